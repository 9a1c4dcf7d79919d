"""BVFLMSP Table 1 on a vertical data set: every baseline on every modality and combination.

Runs :func:`simulations.papers.baselines.fit_evaluate` for every model on every single modality and, for the
multimodal models only, every combination of two or more modalities, once per seed (a seed
drives the train/test split, the validation split, the initialisation and the training). Each
run appends one row to ``OUT/results.csv`` as soon as it finishes; a rerun skips the rows already
there. ``OUT/settings.json`` records the data set, test fraction and baseline settings, and a
rerun with different ones is refused (use another ``--out``). At the end ``OUT/table.md`` holds
the table in the paper's shape: rows model × metric, columns the modality combinations, mean ±
standard deviation over seeds, ``-`` where a model cannot take the combination.

Usage::

    python -m simulations.papers.table1 --data metabric --seeds 0,1,2,3,4 --out DIR \\
        [--jobs 2] [--epochs 200] [--multimodal-epochs 40] [--lr 0.01] ... [--report-only]

Every field of :class:`simulations.papers.baselines.BaselineSettings` is an option (``--multimodal-lr``,
``--patience``, ``--hidden 32,32``, ``--learning-rates nnet_survival=0.001,bayesian_multisurv=0.001``, ...).

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Sec. 7, Table 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from simulations.papers.baselines import METRICS, MODELS, UNIMODAL_MODELS, BaselineSettings, fit_evaluate
from models.data.vertical import BUILT_IN_VERTICAL, VerticalTable, load_vertical, split_train_test
from simulations.results_file import append_runs

#: The paper's Table 1 (TCGA, one 80:10:10 split, no spread): C-index per model and modalities.
PAPER_TABLE1_COLUMNS: tuple[str, ...] = ("Clinical", "miRNA", "DNAm", "Clinical+miRNA", "Clinical+DNAm",
                                         "Clinical+miRNA+DNAm")
PAPER_TABLE1_C_INDEX: dict[str, tuple[float, ...]] = {
    "CPH": (0.671, 0.651, 0.649, math.nan, math.nan, math.nan),
    "DeepSurv": (0.704, 0.649, 0.684, math.nan, math.nan, math.nan),
    "DeepHit": (0.672, 0.659, 0.703, math.nan, math.nan, math.nan),
    "nnetSurvival": (0.691, 0.613, 0.634, math.nan, math.nan, math.nan),
    "Multisurv": (0.696, 0.702, 0.701, 0.732, 0.737, 0.735),
    "BayesianMultisurv": (0.707, 0.703, 0.707, 0.734, 0.742, 0.752),
}
#: Row labels of the table, in the paper's order.
MODEL_LABELS = {
    "cox_ph": "Cox PH", "deepsurv": "DeepSurv", "deephit": "DeepHit", "nnet_survival": "nnet-survival",
    "multisurv": "MultiSurv", "bayesian_multisurv": "BayesianMultisurv",
}
METRIC_LABELS = {"c_index": "C-index", "c_index_td": "ctd", "ibs": "IBS", "inbll": "INBLL"}
FIELDS = ("data", "model", "modalities", "seed", *METRICS, "n_train", "n_fit", "n_validation", "n_test",
          "epochs_trained", "best_epoch", "validation_loss", "cox_penalizer", "seconds")


def combinations(modalities: Sequence[str]) -> list[tuple[str, ...]]:
    """Every non-empty combination of ``modalities``: the single ones first, then pairs, and so on."""
    return [combo for size in range(1, len(modalities) + 1) for combo in itertools.combinations(modalities, size)]


def can_run(model: str, combo: Sequence[str]) -> bool:
    """Whether ``model`` takes the modality combination ``combo`` (unimodal models: one modality)."""
    return len(combo) == 1 or model not in UNIMODAL_MODELS


@dataclasses.dataclass(frozen=True)
class Job:
    """One run: a model on a modality combination of one data set with one seed."""

    data: str
    data_dir: str
    model: str
    modalities: tuple[str, ...]
    seed: int
    test_fraction: float
    settings: BaselineSettings
    threads: int


@functools.cache
def _load(data: str, data_dir: str) -> VerticalTable:
    return load_vertical(data, data_dir=data_dir)


def run_job(job: Job) -> dict[str, object]:
    """Split with the job's seed, fit and evaluate: the row of ``results.csv``."""
    import torch

    torch.set_num_threads(job.threads)
    table = _load(job.data, job.data_dir)
    train_ids, test_ids = split_train_test(table, test_fraction=job.test_fraction, seed=job.seed)
    row = fit_evaluate(job.model, table, job.modalities, train_ids, test_ids, seed=job.seed, settings=job.settings)
    return {**row, "data": job.data}


