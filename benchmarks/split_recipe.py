"""How the split model's no-DP recipe (the ``split.*`` defaults) was chosen: a grid on validation parts.

``python -m benchmarks.split_recipe [--out grid.jsonl] [--settings paper,small-...]``

For every vertical data set (METABRIC genomic | clinical, breast_cancer genes | clinical,
synthetic_multimodal a | b and a | b | c) and seeds 0-4, the label holder's split with the seed
(:func:`models.data.vertical.split_train_test`, 20 % test) is made and only its *training* part is
read: a stratified 20 % of it is the validation part, the rest is fitted (breast_cancer, 198
records: three validation parts per seed, so that a score rests on more than ~10 events). The
test parts are never read. Each setting trains the centralised twin of the split model
(:func:`models.multimodal_training.train_multisurv`, which the split protocol computes exactly)
with the Bayesian layers, AdamW lr 0.003, batch 128, weight decay 1e-4, the similarity weight
0.05 and the paper's 30-interval grid, and is scored by Harrell's C of -RMST of the mean curve of
20 passes on the validation part.

Settings: ``paper`` (embedding 512, 2 encoder blocks, 4 head blocks, dropout 0.5, the per-interval
risk layer, 20 epochs) and every combination of embedding 16 or 32, 0 or 1 encoder blocks, the
proportional or the per-interval risk layer and 20 or 40 epochs, with 1 head block and dropout
0.1. A setting's score is its mean rank (as a fraction of the settings compared) over the data
settings that every compared setting ran; the lowest wins. One recipe for every data set.
(``paper`` takes minutes a run on a 2-core machine; the committed rows,
``docs/results/benchmarks/split_recipe.jsonl``, hold the 16 small settings.)

Prints one JSON line per (setting, data, seed, validation part) and the ranking at the end.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from models.data.vertical import VerticalTable, load_vertical, split_train_test
from models.metrics import evaluate_survival
from models.multimodal import build_multisurv, part_seed, survival_band
from models.multimodal_training import (
    MultimodalData,
    discretised_labels,
    fit_transforms,
    modality_inputs,
    predict_multisurv,
    train_multisurv,
)
from models.survival import restricted_mean_survival_time
from models.time_grid import make_time_grid
from simulations.results_file import append_jsonl

#: (data set, modalities, validation parts per seed).
DATA = (("metabric", ("genomic", "clinical"), 1), ("breast_cancer", ("genes", "clinical"), 3),
        ("synthetic_multimodal", ("a", "b"), 1), ("synthetic_multimodal", ("a", "b", "c"), 1))
SEEDS = (0, 1, 2, 3, 4)
PAPER = {"dim": 512, "encoder_layers": 2, "head_layers": 4, "dropout": 0.5, "risk_layer": "interval", "epochs": 20}


def settings() -> dict[str, dict[str, Any]]:
    """The grid: ``paper`` and the small networks, by name."""
    grid = {"paper": PAPER}
    for dim, encoder_layers, risk_layer, epochs in itertools.product((16, 32), (0, 1), ("proportional", "interval"),
                                                                     (20, 40)):
        grid[f"dim{dim}-enc{encoder_layers}-{risk_layer}-ep{epochs}"] = {
            "dim": dim, "encoder_layers": encoder_layers, "head_layers": 1, "dropout": 0.1, "risk_layer": risk_layer,
            "epochs": epochs}
    return grid


def validation_part(table: VerticalTable, seed: int, part: int) -> tuple[np.ndarray, np.ndarray]:
    """Fitting and validation IDs: a stratified 80/20 split of the training IDs of the label holder's split."""
    train_ids, _ = split_train_test(table, test_fraction=0.2, seed=seed)
    return split_train_test(table.subset(train_ids), test_fraction=0.2, seed=part_seed(seed, "validation", part))


