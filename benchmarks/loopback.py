"""A deployment on 127.0.0.1 (TLS, SuperNode authentication, one SuperNode per site file), and what its rounds cost.

:func:`loopback` starts what ``docs/deployment.md`` describes on one machine: the deploy scripts
make the certificates and keys, a SuperLink runs with TLS and ``--enable-supernode-auth``, and the
sites' keys are registered; :class:`Deployment` starts SuperNodes and submits runs with ``flwr run``.
Every process is started in its own process group and stopped by it. ``tests/test_deployment.py``
uses the same harness.

As a benchmark, it runs FLCHAIN split over 3 SuperNodes (6,524 records: those without a missing
value) and reports, for each executor of ``--executors`` (:data:`EXECUTORS`: Flower's default, or
``--isolation process`` beside Flower's ``flower-superexec`` or fedsurv's warm executor):

* ``round_s``: the median wall time of a round but the first and the last (the first also pays the
  set-up, the last the final recalibration query), from the run's ``metrics.jsonl``;
* ``messages_per_site``: how many messages of each type site-1 answered in the run (the set-up's, the rounds'
  and the last round's together; the sequential messages of a round are counted exactly in process by
  ``tests/test_message_count.py``);
* ``phases``: per message type, the median of each phase of :data:`PHASES` over the three sites'
  messages but each site's first of a type it gets every round, from the marks Flower's DEBUG log puts in each
  SuperNode's log (:data:`MARKS`): runtime start (the executor's look for work and a new process, or
  a fork), fetching the message and installing the app bundle, the ClientApp's imports and handling,
  the reply's way to the SuperNode and to the SuperLink, the site's own time (message received to
  reply pushed), and the idle time before it (the SuperNode's idle sleep and the other sites' turns);

for each setting of ``--settings``: ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` in the SuperNodes'
environment (how often an executor looks for a message to run: Flower's default 1 s, the warm
executor's 0.2 s) and ``evaluation.every``. The three SuperNodes, the SuperLink and the ServerApp
share this machine's cores, where a real deployment gives each site its own. :data:`TARGETS` are
the deployment's targets on an idle machine.

Usage::

    python -m benchmarks.loopback [--strategies dp_sgd,distributed_dp] [--executors stock,warm] [--rounds 5]
        [--settings 1:1,0.1:4] [--out file.json] [--keep folder] [--note "how loaded the machine was"]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import re
import shlex
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
from flwr_app.executor import DEFAULT_POLL_S

BIN = Path(sys.executable).parent
DEPLOY = PROJECT_ROOT / "deploy"
CONNECTION = "deployment"
SITES = ("site-1", "site-2", "site-3")
#: How a SuperNode runs its ClientApps: Flower's default (``--isolation subprocess``: the SuperNode starts
#: ``flower-superexec``), ``--isolation process`` beside Flower's ``flower-superexec``, or beside fedsurv's warm
#: executor (``python -m flwr_app.executor``).
EXECUTORS = ("stock", "subprocess-flower", "warm")
#: The deployment's targets (on an idle machine; medians over the rounds after the first).
TARGETS = {"site_own_s_per_message": 1.0, "fedavg_dp_sgd_round_s": 6.0, "distributed_dp_round_s": 15.0}


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

    def __init__(self, root: Path, env: dict[str, str] | None = None, *, executor: str = "stock") -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor {executor!r}: one of {', '.join(EXECUTORS)}")
        self.root = root
        self.executor = executor
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
        """A SuperNode for ``site``. With ``--isolation process`` a shell starts it and then its executor (with
        ``--parent-pid``) in one process group, and exits with the SuperNode's status once it has exited."""
        runtime = free_port()
        node = [BIN / "flower-supernode", "--superlink", f"127.0.0.1:{self.port}",
                "--root-certificates", self.root / "certs" / "ca.crt",
                "--auth-supernode-private-key", self.root / "keys" / (key or site),
                "--port", str(runtime), "--node-config", node_config]
        if self.executor == "stock":
            return self.start(site, *node)
        executor = [BIN / "flower-superexec"] if self.executor == "subprocess-flower" else \
            [sys.executable, "-m", "flwr_app.executor"]
        executor += ["--insecure", "--runtime-api-address", f"127.0.0.1:{runtime}", "--parent-pid"]
        quoted = shlex.join(str(part) for part in [*node, "--isolation", "process"])
        # The shell waits for the SuperNode's own graceful exit on SIGTERM (stop() signals the whole group).
        return self.start(site, "bash", "-c", f"{quoted} & node=$!; {shlex.join(str(part) for part in executor)} "
                          "$node & trap 'wait $node; exit $?' TERM INT; wait $node")

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
def loopback(root: Path, *, keys: tuple[str, ...] = SITES, env: dict[str, str] | None = None,
             executor: str = "stock") -> Iterator[Deployment]:
    """A SuperLink on 127.0.0.1 with TLS and SuperNode authentication, ``keys`` registered (made in ``root``).

    ``env`` is added to every process's environment; ``executor`` is how SuperNodes run their ClientApps
    (:data:`EXECUTORS`). Every process is stopped on leaving.
    """
    deploy = Deployment(root, env, executor=executor)
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


