r"""Federated Cox proportional-hazards regression from additive per-site sums.

Newton–Raphson needs, at each :math:`\beta`, the log partial likelihood, its score and its
information matrix. Each is a sum over event times of terms built from sums over records,
so every site computes sums from its own records and the server only adds them.

Two models:

* **Stratified by site** (each site has its own baseline hazard): the partial likelihood is a
  product over sites, so each site sends :class:`CoxSums` — its log-likelihood, score and
  information — from :func:`site_sums_stratified`, and their sum is exactly the stratified
  partial likelihood of the pooled records with strata = sites (lifelines'
  ``CoxPHFitter(strata=["site"])``). A site reveals only these p + p² + 3 numbers per round.
* **Pooled** (one baseline hazard across sites): risk sets span sites, so each site sends
  per-cell sums on a shared time grid (:func:`site_risk_set_sums`) and the server forms the
  likelihood from their sum (:func:`pooled_newton_terms`). On the grid of every distinct
  event time this is exactly lifelines' ``CoxPHFitter()`` on the pooled records.

Ties follow Efron (as lifelines and R's ``coxph``): at a time with :math:`d` events (tie set
:math:`D`), risk set :math:`R`, risk scores :math:`\phi_i = w_i e^{x_i^\top\beta}` and
:math:`\bar w = \sum_D w_i / d`,

.. math::

    \ell = \sum_{i \in D} w_i x_i^\top\beta - \bar w \sum_{l=0}^{d-1} \log\Bigl(
    \sum_R \phi_i - \tfrac{l}{d} \sum_D \phi_i\Bigr),

with score and information its first and negated second derivatives.

Scale. lifelines standardises every covariate with the pooled mean and standard deviation
(``ddof=1``) before fitting and applies its ridge penalty
:math:`n \cdot c \cdot \tfrac12 \lVert\beta\rVert^2` (:math:`n` = number of records,
:math:`c` = ``penalizer``) to the standardised coefficients. :func:`fit_stratified` and
:func:`fit_pooled` replicate this: the sites send :class:`ColumnMoments`, the server
broadcasts the mean and standard deviation, the sites standardise, Newton runs on the
standardised scale with ``penalizer = c * n``, and :class:`CoxResult` reports
coefficients per unit of the user's columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd
from scipy import linalg, sparse, stats

from models.km import (
    combine_km_counts,
    grid_index,
    kaplan_meier,
    site_km_counts,
    survival_arrays,
)

__all__ = [
    "ColumnMoments",
    "CoxResult",
    "CoxSums",
    "LikelihoodRatioTest",
    "NewtonResult",
    "RISK_WEIGHTED",
    "RiskSetSums",
    "SchoenfeldSums",
    "SiteData",
    "efron_event_means",
    "fit_pooled",
    "fit_stratified",
    "newton_raphson",
    "ph_test_pooled",
    "ph_test_stratified",
    "pooled_newton_terms",
    "pooled_residual_terms",
    "proportional_hazard_test",
    "site_column_moments",
    "site_risk_set_sums",
    "site_schoenfeld_sums",
    "site_score_residual_sums",
    "site_score_residual_sums_pooled",
    "site_sums_stratified",
    "time_transform",
]

Terms = tuple[float, np.ndarray, np.ndarray]
"""``(loglik, score (p,), information (p, p))`` at one :math:`\\beta`."""


def _design(x: np.ndarray, n: int) -> np.ndarray:
    """``x`` as a finite float (n, p) matrix; one-line ``ValueError`` otherwise."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"x must be an (n, p) matrix with n = {n} records, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("x must be finite: impute or drop records with missing covariates")
    return x


def _beta(beta: np.ndarray, p: int) -> np.ndarray:
    beta = np.asarray(beta, dtype=np.float64).reshape(-1)
    if beta.shape != (p,):
        raise ValueError(f"beta must have one coefficient per column of x ({p}), got {beta.shape[0]}")
    return beta


# --------------------------------------------------------------------------------------------
# Sums


@dataclass(frozen=True, eq=False)
class CoxSums:
    """One site's (or, summed, all sites') Efron log partial likelihood, score (p,) and
    information (p, p) at one :math:`\\beta`, with its numbers of records and events."""

    loglik: float
    score: np.ndarray
    information: np.ndarray
    n: int
    events: int

    def __add__(self, other: CoxSums) -> CoxSums:
        return CoxSums(
            self.loglik + other.loglik,
            self.score + other.score,
            self.information + other.information,
            self.n + other.n,
            self.events + other.events,
        )

    def terms(self) -> Terms:
        """``(loglik, score, information)``: what :func:`newton_raphson` asks for."""
        return self.loglik, self.score, self.information


