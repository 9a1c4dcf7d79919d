"""A split run's model predicts new records (models.split_run): the label holder's head in model.pt with the encoders
the simulated sites saved in <run>/sites/<modality>/ reproduce the run's own test curves and C-index."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

from flwr_app import split_messages as wire
from flwr_app import vertical_task
from flwr_app.vertical_server import _metrics
from models.data.validate import DataValidationError
from models.multimodal import survival_band
from models.split_run import SITE_SPEC_FILE, SITES_DIR, load_split_run
from models.survival import restricted_mean_survival_time
from simulations import engine
from simulations.engine import resolve, run_inprocess
from strategies.split import LocalSites, SplitSite, predict_split

# The smallest split run of tests/test_vertical_run.py, private with clean inference (the test curves are then the
# model's: clipped embeddings without noise).
TINY = {
    "strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
    "model.name": "bayesian_multisurv", "model.num_durations": 10, "federation.rounds": 2, "train.batch_size": 64,
    "train.lr": 0.005, "split.embedding_dim": 16, "split.encoder_layers": 1, "split.head_layers": 1,
    "split.mc_samples": 4, "baseline.centralized": False, "privacy.epsilon": 8.0, "split.clean_inference": True,
}


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("split_run")
    overrides = {**TINY, "output.dir": str(out)}
    summary = run_inprocess(overrides)
    cfg = resolve(overrides)[1]
    table = vertical_task.load_table(cfg)
    return out, cfg, summary, table, vertical_task.labels(cfg, table)


def test_the_saved_model_gives_the_runs_own_test_curves_and_c_index(split_run):
    out, cfg, summary, table, label_info = split_run
    assert summary["site_models"] == {name: "saved in its model-dir" for name in "abc"}
    run = load_split_run(out)
    assert run.modalities == ("a", "b", "c") and run.passes == cfg.split.mc_samples
    assert run.input_columns == {name: tuple(table.modalities[name].columns) for name in run.modalities}
    records = {name: table.modalities[name].loc[label_info.test_ids] for name in run.modalities}
    curves = run.predict_survival(records)
    bands = np.load(out / "survival_bands.npz")
    assert list(curves.index) == [str(i) for i in bands["ids"]]
    assert curves.columns.name == "time" and np.array_equal(curves.columns.to_numpy(), bands["cuts"])
    np.testing.assert_allclose(curves.to_numpy(), bands["mean"], rtol=0, atol=1e-6)
    test = _metrics(label_info, curves.to_numpy(), time_=label_info.test_time, event=label_info.test_event)
    assert test["c_index"] == pytest.approx(summary["test"]["c_index"], abs=1e-9)
    risk = run.risk_score(records)
    assert risk.index.equals(curves.index)
    np.testing.assert_allclose(risk.to_numpy(), -restricted_mean_survival_time(run.times, curves.to_numpy()))
    # one frame with every modality's columns and the ID column, in another order: the same curves, by ID
    joined = pd.concat([records[name] for name in run.modalities], axis=1).iloc[::-1]
    joined = joined.rename_axis("id").reset_index()
    np.testing.assert_allclose(run.predict_survival(joined).loc[curves.index].to_numpy(), curves.to_numpy(),
                               rtol=0, atol=1e-6)


def test_load_run_gives_the_split_model_and_score_is_the_runs_own_test_figure(split_run):
    """fedsurv.load_run takes a split run too; score() on the labelled test records is the summary's test figures
    (the same protocol: IPCW of the evaluated records), and the shared methods work on its curves."""
    import fedsurv

    out, cfg, summary, table, label_info = split_run
    run = fedsurv.load_run(out)
    assert isinstance(run, fedsurv.SplitRun)
    records = {name: table.modalities[name].loc[label_info.test_ids] for name in run.modalities}
    labels = pd.DataFrame({"time": label_info.test_time, "event": label_info.test_event},
                          index=pd.Index([str(i) for i in label_info.test_ids], name="id"))
    scores = run.score({**records, "a": records["a"].join(labels.set_axis(records["a"].index))})
    for key in ("c_index", "c_index_td", "ibs", "inbll"):
        assert scores[key] == pytest.approx(summary["test"][key], abs=1e-9, nan_ok=True), key
    curves = run.predict_survival(records)
    np.testing.assert_allclose(run.predict_cumulative_hazard(records).to_numpy(), -np.log(curves.to_numpy()))
    median = run.predict_median_survival(records)
    assert median.index.equals(curves.index) and (median > 0).all()
    with pytest.raises(DataValidationError, match="no outcome column"):
        run.score(records)


def test_missing_modalities_are_masked_as_the_sites_mask_them(split_run):
    """Records without modality c (absent from its frame, or all empty) and a modality left out: the curves the
    protocol's own path gives (the sites' predict, the server's fusion) with the saved weights."""
    out, cfg, summary, table, label_info = split_run
    run = load_split_run(out)
    test_ids = [str(i) for i in label_info.test_ids]
    lacking_c, empty_c = test_ids[:5], test_ids[5:8]
    records = {name: table.modalities[name].loc[test_ids] for name in run.modalities}
    records["c"] = records["c"].drop(index=lacking_c)
    records["c"].loc[empty_c] = np.nan
    curves = run.predict_survival(records)

    sites = {}
    for name in run.modalities:
        features = table.modalities[name].copy()
        if name == "c":
            features.loc[lacking_c + empty_c] = np.nan
        config = vertical_task.site_config(cfg, name, label_info, summary["noise_multiplier"])
        site = SplitSite(config, features, noise_base_seed=0)
        site.encoder.load_state_dict(torch.load(out / SITES_DIR / name / "encoder.pt", weights_only=True))
        sites[name] = site
    server = vertical_task.server(cfg, run.modalities, label_info)
    server.fusion_head.load_state_dict(torch.load(out / "model.pt", weights_only=True)["fusion_head"])
    logits, _ = predict_split(server, LocalSites(sites).predict, test_ids, passes=cfg.split.mc_samples, clean=True)
    expected = survival_band(logits)[0].numpy()
    np.testing.assert_allclose(curves.loc[test_ids].to_numpy(), expected, rtol=0, atol=1e-6)
    assert not np.allclose(curves.loc[lacking_c].to_numpy(), np.load(out / "survival_bands.npz")["mean"][:5])

    without_c = run.predict_survival({name: records[name] for name in ("a", "b")})
    np.testing.assert_allclose(without_c.loc[lacking_c].to_numpy(), curves.loc[lacking_c].to_numpy(), atol=1e-6)
    with pytest.raises(DataValidationError, match="hold none of the modalities"):
        run.predict_survival({"a": records["a"].iloc[:2] * np.nan})
    with pytest.raises(ValueError, match="unknown modalities"):
        run.predict_survival({"d": records["a"]})
    with pytest.raises(DataValidationError, match="no columns"):
        run.predict_survival(records["a"])


