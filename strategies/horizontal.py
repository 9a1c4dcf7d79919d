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

Its :meth:`SurvivalFedAvg.run_rounds` replaces Flower's ``Strategy.start``: it can begin at any
round (a run resumed from a checkpoint), records every error reply and every missing reply per
phase and site, and stops the run after a round in which fewer sites trained than
``min_train_nodes`` (that round is not aggregated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from strategies.accounting.rdp import calibrate_noise_multiplier

SITE_KEY = "site"
WEIGHT_KEY = "num-examples"
BRESLOW_QUERY = "query.breslow"
BASELINE_EVENTS = "baseline.event_counts"
BASELINE_RISK = "baseline.risk_sums"
#: In a train reply's site record: the site's privacy state (JSON: σ, its accountant), kept in the checkpoint.
PRIVACY_STATE_KEY = "privacy_state"
#: In a resumed run's train config: the receiving site's own privacy state from the checkpoint (JSON), for a
#: site whose node state is empty (a new run starts with empty node states). Each site gets only its own.
RESUMED_PRIVACY_STATE = "resume.privacy_state"
#: Query asking a node which site it is (a resumed run must give each site its own privacy state).
SITE_NAME_QUERY = "query.site_name"
#: Per-site privacy figures in train replies: kept per site, never averaged across sites.
PRIVACY_KEYS = frozenset(
    {"epsilon", "epsilon_mu", "noise_multiplier", "sample_rate", "clip_norm", "steps", "stopped", "fallback",
     "epsilon_nominal", "epsilon_audited_formula", "noise_min", "noise_max", "weight_norm", "min_site_records",
     "selected_layer"}
)


class TooFewSitesError(RuntimeError):
    """Fewer sites trained in a round than the federation's minimum; the run cannot go on."""


@dataclass
class RoundRecord:
    """What the strategy learnt about one round.

    ``privacy_states`` holds the privacy state each site reported with its training reply (JSON);
    ``shortfall`` says why the round was not aggregated (too few sites trained), empty otherwise.
    """

    train_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    evaluate_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    privacy_states: dict[str, str] = field(default_factory=dict)
    shortfall: str = ""


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


def _sorted_replies(replies: Iterable[Message]) -> list[Message]:
    """Replies in a fixed order (successful ones by site name, then errors).

    Replies arrive in whatever order the sites finish. Sorting them makes the floating-point sums
    of the aggregation, and so a rerun with the same seed, reproducible.
    """
    return sorted(replies, key=lambda message: (message.has_error(), "" if message.has_error()
                                                else _site_name(message)))


class SurvivalFedAvg(FedAvg):
    """Weighted FedAvg that keeps per-site metrics and builds a federated Breslow baseline.

    Parameters
    ----------
    needs_baseline
        True for Cox-type models: collect Breslow aggregates before every evaluation.
    timeout
        Seconds to wait for the sites' replies to each message of a round (train, Breslow, evaluate).
    **fedavg_kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (``fraction_train``,
        ``min_train_nodes``, ...). ``min_train_nodes`` is also the fewest sites whose training
        replies :meth:`run_rounds` aggregates.
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
        self.node_sites: dict[int, str] = {}

    def _record(self, server_round: int) -> RoundRecord:
        return self.rounds.setdefault(server_round, RoundRecord())

    def record_failures(
        self, server_round: int, phase: str, messages: Iterable[Message], replies: Iterable[Message],
    ) -> list[Message]:
        """Record every error reply and every message left unanswered; return the replies, sorted.

        Failures read ``"<phase>: <site> (node <id>): <reason>"``; a site is named once it has
        answered any message of this run.
        """
        replies = _sorted_replies(replies)
        for message in replies:
            if not message.has_error():
                self.node_sites[message.metadata.src_node_id] = _site_name(message)
        record = self._record(server_round)

        def name(node: int) -> str:
            return f"{self.node_sites.get(node, 'unnamed site')} (node {node})"

        for message in replies:
            if message.has_error():
                record.failures.append(f"{phase}: {name(message.metadata.src_node_id)}: {message.error.reason}")
        answered = {message.metadata.src_node_id for message in replies}
        for node in sorted({message.metadata.dst_node_id for message in messages} - answered):
            record.failures.append(f"{phase}: {name(node)}: no reply within {self.timeout:g} s")
        return replies

    def run_rounds(
        self, grid: Grid, *, arrays: ArrayRecord, first_round: int, last_round: int,
        end_of_round: Callable[[int, ArrayRecord], None], outer: Strategy | None = None,
        site_states: Mapping[str, str] | None = None,
    ) -> ArrayRecord:
        """Rounds ``first_round`` to ``last_round`` from the global model ``arrays``; return the final model.

        Each round: train (the sites' replies aggregated by ``outer``, a wrapper such as Flower's
        central-DP strategy around this one, or this strategy), Breslow query and evaluation, then
        ``end_of_round(round, global arrays)``. A site that fails or does not answer within
        ``timeout`` is recorded in the round's ``failures`` and the round goes on without it. If
        fewer than ``min_train_nodes`` sites trained, the round is not aggregated (the global model
        stays as it was; the sites that trained have still released their updates, so their
        metrics are kept), ``end_of_round`` runs, and :class:`TooFewSitesError` stops the run.

        ``site_states`` (a resumed run: site name -> its privacy state from the checkpoint): the
        nodes are asked which site they are first, and each training message carries its own
        site's state only (:data:`RESUMED_PRIVACY_STATE`); no site sees another's.
        """
        outer = self if outer is None else outer
        if site_states:
            self.identify_sites(grid)
        for server_round in range(first_round, last_round + 1):
            record = self._record(server_round)
            messages = list(outer.configure_train(server_round, arrays, ConfigRecord(), grid))
            if site_states:
                messages = [self._with_own_state(message, site_states) for message in messages]
            replies = self.record_failures(server_round, "train", messages,
                                           grid.send_and_receive(messages, timeout=self.timeout))
            aggregated, _ = outer.aggregate_train(server_round, replies)
            trained = sum(not message.has_error() for message in replies)
            if trained < self.min_train_nodes:
                record.shortfall = (f"{trained} of {len(messages)} sites trained, fewer than the minimum "
                                    f"{self.min_train_nodes}: the round was not aggregated")
            elif aggregated is not None:
                arrays = aggregated
            messages = list(outer.configure_evaluate(server_round, arrays, ConfigRecord(), grid))
            replies = self.record_failures(server_round, "evaluate", messages,
                                           grid.send_and_receive(messages, timeout=self.timeout))
            outer.aggregate_evaluate(server_round, replies)
            end_of_round(server_round, arrays)
            if record.shortfall:
                raise TooFewSitesError(f"round {server_round}: {record.shortfall}; failures: "
                                       f"{'; '.join(record.failures)}")
        return arrays

    def identify_sites(self, grid: Grid) -> None:
        """Ask every connected node which site it is (:data:`SITE_NAME_QUERY`); remember the answers."""
        messages = [Message(content=RecordDict({self.configrecord_key: ConfigRecord()}), dst_node_id=node,
                            message_type=SITE_NAME_QUERY) for node in grid.get_node_ids()]
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            if not reply.has_error():
                self.node_sites[reply.metadata.src_node_id] = _site_name(reply)

    def _with_own_state(self, message: Message, site_states: Mapping[str, str]) -> Message:
        """``message`` with its destination site's own saved privacy state added to its config (if it has one)."""
        site = self.node_sites.get(message.metadata.dst_node_id)
        if site not in site_states:
            return message
        config = ConfigRecord(dict(message.content[self.configrecord_key]))
        config[RESUMED_PRIVACY_STATE] = site_states[site]
        content = RecordDict({self.arrayrecord_key: message.content[self.arrayrecord_key],
                              self.configrecord_key: config})
        return Message(content=content, dst_node_id=message.metadata.dst_node_id,
                       message_type=message.metadata.message_type)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: each round's records and the last Breslow baseline (plain Python)."""
        return {"rounds": {server_round: asdict(record) for server_round, record in self.rounds.items()},
                "baseline": None if self.baseline is None else [part.tolist() for part in self.baseline]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rounds = {int(server_round): RoundRecord(**record) for server_round, record in state["rounds"].items()}
        baseline = state["baseline"]
        self.baseline = None if baseline is None else (np.asarray(baseline[0], dtype=np.float64),
                                                       np.asarray(baseline[1], dtype=np.float64))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg aggregation, after recording each site's training metrics and privacy state."""
        replies = _sorted_replies(replies)
        record = self._record(server_round)
        for message in replies:
            if not message.has_error():
                site = _site_name(message)
                record.train_sites[site] = _metrics(message)
                site_record = message.content.config_records.get(SITE_KEY)
                if site_record is not None and PRIVACY_STATE_KEY in site_record:
                    record.privacy_states[site] = str(site_record[PRIVACY_STATE_KEY])
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
        replies = _sorted_replies(replies)
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
                content=RecordDict({self.arrayrecord_key: arrays,
                                    self.configrecord_key: ConfigRecord({"server-round": server_round})}),
                dst_node_id=node_id,
                message_type=BRESLOW_QUERY,
            )
            for node_id in node_ids
        ]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        event_counts: np.ndarray | None = None
        risk_sums: np.ndarray | None = None
        for message in self.record_failures(server_round, "breslow", messages, replies):
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
