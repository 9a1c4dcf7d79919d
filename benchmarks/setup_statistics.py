"""Benchmark: what differentially private set-up statistics cost in accuracy, utility and budget.

For a data set split into IID sites as the default federation does (FLCHAIN: 5 sites, METABRIC:
4), the shared set-up (preprocessing, time grid, time scale, record counts) is built these ways:

``exact``
    Fitted on the pooled training parts without noise (what the simulation does today).
``dp``
    From the sites' noisy releases (:mod:`strategies.mechanisms.setup_statistics`) at set-up
    noise multiplier ``z`` (``--noise``), with no public information but the schema.
``dictionary``
    From a public data dictionary (``DICTIONARIES`` below: ranges and levels, an equidistant
    grid over the public follow-up range): no privacy cost but the record counts'.
``dp_time_max``
    As ``dp``, but with the dictionary's public follow-up range (no range histogram of the times).
``mixed``
    The dictionary's entries that are public beyond doubt (``MIXED_NUMERIC``: a sampling period,
    0/1 indicators; the category levels; the follow-up range) and DP for the rest: the measured
    features' ranges and moments, and the quantile grid.
``dictionary_dp_grid``
    The dictionary's ranges and levels with the quantile grid of the DP time histogram over the
    public follow-up range (a diagnostic: which part of the dictionary's cost is the grid's).

It reports the error of the DP statistics against the exact ones (feature means in exact
standard deviations, relative error of the standard deviations, the share of training values
clipped, the distance between the time grids as a share of the largest time, the time scale, the
counts; the means and standard deviations also against the exact ones of the values clipped to
the range, which isolates the noise's part). Then it trains the discrete-time hazard model of the
default configuration centrally on the pooled training data encoded each way, with Adam (no DP)
and with DP-SGD at each ``--epsilons`` (δ = 1e-5, RDP; where the set-up is private, the DP-SGD
noise is calibrated so that DP-SGD and the set-up releases together spend the target), and
gives the test C-index and IBS, mean ± std over ``--seeds`` (each seed drives the partition, the
split, the set-up noise, the initialisation and DP-SGD). Last, the share of the budget the
set-up takes: the DP-SGD noise multiplier needed with and without the set-up releases at each ε,
for the smallest site of the default federation (20 rounds of one local epoch, batch 128) and
for the centralised model.

Prints one JSON object.

Usage::

    python benchmarks/setup_statistics.py [--data flchain] [--noise 10] [--seeds 0,1,2]
        [--epsilons 1,10] [--conditions exact,dp,dictionary,...] [--no-train]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import operator
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app.task import build_network, evaluate  # noqa: E402
from models.data.files import resolve_data_dir  # noqa: E402
from models.data import Preprocessor, SurvivalArrays, load_table  # noqa: E402
from models.data.dictionary import DataDictionary  # noqa: E402
from models.data.federated import SPLIT_STREAM, assign_sites  # noqa: E402
from models.data.partition import stratified_split  # noqa: E402
from models.time_grid import make_time_grid  # noqa: E402
from models.training import train_epochs  # noqa: E402
from simulations.engine import resolve  # noqa: E402
from strategies.accounting.rdp import calibrate_noise_multiplier, epsilon_from_history  # noqa: E402
from strategies.mechanisms import setup_statistics as setup  # noqa: E402
from strategies.mechanisms.schedules import poisson_schedule  # noqa: E402
from strategies.mechanisms.dp_sgd_training import train_epochs_dp  # noqa: E402

SITES = {"flchain": 5, "metabric": 4}
DELTA = 1e-5
ROUNDS = 20  # the default federation: 20 rounds of one local epoch
NOISE_STREAM = 7
#: Public data dictionaries: generous round bounds that the data sets' documentation supports
#: (chosen by us after having seen the data sets' summaries, so not a blind test). FLCHAIN
#: (Dispenzieri et al., Mayo Clin Proc 2012; sksurv/R survival docs): Olmsted County residents
#: aged 50 or more, serum sampled 1995-2003, free light chains and creatinine in mg/dL (wide
#: clinical ranges), follow-up in days until about 2009 (at most ~15 years).
#: METABRIC (pycox version: four gene expressions on a log2 scale, four 0/1 treatment and
#: receptor indicators, age at diagnosis), follow-up in months, at most 30 years.
DICTIONARIES = {
    "flchain": {
        "numeric": {"age": [50, 105], "creatinine": [0, 15], "kappa": [0, 50], "lambda": [0, 50],
                    "sample.yr": [1995, 2003]},
        "categorical": {"flc.grp": [str(k) for k in range(1, 11)], "mgus": ["no", "yes"], "sex": ["F", "M"]},
        "time": {"max": 5500},
    },
    "metabric": {
        "numeric": {**{f"x{k}": [0, 16] for k in range(4)}, **{f"x{k}": [0, 1] for k in range(4, 8)},
                    "x8": [20, 100]},
        "time": {"max": 360},
    },
}

#: The dictionary entries that are public beyond doubt (the study's sampling period, 0/1
#: indicators); with the levels and the follow-up range they make the ``mixed`` condition.
MIXED_NUMERIC = {"flchain": ("sample.yr",), "metabric": ("x4", "x5", "x6", "x7")}


def site_parts(name: str, seed: int):
    """The raw table and each site's (train, test) positions, as ``build_federated_dataset`` splits them."""
    table = load_table(name, data_dir=resolve_data_dir(""))
    sites = assign_sites(table, "iid", np.arange(len(table)), num_sites=SITES[name], seed=seed,
                         dirichlet_alpha=0.5, min_site_records=0)
    rng = np.random.default_rng([seed, SPLIT_STREAM])
    return table, [stratified_split(positions, table.event, 0.2, rng) for positions in sites.values()]


