"""distributed_dp's recalibration sums through its secure sum: the plan's privacy bound, the sites' vectors, the
server's check, and whole runs (a refused sum, a refused plain query, one release per site)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from simulations.engine import resolve, run_inprocess
from strategies.accounting.distributed_dp import ddg_rdp
from strategies.accounting.rdp import DEFAULT_RDP_ORDERS
from strategies.config import ConfigError
from strategies.horizontal import RECALIBRATION_HORIZONS
from strategies.mechanisms.setup_share import recalibration_multiplier
from strategies.mechanisms.distributed_dp import DistributedDP, gaussian_bound, power_sum_plan
from strategies.mechanisms.registry import horizontal_mechanism
from strategies.rounds.aggregation import PlainRelease
from strategies.rounds.secure_sum import SecureSumRelease

RUN = {"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "data.name": "flchain", "federation.rounds": 2,
       "federation.num_sites": 4, "baseline.centralized": False}


@pytest.mark.parametrize("multiplier, bits, records", [(40.0, 48, 6000.0), (3.0, 20, 1500.0), (0.3, 14, 100.0),
                                                       (0.2, 14, 100.0)])
def test_the_sum_is_dominated_by_the_gaussian_the_prior_plans(multiplier, bits, records):
    """Prop. 14's RDP of the planned release (with its tau terms) is at most the Gaussian mechanism's at the prior's
    multiplier, alpha / (2 z^2), at every order; where tau matters (small s) the sites' noise is raised for it."""
    plan = power_sum_plan(multiplier=multiplier, parties=5, max_dropouts=1, colluding=0, records=records, size=9,
                          modulus_bits=bits)
    rdp = ddg_rdp(DEFAULT_RDP_ORDERS, l2_sensitivity=plan.l2, l1_sensitivity=plan.l1, local_sigma=plan.local_sigma,
                  num_parties=plan.honest, dim=plan.dim)
    assert np.all(rdp <= np.asarray(DEFAULT_RDP_ORDERS) / (2 * multiplier ** 2))
    assert gaussian_bound(plan) >= multiplier and plan.honest == 4 and plan.gamma >= 1
    assert plan.l2 == pytest.approx(plan.gamma * 3 + 1.5)  # Delta = gamma sqrt(9) + sqrt(9)/2
    assert plan.local_sigma == pytest.approx(plan.noise_multiplier * plan.l2 / 2)
    if multiplier == 0.2:  # s about 0.8: tau is 0.02 and the noise goes up by 1.7 %
        assert plan.noise_multiplier > 1.01 * multiplier
    else:
        assert plan.noise_multiplier == pytest.approx(multiplier, rel=1e-4)


def test_a_sum_no_modulus_can_hold_is_refused_with_the_keys():
    with pytest.raises(ValueError, match="modulus of 2\\^12"):
        power_sum_plan(multiplier=0.5, parties=5, max_dropouts=1, colluding=0, records=100.0, size=9, modulus_bits=12)
    cfg = resolve({**RUN, "privacy.modulus_bits": 16})[1]
    with pytest.raises(ConfigError, match="privacy.modulus_bits.*modulus of 2\\^16"):  # gamma below 1 for 10^5 records
        DistributedDP().recalibration_plan(cfg, parties=4, records=1e5, size=9)


def test_the_unmasked_sum_gives_the_power_sums_to_rounding_and_noise():
    mechanism = DistributedDP()
    plan = power_sum_plan(multiplier=3.0, parties=3, max_dropouts=0, colluding=0, records=600.0, size=9,
                          modulus_bits=30)
    rng = np.random.default_rng(0)
    terms = [rng.random((200, 9)) ** 3 for _ in range(3)]
    vectors = [mechanism.recalibration_contribution(t, plan, rng=np.random.default_rng(i)) for i, t in enumerate(terms)]
    sums, reason = mechanism.recalibration_sums(sum(vectors), plan, count=600.0, sites=3)
    exact = sum(t.sum(axis=0) for t in terms)
    noise = math.sqrt(3) * plan.local_sigma / plan.gamma  # the summed noise's std, in power-sum units
    assert reason == "" and np.all(np.abs(sums - exact) <= 6 * noise + 600 / (2 * plan.gamma))
    assert noise == pytest.approx(3.0 * plan.l2 / plan.gamma)  # z Delta over gamma: 3 x (3 + 1.5 / gamma)
    draws = np.stack([mechanism.recalibration_contribution(terms[0], plan, rng=np.random.default_rng(seed))
                      for seed in range(200)]) - np.rint(plan.gamma * terms[0]).astype(np.int64).sum(axis=0)
    assert np.std(draws) == pytest.approx(plan.local_sigma, rel=0.1)
    with pytest.raises(ValueError, match="values in \\[0, 1\\]"):
        mechanism.recalibration_contribution(terms[0] + 1.0, plan, rng=rng)
    _, reason = mechanism.recalibration_sums(sum(vectors) * 1000, plan, count=600.0, sites=3)
    assert "beyond what honest sites can produce" in reason and "cannot say whose" in reason


def test_the_secure_sum_cuts_the_noise_the_plan_allows_for():
    """Each site adds all of its noise in a plain release (sqrt(k) times one release's); through the secure sum the
    k shares carry k / (k - D - t) times one release's variance."""
    dp_sgd = resolve({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})[1]
    dd = resolve({**RUN, "privacy.max_dropouts": 1, "privacy.colluding_sites": 1})[1]
    assert horizontal_mechanism("dp_sgd").recalibration_spread(dp_sgd, 5) == pytest.approx(math.sqrt(5))
    assert horizontal_mechanism("distributed_dp").recalibration_spread(dd, 5) == pytest.approx(math.sqrt(5 / 3))


