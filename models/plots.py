"""Figures of survival predictions (matplotlib).

The figures a run writes are drawn on :class:`matplotlib.figure.Figure` objects, outside pyplot, so
they need no display and leave the caller's backend alone (a notebook keeps its inline figures);
:func:`plot_curves` and :func:`plot_calibration` draw on the caller's axes (or pyplot's current
ones) for :class:`models.predict.SavedRun`'s ``plot_*`` methods.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from lifelines import KaplanMeierFitter
from matplotlib.figure import Figure

from models.data import FederatedDataset
from models.metrics import calibration_table, survival_at
from models.survival import SurvivalModel

MAX_PANELS = 16


def _panels(count: int, *, width: float = 3.6, height: float = 2.9) -> tuple[Figure, np.ndarray]:
    """A grid of ``count`` panels, at most 4 per row, with a shared y axis."""
    columns = min(4, count)
    rows = math.ceil(count / columns)
    fig = Figure(figsize=(width * columns, height * rows))
    return fig, fig.subplots(rows, columns, squeeze=False, sharey=True)


def _save(fig: Figure, axes: np.ndarray, used: int, path: Path, title: str, *, title_size: float = 12) -> Path:
    """Hide the unused panels, label the survival axis, add the legend and title, write ``path``."""
    for axis in list(axes.flat)[used:]:
        axis.set_visible(False)
    axes[0, 0].legend(fontsize=7, loc="lower left")
    for axis in axes[:, 0]:
        axis.set_ylabel("survival")
    if title:
        fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_survival_vs_km(model: SurvivalModel, dataset: FederatedDataset, path: Path, *, title: str = "") -> Path:
    """Mean predicted survival of each site's test records against their Kaplan–Meier curve.

    One panel per site (the ``MAX_PANELS`` largest sites when there are more) plus one for the
    pooled test split; the Kaplan–Meier curve is drawn with its 95% confidence band (lifelines,
    Greenwood). A well-calibrated model keeps its curve inside the band.
    """
    sites = sorted(dataset.sites, key=lambda site: len(site.test), reverse=True)[:MAX_PANELS]
    panels = [("pooled test", dataset.pooled("test"))] + [(site.name, site.test) for site in sites]
    fig, axes = _panels(len(panels))
    for axis, (name, part) in zip(axes.flat, panels):
        if len(part) == 0:
            axis.set_visible(False)
            continue
        times, surv = model.predict_survival(part.x)
        kmf = KaplanMeierFitter().fit(part.time, part.event)
        band = kmf.confidence_interval_survival_function_
        axis.fill_between(band.index, band.iloc[:, 0], band.iloc[:, 1], step="post", alpha=0.25, color="C0")
        axis.step(kmf.survival_function_.index, kmf.survival_function_.iloc[:, 0], where="post", color="C0",
                  label="Kaplan–Meier (95% CI)")
        axis.step(np.concatenate([[0.0], times]), np.concatenate([[1.0], surv.mean(axis=0)]), where="post",
                  color="C3", label="mean predicted")
        axis.set_title(f"{name} (n={len(part)}, events={int(part.event.sum())})", fontsize=8)
        axis.set_xlim(0, float(np.max(part.time)))
    return _save(fig, axes, len(panels), path, title)


def plot_survival_bands(
    cuts: np.ndarray, mean: np.ndarray, lower: np.ndarray, upper: np.ndarray, path: Path, *,
    labels: Sequence[str] | None = None, records: int = 6, title: str = "",
) -> Path:
    """Mean predicted survival curve and its credible band for a few records (one panel each).

    The records shown are spread over the range of predicted risk (quantiles of the mean curve's
    last value), so that the panels show low-, middle- and high-risk records.

    Parameters
    ----------
    cuts : ndarray, shape (T,)
        Time grid of the curves.
    mean, lower, upper : ndarray, shape (n, T)
        Mean survival and the band's bounds per record (e.g. :func:`models.multimodal.survival_band`).
    path : Path
    labels : sequence of str, optional
        Record names (e.g. IDs) for the panel titles; default the row index.
    records : int, default 6
    title : str
    """
    n = mean.shape[0]
    order = np.argsort(mean[:, -1])
    chosen = order[np.unique(np.linspace(0, n - 1, min(records, n)).round().astype(int))]
    fig, axes = _panels(len(chosen))
    for axis, index in zip(axes.flat, chosen):
        axis.fill_between(cuts, lower[index], upper[index], step="post", alpha=0.3, color="C0", label="95% band")
        axis.step(cuts, mean[index], where="post", color="C0", label="mean survival")
        axis.set_title(f"record {labels[index] if labels is not None else index}", fontsize=8)
        axis.set_xlabel("time")
        axis.set_ylim(0, 1.02)
    return _save(fig, axes, len(chosen), path, title, title_size=9)


def _axes(ax: Any | None) -> Any:
    """``ax``, or pyplot's current axes (imported only then, so that the run's figures never need pyplot)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.gca()


