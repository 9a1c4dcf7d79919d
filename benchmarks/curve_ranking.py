r"""Why the hazard model's curves ranked worse over time (Antolini's C_td) than its risk score (Harrell's C) without
DP, the fix, and how the no-DP ``model.risk_layer`` default was chosen: through the apps on validation splits.

``python -m benchmarks.curve_ranking diagnose [--data ...] [--seeds 0,1] [--out rows.jsonl]``
    The cause. Trains the default (``model.risk_layer=interval``, 20 quantile intervals) on each validation file and
    takes its curves on the validation part apart: C_td beside pycox's ``concordance_td("antolini")`` and Harrell's
    C beside scikit-survival's ``concordance_index_censored`` (the project's numpy versions, checked against the
    libraries); Harrell's C of the curves' first column :math:`\hat S(\tau_0)` alone; the share of C_td's comparable
    pairs whose event falls in the first interval :math:`(\tau_0, \tau_1]`; C_td again with that first column given
    the order of the second (``c_index_td_col0_as_col1``), with every event ranked at the end of its own interval
    (``c_index_td_own_interval``) and on the curves interpolated at constant hazard within intervals.
``python -m benchmarks.curve_ranking select [--data ...] [--seeds 0,1,2] [--settings a,b] [--out rows.jsonl]``
    The choice (no test record is read): the settings of :data:`SETTINGS` on every validation file and seed.
``python -m benchmarks.curve_ranking evaluate [--data ...] [--seeds 0,1,2,3,4] [--settings a,b] [--out rows.jsonl]``
    The test figures of the two layers on the real federation (its test split).
``python -m benchmarks.curve_ranking table --rows rows.jsonl``
    Mean ± std over seeds of C, C_td, C - C_td and IBS per stage, data set and setting, and the choice (saved rows).

Data. The bundled sets at their default federation (FLCHAIN, METABRIC, GBSG, WHAS at 5 i.i.d. sites, SBA over its 4
census regions; ``evaluate`` also the simulated Cox data, ``sim_cox``) and five small public sets that lifelines and
scikit-survival ship (:data:`REGISTRY`), written as CSV files and run with ``data.name=csv``: NCCTG lung cancer over
its institutions (``federation.partition=inst``, the 9 with at least 10 patients: a small multi-centre federation),
the Veterans' lung-cancer trial over its 4 cell types, WHAS500, GBSG2 and Rossi at 5 i.i.d. sites. Validation files:
for the bundled sets those of :func:`benchmarks.setup_share.validation_csv` (each seed's training records of the
default federation, 80 % ``train`` / 20 % ``test``); for the public sets the same within each site
(:func:`registry_validation_csv`). Runs go through the ServerApp and ClientApp (:func:`simulations.engine.run_inprocess`)
without DP and are scored on the pooled validation (or test) parts.

The cause (rows of setting ``interval, untied``: the network before 2026-11-28, whose interval 0 had weights of its
own; ``docs/results/benchmarks/curve_ranking.jsonl``; figures are means over the seeds of the validation parts). C_td
is computed right: it equals pycox's ``concordance_td("antolini")`` on every run, and Harrell's C (on
:math:`-\mathrm{RMST}` of the curves over the grid) equals scikit-survival's. The gap came from the ``interval``
layer's first output. The quantile grid starts at :math:`\tau_0 = 0`, so interval 0 is the single point
:math:`\{0\}`: no event falls in it (bar time-0 records), its logit's dependence on the record was learnt from nothing
(every record only "survives" it, and Adam moves those weights at full speed all the same), and
:math:`\hat S(\tau_0)` ordered the records at chance: Harrell's C of that column alone was 0.47-0.53 on FLCHAIN,
METABRIC, GBSG and WHAS (0.77 on SBA). A right-continuous step curve keeps that value until :math:`\tau_1`, so C_td
ranked every event of the first interval by it; those events have the largest risk sets and hold 6-16 % of C_td's
comparable pairs (WHAS 16 %, one seed 21 %). Giving column 0 the order of column 1, and nothing else, brought C_td to
at most 0.012 below C on every bundled set (WHAS 0.759 -> 0.828, C 0.840); ranking every event at the end of
its own interval, to at most 0.002 below it. More intervals dilute the first one (WHAS: C - C_td 0.123 with 10
intervals, 0.068 with 20, 0.040 with 40), an even grid puts more events in it (WHAS 0.161), 40 rounds instead of 20
change nothing (0.065). Crossing of the later columns and the one-interval lag of step curves add the rest: little on
the bundled sets, more on the small public ones, where each interval's weights see few events (Veterans 0.060, GBSG2
0.035). The probe of the fix (interval 0 taking interval 1's weights by overriding the forward pass, setting
``interval, tied first interval (probe)``) closed the gap on every bundled set (|C - C_td| <= 0.013) with C and IBS
unchanged.

The fix. :class:`models.survival.HazardMLP`'s ``interval`` layer now ties interval 0 to interval 1 in the network
(:class:`models.survival.FirstIntervalTie`: ``Linear(width, T - 1)`` without bias, the tie, and the interval baselines
``β`` as a parameter of their own, which DP-SGD's ghost clipping takes as it takes the proportional layer's). It
draws another random initialisation than the untied network for the same seed (its output layer is one row smaller),
so the two are compared over seeds, not run for run.

The choice (:func:`choose`, validation rows only). Candidates are the two risk layers at the model's 20 intervals
(``model.num_durations`` is shared with the DP recipes, which must not change; the other settings are probes of the
hypotheses). A candidate qualifies when on every bundled set (a) its mean validation |C - C_td| is within
:data:`TARGET` and (b) its mean validation C is not below the former default's (``interval, untied``) by more than two
standard errors of the paired per-seed differences (the issue's "without lowering C"); among those, the lowest mean
rank of C and IBS over the bundled (data set, seed) groups that ran both wins. Seeds 0-2 everywhere, and 3-7 on
METABRIC and SBA, whose C moved most between the first runs. The untied layer fails (a) (WHAS 0.068); ``proportional``
fails (b) on SBA (0.940 against 0.945, paired difference -0.006 ± 0.001: its hazards are not proportional); the tied ``interval`` meets both (worst
|C - C_td| 0.022 on METABRIC, where C_td is the higher; C differences -0.003 ± 0.006 on METABRIC, -0.001 ± 0.001 on
SBA) and stays the no-DP default (``strategies/config.py`` ``TRAINING_DEFAULTS``).

Test figures (``evaluate``, seeds 0-4, SBA 0-9; untied -> tied): |C - C_td| 0.013 -> 0.001 (FLCHAIN), 0.015 ->
0.022 (METABRIC, C_td the higher), 0.022 -> 0.003 (GBSG), 0.052 -> 0.007 (WHAS), 0.010 -> 0.006 (SBA) and 0.119 ->
0.026 (``sim_cox``); C 0.800 -> 0.800, 0.640 -> 0.647, 0.683 -> 0.684, 0.839 -> 0.839, 0.948 -> 0.947 (paired
difference -0.001 ± 0.001) and 0.936 -> 0.922 (-0.015 ± 0.016: one seed's C is 0.858, its −RMST ranking swinging
between 0.80 and 0.86 from round to round while its C_td stays at 0.948; the other four seeds 0.938 both).

Prints one JSON line per run (``--out`` appends them) and the table at the end. The saved rows are the output of
``diagnose --seeds 0,1``, ``select`` and ``evaluate`` (those of the untied network relabelled ``..., untied``).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.setup_share import NATURAL, validation_csv
from flwr_app import interrupt
from models.data import load_table
from models.data.federated import SPLIT_STREAM, assign_sites, train_test_positions
from models.data.partition import stratified_split
from simulations.engine import resolve, run_inprocess
from simulations.results_file import append_jsonl, mean_std

BUNDLED = ("flchain", "metabric", "gbsg", "whas", "sba")
#: Largest |C - C_td| (mean over seeds, validation) a default may leave on any bundled set.
TARGET = 0.03
SITES = 5
VALIDATION_STREAM = 37
#: The former default's rows: the ``interval`` layer before interval 0 was tied to interval 1 (2026-11-28).
FORMER = "interval, untied"
#: The candidate defaults (the default first) and the probes of the hypotheses: name -> run-config overrides.
CANDIDATES = {"interval": {"model.risk_layer": "interval"}, "proportional": {"model.risk_layer": "proportional"}}
SETTINGS: dict[str, dict[str, Any]] = {
    **CANDIDATES,
    "interval, 10 intervals": {"model.risk_layer": "interval", "model.num_durations": 10},
    "interval, 40 intervals": {"model.risk_layer": "interval", "model.num_durations": 40},
    "interval, even grid": {"model.risk_layer": "interval", "model.time_grid": "equidistant"},
    "interval, 40 rounds": {"model.risk_layer": "interval", "federation.rounds": 40},
    "proportional, 40 intervals": {"model.risk_layer": "proportional", "model.num_durations": 40},
}
#: The test figures: the two risk layers.
EVALUATE = CANDIDATES


# --------------------------------------------------------------------------- public data sets


@dataclass(frozen=True)
class Registry:
    """A public data set from a package: how to read it (a frame with ``time`` and ``event``) and its federation."""

    source: str
    read: Callable[[], pd.DataFrame]
    partition: str = "iid"
    min_site_records: int = 0


def _lung() -> pd.DataFrame:
    from lifelines.datasets import load_lung

    frame = load_lung().dropna(subset=["inst"]).rename(columns={"status": "event"})
    return frame.assign(inst=frame["inst"].astype(int))


def _veterans() -> pd.DataFrame:
    from sksurv.datasets import load_veterans_lung_cancer

    x, y = load_veterans_lung_cancer()
    return x.assign(time=y["Survival_in_days"], event=y["Status"].astype(int))


def _whas500() -> pd.DataFrame:
    from sksurv.datasets import load_whas500

    x, y = load_whas500()
    return x.assign(time=y["lenfol"], event=y["fstat"].astype(int))


def _gbsg2() -> pd.DataFrame:
    from lifelines.datasets import load_gbsg2

    return load_gbsg2().rename(columns={"cens": "event"})


def _rossi() -> pd.DataFrame:
    from lifelines.datasets import load_rossi

    return load_rossi().rename(columns={"week": "time", "arrest": "event"})


REGISTRY: dict[str, Registry] = {
    "lung": Registry("lifelines load_lung (NCCTG), by institution", _lung, "inst", 10),
    "veterans": Registry("scikit-survival load_veterans_lung_cancer, by cell type", _veterans, "Celltype"),
    "whas500": Registry("scikit-survival load_whas500", _whas500),
    "gbsg2": Registry("lifelines load_gbsg2", _gbsg2),
    "rossi": Registry("lifelines load_rossi", _rossi),
}
DATA = ",".join((*BUNDLED, *REGISTRY))


def registry_csv(name: str, folder: Path) -> Path:
    """The public data set ``name`` as a CSV file with ``time`` and ``event`` columns (written once per folder)."""
    path = folder / f"{name}.csv"
    if not path.exists():
        REGISTRY[name].read().to_csv(path, index=False)
    return path


def _registry_keys(name: str) -> dict[str, Any]:
    spec = REGISTRY[name]
    return {"federation.partition": spec.partition, "federation.min_site_records": spec.min_site_records}


def registry_validation_csv(name: str, seed: int, folder: Path) -> Path:
    """The seed's training records of the public set's federation (as ``data.name=csv`` partitions and splits them),
    each site's split 80/20 (stratified by event) into ``train`` and ``test`` (validation); a natural partition's
    column is kept as the site name. The seed's test records are left out."""
    spec = REGISTRY[name]
    path = registry_csv(name, folder)
    table = load_table("csv", path=str(path), notes=False)
    if spec.partition != "iid":
        table = table.with_group(spec.partition)
    test_fraction = resolve({"data.name": "csv", "data.path": str(path)})[1].data.test_fraction
    sites = assign_sites(table, spec.partition, np.arange(len(table)), num_sites=SITES, seed=seed,
                         dirichlet_alpha=0.5, min_site_records=spec.min_site_records)
    split_rng = np.random.default_rng([seed, SPLIT_STREAM])
    validation_rng = np.random.default_rng([seed, VALIDATION_STREAM])
    rows, labels = [], []
    for site, positions in sites.items():
        train = train_test_positions(table, positions, test_fraction=test_fraction, rng=split_rng, site=site)[0]
        fit, validation = stratified_split(train, table.event, 0.2, validation_rng)
        rows += [fit, validation]
        labels += [np.full(fit.size, "train"), np.full(validation.size, "test")]
    rows_all, labels_all = np.concatenate(rows), np.concatenate(labels)
    order = np.argsort(rows_all)
    rows_all, labels_all = rows_all[order], labels_all[order]
    frame = table.features.iloc[rows_all]
    if spec.partition != "iid":
        frame = frame.assign(**{spec.partition: table.groups[spec.partition].iloc[rows_all].to_numpy()})
    frame = frame.assign(time=table.time[rows_all], event=table.event[rows_all].astype(int), split=labels_all)
    out = folder / f"{name}_validation_seed{seed}.csv"
    frame.to_csv(out, index=False)
    return out


