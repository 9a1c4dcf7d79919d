"""How ``privacy.setup_share`` was chosen: dp_sgd through the apps on validation splits of bundled data sets.

``python -m benchmarks.setup_share [--shares 0.1,0.2,0.3,0.45] [--data flchain,metabric,gbsg,whas]
[--epsilons 1,10] [--seeds 0,1] [--out rows.jsonl]``

For each data set and seed, the records that the default federation (5 i.i.d. sites) would train on
at that seed are written to a CSV file with a ``split`` column: 80 % of them ``train``, 20 %
``test`` (the validation part); the records of the seed's own test split are left out, so no test
record is ever read. Each share then runs ``dp_sgd`` at each ε through the ServerApp and ClientApp
(:func:`simulations.engine.run_inprocess`: the private set-up, DP-SGD, the recalibration) with
``data.name=csv data.split_col=split``, and is scored by Harrell's C, the IBS and the gap between
mean predicted and Kaplan-Meier survival at the median follow-up, on the pooled validation parts.
A share's score is its mean rank over data sets, ε, seeds and the three figures (the lowest wins).
Prints one JSON line per run and the ranking at the end.
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
from models.data.federated import SPLIT_STREAM, assign_sites, train_test_positions
from models.data.files import resolve_data_dir
from simulations.engine import resolve, run_inprocess
from simulations.results_file import append_jsonl

SITES = 5
VALIDATION_STREAM = 29


#: Data sets whose default federation is a natural partition: the run-config keys that make it (the partition column
#: is in the validation file).
NATURAL = {"sba": {"federation.partition": "region"}}


def validation_csv(name: str, seed: int, folder: Path) -> Path:
    """The seed's training records of the default federation, split 80/20 into ``train`` and ``test`` (validation).

    SBA: its 4 census regions (:data:`NATURAL`), from :func:`benchmarks.server_optimizers.validation_csv`; the
    others: 5 i.i.d. sites."""
    if name in NATURAL:
        from benchmarks.server_optimizers import validation_csv as natural_validation_csv

        return natural_validation_csv(NATURAL[name]["federation.partition"], seed, folder)
    table = load_table(name, data_dir=str(resolve_data_dir("")))
    test_fraction = resolve({"data.name": name})[1].data.test_fraction
    sites = assign_sites(table, "iid", np.arange(len(table)), num_sites=SITES, seed=seed, dirichlet_alpha=0.5,
                         min_site_records=0)
    rng = np.random.default_rng([seed, SPLIT_STREAM])
    train = np.sort(np.concatenate([train_test_positions(table, positions, test_fraction=test_fraction, rng=rng,
                                                         site=site)[0] for site, positions in sites.items()]))
    labels = np.where(np.random.default_rng([seed, VALIDATION_STREAM]).random(train.size) < 0.2, "test", "train")
    frame = table.features.iloc[train].assign(time=table.time[train], event=table.event[train].astype(int),
                                              split=labels)
    path = folder / f"{name}_seed{seed}.csv"
    frame.to_csv(path, index=False)
    return path


def validation_row(name: str, path: Path, overrides: dict, *, setting: str, epsilon: float, seed: int,
                   out: Path) -> dict:
    """One run through the apps on a validation file (:func:`validation_csv`) and its validation scores."""
    summary = run_inprocess({"data.name": "csv", "data.path": str(path), "data.split_col": "split",
                             "privacy.epsilon": epsilon, "seed": seed, "baseline.centralized": False,
                             "output.dir": str(out), **NATURAL.get(name, {}), **overrides})
    return {"data": name, "setting": setting, "epsilon": epsilon, "seed": seed,
            "c_index": summary["test"]["c_index"], "c_index_td": summary["test"].get("c_index_td"),
            "ibs": summary["test"]["ibs"],
            "gap": summary.get("calibration", {}).get("median_gap", float("nan")),
            "ledger_epsilon": summary["privacy"]["epsilon"]}


def run_grid(settings: dict[str, dict], *, data: str, seeds: str, epsilons: str, out: str) -> list[dict]:
    """Every setting (name -> run-config overrides) on every data set's validation file, seed and ε; one JSON
    line printed (and appended to ``out``, if given) per run; then the ranking."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in data.split(","):
            for seed in (int(s) for s in seeds.split(",")):
                path = validation_csv(name, seed, Path(folder))
                for epsilon in (float(e) for e in epsilons.split(",")):
                    for index, (setting, overrides) in enumerate(settings.items()):
                        run_dir = Path(folder) / f"run_{name}_{seed}_{epsilon:g}_{index}"
                        row = validation_row(name, path, overrides, setting=setting, epsilon=epsilon, seed=seed,
                                             out=run_dir)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if out:
                            append_jsonl(out, row)
    print(json.dumps({"ranking (mean rank, setting)": ranking(rows)}))
    return rows


def ranking(rows: list[dict], setting: str = "setting") -> list[tuple[float, object]]:
    """(mean rank, setting), best first: ranks within each (data, ε, seed) of C (higher better), IBS and gap.

    ``setting``: the row key that names what is compared (the saved rows of the share grid: ``share``)."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[(row["data"], row["epsilon"], row["seed"])].append(row)
    ranks = collections.defaultdict(list)
    for group in groups.values():
        for key, sign in (("c_index", -1.0), ("ibs", 1.0), ("gap", 1.0)):
            order = sorted(group, key=lambda row: sign * row[key])
            for position, row in enumerate(order):
                ranks[row[setting]].append(position / max(1, len(order) - 1))
    return sorted(((float(np.mean(values)), name) for name, values in ranks.items()), key=lambda item: item[0])


def grid_parser(description: str, *, seeds: str) -> argparse.ArgumentParser:
    """The options every validation grid takes (:func:`run_grid`): data sets, ε, seeds and the rows file."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", default="flchain,metabric,gbsg,whas")
    parser.add_argument("--epsilons", default="1,10")
    parser.add_argument("--seeds", default=seeds)
    parser.add_argument("--out", default="")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = grid_parser(__doc__.splitlines()[0], seeds="0,1")
    parser.add_argument("--shares", default="0.1,0.2,0.3,0.45")
    args = parser.parse_args(argv)
    settings = {f"share {share:g}": {"strategy.name": "dp_sgd", "privacy.setup_share": share}
                for share in (float(s) for s in args.shares.split(","))}
    run_grid(settings, data=args.data, seeds=args.seeds, epsilons=args.epsilons, out=args.out)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
