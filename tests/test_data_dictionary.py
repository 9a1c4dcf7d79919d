"""Public data dictionary, clip ranges in the Preprocessor, and the time grid from fractional counts."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from models.data import Preprocessor
from models.data.dictionary import DataDictionary, DataDictionaryError
from models.data.validate import DataValidationError
from models.time_grid import make_time_grid, time_grid_from_counts

GOOD = {
    "numeric": {"age": [50, 105], "creatinine": [0, 15.5]},
    "categorical": {"sex": ["F", "M"], "grade": [1, 2, 3], "smoker": [True, False]},
    "time": {"grid": [0, 365, 730, 1095.5]},
}


def test_json_and_yaml_files_give_the_same_dictionary(tmp_path):
    json_path = tmp_path / "dict.json"
    json_path.write_text(json.dumps(GOOD))
    yaml_path = tmp_path / "dict.yaml"
    yaml_path.write_text(
        "numeric:\n  age: [50, 105]\n  creatinine: [0, 15.5]\n"
        "categorical:\n  sex: [F, M]\n  grade: [1, 2, 3]\n  smoker: [true, false]\n"
        "time:\n  grid: [0, 365, 730, 1095.5]\n"
    )
    from_json, from_yaml = DataDictionary.load(json_path), DataDictionary.load(yaml_path)
    assert from_json.numeric == from_yaml.numeric == {"age": (50.0, 105.0), "creatinine": (0.0, 15.5)}
    assert from_json.categorical == from_yaml.categorical == {
        "sex": ("F", "M"), "grade": ("1", "2", "3"), "smoker": ("True", "False")}
    assert from_json.time_grid == from_yaml.time_grid == (0.0, 365.0, 730.0, 1095.5)
    assert from_json.time_max == 1095.5 and from_json.source == str(json_path)
    assert DataDictionary.from_mapping(from_json.to_dict()).numeric == from_json.numeric
    assert DataDictionary.from_mapping({"time": {"max": 60}}).time_max == 60.0
    assert DataDictionary.from_mapping(None).numeric == {}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"numeric": {"age": [105, 50]}}, "numeric column 'age': range must be [lo, hi] with finite numbers lo < hi"),
        ({"numeric": {"age": [0, float("inf")]}}, "numeric column 'age': range must be"),
        ({"numeric": {"age": [0, "old"]}}, "numeric column 'age': range must be"),
        ({"numeric": {"age": 50}}, "numeric column 'age': range must be"),
        ({"numeric": {"age": [True, 2]}}, "numeric column 'age': range must be"),
        ({"categorical": {"sex": []}}, "categorical column 'sex': levels must be a non-empty list"),
        ({"categorical": {"sex": "F"}}, "categorical column 'sex': levels must be a non-empty list"),
        ({"categorical": {"sex": ["F", None]}}, "categorical column 'sex': levels must be a non-empty list"),
        ({"categorical": {"grade": [1, "1"]}}, "categorical column 'grade': level '1' is listed more than once"),
        ({"numeric": {"x": [0, 1]}, "categorical": {"x": ["a"]}},
         "column 'x' is listed as both numeric and categorical"),
        ({"time": {"grid": [1, 2, 3]}}, "time: 'grid' must be at least two finite, strictly increasing cut points"),
        ({"time": {"grid": [0, 2, 2]}}, "time: 'grid' must be"),
        ({"time": {"grid": [0]}}, "time: 'grid' must be"),
        ({"time": {"max": -3}}, "time: 'max' must be a finite number > 0"),
        ({"time": {"grid": [0, 1], "max": 1}}, "time: give one of 'grid' or 'max'"),
        ({"time": {"range": [0, 1]}}, "time: give one of 'grid' or 'max'"),
        ({"columns": {}}, "unknown section(s) columns"),
        ({"numeric": [["age", 0, 1]]}, "'numeric' must be a mapping of column to entry"),
        ([1, 2], "a data dictionary must be a mapping"),
    ],
)
def test_a_bad_entry_is_one_line_naming_the_file_the_column_and_the_problem(tmp_path, payload, message):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(DataDictionaryError) as err:
        DataDictionary.load(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert isinstance(err.value, DataValidationError)


def test_unreadable_or_malformed_files_are_named(tmp_path):
    with pytest.raises(DataDictionaryError, match="cannot read the data dictionary"):
        DataDictionary.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{numeric: ")
    with pytest.raises(DataDictionaryError, match=r"bad\.json: not valid JSON"):
        DataDictionary.load(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("numeric: [unclosed\n")
    with pytest.raises(DataDictionaryError, match=r"bad\.yaml: not valid YAML") as err:
        DataDictionary.load(tmp_path / "bad.yaml")
    assert "\n" not in str(err.value)
    (tmp_path / "dict.txt").write_text("{}")
    with pytest.raises(DataDictionaryError, match=r"dict\.txt: a data dictionary must be a \.json, \.yaml or \.yml"):
        DataDictionary.load(tmp_path / "dict.txt")


def test_columns_must_exist_with_the_listed_kind():
    dictionary = DataDictionary.from_mapping(GOOD, source="study.json")
    dictionary.check_columns({"age", "creatinine", "kappa"}, {"sex", "grade", "smoker"})
    with pytest.raises(DataDictionaryError, match="study.json: column 'age' is listed as numeric but is categorical"):
        dictionary.check_columns({"creatinine"}, {"age", "sex", "grade", "smoker"})
    with pytest.raises(DataDictionaryError, match="study.json: categorical column 'grade' is not a feature column"):
        dictionary.check_columns({"age", "creatinine"}, {"sex", "smoker"})


# --------------------------------------------------------------------------- Preprocessor clip ranges


def test_clip_ranges_clip_before_standardising_and_survive_serialisation():
    frame = pd.DataFrame({"age": [10.0, 50.0, np.nan, 300.0], "sex": ["F", "M", "F", None]})
    pre = Preprocessor(("age", "sex"), {"age": 60.0}, {"age": 20.0}, {"sex": ("F", "M")}, {"age": (20.0, 100.0)})
    np.testing.assert_allclose(pre.transform(frame)[:, 0], [-2.0, -0.5, 0.0, 2.0])
    again = Preprocessor.from_dict(json.loads(json.dumps(pre.to_dict())))
    assert again == pre
    np.testing.assert_array_equal(again.transform(frame), pre.transform(frame))
    assert Preprocessor.fit(frame).ranges == {}  # the exact fit clips nothing
    with pytest.raises(ValueError, match="clip range of column 'age' must be finite"):
        Preprocessor(("age",), {"age": 0.0}, {"age": 1.0}, {}, {"age": (5.0, 5.0)})
    with pytest.raises(ValueError, match="clip range of column 'sex'"):
        Preprocessor(("age", "sex"), {"age": 0.0}, {"age": 1.0}, {"sex": ("F",)}, {"sex": (0.0, 1.0)})


# --------------------------------------------------------------------------- grid from counts


def test_time_grid_from_fractional_counts_depends_only_on_their_proportions():
    rng = np.random.default_rng(0)
    time = rng.integers(1, 60, 500).astype(float)
    event = (rng.random(500) < 0.5).astype(float)
    points = np.arange(1.0, 60.0)
    events = np.array([event[time == t].sum() for t in points])
    censored = np.array([(1 - event[time == t]).sum() for t in points])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = make_time_grid(time, event, num_durations=12)
        np.testing.assert_array_equal(time_grid_from_counts(points, events, censored, num_durations=12), exact)
        np.testing.assert_array_equal(
            time_grid_from_counts(points, events * 0.37, censored * 0.37, num_durations=12), exact)
    np.testing.assert_allclose(time_grid_from_counts(points, events, censored, num_durations=5, scheme="equidistant"),
                               np.linspace(0, time.max(), 5))
    with pytest.raises(ValueError, match="non-negative counts"):
        time_grid_from_counts(points, -events, censored, num_durations=5)
    with pytest.raises(ValueError, match="strictly increasing"):
        time_grid_from_counts(points[::-1], events, censored, num_durations=5)
