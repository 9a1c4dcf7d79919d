"""Stopping a run with SIGINT or SIGTERM: after the round in progress, with its checkpoint, resumable.

The fast tests inject the stop request that a signal makes (:func:`flwr_app.interrupt.request`)
into runs of the real ServerApp and ClientApp over the in-process grid, and check the signal
handlers themselves in this process. The slow test sends SIGINT to ``python -m simulations.run``
(Flower's simulation engine, Ray) as Ctrl-C in a terminal does: to its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flwr_app import interrupt
from flwr_app.config import PROJECT_ROOT
from simulations.engine import run_inprocess
from strategies.mechanisms.embedding_dp import embedding_epsilon

SMALL = {"federation.num_sites": 3, "federation.rounds": 3, "baseline.centralized": False}


@pytest.fixture(autouse=True)
def no_stop_request():
    interrupt.clear()
    yield
    interrupt.clear()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _request_during(server_round: int, signum: int):
    """An ``observe`` for :class:`InProcessGrid`: request a stop when round ``server_round``'s first reply comes."""

    def observe(message, reply):
        if message.metadata.message_type == "train" and message.content["config"]["server-round"] == server_round:
            interrupt.request(signum)

    return observe


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, run_inprocess({**SMALL, "output.dir": str(out)})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_ends_the_run_after_the_round_and_resuming_gives_the_uninterrupted_run(uninterrupted, tmp_path, signum):
    """Stopped during round 1 and again during the last round, resumed twice: the same model as without stops."""
    full_dir, full = uninterrupted
    with pytest.raises(interrupt.StopRequested) as stopped:
        run_inprocess({**SMALL, "output.dir": str(tmp_path)}, observe=_request_during(1, signum))
    assert (stopped.value.signum, stopped.value.completed, stopped.value.exit_code) == (signum, 1, 128 + signum)
    assert f"resume.from={tmp_path}" in str(stopped.value)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["round"] == 1
    assert [line["round"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "summary.json").exists()
    log = (tmp_path / "run.log").read_text(encoding="utf-8").splitlines()
    assert log[-2].startswith("round   1/3") and log[-1] == f"stopped: {stopped.value}"

    interrupt.clear()
    with pytest.raises(interrupt.StopRequested) as stopped:  # the last round: its checkpoint, but no results yet
        run_inprocess({**SMALL, "resume.from": str(tmp_path)}, observe=_request_during(3, signum))
    assert stopped.value.completed == 3 and not (tmp_path / "summary.json").exists()

    interrupt.clear()
    resumed = run_inprocess({**SMALL, "resume.from": str(tmp_path)})
    assert resumed["resumed_after_round"] == 3
    assert [line["round"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert _read_jsonl(tmp_path / "ledger.jsonl") == _read_jsonl(full_dir / "ledger.jsonl")
    models = [torch.load(path / "model.pt", weights_only=False)["state_dict"] for path in (tmp_path, full_dir)]
    assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])  # each round is seeded
    assert resumed["test"] == pytest.approx(full["test"], rel=1e-9)


def test_an_entry_point_of_in_process_runs_stops_after_the_round_on_sigterm_and_starts_no_other_run(tmp_path, capsys):
    """A sweep or benchmark (``interrupt.run_stoppable``) sent SIGTERM during its first run's round 2: that run stops
    after round 2 with its checkpoint, the second run never starts, and the entry point returns 143."""
    started, sent = [], []

    def kill_during_round_2(message, reply):
        if message.metadata.message_type == "train" and message.content["config"]["server-round"] == 2 and not sent:
            sent.append(True)  # once: a second signal would stop the run at once
            os.kill(os.getpid(), signal.SIGTERM)

    def main():
        for index in range(2):
            started.append(index)
            run_inprocess({**SMALL, "output.dir": str(tmp_path / str(index))}, observe=kill_during_round_2)

    assert interrupt.run_stoppable(lambda: {"rows": 3}) == 0 and interrupt.run_stoppable(lambda: 2) == 2  # no stop
    previous = signal.getsignal(signal.SIGTERM)
    assert interrupt.run_stoppable(main) == 143
    assert signal.getsignal(signal.SIGTERM) is previous  # the handlers come back
    assert started == [0]
    assert torch.load(tmp_path / "0" / "checkpoint.pt", weights_only=True)["round"] == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # the stop's own message: where it stopped, how to go on
        f"stopped: SIGTERM: the run stopped after round 2 of 3; continue it with the same settings and "
        f"resume.from={tmp_path / '0'}; what was written up to then is kept")


