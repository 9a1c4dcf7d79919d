"""Real survival files read as registries export them: text and boolean events (data.event_values), columns of mixed
numbers and words, SurvSet's ``missing`` category, headers with surrounding spaces, and DataFrames given to
``fedsurv.fit`` with their dtypes.

The files are scikit-survival's bundled data sets (GBSG2, the veterans' lung cancer trial, FLCHAIN) written with
pandas' ``to_csv``, and a SEER-shaped file derived from GBSG2 (Kaggle's SEER breast cancer layout: ``Status``
Alive/Dead, ``Grade`` 1/2/3 and `` anaplastic; Grade IV``, a ``"T Stage "`` header). The references are the data
sets' own outcome arrays.
"""

import numpy as np
import pandas as pd
import pytest
from sksurv.datasets import load_flchain, load_gbsg2, load_veterans_lung_cancer
from sksurv.metrics import concordance_index_censored

import fedsurv
from flwr_app.config import ConfigError
from flwr_app.task import load_site_table
from models.data import ColumnRoles, DataValidationError, Preprocessor, load_table
from models.data.validate import event_problems
from simulations import engine
from strategies.config import parse_flat
from strategies.mechanisms.setup_statistics import SetupPlan

GRADE_IV = " anaplastic; Grade IV"


@pytest.fixture(scope="module")
def gbsg2():
    return load_gbsg2()


def export(frame: pd.DataFrame, path) -> str:
    """``frame`` as a registry's CSV export (pandas' ``to_csv``, no index)."""
    frame.to_csv(path, index=False)
    return str(path)


def seer_frame(gbsg2) -> pd.DataFrame:
    """GBSG2 in the SEER breast cancer layout: text outcome, Grade 1-3 with 19 grade III records as SEER's grade IV
    label, a header with a trailing space, survival in whole months."""
    x, y = gbsg2
    grade = x["tgrade"].astype(str).map({"I": "1", "II": "2", "III": "3"})
    grade[np.flatnonzero(grade == "3")[:19]] = GRADE_IV
    tsize = x["tsize"].astype(int)
    return pd.DataFrame({
        "Age": x["age"].astype(int), "T Stage ": np.select([tsize <= 20, tsize <= 50], ["T1", "T2"], "T3"),
        "Grade": grade, "Tumor Size": tsize,
        "Estrogen Status": np.where(x["estrec"] >= 10, "Positive", "Negative"),
        "Reginol Node Positive": x["pnodes"].astype(int),
        "Survival Months": np.round(y["time"] / 30.44).astype(int), "Status": np.where(y["cens"], "Dead", "Alive"),
    })


def load_seer(path: str, **roles) -> object:
    return load_table("csv", path=path, time_col="Survival Months", event_col="Status", roles=ColumnRoles(**roles),
                      notes=False)


def test_gbsg2_export_reads_its_boolean_event_and_text_columns_as_they_are(gbsg2, tmp_path):
    x, y = gbsg2
    path = export(x.assign(time=y["time"], cens=y["cens"]), tmp_path / "gbsg2.csv")
    table = load_table("csv", path=path, event_col="cens", notes=False)
    np.testing.assert_array_equal(table.event, y["cens"].astype("float32"))
    np.testing.assert_array_equal(table.time, y["time"])
    names = Preprocessor.fit(table.features).feature_names
    assert {"horTh=no", "horTh=yes", "menostat=Post", "menostat=Pre", "tgrade=I", "tgrade=II", "tgrade=III",
            "age", "pnodes"} <= set(names)


def test_a_boolean_event_is_read_as_is_or_through_event_values(tmp_path):
    x, y = load_veterans_lung_cancer()
    path = export(x.assign(days=y["Survival_in_days"], Status=y["Status"]), tmp_path / "veterans.csv")
    for values, expected in (((), y["Status"]), (("TRUE",), y["Status"]), ((" false",), ~y["Status"])):
        table = load_table("csv", path=path, time_col="days", event_col="Status",
                           roles=ColumnRoles(event_values=values), notes=False)
        np.testing.assert_array_equal(table.event, expected.astype("float32"))
    assert set(table.features["Celltype"]) == set(x["Celltype"].astype(str))


def test_event_values_match_numbers_by_value_and_text_without_case_or_spaces():
    text, _ = event_problems(pd.Series([" dead", "Alive ", "DEAD", "alive"]), source="s", column="c",
                             event_values=("Dead",))
    causes, _ = event_problems(pd.Series([0, 1, 2, 1.0, 0]), source="s", column="c", event_values=("1", "2.0"))
    np.testing.assert_array_equal(text, [1, 0, 1, 0])
    np.testing.assert_array_equal(causes, [0, 1, 1, 1, 0])


