"""Federated Kaplan–Meier and log-rank tests (models.km) against lifelines and scikit-survival
on public data split into sites."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from lifelines import KaplanMeierFitter
from lifelines.datasets import load_gbsg2, load_rossi, load_waltons
from lifelines.statistics import logrank_test as lifelines_logrank
from lifelines.statistics import multivariate_logrank_test
from sksurv.compare import compare_survival

from models.km import (
    combine_km_counts,
    kaplan_meier,
    logrank_test,
    site_km_counts,
    site_logrank_sums,
)
from tests.test_analysis_api import survdiff_stratified


def _waltons() -> tuple[pd.DataFrame, str, str, str]:
    df = load_waltons()
    df["site"] = np.random.default_rng(2).integers(0, 3, len(df))
    return df, "T", "E", "group"


def _gbsg2() -> tuple[pd.DataFrame, str, str, str]:
    df = load_gbsg2()
    df["site"] = np.random.default_rng(4).integers(0, 4, len(df))
    return df, "time", "cens", "tgrade"


def _rossi() -> tuple[pd.DataFrame, str, str, str]:
    df = load_rossi()
    df["site"] = np.random.default_rng(6).integers(0, 5, len(df))
    return df, "week", "arrest", "fin"


DATA = {"waltons": _waltons, "gbsg2": _gbsg2, "rossi": _rossi}


def _site_frames(df: pd.DataFrame) -> list[pd.DataFrame]:
    return [g for _, g in df.groupby("site", sort=True)]


def _lifelines_km(df: pd.DataFrame, t: str, e: str, weights=None) -> KaplanMeierFitter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KaplanMeierFitter().fit(df[t], df[e], weights=weights)


@pytest.mark.parametrize("name", ["waltons", "gbsg2", "rossi"])
def test_kaplan_meier_matches_lifelines(name: str) -> None:
    df, t, e, _ = DATA[name]()
    km = kaplan_meier(combine_km_counts([site_km_counts(g[t], g[e]) for g in _site_frames(df)]))
    ref = _lifelines_km(df, t, e)
    times = km.index.values
    np.testing.assert_array_equal(times, np.unique(df[t]))
    np.testing.assert_allclose(km["survival"], ref.survival_function_.loc[times, "KM_estimate"], atol=1e-10)
    ci = ref.confidence_interval_.loc[times]
    np.testing.assert_allclose(km["lower"], ci.iloc[:, 0], atol=1e-10)
    np.testing.assert_allclose(km["upper"], ci.iloc[:, 1], atol=1e-10)
    np.testing.assert_allclose(km["at_risk"], ref.event_table.loc[times, "at_risk"])
    np.testing.assert_allclose(km["events"], ref.event_table.loc[times, "observed"])
    np.testing.assert_allclose(km["greenwood_sum"], ref._cumulative_sq_.loc[times], rtol=1e-10)


def test_kaplan_meier_at_a_lower_alpha() -> None:
    df, t, e, _ = _gbsg2()
    km = kaplan_meier(combine_km_counts([site_km_counts(g[t], g[e]) for g in _site_frames(df)]), alpha=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = KaplanMeierFitter(alpha=0.1).fit(df[t], df[e])
    np.testing.assert_allclose(km["lower"], ref.confidence_interval_.loc[km.index].iloc[:, 0], atol=1e-10)


def test_combined_counts_equal_the_pooled_records_counts() -> None:
    df, t, e, _ = _gbsg2()
    combined = combine_km_counts([site_km_counts(g[t], g[e]) for g in _site_frames(df)])
    whole = site_km_counts(df[t], df[e])
    for field in ("times", "at_risk", "events", "censored"):
        np.testing.assert_array_equal(getattr(combined, field), getattr(whole, field))


def test_kaplan_meier_on_the_event_time_grid_is_exact() -> None:
    """Sites reveal counts only at event times (censoring rounds down) and lose nothing there."""
    df, t, e, _ = _gbsg2()
    grid = np.unique(df.loc[df[e] == 1, t])
    km = kaplan_meier(combine_km_counts([site_km_counts(g[t], g[e], grid) for g in _site_frames(df)]))
    ref = _lifelines_km(df, t, e)
    np.testing.assert_allclose(km["survival"], ref.survival_function_.loc[grid, "KM_estimate"], atol=1e-12)
    np.testing.assert_allclose(km["upper"], ref.confidence_interval_.loc[grid].iloc[:, 1], atol=1e-10)
    np.testing.assert_allclose(km["at_risk"], ref.event_table.loc[grid, "at_risk"])


def test_weighted_kaplan_meier_matches_lifelines() -> None:
    df, t, e, _ = _waltons()
    df["w"] = np.random.default_rng(8).integers(1, 4, len(df)).astype(float)
    km = kaplan_meier(combine_km_counts([site_km_counts(g[t], g[e], weights=g["w"]) for g in _site_frames(df)]))
    ref = _lifelines_km(df, t, e, weights=df["w"])
    np.testing.assert_allclose(km["survival"], ref.survival_function_.loc[km.index, "KM_estimate"], atol=1e-10)
    np.testing.assert_allclose(km["lower"], ref.confidence_interval_.loc[km.index].iloc[:, 0], atol=1e-10)


def _site_logrank(df: pd.DataFrame, t: str, e: str, g: str, times: np.ndarray | None = None):
    times = np.unique(df.loc[df[e] == 1, t]) if times is None else times
    return [site_logrank_sums(s[t], s[e], s[g], times) for s in _site_frames(df)]


@pytest.mark.parametrize("name", ["waltons", "rossi"])
def test_two_group_logrank_matches_lifelines(name: str) -> None:
    df, t, e, g = DATA[name]()
    result = logrank_test(_site_logrank(df, t, e, g))
    labels = sorted(df[g].unique())
    a, b = df[df[g] == labels[0]], df[df[g] == labels[1]]
    ref = lifelines_logrank(a[t], b[t], a[e], b[e])
    assert result.statistic == pytest.approx(ref.test_statistic, rel=1e-8)
    assert result.p_value == pytest.approx(ref.p_value, rel=1e-6, abs=1e-12)
    assert result.degrees_of_freedom == 1
    np.testing.assert_allclose(result.observed, [a[e].sum(), b[e].sum()])
    assert result.expected.sum() == pytest.approx(df[e].sum())


def test_k_group_logrank_matches_lifelines_and_sksurv() -> None:
    df, t, e, g = _gbsg2()
    result = logrank_test(_site_logrank(df, t, e, g))
    ref = multivariate_logrank_test(df[t], df[g], df[e])
    assert result.statistic == pytest.approx(ref.test_statistic, rel=1e-8)
    assert result.p_value == pytest.approx(ref.p_value, rel=1e-6, abs=1e-15)
    assert result.degrees_of_freedom == 2
    y = np.array(list(zip(df[e].astype(bool), df[t].astype(float))), dtype=[("event", bool), ("time", float)])
    chisq, pvalue = compare_survival(y, df[g].values)
    assert result.statistic == pytest.approx(chisq, rel=1e-8)
    assert result.p_value == pytest.approx(pvalue, rel=1e-6, abs=1e-15)


def test_logrank_on_a_grid_with_censoring_times_is_unchanged() -> None:
    df, t, e, g = _waltons()
    exact = logrank_test(_site_logrank(df, t, e, g))
    finer = logrank_test(_site_logrank(df, t, e, g, np.unique(df[t])))
    assert finer.statistic == pytest.approx(exact.statistic, rel=1e-12)


def test_a_site_lacking_a_group_is_aligned() -> None:
    df, t, e, g = _gbsg2()
    df = df[~((df["site"] == 0) & (df[g] == "I"))]
    result = logrank_test(_site_logrank(df, t, e, g))
    assert result.statistic == pytest.approx(multivariate_logrank_test(df[t], df[g], df[e]).test_statistic, rel=1e-8)


@pytest.mark.parametrize("name", ["rossi", "gbsg2"])
def test_stratified_logrank_matches_a_direct_computation(name: str) -> None:
    df, t, e, g = DATA[name]()
    result = logrank_test(_site_logrank(df, t, e, g), stratified=True)
    statistic, p_value, _ = survdiff_stratified(df, t, e, g, "site")
    assert result.statistic == pytest.approx(statistic, rel=1e-10)
    assert result.p_value == pytest.approx(p_value, rel=1e-8)
    assert result.statistic != pytest.approx(logrank_test(_site_logrank(df, t, e, g)).statistic, rel=1e-4)


def test_stratified_logrank_with_one_stratum_is_the_pooled_test() -> None:
    df, t, e, g = _rossi()
    times = np.unique(df.loc[df[e] == 1, t])
    one = site_logrank_sums(df[t], df[e], df[g], times)
    assert logrank_test([one], stratified=True).statistic == pytest.approx(
        logrank_test(_site_logrank(df, t, e, g)).statistic, rel=1e-12)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="grid ends before an event time"):
        site_km_counts([1.0, 5.0], [1, 1], grid=[1.0, 2.0])
    with pytest.raises(ValueError, match="different times"):
        site_logrank_sums([1.0], [1], ["a"], [1.0]) + site_logrank_sums([1.0], [1], ["a"], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least two groups"):
        logrank_test(site_logrank_sums([1.0, 2.0], [1, 1], ["a", "a"], [1.0, 2.0]))
    with pytest.raises(ValueError, match="time must be finite"):
        site_km_counts([1.0, np.nan], [1, 0])
    with pytest.raises(ValueError, match="group must have one label per record"):
        site_logrank_sums([1.0, 2.0], [1, 1], ["a"], [1.0, 2.0])