# --------------------------------------------------------------------------- runs


def validation_keys(name: str, seed: int, folder: Path) -> dict[str, Any]:
    """The run-config keys that train on the seed's validation file of ``name`` and score its validation part."""
    if name in REGISTRY:
        path, natural = registry_validation_csv(name, seed, folder), _registry_keys(name)
    else:
        path, natural = validation_csv(name, seed, folder), NATURAL.get(name, {})
    return {"data.name": "csv", "data.path": str(path), "data.split_col": "split", **natural}


def federation_keys(name: str, folder: Path) -> dict[str, Any]:
    """The run-config keys of the real federation of ``name`` (scored on its test split)."""
    if name in REGISTRY:
        return {"data.name": "csv", "data.path": str(registry_csv(name, folder)), **_registry_keys(name)}
    return {"data.name": name}


def run(keys: dict[str, Any], setting: str, overrides: dict[str, Any], seed: int, folder: Path) -> dict[str, Any]:
    """One run without DP through the apps; its summary and output folder."""
    out = Path(tempfile.mkdtemp(dir=folder))
    summary = run_inprocess({**keys, "seed": seed, "baseline.centralized": False, "output.dir": str(out), **overrides})
    return {"summary": summary, "dir": out}


def scores(summary: dict[str, Any]) -> dict[str, float]:
    test = summary["test"]
    return {"c_index": test["c_index"], "c_index_td": test["c_index_td"], "ibs": test["ibs"],
            "gap": summary.get("calibration", {}).get("median_gap", math.nan), "num_sites": summary["num_sites"]}


