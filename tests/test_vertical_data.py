"""Vertically partitioned data: loaders, the three-modality generator, ID alignment."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from sksurv.linear_model import CoxPHSurvivalAnalysis
from sksurv.metrics import concordance_index_censored
from sksurv.util import Surv

from models.data.vertical import (
    METABRIC_MODALITIES,
    VerticalAlignmentError,
    align_modalities,
    load_breast_cancer_vertical,
    load_metabric_vertical,
    simulate_multimodal,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not (DATA_DIR / "metabric.csv").exists(), reason="../shared/data/metabric.csv not present")
def test_metabric_splits_into_genomic_and_clinical() -> None:
    table = load_metabric_vertical(DATA_DIR)
    assert len(table) == 1904
    assert {name: tuple(frame.columns) for name, frame in table.modalities.items()} == METABRIC_MODALITIES
    assert table.event.mean() == pytest.approx(0.58, abs=0.01)  # 42 % censored (data README)
    assert (table.modalities["genomic"].index == table.ids).all()


def test_metabric_missing_file_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="metabric.csv"):
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
