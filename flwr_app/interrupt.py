"""Stop requests: SIGINT or SIGTERM stops a run after the round in progress, with its checkpoint written.

The ServerApp cannot be stopped from outside at an arbitrary point: in a simulation it runs in a
thread of Flower's simulation runtime (Python runs signal handlers in the main thread only, and
nothing can raise an exception inside another thread), and a round cut short would lose the sites'
work and leave no consistent checkpoint. So a signal only *requests* a stop, and the ServerApp
looks for a request between rounds, once the round's outputs and checkpoint are written:

* :func:`stop_on_signals` (used by :func:`simulations.engine.run_simulation`, main thread) turns
  the first SIGINT or SIGTERM into a request (:func:`request`); a second one, while the round is
  still running (:func:`at_once_allowed`), stops at once (:class:`Interrupted` in the main
  thread; the last written checkpoint stays valid).
* :func:`run_stoppable` does the same for a command-line entry point whose runs go one after
  another in this process (the in-process grid of the sweeps and benchmarks): the run in progress
  stops after its round, no other starts, and it exits with ``128 + signal``.
* :func:`raise_if_requested` (the ServerApp, at the end of every round or split epoch) raises
  :class:`StopRequested` when a stop was requested; the run can then continue from its
  checkpoint with ``resume.from``.

Under ``flwr run`` the ServerApp is a process of Flower's (``flwr-serverapp``) with Flower's own
signal handling (``flwr stop <run-id>``); no request is ever made there and
:func:`raise_if_requested` does nothing. In-process callers (tests) may call :func:`request`
themselves and :func:`clear` afterwards.

Exit codes follow the shell's convention for a process ended by a signal: ``128 + signal number``
(SIGINT 130, SIGTERM 143), :attr:`StopRequested.exit_code`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

__all__ = ["Interrupted", "StopRequested", "at_once_allowed", "clear", "raise_if_requested", "request", "requested",
           "raise_before_run", "run_stoppable", "stop_on_signals"]

#: The signals that stop a run.
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_signum: int | None = None
_stopped = threading.Event()  # raise_if_requested has raised: the run is already stopping
_at_once = threading.Event()  # inside at_once_allowed(): a second signal stops at once


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequested(Exception):
    """The run stopped between two rounds (or split epochs) because a signal asked it to.

    Attributes
    ----------
    signum
        The signal (``signal.SIGINT``, ``signal.SIGTERM``).
    completed
        The last round (split: epoch) whose outputs were written.
    exit_code
        ``128 + signum``: what a command-line entry point exits with.
    """

    def __init__(self, message: str, *, signum: int, completed: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.completed = completed
        self.exit_code = 128 + signum


class Interrupted(KeyboardInterrupt):
    """A second signal stopped the run at once, in the middle of a round (raised in the main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{_name(signum)} received twice: stopped at once")
        self.signum = signum
        self.exit_code = 128 + signum


def request(signum: int = signal.SIGINT) -> None:
    """Ask the running ServerApp to stop after its current round (the first request's signal is kept)."""
    global _signum
    with _lock:
        if _signum is None:
            _signum = signum


def requested() -> int | None:
    """The signal that requested a stop, or ``None`` if none has."""
    with _lock:
        return _signum


def clear() -> None:
    """Forget any stop request (a new run starts)."""
    global _signum
    with _lock:
        _signum = None
        _stopped.clear()


def raise_if_requested(completed: int, *, of: int, directory: Path, resumable: bool = True,
                       unit: str = "round") -> None:
    """Raise :class:`StopRequested` if a stop was requested; call it once the ``completed`` round's outputs are written.

    Parameters
    ----------
    completed
        The round (split learning: epoch) just completed.
    of
        The run's number of rounds (epochs).
    directory
        The run's output directory (named in the message).
    resumable
        Whether ``resume.from = directory`` continues the run (horizontal runs: a checkpoint
        after every round); split runs cannot be resumed.
    unit
        What a round is called in the message (``"round"``, ``"epoch"``).
    """
    signum = requested()
    if signum is None:
        return
    _stopped.set()
    then = (f"continue it with the same settings and resume.from={directory}" if resumable else
            f"its outputs up to then are in {directory} (a split run cannot be resumed: start it again)")
    raise StopRequested(f"{_name(signum)}: the run stopped after {unit} {completed} of {of}; {then}",
                        signum=signum, completed=completed)


def _note(signum: int) -> None:
    """The first signal: request a stop and say so on stderr (once, whoever notes it first)."""
    with _lock:
        global _signum
        if _signum is not None:
            return
        _signum = signum
    # os.write, not print: this may run inside a write to sys.stderr (the handler) or beside one (the watcher).
    with contextlib.suppress(OSError):
        os.write(2, f"{_name(signum)} received: the run stops after the round in progress (its checkpoint is "
                    f"written); send it again to stop at once\n".encode())


def _watch(read_fd: int) -> None:
    """Note the first signal as soon as it arrives (the byte the C-level handler writes to the wakeup fd).

    Python runs a signal's handler in the main thread only, when it next executes bytecode; a main
    thread blocked in a C call (Flower's simulation runtime, Ray) would note the signal rounds later.
    """
    while True:
        try:
            select.select([read_fd], [], [])
            data = os.read(read_fd, 64)
        except (OSError, ValueError):
            return  # the block ended and closed the pipe
        if not data:
            return
        for signum in data:
            if signum in SIGNALS:
                _note(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """For the block, SIGINT and SIGTERM request a stop (:func:`request`) instead of ending the process.

    The first signal is noted at once (one line on stderr; a thread watches the signal wakeup fd, so
    a main thread blocked in C code does not delay it) and the ServerApp stops after the round in
    progress. A second one, inside :func:`at_once_allowed` and before the ServerApp has stopped,
    raises :class:`Interrupted` in the main thread; elsewhere (the run is already stopping, or
    cleaning up) it changes nothing. The previous handlers and wakeup fd come back when the block
    ends, and any request is cleared when it starts. Outside the main thread (where Python cannot
    set handlers) the block changes nothing.
    """
    clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    calls = 0

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal calls
        calls += 1
        _note(signum)
        if calls > 1 and _at_once.is_set() and not _stopped.is_set():
            raise Interrupted(signum)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="fedsurv-signal-watch", daemon=True)
    watcher.start()
    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        watcher.join(timeout=1)
        os.close(read_fd)


@contextlib.contextmanager
def at_once_allowed() -> Iterator[None]:
    """Inside :func:`stop_on_signals`: while the block runs, a second signal stops the run at once.

    Wrap what may be cut short (the simulation itself), not the clean-up after it, which a second
    signal must not interrupt.
    """
    _at_once.set()
    try:
        yield
    finally:
        _at_once.clear()


def run_stoppable(main: Callable[[], object]) -> int:
    """Run ``main`` (a command-line entry point whose runs go one after another in this process) and return its exit
    code (what it returns if that is an int, else 0): SIGINT or SIGTERM stops the run in progress after its round
    (:func:`stop_on_signals`; the in-process runner starts no other, :func:`raise_before_run`; a grid finishes its
    runs under way), prints one line (the stop's own message: where it stopped, how to go on) and returns
    ``128 + signal``; a second signal stops at once. What was written up to then stays."""
    with stop_on_signals(), at_once_allowed():
        try:
            code = main()
            return code if isinstance(code, int) else 0  # a main may return its results (a dict): success
        except (StopRequested, Interrupted) as stop:
            print(f"stopped: {stop}; what was written up to then is kept", file=sys.stderr)
            return stop.exit_code


def raise_before_run() -> None:
    """Raise :class:`StopRequested` if a stop was requested before a run starts (a runner calls it first)."""
    if (signum := requested()) is not None:
        raise StopRequested(f"{_name(signum)}: no run starts after a stop was requested", signum=signum, completed=0)
