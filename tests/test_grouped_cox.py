"""The grouped-time Cox model and its private fit (models/grouped_cox.py): the exact fit against two independent
references, the closed-form score and information against autograd, the outcome-blind clipping's bounds and
unbiasedness, the noise plan's accounting, the covariance's algebra and, slow, the coverage of the private
intervals (benchmarks/dp_cox_coverage.py at fewer replicates)."""

import numpy as np
import pandas as pd
import pytest
from scipy import optimize

from models.grouped_cox import (
    ALPHA_RANGE,
    ClipBounds,
    GroupedCoxDesign,
    NoisePlan,
    PrivateSettings,
    SiteRecords,
    alpha_start,
    count_information,
    delta_method_covariance,
    fit_exact,
    floor_information,
    information_estimate,
    information_matrix,
    newton_update,
    pack_layout,
    prepare_site,
    propagated_covariance,
    record_bounds,
    record_information,
    record_loglik,
    record_score,
    site_counts,
    site_release,
    site_step,
    smoothed_alpha_start,
    smoothed_information,
    start_from_counts,
)

BETA = np.array([0.7, -0.4, 0.2])


def _records(n: int, seed: int, *, last_censored: float = 0.97) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, time, event)``: Weibull PH times (shape 1.5), exponential censoring, the latest times censored."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3))
    event_time = (rng.exponential(size=n) / np.exp(x @ BETA)) ** (1 / 1.5)
    time = np.minimum(event_time, rng.exponential(2.0, size=n))
    event = (event_time <= time).astype(int)
    event[time > np.quantile(time, last_censored)] = 0
    return x, time, event


def _quantile_design(time: np.ndarray, event: np.ndarray, intervals: int) -> GroupedCoxDesign:
    cuts = np.quantile(time[event == 1], np.arange(1, intervals + 1) / (intervals + 1))
    return GroupedCoxDesign(np.concatenate([[0.0], cuts]), low=[-5.0] * 3, high=[5.0] * 3, center=[0.0] * 3)


# ------------------------------------------------------------------------------------- the exact (non-private) fit


def _person_period(x: np.ndarray, time: np.ndarray, event: np.ndarray, grid: np.ndarray,
                   design: GroupedCoxDesign) -> tuple[np.ndarray, np.ndarray]:
    """The expanded data, built record by record: one row per interval a record is at risk in (event: up to the
    interval containing it; censoring: the intervals ending at or before it; times after the grid: all), columns
    one-hot interval then the scaled covariates, and the 0/1 outcome of each row."""
    u = design.scale(x)
    rows, outcome = [], []
    for i in range(time.size):
        end = grid[-1]
        if event[i] and time[i] <= end:
            last = next(j for j in range(1, grid.size) if grid[j] >= time[i])
        else:
            last = max(j for j in range(grid.size) if grid[j] <= min(time[i], end))
        for j in range(1, last + 1):
            rows.append(np.concatenate([np.eye(grid.size - 1)[j - 1], u[i]]))
            outcome.append(1.0 if (event[i] and time[i] <= end and j == last) else 0.0)
    return np.array(rows), np.array(outcome)


def test_the_exact_fit_is_the_person_period_maximum_likelihood():
    """Newton on the closed-form per-record sums (no noise, no clipping) lands, to 1e-6 in β, where scipy's BFGS
    puts the maximum of the same complementary log-log likelihood written on the expanded person-period rows."""
    x, time, event = _records(400, seed=1)
    design = _quantile_design(time, event, intervals=8)
    fit = fit_exact(design, [prepare_site(design, x[:150], time[:150], event[:150]),
                             prepare_site(design, x[150:], time[150:], event[150:])])
    rows, y = _person_period(x, time, event, design.grid, design)

    def negative(theta: np.ndarray) -> tuple[float, np.ndarray]:
        mu = np.exp(rows @ theta)
        loglik = np.where(y == 1, np.log(-np.expm1(-mu)), -mu).sum()
        slope = np.where(y == 1, mu * np.exp(-mu) / -np.expm1(-mu), -mu)
        return -loglik, -(rows.T @ slope)

    start = np.concatenate([np.full(design.intervals, -2.0), np.zeros(3)])
    reference = optimize.minimize(negative, start, jac=True, method="BFGS", options={"gtol": 1e-9, "maxiter": 5000})
    assert np.max(np.abs(negative(reference.x)[1])) < 1e-6  # BFGS may stop at "precision loss": at the optimum
    np.testing.assert_allclose(fit.theta[design.intervals:], reference.x[design.intervals:], atol=1e-6)
    np.testing.assert_allclose(fit.theta, reference.x, atol=1e-5)


