"""Bayesian DP accountant: reference costs, the d = C equivalence with opacus RDP, UCB, calibration."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from opacus.accountants.analysis.rdp import _compute_rdp

from strategies.accounting.bayesian_dp import (
    DEFAULT_ORDERS,
    BayesianAccountant,
    calibrate_noise_for_bdp,
    classical_noise_multiplier,
    distances_from_gram,
    log_binomial_cost,
    neighbour_distances,
    pairwise_distances,
    project_epsilon_mu,
    step_costs,
    ucb_cost,
)
from strategies.accounting.rdp import SiteAccountant

# (q, σ, λ, d, c(λ; d)) with C = 1, from DESIGN §4; each to the digits given there.
REFERENCE = [
    (0.01, 1.0, 1, 1.0, "1.718134e-4"),
    (0.01, 1.0, 1, 0.5, "2.84021e-5"),
    (0.01, 1.0, 1, 0.1, "1.005016e-6"),
    (0.01, 1.0, 4, 1.0, "1.874669e-3"),
    (0.01, 1.0, 4, 0.5, "2.866697e-4"),
    (0.01, 1.0, 4, 0.1, "1.0053173e-5"),
    (0.01, 1.0, 16, 1.0, "57.7122962629"),
    (0.01, 1.0, 16, 0.5, "4.0531707e-3"),
    (0.01, 1.0, 16, 0.1, "1.36887267e-4"),
    (0.01, 1.0, 32, 1.0, "376.0293838624"),
    (0.01, 1.0, 32, 0.5, "1.66581060e-2"),
    (0.01, 1.0, 32, 0.1, "5.32297410e-4"),
    (0.05, 2.0, 8, 1.0, "2.85920760e-2"),
    (0.05, 2.0, 8, 0.3, "2.0636471e-3"),
]


def _significant_digits(text: str) -> int:
    mantissa = text.lower().split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa)


@pytest.mark.parametrize(("q", "sigma", "order", "d", "expected"), REFERENCE)
def test_reference_costs(q: float, sigma: float, order: int, d: float, expected: str) -> None:
    got = log_binomial_cost(order, d, sample_rate=q, noise_std=sigma * 1.0)
    digits = _significant_digits(expected)
    assert f"{got:.{digits - 1}e}" == f"{float(expected):.{digits - 1}e}"


@pytest.mark.parametrize(
    ("q", "sigma", "order"),
    [(0.01, 1.0, 1), (0.01, 1.0, 4), (0.01, 1.0, 16), (0.01, 1.0, 64), (0.05, 2.0, 8),
     (0.2, 0.8, 32), (256 / 60000, 1.1, 8), (1.0, 3.0, 4)],
)
@pytest.mark.parametrize("clip", [1.0, 0.1])
def test_cost_at_sensitivity_equals_opacus_rdp(q: float, sigma: float, order: int, clip: float) -> None:
    got = log_binomial_cost(order, clip, sample_rate=q, noise_std=sigma * clip)
    expected = order * float(_compute_rdp(q, sigma, order + 1))
    assert got == pytest.approx(expected, rel=1e-6)


def test_cost_vectorised_and_monotone() -> None:
    d = np.array([0.0, 0.1, 0.5, 1.0, 2.0])
    costs = log_binomial_cost(8, d, sample_rate=0.05, noise_std=1.0)
    assert isinstance(costs, np.ndarray) and costs.shape == (5,)
    assert costs[0] == pytest.approx(0.0, abs=1e-15)
    assert np.all(np.diff(costs) > 0)
    for value, scalar in zip(costs, d):
        assert value == log_binomial_cost(8, float(scalar), sample_rate=0.05, noise_std=1.0)
    # no overflow for huge orders / distances
    assert np.isfinite(log_binomial_cost(64, 50.0, sample_rate=0.5, noise_std=0.1))


def test_pairwise_distances() -> None:
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(6, 11))
    expected = [np.linalg.norm(grads[i] - grads[j]) for i in range(6) for j in range(i + 1, 6)]
    np.testing.assert_allclose(pairwise_distances(grads), expected, rtol=1e-12)
    np.testing.assert_allclose(pairwise_distances(torch.from_numpy(grads).float()), expected, rtol=1e-6)
    with pytest.raises(ValueError):
        pairwise_distances(grads[:1])


def test_ucb_formula() -> None:
    costs = np.array([1e-3, 2e-3, 5e-4, 1.5e-3, 8e-4])
    T, gamma = 100, 1e-6
    from scipy.stats import t

    values = np.exp(T * costs)
    naive = math.log(values.mean() + t.ppf(1 - gamma, len(costs) - 1) * values.std() / math.sqrt(len(costs) - 1)) / T
    assert ucb_cost(costs, total_steps=T, gamma_step=gamma) == pytest.approx(naive, rel=1e-10)
    assert ucb_cost(costs, total_steps=T, gamma_step=gamma) > np.log(values.mean()) / T


def test_ucb_edge_cases() -> None:
    # zero variance: exactly the common cost
    assert ucb_cost(np.full(10, 0.25), total_steps=1000, gamma_step=1e-12) == pytest.approx(0.25, rel=1e-14)
    # overflow in linear space is fine in log space
    big = ucb_cost(np.array([1.0, 2.0, 3.0]), total_steps=10_000, gamma_step=1e-16)
    assert math.isfinite(big) and big >= 3.0 - 1e-9
    # a single pair: no NaN, warns
    with pytest.warns(RuntimeWarning):
        assert ucb_cost(np.array([0.01]), total_steps=10, gamma_step=1e-3) == 0.01
    # two pairs work (df = 1)
    assert math.isfinite(ucb_cost(np.array([0.01, 0.02]), total_steps=10, gamma_step=1e-3))
    with pytest.raises(ValueError):
        ucb_cost(np.array([]), total_steps=10, gamma_step=1e-3)
    with pytest.raises(ValueError):
        ucb_cost(np.array([0.1, 0.2]), total_steps=10, gamma_step=0.0)


def _steps(accountant: BayesianAccountant, distances: np.ndarray, *, q: float, s: float, steps: int) -> None:
    for _ in range(steps):
        accountant.step(distances=distances, sample_rate=q, noise_std=s, total_steps=steps, gamma_step=1e-12)


def test_all_distances_at_sensitivity_match_rdp() -> None:
    q, sigma, clip, steps = 0.01, 1.0, 1.0, 50
    accountant = BayesianAccountant()
    _steps(accountant, np.full(28, clip), q=q, s=sigma * clip, steps=steps)
    expected = np.array([steps * lam * float(_compute_rdp(q, sigma, lam + 1)) for lam in DEFAULT_ORDERS])
    np.testing.assert_allclose(accountant.total_costs, expected, rtol=1e-6)


def test_average_case_below_worst_case() -> None:
    q, sigma, clip, steps, delta = 0.01, 1.0, 1.0, 200, 1e-5
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(16, 50))
    grads *= (rng.uniform(0.15, 0.3, size=(16, 1)) / np.linalg.norm(grads, axis=1, keepdims=True))
    distances = pairwise_distances(grads)
    assert distances.max() < clip
    accountant = BayesianAccountant()
    _steps(accountant, distances, q=q, s=sigma * clip, steps=steps)
    classical = SiteAccountant()
    classical.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    rdp_costs = np.array([steps * lam * float(_compute_rdp(q, sigma, lam + 1)) for lam in DEFAULT_ORDERS])
    assert np.all(accountant.total_costs < rdp_costs)
    assert accountant.epsilon(delta) < classical.epsilon(delta)
    assert accountant.delta_mu(delta) == pytest.approx(delta + steps * 1e-12, rel=1e-6)


def test_step_from_clipped_grads_matches_distances_and_is_deterministic() -> None:
    rng = np.random.default_rng(2)
    grads = torch.from_numpy(rng.normal(size=(8, 20)) * 0.1)
    for adjacency in ("add-remove", "replace-one"):
        first, second, third = (BayesianAccountant(adjacency=adjacency) for _ in range(3))
        for accountant in (first, second):
            accountant.step(clipped_grads=grads, sample_rate=0.02, noise_std=1.2, total_steps=10)
        third.step(distances=neighbour_distances(grads, adjacency=adjacency), sample_rate=0.02, noise_std=1.2,
                   total_steps=10)
        assert np.array_equal(first.total_costs, second.total_costs)
        assert np.array_equal(first.total_costs, third.total_costs)
    with pytest.raises(ValueError):
        first.step(sample_rate=0.02, noise_std=1.2, total_steps=10)
    with pytest.raises(ValueError):
        first.step(clipped_grads=grads, distances=[0.1, 0.2], sample_rate=0.02, noise_std=1.2, total_steps=10)


def test_num_steps_equals_repeated_steps() -> None:
    d = np.linspace(0.1, 0.9, 15)
    once, repeated = BayesianAccountant(), BayesianAccountant()
    once.step(distances=d, sample_rate=0.05, noise_std=1.0, total_steps=5, num_steps=5)
    _steps(repeated, d, q=0.05, s=1.0, steps=5)
    np.testing.assert_allclose(once.total_costs, repeated.total_costs, rtol=1e-12)
    assert once.gamma == pytest.approx(repeated.gamma, rel=1e-12)


def test_horizon_warning() -> None:
    accountant = BayesianAccountant()
    with pytest.warns(RuntimeWarning, match="horizon"):
        accountant.step(distances=[0.1, 0.2, 0.3], sample_rate=0.1, noise_std=1.0, total_steps=1, num_steps=2)


def test_state_dict_round_trip() -> None:
    accountant = BayesianAccountant(orders=(2, 8, 32))
    _steps(accountant, np.linspace(0.2, 0.8, 10), q=0.03, s=1.5, steps=7)
    state = json.loads(json.dumps(accountant.state_dict()))
    restored = BayesianAccountant()
    restored.load_state_dict(state)
    assert restored.orders == (2, 8, 32)
    assert np.array_equal(restored.total_costs, accountant.total_costs)
    assert restored.epsilon(1e-5) == accountant.epsilon(1e-5)
    assert restored.delta_mu(1e-5) == accountant.delta_mu(1e-5)
    assert restored.spent_steps == 7
    assert BayesianAccountant.from_state_dict(state).epsilon(1e-5) == accountant.epsilon(1e-5)


def test_budget_filter_stops_before_overspending() -> None:
    d = np.linspace(0.3, 0.9, 20)
    target, beta, total = 2.0, 1e-5, 2000
    accountant = BayesianAccountant()
    with pytest.raises(ValueError):
        accountant.would_exceed(target_epsilon_mu=target, beta=beta)
    taken = 0
    while True:
        costs = accountant.step(distances=d, sample_rate=0.02, noise_std=1.5, total_steps=total)
        taken += 1
        assert accountant.epsilon(beta) <= target
        if accountant.would_exceed(target_epsilon_mu=target, beta=beta, next_costs=costs):
            break
        assert taken < total
    assert taken > 10
    accountant.step(distances=d, sample_rate=0.02, noise_std=1.5, total_steps=total)
    assert accountant.epsilon(beta) > target
    assert accountant.would_exceed(target_epsilon_mu=target, beta=beta)


def test_calibration_meets_target() -> None:
    rng = np.random.default_rng(3)
    pilot = rng.uniform(0.2, 1.0, size=120)
    kwargs = dict(beta=1e-5, distances_pilot=pilot, sample_rate=0.01, steps=1000, clip_norm=2.0)
    sigma = calibrate_noise_for_bdp(target_epsilon_mu=1.0, tolerance=1e-3, **kwargs)
    projected = project_epsilon_mu(
        noise_multiplier=sigma, distances=pilot, sample_rate=0.01, steps=1000, clip_norm=2.0, beta=1e-5
    )
    assert 1.0 - 1e-3 <= projected <= 1.0
    # an accountant stepped with the pilot distances reports the projected figure
    accountant = BayesianAccountant()
    accountant.step(distances=pilot, sample_rate=0.01, noise_std=sigma * 2.0, total_steps=1000, num_steps=1000)
    assert accountant.epsilon(1e-5) == pytest.approx(projected, rel=1e-12)
    # average case needs less noise than the worst case for the same nominal ε
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        worst = calibrate_noise_for_bdp(
            target_epsilon_mu=1.0, tolerance=1e-3, **{**kwargs, "distances_pilot": np.full(5, 2.0)}
        )
    assert sigma < worst


def test_calibration_unreachable_target() -> None:
    with pytest.raises(ValueError, match="too small"):
        calibrate_noise_for_bdp(
            target_epsilon_mu=0.01, beta=1e-5, distances_pilot=[0.5, 0.6, 0.7], sample_rate=0.01,
            steps=100, clip_norm=1.0, max_noise_multiplier=100.0,
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sample_rate": 0.0, "noise_std": 1.0},
        {"sample_rate": 0.1, "noise_std": 0.0},
        {"sample_rate": 1.1, "noise_std": 1.0},
    ],
)
def test_cost_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        log_binomial_cost(4, 0.5, **kwargs)


def test_order_validation() -> None:
    with pytest.raises(ValueError):
        log_binomial_cost(0, 0.5, sample_rate=0.1, noise_std=1.0)
    with pytest.raises(TypeError):
        log_binomial_cost(2.5, 0.5, sample_rate=0.1, noise_std=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        log_binomial_cost(2, -0.5, sample_rate=0.1, noise_std=1.0)
    with pytest.raises(ValueError):
        BayesianAccountant(orders=())
    with pytest.raises(ValueError):
        BayesianAccountant().epsilon(0.0)


def test_neighbour_distances_per_adjacency() -> None:
    rng = np.random.default_rng(5)
    grads = rng.normal(size=(6, 9))
    np.testing.assert_allclose(neighbour_distances(grads, adjacency="add-remove"), np.linalg.norm(grads, axis=1),
                               rtol=1e-12)
    np.testing.assert_array_equal(neighbour_distances(grads, adjacency="replace-one"), pairwise_distances(grads))
    with pytest.raises(ValueError, match="adjacency"):
        neighbour_distances(grads, adjacency="substitute")
    with pytest.raises(ValueError, match="adjacency"):
        BayesianAccountant(adjacency="add_remove")


@pytest.mark.parametrize(("q", "s", "count"), [(0.01, 1.0, 16), (0.2, 0.7, 120), (1.0, 3.0, 5), (0.05, 0.3, 2)])
def test_step_costs_equal_the_per_order_reference(q: float, s: float, count: int) -> None:
    """The vectorised step cost equals ucb_cost(log_binomial_cost) order by order."""
    distances = np.random.default_rng(count).uniform(0.0, 2.0, size=count)
    expected = [ucb_cost(log_binomial_cost(order, distances, sample_rate=q, noise_std=s), total_steps=300,
                         gamma_step=1e-12) for order in DEFAULT_ORDERS]
    got = step_costs(distances, orders=DEFAULT_ORDERS, sample_rate=q, noise_std=s, total_steps=300, gamma_step=1e-12)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    equal = step_costs(np.full(7, 0.4), orders=(3, 9), sample_rate=q, noise_std=s, total_steps=10, gamma_step=1e-9)
    np.testing.assert_allclose(equal, [log_binomial_cost(order, 0.4, sample_rate=q, noise_std=s) for order in (3, 9)],
                               rtol=1e-12)


def test_add_remove_with_every_gradient_clipped_is_the_classical_bound() -> None:
    """Add/remove: every record clipped to norm C gives d = C, i.e. λ·RDP_{λ+1} of opacus exactly."""
    q, sigma, clip, steps = 0.02, 1.3, 0.5, 40
    grads = np.random.default_rng(3).normal(size=(16, 30))
    grads *= clip / np.linalg.norm(grads, axis=1, keepdims=True)
    accountant = BayesianAccountant(adjacency="add-remove")
    for _ in range(steps):
        accountant.step(clipped_grads=grads, sample_rate=q, noise_std=sigma * clip, total_steps=steps)
    expected = np.array([steps * lam * float(_compute_rdp(q, sigma, lam + 1)) for lam in DEFAULT_ORDERS])
    np.testing.assert_allclose(accountant.total_costs, expected, rtol=1e-6)


def test_replace_one_worst_case_is_the_add_remove_bound_at_half_the_noise() -> None:
    """Replace-one: the largest distance 2C costs what add/remove costs at noise multiplier σ/2."""
    q, sigma, clip = 0.03, 1.6, 2.0
    half = classical_noise_multiplier(sigma, adjacency="replace-one")
    assert half == sigma / 2 and classical_noise_multiplier(sigma, adjacency="add-remove") == sigma
    for order in DEFAULT_ORDERS:
        cost = log_binomial_cost(order, 2 * clip, sample_rate=q, noise_std=sigma * clip)
        assert cost == pytest.approx(order * float(_compute_rdp(q, half, order + 1)), rel=1e-6)


@pytest.mark.parametrize("adjacency", ["add-remove", "replace-one"])
def test_distances_from_gram_equal_the_direct_distances(adjacency: str) -> None:
    grads = np.random.default_rng(8).normal(size=(16, 40)) * 0.05
    gram = grads @ grads.T
    np.testing.assert_allclose(distances_from_gram(gram, adjacency=adjacency),
                               neighbour_distances(grads, adjacency=adjacency), rtol=1e-9)
    with pytest.raises(ValueError, match="square"):
        distances_from_gram(gram[:3], adjacency=adjacency)


def test_epsilon_mu_at_the_worst_case_is_mironovs_conversion_of_opacus_rdp() -> None:
    """d = C everywhere: ε_μ is opacus' RDP turned into ε by Mironov's (tail-bound) conversion,
    which is looser than the conversion opacus itself uses (Balle et al. 2020)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    q, sigma, steps, beta = 0.061, 4.57, 320, 1e-5
    eps_mu = project_epsilon_mu(noise_multiplier=sigma, distances=np.ones(12), sample_rate=q, steps=steps,
                                clip_norm=1.0, beta=beta)
    alphas = [order + 1 for order in DEFAULT_ORDERS]
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=alphas)
    mironov = min(r + math.log(1 / beta) / (alpha - 1) for alpha, r in zip(alphas, rdp))
    assert eps_mu == pytest.approx(mironov, rel=1e-9)
    opacus_orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    classical, _ = get_privacy_spent(orders=opacus_orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                                                           orders=opacus_orders), delta=beta)
    assert 1.15 < eps_mu / classical < 1.3  # the gap the README and ledger state
