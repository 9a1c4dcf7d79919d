"""What a site keeps between messages (issue 28): the parsed run config, a deployed site's prepared records and
the run's model skeleton are built once per process and key, and never carry a run's privacy state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from flwr_app import client_app, config, deployment, site_context, task
from flwr_app.config import parse_run_config
from simulations.engine import resolve, run_inprocess
from strategies.rounds.records import CARRIED_EVALUATION

SMALL = {"federation.rounds": 2, "federation.num_sites": 2, "evaluation.server_side": False,
         "baseline.centralized": False}


@pytest.fixture(autouse=True)
def _fresh_caches():
    client_app.MODELS.clear()
    site_context.SITES.clear()
    yield
    client_app.MODELS.clear()
    site_context.SITES.clear()


def test_a_run_config_is_parsed_and_checked_once_per_content(monkeypatch):
    calls = []
    parse = config._parse
    monkeypatch.setattr(config, "_parse", lambda flat: calls.append(dict(flat)) or parse(flat))
    monkeypatch.setattr(config, "_parsed", type(config._parsed)())
    flat = {"federation.num_sites": 3, "train.local_epochs": 1}
    first = parse_run_config(flat)
    assert parse_run_config(dict(flat)) is first and len(calls) == 1
    changed = parse_run_config({**flat, "federation.num_sites": 4})
    assert changed.federation.num_sites == 4 and len(calls) == 2
    with pytest.raises(config.ConfigError):  # a bool where an int goes is not the cached int's entry
        parse_run_config({**flat, "federation.num_sites": True})
    with pytest.raises(config.ConfigError):  # a failed config is not kept: it fails again
        parse_run_config({"no.such.key": 1})
    with pytest.raises(config.ConfigError):
        parse_run_config({"no.such.key": 1})


def test_a_node_builds_the_model_once_and_reuses_its_copy(monkeypatch, tmp_path):
    builds = []
    build = task.build_model
    monkeypatch.setattr(task, "build_model", lambda cfg, dataset: builds.append(cfg) or build(cfg, dataset))
    run_inprocess({**SMALL, "output.dir": str(tmp_path)})
    assert len(client_app.MODELS.entries) == 1
    skeleton = next(iter(client_app.MODELS.entries.values()))
    # Built once for the sites (the server builds its own initial model too); 2 sites x 2 rounds x (train, evaluate)
    # messages run one after another, so one copy serves them all.
    assert len(builds) == 2 and skeleton.copies == 1
    run_inprocess({**SMALL, "seed": 7, "output.dir": str(tmp_path / "other")})
    assert len(client_app.MODELS.entries) == 2  # a changed run config gets its own skeleton


def test_a_returned_copy_is_the_skeleton_again_and_a_hooked_one_is_dropped():
    _, cfg = resolve(SMALL)
    skeleton = client_app._Skeleton(task.build_model(cfg, task.load_federation(cfg)))
    model = skeleton.take()
    model.set_exponents(np.ones(model.cuts.size))
    model.net.eval()
    model._cuts_tensor += 1.0  # changed in place: neither the skeleton nor the next copy may see it
    model.cuts = model.cuts + 1.0
    for parameter in model.net.parameters():
        parameter.grad = torch.ones_like(parameter)
        parameter.grad_sample = torch.zeros(1)
    skeleton.give_back(model)
    again = skeleton.take()
    assert again is model and skeleton.copies == 1
    assert again.exponents is None and again.net.training == skeleton.model.net.training
    assert np.array_equal(again.cuts, skeleton.model.cuts)
    assert torch.equal(again._cuts_tensor, skeleton.model._cuts_tensor)
    assert again._cuts_tensor is not skeleton.model._cuts_tensor and again.cuts is not skeleton.model.cuts
    assert all(p.grad is None and not hasattr(p, "grad_sample") for p in again.net.parameters())
    handle = next(iter(again.net.modules())).register_forward_hook(lambda *args: None)
    skeleton.give_back(again)
    fresh = skeleton.take()
    assert fresh is not again and skeleton.copies == 2
    handle.remove()
    client_app._held.__dict__.pop("models", None)


def test_weights_are_loaded_as_load_state_dict_loads_them():
    _, cfg = resolve(SMALL)
    model = task.build_model(cfg, task.load_federation(cfg))
    other = task.build_model(cfg, task.load_federation(resolve({**SMALL, "seed": 3})[1]))
    client_app._load_weights(model.net, ArrayRecord(other.net.state_dict()))
    for (name, a), b in zip(model.net.state_dict().items(), other.net.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    wrong = ArrayRecord({**other.net.state_dict(), "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError):  # not the network's names: load_state_dict's own error
        client_app._load_weights(model.net, wrong)


def test_one_evaluation_gives_the_metrics_and_reasons_of_the_two_calls():
    _, cfg = resolve(SMALL)
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    test = dataset.sites[0].test
    metrics = task.evaluate(model, test)
    together = task.evaluate_with_reasons(model, test)
    assert together == (metrics, task.undefined_metrics(model, test, metrics))


def test_a_deployed_site_is_prepared_once_per_file_config_and_set_up(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(deployment, "deployed_site", lambda cfg, context: built.append(cfg) or object())
    monkeypatch.setattr(deployment, "site_name", lambda context: "site-a")
    path = tmp_path / "site.csv"
    path.write_text("time,event,age\n1,1,50\n")
    run_config = {"data.name": config.DEPLOYED_DATA, "evaluation.server_side": False, "baseline.centralized": False}

    def context(flat, privacy: str) -> Context:
        state = RecordDict({client_app.PRIVACY_STATE: ConfigRecord({"json": privacy})})
        return Context(run_id=1, node_id=5, node_config={"data-path": str(path)}, state=state, run_config=flat)

    first, _ = site_context.node_site(context(run_config, '{"run": 1}'))
    second, _ = site_context.node_site(context(dict(run_config), '{"run": 2}'))
    assert second is first and len(built) == 1  # another run's privacy state is not part of the prepared site
    path.write_text("time,event,age\n1,1,50\n2,0,60\n")
    assert site_context.node_site(context(run_config, '{"run": 1}'))[0] is not first and len(built) == 2
    site_context.node_site(context({**run_config, "seed": 9}, '{"run": 1}'))
    assert len(built) == 3


def test_the_privacy_state_stays_in_each_node_state():
    assert client_app.PRIVACY_STATE == deployment.PRIVACY_STATE
    states = [{"rounds": 1}, {"rounds": 5}]
    contexts = [Context(run_id=run, node_id=1, node_config={}, run_config={},
                        state=RecordDict({client_app.PRIVACY_STATE: ConfigRecord({"json": str(state).replace("'", '"')})}))
                for run, state in enumerate(states)]
    assert [client_app._privacy_state(c, ConfigRecord(), None, 1, deployed=False, rounds=1)
            for c in contexts] == [(s, 0) for s in states]
    kept = repr([vars(entry) for entry in client_app.MODELS.entries.values()]) + repr(site_context.SITES.entries)
    assert "rounds" not in kept


def test_evaluation_every_k_rounds_sends_no_evaluation_message_between_and_evaluates_the_last(tmp_path):
    """``evaluation.every = 3`` over 4 rounds: the sites are sent evaluation messages (and the server evaluates the
    pooled test split) after rounds 3 and 4 only; the final figures are those of ``every = 1``'s last round."""
    asked: list[tuple[str, int]] = []

    def observe(message, reply):
        config = message.content.config_records.get("config", {})
        if message.metadata.message_type == "evaluate":
            asked.append(("evaluate", int(config["server-round"])))
        elif config.get(CARRIED_EVALUATION) is True:  # a training message that asks for the previous round's
            asked.append(("evaluate", int(config["server-round"]) - 1))

    overrides = {**SMALL, "federation.rounds": 4, "evaluation.server_side": True, "seed": 2}
    every = run_inprocess({**overrides, "evaluation.every": 3, "output.dir": str(tmp_path / "every3")},
                          observe=observe)
    assert sorted({server_round for _, server_round in asked}) == [3, 4] and len(asked) == 2 * 2
    lines = [json.loads(line) for line in (tmp_path / "every3" / "metrics.jsonl").read_text().splitlines()]
    assert [bool(line["sites"]) for line in lines] == [False, False, True, True]
    assert [bool(line["global_test"]) for line in lines] == [False, False, True, True]
    each = run_inprocess({**overrides, "output.dir": str(tmp_path / "every1")})
    assert every["test"] == pytest.approx(each["test"], rel=0, abs=1e-12)
    assert every["sites"].keys() == each["sites"].keys()
    for site in each["sites"]:
        assert every["sites"][site] == pytest.approx(each["sites"][site], rel=0, abs=1e-12)


def test_evaluation_every_is_refused_for_a_split_run():
    with pytest.raises(config.ConfigError, match="'evaluation.every' = 2 applies to horizontal runs only"):
        resolve({"strategy.name": "split", "data.name": "metabric", "evaluation.every": 2})
