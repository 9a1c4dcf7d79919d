r"""Federated Breslow estimator of the baseline cumulative hazard from per-site aggregates.

All sites share a time grid :math:`\tau_0 < \dots < \tau_{K-1}` (the model's cut points or a
finer grid). Interval :math:`k` is :math:`(\tau_{k-1}, \tau_k]` with :math:`\tau_{-1} = -\infty`.
Each site sends only

.. math::

    d_k = \#\{j : \delta_j = 1,\ \tau_{k-1} < T_j \le \tau_k\}, \qquad
    R_k = \sum_{j:\, T_j > \tau_{k-1}} e^{g_{jk}},

where :math:`g_{jk} = g(x_j)` for a proportional-hazards model and :math:`g(\tau_k, x_j)` for
CoxTime; events after :math:`\tau_{K-1}` are ignored. No event time leaves the site. The server
sums both over sites and forms

.. math::

    \Delta\hat H_0(\tau_k) = \frac{\sum_s d_k^{(s)}}{\sum_s R_k^{(s)}} \ (0 \text{ where } R_k = 0),
    \qquad \hat H_0(\tau_k) = \sum_{l \le k} \Delta\hat H_0(\tau_l).

When the grid contains every observed time this is exactly Breslow's estimator on the pooled
data (the risk set :math:`\{T_j > \tau_{k-1}\}` is then :math:`\{T_j \ge \tau_k\}`).

References
----------
Breslow (1972), discussion of Cox, JRSS-B 34:216; Kvamme, Borgan & Scheel (2019), JMLR 20(129),
eq. (7) (time-dependent version used by CoxTime).
"""

from __future__ import annotations

import numpy as np

__all__ = ["baseline_cumulative_hazard", "baseline_hazard_increments", "site_aggregates"]


def site_aggregates(
    time: np.ndarray, event: np.ndarray, log_risk: np.ndarray, grid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    r"""Per-site sufficient statistics :math:`(d_k, R_k)` on a shared grid.

    .. math::

        d_k = \sum_j \delta_j \mathbb{1}[\tau_{k-1} < T_j \le \tau_k], \qquad
        R_k = \sum_j \mathbb{1}[T_j > \tau_{k-1}] \, e^{g_{jk}}.

    Parameters
    ----------
    time : ndarray, shape (n,)
        Observed times at the site.
    event : ndarray, shape (n,)
        Event indicators (0/1 or bool).
    log_risk : ndarray, shape (n,) or (n, K)
        :math:`g(x_j)` (proportional hazards), or :math:`g(\tau_k, x_j)` per grid point
        (CoxTime).
    grid : ndarray, shape (K,)
        Strictly increasing shared grid :math:`\tau`.

    Returns
    -------
    event_counts : ndarray of float, shape (K,)
    risk_sums : ndarray of float, shape (K,)

    References
    ----------
    Breslow (1972), JRSS-B 34:216.
    """
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event)
    log_risk = np.asarray(log_risk, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    if time.ndim != 1 or event.shape != time.shape:
        raise ValueError(f"time and event must be 1-D of equal length, got {time.shape}, {event.shape}")
    if grid.ndim != 1 or grid.size == 0 or np.any(np.diff(grid) <= 0):
        raise ValueError("grid must be a non-empty, strictly increasing 1-D array")
    n, num_points = time.shape[0], grid.shape[0]
    if log_risk.shape not in ((n,), (n, num_points)):
        raise ValueError(f"log_risk must have shape ({n},) or ({n}, {num_points}), got {log_risk.shape}")
    if not np.all(np.isfinite(time)) or not np.all(np.isfinite(log_risk)):
        raise ValueError("time and log_risk must be finite")
    if not np.all(np.isin(event, (0, 1))):
        raise ValueError("event must contain only 0/1")
    # interval of each record: smallest k with tau_k >= T_j (K if beyond the grid);
    # T_j > tau_{k-1}  <=>  k <= interval_j.
    interval = np.searchsorted(grid, time, side="left")
    is_counted_event = (event == 1) & (interval < num_points)
    event_counts = np.bincount(interval[is_counted_event], minlength=num_points).astype(np.float64)
    last_at_risk = np.minimum(interval, num_points - 1)
    if log_risk.ndim == 1:
        per_interval = np.bincount(last_at_risk, weights=np.exp(log_risk), minlength=num_points)
        risk_sums = np.cumsum(per_interval[::-1])[::-1]
    else:
        at_risk = np.arange(num_points)[None, :] <= last_at_risk[:, None]
        risk_sums = np.where(at_risk, np.exp(log_risk), 0.0).sum(axis=0)
    return event_counts, risk_sums


def baseline_hazard_increments(event_counts: np.ndarray, risk_sums: np.ndarray) -> np.ndarray:
    r"""Breslow increments :math:`\Delta\hat H_0(\tau_k) = d_k / R_k` (0 where :math:`R_k = 0`).

    Parameters
    ----------
    event_counts, risk_sums : ndarray, shape (K,)
        Sums over sites of the outputs of :func:`site_aggregates`.

    Returns
    -------
    ndarray, shape (K,)

    References
    ----------
    Breslow (1972), JRSS-B 34:216.
    """
    event_counts = np.asarray(event_counts, dtype=np.float64)
    risk_sums = np.asarray(risk_sums, dtype=np.float64)
    if event_counts.ndim != 1 or risk_sums.shape != event_counts.shape:
        raise ValueError(
            f"event_counts and risk_sums must be 1-D of equal length, got "
            f"{event_counts.shape}, {risk_sums.shape}"
        )
    if np.any(event_counts < 0) or np.any(risk_sums < 0):
        raise ValueError("event_counts and risk_sums must be non-negative")
    if np.any((event_counts > 0) & (risk_sums == 0)):
        raise ValueError("an interval has events but an empty risk set: aggregates are inconsistent")
    safe = np.where(risk_sums > 0, risk_sums, 1.0)
    return np.where(risk_sums > 0, event_counts / safe, 0.0)


def baseline_cumulative_hazard(event_counts: np.ndarray, risk_sums: np.ndarray) -> np.ndarray:
    r"""Breslow cumulative baseline hazard :math:`\hat H_0(\tau_k) = \sum_{l \le k} d_l / R_l`.

    Parameters
    ----------
    event_counts, risk_sums : ndarray, shape (K,)
        Sums over sites of the outputs of :func:`site_aggregates`.

    Returns
    -------
    ndarray, shape (K,)

    References
    ----------
    Breslow (1972), JRSS-B 34:216.
    """
    return np.cumsum(baseline_hazard_increments(event_counts, risk_sums))
