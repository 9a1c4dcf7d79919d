"""Flower messages of federated Cox regression (``model.name = "coxph"``): names, encoding, the design, the manifest.

Message types (``<category>.<action>``, routed by the ClientApp to :mod:`flwr_app.cox_client`; the server's side is
:mod:`flwr_app.cox_server`):

``query.cox_moments``      once: the site's record count and each covariate's sum and sum of squares over its
                           training records (:class:`models.cox.ColumnMoments`: the standardisation of lifelines)
``query.cox_event_times``  once, ``cox.strata = none`` with ``cox.grid = events``: the distinct event times of the
                           site's training records (the pooled grid of the risk-set sums)
``query.cox_sums``         every Newton step: the server's β (per unit of the encoded columns) -> the site's
                           :class:`models.cox.CoxSums` (stratified) or :class:`models.cox.RiskSetSums` (pooled)
``query.cox_meat``         once, ``cox.robust``: the site's score-residual cross-products at the final β
``query.cox_schoenfeld``   once, ``cox.ph_test``: the site's :class:`models.cox.SchoenfeldSums` at the final β

Arrays travel in an ``ArrayRecord`` (:data:`ARRAYS`; float64, lossless), the step and the rank offset in a
``ConfigRecord`` (:data:`CONFIG`), the site's name in the reply's ``site`` record. What a site computes and releases
is set by its own run config (``cox.*``), never by the message: a message asking for what the run's config does not
plan is refused.

The covariates (:class:`CoxDesign`) are the encoded model inputs of the shared preprocessing
(:class:`models.data.Preprocessor`: numeric columns standardised, categorical columns one-hot), without one
reference level per categorical column (the full one-hot encoding sums to 1, which the baseline hazard absorbs):
the first level in the preprocessor's (sorted) order. A record whose level is missing or unseen is encoded as all
zeros, so in the fit it counts as the reference level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from models.data import Preprocessor
from strategies.config import ExperimentConfig
from strategies.mechanisms.base import Manifest, ReleasedValue, common_releases

__all__ = [
    "ARRAYS",
    "CONFIG",
    "EVENT_TIMES",
    "MEAT",
    "MOMENTS",
    "RISK_SET",
    "SCHOENFELD",
    "SUMS",
    "CoxDesign",
    "check_beta",
    "coxph_manifest",
    "decode",
    "encode",
]

MOMENTS = "query.cox_moments"
EVENT_TIMES = "query.cox_event_times"
SUMS = "query.cox_sums"
MEAT = "query.cox_meat"
SCHOENFELD = "query.cox_schoenfeld"
#: The records of a message and of its reply: the arrays, and the scalars of a request.
ARRAYS, CONFIG = "cox", "config"
#: The per-grid-point arrays of :class:`models.cox.RiskSetSums` (a pooled step's reply, beside ``n``).
RISK_SET = ("events", "event_weight", "event_x", "event_risk", "event_risk_x", "event_risk_xx", "risk", "risk_x",
            "risk_xx")
#: The Newton steps of a run (its ``step``) count from 1; the messages after the fit carry ``step`` 0.
AFTER_FIT = 0


def encode(arrays: Mapping[str, np.ndarray], config: Mapping[str, int | float | str] | None = None) -> RecordDict:
    """A request or reply: ``arrays`` (each as float64 or int64) and, for a request, its scalars."""
    record = ArrayRecord()
    for name, value in arrays.items():
        value = np.asarray(value)
        record[name] = Array(np.ascontiguousarray(value, dtype=np.int64 if value.dtype.kind in "iub" else np.float64))
    content = RecordDict({ARRAYS: record})
    if config is not None:
        content[CONFIG] = ConfigRecord(dict(config))
    return content


def decode(content: RecordDict) -> dict[str, np.ndarray]:
    """The arrays of a request or reply (``ValueError`` when it carries none)."""
    if ARRAYS not in content.array_records:
        raise ValueError(f"the message carries no '{ARRAYS}' arrays")
    return {name: array.numpy() for name, array in content.array_records[ARRAYS].items()}


def check_beta(beta: np.ndarray | None, p: int) -> np.ndarray:
    """The server's β as a site accepts it: p finite numbers (``ValueError``, one line, otherwise)."""
    if beta is None:
        raise ValueError("Cox query refused: the message carries no beta")
    beta = np.asarray(beta, dtype=np.float64)
    if beta.ndim != 1 or beta.size != p:
        raise ValueError(f"Cox query refused: beta must hold {p} coefficients (one per covariate), got shape "
                         f"{beta.shape}")
    if not np.all(np.isfinite(beta)):
        raise ValueError(f"Cox query refused: beta must be finite, got {np.count_nonzero(~np.isfinite(beta))} "
                         "non-finite coefficient(s)")
    if np.max(np.abs(beta)) > MAX_ABS_BETA:
        raise ValueError(f"Cox query refused: |beta| up to {np.max(np.abs(beta)):.3g} per unit of an encoded column "
                         f"(at most {MAX_ABS_BETA:g}): exp(x'beta) would overflow")
    return beta


#: The largest coefficient a site accepts per unit of an encoded column (standardised, or 0/1): exp(50) is 5e21.
MAX_ABS_BETA = 50.0


