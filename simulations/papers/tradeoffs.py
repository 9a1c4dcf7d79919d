"""The measured trade-offs of docs/when-to-use-what.md: runs through the apps, and their tables.

``python -m simulations.papers.tradeoffs run PLAN --out rows.jsonl [--strategies a,b]``   run every configuration of a
plan, or those of the named strategies (resumable: configurations already in ``rows.jsonl`` are skipped)
``python -m simulations.papers.tradeoffs table rows.jsonl [...]``      mean ± std over seeds per setting, as Markdown

Every run is a whole federation through the ServerApp and ClientApp (:func:`simulations.engine.run_inprocess`,
Flower's Message API in one process) with the project's defaults except what the plan sets. A row keeps the
final global model's test (and SBA out-of-time) metrics on the pooled test split, the headline ε of the
ledger (the largest over sites, never an average) and the centralised baseline (the same mechanism on the
pooled data; not private, a simulation reference). Hyperparameters are the defaults; nothing here is tuned
on test data.

Plans
-----
``main``: SBA (4 census regions) and FLCHAIN (5 sites): fedavg, and dp_sgd at ε = 1, 2, 10, seeds 0-4.
``old_recipe``: FLCHAIN dp_sgd at ε = 1, 10 with the defaults before the DP recipe (lr 0.003, batch 128,
1 local epoch, clip 1), seeds 0-4.
``site_size``: FLCHAIN with 20 sites (a quarter of the records each), fedavg and dp_sgd at ε = 1, seeds 0-2.
``central_dp_sites``: the simulated Cox data (35,000 training records) over 10, 100 and 1000 sites, fedavg
and central_dp at ε = 1, 10 rounds, seeds 0-2 (1000 sites: seed 0; a round takes minutes on 2 cores).
``states``: SBA over the 40 states with at least 100 loans, dp_sgd at ε = 1, seeds 0-2.
``distributed``: SBA over the 40 states with at least 100 loans and over the 4 regions, distributed_dp at
ε = 1, seeds 0-4.
``field``: every bundled real data set (FLCHAIN, METABRIC, GBSG, WHAS at 5 i.i.d. sites, SBA over the 4
regions): fedavg, and dp_sgd and distributed_dp at ε = 1 and 10, seeds 0-4; its table (``field-table``) has
the time-dependent C, the Kaplan-Meier-null IBS and the calibration gap at the median follow-up beside C and IBS.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr_app import interrupt
from simulations.results_file import append_jsonl, code_commit

SEEDS5 = range(5)
OLD_RECIPE = {"train.lr": 0.003, "train.batch_size": 128, "train.local_epochs": 1, "privacy.clip_norm": 1.0,
              "model.risk_layer": "interval"}
SBA_REGIONS = {"data.name": "sba", "federation.partition": "region"}
SBA_STATES = {"data.name": "sba", "federation.partition": "State", "federation.min_site_records": 100}
FIELD_DATA = ("flchain", "metabric", "gbsg", "whas", "sba")


def _plans() -> dict[str, list[dict[str, Any]]]:
    main: list[dict[str, Any]] = []
    for seed in SEEDS5:
        main += [{**SBA_REGIONS, "strategy.name": "fedavg", "seed": seed},
                 {"data.name": "flchain", "strategy.name": "fedavg", "seed": seed}]
    for epsilon in (1, 10, 2):
        for seed in SEEDS5:
            main += [{**SBA_REGIONS, "strategy.name": "dp_sgd", "privacy.epsilon": epsilon, "seed": seed},
                     {"data.name": "flchain", "strategy.name": "dp_sgd", "privacy.epsilon": epsilon, "seed": seed}]
    old = [{"data.name": "flchain", "strategy.name": "dp_sgd", "privacy.epsilon": epsilon, "seed": seed,
            "baseline.centralized": False, **OLD_RECIPE} for epsilon in (1, 10) for seed in SEEDS5]
    size = [{"data.name": "flchain", "federation.num_sites": 20, "strategy.name": strategy, "seed": seed,
             "baseline.centralized": False, **({"privacy.epsilon": 1} if strategy == "dp_sgd" else {})}
            for seed in range(3) for strategy in ("dp_sgd", "fedavg")]
    central = [{"data.name": "sim_cox", "federation.num_sites": sites, "strategy.name": strategy, "seed": seed,
                "federation.rounds": 10, "baseline.centralized": False, "federation.min_sites": 2,
                **({"privacy.epsilon": 1} if strategy == "central_dp" else {})}
               for sites in (10, 100, 1000) for seed in (range(3) if sites < 1000 else (0,))
               for strategy in ("fedavg", "central_dp")]
    distributed = [{**partition, "strategy.name": "distributed_dp", "privacy.epsilon": 1, "seed": seed}
                   for partition in (SBA_STATES, SBA_REGIONS) for seed in SEEDS5]
    states = [{**SBA_STATES, "strategy.name": "dp_sgd", "privacy.epsilon": 1, "seed": seed,
               "baseline.centralized": False} for seed in range(3)]
    field = [{**({"data.name": name} if name != "sba" else SBA_REGIONS), "strategy.name": strategy, "seed": seed,
              "baseline.centralized": False, **({"privacy.epsilon": epsilon} if epsilon else {})}
             for name in FIELD_DATA for seed in SEEDS5
             for strategy, epsilon in (("fedavg", 0), ("dp_sgd", 1), ("dp_sgd", 10), ("distributed_dp", 1),
                                       ("distributed_dp", 10))]
    return {"main": main, "states": states, "old_recipe": old, "site_size": size, "central_dp_sites": central,
            "distributed": distributed, "field": field}


PLANS = _plans()


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def run(plan: Iterable[dict[str, Any]], out: Path) -> None:
    """Run each configuration not yet in ``out``; append one JSON row per run (an error is a row too)."""
    from simulations.engine import run_inprocess

    done = {_key(json.loads(line)["config"]) for line in out.read_text().splitlines()} if out.exists() else set()
    for config in plan:
        if _key(config) in done:
            continue
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as directory:
            run_dir = Path(directory) / hashlib.sha1(_key(config).encode()).hexdigest()[:12]
            try:
                summary = run_inprocess({**config, "output.dir": str(run_dir)})
                calibration = summary.get("calibration", {})
                row = {"config": config, "test": summary["test"], "oot": summary.get("oot"),
                       "epsilon": summary["privacy"].get("epsilon"), "centralized": summary.get("centralized"),
                       "calibration": {key: calibration.get(key) for key in ("median_gap", "ibs_km_null")},
                       "commit": code_commit()}
            except interrupt.StopRequested:
                raise  # a signal stops the plan: this run leaves no row, and a later call runs it again
            except Exception as err:  # a failed run is a row, and the plan goes on
                row = {"config": config, "error": f"{type(err).__name__}: {err}"[:500]}
        row["wall_s"] = round(time.perf_counter() - started, 1)
        append_jsonl(out, row)
        print(_key(config), row.get("error") or {k: round(v, 4) for k, v in row["test"].items()}, flush=True)


def _setting(config: dict[str, Any]) -> tuple:
    sites = (config.get("federation.partition") or f"{config.get('federation.num_sites', 5)} iid")
    recipe = "old recipe" if "train.lr" in config else ""
    return (config["data.name"], sites, config["strategy.name"], config.get("privacy.epsilon", math.inf), recipe)


def _moments(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    mean, std = _moments(values)
    return f"{mean:.3f} ± {std:.3f}"


def _default_run(row: dict[str, Any], match: dict[str, Any]) -> bool:
    """A run that finished, with the defaults' training keys, whose configuration has every value of ``match``."""
    config = row["config"]
    return ("error" not in row and not any(key.startswith("train.") for key in config)
            and all(config.get(key) == value for key, value in match.items()))


