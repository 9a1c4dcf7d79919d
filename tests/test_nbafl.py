"""Weight perturbation before upload: release_weights for NbAFL, LS-ADP and ROW-DP (nbafl.py)."""

from __future__ import annotations

import copy
import math

import dp_accounting
import numpy as np
import pytest
import scipy.stats
import torch
from dp_accounting.rdp import RdpAccountant
from torch import nn

from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import (
    AUDIT_RDP_ORDERS,
    audited_epsilon_rdp,
    gaussian_constant,
    nbafl_sensitivity,
    nbafl_uplink_noise_std,
)
from strategies.mechanisms.schedules import calibrate_gaussian_noise_multiplier
from strategies.mechanisms.weight_release import layer_parameters, release_weights, select_layer

# δ = 1e-5, C = 1, m = 1000, L = 5 (five rounds).
PRIVACY = {"delta": 1e-5, "clip_norm": 1.0, "min_site_records": 1000, "exposures": 5}
# σ_U(ε = 0.6) = c L (2C/m) / ε = 4.844805262605389 × 5 × 0.002 / 0.6 = 0.08074675437675649
SIGMA_AT_0_6 = 0.08074675437675649


def make_net(*sizes: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=False)])


def flat_layers(net: nn.Module) -> list[torch.Tensor]:
    """Each layer's parameters, flattened and concatenated (as release_weights sees them), float64."""
    return [torch.cat([p.detach().reshape(-1) for p in params]).double() for params in layer_parameters(net)]


def globally_clipped(net: nn.Module, clip_norm: float) -> list[torch.Tensor]:
    layers = flat_layers(net)
    norm = math.sqrt(sum(float(values.square().sum()) for values in layers))
    scale = min(1.0, clip_norm / norm)
    return [values * scale for values in layers]


def release(net: nn.Module, *, seed: int = 0, **kwargs) -> object:
    settings = {**PRIVACY, "allocation": "paper", "selected_layer": -1}
    settings.update(kwargs)
    public = settings.pop("public_state", None)
    if public is None:
        public = {key: value.detach().clone() for key, value in net.state_dict().items()}
    return release_weights(net, generator=torch.Generator().manual_seed(seed), public_state=public, **settings)


def std_bounds(sigma: float, n: int, tail: float = 1e-6) -> tuple[float, float]:
    """Range of the sample std of n N(0, σ²) draws (known mean 0) outside which the chance is 2·tail."""
    low, high = scipy.stats.chi2.ppf([tail, 1.0 - tail], df=n)
    return sigma * math.sqrt(low / n), sigma * math.sqrt(high / n)


# --------------------------------------------------------------------------------------------
# allocation "paper"
# --------------------------------------------------------------------------------------------


def test_sigma_constant_by_hand() -> None:
    assert nbafl_uplink_noise_std(epsilon=0.6, **PRIVACY) == pytest.approx(SIGMA_AT_0_6, rel=1e-13)
    assert SIGMA_AT_0_6 == pytest.approx(4.844805262605389 * 5 * 0.002 / 0.6, rel=1e-15)


def test_paper_nbafl_noises_every_weight_with_sigma_u_and_audits_to_the_nominal_epsilon() -> None:
    net = make_net(50, 50)
    clipped = globally_clipped(net, PRIVACY["clip_norm"])
    original_norm = math.sqrt(sum(float(v.square().sum()) for v in flat_layers(net)))
    assert original_norm > 2.0  # default init of Linear(50, 50): ≈ 4.1, so the clip is active
    result = release(net, method="nbafl", epsilon=0.6)

    assert result.noise_min == result.noise_max == pytest.approx(SIGMA_AT_0_6, rel=1e-12)
    assert result.epsilon_nominal == 0.6
    assert result.epsilon_audited_formula == pytest.approx(0.6, abs=1e-9)
    assert result.epsilon_rdp == pytest.approx(
        audited_epsilon_rdp([SIGMA_AT_0_6], **PRIVACY), rel=1e-12)
    # effective multiplier σ/Δs_U = c L / ε = 4.8448 × 5 / 0.6
    assert result.noise_multiplier == pytest.approx(4.844805262605389 * 5 / 0.6, rel=1e-12)
    assert result.weight_norm == pytest.approx(original_norm, rel=1e-12)
    assert result.importance == () and result.selected_layer == -1

    noise = torch.cat([after - before for after, before in zip(flat_layers(net), clipped, strict=True)])
    assert noise.numel() == 2550
    empirical = float(noise.square().mean().sqrt())
    low, high = std_bounds(SIGMA_AT_0_6, noise.numel())
    assert low < empirical < high
    assert abs(float(noise.mean())) < 5 * SIGMA_AT_0_6 / math.sqrt(noise.numel())


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_paper_release_is_clipped_to_the_global_norm() -> None:
    net = make_net(20, 30, 5)
    result = release(net, method="nbafl", epsilon=1e9, clip_norm=0.5)
    assert result.noise_max < 1e-9
    released_norm = math.sqrt(sum(float(v.square().sum()) for v in flat_layers(net)))
    assert result.weight_norm > 0.5
    assert released_norm <= 0.5 + 1e-5
    assert released_norm == pytest.approx(0.5, abs=1e-5)  # scaled, not truncated per weight


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_paper_release_below_the_clip_norm_is_not_scaled() -> None:
    net = make_net(4, 3)
    before = flat_layers(net)
    release(net, method="nbafl", epsilon=1e9, clip_norm=100.0, min_site_records=10**9)
    for after, expected in zip(flat_layers(net), before, strict=True):
        assert torch.allclose(after, expected, atol=1e-6, rtol=0)


