"""Benchmark: honest heterogeneous sites are never refused (no-DP FedAvg, default settings).

Runs no-DP FedAvg on natural partitions of real data and counts, over every round, the failures
(refused or missing replies, by phase) and the flags (kept, with the reason) of each site, and how
many sites appear in ``summary.json``:

* SBA's loans over its 4 regions and over its 40 states with at least 100 loans, seeds 0 … ``--seeds - 1``;
* FLCHAIN over 5 IID centres where one centre's follow-up ends early: its records are censored at
  ``--short-days`` days (an administrative end of follow-up; default 90, about 1% of FLCHAIN's),
  written as a CSV file with a ``centre`` column (``federation.partition=centre``).

Every site is honest, so every failure is an honest site refused::

    python -m benchmarks.heterogeneous_sites [--seeds 5] [--rounds 20] [--set KEY=VALUE ...] [--out rows.jsonl]

``--set federation.update_bound=5 --set federation.max_weight_ratio=0`` runs the defaults before the robust default
(the paired reference of its cost).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from flwr_app import interrupt
from models.data import load_table
from models.data.files import resolve_data_dir
from simulations.engine import run_inprocess
from simulations.results_file import append_jsonl

FEDERATIONS = {
    "SBA, 4 regions": {"data.name": "sba", "federation.partition": "region"},
    "SBA, 40 states": {"data.name": "sba", "federation.partition": "State", "federation.min_site_records": 100},
}


def short_follow_up_csv(folder: Path, *, days: float, seed: int, sites: int = 5) -> Path:
    """FLCHAIN with a ``centre`` column (``sites`` IID centres); centre 0's records censored at ``days``."""
    table = load_table("flchain", data_dir=str(resolve_data_dir("")))
    frame = table.features.copy()
    time, event = table.time.astype(np.float64).copy(), table.event.astype(int).copy()
    centre = np.random.default_rng(seed).integers(0, sites, len(frame))
    short = (centre == 0) & (time > days)
    time[short], event[short] = days, 0
    frame["centre"] = [f"centre-{c}" for c in centre]
    frame["time"], frame["event"] = time, event
    path = folder / f"flchain_short_follow_up_{seed}.csv"
    frame.to_csv(path, index=False)
    return path


def count(name: str, overrides: dict[str, Any], seed: int, folder: Path) -> dict[str, Any]:
    """One run: its failures by phase and site, its flags by phase and site, and the sites in summary.json."""
    out = folder / f"{name.replace(' ', '_').replace(',', '')}-{seed}"
    summary = run_inprocess({**overrides, "strategy.name": "fedavg", "seed": seed, "baseline.centralized": False,
                             "output.dir": str(out)})
    failures, flags = collections.Counter(), collections.Counter()
    for text in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        failures.update(f"{f['phase']}: {f['site']}" for f in line["failures"])
        flags.update(f"{f['phase']}: {f['site']}" for f in line["flags"])
    return {"federation": name, "seed": seed, "sites": summary["num_sites"], "in_summary": len(summary["sites"]),
            "failures": dict(failures), "flags": dict(flags), "c_index": summary["test"].get("c_index"),
            "sites_mean_c_index": summary["sites_mean"].get("c_index")}


def _text(settings: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(settings.items())) or "defaults"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: (federation, settings) -> runs, sites, honest sites refused (site-rounds), flagged site-rounds,
    sites in the summary, and C (mean ± std over seeds)."""
    lines = ["| federation | settings | runs | sites | honest site-rounds refused | site-rounds flagged (kept) | "
             "sites in summary.json | C |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, settings in dict.fromkeys((row["federation"], _text(row.get("settings", {}))) for row in rows):
        runs = [row for row in rows if (row["federation"], _text(row.get("settings", {}))) == (name, settings)]
        values = [row["c_index"] for row in runs]
        c_index = f"{np.mean(values):.4f} ± {np.std(values, ddof=1) if len(values) > 1 else 0.0:.4f}"
        refused = sum(sum(row["failures"].values()) for row in runs)
        flagged = sum(sum(row["flags"].values()) for row in runs)
        sites = sorted({row["sites"] for row in runs})
        kept = f"{sum(row['in_summary'] for row in runs)}/{sum(row['sites'] for row in runs)}"
        lines.append(f"| {name} | {settings} | {len(runs)} | "
                     f"{', '.join(map(str, sites))} | {refused} | {flagged} | {kept} | {c_index} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--short-days", type=float, default=90.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config key of every run (repeat; default: the schema's), e.g. federation.update_bound=5")
    parser.add_argument("--only", default="", help="run only the federations whose name contains this")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON lines)")
    args = parser.parse_args(argv)
    settings = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    rows = []
    if args.out:  # one line a run, written as it ends: a stopped benchmark keeps the runs it finished
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("", encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed in range(args.seeds):
            federations = {**FEDERATIONS, "FLCHAIN, 5 centres, one with short follow-up": {
                "data.name": "csv", "federation.partition": "centre",
                "data.path": str(short_follow_up_csv(folder, days=args.short_days, seed=seed))}}
            for name, overrides in federations.items():
                if args.only in name:
                    rows.append({**count(name, {**overrides, **settings, "federation.rounds": args.rounds}, seed,
                                         folder), "settings": settings})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if args.out:
                        append_jsonl(args.out, rows[-1])
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
