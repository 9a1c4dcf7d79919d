"""A hostile or buggy site (``debug.fail_mode``) cannot take the federation down or decide its result.

Each run uses the in-process engine (the real ServerApp and ClientApp): site-1 sends a tampered
reply from round 1 on; the run must finish, name site-1 in every round's failures, keep the
ledger valid JSON, and end with a global model whose pooled test C-index (FLCHAIN, server-side
evaluation) is within 0.01 of the clean run's.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from simulations.engine import run_inprocess

SMALL = {"federation.num_sites": 3, "federation.rounds": 3, "baseline.centralized": False,
         "debug.fail_site": "site-1", "debug.fail_round": 1}
DP_SGD = {"strategy.name": "dp_sgd", "privacy.epsilon": 5.0}
MODES = {  # mode -> (strategy overrides, the phase whose reply is refused, words of the reason)
    "nan_weights": ({}, "train", "non-finite value"),
    "wrong_shape": ({}, "train", "has shape"),
    "inflated_count": ({}, "train", "num-examples = 1e+12"),
    "spoofed_name": ({}, "train", "claims to come from site 'site-0'"),
    "forged_metrics": ({"evaluation.screen": True}, "evaluate", "implausible test metrics"),
    "forged_epsilon": (DP_SGD, "train", "epsilon = 1e-09 does not match"),
}


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The clean runs (no hostile site) the hostile ones are compared with, by strategy."""
    runs = {}
    for name, overrides in (("fedavg", {}), ("dp_sgd", DP_SGD)):
        out = tmp_path_factory.mktemp(f"clean-{name}")
        runs[name] = run_inprocess({**SMALL, **overrides, "debug.fail_site": "", "output.dir": str(out)})
    return runs


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_hostile_site_is_named_and_the_model_is_unharmed(tmp_path, clean, mode):
    overrides, phase, words = MODES[mode]
    summary = run_inprocess({**SMALL, **overrides, "debug.fail_mode": mode, "output.dir": str(tmp_path)})
    metrics = _lines(tmp_path / "metrics.jsonl")
    assert [line["round"] for line in metrics] == [1, 2, 3]
    for line in metrics:
        assert [(f["phase"], f["site"]) for f in line["failures"]] == [(phase, "site-1")], line["failures"]
        assert words in line["failures"][0]["reason"]
    private = overrides.get("strategy.name") == "dp_sgd"
    reference = clean["dp_sgd" if private else "fedavg"]
    assert abs(summary["test"]["c_index"] - reference["test"]["c_index"]) < 0.01
    # the ledger is strict JSON (no NaN) and its epsilons are the server's, not the forged ones
    text = (tmp_path / "ledger.jsonl").read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    if private:
        assert summary["privacy"]["epsilon"] == pytest.approx(reference["privacy"]["epsilon"])
    if phase == "evaluate":  # the forged figures are left out of the sites' mean
        assert "site-1" not in summary["sites"]


def test_unusual_test_metrics_are_flagged_and_kept_unless_screening_is_asked_for(tmp_path):
    """Heterogeneity is not a failure: by default a site whose figures stand far outside the others' is flagged
    in metrics.jsonl, on the console and in summary.json, kept in the sites' mean, and named in no failure."""
    summary = run_inprocess({**SMALL, "debug.fail_mode": "forged_metrics", "output.dir": str(tmp_path)})
    for line in _lines(tmp_path / "metrics.jsonl"):
        assert line["failures"] == []
        assert [(f["phase"], f["site"]) for f in line["flags"]] == [("evaluate", "site-1")]
        assert line["flags"][0]["reason"].startswith("unusual test metrics: ")
        assert "site-1" in line["sites"]
    assert summary["sites"]["site-1"]["flag"].startswith("unusual test metrics: ")
    assert set(summary["sites"]) == {"site-0", "site-1", "site-2"}
    weights = {site: metrics["num-examples"] for site, metrics in summary["sites"].items()}
    expected = sum(weights[site] * summary["sites"][site]["c_index"] for site in weights) / sum(weights.values())
    assert summary["sites_mean"]["c_index"] == pytest.approx(expected)