def emit(row: dict, rows: list[dict], out: str) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        append_jsonl(out, row)


def _chosen(settings: dict[str, dict[str, Any]], names: str) -> dict[str, dict[str, Any]]:
    """The settings named in ``names`` (comma-separated; all when empty)."""
    if not names:
        return settings
    unknown = sorted(set(names.split(",")) - set(settings))
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {sorted(settings)}")
    return {name: settings[name] for name in names.split(",")}


def _validation_files(args: argparse.Namespace, folder: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(data set, seed, run-config keys)`` of every validation file of ``--data`` and ``--seeds``, in ``folder``."""
    for name in args.data.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            yield name, seed, validation_keys(name, seed, folder)


def run_select(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, seed, keys in _validation_files(args, folder):
            for setting, overrides in _chosen(SETTINGS, args.settings).items():
                result = run(keys, setting, overrides, seed, folder)
                emit({"stage": "select", "data": name, "seed": seed, "setting": setting,
                      **scores(result["summary"])}, rows, args.out)
    return rows


def run_evaluate(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.data.split(","):
            keys = federation_keys(name, folder)
            for seed in (int(s) for s in args.seeds.split(",")):
                for setting, overrides in _chosen(EVALUATE, args.settings).items():
                    result = run(keys, setting, overrides, seed, folder)
                    emit({"stage": "evaluate", "data": name, "seed": seed, "setting": setting,
                          "risk_layer": resolve({**keys, "seed": seed, **overrides})[1].model.risk_layer,
                          **scores(result["summary"])}, rows, args.out)
    return rows


def constant_hazard_curves(times: np.ndarray, surv: np.ndarray, points: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Step curves on the grid refined to ``points`` steps per interval at constant hazard within each interval
    (pycox's ``LogisticHazard.interpolate(points, "const_hazard")``)."""
    grid, curves = [times[:1]], [surv[:, :1]]
    share = np.arange(1, points + 1) / points
    for j in range(1, times.size):
        grid.append(times[j - 1] + share * (times[j] - times[j - 1]))
        before = surv[:, j - 1:j]
        ratio = np.divide(surv[:, j:j + 1], before, out=np.zeros_like(before), where=before > 0)
        curves.append(before * ratio ** share[None, :])
    return np.concatenate(grid), np.concatenate(curves, axis=1)


def decompose(model: Any, records: Any) -> dict[str, float]:
    """The figures of ``diagnose`` for a trained hazard model on the validation records."""
    from pycox.evaluation import EvalSurv
    from sksurv.metrics import concordance_index_censored

    from models.metrics import _antolini, _harrell, evaluate_survival

    time, event = records.time, records.event
    times, surv, risk = model.predict(records.x)
    metrics = evaluate_survival(times, surv, time=time, event=event, risk=risk)
    pycox = EvalSurv(pd.DataFrame(surv.T, index=times), time, event.astype(int), censor_surv="km")
    position = np.searchsorted(times, time, side="right")  # C_td reads column position - 1 at an event's time
    died = np.flatnonzero(event == 1)
    pairs = np.array([np.sum((time > time[i]) | ((time == time[i]) & (event == 0))) for i in died])
    first = position[died] == 1
    column0 = surv.copy()
    column0[:, 0] = 1.0 - 1e-12 * (1.0 - surv[:, 1])  # the order of column 1 at (almost) the value 1
    own = np.concatenate([surv[:, 1:], surv[:, -1:]], axis=1)  # each event ranked at the end of its interval
    refined = constant_hazard_curves(times, surv)
    return {
        "c_index": metrics["c_index"], "c_index_td": metrics["c_index_td"], "ibs": metrics["ibs"],
        "pycox_c_index_td": float(pycox.concordance_td("antolini")),
        "sksurv_c_index": float(concordance_index_censored(event.astype(bool), time, risk)[0]),
        "c_index_of_column0": _harrell(-surv[:, 0], time, event),
        "events": int(died.size), "first_interval_events": int(first.sum()),
        "first_interval_pair_share": float(pairs[first].sum() / pairs.sum()),
        "c_index_td_col0_as_col1": _antolini(times, column0, time, event),
        "c_index_td_own_interval": _antolini(times, own, time, event),
        "c_index_td_constant_hazard": _antolini(*refined, time, event),
    }


def run_diagnose(args: argparse.Namespace) -> list[dict]:
    from flwr_app import task
    from models.predict import load_run

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, seed, keys in _validation_files(args, folder):
            overrides = CANDIDATES["interval"]
            result = run(keys, "interval", overrides, seed, folder)
            cfg = resolve({**keys, "seed": seed, **overrides})[1]
            records = task.load_federation(cfg).pooled("test")
            emit({"stage": "diagnose", "data": name, "seed": seed, "setting": "interval",
                  **decompose(load_run(result["dir"]).model, records)}, rows, args.out)
    return rows


# --------------------------------------------------------------------------- summary


def _cells(rows: list[dict], stage: str) -> dict[tuple[str, str], list[dict]]:
    cells: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for row in rows:
        if row["stage"] == stage:
            cells[(row["data"], row["setting"])].append(row)
    return cells


def _c_change(candidate: list[dict], former: list[dict]) -> tuple[float, float] | None:
    """Mean and standard error of the paired per-seed C differences, candidate minus former default (None without
    two seeds in common)."""
    by_seed = {row["seed"]: row["c_index"] for row in former}
    diffs = [row["c_index"] - by_seed[row["seed"]] for row in candidate if row["seed"] in by_seed]
    if len(diffs) < 2:
        return None
    return statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def _mean_ranks(rows: list[dict]) -> dict[str, float]:
    """Mean rank (0 best, 1 worst) of C and IBS over the bundled (data set, seed) groups where every candidate ran."""
    groups: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for row in rows:
        if row["stage"] == "select" and row["data"] in BUNDLED and row["setting"] in CANDIDATES:
            groups[(row["data"], row["seed"])].append(row)
    ranks: dict[str, list[float]] = collections.defaultdict(list)
    for group in groups.values():
        if len(group) < len(CANDIDATES):
            continue
        for key, sign in (("c_index", -1.0), ("ibs", 1.0)):
            for position, row in enumerate(sorted(group, key=lambda row: sign * row[key])):
                ranks[row["setting"]].append(position / (len(group) - 1))
    return {setting: statistics.mean(values) for setting, values in ranks.items()}


def choose(rows: list[dict]) -> dict[str, Any]:
    """The choice of the module text from ``select`` rows: per candidate its worst bundled mean |C - C_td|, its C
    change against :data:`FORMER` per bundled set (mean, standard error), whether it qualifies (gap within
    :data:`TARGET` and no C change below two standard errors) and its mean rank of C and IBS; the best qualifying."""
    cells = _cells(rows, "select")
    ranks = _mean_ranks(rows)
    table: dict[str, dict[str, Any]] = {}
    for setting in CANDIDATES:
        names = [name for name in BUNDLED if (name, setting) in cells]
        if not names:
            continue
        gap = max(abs(statistics.mean(r["c_index"] - r["c_index_td"] for r in cells[(name, setting)])) for name in names)
        change = {name: _c_change(cells[(name, setting)], cells.get((name, FORMER), [])) for name in names}
        keeps_c = all(value is None or value[0] >= -2.0 * value[1] for value in change.values())
        table[setting] = {"worst_gap": gap, "c_change": change, "qualifies": gap <= TARGET and keeps_c,
                          "mean_rank": ranks.get(setting, math.nan)}
    qualified = [setting for setting, value in table.items() if value["qualifies"]]
    return {"candidates": table, "best_qualifying": min(qualified, key=lambda s: table[s]["mean_rank"], default=None)}


def print_table(rows: list[dict]) -> None:
    for stage in ("diagnose", "select", "evaluate"):
        cells = _cells(rows, stage)
        if not cells:
            continue
        print(f"\n{stage}: mean ± std over seeds")
        if stage == "diagnose":
            keys = ("c_index", "c_index_td", "pycox_c_index_td", "sksurv_c_index", "c_index_of_column0",
                    "first_interval_pair_share", "c_index_td_col0_as_col1", "c_index_td_own_interval",
                    "c_index_td_constant_hazard")
            print("| data | " + " | ".join(keys) + " |")
            print("|---" * (len(keys) + 1) + "|")
            for (name, _), group in cells.items():
                print(f"| {name} | " + " | ".join(mean_std(r[k] for r in group) for k in keys) + " |")
            continue
        print("| data | setting | seeds | C | C_td | C - C_td | IBS |")
        print("|---|---|---|---|---|---|---|")
        for (name, setting), group in cells.items():
            print(f"| {name} | {setting} | {len(group)} | {mean_std(r['c_index'] for r in group)} | "
                  f"{mean_std(r['c_index_td'] for r in group)} | "
                  f"{mean_std(r['c_index'] - r['c_index_td'] for r in group)} | {mean_std(r['ibs'] for r in group)} |")
    if _cells(rows, "select"):
        print(json.dumps({"choice": choose(rows)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("diagnose", "select", "evaluate", "table"))
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--seeds", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--settings", default="", help="select, evaluate: only these settings (comma-separated)")
    parser.add_argument("--rows", default="", help="table: the saved rows (JSON lines)")
    args = parser.parse_args(argv)
    if args.stage == "table":
        lines = Path(args.rows).read_text(encoding="utf-8").splitlines()
        print_table([json.loads(line) for line in lines if line.strip()])
        return
    stages = {"diagnose": (run_diagnose, "0,1"), "select": (run_select, "0,1,2"),
              "evaluate": (run_evaluate, "0,1,2,3,4")}
    function, seeds = stages[args.stage]
    args.seeds = args.seeds or seeds
    print_table(function(args))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
