"""How the ``federation.server_lr`` / ``federation.server_momentum`` defaults were chosen: each server optimiser
through the apps on validation splits of SBA's natural partitions (4 census regions, 40 states).

``python -m benchmarks.server_optimizers [--partitions region,State] [--seeds 0,1] [--optimizers
fedadam,fedyogi,fedadagrad,fedavgm] [--out rows.jsonl]`` (the choice), and
``python -m benchmarks.server_optimizers --evaluate [--seeds 0,1,2,3,4] [--optimizers fedavg,fedadam,...]`` (the
test figures at the schema's defaults, after the choice); ``--rows rows.jsonl`` summarises saved rows.

Choice (no test record is read): for each partition and seed, the records that the natural federation
(``data=sba federation.partition=region``, or ``State`` with ``federation.min_site_records=100``) would train on at
that seed, in-time loans only, are written to a CSV file with the partition column and a ``split`` column: within
each site, 80 % of its training records ``train`` and 20 % ``test`` (the validation part), stratified by event; the
seed's test split and the out-of-time loans are left out. Every setting of the grid (:data:`GRID`: server learning
rates, and momenta where the optimiser has one; FedAvg as the reference) then runs without DP through the ServerApp
and ClientApp (:func:`simulations.engine.run_inprocess`) with ``data.name=csv data.split_col=split
federation.partition=<column>`` (the column is then a site name, not a feature), and is scored by Harrell's C and
the IBS of the global model on the pooled validation parts (and the mean of the sites' own C). An optimiser's
default is its setting with the highest mean validation C over partitions and seeds; settings within
:data:`TIE` of the best C are ranked by mean IBS. Flower's ``tau`` (1e-3 for FedAdam, FedYogi and FedAdagrad in
the installed Flower) and ``beta_2`` are not searched.

``--evaluate`` runs the named optimisers at the schema's defaults (``server_lr`` / ``server_momentum`` left at
``auto``) on the real federation, test split included, and prints mean ± std over seeds of the pooled-test C and
IBS and of the mean over the sites' own test parts.

The choice ran in two stages: the whole grid on seeds 0 and 1, then each optimiser's two best settings (by mean
validation C) and FedAvg on seeds 2 and 3 (``--only``); the default is the best over the four seeds.

Prints one JSON line per run and the choice (or the summary table) at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from flwr_app import interrupt
from models.data import load_table
from models.data.federated import (
    SPLIT_STREAM,
    assign_sites,
    out_of_time_mask,
    train_test_positions,
)
from models.data.files import resolve_data_dir
from models.data.partition import stratified_split
from simulations.engine import resolve, run_inprocess
from simulations.results_file import append_jsonl
from strategies.config import SERVER_OPTIMIZERS
from strategies.server_optimizers import make_server_optimizer

VALIDATION_STREAM = 31
#: Natural partitions of SBA: column -> federation.min_site_records (the 40 states with at least 100 loans).
PARTITIONS = {"region": 0, "State": 100}
#: Settings within this much of the best mean validation C are ranked by their mean IBS.
TIE = 0.002
#: optimiser -> settings searched: (server_lr, server_momentum); None: the option has no momentum (or Flower's).
GRID: dict[str, list[tuple[float, float | None]]] = {
    "fedavg": [],
    "fedadam": [(0.1, None), (0.03, None), (0.01, None), (0.003, None)],
    "fedyogi": [(0.1, None), (0.03, None), (0.01, None), (0.003, None)],
    "fedadagrad": [(0.3, None), (0.1, None), (0.03, None), (0.01, None)],
    "fedavgm": [(1.0, 0.9), (1.0, 0.7), (1.0, 0.5), (0.5, 0.9), (0.3, 0.9)],
}


def setting_name(optimizer: str, lr: float | None, momentum: float | None) -> str:
    if lr is None:
        return optimizer
    return f"{optimizer} lr={lr:g}" + ("" if momentum is None else f" m={momentum:g}")


def overrides_of(optimizer: str, lr: float | None, momentum: float | None) -> dict:
    return {"federation.server_optimizer": optimizer,
            **({} if lr is None else {"federation.server_lr": lr}),
            **({} if momentum is None else {"federation.server_momentum": momentum})}


def validation_csv(partition: str, seed: int, folder: Path) -> Path:
    """The seed's training records of SBA's ``partition`` federation, each site's split 80/20 (stratified by event)
    into ``train`` and ``test`` (validation); the partition column is kept as the site name."""
    data = resolve({"data.name": "sba"})[1].data
    table = load_table("sba", data_dir=str(resolve_data_dir("")), sba_horizon_months=data.horizon_months)
    table = table.with_group(partition)
    oot = out_of_time_mask(table, "sba", data.oot_start)
    in_time = np.flatnonzero(~oot) if oot is not None else np.arange(len(table))
    sites = assign_sites(table, partition, in_time, num_sites=0, seed=seed, dirichlet_alpha=0.5,
                         min_site_records=PARTITIONS[partition])
    split_rng = np.random.default_rng([seed, SPLIT_STREAM])
    validation_rng = np.random.default_rng([seed, VALIDATION_STREAM])
    train_parts, validation_parts = [], []
    for site, positions in sites.items():
        train = train_test_positions(table, positions, test_fraction=data.test_fraction, rng=split_rng, site=site)[0]
        fit, validation = stratified_split(train, table.event, 0.2, validation_rng)
        train_parts.append(fit)
        validation_parts.append(validation)
    rows = np.concatenate(train_parts + validation_parts)
    labels = np.array(["train"] * sum(map(len, train_parts)) + ["test"] * sum(map(len, validation_parts)))
    order = np.argsort(rows)
    rows, labels = rows[order], labels[order]
    frame = table.features.iloc[rows].assign(**{partition: table.groups[partition].iloc[rows].to_numpy()},
                                              time=table.time[rows], event=table.event[rows].astype(int),
                                              split=labels)
    path = folder / f"sba_{partition}_seed{seed}.csv"
    frame.to_csv(path, index=False)
    return path


def scores(summary: dict) -> dict:
    return {"c_index": summary["test"]["c_index"], "ibs": summary["test"]["ibs"],
            "sites_c_index": summary.get("sites_mean", {}).get("c_index", float("nan")),
            "sites_ibs": summary.get("sites_mean", {}).get("ibs", float("nan")),
            "ibs_km_null": summary.get("calibration", {}).get("ibs_km_null", float("nan"))}


def choose(rows: list[dict]) -> dict[str, dict]:
    """Per optimiser: each setting's mean validation C and IBS over its runs, and the chosen setting (see the module
    text) among the settings with the most runs (those of the last stage)."""
    cells = collections.defaultdict(list)
    for row in rows:
        cells[(row["optimizer"], row["setting"])].append(row)
    table: dict[str, dict] = collections.defaultdict(dict)
    for (optimizer, setting), group in cells.items():
        table[optimizer][setting] = {"c_index": float(np.mean([r["c_index"] for r in group])),
                                     "ibs": float(np.mean([r["ibs"] for r in group])),
                                     "sites_c_index": float(np.mean([r["sites_c_index"] for r in group])),
                                     "runs": len(group)}
    chosen = {}
    for optimizer, settings in table.items():
        most = max(value["runs"] for value in settings.values())  # the settings of the last stage
        eligible = {name: value for name, value in settings.items() if value["runs"] == most}
        best_c = max(value["c_index"] for value in eligible.values())
        near = [name for name, value in eligible.items() if value["c_index"] >= best_c - TIE]
        chosen[optimizer] = {"chosen": min(near, key=lambda name: settings[name]["ibs"]), "settings": settings}
    return chosen


def run_choice(args: argparse.Namespace) -> None:
    rows = []
    optimizers = ["fedavg", *[name for name in args.optimizers.split(",") if name != "fedavg"]]
    with tempfile.TemporaryDirectory() as folder:
        for partition in args.partitions.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                path = validation_csv(partition, seed, Path(folder))
                for optimizer in optimizers:
                    for lr, momentum in GRID[optimizer] or [(None, None)]:
                        setting = setting_name(optimizer, lr, momentum)
                        if args.only and optimizer != "fedavg" and setting not in args.only.split(","):
                            continue
                        run_dir = Path(folder) / f"run_{partition}_{seed}_{setting.replace(' ', '_')}"
                        summary = run_inprocess({"data.name": "csv", "data.path": str(path), "data.split_col": "split",
                                                 "federation.partition": partition, "seed": seed,
                                                 "baseline.centralized": False, "output.dir": str(run_dir),
                                                 **overrides_of(optimizer, lr, momentum)})
                        row = {"mode": "validation", "partition": partition, "seed": seed, "optimizer": optimizer,
                               "setting": setting, "server_lr": lr, "server_momentum": momentum,
                               "num_sites": summary["num_sites"], "wall_time_s": summary.get("wall_time_s"),
                               **scores(summary)}
                        emit(row, rows, args.out)
    print(json.dumps({"choice": choose(rows)}))


def emit(row: dict, rows: list[dict], out: str | None) -> None:
    """Keep ``row``, print it as a JSON line and append it to ``out`` (when given)."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        append_jsonl(out, row)