@pytest.mark.parametrize("scale", [-10.0, 1e3, 1e6, -5.0])
def test_a_well_formed_scaled_update_is_bounded_by_default_and_decides_the_plain_mean(tmp_path, clean, scale):
    """A finite, well-formed update (every weight times ``scale``) passes every check. The default mean bounds its
    pull from the coordinate-wise median (the site is flagged, the model is unharmed); the plain mean
    (``federation.update_bound=0``) takes it in; Flower's coordinate-wise median keeps it out too."""
    poisoned = {**SMALL, "debug.fail_mode": "poisoned_update", "debug.fail_scale": scale}
    bounded = run_inprocess({**poisoned, "output.dir": str(tmp_path / "bounded")})
    clean_c = clean["fedavg"]["test"]["c_index"]
    assert abs(bounded["test"]["c_index"] - clean_c) < 0.01
    for line in _lines(tmp_path / "bounded" / "metrics.jsonl"):
        assert not line["failures"]
        assert [(f["phase"], f["site"]) for f in line["flags"]] == [("train", "site-1")], line["flags"]
        assert line["update_spread"]["site-1"] > 5 >= max(line["update_spread"][s] for s in ("site-0", "site-2"))
    if scale == -10.0:
        mean = run_inprocess({**poisoned, "federation.update_bound": 0, "output.dir": str(tmp_path / "mean")})
        assert all(not line["flags"] for line in _lines(tmp_path / "mean" / "metrics.jsonl"))
        assert mean["test"]["c_index"] < clean_c - 0.05
        median = run_inprocess({**poisoned, "federation.aggregation": "median",
                                "output.dir": str(tmp_path / "median")})
        assert abs(median["test"]["c_index"] - clean_c) < 0.02


def _split_step_replies(change):
    """The in-process grid's ``transform`` that replaces each split-learning step reply by what ``change(modality,
    reply, request)`` returns (a :class:`~strategies.split.SiteReply`) for the decoded reply and request."""
    from flwr_app import split_messages as wire

    def transform(message, reply):
        if message.metadata.message_type != wire.STEP or reply.has_error():
            return reply
        modality, site_reply = wire.decode_reply(reply.content)
        reply.content = wire.encode_reply(modality, change(modality, site_reply, wire.decode_request(message.content)))
        return reply

    return transform


def test_a_split_site_whose_embeddings_are_not_finite_stops_the_run_naming_it(tmp_path):
    """Split learning needs every site for every batch: a refused reply stops the run, naming the site and why."""
    from strategies.split import SplitSiteError

    def corrupt(modality, reply, request):
        if modality == "b" and request.forward_ids is not None and request.forward_step >= 2:
            embeddings = reply.embeddings.copy()
            embeddings[0, 0] = float("nan")
            return dataclasses.replace(reply, embeddings=embeddings)
        return reply

    vertical = {"strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 200,
                "model.name": "bayesian_multisurv", "model.num_durations": 8, "train.batch_size": 64,
                "split.embedding_dim": 8, "split.encoder_layers": 1, "split.head_layers": 1, "split.mc_samples": 2,
                "federation.rounds": 2, "privacy.epsilon": 8.0, "baseline.centralized": False}
    with pytest.raises(SplitSiteError, match=r"site 'b' \(node \d+\) sent a refused train\.split_step reply: "
                                             r"embeddings are not finite"):
        run_inprocess({**vertical, "output.dir": str(tmp_path)}, transform=_split_step_replies(corrupt))


def test_a_split_site_that_under_reports_its_releases_is_refused(tmp_path):
    """The label holder counts the releases it asked each site for: a privacy report that claims fewer is refused."""
    from strategies.split import SplitSiteError

    def under_report(modality, reply, request):
        return dataclasses.replace(reply, privacy={**reply.privacy, "releases_max": 0.0}) if modality == "a" else reply

    vertical = {"strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 200,
                "model.name": "bayesian_multisurv", "model.num_durations": 8, "train.batch_size": 64,
                "split.embedding_dim": 8, "split.encoder_layers": 1, "split.head_layers": 1, "split.mc_samples": 2,
                "federation.rounds": 2, "privacy.epsilon": 8.0, "baseline.centralized": False}
    with pytest.raises(SplitSiteError, match=r"site 'a' \(node \d+\) sent a refused train\.split_step reply: the "
                                             r"privacy report counts 0\.0 releases"):
        run_inprocess({**vertical, "output.dir": str(tmp_path)}, transform=_split_step_replies(under_report))


