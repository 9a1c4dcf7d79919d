"""Sequential messages per round: a round's evaluation (a Cox-type model: its Breslow sums) travels with the next
round's training message (distributed_dp: its masked stage).

End to end through Flower (the in-process engine: the real ServerApp and ClientApp), counting every message the
server sends by type and round, and comparing the round metrics with those of the same run whose evaluations each
go in messages of their own (:meth:`strategies.rounds.carried.CarriedEvaluation.defers` patched to say no).
"""

from __future__ import annotations

import collections
import json

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from flwr_app import client_app
from simulations.engine import resolve, run_inprocess
from strategies import secure_aggregation as secagg
from strategies.rounds import carried
from strategies.rounds.records import (BRESLOW_RECORD, CARRIED_BRESLOW, CARRIED_EVALUATION, EVALUATION_RECORD,
                                       EVALUATION_SITE, UNDEFINED_KEY)

SMALL = {"federation.rounds": 3, "federation.num_sites": 3, "evaluation.server_side": False,
         "baseline.centralized": False}
STRATEGIES = {"fedavg": {}, "dp_sgd": {"strategy.name": "dp_sgd", "privacy.epsilon": 5.0}}
#: What closes a run after its last training message, besides the evaluate message: dp_sgd's private set-up
#: recalibrates the final model once (its sums before the evaluation that uses the exponents).
CLOSING = {"fedavg": {}, "dp_sgd": {"query.recalibration": 1}}


def _counted_run(overrides, tmp_path):
    """Run; return the messages sent, by round (a secure sum's stages: by its group, e.g. ``"2-recalibration"``):
    (message type, whether it asks about the previous round's model) -> count; and the lines of metrics.jsonl but
    their wall times."""
    sent: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def observe(message, reply):
        config = message.content.config_records.get("config", {})
        group = message.metadata.group_id  # a secure sum's: its round (and what it sums), on each of its stages
        if "server-round" not in config and not group:  # the set-up's messages
            return
        carries = config.get(CARRIED_EVALUATION) is True or config.get(CARRIED_BRESLOW) is True
        if carries:
            record = EVALUATION_RECORD if config.get(CARRIED_EVALUATION) is True else BRESLOW_RECORD
            assert not reply.has_error() and record in reply.content, "a carried part is missing"
        key = group if group and not group.isdigit() else int(config.get("server-round", group))
        sent[key][(message.metadata.message_type, carries)] += 1

    run_inprocess({**overrides, "output.dir": str(tmp_path)}, observe=observe)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return sent, [{key: value for key, value in line.items() if key != "elapsed_s"} for line in lines]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_one_sequential_message_a_round_and_the_same_round_metrics(tmp_path, monkeypatch, strategy):
    """Rounds 1 and 2 send one training message per site (round 2's also asks for round 1's evaluation); the last
    round's training message carries round 2's and one evaluate message closes the run (dp_sgd: after the
    recalibration query). The round metrics are those of the run in which each evaluation goes in an evaluate message
    of its own."""
    overrides = {**SMALL, **STRATEGIES[strategy]}
    sent, lines = _counted_run(overrides, tmp_path / "carried")
    sites = SMALL["federation.num_sites"]
    closing = {(kind, False): count * sites for kind, count in CLOSING[strategy].items()}
    assert sent == {1: {("train", False): sites}, 2: {("train", True): sites},
                    3: {("train", True): sites, ("evaluate", False): sites, **closing}}
    monkeypatch.setattr(carried.CarriedEvaluation, "defers", lambda self, server_round, last_round: False)
    alone, separate = _counted_run(overrides, tmp_path / "alone")
    assert alone == {r: {("train", False): sites, ("evaluate", False): sites, **(closing if r == 3 else {})}
                     for r in (1, 2, 3)}
    assert [line["round"] for line in lines] == [1, 2, 3]
    for line, other in zip(lines, separate, strict=True):
        assert all(line[key] for key in ("sites_mean", "sites"))
        assert line == other


