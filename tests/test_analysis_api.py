"""fedsurv.kaplan_meier and fedsurv.logrank_test (fedsurv/analysis.py) on real public data:
against lifelines' KaplanMeierFitter, logrank_test and multivariate_logrank_test, and against an
independent record-level survdiff computation for the test stratified by site.

NCCTG lung cancer (lifelines' load_lung) with its real institutions (``inst``) as the sites,
Waltons (lifelines) and the Veterans' lung cancer trial (scikit-survival).
"""

from __future__ import annotations

import warnings

import matplotlib
import numpy as np
import pandas as pd
import pytest
from lifelines import KaplanMeierFitter
from lifelines.datasets import load_lung, load_waltons
from lifelines.statistics import logrank_test as lifelines_logrank
from lifelines.statistics import multivariate_logrank_test
from scipy import stats
from sksurv.datasets import load_veterans_lung_cancer

import fedsurv

matplotlib.use("Agg")

TOL = 1e-4


@pytest.fixture(scope="module")
def lung() -> pd.DataFrame:
    """228 patients of 18 institutions; the one record without an institution is dropped."""
    return load_lung().dropna(subset=["inst"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def veterans() -> pd.DataFrame:
    x, y = load_veterans_lung_cancer()
    return x.assign(time=y["Survival_in_days"], status=y["Status"])


def _lifelines_km(time, event, alpha: float = 0.05) -> KaplanMeierFitter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KaplanMeierFitter(alpha=alpha).fit(time, event)


def _assert_km_equal(curve: pd.DataFrame, ref: KaplanMeierFitter) -> None:
    """One curve of fedsurv.kaplan_meier equals a fitted KaplanMeierFitter at every time of its timeline."""
    np.testing.assert_array_equal(curve.index.to_numpy(), ref.survival_function_.index.to_numpy())
    np.testing.assert_allclose(curve["survival"], ref.survival_function_.iloc[:, 0], atol=TOL)
    np.testing.assert_allclose(curve["lower"], ref.confidence_interval_.iloc[:, 0], atol=TOL)
    np.testing.assert_allclose(curve["upper"], ref.confidence_interval_.iloc[:, 1], atol=TOL)
    table = ref.event_table
    np.testing.assert_array_equal(curve["at_risk"], table["at_risk"])
    np.testing.assert_array_equal(curve["events"], table["observed"])
    np.testing.assert_array_equal(curve["censored"], table["censored"])


# ---------------------------------------------------------------------------------------- KM


def test_kaplan_meier_over_institutions_matches_lifelines(lung) -> None:
    curve = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst")
    assert curve.index.name == "time"
    assert list(curve.columns[:6]) == ["survival", "lower", "upper", "at_risk", "events", "censored"]
    _assert_km_equal(curve, _lifelines_km(lung["time"], lung["status"]))
    # the sites' split does not matter: one site gives the same curve
    np.testing.assert_allclose(fedsurv.kaplan_meier(lung, time_col="time", event_col="status"), curve, atol=1e-12)


def test_kaplan_meier_per_group_matches_lifelines_per_group(lung) -> None:
    curves = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst", group_col="sex")
    assert curves.index.names == ["sex", "time"]
    assert curves.index.get_level_values(0).unique().tolist() == [1, 2]
    for sex, part in lung.groupby("sex"):
        _assert_km_equal(curves.loc[sex], _lifelines_km(part["time"], part["status"]))


def test_kaplan_meier_with_text_groups_and_alpha(veterans) -> None:
    sites = veterans.assign(centre=np.random.default_rng(3).choice(["north", "south", "east"], len(veterans)))
    curves = fedsurv.kaplan_meier(sites, time_col="time", event_col="status", site_col="centre",
                                  group_col="Celltype", alpha=0.1)
    assert curves.attrs["alpha"] == 0.1
    for cell, part in sites.groupby("Celltype", observed=True):
        _assert_km_equal(curves.loc[cell], _lifelines_km(part["time"], part["status"], alpha=0.1))


def test_kaplan_meier_on_the_event_time_grid_is_exact(lung) -> None:
    grid = np.unique(lung.loc[lung["status"] == 1, "time"])
    on_grid = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst", grid=grid)
    exact = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst")
    np.testing.assert_array_equal(on_grid.index, grid)
    for column in ("survival", "lower", "upper", "at_risk", "events"):
        np.testing.assert_allclose(on_grid[column], exact.loc[grid, column], atol=1e-12)
    with pytest.raises(ValueError, match="grid ends before an event time"):
        fedsurv.kaplan_meier(lung, time_col="time", event_col="status", grid=grid[:-1])


def test_plot_kaplan_meier_draws_one_curve_per_group(lung) -> None:
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    curves = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst", group_col="sex")
    assert fedsurv.plot_kaplan_meier(curves, ax=ax, censors=True) is ax
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == ["1", "2"]
    assert ax.get_legend().get_title().get_text() == "sex"
    assert ax.get_xlabel() == "time"


# ---------------------------------------------------------------------------------- log-rank


def test_pooled_logrank_matches_lifelines(lung) -> None:
    result = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst",
                                  stratified=False)
    men, women = lung[lung["sex"] == 1], lung[lung["sex"] == 2]
    ref = lifelines_logrank(men["time"], women["time"], men["status"], women["status"])
    assert result.test_name == "logrank_test" and not result.stratified
    assert result.statistic == pytest.approx(ref.test_statistic, abs=TOL)
    assert result.p_value == pytest.approx(ref.p_value, abs=TOL)
    assert result.degrees_of_freedom == 1
    np.testing.assert_allclose(result.observed, [men["status"].sum(), women["status"].sum()])
    assert result.expected.sum() == pytest.approx(lung["status"].sum())
    assert result.summary.loc[0, "test_statistic"] == result.statistic


def test_k_group_logrank_without_sites_matches_lifelines(veterans) -> None:
    result = fedsurv.logrank_test(veterans, time_col="time", event_col="status", group_col="Celltype")
    ref = multivariate_logrank_test(veterans["time"], veterans["Celltype"], veterans["status"])
    assert result.test_name == "multivariate_logrank_test" and result.degrees_of_freedom == 3
    assert result.statistic == pytest.approx(ref.test_statistic, abs=TOL)
    assert result.p_value == pytest.approx(ref.p_value, abs=TOL)
    assert result.groups == ("adeno", "large", "smallcell", "squamous")


def survdiff_stratified(df: pd.DataFrame, t: str, e: str, g: str, site: str) -> tuple[float, float, np.ndarray]:
    """R's survdiff(Surv(t, e) ~ g + strata(site)), record by record: within each site, at each of
    its event times, observed − expected events and the hypergeometric covariance; summed over sites."""
    labels = sorted(df[g].unique())
    k = len(labels)
    z, v, expected = np.zeros(k), np.zeros((k, k)), np.zeros(k)
    for _, s in df.groupby(site):
        for time in np.unique(s.loc[s[e] == 1, t]):
            at_risk = s[s[t] >= time]
            n_j = np.array([(at_risk[g] == lab).sum() for lab in labels], float)
            d_j = np.array([((at_risk[t] == time) & (at_risk[e] == 1) & (at_risk[g] == lab)).sum() for lab in labels])
            n, d = n_j.sum(), d_j.sum()
            z += d_j - n_j * d / n
            expected += n_j * d / n
            if n > 1:
                v += d * (n - d) / (n * n * (n - 1)) * (n * np.diag(n_j) - np.outer(n_j, n_j))
    statistic = float(z[:-1] @ np.linalg.solve(v[:-1, :-1], z[:-1]))
    return statistic, float(stats.chi2.sf(statistic, k - 1)), expected


def test_logrank_stratified_by_institution_is_survdiff_with_strata(lung) -> None:
    result = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst")
    statistic, p_value, expected = survdiff_stratified(lung, "time", "status", "sex", "inst")
    assert result.stratified and result.test_name == "stratified_logrank_test"
    assert result.statistic == pytest.approx(statistic, rel=1e-10)
    assert result.p_value == pytest.approx(p_value, rel=1e-8)
    np.testing.assert_allclose(result.expected, expected, rtol=1e-10)
    pooled = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst",
                                  stratified=False)
    assert abs(result.statistic - pooled.statistic) > 0.1  # stratifying by institution changes the test


