"""A user's own data: ID columns, dropped columns, a predefined split, duplicated names, a saved model applied
to new raw records, and why a site's metric is undefined."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from fedsurv import load_run
from flwr_app import task
from models.data import ColumnRoles, DataValidationError, build_federated_dataset, load_table
from models.data.vertical import read_modality_file
from models.metrics import UNDEFINED_REASONS, evaluate_survival
from models.predict import PREPROCESSING_FILE
from simulations.engine import resolve, run_inprocess


def cohort(n: int = 1200, seed: int = 0) -> pd.DataFrame:
    """A raw cohort as a user has it: a string ID, string categoricals and numbers with gaps, two hospitals, a
    train/test column. Hospital B's test records are all censored (its C-index is undefined)."""
    rng = np.random.default_rng(seed)
    age = rng.normal(60, 10, n).round(1)
    stage = rng.choice(["I", "II", "III"], n)
    grade = rng.choice([1, 2, 3], n).astype(float)
    risk = 0.04 * (age - 60) + 0.8 * (stage == "III") + 0.3 * grade
    event_time, censor_time = rng.exponential(50 * np.exp(-risk)), rng.exponential(60, n)
    frame = pd.DataFrame({
        "patient": [f"P{i:05d}" for i in range(n)], "age": age, "stage": stage, "grade": grade,
        "hospital": np.where(rng.random(n) < 0.5, "A", "B"), "note": rng.choice(["x", "y"], n),
        "time": np.minimum(event_time, censor_time).round(2), "event": (event_time <= censor_time).astype(int),
        "split": np.where(rng.random(n) < 0.25, "test", "train"),
    })
    frame.loc[rng.choice(n, 40, replace=False), "age"] = np.nan
    frame.loc[rng.choice(n, 30, replace=False), "stage"] = np.nan
    frame.loc[rng.choice(n, 30, replace=False), "grade"] = np.nan
    frame.loc[(frame.hospital == "B") & (frame.split == "test"), "event"] = 0
    return frame


@pytest.fixture
def cohort_csv(tmp_path):
    path = tmp_path / "cohort.csv"
    cohort().to_csv(path, index=False)
    return path


def _csv(path, **roles):
    return load_table("csv", path=str(path), roles=ColumnRoles(**roles))


@pytest.mark.parametrize(("column", "values", "why"), [
    ("patient", lambda n: [f"P{i:05d}" for i in range(n)], "a string column unique on every row"),
    ("record", lambda n: np.arange(1000, 1000 + n), "an integer column unique on every row"),
    ("visit", lambda n: [f"V{i % 40}" for i in range(n)], "a string column with 40 distinct values in 60 rows"),
])
def test_an_identifier_like_column_is_refused_naming_the_file_the_column_and_the_key(tmp_path, column, values, why):
    frame = cohort(60).drop(columns=["patient", "split", "hospital"])
    frame.insert(0, column, values(len(frame)))
    path = tmp_path / "ids.csv"
    frame.to_csv(path, index=False)
    with pytest.raises(DataValidationError) as err:
        _csv(path)
    message = str(err.value)
    assert message == (f"{path}: column '{column}' looks like a record identifier ({why}); name it in data.id_col "
                       "(or data.drop_cols), or list the features in data.feature_cols")
    table = _csv(path, id_col=column)
    assert column not in table.features.columns and column not in table.groups.columns
    assert column not in _csv(path, drop_cols=(column,)).features.columns


def test_continuous_measurements_few_levels_and_tiny_tables_are_not_identifiers(tmp_path):
    frame = cohort(60).drop(columns=["patient", "split"])
    frame["albumin"] = np.random.default_rng(1).normal(4, 0.5, len(frame))  # unique on every row, but a float
    frame["ward"] = [f"W{i % 25}" for i in range(len(frame))]  # 25 levels in 60 rows: not more than half
    path = tmp_path / "ok.csv"
    frame.to_csv(path, index=False)
    assert {"albumin", "ward", "hospital"} <= set(_csv(path).features.columns)
    small = frame.head(19).assign(code=[f"C{i}" for i in range(19)])  # below 20 rows nothing is an identifier
    small.to_csv(path, index=False)
    assert "code" in _csv(path).features.columns


