"""How the DP-SGD recipe of ``dp_sgd`` and ``bdp`` was chosen: a grid on validation splits of unreported data sets.

``python -m benchmarks.dp_recipe [--data metabric,gbsg,whas] [--epsilons 1,10] [--rounds 20] [--limit N]
[--out grid.jsonl]``

For each of METABRIC, GBSG and WHAS (public data sets that no DP result of the project reports), the
records that the default federation (5 i.i.d. sites, seed 0) trains on are split 80/20 into a fitting
part and a validation part (:func:`benchmarks.setup_share.validation_csv`; the test parts are never
read). Each setting runs ``dp_sgd`` (``model.name = hazard_mlp``, 20 time intervals) through the
ServerApp and ClientApp (:func:`simulations.engine.run_inprocess`: the private set-up, per-site DP-SGD
with its noise calibrated for all its steps, the checked and bounded mean, the recalibration; the other
keys at their defaults) for 20 rounds at ε = 1 and ε = 10, for every combination of

* expected batch size 128, 512; Adam learning rate 0.003, 0.01 (second grid: 0.01, 0.03);
* clip norm 1, 5 (second grid: 5, 20); local epochs 1, 3 (second grid: 3, 6),

and is scored by Harrell's C and the IBS on the pooled validation parts (the global model, server-side);
``sigma_max`` is the largest noise multiplier a site's ledger entry states. A setting's score is its
mean rank (as a fraction of the settings compared) over the data sets, both ε and both metrics; the
lowest wins. Selection uses public data only, so it spends no privacy of any site.

Prints one JSON line per setting (appended to ``--out`` if given) and the ranking at the end;
``--limit N`` runs only the first N settings of each data set and ε (a quick check).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from benchmarks.setup_share import validation_csv
from flwr_app import interrupt
from simulations.engine import run_inprocess
from simulations.results_file import append_jsonl

DATA_SETS = ("metabric", "gbsg", "whas")
EPSILONS = (1.0, 10.0)
GRIDS = (
    dict(batch=(128, 512), lr=(0.003, 0.01), clip=(1.0, 5.0), epochs=(1, 3)),
    dict(batch=(128, 512), lr=(0.01, 0.03), clip=(5.0, 20.0), epochs=(3, 6)),
)
#: The run-config keys every setting shares (besides the validation file, ε and the setting's own).
RUN = {"strategy.name": "dp_sgd", "model.name": "hazard_mlp", "model.num_durations": 20, "federation.num_sites": 5,
       "seed": 0, "baseline.centralized": False}


def settings() -> Iterator[tuple[int, float, float, int]]:
    """Every (batch, lr, clip, local epochs) of :data:`GRIDS`, grid after grid."""
    for grid in GRIDS:
        yield from itertools.product(grid["batch"], grid["lr"], grid["clip"], grid["epochs"])


def recipe_row(name: str, path: Path, out: Path, *, epsilon: float, batch: int, lr: float, clip: float, epochs: int,
               rounds: int) -> dict:
    """One setting through the apps on the validation file ``path`` (run directory ``out``): its row."""
    summary = run_inprocess({**RUN, "data.name": "csv", "data.path": str(path), "data.split_col": "split",
                             "privacy.epsilon": epsilon, "train.batch_size": batch, "train.lr": lr,
                             "privacy.clip_norm": clip, "train.local_epochs": epochs, "federation.rounds": rounds,
                             "output.dir": str(out)})
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text(encoding="utf-8").splitlines()]
    sigmas = [entry["noise_multiplier"] for entry in ledger if entry.get("noise_multiplier") is not None]
    return dict(data=name, epsilon=epsilon, batch=batch, lr=lr, clip=clip, epochs=epochs,
                c_index=float(summary["test"]["c_index"]), ibs=float(summary["test"]["ibs"]),
                sigma_max=float(max(sigmas)))


def ranking(rows: Iterable[dict]) -> list[tuple[tuple, float, int]]:
    """Settings by mean rank fraction over (data set, ε) groups and both metrics (lowest first)."""
    rows = list(rows)
    setting = lambda row: (row["batch"], row["lr"], row["clip"], row["epochs"])  # noqa: E731
    ranks: dict[tuple, list[float]] = collections.defaultdict(list)
    for group in {(row["data"], row["epsilon"]) for row in rows}:
        members = [row for row in rows if (row["data"], row["epsilon"]) == group]
        for metric, sign in (("c_index", -1.0), ("ibs", 1.0)):
            for rank, row in enumerate(sorted(members, key=lambda row: sign * row[metric])):
                ranks[setting(row)].append(rank / len(members))
    return sorted(((key, float(np.mean(values)), len(values)) for key, values in ranks.items()),
                  key=lambda item: item[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=",".join(DATA_SETS))
    parser.add_argument("--epsilons", default=",".join(f"{epsilon:g}" for epsilon in EPSILONS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--limit", type=int, default=0, help="only the first N settings (0: all)")
    parser.add_argument("--out", default="", help="also append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = list(settings())[:args.limit or None]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.data.split(","):
            path = validation_csv(name, 0, Path(folder))
            for epsilon, (index, (batch, lr, clip, epochs)) in itertools.product(
                    (float(e) for e in args.epsilons.split(",")), enumerate(chosen)):
                row = recipe_row(name, path, Path(folder) / f"run_{name}_{epsilon:g}_{index}", epsilon=epsilon,
                                 batch=batch, lr=lr, clip=clip, epochs=epochs, rounds=args.rounds)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    append_jsonl(args.out, row)
    print("setting (batch, lr, clip, local epochs) -> mean rank fraction (lower is better), groups")
    for key, score, count in ranking(rows)[:10]:
        print(f"{key}: {score:.3f} ({count})")


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