def _last_line(path):
    return json.loads((path / "metrics.jsonl").read_text().splitlines()[-1])


def test_distributed_dp_sends_its_recalibration_sums_through_the_secure_sum(tmp_path):
    seen = []
    summary = run_inprocess({**RUN, "output.dir": str(tmp_path)},
                            observe=lambda message, reply: seen.append(message))
    types = {message.metadata.message_type for message in seen}
    assert "query.recalibration" not in types
    recalibrating = [m for m in seen if m.metadata.message_type == "query.secagg_masked"
                     and RECALIBRATION_HORIZONS in m.content["config"]]
    assert len(recalibrating) == 4
    exponents = np.asarray(torch.load(tmp_path / "model.pt", weights_only=True)["exponents"])
    assert np.all(exponents > 0) and not np.allclose(exponents, 1.0)
    assert _last_line(tmp_path)["failures"] == []
    assert summary["privacy"]["epsilon"] == pytest.approx(1.0, abs=1e-3)
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    planned = recalibration_multiplier(resolve(RUN)[1])
    assert any(z == pytest.approx(planned) and rate == 1.0 and steps == 1 for z, rate, steps in entry["prior"])
    assert any("recalibration after the last round goes through the same secure sum" in sentence
               for sentence in entry["assumptions"])


def test_a_recalibration_sum_outside_the_protocol_is_refused_unattributed(tmp_path, monkeypatch):
    honest = DistributedDP.recalibration_contribution
    monkeypatch.setattr(DistributedDP, "recalibration_contribution",
                        lambda self, terms, plan, *, rng: honest(self, terms, plan, rng=rng) * 1000)
    summary = run_inprocess({**RUN, "output.dir": str(tmp_path)})
    failures = _last_line(tmp_path)["failures"]
    assert [(f["phase"], f["site"]) for f in failures] == [("recalibration", "unattributable")]
    assert "cannot say whose contribution" in failures[0]["reason"]
    assert torch.load(tmp_path / "model.pt", weights_only=True).get("exponents") is None  # the curves as trained
    assert summary["test"]["c_index"] > 0.5


def test_a_recalibration_sum_the_keys_cannot_plan_is_a_named_failure_not_a_crash(tmp_path, monkeypatch):
    def unplannable(self, cfg, *, parties, records, size, honest_sites=()):
        raise ConfigError("run config: strategy 'distributed_dp' recalibration (privacy.modulus_bits): no room")

    seen = []
    monkeypatch.setattr(DistributedDP, "recalibration_plan", unplannable)
    run_inprocess({**RUN, "output.dir": str(tmp_path)}, observe=lambda message, reply: seen.append(message))
    failures = _last_line(tmp_path)["failures"]
    assert [(f["phase"], f["site"]) for f in failures] == [("recalibration", "unattributable")]
    assert "privacy.modulus_bits" in failures[0]["reason"]
    assert not any(RECALIBRATION_HORIZONS in m.content["config"] for m in seen if "config" in m.content)


def test_a_distributed_dp_site_refuses_a_plain_recalibration_query(tmp_path, monkeypatch):
    """A server that asks for the sums in the clear (each site's own noise, outside the secure sum) is refused."""
    monkeypatch.setattr(SecureSumRelease, "power_sums", PlainRelease.power_sums)
    run_inprocess({**RUN, "output.dir": str(tmp_path)})
    failures = _last_line(tmp_path)["failures"]
    assert sorted(f["site"] for f in failures) == [f"site-{i}" for i in range(4)]
    assert all(f["phase"] == "recalibration" and "through its secure sum only" in f["reason"] for f in failures)
    assert torch.load(tmp_path / "model.pt", weights_only=True).get("exponents") is None


def test_a_site_releases_its_recalibration_sums_once(tmp_path, monkeypatch):
    asked = PlainRelease.power_sums

    def twice(self, *args):
        asked(self, *args)
        return asked(self, *args)

    monkeypatch.setattr(PlainRelease, "power_sums", twice)
    run_inprocess({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "data.name": "flchain", "federation.rounds": 1,
                   "federation.num_sites": 3, "baseline.centralized": False, "output.dir": str(tmp_path)})
    failures = _last_line(tmp_path)["failures"]
    assert len(failures) == 3 and all("released its recalibration sums in this run already" in f["reason"]
                                      for f in failures)


def test_a_gaussian_sum_of_signed_vectors_returns_their_sum_to_rounding_and_noise():
    from strategies.mechanisms.distributed_dp import gaussian_sum_contribution, gaussian_sum_plan

    rng = np.random.default_rng(4)
    plan = gaussian_sum_plan(multiplier=2.0, parties=3, max_dropouts=0, colluding=0, records=300.0, size=4, clip=1.5,
                             modulus_bits=48)
    assert gaussian_bound(plan) >= 2.0
    sites = [rng.normal(size=(100, 4)) for _ in range(3)]
    sites = [rows * np.minimum(1.0, 1.5 / np.linalg.norm(rows, axis=1, keepdims=True)) for rows in sites]
    total = sum(gaussian_sum_contribution(rows, plan, clip=1.5, rng=rng) for rows in sites) / plan.gamma
    noise_std = math.sqrt(3) * plan.local_sigma / plan.gamma  # the three shares, back on the terms' scale
    assert np.all(np.abs(total - sum(rows.sum(axis=0) for rows in sites)) < 6 * noise_std + 300 / plan.gamma)
    with pytest.raises(ValueError, match="L2 bound 1.5"):
        gaussian_sum_contribution(np.array([[2.0, 0.0, 0.0, 0.0]]), plan, clip=1.5, rng=rng)