class OnlyFirstLayer:
    """Metric that depends on layer 0 only: perturbing layer 1 leaves it bit-identical."""

    def __call__(self, net: nn.Module) -> float:
        return float(net[0].weight.double().square().sum() + net[0].bias.double().sum())


def test_ls_adp_gives_the_only_layer_that_matters_all_of_the_budget() -> None:
    eps = 0.6
    net = make_net(10, 10, 10, seed=1)
    public = {key: value.detach().clone() + 1.0 for key, value in net.state_dict().items()}
    result = release(net, method="ls_adp", epsilon=eps, evaluate=OnlyFirstLayer(), public_state=public)

    assert result.importance == (1.0, 0.0)
    # layer 0's budget ε K V_0 = 2ε; layer 1 gets 0 (infinite noise: not released)
    assert result.noise_min == pytest.approx(SIGMA_AT_0_6 / 2, rel=1e-12)
    assert math.isinf(result.noise_max)
    assert result.epsilon_nominal == eps
    assert result.epsilon_audited_formula == pytest.approx(2 * eps, rel=1e-12)
    # layer 1 releases the public (global) value, not the local one
    assert torch.equal(net[1].weight, public["1.weight"]) and torch.equal(net[1].bias, public["1.bias"])
    assert not torch.equal(net[0].weight, public["0.weight"])


def test_ls_adp_audited_epsilon_is_the_largest_layer_budget_and_exceeds_nbafl() -> None:
    eps, mix = 0.6, 0.5
    net = make_net(10, 10, 10, seed=1)
    nbafl_net = copy.deepcopy(net)
    result = release(net, method="ls_adp", epsilon=eps, evaluate=OnlyFirstLayer(), uniform_mix=mix)
    nbafl = release(nbafl_net, method="nbafl", epsilon=eps)

    # V = (1 − λ)(1, 0) + λ/2 = (0.75, 0.25); budgets ε K V = (0.9, 0.3)
    assert result.importance == pytest.approx((0.75, 0.25), rel=1e-12)
    assert sum(result.importance) == pytest.approx(1.0, rel=1e-12)
    k = len(result.importance)
    assert result.epsilon_audited_formula == pytest.approx(eps * k * max(result.importance), rel=1e-12)
    assert result.epsilon_audited_formula == pytest.approx(0.9, rel=1e-12)
    assert result.epsilon_audited_formula >= result.epsilon_nominal == eps
    assert result.noise_min == pytest.approx(SIGMA_AT_0_6 / 1.5, rel=1e-12)
    assert result.noise_max == pytest.approx(SIGMA_AT_0_6 / 0.5, rel=1e-12)
    assert result.epsilon_rdp == pytest.approx(audited_epsilon_rdp([result.noise_min], **PRIVACY), rel=1e-12)
    assert result.epsilon_rdp >= nbafl.epsilon_rdp
    assert result.epsilon_rdp > nbafl.epsilon_rdp * 1.2  # 1.5× the budget: strictly worse


def test_ls_adp_needs_evaluate() -> None:
    with pytest.raises(ValueError, match="evaluate"):
        release(make_net(3, 2), method="ls_adp", epsilon=1.0)


# --------------------------------------------------------------------------------------------
# allocation "exact"
# --------------------------------------------------------------------------------------------


