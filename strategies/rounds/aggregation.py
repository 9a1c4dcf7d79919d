"""The aggregation phase of a round: how the training messages become the round's released aggregate.

:class:`TrainingRelease` is the one step where mechanisms differ: :class:`PlainRelease` sends the messages, screens
the replies (:class:`~strategies.rounds.screening.TrainScreen`) and combines them (the strategy's
``aggregate_train``, :class:`UpdateAggregation`, possibly wrapped by a central-DP strategy);
:class:`~strategies.rounds.secure_sum.SecureSumRelease` unmasks only the sites' sum. The round loop calls
:meth:`TrainingRelease.release` and never asks which it holds. Each also collects the final model's recalibration
sums (:meth:`TrainingRelease.power_sums`) the way its sites release them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import MultiKrum, Strategy
from flwr.supercore import log

from strategies.arrays import values
from strategies.config import DEFAULT_UPDATE_BOUND, ExperimentConfig
from strategies.mechanisms.base import HorizontalMechanism, SiteSetUp
from strategies.mechanisms.setup_share import recalibration_multiplier
from strategies.mechanisms.setup_statistics import RecalibrationPlan
from strategies.replies import check_power_sums
from strategies.rounds.ledger import RoundBook
from strategies.rounds.records import RECALIBRATION_QUERY, WEIGHT_KEY, GlobalModel, digest, records_of
from strategies.rounds.robust import (centred_clip, discard_limit, discarded_shares, multikrum_selection,
                                      outlier_spread, robust_refusal, robust_trim, stacked)
from strategies.rounds.screening import ReplyScreen, TrainScreen

#: What :meth:`UpdateAggregation.aggregate` falls back on: FedAvg's weighted mean of the contributing replies.
Mean = Callable[[list[Message]], tuple[ArrayRecord | None, MetricRecord | None]]


class TrainingRelease(ABC):
    """How one round's training messages become the round's released aggregate.

    Contract: :meth:`release` sends the round's messages, records in ``book`` every site that released something
    (``released``), every accepted report (``train_sites``) and every named failure, sets the round's ``shortfall``
    when the run must stop, and returns the aggregate the round released (before any server optimiser), or None when
    the round is not aggregated (the global model stays).
    """

    @abstractmethod
    def release(self, grid: Grid, server_round: int, arrays: ArrayRecord, messages: list[Message], outer: Strategy,
                *, resumed: bool) -> ArrayRecord | None:
        """The round's released aggregate of the model ``arrays`` sent as ``messages`` (None: not aggregated)."""

    @abstractmethod
    def power_sums(self, server_round: int, content: RecordDict, grid: Grid,
                   plan: RecalibrationPlan) -> tuple[np.ndarray | None, float]:
        """The sites' summed noisy recalibration power sums of ``content``'s model and their agreed records."""


class PlainRelease(TrainingRelease):
    """Each site's reply read on its own: the messages sent, the replies screened, the accepted ones combined by
    ``outer.aggregate_train`` (the strategy, or a wrapper such as Flower's central-DP strategy around it)."""

    def __init__(self, book: RoundBook, replies: ReplyScreen, screen: TrainScreen, *, cfg: ExperimentConfig,
                 setups: Mapping[str, SiteSetUp], timeout: float, min_train_nodes: int, array_key: str,
                 config_key: str) -> None:
        self.book, self.replies, self.screen = book, replies, screen
        self.cfg, self.setups, self.timeout = cfg, setups, timeout
        self.min_train_nodes = min_train_nodes
        self.keys = {"array_key": array_key, "config_key": config_key}

    def release(self, grid: Grid, server_round: int, arrays: ArrayRecord, messages: list[Message], outer: Strategy,
                *, resumed: bool) -> ArrayRecord | None:
        """Fewer than ``min_train_nodes`` accepted updates: not aggregated, and the round's shortfall says so. A
        resumed run's message carries its own site's privacy position only
        (:meth:`~strategies.rounds.ledger.RoundBook.with_own_state`). The round's record is made once the replies
        are in (a ``grid`` that closes the previous round on their arrival closes it first)."""
        if resumed:
            messages = [self.book.with_own_state(message, **self.keys) for message in messages]
        received = grid.send_and_receive(messages, timeout=self.timeout)
        record = self.book.record(server_round)
        replies = self.replies.record_failures(server_round, "train", messages, received)
        self.book.count_unanswered_as_released(record, messages, replies)
        accepted = self.screen.screen(server_round, replies)
        aggregated, _ = outer.aggregate_train(server_round, accepted)
        if len(accepted) < self.min_train_nodes:
            record.shortfall = (f"{len(accepted)} of {len(messages)} sites' updates accepted, fewer than the "
                                f"minimum {self.min_train_nodes}: the round was not aggregated")
            return None
        return aggregated

    def power_sums(self, server_round: int, content: RecordDict, grid: Grid,
                   plan: RecalibrationPlan) -> tuple[np.ndarray | None, float]:
        """The accepted sites' noisy power sums, each site's release checked on its own; and their agreed records."""
        messages = [Message(content=content, dst_node_id=node_id, message_type=RECALIBRATION_QUERY)
                    for node_id in grid.get_node_ids()]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        std = recalibration_multiplier(self.cfg) * plan.sensitivity()
        total, count = np.zeros(plan.size), 0.0
        accepted = self.replies.accepted_metrics(
            server_round, "recalibration",
            self.replies.record_failures(server_round, "recalibration", messages, replies),
            lambda site, metrics: check_power_sums(metrics.get("power_sums"), size=plan.size,
                                                   max_records=self.setups[site].count, noise_std=std))
        for _, site, _, metrics in accepted:
            total += np.asarray(metrics["power_sums"], dtype=np.float64)
            count += self.setups[site].count
        return total, count