def test_a_duplicated_column_name_is_refused_from_the_raw_header(tmp_path):
    path = tmp_path / "dup.csv"
    frame = cohort(60).drop(columns=["patient", "split"])
    text = frame.to_csv(index=False).replace("note", "age", 1)  # header: patient-free, 'age' twice
    path.write_text(text)
    with pytest.raises(DataValidationError, match=r"^.*dup\.csv: column 'age' appears 2 times in the header "
                                                  r"\(columns 1, 5\); rename or remove the duplicates$"):
        _csv(path)


def test_keys_naming_absent_or_conflicting_columns_are_refused(cohort_csv):
    with pytest.raises(DataValidationError, match="data.id_col names column 'pid', which the file does not have"):
        _csv(cohort_csv, id_col="pid")
    with pytest.raises(DataValidationError, match="data.drop_cols names column 'nope'"):
        _csv(cohort_csv, id_col="patient", drop_cols=("nope",))
    with pytest.raises(DataValidationError, match="'patient' is named by data.id_col and is also listed in "
                                                  "data.feature_cols"):
        load_table("csv", path=str(cohort_csv), feature_cols=("age", "patient"), roles=ColumnRoles(id_col="patient"))


def test_split_col_replaces_the_random_split(cohort_csv, tmp_path):
    raw = pd.read_csv(cohort_csv)
    dataset = build_federated_dataset(name="csv", path=str(cohort_csv), seed=0, num_sites=3,
                                      roles=ColumnRoles(id_col="patient", drop_cols=("note",), split_col="split"))
    assert len(dataset.pooled("test")) == int((raw.split == "test").sum())
    assert sorted(dataset.pooled("test").time) == sorted(raw.time[raw.split == "test"])
    assert dataset.preprocessor.columns == ("age", "stage", "grade", "hospital")
    bad = raw.assign(split=raw.split.where(raw.index % 50 != 0, "validation"))
    bad.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(DataValidationError, match=r"column 'split': 24 labels other than train or test \(found "
                                                  r"'validation'; data.split_col accepts train, test\) \(rows 1, 51"):
        _csv(tmp_path / "bad.csv", id_col="patient", split_col="split")


def test_deepsurvs_own_split_of_metabric_is_reproducible():
    dataset = build_federated_dataset(name="metabric", seed=0, num_sites=2, roles=ColumnRoles(split_col="split"))
    assert len(dataset.pooled("test")) == 381 and len(dataset.pooled("train")) == 1523


def test_a_deployed_site_and_a_modality_file_apply_the_same_rule(cohort_csv, tmp_path):
    deployed = {"data.name": "site_files", "evaluation.server_side": False, "baseline.centralized": False}
    _, cfg = resolve(deployed)
    with pytest.raises(DataValidationError, match="column 'patient' looks like a record identifier"):
        task.load_site_table(cfg, str(cohort_csv))
    _, cfg = resolve({**deployed, "data.id_col": "patient", "data.split_col": "split"})
    assert "patient" not in task.load_site_table(cfg, str(cohort_csv)).features.columns
    modality = cohort(60)[["patient", "age", "stage"]].assign(barcode=[f"B{i}" for i in range(60)])
    modality.to_csv(tmp_path / "clinical.csv", index=False)
    with pytest.raises(DataValidationError, match="clinical.csv: column 'barcode' looks like a record identifier"):
        read_modality_file(tmp_path / "clinical.csv", id_column="patient")
    features = read_modality_file(tmp_path / "clinical.csv", id_column="patient", drop_cols=("barcode",))
    assert list(features.columns) == ["age", "stage"] and features.index[0] == "P00000"


