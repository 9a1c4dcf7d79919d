"""NbAFL / LS-ADP / ROW-DP end to end: Flower simulation, ledger, the same run in process, config."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flwr_app.config import ConfigError
from simulations.engine import resolve, run_inprocess, run_simulation
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS, gaussian_constant
from strategies.mechanisms.schedules import calibrate_gaussian_noise_multiplier

EPSILON = 0.8
ROUNDS = 2
SITES = 3
SMALL = {"model.name": "cox_mlp", "privacy.epsilon": EPSILON, "federation.num_sites": SITES,
         "federation.rounds": ROUNDS, "baseline.centralized": False}


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _run(tmp_path_factory, name, overrides):
    out = tmp_path_factory.mktemp(name)
    overrides = {**overrides, "output.dir": str(out)}
    return out, overrides, run_simulation(overrides, engine="ray")


@pytest.fixture(scope="module")
def ls_adp_run(tmp_path_factory):
    return _run(tmp_path_factory, "ls_adp", {**SMALL, "strategy.name": "ls_adp"})


@pytest.fixture(scope="module")
def row_dp_exact_run(tmp_path_factory):
    return _run(tmp_path_factory, "row_dp_exact", {**SMALL, "strategy.name": "row_dp", "privacy.allocation": "exact"})


def _by_site(ledger):
    sites: dict[str, list[dict]] = {}
    for entry in ledger:
        sites.setdefault(entry["site"], []).append(entry)
    return {site: sorted(entries, key=lambda entry: entry["round"]) for site, entries in sites.items()}


def _check_composition(entries, delta):
    """epsilon: RDP of 1/z² = Σ 1/z_r²; epsilon_audited_formula: Σ c/z_r (the ledger's per-round z_r)."""
    c = gaussian_constant(delta)
    inverse_square, formula = 0.0, 0.0
    for entry in entries:
        inverse_square += 1.0 / entry["noise_multiplier"] ** 2
        formula += c / entry["noise_multiplier"]
        expected = epsilon_gaussian_rounds(noise_multiplier=inverse_square**-0.5, rounds=1, delta=delta,
                                           orders=list(AUDIT_RDP_ORDERS))
        assert entry["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert entry["epsilon_audited_formula"] == pytest.approx(formula, rel=1e-9)


@pytest.mark.slow
def test_ls_adp_flower_run_writes_an_honest_ledger(ls_adp_run):
    out, _, summary = ls_adp_run
    ledger = _read_jsonl(out / "ledger.jsonl")
    assert len(ledger) == SITES * ROUNDS
    by_site = _by_site(ledger)
    assert sorted(by_site) == [f"site-{i}" for i in range(SITES)]
    for entries in by_site.values():
        assert [entry["round"] for entry in entries] == list(range(1, ROUNDS + 1))
        for entry in entries:
            assert entry["mechanism"] == "ls_adp_paper"
            assert entry["unit"] == "record" and entry["adjacency"] == "replace-one"
            assert entry["epsilon_nominal"] == EPSILON
            assert entry["delta"] == 1e-5 and entry["sample_rate"] == 1.0 and entry["clip_norm"] == 1.0
            assert entry["steps"] == entry["round"]
            assert entry["noise_multiplier"] > 0 and math.isfinite(entry["noise_multiplier"])
            # each round's formula figure is at least ε/L (the largest layer budget ≥ the mean)
            assert entry["epsilon_audited_formula"] >= EPSILON * entry["round"] / ROUNDS - 1e-12
            text = " ".join(entry["assumptions"])
            assert "private data" in text and "Lemma 1" in text and "replacing one record" in text
        epsilons = [entry["epsilon"] for entry in entries]
        assert epsilons == sorted(epsilons) and epsilons[0] > 0
        _check_composition(entries, 1e-5)

    last = [entries[-1] for entries in by_site.values()]
    privacy = summary["privacy"]
    assert set(privacy) >= {"epsilon", "epsilon_nominal", "epsilon_audited_formula", "delta", "unit"}
    assert privacy["epsilon"] == max(entry["epsilon"] for entry in last)
    assert privacy["epsilon_audited_formula"] == max(entry["epsilon_audited_formula"] for entry in last)
    assert privacy["epsilon_nominal"] == EPSILON
    assert privacy["epsilon_audited_formula"] >= privacy["epsilon_nominal"]
    assert privacy["unit"] == "record"
    assert summary["strategy"] == "ls_adp" and summary["rounds"] == ROUNDS
    assert math.isfinite(summary["test"]["c_index"])
    rounds = _read_jsonl(out / "metrics.jsonl")
    assert [line["round"] for line in rounds] == list(range(1, ROUNDS + 1))
    assert all(len(line["sites"]) == SITES and not line["failures"] for line in rounds)


def _assert_inprocess_reproduces(out, overrides, summary, tmp_path):
    """The same overrides through the in-process grid: the same model, ledger and figures as through Ray."""
    local = run_inprocess({**overrides, "output.dir": str(tmp_path)})
    flower, inprocess = (torch.load(path / "model.pt", weights_only=False)["state_dict"] for path in (out, tmp_path))
    assert sorted(flower) == sorted(inprocess)
    for key, value in flower.items():
        assert value.shape == inprocess[key].shape
        assert float((value - inprocess[key]).abs().max()) < 1e-6, key
    assert _read_jsonl(tmp_path / "ledger.jsonl") == _read_jsonl(out / "ledger.jsonl")
    assert local["privacy"] == summary["privacy"]
    assert local["test"]["c_index"] == pytest.approx(summary["test"]["c_index"], abs=1e-6)


@pytest.mark.slow
def test_inprocess_engine_reproduces_the_ls_adp_flower_run(ls_adp_run, tmp_path):
    _assert_inprocess_reproduces(*ls_adp_run, tmp_path)


@pytest.mark.slow
def test_row_dp_exact_spends_at_most_the_target_and_is_reproduced_in_process(row_dp_exact_run, tmp_path):
    out, overrides, summary = row_dp_exact_run
    ledger = _read_jsonl(out / "ledger.jsonl")
    assert len(ledger) == SITES * ROUNDS
    for entries in _by_site(ledger).values():
        assert {entry["mechanism"] for entry in entries} == {"row_dp_exact"}
        # the same calibrated z every round; over all L = ROUNDS uploads RDP gives the target
        z = calibrate_gaussian_noise_multiplier(epsilon=EPSILON, delta=1e-5, releases=ROUNDS)
        for entry in entries:
            assert entry["noise_multiplier"] == pytest.approx(z, rel=1e-12)  # up to float rounding
        _check_composition(entries, 1e-5)
        assert entries[-1]["epsilon"] <= EPSILON
        assert entries[-1]["epsilon"] == pytest.approx(EPSILON, abs=1e-3)
        assert any("allocation 'exact'" in line for line in entries[-1]["assumptions"])
    assert summary["privacy"]["epsilon"] <= EPSILON
    _assert_inprocess_reproduces(out, overrides, summary, tmp_path)


# --------------------------------------------------------------------------------------------
# configuration errors (no simulation)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["nbafl", "ls_adp", "row_dp"])
def test_weight_perturbation_needs_a_finite_epsilon(strategy):
    with pytest.raises(ConfigError, match=f"'{strategy}' needs a finite 'privacy.epsilon'"):
        resolve({"strategy.name": strategy})
    with pytest.raises(ConfigError, match="needs a finite 'privacy.epsilon'"):
        resolve({"strategy.name": strategy, "privacy.epsilon": math.inf})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"privacy.allocation": "bogus"}, "'privacy.allocation' = 'bogus'; choose one of paper, exact"),
        ({"privacy.dispersion": "kurtosis"}, "'privacy.dispersion' = 'kurtosis'"),
        ({"privacy.uniform_mix": 2.0}, "'privacy.uniform_mix' must be in \\[0, 1\\]"),
        ({"privacy.uniform_mix": -0.1}, "'privacy.uniform_mix' must be in \\[0, 1\\]"),
        ({"privacy.min_site_records": -1}, "'privacy.min_site_records' must be >= 0"),
    ],
)
def test_bad_weight_perturbation_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve({"strategy.name": "ls_adp", "privacy.epsilon": 1.0, **override})


def test_weight_perturbation_settings_parse():
    _, cfg = resolve({"strategy.name": "row_dp", "privacy.epsilon": 0.5, "privacy.allocation": "exact",
                      "privacy.dispersion": "iqr", "privacy.uniform_mix": 0.25, "privacy.min_site_records": 100})
    assert cfg.strategy == "row_dp"
    assert (cfg.privacy.allocation, cfg.privacy.dispersion, cfg.privacy.uniform_mix,
            cfg.privacy.min_site_records) == ("exact", "iqr", 0.25, 100)
