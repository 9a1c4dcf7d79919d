"""What the server's aggregation gives each site, and what it tells about whom it left out.

* a site's weight (its agreed count) is capped at ``federation.max_weight_ratio`` x the round's median weight, and
  the capped site is flagged;
* the robust aggregators (median, trimmed mean, multi-krum) record each site's share left out, and flag a site
  left out in most of its rounds;
* krum does not freeze on a site that returns the global model unchanged;
* a run whose nodes do not say which site they are stops at once, naming them.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from simulations import engine
from strategies.horizontal import (
    SITE_KEY,
    WEIGHT_KEY,
    SurvivalFedAvg,
    TooFewSitesError,
    capped_weights,
    discard_limit,
    discarded_shares,
    make_aggregator,
    multikrum_selection,
    robust_trim,
)
from strategies.mechanisms.base import SiteSetUp
from strategies.mechanisms.registry import horizontal_mechanism


@pytest.fixture
def stamped(monkeypatch):
    """Messages are stamped with a run's identity (what a run sets)."""
    for name, value in (("_task_id", 1), ("_run_id", engine.new_run_id()), ("_node_id", engine.SUPERLINK_NODE_ID)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)


def _strategy(overrides: dict, counts: list[float]) -> SurvivalFedAvg:
    _, cfg = engine.resolve({"baseline.centralized": False, "federation.num_sites": len(counts), **overrides})
    federation = cfg.federation
    setups = {f"site-{i}": SiteSetUp(float(count), float(min(counts))) for i, count in enumerate(counts)}
    strategy = SurvivalFedAvg(
        mechanism=horizontal_mechanism(cfg.strategy), cfg=cfg, setups=setups, needs_baseline=False, timeout=5.0,
        aggregator=make_aggregator(federation.aggregation, trim_fraction=federation.trim_fraction,
                                   malicious=federation.max_malicious, sites=len(counts), weighted_by_key=WEIGHT_KEY),
        min_train_nodes=2)
    strategy.node_sites = {index + 1: site for index, site in enumerate(setups)}
    return strategy


def _model(vector: np.ndarray) -> ArrayRecord:
    """A model of two arrays (a weight matrix of 2 rows, a bias of 3) holding ``vector``."""
    return ArrayRecord({"w": Array(vector[:-3].reshape(2, -1).astype(np.float32)),
                        "b": Array(vector[-3:].astype(np.float32))})


def _flat(record: ArrayRecord) -> np.ndarray:
    return np.concatenate([record["w"].numpy().ravel(), record["b"].numpy().ravel()]).astype(np.float64)


def _replies(strategy: SurvivalFedAvg, models: list[np.ndarray]) -> list[Message]:
    """Each site's training reply (its model and its agreed count) to a train message of round 1."""
    replies = []
    for (node, site), vector in zip(sorted(strategy.node_sites.items()), models, strict=True):
        sent = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=node,
                       message_type="train")
        content = RecordDict({"arrays": _model(vector),
                              "metrics": MetricRecord({WEIGHT_KEY: strategy.setups[site].count, "train_loss": 1.0})})
        replies.append(Message(content, reply_to=sent))
    return replies


# ------------------------------------------------------------------ the weight cap

def test_capped_weights_hold_an_inflated_count_to_the_ratio_of_the_median():
    weights = np.array([100.0, 110.0, 120.0, 130.0, 100.0 * 12_000])
    capped = capped_weights(weights, 3.0)
    np.testing.assert_array_equal(capped, [100.0, 110.0, 120.0, 130.0, 360.0])  # median 120
    assert weights[-1] / weights.sum() > 0.99 and capped[-1] / capped.sum() < 0.45  # 360 / 820
    np.testing.assert_array_equal(capped_weights(weights, 0.0), weights)  # 0: no cap
    with_idle = capped_weights(np.array([0.0, 0.0, 0.0, 10.0, 10.0, 1000.0]), 2.0)  # 0 counts in no median
    np.testing.assert_array_equal(with_idle, [0.0, 0.0, 0.0, 10.0, 10.0, 20.0])
    even = np.array([10.0, 20.0, 30.0, 1000.0])
    np.testing.assert_array_equal(capped_weights(even, 1.0), [10.0, 20.0, 25.0, 25.0])