def test_on_a_grid_of_every_event_time_beta_is_lifelines_cox():
    """With an interval per distinct event time (continuous data, no ties) the grouped model's β is Cox's: within
    0.1 of lifelines' standard error and 2 % of its value, its standard errors within 1 % (the grouped likelihood
    uses 1 - exp(-μ) per interval where the partial likelihood has its limit: the gap shrinks with the hazards)."""
    from lifelines import CoxPHFitter

    x, time, event = _records(300, seed=2)
    design = GroupedCoxDesign(np.concatenate([[0.0], np.unique(time[event == 1])]), low=[-5.0] * 3, high=[5.0] * 3,
                              center=[0.0] * 3)
    fit = fit_exact(design, [prepare_site(design, x, time, event)])
    frame = pd.DataFrame({"t": time, "e": event, "x0": x[:, 0], "x1": x[:, 1], "x2": x[:, 2]})
    cox = CoxPHFitter().fit(frame, "t", "e")
    assert np.all(np.abs(fit.beta - cox.params_.values) <= 0.1 * cox.standard_errors_.values)
    np.testing.assert_allclose(fit.beta, cox.params_.values, rtol=0.02)
    np.testing.assert_allclose(fit.standard_errors, cox.standard_errors_.values, rtol=0.01)


def test_the_grid_convention_of_prepare_site():
    """Events round up to their interval, censorings down, times after the grid are censored at its end, an event
    at tau_0 is refused; covariates are clipped into their range and centred."""
    design = GroupedCoxDesign(np.array([0.0, 1.0, 2.0, 3.0]), low=[0.0], high=[10.0], center=[5.0])
    records = prepare_site(design, np.array([[-4.0], [5.0], [20.0], [7.5], [2.5]]),
                           np.array([1.5, 1.5, 2.0, 9.0, 0.5]), np.array([1, 0, 0, 1, 0]))
    assert records.at_risk.tolist() == [2, 1, 2, 3, 0]
    assert records.event.tolist() == [True, False, False, False, False]
    np.testing.assert_allclose(records.u[:, 0], [-1.0, 0.0, 1.0, 0.5, -0.5])
    with pytest.raises(ValueError, match="tau_0"):
        prepare_site(design, np.array([[1.0]]), np.array([0.0]), np.array([1]))


# ------------------------------------------------------------------------------------- closed forms vs autograd


def test_score_and_information_are_the_derivatives_of_the_loglik():
    """Per record: the closed-form log-likelihood, score and observed information equal torch's value, gradient
    and negated Hessian of the same likelihood written interval by interval; the expected information is the
    observed one averaged over each at-risk interval's outcome."""
    import torch

    rng = np.random.default_rng(3)
    t, p, n = 5, 3, 12
    records = SiteRecords(u=rng.uniform(-1, 1, (n, p)), at_risk=rng.integers(0, t + 1, n),
                          event=rng.random(n) < 0.6, intervals=t)
    theta = np.concatenate([rng.normal(-1.0, 0.8, t), rng.normal(0, 0.8, p)])
    loglik, score = record_loglik(records, theta), record_score(records, theta)
    observed, expected = record_information(records, theta, "observed"), record_information(records, theta)
    for i in range(n):
        def f(th, i=i):
            u = torch.tensor(records.u[i])
            total = torch.zeros((), dtype=torch.float64)
            for j in range(int(records.at_risk[i])):
                mu = torch.exp(th[j] + u @ th[t:])
                last = bool(records.event[i]) and j == records.at_risk[i] - 1
                total = total + (torch.log(1 - torch.exp(-mu)) if last else -mu)
            return total

        th = torch.tensor(theta, requires_grad=True)
        value = f(th)
        gradient = torch.autograd.grad(value, th)[0].numpy() if records.at_risk[i] else np.zeros(t + p)
        hessian = torch.autograd.functional.hessian(f, torch.tensor(theta)).numpy()
        assert loglik[i] == pytest.approx(float(value.detach()), abs=1e-12)
        np.testing.assert_allclose(score[i], gradient, atol=1e-12)
        np.testing.assert_allclose(information_matrix(observed[i], t, p), -hessian, atol=1e-12)
        mu = np.exp(theta[:t] + records.u[i] @ theta[t:])[: records.at_risk[i]]
        hazard = -np.expm1(-mu)
        weight_event = mu * (mu - 1 + np.exp(-mu)) * np.exp(-mu) / hazard**2
        average = hazard * weight_event + (1 - hazard) * mu
        z = np.concatenate([np.eye(t)[: records.at_risk[i]], np.tile(records.u[i], (records.at_risk[i], 1))], axis=1)
        np.testing.assert_allclose(information_matrix(expected[i], t, p), (z * average[:, None]).T @ z, atol=1e-12)


