"""Differentially private set-up statistics (strategies.mechanisms.setup_statistics)."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.isotonic import IsotonicRegression

from models.data import Preprocessor
from models.data.dictionary import DataDictionary
from models.time_grid import event_quantile_grid, make_time_grid, time_grid_from_histogram, time_histogram
from strategies.mechanisms import setup_statistics as setup
from strategies.mechanisms.setup_statistics import (
    AgreedRanges,
    MomentRelease,
    RangeRelease,
    SetupPlan,
    agree_ranges,
    monotone_counts,
    range_edges,
    release_moments,
    release_ranges,
    setup_releases,
    shared_setup,
    time_edges,
)


def table(n: int = 300, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Raw features (numeric with missing values, a heavy tail, a binary numeric column, a
    categorical and a boolean column), times and events."""
    rng = np.random.default_rng(seed)
    features = pd.DataFrame({
        "age": rng.normal(60, 10, n),
        "dose": np.where(rng.random(n) < 0.2, np.nan, rng.lognormal(0.0, 1.0, n)),
        "flag": rng.integers(0, 2, n),
        "stage": pd.Categorical(rng.choice(["I", "II", "III"], n)),
        "smoker": rng.random(n) < 0.3,
    })
    time = np.round(rng.exponential(400.0, n), 1)
    event = (rng.random(n) < 0.6).astype(float)
    return features, time, event


def run_protocol(plan: SetupPlan, sites, rng: np.random.Generator, num_durations: int = 10):
    """Both passes at every site, summed at the server; returns the set-up and the pieces."""
    first = [release_ranges(plan, f, t, rng) for f, t, _ in sites]
    summed_first = functools.reduce(operator.add, first)
    ranges = agree_ranges(plan, summed_first)
    second = [release_moments(plan, ranges, f, t, e, rng) for f, t, e in sites]
    summed_second = functools.reduce(operator.add, second)
    return shared_setup(plan, ranges, summed_first, summed_second, num_durations=num_durations), ranges, first, second


def split(features, time, event, parts: int = 3):
    return [(features.iloc[idx], time[idx], event[idx]) for idx in np.array_split(np.arange(len(time)), parts)]


# --------------------------------------------------------------------------- release vectors


def range_vector(plan: SetupPlan, release: RangeRelease, name: str) -> np.ndarray:
    if name == "record_count":
        return np.array([release.count])
    if name == "time_range":
        return release.time
    return np.concatenate([release.histograms[c] for c in plan.private_numeric])


def moment_vector(plan: SetupPlan, release: MomentRelease, name: str) -> np.ndarray:
    if name == "time_histogram":
        return np.concatenate([release.events, release.censored])
    return np.concatenate([release.moments[c] for c in plan.moment_columns])


def release_vector(plan: SetupPlan, ranges: AgreedRanges, features, time, event, name: str) -> np.ndarray:
    """The exact (noise-free) vector of release ``name`` of one site's records."""
    exact = SetupPlan(plan.columns, plan.numeric, 0.0, plan.adjacency, plan.dictionary, plan.time_grid)
    rng = np.random.default_rng(0)
    if name in RANGE_PASS:
        return range_vector(exact, release_ranges(exact, features, time, rng), name)
    return moment_vector(exact, release_moments(exact, ranges, features, time, event, rng), name)


def with_row(features, time, event, row: dict, t: float, e: float):
    extra = pd.DataFrame({c: [row[c]] for c in features.columns}).astype(features.dtypes.to_dict())
    return pd.concat([features, extra], ignore_index=True), np.append(time, t), np.append(event, e)


def replaced(features, time, event, row: dict, t: float, e: float, position: int = 0):
    features = features.copy()
    for column, value in row.items():
        features.loc[position, column] = value
    time, event = time.copy(), event.copy()
    time[position], event[position] = t, e
    return features, time, event


RELEASES = ("record_count", "time_range", "range_histograms", "time_histogram", "feature_moments")
RANGE_PASS = RELEASES[:3]


@pytest.fixture()
def data():
    return table(120, seed=3)


@pytest.fixture()
def fixed_ranges(data):
    """Public (data-independent) ranges for the second pass: the sensitivity is checked for fixed ranges."""
    return AgreedRanges({"age": (20.0, 100.0), "dose": (0.0, 5.0), "flag": (0.0, 1.0)}, 1000.0,
                        time_bins=setup.TIME_BINS_MAX)