def _read(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame(columns=list(FIELDS))
    return pd.read_csv(path, dtype={"modalities": str})


def _check_settings(out: Path, record: dict[str, object]) -> None:
    """Write ``settings.json``, or refuse when the folder holds results made with other settings."""
    path = out / "settings.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != record:
            changed = sorted(key for key in record.keys() | previous.keys() if previous.get(key) != record.get(key))
            raise SystemExit(f"{out}: results.csv was made with other settings (differences: {changed}); "
                             "use another --out or the same settings")
    else:
        path.write_text(json.dumps(record, indent=2) + "\n")


def run_table(out: Path, *, data: str, data_dir: str, seeds: Sequence[int], models: Sequence[str],
              test_fraction: float, settings: BaselineSettings, jobs: int, threads: int) -> pd.DataFrame:
    """Run the missing rows of the table (appended to ``out/results.csv`` as they finish); all rows."""
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out, {"data": data, "test_fraction": test_fraction, **_jsonable(settings)})
    path = out / "results.csv"
    done = {(row.model, row.modalities, int(row.seed)) for row in _read(path).itertuples()}
    modalities = list(_load(data, data_dir).modalities)
    todo = [Job(data, data_dir, model, combo, seed, test_fraction, settings, threads)
            for seed in seeds for combo in combinations(modalities) for model in models
            if can_run(model, combo) and (model, "+".join(combo), seed) not in done]
    print(f"{data}: {len(done)} runs in {path}, {len(todo)} to go", flush=True)
    append_runs(path, FIELDS, todo, run_job, workers=jobs, describe=lambda row: (
        f"{row['model']} on {row['modalities']} seed {row['seed']}: C {row['c_index']:.3f} "
        f"ctd {row['c_index_td']:.3f} IBS {row['ibs']:.3f} INBLL {row['inbll']:.3f} "
        f"(best epoch {row['best_epoch']}, {row['seconds']:.1f} s)"))
    return _read(path)


def _cell(values: pd.Series, seeds: int) -> str:
    """``mean ± std`` (sample std) of the finite values, with their count when it differs from ``seeds``."""
    finite = values[np.isfinite(values.to_numpy(dtype=float))]
    if finite.empty:
        return "not run" if values.empty else "NaN"
    spread = float(finite.std(ddof=1)) if len(finite) > 1 else 0.0
    text = f"{float(finite.mean()):.3f} ± {spread:.3f}"
    return text if len(finite) == seeds else f"{text} (n={len(finite)})"


