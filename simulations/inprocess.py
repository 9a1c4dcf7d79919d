"""The in-process engine's grid: a Flower ``Grid`` whose nodes are ClientApp calls in this process and, for a
large federation, in worker processes (:class:`InProcessGrid`).

This module imports the ClientApp's light path only (not the ServerApp, not Ray), so that a worker process
(``python -m simulations.inprocess``) starts in about a second.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from strategies.config import PARALLEL_MIN_SITES

__all__ = ["PARALLEL_MIN_SITES", "DropReply", "InProcessGrid", "new_run_id", "site_processes"]

_log = logging.getLogger(__name__)


def new_run_id() -> int:
    """A fresh run ID, as Flower's SuperLink draws one: a random positive 63-bit integer (a site's ledger tells runs
    apart by it)."""
    return secrets.randbelow(2**63 - 1) + 1


def site_processes(num_sites: int, *, cpus: int | None = None) -> int:
    """How many processes (this one and workers) carry an in-process simulation of ``num_sites`` sites: one per CPU
    this process may use (``cpus``), from :data:`PARALLEL_MIN_SITES` sites on on Linux and macOS; else 1."""
    if num_sites < PARALLEL_MIN_SITES or os.name != "posix":
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, num_sites))


class DropReply(Exception):
    """Raised by an :class:`InProcessGrid`'s ``transform`` to leave a message without a reply."""


