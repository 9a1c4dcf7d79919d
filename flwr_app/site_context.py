"""What every handler of a site's messages starts from: the node's run config, its records, its set-up, its privacy
policy's charges, and the node state of a secure-sum round (:mod:`flwr_app.client_app`, :mod:`flwr_app.cox_client`).

The data, model and set-up code (torch, pandas) is imported by the function that needs it: in a deployment every
message may start a new ``flwr-clientapp`` process, which then pays only for what its message needs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from flwr.app import Context

from flwr_app.config import ExperimentConfig, parse_run_config

if TYPE_CHECKING:
    from models.data import SiteData
    from strategies.mechanisms.base import SiteSetUp

__all__ = ["PREPARED_ENTRIES", "SECAGG_ROUND", "SECAGG_STATE", "SITES", "Prepared", "charge", "node_site",
           "own_honest_sites", "run_config", "site_setup", "spec_json", "tolerated_dropouts"]

#: Node state of a secure-aggregation round: the site's protocol state, and the round's public figures.
SECAGG_STATE = "secagg.state"
SECAGG_ROUND = "secagg.round"

# What a node keeps between messages.
#
# Context.state (a RecordDict) holds only ArrayRecord, MetricRecord and ConfigRecord values, and Flower
# copies or serialises it around every message (the simulation engine ships it to the Ray actor and back;
# a deployed SuperNode sends it to the ``flwr-clientapp`` process), so it can hold neither a site's
# prepared records nor a model object. They are kept here, per process, keyed by everything they are
# built from (the parsed run config, and a deployed site's file, its state and set-up as received): a
# Ray actor or a long-lived ClientApp process serves many messages of a run, and a changed run config
# or file gets a fresh entry. Nothing here is private state: the site's accountant stays in
# Context.state, so two runs (or two sites of one process) never share it.

#: How many prepared sites and model skeletons a process keeps (least recently used dropped first).
PREPARED_ENTRIES = 8


class Prepared:
    """A small thread-safe LRU map of what a node builds from its run config (a site's data, a model skeleton)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self.builds = 0  # entries built (tests count them)
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        value = build()
        with self._lock:
            self.builds += 1
            self.entries[key] = value
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


#: Deployed sites' prepared records (a simulation's sites come from :func:`flwr_app.task.load_federation`'s cache).
SITES = Prepared(PREPARED_ENTRIES)


def run_config(context: Context) -> ExperimentConfig:
    """The node's run config, parsed (memoised by content: :func:`flwr_app.config.parse_run_config`)."""
    return parse_run_config(context.run_config)


def _file_key(path: str) -> tuple:
    """A site file's identity: its path, size and modification time (a rewritten file gets a fresh entry)."""
    try:
        stat = os.stat(path)
    except OSError:
        return (path, None)
    return (path, stat.st_size, stat.st_mtime_ns)


def spec_json(context: Context) -> str | None:
    """The set-up this deployed site received, as its node state holds it (``None`` before its set-up)."""
    from flwr_app import deployment

    stored = context.state.config_records.get(deployment.SPEC_STATE)
    return None if stored is None else str(stored["json"])


def node_site(context: Context, cfg: ExperimentConfig | None = None) -> tuple[SiteData, int]:
    """The node's site and its index in the seeds (simulation: ``partition-id``; deployment: the node ID)."""
    from flwr_app import task

    cfg = cfg or run_config(context)
    if cfg.data.deployed:
        from flwr_app import deployment

        path = context.node_config.get("data-path")
        key = (cfg, _file_key(str(path)) if path is not None else None, spec_json(context),
               deployment.site_name(context))
        return SITES.get(key, lambda: deployment.deployed_site(cfg, context)), context.node_id
    dataset = task.load_federation(cfg)
    if "partition-id" not in context.node_config:
        raise ValueError("node config has no 'partition-id': cannot tell which site this node is")
    index = int(context.node_config["partition-id"])
    if not 0 <= index < dataset.num_sites:
        raise ValueError(
            f"node config partition-id {index} is outside the federation's {dataset.num_sites} sites "
            f"({dataset.source}, partition '{cfg.federation.partition}'): run with num-supernodes = "
            f"{dataset.num_sites}"
        )
    return dataset.sites[index], index


def site_setup(cfg: ExperimentConfig, context: Context, site: SiteData) -> SiteSetUp:
    """The site's set-up: its record count as agreed with the server, and the smallest agreed count."""
    if cfg.data.deployed:
        from flwr_app import deployment

        return deployment.stored_setup(context)
    from flwr_app import task

    return task.federation_setup(cfg).setups[site.name]


def charge(context: Context, cfg: ExperimentConfig, site: SiteData, server_round: int, message: str, values: str,
           history: tuple[tuple[float, float, int], ...] | None, *,
           details: tuple[tuple[str, Any], ...] = ()) -> None:
    """Charge a release to the site's own privacy policy before it leaves (:mod:`flwr_app.site_policy`; a no-op
    without one): a refusal raises, and the reply becomes an error filed under the site's name."""
    from flwr_app import site_policy

    site_policy.enforce(context.node_config, site.name, site_policy.Request(
        cfg.strategy, context.run_id, server_round, message, values, history, delta=cfg.privacy.delta,
        details=details))


def own_honest_sites(context: Context) -> tuple[float, ...]:
    """The honest sites this site's own policy counts on in a secure sum (none without a policy): never a figure the
    server sent."""
    from flwr_app import site_policy

    policy = site_policy.SitePolicy.from_node_config(context.node_config)
    return () if policy is None else (float(policy.min_honest_sites),)


def tolerated_dropouts(cfg: ExperimentConfig, context: Context, state: Any) -> ExperimentConfig:
    """``cfg`` as a policy site plans its secure-sum share with: the drop-outs counted are at least those its own
    Shamir sharing tolerates (``num_shares - threshold`` of ``state``), whatever ``privacy.max_dropouts`` says (the
    server could otherwise say 0 and have the site count one share too many)."""
    if not own_honest_sites(context):
        return cfg
    dropouts = max(cfg.privacy.max_dropouts, int(state.num_shares) - int(state.threshold))
    return dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, max_dropouts=dropouts))
