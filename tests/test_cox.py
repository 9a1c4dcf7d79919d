"""Federated Cox regression (models.cox) against lifelines' CoxPHFitter on public data split
into sites: stratified (strata = sites) and pooled fits, robust variance, PH tests."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from lifelines import CoxPHFitter
from lifelines.datasets import load_gbsg2, load_lung, load_rossi
from lifelines.fitters.coxph_fitter import SemiParametricPHFitter
from lifelines.statistics import proportional_hazard_test as lifelines_ph_test

from models.cox import (
    CoxSums,
    SiteData,
    fit_pooled,
    fit_stratified,
    newton_raphson,
    ph_test_pooled,
    ph_test_stratified,
    pooled_newton_terms,
    site_risk_set_sums,
    site_sums_stratified,
)
from models.km import grid_index

TIGHT = {"precision": 1e-12, "r_precision": 1e-15}


def _rossi() -> tuple[pd.DataFrame, list[str], str, str]:
    df = load_rossi()
    df["site"] = np.random.default_rng(7).integers(0, 4, len(df))
    return df, ["fin", "age", "race", "wexp", "mar", "paro", "prio"], "week", "arrest"


def _gbsg2() -> tuple[pd.DataFrame, list[str], str, str]:
    raw = load_gbsg2()
    df = raw[["age", "tsize", "pnodes", "progrec", "estrec", "time", "cens"]].copy()
    df["horTh"] = (raw["horTh"] == "yes").astype(float)
    df["post"] = (raw["menostat"] == "Post").astype(float)
    df["site"] = raw["tgrade"].map({"I": 0, "II": 1, "III": 2})  # a natural split: tumour grade
    return df, ["age", "tsize", "pnodes", "progrec", "estrec", "horTh", "post"], "time", "cens"


def _lung() -> tuple[pd.DataFrame, list[str], str, str]:
    df = load_lung()[["inst", "time", "status", "age", "sex", "ph.ecog"]].dropna()
    df = df.rename(columns={"inst": "site"})  # the natural split: 18 institutions
    return df.reset_index(drop=True), ["age", "sex", "ph.ecog"], "time", "status"


DATA = {"rossi": _rossi, "gbsg2": _gbsg2, "lung": _lung}


def _sites(df: pd.DataFrame, names: list[str], t: str, e: str, w: str | None = None) -> list[SiteData]:
    """One SiteData per value of ``site``, in sorted order (lifelines' stratum order)."""
    return [SiteData(g[names].values, g[t].values, g[e].values, None if w is None else g[w].values)
            for _, g in df.groupby("site", sort=True)]


def _lifelines(df, t, e, *, strata=True, **kwargs) -> CoxPHFitter:
    fit_kwargs = {k: kwargs.pop(k) for k in ("robust", "weights_col", "fit_options") if k in kwargs}
    frame = df if strata else df.drop(columns="site")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CoxPHFitter(**kwargs).fit(frame, t, e, strata=["site"] if strata else None, **fit_kwargs)


def _assert_matches(result, cph: CoxPHFitter) -> None:
    """β within 1e-4·max(|β|, SE), SEs to 1e-4 relative, p-values to 1e-3, same summary columns."""
    ref = cph.summary.loc[result.params.index]
    scale = np.maximum(ref["coef"].abs(), ref["se(coef)"])
    assert ((result.params - ref["coef"]).abs() / scale).max() < 1e-4
    assert ((result.standard_errors / ref["se(coef)"]) - 1).abs().max() < 1e-4
    assert (result.summary["p"] - ref["p"]).abs().max() < 1e-3
    assert list(result.summary.columns) == list(cph.summary.columns)
    np.testing.assert_allclose(result.summary.values, ref.values, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["rossi", "gbsg2", "lung"])
@pytest.mark.parametrize("penalizer", [0.0, 0.05])
def test_stratified_matches_lifelines(name: str, penalizer: float) -> None:
    df, names, t, e = DATA[name]()
    result = fit_stratified(_sites(df, names, t, e), names, penalizer=penalizer)
    cph = _lifelines(df, t, e, penalizer=penalizer)
    _assert_matches(result, cph)
    assert result.log_likelihood == pytest.approx(cph.log_likelihood_, abs=1e-6)
    lr, ref_lr = result.log_likelihood_ratio_test(), cph.log_likelihood_ratio_test()
    assert lr.statistic == pytest.approx(ref_lr.test_statistic, rel=1e-6)
    assert lr.p_value == pytest.approx(ref_lr.p_value, rel=1e-4, abs=1e-12)
    assert result.converged and result.n == len(df) and result.events == int(df[e].sum())


def test_penalty_convention_is_lifelines_exactly() -> None:
    """With lifelines converged tightly too, β agrees to 1e-6 SE: same standardisation and the
    ridge penalty n·c·½‖β_std‖²."""
    df, names, t, e = _gbsg2()
    result = fit_stratified(_sites(df, names, t, e), names, penalizer=0.3)
    cph = _lifelines(df, t, e, penalizer=0.3, fit_options=TIGHT)
    assert ((result.params - cph.params_).abs() / cph.standard_errors_).max() < 1e-6
    assert result.log_likelihood == pytest.approx(cph.log_likelihood_, abs=1e-9)


@pytest.mark.parametrize("name", ["rossi", "gbsg2"])
@pytest.mark.parametrize("penalizer", [0.0, 0.05])
def test_pooled_on_event_times_matches_lifelines(name: str, penalizer: float) -> None:
    df, names, t, e = DATA[name]()
    result = fit_pooled(_sites(df, names, t, e), names, penalizer=penalizer)
    cph = _lifelines(df, t, e, strata=False, penalizer=penalizer)
    _assert_matches(result, cph)
    assert result.log_likelihood == pytest.approx(cph.log_likelihood_, abs=1e-6)
    assert result.log_likelihood_null == pytest.approx(cph._ll_null_, abs=1e-9)


def test_pooled_on_a_grid_holding_censoring_times_too_is_exact() -> None:
    """Grid points without events change nothing: any grid containing every event time is exact."""
    df, names, t, e = _rossi()
    sites = _sites(df, names, t, e)
    exact = fit_pooled(sites, names)
    finer = fit_pooled(sites, names, grid=np.union1d(df[t].unique(), np.arange(0.5, 60)))
    np.testing.assert_allclose(finer.params, exact.params, rtol=1e-10, atol=1e-12)


def test_pooled_coarse_grid_is_close() -> None:
    """A 100-cell equal-width grid on gbsg2 (about 3 distinct event times per cell)."""
    df, names, t, e = _gbsg2()
    grid = np.linspace(0, df.loc[df[e] == 1, t].max(), 101)[1:]
    coarse = fit_pooled(_sites(df, names, t, e), names, grid=grid)
    cph = _lifelines(df, t, e, strata=False)
    shift = ((coarse.params - cph.params_).abs() / cph.standard_errors_).max()
    print(f"\n100-cell grid on gbsg2: max |Δβ|/SE = {shift:.4f}")
    assert 0 < shift <= 0.1


def test_site_sums_add_up_to_the_pooled_records_sums() -> None:
    df, names, t, e = _gbsg2()
    x = (df[names] - df[names].mean()) / df[names].std()
    beta = np.random.default_rng(1).normal(scale=0.2, size=len(names))
    grid = np.unique(df.loc[df[e] == 1, t])
    parts = [site_risk_set_sums(x.values[idx], df[t].values[idx], df[e].values[idx], beta, grid)
             for idx in df.groupby("site").indices.values()]
    total = sum(parts[1:], parts[0])
    whole = site_risk_set_sums(x.values, df[t].values, df[e].values, beta, grid)
    for field in ("events", "event_weight", "event_x", "event_risk", "event_risk_x", "event_risk_xx",
                  "risk", "risk_x", "risk_xx"):
        np.testing.assert_allclose(getattr(total, field), getattr(whole, field), rtol=1e-10, atol=1e-10)
    assert total.n == whole.n == len(df)
    for a, b in zip(pooled_newton_terms(total, beta), pooled_newton_terms(whole, beta)):
        np.testing.assert_allclose(a, b, rtol=1e-10)


def test_a_common_scale_of_the_risk_scores_per_cell_changes_no_newton_term() -> None:
    df, names, t, e = _gbsg2()
    x = (df[names] - df[names].mean()) / df[names].std()
    beta = np.random.default_rng(2).normal(scale=0.5, size=len(names))
    grid = np.quantile(df.loc[df[e] == 1, t], np.linspace(0.05, 1, 12))
    whole = site_risk_set_sums(x.values, df[t].values, df[e].values, beta, grid)
    for log_scale in (30.0, np.linspace(-5.0, 40.0, grid.size)):  # one number, or one per cell
        scaled = site_risk_set_sums(x.values, df[t].values, df[e].values, beta, grid, log_scale=log_scale)
        np.testing.assert_allclose(scaled.risk, whole.risk * np.exp(-np.broadcast_to(log_scale, grid.shape)),
                                   rtol=1e-12)
        back = scaled.rescaled(log_scale)
        for a, b in zip(pooled_newton_terms(back, beta), pooled_newton_terms(whole, beta)):
            np.testing.assert_allclose(a, b, rtol=1e-12)
        np.testing.assert_array_equal(scaled.event_x, whole.event_x)
    bound = whole.risk_bound()
    for name in ("event_risk", "event_risk_x", "event_risk_xx", "risk", "risk_x", "risk_xx"):
        value = np.abs(getattr(whole, name)).reshape(grid.size, -1)
        assert np.all(value.max(axis=1) <= bound * (1 + 1e-12)), name


def test_newton_reports_each_accepted_point_and_halves_a_trial_it_cannot_evaluate() -> None:
    df, names, t, e = _gbsg2()
    x = ((df[names] - df[names].mean()) / df[names].std()).values
    calls, accepted = [], []

    def sums_at(beta):  # the first trial step "cannot be evaluated": -inf, as an out-of-range secure sum
        calls.append(beta.copy())
        if len(calls) == 2:
            return -np.inf, np.zeros(beta.size), np.eye(beta.size)
        return site_sums_stratified(x, df[t].values, df[e].values, beta).terms()

    result = newton_raphson(sums_at, len(names), accepted=lambda beta: accepted.append(beta.copy()))
    assert result.converged and np.array_equal(accepted[0], np.zeros(len(names)))
    np.testing.assert_allclose(calls[2], calls[1] / 2)  # halved
    assert len(accepted) == result.steps + 1 and np.array_equal(accepted[-1], result.beta)
    assert all(any(np.array_equal(point, call) for call in calls) for point in accepted)


def _lifelines_efron(x, t, e, w, beta) -> tuple[float, np.ndarray, np.ndarray]:
    """lifelines' own per-stratum Efron sums (sorted by time, as it requires)."""
    order = np.lexsort((e, t))
    frame = pd.DataFrame(x[order])
    hessian, gradient, loglik = SemiParametricPHFitter()._get_efron_values_single(
        frame, pd.Series(t[order]), pd.Series(e[order].astype(bool)), pd.Series(w[order]), None, beta)
    return loglik, gradient, -hessian


@pytest.mark.parametrize("weighted", [False, True])
def test_site_sums_are_efron_exactly(weighted: bool) -> None:
    """Each site's loglik, score and information at an arbitrary β equal lifelines' Efron sums
    for that stratum (rossi: many tied weeks), with and without weights."""
    df, names, t, e = _rossi()
    rng = np.random.default_rng(3)
    beta = rng.normal(scale=0.1, size=len(names))
    x = ((df[names] - df[names].mean()) / df[names].std()).values
    w = rng.integers(1, 4, len(df)).astype(float) if weighted else np.ones(len(df))
    total = None
    for idx in df.groupby("site").indices.values():
        sums = site_sums_stratified(x[idx], df[t].values[idx], df[e].values[idx], beta, weights=w[idx])
        ref = _lifelines_efron(x[idx], df[t].values[idx], df[e].values[idx], w[idx], beta)
        np.testing.assert_allclose(sums.loglik, ref[0], rtol=1e-12)
        np.testing.assert_allclose(sums.score, ref[1], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(sums.information, ref[2], rtol=1e-10, atol=1e-10)
        total = sums if total is None else total + sums
    assert total.n == len(df) and total.events == int(df[e].sum())


def test_weighted_stratified_fit_matches_lifelines() -> None:
    df, names, t, e = _rossi()
    df["w"] = np.random.default_rng(5).integers(1, 4, len(df)).astype(float)
    result = fit_stratified(_sites(df, names, t, e, "w"), names)
    _assert_matches(result, _lifelines(df, t, e, weights_col="w"))


def test_site_without_events_and_single_record() -> None:
    x = np.array([[0.3, -1.0], [1.2, 0.4], [-0.5, 2.0]])
    none = site_sums_stratified(x, [5.0, 6.0, 7.0], [0, 0, 0], np.array([0.2, -0.1]))
    assert none.loglik == 0 and not none.score.any() and not none.information.any()
    assert (none.n, none.events) == (3, 0)
    one = site_sums_stratified(x[:1], [5.0], [1], np.array([0.2, -0.1]))
    assert one.loglik == pytest.approx(0.0) and np.allclose(one.score, 0) and np.allclose(one.information, 0)
    assert (one.n, one.events) == (1, 1)
    total = none + one
    assert isinstance(total, CoxSums) and (total.n, total.events) == (4, 1)


def test_robust_stratified_matches_lifelines_with_ties() -> None:
    """ties='lifelines' reproduces lifelines' robust=True on tied data (rossi)."""
    df, names, t, e = _rossi()
    result = fit_stratified(_sites(df, names, t, e), names, robust=True, ties="lifelines")
    cph = _lifelines(df, t, e, robust=True)
    _assert_matches(result, cph)
    model_se = np.sqrt(np.diag(result.variance.values))
    assert np.abs(result.standard_errors.values / model_se - 1).max() > 1e-3  # robust differs from model-based


def _jittered(loader):
    df, names, t, e = loader()
    df[t] = df[t] + np.random.default_rng(11).uniform(0, 0.5, len(df))
    assert df[t].is_unique
    return df, names, t, e


@pytest.mark.parametrize("strata", [True, False])
def test_robust_breslow_matches_lifelines_without_ties(strata: bool) -> None:
    df, names, t, e = _jittered(_gbsg2)
    sites = _sites(df, names, t, e)
    result = fit_stratified(sites, names, robust=True) if strata else fit_pooled(sites, names, robust=True)
    _assert_matches(result, _lifelines(df, t, e, strata=strata, robust=True))


@pytest.mark.parametrize("robust", [False, True])
@pytest.mark.parametrize("transform", ["identity", "log", "rank", "km"])
def test_ph_test_stratified_matches_lifelines(transform: str, robust: bool) -> None:
    df, names, t, e = _rossi()
    sites = _sites(df, names, t, e)
    result = fit_stratified(sites, names, robust=robust, ties="lifelines")
    mine = ph_test_stratified(sites, result, transform)
    ref = lifelines_ph_test(_lifelines(df, t, e, robust=robust), df, time_transform=transform).summary
    np.testing.assert_allclose(mine["test_statistic"], ref["test_statistic"].loc[names], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(mine["p"], ref["p"].loc[names], atol=1e-4)


@pytest.mark.parametrize("transform", ["identity", "log", "km"])
def test_ph_test_pooled_matches_lifelines(transform: str) -> None:
    df, names, t, e = _gbsg2()
    sites = _sites(df, names, t, e)
    mine = ph_test_pooled(sites, fit_pooled(sites, names), transform)
    cph = _lifelines(df, t, e, strata=False)
    ref = lifelines_ph_test(cph, df.drop(columns="site"), time_transform=transform).summary
    np.testing.assert_allclose(mine["test_statistic"], ref["test_statistic"].loc[names], rtol=1e-5, atol=1e-4)


def test_newton_reports_failure_and_recovers_with_penalty() -> None:
    """Perfect separation: no finite MLE, Newton does not converge; a ridge penalty fixes it."""
    x = np.array([[0.0], [1.0], [2.0], [3.0]])
    time, event = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1, 1, 1, 1])

    def sums_at(beta):
        return site_sums_stratified(x, time, event, beta).terms()

    assert not newton_raphson(sums_at, 1, max_steps=15).converged
    assert newton_raphson(sums_at, 1, penalizer=1.0).converged


def test_a_singular_information_names_the_collinear_covariates() -> None:
    """Two columns that carry one variable (SEER's Grade and differentiate: the same levels, two names), and a third
    that sums others: the error names those, not the independent ones."""
    rng = np.random.default_rng(3)
    age, grade, nodes = rng.normal(size=200), rng.integers(1, 4, 200).astype(float), rng.poisson(2, 200) * 1.0
    time, event = rng.exponential(size=200), rng.random(200) < 0.7
    x = np.column_stack([age, grade, nodes, grade])
    with pytest.raises(ValueError, match=r"covariates (grade, differentiate|differentiate, grade) are collinear"):
        fit_stratified([SiteData(x, time, event)], ["age", "grade", "nodes", "differentiate"])
    x = np.column_stack([age, grade, nodes, grade + nodes])
    with pytest.raises(ValueError, match=r"covariates .* are collinear") as raised:
        fit_stratified([SiteData(x, time, event)], ["age", "grade", "nodes", "total"])
    assert "age" not in str(raised.value) and all(name in str(raised.value) for name in ("grade", "nodes", "total"))


def test_errors_name_the_argument() -> None:
    x = np.array([[1.0], [2.0]])
    with pytest.raises(ValueError, match="event must hold only 0/1"):
        site_sums_stratified(x, [1.0, 2.0], [0, 2], np.zeros(1))
    with pytest.raises(ValueError, match="beta must have one coefficient"):
        site_sums_stratified(x, [1.0, 2.0], [1, 0], np.zeros(2))
    with pytest.raises(ValueError, match="grid ends before an event time"):
        site_risk_set_sums(x, [1.0, 5.0], [1, 1], np.zeros(1), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="constant across all sites"):
        fit_stratified([SiteData(np.ones((3, 1)), [1.0, 2.0, 3.0], [1, 0, 1])], ["c"])
    with pytest.raises(ValueError, match="different grids"):
        site_risk_set_sums(x, [1.0, 2.0], [1, 0], np.zeros(1), [2.0]) + site_risk_set_sums(
            x, [1.0, 2.0], [1, 0], np.zeros(1), [3.0])


def test_grid_rounding() -> None:
    """Events round up to the next grid point, censorings down (−1 before the grid)."""
    grid = np.array([2.0, 4.0, 6.0])
    cell = grid_index(np.array([1.0, 1.0, 2.0, 3.0, 3.0, 7.0]), np.array([1, 0, 1, 1, 0, 0]), grid)
    assert cell.tolist() == [0, -1, 0, 1, 0, 2]


def test_print_summary(capsys: pytest.CaptureFixture[str]) -> None:
    df, names, t, e = _rossi()
    fit_stratified(_sites(df, names, t, e), names, robust=True).print_summary()
    out = capsys.readouterr().out
    assert "432 records, 114 events, robust standard errors" in out
    assert all(name in out for name in names) and "log-likelihood ratio test" in out