def test_robust_aggregators_are_refused_below_the_sites_they_need():
    """trimmed_mean must trim at least one site at each tail, krum needs 2f + 3 sites, the median 3."""
    from strategies.config import ConfigError
    from strategies.horizontal import make_aggregator, robust_minimum

    assert robust_minimum("trimmed_mean", trim_fraction=0.2, malicious=1) == 5
    assert robust_minimum("trimmed_mean", trim_fraction=0.34, malicious=1) == 3
    assert robust_minimum("krum", trim_fraction=0.2, malicious=1) == 5
    assert make_aggregator("trimmed_mean", trim_fraction=0.2, malicious=1, sites=5) is not None
    with pytest.raises(ConfigError, match=r"trims int\(0.2 x 3\) = 0 .* at least 5 sites .*trim_fraction >= 0.333"):
        make_aggregator("trimmed_mean", trim_fraction=0.2, malicious=1, sites=3)
    with pytest.raises(ConfigError, match=r"max_malicious = 1 needs at least 2 x 1 \+ 3 = 5 sites a round; 3 take"):
        make_aggregator("krum", trim_fraction=0.2, malicious=1, sites=3)
    with pytest.raises(ConfigError, match="'median' needs at least 3 sites"):
        make_aggregator("median", trim_fraction=0.2, malicious=1, sites=2)


def test_trimmed_mean_that_trims_nothing_is_refused_before_the_set_up_and_one_that_trims_keeps_the_model(
        tmp_path, clean):
    from strategies.config import ConfigError

    poisoned = {**SMALL, "debug.fail_mode": "poisoned_update", "federation.aggregation": "trimmed_mean"}
    with pytest.raises(ConfigError, match="federation.trim_fraction = 0.2 trims"):
        run_inprocess({**poisoned, "output.dir": str(tmp_path / "refused")})
    assert not (tmp_path / "refused" / "ledger.jsonl").exists()
    trimmed = run_inprocess({**poisoned, "federation.trim_fraction": 0.34, "output.dir": str(tmp_path / "trimmed")})
    assert abs(trimmed["test"]["c_index"] - clean["fedavg"]["test"]["c_index"]) < 0.02


def test_refusal_texts_are_bounded_and_a_flood_of_metric_keys_is_refused_by_count(tmp_path):
    """A reply with 10^4 metric keys is refused by its count; no failure reason exceeds 1,000 characters."""
    from strategies.horizontal import MAX_REASON_CHARS, SITE_KEY, failure
    from strategies.replies import check_arrays

    assert len(failure("train", "site-0", 1, "x" * 10**6)["reason"]) <= MAX_REASON_CHARS
    reference = {"w": np.zeros(2, dtype=np.float32)}
    flood = {**reference, **{f"extra.{i}": np.zeros(1, dtype=np.float32) for i in range(10**4)}}
    reason = check_arrays(reference, flood)
    assert reason.startswith("model update has other parameters than the global model: unexpected 10000: ")
    assert len(reason) < 1000

    def flooded(message, reply):  # site-1's test metrics gain 10^4 keys
        if message.metadata.message_type == "evaluate" and not reply.has_error() and \
                str(reply.content[SITE_KEY]["name"]) == "site-1":
            reply.content["metrics"].update({f"k{i}": 0.0 for i in range(10**4)})
        return reply

    cfg = {**SMALL, "debug.fail_site": "", "federation.rounds": 1}
    summary = run_inprocess({**cfg, "output.dir": str(tmp_path)}, transform=flooded)
    (line,) = _lines(tmp_path / "metrics.jsonl")
    assert [(f["phase"], f["site"]) for f in line["failures"]] == [("evaluate", "site-1")], line["failures"]
    assert line["failures"][0]["reason"].endswith("keys; at most 64 are read")
    assert len((tmp_path / "metrics.jsonl").read_text(encoding="utf-8")) < 50_000
    assert "site-1" not in summary["sites"]


