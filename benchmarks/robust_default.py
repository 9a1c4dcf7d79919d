"""How the default ``federation.update_bound`` was chosen: centred clipping's bound on validation splits, honest
heterogeneous federations and attacked ones.

The default aggregator is FedAvg's weighted mean with each update's pull from the coordinate-wise median bounded to
``update_bound`` x the median distance (:func:`strategies.horizontal.centred_clip`). A coalition of colluding sites
(fewer than half) cannot move the median or the median distance beyond the honest sites' own spread, so together
it moves the mean by at most its share of the weight x ``update_bound`` x that distance: the smaller the bound,
the less a coalition inside it can add up, and the more the honest sites farthest from the median are held in.

Candidates (:data:`BOUNDS`; 5 was the default before). No test record is read:

* **honest heterogeneous federations** (the cost): SBA over its 4 regions and its 40 states with at least 100
  loans (the seed's training records, 80/20 into ``train`` and validation within each site,
  :func:`benchmarks.server_optimizers.validation_csv`), and FLCHAIN's training records (5 i.i.d. centres,
  :func:`benchmarks.setup_share.validation_csv`) with centre 0's follow-up ending at 90 days (:func:`short_centre`);
  no attack; C of the global model on the pooled validation parts;
* **attacked federations** (the benefit): FLCHAIN's validation file at 3 and 5 i.i.d. sites under the update-level
  attacks of :mod:`benchmarks.hostile_matrix` (:data:`ATTACKS`; ``adaptive_inside`` placed just inside each
  candidate's own bound), each against the clean run of the same bound, sites and seed.

Every run has the schema's default rounds and training. The choice (:func:`choose`): among the bounds whose mean
validation C on every honest federation is within :data:`COST` of the old default's, the one with the smallest
worst loss under attack (the largest over sites and attacks of the mean over seeds of clean C − attacked C)::

    python -m benchmarks.robust_default [--seeds 0,1] [--bounds 5,2,1.5,1] [--out rows.jsonl]
    python -m benchmarks.robust_default --rows docs/results/benchmarks/robust_default.jsonl   # the table, the choice

On seeds 0 and 1 (``docs/results/benchmarks/robust_default.jsonl``; 136 runs, 2-core machine, about 10 minutes),
bound 1 costs at most 0.0052 of validation C (SBA's 40 states) and loses at most 0.0082 under attack (a sign-flipped
x5 update at 1 of 3 sites); 5, the old default, loses 0.476 to a coalition of 2 of 5 sites just inside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks import hostile_matrix
from benchmarks.server_optimizers import validation_csv as natural_validation_csv
from benchmarks.setup_share import validation_csv
from flwr_app import interrupt
from simulations.engine import run_inprocess
from simulations.results_file import append_jsonl
from strategies.config import TRAINING_DEFAULTS

BOUNDS = (5.0, 2.0, 1.5, 1.0)
#: The old default, the reference of the cost.
REFERENCE = 5.0
#: The largest mean validation-C cost on an honest federation a candidate may have: the tolerance the default is held
#: to on the test splits (a first run of the choice at 0.005 admitted 1.5 but not 1, and 1.5's worst validation loss,
#: 0.014 under a sign-flipped x5 update at 1 of 3 sites, is beyond that same tolerance; both figures are in the rows).
COST = 0.01
ATTACKS = ("sign_flip_x5", "scale_1e6", "collude_x3", "adaptive_inside", "little_is_enough", "inner_product")
SHORT_DAYS = 90.0
DEFAULT_ROUNDS = TRAINING_DEFAULTS["federation.rounds"]


def short_centre(path: Path, seed: int, *, sites: int = 5) -> Path:
    """FLCHAIN's validation file with a ``centre`` column (``sites`` i.i.d. centres by ``seed``) whose centre 0 has
    every record censored at :data:`SHORT_DAYS` days (an administrative end of follow-up)."""
    frame = pd.read_csv(path)
    centre = np.random.default_rng([seed, 7]).integers(0, sites, len(frame))
    short = (centre == 0) & (frame["time"] > SHORT_DAYS)
    frame.loc[short, "time"], frame.loc[short, "event"] = SHORT_DAYS, 0
    frame["centre"] = [f"centre-{c}" for c in centre]
    out = path.with_name(path.stem + "_short_centre.csv")
    frame.to_csv(out, index=False)
    return out


def honest_files(seed: int, folder: Path) -> dict[str, dict[str, Any]]:
    """The honest heterogeneous federations of ``seed``: name -> run-config overrides."""
    flchain = validation_csv("flchain", seed, folder)
    return {
        "SBA, 4 regions": {"data.path": str(natural_validation_csv("region", seed, folder)),
                           "federation.partition": "region"},
        "SBA, 40 states": {"data.path": str(natural_validation_csv("State", seed, folder)),
                           "federation.partition": "State", "federation.min_site_records": 100},
        "FLCHAIN, 5 centres, one with short follow-up": {"data.path": str(short_centre(flchain, seed)),
                                                         "federation.partition": "centre"},
    }


def honest_row(name: str, overrides: dict[str, Any], bound: float, seed: int, folder: Path) -> dict[str, Any]:
    out = folder / f"honest-{len(list(folder.iterdir()))}"
    summary = run_inprocess({"data.name": "csv", "data.split_col": "split", "seed": seed, "baseline.centralized": False,
                             "federation.update_bound": bound, "output.dir": str(out), **overrides})
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return {"kind": "honest", "federation": name, "bound": bound, "seed": seed, "c_index": summary["test"]["c_index"],
            "sites": summary["num_sites"], "failures": sum(len(line["failures"]) for line in lines),
            "flags": sum(len(line["flags"]) for line in lines)}


def attacked_row(sites: int, attack: str, bound: float, seed: int, folder: Path, path: Path) -> dict[str, Any]:
    overrides = {"data.name": "csv", "data.path": str(path), "data.split_col": "split",
                 "federation.update_bound": bound}
    run = folder / f"attacked-{bound:g}"
    run.mkdir(exist_ok=True)
    row = hostile_matrix.run_cell(sites, "fedavg", seed, attack, run, rounds=DEFAULT_ROUNDS, overrides=overrides)
    return {"kind": "attacked", "sites": sites, "attack": attack, "bound": bound, "seed": seed,
            "c_index": row.get("c_index"), "finished": row["finished"], "named": row["named"],
            "attackers": row["attackers"]}


def _mean(rows: list[dict[str, Any]]) -> float:
    return statistics.mean(row["c_index"] for row in rows)


def costs(rows: list[dict[str, Any]]) -> dict[float, dict[str, float]]:
    """Each bound's mean validation C minus the reference's, per honest federation (paired seeds)."""
    honest = [row for row in rows if row["kind"] == "honest"]
    out: dict[float, dict[str, float]] = {}
    for bound in sorted({row["bound"] for row in honest}, reverse=True):
        for name in dict.fromkeys(row["federation"] for row in honest):
            mine = {row["seed"]: row["c_index"] for row in honest if (row["bound"], row["federation"]) == (bound, name)}
            ref = {row["seed"]: row["c_index"] for row in honest
                   if (row["bound"], row["federation"]) == (REFERENCE, name)}
            paired = [mine[seed] - ref[seed] for seed in mine if seed in ref]
            if paired:
                out.setdefault(bound, {})[name] = statistics.mean(paired)
    return out


def losses(rows: list[dict[str, Any]]) -> dict[float, dict[str, float]]:
    """Each bound's mean over seeds of clean C − attacked C, per (sites, attack)."""
    attacked = [row for row in rows if row["kind"] == "attacked" and row["finished"]]
    out: dict[float, dict[str, float]] = {}
    for row in attacked:
        if row["attack"] == hostile_matrix.CLEAN:
            continue
        clean = [other["c_index"] for other in attacked if other["attack"] == hostile_matrix.CLEAN and
                 (other["bound"], other["sites"], other["seed"]) == (row["bound"], row["sites"], row["seed"])]
        if clean:
            out.setdefault(row["bound"], {}).setdefault(f"{row['sites']} sites, {row['attack']}", []).append(
                clean[0] - row["c_index"])
    return {bound: {cell: statistics.mean(values) for cell, values in cells.items()} for bound, cells in out.items()}


