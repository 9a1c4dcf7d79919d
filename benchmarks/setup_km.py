"""Diagnostic: how far the private set-up's Kaplan–Meier curve is from the exact one, and whether a recalibration is planned.

For each data set and seed, the default federation of ``strategy`` at ε (5 i.i.d. sites, the default set-up share)
runs its private set-up in simulation (:func:`flwr_app.task.federation_setup`, as a run builds it). At the quartiles of the
pooled training follow-up it compares the set-up's Kaplan–Meier curve (of its denoised time histogram: the
recalibration's target, :func:`~strategies.mechanisms.setup_statistics.recalibration_plan`) with the exact
Kaplan–Meier estimate of the pooled training records, and, as the yardstick of sampling error, the pooled test
records' estimate with the same training one. It also says whether the run plans a recalibration (the summed noise
of a power sum at most ``RECALIBRATION_MAX_ERROR`` of the records). No model is trained. Prints one JSON line per
data set: the mean absolute differences at the three quartiles over the seeds.

Usage::

    python -m benchmarks.setup_km [--data metabric,gbsg,whas] [--seeds 0,...,7] [--strategy distributed_dp]
    [--epsilon 1]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from flwr_app import interrupt, task
from models.metrics import kaplan_meier_curves, survival_at
from models.time_grid import histogram_survival
from simulations.engine import resolve

LEVELS = (0.25, 0.5, 0.75)


def _km_at(time: np.ndarray, event: np.ndarray, horizons: np.ndarray) -> np.ndarray:
    """The Kaplan–Meier estimate of ``(time, event)`` at ``horizons`` (sksurv's, a step function)."""
    times, surv = kaplan_meier_curves(time, event, 1)
    return survival_at(times, surv, horizons)[0]


def measure(data: str, seeds: list[int], *, strategy: str, epsilon: float) -> dict:
    """Mean |set-up KM − training KM| and |test KM − training KM| at the follow-up quartiles, and the plans."""
    setup_error, sampling_error, planned = [], [], []
    for seed in seeds:
        _, cfg = resolve({"data.name": data, "strategy.name": strategy, "privacy.epsilon": epsilon, "seed": seed,
                          "baseline.centralized": False})
        dataset, federation = task.load_federation(cfg), task.federation_setup(cfg)
        train, test = dataset.pooled("train"), dataset.pooled("test")
        horizons = np.quantile(train.time, LEVELS)
        points, events, censored = (np.asarray(part, dtype=np.float64) for part in federation.time_counts)
        exact = _km_at(train.time, train.event, horizons)
        setup_error.append(histogram_survival(np.concatenate(([0.0], points)), events, censored, horizons) - exact)
        sampling_error.append(_km_at(test.time, test.event, horizons) - exact)
        planned.append(federation.recalibration is not None)
    return {"data": data, "strategy": strategy, "epsilon": epsilon, "seeds": len(seeds), "levels": LEVELS,
            "setup_km_minus_training_km": np.abs(setup_error).mean(axis=0).round(3).tolist(),
            "test_km_minus_training_km": np.abs(sampling_error).mean(axis=0).round(3).tolist(),
            "recalibration_planned": f"{sum(planned)} of {len(planned)} seeds"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="metabric,gbsg,whas")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--strategy", default="distributed_dp")
    parser.add_argument("--epsilon", type=float, default=1.0)
    args = parser.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    for data in args.data.split(","):
        print(json.dumps(measure(data, seeds, strategy=args.strategy, epsilon=args.epsilon)), flush=True)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
