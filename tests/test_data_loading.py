"""Loading the data sets, preprocessing, and building federated data sets."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from models.data import (
    DataValidationError,
    FeatureStatistics,
    Preprocessor,
    SurvivalArrays,
    build_federated_dataset,
    load_table,
)

# --------------------------------------------------------------------------- preprocessing


def raw_features(n: int = 200, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "age": rng.normal(60, 10, n),
            "dose": np.where(rng.random(n) < 0.1, np.nan, rng.exponential(2.0, n)),
            "constant": np.full(n, 0.1),
            "sex": pd.Categorical(rng.choice(["F", "M"], n)),
            "smoker": rng.random(n) < 0.3,
            "stage": rng.choice(["I", "II", None], n),
        }
    )


def test_preprocessor_standardises_imputes_and_one_hot_encodes():
    train = raw_features()
    pre = Preprocessor.fit(train)
    x = pre.transform(train)
    assert x.dtype == np.float32 and not np.isnan(x).any()
    assert pre.feature_names == (
        "age", "dose", "constant", "sex=F", "sex=M", "smoker=False", "smoker=True", "stage=I", "stage=II",
    )  # fmt: skip
    np.testing.assert_allclose(x[:, 0].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(x[:, 0].std(), 1.0, atol=1e-5)
    assert (x[train["dose"].isna().to_numpy(), 1] == 0).all()  # mean imputation
    assert pre.stds["constant"] == 1.0 and np.allclose(x[:, 2], 0.0)
    np.testing.assert_array_equal(x[:, 3:5].sum(axis=1), 1.0)
    np.testing.assert_array_equal(x[:, 7:9].sum(axis=1), train["stage"].notna().to_numpy())


def test_preprocessor_uses_training_statistics_only():
    train, test = raw_features(seed=0), raw_features(50, seed=1)
    test.loc[0, "age"] = 1e9
    test.loc[1, ["sex", "stage"]] = [np.nan, "IV"]
    pre = Preprocessor.fit(train)
    means = dict(pre.means)
    encoded_train = pre.transform(train)
    encoded_test = pre.transform(test)
    assert pre.means == means
    np.testing.assert_array_equal(pre.transform(train), encoded_train)
    assert encoded_test[0, 0] > 1e6
    np.testing.assert_array_equal(encoded_test[1, 3:5], 0.0)  # missing category
    np.testing.assert_array_equal(encoded_test[1, 7:9], 0.0)  # unseen category


def test_summed_site_statistics_equal_the_pooled_fit():
    sites = [raw_features(n, seed) for seed, n in enumerate((80, 150, 30))]
    pooled = Preprocessor.fit(pd.concat(sites, ignore_index=True))
    stats = FeatureStatistics.from_frame(sites[0])
    for frame in sites[1:]:
        stats = stats + FeatureStatistics.from_frame(frame)
    federated = Preprocessor.from_statistics(stats)
    assert federated.categories == pooled.categories and federated.columns == pooled.columns
    for column, mean in pooled.means.items():
        assert federated.means[column] == pytest.approx(mean, rel=1e-12)
        assert federated.stds[column] == pytest.approx(pooled.stds[column], rel=1e-9)


def test_survival_arrays_subset_and_concat():
    arrays = SurvivalArrays(np.arange(12).reshape(6, 2), np.arange(6), [0, 1, 0, 1, 1, 0])
    assert arrays.x.dtype == np.float32 and arrays.time.dtype == np.float64 and arrays.event.dtype == np.float32
    parts = [arrays.subset([0, 2]), arrays.subset(np.array([False, True, False, True, True, False]))]
    joined = SurvivalArrays.concat(parts)
    assert len(joined) == 5
    np.testing.assert_array_equal(joined.time, [0, 2, 1, 3, 4])
    with pytest.raises(ValueError, match="inconsistent shapes"):
        SurvivalArrays(np.zeros((3, 2)), np.zeros(2), np.zeros(3))


# --------------------------------------------------------------------------- FLCHAIN


@pytest.fixture(scope="module")
def flchain():
    return build_federated_dataset(name="flchain", seed=0, num_sites=4)


def test_flchain_loads_without_the_leaking_column(flchain):
    train, test = flchain.pooled("train"), flchain.pooled("test")
    assert len(train) + len(test) == 7874
    events = np.concatenate([train.event, test.event])
    assert events.mean() == pytest.approx(0.275, abs=0.001)
    assert not any(name.startswith("chapter") for name in flchain.feature_names)
    assert {"age", "sex=F", "flc.grp=10", "mgus=yes", "creatinine"} <= set(flchain.feature_names)
    assert not np.isnan(train.x).any() and not np.isnan(test.x).any()
    assert flchain.num_sites == 4 and flchain.in_features == train.x.shape[1]
    assert flchain.source == "sksurv:flchain"
    assert all(site.oot is None for site in flchain.sites)
    with pytest.raises(ValueError, match="no out-of-time part"):
        flchain.pooled("oot")


def test_flchain_is_standardised_on_the_training_parts(flchain):
    train, test = flchain.pooled("train"), flchain.pooled("test")
    age = flchain.feature_names.index("age")
    assert train.x[:, age].mean() == pytest.approx(0.0, abs=1e-5)
    assert train.x[:, age].std() == pytest.approx(1.0, abs=1e-4)
    assert test.x[:, age].mean() != pytest.approx(0.0, abs=1e-5)


def test_flchain_split_is_stratified_and_deterministic(flchain):
    for site in flchain.sites:
        assert len(site.test) / (len(site.train) + len(site.test)) == pytest.approx(0.2, abs=0.01)
        assert site.test.event.mean() == pytest.approx(site.train.event.mean(), abs=0.01)
    again = build_federated_dataset(name="flchain", seed=0, num_sites=4)
    other = build_federated_dataset(name="flchain", seed=1, num_sites=4)
    np.testing.assert_array_equal(again.pooled("train").x, flchain.pooled("train").x)
    np.testing.assert_array_equal(again.pooled("test").time, flchain.pooled("test").time)
    assert not np.array_equal(other.sites[0].train.time, flchain.sites[0].train.time)


def test_flchain_dirichlet_sites_have_events():
    data = build_federated_dataset(name="flchain", seed=0, num_sites=5, partition="dirichlet", dirichlet_alpha=0.3)
    rates = [site.train.event.mean() for site in data.sites]
    assert all(rate > 0 for rate in rates) and np.std(rates) > 0.05


# --------------------------------------------------------------------------- any CSV / Parquet


def clinic_frame(n: int = 300) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame(
        {
            "hospital": rng.choice(["Oslo", "Bergen", "Tromso", "Alta"], n, p=[0.4, 0.3, 0.28, 0.02]),
            "age": rng.normal(60, 10, n),
            "grade": rng.choice(["low", "high"], n),
            "months": rng.exponential(30, n),
            "dead": rng.random(n) < 0.4,
        }
    )


def test_csv_natural_partition_one_site_per_value(tmp_path, caplog):
    frame = clinic_frame()
    path = tmp_path / "clinic.csv"
    frame.to_csv(path, index=False)
    with caplog.at_level(logging.WARNING):
        data = build_federated_dataset(
            name="csv", path=str(path), time_col="months", event_col="dead", seed=0, num_sites=99,
            partition="hospital", min_site_records=20,
        )  # fmt: skip
    assert [site.name for site in data.sites] == ["Bergen", "Oslo", "Tromso"]
    assert "Alta" in caplog.text
    counts = frame["hospital"].value_counts()
    assert {s.name: len(s.train) + len(s.test) for s in data.sites} == {k: counts[k] for k in ("Bergen", "Oslo", "Tromso")}
    assert data.feature_names == ("age", "grade=high", "grade=low")


def test_parquet_file_loads(tmp_path):
    path = tmp_path / "clinic.parquet"
    clinic_frame().to_parquet(path)
    table = load_table("csv", path=str(path), time_col="months", event_col="dead", feature_cols=["age"])
    assert len(table) == 300 and list(table.features.columns) == ["age"]
    assert list(table.groups.columns) == ["hospital", "grade"]


# --------------------------------------------------------------------------- SBA


def sba_raw_rows() -> pd.DataFrame:
    """Seven loans exercising the outcome rules; the last three cannot be used."""
    base = {
        "LoanNr_ChkDgt": 1, "Name": "ACME", "City": "X", "Zip": 1, "Bank": "B", "BankState": "CA", "NAICS": 722410,
        "ApprovalFY": 1997, "NoEmp": 4, "NewExist": 2, "CreateJob": 0, "RetainedJob": 3, "FranchiseCode": 1,
        "UrbanRural": 1, "RevLineCr": "N", "LowDoc": "Y", "ChgOffDate": None, "ChgOffPrinGr": "$0.00",
        "DisbursementGross": "$60,000.00 ", "GrAppv": "$60,000.00 ", "SBA_Appv": "$48,000.00 ",
    }  # fmt: skip
    loans = [  # State, ApprovalDate, DisbursementDate, Term, MIS_Status, ChgOffDate
        ("CA", "2/28/1997", "3/31/1997", 84, "CHGOFF", "31-Mar-99"),  # default after 24 months
        ("NY", "1/5/1998", "2/1/1998", 60, "CHGOFF", "1-Feb-04"),  # charge-off after 72 months: censored at 48
        ("TX", "6/1/1997", "7/1/1997", 36, "P I F", None),  # paid in full: censored at Term
        ("DC", "3/1/2006", "4/1/2006", 120, "CHGOFF", "1-Apr-08"),  # out of time, default after 24 months
        ("IL", "6/1/1997", "7/1/1997", 36, None, None),  # no status
        ("IL", "6/1/1997", "7/1/1997", 36, "CHGOFF", "1-Jan-97"),  # charged off before disbursement
        ("IL", "6/1/1997", None, 36, "P I F", None),  # no disbursement date
    ]
    columns = ["State", "ApprovalDate", "DisbursementDate", "Term", "MIS_Status", "ChgOffDate"]
    return pd.DataFrame([{**base, **dict(zip(columns, loan))} for loan in loans])


def test_sba_outcome_features_and_groups_from_raw_rows(tmp_path, caplog):
    path = tmp_path / "sba.csv"
    sba_raw_rows().to_csv(path, index=False)
    with caplog.at_level(logging.INFO):
        table = load_table("sba", path=str(path))
    assert "kept 4 of 7 loans; dropped 3" in caplog.text
    np.testing.assert_allclose(table.time, [24.0, 48.0, 36.0, 24.0], atol=0.1)
    np.testing.assert_array_equal(table.event, [1, 0, 0, 1])
    assert table.features["log1p_DisbursementGross"].iloc[0] == pytest.approx(np.log1p(60000))
    assert table.features["sba_share"].iloc[0] == pytest.approx(0.8)
    assert table.features["naics_sector"].iloc[0] == "72"
    assert table.features["same_state_bank"].tolist() == [1.0, 0.0, 0.0, 0.0]
    leaking = {"ChgOffDate", "ChgOffPrinGr", "MIS_Status", "BalanceGross", "LoanNr_ChkDgt", "Name", "Bank", "State"}
    assert not leaking & set(table.features.columns)
    assert table.groups["region"].tolist() == ["West", "Northeast", "South", "South"]
    assert table.groups["division"].iloc[3] == "South Atlantic"
    assert table.period.tolist() == list(pd.to_datetime(["1997-02-28", "1998-01-05", "1997-06-01", "2006-03-01"]))


def test_sba_missing_raw_column_is_named(tmp_path):
    path = tmp_path / "sba.csv"
    sba_raw_rows().drop(columns=["MIS_Status"]).to_csv(path, index=False)
    with pytest.raises(DataValidationError, match=f"{path}: missing column 'MIS_Status'"):
        load_table("sba", path=str(path))


@pytest.fixture(scope="module")
def sba_regions():
    return build_federated_dataset(name="sba", seed=0, num_sites=3, partition="region")


def test_sba_by_region_with_out_of_time_part(sba_regions):
    data = sba_regions
    assert [site.name for site in data.sites] == ["Midwest", "Northeast", "South", "West"]
    table = load_table("sba")
    in_time = (table.period < pd.Timestamp("2005-01-01")).to_numpy()
    assert len(data.pooled("train")) + len(data.pooled("test")) == in_time.sum()
    assert len(data.pooled("oot")) == (~in_time).sum() > 0
    np.testing.assert_array_equal(np.sort(data.pooled("oot").time), np.sort(table.time[~in_time]))
    counts = table.groups["region"][in_time].value_counts()
    assert {s.name: len(s.train) + len(s.test) for s in data.sites} == counts.to_dict()
    for split in ("train", "test", "oot"):
        part = data.pooled(split)
        assert (part.time[part.event == 1] <= 48).all() and (part.time <= 48).all()
        assert not np.isnan(part.x).any()
    assert 0.05 < data.pooled("train").event.mean() < 0.12


def test_sba_state_partition_and_no_out_of_time():
    data = build_federated_dataset(
        name="sba", seed=0, num_sites=3, partition="State", min_site_records=200,
        oot_start="none",
    )  # fmt: skip
    assert data.num_sites > 10 and all(site.oot is None for site in data.sites)
    assert [site.name for site in data.sites] == sorted(site.name for site in data.sites)
    assert not any(name.startswith(("State", "region")) for name in data.feature_names)


@pytest.mark.parametrize(("name", "rows", "features"), [("metabric", 1904, 9), ("gbsg", 2232, 7), ("whas", 1638, 6)])
def test_deepsurv_csvs_load(name, rows, features):
    table = load_table(name)
    assert len(table) == rows
    assert list(table.features.columns) == [f"x{i}" for i in range(features)]
    data = build_federated_dataset(name=name, seed=0, num_sites=3)
    assert data.in_features == features and "split" not in data.feature_names
    assert sum(len(s.train) + len(s.test) for s in data.sites) == rows


def test_simulated_cox_data_has_the_papers_design():
    """Niu et al.'s generator: 50,000 rows, 30 % censored, and a Cox fit recovers β."""
    from lifelines import CoxPHFitter

    from models.data.datasets import SIM_COX_COEFFICIENTS, load_table, simulate_cox_frame

    table = load_table("sim_cox")
    assert len(table) == 50_000 and list(table.features.columns) == ["x1", "x2", "x3", "x4"]
    assert abs(1.0 - table.event.mean() - 0.30) < 0.01  # censoring hazard 3/7 of the event hazard
    assert set(np.unique(table.features["x3"])) == {0.0, 1.0} and table.features["x4"].between(0, 1).all()
    fit = CoxPHFitter().fit(simulate_cox_frame(20_000, seed=1), duration_col="time", event_col="event")
    z = (fit.params_.to_numpy() - np.asarray(SIM_COX_COEFFICIENTS)) / fit.standard_errors_.to_numpy()
    assert np.all(np.abs(z) < 4), z  # the generator's hazard is exp(βᵀx)
    assert load_table("sim_cox").time.tobytes() == table.time.tobytes()  # one fixed data set
