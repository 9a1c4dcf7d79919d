"""Differentially private set-up statistics (strategies.mechanisms.setup_statistics)."""

from __future__ import annotations

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
from models.time_grid import make_time_grid, time_grid_from_histograms, time_histogram
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
    warnings.filterwarnings("ignore", message="quantile cuts are not unique")
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
    blocks = [release.histograms[c] for c in plan.private_numeric]
    return np.concatenate(blocks + ([release.time] if release.time is not None else []))


def moment_vector(plan: SetupPlan, release: MomentRelease, name: str) -> np.ndarray:
    if name == "time_histogram":
        return np.concatenate([release.events, release.censored])
    return np.concatenate([release.moments[c] for c in plan.private_numeric])


def release_vector(plan: SetupPlan, ranges: AgreedRanges, features, time, event, name: str) -> np.ndarray:
    """The exact (noise-free) vector of release ``name`` of one site's records."""
    exact = SetupPlan(plan.columns, plan.numeric, 0.0, plan.adjacency, plan.dictionary, plan.time_grid)
    rng = np.random.default_rng(0)
    if name in ("record_count", "range_histograms"):
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


RELEASES = ("record_count", "range_histograms", "time_histogram", "feature_moments")


@pytest.fixture()
def data():
    return table(120, seed=3)


@pytest.fixture()
def fixed_ranges(data):
    """Public (data-independent) ranges for the second pass: the sensitivity is checked for fixed ranges."""
    return AgreedRanges({"age": (20.0, 100.0), "dose": (0.0, 5.0), "flag": (0.0, 1.0)}, 1000.0)


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
    assert declared["range_histograms"]["add-remove"] == pytest.approx(math.sqrt(4))  # age, dose, flag, time
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
            vector = range_vector(plan, first, name) if name in RELEASES[:2] else moment_vector(plan, second, name)
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
    edges = time_edges(ranges.time_max)
    assert time.max() <= ranges.time_max <= time.max() * 10 ** 0.1
    np.testing.assert_array_equal(
        shared.cuts, time_grid_from_histograms(edges, *time_histogram(time, event, edges), num_durations=10))
    # today's grid of the times rounded up to the right edges of their intervals
    rounded = edges[np.minimum(np.searchsorted(edges, time, side="right"), edges.size - 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate quantile cuts
        np.testing.assert_array_equal(shared.cuts, make_time_grid(rounded, event, num_durations=10))
    width = edges[1]
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


def test_a_column_hidden_by_the_noise_is_named_in_one_line():
    features, time, event = table(40, seed=8)
    plan = SetupPlan.for_features(features, noise_multiplier=10.0,
                                  dictionary=DataDictionary.from_mapping({"numeric": {"age": [0, 120]}}))
    with pytest.raises(setup.SetupNoiseError) as err:
        run_protocol(plan, split(features, time, event), np.random.default_rng(0))
    assert "range histogram of column 'dose' stands out of the noise" in str(err.value)
    assert "give it a public range in the data dictionary or lower the set-up noise multiplier (10)" in str(err.value)
    assert "\n" not in str(err.value)


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
    assert reference.cuts.size == 10 and reference.cuts[-1] == 1020  # the right edge of the last interval with records
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
    back = MomentRelease.from_dict(second.to_dict(), plan)
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
        MomentRelease.from_dict({**moments, "moments": {**moments["moments"], "age": [1.0, float("inf"), 2.0]}}, plan)


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


def test_a_time_histogram_whose_events_drown_in_noise_gives_the_equidistant_grid():
    """When no event survives the denoising (a small federation under much noise), the grid is the equidistant one
    over the agreed time range instead of a degenerate single cut."""
    frame = pd.DataFrame({"x": np.linspace(1.0, 2.0, 50)})
    plan = setup.SetupPlan.for_features(frame, noise_multiplier=1.0)
    ranges = setup.AgreedRanges({"x": (0.5, 2.5)}, time_max=100.0)
    bins = setup.TIME_HISTOGRAM_BINS
    summed_ranges = setup.RangeRelease(50.0, {"x": np.zeros(range_edges().size - 1)}, np.zeros(range_edges().size - 1), {})
    moments = setup.MomentRelease(np.full(bins, -3.0), np.ones(bins), {"x": np.array([0.0, 10.0, 50.0])})
    shared = setup.shared_setup(plan, ranges, summed_ranges, moments, num_durations=5)
    assert np.allclose(shared.cuts, np.linspace(0.0, 100.0, 5))
