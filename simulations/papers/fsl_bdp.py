"""FSL-BDP comparison tables and figure from saved sweeps: ``python -m simulations.papers.fsl_bdp``.

Reads one or more sweep directories of ``simulations.sweep`` holding runs of ``fedavg``,
``dp_sgd`` and ``bdp`` (with their centralised baselines, ``baseline.centralized=true``) and
writes, in the shape of FSL-BDP's Table 3 and Figure 10:

* ``table3.md`` / ``table3.csv``: per target ε, centralised and federated training under no DP,
  classical DP and Bayesian DP; test and out-of-time C-index and IBS as mean ± std over seeds,
  with the achieved ε (largest over seeds; for BDP ε_μ and the classical ε of the same mechanism
  side by side);
* ``site_wins.csv``: per target ε and site, the site's own test (and out-of-time) C-index of
  the federated ``dp_sgd`` and ``bdp`` global models, mean over seeds, and which is higher;
* ``site_wins.md``: win counts of BDP over classical DP per ε and overall, with a one-sided
  binomial test (H1: BDP wins more than half of the sites), and the federation effect
  (federated − centralised test C-index) per mechanism;
* ``fig10.png``: (a) test C-index per scenario and ε, (b) federation effect per mechanism,
  (c) per-site BDP − DP C-index differences, (d) BDP win rate per ε.

Usage::

    python -m simulations.papers.fsl_bdp SWEEP_DIR [SWEEP_DIR ...] --out DIR [--title TEXT]
    python -m simulations.papers.fsl_bdp --report-only --out DIR [--title TEXT]   # from DIR's saved CSVs

References
----------
FSL-BDP (Amed, Sen & Banerjee, arXiv:2601.11134, 2026), Table 3 and Figure 10.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure
from scipy.stats import binomtest

from simulations import sweep

#: (table label, strategy in the sweep results) in the paper's row order.
SCENARIOS: tuple[tuple[str, str], ...] = (
    ("Centralized (No DP)", "centralized"),
    ("Centralized (Classical DP)", "centralized_dp_sgd"),
    ("Centralized (BDP)", "centralized_bdp"),
    ("Federated (No DP)", "fedavg"),
    ("Federated (Classical DP)", "dp_sgd"),
    ("Federated (BDP)", "bdp"),
)
METRICS: tuple[tuple[str, str], ...] = (
    ("Test CI", "test_c_index"), ("Test IBS", "test_ibs"), ("OOT CI", "oot_c_index"), ("OOT IBS", "oot_ibs"),
)


def load_results(sweep_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Successful runs (and their centralised baselines) of every sweep directory, one frame."""
    frames = [sweep.gather(Path(directory)) for directory in sweep_dirs]
    results = pd.concat(frames, ignore_index=True)
    results = results[results["status"] == "ok"].copy()
    central = results["strategy"] == sweep.CENTRALIZED
    duplicated = results[central].duplicated(subset=[*sweep.SETTING_COLUMNS, "seed"], keep="first")
    return results.drop(index=duplicated[duplicated].index).reset_index(drop=True)


def _mean_std(values: pd.Series) -> str:
    values = values.dropna()
    if values.empty:
        return "–"
    if len(values) == 1:
        return f"{values.iloc[0]:.3f}"
    return f"{values.mean():.3f} ± {values.std(ddof=1):.3f}"


def _runs(results: pd.DataFrame, strategy: str, target: float) -> pd.DataFrame:
    """The runs of ``strategy`` at target ε ``target``; a non-DP strategy's runs (target ∞) for any."""
    private = strategy not in ("centralized", "fedavg")
    at_target = (results["epsilon_target"] == target) if private else ~np.isfinite(results["epsilon_target"])
    return results[(results["strategy"] == strategy) & at_target]


