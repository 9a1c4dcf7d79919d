"""Deployed sites with bad data: the site's error reply names the class of failure and the key (its log names file,
column and rows); the server reports it, leaves the site out and trains with the others (in process: the real
ServerApp and ClientApp, each node reading its own file as a SuperNode would)."""

import json
import re

import numpy as np
import pytest
import torch

from flwr_app import site_errors, site_store
from models.data.datasets import load_flchain
from simulations.engine import run_inprocess

RUN = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": "fedavg",
       "federation.num_sites": 4, "federation.min_sites": 2, "federation.rounds": 2,
       "evaluation.server_side": False, "baseline.centralized": False}
SITES = ("site-1", "site-2", "site-3", "site-4")


def _frames():
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    rows = np.array_split(np.random.default_rng(0).permutation(len(frame))[:2000], len(SITES))
    return [frame.iloc[part].reset_index(drop=True) for part in rows]


def _break_missing_time(frame):
    return frame.drop(columns=["futime"])


def _break_negative_time(frame):
    frame.loc[3, "futime"] = -5.0
    return frame


def _break_missing_time_value(frame):
    frame.loc[7, "futime"] = np.nan
    return frame


def _break_event_values(frame):
    frame.loc[2, "death"] = 2
    return frame


def _break_no_events(frame):
    frame["death"] = 0
    return frame


def _break_non_numeric(frame):
    frame["age"] = frame["age"].astype(object)
    frame.loc[5, "age"] = "unknown"
    return frame


def _break_extra_column(frame):
    frame["ward"] = 1.0
    return frame


#: Damage, what the server is told, and what the site's own log says (a schema mismatch: the server's own finding).
CASES = {
    "missing time column": (_break_missing_time, ["data.time_col is not in the site's file"], ["'futime'"]),
    "negative time": (_break_negative_time, ["data.time_col is not a valid time column"],
                      ["futime", "negative", "row 4"]),
    "missing time": (_break_missing_time_value, ["data.time_col is not a valid time column"], ["futime", "row 8"]),
    "event not 0/1": (_break_event_values, ["data.event_col is not a valid event column"],
                      ["'death' (data.event_col)", "values found: 0 (375), 1 (124), 2 (1)", "data.event_values="]),
    "no events": (_break_no_events, ["data.event_col is not a valid event column"], ["no events at all"]),
    "non-numeric value": (_break_non_numeric, ["data.feature_cols is not numeric"], ["age", "non-numeric", "row 6"]),
    "extra column": (_break_extra_column, ["ward", "extra columns"], []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_site_with_bad_data_is_reported_and_left_out_and_the_others_train(case, tmp_path):
    damage, words, detail = CASES[case]
    frames = _frames()
    bad = tmp_path / "site-4.csv"
    configs = []
    for name, frame in zip(SITES, frames, strict=True):
        path = tmp_path / f"{name}.csv"
        (damage(frame) if path == bad else frame).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": name})
    messaged = []
    summary = run_inprocess({**RUN, "output.dir": str(tmp_path / "out")}, node_configs=configs,
                            observe=lambda message, reply: messaged.append((message.metadata.dst_node_id,
                                                                            message.metadata.message_type)))
    (reason,) = summary["left_out"].values()
    for word in words:
        assert word in reason, reason
    if detail:  # the site's own error: its file, column and rows in its log, none of them in its reply
        assert reason.startswith("site 'site-4': ") and str(bad) not in reason
        assert not re.search(r"\d", reason.replace("site-4", "")), reason
        log = (site_store.site_dir(configs[-1]) / site_errors.LOG_FILE).read_text()
        assert all(word in log for word in [str(bad), *detail]), log
    assert summary["num_sites"] == 3 and set(summary["sites"]) == set(SITES[:3])
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2] and all(not line["failures"] for line in lines)
    assert {message_type for node, message_type in messaged if node == 4} == {"query.site_summary"}


def test_sites_whose_schemas_all_differ_stop_the_run_with_every_reason(tmp_path):
    frames = _frames()
    configs = []
    for index, (name, frame) in enumerate(zip(SITES, frames, strict=True)):
        path = tmp_path / f"{name}.csv"
        frame.assign(**{f"extra_{index}": 0.0}).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": name})
    with pytest.raises(RuntimeError, match=r"only 1 of 4 sites can take part(.|\n)*extra_1"):
        run_inprocess({**RUN, "output.dir": str(tmp_path / "out")}, node_configs=configs)


def _final_weights(out):
    return torch.load(out / "model.pt", weights_only=True)["state_dict"]


def test_deployed_noise_comes_from_the_sites_entropy_not_from_the_run_seed(tmp_path):
    """Two deployed dp_sgd runs with the same seed release different updates (the server cannot regenerate
    the noise from the seed); two simulated runs with the same seed release identical ones, and the ledger
    says which is which."""
    configs = []
    for name, frame in zip(SITES, _frames(), strict=True):
        path = tmp_path / f"{name}.csv"
        frame.to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": name})
    deployed = {**RUN, "strategy.name": "dp_sgd", "privacy.epsilon": 5.0, "federation.rounds": 1, "seed": 7}
    for run in ("a", "b"):
        run_inprocess({**deployed, "output.dir": str(tmp_path / run)}, node_configs=configs)
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert any(not bool((a[key] == b[key]).all()) for key in a)
    simulated = {key: value for key, value in deployed.items() if not key.startswith("data.")}
    for run in ("c", "d"):
        run_inprocess({**simulated, "federation.num_sites": 3, "output.dir": str(tmp_path / run)})
    c, d = _final_weights(tmp_path / "c"), _final_weights(tmp_path / "d")
    assert all(bool((c[key] == d[key]).all()) for key in c)
    ledger = {run: json.loads((tmp_path / run / "ledger.jsonl").read_text().splitlines()[0])["assumptions"]
              for run in ("a", "c")}
    assert any("operating-system entropy" in line for line in ledger["a"])
    assert any("not private against anyone who knows the seed" in line for line in ledger["c"])


def _stretch_time(frame):
    frame.loc[:9, "futime"] = 1e12  # these records' times would shrink everyone's grid to two points
    return frame


def _string_id(frame):
    frame.insert(0, "patient", [f"P{i:05d}" for i in range(len(frame))])
    return frame


def _scaled_feature(frame):
    frame["age"] = frame["age"] * 1e6
    return frame


HOSTILE_SETUP = {
    "a stretched time range": (_stretch_time, ["largest training time", "1e+12"]),
    "a string identifier column": (_string_id, ["a feature column looks like a record identifier"]),
    "a feature on another scale": (_scaled_feature, ["'age'", "far outside"]),
}


@pytest.mark.parametrize("case", list(HOSTILE_SETUP))
def test_a_site_whose_set_up_statistics_stand_out_is_refused_and_the_grid_is_the_others(case, tmp_path):
    damage, words = HOSTILE_SETUP[case]
    configs = []
    for name, frame in zip(SITES, _frames(), strict=True):
        path = tmp_path / f"{name}.csv"
        (damage(frame) if name == SITES[-1] else frame).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": name})
    sent = []
    summary = run_inprocess({**RUN, "output.dir": str(tmp_path / "out")}, node_configs=configs,
                            observe=lambda message, reply: sent.append(message))
    (reason,) = summary["left_out"].values()
    for word in words:
        assert word in reason, reason
    assert set(summary["sites"]) == set(SITES[:3])
    if case == "a string identifier column":  # no record's ID reached the server or another site
        assert not any("P00001" in str(message.content) for message in sent)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]
