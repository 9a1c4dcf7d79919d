"""Many small sites under a private set-up: 24 sites of about 30 training records each at ε = 1.

Through the apps (:func:`simulations.engine.run_inprocess`, two rounds): with public ranges the federation trains
under dp_sgd and distributed_dp and its time grid keeps every cell below a quarter of the events; what the set-up
leaves out it says in one console line and in ``summary.json``; a set-up that would leave the model no input, or
no time range, stops in one line naming the keys that help; an ε no noise reaches is refused at configuration time.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest

from flwr_app import deployment, task
from models.data.files import resolve_data_dir
from simulations.engine import resolve, run_inprocess
from strategies.config import ConfigError
from strategies.mechanisms.setup_statistics import SetupNoiseError

#: The bundled sets, 900 records each: 24 sites of 37 or 38, 30 of them training records.
RECORDS = 900
FOLLOW_UP = {"whas": 2400.0, "gbsg": 90.0}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Per data set: the CSV of 900 of its records and dictionaries of its follow-up alone and of every range too."""
    folder = tmp_path_factory.mktemp("small")
    files = {}
    for name, follow_up in FOLLOW_UP.items():
        frame = pd.read_csv(resolve_data_dir("") / f"{name}.csv").drop(columns="split")
        frame = frame.sample(n=RECORDS, random_state=0)
        frame.to_csv(folder / f"{name}.csv", index=False)
        features = frame.drop(columns=["duration", "event"])
        ranges = {c: [float(features[c].min()), float(features[c].max())] for c in features}
        for kind, payload in (("time", {"time": {"max": follow_up}}),
                              ("all", {"numeric": ranges, "time": {"max": follow_up}})):
            (folder / f"{name}-{kind}.json").write_text(json.dumps(payload))
        files[name] = folder
    return files


def _run(small, name: str, dictionary: str | None, **overrides) -> dict:
    run = {"data.name": "csv", "data.path": str(small[name] / f"{name}.csv"), "data.time_col": "duration",
           "data.event_col": "event", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "federation.num_sites": 24,
           "federation.rounds": 2, "baseline.centralized": False, **overrides}
    if dictionary:
        run["data.dictionary"] = str(small[name] / f"{name}-{dictionary}.json")
    return run


def _largest_cell(cfg) -> float:
    """Share of the pooled training events in the fullest cell of the run's grid (beyond its end: one more cell)."""
    train, cuts = task.load_federation(cfg).pooled("train"), task.federation_setup(cfg).cuts
    cell = np.searchsorted(cuts, train.time[train.event == 1], side="left")
    return np.bincount(cell, minlength=cuts.size + 1).max() / cell.size


@pytest.mark.parametrize("strategy", ["dp_sgd", "distributed_dp"])
def test_twenty_four_sites_of_thirty_records_train_with_public_ranges(small, tmp_path, strategy):
    run = _run(small, "whas", "all", **{"strategy.name": strategy})
    summary = run_inprocess({**run, "output.dir": str(tmp_path)})
    cfg = resolve(run)[1]
    assert summary["num_sites"] == 24 and summary["privacy"]["epsilon"] <= 1.0 + 1e-6
    assert np.isfinite(summary["test"]["ibs"]) and "below_null" in summary["km_null"]
    assert summary["setup"] == {"left_out_columns": [], "notes": []}
    setup = task.federation_setup(cfg)
    assert setup.cuts[-1] == pytest.approx(FOLLOW_UP["whas"]) and _largest_cell(cfg) < 0.25


