"""FedAvg for survival models on Flower's Message API.

:class:`SurvivalFedAvg` is Flower's :class:`~flwr.serverapp.strategy.FedAvg` with three additions
that survival models need:

* per-site bookkeeping: every train/evaluate reply carries a ``ConfigRecord`` ``"site"`` naming
  the site, and the strategy keeps each site's metrics per round (a C-index cannot be averaged
  into a pooled C-index, so the per-site figures are kept as they are);
* NaN-aware weighted means of evaluation metrics (a small site's test part may leave a metric
  undefined; one NaN must not hide every other site's figure);
* a federated Breslow baseline for Cox models: before each evaluation it asks every site for the
  sufficient statistics ``(d_k, R_k)`` of its training part on the shared time grid, sums them,
  and sends the resulting baseline to the sites with the evaluation message. No event time
  leaves a site.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from strategies.accounting.rdp import calibrate_noise_multiplier

SITE_KEY = "site"
WEIGHT_KEY = "num-examples"
BRESLOW_QUERY = "query.breslow"
BASELINE_EVENTS = "baseline.event_counts"
BASELINE_RISK = "baseline.risk_sums"
#: Per-site privacy figures in train replies: kept per site, never averaged across sites.
PRIVACY_KEYS = frozenset(
    {"epsilon", "epsilon_mu", "noise_multiplier", "sample_rate", "clip_norm", "steps", "stopped", "fallback",
     "epsilon_nominal", "epsilon_audited_formula", "noise_min", "noise_max", "weight_norm", "min_site_records",
     "selected_layer"}
)


@dataclass
class RoundRecord:
    """What the strategy learnt about one round."""

    train_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    evaluate_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def weighted_nanmean(per_site: dict[str, dict[str, float]], weight_key: str = WEIGHT_KEY) -> dict[str, float]:
    """Weighted mean of each metric over sites, skipping sites where the metric is NaN.

    Parameters
    ----------
    per_site
        ``{site: {metric: value, weight_key: n_records}}``.
    weight_key
        Metric holding each site's weight (its number of records).

    Returns
    -------
    dict
        ``{metric: sum_s w_s x_s / sum_s w_s}`` over the sites with a finite ``x_s``; NaN if none.
    """
    keys = sorted({key for metrics in per_site.values() for key in metrics} - {weight_key})
    result: dict[str, float] = {}
    for key in keys:
        pairs = [
            (float(metrics[weight_key]), float(metrics[key]))
            for metrics in per_site.values()
            if key in metrics and math.isfinite(float(metrics[key]))
        ]
        total = sum(weight for weight, _ in pairs)
        result[key] = sum(weight * value for weight, value in pairs) / total if total > 0 else math.nan
    return result


def aggregate_without_privacy(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Flower's weighted mean of train metrics, leaving out the per-site privacy figures.

    An ε averaged over sites means nothing (the guarantee of record-level DP over disjoint sites
    is the maximum over sites); the ledger keeps them per site instead.
    """
    stripped = [
        RecordDict({"metrics": MetricRecord({key: value for key, value in next(iter(record.metric_records.values())).items()
                                             if key not in PRIVACY_KEYS})})
        for record in records
    ]
    return aggregate_metricrecords(stripped, weight_key)


def _site_name(message: Message) -> str:
    content = message.content
    if SITE_KEY in content.config_records:
        return str(content.config_records[SITE_KEY]["name"])
    return f"node-{message.metadata.src_node_id}"


def _metrics(message: Message) -> dict[str, float]:
    record = next(iter(message.content.metric_records.values()))
    return {key: float(value) for key, value in record.items() if not isinstance(value, list)}


