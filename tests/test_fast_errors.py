"""A newcomer's usual mistakes, each through ``python -m simulations.run`` (and :func:`fedsurv.fit`, ``make flwr``,
``python -m simulations.sweep``): the run stops before anything runs, with exit status 2 (an exception for
:func:`fedsurv.fit`) and ONE line (no traceback) that names the file, column or key and says what to do
(:data:`MISTAKES`, :data:`FIT_MISTAKES`), before torch, Ray or Flower is imported. ``benchmarks/error_latency.py``
times the same mistakes (these tests assert no time)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from flwr_app.config import PROJECT_ROOT, ConfigError
from models.data import DataValidationError

#: A usable CSV's rows: time, event (0/1), two numeric features and a category code.
ROWS = 120


def good_csv(path: Path, rows: int = ROWS) -> Path:
    lines = ["time,event,age,bmi,grade"]
    for index in range(rows):
        lines.append(f"{5 + (index * 7) % 60},{int(index % 3 != 0)},{40 + (index * 7) % 35},"
                     f"{18 + (index * 13) % 17}.5,{1 + index % 3}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def text_event_csv(path: Path) -> Path:
    good_csv(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = [line.split(",") for line in lines[1:]]
    text = [",".join([row[0], "dead" if row[1] == "1" else "alive", *row[2:]]) for row in rows]
    path.write_text("\n".join([lines[0], *text]) + "\n", encoding="utf-8")
    return path


def empty_file(path: Path) -> Path:
    path.write_text("", encoding="utf-8")
    return path


def used_directory(path: Path) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text('{"round": 1}\n', encoding="utf-8")
    return path


#: Each mistake: its overrides of ``python -m simulations.run`` (given a temporary folder), and the words its one line
#: must hold (the file, column or key, and the fix).
Mistake = Callable[[Path], tuple[list[str], list[str]]]


def _csv(tmp: Path, *extra: str, make: Callable[[Path], Path] = good_csv, name: str = "site.csv") -> list[str]:
    return ["data=csv", f"data.path={make(tmp / name)}", *extra]


def natural_csv(path: Path) -> Path:
    """A usable CSV with a site column ``centre`` whose site 'C' has 3 records."""
    good_csv(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    centres = ["A"] * 60 + ["B"] * (ROWS - 63) + ["C"] * 3
    path.write_text("\n".join([f"{lines[0]},centre", *(f"{line},{centre}" for line, centre in zip(lines[1:], centres))])
                    + "\n", encoding="utf-8")
    return path


MISTAKES: dict[str, Mistake] = {
    "wrong-time-column": lambda tmp: (_csv(tmp, "data.time_col=duration"), [
        "site.csv", "data.time_col names column 'duration', which the file does not have",
        "columns present: time, event, age, bmi, grade"]),
    "text-event-column": lambda tmp: (_csv(tmp, make=text_event_csv), [
        "site.csv", "column 'event' (data.event_col)", "'dead' (80)", "data.event_values=dead"]),
    "key-typo": lambda tmp: (["federation.round=5"], ["federation.round", "did you mean federation.rounds",
                                                     "docs/configuration.md"]),
    "epsilon-zero": lambda tmp: (["strategy=dp_sgd", "privacy.epsilon=0"], ["'privacy.epsilon' must be > 0"]),
    "rounds-zero": lambda tmp: (["federation.rounds=0"], ["'federation.rounds' must be > 0"]),
    "missing-file": lambda tmp: (["data=csv", f"data.path={tmp / 'nosuch.csv'}"], [
        f"data.path = '{tmp / 'nosuch.csv'}': file not found", "give the path of an existing CSV or Parquet file"]),
    "unknown-strategy": lambda tmp: (["strategy=fedavgg"], ["strategy=fedavgg", "did you mean fedavg"]),
    "unknown-model": lambda tmp: (["model=coxmlp"], ["model=coxmlp", "did you mean cox_mlp"]),
    "negative-learning-rate": lambda tmp: (["train.lr=-0.01"], ["'train.lr' must be > 0"]),
    "unknown-categorical-column": lambda tmp: (_csv(tmp, "data.categorical_cols=[stage]"), [
        "site.csv", "data.categorical_cols names column 'stage', which the file does not have",
        "features: age, bmi, grade"]),
    "empty-file": lambda tmp: (_csv(tmp, make=empty_file), ["site.csv", "empty file",
                                                           "give a file with a header line"]),
    "directory-not-file": lambda tmp: (["data=csv", f"data.path={good_csv(tmp / 'site.csv').parent}"], [
        f"data.path = '{tmp}' is a folder, not a file", "give the CSV or Parquet file inside it (site.csv)"]),
    "used-output-dir": lambda tmp: ([f"output.dir={used_directory(tmp / 'run')}"], [
        "output.dir", "already holds", "resume.from"]),
    "30-row-file": lambda tmp: (_csv(tmp, make=lambda path: good_csv(path, 30)), [
        "site.csv", "30 records cannot give federation.num_sites = 5 sites",
        "use federation.num_sites=3 or fewer"]),
    "40-sites-120-records": lambda tmp: (_csv(tmp, "federation.num_sites=40"), [
        "site.csv", "120 records cannot give federation.num_sites = 40 sites", "use federation.num_sites=12 or fewer"]),
    "200-sites-120-records": lambda tmp: (_csv(tmp, "federation.num_sites=200"), [
        "site.csv", "federation.num_sites = 200", "use federation.num_sites=12 or fewer"]),
    "tiny-natural-site": lambda tmp: (_csv(tmp, "federation.partition=centre", make=natural_csv), [
        "site.csv", "column 'centre' (federation.partition)", "'C' (3)",
        "leave them out with federation.min_site_records=10"]),
}


def command(overrides: list[str], tmp: Path) -> list[str]:
    """``python -m simulations.run`` with ``overrides``, its Hydra directory in ``tmp``."""
    return [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={tmp / 'hydra'}"]


def run_command(argv: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``argv`` from the project root in its own process group, which is killed if it outlives ``timeout_s``."""
    process = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_mistake_stops_the_run_with_one_line_naming_it(tmp_path, name):
    check_one_line(tmp_path, *MISTAKES[name](tmp_path))


