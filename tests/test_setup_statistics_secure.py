"""The private set-up through the secure sum (strategy distributed_dp): one Gaussian's noise on the sum, not K sites'."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import pandas as pd
import pytest

from strategies.accounting.rdp import epsilon_from_history
from strategies.mechanisms import setup_statistics as setup
from strategies.mechanisms.setup_statistics import AgreedRanges, SecureSetup, SetupPlan

SITES = 24


def _sites(records: int = 35, seed: int = 0) -> list[tuple[pd.DataFrame, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(SITES):
        features = pd.DataFrame({"age": rng.normal(60, 10, records), "bmi": rng.normal(27, 4, records)})
        out.append((features, rng.exponential(500.0, records), (rng.random(records) < 0.6).astype(float)))
    return out


def _pass_1_noise(plan: SetupPlan, secure: SecureSetup, sites, records: float, seed: int) -> np.ndarray:
    """The released summed range histograms minus the exact pooled histograms (the noise the server sees)."""
    rng = np.random.default_rng(seed)
    total = setup.modular_sum([setup.secure_contribution(plan, secure, 1, f, t, None, records=records, rng=rng)
                               for f, t, _ in sites], secure.modulus)
    counts = {str(i): float(len(t)) for i, (_, t, _) in enumerate(sites)}
    summed = setup.secure_ranges_sum(plan, secure, total, counts=counts, levels={})
    exact = setup.release_ranges(_exact(plan), pd.concat([f for f, _, _ in sites]),
                                 np.concatenate([t for _, t, _ in sites]), rng)
    return np.concatenate([summed.histograms[c] - exact.histograms[c] for c in plan.private_numeric])


def _exact(plan: SetupPlan) -> SetupPlan:
    """The plan without noise: the exact sums of the same records."""
    return SetupPlan(plan.columns, plan.numeric, noise_multiplier=0.0)


@pytest.mark.parametrize("dropouts", [0, 2])
def test_the_secure_sums_noise_is_one_gaussians_not_the_sites_summed(dropouts):
    """24 sites' pass-1 histograms through the secure sum: the sum's noise std is the plan's one-Gaussian std
    z_i * Delta_i (times sqrt(k / (k - D)) for D tolerated drop-outs), a fifth of what 24 sites' own noise gives."""
    sites = _sites()
    plan = SetupPlan.for_features(sites[0][0], noise_multiplier=12.0)
    secure = SecureSetup(SITES, max_dropouts=dropouts)
    records = float(sum(len(t) for _, t, _ in sites))
    noise = np.concatenate([_pass_1_noise(plan, secure, sites, records, seed) for seed in range(8)])
    gaussian = plan.noise_std("range_histograms")  # one Gaussian mechanism's std at the release's multiplier
    expected = gaussian * math.sqrt(SITES / (SITES - dropouts))
    assert abs(noise.mean()) < 4 * expected / math.sqrt(noise.size)
    assert noise.std() == pytest.approx(expected, rel=0.03)  # 1936 draws: the sample std is within 1.6 % at 1 sd
    assert setup.summed_noise(plan, secure, "range_histograms", noise.size // 8, records=records, sites=SITES) == (
        pytest.approx(expected, rel=1e-3))
    per_site = functools.reduce(operator.add, [setup.release_ranges(plan, f, t, np.random.default_rng(i))
                                               for i, (f, t, _) in enumerate(sites)])
    assert setup._summed_std(plan, "range_histograms", per_site) == pytest.approx(math.sqrt(SITES) * gaussian)


def test_the_secure_moments_and_time_histogram_decode_to_the_pooled_sums_within_their_noise():
    sites = _sites(seed=1)
    plan = SetupPlan.for_features(sites[0][0], noise_multiplier=12.0)
    secure = SecureSetup(SITES, max_dropouts=1)
    ranges = AgreedRanges({"age": (20.0, 100.0), "bmi": (10.0, 50.0)}, 4000.0, time_bins=20)
    records = float(sum(len(t) for _, t, _ in sites))
    errors = {"time_histogram": [], "feature_moments": []}
    exact = setup.release_moments(_exact(plan), ranges, pd.concat([f for f, _, _ in sites]),
                                  np.concatenate([t for _, t, _ in sites]), np.concatenate([e for _, _, e in sites]),
                                  np.random.default_rng(0))
    for seed in range(20):
        rng = np.random.default_rng(seed)
        total = setup.modular_sum([setup.secure_contribution(plan, secure, 2, f, t, e, records=records, rng=rng,
                                                             ranges=ranges) for f, t, e in sites], secure.modulus)
        summed = setup.secure_moments_sum(plan, secure, ranges, total, records=records, sites=SITES)
        errors["time_histogram"].append(np.concatenate([summed.events - exact.events,
                                                        summed.censored - exact.censored]) / summed.noise["time_histogram"])
        errors["feature_moments"].append(np.concatenate([summed.moments[c] - exact.moments[c] for c in ("age", "bmi")])
                                         / summed.noise["feature_moments"])
    for name, standardised in errors.items():  # unbiased, unit variance once divided by the noise the server uses
        values = np.concatenate(standardised)
        assert abs(values.mean()) < 4 / math.sqrt(values.size), name
        assert values.std() == pytest.approx(1.0, rel=0.1), name
    assert summed.noise["time_histogram"] == pytest.approx(plan.noise_std("time_histogram") * math.sqrt(24 / 23),
                                                           rel=1e-3)


