"""The warm ClientApp executor (flwr_app/executor.py) without a SuperNode, and the Flower entry points it needs.

The task loop runs against a fake Runtime API: each task's child gets its own token, a child that
raises, exits or is killed is reaped with that status and the parent serves the next task, a child
leaves without running the parent's ``atexit`` handlers, and a child still running when the loop
stops is terminated. ``tests/test_deployment.py`` runs the executor against real SuperNodes.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import os
import signal
import subprocess
import sys
import time

import flwr
import pytest

from flwr_app import executor, flower_entry


def test_the_flower_entry_points_exist_with_the_signatures_they_were_tested_with():
    """Fails on a Flower upgrade until the executor is checked against it (then add the version)."""
    assert flwr.__version__ in flower_entry.TESTED_FLOWER_VERSIONS, (
        f"Flower {flwr.__version__} is installed; flwr_app/flower_entry.py was tested with "
        f"{flower_entry.TESTED_FLOWER_VERSIONS}: run tests/test_executor.py and tests/test_deployment.py, then add it")
    for dotted, expected in flower_entry.SIGNATURES.items():
        assert str(inspect.signature(_resolve(dotted))) == expected, dotted


def _resolve(dotted: str) -> object:
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return target
    raise ImportError(dotted)


def _serve(folder):
    """What a child does with its token: record it, then end as the token says."""
    def serve(token: str) -> None:
        (folder / f"{token}.{os.getpid()}").write_text(str(os.getppid()))
        if token == "raise":
            raise RuntimeError("the ClientApp failed")
        if token == "exit3":
            sys.exit(3)  # what Flower's flwr_exit does at the end of run_clientapp
        if token == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if token == "hang":
            time.sleep(600)
    return serve


def test_each_task_is_served_in_its_own_child_and_a_crashed_child_is_reaped_while_the_parent_goes_on(tmp_path):
    tasks = iter([(1, "kill"), None, (2, "raise"), (3, "exit3"), (4, "ok"), (5, "hang")])
    ran_atexit = tmp_path / "atexit"

    def acquire():
        if (found := next(tasks, None)) == (2, "raise"):
            raise ConnectionError("the SuperNode is restarting")  # logged and retried
        return found

    def mark() -> None:
        ran_atexit.write_text(str(os.getpid()))

    atexit.register(mark)
    deadline = time.monotonic() + 3
    try:
        ended = executor.serve_tasks(acquire, _serve(tmp_path), poll_s=0.01,
                                     keep_going=lambda: time.monotonic() < deadline)
    finally:
        atexit.unregister(mark)
    outcome = {end.task_id: end.returncode for end in ended}
    assert outcome == {1: -signal.SIGKILL, 3: 3, 4: 0, 5: -signal.SIGTERM}
    served = sorted(path.name.split(".")[0] for path in tmp_path.iterdir())
    assert served == ["exit3", "hang", "kill", "ok"]  # the task acquire failed on never reached a child
    assert {int(path.read_text()) for path in tmp_path.iterdir()} == {os.getpid()}  # forked from this process
    assert {int(path.name.split(".")[1]) for path in tmp_path.iterdir()} == {end.pid for end in ended}
    assert not ran_atexit.exists()  # os._exit: no child ran the parent's exit handlers
    assert not [pid for pid in (end.pid for end in ended) if os.path.exists(f"/proc/{pid}")]  # all reaped


def test_a_child_that_raises_exits_with_1_and_reports_it():
    pid = executor.serve_in_child(lambda token: 1 / 0, "token")
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1


def test_the_executor_follows_its_parent_and_refuses_a_missing_runtime_option():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert executor.parent_alive(os.getpid()) and executor.parent_alive(None)
    assert not executor.parent_alive(gone.pid)
    with pytest.raises(SystemExit):
        executor._arguments(["--insecure"])
    with pytest.raises(SystemExit):
        executor._arguments(["--runtime-api-address", "127.0.0.1:9094"])  # neither --insecure nor a certificate


def test_the_loopback_benchmark_reads_each_messages_phases_from_a_supernodes_log():
    from benchmarks.loopback import phase_medians

    def line(second: float, text: str) -> str:
        return f"\x1b[92mINFO 2026-11-29 04:28:{second:06.3f}\x1b[0m:      {text}".replace(".", ",", 1)

    log = "\n".join([
        line(1.0, "Receiving: train message (ID: a)"), line(1.5, "Start `flwr-clientapp` process"),
        line(2.0, "[flwr-clientapp] Start `ClientApp` Loading."), line(3.0, "Runtime.PushMessages"),
        line(3.5, "Sending: train message (ID: b)"), line(4.0, "Sent successfully"),
        line(7.0, "Receiving: train message (ID: c)"), line(7.25, "Start `flwr-clientapp` process"),
        line(7.5, "[flwr-clientapp] Start `ClientApp` Loading."), line(8.0, "Runtime.PushMessages"),
        line(8.5, "Sending: train message (ID: d)"), line(9.0, "Sent successfully"),
        line(10.0, "Receiving: evaluate message (ID: e)"), line(10.5, "Start `flwr-clientapp` process")])
    assert phase_medians([log]) == {"train": {  # the first train message is the first round's: left out
        "messages": 1, "runtime_start_s": 0.25, "fetch_and_install_s": 0.25, "imports_and_handling_s": 0.5,
        "reply_to_supernode_s": 0.5, "upload_s": 0.5, "own_s": 1.0, "idle_s": 3.0, "idle_min_s": 3.0}}
