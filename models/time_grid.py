r"""The time grid of the discrete-time models, from times or from counts (numpy only, no torch).

:func:`make_time_grid` gives the cut points of the hazard model's intervals from training times
(pycox ``LabTransDiscreteTime``'s ``"quantiles"`` and ``"equidistant"`` schemes);
:func:`time_histogram` and :func:`time_grid_from_histograms` give the same grid from the sites'
summed histograms, and :func:`time_grid_from_counts` from (possibly fractional, denoised) counts;
:func:`event_quantile_grid` gives cuts at the quantiles of events counted per interval of a noisy
histogram, which the differentially private set-up (:mod:`strategies.mechanisms.setup_statistics`) uses.
:func:`interval_hazard` gives the Kaplan-Meier hazard per interval of the grid from the same counts
(:func:`time_counts` of exact times), the hazard model's data-driven start.
:mod:`models.survival` discretises times on the grid and builds the models on it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "check_time_event",
    "event_quantile_grid",
    "interval_hazard",
    "make_time_grid",
    "time_grid_from_counts",
    "time_grid_from_histogram",
    "histogram_survival",
    "time_grid_from_histograms",
    "time_counts",
    "time_histogram",
]

_SCHEMES = ("quantiles", "equidistant")


def _kaplan_meier(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Kaplan-Meier :math:`\hat S(t) = \prod_{t_i \le t} (1 - d_i / n_i)` at the unique times,
    with :math:`(0, 1)` prepended when every time is positive (as pycox ``kaplan_meier``)."""
    unique_time, inverse = np.unique(time, return_inverse=True)
    deaths = np.bincount(inverse, weights=event, minlength=unique_time.size)
    leaving = np.bincount(inverse, minlength=unique_time.size)
    return _kaplan_meier_counts(unique_time, deaths, leaving)


