"""Figures of survival predictions (matplotlib).

Every function draws on the axes (``ax``) or figure (``fig``, for a grid of panels) it is given,
or on a new one of its own: never on pyplot's current axes, so two calls give two figures. It
returns what it drew on: the axes, or the figure of a grid of panels.

* :func:`plot_survival_vs_km` and :func:`plot_survival_bands` are the figures a run writes
  (``survival_vs_km.png``, ``survival_bands.png``). Their own figures are
  :class:`matplotlib.figure.Figure` objects outside pyplot: they need no display, leave the
  caller's backend alone (a notebook keeps its inline figures) and stay open nowhere once written.
* :func:`plot_curves` and :func:`plot_calibration` draw the ``plot_*`` methods of
  :class:`models.predictions.CurvePredictions`; their own figures are pyplot's (``plt.subplots``),
  so that a notebook shows them.

The time axis reads ``time (<unit>)`` with the run's ``data.time_unit`` (:func:`time_label`), the
survival axis "survival probability".
"""

from __future__ import annotations

import math
import re
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
#: ``data.time_unit``'s default: a time axis without a unit.
DEFAULT_TIME_UNIT = "time"
SURVIVAL_LABEL = "survival probability"


def _unit(time_unit: str) -> str:
    """``time_unit`` stripped; "" for the default (no unit)."""
    unit = str(time_unit or "").strip()
    return "" if unit == DEFAULT_TIME_UNIT else unit


def time_label(time_unit: str = DEFAULT_TIME_UNIT, name: str = "time") -> str:
    """The time axis' label: ``name (time_unit)``, e.g. "time (days)"; ``name`` alone for the default unit or ""."""
    return f"{name} ({_unit(time_unit)})" if _unit(time_unit) else name


def natural_key(name: Any) -> list[tuple[int, Any]]:
    """Sort key that orders the numbers inside names by value: site-2 before site-10, lr=0.003 before lr=0.01."""
    return [(0, float(part)) if part[:1].isdigit() else (1, part)
            for part in re.split(r"(\d+(?:\.\d+)?)", str(name)) if part]