def _release_exact(method: str, net: nn.Module, *, epsilon: float, seed: int = 0, **kwargs) -> object:
    extra: dict = {}
    if method == "ls_adp":
        extra["evaluate"] = OnlyFirstLayer()
        extra["uniform_mix"] = 0.3
    if method == "row_dp":
        generator = torch.Generator().manual_seed(123)
        extra["selected_layer"] = 0
        size = sum(p.numel() for p in layer_parameters(net)[0])
        extra["iterates"] = torch.randn((6, size), generator=generator, dtype=torch.float64)
    extra.update(kwargs)
    return release(net, method=method, allocation="exact", epsilon=epsilon, seed=seed, **extra)


@pytest.mark.parametrize("method", ["nbafl", "ls_adp", "row_dp"])
def test_exact_allocation_spends_exactly_the_target_by_rdp(method: str) -> None:
    target = 2.0
    z = calibrate_gaussian_noise_multiplier(epsilon=target, delta=PRIVACY["delta"], releases=PRIVACY["exposures"])
    result = _release_exact(method, make_net(10, 10, 10, seed=2), epsilon=target)
    assert result.noise_multiplier == pytest.approx(z, rel=1e-9)
    assert result.epsilon_rdp <= target
    assert result.epsilon_rdp == pytest.approx(target, abs=1e-3)
    assert result.epsilon_nominal == target


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
@pytest.mark.parametrize("method", ["nbafl", "ls_adp", "row_dp"])
def test_exact_allocation_clips_each_layer_to_its_share_of_the_clip_norm(method: str) -> None:
    clip = 0.5
    net = make_net(20, 30, 5, seed=3)
    sizes = [sum(p.numel() for p in params) for params in layer_parameters(net)]
    before = [float(v.norm()) for v in flat_layers(net)]
    bounds = [clip * math.sqrt(size / sum(sizes)) for size in sizes]
    assert all(norm > bound for norm, bound in zip(before, bounds, strict=True))  # every clip active
    result = _release_exact(method, net, epsilon=1e6, clip_norm=clip)
    assert result.noise_min < 1e-5
    if method == "ls_adp":
        assert result.noise_max < 1e-5 * 10  # uniform_mix 0.3 keeps every layer's share positive
    layers = flat_layers(net)
    after = [float(v.norm()) for v in layers]
    for index, (norm, bound) in enumerate(zip(after, bounds, strict=True)):
        if index == result.selected_layer:  # row_dp: one unit per weight, each |w| <= C/sqrt(P)
            assert float(layers[index].abs().max()) <= clip / math.sqrt(sum(sizes)) + 1e-4  # + tiny noise
            assert norm <= bound + 1e-4
        else:
            assert norm == pytest.approx(bound, abs=1e-4)
    assert sum(norm**2 for norm in after) <= clip**2 + 1e-4
    assert sum(bound**2 for bound in bounds) == pytest.approx(clip**2, rel=1e-12)


def test_exact_nbafl_noises_every_weight_with_z_times_2c_over_m() -> None:
    target = 1.0
    net = make_net(40, 30, 20, seed=4)
    sizes = [sum(p.numel() for p in params) for params in layer_parameters(net)]
    bounds = [PRIVACY["clip_norm"] * math.sqrt(size / sum(sizes)) for size in sizes]
    clipped = []
    for values, bound in zip(flat_layers(net), bounds, strict=True):
        norm = float(values.norm())
        clipped.append(values * (bound / norm) if norm > bound else values)
    result = _release_exact("nbafl", net, epsilon=target)
    z = calibrate_gaussian_noise_multiplier(epsilon=target, delta=PRIVACY["delta"], releases=PRIVACY["exposures"])
    expected = z * 2 * PRIVACY["clip_norm"] / PRIVACY["min_site_records"]
    assert result.noise_min == pytest.approx(expected, rel=1e-9)
    assert result.noise_max == pytest.approx(expected, rel=1e-9)
    noise = torch.cat([after - before for after, before in zip(flat_layers(net), clipped, strict=True)])
    low, high = std_bounds(expected, noise.numel())
    assert low < float(noise.square().mean().sqrt()) < high


# --------------------------------------------------------------------------------------------
# calibrate_gaussian_noise_multiplier
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("epsilon", "releases"), [(0.5, 1), (1.0, 5), (4.0, 20), (8.0, 100)])
def test_calibrated_multiplier_agrees_with_google_dp_accounting(epsilon: float, releases: int) -> None:
    delta = 1e-5
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=delta, releases=releases)
    google = RdpAccountant(list(AUDIT_RDP_ORDERS))
    google.compose(dp_accounting.GaussianDpEvent(z), releases)
    spent = google.get_epsilon(delta)
    assert spent <= epsilon + 1e-9
    assert spent == pytest.approx(epsilon, rel=1e-4)
    # the smallest such z (to the documented 1e-6 relative tolerance)
    below = RdpAccountant(list(AUDIT_RDP_ORDERS))
    below.compose(dp_accounting.GaussianDpEvent(z * (1 - 1e-5)), releases)
    assert below.get_epsilon(delta) > epsilon


