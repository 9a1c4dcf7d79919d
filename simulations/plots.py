"""Figures of a sweep (``simulations.sweep``), drawn from its summary table.

* :func:`plot_privacy_utility`: test metrics against the target ε, one figure per setting whose
  DP rows span at least two targets (a sweep at one ε has no privacy-utility trade-off to show).
* :func:`plot_by_setting`: test metrics per setting (e.g. each ``train.lr`` of a learning-rate
  sweep), for a sweep over settings at one ε.

Figures are built with ``matplotlib.figure.Figure`` (Agg canvas), without pyplot or a GUI backend:
a figure written to its file stays open nowhere. The drawing functions take ``fig`` (default a new
figure) and return it.
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

from models.plots import natural_key
from simulations.sweep_table import CENTRALIZED, SETTING_COLUMNS

METRIC_LABELS = {
    "test_c_index": "test C-index (higher is better)",
    "test_c_index_td": "test time-dependent C-index",
    "test_ibs": "test integrated Brier score (lower is better)",
    "test_inbll": "test integrated NBLL (lower is better)",
}
REFERENCE_STYLE = {
    CENTRALIZED: {"color": "black", "linestyle": "--"},
    "fedavg": {"color": "tab:gray", "linestyle": ":"},
}
#: How a figure names the centralised baselines: trained again on the federation's records pooled at one place.
CENTRALIZED_NOTE = "pooled reference, not private"


#: Smallest span of a panel's y axis: differences below it are noise, not a trade-off to zoom into
#: (a C-index axis from 0.800 to 0.810 makes 0.005 look like a collapse).
MIN_SPAN = {"test_c_index": 0.05, "test_c_index_td": 0.05, "test_ibs": 0.02, "test_inbll": 0.05}


def _finite(epsilon: pd.Series) -> pd.Series:
    return epsilon.map(lambda e: not pd.isna(e) and math.isfinite(e))


def epsilon_varies(setting: pd.DataFrame) -> bool:
    """Whether the federated DP rows of one setting span at least two target ε (centralised baselines not counted)."""
    federated = ~setting["strategy"].astype(str).str.startswith(CENTRALIZED)
    return setting.loc[federated & _finite(setting["epsilon_target"]), "epsilon_target"].nunique() >= 2


def _drawn(setting: pd.DataFrame, metrics: Sequence[str]) -> list[str]:
    """The metrics with at least one value in the setting (one panel each)."""
    return [m for m in metrics if f"{m}_mean" in setting and setting[f"{m}_mean"].notna().any()]


def _draw_dp_lines(ax: Axes, dp: pd.DataFrame, metric: str) -> None:
    """One line with error bars (+-1 std over seeds; none for one seed) per DP strategy against target epsilon.

    A centralised baseline with a DP mechanism (``centralized_dp_sgd``) is a dashed line labelled as
    the non-private pooled reference it is: its ε is the calibration of its noise, not a guarantee.
    """
    for strategy, rows in dp.groupby("strategy", sort=True):
        rows = rows.sort_values("epsilon_target")
        eps = rows["epsilon_target"].to_numpy(float)
        mean = rows[f"{metric}_mean"].to_numpy(float)
        std = np.nan_to_num(rows[f"{metric}_std"].to_numpy(float), nan=0.0)
        central = str(strategy).startswith(CENTRALIZED)
        ax.errorbar(eps, mean, yerr=std if np.any(std > 0) else None, marker="o", capsize=3,
                    linestyle="--" if central else "-",
                    label=f"{strategy} (noise for the target ε; {CENTRALIZED_NOTE})" if central else str(strategy))


def _widen(ax: Axes, span: float) -> None:
    """At least ``span`` of y axis around what is drawn (error bars included)."""
    low, high = ax.get_ylim()
    if high - low < span:
        centre = (low + high) / 2
        ax.set_ylim(centre - span / 2, centre + span / 2)


def _draw_references(ax: Axes, reference: pd.DataFrame, metric: str) -> None:
    """Horizontal lines (with +-1 std bands) for runs without DP: non-DP strategies, the centralised reference."""
    for index, (_, row) in enumerate(reference.sort_values("strategy").iterrows()):
        mean, std = row[f"{metric}_mean"], row[f"{metric}_std"]
        if pd.isna(mean):
            continue
        style = REFERENCE_STYLE.get(row["strategy"], {"color": f"C{(index + 5) % 10}", "linestyle": "-."})
        label = f"{row['strategy']} (no DP)" if row["strategy"] != CENTRALIZED else f"centralised ({CENTRALIZED_NOTE})"
        ax.axhline(mean, label=label, linewidth=1.2, **style)
        if not pd.isna(std) and std > 0:
            ax.axhspan(mean - std, mean + std, color=style["color"], alpha=0.1, linewidth=0)


def _legend_below(fig: Figure) -> Figure:
    """One legend for every panel, below them (where it hides no point), then the layout."""
    entries: dict[str, object] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * math.ceil(len(entries) / 2), 1, 1))
    return fig


def privacy_utility_figure(setting: pd.DataFrame, metrics: Sequence[str] = ("test_c_index", "test_ibs"), *,
                           fig: Figure | None = None) -> Figure:
    """One setting's test metrics against the target ε (log axis), one panel per metric with values.

    DP strategies are lines with +-1 std error bars; runs without DP (non-DP strategies, the
    centralised reference) horizontal lines. Drawn on ``fig`` (default a new figure); returns it.

    Raises
    ------
    ValueError
        When no metric has a value (the figure would be empty).
    """
    drawn = _drawn(setting, metrics)
    if not drawn:
        raise ValueError(f"privacy-utility figure: no values of {', '.join(metrics)} in the setting's rows")
    finite = _finite(setting["epsilon_target"])
    dp, reference = setting[finite], setting[~finite & setting["epsilon_target"].notna()]
    if fig is None:
        fig = Figure(figsize=(5.2 * len(drawn), 4.0 + 0.25 * len(set(setting["strategy"]))))
    for ax, metric in zip(fig.subplots(1, len(drawn), squeeze=False)[0], drawn, strict=True):
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
    fig.suptitle(_title(setting), fontsize=10)
    return _legend_below(fig)


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


def _settings(summary: pd.DataFrame) -> list[pd.DataFrame]:
    """The successful rows of each setting (the setting columns but the seed), in natural order."""
    columns = [c for c in SETTING_COLUMNS if c in summary]
    ok = summary[summary.get("n_runs", pd.Series(1, index=summary.index)) > 0]
    if not columns:
        return [ok] if len(ok) else []
    groups = [part for _, part in ok.groupby(columns, dropna=False, sort=False)]
    return sorted(groups, key=lambda part: natural_key(" ".join(str(part.iloc[0][c]) for c in columns)))


def plot_privacy_utility(
    summary: pd.DataFrame, path: str | Path, metrics: Sequence[str] = ("test_c_index", "test_ibs")
) -> list[Path]:
    """Write test metrics against epsilon for every setting of a sweep's summary table where ε varies.

    Parameters
    ----------
    summary
        Output of :func:`simulations.sweep.summarize` (columns ``strategy``, ``epsilon_target``,
        ``<metric>_mean``, ``<metric>_std`` and the setting columns).
    path
        Figure file; with several settings drawn (e.g. a sweep over ``model``) the k-th after the
        first goes to ``<stem>_<k><suffix>``.
    metrics
        One panel per metric that has values.

    Returns
    -------
    list of Path
        The files written: one per setting whose DP rows span two or more target ε
        (:func:`epsilon_varies`) and hold a metric; none for a sweep at one ε.
    """
    path = Path(path)
    drawn = [s for s in _settings(summary) if epsilon_varies(s) and _drawn(s, metrics)]
    written = []
    for index, setting in enumerate(drawn):
        target = path if index == 0 else path.with_name(f"{path.stem}_{index}{path.suffix}")
        privacy_utility_figure(setting, metrics).savefig(target, dpi=120)
        written.append(target)
    return written


def _setting_names(settings: Sequence[pd.DataFrame]) -> tuple[list[str], str]:
    """Each setting's name (the setting columns whose values differ between settings: ``column=value``, the
    variant as it is) and what the settings share (for the title)."""
    columns = [c for c in SETTING_COLUMNS if c in settings[0]]
    firsts = pd.DataFrame([part.iloc[0][columns] for part in settings]).astype(str)
    varying = [c for c in columns if firsts[c].nunique() > 1]
    names = [" ".join(row[c] if c == "variant" else f"{c}={row[c]}" for c in varying) for _, row in firsts.iterrows()]
    shared = ", ".join(firsts.iloc[0][c] if c == "variant" else f"{c} {firsts.iloc[0][c]}"
                       for c in columns if c not in varying and firsts.iloc[0][c])
    return names, shared


def _series_label(strategy: str, epsilon: float) -> str:
    """A series' legend: the strategy and its target ε; a centralised baseline named as the non-private reference."""
    eps = f"ε = {epsilon:g}" if math.isfinite(epsilon) else ""
    if strategy.startswith(CENTRALIZED):
        return f"{strategy} ({'noise for ' + eps + '; ' if eps else ''}{CENTRALIZED_NOTE})"
    return f"{strategy} ({eps})" if eps else strategy