def write_table(rows: pd.DataFrame, modalities: Sequence[str], models: Sequence[str] = MODELS) -> str:
    """Table 1's shape as markdown: rows model × metric, columns the modality combinations.

    Cells are mean ± sample standard deviation over the seeds in ``rows``; ``-`` where the model
    cannot take the combination, ``not run`` where it can but ``rows`` hold no run, ``(n=k)`` after
    a cell with fewer finite values than seeds.
    """
    combos = ["+".join(combo) for combo in combinations(modalities)]
    seeds = rows["seed"].nunique()
    lines = ["| Model | Metric | " + " | ".join(combos) + " |", "| --- | --- |" + " --- |" * len(combos)]
    for model in models:
        for metric in METRICS:
            cells = []
            for combo in combos:
                if not can_run(model, combo.split("+")):
                    cells.append("-")
                    continue
                chosen = rows.loc[(rows["model"] == model) & (rows["modalities"] == combo), metric]
                cells.append(_cell(chosen.astype(float), seeds))
            lines.append(f"| {MODEL_LABELS[model]} | {METRIC_LABELS[metric]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_paired_differences(rows: pd.DataFrame, modalities: Sequence[str], model: str = "bayesian_multisurv",
                             reference: str = "multisurv") -> str:
    """``model`` minus ``reference`` per modality combination and metric, paired by seed, as markdown.

    Each cell is the mean ± sample standard deviation over the seeds both ran of the difference,
    and ``better k/n``: the seeds on which ``model`` did better (higher C-indices, lower IBS and
    INBLL).
    """
    combos = ["+".join(combo) for combo in combinations(modalities) if can_run(model, combo) and can_run(reference, combo)]
    lines = [f"| Metric ({MODEL_LABELS[model]} − {MODEL_LABELS[reference]}) | " + " | ".join(combos) + " |",
             "| --- |" + " --- |" * len(combos)]
    for metric in METRICS:
        cells = []
        for combo in combos:
            pair = [rows.loc[(rows["model"] == name) & (rows["modalities"] == combo)].set_index("seed")[metric]
                    for name in (model, reference)]
            difference = (pair[0] - pair[1]).dropna()
            if difference.empty:
                cells.append("not run")
                continue
            better = int(((difference > 0) if metric in ("c_index", "c_index_td") else (difference < 0)).sum())
            spread = float(difference.std(ddof=1)) if len(difference) > 1 else 0.0
            cells.append(f"{float(difference.mean()):+.3f} ± {spread:.3f} (better {better}/{len(difference)})")
        lines.append(f"| {METRIC_LABELS[metric]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _jsonable(settings: BaselineSettings) -> dict[str, object]:
    """The settings as they read back from JSON (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(settings)))


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _learning_rates(text: str) -> tuple[tuple[str, float], ...]:
    """``model=rate,model=rate`` as ``((model, rate), ...)``."""
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected model=rate[,model=rate...], got {text!r}")
    return tuple((model.strip(), float(rate)) for model, rate in pairs)


#: Parsers of the settings that are not a scalar.
_PARSERS = {"hidden": _int_tuple, "learning_rates": _learning_rates}


def _settings_options(parser: argparse.ArgumentParser) -> None:
    """One option per field of :class:`BaselineSettings` (``--multimodal-lr``, ``--hidden 32,32``, ...)."""
    group = parser.add_argument_group("baseline settings (simulations.papers.baselines.BaselineSettings)")
    for field in dataclasses.fields(BaselineSettings):
        default = field.default
        kind = _PARSERS.get(field.name, type(default))
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        group.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=kind, default=default,
                           help=f"default {shown or 'none'}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, choices=BUILT_IN_VERTICAL)
    parser.add_argument("--data-dir", default="",
                        help="folder of metabric.csv (default: $FEDSURV_DATA_DIR, else the bundled copy)")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--report-only", action="store_true", help="rewrite table.md from results.csv")
    _settings_options(parser)
    args = parser.parse_args(argv)
    models = [model.strip() for model in args.models.split(",")]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    try:
        settings = BaselineSettings(**{field.name: getattr(args, field.name)
                                       for field in dataclasses.fields(BaselineSettings)})
    except ValueError as error:
        parser.error(str(error))
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.report_only:
        rows = _read(args.out / "results.csv")
    else:
        rows = run_table(args.out, data=args.data, data_dir=args.data_dir, seeds=seeds, models=models,
                         test_fraction=args.test_fraction, settings=settings, jobs=args.jobs, threads=args.threads)
    modalities = list(_load(args.data, args.data_dir).modalities)
    # every model of the folder's results, not only those this call ran (a rerun of one model keeps the others)
    shown = [model for model in MODELS if model in models or (len(rows) and model in set(rows["model"]))]
    text = write_table(rows, modalities, shown)
    if {"multisurv", "bayesian_multisurv"} <= set(shown):
        text += "\nPaired by seed:\n\n" + write_paired_differences(rows, modalities)
    minutes = rows["seconds"].sum() / 60 if len(rows) else math.nan
    header = (f"{args.data}: mean ± std over {rows['seed'].nunique()} seeds "
              f"({len(rows)} runs, {minutes:.1f} minutes of fitting summed over runs)\n\n")
    (args.out / "table.md").write_text(header + text)
    print(header + text)


if __name__ == "__main__":
    main()