class _Courier:
    """A daemon thread that delivers batches of messages, one message after another, each given up to a timeout.

    One thread serves a grid's batches for as long as none hangs, and the caller sleeps until its
    batch is done or the message in progress has run out of time: a thread per message (or per
    batch) would pay PyTorch's set-up of a thread's first forward and backward pass (about 4 and
    10 ms on 2 cores, against a 1 ms training step of a small site: 1000 sites, 12 s a round), and
    waking the caller after every message costs the delivering thread the GIL that often.
    """

    def __init__(self, deliver: Callable[[Message], None]) -> None:
        self._deliver = deliver
        self._changed = threading.Condition()
        self._batch: Sequence[Message] = ()
        self._claimed = 0  # messages of the batch taken; the last one is in progress or done
        self._started = 0.0  # when the last one taken started
        self._busy = False  # a batch is given and not finished
        self._ended = False  # the thread has ended, or is to end once its message returns
        threading.Thread(target=self._serve, daemon=True, name="inprocess-grid").start()

    def _serve(self) -> None:
        try:
            while (taken := self._take()) is not None:
                try:
                    self._deliver(taken)
                except Exception:  # as a thread per message would: reported, and the next message still delivered
                    logging.getLogger(__name__).exception("an in-process delivery failed")
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _take(self) -> Message | None:
        """The next message to deliver, its start noted (waiting for a batch); None once the courier is to end."""
        with self._changed:
            while not self._ended:
                if self._busy and self._claimed < len(self._batch):
                    self._claimed, self._started = self._claimed + 1, time.monotonic()
                    return self._batch[self._claimed - 1]
                if self._busy:  # the batch is done
                    self._busy = False
                    self._changed.notify_all()
                self._changed.wait()
            return None

    def deliver(self, messages: Sequence[Message], timeout: float | None) -> int:
        """Deliver ``messages`` in turn; return how many are done with: all of them, or those up to the first that
        has not returned within ``timeout`` seconds of its start (its ClientApp keeps the thread, and the courier
        takes no other message)."""
        with self._changed:
            self._batch, self._claimed, self._started, self._busy = messages, 0, time.monotonic(), True
            self._changed.notify_all()
            while self._busy and not self._ended:
                remaining = None if timeout is None else self._started + timeout - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._ended = True
                    return self._claimed
                self._changed.wait(remaining)
            return self._claimed if self._busy else len(messages)  # busy: the thread ended by an error

    @property
    def ended(self) -> bool:
        """The courier takes no more messages (it gave up on a hung one, was closed, or its thread failed)."""
        return self._ended

    def close(self) -> None:
        """End the thread (once the message it runs, if any, has returned)."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()


class InProcessGrid(Grid):
    """A Flower ``Grid`` whose nodes are calls of ``client_app`` (simulated sites) in this process and, with
    ``processes > 1``, in ``processes - 1`` worker processes.

    Node ``i + 1`` is partition ``i`` (node config ``partition-id``, ``num-partitions``) with its
    own ``context.state``, which, as in Flower's simulation engine, changes only when the ClientApp
    returns; a ClientApp that raises gives an error reply (worded as Flower's) and leaves the node
    state as it was. This process's messages run one at a time in the order given, in one thread
    (:class:`_Courier`), each waited for up to ``timeout`` seconds (the real sites run in parallel, each
    within the round's timeout); a ClientApp that has not returned by then gives no reply and keeps
    running in that daemon thread, as a hung site would, and the messages after it go to a new thread.

    With ``processes > 1`` the nodes are cut into that many contiguous shares: the first stays here, each
    other one lives in a worker process (:class:`_Worker`) that delivers its messages the same way while
    this process delivers its own, keeps its nodes' states, and sends back the replies and its log records.
    A worker that ends or stops answering leaves its sites without replies (named failures at the server),
    never the run hanging. Each site's computation is seeded by its own index, so a run gives the same
    results in any number of processes (tests). :meth:`close` ends the thread and the workers.

    Two seams between the sites and the server, for this process's messages only (``processes = 1``):
    ``transform(message, reply)``, when given, returns the reply the server receives instead of the
    one the ClientApp gave (the same or another :class:`~flwr.app.Message`: a hostile site's altered
    update, a forged count or privacy report, a relabelled reply), or raises :class:`DropReply` to
    leave the message without a reply, as a site that never answers; it sees error replies too. Tests
    and audits inject an attack there, on the message the server gets, not in the server's code.
    ``observe(message, reply)``, when given, then sees every message and the reply the server
    receives (audits that need what the server received, e.g. the sites' updates or embeddings;
    tests of what a site was sent). Any other exception of either fails the run (:meth:`send_and_receive`).

    ``node_configs`` replaces the simulated partitions with the given node configs (a deployment's
    ``data-path`` per site, ``data.name = "site_files"``), node ``i + 1`` getting ``node_configs[i]``
    (``nodes[i]`` where given). ``run_id``: the run's ID, the same in every process
    (default: a new one, :func:`new_run_id`), in :attr:`run_id` and every node's context.
    """

    def __init__(self, app: ClientApp, run_config: Mapping[str, Any], num_nodes: int, *,
                 observe: Callable[[Message, Message], None] | None = None,
                 transform: Callable[[Message, Message], Message] | None = None,
                 node_configs: Sequence[Mapping[str, Any]] | None = None, processes: int = 1,
                 nodes: Sequence[int] | None = None, run_id: int | None = None) -> None:
        if node_configs is None:
            node_configs = [{PARTITION_ID_KEY: index, NUM_PARTITIONS_KEY: num_nodes} for index in range(num_nodes)]
        elif len(node_configs) != num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        if processes > 1 and (observe is not None or transform is not None):
            raise ValueError("observe and transform see the messages of this process only: use processes = 1")
        configs = dict(zip(nodes or range(1, num_nodes + 1), map(dict, node_configs), strict=True))
        shares = _shares(list(configs), max(1, min(processes, num_nodes)))
        self.app = app
        self.observe = observe
        self.transform = transform
        self.run_id = new_run_id() if run_id is None else run_id
        self._run = Run.create_empty(run_id=self.run_id)
        self.contexts = {node: Context(run_id=self.run_id, node_id=node, node_config=configs[node],
                                       state=RecordDict(), run_config=dict(run_config)) for node in shares[0]}
        self.replies: dict[str, Message] = {}
        self.timeout: float | None = None
        self.observer_error: Exception | None = None
        self._lock = threading.Lock()
        self._courier: _Courier | None = None
        self._workers = [_Worker(dict(run_config), {node: configs[node] for node in share}, self.run_id)
                         for share in shares[1:]]
        self._worker_of = {node: worker for worker in self._workers for node in worker.nodes}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    @property
    def processes(self) -> int:
        """This process and its workers."""
        return 1 + len(self._workers)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted([*self.contexts, *self._worker_of])

    def _deliver(self, message: Message) -> None:
        """Run the node's ClientApp on ``message``; keep its reply (or error) and, on success, its node state."""
        node = message.metadata.dst_node_id
        stored = self.contexts[node]
        context = Context(run_id=stored.run_id, node_id=node, node_config=stored.node_config,
                          state=copy.deepcopy(stored.state), run_config=stored.run_config)
        try:
            reply = self.app(message, context)
            with self._lock:
                stored.state = context.state
        except Exception as err:  # as Flower's simulation engine: every exception becomes an error reply
            wrapped = ClientAppException(str(err))
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(wrapped)}:<'{wrapped}'>"),
                            reply_to=message)
        try:
            if self.transform is not None:
                reply = self.transform(message, reply)
            reply.metadata.__dict__["_message_id"] = str(uuid4())
            if self.observe is not None:
                self.observe(message, reply)
        except DropReply:
            return
        except Exception as err:  # a seam's bug must fail the run, not leave the server waiting
            self.observer_error = err
        with self._lock:
            self.replies[message.metadata.message_id] = reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message, waiting up to :attr:`timeout` seconds for its ClientApp: the workers' shares are
        sent first, then this process's are delivered in turn while the workers deliver theirs."""
        batch, here = [], []
        shares: dict[_Worker, list[Message]] = collections.defaultdict(list)
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in self.contexts and node not in self._worker_of:
                raise ValueError(f"no node {node} in this in-process federation")
            message.metadata.__dict__["_message_id"] = str(uuid4())
            batch.append(message)
            (here if node in self.contexts else shares[self._worker_of[node]]).append(message)
        for worker, share in shares.items():
            worker.send(share, self.timeout)
        self.deliver(here)
        for worker in shares:
            replies = worker.receive()
            with self._lock:
                self.replies.update(replies)
        return [message.metadata.message_id for message in batch]

    def deliver(self, batch: Sequence[Message]) -> None:
        """Deliver ``batch`` (messages to this process's nodes, with their IDs) in turn in the courier's thread."""
        done = 0
        while done < len(batch):  # after a hung message, the rest go to a new courier
            if self._courier is None:
                self._courier = _Courier(self._deliver)
            done += self._courier.deliver(batch[done:], self.timeout)
            if self._courier.ended:
                self._courier = None

    def close(self) -> None:
        """End the courier's thread (a later message starts a new one) and the worker processes."""
        if self._courier is not None:
            self._courier.close()
            self._courier = None
        for worker in self._workers:
            worker.close()
        self._workers, self._worker_of = [], {}

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return list(self.take_replies(message_ids).values())

    def take_replies(self, message_ids: Iterable[str]) -> dict[str, Message]:
        """The replies there are to ``message_ids``, by message ID, each handed out once."""
        with self._lock:
            return {message_id: self.replies.pop(message_id) for message_id in message_ids
                    if message_id in self.replies}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        self.timeout = timeout
        replies = self.pull_messages(self.push_messages(messages))
        if self.observer_error is not None:
            raise RuntimeError(f"the observer or transform of InProcessGrid raised: {self.observer_error!r}") \
                from self.observer_error
        return replies


