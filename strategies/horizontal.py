"""FedAvg for survival models on Flower's Message API, with every reply checked before it is used.

:class:`SurvivalFedAvg` is Flower's :class:`~flwr.serverapp.strategy.FedAvg` with what survival
models and an untrusted federation need:

* **identity from the node**: the sites are named once, at set-up (:meth:`SurvivalFedAvg.identify_sites`
  in simulation, the deployment's set-up otherwise); a reply's site is the one of the node it
  comes from, and a reply that claims another name is refused;
* **every reply checked** (:mod:`strategies.replies`): a model update must have the global
  model's names, shapes and dtypes and finite values; the record count must be the one agreed at
  set-up; the privacy figures must be exactly what the run's mechanism produces
  (:meth:`strategies.mechanisms.base.HorizontalMechanism.verify`, recomputed at the server);
  evaluation metrics must be in range and not stand far outside the other sites'; Breslow
  aggregates must fit the grid. A refused reply makes its site a named failure of the round
  (``{"phase", "site", "node", "reason"}``) and the round goes on without it;
* **weights from the set-up**: the server weights each accepted update by the count agreed at
  set-up (:meth:`~strategies.mechanisms.base.HorizontalMechanism.aggregation_weight`), never by
  what a reply claims, capped at ``federation.max_weight_ratio`` x the median of the round's weights
  (:func:`capped_weights`: a count inflated at the set-up weighs only so much; the site is flagged);
* per-site bookkeeping (a C-index cannot be averaged into a pooled C-index, so the per-site
  figures are kept as they are) and NaN-aware weighted means of evaluation metrics;
* a federated Breslow baseline for Cox models: before each evaluation it asks every site for
  the sufficient statistics ``(d_k, R_k)`` of its training part on the shared time grid (with the
  next round's training message where that message carries the model, :mod:`strategies.rounds.carried`),
  sums them, and sends the baseline to the sites with the evaluation message;
* a round's evaluation carried by the next round's training message where the sites can evaluate
  the model alone (:mod:`strategies.rounds.carried`): one sequential message a round;
* an optional robust aggregator (Flower's ``FedTrimmedAvg``, ``FedMedian`` or ``MultiKrum``) in place
  of the weighted mean, with a record of whose coordinates or updates it left out each round
  (:func:`discarded_shares`, :func:`multikrum_selection`) and a flag on a site left out in most of its rounds;
* an optional server optimiser (Flower's ``FedAdam``, ``FedYogi``, ``FedAdagrad`` or ``FedAvgM``,
  :mod:`strategies.server_optimizers`) that turns the round's released aggregate (after any
  server-side DP noise) into the new global model.

Its :meth:`SurvivalFedAvg.run_rounds` replaces Flower's ``Strategy.start``: a loop made of the phase objects of
:mod:`strategies.rounds` (configure, screen replies, aggregate, Breslow/recalibration, evaluate, ledger). It can
begin at any round (a run resumed from a checkpoint), records every error reply, missing reply and refused
reply per phase and site, and stops the run after a round in which fewer sites' updates were
accepted than ``min_train_nodes`` (that round is not aggregated). A run in which fewer sites than that
said which site they are (:meth:`SurvivalFedAvg.identify_sites`) stops at once (:meth:`SurvivalFedAvg.require_named`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from strategies.config import ExperimentConfig
from strategies.mechanisms.base import HorizontalMechanism, SecureSumMechanism, SiteSetUp
from strategies.rounds import screening
from strategies.rounds.aggregation import PlainRelease, TrainingRelease, UpdateAggregation
from strategies.rounds.baseline import EvaluationExtras
from strategies.rounds.carried import CarriedEvaluation, CarryingGrid
from strategies.rounds.evaluation import (EvaluationScreen, ModelKeeper, average_weight, divergence, moved_toward,
                                          site_average, site_metrics, weighted_nanmean)
from strategies.rounds.ledger import RoundBook
from strategies.rounds.records import (BASELINE_EVENTS, BASELINE_RISK, KEPT_LOCAL_KEY, MAX_REASON_CHARS, NO_TEST_PART,
                                       PRIVACY_STATE_KEY, RECALIBRATION_EXPONENTS, RECALIBRATION_HORIZONS,
                                       RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE, SITE_KEY, SITE_NAME_QUERY,
                                       UNDEFINED_KEY, WEIGHT_KEY, GlobalModel, RoundRecord, TooFewSitesError,
                                       evaluated_round, failure, holds_test_part, privacy_position)
from strategies.rounds.robust import (capped_weights, centred_clip, discard_limit, discarded_shares, make_aggregator,
                                      multikrum_selection, robust_minimum, robust_refusal, robust_trim, weighted_mean)
from strategies.rounds.secure_sum import MAX_REFUSED_SUMS, SecureSumRelease
from strategies.server_optimizers import ServerOptimizer

#: The names the apps and the tests import from here (the phases' own modules, :mod:`strategies.rounds`, define them).
__all__ = [
    "BASELINE_EVENTS", "BASELINE_RISK", "KEPT_LOCAL_KEY", "MAX_REASON_CHARS", "MAX_REFUSED_SUMS", "NO_TEST_PART",
    "PRIVACY_STATE_KEY", "RECALIBRATION_EXPONENTS", "RECALIBRATION_HORIZONS", "RESUMED_CATCH_UP",
    "RESUMED_PRIVACY_STATE", "SITE_KEY", "SITE_NAME_QUERY", "UNDEFINED_KEY", "WEIGHT_KEY", "RoundRecord",
    "SurvivalFedAvg", "TooFewSitesError", "average_weight", "capped_weights", "centred_clip", "discard_limit",
    "discarded_shares", "divergence", "failure", "holds_test_part", "make_aggregator", "moved_toward",
    "multikrum_selection", "privacy_position", "robust_minimum", "robust_refusal", "robust_trim", "site_average",
    "site_metrics", "weighted_mean", "weighted_nanmean",
]


def _phase_attribute(phase: str, name: str, doc: str) -> property:
    """A strategy attribute that is attribute ``name`` of its phase object ``phase`` (read and set)."""
    return property(lambda self: getattr(getattr(self, phase), name),
                    lambda self, value: setattr(getattr(self, phase), name, value), doc=doc)


class SurvivalFedAvg(FedAvg):
    """Weighted FedAvg that checks every reply, keeps per-site metrics and builds a federated Breslow baseline.

    Its round loop (:meth:`run_rounds`) is made of the phase objects of :mod:`strategies.rounds`, which it composes:
    ``book`` (:class:`~strategies.rounds.ledger.RoundBook`), ``replies`` and ``train_screen``
    (:mod:`~strategies.rounds.screening`), ``combine`` (:class:`~strategies.rounds.aggregation.UpdateAggregation`),
    ``release`` (the run's :class:`~strategies.rounds.aggregation.TrainingRelease`), ``extras``
    (:class:`~strategies.rounds.baseline.EvaluationExtras`), ``evaluation`` and ``keeper``
    (:mod:`~strategies.rounds.evaluation`).

    Parameters
    ----------
    mechanism
        The run's privacy mechanism: it verifies each site's report and sets its weight.
    cfg
        The run's configuration (the mechanism's parameters).
    setups
        Every site's set-up (its agreed record count), by site name.
    needs_baseline
        True for Cox-type models: collect Breslow aggregates before every evaluation.
    grid_size
        Number of points of the shared time grid (the length of Breslow aggregates).
    timeout
        Seconds to wait for the sites' replies to each message of a round (train, Breslow, evaluate).
    aggregator
        A Flower strategy whose ``aggregate_train`` combines the accepted updates instead of the
        weighted mean (:func:`~strategies.rounds.robust.make_aggregator`).
    server_optimizer
        Flower's server optimiser that :meth:`run_rounds` applies to each round's aggregate
        (:func:`strategies.server_optimizers.make_server_optimizer`); ``None``: the aggregate is the
        new global model.
    **fedavg_kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (``fraction_train``,
        ``min_train_nodes``, ...). ``min_train_nodes`` is also the fewest accepted updates
        :meth:`run_rounds` aggregates.
    """

    rounds = _phase_attribute("book", "rounds", "Each round's :class:`RoundRecord`, by round.")
    node_sites = _phase_attribute("book", "node_sites", "Each named node's site (fixed at set-up).")
    global_arrays = _phase_attribute("model", "arrays", "The global model sent in the current round.")
    baseline = _phase_attribute("extras", "baseline", "The last federated Breslow baseline ``(d_k, R_k)`` (or None).")
    recalibration = _phase_attribute("extras", "recalibration", "The final model's recalibration plan and cuts.")
    exponents = _phase_attribute("extras", "exponents", "The recalibration exponents, one per cut (or None).")

    def __init__(self, *, mechanism: HorizontalMechanism, cfg: ExperimentConfig, setups: Mapping[str, SiteSetUp],
                 needs_baseline: bool, grid_size: int = 0, timeout: float = 3600.0,
                 aggregator: Strategy | None = None, server_optimizer: ServerOptimizer | None = None,
                 **fedavg_kwargs: Any) -> None:
        super().__init__(weighted_by_key=WEIGHT_KEY, **fedavg_kwargs)
        self.mechanism, self.cfg, self.setups, self.timeout = mechanism, cfg, dict(setups), timeout
        self.server_optimizer = server_optimizer
        keys = {"array_key": self.arrayrecord_key, "config_key": self.configrecord_key}
        self.book, self.model = RoundBook(), GlobalModel()
        self.replies = screening.ReplyScreen(self.book, self.model, timeout=timeout)
        self.train_screen = screening.TrainScreen(self.book, self.replies, mechanism=mechanism, cfg=cfg,
                                                  setups=self.setups, array_key=self.arrayrecord_key)
        self.combine = UpdateAggregation(self.book, self.model, cfg=cfg, mechanism=mechanism, aggregator=aggregator)
        self.release: TrainingRelease = (
            SecureSumRelease(self.book, self.replies, mechanism=mechanism, cfg=cfg, setups=self.setups,
                             timeout=timeout) if isinstance(mechanism, SecureSumMechanism) else
            PlainRelease(self.book, self.replies, self.train_screen, cfg=cfg, setups=self.setups, timeout=timeout,
                         min_train_nodes=self.min_train_nodes, **keys))
        self.extras = EvaluationExtras(self.replies, self.release, cfg=cfg, setups=self.setups,
                                       needs_baseline=needs_baseline, grid_size=grid_size, timeout=timeout, **keys)
        self.evaluation = EvaluationScreen(self.book, self.replies, cfg=cfg, setups=self.setups)
        self.keeper = ModelKeeper(self.book, cfg=cfg, drop_recalibration=self.extras.drop_recalibration)
        self.carried = CarriedEvaluation(cfg, needs_baseline=needs_baseline)

    # ------------------------------------------------------------------ identity

    def identify_sites(self, grid: Grid) -> dict[int, str]:
        """Ask every connected node which site it is; fix each node's name (:func:`screening.identify_sites`).
        Returns node -> why, for the nodes left out."""
        return screening.identify_sites(self.book, grid, setups=self.setups, timeout=self.timeout,
                                        config_key=self.configrecord_key)

    def require_named(self, left_out: Mapping[int, str]) -> None:
        """Stop the run before any further message when fewer sites were named (:meth:`identify_sites`) than a
        round needs (``min_train_nodes``, at least ``federation.min_sites``): :class:`TooFewSitesError`
        (:func:`screening.require_named`). Otherwise Flower's sampling would wait for ever for sites that are not
        there."""
        screening.require_named(len(self.node_sites), left_out, needed=self.min_train_nodes,
                                min_sites=self.cfg.federation.min_sites, strategy=self.cfg.strategy,
                                timeout=self.timeout)

    def site_reports(self, site: str, last_round: int) -> list[dict[str, float] | None]:
        """``site``'s reports of every round up to ``last_round`` in which it released an update (None: refused)."""
        return self.book.site_reports(site, last_round)

    # ------------------------------------------------------------------ the rounds

    def run_rounds(
        self, grid: Grid, *, arrays: ArrayRecord, first_round: int, last_round: int,
        end_of_round: Callable[[int, ArrayRecord], None], outer: Strategy | None = None,
        resumed: bool = False, stopping: Callable[[], bool] | None = None,
    ) -> ArrayRecord:
        """Rounds ``first_round`` to ``last_round`` from the global model ``arrays``; return the final model.

        Each round: configure (``outer.configure_train``: ``outer`` is a wrapper such as Flower's central-DP
        strategy around this one, or this strategy), the run's training release (:attr:`release`: the replies
        screened and aggregated by ``outer``, or the sites' secure sum; then, with a server optimiser, its
        step from the round's global model given that aggregate: post-processing of what was released), then the
        round's evaluation (:meth:`_evaluate_and_close`) and ``end_of_round(round, global arrays)``, or, where the
        next round's training message asks for it (:mod:`strategies.rounds.carried`), when that message's replies
        come, before they are read as training replies. A site that fails, does not answer within ``timeout`` or
        sends a reply the server refuses is recorded in the round's ``failures`` and the round goes on without it.
        If fewer than ``min_train_nodes`` updates were accepted, the round is not aggregated (the global model stays
        as it was; the sites that trained have still released their updates, so their spend is kept),
        ``end_of_round`` runs, and :class:`TooFewSitesError` stops the run.

        ``resumed`` (a run resumed from a checkpoint, whose round records are loaded): each training
        message carries its own site's last privacy state only (:data:`RESUMED_PRIVACY_STATE`), and the
        rounds charged to the site since (:data:`RESUMED_CATCH_UP`); no site sees another's.

        With ``federation.weight_average`` (:class:`~strategies.rounds.evaluation.ModelKeeper`), the model
        evaluated, passed to ``end_of_round`` and returned is the average of the global models: post-processing of
        the released models, which costs no privacy and changes no training message. A resumed run's ``arrays`` is
        then that average, and the rounds go on from the global model restored by :meth:`load_state_dict`.

        ``stopping()``: whether a stop was requested (``end_of_round`` then raises; None: never). A round that ends
        with a stop requested, or with ``debug.stop_after_round``, is evaluated in its own message; a stop requested
        while the next round's sites train ends the run after that round (:meth:`_close_carried`).
        """
        outer = self if outer is None else outer
        self.carried.stopping = stopping or (lambda: False)
        arrays = self.keeper.start(arrays, first_round=first_round, resumed=resumed)
        for server_round in range(first_round, last_round + 1):
            self.model.arrays = arrays
            messages = list(outer.configure_train(server_round, arrays, ConfigRecord(), grid))
            carrier = grid if self.carried.pending is None else CarryingGrid(
                grid, functools.partial(self._close_carried, grid, outer, end_of_round), request=self.carried.request)
            released = self.release.release(carrier, server_round, arrays, messages, outer, resumed=resumed)
            if self.carried.pending is not None:  # the message to carry it never went out (a secure sum stopped)
                self._close_carried(grid, outer, end_of_round, [], [], sorted(grid.get_node_ids()))
            if self.carried.rolled_back is not None:
                arrays = self.keeper.trained_from_rolled_back(server_round, self.carried.rolled_back)
                self.carried.rolled_back = None
            elif released is not None:
                arrays = self._step(server_round, arrays, released)
            arrays = self._evaluate_and_close(grid, server_round, arrays, outer, end_of_round, last_round)
            if (held := self.carried.held) is not None:  # the stop of the round closed in this round's message
                raise held
        assert self.keeper.average is not None
        return self.keeper.average

    def _step(self, server_round: int, arrays: ArrayRecord, aggregated: ArrayRecord) -> ArrayRecord:
        """The round's new global model: what the round released, or the server optimiser's step toward it."""
        return aggregated if self.server_optimizer is None else self.server_optimizer.step(server_round, arrays,
                                                                                          aggregated)

    def _evaluate_and_close(self, grid: Grid, server_round: int, arrays: ArrayRecord, outer: Strategy,
                            end_of_round: Callable[[int, ArrayRecord], None], last_round: int) -> ArrayRecord:
        """A round's evaluation (on the rounds :meth:`evaluates`) and :meth:`_close`; returns the model kept. A round
        the next training message asks about (:meth:`CarriedEvaluation.defers`) closes when its replies come
        (:meth:`_close_carried`). A new global model that has diverged is rolled back to the last good one before
        any site sees it (:meth:`~strategies.rounds.evaluation.ModelKeeper.checked`). The model evaluated and passed
        to ``end_of_round`` is the running average with the model kept."""
        record = self.book.record(server_round)
        arrays = self.keeper.checked(server_round, arrays)
        evaluated = self.keeper.averaged(server_round, arrays)
        if not record.shortfall and self.carried.defers(server_round, last_round):
            self.carried.pending = (server_round, arrays, evaluated)
            return arrays
        if self.evaluates(server_round):
            self._evaluate(grid, server_round, evaluated, outer)
        return self._close(grid, server_round, arrays, evaluated, outer, end_of_round)

    def _close(self, grid: Grid, server_round: int, arrays: ArrayRecord, evaluated: ArrayRecord, outer: Strategy,
               end_of_round: Callable[[int, ArrayRecord], None]) -> ArrayRecord:
        """End a round (:meth:`_settle`, then ``end_of_round(round, model evaluated)``); return the global model kept.
        :class:`TooFewSitesError` if the round was not aggregated."""
        arrays, evaluated = self._settle(grid, server_round, arrays, evaluated, outer)
        end_of_round(server_round, evaluated)
        if (record := self.book.record(server_round)).shortfall:
            raise TooFewSitesError(f"round {server_round}: {record.shortfall}; failures: "
                                   + "; ".join(f"{f['phase']}: {f['site']} (node {f['node']}): {f['reason']}"
                                               for f in record.failures))
        return arrays

    def _settle(self, grid: Grid, server_round: int, arrays: ArrayRecord, evaluated: ArrayRecord,
                outer: Strategy) -> tuple[ArrayRecord, ArrayRecord]:
        """The global model a round keeps and the model it evaluated. A model whose predictions most evaluating sites
        find not finite is rolled back, and the evaluation runs again on the model kept
        (:meth:`~strategies.rounds.evaluation.ModelKeeper.predictions_checked`)."""
        if (kept := self.keeper.predictions_checked(server_round)) is not None:
            arrays = kept
            evaluated = self.keeper.averaged(server_round, arrays)
            self._evaluate(grid, server_round, evaluated, outer)
        self.keeper.keep(server_round, arrays, evaluated)
        return arrays, evaluated

    def _close_carried(self, grid: Grid, outer: Strategy, end_of_round: Callable[[int, ArrayRecord], None],
                       messages: list[Message], parts: list[Message], failed: list[int]) -> None:
        """Close the round the training ``messages`` asked about: the carried ``parts`` read as evaluate replies (a
        model with a federated baseline: as Breslow replies, :meth:`EvaluationExtras.carry`, then its evaluate
        message); a node whose reply was not read (``failed``) asked alone; :meth:`_settle`; ``end_of_round``. A
        roll-back is noted in :attr:`CarriedEvaluation.rolled_back`; with a stop requested, what ``end_of_round``
        raises is held (:attr:`CarriedEvaluation.held`) until the round the sites have trained closes too."""
        assert self.carried.pending is not None
        server_round, arrays, evaluated = self.carried.pending
        self.carried.pending = None
        if self.extras.needs_baseline:  # the Breslow sums came: the evaluation follows with their baseline
            self.extras.carry(server_round, evaluated, grid, messages, parts, failed)
            self._evaluate(grid, server_round, evaluated, outer)
        else:
            self._evaluate(grid, server_round, evaluated, outer, nodes=failed,
                           carried=self.replies.record_failures(server_round, "evaluate", messages, parts))
        kept, evaluated = self._settle(grid, server_round, arrays, evaluated, outer)
        self.carried.rolled_back = server_round if kept is not arrays else None
        stopping = self.carried.stopping()
        try:
            end_of_round(server_round, evaluated)
        except Exception as err:
            if not stopping:
                raise
            self.carried.held = err

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round``'s model is evaluated: every ``evaluation.every``-th round, and the last
        (:func:`~strategies.rounds.records.evaluated_round`)."""
        return evaluated_round(self.cfg, server_round)

    def _evaluate(self, grid: Grid, server_round: int, arrays: ArrayRecord, outer: Strategy, *,
                  nodes: Iterable[int] | None = None, carried: Iterable[Message] = ()) -> None:
        """The round's Breslow baseline and recalibration (:meth:`configure_evaluate`), then the sites' test metrics
        of ``arrays``, from an evaluate message to every site (or to ``nodes``) and the ``carried`` evaluate replies
        already in; a run whose sites hold no test part (:func:`holds_test_part`) sends no evaluate message."""
        messages = [message for message in outer.configure_evaluate(server_round, arrays, ConfigRecord(), grid)
                    if nodes is None or message.metadata.dst_node_id in nodes]
        if not holds_test_part(self.cfg.data):
            return
        replies = list(carried)
        if messages:
            replies += self.replies.record_failures(server_round, "evaluate", messages,
                                                    grid.send_and_receive(messages, timeout=self.timeout))
        outer.aggregate_evaluate(server_round, sorted(replies, key=lambda reply: reply.metadata.src_node_id))

    # ------------------------------------------------------------------ Flower's strategy steps

    def screen_train(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Check every training reply; return the accepted ones, rebuilt with their weights
        (:meth:`~strategies.rounds.screening.TrainScreen.screen`)."""
        return self.train_screen.screen(server_round, replies)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The weighted mean (or the robust aggregator's combination) of the screened updates
        (:meth:`~strategies.rounds.aggregation.UpdateAggregation.aggregate`). A site with nothing new to contribute
        (e.g. its privacy budget is spent) has weight 0; if every site has, the global model stays as it is."""
        return self.combine.aggregate(server_round, replies, self._weighted_mean)

    def _weighted_mean(self, contributing: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's steps of ``aggregate_train`` with :func:`~strategies.rounds.robust.weighted_mean`."""
        valid, _ = self._check_and_log_replies(contributing, is_train=True)
        contents = [message.content for message in valid]
        if not contents:
            return None, None
        return weighted_mean(contents, self.weighted_by_key), self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Attach the federated Breslow baseline (Cox models) and the recalibration to the evaluation messages
        (:meth:`~strategies.rounds.baseline.EvaluationExtras.attach`)."""
        self.extras.attach(server_round, arrays, config, grid)
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Check each site's evaluation; keep the accepted sites' metrics; return their NaN-aware weighted mean
        (:meth:`~strategies.rounds.evaluation.EvaluationScreen.aggregate`)."""
        return self.evaluation.aggregate(server_round, replies)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: each round's records, the last Breslow baseline (plain Python),
        the server optimiser's state (tensors; ``None`` without one) and, with ``federation.weight_average``, the
        last global model (tensors; the checkpoint's model is then the average; ``None`` without one)."""
        iterate = self.keeper.iterate
        return {"rounds": self.book.rounds_state(),
                "baseline": None if self.baseline is None else [part.tolist() for part in self.baseline],
                "exponents": None if self.exponents is None else self.exponents.tolist(),
                "server_optimizer": None if self.server_optimizer is None else self.server_optimizer.state_dict(),
                "iterate": (iterate.to_torch_state_dict()
                            if iterate is not None and self.cfg.federation.weight_average != "none" else None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.book.load_rounds(state["rounds"])
        baseline = state["baseline"]
        self.baseline = None if baseline is None else (np.asarray(baseline[0], dtype=np.float64),
                                                       np.asarray(baseline[1], dtype=np.float64))
        exponents = state.get("exponents")
        self.exponents = None if exponents is None else np.asarray(exponents, dtype=np.float64)
        if self.server_optimizer is not None:
            self.server_optimizer.load_state_dict(state["server_optimizer"])
        iterate = state.get("iterate")
        self.keeper.iterate = None if iterate is None else ArrayRecord(iterate)
