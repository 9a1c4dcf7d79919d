"""A deployment on 127.0.0.1 (TLS, SuperNode authentication, one SuperNode per site file), and what its rounds cost.

:func:`loopback` starts what ``docs/deployment.md`` describes on one machine: the deploy scripts
make the certificates and keys, a SuperLink runs with TLS and ``--enable-supernode-auth``, and the
sites' keys are registered; :class:`Deployment` starts SuperNodes and submits runs with ``flwr run``.
Every process is started in its own process group and stopped by it. ``tests/test_deployment.py``
uses the same harness.

As a benchmark (issue 28: a message round trip ≤ 3 s, a distributed_dp round ≤ 15 s), it runs
FLCHAIN split over 3 SuperNodes (6,524 records: those without a missing value)
and reports, from each run's ``metrics.jsonl``:

* ``round_s``: the median wall time of a round but the first and the last (the first also pays the
  set-up, the last the final recalibration query);
* ``message_round_trip_s``: those rounds' time over the messages they sent each site one after
  the other (dp_sgd and fedavg: a training message, then an evaluation message; distributed_dp:
  SecAgg+'s four stages and the evaluation message; a round that ``evaluation.every`` does not
  evaluate sends no evaluation message);

for each setting of ``--settings``: ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` in the SuperNodes'
environment (Flower's own setting for how often a SuperNode's executor looks for a message to
run; 1 s by default) and ``evaluation.every``. The three SuperNodes, the SuperLink and the
ServerApp share this machine's cores, where a real deployment gives each site its own.

Usage::

    python -m benchmarks.loopback [--strategies dp_sgd,distributed_dp] [--rounds 5] [--settings 1:1,0.1:1,0.1:4]
        [--out file.json] [--keep folder]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from flwr_app.config import PROJECT_ROOT

BIN = Path(sys.executable).parent
DEPLOY = PROJECT_ROOT / "deploy"
CONNECTION = "deployment"
SITES = ("site-1", "site-2", "site-3")
#: Messages each site answers one after the other in a round after the first (train, evaluate; SecAgg+'s stages).
MESSAGES_PER_ROUND = {"fedavg": 2, "dp_sgd": 2, "distributed_dp": 5}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DeploymentError(RuntimeError):
    """A process of the loopback deployment did not do what was asked (the message holds its log's tail)."""


def _check(condition: object, detail: object) -> None:
    if not condition:
        raise DeploymentError(str(detail))


class Deployment:
    """The processes of one deployment; :meth:`stop_all` ends every one of them by process group."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir()
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr_home"), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "PATH": f"{BIN}:{os.environ['PATH']}",
                    "XDG_STATE_HOME": str(root / "state"),  # the sites' own directories (secret, states, log)
                    **(env or {})}
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}

    def run(self, *command: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(part) for part in command], cwd=PROJECT_ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def start(self, name: str, *command: str | Path) -> subprocess.Popen:
        if name in self.processes:  # a caller that failed before stopping its own: never lose track of a process
            self.stop(name)
        with (self.logs / f"{name}.log").open("w") as log:
            process = subprocess.Popen([str(part) for part in command], cwd=self.root, env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def start_supernode(self, site: str, node_config: str, *, key: str | None = None) -> subprocess.Popen:
        return self.start(site, BIN / "flower-supernode", "--superlink", f"127.0.0.1:{self.port}",
                          "--root-certificates", self.root / "certs" / "ca.crt",
                          "--auth-supernode-private-key", self.root / "keys" / (key or site),
                          "--port", str(free_port()), "--node-config", node_config)

    def stop(self, name: str) -> None:
        process = self.processes.pop(name)
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the group (SuperExec, app processes) after the leader exited
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def flwr_run(self, run_config: str) -> dict:
        """``flwr run`` against the deployment; the run's entry of ``flwr ls`` (``--stream`` exits 0 on failure)."""
        before = {run["run-id"] for run in self.runs()}
        result = self.run(BIN / "flwr", "run", ".", CONNECTION, "--stream", "--run-config", run_config, timeout=480)
        _check(result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:])
        (run,) = [run for run in self.runs() if run["run-id"] not in before]
        _check(run["status"] == "finished:completed", (run, result.stdout[-4000:], self.log("superlink")[-4000:]))
        return run

    def submit(self, run_config: str) -> int:
        """``flwr run`` without ``--stream``: the new run's ID (it returns once the SuperLink has the run)."""
        before = {run["run-id"] for run in self.runs()}
        result = self.run(BIN / "flwr", "run", ".", CONNECTION, "--run-config", run_config, timeout=240)
        _check(result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:])
        (run,) = [run for run in self.runs() if run["run-id"] not in before]
        return run["run-id"]

    def wait_finished(self, run_id: int, *, timeout: float) -> dict:
        """Poll ``flwr ls`` until the run has finished; its entry."""
        deadline = time.monotonic() + timeout
        while True:
            (run,) = [run for run in self.runs() if run["run-id"] == run_id]
            if run["status"].startswith("finished"):
                return run
            _check(time.monotonic() < deadline, (run, self.log("superlink")[-4000:]))
            time.sleep(2)

    def runs(self) -> list[dict]:
        return json.loads(self.run(BIN / "flwr", "ls", CONNECTION, "--format", "json").stdout)["runs"]