@dataclass(frozen=True, eq=False)
class RiskSetSums:
    r"""Per-cell sums on a shared grid :math:`\tau` (length m), additive over sites.

    With :math:`\phi_i = w_i e^{x_i^\top\beta}`, risk set :math:`R_k` (records at risk at
    :math:`\tau_k`) and tie set :math:`D_k` (events at :math:`\tau_k`), both after the grid
    rounding of :func:`models.km.grid_index` (events round up, censorings round down):

    ``risk`` :math:`S_0 = \sum_{R_k}\phi_i` (m,), ``risk_x`` :math:`S_1 = \sum_{R_k}\phi_i x_i`
    (m, p), ``risk_xx`` :math:`S_2 = \sum_{R_k}\phi_i x_i x_i^\top` (m, p, p); ``events``
    :math:`d_k = |D_k|`, ``event_weight`` :math:`\sum_{D_k} w_i`, ``event_x``
    :math:`\sum_{D_k} w_i x_i`, ``event_risk`` / ``event_risk_x`` / ``event_risk_xx``: the
    same three sums as ``risk*`` over :math:`D_k`. ``n`` counts the records.
    :math:`\sum_{D_k} w_i x_i^\top\beta` is ``event_x @ beta`` and is not sent separately.

    Reveals per grid point: the site's number of events, the weighted sum, risk-weighted sum
    and risk-weighted cross-products of the covariates of its events and of its risk set
    (hence, over rounds with different :math:`\beta`, moments of its covariates among those at
    risk). A coarse grid hides exact event times and censoring times.
    """

    grid: np.ndarray
    n: int
    events: np.ndarray
    event_weight: np.ndarray
    event_x: np.ndarray
    event_risk: np.ndarray
    event_risk_x: np.ndarray
    event_risk_xx: np.ndarray
    risk: np.ndarray
    risk_x: np.ndarray
    risk_xx: np.ndarray

    def rescaled(self, log_factor: float | np.ndarray) -> RiskSetSums:
        r"""These sums with every :math:`\phi_i` multiplied by :math:`e^{c_k}` in cell :math:`k`,
        ``log_factor`` :math:`c` one number or one per grid point (the :data:`RISK_WEIGHTED` arrays;
        the counts and event sums unchanged): with :math:`c` the ``log_scale`` of
        :func:`site_risk_set_sums`, the unscaled sums."""
        factor = np.broadcast_to(np.exp(np.asarray(log_factor, dtype=np.float64)), self.risk.shape)
        scaled = {name: getattr(self, name) * factor.reshape(-1, *(1,) * (getattr(self, name).ndim - 1))
                  for name in RISK_WEIGHTED}
        return replace(self, **scaled)

    def risk_bound(self) -> np.ndarray:
        r"""Per grid point (m,), the larger of :math:`S_0` and every :math:`(S_2)_{jj}`: a bound on
        every risk-weighted value (:data:`RISK_WEIGHTED`) of that cell, in these sums and in any part
        of them (a site's own, when these are summed over sites): the cell's events are in its risk
        set, every term of :math:`S_0` and :math:`(S_2)_{jj}` is non-negative, and
        :math:`|(S_1)_j| \le \sqrt{S_0 (S_2)_{jj}}`, :math:`|(S_2)_{jl}| \le
        \sqrt{(S_2)_{jj} (S_2)_{ll}}` (Cauchy–Schwarz). The risk sets shrink along the grid, so
        the first cell's bounds every cell's."""
        return np.maximum(self.risk, np.max(np.diagonal(self.risk_xx, axis1=1, axis2=2), axis=1, initial=0.0))

    def __add__(self, other: RiskSetSums) -> RiskSetSums:
        if not np.array_equal(self.grid, other.grid):
            raise ValueError("RiskSetSums on different grids: every site must use the server's grid")
        names = ("events", "event_weight", "event_x", "event_risk", "event_risk_x", "event_risk_xx",
                 "risk", "risk_x", "risk_xx")
        added = {k: getattr(self, k) + getattr(other, k) for k in names}
        return RiskSetSums(self.grid, self.n + other.n, **added)


#: The arrays of :class:`RiskSetSums` weighted by :math:`\phi_i` (the rest are counts and event sums).
RISK_WEIGHTED = ("event_risk", "event_risk_x", "event_risk_xx", "risk", "risk_x", "risk_xx")


def _cell_sums(cell: np.ndarray, values: np.ndarray, m: int) -> np.ndarray:
    """Row sums of ``values`` (n, k) per ``cell`` index in ``0..m-1`` → (m, k)."""
    member = sparse.csr_matrix((np.ones(cell.size), (cell, np.arange(cell.size))), shape=(m, cell.size))
    return np.asarray(member @ values)


def _weighted_moments(phi: np.ndarray, x: np.ndarray) -> np.ndarray:
    r"""Each record's :math:`(\phi_i, \phi_i x_i, \phi_i x_i x_i^\top)` as one row of length 1 + p + p²."""
    n, p = x.shape
    return np.concatenate(
        [phi[:, None], phi[:, None] * x, (phi[:, None, None] * x[:, :, None] * x[:, None, :]).reshape(n, p * p)],
        axis=1,
    )

def site_risk_set_sums(
    x: np.ndarray, time: np.ndarray, event: np.ndarray, beta: np.ndarray, grid: np.ndarray, *,
    weights: np.ndarray | None = None, log_scale: float | np.ndarray = 0.0,
) -> RiskSetSums:
    r"""One site's :class:`RiskSetSums` at ``beta`` on the shared ``grid``.

    Grid cells: an event at :math:`t` belongs to the smallest grid point :math:`\ge t` (tied
    there with the cell's other events); a censored record stays at risk at every grid point
    :math:`\le t`. Hence the risk set at :math:`\tau_k` is every record with time
    :math:`\ge \tau_k` plus the cell's own events. With ``grid`` = every distinct pooled event
    time (or any superset) the sums give exactly the pooled Efron likelihood; on a coarser
    grid events within a cell are treated as tied at its right edge and records censored
    inside the cell leave before its events (an approximation whose error shrinks with the
    cell width). One pass: records are binned by their last at-risk cell and the risk-set sums
    are reverse cumulative sums over cells.

    ``log_scale`` :math:`c` (one number, or one per grid point): cell :math:`k`'s
    :data:`RISK_WEIGHTED` sums are those of :math:`w_i e^{x_i^\top\beta - c_k}` (without forming
    :math:`e^{x^\top\beta}`, which may overflow). Efron's terms do not change when a cell's every
    :math:`\phi_i` takes a common factor: :meth:`RiskSetSums.rescaled` by :math:`c` undoes it.
    """
    t, e, w = survival_arrays(time, event, weights)
    x = _design(x, t.size)
    beta = _beta(beta, x.shape[1])
    grid = np.asarray(grid, dtype=np.float64)
    cell = grid_index(t, e, grid)
    keep = cell >= 0
    x, e, w, cell = x[keep], e[keep], w[keep], cell[keep]
    p = x.shape[1]
    m = grid.size
    scale = np.broadcast_to(np.asarray(log_scale, dtype=np.float64), grid.shape)
    lowest = float(scale.min()) if m else 0.0
    phi = w * np.exp(x @ beta - lowest)
    per_record = _weighted_moments(phi, x)
    leaving = _cell_sums(cell, per_record, m)
    risk = np.cumsum(leaving[::-1], axis=0)[::-1]
    tied = _cell_sums(cell[e], np.concatenate([np.ones((int(e.sum()), 1)), w[e, None], w[e, None] * x[e],
                                               per_record[e]], axis=1), m)
    if np.any(scale != lowest):  # each cell's own scale
        factor = np.exp(lowest - scale)[:, None]
        risk, tied[:, 2 + p :] = risk * factor, tied[:, 2 + p :] * factor
    return RiskSetSums(
        grid=grid,
        n=int(t.size),
        events=np.rint(tied[:, 0]).astype(np.int64),
        event_weight=tied[:, 1],
        event_x=tied[:, 2 : 2 + p],
        event_risk=tied[:, 2 + p],
        event_risk_x=tied[:, 3 + p : 3 + 2 * p],
        event_risk_xx=tied[:, 3 + 2 * p :].reshape(m, p, p),
        risk=risk[:, 0],
        risk_x=risk[:, 1 : 1 + p],
        risk_xx=risk[:, 1 + p :].reshape(m, p, p),
    )


