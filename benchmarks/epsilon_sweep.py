"""Benchmark: a full ε sweep of every horizontal strategy on FLCHAIN, end to end through Flower.

Runs FedAvg once and each DP strategy (``dp_sgd``, ``bdp``, ``central_dp``, ``nbafl``, ``ls_adp``,
``row_dp``) at every ε of ``--epsilons`` (default 0.5, 1, 2, 10: 25 runs, 1 seed), each as the
default experiment (5 IID sites, 20 rounds) through Flower's simulation engine, one after the
other in this process, as ``simulations.sweep`` does. The same-run reference is the same 25 runs
with the real ServerApp and ClientApp over the in-process grid
(:func:`simulations.engine.run_inprocess`: no Ray, no serialisation), so
``ratio = flower_total_s / inprocess_total_s`` is what the simulation engine costs a sweep.
Both give the same final model for every strategy but ``central_dp``, whose noise Flower draws
unseeded; ``same_c_index`` says where the test C-indices agree.

Prints one JSON object. Target: the whole sweep (4 ε × 7 strategies, 1 seed) in
under 20 minutes on 2 cores.

Usage::

    python benchmarks/epsilon_sweep.py [--epsilons 0.5,1,2,10] [--seed 0] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import interrupt
from simulations.engine import ray_cluster, run_inprocess, run_simulation  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from simulations.results_file import code_commit  # noqa: E402

DP_STRATEGIES = ("dp_sgd", "bdp", "central_dp", "nbafl", "ls_adp", "row_dp")


def _timed(run, overrides: dict) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        summary = run({**overrides, "output.dir": out})
        return time.perf_counter() - started, summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", default="0.5,1,2,10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="run-config key=value shared by every run")
    args = parser.parse_args(argv)
    shared = {"seed": args.seed, "baseline.centralized": False,
              **{key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}}
    runs = [{"strategy.name": "fedavg"}] + [{"strategy.name": strategy, "privacy.epsilon": float(epsilon)}
                                             for strategy in DP_STRATEGIES for epsilon in args.epsilons.split(",")]
    rows = []
    with ray_cluster():  # as `python -m simulations.sweep` runs its jobs: Ray starts once
        for run in runs:
            overrides = {**shared, **run}
            flower_s, flower = _timed(lambda o: run_simulation(o, engine="ray"), overrides)
            inprocess_s, inprocess = _timed(run_inprocess, overrides)
            c_index = flower["test"].get("c_index", math.nan)
            rows.append({"strategy": run["strategy.name"], "epsilon": run.get("privacy.epsilon"),
                         "flower_s": round(flower_s, 2), "inprocess_s": round(inprocess_s, 2),
                         "c_index": c_index, "epsilon_spent": flower["privacy"]["epsilon"],
                         "same_c_index": c_index == inprocess["test"].get("c_index", math.nan)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    flower_total = sum(row["flower_s"] for row in rows)
    inprocess_total = sum(row["inprocess_s"] for row in rows)
    report = {"benchmark": "epsilon_sweep", "runs": len(rows), "flower_total_s": round(flower_total, 1),
              "inprocess_total_s": round(inprocess_total, 1), "ratio": round(flower_total / inprocess_total, 3),
              "target_flower_total_s": 1200, "commit": code_commit(), "rows": rows}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
