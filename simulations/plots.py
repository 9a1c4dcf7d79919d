"""Privacy-utility figures of a sweep (``simulations.sweep``), drawn from its summary table.

Figures are built with ``matplotlib.figure.Figure`` (Agg canvas), without pyplot or a GUI backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.figure import Figure

SETTING_COLUMNS = ["variant", "data", "model", "rounds", "num_sites"]
METRIC_LABELS = {
    "test_c_index": "test C-index (higher is better)",
    "test_c_index_td": "test time-dependent C-index",
    "test_ibs": "test integrated Brier score (lower is better)",
    "test_inbll": "test integrated NBLL (lower is better)",
}
REFERENCE_STYLE = {
    "centralized": {"color": "black", "linestyle": "--"},
    "fedavg": {"color": "tab:gray", "linestyle": ":"},
}


#: Smallest span of a panel's y axis: differences below it are noise, not a trade-off to zoom into
#: (a C-index axis from 0.800 to 0.810 makes 0.005 look like a collapse).
MIN_SPAN = {"test_c_index": 0.05, "test_c_index_td": 0.05, "test_ibs": 0.02, "test_inbll": 0.05}


def _draw_dp_lines(ax: Axes, dp: pd.DataFrame, metric: str) -> None:
    """One line with error bars (+-1 std over seeds; none for one seed) per DP strategy against target epsilon."""
    for strategy, rows in dp.groupby("strategy", sort=True):
        rows = rows.sort_values("epsilon_target")
        eps = rows["epsilon_target"].to_numpy(float)
        mean = rows[f"{metric}_mean"].to_numpy(float)
        std = np.nan_to_num(rows[f"{metric}_std"].to_numpy(float), nan=0.0)
        ax.errorbar(eps, mean, yerr=std if np.any(std > 0) else None, marker="o", capsize=3, label=str(strategy))


def _widen(ax: Axes, span: float) -> None:
    """At least ``span`` of y axis around what is drawn (error bars included)."""
    low, high = ax.get_ylim()
    if high - low < span:
        centre = (low + high) / 2
        ax.set_ylim(centre - span / 2, centre + span / 2)


def _draw_references(ax: Axes, reference: pd.DataFrame, metric: str) -> None:
    """Horizontal lines (with +-1 std bands) for runs without DP: non-DP strategies, centralised."""
    for index, (_, row) in enumerate(reference.sort_values("strategy").iterrows()):
        mean, std = row[f"{metric}_mean"], row[f"{metric}_std"]
        if pd.isna(mean):
            continue
        style = REFERENCE_STYLE.get(row["strategy"], {"color": f"C{(index + 5) % 10}", "linestyle": "-."})
        label = f"{row['strategy']} (no DP)" if row["strategy"] != "centralized" else "centralised (no DP)"
        ax.axhline(mean, label=label, linewidth=1.2, **style)
        if not pd.isna(std) and std > 0:
            ax.axhspan(mean - std, mean + std, color=style["color"], alpha=0.1, linewidth=0)


def _figure(setting: pd.DataFrame, metrics: Sequence[str], title: str) -> Figure:
    finite = setting["epsilon_target"].map(lambda e: not pd.isna(e) and math.isfinite(e))
    dp, reference = setting[finite], setting[~finite & setting["epsilon_target"].notna()]
    fig = Figure(figsize=(5.2 * len(metrics), 4.0))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        if f"{metric}_mean" not in setting:
            ax.set_visible(False)
            continue
        _draw_dp_lines(ax, dp, metric)
        _draw_references(ax, reference, metric)
        _widen(ax, MIN_SPAN.get(metric, 0.0))
        ax.set_xscale("log")
        if dp.empty:
            ax.set_xlim(0.1, 100)
        else:
            ax.set_xticks(sorted(dp["epsilon_target"].unique()))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("target ε (log scale)")
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _seeds(setting: pd.DataFrame) -> str:
    """The seeds behind the figure's points, as many as there are: 5 seeds, 2-5 seeds, or 1 seed."""
    runs = sorted({int(n) for n in setting["n_runs"].dropna()}) if "n_runs" in setting else []
    if not runs:
        return "seeds not recorded"
    if runs == [1]:
        return "1 seed (no error bars)"
    counts = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}–{runs[-1]}"
    return f"mean ± std over {counts} seeds" + (" per point" if len(runs) > 1 else "")


def _title(setting: pd.DataFrame) -> str:
    first = setting.iloc[0]
    parts = [f"{first['data']}", f"{first['model']}", f"{first['num_sites']} sites", f"{first['rounds']} rounds"]
    if str(first.get("variant", "")):
        parts.append(str(first["variant"]))
    return "privacy-utility: " + ", ".join(parts) + f" ({_seeds(setting)})"


def plot_privacy_utility(
    summary: pd.DataFrame, path: str | Path, metrics: Sequence[str] = ("test_c_index", "test_ibs")
) -> list[Path]:
    """Draw test metrics against epsilon for every setting of a sweep's summary table.

    Parameters
    ----------
    summary
        Output of :func:`simulations.sweep.summarize` (columns ``strategy``, ``epsilon_target``,
        ``<metric>_mean``, ``<metric>_std`` and the setting columns).
    path
        Figure file; with several settings (e.g. a sweep over ``model``) the k-th setting after the
        first goes to ``<stem>_<k><suffix>``.
    metrics
        One panel per metric.

    Returns
    -------
    list of Path
        The files written.
    """
    path = Path(path)
    columns = [c for c in SETTING_COLUMNS if c in summary]
    ok = summary[summary.get("n_runs", pd.Series(1, index=summary.index)) > 0]
    written = []
    for index, (_, setting) in enumerate(ok.groupby(columns, dropna=False, sort=True) if columns else [(None, ok)]):
        target = path if index == 0 else path.with_name(f"{path.stem}_{index}{path.suffix}")
        fig = _figure(setting, metrics, _title(setting))
        fig.savefig(target, dpi=120)
        written.append(target)
    return written