def _shares(nodes: list[int], count: int) -> list[list[int]]:
    """``nodes`` cut into ``count`` contiguous shares whose sizes differ by at most one."""
    size, extra = divmod(len(nodes), count)
    bounds = [index * size + min(index, extra) for index in range(count + 1)]
    return [nodes[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


class _Worker:
    """A worker process that holds some nodes and delivers their messages (:func:`_serve`), and its pipe.

    Started as ``python -m simulations.inprocess`` (this module's light imports only, not the caller's main
    module, which ``multiprocessing``'s spawn would import again), in its own session so that the terminal's
    Ctrl-C reaches the parent only (which then closes the grid); it ends when its pipe closes, with the parent.
    """

    #: Seconds a worker gets to end when the grid closes before it is killed.
    CLOSE_S = 5.0

    def __init__(self, run_config: dict[str, Any], configs: dict[int, dict[str, Any]], run_id: int) -> None:
        self.nodes = list(configs)
        self._connection, theirs = multiprocessing.Pipe()
        path = os.pathsep.join(entry for entry in sys.path if entry)  # the modules this process imports
        self._process = subprocess.Popen(
            [sys.executable, "-m", "simulations.inprocess", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "PYTHONPATH": path})
        theirs.close()
        self._connection.send((run_config, configs, run_id))
        self._waiting = 0
        self._timeout: float | None = None

    def send(self, messages: list[Message], timeout: float | None) -> None:
        """Hand ``messages`` to the worker (nothing, once it has ended: they get no reply)."""
        self._waiting, self._timeout = len(messages), timeout
        if not self._connection.closed:  # closed: the worker has ended
            try:
                self._connection.send((messages, timeout))
            except (OSError, ValueError) as err:
                self._end(f"it could not be sent its messages ({err!r})")

    def receive(self) -> dict[str, Message]:
        """The replies to the messages last sent (by message ID), with the worker's log records logged here; none
        from a worker that has ended, or has not answered within the most its messages may take (each its
        timeout, plus a minute)."""
        if self._connection.closed:
            return {}
        limit = None if self._timeout is None else self._timeout * self._waiting + 60.0
        try:
            if not self._connection.poll(limit):
                self._end(f"it has not answered within {limit:g} s")
                return {}
            replies, records = self._connection.recv()
        except (EOFError, OSError) as err:
            self._end(f"it ended ({err!r})")
            return {}
        for record in records:
            logging.getLogger(record.name).handle(record)
        return replies

    def _end(self, why: str) -> None:
        _log.error("the worker process of sites %s-%s gives no more replies: %s (exit code %s)", self.nodes[0],
                   self.nodes[-1], why, self._process.poll())
        self.close()

    def close(self) -> None:
        """Ask the worker to end; kill it if it has not within :attr:`CLOSE_S` seconds."""
        if self._connection.closed:
            return
        with contextlib.suppress(OSError, ValueError):
            self._connection.send(None)
        self._connection.close()
        try:
            self._process.wait(self.CLOSE_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class _KeptRecords(logging.Handler):
    """A worker's log records (warnings and above), kept to go back to the parent with the replies."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None  # the arguments need not pickle
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self.records.append(record)

    def take(self) -> list[logging.LogRecord]:
        records, self.records = self.records, []
        return records


def _serve(connection: Connection) -> None:
    """A worker process: take its run config, nodes and run ID, then deliver each batch it is sent to its nodes and send
    back the replies and its log records, until it is sent None or its parent has gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from flwr_app import client_app

    kept = _KeptRecords()
    logging.getLogger().addHandler(kept)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.handlers, flwr_logger.propagate = [kept], False
    flwr_logger.setLevel(logging.WARNING)
    grid: InProcessGrid | None = None
    try:
        run_config, configs, run_id = connection.recv()
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        grid = InProcessGrid(client_app.app, run_config, len(configs), node_configs=list(configs.values()),
                             nodes=list(configs), run_id=run_id)
        while (request := connection.recv()) is not None:
            messages, grid.timeout = request
            grid.deliver(messages)
            connection.send((grid.take_replies([message.metadata.message_id for message in messages]), kept.take()))
    except (EOFError, OSError):  # the parent has gone
        pass
    finally:
        if grid is not None:
            grid.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
