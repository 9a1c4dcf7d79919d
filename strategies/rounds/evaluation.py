"""The evaluation phase of a round and what the server keeps of the model: the sites' test metrics screened and
pooled (:class:`EvaluationScreen`), a diverged model rolled back and the running average of the global models
(:class:`ModelKeeper`), and the pure functions they use."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.supercore import log

from models.metrics import UNDEFINED_REASONS
from strategies.arrays import values
from strategies.config import ExperimentConfig, FederationConfig
from strategies.mechanisms.base import SiteSetUp
from strategies.replies import check_evaluation, suspect_evaluations
from strategies.rounds.ledger import RoundBook
from strategies.rounds.records import KEPT_LOCAL_KEY, UNDEFINED_KEY, WEIGHT_KEY, RoundRecord, numbers, site_record
from strategies.rounds.robust import outlier_spread
from strategies.rounds.screening import ReplyScreen

#: A global model whose parameter norm grows more than this factor (from at least 1) in one round has diverged.
MAX_NORM_GROWTH = 100.0


def divergence(previous: ArrayRecord, new: ArrayRecord) -> str:
    """Why the global model ``new`` has diverged from ``previous`` ("" if it has not).

    Diverged: a weight is not finite, or the parameter norm is more than :data:`MAX_NORM_GROWTH` times
    the previous model's (or 1, if that is smaller): no honest round of training moves a model that
    far, while one finite update scaled x1e3 does.
    """
    norms = []
    for record in (previous, new):
        squares = [np.square(values(array).astype(np.float64)).sum() for array in record.values()]
        norms.append(math.sqrt(math.fsum(squares)))
    if not math.isfinite(norms[1]):
        return "the new global model has non-finite weights"
    if norms[1] > MAX_NORM_GROWTH * max(1.0, norms[0]):
        return (f"the new global model's parameter norm is {norms[1]:.3g}, more than {MAX_NORM_GROWTH:g} x the "
                f"previous model's {norms[0]:.3g}")
    return ""



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



def marked_kept_local(message: Message) -> bool:
    """Whether the reply's site record says the site kept its test metrics (:data:`KEPT_LOCAL_KEY`)."""
    record = site_record(message.content)
    return record is not None and record.get(KEPT_LOCAL_KEY) is True


def undefined_reasons(message: Message, metrics: Mapping[str, float]) -> dict[str, str]:
    """Why the site says each of its NaN ``metrics`` is undefined: metric -> explanation. Only known codes
    for metrics that are NaN are kept (a reply cannot put other text into the outputs)."""
    record = site_record(message.content)
    try:
        codes = json.loads(str(record[UNDEFINED_KEY])) if record is not None and UNDEFINED_KEY in record else {}
    except ValueError:
        return {}
    if not isinstance(codes, dict):
        return {}
    return {key: UNDEFINED_REASONS[code] for key, code in sorted(codes.items())
            if isinstance(code, str) and code in UNDEFINED_REASONS and key in metrics and math.isnan(metrics[key])}


def site_average(per_site: dict[str, dict[str, float]], weight_key: str = WEIGHT_KEY) -> dict[str, float]:
    """The plain mean of each metric over sites, each site's own test set counting once (NaN skipped).

    The figure of a multi-centre evaluation where every centre matters alike, whatever its size;
    :func:`weighted_nanmean` weights by records instead.
    """
    return weighted_nanmean({site: {**metrics, weight_key: 1.0} for site, metrics in per_site.items()}, weight_key)


def site_metrics(record: RoundRecord) -> dict[str, dict[str, Any]]:
    """Each evaluated site's test metrics, sorted by site, with ``undefined`` (metric -> why it is NaN) where any is
    and ``flag`` (why its figures are unusual) where the screen flagged them."""
    return {site: {**metrics, **({"undefined": record.evaluate_undefined[site]}
                                 if record.evaluate_undefined.get(site) else {}),
                   **({"flag": record.evaluate_flags[site]} if site in record.evaluate_flags else {})}
            for site, metrics in sorted(record.evaluate_sites.items())}


def predictions_diverged(record: RoundRecord) -> str:
    """Why the round's model has diverged by its evaluation ("" if not): more than half of the sites whose
    evaluation was accepted find its predictions not finite (one site's claim cannot roll a round back)."""
    evaluated = len(record.evaluate_sites)
    broken = sorted(site for site, reasons in record.evaluate_undefined.items()
                    if site in record.evaluate_sites and UNDEFINED_REASONS["not_finite"] in reasons.values())
    if evaluated and 2 * len(broken) > evaluated:
        return f"the new global model's predictions are not finite at {len(broken)} of {evaluated} sites"
    return ""



