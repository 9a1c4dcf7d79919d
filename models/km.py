r"""Federated Kaplan–Meier estimator and log-rank tests from additive per-site counts.

Every statistic here is a function of per-time counts that each site computes from its own
records and the server adds: the number at risk :math:`n_k` and the number of events
:math:`d_k` at each time :math:`t_k` (per group, for the log-rank test). Sums over sites of
these counts are the counts of the pooled records, so every result is exactly the one
computed on the pooled records.

Times are either every distinct time a site observed (exact; the site reveals its event and
censoring times with their counts) or a shared grid :math:`\tau_0 < \dots < \tau_{K-1}`
(the site reveals only counts per grid point). On a grid an **event time rounds up** to the
smallest grid point :math:`\ge` it and a **censoring time rounds down** to the largest grid
point :math:`\le` it: a record is at risk at :math:`\tau_k` when its rounded time is
:math:`\ge \tau_k`. A grid that contains every event time gives exactly the statistics of the
unrounded records (at-risk sets matter only at event times, and a record censored at
:math:`t` is at risk at every event time :math:`\le t`, ties included), so such a grid hides
the censoring times at no cost in accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

__all__ = [
    "KMCounts",
    "LogrankResult",
    "LogrankSums",
    "combine_km_counts",
    "grid_index",
    "kaplan_meier",
    "logrank_test",
    "site_km_counts",
    "site_logrank_sums",
    "survival_arrays",
]


def survival_arrays(
    time: np.ndarray, event: np.ndarray, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated ``(time, event, weights)``: float times, boolean events, positive float weights.

    Raises a one-line ``ValueError`` naming the argument when ``time`` or ``event`` is not 1-D
    of one length, ``time`` is not finite, ``event`` holds values other than 0/1, or ``weights``
    is not positive and finite.
    """
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event)
    if t.ndim != 1 or e.shape != t.shape:
        raise ValueError(f"time and event must be 1-D of one length, got shapes {t.shape} and {e.shape}")
    if not np.all(np.isfinite(t)):
        raise ValueError("time must be finite: drop or impute records with missing times")
    if not np.all(np.isin(e, (0, 1))):
        raise ValueError("event must hold only 0/1 (or False/True): recode the event column")
    if weights is None:
        return t, e.astype(bool), np.ones_like(t)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != t.shape or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be positive, finite and one per record: fix or drop the weights")
    return t, e.astype(bool), w


def grid_index(time: np.ndarray, event: np.ndarray, grid: np.ndarray) -> np.ndarray:
    r"""Index of the last grid point at which each record is at risk.

    An event at :math:`t` rounds up to :math:`\min\{k : \tau_k \ge t\}`; a censoring at
    :math:`t` rounds down to :math:`\max\{k : \tau_k \le t\}` (``-1`` when :math:`t < \tau_0`:
    the record is never at risk at a grid point and is left out). A record with index
    :math:`i` is at risk at :math:`\tau_k` for every :math:`k \le i`, and an event with index
    :math:`i` happens at :math:`\tau_i`.

    Raises ``ValueError`` when ``grid`` is not strictly increasing or an event lies after its
    last point.
    """
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or np.any(np.diff(grid) <= 0) or not np.all(np.isfinite(grid)):
        raise ValueError("grid must be a non-empty, finite, strictly increasing 1-D array")
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event, dtype=bool)
    up = np.searchsorted(grid, time, side="left")
    if np.any(event & (up >= grid.size)):
        raise ValueError("grid ends before an event time: extend grid to the largest event time")
    down = np.searchsorted(grid, time, side="right") - 1
    return np.where(event, up, down)


@dataclass(frozen=True, eq=False)
class KMCounts:
    """Weighted counts per time: ``at_risk[k]`` records with time ``>= times[k]`` and
    ``events[k]`` / ``censored[k]`` records leaving at ``times[k]`` (all shape ``(K,)``)."""

    times: np.ndarray
    at_risk: np.ndarray
    events: np.ndarray
    censored: np.ndarray


def site_km_counts(
    time: np.ndarray,
    event: np.ndarray,
    grid: np.ndarray | None = None,
    *,
    weights: np.ndarray | None = None,
) -> KMCounts:
    """One site's Kaplan–Meier counts, at its own distinct times or at the shared ``grid``.

    Reveals: without a grid, every distinct time the site observed with the number of events,
    censorings and records at risk there; with a grid, those counts per grid point only
    (rounded as in the module docstring; records censored before ``grid[0]`` are left out).
    """
    t, e, w = survival_arrays(time, event, weights)
    if grid is None:
        times, cell = np.unique(t, return_inverse=True)
    else:
        times = np.asarray(grid, dtype=np.float64)
        cell = grid_index(t, e, times)
        keep = cell >= 0
        t, e, w, cell = t[keep], e[keep], w[keep], cell[keep]
    k = times.size
    events = np.bincount(cell, weights=w * e, minlength=k)
    censored = np.bincount(cell, weights=w * ~e, minlength=k)
    at_risk = np.cumsum((events + censored)[::-1])[::-1]
    return KMCounts(times, at_risk, events, censored)


