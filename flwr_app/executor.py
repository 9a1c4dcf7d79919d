"""A warm ClientApp executor for a site's SuperNode: imports once, forks a child per task.

Run beside a SuperNode started with ``--isolation process``, in place of Flower's ``flower-superexec``::

    python -m flwr_app.executor --runtime-api-address 127.0.0.1:9094 --insecure [--parent-pid PID]

Flower's executor starts a new ``flwr-clientapp`` process for every message, which imports Flower,
torch and the ClientApp's modules before it handles anything. This one imports them once
(:data:`PRELOAD`), then claims the SuperNode's ClientApp tasks through its Runtime API as
``flower-superexec`` does and serves each in a forked child that runs Flower's own ``run_clientapp``
with that task's token, so Flower's protocol (message, context, reply, heartbeat, task output) is
unchanged. Design notes and measurements: ``docs/deployment.md`` ("Message latency and the warm
executor").

* The parent starts no thread and creates no torch state before it forks (it checks that it has
  one Python thread); it registers no Flower exit handler; it sets ``FLWR_TELEMETRY_ENABLED=0``
  for itself and its children before Flower is imported.
* A child ends with ``os._exit``: the parent's ``atexit`` and exit handlers never run in it. A
  child that raises, exits or is killed is reaped and logged, and the parent goes on; its message
  gets Flower's own error reply ("ClientApp stopped responding") when the task's heartbeat lapses,
  as for a crashed ``flwr-clientapp``.
* ``--parent-pid``: the executor exits once that process (the SuperNode) is gone, and its children,
  which watch the executor as ``flwr-clientapp`` watches ``flower-superexec``, follow. Restarting an
  executor that died is the site's service manager's job.
* The children run the fedsurv code the executor imported (this environment's install), not a
  copy from the run's app bundle: Flower loads ``flwr_app.client_app`` from ``sys.modules`` when it
  is there.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

#: What the parent imports before it forks: the ClientApp, and what its training, set-up and secure-aggregation
#: handlers import when their first message arrives (torch, pandas and SciPy come with them).
PRELOAD = ("flwr_app.client_app", "flwr_app.task", "flwr_app.deployment", "flwr_app.site_state",
           "flwr_app.site_policy", "strategies.horizontal", "strategies.mechanisms.registry",
           "strategies.mechanisms.dp_sgd", "strategies.secure_aggregation", "dp_accounting.pld",
           "dp_accounting.rdp")
#: Seconds between two looks for a task when ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` is not set (Flower's
#: ``flower-superexec``: 1 s). Each look is one request to the SuperNode, which logs it (uvicorn's access log).
DEFAULT_POLL_S = 0.2

LOG = logging.getLogger("flwr")  # Flower's logger: the children's lines come out beside Flower's own


@dataclass(frozen=True)
class Ended:
    """A child that has been reaped: its task, its process and how it ended (exit code, or minus the signal)."""

    task_id: int
    pid: int
    returncode: int


def serve_in_child(serve: Callable[[str], object], token: str) -> int:
    """Fork; the child runs ``serve(token)`` and leaves with ``os._exit`` (its exit code); the parent gets its pid.

    The child's code is ``SystemExit``'s (Flower's ``flwr_exit`` ends ``run_clientapp`` with it), 0 when
    ``serve`` returns, 1 when it raises. Its signal dispositions are reset to the defaults first.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        serve(token)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child reports everything it raises, then leaves
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream cannot stop the child from leaving
                pass
        os._exit(code)


def reap(children: dict[int, int]) -> list[Ended]:
    """Collect every child of ``children`` (pid -> task ID) that has ended, without waiting; remove them."""
    ended = []
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            done, status = pid, 255 << 8
        if done:
            ended.append(Ended(children.pop(pid), pid, os.waitstatus_to_exitcode(status)))
    return ended


def report(ended: Ended) -> None:
    """Log a child's end; one that crashed or was killed is logged as its task's failure."""
    if ended.returncode == 0:
        LOG.debug("fedsurv executor: task %d served (process %d)", ended.task_id, ended.pid)
        return
    how = f"was killed by signal {-ended.returncode}" if ended.returncode < 0 else \
        f"exited with code {ended.returncode}"
    LOG.error("fedsurv executor: the ClientApp process of task %d (pid %d) %s; the SuperNode replies to its "
              "message with Flower's error ('ClientApp stopped responding') once the task's heartbeat lapses",
              ended.task_id, ended.pid, how)


def parent_alive(pid: int | None) -> bool:
    """Whether process ``pid`` still exists (always True without one)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve_tasks(acquire: Callable[[], tuple[int, str] | None], serve: Callable[[str], object], *, poll_s: float,
                keep_going: Callable[[], bool]) -> list[Ended]:
    """Claim tasks with ``acquire`` and serve each in a child (:func:`serve_in_child`) while ``keep_going()``.

    Ended children are reaped and reported at every look; a failing ``acquire`` (the SuperNode not up,
    or restarting) is logged once and retried, as is a failed fork (the claimed task is handed out again
    once its claim lapses). Returns every child that ended, in order; children still
    running when the loop stops are sent SIGTERM and reaped.
    """
    children: dict[int, int] = {}
    ended: list[Ended] = []
    acquire_failed = False
    while keep_going():
        for child in reap(children):
            report(child)
            ended.append(child)
        try:
            task = acquire()
            acquire_failed = False
        except Exception as error:  # noqa: BLE001 - the SuperNode may be restarting: look again
            if not acquire_failed:
                LOG.warning("fedsurv executor: no answer from the SuperNode's Runtime API (%s); retrying", error)
            acquire_failed, task = True, None
        if task is not None:
            task_id, token = task
            try:
                children[serve_in_child(serve, token)] = task_id
            except OSError as error:  # no process to be had: Flower hands the task out again once its claim lapses
                LOG.error("fedsurv executor: could not fork for task %d (%s)", task_id, error)
            else:
                LOG.debug("fedsurv executor: task %d handed to a forked ClientApp process", task_id)
                continue  # another task may be pending: look again at once
        time.sleep(poll_s)
    return ended + _stop(children)


def _stop(children: dict[int, int], grace_s: float = 10.0) -> list[Ended]:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    ended, deadline = [], time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        ended.extend(reap(children))
        time.sleep(0.05)
    for pid in list(children):
        os.kill(pid, signal.SIGKILL)
        ended.append(Ended(children.pop(pid), pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
    return ended


def require_one_thread(after: str) -> None:
    """Stop the executor (``SystemExit``) if ``after`` left a second Python thread: a fork would copy its locks."""
    if threading.active_count() != 1:
        raise SystemExit(f"fedsurv executor: {after} started threads "
                         f"({', '.join(thread.name for thread in threading.enumerate())}); it cannot fork safely")


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules`` (:func:`require_one_thread` after them)."""
    for module in modules:
        importlib.import_module(module)
    require_one_thread("importing the ClientApp")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flwr_app.executor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, HOST:PORT")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--insecure", action="store_true", help="the Runtime API has no TLS (its default)")
    security.add_argument("--root-certificates", help="CA certificate (PEM) of a Runtime API with TLS")
    parser.add_argument("--parent-pid", type=int, help="exit once this process (the SuperNode) has exited")
    parser.add_argument("--poll-interval", type=float,
                        help="seconds between two looks for a task (default: FLWR_SUPEREXEC_TASK_POLL_INTERVAL, "
                             f"else {DEFAULT_POLL_S})")
    args = parser.parse_args(argv)
    if args.poll_interval is None:
        given = os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(DEFAULT_POLL_S))
        try:
            args.poll_interval = float(given)
        except ValueError:
            parser.error(f"FLWR_SUPEREXEC_TASK_POLL_INTERVAL={given!r} is not a number of seconds")
    if not 0.01 <= args.poll_interval <= 60:
        parser.error(f"the poll interval {args.poll_interval} is outside 0.01 to 60 seconds")
    return args


