"""Bayesian differential privacy (FSL-BDP) accountant for DP-SGD at one site.

After Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020
(arXiv:1901.09697), and FSL-BDP (arXiv:2601.11134), Algorithm 2, with one parametrisation
throughout:

* the mechanism is the DP-SGD step: Poisson sampling with rate ``q``, per-sample gradients
  clipped to ``C``, Gaussian noise of standard deviation ``s = σ·C`` added to the **sum** of the
  clipped gradients;
* the privacy cost of a step is driven by the distances ``d`` between the sums of clipped
  gradients of neighbouring batches, measured on the same scale as the sum that receives the
  noise. Two adjacencies are offered (:data:`ADJACENCIES`):

  - ``"add-remove"`` (default; the adjacency of opacus and of classical DP-SGD): the neighbour
    lacks one record ``i``, so ``d_i = ||clip(g_i)||`` ≤ ``C``;
  - ``"replace-one"`` (FSL-BDP and the reference code): record ``i`` is replaced by record
    ``j``, so ``d_ij = ||clip(g_i) − clip(g_j)||`` ≤ ``2C``.

  (The reference code measures leave-one-out *batch means* while the noise is added to the sum,
  which under-states ε_μ by about the batch size; this module does not.)

Per order ``λ`` (an integer ≥ 1; the Rényi order is ``α = λ + 1``) and distance ``d`` the cost
is the rule of Triastcyn & Faltings' Theorem 2 and FSL-BDP's Algorithm 2 (lines 25–27)::

    c_L(λ; d) = log E_{K ~ Bin(λ+1, q)} exp(K(K−1) d² / (2 s²)),
    c_R(λ; d) = log E_{K ~ Bin(λ, q)}   exp(K(K+1) d² / (2 s²)),
    c(λ; d)   = max(c_L(λ; d), c_R(λ; d)),

taken per sampled distance; an upper confidence bound ``ĉ(λ)`` of ``c`` over the sampled
distances is accumulated, ``C(λ) += ĉ(λ)``, and

    ε_μ = min_λ (C(λ) − log β) / λ,    δ_μ = β + γ,

with ``γ = 1 − Π_t (1 − γ_step)`` the total failure probability of the estimator (≤ Σ γ_step).

What the two terms are. With ``μ0 = N(0, s²I)`` and ``μ1 = N(d·e, s²I)`` the noisy sum without
and with the record, and ``ν = (1−q)μ0 + qμ1`` (the record is sampled with probability ``q``):
``c_L = log E_μ0[(ν/μ0)^(λ+1)] = λ·D_{λ+1}(ν‖μ0)``, which for ``d = C`` is ``λ·RDP_{λ+1}`` of
opacus' Poisson-subsampled Gaussian (add/remove-one, sensitivity ``C``); and
``c_R = log E_μ1[(ν/μ0)^λ]``, the same moment of the privacy loss given that the record was
sampled. Conditioning ``K ~ Bin(λ+1, q)`` on its last trial gives
``exp c_L(λ) = (1−q)·exp c_L(λ−1) + q·exp c_R(λ)`` (``c_L(0) = 0``), and ``c_L`` grows with
``λ``, so ``c_R ≥ c_L`` for every ``d`` and ``q`` (equal only for ``d = 0`` or ``q = 1``): the
maximum is always the right term. The rule is conservative: under add/remove ``c_L`` alone is
the exact Rényi bound of the pair, and it also bounds the other direction
``λ·D_{λ+1}(μ0‖ν)`` (Mironov, Talwar & Zhang 2019: ``A_α ≥ B_α``), while
``c_R ≈ λq·(exp(d²/s²) − 1)`` is of first order in ``q`` where ``c_L`` is of second order, i.e.
most of the amplification by subsampling is given up. (Triastcyn & Faltings' code computes its
right term by swapping the two Gaussians inside the same ``Bin(λ+1, q)`` expectation, which for
equal variances gives ``c_L`` again; the rule here is the one their theorem and FSL-BDP state.)

ε_μ bounds the tail of the privacy loss, so costs become ε by the Chernoff/Mironov conversion
``min_λ (C(λ) − log β)/λ``; opacus' classical ε uses the tighter conversion of Balle et al.
(2020) on the smaller ``c_L``. With every record's gradient clipped (``d = C``) ε_μ is therefore
well above the classical ε of the same ``(σ, q, steps)``, the more so the smaller ``q``: at
``ε_μ ≈ 1`` and ``β = δ = 1e-5``, about 1.3 times at ``q = 0.5`` (40 steps), 1.6 times at
``q = 0.1`` (200 steps) and 3.5 times at ``q = 0.01`` (2,000 steps). It is lower only when most
distances are well below ``C``. Under ``"replace-one"`` the worst case of the same bound is
``d = 2C``, which costs what ``d = C`` costs at noise multiplier ``σ/2``; the add/remove RDP of
``σ/2`` is the classical ε to report beside a replace-one ε_μ.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import gammaln, xlog1py, xlogy

from strategies.accounting.calibration import calibrate_noise
from strategies.validation import (
    check_choice,
    check_count,
    check_positive,
    check_probability,
    check_sample_rate,
    is_tensor,
)

#: Default grid of orders λ (Rényi order α = λ + 1).
DEFAULT_ORDERS: tuple[int, ...] = (2, 4, 8, 16, 32, 64)

#: Default per-step failure probability of the UCB estimator.
DEFAULT_GAMMA_STEP: float = 1e-12

#: Neighbouring-dataset relations the accountant supports (see the module docstring).
ADJACENCIES: tuple[str, ...] = ("add-remove", "replace-one")

#: Terms of the per-distance cost (module docstring): ``"left"`` ``c_L``, ``"right"`` ``c_R``,
#: ``"max"`` their maximum ``c``, the cost the accountant accumulates.
COST_SIDES: tuple[str, ...] = ("left", "right", "max")

#: The per-distance cost rule, recorded in :meth:`BayesianAccountant.state_dict` so that costs
#: accumulated under another rule are never continued under this one.
COST_RULE: str = "max(c_L, c_R)"


# --------------------------------------------------------------------------------------------
# numeric and validation helpers
# --------------------------------------------------------------------------------------------


def logsumexp(values: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """``log Σ exp(values)`` along ``axis``, stably (plain numpy; scipy's version costs ~0.4 ms
    per call in overhead, and the accountant calls it a dozen times per training step)."""
    values = np.asarray(values, dtype=np.float64)
    peak = np.max(values, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    result = np.log(np.sum(np.exp(values - peak), axis=axis, keepdims=True)) + peak
    return result.item() if axis is None else np.squeeze(result, axis=axis)


@functools.lru_cache(maxsize=64)
def _student_t_isf(gamma_step: float, df: int) -> float:
    from scipy.stats import t as student_t  # here, not at the top: scipy.stats costs every process 0.6 s to import

    return float(student_t.isf(gamma_step, df=df))


def _check_orders(orders: Sequence[int]) -> tuple[int, ...]:
    checked = tuple(check_count(order, "order") for order in orders)
    if not checked:
        raise ValueError("orders must not be empty")
    if len(set(checked)) != len(checked):
        raise ValueError(f"orders must be distinct, got {checked}")
    return checked


def check_adjacency(adjacency: str) -> str:
    """``adjacency`` if it is one of :data:`ADJACENCIES`, else ``ValueError``."""
    return check_choice(adjacency, ADJACENCIES, "adjacency")


def _as_distances(distances: Any) -> np.ndarray:
    array = np.asarray(
        distances.detach().cpu().double().numpy() if is_tensor(distances) else distances,
        dtype=np.float64,
    ).reshape(-1)
    if array.size == 0:
        raise ValueError("distances must not be empty")
    if not np.all(np.isfinite(array)) or np.any(array < 0.0):
        raise ValueError("distances must be finite and >= 0")
    return array


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------


def pairwise_distances(clipped_grads: Any) -> np.ndarray:
    r"""Euclidean distances between all pairs of per-sample clipped gradients.

    Parameters
    ----------
    clipped_grads : torch.Tensor or numpy.ndarray, shape (M, P) (or (M, ...), flattened)
        ``M ≥ 2`` per-sample gradients, each already clipped to norm ``C`` (the same clipped
        gradients whose sum receives the noise).

    Returns
    -------
    numpy.ndarray, shape (M(M−1)/2,)
        ``||g_i − g_j||_2`` for all ``i < j`` in row-major order (float64).

    References
    ----------
    Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020, §4.
    """
    import torch  # the gradients' own library, imported where distances are computed (at a site)

    # Computed in the gradients' own precision (float32 from training: a distance of norms <= 2C
    # carries a relative error ~1e-7), returned as float64.
    array = clipped_grads.detach().cpu() if is_tensor(clipped_grads) else torch.as_tensor(np.asarray(clipped_grads))
    if array.ndim < 2:
        raise ValueError(f"clipped_grads must have shape (M, P), got {tuple(array.shape)}")
    array = array.reshape(array.shape[0], -1)
    if array.shape[0] < 2:
        raise ValueError(f"need at least 2 per-sample gradients, got {array.shape[0]}")
    distances = torch.pdist(array).double().numpy()  # same pair order as scipy's pdist
    if not np.all(np.isfinite(distances)):
        raise ValueError("clipped_grads must be finite")
    return distances


def neighbour_distances(clipped_grads: Any, *, adjacency: str) -> np.ndarray:
    r"""Distances between the clipped-gradient sums of neighbouring batches.

    Parameters
    ----------
    clipped_grads : torch.Tensor or numpy.ndarray, shape (M, P)
        Per-sample gradients of ``M`` records of the batch, each clipped to norm ``C``.
    adjacency : {"add-remove", "replace-one"}
        ``"add-remove"``: ``||clip(g_i)||`` for each record (``M`` values, ``M ≥ 1``);
        ``"replace-one"``: :func:`pairwise_distances` (``M(M−1)/2`` values, ``M ≥ 2``).

    Returns
    -------
    numpy.ndarray
        The distances (float64).

    References
    ----------
    Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020, §4.
    """
    if check_adjacency(adjacency) == "replace-one":
        return pairwise_distances(clipped_grads)
    import torch  # as in pairwise_distances

    array = clipped_grads.detach().cpu() if is_tensor(clipped_grads) else torch.as_tensor(np.asarray(clipped_grads))
    if array.ndim < 2 or array.shape[0] < 1:
        raise ValueError(f"clipped_grads must have shape (M, P) with M >= 1, got {tuple(array.shape)}")
    norms = torch.linalg.vector_norm(array.reshape(array.shape[0], -1), dim=1).double().numpy()
    if not np.all(np.isfinite(norms)):
        raise ValueError("clipped_grads must be finite")
    return norms


def distances_from_gram(gram: Any, *, adjacency: str) -> np.ndarray:
    r""":func:`neighbour_distances` from the Gram matrix ``G_ij = ⟨clip(g_i), clip(g_j)⟩``.

    ``"add-remove"``: ``sqrt(G_ii)``; ``"replace-one"``: ``sqrt(G_ii + G_jj − 2 G_ij)`` for
    ``i < j`` in row-major order (that of :func:`pairwise_distances`). Lets DP-SGD hand over the
    M×M inner products it can compute from its per-layer factors instead of M per-sample
    gradients (:meth:`strategies.mechanisms.dp_sgd_training.GhostPerSample.gram`). Pass a float64 Gram
    matrix: the replace-one form subtracts nearly equal numbers for nearby gradients.

    References
    ----------
    Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020, §4.
    """
    matrix = gram.detach().cpu().double().numpy() if is_tensor(gram) else np.asarray(gram, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 1:
        raise ValueError(f"gram must be a square (M, M) matrix, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ValueError("gram must be finite")
    diagonal = np.diag(matrix)
    if check_adjacency(adjacency) == "add-remove":
        return np.sqrt(np.maximum(diagonal, 0.0))
    if matrix.shape[0] < 2:
        raise ValueError("replace-one distances need at least 2 records")
    upper_i, upper_j = np.triu_indices(matrix.shape[0], k=1)
    squared = diagonal[upper_i] + diagonal[upper_j] - 2.0 * matrix[upper_i, upper_j]
    return np.sqrt(np.maximum(squared, 0.0))


def classical_noise_multiplier(noise_multiplier: float, *, adjacency: str) -> float:
    r"""Noise multiplier of the classical (opacus, add/remove) ε to report beside ε_μ.

    The per-distance cost :func:`log_binomial_cost` depends on ``d/s`` only and grows with
    ``d``; the largest possible distance is ``C`` under add/remove (classical DP-SGD: noise
    multiplier ``σ``) and ``2C`` under replace-one, which costs what ``C`` costs at noise
    multiplier ``σ/2``. The classical figure is opacus' RDP of that multiplier; it uses ``c_L``
    (the exact Rényi bound), not the larger ``c_R`` of the Bayesian rule.

    References
    ----------
    Triastcyn & Faltings, ICML 2020, Theorem 2; Mironov, Talwar, Zhang, arXiv:1908.10530.
    """
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    return noise_multiplier / 2.0 if check_adjacency(adjacency) == "replace-one" else noise_multiplier


def log_binomial_cost(
    order: int, distance: Any, *, sample_rate: float, noise_std: float, side: str = "max"
) -> float | np.ndarray:
    r"""Per-step privacy cost of the Poisson-subsampled Gaussian for distance ``d``.

    .. math::

        c_L(λ; d) &= \log \mathbb{E}_{K \sim \mathrm{Bin}(λ+1, q)}
                    \exp\!\Big(\frac{K(K-1)\, d^2}{2 s^2}\Big), \qquad
        c_R(λ; d)  = \log \mathbb{E}_{K \sim \mathrm{Bin}(λ, q)}
                    \exp\!\Big(\frac{K(K+1)\, d^2}{2 s^2}\Big), \\
        c(λ; d)   &= \max\big(c_L(λ; d),\, c_R(λ; d)\big),

    each a ``logsumexp`` over ``k`` of ``log P(K = k) + k(k∓1) d²/(2s²)`` (no overflow for
    large ``λ`` or ``d/s``). ``c`` is what :class:`BayesianAccountant` accumulates; it always
    equals ``c_R`` (``c_R ≥ c_L``, module docstring). For ``d = C`` and ``s = σC``, ``c_L``
    equals ``λ·RDP_{λ+1}`` of the subsampled Gaussian (``log A_α`` in Mironov et al.), i.e.
    opacus' ``_compute_rdp(q, σ, 1, [λ+1])·λ``.

    Parameters
    ----------
    order : int
        λ ≥ 1 (Rényi order ``α = λ + 1``).
    distance : float or array_like
        Distance(s) ``d ≥ 0`` between clipped gradients.
    sample_rate : float
        Poisson sampling rate ``q`` in (0, 1].
    noise_std : float
        Standard deviation ``s = σ·C`` of the noise on the sum of clipped gradients.
    side : {"max", "left", "right"}
        ``c`` (default), ``c_L`` or ``c_R``.

    Returns
    -------
    float or numpy.ndarray
        The cost (shape of ``distance``; a float for a scalar).

    References
    ----------
    Triastcyn & Faltings, ICML 2020, Theorem 2 (subsampled Gaussian); FSL-BDP (arXiv:2601.11134),
    Algorithm 2, lines 25–27; Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled
    Gaussian Mechanism", arXiv:1908.10530, §3.3.
    """
    order = check_count(order, "order")
    sample_rate = check_sample_rate(sample_rate)
    noise_std = check_positive(noise_std, "noise_std")
    side = check_choice(side, COST_SIDES, "side")
    scalar = np.ndim(distance) == 0 and not is_tensor(distance)
    d = np.asarray(
        distance.detach().cpu().double().numpy() if is_tensor(distance) else distance,
        dtype=np.float64,
    )
    if not np.all(np.isfinite(d)) or np.any(d < 0.0):
        raise ValueError("distance must be finite and >= 0")
    sides = _side_costs(d.reshape(-1), (order,), sample_rate, noise_std)[:, :, 0]  # (M, 2)
    result = (sides.max(axis=1) if side == "max" else sides[:, COST_SIDES.index(side)]).reshape(d.shape)
    return float(result) if scalar else result


def ucb_cost(costs_per_pair: Any, *, total_steps: int, gamma_step: float) -> float:
    r"""Student-t upper confidence bound on a step's cost over the sampled pairs.

    With ``L_i = T·c_i`` for the ``M`` pair costs ``c_i`` and ``T = total_steps`` (Hölder
    correction of the reference code), let ``m = mean_i exp(L_i)`` and
    ``S = sqrt(mean_i (exp(L_i) − m)²)`` (population standard deviation). Then

    .. math::

        \hat c = \frac{1}{T}\,\log\Big(m + t_{M-1}^{-1}(1-γ_{step})\,\frac{S}{\sqrt{M-1}}\Big),

    which bounds ``(1/T)·log E[exp(T·c)]`` with probability ``1 − γ_step``. Everything is
    evaluated in log space (``m`` and ``S`` via ``max_i L_i`` and ``logsumexp``) and the
    quantile with ``t.isf(γ_step)`` (exact for tiny ``γ_step``, where ``1 − γ_step`` rounds to 1).
    With zero variance the bound is ``log(m)/T`` exactly. With a single pair there is no
    variance estimate: ``c_1`` is returned with a warning (no confidence inflation possible;
    use ≥ 3 pairs as the reference code requires).

    Parameters
    ----------
    costs_per_pair : array_like, shape (M,)
        ``c(λ; d_i)`` (:func:`log_binomial_cost`) for the sampled pairs at one order λ.
    total_steps : int
        ``T``, the total number of steps the accountant will compose (an upper bound is safe).
    gamma_step : float
        Per-step failure probability ``γ_step`` in (0, 1).

    Returns
    -------
    float
        ``ĉ``.

    References
    ----------
    Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020,
    Theorem 3 and the authors' code (``bayesian_privacy_accountant.py``, ``_compute_bdp``).
    """
    costs = np.asarray(costs_per_pair, dtype=np.float64).reshape(-1)
    if costs.size == 0:
        raise ValueError("costs_per_pair must not be empty")
    if np.any(np.isnan(costs)):
        raise ValueError("costs_per_pair must not contain NaN")
    total_steps = check_count(total_steps, "total_steps")
    gamma_step = check_probability(gamma_step, "gamma_step")
    return float(_ucb(costs[:, None], np.ones(costs.size), total_steps=total_steps, gamma_step=gamma_step)[0])


@functools.lru_cache(maxsize=64)
def _log_binomial_table(orders: tuple[int, ...], sample_rate: float) -> tuple[np.ndarray, ...]:
    """The terms of ``c_L`` and ``c_R`` for every order, laid end to end in segments (left, λ_1),
    …, (left, λ_m), (right, λ_1), …: ``log P(K = k)`` (``K ~ Bin(λ+1, q)`` left, ``Bin(λ, q)``
    right), the exponent's factor ``k(k−1)/2`` or ``k(k+1)/2``, and each segment's start and
    length (only the ``k`` a segment has: no ``−inf`` padding to exponentiate)."""
    log_pmf, factors = [], []
    for trials_beyond_order, shift in ((1, -1.0), (0, 1.0)):
        for order in orders:
            n = order + trials_beyond_order
            k = np.arange(n + 1, dtype=np.float64)
            log_pmf.append(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
                           + xlogy(k, sample_rate) + xlog1py(n - k, -sample_rate))
            factors.append(k * (k + shift) / 2.0)
    lengths = np.array([segment.size for segment in log_pmf])
    table = (np.concatenate(log_pmf), np.concatenate(factors), np.cumsum(lengths) - lengths, lengths)
    for array in table:
        array.setflags(write=False)
    return table


def step_costs(
    distances: Any,
    *,
    orders: Sequence[int],
    sample_rate: float,
    noise_std: float,
    total_steps: int,
    gamma_step: float,
) -> np.ndarray:
    r"""``ĉ(λ)`` for every order: :func:`ucb_cost` of :func:`log_binomial_cost` over the distances.

    The per-distance cost is ``c = max(c_L, c_R)``, the maximum taken for each distance before
    the upper confidence bound (FSL-BDP, Algorithm 2, lines 27–29). The figures of
    ``[ucb_cost(log_binomial_cost(λ, d, ...), ...) for λ in orders]`` (the same code), computed
    for all orders and the distinct distances in one array pass: the accountant calls this
    before every training step.

    Parameters
    ----------
    distances : array_like, shape (M,)
        Sampled neighbour distances (:func:`neighbour_distances`).
    orders, sample_rate, noise_std, total_steps, gamma_step
        As in :func:`log_binomial_cost` and :func:`ucb_cost`.

    Returns
    -------
    numpy.ndarray, shape (len(orders),)

    References
    ----------
    Triastcyn & Faltings, ICML 2020, §4, Theorems 2 and 3; FSL-BDP (arXiv:2601.11134), Algorithm 2.
    """
    d = _as_distances(distances)
    orders = _check_orders(orders)
    sample_rate = check_sample_rate(sample_rate)
    noise_std = check_positive(noise_std, "noise_std")
    total_steps = check_count(total_steps, "total_steps")
    gamma_step = check_probability(gamma_step, "gamma_step")
    # Distinct values with their multiplicities (under add/remove most records are clipped to
    # exactly C): the same mean and variance as over all M, fewer exponentials.
    values, counts = np.unique(d, return_counts=True)
    return _ucb(_costs(values, orders, sample_rate, noise_std), counts, total_steps=total_steps,
                gamma_step=gamma_step)


def _side_costs(values: np.ndarray, orders: tuple[int, ...], sample_rate: float, noise_std: float) -> np.ndarray:
    """``c_L`` and ``c_R`` (:func:`log_binomial_cost`) for every distance and order: shape
    (len(values), 2, len(orders)); a log-sum-exp per segment of :func:`_log_binomial_table`."""
    log_pmf, factors, starts, lengths = _log_binomial_table(orders, sample_rate)
    terms = log_pmf + np.multiply.outer((values / noise_std) ** 2, factors)  # (values, all k of all segments)
    peak = np.maximum.reduceat(terms, starts, axis=1)  # finite: every segment has a k with P(K = k) > 0
    sums = np.add.reduceat(np.exp(terms - np.repeat(peak, lengths, axis=1)), starts, axis=1)
    return (np.log(sums) + peak).reshape(values.size, 2, len(orders))


def _costs(values: np.ndarray, orders: tuple[int, ...], sample_rate: float, noise_std: float) -> np.ndarray:
    """``c = max(c_L, c_R)`` for every distance and order: shape (len(values), len(orders))."""
    return _side_costs(values, orders, sample_rate, noise_std).max(axis=1)


def _ucb(costs: np.ndarray, counts: np.ndarray, *, total_steps: int, gamma_step: float) -> np.ndarray:
    """:func:`ucb_cost` per column of ``costs`` (shape (U, orders)), row ``u`` counted ``counts[u]`` times."""
    count = int(counts.sum())
    if count == 1:
        warnings.warn("a single distance gives no variance estimate; the UCB falls back to its cost",
                      RuntimeWarning, stacklevel=3)
        return costs[0].astype(np.float64)
    infinite = np.isposinf(costs).any(axis=0)
    samples = total_steps * np.where(np.isposinf(costs), 0.0, costs).T  # (orders, U)
    weights = counts / count
    log_mean = logsumexp(samples + np.log(weights), axis=1)
    peak = samples.max(axis=1)
    scaled = np.exp(samples - peak[:, None])
    variance_scaled = ((scaled - (scaled @ weights)[:, None]) ** 2) @ weights
    with np.errstate(divide="ignore"):
        log_penalty = (math.log(_student_t_isf(gamma_step, count - 1)) + peak + 0.5 * np.log(variance_scaled)
                       - 0.5 * math.log(count - 1))
    bound = np.where(variance_scaled > 0.0, np.logaddexp(log_mean, log_penalty), log_mean) / total_steps
    return np.where(infinite, math.inf, bound)


def epsilon_mu(total_costs: Any, orders: Sequence[int], *, beta: float) -> float:
    r"""Bayesian ε from accumulated costs: ``ε_μ = min_λ (C(λ) − log β) / λ``.

    References
    ----------
    Triastcyn & Faltings, ICML 2020, Theorem 1 (with the Rényi-to-(ε, δ) step of Mironov 2017).
    """
    orders = _check_orders(orders)
    beta = check_probability(beta, "beta")
    costs = np.asarray(total_costs, dtype=np.float64).reshape(-1)
    if costs.shape != (len(orders),):
        raise ValueError(f"need one cost per order ({len(orders)}), got shape {costs.shape}")
    return float(np.min((costs - math.log(beta)) / np.asarray(orders, dtype=np.float64)))


def project_epsilon_mu(
    *,
    noise_multiplier: float,
    distances: Any,
    sample_rate: float,
    steps: int,
    clip_norm: float,
    beta: float,
    gamma_step: float = DEFAULT_GAMMA_STEP,
    orders: Sequence[int] = DEFAULT_ORDERS,
    prior_costs: Any = None,
) -> float:
    r"""ε_μ after ``steps`` identical steps whose pair distances follow ``distances``.

    ``C(λ) = prior(λ) + steps · ĉ(λ)`` with ``ĉ`` from :func:`step_costs` at ``s = σ·C`` and
    ``T = steps`` (the accountant's rule: the UCB of ``max(c_L, c_R)``); then :func:`epsilon_mu`.
    ``prior_costs``: per-order costs spent before training (e.g. :func:`gaussian_release_costs`
    of the federation's set-up releases); none by default.

    References
    ----------
    Triastcyn & Faltings, ICML 2020, §4; FSL-BDP (arXiv:2601.11134), Algorithm 2.
    """
    steps = check_count(steps, "steps")
    noise_std = check_positive(noise_multiplier, "noise_multiplier") * check_positive(
        clip_norm, "clip_norm"
    )
    costs = step_costs(
        distances, orders=orders, sample_rate=sample_rate, noise_std=noise_std,
        total_steps=steps, gamma_step=gamma_step,
    )
    prior = np.zeros(len(orders)) if prior_costs is None else np.asarray(prior_costs, dtype=np.float64)
    return epsilon_mu(prior + steps * costs, orders, beta=beta)


def gaussian_release_costs(noise_multipliers: Sequence[float], orders: Sequence[int] = DEFAULT_ORDERS) -> np.ndarray:
    r"""Per-order costs of Gaussian releases without subsampling, to compose with the Bayesian accountant.

    A Gaussian mechanism of noise multiplier :math:`z` (noise std over L2 sensitivity) released
    once (:math:`q = 1`) has cost :math:`c(λ) = λ(λ+1)/(2z^2)` at every distance up to its
    sensitivity (both terms of :func:`log_binomial_cost` coincide at :math:`q = 1`; it is
    :math:`λ` times the Gaussian RDP :math:`α/(2z^2)` at :math:`α = λ + 1`); the costs of several
    releases add. A multiplier of ``inf`` (an exact release of something that does not change
    between neighbours) costs nothing.

    References
    ----------
    Mironov, "Rényi Differential Privacy", CSF 2017, Proposition 7 and Corollary 3.
    """
    orders = _check_orders(orders)
    lam = np.asarray(orders, dtype=np.float64)
    inverse_square = sum(0.0 if math.isinf(z) else 1.0 / check_positive(z, "noise_multiplier") ** 2
                         for z in noise_multipliers)
    return lam * (lam + 1.0) / 2.0 * inverse_square


def calibrate_noise_for_bdp(
    *, target_epsilon_mu: float, beta: float, distances_pilot: Any, sample_rate: float, steps: int, clip_norm: float,
    gamma_step: float = DEFAULT_GAMMA_STEP, orders: Sequence[int] = DEFAULT_ORDERS, tolerance: float = 1e-3,
    max_noise_multiplier: float = 1e4, prior_costs: Any = None,
) -> float:
    r"""Smallest σ whose projected ε_μ after ``steps`` steps meets ``target_epsilon_mu``.

    :func:`~strategies.accounting.calibration.calibrate_noise` (ε_μ is non-increasing in σ) on
    :func:`project_epsilon_mu` with the pilot distance distribution, i.e. under the cost rule the
    accountant and its budget filter apply (:func:`step_costs`: the UCB of ``max(c_L, c_R)``). The
    result satisfies ``target − tolerance ≤ ε_μ(σ) ≤ target``.

    Parameters
    ----------
    target_epsilon_mu : float
        Target Bayesian ε.
    beta : float
        β of ``δ_μ = β + γ``.
    distances_pilot : array_like
        Pilot pairwise distances of clipped gradients (e.g. from the first batch).
    sample_rate, steps, clip_norm : float, int, float
        ``q``, total number of steps, clipping norm ``C``.
    gamma_step, orders : float, sequence of int
        As in :class:`BayesianAccountant`.
    tolerance : float
        Acceptable shortfall of ε_μ below the target.
    max_noise_multiplier : float
        Give up (``ValueError``) if even this σ misses the target.
    prior_costs : array_like, optional
        Per-order costs spent before training (:func:`project_epsilon_mu`).

    Returns
    -------
    float
        The noise multiplier σ (noise std ``σ·C`` on the sum).

    References
    ----------
    Triastcyn & Faltings, ICML 2020, §4.
    """
    target = check_positive(target_epsilon_mu, "target_epsilon_mu")
    tolerance = check_positive(tolerance, "tolerance")
    pilot = _as_distances(distances_pilot)
    if np.all(pilot == 0.0):
        raise ValueError("all pilot distances are 0: the cost does not depend on sigma")

    def project(sigma: float) -> float:
        return project_epsilon_mu(
            noise_multiplier=sigma, distances=pilot, sample_rate=sample_rate, steps=steps,
            clip_norm=clip_norm, beta=beta, gamma_step=gamma_step, orders=orders, prior_costs=prior_costs,
        )

    if project(max_noise_multiplier) > target:
        raise ValueError(
            f"target_epsilon_mu={target} not reached with noise_multiplier <= {max_noise_multiplier}; the budget is "
            "too small (−log β / max λ bounds ε_μ from below)")
    return calibrate_noise(project, target, tolerance=tolerance)


# --------------------------------------------------------------------------------------------
# stateful accountant
# --------------------------------------------------------------------------------------------


class BayesianAccountant:
    r"""Bayesian (average-case) accountant for DP-SGD at one site.

    Each :meth:`step` adds ``ĉ(λ)`` (:func:`step_costs`: the upper confidence bound of the
    per-distance cost ``max(c_L, c_R)``, module docstring) to ``C(λ)`` for every order in the grid
    and multiplies the estimator's confidence by ``1 − γ_step``. Then
    ``ε_μ(β) = min_λ (C(λ) − log β)/λ`` and ``δ_μ(β) = β + γ``,
    ``γ = 1 − Π (1 − γ_step)``. Unit: one record; the guarantee is average-case over the data
    distribution (neighbouring records drawn from it), not worst-case.

    Parameters
    ----------
    orders : sequence of int
        Orders λ ≥ 1 (Rényi order α = λ + 1); default ``(2, 4, 8, 16, 32, 64)``.
    adjacency : {"add-remove", "replace-one"}
        Which neighbouring datasets the distances describe (:func:`neighbour_distances`).
    prior_costs : array_like, optional
        Per-order costs spent before the first step (releases composed with training, e.g.
        :func:`gaussian_release_costs` of the set-up statistics); they count in ``ε_μ`` and in
        the budget filter but not in ``spent_steps``.

    References
    ----------
    Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020;
    FSL-BDP (arXiv:2601.11134), Algorithm 2.
    """

    unit: str = "record"
    guarantee: str = "average-case"
    mechanism: str = "bdp"
    cost_rule: str = COST_RULE

    def __init__(self, orders: Sequence[int] = DEFAULT_ORDERS, *, adjacency: str = "add-remove",
                 prior_costs: Any = None) -> None:
        self.orders: tuple[int, ...] = _check_orders(orders)
        self.adjacency: str = check_adjacency(adjacency)
        self.total_costs: np.ndarray = (np.zeros(len(self.orders), dtype=np.float64) if prior_costs is None
                                        else np.asarray(prior_costs, dtype=np.float64).copy())
        if self.total_costs.shape != (len(self.orders),):
            raise ValueError(f"prior_costs needs one cost per order ({len(self.orders)})")
        self.log_confidence: float = 0.0  # Σ log(1 − γ_step)
        self.spent_steps: int = 0
        self.last_costs: np.ndarray | None = None

    def step(
        self,
        *,
        sample_rate: float,
        noise_std: float,
        total_steps: int,
        gamma_step: float = DEFAULT_GAMMA_STEP,
        clipped_grads: Any = None,
        distances: Any = None,
        num_steps: int = 1,
    ) -> np.ndarray:
        """Account ``num_steps`` step(s) whose neighbours are given by ``clipped_grads`` or ``distances``.

        Exactly one of ``clipped_grads`` (shape (M, P); distances by :func:`neighbour_distances`
        under the accountant's adjacency) or ``distances`` must be given.
        ``noise_std`` is ``s = σ·C`` on the sum. ``total_steps`` is the Hölder/UCB horizon T (all
        steps this accountant will see; an upper bound is safe). Returns the per-step ``ĉ(λ)``.
        """
        if (clipped_grads is None) == (distances is None):
            raise ValueError("give exactly one of clipped_grads or distances")
        d = (neighbour_distances(clipped_grads, adjacency=self.adjacency) if distances is None
             else _as_distances(distances))
        costs = step_costs(
            d, orders=self.orders, sample_rate=sample_rate, noise_std=noise_std,
            total_steps=total_steps, gamma_step=gamma_step,
        )
        self.commit(costs, total_steps=total_steps, gamma_step=gamma_step, num_steps=num_steps)
        return costs

    def commit(self, costs: Any, *, total_steps: int, gamma_step: float = DEFAULT_GAMMA_STEP,
               num_steps: int = 1) -> None:
        """Add ``num_steps`` steps of already estimated per-order costs (from :func:`step_costs`).

        Lets a caller estimate a step's cost once, check it against the budget
        (:meth:`would_exceed`) and then commit the same figures.
        """
        num_steps = check_count(num_steps, "num_steps")
        gamma_step = check_probability(gamma_step, "gamma_step")
        total_steps = check_count(total_steps, "total_steps")
        costs = np.asarray(costs, dtype=np.float64).reshape(-1)
        if costs.shape != (len(self.orders),):
            raise ValueError(f"need one cost per order ({len(self.orders)})")
        if self.spent_steps + num_steps > total_steps:
            warnings.warn(
                f"{self.spent_steps + num_steps} steps accounted but total_steps={total_steps}: "
                "the UCB horizon is too short and ε_μ may be under-stated",
                RuntimeWarning,
                stacklevel=2,
            )
        self.total_costs = self.total_costs + num_steps * costs
        self.log_confidence += num_steps * math.log1p(-gamma_step)
        self.spent_steps += num_steps
        self.last_costs = costs

    @property
    def gamma(self) -> float:
        """Total failure probability of the estimator, ``1 − Π(1 − γ_step)``."""
        return float(-math.expm1(self.log_confidence))

    def epsilon(self, beta: float) -> float:
        """ε_μ = min_λ (C(λ) − log β)/λ (0 accounted steps give ``−log β / max λ``)."""
        return epsilon_mu(self.total_costs, self.orders, beta=beta)

    def delta_mu(self, beta: float) -> float:
        """δ_μ = β + γ."""
        return check_probability(beta, "beta") + self.gamma

    def would_exceed(
        self, *, target_epsilon_mu: float, beta: float, next_costs: Any = None
    ) -> bool:
        """Whether one more step of estimated cost ``next_costs`` (per order) would overspend.

        ``next_costs`` defaults to the last step's ``ĉ(λ)`` (``ValueError`` before any step).
        The budget filter: a site stops before a step for which this returns ``True``.
        """
        target = check_positive(target_epsilon_mu, "target_epsilon_mu")
        if next_costs is None:
            if self.last_costs is None:
                raise ValueError("no step accounted yet: pass next_costs")
            next_costs = self.last_costs
        next_costs = np.asarray(next_costs, dtype=np.float64).reshape(-1)
        if next_costs.shape != (len(self.orders),):
            raise ValueError(f"need one cost per order ({len(self.orders)})")
        return epsilon_mu(self.total_costs + next_costs, self.orders, beta=beta) > target

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON-serialisable); floats round-trip exactly."""
        return {
            "mechanism": self.mechanism,
            "cost_rule": self.cost_rule,
            "adjacency": self.adjacency,
            "orders": list(self.orders),
            "total_costs": [float(c) for c in self.total_costs],
            "log_confidence": float(self.log_confidence),
            "spent_steps": int(self.spent_steps),
            "last_costs": None if self.last_costs is None else [float(c) for c in self.last_costs],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        missing = {"orders", "adjacency", "total_costs", "log_confidence", "spent_steps"} - set(state_dict)
        if missing:
            raise KeyError(f"state_dict lacks {sorted(missing)}")
        if state_dict.get("cost_rule") != self.cost_rule:
            raise ValueError(
                f"state_dict has cost_rule={state_dict.get('cost_rule')!r} (None: saved before the rule was "
                f"recorded, c_L alone) but this accountant accumulates {self.cost_rule!r}: its costs cannot be "
                "continued"
            )
        orders = _check_orders(state_dict["orders"])
        costs = np.asarray(state_dict["total_costs"], dtype=np.float64)
        if costs.shape != (len(orders),):
            raise ValueError("total_costs must have one entry per order")
        last = state_dict.get("last_costs")
        self.orders = orders
        self.adjacency = check_adjacency(state_dict["adjacency"])
        self.total_costs = costs
        self.log_confidence = float(state_dict["log_confidence"])
        self.spent_steps = check_count(int(state_dict["spent_steps"]), "spent_steps", minimum=0)
        self.last_costs = None if last is None else np.asarray(last, dtype=np.float64)

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any]) -> BayesianAccountant:
        """New accountant restored from :meth:`state_dict`."""
        accountant = cls(state_dict["orders"], adjacency=state_dict["adjacency"])
        accountant.load_state_dict(state_dict)
        return accountant
