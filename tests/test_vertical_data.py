"""Vertically partitioned data: loaders, the three-modality generator, ID alignment."""

from __future__ import annotations

import re
from itertools import combinations

import numpy as np
import pandas as pd
import pytest
from sksurv.linear_model import CoxPHSurvivalAnalysis
from sksurv.metrics import concordance_index_censored
from sksurv.util import Surv

from simulations.papers.baselines import design_matrix
from models.data import DataValidationError
from models.data.vertical import (
    METABRIC_MODALITIES,
    VerticalAlignmentError,
    align_modalities,
    fit_modality_transform,
    load_breast_cancer_vertical,
    load_metabric_vertical,
    load_vertical,
    read_modality_file,
    simulate_multimodal,
    split_train_test,
)


def test_metabric_splits_into_genomic_and_clinical() -> None:
    table = load_metabric_vertical()  # the bundled copy
    assert len(table) == 1904
    assert {name: tuple(frame.columns) for name, frame in table.modalities.items()} == METABRIC_MODALITIES
    assert table.event.mean() == pytest.approx(0.58, abs=0.01)  # 42 % censored (data README)
    assert (table.modalities["genomic"].index == table.ids).all()


def test_metabric_missing_file_names_the_path(tmp_path) -> None:
    with pytest.raises(DataValidationError, match=re.escape(f"{tmp_path / 'metabric.csv'}: file not found")):
        load_metabric_vertical(tmp_path)


def test_breast_cancer_has_76_genes_and_4_clinical_columns() -> None:
    table = load_breast_cancer_vertical()
    assert len(table) == 198
    assert table.modalities["genes"].shape == (198, 76)
    assert list(table.modalities["clinical"].columns) == ["age", "size", "er", "grade"]
    assert set(np.unique(table.modalities["clinical"]["grade"])) <= {1.0, 2.0, 3.0}
    assert not table.modalities["clinical"].isna().any().any()


def _cox_c_index(table, modalities: tuple[str, ...], train: np.ndarray, test: np.ndarray) -> float:
    x = np.hstack([table.modalities[name].to_numpy() for name in modalities])
    y = Surv.from_arrays(table.event.astype(bool), table.time)
    model = CoxPHSurvivalAnalysis().fit(x[train], y[train])
    risk = model.predict(x[test])
    return concordance_index_censored(table.event[test].astype(bool), table.time[test], risk)[0]


def test_simulated_hazard_needs_all_three_modalities() -> None:
    table = simulate_multimodal(4000, seed=1)
    assert 1 - table.event.mean() == pytest.approx(0.3, abs=0.03)
    order = np.random.default_rng(0).permutation(len(table))
    train, test = order[:3000], order[3000:]
    full = _cox_c_index(table, ("a", "b", "c"), train, test)
    pairs = {pair: _cox_c_index(table, pair, train, test) for pair in combinations("abc", 2)}
    # Each modality carries a third of the log-risk variance: dropping any one costs clearly.
    assert full > 0.75
    assert all(full - c_index > 0.04 for c_index in pairs.values()), (full, pairs)


def test_simulation_is_reproducible_and_indexed_by_id() -> None:
    first, second = simulate_multimodal(200, seed=3), simulate_multimodal(200, seed=3)
    assert np.array_equal(first.time, second.time)
    assert all(first.modalities[k].equals(second.modalities[k]) for k in "abc")
    sub = first.subset(["sim-5", "sim-2"])
    assert list(sub.ids) == ["sim-5", "sim-2"] and sub.time[0] == first.time[5]
    assert list(sub.modalities["b"].index) == ["sim-5", "sim-2"]


def test_alignment_marks_missing_modalities() -> None:
    present = align_modalities(["p1", "p2", "p3"], {"clinical": ["p3", "p1", "p2"], "genomic": ["p2"]})
    assert present.tolist() == [[True, False], [True, True], [True, False]]


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        ({"clinical": ["p1", "p1"]}, "site 'clinical': duplicate record IDs \\['p1'\\]"),
        ({"clinical": ["p1", "p9"]}, "site 'clinical': 1 record IDs are not in the label holder's cohort, e.g. \\['p9'\\]"),
        ({"clinical": ["p1", "p2"], "genomic": ["x"]}, "site 'genomic': 1 record IDs"),
        ({"clinical": ["p1"]}, "1 labelled records are held by no site, e.g. \\['p2'\\]"),
    ],
)
def test_alignment_errors_name_the_site_and_the_ids(sites: dict, message: str) -> None:
    with pytest.raises(VerticalAlignmentError, match=message):
        align_modalities(["p1", "p2"], sites)


def test_alignment_refuses_duplicate_labels() -> None:
    with pytest.raises(VerticalAlignmentError, match="label holder: duplicate"):
        align_modalities(["p1", "p1"], {"clinical": ["p1"]})


def test_metabric_with_a_missing_column_names_the_file_and_column(tmp_path) -> None:
    (tmp_path / "metabric.csv").write_text("x0,x1,x2,x3,x4,x5,x6,x7,duration,event\n" + "0," * 9 + "1\n")
    with pytest.raises(ValueError, match=r"metabric.csv: missing columns \['x8'\]"):
        load_metabric_vertical(tmp_path)