def combine_km_counts(counts: Sequence[KMCounts]) -> KMCounts:
    """Server side: the pooled counts on the union of the sites' times.

    A site's number at risk at a union time ``u`` is its number at risk at its own smallest
    time ``>= u`` (or what is left after its last time), so the result equals
    :func:`site_km_counts` on the pooled records.
    """
    if len(counts) == 0:
        raise ValueError("counts is empty: pass at least one site's KMCounts")
    union = np.unique(np.concatenate([c.times for c in counts]))
    at_risk = np.zeros(union.size)
    events = np.zeros(union.size)
    censored = np.zeros(union.size)
    for c in counts:
        pos = np.searchsorted(union, c.times)
        events[pos] += c.events
        censored[pos] += c.censored
        after_last = c.at_risk[-1] - c.events[-1] - c.censored[-1] if c.times.size else 0.0
        padded = np.append(c.at_risk, after_last)
        at_risk += padded[np.searchsorted(c.times, union, side="left")]
    return KMCounts(union, at_risk, events, censored)


def kaplan_meier(counts: KMCounts, alpha: float = 0.05) -> pd.DataFrame:
    r"""Kaplan–Meier survival with Greenwood variance and log(−log) confidence bounds.

    .. math::

        \hat S(t) = \prod_{t_k \le t} \Bigl(1 - \frac{d_k}{n_k}\Bigr), \qquad
        \sigma^2(t) = \sum_{t_k \le t} \frac{d_k}{n_k (n_k - d_k)} \ (\text{terms with } n_k = d_k
        \text{ dropped}),

        \text{bounds} = \exp\!\bigl(-\exp(\log(-\log \hat S) \mp z_{1-\alpha/2}\,
        \sigma / \log \hat S)\bigr) \ (1 \text{ where undefined}),

    exactly lifelines' ``KaplanMeierFitter`` (``survival_function_``, ``confidence_interval_``).
    Returns a DataFrame indexed by ``time`` with columns ``at_risk, events, censored, survival,
    variance`` (Greenwood: :math:`\hat S^2 \sigma^2`), ``greenwood_sum`` (:math:`\sigma^2`),
    ``lower``, ``upper``.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    n, d = counts.at_risk, counts.events
    with np.errstate(divide="ignore", invalid="ignore"):
        log_step = np.where(n > 0, np.log(n - d) - np.log(np.where(n > 0, n, 1.0)), 0.0)
        term = np.where(n > d, d / (n * (n - d)), 0.0)
        log_s = np.cumsum(log_step)
        cum = np.cumsum(term)
        z = stats.norm.ppf(1 - alpha / 2)
        spread = z * np.sqrt(cum) / log_s
        lower = np.exp(-np.exp(np.log(-log_s) - spread))
        upper = np.exp(-np.exp(np.log(-log_s) + spread))
    survival = np.exp(log_s)
    frame = pd.DataFrame(
        {
            "at_risk": n,
            "events": d,
            "censored": counts.censored,
            "survival": survival,
            "variance": survival**2 * cum,
            "greenwood_sum": cum,
            "lower": np.nan_to_num(lower, nan=1.0),
            "upper": np.nan_to_num(upper, nan=1.0),
        },
        index=pd.Index(counts.times, name="time"),
    )
    return frame


@dataclass(frozen=True, eq=False)
class LogrankSums:
    """Per time and group counts: ``at_risk[k, j]`` and ``events[k, j]`` for group
    ``groups[j]`` at ``times[k]``. Adding two (same ``times``) aligns their groups."""

    times: np.ndarray
    groups: tuple
    at_risk: np.ndarray
    events: np.ndarray

    def __add__(self, other: LogrankSums) -> LogrankSums:
        if not np.array_equal(self.times, other.times):
            raise ValueError("LogrankSums have different times: compute every site's sums on one shared grid")
        groups = tuple(sorted(set(self.groups) | set(other.groups)))
        at_risk = np.zeros((self.times.size, len(groups)))
        events = np.zeros_like(at_risk)
        for part in (self, other):
            cols = [groups.index(g) for g in part.groups]
            at_risk[:, cols] += part.at_risk
            events[:, cols] += part.events
        return LogrankSums(self.times, groups, at_risk, events)


def site_logrank_sums(
    time: np.ndarray, event: np.ndarray, group: np.ndarray, times: np.ndarray
) -> LogrankSums:
    """One site's numbers at risk and events per group at the shared ``times``.

    ``times`` is a grid (rounding as in the module docstring); it must reach the last event,
    and containing every pooled event time makes the test exact. Reveals: per time and per
    group, the site's number at risk and number of events (and which group labels it has).
    """
    t, e, _ = survival_arrays(time, event)
    group = np.asarray(group)
    if group.shape != t.shape:
        raise ValueError(f"group must have one label per record, got shape {group.shape} for {t.size} records")
    times = np.asarray(times, dtype=np.float64)
    cell = grid_index(t, e, times)
    labels = tuple(sorted(set(group.tolist())))
    at_risk = np.zeros((times.size, len(labels)))
    events = np.zeros_like(at_risk)
    for j, label in enumerate(labels):
        mine = (group == label) & (cell >= 0)
        leaving = np.bincount(cell[mine], minlength=times.size)
        at_risk[:, j] = np.cumsum(leaving[::-1])[::-1]
        events[:, j] = np.bincount(cell[mine & e], minlength=times.size)
    return LogrankSums(times, labels, at_risk, events)


@dataclass(frozen=True)
class LogrankResult:
    """Log-rank chi-squared ``statistic`` on ``degrees_of_freedom`` = groups − 1, its
    ``p_value``, and per group ``observed`` / ``expected`` events (summed over strata)."""

    statistic: float
    p_value: float
    degrees_of_freedom: int
    groups: tuple
    observed: np.ndarray
    expected: np.ndarray


def _observed_minus_expected(sums: LogrankSums) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``(O, E, V)`` of one stratum: :math:`E_j = \sum_k n_{kj} d_k / n_k` and the
    hypergeometric covariance :math:`V_{jl} = \sum_k \frac{d_k (n_k - d_k)}{n_k^2 (n_k - 1)}
    (n_k n_{kj} \mathbb{1}_{j=l} - n_{kj} n_{kl})` (the fraction is 1 when :math:`n_k = 1`)."""
    n_kj, d_kj = sums.at_risk, sums.events
    n_k, d_k = n_kj.sum(1), d_kj.sum(1)
    live = (n_k > 0) & (d_k > 0)
    n_kj, n_k, d_k = n_kj[live], n_k[live], d_k[live]
    expected = (n_kj * (d_k / n_k)[:, None]).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(n_k > 1, (n_k - d_k) / (n_k - 1), 1.0)
    factor = ratio * d_k / n_k**2
    variance = np.diag((factor * n_k) @ n_kj) - (n_kj * factor[:, None]).T @ n_kj
    return d_kj.sum(0), expected, variance


