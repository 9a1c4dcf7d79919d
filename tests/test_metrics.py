"""Metrics against lifelines, pycox, scikit-survival and direct computations."""

import math

import numpy as np
import pandas as pd
import pytest
import scipy.integrate
from lifelines import KaplanMeierFitter
from lifelines.utils import concordance_index
from pycox.evaluation import EvalSurv
from sksurv.metrics import brier_score
from sksurv.util import Surv

from models.metrics import (
    brier_at,
    calibration_table,
    default_eval_times,
    evaluate_survival,
    survival_at,
)
from models.survival import restricted_mean_survival_time


def _exponential_data(n, seed, censor_scale=2.0):
    """T ~ Exp(rate exp(beta x)), C ~ Exp(1/censor_scale); true curves on a fine grid."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    rate = 0.5 * np.exp(0.8 * x)
    t = rng.exponential(1 / rate)
    c = rng.exponential(censor_scale, size=n)
    time, event = np.minimum(t, c), (t <= c).astype(int)
    grid = np.linspace(0.0, 8.0, 400)
    surv = np.exp(-np.outer(rate, grid))
    return time, event, grid, surv, rate


def test_survival_at_is_right_continuous_with_one_before_the_grid():
    times = np.array([1.0, 2.0, 4.0])
    surv = np.array([[0.9, 0.5, 0.1]])
    out = survival_at(times, surv, np.array([0.0, 0.999, 1.0, 1.5, 2.0, 3.9, 4.0, 10.0]))
    np.testing.assert_array_equal(out, [[1.0, 1.0, 0.9, 0.9, 0.5, 0.5, 0.1, 0.1]])


def test_harrell_c_matches_lifelines():
    time, event, grid, surv, rate = _exponential_data(500, seed=0)
    train_time, train_event, *_ = _exponential_data(500, seed=1)
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=train_time,
                            censor_event=train_event, risk=np.log(rate))
    assert out["c_index"] == pytest.approx(concordance_index(time, -np.log(rate), event), abs=1e-12)
    default = evaluate_survival(grid, surv, time=time, event=event, censor_time=train_time, censor_event=train_event)
    rmst = restricted_mean_survival_time(grid, surv)
    assert default["c_index"] == pytest.approx(concordance_index(time, rmst, event), abs=1e-12)


def test_antolini_matches_pycox_on_a_grid_holding_the_test_times():
    rng = np.random.default_rng(2)
    n = 300
    time = np.round(rng.exponential(2.0, n), 2)
    event = rng.integers(0, 2, n)
    grid = np.union1d(time, np.linspace(0, 10, 50))
    # crossing curves: Antolini differs from Harrell here
    a, b = rng.uniform(0.2, 1.0, n), rng.uniform(0.5, 2.0, n)
    surv = np.exp(-a[:, None] * grid[None, :] ** b[:, None])
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=time, censor_event=event)
    ref = EvalSurv(pd.DataFrame(surv.T, index=grid), time, event).concordance_td("antolini")
    assert out["c_index_td"] == pytest.approx(ref, abs=1e-12)
    assert abs(out["c_index_td"] - out["c_index"]) > 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_antolini_counts_every_pair_as_its_definition_on_a_coarse_grid(seed):
    """Times before, between and beyond a coarse grid (most records after its last point), tied
    times and tied curve values: the concordant and comparable pairs of the definition, one by one."""
    rng = np.random.default_rng(seed)
    n = 400
    time = np.round(rng.exponential(3.0, n), 1)
    event = rng.integers(0, 2, n)
    grid = np.array([0.5, 1.0, 1.5, 2.5])
    surv = np.round(rng.uniform(0.0, 1.0, (n, grid.size)), 1)
    at_own_time = survival_at(grid, surv, time)  # (n, n): S_j(T_i) in column i
    concordant = comparable = 0
    for i in np.flatnonzero(event == 1):
        for j in range(n):
            if time[i] < time[j] or (time[i] == time[j] and event[j] == 0):
                comparable += 1
                concordant += at_own_time[i, i] < at_own_time[j, i]
    out = evaluate_survival(grid, surv, time=time, event=event)
    assert out["c_index_td"] == concordant / comparable


@pytest.mark.parametrize("seed", range(5))
def test_harrell_and_the_censoring_kaplan_meier_equal_sksurv_with_ties(seed):
    """Tied times (events with censorings), risks tied exactly and within sksurv's 1e-8, small and
    pooled sizes; no censoring and all censored."""
    from sksurv.exceptions import NoComparablePairException
    from sksurv.metrics import concordance_index_censored
    from sksurv.nonparametric import kaplan_meier_estimator

    from models.metrics import _censoring_km, _harrell

    rng = np.random.default_rng(seed)
    for n in (3, 9, 40, 1500):
        time = np.round(rng.exponential(2.0, n), 1) + 0.1
        event = rng.integers(0, 2, n)
        risk = np.round(rng.normal(size=n), 1)
        risk[: n // 3] += rng.choice([0.0, 5e-9, 2e-8], n // 3)  # within and beyond the tolerance
        ours = _harrell(risk, time, event)
        if math.isnan(ours):  # no comparable pair: sksurv refuses
            with pytest.raises((NoComparablePairException, ValueError)):  # ValueError: no event at all
                concordance_index_censored(event.astype(bool), time, risk)
        else:
            assert ours == concordance_index_censored(event.astype(bool), time, risk)[0]
        for censor_event in (event, np.ones(n, dtype=int), np.zeros(n, dtype=int)):
            km = kaplan_meier_estimator(censor_event == 0, time)
            reverse = kaplan_meier_estimator(censor_event == 1, time, reverse=True)
            for ours, theirs in ((_censoring_km(time, censor_event, reverse=False), km),
                                 (_censoring_km(time, censor_event, reverse=True), reverse)):
                np.testing.assert_array_equal(ours[0], theirs[0])
                np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-15, atol=0)


def _censoring_km(train_time, train_event):
    """G(t) = prod_{s <= t} (1 - c_s / n_s) from the training data, as a step function."""
    uniq = np.unique(train_time)
    cens = np.array([np.sum((train_time == s) & (train_event == 0)) for s in uniq])
    at_risk = np.array([np.sum(train_time >= s) for s in uniq])
    values = np.cumprod(1 - cens / at_risk)

    def g(t):
        pos = np.searchsorted(uniq, t, side="right") - 1
        return np.where(pos >= 0, values[np.maximum(pos, 0)], 1.0)

    return g


def test_ibs_matches_direct_ipcw_computation_with_training_censoring():
    time, event, grid, surv, _ = _exponential_data(400, seed=3)
    train_time, train_event, *_ = _exponential_data(1000, seed=4, censor_scale=3.0)
    eval_times = default_eval_times(time, train_time, train_event)
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=train_time,
                            censor_event=train_event, eval_times=eval_times)
    g = _censoring_km(train_time, train_event)
    s = survival_at(grid, surv, eval_times)
    bs = []
    for k, t in enumerate(eval_times):
        case = (time <= t) & (event == 1)
        control = time > t
        bs.append(np.mean(s[:, k] ** 2 * case / g(time) + (1 - s[:, k]) ** 2 * control / g(t)))
    direct = np.trapezoid(bs, eval_times) / (eval_times[-1] - eval_times[0])
    assert out["ibs"] == pytest.approx(direct, rel=1e-10)
    # the censoring records matter: the same test data weighted by their own censoring differ
    other = evaluate_survival(grid, surv, time=time, event=event, censor_time=time, censor_event=event,
                              eval_times=eval_times)
    assert other["ibs"] != pytest.approx(out["ibs"], rel=1e-6)
    np.testing.assert_allclose(
        brier_at(grid, surv, time=time, event=event, censor_time=train_time, censor_event=train_event,
                 horizons=eval_times[[10, 3, 10]]),
        np.array(bs)[[10, 3, 10]], rtol=1e-10,
    )


def test_by_default_the_ipcw_censoring_is_the_evaluated_records_own_as_sksurv_computes_it():
    from sksurv.metrics import integrated_brier_score

    time, event, grid, surv, _ = _exponential_data(400, seed=8)
    default = evaluate_survival(grid, surv, time=time, event=event)
    own = evaluate_survival(grid, surv, time=time, event=event, censor_time=time, censor_event=event)
    assert default == pytest.approx(own, rel=0, abs=0)
    eval_times = default_eval_times(time, time, event)
    test = Surv.from_arrays(event.astype(bool), time)
    reference = integrated_brier_score(test, test, survival_at(grid, surv, eval_times), eval_times)
    assert default["ibs"] == pytest.approx(reference, rel=1e-12)
    np.testing.assert_allclose(brier_at(grid, surv, time=time, event=event, horizons=eval_times[[5, 50]]),
                               brier_score(test, test, survival_at(grid, surv, eval_times[[5, 50]]),
                                           eval_times[[5, 50]])[1], rtol=1e-12)
    with pytest.raises(ValueError, match="go together"):
        evaluate_survival(grid, surv, time=time, event=event, censor_time=time)


@pytest.mark.parametrize("seed", range(6))
def test_ibs_and_brier_at_equal_sksurv_on_small_sites_with_tied_times(seed):
    """A small site's test split (rounded times: events tied with censorings, eval times on the
    records' times), weighted by its own censoring or by other records' (none censored: G = 1)."""
    from sksurv.metrics import integrated_brier_score

    time, event, grid, surv, _ = _exponential_data(9, seed=seed)
    time = np.round(time, 1) + 0.1
    event[:2] = 1, 0
    time[1] = time[0]  # an event and a censoring at the same time
    eval_times = default_eval_times(time, time, event)
    eval_times = np.union1d(eval_times, time[(time > eval_times[0]) & (time < eval_times[-1])])
    test = Surv.from_arrays(event.astype(bool), time)
    at = survival_at(grid, surv, eval_times)
    reference = integrated_brier_score(test, test, at, eval_times)
    assert evaluate_survival(grid, surv, time=time, event=event, eval_times=eval_times)["ibs"] == pytest.approx(
        reference, rel=1e-12)
    other_time = np.linspace(0.05, 1.2 * time.max(), 11)
    uncensored = Surv.from_arrays(np.ones(11, dtype=bool), other_time)
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=other_time,
                            censor_event=np.ones(11, dtype=int), eval_times=eval_times)
    assert out["ibs"] == pytest.approx(integrated_brier_score(uncensored, test, at, eval_times), rel=1e-12)
    np.testing.assert_allclose(brier_at(grid, surv, time=time, event=event, horizons=eval_times),
                               brier_score(test, test, at, eval_times)[1], rtol=1e-12)


def test_inbll_matches_pycox_when_training_and_test_censoring_coincide():
    time, event, grid, surv, _ = _exponential_data(400, seed=5)
    eval_times = default_eval_times(time, time, event)
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=time, censor_event=event,
                            eval_times=eval_times)
    ref = EvalSurv(pd.DataFrame(surv.T, index=grid), time, event.astype(float), censor_surv="km")
    assert out["inbll"] == pytest.approx(ref.integrated_nbll(eval_times), rel=1e-10)
    assert scipy.integrate.simps(np.array([0.0, 1.0, 4.0]), np.array([0.0, 1.0, 2.0])) == pytest.approx(
        scipy.integrate.simpson(np.array([0.0, 1.0, 4.0]), x=np.array([0.0, 1.0, 2.0]))
    )


def test_inbll_matches_pycox_with_the_training_censoring_distribution():
    from pycox.utils import kaplan_meier

    time, event, grid, surv, _ = _exponential_data(400, seed=6)
    train_time, train_event, *_ = _exponential_data(900, seed=7, censor_scale=3.0)
    train_time = np.round(train_time, 2)  # ties between censorings and events
    eval_times = default_eval_times(time, train_time, train_event)
    out = evaluate_survival(grid, surv, time=time, event=event, censor_time=train_time,
                            censor_event=train_event, eval_times=eval_times)
    censor_km = kaplan_meier(train_time, 1 - train_event)
    censor_surv = pd.DataFrame(np.repeat(censor_km.values[:, None], time.size, axis=1), index=censor_km.index)
    ref = EvalSurv(pd.DataFrame(surv.T, index=grid), time, event.astype(float), censor_surv=censor_surv)
    assert out["inbll"] == pytest.approx(ref.integrated_nbll(eval_times), rel=1e-10)


def test_default_eval_times_stay_where_ipcw_is_defined():
    time, event, *_ = _exponential_data(300, seed=6)
    train_time, train_event, *_ = _exponential_data(300, seed=7)
    grid = default_eval_times(time, train_time, train_event)
    lo, hi = np.quantile(time, [0.05, 0.95])
    assert grid.size == 100 and grid[0] == pytest.approx(lo) and grid[-1] == pytest.approx(hi)
    # training data whose last time is censored: censoring KM hits 0 there
    last = train_time.argmax()
    train_event = train_event.copy()
    train_event[last] = 0
    train_time = np.minimum(train_time, np.quantile(time, 0.5))
    grid = default_eval_times(time, train_time, train_event)
    assert grid.size > 2 and grid.max() < train_time.max()


def test_metrics_never_raise_on_small_or_degenerate_sites():
    time, event, grid, surv, _ = _exponential_data(100, seed=8)
    train_time, train_event, *_ = _exponential_data(400, seed=9)
    kwargs = dict(censor_time=train_time, censor_event=train_event)
    out = evaluate_survival(grid, surv, time=time, event=event, **kwargs)
    assert set(out) == {"c_index", "c_index_td", "ibs", "inbll"} and all(np.isfinite(list(out.values())))
    censored = evaluate_survival(grid, surv, time=time, event=np.zeros(100, int), **kwargs)
    assert all(math.isnan(censored[k]) for k in ("c_index", "c_index_td", "ibs"))  # sksurv needs events
    assert np.isfinite(censored["inbll"])  # pycox's IPCW NBLL is defined without events
    single = evaluate_survival(grid, surv[:1], time=time[:1], event=np.array([1]), **kwargs)
    assert all(math.isnan(v) for v in single.values())
    pair = evaluate_survival(grid, surv[:2], time=np.array([0.5, 1.0]), event=np.array([1, 0]), **kwargs)
    assert all(np.isfinite(list(pair.values())))
    nan_curves = evaluate_survival(grid, np.full_like(surv, np.nan), time=time, event=event, **kwargs)
    assert all(math.isnan(v) for v in nan_curves.values())
    wide = evaluate_survival(grid, surv, time=time, event=event, eval_times=np.linspace(-1.0, 50.0, 500), **kwargs)
    assert all(np.isfinite(list(wide.values())))  # eval times outside the IPCW range are dropped
    beyond = evaluate_survival(grid, surv, time=time * 20, event=event, **kwargs)  # outlives training
    assert np.isfinite(beyond["c_index"])
    no_train_events = evaluate_survival(grid, surv, time=time, event=event, censor_time=train_time,
                                        censor_event=np.zeros_like(train_event))
    assert math.isnan(no_train_events["ibs"]) and np.isfinite(no_train_events["c_index"])


def test_brier_at_matches_sksurv_and_is_nan_out_of_range():
    time, event, grid, surv, _ = _exponential_data(300, seed=10)
    train_time, train_event, *_ = _exponential_data(300, seed=11)
    horizons = np.array([0.5, 1.0, 2.0])
    _, ref = brier_score(Surv.from_arrays(train_event.astype(bool), train_time),
                         Surv.from_arrays(event.astype(bool), time), survival_at(grid, surv, horizons), horizons)
    out = brier_at(grid, surv, time=time, event=event, censor_time=train_time, censor_event=train_event,
                   horizons=np.array([2.0, 0.5, 1.0, 1e6]))
    np.testing.assert_allclose(out[:3], ref[[2, 0, 1]], rtol=1e-12)
    assert math.isnan(out[3])


def test_calibration_of_the_true_model_and_km_against_lifelines():
    time, event, grid, surv, _ = _exponential_data(4000, seed=12)
    horizons = np.array([0.5, 1.0, 2.0, 3.0])
    table = calibration_table(grid, surv, time=time, event=event, horizons=horizons)
    assert list(table.columns) == ["horizon", "predicted", "km", "km_lower", "km_upper", "n_at_risk"]
    kmf = KaplanMeierFitter().fit(time, event)
    np.testing.assert_allclose(table["km"], kmf.survival_function_at_times(horizons).to_numpy(), rtol=1e-12)
    ci = kmf.confidence_interval_survival_function_
    lower = ci.iloc[:, 0].reindex(ci.index.union(horizons)).ffill().loc[horizons].to_numpy()
    upper = ci.iloc[:, 1].reindex(ci.index.union(horizons)).ffill().loc[horizons].to_numpy()
    np.testing.assert_allclose(table["km_lower"], lower, rtol=1e-6)
    np.testing.assert_allclose(table["km_upper"], upper, rtol=1e-6)
    # the data-generating model is calibrated: mean predicted survival sits inside the KM 95% CI
    assert np.all(np.abs(table["predicted"] - table["km"]) < 0.02)
    assert np.all((table["km_lower"] <= table["predicted"]) & (table["predicted"] <= table["km_upper"]))
    np.testing.assert_array_equal(table["n_at_risk"], [(time >= h).sum() for h in horizons])
    wrong = calibration_table(grid, surv**2, time=time, event=event, horizons=horizons)
    assert np.all(wrong["predicted"] < wrong["km_lower"])
    assert math.isnan(calibration_table(grid, surv, time=time, event=event, horizons=[1e6])["km"].iloc[0])


@pytest.mark.parametrize("n", [30, 800])
def test_harrell_rounds_the_tie_tolerance_as_sksurv_does(n):
    """Risk differences within a rounding of sksurv's 1e-8 tolerance, over the direct count (n <= 512) and the
    rank counts (n > 512): the same C as sksurv, bit for bit."""
    from sksurv.metrics import concordance_index_censored

    from models.metrics import _harrell

    rng = np.random.default_rng(n)
    for _ in range(20):
        time = np.round(rng.exponential(2.0, n), 1) + 0.1
        event = rng.integers(0, 2, n)
        base = rng.choice([0.3, 1.0, 1e-8, 123.456, -2.5], size=n)
        risk = base + rng.choice([0.0, 1e-8, -1e-8, np.nextafter(1e-8, 1), np.nextafter(1e-8, 0), 1e-8 * (1 + 2**-40),
                                  5e-9], size=n)
        assert _harrell(risk, time, event) == concordance_index_censored(event.astype(bool), time, risk)[0]