def test_a_split_run_stops_between_epochs_with_its_ledger_counting_what_was_sent(tmp_path):
    """The round trip that ends epoch 1 also carries epoch 2's first batch: epoch 1's ledger counts 2 releases."""
    tiny = {"strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
            "model.name": "bayesian_multisurv", "model.num_durations": 10, "federation.rounds": 3,
            "train.batch_size": 64, "split.embedding_dim": 16, "split.encoder_layers": 1, "split.head_layers": 1,
            "split.mc_samples": 4, "privacy.epsilon": 8.0, "output.dir": str(tmp_path)}
    with pytest.raises(interrupt.StopRequested, match="after epoch 1 of 3.*cannot be resumed") as stopped:
        run_inprocess(tiny, observe=lambda message, reply: interrupt.request(signal.SIGINT))  # from its first message
    assert stopped.value.completed == 1
    assert [line["round"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "model.pt").exists()
    ledger = _read_jsonl(tmp_path / "ledger.jsonl")
    assert {entry["round"] for entry in ledger} == {1}
    sites = [entry for entry in ledger if entry["site"] != "all modalities"]
    assert len(sites) == 3 and all(entry["steps"] == 2 for entry in sites)
    for entry in sites:
        assert entry["epsilon"] == pytest.approx(embedding_epsilon(
            noise_multiplier=entry["noise_multiplier"], epochs=2, delta=entry["delta"], adjacency=entry["adjacency"]))


def _wait_for_signal() -> None:
    time.sleep(0.05)  # Python runs the handler at the main thread's next check


def test_the_first_signal_requests_a_stop_and_a_second_stops_at_once_only_while_the_run_runs():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupt.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_signal()
        assert interrupt.requested() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # outside at_once_allowed (clean-up): ignored
        _wait_for_signal()
        with pytest.raises(interrupt.Interrupted) as interrupted, interrupt.at_once_allowed():
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_signal()
        assert interrupted.value.exit_code == 130 and isinstance(interrupted.value, KeyboardInterrupt)
        with pytest.raises(interrupt.StopRequested, match="SIGTERM: the run stopped after round 2 of 5"):
            interrupt.raise_if_requested(2, of=5, directory=Path("/run"))
        with interrupt.at_once_allowed():  # the ServerApp has stopped: what is left is clean-up
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_signal()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    interrupt.clear()
    interrupt.raise_if_requested(1, of=5, directory=Path("/run"))  # no request: nothing happens


def test_a_signal_is_noted_at_once_while_the_main_thread_is_blocked_in_c_code():
    """Python runs handlers in the main thread only, between bytecodes; Flower's runtime blocks it in C calls for
    whole rounds, so the stop request must not wait for the handler (the wakeup fd's watcher notes it)."""
    import hashlib

    seen = []

    def later() -> None:
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        seen.append(interrupt.requested())

    with interrupt.stop_on_signals():
        sender = threading.Thread(target=later)
        sender.start()
        started = time.monotonic()
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 3_000_000)  # C code, GIL released: no handler runs till it returns
        blocked_s = time.monotonic() - started
        sender.join()
    interrupt.clear()
    assert blocked_s > 0.4, "the C call returned too soon to tell"
    assert seen == [signal.SIGINT]


def test_stop_on_signals_outside_the_main_thread_changes_nothing():
    seen = []

    def body():
        with interrupt.stop_on_signals():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


_RAY_SIGTERM = """
import os, signal, time
import ray
from flwr_app import interrupt
from simulations import engine

with interrupt.stop_on_signals():
    ours = signal.getsignal(signal.SIGTERM)
    with engine._ray_started(log_to_driver=False):
        started = ray.is_initialized()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
        print(started, signal.getsignal(signal.SIGTERM) is ours, interrupt.requested() == signal.SIGTERM)
    print(ray.is_initialized())
"""


