"""The PLD accountant against dp-accounting (composed independently here), RDP and the exact Gaussian ε."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from strategies.accounting.ledger import LedgerEntry, PrivacyLedger
from strategies.accounting.pld import (
    PLD_DISCRETIZATION,
    calibrate_pld_noise_multiplier,
    canonical_history,
    pld_epsilon,
)
from strategies.accounting.rdp import (
    DEFAULT_RDP_ORDERS,
    SiteAccountant,
    calibrate_noise_multiplier,
    epsilon_from_history,
)

DELTA = 1e-5
#: FLCHAIN at the dp_sgd recipe: about 1,260 training records a site, batch 512, 3 epochs (7 steps), 20 rounds.
FLCHAIN = (512 / 1260, 7 * 20)
SETUP = ((10.0, 1.0, 1),) * 4


def google_epsilon(history, *, pld: bool = True) -> float:
    """dp-accounting's ε of ``history``, one event per entry (nothing merged), add/remove one."""
    accountant = PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION) if pld else \
        RdpAccountant(list(DEFAULT_RDP_ORDERS))
    for sigma, q, steps in history:
        event = dp_accounting.GaussianDpEvent(sigma)
        accountant.compose(event if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, event), steps)
    return accountant.get_epsilon(DELTA)


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε of the Gaussian mechanism of sensitivity / noise = mu at delta (Balle & Wang 2018, Thm 8)."""
    return brentq(lambda eps: norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta,
                  1e-6, 100.0)


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.01, 1000), (27.0, FLCHAIN[0], FLCHAIN[1]),
                                                   (0.9, 0.05, 300)])
def test_subsampled_gaussian_is_dp_accountings_pld(sigma, q, steps):
    assert pld_epsilon([(sigma, q, steps)], delta=DELTA) == pytest.approx(google_epsilon([(sigma, q, steps)]),
                                                                          rel=1e-12)


def test_a_sites_growing_history_is_dp_accountings_pld_bit_for_bit():
    """Round after round the same subsampled step is composed more times: its PLD is built once and reused, and
    every figure is still the float ``PLDAccountant`` gives for the canonical events."""
    for rounds in (1, 2, 3, 2):
        history = [(7.4, 1.0, 1), (1.68, FLCHAIN[0], 7 * rounds)]
        assert pld_epsilon(history, delta=DELTA) == google_epsilon(canonical_history(history))


@pytest.mark.parametrize(("sigma", "steps"), [(30.0, 60), (4.0, 60), (8.0, 1)])
def test_gaussian_rounds_are_an_upper_bound_within_1e3_of_the_exact_epsilon(sigma, steps):
    """q = 1: ``steps`` releases are one Gaussian with mu = sqrt(steps)/sigma, whose ε is known exactly."""
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, DELTA)
    ours = pld_epsilon([(sigma, 1.0, steps)], delta=DELTA)
    assert exact - 1e-9 <= ours <= exact + 1e-3


def test_gaussian_releases_merge_exactly():
    """Set-up releases of several noise multipliers compose into one Gaussian (mu^2 adds up)."""
    history = [(10.0, 1.0, 1), (7.0, 1.0, 2), (10.0, 1.0, 1), (12.0, 1.0, 1)]
    merged = canonical_history(history)
    mu = math.sqrt(2 / 10.0 ** 2 + 2 / 7.0 ** 2 + 1 / 12.0 ** 2)
    assert len(merged) == 1 and merged[0][0] == pytest.approx(1 / mu, rel=1e-14)
    ours = pld_epsilon(history, delta=DELTA)
    assert exact_gaussian_epsilon(mu, DELTA) - 1e-9 <= ours <= exact_gaussian_epsilon(mu, DELTA) + 1e-3
    assert ours == pytest.approx(google_epsilon(history), abs=2e-3)  # dp-accounting composes one by one


def test_set_up_and_training_compose_as_dp_accounting_does():
    history = [*SETUP, (27.0, *FLCHAIN)]
    assert pld_epsilon(history, delta=DELTA) == pytest.approx(google_epsilon(history), abs=2e-3)
    assert epsilon_from_history(history, delta=DELTA, accountant="rdp") == pytest.approx(
        google_epsilon(history, pld=False), rel=1e-6)


@pytest.mark.parametrize("history", [[(1.0, 0.01, 1000)], [(1.5, 0.01, 1000)], [*SETUP, (27.0, *FLCHAIN)],
                                     [(30.0, 1.0, 60)], [(4.0, 1.0, 60)], [(0.6, 0.01, 1000)]])
def test_pld_is_below_rdp(history):
    pld = epsilon_from_history(history, delta=DELTA, accountant="pld")
    rdp = epsilon_from_history(history, delta=DELTA, accountant="rdp")
    assert 0 < pld < rdp


@pytest.mark.parametrize("history", [[*SETUP, (27.0, *FLCHAIN)], [(1.0, 0.01, 1000)], [(0.55, 0.01, 1000)]])
def test_the_grid_is_fine_enough(history):
    """Halving the grid interval moves ε by less than 1e-3 (and the coarser grid is never below: pessimistic)."""
    default = pld_epsilon(history, delta=DELTA)
    finer = pld_epsilon(history, delta=DELTA, value_discretization_interval=PLD_DISCRETIZATION / 2)
    assert finer - 1e-9 <= default <= finer + 1e-3


@pytest.mark.parametrize(("target", "q", "steps", "prior"), [(1.0, *FLCHAIN, SETUP), (10.0, *FLCHAIN, SETUP),
                                                             (1.0, 1.0, 60, ()), (10.0, 1.0, 60, ()),
                                                             (2.0, 0.01, 1000, ())])
def test_calibration_meets_the_target_with_less_noise_than_rdp(target, q, steps, prior):
    sigma = calibrate_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps,
                                       accountant="pld", prior=prior)
    spent = google_epsilon([*prior, (sigma, q, steps)]) if not prior else \
        pld_epsilon([*prior, (sigma, q, steps)], delta=DELTA)
    assert target - 0.01 <= spent <= target
    rdp_sigma = calibrate_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps,
                                           accountant="rdp", prior=prior)
    assert sigma < rdp_sigma
    # the RDP figure of the PLD-calibrated noise is above the target: what the headline saves
    assert epsilon_from_history([*prior, (sigma, q, steps)], delta=DELTA, accountant="rdp") > target


def test_calibration_refuses_a_prior_that_spends_the_target():
    with pytest.raises(ValueError, match="alone spend"):
        calibrate_pld_noise_multiplier(target_epsilon=0.5, target_delta=DELTA, sample_rate=0.1, steps=10,
                                       prior=((1.0, 1.0, 1),))


def test_invalid_entries_are_refused_and_infinite_noise_is_free():
    with pytest.raises(ValueError, match="sample_rate"):
        pld_epsilon([(1.0, 1.5, 1)], delta=DELTA)
    with pytest.raises(ValueError, match="noise_multiplier"):
        pld_epsilon([(0.0, 0.1, 1)], delta=DELTA)
    assert pld_epsilon([(math.inf, 1.0, 1), (2.0, 0.1, 5)], delta=DELTA) == pld_epsilon([(2.0, 0.1, 5)], delta=DELTA)
    assert pld_epsilon([], delta=DELTA) == 0.0


def test_a_sites_accountant_reports_the_servers_float():
    """The site merges entries as they come, the server composes the plan: the same canonical events, the same ε
    (the server checks a site's figure to a relative 1e-6)."""
    site = SiteAccountant("pld")
    for noise, q, steps in SETUP:
        site.step(noise_multiplier=noise, sample_rate=q, num_steps=steps)
    for _ in range(3):
        site.step(noise_multiplier=27.0, sample_rate=FLCHAIN[0], num_steps=7)
    server = epsilon_from_history([*SETUP, (27.0, FLCHAIN[0], 21)], delta=DELTA, accountant="pld")
    assert site.epsilon(DELTA) == server
    restored = SiteAccountant.from_state_dict(json.loads(json.dumps(site.state_dict())))
    assert restored.mechanism == "pld" and restored.epsilon(DELTA) == server


def _ledger_entry(strategy: str, accountant: str | None = None, rounds: int = 20) -> tuple[LedgerEntry, object]:
    from simulations.engine import resolve
    from strategies.mechanisms.base import SiteSetUp
    from strategies.mechanisms.registry import get_mechanism

    overrides = {"strategy.name": strategy, "privacy.epsilon": 1.0, "federation.rounds": rounds}
    if accountant:
        overrides["privacy.accountant"] = accountant
    cfg = resolve(overrides)[1]
    mechanism = get_mechanism(strategy)
    setup = SiteSetUp(1260.0, 1260.0, SETUP if strategy == "dp_sgd" else ())
    reports = [mechanism.expected_report(cfg, setup=setup, previous=[{}] * r) for r in range(rounds)]
    return mechanism.ledger_entry(cfg, rounds, "site-0", setup=setup, reports=reports), cfg


def test_dp_sgd_ledger_gives_the_pld_headline_and_the_rdp_figure_beside_it():
    entry, cfg = _ledger_entry("dp_sgd")
    history = [*entry.prior, (entry.noise_multiplier, entry.sample_rate, entry.steps)]
    assert cfg.privacy.accountant == "pld" and entry.accountant == "dp-accounting-pld"
    assert entry.epsilon == pytest.approx(google_epsilon(history), abs=2e-3)
    assert entry.epsilon_rdp == pytest.approx(google_epsilon(history, pld=False), rel=1e-6)
    assert 0.99 <= entry.epsilon <= 1.0 < entry.epsilon_rdp
    rdp, _ = _ledger_entry("dp_sgd", "rdp")
    assert rdp.accountant == "opacus-rdp" and rdp.epsilon == rdp.epsilon_rdp <= 1.0
    assert entry.noise_multiplier < 0.95 * rdp.noise_multiplier  # the same budget buys less noise


def test_central_dp_ledger_is_the_exact_gaussian_epsilon_and_rdp_beside_it():
    entry, _ = _ledger_entry("central_dp")
    exact = exact_gaussian_epsilon(math.sqrt(20) / entry.noise_multiplier, DELTA)
    assert entry.accountant == "dp-accounting-pld" and exact <= entry.epsilon <= exact + 1e-3
    assert 0.99 <= entry.epsilon <= 1.0 < entry.epsilon_rdp
    assert entry.epsilon_rdp == pytest.approx(google_epsilon([(entry.noise_multiplier, 1.0, 20)], pld=False),
                                              rel=1e-6)


def test_distributed_dp_stays_rdp_with_its_figure_beside_itself():
    from strategies.mechanisms.registry import get_mechanism

    assert get_mechanism("distributed_dp").accountants == ("rdp",)
    assert get_mechanism("bdp").accountants == ("rdp",)


def test_old_ledger_files_without_epsilon_rdp_still_load(tmp_path):
    entry = LedgerEntry(round=1, site="a", mechanism="dp_sgd", unit="record", adjacency="add-remove",
                        accountant="opacus-rdp", epsilon=0.5, delta=1e-5, prior=((10.0, 1.0, 1),))
    old = {key: value for key, value in asdict(entry).items() if key != "epsilon_rdp"}
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(old) + "\n" + json.dumps({**old, "round": 2, "epsilon": 0.7}) + "\n", encoding="utf-8")
    read = PrivacyLedger.read(path)
    assert read.entries[0] == entry and read.entries[1].epsilon_rdp is None
    resumed = PrivacyLedger.resume(path, last_round=1)
    assert resumed.entries == [entry] and "epsilon_rdp" not in resumed.headline()
    resumed.record(LedgerEntry(round=2, site="a", mechanism="dp_sgd", unit="record", adjacency="add-remove",
                               accountant="dp-accounting-pld", epsilon=0.9, delta=1e-5, epsilon_rdp=1.0))
    assert resumed.headline()["epsilon"] == 0.9 and resumed.headline()["epsilon_rdp"] == 1.0