def test_calibrated_multiplier_matches_the_closed_form_gaussian_rdp() -> None:
    # RDP of L Gaussian releases: L α / (2 z²); conversion ε(α) = RDP + log((α−1)/α) − (log δ + log α)/(α − 1).
    delta, releases, epsilon = 1e-5, 10, 3.0
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=delta, releases=releases)
    orders = np.asarray(AUDIT_RDP_ORDERS, dtype=np.float64)
    eps = releases * orders / (2 * z**2) + np.log((orders - 1) / orders) - (np.log(delta) + np.log(orders)) / (orders - 1)
    assert float(eps.min()) == pytest.approx(epsilon, rel=1e-5)
    assert float(eps.min()) <= epsilon + 1e-12


def test_calibrated_multiplier_grows_as_epsilon_shrinks_and_with_releases() -> None:
    zs = [calibrate_gaussian_noise_multiplier(epsilon=e, delta=1e-5, releases=10) for e in (8.0, 4.0, 1.0, 0.5, 0.1)]
    assert all(a < b for a, b in zip(zs, zs[1:], strict=False))
    z1 = calibrate_gaussian_noise_multiplier(epsilon=1.0, delta=1e-5, releases=1)
    z100 = calibrate_gaussian_noise_multiplier(epsilon=1.0, delta=1e-5, releases=100)
    assert z1 < zs[2] < z100


def test_calibrated_multiplier_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        calibrate_gaussian_noise_multiplier(epsilon=0.0, delta=1e-5, releases=1)
    with pytest.raises(ValueError):
        calibrate_gaussian_noise_multiplier(epsilon=1.0, delta=1.5, releases=1)
    with pytest.raises(ValueError):
        calibrate_gaussian_noise_multiplier(epsilon=1.0, delta=1e-5, releases=0)


# --------------------------------------------------------------------------------------------
# ROW-DP
# --------------------------------------------------------------------------------------------


def _row_dp_setup(seed: int = 5) -> tuple[nn.Sequential, torch.Tensor, dict[str, torch.Tensor]]:
    """Layer 0 (Linear(4, 4), 20 weights) selected; layer 1 (Linear(50, 50)) not.

    Weight 0 of layer 0 (``0.weight[0, 0]``) never moves and ends at 0: importance 0.
    """
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(50, 50))  # never run forward: shapes need not chain
    with torch.no_grad():
        net[0].weight[0, 0] = 0.0
    final = torch.cat([p.detach().reshape(-1) for p in layer_parameters(net)[0]]).double()
    generator = torch.Generator().manual_seed(seed)
    steps = 8
    iterates = final + 0.1 * torch.randn((steps, final.numel()), generator=generator, dtype=torch.float64)
    iterates[-1] = final
    iterates[:, 0] = 0.0
    public = {key: value.detach().clone() + 3.0 for key, value in net.state_dict().items()}
    return net, iterates, public


def test_row_dp_budgets_and_noise() -> None:
    eps = 0.6
    net, iterates, public = _row_dp_setup()
    clipped = globally_clipped(net, PRIVACY["clip_norm"])
    result = release(net, method="row_dp", epsilon=eps, iterates=iterates, selected_layer=0, public_state=public)
    assert result.selected_layer == 0

    # the selected layer's importances by hand: population variance × |last|, normalised
    scores = iterates.var(dim=0, unbiased=False).numpy() * iterates[-1].abs().numpy()
    importance = scores / scores.sum()
    assert importance[0] == 0.0
    budgets = eps * importance.size * importance
    assert budgets.mean() == pytest.approx(eps, rel=1e-12)  # the selected layer's budgets average to ε
    assert result.epsilon_audited_formula == pytest.approx(budgets.max(), rel=1e-9)
    assert result.noise_min == pytest.approx(SIGMA_AT_0_6 * eps / budgets.max(), rel=1e-9)
    assert math.isinf(result.noise_max)  # weight 0 (budget 0)
    assert result.epsilon_rdp == pytest.approx(audited_epsilon_rdp([result.noise_min], **PRIVACY), rel=1e-12)

    # the zero-budget weight releases the public value, exactly
    assert float(net[0].weight.detach()[0, 0]) == float(public["0.weight"][0, 0])
    # every other selected weight releases its local (clipped + noised) value
    released = flat_layers(net)
    public_flat = torch.cat([public["0.weight"].reshape(-1), public["0.bias"]]).double()
    assert not torch.any(released[0][1:] == public_flat[1:])

    # the non-selected layer: noise σ_U(ε) on every weight
    noise = released[1] - clipped[1]
    low, high = std_bounds(SIGMA_AT_0_6, noise.numel())
    assert noise.numel() == 2550
    assert low < float(noise.square().mean().sqrt()) < high


