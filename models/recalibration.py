r"""Recalibration of predicted survival curves to a target marginal curve (numpy only, no torch).

A model trained with DP-SGD ranks records well but its curves drift (per-record clipping weighs
the rare events' gradients down, so hazards come out low and survival high). The recalibrated
curve of a record is

.. math::

    \tilde S(t \mid x) = S(t \mid x)^{c(t)},

a power of its predicted curve (a scaling of its cumulative hazard :math:`-\log S`), with
:math:`c(t) > 0` chosen at a few horizons :math:`t_h` so that the population mean matches the
target, :math:`\frac1n \sum_i S(t_h \mid x_i)^{c_h} = S_{KM}(t_h)`, and interpolated between them.
At each time the ranking of the records is unchanged (the C-index and the time-dependent C-index
are those of the model); only the level of the curves moves.

The mean :math:`m_h(c) = \frac1n \sum_i S(t_h \mid x_i)^{c}` is decreasing in :math:`c`; it is
known from its values at the exponents ``EXPONENTS`` (sums :math:`\sum_i S_i^{c}`, each term in
:math:`[0, 1]`, which is what a differentially private site releases with noise:
:mod:`strategies.mechanisms.setup_statistics`) and at :math:`c = 0` (:math:`m = 1`, exact), and
interpolated linearly in :math:`(c, \log m)` (exact for a population of identical records, where
:math:`\log m = c \log S`), extrapolated within ``EXPONENT_RANGE``. :math:`\log m(c)` is convex
(a log Laplace transform), so an extrapolated :math:`c` is an under-correction rather than an
over-correction.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["EXPONENTS", "EXPONENT_RANGE", "apply_exponents", "cut_exponents", "fit_exponents", "power_sums", "power_terms"]

#: The exponents at which a site sums its records' predicted survival powers.
EXPONENTS: tuple[float, ...] = (1.0, 2.0, 4.0)
#: The exponents a recalibration may take (beyond it the target is not trusted).
EXPONENT_RANGE: tuple[float, float] = (0.1, 10.0)


def power_terms(surv_at_horizons: np.ndarray) -> np.ndarray:
    r"""Each record's :math:`S_i(t_h)^{c}` for every horizon :math:`h` and exponent :math:`c` in ``EXPONENTS``.

    ``surv_at_horizons``: shape ``(n, H)``, values clipped to ``[0, 1]``. Returns shape ``(n, H, len(EXPONENTS))``.
    """
    surv = np.clip(np.asarray(surv_at_horizons, dtype=np.float64), 0.0, 1.0)
    if surv.ndim != 2:
        raise ValueError(f"survival at the horizons must be (records, horizons), got shape {surv.shape}")
    return np.stack([np.power(surv, c) for c in EXPONENTS], axis=2)


def power_sums(surv_at_horizons: np.ndarray) -> np.ndarray:
    r""":math:`\sum_i S_i(t_h)^{c}` for every horizon :math:`h` and exponent :math:`c` in ``EXPONENTS``.

    ``surv_at_horizons``: shape ``(n, H)``, values in ``[0, 1]``. Returns shape ``(H, len(EXPONENTS))``.
    One record moves each entry by at most 1 (L2 sensitivity :math:`\sqrt{H |C|}` under add/remove).
    """
    return power_terms(surv_at_horizons).sum(axis=0)


def fit_exponents(sums: np.ndarray, count: float, target: np.ndarray) -> np.ndarray:
    r"""The exponent :math:`c_h` per horizon whose mean power :math:`m_h(c)` meets ``target[h]``.

    ``sums``: :func:`power_sums` (possibly summed over sites, plus noise), shape ``(H, |C|)``;
    ``count``: the number of records they sum over (possibly noisy); ``target``: the target
    survival at each horizon. The means are clipped to ``(0, 1]`` and made non-increasing in
    :math:`c`; where they are strictly decreasing, :math:`c` is interpolated linearly in
    :math:`\log m` (extrapolated from the outer pair). Where noise flattens them (curves near 1,
    whose powers differ by less than the noise), :math:`c = \log(\text{target}) / \log m(1)`, exact
    for identical records. A horizon with no usable target or mean takes the exponent of the
    nearest usable horizon (1 when there is none), so the exponents do not jump back to 1 between
    horizons. The result is clipped to ``EXPONENT_RANGE``.
    """
    sums = np.asarray(sums, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if sums.shape != (target.size, len(EXPONENTS)) or not (np.all(np.isfinite(sums)) and np.isfinite(count)):
        raise ValueError(f"sums must be {target.size} x {len(EXPONENTS)} finite numbers, got shape {sums.shape}")
    result = np.array([_exponent(sums[h] / max(count, 1.0), target[h]) for h in range(target.size)])
    usable = np.flatnonzero(np.isfinite(result))
    if usable.size == 0:
        return np.ones(target.size)
    nearest = usable[np.abs(np.arange(target.size)[:, None] - usable[None, :]).argmin(axis=1)]
    return np.clip(result[nearest], *EXPONENT_RANGE)


def _exponent(means: np.ndarray, target: float) -> float:
    """One horizon's exponent from its mean powers at ``EXPONENTS`` (NaN when none can be fitted).

    The exact point :math:`m(0) = 1` anchors the interpolation below the smallest exponent.
    """
    means = np.minimum.accumulate(np.clip(means, 1e-9, 1.0))
    log_m = np.concatenate(([0.0], np.log(means)))
    if not 0.0 < target < 1.0:
        return math.nan
    goal = math.log(target)
    if np.any(np.diff(log_m) >= 0):
        plain = log_m[1 + EXPONENTS.index(1.0)]
        return goal / plain if plain < 0 else math.nan
    grid = np.concatenate(([0.0], EXPONENTS))
    j = int(np.clip(np.searchsorted(-log_m, -goal) - 1, 0, log_m.size - 2))  # the pair around the goal
    slope = (grid[j + 1] - grid[j]) / (log_m[j + 1] - log_m[j])
    return float(grid[j] + slope * (goal - log_m[j]))


def cut_exponents(cuts: np.ndarray, horizons: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """The exponent at every time of ``cuts``: ``exponents`` at ``horizons``, linear in between, constant beyond."""
    return np.interp(np.asarray(cuts, dtype=np.float64), np.asarray(horizons, dtype=np.float64),
                     np.asarray(exponents, dtype=np.float64))


def apply_exponents(surv: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    r""":math:`S_i(t_k)^{c_k}` for curves ``surv`` of shape ``(n, T)`` and one exponent per time, made
    non-increasing in time (a power that falls with time could otherwise lift a curve)."""
    powered = np.power(np.clip(np.asarray(surv, dtype=np.float64), 0.0, 1.0), np.asarray(exponents)[None, :])
    return np.minimum.accumulate(powered, axis=1)
