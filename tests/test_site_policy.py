"""A site's own privacy policy (flwr_app.site_policy): its Rényi filter against dp-accounting, its ledger file,
and, through the real ServerApp and ClientApp in process, a deployed site that refuses a run its budget cannot
hold before it releases anything, and keeps its budget across runs and restarts."""


import json

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp as dp_rdp
from flwr.app import Context, Message, RecordDict

from flwr_app import deployment, site_policy
from flwr_app.site_policy import PolicyRefusal, Request, SitePolicy, enforce, read_ledger
from models.data.datasets import load_flchain
from simulations.engine import _prepare, run_inprocess
from strategies.accounting.filter import (
    FilterExhausted,
    RenyiFilter,
    epsilon_at_order,
    filter_order,
    rdp_at_order,
    rdp_budget,
)
from strategies.accounting.rdp import epsilon_from_history


# ------------------------------------------------------------------ the filter's mathematics


def _dp_accounting_epsilon(history, order, delta):
    accountant = dp_rdp.RdpAccountant(orders=[float(order)])
    for sigma, rate, steps in history:
        event = dp_accounting.GaussianDpEvent(sigma)
        accountant.compose(event if rate == 1 else dp_accounting.PoissonSampledDpEvent(rate, event), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("history", [[(10.0, 1.0, 1)], [(3.0, 0.1, 50)], [(7.4, 1.0, 1), (1.2, 0.02, 400)]])
@pytest.mark.parametrize("order", [2, 8, 18, 40])
def test_the_filter_cost_and_its_epsilon_at_one_order_match_dp_accounting(history, order):
    assert epsilon_at_order(rdp_at_order(history, order), order, 1e-5) == pytest.approx(
        _dp_accounting_epsilon(history, order, 1e-5), rel=1e-9)


@pytest.mark.parametrize("epsilon", [0.3, 1.0, 3.0, 10.0])
def test_the_budget_is_the_largest_rdp_whose_conversion_is_epsilon_and_the_order_fits_a_gaussian(epsilon):
    order = filter_order(epsilon, 1e-5)
    assert epsilon_at_order(rdp_budget(epsilon, 1e-5, order), order, 1e-5) == pytest.approx(epsilon)
    # the chosen order lets a Gaussian of the whole budget have the least noise of any order of the grid
    sigma = np.sqrt(order / (2 * rdp_budget(epsilon, 1e-5, order)))
    assert epsilon_from_history([(sigma * 0.999, 1.0, 1)], delta=1e-5) > epsilon * 0.98
    assert filter_order(1.0, 1e-5) == 18


def test_an_adaptive_sequence_stops_at_the_budget_and_the_admitted_releases_are_within_epsilon():
    """A server that lowers the noise after every answer: each request is charged at its own parameters, the
    first that would pass the budget is refused and changes nothing, and the admitted history's epsilon (by
    dp-accounting at the filter's order, and by the min over orders) is within the limit."""
    filt = RenyiFilter(epsilon=1.0, delta=1e-5)
    admitted, sigma = [], 30.0
    while True:
        request = [(sigma, 0.05, 100)]
        spent = filt.spent
        try:
            filt.charge(request)
        except FilterExhausted as err:
            assert filt.spent == spent and "> 1" in str(err)
            break
        admitted += request
        sigma *= 0.8
    assert len(admitted) >= 3
    assert filt.epsilon() <= 1.0
    assert _dp_accounting_epsilon(admitted, filt.order, 1e-5) == pytest.approx(filt.epsilon(), rel=1e-9)
    assert epsilon_from_history(admitted, delta=1e-5) <= filt.epsilon()
    restored = RenyiFilter.from_state_dict(filt.state_dict())
    assert restored.state_dict() == filt.state_dict()


# ------------------------------------------------------------------ the policy and its ledger file


def _site_file(tmp_path, name="site.csv", rows=600, seed=0):
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    path = tmp_path / name
    frame.iloc[np.random.default_rng(seed).permutation(len(frame))[:rows]].to_csv(path, index=False)
    return path


@pytest.mark.parametrize(("config", "words"), [
    ({"privacy-max-epsilon": 1}, "'privacy-ledger'"),
    ({"privacy-ledger": "/x.jsonl"}, "'privacy-max-epsilon'"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": "one"}, "privacy-max-epsilon = 'one' is not a number"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 0}, "privacy-max-epsilon = 0 must be a finite number > 0"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1, "privacy-mechanisms": "dp_sgd,fedavg"},
     "privacy-mechanisms = 'dp_sgd,fedavg'"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1, "privacy-rdp-order": 1}, "privacy-rdp-order = 1"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilo": 1}, "privacy-max-epsilo: not a key of the site's privacy"),
    ({"privacy-max-eps": 1}, "privacy-max-eps: not a key"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1, "privacy-mechanisms": "dp_sgd,bdp"},
     "bdp: its noise scale and its stopping time depend on the site's records"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1, "privacy-min-honest-sites": 2.5},
     "privacy-min-honest-sites = 2.5 must be a whole number >= 1"),
    ({"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1, "privacy-rdp-order": 2.5},
     "privacy-rdp-order = 2.5 must be a whole number"),
])
def test_a_bad_policy_is_refused_in_one_line_naming_the_key(config, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        SitePolicy.from_node_config(config)


def test_no_policy_keys_no_policy():
    assert SitePolicy.from_node_config({"data-path": "/x.csv", "partition-id": 0}) is None


def _node(tmp_path, data, **extra):
    return {"data-path": str(data), "site-name": "site-a", "privacy-ledger": str(tmp_path / "ledger.jsonl"),
            "privacy-max-epsilon": 1.0, "data-time-col": "futime", "data-event-col": "death", **extra}


def test_the_ledger_file_charges_each_release_refuses_what_the_budget_cannot_hold_and_spans_restarts(tmp_path):
    data = _site_file(tmp_path)
    node = _node(tmp_path, data)
    request = Request("dp_sgd", 1, 1, "train", "model update", ((8.0, 0.1, 100),))
    enforce(node, "site-a", request)
    enforce(node, "site-a", request)  # a new process reads the file anew: this is also what a restart sees
    with pytest.raises(PolicyRefusal, match=r"site 'site-a' privacy policy refuses train: .*> 1 at delta"):
        for _ in range(20):
            enforce(node, "site-a", request)
    lines = read_ledger(tmp_path / "ledger.jsonl")
    header, releases = lines[0], [line for line in lines if line["kind"] == "release"]
    assert header["kind"] == "header" and header["order"] == 18 and header["data_path"] == str(data)
    assert (header["unit"], header["adjacency"]) == ("record", "add-remove")
    assert lines[-1]["kind"] == "refusal" and lines[-1]["epsilon"] == releases[-1]["epsilon"] <= 1.0
    cost = rdp_at_order([(8.0, 0.1, 100)], 18)
    assert [line["rdp"] for line in releases] == pytest.approx([cost] * len(releases))
    assert releases[-1]["epsilon"] == pytest.approx(epsilon_at_order(cost * len(releases), 18, 1e-5))
    table = site_policy.ledger_table(lines)
    assert "Rényi filter of order 18" in table and "REFUSED" in table


@pytest.mark.parametrize(("request_", "extra", "words"), [
    (Request("fedavg", 1, 1, "train", "model update", None), {}, "not one this site accepts"),
    (Request("bdp", 1, 1, "train", "model update", ((5.0, 0.1, 1),)), {},
     "not one this site accepts .*: its noise scale and its stopping time depend on the site's records"),
    (Request("dp_sgd", 1, 1, "train", "model update", ((5.0, 0.1, 1),), delta=1e-3), {},
     "privacy.delta = 0.001, more than this site's privacy-delta = 1e-05"),
    (Request("dp_sgd", 1, 0, "site_summary", "exact set-up statistics", None), {}, "cannot be charged"),
    (Request("dp_sgd", 1, 1, "train", "model update", ((0.4, 0.1, 1),)), {"privacy-min-noise": 0.5},
     "noise multiplier of 0.4 is below the site's floor privacy-min-noise = 0.5"),
    (Request("bdp", 1, 1, "train", "model update", ((5.0, 0.1, 1),)), {"privacy-mechanisms": "dp_sgd"},
     "strategy 'bdp' is not one this site accepts"),
])
def test_what_the_policy_cannot_charge_or_does_not_accept_is_refused(tmp_path, request_, extra, words):
    data = _site_file(tmp_path)
    with pytest.raises(PolicyRefusal, match=words):
        enforce(_node(tmp_path, data, **extra), "site-a", request_)
    assert [line["kind"] for line in read_ledger(tmp_path / "ledger.jsonl")] == ["header", "refusal"]


def test_a_ledger_file_holds_one_data_set_and_keeps_its_order(tmp_path):
    first, other = _site_file(tmp_path), _site_file(tmp_path, "other.csv", seed=1)
    request = Request("dp_sgd", 1, 1, "train", "model update", ((5.0, 0.1, 10),))
    enforce(_node(tmp_path, first), "site-a", request)
    with pytest.raises(ValueError, match="holds the budget of another data set"):
        enforce(_node(tmp_path, other), "site-a", request)
    with pytest.raises(ValueError, match="privacy-rdp-order = 4, but .* was created with order 18"):
        enforce(_node(tmp_path, first, **{"privacy-rdp-order": 4}), "site-a", request)


# ------------------------------------------------------------------ a deployed site, through the apps


def test_a_server_asking_the_set_up_again_is_charged_for_every_answer_until_the_plan_no_longer_fits(tmp_path):
    """One answer per question is not assumed: every repeated set-up answer is charged, and the site stops
    answering while its budget can still hold the run it was asked for."""
    from flwr.supercore.task_identity import TaskIdentity

    data = _site_file(tmp_path)
    fused, _, _ = _prepare({"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                            "strategy.name": "dp_sgd", "privacy.epsilon": 0.3, "federation.num_sites": 2,
                            "federation.rounds": 1, "evaluation.server_side": False, "baseline.centralized": False,
                            "output.dir": str(tmp_path / "out")}, "test")
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
    context = Context(run_id=7, node_id=3, node_config=_node(tmp_path, data), state=RecordDict(), run_config=fused)
    message = Message(content=deployment._payload({"dictionary": None}), dst_node_id=3,
                      message_type=deployment.RANGES)
    answers = 0
    with pytest.raises(PolicyRefusal, match="the run's plan would take the site's filter"):
        for _ in range(200):
            deployment.setup_ranges(message, context)
            answers += 1
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert 2 <= answers == sum(line["kind"] == "release" for line in lines) < 200
    assert lines[-1]["kind"] == "refusal" and lines[-1]["epsilon"] < 1.0


def _federation(tmp_path):
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    configs = []
    for index, rows in enumerate(np.array_split(np.random.default_rng(0).permutation(len(frame))[:3000], 3)):
        path = tmp_path / f"site-{index + 1}.csv"
        frame.iloc[rows].reset_index(drop=True).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index + 1}"})
    configs[0].update({"privacy-ledger": str(tmp_path / "site-1-ledger.jsonl"), "privacy-max-epsilon": 1.0,
                       "data-time-col": "futime", "data-event-col": "death"})
    return configs