@pytest.mark.parametrize("ratio", [3.0, 0.0])
def test_an_inflated_count_is_capped_in_the_mean_and_flagged(stamped, ratio):
    """The server's mean weights by the capped counts (plain mean and centred clipping alike); the site is
    flagged, never failed. ``federation.max_weight_ratio = 0``: the agreed counts as they are."""
    from strategies.horizontal import centred_clip

    counts = [100.0, 100.0, 100.0, 100.0, 10_000.0]
    rng = np.random.default_rng(3)
    models = [rng.normal(size=9) for _ in counts]
    models[2] = models[2] * 1e3  # far: centred clipping bounds its pull
    matrix = np.stack([_flat(_model(model)) for model in models])
    weights = np.array(counts if ratio == 0 else [100.0] * 4 + [300.0])
    weights = weights / weights.sum()
    for bound, expected in ((0.0, weights @ matrix), (5.0, centred_clip(matrix, weights, 5.0)[0])):
        strategy = _strategy({"federation.max_weight_ratio": ratio, "federation.update_bound": bound}, counts)
        strategy.global_arrays = _model(np.zeros(9))
        accepted = strategy.screen_train(1, _replies(strategy, models))
        aggregated, _ = strategy.aggregate_train(1, accepted)
        np.testing.assert_allclose(_flat(aggregated), expected, rtol=1e-5, atol=1e-6)
        record = strategy.rounds[1]
        assert record.failures == []
        assert list(record.train_flags) == (["site-2"] if bound else [])
        if ratio:
            assert list(record.weight_flags) == ["site-4"]
            assert "100 x the median" in record.weight_flags["site-4"]
            assert "federation.max_weight_ratio" in record.weight_flags["site-4"]
        else:
            assert record.weight_flags == {}