def test_declared_sensitivity_bounds_random_neighbours_and_is_attained_by_a_worst_case_record(data, fixed_ranges):
    features, time, event = data
    plan = SetupPlan.for_features(features)
    declared = {r.name: r.sensitivity for r in setup_releases(plan)}
    assert set(declared) == set(RELEASES)
    rng = np.random.default_rng(11)
    base = {name: release_vector(plan, fixed_ranges, features, time, event, name) for name in RELEASES}
    moved = {name: {"add-remove": 0.0, "replace-one": 0.0} for name in RELEASES}
    for _ in range(40):  # random records, some with missing values, some out of every range
        row = {"age": rng.choice([rng.normal(60, 30), np.nan, 500.0]),
               "dose": rng.choice([rng.exponential(3), np.nan]), "flag": int(rng.integers(0, 2)),
               "stage": rng.choice(["I", "II", "III"]), "smoker": bool(rng.random() < .5)}
        t, e = float(rng.exponential(600)), float(rng.integers(0, 2))
        position = int(rng.integers(120))
        for adjacency, neighbour in (("add-remove", with_row(features, time, event, row, t, e)),
                                     ("replace-one", replaced(features, time, event, row, t, e, position))):
            for name in RELEASES:
                change = np.linalg.norm(release_vector(plan, fixed_ranges, *neighbour, name) - base[name])
                assert change <= declared[name][adjacency] + 1e-9, (name, adjacency)
                moved[name][adjacency] = max(moved[name][adjacency], change)
    # worst cases: every numeric value at its range's upper edge, replaced by one at the lower edge
    # in other histogram bins; an event inside the time range replaced by a censoring elsewhere
    high = {"age": 100.0, "dose": 5.0, "flag": 1, "stage": "I", "smoker": True}
    low = {"age": 20.0, "dose": 0.0, "flag": 0, "stage": "II", "smoker": False}
    worst_added = with_row(features, time, event, high, 10.0, 1.0)
    start = with_row(features, time, event, high, 10.0, 1.0)
    worst_replaced = replaced(*start, low, 900.0, 0.0, position=len(time))
    for name in RELEASES:
        base_high = release_vector(plan, fixed_ranges, *start, name)
        added = np.linalg.norm(release_vector(plan, fixed_ranges, *worst_added, name) - base[name])
        swapped = np.linalg.norm(release_vector(plan, fixed_ranges, *worst_replaced, name) - base_high)
        assert added == pytest.approx(declared[name]["add-remove"], rel=1e-9), name
        assert swapped == pytest.approx(declared[name]["replace-one"], rel=1e-9, abs=1e-12), name
    assert declared["range_histograms"]["add-remove"] == pytest.approx(math.sqrt(3))  # age, dose, flag
    assert declared["time_range"]["replace-one"] == pytest.approx(math.sqrt(2))
    assert declared["feature_moments"]["replace-one"] == pytest.approx(2 * math.sqrt(3))


def test_noise_has_the_declared_standard_deviation_and_mean_zero(data, fixed_ranges):
    features, time, event = data
    plan = SetupPlan.for_features(features, noise_multiplier=3.0)
    stds = {r.name: r.noise_std for r in setup_releases(plan)}
    rng = np.random.default_rng(2024)
    draws = {name: [] for name in RELEASES}
    for _ in range(40):
        first = release_ranges(plan, features, time, rng)
        second = release_moments(plan, fixed_ranges, features, time, event, rng)
        for name in RELEASES:
            vector = range_vector(plan, first, name) if name in RANGE_PASS else moment_vector(plan, second, name)
            draws[name].append(vector - release_vector(plan, fixed_ranges, features, time, event, name))
    for name, noise in draws.items():
        noise = np.concatenate(noise)
        assert abs(noise.mean()) < 4 * stds[name] / math.sqrt(noise.size), name
        assert noise.std() / stds[name] == pytest.approx(1.0, abs=max(0.05, 5 / math.sqrt(2 * noise.size))), name


def test_releases_compose_to_one_gaussian_with_the_plan_noise_multiplier(data):
    features, _, _ = data
    for adjacency in setup.ADJACENCIES:
        plan = SetupPlan.for_features(features, noise_multiplier=7.0, adjacency=adjacency)
        multipliers = [r.noise_multiplier(adjacency) for r in setup_releases(plan)]
        assert sum(z ** -2 for z in multipliers) == pytest.approx(7.0 ** -2, rel=1e-12)
        for release in setup_releases(plan):
            sensitivity = release.sensitivity[adjacency]
            expected = release.noise_multiplier(adjacency) * sensitivity if sensitivity else 0.0
            assert release.noise_std == pytest.approx(expected)
    count = setup_releases(SetupPlan.for_features(features, noise_multiplier=7.0, adjacency="replace-one"))[0]
    assert count.name == "record_count" and count.noise_std == 0.0 and count.noise_multiplier("replace-one") == math.inf
    assert count.noise_multiplier("add-remove") == 0.0  # exact under replace-one: not private under add/remove


def test_the_server_recomputes_the_sites_releases_from_the_public_plan(data):
    features, _, _ = data
    site_a, site_b = features.iloc[:60], features.iloc[60:]
    dictionary = DataDictionary.from_mapping({"numeric": {"age": [0, 120]}, "categorical": {"stage": ["I", "II"]}})
    options = dict(noise_multiplier=4.0, dictionary=dictionary)
    at_sites = [SetupPlan.for_features(site, **options).releases() for site in (site_a, site_b)]
    at_server = SetupPlan(tuple(features.columns), frozenset({"age", "dose", "flag"}), **options).releases()
    assert at_sites[0] == at_sites[1] == at_server
    assert [r.name for r in at_server] == list(RELEASES)


def test_noiseless_sums_of_site_releases_equal_the_release_of_the_pooled_data():
    features, time, event = table(300, seed=1)
    plan = SetupPlan.for_features(features, noise_multiplier=0.0)
    rng = np.random.default_rng(0)
    _, ranges, first, second = run_protocol(plan, split(features, time, event), rng)
    pooled_first = release_ranges(plan, features, time, rng)
    pooled_second = release_moments(plan, ranges, features, time, event, rng)
    summed_first, summed_second = functools.reduce(operator.add, first), functools.reduce(operator.add, second)
    assert summed_first.count == pooled_first.count == 300 and summed_first.sites == 3
    assert summed_first.levels == pooled_first.levels == {"stage": ("I", "II", "III"), "smoker": ("False", "True")}
    for column in plan.private_numeric:
        np.testing.assert_array_equal(summed_first.histograms[column], pooled_first.histograms[column])
        np.testing.assert_allclose(summed_second.moments[column], pooled_second.moments[column], rtol=1e-12)
    np.testing.assert_array_equal(summed_first.time, pooled_first.time)
    np.testing.assert_array_equal(summed_second.events, pooled_second.events)
    np.testing.assert_array_equal(summed_second.censored, pooled_second.censored)


