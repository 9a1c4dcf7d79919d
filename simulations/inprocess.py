"""Federations as in-process loops, for repetition-heavy reproductions.

Horizontal:
:func:`run_federation` runs exactly the steps of the ServerApp and ClientApp of a horizontal
run — the same data, model, seeds, local training (``flwr_app.task``), privacy mechanism,
site-ordered weighted averaging (Flower's own ``aggregate_arrayrecords``) and federated Breslow
baseline — without Flower's messaging and Ray. A test checks that it reproduces a Flower
simulation's final model and privacy figures; the reproduction scripts use it to run hundreds of
repetitions on a laptop. It does not replace the Flower path for users: it has no fault
handling, no per-round outputs and no deployment.

Vertical: :class:`LocalSplitTransport` holds the simulated modality sites as objects and
:func:`run_vertical_inprocess` runs the ServerApp's own :func:`flwr_app.vertical_server.run_vertical`
over it, outputs and ledger included; a test checks that it reproduces a Flower simulation of
the same run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flwr_app import task, vertical_task
from flwr_app.config import ExperimentConfig
from flwr_app.outputs import RunOutputs
from flwr_app.vertical_server import EmbeddingAudit, run_vertical
from models.data import FederatedDataset
from models.survival import SurvivalModel
from strategies.horizontal import WEIGHT_KEY
from strategies.split import LocalSites, PredictRequest, SiteConfig, SiteReply, SiteRequest, SplitSite

__all__ = ["LocalSplitTransport", "run_federation", "run_vertical_inprocess"]

_METRICS = ("c_index", "c_index_td", "ibs", "inbll")


def _evaluate(model: SurvivalModel, dataset: FederatedDataset, *, concordance_td: bool) -> tuple[dict[str, float], str]:
    """Federated Breslow baseline (Cox models) and pooled test metrics; NaN and why if diverged."""
    if not all(bool(torch.isfinite(value).all()) for value in model.net.state_dict().values()):
        return dict.fromkeys(_METRICS, math.nan), "diverged: non-finite weights"
    try:
        if model.needs_baseline:
            event_counts, risk_sums = None, None
            for site in sorted(dataset.sites, key=lambda site: site.name):
                counts, sums = model.breslow_aggregates(site.train.x, site.train.time, site.train.event)
                counts, sums = np.asarray(counts, dtype=np.float64), np.asarray(sums, dtype=np.float64)
                event_counts = counts if event_counts is None else event_counts + counts
                risk_sums = sums if risk_sums is None else risk_sums + sums
            model.set_baseline(event_counts, risk_sums)
        return task.evaluate(model, dataset.pooled("test"), dataset.pooled("train"),
                             concordance_td=concordance_td), ""
    except ValueError as err:  # e.g. risks that overflow to inf or underflow to an empty risk set
        return dict.fromkeys(_METRICS, math.nan), f"diverged: {err}"


def run_federation(cfg: ExperimentConfig, *, concordance_td: bool = True) -> dict[str, Any]:
    """Train ``cfg``'s federation for ``federation.rounds`` rounds in process; evaluate at the end.

    Every site trains in every round (``federation.fraction_train`` must be 1). With
    ``concordance_td=False`` the O(n²) Antolini C-index is skipped (NaN).

    Returns
    -------
    dict
        ``test``: metrics of the final global model on the pooled test split (as the ServerApp's
        server-side evaluation; NaN, with the reason in ``error``, when the model diverged, e.g.
        non-finite weights or risks that overflow); ``privacy``: the worst site's last training report (its
        privacy figures), or ``None`` without DP; ``state_dict``: the final global weights.
    """
    if cfg.federation.fraction_train != 1.0:
        raise ValueError("run_federation trains every site in every round: set federation.fraction_train = 1")
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    global_arrays = ArrayRecord(model.net.state_dict())
    order = sorted(range(dataset.num_sites), key=lambda index: dataset.sites[index].name)
    states: dict[int, dict | None] = dict.fromkeys(order)
    reports: dict[int, dict[str, float]] = {}
    for server_round in range(1, cfg.federation.rounds + 1):
        replies = []
        for index in order:
            site = dataset.sites[index]
            model.net.load_state_dict(global_arrays.to_torch_state_dict())
            seed = task.round_seed(cfg.seed, server_round, index)
            weight = len(site.train)
            if cfg.strategy in task.PRIVATE_TRAINING:
                previous = states[index]
                metrics, states[index] = task.PRIVATE_TRAINING[cfg.strategy](
                    model, site.train, cfg, seed=seed, state=previous)
                if previous is not None and states[index]["steps"] == previous["steps"]:
                    weight = 0
                reports[index] = metrics
            elif cfg.strategy == "fedavg":
                task.train_local(model, site.train, cfg, seed=seed)
            else:
                raise ValueError(f"run_federation does not run strategy {cfg.strategy!r} (server-side mechanism)")
            if weight > 0:
                replies.append(RecordDict({"arrays": ArrayRecord(model.net.state_dict()),
                                           "metrics": MetricRecord({WEIGHT_KEY: weight})}))
        if replies:
            global_arrays = aggregate_arrayrecords(replies, WEIGHT_KEY)
    model.net.load_state_dict(global_arrays.to_torch_state_dict())
    test, error = _evaluate(model, dataset, concordance_td=concordance_td)
    privacy = None
    if reports:
        privacy = max(reports.values(), key=lambda report: report.get("epsilon", -math.inf))
    return {"test": test, "error": error, "privacy": privacy,
            "state_dict": {key: value.clone() for key, value in model.net.state_dict().items()}}


class LocalSplitTransport:
    """The simulated modality sites of ``cfg`` as objects in this process (partition ``i`` = modality ``i``)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.data = [vertical_task.simulated_site(cfg, index)
                     for index in range(len(vertical_task.load_table(cfg).modalities))]
        self.sites = LocalSites({})
        self.round_trips = 0

    def hello(self) -> dict[str, list[str]]:
        return {data.modality: [str(i) for i in data.features.index[data.features.notna().any(axis=1).to_numpy()]]
                for data in self.data}

    def setup(self, configs: dict[str, SiteConfig]) -> None:
        by_modality = {data.modality: data for data in self.data}
        self.sites = LocalSites({
            name: SplitSite(config, by_modality[name].features, by_modality[name].categorical,
                            noise_base_seed=by_modality[name].noise_base_seed, source=by_modality[name].source)
            for name, config in configs.items()})

    def exchange(self, requests: dict[str, SiteRequest]) -> dict[str, SiteReply]:
        self.round_trips += 1
        return self.sites(requests)

    def predict(self, requests: dict[str, PredictRequest]) -> dict[str, SiteReply]:
        return self.sites.predict(requests)


def run_vertical_inprocess(cfg: ExperimentConfig, *, audit: EmbeddingAudit | None = None) -> dict[str, Any]:
    """Run ``cfg`` (strategy ``split``) with the ServerApp's code over :class:`LocalSplitTransport`."""
    if cfg.strategy != "split":
        raise ValueError("run_vertical_inprocess runs strategy 'split'")
    outputs = RunOutputs.create(cfg)
    outputs.write_config(cfg, {})
    return run_vertical(cfg, LocalSplitTransport(cfg), outputs, audit=audit)
