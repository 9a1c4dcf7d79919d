"""Every value a site sends is in its mechanism's release manifest, covered or listed as uncovered.

Each run below goes through the real ServerApp and ClientApp in process; every reply a site sends is
observed and every key of it (arrays, metrics, config entries, the fields of a deployment's JSON
payloads) must be claimed by an entry of the manifest of the run's mechanism.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import RecordDict

from models.data.datasets import load_flchain
from simulations.engine import resolve, run_inprocess
from strategies.mechanisms.registry import MECHANISMS, get_mechanism

SMALL = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False}


def _settings(overrides):
    """SMALL and ``overrides``; a split run has one site per modality (federation.num_sites is refused there)."""
    split = str(overrides.get("strategy.name", "")).endswith("split")
    return {**{key: value for key, value in SMALL.items() if not (split and key == "federation.num_sites")},
            **overrides}
RUNS = {
    "fedavg": {},
    "fedavg cox": {"model.name": "cox_mlp"},
    "dp_sgd": {"strategy.name": "dp_sgd", "privacy.epsilon": 2.0},
    "bdp": {"strategy.name": "bdp", "privacy.epsilon": 2.0},
    "central_dp": {"strategy.name": "central_dp", "privacy.epsilon": 2.0},
    "nbafl cox": {"strategy.name": "nbafl", "privacy.epsilon": 2.0, "model.name": "cox_mlp"},
    "ls_adp": {"strategy.name": "ls_adp", "privacy.epsilon": 2.0},
    "distributed_dp": {"strategy.name": "distributed_dp", "privacy.epsilon": 2.0},
    "row_dp": {"strategy.name": "row_dp", "privacy.epsilon": 2.0},
    "split": {"strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 200,
              "model.name": "bayesian_multisurv", "model.num_durations": 8, "train.batch_size": 64,
              "split.embedding_dim": 8, "split.encoder_layers": 1, "split.head_layers": 1, "split.mc_samples": 2,
              "privacy.epsilon": 8.0},
    "private_split": {"strategy.name": "private_split", "data.name": "synthetic_multimodal", "federation.rounds": 2,
                      "split.mc_samples": 2, "privacy.epsilon": 10.0},
}


def sent_keys(content: RecordDict) -> list[str]:
    """``record.key`` of every value in a reply (a deployment's JSON payload opened up)."""
    keys = [f"{name}.{key}" for name, record in content.array_records.items() for key in record]
    keys += [f"{name}.{key}" for name, record in content.metric_records.items() for key in record]
    for name, record in content.config_records.items():
        for key, value in record.items():
            if name == "deployment" and key == "json":
                keys += [f"deployment.{field}" for field in json.loads(str(value))]
            else:
                keys.append(f"{name}.{key}")
    return keys


def _observed(overrides, tmp_path, node_configs=None):
    seen: list[tuple[str, str]] = []

    def observe(message, reply):
        if not reply.has_error():
            seen.extend((message.metadata.message_type, key) for key in sent_keys(reply.content))

    run_inprocess({**_settings(overrides), "output.dir": str(tmp_path / "out")}, observe=observe,
                  node_configs=node_configs)
    return seen


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_key_a_site_sends_is_in_the_manifest(tmp_path, run):
    overrides = RUNS[run]
    seen = _observed(overrides, tmp_path)
    _, cfg = resolve(_settings(overrides))
    manifest = get_mechanism(cfg.strategy).manifest(cfg)
    assert seen
    unlisted = sorted({f"{kind}/{key}" for kind, key in seen if not manifest.covers(kind, key)})
    assert not unlisted, f"sent but not in the manifest of {cfg.strategy}: {unlisted}"
    written = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert written == json.loads(json.dumps(manifest.as_dict()))


def flchain_site_files(folder, *, sites: int = 3, records: int = 3000) -> list[dict]:
    """Node configs of ``sites`` deployed sites, each with a CSV file of FLCHAIN records (``futime``, ``death``):
    ``records`` of them in all, drawn by seed 0."""
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    configs = []
    for index, rows in enumerate(np.array_split(np.random.default_rng(0).permutation(len(frame))[:records], sites)):
        path = folder / f"site-{index}.csv"
        frame.iloc[rows].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}"})
    return configs


@pytest.mark.parametrize(("strategy", "set_up"), [
    ("dp_sgd", {"query.setup_ranges", "query.setup_moments"}),  # the private set-up's two passes
    ("fedavg", {"query.site_summary", "query.site_time_histogram"}),  # exact sums
])
def test_a_deployments_set_up_messages_are_in_the_manifest(tmp_path, strategy, set_up):
    configs = flchain_site_files(tmp_path)
    overrides = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                 "strategy.name": strategy, "evaluation.server_side": False}
    if strategy == "dp_sgd":
        overrides |= {"privacy.epsilon": 2.0, "privacy.setup_share": 0.2}  # 2400 records, OS-entropy noise
    seen = _observed(overrides, tmp_path, node_configs=configs)
    _, cfg = resolve(_settings(overrides))
    manifest = get_mechanism(strategy).manifest(cfg)
    recalibration = {"query.recalibration"} if cfg.strategy == "dp_sgd" else set()  # the planned release
    assert {kind for kind, _ in seen} == set_up | {"train", "evaluate"} | recalibration  # set-up reply: empty
    unlisted = sorted({f"{kind}/{key}" for kind, key in seen if not manifest.covers(kind, key)})
    assert not unlisted, unlisted


def test_a_dp_run_sends_no_training_loss_and_the_manifest_would_catch_it():
    for name, mechanism in MECHANISMS.items():
        if name in ("fedavg", "split", "private_split"):  # the vertical ones send no loss at all
            continue
        _, cfg = resolve({"strategy.name": name, "privacy.epsilon": 1.0})
        assert not mechanism.manifest(cfg).covers("train", "metrics.train_loss"), name
        assert "train_loss" not in mechanism.report_keys(cfg)


def test_the_privacy_reference_has_every_mechanisms_manifest():
    from strategies.mechanisms.reference import mechanism_config, reference_page

    page = reference_page()
    for name, mechanism in MECHANISMS.items():
        assert f"## `{name}`" in page
        assert mechanism.manifest(mechanism_config(mechanism)).as_markdown() in page, name
