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

Under ``strategy.name = dp_sgd`` / ``distributed_dp`` (the private grouped-time model, :mod:`models.grouped_cox`) the
messages are :data:`DP_COUNTS`, :data:`DP_SCORE` and :data:`DP_INFORMATION` instead, in the order of
:func:`private_releases` (``distributed_dp``: each the stage-2 query of a secure sum); :func:`private_design`,
:func:`private_plan` and :func:`private_sum_plan` are what both sides compute from their own set-up and run config.

With ``cox.secure_sum = true`` (``cox.strata = site``, or ``none`` on k points of the set-up's public time grid,
``cox.grid = k``) the sites' moments, Newton sums (pooled: every cell's :class:`models.cox.RiskSetSums`), robust
meat and Schoenfeld sums never travel as arrays (the vector of each: :func:`secure_layout`): the server runs SecAgg+
(:class:`strategies.secure_aggregation.SecureSum`, its four stages ``query.secagg_*``) once per query, its stage-2
message carrying the query's arrays and its type (:data:`SECURE_QUERY` in the ``config`` record); each site
answers with its values in fixed point (:func:`to_fixed`), masked, and the server unmasks only their sum over sites
(:func:`from_fixed`). Fixed point:
``v -> round(v * 2^32) mod 2^62`` (:data:`SECURE_SCALE_BITS`, :data:`SECURE_MODULUS_BITS`), decoded with
:func:`~strategies.secure_aggregation.centred` then ``/ 2^32``: a resolution of 2^-32 (2.3e-10) per site and value,
fine enough that Newton's step halving (which compares log-likelihoods to 1e-12 relative) and β (to far below
1e-6) match the clear fit. ``privacy.modulus_bits`` (default 48) is not reused: at 48 bits this resolution would
leave a log-likelihood range of only ±2^15 = 32768, so the modulus is the protocol's largest, 2^62. No site's
value may reach ``2^29 / k`` in size (:func:`secure_limit`; ``k`` the sites of the sum: 1.3e8 for 4 sites), so
that the sum over sites can never wrap around the modulus: a site refuses (one line naming the value) any other
value beyond it, which stops the run.

