r"""A Rényi-DP privacy filter: the budget a site enforces over requests chosen adaptively (an
:class:`~strategies.accounting.interface.Accountant` that refuses what its budget cannot hold).

A site that does not trust the server with its budget cannot use a composition bound computed for
a fixed plan (PLD, PRV): the server chooses each request after seeing earlier answers. Rényi DP of
one fixed order composes additively under fully adaptive choices of the mechanisms and of their
parameters (Feldman & Zrnic, "Individual Privacy Accounting via a Rényi Filter", NeurIPS 2021,
Thm. 3.1; extended to concurrent interaction by Haney et al., CCS 2023): the interaction that
admits a request only while

.. math::

    \sum_i \rho_i(\alpha) \le B(\alpha)

is :math:`(\alpha, B)`-RDP, whatever the order of requests and their parameters. The filter's
guarantee is then the conversion of that one order,

.. math::

    \varepsilon = B - \frac{\log \delta + \log \alpha}{\alpha - 1} + \log\frac{\alpha - 1}{\alpha}

(Balle et al. 2020, Thm. 21; opacus' ``get_privacy_spent`` at one order). :func:`rdp_budget` is
its inverse. The order is fixed when a filter is created and never changes afterwards (a filter
that picked the best order after the fact would not be a filter); :func:`filter_order` picks the
order at which a Gaussian mechanism could spend the most of ``(ε, δ)``.

Each request is a history of (subsampled) Gaussian releases, ``(noise multiplier, sample rate,
steps)`` as the project's accountants take them; its cost is opacus' ``compute_rdp`` at the
filter's order (add/remove-one adjacency).

Example
-------
>>> f = RenyiFilter(epsilon=1.0, delta=1e-5)   # order 18
>>> f.charge([(10.0, 1.0, 1)])   # one Gaussian release of noise multiplier 10: order / (2 * 10**2)
0.09
>>> f.admits([(1.0, 1.0, 1)])    # a noise multiplier of 1 costs more than the budget
False
>>> round(f.epsilon(), 3)         # the guarantee so far, at the filter's delta
0.54
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from strategies.accounting.calibration import calibrate_noise
from strategies.accounting.rdp import subsampled_gaussian_rdp
from strategies.validation import check_count, check_positive, check_probability, check_sample_rate

__all__ = ["FILTER_ORDERS", "FilterExhausted", "RenyiFilter", "SiteFilter", "epsilon_at_order", "filter_order", "fitting_noise_multiplier",
           "rdp_at_order", "rdp_budget"]

History = Iterable[Sequence[float]]


class FilterExhausted(ValueError):
    """A request the filter cannot admit: its cost would take the spent RDP past the budget."""


def rdp_at_order(history: History, order: float) -> float:
    """Rényi DP at ``order`` of a history of Poisson-subsampled Gaussian releases ``(σ, q, steps)`` (opacus)."""
    total = 0.0
    for noise_multiplier, sample_rate, steps in history:
        check_positive(noise_multiplier, "noise_multiplier")
        check_sample_rate(sample_rate)
        check_count(int(steps), "steps")
        total += float(subsampled_gaussian_rdp(sample_rate=sample_rate, noise_multiplier=noise_multiplier,
                                               steps=int(steps), orders=(order,))[0])
    return total


def epsilon_at_order(rdp: float, order: float, delta: float) -> float:
    """ε at ``delta`` of an ``(order, rdp)``-RDP guarantee (opacus' conversion at one order; 0 when nothing is spent)."""
    check_probability(delta, "delta")
    if order <= 1:
        raise ValueError(f"order must be > 1, got {order}")
    if rdp <= 0:
        return 0.0
    return max(0.0, rdp - (math.log(delta) + math.log(order)) / (order - 1) + math.log((order - 1) / order))


def rdp_budget(epsilon: float, delta: float, order: float) -> float:
    """The largest RDP at ``order`` whose conversion (:func:`epsilon_at_order`) is at most ``epsilon`` (may be < 0:
    no release fits)."""
    check_positive(epsilon, "epsilon")
    check_probability(delta, "delta")
    return epsilon + (math.log(delta) + math.log(order)) / (order - 1) - math.log((order - 1) / order)


#: The orders a filter may take: whole numbers, where the RDP of the subsampled Gaussian is an exact finite sum
#: (opacus and dp-accounting agree to rounding; at fractional orders their series differ in the fourth digit).
FILTER_ORDERS: tuple[int, ...] = tuple(range(2, 257))


def filter_order(epsilon: float, delta: float, orders: Sequence[float] = FILTER_ORDERS) -> float:
    """The order of ``orders`` at which a Gaussian mechanism (RDP linear in the order) can spend most of ``(ε, δ)``:
    the largest ``rdp_budget(ε, δ, α) / α``."""
    return max(orders, key=lambda order: rdp_budget(epsilon, delta, order) / order)


@functools.lru_cache(maxsize=1024)
def fitting_noise_multiplier(*, order: float, budget: float, prior: tuple[tuple[float, float, int], ...],
                             sample_rate: float, steps: int) -> float:
    """The smallest σ (to 0.1 % of the budget) for which ``prior`` and ``steps`` Poisson-subsampled Gaussian steps (σ,
    ``sample_rate``) cost at most ``budget`` at ``order``; ``ValueError`` when ``prior`` alone costs the budget."""
    base = rdp_at_order(prior, order)
    if base >= budget:
        raise ValueError(f"the releases before training alone cost RDP {base:.4g} at order {order:g}, more than the "
                         f"{max(budget, 0.0):.4g} the site's filter has left")
    return calibrate_noise(lambda sigma: base + rdp_at_order([(sigma, sample_rate, steps)], order), budget,
                           tolerance=1e-3 * budget)


class RenyiFilter:
    """A site's Rényi filter: fixed order, budget from ``(epsilon, delta)``, RDP spent so far.

    Parameters are keyword-only. ``order`` (a whole number >= 2, :data:`FILTER_ORDERS`) defaults to
    :func:`filter_order` of the budget; a filter restored from a site's ledger must keep the order it was
    created with.
    """

    def __init__(self, *, epsilon: float, delta: float, order: float | None = None, spent: float = 0.0) -> None:
        self.epsilon_limit = check_positive(epsilon, "epsilon")
        self.delta = check_probability(delta, "delta")
        self.order = float(filter_order(epsilon, delta) if order is None else order)
        if self.order != int(self.order) or self.order < 2:
            raise ValueError(f"order must be a whole number >= 2, got {self.order}")
        if spent < 0:
            raise ValueError(f"spent RDP must be >= 0, got {spent}")
        self.spent = float(spent)

    @property
    def budget(self) -> float:
        """The RDP at :attr:`order` the filter admits in all."""
        return rdp_budget(self.epsilon_limit, self.delta, self.order)

    def epsilon(self, delta: float | None = None) -> float:
        """The filter's guarantee for what it admitted so far: ε at ``delta`` (default :attr:`delta`) of the spent RDP."""
        return epsilon_at_order(self.spent, self.order, self.delta if delta is None else delta)

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> float:
        """:meth:`charge` one release (the accountant interface, :mod:`strategies.accounting.interface`)."""
        return self.charge([(noise_multiplier, sample_rate, num_steps)])

    def cost(self, history: History) -> float:
        """The RDP at :attr:`order` of a request (:func:`rdp_at_order`)."""
        return rdp_at_order(history, self.order)

    def admits(self, history: History) -> bool:
        """Whether the request fits what is left of the budget."""
        return self.spent + self.cost(history) <= self.budget

    def charge(self, history: History) -> float:
        """Admit the request and add its cost (returned), or raise :class:`FilterExhausted` and change nothing."""
        cost = self.cost(history)
        if self.spent + cost > self.budget:
            raise FilterExhausted(
                f"the request costs RDP {cost:.4g} at order {self.order:g}, and {self.spent:.4g} of the budget "
                f"{max(self.budget, 0.0):.4g} is spent: it would take the filter to epsilon "
                f"{epsilon_at_order(self.spent + cost, self.order, self.delta):.3f} > {self.epsilon_limit:g} at "
                f"delta {self.delta:g}")
        self.spent += cost
        return cost

    def state_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon_limit, "delta": self.delta, "order": self.order, "spent": self.spent}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RenyiFilter:
        return cls(epsilon=float(state["epsilon"]), delta=float(state["delta"]), order=float(state["order"]),
                   spent=float(state["spent"]))


@dataclass(frozen=True)
class SiteFilter:
    """A site's Rényi filter at the start of a run: its order, the RDP spent before the run, its limit (ε, δ), and
    the honest sites (itself included) whose noise shares it counts on in a secure sum (1: its own alone)."""

    order: float
    spent: float
    epsilon: float
    delta: float
    honest_sites: float = 1.0

    @property
    def remaining(self) -> float:
        """The RDP at :attr:`order` the run may spend."""
        return rdp_budget(self.epsilon, self.delta, self.order) - self.spent

    def epsilon_after(self, history: Sequence[tuple[float, float, int]]) -> float:
        """The filter's ε once ``history`` (the run's releases so far) is charged."""
        return epsilon_at_order(self.spent + rdp_at_order(history, self.order), self.order, self.delta)
