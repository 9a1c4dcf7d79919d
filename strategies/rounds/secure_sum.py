"""The aggregation step of a mechanism with a secure sum (:class:`~strategies.mechanisms.base.SecureSumMechanism`):
the sites' integer vectors go through SecAgg+ (:class:`strategies.secure_aggregation.SecureSum`) and the server
unmasks only their sum, then takes the mechanism's step from it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from strategies.arrays import values
from strategies.config import ConfigError, ExperimentConfig
from strategies.mechanisms.base import SecureSumMechanism, SiteSetUp
from strategies.mechanisms.distributed_dp import count_std
from strategies.mechanisms.setup_statistics import RecalibrationPlan
from strategies.rounds.aggregation import TrainingRelease
from strategies.rounds.ledger import RoundBook
from strategies.rounds.records import RoundRecord, failure
from strategies.rounds.screening import ReplyScreen
from strategies.secure_aggregation import SecureSum, centred, protocol_parameters

#: A run with a secure sum stops once this many consecutive rounds' unmasked sums were refused (one refused
#: round keeps the model and goes on: secure aggregation cannot say which site to leave out).
MAX_REFUSED_SUMS = 3
#: The failure entry of a refused secure sum names no site: the server sees only the sum.
UNATTRIBUTABLE = "unattributable"


class SecureSumRelease(TrainingRelease):
    """A round of a mechanism with a secure sum: the sites asked send their vectors through SecAgg+, the server
    unmasks only their sum and takes the mechanism's step; its optimiser state (``server_state``) stays here.

    Every site asked for its vector counts as having released it (the round's plan is its report); a round with more
    than ``privacy.max_dropouts`` drop-outs is not unmasked (its shortfall). An unmasked sum beyond what honest
    sites can produce (the mechanism's ``server_step`` says why) is refused as a round-level failure
    (:func:`refuse_secure_sum`: phase ``secagg_sum``, site ``unattributable``): the global model and the
    server's optimiser state stay as they were, the spend counts, and the run goes on; it stops when
    :data:`MAX_REFUSED_SUMS` consecutive rounds' sums were refused.

    Consecutive training rounds are pipelined (:meth:`_pipelines`): round ``r``'s unmask message also carries round
    ``r + 1``'s stage-0 values, planned for the same sites (every site is selected each round), so a round after the
    first costs three sequential messages (share keys; masked vector, with the carried evaluation; unmask with the
    next round's keys). Round ``r + 1`` uses those keys only when its own stage-0 values and sites are exactly those
    planned (else every site gets a fresh stage 0); a site that sent none (dropped out, new) gets a stage-0 message
    of its own. Any other secure sum in between discards them. The keys are not checkpointed: a resumed run starts
    with a fresh stage 0.
    """

    def __init__(self, book: RoundBook, replies: ReplyScreen, *, mechanism: SecureSumMechanism,
                 cfg: ExperimentConfig, setups: Mapping[str, SiteSetUp], timeout: float) -> None:
        self.book, self.replies = book, replies
        self.mechanism, self.cfg, self.setups, self.timeout = mechanism, cfg, setups, timeout
        self.server_state: dict[str, Any] | None = None
        #: The next training round's planned stage-0 values and sites, and the keys the sites sent for it.
        self.advertised: tuple[tuple[dict[str, Any], list[int]], dict[int, tuple[Any, Any]]] | None = None

    def release(self, grid: Grid, server_round: int, arrays: ArrayRecord, messages: list[Message], outer: Strategy,
                *, resumed: bool) -> ArrayRecord | None:
        """The new global model from the sum of the vectors of the sites ``messages`` select (each message's
        content, as configured, goes out with the masked vector). The round's record is made once the sum is in (a
        ``grid`` that closes the previous round with the masked stage's replies closes it first)."""
        contents = {m.metadata.dst_node_id: m.content for m in messages
                    if m.metadata.dst_node_id in self.book.node_sites}
        nodes = sorted(contents)
        sites = {node: self.book.node_sites[node] for node in nodes}
        current = {key: values(array) for key, array in arrays.items()}
        dim = sum(array.size for array in current.values())
        records = sum(self.setups[site].count for site in sites.values())
        plan = self.mechanism.plan(self.cfg, parties=len(nodes), records=records, dim=dim,
                                   setup=self.setups[sites[nodes[0]]], honest_sites=self._honest_sites(sites.values()))
        result = self._secure_sum(grid, server_round, nodes, modulus=plan.modulus, dim=dim, records=records,
                                  content=lambda node: RecordDict(dict(contents[node].items())),
                                  pipelined=self._pipelines(server_round))
        record = self.book.record(server_round)
        for node in result.sent:
            record.released[sites[node]] = plan.report()
        if result.total is None:
            record.shortfall = f"secure aggregation did not complete: {result.shortfall}; the round was not aggregated"
            return None
        new, self.server_state, reason = self.mechanism.server_step(
            current, centred(result.total, plan.modulus), plan, count=self._count(result.included),
            lr=self.cfg.train.lr, state=self.server_state, sites=len(result.included),
            count_std=max(count_std(self.setups[sites[node]].prior) for node in result.included))
        if reason:
            refuse_secure_sum(record, server_round, reason, included=[sites[n] for n in result.included],
                              dropped=[f"{f['site']} ({f['phase']})" for f in record.failures],
                              streak=refused_sum_streak(self.book.rounds, server_round) + 1)
            return None
        for node in result.included:
            record.train_sites[sites[node]] = plan.report()
        assert new is not None
        return ArrayRecord({key: Array(value) for key, value in new.items()})

    def power_sums(self, server_round: int, content: RecordDict, grid: Grid,
                   plan: RecalibrationPlan) -> tuple[np.ndarray | None, float]:
        """The sites' summed power sums through the secure sum (the mechanism's ``recalibration_plan``), and the
        included sites' agreed records. A plan the run's keys cannot meet, a protocol that does not complete, or a
        sum beyond what honest sites can produce is a failure of phase ``recalibration`` (naming no site) and gives
        no sums."""
        node_sites, record = self.book.node_sites, self.book.record(server_round)
        nodes = sorted(node for node in grid.get_node_ids() if node in node_sites)
        records = sum(self.setups[node_sites[node]].count for node in nodes)
        try:
            secure = self.mechanism.recalibration_plan(
                self.cfg, parties=len(nodes), records=records, size=plan.size,
                honest_sites=self._honest_sites(node_sites[node] for node in nodes))
        except ConfigError as err:  # nothing was asked of any site: the curves stay as trained
            record.failures.append(failure("recalibration", UNATTRIBUTABLE, 0, str(err)))
            return None, 0.0
        result = self._secure_sum(grid, server_round, nodes, modulus=secure.modulus, dim=plan.size, records=records,
                                  content=lambda node: RecordDict(dict(content.items())), phase="recalibration")
        included = [node_sites[node] for node in result.included]
        if result.total is None:
            record.failures.append(failure("recalibration", UNATTRIBUTABLE, 0, result.shortfall))
            return None, 0.0
        count = self._count(result.included)
        sums, reason = self.mechanism.recalibration_sums(
            centred(result.total, secure.modulus), secure, count=count, sites=len(included),
            count_std=max(count_std(self.setups[site].prior) for site in included))
        if reason:
            record.failures.append(failure("recalibration", UNATTRIBUTABLE, 0, reason))
            log(WARNING, "Round %s: the recalibration sum was refused: %s", server_round, reason)
            return None, 0.0
        return sums, count

    def _count(self, nodes: Iterable[int]) -> float:
        """The agreed records of the sites of ``nodes``."""
        return sum(self.setups[self.book.node_sites[node]].count for node in nodes)

    def _honest_sites(self, sites: Iterable[str]) -> list[float]:
        """The honest sites that the privacy policies of ``sites`` count on, as they announced them at set-up."""
        return [setup.filter.honest_sites for site in sites
                if (setup := self.setups.get(site)) is not None and setup.filter is not None]

    def _pipelines(self, server_round: int) -> bool:
        """Whether ``server_round``'s unmask message carries the next training round's stage 0: a next round comes
        (not the last, not ``debug.stop_after_round``) and selects every site (``federation.fraction_train = 1``),
        so its planned sites are this round's."""
        return (server_round < int(self.cfg.federation.rounds) and server_round != self.cfg.debug.stop_after_round
                and self.cfg.federation.fraction_train == 1.0)

    def _secure_sum(self, grid: Grid, server_round: int, nodes: list[int], *, modulus: int, dim: int, records: float,
                    content: Callable[[int], RecordDict], phase: str | None = None, pipelined: bool = False) -> Any:
        """One run of SecAgg+ (:class:`strategies.secure_aggregation.SecureSum`) over ``nodes``, whose agreed records
        are ``records``; its failures recorded under the stage's name, or under ``phase`` naming the stage. The
        sum is not unmasked when more than ``privacy.max_dropouts`` sites dropped out. The keys the previous sum's
        unmask replies carried (:attr:`advertised`) serve when this sum's stage-0 values and sites are those
        planned; ``pipelined``: this sum's unmask message carries the stage 0 of the next sum, planned as this one."""
        privacy = self.cfg.privacy
        num_shares, threshold = protocol_parameters(len(nodes), max_dropouts=privacy.max_dropouts,
                                                    colluding=privacy.colluding_sites)
        secure = SecureSum(modulus=modulus, num_shares=num_shares, threshold=threshold, dimension=dim,
                           timeout=self.timeout, shuffle_seed=self.cfg.seed * 100_003 + server_round)
        setup = {"parties": len(nodes), "records": float(records)}
        planned = (secure.stage_zero(setup), list(nodes))
        advertised, self.advertised = self.advertised, None
        result = secure.run(grid, nodes, setup=setup, masked_content=content,
                            group=f"{server_round}{'-' + phase if phase else ''}",
                            min_included=len(nodes) - privacy.max_dropouts,
                            advertised=advertised[1] if advertised is not None and advertised[0] == planned else None,
                            next_setup=planned[0] if pipelined else None)
        if pipelined and result.advertised:
            self.advertised = (planned, result.advertised)
        for stage, node, reason in result.failures:
            stage = stage.removeprefix("query.")
            self.book.fail(server_round, phase or stage, node, f"{stage}: {reason}" if phase else reason)
        return result


def refused_sum_streak(rounds: Mapping[int, RoundRecord], server_round: int) -> int:
    """How many rounds right before ``server_round`` had their unmasked secure sum refused (phase ``secagg_sum``)."""
    streak, previous = 0, server_round - 1
    while previous in rounds and any(f["phase"] == "secagg_sum" for f in rounds[previous].failures):
        streak, previous = streak + 1, previous - 1
    return streak


def refuse_secure_sum(record: RoundRecord, server_round: int, reason: str, *, included: list[str],
                      dropped: list[str], streak: int) -> None:
    """Record a refused unmasked sum as a round-level failure naming the stage and the drop-outs, no site.

    The round is not aggregated but the run goes on (no shortfall) unless this is the
    :data:`MAX_REFUSED_SUMS`-th refused round in a row: then the shortfall stops the run with a named error.
    """
    text = (f"stage: the sum check, after the masked-vector collection and the unmasking; {reason}. Sites in the "
            f"sum: {', '.join(included)}; drop-outs and failures before it: {'; '.join(dropped) or 'none'}. The round "
            "was not aggregated (the global model stays; every site asked released its vector, so its spend counts); "
            f"{streak} consecutive refused round(s), the run stops at {MAX_REFUSED_SUMS}")
    record.failures.append(failure("secagg_sum", UNATTRIBUTABLE, 0, text))
    if streak >= MAX_REFUSED_SUMS:
        record.shortfall = (f"the unmasked secure sum was refused in {streak} consecutive rounds (up to round "
                            f"{server_round}): a site keeps sending vectors outside the protocol and secure "
                            "aggregation cannot say which; the run stops")