def test_modality_transform_codes_categories_and_standardises_on_training_rows() -> None:
    train = pd.DataFrame({"grade": [1.0, 3.0, 3.0, 1.0], "er": [0.0, 1.0, 1.0, 1.0], "age": [40.0, 50.0, 60.0, np.nan]})
    transform = fit_modality_transform(train, categorical=["grade", "er"])
    assert transform.input_shape == ((3, 3), 1)  # two levels each + one code for missing/unseen
    new = pd.DataFrame({"grade": [3.0, 2.0, np.nan], "er": [0.0, 1.0, 1.0], "age": [55.0, np.nan, 40.0]})
    out = transform.transform(new)
    assert out.dtype == np.float32 and out.shape == (3, 3)
    assert out[:, 0].tolist() == [1, 2, 2]  # 3 -> code 1; unseen 2 and missing -> code 2
    assert out[:, 1].tolist() == [0, 1, 1]
    mean, std = np.mean([40, 50, 60]), np.std([40, 50, 60])
    np.testing.assert_allclose(out[:, 2], [(55 - mean) / std, 0.0, (40 - mean) / std], rtol=1e-6)
    with pytest.raises(ValueError, match=r"site 'clinical': column 'age': 1 non-numeric values \(records \[1\]\)"):
        transform.transform(new.assign(age=[1.0, "old", 3.0]), source="site 'clinical'")
    with pytest.raises(ValueError, match=r"clinical.csv: missing columns \['er'\]"):
        transform.transform(new.drop(columns="er"), source="clinical.csv")
    constant = fit_modality_transform(pd.DataFrame({"x": [2.0, 2.0]}))
    assert constant.scale.tolist() == [1.0] and constant.input_shape == ((), 1)


def test_a_text_column_is_a_categorical_whose_levels_are_its_strings() -> None:
    train = pd.DataFrame({"histology": ["ductal", "lobular", "ductal", None], "age": [40.0, 50.0, 60.0, 70.0]})
    transform = fit_modality_transform(train)  # not named categorical: its text makes it one
    assert transform.categorical == ("histology",) and transform.continuous == ("age",)
    assert transform.levels == (("ductal", "lobular"),) and transform.input_shape == ((3,), 1)
    new = pd.DataFrame({"histology": ["lobular", "mucinous", None, "ductal"], "age": [40.0, 50.0, 60.0, 70.0]})
    assert transform.transform(new)[:, 0].tolist() == [1, 2, 2, 0]  # unseen and missing -> code 2
    x, names = design_matrix(transform, new, source="site")
    assert names == ["histology=lobular", "age"] and x[:, 0].tolist() == [1, 0, 0, 0]
    numeric = fit_modality_transform(pd.DataFrame({"grade": [1.0, 2.0]}), categorical=["grade"])
    with pytest.raises(ValueError, match=r"site 'b': column 'grade': 1 non-numeric values \(records \[1\]\)"):
        numeric.transform(pd.DataFrame({"grade": [1.0, "high"]}), source="site 'b'")


def test_label_holder_split_is_stratified_disjoint_and_reproducible() -> None:
    table = simulate_multimodal(1000, seed=0)
    train, test = split_train_test(table, test_fraction=0.2, seed=3)
    assert len(train) + len(test) == 1000 and not set(train) & set(test)
    assert len(test) == pytest.approx(200, abs=1)
    event = pd.Series(table.event, index=table.ids)
    assert event[test].mean() == pytest.approx(event[train].mean(), abs=0.01)
    again, _ = split_train_test(table, test_fraction=0.2, seed=3)
    assert np.array_equal(train, again)
    assert not np.array_equal(train, split_train_test(table, test_fraction=0.2, seed=4)[0])


def test_select_keeps_the_named_modalities_and_their_categorical_columns() -> None:
    table = load_breast_cancer_vertical()
    assert table.categorical == {"clinical": ("er", "grade")}
    clinical = table.select(["clinical"])
    assert list(clinical.modalities) == ["clinical"] and clinical.categorical == table.categorical
    assert table.select(["genes"]).categorical == {}
    with pytest.raises(ValueError, match="unknown modalities \\['dna'\\]"):
        table.select(["dna"])
    assert list(load_vertical("synthetic_multimodal", n=50).modalities) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="unknown vertical data set"):
        load_vertical("flchain")


def test_read_modality_file_errors_name_file_and_column(tmp_path) -> None:
    good = tmp_path / "genes.csv"
    good.write_text("id,g1,g2\np1,0.5,1\np2,0.1,2\n")
    frame = read_modality_file(good)
    assert list(frame.index) == ["p1", "p2"] and list(frame.columns) == ["g1", "g2"]
    dup = tmp_path / "dup.csv"
    dup.write_text("id,g1\np1,0.5\np1,0.1\n")
    with pytest.raises(ValueError, match=r"dup.csv: column 'id': duplicate IDs \['p1'\]"):
        read_modality_file(dup)
    with pytest.raises(ValueError, match=r"genes.csv: no ID column 'patient'"):
        read_modality_file(good, id_column="patient")
    with pytest.raises(DataValidationError, match="missing.csv: modality file not found"):
        read_modality_file(tmp_path / "missing.csv")
