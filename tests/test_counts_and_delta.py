"""Issue 26, items 5 and 6: no reply reveals a count beyond the set-up's, and delta is refused above 1/n.

Item 5: a site's evaluation reply carries its test metrics and no record count; the server weights the
sites' metrics by the counts agreed at set-up (the noisy ones under a private set-up). Item 6: a delta
above 1/n, n the population the strategy protects (each site's records; distributed_dp: their union;
central_dp: the sites), is refused in one line naming n, unless ``privacy.delta_override``; in a
deployment each site of a per-site mechanism refuses it against its own count before it releases anything.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from flwr_app import site_errors, site_store
from flwr_app.config import ConfigError
from flwr_app.task import federation_setup
from models.data.datasets import load_flchain
from simulations.engine import resolve, run_inprocess
from strategies.horizontal import weighted_nanmean
from strategies.mechanisms.base import delta_refusal
from strategies.mechanisms.registry import MECHANISMS
from strategies.replies import check_evaluation, error_message

SMALL = {"federation.num_sites": 3, "federation.rounds": 1, "baseline.centralized": False,
         "evaluation.server_side": False}
DP_SGD = {**SMALL, "strategy.name": "dp_sgd", "privacy.epsilon": 2.0}


# ------------------------------------------------------------------ item 5: counts


def test_dp_sgd_evaluation_replies_carry_no_count_and_the_sites_mean_is_weighted_by_the_agreed_counts(tmp_path):
    evaluate_keys: list[set[str]] = []

    def observe(message, reply):
        if message.metadata.message_type == "evaluate" and not reply.has_error():
            evaluate_keys.append({f"{name}.{key}" for name, record in reply.content.metric_records.items()
                                  for key in record})

    summary = run_inprocess({**DP_SGD, "output.dir": str(tmp_path)}, observe=observe)
    assert len(evaluate_keys) == 3
    for keys in evaluate_keys:
        assert "metrics.c_index" in keys
        assert not any("num-examples" in key or "count" in key for key in keys), keys
    agreed = {site: setup.count for site, setup in federation_setup(resolve(DP_SGD)[1]).setups.items()}
    assert set(summary["sites"]) == set(agreed)
    for site, metrics in summary["sites"].items():
        assert metrics["num-examples"] == agreed[site]  # the weight beside a site's metrics: its agreed count
    expected = sum(agreed[site] * summary["sites"][site]["c_index"] for site in agreed) / sum(agreed.values())
    assert summary["sites_mean"]["c_index"] == pytest.approx(expected)
    assert summary["test"]["c_index"] == pytest.approx(expected)  # no server-side evaluation: the sites' mean


def test_an_evaluation_reply_with_a_count_is_refused():
    assert check_evaluation({"c_index": 0.7, "ibs": 0.1}) == ""
    assert check_evaluation({"c_index": 0.7, "oot_ibs": math.nan}) == ""
    assert check_evaluation({"c_index": 0.7, "num-examples": 400}).startswith(
        "num-examples: an evaluation reply carries no record count")
    assert weighted_nanmean({"a": {"c_index": 0.8, "num-examples": 3.0},
                             "b": {"c_index": 0.6, "num-examples": 1.0}})["c_index"] == pytest.approx(0.75)


# ------------------------------------------------------------------ item 6: delta against the protected population


def _cfg(strategy, **privacy):
    return resolve({"strategy.name": strategy, "privacy.epsilon": 2.0,
                    **{f"privacy.{key}": value for key, value in privacy.items()}})[1]


@pytest.mark.parametrize("strategy", ["dp_sgd", "bdp", "nbafl", "ls_adp", "row_dp"])
def test_a_per_site_mechanism_refuses_delta_above_one_over_a_sites_count(strategy):
    counts = {"a": 2_000.0, "b": 200_000.0, "c": 150_000.0}
    reason = delta_refusal(_cfg(strategy), MECHANISMS[strategy], counts)
    assert reason.startswith("run config: privacy.delta = 1e-05 exceeds 1/n = 5e-06: ")
    assert "n = 200000 at site 'b'" in reason and "n = 150000 at site 'c'" in reason and "site 'a'" not in reason
    assert "privacy.delta_override = true" in reason and "each site's training records" in reason
    assert delta_refusal(_cfg(strategy, delta_override=True), MECHANISMS[strategy], counts) == ""
    assert delta_refusal(_cfg(strategy), MECHANISMS[strategy], {"a": 2_000.0, "b": 100_000.0}) == ""  # 1/n = delta


def test_distributed_dp_refuses_delta_above_one_over_the_unions_count():
    counts = {"a": 60_000.0, "b": 50_000.0}  # each under 1/delta, together over it
    assert delta_refusal(_cfg("dp_sgd"), MECHANISMS["dp_sgd"], counts) == ""
    reason = delta_refusal(_cfg("distributed_dp"), MECHANISMS["distributed_dp"], counts)
    assert reason.startswith("run config: privacy.delta = 1e-05 exceeds 1/n = 9.09e-06: n = 110000 records of 2 "
                             "sites together")
    assert "the union of the sites' training records" in reason
    assert delta_refusal(_cfg("distributed_dp", delta_override=True), MECHANISMS["distributed_dp"], counts) == ""
    assert delta_refusal(_cfg("distributed_dp"), MECHANISMS["distributed_dp"], {"a": 40_000.0, "b": 50_000.0}) == ""


def test_central_dp_counts_sites_and_fedavg_is_never_refused():
    reason = delta_refusal(_cfg("central_dp", delta=0.4), MECHANISMS["central_dp"], {"a": 10.0, "b": 10.0, "c": 10.0})
    assert "n = 3 sites" in reason and "site-level DP" in reason
    assert delta_refusal(_cfg("central_dp"), MECHANISMS["central_dp"], {"a": 1e9, "b": 1e9}) == ""
    fedavg = resolve({})[1]
    assert delta_refusal(fedavg, MECHANISMS["fedavg"], {"a": 1e9}) == ""


def test_the_default_delta_refuses_no_bundled_data_set():
    """1e-5 against the largest bundled federation: sim_cox's 50,000 records in all (the union under distributed_dp)."""
    for name in ("flchain", "sba", "sim_cox"):
        cfg = resolve({"data.name": name, "strategy.name": "distributed_dp", "privacy.epsilon": 2.0})[1]
        counts = {site: setup.count for site, setup in federation_setup(cfg).setups.items()}
        assert delta_refusal(cfg, MECHANISMS["distributed_dp"], counts) == "", name


