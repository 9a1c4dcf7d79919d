"""fedsurv as a scikit-learn estimator (:class:`fedsurv.FederatedSurvival`) and permutation importance.

scikit-learn's tools (``clone``, ``cross_val_score``, ``GridSearchCV``, ``Pipeline``, ``permutation_importance``)
take the estimator and give what a hand loop over :func:`fedsurv.fit` gives with the same folds, seeds and
``data.test_fraction = 0`` (the estimator trains on every record of ``X``); scores are checked against
scikit-survival's ``concordance_index_censored``, a Cox fit on ``X`` against lifelines' on every record. The runs
are small and short (400 GBSG records, 2 sites, 1-2 rounds) over the in-process engine
(``simulation.engine = inprocess``).
"""

import pickle

import numpy as np
import pandas as pd
import pytest
import sklearn.utils.estimator_checks as checks
from lifelines import CoxPHFitter
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.inspection import permutation_importance
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sksurv.metrics import concordance_index_censored
from sksurv.util import Surv

import fedsurv
from flwr_app.config import ConfigError
from models.data.files import data_file

CONFIG = {"simulation.engine": "inprocess", "baseline.centralized": False}
PARAMS = {"sites": 2, "rounds": 1, "seed": 0, "config": CONFIG}


@pytest.fixture(scope="module")
def gbsg():
    """800 GBSG records with a pure-noise column: the first 400 to train on, the others to score."""
    frame = pd.read_csv(data_file("gbsg")).drop(columns="split").sample(800, random_state=0).reset_index(drop=True)
    return frame.assign(noise=np.random.default_rng(1).normal(size=len(frame)))


@pytest.fixture(scope="module")
def data(gbsg):
    X = gbsg.drop(columns=["duration", "event", "noise"])
    y = Surv.from_arrays(event=gbsg["event"] == 1, time=gbsg["duration"])
    return X.iloc[:400], y[:400], X.iloc[400:], y[400:]


@pytest.fixture(scope="module")
def fitted(data):
    X, y, _, _ = data
    return fedsurv.FederatedSurvival(**PARAMS).fit(X, y)


def hand_fit(X, y, tmp_path, **params):
    """fedsurv.fit on X with y's outcomes as columns, as a user would call it for a model of every record."""
    frame = X.assign(time=y["time"], event=y["event"].astype(int))
    keyed = {**PARAMS, "config": {**CONFIG, "data.test_fraction": 0}, **params}
    return fedsurv.fit(frame, time_col="time", event_col="event", output_dir=tmp_path, **keyed)


def harrell(run, X, y):
    return concordance_index_censored(y["event"], y["time"], run.risk_score(X).to_numpy())[0]


@pytest.mark.parametrize("check", [
    checks.check_no_attributes_set_in_init, checks.check_parameters_default_constructible,
    checks.check_get_params_invariance, checks.check_set_params, checks.check_estimator_cloneable,
    checks.check_estimator_repr, checks.check_do_not_raise_errors_in_init_or_set_params,
    checks.check_estimators_unfitted, checks.check_mixin_order, checks.check_valid_tag_types,
    checks.check_requires_y_none,
])
def test_scikit_learn_api_checks_that_apply_to_a_survival_estimator(check):
    """The checks that do not fit on a regression or classification target (a survival y is structured)."""
    check("FederatedSurvival", fedsurv.FederatedSurvival(**PARAMS))


def test_params_round_trip_through_clone_and_set_params(fitted):
    params = fitted.get_params()
    assert params == {**fedsurv.FederatedSurvival().get_params(), **PARAMS}
    copy = clone(fitted)
    assert copy.get_params() == params and copy.config is not fitted.config
    assert not hasattr(copy, "run_") and not hasattr(copy, "n_features_in_")
    copy.set_params(rounds=3, lr=0.01, config={"train.batch_size": 64})
    assert (copy.rounds, copy.lr, copy.config) == (3, 0.01, {"train.batch_size": 64})
    assert fitted.rounds == 1