def new_axes(ax: Any | None) -> Any:
    """``ax``, or the axes of a new pyplot figure (imported only then: the run's figures never need pyplot)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots()[1]


def _panels(count: int, fig: Figure | None, *, width: float = 3.6, height: float = 2.9) -> tuple[Figure, np.ndarray]:
    """A grid of ``count`` panels, at most 4 per row, with a shared y axis, on ``fig`` or a new figure."""
    columns = min(4, count)
    rows = math.ceil(count / columns)
    if fig is None:
        fig = Figure(figsize=(width * columns, height * rows))
    return fig, fig.subplots(rows, columns, squeeze=False, sharey=True)


def _finish(fig: Figure, axes: np.ndarray, used: int, path: Path | None, title: str, time_unit: str, *,
            title_size: float = 12) -> Figure:
    """Hide the unused panels, label every panel's axes, add the legend and title; write ``path`` if given."""
    for axis in list(axes.flat)[used:]:
        axis.set_visible(False)
    for axis in axes.flat:
        if axis.get_visible():
            axis.set_xlabel(time_label(time_unit), fontsize=8)
            axis.set_ylabel(SURVIVAL_LABEL, fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def plot_survival_vs_km(model: SurvivalModel, dataset: FederatedDataset, path: Path | None = None, *,
                        title: str = "", time_unit: str = DEFAULT_TIME_UNIT, fig: Figure | None = None) -> Figure:
    """Mean predicted survival of each site's test records against their Kaplan–Meier curve.

    One panel for the pooled test split, then one per site in natural order of their names
    (site-0, site-1, site-2, ..., site-10; the ``MAX_PANELS`` largest sites when there are more);
    the Kaplan–Meier curve is drawn with its 95% confidence band (lifelines, Greenwood). A
    well-calibrated model keeps its curve inside the band. Drawn on ``fig`` (default a new figure
    outside pyplot), written to ``path`` when given; returns the figure.
    """
    largest = sorted(dataset.sites, key=lambda site: len(site.test), reverse=True)[:MAX_PANELS]
    sites = sorted(largest, key=lambda site: natural_key(site.name))
    panels = [("pooled test", dataset.pooled("test"))] + [(site.name, site.test) for site in sites]
    fig, axes = _panels(len(panels), fig)
    for axis, (name, part) in zip(axes.flat, panels):
        if len(part) == 0:
            axis.set_title(f"{name}: no test records", fontsize=8)
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
    return _finish(fig, axes, len(panels), path, title, time_unit)


def plot_survival_bands(
    cuts: np.ndarray, mean: np.ndarray, lower: np.ndarray, upper: np.ndarray, path: Path | None = None, *,
    labels: Sequence[str] | None = None, records: int = 6, title: str = "", time_unit: str = DEFAULT_TIME_UNIT,
    fig: Figure | None = None,
) -> Figure:
    """Mean predicted survival curve and its credible band for a few records (one panel each).

    The records shown are spread over the range of predicted risk (quantiles of the mean curve's
    last value), so that the panels show low-, middle- and high-risk records.

    Parameters
    ----------
    cuts : ndarray, shape (T,)
        Time grid of the curves.
    mean, lower, upper : ndarray, shape (n, T)
        Mean survival and the band's bounds per record (e.g. :func:`models.multimodal.survival_band`).
    path : Path, optional
        Where to write the figure.
    labels : sequence of str, optional
        Record names (e.g. IDs) for the panel titles; default the row index.
    records : int, default 6
    title : str
    time_unit : str
        The unit of ``cuts`` (``data.time_unit``), in the time axis' label.
    fig : Figure, optional
        Drawn on it; default a new figure outside pyplot.

    Returns
    -------
    Figure
    """
    n = mean.shape[0]
    order = np.argsort(mean[:, -1])
    chosen = order[np.unique(np.linspace(0, n - 1, min(records, n)).round().astype(int))]
    fig, axes = _panels(len(chosen), fig)
    for axis, index in zip(axes.flat, chosen):
        axis.fill_between(cuts, lower[index], upper[index], step="post", alpha=0.3, color="C0", label="95% band")
        axis.step(cuts, mean[index], where="post", color="C0", label="mean survival")
        axis.set_title(f"record {labels[index] if labels is not None else index}", fontsize=8)
        axis.set_ylim(0, 1.02)
    return _finish(fig, axes, len(chosen), path, title, time_unit, title_size=9)


def plot_curves(curves: pd.DataFrame, *, ax: Any | None = None, time_unit: str = DEFAULT_TIME_UNIT) -> Any:
    """One survival step curve per row of ``curves`` (columns: times), labelled by its index.

    Drawn on ``ax`` (default a new pyplot figure); the time axis reads the columns' name with
    ``time_unit`` (:func:`time_label`). Returns the axes.
    """
    ax = new_axes(ax)
    times = np.asarray(curves.columns, dtype=np.float64)
    for label, row in curves.iterrows():
        ax.step(np.concatenate([[0.0], times]), np.concatenate([[1.0], row.to_numpy(dtype=np.float64)]),
                where="post", label=str(label))
    ax.set_xlabel(time_label(time_unit, str(curves.columns.name or "time")))
    ax.set_ylabel(SURVIVAL_LABEL)
    ax.set_ylim(0, 1.02)
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


def plot_calibration(table: pd.DataFrame, *, horizon: float, ax: Any | None = None,
                     time_unit: str = DEFAULT_TIME_UNIT) -> Any:
    """The points of :func:`calibration_groups` against the diagonal, with their 95% intervals.

    Drawn on ``ax`` (default a new pyplot figure); the axes name the horizon in ``time_unit``.
    Returns the axes.
    """
    ax = new_axes(ax)
    at = f"t = {horizon:.4g} {_unit(time_unit)}".rstrip()
    below = (table["km"] - table["km_lower"]).to_numpy()
    above = (table["km_upper"] - table["km"]).to_numpy()
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    ax.errorbar(table["predicted"], table["km"], yerr=np.vstack([below, above]), fmt="o", capsize=3,
                label="groups of predicted risk (Kaplan–Meier, 95% CI)")
    ax.set_xlabel(f"mean predicted survival probability at {at}")
    ax.set_ylabel(f"observed (Kaplan–Meier) survival at {at}")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="upper left")
    return ax