def test_flowers_ray_backend_uses_a_ray_that_is_already_initialised_as_it_is():
    """The Ray engine starts Ray itself (``simulations.engine._ray_started``) so that it can set its signal handlers
    again after ``ray.init``: that relies on Flower's backend calling ``ray.init`` only when Ray is not running."""
    import inspect

    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    source = inspect.getsource(RayBackend.init_ray)
    assert source.count("ray.init(") == 1 and "if not ray.is_initialized():" in source


@pytest.mark.slow
def test_a_sigterm_after_ray_init_reaches_the_stop_handler_and_the_process_lives_on():
    """``ray.init`` sets Python and native SIGTERM handlers that end the process; inside the Ray engine's start
    (``simulations.engine._ray_started``) a SIGTERM requests a stop and the process lives on, and Ray is shut
    down when the block ends."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", _RAY_SIGTERM], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True", "False"], done.stderr[-2000:]
    assert "*** SIGTERM received at" not in done.stderr  # Abseil's failure-signal handler did not run


def _group_processes(pgid: int) -> list[str]:
    """Live (not zombie) processes of process group ``pgid``."""
    import ray  # noqa: F401  (Ray bundles psutil)
    import psutil

    alive = []
    for process in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(process.info["cmdline"] or [])[:100])
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "to_group", "engine"), [(signal.SIGINT, True, "ray"),
                                                          (signal.SIGTERM, False, "inprocess")],
                         ids=["SIGINT-to-the-group-on-ray", "SIGTERM-to-the-pid-in-process"])
def test_a_signal_stops_the_cli_run_after_the_round_leaving_nothing_and_resume_finishes_it(tmp_path, signum, to_group,
                                                                                           engine):
    """Ctrl-C in a terminal signals the whole process group (Ray's processes included); a process manager
    (systemd, supervisord, a batch system's first notice) signals the main PID alone: either stops the run after
    the round in progress, on either engine."""
    run_dir = tmp_path / "run"
    settings = ["federation.num_sites=3", "federation.rounds=4", "baseline.centralized=false",
                f"simulation.engine={engine}"]
    command = [sys.executable, "-m", "simulations.run", *settings]
    process = subprocess.Popen([*command, f"hydra.run.dir={run_dir}"], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # a group, as a shell job
    lines: list[str] = []
    first_round = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("round   1/4"):
                first_round.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first_round.wait(timeout=300), "".join(lines) + process.stderr.read()
        if to_group:
            os.killpg(process.pid, signum)  # Ctrl-C: the whole foreground group
        else:
            os.kill(process.pid, signum)
        sent = time.monotonic()
        returncode = process.wait(timeout=120)
        stop_s = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    stderr = process.stderr.read().strip().splitlines()
    name = signal.Signals(signum).name
    print(f"{name} -> exit code {returncode} after {stop_s:.1f} s", file=sys.stderr)
    assert returncode == 128 + signum, stderr
    assert stop_s < 60
    assert stderr[-1].startswith(f"stopped: {name}: the run stopped after round")
    assert stderr[-1].endswith(f"resume.from={run_dir}")
    assert not any("Traceback" in line for line in stderr)
    deadline = time.monotonic() + 5
    while (left := _group_processes(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    completed = torch.load(run_dir / "checkpoint.pt", weights_only=True)["round"]
    # the round in progress when the signal came: round 2 unless it had not started, or (rounds take under a second
    # here, and a signal to the PID alone lets the sites finish) had just ended
    assert completed in (1, 2, 3)
    assert [line["round"] for line in _read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, completed + 1))
    assert (run_dir / "run.log").read_text(encoding="utf-8").splitlines()[-1] == stderr[-1]

    resumed = subprocess.run([*command, f"resume.from={run_dir}", f"hydra.run.dir={tmp_path / 'resume'}"],
                             cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [line["round"] for line in _read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["resumed_after_round"] == completed
