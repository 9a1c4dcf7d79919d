"""data.categorical_cols for every tabular source: numeric category codes are one-hot encoded (csv, a named data set,
a deployed site's file, through the private set-up), a bad name is refused naming the key and the file, and an
unlisted column of a few integer codes gets a one-line note naming it and the key."""

import json
import logging

import numpy as np
import pandas as pd
import pytest

from models.data import ColumnRoles, DataValidationError, load_table
from models.predict import load_run
from simulations.engine import run_inprocess


def centres(n: int = 900, seed: int = 0) -> pd.DataFrame:
    """Five centres coded 1-5 whose risk is not monotone in the code, a stage coded 1-3 with gaps, and age."""
    rng = np.random.default_rng(seed)
    centre = rng.integers(1, 6, n)
    stage = rng.choice([1.0, 2.0, 3.0, np.nan], n, p=[0.3, 0.3, 0.3, 0.1])
    risk = np.array([0.0, 1.2, -0.8, 0.4, 2.0, -1.5])[centre] + 0.2 * np.nan_to_num(stage)
    event_time, censor_time = rng.exponential(np.exp(-risk)), rng.exponential(1.5, n)
    return pd.DataFrame({"centre": centre, "stage": stage, "age": rng.normal(60, 10, n).round(1),
                         "time": np.minimum(event_time, censor_time), "event": (event_time <= censor_time).astype(int)})


@pytest.fixture
def centres_csv(tmp_path):
    path = tmp_path / "centres.csv"
    centres().to_csv(path, index=False)
    return path


def test_listed_codes_become_category_labels_and_missing_stays_missing(centres_csv):
    table = load_table("csv", path=str(centres_csv), roles=ColumnRoles(categorical=("centre", "stage")))
    assert sorted(table.features["centre"].unique()) == ["1", "2", "3", "4", "5"]
    assert set(table.features["stage"].dropna()) == {"1", "2", "3"}  # 2.0 is the code "2", not "2.0"
    assert table.features["stage"].isna().sum() == centres()["stage"].isna().sum()
    assert table.features["age"].dtype == float


def test_a_bad_name_is_refused_naming_the_key_the_file_and_the_column(centres_csv):
    with pytest.raises(DataValidationError, match=r"centres.csv: data.categorical_cols names column 'ward', which "
                                                  r"the file does not have"):
        load_table("csv", path=str(centres_csv), roles=ColumnRoles(categorical=("ward",)))
    with pytest.raises(DataValidationError, match=r"names column 'time', which is not a feature of the run"):
        load_table("csv", path=str(centres_csv), roles=ColumnRoles(categorical=("time",)))


def test_an_unlisted_column_of_integer_codes_gets_one_note_naming_it_and_the_key(centres_csv, caplog):
    with caplog.at_level(logging.WARNING, logger="models.data.datasets"):
        load_table("csv", path=str(centres_csv))
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [
        f"{centres_csv}: column 'centre' holds 5 integer values (1, 2, 3, 4, 5) and is used as a number; if they "
        "are codes of categories, list it in data.categorical_cols",
        f"{centres_csv}: column 'stage' holds 3 integer values (1, 2, 3) and is used as a number; if they are codes "
        "of categories, list it in data.categorical_cols"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="models.data.datasets"):
        load_table("csv", path=str(centres_csv), roles=ColumnRoles(categorical=("centre", "stage")))
    assert not caplog.records


def test_a_named_data_set_takes_the_key_too():
    table = load_table("gbsg", roles=ColumnRoles(categorical=("x1",)))  # GBSG's x1: tumour grade, coded 0-2
    assert set(table.features["x1"].dropna()) == {"0", "1", "2"}


RUN = {"federation.num_sites": 2, "federation.rounds": 3, "baseline.centralized": False}


