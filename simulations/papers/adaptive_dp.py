"""Reproduce the adaptive-DP Cox-MLP paper (Niu et al. 2025): NbAFL, LS-ADP, ROW-DP vs no DP.

Runs every (method, ε, repetition) of a grid with :func:`simulations.engine.run_inprocess` (the
ServerApp and ClientApp over the in-process grid), appends one row per run to
``OUT/results.csv`` as soon as it finishes (a rerun skips the rows already there), and writes
``OUT/table.md`` (mean ± std per method and ε, the paper's figure beside ours, nominal and
audited ε) and ``OUT/figure.png``.

Usage::

    python -m simulations.papers.adaptive_dp --out DIR --epsilons 0.6,0.7,0.8,0.9,1.0 --reps 10 \\
        [--jobs 2] [--metrics inbll,ibs] [--methods ...] key=value ...

``key=value`` are run-config overrides shared by every run (e.g. ``data.name=sim_cox``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np

from flwr_app import interrupt
from simulations.hydra_config import parse_value
from simulations.results_file import append_runs, read_rows

#: Method label -> run-config overrides.
METHODS: dict[str, dict[str, Any]] = {
    "no DP": {"strategy.name": "fedavg"},
    "NbAFL": {"strategy.name": "nbafl"},
    **{f"ROW-DP({name})": {"strategy.name": "row_dp", "privacy.dispersion": name.lower()}
       for name in ("Std", "Var", "Range", "MAE", "IQR")},
    "LS-ADP": {"strategy.name": "ls_adp"},
    "NbAFL exact": {"strategy.name": "nbafl", "privacy.allocation": "exact"},
    "LS-ADP exact": {"strategy.name": "ls_adp", "privacy.allocation": "exact"},
    "ROW-DP(Var) exact": {"strategy.name": "row_dp", "privacy.dispersion": "var", "privacy.allocation": "exact"},
    # The paper's rule with every weight guaranteed half the mean budget (uniform_mix 0.5).
    "ROW-DP(Var) mix 0.5": {"strategy.name": "row_dp", "privacy.dispersion": "var", "privacy.uniform_mix": 0.5},
}

SIMULATION_EPSILONS = (0.6, 0.7, 0.8, 0.9, 1.0)
FLCHAIN_EPSILONS = (3.0, 4.0, 5.0, 7.0)


def _by_epsilon(epsilons: tuple[float, ...], rows: dict[str, tuple[float, ...]]) -> dict[str, dict[float, float]]:
    return {method: dict(zip(epsilons, values, strict=True)) for method, values in rows.items()}


#: The paper's Tables 2–4 (means over 100 repetitions), by metric, method and ε.
PAPER: dict[str, dict[str, dict[float, float]]] = {
    "inbll": _by_epsilon(SIMULATION_EPSILONS, {
        "NbAFL": (0.2753, 0.2613, 0.2581, 0.2446, 0.2359),
        "ROW-DP(Std)": (0.2726, 0.2553, 0.2541, 0.2498, 0.2476),
        "ROW-DP(Var)": (0.2681, 0.2596, 0.2572, 0.2530, 0.2456),
        "ROW-DP(Range)": (0.2686, 0.2594, 0.2567, 0.2464, 0.2455),
        "ROW-DP(MAE)": (0.2692, 0.2683, 0.2593, 0.2515, 0.2450),
        "ROW-DP(IQR)": (0.2690, 0.2600, 0.2554, 0.2528, 0.2365),
        "LS-ADP": (0.2560, 0.2551, 0.2550, 0.2464, 0.2455),
        "no DP": (0.2309,) * 5,
    }),
    "ibs": _by_epsilon(SIMULATION_EPSILONS, {
        "NbAFL": (0.0592, 0.0572, 0.0549, 0.0548, 0.0542),
        "ROW-DP(Std)": (0.0577, 0.0560, 0.0553, 0.0543, 0.0545),
        "ROW-DP(Var)": (0.0569, 0.0562, 0.0555, 0.0552, 0.0546),
        "ROW-DP(Range)": (0.0576, 0.0567, 0.0553, 0.0548, 0.0547),
        "ROW-DP(MAE)": (0.0561, 0.0558, 0.0553, 0.0548, 0.0543),
        "ROW-DP(IQR)": (0.0569, 0.0569, 0.0545, 0.0545, 0.0544),
        "LS-ADP": (0.0551, 0.0547, 0.0542, 0.0543, 0.0543),
        "no DP": (0.0540,) * 5,
    }),
    "c_index": _by_epsilon(FLCHAIN_EPSILONS, {
        "NbAFL": (0.7361, 0.7560, 0.7656, 0.7676),
        "ROW-DP(Std)": (0.7301, 0.7484, 0.7538, 0.7550),
        "ROW-DP(Var)": (0.7292, 0.7438, 0.7433, 0.7573),
        "ROW-DP(Range)": (0.7251, 0.7522, 0.7530, 0.7568),
        "ROW-DP(MAE)": (0.7231, 0.7485, 0.7515, 0.7599),
        "ROW-DP(IQR)": (0.7248, 0.7515, 0.7585, 0.7593),
        "LS-ADP": (0.7627, 0.7653, 0.7678, 0.7701),
        "no DP": (0.7701,) * 4,
    }),
}

FIELDS = ("method", "epsilon_target", "seed", "c_index", "ibs", "inbll", "epsilon_rdp",
          "epsilon_audited_formula", "epsilon_nominal", "noise_multiplier", "wall_s", "error")
LOWER_IS_BETTER = {"ibs", "inbll"}


def _run(job: tuple[str, float, int, dict[str, Any]]) -> dict[str, Any]:
    """One federation; the row of results.csv (the worst site's ledger figures; NaN metrics if the model diverged)."""
    from simulations.engine import run_inprocess, strategy_overrides
    from strategies.accounting.ledger import PrivacyLedger

    method, epsilon, seed, shared = job
    warnings.simplefilter("ignore", RuntimeWarning)  # overflow in a diverged model: reported as such
    started = time.perf_counter()
    if method == "no DP":  # no mechanism: the shared privacy keys would be refused as having no effect
        shared, _ = strategy_overrides(METHODS[method]["strategy.name"], shared)
    with TemporaryDirectory() as out:
        overrides = {**shared, **METHODS[method], "seed": seed, "baseline.centralized": False, "output.dir": out,
                     "privacy.epsilon": "inf" if method == "no DP" else epsilon}
        summary = run_inprocess(overrides)
        worst = PrivacyLedger.read(Path(out) / "ledger.jsonl").worst()
        error = _why_missing(summary, Path(out) / "metrics.jsonl")

    def number(value: float | None) -> float:  # summary.json and the ledger write NaN and no ε as null
        return math.nan if value is None else float(value)

    return {
        "method": method, "epsilon_target": epsilon, "seed": seed,
        **{key: number(summary["test"].get(key)) for key in ("c_index", "ibs", "inbll")},
        **{column: number(getattr(worst, key, None)) for column, key in (
            ("epsilon_rdp", "epsilon"), ("epsilon_audited_formula", "epsilon_audited_formula"),
            ("epsilon_nominal", "epsilon_nominal"), ("noise_multiplier", "noise_multiplier"))},
        "wall_s": time.perf_counter() - started,
        "error": error,
    }


def _why_missing(summary: dict[str, Any], metrics_path: Path) -> str:
    """Why the run's test metrics are missing ("" if none is): the ServerApp's own reason for a diverged
    global model, else the last round's failures (e.g. every site's Breslow aggregates refused as not finite)."""
    if summary.get("diverged"):
        return summary["diverged"]
    missing = [key for key in ("c_index", "ibs", "inbll") if summary["test"].get(key) is None]
    if not missing:
        return ""
    last = json.loads(metrics_path.read_text(encoding="utf-8").splitlines()[-1])
    reasons = sorted({f"{failure['phase']}: {' '.join(failure['reason'].split())}" for failure in last.get("failures", [])})
    return f"no {', '.join(missing)}" + (f"; last round's failures: {'; '.join(reasons)}" if reasons else "")


def _read(path: Path) -> list[dict[str, Any]]:
    return read_rows(path, text_fields=("method", "error"))


def run_grid(out: Path, methods: list[str], epsilons: list[float], reps: int, shared: dict[str, Any],
             jobs: int) -> list[dict[str, Any]]:
    """Run the grid's missing runs (no DP once per seed, at every ε's row) and return all rows."""
    path = out / "results.csv"
    done = {(row["method"], float(row["epsilon_target"]), int(row["seed"])) for row in _read(path)}
    todo = []
    for seed in range(reps):
        for method in methods:
            for epsilon in ([math.inf] if method == "no DP" else epsilons):
                if (method, epsilon, seed) not in done:
                    todo.append((method, epsilon, seed, shared))
    append_runs(path, FIELDS, todo, _run, workers=jobs, describe=lambda row: (
        f"{row['method']} eps={row['epsilon_target']} seed={int(row['seed'])}: C {row['c_index']:.4f} "
        f"IBS {row['ibs']:.4f} INBLL {row['inbll']:.4f} eps_rdp {row['epsilon_rdp']:.3f} ({row['wall_s']:.1f} s)"))
    return _read(path)


def _cell(values: list[float], digits: int = 4) -> str:
    """``mean ± std`` of the finite values, with how many were finite when some were not (diverged)."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return f"diverged ({len(values)}/{len(values)})" if values else "–"
    spread = float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0
    text = f"{float(np.mean(finite)):.{digits}f} ± {spread:.{digits}f}"
    return text if len(finite) == len(values) else f"{text} ({len(values) - len(finite)}/{len(values)} diverged)"


def write_report(out: Path, rows: list[dict[str, Any]], methods: list[str], epsilons: list[float],
                 metrics: list[str]) -> str:
    """``table.md`` (ours beside the paper's, with nominal / audited ε) and ``figure.png``."""
    lines: list[str] = []
    reps = len({int(row["seed"]) for row in rows})
    for metric in metrics:
        paper = PAPER.get(metric, {})
        lines += [f"### {metric} (ours: mean ± std over {reps} repetitions; paper in brackets)", "",
                  "| method | " + " | ".join(f"ε = {eps:g}" for eps in epsilons) + " |",
                  "| --- |" + " --- |" * len(epsilons)]
        for method in methods:
            cells = []
            for eps in epsilons:
                values = [row[metric] for row in rows if row["method"] == method
                          and (method == "no DP" or row["epsilon_target"] == eps)]
                reference = paper.get(method, {}).get(eps)
                cells.append(_cell(values) + (f" [{reference:.4f}]" if reference is not None else ""))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### ε of each run (the worst site; max over repetitions)", "",
              "nominal = the paper's average budget; formula = the paper's own formula at the smallest noise "
              "(composed linearly over rounds); RDP = Gaussian RDP at the smallest noise, composed over rounds, "
              "converted at the run's δ.", "",
              "| method | " + " | ".join(f"ε = {eps:g}: nominal / formula / RDP" for eps in epsilons) + " |",
              "| --- |" + " --- |" * len(epsilons)]
    for method in methods:
        if method == "no DP":
            continue
        cells = []
        for eps in epsilons:
            chosen = [row for row in rows if row["method"] == method and row["epsilon_target"] == eps]
            if not chosen:
                cells.append("–")
                continue
            cells.append(" / ".join(f"{max(row[key] for row in chosen):.3g}"
                                    for key in ("epsilon_nominal", "epsilon_audited_formula", "epsilon_rdp")))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    _figure(out / "figure.png", rows, methods, epsilons, metrics)
    return text


def _figure(path: Path, rows: list[dict[str, Any]], methods: list[str], epsilons: list[float],
            metrics: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics) + 2.5, 4), squeeze=False)
    colours = plt.get_cmap("tab20").colors
    for ax, metric in zip(axes[0], metrics, strict=True):
        for index, method in enumerate(methods):
            means, stds = [], []
            for eps in epsilons:
                values = [row[metric] for row in rows if row["method"] == method
                          and (method == "no DP" or row["epsilon_target"] == eps)]
                finite = [value for value in values if math.isfinite(value)]
                means.append(np.mean(finite) if finite else np.nan)
                stds.append(np.std(finite) if finite else np.nan)
            style = "--" if method == "no DP" else ("-." if "exact" in method else "-")
            ax.errorbar(epsilons, means, yerr=stds, label=method, linestyle=style, marker="o", capsize=2,
                        color=colours[(2 * index) % 20 + (2 * index // 20) % 2])
        ax.set_xlabel("target ε (the paper's average budget)")
        ax.set_ylabel(metric)
        if metric in LOWER_IS_BETTER:
            ax.set_yscale("log")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0.0, 0.0, 1.0 - 2.3 / fig.get_figwidth(), 1.0))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epsilons", default="0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--metrics", default="inbll,ibs,c_index")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--report-only", action="store_true", help="rewrite table.md/figure.png from results.csv")
    parser.add_argument("overrides", nargs="*", help="run-config key=value shared by every run")
    args = parser.parse_args(argv)
    shared = {key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}
    methods = [method.strip() for method in args.methods.split(",")]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    epsilons = [float(value) for value in args.epsilons.split(",")]
    rows = (_read(args.out / "results.csv") if args.report_only
            else run_grid(args.out, methods, epsilons, args.reps, shared, args.jobs))
    print(write_report(args.out, rows, methods, epsilons, [m.strip() for m in args.metrics.split(",")]))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
