"""A run's ``run.log``, its one-line errors, and the output directory of another run (refused).

The runs use the in-process engine (the real ServerApp and ClientApp over ``InProcessGrid``), so
``run.log`` is written as under ``flwr run``: by the ServerApp itself, without Hydra.
"""

from __future__ import annotations

import json
import sys
import threading

import pytest

from flwr_app import runlog
from flwr_app.config import ConfigError
from flwr_app.outputs import RunOutputs
from simulations.engine import resolve, run_inprocess
from simulations.run import describe_failure
from strategies.horizontal import TooFewSitesError

SMALL = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False}


def test_run_log_holds_what_the_server_printed(tmp_path, capsys):
    run_inprocess({**SMALL, "output.dir": str(tmp_path)})
    printed = capsys.readouterr().out.splitlines()
    log = (tmp_path / "run.log").read_text(encoding="utf-8").splitlines()
    assert log == printed  # the console still shows everything; the log holds the same lines
    assert [line[:11] for line in log if line.startswith("round")] == ["round   1/2", "round   2/2"]
    assert log[-1] == f"outputs: {tmp_path}" and any(line.startswith("final test") for line in log)
    assert not isinstance(sys.stdout, runlog._Tee)  # stdout is given back after the run


def test_a_failed_run_is_one_line_with_the_traceback_in_run_log(tmp_path):
    overrides = {**SMALL, "output.dir": str(tmp_path), "federation.min_sites": 3, "debug.fail_site": "site-1"}
    with pytest.raises(TooFewSitesError) as failed:
        run_inprocess(overrides)
    message, code = describe_failure(failed.value, resolve(overrides)[0])
    assert code == 1 and "\n" not in message
    assert message.startswith("error: TooFewSitesError: round 1: 2 of 3 sites' updates accepted")
    assert message.endswith(f"(traceback in {tmp_path / 'run.log'})")
    log = (tmp_path / "run.log").read_text(encoding="utf-8")
    assert log.startswith("fedsurv: fedavg") and "round   1/2" in log
    assert "error: TooFewSitesError: round 1" in log and "Traceback (most recent call last)" in log
    assert "injected failure (debug.fail_site = 'site-1')" in log  # the whole chain, down to the site's error
    assert runlog.log_path(failed.value) == tmp_path / "run.log"


def test_configuration_errors_and_stops_are_one_line_with_their_exit_code(tmp_path):
    flat = resolve({"output.dir": str(tmp_path)})[0]
    assert describe_failure(ConfigError("run config: 'train.lr' must be a number, got nan"), flat) == \
        ("error: run config: 'train.lr' must be a number, got nan", 2)
    assert describe_failure(KeyboardInterrupt(), flat) == ("stopped: SIGINT", 130)
    assert describe_failure(RuntimeError("first line\nsecond line"), flat) == ("error: RuntimeError: first line ...", 1)
    message, _ = describe_failure(RuntimeError("x" * 1000), flat)
    assert message == f"error: RuntimeError: {'x' * 300} ..."


def test_only_the_attached_thread_is_logged_and_an_error_is_written_once(tmp_path):
    def other():
        print("from another thread")

    (tmp_path / "outer").mkdir()
    with pytest.raises(ValueError), runlog.run_log(tmp_path / "outer"):
        with runlog.run_log(tmp_path):
            print("from the run")
            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
            raise ValueError("bad value")
    log = (tmp_path / "run.log").read_text(encoding="utf-8")
    assert log.startswith("from the run\nerror: ValueError: bad value\nTraceback")
    assert "from another thread" not in log
    assert not (tmp_path / "outer" / "run.log").read_text(encoding="utf-8")  # written by the inner block only


def test_logged_functions_write_nothing_until_attached(tmp_path):
    @runlog.logged
    def main(attach: bool) -> None:
        print("before")
        if attach:
            runlog.attach(tmp_path)
        print("after")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        main(False)
    assert not (tmp_path / "run.log").exists()
    with pytest.raises(RuntimeError):
        main(True)
    assert (tmp_path / "run.log").read_text(encoding="utf-8").startswith("after\nerror: RuntimeError: crash\n")
    with pytest.raises(RuntimeError, match="runlog.logged"):
        runlog.attach(tmp_path)


@pytest.mark.parametrize("held", ["config.json", "metrics.jsonl", "ledger.jsonl", "checkpoint.pt", "summary.json"])
def test_a_directory_that_holds_a_run_is_refused_unless_resumed(tmp_path, held):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "run.log").write_text("Hydra's or an earlier attempt's log\n")
    cfg = resolve({**SMALL, "output.dir": str(tmp_path)})[1]
    assert RunOutputs.create(cfg).directory == tmp_path  # Hydra's files only: fine
    (tmp_path / held).write_text("{}\n")
    with pytest.raises(ConfigError, match=f"already holds a run \\({held}\\).*resume.from = '{tmp_path}'"):
        RunOutputs.create(cfg)


def test_a_second_run_into_the_same_directory_is_refused_and_changes_nothing(tmp_path):
    run_inprocess({**SMALL, "output.dir": str(tmp_path)})
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="already holds a run"):
        run_inprocess({**SMALL, "output.dir": str(tmp_path)})
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
