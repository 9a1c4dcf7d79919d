r"""Tight accounting with privacy loss distributions (dp-accounting's ``PLDAccountant``).

The privacy loss distribution (PLD) of a mechanism determines its whole ``(ε, δ)`` curve;
composition is the convolution of PLDs, computed numerically on a grid of privacy-loss values
(Koskela, Jälkö, Honkela 2020; Meiser, Mohammadi 2018; Doroshenko, Ghazi, Kamath, Kumar,
Manurangsi 2022). dp-accounting's implementation, used here unchanged, gives an **upper bound**
on the hockey-stick divergence of the composition when every PLD is built with

* ``pessimistic_estimate=True`` (privacy losses rounded up onto the grid, connect-the-dots: the
  discretised PLD dominates the exact one) — ``PLDAccountant``'s default for every event;
* tail mass beyond the truncation bound moved to the infinite privacy loss (counted in δ).

So the ε it returns is sound (never below the true ε of the events) and is tighter than the
Rényi-DP conversion, which loses about 10 % of ε at the budgets this project runs
(``benchmarks/accountants.py``). Smaller grid intervals are tighter and slower; at
:data:`PLD_DISCRETIZATION` (``1e-4``, dp-accounting's default) halving the interval changes ε by
less than ``1e-3`` at the project's settings (a test checks it), and the bias is always upwards.

Events and adjacency
--------------------
A history is a sequence of ``(σ, q, n)``: ``n`` applications of the mechanism that adds
``N(0, σ²C²)`` to a sum of contributions of L2 norm at most ``C``, each record included
independently with probability ``q`` (Poisson sampling; ``q = 1``: no sampling). Adjacency is
**add/remove one**, as for opacus' RDP and PRV accountants. Every entry with ``q = 1`` is a
Gaussian mechanism, and ``n₁`` releases at ``σ₁``, ``n₂`` at ``σ₂``, … compose **exactly** into one
Gaussian mechanism of noise multiplier ``(Σ nᵢ/σᵢ²)^{-1/2}`` (the composed privacy loss is that of
one Gaussian shift of norm ``√(Σ nᵢ/σᵢ²)``; Dong, Roth, Su 2022, Corollary 3.3), which is what
``PLDAccountant`` itself does for a self-composed Gaussian event: the set-up releases are merged
so. Entries with ``q < 1`` are ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` composed ``n``
times. An entry of infinite ``σ`` releases nothing sensitive and costs nothing.

The history is put in a canonical order (:func:`canonical_history`) before it is composed, so
that a site's accountant (which merges equal entries as they come) and the server (which
recomputes the figure from the plan) compose the same events in the same order and obtain the
same float.

References
----------
Doroshenko, Ghazi, Kamath, Kumar, Manurangsi, "Connect the Dots: Tighter Discrete Approximations
of Privacy Loss Distributions", PETS 2022; Koskela, Jälkö, Honkela, "Computing Tight Differential
Privacy Guarantees Using FFT", AISTATS 2020; Google's dp-accounting ``pld`` package.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from strategies.accounting.calibration import calibrate_noise
from strategies.validation import check_count, check_positive, check_probability, check_sample_rate

__all__ = ["PLD_DISCRETIZATION", "calibrate_pld_noise_multiplier", "canonical_history", "pld_epsilon"]

#: The grid interval of the privacy losses (dp-accounting's default; see the module docstring).
PLD_DISCRETIZATION = 1e-4

History = tuple[tuple[float, float, int], ...]


def canonical_history(history: Sequence[tuple[float, float, int]]) -> History:
    """The same composition as ``history``, in canonical form.

    Entries of infinite σ are dropped (free); every ``q = 1`` entry is merged into one Gaussian
    ``((Σ n/σ²)^{-1/2}, 1.0, 1)`` (exact, see the module docstring); ``q < 1`` entries with equal
    ``(σ, q)`` are merged (steps added) and sorted. Raises ``ValueError`` on an invalid entry.
    """
    sampled: dict[tuple[float, float], int] = {}
    gaussian: dict[float, int] = {}  # merged by sigma first: the float is the same however the steps were split
    for noise_multiplier, sample_rate, num_steps in history:
        if math.isinf(noise_multiplier) and noise_multiplier > 0:
            continue
        sigma = check_positive(noise_multiplier, "noise_multiplier")
        rate = check_sample_rate(sample_rate)
        steps = check_count(num_steps, "num_steps")
        if rate == 1.0:
            gaussian[sigma] = gaussian.get(sigma, 0) + steps
        else:
            sampled[(sigma, rate)] = sampled.get((sigma, rate), 0) + steps
    merged = [(sigma, rate, steps) for (sigma, rate), steps in sorted(sampled.items())]
    if gaussian:
        precision = math.fsum(steps / sigma ** 2 for sigma, steps in sorted(gaussian.items()))
        merged.insert(0, (1.0 / math.sqrt(precision), 1.0, 1))
    return tuple(merged)


def pld_epsilon(history: Sequence[tuple[float, float, int]], *, delta: float,
                value_discretization_interval: float = PLD_DISCRETIZATION) -> float:
    r"""ε at ``delta`` of the composition of ``history`` by dp-accounting's ``PLDAccountant``.

    ``history``: ``(σ, q, n)`` entries as in the module docstring; add/remove-one adjacency;
    pessimistic (upper-bound) PLDs. ``0.0`` for an empty history. Memoised on the canonical form.
    """
    delta = check_probability(delta, "delta")
    check_positive(value_discretization_interval, "value_discretization_interval")
    events = canonical_history(history)
    if not events:
        return 0.0
    return _pld_epsilon(events, delta, float(value_discretization_interval))


@functools.lru_cache(maxsize=4096)
def _pld_epsilon(events: History, delta: float, interval: float) -> float:
    """What ``PLDAccountant.compose(event, steps)`` of each event then ``get_epsilon(delta)`` returns, bit for bit
    (the same calls in the same order), with each Poisson-subsampled step's PLD built once (:func:`_sampled_step`)."""
    from dp_accounting.pld import privacy_loss_distribution

    pld = privacy_loss_distribution.identity(value_discretization_interval=interval)
    for sigma, rate, steps in events:
        if rate == 1.0:
            piece = privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(steps), value_discretization_interval=interval,
                neighboring_relation=_add_or_remove())
        else:
            piece = _sampled_step(sigma, rate, interval).self_compose(steps)
        pld = pld.compose(piece)
    return float(pld.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=64)
