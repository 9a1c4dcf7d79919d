"""A site's privacy ledger is tamper-evident (flwr_app.site_store, flwr_app.site_policy): its lines are hash-chained,
its head is kept in the site's directory, and a ledger deleted, cut short or edited (or its head deleted) stops every
release with a one-line message for the operator, while what a crash leaves (a torn last line, a line without its
head) is repaired and charging goes on. In-process runs get a run ID of their own."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flwr_app import site_policy, site_store
from flwr_app.site_policy import PolicyRefusal, Request, announce, enforce, read_ledger
from flwr_app.site_store import GENESIS, LedgerTampered

ROOT = Path(__file__).resolve().parents[1]
REQUEST = Request("dp_sgd", 1, 1, "train", "model update", ((20.0, 0.1, 100),))


def _node(tmp_path, **extra):
    data = tmp_path / "site.csv"
    if not data.exists():
        data.write_text("age,futime,death\n50,100,1\n61,250,0\n72,30,1\n")
    return {"data-path": str(data), "site-name": "site-a", "privacy-ledger": str(tmp_path / "ledger.jsonl"),
            "privacy-max-epsilon": 1.0, **extra}


def _charged(tmp_path, count=3, **extra):
    node = _node(tmp_path, **extra)
    for _ in range(count):
        enforce(node, "site-a", REQUEST)
    return node, tmp_path / "ledger.jsonl", site_store.ledger_head(node, tmp_path / "ledger.jsonl")


def _releases(ledger):
    return [line for line in read_ledger(ledger) if line["kind"] == "release"]


def test_each_line_chains_to_the_one_before_and_the_head_in_the_site_directory_names_the_last(tmp_path):
    site = tmp_path / "site"
    node, ledger, head = _charged(tmp_path, **{"site-dir": str(site)})
    assert head == site / "ledger.jsonl.head" and not (tmp_path / "ledger.jsonl.head").exists()
    raw = ledger.read_bytes().splitlines(keepends=True)
    lines = [json.loads(line) for line in raw]
    assert [line["kind"] for line in lines] == ["header", "release", "release", "release"]
    assert lines[0]["prev"] == GENESIS == "0" * 64
    assert [line["prev"] for line in lines[1:]] == [hashlib.sha256(line).hexdigest() for line in raw[:-1]]
    assert json.loads(head.read_text()) == {"lines": 4, "sha256": hashlib.sha256(raw[-1]).hexdigest()}
    assert site_policy.main([str(ledger), "--site-dir", str(site), "--verify"]) == 0
    assert site_policy.main([str(ledger), "--verify"]) == 2  # its head is not beside it


def _delete_ledger(ledger, head):
    ledger.unlink()


def _drop_last_line(ledger, head):
    ledger.write_bytes(b"".join(ledger.read_bytes().splitlines(keepends=True)[:-1]))


def _edit_middle_line(ledger, head):
    raw = ledger.read_bytes().splitlines(keepends=True)
    line = json.loads(raw[2])
    raw[2] = (json.dumps({**line, "rdp": 0.0}) + "\n").encode()  # the same line, its cost erased
    ledger.write_bytes(b"".join(raw))


def _edit_last_line(ledger, head):
    ledger.write_bytes(ledger.read_bytes().replace(b'"round": 1', b'"round": 2'))


def _delete_head(ledger, head):
    head.unlink()


@pytest.mark.parametrize("tamper", [_delete_ledger, _drop_last_line, _edit_middle_line, _edit_last_line,
                                    _delete_head])
def test_a_ledger_deleted_cut_short_or_edited_or_its_head_deleted_stops_every_release(tmp_path, capsys, tamper):
    node, ledger, head = _charged(tmp_path)
    tamper(ledger, head)
    before = {path: path.read_bytes() if path.exists() else None for path in (ledger, head)}
    for attempt in (lambda: enforce(node, "site-a", REQUEST), lambda: announce(node)):
        with pytest.raises(LedgerTampered) as caught:
            attempt()
        message = str(caught.value)
        assert "\n" not in message and str(ledger) in message and str(head) in message
        assert "releases nothing until an operator acts" in message
        assert "restore the ledger from the site's backup" in message and "remove both" in message
        assert '"kind"' not in message and "rdp" not in message and "sha256" not in message.lower()
        assert {path: path.read_bytes() if path.exists() else None for path in (ledger, head)} == before
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, PolicyRefusal)
    capsys.readouterr()
    assert site_policy.main([str(ledger), "--verify"]) == 2
    assert site_policy.main([str(ledger)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith("error: privacy ledger ") and "remove both" in err


def test_removing_both_files_knowingly_starts_a_new_budget(tmp_path):
    node, ledger, head = _charged(tmp_path)
    ledger.unlink()
    head.unlink()
    enforce(node, "site-a", REQUEST)
    assert [line["kind"] for line in read_ledger(ledger)] == ["header", "release"]
    assert json.loads(head.read_text())["lines"] == 2


def test_a_torn_last_line_is_repaired_and_the_ledger_keeps_charging(tmp_path, capfd):
    node, ledger, head = _charged(tmp_path)
    complete = ledger.read_bytes()
    last = complete.splitlines(keepends=True)[-1]
    with ledger.open("ab") as handle:  # a crash mid-append: half a line, no newline
        handle.write(last[: len(last) // 2])
    assert site_store.read_verified(ledger, head).torn == len(last) // 2
    assert site_policy.main([str(ledger), "--verify"]) == 0
    assert ledger.read_bytes().endswith(last[: len(last) // 2])  # the command changes nothing
    capfd.readouterr()
    enforce(node, "site-a", REQUEST)
    err = capfd.readouterr().err
    assert "repaired" in err and str(ledger) in err and err.count("\n") == 1
    assert ledger.read_bytes().startswith(complete) and len(_releases(ledger)) == 4
    state = site_store.read_verified(ledger, head)
    assert (state.torn, state.ahead, state.head.lines) == (0, False, 5)


def test_a_line_whose_head_was_not_written_is_accepted_and_the_head_caught_up(tmp_path, capfd):
    node, ledger, head = _charged(tmp_path)
    old_head = head.read_bytes()
    enforce(node, "site-a", REQUEST)
    head.write_bytes(old_head)  # a crash between the synced append and the head's replacement
    capfd.readouterr()
    assert announce(node).spent == pytest.approx(sum(line["rdp"] for line in _releases(ledger)))
    err = capfd.readouterr().err
    assert "head updated" in err and err.count("\n") == 1
    assert json.loads(head.read_text())["lines"] == 5
    enforce(node, "site-a", REQUEST)
    head.write_bytes(old_head)  # two lines ahead of its head: no crash leaves that
    with pytest.raises(LedgerTampered, match="the ledger has 6 lines, its head records 4"):
        enforce(node, "site-a", REQUEST)
    head.unlink()
    ledger.write_bytes(ledger.read_bytes().splitlines(keepends=True)[0])  # a header alone, its head not written
    enforce(node, "site-a", REQUEST)
    assert [line["kind"] for line in read_ledger(ledger)] == ["header", "release"]
    head.write_bytes(old_head)
    with pytest.raises(LedgerTampered, match="the ledger has 2 lines, its head records 4"):
        enforce(node, "site-a", REQUEST)


CHILD = """
import json, os, sys
from flwr_app import site_policy
node = json.loads(sys.argv[1])
request = site_policy.Request("dp_sgd", 1, 1, "train", "model update", ((50.0, 0.01, 1),))
parent = os.getppid()
while os.getppid() == parent:  # a test killed before it kills this process: it stops by itself
    site_policy.enforce(node, "site-a", request)