class SurvivalFedAvg(FedAvg):
    """Weighted FedAvg that keeps per-site metrics and builds a federated Breslow baseline.

    Parameters
    ----------
    needs_baseline
        True for Cox-type models: collect Breslow aggregates before every evaluation.
    timeout
        Seconds to wait for the Breslow query replies.
    **fedavg_kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (``fraction_train``,
        ``min_train_nodes``, ...).
    """

    def __init__(self, *, needs_baseline: bool, timeout: float = 3600.0, **fedavg_kwargs: object) -> None:
        super().__init__(
            weighted_by_key=WEIGHT_KEY, train_metrics_aggr_fn=aggregate_without_privacy,
            **fedavg_kwargs,  # type: ignore[arg-type]
        )
        self.needs_baseline = needs_baseline
        self.timeout = timeout
        self.rounds: dict[int, RoundRecord] = {}
        self.baseline: tuple[np.ndarray, np.ndarray] | None = None

    def _record(self, server_round: int) -> RoundRecord:
        return self.rounds.setdefault(server_round, RoundRecord())

    def _split_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Record failed replies; return all replies in a fixed order (by site name).

        Replies arrive in whatever order the sites finish. Sorting them makes the floating-point
        sums of the aggregation, and so a rerun with the same seed, reproducible.
        """
        replies = sorted(replies, key=lambda message: (message.has_error(), "" if message.has_error()
                                                        else _site_name(message)))
        record = self._record(server_round)
        for message in replies:
            if message.has_error():
                record.failures.append(f"node {message.metadata.src_node_id}: {message.error.reason}")
        return replies

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg aggregation, after recording each site's training metrics."""
        replies = self._split_replies(server_round, replies)
        record = self._record(server_round)
        for message in replies:
            if not message.has_error():
                record.train_sites[_site_name(message)] = _metrics(message)
        # A site with nothing new to contribute (e.g. its privacy budget is spent) replies with
        # weight 0; if every site does, the global model stays as it is.
        contributing = [m for m in replies if m.has_error() or _metrics(m).get(WEIGHT_KEY, 0.0) > 0]
        if not any(not message.has_error() for message in contributing):
            return None, None
        return super().aggregate_train(server_round, contributing)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Attach the federated Breslow baseline (Cox models) to the evaluation messages."""
        if self.needs_baseline:
            self.baseline = self._collect_breslow(server_round, arrays, grid)
            if self.baseline is not None:
                config[BASELINE_EVENTS] = self.baseline[0].tolist()
                config[BASELINE_RISK] = self.baseline[1].tolist()
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Keep each site's evaluation metrics; return their NaN-aware weighted mean."""
        replies = self._split_replies(server_round, replies)
        record = self._record(server_round)
        for message in replies:
            if not message.has_error():
                record.evaluate_sites[_site_name(message)] = _metrics(message)
        if not record.evaluate_sites:
            return None
        return MetricRecord(weighted_nanmean(record.evaluate_sites))

    def _collect_breslow(
        self, server_round: int, arrays: ArrayRecord, grid: Grid
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Sum every site's ``(d_k, R_k)`` for the model in ``arrays``."""
        node_ids = list(grid.get_node_ids())
        messages = [
            Message(
                content=RecordDict({self.arrayrecord_key: arrays}),
                dst_node_id=node_id,
                message_type=BRESLOW_QUERY,
            )
            for node_id in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        event_counts: np.ndarray | None = None
        risk_sums: np.ndarray | None = None
        for message in self._split_replies(server_round, replies):
            if message.has_error():
                continue
            metrics = next(iter(message.content.metric_records.values()))
            site_events = np.asarray(metrics["event_counts"], dtype=np.float64)
            site_risk = np.asarray(metrics["risk_sums"], dtype=np.float64)
            event_counts = site_events if event_counts is None else event_counts + site_events
            risk_sums = site_risk if risk_sums is None else risk_sums + site_risk
        if event_counts is None or risk_sums is None:
            log(WARNING, "Round %s: no site answered the Breslow query; no baseline hazard", server_round)
            return None
        return event_counts, risk_sums


def with_central_dp(
    strategy: SurvivalFedAvg, *, epsilon: float, delta: float, rounds: int, clip_norm: float,
    num_sites: int, accountant: str = "rdp",
) -> tuple[DifferentialPrivacyServerSideFixedClipping, float]:
    r"""Wrap ``strategy`` in Flower's server-side fixed-clipping DP, calibrated to ``(ε, δ)``.

    Each round the server clips every site's update :math:`\Delta_k` to L2 norm ``clip_norm``
    and adds :math:`N(0, (\sigma C / m)^2)` to the mean of the ``m = num_sites`` updates (Flower's
    ``DifferentialPrivacyServerSideFixedClipping``): a Gaussian mechanism with noise multiplier
    :math:`\sigma` for adding or removing one site's update, with the denominator fixed at ``m``.
    :math:`\sigma` is calibrated so that ``rounds`` such releases spend at most ``epsilon`` at
    ``delta`` without amplification (every site takes part in every round; opacus RDP, q = 1).
    Sites must be weighted equally (each reports weight 1), or one site's influence on the
    weighted mean would exceed ``C / m``.

    Returns
    -------
    (wrapped strategy, noise multiplier σ)

    References
    ----------
    McMahan, Ramage, Talwar & Zhang (2018), "Learning differentially private recurrent language
    models", ICLR (DP-FedAvg); Mironov (2017), "Rényi differential privacy", CSF.
    """
    if num_sites < 1 or rounds < 1:
        raise ValueError(f"num_sites and rounds must be >= 1, got {num_sites}, {rounds}")
    noise_multiplier = calibrate_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=rounds, accountant=accountant,
    )
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        strategy, noise_multiplier=noise_multiplier, clipping_norm=clip_norm, num_sampled_clients=num_sites,
    )
    return wrapped, noise_multiplier