# ------------------------------------------------------------------------------------- outcome-blind clipping


def _small_design() -> tuple[GroupedCoxDesign, ClipBounds, np.ndarray]:
    design = GroupedCoxDesign(np.linspace(0.0, 3.0, 7), low=[-3.0] * 3, high=[3.0] * 3, center=[0.0] * 3,
                              scales=[1 / 3] * 3)
    bounds = ClipBounds.from_scalars(design, score_alpha=2.0, score_beta=3.0, info_diag=1.0, info_cross=2.0,
                                     info_beta=12.0)
    theta = np.concatenate([np.linspace(-2.5, -0.5, design.intervals), 3 * BETA])
    return design, bounds, theta


def test_every_outcome_of_a_record_releases_within_its_bound():
    """A record's weight and horizon do not depend on its outcome, and whatever the outcome (an event in any
    interval, or censored after any), its released score and information have normalised norm at most 1: no
    record reaches the safety clip."""
    design, bounds, theta = _small_design()
    u = design.scale(np.random.default_rng(4).uniform(-3, 3, (60, 3)))
    t = design.intervals
    reference = record_bounds(SiteRecords(u, np.full(60, t), np.zeros(60, bool), t), theta, bounds)
    for last in range(t + 1):
        for event in (False, True):
            if event and last == 0:
                continue
            records = SiteRecords(u, np.full(60, last), np.full(60, event), t)
            weight, horizon = record_bounds(records, theta, bounds)
            np.testing.assert_array_equal(weight, reference[0])
            np.testing.assert_array_equal(horizon, reference[1])
            for i in range(60):
                one = SiteRecords(u[i:i + 1], records.at_risk[i:i + 1], records.event[i:i + 1], t)
                step = site_step(one, theta, bounds, with_information=True)
                assert step.clipped == 0
                assert np.linalg.norm(step.score / bounds.score) <= 1 + 1e-9
                assert np.linalg.norm(step.information / bounds.information) <= 1 + 1e-9


def test_removing_a_record_moves_each_sum_by_at_most_its_bound():
    """Add/remove-one sensitivity: the site's summed score and information change by normalised norm at most 1
    when any one record is left out."""
    design, bounds, theta = _small_design()
    x, time, event = _records(80, seed=5)
    records = prepare_site(design, np.clip(x, -3, 3), time, event)
    full = site_step(records, theta, bounds, with_information=True)
    for i in range(records.n):
        keep = np.arange(records.n) != i
        rest = SiteRecords(records.u[keep], records.at_risk[keep], records.event[keep], records.intervals)
        part = site_step(rest, theta, bounds, with_information=True)
        assert np.linalg.norm((full.score - part.score) / bounds.score) <= 1 + 1e-9
        assert np.linalg.norm((full.information - part.information) / bounds.information) <= 1 + 1e-9
    assert np.linalg.norm(site_counts(records) - site_counts(rest)) <= 1.0