class UpdateAggregation:
    """Combines a round's screened updates: the weighted mean, with each update's pull bounded where the run bounds
    updates, or a robust aggregator's combination; records each update's spread and whom an aggregator left out.

    Contract (:meth:`aggregate`): a site with weight 0 contributes nothing; none contributing: ``(None, None)`` (the
    global model stays); the record of the round gets ``update_spread``/``train_flags`` (3 or more updates) and,
    with a robust aggregator, ``discarded``/``discarded_most``/``aggregate_flags``.
    """

    def __init__(self, book: RoundBook, model: GlobalModel, *, cfg: ExperimentConfig,
                 mechanism: HorizontalMechanism, aggregator: Strategy | None) -> None:
        self.book, self.model, self.cfg = book, model, cfg
        self.mechanism = mechanism
        self.aggregator = aggregator
        self._stack: np.ndarray | None = None  # :meth:`_bounded_mean`'s matrix of updates, reused

    def aggregate(self, server_round: int, replies: Iterable[Message],
                  mean: Mean) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The bounded mean (:meth:`_bounded_mean`), the robust aggregator's combination (:meth:`_robust_aggregate`),
        or ``mean`` of the contributing replies."""
        contributing = [message for message in replies if not message.has_error()
                        and float(records_of(message.content, MetricRecord)[0][WEIGHT_KEY]) > 0]
        if not contributing:
            return None, None
        if len(contributing) >= 3:
            bounded = self._bounded_mean(server_round, contributing)
            if bounded is not None:
                return bounded, None
        if self.aggregator is not None:
            return self._robust_aggregate(server_round, contributing)
        return mean(contributing)

    def _robust_aggregate(self, server_round: int,
                          contributing: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The robust aggregator's combination of the ``contributing`` updates, with a record of whom it left out.

        krum: an update that is bit for bit the global model (a site that did not train) is no candidate:
        krum's score favours it and would keep the model where it is. It counts as one of the
        ``federation.max_malicious`` sites tolerated, and multi-krum averages the ``n - f`` best-scored of the
        ``n`` other updates. Too few candidates for the aggregator (:func:`robust_refusal`): the global model stays.
        Before the aggregator runs (Flower's take the arrays out of the replies), :meth:`_record_discards`.
        """
        federation = self.cfg.federation
        candidates, malicious = contributing, federation.max_malicious
        if federation.aggregation == "krum":
            model = self.model.of_round(server_round)[0]
            candidates = [message for message in contributing
                          if digest(records_of(message.content, ArrayRecord)[0]) != model]
            malicious = max(0, malicious - (len(contributing) - len(candidates)))
        if reason := robust_refusal(federation.aggregation, trim_fraction=federation.trim_fraction,
                                     malicious=malicious, sites=len(candidates)):
            log(WARNING, "Round %s: %s accepted updates are too few (%s): the global model stays as it is",
                server_round, len(candidates), reason)
            return None, None
        self._record_discards(server_round, contributing, candidates, malicious)
        if isinstance(self.aggregator, MultiKrum):
            self.aggregator.num_malicious_nodes = malicious
            self.aggregator.num_nodes_to_select = len(candidates) - malicious
        return self.aggregator.aggregate_train(server_round, candidates)

    def _record_discards(self, server_round: int, contributing: list[Message], candidates: list[Message],
                         malicious: int) -> None:
        """Record each contributing site's share left out by the robust aggregator (``discarded``), the sites left
        out more than an even spread (``discarded_most``, :func:`discard_limit`), and flag a site left out in more than
        half of the rounds it took part in, at least 2 (heterogeneous sites are normal: a flag, never a failure).

        The shares come from the matrix the aggregator works on: the candidates' models; median and trimmed mean:
        :func:`discarded_shares`; krum: :func:`multikrum_selection` (1 for an update not selected or no candidate).
        """
        federation, record = self.cfg.federation, self.book.record(server_round)
        sites = [self.book.node_sites.get(message.metadata.dst_node_id, "unnamed site") for message in contributing]
        arrays = [records_of(message.content, ArrayRecord)[0] for message in candidates]
        names = list(arrays[0].keys())
        matrix = stacked(arrays, names)
        if federation.aggregation == "krum":
            dtype = np.result_type(*(values(arrays[0][name]).dtype for name in names))
            selected = multikrum_selection(matrix.astype(dtype), malicious, len(candidates) - malicious)
            kept = {id(candidates[index]) for index in selected}
            shares = [0.0 if id(message) in kept else 1.0 for message in contributing]
            limit = discard_limit(len(contributing), len(contributing) - len(kept))
        else:
            trim = robust_trim(federation.aggregation, sites=len(candidates), trim_fraction=federation.trim_fraction)
            shares = discarded_shares(matrix, trim).tolist()
            limit = discard_limit(len(candidates), 2 * trim)
        record.discarded = {site: float(share) for site, share in zip(sites, shares, strict=True)}
        record.discarded_most = sorted(site for site, share in record.discarded.items() if share >= limit - 1e-12)
        for site in sites:
            taken = [r for number, r in self.book.rounds.items() if number <= server_round and site in r.discarded]
            out = sum(site in r.discarded_most for r in taken)
            if out >= 2 and 2 * out > len(taken):
                what = ("its update was not selected by krum" if federation.aggregation == "krum" else
                        f"most of its coordinates were cut by federation.aggregation = {federation.aggregation!r}")
                record.aggregate_flags[site] = (f"{what} in {out} of the {len(taken)} rounds it took part in (this "
                                                f"round: {record.discarded[site]:.0%} of it left out)")

    def _bounds_updates(self) -> bool:
        """Whether the weighted mean bounds each update's pull (:func:`centred_clip`): ``update_bound`` set, no robust
        aggregator, and a mechanism that honours ``federation.update_bound`` (central_dp's and distributed_dp's
        accounting rests on the plain mean)."""
        return (self.cfg.federation.update_bound > 0 and self.aggregator is None
                and "federation.update_bound" in self.mechanism.honours)

    def _bounded_mean(self, server_round: int, contributing: list[Message]) -> ArrayRecord | None:
        """Record each of 3 or more accepted updates' spread (its distance from the coordinate-wise median over the
        median distance) and flag each site beyond :func:`outlier_spread`; where the run bounds updates
        (:meth:`_bounds_updates`), return their weighted mean with each one's pull bounded to ``update_bound`` x the
        median distance; None otherwise, or when it bounded none (the plain weighted mean, which FedAvg computes, is
        then the same). A bound near 1 cuts the pull of about half of the honest sites a little, as it should: what
        names a site is standing out, not being bounded."""
        record = self.book.record(server_round)
        arrays = [records_of(message.content, ArrayRecord)[0] for message in contributing]
        names = list(arrays[0].keys())
        shapes = {name: values(arrays[0][name]).shape for name in names}
        dtypes = {name: values(arrays[0][name]).dtype for name in names}
        vectors = self._stack = stacked(arrays, names, self._stack)  # the same buffer round after round
        weights = np.array([float(records_of(message.content, MetricRecord)[0][WEIGHT_KEY])
                            for message in contributing])
        bounds, bound = self._bounds_updates(), self.cfg.federation.update_bound
        mean, scale, spread = centred_clip(vectors, weights / weights.sum(), bound if bounds else DEFAULT_UPDATE_BOUND)
        beyond = outlier_spread(self.cfg.federation)
        for message, ratio in zip(contributing, spread, strict=True):
            site = self.book.node_sites.get(message.metadata.dst_node_id, "unnamed site")
            record.update_spread[site] = float(ratio)
            if bounds and ratio > beyond:
                record.train_flags[site] = (
                    f"update {ratio:.3g} x the median distance from the sites' coordinate-wise median (beyond "
                    f"{beyond:g} x): its pull was bounded to {bound:g} x (federation.update_bound)")
        if not bounds or np.all(scale == 1.0):
            return None
        parts, start = {}, 0
        for name in names:
            size = int(np.prod(shapes[name]))
            parts[name] = mean[start:start + size].reshape(shapes[name]).astype(dtypes[name])
            start += size
        return ArrayRecord({name: Array(parts[name]) for name in names})
