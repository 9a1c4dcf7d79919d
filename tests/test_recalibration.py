"""Private recalibration of a DP hazard model's curves (models.recalibration, the recalibration release)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models import recalibration as rc
from models.predict import load_run
from models.survival import build_survival_model
from models.time_grid import histogram_survival
from simulations.engine import resolve, run_inprocess
from strategies.mechanisms.setup_share import recalibration_history, recalibration_multiplier, recalibrates, setup_multiplier
from strategies.accounting.setup_budget import RECALIBRATION_SHARE, setup_noise_multiplier
from strategies.mechanisms.setup_statistics import recalibration_plan


def test_power_sums_are_sums_of_powers_and_move_by_at_most_one_per_record():
    surv = np.random.default_rng(0).uniform(0, 1, (50, 3))
    sums = rc.power_sums(surv)
    assert sums.shape == (3, len(rc.EXPONENTS))
    for j, c in enumerate(rc.EXPONENTS):
        np.testing.assert_allclose(sums[:, j], (surv ** c).sum(axis=0))
    added = rc.power_sums(np.vstack([surv, np.ones((1, 3))])) - sums
    assert np.all((added >= 0) & (added <= 1)) and np.linalg.norm(added) <= math.sqrt(sums.size) + 1e-12


def test_the_fitted_power_meets_the_target_exactly_for_identical_records():
    """For a population of identical records log m(c) = c log S, so the interpolation is exact."""
    surv = np.full((200, 3), [0.9, 0.7, 0.5])
    target = np.array([0.95, 0.6, 0.03])  # below the first exponent (anchored at m(0) = 1), between, beyond
    exponents = rc.fit_exponents(rc.power_sums(surv), 200, target)
    np.testing.assert_allclose(exponents, np.log(target) / np.log([0.9, 0.7, 0.5]), rtol=1e-9)
    np.testing.assert_allclose(rc.apply_exponents(surv[:1], exponents)[0], target, rtol=1e-9)


def test_the_fitted_power_meets_the_target_of_a_mixed_population_to_interpolation_error():
    rng = np.random.default_rng(1)
    risk = np.exp(rng.normal(0, 1, 5000))
    surv = np.exp(-np.outer(risk, [0.1, 0.3, 0.6]))  # proportional hazards
    target = np.array([0.85, 0.6, 0.45])
    exponents = rc.fit_exponents(rc.power_sums(surv), surv.shape[0], target)
    achieved = rc.apply_exponents(surv, exponents).mean(axis=0)
    np.testing.assert_allclose(achieved, target, atol=0.01)
    assert np.all((exponents >= rc.EXPONENT_RANGE[0]) & (exponents <= rc.EXPONENT_RANGE[1]))
    # a power keeps every record's rank at each time
    powered = rc.apply_exponents(surv, exponents)
    assert all((np.argsort(powered[:, k], kind="stable") == np.argsort(surv[:, k], kind="stable")).all()
               for k in range(3))


def test_unusable_means_keep_the_curve_and_powers_never_lift_a_curve_over_time():
    flat = rc.fit_exponents(np.ones((1, len(rc.EXPONENTS))) * 10, 10, np.array([0.5]))
    assert flat.tolist() == [1.0]  # every record at S = 1: no power moves it
    # a horizon without a usable target takes its neighbour's exponent, not 1 (no jump back between horizons)
    surv = np.full((100, 3), [0.9, 0.8, 0.7])
    filled = rc.fit_exponents(rc.power_sums(surv), 100, np.array([0.81, 0.64, 1.0]))
    np.testing.assert_allclose(filled, [2.0, 2.0, 2.0], rtol=1e-9)
    # means flattened by noise (not decreasing in c) fall back to log(target) / log m(1)
    noisy = np.array([[90.0, 91.0, 80.0]])
    np.testing.assert_allclose(rc.fit_exponents(noisy, 100, np.array([0.81])), [math.log(0.81) / math.log(0.9)])
    surv = np.array([[0.9, 0.8, 0.7]])
    lifted = rc.apply_exponents(surv, np.array([2.0, 1.0, 0.5]))
    assert np.all(np.diff(lifted[0]) <= 0)
    np.testing.assert_allclose(rc.cut_exponents([0, 5, 10, 20], [5, 10], [2.0, 1.0]), [2.0, 2.0, 1.0, 1.0])


def test_a_hazard_model_applies_its_exponents_and_rejects_bad_ones():
    model = build_survival_model("hazard_mlp", in_features=3, cuts=np.linspace(0, 10, 5), seed=0)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    _, before = model.predict_survival(x)
    exponents = np.full(5, 2.0)
    model.set_exponents(exponents)
    _, after = model.predict_survival(x)
    np.testing.assert_allclose(after, before ** 2, rtol=1e-12)
    with pytest.raises(ValueError, match="5 positive exponents"):
        model.set_exponents(np.array([1.0, -1.0, 1.0, 1.0, 1.0]))


def test_the_plan_takes_its_target_from_the_set_up_histogram_and_its_budget_from_the_share():
    points = np.array([1.0, 2.0, 3.0, 4.0])
    events, censored = np.array([10.0, 10.0, 10.0, 10.0]), np.array([0.0, 20.0, 0.0, 40.0])
    plan = recalibration_plan((points, events, censored), count=100.0, spread=1.0, multiplier=0.0)
    share = np.cumsum(events + censored) / 100
    np.testing.assert_allclose(plan.horizons, np.interp([0.25, 0.5, 0.75], share, points))
    np.testing.assert_allclose(plan.target, histogram_survival([0.0, *points], events, censored, plan.horizons))
    assert plan.size == plan.horizons.size * len(rc.EXPONENTS) and plan.sensitivity() == math.sqrt(plan.size)
    assert recalibration_plan(None, count=100.0, spread=1.0, multiplier=0.0) is None
    assert recalibration_plan((points, events, censored), count=100.0, spread=2.0, multiplier=1.0) is None  # too noisy
    assert recalibration_plan((points, events, censored), count=1000.0, spread=2.0, multiplier=1.0) is not None
    cfg = resolve({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})[1]
    assert recalibrates(cfg)
    z = setup_noise_multiplier(epsilon=1.0, delta=1e-5, share=cfg.privacy.setup_share)
    # the set-up and the recalibration split the set-up's share of the RDP budget: z^-2 = z_s^-2 + z_r^-2
    assert setup_multiplier(cfg) ** -2 + recalibration_multiplier(cfg) ** -2 == pytest.approx(z ** -2, rel=1e-12)
    assert recalibration_multiplier(cfg) == pytest.approx(z / math.sqrt(RECALIBRATION_SHARE))
    assert recalibration_history(cfg) == ((recalibration_multiplier(cfg), 1.0, 1),)
    for overrides in ({"strategy.name": "central_dp"}, {"privacy.setup_share": 0.0}, {"strategy.name": "nbafl"}):
        other = resolve({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, **overrides})[1]
        assert not recalibrates(other) and recalibration_history(other) == ()


def test_a_dp_run_recalibrates_its_final_model_through_the_apps(tmp_path):
    """The sites answer the recalibration query with noisy power sums; the saved model carries the exponents,
    the site accountants composed the planned release (the ledger's ε stays within the target), and the
    recalibrated curves are what the run reports."""
    summary = run_inprocess({"data.name": "flchain", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0,
                             "federation.rounds": 2, "baseline.centralized": False, "output.dir": str(tmp_path)})
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    exponents = np.asarray(saved["exponents"])
    assert exponents.shape == (len(load_run(tmp_path).model.cuts),) and np.all(exponents > 0)
    assert not np.allclose(exponents, 1.0)
    assert load_run(tmp_path).model.exponents is not None
    assert summary["privacy"]["epsilon"] <= 1.0 + 1e-9
    import json

    entry = json.loads([line for line in (tmp_path / "ledger.jsonl").read_text().splitlines() if line][-1])
    planned = recalibration_multiplier(resolve({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})[1])
    assert any(z == pytest.approx(planned) and rate == 1.0 and steps == 1 for z, rate, steps in entry["prior"])
    assert any("recalibration" in sentence for sentence in entry["assumptions"])
