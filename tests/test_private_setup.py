"""The private set-up of dp_sgd and bdp: its releases are composed in every site's ledger, independently checked.

The ledger's ε of a dp_sgd run with a private set-up must be what Google's dp-accounting gives for
the composition of the set-up's Gaussian releases (no subsampling) and the site's DP-SGD steps
(Poisson-subsampled Gaussian), by its RDP accountant (``privacy.accountant = rdp``) or its PLD
accountant (the default), and must spend the target: DP-SGD gets what the set-up leaves.
"""

from __future__ import annotations

import dataclasses
import json

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from flwr_app import task
from simulations.engine import resolve, run_inprocess
from strategies.accounting.rdp import DEFAULT_RDP_ORDERS
from strategies.mechanisms.schedules import poisson_schedule
from strategies.mechanisms.registry import get_mechanism

RUN = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False, "strategy.name": "dp_sgd",
       "privacy.epsilon": 2.0}


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_the_ledger_composes_the_set_up_with_training_as_dp_accounting_does(tmp_path, accountant):
    run = {**RUN, "privacy.accountant": accountant, "output.dir": str(tmp_path)}
    summary = run_inprocess(run)
    cfg = resolve(run)[1]
    setup = task.federation_setup(cfg)
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    final = [entry for entry in ledger if entry["round"] == 2]
    assert len(final) == 3 and setup.plan is not None
    for entry in final:
        site = setup.setups[entry["site"]]
        assert len(site.prior) >= 3  # count, range histograms, time histogram, moments (as the plan makes them)
        assert [tuple(prior) for prior in entry["prior"]] == list(site.prior)  # the ledger names what it composed
        sample_rate, steps = poisson_schedule(site.count, batch_size=cfg.train.batch_size,
                                              epochs=cfg.train.local_epochs)
        assert entry["sample_rate"] == pytest.approx(sample_rate) and entry["steps"] == 2 * steps
        epsilon = {}
        for name, google in (("rdp", RdpAccountant(list(DEFAULT_RDP_ORDERS))), ("pld", PLDAccountant())):
            for noise, _, _ in site.prior:  # one event per release (the ledger merges them into one Gaussian)
                google.compose(dp_accounting.GaussianDpEvent(noise))
            google.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                sample_rate, dp_accounting.GaussianDpEvent(entry["noise_multiplier"])), 2 * steps))
            epsilon[name] = google.get_epsilon(cfg.privacy.delta)
        assert entry["epsilon_rdp"] == pytest.approx(epsilon["rdp"], rel=1e-4)
        if accountant == "rdp":
            assert entry["accountant"] == "opacus-rdp" and entry["epsilon"] == entry["epsilon_rdp"]
        else:  # the grid's rounding, once per release here, once for the merged Gaussian in the ledger
            assert entry["accountant"] == "dp-accounting-pld" and entry["epsilon"] < entry["epsilon_rdp"]
            assert entry["epsilon"] == pytest.approx(epsilon["pld"], abs=2e-3)
        assert 2.0 - 0.02 <= entry["epsilon"] <= 2.0  # the whole budget, set-up included
    # the agreed counts are noisy (std about 32 records at the default noise), and DP-SGD's noise is larger
    # than it would be without the set-up releases: it gets what they leave of the budget
    exact = task.federation_setup(resolve({**RUN, "privacy.setup_share": 0.0})[1])
    assert any(site.count != exact.setups[name].count for name, site in setup.setups.items())
    mechanism = get_mechanism("dp_sgd")
    for site in setup.setups.values():
        without = dataclasses.replace(site, prior=())
        assert mechanism.schedule(cfg, site)[2] > mechanism.schedule(cfg, without)[2]
    assert summary["privacy"]["uncovered"] == ["participation", "schema"]


def test_the_set_up_noise_is_seeded_in_simulation_and_the_exact_set_up_is_listed_uncovered():
    cfg = resolve(RUN)[1]
    again = task._simulation.__wrapped__(task._simulation_key(cfg))[1]
    assert {name: site.count for name, site in again.setups.items()} == \
        {name: site.count for name, site in task.federation_setup(cfg).setups.items()}
    exact = resolve({**RUN, "privacy.setup_share": 0.0})[1]
    uncovered = [release.value for release in get_mechanism("dp_sgd").manifest(exact).uncovered]
    assert {"record count", "feature statistics", "time grid"} <= set(uncovered)
    assert task.federation_setup(exact).plan is None and all(not s.prior for s in task.federation_setup(exact).setups.values())


def test_bdp_composes_the_set_up_in_both_accountants(tmp_path):
    run = {**RUN, "strategy.name": "bdp"}
    run_inprocess({**run, "output.dir": str(tmp_path)})
    cfg = resolve(run)[1]
    setup = task.federation_setup(cfg)
    final = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()][-3:]
    for entry in final:
        site = setup.setups[entry["site"]]
        sample_rate, _ = poisson_schedule(site.count, batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
        google = RdpAccountant(list(DEFAULT_RDP_ORDERS))
        for noise, _, _ in site.prior:
            google.compose(dp_accounting.GaussianDpEvent(noise))
        google.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            sample_rate, dp_accounting.GaussianDpEvent(entry["noise_multiplier"])), entry["steps"]))
        assert entry["epsilon_classical"] == pytest.approx(google.get_epsilon(cfg.privacy.delta), rel=1e-4)
        assert entry["epsilon"] <= 2.0 + 1e-6
