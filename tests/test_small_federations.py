"""Many small sites under a private set-up: 24 sites of about 30 training records each at ε = 1.

Through the apps (:func:`simulations.engine.run_inprocess`, two rounds): with public ranges the federation trains
under dp_sgd and distributed_dp and its time grid keeps every cell below a quarter of the events; without them both
set up through the secure sum (dp_sgd's ``privacy.setup_sum = auto`` chooses it here, from the run config alone) and
train with every column; summed per site (``privacy.setup_sum = per_site``), what the set-up leaves out it says in
one console line and in ``summary.json``, and a set-up that would leave the model no input, or no time range, stops
in one line naming the keys that help; an ε no noise reaches is refused at configuration time.
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
from strategies.accounting.rdp import epsilon_from_history
from strategies.config import ConfigError
from strategies.mechanisms.dp_sgd import AUTO_SECURE_SETUP_NOISE, DPSGD
from strategies.mechanisms.setup_share import setup_multiplier
from strategies.mechanisms.setup_statistics import SetupNoiseError, accountant_history

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


@pytest.mark.parametrize(("strategy", "dictionary"),
                         list(itertools.product(["distributed_dp", "dp_sgd"], [None, "time"])))
def test_the_set_up_goes_through_the_secure_sum_without_public_ranges(small, tmp_path, strategy, dictionary):
    """No public range (with or without the follow-up): the set-up's sums carry one Gaussian's noise, so every
    column's range and the time range stand out; the ledger's set-up history is the plan's Gaussian entries and
    composes to the one Gaussian of the set-up's noise multiplier. dp_sgd's ``privacy.setup_sum = auto`` takes the
    secure sum here (summed per site, seed 0 stops for want of a time range: the test below), and its ledger and
    manifest say so."""
    run = _run(small, "whas", dictionary, **{"strategy.name": strategy, "seed": 0})
    summary = run_inprocess({**run, "output.dir": str(tmp_path)})
    cfg = resolve(run)[1]
    assert summary["setup"] == {"left_out_columns": [], "notes": []} and np.isfinite(summary["test"]["ibs"])
    setup = task.federation_setup(cfg)
    assert setup.cuts[-1] == pytest.approx(FOLLOW_UP["whas"]) if dictionary else setup.cuts[-1] > 1000.0
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    planned = task.setup_history(cfg, setup.plan, setup.recalibration)
    assert {tuple(map(tuple, row["prior"])) for row in ledger} == {planned}
    z = setup_multiplier(cfg)
    assert epsilon_from_history(list(accountant_history(setup.plan)), delta=cfg.privacy.delta) == pytest.approx(
        epsilon_from_history([(z, 1.0, 1)], delta=cfg.privacy.delta), rel=1e-9)
    if strategy == "dp_sgd":
        assert any(sentence.startswith("set-up summed securely (privacy.setup_sum = auto)")
                   for sentence in ledger[0]["assumptions"])
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert "masked set-up vectors" in json.dumps(manifest) and "honest survivors" in json.dumps(manifest)


def test_what_the_set_up_leaves_out_is_one_console_line_and_in_the_summary(small, tmp_path, capsys):
    run = _run(small, "whas", "time", seed=0, **{"privacy.setup_sum": "per_site"})
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
        run_inprocess({**_run(small, "gbsg", "time", seed=0, **{"privacy.setup_sum": "per_site"}),
                       "output.dir": str(tmp_path / "out")})
    message = str(err.value)
    assert "all 7 columns would be left out and the model would have no input" in message and "\n" not in message
    for key in ("data.dictionary", "privacy.setup_share", "privacy.epsilon", "fewer, larger sites"):
        assert key in message
    assert not (tmp_path / "out" / "model.pt").exists()


def test_a_federation_too_small_for_a_time_range_names_the_dictionarys_follow_up(small, tmp_path):
    with pytest.raises(SetupNoiseError) as err:
        run_inprocess({**_run(small, "whas", None, seed=0, **{"privacy.setup_sum": "per_site"}),
                       "output.dir": str(tmp_path / "out")})
    message = str(err.value)
    assert "summed over 24 sites" in message and "\n" not in message
    for key in ("data.dictionary (time: {max: ...}", "privacy.setup_share", "privacy.epsilon", "fewer, larger sites",
                "sum it securely (dp_sgd: privacy.setup_sum = secure)"):
        assert key in message
    hidden = int(message.split("for the ")[1].split(" column")[0])  # the columns hidden too are named with their key
    assert "and numeric: {column: [lo, hi]}" in message[:300] and 1 <= hidden <= 6  # a console line shows 300


def _setup_sum(sites: int, epsilon: float = 1.0, **overrides) -> tuple[str, object]:
    cfg = resolve({"data.name": "whas", "strategy.name": "dp_sgd", "privacy.epsilon": epsilon,
                   "federation.num_sites": sites, **overrides})[1]
    return DPSGD().setup_sum(cfg), cfg


def test_dp_sgd_chooses_its_set_up_sum_from_the_run_config_alone():
    """``privacy.setup_sum = auto``: per site for the bundled demos' federations (3-6 sites at ε = 1) and up to 11
    sites at ε = 1 (sqrt(11) z = 29.4); through the secure sum from 12 sites (30.7), at 24 sites down to ε = 1.4
    (29.9 at 1.5); never where the per-site noise is low (24 sites at ε = 10) or SecAgg+ cannot run (2 sites,
    max_dropouts 1). The server and a deployed site (which passes 1 party: it takes no federation size from the
    server) decide alike."""
    for sites in (3, 4, 5, 6, 11):
        choice, cfg = _setup_sum(sites)
        assert choice == "per_site" and task.secure_setup(cfg, sites) is None and task.secure_setup(cfg, 1) is None
    for sites, epsilon in ((12, 1.0), (24, 1.0), (24, 1.4)):
        choice, cfg = _setup_sum(sites, epsilon)
        assert np.sqrt(sites) * setup_multiplier(cfg) > AUTO_SECURE_SETUP_NOISE
        assert choice == "secure" and task.secure_setup(cfg, sites).parties == sites
        assert task.secure_setup(cfg, 1) is not None
    assert _setup_sum(24, 10.0)[0] == "per_site" and _setup_sum(2, 0.2)[0] == "per_site"
    assert _setup_sum(2, 0.2, **{"privacy.max_dropouts": 0, "privacy.setup_sum": "secure"})[0] == "secure"
    assert _setup_sum(24, **{"privacy.setup_sum": "per_site"})[0] == "per_site"


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"strategy.name": "fedavg", "privacy.epsilon": float("inf"), "privacy.setup_sum": "secure"},
     "privacy.setup_sum = 'secure' has no effect on strategy 'fedavg'"),
    ({"strategy.name": "distributed_dp", "privacy.setup_sum": "per_site"},
     "has no effect on strategy 'distributed_dp'"),
    ({"privacy.setup_sum": "secure", "privacy.setup_share": 0.0}, "privacy.setup_sum = 'secure' chooses how"),
    ({"privacy.setup_sum": "secure", "federation.num_sites": 2}, "needs k > 2 * max_dropouts + colluding_sites"),
    ({"privacy.max_dropouts": 0}, "privacy.max_dropouts = 0 is read by strategy 'dp_sgd' only for its secure set-up"),
    ({"privacy.setup_sum": "per_site", "federation.num_sites": 24, "privacy.modulus_bits": 40},
     "privacy.modulus_bits = 40 is read by strategy 'dp_sgd' only"),
])
def test_a_set_up_sum_key_the_run_would_ignore_is_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as err:
        resolve({"data.name": "whas", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0, **overrides})
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_epsilon_below_what_rdp_certifies_is_refused_at_configuration(tmp_path):
    run = {"data.name": "whas", "strategy.name": "dp_sgd", "privacy.epsilon": 0.05, "output.dir": str(tmp_path / "o")}
    with pytest.raises(ConfigError) as err:
        resolve(run)
    message = str(err.value)
    assert message.startswith("run config: privacy.epsilon = 0.05 is at or below 0.1029") and "\n" not in message
    with pytest.raises(ConfigError, match="privacy.epsilon = 0.05"):
        run_inprocess({**run, "strategy.name": "distributed_dp"})
    assert not (tmp_path / "o").exists()


def _site_files(frame: pd.DataFrame, folder, *, sites: int, size: int) -> list[dict[str, str]]:
    """``sites`` consecutive blocks of ``size`` records of ``frame``, each written as a deployed site's file, and
    their node configs."""
    configs = []
    for index in range(sites):
        path = folder / f"site-{index}.csv"
        frame.iloc[size * index:size * (index + 1)].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}"})
    return configs


def test_a_deployed_set_up_that_leaves_no_column_stops_before_the_second_pass(small, tmp_path, monkeypatch):
    """Four deployed sites of 40 GBSG records: the server stops after the first pass, in one line, and no site is
    asked for its second release (seeded noise here; a deployed site draws it from its own entropy)."""
    configs = _site_files(pd.read_csv(small["gbsg"] / "gbsg.csv"), tmp_path, sites=4, size=40)
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


@pytest.mark.parametrize(("strategy", "overrides", "sums"), [
    ("distributed_dp", {}, 3), ("dp_sgd", {"privacy.setup_sum": "secure"}, 2)])
def test_a_deployed_set_up_goes_through_two_secure_sums(small, tmp_path, monkeypatch, strategy, overrides, sums):
    """Six deployed sites of 150 WHAS records, no public range: each sends its noisy count and levels, then the
    set-up's histograms and moments only through SecAgg+ (no site answers setup_moments), and the run trains with
    every column (seeded noise here; a deployed site draws it from its own entropy). A dp_sgd site does so from its
    own run config's ``privacy.setup_sum``, then trains with its own DP-SGD (its rounds are plain training replies)."""
    configs = _site_files(pd.read_csv(small["whas"] / "whas.csv"), tmp_path, sites=6, size=150)
    seeds, contribution, count = itertools.count(), deployment.secure_contribution, deployment.noisy_count
    monkeypatch.setattr(deployment, "secure_contribution", lambda *args, rng, **kwargs: contribution(
        *args, rng=np.random.default_rng(next(seeds)), **kwargs))
    monkeypatch.setattr(deployment, "noisy_count", lambda plan, records, rng: count(
        plan, records, np.random.default_rng(next(seeds))))
    asked = []
    run = {"data.name": "site_files", "data.time_col": "duration", "data.event_col": "event",
           "strategy.name": strategy, "privacy.epsilon": 1.0, "federation.num_sites": 6,
           "federation.rounds": 1, "evaluation.server_side": False, "baseline.centralized": False,
           "output.dir": str(tmp_path / "out"), **overrides}
    summary = run_inprocess(run, node_configs=configs,
                            observe=lambda message, reply: asked.append(message.metadata.message_type))
    assert deployment.RANGES in asked and deployment.MOMENTS not in asked
    masked = [kind for kind in asked if kind.endswith("secagg_masked")]
    assert len(masked) == sums * 6  # two set-up sums (and distributed_dp's round)
    assert summary["num_sites"] == 6 and summary["setup"] == {"left_out_columns": [], "notes": []}


