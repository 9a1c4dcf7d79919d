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
  the sufficient statistics ``(d_k, R_k)`` of its training part on the shared time grid, sums
  them, and sends the baseline to the sites with the evaluation message;
* an optional robust aggregator (Flower's ``FedTrimmedAvg``, ``FedMedian`` or ``MultiKrum``) in place
  of the weighted mean, with a record of whose coordinates or updates it left out each round
  (:func:`discarded_shares`, :func:`multikrum_selection`) and a flag on a site left out in most of its rounds;
* an optional server optimiser (Flower's ``FedAdam``, ``FedYogi``, ``FedAdagrad`` or ``FedAvgM``,
  :mod:`strategies.server_optimizers`) that turns the round's released aggregate (after any
  server-side DP noise) into the new global model.

Its :meth:`SurvivalFedAvg.run_rounds` replaces Flower's ``Strategy.start``: it can begin at any
round (a run resumed from a checkpoint), records every error reply, missing reply and refused
reply per phase and site, and stops the run after a round in which fewer sites' updates were
accepted than ``min_train_nodes`` (that round is not aggregated). A run in which fewer sites than that
said which site they are (:meth:`SurvivalFedAvg.identify_sites`) stops at once (:meth:`SurvivalFedAvg.require_named`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, MultiKrum, Strategy
from flwr.supercore import log

from models.metrics import UNDEFINED_REASONS
from models.recalibration import cut_exponents, fit_exponents
from strategies.arrays import values
from strategies.config import (
    AGGREGATIONS,
    DEFAULT_UPDATE_BOUND,
    OUTLIER_SPREAD,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    FederationConfig,
)
from strategies.mechanisms.base import HorizontalMechanism, SecureSumMechanism, SiteSetUp
from strategies.mechanisms.setup_share import recalibration_multiplier
from strategies.mechanisms.setup_statistics import RecalibrationPlan
from strategies.server_optimizers import ServerOptimizer
from strategies.replies import (
    check_arrays,
    check_breslow,
    check_count,
    check_evaluation,
    check_power_sums,
    error_message,
    suspect_evaluations,
)

SITE_KEY = "site"
#: What a run whose sites hold out no test part (:func:`holds_test_part`) reports in place of test figures.
NO_TEST_PART = ("none: data.test_fraction = 0, so no site held out a test part and the model trained on every "
                "record; no test figure, site test metric, calibration table, Kaplan–Meier null or survival_vs_km.png, "
                "and a round's model is rolled back on its weights alone, not on the sites' predictions (score the "
                "saved model on other records: fedsurv.load_run(dir).score)")
WEIGHT_KEY = "num-examples"
BRESLOW_QUERY = "query.breslow"
BASELINE_EVENTS = "baseline.event_counts"
BASELINE_RISK = "baseline.risk_sums"
#: Query for a site's noisy recalibration sums of the final model (:mod:`models.recalibration`).
RECALIBRATION_QUERY = "query.recalibration"
#: In the recalibration query's config: the horizons (public plan).
RECALIBRATION_HORIZONS = "recalibration.horizons"
#: In the final round's evaluate config: the recalibration exponent at every cut.
RECALIBRATION_EXPONENTS = "recalibration.exponents"
#: In an evaluate reply's site record: why each undefined (NaN) metric is undefined (JSON: metric -> a code of
#: :data:`models.metrics.UNDEFINED_REASONS`; absent when every metric is defined).
UNDEFINED_KEY = "undefined"
#: In an evaluate reply's site record: ``True`` when the site kept its test metrics (its metric record is empty).
KEPT_LOCAL_KEY = "kept_local"
#: In a train reply's site record: the site's privacy state (JSON: its accountant), kept in the checkpoint.
PRIVACY_STATE_KEY = "privacy_state"
#: In a resumed run's train config: the receiving site's own privacy state from the checkpoint (JSON), for a
#: site whose node state is empty (a new run starts with empty node states). Each site gets only its own.
RESUMED_PRIVACY_STATE = "resume.privacy_state"
#: In a resumed run's train config, beside :data:`RESUMED_PRIVACY_STATE`: the rounds the server has charged the site
#: since that state (released without an accepted reply), which the site charges to its accountant before training.
RESUMED_CATCH_UP = "resume.catch_up"
#: Query asking a node which site it is (the server names every node once, at the start of a run).
SITE_NAME_QUERY = "query.site_name"
#: The most a site's privacy state may weigh (it is kept in every checkpoint).
MAX_PRIVACY_STATE_CHARS = 1_000_000


class TooFewSitesError(RuntimeError):
    """Fewer sites' updates were accepted in a round than the federation's minimum; the run cannot go on."""


#: A failure's reason is cut to this many characters (a hostile reply must not flood metrics.jsonl and checkpoints).
MAX_REASON_CHARS = 1000
#: A reply's metric record may carry at most this many keys (more are refused by count, unread).
MAX_METRIC_KEYS = 64
#: A reply may carry at most this many bytes besides a model's worth of arrays (more are refused by count, unread).
MAX_REPLY_EXTRA_BYTES = 2_000_000
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


def failure(phase: str, site: str, node: int, reason: str) -> dict[str, Any]:
    """One named failure of a round: which message, which site (and node), why (cut to ``MAX_REASON_CHARS``)."""
    if len(reason) > MAX_REASON_CHARS:
        reason = f"{reason[:MAX_REASON_CHARS - 40]} ... ({len(reason) - MAX_REASON_CHARS + 40} characters cut)"
    return {"phase": phase, "site": site[:200], "node": int(node), "reason": reason}


@dataclass
class RoundRecord:
    """What the strategy learnt about one round.

    ``released``: every site whose training reply arrived, with its report if the server accepted
    it and ``None`` if it refused it (the update reached the server either way, so the ledger
    counts it), and every site that did not answer in time (``None``: it may have sent its update
    late). A site whose ClientApp failed (an error reply) released nothing that round. ``train_sites``: the accepted reports. ``privacy_states``: the state each accepted
    site reported (JSON). ``failures``: ``{"phase", "site", "node", "reason"}`` of every error,
    missing or refused reply. ``evaluate_flags``: sites whose test metrics stand far outside the
    others' (kept unless ``evaluation.screen``), and why; ``train_flags``: sites whose update's pull
    was bounded (:func:`centred_clip`), and why; ``update_spread``: each update's distance from the
    coordinate-wise median over the median distance. ``shortfall`` says why the round was not
    aggregated (too few sites), empty otherwise. ``rolled_back``: when the round's new global model
    diverged (:func:`divergence`, or most sites' predictions not finite), ``{"to_round", "reason",
    "sites"}``: the round kept the model of round ``to_round``; ``sites`` are the sites whose updates
    stood out that round (none named when no update did). ``evaluate_local``: sites that kept their test
    metrics at the site (their evaluation reply carries none; they are in no per-site or pooled figure).
    ``weight_flags``: sites whose weight was capped (:func:`capped_weights`), and why. With a robust aggregator,
    ``discarded``: each aggregated site's share of what the aggregator left out of its update (its coordinates
    outside the kept values, :func:`discarded_shares`; krum: 1 when its update was not selected, 0 when it was);
    ``discarded_most``: the sites left out more than the aggregator's even spread (:func:`discard_limit`) that round;
    ``aggregate_flags``: sites left out in more than half of the rounds they took part in (at least 2), and why.
    """

    train_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    released: dict[str, dict[str, float] | None] = field(default_factory=dict)
    evaluate_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    evaluate_undefined: dict[str, dict[str, str]] = field(default_factory=dict)
    evaluate_flags: dict[str, str] = field(default_factory=dict)
    train_flags: dict[str, str] = field(default_factory=dict)
    update_spread: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    privacy_states: dict[str, str] = field(default_factory=dict)
    shortfall: str = ""
    rolled_back: dict[str, Any] = field(default_factory=dict)
    evaluate_local: list[str] = field(default_factory=list)
    weight_flags: dict[str, str] = field(default_factory=dict)
    discarded: dict[str, float] = field(default_factory=dict)
    discarded_most: list[str] = field(default_factory=list)
    aggregate_flags: dict[str, str] = field(default_factory=dict)


def holds_test_part(data: DataConfig) -> bool:
    """Whether the run's sites hold out test parts: ``data.split_col`` labels them, or ``data.test_fraction`` > 0."""
    return bool(data.split_col) or data.test_fraction > 0


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


def _records_of(content: RecordDict, kind: type) -> list:
    """The records of type ``kind`` in ``content``, in order, as ``content.array_records.values()`` & co. list them
    (those properties build and type-check a new dictionary at every access: a large federation reads them often)."""
    return [record for record in content.values() if isinstance(record, kind)]


def _site_record(content: RecordDict) -> ConfigRecord | None:
    """``content.config_records.get(SITE_KEY)``."""
    record = content.get(SITE_KEY)
    return record if isinstance(record, ConfigRecord) else None


def _claimed_name(message: Message) -> str | None:
    record = _site_record(message.content)
    return None if record is None or "name" not in record else str(record["name"])


def _metric_record(message: Message) -> MetricRecord | None:
    records = _records_of(message.content, MetricRecord)
    return records[0] if len(records) == 1 else None


def _marked_kept_local(message: Message) -> bool:
    """Whether the reply's site record says the site kept its test metrics (:data:`KEPT_LOCAL_KEY`)."""
    record = _site_record(message.content)
    return record is not None and record.get(KEPT_LOCAL_KEY) is True


def _undefined(message: Message, metrics: Mapping[str, float]) -> dict[str, str]:
    """Why the site says each of its NaN ``metrics`` is undefined: metric -> explanation. Only known codes
    for metrics that are NaN are kept (a reply cannot put other text into the outputs)."""
    record = _site_record(message.content)
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


def _predictions_diverged(record: RoundRecord) -> str:
    """Why the round's model has diverged by its evaluation ("" if not): more than half of the sites whose
    evaluation was accepted find its predictions not finite (one site's claim cannot roll a round back)."""
    evaluated = len(record.evaluate_sites)
    broken = sorted(site for site, reasons in record.evaluate_undefined.items()
                    if site in record.evaluate_sites and UNDEFINED_REASONS["not_finite"] in reasons.values())
    if evaluated and 2 * len(broken) > evaluated:
        return f"the new global model's predictions are not finite at {len(broken)} of {evaluated} sites"
    return ""


def _digest(arrays: ArrayRecord) -> bytes:
    """A digest of a model's names and bytes (to recognise the same update sent twice)."""
    digest = hashlib.blake2b(digest_size=16)
    for key, array in arrays.items():
        digest.update(key.encode())
        digest.update(array.data)
    return digest.digest()


def privacy_position(rounds: Mapping[int, Any], site: str) -> tuple[str | None, int]:
    """``site``'s last privacy state the server holds and how many rounds it has charged the site since.

    ``rounds``: the strategy's round records (``privacy_states``: the state of each accepted training
    reply; ``released``: every round the server counts as released by the site, accepted, refused or
    unanswered). Returns ``(state JSON or None, rounds charged after it)``.
    """
    state, since = None, 0
    for server_round in sorted(rounds):
        record = rounds[server_round]
        if site in record.privacy_states:
            state, since = record.privacy_states[site], 0
        elif site in record.released:
            since += 1
    return state, since


def _value_bytes(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, list):
        return sum(_value_bytes(item) for item in value)
    return 8


def payload_bytes(content: RecordDict) -> int:
    """The bytes a message's records carry: its arrays' data, each key, 8 per number, each string's length."""
    arrays = sum(len(array.data) for record in _records_of(content, ArrayRecord) for array in record.values())
    values = sum(len(key) + _value_bytes(value)
                 for record in (*_records_of(content, MetricRecord), *_records_of(content, ConfigRecord))
                 for key, value in record.items())
    return arrays + values


def _numbers(record: MetricRecord) -> dict[str, Any]:
    return {key: value for key, value in record.items() if not isinstance(value, list)}


def weighted_mean(contents: list[RecordDict], weight_key: str) -> ArrayRecord:
    """FedAvg's weighted mean of the replies' arrays: Flower's ``aggregate_arrayrecords``, the same float
    operations in the same order (the same bytes: tests), reading each array as a view
    (:func:`strategies.arrays.values`) instead of parsing it with ``Array.numpy()``."""
    weights = [_records_of(content, MetricRecord)[0][weight_key] for content in contents]
    total = sum(weights)
    sums: dict[str, np.ndarray] = {}
    for content, factor in zip(contents, [weight / total for weight in weights], strict=True):
        for record in _records_of(content, ArrayRecord):
            for key, array in record.items():
                if key not in sums:
                    sums[key] = values(array) * factor
                else:
                    sums[key] += values(array) * factor
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in sums.items()})


