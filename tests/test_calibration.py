"""Calibrated hazard-model start and the calibration report (issue 24, item 3).

The Kaplan–Meier hazard per interval (:func:`models.time_grid.interval_hazard`) is checked against
lifelines and a closed form, the untrained hazard MLP against the Kaplan–Meier curve at its cuts,
and a run's calibration report against an independent computation from its saved model.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from lifelines import KaplanMeierFitter

from flwr_app import task
from models.data.files import data_file
from models.metrics import evaluate_survival
from models.predict import load_run
from models.survival import HAZARD_CLIP, build_survival_model
from models.time_grid import histogram_survival, interval_hazard, time_counts, time_histogram
from simulations.engine import resolve, run_inprocess


def _lifelines_km(time, event, at):
    return KaplanMeierFitter().fit(time, event).survival_function_at_times(at).to_numpy()


def test_interval_hazard_closed_form():
    # 4 records: an event and a censoring at 1, an event at 2, a censoring at 3.
    # S(1) = 1 - 1/4, S(2) = S(1) (1 - 1/2), S(3) = S(2); intervals [0, 0], (0, 1.5], (1.5, 3].
    hazard = interval_hazard(np.array([1.0, 2.0, 3.0]), np.array([1, 1, 0]), np.array([1, 0, 1]),
                             np.array([0.0, 1.5, 3.0]))
    np.testing.assert_allclose(hazard, [0.0, 0.25, 0.5], atol=1e-15)


def test_interval_hazard_reproduces_lifelines_km_at_the_cuts_from_integer_counts():
    rng = np.random.default_rng(3)
    time = rng.integers(1, 60, 500).astype(float)  # many ties
    event = (rng.random(500) < 0.4).astype(int)
    # cuts on record times, between them, before the first and beyond the last
    cuts = np.array([0.0, 0.5, 7.0, 12.5, 30.0, 44.2, 59.0, 80.0])
    points, events, censored = time_counts(time, event)
    assert events.sum() == event.sum() and events.sum() + censored.sum() == time.size
    hazard = interval_hazard(points, events, censored, cuts)
    np.testing.assert_allclose(np.cumprod(1.0 - hazard), _lifelines_km(time, event, cuts), atol=1e-12)
    # the Kaplan–Meier curve depends on the counts' proportions only, and empty points change nothing
    padded = np.concatenate([points, points[-1] + np.arange(1.0, 4.0)])
    zeros = np.zeros(3)
    np.testing.assert_allclose(interval_hazard(padded, np.concatenate([2.5 * events, zeros]),
                                               np.concatenate([2.5 * censored, zeros]), cuts), hazard, atol=1e-12)


def test_interval_hazard_is_one_after_the_curve_reaches_zero_and_refuses_bad_counts():
    hazard = interval_hazard(np.array([1.0, 2.0]), np.array([1.0, 1.0]), np.array([1.0, 0.0]),
                             np.array([0.0, 2.0, 3.0]))
    np.testing.assert_allclose(hazard, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="at least one event"):
        interval_hazard(np.array([1.0, 2.0]), np.zeros(2), np.ones(2), np.array([0.0, 2.0]))
    with pytest.raises(ValueError, match="non-negative"):
        interval_hazard(np.array([1.0, 2.0]), np.array([1.0, -1.0]), np.ones(2), np.array([0.0, 2.0]))


def test_untrained_hazard_mlp_predicts_the_km_curve_of_a_histogram_up_to_its_resolution():
    rng = np.random.default_rng(7)
    time = rng.exponential(10.0, 3000)
    censor = rng.exponential(15.0, 3000)
    observed, event = np.minimum(time, censor), (time <= censor).astype(int)
    edges = np.linspace(0.0, observed.max(), 2001)
    cuts = np.quantile(observed, np.linspace(0.0, 0.9, 12))
    cuts[0] = 0.0
    exact = _lifelines_km(observed, event, cuts)
    # exact counts: the model's curve is the Kaplan–Meier curve, for every record
    model = build_survival_model("hazard_mlp", in_features=4, cuts=cuts,
                                 baseline_hazard=interval_hazard(*time_counts(observed, event), cuts))
    _, surv = model.predict_survival(rng.normal(size=(50, 4)))
    np.testing.assert_allclose(surv, np.broadcast_to(exact, surv.shape), atol=cuts.size * HAZARD_CLIP)
    # histogram counts (records at their bins' right edges): the same up to the bins' width
    events, censored = time_histogram(observed, event, edges)
    model = build_survival_model("hazard_mlp", in_features=4, cuts=cuts,
                                 baseline_hazard=interval_hazard(edges[1:], events, censored, cuts))
    _, surv = model.predict_survival(rng.normal(size=(50, 4)))
    width = edges[1] - edges[0]
    band = np.abs(_lifelines_km(observed, event, np.maximum(cuts - width, 0.0)) - exact)
    assert np.all(np.abs(surv.mean(axis=0) - exact) <= band + 2e-3)
    # without a baseline the start is data-independent and far from it
    plain = build_survival_model("hazard_mlp", in_features=4, cuts=cuts)
    assert np.abs(plain.predict_survival(rng.normal(size=(50, 4)))[1].mean(axis=0) - exact).max() > 0.1


RUN = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False,
       "strategy.name": "dp_sgd", "privacy.epsilon": 2.0}


def test_the_global_model_starts_at_the_set_up_km_private_or_exact():
    cfg = resolve(RUN)[1]
    dataset, setup = task.load_federation(cfg), task.federation_setup(cfg)
    assert setup.plan is not None and setup.time_counts is not None
    train = dataset.pooled("train")
    exact = _lifelines_km(train.time, train.event, setup.cuts)
    # private set-up: the Kaplan–Meier curve of the denoised time histogram (post-processing), not the exact one
    _, surv = task.build_model(cfg, dataset).predict_survival(train.x)
    points, events, censored = setup.time_counts  # the histogram's curve, linear within its intervals
    curve = histogram_survival([0.0, *points], events, censored, setup.cuts)
    hazard = 1.0 - curve / np.concatenate(([1.0], curve[:-1]))
    released = np.cumprod(1.0 - np.clip(hazard, HAZARD_CLIP, 1.0 - HAZARD_CLIP))
    np.testing.assert_allclose(surv, np.broadcast_to(released, surv.shape), rtol=1e-5)
    assert 0.0 < np.abs(released - exact).max() < 0.1  # the set-up's noise and its histogram's bins
    # exact set-up: the pooled training Kaplan–Meier curve
    exact_cfg = resolve({**RUN, "privacy.setup_share": 0.0})[1]
    exact_setup = task.federation_setup(exact_cfg)
    assert exact_setup.plan is None
    _, surv = task.build_model(exact_cfg, task.load_federation(exact_cfg)).predict_survival(train.x)
    np.testing.assert_allclose(surv.mean(axis=0), _lifelines_km(train.time, train.event, exact_setup.cuts),
                               atol=exact_setup.cuts.size * HAZARD_CLIP)
    cox_cfg = resolve({**RUN, "strategy.name": "central_dp", "model.name": "cox_mlp"})[1]
    assert task.baseline_hazard(cox_cfg, setup.cuts, setup.time_counts) is None  # Breslow after training
    assert task.baseline_hazard(cfg, setup.cuts, setup.time_counts) is not None


def test_a_run_reports_calibration_as_an_independent_computation_gives_it(tmp_path):
    overrides = {**RUN, "output.dir": str(tmp_path)}
    summary = run_inprocess(overrides)
    cfg = resolve(overrides)[1]
    dataset = task.load_federation(cfg)
    train, test = dataset.pooled("train"), dataset.pooled("test")
    report = summary["calibration"]
    rows = report["tables"]["pooled test"]
    horizons = np.percentile(train.time, [25, 50, 75])
    np.testing.assert_allclose([row["horizon"] for row in rows], horizons)
    model = load_run(tmp_path).model
    times, surv = model.predict_survival(test.x)
    predicted = np.array([surv[:, np.searchsorted(times, h, side="right") - 1].mean() for h in horizons])
    km = _lifelines_km(test.time, test.event, horizons)
    np.testing.assert_allclose([row["predicted"] for row in rows], predicted, rtol=1e-6)
    np.testing.assert_allclose([row["km"] for row in rows], km, rtol=1e-9)
    assert report["median_gap"] == pytest.approx(abs(predicted[1] - km[1]), rel=1e-6)
    kmf = KaplanMeierFitter().fit(train.time, train.event)
    null_times = np.unique(train.time)
    null_surv = np.tile(kmf.survival_function_at_times(null_times).to_numpy(), (len(test), 1))
    reference = evaluate_survival(null_times, null_surv, time=test.time, event=test.event, censor_time=test.time,
                                  censor_event=test.event, risk=np.zeros(len(test)))["ibs"]
    assert report["ibs_km_null"] == pytest.approx(reference, rel=1e-9)
    assert set(report["tables"]) == {"pooled test", *(site.name for site in dataset.sites)}
    assert summary["km_null"] == {"ibs": summary["test"]["ibs"], "ibs_km_null": report["ibs_km_null"],
                                  "below_null": summary["test"]["ibs"] < report["ibs_km_null"]}


def test_a_model_no_better_than_kaplan_meier_is_said_so_in_the_console_the_summary_and_score(tmp_path, capsys):
    """An untrained network (one round at a negligible learning rate) predicts the Kaplan-Meier start on the
    grid's 20 cuts, a coarser copy of the null curve: the run says so in one line and flags it; ``score`` warns."""
    summary = run_inprocess({"data.name": "whas", "federation.num_sites": 2, "federation.rounds": 1, "train.lr": 1e-9,
                             "baseline.centralized": False, "output.dir": str(tmp_path)})
    check = summary["km_null"]
    assert check["below_null"] is False and check["ibs"] >= check["ibs_km_null"]
    lines = [line for line in capsys.readouterr().out.splitlines() if "Kaplan-Meier null" in line]
    assert lines == [f"warning: the model's IBS {check['ibs']:.4f} on the pooled test split is not below the "
                     f"Kaplan-Meier null's {check['ibs_km_null']:.4f}: its curves predict survival no better than "
                     "the covariate-free curve"]
    run = load_run(tmp_path)
    records = pd.read_csv(data_file("whas"))
    with pytest.warns(UserWarning, match=r"^the model's IBS .* on these records is not below the Kaplan-Meier") as seen:
        scores = run.score(records)
    assert len(seen) == 1 and scores["ibs"] >= scores["ibs_km_null"]
    time, event = records[run.outcome[0]].to_numpy(float), records[run.outcome[1]].to_numpy(int)
    kmf = KaplanMeierFitter().fit(time, event)
    null_times = np.unique(time)
    null_surv = np.tile(kmf.survival_function_at_times(null_times).to_numpy(), (len(time), 1))
    reference = evaluate_survival(null_times, null_surv, time=time, event=event, risk=np.zeros(len(time)))["ibs"]
    assert scores["ibs_km_null"] == pytest.approx(reference, rel=1e-9)
