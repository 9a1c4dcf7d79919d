"""Flower simulation overhead: the same FedAvg experiment through Flower and as a bare loop.

Both paths build the same data, model and initialisation (``flwr_app.task``), train every site
with the same seeds and the same number of local steps, evaluate every site on its own test part
each round, and average with the same weights. The Flower path is the real ServerApp/ClientApp
through the simulation engine (Ray); the bare path is a plain in-process Python loop. The script
prints one JSON object with both wall times, their ratio and both final C-indices (which agree up
to floating-point summation order when the paths train the same model).

Usage::

    python benchmarks/flower_overhead.py [--rounds 50] [--sites 5] [key=value ...]

Target (DESIGN §8): ratio ≤ 2 on a 50-round FLCHAIN run (aim 1.2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import task  # noqa: E402
from simulations.engine import resolve, run_simulation  # noqa: E402


def bare_fedavg(overrides: dict) -> dict:
    """FedAvg as a plain loop over sites, mirroring the ClientApp/ServerApp steps."""
    _, cfg = resolve(overrides)
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    global_state = {key: value.clone() for key, value in model.net.state_dict().items()}
    for server_round in range(1, cfg.federation.rounds + 1):
        states, weights = [], []
        for index, site in enumerate(dataset.sites):
            model.net.load_state_dict(global_state)
            seed = int(np.random.SeedSequence([cfg.seed, server_round, index]).generate_state(1)[0])
            task.train_local(model, site.train, cfg, seed=seed)
            states.append({key: value.detach().clone() for key, value in model.net.state_dict().items()})
            weights.append(len(site.train))
        total = float(sum(weights))
        global_state = {
            key: sum(state[key] * (weight / total) for state, weight in zip(states, weights))
            for key in global_state
        }
        model.net.load_state_dict(global_state)
        if model.needs_baseline:
            aggregates = [model.breslow_aggregates(s.train.x, s.train.time, s.train.event) for s in dataset.sites]
            model.set_baseline(sum(a[0] for a in aggregates), sum(a[1] for a in aggregates))
        site_metrics = [task.evaluate(model, site.test, site.train) for site in dataset.sites]
    weights = np.array([len(site.test) for site in dataset.sites], dtype=float)
    c_index = np.array([metrics["c_index"] for metrics in site_metrics])
    return {"sites_mean_c_index": float(np.sum(weights * c_index) / weights.sum())}


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
    for item in args.overrides:
        key, value = item.split("=", 1)
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    torch.set_num_threads(1)

    started = time.perf_counter()
    bare = bare_fedavg(overrides)
    bare_s = time.perf_counter() - started

    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        summary = run_simulation({**overrides, "output.dir": out})
        flower_s = time.perf_counter() - started

    print(json.dumps({
        "benchmark": "flower_simulation_overhead",
        "rounds": args.rounds,
        "sites": args.sites,
        "overrides": {key: value for key, value in overrides.items()},
        "flower_wall_s": round(flower_s, 2),
        "bare_loop_wall_s": round(bare_s, 2),
        "ratio_flower_over_bare": round(flower_s / bare_s, 3),
        "target_ratio": 2.0,
        "flower_sites_mean_c_index": summary["test"].get("c_index"),
        "bare_sites_mean_c_index": bare["sites_mean_c_index"],
    }, indent=2))


if __name__ == "__main__":
    main()