"""


def _kill_mid_append(node, ledger, delay):
    """Run a process that charges in a loop; kill -9 it ``delay`` s after the ledger has grown by two lines."""
    lines = len(ledger.read_bytes().splitlines()) if ledger.exists() else 0
    process = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(node)], cwd=ROOT, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not ledger.exists() or len(ledger.read_bytes().splitlines()) < lines + 2:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the process charged nothing within 60 s"
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(10) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.05])
def test_a_site_killed_mid_append_charges_on_and_its_budget_is_its_lines(tmp_path, delay):
    node = _node(tmp_path, **{"privacy-max-epsilon": 10.0})
    ledger = tmp_path / "ledger.jsonl"
    request = Request("dp_sgd", 1, 1, "train", "model update", ((50.0, 0.01, 1),))
    for _ in range(2):
        _kill_mid_append(node, ledger, delay)
        enforce(node, "site-a", request)  # works, or repairs a torn line: never LedgerTampered
    state = site_store.read_verified(ledger, site_store.ledger_head(node, ledger))
    releases = [line for line in state.records if line["kind"] == "release"]
    assert (state.torn, state.ahead) == (0, False) and state.head.lines == len(state.records) == len(releases) + 1
    assert announce(node).spent == pytest.approx(len(releases) * releases[0]["rdp"])


def test_each_in_process_grid_has_a_run_id_of_its_own():
    from flwr.clientapp import ClientApp

    from simulations.inprocess import InProcessGrid

    grids = [InProcessGrid(ClientApp(), {}, 2) for _ in range(2)]
    try:
        first, second = (grid.run_id for grid in grids)
        assert first != second and 0 < first < 2**63 and 0 < second < 2**63
        assert {context.run_id for context in grids[0].contexts.values()} == {first} == {grids[0].run.run_id}
        assert InProcessGrid(ClientApp(), {}, 1, run_id=7).contexts[1].run_id == 7
    finally:
        for grid in grids:
            grid.close()