def test_noiseless_setup_equals_the_exact_pooled_preprocessing_and_grid_within_the_histogram_resolution():
    features, time, event = table(400, seed=5)
    plan = SetupPlan.for_features(features, noise_multiplier=0.0)
    shared, ranges, _, _ = run_protocol(plan, split(features, time, event), np.random.default_rng(0))
    exact = Preprocessor.fit(features)
    assert shared.preprocessor.columns == exact.columns and shared.preprocessor.categories == exact.categories
    for column in exact.means:
        assert shared.preprocessor.means[column] == pytest.approx(exact.means[column], rel=1e-9)
        assert shared.preprocessor.stds[column] == pytest.approx(exact.stds[column], rel=1e-9)
        lo, hi = ranges.features[column]
        values = features[column].dropna()
        edges = range_edges()
        assert lo <= values.min() and values.max() < hi  # no value is clipped: the edges of the extreme bins
        assert lo == edges[edges <= values.min()].max() and hi == edges[edges > values.max()].min()
    np.testing.assert_allclose(shared.preprocessor.transform(features), exact.transform(features), atol=1e-5)
    edges = ranges.time_edges()
    assert ranges.time_bins == setup.TIME_BINS_MAX  # without noise, the finest histogram
    np.testing.assert_array_equal(edges, time_edges(ranges.time_max, setup.TIME_BINS_MAX))
    assert time.max() <= ranges.time_max <= time.max() * 10 ** (1 / setup.RANGE_BINS_PER_DECADE)
    events_per_interval = time_histogram(time, event, edges)[0]
    np.testing.assert_array_equal(shared.cuts, event_quantile_grid(edges, events_per_interval, num_durations=10))
    # without noise no pseudo-event: cut k lies in the interval of the exact k/9 event quantile (or at its edge)
    ordered = np.sort(time[event == 1])
    exact_cuts = ordered[np.ceil(np.arange(1, 10) * ordered.size / 9).astype(int) - 1]
    assert shared.cuts.size == 10
    interval = np.searchsorted(edges, exact_cuts, side="left")
    assert np.all(shared.cuts[1:] >= edges[interval - 1] - 1e-9)
    assert np.all(shared.cuts[1:] <= edges[interval] + 1e-9)
    width = np.diff(edges).max()
    assert shared.time_scale[0] == pytest.approx(time.mean(), abs=width / 2)
    assert shared.time_scale[1] == pytest.approx(time.std(), abs=width)


def test_a_full_dictionary_uses_no_data():
    features, time, event = table(200, seed=2)
    dictionary = DataDictionary.from_mapping({
        "numeric": {"age": [30, 90], "dose": [0, 10], "flag": [0, 1]},
        "categorical": {"stage": ["I", "II", "III", "IV"], "smoker": [True, False]},
        "time": {"grid": [0, 100, 300, 1000]},
    })
    plan = SetupPlan.for_features(features, noise_multiplier=5.0, dictionary=dictionary)
    assert [r.name for r in setup_releases(plan)] == ["record_count"]
    real, _, _, _ = run_protocol(plan, split(features, time, event), np.random.default_rng(0))
    blank = pd.DataFrame(np.nan, index=features.index, columns=features.columns)
    other_time = np.random.default_rng(9).exponential(5.0, len(time))
    nothing, _, _, _ = run_protocol(plan, split(blank, other_time, np.zeros_like(event)), np.random.default_rng(1))
    assert real.preprocessor == nothing.preprocessor
    np.testing.assert_array_equal(real.cuts, [0, 100, 300, 1000])
    np.testing.assert_array_equal(nothing.cuts, real.cuts)
    assert real.time_scale == nothing.time_scale == (500.0, 500.0)
    assert real.preprocessor.means["age"] == 60 and real.preprocessor.stds["age"] == 30
    assert real.preprocessor.categories["smoker"] == ("True", "False")
    encoded = real.preprocessor.transform(pd.DataFrame({**{c: features[c] for c in features}, "age": [200.0] * 200}))
    assert np.all(encoded[:, 0] == 1.0)  # clipped to the range, scaled onto [-1, 1]


