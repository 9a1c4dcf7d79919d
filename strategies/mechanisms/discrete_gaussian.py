r"""The discrete Gaussian :math:`N_{\mathbb Z}(0, \sigma^2)`: :math:`P(X = x) \propto e^{-x^2/(2\sigma^2)}` on the integers.

:func:`sample_discrete_gaussian` is Canonne, Kamath & Steinke's rejection sampler (NeurIPS 2020,
Algorithm 3 over their Algorithm 2), vectorised over a batch of candidates with numpy:

1. discrete Laplace with scale :math:`t = \lfloor\sigma\rfloor + 1`: :math:`U \sim \mathcal U\{0..t-1\}`, kept
   with probability :math:`e^{-U/t}`; :math:`V \sim` Geometric (:math:`P(V = v) = (1 - e^{-1}) e^{-v}`,
   drawn as :math:`\lfloor E \rfloor` with :math:`E` standard exponential, which has exactly this law);
   :math:`X = U + tV`; a random sign, rejecting :math:`-0`;
2. the candidate :math:`Y` is kept with probability :math:`\exp(-(|Y| - \sigma^2/t)^2 / (2\sigma^2))`.

The acceptance probabilities are evaluated in float64, as Kairouz, Liu & Steinke's reference
implementation of the distributed discrete Gaussian does (vectorised, in floating point), not with
the exact rational arithmetic of Canonne et al.'s Algorithm 1: each probability is exact to a
relative 2^-52, which the accountant does not count (docs/privacy-methods.md says so). No torch.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["discrete_gaussian_moments", "sample_discrete_gaussian"]


def sample_discrete_gaussian(rng: np.random.Generator, sigma2: float, size: int) -> np.ndarray:
    """``size`` independent draws of :math:`N_{\\mathbb Z}(0, \\sigma^2)` (int64), from ``rng``."""
    sigma2 = float(sigma2)
    if not (math.isfinite(sigma2) and sigma2 > 0):
        raise ValueError(f"sigma2 must be a finite number > 0, got {sigma2}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    t = math.floor(math.sqrt(sigma2)) + 1
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        batch = max(64, int(2.2 * (size - filled)))  # the two rejection steps together keep about 0.48
        u = rng.integers(0, t, size=batch, dtype=np.int64)
        keep = rng.random(batch) < np.exp(-u / t)
        x = u + t * np.floor(rng.standard_exponential(batch)).astype(np.int64)
        negative = rng.random(batch) < 0.5
        keep &= ~(negative & (x == 0))
        y = np.where(negative, -x, x)
        keep &= rng.random(batch) < np.exp(-((np.abs(y) - sigma2 / t) ** 2) / (2.0 * sigma2))
        accepted = y[keep][: size - filled]
        out[filled:filled + accepted.size] = accepted
        filled += accepted.size
    return out


def discrete_gaussian_moments(sigma2: float) -> tuple[float, float]:
    """The exact mean (0) and variance of :math:`N_{\\mathbb Z}(0, \\sigma^2)`, by summing the mass function."""
    reach = int(math.ceil(40.0 * math.sqrt(sigma2))) + 2
    support = np.arange(-reach, reach + 1, dtype=np.float64)
    mass = np.exp(-support ** 2 / (2.0 * sigma2))
    mass /= mass.sum()
    return float(np.sum(support * mass)), float(np.sum(support ** 2 * mass))