def table(rows: Iterable[dict[str, Any]]) -> str:
    """Mean ± std (sample std) over seeds per setting, with the centralised baseline beside it.

    The baseline trains on the pooled training records with the run's mechanism when that is per-record DP-SGD
    (``dp_sgd``, ``bdp``: "DP at the same ε"), and without DP otherwise ("no DP").
    """
    groups: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        groups[_setting(row["config"])].append(row)
    lines = ["| data | sites | strategy | target ε | seeds | test C | test IBS | ε (max over seeds) | "
             "centralised baseline | its C | its IBS |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (data, sites, strategy, epsilon, recipe), members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ok = [row for row in members if "error" not in row]
        baselines = [row["centralized"] for row in ok if isinstance(row.get("centralized"), dict)
                     and "test" in row["centralized"]]
        central = [baseline["test"] for baseline in baselines]
        kind = ("DP, same ε" if baselines and isinstance(baselines[0].get("privacy"), dict) else
                "no DP" if baselines else "–")
        epsilons = [row["epsilon"] for row in ok if row.get("epsilon") is not None]
        name = f"{strategy} ({recipe})" if recipe else strategy
        lines.append(
            f"| {data} | {sites} | {name} | {'–' if math.isinf(epsilon) else f'{epsilon:g}'} | {len(ok)}"
            f"{f' ({len(members) - len(ok)} failed)' if len(ok) < len(members) else ''} | "
            f"{_mean_std([row['test']['c_index'] for row in ok])} | {_mean_std([row['test']['ibs'] for row in ok])} | "
            f"{f'{max(epsilons):.3f}' if epsilons else '–'} | {kind} | {_mean_std([c['c_index'] for c in central])} | "
            f"{_mean_std([c['ibs'] for c in central])} |")
    return "\n".join(lines)


def field_table(rows: Iterable[dict[str, Any]]) -> str:
    """Mean ± std over seeds per (data, strategy, ε): C, time-dependent C, IBS, the Kaplan-Meier-null IBS and the
    absolute gap between mean predicted and Kaplan-Meier survival at the median follow-up (pooled test split)."""
    groups: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        config = row["config"]
        groups[(FIELD_DATA.index(config["data.name"]), config["data.name"], config["strategy.name"] != "fedavg",
                config["strategy.name"], config.get("privacy.epsilon", 0))].append(row)
    lines = ["| data | strategy | ε | seeds | C | C_td | IBS | Kaplan–Meier IBS | gap at median | ε (max) | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (_, data, _, strategy, epsilon), members in sorted(groups.items()):
        ok = [row for row in members if "error" not in row]
        epsilons = [row["epsilon"] for row in ok if row.get("epsilon") is not None]
        commits = ", ".join(sorted({row.get("commit", "") for row in ok}))
        lines.append(
            f"| {data} | {strategy} | {epsilon or '–'} | {len(ok)}"
            f"{f' ({len(members) - len(ok)} failed)' if len(ok) < len(members) else ''} | "
            + " | ".join(_mean_std([row["test"][key] for row in ok]) for key in ("c_index", "c_index_td", "ibs"))
            + " | " + " | ".join(_mean_std([row["calibration"][key] for row in ok]) for key in ("ibs_km_null",
                                                                                                  "median_gap"))
            + f" | {f'{max(epsilons):.3f}' if epsilons else '–'} | {commits} |")
    return "\n".join(lines)


#: The README's headline rows of the field plan: (federation label, data set, strategy); ε = 1 for the DP ones.
FIELD_HEADLINE: tuple[tuple[str, str, str], ...] = tuple(
    (label, data, strategy) for label, data in (("FLCHAIN, 5 sites", "flchain"), ("METABRIC, 5 sites", "metabric"),
                                                ("SBA loans, 4 regions", "sba"))
    for strategy in ("fedavg", "dp_sgd", "distributed_dp"))


def field_headline(rows: Iterable[dict[str, Any]]) -> str:
    """The README's table: C, IBS and the Kaplan-Meier IBS (mean ± std over seeds) and the largest ε, at ε = 1."""
    rows = [row for row in rows if "error" not in row]
    lines = ["| federation | strategy | ε | C | IBS | Kaplan–Meier IBS |", "| --- | --- | --- | --- | --- | --- |"]
    for label, data, strategy in FIELD_HEADLINE:
        members = [row for row in rows if row["config"]["data.name"] == data
                   and row["config"]["strategy.name"] == strategy and row["config"].get("privacy.epsilon", 1) == 1]
        epsilons = [row["epsilon"] for row in members if row.get("epsilon") is not None]
        lines.append(f"| {label} | {strategy if epsilons else f'{strategy} (no DP)'} | "
                     f"{f'{max(epsilons):.3f}' if epsilons else '–'} | "
                     f"{_mean_std([row['test']['c_index'] for row in members])} | "
                     f"{_mean_std([row['test']['ibs'] for row in members])} | "
                     f"{_moments([row['calibration']['ibs_km_null'] for row in members])[0]:.3f} |")
    return "\n".join(lines)


def load_rows(folder: Path, *names: str) -> list[dict[str, Any]]:
    """The saved rows of the named plans (``folder/<name>.jsonl``)."""
    return [json.loads(line) for name in names for line in (folder / f"{name}.jsonl").read_text().splitlines()
            if line.strip()]


#: The README's headline rows: (federation label, data set, partition or site count, strategy label, filter).
HEADLINE: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("FLCHAIN, 5 sites", {"data.name": "flchain", "strategy.name": "fedavg"}, "fedavg (no DP)"),
    ("FLCHAIN, 5 sites", {"data.name": "flchain", "strategy.name": "dp_sgd", "privacy.epsilon": 1}, "dp_sgd"),
    ("FLCHAIN, 5 sites", {"data.name": "flchain", "strategy.name": "dp_sgd", "privacy.epsilon": 10}, "dp_sgd"),
    ("SBA loans, 4 regions", {**SBA_REGIONS, "strategy.name": "fedavg"}, "fedavg (no DP)"),
    ("SBA loans, 4 regions", {**SBA_REGIONS, "strategy.name": "dp_sgd", "privacy.epsilon": 1}, "dp_sgd"),
    ("SBA loans, 4 regions", {**SBA_REGIONS, "strategy.name": "distributed_dp", "privacy.epsilon": 1},
     "distributed_dp (60 rounds)"),
    ("SBA loans, 40 states", {**SBA_STATES, "strategy.name": "distributed_dp", "privacy.epsilon": 1},
     "distributed_dp (60 rounds)"),
)


def headline(rows: list[dict[str, Any]]) -> str:
    """The README's table: C and IBS (mean ± std over seeds) and the largest ε of a few settings."""
    lines = ["| federation | strategy | ε | C | IBS |", "| --- | --- | --- | --- | --- |"]
    for label, match, strategy in HEADLINE:
        members = [row for row in rows if _default_run(row, match)
                   and (match.get("federation.partition") or row["config"].get("federation.partition") is None)]
        epsilons = [row["epsilon"] for row in members if row.get("epsilon") is not None]
        lines.append(f"| {label} | {strategy} | {f'{max(epsilons):.3f}' if epsilons else '–'} | "
                     f"{_mean_std([row['test']['c_index'] for row in members])} | "
                     f"{_mean_std([row['test']['ibs'] for row in members])} |")
    return "\n".join(lines)


def plot_against_epsilon(rows: list[dict[str, Any]], path: Path) -> None:
    """Test C and IBS of dp_sgd against ε (mean ± std over seeds), no-DP FedAvg as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = (("FLCHAIN, 5 sites", {"data.name": "flchain"}), ("SBA, 4 regions", SBA_REGIONS))
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for (label, match), colour in zip(sets, ("tab:blue", "tab:orange")):
        chosen = [row for row in rows if _default_run(row, match) and row["config"].get("federation.num_sites") is None]
        for axis, metric in zip(axes, ("c_index", "ibs")):
            points = sorted({row["config"]["privacy.epsilon"] for row in chosen
                             if row["config"]["strategy.name"] == "dp_sgd"})
            values = [[row["test"][metric] for row in chosen if row["config"]["strategy.name"] == "dp_sgd"
                       and row["config"]["privacy.epsilon"] == eps] for eps in points]
            means, stds = zip(*(_moments(v) for v in values))
            axis.errorbar(points, means, yerr=stds, marker="o", color=colour, capsize=3, label=f"{label}: dp_sgd")
            plain = [row["test"][metric] for row in chosen if row["config"]["strategy.name"] == "fedavg"]
            axis.axhline(_moments(plain)[0], color=colour, linestyle="--", label=f"{label}: fedavg, no DP")
    for axis, name in zip(axes, ("test C-index", "test IBS")):
        axis.set_xscale("log")
        axis.set_xlabel("ε (record level, δ = 1e-5)")
        axis.set_ylabel(name)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="run a plan")
    runner.add_argument("plan", choices=sorted(PLANS))
    runner.add_argument("--out", type=Path, required=True)
    runner.add_argument("--strategies", default="", help="run only these strategies (comma-separated)")
    tables = sub.add_parser("table", help="Markdown table of saved rows")
    tables.add_argument("rows", type=Path, nargs="+")
    fields = sub.add_parser("field-table", help="Markdown table of the field plan's rows")
    fields.add_argument("rows", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        chosen = set(filter(None, args.strategies.split(",")))
        run([config for config in PLANS[args.plan] if not chosen or config["strategy.name"] in chosen], args.out)
        return
    rows = [json.loads(line) for path in args.rows for line in path.read_text().splitlines() if line]
    print(field_table(rows) if args.command == "field-table" else table(rows))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
