"""Flower simulation overhead: the same FedAvg experiment through Flower and as a bare loop.

Both paths build the same data, model and initialisation (``flwr_app.task``), train every site
with the same seeds and the same number of local steps, evaluate every site on its own test part
each round, and average with the same weights. The Flower path is the real ServerApp/ClientApp
through the simulation engine (Ray); the bare path is a plain in-process Python loop
(:func:`simulations.inprocess.run_federation` with ``evaluate_sites=True``). The Flower
path is timed twice: cold (the run starts Ray and shuts it down, as a single ``flwr run`` does)
and on a Ray cluster started beforehand (:func:`simulations.engine.ray_cluster`, as a sweep runs
its jobs; the cluster's start-up is reported on its own). The script prints one JSON object with
the wall times, the ratios and the final C-indices (which agree up to floating-point summation
order when the paths train the same model).

Usage::

    python benchmarks/flower_overhead.py [--rounds 50] [--sites 5] [key=value ...]

Target: ratio ≤ 2 on a 50-round FLCHAIN run (aim 1.2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulations.engine import ray_cluster, resolve, run_simulation  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from simulations.inprocess import run_federation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="run-config overrides key=value")
    args = parser.parse_args()
    overrides: dict = {
        "federation.rounds": args.rounds,
        "federation.num_sites": args.sites,
        "evaluation.server_side": False,
        "baseline.centralized": False,
    }
    overrides.update({key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)})
    torch.set_num_threads(1)

    _, cfg = resolve(overrides)
    started = time.perf_counter()
    bare = run_federation(cfg, evaluate_sites=True)
    bare_s = time.perf_counter() - started

    def flower() -> tuple[float, dict, float]:
        """Wall time, summary, and the mean time of the rounds after the first (from metrics.jsonl)."""
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            summary = run_simulation({**overrides, "output.dir": out})
            wall_s = time.perf_counter() - started
            elapsed = [json.loads(line)["elapsed_s"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        return wall_s, summary, (elapsed[-1] - elapsed[0]) / max(len(elapsed) - 1, 1)

    flower_s, summary, _ = flower()
    started = time.perf_counter()
    with ray_cluster():
        cluster_s = time.perf_counter() - started
        shared_s, shared, round_s = flower()

    print(json.dumps({
        "benchmark": "flower_simulation_overhead",
        "rounds": overrides["federation.rounds"],
        "sites": overrides["federation.num_sites"],
        "overrides": {key: value for key, value in overrides.items()},
        "bare_loop_wall_s": round(bare_s, 2),
        "flower_wall_s": round(flower_s, 2),
        "ratio_flower_over_bare": round(flower_s / bare_s, 3),
        "flower_shared_ray_wall_s": round(shared_s, 2),
        "ratio_flower_shared_ray_over_bare": round(shared_s / bare_s, 3),
        "ray_cluster_start_s": round(cluster_s, 2),
        "flower_round_after_the_first_s": round(round_s, 4),
        "bare_loop_wall_per_round_s": round(bare_s / overrides["federation.rounds"], 4),
        "target_ratio": 2.0,
        "bare_sites_mean_c_index": bare["sites_mean"]["c_index"],
        "flower_sites_mean_c_index": summary["test"].get("c_index"),
        "flower_shared_ray_sites_mean_c_index": shared["test"].get("c_index"),
    }, indent=2))


if __name__ == "__main__":
    main()