def test_a_sweep_refuses_a_typo_before_its_first_job(tmp_path):
    """``python -m simulations.sweep -m`` checks its command line as ``simulations.run`` does, the values of a
    swept group option included."""
    for overrides, line in ((["federation.round=1,2"], "unknown key federation.round; did you mean "
                                                       "federation.rounds? (every key: docs/configuration.md)"),
                            (["strategy=fedavg,dpsgd"], "strategy=dpsgd: no such strategy option; did you mean dp_sgd? "
                                                        "(every strategy option: docs/configuration.md)")):
        result = run_command([sys.executable, "-m", "simulations.sweep", "-m", *overrides,
                              f"hydra.sweep.dir={tmp_path / 'sweep'}"])
        assert result.returncode == 2 and result.stderr.splitlines() == [f"error: run config: {line}"], result.stderr
        assert not (tmp_path / "sweep").exists()


def check_one_line(tmp_path: Path, overrides: list[str], words: list[str]) -> None:
    result = run_command(command(overrides, tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "hydra" / "summary.json").exists()


def test_a_typo_suggests_the_key_and_not_the_whole_list(tmp_path):
    """``+key=value`` (what Hydra advises for a key its config lacks) reaches the schema's check: the same one line."""
    result = run_command(command(["+federation.round=5"], tmp_path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: run config: unknown key federation.round; did you mean federation.rounds? "
        "(every key: docs/configuration.md)"]


def records(rows: int = ROWS) -> pd.DataFrame:
    """:func:`good_csv`'s records as a frame."""
    return pd.DataFrame({"time": [5 + (index * 7) % 60 for index in range(rows)],
                         "event": [int(index % 3 != 0) for index in range(rows)],
                         "age": [40 + (index * 7) % 35 for index in range(rows)]})


#: :func:`fedsurv.fit`'s mistakes (given a temporary folder): its arguments, the exception, and the words of its one
#: line (the file, column or argument, and the fix).
FIT_MISTAKES: dict[str, Callable[[Path], tuple[dict[str, Any], type[Exception], list[str]]]] = {
    "key typo": lambda tmp: ({"data": good_csv(tmp / "site.csv"), "config": {"train.lrr": 0.01}}, ConfigError,
                             ["unknown key train.lrr; did you mean train.lr?"]),
    "missing file": lambda tmp: ({"data": tmp / "nosuch.csv"}, DataValidationError,
                                 [f"data = '{tmp / 'nosuch.csv'}': file not found",
                                  "give the path of an existing CSV or Parquet file"]),
    "folder": lambda tmp: ({"data": good_csv(tmp / "site.csv").parent}, DataValidationError,
                           [f"data = '{tmp}' is a folder, not a file", "give the CSV or Parquet file inside it"]),
    "frame: wrong time column": lambda tmp: ({"data": records(), "time_col": "duration"}, DataValidationError, [
        "the DataFrame given to fedsurv.fit: time_col names column 'duration', which the file does not have",
        "columns present: time, event, age"]),
    "frame: too few records for the sites": lambda tmp: ({"data": records(30)}, DataValidationError, [
        "the DataFrame given to fedsurv.fit: 30 records cannot give sites = 5 sites", "use sites=3 or fewer"]),
    "file: more sites than records": lambda tmp: ({"data": good_csv(tmp / "site.csv"), "sites": 200},
                                                  DataValidationError, [
        f"{tmp / 'site.csv'}: 120 records cannot give sites = 200 sites", "use sites=12 or fewer"]),
}


@pytest.mark.parametrize("name", list(FIT_MISTAKES))
def test_fit_refuses_a_mistake_in_one_line_before_writing_anything(tmp_path, name):
    import fedsurv

    arguments, error, words = FIT_MISTAKES[name](tmp_path)
    with pytest.raises(error) as caught:
        fedsurv.fit(**arguments, output_dir=tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message and type(caught.value) is error, message
    for word in words:
        assert word in message, (word, message)
    assert not (tmp_path / "run" / "input.parquet").exists() and not (tmp_path / "run" / "config.json").exists()


def test_fit_refuses_before_importing_torch_ray_or_flower(tmp_path):
    """``import fedsurv`` and a refused :func:`fedsurv.fit` (a typo, a missing file, a bad frame) import neither
    torch, Ray nor Flower (a new interpreter: this one has imported them)."""
    code = f"""
import sys
import pandas as pd
import fedsurv
from fedsurv import fit
frame = pd.DataFrame({{"time": [1.0] * 30, "event": [1] * 30, "age": range(30)}})
for arguments in ({{"data": {str(good_csv(tmp_path / "site.csv"))!r}, "config": {{"train.lrr": 0.01}}}},
                  {{"data": {str(tmp_path / "nosuch.csv")!r}}}, {{"data": frame}}, {{"data": frame, "time_col": "t"}}):
    try:
        fit(**arguments, output_dir={str(tmp_path / "run")!r})
    except ValueError:
        pass
    else:
        sys.exit("not refused")
print(sorted(name for name in ("torch", "ray", "flwr") if name in sys.modules))
"""
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-3000:]


def test_make_flwr_refuses_a_used_output_dir_before_flower_starts(tmp_path):
    """``make flwr`` checks the run config first (``python -m flwr_app.config --check-run``): a second run into the
    same ``output.dir`` stops with the reason in one line and exit status 2, and ``flwr run`` is not started."""
    used = used_directory(tmp_path / "run")
    venv = Path(sys.executable).parent.parent
    result = run_command(["make", "-s", "flwr", f"VENV={venv}", f"FLWR_HOME={tmp_path / 'flwr_home'}",
                          "-o", f"{venv}/.installed", "-o", f"{venv}/.flwr-env",
                          f"RUN_CONFIG=federation.rounds=1 output.dir='{used}'"])
    assert result.returncode == 2, result.stderr[-3000:]
    first, *rest = result.stderr.strip().splitlines()
    assert first == (f"error: run config: output.dir = '{used}' already holds a run (metrics.jsonl); choose a new "
                     f"directory, or continue that run with resume.from = '{used}'")
    # make's own closing line ("make[1]: ***" when the suite itself runs under make, as `make test` does)
    assert all(re.match(r"make(\[\d+\])?: \*\*\*", line) for line in rest), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "flwr_home").exists() and result.stdout == ""


def test_check_run_suggests_the_key_of_a_flwr_run_config(tmp_path):
    result = run_command([sys.executable, "-m", "flwr_app.config", "--check-run", "federation.round=5 train.lrr=0.1"])
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: run config: unknown keys federation.round (did you mean federation.rounds?), train.lrr (did you mean "
        "train.lr?); every key: docs/configuration.md"]


def test_the_defaults_are_the_ones_flower_fuses():
    """:func:`flwr_app.config.project_run_config` reads pyproject.toml as Flower does (without importing it)."""
    from flwr.common.config import get_fused_config_from_dir

    from flwr_app.config import project_run_config, resolve

    assert project_run_config() == get_fused_config_from_dir(PROJECT_ROOT, {})
    overrides = {"federation.rounds": 3, "data.name": "gbsg"}
    assert resolve(overrides)[0] == get_fused_config_from_dir(PROJECT_ROOT, overrides)
