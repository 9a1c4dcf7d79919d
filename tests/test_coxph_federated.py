"""``model.name = "coxph"`` through Flower (the ServerApp and ClientApp over the in-process grid) against lifelines'
``CoxPHFitter`` fitted on the same training records and the same covariates."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
from flwr.app import Context, Message, RecordDict
from lifelines import CoxPHFitter
from lifelines.statistics import proportional_hazard_test

import fedsurv
from benchmarks.coxph_reference import lifelines_fit as _lifelines
from benchmarks.coxph_reference import reference_frame as _reference
from flwr_app import cox_client, cox_server, task
from flwr_app.config import ConfigError, parse_run_config
from flwr_app.cox_messages import MEAT, SCHOENFELD, SUMS, decode, encode, k_point_grid
from flwr_app.cox_server import CoxSiteError
from models.cox_run import CoxRun
from models.predict import load_run
from simulations.engine import resolve, run_inprocess

FAST = {"evaluation.server_side": False, "baseline.centralized": False}


def _assert_equal(run: CoxRun, cph: CoxPHFitter, names: list[str]) -> float:
    """β to 1e-4·max(|β|, SE), SEs to 1e-4 relative, p to 1e-3; returns max |Δβ| / SE."""
    ours, ref = run.summary_table(), cph.summary.loc[names]
    assert list(ours.index) == names and list(ours.columns) == list(cph.summary.columns)
    scale = np.maximum(ref["coef"].abs(), ref["se(coef)"])
    assert ((ours["coef"] - ref["coef"]).abs() / scale).max() < 1e-4
    assert ((ours["se(coef)"] / ref["se(coef)"]) - 1).abs().max() < 1e-4
    assert (ours["p"] - ref["p"]).abs().max() < 1e-3
    assert run.result.log_likelihood == pytest.approx(cph.log_likelihood_, rel=1e-8)
    return float(((ours["coef"] - ref["coef"]).abs() / ref["se(coef)"]).max())


STRATIFIED = {
    "flchain": {"data.name": "flchain", "federation.num_sites": 3},
    "gbsg": {"data.name": "gbsg", "federation.num_sites": 3},
    "whas": {"data.name": "whas", "federation.num_sites": 4},
    "metabric": {"data.name": "metabric", "federation.num_sites": 3},
    # SBA's rare industry levels without a charge-off make the unpenalised likelihood monotone: lifelines' ridge
    "sba-regions": {"data.name": "sba", "federation.partition": "region", "cox.penalizer": 0.01},
}


@pytest.mark.parametrize("name", list(STRATIFIED))
def test_the_stratified_fit_through_flower_equals_lifelines_strata_site(name, tmp_path):
    overrides = STRATIFIED[name]
    run_inprocess({"model.name": "coxph", **FAST, **overrides, "output.dir": str(tmp_path)})
    run = load_run(tmp_path)
    assert isinstance(run, CoxRun) and run.result.converged
    frame, names = _reference(overrides)
    cph = _lifelines(frame, penalizer=overrides.get("cox.penalizer", 0.0))
    print(f"{name}: max |coef - lifelines| / se = {_assert_equal(run, cph, names):.2e}")


def test_a_full_run_writes_the_outputs_tests_proportional_hazards_and_predicts(tmp_path):
    overrides = {"data.name": "gbsg", "federation.num_sites": 3}
    summary = run_inprocess({"model.name": "coxph", **overrides, "output.dir": str(tmp_path)})
    for name in ("coxph.json", "coxph_summary.csv", "manifest.json", "ledger.jsonl", "model.pt", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    figures = summary["coxph"]
    assert figures["converged"] and figures["events"] == 1014 and figures["strata"] == "site"
    assert 0.6 < summary["test"]["c_index"] < 0.8 and summary["test"]["c_index"] == figures["concordance_test"]
    assert summary["centralized"]["max_abs_coef_diff_over_se"] < 1e-6
    assert "Cox sums" in summary["privacy"]["uncovered"] and summary["privacy"]["epsilon"] is None
    assert set(summary["sites"]) == {"site-0", "site-1", "site-2"}
    assert summary["km_null"] == {"ibs": summary["test"]["ibs"], "ibs_km_null": summary["calibration"]["ibs_km_null"],
                                  "below_null": True}
    run = load_run(tmp_path)
    frame, names = _reference(overrides)
    cph = _lifelines(frame)
    ours = run.proportional_hazard_test()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = proportional_hazard_test(cph, frame, time_transform="rank").summary.loc[names]
    np.testing.assert_allclose(ours["test_statistic"], theirs["test_statistic"], rtol=1e-6)
    np.testing.assert_allclose(ours["p"], theirs["p"], rtol=1e-6, atol=1e-12)
    _, cfg = resolve({"model.name": "coxph", **overrides})
    test = task.load_federation(cfg).pooled("test")
    times, surv = run.model.predict_survival(test.x)
    assert surv.shape == (len(test), times.size) and np.all(np.diff(surv, axis=1) <= 1e-12)
    np.testing.assert_allclose(run.model.risk_score(test.x), test.x @ run.model.net.layers[0].weight.detach()
                               .numpy().ravel().astype(np.float64), rtol=1e-5, atol=1e-6)


def test_the_pooled_fit_on_every_event_time_equals_lifelines_without_strata(tmp_path):
    overrides = {"data.name": "whas", "federation.num_sites": 3}
    summary = run_inprocess({"model.name": "coxph", "cox.strata": "none", "baseline.centralized": False,
                             "evaluation.server_side": False, **overrides, "output.dir": str(tmp_path)})
    frame, names = _reference(overrides)
    cph = _lifelines(frame, strata=False)
    print(f"whas pooled: max |coef - lifelines| / se = {_assert_equal(load_run(tmp_path), cph, names):.2e}")
    assert summary["coxph"]["grid_points"] == frame.loc[frame["E"] == 1, "T"].nunique()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = proportional_hazard_test(cph, frame.drop(columns="site"), time_transform="km").summary.loc[names]
    np.testing.assert_allclose(load_run(tmp_path).proportional_hazard_test()["p"], theirs["p"], rtol=1e-6)


def test_a_coarse_pooled_grid_and_robust_errors_match_the_same_fit_in_one_process(tmp_path):
    summary = run_inprocess({"model.name": "coxph", "data.name": "whas", "federation.num_sites": 3,
                             "cox.strata": "none", "cox.grid": "20", "cox.robust": True, "cox.ph_test": "none",
                             "evaluation.server_side": False, "output.dir": str(tmp_path)})
    assert summary["coxph"]["grid_points"] == 20 and summary["coxph"]["standard_errors"] == "robust (sandwich)"
    assert summary["centralized"]["max_abs_coef_diff_over_se"] < 1e-6
    assert summary["centralized"]["max_rel_se_diff"] < 1e-6
    with pytest.raises(ValueError, match="no proportional-hazards test"):
        load_run(tmp_path).proportional_hazard_test()


def test_a_categorical_column_gives_one_hazard_ratio_per_level_against_a_named_reference(tmp_path):
    rng = np.random.default_rng(3)
    n = 600
    arm = rng.choice(["control", "low", "high"], n)
    age = rng.normal(60, 10, n)
    hazard = np.exp(0.03 * (age - 60) + np.select([arm == "low", arm == "high"], [-0.4, -0.8], 0.0))
    time, censor = rng.exponential(1 / hazard), rng.exponential(2.0, n)
    data = pd.DataFrame({"time": np.round(np.minimum(time, censor), 3), "event": (time <= censor).astype(int),
                         "age": age, "arm": arm, "centre": rng.choice(["A", "B", "C"], n)})
    run = fedsurv.fit(data, site_col="centre", model="coxph", output_dir=tmp_path,
                      config={"evaluation.server_side": False, "baseline.centralized": False})
    assert isinstance(run, CoxRun)
    assert list(run.hazard_ratios.index) == ["age", "arm=high", "arm=low"] and run.references == {"arm": "control"}
    assert run.hazard_ratios["arm=high"] < run.hazard_ratios["arm=low"] < 1
    assert list(run.summary_table().columns)[:3] == ["coef", "exp(coef)", "se(coef)"]
    assert {"c_index", "ibs"} <= set(run.score(data))
    flat = json.loads((tmp_path / "config.json").read_text())["run_config"]
    frame, names = _reference({key: value for key, value in flat.items() if value is not None})  # inf: None
    assert names == ["age", "arm=high", "arm=low"] and sorted(frame["site"].unique()) == ["A", "B", "C"]
    _assert_equal(run, _lifelines(frame), names)
    assert run.plot_coefficients(hazard_ratios=True) is not None


def _site_context(overrides: dict) -> Context:
    fused, _ = resolve({"model.name": "coxph", **FAST, **overrides})
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config=fused)


@pytest.mark.parametrize(("beta", "message"), [
    ([0.0] * 5, r"beta must hold 6 coefficients"),
    ([0.0, np.nan, 0.0, 0.0, 0.0, 0.0], r"beta must be finite"),
    ([0.0, np.inf, 0.0, 0.0, 0.0, 0.0], r"beta must be finite"),
    ([1e3, 0.0, 0.0, 0.0, 0.0, 0.0], r"exp\(x'beta\) would overflow"),
])
def test_a_site_refuses_a_bad_beta_in_one_line(beta, message):
    context = _site_context({"data.name": "whas", "federation.num_sites": 3})
    request = Message(content=encode({"beta": np.asarray(beta)}, {"step": 1}), dst_node_id=1, message_type=SUMS)
    with pytest.raises(ValueError, match=message) as refused:
        cox_client.sums(request, context)
    assert "\n" not in str(refused.value)


def test_a_site_refuses_what_its_own_config_does_not_plan():
    context = _site_context({"data.name": "whas", "federation.num_sites": 3})
    with pytest.raises(ValueError, match=r"does not plan to release the site's event times"):
        cox_client.event_times(Message(content=encode({}, {"step": 0}), dst_node_id=1,
                                       message_type="query.cox_event_times"), context)
    with pytest.raises(ValueError, match=r"robust standard errors \(cox.robust\)"):
        cox_client.meat(Message(content=encode({"beta": np.zeros(6)}, {"step": 0}), dst_node_id=1,
                                message_type="query.cox_meat"), context)


#: A pooled fit on k = 20 points of the set-up's time grid, robust errors and the PH test: every pooled query.
POOLED_K = {"data.name": "whas", "federation.num_sites": 3, "cox.strata": "none", "cox.grid": "20",
            "cox.robust": True, "cox.ph_test": "identity"}


def _forged_grids(cuts: np.ndarray, times: np.ndarray) -> dict[str, np.ndarray]:
    """Grids a dishonest server could send instead of the 20 points: finer ones, one around single records, and
    20 points that are not the set-up's."""
    honest = k_point_grid(cuts, 20)
    return {"every cut": cuts, "2000 points": np.linspace(cuts[0], cuts[-1], 2000),
            "around each record": np.unique(np.concatenate([times - 1e-6, times])),
            "20 shifted points": honest + 0.5, "10 of the 20": honest[:10]}


