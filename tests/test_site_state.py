"""A site's privacy state is its own (flwr_app.site_state): a state the server hands back must carry the site's
seal, a deployed site's own copy wins over anything the server sends, and the rounds the server says it charged
are bounded. Through the real apps in process: a dishonest server that puts a forged state and a huge catch-up
in every training message gets no update from any site, with or without a policy, under dp_sgd and bdp."""

import json

import numpy as np
import pytest

from flwr_app import site_state
from models.data.datasets import load_flchain
from simulations.engine import run_inprocess
from strategies import horizontal
from strategies.horizontal import RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE


def _node(tmp_path):
    return {"site-dir": str(tmp_path / "site")}


def test_a_sealed_state_verifies_only_unaltered_and_only_for_its_site(tmp_path):
    key = site_state.state_key(_node(tmp_path), True)
    sealed = site_state.seal({"steps": 10, "noise_multiplier": 1.2}, key=key, site="site-a", run=5, server_round=2)
    assert site_state.unseal(sealed, key=key, site="site-a") == site_state.Sealed(
        "site-a", 5, 2, {"steps": 10, "noise_multiplier": 1.2})
    body = json.loads(sealed)
    forged = json.dumps({**body, "state": {**body["state"], "noise_multiplier": 0.01}})
    with pytest.raises(site_state.StateRefused, match="not sealed by this site"):
        site_state.unseal(forged, key=key, site="site-a")
    with pytest.raises(site_state.StateRefused):  # another site's state (the site name is under the seal)
        site_state.unseal(sealed, key=key, site="site-b")
    with pytest.raises(site_state.StateRefused):  # a key the site did not make (another site directory)
        site_state.unseal(sealed, key=site_state.state_key({"site-dir": str(tmp_path / "other")}, True), site="site-a")
    with pytest.raises(site_state.StateRefused):
        site_state.unseal('{"steps": 1e9}', key=key, site="site-a")  # an unsealed state, as a server would forge it


def test_a_site_that_died_before_keeping_a_round_counts_the_round_the_server_charged(tmp_path):
    """Killed in round 2 before its state was kept: its own copy is of round 1; the server charged round 2 (no reply)
    and says so; the site counts it (one round, whatever the claim) before it trains in round 3."""
    node = _node(tmp_path)
    key = site_state.state_key(node, True)
    own = site_state.seal({"steps": 1}, key=key, site="a", run=7, server_round=1)
    site_state.save_own(node, own, 7)
    assert site_state.restore(node, deployed=True, site="a", run=7, server_round=3, handed_back=own, catch_up=1,
                              max_rounds=10) == ({"steps": 1}, 1)
    assert site_state.restore(node, deployed=True, site="a", run=7, server_round=3, handed_back=None, catch_up=50,
                              max_rounds=10) == ({"steps": 1}, 1)
    assert site_state.restore(node, deployed=True, site="a", run=9, server_round=10**9, handed_back=None,
                              catch_up=10**9, max_rounds=5) == (None, 5)  # no state at all: at most the run's rounds


def test_a_deployed_sites_own_copy_wins_and_catch_up_is_bounded(tmp_path):
    node = _node(tmp_path)
    key = site_state.state_key(node, True)
    old = site_state.seal({"steps": 1}, key=key, site="a", run=7, server_round=1)
    own = site_state.seal({"steps": 3}, key=key, site="a", run=7, server_round=3)
    # no copy of its own: the handed-back state, catch-up at most the rounds since it
    assert site_state.restore(node, deployed=True, site="a", run=7, server_round=4, handed_back=old,
                              catch_up=10**9, max_rounds=10) == ({"steps": 1}, 2)
    site_state.save_own(node, own, 7)
    # a server rolling the site back to an older state it sealed (and claiming no round since): its own copy wins
    assert site_state.restore(node, deployed=True, site="a", run=7, server_round=4, handed_back=old,
                              catch_up=0, max_rounds=10) == ({"steps": 3}, 0)
    # a resumed run (a new run id) that names the old run: the site's own copy of that run
    assert site_state.restore(node, deployed=True, site="a", run=8, server_round=4, handed_back=old,
                              catch_up=5, max_rounds=10) == ({"steps": 3}, 0)
    (tmp_path / "site" / site_state.STATES / "7.json").write_text(own.replace('"steps": 3', '"steps": 0'))
    with pytest.raises(site_state.StateRefused):  # its own copy altered on disk is not used either
        site_state.restore(node, deployed=True, site="a", run=7, server_round=4, handed_back=None, catch_up=0,
                           max_rounds=10)