@dataclass(frozen=True)
class CoxDesign:
    """The Cox covariates among the preprocessor's encoded columns, and their units.

    Attributes
    ----------
    kept
        Positions of the covariates among :attr:`Preprocessor.feature_names` (every column but each categorical
        column's reference level; a categorical column with a single level is left out entirely).
    names
        The covariates' names: a numeric column's name, ``column=level`` for a level.
    references
        Each categorical column's reference level (the hazard ratios of its other levels are against it).
    scale, shift
        A covariate in the user's units is ``encoded * scale + shift``: a numeric column's standard deviation
        and mean in the preprocessing; 1 and 0 for a level. A coefficient per user unit is the coefficient per
        encoded unit divided by ``scale``.
    """

    kept: np.ndarray
    names: tuple[str, ...]
    references: dict[str, str]
    scale: np.ndarray
    shift: np.ndarray

    @property
    def p(self) -> int:
        return len(self.names)

    @classmethod
    def from_preprocessor(cls, preprocessor: Preprocessor) -> CoxDesign:
        kept, names, scale, shift, references = [], [], [], [], {}
        position = 0
        for column in preprocessor.columns:
            if column in preprocessor.means:
                kept.append(position)
                names.append(column)
                scale.append(float(preprocessor.stds[column]))
                shift.append(float(preprocessor.means[column]))
                position += 1
                continue
            levels = preprocessor.categories[column]
            if levels:
                references[column] = levels[0]
            for offset, level in enumerate(levels[1:], start=1):
                kept.append(position + offset)
                names.append(f"{column}={level}")
                scale.append(1.0)
                shift.append(0.0)
            position += len(levels)
        if not names:
            raise ValueError("coxph needs at least one covariate: every feature column is a categorical column with "
                             "a single level")
        return cls(np.asarray(kept, dtype=np.int64), tuple(names), references, np.asarray(scale), np.asarray(shift))

    def covariates(self, x: np.ndarray) -> np.ndarray:
        """The covariates (float64, n x p) of encoded model inputs ``x`` (n x the preprocessor's width)."""
        return np.asarray(x, dtype=np.float64)[:, self.kept]


def coxph_manifest(cfg: ExperimentConfig) -> Manifest:
    """Every value a site sends in a ``coxph`` run (no noise anywhere: every release is uncovered)."""
    cox = cfg.cox
    pooled = cox.strata == "none"
    releases = [
        ReleasedValue("covariate moments", "once: the number of training records and each covariate's sum and sum "
                      "of squares over them (lifelines' standardisation of the columns)", "cox", False,
                      "sent without noise; the same kind of statistics as the set-up's feature statistics",
                      (f"{MOMENTS}/{ARRAYS}.*",)),
    ]
    if pooled:
        if cox.grid == "events":
            releases.append(ReleasedValue(
                "event times", "once: every distinct event time of the site's training records (the pooled grid of "
                "the risk-set sums, cox.grid = events)", "cox", False,
                "sent as they are: reveals when each of the site's events happened (cox.grid = k sends none)",
                (f"{EVENT_TIMES}/{ARRAYS}.*",)))
        releases.append(ReleasedValue(
            "risk-set sums", "every Newton step, at the server's beta, per point of the shared grid (cox.grid): the "
            "site's number of events, their covariate sums, and the sums, risk-weighted covariate sums and "
            "risk-weighted cross-products of exp(x'beta) over its events and over its records at risk "
            "(models.cox.RiskSetSums)", "cox", False,
            "exact: the number of events at every grid point (with cox.grid = events: every event time) and, over "
            "steps with different beta, moments of the covariates of those at risk", (f"{SUMS}/{ARRAYS}.*",)))
    else:
        releases.append(ReleasedValue(
            "Cox sums", "every Newton step, at the server's beta: the site's Efron log partial likelihood, its score "
            "(p numbers) and information matrix (p x p) within its own stratum, its number of training records and "
            "of events (models.cox.CoxSums)", "cox", False,
            "exact; over steps with different beta the server learns more about the site's records than one step "
            "shows (p + p^2 + 3 numbers a step)", (f"{SUMS}/{ARRAYS}.*",)))
    if cox.robust:
        releases.append(ReleasedValue(
            "score-residual cross-products", "once, at the final beta: the p x p sum of r r' over the site's "
            "Lin-Wei score residuals (the sandwich's meat)" + ("; built on the server's broadcast of the pooled "
                                                              "Breslow increments and risk-set means" if pooled
                                                              else ""), "cox", False, "sent without noise",
            (f"{MEAT}/{ARRAYS}.*",)))
    if cox.ph_test != "none":
        releases.append(ReleasedValue(
            "Schoenfeld sums", f"once, at the final beta: the site's number of events and the sums of the "
            f"transformed event times ({cox.ph_test}), their squares, the Schoenfeld residuals and the "
            "time-weighted residuals (2p + 3 numbers, models.cox.SchoenfeldSums)", "cox", False,
            "sent without noise" + ("; the rank transform needs the number of events at the sites named before it "
                                    "(sent by the server)" if cox.ph_test == "rank" else ""),
            (f"{SCHOENFELD}/{ARRAYS}.*",)))
    releases += common_releases(cfg, private=False, record_level=False)
    return Manifest("fedavg", "none", tuple(releases))