def test_stratified_logrank_with_k_groups_and_one_stratum(veterans) -> None:
    sites = veterans.assign(centre=np.random.default_rng(5).integers(1, 5, len(veterans)))
    result = fedsurv.logrank_test(sites, time_col="time", event_col="status", group_col="Celltype",
                                  site_col="centre")
    statistic, p_value, _ = survdiff_stratified(sites, "time", "status", "Celltype", "centre")
    assert result.statistic == pytest.approx(statistic, rel=1e-10)
    assert result.p_value == pytest.approx(p_value, rel=1e-8)
    one = fedsurv.logrank_test(sites.assign(centre=1), time_col="time", event_col="status", group_col="Celltype",
                               site_col="centre")
    pooled = fedsurv.logrank_test(sites, time_col="time", event_col="status", group_col="Celltype")
    assert one.stratified and one.statistic == pytest.approx(pooled.statistic, rel=1e-12)


def test_released_counts_are_each_sites_own_counts(lung) -> None:
    result = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst")
    released = result.released
    assert list(released.columns) == ["site", "time", "group", "at_risk", "events"]
    times = np.unique(lung.loc[lung["status"] == 1, "time"])
    assert sorted(released["site"].unique()) == sorted(lung["inst"].unique())
    for (site, sex), rows in released.groupby(["site", "group"]):
        mine = lung[(lung["inst"] == site) & (lung["sex"] == sex)]
        np.testing.assert_array_equal(rows["time"], times)
        np.testing.assert_array_equal(rows["at_risk"], [(mine["time"] >= t).sum() for t in times])
        np.testing.assert_array_equal(rows["events"], [((mine["time"] == t) & (mine["status"] == 1)).sum()
                                                       for t in times])
    # a site releases only the groups it holds
    held = lung.groupby("inst")["sex"].nunique()
    assert released.groupby("site")["group"].nunique().to_dict() == held.to_dict()
    assert released.groupby("group")["events"].sum().tolist() == result.observed.tolist()