def score(table: VerticalTable, fit_ids: np.ndarray, validation_ids: np.ndarray, *, seed: int,
          setting: dict[str, Any], passes: int = 20) -> dict[str, float]:
    """Train the twin on ``fit_ids`` with ``setting``; Harrell's C on ``validation_ids`` and the loss curve."""
    fit, validation = table.subset(fit_ids), table.subset(validation_ids)
    cuts = make_time_grid(fit.time, fit.event, num_durations=30)
    transforms = fit_transforms(table, fit_ids)
    data = MultimodalData(*modality_inputs(table, fit_ids, transforms), *discretised_labels(fit.time, fit.event, cuts))
    model = build_multisurv({name: t.input_shape for name, t in transforms.items()}, seed=seed,
                            num_durations=len(cuts), dim=setting["dim"], encoder_layers=setting["encoder_layers"],
                            head_layers=setting["head_layers"], dropout=setting["dropout"],
                            risk_layer=setting["risk_layer"])
    losses = train_multisurv(model, data, epochs=setting["epochs"], batch_size=128, lr=0.003, weight_decay=1e-4,
                             seed=seed)
    inputs, present = modality_inputs(table, validation_ids, transforms)
    mean, _, _ = survival_band(predict_multisurv(model, inputs, present, passes=passes, seed=seed))
    curves = mean.numpy()
    scores = evaluate_survival(cuts, curves, time=validation.time, event=validation.event,
                               risk=-restricted_mean_survival_time(cuts, curves), concordance_td=False)
    return {"c_index": round(float(scores["c_index"]), 4), "loss_first": round(losses[0], 3),
            "loss_last": round(losses[-1], 3)}


def ranking(rows: Iterable[dict]) -> list[tuple[str, float, dict[str, float]]]:
    """Settings by mean rank fraction of their mean validation C over the data settings that every setting
    ran (lowest first)."""
    means: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for row in rows:
        means[(row["setting"], row["data"])].append(row["c_index"])
    by_data: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (setting, data), values in means.items():
        by_data[data][setting] = float(np.mean(values))
    settings_seen = {setting for setting, _ in means}
    by_data = {data: scores for data, scores in by_data.items() if set(scores) == settings_seen}  # common groups
    ranks: dict[str, list[float]] = collections.defaultdict(list)
    for scores in by_data.values():
        for rank, setting in enumerate(sorted(scores, key=lambda name: -scores[name])):
            ranks[setting].append(rank / len(scores))
    return sorted(((setting, float(np.mean(values)), {data: by_data[data][setting] for data in by_data})
                   for setting, values in ranks.items() if len(values) == len(by_data)), key=lambda item: item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="also append the rows to this JSON-lines file")
    parser.add_argument("--settings", default="", help="comma-separated names (default: the whole grid)")
    parser.add_argument("--data", default="", help="comma-separated data settings, e.g. metabric,breast_cancer")
    parser.add_argument("--rank", default="", help="only print the ranking of the rows in this JSON-lines file")
    args = parser.parse_args()
    if args.rank:
        rows = [json.loads(line) for line in open(args.rank, encoding="utf-8") if line.strip()]
    else:
        torch.set_num_threads(1)
        grid = settings()
        chosen = [name.strip() for name in args.settings.split(",") if name.strip()] or list(grid)
        wanted = {name.strip() for name in args.data.split(",") if name.strip()}
        rows = []
        for name, modalities, parts in DATA:
            label = f"{name}:{'+'.join(modalities)}"
            if wanted and label not in wanted and name not in wanted:
                continue
            table = load_vertical(name).select(modalities)
            for setting in chosen:
                for seed, part in itertools.product(SEEDS, range(parts)):
                    started = time.perf_counter()
                    fit_ids, validation_ids = validation_part(table, seed, part)
                    row = {"setting": setting, "data": label, "seed": seed, "part": part,
                           **score(table, fit_ids, validation_ids, seed=seed, setting=grid[setting]),
                           "seconds": round(time.perf_counter() - started, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        append_jsonl(args.out, row)
    print("setting -> mean rank fraction (lower is better); mean validation C per data setting")
    for setting, value, by_data in ranking(rows):
        print(f"{setting:36s} {value:.3f}  " + "  ".join(f"{data} {c:.4f}" for data, c in by_data.items()))


if __name__ == "__main__":
    main()
