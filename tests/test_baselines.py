"""BVFLMSP Table 1 baselines (simulations.papers.baselines) and the table runner (simulations.papers.table1)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from lifelines import CoxPHFitter
from lifelines.utils import concordance_index

from simulations.papers.baselines import (
    METRICS,
    MODELS,
    MULTIMODAL_MODELS,
    UNIMODAL_MODELS,
    BaselineSettings,
    DeepHitModel,
    fit_evaluate,
)
from models.data.vertical import VerticalTable, simulate_multimodal, split_train_test
from models.survival import HazardMLP
from models.time_grid import make_time_grid
from simulations.papers import table1

#: Small nets and few epochs: every model runs in about a second.
FAST = BaselineSettings(epochs=60, multimodal_epochs=15, dim=32, encoder_layers=1, head_layers=1, mc_passes=10,
                        validation_passes=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny nets run fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def strong_signal() -> tuple[VerticalTable, np.ndarray, np.ndarray]:
    table = simulate_multimodal(600, features_per_modality=4, signal=1.5, seed=0)
    train_ids, test_ids = split_train_test(table, test_fraction=0.3, seed=0)
    return table, train_ids, test_ids


def _clinical_table(n: int = 500, seed: int = 1) -> VerticalTable:
    """One modality with a 3-level categorical column and a continuous one, Cox hazard in both."""
    rng = np.random.default_rng(seed)
    grade = rng.integers(1, 4, n).astype(float)
    age = rng.normal(60, 10, n)
    event_time = rng.exponential(1.0, n) / np.exp(0.6 * (grade == 2) + 1.2 * (grade == 3) + 0.05 * (age - 60))
    censor_time = rng.exponential(2.0, n)
    ids = np.array([f"r{i}" for i in range(n)])
    frame = pd.DataFrame({"grade": grade, "age": age}, index=ids)
    return VerticalTable(name="clinical_sim", ids=ids, time=np.minimum(event_time, censor_time),
                         event=(event_time <= censor_time).astype(np.int64), modalities={"clinical": frame},
                         categorical={"clinical": ("grade",)})


def test_cox_ph_c_index_equals_lifelines_concordance_of_the_same_fit() -> None:
    table = _clinical_table()
    train_ids, test_ids = split_train_test(table, test_fraction=0.3, seed=0)
    row = fit_evaluate("cox_ph", table, ["clinical"], train_ids, test_ids, seed=0)
    # lifelines on the raw columns with grade one-hot: the same partial likelihood up to the
    # standardisation of age, so the same ranking of the test records
    train, test = table.subset(train_ids), table.subset(test_ids)

    def lifelines_frame(part: VerticalTable) -> pd.DataFrame:
        clinical = part.modalities["clinical"]
        return pd.DataFrame({"g2": (clinical["grade"] == 2).to_numpy(float), "g3": (clinical["grade"] == 3).to_numpy(float),
                             "age": clinical["age"].to_numpy()})

    fitter = CoxPHFitter().fit(lifelines_frame(train).assign(T=train.time, E=train.event), "T", "E")
    expected = concordance_index(test.time, -fitter.predict_partial_hazard(lifelines_frame(test)), test.event)
    assert row["c_index"] == pytest.approx(expected, abs=1e-12)
    assert row["cox_penalizer"] == 0.0  # plenty of events per variable: unpenalised
    assert row["c_index"] > 0.6
    # proportional hazards: curves never cross, so Antolini's C agrees with Harrell's
    assert row["c_index_td"] == pytest.approx(row["c_index"], abs=0.01)


def test_cox_ph_is_penalised_when_events_per_variable_are_few() -> None:
    table = simulate_multimodal(120, features_per_modality=8, signal=1.0, seed=3)
    train_ids, test_ids = split_train_test(table, test_fraction=0.3, seed=0)
    row = fit_evaluate("cox_ph", table, ["a"], train_ids, test_ids, seed=0,
                       settings=BaselineSettings(cox_penalizer=0.05))
    assert row["cox_penalizer"] == 0.05  # about 60 events for 8 variables: < 10 per variable


@pytest.mark.parametrize("name", MODELS)
def test_every_model_runs_end_to_end_and_ranks_better_than_chance(name, strong_signal) -> None:
    table, train_ids, test_ids = strong_signal
    modalities = ["a"] if name in UNIMODAL_MODELS else ["a", "b", "c"]
    row = fit_evaluate(name, table, modalities, train_ids, test_ids, seed=0, settings=FAST)
    assert row["model"] == name and row["modalities"] == "+".join(modalities)
    assert all(np.isfinite(row[metric]) for metric in METRICS)
    assert row["n_test"] == len(test_ids) and row["n_train"] == len(train_ids)
    # one modality holds a third of the log-risk variance; all three hold all of it
    assert row["c_index"] > (0.62 if name in UNIMODAL_MODELS else 0.75)
    assert row["c_index_td"] > 0.6
    if name != "cox_ph":
        assert row["n_fit"] + row["n_validation"] == len(train_ids)
        assert 1 <= row["best_epoch"] <= row["epochs_trained"]


@pytest.mark.parametrize("name", MULTIMODAL_MODELS)
def test_multimodal_models_gain_from_the_modalities_the_hazard_needs(name, strong_signal) -> None:
    table, train_ids, test_ids = strong_signal
    one = fit_evaluate(name, table, ["a"], train_ids, test_ids, seed=0, settings=FAST)
    three = fit_evaluate(name, table, ["a", "b", "c"], train_ids, test_ids, seed=0, settings=FAST)
    assert three["c_index"] > one["c_index"] + 0.05


def test_early_stopping_ends_patience_epochs_after_the_best_one(strong_signal) -> None:
    table, train_ids, test_ids = strong_signal
    settings = BaselineSettings(epochs=300, patience=3, lr=0.05)
    row = fit_evaluate("nnet_survival", table, ["b"], train_ids, test_ids, seed=1, settings=settings)
    assert row["epochs_trained"] == min(row["best_epoch"] + 3, 300)
    assert row["epochs_trained"] < 300


def test_a_per_model_learning_rate_replaces_the_group_one(strong_signal) -> None:
    table, train_ids, test_ids = strong_signal

    def run(settings: BaselineSettings) -> dict[str, object]:
        return fit_evaluate("nnet_survival", table, ["a"], train_ids, test_ids, seed=0, settings=settings)

    override = BaselineSettings(epochs=20, learning_rates=(("nnet_survival", 0.05), ("multisurv", 0.002)))
    assert override.learning_rate("multisurv") == 0.002 and override.learning_rate("deephit") == override.lr
    assert override.learning_rate("bayesian_multisurv") == override.multimodal_lr
    same = run(BaselineSettings(epochs=20, lr=0.05))
    assert {key: value for key, value in run(override).items() if key != "seconds"} == \
        {key: value for key, value in same.items() if key != "seconds"}
    assert run(BaselineSettings(epochs=20))["validation_loss"] != same["validation_loss"]
    with pytest.raises(ValueError, match=r"learning_rates names \['cox_ph'\]"):
        BaselineSettings(learning_rates=(("cox_ph", 0.1),))


@pytest.mark.parametrize("name", UNIMODAL_MODELS)
def test_unimodal_models_refuse_two_modalities(name, strong_signal) -> None:
    table, train_ids, test_ids = strong_signal
    with pytest.raises(ValueError, match=rf"{name} is a unimodal baseline \(BVFLMSP Table 1 runs it on single "
                                         r"modalities only\) and cannot take 2 modalities \['a', 'b'\]"):
        fit_evaluate(name, table, ["a", "b"], train_ids, test_ids, seed=0, settings=FAST)


def test_entry_point_errors_name_the_problem(strong_signal) -> None:
    table, train_ids, test_ids = strong_signal
    with pytest.raises(ValueError, match="unknown baseline 'coxph'"):
        fit_evaluate("coxph", table, ["a"], train_ids, test_ids, seed=0)
    with pytest.raises(ValueError, match="no modality given"):
        fit_evaluate("multisurv", table, [], train_ids, test_ids, seed=0)
    with pytest.raises(ValueError, match=r"unknown modalities \['d'\]"):
        fit_evaluate("multisurv", table, ["a", "d"], train_ids, test_ids, seed=0)
    with pytest.raises(ValueError, match="in both the training and the test IDs"):
        fit_evaluate("cox_ph", table, ["a"], train_ids, np.concatenate([test_ids, train_ids[:2]]), seed=0)


def test_deephit_curves_are_pycox_deephit_single_curves() -> None:
    from pycox.models import DeepHitSingle

    rng = np.random.default_rng(0)
    time, event = rng.exponential(1.0, 200), rng.integers(0, 2, 200)
    cuts = make_time_grid(time, event, num_durations=12)
    torch.manual_seed(0)
    net = HazardMLP(5, cuts.size, hidden=(16,), activation="relu")
    ours = DeepHitModel(net, cuts, 5, alpha=0.2, sigma=0.1)
    x = rng.normal(size=(30, 5)).astype(np.float32)
    times, surv = ours.predict_survival(x)
    reference = DeepHitSingle(net, duration_index=cuts).predict_surv_df(x)
    np.testing.assert_allclose(times, reference.index.to_numpy())
    np.testing.assert_allclose(surv, reference.to_numpy().T, atol=1e-6)


def _fake_rows(modalities: list[str], seeds: list[int]) -> pd.DataFrame:
    rows = []
    for seed in seeds:
        for combo in table1.combinations(modalities):
            for model in MODELS:
                if table1.can_run(model, combo):
                    rows.append({"model": model, "modalities": "+".join(combo), "seed": seed,
                                 **{metric: 0.5 + 0.1 * seed + 0.01 * len(combo) for metric in METRICS}})
    return pd.DataFrame(rows)


def test_table_puts_dash_where_a_model_cannot_run_and_mean_std_elsewhere() -> None:
    text = table1.write_table(_fake_rows(["genomic", "clinical"], [0, 1]), ["genomic", "clinical"])
    lines = text.splitlines()
    assert lines[0] == "| Model | Metric | genomic | clinical | genomic+clinical |"
    cells = {(parts[1], parts[2]): parts[3:6] for parts in
             ([cell.strip() for cell in line.split("|")] for line in lines[2:])}
    assert len(cells) == len(MODELS) * len(METRICS)
    for model in MODELS:
        for metric in table1.METRIC_LABELS.values():
            genomic, clinical, both = cells[(table1.MODEL_LABELS[model], metric)]
            assert genomic == clinical == "0.560 ± 0.071"  # 0.51 and 0.61
            assert both == ("-" if model in UNIMODAL_MODELS else "0.570 ± 0.071")


def test_table_marks_missing_runs_and_short_cells() -> None:
    rows = _fake_rows(["a", "b", "c"], [0, 1])
    rows = rows[~((rows["model"] == "bayesian_multisurv") & (rows["modalities"] == "a+c"))]
    rows = rows[~((rows["model"] == "deephit") & (rows["modalities"] == "b") & (rows["seed"] == 1))]
    lines = table1.write_table(rows, ["a", "b", "c"]).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")][3:-1]
    assert header == ["a", "b", "c", "a+b", "a+c", "b+c", "a+b+c"]
    by_row = {tuple(parts[1:3]): dict(zip(header, parts[3:-1], strict=True)) for parts in
              ([cell.strip() for cell in line.split("|")] for line in lines[2:])}
    assert by_row[("BayesianMultisurv", "IBS")]["a+c"] == "not run"
    assert by_row[("DeepHit", "C-index")]["b"] == "0.510 ± 0.000 (n=1)"
    assert by_row[("DeepSurv", "INBLL")]["a+b+c"] == "-"
    assert by_row[("Cox PH", "INBLL")]["a+b+c"] == "0.580 ± 0.071"  # the linear reference of a combination


def test_rerun_skips_rows_already_in_results_and_refuses_other_settings(tmp_path) -> None:
    arguments = ["--data", "synthetic_multimodal", "--seeds", "0", "--out", str(tmp_path), "--models", "cox_ph"]
    table1.main(arguments)
    first = pd.read_csv(tmp_path / "results.csv")
    assert sorted(first["modalities"]) == ["a", "a+b", "a+b+c", "a+c", "b", "b+c", "c"]
    table1.main(arguments)
    assert pd.read_csv(tmp_path / "results.csv").equals(first)
    text = (tmp_path / "table.md").read_text()
    assert "| Cox PH | C-index |" in text and "| MultiSurv |" not in text
    with pytest.raises(SystemExit, match="other settings"):
        table1.main([*arguments, "--cox-penalizer", "0.5"])


def test_paired_differences_are_per_seed_and_count_the_better_direction() -> None:
    rows = _fake_rows(["a", "b"], [0, 1, 2])
    bayesian = rows["model"] == "bayesian_multisurv"
    rows.loc[bayesian, "c_index"] += np.where(rows.loc[bayesian, "seed"] == 2, -0.01, 0.03)  # better on 2 of 3 seeds
    rows.loc[bayesian, "ibs"] += 0.02  # worse on every seed
    lines = table1.write_paired_differences(rows, ["a", "b"]).splitlines()
    assert lines[0] == "| Metric (BayesianMultisurv − MultiSurv) | a | b | a+b |"
    cells = {parts[1]: parts[2:5] for parts in ([cell.strip() for cell in line.split("|")] for line in lines[2:])}
    assert cells["C-index"] == ["+0.017 ± 0.023 (better 2/3)"] * 3
    assert cells["IBS"] == ["+0.020 ± 0.000 (better 0/3)"] * 3
