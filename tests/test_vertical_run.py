"""A vertical run (strategy split) end to end in process (the real apps over the in-process grid): outputs,
ledger, calibration, alignment errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from flwr_app import split_messages as wire
from flwr_app import vertical_task
from flwr_app.outputs import RunOutputs
from flwr_app.vertical_server import run_vertical
from strategies.mechanisms.embedding_dp import RECORD_LEVEL, EmbeddingDP
from models.data.vertical import VerticalAlignmentError
from simulations.engine import resolve, run_inprocess
from strategies.mechanisms.embedding_dp import embedding_epsilon
from strategies.split import PredictRequest, SiteConfig, SiteReply, SiteRequest, SplitSiteError

TINY = {
    "strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
    "model.name": "bayesian_multisurv", "model.num_durations": 10, "federation.rounds": 2, "train.batch_size": 64,
    "train.lr": 0.005, "split.embedding_dim": 16, "split.encoder_layers": 1, "split.head_layers": 1,
    "split.mc_samples": 4,
}


def _overrides(tmp_path, **overrides):
    return {**TINY, "output.dir": str(tmp_path), **overrides}


def _config(tmp_path, **overrides):
    return resolve(_overrides(tmp_path, **overrides))[1]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("split_dp")
    overrides = _overrides(out, **{"privacy.epsilon": 8.0})
    return out, resolve(overrides)[1], run_inprocess(overrides)


def test_outputs_ledger_and_round_trips(dp_run):
    out, cfg, summary = dp_run
    for name in ("config.json", "metrics.jsonl", "ledger.jsonl", "summary.json", "model.pt", "survival_bands.npz",
                 "survival_bands.png"):
        assert (out / name).stat().st_size > 0, name
    assert summary["round_trips"] == summary["batches"] + 1
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    # per epoch and after prediction: one entry per site and one for the record over all modalities
    assert len(ledger) == 3 * 4 and {entry["site"] for entry in ledger} == {"a", "b", "c", RECORD_LEVEL}
    assert all(entry["unit"] == "record" and entry["adjacency"] == "replace-one" for entry in ledger)
    assert all(any("not covered" in line for line in entry["assumptions"]) for entry in ledger)
    bands = np.load(out / "survival_bands.npz")
    assert bands["mean"].shape == (len(bands["ids"]), len(bands["cuts"]))
    assert np.all(bands["lower"] <= bands["mean"] + 1e-6) and np.all(bands["mean"] <= bands["upper"] + 1e-6)


def test_record_level_epsilon_composes_every_sites_releases_and_meets_the_target(dp_run):
    out, cfg, summary = dp_run
    sigma = summary["noise_multiplier"]
    releases = EmbeddingDP().planned_releases(cfg)  # max(2 epochs, 4 prediction passes)
    assert releases == 4
    # three sites, each releasing a test record 4 times: 12 Gaussian releases of noise multiplier sigma/2
    assert summary["privacy"]["epsilon"] == pytest.approx(
        embedding_epsilon(noise_multiplier=sigma, epochs=3 * releases, delta=1e-5, adjacency="replace-one"), rel=1e-9)
    assert 8.0 * 0.999 <= summary["privacy"]["epsilon"] <= 8.0
    for report in summary["privacy_sites"].values():
        assert report["epsilon"] == pytest.approx(
            embedding_epsilon(noise_multiplier=sigma, epochs=4, delta=1e-5, adjacency="replace-one"))
        assert report["epsilon_training"] < report["epsilon_held_out"] == report["epsilon"]
    # the centralised twin is the same computation
    assert summary["centralized"]["test"] == pytest.approx(summary["test"], rel=1e-4, abs=1e-4)


def test_paper_calibration_reports_its_claim_beside_the_rdp_epsilon(tmp_path):
    overrides = _overrides(tmp_path, **{"privacy.epsilon": 8.0, "split.calibration": "paper",
                                        "baseline.centralized": False})
    cfg, summary = resolve(overrides)[1], run_inprocess(overrides)
    n_train = len(vertical_task.labels(cfg, vertical_task.load_table(cfg)).train_ids)
    assert n_train == 240  # 300 records, 20 % held out
    paper_sigma = 2 * (64 / n_train) * math.sqrt(2 * math.ceil(n_train / 64) * math.log(1e5)) / 8.0
    assert summary["noise_multiplier"] == pytest.approx(paper_sigma, rel=1e-9)
    assert summary["privacy"]["epsilon_nominal"] == pytest.approx(8.0, rel=1e-9)  # the formula's own claim
    assert summary["privacy"]["epsilon"] > 10 * 8.0  # what that sigma really spends (RDP, all sites): 109


def test_without_privacy_the_ledger_says_so(tmp_path):
    summary = run_inprocess(_overrides(tmp_path, **{"baseline.centralized": False, "federation.rounds": 1}))
    assert summary["privacy"]["epsilon"] is None and summary["noise_multiplier"] == 0.0
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert {entry["mechanism"] for entry in ledger} == {"none"}


class _Transport:
    """A transport whose sites report other IDs or modalities than the label holder expects (the run stops
    at the answers to its first message)."""

    round_trips = 0

    def __init__(self, held):
        self.held = held

    def hello(self):
        return self.held


def test_misaligned_ids_and_missing_sites_stop_with_the_site_named(tmp_path):
    cfg = _config(tmp_path, **{"baseline.centralized": False})
    table = vertical_task.load_table(cfg)
    ids = [str(i) for i in table.ids]
    outputs = RunOutputs.create(cfg)
    with pytest.raises(VerticalAlignmentError, match="site 'b': 1 record IDs are not in the label holder's cohort"):
        run_vertical(cfg, _Transport({"a": ids, "b": ids + ["stranger"], "c": ids}), outputs)
    with pytest.raises(SplitSiteError, match=r"no site holds \['c'\]"):
        run_vertical(cfg, _Transport({"a": ids, "b": ids}), outputs)
    with pytest.raises(SplitSiteError, match="unexpected sites \\['d'\\]"):
        run_vertical(cfg, _Transport({"a": ids, "b": ids, "c": ids, "d": ids}), outputs)


def test_deployed_site_reads_its_modality_file(tmp_path):
    cfg = _config(tmp_path)
    path = tmp_path / "clinical.csv"
    pd.DataFrame({"id": ["p1", "p2"], "age": [50.0, 60.0], "grade": [1, 3]}).to_csv(path, index=False)
    site = vertical_task.site_from_node_config(cfg, {"modality": "clinical", "data-path": str(path),
                                                     "categorical": "grade"})
    assert site.modality == "clinical" and site.categorical == ("grade",)
    assert list(site.features.index) == ["p1", "p2"]
    fresh = [vertical_task.site_from_node_config(cfg, {"modality": "c", "data-path": str(path)}).noise_base_seed
             for _ in range(2)]
    assert fresh[0] != fresh[1]  # operating-system entropy for every run, never the run seed
    # two runs' releases of the same records: their difference is noise (std sqrt(2) sigma C), not zero
    from strategies.split import noise_seed, release_embeddings

    embeddings = torch.randn(2000, 4)
    runs = [release_embeddings(embeddings, clip_norm=1.0, noise_multiplier=1.0, noise_seed=noise_seed(base, "c", 0))
            for base in fresh]
    difference = (runs[0] - runs[1]).flatten()  # the clipped embeddings cancel; std sqrt(2 (1 - rho)) sigma C
    assert abs(float(difference.std()) - 2 ** 0.5) < 0.05  # the two runs' noises are uncorrelated
    with pytest.raises(ValueError, match="node config sets 'noise-seed': a fixed noise seed makes two runs'"):
        vertical_task.site_from_node_config(cfg, {"modality": "c", "data-path": str(path), "noise-seed": 7})
    with pytest.raises(ValueError, match="needs 'modality' and 'data-path'"):
        vertical_task.site_from_node_config(cfg, {"modality": "clinical"})
    with pytest.raises(ValueError, match="partition-id 3 is outside the 3 modalities"):
        vertical_task.site_from_node_config(cfg, {"partition-id": 3})


def test_messages_round_trip():
    request = SiteRequest(backward_ids=["a", "b"], backward_step=4, gradient=np.arange(6, dtype=np.float32).reshape(2, 3),
                          forward_ids=["c"], forward_step=5)
    back = wire.decode_request(wire.encode_request(request))
    assert back.backward_ids == ["a", "b"] and back.forward_ids == ["c"] and back.backward_step == 4
    np.testing.assert_array_equal(back.gradient, request.gradient)
    first = wire.decode_request(wire.encode_request(SiteRequest(forward_ids=[], forward_step=0)))
    assert first.backward_ids is None and first.gradient is None and first.forward_ids == []
    reply = SiteReply(np.ones((2, 3), np.float32), np.array([True, False]), {"epsilon": math.inf})
    modality, decoded = wire.decode_reply(wire.encode_reply("genes", reply))
    assert modality == "genes" and decoded.privacy == {"epsilon": math.inf}
    np.testing.assert_array_equal(decoded.present, reply.present)
    predict = PredictRequest(ids=["x"], passes=3, first_step=11, clean=True)
    assert wire.decode_predict(wire.encode_predict(predict)) == predict
    config = SiteConfig(modality="a", seed=1, train_ids=("x", "y"), num_train=2)
    assert wire.decode_setup(wire.encode_setup(config)) == config
