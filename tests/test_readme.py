"""README.md as a newcomer reads it: short, its links resolve, and every command and Python block it
shows runs as written, in a copy of the checkout (nothing beside it), without an activated environment.

The one command not run here: `make test`, which runs this suite (it would run itself).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flwr_app.config import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
DOCS = PROJECT_ROOT / "docs"
NOT_RUN = {"make test": "runs this test suite, so running it here would run the suite inside itself"}
# Each command README.md shows is run by the fixture below according to its first words.
RUNNERS = ("pip install", "make demo", "make flwr")
VENV = Path(sys.executable).parent.parent
LOCAL_SUPERLINK_PORT = 39091


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands() -> list[str]:
    """Every shell command of README.md's bash blocks, in order, without its comment."""
    commands = []
    for block in code_blocks(readme_text(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
            if command:
                commands.append(command)
    return commands


def test_readme_is_under_12_kb():
    size = len(README.read_bytes())
    assert size < 12_000, f"README.md is {size} bytes"


def test_every_readme_command_is_run_by_this_test():
    commands = readme_commands()
    assert "make demo" in commands and "make test" in commands
    assert commands[:2] == ["make demo", "make test"], "the two commands come first"
    unhandled = [c for c in commands if c not in NOT_RUN and not c.startswith(RUNNERS)]
    assert not unhandled, f"README.md shows commands tests/test_readme.py does not run: {unhandled}"
    assert len(code_blocks(readme_text(), "python")) == 1


def _links(page: Path) -> list[Path]:
    text = page.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [(page.parent / target.split("#")[0]).resolve() for target in targets
            if not re.match(r"[a-z]+://", target) and not target.startswith("#")]


def test_readme_and_docs_links_resolve():
    pages = [README] + [DOCS / name for name in ("tutorial.md", "privacy-methods.md", "deployment.md",
                                                   "architecture.md")] + sorted((DOCS / "howto").glob("*.md"))
    missing = {link for page in pages for link in _links(page) if not link.exists()}
    assert not missing, f"links to missing files: {sorted(str(p) for p in missing)}"


def test_readme_results_table_is_the_reports():
    """The README's table is copied from the generated docs/results.md: a rerun of the report that
    changes a figure makes this fail until the README is updated too."""
    rows = [line for line in readme_text().splitlines() if line.startswith("| ")]
    assert len(rows) >= 4
    report = (DOCS / "results.md").read_text(encoding="utf-8").splitlines()
    start = report.index(rows[0])
    assert report[start:start + len(rows)] == rows
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme_text())
    assert len(figures) == 1 and (PROJECT_ROOT / figures[0]).stat().st_size > 10_000


# --- the commands themselves (slow: Flower simulations through Ray, a pip install) -------------------

def _local_superlinks(flwr_home: Path) -> list[psutil.Process]:
    found = []
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == LOCAL_SUPERLINK_PORT and connection.pid:
            process = psutil.Process(connection.pid)
            if f"{flwr_home}/local-superlink/" in " ".join(process.cmdline()):
                found.append(process)
    return found


def _copy_checkout(destination: Path) -> Path:
    ignored = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", ".flwr_home", ".pytest_cache",
                                     "__pycache__", "*.egg-info")
    shutil.copytree(PROJECT_ROOT, destination, ignore=ignored)
    return destination


def _environment_without_venv() -> dict:
    """The caller's environment with no activated virtual environment: no VIRTUAL_ENV, and no venv's
    bin/ on PATH (the README's commands must not need one)."""
    # nor the variables of a make that runs this suite: `make test ARGS="-m slow"` exports ARGS (and
    # MAKEFLAGS) to its recipe, and the README's `make demo` would read them as if the user had typed them
    makefile = (PROJECT_ROOT / "Makefile").read_text(encoding="utf-8")
    make_variables = set(re.findall(r"\$\(([A-Z_]+)\)", makefile)) | {"MAKEFLAGS", "MFLAGS", "MAKELEVEL",
                                                                     "MAKEOVERRIDES"}
    # and no PYTHONPATH: Ray, started by an earlier test of this process, puts the checkout on it
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "FLWR_HOME", "PYTHONPATH", *make_variables} and not k.startswith("RAY_")}
    path = [p for p in env.get("PATH", "").split(os.pathsep)
            if p and not (Path(p) / "activate").exists() and Path(p).resolve() != (VENV / "bin").resolve()]
    env["PATH"] = os.pathsep.join(path)
    return env


def _run(command: str, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    if command.startswith("make"):
        # The environment is the one running these tests (make's own target would install a new one):
        # the same venv, its install marked as done.
        command += f" VENV={VENV} -o {VENV}/.installed"
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _pip_environment(tmp: Path, name: str) -> tuple[Path, dict]:
    """A new virtual environment ``name`` that sees the installed dependencies (through a .pth file) but not
    the project: `pip install -e .` must install the project alone and download nothing else."""
    venv = tmp / name
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    inherited = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site_packages / "_inherited.pth").write_text("\n".join(inherited) + "\n")
    env = _environment_without_venv()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return venv, env