def plot_curves(curves: pd.DataFrame, *, ax: Any | None = None, ylabel: str = "survival") -> Any:
    """One step curve per row of ``curves`` (columns: times), labelled by its index; returns the axes."""
    ax = _axes(ax)
    times = np.asarray(curves.columns, dtype=np.float64)
    start, first = (0.0, 1.0) if ylabel == "survival" else (0.0, 0.0)
    for label, row in curves.iterrows():
        ax.step(np.concatenate([[start], times]), np.concatenate([[first], row.to_numpy(dtype=np.float64)]),
                where="post", label=str(label))
    ax.set_xlabel(curves.columns.name or "time")
    ax.set_ylabel(ylabel)
    if len(curves) <= 10:
        ax.legend(fontsize=7, title=curves.index.name)
    return ax


def calibration_groups(
    times: np.ndarray, surv: np.ndarray, *, time: np.ndarray, event: np.ndarray, horizon: float, groups: int = 5,
) -> pd.DataFrame:
    r"""Predicted against observed survival at ``horizon`` by group of predicted risk.

    The records are cut into ``groups`` groups of equal size by their predicted :math:`\hat S(h)`;
    each row is one group's mean predicted survival at :math:`h` and its Kaplan–Meier estimate with
    95% confidence interval (:func:`models.metrics.calibration_table`). A calibrated model's points
    lie on the diagonal, within their intervals.

    Returns
    -------
    DataFrame with columns ``group, n, predicted, km, km_lower, km_upper``.
    """
    at_horizon = survival_at(times, surv, np.array([horizon]))[:, 0]
    order = np.argsort(at_horizon, kind="stable")
    rows = []
    for group, members in enumerate(np.array_split(order, min(groups, len(order)))):
        table = calibration_table(times, surv[members], time=time[members], event=event[members],
                                  horizons=np.array([horizon]))
        rows.append({"group": group + 1, "n": len(members), **table.iloc[0][
            ["predicted", "km", "km_lower", "km_upper"]].to_dict()})
    return pd.DataFrame(rows)


def plot_calibration(table: pd.DataFrame, *, horizon: float, ax: Any | None = None) -> Any:
    """The points of :func:`calibration_groups` against the diagonal, with their 95% intervals; returns the axes."""
    ax = _axes(ax)
    below = (table["km"] - table["km_lower"]).to_numpy()
    above = (table["km_upper"] - table["km"]).to_numpy()
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    ax.errorbar(table["predicted"], table["km"], yerr=np.vstack([below, above]), fmt="o", capsize=3,
                label="groups of predicted risk (Kaplan–Meier, 95% CI)")
    ax.set_xlabel(f"mean predicted survival at t = {horizon:.4g}")
    ax.set_ylabel(f"observed (Kaplan–Meier) survival at t = {horizon:.4g}")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="upper left")
    return ax