#: Flower's log lines (``FLWR_LOG_LEVEL=DEBUG``) that mark where a message is, in a SuperNode's log.
MARKS = {"received": "Receiving: ", "runtime": "Start `flwr-clientapp` process",
         "loading": "Start `ClientApp` Loading.", "replied": "Runtime.PushMessages", "sending": "Sending: ",
         "sent": "Sent successfully"}
#: A message's phases: from one mark to the next (``own``: the site's own time, runtime start to reply; ``idle``:
#: from the site's previous reply leaving to this message arriving, the SuperNode's idle wait included).
PHASES = {"runtime_start_s": ("received", "runtime"), "fetch_and_install_s": ("runtime", "loading"),
          "imports_and_handling_s": ("loading", "replied"), "reply_to_supernode_s": ("replied", "sending"),
          "upload_s": ("sending", "sent"), "own_s": ("received", "replied"), "idle_s": ("previous_sent", "received")}
_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\S*:\s+(.*)$")


def message_marks(log: str) -> list[dict]:
    """Each message a SuperNode handled, in order: its type and the time of each of :data:`MARKS` (seconds)."""
    messages: list[dict] = []
    current: dict | None = None
    previous_sent = None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        if not (match := _LINE.search(line)):
            continue
        stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        text = match[2]
        if text.startswith(MARKS["received"]):
            current = {"type": text[len(MARKS["received"]):].split(" message")[0], "received": stamp,
                       "previous_sent": previous_sent}
            continue
        if current is None:
            continue
        for mark, start in MARKS.items():
            if start in text:
                current.setdefault(mark, stamp)
        if "sent" in current:
            messages.append(current)
            previous_sent, current = current["sent"], None
    return messages


def phase_medians(logs: list[str]) -> dict[str, dict[str, float]]:
    """Per message type, the median of each of :data:`PHASES` over the sites' messages but each site's first of
    a type it got more than once (the first round's), the shortest idle time, and how many messages that is."""
    by_type: dict[str, list[dict]] = {}
    for log in logs:
        messages = message_marks(log)
        kinds = collections.Counter(message["type"] for message in messages)
        seen: set[str] = set()
        for message in messages:
            if message["type"] in seen or kinds[message["type"]] == 1:
                by_type.setdefault(message["type"], []).append(message)
            seen.add(message["type"])
    medians = {}
    for kind, messages in sorted(by_type.items()):
        medians[kind] = {"messages": len(messages)}
        for phase, (start, end) in PHASES.items():
            values = [message[end] - message[start] for message in messages
                      if message.get(start) is not None and message.get(end) is not None]
            if values:
                medians[kind][phase] = round(statistics.median(values), 3)
                if phase == "idle_s":
                    medians[kind]["idle_min_s"] = round(min(values), 3)
    return medians


def measure(strategy: str, rounds: int, *, poll: float | None, every: int = 1, keep: Path | None = None,
            executor: str = "stock") -> dict:
    """One run of ``strategy`` over a fresh loopback deployment of FLCHAIN's 3 site files; its round times.

    ``poll``: the SuperNodes' ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (None: Flower's default);
    ``every``: ``evaluation.every``; ``keep``: a new folder for the deployment (its logs, with
    Flower's timestamps), kept afterwards.
    """
    from models.data.datasets import _sksurv_flchain

    env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(poll)} if poll else {}
    env["FLWR_LOG_LEVEL"] = "DEBUG"  # the marks of each message's phases
    if keep is not None:
        keep.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        root = keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        deployment = stack.enter_context(loopback(root, env=env, executor=executor))
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
        phases = phase_medians([deployment.log(site) for site in SITES])
        counts = collections.Counter(message["type"] for message in message_marks(deployment.log(SITES[0])))
    default_poll = 1.0 if executor != "warm" else DEFAULT_POLL_S
    return {"executor": executor, "strategy": strategy, "rounds": rounds, "records": len(flchain),
            "executor_poll_s": poll or default_poll, "evaluation_every": every, "run_s": run_s,
            "round_s_after_first": times, "evaluated": evaluated, "round_s": statistics.median(times),
            "messages_per_site": dict(counts), "phases": phases, **health}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="dp_sgd,distributed_dp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settings", default="1:1",
                        help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds (1: unset, the executor's default):"
                             "evaluation.every pairs, comma-separated (default: %(default)s)")
    parser.add_argument("--executors", default="stock,warm",
                        help=f"comma-separated, of {', '.join(EXECUTORS)} (default: %(default)s)")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. how loaded the machine was)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="keep each deployment's folder and logs under this new folder")
    args = parser.parse_args(argv)
    rows = []
    for setting in args.settings.split(","):
        poll, every = float(setting.split(":")[0]), int(setting.split(":")[1])
        for strategy in args.strategies.split(","):
            for executor in args.executors.split(","):
                keep = args.keep / f"{strategy}-{executor}-poll-{poll:g}-every-{every}" if args.keep else None
                rows.append(measure(strategy, args.rounds, poll=None if poll == 1.0 else poll, every=every,
                                    keep=keep, executor=executor))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"targets": TARGETS, "note": args.note, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
