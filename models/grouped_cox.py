r"""Differentially private Cox regression for a federation of small centres: the grouped-time model.

Model
-----
The grouped-time proportional-hazards model (Prentice & Gloeckler 1978; Kalbfleisch & Prentice,
*The Statistical Analysis of Failure Time Data*, 2nd ed., §4.6). A public grid
:math:`0 = \tau_0 < \tau_1 < \dots < \tau_T` cuts follow-up into intervals
:math:`I_j = (\tau_{j-1}, \tau_j]`; the hazard of record :math:`i` in interval :math:`j` is

.. math::

    h_{ij} = 1 - \exp\bigl(-\exp(\alpha_j + u_i^\top\beta)\bigr)
    \quad\text{(complementary log-log link)},

which is exactly the continuous-time PH model :math:`\lambda(t \mid u) = \lambda_0(t)\,e^{u^\top\beta}`
observed on the grid (:math:`\alpha_j = \log\int_{I_j}\lambda_0`): :math:`\beta` are the log hazard
ratios of the continuous model. Parameters :math:`\theta = (\alpha_1..\alpha_T, \beta_1..\beta_p)`.

Grid convention (:func:`models.km.grid_index`): an event at :math:`t` rounds **up** to the interval
containing it; a censoring at :math:`t` rounds **down**: the record is at risk in the intervals
that end at or before :math:`t` (a record censored inside :math:`I_j` leaves before :math:`I_j`'s
events, as in Cox's risk sets on a grid of every event time). :math:`\kappa_i` is the number of
intervals record :math:`i` is at risk in (intervals :math:`1..\kappa_i`), with its event, if any,
in interval :math:`\kappa_i`. Times after :math:`\tau_T` are censored at :math:`\tau_T` (the end of
follow-up: put :math:`\tau_T` where records are still at risk, or the last interval's hazard is 1);
an event at or before :math:`\tau_0` is refused.

Covariates are mapped into :math:`[-1, 1]` by agreed public ranges, clipped, and centred by a
public centre (:class:`GroupedCoxDesign`); :meth:`GroupedCoxFit.beta` reports :math:`\beta` per unit
of the user's columns.

Per-record terms (closed form, vectorised over records)
-------------------------------------------------------
With :math:`\mu_{ij} = e^{\alpha_j + u_i^\top\beta}`, :math:`y_{ij} = 1` in the event's interval and
:math:`z_{ij} = (e_j, u_i)`:

.. math::

    \ell_i = \sum_{j \le \kappa_i} y_{ij}\log(1 - e^{-\mu_{ij}}) - (1 - y_{ij})\,\mu_{ij}, \qquad
    g_i = \sum_{j \le \kappa_i} s_{ij} z_{ij}, \qquad H_i = \sum_{j \le \kappa_i} w_{ij} z_{ij} z_{ij}^\top,

:math:`s_{ij} = y_{ij}\,\mu/(e^{\mu} - 1) - (1 - y_{ij})\,\mu`. The private fit uses the
**expected** information (Fisher scoring): :math:`w = \mu^2/(e^\mu - 1) \in [0, 0.648]`, the
information of each at-risk interval's Bernoulli trial, which does not depend on the outcome;
``observed`` (the negative Hessian, :math:`w = \mu` for :math:`y = 0` and
:math:`\mu(\mu - 1 + e^{-\mu})e^{-\mu}/(1 - e^{-\mu})^2` for :math:`y = 1`) is offered for checks.
A record's information is released as its *packed* vector of distinct entries
(:func:`pack_layout`: the T diagonal αα entries, the T × p αβ block, the ββ upper triangle; every
other entry of :math:`H_i` is 0), whose L2 norm is at most :math:`\lVert H_i\rVert_F`.

Outcome-blind clipping and sensitivity
--------------------------------------
Clipping a score by its realised norm biases the estimating equation: the records clipped are
the high-risk ones with long follow-up, whose large negative residuals would be shrunk (measured:
up to 1.4 standard errors on β). Here the clip never looks at the outcome. Each record gets, from
its covariates and the public θ and bounds only, a **horizon** :math:`J_i` (it counts as censored
after interval :math:`J_i`) and a **weight** :math:`c_i \le 1` such that *every* outcome it could
have up to :math:`J_i` gives :math:`\lVert c_i g_i / c\rVert \le 1`, :math:`c` the public per-entry
bounds (:class:`ClipBounds`, :func:`record_bounds`). Censoring that depends on covariates only is
independent censoring, and a covariate-dependent weight keeps a score's mean 0, so the released
score sum is an unbiased estimating function at the true θ. The information is released with the
same horizon and weight times an outcome-blind factor (:func:`information_factor`) that keeps its
normalised norm at most 1. Under **add/remove-one record** adjacency each release therefore moves
by at most 1 in its normalised norm :math:`\lVert\Delta/c\rVert` (in the original units: by at
most :math:`c` entry-wise weighted, e.g. :math:`\lVert\Delta S_g\rVert \le \max_e c_e`), and
:math:`N(0, z^2 c_e^2)` on every entry :math:`e` is a Gaussian mechanism of noise multiplier
:math:`z`. The count release (:func:`site_counts`: one record adds 1 to one of 2T cells) has L2
sensitivity 1. A site's releases are functions of its own records and the public values only
(:func:`site_release`, :func:`site_count_release`); the server's steps are functions of the sums
(:func:`start_from_counts`, :func:`newton_update`, :func:`information_estimate`,
:func:`private_covariance`).

Noise and accounting
--------------------
:class:`NoisePlan`: Gaussian releases without subsampling, release :math:`k` of multiplier
:math:`z_k = z/\sqrt{\rho_k}` with shares :math:`\sum_k \rho_k = 1`; their composition is exactly
one Gaussian mechanism of multiplier :math:`(\sum_k 1/z_k^2)^{-1/2} = z` (Dong, Roth & Su 2022,
Cor. 3.3), so :math:`z` is calibrated for one Gaussian release at the target
:math:`(\varepsilon, \delta)` by the project's accountant; :mod:`models` does not import
:mod:`strategies`, so the caller does it (``benchmarks.dp_cox_coverage.calibrate_plan``) and
:meth:`NoisePlan.history` is the accountant's input. Two settings: ``sum`` (``distributed_dp``'s):
one Gaussian on the summed releases, which the sites add as shares of variance
:math:`z_k^2 c^2 / K` through secure aggregation; ``per_site`` (``dp_sgd``'s): every site adds the
full :math:`N(0, z_k^2 c^2)` to its own sums, and the summed noise has :math:`K` times the variance.

Estimator
---------
Noisy counts give :math:`\alpha^{(0)}_j = \log(-\log(1 - \hat d_j/\hat n_j))` (or, where the
counts are too noisy for each interval's own hazard, the maximiser of their penalised likelihood,
:func:`smoothed_alpha_start`), :math:`\beta^{(0)} = 0` and a public information :math:`R`
(:func:`count_information`: the expected information as if β = 0 and every risk set had the
covariates' public centre and spreads). Each step releases the outcome-blind score sum at θ and
moves :math:`\theta \leftarrow \theta + (R + L)^{-1}(\hat S_g - L\theta)`, :math:`L = \lambda
D^\top D` a second-difference penalty on the α's (:func:`smoothing_penalty`: each interval's
baseline borrows from its neighbours, which keeps the noisy α's, and with them the horizons,
sane), each α's move optionally cut to a trust region (:attr:`PrivateSettings.max_alpha_move`). A
noisy released information was measured worse as the step's matrix (its noise maps the score's
noise into wild steps); the information is released once, at the final θ, for the covariance.

Covariance
----------
:func:`private_covariance`, post-processing of released values only: the delta method carried
through every step (:func:`propagated_covariance`): the sampling part :math:`G^{-1}HG^{-1}`
(:math:`G = H + L`, model-based :math:`\mathrm{Var}\,u = H`) plus each step's known score-noise
covariance, carried to the end through :math:`A_k = I - P_k^{-1}G`, with :math:`H` the released
information, its αβ block smoothed over the intervals and debiased (:func:`smoothed_information`)
and floored relative to its own diagonal (:func:`information_estimate`), then a parametric bootstrap over the
released information removes the upward bias the noisy :math:`H` gives the variances. The delta
method of the last step alone (:func:`delta_method_covariance`, :math:`\hat H^{-1}(\hat H +
\Sigma_\xi)\hat H^{-1}`) is offered; it ignores how the earlier steps' noise propagates and was
measured too wide here. Coverage and widths: ``docs/dp-cox.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

from models.km import grid_index

__all__ = [
    "COUNTS",
    "INFORMATION",
    "SCORE",
    "ALPHA_RANGE",
    "ClipBounds",
    "GroupedCoxDesign",
    "GroupedCoxFit",
    "NoisePlan",
    "PrivateServer",
    "PrivateSettings",
    "PrivateTrace",
    "RECIPES",
    "Recipe",
    "SiteRecords",
    "SiteStep",
    "alpha_start",
    "clip_factors",
    "count_information",
    "delta_method_covariance",
    "fit_exact",
    "fit_private",
    "floor_information",
    "information_estimate",
    "information_factor",
    "information_matrix",
    "newton_update",
    "pack_layout",
    "prepare_site",
    "private_covariance",
    "propagated_covariance",
    "record_bounds",
    "record_information",
    "record_loglik",
    "record_score",
    "run_private",
    "site_count_release",
    "site_counts",
    "site_release",
    "site_step",
    "smoothed_alpha_start",
    "smoothed_information",
    "smoothing_penalty",
    "start_from_counts",
    "truncate",
]

InformationKind = Literal["expected", "observed"]
Setting = Literal["sum", "per_site"]

#: Hazards of the starting values are kept in [HAZARD_FLOOR, 1 - HAZARD_FLOOR].
HAZARD_FLOOR = 1e-3
#: The private iterates' α are kept in this range (interval hazards from 1e-5 to 1 - 1e-5).
ALPHA_RANGE = (float(np.log(-np.log1p(-1e-5))), float(np.log(-np.log(1e-5))))


# --------------------------------------------------------------------------------------------
# Public design and a site's records


@dataclass(frozen=True, eq=False)
class GroupedCoxDesign:
    r"""The public values every site is sent: the grid ``(τ_0 = 0 < … < τ_T)``, each covariate's
    agreed range ``(low, high)`` (``low < high``) and optional ``center`` (a public value per
    column in its units, e.g. an agreed or noisy mean; default the range's midpoint), with the
    columns' ``names`` and ``scales``: a public spread of each column on the scale of :math:`u`
    (e.g. its standard deviation from the set-up's noisy moments; default 1), which sets the clip
    bounds' shape (:meth:`ClipBounds.from_scalars`) and the start's information
    (:func:`count_information`). A covariate is used as :math:`u = \mathrm{clip}(2(x - low)/(high - low) - 1,
    -1, 1) - c`, :math:`c` the center on the same scale: centring changes the α's, not β, and
    makes the αβ information small (see :class:`ClipBounds`)."""

    grid: np.ndarray
    low: np.ndarray
    high: np.ndarray
    names: tuple[str, ...] = ()
    center: np.ndarray | None = None
    scales: np.ndarray | None = None

    def __post_init__(self) -> None:
        grid = np.asarray(self.grid, dtype=np.float64)
        low, high = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (self.low, self.high))
        if grid.ndim != 1 or grid.size < 2 or grid[0] != 0 or np.any(np.diff(grid) <= 0) or not np.all(
                np.isfinite(grid)):
            raise ValueError("grid must be finite, strictly increasing, start at 0 and have at least 2 points")
        if low.shape != high.shape or low.size == 0 or not np.all(np.isfinite(low) & np.isfinite(high) & (low < high)):
            raise ValueError("low and high must be finite, one per covariate, with low < high")
        center = (low + high) / 2.0 if self.center is None else np.asarray(self.center, dtype=np.float64).reshape(-1)
        if center.shape != low.shape or not np.all((low <= center) & (center <= high)):
            raise ValueError("center must give one value per covariate, inside its range")
        scales = np.ones(low.size) if self.scales is None else np.asarray(self.scales, dtype=np.float64).reshape(-1)
        if scales.shape != low.shape or not np.all(np.isfinite(scales) & (scales > 0)):
            raise ValueError("scales must give one finite positive number per covariate")
        names = tuple(self.names) or tuple(f"x{j}" for j in range(low.size))
        if len(names) != low.size:
            raise ValueError(f"names must give one name per covariate ({low.size}), got {len(names)}")
        for name, value in (("grid", grid), ("low", low), ("high", high), ("names", names), ("center", center),
                            ("scales", scales)):
            object.__setattr__(self, name, value)

    @property
    def intervals(self) -> int:
        """T, the number of intervals (one α each)."""
        return self.grid.size - 1

    @property
    def covariates(self) -> int:
        """p, the number of covariates (one β each)."""
        return self.low.size

    @property
    def dim(self) -> int:
        """T + p, the length of θ and of a score."""
        return self.intervals + self.covariates

    def _unit(self, x: np.ndarray) -> np.ndarray:
        return 2.0 * (x - self.low) / (self.high - self.low) - 1.0

    def scale(self, x: np.ndarray) -> np.ndarray:
        """``x`` (n, p) as the model's :math:`u`: mapped by ``(low, high) → (-1, 1)``, clipped into
        ``[-1, 1]``, minus the center's image; every entry lies in [-2, 2]."""
        x = np.asarray(x, dtype=np.float64)
        x = x[:, None] if x.ndim == 1 else x
        if x.ndim != 2 or x.shape[1] != self.covariates or not np.all(np.isfinite(x)):
            raise ValueError(f"x must be a finite (n, {self.covariates}) matrix, got shape {x.shape}")
        return np.clip(self._unit(x), -1.0, 1.0) - self._unit(self.center)

    def per_unit(self) -> np.ndarray:
        """The factor (p,) taking β on :math:`u` to β per unit of the user's columns."""
        return 2.0 / (self.high - self.low)


@dataclass(frozen=True, eq=False)
class SiteRecords:
    """One site's records as the model sees them: covariates ``u`` (n, p) (scaled, clipped, centred),
    ``at_risk`` κ (n,) the number of intervals each is at risk in (0..T) and ``event`` (n,)."""

    u: np.ndarray
    at_risk: np.ndarray
    event: np.ndarray
    intervals: int

    @property
    def n(self) -> int:
        return int(self.at_risk.size)


def prepare_site(design: GroupedCoxDesign, x: np.ndarray, time: np.ndarray, event: np.ndarray) -> SiteRecords:
    """A site's :class:`SiteRecords` from its raw covariates, times and 0/1 events (grid convention
    of the module docstring; times after τ_T censored at τ_T). ``ValueError`` on an event at or
    before τ_0, non-finite or negative times, or a shape mismatch."""
    t = np.asarray(time, dtype=np.float64).reshape(-1)
    e = np.asarray(event).reshape(-1)
    if e.shape != t.shape or not np.all(np.isfinite(t)) or np.any(t < 0) or not np.all(np.isin(e, (0, 1))):
        raise ValueError("time must be finite and >= 0, event 0/1, both 1-D of one length")
    e = e.astype(bool)
    if np.any(e & (t <= design.grid[0])):
        raise ValueError("an event at or before the grid's first point tau_0: events must come after it")
    end = design.grid[-1]
    e = e & (t <= end)
    t = np.minimum(t, end)
    u = design.scale(x)
    if u.shape[0] != t.size:
        raise ValueError(f"x has {u.shape[0]} rows but time has {t.size}")
    kappa = grid_index(t, e, design.grid)
    return SiteRecords(u=u, at_risk=kappa.astype(np.int64), event=e, intervals=design.intervals)


# --------------------------------------------------------------------------------------------
# Per-record log-likelihood, score and information


def _split(theta: np.ndarray, records: SiteRecords) -> tuple[np.ndarray, np.ndarray]:
    theta = np.asarray(theta, dtype=np.float64).reshape(-1)
    t, p = records.intervals, records.u.shape[1]
    if theta.size != t + p or not np.all(np.isfinite(theta)):
        raise ValueError(f"theta must be finite with T + p = {t + p} entries, got {theta.size}")
    return theta[:t], theta[t:]


def _person_period(records: SiteRecords, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``(mask, y, mu)``, each (n, T): at risk, event indicator and :math:`\mu_{ij}` (0 off the mask)."""
    alpha, beta = _split(theta, records)
    columns = np.arange(records.intervals)
    mask = columns[None, :] < records.at_risk[:, None]
    y = mask & records.event[:, None] & (columns[None, :] == records.at_risk[:, None] - 1)
    mu = np.where(mask, np.exp(np.minimum(alpha[None, :] + (records.u @ beta)[:, None], 700.0)), 0.0)
    return mask, y, mu


def _one_minus_exp(mu: np.ndarray) -> np.ndarray:
    r""":math:`1 - e^{-\mu}` without cancellation."""
    return -np.expm1(-mu)


def record_loglik(records: SiteRecords, theta: np.ndarray) -> np.ndarray:
    r"""Each record's log-likelihood :math:`\ell_i(\theta)` (n,)."""
    _, y, mu = _person_period(records, theta)
    with np.errstate(divide="ignore"):
        event_term = np.log(np.where(y, _one_minus_exp(mu), 1.0))
    return (event_term - np.where(y, 0.0, mu)).sum(axis=1)


def _event_slope(mu: np.ndarray) -> np.ndarray:
    r""":math:`\mu/(e^\mu - 1)` (1 at 0), stable for large :math:`\mu`."""
    with np.errstate(invalid="ignore", divide="ignore"):
        value = mu * np.exp(-mu) / _one_minus_exp(mu)
    return np.where(mu > 1e-12, value, 1.0 - mu / 2.0)


def record_score(records: SiteRecords, theta: np.ndarray) -> np.ndarray:
    r"""Each record's score :math:`g_i = \partial\ell_i/\partial\theta` (n, T + p), α first."""
    _, y, mu = _person_period(records, theta)
    s = np.where(y, _event_slope(mu), -mu)
    return np.concatenate([s, records.u * s.sum(axis=1, keepdims=True)], axis=1)


def _weights(y: np.ndarray, mu: np.ndarray, kind: InformationKind) -> np.ndarray:
    r"""Per person-period information weight :math:`w_{ij}` (0 off the risk set, where :math:`\mu = 0`)."""
    if kind == "expected":
        return mu * _event_slope(mu)
    if kind != "observed":
        raise ValueError(f"information must be 'expected' or 'observed', got {kind!r}")
    small = mu < 1e-4
    excess = np.where(small, mu**2 / 2 - mu**3 / 6 + mu**4 / 24, mu + np.expm1(-mu))  # mu - 1 + e^{-mu}
    with np.errstate(invalid="ignore", divide="ignore"):
        event_weight = np.where(mu > 0, mu * excess * np.exp(-mu) / _one_minus_exp(mu) ** 2, 0.0)
    return np.where(y, event_weight, mu)


def pack_layout(intervals: int, covariates: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column (in θ's order) of each entry of the packed information: the T diagonal αα
    entries, then the αβ block row by row (T × p), then the ββ upper triangle row by row."""
    t, p = intervals, covariates
    diag = np.arange(t)
    cross_rows, cross_cols = np.repeat(diag, p), t + np.tile(np.arange(p), t)
    upper_rows, upper_cols = np.triu_indices(p)
    return (np.concatenate([diag, cross_rows, t + upper_rows]),
            np.concatenate([diag, cross_cols, t + upper_cols]))


def record_information(records: SiteRecords, theta: np.ndarray, kind: InformationKind = "expected") -> np.ndarray:
    """Each record's packed information (n, T + T·p + p(p+1)/2) in :func:`pack_layout`'s order."""
    _, y, mu = _person_period(records, theta)
    w = _weights(y, mu, kind)
    u = records.u
    n, p = u.shape
    upper = np.triu_indices(p)
    outer = (u[:, :, None] * u[:, None, :])[:, upper[0], upper[1]]
    cross = (w[:, :, None] * u[:, None, :]).reshape(n, -1)
    return np.concatenate([w, cross, w.sum(axis=1, keepdims=True) * outer], axis=1)


def information_matrix(packed: np.ndarray, intervals: int, covariates: int) -> np.ndarray:
    """The symmetric (T + p, T + p) information of a packed vector (one record's or a sum)."""
    rows, cols = pack_layout(intervals, covariates)
    packed = np.asarray(packed, dtype=np.float64).reshape(-1)
    if packed.size != rows.size:
        raise ValueError(f"packed information must have {rows.size} entries, got {packed.size}")
    matrix = np.zeros((intervals + covariates,) * 2)
    matrix[rows, cols] = packed
    matrix[cols, rows] = packed
    return matrix


# --------------------------------------------------------------------------------------------
# Clip bounds and a site's releases


@dataclass(frozen=True, eq=False)
class ClipBounds:
    r"""Public per-entry bounds :math:`c` of a record's score (T + p,) and packed information
    (:func:`pack_layout`), and which information entries are ``released`` (the others are not
    sent and count as 0). Each record's release is scaled, outcome-blind, so that its normalised
    norm :math:`\lVert r_i/c\rVert` is at most 1 (:func:`record_bounds`): the released sum moves by
    at most 1 in the norm :math:`\lVert\Delta/c\rVert` when one record is added or removed, and its
    noise is :math:`N(0, z^2 c_e^2)` on entry :math:`e`."""

    score: np.ndarray
    information: np.ndarray
    released: np.ndarray

    @classmethod
    def from_scalars(cls, design: GroupedCoxDesign, *, score_alpha: float, score_beta: float, info_diag: float,
                     info_cross: float | None, info_beta: float) -> ClipBounds:
        r"""Bounds from five numbers and the design's ``scales`` :math:`s`: score :math:`(C_\alpha 1_T, C_\beta s)`,
        information :math:`C_{\alpha\alpha}` on the αα
        diagonal, :math:`C_{\alpha\beta} s_k` on the αβ entries (``None``: the αβ block is not
        released: a block-diagonal information) and :math:`C_{\beta\beta} s_k s_l` on the ββ entries."""
        t, p = design.intervals, design.covariates
        s = design.scales
        values = (score_alpha, score_beta, info_diag, 1.0 if info_cross is None else info_cross, info_beta)
        if not all(np.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"clip bounds must be finite and > 0, got {values}")
        rows, cols = pack_layout(t, p)
        s_row = np.where(rows >= t, s[np.maximum(rows - t, 0)], 1.0)
        s_col = np.where(cols >= t, s[np.maximum(cols - t, 0)], 1.0)
        cross = (rows < t) & (cols >= t)
        level = np.where(cols < t, info_diag, np.where(cross, values[3], info_beta))
        released = ~cross if info_cross is None else np.ones(rows.size, dtype=bool)
        return cls(np.concatenate([np.full(t, float(score_alpha)), score_beta * s]), level * s_row * s_col, released)


def clip_factors(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    r"""Clip factor per record (n,): :math:`\min(1, 1/\lVert v_i / c\rVert)` for ``values`` (n, k)
    and per-entry ``bounds`` :math:`c` (k,); every clipped row has :math:`\lVert c_i v_i / c\rVert \le 1`."""
    norm = np.sqrt(np.square(values / bounds).sum(axis=1))
    return 1.0 / np.maximum(norm, 1.0)


def _worst_score_norm(records: SiteRecords, theta: np.ndarray, bounds: ClipBounds) -> tuple[np.ndarray, np.ndarray]:
    r"""Per record and horizon J = 1..T (n, T): the largest :math:`\lVert g/c\rVert` over every outcome a
    record at risk through J could have (an event in any interval j ≤ J, or at risk through j and no
    further), from its covariates and ``theta`` alone (``inf`` where it overflows: weight 0); and the
    expected information weights (n, T)."""
    alpha, beta = _split(theta, records)
    t = records.intervals
    mu = np.exp(np.minimum(alpha[None, :] + (records.u @ beta)[:, None], 700.0))
    slope = _event_slope(mu)
    c_alpha, c_beta = bounds.score[:t], bounds.score[t:]
    spread = np.square(records.u / c_beta).sum(axis=1, keepdims=True)  # ||u/c_beta||^2
    with np.errstate(over="ignore", invalid="ignore"):
        surv_alpha = np.cumsum(np.square(mu / c_alpha), axis=1)
        hazard = np.cumsum(mu, axis=1)
        before_alpha = np.concatenate([np.zeros((records.n, 1)), surv_alpha[:, :-1]], axis=1)
        before = np.concatenate([np.zeros((records.n, 1)), hazard[:, :-1]], axis=1)
        survive = surv_alpha + np.square(hazard) * spread
        event = before_alpha + np.square(slope / c_alpha) + np.square(slope - before) * spread
        worst = np.sqrt(np.maximum.accumulate(np.maximum(survive, event), axis=1))
    return np.where(np.isnan(worst), np.inf, worst), mu * slope


def _worst_information_norm(records: SiteRecords, weights: np.ndarray, bounds: ClipBounds) -> np.ndarray:
    r"""Per record and horizon J (n, T): :math:`\lVert v/c\rVert` of the packed expected information of a
    record at risk through J (the largest over its outcomes: every entry grows with the intervals)."""
    t, p = records.intervals, records.u.shape[1]
    scaled = np.where(bounds.released, 1.0 / bounds.information, 0.0)
    diag = scaled[:t]
    cross = scaled[t:t + t * p].reshape(t, p)
    upper = np.triu_indices(p)
    outer = (records.u[:, upper[0]] * records.u[:, upper[1]]) * scaled[t + t * p:]
    with np.errstate(over="ignore", invalid="ignore"):
        squared = np.cumsum(np.square(weights) * (np.square(diag) + np.square(records.u) @ np.square(cross).T), axis=1)
        squared += np.square(np.cumsum(weights, axis=1)) * np.square(outer).sum(axis=1, keepdims=True)
    return np.where(np.isnan(squared), np.inf, np.sqrt(squared))


def record_bounds(records: SiteRecords, theta: np.ndarray, bounds: ClipBounds) -> tuple[np.ndarray, np.ndarray]:
    r"""Each record's weight :math:`c_i \in [0, 1]` and horizon :math:`J_i \in 1..T`, functions of its
    covariates and the public ``theta`` and ``bounds`` only (never of its outcome).

    The record counts as censored after interval :math:`J_i` (if still at risk then) and its score
    is multiplied by :math:`c_i`. With :math:`N_i(J)` the largest :math:`\lVert g/c\rVert` over every
    outcome up to J (:func:`_worst_score_norm`): :math:`J_i` is the last J with :math:`N_i(J) \le 1`
    and :math:`c_i = 1`; a record whose first interval already exceeds it (extreme covariates) takes
    the J maximising :math:`\min(1, 1/N_i(J))\sum_{j \le J} w_{ij}` and :math:`c_i = 1/N_i(J_i)`. So
    every possible record's score has normalised norm at most 1, and, the weight and the extra
    censoring depending on covariates only, the weighted score of the censored records has mean zero
    at the true θ: the estimating equation stays unbiased (outcome-blind clipping)."""
    norm, weights = _worst_score_norm(records, theta, bounds)
    factor = np.minimum(1.0, 1.0 / np.maximum(norm, 1e-300))
    within = norm <= 1.0
    last_within = within.shape[1] - 1 - np.argmax(within[:, ::-1], axis=1)
    best = np.argmax(factor * np.cumsum(weights, axis=1), axis=1)
    horizon = np.where(within[:, 0], last_within, best)
    return factor[np.arange(records.n), horizon], horizon + 1


def information_factor(records: SiteRecords, theta: np.ndarray, bounds: ClipBounds, weight: np.ndarray,
                       horizon: np.ndarray) -> np.ndarray:
    r"""The further factor :math:`c^H_i = \min(1, 1/(c_i N^H_i(J_i)))` of each record's information
    (weight :math:`c_i` and horizon :math:`J_i` of :func:`record_bounds`, :math:`N^H_i(J)` the
    normalised norm of its packed information at risk through J, the largest over its outcomes):
    outcome-blind, so that the released information :math:`\sum c^H_i c_i v_i` has per-record norm
    at most 1. It is 1 for all but the records of extreme information."""
    _, weights = _worst_score_norm(records, theta, bounds)
    norm = _worst_information_norm(records, weights, bounds)[np.arange(records.n), horizon - 1]
    return np.minimum(1.0, 1.0 / np.maximum(weight * norm, 1e-300))


def truncate(records: SiteRecords, horizon: np.ndarray) -> SiteRecords:
    """``records`` censored after their ``horizon`` interval (n,) where still at risk then."""
    kept = records.at_risk <= horizon
    return SiteRecords(records.u, np.minimum(records.at_risk, horizon), records.event & kept, records.intervals)


@dataclass(frozen=True, eq=False)
class SiteStep:
    """A site's sums at one step, before noise (:func:`site_step`) or with its noise
    (:func:`site_release`): the score (T + p,) and, when released, the packed information; with (diagnostics, not released) the records whose weight is below 1, whose
    horizon cut their follow-up, and whose actual normalised norm still exceeded 1 (a safety clip of
    each release on its own: never, but for rounding)."""

    score: np.ndarray
    information: np.ndarray | None
    weighted: int = 0
    truncated: int = 0
    clipped: int = 0


def site_step(records: SiteRecords, theta: np.ndarray, bounds: ClipBounds | None, *,
              with_information: bool) -> SiteStep:
    r"""A site's sums at the public ``theta``, before noise: :math:`\sum c_i g_i` and (when
    ``with_information``) :math:`\sum c^H_i c_i v_i` over its records truncated at their horizons
    (:func:`record_bounds`, :func:`information_factor`), expected information. ``bounds=None``: the
    exact sums (no weight, no horizon). Each record's normalised score, and information, has norm at
    most 1 (checked: a final clip of each, which the outcome-blind bounds leave idle)."""
    if bounds is None:
        info = record_information(records, theta).sum(axis=0) if with_information else None
        return SiteStep(record_score(records, theta).sum(axis=0), info)
    weight, horizon = record_bounds(records, theta, bounds)
    cut = truncate(records, horizon)
    g = record_score(cut, theta) * weight[:, None]
    safety = clip_factors(g, bounds.score)
    info, clipped = None, safety < 1.0 - 1e-9
    if with_information:
        factor = weight * information_factor(records, theta, bounds, weight, horizon)
        v = np.where(bounds.released, record_information(cut, theta), 0.0) * factor[:, None]
        info_safety = clip_factors(v, bounds.information)
        info, clipped = info_safety @ v, clipped | (info_safety < 1.0 - 1e-9)
    return SiteStep(safety @ g, info, int(np.sum(weight < 1.0)), int(np.sum(cut.at_risk < records.at_risk)),
                    int(np.sum(clipped)))


def site_counts(records: SiteRecords) -> np.ndarray:
    """The (2T,) count histogram: records whose event (first T cells) or censoring (last T) ends
    their risk in interval j; records never at risk add nothing. L2 sensitivity 1."""
    t = records.intervals
    held = records.at_risk > 0
    cell = records.at_risk[held] - 1 + np.where(records.event[held], 0, t)
    return np.bincount(cell, minlength=2 * t).astype(np.float64)


# --------------------------------------------------------------------------------------------
# Noise plan


@dataclass(frozen=True)
class NoisePlan:
    r"""Budget shares of the releases, the total noise multiplier and how the steps use them.

    ``total``: the multiplier :math:`z` of one Gaussian mechanism spending the whole (ε, δ)
    (calibrated by the caller's accountant). Shares :math:`\rho`: the count release's; per Newton
    step k the score's (``score_shares``, all > 0) and the information's at :math:`\theta_k`
    (``info_shares``, one more entry than steps: the last is released at the final
    :math:`\theta_S`, for the covariance alone; 0: no release). They add up to 1; a release of share
    :math:`\rho` has multiplier :math:`z/\sqrt\rho`. ``precondition``: the matrix of each step,
    ``reference`` (the counts' :func:`count_information`) or ``released`` (the last information
    released, floored; the reference before any). ``setting``: ``sum`` (one Gaussian on the sum,
    added as shares through secure aggregation) or ``per_site`` (each of ``sites`` adds the full
    noise). ``noise_factor``: the summed noise's actual standard deviation over the nominal one of
    :meth:`sum_multiplier` (default 1; e.g. a secure sum's discrete shares sized for fewer honest sites
    than took part, or sites whose multipliers differ); only the server's variances read it."""

    total: float
    count_share: float
    score_shares: tuple[float, ...]
    info_shares: tuple[float, ...]
    precondition: Literal["reference", "released"] = "reference"
    setting: Setting = "sum"
    sites: int = 1
    noise_factor: float = 1.0

    def __post_init__(self) -> None:
        shares = (self.count_share, *self.score_shares, *self.info_shares)
        if not (np.isfinite(self.total) and self.total > 0):
            raise ValueError(f"total noise multiplier must be finite and > 0, got {self.total!r}")
        if (not self.score_shares or len(self.info_shares) != len(self.score_shares) + 1 or min(shares) < 0
                or self.count_share <= 0 or min(self.score_shares) <= 0 or abs(sum(shares) - 1.0) > 1e-9):
            raise ValueError(f"shares must be >= 0 (count and scores > 0), one score share per step and one "
                             f"information share more, adding up to 1; got {shares}")
        if self.precondition not in ("reference", "released"):
            raise ValueError(f"precondition must be 'reference' or 'released', got {self.precondition!r}")
        if not (np.isfinite(self.noise_factor) and self.noise_factor > 0):
            raise ValueError(f"noise_factor must be finite and > 0, got {self.noise_factor!r}")
        if self.setting not in ("sum", "per_site") or self.sites < 1:
            raise ValueError(f"setting must be 'sum' or 'per_site' and sites >= 1, got {self.setting!r}, {self.sites}")

    @property
    def steps(self) -> int:
        return len(self.score_shares)

    def multiplier(self, share: float) -> float:
        """The noise multiplier of a release of ``share`` (``inf`` for 0: nothing released)."""
        return float(self.total / np.sqrt(share)) if share > 0 else float("inf")

    def history(self) -> list[tuple[float, float, int]]:
        """Every release as the project's accountants take it, ``(multiplier, 1.0, 1)`` (no
        subsampling): their composition is one Gaussian of multiplier ``total``."""
        shares = (self.count_share, *self.score_shares, *(s for s in self.info_shares if s > 0))
        return [(self.multiplier(share), 1.0, 1) for share in shares]

    def site_multiplier(self, share: float) -> float:
        """The multiplier of the noise one site adds to a release of ``share``."""
        z = self.multiplier(share)
        return z / np.sqrt(self.sites) if self.setting == "sum" else z

    def sum_multiplier(self, share: float) -> float:
        r"""The multiplier of the noise on the summed release: :math:`z_k`, or :math:`\sqrt K z_k` per site, times
        ``noise_factor``."""
        z = self.multiplier(share)
        return (z if self.setting == "sum" else z * np.sqrt(self.sites)) * self.noise_factor


# --------------------------------------------------------------------------------------------
# A site's noisy releases


def _noise(shape: tuple[int, ...], bounds: np.ndarray | float, multiplier: float, rng: np.random.Generator,
           released: np.ndarray | bool = True) -> np.ndarray:
    r""":math:`N(0, z^2c_e^2)` on each ``released`` entry e (0 elsewhere)."""
    return np.where(released, rng.normal(0.0, 1.0, size=shape) * multiplier * bounds, 0.0)


def site_count_release(records: SiteRecords, plan: NoisePlan, rng: np.random.Generator) -> np.ndarray:
    """A site's noisy count histogram (:func:`site_counts` plus its noise share of the count
    release). ``rng``: a deployed site's own entropy (a simulation's seeded generator)."""
    counts = site_counts(records)
    return counts + _noise(counts.shape, 1.0, plan.site_multiplier(plan.count_share), rng)


def site_release(records: SiteRecords, theta: np.ndarray, bounds: ClipBounds, plan: NoisePlan, *,
                 score_share: float, info_share: float, rng: np.random.Generator) -> SiteStep:
    """A site's noisy release at the public ``theta``: :func:`site_step` with the site's noise
    (:meth:`NoisePlan.site_multiplier`) on the score when ``score_share`` > 0 (else no score: 0
    and not sent) and on the released information entries when ``info_share`` > 0."""
    step = site_step(records, theta, bounds, with_information=info_share > 0)
    score = np.zeros_like(step.score)
    if score_share > 0:
        score = step.score + _noise(step.score.shape, bounds.score, plan.site_multiplier(score_share), rng)
    info = None
    if step.information is not None:
        info = step.information + _noise(step.information.shape, bounds.information,
                                         plan.site_multiplier(info_share), rng, bounds.released)
    return SiteStep(score, info, step.weighted, step.truncated, step.clipped)


# --------------------------------------------------------------------------------------------
# Server: functions of the summed releases


def _count_terms(counts: np.ndarray, intervals: int) -> tuple[np.ndarray, np.ndarray]:
    """``(events, at_risk)`` per interval from summed (noisy) counts: at risk at least 1, events in [0, at risk]."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    if counts.size != 2 * intervals:
        raise ValueError(f"counts must have 2T = {2 * intervals} entries, got {counts.size}")
    leaving = np.maximum(counts[:intervals] + counts[intervals:], 0.0)
    at_risk = np.maximum(np.cumsum(leaving[::-1])[::-1], 1.0)
    return np.clip(counts[:intervals], 0.0, at_risk), at_risk


def alpha_start(counts: np.ndarray, intervals: int) -> np.ndarray:
    r"""Starting :math:`\alpha_j = \log(-\log(1 - \hat d_j/\hat n_j))` from summed (noisy) counts of
    :func:`site_counts`: :math:`\hat n_j` the records leaving in interval j or later; the hazard
    kept in [HAZARD_FLOOR, 1 - HAZARD_FLOOR]."""
    events, at_risk = _count_terms(counts, intervals)
    hazard = np.clip(events / at_risk, HAZARD_FLOOR, 1.0 - HAZARD_FLOOR)
    return np.log(-np.log1p(-hazard))


def count_information(counts: np.ndarray, theta: np.ndarray, design: GroupedCoxDesign) -> np.ndarray:
    r"""A public approximation of the expected information from the summed (noisy) counts alone,
    as if β = 0 and every risk set had the covariates' public centre and ``design.scales``
    (independent columns): :math:`\mathrm{diag}(w_j \hat n_j)` for α, zero αβ,
    :math:`(\sum_j w_j \hat n_j)\,\mathrm{diag}(s^2)` for β, :math:`w_j` the weight of
    :math:`\mu_j = e^{\alpha_j}` (α from ``theta``). The steps' matrix."""
    t = design.intervals
    _, at_risk = _count_terms(counts, t)
    mu = np.exp(np.asarray(theta, dtype=np.float64)[:t])
    alpha_info = mu * _event_slope(mu) * at_risk
    return np.diag(np.concatenate([alpha_info, alpha_info.sum() * np.square(design.scales)]))


def smoothed_alpha_start(counts: np.ndarray, design: GroupedCoxDesign, smooth: float, *, tol: float = 1e-8,
                         max_steps: int = 100) -> np.ndarray:
    r"""Starting α from summed (noisy) counts, as for β = 0, by the penalised grouped-time likelihood of the counts,
    :math:`\sum_j \hat d_j\log(1 - e^{-\mu_j}) - (\hat n_j - \hat d_j)\mu_j - \tfrac\lambda2\lVert D\alpha\rVert^2`
    (:math:`\mu_j = e^{\alpha_j}`, ``smooth`` :math:`\lambda` of :func:`smoothing_penalty`, events clipped into
    [0, :math:`\hat n_j`]): concave, maximised by Fisher scoring with step halving from the pooled hazard
    :math:`\sum\hat d/\sum\hat n`, α kept within :data:`ALPHA_RANGE`. Each interval borrows from its neighbours,
    so an interval whose noisy count is 0 or negative no longer starts at the hazard floor."""
    events, at_risk = _count_terms(counts, design.intervals)
    penalty = smoothing_penalty(design, smooth)[:design.intervals, :design.intervals]

    def objective(alpha: np.ndarray) -> float:
        mu = np.exp(alpha)
        return float(events @ np.log(-np.expm1(-mu)) - (at_risk - events) @ mu - alpha @ penalty @ alpha / 2.0)

    pooled = np.clip(events.sum() / at_risk.sum(), HAZARD_FLOOR, 1.0 - HAZARD_FLOOR)
    alpha = np.full(design.intervals, np.log(-np.log1p(-pooled)))
    value = objective(alpha)
    for _ in range(max_steps):
        mu = np.exp(alpha)
        slope = _event_slope(mu)
        move = np.linalg.solve(np.diag(at_risk * mu * slope) + penalty,
                               events * slope - (at_risk - events) * mu - penalty @ alpha)
        size = 1.0
        while size > 1e-6 and objective(np.clip(alpha + size * move, *ALPHA_RANGE)) < value:
            size /= 2.0
        if size <= 1e-6:
            break
        alpha = np.clip(alpha + size * move, *ALPHA_RANGE)
        value = objective(alpha)
        if np.max(np.abs(size * move)) < tol:
            break
    return alpha


def start_from_counts(counts: np.ndarray, design: GroupedCoxDesign, *,
                      smooth: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """θ_0 (β = 0; α by :func:`alpha_start`, or with ``smooth`` > 0 by :func:`smoothed_alpha_start` at that
    λ: :attr:`PrivateSettings.start_smooth`) and the reference information :func:`count_information` at θ_0, from
    the summed noisy counts."""
    if not (np.isfinite(smooth) and smooth >= 0):
        raise ValueError(f"the start's smoothing strength must be finite and >= 0, got {smooth!r}")
    alpha = smoothed_alpha_start(counts, design, smooth) if smooth > 0 else alpha_start(counts, design.intervals)
    theta = np.concatenate([alpha, np.zeros(design.covariates)])
    return theta, count_information(counts, theta, design)


def smoothing_penalty(design: GroupedCoxDesign, strength: float) -> np.ndarray:
    r"""The (T + p) square matrix :math:`L = \lambda D^\top D` on the α's (:math:`D` their second
    differences) and 0 on β: the penalty :math:`\tfrac\lambda2 \lVert D\alpha\rVert^2` subtracted from
    the log-likelihood, so that each interval's α borrows strength from its neighbours (a straight
    line in j is not penalised). ``strength`` :math:`\lambda \ge 0`."""
    if not (np.isfinite(strength) and strength >= 0):
        raise ValueError(f"the smoothing strength must be finite and >= 0, got {strength!r}")
    t = design.intervals
    penalty = np.zeros((design.dim, design.dim))
    if t >= 3:
        second = np.diff(np.eye(t), n=2, axis=0)
        penalty[:t, :t] = strength * second.T @ second
    return penalty


def newton_update(theta: np.ndarray, score: np.ndarray, matrix: np.ndarray, penalty: np.ndarray,
                  intervals: int, *, max_alpha_move: float = np.inf) -> np.ndarray:
    r"""One step :math:`\theta + P^{-1}(\hat S_g - L\theta)` (``matrix`` :math:`P`, penalty included;
    ``penalty`` :math:`L`), each α's move cut to at most ``max_alpha_move`` in absolute value
    (:attr:`PrivateSettings.max_alpha_move`) and the α kept within :data:`ALPHA_RANGE`."""
    if not max_alpha_move > 0:
        raise ValueError(f"max_alpha_move must be > 0, got {max_alpha_move!r}")
    move = np.linalg.solve(matrix, score - penalty @ theta)
    move[:intervals] = np.clip(move[:intervals], -max_alpha_move, max_alpha_move)
    theta = theta + move
    theta[:intervals] = np.clip(theta[:intervals], *ALPHA_RANGE)
    return theta


def floor_information(information: np.ndarray, floor: float, reference: np.ndarray) -> np.ndarray:
    r"""``information`` made symmetric with :math:`\hat H \succeq f R`: the eigenvalues of
    :math:`R^{-1/2}\hat H R^{-1/2}` below ``floor`` :math:`f > 0` raised to it, ``reference``
    :math:`R` a positive definite matrix (:func:`information_estimate`: the release's own diagonal)."""
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor!r}")
    ref_values, ref_vectors = np.linalg.eigh(reference)
    root = (ref_vectors * np.sqrt(ref_values)) @ ref_vectors.T
    inverse_root = (ref_vectors / np.sqrt(ref_values)) @ ref_vectors.T
    whitened = inverse_root @ information @ inverse_root
    values, vectors = np.linalg.eigh((whitened + whitened.T) / 2.0)
    return root @ ((vectors * np.maximum(values, floor)) @ vectors.T) @ root


def smoothed_information(packed: np.ndarray, design: GroupedCoxDesign, noise_variance: np.ndarray,
                         alpha: np.ndarray) -> np.ndarray:
    r"""The noisy released information (packed; ``noise_variance`` its per-entry variance) with its αβ
    block smoothed over the intervals and the ββ block debiased: post-processing of released values.

    Column k of the αβ block is :math:`H_{jj}\bar u_{jk}`, :math:`\bar u_{jk}` the information-weighted
    mean of covariate k among those at risk in interval j, which drifts smoothly as the risk sets
    thin; it is replaced by its weighted least-squares fit on :math:`H_{jj}(1, \Lambda_j)`
    (:math:`\Lambda_j` the cumulative baseline hazard at the middle of interval j, from ``alpha``),
    which keeps 2 of T noisy degrees of freedom (without noise it changes the variances of β by
    under 2 % in the coverage simulation). The fit's noise still adds
    :math:`\mathrm{tr}(H_{\alpha\alpha}^{-1}\,\mathrm{Cov})` on average to
    :math:`H_{\beta\alpha}H_{\alpha\alpha}^{-1}H_{\alpha\beta}` (entry kk), so that much is added to the
    ββ diagonal: the Schur complement, hence the variance of β, is unbiased to first order. Without
    a released αβ block (``noise_variance`` 0 there) the matrix is returned as released."""
    t, p = design.intervals, design.covariates
    matrix = information_matrix(packed, t, p)
    variance = np.asarray(noise_variance, dtype=np.float64)[t:t + t * p].reshape(t, p)
    if not np.any(variance > 0):
        return matrix
    diag = np.maximum(np.diag(matrix)[:t], 1.0)
    mu = np.exp(np.clip(np.asarray(alpha, dtype=np.float64), *ALPHA_RANGE))
    basis = diag[:, None] * np.stack([np.ones(t), np.cumsum(mu) - mu / 2.0], axis=1)
    for k in range(p):
        weight = 1.0 / np.maximum(variance[:, k], 1e-300)
        gram = basis.T @ (basis * weight[:, None])
        fitted = basis @ np.linalg.solve(gram, basis.T @ (weight * matrix[:t, t + k]))
        matrix[:t, t + k] = matrix[t + k, :t] = fitted
        matrix[t + k, t + k] += np.trace(np.linalg.solve(gram, (basis / diag[:, None]).T @ basis))
    return matrix


def information_estimate(packed: np.ndarray, theta: np.ndarray, share: float, design: GroupedCoxDesign,
                         plan: NoisePlan, bounds: ClipBounds, floor: float) -> np.ndarray:
    r"""The summed noisy information released at ``theta`` with ``share`` as the estimate of the
    information: :func:`smoothed_information` with the release's known noise variance, then
    :func:`floor_information` at ``floor`` times its own diagonal :math:`D` (each entry at least twice its noise's
    standard deviation): :math:`\hat H \succeq fD`. Without noise this binds only where the information's
    correlation matrix has an eigenvalue below :math:`f` (near-collinear columns); it assumes nothing about the
    covariates, so it cannot make the information larger than the released one but for that noise."""
    variance = np.where(bounds.released, (plan.sum_multiplier(share) * bounds.information) ** 2, 0.0)
    smoothed = smoothed_information(packed, design, variance, theta[:design.intervals])
    rows, cols = pack_layout(design.intervals, design.covariates)
    noise_sd = np.zeros(design.dim)
    diagonal = rows == cols
    noise_sd[rows[diagonal]] = np.sqrt(variance[diagonal])
    own = np.maximum(np.diag(smoothed), 2.0 * noise_sd)
    return floor_information(smoothed, floor, np.diag(np.maximum(own, 1e-12 * max(float(own.max()), 1e-300))))


def delta_method_covariance(information: np.ndarray, noise_variance: np.ndarray) -> np.ndarray:
    r""":math:`\hat H^{-1}(\hat H + \Sigma_\xi)\hat H^{-1}`: the covariance of a Newton step's
    result whose score sum carried independent noise of per-entry variance ``noise_variance``
    (:math:`\Sigma_\xi` its diagonal), ``information`` :math:`\hat H` the matrix the step used, the
    previous iterate taken as converged."""
    inverse = np.linalg.inv(information)
    covariance = inverse + (inverse * np.asarray(noise_variance, dtype=np.float64)) @ inverse
    return (covariance + covariance.T) / 2.0


def propagated_covariance(information: np.ndarray, preconditioners: Sequence[np.ndarray],
                          noise_variances: Sequence[np.ndarray], penalty: np.ndarray | None = None) -> np.ndarray:
    r"""The covariance of the last iterate of :math:`\theta_{k+1} = \theta_k + P_k^{-1}(U(\theta_k) -
    L\theta_k + \xi_k)` linearised at its fixed point, :math:`U(\theta) = u - H(\theta - \theta^*)`,
    once the start's error has died out (``penalty`` :math:`L`, default 0; each :math:`P_k`
    includes it). With :math:`G = H + L`: the sampling part :math:`G^{-1}HG^{-1}`
    (:math:`\mathrm{Var}\,u = H`, model-based) plus every step's noise
    :math:`\xi_k \sim N(0, \mathrm{diag}(v_k))` carried to the end,
    :math:`\sum_k M_k \mathrm{diag}(v_k) M_k^\top`, :math:`M_k = A_{S-1}\cdots A_{k+1}P_k^{-1}`,
    :math:`A_m = I - P_m^{-1}G`. With one step, no penalty and :math:`P = H` this is
    :func:`delta_method_covariance`."""
    total = information if penalty is None else information + penalty
    inverse = np.linalg.inv(total)
    covariance = inverse @ information @ inverse
    carry = np.eye(information.shape[0])
    for precondition, variance in zip(reversed(preconditioners), reversed(noise_variances), strict=True):
        step = carry @ np.linalg.inv(precondition)
        covariance = covariance + (step * np.asarray(variance, dtype=np.float64)) @ step.T
        carry = carry @ (np.eye(information.shape[0]) - np.linalg.solve(precondition, total))
    return (covariance + covariance.T) / 2.0


@dataclass(frozen=True)
class PrivateSettings:
    r"""The server's choices beyond the plan (public; none costs privacy): ``floor`` :math:`f`, the
    released information is kept :math:`\succeq f D`, :math:`D` its own diagonal (:func:`information_estimate`);
    ``smooth`` :math:`\lambda`, the α penalty (:func:`smoothing_penalty`); ``covariance``: ``propagated``
    (:func:`propagated_covariance`, bias-corrected over ``correction_draws`` redraws of the released
    information's noise, :func:`private_covariance`) or ``delta`` (the last step alone). The
    defaults are the coverage simulation's choices (``docs/dp-cox.md``). ``start_smooth``: the λ of the start's
    penalised count fit (:func:`smoothed_alpha_start`; 0: each interval's own hazard, :func:`alpha_start`);
    ``max_alpha_move``: the largest move of any α in one step (:func:`newton_update`; a trust region for the
    fixed-matrix step, whose linearisation fails when a noisy step moves a log hazard by more than about 1)."""

    floor: float = 0.1
    smooth: float = 150.0
    covariance: Literal["propagated", "delta"] = "propagated"
    correction_draws: int = 40
    start_smooth: float = 0.0
    max_alpha_move: float = float("inf")


@dataclass(frozen=True)
class Recipe:
    """The chosen design of one noise setting (public; ``docs/dp-cox.md`` gives the coverage that chose it): the
    budget shares of :class:`NoisePlan` (``count_share``, ``score_shares``, ``info_shares``), the five clip bound
    scalars of :meth:`ClipBounds.from_scalars` (``bounds``) and the server's :class:`PrivateSettings`."""

    count_share: float
    score_shares: tuple[float, ...]
    info_shares: tuple[float, ...]
    bounds: tuple[tuple[str, float | None], ...]
    settings: PrivateSettings
    precondition: Literal["reference", "released"] = "reference"

    def plan(self, total: float, *, setting: Setting, sites: int) -> NoisePlan:
        """The recipe's :class:`NoisePlan` at total noise multiplier ``total``."""
        return NoisePlan(total=total, count_share=self.count_share, score_shares=self.score_shares,
                         info_shares=self.info_shares, precondition=self.precondition, setting=setting, sites=sites)

    def clip_bounds(self, design: GroupedCoxDesign) -> ClipBounds:
        """The recipe's :class:`ClipBounds` on ``design``'s spreads."""
        return ClipBounds.from_scalars(design, **dict(self.bounds))


_BOUNDS = (("score_alpha", 2.0), ("score_beta", 3.0), ("info_diag", 1.0), ("info_cross", 2.0), ("info_beta", 12.0))
#: The chosen design per setting: ``sum`` (noise on the summed releases, ``distributed_dp``) and ``per_site`` (every
#: site adds the full noise, ``dp_sgd``).
RECIPES: dict[str, Recipe] = {
    "sum": Recipe(0.04, (0.08, 0.10, 0.15, 0.38), (0.0, 0.0, 0.0, 0.0, 0.25), _BOUNDS, PrivateSettings()),
    "per_site": Recipe(0.04, (0.10, 0.15, 0.46), (0.0, 0.0, 0.0, 0.25), _BOUNDS,
                       PrivateSettings(smooth=900.0, start_smooth=900.0, max_alpha_move=1.0)),
}


@dataclass(frozen=True, eq=False)
class PrivateTrace:
    """What the server holds after a private fit, every item a function of released values: the
    iterates ``thetas`` (θ_0 … θ_S), the counts' ``reference`` information, each step's matrix
    ``preconditioners`` (penalty included), ``information`` (the estimate of the information at
    the solution from the last information release, :func:`information_estimate`; the reference
    without one), that release as sent (``released``: the noisy packed sum, the θ it was taken at,
    its share and the step it came before, S for the final θ; ``None`` without one) and, per round, the summed weighted, truncated and
    clipped record counts (``diagnostics``: the simulation's view, never released)."""

    thetas: tuple[np.ndarray, ...]
    reference: np.ndarray
    preconditioners: tuple[np.ndarray, ...]
    information: np.ndarray
    released: tuple[np.ndarray, np.ndarray, float, int] | None
    diagnostics: tuple[tuple[int, int, int], ...]


def private_covariance(trace: PrivateTrace, design: GroupedCoxDesign, plan: NoisePlan, bounds: ClipBounds,
                       settings: PrivateSettings, rng: np.random.Generator) -> np.ndarray:
    r"""The covariance of the private estimate :math:`\theta_S`, from released values only.

    ``propagated``: :func:`propagated_covariance` of the trace's information estimate, its
    preconditioners and every score release's known noise variance. The information estimate is
    noisy and the covariance a convex-like function of it (inverses, floor), so its variances come
    out too large on average; a parametric bootstrap over the released information removes that:
    with :math:`V` the diagonal from the release and :math:`\bar V` the mean diagonal over
    ``correction_draws`` re-estimates from the release plus fresh noise of its known covariance
    (the steps' matrices redrawn with it where they were the release), the covariance is rescaled to the diagonal :math:`V^2/\bar V` (correlations kept). ``delta``:
    :func:`delta_method_covariance` of the information estimate and the last score's noise."""
    penalty = smoothing_penalty(design, settings.smooth)
    variances = [(plan.sum_multiplier(share) * bounds.score) ** 2 for share in plan.score_shares]
    if settings.covariance == "delta":
        return delta_method_covariance(trace.information, variances[-1])
    if settings.covariance != "propagated":
        raise ValueError(f"covariance must be 'propagated' or 'delta', got {settings.covariance!r}")
    covariance = propagated_covariance(trace.information, trace.preconditioners, variances, penalty)
    if trace.released is None or settings.correction_draws < 1:
        return covariance
    packed, theta, share, at = trace.released
    sd = np.where(bounds.released, plan.sum_multiplier(share) * bounds.information, 0.0)

    def diagonal(information: np.ndarray) -> np.ndarray:
        matrices = [information + penalty if plan.precondition == "released" and k >= at else matrix
                    for k, matrix in enumerate(trace.preconditioners)]
        return np.diag(propagated_covariance(information, matrices, variances, penalty))

    redrawn = [information_estimate(packed + rng.normal(size=packed.shape) * sd, theta, share, design, plan,
                                    bounds, settings.floor)
               for _ in range(settings.correction_draws)]
    scale = np.sqrt(np.diag(covariance) / np.mean([diagonal(h) for h in redrawn], axis=0))
    return covariance * np.outer(scale, scale)


@dataclass(frozen=True, eq=False)
class GroupedCoxFit:
    """A fit: ``theta`` on the model's scale and its ``covariance``; β per unit of the user's columns
    (``beta``, ``standard_errors``, ``lower``, ``upper`` at level ``1 - alpha``)."""

    design: GroupedCoxDesign
    theta: np.ndarray
    covariance: np.ndarray
    alpha: float = 0.05
    steps: int = 0

    @property
    def beta(self) -> np.ndarray:
        return self.theta[self.design.intervals:] * self.design.per_unit()

    @property
    def standard_errors(self) -> np.ndarray:
        t = self.design.intervals
        return np.sqrt(np.diag(self.covariance)[t:]) * self.design.per_unit()

    @property
    def lower(self) -> np.ndarray:
        return self.beta - stats.norm.ppf(1 - self.alpha / 2) * self.standard_errors

    @property
    def upper(self) -> np.ndarray:
        return self.beta + stats.norm.ppf(1 - self.alpha / 2) * self.standard_errors


# --------------------------------------------------------------------------------------------
# In-process federation (every site's records at hand, as the server loop would run it)


def _exact_terms(design: GroupedCoxDesign, sites: Sequence[SiteRecords], theta: np.ndarray,
                 kind: InformationKind) -> tuple[np.ndarray, np.ndarray]:
    score = sum(record_score(s, theta).sum(axis=0) for s in sites)
    packed = sum(record_information(s, theta, kind).sum(axis=0) for s in sites)
    return score, information_matrix(packed, design.intervals, design.covariates)


def fit_exact(design: GroupedCoxDesign, sites: Sequence[SiteRecords], *, kind: InformationKind = "expected",
              tol: float = 1e-10, max_steps: int = 100, alpha: float = 0.05) -> GroupedCoxFit:
    """The non-private maximum-likelihood fit: exact sums (no clipping, no noise, no penalty),
    Newton (``observed``) or Fisher scoring (``expected``) from the counts' start to convergence
    (``max |step| < tol``; a step longer than 5 in any coordinate is shortened to 5); covariance
    :math:`H^{-1}`, the expected information at the estimate. ``RuntimeError`` when it does not
    converge (e.g. an interval whose hazard is 0 or 1)."""
    counts = sum(site_counts(s) for s in sites)
    theta = np.concatenate([alpha_start(counts, design.intervals), np.zeros(design.covariates)])
    for step in range(1, max_steps + 1):
        score, information = _exact_terms(design, sites, theta, kind)
        move = np.linalg.solve(information, score)
        theta = theta + move * min(1.0, 5.0 / max(float(np.max(np.abs(move))), 1e-300))
        if np.max(np.abs(move)) < tol:
            break
    else:
        raise RuntimeError(f"the exact grouped-Cox fit did not converge in {max_steps} steps")
    _, information = _exact_terms(design, sites, theta, "expected")
    return GroupedCoxFit(design, theta, np.linalg.inv(information), alpha=alpha, steps=step)


def _summed(parts: Sequence[SiteStep]) -> tuple[np.ndarray, np.ndarray | None, tuple[int, int, int]]:
    info = None if parts[0].information is None else sum(part.information for part in parts)
    counted = tuple(int(sum(getattr(part, name) for part in parts)) for name in ("weighted", "truncated", "clipped"))
    return sum(part.score for part in parts), info, counted


#: The kinds of release of a private fit, in :meth:`PrivateServer.releases`' order within a step.
COUNTS, INFORMATION, SCORE = "counts", "information", "score"


class PrivateServer:
    r"""The server's side of the private fit: fed the summed releases in the plan's order
    (:meth:`releases`), it holds the public θ at which the next one is taken (:attr:`theta`).

    :meth:`counts` gives θ_0 (:func:`start_from_counts`, at ``settings.start_smooth``) and the reference
    information R; :meth:`information` the estimate at the solution (:func:`information_estimate`);
    :meth:`score` one :func:`newton_update` with :math:`P = R + L` (or, with ``plan.precondition ==
    "released"``, the last information estimate plus :math:`L`; α moves cut at
    ``settings.max_alpha_move``). Every input is a summed release; nothing else is read."""

    def __init__(self, design: GroupedCoxDesign, plan: NoisePlan, bounds: ClipBounds, settings: PrivateSettings):
        self.design, self.plan, self.bounds, self.settings = design, plan, bounds, settings
        self.penalty = smoothing_penalty(design, settings.smooth)
        self.thetas: list[np.ndarray] = []
        self.matrices: list[np.ndarray] = []
        self.reference: np.ndarray | None = None
        self.estimate: np.ndarray | None = None
        self.released: tuple[np.ndarray, np.ndarray, float, int] | None = None

    @staticmethod
    def releases(plan: NoisePlan) -> tuple[tuple[str, int, float], ...]:
        """The fit's releases in order, ``(kind, step, share)``: the counts, then per step k the information at
        θ_k where its share is > 0 (the last at θ_S) before the score at θ_k (k < S)."""
        releases = [(COUNTS, 0, plan.count_share)]
        for step, info_share in enumerate(plan.info_shares):
            if info_share > 0:
                releases.append((INFORMATION, step, info_share))
            if step < plan.steps:
                releases.append((SCORE, step, plan.score_shares[step]))
        return tuple(releases)

    @property
    def theta(self) -> np.ndarray:
        return self.thetas[-1]

    def counts(self, summed: np.ndarray) -> None:
        theta, self.reference = start_from_counts(summed, self.design, smooth=self.settings.start_smooth)
        self.estimate = self.reference
        self.thetas.append(theta)

    def information(self, summed: np.ndarray, step: int, share: float) -> None:
        self.released = (summed, self.theta, share, step)
        self.estimate = information_estimate(summed, self.theta, share, self.design, self.plan, self.bounds,
                                             self.settings.floor)

    def score(self, summed: np.ndarray) -> None:
        matrix = self.estimate if self.plan.precondition == "released" else self.reference
        self.matrices.append(matrix + self.penalty)
        self.thetas.append(newton_update(self.theta, summed, self.matrices[-1], self.penalty, self.design.intervals,
                                         max_alpha_move=self.settings.max_alpha_move))

    def trace(self, diagnostics: tuple[tuple[int, int, int], ...] = ()) -> PrivateTrace:
        """What the server holds after the last release (:class:`PrivateTrace`)."""
        return PrivateTrace(tuple(self.thetas), self.reference, tuple(self.matrices), self.estimate, self.released,
                            diagnostics)


def run_private(design: GroupedCoxDesign, sites: Sequence[SiteRecords], plan: NoisePlan, bounds: ClipBounds,
                settings: PrivateSettings, rng: np.random.Generator) -> PrivateTrace:
    """The private fit run in one process: every site's release from :func:`site_count_release` /
    :func:`site_release` (noise from ``rng``; a step's information and score drawn together at θ_k), their sums
    fed to a :class:`PrivateServer` in its order; the trace's diagnostics are the summed weighted, truncated and
    clipped record counts per step."""
    server = PrivateServer(design, plan, bounds, settings)
    server.counts(sum(site_count_release(s, plan, rng) for s in sites))
    diagnostics = []
    for step, info_share in enumerate(plan.info_shares):
        score_share = plan.score_shares[step] if step < plan.steps else 0.0
        score, packed, counted = _summed([site_release(s, server.theta, bounds, plan, score_share=score_share,
                                                       info_share=info_share, rng=rng) for s in sites])
        diagnostics.append(counted)
        if packed is not None:
            server.information(packed, step, info_share)
        if score_share > 0:
            server.score(score)
    return server.trace(tuple(diagnostics))


def fit_private(design: GroupedCoxDesign, sites: Sequence[SiteRecords], plan: NoisePlan, bounds: ClipBounds, *,
                rng: np.random.Generator, settings: PrivateSettings | None = None,
                alpha: float = 0.05) -> tuple[GroupedCoxFit, PrivateTrace]:
    """:func:`run_private` and :func:`private_covariance`: the private fit (β per unit, its
    confidence intervals) and the server's trace."""
    settings = PrivateSettings() if settings is None else settings
    trace = run_private(design, sites, plan, bounds, settings, rng)
    covariance = private_covariance(trace, design, plan, bounds, settings, rng)
    return GroupedCoxFit(design, trace.thetas[-1], covariance, alpha=alpha, steps=plan.steps), trace