@pytest.mark.parametrize("tamper", ["duplicate", "relabelled", "heavy", "stale"])
def test_a_duplicate_relabelled_heavy_or_replayed_reply_is_refused_under_the_node_it_answers(
        tmp_path, clean, monkeypatch, tamper):
    """site-1 (node 2) answers its training message twice, or its reply comes back labelled as node 1 (site-0), or
    it carries 3 MB of padding, or from round 2 on it sends its round-1 update again: the reply is refused and filed
    under site-1, the node the message went to (the heavy one by its size, unread); no honest site is named."""
    from flwr.app import ConfigRecord

    from simulations import engine

    original = engine.InProcessGrid.send_and_receive
    stale = {}

    def tampered(grid, messages, *, timeout=None):
        messages = list(messages)
        replies = list(original(grid, messages, timeout=timeout))
        if messages and messages[0].metadata.message_type == "train":
            hostile = [reply for reply in replies if reply.metadata.src_node_id == 2]
            if tamper == "duplicate":
                replies += hostile
            elif tamper == "heavy":
                hostile[0].content["padding"] = ConfigRecord({"x": "x" * 3_000_000})
            elif tamper == "stale":
                first = stale.setdefault("arrays", hostile[0].content["arrays"])
                hostile[0].content["arrays"] = first
            else:
                hostile[0].metadata.__dict__["_src_node_id"] = 1
        return replies

    monkeypatch.setattr(engine.InProcessGrid, "send_and_receive", tampered)
    summary = run_inprocess({**SMALL, "debug.fail_site": "", "output.dir": str(tmp_path)})
    words = {"duplicate": "2 replies to one message", "relabelled": "labelled as node 1",
             "heavy": "bytes, more than the", "stale": "bit for bit the one it sent in round 1"}[tamper]
    for line in _lines(tmp_path / "metrics.jsonl"):
        if tamper == "stale" and line["round"] == 1:
            assert line["failures"] == []
            continue
        assert [(f["phase"], f["site"]) for f in line["failures"]] == [("train", "site-1")], line["failures"]
        assert words in line["failures"][0]["reason"]
    assert abs(summary["test"]["c_index"] - clean["fedavg"]["test"]["c_index"]) < 0.01


def test_a_site_whose_training_replies_are_lost_is_named_each_round_and_a_broken_transform_fails_the_run(tmp_path):
    """The grid's ``transform`` drops site-1's (node 2's) training replies: each round names site-1 alone, as a site
    that did not answer, and the run finishes; a transform that raises anything else stops the run, naming its error."""
    from simulations.inprocess import DropReply

    def lost(message, reply):
        if message.metadata.message_type == "train" and message.metadata.dst_node_id == 2:
            raise DropReply
        return reply

    run = {**SMALL, "debug.fail_site": "", "federation.rounds": 2}
    run_inprocess({**run, "output.dir": str(tmp_path / "lost")}, transform=lost)
    for line in _lines(tmp_path / "lost" / "metrics.jsonl"):
        assert [(f["phase"], f["site"]) for f in line["failures"]] == [("train", "site-1")], line["failures"]
        assert line["failures"][0]["reason"].startswith("no reply within ")

    def broken(message, reply):
        raise KeyError("broken")

    with pytest.raises(RuntimeError, match=r"transform of InProcessGrid raised: KeyError\('broken'\)"):
        run_inprocess({**run, "output.dir": str(tmp_path / "broken")}, transform=broken)


