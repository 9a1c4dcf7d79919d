"""Checkpoints and resumption: a run stopped after round k and resumed ends as the uninterrupted run does.

The runs use the in-process engine (the real ServerApp and ClientApp over ``InProcessGrid``);
``debug.stop_after_round`` stops the ServerApp as a crash of the server would, after that
round's outputs and checkpoint.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flwr_app.config import ConfigError
from flwr_app.horizontal_server import RunStopped
from simulations.engine import run_inprocess
from strategies.horizontal import RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE, SITE_KEY

SMALL = {"federation.num_sites": 3, "baseline.centralized": False, "evaluation.server_side": True}


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _stop_then_resume(directory, overrides, stops):
    """Run ``overrides`` in ``directory``, stopping after each round in ``stops`` and resuming; return the summary."""
    for index, stop in enumerate(stops):
        resume = {"resume.from": str(directory)} if index else {"output.dir": str(directory)}
        with pytest.raises(RunStopped, match=f"stop_after_round = {stop}.*resume.from"):
            run_inprocess({**overrides, **resume, "debug.stop_after_round": stop})
    return run_inprocess({**overrides, "resume.from": str(directory)})


def _assert_same_run(resumed_dir, resumed, full_dir, full, rounds, *, same_weights=True):
    assert resumed["privacy"] == full["privacy"]                                       # the same final epsilon
    assert _read_jsonl(resumed_dir / "ledger.jsonl") == _read_jsonl(full_dir / "ledger.jsonl")  # entry for entry
    metrics = [_read_jsonl(path / "metrics.jsonl") for path in (resumed_dir, full_dir)]
    assert [line["round"] for line in metrics[0]] == list(range(1, rounds + 1))          # each round once
    for a, b in zip(*metrics, strict=True):
        assert a["privacy"] == b["privacy"] and a["failures"] == b["failures"] == []
        if same_weights:
            assert a["train"] == b["train"] and a["global_test"] == pytest.approx(b["global_test"], rel=1e-9)
    if same_weights:  # every site's training is seeded per round: the resumed run is the same computation
        models = [torch.load(path / "model.pt", weights_only=False)["state_dict"] for path in (resumed_dir, full_dir)]
        assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])
        assert resumed["test"] == pytest.approx(full["test"], rel=1e-9)


@pytest.fixture(scope="module")
def dp_sgd_full(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_sgd_full")
    overrides = {**SMALL, "strategy.name": "dp_sgd", "privacy.epsilon": 2.0, "federation.rounds": 4}
    return out, overrides, run_inprocess({**overrides, "output.dir": str(out)})


def test_dp_sgd_resumed_twice_ends_as_the_uninterrupted_run(dp_sgd_full, tmp_path):
    full_dir, overrides, full = dp_sgd_full
    resumed = _stop_then_resume(tmp_path, overrides, stops=[1, 3])
    assert resumed["resumed_after_round"] == 3
    _assert_same_run(tmp_path, resumed, full_dir, full, rounds=4)


def test_each_resumed_site_is_sent_its_own_privacy_state_only(dp_sgd_full, tmp_path):
    """The checkpoint's states go back one per site: no site learns another's sigma, steps or accountant."""
    _, overrides, _ = dp_sgd_full
    with pytest.raises(RunStopped):
        run_inprocess({**overrides, "output.dir": str(tmp_path), "debug.stop_after_round": 2})
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["strategy"]["rounds"][2]["privacy_states"]
    sent = {}

    def observe(message, reply):
        if message.metadata.message_type == "train" and not reply.has_error():
            config = message.content["config"]
            site = str(reply.content[SITE_KEY]["name"])
            sent.setdefault(site, []).append(str(config[RESUMED_PRIVACY_STATE]) if RESUMED_PRIVACY_STATE in config
                                             else None)

    run_inprocess({**overrides, "resume.from": str(tmp_path)}, observe=observe)
    assert len(saved) == 3 and set(sent) == set(saved)
    for site, states in sent.items():
        assert states[0] == saved[site]  # round 3: its own state, and nobody else's
        assert states[1] != saved[site] and json.loads(states[1])  # round 4: its own state after round 3


def test_lines_written_after_the_last_checkpoint_are_dropped_and_rerun(dp_sgd_full, tmp_path):
    """A crash between writing round 2's lines and its checkpoint: the resumed run starts from round 1's checkpoint."""
    full_dir, overrides, full = dp_sgd_full
    with pytest.raises(RunStopped):
        run_inprocess({**overrides, "output.dir": str(tmp_path), "debug.stop_after_round": 1})
    shutil.copy(tmp_path / "checkpoint.pt", tmp_path / "round1.pt")
    with pytest.raises(RunStopped):
        run_inprocess({**overrides, "resume.from": str(tmp_path), "debug.stop_after_round": 2})
    assert [line["round"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    shutil.copy(tmp_path / "round1.pt", tmp_path / "checkpoint.pt")
    resumed = run_inprocess({**overrides, "resume.from": str(tmp_path / "checkpoint.pt")})
    assert resumed["resumed_after_round"] == 1
    _assert_same_run(tmp_path, resumed, full_dir, full, rounds=4)


def test_bdp_resumed_ends_with_the_same_epsilon_mu(tmp_path):
    """The Bayesian accountant's state (per-order cost sums) comes back from the checkpoint."""
    overrides = {**SMALL, "strategy.name": "bdp", "privacy.epsilon": 2.0, "federation.rounds": 3}
    full = run_inprocess({**overrides, "output.dir": str(tmp_path / "full")})
    resumed = _stop_then_resume(tmp_path / "resumed", overrides, stops=[1])
    _assert_same_run(tmp_path / "resumed", resumed, tmp_path / "full", full, rounds=3)
    assert full["privacy"]["epsilon_classical"] > 0 and len(_read_jsonl(tmp_path / "full" / "ledger.jsonl")) == 9