def main(argv: list[str] | None = None) -> None:
    """``python -m flwr_app.executor``: serve the SuperNode's ClientApp tasks until it (or a signal) stops us."""
    args = _arguments(argv)
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # read when Flower's telemetry is imported: before any flwr import
    from flwr_app import flower_entry

    import flwr

    if flwr.__version__ not in flower_entry.TESTED_FLOWER_VERSIONS:
        LOG.warning("fedsurv executor: tested with Flower %s, running on %s",
                    " and ".join(flower_entry.TESTED_FLOWER_VERSIONS), flwr.__version__)
    certificates = flower_entry.root_certificates(args.root_certificates, args.insecure)
    preload()
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: stopping.append(number))
    client = flower_entry.runtime_client(args.runtime_api_address, insecure=args.insecure, certificates=certificates)
    parent = os.getpid()

    def serve(token: str) -> None:
        LOG.info("Start `flwr-clientapp` process (forked by the fedsurv executor)")
        flower_entry.run_clientapp(runtime_api_address=args.runtime_api_address, token=token,
                                   insecure=args.insecure, certificates=certificates, parent_pid=parent)

    def acquire() -> tuple[int, str] | None:
        task = flower_entry.acquire_clientapp_task(client)
        if task is not None:
            require_one_thread("the Runtime API client")
        return task

    LOG.info("fedsurv executor: serving ClientApp tasks of the SuperNode at %s", args.runtime_api_address)
    serve_tasks(acquire, serve, poll_s=args.poll_interval,
                keep_going=lambda: not stopping and parent_alive(args.parent_pid))
    LOG.info("fedsurv executor: stopped (%s)", "signal" if stopping else f"process {args.parent_pid} has exited")


if __name__ == "__main__":
    main()