def test_the_outcome_blind_score_has_mean_zero_at_the_truth():
    """At the true θ the weighted, truncated score has mean 0 over simulated data sets (here within 4 standard
    errors of the mean), while clipping each record's realised score at the same bounds does not. Censoring falls
    on grid points only, where the grouped likelihood is exact (censoring inside an interval coarsens it: the
    interval's risk set loses those records, which biases its α a little whatever the clipping)."""
    design, bounds, _ = _small_design()
    shape, rng = 1.5, np.random.default_rng(6)
    grid = design.grid
    theta = np.concatenate([np.log(np.diff(grid ** shape)), 3 * BETA])
    blind, realised = [], []
    for _ in range(300):
        x = np.clip(rng.standard_normal((400, 3)), -3, 3)
        event_time = (rng.exponential(size=400) / np.exp(x @ BETA)) ** (1 / shape)
        time = np.minimum(event_time, grid[rng.integers(1, grid.size, 400)])
        records = prepare_site(design, x, time, (event_time <= time).astype(int))
        blind.append(site_step(records, theta, bounds, with_information=False).score / bounds.score)
        g = record_score(records, theta) / bounds.score
        realised.append((g / np.maximum(np.linalg.norm(g, axis=1), 1.0)[:, None]).sum(axis=0))
    for sums, centred in ((np.array(blind), True), (np.array(realised), False)):
        z = sums.mean(axis=0) / (sums.std(axis=0, ddof=1) / np.sqrt(len(sums)))
        assert (np.max(np.abs(z)) < 4) == centred, z


# ------------------------------------------------------------------------------------- noise and accounting


def test_the_plan_spends_the_target_epsilon_by_the_accountant_it_used():
    """calibrate_plan's releases compose, by the project's PLD (and RDP) accountant, to ε within 0.01 below the
    target, the same ε as the single Gaussian release it calibrated."""
    from benchmarks.dp_cox_coverage import PLAN, calibrate_plan
    from strategies.accounting.rdp import epsilon_from_history

    for accountant in ("pld", "rdp"):
        plan = calibrate_plan(epsilon=1.0, delta=1e-5, accountant=accountant, **PLAN["sum"])
        spent = epsilon_from_history(plan.history(), delta=1e-5, accountant=accountant)
        single = epsilon_from_history([(plan.total, 1.0, 1)], delta=1e-5, accountant=accountant)
        assert 0.99 <= spent <= 1.0 + 1e-9
        assert spent == pytest.approx(single, abs=1e-9)
        assert len(plan.history()) == 1 + plan.steps + sum(share > 0 for share in plan.info_shares)


def test_the_summed_noise_of_the_two_settings():
    """``sum``: the sites' shares add up to one Gaussian of multiplier z_k on the sum; ``per_site``: each site adds
    the full z_k, K times the variance on the sum. Checked on the sites' actual draws."""
    design, bounds, theta = _small_design()
    empty = SiteRecords(np.zeros((0, 3)), np.zeros(0, int), np.zeros(0, bool), design.intervals)
    for setting, factor in (("sum", 1.0), ("per_site", 6.0)):
        plan = NoisePlan(total=2.0, count_share=0.2, score_shares=(0.8,), info_shares=(0.0, 0.0), setting=setting,
                         sites=6)
        rng = np.random.default_rng(7)
        draws = np.array([sum(site_release(empty, theta, bounds, plan, score_share=0.8, info_share=0.0, rng=rng).score
                              for _ in range(6)) / bounds.score for _ in range(800)])
        assert draws.var() == pytest.approx(factor * plan.multiplier(0.8) ** 2, rel=0.06)
        assert plan.sum_multiplier(0.8) ** 2 == pytest.approx(factor * plan.multiplier(0.8) ** 2)


# ------------------------------------------------------------------------------------- covariance algebra