@pytest.mark.filterwarnings("ignore:X does not have valid feature names")
def test_fit_keeps_the_columns_and_score_is_sksurvs_harrell_c(fitted, data):
    X, _, X_test, y_test = data
    assert fitted.n_features_in_ == 7 and list(fitted.feature_names_in_) == list(X.columns)
    assert fitted.summary_["num_sites"] == 2
    assert fitted.summary_["test"] == {} and fitted.summary_["test_source"].startswith("none: data.test_fraction = 0")
    assert not fitted.run_.directory.exists() and fitted.run_dir_ is None  # the temporary run is gone
    risk = fitted.predict(X_test)
    np.testing.assert_array_equal(risk, fitted.run_.risk_score(X_test).to_numpy())
    assert fitted.score(X_test, y_test) == concordance_index_censored(y_test["event"], y_test["time"], risk)[0]
    assert fitted.score(X_test, y_test) > 0.6
    with pytest.raises(ValueError, match="feature names should match"):
        fitted.predict(X_test[list(reversed(X_test.columns))])
    with pytest.raises(ValueError, match="has 6 features"):
        fitted.predict(X_test.iloc[:, :6].to_numpy())


def test_survival_functions_are_the_runs_curves_as_sksurv_step_functions(fitted, data):
    X_test = data[2].iloc[:5]
    curves = fitted.run_.predict_survival(X_test)
    array = fitted.predict_survival_function(X_test, return_array=True)
    np.testing.assert_array_equal(fitted.unique_times_, curves.columns.to_numpy())
    np.testing.assert_array_equal(array, curves.to_numpy())
    at = np.array([fitted.unique_times_[0], fitted.unique_times_[3] + 0.5, fitted.unique_times_[-1]])
    for fn, row in zip(fitted.predict_survival_function(X_test), array, strict=True):
        np.testing.assert_array_equal(fn(at), row[[0, 3, -1]])
    hazards = fitted.predict_cumulative_hazard_function(X_test)
    np.testing.assert_allclose(hazards[2](fitted.unique_times_), -np.log(array[2]))


def test_fit_reads_the_outcomes_from_the_frame_when_y_is_none(fitted, gbsg, data):
    frame = gbsg.drop(columns="noise").iloc[:400]
    other = fedsurv.FederatedSurvival(**PARAMS, time_col="duration").fit(frame)
    assert list(other.feature_names_in_) == list(fitted.feature_names_in_)
    np.testing.assert_array_equal(other.predict(data[2]), fitted.predict(data[2]))
    assert other.score(gbsg.drop(columns="noise").iloc[400:]) == fitted.score(data[2], data[3])


def test_an_array_is_named_x0_and_a_fitted_estimator_pickles(data):
    X, y, X_test, _ = data
    est = fedsurv.FederatedSurvival(**PARAMS).fit(X.to_numpy(), y)
    assert est.input_columns_ == [f"x{i}" for i in range(7)] and not hasattr(est, "feature_names_in_")
    copy = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(copy.predict(X_test.to_numpy()), est.predict(X_test.to_numpy()))


def test_cross_val_score_equals_a_hand_loop_over_fit(data, tmp_path):
    X, y, _, _ = data
    folds = KFold(3, shuffle=True, random_state=0)
    scores = cross_val_score(fedsurv.FederatedSurvival(**PARAMS), X, y, cv=folds)
    hand = [harrell(hand_fit(X.iloc[train], y[train], tmp_path / str(k)), X.iloc[test], y[test])
            for k, (train, test) in enumerate(folds.split(X))]
    print("cross_val_score", scores, "hand loop", hand)
    np.testing.assert_array_equal(scores, hand)


