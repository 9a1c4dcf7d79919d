"""Benchmark: one hostile site of three under the default settings (FedAvg), replies tampered with on the grid.

Over the in-process grid (the real ServerApp and ClientApp, FLCHAIN, 3 IID sites, 3 rounds), site-1's
replies are replaced between the site and the server, as a compromised site or link would, from round 1:
its training update times 1e3 or 1e6 or -5 (well formed, finite), its round-1 update sent again in every
later round (stale), its training reply sent twice (duplicate), or labelled as node 1, site-0's
(relabelled). For each mode and seed it reports whether the run finished, whether site-1 was named
(a failure, a flag, or a rolled-back round's cause), whether any honest site was, and the final pooled
test C-index beside the clean run's of the same seed::

    python -m benchmarks.hostile_matrix [--seeds 3] [--out docs/results/benchmarks/hostile_matrix.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord, Message

from flwr_app import interrupt
from simulations import engine
from simulations.results_file import append_jsonl

HOSTILE_NODE, HOSTILE_SITE = 2, "site-1"
RUN = {"federation.num_sites": 3, "federation.rounds": 3, "baseline.centralized": False}


def _scaled(factor: float) -> Callable[[list[Message], dict], list[Message]]:
    def tamper(replies: list[Message], _: dict) -> list[Message]:
        for reply in replies:
            if reply.metadata.src_node_id == HOSTILE_NODE and not reply.has_error():
                arrays = reply.content["arrays"]
                reply.content["arrays"] = ArrayRecord({key: Array(array.numpy() * factor)
                                                       for key, array in arrays.items()})
        return replies
    return tamper


def _stale(replies: list[Message], memory: dict) -> list[Message]:
    for reply in replies:
        if reply.metadata.src_node_id == HOSTILE_NODE and not reply.has_error():
            if "arrays" in memory:
                reply.content["arrays"] = memory["arrays"]
            else:
                memory["arrays"] = reply.content["arrays"]
    return replies


def _duplicate(replies: list[Message], _: dict) -> list[Message]:
    return replies + [reply for reply in replies if reply.metadata.src_node_id == HOSTILE_NODE]


def _relabelled(replies: list[Message], _: dict) -> list[Message]:
    for reply in replies:
        if reply.metadata.src_node_id == HOSTILE_NODE:
            reply.metadata.__dict__["_src_node_id"] = 1
    return replies


MODES: dict[str, Callable[[list[Message], dict], list[Message]]] = {
    "x1e3": _scaled(1e3), "x1e6": _scaled(1e6), "sign-flipped x5": _scaled(-5.0), "stale round-1 update": _stale,
    "duplicate reply": _duplicate, "relabelled as site-0": _relabelled,
}


@contextlib.contextmanager
def tampered_training(tamper: Callable[[list[Message], dict], list[Message]] | None) -> Iterator[None]:
    """While open, the in-process grid passes every training reply through ``tamper`` (None: untouched)."""
    original = engine.InProcessGrid.send_and_receive
    memory: dict[str, Any] = {}

    def send_and_receive(grid, messages, *, timeout=None):
        messages = list(messages)
        replies = list(original(grid, messages, timeout=timeout))
        if tamper is not None and messages and messages[0].metadata.message_type == "train":
            replies = tamper(replies, memory)
        return replies

    engine.InProcessGrid.send_and_receive = send_and_receive
    try:
        yield
    finally:
        engine.InProcessGrid.send_and_receive = original


def named_sites(directory: Path) -> set[str]:
    """Every site a run named: in a failure, a flag, or as the cause of a rolled-back round."""
    named: set[str] = set()
    for text in (directory / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        named |= {entry["site"] for entry in line["failures"] + line["flags"]}
        named |= set(line.get("rolled_back", {}).get("sites", []))
    return named


def run_mode(mode: str, seed: int, folder: Path) -> dict[str, Any]:
    """One run of ``mode`` (or ``"clean"``) at ``seed``: finished, who was named, the final C-index."""
    out = folder / f"{mode.replace(' ', '_')}-{seed}"
    try:
        with tampered_training(MODES.get(mode)):
            summary = engine.run_inprocess({**RUN, "seed": seed, "output.dir": str(out)})
    except interrupt.StopRequested:
        raise
    except Exception as err:  # noqa: BLE001 - a run the hostile site stopped is a result here
        return {"mode": mode, "seed": seed, "finished": False, "error": f"{type(err).__name__}: {err}"[:300],
                "named": sorted(named_sites(out)) if (out / "metrics.jsonl").exists() else []}
    return {"mode": mode, "seed": seed, "finished": True, "named": sorted(named_sites(out)),
            "c_index": summary["test"]["c_index"]}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: mode -> finished, hostile named, honest named, final C (mean ± std), largest |C - clean C|."""
    clean = {row["seed"]: row["c_index"] for row in rows if row["mode"] == "clean"}
    lines = ["| mode | finished | site-1 named | honest site named | final C | max abs(C − clean C) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode in ["clean", *MODES]:
        runs = [row for row in rows if row["mode"] == mode]
        finished = [row for row in runs if row["finished"]]
        values = [row["c_index"] for row in finished]
        honest = sum(any(site != HOSTILE_SITE for site in row["named"]) for row in runs)
        hostile = sum(HOSTILE_SITE in row["named"] for row in runs)
        gap = max((abs(row["c_index"] - clean[row["seed"]]) for row in finished), default=float("nan"))
        spread = f"{statistics.mean(values):.4f} ± {statistics.pstdev(values):.4f}" if values else "–"
        lines.append(f"| {mode} | {len(finished)}/{len(runs)} | {'–' if mode == 'clean' else f'{hostile}/{len(runs)}'}"
                     f" | {honest}/{len(runs)} | {spread} | {'–' if mode == 'clean' else f'{gap:.4f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON lines)")
    args = parser.parse_args(argv)
    rows = []
    if args.out:  # one line a run, written as it ends: a stopped benchmark keeps the runs it finished
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("", encoding="utf-8")
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            for mode in ["clean", *MODES]:
                rows.append(run_mode(mode, seed, Path(folder)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                if args.out:
                    append_jsonl(args.out, rows[-1])
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