RUN = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": "dp_sgd",
       "federation.num_sites": 3, "federation.min_sites": 2, "federation.rounds": 1, "evaluation.server_side": False,
       "baseline.centralized": False}


def _site_1_entries(out):
    entries = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    return [entry for entry in entries if entry["site"] == "site-1"]


def test_a_site_with_a_budget_of_1_refuses_a_run_at_3_before_releasing_anything_and_keeps_its_budget(tmp_path):
    """site-1 holds a policy of epsilon <= 1. A run asking for 3 is refused at the first set-up message, before
    anything leaves, and the server names it. In later runs (new nodes: as restarted SuperNodes, the budget lives in
    the file) the server plans site-1's noise to fit what its filter has left: at 0.5 its noise is the run's
    (PLD-calibrated), at 0.8 it is raised to fit; the server's ledger gives the run's PLD and RDP figures and the
    site's filter figure beside them, the filter figure equals the site's file, and the file never passes 1."""
    configs = _federation(tmp_path)
    ledger = tmp_path / "site-1-ledger.jsonl"
    asked = []
    summary = run_inprocess({**RUN, "privacy.epsilon": 3.0, "output.dir": str(tmp_path / "a")}, node_configs=configs,
                            observe=lambda message, reply: asked.append((message.metadata.dst_node_id,
                                                                         message.metadata.message_type)))
    (reason,) = summary["left_out"].values()
    assert reason == ("site 'site-1': the site's privacy policy refused the request; nothing released (the site's "
                      "log has the detail)")  # a deployed site's reply: its limit and budget stay in its own log
    site_log = tmp_path / "site.log"  # the site's directory: its ledger's
    assert "privacy.epsilon = 3, more than this site's limit privacy-max-epsilon = 1" in site_log.read_text()
    assert set(summary["sites"]) == {"site-2", "site-3"}
    assert {kind for node, kind in asked if node == 1} == {"query.setup_ranges"}
    assert [line["kind"] for line in read_ledger(ledger)] == ["header", "refusal"]
    noise = {}
    for name, epsilon in (("b", 0.5), ("c", 0.8)):
        summary = run_inprocess({**RUN, "privacy.epsilon": epsilon, "output.dir": str(tmp_path / name)},
                                node_configs=configs)
        assert "left_out" not in summary and summary["sites_kept_local"] == ["site-1"]  # its policy keeps them
        entries = [json.loads(line) for line in (tmp_path / name / "ledger.jsonl").read_text().splitlines()]
        (own,) = [entry for entry in entries if entry["site"] == "site-1"]
        others = [entry for entry in entries if entry["site"] != "site-1"]
        noise[name] = own["epsilon"] / epsilon  # below 1 where the filter, not the run's accountant, set its noise
        assert own["epsilon"] <= epsilon and own["epsilon_rdp"] > own["epsilon"]
        released = [line for line in read_ledger(ledger) if line["kind"] == "release"]
        assert own["epsilon_filter"] == pytest.approx(released[-1]["epsilon"], rel=1e-9)
        assert all(entry["epsilon_filter"] is None for entry in others)
    assert noise["c"] < 0.95 < noise["b"], noise
    released = [line for line in read_ledger(ledger) if line["kind"] == "release"]
    assert [line["message"] for line in released] == ["setup_ranges", "setup_moments", "train"] * 2
    assert 0.95 < released[-1]["epsilon"] <= 1.0
    summary = run_inprocess({**RUN, "privacy.epsilon": 0.5, "output.dir": str(tmp_path / "d")}, node_configs=configs)
    assert "site-1" not in summary["sites"] and "privacy policy refused" in str(summary["left_out"])
    assert "cannot hold even the set-up" in site_log.read_text()
    assert max(line["epsilon"] for line in read_ledger(ledger)[1:]) <= 1.0
