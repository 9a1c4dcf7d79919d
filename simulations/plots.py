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


def _band(mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    std = np.nan_to_num(std, nan=0.0)
    return mean - std, mean + std


def _draw_dp_lines(ax: Axes, dp: pd.DataFrame, metric: str) -> None:
    """One line (with a +-1 std band over seeds) per DP strategy against target epsilon."""
    for strategy, rows in dp.groupby("strategy", sort=True):
        rows = rows.sort_values("epsilon_target")
        eps = rows["epsilon_target"].to_numpy(float)
        mean = rows[f"{metric}_mean"].to_numpy(float)
        line = ax.plot(eps, mean, marker="o", label=str(strategy))[0]
        low, high = _band(mean, rows[f"{metric}_std"].to_numpy(float))
        ax.fill_between(eps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)


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


def _title(setting: pd.DataFrame) -> str:
    first = setting.iloc[0]
    parts = [f"{first['data']}", f"{first['model']}", f"{first['num_sites']} sites", f"{first['rounds']} rounds"]
    if str(first.get("variant", "")):
        parts.append(str(first["variant"]))
    seeds = int(setting["n_runs"].max()) if "n_runs" in setting else 0
    return "privacy-utility: " + ", ".join(parts) + f" (mean ± std over up to {seeds} seed(s))"


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
