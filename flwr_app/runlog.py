"""``run.log`` in a run's output directory: what the ServerApp prints, and how the run ended.

The ServerApp writes its own log, so that ``python -m simulations.run`` (Hydra) and ``flwr run``
(no Hydra) leave the same file: one line per round, the final figures, and, if the run fails, the
error with its full traceback (a signal's stop: one line saying so). The command line then shows
the error in one line and names this file. A resumed run appends to the log of the run it
continues.

Use, in the ServerApp::

    @app.main()
    @runlog.logged
    def main(grid, context):
        ...
        outputs = RunOutputs.create(cfg)
        runlog.attach(outputs.directory)

and around other code that belongs to a run (:func:`run_log`). What a thread prints while it is
attached goes to the console as before and to ``run.log``; what other threads print (the sites of
an in-process simulation) does not. A logger's records can be sent there instead of the console
(:func:`logger_records`: Flower's simulation runtime). An exception is written once, by the
innermost block it leaves; :func:`log_path` tells where.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

from flwr_app.interrupt import StopRequested

__all__ = ["RUN_LOG", "attach", "log_path", "logged", "logger_records", "one_line", "run_log"]

RUN_LOG = "run.log"
_LOGGED_TO = "_fedsurv_run_log"  # attribute of an exception already written to a run.log: its path

F = TypeVar("F", bound=Callable[..., Any])


class _Session:
    """One logged call: the ``run.log`` it writes to once attached."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.file: TextIO | None = None

    def open(self, directory: Path) -> None:
        if self.file is not None:
            raise RuntimeError(f"the run log is already attached to {self.path}")
        self.path = Path(directory) / RUN_LOG
        self.file = self.path.open("a", encoding="utf-8", buffering=1)

    def record(self, err: BaseException) -> None:
        """Write how the run ended (once per exception, by the innermost session that has a file)."""
        if self.file is None or getattr(err, _LOGGED_TO, None) is not None:
            return
        if isinstance(err, StopRequested):
            self.file.write(f"stopped: {err}\n")
        elif isinstance(err, (KeyboardInterrupt, SystemExit)):  # a second signal; Flower's own handlers (flwr run)
            self.file.write(f"stopped: {type(err).__name__}" + (f": {one_line(err)}" if str(err) else "") + "\n")
        else:
            self.file.write(f"error: {type(err).__name__}: {one_line(err)}\n{''.join(traceback.format_exception(err))}")
        self.file.flush()
        with contextlib.suppress(AttributeError, TypeError):
            setattr(err, _LOGGED_TO, self.path)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class _Tee:
    """``sys.stdout`` while a session is attached: all text to the console, an attached thread's also to its log."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        session = _innermost()
        if session is not None and session.file is not None and not session.file.closed:
            session.file.write(text)
        return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


_lock = threading.Lock()
_sessions: dict[int, list[_Session]] = {}  # thread ident -> its sessions, innermost last
_tee: _Tee | None = None


def _innermost() -> _Session | None:
    stack = _sessions.get(threading.get_ident())
    return stack[-1] if stack else None


def _push(session: _Session) -> None:
    global _tee
    with _lock:
        _sessions.setdefault(threading.get_ident(), []).append(session)
        if _tee is None:
            _tee = _Tee(sys.stdout)
            sys.stdout = _tee


def _pop(session: _Session) -> None:
    global _tee
    with _lock:
        stack = _sessions[threading.get_ident()]
        stack.remove(session)
        if not stack:
            del _sessions[threading.get_ident()]
        if not _sessions and _tee is not None:
            if sys.stdout is _tee:  # else someone replaced it since: our tee, now idle, stays inside theirs
                sys.stdout = _tee.stream
            _tee = None
    session.close()


@contextlib.contextmanager
def _session() -> Iterator[_Session]:
    session = _Session()
    _push(session)
    try:
        yield session
    except BaseException as err:
        session.record(err)
        raise
    finally:
        _pop(session)


def logged(main: F) -> F:
    """Decorate a ServerApp's main function: once it calls :func:`attach`, its output and its end go to ``run.log``."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _session():
            return main(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def attach(directory: str | Path) -> Path:
    """Start writing the calling :func:`logged` function's log to ``<directory>/run.log`` (appended); return its path.

    Call it once the run's output directory is known (and accepted: a directory refused by
    :meth:`flwr_app.outputs.RunOutputs.create` gets no log).
    """
    session = _innermost()
    if session is None:
        raise RuntimeError("runlog.attach is called from a function decorated with runlog.logged (or in run_log)")
    session.open(Path(directory))
    assert session.path is not None
    return session.path


@contextlib.contextmanager
def run_log(directory: str | Path) -> Iterator[Path]:
    """For the block, this thread's output and an exception that leaves it go to ``<directory>/run.log``."""
    with _session() as session:
        session.open(Path(directory))
        assert session.path is not None
        yield session.path


@contextlib.contextmanager
def logger_records(name: str, directory: str | Path) -> Iterator[None]:
    """For the block, the records of logger ``name`` go to ``<directory>/run.log`` instead of its own handlers.

    Used for Flower's simulation runtime (logger ``flwr``): it logs every failed message of a
    site with its traceback, which the ServerApp reports in one line per round (``failures``).
    """
    logger = logging.getLogger(name)
    handler = logging.FileHandler(Path(directory) / RUN_LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"{name} %(levelname)s: %(message)s"))
    handlers = logger.handlers[:]
    logger.handlers = [handler]
    try:
        yield
    finally:
        logger.handlers = handlers
        handler.close()


def log_path(err: BaseException) -> Path | None:
    """The ``run.log`` that ``err``'s traceback was written to, if any."""
    return getattr(err, _LOGGED_TO, None)


def one_line(err: BaseException) -> str:
    """``err``'s message in one line: its first non-empty line (``...`` if more follow), else its type."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[0] + (" ..." if len(lines) > 1 else "")