def _deployed_site(small, tmp_path, monkeypatch, overrides: dict):
    """A deployed site of 40 WHAS records in a 4-site run of ``overrides``: its fused run config, its context, a
    message builder and its answer to a set-up secure sum's pass (``vector(setup_pass, ranges)``, the secure sum's
    parameters from the site's own run config, as the ClientApp passes them)."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from simulations import engine

    for name, value in (("_task_id", 1), ("_run_id", 3), ("_node_id", 2)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)  # messages built outside a run need an identity

    path = tmp_path / "site.csv"
    pd.read_csv(small["whas"] / "whas.csv").iloc[:40].to_csv(path, index=False)
    fused, _ = resolve({"data.name": "site_files", "data.time_col": "duration", "data.event_col": "event",
                        "privacy.epsilon": 1.0, "federation.num_sites": 4, "evaluation.server_side": False,
                        "baseline.centralized": False, **overrides})
    context = Context(run_id=3, node_id=2, node_config={"data-path": str(path), "site-name": "a"}, state=RecordDict(),
                      run_config=fused)
    secure = task.secure_setup(deployment.parse_run_config(fused), 4)

    def message(kind: str, content: RecordDict) -> Message:
        return Message(content=content, dst_node_id=2, message_type=kind)

    def vector(setup_pass: int, ranges=None):
        payload = json.dumps({"dictionary": None, "ranges": ranges})
        content = RecordDict({"config": ConfigRecord({deployment.SETUP_PASS: setup_pass,
                                                      deployment.SETUP_PUBLIC: payload})})
        return deployment.setup_vector(message("query.secagg_masked", content), context, secure, 160.0)

    return fused, context, message, vector


@pytest.mark.parametrize("overrides", [{"strategy.name": "distributed_dp"},
                                       {"strategy.name": "dp_sgd", "privacy.setup_sum": "secure"}])
def test_a_deployed_site_releases_each_secure_set_up_pass_once_after_its_count(small, tmp_path, monkeypatch,
                                                                               overrides):
    """A site whose run config sums the set-up securely (distributed_dp; dp_sgd with privacy.setup_sum = secure): no
    set-up vector before its setup_ranges release (which charged pass 1), each pass's vector once, and a second
    setup_ranges and any setup_moments query refused."""
    fused, context, message, vector = _deployed_site(small, tmp_path, monkeypatch, overrides)
    with pytest.raises(ValueError, match="after its setup_ranges release"):
        vector(1)
    ranges_request = message(deployment.RANGES, deployment._payload({"dictionary": None}))
    reply = deployment._read(deployment.setup_ranges(ranges_request, context))
    assert reply["histograms"] == {} and reply["time"] is None and np.isfinite(reply["count"])
    assert vector(1).size == sum(size for _, size in _segments(fused, 1))
    with pytest.raises(ValueError, match="releases each pass once"):
        vector(1)
    with pytest.raises(ValueError, match="released its set-up count in this run already"):
        deployment.setup_ranges(ranges_request, context)
    agreed = {"features": {c: [0.0, 100.0] for c in ("x0", "x1", "x2", "x3", "x4", "x5")}, "time_max": 2400.0,
              "fallbacks": {}, "time_bins": 20}
    assert vector(2, agreed).size == 2 * 20 + 3 * 6
    with pytest.raises(ValueError, match="releases each pass once"):
        vector(2, agreed)
    with pytest.raises(ValueError, match="secure sum only"):
        deployment.setup_moments(message(deployment.MOMENTS, deployment._payload({"ranges": agreed})), context)


def test_a_deployed_dp_sgd_site_summing_per_site_refuses_every_set_up_vector(small, tmp_path, monkeypatch):
    """The server cannot switch a site's set-up sum: a dp_sgd site whose own run config sums per site (auto: 4 sites
    at ε = 1) answers setup_ranges with its own noisy histograms and refuses a set-up vector before and after it."""
    fused, context, message, vector = _deployed_site(small, tmp_path, monkeypatch, {"strategy.name": "dp_sgd"})
    assert task.secure_setup(deployment.parse_run_config(fused), 4) is None
    with pytest.raises(ValueError, match="after its setup_ranges release"):
        vector(1)
    reply = deployment._read(deployment.setup_ranges(message(deployment.RANGES,
                                                             deployment._payload({"dictionary": None})), context))
    assert len(reply["histograms"]) == 6 and len(reply["time"]) == len(reply["histograms"]["x0"])
    for setup_pass in (1, 2):
        with pytest.raises(ValueError, match="after its setup_ranges release"):
            vector(setup_pass)


def _segments(fused, setup_pass):
    """The secure-sum segments of a pass of the run's set-up plan over WHAS's columns."""
    from strategies.mechanisms.setup_statistics import secure_segments

    cfg = deployment.parse_run_config(fused)
    frame = pd.read_csv(resolve_data_dir("") / "whas.csv").drop(columns=["split", "duration", "event"])
    return secure_segments(task.setup_plan(cfg, frame), setup_pass)