def average_weight(federation: FederationConfig, server_round: int) -> float:
    """The weight ``w`` of round ``server_round``'s global model ``x`` in the running average ``a`` of
    ``federation.weight_average`` (``a <- a + w (x - a)``; 1: the average is ``x``).

    ``ema``: ``(1 - d) / (1 - d^t)``, so that ``a`` after round ``t`` is the bias-corrected exponential moving
    average ``sum_s (1 - d) d^(t - s) x_s / (1 - d^t)`` of rounds 1..t (the initial model weighs nothing);
    ``tail``: the plain mean of the global models from round ``k = rounds - ceil(tail_fraction x rounds) + 1`` on
    (before round ``k`` the average is the global model); ``none``: 1."""
    if federation.weight_average == "ema":
        decay = federation.ema_decay
        return (1.0 - decay) / (1.0 - decay ** server_round)
    if federation.weight_average == "tail":
        first = federation.rounds - math.ceil(federation.tail_fraction * federation.rounds) + 1
        return 1.0 if server_round <= first else 1.0 / (server_round - first + 1)
    return 1.0


def moved_toward(average: ArrayRecord, arrays: ArrayRecord, weight: float) -> ArrayRecord:
    """``average + weight (arrays - average)``, array by array (in float64, stored in each array's dtype)."""
    if weight == 1.0:
        return arrays
    moved = {}
    for key, array in arrays.items():
        new, old = values(array), values(average[key])
        moved[key] = Array((old + weight * (new.astype(np.float64) - old)).astype(new.dtype))
    return ArrayRecord(moved)



