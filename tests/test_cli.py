"""The Hydra entry point stops bad input with a message naming the file and the problem."""

import subprocess
import sys

import pytest

from flwr_app.config import PROJECT_ROOT

GOOD = "time,event,age\n10,1,50\n12,0,61\n30,1,70\n44,0,35\n"


def run_cli(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (GOOD.replace("12,0,61", "-12,0,61"), "negative"),
        (GOOD.replace("30,1,70", "30,2,70"), "event"),
        (GOOD.replace("time,", "duration,"), "time"),
    ],
    ids=["negative-time", "event-2", "missing-time-column"],
)
def test_bad_csv_stops_with_file_and_problem(tmp_path, content, problem):
    path = tmp_path / "site.csv"
    path.write_text(content)
    result = run_cli(tmp_path / "run", "data=csv", f"data.path={path}", "data.time_col=time", "data.event_col=event")
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error:") and str(path) in message and problem in message
    assert "Traceback" not in result.stderr


def test_bad_config_value_names_the_key(tmp_path):
    result = run_cli(tmp_path, "federation.rounds=0")
    assert result.returncode == 2
    assert "'federation.rounds' must be > 0" in result.stderr


@pytest.mark.parametrize("override", ["train.lr=nan", "privacy.clip_norm=nan", "federation.timeout_s=nan"])
def test_nan_is_one_line_naming_the_key(tmp_path, override):
    result = run_cli(tmp_path, override)
    key = override.split("=")[0]
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: run config: '{key}' must be a number, got nan"]


def test_a_directory_that_holds_a_run_is_refused_in_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    result = run_cli(tmp_path, "federation.rounds=1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: run config: output.dir = '{tmp_path}' already holds a run (metrics.jsonl); choose a new directory, "
        f"or continue that run with resume.from = '{tmp_path}'"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"round": 1}\n'


@pytest.mark.parametrize("override", ["data=nosuch", "federation.nosuch=1"])
def test_hydras_own_configuration_errors_exit_2_too(tmp_path, override):
    """An unknown config group option or key is reported by Hydra before any run starts; it exits 2, as every
    configuration error does (a run that fails while running exits 1)."""
    result = run_cli(tmp_path, override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
