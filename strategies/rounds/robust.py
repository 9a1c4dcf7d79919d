"""How the accepted updates of a round are combined: FedAvg's weighted mean, centred clipping, Flower's robust
aggregators and the record of whom they left out (pure functions on arrays)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, MultiKrum, Strategy

from strategies.arrays import values
from strategies.config import AGGREGATIONS, OUTLIER_SPREAD, ConfigError, FederationConfig
from strategies.rounds.records import records_of

def weighted_mean(contents: list[RecordDict], weight_key: str) -> ArrayRecord:
    """FedAvg's weighted mean of the replies' arrays: Flower's ``aggregate_arrayrecords``, the same float
    operations in the same order (the same bytes: tests), reading each array as a view
    (:func:`strategies.arrays.values`) instead of parsing it with ``Array.numpy()``."""
    weights = [records_of(content, MetricRecord)[0][weight_key] for content in contents]
    total = sum(weights)
    sums: dict[str, np.ndarray] = {}
    for content, factor in zip(contents, [weight / total for weight in weights], strict=True):
        for record in records_of(content, ArrayRecord):
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


def stacked(arrays: Sequence[ArrayRecord], names: Sequence[str], out: np.ndarray | None = None) -> np.ndarray:
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
    :meth:`strategies.rounds.aggregation.UpdateAggregation.aggregate` sets both for the updates it hands it).
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



def outlier_spread(federation: FederationConfig) -> float:
    """The spread beyond which a site's update stands out (flagged, named for a rolled-back round):
    :data:`~strategies.config.OUTLIER_SPREAD`, or the run's ``federation.update_bound`` where that is larger."""
    return max(OUTLIER_SPREAD, federation.update_bound)
