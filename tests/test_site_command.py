"""``fedsurv-site`` (``python -m flwr_app.site``): checks before connecting, the first screen, the supervisor, status.

The keys and certificates are the deploy scripts' own (``deploy/make_certificates.sh``,
``deploy/make_supernode_keys.sh``); an expired CA is made with ``cryptography``. No SuperNode is
started: a bad input must stop the command before it starts any process (``subprocess.Popen`` fails
the test if called), and the supervisor is exercised with stand-in processes.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from flwr.common.config import parse_config_args

from flwr_app import site, site_policy
from flwr_app.config import PROJECT_ROOT

POLICY = """site-name = "hospital-a"
privacy-max-epsilon = 1.0
privacy-delta = 1e-5
privacy-mechanisms = ["dp_sgd", "distributed_dp"]
data-time-col = "months"
data-event-col = "died"
data-categorical-cols = ["stage"]
"""


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    """A site's inputs as the docs make them: the deploy scripts' CA and key, a CSV, a policy file."""
    root = tmp_path_factory.mktemp("site")
    for script, *args in (("make_certificates.sh", root / "certs", "127.0.0.1"),
                          ("make_supernode_keys.sh", root / "keys", "hospital-a")):
        subprocess.run(["bash", PROJECT_ROOT / "deploy" / script, *args], check=True, capture_output=True)
    rng = np.random.default_rng(0)
    n = 120
    pd.DataFrame({"age": rng.normal(60, 10, n).round(1), "stage": rng.integers(1, 4, n),
                  "months": rng.exponential(30, n).round(2), "died": rng.integers(0, 2, n)}).to_csv(
        root / "site.csv", index=False)
    (root / "policy.toml").write_text(POLICY)
    return root


def _args(root: Path, **change: str) -> list[str]:
    options = {"--superlink": "127.0.0.1:9091", "--ca": str(root / "certs" / "ca.crt"),
               "--key": str(root / "keys" / "hospital-a"), "--data": str(root / "site.csv"),
               "--policy": str(root / "policy.toml"), "--state-dir": str(root / "state")}
    options.update({f"--{key.replace('_', '-')}": value for key, value in change.items()})
    return ["start", *(part for pair in options.items() for part in pair)]


@pytest.fixture
def no_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_dry_run_prints_the_first_screen_and_the_exact_supernode_command(material, capsys, no_process):
    """The good path: every input passes, the screen names the site, its records, its budget and what leaves it,
    and the printed flower-supernode command carries a node config that Flower's own parser reads back to the
    site's policy, its data file and its state directory. Nothing is started, nothing is created."""
    assert site.main([*_args(material), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fedsurv site 'hospital-a': every check passed" in out
    assert "site.csv: 120 records" in out and "outcome months (time), died (event); 2 features: age, stage" in out
    assert "epsilon 1 at delta 1e-05" in out and "mechanisms dp_sgd, distributed_dp" in out
    assert "schema*" in out and "model update (dp_sgd)" in out and "masked vector (distributed_dp)" in out
    leaving = out[out.index("What leaves the site"):out.index("  kept ")]
    assert "test metrics" not in leaving and re.search(r"^  kept +test metrics: at the site", out, re.MULTILINE)
    assert "ledger.jsonl: new (nothing spent)" in out
    lines = out.splitlines()
    command = shlex.split(lines[lines.index("Would run (FLWR_TELEMETRY_ENABLED=0):") + 1])
    assert Path(command[0]).name == "flower-supernode"
    flags = dict(zip(command[1:-1:2], command[2::2]))
    assert flags["--superlink"] == "127.0.0.1:9091" and flags["--isolation"] == "process"
    assert flags["--root-certificates"] == str(material / "certs" / "ca.crt")
    assert flags["--auth-supernode-private-key"] == str(material / "keys" / "hospital-a")
    node_config = parse_config_args([flags["--node-config"]])
    assert node_config["data-path"] == str(material / "site.csv")
    assert node_config["site-dir"] == str(material / "state")
    assert node_config["data-categorical-cols"] == "stage"
    policy = site_policy.SitePolicy.from_node_config(node_config)
    assert policy.ledger == material / "state" / "ledger.jsonl" and policy.max_epsilon == 1.0
    executor = shlex.split(lines[lines.index("Would run (FLWR_TELEMETRY_ENABLED=0):") + 2])
    assert executor[1:3] == ["-m", "flwr_app.executor"] and "--parent-pid" in executor
    assert not (material / "state").exists()


def _expired_ca(path: Path) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=400))
            .not_valid_after(now - datetime.timedelta(days=35)).sign(key, hashes.SHA384()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _bad(material: Path, tmp: Path, case: str) -> tuple[dict[str, str], str]:
    """The options of one bad input, and the file (or value) its error line must name."""
    write = {"garbage": b"not a key or a certificate\n", "few.csv": b"months,died,age,stage\n1,1,50,1\n2,0,60,2\n",
             "nocols.csv": b"time,event,age\n1,1,50\n"}
    for name, data in write.items():
        (tmp / name).write_bytes(data)
    policies = {"unknown.toml": POLICY + "privacy-max-epsilom = 2\n", "nobudget.toml": POLICY.replace(
        "privacy-max-epsilon = 1.0\n", ""), "datapath.toml": POLICY + "data-path = '/x.csv'\n",
        "negative.toml": POLICY.replace("privacy-max-epsilon = 1.0", "privacy-max-epsilon = -1"),
        "sitename.toml": POLICY.replace('"hospital-a"', '"../hospital a"'), "nottoml.toml": "site-name: x\n"}
    for name, text in policies.items():
        (tmp / name).write_text(text)
    _expired_ca(tmp / "expired.crt")
    cases = {
        "missing data": ({"data": str(tmp / "missing.csv")}, "missing.csv"),
        "data is a directory": ({"data": str(tmp)}, str(tmp)),
        "too few records": ({"data": str(tmp / "few.csv")}, "few.csv"),
        "csv without the policy's columns": ({"data": str(tmp / "nocols.csv")}, "nocols.csv"),
        "key is a certificate": ({"key": str(material / "certs" / "ca.crt")}, "ca.crt"),
        "key is garbage": ({"key": str(tmp / "garbage")}, "garbage"),
        "key is a PEM TLS key": ({"key": str(material / "certs" / "server.key")}, "server.key"),
        "missing key": ({"key": str(tmp / "nokey")}, "nokey"),
        "CA is garbage": ({"ca": str(tmp / "garbage")}, "garbage"),
        "CA expired": ({"ca": str(tmp / "expired.crt")}, "expired.crt"),
        "CA is a key": ({"ca": str(material / "keys" / "hospital-a")}, "hospital-a"),
        "policy unknown key": ({"policy": str(tmp / "unknown.toml")}, "privacy-max-epsilom"),
        "policy without a budget": ({"policy": str(tmp / "nobudget.toml")}, "privacy-max-epsilon"),
        "policy sets data-path": ({"policy": str(tmp / "datapath.toml")}, "data-path"),
        "policy negative budget": ({"policy": str(tmp / "negative.toml")}, "privacy-max-epsilon"),
        "policy site-name a path": ({"policy": str(tmp / "sitename.toml")}, "site-name"),
        "policy not TOML": ({"policy": str(tmp / "nottoml.toml")}, "nottoml.toml"),
        "address without a port": ({"superlink": "superlink.example.org"}, "superlink.example.org"),
        "address with a scheme": ({"superlink": "https://superlink.example.org:9091"}, "https://"),
    }
    return cases[case]


CASES = ["missing data", "data is a directory", "too few records", "csv without the policy's columns",
         "key is a certificate", "key is garbage", "key is a PEM TLS key", "missing key", "CA is garbage",
         "CA expired", "CA is a key", "policy unknown key", "policy without a budget", "policy sets data-path",
         "policy negative budget", "policy site-name a path", "policy not TOML", "address without a port",
         "address with a scheme"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_stops_the_start_before_any_process_in_one_line(case, material, tmp_path, capsys, no_process):
    """Each bad input: exit status 2, one line on stderr naming the file (or key, or address) and a fix, nothing on
    stdout, no process started (a real start, not a dry run)."""
    change, named = _bad(material, tmp_path, case)
    assert site.main(_args(material, **change)) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and not captured.out, captured
    assert named in lines[0] and lines[0].startswith("fedsurv-site: --")
    assert any(fix in lines[0] for fix in ("give", "remove", "ask", "add", "make", "must", "did you mean", "correct",
                                           "write",
                                           "e.g.")), lines[0]


def test_every_bad_input_has_its_own_line(material, tmp_path, capsys, no_process):
    (tmp_path / "garbage").write_bytes(b"junk\n")
    assert site.main(_args(material, key=str(tmp_path / "garbage"), ca=str(tmp_path / "garbage"),
                           superlink="nohost")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["--superlink", "--key", "--ca"]


def test_the_unknown_key_suggests_the_near_one(material, tmp_path, capsys):
    (tmp_path / "p.toml").write_text(POLICY + "privacy-max-epsilom = 2\n")
    assert site.main(_args(material, policy=str(tmp_path / "p.toml"))) == 2
    assert "did you mean 'privacy-max-epsilon'" in capsys.readouterr().err


def test_a_public_key_beside_the_key_must_be_its_own(material, tmp_path, capsys, no_process):
    key = tmp_path / "hospital-a"
    key.write_bytes((material / "keys" / "hospital-a").read_bytes())
    other = ec.generate_private_key(ec.SECP384R1()).public_key()
    (tmp_path / "hospital-a.pub").write_bytes(other.public_bytes(serialization.Encoding.OpenSSH,
                                                                 serialization.PublicFormat.OpenSSH))
    assert site.main(_args(material, key=str(key))) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "hospital-a.pub: is not the public key of --key" in line


def _charge(node_config: dict, run: int) -> None:
    site_policy.enforce(node_config, "hospital-a", site_policy.Request(
        "dp_sgd", run, 1, "train", "model update", ((4.0, 0.01, 10),)))


def test_status_shows_the_ledger_per_run_and_the_last_message(material, tmp_path, capsys):
    """status reads the ledger the site's policy code wrote: one row per run, the filter's ε after it against the
    budget, and the latest message the site recorded (here its kept test metrics, written after the releases)."""
    state = tmp_path / "state"
    node_config, _ = site.read_policy(material / "policy.toml", material / "site.csv", state)
    for run in (11, 11, 12):
        _charge(node_config, run)
    (state / site.EVALUATION_FILE).write_text(json.dumps(
        {"run": 12, "round": 1, "site": "hospital-a", "test_records": 20, "time": "2999-01-01T00:00:00+00:00",
         "metrics": {}, "undefined": {}}) + "\n")
    assert site.main(["status", "--policy", str(material / "policy.toml"), "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    ledger = [json.loads(line) for line in (state / "ledger.jsonl").read_text().splitlines()]
    assert f"epsilon {ledger[-1]['epsilon']:.4f} of 1 spent" in out
    assert f"11 | 2 | 0 | {ledger[1]['rdp'] + ledger[2]['rdp']:.4g} | {ledger[2]['epsilon']:.4f} |" in out
    assert "last message recorded: 2999-01-01T00:00:00+00:00 run 12 round 1 evaluate: test metrics kept" in out


def test_a_tampered_ledger_stops_start_and_status(material, tmp_path, capsys, no_process):
    state = tmp_path / "state"
    node_config, _ = site.read_policy(material / "policy.toml", material / "site.csv", state)
    _charge(node_config, 3)
    _charge(node_config, 3)
    ledger = state / "ledger.jsonl"
    ledger.write_text("\n".join(ledger.read_text().splitlines()[:2]) + "\n")  # a line removed
    assert site.main(_args(material, state_dir=str(state))) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "does not match its head" in line and "restore the ledger" in line
    assert site.main(["status", "--policy", str(material / "policy.toml"), "--state-dir", str(state)]) == 2


# ------------------------------------------------------------------ the supervisor, with stand-in processes


def _plan(material: Path) -> site.SitePlan:
    node_config, policy = site.read_policy(material / "policy.toml", material / "site.csv", material / "unused")
    return site.SitePlan("127.0.0.1:9091", material / "certs" / "ca.crt", material / "keys" / "hospital-a",
                         node_config, policy, {}, 9094)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _sleeper(pid_file: Path) -> list[str]:
    """A stand-in that records its pid, checks that Flower's telemetry is off, and sleeps."""
    return _python(f"import os, time; assert os.environ['FLWR_TELEMETRY_ENABLED'] == '0'; "
                   f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")


def test_supervisor_stops_both_on_sigterm(material, monkeypatch, tmp_path):
    """SIGTERM to the command stops the SuperNode and its executor (one process group) and exits 0; both ran with
    Flower's telemetry off (a stand-in without it exits at once, which the SuperNode's would report)."""
    monkeypatch.setattr(site, "supernode_command", lambda plan: _sleeper(tmp_path / "supernode.pid"))
    monkeypatch.setattr(site, "executor_command", lambda address, pid: _sleeper(tmp_path / "executor.pid"))
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    assert site.supervise(_plan(material)) == 0
    timer.join()
    pids = [int((tmp_path / f"{name}.pid").read_text()) for name in ("supernode", "executor")]
    assert os.getpgid(os.getpid()) not in pids and not any(map(_alive, pids))


def test_supervisor_restarts_a_dying_executor_a_bounded_number_of_times(material, monkeypatch, capsys):
    monkeypatch.setattr(site, "supernode_command", lambda plan: _python("import time; time.sleep(60)"))
    monkeypatch.setattr(site, "executor_command", lambda address, pid: _python("raise SystemExit(3)"))
    assert site.supervise(_plan(material)) == 1
    err = capsys.readouterr().err
    assert err.count("restarting it") == site.MAX_RESTARTS and "stopping the site" in err


def test_supervisor_exits_with_the_supernode(material, monkeypatch, tmp_path):
    monkeypatch.setattr(site, "supernode_command", lambda plan: _python(
        "import time; time.sleep(1); raise SystemExit(5)"))
    monkeypatch.setattr(site, "executor_command", lambda address, pid: _sleeper(tmp_path / "executor.pid"))
    assert site.supervise(_plan(material)) == 5
    assert not _alive(int((tmp_path / "executor.pid").read_text()))


def test_status_of_a_site_that_has_released_nothing(material, tmp_path, capsys):
    assert site.main(["status", "--policy", str(material / "policy.toml"), "--state-dir", str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "epsilon 0.0000 of 1 spent" in out and ": none yet)" in out
    assert "last message recorded: none recorded yet" in out and not (tmp_path / "new").exists()


def test_status_reads_the_file_the_clientapp_keeps_its_test_metrics_in():
    from flwr_app import client_app

    assert site.EVALUATION_FILE == client_app.EVALUATION_FILE


def test_a_ledger_of_another_data_file_or_order_stops_the_start(material, tmp_path, capsys, no_process):
    """The checks the site makes at its first message, made before it connects: the ledger's data file and order."""
    state = tmp_path / "state"
    node_config, _ = site.read_policy(material / "policy.toml", material / "site.csv", state)
    _charge(node_config, 1)
    other = tmp_path / "other.csv"
    other.write_text((material / "site.csv").read_text() + "61.0,2,5.0,1\n")
    assert site.main(_args(material, state_dir=str(state), data=str(other))) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "holds the budget of another data file" in line and str(other) in line
    (tmp_path / "order.toml").write_text(POLICY + "privacy-rdp-order = 7\n")
    assert site.main(_args(material, state_dir=str(state), policy=str(tmp_path / "order.toml"))) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "privacy-rdp-order = 7" in line and "ledger.jsonl" in line


def test_a_deployed_site_records_every_message_it_handles_and_status_shows_the_last(tmp_path):
    """Each message a deployed site handles is one line of its own messages.jsonl (type, round, outcome), in the
    order the server sent them; ``last_message`` reads the record."""
    from models.data.datasets import load_flchain
    from simulations.engine import run_inprocess

    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    configs = []
    for index, part in enumerate(np.array_split(np.random.default_rng(0).permutation(len(frame))[:600], 3)):
        path = tmp_path / f"site-{index}.csv"
        frame.iloc[part].reset_index(drop=True).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index}", "site-dir": str(tmp_path / f"dir-{index}")})
    sent = []
    run_inprocess({"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                   "federation.num_sites": 3, "federation.rounds": 2, "train.local_epochs": 1,
                   "evaluation.server_side": False, "baseline.centralized": False, "output.dir": str(tmp_path / "run")},
                  node_configs=configs,
                  observe=lambda message, reply: sent.append(message) if message.metadata.dst_node_id == 1 else None)
    record = [json.loads(line) for line in (tmp_path / "dir-0" / "messages.jsonl").read_text().splitlines()]
    assert [line["type"] for line in record] == [message.metadata.message_type for message in sent]
    assert {line["outcome"] for line in record} == {"replied"}
    assert [line["round"] for line in record if line["type"] == "train"] == [1, 2]
    assert f"{record[-1]['type']}: replied" in site.last_message(tmp_path / "dir-0", [])
