"""A deployment on 127.0.0.1: TLS, SuperNode authentication, site files, `flwr run` (docs/deployment.md).

The deploy scripts make the certificates and keys; a SuperLink runs with TLS and
``--enable-supernode-auth``; three registered SuperNodes each read their own file. A horizontal
``dp_sgd`` run (one SuperNode killed after its first round) and a vertical ``split`` run go through
``flwr run``, and a SuperNode whose key was never registered is refused. The SuperNodes run with
``--isolation process`` beside fedsurv's warm executor (``python -m flwr_app.executor``), as a site
does. Every process is started in its own process group and stopped by it.
"""

import json
import os
import signal
import time

import numpy as np
import pandas as pd
import pytest
import torch

from benchmarks.loopback import BIN, CONNECTION, SITES, Deployment, loopback
from models.data.datasets import _sksurv_flchain
from models.data.vertical import simulate_multimodal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with loopback(tmp_path_factory.mktemp("deployment"), keys=(*SITES, "intruder"), executor="warm") as deploy:
        yield deploy


def test_unregistered_node_refused_and_dp_sgd_run_finishes_without_a_site_killed_mid_run(deployment):
    """An unregistered SuperNode is refused; two dp_sgd runs with the same seed release different noisy updates
    (deployed noise comes from each site's OS entropy); a dp_sgd run whose third site is SIGKILLed after round 1
    finishes with the other two, and the ledger holds the killed site's spend up to its last accepted round, and any
    round it was asked after it left, counted as released."""
    intruder = deployment.start_supernode("intruder", "data-path='/nonexistent.csv'", key="intruder")
    assert intruder.wait(timeout=120) != 0
    deployment.stop("intruder")
    assert "No SuperNode found with the given public key" in deployment.log("superlink")

    flchain = _sksurv_flchain().drop(columns=["chapter"]).sample(n=1500, random_state=0)
    for site, rows in zip(SITES, np.array_split(np.arange(len(flchain)), len(SITES))):
        path = deployment.root / f"{site}.csv"
        flchain.iloc[rows].to_csv(path, index=False)
        deployment.start_supernode(site, f"data-path='{path}' site-name='{site}'")
    # Public design facts (FLCHAIN's codebook) for the columns a small federation's private set-up cannot
    # resolve through its noise; the server alone reads the file and sends its content to the sites.
    dictionary = deployment.root / "flchain_dictionary.json"
    dictionary.write_text(json.dumps({"numeric": {"flc.grp": [1, 10], "sample.yr": [1995, 2003]},
                                      "categorical": {"mgus": ["no", "yes"], "sex": ["F", "M"]}}))
    dp_sgd = ("data.name='site_files' data.time_col='futime' data.event_col='death' strategy.name='dp_sgd' "
              "privacy.epsilon=5 federation.num_sites=3 federation.min_sites=2 train.batch_size=64 "
              f"evaluation.server_side=false baseline.centralized=false data.dictionary='{dictionary}'")
    # Two one-round runs with the same seed: each site draws its noise (and batches) from its own OS entropy, so
    # the updates it releases differ, and the server cannot regenerate them from the seed.
    released = []
    for name in ("entropy-a", "entropy-b"):
        finished = deployment.wait_finished(deployment.submit(
            f"{dp_sgd} federation.rounds=1 seed=3 output.dir='{deployment.root / name}'"), timeout=300)
        assert finished["status"] == "finished:completed", (finished, deployment.log("superlink")[-4000:])
        released.append(torch.load(deployment.root / name / "model.pt", weights_only=True)["state_dict"])
    assert any(not bool((released[0][key] == released[1][key]).all()) for key in released[0])
    out = deployment.root / "horizontal"
    rounds = 3
    run_id = deployment.submit(f"{dp_sgd} federation.rounds={rounds} output.dir='{out}'")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline, deployment.log("superlink")[-4000:]
        time.sleep(1)
    killed = SITES[-1]
    deployment.stop(killed)  # SIGTERM, then SIGKILL to its whole process group: the site is gone
    run = deployment.wait_finished(run_id, timeout=600)
    assert run["status"] == "finished:completed", (run, deployment.log("superlink")[-4000:])

    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["test_source"] == "weighted mean of the sites' own test metrics"
    assert 0.5 < summary["test"]["c_index"] <= 1.0 and 0 < summary["privacy"]["epsilon"] <= 5
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(1, rounds + 1))
    assert set(lines[0]["sites"]) == set(SITES) and not lines[0]["failures"]
    assert set(lines[-1]["sites"]) == set(summary["sites"]) == set(SITES) - {killed}
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert {entry["mechanism"] for entry in ledger} == {"dp_sgd"}
    unanswered = {site: sorted(entry["round"] for entry in ledger if entry["site"] == site and any(
        "no accepted reply" in text for text in entry["assumptions"])) for site in SITES}
    spent = {site: sorted(entry["round"] for entry in ledger if entry["site"] == site) for site in SITES}
    accepted = {site: [number for number in spent[site] if number not in unanswered[site]] for site in SITES}
    last = max(accepted[killed])
    assert accepted[killed] == list(range(1, last + 1)) and last < rounds
    assert all(number > last for number in unanswered[killed])  # asked after it left: counted as released
    for site in SITES[:-1]:
        assert accepted[site] == spent[site] == list(range(1, rounds + 1))
    killed_epsilon = max(entry["epsilon"] for entry in ledger if entry["site"] == killed)
    assert summary["privacy"]["epsilon"] >= killed_epsilon  # the headline is the worst site's, never an average
    for site in SITES[:-1]:
        deployment.stop(site)


