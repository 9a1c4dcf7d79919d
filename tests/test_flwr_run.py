"""`flwr run .` executes the same app with the same run-config keys (through a local SuperLink)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flwr_app.config import PROJECT_ROOT

pytestmark = pytest.mark.slow


def superlinks_of(flwr_home: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "flower-superlink" in cmdline and str(flwr_home) in cmdline:
            found.append(process)
    return found


def test_flwr_run_trains_with_the_run_config(tmp_path):
    """METABRIC: a bundled CSV, which the app bundle ``flwr run`` builds does not carry (the installed copy is read)."""
    flwr = shutil.which("flwr", path=str(Path(sys.executable).parent))
    assert flwr, "the flwr CLI is installed with the project"
    flwr_home = tmp_path / "flwr_home"
    out = tmp_path / "run"
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        result = subprocess.run(
            [flwr, "run", ".", "local", "--stream",
             "--run-config", f"data.name='metabric' federation.num_sites=3 federation.rounds=2 output.dir='{out}' "
                            "model.name='cox_mlp'",
             "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=500,
        )
        # `flwr run --stream` exits 0 even when the run failed: check the run's status too.
        listing = subprocess.run([flwr, "ls", "local", "--format", "json"], cwd=PROJECT_ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
    finally:
        for process in superlinks_of(flwr_home):
            process.terminate()
            process.wait(timeout=30)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(listing.stdout)["runs"]
    assert runs and all(run["status"] == "finished:completed" for run in runs), runs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "cox_mlp" and summary["rounds"] == 2 and summary["num_sites"] == 3
    assert summary["data"]["name"] == "metabric" and summary["test"]["c_index"] > 0.58
    assert not superlinks_of(flwr_home)


def test_flwr_run_from_the_activated_environment_without_a_deprecation_warning(tmp_path):
    """As Flower's quickstarts: `source .venv/bin/activate; flwr run . --stream --federation-config
    "num-supernodes=5"`, with the activate script and the Flower configuration that make writes (here into a copy
    of the activate script and a temporary FLWR_HOME, on a free port): the 5 default sites all train, and Flower
    warns of no deprecated setting (the configuration names the SuperLink only, no `options.`)."""
    import socket

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(Path(sys.executable).parent / "activate", venv / "bin" / "activate")
    (venv / ".installed").touch()
    flwr_home = tmp_path / "flwr_home"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    subprocess.run(["make", "-s", f"VENV={venv}", f"FLWR_HOME={flwr_home}", f"LOCAL_SUPERLINK_PORT={port}",
                    "-o", f"{venv}/.installed", f"{venv}/.flwr-env"], cwd=PROJECT_ROOT, check=True, timeout=60)
    written = (flwr_home / "config.toml").read_text()
    assert 'address = ":local:"' in written and "options." not in written
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    try:
        result = subprocess.run(
            ["bash", "-c", f"source {venv}/bin/activate && flwr run . --stream --run-config "
                           f"\"federation.rounds=1 baseline.centralized=false output.dir='{out}'\" "
                           "--federation-config \"num-supernodes=5\""],
            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=500)
    finally:
        for process in superlinks_of(flwr_home):
            process.terminate()
            process.wait(timeout=30)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "deprecated" not in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_sites"] == 5 and len(summary["sites"]) == 5 and summary["test"]["c_index"] > 0.75