def test_one_exact_step_is_the_delta_method_and_the_floor_holds():
    rng = np.random.default_rng(8)
    a = rng.normal(size=(6, 6))
    information = a @ a.T + 6 * np.eye(6)
    noise = rng.uniform(0.5, 2.0, 6)
    np.testing.assert_allclose(propagated_covariance(information, [information], [noise]),
                               delta_method_covariance(information, noise), atol=1e-12)
    reference = np.diag(rng.uniform(1, 5, 6))
    floored = floor_information(information - 8 * np.eye(6), 0.5, reference)
    root = np.diag(1 / np.sqrt(np.diag(reference)))
    assert np.linalg.eigvalsh(root @ floored @ root).min() >= 0.5 - 1e-9
    np.testing.assert_allclose(floor_information(information, 1e-6, reference), information, atol=1e-9)


def test_the_information_floor_never_lifts_a_noise_free_release_whatever_the_public_spreads():
    """The estimate's floor is relative to the released information's own diagonal: on correlated covariates whose
    public spreads overstate the real ones tenfold (as a column's half-range once did), a noise-free release is kept
    as released, where the same floor times the counts' public information (independent columns of those spreads)
    would lift it; a noisy release comes out positive definite."""
    floor = PrivateSettings().floor
    rng = np.random.default_rng(12)
    x = rng.multivariate_normal(np.zeros(3), [[1, 0.6, 0.6], [0.6, 1, 0.6], [0.6, 0.6, 1]], size=600)
    event_time = (rng.exponential(size=600) / np.exp(x @ BETA)) ** (1 / 1.5)
    time = np.minimum(event_time, rng.exponential(2.0, size=600))
    design = GroupedCoxDesign(np.linspace(0.0, 2.0, 7), low=[-3.0] * 3, high=[3.0] * 3, center=[0.0] * 3,
                              scales=[10 / 3] * 3)
    bounds = ClipBounds.from_scalars(design, score_alpha=2.0, score_beta=3.0, info_diag=1.0, info_cross=2.0,
                                     info_beta=12.0)
    records = prepare_site(design, np.clip(x, -3, 3), time, (event_time <= time).astype(int))
    theta, reference = start_from_counts(site_counts(records), design)
    packed = site_step(records, theta, bounds, with_information=True).information
    for total, noisy in ((1e-9, False), (3.0, True)):
        plan = NoisePlan(total=total, count_share=0.25, score_shares=(0.5,), info_shares=(0.0, 0.25))
        variance = (plan.sum_multiplier(0.25) * bounds.information) ** 2
        released = packed + (rng.normal(size=packed.shape) * np.sqrt(variance) if noisy else 0.0)
        estimate = information_estimate(released, theta, 0.25, design, plan, bounds, floor)
        smoothed = smoothed_information(released, design, variance, theta[:design.intervals])
        assert np.linalg.eigvalsh(estimate).min() > 0
        if not noisy:
            np.testing.assert_allclose(estimate, smoothed, rtol=1e-9, atol=1e-9)
            assert np.abs(floor_information(smoothed, floor, reference) - smoothed).max() > 1.0
    assert np.allclose(reference, count_information(site_counts(records), theta, design))


def test_smoothing_keeps_an_information_whose_cross_block_follows_the_model():
    """An αβ block that is exactly the diagonal times a line in the cumulative hazard is kept as it is; the
    debiasing adds the fit's expected noise term to the ββ diagonal only."""
    design, bounds, theta = _small_design()
    t, p = design.intervals, design.covariates
    alpha = theta[:t]
    mu = np.exp(alpha)
    hazard = np.cumsum(mu) - mu / 2
    diag = np.linspace(30, 60, t)
    matrix = np.diag(np.concatenate([diag, [50.0, 60.0, 70.0]]))
    cross = diag[:, None] * (np.array([0.1, -0.2, 0.05]) + np.outer(hazard, [0.02, 0.01, -0.03]))
    matrix[:t, t:], matrix[t:, :t] = cross, cross.T
    packed = matrix[pack_layout(t, p)]
    no_noise = smoothed_information(packed, design, np.where(bounds.released, 1e-30, 0.0), alpha)
    np.testing.assert_allclose(no_noise, matrix, atol=1e-8)
    noisy = smoothed_information(packed, design, np.full(packed.shape, 4.0), alpha)
    np.testing.assert_allclose(noisy[:t, :], matrix[:t, :], atol=1e-8)
    assert np.all(np.diag(noisy)[t:] > np.diag(matrix)[t:])