def test_vertical_split_run_with_labels_file_completes(deployment):
    table = simulate_multimodal(300)
    labels = deployment.root / "labels.csv"
    table_labels = {"id": table.ids, "time": table.time, "event": table.event}
    pd.DataFrame(table_labels).to_csv(labels, index=False)
    for site, modality in zip(SITES, table.modalities):
        path = deployment.root / f"{modality}.csv"
        table.modalities[modality].rename_axis("id").reset_index().to_csv(path, index=False)
        deployment.start_supernode(site, f"modality='{modality}' data-path='{path}'")
    out = deployment.root / "vertical"
    deployment.flwr_run(
        f"data.name='site_files' data.labels_path='{labels}' strategy.name='split' model.name='bayesian_multisurv' "
        f"split.modalities='a,b,c' split.embedding_dim=16 split.mc_samples=2 privacy.epsilon=10 federation.rounds=1 "
        f"evaluation.server_side=false baseline.centralized=false output.dir='{out}'"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["modalities"] == ["a", "b", "c"] and summary["epochs"] == 1
    assert summary["round_trips"] == summary["batches"] + 1
    assert summary["privacy"]["epsilon"] <= 10 + 1e-6
    assert (out / "metrics.jsonl").read_text().count("\n") == 1
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert {entry["site"] for entry in ledger} == {"a", "b", "c", "all modalities"}
    assert (out / "survival_bands.npz").exists()
    for site in SITES:
        deployment.stop(site)


def _supernode_status(deployment: Deployment, node_id: int) -> str:
    listed = json.loads(deployment.run(BIN / "flwr", "supernode", "list", CONNECTION, "--format", "json").stdout)
    return next((node["status"] for node in listed["nodes"] if int(node["node-id"]) == node_id), "")


def test_a_supernode_killed_in_round_2_and_restarted_with_its_key_rejoins_and_trains(deployment):
    """kill -9 one SuperNode once round 1 of a dp_sgd run has ended (in round 2, or just after it answered round 2's
    message), restart it with the same key once the SuperLink has it
    offline (before, Flower refuses to activate it: exit 305): it keeps its node ID, gets the agreed set-up again,
    trains in a later round, the run finishes, and its absence is filed once, under its site's name, with the time
    the server saw it."""
    flchain = _sksurv_flchain().drop(columns=["chapter"]).sample(n=1500, random_state=1)
    configs = {}
    for site, rows in zip(SITES, np.array_split(np.arange(len(flchain)), len(SITES))):
        path = deployment.root / f"rejoin-{site}.csv"
        flchain.iloc[rows].to_csv(path, index=False)
        configs[site] = f"data-path='{path}' site-name='{site}'"
        deployment.start_supernode(site, configs[site])
    dictionary = deployment.root / "rejoin_dictionary.json"  # as in the test above: the private set-up's public facts
    dictionary.write_text(json.dumps({"numeric": {"flc.grp": [1, 10], "sample.yr": [1995, 2003]},
                                      "categorical": {"mgus": ["no", "yes"], "sex": ["F", "M"]}}))
    out = deployment.root / "rejoin"
    # Enough rounds to outlast the SuperLink's offline detection (up to 2 x 30 s) and the restart: a warm site's round
    # takes little more than the SuperNode's 3 s idle sleep.
    rounds = 30
    run_id = deployment.submit(
        "data.name='site_files' data.time_col='futime' data.event_col='death' strategy.name='dp_sgd' "
        f"privacy.epsilon=5 federation.num_sites=3 federation.min_sites=2 train.batch_size=64 "
        f"federation.rounds={rounds} evaluation.server_side=false baseline.centralized=false "
        f"data.dictionary='{dictionary}' output.dir='{out}'")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline, deployment.log("superlink")[-4000:]
        time.sleep(0.5)
    killed = SITES[-1]
    listed = json.loads(deployment.run(BIN / "flwr", "supernode", "list", CONNECTION, "--format", "json").stdout)
    online = [int(node["node-id"]) for node in listed["nodes"] if node["status"] == "online"]
    os.killpg(deployment.processes.pop(killed).pid, signal.SIGKILL)  # kill -9: SuperNode and its ClientApps
    killed_at = time.monotonic()
    # The round under way: the site may already have answered its message (a warm site takes about a second), and
    # then its absence falls in the next round.
    killed_in = metrics.read_text().count("\n") + 1
    # The SuperLink marks it offline once it misses its heartbeats (up to 2 x 30 s); its node ID is the one its
    # registered key was given, so the restarted SuperNode is the same node.
    while all(_supernode_status(deployment, node) == "online" for node in online):
        assert time.monotonic() - killed_at < 120, deployment.log("superlink")[-4000:]
        time.sleep(1)
    offline_after = time.monotonic() - killed_at
    deployment.start_supernode(killed, configs[killed])
    run = deployment.wait_finished(run_id, timeout=600)
    assert run["status"] == "finished:completed", (run, deployment.log("superlink")[-4000:])

    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(1, rounds + 1))
    filed = [(line["round"], failure) for line in lines for failure in line["failures"]]
    assert len(filed) == 1, filed  # once: not also as unanswered, never as an unnamed site
    (round_filed, failure), = filed
    assert failure["site"] == killed and round_filed in (killed_in, killed_in + 1) and failure["phase"] == "train"
    assert "went offline" in failure["reason"] and "seen after" in failure["reason"]
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    trained = sorted(entry["round"] for entry in ledger if entry["site"] == killed
                     and not any("no accepted reply" in text for text in entry["assumptions"]))
    assert trained[0] == 1 and trained[-1] == rounds and round_filed not in trained  # accepted after it rejoined
    assert set(lines[-1]["sites"]) == set(SITES)
    log = (out / "run.log").read_text()
    assert f"site '{killed}'" in log and "rejoined: it holds the agreed set-up again" in log
    (out / "rejoin_log.txt").write_text(
        f"kill -9 {killed} during round {killed_in}; `flwr supernode list` had it offline after {offline_after:.0f} s; "
        "restarted with its key\n"
        + "".join(text + "\n" for text in log.splitlines() if killed in text or text.startswith("round"))
        + "".join(json.dumps({"round": line["round"], "failures": line["failures"], "sites": sorted(line["sites"])})
                  + "\n" for line in lines)
        + "".join(f"ledger {killed} round {entry['round']}: steps {entry['steps']}, epsilon {entry['epsilon']:.3f}"
                  + (" (no accepted reply: counted as released)" if entry["round"] not in trained else "") + "\n"
                  for entry in ledger if entry["site"] == killed))
    for site in SITES:
        deployment.stop(site)