def test_evaluation_every_k_rounds_carries_only_the_planned_evaluations(tmp_path):
    """``evaluation.every = 2`` over 4 rounds: round 3's training message carries round 2's evaluation; rounds 2 and
    4 carry none (rounds 1 and 3 are not evaluated); the last round is evaluated in a message of its own."""
    sent, lines = _counted_run({**SMALL, "federation.rounds": 4, "evaluation.every": 2}, tmp_path)
    sites = SMALL["federation.num_sites"]
    assert sent == {1: {("train", False): sites}, 2: {("train", False): sites}, 3: {("train", True): sites},
                    4: {("train", False): sites, ("evaluate", False): sites}}
    assert [bool(line["sites"]) for line in lines] == [False, True, False, True]


def test_a_cox_model_carries_its_breslow_sums_and_keeps_its_evaluate_message(tmp_path, monkeypatch):
    """A Cox-type model's evaluation needs the federated baseline of the same model: round 2's training message
    carries the Breslow sums of round 1's model, then round 1's evaluate message (with their sum) closes round 1 (two
    sequential messages a round, not three); the last round keeps its Breslow query. The round metrics are those of
    the run with a Breslow query before every evaluation."""
    overrides = {**SMALL, "federation.rounds": 2, "model.name": "cox_mlp"}
    sent, lines = _counted_run(overrides, tmp_path / "carried")
    sites = SMALL["federation.num_sites"]
    assert sent == {1: {("train", False): sites, ("evaluate", False): sites},
                    2: {("train", True): sites, ("query.breslow", False): sites, ("evaluate", False): sites}}
    monkeypatch.setattr(carried.CarriedEvaluation, "defers", lambda self, server_round, last_round: False)
    alone, separate = _counted_run(overrides, tmp_path / "alone")
    assert alone == {r: {("train", False): sites, ("query.breslow", False): sites, ("evaluate", False): sites}
                     for r in (1, 2)}
    for line, other in zip(lines, separate, strict=True):
        assert all(line[key] for key in ("sites_mean", "sites"))
        assert line == other


def test_distributed_dp_carries_the_evaluation_in_its_masked_stage(tmp_path, monkeypatch):
    """distributed_dp: round ``r + 1``'s masked stage (the one that carries the model) asks for round ``r``'s test
    metrics, and round ``r``'s unmask message carries round ``r + 1``'s key set-up: after the first round, three
    sequential messages a round (share keys; masked vector; unmask with the next round's keys), not five; the last
    round's unmask carries none and an evaluate message closes the run. The round metrics are those of the run with an
    evaluate message after every round."""
    overrides = {**SMALL, "federation.rounds": 3, "federation.num_sites": 4, "strategy.name": "distributed_dp",
                 "privacy.epsilon": 1.0}
    sent, lines = _counted_run(overrides, tmp_path / "carried")
    kinds = ("query.secagg_setup", "query.secagg_share_keys", "query.secagg_unmask")
    stages = {(kind, False): 4 for kind in kinds}
    pipelined = {(kind, False): 4 for kind in kinds[1:]}
    assert sent[1] == {**stages, ("query.secagg_masked", False): 4}
    assert sent[2] == {**pipelined, ("query.secagg_masked", True): 4}  # three sequential messages
    assert sent[3] == {**pipelined, ("query.secagg_masked", True): 4, ("evaluate", False): 4}
    assert sent["3-recalibration"] == {**stages, ("query.secagg_masked", False): 4}  # the private set-up's, once
    monkeypatch.setattr(carried.CarriedEvaluation, "defers", lambda self, server_round, last_round: False)
    alone, separate = _counted_run(overrides, tmp_path / "alone")
    assert alone[1] == {**stages, ("query.secagg_masked", False): 4, ("evaluate", False): 4}
    for line, other in zip(lines, separate, strict=True):
        assert all(line[key] for key in ("sites_mean", "sites"))
        assert line == other