def test_the_bounded_mean_is_the_weighted_mean_until_an_update_is_far_and_then_bounds_its_pull():
    from strategies.horizontal import centred_clip

    rng = np.random.default_rng(0)
    updates, weights = rng.normal(size=(5, 20)), np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    mean, scale, _ = centred_clip(updates, weights, 5.0)
    np.testing.assert_allclose(mean, weights @ updates, rtol=1e-12)
    assert np.all(scale == 1.0)
    far = updates.copy()
    far[2] *= 1e6
    bounded, scale, spread = centred_clip(far, weights, 5.0)
    centre = np.median(far, axis=0)
    tau = 5.0 * np.median(np.linalg.norm(far - centre, axis=1))
    assert scale[2] < 1 and np.all(np.delete(scale, 2) == 1.0) and spread[2] > 1e5
    others = centre + np.delete(weights, 2) @ (np.delete(far, 2, axis=0) - centre)
    assert np.linalg.norm(bounded - others) <= weights[2] * tau * (1 + 1e-9)  # its pull is at most w tau
    wide = rng.normal(size=(7, 1000))  # several blocks of columns: the same as the formula on the whole matrix
    wide[3] *= 50.0
    wide_weights = np.full(7, 1 / 7)
    centre = np.median(wide, axis=0)
    distance = np.linalg.norm(wide - centre, axis=1)
    expected_scale = np.minimum(1.0, 2.0 * np.median(distance) / distance)
    mean, scale, spread = centred_clip(wide, wide_weights, 2.0)
    np.testing.assert_allclose(scale, expected_scale, rtol=1e-12)
    np.testing.assert_allclose(spread, distance / np.median(distance), rtol=1e-12)
    np.testing.assert_allclose(mean, centre + (wide_weights * expected_scale) @ (wide - centre), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("sites", [1, 2, 3, 4, 7, 10, 101])
def test_the_coordinate_median_is_numpys_to_the_bit(sites):
    """One partition gives np.median's floats for odd and even site counts, with tied coordinates; the matrix of
    stacked updates holds each update's arrays flattened in order, converted from float32 as astype does."""
    from flwr.app import Array, ArrayRecord

    from strategies.rounds.robust import COLUMN_BLOCK, coordinate_median
    from strategies.rounds.robust import stacked as _stacked

    rng = np.random.default_rng(sites)
    updates = rng.normal(size=(sites, 2 * COLUMN_BLOCK + 40))  # two whole blocks of columns and part of one
    updates[rng.random(updates.shape) < 0.3] = 0.25
    np.testing.assert_array_equal(coordinate_median(updates), np.median(updates, axis=0))
    records = [ArrayRecord({"w": Array(rng.normal(size=(3, 4)).astype(np.float32)),
                            "b": Array(rng.normal(size=2).astype(np.float32))}) for _ in range(sites)]
    expected = np.stack([np.concatenate([r["w"].numpy().astype(np.float64).ravel(),
                                         r["b"].numpy().astype(np.float64).ravel()]) for r in records])
    np.testing.assert_array_equal(_stacked(records, ["w", "b"]), expected)
    buffer = np.full(expected.shape, np.nan)
    assert _stacked(records, ["w", "b"], buffer) is buffer  # a buffer of the right shape is written, not replaced
    np.testing.assert_array_equal(buffer, expected)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"strategy.name": "central_dp", "privacy.epsilon": 1.0, "federation.update_bound": 3},
     "federation.update_bound = 3 bounds FedAvg's weighted mean, which"),
    ({"federation.aggregation": "median", "federation.update_bound": 3},
     "federation.update_bound = 3 is read only with FedAvg's weighted mean (federation.aggregation = 'fedavg'), "
     "which federation.aggregation = 'median' is not; leave it at 1"),
    ({"federation.trim_fraction": 0.3}, "federation.trim_fraction = 0.3 is read only with federation.aggregation = "
                                        "'trimmed_mean', which federation.aggregation = 'fedavg' is not"),
    ({"federation.max_malicious": 2}, "federation.max_malicious = 2 is read only with federation.aggregation = 'krum'"),
    ({"model.penalty": 0.1}, "model.penalty = 0.1 is read only with model.name = 'cox_mlp' or 'cox_time', which "
                             "model.name = 'hazard_mlp' is not; leave it at 0"),
    ({"federation.update_bound": 0.5}, "federation.update_bound = 0.5 would bound most honest updates"),
])
def test_a_key_that_the_run_would_ignore_is_refused(overrides, words):
    from flwr_app.config import parse_run_config
    from strategies.config import ConfigError, defaults

    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_run_config({**defaults(), **SMALL, "debug.fail_site": "", **overrides})


