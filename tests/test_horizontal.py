"""Pure helpers of the horizontal strategy and the privacy ledger."""

import json
import math

import pytest

from strategies.accounting.ledger import LedgerEntry, PrivacyLedger
from strategies.horizontal import weighted_nanmean


def test_weighted_nanmean_weights_by_records_and_skips_undefined_sites():
    per_site = {
        "a": {"c_index": 0.8, "ibs": 0.10, "num-examples": 300},
        "b": {"c_index": 0.6, "ibs": math.nan, "num-examples": 100},
        "c": {"c_index": math.nan, "ibs": 0.20, "num-examples": 100},
    }
    mean = weighted_nanmean(per_site)
    assert mean["c_index"] == pytest.approx((0.8 * 300 + 0.6 * 100) / 400)
    assert mean["ibs"] == pytest.approx((0.10 * 300 + 0.20 * 100) / 400)
    assert "num-examples" not in mean
    assert math.isnan(weighted_nanmean({"a": {"x": math.nan, "num-examples": 5}})["x"])


def entry(round_, site, epsilon, unit="record"):
    return LedgerEntry(round=round_, site=site, mechanism="dp_sgd", unit=unit, adjacency="add-remove",
                       accountant="rdp", epsilon=epsilon, delta=1e-5)


def test_headline_is_the_worst_site_at_its_latest_round_never_a_mean(tmp_path):
    ledger = PrivacyLedger(tmp_path / "ledger.jsonl")
    for record in [entry(1, "a", 0.5), entry(1, "b", 0.9), entry(2, "a", 1.4), entry(2, "b", 1.1)]:
        ledger.record(record)
    headline = ledger.headline()
    assert headline["epsilon"] == pytest.approx(1.4) and headline["site"] == "a"
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["epsilon"] == 1.1


def test_one_unprotected_site_means_no_guarantee():
    ledger = PrivacyLedger()
    ledger.record(entry(1, "a", 0.5))
    ledger.record(LedgerEntry(round=1, site="b", mechanism="none", unit="none", adjacency="n/a",
                              accountant="none", epsilon=None, delta=None))
    assert ledger.headline()["epsilon"] is None and ledger.headline()["site"] == "b"
    assert PrivacyLedger().headline()["epsilon"] is None


@pytest.mark.parametrize("rounds", [1, 10, 50])
def test_central_dp_epsilon_agrees_with_flowers_own_accountant(rounds):
    """Our opacus figure for client-level DP equals Flower's dp-accounting RdpAccountant."""
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from strategies.accounting.rdp import epsilon_gaussian_rounds
    from strategies.mechanisms.central_dp import central_noise_multiplier

    target, delta, sites = 3.0, 1e-5, 5
    sigma = central_noise_multiplier(epsilon=target, delta=delta, rounds=rounds)
    flower = RdpAccountant(PrivacyConfig(target_delta=delta, population_size=sites,
                                         neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                         sampling_method=SamplingMethod.NO_AMPLIFICATION))
    flower.compose(GaussianPrivacyEvent(noise_multiplier=sigma, sample_size=sites, population_size=sites),
                   count=rounds)
    ours = epsilon_gaussian_rounds(noise_multiplier=sigma, rounds=rounds, delta=delta)
    assert ours == pytest.approx(flower.get_epsilon(delta), rel=1e-6)
    assert target - 0.05 <= ours <= target


def test_central_dp_with_the_prv_accountant_reports_the_prv_epsilon_it_is_labelled_with():
    """The ledger's accountant label is what computed its epsilon: with privacy.accountant=prv, the PRV figure,
    an upper bound within 0.015 of the exact epsilon of the Gaussian composition (the analytic Gaussian
    mechanism, Balle & Wang 2018, which Google's PLD accountant also gives), within the target."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from scipy.optimize import brentq
    from scipy.stats import norm

    from simulations.engine import resolve
    from strategies.mechanisms.base import SiteSetUp
    from strategies.mechanisms.registry import get_mechanism

    _, cfg = resolve({"strategy.name": "central_dp", "privacy.epsilon": 1.0, "privacy.accountant": "prv",
                      "federation.rounds": 20})
    mechanism = get_mechanism("central_dp")
    entry = mechanism.ledger_entry(cfg, 20, "site-0", setup=SiteSetUp(1.0, 1.0), reports=[{}] * 20)
    assert entry.accountant == "opacus-prv"
    sigma = entry.noise_multiplier / math.sqrt(20)  # 20 Gaussian releases compose to one of sigma / sqrt(20)
    exact = brentq(lambda eps: norm.cdf(-eps * sigma + 1 / (2 * sigma))
                   - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma)) - cfg.privacy.delta, 1e-3, 10)
    pld = PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(entry.noise_multiplier), 20)
    assert pld.get_epsilon(cfg.privacy.delta) == pytest.approx(exact, abs=1e-4)
    assert exact <= entry.epsilon <= exact + 0.015
    assert 0.98 <= entry.epsilon <= 1.0
    rdp = mechanism.ledger_entry(resolve({"strategy.name": "central_dp", "privacy.epsilon": 1.0,
                                          "privacy.accountant": "rdp"})[1], 20, "site-0",
                                 setup=SiteSetUp(1.0, 1.0), reports=[{}] * 20)
    assert rdp.accountant == "opacus-rdp" and rdp.noise_multiplier > entry.noise_multiplier  # RDP is looser
