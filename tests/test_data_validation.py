"""Bad input gives a DataValidationError naming the file, the column, the problem and the rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from models.data import (
    DataValidationError,
    build_federated_dataset,
    check_same_schema,
    load_table,
    validate_survival_frame,
)
from models.data.validate import describe_rows


def good_frame(n: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "age": rng.normal(60, 10, n).round(1),
            "stage": rng.choice(["I", "II", "III"], n),
            "time": rng.exponential(10, n).round(2),
            "event": np.tile([0, 1], n // 2),
        }
    )


def write_csv(tmp_path: Path, frame: pd.DataFrame, name: str = "site.csv") -> str:
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return str(path)


def load_csv(path: str, **kwargs) -> None:
    load_table("csv", path=path, time_col="time", event_col="event", **kwargs)


def assert_message(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_good_csv_loads_with_parsed_outcome(tmp_path):
    table = load_table("csv", path=write_csv(tmp_path, good_frame()), time_col="time", event_col="event")
    assert len(table) == 40
    assert list(table.features.columns) == ["age", "stage"]
    assert table.time.dtype == np.float64 and table.event.dtype == np.float32
    assert set(np.unique(table.event)) == {0.0, 1.0}


def test_negative_time_names_file_column_and_rows(tmp_path):
    frame = good_frame()
    frame.loc[[1, 6, 8], "time"] = -1.0
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'time'", "3 negative values", "rows 2, 7, 9")


def test_event_value_two_is_rejected(tmp_path):
    frame = good_frame()
    frame.loc[4, "event"] = 2
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'event' (data.event_col): 1 values other than 0/1 or true/false (row 5)",
                   "values found: 1 (20), 0 (19), 2 (1)", "e.g. data.event_values=[1,2]")


def test_missing_time_column_lists_present_columns(tmp_path):
    path = write_csv(tmp_path, good_frame().drop(columns=["time"]))
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "data.time_col names column 'time', which the file does not have",
                   "columns present: age, stage, event")


def test_missing_feature_column(tmp_path):
    path = write_csv(tmp_path, good_frame())
    with pytest.raises(DataValidationError) as error:
        load_csv(path, feature_cols=["age", "weight"])
    assert_message(error, path, "data.feature_cols names column 'weight', which the file does not have")


def test_nan_and_non_numeric_times(tmp_path):
    frame = good_frame().astype({"time": object})
    frame.loc[2, "time"] = np.nan
    frame.loc[[3, 10], "time"] = "soon"
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'time'", "2 non-numeric values (rows 4, 11)", "1 missing (NaN) values (row 3)")


def test_non_numeric_value_in_numeric_feature(tmp_path):
    frame = good_frame().astype({"age": object})
    frame.loc[7, "age"] = "sixty"
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'age'", "1 non-numeric values", "row 8")


def test_non_numeric_and_missing_events(tmp_path):
    frame = good_frame().astype({"event": object})
    frame.loc[0, "event"] = "dead"
    frame.loc[1, "event"] = np.nan
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'event' (data.event_col)", "values other than 0/1 or true/false (row 1)",
                   "'dead' (1)", "data.event_values=dead", "missing (NaN) values (row 2)")


@pytest.mark.parametrize("values", [[True, False], ["1", "0"], [1.0, 0.0]])
def test_boolean_and_string_events_are_accepted(values):
    frame = good_frame().assign(event=values * 20)
    _, event = validate_survival_frame(frame, source="mem", time_col="time", event_col="event", feature_cols=["age"])
    np.testing.assert_array_equal(event, [1.0, 0.0] * 20)


def test_no_events_at_all(tmp_path):
    path = write_csv(tmp_path, good_frame().assign(event=0))
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "column 'event'", "no events at all")


def test_infinite_time_and_feature():
    frame = good_frame()
    frame.loc[5, "time"] = np.inf
    frame.loc[9, "age"] = -np.inf
    with pytest.raises(DataValidationError) as error:
        validate_survival_frame(frame, source="mem", time_col="time", event_col="event", feature_cols=["age"])
    assert_message(error, "mem: column 'time' (data.time_col): 1 infinite values (row 6)",
                   "mem: column 'age': 1 infinite values (row 10)")


def test_missing_file(tmp_path):
    path = str(tmp_path / "absent.csv")
    with pytest.raises(DataValidationError) as error:
        load_csv(path)
    assert_message(error, path, "file not found")


@pytest.mark.parametrize("content", ["", "age,time,event\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.csv"
    path.write_text(content)
    with pytest.raises(DataValidationError) as error:
        load_csv(str(path))
    assert_message(error, str(path), "empty file")


def test_row_listing_shows_first_five_and_count():
    assert describe_rows([0]) == "row 1"
    assert describe_rows(range(12)) == "rows 1, 2, 3, 4, 5, ... (12 in all)"


def test_unknown_data_set_and_missing_csv_path():
    with pytest.raises(DataValidationError, match="unknown data set 'nope'; options: flchain"):
        load_table("nope")
    with pytest.raises(DataValidationError, match="needs a path"):
        load_table("csv")


def test_unknown_partition_lists_options(tmp_path):
    path = write_csv(tmp_path, good_frame())
    with pytest.raises(DataValidationError) as error:
        build_federated_dataset(name="csv", path=path, seed=0, num_sites=2, partition="hospital")
    assert_message(error, path, "unknown partition 'hospital'", "iid, dirichlet", "stage")


def test_site_without_training_events_is_named(tmp_path):
    frame = good_frame().assign(hospital=np.where(np.arange(40) < 20, "A", "B"))
    frame.loc[frame.hospital == "B", "event"] = 0
    path = write_csv(tmp_path, frame)
    with pytest.raises(DataValidationError) as error:
        build_federated_dataset(name="csv", path=path, seed=0, num_sites=2, partition="hospital")
    assert_message(error, path, "no events in the training part", "site 'B' (16 records)")
    assert "site 'A'" not in str(error.value)


def test_out_of_time_needs_dates(tmp_path):
    path = write_csv(tmp_path, good_frame())
    with pytest.raises(DataValidationError, match="needs record dates"):
        build_federated_dataset(name="csv", path=path, seed=0, num_sites=2, oot_start="2005-01-01")


def test_same_schema_passes_for_int_vs_float():
    check_same_schema({"A": good_frame(), "B": good_frame().astype({"event": float})})


def test_schema_differences_name_site_and_columns():
    frames = {
        "A": good_frame(),
        "B": good_frame().drop(columns=["stage"]).assign(bmi=1.0),
        "C": good_frame().astype({"age": str}),
    }
    with pytest.raises(DataValidationError) as error:
        check_same_schema(frames)
    assert_message(
        error,
        "site 'B': missing columns ['stage']",
        "site 'B': extra columns ['bmi']",
        "site 'C': column 'age' is categorical but numeric at site 'A'",
    )


def test_labels_file_of_a_vertical_deployment_names_file_column_and_rows(tmp_path: Path) -> None:
    from models.data.vertical import read_labels_file

    path = tmp_path / "labels.csv"
    pd.DataFrame({"id": ["p1", "p2", "p3"], "time": [3.0, -1.0, 2.0], "event": [1, 0, 2]}).to_csv(path, index=False)
    with pytest.raises(DataValidationError) as err:
        read_labels_file(path)
    assert f"{path}: column 'time' (data.time_col): 1 negative values (row 2)" in str(err.value)
    assert f"{path}: column 'event' (data.event_col): 1 values other than 0/1 or true/false (row 3)" in str(err.value)
    pd.DataFrame({"id": ["p1", "p2"], "t": [3.0, 1.0], "e": [1, 0]}).to_csv(path, index=False)
    table = read_labels_file(path, time_col="t", event_col="e")
    assert table.ids.tolist() == ["p1", "p2"] and table.time.tolist() == [3.0, 1.0] and not table.modalities


def test_deployed_preprocessing_from_summed_site_statistics_equals_the_pooled_fit() -> None:
    from models.data import FeatureStatistics, Preprocessor
    from models.time_grid import make_time_grid, time_grid_from_histograms, time_histogram

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"age": rng.normal(60, 10, 90), "sex": rng.choice(["F", "M"], 90)})
    frame.loc[[3, 50], "age"] = np.nan
    sites = [frame.iloc[:30], frame.iloc[30:60], frame.iloc[60:]]
    summed = sum((FeatureStatistics.from_dict(FeatureStatistics.from_frame(site).to_dict()) for site in sites[1:]),
                 start=FeatureStatistics.from_frame(sites[0]))
    deployed = Preprocessor.from_dict(Preprocessor.from_statistics(summed).to_dict())
    np.testing.assert_allclose(deployed.transform(frame), Preprocessor.fit(frame).transform(frame), rtol=1e-6)

    time, event = rng.exponential(5.0, 90), rng.integers(0, 2, 90)
    edges = np.linspace(0.0, time.max(), 2001)
    counts = [time_histogram(time[part], event[part], edges) for part in np.array_split(np.arange(90), 3)]
    events, censored = (np.sum([c[k] for c in counts], axis=0) for k in (0, 1))
    np.testing.assert_allclose(time_grid_from_histograms(edges, events, censored, num_durations=10, scheme="equidistant"),
                               make_time_grid(time, event, num_durations=10, scheme="equidistant"))
    quantiles = time_grid_from_histograms(edges, events, censored, num_durations=10)
    assert np.abs(quantiles - make_time_grid(time, event, num_durations=10)).max() <= time.max() / 2000