@pytest.mark.parametrize(("strategy", "model", "extra"), [
    ("fedavg", "cox_mlp", {}),  # the federated Breslow baseline is saved with the model
    ("dp_sgd", "hazard_mlp", {"privacy.epsilon": 5.0}),  # the agreed noisy preprocessing
])
def test_a_saved_model_predicts_raw_new_records_as_the_run_did(cohort_csv, tmp_path, strategy, model, extra):
    out = tmp_path / "run"
    overrides = {"data.name": "csv", "data.path": str(cohort_csv), "data.id_col": "patient", "data.drop_cols": "note",
                 "data.split_col": "split", "federation.partition": "hospital", "federation.rounds": 2,
                 "strategy.name": strategy, "model.name": model, "baseline.centralized": False,
                 "output.dir": str(out), **extra}
    summary = run_inprocess(overrides)
    assert summary["data"]["features"] == {
        "input_columns": ["age", "stage", "grade"],
        "model_inputs": ["age", "stage=I", "stage=II", "stage=III", "grade"]}
    assert json.loads((out / PREPROCESSING_FILE).read_text())["input_columns"] == ["age", "stage", "grade"]

    run = load_run(out)
    raw = pd.read_csv(cohort_csv, dtype=str, keep_default_na=False)  # every cell a string, gaps as ""
    test_rows = raw[raw.split == "test"].sort_values("hospital", kind="stable")  # the pooled test split's order
    # The in-run model on the run's own encoded test records (the same process: the run's memoised data set)
    _, cfg = resolve(overrides)
    dataset = task.load_federation(cfg)
    in_run = task.build_model(cfg, dataset)
    saved = torch.load(out / "model.pt", weights_only=True)
    in_run.net.load_state_dict(saved["state_dict"])
    if in_run.needs_baseline:
        in_run.set_baseline(*map(np.asarray, saved["baseline"]))
    if saved.get("exponents") is not None:  # a DP run's recalibration
        in_run.set_exponents(np.asarray(saved["exponents"]))
    expected = in_run.predict_survival(dataset.pooled("test").x[:5])[1]
    curves = run.predict_survival(test_rows.head(5).drop(columns=["time", "event"]))
    assert list(curves.index) == list(test_rows.patient.head(5)) and curves.shape == (5, len(run.times))
    np.testing.assert_array_equal(curves.to_numpy(), expected)

    # The reloaded model on every raw test row reproduces the run's reported test metrics
    times, surv = run.model.predict_survival(run.encode(test_rows))
    time, event = test_rows.time.astype(float).to_numpy(), test_rows.event.astype(int).to_numpy()
    metrics = evaluate_survival(times, surv, time=time, event=event, censor_time=time, censor_event=event,
                                risk=run.risk_score(test_rows))
    for key in ("c_index", "c_index_td", "ibs"):
        assert metrics[key] == pytest.approx(summary["test"][key], rel=1e-12), key

    with pytest.raises(DataValidationError, match="new records: missing column 'stage'; columns present"):
        run.predict_survival(test_rows.drop(columns=["stage"]))

    # Hospital B's test split has no events: its C-index is null and says why, in the summary and every round
    assert summary["sites"]["B"]["c_index"] is None
    assert summary["sites"]["B"]["undefined"]["c_index"] == UNDEFINED_REASONS["no_events"]
    assert "undefined" not in summary["sites"]["A"]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        assert json.loads(line)["sites"]["B"]["undefined"]["c_index"].startswith("no comparable pairs")


def test_a_split_learning_run_loads_with_its_sites_encoders_and_says_which_folder_is_missing(tmp_path):
    import shutil

    from models.split_run import SITES_DIR, SplitRun

    run_inprocess({"strategy.name": "split", "data.name": "synthetic_multimodal", "model.name": "bayesian_multisurv",
                   "data.synthetic_records": 300, "federation.rounds": 1, "split.mc_samples": 2,
                   "baseline.centralized": False, "output.dir": str(tmp_path)})
    assert isinstance(load_run(tmp_path), SplitRun)
    shutil.rmtree(tmp_path / SITES_DIR / "b")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / SITES_DIR / 'b'}"):
        load_run(tmp_path)


def test_a_gzip_csv_is_read_and_binary_non_utf8_or_corrupt_files_are_refused_naming_the_file(tmp_path):
    import gzip
    import os

    from models.data.datasets import read_frame

    (tmp_path / "cohort.csv.gz").write_bytes(gzip.compress(b"time,event,x\n1,1,2\n2,0,3\n"))
    assert read_frame(tmp_path / "cohort.csv.gz").shape == (2, 3)
    cases = {"random.csv": os.urandom(2000), "latin1.csv": "time,event,name\n1,1,caf\xe9\n".encode("latin-1"),
             "fake.csv.gz": b"time,event\n1,1\n"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataValidationError) as refused:
            read_frame(tmp_path / name)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / name}: ") and "\n" not in message
        assert ("not UTF-8 text" if name.endswith(".csv") else "not a readable CSV file") in message


def test_a_negative_seed_and_an_unwritable_output_dir_are_refused_naming_the_key(tmp_path):
    from strategies.config import ConfigError

    with pytest.raises(ConfigError, match="seed"):
        resolve({"seed": -1})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"output.dir = .*a-file/run' cannot be written"):
        run_inprocess({"federation.num_sites": 2, "federation.rounds": 1, "baseline.centralized": False,
                       "output.dir": str(blocker / "run")})