def test_grid_search_over_rounds_and_learning_rate(data, tmp_path):
    X, y, _, _ = data
    grid = {"rounds": [1, 2], "lr": [0.003, 0.01]}
    search = GridSearchCV(fedsurv.FederatedSurvival(**PARAMS, output_dir=tmp_path), grid, cv=2).fit(X, y)
    assert search.best_params_ in [{"rounds": r, "lr": lr} for r in grid["rounds"] for lr in grid["lr"]]
    means = search.cv_results_["mean_test_score"]
    assert len(set(means)) == 4  # each setting reached the runs
    assert len(list(tmp_path.iterdir())) == 4 * 2 + 1  # a new run directory per fit, kept under output_dir
    assert search.best_estimator_.run_dir_.parent == tmp_path and search.best_estimator_.run_dir_.is_dir()


def test_a_scaler_in_a_pipeline_changes_nothing_the_run_standardises_itself(fitted, data):
    X, y, X_test, y_test = data
    plain = make_pipeline(StandardScaler(), fedsurv.FederatedSurvival(**PARAMS)).fit(X, y)
    assert plain[-1].input_columns_ == [f"x{i}" for i in range(7)]  # the scaler gave an array
    framed = make_pipeline(StandardScaler(), fedsurv.FederatedSurvival(**PARAMS)).set_output(transform="pandas")
    framed.fit(X, y)
    assert list(framed[-1].feature_names_in_) == list(X.columns)
    for pipeline in (plain, framed):
        assert pipeline.score(X_test, y_test) == pytest.approx(fitted.score(X_test, y_test), abs=1e-6)


def test_sklearn_permutation_importance_equals_a_hand_permutation_loop(fitted, data):
    _, _, X_test, y_test = data
    result = permutation_importance(fitted, X_test, y_test, n_repeats=3, random_state=0)
    seed = np.random.RandomState(0).randint(np.iinfo(np.int32).max + 1)  # sklearn's protocol: one seed, then
    base = fitted.score(X_test, y_test)                                # each column's shuffles from it
    for j, column in enumerate(X_test.columns):
        rng, order, shuffled = np.random.RandomState(seed), np.arange(len(X_test)), X_test.copy()
        drops = []
        for _ in range(3):
            rng.shuffle(order)
            shuffled[column] = shuffled[column].to_numpy()[order]
            drops.append(base - fitted.score(shuffled, y_test))
        np.testing.assert_array_equal(result.importances[j], drops)


def test_run_permutation_importance_finds_the_strong_covariate_and_not_the_noise(gbsg, tmp_path):
    run = fedsurv.fit(gbsg.iloc[:400], time_col="duration", event_col="event", output_dir=tmp_path,
                      **{**PARAMS, "rounds": 2})
    test = gbsg.iloc[400:]
    table = run.permutation_importance(test, n_repeats=5, seed=0)
    print(table.round(4).to_string())
    assert list(table.columns) == ["c_index_drop_mean", "c_index_drop_std", "ibs_rise_mean", "ibs_rise_std"]
    assert sorted(table.index) == sorted(run.input_columns) and table["c_index_drop_mean"].is_monotonic_decreasing
    scores = run.score(test)
    assert table.attrs["baseline"] == pytest.approx({"c_index": scores["c_index"], "ibs": scores["ibs"]})
    assert abs(table.loc["noise", "c_index_drop_mean"]) < 0.01 and abs(table.loc["noise", "ibs_rise_mean"]) < 0.002
    strong = table.loc["x4"]  # the covariate with the largest Cox z of these records
    assert table.index[0] == "x4" and strong["c_index_drop_mean"] > 0.04 and strong["ibs_rise_mean"] > 0.003
    assert strong["c_index_drop_mean"] > 3 * strong["c_index_drop_std"]
    assert strong["ibs_rise_mean"] > 3 * strong["ibs_rise_std"]
    again = run.permutation_importance(test, n_repeats=5, seed=0)
    pd.testing.assert_frame_equal(again, table)


