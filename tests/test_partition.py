"""Partitions into sites and stratified train/test splits."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from models.data import DataValidationError, natural_partition, partition_indices, stratified_split

N = 3000


@pytest.fixture(scope="module")
def outcome() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(42)
    time = rng.exponential(100.0, N)
    event = (rng.random(N) < 0.3).astype(np.float32)
    return time, event


def parts_of(scheme: str, outcome, seed: int = 0, **kwargs) -> list[np.ndarray]:
    time, event = outcome
    return partition_indices(scheme, time=time, event=event, num_sites=kwargs.pop("num_sites", 5), seed=seed, **kwargs)


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    everything = np.concatenate(parts)
    assert sum(p.size for p in parts) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_parts_are_disjoint_and_cover_all_records(scheme, outcome):
    assert_disjoint_cover(parts_of(scheme, outcome), N)


def test_iid_sizes_are_near_equal(outcome):
    sizes = [p.size for p in parts_of("iid", outcome, num_sites=7)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_same_seed_same_partition_other_seed_other_partition(scheme, outcome):
    first, again, other = (parts_of(scheme, outcome, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def event_rate_variance(parts: list[np.ndarray], event: np.ndarray) -> float:
    return float(np.var([event[p].mean() for p in parts]))


def test_dirichlet_with_small_alpha_is_more_skewed_than_iid(outcome):
    _, event = outcome
    iid = np.mean([event_rate_variance(parts_of("iid", outcome, seed=s), event) for s in range(5)])
    skewed = np.mean(
        [event_rate_variance(parts_of("dirichlet", outcome, seed=s, dirichlet_alpha=0.1), event) for s in range(5)]
    )
    assert skewed > 20 * iid


def test_dirichlet_sites_meet_size_and_event_minimum(outcome):
    _, event = outcome
    for seed in range(5):
        parts = parts_of("dirichlet", outcome, seed=seed, dirichlet_alpha=0.1, num_sites=8, min_site_records=30)
        assert all(p.size >= 30 and event[p].sum() >= 1 for p in parts)


def test_dirichlet_gives_up_with_a_clear_error(outcome):
    with pytest.raises(DataValidationError, match="no Dirichlet partition .* raise dirichlet_alpha"):
        parts_of("dirichlet", outcome, num_sites=5, min_site_records=590)
    with pytest.raises(DataValidationError, match="cannot give federation.num_sites = 50 sites of at least 100 records"):
        parts_of("dirichlet", outcome, num_sites=50, min_site_records=100)


def test_natural_partition_reproduces_group_counts(outcome):
    groups = pd.Series(np.random.default_rng(1).choice(["West", "South", "Midwest"], N), name="region")
    parts = natural_partition(groups)
    assert list(parts) == ["Midwest", "South", "West"]
    counts = groups.value_counts()
    assert {name: p.size for name, p in parts.items()} == counts.to_dict()
    assert all((groups.iloc[p] == name).all() for name, p in parts.items())
    assert_disjoint_cover(parts_of("region", outcome, groups=groups), N)


def test_natural_partition_drops_small_and_missing_groups(caplog):
    groups = pd.Series(["a"] * 50 + ["b"] * 5 + ["c"] * 3 + [None] * 2, name="site")
    with caplog.at_level(logging.WARNING):
        parts = natural_partition(groups, min_site_records=10)
    assert list(parts) == ["a"]
    assert "2 values with fewer than 10 records dropped: b (5), c (3)" in caplog.text
    assert "2 records without a value" in caplog.text


def test_unknown_scheme_lists_options(outcome):
    with pytest.raises(DataValidationError, match="unknown partition 'random'; options: iid, dirichlet"):
        parts_of("random", outcome)


def test_stratified_split_keeps_event_rate_and_is_disjoint(outcome):
    _, event = outcome
    site = np.arange(0, N, 2)
    train, test = stratified_split(site, event, 0.25, np.random.default_rng(0))
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.union1d(train, test), site)
    assert abs(test.size / site.size - 0.25) < 0.01
    assert abs(event[test].mean() - event[site].mean()) < 0.01


def test_stratified_split_keeps_a_lone_event_in_training():
    event = np.array([0, 0, 0, 1], dtype=np.float32)
    train, test = stratified_split(np.arange(4), event, 0.5, np.random.default_rng(0))
    assert 3 in train and test.size == 2