def _federation(tmp_path, policy: bool):
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    configs = []
    for index, rows in enumerate(np.array_split(np.random.default_rng(0).permutation(len(frame))[:1800], 3)):
        path = tmp_path / f"site-{index + 1}.csv"
        frame.iloc[rows].reset_index(drop=True).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index + 1}",
                        "site-dir": str(tmp_path / f"site-{index + 1}")})
    if policy:
        for config in configs:
            config.update({"privacy-ledger": str(tmp_path / f"{config['site-name']}-ledger.jsonl"),
                           "privacy-max-epsilon": 10.0, "data-time-col": "futime", "data-event-col": "death"})
    return configs


FORGED = {"steps": 10**9, "noise_multiplier": 0.01, "bayes": {}, "classical": {}, "accountant": {}}


@pytest.mark.parametrize(("strategy", "policy"), [("dp_sgd", True), ("dp_sgd", False), ("bdp", False)])
def test_a_server_forging_the_privacy_state_gets_no_update(tmp_path, monkeypatch, strategy, policy):
    """Every training message of a dishonest server carries a forged state (steps 1e9, sigma 0.01) and a catch-up of
    a million rounds, as a resumed run's config would: every site refuses it before training, so no weights leave,
    and a policy site's ledger charges no training."""
    configure = horizontal.SurvivalFedAvg.configure_train

    def forging(self, server_round, arrays, config, grid):
        messages = list(configure(self, server_round, arrays, config, grid))
        for message in messages:
            message.content["config"][RESUMED_PRIVACY_STATE] = json.dumps(FORGED)
            message.content["config"][RESUMED_CATCH_UP] = 10**6
        return messages

    monkeypatch.setattr(horizontal.SurvivalFedAvg, "configure_train", forging)
    replies = []
    run = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": strategy,
           "privacy.epsilon": 1.0, "federation.num_sites": 3, "federation.min_sites": 2, "federation.rounds": 1,
           "evaluation.server_side": False, "baseline.centralized": False, "output.dir": str(tmp_path / "out")}
    with pytest.raises(Exception, match="site"):
        run_inprocess(run, node_configs=_federation(tmp_path, policy),
                      observe=lambda message, reply: replies.append((message, reply)))
    trained = [reply for message, reply in replies if message.metadata.message_type == "train"]
    assert len(trained) == 3
    assert all(reply.has_error() and "not sealed by this site" in reply.error.reason for reply in trained)
    assert not any(reply.content.array_records for reply in trained if not reply.has_error())
    if policy:
        for index in (1, 2, 3):
            lines = [json.loads(line) for line in (tmp_path / f"site-{index}-ledger.jsonl").read_text().splitlines()]
            assert not [line for line in lines if line.get("message") == "train"]


def test_a_resumed_deployed_sites_state_reaches_the_server_sealed(tmp_path):
    """The state a site's reply carries (which the server checkpoints) is sealed: the server holds it, cannot alter
    it unseen, and the site's own directory holds the same copy."""
    replies = []
    run = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": "dp_sgd",
           "privacy.epsilon": 1.0, "federation.num_sites": 3, "federation.min_sites": 2, "federation.rounds": 1,
           "evaluation.server_side": False, "baseline.centralized": False, "output.dir": str(tmp_path / "out")}
    configs = _federation(tmp_path, False)
    run_inprocess(run, node_configs=configs, observe=lambda message, reply: replies.append((message, reply)))
    trained = [reply for message, reply in replies if message.metadata.message_type == "train"]
    assert len(trained) == 3 and not any(reply.has_error() for reply in trained)
    for reply, config in zip(sorted(trained, key=lambda r: str(r.content[horizontal.SITE_KEY]["name"])), configs):
        sealed = str(reply.content[horizontal.SITE_KEY][horizontal.PRIVACY_STATE_KEY])
        key = site_state.state_key(config, True)
        opened = site_state.unseal(sealed, key=key, site=config["site-name"])
        assert opened.round == 1 and opened.state
        (own,) = (tmp_path / config["site-name"] / site_state.STATES).glob("*.json")
        assert own.read_text() == sealed