def _kaplan_meier_counts(
    points: np.ndarray, deaths: np.ndarray, leaving: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_kaplan_meier` of records given as ``deaths`` events and ``leaving`` records in all
    at each of the increasing time ``points`` (counts may be fractional)."""
    at_risk = np.cumsum(leaving[::-1])[::-1]  # records at or after each point (>= deaths there, also in floats)
    with np.errstate(divide="ignore"):
        surv = np.exp(np.cumsum(np.log(1.0 - deaths / at_risk)))
    if points[0] > 0:
        points = np.concatenate(([0.0], points))
        surv = np.concatenate(([1.0], surv))
    return points, surv


def check_time_event(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event)
    if time.ndim != 1 or event.shape != time.shape or time.size == 0:
        raise ValueError(
            f"time and event must be non-empty 1-D arrays of equal length, got {time.shape}, {event.shape}"
        )
    if not np.all(np.isfinite(time)) or np.any(time < 0):
        raise ValueError("time must be finite and non-negative")
    if not np.all(np.isin(event, (0, 1))):
        raise ValueError("event must contain only 0/1")
    return time, event.astype(np.float64)


def make_time_grid(
    time: np.ndarray, event: np.ndarray, *, num_durations: int, scheme: str = "quantiles"
) -> np.ndarray:
    r"""Cut points :math:`\tau_0 = 0 < \tau_1 < \dots < \tau_{T-1} = \max_i T_i`.

    ``"equidistant"``: :math:`\tau_j = j \max_i T_i / (T-1)`.
    ``"quantiles"``: equally spaced levels :math:`s_j` of the Kaplan-Meier curve
    :math:`\hat S` between its minimum and 1; :math:`\tau_j` is the first time at which
    :math:`\hat S \le s_j` (so the intervals hold roughly equal numbers of events);
    duplicates are dropped (tied times give fewer cuts, silently) and :math:`\tau_0` is set to 0.
    Identical to pycox ``LabTransDiscreteTime(num_durations, scheme).fit(time, event).cuts``.

    Parameters
    ----------
    time, event : ndarray, shape (n,)
        Training times (non-negative) and event indicators.
    num_durations : int
        Number of cut points :math:`T \ge 2` (the hazard net's output size).
    scheme : {"quantiles", "equidistant"}

    Returns
    -------
    ndarray of float64, shape (T,) (fewer for "quantiles" when levels coincide)

    References
    ----------
    Kvamme & Borgan (2019), arXiv:1910.06724, Sec. 4 (pycox ``make_cuts``).
    """
    time, event = check_time_event(time, event)
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    if scheme == "equidistant":
        cuts = np.linspace(0.0, time.max(), num_durations)
        if np.any(np.diff(cuts) == 0):
            raise ValueError("equidistant cuts are not unique: all times are 0")
        return cuts
    return _quantile_cuts(*_kaplan_meier(time, event), num_durations)


def _quantile_cuts(km_time: np.ndarray, km_surv: np.ndarray, num_durations: int) -> np.ndarray:
    """The ``"quantiles"`` cut points of :func:`make_time_grid` from a Kaplan-Meier curve."""
    levels = np.linspace(km_surv.min(), km_surv.max(), num_durations)
    first_below = np.searchsorted(km_surv[::-1], levels)[::-1]
    # Tied times (months, days, a coarse follow-up) make levels share a cut: the grid has fewer
    # cuts, as documented, and the model as many outputs. Not a warning: it is normal for user data.
    cuts = np.unique(km_time[::-1][first_below])
    cuts[0] = 0.0
    return cuts


def time_histogram(time: np.ndarray, event: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Events and censorings per interval of ``edges`` (the last interval includes its right edge).

    A deployed site's contribution to :func:`time_grid_from_histograms`: counts only, no time.
    """
    time, event = check_time_event(time, event)
    events, _ = np.histogram(time[event == 1], bins=edges)
    censored, _ = np.histogram(time[event == 0], bins=edges)
    return events, censored


def time_grid_from_histograms(
    edges: np.ndarray, events: np.ndarray, censored: np.ndarray, *, num_durations: int, scheme: str = "quantiles",
) -> np.ndarray:
    """:func:`make_time_grid` of the records summarised by the summed :func:`time_histogram` counts.

    Each record is placed at the right edge of its interval, so the grid is that of the pooled
    times rounded up to the histogram's resolution (``edges[-1]``, the largest time, is exact);
    with ``"equidistant"`` it equals :func:`make_time_grid` of the pooled times.
    """
    edges = np.asarray(edges, dtype=np.float64)
    return time_grid_from_counts(edges[1:], events, censored, num_durations=num_durations, scheme=scheme)


def _checked_counts(points: np.ndarray, events: np.ndarray,
                    censored: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(points, events, censored)`` as float arrays, refused unless 1-D of one length with finite,
    non-negative, strictly increasing points."""
    points = np.asarray(points, dtype=np.float64)
    events = np.asarray(events, dtype=np.float64)
    censored = np.asarray(censored, dtype=np.float64)
    if points.ndim != 1 or events.shape != points.shape or censored.shape != points.shape:
        raise ValueError(f"points, events and censored must be 1-D of one length, got {points.shape}, "
                         f"{events.shape}, {censored.shape}")
    if not np.all(np.isfinite(points)) or np.any(points < 0) or np.any(np.diff(points) <= 0):
        raise ValueError("points must be finite, non-negative and strictly increasing")
    return points, events, censored


def time_grid_from_counts(
    points: np.ndarray, events: np.ndarray, censored: np.ndarray, *, num_durations: int, scheme: str = "quantiles",
) -> np.ndarray:
    """:func:`make_time_grid` of records given as counts of events and censorings at time points.

    ``events[j]`` events and ``censored[j]`` censorings happen at ``points[j]``; counts may be
    fractional (e.g. denoised noisy counts), the Kaplan-Meier curve weighs them as they are. With
    integer counts the result is :func:`make_time_grid` of the records the counts stand for;
    ``"equidistant"`` ends at the last point holding a record.

    Parameters
    ----------
    points : ndarray, shape (m,)
        Strictly increasing, non-negative times.
    events, censored : ndarray, shape (m,)
        Non-negative counts; at least one positive.
    num_durations, scheme
        As in :func:`make_time_grid`.
    """
    points, events, censored = _checked_counts(points, events, censored)
    counts = events + censored
    if not (np.all(np.isfinite(counts)) and np.all(events >= 0) and np.all(censored >= 0) and counts.sum() > 0):
        raise ValueError("events and censored must be finite, non-negative counts, not all zero")
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    held = counts > 0
    points, events, counts = points[held], events[held], counts[held]
    if scheme == "equidistant":
        if points[-1] == 0:
            raise ValueError("equidistant cuts are not unique: all times are 0")
        return np.linspace(0.0, points[-1], num_durations)
    return _quantile_cuts(*_kaplan_meier_counts(points, events, counts), num_durations)


def _edge_survival(events: np.ndarray, censored: np.ndarray) -> np.ndarray:
    """Kaplan-Meier survival at the edges of intervals holding ``events`` and ``censored`` records (starts at 1)."""
    at_risk = np.cumsum((events + censored)[::-1])[::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(at_risk > 0, 1.0 - events / at_risk, 1.0)
    return np.concatenate(([1.0], np.cumprod(np.clip(factor, 0.0, 1.0))))


def histogram_survival(edges: np.ndarray, events: np.ndarray, censored: np.ndarray, times: np.ndarray) -> np.ndarray:
    r"""The curve of :func:`time_grid_from_histogram` at ``times``: Kaplan-Meier at the edges of the
    intervals, linear within them (records spread evenly over their interval), 1 before 0 and
    constant after the last edge. Every interval holding events has a drop, so consecutive quantile
    cuts of this curve never bound an interval of zero hazard."""
    edges = np.asarray(edges, dtype=np.float64)
    surv = _edge_survival(np.asarray(events, dtype=np.float64), np.asarray(censored, dtype=np.float64))
    return np.interp(np.asarray(times, dtype=np.float64), edges, surv, left=1.0)


def time_grid_from_histogram(
    edges: np.ndarray, events: np.ndarray, censored: np.ndarray, *, num_durations: int,
) -> np.ndarray:
    r"""Quantile cuts of the Kaplan-Meier curve of records counted per interval, interpolated within intervals.

    ``events[j]`` and ``censored[j]`` records leave in :math:`(e_j, e_{j+1}]`; the curve at the
    edges is :math:`S(e_0) = 1`, :math:`S(e_{j+1}) = S(e_j)(1 - d_j / n_j)` with :math:`n_j` the
    records still at risk at :math:`e_j`, and linear in between (records spread evenly over their
    interval). As :func:`make_time_grid`'s ``"quantiles"``, the cuts are the times at which
    :math:`S` first reaches ``num_durations`` equally spaced levels from its minimum to 1, the
    first set to 0 and the last at the end of the last interval holding a record; a level the curve crosses inside an interval gets a cut inside it, so a coarse
    (e.g. noisy, differentially private) histogram still gives distinct cuts where the events are.
    Counts may be fractional (denoised). Fewer cuts are returned only where levels coincide
    (intervals without events).

    Parameters
    ----------
    edges : ndarray, shape (m + 1,)
        Strictly increasing, starting at 0.
    events, censored : ndarray, shape (m,)
        Non-negative counts with at least one event.
    num_durations : int
        Number of cut points (>= 2).
    """
    edges = np.asarray(edges, dtype=np.float64)
    events = np.asarray(events, dtype=np.float64)
    censored = np.asarray(censored, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or edges[0] != 0 or np.any(np.diff(edges) <= 0):
        raise ValueError("edges must be strictly increasing from 0")
    if events.shape != (edges.size - 1,) or censored.shape != events.shape:
        raise ValueError(f"events and censored need {edges.size - 1} counts, got {events.shape}, {censored.shape}")
    if np.any(events < 0) or np.any(censored < 0) or not np.all(np.isfinite(events + censored)) or events.sum() <= 0:
        raise ValueError("events and censored must be finite, non-negative counts with at least one event")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    surv = _edge_survival(events, censored)
    levels = np.linspace(surv.min(), 1.0, num_durations)
    reached = np.argmax(surv[None, :] <= levels[:, None] + 1e-12, axis=1)  # first edge at or below each level
    before = np.maximum(reached - 1, 0)
    drop = surv[before] - surv[reached]
    share = np.divide(surv[before] - levels, drop, out=np.ones_like(levels), where=drop > 0)
    cuts = edges[before] + np.clip(share, 0.0, 1.0) * (edges[reached] - edges[before])
    cuts[0] = edges[np.flatnonzero(events + censored > 0)[-1] + 1]  # the lowest level: the last record (as pycox)
    cuts = np.unique(np.where(reached == 0, 0.0, cuts))
    cuts[0] = 0.0
    return cuts


def event_quantile_grid(
    edges: np.ndarray, events: np.ndarray, *, num_durations: int, floor: float = 0.0,
) -> np.ndarray:
    r"""Cuts at equally spaced quantiles of the events counted per interval, linear within intervals.

    Interval :math:`j`, :math:`(e_j, e_{j+1}]`, holds :math:`m_j = d_j + f` events spread evenly over
    it (``events[j]`` plus ``floor``). With :math:`M(t)` the number of them up to :math:`t`, the cuts are the
    first times at which :math:`M` reaches :math:`k M(e_m) / (T - 1)`, :math:`k = 0, \dots, T - 1`
    (:math:`T` = ``num_durations``): each cell of the grid holds about the same number of events. The
    first cut is 0, the last the right edge of the last interval with :math:`m_j > 0`.

    ``floor`` is what a noisy histogram cannot rule out: a denoised count of 0 may hide about one noise
    standard deviation of events, so every interval counts at least that many and keeps its share of
    the cuts. The largest cell then spans at most about :math:`\sum_j m_j / ((T - 1) f)` intervals
    wherever the noise put the events, while intervals whose events stand far out of the noise get cuts
    in proportion to them. Unlike the Kaplan-Meier quantiles of :func:`time_grid_from_histogram`, no
    ratio of two noisy counts enters. Counts may be fractional; fewer cuts are returned only where
    levels coincide (``floor`` 0 and intervals without events).

    Parameters
    ----------
    edges : ndarray, shape (m + 1,)
        Strictly increasing, starting at 0.
    events : ndarray, shape (m,)
        Non-negative (denoised) event counts.
    num_durations : int
        Number of cut points (>= 2).
    floor : float
        Pseudo-events added to every interval (>= 0).

    Raises
    ------
    ValueError
        On malformed input, or when no interval holds any mass (no event and ``floor`` 0).
    """
    edges = np.asarray(edges, dtype=np.float64)
    events = np.asarray(events, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or edges[0] != 0 or np.any(np.diff(edges) <= 0):
        raise ValueError("edges must be strictly increasing from 0")
    if events.shape != (edges.size - 1,) or not np.all(np.isfinite(events)) or np.any(events < 0):
        raise ValueError(f"events must be {edges.size - 1} finite, non-negative counts, got shape {events.shape}")
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"floor must be a finite number >= 0, got {floor!r}")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    mass = events + floor
    cumulative = np.concatenate(([0.0], np.cumsum(mass)))
    if not cumulative[-1] > 0:
        raise ValueError("no interval holds an event (and floor is 0): the grid has nothing to follow")
    levels = np.linspace(0.0, cumulative[-1], num_durations)
    interval = np.clip(np.searchsorted(cumulative, levels, side="left") - 1, 0, mass.size - 1)
    share = np.divide(levels - cumulative[interval], mass[interval], out=np.ones_like(levels),
                      where=mass[interval] > 0)
    cuts = edges[interval] + np.clip(share, 0.0, 1.0) * (edges[interval + 1] - edges[interval])
    cuts[0] = 0.0
    return np.unique(cuts)


def time_counts(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact ``(points, events, censored)``: the unique times and the events and censorings at each.

    The exact counterpart of a private set-up's denoised ``SharedSetup.time_counts``.
    """
    time, event = check_time_event(time, event)
    points, inverse = np.unique(time, return_inverse=True)
    events = np.bincount(inverse, weights=event, minlength=points.size)
    return points, events, np.bincount(inverse, minlength=points.size) - events


def interval_hazard(
    points: np.ndarray, events: np.ndarray, censored: np.ndarray, cuts: np.ndarray,
) -> np.ndarray:
    r"""Discrete hazard per interval of the grid ``cuts`` whose survival is the counts' Kaplan-Meier.

    With :math:`\hat S` the Kaplan-Meier curve of the records the counts stand for (``events[k]``
    events and ``censored[k]`` censorings at ``points[k]``; fractional counts weigh as they are)
    and the hazard model's intervals :math:`(\tau_{j-1}, \tau_j]` (interval 0 is
    :math:`[0, \tau_0]`; :func:`models.survival.discretise`),

    .. math::

        h_j = 1 - \hat S(\tau_j) / \hat S(\tau_{j-1}), \qquad \hat S(\tau_{-1}) = 1,

    (:math:`h_j = 1` once :math:`\hat S(\tau_{j-1}) = 0`), so that
    :math:`\prod_{l \le j} (1 - h_l) = \hat S(\tau_j)`. A censoring inside an interval keeps
    its record at risk until its time, as in Kaplan-Meier; the covariate-free maximum of the
    logistic-hazard likelihood instead drops it from that interval's risk set (pycox's
    convention), a slightly larger hazard where censoring is heavy.

    Parameters
    ----------
    points : ndarray, shape (m,)
        Strictly increasing, non-negative times.
    events, censored : ndarray, shape (m,)
        Non-negative counts, at least one event.
    cuts : ndarray, shape (T,)
        The grid (strictly increasing).

    Returns
    -------
    ndarray of float64, shape (T,), in [0, 1]
    """
    points, events, censored = _checked_counts(points, events, censored)
    cuts = np.asarray(cuts, dtype=np.float64)
    if not (np.all(np.isfinite(events + censored)) and np.all(events >= 0) and np.all(censored >= 0)
            and events.sum() > 0):
        raise ValueError("events and censored must be finite, non-negative counts with at least one event")
    if cuts.ndim != 1 or cuts.size < 1 or np.any(np.diff(cuts) <= 0):
        raise ValueError("cuts must be a strictly increasing 1-D array")
    held = events + censored > 0
    km_time, km_surv = _kaplan_meier_counts(points[held], events[held], (events + censored)[held])
    position = np.searchsorted(km_time, cuts, side="right") - 1
    surv = np.clip(np.where(position >= 0, km_surv[np.maximum(position, 0)], 1.0), 0.0, 1.0)
    before = np.concatenate(([1.0], surv[:-1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(before > 0, 1.0 - surv / before, 1.0)
