r"""Accounting of the distributed discrete Gaussian mechanism (strategy ``distributed_dp``).

Each of :math:`n` parties adds independent discrete Gaussian noise :math:`N_{\mathbb Z}(0, s^2)^d` to
an integer vector; only the sum is released. Kairouz, Liu & Steinke (2021), Proposition 14 (the
Rényi form of their Theorem 1): for integer inputs whose neighbouring sums differ by at most
:math:`\Delta_2` in L2 norm and :math:`\Delta_1` in L1 norm, the released sum satisfies
:math:`(\alpha, \varepsilon(\alpha))`-RDP for every order :math:`\alpha > 1` with

.. math::

    \varepsilon(\alpha) = \min\Big\{
        \tfrac{\alpha}{2}\,\tfrac{\Delta_2^2}{n s^2} + \tau d,\;
        \tfrac{\alpha}{2}\Big(\tfrac{\Delta_2^2}{n s^2} + \tfrac{2 \Delta_1 \tau}{\sqrt n\, s} + \tau^2 d\Big),\;
        \tfrac{\alpha}{2}\Big(\tfrac{\Delta_2}{\sqrt n\, s} + \tau \sqrt d\Big)^2 \Big\},
    \qquad
    \tau = 10 \sum_{k=1}^{n-1} e^{-2 \pi^2 s^2 \frac{k}{k+1}}.

The last two branches are linear in :math:`\alpha`: :math:`\rho`-zCDP with :math:`\rho = \frac12
\varepsilon^2` and :math:`\varepsilon = \min\{\sqrt{\Delta_2^2/(n s^2) + 2 \Delta_1 \tau/(\sqrt n s) +
\tau^2 d},\; \Delta_2/(\sqrt n s) + \tau \sqrt d\}` (their Theorem 1's concentrated-DP statement,
:func:`ddg_rho`). As :math:`\tau \to 0` every branch is the Gaussian mechanism's
:math:`\frac{\alpha}{2} \Delta_2^2 / (n s^2)`.

For integer vectors :math:`\lVert x \rVert_1 \le \lVert x \rVert_2^2`, and :math:`\lVert x \rVert_1
\le \sqrt d \lVert x \rVert_2`, so :math:`\Delta_1 = \min(\Delta_2^2, \sqrt d \Delta_2)` when no
better L1 bound is known (:func:`l1_bound`).

RDP composes additively over rounds; ε at δ uses the conversion the project uses for DP-SGD
(opacus ``get_privacy_spent``: Balle et al. 2020), on opacus' default orders.

Reference: P. Kairouz, Z. Liu, T. Steinke, "The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", ICML 2021 (arXiv:2102.06387), Theorem 1 and
Proposition 14. This module imports neither torch nor opacus at import time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from strategies.accounting.rdp import DEFAULT_RDP_ORDERS, rdp_to_epsilon, subsampled_gaussian_rdp
from strategies.validation import check_positive, check_probability

__all__ = ["ddg_epsilon", "ddg_rdp", "ddg_rho", "ddg_tau", "l1_bound"]


def ddg_tau(local_sigma: float, num_parties: int) -> float:
    r""":math:`\tau = 10 \sum_{k=1}^{n-1} \exp(-2\pi^2 s^2 k/(k+1))` (Kairouz et al. 2021, Theorem 1)."""
    check_positive(local_sigma, "local_sigma")
    if num_parties < 1:
        raise ValueError(f"num_parties must be >= 1, got {num_parties}")
    return 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * local_sigma ** 2 * k / (k + 1)) for k in range(1, num_parties))


def l1_bound(l2: float, dim: int) -> float:
    r"""An L1 sensitivity of integer vectors of L2 norm at most ``l2`` in dimension ``dim``:
    :math:`\min(\Delta_2^2, \sqrt d\, \Delta_2)`."""
    return min(l2 * l2, math.sqrt(dim) * l2)


def _scales(l2: float, l1: float, local_sigma: float, num_parties: int) -> tuple[float, float]:
    check_positive(l2, "l2_sensitivity")
    check_positive(l1, "l1_sensitivity")
    scale = math.sqrt(num_parties) * local_sigma
    return l2 / scale, l1 / scale


def ddg_rdp(orders: Sequence[float], *, l2_sensitivity: float, l1_sensitivity: float, local_sigma: float,
            num_parties: int, dim: int) -> np.ndarray:
    r"""RDP :math:`\varepsilon(\alpha)` of one release of the sum of ``num_parties`` discrete Gaussians
    :math:`N_{\mathbb Z}(0, s^2)^d` (``local_sigma`` = s), at each order (Proposition 14)."""
    l2, l1 = _scales(l2_sensitivity, l1_sensitivity, local_sigma, num_parties)
    tau = ddg_tau(local_sigma, num_parties)
    alphas = np.asarray(orders, dtype=np.float64)
    if np.any(alphas <= 1):
        raise ValueError("RDP orders must be > 1")
    first = alphas / 2.0 * l2 ** 2 + tau * dim
    second = alphas / 2.0 * (l2 ** 2 + 2.0 * l1 * tau + tau ** 2 * dim)
    third = alphas / 2.0 * (l2 + math.sqrt(dim) * tau) ** 2
    return np.minimum(np.minimum(first, second), third)


def ddg_rho(*, l2_sensitivity: float, l1_sensitivity: float, local_sigma: float, num_parties: int, dim: int) -> float:
    r"""ρ of the ρ-zCDP of one release (Theorem 1's branches linear in α): :math:`\frac12 \varepsilon^2`."""
    l2, l1 = _scales(l2_sensitivity, l1_sensitivity, local_sigma, num_parties)
    tau = ddg_tau(local_sigma, num_parties)
    return 0.5 * min(l2 ** 2 + 2.0 * l1 * tau + tau ** 2 * dim, (l2 + math.sqrt(dim) * tau) ** 2)


def ddg_epsilon(*, releases: Sequence[tuple[float, float, float, int, int]], delta: float,
                prior: Sequence[tuple[float, float, int]] = (), orders: Sequence[float] = DEFAULT_RDP_ORDERS) -> float:
    """ε at ``delta`` of the composition (RDP added order by order) of ``prior`` Poisson-subsampled Gaussian
    releases ``(noise multiplier, sample rate, steps)`` (the private set-up) and one distributed discrete
    Gaussian release per entry of ``releases``, ``(l2, l1, local_sigma, num_parties, dim)``; add/remove adjacency."""
    check_probability(delta, "delta")
    alphas = list(orders)
    rdp = np.zeros(len(alphas))
    for l2, l1, local_sigma, parties, dim in releases:
        rdp = rdp + ddg_rdp(alphas, l2_sensitivity=l2, l1_sensitivity=l1, local_sigma=local_sigma,
                            num_parties=int(parties), dim=int(dim))
    for noise, rate, steps in prior:
        rdp = rdp + subsampled_gaussian_rdp(sample_rate=rate, noise_multiplier=noise, steps=steps, orders=alphas)
    if not np.any(rdp > 0):
        return 0.0
    return rdp_to_epsilon(alphas, rdp, delta=delta)


class DistributedAccountant:
    """A site's distributed-discrete-Gaussian position (the accountant interface, :mod:`strategies.accounting.interface`):
    the private set-up's releases (``prior``) and one release per round it was asked for its vector."""

    def __init__(self, *, prior: Sequence[tuple[float, float, int]] = ()) -> None:
        self.prior = tuple((float(noise), float(rate), int(steps)) for noise, rate, steps in prior)
        self.releases: list[tuple[float, float, float, int, int]] = []

    def step(self, *, l2: float, l1: float, local_sigma: float, parties: int, dim: int) -> None:
        """Compose one round's release: the sum of ``parties`` discrete Gaussian shares of std ``local_sigma``."""
        self.releases.append((float(l2), float(l1), float(local_sigma), int(parties), int(dim)))

    def epsilon(self, delta: float) -> float:
        return ddg_epsilon(releases=self.releases, delta=delta, prior=self.prior)

    def state_dict(self) -> dict:
        return {"prior": [list(entry) for entry in self.prior], "releases": [list(entry) for entry in self.releases]}

    @classmethod
    def from_state_dict(cls, state: dict) -> DistributedAccountant:
        accountant = cls(prior=[tuple(entry) for entry in state["prior"]])
        for l2, l1, sigma, parties, dim in state["releases"]:
            accountant.step(l2=l2, l1=l1, local_sigma=sigma, parties=parties, dim=dim)
        return accountant
