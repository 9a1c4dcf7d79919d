"""A user's own vertical data in simulation (data.name = vertical_files): a labels file and one file per modality,
read with a deployment's readers, run in process with the real apps beside the centralised twin; bad files and
keys stop the run with one line naming the file (or key), the column and the rows."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from flwr_app import vertical_task
from flwr_app.config import ConfigError, parse_run_config
from models.data import DataValidationError
from models.data.vertical import simulate_multimodal
from models.multimodal_training import fit_transforms
from simulations.engine import resolve, run_inprocess
from simulations.run import describe_failure

TINY = {
    "strategy.name": "split", "data.name": "vertical_files", "data.id_col": "patient", "data.time_col": "months",
    "data.event_col": "relapse", "data.categorical_cols": "grade", "data.drop_cols": "note",
    "model.num_durations": 10, "federation.rounds": 2, "train.batch_size": 64, "split.embedding_dim": 16,
    "split.encoder_layers": 1, "split.head_layers": 1, "split.mc_samples": 4,
}


def write_files(folder, n: int = 300):
    """A labels CSV and two modality files as a user has them: string IDs, a text column, a numeric category,
    a column to drop, a Parquet file, and records one modality lacks. Returns the run-config keys naming them."""
    table = simulate_multimodal(n, features_per_modality=4, seed=1)
    ids = [f"P{i:04d}" for i in range(n)]
    pd.DataFrame({"patient": ids, "months": table.time, "relapse": table.event}).to_csv(folder / "labels.csv",
                                                                                         index=False)
    clinical = table.modalities["a"].set_axis(ids, axis=0)
    clinical["stage"] = np.where(clinical["a0"] > 0.5, "III", np.where(clinical["a0"] > -0.5, "II", "I"))
    clinical["grade"] = np.digitize(clinical["a1"], [-0.5, 0.5]) + 1
    clinical["note"] = "free text"
    clinical.rename_axis("patient").reset_index().to_csv(folder / "clinical.csv", index=False)
    genomic = table.modalities["b"].set_axis(ids, axis=0).iloc[[i for i in range(n) if i % 10]]  # 30 records lack it
    genomic.rename_axis("patient").reset_index().to_parquet(folder / "genomic.parquet", index=False)
    return {"data.labels_path": str(folder / "labels.csv"),
            "data.modality_paths": f"{folder / 'clinical.csv'},genomic={folder / 'genomic.parquet'}"}


def test_own_files_run_in_simulation_and_equal_their_centralised_twin(tmp_path):
    overrides = {**TINY, **write_files(tmp_path), "output.dir": str(tmp_path / "out")}
    cfg = resolve(overrides)[1]
    table = vertical_task.load_table(cfg)
    # one site per file, named by the file or by its name=; the ID, the labels and the dropped column are no features
    assert list(table.modalities) == ["clinical", "genomic"]
    assert list(table.modalities["clinical"].columns) == ["a0", "a1", "a2", "a3", "stage", "grade"]
    assert table.categorical == {"clinical": ("grade",)} and table.ids[0] == "P0000"
    assert table.sources["genomic"].endswith("genomic.parquet")
    # the records genomic.parquet lacks are a missing modality; the text column is categorical with its strings
    assert int(table.modalities["genomic"].isna().all(axis=1).sum()) == 30
    transform = fit_transforms(table, table.ids)["clinical"]
    assert transform.categorical == ("grade", "stage") and transform.levels[1] == ("I", "II", "III")

    summary = run_inprocess(overrides)
    assert summary["modalities"] == ["clinical", "genomic"] and summary["data"] == {"name": "vertical_files"}
    assert summary["round_trips"] == summary["batches"] + 1 and summary["privacy"]["epsilon"] is None
    # without DP the split protocol computes the centralised twin's steps: the same figures
    assert summary["centralized"]["test"] == pytest.approx(summary["test"], rel=1e-4, abs=1e-4)
    assert summary["test"]["c_index"] > 0.55  # modalities a and b carry two thirds of the log-risk variance

    # split.modalities picks some of the files
    only = vertical_task.load_table(resolve({**overrides, "split.modalities": "genomic"})[1])
    assert list(only.modalities) == ["genomic"]


def test_a_changed_file_is_read_again(tmp_path):
    overrides = {**TINY, **write_files(tmp_path), "output.dir": str(tmp_path / "out")}
    cfg = resolve(overrides)[1]
    assert len(vertical_task.load_table(cfg)) == 300
    labels = pd.read_csv(tmp_path / "labels.csv").iloc[:250]
    labels.to_csv(tmp_path / "labels.csv", index=False)
    os.utime(tmp_path / "labels.csv", ns=(1, 1))  # a new modification time, whatever the clock's resolution
    with pytest.raises(DataValidationError, match="not in the label holder's cohort"):
        vertical_task.load_table(cfg)  # the modality files now hold 50 unknown IDs


def _negative_time(folder):
    frame = pd.read_csv(folder / "labels.csv")
    frame.loc[[3, 8], "months"] = -1.0
    frame.to_csv(folder / "labels.csv", index=False)


def _text_in_a_numeric_category(folder):
    frame = pd.read_csv(folder / "clinical.csv")
    frame["grade"] = frame["grade"].astype(object)
    frame.loc[6, "grade"] = "high"
    frame.to_csv(folder / "clinical.csv", index=False)


def _unknown_ids(folder):
    frame = pd.read_parquet(folder / "genomic.parquet")
    frame.loc[0, "patient"] = "Q9999"
    frame.to_parquet(folder / "genomic.parquet", index=False)


def _duplicate_ids(folder):
    frame = pd.read_csv(folder / "clinical.csv")
    frame.loc[5, "patient"] = frame.loc[4, "patient"]
    frame.to_csv(folder / "clinical.csv", index=False)


def _labels_in_a_modality(folder):
    clinical = pd.read_csv(folder / "clinical.csv")
    clinical["months"] = pd.read_csv(folder / "labels.csv")["months"]
    clinical.to_csv(folder / "clinical.csv", index=False)


def _no_id_column(folder):
    pd.read_parquet(folder / "genomic.parquet").rename(columns={"patient": "pid"}).to_parquet(
        folder / "genomic.parquet", index=False)


def _missing_file(folder):
    (folder / "genomic.parquet").unlink()


BAD_FILES = {
    "negative time": (_negative_time, ["labels.csv", "'months'", "negative", "rows 4, 9"]),
    "text in a numeric category": (_text_in_a_numeric_category, ["clinical.csv", "'grade'", "non-numeric",
                                                                 "records ['P0006']", "data.categorical_cols"]),
    "unknown IDs": (_unknown_ids, ["genomic.parquet", "1 record IDs are not in the label holder's cohort", "'Q9999'",
                                   "labels.csv"]),
    "duplicate IDs": (_duplicate_ids, ["clinical.csv", "'patient'", "duplicate IDs ['P0004']"]),
    "labels in a modality file": (_labels_in_a_modality, ["clinical.csv", "['months']", "data.drop_cols"]),
    "no ID column": (_no_id_column, ["genomic.parquet", "no ID column 'patient'", "data.id_col"]),
    "missing file": (_missing_file, ["genomic.parquet", "not found"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_stops_the_run_with_one_line_naming_file_column_and_rows(case, tmp_path):
    damage, words = BAD_FILES[case]
    overrides = {**TINY, **write_files(tmp_path), "output.dir": str(tmp_path / "out")}
    damage(tmp_path)
    with pytest.raises(DataValidationError) as caught:
        run_inprocess(overrides)
    message = str(caught.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    # the command line prints it as a bad-data error (exit 2: nothing was run)
    line, code = describe_failure(caught.value, {**overrides, "resume.from": ""})
    assert code == 2 and line == f"error: {message}"


def test_keys_of_the_files_are_checked_and_named(tmp_path):
    base = {"strategy.name": "split", "data.name": "vertical_files"}
    files = {"data.labels_path": "/l.csv", "data.modality_paths": "clinical=/c.csv,/d/genomic.parquet"}
    assert parse_run_config({**base, **files}).data.modality_files == {"clinical": "/c.csv",
                                                                       "genomic": "/d/genomic.parquet"}
    with pytest.raises(ConfigError, match="needs 'data.labels_path'.*'data.modality_paths'"):
        parse_run_config({**base, "data.labels_path": "/l.csv"})
    with pytest.raises(ConfigError, match=r"'data.modality_paths' names modality \['clinical'\] more than once"):
        parse_run_config({**base, **files, "data.modality_paths": "/a/clinical.csv,clinical=/b.csv"})
    with pytest.raises(ConfigError, match="'data.modality_paths' item '=/c.csv' is not modality=path"):
        parse_run_config({**base, **files, "data.modality_paths": "=/c.csv"})
    with pytest.raises(ConfigError, match=r"'split.modalities' names \['genes'\]"):
        parse_run_config({**base, **files, "split.modalities": "genes"})
    with pytest.raises(ConfigError, match=r"'data.modality_paths' name\(s\) the files of data.name = 'vertical_files'"):
        parse_run_config({"strategy.name": "split", "data.name": "metabric", **files, "data.labels_path": "",
                          "data.categorical_cols": "grade"})  # data.categorical_cols applies to every table
    with pytest.raises(ConfigError, match="strategy 'fedavg' needs a vertical data set|is vertical"):
        parse_run_config({**files, "data.name": "vertical_files"})
    overrides = {**TINY, **write_files(tmp_path), "output.dir": str(tmp_path / "out")}
    with pytest.raises(DataValidationError, match=r"data.categorical_cols names \['stage_'\], which no modality file"):
        vertical_task.load_table(resolve({**overrides, "data.categorical_cols": "grade,stage_"})[1])


def test_metabric_written_to_files_runs_as_the_built_in_metabric(tmp_path):
    """The same records, IDs and categorical columns from files give the built-in data set's run, figure for figure."""
    from models.data.vertical import METABRIC_CATEGORICAL, load_metabric_vertical

    table = load_metabric_vertical()
    pd.DataFrame({"id": table.ids, "time": table.time, "event": table.event}).to_csv(tmp_path / "labels.csv",
                                                                                     index=False)
    for name, frame in table.modalities.items():
        frame.rename_axis("id").reset_index().to_csv(tmp_path / f"{name}.csv", index=False)
    run = {key: value for key, value in TINY.items() if not key.startswith("data.")}
    run["federation.rounds"] = 1
    built_in = run_inprocess({**run, "data.name": "metabric", "output.dir": str(tmp_path / "built_in")})
    files = run_inprocess({
        **run, "data.name": "vertical_files", "data.labels_path": str(tmp_path / "labels.csv"),
        "data.modality_paths": f"{tmp_path / 'genomic.csv'},{tmp_path / 'clinical.csv'}",
        "data.categorical_cols": ",".join(METABRIC_CATEGORICAL["clinical"]), "output.dir": str(tmp_path / "files")})
    assert files["modalities"] == built_in["modalities"] == ["genomic", "clinical"]
    assert files["test"] == pytest.approx(built_in["test"], rel=1e-9, abs=1e-12)
    assert files["centralized"]["test"] == pytest.approx(built_in["centralized"]["test"], rel=1e-9, abs=1e-12)