def choose(rows: list[dict[str, Any]]) -> float:
    """Among the bounds within :data:`COST` of the reference on every honest federation, the smallest worst loss."""
    cost, loss = costs(rows), losses(rows)
    admissible = [bound for bound, cells in cost.items() if min(cells.values()) >= -COST and bound in loss]
    return min(admissible, key=lambda bound: (max(loss[bound].values()), -bound))


def table(rows: list[dict[str, Any]]) -> str:
    cost, loss = costs(rows), losses(rows)
    federations = list(dict.fromkeys(name for cells in cost.values() for name in cells))
    cells = list(dict.fromkeys(cell for values in loss.values() for cell in values))
    lines = ["| update_bound | " + " | ".join(federations + cells) + " | worst loss |",
             "| --- |" + " --- |" * (len(federations) + len(cells) + 1)]
    for bound in sorted(set(cost) | set(loss), reverse=True):
        figures = [f"{cost.get(bound, {}).get(name, float('nan')):+.4f}" for name in federations]
        figures += [f"{loss.get(bound, {}).get(cell, float('nan')):+.4f}" for cell in cells]
        worst = max(loss.get(bound, {}).values(), default=float("nan"))
        lines.append(f"| {bound:g} | " + " | ".join(figures) + f" | {worst:+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--bounds", default=",".join(f"{bound:g}" for bound in BOUNDS))
    parser.add_argument("--sites", default="3,5")
    parser.add_argument("--out", type=Path, default=None, help="append the rows here (JSON lines)")
    parser.add_argument("--rows", type=Path, default=None, help="only summarise these saved rows")
    args = parser.parse_args(argv)
    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text(encoding="utf-8").splitlines()]
        print(table(rows))
        print(f"chosen update_bound: {choose(rows):g}")
        return 0
    bounds = [float(value) for value in args.bounds.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed in (int(value) for value in args.seeds.split(",")):
            files = Path(tmp) / f"files-{seed}"
            files.mkdir()
            federations = honest_files(seed, files)
            flchain = validation_csv("flchain", seed, files)
            for bound in bounds:
                work = folder / f"runs-{seed}-{bound:g}"
                work.mkdir()
                jobs = [lambda name=name, o=o: honest_row(name, o, bound, seed, work) for name, o in federations.items()]
                jobs += [lambda n=n, a=a: attacked_row(n, a, bound, seed, work, flchain)
                         for n in (int(value) for value in args.sites.split(",")) for a in (hostile_matrix.CLEAN,) + ATTACKS]
                for job in jobs:
                    rows.append(job())
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if args.out:
                        append_jsonl(args.out, rows[-1])
    print(table(rows))
    print(f"chosen update_bound: {choose(rows):g}")
    return 0


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
