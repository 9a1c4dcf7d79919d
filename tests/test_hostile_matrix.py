"""The hostile-site benchmark's attacks, each applied to a constructed round of training replies."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from benchmarks import hostile_matrix as hm
from simulations import engine
from strategies.config import DEFAULT_UPDATE_BOUND
from strategies.horizontal import centred_clip, robust_refusal

SHAPES = {"layer.weight": (6, 4), "layer.bias": (6,)}


@pytest.fixture
def identity(monkeypatch):
    for name, value in (("_task_id", 1), ("_run_id", engine.new_run_id()), ("_node_id", engine.SUPERLINK_NODE_ID)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)  # messages are stamped with them


def _record(vector: np.ndarray) -> ArrayRecord:
    return hm.as_record(vector, ArrayRecord({key: Array(np.zeros(shape, np.float32)) for key, shape in SHAPES.items()}))


def _round(sites: int, *, same_global: bool = True, seed: int = 0):
    """A round of ``sites`` training replies: node i + 1 was sent g_i (all the same unless ``same_global``) and
    replies g_i + a shared drift + its own noise. Returns the replies, the sent arrays by message ID, and the g's
    and updates (float32-exact) by node."""
    rng = np.random.default_rng(seed)
    size = sum(int(np.prod(shape)) for shape in SHAPES.values())
    drift, common = rng.normal(0, 0.1, size), rng.normal(0, 1, size)
    replies, sent, truth = [], {}, {}
    for node in range(1, sites + 1):
        base = hm.as_vector(_record(common if same_global else rng.normal(0, 1, size)))
        weights = hm.as_vector(_record(base + drift + rng.normal(0, 0.05, size)))
        message = Message(RecordDict({"arrays": _record(base), "config": ConfigRecord({})}), node, "train")
        message.metadata.__dict__["_message_id"] = f"message-{node}"  # as the grid gives it
        sent[message.metadata.message_id] = message.content["arrays"]
        replies.append(Message(RecordDict({"arrays": _record(weights)}), reply_to=message))
        truth[node] = (base, weights - base)
    return replies, sent, truth


def _sent_weights(replies: list[Message]) -> dict[int, np.ndarray]:
    return {reply.metadata.src_node_id: hm.as_vector(reply.content["arrays"]) for reply in replies}


def test_the_sign_flipped_update_is_g_minus_5_delta_from_the_global_model_its_message_carried(identity):
    replies, sent, truth = _round(5, same_global=False)
    out = _sent_weights(hm.make_tamper("sign_flip_x5", 5)(replies, sent, {}))
    base, update = truth[hm.HOSTILE_NODE]
    np.testing.assert_allclose(out[hm.HOSTILE_NODE], base - 5.0 * update, rtol=1e-6, atol=1e-6)
    for node in (1, 3, 4, 5):
        np.testing.assert_array_equal(out[node], truth[node][0] + truth[node][1])


def test_the_scaled_update_is_g_plus_1e6_delta_and_finite(identity):
    replies, sent, truth = _round(3)
    out = _sent_weights(hm.make_tamper("scale_1e6", 3)(replies, sent, {}))
    base, update = truth[hm.HOSTILE_NODE]
    assert np.all(np.isfinite(out[hm.HOSTILE_NODE]))
    np.testing.assert_allclose(out[hm.HOSTILE_NODE], base + 1e6 * update, rtol=1e-6)


def test_the_coalition_is_a_minority_of_the_sizes_the_brief_names():
    assert [hm.coalition_size(sites) for sites in (3, 5, 10)] == [1, 2, 3]
    assert hm.attacker_nodes("collude_x3", 10) == [2, 3, 4]
    assert hm.attacker_nodes("sign_flip_x5", 10) == [2] and hm.attacker_nodes("clean", 10) == []


def test_the_colluders_each_send_g_minus_3_times_the_honest_mean_update(identity):
    replies, sent, truth = _round(5)
    out = _sent_weights(hm.make_tamper("collude_x3", 5)(replies, sent, {}))
    honest = np.mean([truth[node][1] for node in (1, 4, 5)], axis=0)
    for node in (2, 3):
        np.testing.assert_allclose(out[node], truth[node][0] - 3.0 * honest, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[1], truth[1][0] + truth[1][1])


@pytest.mark.parametrize(("attack", "sites"), [("adaptive_inside", 5), ("adaptive_inside", 10),
                                               ("adaptive_spread15", 5)])
def test_the_adaptive_coalition_stands_where_centred_clipping_measures_it(identity, attack, sites):
    """Measured as the server does on the tampered replies: the colluders' distance from the coordinate-wise median
    of all updates is 0.98 x update_bound (or 15) x the median distance, on the line of the honest mean update and
    as far against it as that allows (at the default bound of 1, not even a zero update stands inside: the coalition
    then leans with the honest mean); inside the bound they are not clipped, at 15 they are."""
    replies, sent, truth = _round(sites)
    out = _sent_weights(hm.make_tamper(attack, sites)(replies, sent, {}))
    rows = np.array([out[node] for node in sorted(out)])
    _, scale, spread = centred_clip(rows, np.full(sites, 1.0 / sites), DEFAULT_UPDATE_BOUND)
    target = 0.98 * DEFAULT_UPDATE_BOUND if attack == "adaptive_inside" else 15.0
    coalition = [node - 1 for node in hm.attacker_nodes(attack, sites)]
    np.testing.assert_allclose(spread[coalition], target, rtol=1e-5)
    assert np.all(scale[coalition] == 1.0) if attack == "adaptive_inside" else np.all(scale[coalition] < 1.0)
    honest = np.mean([truth[node][1] for node in truth if node - 1 not in coalition], axis=0)
    update = out[coalition[0] + 1] - truth[coalition[0] + 1][0]
    assert abs(update @ honest / (np.linalg.norm(update) * np.linalg.norm(honest))) > 0.999999
    further = np.array([out[node] if node - 1 not in coalition else out[node] - 1e-3 * honest for node in sorted(out)])
    assert np.all(centred_clip(further, np.full(sites, 1.0 / sites), DEFAULT_UPDATE_BOUND)[2][coalition] > target)


def test_the_free_rider_returns_exactly_the_global_model(identity):
    replies, sent, truth = _round(5, same_global=False)
    out = _sent_weights(hm.make_tamper("free_rider", 5)(replies, sent, {}))
    np.testing.assert_array_equal(out[hm.HOSTILE_NODE], truth[hm.HOSTILE_NODE][0])
    assert not np.array_equal(out[1], truth[1][0])


def test_the_hook_passes_the_train_replies_and_the_arrays_of_the_messages_they_answer(identity, monkeypatch):
    replies, sent, _ = _round(3)
    messages = [Message(RecordDict({"arrays": sent[f"message-{node}"]}), node, "train") for node in (1, 2, 3)]

    def grid_reply(grid, batch, *, timeout=None):
        for node, message in enumerate(batch, start=1):
            message.metadata.__dict__["_message_id"] = f"message-{node}"
        return replies

    monkeypatch.setattr(engine.InProcessGrid, "send_and_receive", grid_reply)
    seen = []
    with hm.tampered_training(lambda got, arrays, memory: seen.append((got, arrays)) or got[:1]) as counts:
        assert engine.InProcessGrid.send_and_receive(None, messages) == replies[:1]
        evaluation = [Message(RecordDict({"arrays": sent["message-1"]}), 1, "evaluate")]
        assert engine.InProcessGrid.send_and_receive(None, evaluation) == replies
        assert counts == {"rounds": 1, "unmoved": 1}  # evaluated on the model its training was sent
        engine.InProcessGrid.send_and_receive(None, messages)
        moved = [Message(RecordDict({"arrays": replies[0].content["arrays"]}), 1, "evaluate")]
        engine.InProcessGrid.send_and_receive(None, moved)
    assert counts == {"rounds": 2, "unmoved": 1}
    assert len(seen) == 2 and seen[0][0] == replies
    assert seen[0][1] == {f"message-{node}": sent[f"message-{node}"] for node in (1, 2, 3)}
    assert engine.InProcessGrid.send_and_receive is grid_reply


def test_label_flipping_inverts_the_events_and_reverses_the_order_of_the_times():
    frame = pd.DataFrame({"age": [50, 60, 70, 80], "futime": [10.0, 400.0, 30.0, 2000.0], "death": [1, 0, 0, 1]})
    flipped = hm.flipped_labels(frame)
    assert flipped["death"].tolist() == [0, 1, 1, 0] and flipped["age"].tolist() == frame["age"].tolist()
    assert (flipped["futime"].min(), flipped["futime"].max()) == (10.0, 2000.0)
    assert np.argsort(flipped["futime"]).tolist() == np.argsort(-frame["futime"]).tolist()


@pytest.mark.parametrize("sites", [3, 5, 10])
@pytest.mark.parametrize("aggregation", ["fedavg", "median", "trimmed_mean", "krum"])
def test_every_aggregation_is_configured_to_run_at_every_size(aggregation, sites):
    keys = hm.aggregation_keys(aggregation, sites)
    engine.resolve({**hm.RUN, **keys, "federation.num_sites": sites})  # raises on a refused combination
    assert not robust_refusal(aggregation, trim_fraction=keys.get("federation.trim_fraction", 0.2),
                              malicious=keys.get("federation.max_malicious", 1), sites=sites)


def test_the_table_measures_each_attack_against_its_own_clean_run_of_the_same_seed():
    rows = [{"sites": 5, "aggregation": "median", "seed": seed, "attack": attack, "attackers": attackers,
             "finished": True, "named": named, "c_index": c}
            for seed, attack, attackers, named, c in [
                (0, "clean", [], [], 0.80), (1, "clean", [], [], 0.70),
                (0, "clean_site_files", [], [], 0.60),
                (0, "sign_flip_x5", ["site-1"], ["site-1"], 0.75), (1, "sign_flip_x5", ["site-1"], ["site-3"], 0.55),
                (0, "label_flip", ["site-1"], [], 0.50)]]
    rows[3]["named_for"] = {"site-1": ["flag:train"]}
    rows[4].update({"named_for": {"site-3": ["flag:evaluate"]}, "rounds": 3, "unmoved": 2})
    lines = {line.split(" | ")[1]: line for line in hm.table(rows).splitlines()[2:]}
    assert "-0.100 ± 0.071 · 1/2 (flag:train) · 1/2 · unmoved 2/3 rounds" in lines["sign_flip_x5"]  # -0.05, -0.15
    assert "-0.100 · 0/1 · 0/1" in lines["label_flip"]
