"""The results file of a reproduction grid: one CSV row per run, appended as each run finishes.

A rerun reads the rows already there and runs only the missing ones. A grid stopped by a signal
writes the rows of its runs under way first; only a second signal (stop at once) loses them.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import multiprocessing
import signal
import statistics
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "append_runs", "code_commit", "mean_std", "read_rows"]

PROJECT = Path(__file__).resolve().parent.parent


def mean_std(values: Iterable[float], digits: int = 3) -> str:
    """``mean ± std`` (sample std) of the finite values for a table cell; ``value (1 run)`` for one, ``–`` for none."""
    finite = [float(value) for value in values if math.isfinite(value)]
    if not finite:
        return "–"
    if len(finite) == 1:
        return f"{finite[0]:.{digits}f} (1 run)"
    return f"{statistics.mean(finite):.{digits}f} ± {statistics.stdev(finite):.{digits}f}"


def append_jsonl(path: str | Path, row: Mapping[str, Any]) -> None:
    """Append ``row`` to the JSON-lines file ``path`` as one line (at once: a stopped run loses nothing)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, default=float) + "\n")


def read_rows(path: Path, *, text_fields: Iterable[str]) -> list[dict[str, Any]]:
    """Rows of ``path`` (none if it does not exist), every field but ``text_fields`` as a float."""
    if not path.exists():
        return []
    text = set(text_fields)
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [{key: value if key in text else float(value) for key, value in row.items()} for row in rows]


def append_runs(
    path: Path, fields: Sequence[str], jobs: Sequence[Any], run: Callable[[Any], dict[str, Any]], *,
    workers: int, describe: Callable[[dict[str, Any]], str],
) -> None:
    """Run ``run(job)`` for every job in ``workers`` processes; append and flush its rows in job order as they come.

    ``run(job)`` returns one row or a list of rows (a run that yields one row per site, say);
    ``describe(row)`` is the progress line printed for each row. A job is submitted only when a worker is free.
    Under :func:`flwr_app.interrupt.run_stoppable` (Ctrl-C reaches the workers too; they ignore it):

    * a first signal stops the grid after the runs under way: no further run starts, their rows are written,
      and :class:`~flwr_app.interrupt.StopRequested` says how many rows the file holds;
    * a second signal stops at once: the workers are killed and the rows of the runs under way are lost.

    A run that raises stops the grid the same way as a first signal, then its error is raised.
    """
    from flwr_app.interrupt import StopRequested, raise_before_run

    path.parent.mkdir(parents=True, exist_ok=True)
    new_file = not path.exists()
    # spawned, not forked: a fork of a process whose threads (torch's, an earlier in-process run's) hold a lock can
    # leave the worker waiting on that lock for ever (a grid run from the test suite hung so)
    context = multiprocessing.get_context("spawn")
    with path.open("a", newline="") as handle, ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                                                   initializer=_leave_signals_to_parent) as pool:
        writer = csv.DictWriter(handle, fieldnames=list(fields))
        if new_file:
            writer.writeheader()
        written = itertools.count(1)

        def write(result: dict[str, Any] | list[dict[str, Any]]) -> None:
            rows = result if isinstance(result, list) else [result]
            writer.writerows(rows)
            handle.flush()
            for row in rows:
                print(f"[{next(written)}/{len(jobs)}] {describe(row)}", flush=True)

        queue = iter(jobs)
        running = [pool.submit(run, job) for job in itertools.islice(queue, workers)]  # in job order
        try:
            while running:
                wait(running, return_when=FIRST_COMPLETED)
                while running and running[0].done():  # the rows of the oldest runs, in job order
                    write(running.pop(0).result())
                raise_before_run()  # a stop was requested (interrupt.run_stoppable): no further run starts
                busy = sum(not future.done() for future in running)
                running += [pool.submit(run, job) for job in itertools.islice(queue, workers - busy)]
        except KeyboardInterrupt:  # a second signal (interrupt.Interrupted), or Ctrl-C without run_stoppable
            _stop_at_once(pool)
            raise
        except StopRequested as stop:
            _finish(running, write, pool)
            with path.open(newline="") as rows_file:
                rows = sum(1 for _ in csv.DictReader(rows_file))
            raise StopRequested(f"{signal.Signals(stop.signum).name}: the grid stopped after its runs under way; "
                                f"{path} holds {rows} rows (the same command runs the rest)",
                                signum=stop.signum, completed=rows) from None
        except BaseException:
            _finish(running, write, pool)
            raise


def _finish(running: list[Any], write: Callable[[Any], None], pool: ProcessPoolExecutor) -> None:
    """Wait for the runs under way and write the rows of those that succeed, in job order (a second signal: at once)."""
    try:
        for future in running:
            try:
                write(future.result())
            except Exception:  # noqa: BLE001 - the grid is stopping already; the first error is the one raised
                continue
    except KeyboardInterrupt:
        _stop_at_once(pool)
        raise


def _stop_at_once(pool: ProcessPoolExecutor) -> None:
    """Kill the grid's workers (they ignore SIGINT and SIGTERM; a grid's process has no other child processes) and
    drop the runs not started."""
    for child in multiprocessing.active_children():
        child.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _leave_signals_to_parent() -> None:
    """A grid's worker ignores SIGINT and SIGTERM: Ctrl-C reaches the whole process group, and the parent stops the
    grid (:func:`append_runs`) instead of each worker dying mid-run (the pool would break with a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


#: The paths whose uncommitted changes would change what a run computes (docs and reports do not).
RUN_CODE = ("models", "strategies", "flwr_app", "conf", "pyproject.toml", "simulations/engine.py")


def code_commit() -> str:
    """The checked-out commit, with ``+`` when ``RUN_CODE`` has uncommitted changes; "" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=PROJECT)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *RUN_CODE],
                               capture_output=True, text=True, check=True, cwd=PROJECT)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