def test_result_prints_like_lifelines(lung) -> None:
    result = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst")
    text = repr(result)
    assert text.startswith("<fedsurv.LogrankTestResult: stratified_logrank_test>")
    for piece in ("degrees_of_freedom = 1", "null_distribution = chi squared", "strata = inst (18 sites)",
                  "test_statistic", "-log2(p)", "<0.005", "no DP", "observed", "expected"):
        assert piece in text
    assert result.to_dict()["observed"] == {1: 111.0, 2: 53.0}


# ------------------------------------------------------------------------------ input handling


@pytest.mark.parametrize("coding", [
    {1: "dead", 0: "alive"}, {1: "Yes", 0: " no "}, {1: "TRUE", 0: "False"}, {1: "1", 0: "0"},
    {1: True, 0: False}, {1: 1.0, 0: 0.0},
])
def test_event_codings_give_the_same_results(lung, coding) -> None:
    recoded = lung.assign(status=lung["status"].map(coding))
    if isinstance(coding[1], bool):
        assert recoded["status"].dtype == bool
    base = fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst")
    other = fedsurv.logrank_test(recoded, time_col="time", event_col="status", group_col="sex", site_col="inst")
    assert other.statistic == base.statistic
    pd.testing.assert_frame_equal(
        fedsurv.kaplan_meier(recoded, time_col="time", event_col="status", group_col="sex"),
        fedsurv.kaplan_meier(lung, time_col="time", event_col="status", group_col="sex"))