def _efron_slots(total: RiskSetSums) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r"""Efron's per-event "slots": for cell k with :math:`d_k` events, slots
    :math:`l = 0..d_k-1` with fraction :math:`l/d_k`. Returns ``(cell, fraction, denominator,
    numerator)`` with :math:`S_0 - \tfrac{l}{d}\,T_0` and :math:`S_1 - \tfrac{l}{d}\,T_1`."""
    d = total.events
    cell = np.repeat(np.arange(d.size), d)
    first = np.repeat(np.cumsum(d) - d, d)
    fraction = (np.arange(cell.size) - first) / d[cell]
    denominator = total.risk[cell] - fraction * total.event_risk[cell]
    numerator = total.risk_x[cell] - fraction[:, None] * total.event_risk_x[cell]
    return cell, fraction, denominator, numerator


def pooled_newton_terms(total: RiskSetSums, beta: np.ndarray) -> Terms:
    r"""Efron log partial likelihood, score and information from the summed cell sums.

    Per cell with :math:`d` events, slots :math:`l = 0..d-1`,
    :math:`a_l = S_0 - \tfrac{l}{d} T_0`, :math:`b_l = S_1 - \tfrac{l}{d} T_1`,
    :math:`C_l = S_2 - \tfrac{l}{d} T_2` and :math:`\bar w = \sum_D w / d`:

    .. math::

        \ell = \textstyle\sum_D w x^\top\beta - \bar w \sum_l \log a_l, \quad
        U = \sum_D w x - \bar w \sum_l b_l / a_l, \quad
        I = \bar w \sum_l \bigl(C_l / a_l - b_l b_l^\top / a_l^2\bigr),

    summed over cells (lifelines' ``_get_efron_values``, including its weighted-ties rule).
    """
    beta = _beta(beta, total.risk_x.shape[1])
    cell, fraction, denominator, numerator = _efron_slots(total)
    if cell.size == 0:
        p = beta.size
        return 0.0, np.zeros(p), np.zeros((p, p))
    if np.any(denominator <= 0):
        raise ValueError("a cell has events but no risk: the summed RiskSetSums are inconsistent")
    mean_weight = (total.event_weight / np.maximum(total.events, 1))[cell]
    loglik = float(total.event_x.sum(0) @ beta - mean_weight @ np.log(denominator))
    ratio = numerator / denominator[:, None]
    score = total.event_x.sum(0) - mean_weight @ ratio
    m = total.events.size
    on_risk = np.bincount(cell, weights=mean_weight / denominator, minlength=m)
    on_ties = np.bincount(cell, weights=mean_weight * fraction / denominator, minlength=m)
    information = (
        np.einsum("k,kab->ab", on_risk, total.risk_xx)
        - np.einsum("k,kab->ab", on_ties, total.event_risk_xx)
        - (mean_weight[:, None] * ratio).T @ ratio
    )
    return loglik, score, information


def site_sums_stratified(
    x: np.ndarray,
    time: np.ndarray,
    event: np.ndarray,
    beta: np.ndarray,
    *,
    weights: np.ndarray | None = None,
) -> CoxSums:
    r"""One site's Efron log partial likelihood, score and information at ``beta`` within its
    own stratum (its own baseline hazard), exactly as lifelines computes one stratum.

    The sum over sites is the stratified likelihood of the pooled records with strata = sites.
    Reveals: the p + p² + 1 numbers, the number of records and the number of events. Handles
    ties, a site without events (all zero) and a single record.
    """
    t, e, w = survival_arrays(time, event, weights)
    x = _design(x, t.size)
    p = x.shape[1]
    beta = _beta(beta, p)
    if not e.any():
        return CoxSums(0.0, np.zeros(p), np.zeros((p, p)), int(t.size), 0)
    grid = np.unique(t[e])
    loglik, score, information = pooled_newton_terms(site_risk_set_sums(x, t, e, beta, grid, weights=w), beta)
    return CoxSums(loglik, score, information, int(t.size), int(e.sum()))


# --------------------------------------------------------------------------------------------
# Newton–Raphson


@dataclass(frozen=True, eq=False)
class NewtonResult:
    """Newton–Raphson outcome on the scale ``sums_at`` works in: ``beta``; the *penalised*
    ``loglik``, ``score`` and ``information`` there; ``loglik_null`` (unpenalised, at
    :math:`\\beta = 0`, when the run started there, else ``None``); ``steps``; ``converged``."""

    beta: np.ndarray
    loglik: float
    score: np.ndarray
    information: np.ndarray
    loglik_null: float | None
    steps: int
    converged: bool


def _penalised(terms: Terms, beta: np.ndarray, penalizer: np.ndarray) -> Terms:
    loglik, score, information = terms
    return (
        float(loglik - 0.5 * penalizer @ beta**2),
        np.asarray(score) - penalizer * beta,
        np.asarray(information) + np.diag(penalizer),
    )