The pooled risk sums are sums of ``exp(x'β)``, whose size follows β (FLCHAIN, 5 sites: 6e3 at β = 0, 2e12 at
Newton's first trial step, 3e5 at the fit; the range is 1.07e8). So every pooled Newton query carries a public
scale ``log_scale``, one number ``c_k`` per cell of the grid (the same for every site; :func:`secure_log_scale`):
the sites send each cell's risk-weighted sums of ``exp(x'β - c_k)`` and the server multiplies them back by
``e^c_k`` (:meth:`models.cox.RiskSetSums.rescaled`). Efron's likelihood, score and information do not depend on
a factor common to every ``exp(x'β)`` of a cell, so the fit is the clear one. ``c`` puts each cell's bound
(:meth:`~models.cox.RiskSetSums.risk_bound` of the summed sums) at the last point Newton accepted (at the start,
β = 0: the moments' record count and sums of squares) between 2^-17 and 2^-16 of the range
(:data:`SECURE_HEADROOM_BITS`): the resolution is then about 2^-45 k of each cell's bound (the log partial
likelihood within 1e-9 on the bundled data sets, inside Newton's 1e-12 relative comparison), and a
trial step may grow a cell's sums 2^16-fold. A trial step that takes a site's risk sums beyond the range
anyway is *out of range*: the site sends uniform random numbers modulo 2^62 instead of its values, with 1 in the
vector's last number (:data:`OUT_OF_RANGE`, 0 at every other site), so that the server learns only how many
sites were out of range (every other number of the sum is uniform: not even the other sites' partial sum
shows), and Newton halves that step as it does a step to a lower log-likelihood (on the bundled data sets only
where the clear fit halves it too). ``cox.grid = events`` has no secure sum: its grid, the union of
the sites' event times, is itself what the sum would hide.

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

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from models.cox import RISK_WEIGHTED
from models.data import Preprocessor
from models import grouped_cox as gc
from models.grouped_cox import RECIPES, ClipBounds, GroupedCoxDesign, NoisePlan, SiteRecords, prepare_site
from strategies.accounting.filter import fitting_noise_multiplier
from strategies.accounting.rdp import calibrate_noise_multiplier
from strategies.config import CoxConfig, ExperimentConfig
from strategies.mechanisms.base import SiteSetUp
from strategies.mechanisms.manifest import Manifest, ReleasedValue, common_releases
from strategies.mechanisms.distributed_dp import RoundPlan, counted_honest, gaussian_sum_plan

__all__ = [
    "ARRAYS",
    "CONFIG",
    "EVENT_TIMES",
    "MEAT",
    "MOMENTS",
    "OUT_OF_RANGE",
    "RISK_SET",
    "SCHOENFELD",
    "SECURE_HEADROOM_BITS",
    "SECURE_MODULUS_BITS",
    "SECURE_QUERY",
    "SECURE_SCALE_BITS",
    "SUMS",
    "CoxDesign",
    "DP_COUNTS",
    "DP_INFORMATION",
    "DP_QUERIES",
    "DP_SCORE",
    "check_beta",
    "coxph_manifest",
    "private_design",
    "private_manifest",
    "private_plan",
    "private_records",
    "private_release_size",
    "private_releases",
    "private_setting",
    "private_sum_plan",
    "private_total",
    "decode",
    "encode",
    "from_fixed",
    "k_point_grid",
    "secure_layout",
    "secure_limit",
    "secure_log_scale",
    "secure_seen",
    "to_fixed",
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


def k_point_grid(cuts: np.ndarray, k: int) -> np.ndarray:
    """The pooled grid of ``cox.strata = none`` with ``cox.grid = k``: ``k`` points of the set-up's time grid
    ``cuts`` (the ``SiteSpec.cuts`` every party holds before the fit), at the indices ``round(linspace(0, len - 1,
    k))`` (its first and last cut included; duplicates dropped; every cut when there are no more than ``k``).

    The contract of the k-point grid: the server sends exactly this grid with every pooled query (Newton sums, the
    robust meat, the PH test's Schoenfeld sums), and a site answers on no other (``flwr_app.cox_client`` computes it
    from its own copy of the cuts and its own ``cox.grid``, and refuses a query whose grid differs), so the server
    learns per-cell sums on these ``k`` cells only, as the manifest states (:func:`secure_seen`)."""
    cuts = np.asarray(cuts, dtype=np.float64).reshape(-1)
    picked = np.round(np.linspace(0, cuts.size - 1, min(int(k), cuts.size))).astype(int)
    return cuts[np.unique(picked)]


#: The ``config`` key of a secure sum's stage-2 message (``query.secagg_masked``) naming the Cox query it answers.
SECURE_QUERY = "cox_query"
#: The secure sum's fixed point: values in units of 2^-SECURE_SCALE_BITS, modulo 2^SECURE_MODULUS_BITS.
SECURE_SCALE_BITS, SECURE_MODULUS_BITS = 32, 62
#: The last number of a pooled Newton step's secure vector: 1 from a site whose risk sums are out of range, else 0.
OUT_OF_RANGE = "out_of_range"
#: The public scale puts each cell's risk sums' bound at the last accepted Newton point between 2^-17 and 2^-16 of the
#: fixed point's range: a trial step may grow them 2^16-fold before a site is out of range, and the resolution is
#: about 2^-45 k of the bound (k sites).
SECURE_HEADROOM_BITS = 16


def secure_limit(parties: int) -> float:
    """The size no site's value of a secure sum over ``parties`` sites may reach: ``2^29 / parties`` (so that the
    sum of the sites' values, in units of 2^-32, stays below 2^61 and never wraps around the modulus 2^62)."""
    return 2.0 ** (SECURE_MODULUS_BITS - 1 - SECURE_SCALE_BITS) / max(int(parties), 1)


def secure_log_scale(bound: np.ndarray, parties: int) -> np.ndarray:
    """The public scale of a pooled Newton query over ``parties`` sites, one number ``c_k`` per grid cell: the
    sites send cell k's risk-weighted sums of ``exp(x'β - c_k)``.

    ``bound``: per cell (or one for every cell), an unscaled bound on the sum over sites of every risk-weighted
    value there: the pooled :meth:`~models.cox.RiskSetSums.risk_bound` of the last accepted point, or before the
    first evaluation, at β = 0, the larger of the record count and every covariate's sum of squares. ``c_k`` is
    the multiple of ln 2 that puts ``bound_k`` between 2^-17 and 2^-16 of :func:`secure_limit`
    (:data:`SECURE_HEADROOM_BITS`; a power of two, so counts at β = 0 lose nothing to the fixed point), a cell
    with a zero bound (nobody at risk) the largest cell's. The server computes it from sums over sites only; it is
    the same for every site. ``ValueError`` unless every bound is finite and at least one positive."""
    bound = np.asarray(bound, dtype=np.float64)
    if not (np.all(np.isfinite(bound)) and np.all(bound >= 0) and np.any(bound > 0)):
        raise ValueError(f"the pooled risk sums' bound must be finite, >= 0 and somewhere > 0, got {bound}")
    bound = np.where(bound > 0, bound, bound.max())
    target = secure_limit(parties) / 2.0 ** SECURE_HEADROOM_BITS
    return np.ceil(np.log2(bound / target)) * math.log(2.0)


def secure_layout(message_type: str, p: int, m: int | None = None) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """The vector of a secure Cox query: ``(name, shape, length)`` in order, ``shape`` the array's shape in the clear
    reply, ``length`` how many numbers of the vector it takes (a symmetric p x p matrix travels as its upper
    triangle, ``p(p+1)/2`` numbers; an (m, p, p) array as each cell's upper triangle, ``m p(p+1)/2``).

    ``m``: the number of cells of the pooled grid (``cox.strata = none``); only a Newton step's layout depends on
    it: ``n``, the :data:`RISK_SET` arrays of :class:`models.cox.RiskSetSums` and :data:`OUT_OF_RANGE` (one number,
    last) with ``m``, the stratified :class:`models.cox.CoxSums` with ``None``. ``ValueError`` for a query with no
    secure sum."""
    triangle = p * (p + 1) // 2
    sums = (("loglik", (1,)), ("score", (p,)), ("information", (p, p)), ("n", (1,)), ("events", (1,)))
    if m is not None:
        cell = {"events": (), "event_weight": (), "event_x": (p,), "event_risk": (), "event_risk_x": (p,),
                "event_risk_xx": (p, p), "risk": (), "risk_x": (p,), "risk_xx": (p, p)}
        sums = (("n", (1,)), *((name, (int(m), *cell[name])) for name in RISK_SET), (OUT_OF_RANGE, (1,)))
    layouts = {
        MOMENTS: (("n", (1,)), ("total", (p,)), ("total_sq", (p,))),
        SUMS: sums,
        MEAT: (("meat", (p, p)),),
        SCHOENFELD: (("events", (1,)), ("g_sum", (1,)), ("g_sq_sum", (1,)), ("residual_sum", (p,)),
                     ("g_residual_sum", (p,))),
    }
    if message_type not in layouts:
        raise ValueError(f"Cox query refused: {message_type!r} has no secure sum (cox.secure_sum)")
    return tuple((name, shape, int(np.prod(shape[:-2])) * triangle if name in _SYMMETRIC else int(np.prod(shape)))
                 for name, shape in layouts[message_type])


#: The arrays sent as upper triangles: p x p matrices, and the (m, p, p) cross-products of a pooled step.
_SYMMETRIC = ("information", "meat", "event_risk_xx", "risk_xx")
#: The counts, rounded to integers when decoded.
_COUNTS = ("n", "events", OUT_OF_RANGE)


def to_fixed(arrays: Mapping[str, np.ndarray], message_type: str, p: int, *, parties: int, site: str,
             m: int | None = None) -> np.ndarray:
    """A site's reply ``arrays`` as the secure sum's vector (:func:`secure_layout` with ``p`` and ``m``):
    ``round(v * 2^32) mod 2^62`` (int64), :data:`OUT_OF_RANGE` 0.

    A value beyond :func:`secure_limit` (``|v| >= 2^29 / parties``, beyond which the sum could wrap) or not finite:
    in the risk-weighted arrays of a pooled Newton step (:data:`models.cox.RISK_WEIGHTED`, whose size follows the
    server's β and public scale) the site is out of range, and the vector is :func:`_out_of_range_vector` instead;
    anywhere else ``ValueError`` (one line, naming the site's value), as for an array of the wrong shape."""
    limit = secure_limit(parties)
    upper = np.triu_indices(p)
    layout = secure_layout(message_type, p, m)
    parts, out_of_range = [], False
    for name, shape, _ in layout:
        if name == OUT_OF_RANGE:
            parts.append(np.zeros(1))
            continue
        value = np.asarray(arrays[name], dtype=np.float64)
        if value.shape != shape:
            raise ValueError(f"Cox secure sum: '{name}' has shape {value.shape}, not {shape}")
        value = (value[..., upper[0], upper[1]] if name in _SYMMETRIC else value).reshape(-1)
        bad = np.flatnonzero(~(np.abs(value) < limit))
        if bad.size and name in RISK_WEIGHTED and layout[-1][0] == OUT_OF_RANGE:
            out_of_range = True
        elif bad.size:
            raise ValueError(f"cox.secure_sum refused: site '{site}' would send {name}[{int(bad[0])}] = "
                             f"{value[bad[0]]:.6g}, beyond the fixed point's range |v| < 2^29/{parties} = {limit:.4g} "
                             f"(2^-{SECURE_SCALE_BITS} modulo 2^{SECURE_MODULUS_BITS}): the sum over sites could wrap "
                             "around; set cox.secure_sum = false")
        parts.append(value)
    if out_of_range:
        return _out_of_range_vector(sum(length for _, _, length in layout))
    fixed = np.rint(np.concatenate(parts) * 2.0 ** SECURE_SCALE_BITS).astype(np.int64)
    return np.mod(fixed, np.int64(2) ** SECURE_MODULUS_BITS)


def _out_of_range_vector(length: int) -> np.ndarray:
    """An out-of-range site's vector: uniform random numbers modulo 2^62 (fresh from the operating system's entropy)
    in place of its values, and 1 (2^32 in fixed point) in the last, :data:`OUT_OF_RANGE`. In the sum over sites
    every number but the last is then uniform, whatever the other sites sent (their partial sum stays hidden,
    unlike with zeros), and the last counts the out-of-range sites."""
    vector = np.random.default_rng().integers(0, 2 ** SECURE_MODULUS_BITS, size=length, dtype=np.int64)
    vector[-1] = 2 ** SECURE_SCALE_BITS
    return vector


def from_fixed(values: np.ndarray, message_type: str, p: int, m: int | None = None) -> dict[str, np.ndarray]:
    """The summed arrays of a secure Cox query from its decoded (centred) sum ``values`` (float64, units of
    2^-32; :func:`secure_layout` with ``p`` and ``m``), each in its clear shape: symmetric matrices rebuilt from
    their upper triangles, counts rounded to integers."""
    values = np.asarray(values, dtype=np.float64) / 2.0 ** SECURE_SCALE_BITS
    upper = np.triu_indices(p)
    found, start = {}, 0
    for name, shape, length in secure_layout(message_type, p, m):
        value = values[start:start + length]
        start += length
        if name in _SYMMETRIC:
            matrix = np.zeros(shape)
            matrix[..., upper[0], upper[1]] = value.reshape(*shape[:-2], -1)
            value = matrix + np.swapaxes(np.triu(matrix, 1), -1, -2)
        value = value.reshape(shape)
        if name in _COUNTS:
            value = np.rint(value).astype(np.int64)
        found[name] = value
    return found


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


def coxph_manifest(cfg: ExperimentConfig, setup: SiteSetUp | None = None) -> Manifest:
    """Every value a site sends in a ``coxph`` run: with ``fedavg`` no noise anywhere (every release is uncovered);
    with ``dp_sgd`` / ``distributed_dp`` :func:`private_manifest` (``setup``: a site's, for the multipliers)."""
    if cfg.strategy != "fedavg":
        return private_manifest(cfg, setup)
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
    if cox.secure_sum:
        releases = [_secure_release(release, secure_seen(cfg.cox)) for release in releases] + _secure_sum_releases()
    releases += common_releases(cfg, private=False, record_level=False)
    return Manifest("fedavg", "none", tuple(releases))


#: What the server still sees in a secure Cox sum, beside the sum over sites.
SECURE_BOOKKEEPING = ("which sites completed each stage of every secure sum and which failed, dropped out or "
                      "disputed a neighbour's share (SecAgg+'s per-site bookkeeping); a drop-out stops the fit")


def secure_seen(cox: CoxConfig) -> str:
    """What the server sees of the sites' Cox values with ``cox.secure_sum`` (beside :data:`SECURE_BOOKKEEPING`), for
    the run's ``cox`` group: the sums over sites only, with ``cox.strata = none`` per cell of the public grid
    (``cox.grid = k``: points of the set-up's time grid, which every party holds before the fit) and, per Newton
    evaluation, the number of sites out of range (:data:`OUT_OF_RANGE`); nothing per site."""
    if cox.strata == "none":
        return (f"only the sum over sites of each query's values (the risk-set sums per cell of the public grid, "
                f"cox.grid = {cox.grid} points of the set-up's time grid, each cell's scaled by the public "
                "factor exp(-c_k) the server sends), never one site's own values or event counts; and, for each "
                "Newton evaluation, how many sites' risk sums were beyond the fixed point's range at that beta and "
                "scale (a count, not which sites: such a site sends uniform random numbers instead of its values, "
                "and the fit halves that trial step)")
    return "only the sum over sites of each query's values, never one site's own values"


def _secure_release(release: ReleasedValue, seen: str) -> ReleasedValue:
    """A Cox release as ``cox.secure_sum`` sends it: in fixed point, masked, through SecAgg+; ``seen``: what the
    server sees of it (:func:`secure_seen`)."""
    return replace(release, detail=f"{release.detail}; in fixed point (2^-{SECURE_SCALE_BITS} modulo "
                                   f"2^{SECURE_MODULUS_BITS}), masked by SecAgg+ (cox.secure_sum)",
                   reason=(f"no noise, but through the secure sum: the server sees {seen} (the site's ledger records "
                           f"the release as the clear path does); it still sees {SECURE_BOOKKEEPING}"),
                   wire=("query.secagg_masked/masked.masked",))


def _secure_sum_releases() -> list[ReleasedValue]:
    """The protocol's own messages (as :mod:`strategies.mechanisms.distributed_dp` lists them)."""
    no_info = "drawn fresh for every secure sum, not computed from any record: carry no information about the records"
    return [
        ReleasedValue("secure-aggregation keys", "one-time public keys, encrypted Shamir shares and the shares "
                      "revealed in unmasking, for every secure sum (4 round trips a query)", "cox", True, no_info,
                      ("query.secagg_setup/secagg.*", "query.secagg_share_keys/secagg.*",
                       "query.secagg_unmask/secagg.*")),
        ReleasedValue("disputed neighbours", "the neighbours whose encrypted share the site could not use", "cox",
                      True, "a fact about the other sites' messages, not computed from any record",
                      ("query.secagg_masked/secagg.disputed",)),
    ]


# ------------------------------------------------------------------ the private fit (dp_sgd, distributed_dp)

#: The private fit's messages (:mod:`models.grouped_cox` over the app): the noisy count histogram (once), the
#: outcome-blind score sum at the server's θ (``step`` 0..S-1, in order) and the packed information at the server's
#: θ (the steps whose information share is > 0: the final θ_S in the recipes).
DP_COUNTS = "query.cox_dp_counts"
DP_SCORE = "query.cox_dp_score"
DP_INFORMATION = "query.cox_dp_information"
DP_QUERIES = (DP_COUNTS, DP_SCORE, DP_INFORMATION)
#: A numeric column without an agreed clip range is mapped by this many of its (set-up) standard deviations either
#: side of its (set-up) mean: a public range from the set-up's moments.
UNRANGED_SDS = 3.0
#: The private grid's last cut: the set-up's cut at this fraction of its list. The cuts follow equal steps of the
#: set-up's Kaplan-Meier curve, and the last ones trail into the public upper bound past every record's follow-up; a
#: grid ending there has no survivors in its last interval (hazard 1: a censoring rounds down), so it ends where
#: records are still at risk (GBSG and WHAS at 6 sites: 300-580 records followed past it) and later times are
#: censored there.
PRIVATE_LAST_CUT = 0.85


def private_setting(strategy: str) -> str:
    """The :class:`models.grouped_cox.NoisePlan` setting of a private ``coxph`` run of ``strategy``: ``sum``
    (``distributed_dp``: one Gaussian on the sum, the sites' discrete shares summed through SecAgg+) or ``per_site``
    (``dp_sgd``: every site adds the full noise in the clear)."""
    return "sum" if strategy == "distributed_dp" else "per_site"


def private_design(preprocessor: Preprocessor, cuts: np.ndarray, points: int) -> GroupedCoxDesign:
    """The public design of the private fit, from the set-up alone (every party builds it from its own copy): the
    grid of :func:`k_point_grid` of the set-up's cuts up to :data:`PRIVATE_LAST_CUT` of their list (0 put first),
    and per covariate of :class:`CoxDesign` (encoded units) its range, centre and spread: a numeric column's agreed
    clip range mapped by the set-up's mean and standard deviation (without one, :data:`UNRANGED_SDS` standard
    deviations either side), centre 0 (the set-up's mean), spread ``2 / (high - low)`` (one encoded standard deviation
    on the model's scale); a level ``[0, 1]``, centre 1/2, spread 1 (the largest a 0/1 column's can be)."""
    cox_design = CoxDesign.from_preprocessor(preprocessor)
    cuts = np.asarray(cuts, dtype=np.float64).reshape(-1)
    grid = k_point_grid(cuts[:int(round(PRIVATE_LAST_CUT * (cuts.size - 1))) + 1], points)
    grid = grid if grid[0] == 0 else np.concatenate([[0.0], grid[grid > 0]])
    numeric = {name: name for name in preprocessor.means}
    low, high, center = [], [], []
    for name in cox_design.names:
        if name in numeric:
            mean, std = preprocessor.means[name], preprocessor.stds[name]
            lo, hi = preprocessor.ranges.get(name, (mean - UNRANGED_SDS * std, mean + UNRANGED_SDS * std))
            low.append((lo - mean) / std)
            high.append((hi - mean) / std)
            center.append(min(max(0.0, low[-1]), high[-1]))
        else:
            low.append(0.0), high.append(1.0), center.append(0.5)
    low, high = np.asarray(low), np.asarray(high)
    spread = np.where([name in numeric for name in cox_design.names], 2.0 / (high - low), 1.0)
    return GroupedCoxDesign(grid=grid, low=low, high=high, names=cox_design.names, center=np.asarray(center),
                            scales=spread)


def private_records(design: GroupedCoxDesign, x: np.ndarray, time: np.ndarray, event: np.ndarray) -> SiteRecords:
    """A site's records as the private fit sees them (:func:`models.grouped_cox.prepare_site` on the covariates ``x``
    of :meth:`CoxDesign.covariates`), an event at time 0, the grid's first point (a death on the day of entry, as in
    FLCHAIN), counted in the first interval: the grouped-time model has no interval before it, and the exact fit keeps
    such a record as an event with every record at risk."""
    time = np.asarray(time, dtype=np.float64).reshape(-1)
    event = np.asarray(event).reshape(-1) > 0
    time = np.where(event & (time == design.grid[0]), design.grid[1], time)
    return prepare_site(design, x, time, event)


def private_total(cfg: ExperimentConfig, setup: SiteSetUp) -> float:
    """A site's total noise multiplier :math:`z` of the private fit: one Gaussian release (q = 1) that, after its
    set-up releases (``setup.prior``), spends ``(privacy.epsilon, privacy.delta)`` by the run's accountant; for a
    site with its own privacy filter, also one that fits what the filter has left (the larger). The recipe's
    releases, of multipliers :math:`z/\\sqrt{\\rho_k}`, compose to exactly this one Gaussian."""
    total = calibrate_noise_multiplier(target_epsilon=cfg.privacy.epsilon, target_delta=cfg.privacy.delta,
                                       sample_rate=1.0, steps=1, accountant=cfg.privacy.accountant,
                                       prior=tuple(setup.prior), epsilon_tolerance=1e-4 * cfg.privacy.epsilon)
    if setup.filter is not None:
        total = max(total, fitting_noise_multiplier(order=setup.filter.order, budget=setup.filter.remaining,
                                                    prior=tuple(setup.prior), sample_rate=1.0, steps=1))
    return float(total)


def private_plan(cfg: ExperimentConfig, setup: SiteSetUp, *, sites: int = 1) -> NoisePlan:
    """The site's :class:`models.grouped_cox.NoisePlan`: the recipe of :func:`private_setting` at
    :func:`private_total`. ``sites`` is read by the server's variances only (a site's own noise never depends on
    it: ``per_site`` adds the full noise, ``sum`` sizes its share by :func:`private_sum_plan`)."""
    setting = private_setting(cfg.strategy)
    return RECIPES[setting].plan(private_total(cfg, setup), setting=setting, sites=sites)


def private_releases(plan: NoisePlan) -> tuple[tuple[str, int, float], ...]:
    """The run's releases in order, ``(message type, step, share)``
    (:meth:`models.grouped_cox.PrivateServer.releases`): the counts, then per step k the information at θ_k where its
    share is > 0 (the last at θ_S) before the score (k < S)."""
    types = {gc.COUNTS: DP_COUNTS, gc.INFORMATION: DP_INFORMATION, gc.SCORE: DP_SCORE}
    return tuple((types[kind], step, share) for kind, step, share in gc.PrivateServer.releases(plan))


def private_sum_plan(cfg: ExperimentConfig, multiplier: float, *, parties: int, records: float, size: int,
                     honest_sites: tuple[float, ...] = ()) -> RoundPlan:
    """The secure sum of one ``distributed_dp`` release
    (:func:`strategies.mechanisms.distributed_dp.gaussian_sum_plan`): ``size`` values per record, each record's normalised vector of L2 norm at most 1 (clip 1), charged as the Gaussian
    ``(multiplier, 1, 1)``; modulus ``2^privacy.modulus_bits``; shares sized for the honest survivors, at most those
    the policies ``honest_sites`` count on (:func:`~strategies.mechanisms.distributed_dp.counted_honest`)."""
    return gaussian_sum_plan(multiplier=multiplier, parties=parties, max_dropouts=cfg.privacy.max_dropouts,
                             colluding=cfg.privacy.colluding_sites, records=records, size=size, clip=1.0,
                             modulus_bits=cfg.privacy.modulus_bits,
                             honest_cap=counted_honest(honest_sites, cfg.privacy.max_dropouts))


def private_release_size(message_type: str, design: GroupedCoxDesign, bounds: ClipBounds) -> int:
    """The number of values of a release: 2T counts, T + p score entries, or the released packed information's."""
    if message_type == DP_COUNTS:
        return 2 * design.intervals
    if message_type == DP_SCORE:
        return design.dim
    return int(np.count_nonzero(bounds.released))


def private_manifest(cfg: ExperimentConfig, setup: SiteSetUp | None) -> Manifest:
    """Every value a site sends in a private ``coxph`` run: the recipe's releases (:func:`private_releases`), each a
    Gaussian mechanism of multiplier ``z/sqrt(share)`` (the site's :func:`private_total` at ``setup``; without one the
    shares alone) on the record-level, add/remove-one sensitivity 1 of its normalised sums; the set-up's releases;
    no Breslow aggregates and no test metrics (the private fit makes no predictions)."""
    setting = private_setting(cfg.strategy)
    plan = None if setup is None else private_plan(cfg, setup)
    how = ("the site's discrete Gaussian share, masked by SecAgg+: the server sees only the sum over sites "
           f"(distributed discrete Gaussian summed modulo 2^{cfg.privacy.modulus_bits}, charged as the Gaussian of "
           "that multiplier on the union)" if setting == "sum" else "N(0, z^2 c_e^2) on every entry, in the clear")
    what = {DP_COUNTS: "once: the site's count histogram (events and censorings per interval of the public grid, 2T "
                       "numbers; one record adds 1 to one cell)",
            DP_SCORE: "outcome-blind clipped score sum at the server's theta (T + p numbers; "
                      "models.grouped_cox.site_step)",
            DP_INFORMATION: "outcome-blind clipped packed expected information at the server's theta (the final "
                            "theta in the recipe)"}
    releases = []
    for message_type, step, share in private_releases(RECIPES[setting].plan(1.0, setting=setting, sites=1)):
        label = {DP_COUNTS: "noisy counts", DP_SCORE: f"noisy score, step {step + 1}",
                 DP_INFORMATION: f"noisy information, at theta_{step}"}[message_type]
        multiplier = "" if plan is None else f", noise multiplier {plan.multiplier(share):.4g}"
        wire = ("query.secagg_masked/masked.masked",) if setting == "sum" else (f"{message_type}/{ARRAYS}.*",)
        releases.append(ReleasedValue(label, f"{what[message_type]}; {how}", "cox", True,
                                      f"Gaussian mechanism, record-level add/remove, share {share:g} of the budget"
                                      f"{multiplier}; composed with the set-up's releases by the "
                                      f"{cfg.privacy.accountant} accountant", wire))
    if setting == "sum":
        releases += _secure_sum_releases()
    releases += [release for release in common_releases(cfg, private=True, record_level=True,
                                                        private_setup=cfg.privacy.setup_share > 0)
                 if release.value not in ("Breslow aggregates", "test metrics")]
    return Manifest(cfg.strategy, "record", tuple(releases))
