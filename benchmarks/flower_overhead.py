"""Flower simulation overhead: the same FedAvg experiment through Flower and as a bare loop.

Both paths build the same data, model and initialisation (``flwr_app.task``), train every site
with the same seeds and the same number of local steps, evaluate every site on its own test part
each round, and average with the same weights. The Flower path is the real ServerApp/ClientApp
through the simulation engine (Ray), and the same apps over the in-process grid
(:func:`simulations.engine.run_inprocess`: the sites one after the other in this process, no Ray,
no serialisation); the bare path is a plain in-process Python loop
(:func:`bare_federation`, this benchmark's reference and nothing else: no messages, no checks of
the replies, no ledger, no outputs; ``tests/test_bare_reference.py`` checks that it ends with the
real apps' figures). Flower's Ray engine is timed twice: cold (the run starts Ray and shuts it
down, as a single ``flwr run`` on Ray does) and on a Ray cluster started beforehand
(:func:`simulations.engine.ray_cluster`, as a sweep runs its jobs; the cluster's start-up is
reported on its own); the default engine (``simulation.engine = auto``: the in-process grid for a
federation this small) once more. The script prints one JSON object with the wall times, the ratios and the final C-indices (which agree up to floating-point summation
order when the paths train the same model).

Usage::

    python benchmarks/flower_overhead.py [--rounds 50] [--sites 5] [key=value ...]

Target: default engine / bare loop ≤ 1.5 on a 50-round FLCHAIN run with 5 sites.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import task  # noqa: E402
from flwr_app.config import ExperimentConfig  # noqa: E402
from models.data import FederatedDataset  # noqa: E402
from models.survival import SurvivalModel  # noqa: E402
from simulations.engine import ray_cluster, resolve, run_inprocess, run_simulation  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from strategies.horizontal import WEIGHT_KEY, weighted_nanmean  # noqa: E402
from strategies.mechanisms.base import SiteSetUp  # noqa: E402
from strategies.mechanisms.registry import horizontal_mechanism  # noqa: E402


def bare_federation(cfg: ExperimentConfig) -> dict[str, float]:
    """``cfg``'s federation as a plain loop: the work of the ServerApp and ClientApp without Flower.

    The same data, model and initialisation (:mod:`flwr_app.task`), every site's local training
    with the same seeds and privacy mechanism, the weighted average in site order (Flower's own
    ``aggregate_arrayrecords``), and after every round every site's evaluation of the global model
    on its own test part (Cox models: with the federated Breslow baseline). Every site trains in
    every round and there is no server-side evaluation (``federation.fraction_train = 1``,
    ``evaluation.server_side = false``) and the plain mean is the new global model (``federation.update_bound = 0``,
    ``federation.server_optimizer = fedavg``).

    Returns
    -------
    dict
        The last round's test-size-weighted mean of the sites' test metrics: the summary's
        ``test`` of the same run through the apps.
    """
    if cfg.federation.fraction_train != 1.0 or cfg.server_evaluation:
        raise ValueError("the bare loop trains every site in every round and evaluates at the sites only: "
                         "set federation.fraction_train = 1 and evaluation.server_side = false")
    if cfg.federation.update_bound != 0:
        raise ValueError(f"the bare loop takes the plain weighted mean: set federation.update_bound = 0 (not "
                         f"{cfg.federation.update_bound:g}, which bounds each update's pull)")
    if cfg.federation.server_optimizer != "fedavg":
        raise ValueError(f"the bare loop takes the weighted mean as the new global model: set "
                         f"federation.server_optimizer = 'fedavg' (not {cfg.federation.server_optimizer!r})")
    mechanism = horizontal_mechanism(cfg.strategy)
    if mechanism.server_side:
        raise ValueError(f"the bare loop does not run strategy {cfg.strategy!r} (a server-side mechanism)")
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    setups = task.federation_setup(cfg).setups
    global_arrays = ArrayRecord(model.net.state_dict())
    order = sorted(range(dataset.num_sites), key=lambda index: dataset.sites[index].name)
    states: dict[int, dict | None] = dict.fromkeys(order)
    site_metrics: dict[str, float] = {}
    for server_round in range(1, cfg.federation.rounds + 1):
        replies = []
        for index in order:
            site = dataset.sites[index]
            model.net.load_state_dict(global_arrays.to_torch_state_dict())
            update = mechanism.site_round(model, site.train, cfg, seed=task.round_seed(cfg.seed, server_round, index),
                                          state=states[index], setup=setups[site.name])
            states[index] = update.state
            if update.contributes:
                replies.append(RecordDict({"arrays": ArrayRecord(model.net.state_dict()), "metrics": MetricRecord(
                    {WEIGHT_KEY: mechanism.aggregation_weight(setups[site.name])})}))
        if replies:
            global_arrays = aggregate_arrayrecords(replies, WEIGHT_KEY)
        site_metrics = _evaluate_sites(model, global_arrays, dataset, setups)
    return site_metrics


def _evaluate_sites(model: SurvivalModel, arrays: ArrayRecord, dataset: FederatedDataset,
                    setups: Mapping[str, SiteSetUp]) -> dict[str, float]:
    """Every site's metrics of the global model on its own test part, weighted by its agreed record count (as the
    ServerApp averages them)."""
    model.net.load_state_dict(arrays.to_torch_state_dict())
    if model.needs_baseline:  # the federated Breslow baseline: every site's (d_k, R_k), summed in site order
        event_counts, risk_sums = None, None
        for site in sorted(dataset.sites, key=lambda site: site.name):
            counts, sums = (np.asarray(part, dtype=np.float64)
                            for part in model.breslow_aggregates(site.train.x, site.train.time, site.train.event))
            event_counts = counts if event_counts is None else event_counts + counts
            risk_sums = sums if risk_sums is None else risk_sums + sums
        model.set_baseline(event_counts, risk_sums)
    return weighted_nanmean({site.name: {**task.evaluate(model, site.test), WEIGHT_KEY: setups[site.name].count}
                             for site in dataset.sites})


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
        "federation.update_bound": 0,
    }
    overrides.update({key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)})
    torch.set_num_threads(1)

    _, cfg = resolve(overrides)
    started = time.perf_counter()
    bare = bare_federation(cfg)
    bare_s = time.perf_counter() - started

    def flower(run=run_simulation) -> tuple[float, dict, float]:
        """Wall time, summary, and the mean time of the rounds after the first (from metrics.jsonl)."""
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            summary = run({**overrides, "output.dir": out})
            wall_s = time.perf_counter() - started
            elapsed = [json.loads(line)["elapsed_s"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        return wall_s, summary, (elapsed[-1] - elapsed[0]) / max(len(elapsed) - 1, 1)

    flower_s, summary, _ = flower(functools.partial(run_simulation, engine="ray"))
    inprocess_s, inprocess, inprocess_round_s = flower(run_inprocess)
    default_s, default, _ = flower()  # simulation.engine = auto: the in-process grid for a federation this small
    started = time.perf_counter()
    with ray_cluster():
        cluster_s = time.perf_counter() - started
        shared_s, shared, round_s = flower()  # auto on a running cluster: Ray

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
        "default_engine_wall_s": round(default_s, 2),
        "ratio_default_engine_over_bare": round(default_s / bare_s, 3),
        "inprocess_wall_s": round(inprocess_s, 2),
        "ratio_inprocess_over_bare": round(inprocess_s / bare_s, 3),
        "inprocess_round_after_the_first_s": round(inprocess_round_s, 4),
        "bare_loop_wall_per_round_s": round(bare_s / overrides["federation.rounds"], 4),
        "target_ratio": 1.5,
        "bare_sites_mean_c_index": bare["c_index"],
        "flower_sites_mean_c_index": summary["test"].get("c_index"),
        "flower_shared_ray_sites_mean_c_index": shared["test"].get("c_index"),
        "inprocess_sites_mean_c_index": inprocess["test"].get("c_index"),
        "default_engine_sites_mean_c_index": default["test"].get("c_index"),
    }, indent=2))


if __name__ == "__main__":
    main()