def build_setup(table, parts, plan: setup.SetupPlan, rng: np.random.Generator, num_durations: int):
    """The two passes of every site, summed, and the shared set-up; also the sites' noisy counts."""
    first = [setup.release_ranges(plan, table.features.iloc[train], table.time[train], rng) for train, _ in parts]
    summed = functools.reduce(operator.add, first)
    ranges = setup.agree_ranges(plan, summed)
    second = [setup.release_moments(plan, ranges, table.features.iloc[train], table.time[train],
                                    table.event[train], rng) for train, _ in parts]
    shared = setup.shared_setup(plan, ranges, summed, functools.reduce(operator.add, second),
                                num_durations=num_durations)
    return shared, [release.count for release in first]


def grid_distance(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    """Mean distance from each cut of either grid to the nearest cut of the other, over ``scale``."""
    def one_way(x, y):
        return float(np.mean(np.min(np.abs(x[:, None] - y[None, :]), axis=1)))
    return (one_way(a, b) + one_way(b, a)) / 2 / scale


def statistics_errors(table, parts, exact: setup.SharedSetup, shared: setup.SharedSetup, counts) -> dict:
    train = np.concatenate([tr for tr, _ in parts])
    features = table.features.iloc[train]
    pre, ref = shared.preprocessor, exact.preprocessor
    columns = {}
    for column in ref.means:
        values = features[column].to_numpy(dtype=float)
        values = values[~np.isnan(values)]
        lo, hi = pre.ranges.get(column, (-np.inf, np.inf))
        clipped = np.clip(values, lo, hi)
        columns[column] = {
            "mean_error_sd": abs(pre.means[column] - ref.means[column]) / ref.stds[column],
            "std_rel_error": abs(pre.stds[column] / ref.stds[column] - 1),
            "clipped_share": float(np.mean((values < lo) | (values > hi))),
            # against the exact moments of the values clipped to the range: the noise's part of the error
            "mean_error_sd_vs_clipped": abs(pre.means[column] - clipped.mean()) / clipped.std(),
            "std_rel_error_vs_clipped": abs(pre.stds[column] / clipped.std() - 1),
        }
    t_max = float(table.time[train].max())
    return {
        "columns": columns,
        "mean_error_sd": float(np.mean([c["mean_error_sd"] for c in columns.values()])),
        "std_rel_error": float(np.mean([c["std_rel_error"] for c in columns.values()])),
        "clipped_share": float(np.mean([c["clipped_share"] for c in columns.values()])),
        "mean_error_sd_vs_clipped": float(np.mean([c["mean_error_sd_vs_clipped"] for c in columns.values()])),
        "std_rel_error_vs_clipped": float(np.mean([c["std_rel_error_vs_clipped"] for c in columns.values()])),
        "grid_distance": grid_distance(shared.cuts, exact.cuts, t_max),
        "num_cuts": int(shared.cuts.size),
        "time_mean_rel_error": abs(shared.time_scale[0] / exact.time_scale[0] - 1),
        "time_std_rel_error": abs(shared.time_scale[1] / exact.time_scale[1] - 1),
        "count_abs_error": float(np.mean(np.abs(np.asarray(counts) - [len(tr) for tr, _ in parts]))),
    }


def calibrate_with_setup(target: float, sample_rate: float, steps: int, setup_z: float | None) -> float:
    """Smallest DP-SGD noise multiplier (to 0.1 %) with which DP-SGD and the set-up (one Gaussian
    with multiplier ``setup_z``; none when ``None``) together spend at most ``target`` at δ."""
    alone = calibrate_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=sample_rate, steps=steps)
    if setup_z is None:
        return alone
    fixed = [(setup_z, 1.0, 1)]
    if epsilon_from_history(fixed, delta=DELTA) >= target:
        return math.inf
    low, high = alone, alone
    while epsilon_from_history([(high, sample_rate, steps), *fixed], delta=DELTA) > target:
        low, high = high, high * 2
    while high / low > 1.001:
        middle = (low + high) / 2
        if epsilon_from_history([(middle, sample_rate, steps), *fixed], delta=DELTA) > target:
            low = middle
        else:
            high = middle
    return high