def _newton_step(score: np.ndarray, information: np.ndarray, step: int, names: Sequence[str] = ()) -> np.ndarray:
    try:
        return linalg.solve(information, score, assume_a="pos")
    except (linalg.LinAlgError, ValueError) as error:
        raise ValueError(
            f"information matrix is not positive definite at Newton step {step}: "
            f"{_degenerate(information, names)} (or separate events completely); drop one or set penalizer > 0"
        ) from error


def _degenerate(information: np.ndarray, names: Sequence[str]) -> str:
    """The covariates of the information's flattest direction (its least eigenvalue's eigenvector, loadings at
    least a fifth of the largest; at most 6, largest first): those that are constant or collinear."""
    if len(names) != information.shape[0] or not np.all(np.isfinite(information)):
        return "a covariate is constant or collinear"
    vector = np.abs(np.linalg.eigh((information + information.T) / 2.0)[1][:, 0])
    loaded = [int(i) for i in np.argsort(-vector) if vector[i] >= 0.2 * vector.max()][:6]
    if len(loaded) == 1:
        return f"covariate {names[loaded[0]]} is constant"
    return f"covariates {', '.join(names[i] for i in loaded)} are collinear (one is a combination of the others)"


def newton_raphson(
    sums_at: Callable[[np.ndarray], Terms],
    p: int,
    *,
    penalizer: float | np.ndarray = 0.0,
    max_steps: int = 50,
    tol: float = 1e-12,
    init: np.ndarray | None = None,
    accepted: Callable[[np.ndarray], None] | None = None,
    names: Sequence[str] = (),
) -> NewtonResult:
    r"""Maximise :math:`\ell(\beta) - \tfrac12 \sum_j c_j \beta_j^2` by Newton–Raphson with
    step halving.

    ``sums_at(beta)`` returns ``(loglik, score, information)`` of the unpenalised model; in the
    federated case the server's callable asks every site for its sums and adds them (one
    round per call). ``penalizer`` is :math:`c` (scalar or per coefficient) on the scale
    ``sums_at`` works in; lifelines' ``CoxPHFitter(penalizer=c)`` is ``penalizer = c * n`` on
    standardised columns (see the module docstring). Each step solves
    :math:`I\,\delta = U`; the step is halved (at most 30 times) until the penalised
    log-likelihood does not decrease. Stops, converged, when the Newton decrement
    :math:`U^\top I^{-1} U / 2 < \text{tol}` (the log-likelihood gain the next step would
    bring; :math:`\beta` is then within about :math:`\sqrt{2\,\text{tol}}` standard errors of
    the optimum: 1.4e-6 at the default), without taking that step. Newton converges
    quadratically, so a smaller ``tol`` costs at most about one more round. A non-finite
    log-likelihood (``-inf`` from ``sums_at``: a trial it could not evaluate) counts as lower.
    ``accepted(beta)``, if given, is called with the start and then with each step's accepted
    :math:`\beta`, before the next call of ``sums_at`` (which is a trial step from it). ``names``, the
    covariates' names, lets the error for a singular information name the constant or collinear ones.
    """
    if p < 1:
        raise ValueError(f"p must be at least 1, got {p}")
    pen = np.broadcast_to(np.asarray(penalizer, dtype=np.float64), (p,)).copy()
    if np.any(pen < 0):
        raise ValueError("penalizer must be >= 0")
    beta = np.zeros(p) if init is None else _beta(init, p).copy()
    raw = sums_at(beta)
    loglik_null = float(raw[0]) if init is None or not np.any(beta) else None
    loglik, score, information = _penalised(raw, beta, pen)
    for step in range(1, max_steps + 1):
        if accepted is not None:
            accepted(beta)
        delta = _newton_step(score, information, step, names)
        if score @ delta / 2 < tol:
            return NewtonResult(beta, loglik, score, information, loglik_null, step - 1, True)
        size = 1.0
        for _ in range(31):
            trial = beta + size * delta
            terms = _penalised(sums_at(trial), trial, pen)
            if np.isfinite(terms[0]) and terms[0] >= loglik - 1e-12 * abs(loglik):
                break
            size /= 2
        else:
            return NewtonResult(beta, loglik, score, information, loglik_null, step, False)
        beta = trial
        loglik, score, information = terms
    return NewtonResult(beta, loglik, score, information, loglik_null, max_steps, False)


# --------------------------------------------------------------------------------------------
# Standardisation