# ------------------------------------------------------------------ distributed_dp at sites with a policy


def test_a_policy_site_sizes_its_share_from_its_own_honest_sites_not_the_parties_the_server_claims():
    """h = 3 honest sites in the policy: a server claiming 100 parties leaves the site's noise share (relative to one
    record's sensitivity) and its charge as they are at 3; without a policy the claim shrinks the share."""
    from strategies.mechanisms.distributed_dp import counted_honest, gaussian_bound, round_plan

    def plan(parties, cap):
        return round_plan(epsilon=1.0, delta=1e-5, rounds=10, parties=parties, max_dropouts=0, colluding=0,
                          records=2000.0, dim=500, modulus_bits=32, clip=1.0, honest_cap=cap)

    cap = counted_honest([3.0], max_dropouts=0)
    honest, claimed = plan(3, cap), plan(100, cap)
    assert claimed.honest == honest.honest == 3
    assert claimed.local_sigma / claimed.l2 == pytest.approx(honest.local_sigma / honest.l2, rel=1e-3)
    assert gaussian_bound(claimed) == pytest.approx(gaussian_bound(honest), rel=1e-3)
    unguarded = plan(100, None)
    assert unguarded.local_sigma / unguarded.l2 < 0.2 * honest.local_sigma / honest.l2  # sqrt(3/100)
    assert counted_honest([5.0, 2.0], max_dropouts=1) == 1 and counted_honest([], 1) is None
    assert counted_honest([1.0], max_dropouts=0) == 1  # local-only: its own share alone


def test_distributed_dp_runs_at_three_policy_sites_charged_with_h_t_and_d_in_their_ledgers(tmp_path):
    configs = _federation(tmp_path, True)
    for config in configs:
        config["privacy-min-honest-sites"] = 3
    run = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
           "strategy.name": "distributed_dp", "privacy.epsilon": 2.0, "federation.num_sites": 3,
           "federation.min_sites": 3, "federation.rounds": 2, "evaluation.server_side": False,
           "baseline.centralized": False, "output.dir": str(tmp_path / "out")}
    summary = run_inprocess(run, node_configs=configs)
    assert "left_out" not in summary  # every site took part (their test metrics stay at the sites)
    for index in (1, 2, 3):
        lines = [json.loads(line) for line in (tmp_path / f"site-{index}-ledger.jsonl").read_text().splitlines()]
        trains = [line for line in lines if line.get("message") == "train"]
        assert len(trains) == 2 and all(line["kind"] == "release" for line in trains)
        assert {(line["honest_sites"], line["counted_shares"], line["max_dropouts"], line["colluding_sites"],
                 line["parties_reported"]) for line in trains} == {(3, 2, 1, 0, 3)}  # h - D shares: D = 1 tolerated drop-out
        assert all(line["rdp"] > 0 for line in trains) and lines[-1]["epsilon"] <= 10.0


def test_a_policy_site_counts_at_least_the_drop_outs_its_own_sharing_tolerates():
    """A server that says privacy.max_dropouts = 0 while the site's Shamir sharing (its own state) tolerates 2 drop-outs
    does not make the site count more honest shares; a site without a policy follows the run config."""
    from types import SimpleNamespace

    from flwr_app import site_context
    from flwr_app.config import parse_run_config
    from simulations.engine import resolve

    fused, _ = resolve({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "privacy.max_dropouts": 0,
                        "federation.num_sites": 5})
    cfg = parse_run_config(fused)
    sharing = SimpleNamespace(num_shares=5, threshold=3)
    policy = SimpleNamespace(node_config={"privacy-ledger": "/x.jsonl", "privacy-max-epsilon": 1,
                                          "privacy-min-honest-sites": 4})
    assert site_context.tolerated_dropouts(cfg, policy, sharing).privacy.max_dropouts == 2
    assert site_context.tolerated_dropouts(cfg, SimpleNamespace(node_config={}), sharing).privacy.max_dropouts == 0
