"""What the server checks in every site's reply before using it (pure functions, no Flower).

Sites are not trusted for integrity: a site may be buggy or hostile and send anything. Each
function here returns why a decoded reply is unusable ("" when it is fine); the strategy
(:mod:`strategies.horizontal`) turns a non-empty reason into a named failure of that site for the
round and goes on without the reply.

* :func:`check_arrays`: a model update has exactly the global model's names, shapes and dtypes,
  and finite values.
* :func:`check_count`: a record count equals the one fixed at set-up (or 0: nothing new).
* :func:`check_evaluation` and :func:`suspect_evaluations`: test metrics are finite and in range,
  no record count comes with them (none at all from a site that keeps them local), and no site's
  figures stand far outside the other sites'.
* :func:`check_breslow`: Breslow aggregates have the grid's length, are finite and non-negative,
  and count no more events than the site has records.
* :func:`check_embeddings`: a split-learning site's embeddings have the requested shape and finite
  values, and its presence mask one boolean per requested record.
* :func:`error_message`: the site's own message inside the reason of an error reply.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping

import numpy as np

__all__ = [
    "METRIC_RANGES",
    "error_message",
    "check_arrays",
    "check_breslow",
    "check_embeddings",
    "check_count",
    "check_evaluation",
    "suspect_evaluations",
]

#: Test metrics a site may report and the range each lies in. ``inbll`` is a weighted mean of
#: log-likelihood terms of survival probabilities clipped to [1e-7, 1 - 1e-7], so at most -log(1e-7).
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "c_index": (0.0, 1.0),
    "c_index_td": (0.0, 1.0),
    "ibs": (0.0, 1.0),
    "inbll": (0.0, -math.log(1e-7)),
}


def _names(label: str, names: list[str], shown: int = 5) -> str:
    """``label`` and the first ``shown`` names, with how many more ("" for none)."""
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{label} {len(names)}: {', '.join(name[:80] for name in names[:shown])}{more}"


def check_arrays(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> str:
    """Why ``update`` is not a valid version of the model ``reference`` ("" when it is).

    Same parameter names (none missing, none extra), the same shape and dtype for each, and
    every value finite.
    """
    missing = sorted(set(reference) - set(update))
    extra = sorted(set(update) - set(reference))
    if missing or extra:
        return ("model update has other parameters than the global model: "
                + "; ".join(part for part in (_names("missing", missing), _names("unexpected", extra)) if part))
    for name, expected in reference.items():
        value = update[name]
        if value.shape != expected.shape:
            return f"model update: {name} has shape {tuple(value.shape)}, the global model {tuple(expected.shape)}"
        if value.dtype != expected.dtype:
            return f"model update: {name} has dtype {value.dtype}, the global model {expected.dtype}"
        if not np.all(np.isfinite(value)):
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            return f"model update: {name} has {bad} non-finite value(s)"
    return ""


def check_count(reported: object, agreed: float) -> str:
    """Why a reported record count (``num-examples``) is not the one agreed at set-up ("" when it is).

    A site reports its agreed count with every update, or 0 when it has nothing new to contribute
    (its privacy budget is spent); anything else (another count, a fraction, NaN) is refused, so
    no site can weigh itself into the global model.
    """
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or not math.isfinite(float(reported)):
        return f"num-examples = {reported!r} is not a finite number"
    if float(reported) != 0.0 and not math.isclose(float(reported), agreed, rel_tol=1e-9):
        return f"num-examples = {float(reported):.6g}, but the site's record count agreed at set-up is {agreed:.6g}"
    return ""


def check_evaluation(metrics: Mapping[str, object], *, kept_local: bool = False) -> str:
    """Why a site's evaluation reply is unusable ("" when it is fine).

    Known metric names only (:data:`METRIC_RANGES`, optionally prefixed ``oot_``); each a number in its
    range or NaN (a metric undefined on the site's held-out part, e.g. no events). A record count
    (``num-examples``) is refused: the server weights a site's metrics by its count agreed at set-up,
    and an exact held-out count would reveal the site's size beyond the set-up's noisy count. A reply
    that says the site kept its test metrics (``kept_local``) carries none.
    """
    if kept_local and metrics:
        return (f"the reply says the site kept its test metrics local but carries {len(metrics)} metric(s): "
                f"{', '.join(name[:40] for name in sorted(map(str, metrics))[:5])}")
    if "num-examples" in metrics:
        return ("num-examples: an evaluation reply carries no record count (the server weights the site's test "
                "metrics by its count agreed at set-up)")
    for key, value in metrics.items():
        name = key[4:] if key.startswith("oot_") else key
        if name not in METRIC_RANGES:
            return f"unknown metric {key!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} = {value!r} is not a number"
        low, high = METRIC_RANGES[name]
        if not math.isnan(value) and not low <= value <= high:
            return f"{key} = {value!r} lies outside [{low:g}, {high:g}]"
    return ""


def suspect_evaluations(per_site: Mapping[str, Mapping[str, float]], *, spread_factor: float = 6.0,
                        floor: Mapping[str, float] | None = None) -> dict[str, str]:
    r"""Sites whose test metrics stand far outside the other sites' (site -> why).

    For each metric and each site with at least two other sites reporting it, the site's value
    :math:`x` is compared with the median :math:`m` and the spread
    :math:`s = 1.4826\,\mathrm{MAD}` of the **other** sites' values; it is suspect when

    .. math::

        |x - m| > \max(\text{floor}, k\,s),

    with :math:`k` = ``spread_factor`` and the floor absolute for the C-indices (0.15: no
    plausible federation of one model differs that much between sites of a few hundred records
    unless one lies) and relative for IBS and INBLL (half the others' median). The rule is one
    site at a time against the others, so one forged site cannot shift the reference it is judged
    against. It is a screen, not proof: a site that forges figures close to the others' passes,
    and a genuinely different site in a small federation may be flagged; a flagged site's figures
    are left out of the run's mean and the site is named.
    """
    floor = dict(floor or {"c_index": 0.15, "c_index_td": 0.15, "ibs": 0.5, "inbll": 0.5})
    relative = {"ibs", "inbll"}
    suspects: dict[str, str] = {}
    keys = sorted({key for metrics in per_site.values() for key in metrics} & set(METRIC_RANGES))
    references = {key: _LeaveOneOut([float(metrics[key]) for metrics in per_site.values() if key in metrics])
                  for key in keys}
    for site, metrics in per_site.items():
        for key in keys:
            value = metrics.get(key, math.nan)
            if not math.isfinite(value) or references[key].size < 3:  # fewer than two others
                continue
            centre, spread = references[key].without(float(value))
            spread *= 1.4826
            tolerance = max(floor[key] * (abs(centre) if key in relative else 1.0), spread_factor * spread)
            if abs(value - centre) > tolerance:
                suspects[site] = (f"{key} = {value:.4g} stands outside the other sites' {centre:.4g} +/- "
                                  f"{tolerance:.3g} (median +/- max(floor, {spread_factor:g} x spread))")
                break
    return suspects


class _LeaveOneOut:
    """The median of the finite values but one, and their median absolute deviation from it, for every value.

    The same floats as ``statistics.median`` of the others and of their distances to that median, in
    O(n log n) for all n sites instead of O(n^2): a federation of a thousand sites screened every round.
    """

    def __init__(self, values: list[float]) -> None:
        self.ordered = sorted(value for value in values if math.isfinite(value))
        self.size = len(self.ordered)
        self._deviations: dict[float, list[float]] = {}

    def without(self, value: float) -> tuple[float, float]:
        """(median, median absolute deviation) of the values without one occurrence of ``value`` (one of them)."""
        drop = bisect.bisect_left(self.ordered, value)
        centre = _median_without(self.ordered, drop)
        if centre not in self._deviations:  # the centre takes at most three values
            self._deviations[centre] = sorted(abs(other - centre) for other in self.ordered)
        deviations = self._deviations[centre]
        return centre, _median_without(deviations, bisect.bisect_left(deviations, abs(value - centre)))


def _median_without(ordered: list[float], drop: int) -> float:
    """``statistics.median`` of the sorted ``ordered`` without its element at position ``drop``."""
    n = len(ordered) - 1

    def at(index: int) -> float:
        return ordered[index if index < drop else index + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def check_breslow(event_counts: object, risk_sums: object, *, grid_size: int, max_records: float) -> str:
    """Why a site's Breslow aggregates are unusable ("" when they are fine).

    Two sequences of ``grid_size`` finite, non-negative numbers; the event counts whole numbers
    summing to at most the site's agreed record count.
    """
    try:
        counts = np.asarray(event_counts, dtype=np.float64)
        sums = np.asarray(risk_sums, dtype=np.float64)
    except (TypeError, ValueError):
        return "Breslow aggregates are not numeric"
    if counts.shape != (grid_size,) or sums.shape != (grid_size,):
        return (f"Breslow aggregates have shapes {counts.shape} and {sums.shape}; the time grid has {grid_size} "
                "points")
    if not (np.all(np.isfinite(counts)) and np.all(np.isfinite(sums))):
        return "Breslow aggregates are not finite"
    if np.any(counts < 0) or np.any(sums < 0) or np.any(counts != np.round(counts)):
        return "Breslow aggregates: event counts must be whole numbers >= 0 and risk sums >= 0"
    if counts.sum() > max_records * (1 + 1e-9):
        return f"Breslow aggregates count {counts.sum():g} events, more than the site's {max_records:g} records"
    return ""


def check_power_sums(sums: object, *, size: int, max_records: float, noise_std: float) -> str:
    """Why a site's recalibration release is unusable ("" when it is fine): ``size`` finite numbers,
    each a noisy sum of at most the site's records' values in [0, 1], so within ``10 noise_std`` of
    ``[0, max_records]``."""
    try:
        values = np.asarray(sums, dtype=np.float64)
    except (TypeError, ValueError):
        return "recalibration sums are not numeric"
    if values.shape != (size,) or not np.all(np.isfinite(values)):
        return f"recalibration sums must be {size} finite numbers, got shape {values.shape}"
    margin = 10.0 * noise_std + 1e-9
    if values.min() < -margin or values.max() > max_records + margin:
        return (f"recalibration sums outside [0, {max_records:g}] beyond their noise (std {noise_std:.3g}): "
                f"[{values.min():.4g}, {values.max():.4g}]")
    return ""


def check_embeddings(embeddings: np.ndarray, present: np.ndarray, *, rows: int, dim: int, passes: int | None) -> str:
    """Why a split-learning site's reply is unusable ("" when it is fine).

    ``embeddings`` must have shape ``(rows, dim)`` (a training step; ``passes`` None) or
    ``(passes, rows, dim)`` (prediction) and finite values; ``present`` one boolean per requested
    record.
    """
    expected = (rows, dim) if passes is None else (passes, rows, dim)
    if embeddings.shape != expected:
        return f"embeddings have shape {embeddings.shape}, {expected} were requested"
    if not np.all(np.isfinite(embeddings)):
        return "embeddings are not finite"
    if present.shape != (rows,) or present.dtype != np.bool_:
        return f"the presence mask must be {rows} booleans, got {present.dtype} of shape {present.shape}"
    return ""


#: How Flower words the reason of an error reply from a ClientApp that raised (``f"{type(err)}:<'{err}'>"``, the
#: exception a ``ClientAppException`` whose text starts "Exception ClientAppException occurred. Message: ").
_FLOWER_REASON = re.compile(r"^<class '[\w.()]+'>:<'\s*(?:Exception \w+ occurred\. Message: )?(?P<message>.*)'>$", re.S)
#: Under Flower's Ray simulation the reason is Ray's task error: the actor's traceback, then Flower's text.
_RAY_MESSAGE = re.compile(r"Exception \w+ occurred\. Message: (?P<message>.*)'>$", re.S)


def error_message(reason: str) -> str:
    """The message a site's code raised, without Flower's (or Ray's) wrapping of it (any other reason as it is).

    >>> error_message("<class 'flwr.clientapp.client_app.ClientAppException'>:<'\\nException "
    ...               "ClientAppException occurred. Message: clinical.csv: column 'grade': 2 non-numeric values'>")
    "clinical.csv: column 'grade': 2 non-numeric values"
    >>> error_message("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() "
    ...               "(pid=1)\\n  File ...\\nException ClientAppException occurred. Message: a.csv: column 'x': 2 rows'>")
    "a.csv: column 'x': 2 rows"
    """
    reason = reason.strip()
    match = _RAY_MESSAGE.search(reason) if reason.startswith("<class 'ray.") else _FLOWER_REASON.match(reason)
    return match.group("message").strip() if match else reason
