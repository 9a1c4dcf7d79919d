"""Split learning end to end through Flower's simulation engine (Ray): the real ServerApp and ClientApp."""

from __future__ import annotations

import json
import re

import pytest
import torch

from simulations.engine import resolve, run_inprocess, run_simulation

pytestmark = pytest.mark.slow

RUN = {
    "strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
    "model.name": "bayesian_multisurv", "model.num_durations": 10, "federation.rounds": 2, "train.batch_size": 64,
    "train.lr": 0.005, "split.embedding_dim": 16, "split.encoder_layers": 1, "split.head_layers": 1,
    "split.mc_samples": 4, "privacy.epsilon": 8.0, "baseline.centralized": False,
}


def test_flower_split_run_equals_the_in_process_run(tmp_path):
    flower = run_simulation({**RUN, "output.dir": str(tmp_path / "flower")}, engine="ray")
    local = run_inprocess({**RUN, "output.dir": str(tmp_path / "local")})
    # one message per site per batch, plus the last gradient, through real Flower messages (Ray or in process)
    assert flower["round_trips"] == flower["batches"] + 1 and flower["batches"] == local["batches"]
    assert local["round_trips"] == flower["round_trips"]
    # each site restored its encoder, optimiser and counts from context.state at every message: same run
    assert flower["test"] == pytest.approx(local["test"], rel=1e-6, abs=1e-9)
    assert flower["privacy"]["epsilon"] == pytest.approx(local["privacy"]["epsilon"], rel=1e-12)
    assert flower["privacy_sites"] == local["privacy_sites"]
    heads = [torch.load(tmp_path / part / "model.pt", weights_only=False)["fusion_head"] for part in ("flower", "local")]
    for key, value in heads[0].items():
        torch.testing.assert_close(value, heads[1][key], rtol=1e-6, atol=1e-7)
    ledgers = [[json.loads(line) for line in (tmp_path / part / "ledger.jsonl").read_text().splitlines()]
               for part in ("flower", "local")]
    assert [(e["round"], e["site"], e["epsilon"]) for e in ledgers[0]] == [
        (e["round"], e["site"], e["epsilon"]) for e in ledgers[1]]


def test_flower_private_split_run_equals_the_in_process_run_and_a_site_error_is_one_line(tmp_path):
    from simulations.run import describe_failure
    from strategies.split import SplitSiteError

    run = {"strategy.name": "private_split", "data.name": "synthetic_multimodal", "split.modalities": "a,b",
           "privacy.epsilon": 10.0, "federation.rounds": 3, "split.mc_samples": 4, "baseline.centralized": False}
    flower = run_simulation({**run, "output.dir": str(tmp_path / "flower")}, engine="ray")
    local = run_inprocess({**run, "output.dir": str(tmp_path / "local")})
    # each site kept its preprocessing, encoder and cache in context.state between messages (Ray actors): same run
    assert flower["test"] == local["test"] and flower["privacy"] == local["privacy"]
    # a site's error through Ray reaches the user as the site's own line
    bad = {**run, "split.modalities": "a,b,c", "privacy.epsilon": 1.0, "data.synthetic_records": 400,
           "output.dir": str(tmp_path / "small")}
    with pytest.raises(SplitSiteError) as caught:
        run_simulation(bad, engine="ray")
    line, code = describe_failure(caught.value, resolve(bad)[0])
    assert code == 1 and "ray::" not in line
    # every site is too small; whichever site's reply the server reads first is the one named
    # the size and the keys come first: they survive the console line's 300 characters
    assert re.search(r"site '([abc])' \(node \d+\) failed on train\.private_split_setup: synthetic_multimodal modality "
                     r"'\1': 320 training records are too few at privacy\.epsilon = 1: a column needs about \d+; raise "
                     r"privacy\.epsilon or privacy\.setup_share, or give ranges in data\.dictionary", line), line