# ------------------------------------------------------------------------------------- server steps


def test_the_smoothed_start_maximises_the_penalised_count_likelihood():
    """smoothed_alpha_start on noisy counts (some cells negative) is scipy's maximiser of the penalised grouped-time
    likelihood of the counts written out here; with a negligible penalty and exact counts it is each interval's own
    hazard (alpha_start); start_from_counts uses the one its ``smooth`` names."""
    x, time, event = _records(400, 21)
    design = _quantile_design(time, event, 8)
    t = design.intervals
    exact = site_counts(prepare_site(design, x, time, event))
    noisy = exact + np.random.default_rng(22).normal(0.0, 25.0, exact.size)
    assert np.any(noisy < 0)
    leaving = np.maximum(noisy[:t] + noisy[t:], 0.0)
    at_risk = np.maximum(np.cumsum(leaving[::-1])[::-1], 1.0)
    events = np.clip(noisy[:t], 0.0, at_risk)
    strength = 40.0

    def negative(alpha: np.ndarray) -> float:
        mu = np.exp(alpha)
        loglik = sum(d * np.log(1 - np.exp(-m)) - (n - d) * m for d, n, m in zip(events, at_risk, mu))
        return -(loglik - strength / 2 * sum((alpha[j] - 2 * alpha[j + 1] + alpha[j + 2]) ** 2 for j in range(t - 2)))

    reference = optimize.minimize(negative, np.full(t, -1.5), method="L-BFGS-B", bounds=[ALPHA_RANGE] * t,
                                  options={"ftol": 1e-14, "gtol": 1e-10, "maxiter": 5000}).x
    smoothed = smoothed_alpha_start(noisy, design, strength)
    np.testing.assert_allclose(smoothed, reference, atol=2e-4)
    np.testing.assert_allclose(smoothed_alpha_start(exact, design, 1e-9), alpha_start(exact, t), atol=1e-5)
    np.testing.assert_allclose(start_from_counts(noisy, design)[0][:t], alpha_start(noisy, t))
    np.testing.assert_allclose(start_from_counts(noisy, design, smooth=strength)[0][:t], smoothed)


def test_a_step_cuts_each_alpha_move_and_leaves_beta_alone():
    design, _, theta = _small_design()
    t = design.intervals
    matrix = np.diag(np.linspace(1.0, 3.0, design.dim))
    score = np.random.default_rng(23).normal(0.0, 3.0, design.dim)
    free = newton_update(theta, score, matrix, np.zeros_like(matrix), t)
    cut = newton_update(theta, score, matrix, np.zeros_like(matrix), t, max_alpha_move=0.5)
    move = score / np.diag(matrix)
    assert np.any(np.abs(move[:t]) > 0.5)
    np.testing.assert_allclose(free[:t], np.clip(theta[:t] + move[:t], *ALPHA_RANGE))
    np.testing.assert_allclose(free[t:], theta[t:] + move[t:])
    np.testing.assert_allclose(cut[:t], theta[:t] + np.clip(move[:t], -0.5, 0.5))
    np.testing.assert_allclose(cut[t:], free[t:])
    with pytest.raises(ValueError, match="max_alpha_move"):
        newton_update(theta, score, matrix, np.zeros_like(matrix), t, max_alpha_move=0.0)


# ------------------------------------------------------------------------------------- coverage (slow)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["sum", "per_site"])
def test_private_intervals_cover_at_the_nominal_rate(setting):
    """benchmarks.dp_cox_coverage at 120 replicates (600 interval-coefficient pairs, ε = 1) of each noise setting's
    recipe: coverage within 0.915-0.985 (the benchmark's 0.925-0.975 target widened by about two Monte Carlo standard
    errors at this size), the intervals wider than without privacy and the mean bias below 0.05 per unit."""
    from benchmarks.dp_cox_coverage import run_setting

    row = run_setting(setting, setting, reps=120, seed=31)
    assert 0.915 <= row["coverage"] <= 0.985, row
    assert row["median_width"] > row["median_width_no_dp"]
    assert max(abs(b) for b in row["mean_bias"]) < 0.05, row