def _output_dir(command: str) -> str | None:
    named = re.search(r"output\.dir='?([^\s\"']+)", command)
    return named.group(1) if named else None


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Runs every README command but `make test`, in order, in a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("readme")
    checkout = _copy_checkout(tmp / "fedsurv")
    env = _environment_without_venv()
    results = {}
    try:
        for command in readme_commands():
            if command in NOT_RUN:
                continue
            if command.startswith("pip install"):
                venv, pip_env = _pip_environment(tmp, f"pip-venv-{len(results)}")
                results[command] = (_run(command, checkout, pip_env, timeout=600), venv)
            else:
                results[command] = (_run(command, checkout, env, timeout=900), None)
    finally:
        for process in _local_superlinks(checkout / ".flwr_home"):  # only if `make flwr-stop` did not
            process.terminate()
            process.wait(timeout=30)
    return checkout, results


@pytest.mark.slow
def test_readme_commands_run_as_written(readme_run):
    checkout, results = readme_run
    for command, (result, venv) in results.items():
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if command.startswith("pip install"):
            installed = re.search(r"Successfully installed (.*)", result.stdout).group(1).split()
            # The project and at most pip's own tools (the new venv's setuptools may be older than a
            # dependency asks): nothing of the stack (torch, flwr, ...) is downloaded again.
            assert "fedsurv-0.1.0" in installed, result.stdout[-2000:]
            assert all(p.startswith(("fedsurv-", "setuptools-", "pip-", "wheel-")) for p in installed), installed
            where = subprocess.run([str(venv / "bin" / "python"), "-c", "import models, simulations.hydra_config as h; "
                                    "print(models.__file__, h.CONF_DIR.is_dir())"],
                                   cwd=venv, env=_environment_without_venv(), capture_output=True, text=True,
                                   timeout=120)
            # an editable install runs the checkout; a wheel its own copy, with Hydra's conf/ inside
            home = checkout if " -e " in f"{command} " else venv
            assert where.stdout.startswith(str(home)) and where.stdout.split()[-1] == "True", where.stdout + where.stderr
        elif command.startswith("make demo") or command.startswith("make flwr RUN_CONFIG"):
            named = _output_dir(command)
            summaries = ([checkout / named / "summary.json"] if named else
                         [s for s in (checkout / "outputs").glob("**/summary.json")
                          if not any(s.is_relative_to(checkout / d) for d in map(_output_dir, results) if d)])
            assert len(summaries) == 1 and summaries[0].exists(), f"{command}: no summary.json ({summaries})"
            summary = json.loads(summaries[0].read_text())
            assert summary["test"]["c_index"] > 0.55, (command, summary["test"])
    flwr = next(result for command, (result, _) in results.items() if command.startswith("make flwr RUN_CONFIG"))
    assert "flwr run: finished:completed" in flwr.stdout
    flwr_home = checkout / ".flwr_home"
    # No second environment: the SuperLink did not install the app's dependencies for the run.
    assert not list(flwr_home.glob("**/runtime-envs")), "Flower built a runtime environment"
    assert "Installing application dependencies" not in (flwr_home / "local-superlink" / "superlink.log").read_text()
    stop = results["make flwr-stop"][0]
    assert "stopped the local SuperLink" in stop.stdout and not _local_superlinks(flwr_home)


def test_readme_python_example_is_at_most_10_lines():
    (block,) = code_blocks(readme_text(), "python")
    assert len(block.strip().splitlines()) <= 10


@pytest.mark.slow
def test_readme_python_example_fits_scores_and_predicts(readme_run, monkeypatch, capsys):
    """DataFrame -> federated model (Flower on Ray) -> C-index and survival curves on held-out rows."""
    checkout, results = readme_run
    assert all(result.returncode == 0 for result, _ in results.values())
    (block,) = code_blocks(readme_text(), "python")
    monkeypatch.chdir(checkout)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    scores = namespace["run"].score(namespace["held_out"])
    assert scores["c_index"] > 0.55 and scores["ibs"] < 0.25, scores
    assert repr(scores) in capsys.readouterr().out  # the example prints the same scores
    curves = namespace["curves"]
    assert curves.shape[0] == 5 and curves.shape[1] >= 2
    values = curves.to_numpy()
    assert ((values >= 0) & (values <= 1)).all()
    assert (values[:, 1:] <= values[:, :-1] + 1e-9).all(), "a survival curve increases"
    assert (checkout / "outputs" / "api" / "calibration.png").stat().st_size > 10_000