def test_central_dp_resumed_ends_with_the_same_epsilon(tmp_path):
    """Flower's server-side noise comes from numpy's global generator: the same epsilon, not the same weights."""
    overrides = {**SMALL, "strategy.name": "central_dp", "privacy.epsilon": 4.0, "privacy.clip_norm": 0.1,
                 "federation.rounds": 3}
    full = run_inprocess({**overrides, "output.dir": str(tmp_path / "full")})
    resumed = _stop_then_resume(tmp_path / "resumed", overrides, stops=[2])
    _assert_same_run(tmp_path / "resumed", resumed, tmp_path / "full", full, rounds=3, same_weights=False)


def test_resume_refuses_another_configuration(dp_sgd_full, tmp_path):
    full_dir, overrides, _ = dp_sgd_full
    shutil.copytree(full_dir, tmp_path / "run")
    before = (tmp_path / "run" / "ledger.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"federation\.rounds \(4 in the checkpoint, 6 now\)"):
        run_inprocess({**overrides, "federation.rounds": 6, "resume.from": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="no checkpoint at"):
        run_inprocess({**overrides, "resume.from": str(tmp_path / "nothing")})
    with pytest.raises(ConfigError, match="leave output.dir empty"):
        run_inprocess({**overrides, "resume.from": str(tmp_path / "run"), "output.dir": str(tmp_path / "other")})
    assert (tmp_path / "run" / "ledger.jsonl").read_text() == before  # nothing touched


def test_a_site_charged_a_round_it_did_not_answer_catches_up_when_the_run_resumes(tmp_path):
    """dp_sgd: site-1 does not answer round 2 (it hangs past federation.timeout_s), which the server counts as
    released; the run stops after round 2 and resumes with site-1 well. Its checkpointed state is round 1's, so its
    resumed training message carries one round to catch up: its round-3 and round-4 reports match the ledger's
    recomputation (accepted, no failure) and its ledger counts 4 released rounds within the budget."""
    overrides = {**SMALL, "strategy.name": "dp_sgd", "privacy.epsilon": 2.0, "federation.rounds": 4}
    hang = {"debug.fail_site": "site-1", "debug.fail_mode": "hang", "debug.fail_round": 2,
            "federation.timeout_s": 8.0}
    with pytest.raises(RunStopped):
        run_inprocess({**overrides, **hang, "output.dir": str(tmp_path), "debug.stop_after_round": 2})
    catch_up = {}

    def observe(message, reply):
        if message.metadata.message_type == "train" and not reply.has_error():
            site = str(reply.content[SITE_KEY]["name"])
            catch_up.setdefault(site, []).append(message.content["config"].get(RESUMED_CATCH_UP, 0))

    summary = run_inprocess({**overrides, "resume.from": str(tmp_path), "federation.timeout_s": 8.0}, observe=observe)
    metrics = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [f["site"] for f in metrics[1]["failures"]] == ["site-1"]
    assert metrics[2]["failures"] == metrics[3]["failures"] == []
    assert catch_up == {"site-0": [0, 0], "site-1": [1, 0], "site-2": [0, 0]}
    ledger = _read_jsonl(tmp_path / "ledger.jsonl")
    site_1 = [entry for entry in ledger if entry["site"] == "site-1"]
    assert [entry["round"] for entry in site_1] == [1, 2, 3, 4]
    assert site_1[0]["epsilon"] < site_1[2]["epsilon"] < site_1[3]["epsilon"] <= 2.0 + 1e-9
    assert summary["privacy"]["epsilon"] <= 2.0 + 1e-9