def test_a_site_answers_pooled_queries_only_on_the_k_points_of_its_own_set_up_grid(monkeypatch):
    from simulations import engine

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)  # the honest reply is stamped with them
    context = _site_context(POOLED_K)
    _, cfg = resolve({"model.name": "coxph", **FAST, **POOLED_K})
    cuts, site = task.federation_setup(cfg).cuts, task.load_federation(cfg).sites[0]
    honest = k_point_grid(cuts, 20)
    assert honest.size == 20 and cuts.size > 20
    reply = cox_client.sums(Message(content=encode({"beta": np.zeros(6), "grid": honest}, {"step": 1}),
                                    dst_node_id=1, message_type=SUMS), context)
    assert decode(reply.content)["risk_x"].shape == (20, 6)
    queries = ((cox_client.sums, SUMS, lambda m: {}),
               (cox_client.meat, MEAT, lambda m: {"hazard_increment": np.zeros(m), "mean_x": np.zeros((m, 6))}),
               (cox_client.schoenfeld, SCHOENFELD, lambda m: {"event_means": np.zeros((m, 6))}))
    for label, grid in _forged_grids(cuts, np.asarray(site.train.time, dtype=np.float64)).items():
        for handler, kind, broadcast in queries:  # each query as the server would send it, on the forged grid
            arrays = {"beta": np.zeros(6), "grid": grid, **broadcast(grid.size)}
            request = Message(content=encode(arrays, {"step": 0}), dst_node_id=1, message_type=kind)
            with pytest.raises(ValueError, match=r"^Cox query refused: this run's config \(cox.grid = 20\) answers "
                                                 r"only on the 20 points of the set-up's time grid it picks") as refused:
                handler(request, context)
            assert "\n" not in str(refused.value), (label, kind)
            assert f"got {grid.size} point(s)" in str(refused.value), (label, kind)