def test_a_federation_one_hot_encodes_the_codes_and_learns_a_non_monotone_centre_effect(centres_csv, tmp_path):
    """The same file, centre as a number and as categories: only the categories carry its effect (risk by centre
    1.2, -0.8, 0.4, 2.0, -1.5)."""
    c_index = {}
    for name, extra in (("number", {}), ("codes", {"data.categorical_cols": "centre,stage"})):
        summary = run_inprocess({**RUN, "data.name": "csv", "data.path": str(centres_csv), **extra,
                                 "output.dir": str(tmp_path / name)})
        c_index[name] = summary["test"]["c_index"]
    inputs = json.loads((tmp_path / "codes" / "preprocessing.json").read_text())["model_inputs"]
    assert inputs[:5] == [f"centre={code}" for code in range(1, 6)] and "stage=2" in inputs
    assert c_index["codes"] > c_index["number"] + 0.1, c_index
    run, records = load_run(tmp_path / "codes"), centres(20, seed=1)  # stage 2.0 with missing values: floats
    one_hot = pd.DataFrame(run.preprocessor.transform(records), columns=run.preprocessor.feature_names)
    np.testing.assert_array_equal(one_hot["stage=2"], (records["stage"] == 2.0).astype("float32"))


def _site_files(tmp_path) -> list[dict[str, str]]:
    """The centres data split over two deployed sites' files; their node configs."""
    frame = centres()
    configs = []
    for index, rows in enumerate(np.array_split(np.arange(len(frame)), 2)):
        path = tmp_path / f"site-{index}.csv"
        frame.iloc[rows].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}"})
    return configs


def test_deployed_sites_with_a_private_set_up_agree_the_categories(centres_csv, tmp_path):
    configs = _site_files(tmp_path)
    summary = run_inprocess({"data.name": "site_files", "strategy.name": "dp_sgd", "privacy.epsilon": 10.0,
                             "federation.num_sites": 2, "federation.rounds": 1, "evaluation.server_side": False,
                             "baseline.centralized": False, "data.categorical_cols": "centre",
                             "output.dir": str(tmp_path / "out")}, node_configs=configs)
    assert summary["num_sites"] == 2
    inputs = json.loads((tmp_path / "out" / "preprocessing.json").read_text())["model_inputs"]
    assert [name for name in inputs if name.startswith("centre")] == [f"centre={code}" for code in range(1, 6)]


def test_a_deployed_site_logs_its_files_notes_at_set_up_only(tmp_path, monkeypatch):
    """A deployed site reads its file again for every message (a new process each, under Flower's SuperNode): the
    integer-code note is logged while it answers set-up messages, never with a training or evaluation message."""
    from simulations import engine

    configs = _site_files(tmp_path)
    handling: list[str] = []
    deliver = engine.InProcessGrid._deliver

    def tagged(grid, message):  # noqa: ANN001, ANN202
        handling.append(message.metadata.message_type)
        return deliver(grid, message)

    noted: list[tuple[str, str]] = []

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            noted.append((handling[-1] if handling else "", record.getMessage()))

    monkeypatch.setattr(engine.InProcessGrid, "_deliver", tagged)
    handler = Notes(level=logging.WARNING)
    logging.getLogger("models.data.datasets").addHandler(handler)
    try:
        run_inprocess({"data.name": "site_files", "federation.num_sites": 2, "federation.rounds": 2,
                       "evaluation.server_side": False, "baseline.centralized": False,
                       "data.categorical_cols": "centre", "output.dir": str(tmp_path / "out")}, node_configs=configs)
    finally:
        logging.getLogger("models.data.datasets").removeHandler(handler)
    assert {"train", "evaluate"} <= set(handling)
    assert {note.split(":")[0] for _, note in noted} == {str(tmp_path / "site-0.csv"), str(tmp_path / "site-1.csv")}
    assert all("column 'stage' holds 3 integer values" in note for _, note in noted)
    assert not [kind for kind, _ in noted if kind in ("train", "evaluate")], noted