def test_ranged_moments_standardise_a_column_with_a_public_range_by_its_own_moments():
    features, time, event = table(300, seed=5)
    ranges = {"age": [0, 200], "dose": [0, 4], "flag": [0, 1]}
    dictionary = DataDictionary.from_mapping({"numeric": ranges, "time": {"max": 5000}})
    sites = split(features, time, event)
    public = SetupPlan.for_features(features, noise_multiplier=0.0, dictionary=dictionary)
    own = SetupPlan.for_features(features, noise_multiplier=0.0, dictionary=dictionary, ranged_moments=True)
    assert "feature_moments" not in [r.name for r in setup_releases(public)]
    assert [(r.name, r.size) for r in setup_releases(own) if r.name == "feature_moments"] == [("feature_moments", 9)]
    by_range, _, _, _ = run_protocol(public, sites, np.random.default_rng(0))
    by_moments, _, _, _ = run_protocol(own, sites, np.random.default_rng(0))
    for column, (lo, hi) in ranges.items():
        values = np.clip(features[column].to_numpy(dtype=float), lo, hi)
        values = values[~np.isnan(values)]
        assert by_range.preprocessor.means[column] == (lo + hi) / 2 and by_range.preprocessor.stds[column] == (hi - lo) / 2
        assert by_moments.preprocessor.means[column] == pytest.approx(values.mean(), rel=1e-9)
        assert by_moments.preprocessor.stds[column] == pytest.approx(values.std(), rel=1e-9)
        assert by_moments.preprocessor.ranges[column] == by_range.preprocessor.ranges[column] == (lo, hi)


def test_public_time_range_gives_a_free_equidistant_grid_and_bounds_the_time_histogram():
    features, time, event = table(200, seed=4)
    equidistant = SetupPlan.for_features(features, noise_multiplier=1.0, time_grid="equidistant",
                                         dictionary=DataDictionary.from_mapping({"time": {"max": 2000}}))
    assert [r.name for r in equidistant.releases()] == ["record_count", "range_histograms", "feature_moments"]
    assert equidistant.releases()[1].sensitivity["add-remove"] == pytest.approx(math.sqrt(3))  # no time histogram
    shared, ranges, _, _ = run_protocol(equidistant, split(features, time, event), np.random.default_rng(0))
    np.testing.assert_allclose(shared.cuts, np.linspace(0, 2000, 10))
    quantiles = SetupPlan.for_features(features, noise_multiplier=0.0,
                                       dictionary=DataDictionary.from_mapping({"time": {"max": 2000}}))
    assert "time_histogram" in [r.name for r in quantiles.releases()]
    _, ranges, _, second = run_protocol(quantiles, split(features, time, event), np.random.default_rng(0))
    assert ranges.time_max == 2000.0
    inside = time <= 2000
    summed = functools.reduce(operator.add, second)
    assert summed.events.sum() == event[inside].sum()  # events beyond the range count as censorings
    assert summed.events.sum() + summed.censored.sum() == time.size


def test_noisy_ranges_hold_the_bulk_and_never_reach_empty_far_bins():
    features, time, event = table(3000, seed=6)
    plan = SetupPlan.for_features(features, noise_multiplier=10.0)
    holds_quartiles = 0
    for seed in range(20):
        _, ranges, _, _ = run_protocol(plan, split(features, time, event, 5), np.random.default_rng(seed))
        for column in ("age", "dose"):
            lo, hi = ranges.features[column]
            values = features[column].dropna()
            assert lo <= values.median() <= hi
            assert lo >= -abs(values.min()) * 10 and hi <= values.max() * 10
            holds_quartiles += lo <= values.quantile(0.25) and values.quantile(0.75) <= hi
        assert np.quantile(time, 0.5) <= ranges.time_max <= time.max() * 10
    assert holds_quartiles >= 36  # of 40


def test_a_column_hidden_by_the_noise_is_left_out_and_named_and_hidden_times_stop_in_one_line():
    features, time, event = table(40, seed=8)
    public_time = DataDictionary.from_mapping({"numeric": {"age": [0, 120]}, "time": {"max": 5000}})
    plan = SetupPlan.for_features(features, noise_multiplier=10.0, dictionary=public_time)
    shared, ranges, _, _ = run_protocol(plan, split(features, time, event), np.random.default_rng(0))
    assert ranges.fallbacks.get("dose") == "left out" and "age" not in ranges.fallbacks  # age's range is public
    out = sorted(ranges.left_out)
    assert "dose" not in shared.preprocessor.columns and "age" in shared.preprocessor.columns
    assert shared.preprocessor.transform(features).shape[1] == (
        Preprocessor.fit(features.drop(columns=out)).transform(features.drop(columns=out)).shape[1])
    (note,) = shared.notes  # one line for every fallback together
    assert note.startswith(f"private set-up: {len(out)} of 5 columns left out of the model ({', '.join(out)})")
    assert "no range stood out of the noise" in note and "data.dictionary" in note
    assert "privacy.setup_share" in note and "\n" not in note
    assert shared.left_out == tuple(c for c in plan.columns if c in out)
    private_time = SetupPlan.for_features(features, noise_multiplier=10.0,
                                          dictionary=DataDictionary.from_mapping({"numeric": {"age": [0, 120]}}))
    with pytest.raises(setup.SetupNoiseError) as err:
        run_protocol(private_time, split(features, time, event), np.random.default_rng(0))
    assert "the training times' range histogram does not stand out of the noise" in str(err.value)
    assert "raise privacy.setup_share or privacy.epsilon" in str(err.value) and "\n" not in str(err.value)