def budget_share(sample_rate: float, steps: int, setup_z: float, epsilons) -> dict:
    """DP-SGD noise multiplier with and without the set-up releases, per target ε."""
    rows = {}
    for eps in epsilons:
        alone = calibrate_with_setup(eps, sample_rate, steps, None)
        joint = calibrate_with_setup(eps, sample_rate, steps, setup_z)
        if math.isinf(joint):  # the set-up alone spends the budget
            rows[str(eps)] = {"sigma_without_setup": alone, "sigma_with_setup": None}
            continue
        rows[str(eps)] = {
            "sigma_without_setup": alone, "sigma_with_setup": joint,
            "sigma_increase": joint / alone - 1,
            "epsilon_dp_sgd_alone_at_joint_sigma": epsilon_from_history([(joint, sample_rate, steps)], delta=DELTA),
        }
    return {"sample_rate": sample_rate, "steps": steps,
            "epsilon_setup_alone": epsilon_from_history([(setup_z, 1.0, 1)], delta=DELTA), "by_epsilon": rows}


def encode(pre: Preprocessor, table, positions) -> SurvivalArrays:
    return SurvivalArrays(pre.transform(table.features.iloc[positions]), table.time[positions], table.event[positions])


def train_and_evaluate(cfg, shared: setup.SharedSetup, table, parts, epsilon: float | None, setup_z: float | None,
                       seed: int, epochs: int) -> dict:
    """Test C-index and IBS of the hazard model trained on the encoded pooled training data ({} when
    the set-up alone spends more than ``epsilon``)."""
    train = encode(shared.preprocessor, table, np.concatenate([tr for tr, _ in parts]))
    test = encode(shared.preprocessor, table, np.concatenate([te for _, te in parts]))
    model = build_network(cfg, in_features=train.x.shape[1], cuts=shared.cuts, time_scale=shared.time_scale)
    common = dict(epochs=epochs, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
                  weight_decay=cfg.train.weight_decay, seed=seed)
    if epsilon is None:
        train_epochs(model, train.x, train.time, train.event, **common)
        sigma = 0.0
    else:
        sample_rate, steps = poisson_schedule(len(train), batch_size=cfg.train.batch_size, epochs=epochs)
        sigma = calibrate_with_setup(epsilon, sample_rate, steps, setup_z)
        if math.isinf(sigma):
            return {}  # the set-up alone spends more than the target
        train_epochs_dp(model, train.x, train.time, train.event, noise_multiplier=sigma,
                        clip_norm=cfg.privacy.clip_norm, **common)
    metrics = evaluate(model, test)
    return {"c_index": metrics["c_index"], "ibs": metrics["ibs"], "sigma": sigma}


def mean_std(values) -> list[float]:
    return [float(np.mean(values)), float(np.std(values))]


