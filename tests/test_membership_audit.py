"""Membership-inference audit: the attack's figures by hand and by Mann-Whitney, the DP ceilings
against their closed forms and against mechanisms whose trade-off curves are known exactly."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu, norm

from models.survival import build_survival_model
from models.time_grid import make_time_grid
from strategies.audits.membership import (
    loss_threshold_attack,
    max_accuracy,
    max_advantage,
    max_auc,
    max_true_positive_rate,
    survival_log_loss,
)


def test_attack_figures_by_hand() -> None:
    # members' losses below all non-members' but one: 8 of 9 pairs ordered, AUC 8/9
    audit = loss_threshold_attack(np.array([0.1, 0.2, 0.3]), np.array([0.25, 0.4, 0.5]), fpr=0.01)
    assert audit.auc == pytest.approx(8 / 9)
    # threshold 0.2: TPR 2/3 at FPR 0; threshold 0.3: TPR 1 at FPR 1/3
    assert audit.advantage == pytest.approx(2 / 3)
    assert audit.tpr_at_fpr == pytest.approx(2 / 3)
    assert (audit.members, audit.non_members) == (3, 3)


def test_auc_is_the_mann_whitney_statistic_with_ties() -> None:
    rng = np.random.default_rng(0)
    members = np.round(rng.gamma(2.0, 0.5, size=300), 1)  # rounding makes ties
    non_members = np.round(rng.gamma(2.2, 0.5, size=200), 1)
    audit = loss_threshold_attack(members, non_members)
    u = mannwhitneyu(non_members, members, alternative="two-sided").statistic  # pairs with member loss lower
    assert audit.auc == pytest.approx(u / (members.size * non_members.size), abs=1e-12)


def test_auc_standard_error_matches_the_bootstrap() -> None:
    rng = np.random.default_rng(2)
    members, non_members = rng.normal(0.0, 1.0, 400), rng.normal(0.4, 1.0, 300)
    audit = loss_threshold_attack(members, non_members)
    boot = [loss_threshold_attack(rng.choice(members, members.size), rng.choice(non_members, non_members.size)).auc
            for _ in range(400)]
    assert audit.auc_standard_error == pytest.approx(np.std(boot), rel=0.15)


def test_identical_distributions_give_guessing_and_separated_ones_give_one() -> None:
    rng = np.random.default_rng(1)
    same = loss_threshold_attack(rng.normal(size=20000), rng.normal(size=20000))
    assert abs(same.auc - 0.5) < 0.01 and same.advantage < 0.03
    apart = loss_threshold_attack(rng.uniform(0, 1, 100), rng.uniform(2, 3, 100))
    assert (apart.auc, apart.advantage, apart.tpr_at_fpr) == (1.0, 1.0, 1.0)


def test_ceilings_without_delta_are_the_closed_forms() -> None:
    for epsilon in (0.0, 0.1, 1.0, 3.0, 8.0):
        bound = math.exp(epsilon) / (1 + math.exp(epsilon))
        assert max_accuracy(epsilon=epsilon) == pytest.approx(bound)
        assert max_auc(epsilon=epsilon) == pytest.approx(bound)
        assert max_advantage(epsilon=epsilon) == pytest.approx(math.tanh(epsilon / 2))
    assert max_auc(epsilon=math.inf) == max_advantage(epsilon=math.inf) == 1.0
    assert max_auc(epsilon=5000.0) == max_accuracy(epsilon=5000.0) == 1.0  # e^eps overflows: no bound


def test_auc_ceiling_is_the_area_under_the_tpr_ceiling() -> None:
    grid = np.linspace(0.0, 1.0, 200001)
    for epsilon, delta in ((0.5, 1e-5), (2.0, 0.01), (5.0, 0.1)):
        area = np.trapezoid(max_true_positive_rate(grid, epsilon=epsilon, delta=delta), grid)
        assert max_auc(epsilon=epsilon, delta=delta) == pytest.approx(area, abs=1e-8)
        corner = (1 - delta) / (1 + math.exp(epsilon))
        assert max_advantage(epsilon=epsilon, delta=delta) == pytest.approx(
            float(max_true_positive_rate(corner, epsilon=epsilon, delta=delta)) - corner)


def test_randomised_response_meets_the_ceiling() -> None:
    # One bit kept with probability e^eps/(1+e^eps): the test "bit says member" has exactly the
    # ceiling's TPR at its FPR, so the bound is tight there.
    epsilon = 1.3
    keep = math.exp(epsilon) / (1 + math.exp(epsilon))
    assert float(max_true_positive_rate(1 - keep, epsilon=epsilon)) == pytest.approx(keep)


def test_gaussian_mechanism_tradeoff_lies_under_the_ceiling_of_its_own_epsilon_delta() -> None:
    # mu-GDP (Dong, Roth & Su 2022): optimal TPR at FPR a is Phi(Phi^-1(a) + mu), and the mechanism is
    # (eps, delta(eps))-DP with delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Cor. 2.13).
    # The ceiling of that pair must lie above the whole curve and touch it.
    alpha = np.linspace(1e-6, 1 - 1e-6, 20001)
    for mu in (0.5, 1.0, 2.0):
        curve = norm.cdf(norm.ppf(alpha) + mu)
        for epsilon in (0.5, 1.0, 3.0):
            delta = norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)
            ceiling = max_true_positive_rate(alpha, epsilon=epsilon, delta=delta)
            assert np.all(curve <= ceiling + 1e-9)
            assert np.min(ceiling - curve) < 1e-3


def test_survival_log_loss_by_hand() -> None:
    times = np.array([0.0, 1.0, 2.0, 3.0])
    surv = np.tile([1.0, 0.9, 0.6, 0.2], (4, 1))
    time = np.array([1.5, 1.5, 2.0, 10.0])
    event = np.array([1, 0, 1, 1])
    # event at 1.5 -> interval ending at 2.0: S(1) - S(2); censored at 1.5 -> S(1); event at 2.0 -> S(1) - S(2);
    # beyond the grid -> censored at its end: S(3)
    expected = [-math.log(0.9 - 0.6), -math.log(0.9), -math.log(0.9 - 0.6), -math.log(0.2)]
    np.testing.assert_allclose(survival_log_loss(times, surv, time, event), expected)


def test_survival_log_loss_is_the_hazard_models_own_per_record_loss() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 4))
    time = rng.exponential(1.0, size=200).astype(np.float32).astype(np.float64)  # the model's loss sees float32
    event = rng.integers(0, 2, size=200)
    cuts = make_time_grid(time, event, num_durations=10)
    model = build_survival_model("hazard_mlp", in_features=4, cuts=cuts, hidden=(16,), dropout=0.0,
                                 activation="relu", penalty=0.0, time_scale=(1.0, 1.0), seed=0)
    times, surv = model.predict_survival(x)
    own = model.per_sample_loss(torch.tensor(x, dtype=torch.float32), torch.tensor(time, dtype=torch.float32),
                                torch.tensor(event, dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(survival_log_loss(times, surv, time, event), own, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="member and one non-member"):
        loss_threshold_attack(np.array([]), np.array([1.0]))
    with pytest.raises(ValueError, match="finite"):
        loss_threshold_attack(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="delta"):
        max_auc(epsilon=1.0, delta=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        max_advantage(epsilon=-1.0)
    with pytest.raises(ValueError, match="event"):
        survival_log_loss(np.array([1.0]), np.array([[0.5]]), np.array([1.0]), np.array([2]))