def _one_line_error(match: str, function=fedsurv.kaplan_meier, error=ValueError, **kwargs) -> str:
    with pytest.raises(error, match=match) as caught:
        function(**kwargs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_bad_event_values_are_named(lung) -> None:
    frame = lung.assign(status=lung["status"].map({1: "dead", 0: "alive"}).astype(object))
    frame.loc[:2, "status"] = "unknown"
    frame.loc[3, "status"] = np.nan
    message = _one_line_error("event_col 'status' must hold 0/1", data=frame, time_col="time", event_col="status")
    assert "'unknown', nan in 4 of 227 rows" in message
    message = _one_line_error("event_col 'status'", data=lung.assign(status=lung["status"] + 1),
                              time_col="time", event_col="status")
    assert "found 2 in 164 of 227 rows" in message


def test_bad_times_are_counted(lung) -> None:
    frame = lung.assign(time=lung["time"].astype(float))
    frame.loc[:1, "time"] = -1.0
    frame.loc[2, "time"] = np.inf
    frame.loc[3, "time"] = np.nan
    message = _one_line_error("time_col 'time' must hold non-negative, finite numbers; 4 of 227 rows",
                              data=frame, time_col="time", event_col="status")
    assert "1 missing or not a number, 2 negative, 1 infinite" in message
    _one_line_error("time_col 'time'.*1 missing or not a number",
                    data=lung.assign(time=lung["time"].astype(object).where(lung.index > 0, "soon")),
                    time_col="time", event_col="status")


def test_missing_sites_groups_and_columns_are_named(lung) -> None:
    raw = load_lung()  # one record without an institution
    _one_line_error("site_col 'inst' has 1 missing value: drop those rows", data=raw, time_col="time",
                    event_col="status", site_col="inst")
    _one_line_error("group_col 'ph.ecog' has 1 missing value", fedsurv.logrank_test, data=lung, time_col="time",
                    event_col="status", group_col="ph.ecog")
    _one_line_error("event_col='death' is not a column of data", data=lung, time_col="time", event_col="death")
    _one_line_error("data must be a pandas DataFrame", error=TypeError, data=lung.to_numpy(), time_col="time", event_col="status")


def test_logrank_refusals(lung) -> None:
    _one_line_error(r"group_col 'sex' has a single level \(1\)", fedsurv.logrank_test, data=lung[lung["sex"] == 1],
                    time_col="time", event_col="status", group_col="sex")
    _one_line_error("stratified=True needs site_col", fedsurv.logrank_test, data=lung, time_col="time",
                    event_col="status", group_col="sex", stratified=True)
    _one_line_error("no site of site_col 'site' holds two levels", fedsurv.logrank_test,
                    data=lung.assign(site=lung["sex"]), time_col="time", event_col="status", group_col="sex",
                    site_col="site")
    _one_line_error("has no events", fedsurv.logrank_test, data=lung.assign(status=0), time_col="time",
                    event_col="status", group_col="sex")


def test_waltons_text_groups_match_lifelines() -> None:
    df = load_waltons().assign(site=lambda d: np.random.default_rng(2).integers(0, 3, len(d)))
    result = fedsurv.logrank_test(df, time_col="T", event_col="E", group_col="group", site_col="site",
                                  stratified=False)
    a, b = df[df["group"] == "control"], df[df["group"] == "miR-137"]
    ref = lifelines_logrank(a["T"], b["T"], a["E"], b["E"])
    assert result.statistic == pytest.approx(ref.test_statistic, abs=TOL)
    assert result.p_value == pytest.approx(ref.p_value, abs=TOL)
    curves = fedsurv.kaplan_meier(df, time_col="T", event_col="E", site_col="site", group_col="group")
    _assert_km_equal(curves.loc["miR-137"], _lifelines_km(b["T"], b["E"]))