def test_fit_trains_on_every_record_of_X_unless_config_holds_out_a_test_part(fitted, data):
    """The Cox fit on X through the estimator equals lifelines' stratified fit on all of X (a fit on 80 % of it
    differs by far more); ``data.test_fraction`` in ``config`` holds out a test part again, which the run scores."""
    X, y, X_test, _ = data
    centres = np.where(np.arange(len(X)) % 3 == 0, "north", "south")
    est = fedsurv.FederatedSurvival(**{**PARAMS, "rounds": None}, model="coxph", site_col="centre")
    est.fit(X.assign(centre=centres), y)
    reference = CoxPHFitter().fit(X.assign(centre=centres, T=y["time"], E=y["event"]), "T", "E", strata=["centre"])
    scale = np.maximum(reference.params_.abs(), reference.standard_errors_)
    gap = ((est.run_.params - reference.params_[est.run_.params.index]).abs() / scale).max()
    print(f"max |coef - lifelines on all of X| / max(|coef|, se) = {gap:.2e}")
    assert gap < 1e-4 and est.summary_["test"] == {}
    held_out = fedsurv.FederatedSurvival(**{**PARAMS, "config": {**CONFIG, "data.test_fraction": 0.2}}).fit(X, y)
    assert 0.5 < held_out.summary_["test"]["c_index"] < 1
    assert not np.allclose(held_out.predict(X_test), fitted.predict(X_test))


def test_coxph_fits_predicts_the_linear_predictor_and_scores(data):
    X, y, X_test, y_test = data
    est = fedsurv.FederatedSurvival(**{**PARAMS, "rounds": None}, model="coxph").fit(X, y)
    assert list(est.run_.hazard_ratios.index) == list(X.columns)
    linear = X_test.to_numpy() @ est.run_.params.to_numpy()
    risk = est.predict(X_test)
    np.testing.assert_allclose(risk - risk.mean(), linear - linear.mean(), atol=1e-6)  # float32 network
    expected = concordance_index_censored(y_test["event"], y_test["time"], linear)[0]
    assert est.score(X_test, y_test) == pytest.approx(expected, abs=1e-4)


def test_bad_input_is_refused_in_one_line(fitted, data):
    X, y, _, _ = data
    with pytest.raises(ConfigError, match="lr and config\\['train.lr'\\] both given"):
        fedsurv.FederatedSurvival(**{**PARAMS, "lr": 0.01, "config": {"train.lr": 0.1}}).fit(X, y)
    failed = fedsurv.FederatedSurvival(**PARAMS, site_col="centre")
    with pytest.raises(ValueError, match="site_col='centre' is not a column of X"):
        failed.fit(X, y)
    with pytest.raises(NotFittedError):  # a failed fit leaves no model behind
        failed.predict(X)
    with pytest.raises(ValueError, match="X has a column 'time'"):
        fedsurv.FederatedSurvival(**PARAMS).fit(X.rename(columns={"x0": "time"}), y)
    with pytest.raises(ValueError, match="structured array"):
        fedsurv.FederatedSurvival(**PARAMS).fit(X, y["time"])
    with pytest.raises(ValueError, match="structured array"):
        fitted.score(X, y["time"])
    with pytest.raises(ValueError, match="requires y to be passed.*pass y"):
        fitted.score(X.to_numpy())


def test_site_col_places_the_records_and_is_not_a_feature(data):
    X, y, X_test, _ = data
    centres = np.where(np.arange(len(X)) % 3 == 0, "north", "south")
    est = fedsurv.FederatedSurvival(**PARAMS, site_col="centre").fit(X.assign(centre=centres), y)
    assert est.summary_["num_sites"] == 2 and "centre" not in est.run_.input_columns
    assert est.n_features_in_ == 8  # scikit-learn's count: the columns of X, the site column among them
    risk = est.predict(X_test.assign(centre="elsewhere"))  # a record's site does not enter its prediction
    np.testing.assert_array_equal(risk, est.predict(X_test.assign(centre="north")))