def test_an_r_status_column_is_refused_suggesting_its_event_code():
    """R's survival data code status 1 = censored, 2 = dead: the suggested key is 2, and it reads them."""
    status = pd.Series([1, 2, 2, 1, 1])
    _, problems = event_problems(status, source="lung.csv", column="status", event_values=())
    assert problems == [("lung.csv: column 'status' (data.event_col): 2 values other than 0/1 or true/false (rows "
                         "2, 3); values found: 1 (3), 2 (2); name the values that mark an event in data.event_values "
                         "(e.g. data.event_values=2): every other value then marks a censored record")]
    events, problems = event_problems(status, source="lung.csv", column="status", event_values=("2",))
    np.testing.assert_array_equal(events, [0, 1, 1, 0, 0])
    assert not problems


def test_seer_export_without_keys_names_the_event_column_the_values_and_both_fixes(gbsg2, tmp_path):
    _, y = gbsg2
    path = export(seer_frame(gbsg2), tmp_path / "seer.csv")
    with pytest.raises(DataValidationError) as error:
        load_seer(path)
    message = str(error.value)
    dead, alive = int(y["cens"].sum()), int((~y["cens"]).sum())
    for part in (f"{path}: column 'Status' (data.event_col): {len(y)} values other than 0/1 or true/false",
                 f"values found: 'Alive' ({alive}), 'Dead' ({dead})", "e.g. data.event_values=Dead",
                 f"{path}: column 'Grade': 19 non-numeric values in a numeric column", f"'{GRADE_IV}' (19)",
                 "list the column in data.categorical_cols", "or clean these values"):
        assert part in message, message
    assert error.value.public == (("not an event column", "data.event_col"), ("not numeric", "data.feature_cols"))


def test_seer_export_runs_with_event_values_and_grade_as_categories(gbsg2, tmp_path):
    _, y = gbsg2
    path = export(seer_frame(gbsg2), tmp_path / "seer.csv")
    table = load_seer(path, event_values=("dead",), categorical=("Grade",), drop_cols=("T Stage",))
    np.testing.assert_array_equal(table.event, y["cens"].astype("float32"))
    assert "T Stage " not in table.features  # named without its trailing space, as a run config can write it
    assert Preprocessor.fit(table.features).categories["Grade"] == (GRADE_IV, "1", "2", "3")
    plan = SetupPlan.for_features(table.features, noise_multiplier=1.0)
    assert "Grade" in plan.categorical and "Age" in plan.numeric


def test_event_values_that_no_row_holds_are_named_with_the_values_found(gbsg2, tmp_path):
    _, y = gbsg2
    path = export(seer_frame(gbsg2), tmp_path / "seer.csv")
    with pytest.raises(DataValidationError) as error:
        load_seer(path, event_values=("Dead", "Deceased"), categorical=("Grade",))
    dead, alive = int(y["cens"].sum()), int((~y["cens"]).sum())
    assert str(error.value) == (f"{path}: column 'Status' (data.event_col): data.event_values names 'Deceased', which "
                                f"no row holds; values found: 'Alive' ({alive}), 'Dead' ({dead})")


def survset_frame(gbsg2) -> pd.DataFrame:
    """GBSG2 as SurvSet codes it: factors as codes, a missing level written ``missing``, and a record ID ``pid``."""
    x, y = gbsg2
    frame = x.assign(tgrade=x["tgrade"].astype(str).map({"I": "1", "II": "2", "III": "3"}),
                     horTh=(x["horTh"] == "yes").astype(int).astype(str), pid=np.arange(len(x)),
                     event=y["cens"].astype(int), time=y["time"])
    frame.loc[::25, "tgrade"] = "missing"
    frame.loc[::40, "horTh"] = "missing"
    return frame


def test_survset_missing_level_is_refused_with_its_count_and_the_keys_then_kept_as_a_level(gbsg2, tmp_path):
    frame = survset_frame(gbsg2)
    path = export(frame, tmp_path / "survset.csv")
    with pytest.raises(DataValidationError) as error:
        load_table("csv", path=path, notes=False)
    message = str(error.value)
    for part in (f"column 'tgrade': {len(frame[::25])} non-numeric values", f"'missing' ({len(frame[::25])})",
                 f"column 'horTh': {len(frame[::40])} non-numeric values", "data.categorical_cols: horTh,tgrade",
                 "column 'pid' looks like a record identifier", "data.id_col"):
        assert part in message, message
    table = load_table("csv", path=path, roles=ColumnRoles(id_col="pid", categorical=("tgrade", "horTh")),
                       notes=False)
    pre = Preprocessor.fit(table.features)
    assert pre.categories["tgrade"] == ("1", "2", "3", "missing") and pre.categories["horTh"] == ("0", "1", "missing")
    block = pre.transform(table.features)[:, [pre.feature_names.index(f"tgrade={k}") for k in pre.categories["tgrade"]]]
    np.testing.assert_array_equal(block[:, 3], (frame["tgrade"] == "missing").to_numpy())


