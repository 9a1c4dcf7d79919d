"""Run one experiment through Flower's simulation engine (Ray backend), from Python.

``flwr run .`` and this module execute the same ``ServerApp``/``ClientApp`` (named in
``pyproject.toml``) with the same fused run config (pyproject defaults + overrides). The only
difference is who starts the simulation: ``flwr run`` goes through a SuperLink, this module calls
Flower's simulation runtime in-process, as ``flwr-simulation`` does. ``flwr.simulation.
run_simulation`` would pass an empty run config, so we call the runtime function it wraps
(``_run_simulation``, pinned flwr 1.41) with a ``Run`` that carries the overrides.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, RecordDict
from flwr.common.config import get_fused_config_from_dir, get_project_config
from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
from flwr.simulation.run_simulation import _run_simulation
from flwr.supercore.constant import NOOP_FEDERATION_ID
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.telemetry import EventType

from flwr_app import task, vertical_task
from flwr_app.config import PROJECT_ROOT, ConfigError, ExperimentConfig, parse_run_config
from flwr_app.outputs import RunOutputs


def schema_keys() -> set[str]:
    """Run-config keys declared in ``pyproject.toml``."""
    return set(get_fused_config_from_dir(PROJECT_ROOT, {}))


def resolve(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], ExperimentConfig]:
    """Fuse ``overrides`` with the pyproject defaults and validate the result.

    Raises
    ------
    ConfigError
        For a key the schema does not declare (with the list of known keys) or a bad value.
    """
    unknown = sorted(set(overrides) - schema_keys())
    if unknown:
        raise ConfigError(
            f"unknown run-config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(schema_keys()))}"
        )
    fused = get_fused_config_from_dir(PROJECT_ROOT, dict(overrides))
    return fused, parse_run_config(fused)


def run_simulation(overrides: Mapping[str, Any], *, cpus_per_site: float = 1.0, verbose: bool = False) -> dict[str, Any]:
    """Run one experiment and return its ``summary.json``.

    The number of simulated SuperNodes is the number of sites of the run's data set (for a
    natural partition that is the number of groups, known only once the data are loaded; for
    split learning the number of modalities).
    """
    fused, cfg = resolve(overrides)
    if not cfg.output_dir and not cfg.resume_from:
        raise ConfigError("run_simulation needs 'output.dir' (or 'resume.from') so that it can read the run's summary")
    if cfg.strategy == "split":
        num_sites = len(vertical_task.load_table(cfg).modalities)
    else:
        num_sites = task.load_federation(cfg).num_sites
    if cfg.strategy != "split" and num_sites < cfg.federation.min_sites:
        raise ConfigError(
            f"the federation has {num_sites} site(s) but federation.min_sites = {cfg.federation.min_sites}"
        )
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    run = Run.create_empty(run_id=generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
    run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
    run.federation_id = NOOP_FEDERATION_ID
    run.override_config = dict(overrides)
    # As flwr.simulation.run_simulation does for its own Run: messages are stamped with these.
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=fused)
    components = get_project_config(PROJECT_ROOT)["tool"]["flwr"]["app"]["components"]
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        _run_simulation(
            num_supernodes=num_sites,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
            server_app_attr=components["serverapp"],
            client_app_attr=components["clientapp"],
            backend_name="ray",
            backend_config={
                "client_resources": {"num_cpus": cpus_per_site, "num_gpus": 0.0},
                "init_args": {"include_dashboard": False, "log_to_driver": verbose},
            },
            app_dir=str(PROJECT_ROOT),
            run=run,
            server_app_context=context,
            is_app=True,
            verbose_logging=verbose,
        )
    finally:
        flwr_logger.setLevel(level)
    return json.loads(RunOutputs.create(cfg).summary_path.read_text(encoding="utf-8"))