@pytest.mark.parametrize("secure", [False, True])
def test_a_server_sending_a_finer_grid_gets_no_sums_and_the_fit_stops(secure, tmp_path, monkeypatch):
    _, cfg = resolve({"model.name": "coxph", **FAST, **POOLED_K})
    train = task.load_federation(cfg).pooled("train")
    forged = np.unique(np.concatenate([train.time - 1e-6, train.time]))  # a cell around every record
    monkeypatch.setattr(cox_server, "k_point_grid", lambda cuts, k: forged)  # the server's choice only
    sent, answered = [], []

    def observe(message, reply):  # every query carrying a grid: in the clear, or a secure sum's masked stage
        arrays = message.content.array_records.get("cox")
        if arrays is not None and "grid" in arrays:
            sent.append(int(arrays["grid"].numpy().size))
            if not reply.has_error():
                answered.append(message.metadata.message_type)

    refused = (r"^coxph stopped at Newton step 1: site 'site-\d' \(node \d+\)( in the secure sum's secagg_masked "
               r"stage,)? failed: Cox query refused: this run's config \(cox.grid = 20\) answers only on the 20 points")
    with pytest.raises(CoxSiteError, match=refused):
        run_inprocess({"model.name": "coxph", **FAST, **POOLED_K, "cox.secure_sum": secure,
                       "output.dir": str(tmp_path)},
                      observe=observe)
    assert sent and set(sent) == {forged.size} and forged.size > 100  # the forged grid reached the sites
    assert not answered  # and no site sent a sum on it