def test_a_diverging_model_is_rolled_back_naming_only_the_site_that_caused_it_and_never_checkpointed(
        tmp_path, clean):
    """With the bound off (``federation.update_bound=0``), site-1 sends its update x1e6 from round 2: the new global
    model's norm explodes, so rounds 2 and 3 keep round 1's model (``rolled_back`` names site-1 alone); no honest
    site is named anywhere; the checkpoint holds round 1's model, so ``resume.from`` never starts from a poisoned
    one; the final model is within 0.01 of the clean run's C."""
    import torch

    poisoned = {**SMALL, "debug.fail_mode": "poisoned_update", "debug.fail_scale": 1e6, "debug.fail_round": 2,
                "federation.update_bound": 0, "output.dir": str(tmp_path)}
    summary = run_inprocess(poisoned)
    lines = _lines(tmp_path / "metrics.jsonl")
    assert "rolled_back" not in lines[0]
    for line in lines[1:]:
        assert line["rolled_back"]["to_round"] == 1 and line["rolled_back"]["sites"] == ["site-1"]
        assert "parameter norm" in line["rolled_back"]["reason"]
        assert line["failures"] == [] and line["global_test"] == lines[0]["global_test"]
    assert abs(summary["test"]["c_index"] - clean["fedavg"]["test"]["c_index"]) < 0.01
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["round"] == 3
    assert max(float(value.abs().max()) for value in checkpoint["arrays"].values()) < 100


def test_divergence_is_non_finite_weights_or_an_exploding_norm_and_one_site_cannot_claim_it():
    from flwr.app import Array, ArrayRecord

    from models.metrics import UNDEFINED_REASONS
    from strategies.horizontal import RoundRecord, divergence
    from strategies.rounds.evaluation import predictions_diverged as _predictions_diverged

    def record(*values):
        return ArrayRecord({"w": Array(np.asarray(values, dtype=np.float32))})

    assert divergence(record(3.0, 4.0), record(30.0, 40.0)) == ""  # x10: a large step, not a divergence
    assert "parameter norm is 5e+03" in divergence(record(3.0, 4.0), record(3000.0, 4000.0))
    assert divergence(record(0.0, 0.0), record(60.0, 80.0)) == ""  # from a zero model: bounded by 100 x 1
    assert "non-finite" in divergence(record(3.0, 4.0), record(np.nan, 4.0))
    broken = {"c_index": UNDEFINED_REASONS["not_finite"]}
    rounds = RoundRecord(evaluate_sites={f"site-{i}": {"c_index": float("nan")} for i in range(3)},
                         evaluate_undefined={"site-1": broken})
    assert _predictions_diverged(rounds) == ""  # one site's claim rolls nothing back
    rounds.evaluate_undefined["site-2"] = broken
    assert _predictions_diverged(rounds) == "the new global model's predictions are not finite at 2 of 3 sites"


def test_weighted_mean_writes_the_bytes_of_flowers_fedavg_mean():
    """The plain mean of accepted updates (no update bounded) is FedAvg's, byte for byte, for float32 and
    float64 arrays and integer or fractional weights."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from strategies.horizontal import weighted_mean

    rng = np.random.default_rng(0)
    for weights in ([3, 5, 1, 8], [2.5, 0.1, 7.0, 1.25]):
        contents = [RecordDict({"arrays": ArrayRecord({"w": Array(rng.normal(size=(4, 3)).astype(np.float32)),
                                                       "b": Array(rng.normal(size=3))}),
                                "metrics": MetricRecord({"num-examples": weight})}) for weight in weights]
        ours, flowers = weighted_mean(contents, "num-examples"), aggregate_arrayrecords(contents, "num-examples")
        assert list(ours) == list(flowers)
        assert all(ours[key].data == flowers[key].data for key in flowers)