@dataclass(frozen=True, eq=False)
class ColumnMoments:
    """Per-column record count, sum and sum of squares (additive over sites)."""

    n: int
    total: np.ndarray
    total_sq: np.ndarray

    def __add__(self, other: ColumnMoments) -> ColumnMoments:
        return ColumnMoments(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> np.ndarray:
        return self.total / self.n

    @property
    def std(self) -> np.ndarray:
        """Standard deviation with ``ddof=1`` (as pandas' ``DataFrame.std``)."""
        if self.n < 2:
            raise ValueError("standardising needs at least two records across all sites")
        var = (self.total_sq - self.n * self.mean**2) / (self.n - 1)
        return np.sqrt(np.maximum(var, 0.0))


def site_column_moments(x: np.ndarray) -> ColumnMoments:
    """One site's :class:`ColumnMoments` (reveals its record count and each column's sum and
    sum of squares, i.e. its column means and variances)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    return ColumnMoments(int(x.shape[0]), x.sum(0), (x**2).sum(0))


# --------------------------------------------------------------------------------------------
# Robust (sandwich) variance


def site_score_residual_sums(
    x: np.ndarray,
    time: np.ndarray,
    event: np.ndarray,
    beta: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    ties: Literal["breslow", "lifelines"] = "breslow",
) -> np.ndarray:
    r"""Stratified model: :math:`\sum_i r_i r_i^\top` (p, p) over the site's score residuals
    within its own stratum at the final ``beta``; the server adds them into the sandwich
    "meat" :math:`M` and forms :math:`V M V` with :math:`V` the inverse information.

    :math:`r_i = w_i\bigl[\delta_i (x_i - \bar x(t_i)) - \phi_i \sum_{t_k \le t_i}
    \tfrac{w_k \delta_k}{S_0(t_k)} (x_i - \bar x(t_k))\bigr]` with
    :math:`\phi_i = e^{x_i^\top\beta}`, :math:`\bar x = S_1 / S_0` (Lin & Wei 1989, Breslow
    form). ``ties="breslow"`` uses whole tied risk sets (order-free; equals lifelines when
    there are no ties). ``ties="lifelines"`` reproduces lifelines' ``robust=True`` exactly:
    records sorted stably by (time, event) and each treated as if alone at its position, so
    with ties the result depends on the input order of tied records.
    Reveals only this p × p matrix.
    """
    t, e, w = survival_arrays(time, event, weights)
    x = _design(x, t.size)
    beta = _beta(beta, x.shape[1])
    if ties == "breslow":
        grid = np.unique(t[e]) if e.any() else np.array([t.max()])
        total = site_risk_set_sums(x, t, e, beta, grid, weights=w)
        return site_score_residual_sums_pooled(x, t, e, beta, grid, *pooled_residual_terms(total), weights=w)
    if ties != "lifelines":
        raise ValueError(f"ties must be 'breslow' or 'lifelines', got {ties!r}")
    order = np.lexsort((e, t))
    x, e, w = x[order], e[order], w[order]
    phi = np.exp(x @ beta)
    s0 = np.cumsum((w * phi)[::-1])[::-1]
    mean = np.cumsum((w * phi)[::-1, None] * x[::-1], axis=0)[::-1] / s0[:, None]
    hazard = e * w / s0
    residual = e[:, None] * (x - mean) - phi[:, None] * (
        x * np.cumsum(hazard)[:, None] - np.cumsum(hazard[:, None] * mean, axis=0)
    )
    residual *= w[:, None]
    return residual.T @ residual


def pooled_residual_terms(total: RiskSetSums) -> tuple[np.ndarray, np.ndarray]:
    r"""What the server broadcasts for the pooled sandwich: per grid point the Breslow hazard
    increment :math:`\sum_D w / S_0` (m,) and the risk-weighted mean :math:`S_1 / S_0` (m, p)
    (zero where nobody is at risk). Reveals to every site the pooled baseline hazard
    increments and the pooled risk-weighted covariate means per grid point."""
    at_risk = total.risk > 0
    safe = np.where(at_risk, total.risk, 1.0)
    increment = np.where(at_risk, total.event_weight / safe, 0.0)
    mean = np.where(at_risk[:, None], total.risk_x / safe[:, None], 0.0)
    return increment, mean


def site_score_residual_sums_pooled(
    x: np.ndarray,
    time: np.ndarray,
    event: np.ndarray,
    beta: np.ndarray,
    grid: np.ndarray,
    hazard_increment: np.ndarray,
    mean_x: np.ndarray,
    *,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    r"""Pooled model: one site's :math:`\sum_i r_i r_i^\top` (p, p), with the Breslow-form
    score residuals of :func:`site_score_residual_sums` built on the pooled risk sets that the
    server broadcasts (:func:`pooled_residual_terms`, same ``grid``). Exact federated
    sandwich; equals lifelines' ``robust=True`` when no event time is tied (lifelines orders
    tied records by position, which would need the pooled ordering of records across sites).
    Reveals only this p × p matrix.
    """
    t, e, w = survival_arrays(time, event, weights)
    x = _design(x, t.size)
    beta = _beta(beta, x.shape[1])
    cell = grid_index(t, e, np.asarray(grid, dtype=np.float64))
    phi = np.exp(x @ beta)
    cum_hazard = np.concatenate([[0.0], np.cumsum(hazard_increment)])
    cum_hazard_mean = np.concatenate([np.zeros((1, x.shape[1])), np.cumsum(hazard_increment[:, None] * mean_x, 0)])
    upto = cell + 1
    own_mean = mean_x[np.maximum(cell, 0)]
    residual = e[:, None] * (x - own_mean) - phi[:, None] * (x * cum_hazard[upto][:, None] - cum_hazard_mean[upto])
    residual *= w[:, None]
    return residual.T @ residual


# --------------------------------------------------------------------------------------------
# Results


class LikelihoodRatioTest(NamedTuple):
    """The likelihood-ratio chi-squared test: ``statistic``, ``degrees_of_freedom``, ``p_value``."""

    statistic: float
    degrees_of_freedom: int
    p_value: float


@dataclass(frozen=True, eq=False)
class CoxResult:
    """A fitted Cox model per unit of the user's columns.

    ``params`` (coef), ``variance`` (model-based: inverse penalised information),
    ``robust_variance`` (sandwich, or ``None``), ``standard_errors`` (robust when available,
    as lifelines), ``log_likelihood`` (penalised, as lifelines' ``log_likelihood_``),
    ``log_likelihood_null`` (at β = 0), ``n``, ``events``, ``concordance`` (``None`` unless
    given), ``alpha``, ``converged``, ``steps``.
    """

    params: pd.Series
    variance: pd.DataFrame
    standard_errors: pd.Series
    log_likelihood: float
    log_likelihood_null: float | None
    n: int
    events: int
    robust_variance: pd.DataFrame | None = None
    concordance: float | None = None
    alpha: float = 0.05
    converged: bool = True
    steps: int = 0

    @classmethod
    def from_newton(
        cls,
        newton: NewtonResult,
        names: Sequence[str],
        std: np.ndarray | None = None,
        *,
        n: int,
        events: int,
        meat: np.ndarray | None = None,
        concordance: float | None = None,
        alpha: float = 0.05,
    ) -> CoxResult:
        """Result from a Newton run on columns divided by ``std`` (``None``: unscaled).
        ``meat`` is the summed :math:`\\sum r r^\\top` on that same scale (robust variance)."""
        names = list(names)
        scale = np.ones(len(names)) if std is None else np.asarray(std, dtype=np.float64)
        inverse = linalg.inv(newton.information)
        unscale = np.outer(scale, scale)
        variance = pd.DataFrame(inverse / unscale, index=names, columns=names)
        robust = None if meat is None else pd.DataFrame(inverse @ meat @ inverse / unscale, index=names, columns=names)
        chosen = variance if robust is None else robust
        index = pd.Index(names, name="covariate")
        return cls(
            params=pd.Series(newton.beta / scale, index=index, name="coef"),
            variance=variance,
            standard_errors=pd.Series(np.sqrt(np.diag(chosen.values)), index=index, name="se"),
            log_likelihood=newton.loglik,
            log_likelihood_null=newton.loglik_null,
            n=n,
            events=events,
            robust_variance=robust,
            concordance=concordance,
            alpha=alpha,
            converged=newton.converged,
            steps=newton.steps,
        )

    @property
    def hazard_ratios(self) -> pd.Series:
        return np.exp(self.params).rename("exp(coef)")

    @property
    def summary(self) -> pd.DataFrame:
        """lifelines' ``CoxPHFitter.summary`` columns: coef, exp(coef), se(coef), coef
        lower/upper, exp(coef) lower/upper, cmp to, z, p (two-sided normal), -log2(p)."""
        ci = f"{100 * (1 - self.alpha):g}%"
        z = stats.norm.ppf(1 - self.alpha / 2)
        coef, se = self.params, self.standard_errors
        frame = pd.DataFrame(index=coef.index)
        frame["coef"] = coef
        frame["exp(coef)"] = np.exp(coef)
        frame["se(coef)"] = se
        frame[f"coef lower {ci}"] = coef - z * se
        frame[f"coef upper {ci}"] = coef + z * se
        frame[f"exp(coef) lower {ci}"] = np.exp(coef - z * se)
        frame[f"exp(coef) upper {ci}"] = np.exp(coef + z * se)
        frame["cmp to"] = 0.0
        frame["z"] = coef / se
        frame["p"] = 2 * stats.norm.sf(np.abs(frame["z"]))
        with np.errstate(divide="ignore"):
            frame["-log2(p)"] = -np.log2(frame["p"])
        return frame

    def log_likelihood_ratio_test(self) -> LikelihoodRatioTest:
        """:math:`2(\\ell - \\ell_0)` against the model without covariates, on p degrees of
        freedom (lifelines' ``log_likelihood_ratio_test``: ℓ is the penalised value)."""
        if self.log_likelihood_null is None:
            raise ValueError("log_likelihood_null is unknown: start newton_raphson at beta = 0 to get it")
        statistic = 2 * (self.log_likelihood - self.log_likelihood_null)
        dof = int(self.params.size)
        return LikelihoodRatioTest(float(statistic), dof, float(stats.chi2.sf(statistic, dof)))

    def print_summary(self, decimals: int = 3) -> None:
        """Print the fit's size, log-likelihood, summary table and likelihood-ratio test."""
        print(f"Cox proportional hazards: {self.n} records, {self.events} events, "
              f"{'robust' if self.robust_variance is not None else 'model-based'} standard errors")
        print(f"partial log-likelihood = {self.log_likelihood:.{decimals}f}"
              f"{'' if self.converged else '  (Newton did not converge)'}")
        if self.concordance is not None:
            print(f"concordance = {self.concordance:.{decimals}f}")
        print(self.summary.to_string(float_format=lambda v: f"{v:.{decimals}f}"))
        if self.log_likelihood_null is not None:
            lr = self.log_likelihood_ratio_test()
            print(f"log-likelihood ratio test = {lr.statistic:.{decimals}f} on {lr.degrees_of_freedom} df, "
                  f"p = {lr.p_value:.3g}")


# --------------------------------------------------------------------------------------------
# Proportional-hazards test (scaled Schoenfeld residuals)


@dataclass(frozen=True, eq=False)
class SchoenfeldSums:
    r"""Additive sums over events :math:`k` of the transformed time :math:`g_k` and the
    Schoenfeld residual :math:`s_k` (p,): ``events`` (count), ``g_sum`` :math:`\sum g_k`,
    ``g_sq_sum`` :math:`\sum g_k^2`, ``residual_sum`` :math:`\sum s_k`, ``g_residual_sum``
    :math:`\sum g_k s_k`. Reveals these 2p + 3 numbers."""

    events: int
    g_sum: float
    g_sq_sum: float
    residual_sum: np.ndarray
    g_residual_sum: np.ndarray

    def __add__(self, other: SchoenfeldSums) -> SchoenfeldSums:
        return SchoenfeldSums(
            self.events + other.events,
            self.g_sum + other.g_sum,
            self.g_sq_sum + other.g_sq_sum,
            self.residual_sum + other.residual_sum,
            self.g_residual_sum + other.g_residual_sum,
        )


def efron_event_means(total: RiskSetSums) -> np.ndarray:
    r"""Per grid point the Efron-weighted covariate mean of the risk set,
    :math:`\tfrac1d \sum_{l=0}^{d-1} b_l / a_l` (m, p) (NaN without events): the expected
    covariate of an event there. Broadcast by the server for the pooled PH test; reveals the
    pooled mean per event time."""
    cell, _, denominator, numerator = _efron_slots(total)
    m, p = total.risk_x.shape
    sums = np.stack([np.bincount(cell, weights=numerator[:, j] / denominator, minlength=m) for j in range(p)], 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / np.where(total.events > 0, total.events, np.nan)[:, None]


def time_transform(
    time: np.ndarray,
    event: np.ndarray,
    transform: Literal["identity", "log", "rank", "km"],
    *,
    rank_offset: int = 0,
    km: pd.Series | None = None,
) -> np.ndarray:
    r"""The transformed time :math:`g` of each record (NaN for censored records), as lifelines'
    ``proportional_hazard_test(time_transform=...)`` defines it.

    ``identity`` :math:`t`; ``log`` :math:`\log t` (local: reveals nothing). ``km``
    :math:`1 - \hat S(t)` with ``km`` the pooled Kaplan–Meier survival indexed by time (from
    :mod:`models.km`; the server broadcasts the pooled survival curve at every event time).
    ``rank``: lifelines numbers events 1, 2, … in (stratum, time) order, so a site's event
    ranks are ``rank_offset`` (the number of events at the sites ordered before it, the only
    thing revealed) plus its own events' order by time (tied events in input order). For a
    pooled model with several sites, ``rank`` would need the pooled ordering of every event
    time (each site's event times relative to the others'): not offered.
    """
    t, e, _ = survival_arrays(time, event)
    g = np.full(t.size, np.nan)
    if transform == "identity":
        g[e] = t[e]
    elif transform == "log":
        g[e] = np.log(t[e])
    elif transform == "rank":
        events = np.flatnonzero(e)
        g[events[np.argsort(t[events], kind="stable")]] = rank_offset + np.arange(1, events.size + 1)
    elif transform == "km":
        if km is None:
            raise ValueError("transform='km' needs km: the pooled Kaplan-Meier survival indexed by time")
        times = np.asarray(km.index, dtype=np.float64)
        at = np.searchsorted(times, t[e], side="right") - 1
        g[e] = 1 - np.where(at >= 0, np.asarray(km.values, dtype=np.float64)[np.maximum(at, 0)], 1.0)
    else:
        raise ValueError(f"transform must be 'identity', 'log', 'rank' or 'km', got {transform!r}")
    return g


def site_schoenfeld_sums(
    x: np.ndarray,
    time: np.ndarray,
    event: np.ndarray,
    beta: np.ndarray,
    g: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    grid: np.ndarray | None = None,
    event_means: np.ndarray | None = None,
) -> SchoenfeldSums:
    r"""One site's :class:`SchoenfeldSums` at the final ``beta``.

    Schoenfeld residual of event :math:`k`: :math:`s_k = x_k - \bar x_E(t_k)`, the Efron mean
    of :func:`efron_event_means`. Stratified model (``grid=None``): the mean over the site's
    own risk set. Pooled model: the server's broadcast ``event_means`` on ``grid``.
    ``g``: the transformed time per record (:func:`time_transform`).
    """
    t, e, w = survival_arrays(time, event, weights)
    x = _design(x, t.size)
    beta = _beta(beta, x.shape[1])
    g = np.asarray(g, dtype=np.float64)
    if g.shape != t.shape or not np.all(np.isfinite(g[e])):
        raise ValueError("g must give a finite transformed time for every event: use time_transform")
    if grid is None:
        grid = np.unique(t[e]) if e.any() else np.array([t.max()])
        event_means = efron_event_means(site_risk_set_sums(x, t, e, beta, grid, weights=w))
    elif event_means is None:
        raise ValueError("a pooled grid needs event_means: broadcast efron_event_means of the summed sums")
    cell = grid_index(t, e, np.asarray(grid, dtype=np.float64))
    resid = x[e] - np.asarray(event_means)[cell[e]]
    return SchoenfeldSums(int(e.sum()), float(g[e].sum()), float((g[e] ** 2).sum()), resid.sum(0), g[e] @ resid)


def proportional_hazard_test(
    total: SchoenfeldSums,
    variance: np.ndarray,
    standard_errors: np.ndarray,
    names: Sequence[str] | None = None,
) -> pd.DataFrame:
    r"""Per-covariate test of proportional hazards from the summed :class:`SchoenfeldSums`
    (lifelines' ``proportional_hazard_test``, Grambsch–Therneau with the approximation that
    scales residuals by :math:`D\,V`).

    With :math:`D` events, :math:`\bar g = \sum g / D`, :math:`Q = \sum g^2 - D \bar g^2` and
    :math:`a = \sum g s - \bar g \sum s`,

    .. math::

        T_j = \frac{D\,\bigl((a^\top V)_j\bigr)^2}{\mathrm{se}_j^2\, Q} \sim \chi^2_1,

    ``variance`` :math:`V` the model-based variance and ``standard_errors`` the reported ones
    (robust when the fit was robust, as lifelines), on the same column scale as ``x``.
    Returns a DataFrame with ``test_statistic``, ``p``, ``-log2(p)`` per covariate.
    """
    d = total.events
    if d < 2:
        raise ValueError("the proportional-hazards test needs at least two events")
    g_mean = total.g_sum / d
    spread = total.g_sq_sum - d * g_mean**2
    if spread <= 0:
        raise ValueError("the transformed event times are all equal: choose another time_transform")
    a = total.g_residual_sum - g_mean * total.residual_sum
    statistic = d * (a @ np.asarray(variance)) ** 2 / (np.asarray(standard_errors) ** 2 * spread)
    p = stats.chi2.sf(statistic, 1)
    index = pd.Index(list(names) if names is not None else range(statistic.size), name="covariate")
    with np.errstate(divide="ignore"):
        return pd.DataFrame({"test_statistic": statistic, "p": p, "-log2(p)": -np.log2(p)}, index=index)


# --------------------------------------------------------------------------------------------
# In-process federation (the server loop with every site's records at hand)


@dataclass(frozen=True, eq=False)
class SiteData:
    """One site's records: covariates ``x`` (n, p), ``time``, ``event`` and optional
    ``weights``."""

    x: np.ndarray
    time: np.ndarray
    event: np.ndarray
    weights: np.ndarray | None = None


def _standardise(sites: Sequence[SiteData]) -> tuple[list[SiteData], ColumnMoments]:
    """Sites' columns standardised with the pooled mean and std (ddof=1), as lifelines."""
    if not sites:
        raise ValueError("sites is empty: pass at least one SiteData")
    moments = sum((site_column_moments(s.x) for s in sites[1:]), site_column_moments(sites[0].x))
    std = moments.std
    if np.any(std == 0):
        raise ValueError(f"columns {np.flatnonzero(std == 0).tolist()} are constant across all sites: drop them")
    scaled = [SiteData((np.asarray(s.x, float).reshape(len(s.time), -1) - moments.mean) / std, s.time, s.event,
                       s.weights) for s in sites]
    return scaled, moments


def fit_stratified(
    sites: Sequence[SiteData],
    names: Sequence[str],
    *,
    penalizer: float = 0.0,
    robust: bool = False,
    ties: Literal["breslow", "lifelines"] = "breslow",
    alpha: float = 0.05,
) -> CoxResult:
    """Stratified-by-site Cox fit run in one process, as the federated server would: equals
    lifelines' ``CoxPHFitter(penalizer=penalizer).fit(df, strata=["site"], robust=robust)``.
    ``ties`` picks the score residuals of the robust variance
    (:func:`site_score_residual_sums`)."""
    scaled, moments = _standardise(sites)

    def sums_at(beta: np.ndarray) -> Terms:
        parts = [site_sums_stratified(s.x, s.time, s.event, beta, weights=s.weights) for s in scaled]
        return sum(parts[1:], parts[0]).terms()

    newton = newton_raphson(sums_at, len(names), penalizer=penalizer * moments.n, names=names)
    meat = None
    if robust:
        meat = sum(site_score_residual_sums(s.x, s.time, s.event, newton.beta, weights=s.weights, ties=ties)
                   for s in scaled)
    events = int(sum(np.asarray(s.event, bool).sum() for s in sites))
    return CoxResult.from_newton(newton, names, moments.std, n=moments.n, events=events, meat=meat, alpha=alpha)


def _pooled_grid(sites: Sequence[SiteData], grid: np.ndarray | None) -> np.ndarray:
    """The shared grid: as given, else every distinct pooled event time."""
    if grid is not None:
        return np.asarray(grid, dtype=np.float64)
    times = np.concatenate([np.asarray(s.time, float)[np.asarray(s.event, bool)] for s in sites])
    return np.unique(times)


def fit_pooled(
    sites: Sequence[SiteData],
    names: Sequence[str],
    *,
    grid: np.ndarray | None = None,
    penalizer: float = 0.0,
    robust: bool = False,
    alpha: float = 0.05,
) -> CoxResult:
    """Pooled Cox fit (one baseline hazard) run in one process on the shared ``grid`` (default:
    every distinct pooled event time, where it equals lifelines' ``CoxPHFitter`` on the pooled
    records). ``robust`` uses :func:`site_score_residual_sums_pooled`."""
    scaled, moments = _standardise(sites)
    cells = _pooled_grid(sites, grid)

    def total_at(beta: np.ndarray) -> RiskSetSums:
        parts = [site_risk_set_sums(s.x, s.time, s.event, beta, cells, weights=s.weights) for s in scaled]
        return sum(parts[1:], parts[0])

    newton = newton_raphson(lambda b: pooled_newton_terms(total_at(b), b), len(names),
                            penalizer=penalizer * moments.n, names=names)
    meat = None
    if robust:
        broadcast = pooled_residual_terms(total_at(newton.beta))
        meat = sum(site_score_residual_sums_pooled(s.x, s.time, s.event, newton.beta, cells, *broadcast,
                                                   weights=s.weights) for s in scaled)
    events = int(sum(np.asarray(s.event, bool).sum() for s in sites))
    return CoxResult.from_newton(newton, names, moments.std, n=moments.n, events=events, meat=meat, alpha=alpha)


def _km_series(sites: Sequence[SiteData]) -> pd.Series:
    """Pooled Kaplan–Meier survival (weighted as the fit) from the sites' counts."""
    counts = [site_km_counts(s.time, s.event, weights=s.weights) for s in sites]
    return kaplan_meier(combine_km_counts(counts))["survival"]


def _standard_scale(
    sites: Sequence[SiteData], result: CoxResult
) -> tuple[list[SiteData], np.ndarray, np.ndarray, np.ndarray]:
    """Standardised sites with ``result``'s coefficients, variance and standard errors on that
    scale (the PH statistic does not depend on the column scale; this keeps exp(xβ) tame)."""
    scaled, moments = _standardise(sites)
    std = moments.std
    variance = result.variance.values * np.outer(std, std)
    return scaled, result.params.values * std, variance, result.standard_errors.values * std


def ph_test_stratified(
    sites: Sequence[SiteData],
    result: CoxResult,
    transform: Literal["identity", "log", "rank", "km"] = "rank",
) -> pd.DataFrame:
    """Proportional-hazards test of a stratified fit, run in one process: equals lifelines'
    ``proportional_hazard_test(cph, df, time_transform)`` for ``CoxPHFitter(strata=["site"])``
    when ``sites`` are in the order of their stratum labels (which fixes lifelines' ranks)."""
    scaled, beta, variance, se = _standard_scale(sites, result)
    km = _km_series(sites) if transform == "km" else None
    parts, offset = [], 0
    for s in scaled:
        g = time_transform(s.time, s.event, transform, rank_offset=offset, km=km)
        parts.append(site_schoenfeld_sums(s.x, s.time, s.event, beta, g, weights=s.weights))
        offset += parts[-1].events
    total = sum(parts[1:], parts[0])
    return proportional_hazard_test(total, variance, se, result.params.index)


def ph_test_pooled(
    sites: Sequence[SiteData],
    result: CoxResult,
    transform: Literal["identity", "log", "km"] = "km",
    *,
    grid: np.ndarray | None = None,
) -> pd.DataFrame:
    """Proportional-hazards test of a pooled fit, run in one process: the server broadcasts
    :func:`efron_event_means` of the summed :class:`RiskSetSums` at the final β (and, for
    ``km``, the pooled Kaplan–Meier curve); equals lifelines' ``proportional_hazard_test`` on
    ``CoxPHFitter()`` with the default grid. ``rank`` is not offered (see
    :func:`time_transform`)."""
    if transform == "rank":
        raise ValueError("transform='rank' needs the pooled ordering of event times: use 'km', 'identity' or 'log'")
    scaled, beta, variance, se = _standard_scale(sites, result)
    cells = _pooled_grid(sites, grid)
    parts = [site_risk_set_sums(s.x, s.time, s.event, beta, cells, weights=s.weights) for s in scaled]
    means = efron_event_means(sum(parts[1:], parts[0]))
    km = _km_series(sites) if transform == "km" else None
    sums = [site_schoenfeld_sums(s.x, s.time, s.event, beta,
                                 time_transform(s.time, s.event, transform, km=km),
                                 weights=s.weights, grid=cells, event_means=means) for s in scaled]
    total = sum(sums[1:], sums[0])
    return proportional_hazard_test(total, variance, se, result.params.index)