def test_distributed_dp_pipelines_fresh_keys_and_asks_a_dropped_site_alone(tmp_path):
    """Round ``r``'s unmask message carries round ``r + 1``'s stage-0 values (those round ``r + 1``'s own stage 0
    would send) to the sites in its sum; each returns two fresh public keys with its shares, and round ``r + 1``
    forwards exactly those keys at its share-keys stage. A site that dropped out of round 2 (its masked stage fails)
    gets no unmask message, so round 3 sends it alone a stage-0 message; the last round's unmask carries no set-up."""
    overrides = {**SMALL, "federation.rounds": 3, "federation.num_sites": 4, "strategy.name": "distributed_dp",
                 "privacy.epsilon": 1.0, "debug.fail_site": "site-0", "debug.fail_round": 2,
                 "output.dir": str(tmp_path)}
    setups: dict[str, list[int]] = collections.defaultdict(list)
    advertised: dict[str, dict[int, tuple]] = collections.defaultdict(dict)
    forwarded: dict[str, dict[int, tuple]] = collections.defaultdict(dict)
    next_values: dict[str, list[dict]] = collections.defaultdict(list)
    stage_zero: dict[str, list[dict]] = collections.defaultdict(list)

    def observe(message, reply):
        group, kind = message.metadata.group_id, message.metadata.message_type
        node = message.metadata.dst_node_id
        if kind == secagg.SETUP:
            setups[group].append(node)
            stage_zero[group].append(dict(message.content[secagg.RECORD]))
        elif kind == secagg.SHARE_KEYS:
            forwarded[group].update({int(n): tuple(pair) for n, pair in message.content[secagg.RECORD].items()})
        elif kind == secagg.UNMASK and secagg.NEXT_RECORD in message.content.config_records:
            next_values[group].append(dict(message.content[secagg.NEXT_RECORD]))
            assert not reply.has_error()
            record = reply.content[secagg.RECORD]
            advertised[group][node] = (record["pk1"], record["pk2"])

    run_inprocess(overrides, observe=observe)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3] and all(line["sites"] for line in lines)
    assert sorted(next_values) == ["1", "2"] and len(next_values["1"]) == 4 and len(next_values["2"]) == 3
    assert len(setups["1"]) == 4 and "2" not in setups
    dropped = sorted(set(advertised["1"]) - set(advertised["2"]))
    assert len(dropped) == 1 and setups["3"] == dropped  # the drop-out of round 2, alone
    assert all(values == stage_zero["1"][0] for group in ("1", "2") for values in next_values[group])
    for group, following in (("1", "2"), ("2", "3")):
        assert all(forwarded[following][node] == keys for node, keys in advertised[group].items())
    keys = [key for group in advertised.values() for pair in group.values() for key in pair]
    keys += [key for pair in forwarded["1"].values() for key in pair]
    assert all(len(key) == 32 for key in keys) and len(set(keys)) == len(keys)  # fresh for every sum


def test_a_site_answers_only_the_carried_queries_its_own_config_plans(tmp_path):
    """The server cannot make a site evaluate more than its run config says: with ``evaluation.every = 2``, round 2's
    training message asking for round 1's test metrics is refused (round 1 is not evaluated), and so is one asking a
    hazard model's site for Breslow sums; round 3's message asking for round 2's gets them, with the update."""
    overrides = {**SMALL, "evaluation.every": 2, "output.dir": str(tmp_path)}
    trains: dict[int, Message] = {}

    def observe(message, reply):
        if message.metadata.message_type == "train":
            trains.setdefault(int(message.content["config"]["server-round"]), message)

    run_inprocess(overrides, observe=observe)

    def answer(server_round, **asked):
        message = trains[server_round]
        config = ConfigRecord({key: value for key, value in message.content["config"].items()
                               if key not in (CARRIED_EVALUATION, CARRIED_BRESLOW)} | asked)
        content = RecordDict({"arrays": message.content["arrays"], "config": config})
        context = Context(run_id=message.metadata.run_id, node_id=message.metadata.dst_node_id,
                          node_config={"partition-id": 0, "num-partitions": 3}, state=RecordDict(),
                          run_config=resolve(overrides)[0])
        return client_app.app(Message(content=content, dst_node_id=message.metadata.dst_node_id,
                                      message_type="train"), context)

    for server_round, asked in ((2, CARRIED_EVALUATION), (3, CARRIED_BRESLOW)):
        with pytest.raises(ValueError, match=f"query refused: .* in round {server_round}'s training message, not "
                                             f"{asked}"):
            answer(server_round, **{asked: True})
    reply = answer(3, **{CARRIED_EVALUATION: True})
    assert not reply.has_error() and set(reply.content[EVALUATION_RECORD]) >= {"c_index", "ibs"}
    assert "arrays" in reply.content and EVALUATION_RECORD not in answer(3).content