def test_a_deployed_site_checks_the_grid_against_the_set_up_it_stored(tmp_path, monkeypatch, capsys):
    from tests.test_manifest import flchain_site_files

    configs = flchain_site_files(tmp_path)
    overrides = {"model.name": "coxph", **FAST, **POOLED_K, "data.name": "site_files", "data.time_col": "futime",
                 "data.event_col": "death"}
    honest = run_inprocess({**overrides, "output.dir": str(tmp_path / "honest")}, node_configs=configs)
    assert honest["coxph"]["converged"] and honest["coxph"]["grid_points"] == 20  # the spec's cuts, via JSON
    monkeypatch.setattr(cox_server, "k_point_grid", lambda cuts, k: np.asarray(cuts)[:-1])  # all but one cut
    with pytest.raises(CoxSiteError, match=r"coxph stopped at Newton step 1: site 'site-\d' .*could not handle"):
        run_inprocess({**overrides, "output.dir": str(tmp_path / "forged")}, node_configs=configs)
    assert "Cox query refused: this run's config (cox.grid = 20) answers only on the 20 points" in capsys.readouterr().err


def test_a_site_failing_during_newton_stops_the_run_naming_it(tmp_path):
    with pytest.raises(Exception, match=r"coxph stopped at Newton step 3: site 'site-1' \(node \d+\) failed"):
        run_inprocess({"model.name": "coxph", "data.name": "whas", "federation.num_sites": 3, **FAST,
                       "debug.fail_site": "site-1", "debug.fail_message": "cox", "debug.fail_round": 3,
                       "output.dir": str(tmp_path)})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"strategy.name": "central_dp", "privacy.epsilon": 1.0},
     r"model.name = 'coxph' runs with strategy.name in fedavg, dp_sgd, distributed_dp .*strategy.name = 'central_dp'"),
    ({"federation.rounds": 5}, r"federation.rounds = 5 has no effect on model.name = 'coxph'"),
    ({"model.hidden": "16"}, r"model.hidden = '16' has no effect on model.name = 'coxph'"),
    ({"train.lr": 0.1}, r"train.lr = 0.1 has no effect"),
    ({"cox.grid": "10"}, r"cox.grid = '10' is read only with cox.strata = 'none'"),
    ({"cox.strata": "none", "cox.ph_test": "rank"}, r"cox.ph_test = 'rank' needs the pooled order"),
])
def test_coxph_refuses_another_strategy_and_the_keys_it_ignores_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        parse_run_config({"model.name": "coxph", **overrides})
    assert "\n" not in str(refused.value)


def test_the_cox_keys_are_refused_without_coxph():
    with pytest.raises(ConfigError, match=r"cox.robust = true is read only with model.name = 'coxph'"):
        parse_run_config({"cox.robust": True})


def test_a_deployment_fits_from_the_sites_own_files_and_every_value_sent_is_in_the_manifest(tmp_path):
    from flwr_app.cox_messages import coxph_manifest
    from tests.test_manifest import flchain_site_files, sent_keys

    configs = flchain_site_files(tmp_path)
    seen: list[tuple[str, str]] = []

    def observe(message, reply):
        if not reply.has_error():
            seen.extend((message.metadata.message_type, key) for key in sent_keys(reply.content))

    overrides = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                 "model.name": "coxph", "cox.robust": True, "federation.num_sites": 3, **FAST}
    summary = run_inprocess({**overrides, "output.dir": str(tmp_path / "out")}, observe=observe,
                            node_configs=configs)
    assert summary["coxph"]["converged"] and summary["num_sites"] == 3 and summary["coxph"]["ph_test_p"]
    assert summary["test_source"] == "weighted mean of the sites' own test metrics" and summary["test"]["c_index"] > 0.7
    _, cfg = resolve(overrides)
    manifest = coxph_manifest(cfg)
    kinds = {kind for kind, _ in seen}
    assert {"query.cox_moments", "query.cox_sums", "query.cox_meat", "query.cox_schoenfeld", "query.breslow",
            "evaluate"} <= kinds and "query.cox_event_times" not in kinds
    unlisted = sorted({f"{kind}/{key}" for kind, key in seen if not manifest.covers(kind, key)})
    assert not unlisted, unlisted
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == json.loads(json.dumps(manifest.as_dict()))
    run = load_run(tmp_path / "out")
    assert run.result.robust_variance is not None and run.references == {"mgus": "no", "sex": "F"}