def test_a_sum_beyond_what_honest_sites_can_produce_is_refused_in_one_line():
    sites = _sites(records=30, seed=2)
    plan = SetupPlan.for_features(sites[0][0], noise_multiplier=12.0)
    secure = SecureSetup(SITES, max_dropouts=1)
    records = float(sum(len(t) for _, t, _ in sites))
    rng = np.random.default_rng(0)
    vectors = [setup.secure_contribution(plan, secure, 1, f, t, None, records=records, rng=rng) for f, t, _ in sites]
    (_, time_bins), (name, size) = setup.secure_segments(plan, 1)
    gamma = secure.sum_plan(plan, name, size, records).gamma
    vectors[0][time_bins:] += np.int64(math.floor(gamma)) * 10_000  # one site claims 10 000 records in every bin
    with pytest.raises(ValueError) as err:
        setup.secure_ranges_sum(plan, secure, setup.modular_sum(vectors, secure.modulus),
                                counts={str(i): 30.0 for i in range(SITES)}, levels={})
    assert "range_histograms" in str(err.value) and "beyond what honest sites can produce" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_secure_set_up_charges_exactly_the_plans_gaussian_entries():
    """Every secure sum's plan bounds its release's RDP by the Gaussian entry (z_i, 1, 1) the ledger's prior holds,
    and the entries compose to the one Gaussian of the set-up's noise multiplier (opacus' RDP)."""
    from strategies.mechanisms.distributed_dp import gaussian_bound

    sites = _sites()
    plan = SetupPlan.for_features(sites[0][0], noise_multiplier=12.0)
    secure = SecureSetup(SITES, max_dropouts=1)
    history = {r.name: r.noise_multiplier("add-remove") for r in setup.setup_releases(plan)}
    assert setup.accountant_history(plan) == tuple((z, 1.0, 1) for z in history.values())  # what the ledger holds
    for name, size in setup.secure_segments(plan, 1) + setup.secure_segments(
            plan, 2, AgreedRanges({"age": (0.0, 1.0), "bmi": (0.0, 1.0)}, 10.0, time_bins=50)):
        assert gaussian_bound(secure.sum_plan(plan, name, size, 840.0)) >= history[name]
    assert epsilon_from_history(list(setup.accountant_history(plan)), delta=1e-5) == pytest.approx(
        epsilon_from_history([(12.0, 1.0, 1)], delta=1e-5), rel=1e-9)


def test_a_secure_set_up_refuses_replace_one_adjacency():
    plan = SetupPlan.for_features(_sites()[0][0], noise_multiplier=12.0, adjacency="replace-one")
    with pytest.raises(ValueError, match="add/remove"):
        SecureSetup(SITES).sum_plan(plan, "range_histograms", 242, 840.0)


def test_a_modulus_too_small_for_the_set_ups_sums_is_refused_in_one_line_naming_the_keys():
    from strategies.config import ConfigError

    plan = SetupPlan.for_features(_sites()[0][0], noise_multiplier=12.0)
    with pytest.raises(ConfigError) as err:
        SecureSetup(SITES, modulus_bits=16).sum_plan(plan, "range_histograms", 242, 840.0)
    assert "privacy.modulus_bits" in str(err.value) and "\n" not in str(err.value)
    assert SecureSetup(SITES, modulus_bits=48).sum_plan(plan, "range_histograms", 242, 840.0).gamma > 1e6


@pytest.mark.parametrize("public", [None, {"time": {"grid": [0.0, 100.0, 400.0, 1500.0]}},
                                    {"numeric": {"age": [0.0, 120.0], "bmi": [5.0, 60.0]}, "time": {"max": 5000.0}}])
def test_the_whole_secure_set_up_runs_in_one_process_and_keeps_every_column(public):
    """run_setup through the secure sum over 24 sites of 35 records: no column left out, a time grid within the
    agreed follow-up, means within a few noise units of the pooled ones; what the dictionary makes public is used as
    is and nothing is summed for it."""
    from models.data.dictionary import DataDictionary

    sites = {str(i): site for i, site in enumerate(_sites(seed=3))}
    dictionary = None if public is None else DataDictionary.from_mapping(public)
    plan = SetupPlan.for_features(sites["0"][0], noise_multiplier=12.0, dictionary=dictionary)
    rngs = {name: np.random.default_rng(int(name)) for name in sites}
    shared, counts = setup.run_setup(plan, sites, rngs, num_durations=10, require_inputs=True,
                                     secure=SecureSetup(SITES, max_dropouts=1))
    assert shared.left_out == () and set(counts) == set(sites) and all(c >= 1 for c in counts.values())
    pooled = pd.concat([f for f, _, _ in sites.values()])
    if public is None:
        assert abs(shared.preprocessor.means["age"] - pooled["age"].mean()) < 3.0
    if public is not None and "grid" in public["time"]:
        np.testing.assert_array_equal(shared.cuts, public["time"]["grid"])
        assert setup.secure_segments(plan, 2, None) == (("feature_moments", 6),)
    else:
        assert np.all(np.diff(shared.cuts) > 0) and shared.cuts[-1] <= (5000.0 if public else 1e4)