def summarise(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    out = {"seeds": len(rows), **{k: mean_std([r[k] for r in rows]) for k in keys}}
    if "columns" in rows[0]:
        out["columns"] = {c: {k: mean_std([r["columns"][c][k] for r in rows]) for k in rows[0]["columns"][c]}
                          for c in rows[0]["columns"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="flchain")
    parser.add_argument("--noise", default=str(setup.DEFAULT_SETUP_NOISE_MULTIPLIER))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epsilons", default="1,10")
    parser.add_argument("--conditions", default="exact,dp,dictionary")
    parser.add_argument("--epochs", type=int, default=ROUNDS)
    parser.add_argument("--no-train", action="store_true", help="statistics and budget only")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    epsilons = [float(e) for e in args.epsilons.split(",")]
    noises = [float(z) for z in args.noise.split(",")]
    conditions = args.conditions.split(",")
    started = time.perf_counter()
    result: dict = {"data": args.data, "sites": SITES[args.data], "epochs": args.epochs, "delta": DELTA,
                    "seeds": seeds, "bins": {"range_per_decade": setup.RANGE_BINS_PER_DECADE,
                                             "range_threshold": setup.RANGE_THRESHOLD,
                                             "time": [setup.TIME_BINS_MIN, setup.TIME_BINS_MAX]},
                    "weights": dict(setup.RELEASE_WEIGHTS), "statistics": {}, "utility": {}, "budget": {}}
    dictionary = DataDictionary.from_mapping(DICTIONARIES[args.data], source=f"DICTIONARIES['{args.data}']")
    entries = DICTIONARIES[args.data]
    mixed = DataDictionary.from_mapping(
        {"numeric": {c: entries["numeric"][c] for c in MIXED_NUMERIC[args.data]},
         "categorical": entries.get("categorical", {}), "time": entries["time"]}, source="mixed")
    runs: dict[str, list[dict]] = {}
    stats: dict[str, list[dict]] = {}
    failures: dict[str, list[str]] = {}
    for seed in seeds:
        _, cfg = resolve({"seed": seed, "data.name": args.data})
        table, parts = site_parts(args.data, seed)
        train = np.concatenate([tr for tr, _ in parts])
        exact = setup.SharedSetup(
            Preprocessor.fit(table.features.iloc[train]),
            make_time_grid(table.time[train], table.event[train], num_durations=cfg.model.num_durations),
            (float(np.mean(table.time[train])), float(np.std(table.time[train]))))
        built = {"exact": (exact, None)} if "exact" in conditions else {}
        plans = {}
        for z in noises if "dp" in conditions else []:
            plans[f"dp_z{z:g}"] = (setup.SetupPlan.for_features(table.features, noise_multiplier=z), z)
        if "dictionary" in conditions:
            plan = setup.SetupPlan.for_features(table.features, dictionary=dictionary, time_grid="equidistant")
            assert all(r.name == "record_count" for r in plan.releases())  # only the count is private
            plans["dictionary"] = (plan, None)
        for z in noises if "dp_time_max" in conditions else []:
            # everything private but the dictionary's public follow-up range (quantile grid from the DP histogram)
            time_only = DataDictionary.from_mapping({"time": DICTIONARIES[args.data]["time"]}, source="time only")
            plans[f"dp_time_max_z{z:g}"] = (
                setup.SetupPlan.for_features(table.features, dictionary=time_only, noise_multiplier=z), z)
        for z in noises if "mixed" in conditions else []:
            plans[f"mixed_z{z:g}"] = (
                setup.SetupPlan.for_features(table.features, dictionary=mixed, noise_multiplier=z), z)
        for z in noises if "dictionary_dp_grid" in conditions else []:
            # the dictionary's ranges and levels, the quantile grid from the DP time histogram on [0, public max]
            plans[f"dictionary_dp_grid_z{z:g}"] = (
                setup.SetupPlan.for_features(table.features, dictionary=dictionary, noise_multiplier=z), z)
        for name, (plan, z) in plans.items():
            try:
                shared, counts = build_setup(table, parts, plan, np.random.default_rng([seed, NOISE_STREAM]),
                                             cfg.model.num_durations)
            except setup.SetupNoiseError as err:
                failures.setdefault(name, []).append(f"seed {seed}: {err}")
                continue
            stats.setdefault(name, []).append(statistics_errors(table, parts, exact, shared, counts))
            built[name] = (shared, z)
        if args.no_train:
            continue
        for name, (shared, z) in built.items():
            for eps in [None, *epsilons]:
                row = train_and_evaluate(cfg, shared, table, parts, eps, z, seed, args.epochs)
                if not row:
                    failures.setdefault(name, []).append(f"seed {seed}: the set-up alone spends more than ε = {eps:g}")
                    continue
                runs.setdefault(f"{name}/{'none' if eps is None else f'eps{eps:g}'}", []).append(row)
                print(f"[{time.perf_counter() - started:7.0f} s] seed {seed} {name} eps={eps}: {row}",
                      file=sys.stderr, flush=True)
    result["statistics"] = {name: summarise(rows) for name, rows in stats.items()}
    result["utility"] = {name: summarise(rows) for name, rows in runs.items()}
    result["failures"] = failures
    table, parts = site_parts(args.data, seeds[0])
    smallest = min(len(tr) for tr, _ in parts)
    site_rate, site_steps = poisson_schedule(smallest, batch_size=128, epochs=1)  # one round, as train_local_dp
    central = poisson_schedule(sum(len(tr) for tr, _ in parts), batch_size=128, epochs=args.epochs)
    for z in (z for z in noises if z > 0):  # z = 0: exact releases, no privacy
        result["budget"][f"z{z:g}"] = {
            "smallest_site": {"records": smallest, **budget_share(site_rate, site_steps * ROUNDS, z, epsilons)},
            "centralised": budget_share(*central, z, epsilons),
        }
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