def run_evaluation(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for partition in args.partitions.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for optimizer in args.optimizers.split(","):
                    run_dir = Path(folder) / f"run_{partition}_{seed}_{optimizer}"
                    summary = run_inprocess({"data.name": "sba", "federation.partition": partition,
                                             "federation.min_site_records": PARTITIONS[partition], "seed": seed,
                                             "baseline.centralized": False, "output.dir": str(run_dir),
                                             "federation.server_optimizer": optimizer})
                    lr, momentum = effective_defaults(optimizer)
                    row = {"mode": "test", "partition": partition, "seed": seed, "optimizer": optimizer,
                           "server_lr": lr, "server_momentum": momentum,
                           "num_sites": summary["num_sites"], "wall_time_s": summary.get("wall_time_s"),
                           **scores(summary)}
                    emit(row, rows, args.out)
    print(json.dumps({"test": summarise(rows)}))


def effective_defaults(optimizer: str) -> tuple[float | None, float | None]:
    """The learning rate and momentum that Flower's strategy holds when the run config leaves them at ``auto``."""
    optimizer_object = make_server_optimizer(resolve({"federation.server_optimizer": optimizer})[1].federation)
    if optimizer_object is None:
        return None, None
    option = SERVER_OPTIMIZERS[optimizer]
    return (getattr(optimizer_object.strategy, option.lr),
            getattr(optimizer_object.strategy, option.momentum) if option.momentum else None)


def summarise(rows: list[dict]) -> dict:
    """(partition, optimiser) -> mean and std over seeds of each score."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[f"{row['partition']} {row['optimizer']}"].append(row)
    return {name: {key: [float(np.mean([r[key] for r in group])), float(np.std([r[key] for r in group], ddof=1))
                         if len(group) > 1 else 0.0]
                   for key in ("c_index", "ibs", "sites_c_index", "sites_ibs")} | {"seeds": len(group)}
            for name, group in groups.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluate", action="store_true", help="test figures at the schema's defaults")
    parser.add_argument("--partitions", default="region,State")
    parser.add_argument("--seeds", default="")
    parser.add_argument("--optimizers", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--only", default="", help="choice: run only these settings (comma-separated names as "
                                                   "printed, e.g. 'fedadam lr=0.1'), and fedavg")
    parser.add_argument("--rows", default="", help="summarise saved rows (JSON lines) instead of running")
    args = parser.parse_args(argv)
    if args.rows:
        rows = [json.loads(line) for line in Path(args.rows).read_text(encoding="utf-8").splitlines() if line.strip()]
        print(json.dumps({"choice": choose([row for row in rows if row["mode"] == "validation"]),
                          "test": summarise([row for row in rows if row["mode"] == "test"])}, indent=1))
        return
    if args.evaluate:
        args.seeds = args.seeds or "0,1,2,3,4"
        args.optimizers = args.optimizers or "fedavg,fedadam,fedyogi,fedadagrad,fedavgm"
        run_evaluation(args)
    else:
        args.seeds = args.seeds or "0,1"
        args.optimizers = args.optimizers or "fedadam,fedyogi,fedadagrad,fedavgm"
        run_choice(args)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