#: Columns of the update matrix that :func:`centred_clip` and :func:`coordinate_median` work on at once: their
#: temporaries stay a few MB (reused by the allocator, in cache) instead of copies of the whole matrix, which
#: cost a thousand-site round more in page faults than in arithmetic.
COLUMN_BLOCK = 256


def _blocks(width: int) -> list[slice]:
    return [slice(start, min(start + COLUMN_BLOCK, width)) for start in range(0, width, COLUMN_BLOCK)]


def centred_clip(updates: np.ndarray, weights: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The weighted mean of ``updates`` with each one's pull from the coordinate-wise median bounded.

    .. math::

        v = \operatorname{median}_i x_i, \quad \tau = b \cdot \operatorname{median}_i \lVert x_i - v\rVert,
        \quad \bar x = v + \sum_i w_i \min\Bigl(1, \frac{\tau}{\lVert x_i - v\rVert}\Bigr)(x_i - v)

    (centred clipping, Karimireddy, He & Jaggi, ICML 2021, one step from the median). When no update is
    farther than :math:`\tau` it is exactly the weighted mean :math:`\sum_i w_i x_i`; one update, however
    large, moves it by at most :math:`w_i \tau`. ``updates``: shape ``(k, d)``; ``weights``: shape ``(k,)``,
    summing to 1; ``bound``: :math:`b \ge 1`. Returns the aggregate, each update's scale (1: untouched) and
    its distance over the median distance. Works on :data:`COLUMN_BLOCK` columns at a time.
    """
    centre = coordinate_median(updates)
    squares = np.zeros(updates.shape[0])
    for block in _blocks(updates.shape[1]):
        offsets = updates[:, block] - centre[block]
        squares += np.einsum("ij,ij->i", offsets, offsets)
    distance = np.sqrt(squares)
    typical = float(np.median(distance))
    spread = distance / typical if typical > 0 else np.where(distance > 0, np.inf, 1.0)
    tau = bound * typical
    scale = np.minimum(1.0, np.divide(tau, distance, out=np.ones_like(distance), where=distance > 0))
    pull = weights * scale
    mean = np.empty_like(centre)
    for block in _blocks(updates.shape[1]):
        mean[block] = centre[block] + pull @ (updates[:, block] - centre[block])
    return mean, scale, spread


def coordinate_median(updates: np.ndarray) -> np.ndarray:
    """``np.median(updates, axis=0)`` of finite ``updates`` (shape ``(k, d)``), the same floats, from one partition
    of each :data:`COLUMN_BLOCK` columns, transposed so that each coordinate's values lie side by side: for even
    ``k`` the upper middle value is the smallest of the upper half (``np.median`` partitions at both)."""
    k = updates.shape[0]
    middle = k // 2
    centre = np.empty(updates.shape[1])
    for block in _blocks(updates.shape[1]):
        columns = np.ascontiguousarray(updates[:, block].T)  # each coordinate's k values side by side
        if k % 2:
            columns.partition(middle, axis=1)
            centre[block] = columns[:, middle]
        else:
            columns.partition(middle - 1, axis=1)
            centre[block] = (columns[:, middle - 1] + columns[:, middle:].min(axis=1)) / 2.0
    return centre


def _stacked(arrays: Sequence[ArrayRecord], names: Sequence[str], out: np.ndarray | None = None) -> np.ndarray:
    """The updates as the rows of one float64 matrix, each the concatenation of its arrays ``names`` flattened (read
    as views, :func:`strategies.arrays.values`, and converted once, into the matrix); written into ``out`` (a
    buffer kept from an earlier round) where its shape fits."""
    sizes = [values(arrays[0][name]).size for name in names]
    shape = (len(arrays), sum(sizes))
    matrix = out if out is not None and out.shape == shape else np.empty(shape)
    for row, array in zip(matrix, arrays, strict=True):
        start = 0
        for name, size in zip(names, sizes, strict=True):
            row[start:start + size] = values(array[name]).ravel()
            start += size
    return matrix


def capped_weights(weights: np.ndarray, ratio: float) -> np.ndarray:
    """``weights`` with each capped at ``ratio`` x the median of the positive ones; ``ratio`` 0: unchanged.

    A weight of 0 (a site with nothing new) stays 0 and counts in no median. One site's inflated count
    then weighs at most ``ratio`` x a typical site's, however large it is.
    """
    positive = weights[weights > 0]
    if ratio <= 0 or positive.size == 0:
        return weights.copy()
    return np.minimum(weights, ratio * float(np.median(positive)))


def robust_trim(name: str, *, sites: int, trim_fraction: float) -> int:
    """How many values of each coordinate aggregator ``name`` cuts at each tail of ``sites`` updates: Flower's
    ``FedTrimmedAvg`` ``int(trim_fraction x sites)``; ``FedMedian`` all but the median (the middle pair for even
    ``sites``), ``(sites - 1) // 2``."""
    return int(trim_fraction * sites) if name == "trimmed_mean" else (sites - 1) // 2


def discarded_shares(updates: np.ndarray, trim: int) -> np.ndarray:
    """Each row's share of the coordinates where a cut of ``trim`` values at each tail leaves its value out.

    ``updates``: shape ``(k, d)``. A value is left out of a coordinate when it lies below the
    ``trim + 1``-th smallest value or above the ``trim + 1``-th largest, the range that a trimmed mean
    (``FedTrimmedAvg``) averages and in which a median (``trim = (k - 1) // 2``) lies; a value equal to a
    kept one counts as kept. Works on :data:`COLUMN_BLOCK` columns at a time.
    """
    k = updates.shape[0]
    outside = np.zeros(k)
    for block in _blocks(updates.shape[1]):
        columns = updates[:, block]
        ordered = np.sort(columns, axis=0)
        outside += ((columns < ordered[trim]) | (columns > ordered[k - 1 - trim])).sum(axis=1)
    return outside / max(1, updates.shape[1])


def discard_limit(sites: int, left_out: int) -> float:
    """The share from which a site counts as left out of a round: the aggregator leaves out ``left_out`` of
    ``sites`` values a coordinate (krum: updates), a share ``e = left_out / sites`` of each site's when
    spread evenly; a site is left out when it kept at most half of the ``1 - e`` it would keep then."""
    even = left_out / sites
    return even + (1.0 - even) / 2.0


def multikrum_selection(updates: np.ndarray, malicious: int, keep: int) -> np.ndarray:
    """The rows multi-krum averages (Blanchard et al. 2017), best score first: Flower's ``select_multikrum``.

    ``updates``: the models as rows, shape ``(k, d)``, in the dtype Flower's selection computes in (the models'
    own). Each row's score is the sum of its squared distances to its ``max(1, k - malicious - 2)`` nearest other
    rows; the ``keep`` lowest scores are selected. The same arithmetic as Flower's, so the same selection.
    """
    norms = np.square(updates).sum(axis=1)
    distances = norms[:, None] + norms[None, :] - 2 * updates @ updates.T
    nearest = max(1, updates.shape[0] - malicious - 2)
    scores = [np.sum(row[np.argsort(row)[1:nearest + 1]]) for row in distances]
    return np.argsort(scores)[:keep]


def robust_minimum(name: str, *, trim_fraction: float, malicious: int) -> float:
    """The fewest updates with which aggregator ``name`` does what it says (1 for FedAvg's mean).

    ``trimmed_mean`` cuts ``int(trim_fraction * n)`` updates at each tail (Flower's ``FedTrimmedAvg``):
    at least one needs ``n >= ceil(1 / trim_fraction)``; ``median`` resists one outlier from 3 updates;
    ``krum`` with ``malicious`` = f >= 1 needs ``n >= 2 f + 3``; with f = 0 (none left to tolerate, e.g. once a
    free rider is set aside) it averages every update, from 1.
    """
    if name == "trimmed_mean":
        return max(3, math.ceil(1.0 / trim_fraction - 1e-9)) if trim_fraction > 0 else math.inf
    if name == "median":
        return 3
    if name == "krum":
        return 2 * malicious + 3 if malicious else 1
    return 1


def robust_refusal(name: str, *, trim_fraction: float, malicious: int, sites: int) -> str:
    """Why ``sites`` updates a round are too few for aggregator ``name`` ("" when they are enough)."""
    needed = robust_minimum(name, trim_fraction=trim_fraction, malicious=malicious)
    if sites >= needed:
        return ""
    if name == "trimmed_mean" and trim_fraction == 0:
        return "federation.aggregation = 'trimmed_mean' with federation.trim_fraction = 0 trims nothing: set it above 0"
    if name == "trimmed_mean":
        return (f"federation.aggregation = 'trimmed_mean' with federation.trim_fraction = {trim_fraction:g} trims "
                f"int({trim_fraction:g} x {sites}) = {int(trim_fraction * sites)} of the {sites} sites of a round "
                f"at each tail; it needs at least {needed} sites a round at this trim_fraction"
                + (f" (or federation.trim_fraction >= {1 / sites:.3g})" if sites >= 3 else ""))
    if name == "krum":
        return (f"federation.aggregation = 'krum' with federation.max_malicious = {malicious} needs at least "
                f"2 x {malicious} + 3 = {needed} sites a round; {sites} take part")
    return f"federation.aggregation = 'median' needs at least 3 sites a round to outvote one; {sites} take part"


def make_aggregator(name: str, *, trim_fraction: float, malicious: int, sites: int,
                    **fedavg_kwargs: Any) -> Strategy | None:
    """Flower's robust aggregator ``name`` (None for the weighted mean of FedAvg itself), for ``sites``
    updates a round; ``ConfigError`` naming the keys when they are too few for it (:func:`robust_minimum`).

    ``trimmed_mean``: ``FedTrimmedAvg`` (coordinate-wise mean without the ``trim_fraction`` largest
    and smallest values); ``median``: ``FedMedian`` (coordinate-wise median); ``krum``: ``MultiKrum``
    with ``malicious`` tolerated sites, averaging the ``sites - malicious`` best-scored updates (each round
    :meth:`SurvivalFedAvg.aggregate_train` sets both for the updates it hands it).
    """
    if name not in AGGREGATIONS:
        raise ConfigError(f"run config: 'federation.aggregation' = {name!r}; choose one of {', '.join(AGGREGATIONS)}")
    if reason := robust_refusal(name, trim_fraction=trim_fraction, malicious=malicious, sites=sites):
        raise ConfigError(f"run config: {reason}")
    if name == "trimmed_mean":
        return FedTrimmedAvg(beta=trim_fraction, **fedavg_kwargs)
    if name == "median":
        return FedMedian(**fedavg_kwargs)
    if name == "krum":
        return MultiKrum(num_malicious_nodes=malicious, num_nodes_to_select=max(1, sites - malicious), **fedavg_kwargs)
    return None


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


class SurvivalFedAvg(FedAvg):
    """Weighted FedAvg that checks every reply, keeps per-site metrics and builds a federated Breslow baseline.

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
        weighted mean (:func:`make_aggregator`).
    server_optimizer
        Flower's server optimiser that :meth:`run_rounds` applies to each round's aggregate
        (:func:`strategies.server_optimizers.make_server_optimizer`); ``None``: the aggregate is the
        new global model.
    **fedavg_kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (``fraction_train``,
        ``min_train_nodes``, ...). ``min_train_nodes`` is also the fewest accepted updates
        :meth:`run_rounds` aggregates.
    """

    def __init__(self, *, mechanism: HorizontalMechanism, cfg: ExperimentConfig, setups: Mapping[str, SiteSetUp],
                 needs_baseline: bool, grid_size: int = 0, timeout: float = 3600.0,
                 aggregator: Strategy | None = None, server_optimizer: ServerOptimizer | None = None,
                 **fedavg_kwargs: Any) -> None:
        super().__init__(weighted_by_key=WEIGHT_KEY, **fedavg_kwargs)
        self.mechanism = mechanism
        self.cfg = cfg
        self.setups = dict(setups)
        self.needs_baseline = needs_baseline
        self.grid_size = grid_size
        self.timeout = timeout
        self.aggregator = aggregator
        self.server_optimizer = server_optimizer
        self.rounds: dict[int, RoundRecord] = {}
        self._final_rounds: dict[int, dict[str, Any]] = {}  # state_dict's conversion of the rounds before the latest
        self.baseline: tuple[np.ndarray, np.ndarray] | None = None
        self.node_sites: dict[int, str] = {}
        self.global_arrays: ArrayRecord | None = None
        #: A secure-sum mechanism's server optimiser state (kept at the server between rounds).
        self.server_state: dict[str, Any] | None = None
        #: The recalibration after the last round (a private set-up's hazard model): its public plan and the
        #: model's cuts; ``exponents``: its result, one per cut (None until then, or without one).
        self.recalibration: tuple[RecalibrationPlan, np.ndarray] | None = None
        self.exponents: np.ndarray | None = None
        self._recalibrated = False
        #: Each site's updates (digest -> the round and the digest of the global model it was sent then).
        self._sent_updates: dict[str, dict[bytes, tuple[int, bytes]]] = {}
        self._global: tuple[int, bytes, dict[str, np.ndarray]] = (0, b"", {})  # round, digest, arrays as views
        #: The last round whose model did not diverge, and that model (where a diverged round goes back to).
        self.last_good: tuple[int, ArrayRecord | None] = (0, None)
        #: ``federation.weight_average``: the average of the global models so far (:func:`average_weight`), which
        #: is the model evaluated, recalibrated, passed to ``end_of_round`` and returned by :meth:`run_rounds`; and
        #: the last global model, which the sites train from (kept in :meth:`state_dict` for a resumed run).
        self.average: ArrayRecord | None = None
        self.iterate: ArrayRecord | None = None
        self._stack: np.ndarray | None = None  # :meth:`_bounded_mean`'s matrix of updates, reused

    def _record(self, server_round: int) -> RoundRecord:
        return self.rounds.setdefault(server_round, RoundRecord())

    def _honest_sites(self, sites: Iterable[str]) -> list[float]:
        """The honest sites that the privacy policies of ``sites`` count on, as they announced them at set-up."""
        return [setup.filter.honest_sites for site in sites
                if (setup := self.setups.get(site)) is not None and setup.filter is not None]

    def _fail(self, server_round: int, phase: str, node: int, reason: str) -> None:
        self._record(server_round).failures.append(
            failure(phase, self.node_sites.get(node, "unnamed site"), node, reason))

    # ------------------------------------------------------------------ identity

    def identify_sites(self, grid: Grid) -> dict[int, str]:
        """Ask every connected node which site it is (:data:`SITE_NAME_QUERY`); fix each node's name.

        A node whose claimed name is not a site of the federation, or is already held by another
        node, or that does not answer, is left out; returns node -> why, for those.
        """
        nodes = sorted(grid.get_node_ids())
        messages = [Message(content=RecordDict({self.configrecord_key: ConfigRecord()}), dst_node_id=node,
                            message_type=SITE_NAME_QUERY) for node in nodes]
        left_out: dict[int, str] = {}
        replies = sorted(grid.send_and_receive(messages, timeout=self.timeout),
                         key=lambda reply: reply.metadata.src_node_id)
        for reply in replies:
            node = reply.metadata.src_node_id
            name = None if reply.has_error() else _claimed_name(reply)
            if reply.has_error():
                left_out[node] = f"failed to say which site it is: {error_message(reply.error.reason)}"
            elif name is None or name not in self.setups:
                left_out[node] = f"claims to be {name!r}, which is not a site of this federation"
            elif name in self.node_sites.values():
                left_out[node] = f"claims to be site {name!r}, which another node already is"
            else:
                self.node_sites[node] = name
        for node in nodes:
            if node not in self.node_sites and node not in left_out:
                left_out[node] = f"did not say which site it is within {self.timeout:g} s"
        return left_out

    def require_named(self, left_out: Mapping[int, str]) -> None:
        """Stop the run before any further message when fewer sites were named (:meth:`identify_sites`) than a
        round needs (``min_train_nodes``, at least ``federation.min_sites``): :class:`TooFewSitesError`, one line
        naming every node left out and why (a node that did not answer: within ``federation.timeout_s``).
        Otherwise Flower's sampling would wait for ever for sites that are not there."""
        named, needed = len(self.node_sites), self.min_train_nodes
        if named >= needed:
            return
        minimum = self.cfg.federation.min_sites
        rule = f"federation.min_sites = {minimum}" + (f"; strategy '{self.cfg.strategy}' needs {needed}"
                                                      if needed != minimum else "")
        raise TooFewSitesError(
            f"{named} of {named + len(left_out)} nodes said which site they are within federation.timeout_s = "
            f"{self.timeout:g} s, fewer than the {needed} sites a round needs ({rule}); the run stops before any "
            "training: " + "; ".join(f"node {node} {reason}" for node, reason in sorted(left_out.items())))

    def _identity(self, message: Message) -> tuple[str | None, str]:
        """The site a reply comes from (by its node) and why it is refused on identity ("" if not)."""
        node = message.metadata.src_node_id
        site = self.node_sites.get(node)
        if site is None:
            return None, "a node that was not named at set-up"
        claimed = _claimed_name(message)
        if claimed is not None and claimed != site:
            return site, f"the reply claims to come from site {claimed!r}, but node {node} is site {site!r}"
        return site, ""

    def _accepted_metrics(
        self, server_round: int, phase: str, replies: Iterable[Message],
        check: Callable[[str, MetricRecord], str],
    ) -> Iterator[tuple[Message, str, int, MetricRecord]]:
        """``(reply, site, node, metric record)`` of each reply of ``phase`` that passes the identity check,
        carries exactly one metric record and passes ``check(site, record)`` (a reason, "" if none); every
        other reply but the error replies becomes a named failure of the round."""
        for message in replies:
            if message.has_error():
                continue
            node = message.metadata.src_node_id
            site, reason = self._identity(message)
            metrics = _metric_record(message)
            if not reason and metrics is not None and len(metrics) > MAX_METRIC_KEYS:
                reason = f"the reply's metric record has {len(metrics)} keys; at most {MAX_METRIC_KEYS} are read"
            if not reason:
                reason = "the reply must carry exactly one metric record" if metrics is None else check(site, metrics)
            if reason:
                self._fail(server_round, phase, node, reason)
                continue
            yield message, site, node, metrics

    # ------------------------------------------------------------------ failures

    def record_failures(
        self, server_round: int, phase: str, messages: Iterable[Message], replies: Iterable[Message],
    ) -> list[Message]:
        """Record every error reply and every message left unanswered; return the usable replies, sorted by node.

        A reply belongs to the node its message was sent to (``reply_to_message_id``), whatever node it
        says it comes from: an error reply is filed under that node's site; a reply labelled as another
        node, and every reply of a node that answered one message more than once, is refused and filed
        under the node the message went to, never under the node it names. A reply to no message of
        the round is filed as unattributable. A reply heavier than :meth:`_reply_limit` is refused by its size.
        """
        messages = list(messages)
        sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages
                if message.metadata.message_id}
        by_target: dict[int, list[Message]] = collections.defaultdict(list)
        for reply in replies:
            target = sent.get(reply.metadata.reply_to_message_id) if sent else reply.metadata.src_node_id
            if target is None:
                self._record(server_round).failures.append(failure(
                    phase, "unattributable", reply.metadata.src_node_id, "a reply to no message of this round"))
                continue
            by_target[target].append(reply)
        kept, limit = [], self._reply_limit()
        for target, group in sorted(by_target.items()):
            reply = group[0]
            if len(group) > 1:
                self._fail(server_round, phase, target, f"{len(group)} replies to one message: none is used")
            elif reply.has_error():
                self._fail(server_round, phase, target, error_message(reply.error.reason))
                kept.append(reply)
            elif reply.metadata.src_node_id != target:
                self._fail(server_round, phase, target,
                           f"its reply came back labelled as node {reply.metadata.src_node_id}: refused")
            elif (size := payload_bytes(reply.content)) > limit:
                self._fail(server_round, phase, target, f"its reply carries {size} bytes, more than the "
                           f"{limit} a reply may (a model's worth of arrays + {MAX_REPLY_EXTRA_BYTES})")
            else:
                kept.append(reply)
        for node in sorted({message.metadata.dst_node_id for message in messages} - set(by_target)):
            self._fail(server_round, phase, node, f"no reply within {self.timeout:g} s")
        return kept

    def _reply_limit(self) -> int:
        """The most bytes a reply may carry: the global model's arrays and :data:`MAX_REPLY_EXTRA_BYTES`."""
        model = self.global_arrays
        return MAX_REPLY_EXTRA_BYTES + (0 if model is None else sum(len(array.data) for array in model.values()))

    # ------------------------------------------------------------------ the rounds

    def run_rounds(
        self, grid: Grid, *, arrays: ArrayRecord, first_round: int, last_round: int,
        end_of_round: Callable[[int, ArrayRecord], None], outer: Strategy | None = None,
        resumed: bool = False,
    ) -> ArrayRecord:
        """Rounds ``first_round`` to ``last_round`` from the global model ``arrays``; return the final model.

        Each round: train (the accepted replies aggregated by ``outer``, a wrapper such as Flower's
        central-DP strategy around this one, or this strategy; then, with a server optimiser, its
        step from the round's global model given that aggregate: post-processing of what ``outer``
        released), Breslow query and evaluation, then ``end_of_round(round, global arrays)``. A site that fails, does not answer within
        ``timeout`` or sends a reply the server refuses is recorded in the round's ``failures``
        and the round goes on without it. If fewer than ``min_train_nodes`` updates were accepted,
        the round is not aggregated (the global model stays as it was; the sites that trained have
        still released their updates, so their spend is kept), ``end_of_round`` runs, and
        :class:`TooFewSitesError` stops the run.

        ``resumed`` (a run resumed from a checkpoint, whose round records are loaded): each training
        message carries its own site's last privacy state only (:data:`RESUMED_PRIVACY_STATE`), and the
        rounds charged to the site since (:data:`RESUMED_CATCH_UP`); no site sees another's.

        With ``federation.weight_average`` (:attr:`average`), the model evaluated, passed to ``end_of_round``
        and returned is the average of the global models: post-processing of the released models, which
        costs no privacy and changes no training message. A resumed run's ``arrays`` is then that average,
        and the rounds go on from the global model restored by :meth:`load_state_dict`.
        """
        outer = self if outer is None else outer
        self.average = arrays
        if resumed and self.iterate is not None:
            arrays = self.iterate
        self.last_good = (first_round - 1, arrays)
        for server_round in range(first_round, last_round + 1):
            record = self._record(server_round)
            self.global_arrays = arrays
            messages = list(outer.configure_train(server_round, arrays, ConfigRecord(), grid))
            if isinstance(self.mechanism, SecureSumMechanism):
                released = self.secure_round(grid, server_round, arrays, messages)
                arrays = arrays if released is arrays else self._step(server_round, arrays, released)
                arrays = self._evaluate_and_close(grid, server_round, arrays, outer, end_of_round)
                continue
            if resumed:
                messages = [self._with_own_state(message) for message in messages]
            replies = self.record_failures(server_round, "train", messages,
                                           grid.send_and_receive(messages, timeout=self.timeout))
            self._count_unanswered_as_released(record, messages, replies)
            accepted = self.screen_train(server_round, replies)
            aggregated, _ = outer.aggregate_train(server_round, accepted)
            if len(accepted) < self.min_train_nodes:
                record.shortfall = (f"{len(accepted)} of {len(messages)} sites' updates accepted, fewer than the "
                                    f"minimum {self.min_train_nodes}: the round was not aggregated")
            elif aggregated is not None:
                arrays = self._step(server_round, arrays, aggregated)
            arrays = self._evaluate_and_close(grid, server_round, arrays, outer, end_of_round)
        assert self.average is not None
        return self.average

    def _count_unanswered_as_released(self, record: RoundRecord, messages: Iterable[Message],
                                      replies: Iterable[Message]) -> None:
        """Mark in ``record.released`` (as ``None``) every known site sent a training message that no reply
        answers: a site that did not answer in time may still have trained and sent its update late (the
        server would then hold it), so its round counts as released."""
        answered = {reply.metadata.src_node_id for reply in replies}
        for message in messages:
            site = self.node_sites.get(message.metadata.dst_node_id)
            if site is not None and message.metadata.dst_node_id not in answered:
                record.released[site] = None

    def _step(self, server_round: int, arrays: ArrayRecord, aggregated: ArrayRecord) -> ArrayRecord:
        """The round's new global model: what the round released, or the server optimiser's step toward it."""
        return aggregated if self.server_optimizer is None else self.server_optimizer.step(server_round, arrays,
                                                                                          aggregated)

    def _evaluate_and_close(self, grid: Grid, server_round: int, arrays: ArrayRecord, outer: Strategy,
                            end_of_round: Callable[[int, ArrayRecord], None]) -> ArrayRecord:
        """A round's evaluation (on the rounds :meth:`evaluates`), then ``end_of_round``; returns the model kept.

        A new global model that has diverged (:func:`divergence`) is rolled back to the last good one
        before any site sees it; on an evaluated round, one whose predictions most evaluating sites find
        not finite is rolled back after the evaluation, which then runs again on the model kept (:meth:`_roll_back`).
        The model evaluated and passed to ``end_of_round`` is the running average (:attr:`average`) with the
        model kept. :class:`TooFewSitesError` after ``end_of_round`` if the round was not aggregated.
        """
        record = self._record(server_round)
        if reason := divergence(self.last_good[1], arrays):
            arrays = self._roll_back(server_round, reason)
        weight = average_weight(self.cfg.federation, server_round)
        assert self.average is not None
        evaluated = moved_toward(self.average, arrays, weight)
        if self.evaluates(server_round):
            self._evaluate(grid, server_round, evaluated, outer)
        if not record.rolled_back and (reason := _predictions_diverged(record)):
            arrays = self._roll_back(server_round, reason)
            evaluated = moved_toward(self.average, arrays, weight)
            record.evaluate_sites.clear()
            record.evaluate_undefined.clear()
            record.evaluate_flags.clear()
            record.evaluate_local.clear()
            self._evaluate(grid, server_round, evaluated, outer)
        if not record.rolled_back:
            self.last_good = (server_round, arrays)
        self.average, self.iterate = evaluated, arrays
        end_of_round(server_round, evaluated)
        if record.shortfall:
            raise TooFewSitesError(f"round {server_round}: {record.shortfall}; failures: "
                                   + "; ".join(f"{f['phase']}: {f['site']} (node {f['node']}): {f['reason']}"
                                               for f in record.failures))
        return arrays

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round``'s model is evaluated: every ``evaluation.every``-th round, and the last."""
        return server_round % self.cfg.evaluation_every == 0 or server_round >= self.cfg.federation.rounds

    def _evaluate(self, grid: Grid, server_round: int, arrays: ArrayRecord, outer: Strategy) -> None:
        """The round's Breslow baseline and recalibration (:meth:`configure_evaluate`), then the sites' test metrics
        of ``arrays``; a run whose sites hold no test part (:func:`holds_test_part`) sends no evaluate message."""
        messages = list(outer.configure_evaluate(server_round, arrays, ConfigRecord(), grid))
        if not holds_test_part(self.cfg.data):
            return
        replies = self.record_failures(server_round, "evaluate", messages,
                                       grid.send_and_receive(messages, timeout=self.timeout))
        outer.aggregate_evaluate(server_round, replies)

    def _roll_back(self, server_round: int, reason: str) -> ArrayRecord:
        """Record that ``server_round``'s model diverged and return the last good model, which the round keeps.

        The sites named are those whose update stood out from the others that round (an update
        spread above :meth:`_outlier_spread`, :meth:`_bounded_mean`); the sites that only received or evaluated
        the diverged model are never named. The sites' updates were released all the same (their
        privacy spend stands). A recalibration computed for the diverged model is dropped, not asked again
        (each site releases it once).
        """
        record = self._record(server_round)
        sites = sorted(site for site, spread in record.update_spread.items() if spread > self._outlier_spread())
        record.rolled_back = {"to_round": self.last_good[0], "reason": reason, "sites": sites}
        if self.exponents is not None and server_round == self.cfg.federation.rounds and self.recalibration:
            self.exponents = None
            record.rolled_back["recalibration"] = "dropped: it was computed for the diverged model"
        log(WARNING, "Round %s: %s; the global model goes back to round %s's (%s)", server_round, reason,
            self.last_good[0], f"caused by {', '.join(sites)}" if sites else "no site's update stood out")
        return self.last_good[1]

    def secure_round(self, grid: Grid, server_round: int, arrays: ArrayRecord, messages: list[Message]) -> ArrayRecord:
        """A round of a mechanism with a secure sum: the sites selected by ``messages`` send their integer vectors
        through SecAgg+ (:class:`strategies.secure_aggregation.SecureSum`); the server unmasks only their sum and
        takes the mechanism's step. Returns the new global model (the old one when the round is not aggregated).

        Every site asked for its vector counts as having released it (the round's plan is its report);
        a round with more than ``privacy.max_dropouts`` drop-outs is not unmasked (its shortfall). An unmasked
        sum beyond what honest sites can produce (the mechanism's ``server_step`` says why) is refused as a
        round-level failure (:func:`_refuse_secure_sum`: phase ``secagg_sum``, site ``unattributable``): the
        global model and the server's optimiser state stay as they were, the spend counts, and the run goes on;
        it stops when :data:`MAX_REFUSED_SUMS` consecutive rounds' sums were refused.
        """
        from strategies.mechanisms.distributed_dp import count_std as _count_std
        from strategies.secure_aggregation import centred

        record = self._record(server_round)
        contents = {m.metadata.dst_node_id: m.content for m in messages if m.metadata.dst_node_id in self.node_sites}
        nodes = sorted(contents)
        sites = {node: self.node_sites[node] for node in nodes}
        current = {key: values(array) for key, array in arrays.items()}
        dim = sum(array.size for array in current.values())
        records = sum(self.setups[site].count for site in sites.values())
        plan = self.mechanism.plan(self.cfg, parties=len(nodes), records=records, dim=dim,
                                   setup=self.setups[sites[nodes[0]]], honest_sites=self._honest_sites(sites.values()))
        result = self._secure_sum(grid, server_round, nodes, modulus=plan.modulus, dim=dim, records=records,
                                  content=lambda node: RecordDict(dict(contents[node].items())))
        for node in result.sent:
            record.released[sites[node]] = plan.report()
        if result.total is None:
            record.shortfall = f"secure aggregation did not complete: {result.shortfall}; the round was not aggregated"
            return arrays
        count = sum(self.setups[sites[node]].count for node in result.included)
        new, self.server_state, reason = self.mechanism.server_step(
            current, centred(result.total, plan.modulus), plan, count=count, lr=self.cfg.train.lr,
            state=self.server_state, sites=len(result.included),
            count_std=max(_count_std(self.setups[sites[node]].prior) for node in result.included))
        if reason:
            _refuse_secure_sum(record, server_round, reason, included=[sites[n] for n in result.included],
                               dropped=[f"{f['site']} ({f['phase']})" for f in record.failures],
                               streak=_refused_sum_streak(self.rounds, server_round) + 1)
            return arrays
        for node in result.included:
            record.train_sites[sites[node]] = plan.report()
        assert new is not None
        return ArrayRecord({key: Array(value) for key, value in new.items()})

    def _with_own_state(self, message: Message) -> Message:
        """``message`` with its destination site's own last privacy state as the server holds it, and the rounds
        charged to the site since (:func:`privacy_position`), added to its config (if it has a state)."""
        site = self.node_sites.get(message.metadata.dst_node_id)
        state, since = privacy_position(self.rounds, site) if site is not None else (None, 0)
        if state is None:
            return message
        config = ConfigRecord(dict(message.content[self.configrecord_key]))
        config[RESUMED_PRIVACY_STATE] = state
        if since:
            config[RESUMED_CATCH_UP] = since
        content = RecordDict({self.arrayrecord_key: message.content[self.arrayrecord_key],
                              self.configrecord_key: config})
        return Message(content=content, dst_node_id=message.metadata.dst_node_id,
                       message_type=message.metadata.message_type)

    # ------------------------------------------------------------------ training replies

    def site_reports(self, site: str, last_round: int) -> list[dict[str, float] | None]:
        """``site``'s reports of every round up to ``last_round`` in which it released an update (None: refused)."""
        return [record.released[site] for server_round, record in sorted(self.rounds.items())
                if server_round <= last_round and site in record.released]

    def _check_train(self, server_round: int, message: Message, site: str) -> tuple[str, dict[str, float] | None,
                                                                                     float, str | None]:
        """Why a training reply is refused ("" when accepted), its report, its reported count and privacy state."""
        content = message.content
        updates = _records_of(content, ArrayRecord)
        if len(updates) != 1:
            return "the reply must carry exactly one model update", None, 0.0, None
        record = _metric_record(message)
        if record is None:
            return "the reply must carry exactly one metric record", None, 0.0, None
        numbers = _numbers(record)
        count = numbers.pop(WEIGHT_KEY, None)
        reason = check_count(count, self.setups[site].count)
        if reason:
            return reason, None, 0.0, None
        update = updates[0]
        reason = check_arrays(self._global_model(server_round)[1],
                              {key: values(array) for key, array in update.items()})
        if reason or (reason := self._replay(server_round, site, update)):
            return reason, None, float(count), None
        previous = self.site_reports(site, server_round - 1)
        reason = self.mechanism.verify(self.cfg, numbers, setup=self.setups[site], previous=previous)
        if reason:
            return reason, None, float(count), None
        state = None
        site_record = _site_record(content)
        if site_record is not None and PRIVACY_STATE_KEY in site_record:
            state = str(site_record[PRIVACY_STATE_KEY])
            try:
                if len(state) > MAX_PRIVACY_STATE_CHARS or not isinstance(json.loads(state), dict):
                    raise ValueError
            except ValueError:
                return "the privacy state is not a JSON object of reasonable size", None, float(count), None
        return "", {key: float(value) for key, value in numbers.items()}, float(count), state

    def _global_model(self, server_round: int) -> tuple[bytes, dict[str, np.ndarray]]:
        """The digest and the arrays (views) of the global model sent in ``server_round`` (read once a round)."""
        assert self.global_arrays is not None
        if self._global[0] != server_round:
            self._global = (server_round, _digest(self.global_arrays),
                            {key: values(array) for key, array in self.global_arrays.items()})
        return self._global[1], self._global[2]

    def _replay(self, server_round: int, site: str, update: ArrayRecord) -> str:
        """Why ``update`` is refused as a replay ("" if it is not): bit for bit an update ``site`` sent in an earlier
        round, when it was sent another global model (training from another model never gives the same bits; from
        the same one, after a rolled-back round, it can)."""
        digest = self._global_model(server_round)[0]
        seen = self._sent_updates.setdefault(site, {})
        earlier = seen.setdefault(_digest(update), (server_round, digest))
        if earlier[1] != digest:
            return (f"its update is bit for bit the one it sent in round {earlier[0]}, when it was sent another "
                    "global model: a replay")
        return ""

    def screen_train(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Check every training reply; record accepted reports and named failures; return the accepted replies.

        Each accepted reply is rebuilt with only its model update and the weight the server gives
        it (:meth:`~strategies.mechanisms.base.HorizontalMechanism.aggregation_weight` of the
        site's set-up, or 0 when the site has nothing new, capped by :meth:`_cap_weights`), in site
        order so that the sums of the aggregation, and so a rerun, are reproducible.
        """
        record = self._record(server_round)
        accepted: list[tuple[str, Message]] = []
        for message in replies:
            if message.has_error():
                continue
            node = message.metadata.src_node_id
            site, reason = self._identity(message)
            if site is None:
                self._fail(server_round, "train", node, reason)
                continue
            report, count, state = None, 0.0, None
            if not reason:
                reason, report, count, state = self._check_train(server_round, message, site)
            record.released[site] = report
            if reason:
                self._fail(server_round, "train", node, reason)
                continue
            assert report is not None
            record.train_sites[site] = report
            if state is not None:
                record.privacy_states[site] = state
            weight = self.mechanism.aggregation_weight(self.setups[site]) if count > 0 else 0.0
            content = RecordDict({self.arrayrecord_key: _records_of(message.content, ArrayRecord)[0],
                                  "metrics": MetricRecord({WEIGHT_KEY: weight})})
            accepted.append((site, Message(content=content, dst_node_id=node,
                                           message_type=message.metadata.message_type)))
        accepted.sort(key=lambda pair: pair[0])
        self._cap_weights(server_round, accepted)
        return [message for _, message in accepted]

    def _cap_weights(self, server_round: int, accepted: list[tuple[str, Message]]) -> None:
        """Cap the weights of the round's ``(site, rebuilt reply)`` pairs in place at ``federation.max_weight_ratio``
        x their median (:func:`capped_weights`); flag each site capped (a large honest site is normal: not a failure).
        Every consumer of the weights (the weighted mean, centred clipping, multi-krum's mean, a DP wrapper) reads
        the capped ones."""
        ratio = self.cfg.federation.max_weight_ratio
        records = [_records_of(message.content, MetricRecord)[0] for _, message in accepted]
        weights = np.array([float(record[WEIGHT_KEY]) for record in records])
        capped = capped_weights(weights, ratio)
        if not accepted or np.array_equal(capped, weights):
            return
        median = float(np.median(weights[weights > 0]))
        flags = self._record(server_round).weight_flags
        for (site, _), record, weight, cap in zip(accepted, records, weights, capped, strict=True):
            if cap < weight:
                record[WEIGHT_KEY] = float(cap)
                flags[site] = (f"weight {weight:g} (its agreed count) is {weight / median:.3g} x the median of the "
                               f"round's {int(np.sum(weights > 0))} sites' ({median:g}): capped at {ratio:g} x the "
                               "median (federation.max_weight_ratio)")

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The weighted mean (or the robust aggregator's combination) of the screened updates.

        A site with nothing new to contribute (e.g. its privacy budget is spent) has weight 0; if
        every site has, the global model stays as it is. A robust aggregator: :meth:`_robust_aggregate`.
        """
        contributing = [message for message in replies if not message.has_error()
                        and float(_records_of(message.content, MetricRecord)[0][WEIGHT_KEY]) > 0]
        if not contributing:
            return None, None
        if len(contributing) >= 3:
            bounded = self._bounded_mean(server_round, contributing)
            if bounded is not None:
                return bounded, None
        if self.aggregator is not None:
            return self._robust_aggregate(server_round, contributing)
        valid, _ = self._check_and_log_replies(contributing, is_train=True)  # FedAvg.aggregate_train's steps
        contents = [message.content for message in valid]
        if not contents:
            return None, None
        return weighted_mean(contents, self.weighted_by_key), self.train_metrics_aggr_fn(contents, self.weighted_by_key)

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
            model = self._global_model(server_round)[0]
            candidates = [message for message in contributing
                          if _digest(_records_of(message.content, ArrayRecord)[0]) != model]
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
        federation, record = self.cfg.federation, self._record(server_round)
        sites = [self.node_sites.get(message.metadata.dst_node_id, "unnamed site") for message in contributing]
        arrays = [_records_of(message.content, ArrayRecord)[0] for message in candidates]
        names = list(arrays[0].keys())
        matrix = _stacked(arrays, names)
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
            taken = [r for number, r in self.rounds.items() if number <= server_round and site in r.discarded]
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

    def _outlier_spread(self) -> float:
        """The spread beyond which a site's update stands out (flagged, named for a rolled-back round):
        :data:`OUTLIER_SPREAD`, or the run's ``update_bound`` where that is larger."""
        return max(OUTLIER_SPREAD, self.cfg.federation.update_bound)

    def _bounded_mean(self, server_round: int, contributing: list[Message]) -> ArrayRecord | None:
        """Record each of 3 or more accepted updates' spread (its distance from the coordinate-wise median over the
        median distance) and flag each site beyond :meth:`_outlier_spread`; where the run bounds updates
        (:meth:`_bounds_updates`), return their weighted mean with each one's pull bounded to ``update_bound`` x the
        median distance; None otherwise, or when it bounded none (the plain weighted mean, which FedAvg computes, is
        then the same). A bound near 1 cuts the pull of about half of the honest sites a little, as it should: what
        names a site is standing out, not being bounded."""
        record = self._record(server_round)
        arrays = [_records_of(message.content, ArrayRecord)[0] for message in contributing]
        names = list(arrays[0].keys())
        shapes = {name: values(arrays[0][name]).shape for name in names}
        dtypes = {name: values(arrays[0][name]).dtype for name in names}
        vectors = self._stack = _stacked(arrays, names, self._stack)  # the same buffer round after round
        weights = np.array([float(_records_of(message.content, MetricRecord)[0][WEIGHT_KEY])
                            for message in contributing])
        bounds, bound = self._bounds_updates(), self.cfg.federation.update_bound
        mean, scale, spread = centred_clip(vectors, weights / weights.sum(), bound if bounds else DEFAULT_UPDATE_BOUND)
        for message, ratio in zip(contributing, spread, strict=True):
            site = self.node_sites.get(message.metadata.dst_node_id, "unnamed site")
            record.update_spread[site] = float(ratio)
            if bounds and ratio > self._outlier_spread():
                record.train_flags[site] = (
                    f"update {ratio:.3g} x the median distance from the sites' coordinate-wise median (beyond "
                    f"{self._outlier_spread():g} x): its pull was bounded to {bound:g} x (federation.update_bound)")
        if not bounds or np.all(scale == 1.0):
            return None
        parts, start = {}, 0
        for name in names:
            size = int(np.prod(shapes[name]))
            parts[name] = mean[start:start + size].reshape(shapes[name]).astype(dtypes[name])
            start += size
        return ArrayRecord({name: Array(parts[name]) for name in names})

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Attach the federated Breslow baseline (Cox models) to the evaluation messages."""
        if self.needs_baseline:
            self.baseline = self._collect_breslow(server_round, arrays, grid)
            if self.baseline is not None:
                config[BASELINE_EVENTS] = self.baseline[0].tolist()
                config[BASELINE_RISK] = self.baseline[1].tolist()
        if self.recalibration is not None and server_round == self.cfg.federation.rounds and not self._recalibrated:
            self._recalibrated = True  # each site releases its recalibration sums once
            self.exponents = self._collect_recalibration(server_round, arrays, grid)
        if self.exponents is not None:
            config[RECALIBRATION_EXPONENTS] = self.exponents.tolist()
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Check each site's evaluation; keep the accepted sites' metrics; return their NaN-aware weighted mean.

        Refused replies (identity, unknown metric, out of range, a record count) are named failures and left
        out of the mean. The reply carries no record count: each accepted site's metrics are stored with
        ``num-examples`` = its record count agreed at set-up (the weight of :func:`weighted_nanmean`, the
        same as its FedAvg weight's count), so under a DP set-up the mean reveals no count beyond the noisy one. A site whose figures stand far outside the others'
        (:func:`~strategies.replies.suspect_evaluations`) is flagged and kept (heterogeneous sites are
        normal), or, with ``evaluation.screen``, a named failure left out of the mean. A reply marked
        :data:`KEPT_LOCAL_KEY` (a site whose own policy keeps its test metrics) must carry no metric; its site
        is listed in ``evaluate_local``, not failed, and is in no per-site or pooled figure.
        """
        record = self._record(server_round)
        checked: dict[str, tuple[int, dict[str, float]]] = {}
        accepted = self._accepted_metrics(
            server_round, "evaluate", replies,
            lambda site, metrics: check_evaluation(_numbers(metrics)))
        for message, site, node, metrics in accepted:
            if _marked_kept_local(message):
                if reason := check_evaluation(_numbers(metrics), kept_local=True):
                    self._fail(server_round, "evaluate", node, reason)
                else:
                    record.evaluate_local.append(site)
                continue
            checked[site] = (node, {key: float(value) for key, value in _numbers(metrics).items()})
            record.evaluate_undefined[site] = _undefined(message, checked[site][1])
            # the site's weight in the sites' mean: its count agreed at set-up (the reply carries no count)
            checked[site][1][WEIGHT_KEY] = float(self.setups[site].count)
        suspects = suspect_evaluations({site: metrics for site, (_, metrics) in checked.items()})
        for site, (node, metrics) in sorted(checked.items()):
            if site in suspects and self.cfg.evaluation_screen:
                self._fail(server_round, "evaluate", node, f"implausible test metrics: {suspects[site]}")
                continue
            if site in suspects:
                record.evaluate_flags[site] = f"unusual test metrics: {suspects[site]}"
            record.evaluate_sites[site] = metrics
        if not record.evaluate_sites:
            return None
        return MetricRecord(weighted_nanmean(record.evaluate_sites))

    def _collect_breslow(
        self, server_round: int, arrays: ArrayRecord, grid: Grid
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Sum the accepted sites' ``(d_k, R_k)`` for the model in ``arrays``."""
        messages = [
            Message(
                content=RecordDict({self.arrayrecord_key: arrays,
                                    self.configrecord_key: ConfigRecord({"server-round": server_round})}),
                dst_node_id=node_id,
                message_type=BRESLOW_QUERY,
            )
            for node_id in grid.get_node_ids()
        ]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        event_counts: np.ndarray | None = None
        risk_sums: np.ndarray | None = None
        accepted = self._accepted_metrics(
            server_round, "breslow", self.record_failures(server_round, "breslow", messages, replies),
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
        """The final model's recalibration exponents at its cuts, from the accepted sites' noisy power sums
        (:func:`models.recalibration.fit_exponents` against the plan's target); None when no sum came. A mechanism
        with a secure sum collects them through it (:meth:`_secure_power_sums`), any other by a plain query."""
        plan, cuts = self.recalibration
        config = ConfigRecord({"server-round": server_round, RECALIBRATION_HORIZONS: plan.horizons.tolist()})
        collect = self._secure_power_sums if isinstance(self.mechanism, SecureSumMechanism) else self._power_sums
        total, count = collect(server_round, RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config}),
                               grid, plan)
        if total is None or count == 0:
            log(WARNING, "Round %s: no recalibration sum came; the curves stay as trained", server_round)
            return None
        exponents = fit_exponents(total.reshape(plan.horizons.size, -1), count, plan.target)
        return cut_exponents(cuts, plan.horizons, exponents)

    def _power_sums(self, server_round: int, content: RecordDict, grid: Grid,
                    plan: RecalibrationPlan) -> tuple[np.ndarray | None, float]:
        """The accepted sites' noisy power sums, each site's release checked on its own; and their agreed records."""
        messages = [Message(content=content, dst_node_id=node_id, message_type=RECALIBRATION_QUERY)
                    for node_id in grid.get_node_ids()]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        std = recalibration_multiplier(self.cfg) * plan.sensitivity()
        total, count = np.zeros(plan.size), 0.0
        accepted = self._accepted_metrics(
            server_round, "recalibration", self.record_failures(server_round, "recalibration", messages, replies),
            lambda site, metrics: check_power_sums(metrics.get("power_sums"), size=plan.size,
                                                   max_records=self.setups[site].count, noise_std=std))
        for _, site, _, metrics in accepted:
            total += np.asarray(metrics["power_sums"], dtype=np.float64)
            count += self.setups[site].count
        return total, count

    def _secure_power_sums(self, server_round: int, content: RecordDict, grid: Grid,
                           plan: RecalibrationPlan) -> tuple[np.ndarray | None, float]:
        """The sites' summed power sums through the secure sum (the mechanism's ``recalibration_plan``), and the
        included sites' agreed records. A plan the run's keys cannot meet, a protocol that does not complete, or a
        sum beyond what honest sites can produce is a failure of phase ``recalibration`` (naming no site) and gives
        no sums."""
        from strategies.mechanisms.distributed_dp import count_std
        from strategies.secure_aggregation import centred

        nodes = sorted(node for node in grid.get_node_ids() if node in self.node_sites)
        records = sum(self.setups[self.node_sites[node]].count for node in nodes)
        try:
            secure = self.mechanism.recalibration_plan(
                self.cfg, parties=len(nodes), records=records, size=plan.size,
                honest_sites=self._honest_sites(self.node_sites[node] for node in nodes))
        except ConfigError as err:  # nothing was asked of any site: the curves stay as trained
            self._record(server_round).failures.append(failure("recalibration", UNATTRIBUTABLE, 0, str(err)))
            return None, 0.0
        result = self._secure_sum(grid, server_round, nodes, modulus=secure.modulus, dim=plan.size, records=records,
                                  content=lambda node: RecordDict(dict(content.items())), phase="recalibration")
        included = [self.node_sites[node] for node in result.included]
        if result.total is None:
            self._record(server_round).failures.append(failure("recalibration", UNATTRIBUTABLE, 0, result.shortfall))
            return None, 0.0
        count = sum(self.setups[site].count for site in included)
        sums, reason = self.mechanism.recalibration_sums(
            centred(result.total, secure.modulus), secure, count=count, sites=len(included),
            count_std=max(count_std(self.setups[site].prior) for site in included))
        if reason:
            self._record(server_round).failures.append(failure("recalibration", UNATTRIBUTABLE, 0, reason))
            log(WARNING, "Round %s: the recalibration sum was refused: %s", server_round, reason)
            return None, 0.0
        return sums, count

    def _secure_sum(self, grid: Grid, server_round: int, nodes: list[int], *, modulus: int, dim: int, records: float,
                    content: Callable[[int], RecordDict], phase: str | None = None) -> Any:
        """One run of SecAgg+ (:class:`strategies.secure_aggregation.SecureSum`) over ``nodes``, whose agreed records
        are ``records``; its failures recorded under the stage's name, or under ``phase`` naming the stage. The
        sum is not unmasked when more than ``privacy.max_dropouts`` sites dropped out."""
        from strategies.secure_aggregation import SecureSum, protocol_parameters

        privacy = self.cfg.privacy
        num_shares, threshold = protocol_parameters(len(nodes), max_dropouts=privacy.max_dropouts,
                                                    colluding=privacy.colluding_sites)
        secure = SecureSum(modulus=modulus, num_shares=num_shares, threshold=threshold, dimension=dim,
                           timeout=self.timeout, shuffle_seed=self.cfg.seed * 100_003 + server_round)
        result = secure.run(grid, nodes, setup={"parties": len(nodes), "records": float(records)},
                            masked_content=content, group=f"{server_round}{'-' + phase if phase else ''}",
                            min_included=len(nodes) - privacy.max_dropouts)
        for stage, node, reason in result.failures:
            stage = stage.removeprefix("query.")
            self._fail(server_round, phase or stage, node, f"{stage}: {reason}" if phase else reason)
        return result

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: each round's records, the last Breslow baseline (plain Python),
        the server optimiser's state (tensors; ``None`` without one) and, with ``federation.weight_average``, the
        last global model (tensors; the checkpoint's model is then the average; ``None`` without one)."""
        latest = max(self.rounds, default=0)
        for server_round, record in self.rounds.items():  # a round before the latest is final: converted once
            if server_round != latest and server_round not in self._final_rounds:
                self._final_rounds[server_round] = asdict(record)
        rounds = {server_round: self._final_rounds[server_round] if server_round != latest else asdict(record)
                  for server_round, record in self.rounds.items()}
        return {"rounds": rounds,
                "baseline": None if self.baseline is None else [part.tolist() for part in self.baseline],
                "exponents": None if self.exponents is None else self.exponents.tolist(),
                "server_optimizer": None if self.server_optimizer is None else self.server_optimizer.state_dict(),
                "iterate": (self.iterate.to_torch_state_dict()
                            if self.iterate is not None and self.cfg.federation.weight_average != "none" else None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rounds = {int(server_round): RoundRecord(**record) for server_round, record in state["rounds"].items()}
        self._final_rounds = {}
        baseline = state["baseline"]
        self.baseline = None if baseline is None else (np.asarray(baseline[0], dtype=np.float64),
                                                       np.asarray(baseline[1], dtype=np.float64))
        exponents = state.get("exponents")
        self.exponents = None if exponents is None else np.asarray(exponents, dtype=np.float64)
        if self.server_optimizer is not None:
            self.server_optimizer.load_state_dict(state["server_optimizer"])
        iterate = state.get("iterate")
        self.iterate = None if iterate is None else ArrayRecord(iterate)


#: A run with a secure sum stops once this many consecutive rounds' unmasked sums were refused (one refused
#: round keeps the model and goes on: secure aggregation cannot say which site to leave out).
MAX_REFUSED_SUMS = 3
#: The failure entry of a refused secure sum names no site: the server sees only the sum.
UNATTRIBUTABLE = "unattributable"


def _refused_sum_streak(rounds: Mapping[int, RoundRecord], server_round: int) -> int:
    """How many rounds right before ``server_round`` had their unmasked secure sum refused (phase ``secagg_sum``)."""
    streak, previous = 0, server_round - 1
    while previous in rounds and any(f["phase"] == "secagg_sum" for f in rounds[previous].failures):
        streak, previous = streak + 1, previous - 1
    return streak


def _refuse_secure_sum(record: RoundRecord, server_round: int, reason: str, *, included: list[str],
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