def test_a_model_rolled_back_after_its_carried_evaluation_discards_the_updates_trained_from_it(tmp_path):
    """Two of three sites find round 1's predictions not finite in the test metrics round 2's training replies carry:
    round 1's model is rolled back (to the initial one) and evaluated again in an evaluate message of its own, round 2's
    updates (trained from the rolled-back model) are not aggregated, yet released (every site has its ledger entry), and
    round 3 trains from the initial model again."""
    sent: dict[int, list] = collections.defaultdict(list)

    def broken(message, reply):
        config = message.content.config_records.get("config", {})
        if message.metadata.message_type in ("train", "evaluate"):
            sent[int(config["server-round"])].append((message.metadata.message_type, message.content["arrays"]))
        if config.get(CARRIED_EVALUATION) is True and config["server-round"] == 2 and not reply.has_error():
            site = str(reply.content[EVALUATION_SITE]["name"])
            if site != "site-0":
                reply.content[EVALUATION_RECORD]["c_index"] = float("nan")
                reply.content[EVALUATION_SITE][UNDEFINED_KEY] = json.dumps({"c_index": "not_finite"})
        return reply

    run_inprocess({**SMALL, "output.dir": str(tmp_path)}, transform=broken)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["rolled_back"]["to_round"] == 0
    assert lines[0]["rolled_back"]["reason"] == "the new global model's predictions are not finite at 2 of 3 sites"
    assert lines[1]["rolled_back"] == {"to_round": 0, "sites": [], "reason": (
        "its updates were trained from round 1's model, rolled back after its evaluation: not aggregated")}
    assert "rolled_back" not in lines[2]
    assert [kind for kind, _ in sent[1]] == ["train"] * 3 + ["evaluate"] * 3  # round 1's second evaluation
    initial, again = sent[1][0][1], sent[3][0][1]
    assert all(initial[key].data == again[key].data for key in initial)  # round 3 trains from the initial model
    assert sent[1][3][1].keys() == initial.keys() and all(sent[1][3][1][key].data == initial[key].data
                                                         for key in initial)
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert sorted((entry["round"], entry["site"]) for entry in ledger) == [
        (r, f"site-{i}") for r in (1, 2, 3) for i in range(3)]


@pytest.mark.parametrize("colluding", [0, 1])
def test_a_site_finishes_its_sum_before_it_makes_the_next_keys_under_its_own_checks(colluding):
    """An unmask message that carries the next sum's stage 0 (five holders, threshold 3): with no colluder in the
    site's own run config, the reply has the site's shares and two fresh public keys, and the node state is that sum's
    stage 0 with those keys and its public figures; with one (6 > 6 fails), the message fails and the finished sum's
    state stays, so a second unmask is refused too."""
    from flwr.supercore.task_identity import TaskIdentity

    from flwr_app.site_context import SECAGG_ROUND, SECAGG_STATE
    from simulations.engine import SUPERLINK_NODE_ID, new_run_id

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, new_run_id(), SUPERLINK_NODE_ID
    shares = {7: b"seed-7", 8: b"seed-8", 9: b"seed-9"}
    state = secagg.SiteState(node=7, stage=secagg.MASKED, modulus=2 ** 40, num_shares=3, threshold=2,
                             seed_shares=shares)
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict({SECAGG_STATE: state.to_record()}),
                      run_config={"strategy.name": "distributed_dp", "privacy.epsilon": 1.0,
                                  "privacy.colluding_sites": colluding})
    following = {"modulus": 2 ** 40, "num_shares": 5, "threshold": 3, "parties": 5, "records": 100.0}

    def unmask():
        content = RecordDict({secagg.RECORD: ConfigRecord({"survivors": [7, 8, 9], "dropped": []}),
                              secagg.NEXT_RECORD: ConfigRecord(following)})
        return client_app.secagg_unmask(Message(content=content, dst_node_id=7, message_type=secagg.UNMASK), context)

    if colluding:
        with pytest.raises(ValueError, match="colluding_sites=1"):
            unmask()
        assert secagg.SiteState.from_record(context.state[SECAGG_STATE]).stage == secagg.UNMASK
        with pytest.raises(ValueError, match="after stage query.secagg_unmask"):
            unmask()
        return
    record = unmask().content[secagg.RECORD]
    assert list(record["nodes"]) == [7, 8, 9] and list(record["shares"]) == [shares[n] for n in (7, 8, 9)]
    kept = secagg.SiteState.from_record(context.state[SECAGG_STATE])
    assert (kept.stage, kept.num_shares, kept.threshold, kept.seed_shares) == (secagg.SETUP, 5, 3, {})
    assert (record["pk1"], record["pk2"]) == (kept.pk1, kept.pk2) and len({kept.pk1, kept.pk2}) == 2
    assert dict(context.state[SECAGG_ROUND]) == {"parties": 5, "records": 100.0}


