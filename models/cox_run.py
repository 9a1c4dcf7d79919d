"""A federated Cox regression run (``model.name = "coxph"``) read back: :class:`CoxRun`.

:func:`models.predict.load_run` (and :func:`fedsurv.fit`) return a :class:`CoxRun` for a ``coxph`` run: everything a
:class:`~models.saved_run.SavedRun` does (``predict_survival`` with the federated Breslow baseline, ``risk_score``
= the linear predictor, ``score``, ...) and the regression's own figures, read from the run's ``coxph.json``
(:mod:`flwr_app.cox_server`), in lifelines' terms:

>>> run = fedsurv.fit(train, time_col="time", event_col="event", site_col="centre", model="coxph")
>>> run.hazard_ratios                   # Series: one per numeric column and per non-reference level
>>> run.summary_table()                 # lifelines' CoxPHFitter.summary columns
>>> run.print_summary()
>>> run.proportional_hazard_test()      # per covariate: test_statistic, p, -log2(p)
>>> run.plot_coefficients()             # forest plot of the coefficients and their confidence intervals
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from models.cox import CoxResult, LikelihoodRatioTest
from models.saved_run import SavedRun

__all__ = ["COXPH_JSON", "CoxRun"]

#: The fit's figures in the run's directory (written by :mod:`flwr_app.cox_server`).
COXPH_JSON = "coxph.json"


@dataclass(frozen=True)
class CoxRun(SavedRun):
    """A ``coxph`` run: a :class:`~models.saved_run.SavedRun` with the fitted regression's figures.

    Coefficients are per unit of the user's columns (a numeric column's raw unit; a categorical column's level
    against its reference level, :attr:`references`). ``fit``: the run's ``coxph.json``.
    """

    fit: Mapping[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def result(self) -> CoxResult:
        """The fit as :class:`models.cox.CoxResult` (coefficients, variances, log-likelihoods, ...)."""
        fit = self.fit
        names = list(fit["names"])
        index = pd.Index(names, name="covariate")

        def frame(values: Any) -> pd.DataFrame | None:
            return None if values is None else pd.DataFrame(np.asarray(values, dtype=np.float64), index=names,
                                                            columns=names)

        return CoxResult(
            params=pd.Series(fit["coef"], index=index, name="coef", dtype=np.float64),
            variance=frame(fit["variance"]),
            standard_errors=pd.Series(fit["se"], index=index, name="se", dtype=np.float64),
            log_likelihood=float(fit["log_likelihood"]),
            log_likelihood_null=None if fit["log_likelihood_null"] is None else float(fit["log_likelihood_null"]),
            n=int(fit["n"]), events=int(fit["events"]), robust_variance=frame(fit.get("robust_variance")),
            alpha=float(fit["alpha"]), converged=bool(fit["converged"]), steps=int(fit["steps"]),
        )

    @property
    def params(self) -> pd.Series:
        """The coefficients (log hazard ratios) per unit of the user's columns."""
        return self.result.params

    @property
    def hazard_ratios(self) -> pd.Series:
        """exp(coef), indexed by the covariates: numeric column names and ``column=level`` for the levels."""
        return self.result.hazard_ratios

    @property
    def references(self) -> dict[str, str]:
        """Each categorical column's reference level."""
        return dict(self.fit.get("references", {}))

    def summary_table(self) -> pd.DataFrame:
        """lifelines' ``CoxPHFitter.summary``: coef, exp(coef), se(coef), confidence bounds, cmp to, z, p,
        -log2(p)."""
        return self.result.summary

    def log_likelihood_ratio_test(self) -> LikelihoodRatioTest:
        """The likelihood-ratio test against the model without covariates (lifelines' ``log_likelihood_ratio_test``)."""
        return self.result.log_likelihood_ratio_test()

    def proportional_hazard_test(self) -> pd.DataFrame:
        """The federated test of proportional hazards (scaled Schoenfeld residuals, the run's ``cox.ph_test`` time
        transform): one row per covariate with ``test_statistic``, ``p`` and ``-log2(p)``.

        Raises
        ------
        ValueError
            When the run made no test (``cox.ph_test = none``, or too few events), saying why.
        """
        table = self.fit.get("ph_test")
        if table is None:
            raise ValueError(f"{self.directory}: no proportional-hazards test in this run "
                             f"({self.fit.get('ph_test_note') or 'cox.ph_test = none'})")
        statistic, p = np.asarray(table["test_statistic"], dtype=np.float64), np.asarray(table["p"], dtype=np.float64)
        with np.errstate(divide="ignore"):
            return pd.DataFrame({"test_statistic": statistic, "p": p, "-log2(p)": -np.log2(p)},
                                index=pd.Index(table["covariates"], name="covariate"))

    def print_summary(self, decimals: int = 3) -> None:
        """lifelines-style summary: size, log-likelihood, the table, the likelihood-ratio test, the reference levels
        and the proportional-hazards test."""
        self.result.print_summary(decimals)
        if self.references:
            print("reference levels: " + ", ".join(f"{column}={level}" for column, level in self.references.items()))
        if self.fit.get("ph_test") is not None:
            print("proportional-hazards test:")
            print(self.proportional_hazard_test().to_string(float_format=lambda v: f"{v:.{decimals}f}"))

    def plot_coefficients(self, ax: Any = None, *, hazard_ratios: bool = False) -> Any:
        """Forest plot: each coefficient (or hazard ratio) with its confidence interval, one row per covariate.

        Drawn on ``ax``, default a new figure (never pyplot's current axes). Returns the axes.
        """
        import matplotlib.pyplot as plt

        table = self.summary_table()
        ci = f"{100 * (1 - self.result.alpha):g}%"
        prefix = "exp(coef)" if hazard_ratios else "coef"
        centre, lower, upper = table[prefix], table[f"{prefix} lower {ci}"], table[f"{prefix} upper {ci}"]
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 0.4 * len(table) + 1.2))
        rows = np.arange(len(table))[::-1]
        ax.errorbar(centre, rows, xerr=[centre - lower, upper - centre], fmt="s", color="k", capsize=3)
        ax.axvline(1.0 if hazard_ratios else 0.0, color="grey", linestyle="--", linewidth=1)
        ax.set_yticks(rows, list(table.index))
        if hazard_ratios:
            ax.set_xscale("log")
        ax.set_xlabel(f"{'hazard ratio' if hazard_ratios else 'log hazard ratio (coef)'} ({ci} CI)")
        ax.set_ylabel("covariate")
        return ax