def table3(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (target ε, scenario): the metrics as mean ± std over seeds and the achieved ε.

    No-DP rows (target ε = ∞) are repeated under every finite ε so that each block reads alone.
    """
    targets = sorted(e for e in results["epsilon_target"].unique() if math.isfinite(e))
    rows = []
    for target in targets:
        for label, strategy in SCENARIOS:
            private = strategy not in ("centralized", "fedavg")
            runs = _runs(results, strategy, target)
            row: dict[str, object] = {"epsilon_target": target, "scenario": label, "seeds": len(runs)}
            for name, column in METRICS:
                row[name] = _mean_std(runs[column]) if column in runs else "–"
            epsilon = runs["epsilon"].max() if private and len(runs) else math.nan
            classical = runs["epsilon_classical"].max() if "bdp" in strategy and len(runs) else math.nan
            row["epsilon (max over seeds)"] = "–" if math.isnan(epsilon) else f"{epsilon:.3f}"
            row["classical epsilon of BDP"] = "–" if math.isnan(classical) else f"{classical:.3f}"
            rows.append(row)
    return pd.DataFrame(rows)


def _site_metrics(output_dir: str) -> dict[str, dict[str, float]]:
    summary = json.loads((Path(output_dir) / sweep.SUMMARY_FILE).read_text(encoding="utf-8"))
    return summary.get("sites") or {}


def site_comparison(results: pd.DataFrame, metric: str = "c_index") -> pd.DataFrame:
    """Per target ε and site: the federated ``dp_sgd`` and ``bdp`` models' own-site metric.

    Each site's figure is its federated evaluation (the global model on the site's own test
    part, ``summary.json`` ``sites``), averaged over the seeds; ``oot_<metric>`` likewise for
    the out-of-time part. A site whose figure is undefined (no comparable pair) is left out.
    """
    records = []
    for strategy in ("dp_sgd", "bdp"):
        for _, run in results[results["strategy"] == strategy].iterrows():
            for site, metrics in _site_metrics(run["output_dir"]).items():
                records.append({"epsilon_target": run["epsilon_target"], "site": site, "strategy": strategy,
                                "seed": run["seed"], metric: metrics.get(metric, math.nan),
                                f"oot_{metric}": metrics.get(f"oot_{metric}", math.nan)})
    if not records:
        return pd.DataFrame(columns=["epsilon_target", "site"])
    frame = pd.DataFrame(records)
    mean = frame.groupby(["epsilon_target", "site", "strategy"])[[metric, f"oot_{metric}"]].mean().unstack("strategy")
    out = pd.DataFrame({
        "dp_sgd": mean[(metric, "dp_sgd")], "bdp": mean[(metric, "bdp")],
        "oot_dp_sgd": mean[(f"oot_{metric}", "dp_sgd")], "oot_bdp": mean[(f"oot_{metric}", "bdp")],
    }).reset_index()
    out["difference"] = out["bdp"] - out["dp_sgd"]
    out["bdp_wins"] = out["difference"] > 0
    out["oot_difference"] = out["oot_bdp"] - out["oot_dp_sgd"]
    out["oot_bdp_wins"] = out["oot_difference"] > 0
    return out


def win_counts(sites: pd.DataFrame) -> pd.DataFrame:
    """BDP wins over classical DP per target ε and overall (test and out-of-time), with a
    one-sided binomial test of H1: P(BDP wins) > 1/2 (ties and undefined sites left out)."""
    rows = []
    groups = [(f"{target:g}", part) for target, part in sites.groupby("epsilon_target")] + [("all", sites)]
    for label, part in groups:
        row: dict[str, object] = {"epsilon_target": label}
        for prefix in ("", "oot_"):
            difference = part[f"{prefix}difference"].dropna()
            difference = difference[difference != 0]
            wins, total = int((difference > 0).sum()), len(difference)
            row[f"{prefix}bdp_wins"] = f"{wins}/{total}"
            row[f"{prefix}p_value"] = binomtest(wins, total, 0.5, alternative="greater").pvalue if total else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def federation_effect(results: pd.DataFrame) -> pd.DataFrame:
    """Federated − centralised test C-index (mean over seeds) per mechanism and target ε."""
    rows = []
    pairs = {"No DP": ("fedavg", "centralized"), "Classical DP": ("dp_sgd", "centralized_dp_sgd"),
             "BDP": ("bdp", "centralized_bdp")}
    targets = sorted(e for e in results["epsilon_target"].unique() if math.isfinite(e))
    for target in targets:
        for mechanism, (federated, centralised) in pairs.items():
            fed, cen = (float(_runs(results, name, target)["test_c_index"].mean()) for name in (federated, centralised))
            rows.append({"epsilon_target": target, "mechanism": mechanism, "federated": fed, "centralized": cen,
                         "effect": fed - cen, "relative_effect": (fed - cen) / cen if cen else math.nan})
    return pd.DataFrame(rows)


def plot_fig10(table: pd.DataFrame, results: pd.DataFrame, sites: pd.DataFrame, wins: pd.DataFrame,
               effect: pd.DataFrame, path: Path, title: str) -> None:
    """Four panels in the spirit of FSL-BDP's Figure 10."""
    fig = Figure(figsize=(13, 9))
    (ax_a, ax_b), (ax_c, ax_d) = fig.subplots(2, 2)
    targets = sorted(e for e in results["epsilon_target"].unique() if math.isfinite(e))
    width = 0.8 / len(SCENARIOS)
    colours = {"No DP": "tab:blue", "Classical DP": "tab:orange", "BDP": "tab:green"}
    for k, (label, strategy) in enumerate(SCENARIOS):
        means, stds = [], []
        for target in targets:
            runs = _runs(results, strategy, target)
            means.append(runs["test_c_index"].mean() if len(runs) else math.nan)
            stds.append(runs["test_c_index"].std(ddof=1) if len(runs) > 1 else 0.0)
        positions = np.arange(len(targets)) + (k - (len(SCENARIOS) - 1) / 2) * width
        centralised = label.startswith("Centralized")
        ax_a.bar(positions, means, width, yerr=stds, label=label, capsize=2,
                 color=colours[label.split("(")[1].rstrip(")")], hatch="//" if centralised else None,
                 alpha=0.45 if centralised else 0.9, edgecolor="black", linewidth=0.5)
    ax_a.set_xticks(np.arange(len(targets)), [f"ε = {t:g}" for t in targets])
    ax_a.set_ylabel("test C-index (mean ± std over seeds)")
    ax_a.set_ylim(0.4, 1.0)
    ax_a.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax_a.set_title("(a) centralised vs federated, by mechanism")
    ax_a.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.07))
    for mechanism, part in effect.groupby("mechanism", sort=False):
        ax_b.plot(part["epsilon_target"], part["effect"], marker="o", label=mechanism)
    ax_b.axhline(0.0, color="grey", linewidth=0.8)
    ax_b.set_xscale("log")
    ax_b.set_xticks(targets, [f"{t:g}" for t in targets])
    ax_b.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax_b.set_xlabel("target ε")
    ax_b.set_ylabel("federated − centralised test C-index")
    ax_b.set_title("(b) federation effect")
    ax_b.legend(fontsize=8)
    for k, target in enumerate(targets):
        part = sites[sites["epsilon_target"] == target]
        jitter = np.linspace(-0.25, 0.25, max(len(part), 1))[: len(part)]
        ax_c.scatter(k + jitter, part["difference"], s=12,
                     c=np.where(part["difference"] > 0, "tab:green", "tab:red"))
    ax_c.axhline(0.0, color="grey", linewidth=0.8)
    ax_c.set_xticks(np.arange(len(targets)), [f"ε = {t:g}" for t in targets])
    ax_c.set_ylabel("site test C-index: BDP − classical DP")
    ax_c.set_title("(c) per-site differences (federated, mean over seeds)")
    per_eps = wins[wins["epsilon_target"] != "all"]
    rates = [int(w.split("/")[0]) / max(int(w.split("/")[1]), 1) for w in per_eps["bdp_wins"]]
    ax_d.bar(per_eps["epsilon_target"], rates, color="tab:blue", alpha=0.8)
    for x, (rate, label) in enumerate(zip(rates, per_eps["bdp_wins"])):
        ax_d.text(x, rate + 0.01, label, ha="center", fontsize=8)
    ax_d.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax_d.set_ylim(0, 1)
    ax_d.set_xlabel("target ε")
    ax_d.set_ylabel("share of sites where BDP beats classical DP")
    ax_d.set_title("(d) site-level win rate (test C-index)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def _markdown(frame: pd.DataFrame, floatfmt: str = ".3f") -> str:
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    lines = [header, "| " + " | ".join("---" for _ in frame.columns) + " |"]
    for _, row in frame.iterrows():
        cells = [format(v, floatfmt) if isinstance(v, float) and not math.isnan(v) else str(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(sweep_dirs: Sequence[str | Path], out: str | Path, title: str = "FSL-BDP comparison") -> dict[str, Path]:
    """Write every table and the figure to ``out`` from the sweeps' runs; return the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(sweep_dirs)
    sites = site_comparison(results)
    results.to_csv(out / "results.csv", index=False)
    sites.to_csv(out / "site_wins.csv", index=False)
    return _write(results, sites, out, title)


def write_saved(out: str | Path, title: str = "FSL-BDP comparison") -> dict[str, Path]:
    """Rewrite the tables and the figure of ``out`` from its saved ``results.csv`` and ``site_wins.csv``.

    The run directories of the sweeps are not needed: ``results.csv`` keeps every run's metrics
    and ε, ``site_wins.csv`` the per-site figures.
    """
    out = Path(out)
    results = pd.read_csv(out / "results.csv", float_precision="round_trip")
    sites = pd.read_csv(out / "site_wins.csv", float_precision="round_trip")
    return _write(results, sites, out, title)


def _write(results: pd.DataFrame, sites: pd.DataFrame, out: Path, title: str) -> dict[str, Path]:
    """The tables and the figure from the runs (``results.csv``) and the per-site figures (``site_wins.csv``)."""
    table = table3(results)
    wins = win_counts(sites) if len(sites) else pd.DataFrame()
    effect = federation_effect(results)
    files = {"results": out / "results.csv", "table3_csv": out / "table3.csv", "table3": out / "table3.md",
             "site_wins_csv": out / "site_wins.csv", "site_wins": out / "site_wins.md", "figure": out / "fig10.png"}
    table.to_csv(files["table3_csv"], index=False)
    blocks = [f"# {title}\n"]
    for target, part in table.groupby("epsilon_target", sort=True):
        blocks.append(f"## target ε = {target:g}\n\n{_markdown(part.drop(columns='epsilon_target'))}\n")
    files["table3"].write_text("\n".join(blocks), encoding="utf-8")
    files["site_wins"].write_text(
        f"# {title}: BDP vs classical DP per site\n\n{_markdown(wins, '.4f')}\n\n"
        f"## Federation effect (federated − centralised test C-index)\n\n{_markdown(effect, '.4f')}\n",
        encoding="utf-8")
    if len(sites):
        plot_fig10(table, results, sites, wins, effect, files["figure"], title)
    return files


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="*", help="sweep directories (simulations.sweep outputs)")
    parser.add_argument("--out", required=True, help="directory for the tables and the figure")
    parser.add_argument("--title", default="FSL-BDP comparison")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the tables and the figure from OUT's results.csv and site_wins.csv")
    args = parser.parse_args(argv)
    if args.report_only == bool(args.sweep_dirs):
        parser.error("give sweep directories, or --report-only without them")
    for directory in args.sweep_dirs:
        if not Path(directory).is_dir():
            parser.error(f"{directory} is not a directory")
    files = (write_saved(args.out, args.title) if args.report_only
             else write(args.sweep_dirs, args.out, args.title))
    print((Path(args.out) / "table3.md").read_text(encoding="utf-8"))
    print((Path(args.out) / "site_wins.md").read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(path) for path in files.values() if path.exists()))


if __name__ == "__main__":
    main()
