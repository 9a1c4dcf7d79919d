"""One experiment: ``python -m simulations.run [key=value ...]`` (Hydra overrides).

Examples
--------
``python -m simulations.run``                                   5-site FedAvg, hazard MLP, FLCHAIN
``python -m simulations.run model=cox_mlp federation.rounds=30``
``python -m simulations.run data=sba federation.partition=region``
``python -m simulations.run data=csv data.path=/abs/site.csv data.time_col=t data.event_col=e``

The run goes through the ServerApp and ClientApp of ``flwr_app``, carried by Flower's simulation
engine (Ray) or the in-process grid (``simulation.engine``: ``auto`` takes the in-process grid for
a small federation, Ray for a large one or on the cluster ``RAY_ADDRESS`` names;
:func:`simulations.engine.run_simulation`); with ``baseline.centralized=true`` (default) the same model is also trained on the
pooled training data and reported beside the federated result.

Checks. Before torch, Ray and Flower are imported (within about a second): the command line's keys
and group options (:func:`check_command_line`: an unknown one names the nearest), the run config's
values (:func:`flwr_app.config.resolve`), a horizontal run's data file, its partition into sites (at least
:data:`models.data.partition.MIN_SITE_RECORDS` records each) and the output directory
(:func:`flwr_app.config.check_inputs`).

Ending. The outputs go to Hydra's run directory (or ``output.dir``), which must not hold another
run; the run's log is its ``run.log``. A failed run prints one line on stderr, ``error: ...``, and
exits with 2 for a bad configuration or data (nothing was run) or 1 for an error during the run
(its traceback is in ``run.log``). Ctrl-C (SIGINT) or SIGTERM stops the run after the round in
progress, once its checkpoint is written, and exits with 130 or 143; ``resume.from=<run dir>``
continues it. A second signal stops it at once (the previous round's checkpoint stays). No Ray
process is left behind.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flwr_app import runlog
from flwr_app.config import (
    HYDRA_GROUPS,
    KEYS_PAGE,
    ConfigError,
    check_inputs,
    did_you_mean,
    resolve,
    unknown_keys_error,
)
from flwr_app.interrupt import StopRequested
from models.data import DataValidationError
from simulations.hydra_config import CONF_DIR, CONFIG_PATH, flatten
from strategies.config import KEYS

# torch, Ray and Flower are imported once the run config and the data file are checked (:func:`main`), so that a
# bad key, value or file is refused within a second or two.


#: Characters of a run-time error's message shown on the command line (all of it is in run.log).
MAX_LINE = 300


def exit_with(message: str, code: int) -> NoReturn:
    """Print ``message`` on stderr and end the process with ``code``.

    After a run stopped at once (a second signal) the ServerApp's thread may still wait for
    replies that will never come, and Python would wait for it before exiting: then the exit
    handlers run and the process ends without waiting.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    waiting = [thread for thread in threading.enumerate()
               if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]
    if waiting:
        atexit._run_exitfuncs()
        os._exit(code)
    sys.exit(code)


def describe_failure(err: BaseException, flat: dict[str, Any]) -> tuple[str, int]:
    """The one line that reports how ``run_simulation(flat)`` ended with ``err``, and the exit code."""
    if isinstance(err, (ConfigError, DataValidationError)):  # several problems of a file: one line, "; " between
        return "error: " + "; ".join(line.strip() for line in str(err).splitlines() if line.strip()), 2
    if isinstance(err, StopRequested):
        return f"stopped: {err}", err.exit_code
    from flwr_app.outputs import CHECKPOINT, resume_directory  # imports torch

    directory = resume_directory(flat["resume.from"]) if flat["resume.from"] else Path(flat["output.dir"]).resolve()
    if isinstance(err, KeyboardInterrupt):  # Interrupted (a second signal), or SIGINT before the handlers were set
        resume = f"; continue from the last checkpoint with resume.from={directory}" \
            if (directory / CHECKPOINT).exists() else ""
        return f"stopped: {str(err) or 'SIGINT'}{resume}", getattr(err, "exit_code", 130)
    line = runlog.one_line(err)
    if len(line) > MAX_LINE:  # the whole message is in run.log
        line = line[:MAX_LINE] + " ..."
    where = runlog.log_path(err)
    return f"error: {type(err).__name__}: {line}" + (f" (traceback in {where})" if where else ""), 1


def check_command_line(arguments: Sequence[str]) -> None:
    """Refuse, before Hydra composes the configuration, an override that names no run-config key or a config group
    option that does not exist (Hydra's own error would advise ``+key`` or list every option), also among the
    values of a sweep (``-m strategy=fedavg,dpsgd``): one line on stderr with the nearest names and where every key
    is listed, exit status 2. Overrides of ``hydra.*``, deletions, another config (``--config-name``) and what
    Hydra cannot parse are left to Hydra. ``python -m simulations.sweep`` checks its command line with it too."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, OverrideType

    if "--version" in arguments:
        return
    try:
        args = get_args_parser().parse_args(arguments)
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except (Exception, SystemExit):  # Hydra reports a command line it cannot read
        return
    if args.config_name or args.config_path or args.config_dir:
        return
    unknown = []
    for override in overrides:
        key = override.key_or_group
        if override.type == OverrideType.DEL or override.package or key.split(".")[0] == "hydra" or key in KEYS:
            continue
        if key in HYDRA_GROUPS:
            value = override.value()
            options = sorted(path.stem for path in (CONF_DIR / key).glob("*.yaml") if path.stem != "base")
            for choice in value.list if isinstance(value, ChoiceSweep) else [value]:
                if isinstance(choice, str) and choice not in options:
                    exit_with(f"error: run config: {key}={choice}: no such {key} option{did_you_mean(choice, options)} "
                              f"(every {key} option: {KEYS_PAGE})", 2)
            continue
        unknown.append(key)
    if unknown:
        exit_with(f"error: {unknown_keys_error(sorted(set(unknown)), KEYS)}", 2)


#: Set once a Hydra entry point's task has started: a SystemExit(1) before it is Hydra's own configuration error.
TASK_STARTED = threading.Event()


def run_hydra(entry: Callable[[], Any]) -> None:
    """Call a ``@hydra.main`` entry point; Hydra's own configuration errors (an unknown config group option, a bad
    override), which it reports before any task starts and ends with exit status 1, end with status 2, as every
    configuration error of fedsurv's does."""
    try:
        entry()
    except SystemExit as ended:
        if ended.code == 1 and not TASK_STARTED.is_set():
            raise SystemExit(2) from None
        raise


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Run the experiment; return the test C-index (Hydra sweepers may optimise it)."""
    TASK_STARTED.set()
    flat = flatten(cfg)
    if not flat["output.dir"] and not flat["resume.from"]:  # a resumed run continues in its own directory
        flat["output.dir"] = HydraConfig.get().runtime.output_dir
    try:
        check_inputs(resolve(flat)[1])
    except (ConfigError, DataValidationError) as err:
        exit_with(*describe_failure(err, flat))
    from simulations.engine import run_simulation  # torch, Ray and Flower

    try:
        summary = run_simulation(flat)
    except (Exception, KeyboardInterrupt) as err:
        exit_with(*describe_failure(err, flat))
    return summary["test"].get("c_index")


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    run_hydra(main)