class EvaluationScreen:
    """Screens a round's evaluation replies and pools the accepted sites' test metrics.

    Contract (:meth:`aggregate`): refused replies (identity, unknown metric, out of range, a record count) are named
    failures of phase ``evaluate``; every accepted site's metrics are kept in the round's record with ``num-examples``
    = its count agreed at set-up; returns their NaN-aware weighted mean, None when no site's were accepted.
    """

    def __init__(self, book: RoundBook, replies: ReplyScreen, *, cfg: ExperimentConfig,
                 setups: Mapping[str, SiteSetUp]) -> None:
        self.book, self.replies, self.cfg, self.setups = book, replies, cfg, setups

    def aggregate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Check each site's evaluation; keep the accepted sites' metrics; return their NaN-aware weighted mean.

        The reply carries no record count: each accepted site's metrics are weighted by its count agreed at
        set-up (the weight of :func:`weighted_nanmean`, the same as its FedAvg weight's count), so under a DP set-up
        the mean reveals no count beyond the noisy one. A site whose figures stand far outside the others'
        (:func:`~strategies.replies.suspect_evaluations`) is flagged and kept (heterogeneous sites are
        normal), or, with ``evaluation.screen``, a named failure left out of the mean. A reply marked
        :data:`~strategies.rounds.records.KEPT_LOCAL_KEY` (a site whose own policy keeps its test metrics) must
        carry no metric; its site is listed in ``evaluate_local``, not failed, and is in no per-site or pooled figure.
        """
        record = self.book.record(server_round)
        checked: dict[str, tuple[int, dict[str, float]]] = {}
        accepted = self.replies.accepted_metrics(
            server_round, "evaluate", replies, lambda site, metrics: check_evaluation(numbers(metrics)))
        for message, site, node, metrics in accepted:
            if marked_kept_local(message):
                if reason := check_evaluation(numbers(metrics), kept_local=True):
                    self.book.fail(server_round, "evaluate", node, reason)
                else:
                    record.evaluate_local.append(site)
                continue
            checked[site] = (node, {key: float(value) for key, value in numbers(metrics).items()})
            record.evaluate_undefined[site] = undefined_reasons(message, checked[site][1])
            # the site's weight in the sites' mean: its count agreed at set-up (the reply carries no count)
            checked[site][1][WEIGHT_KEY] = float(self.setups[site].count)
        suspects = suspect_evaluations({site: metrics for site, (_, metrics) in checked.items()})
        for site, (node, metrics) in sorted(checked.items()):
            if site in suspects and self.cfg.evaluation_screen:
                self.book.fail(server_round, "evaluate", node, f"implausible test metrics: {suspects[site]}")
                continue
            if site in suspects:
                record.evaluate_flags[site] = f"unusual test metrics: {suspects[site]}"
            record.evaluate_sites[site] = metrics
        if not record.evaluate_sites:
            return None
        return MetricRecord(weighted_nanmean(record.evaluate_sites))


class ModelKeeper:
    """The global model kept from round to round: the last good model, a diverged one rolled back, and the running
    average of ``federation.weight_average``.

    ``average``: the average of the global models so far (:func:`average_weight`), which is the model evaluated,
    recalibrated and returned by the round loop; ``iterate``: the last global model, which the sites train from
    (kept in a checkpoint for a resumed run); ``last_good``: the last round whose model did not diverge, and that
    model (where a diverged round goes back to).
    """

    def __init__(self, book: RoundBook, *, cfg: ExperimentConfig, drop_recalibration: Callable[[int], bool]) -> None:
        self.book, self.cfg = book, cfg
        self.drop_recalibration = drop_recalibration
        self.last_good: tuple[int, ArrayRecord | None] = (0, None)
        self.average: ArrayRecord | None = None
        self.iterate: ArrayRecord | None = None

    def start(self, arrays: ArrayRecord, *, first_round: int, resumed: bool) -> ArrayRecord:
        """Begin at ``first_round`` from ``arrays`` (a resumed run's average); return the model the sites train from
        (a resumed run's restored :attr:`iterate`, if any)."""
        self.average = arrays
        if resumed and self.iterate is not None:
            arrays = self.iterate
        self.last_good = (first_round - 1, arrays)
        return arrays

    def checked(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """``arrays``, or the last good model when they have diverged (:func:`divergence`: rolled back)."""
        if reason := divergence(self.last_good[1], arrays):
            return self.roll_back(server_round, reason)
        return arrays

    def averaged(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The running average with ``arrays`` as ``server_round``'s model (:func:`moved_toward`)."""
        assert self.average is not None
        return moved_toward(self.average, arrays, average_weight(self.cfg.federation, server_round))

    def predictions_checked(self, server_round: int) -> ArrayRecord | None:
        """The last good model when most evaluating sites found the round's predictions not finite
        (:func:`predictions_diverged`: rolled back, the round's evaluation cleared for a second one); None if not."""
        record = self.book.record(server_round)
        if record.rolled_back or not (reason := predictions_diverged(record)):
            return None
        arrays = self.roll_back(server_round, reason)
        record.evaluate_sites.clear()
        record.evaluate_undefined.clear()
        record.evaluate_flags.clear()
        record.evaluate_local.clear()
        return arrays

    def keep(self, server_round: int, arrays: ArrayRecord, evaluated: ArrayRecord) -> None:
        """End ``server_round`` with the global model ``arrays`` and the average ``evaluated``."""
        if not self.book.record(server_round).rolled_back:
            self.last_good = (server_round, arrays)
        self.average, self.iterate = evaluated, arrays

    def trained_from_rolled_back(self, server_round: int, carried_round: int) -> ArrayRecord:
        """Record that ``server_round``'s updates were trained from ``carried_round``'s model, which was rolled back
        after its evaluation came with them: they are not aggregated (released all the same: their spend stands),
        and the round keeps the last good model, which it returns."""
        self.book.record(server_round).rolled_back = {
            "to_round": self.last_good[0], "sites": [],
            "reason": (f"its updates were trained from round {carried_round}'s model, rolled back after its "
                       "evaluation: not aggregated")}
        log(WARNING, "Round %s: trained from round %s's rolled-back model; the global model stays round %s's",
            server_round, carried_round, self.last_good[0])
        assert self.last_good[1] is not None
        return self.last_good[1]

    def roll_back(self, server_round: int, reason: str) -> ArrayRecord:
        """Record that ``server_round``'s model diverged and return the last good model, which the round keeps.

        The sites named are those whose update stood out from the others that round (an update
        spread above :func:`~strategies.rounds.robust.outlier_spread`); the sites that only received or evaluated
        the diverged model are never named. The sites' updates were released all the same (their
        privacy spend stands). A recalibration computed for the diverged model is dropped, not asked again
        (each site releases it once).
        """
        record = self.book.record(server_round)
        beyond = outlier_spread(self.cfg.federation)
        sites = sorted(site for site, spread in record.update_spread.items() if spread > beyond)
        record.rolled_back = {"to_round": self.last_good[0], "reason": reason, "sites": sites}
        if self.drop_recalibration(server_round):
            record.rolled_back["recalibration"] = "dropped: it was computed for the diverged model"
        log(WARNING, "Round %s: %s; the global model goes back to round %s's (%s)", server_round, reason,
            self.last_good[0], f"caused by {', '.join(sites)}" if sites else "no site's update stood out")
        return self.last_good[1]
