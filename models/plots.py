"""Figures of survival predictions (matplotlib, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from lifelines import KaplanMeierFitter  # noqa: E402

from models.data import FederatedDataset  # noqa: E402
from models.survival import SurvivalModel  # noqa: E402

MAX_PANELS = 16


def _panels(count: int, *, width: float = 3.6, height: float = 2.9) -> tuple[plt.Figure, np.ndarray]:
    """A grid of ``count`` panels, at most 4 per row, with a shared y axis."""
    columns = min(4, count)
    rows = math.ceil(count / columns)
    return plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False, sharey=True)


def _save(fig: plt.Figure, axes: np.ndarray, used: int, path: Path, title: str, *, title_size: float = 12) -> Path:
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
    plt.close(fig)
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