def test_a_pipelined_sum_checks_the_advertised_keys_as_stage_zero_and_asks_the_others_alone():
    """Two sums over five sites (D = 2), the first's unmask message carrying the second's stage 0: the second sends
    stage 0 only to the site whose keys it was not given, refuses (as at stage 0) a site that advertised a key of 31
    bytes and one that advertised a key of small order, and unmasks exactly the others' sum."""
    import numpy as np
    from flwr.supercore.task_identity import TaskIdentity

    from simulations.engine import SUPERLINK_NODE_ID, new_run_id
    from tests.test_distributed_dp import SiteGrid, _vectors

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, new_run_id(), SUPERLINK_NODE_ID
    tampered = {2: {"pk1": bytes(31)}, 3: {"pk2": bytes(32)}}  # all zeros: a point of small order

    class PipelinedGrid(SiteGrid):
        def __init__(self, vectors):
            super().__init__(vectors)
            self.setups: list[int] = []

        def send_and_receive(self, messages, timeout=None):
            messages = list(messages)
            self.setups += [m.metadata.dst_node_id for m in messages if m.metadata.message_type == secagg.SETUP]
            following = {m.metadata.dst_node_id: m.content.config_records[secagg.NEXT_RECORD] for m in messages
                         if secagg.NEXT_RECORD in m.content.config_records}
            replies = super().send_and_receive(messages, timeout)
            for reply in replies:
                if (node := reply.metadata.src_node_id) in following:
                    self.states[node], keys = secagg.site_setup(node, following[node])
                    reply.content[secagg.RECORD].update({**keys, **tampered.get(node, {})})
            return replies

    vectors = _vectors(5, 40, seed=5)
    grid = PipelinedGrid(vectors)
    num_shares, threshold = secagg.protocol_parameters(5, max_dropouts=2, colluding=0)

    def secure(seed):
        return secagg.SecureSum(modulus=2 ** 40, num_shares=num_shares, threshold=threshold, dimension=40,
                                timeout=10.0, shuffle_seed=seed)

    first = secure(1).run(grid, sorted(vectors), setup={}, masked_content=lambda node: RecordDict(), group="1",
                          next_setup=secure(2).stage_zero({}))
    assert not first.failures and sorted(first.advertised) == sorted(vectors) and grid.setups == sorted(vectors)
    advertised = {node: keys for node, keys in first.advertised.items() if node != 5}
    second = secure(2).run(grid, sorted(vectors), setup={}, masked_content=lambda node: RecordDict(), group="2",
                           advertised=advertised)
    assert grid.setups == [*sorted(vectors), 5]
    assert [(stage, node) for stage, node, _ in second.failures] == [(secagg.SETUP, 2), (secagg.SETUP, 3)]
    assert second.included == [1, 4, 5] and not second.advertised
    assert np.array_equal(secagg.centred(second.total, 2 ** 40), vectors[1] + vectors[4] + vectors[5])