def test_row_dp_exact_zero_budget_weight_releases_the_public_value() -> None:
    net, iterates, public = _row_dp_setup(seed=6)
    result = release(net, method="row_dp", allocation="exact", epsilon=1.0, iterates=iterates, selected_layer=0,
                     public_state=public)
    assert math.isinf(result.noise_max)
    assert float(net[0].weight.detach()[0, 0]) == float(public["0.weight"][0, 0])
    z = calibrate_gaussian_noise_multiplier(epsilon=1.0, delta=PRIVACY["delta"], releases=PRIVACY["exposures"])
    assert result.noise_multiplier == pytest.approx(z, rel=1e-9)


def test_row_dp_refuses_missing_or_misshapen_iterates() -> None:
    net = make_net(3, 2)
    with pytest.raises(ValueError, match="iterates"):
        release(net, method="row_dp", epsilon=1.0)
    with pytest.raises(ValueError, match="iterates must have shape"):
        release(make_net(3, 2), method="row_dp", epsilon=1.0, iterates=torch.zeros(4, 7), selected_layer=0)
    with pytest.raises(ValueError, match="iterates"):
        release(make_net(3, 2), method="row_dp", epsilon=1.0, iterates=torch.zeros(4, 8), selected_layer=1)


def test_select_layer_is_uniform_over_the_layers() -> None:
    net = make_net(3, 4, 5, 2)
    generator = torch.Generator().manual_seed(0)
    draws = [select_layer(net, generator) for _ in range(3000)]
    counts = np.bincount(draws, minlength=3)
    assert counts.size == 3 and counts.min() > 850
    assert scipy.stats.chisquare(counts).pvalue > 1e-6


# --------------------------------------------------------------------------------------------
# refusals and determinism
# --------------------------------------------------------------------------------------------


def test_network_with_buffers_is_refused() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with pytest.raises(ValueError, match="buffers"):
        release(net, method="nbafl", epsilon=1.0)


@pytest.mark.parametrize(("field", "value"), [("method", "dp_sgd"), ("allocation", "bogus"),
                                              ("dispersion_measure", "kurtosis")])
def test_unknown_names_are_refused(field: str, value: str) -> None:
    kwargs = {"method": "nbafl", "epsilon": 1.0, field: value}
    with pytest.raises(ValueError, match=field):
        release(make_net(3, 2), **kwargs)


def test_public_state_must_cover_every_parameter() -> None:
    net = make_net(3, 2)
    with pytest.raises(ValueError, match="public_state lacks"):
        release(net, method="nbafl", epsilon=1.0, public_state={"0.weight": torch.zeros(2, 3)})


@pytest.mark.parametrize(("method", "allocation"), [("nbafl", "paper"), ("ls_adp", "paper"), ("row_dp", "exact")])
def test_same_seed_gives_bit_identical_releases(method: str, allocation: str) -> None:
    def run(seed: int) -> tuple[list[torch.Tensor], object]:
        net = make_net(10, 10, 10, seed=7)
        extra = {"evaluate": OnlyFirstLayer(), "uniform_mix": 0.2} if method == "ls_adp" else {}
        if method == "row_dp":
            extra = {"selected_layer": 1,
                     "iterates": torch.randn((5, 110), generator=torch.Generator().manual_seed(1))}
        result = release(net, method=method, allocation=allocation, epsilon=0.8, seed=seed, **extra)
        return [p.detach().clone() for p in net.parameters()], result

    first, first_release = run(11)
    second, second_release = run(11)
    other, _ = run(12)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert first_release == second_release
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_release_constants_by_hand() -> None:
    # Δs_U = 2 × 1 / 1000; c at δ = 1e-5
    assert nbafl_sensitivity(clip_norm=1.0, min_site_records=1000) == pytest.approx(0.002, rel=1e-15)
    assert gaussian_constant(1e-5) == pytest.approx(4.844805262605389, rel=1e-14)
    # the RDP audit of NbAFL at multiplier c L / ε is epsilon_gaussian_rounds at that multiplier
    z = 4.844805262605389 * 5 / 0.6
    assert audited_epsilon_rdp([SIGMA_AT_0_6], **PRIVACY) == pytest.approx(
        epsilon_gaussian_rounds(noise_multiplier=z, rounds=5, delta=1e-5, orders=list(AUDIT_RDP_ORDERS)), rel=1e-12)
