"""Sites that fail mid-run (injected with ``debug.*``): the federation goes on, or stops cleanly, with honest outputs.

Most runs use the in-process engine (the real ServerApp and ClientApp over ``InProcessGrid``);
one slow test runs the same failure through Flower's simulation engine and checks both agree.
"""

from __future__ import annotations

import json

import pytest
import torch

from flwr_app.config import ConfigError
from simulations.engine import resolve, run_inprocess, run_simulation
from strategies.horizontal import TooFewSitesError
from strategies.mechanisms.embedding_dp import embedding_epsilon
from strategies.split import SplitSiteError

SMALL = {"federation.num_sites": 3, "federation.rounds": 3, "baseline.centralized": False,
         "evaluation.server_side": False}
DP_SGD = {**SMALL, "strategy.name": "dp_sgd", "privacy.epsilon": 2.0}
SITE_1_FAILS_FROM_ROUND_2 = {"debug.fail_site": "site-1", "debug.fail_round": 2}


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _named(failure, phase, site):
    """A failure record names the phase, the site and its node."""
    return failure["phase"] == phase and failure["site"] == site and isinstance(failure["node"], int)


def _rounds_by_site(ledger):
    rounds: dict[str, list[int]] = {}
    for entry in ledger:
        rounds.setdefault(entry["site"], []).append(entry["round"])
    return rounds


@pytest.fixture(scope="module")
def dp_sgd_site_fails(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_sgd_site_fails")
    overrides = {**DP_SGD, **SITE_1_FAILS_FROM_ROUND_2, "output.dir": str(out)}
    return out, overrides, run_inprocess(overrides)


def test_a_site_that_raises_in_training_is_left_out_and_released_nothing(dp_sgd_site_fails):
    out, _, summary = dp_sgd_site_fails
    metrics = _read_jsonl(out / "metrics.jsonl")
    assert [line["round"] for line in metrics] == [1, 2, 3]
    assert metrics[0]["failures"] == []
    for line in metrics[1:]:
        assert len(line["failures"]) == 1
        # the site's own one-line message, not Flower's wrapping of it
        assert _named(line["failures"][0], "train", "site-1")
        assert line["failures"][0]["reason"].startswith("injected failure (debug.fail_site = 'site-1')")
        assert sorted(line["sites"]) == ["site-0", "site-1", "site-2"]  # it still evaluates (it fails in train only)
        assert "not_aggregated" not in line
    ledger = _read_jsonl(out / "ledger.jsonl")
    # no entry for the rounds it failed in; its spend up to its last completed round is there
    assert _rounds_by_site(ledger) == {"site-0": [1, 2, 3], "site-1": [1], "site-2": [1, 2, 3]}
    site_1 = next(entry for entry in ledger if entry["site"] == "site-1")
    others = [entry for entry in ledger if entry["site"] != "site-1"]
    assert 0 < site_1["epsilon"] < min(entry["epsilon"] for entry in others if entry["round"] == 3)
    assert summary["privacy"]["epsilon"] == pytest.approx(max(e["epsilon"] for e in others if e["round"] == 3))
    assert metrics[-1]["privacy"]["epsilon"] == summary["privacy"]["epsilon"]


@pytest.mark.parametrize("message", ["evaluate", "breslow"])
def test_a_site_that_fails_in_evaluation_or_the_breslow_query_is_recorded_and_the_run_goes_on(tmp_path, message):
    summary = run_inprocess({**SMALL, "model.name": "cox_mlp", "federation.rounds": 2, "output.dir": str(tmp_path),
                             "debug.fail_site": "site-1", "debug.fail_round": 2, "debug.fail_message": message})
    metrics = _read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[0]["failures"] == []
    assert len(metrics[1]["failures"]) == 1 and _named(metrics[1]["failures"][0], message, "site-1")
    # training was not affected: every site has its ledger entry in both rounds
    assert _rounds_by_site(_read_jsonl(tmp_path / "ledger.jsonl")) == {f"site-{i}": [1, 2] for i in range(3)}
    expected_sites = ["site-0", "site-2"] if message == "evaluate" else ["site-0", "site-1", "site-2"]
    assert sorted(summary["sites"]) == expected_sites   # a baseline from two sites still lets every site evaluate


def test_a_site_that_never_answers_is_left_out_after_the_timeout(tmp_path):
    summary = run_inprocess({**SMALL, "federation.rounds": 2, "federation.timeout_s": 8.0, "output.dir": str(tmp_path),
                             **SITE_1_FAILS_FROM_ROUND_2, "debug.fail_mode": "hang"})
    metrics = _read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[1]["failures"] == [metrics[1]["failures"][0]]
    assert _named(metrics[1]["failures"][0], "train", "site-1") and "no reply within 8 s" in metrics[1]["failures"][0]["reason"]
    # site-1 may have trained and sent its update after the timeout: the ledger counts round 2 as released
    ledger = _read_jsonl(tmp_path / "ledger.jsonl")
    assert _rounds_by_site(ledger) == {"site-0": [1, 2], "site-1": [1, 2], "site-2": [1, 2]}
    late = [entry for entry in ledger if entry["site"] == "site-1" and entry["round"] == 2]
    assert "it may have sent its update late" in late[0]["assumptions"][-1]
    assert summary["rounds"] == 2


def test_below_min_sites_the_round_is_not_aggregated_and_the_run_stops_resumably(tmp_path):
    overrides = {**DP_SGD, "federation.min_sites": 3, "output.dir": str(tmp_path)}
    with pytest.raises(TooFewSitesError, match=r"(?s)round 2: 2 of 3 sites' updates accepted, fewer than the minimum 3.*site-1.*"
                                               r"resume\.from"):
        run_inprocess({**overrides, **SITE_1_FAILS_FROM_ROUND_2})
    metrics = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["round"] for line in metrics] == [1, 2] and "not_aggregated" in metrics[1]
    assert not (tmp_path / "summary.json").exists()
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["round"] == 2
    # the sites that trained in round 2 released their updates: their spend is in the ledger
    assert _rounds_by_site(_read_jsonl(tmp_path / "ledger.jsonl")) == {"site-0": [1, 2], "site-1": [1],
                                                                      "site-2": [1, 2]}
    # site-1 is back: the run goes on from round 3, and site-1's accountant continues from its round 1
    summary = run_inprocess({**overrides, "resume.from": str(tmp_path)})
    ledger = _read_jsonl(tmp_path / "ledger.jsonl")
    assert _rounds_by_site(ledger) == {"site-0": [1, 2, 3], "site-1": [1, 3], "site-2": [1, 2, 3]}
    site_1 = [entry for entry in ledger if entry["site"] == "site-1"]
    assert site_1[1]["steps"] == 2 * site_1[0]["steps"]   # two rounds of steps, not one: nothing forgotten
    assert summary["resumed_after_round"] == 2 and summary["rounds"] == 3