@contextlib.contextmanager
def loopback(root: Path, *, keys: tuple[str, ...] = SITES, env: dict[str, str] | None = None) -> Iterator[Deployment]:
    """A SuperLink on 127.0.0.1 with TLS and SuperNode authentication, ``keys`` registered (made in ``root``).

    ``env`` is added to every process's environment. Every process is stopped on leaving.
    """
    deploy = Deployment(root, env)
    try:
        for command in (
            ["make_certificates.sh", root / "certs", "127.0.0.1"],
            ["make_supernode_keys.sh", root / "keys", *keys],
            ["add_connection.sh", CONNECTION, f"127.0.0.1:{deploy.port}", root / "certs" / "ca.crt"],
        ):
            result = deploy.run("bash", DEPLOY / command[0], *command[1:])
            _check(result.returncode == 0, result.stderr)
        certs = root / "certs"
        deploy.start("superlink", BIN / "flower-superlink", "--ssl-ca-certfile", certs / "ca.crt",
                     "--ssl-certfile", certs / "server.crt", "--ssl-keyfile", certs / "server.key",
                     "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(deploy.port))
        deadline = time.monotonic() + 60
        while deploy.run(BIN / "flwr", "supernode", "list", CONNECTION).returncode != 0:
            _check(time.monotonic() < deadline, deploy.log("superlink"))
            _check(deploy.processes["superlink"].poll() is None, deploy.log("superlink"))
            time.sleep(1)
        for site in SITES:
            result = deploy.run(BIN / "flwr", "supernode", "register", root / "keys" / f"{site}.pub", CONNECTION,
                                "--format", "json")
            _check(result.returncode == 0 and json.loads(result.stdout)["success"], result.stdout + result.stderr)
        yield deploy
    finally:
        deploy.stop_all()


def _rounds(metrics: Path) -> tuple[list[float], list[bool], dict[str, int]]:
    """Wall time of each round but the first and the last, whether its model was evaluated (sites' metrics), and
    over all rounds how many were not aggregated and how many failures were filed (a timing of rounds that did
    not complete is no timing of the protocol)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [later["elapsed_s"] - earlier["elapsed_s"] for earlier, later in zip(lines, lines[1:-1])]
    health = {"rounds_not_aggregated": sum("not_aggregated" in line for line in lines),
              "failures": sum(len(line["failures"]) for line in lines)}
    return times, [bool(line["sites"]) for line in lines[1:-1]], health


def measure(strategy: str, rounds: int, *, poll: float | None, every: int = 1, keep: Path | None = None) -> dict:
    """One run of ``strategy`` over a fresh loopback deployment of FLCHAIN's 3 site files; its round times.

    ``poll``: the SuperNodes' ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (None: Flower's default);
    ``every``: ``evaluation.every``; ``keep``: a new folder for the deployment (its logs, with
    Flower's timestamps), kept afterwards.
    """
    from models.data.datasets import _sksurv_flchain

    env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(poll)} if poll else {}
    if keep is not None:
        keep.mkdir(parents=True)
        env["FLWR_LOG_LEVEL"] = "DEBUG"
    with contextlib.ExitStack() as stack:
        root = keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        deployment = stack.enter_context(loopback(root, env=env))
        flchain = _sksurv_flchain().drop(columns=["chapter"]).dropna()
        for index, site in enumerate(SITES):
            path = deployment.root / f"{site}.csv"
            flchain.iloc[index::len(SITES)].to_csv(path, index=False)
            deployment.start_supernode(site, f"data-path='{path}' site-name='{site}'")
        out = deployment.root / "run"
        started = time.monotonic()
        deployment.flwr_run(
            f"data.name='site_files' data.time_col='futime' data.event_col='death' strategy.name='{strategy}' "
            f"privacy.epsilon={'inf' if strategy == 'fedavg' else 1} federation.num_sites=3 "
            f"federation.rounds={rounds} evaluation.every={every} evaluation.server_side=false "
            f"baseline.centralized=false output.dir='{out}'")
        run_s = time.monotonic() - started
        times, evaluated, health = _rounds(out / "metrics.jsonl")
    messages = [MESSAGES_PER_ROUND[strategy] - (0 if done else 1) for done in evaluated]
    return {"strategy": strategy, "rounds": rounds, "records": len(flchain), "executor_poll_s": poll or 1.0,
            "evaluation_every": every, "run_s": run_s, "round_s_after_first": times, "evaluated": evaluated,
            "round_s": statistics.median(times), "messages_per_round": statistics.median(messages),
            "message_round_trip_s": sum(times) / sum(messages), **health}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="dp_sgd,distributed_dp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settings", default="1:1,0.1:1,0.1:4",
                        help="executor poll seconds:evaluation.every pairs, comma-separated (default: %(default)s)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="keep each deployment's folder and logs under this new folder")
    args = parser.parse_args(argv)
    rows = []
    for setting in args.settings.split(","):
        poll, every = float(setting.split(":")[0]), int(setting.split(":")[1])
        for strategy in args.strategies.split(","):
            keep = args.keep / f"{strategy}-poll-{poll:g}-every-{every}" if args.keep else None
            rows.append(measure(strategy, args.rounds, poll=None if poll == 1.0 else poll, every=every, keep=keep))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"targets": {"message_round_trip_s": 3.0, "distributed_dp_round_s": 15.0},
                                        "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