def test_flchain_chapter_keeps_its_missing_values_encoded_apart_from_every_level(tmp_path):
    x, y = load_flchain()
    path = export(x.assign(futime=y["futime"], death=y["death"]), tmp_path / "flchain.csv")
    table = load_table("csv", path=path, time_col="futime", event_col="death",
                       roles=ColumnRoles(categorical=("flc.grp", "chapter")), notes=False)
    np.testing.assert_array_equal(table.event, y["death"].astype("float32"))
    missing = x["chapter"].isna().to_numpy()
    assert missing.sum() > 0 and (table.features["chapter"].isna().to_numpy() == missing).all()
    pre = Preprocessor.fit(table.features)
    assert pre.categories["flc.grp"] == tuple(sorted(map(str, range(1, 11))))
    assert pre.categories["chapter"] == tuple(sorted(x["chapter"].dropna().astype(str).unique()))
    columns = [pre.feature_names.index(f"chapter={k}") for k in pre.categories["chapter"]]
    np.testing.assert_array_equal(pre.transform(table.features)[:, columns].sum(axis=1), (~missing).astype(float))


def test_event_values_are_refused_where_the_run_ignores_them():
    with pytest.raises(DataValidationError, match="data set 'gbsg' has a fixed 0/1 event column 'event'"):
        load_table("gbsg", roles=ColumnRoles(event_values=("1",)))
    with pytest.raises(ConfigError) as error:
        parse_flat({"data.name": "flchain", "data.event_values": "Dead"})
    assert str(error.value) == ("run config: data.event_values = 'Dead' has no effect on data.name = 'flchain' (its "
                                "event column is fixed, 0/1); it applies to data.name = 'csv' and 'site_files' "
                                "(horizontal): leave it at ''")


def test_a_deployed_site_reads_its_own_file_with_the_run_configs_event_values_and_categories(gbsg2, tmp_path):
    _, y = gbsg2
    path = export(seer_frame(gbsg2), tmp_path / "site.csv")
    cfg = parse_flat({"data.name": "site_files", "data.time_col": "Survival Months", "data.event_col": "Status",
                      "data.event_values": "Dead", "data.categorical_cols": "Grade", "evaluation.server_side": False,
                      "baseline.centralized": False})
    table = load_site_table(cfg, path, notes=False)
    np.testing.assert_array_equal(table.event, y["cens"].astype("float32"))
    assert isinstance(table.features["Grade"].dtype, pd.CategoricalDtype)


def test_fit_keeps_a_frames_dtypes_and_names_the_frame_in_its_errors(gbsg2, tmp_path, monkeypatch):
    frame = seer_frame(gbsg2).astype({"Grade": "category"})
    with pytest.raises(DataValidationError) as error:
        fedsurv.fit(frame, time_col="Survival Months", event_col="Status", output_dir=tmp_path / "refused")
    message = str(error.value)
    assert message.startswith(f"{fedsurv.api.FRAME_SOURCE}: column 'Status' (event_col):"), message
    assert "e.g. event_values=Dead" in message and fedsurv.api.DATA_FILE not in message and "Grade" not in message
    monkeypatch.setattr(engine, "run_simulation", lambda overrides: engine.run_inprocess(overrides))
    run = fedsurv.fit(frame, time_col="Survival Months", event_col="Status", event_values=["Dead"], sites=2,
                      rounds=1, output_dir=tmp_path / "run", config={"baseline.centralized": False})
    copy = pd.read_parquet(run.directory / fedsurv.api.DATA_FILE)
    assert isinstance(copy["Grade"].dtype, pd.CategoricalDtype) and list(copy.columns) == list(frame.columns)
    assert 0.5 < run.summary["test"]["c_index"] <= 1.0
    dead = (frame["Status"] == "Dead").to_numpy()  # scoring reads the text events as the run did
    reference = concordance_index_censored(dead, frame["Survival Months"].to_numpy(float), run.risk_score(frame))[0]
    assert run.event_values == ("Dead",) and run.score(frame)["c_index"] == pytest.approx(reference, abs=1e-9)
    with pytest.raises(DataValidationError, match="'Status'"):
        run.score(frame.assign(Status=None))