VERTICAL = {
    "strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
    "model.name": "bayesian_multisurv", "model.num_durations": 10, "federation.rounds": 3, "train.batch_size": 64,
    "split.embedding_dim": 16, "split.encoder_layers": 1, "split.head_layers": 1, "split.mc_samples": 4,
    "privacy.epsilon": 8.0, "baseline.centralized": False,
}


def test_a_vertical_run_stops_naming_the_site_and_epoch_and_keeps_its_outputs(tmp_path):
    with pytest.raises(SplitSiteError, match=r"(?s)site 'b' \(node \d+\) failed on train\.split_step: injected failure.*"
                                             r"during epoch 2 of 3.*epochs 1 to 1"):
        run_inprocess({**VERTICAL, "output.dir": str(tmp_path), "debug.fail_site": "b", "debug.fail_round": 2})
    assert [line["round"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "model.pt").exists()
    ledger = _read_jsonl(tmp_path / "ledger.jsonl")
    first = [entry for entry in ledger if entry["round"] == 1]
    partial = [entry for entry in ledger if entry["round"] == 2]
    assert [entry["site"] for entry in first] == [entry["site"] for entry in partial] == ["a", "b", "c",
                                                                                       "all modalities"]
    # Epoch 1's entries count 2 releases (its last round trip carried epoch 2's first batch). Stopped during
    # epoch 2, a record can have been released 3 times (the failed round trip may have carried epoch 3's first
    # batch at the sites that answered): the ledger counts 3 at every site, an upper bound.
    assert [entry["steps"] for entry in first] == [2, 2, 2, 6] and [entry["steps"] for entry in partial] == [3, 3, 3, 9]
    for before, after in zip(first, partial, strict=True):
        assert after["epsilon"] > before["epsilon"] and "the run stopped during epoch 2 of 3" in after["assumptions"][-1]
    for entry in partial[:-1]:
        assert entry["epsilon"] == pytest.approx(embedding_epsilon(
            noise_multiplier=entry["noise_multiplier"], epochs=3, delta=entry["delta"], adjacency="replace-one"),
            rel=1e-12)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"debug.fail_mode": "explode"}, "'debug.fail_mode' = 'explode'; choose one of raise, hang"),
        ({"debug.fail_message": "fit"}, "'debug.fail_message' = 'fit'; choose one of train, evaluate, breslow"),
        ({"federation.timeout_s": 0.0}, "'federation.timeout_s' must be > 0"),
        ({**VERTICAL, "resume.from": "/x"}, "resume.from = '/x' is not offered for strategy 'split'"),
        ({**VERTICAL, "debug.stop_after_round": 1}, "applies to horizontal runs only"),
        ({**VERTICAL, "debug.fail_site": "a", "debug.fail_message": "evaluate"}, "never happens there"),
        ({"data.name": "site_files", "evaluation.server_side": False, "baseline.centralized": False,
          "debug.fail_site": "site-0"}, "simulations only"),
    ],
)
def test_bad_fault_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve(override)


@pytest.mark.slow
def test_flower_simulation_handles_the_failure_as_the_in_process_engine_does(dp_sgd_site_fails, tmp_path):
    local_dir, overrides, local = dp_sgd_site_fails
    flower = run_simulation({**overrides, "output.dir": str(tmp_path)}, engine="ray")
    for directory in (tmp_path, local_dir):  # Flower's reason adds Ray's traceback to the site's own message
        metrics = _read_jsonl(directory / "metrics.jsonl")
        assert [len(line["failures"]) for line in metrics] == [0, 1, 1]
        for line in metrics[1:]:
            assert _named(line["failures"][0], "train", "site-1")
            assert (f"injected failure (debug.fail_site = 'site-1'): train in round {line['round']}"
                    in line["failures"][0]["reason"])
    assert _read_jsonl(tmp_path / "ledger.jsonl") == _read_jsonl(local_dir / "ledger.jsonl")
    assert flower["privacy"] == local["privacy"] and sorted(flower["sites"]) == sorted(local["sites"])
    for site, metrics in flower["sites"].items():
        assert metrics == pytest.approx(local["sites"][site], rel=1e-9)
    models = [torch.load(path / "model.pt", weights_only=False)["state_dict"] for path in (tmp_path, local_dir)]
    assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["round"] == 3
