"""The Breslow/recalibration phase: what an evaluation message carries besides the model.

Before each evaluation of a Cox-type model, :class:`EvaluationExtras` asks every site for the sufficient statistics
``(d_k, R_k)`` of its training part on the shared time grid and sums them (the federated Breslow baseline), or
sums those the next round's training replies carried (:meth:`EvaluationExtras.carry`,
:mod:`strategies.rounds.carried`); after the last round of a private set-up's hazard model, it collects the sites'
noisy recalibration power sums once (through the run's :class:`~strategies.rounds.aggregation.TrainingRelease`, as
its sites release them) and fits the recalibration exponents. Both go out in the evaluation config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from models.recalibration import cut_exponents, fit_exponents
from strategies.config import ExperimentConfig
from strategies.mechanisms.base import SiteSetUp
from strategies.mechanisms.setup_statistics import RecalibrationPlan
from strategies.replies import check_breslow
from strategies.rounds.aggregation import TrainingRelease
from strategies.rounds.records import (BASELINE_EVENTS, BASELINE_RISK, BRESLOW_QUERY, RECALIBRATION_EXPONENTS,
                                       RECALIBRATION_HORIZONS)
from strategies.rounds.screening import ReplyScreen


class EvaluationExtras:
    """The federated Breslow baseline (``needs_baseline``) and the final model's recalibration (``recalibration``:
    its public plan and the model's cuts; ``exponents``: its result, one per cut, None until then or without one).

    Contract (:meth:`attach`): adds the baseline and the exponents to an evaluation config; asks for the Breslow
    aggregates on every call (unless :meth:`carry` summed those of the round's model) and for the recalibration sums
    once a run, on the last round (each site releases its recalibration sums once).
    """

    def __init__(self, replies: ReplyScreen, release: TrainingRelease, *, cfg: ExperimentConfig,
                 setups: Mapping[str, SiteSetUp], needs_baseline: bool, grid_size: int, timeout: float,
                 array_key: str, config_key: str) -> None:
        self.replies, self.release = replies, release
        self.cfg, self.setups, self.timeout = cfg, setups, timeout
        self.needs_baseline, self.grid_size = needs_baseline, grid_size
        self.array_key, self.config_key = array_key, config_key
        self.baseline: tuple[np.ndarray, np.ndarray] | None = None
        self.recalibration: tuple[RecalibrationPlan, np.ndarray] | None = None
        self.exponents: np.ndarray | None = None
        self._recalibrated = False
        self._carried: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}  # round -> baseline from carried sums

    def attach(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> None:
        """Collect what ``server_round``'s evaluation of ``arrays`` needs and add it to ``config``."""
        if self.needs_baseline:
            self.baseline = (self._carried.pop(server_round) if server_round in self._carried else
                             self._summed(server_round, self._query(server_round, arrays, grid, grid.get_node_ids())))
            if self.baseline is not None:
                config[BASELINE_EVENTS] = self.baseline[0].tolist()
                config[BASELINE_RISK] = self.baseline[1].tolist()
        if self.recalibration is not None and server_round == self.cfg.federation.rounds and not self._recalibrated:
            self._recalibrated = True  # each site releases its recalibration sums once
            self.exponents = self._collect_recalibration(server_round, arrays, grid)
        if self.exponents is not None:
            config[RECALIBRATION_EXPONENTS] = self.exponents.tolist()

    def drop_recalibration(self, server_round: int) -> bool:
        """Drop the exponents computed for ``server_round``'s model (it diverged); whether there were any."""
        if self.exponents is not None and server_round == self.cfg.federation.rounds and self.recalibration:
            self.exponents = None
            return True
        return False

    def carry(self, server_round: int, arrays: ArrayRecord, grid: Grid, messages: list[Message],
              parts: list[Message], failed: Iterable[int]) -> None:
        """Sum the Breslow sums of ``server_round``'s model ``arrays`` that training ``messages``' replies carried
        (``parts``; the nodes ``failed``, whose reply was not read, asked in a Breslow query of their own); the
        round's next :meth:`attach` uses the sum (once: an evaluation after a roll-back asks again)."""
        replies = self.replies.record_failures(server_round, "breslow", messages, parts)
        if failed := list(failed):
            replies += self._query(server_round, arrays, grid, failed)
        self._carried[server_round] = self._summed(server_round,
                                                   sorted(replies, key=lambda reply: reply.metadata.src_node_id))

    def _query(self, server_round: int, arrays: ArrayRecord, grid: Grid, nodes: Iterable[int]) -> list[Message]:
        """Ask ``nodes`` for the Breslow sums of the model in ``arrays``; the usable replies, by node."""
        messages = [
            Message(content=RecordDict({self.array_key: arrays,
                                        self.config_key: ConfigRecord({"server-round": server_round})}),
                    dst_node_id=node_id, message_type=BRESLOW_QUERY)
            for node_id in nodes
        ]
        return self.replies.record_failures(server_round, "breslow", messages,
                                            grid.send_and_receive(messages, timeout=self.timeout))

    def _summed(self, server_round: int, replies: Iterable[Message]) -> tuple[np.ndarray, np.ndarray] | None:
        """Sum the accepted sites' ``(d_k, R_k)`` in ``replies`` (in their order; None when no site's was accepted)."""
        event_counts: np.ndarray | None = None
        risk_sums: np.ndarray | None = None
        accepted = self.replies.accepted_metrics(
            server_round, "breslow", replies,
            lambda site, metrics: check_breslow(metrics.get("event_counts"), metrics.get("risk_sums"),
                                                grid_size=self.grid_size, max_records=self.setups[site].count))
        for _, _, _, metrics in accepted:
            site_events = np.asarray(metrics["event_counts"], dtype=np.float64)
            site_risk = np.asarray(metrics["risk_sums"], dtype=np.float64)
            event_counts = site_events if event_counts is None else event_counts + site_events
            risk_sums = site_risk if risk_sums is None else risk_sums + site_risk
        if event_counts is None or risk_sums is None:
            log(WARNING, "Round %s: no site answered the Breslow query; no baseline hazard", server_round)
            return None
        return event_counts, risk_sums

    def _collect_recalibration(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> np.ndarray | None:
        """The final model's recalibration exponents at its cuts, from the sites' summed noisy power sums
        (:func:`models.recalibration.fit_exponents` against the plan's target); None when no sum came."""
        assert self.recalibration is not None
        plan, cuts = self.recalibration
        config = ConfigRecord({"server-round": server_round, RECALIBRATION_HORIZONS: plan.horizons.tolist()})
        total, count = self.release.power_sums(
            server_round, RecordDict({self.array_key: arrays, self.config_key: config}), grid, plan)
        if total is None or count == 0:
            log(WARNING, "Round %s: no recalibration sum came; the curves stay as trained", server_round)
            return None
        exponents = fit_exponents(total.reshape(plan.horizons.size, -1), count, plan.target)
        return cut_exponents(cuts, plan.horizons, exponents)