def by_setting_figure(settings: Sequence[pd.DataFrame], metrics: Sequence[str] = ("test_c_index", "test_ibs"), *,
                      fig: Figure | None = None) -> Figure:
    """Test metrics per setting (x: the settings, in the order given), one panel per metric with values.

    One series of points with +-1 std error bars per strategy and target ε. Drawn on ``fig``
    (default a new figure); returns it.

    Raises
    ------
    ValueError
        When no metric has a value (the figure would be empty).
    """
    names, shared = _setting_names(settings)
    rows = pd.concat([part.assign(position=index) for index, part in enumerate(settings)])
    drawn = _drawn(rows, metrics)
    if not drawn:
        raise ValueError(f"figure by setting: no values of {', '.join(metrics)} in the sweep's rows")
    series = list(rows.groupby(["strategy", "epsilon_target"], sort=True))
    if fig is None:
        fig = Figure(figsize=(max(5.2, 1.1 * len(names) + 2.5) * len(drawn), 4.2 + 0.25 * len(series)))
    for ax, metric in zip(fig.subplots(1, len(drawn), squeeze=False)[0], drawn, strict=True):
        for index, ((strategy, epsilon), part) in enumerate(series):
            std = np.nan_to_num(part[f"{metric}_std"].to_numpy(float), nan=0.0)
            ax.errorbar(part["position"] + 0.08 * (index - (len(series) - 1) / 2), part[f"{metric}_mean"],
                        yerr=std if np.any(std > 0) else None, marker="o", capsize=3, linestyle="none",
                        label=_series_label(str(strategy), float(epsilon)))
        _widen(ax, MIN_SPAN.get(metric, 0.0))
        long = max(map(len, names)) > 12
        ax.set_xticks(range(len(names)), names, rotation=20 if long else 0, ha="right" if long else "center")
        ax.set_xlabel("setting")
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"by setting: {shared} ({_seeds(rows)})", fontsize=10)
    return _legend_below(fig)


def plot_by_setting(
    summary: pd.DataFrame, path: str | Path, metrics: Sequence[str] = ("test_c_index", "test_ibs")
) -> list[Path]:
    """Write test metrics per setting of a sweep over settings (e.g. ``train.lr``), settings in natural order.

    Returns
    -------
    list of Path
        ``[path]``, or ``[]`` when the summary holds fewer than two settings or no metric values.
    """
    settings = _settings(summary)
    if len(settings) < 2 or not _drawn(pd.concat(settings), metrics):
        return []
    by_setting_figure(settings, metrics).savefig(Path(path), dpi=120)
    return [Path(path)]
