"""Federated Breslow estimator against scikit-survival, lifelines and brute force."""

import numpy as np
import pytest
from lifelines import NelsonAalenFitter
from sksurv.linear_model.coxph import BreslowEstimator

from models.breslow import baseline_cumulative_hazard, baseline_hazard_increments, site_aggregates


def _data(n=400, seed=0):
    rng = np.random.default_rng(seed)
    log_risk = rng.normal(scale=0.7, size=n)
    time = np.round(rng.exponential(10 * np.exp(-log_risk)), 1)  # rounding creates ties
    event = (rng.uniform(size=n) < 0.6).astype(int)
    return time, event, log_risk


def test_exact_breslow_when_grid_holds_every_observed_time():
    time, event, log_risk = _data()
    grid = np.unique(time)
    h0 = baseline_cumulative_hazard(*site_aggregates(time, event, log_risk, grid))
    ref = BreslowEstimator().fit(log_risk, event.astype(bool), time)
    np.testing.assert_array_equal(ref.unique_times_, grid)
    np.testing.assert_allclose(h0, ref.cum_baseline_hazard_.y, rtol=1e-12)


def test_zero_log_risk_gives_nelson_aalen():
    time, event, _ = _data(seed=1)
    grid = np.unique(time)
    h0 = baseline_cumulative_hazard(*site_aggregates(time, event, np.zeros_like(time), grid))
    naf = NelsonAalenFitter(nelson_aalen_smoothing=False).fit(time, event)
    ref = naf.cumulative_hazard_.iloc[:, 0].reindex(grid).to_numpy()
    np.testing.assert_allclose(h0, ref, rtol=1e-12)


def test_three_sites_sum_to_pooled_estimate():
    time, event, log_risk = _data(n=600, seed=2)
    grid = np.quantile(time, np.linspace(0, 1, 25))
    pooled = site_aggregates(time, event, log_risk, grid)
    sites = np.array_split(np.random.default_rng(0).permutation(time.size), 3)
    parts = [site_aggregates(time[s], event[s], log_risk[s], grid) for s in sites]
    summed = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    np.testing.assert_allclose(summed[0], pooled[0])
    np.testing.assert_allclose(summed[1], pooled[1], rtol=1e-12)
    np.testing.assert_allclose(baseline_cumulative_hazard(*summed), baseline_cumulative_hazard(*pooled), rtol=1e-12)


def _brute_force(time, event, log_risk, grid):
    lower = np.concatenate(([-np.inf], grid[:-1]))
    g = log_risk if log_risk.ndim == 2 else np.repeat(log_risk[:, None], grid.size, axis=1)
    d = np.array([np.sum(event * (time > lo) * (time <= hi)) for lo, hi in zip(lower, grid)], dtype=float)
    r = np.array([np.sum(np.exp(g[:, k]) * (time > lower[k])) for k in range(grid.size)])
    return d, r


@pytest.mark.parametrize("time_varying", [False, True])
def test_coarse_grid_matches_definition(time_varying):
    time, event, log_risk = _data(n=200, seed=3)
    grid = np.array([2.0, 5.0, 7.5, 12.0, 20.0])  # some events fall after the last point
    if time_varying:
        log_risk = log_risk[:, None] + np.linspace(-0.5, 0.5, grid.size)[None, :]
    d, r = site_aggregates(time, event, log_risk, grid)
    d_ref, r_ref = _brute_force(time, event, log_risk, grid)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_allclose(r, r_ref, rtol=1e-12)
    assert d.sum() < event.sum()  # events after the grid are ignored


def test_time_constant_matrix_equals_vector_form():
    time, event, log_risk = _data(n=100, seed=4)
    grid = np.linspace(0, 30, 12)
    d1, r1 = site_aggregates(time, event, log_risk, grid)
    d2, r2 = site_aggregates(time, event, np.repeat(log_risk[:, None], grid.size, axis=1), grid)
    np.testing.assert_array_equal(d1, d2)
    np.testing.assert_allclose(r1, r2, rtol=1e-12)


def test_increments_handle_empty_risk_sets_and_reject_inconsistent_aggregates():
    np.testing.assert_array_equal(baseline_hazard_increments([1.0, 0.0, 0.0], [4.0, 2.0, 0.0]), [0.25, 0.0, 0.0])
    with pytest.raises(ValueError, match="empty risk set"):
        baseline_hazard_increments([1.0, 1.0], [2.0, 0.0])
    with pytest.raises(ValueError):
        baseline_hazard_increments([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="increasing"):
        site_aggregates(np.ones(3), np.ones(3), np.zeros(3), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="0/1"):
        site_aggregates(np.ones(3), np.array([0, 2, 1]), np.zeros(3), np.array([1.0, 2.0]))
