"""fedsurv's Python API end to end: fit a federation from a DataFrame, then predict, score and plot.

The runs go through the ServerApp and ClientApp in process (:func:`simulations.engine.run_inprocess`
stands in for Ray's engine, which the README's slow test uses through the same ``fit``).
"""

import json

import matplotlib
import numpy as np
import pandas as pd
import pytest

import fedsurv
from flwr_app.config import ConfigError
from models.data import DataValidationError
from models.data.files import data_file
from models.metrics import calibration_table, evaluate_survival, survival_at
from simulations import engine

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def records():
    """METABRIC with DeepSurv's split, a record ID and an integer-coded factor, as a user's frame."""
    frame = pd.read_csv(data_file("metabric"))
    return frame.assign(patient=[f"p{i:04d}" for i in range(len(frame))],
                        centre=np.random.default_rng(0).integers(1, 5, len(frame)))


@pytest.fixture(scope="module")
def run(records, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setattr(engine, "run_simulation", lambda overrides: engine.run_inprocess(overrides))
    try:
        return fedsurv.fit(records, time_col="duration", event_col="event", id_col="patient",
                           categorical_cols=["centre"], sites=3, rounds=4,
                           output_dir=tmp_path_factory.mktemp("api") / "run",
                           config={"data.split_col": "split", "baseline.centralized": False})
    finally:
        patch.undo()


def test_fit_trains_on_the_frame_with_its_keys(run, records):
    assert (run.directory / fedsurv.api.DATA_FILE).is_file()
    resolved = json.loads((run.directory / "config.json").read_text())["resolved"]
    assert resolved["data"]["id_col"] == "patient" and resolved["federation"]["rounds"] == 4
    assert "centre=2" in run.preprocessor.feature_names  # the coded factor is one-hot, not a number
    assert run.outcome == ("duration", "event") and run.id_col == "patient"
    assert run.summary["num_sites"] == 3 and run.summary["test"]["c_index"] > 0.55


def test_score_on_the_test_rows_is_the_runs_own_pooled_test_figure(run, records):
    test = records[records["split"] == "test"]
    scores = run.score(test)
    for key in ("c_index", "c_index_td", "ibs", "inbll"):
        assert scores[key] == pytest.approx(run.summary["test"][key], abs=1e-9), key


def test_predictions_are_indexed_by_the_id_and_agree_with_each_other(run, records):
    new = records.drop(columns=["duration", "event", "split"]).iloc[:40]
    curves = run.predict_survival(new)
    assert curves.index.name == "patient" and list(curves.index) == list(new["patient"])
    np.testing.assert_array_equal(curves.columns.to_numpy(), run.times)
    values = curves.to_numpy()
    assert ((values >= 0) & (values <= 1)).all() and (np.diff(values, axis=1) <= 1e-9).all()
    at = [0.0, float(run.times[3]) + 0.5, 1e9]
    np.testing.assert_allclose(run.predict_survival(new, times=at).to_numpy(),
                               survival_at(run.times, values, np.array(at)))
    np.testing.assert_allclose(run.predict_cumulative_hazard(new).to_numpy(), -np.log(values))
    median = run.predict_median_survival(new)
    for i, (_, row) in enumerate(curves.iterrows()):
        below = np.flatnonzero(row.to_numpy() <= 0.5)
        assert median.iloc[i] == (run.times[below[0]] if below.size else np.inf)
    assert np.isinf(run.predict_percentile(new, p=1e-9)).all()  # nobody's curve reaches 0 on the grid
    risk = run.risk_score(new)
    assert list(risk.index) == list(new["patient"])
    np.testing.assert_allclose(risk.to_numpy(), run.model.risk_score(run.encode(new)))


def test_calibration_groups_records_by_predicted_risk_against_kaplan_meier(run, records):
    test = records[records["split"] == "test"]
    table = run.calibration(test, groups=4)
    assert table["n"].sum() == len(test) and table["n"].max() - table["n"].min() <= 1
    horizon = float(np.median(test["duration"]))
    curves = run.predict_survival(test)
    at = survival_at(run.times, curves.to_numpy(), np.array([horizon]))[:, 0]
    lowest = np.argsort(at, kind="stable")[: table["n"].iloc[0]]
    expected = calibration_table(run.times, curves.to_numpy()[lowest], time=test["duration"].to_numpy()[lowest],
                                 event=test["event"].to_numpy()[lowest], horizons=np.array([horizon]))
    assert table["predicted"].iloc[0] == pytest.approx(expected["predicted"].iloc[0])
    assert table["km"].iloc[0] == pytest.approx(expected["km"].iloc[0])
    assert table["predicted"].is_monotonic_increasing


def test_plots_draw_on_the_callers_axes(run, records):
    from matplotlib.figure import Figure

    test = records[records["split"] == "test"]
    axes = Figure().subplots(1, 2)
    run.plot_survival(test.head(3), ax=axes[0])
    assert len(axes[0].get_lines()) == 3
    run.plot_calibration(test, groups=5, ax=axes[1])
    assert len(axes[1].containers) == 1 and len(axes[1].containers[0].lines[0].get_xdata()) == 5


def test_score_refuses_records_without_usable_outcomes(run, records):
    with pytest.raises(DataValidationError, match="labelled records.*'duration'"):
        run.score(records.drop(columns=["duration"]))
    broken = records.iloc[:50].assign(event=2)
    with pytest.raises(DataValidationError, match="0/1 event in 'event'"):
        run.score(broken)


def test_fit_refuses_a_key_given_twice_or_unknown_before_writing_anything(records, tmp_path):
    with pytest.raises(ConfigError, match="seed given both"):
        fedsurv.fit(records, time_col="duration", output_dir=tmp_path / "a", config={"seed": 3})
    with pytest.raises(ConfigError, match=r"unknown .*key.* train\.learning_rate"):
        fedsurv.fit(records, time_col="duration", output_dir=tmp_path / "b", config={"train.learning_rate": 0.1})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_evaluate_survival_is_what_score_reports_on_any_records(run, records):
    sample = records.sample(300, random_state=1)
    curves = run.predict_survival(sample).to_numpy()
    expected = evaluate_survival(run.times, curves, time=sample["duration"].to_numpy(),
                                 event=sample["event"].to_numpy(), risk=run.risk_score(sample).to_numpy())
    scores = run.score(sample)
    assert {key: value for key, value in scores.items() if key != "ibs_km_null"} == pytest.approx(expected, nan_ok=True)
    assert scores["ibs_km_null"] > scores["ibs"]  # a 4-round model still below the sample's own Kaplan-Meier curve


def test_load_run_refuses_weights_of_another_network_in_one_line(run, tmp_path):
    """A run whose saved weights do not fit the network its configuration builds (e.g. saved by a version whose
    interval layer had weights of its own for interval 0) is refused naming the file, not with torch's dump."""
    import shutil

    import torch

    copy = tmp_path / "old"
    shutil.copytree(run.directory, copy)
    saved = torch.load(copy / "model.pt", weights_only=True)
    last = [name for name in saved["state_dict"] if name.startswith("layers.")][-1]
    weight = saved["state_dict"][last]
    saved["state_dict"][last] = torch.cat([weight[:1], weight])  # one weight row per interval, interval 0's own
    torch.save(saved, copy / "model.pt")
    with pytest.raises(ValueError, match=r"model\.pt: its weights do not fit the hazard_mlp network") as error:
        fedsurv.load_run(copy)
    assert "\n" not in str(error.value)