def test_a_range_below_the_test_but_clear_of_the_noise_is_found_by_the_scan_fallback():
    """A column whose values stand about 5 noise standard deviations above 0 over a few bins: no
    window passes ``RANGE_THRESHOLD`` at its width, the most significant one does pass ``SCAN_THRESHOLD``."""
    edges = range_edges()
    plan = SetupPlan(("x",), frozenset({"x"}), noise_multiplier=1.0,
                     dictionary=DataDictionary.from_mapping({"time": {"max": 100}}))
    std = plan.noise_std("range_histograms")
    counts = np.zeros(edges.size - 1)
    bins = np.flatnonzero((edges[:-1] >= 10) & (edges[:-1] < 60))  # values in [10, 63.1): 4 bins
    counts[bins] = 5.0 * std * math.sqrt(bins.size) / bins.size
    found = agree_ranges(plan, RangeRelease(counts.sum(), {"x": counts}, None, {}))
    assert found.fallbacks == {"x": "scan"}
    assert found.features["x"] == pytest.approx((10.0, 10 ** 1.8))
    noise = np.random.default_rng(0).normal(0.0, std, counts.size)
    left = [agree_ranges(plan, RangeRelease(0.0, {"x": np.random.default_rng(s).normal(0.0, std, counts.size)}, None,
                                            {})).fallbacks.get("x") for s in range(50)]
    assert left.count("left out") >= 45  # pure noise: the column is left out (the scan's false alarms are rare)
    assert agree_ranges(plan, RangeRelease(0.0, {"x": counts * 3 + noise}, None, {})).fallbacks == {}