def logrank_test(sums: LogrankSums | Sequence[LogrankSums], *, stratified: bool = False) -> LogrankResult:
    r"""Log-rank test of equal survival across groups from summed per-site counts.

    Pooled (``stratified=False``): the sites' sums are added and the test is lifelines'
    ``multivariate_logrank_test`` (``logrank_test`` for two groups) on the pooled records.
    Stratified by site (a sequence and ``stratified=True``): observed − expected
    :math:`Z = \sum_s (O_s - E_s)` and covariance :math:`V = \sum_s V_s` are summed over
    sites, each computed within its own site (R's ``survdiff(... + strata(site))``). In both
    cases :math:`\chi^2 = Z_{-}^\top V_{-}^{+} Z_{-}` over all groups but the last
    (pseudo-inverse), with groups − 1 degrees of freedom.
    """
    parts = [sums] if isinstance(sums, LogrankSums) else list(sums)
    if not parts:
        raise ValueError("sums is empty: pass at least one site's LogrankSums")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    groups = total.groups
    if len(groups) < 2:
        raise ValueError(f"the log-rank test needs at least two groups, found {list(groups)}")
    strata = [_align(p, groups) for p in parts] if stratified else [total]
    observed = np.zeros(len(groups))
    expected = np.zeros(len(groups))
    variance = np.zeros((len(groups), len(groups)))
    for stratum in strata:
        o, e, v = _observed_minus_expected(stratum)
        observed, expected, variance = observed + o, expected + e, variance + v
    z = (observed - expected)[:-1]
    statistic = float(z @ np.linalg.pinv(variance[:-1, :-1]) @ z)
    dof = len(groups) - 1
    return LogrankResult(statistic, float(stats.chi2.sf(statistic, dof)), dof, groups, observed, expected)


def _align(sums: LogrankSums, groups: tuple) -> LogrankSums:
    """``sums`` with zero columns for the groups it lacks, in the order of ``groups``."""
    empty = LogrankSums(sums.times, groups, np.zeros((sums.times.size, len(groups))),
                        np.zeros((sums.times.size, len(groups))))
    return empty + sums