def test_what_the_set_up_leaves_out_is_one_console_line_and_in_the_summary(small, tmp_path, capsys):
    run = _run(small, "whas", "time", seed=0)
    summary = run_inprocess({**run, "output.dir": str(tmp_path)})
    lines = [line for line in capsys.readouterr().out.splitlines() if "set-up" in line]
    left_out = summary["setup"]["left_out_columns"]
    assert len(lines) == 1 and 0 < len(left_out) < 6 and summary["setup"]["notes"] == lines, lines
    (line,) = lines
    assert line.startswith(f"private set-up: {len(left_out)} of 6 columns left out of the model "
                           f"({', '.join(left_out)})")
    assert "data.dictionary" in line and "privacy.setup_share" in line
    assert set(left_out).isdisjoint(summary["data"]["features"]["input_columns"])
    assert json.loads((tmp_path / "summary.json").read_text())["setup"]["left_out_columns"] == left_out
    assert _largest_cell(resolve(run)[1]) < 0.25


def test_a_set_up_that_leaves_no_column_stops_in_one_line_before_any_network(small, tmp_path):
    with pytest.raises(SetupNoiseError) as err:  # GBSG's seven numeric columns, only the follow-up public
        run_inprocess({**_run(small, "gbsg", "time", seed=0), "output.dir": str(tmp_path / "out")})
    message = str(err.value)
    assert "all 7 columns would be left out and the model would have no input" in message and "\n" not in message
    for key in ("data.dictionary", "privacy.setup_share", "privacy.epsilon", "fewer, larger sites"):
        assert key in message
    assert not (tmp_path / "out" / "model.pt").exists()


def test_a_federation_too_small_for_a_time_range_names_the_dictionarys_follow_up(small, tmp_path):
    with pytest.raises(SetupNoiseError) as err:
        run_inprocess({**_run(small, "whas", None, seed=0), "output.dir": str(tmp_path / "out")})
    message = str(err.value)
    assert "summed over 24 sites" in message and "\n" not in message
    for key in ("data.dictionary (time: {max: ...}", "privacy.setup_share", "privacy.epsilon", "fewer, larger sites"):
        assert key in message


def test_an_epsilon_below_what_rdp_certifies_is_refused_at_configuration(tmp_path):
    run = {"data.name": "whas", "strategy.name": "dp_sgd", "privacy.epsilon": 0.05, "output.dir": str(tmp_path / "o")}
    with pytest.raises(ConfigError) as err:
        resolve(run)
    message = str(err.value)
    assert message.startswith("run config: privacy.epsilon = 0.05 is at or below 0.1029") and "\n" not in message
    with pytest.raises(ConfigError, match="privacy.epsilon = 0.05"):
        run_inprocess({**run, "strategy.name": "distributed_dp"})
    assert not (tmp_path / "o").exists()


def test_a_deployed_set_up_that_leaves_no_column_stops_before_the_second_pass(small, tmp_path, monkeypatch):
    """Four deployed sites of 40 GBSG records: the server stops after the first pass, in one line, and no site is
    asked for its second release (seeded noise here; a deployed site draws it from its own entropy)."""
    frame = pd.read_csv(small["gbsg"] / "gbsg.csv")
    configs = []
    for index in range(4):
        path = tmp_path / f"site-{index}.csv"
        frame.iloc[40 * index:40 * (index + 1)].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}"})
    seeded, seeds = deployment.release_ranges, itertools.count()
    monkeypatch.setattr(deployment, "release_ranges", lambda plan, features, time, rng: seeded(
        plan, features, time, np.random.default_rng(next(seeds))))
    asked = []
    run = {"data.name": "site_files", "data.time_col": "duration", "data.event_col": "event", "strategy.name": "dp_sgd",
           "privacy.epsilon": 1.0, "federation.num_sites": 4, "federation.rounds": 1, "evaluation.server_side": False,
           "baseline.centralized": False, "data.dictionary": str(small["gbsg"] / "gbsg-time.json"),
           "output.dir": str(tmp_path / "out")}
    with pytest.raises(RuntimeError) as err:
        run_inprocess(run, node_configs=configs,
                      observe=lambda message, reply: asked.append(message.metadata.message_type))
    message = str(err.value)
    assert message.startswith("set-up: set-up statistics: no column's range stood out of the noise")
    assert "\n" not in message
    assert deployment.RANGES in asked and deployment.MOMENTS not in asked
