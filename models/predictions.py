"""What every trained run offers on raw records, built on its survival curves: :class:`CurvePredictions`.

A horizontal run (:class:`models.saved_run.SavedRun`) and a split run
(:class:`models.split_run.SplitRun`) each say how they predict survival curves and a risk score,
and where the outcomes of labelled records are; the cumulative hazard, survival-time percentiles,
scores, calibration and plots follow here, once for both.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import pandas as pd

from models.data.validate import checked_outcomes
from models.importance import permutation_importance as _permutation_importance
from models.metrics import evaluate_survival, kaplan_meier_curves, km_null_check, km_null_warning

__all__ = ["CurvePredictions", "checked_outcomes"]


class CurvePredictions(ABC):
    """Predictions, scores and plots of a trained model from its survival curves on raw records."""

    # A subclass provides ``times`` (the time grid of the predicted curves, a field or a property) and
    # ``outcome`` (the time and event columns of labelled records, for score and calibration); ``event_values`` (the
    # run's ``data.event_values``: the event column's values that mark an event, () for 0/1 events) may override.
    times: np.ndarray
    outcome: tuple[str, str]
    event_values: tuple[str, ...] = ()

    @abstractmethod
    def predict_survival(self, records: Any, times: Any = None) -> pd.DataFrame:
        """Survival curves: one row per record, one column per time (default :attr:`times`)."""

    @abstractmethod
    def risk_score(self, records: Any) -> pd.Series:
        """The risk score of each record (higher: earlier event), as the C-index ranks them."""

    @abstractmethod
    def _labelled(self, records: Any) -> pd.DataFrame:
        """The records as one frame holding :attr:`outcome`, its rows in the order of the predictions."""

    def predict_cumulative_hazard(self, records: Any, times: Any = None) -> pd.DataFrame:
        r"""Cumulative hazards :math:`\hat H(t \mid x) = -\log \hat S(t \mid x)`, shaped like
        :meth:`predict_survival` (``inf`` where the predicted survival is 0)."""
        curves = self.predict_survival(records, times)
        with np.errstate(divide="ignore"):
            return -np.log(curves)

    def predict_percentile(self, records: Any, p: float = 0.5) -> pd.Series:
        r"""The time at which each record's predicted survival falls to ``p`` (lifelines' convention).

        The first grid time :math:`t` with :math:`\hat S(t \mid x) \le p`; ``inf`` when the curve
        stays above ``p`` over the grid (the run's follow-up does not reach it).
        """
        if not 0.0 < p < 1.0:
            raise ValueError(f"p must lie in (0, 1), got {p!r}")
        curves = self.predict_survival(records)
        below = curves.to_numpy() <= p
        first = np.where(below.any(axis=1), self.times[np.argmax(below, axis=1)], np.inf)
        return pd.Series(first, index=curves.index, name=f"survival_time_at_{p:g}")

    def predict_median_survival(self, records: Any) -> pd.Series:
        """The predicted median survival time of each record (:meth:`predict_percentile` at 0.5)."""
        return self.predict_percentile(records, 0.5).rename("median_survival_time")

    def score(self, records: Any) -> dict[str, float]:
        """Harrell's C, Antolini's time-dependent C, the IBS and the INBLL on labelled records, and
        ``ibs_km_null``: the IBS of the covariate-free Kaplan-Meier curve of the same records.

        The records carry the outcome columns :attr:`outcome`; the figures are computed as a run
        scores a site's test set (:func:`models.metrics.evaluate_survival`: the IPCW censoring of
        the scored records themselves, ``docs/evaluation.md``). NaN where a figure is undefined.
        The null curve is fitted on the scored records themselves, a stricter bar than a curve from
        other records; a ``UserWarning`` says so in one line when the model's IBS is not below it.
        """
        time, event = checked_outcomes(self._labelled(records), self.outcome, self.event_values)
        curves = self.predict_survival(records)
        result = evaluate_survival(self.times, curves.to_numpy(), time=time, event=event,
                                   risk=self._score_risk(records))
        km_times, km_surv = kaplan_meier_curves(time, event, len(time))
        result["ibs_km_null"] = evaluate_survival(km_times, km_surv, time=time, event=event, risk=np.zeros(len(time)),
                                                  concordance_td=False)["ibs"]
        warning = km_null_warning(km_null_check(result["ibs"], result["ibs_km_null"]), "these records")
        if warning is not None:
            warnings.warn(warning.removeprefix("warning: "), UserWarning, stacklevel=2)
        return result

    def _score_risk(self, records: Any) -> np.ndarray | None:
        """The risk :meth:`score` ranks by; ``None``: the curves' −RMST (:func:`evaluate_survival`'s default),
        which a model whose risk score is that saves computing its curves a second time."""
        return self.risk_score(records).to_numpy()

    def calibration(self, records: Any, *, horizon: float | None = None, groups: int = 5) -> pd.DataFrame:
        """Predicted against Kaplan–Meier survival at ``horizon`` by group of predicted risk.

        ``horizon`` defaults to the median observed time of the labelled ``records``; see
        :func:`models.plots.calibration_groups` for the columns.
        """
        from models.plots import calibration_groups

        time, event = checked_outcomes(self._labelled(records), self.outcome, self.event_values)
        curves = self.predict_survival(records).to_numpy()
        horizon = float(np.median(time)) if horizon is None else float(horizon)
        return calibration_groups(self.times, curves, time=time, event=event, horizon=horizon, groups=groups)

    @property
    def time_unit(self) -> str:
        """The run's ``data.time_unit``, read from the ``config.json`` in its ``directory`` ("time", no unit, when
        the run recorded none)."""
        import json
        from pathlib import Path

        from models.plots import DEFAULT_TIME_UNIT

        directory = getattr(self, "directory", None)
        path = None if directory is None else Path(directory) / "config.json"
        resolved = json.loads(path.read_text(encoding="utf-8")).get("resolved", {}) if path and path.is_file() else {}
        return str((resolved.get("data") or {}).get("time_unit") or DEFAULT_TIME_UNIT)

    def plot_survival(self, records: Any, *, ax: Any | None = None) -> Any:
        """The predicted survival curves of ``records`` (a few: one curve each).

        Drawn on ``ax``, default a new figure (never pyplot's current axes); the time axis reads
        the run's :attr:`time_unit`. Returns the axes.
        """
        from models.plots import plot_curves

        return plot_curves(self.predict_survival(records), ax=ax, time_unit=self.time_unit)

    def plot_calibration(self, records: Any, *, horizon: float | None = None, groups: int = 5,
                         ax: Any | None = None) -> Any:
        """:meth:`calibration` drawn against the diagonal with the 95% intervals.

        Drawn on ``ax``, default a new figure (never pyplot's current axes); the horizon is named in
        the run's :attr:`time_unit`. Returns the axes.
        """
        from models.plots import plot_calibration

        if horizon is None:
            horizon = float(np.median(checked_outcomes(self._labelled(records), self.outcome, self.event_values)[0]))
        return plot_calibration(self.calibration(records, horizon=horizon, groups=groups), horizon=horizon, ax=ax,
                                time_unit=self.time_unit)

    def permutation_importance(self, records: Any, *, n_repeats: int = 5, seed: int = 0) -> pd.DataFrame:
        """The drop in Harrell's C and the rise in the IBS on labelled ``records`` when each input column is
        shuffled: mean and std over ``n_repeats``, most important first (a frame; the computation and its
        contract: :func:`models.importance.permutation_importance`)."""
        return _permutation_importance(self, records, n_repeats=n_repeats, seed=seed)