def test_a_run_whose_sites_had_no_model_dir_names_the_missing_folder(tmp_path):
    plain = [{PARTITION_ID_KEY: index, NUM_PARTITIONS_KEY: 3} for index in range(3)]  # no model-dir
    summary = run_inprocess({**TINY, "federation.rounds": 1, "output.dir": str(tmp_path)}, node_configs=plain)
    assert set(summary["site_models"].values()) == {"not saved (no model-dir in its node config)"}
    with pytest.raises(FileNotFoundError) as err:
        load_split_run(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / SITES_DIR / "a") in message and "model-dir" in message


def test_sites_of_another_run_and_private_split_runs_are_refused(split_run, tmp_path):
    out, *_ = split_run
    spec_path = out / SITES_DIR / "b" / SITE_SPEC_FILE
    spec = json.loads(spec_path.read_text())
    assert "train_ids" not in spec["config"] and spec["input_columns"] == [f"b{j}" for j in range(8)]
    other = tmp_path / "b"
    other.mkdir()
    (other / SITE_SPEC_FILE).write_text(json.dumps({**spec, "run_token": "another"}))
    (other / "encoder.pt").write_bytes((out / SITES_DIR / "b" / "encoder.pt").read_bytes())
    with pytest.raises(ValueError, match="from another run"):
        load_split_run(out, sites={"b": other})
    private = tmp_path / "private"
    private.mkdir()
    (private / "config.json").write_text(json.dumps({"resolved": {"strategy": "private_split"}}))
    with pytest.raises(ValueError, match="private_split run: its sites keep no model"):
        load_split_run(private)


def test_the_save_messages_carry_the_token_and_the_modality_only():
    assert wire.decode_save(wire.encode_save("0123abcd")) == "0123abcd"
    with pytest.raises(ValueError, match="run token"):
        wire.decode_save(wire.encode_save("../../etc"))
    assert wire.decode_save_reply(wire.encode_save_reply("a")) == "a"
    assert wire.decode_save_reply(wire.encode_save_reply(None)) is None
    extra = wire.encode_save_reply("a")
    extra["split.site"] = ConfigRecord({"modality": "a", "weights": [1.0]})
    with pytest.raises(ValueError, match="modality only"):
        wire.decode_save_reply(extra)
    with pytest.raises(ValueError, match="modality only"):
        wire.decode_save_reply(RecordDict({"split.arrays": ConfigRecord({"x": 1})}))


def test_each_simulated_site_gets_its_own_model_dir(tmp_path):
    """The node configs both engines give the split sites (Flower's runtime through ``engine.ray_apps``: its test in
    tests/test_engine.py)."""
    overrides = {**TINY, "output.dir": str(tmp_path)}
    fused, cfg, outputs = engine._prepare(overrides, "test")
    configs = engine.site_node_configs(cfg, outputs, 3)
    assert [config["model-dir"] for config in configs] == [str(tmp_path.resolve() / SITES_DIR / m) for m in "abc"]