def test_a_site_whose_policy_is_epsilon_1_refuses_a_run_at_3_before_releasing_anything_and_keeps_its_budget(
        deployment):
    """site-1's SuperNode holds a privacy policy of epsilon <= 1 (its own ledger file): a dp_sgd run asked at
    epsilon 3 is refused by it at the first set-up message, before anything leaves, and the server names it. After a
    SuperNode restart, runs at 0.5 and 0.8 are admitted, the second with site-1's noise raised by the server's plan
    to fit what its filter has left; the server's ledger shows the run's figures and the site's filter figure, which
    equals the site's file, and the file never shows more than 1."""
    from models.data.datasets import load_flchain
    from flwr_app.site_policy import ledger_table, read_ledger

    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    ledger = deployment.root / "site-1-ledger.jsonl"
    configs = {}
    for index, rows in enumerate(np.array_split(np.random.default_rng(0).permutation(len(frame))[:3000], 3)):
        path = deployment.root / f"policy-{SITES[index]}.csv"
        frame.iloc[rows].reset_index(drop=True).to_csv(path, index=False)
        configs[SITES[index]] = f"data-path='{path}' site-name='{SITES[index]}'"
    configs["site-1"] += (f" privacy-ledger='{ledger}' privacy-max-epsilon=1 data-time-col='futime' "
                          "data-event-col='death'")  # a policy site reads its file with its own column roles
    for site in SITES:
        deployment.start_supernode(site, configs[site])
    base = ("data.name='site_files' data.time_col='futime' data.event_col='death' strategy.name='dp_sgd' "
            "federation.num_sites=3 federation.min_sites=2 federation.rounds=1 evaluation.server_side=false "
            "baseline.centralized=false")

    def run(epsilon: float, name: str) -> tuple[dict, dict]:
        deployment.flwr_run(f"{base} privacy.epsilon={epsilon} output.dir='{deployment.root / name}'")
        entries = [json.loads(line) for line in (deployment.root / name / "ledger.jsonl").read_text().splitlines()]
        return (json.loads((deployment.root / name / "summary.json").read_text()),
                next((entry for entry in entries if entry["site"] == "site-1"), {}))

    refused, _ = run(3, "policy-a")
    (reason,) = refused["left_out"].values()
    assert reason == ("site 'site-1': the site's privacy policy refused the request; nothing released (the site's "
                      "log has the detail)"), reason
    assert "more than this site's limit privacy-max-epsilon = 1" in (deployment.root / "site.log").read_text()
    assert set(refused["sites"]) == {"site-2", "site-3"}
    assert [line["kind"] for line in read_ledger(ledger)] == ["header", "refusal"]
    deployment.stop("site-1")  # SIGTERM: the SuperNode leaves; started again with the same key and node config
    deployment.start_supernode("site-1", configs["site-1"])
    report = [f"run a (epsilon 3): left out: {reason}"]
    for name, epsilon in (("policy-b", 0.5), ("policy-c", 0.8)):
        summary, own = run(epsilon, name)
        assert summary["sites_kept_local"] == ["site-1"] and "left_out" not in summary  # its policy keeps them
        released = [line for line in read_ledger(ledger) if line["kind"] == "release"]
        assert own["epsilon_filter"] == pytest.approx(released[-1]["epsilon"], rel=1e-9)
        assert released[-1]["epsilon"] <= 1.0
        report.append(f"run {name[-1]} (epsilon {epsilon}): site-1 noise multiplier {own['noise_multiplier']:.3f}, "
                      f"epsilon {own['epsilon']:.4f} (PLD), {own['epsilon_rdp']:.4f} (RDP), its filter "
                      f"{own['epsilon_filter']:.4f}; run headline {summary['privacy']['epsilon']:.4f}")
    assert own["epsilon"] < 0.95 * 0.8  # the filter, not the run's accountant, set site-1's noise at 0.8
    lines = read_ledger(ledger)
    assert [line["message"] for line in lines if line["kind"] == "release"] == ["setup_ranges", "setup_moments",
                                                                               "train"] * 2
    assert max(line["epsilon"] for line in lines[1:]) <= 1.0
    (deployment.root / "policy_log.txt").write_text("\n".join(report) + "\n\n" + ledger_table(lines) + "\n")
    for site in SITES:
        deployment.stop(site)
