"""Run one experiment: the ServerApp and ClientApp of ``pyproject.toml``, from Python. The one runner.

:func:`run_simulation` fuses the run config (pyproject defaults + overrides, validated by
:func:`resolve`), checks the outputs, and runs the same apps over one of two engines, with the
same run.log, signal handling and outputs (``simulation.engine``; ``auto`` picks by the
federation's size and whether a Ray cluster is running, :func:`choose_engine`):

* ``ray``: Flower's simulation engine, as ``flwr run .`` (through a SuperLink) uses: the sites run
  in parallel in their own processes (Ray actors), on a cluster ``RAY_ADDRESS`` names (a sweep's,
  :func:`ray_cluster`, or the user's, of one machine or many) or on a Ray instance started for the
  run. Through Flower's public ``flwr.simulation.run_simulation``, which gives the apps an empty run
  config: it runs a ``ServerApp`` whose main calls :data:`flwr_app.server_app.app` with the run's
  config, and :class:`flwr_app.client_app.SimulatedSites` (:data:`flwr_app.client_app.app` with the
  run's config and node configs).
* ``inprocess``: :class:`~simulations.inprocess.InProcessGrid`, a Flower ``Grid`` whose nodes are ClientApp
  calls in this process, one site at a time, and from :data:`~simulations.inprocess.PARALLEL_MIN_SITES` sites on
  in one worker process per further CPU as well: no Ray start. :func:`run_inprocess` forces it
  and takes what only it offers: ``transform`` changes the reply the server receives (a hostile
  site's message, injected on the wire), ``observe`` sees every message and its reply (audits of
  what the server received), and ``node_configs`` runs a deployment's sites, each reading its own
  file. Tests check that both engines give the same run.

A split run's simulated sites keep their trained encoders in the run's directory: each gets node
config ``model-dir = <output dir>/sites/<modality>`` (:func:`site_node_configs`; in a deployment the
site's admin sets it, or not), so :func:`models.split_run.load_split_run` finds the whole model there.

Flower's simulation runtime looks for new messages to the virtual SuperNodes every 0.1 s, which
adds about 50 ms to every message round trip on Ray (two per FedAvg round, one per split-learning
batch); no public setting changes it, and the in-process engine, the default up to
:data:`~strategies.config.INPROCESS_MAX_SITES` sites, does not pay it (``docs/howto/experiments.md``,
"Which engine").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flwr.simulation
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from flwr_app import client_app, interrupt, runlog, server_app, task, vertical_client, vertical_task
from flwr_app.config import ConfigError, ExperimentConfig, resolve
from flwr_app.outputs import RunOutputs
from models.split_run import SITES_DIR
from simulations.inprocess import InProcessGrid, new_run_id, site_processes
from strategies.config import AUTO, ENGINES, INPROCESS_MAX_SITES
from strategies.mechanisms.registry import get_mechanism


def site_node_configs(cfg: ExperimentConfig, outputs: RunOutputs, num_sites: int) -> list[dict[str, Any]]:
    """The simulated sites' node configs: ``partition-id`` and ``num-partitions`` (as Flower's simulation gives them)
    and, for a split run, ``model-dir``: ``<output dir>/sites/<modality>`` of the partition's modality, where the
    site keeps its trained encoder (:func:`flwr_app.vertical_client.save`)."""
    configs: list[dict[str, Any]] = [{PARTITION_ID_KEY: index, NUM_PARTITIONS_KEY: num_sites}
                                     for index in range(num_sites)]
    if cfg.strategy == "split":
        for config, modality in zip(configs, vertical_task.load_table(cfg).modalities, strict=True):
            config[vertical_client.MODEL_DIR_KEY] = str(outputs.directory / SITES_DIR / modality)
    return configs


def _ray_environment() -> None:
    """Ray's settings for every run, set before the first ``ray.init`` or ``ray start`` (unless the user set them).

    ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` is the setting Ray's FutureWarning asks for ("In future
    versions of Ray, Ray will no longer override accelerator visible devices env var if num_gpus=0"):
    the sites ask for no GPU and the models run on the CPU, so the future default changes nothing
    and the warning is not printed. ``RAY_DEDUP_LOGS=0``: a site's lines are not merged with others'.
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


@contextlib.contextmanager
def ray_cluster(*, num_cpus: int | None = None, start_timeout_s: float = 120.0) -> Iterator[str]:
    """A local Ray cluster that every :func:`run_simulation` of the block connects to; yields its address.

    Without it each run starts Ray and shuts it down again (about 4 s of a run on 2 cores). A
    sweep starts one cluster (``ray start --head --block`` in its own process group), and each run
    connects to it through ``RAY_ADDRESS`` in a fraction of a second. Runs share no state: each is
    its own Ray job, with its own actors and worker processes, gone when the run ends. The
    cluster is stopped when the block ends, also on error. If ``RAY_ADDRESS`` is already set (a
    cluster of the user's), the block uses it and leaves it running.

    Parameters
    ----------
    num_cpus
        CPUs the cluster offers (default: all of the machine's).
    start_timeout_s
        How long to wait for the cluster to accept a connection.
    """
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    _ray_environment()
    import ray

    head, log, temp_dir, command, port = _start_head(num_cpus)
    address = f"127.0.0.1:{port}"
    stop = functools.partial(_stop_cluster, head, log, temp_dir)
    atexit.register(stop)  # also when the block is left by an interrupt that ends the program (a Hydra sweep's ^C)
    try:
        _wait_for_head(head, log, command, port, start_timeout_s)
        ray.init(address=address, include_dashboard=False, log_to_driver=False)  # wait until it takes jobs
        ray.shutdown()
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        if ray.is_initialized():
            ray.shutdown()
        stop()
        atexit.unregister(stop)


def _start_head(num_cpus: int | None) -> tuple[subprocess.Popen, Any, str, list[str], int]:
    """Start ``ray start --head --block`` on a free local port in its own process group; return the process, its
    log file, its temporary directory, the command and the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Its own temporary directory: `ray start` records the cluster's address in <temp dir>/ray_current_cluster, and a
    # later ray.init() without an address (a run after the block) would try to connect to the stopped cluster.
    temp_dir = tempfile.mkdtemp(prefix="fedsurv-ray-")
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
               f"--num-cpus={num_cpus or os.cpu_count()}", "--include-dashboard=false", "--disable-usage-stats",
               f"--temp-dir={temp_dir}"]
    log = tempfile.TemporaryFile()  # not a pipe: an unread pipe could fill up and block the cluster
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return head, log, temp_dir, command, port


def _wait_for_head(head: subprocess.Popen, log: Any, command: list[str], port: int, timeout_s: float) -> None:
    """Wait until the cluster :func:`_start_head` started accepts a connection on ``port``; ``RuntimeError`` (with
    the end of its log) if it exits first, or if ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"'{' '.join(command)}' exited with {head.returncode}: "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster at 127.0.0.1:{port} did not start within {timeout_s:g} s")
            time.sleep(0.1)


def _stop_cluster(head: subprocess.Popen, log: Any, temp_dir: str) -> None:
    """Stop the cluster :func:`ray_cluster` started and remove its files (again: nothing)."""
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the cluster's processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def _ray_started(*, log_to_driver: bool) -> Iterator[None]:
    """Ray for the block: started (or joined, on the cluster ``RAY_ADDRESS`` names) by ``ray.init`` in this thread,
    with this process's SIGINT and SIGTERM handlers (:func:`flwr_app.interrupt.stop_on_signals`) as they were
    before it; shut down when the block ends. Flower's Ray backend then uses that Ray as it is.

    ``ray.init`` changes what SIGTERM does to the process that calls it: the Ray node it starts and
    ``ray.init`` itself set a Python handler that exits at once, and the driver's core worker installs
    Abseil's failure-signal handler, which prints a stack trace on SIGTERM and ends the process. Either
    would end the main thread in the middle of a round while the ServerApp's thread waits for replies
    that never come. In the main thread, setting the handlers again right after ``ray.init``
    (``signal.signal`` installs the interpreter's own C handler) undoes both; the failure-signal handler
    of the other signals (a native crash's stack trace) stays. ``tests/test_interrupt.py`` checks that
    a SIGTERM in the block reaches the handler and leaves the process running.

    Ray's workers import this process's modules: their ``PYTHONPATH`` is this process's ``sys.path``
    followed by its ``PYTHONPATH``, as Flower's backend sets it when it starts Ray itself.
    """
    import ray

    handlers = {signum: signal.getsignal(signum) for signum in interrupt.SIGNALS}
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, include_dashboard=False,
             log_to_driver=log_to_driver)
    try:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in handlers.items():
                if handler is not None:  # None: a handler not set from Python, which Python cannot set again
                    signal.signal(signum, handler)
        yield
    finally:
        if ray.is_initialized():  # Flower's backend shuts it down when the run ends; not when the run fails to start
            ray.shutdown()


def _is_ray_process(process: Any, ray_dir: str) -> bool:
    """A Ray daemon (a program or script of the ``ray`` package) or worker (``ray::...``)."""
    cmdline = process.cmdline()
    return process.name().startswith("ray::") or (bool(cmdline) and cmdline[0].startswith("ray::")) or \
        any(arg.startswith(ray_dir) for arg in cmdline)


@contextlib.contextmanager
def _ray_processes_ended(*, interval_s: float = 1.0, grace_s: float = 5.0) -> Iterator[None]:
    """Make sure that the Ray processes started while the block runs are gone when it ends.

    Flower's backend ends a run with ``ray.shutdown()``, which stops Ray's daemons, but the
    site actors (``ray::ClientAppActor``) exit only once they notice that their raylet is gone:
    seconds to minutes after the run. A thread notes this process's Ray descendants while the
    block runs; when it ends, those still alive get SIGTERM, and SIGKILL after ``grace_s``
    seconds. With ``RAY_ADDRESS`` set (a cluster of :func:`ray_cluster` or the user's) nothing
    is done: the cluster ends its jobs' workers.
    """
    if os.environ.get("RAY_ADDRESS"):
        yield
        return
    import ray  # Ray bundles psutil (ray/thirdparty_files), which it puts on the path
    import psutil

    ray_dir = os.path.dirname(ray.__file__) + os.sep
    me = psutil.Process()
    seen: dict[int, Any] = {}
    done = threading.Event()

    def note() -> None:
        for process in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.pid not in seen and _is_ray_process(process, ray_dir):
                    seen[process.pid] = process

    def watch() -> None:
        while not done.wait(interval_s):
            with contextlib.suppress(psutil.Error):
                note()

    watcher = threading.Thread(target=watch, name="fedsurv-ray-processes", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        with contextlib.suppress(psutil.Error):
            note()
        alive = [process for process in seen.values() if process.is_running()]  # is_running: not a reused PID
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=grace_s)


def strategy_overrides(strategy: str, shared: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``shared`` without the mechanism keys that ``strategy`` does not honour (it would refuse them: e.g.
    ``train.local_epochs`` for ``distributed_dp``, whose round is one gradient step), and the keys left out."""
    from strategies.config import mechanism_keys
    from strategies.mechanisms.registry import get_mechanism

    honours, keys = get_mechanism(strategy).honours, set(mechanism_keys())
    dropped = tuple(key for key in shared if key in keys and key not in honours)
    return {key: value for key, value in shared.items() if key not in dropped}, dropped


def _prepare(overrides: Mapping[str, Any], runner: str) -> tuple[dict[str, Any], ExperimentConfig, RunOutputs]:
    """The fused and parsed run config of ``overrides``, and the run's outputs (checked before anything runs).

    Raises
    ------
    ConfigError
        For a bad run config, no ``output.dir`` (nor ``resume.from``) to read the summary from, or an
        ``output.dir`` that holds another run.
    """
    fused, cfg = resolve(overrides)
    if not cfg.output_dir and not cfg.resume_from:
        raise ConfigError(f"{runner} needs 'output.dir' (or 'resume.from') so that it can read the run's summary")
    return fused, cfg, RunOutputs.create(cfg)  # refuses a directory that holds another run


def _num_sites(cfg: ExperimentConfig) -> int:
    """Simulated sites of ``cfg``: one per modality for split learning, else the data set's sites (for a
    natural partition the number of groups, known only once the data are loaded)."""
    if get_mechanism(cfg.strategy).vertical:
        return len(vertical_task.load_table(cfg).modalities)
    return task.load_federation(cfg).num_sites


# ------------------------------------------------------------------ the runner and its two engines

#: The engines that carry a simulation's messages (``simulation.engine``; ``auto`` picks one: :func:`choose_engine`).
RAY, INPROCESS = "ray", "inprocess"


def choose_engine(engine: str, num_sites: int) -> str:
    """The engine that runs a federation of ``num_sites`` sites: ``engine``, unless it is ``auto``.

    ``auto`` is Ray while ``RAY_ADDRESS`` names a running cluster (a sweep's, :func:`ray_cluster`, or
    one the user started for their runs), else the in-process grid up to
    :data:`~strategies.config.INPROCESS_MAX_SITES` sites and Ray above: up to there the in-process
    grid is faster, since it pays no Ray start, no actors and no serialisation, while Ray runs
    the sites in parallel, which pays off once a round has many sites' training to do
    (the measurements: ``docs/howto/experiments.md``, "Which engine").
    """
    if engine not in ENGINES:
        raise ConfigError(f"simulation.engine = {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine != AUTO:
        return engine
    if os.environ.get("RAY_ADDRESS"):
        return RAY
    return INPROCESS if num_sites <= INPROCESS_MAX_SITES else RAY


def run_simulation(overrides: Mapping[str, Any], *, engine: str | None = None, cpus_per_site: float = 1.0,
                   verbose: bool = False, observe: Callable[[Message, Message], None] | None = None,
                   transform: Callable[[Message, Message], Message] | None = None,
                   node_configs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Run one experiment with the ServerApp and ClientApp of ``pyproject.toml`` and return its ``summary.json``.

    The one runner of every simulation (``python -m simulations.run``, the sweeps, :func:`fedsurv.fit`,
    the tests and benchmarks); ``engine`` (default: the run config's ``simulation.engine``,
    :func:`choose_engine`) picks what carries the messages:

    * ``"ray"``: Flower's simulation engine, one Ray actor per site, the sites in parallel
      (``cpus_per_site`` CPUs each); on the cluster ``RAY_ADDRESS`` names if set
      (:func:`ray_cluster`, or the user's), else on a Ray instance started for the run.
    * ``"inprocess"``: :class:`InProcessGrid`, the sites one at a time in this process and, from
      :data:`~simulations.inprocess.PARALLEL_MIN_SITES` sites on, in one worker process per further CPU
      (:func:`~simulations.inprocess.site_processes`; ``summary["engine"]["processes"]``).
      ``observe``, ``transform`` and ``node_configs`` are for this engine only (:class:`InProcessGrid`).

    The number of sites is the data set's (for a natural partition the number of groups, known
    only once the data are loaded; for split learning the number of modalities), or the number
    of ``node_configs``. Either engine keeps the same promises:

    * In the main thread, SIGINT and SIGTERM stop the run after the round in progress, with its
      checkpoint written (:mod:`flwr_app.interrupt`), and a second signal stops it at once. No
      run starts once a stop was requested (:func:`flwr_app.interrupt.run_stoppable`).
    * An error is written with its traceback to the run's ``run.log`` (:mod:`flwr_app.runlog`);
      unless ``verbose``, the records of Flower's logger (warnings and errors, e.g. every failed
      message of a site) go there only.
    * When the function returns or raises, no Ray process it started is left.

    Raises
    ------
    ConfigError
        For a bad run config, fewer sites than ``federation.min_sites``, or an ``output.dir`` that
        holds another run (checked before any engine starts).
    flwr_app.interrupt.StopRequested
        When a signal stopped the run between two rounds (split learning: epochs).
    flwr_app.interrupt.Interrupted
        When a second signal stopped it at once.
    """
    return _run(overrides, engine=engine, cpus_per_site=cpus_per_site, verbose=verbose, observe=observe,
                transform=transform, node_configs=node_configs)


def run_inprocess(overrides: Mapping[str, Any], *, observe: Callable[[Message, Message], None] | None = None,
                  transform: Callable[[Message, Message], Message] | None = None,
                  node_configs: Sequence[Mapping[str, Any]] | None = None, verbose: bool = False) -> dict[str, Any]:
    """:func:`run_simulation` over :class:`InProcessGrid` whatever ``simulation.engine`` says; return the summary.

    Any strategy, horizontal or split, with one node per site (split: per modality), or one per
    entry of ``node_configs`` (a deployment's sites, each reading its own file; default
    :func:`site_node_configs`: a split run's sites keep their encoders in the run's directory).
    ``transform(message, reply)`` returns the reply the server receives (a hostile site's, or
    :class:`~simulations.inprocess.DropReply` for none) and ``observe(message, reply)`` sees every
    message and that reply (:class:`InProcessGrid`; the sites then run in this process only).
    Whatever the ServerApp raises (a failed run, :class:`flwr_app.interrupt.StopRequested` after a
    requested stop) propagates.
    """
    return _run(overrides, engine=INPROCESS, cpus_per_site=1.0, verbose=verbose, observe=observe,
                transform=transform, node_configs=node_configs)


def _run(overrides: Mapping[str, Any], *, engine: str | None, cpus_per_site: float, verbose: bool,
         observe: Callable[[Message, Message], None] | None,
         transform: Callable[[Message, Message], Message] | None,
         node_configs: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The runner behind :func:`run_simulation` and :func:`run_inprocess` (which a test may replace separately)."""
    interrupt.raise_before_run()
    fused, cfg, outputs = _prepare(overrides, "run_simulation")
    simulated = node_configs is None
    num_sites = _num_sites(cfg) if node_configs is None else len(node_configs)
    chosen = choose_engine(engine or cfg.engine, num_sites)
    seams = {"observe": observe, "transform": transform}
    if chosen == RAY and (any(seam is not None for seam in seams.values()) or node_configs is not None):
        raise ValueError("transform, observe and node_configs need engine='inprocess'")
    if node_configs is None:
        node_configs = site_node_configs(cfg, outputs, num_sites)
    processes = 1 if chosen == RAY or any(seam is not None for seam in seams.values()) else site_processes(num_sites)
    with runlog.run_log(outputs.directory), interrupt.stop_on_signals(), \
            _ray_processes_ended() if chosen == RAY else contextlib.nullcontext():
        with interrupt.at_once_allowed():
            if simulated and not get_mechanism(cfg.strategy).vertical and num_sites < cfg.federation.min_sites:
                raise ConfigError(
                    f"the federation has {num_sites} site(s) but federation.min_sites = {cfg.federation.min_sites}"
                )
            with _flower_log(outputs, verbose):
                if chosen == RAY:
                    _run_on_ray(fused, node_configs, cpus_per_site=cpus_per_site, verbose=verbose)
                else:
                    _run_in_process(fused, node_configs, seams=seams, processes=processes)
    summary = json.loads(outputs.summary_path.read_text(encoding="utf-8"))
    summary["engine"] = {"requested": engine or cfg.engine, "ran": chosen, "sites": num_sites}
    if chosen == INPROCESS:
        summary["engine"]["processes"] = processes
    outputs.write_summary(summary)
    return summary


@contextlib.contextmanager
def _flower_log(outputs: RunOutputs, verbose: bool) -> Iterator[None]:
    """Unless ``verbose``, Flower's logger records warnings and errors only, in the run's ``run.log`` only."""
    if verbose:
        yield
        return
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)
    try:
        with runlog.logger_records("flwr", outputs.directory):
            yield
    finally:
        flwr_logger.setLevel(level)


def _run_on_ray(fused: dict[str, Any], node_configs: Sequence[Mapping[str, Any]], *, cpus_per_site: float,
                verbose: bool) -> None:
    """The Ray engine: ``flwr.simulation.run_simulation`` with the apps of :func:`ray_apps`."""
    _ray_environment()
    server, sites = ray_apps(fused, node_configs)
    with _ray_started(log_to_driver=verbose):
        flwr.simulation.run_simulation(
            server_app=server,
            client_app=sites,
            num_supernodes=len(node_configs),
            backend_name="ray",
            backend_config={"client_resources": {"num_cpus": cpus_per_site, "num_gpus": 0.0}},
            verbose_logging=verbose,
        )


def ray_apps(fused: Mapping[str, Any], node_configs: Sequence[Mapping[str, Any]]) -> tuple[ServerApp, ClientApp]:
    """The ServerApp and ClientApp that ``flwr.simulation.run_simulation`` runs for the Ray engine.

    That runtime gives the ServerApp and every virtual SuperNode an empty run config, and the
    SuperNodes node config ``partition-id`` and ``num-partitions`` only. The ServerApp calls
    :data:`flwr_app.server_app.app` with run config ``fused`` (the runtime's grid, run ID and
    state); the ClientApp is :class:`flwr_app.client_app.SimulatedSites`, which adds the other keys
    of ``node_configs[partition-id]`` (a split site's ``model-dir``) to the two Flower gives
    (:func:`site_node_configs`' own).
    """
    extra = {index: keys for index, config in enumerate(node_configs)
             if (keys := {key: value for key, value in config.items()
                          if key not in (PARTITION_ID_KEY, NUM_PARTITIONS_KEY)})}
    run_config = dict(fused)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        server_app.app(grid, Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                                     state=context.state, run_config=dict(run_config)))

    return server, client_app.SimulatedSites(run_config, extra)


def _run_in_process(fused: dict[str, Any], node_configs: Sequence[Mapping[str, Any]], *,
                    seams: Mapping[str, Callable[[Message, Message], Any] | None], processes: int) -> None:
    """The in-process engine: the ServerApp in this thread over :class:`InProcessGrid` (with ``seams``: its
    ``observe`` and ``transform``), the sites in ``processes`` processes (this one and workers)."""
    run_id = new_run_id()  # one per run, as a SuperLink's: a site's ledger tells two runs apart
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    grid = InProcessGrid(client_app.app, fused, len(node_configs), **seams, node_configs=node_configs,
                         processes=processes, run_id=run_id)
    try:
        server_app.app(grid, Context(run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={},
                                     state=RecordDict(), run_config=fused))
    finally:
        grid.close()
