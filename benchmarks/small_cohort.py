"""Benchmark: ``private_split`` on a small cohort, 120-record METABRIC samples given as a user's vertical files.

Each run goes through the apps (:func:`simulations.engine.run_inprocess`) on one sample written as the
label holder's and the two sites' CSV files (:func:`write_sample`), 96 training and 24 test records.

``python -m benchmarks.small_cohort select [--out rows.jsonl] [--seeds 3] [--samples 8]``
    Runs every setting of :data:`GRID` on *selection* samples: 120 records drawn from the METABRIC records
    that no target sample holds, so no record of a target sample, training or test, is read. A setting's
    score is its mean test C over the selection samples and seeds.

``python -m benchmarks.small_cohort measure [--out rows.jsonl] [--seeds 5] [--samples 8] [key=value ...]``
    The *target* samples (``numpy.random.default_rng(k).choice`` of 120 records, k = 0, 1, ...; sample 0 is the
    one ``tests/test_private_split_run.py`` runs) at ε = 10 with the overrides given: test C per run.

Both print one JSON line per run (``--out`` appends them) and a summary per setting at the end. A
``dictionary`` override of ``true`` gives the sites :data:`DICTIONARY` (public ranges) as ``data.dictionary``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from models.data.vertical import METABRIC_CATEGORICAL, load_metabric_vertical
from simulations.engine import run_inprocess
from simulations.hydra_config import parse_value
from simulations.results_file import append_jsonl

#: Public knowledge about METABRIC's columns, not the data: log2 expression intensities, adult ages, binary levels.
DICTIONARY = {
    "numeric": {"x0": [4, 16], "x1": [4, 16], "x2": [4, 16], "x3": [4, 16], "x8": [20, 100]},
    "categorical": {column: ["0.0", "1.0"] for column in ("x4", "x5", "x6", "x7")},
}
#: Records per sample.
SIZE = 120
#: The settings ``select`` compares (each with the dictionary): the head's risk layer, the encoder statistics' share
#: and the set-up's share of ε.
GRID = [{"split.risk_layer": layer, "split.fit_share": fit, "privacy.setup_share": setup}
        for layer, fit, setup in itertools.product(("interval", "proportional"), (0.05, 0.1, 0.2), (0.2, 0.1, 0.05))]


def target_rows(sample: int, total: int) -> np.ndarray:
    """The record indices of target sample ``sample``."""
    return np.sort(np.random.default_rng(sample).choice(total, SIZE, replace=False))


def selection_rows(sample: int, total: int, targets: int) -> np.ndarray:
    """The record indices of selection sample ``sample``: drawn from the records none of the first ``targets`` target
    samples holds."""
    taken = np.unique(np.concatenate([target_rows(k, total) for k in range(targets)]))
    free = np.setdiff1d(np.arange(total), taken)
    return np.sort(np.random.default_rng(10_000 + sample).choice(free, SIZE, replace=False))


def write_sample(folder: Path, rows: np.ndarray) -> dict[str, str | bool]:
    """METABRIC's records ``rows`` as a user's vertical files in ``folder`` (labels, genomic, clinical); the overrides
    that run ``private_split`` on them."""
    table = load_metabric_vertical()
    ids = table.ids[rows]
    pd.DataFrame({"id": ids, "time": table.time[rows], "event": table.event[rows]}).to_csv(folder / "labels.csv",
                                                                                          index=False)
    for name, frame in table.modalities.items():
        frame.iloc[rows].set_axis(ids).rename_axis("id").reset_index().to_csv(folder / f"{name}.csv", index=False)
    (folder / "dictionary.json").write_text(json.dumps(DICTIONARY))
    return {"strategy.name": "private_split", "data.name": "vertical_files",
            "data.labels_path": str(folder / "labels.csv"),
            "data.modality_paths": f"{folder / 'genomic.csv'},{folder / 'clinical.csv'}",
            "data.categorical_cols": ",".join(METABRIC_CATEGORICAL["clinical"]), "baseline.centralized": False}


def _run(files: dict, setting: dict, seed: int, folder: Path) -> float:
    overrides = {**files, "privacy.epsilon": 10.0, "seed": seed, "output.dir": tempfile.mkdtemp(dir=folder)}
    for key, value in setting.items():
        if key == "dictionary":
            if value:
                overrides["data.dictionary"] = str(folder / "dictionary.json")
        else:
            overrides[key] = value
    return float(run_inprocess(overrides)["test"]["c_index"])


def run_grid(settings: list[dict], *, kind: str, samples: int, seeds: int, out: str | None) -> dict[str, float]:
    """Test C of every setting on ``samples`` samples of ``kind`` (selection or target) × ``seeds``; mean per setting."""
    total = len(load_metabric_vertical().ids)
    means = {}
    with tempfile.TemporaryDirectory() as scratch:
        for sample in range(samples):
            folder = Path(scratch) / f"{kind}{sample}"
            folder.mkdir()
            rows = selection_rows(sample, total, 8) if kind == "selection" else target_rows(sample, total)
            files = write_sample(folder, rows)
            for setting, seed in itertools.product(settings, range(seeds)):
                row = {"kind": kind, "sample": sample, "seed": seed, **setting,
                       "c_index": _run(files, setting, seed, folder)}
                print(json.dumps(row), flush=True)
                if out:
                    append_jsonl(out, row)
                means.setdefault(json.dumps(setting, sort_keys=True), []).append(row["c_index"])
    return {key: statistics.mean(values) for key, values in means.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("select", "measure"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="key=value (measure)")
    args = parser.parse_intermixed_args(argv)
    if args.command == "select":
        settings = [{"dictionary": True, **setting} for setting in GRID]
        means = run_grid(settings, kind="selection", samples=args.samples, seeds=args.seeds or 3, out=args.out)
    else:
        setting = {key: parse_value(value) for key, value in (item.split("=", 1) for item in args.overrides)}
        means = run_grid([setting], kind="target", samples=args.samples, seeds=args.seeds or 5, out=args.out)
    for key, mean in sorted(means.items(), key=lambda pair: -pair[1]):
        print(f"{mean:.3f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
