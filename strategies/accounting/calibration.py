"""Noise calibration: the one solver every accountant's calibration uses.

A privacy spend (ε of a plan, or its Rényi divergence at one order) decreases as the noise
multiplier grows; calibration finds the noise multiplier whose spend lies just below a target.
:func:`calibrate_noise` does it for any such spend: it brackets the solution in ``log σ`` by steps
from a start, then narrows the bracket by Illinois regula falsi, and always returns a σ whose
spend is at most the target (within ``tolerance`` of it).

Example
-------
>>> sigma = calibrate_noise(lambda s: 0.5 / s**2, 0.02, tolerance=1e-4)   # a Gaussian's zCDP at one order
>>> 0.02 - 1e-4 <= 0.5 / sigma**2 <= 0.02
True
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["calibrate_noise"]


def calibrate_noise(spend: Callable[[float], float], target: float, *, tolerance: float, start: float = 1.0,
                    step: float = math.log(2.0)) -> float:
    """The noise multiplier σ with ``target - tolerance <= spend(σ) <= target``, for ``spend`` decreasing in σ.

    ``start``: where the search begins (a good guess saves evaluations); ``step``: the bracketing step
    in ``log σ``. ``ValueError`` when no σ in [1e-6, 1e7] spends at most the target.
    """
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
    return math.exp(_solve_decreasing(lambda x: spend(math.exp(x)) - target, math.log(start), tolerance, step=step))


def _solve_decreasing(gap: Callable[[float], float], start: float, tolerance: float, *, step: float) -> float:
    """``x`` with ``-tolerance ≤ gap(x) ≤ 0`` for a decreasing ``gap``: bracket from ``start`` in steps of
    ``step``, then Illinois regula falsi (the bracket's upper end always has ``gap ≤ 0``)."""
    low, high = start, start
    gap_low = gap_high = gap(start)
    while gap_high > 0.0:  # too little noise at high: step up
        low, gap_low = high, gap_high
        high += step
        if high > math.log(1e7):
            raise ValueError("no noise multiplier up to 1e7 reaches the target")
        gap_high = gap(high)
    while gap_low <= 0.0:  # enough noise at low: step down
        if -tolerance <= gap_low:
            return low
        high, gap_high = low, gap_low
        low -= step
        if low < math.log(1e-6):
            raise ValueError("the target is met by a noise multiplier below 1e-6")
        gap_low = gap(low)
    if -tolerance <= gap_high:
        return high
    side = 0
    for _ in range(200):
        point = (low * gap_high - high * gap_low) / (gap_high - gap_low)
        if not low < point < high or high - low < 1e-12:
            point = (low + high) / 2.0
        value = gap(point)
        if -tolerance <= value <= 0.0:
            return point
        if value > 0.0:
            low, gap_low = point, value
            gap_high, side = (gap_high / 2.0, 1) if side == 1 else (gap_high, 1)
        else:
            high, gap_high = point, value
            gap_low, side = (gap_low / 2.0, -1) if side == -1 else (gap_low, -1)
    return high  # the bracket's noisy end always meets spend ≤ target
