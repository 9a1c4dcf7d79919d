"""NbAFL noise, LS-ADP / ROW-DP importances and budgets, and their audited ε (adaptive_dp.py)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import (
    AUDIT_RDP_ORDERS,
    DISPERSION_MEASURES,
    audited_epsilon_nominal_formula,
    audited_epsilon_rdp,
    clip_update,
    dispersion,
    exact_budget_noise_stds,
    gaussian_constant,
    joint_noise_multiplier,
    layer_sensitivity_importance,
    ls_adp_budgets,
    nbafl_downlink_noise_std,
    nbafl_sensitivity,
    nbafl_uplink_noise_std,
    noise_std_from_budgets,
    row_dp_budgets,
    row_dp_importance,
    split_clip_norm,
)
from strategies.mechanisms.weight_release import perturbed_layer_metrics

# The paper's simulation setting: δ = 1e-5, C = 1, m = 1000, L = 50, ε = 0.6.
NBAFL = {"delta": 1e-5, "clip_norm": 1.0, "min_site_records": 1000, "exposures": 50}
# c = sqrt(2 ln(1.25 / 1e-5)) = sqrt(2 × 11.736069016284437) = sqrt(23.472138032568874)
C_AT_1E_5 = 4.844805262605389


# --------------------------------------------------------------------------------------------
# NbAFL
# --------------------------------------------------------------------------------------------


def test_gaussian_constant_hand_value() -> None:
    assert gaussian_constant(1e-5) == pytest.approx(C_AT_1E_5, rel=1e-14)
    assert C_AT_1E_5**2 == pytest.approx(2 * 11.736069016284437, rel=1e-14)


def test_uplink_noise_std_hand_value() -> None:
    # ΔsU = 2 × 1 / 1000 = 0.002;  σ_U = 4.844805262605389 × 50 × 0.002 / 0.6 = 0.8074675437675649
    assert nbafl_sensitivity(clip_norm=1.0, min_site_records=1000) == pytest.approx(0.002, rel=1e-15)
    sigma = nbafl_uplink_noise_std(epsilon=0.6, **NBAFL)
    assert sigma == pytest.approx(4.844805262605389 * 50 * 0.002 / 0.6, rel=1e-13)
    assert sigma == pytest.approx(0.8074675437675649, rel=1e-13)


def test_downlink_noise_std_positive_when_rounds_exceed_exposures_sqrt_sites() -> None:
    # T = 50, N = 5, L = 10: L·sqrt(N) = 22.36 < 50; T² − L²N = 2500 − 500 = 2000
    # σ_D = 2 × 4.844805262605389 × 1 × sqrt(2000) / (1000 × 5 × 0.6) = 0.14444418539912493
    sigma = nbafl_downlink_noise_std(
        epsilon=0.6, delta=1e-5, clip_norm=1.0, min_site_records=1000, exposures=10, rounds=50, num_sites=5
    )
    assert sigma == pytest.approx(2 * 4.844805262605389 * 44.721359549995796 / 3000, rel=1e-13)
    assert sigma == pytest.approx(0.14444418539912493, rel=1e-13)


@pytest.mark.parametrize(("rounds", "num_sites", "exposures"), [(20, 5, 10), (20, 4, 10), (50, 5, 50)])
def test_downlink_noise_std_zero_when_rounds_at_most_exposures_sqrt_sites(
    rounds: int, num_sites: int, exposures: int
) -> None:
    # 20 ≤ 10·sqrt(5) = 22.4;  20 = 10·sqrt(4) exactly (boundary);  50 ≤ 50·sqrt(5)
    sigma = nbafl_downlink_noise_std(
        epsilon=0.6,
        delta=1e-5,
        clip_norm=1.0,
        min_site_records=1000,
        exposures=exposures,
        rounds=rounds,
        num_sites=num_sites,
    )
    assert sigma == 0.0


def test_clip_update_scales_jointly_to_clip_norm_numpy_and_torch() -> None:
    # global norm of (3, 4) and (12,) is sqrt(9 + 16 + 144) = 13
    arrays = [np.array([3.0, 4.0]), np.array([12.0])]
    clipped, norm = clip_update(arrays, 1.3)
    assert norm == pytest.approx(13.0, rel=1e-15)
    np.testing.assert_allclose(clipped[0], [0.3, 0.4], rtol=1e-14)
    np.testing.assert_allclose(clipped[1], [1.2], rtol=1e-14)
    assert math.sqrt(sum(float(np.sum(a**2)) for a in clipped)) <= 1.3 * (1 + 1e-14)
    np.testing.assert_array_equal(arrays[0], [3.0, 4.0])  # inputs untouched

    tensors = [torch.tensor([[3.0, 4.0]]), torch.tensor([12.0])]
    clipped_t, norm_t = clip_update(tensors, 1.3)
    assert norm_t == pytest.approx(13.0, rel=1e-7)
    assert isinstance(clipped_t[0], torch.Tensor) and clipped_t[0].dtype == torch.float32
    assert clipped_t[0].shape == (1, 2)
    total = math.sqrt(sum(float(torch.sum(t.double() ** 2)) for t in clipped_t))
    assert total <= 1.3 * (1 + 1e-6)


def test_clip_update_unchanged_below_clip_norm() -> None:
    tensors = [torch.randn(4, 3, generator=torch.Generator().manual_seed(0)) * 0.1, torch.zeros(3)]
    clipped, norm = clip_update(tensors, 10.0)
    assert norm < 10.0
    for before, after in zip(tensors, clipped, strict=True):
        assert torch.equal(before, after)
        assert after is not before
    zero, zero_norm = clip_update([np.zeros(3)], 1.0)
    assert zero_norm == 0.0 and np.array_equal(zero[0], np.zeros(3))


# --------------------------------------------------------------------------------------------
# LS-ADP
# --------------------------------------------------------------------------------------------


def test_layer_sensitivity_importance_hand_values_and_uniform_fallback() -> None:
    # p = 0.7; |p_i − p| = 0.1, 0.3, 0.0, 0.1 → sum 0.5 → V = 0.2, 0.6, 0, 0.2
    importance = layer_sensitivity_importance(0.7, [0.8, 0.4, 0.7, 0.6])
    np.testing.assert_allclose(importance, [0.2, 0.6, 0.0, 0.2], atol=1e-12)
    assert importance.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_array_equal(layer_sensitivity_importance(0.5, [0.5, 0.5, 0.5]), [1 / 3] * 3)


class _OneBranchMatters(nn.Module):
    """``used(x) + 0 · ignored(x)``: perturbing ``ignored`` cannot change the output at all."""

    def __init__(self) -> None:
        super().__init__()
        self.ignored = nn.Linear(3, 1)
        self.used = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) + 0.0 * self.ignored(x)


def test_perturbed_layer_metrics_ranks_the_layer_that_matters_and_restores_exactly() -> None:
    torch.manual_seed(0)
    model = _OneBranchMatters()
    inputs = torch.randn(32, 3, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    changed_per_call: list[set[str]] = []

    def evaluate(net: nn.Module) -> float:
        changed_per_call.append(
            {name for name, p in net.named_parameters() if not torch.equal(p, before[name])}
        )
        return float(torch.mean((net(inputs) - targets) ** 2))

    baseline, perturbed, names = perturbed_layer_metrics(
        model, evaluate, noise_std=0.5, generator=torch.Generator().manual_seed(3)
    )
    assert names == ["ignored", "used"]
    # baseline: nothing perturbed; then exactly one layer (weight and bias) at a time
    assert changed_per_call == [set(), {"ignored.weight", "ignored.bias"}, {"used.weight", "used.bias"}]
    assert perturbed[0] == baseline and perturbed[1] != baseline
    importance = layer_sensitivity_importance(baseline, perturbed)
    np.testing.assert_array_equal(importance, [0.0, 1.0])
    assert names[int(np.argmax(importance))] == "used"
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # bit-for-bit


def test_perturbed_layer_metrics_restores_when_evaluate_raises_and_names_nested_layers() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def failing(net: nn.Module) -> float:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return 0.0

    with pytest.raises(RuntimeError, match="boom"):
        perturbed_layer_metrics(model, failing, noise_std=1.0)
    for original, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(original, p)
    _, perturbed, names = perturbed_layer_metrics(model, lambda net: 1.0, noise_std=1.0)
    assert names == ["0", "2"] and perturbed == [1.0, 1.0]


# --------------------------------------------------------------------------------------------
# ROW-DP
# --------------------------------------------------------------------------------------------


def test_dispersion_hand_values() -> None:
    # one weight's iterates 1, 2, 3, 10 (mean 4, deviations −3, −2, −1, 6); another constant
    iterates = np.array([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0], [10.0, 5.0]])
    np.testing.assert_allclose(dispersion(iterates, "var"), [50 / 4, 0.0])  # (9+4+1+36)/4
    np.testing.assert_allclose(dispersion(iterates, "std"), [math.sqrt(12.5), 0.0])
    np.testing.assert_allclose(dispersion(iterates, "range"), [9.0, 0.0])
    # linear interpolation: Q3 at position 2.25 → 3 + 0.25·7 = 4.75; Q1 at 0.75 → 1.75
    np.testing.assert_allclose(dispersion(iterates, "iqr"), [3.0, 0.0])
    np.testing.assert_allclose(dispersion(iterates, "mae"), [(3 + 2 + 1 + 6) / 4, 0.0])


def test_dispersion_matches_numpy_and_scipy() -> None:
    rng = np.random.default_rng(0)
    iterates = rng.normal(size=(7, 4, 3))
    np.testing.assert_allclose(dispersion(iterates, "var"), np.var(iterates, axis=0), rtol=1e-13)
    np.testing.assert_allclose(dispersion(iterates, "std"), np.std(iterates, axis=0), rtol=1e-13)
    np.testing.assert_allclose(
        dispersion(iterates, "range"), iterates.max(axis=0) - iterates.min(axis=0), rtol=1e-13
    )
    q75, q25 = np.percentile(iterates, [75, 25], axis=0)
    np.testing.assert_allclose(dispersion(iterates, "iqr"), q75 - q25, rtol=1e-13)
    np.testing.assert_allclose(dispersion(iterates, "iqr"), scipy.stats.iqr(iterates, axis=0), rtol=1e-13)
    mad = np.mean(np.abs(iterates - iterates.mean(axis=0)), axis=0)
    np.testing.assert_allclose(dispersion(iterates, "mae"), mad, rtol=1e-13)
    # torch input and a list of per-iteration tensors give the same
    as_list = [torch.from_numpy(a) for a in iterates]
    np.testing.assert_allclose(dispersion(as_list, "mae"), mad, rtol=1e-13)
    np.testing.assert_allclose(dispersion(torch.from_numpy(iterates), "var"), np.var(iterates, axis=0))


def test_row_dp_importance_hand_values_and_uniform_fallback() -> None:
    # weights' iterates: (0, 1, 2), (5, 5, 5), (1, 0, −1)
    iterates = np.array([[0.0, 5.0, 1.0], [1.0, 5.0, 0.0], [2.0, 5.0, -1.0]])
    # var = 2/3, 0, 2/3; |last| = 2, 5, 1 → scores 4/3, 0, 2/3 → V = 2/3, 0, 1/3
    np.testing.assert_allclose(row_dp_importance(iterates, "var"), [2 / 3, 0.0, 1 / 3], rtol=1e-14)
    # range = 2, 0, 2 → scores 4, 0, 2 → same V
    np.testing.assert_allclose(row_dp_importance(iterates, "range"), [2 / 3, 0.0, 1 / 3], rtol=1e-14)
    # a single iterate has no dispersion: uniform
    np.testing.assert_array_equal(row_dp_importance(iterates[:1], "std"), [1 / 3] * 3)
    shaped = row_dp_importance(np.random.default_rng(1).normal(size=(5, 2, 3)), "iqr")
    assert shaped.shape == (2, 3) and shaped.sum() == pytest.approx(1.0, abs=1e-14)


# --------------------------------------------------------------------------------------------
# budgets and noise
# --------------------------------------------------------------------------------------------


def test_ls_adp_budgets_hand_values_and_mean_is_epsilon() -> None:
    # ε_i = 0.6 × 3 × (0.5, 0.3, 0.2) = (0.9, 0.54, 0.36)
    budgets = ls_adp_budgets([0.5, 0.3, 0.2], epsilon=0.6)
    np.testing.assert_allclose(budgets, [0.9, 0.54, 0.36], rtol=1e-14)
    np.testing.assert_allclose(ls_adp_budgets([5.0, 3.0, 2.0], epsilon=0.6), budgets, rtol=1e-14)
    importance = np.random.default_rng(2).dirichlet(np.ones(6))
    assert ls_adp_budgets(importance, epsilon=0.7).mean() == pytest.approx(0.7, rel=1e-14)
    # uniform_mix = 0.5 with V = (1, 0): V' = (0.75, 0.25) → (1.2, 0.4), every layer ≥ 0.5 ε
    mixed = ls_adp_budgets([1.0, 0.0], epsilon=0.8, uniform_mix=0.5)
    np.testing.assert_allclose(mixed, [1.2, 0.4], rtol=1e-14)
    assert mixed.mean() == pytest.approx(0.8, rel=1e-14)


def test_row_dp_budgets_selected_layer_averages_to_epsilon_others_at_epsilon() -> None:
    # selected layer 1 (3 weights): 0.8 × 3 × (0.5, 0.25, 0.25) = (1.2, 0.6, 0.6)
    budgets = row_dp_budgets([4, 3, 2], 1, [0.5, 0.25, 0.25], epsilon=0.8)
    assert [b.shape for b in budgets] == [(4,), (3,), (2,)]
    np.testing.assert_allclose(budgets[1], [1.2, 0.6, 0.6], rtol=1e-14)
    np.testing.assert_array_equal(budgets[0], [0.8] * 4)
    np.testing.assert_array_equal(budgets[2], [0.8] * 2)
    importance = np.random.default_rng(3).dirichlet(np.ones(12)).reshape(3, 4)
    shaped = row_dp_budgets([5, 12], 1, importance, epsilon=0.6)
    assert shaped[1].shape == (3, 4)
    assert shaped[1].mean() == pytest.approx(0.6, rel=1e-14)
    assert np.concatenate([b.ravel() for b in shaped]).mean() == pytest.approx(0.6, rel=1e-14)


def test_noise_std_from_budgets_is_nbafl_sigma_per_unit_and_inf_at_zero() -> None:
    stds = noise_std_from_budgets([0.6, 1.2, 0.0], **NBAFL)
    # 0.6 → 0.8074675437675649 (as NbAFL at ε = 0.6); 1.2 → half of it; 0 → inf
    assert stds[0] == pytest.approx(0.8074675437675649, rel=1e-13)
    assert stds[1] == pytest.approx(0.8074675437675649 / 2, rel=1e-13)
    assert math.isinf(stds[2])
    assert stds[0] == pytest.approx(nbafl_uplink_noise_std(epsilon=0.6, **NBAFL), rel=1e-15)


def test_audited_epsilon_is_the_largest_budget_not_the_mean() -> None:
    budgets = ls_adp_budgets([0.5, 0.3, 0.2], epsilon=0.6)  # (0.9, 0.54, 0.36), mean 0.6
    stds = noise_std_from_budgets(budgets, **NBAFL)
    audited = audited_epsilon_nominal_formula(stds, **NBAFL)
    assert audited == pytest.approx(0.9, rel=1e-13)
    # by definition: c L ΔsU / σ_min = 4.844805262605389 × 50 × 0.002 / σ_min
    assert audited == pytest.approx(4.844805262605389 * 50 * 0.002 / stds.min(), rel=1e-13)
    assert audited > 0.6
    uniform = noise_std_from_budgets(ls_adp_budgets([1, 1, 1], epsilon=0.6), **NBAFL)
    assert audited_epsilon_nominal_formula(uniform, **NBAFL) == pytest.approx(0.6, rel=1e-13)
    # ROW-DP: ragged per-layer arrays; the largest budget in the selected layer sets ε
    row = row_dp_budgets([4, 3, 2], 1, [0.5, 0.25, 0.25], epsilon=0.8)
    row_stds = [noise_std_from_budgets(b, **NBAFL) for b in row]
    assert audited_epsilon_nominal_formula(row_stds, **NBAFL) == pytest.approx(1.2, rel=1e-13)
    # a layer with V = 0 is not released (σ = ∞): it does not lower the audited ε
    zero_layer = noise_std_from_budgets(ls_adp_budgets([1.0, 0.0], epsilon=0.6), **NBAFL)
    assert audited_epsilon_nominal_formula(zero_layer, **NBAFL) == pytest.approx(1.2, rel=1e-13)


def test_audited_epsilon_rdp_is_gaussian_rdp_at_min_sigma_over_sensitivity() -> None:
    stds = noise_std_from_budgets(ls_adp_budgets([0.5, 0.3, 0.2], epsilon=0.6), **NBAFL)
    z = stds.min() / 0.002  # σ_min / ΔsU
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the extended order grid reaches the optimum
        audited = audited_epsilon_rdp(stds, **NBAFL)
    expected = epsilon_gaussian_rounds(noise_multiplier=z, rounds=50, delta=1e-5, orders=list(AUDIT_RDP_ORDERS))
    assert audited == pytest.approx(expected, rel=1e-12)
    # independently: min_α [50 α / (2 z²) + log((α−1)/α) − (log δ + log α)/(α − 1)] (Balle et al.)
    alphas = np.array(AUDIT_RDP_ORDERS)
    by_order = 50 * alphas / (2 * z**2) + np.log1p(-1 / alphas) - (np.log(1e-5) + np.log(alphas)) / (alphas - 1)
    assert audited == pytest.approx(float(by_order.min()), rel=1e-9)
    # orders are only ever added to opacus' grid, so the bound can only get tighter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coarse = epsilon_gaussian_rounds(noise_multiplier=z, rounds=50, delta=1e-5)
    assert audited <= coarse
    # more budget on one layer can only cost more than the uniform allocation at the same mean
    uniform = noise_std_from_budgets(ls_adp_budgets([1, 1, 1], epsilon=0.6), **NBAFL)
    assert audited_epsilon_rdp(stds, **NBAFL) > audited_epsilon_rdp(uniform, **NBAFL)
    assert audited_epsilon_rdp([math.inf, math.inf], **NBAFL) == 0.0


# --------------------------------------------------------------------------------------------
# exact-budget variant
# --------------------------------------------------------------------------------------------


def test_split_clip_norm_squares_sum_to_clip_norm_squared() -> None:
    # sizes 1, 3: C_i = 2 × sqrt(1/4), 2 × sqrt(3/4) = 1, sqrt(3)
    np.testing.assert_allclose(split_clip_norm([1, 3], clip_norm=2.0), [1.0, math.sqrt(3)], rtol=1e-15)
    norms = split_clip_norm([120, 64, 33, 1], clip_norm=1.7)
    assert float(np.sum(norms**2)) == pytest.approx(1.7**2, rel=1e-14)


def test_exact_budget_joint_noise_multiplier_equals_z() -> None:
    rng = np.random.default_rng(4)
    for trial in range(20):
        sizes = rng.integers(1, 200, size=int(rng.integers(1, 8)))
        importance = rng.dirichlet(np.ones(sizes.size))
        z = float(rng.uniform(0.3, 5.0))
        norms = split_clip_norm([int(s) for s in sizes], clip_norm=float(rng.uniform(0.1, 3.0)))
        stds = exact_budget_noise_stds(importance, norms, noise_multiplier=z)
        assert joint_noise_multiplier(norms, stds) == pytest.approx(z, abs=1e-12), trial
    # hand check: V = (0.25, 0.75), C_i = (1, 1), z = 2 → s = (4, 2/sqrt(0.75)); Σ C²/s² = 1/16 + 3/16
    stds = exact_budget_noise_stds([0.25, 0.75], [1.0, 1.0], noise_multiplier=2.0)
    np.testing.assert_allclose(stds, [4.0, 2 / math.sqrt(0.75)], rtol=1e-15)
    assert joint_noise_multiplier([1.0, 1.0], stds) == pytest.approx(2.0, abs=1e-12)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": math.inf}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"min_site_records": 0}, "min_site_records"),
        ({"exposures": 0}, "exposures"),
    ],
)
def test_nbafl_bad_inputs_name_the_parameter(overrides: dict, name: str) -> None:
    kwargs = {"epsilon": 0.6, **NBAFL, **overrides}
    with pytest.raises(ValueError, match=name):
        nbafl_uplink_noise_std(**kwargs)
    with pytest.raises(ValueError, match=name):
        nbafl_downlink_noise_std(**kwargs, rounds=50, num_sites=5)


def test_other_bad_inputs_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="rounds"):
        nbafl_downlink_noise_std(epsilon=0.6, **NBAFL, rounds=0, num_sites=5)
    with pytest.raises(ValueError, match="num_sites"):
        nbafl_downlink_noise_std(epsilon=0.6, **NBAFL, rounds=5, num_sites=0)
    with pytest.raises(ValueError, match="clip_norm"):
        clip_update([np.ones(2)], 0.0)
    with pytest.raises(ValueError, match=r"measure must be one of .*'iqr'.*'mae'"):
        dispersion(np.ones((3, 2)), "mad")
    assert set(DISPERSION_MEASURES) == {"var", "std", "range", "iqr", "mae"}
    with pytest.raises(ValueError, match="importance"):
        ls_adp_budgets([0.5, -0.1], epsilon=0.6)
    with pytest.raises(ValueError, match="importance"):
        ls_adp_budgets([0.0, 0.0], epsilon=0.6)
    with pytest.raises(ValueError, match="uniform_mix"):
        ls_adp_budgets([0.5, 0.5], epsilon=0.6, uniform_mix=1.5)
    with pytest.raises(ValueError, match="selected_layer"):
        row_dp_budgets([2, 3], 2, [1.0, 1.0], epsilon=0.6)
    with pytest.raises(ValueError, match="importance_of_selected"):
        row_dp_budgets([2, 3], 0, [1.0, 1.0, 1.0], epsilon=0.6)
    with pytest.raises(ValueError, match="budgets"):
        noise_std_from_budgets([0.5, -1.0], **NBAFL)
    with pytest.raises(ValueError, match="noise_stds"):
        audited_epsilon_nominal_formula([0.0, 1.0], **NBAFL)
    with pytest.raises(ValueError, match="importance"):
        exact_budget_noise_stds([1.0, 0.0], [1.0, 1.0], noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        exact_budget_noise_stds([1.0, 1.0], [1.0, 1.0], noise_multiplier=0.0)
    with pytest.raises(ValueError, match="noise_std"):
        perturbed_layer_metrics(nn.Linear(2, 1), lambda net: 0.0, noise_std=0.0)
    with pytest.raises(ValueError, match="perturbed_metrics"):
        layer_sensitivity_importance(0.5, [])
    with pytest.raises(ValueError, match="layer_sizes"):
        split_clip_norm([3, 0], clip_norm=1.0)