def test_the_default_bound_cuts_honest_pulls_but_names_only_a_site_beyond_five_median_distances(stamped):
    """At the default bound (1 x the median distance) about half of 5 honest-looking updates are bounded and the
    mean is not the plain one, yet no site is flagged; a sixth update 20 x as far is bounded and flagged."""
    from strategies.horizontal import centred_clip

    rng = np.random.default_rng(4)
    models = [rng.normal(size=9) for _ in range(5)]
    matrix = np.stack([_flat(_model(model)) for model in models])
    weights = np.full(5, 0.2)
    strategy = _strategy({}, [100.0] * 5)
    strategy.global_arrays = _model(np.zeros(9))
    aggregated, _ = strategy.aggregate_train(1, strategy.screen_train(1, _replies(strategy, models)))
    _, scale, spread = centred_clip(matrix, weights, 1.0)
    assert np.sum(scale < 1.0) >= 2 and np.all(spread < 5.0)
    np.testing.assert_allclose(_flat(aggregated), centred_clip(matrix, weights, 1.0)[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(_flat(aggregated), weights @ matrix, rtol=1e-3)
    assert strategy.rounds[1].train_flags == {}

    far = _strategy({}, [100.0] * 6)
    far.global_arrays = _model(np.zeros(9))
    far.aggregate_train(1, far.screen_train(1, _replies(far, [*models, 20 * models[0] + 20])))
    assert list(far.rounds[1].train_flags) == ["site-5"]
    assert "beyond 5 x" in far.rounds[1].train_flags["site-5"]


def test_a_negative_weight_ratio_is_refused_naming_the_key():
    from strategies.config import ConfigError

    with pytest.raises(ConfigError, match="federation.max_weight_ratio") as err:
        engine.resolve({"federation.max_weight_ratio": -1})
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ what the robust aggregators leave out

def _brute_force_shares(matrix: np.ndarray, trim: int) -> np.ndarray:
    k = matrix.shape[0]
    out = np.zeros(k)
    for column in matrix.T:
        ordered = sorted(column)
        low, high = ordered[trim], ordered[k - 1 - trim]
        out += [(value < low or value > high) for value in column]
    return out / matrix.shape[1]


def test_discarded_shares_name_the_values_cut_by_the_median_and_the_trimmed_mean():
    matrix = np.array([[0.0, 5.0, 1.0, 2.0],
                       [1.0, 4.0, 1.0, 3.0],
                       [2.0, 3.0, 1.0, 1.0],
                       [3.0, 2.0, 0.0, 0.0],
                       [9.0, 9.0, 9.0, 9.0]])  # row 4 is the largest value of every coordinate
    # median (trim 2 of 5): the medians are 2, 4, 1, 2 (the three 1.0s of column 2 all count as the median): rows 0,
    # 1 and 2 are the median twice each, rows 3 and 4 never
    np.testing.assert_array_equal(discarded_shares(matrix, 2), [2 / 4, 2 / 4, 2 / 4, 1.0, 1.0])
    # trimmed mean cutting 1 a tail: row 4 always (the maximum); the minimum row 0 at column 0, row 3 at columns 1-3
    np.testing.assert_array_equal(discarded_shares(matrix, 1), [1 / 4, 0.0, 0.0, 3 / 4, 1.0])
    np.testing.assert_array_equal(discarded_shares(matrix, 0), np.zeros(5))
    # even k: the median keeps the middle pair
    np.testing.assert_array_equal(discarded_shares(matrix[:4], robust_trim("median", sites=4, trim_fraction=0.2)),
                                  _brute_force_shares(matrix[:4], 1))
    rng = np.random.default_rng(0)
    wide = np.round(rng.normal(size=(7, 700)), 1)  # several column blocks, with ties
    for trim in (0, 1, 2, 3):
        np.testing.assert_array_equal(discarded_shares(wide, trim), _brute_force_shares(wide, trim))
    assert robust_trim("trimmed_mean", sites=7, trim_fraction=0.2) == 1
    assert robust_trim("median", sites=7, trim_fraction=0.2) == 3
    assert discard_limit(5, 4) == pytest.approx(0.9) and discard_limit(5, 1) == pytest.approx(0.6)


def test_multikrum_selection_is_flowers_and_krum_alone_picks_a_free_rider():
    from flwr.serverapp.strategy.multikrum import select_multikrum

    rng = np.random.default_rng(1)
    current = rng.normal(size=9)
    deltas = [np.eye(9)[i] * (1.0 + 0.1 * i) for i in range(4)]  # honest updates in different directions
    models = [current, *(current + delta for delta in deltas)]  # row 0: the global model unchanged
    matrix = np.stack([_flat(_model(model)) for model in models]).astype(np.float32)
    contents = [RecordDict({"arrays": _model(model)}) for model in models]
    for malicious, keep in ((1, 1), (1, 4), (0, 3), (2, 1)):
        ours = multikrum_selection(matrix, malicious, keep)
        theirs = select_multikrum(contents, num_malicious_nodes=malicious, num_nodes_to_select=keep)
        assert [contents[index] for index in ours] == theirs
    assert list(multikrum_selection(matrix, 1, 1)) == [0]  # krum's score favours the update of 0
    noisy = np.stack([_flat(_model(rng.normal(size=9))) for _ in range(7)]).astype(np.float32)
    noisy[2] *= 40
    contents = [RecordDict({"arrays": _model(row.astype(np.float64))}) for row in noisy]
    ours = multikrum_selection(noisy, 2, 5)
    assert 2 not in ours
    assert [contents[i] for i in ours] == select_multikrum(contents, num_malicious_nodes=2, num_nodes_to_select=5)


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean", "krum"])
def test_a_far_site_is_recorded_as_left_out_and_flagged_from_its_second_round(stamped, aggregation):
    counts = [100.0] * 5
    rng = np.random.default_rng(2)
    strategy = _strategy({"federation.aggregation": aggregation}, counts)
    for server_round in (1, 2, 3):
        strategy.global_arrays = _model(np.zeros(203))
        models = [rng.normal(scale=0.1, size=203) for _ in counts]
        models[3] = models[3] + 50.0  # site-3 far from the others in every coordinate
        accepted = strategy.screen_train(server_round, _replies(strategy, models))
        aggregated, _ = strategy.aggregate_train(server_round, accepted)
        record = strategy.rounds[server_round]
        assert record.discarded["site-3"] == 1.0 and record.discarded_most == ["site-3"]
        assert all(share < 1.0 for site, share in record.discarded.items() if site != "site-3")
        assert np.abs(_flat(aggregated)).max() < 1.0  # site-3 is not in the aggregate
        assert record.failures == []
        if server_round == 1:
            assert record.aggregate_flags == {}
        else:
            assert list(record.aggregate_flags) == ["site-3"]
            assert f"in {server_round} of the {server_round} rounds it took part in" in record.aggregate_flags["site-3"]


def test_krum_averages_the_best_updates_and_leaves_a_free_rider_out(stamped):
    """Multi-krum averages the n - f best-scored updates; an update that is the global model is no candidate (and
    counts as one of the f tolerated sites), so the model moves by the honest sites' mean."""
    counts = [100.0, 200.0, 100.0, 100.0, 100.0]
    current = np.linspace(-1.0, 1.0, 9)
    strategy = _strategy({"federation.aggregation": "krum"}, counts)
    strategy.global_arrays = _model(current)
    rng = np.random.default_rng(4)
    models = [current + rng.normal(scale=0.05, size=9) for _ in counts]
    models[1] = _flat(_model(current))  # site-1 sends the global model back
    aggregated, _ = strategy.aggregate_train(1, strategy.screen_train(1, _replies(strategy, models)))
    honest = [0, 2, 3, 4]
    expected = np.mean([_flat(_model(models[i])) for i in honest], axis=0)
    np.testing.assert_allclose(_flat(aggregated), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(_flat(aggregated), _flat(_model(current)))
    record = strategy.rounds[1]
    assert record.discarded == {"site-0": 0.0, "site-1": 1.0, "site-2": 0.0, "site-3": 0.0, "site-4": 0.0}
    assert record.discarded_most == ["site-1"]


def free_rider(message: Message, reply: Message) -> Message:
    """The in-process grid's ``transform``: site-1's training reply carries the global model it was sent, in every
    round."""
    if message.metadata.message_type == "train" and not reply.has_error() and \
            str(reply.content[SITE_KEY]["name"]) == "site-1":
        reply.content["arrays"] = message.content["arrays"]
    return reply


def _models_sent(tmp_path, overrides: dict, transform=None) -> dict[int, np.ndarray]:
    """Run ``overrides`` in process (the sites' replies through ``transform``); the global model each round's training
    message carried to node 1."""
    sent: dict[int, np.ndarray] = {}

    def observe(message, reply):
        if message.metadata.message_type == "train" and message.metadata.dst_node_id == 1:
            arrays = message.content["arrays"]
            sent[int(message.content["config"]["server-round"])] = np.concatenate(
                [array.numpy().ravel() for array in arrays.values()])

    engine.run_inprocess({"baseline.centralized": False, "output.dir": str(tmp_path), **overrides}, observe=observe,
                         transform=transform)
    return sent


def test_a_free_rider_does_not_freeze_krum_with_none_left_to_tolerate(tmp_path):
    """3 sites, krum with max_malicious = 0, site-1 a free rider: set aside, it leaves 2 candidates, which krum with
    nothing to tolerate averages (it used to need 3 and kept the model where it was)."""
    sent = _models_sent(tmp_path, {"federation.num_sites": 3, "federation.rounds": 3, "federation.aggregation": "krum",
                                   "federation.max_malicious": 0}, free_rider)
    assert sorted(sent) == [1, 2, 3]
    assert all(not np.array_equal(sent[number], sent[number - 1]) for number in (2, 3))


def test_a_free_rider_does_not_freeze_krum_in_a_run(tmp_path, capsys):
    """5 sites, krum, site-1 returns the global model it was sent: the model changes every round, site-1 is left
    out every round and flagged (phase ``aggregate``) from round 2 on, in metrics.jsonl and on the console."""
    rounds = 4
    sent = _models_sent(tmp_path, {"federation.num_sites": 5, "federation.rounds": rounds,
                                   "federation.aggregation": "krum"}, free_rider)
    assert sorted(sent) == list(range(1, rounds + 1))
    for server_round in range(2, rounds + 1):
        assert not np.array_equal(sent[server_round], sent[server_round - 1]), server_round
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    for line in lines:
        assert line["failures"] == []
        assert line["discarded"]["site-1"] == 1.0
        aggregate = [(f["phase"], f["site"]) for f in line["flags"] if f["phase"] == "aggregate"]
        assert aggregate == ([] if line["round"] == 1 else [("aggregate", "site-1")])
    console = capsys.readouterr().out
    assert "site-1 (aggregate)" in console


# ------------------------------------------------------------------ a naming step nobody answers

def test_a_run_whose_sites_do_not_say_who_they_are_stops_at_once_naming_them(tmp_path, monkeypatch):
    """4 of 5 nodes never answer the naming query (federation.min_sites = 2): the run stops right after the
    naming step's timeout with one line naming each silent node and the timeout, and sends no further message."""
    from strategies.horizontal import SITE_NAME_QUERY

    asked: list[str] = []  # the messages the server sends, from the naming query on

    class SilentGrid(engine.InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type == SITE_NAME_QUERY:
                asked.append(SITE_NAME_QUERY)
                time.sleep(timeout)  # the other nodes never answer
                messages = [message for message in messages if message.metadata.dst_node_id == 1]
            elif asked:
                asked.extend(message.metadata.message_type for message in messages)
            return super().send_and_receive(messages, timeout=timeout)

    monkeypatch.setattr(engine, "InProcessGrid", SilentGrid)
    timeout = 2.0
    started = time.monotonic()
    with pytest.raises(TooFewSitesError) as err:
        engine.run_inprocess({"federation.num_sites": 5, "federation.rounds": 2, "federation.timeout_s": timeout,
                              "baseline.centralized": False, "output.dir": str(tmp_path)})
    assert time.monotonic() - started < timeout + 10
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("1 of 5 nodes said which site they are within federation.timeout_s = 2 s, fewer than the "
                           "2 sites a round needs (federation.min_sites = 2)")
    for node in (2, 3, 4, 5):
        assert f"node {node} did not say which site it is within 2 s" in text
    assert "node 1 " not in text
    assert asked == [SITE_NAME_QUERY]