def _sampled_step(sigma: float, rate: float, interval: float):  # noqa: ANN202 (dp-accounting's PLD)
    """One Poisson-subsampled Gaussian step's PLD, as ``PLDAccountant`` builds it: most of the cost of an ε, and the
    same every round of a site (only the number of steps grows)."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=rate,
        neighboring_relation=_add_or_remove())


def _add_or_remove():  # noqa: ANN202
    import dp_accounting

    return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def calibrate_pld_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                                   prior: Sequence[tuple[float, float, int]] = (), epsilon_tolerance: float = 0.01,
                                   value_discretization_interval: float = PLD_DISCRETIZATION) -> float:
    r"""Noise multiplier σ with ``target − tolerance ≤ ε_PLD(prior + (σ, q, steps)) ≤ target``.

    ``ε_PLD`` is :func:`pld_epsilon` at ``value_discretization_interval`` (decreasing in σ), the
    figure the ledger reports. The search runs first on a grid ten times coarser (cheap PLDs),
    bracketing σ by doubling or halving from 1 and narrowing the bracket by regula falsi in
    ``log σ`` (Illinois variant); it then repeats at the ledger's interval from there, in steps of
    1 %, usually with one evaluation. Every candidate is evaluated at the ledger's interval before
    it is returned, so σ meets the contract whatever the coarse phase found. ``ValueError`` when
    the prior alone spends the target.
    """
    target_epsilon = check_positive(target_epsilon, "target_epsilon")
    check_probability(target_delta, "delta")
    sample_rate = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps")
    interval = check_positive(value_discretization_interval, "value_discretization_interval")
    if not epsilon_tolerance > 0.0:
        raise ValueError(f"epsilon_tolerance must be > 0, got {epsilon_tolerance!r}")
    prior = canonical_history(prior)
    spent = pld_epsilon(prior, delta=target_delta, value_discretization_interval=interval) if prior else 0.0
    if spent >= target_epsilon:
        raise ValueError(f"the releases before training alone spend epsilon {spent:.4g} (PLD) of the target "
                         f"{target_epsilon:g}: nothing is left for training")

    def spend(grid: float) -> Callable[[float], float]:
        return lambda sigma: pld_epsilon((*prior, (sigma, sample_rate, steps)), delta=target_delta,
                                         value_discretization_interval=grid)

    coarse = calibrate_noise(spend(10.0 * interval), target_epsilon, tolerance=epsilon_tolerance)
    return calibrate_noise(spend(interval), target_epsilon, tolerance=epsilon_tolerance, start=coarse,
                           step=math.log(1.01))