def test_a_simulated_run_refuses_distributed_dps_delta_against_the_union_and_accepts_the_override(tmp_path):
    # flchain over 3 sites: about 2,100 training records each (1/n ~ 4.8e-4), 6,300 together (1/n ~ 1.6e-4)
    union = {**SMALL, "strategy.name": "distributed_dp", "privacy.epsilon": 2.0, "privacy.delta": 3e-4}
    with pytest.raises(ConfigError, match=r"privacy.delta = 0.0003 exceeds 1/n = .*: n = \d+ records of 3 sites "
                                          r"together.*privacy.delta_override = true"):
        run_inprocess({**union, "output.dir": str(tmp_path / "refused")})
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before the first round
    summary = run_inprocess({**union, "privacy.delta_override": True, "output.dir": str(tmp_path / "override")})
    assert summary["rounds"] == 1 and summary["privacy"]["delta"] == pytest.approx(3e-4)


def test_a_simulated_per_site_run_refuses_delta_naming_each_sites_count(tmp_path):
    with pytest.raises(ConfigError, match=r"privacy.delta = 0.001 exceeds 1/n = .*: n = \d+ at site 'site-0', "
                                          r"n = \d+ at site 'site-1', n = \d+ at site 'site-2', n the population "
                                          r"strategy 'dp_sgd' protects"):
        run_inprocess({**DP_SGD, "privacy.delta": 1e-3, "output.dir": str(tmp_path)})


def test_a_deployed_site_refuses_a_delta_above_one_over_its_own_count_before_releasing_anything(tmp_path):
    """site-0 holds 2,400 records (1/n ~ 4.2e-4 < delta = 1e-3): it answers the private set-up's first pass with
    an error and sends nothing; site-1 and site-2 (240 training records each: 1/n ~ 4.2e-3) go on without it."""
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    rows = np.random.default_rng(0).permutation(len(frame))
    configs = []
    for index, part in enumerate((rows[:3000], rows[3000:3300], rows[3300:3600])):
        path = tmp_path / f"site-{index}.csv"
        frame.iloc[part].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}"})
    replies: list[tuple[str, str]] = []

    def observe(message, reply):
        replies.append((message.metadata.message_type, reply.error.reason if reply.has_error() else ""))

    overrides = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                 "strategy.name": "dp_sgd", "privacy.epsilon": 10.0, "privacy.delta": 1e-3,
                 "federation.num_sites": 3, "federation.rounds": 1, "federation.min_sites": 2, "evaluation.server_side": False,
                 "baseline.centralized": False, "output.dir": str(tmp_path / "out")}
    summary = run_inprocess(overrides, observe=observe, node_configs=configs)
    refused = [reason for kind, reason in replies if reason]
    assert len(refused) == 1
    said = ("site 'site-0': privacy.delta is more than 1/n for the site's training records; the site releases nothing "
            "(the site's log has the detail)")  # a deployed site's reply: its exact count stays in its own log
    assert error_message(refused[0]) == said
    log = (site_store.site_dir(configs[0]) / site_errors.LOG_FILE).read_text()
    assert "site 'site-0' releases nothing: run config: privacy.delta = 0.001 exceeds 1/n" in log
    count = re.search(r"n = (\d+) at site 'site-0'", log).group(1)  # its training count: in its log only
    assert 2000 < int(count) < 3000 and count not in refused[0]
    assert set(summary["sites"]) == {"site-1", "site-2"}
    assert list(summary["left_out"].values()) == [said]


@pytest.mark.parametrize("strategy", ["split", "private_split"])
def test_a_vertical_run_refuses_delta_above_one_over_its_training_records_before_any_release(strategy, tmp_path):
    """The vertical strategies protect the label holder's training records (each with all its modalities): a delta
    above 1/n is refused before any site releases an embedding, naming n; the override lets it run."""
    run = {"strategy.name": strategy, "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
           "split.modalities": "a,b", "privacy.epsilon": 10.0, "privacy.delta": 0.01, "federation.rounds": 1,
           "baseline.centralized": False, "split.mc_samples": 2}
    released = []
    with pytest.raises(ConfigError, match=r"privacy.delta = 0.01 exceeds 1/n = .*: n = \d+ training records, n the "
                                          rf"population strategy '{strategy}' protects \(the vertical federation's"):
        run_inprocess({**run, "output.dir": str(tmp_path / "refused")},
                      observe=lambda message, reply: released.append(message.metadata.message_type))
    assert set(released) == {"query.split_hello"}  # the record IDs only: nothing computed from a record's values
    summary = run_inprocess({**run, "privacy.delta_override": True, "output.dir": str(tmp_path / "override")})
    assert summary["privacy"]["delta"] == pytest.approx(0.01)