def test_noisy_setup_is_close_to_the_exact_one():
    features, time, event = table(6000, seed=7)
    plan = SetupPlan.for_features(features, noise_multiplier=10.0)
    shared, _, _, _ = run_protocol(plan, split(features, time, event, 5), np.random.default_rng(3))
    exact = Preprocessor.fit(features)
    assert abs(shared.preprocessor.means["age"] - exact.means["age"]) < 0.2 * exact.stds["age"]
    assert shared.preprocessor.stds["age"] == pytest.approx(exact.stds["age"], rel=0.25)
    assert shared.time_scale[0] == pytest.approx(time.mean(), rel=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = make_time_grid(time, event, num_durations=10)
    nearest = np.min(np.abs(shared.cuts[:, None] - reference[None, :]), axis=1)
    assert nearest.mean() < 0.05 * time.max()


def test_a_public_time_range_beyond_the_data_does_not_drag_the_grid_into_the_empty_tail():
    features, time, event = table(6000, seed=9)
    time = np.random.default_rng(9).uniform(0, 1000, time.size)
    dictionary = DataDictionary.from_mapping({"time": {"max": 1500}})
    noiseless = SetupPlan.for_features(features, noise_multiplier=0.0, dictionary=dictionary)
    reference, _, _, _ = run_protocol(noiseless, split(features, time, event, 5), np.random.default_rng(0))
    assert reference.cuts.size == 10 and reference.cuts[-1] == pytest.approx(1020)  # the right edge of the last interval with records
    plan = SetupPlan.for_features(features, noise_multiplier=10.0, dictionary=dictionary)
    for seed in range(5):
        shared, _, _, _ = run_protocol(plan, split(features, time, event, 5), np.random.default_rng(seed))
        assert shared.cuts.size >= 9 and shared.cuts[-2] <= 1020  # no quantile cut in the empty tail
        nearest = np.min(np.abs(reference.cuts[:, None] - shared.cuts[None, :]), axis=1)
        assert nearest.mean() < 3 * 30  # three intervals


def test_range_releases_round_trip_and_reject_what_does_not_fit_the_plan(data, fixed_ranges):
    features, time, event = data
    plan = SetupPlan.for_features(features, noise_multiplier=2.0)
    rng = np.random.default_rng(0)
    first = release_ranges(plan, features, time, rng)
    again = RangeRelease.from_dict(first.to_dict(), plan)
    assert again.count == first.count and again.levels == first.levels
    np.testing.assert_array_equal(again.histograms["dose"], first.histograms["dose"])
    second = release_moments(plan, fixed_ranges, features, time, event, rng)
    back = MomentRelease.from_dict(second.to_dict(), plan, fixed_ranges)
    np.testing.assert_array_equal(back.moments["age"], second.moments["age"])
    assert AgreedRanges.from_dict(fixed_ranges.to_dict()) == fixed_ranges
    with pytest.raises(ValueError, match="range of column 'age' must be finite"):
        AgreedRanges({"age": (3.0, 3.0)}, 10.0)
    with pytest.raises(ValueError, match="time_max must be a finite number > 0"):
        AgreedRanges({}, float("nan"))
    payload = first.to_dict()
    with pytest.raises(ValueError, match="range histograms for columns"):
        RangeRelease.from_dict({**payload, "histograms": {"age": payload["histograms"]["age"]}}, plan)
    with pytest.raises(ValueError, match="range histogram of 'age' must be"):
        RangeRelease.from_dict({**payload, "histograms": {**payload["histograms"], "age": [1.0, 2.0]}}, plan)
    with pytest.raises(ValueError, match="record count must be a finite number"):
        RangeRelease.from_dict({**payload, "count": float("nan")}, plan)
    moments = second.to_dict()
    with pytest.raises(ValueError, match="moments of 'age' must be 3 finite numbers"):
        MomentRelease.from_dict({**moments, "moments": {**moments["moments"], "age": [1.0, float("inf"), 2.0]}}, plan,
                                fixed_ranges)
    with pytest.raises(ValueError, match="time histogram \\(events\\) must be"):
        MomentRelease.from_dict({**moments, "events": moments["events"][:-1]}, plan, fixed_ranges)


def test_monotone_counts_is_the_isotonic_fit_of_the_cumulative_counts():
    rng = np.random.default_rng(0)
    exact = rng.poisson(3.0, 50).astype(float)
    np.testing.assert_array_equal(monotone_counts(exact), exact)
    noisy = exact + rng.normal(0, 4.0, 50)
    denoised = monotone_counts(noisy)
    assert np.all(denoised >= 0)
    cumulative = np.concatenate(([0.0], np.cumsum(noisy)))
    weights = np.r_[1e9, np.ones(50)]
    reference = IsotonicRegression().fit_transform(np.arange(51), cumulative, sample_weight=weights)
    np.testing.assert_allclose(np.cumsum(denoised), reference[1:] - reference[0], atol=1e-6)


def test_range_edges_are_symmetric_with_a_central_bin_for_zero():
    edges = range_edges(bins_per_decade=2, decades=(-1, 1))
    np.testing.assert_allclose(edges, [-10, -10 ** 0.5, -1, -10 ** -0.5, -0.1, 0.1, 10 ** -0.5, 1, 10 ** 0.5, 10])
    assert range_edges().size - 1 == 2 * 12 * setup.RANGE_BINS_PER_DECADE + 1


def test_plan_rejects_bad_options(data):
    features, _, _ = data
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        SetupPlan.for_features(features, noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="adjacency must be one of"):
        SetupPlan.for_features(features, adjacency="user")
    with pytest.raises(ValueError, match="time_grid must be one of"):
        SetupPlan.for_features(features, time_grid="log")


def test_a_time_histogram_whose_events_drown_in_noise_gives_the_histograms_own_public_intervals():
    """When no event survives the denoising (a small federation under much noise), every interval counts its one
    noise standard deviation of events: the cuts follow the histogram's public intervals, half log-spaced (early
    resolution) and half equal, over the whole agreed time range, not an even grid."""
    frame = pd.DataFrame({"x": np.linspace(1.0, 2.0, 50)})
    plan = setup.SetupPlan.for_features(frame, noise_multiplier=1.0)
    ranges = setup.AgreedRanges({"x": (0.5, 2.5)}, time_max=100.0, time_bins=20)
    edges = ranges.time_edges()
    summed_ranges = setup.RangeRelease(50.0, {"x": np.zeros(range_edges().size - 1)}, np.zeros(range_edges().size - 1), {})
    moments = setup.MomentRelease(np.full(edges.size - 1, -3.0), np.ones(edges.size - 1),
                                  {"x": np.array([0.0, 10.0, 50.0])})
    shared = setup.shared_setup(plan, ranges, summed_ranges, moments, num_durations=5)
    np.testing.assert_allclose(shared.cuts, event_quantile_grid(edges, np.zeros(edges.size - 1), num_durations=5,
                                                                floor=1.0))
    assert shared.cuts[0] == 0 and shared.cuts[-1] == pytest.approx(100.0) and shared.cuts[1] < 10.0


# --------------------------------------------------------------------------- the budget and the time grid


def test_the_set_up_spends_its_share_of_the_rdp_budget_and_a_larger_epsilon_gives_less_noise():
    """z(ε, δ, s) = z_ε / sqrt(s): the set-up's RDP is s times that of the Gaussian spending (ε, δ) alone,
    which dp-accounting's RDP accountant confirms independently."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    for epsilon in (1.0, 10.0):
        full = setup.setup_noise_multiplier(epsilon=epsilon, delta=1e-5, share=0.9999999)
        spent = RdpAccountant(orders).compose(GaussianDpEvent(full)).get_epsilon(1e-5)
        assert spent == pytest.approx(epsilon, abs=0.011)  # the calibration's tolerance
        for share in (0.05, 0.2, 0.5):
            z = setup.setup_noise_multiplier(epsilon=epsilon, delta=1e-5, share=share)
            assert (1 / (2 * z ** 2)) == pytest.approx(share / (2 * full ** 2), rel=1e-5)  # RDP / alpha
    noisy = [setup.setup_noise_multiplier(epsilon=e, delta=1e-5, share=0.2) for e in (0.5, 1.0, 3.0, 10.0)]
    assert noisy == sorted(noisy, reverse=True) and noisy[-1] < 0.2 * noisy[1]
    assert setup.setup_noise_multiplier(epsilon=1.0, delta=1e-5, share=0.0) == 0.0
    with pytest.raises(ValueError, match="set-up share must be in"):
        setup.setup_noise_multiplier(epsilon=1.0, delta=1e-5, share=1.0)


def test_the_time_histogram_is_as_fine_as_its_noise_allows():
    frame = pd.DataFrame({"x": [1.0, 2.0]})
    bins = [setup.time_bins(SetupPlan.for_features(frame, noise_multiplier=z), 2000.0, 5) for z in (0.0, 1.0, 3.0, 10.0)]
    assert bins[0] == setup.TIME_BINS_MAX and bins == sorted(bins, reverse=True) and bins[-1] < bins[1]
    assert setup.time_bins(SetupPlan.for_features(frame, noise_multiplier=50.0), 100.0, 10) == setup.TIME_BINS_MIN
    for count in (8, 21, 100):
        edges = time_edges(10.0, count)
        assert edges[0] == 0 and edges[-1] == pytest.approx(10.0) and np.all(np.diff(edges) > 0)
        assert edges[1] == pytest.approx(10.0 * setup.TIME_LOG_START) and count - 1 <= edges.size - 1 <= count


def test_histogram_grid_equals_the_kaplan_meier_quantiles_where_records_sit_at_the_edges():
    """With every record at its interval's right edge the curve at the edges is the Kaplan-Meier
    estimate (lifelines); a level crossed inside an interval gets a cut inside it."""
    from lifelines import KaplanMeierFitter

    rng = np.random.default_rng(3)
    edges = np.array([0.0, 1.0, 2.5, 4.0, 7.0, 10.0])
    index = rng.integers(1, edges.size, 300)
    time, event = edges[index], (rng.random(300) < 0.7).astype(float)
    events, censored = time_histogram(time, event, edges + 1e-9)  # time edges[k] in (edges[k-1], edges[k]]
    cuts = time_grid_from_histogram(edges, events, censored, num_durations=6)
    curve = KaplanMeierFitter().fit(time, event).survival_function_at_times(edges).to_numpy()
    levels = np.linspace(curve.min(), 1.0, 6)
    for level, cut in zip(levels[::-1][1:-1], cuts[1:-1]):
        k = int(np.argmax(curve <= level + 1e-12))
        assert edges[k - 1] <= cut <= edges[k]
        share = (curve[k - 1] - level) / (curve[k - 1] - curve[k])
        assert cut == pytest.approx(edges[k - 1] + share * (edges[k] - edges[k - 1]))
    assert cuts[0] == 0 and cuts[-1] == edges[-1]


def test_early_events_get_their_own_intervals_under_noise():
    """An ICU-like cohort: a third of the deaths in the first 2 % of the follow-up. The private grid's
    first interval holds a few per cent of the events, not the whole early third."""
    rng = np.random.default_rng(5)
    n = 4000
    early = rng.random(n) < 0.3
    time = np.where(early, rng.uniform(0.0, 20.0, n), rng.uniform(20.0, 1000.0, n))
    event = np.where(early, 1.0, (rng.random(n) < 0.4).astype(float))
    features = pd.DataFrame({"x": rng.normal(size=n)})
    for z in (0.0, 3.0):
        plan = SetupPlan.for_features(features, noise_multiplier=z)
        shared, _, _, _ = run_protocol(plan, split(features, time, event, 4), np.random.default_rng(1), num_durations=20)
        first = np.mean(time[event == 1] <= shared.cuts[1])
        assert first < 0.12, (z, shared.cuts[:4])
        assert np.sum(shared.cuts < 20.0) >= 4  # several cuts among the early deaths


def test_honest_range_releases_are_plausible_and_inflated_ones_are_not():
    """Each histogram is judged against its own release's noise: with every feature range public the
    times' histogram (its own release) is still noisy, and an honest site passes."""
    features, time, _ = table(600, seed=11)
    public = DataDictionary.from_mapping({"numeric": {"age": [0, 120], "dose": [0, 50], "flag": [0, 1]}})
    for dictionary in (None, public):
        plan = SetupPlan.for_features(features, noise_multiplier=3.0, dictionary=dictionary)
        for seed in range(20):
            release = release_ranges(plan, features, time, np.random.default_rng(seed))
            assert setup.implausible_ranges(release, plan) == "", (dictionary, seed)
        inflated = dataclasses.replace(release, time=release.time + 50 * plan.noise_std("time_range"))
        assert "range histogram of 'time'" in setup.implausible_ranges(inflated, plan)


# --------------------------------------------------------------------------- small federations


def test_the_event_quantile_grid_gives_each_cell_its_share_of_the_events_and_the_floor_every_interval_cuts():
    edges = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    events = np.array([0.0, 10.0, 0.0, 0.0, 10.0])
    np.testing.assert_allclose(event_quantile_grid(edges, events, num_durations=5), [0.0, 1.5, 2.0, 4.5, 5.0])
    # the floor: every interval counts f more events (what the noise cannot rule out), so wherever the noise put
    # the events no cell spans more than about M / ((T - 1) f) intervals (M: all the mass)
    rng = np.random.default_rng(0)
    wide = np.linspace(0.0, 40.0, 41)
    for _ in range(20):
        piled = np.zeros(40)
        piled[rng.integers(40)] = 500.0
        floored = event_quantile_grid(wide, piled, num_durations=20, floor=10.0)
        assert floored[-1] == 40.0 and np.diff(floored).max() <= (500.0 + 400.0) / (19 * 10.0) + 1
    np.testing.assert_allclose(event_quantile_grid(edges, np.zeros(5), num_durations=6, floor=2.0), edges)
    # the grid ends at the last interval with events (censorings only after it)
    assert event_quantile_grid(edges, np.array([0, 0, 3.0, 0, 0]), num_durations=4)[-1] == 3.0
    with pytest.raises(ValueError, match="no interval holds an event"):
        event_quantile_grid(edges, np.zeros(5), num_durations=4)
    with pytest.raises(ValueError, match="floor must be"):
        event_quantile_grid(edges, events, num_durations=4, floor=-1.0)
    with pytest.raises(ValueError, match="events must be 5 finite"):
        event_quantile_grid(edges, events[:-1], num_durations=4)


def _largest_cell(cuts: np.ndarray, time: np.ndarray, event: np.ndarray) -> float:
    """Share of the events in the fullest cell of ``cuts`` (events beyond the last cut count as one more cell)."""
    cell = np.searchsorted(cuts, time[event == 1], side="left")
    return np.bincount(cell, minlength=cuts.size + 1).max() / cell.size


def test_a_small_noisy_federation_with_a_public_follow_up_never_puts_half_the_events_in_one_cell():
    """24 sites of 30 records, ε = 1 at the default share, the follow-up range public: the noise per interval of
    the time histogram is about the events it holds. The Kaplan-Meier quantiles of the denoised histogram put up to
    most of the events in one cell; the event quantiles with a one-noise-std floor keep every cell below a quarter."""
    rng = np.random.default_rng(0)
    n = 24 * 30
    time = np.where(rng.random(n) < 0.3, rng.uniform(0.0, 30.0, n), rng.uniform(30.0, 2000.0, n))
    event = (rng.random(n) < 0.45).astype(float)
    features = pd.DataFrame({"x": rng.normal(size=n)})
    z = setup.setup_noise_multiplier(epsilon=1.0, delta=1e-5, share=0.21)
    public = DataDictionary.from_mapping({"numeric": {"x": [-4, 4]}, "time": {"max": 2400}})
    plan = SetupPlan.for_features(features, noise_multiplier=z, dictionary=public)
    kaplan_meier, quantiles = [], []
    for seed in range(12):
        shared, ranges, _, second = run_protocol(plan, split(features, time, event, 24), np.random.default_rng(seed),
                                                 num_durations=20)
        summed = functools.reduce(operator.add, second)
        trimmed = setup._trim_tail(monotone_counts(summed.events), monotone_counts(summed.censored),
                                   math.sqrt(24) * plan.noise_std("time_histogram"))
        if trimmed[0].sum() > 0:
            cuts = time_grid_from_histogram(ranges.time_edges(), *trimmed, num_durations=20)
            kaplan_meier.append(_largest_cell(cuts, time, event))
        quantiles.append(_largest_cell(shared.cuts, time, event))
        assert shared.cuts[-1] == pytest.approx(2400.0)  # no event lies beyond the grid
    assert max(kaplan_meier) > 0.45 and max(quantiles) < 0.25, (kaplan_meier, quantiles)


def test_a_set_up_that_would_leave_no_column_stops_in_one_line_before_its_second_pass(monkeypatch):
    features, time, event = table(40, seed=8)
    numeric = features[["age", "dose"]]
    plan = SetupPlan.for_features(numeric, noise_multiplier=10.0,
                                  dictionary=DataDictionary.from_mapping({"time": {"max": 5000}}))
    sites = {f"site-{i}": part for i, part in enumerate(split(numeric, time, event))}
    rngs = {name: np.random.default_rng(i) for i, name in enumerate(sites)}
    monkeypatch.setattr(setup, "release_moments", lambda *args: pytest.fail("the second pass released"))
    with pytest.raises(setup.SetupNoiseError) as err:
        setup.run_setup(plan, sites, rngs, num_durations=10, require_inputs=True)
    message = str(err.value)
    assert "all 2 columns would be left out and the model would have no input" in message and "\n" not in message
    for key in ("data.dictionary", "privacy.setup_share", "privacy.epsilon", "fewer, larger sites"):
        assert key in message
    with_levels = SetupPlan.for_features(features, noise_multiplier=10.0, dictionary=plan.dictionary)
    ranges = AgreedRanges({"age": (0.0, 1.0), "dose": (0.0, 1.0), "flag": (0.0, 1.0)}, 5000.0,
                          {"age": "left out", "dose": "left out", "flag": "left out"}, 8)
    setup.check_inputs(with_levels, ranges, release_ranges(with_levels, features, time, np.random.default_rng(0)))


def test_the_fallbacks_are_one_sentence_naming_the_columns():
    ranges = AgreedRanges({f"c{i:02d}": (0.0, 1.0) for i in range(40)}, 10.0,
                          {**{f"c{i:02d}": "left out" for i in range(32)}, "c32": "scan", "time": "scan"}, 8)
    (note,) = ranges.describe(41)
    assert note.startswith("private set-up: 32 of 41 columns left out of the model (c00, c01, ")
    assert f"c{setup.NAMED_COLUMNS - 1:02d} and {32 - setup.NAMED_COLUMNS} more)" in note
    assert "; 1 column ranged by the scan fallback, the histogram's most significant window (c32)" in note
    assert "; the training times ranged by the scan fallback" in note and "\n" not in note
    assert AgreedRanges({"c": (0.0, 1.0)}, 10.0).describe(1) == ()


def test_an_epsilon_no_noise_reaches_is_refused_in_one_line_naming_privacy_epsilon():
    from strategies.accounting.rdp import DEFAULT_RDP_ORDERS, epsilon_floor, rdp_to_epsilon
    from strategies.config import ConfigError

    floor = epsilon_floor(1e-5)
    assert floor == pytest.approx(rdp_to_epsilon(DEFAULT_RDP_ORDERS, np.zeros(len(DEFAULT_RDP_ORDERS)), delta=1e-5))
    assert 0.1 < floor < 0.11 and epsilon_floor(1e-3) < floor
    assert setup.setup_budget_refusal(epsilon=floor * 1.01, delta=1e-5) == ""
    with pytest.raises(ConfigError) as err:
        setup.setup_noise_multiplier(epsilon=0.05, delta=1e-5, share=0.3)
    message = str(err.value)
    assert message.startswith("run config: privacy.epsilon = 0.05 is at or below 0.1029") and "\n" not in message
    assert "raise privacy.epsilon above 0.103" in message and "privacy.delta" in message
