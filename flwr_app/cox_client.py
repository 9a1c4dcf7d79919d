"""A site's side of federated Cox regression (``model.name = "coxph"``; messages: :mod:`flwr_app.cox_messages`).

Every reply is computed from the site's *training* records only, encoded with the federation's shared preprocessing
(:class:`flwr_app.cox_messages.CoxDesign`), by the functions of :mod:`models.cox`. What the site computes is decided
by its own run config (``cox.strata``, ``cox.robust``, ``cox.ph_test``, ``cox.grid``): a query for anything else is
refused, and so is a β that is not ``p`` finite numbers of a plausible size and, with ``cox.grid = k``, any grid but
the k points of the set-up's time grid (:func:`flwr_app.cox_messages.k_point_grid` of the site's own copy). With
``cox.secure_sum`` the site answers only through the secure sum (:func:`secure_vector`, from
:func:`flwr_app.client_app.secagg_masked`; stratified, or pooled on the server's grid of ``cox.grid = k`` points)
and refuses a query in the clear (and without it, the reverse). Each reply is charged to the site's privacy policy
first (:func:`flwr_app.site_context.charge`: a site with a policy refuses these exact releases).

Under ``strategy.name = dp_sgd`` / ``distributed_dp`` the site answers only the private fit's releases
(:func:`dp_counts`, :func:`dp_score`, :func:`dp_information` in the clear, or :func:`private_vector` through the
secure sum) and refuses every exact query: its plan, design and noise come from its own run config and set-up
(:func:`flwr_app.cox_messages.private_plan`, :func:`~flwr_app.cox_messages.private_design`), each planned release is
made once, in order, charged to its policy first (:func:`_private_request`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from flwr.app import ConfigRecord, Context, Message

from flwr_app.cox_messages import (
    CONFIG,
    DP_COUNTS,
    DP_INFORMATION,
    DP_QUERIES,
    DP_SCORE,
    MEAT,
    MOMENTS,
    RISK_SET,
    SCHOENFELD,
    SECURE_QUERY,
    SUMS,
    CoxDesign,
    check_beta,
    decode,
    encode,
    k_point_grid,
    private_design,
    private_plan,
    private_records,
    private_releases,
    private_setting,
    private_sum_plan,
    to_fixed,
)
from flwr_app.site_context import (
    SECAGG_ROUND,
    SECAGG_STATE,
    charge,
    node_site,
    own_honest_sites,
    run_config,
    site_setup,
    tolerated_dropouts,
)
from flwr_app import site_policy
from models import cox, grouped_cox
from models.grouped_cox import RECIPES
from strategies.config import COXPH, ExperimentConfig

__all__ = ["dp_counts", "dp_information", "dp_score", "event_times", "meat", "moments", "private_rows",
           "private_vector", "schoenfeld", "secure_vector", "sums"]


@dataclass(frozen=True)
class _Request:
    """What a Cox query starts with: the run config, the site's name, its covariates and outcomes, the arrays, and
    the site's own copy of the set-up's time grid (``cuts``: what a ``cox.grid = k`` query's grid must come from)."""

    cfg: ExperimentConfig
    site: str
    x: np.ndarray
    time: np.ndarray
    event: np.ndarray
    arrays: dict[str, np.ndarray]
    step: int
    cuts: np.ndarray


def _request(message: Message, context: Context, what: str) -> _Request:
    from flwr_app.faults import inject_failure

    cfg = run_config(context)
    if cfg.model.name != COXPH:
        raise ValueError(f"Cox query refused: this run's model.name is {cfg.model.name!r}, not {COXPH!r}")
    if cfg.strategy != "fedavg":
        raise ValueError(f"Cox query refused: strategy.name = {cfg.strategy!r} releases only the private fit's noisy "
                         "sums, never the exact ones")
    site, _ = node_site(context, cfg)
    config = message.content.config_records.get(CONFIG, ConfigRecord())
    step = int(config.get("step", 0))
    secure = SECURE_QUERY in config
    if secure != cfg.cox.secure_sum:
        raise ValueError("Cox query refused: this run's config (cox.secure_sum = "
                         f"{str(cfg.cox.secure_sum).lower()}) sends the site's sums "
                         + ("only through the secure sum" if cfg.cox.secure_sum else "in the clear, not through a "
                            "secure sum"))
    inject_failure(cfg, site=site.name, server_round=step, message="cox")
    preprocessor, cuts = _own_setup(cfg, context)
    design = CoxDesign.from_preprocessor(preprocessor)
    charge(context, cfg, site, step, "cox", what, None)
    arrays = decode(message.content) if message.content.array_records else {}
    return _Request(cfg, site.name, design.covariates(site.train.x), np.asarray(site.train.time, dtype=np.float64),
                    np.asarray(site.train.event) > 0, arrays, step, np.asarray(cuts, dtype=np.float64))


def _reply(message: Message, request: _Request, arrays: dict[str, np.ndarray]) -> Message:
    content = encode(arrays)
    content["site"] = ConfigRecord({"name": request.site})
    return Message(content=content, reply_to=message)


def _grid(request: _Request, name: str = "grid") -> np.ndarray:
    """The server's pooled grid, as the site accepts it: finite and strictly increasing; with ``cox.grid = k`` (the
    site's own run config) exactly :func:`~flwr_app.cox_messages.k_point_grid` of the site's own copy of the
    set-up's cuts, so that no grid the server picks (finer, or placed around single records) gets the site's sums
    on more cells than the manifest's k points. ``cox.grid = events`` takes any such grid (its manifest releases
    the union of the sites' event times, which the site cannot check beyond its own)."""
    grid = np.asarray(request.arrays.get(name, np.empty(0)), dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(np.diff(grid) <= 0):
        raise ValueError("Cox query refused: the grid must be a finite, strictly increasing list of times")
    planned = request.cfg.cox.grid
    if planned != "events":
        expected = k_point_grid(request.cuts, int(planned))
        if not np.array_equal(grid, expected):
            raise ValueError(f"Cox query refused: this run's config (cox.grid = {planned}) answers only on the "
                             f"{expected.size} points of the set-up's time grid it picks ({expected[0]:g} to "
                             f"{expected[-1]:g}), got {grid.size} point(s)"
                             + (" that differ" if grid.size == expected.size else ""))
    return grid


def _broadcast(request: _Request, name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = np.asarray(request.arrays.get(name, np.empty(0)), dtype=np.float64)
    if value.shape != shape or not np.all(np.isfinite(value)):
        raise ValueError(f"Cox query refused: '{name}' must be {shape} finite numbers, got shape {value.shape}")
    return value


def moments(message: Message, context: Context) -> Message:
    """The record count and each covariate's sum and sum of squares (:func:`models.cox.site_column_moments`)."""
    request = _request(message, context, "covariate moments")
    found = cox.site_column_moments(request.x)
    return _reply(message, request, {"n": np.array([found.n]), "total": found.total, "total_sq": found.total_sq})


def event_times(message: Message, context: Context) -> Message:
    """The distinct training event times (the pooled grid of ``cox.grid = events``); refused by any other run."""
    request = _request(message, context, "event times")
    cox_cfg = request.cfg.cox
    if cox_cfg.strata != "none" or cox_cfg.grid != "events":
        raise ValueError("Cox query refused: this run's config (cox.strata, cox.grid) does not plan to release the "
                         "site's event times")
    return _reply(message, request, {"times": np.unique(request.time[request.event])})


def sums(message: Message, context: Context) -> Message:
    """One Newton step at the server's β: :class:`models.cox.CoxSums` (stratified) or :class:`models.cox.RiskSetSums`
    on the server's grid (pooled), each cell's risk-weighted sums of ``exp(x'β - c_k)`` with ``c`` the query's
    public ``log_scale`` (one finite number per cell, 0 when the query has none; ``cox.secure_sum`` sends it: see
    :func:`flwr_app.cox_messages.secure_log_scale`)."""
    request = _request(message, context, "Cox sums")
    beta = check_beta(request.arrays.get("beta"), request.x.shape[1])
    if request.cfg.cox.strata == "site":
        found = cox.site_sums_stratified(request.x, request.time, request.event, beta)
        return _reply(message, request, {"loglik": np.array([found.loglik]), "score": found.score,
                                         "information": found.information, "n": np.array([found.n]),
                                         "events": np.array([found.events])})
    grid = _grid(request)
    log_scale = _broadcast(request, "log_scale", grid.shape) if "log_scale" in request.arrays else 0.0
    total = cox.site_risk_set_sums(request.x, request.time, request.event, beta, grid, log_scale=log_scale)
    return _reply(message, request, {"n": np.array([total.n]), **{name: getattr(total, name) for name in RISK_SET}})


def meat(message: Message, context: Context) -> Message:
    """The site's :math:`\\sum r r^\\top` of score residuals at the final β (robust variance); refused unless the
    run's config sets ``cox.robust``."""
    request = _request(message, context, "score-residual cross-products")
    if not request.cfg.cox.robust:
        raise ValueError("Cox query refused: this run's config does not ask for robust standard errors (cox.robust)")
    p = request.x.shape[1]
    beta = check_beta(request.arrays.get("beta"), p)
    if request.cfg.cox.strata == "site":
        found = cox.site_score_residual_sums(request.x, request.time, request.event, beta)
    else:
        grid = _grid(request)
        found = cox.site_score_residual_sums_pooled(
            request.x, request.time, request.event, beta, grid, _broadcast(request, "hazard_increment", grid.shape),
            _broadcast(request, "mean_x", (grid.size, p)))
    return _reply(message, request, {"meat": found})


def schoenfeld(message: Message, context: Context) -> Message:
    """The site's :class:`models.cox.SchoenfeldSums` at the final β with the run's ``cox.ph_test`` time transform;
    refused when it is ``none``. Through the secure sum the ``identity`` transform is in units of the set-up's last
    cut, the same public number at every site, so that the squared times stay within the fixed point's range: the
    test statistic does not change when every transformed time is scaled by one number."""
    request = _request(message, context, "Schoenfeld sums")
    transform = request.cfg.cox.ph_test
    if transform == "none":
        raise ValueError("Cox query refused: this run's config asks for no proportional-hazards test (cox.ph_test)")
    p = request.x.shape[1]
    beta = check_beta(request.arrays.get("beta"), p)
    x, time, event = request.x, request.time, request.event
    if request.cfg.cox.strata == "site":
        offset = int(np.asarray(request.arrays.get("rank_offset", [0])).reshape(-1)[0])
        if offset < 0:
            raise ValueError("Cox query refused: rank_offset must be >= 0")
        g = cox.time_transform(time, event, transform, rank_offset=offset)
        if transform == "identity" and request.cfg.cox.secure_sum:  # in units of the set-up's follow-up (public)
            g = g / request.cuts[-1]
        found = cox.site_schoenfeld_sums(x, time, event, beta, g)
    else:
        grid = _grid(request)
        km = None
        if transform == "km":
            km = pd.Series(_broadcast(request, "km", grid.shape), index=grid)
        g = cox.time_transform(time, event, transform, km=km)
        found = cox.site_schoenfeld_sums(x, time, event, beta, g, grid=grid,
                                         event_means=_event_means(request, grid.size, p))
    return _reply(message, request, {"events": np.array([found.events]), "g_sum": np.array([found.g_sum]),
                                     "g_sq_sum": np.array([found.g_sq_sum]), "residual_sum": found.residual_sum,
                                     "g_residual_sum": found.g_residual_sum})


def _event_means(request: _Request, m: int, p: int) -> np.ndarray:
    """The pooled Efron means per grid point (NaN where the grid point has no event)."""
    value = np.asarray(request.arrays.get("event_means", np.empty(0)), dtype=np.float64)
    if value.shape != (m, p) or np.any(np.isinf(value)):
        raise ValueError(f"Cox query refused: 'event_means' must be ({m}, {p}) numbers, got shape {value.shape}")
    return value


# ------------------------------------------------------------------ the private fit (dp_sgd, distributed_dp)

#: Node state: how many of the run's private releases (:func:`~flwr_app.cox_messages.private_releases`) the site made.
PRIVATE_STATE = "cox.private.released"
#: Stream of a site's private-fit noise (beside the other draws from its seed).
PRIVATE_STREAM = 29


@dataclass(frozen=True)
class _Private:
    """A private release as the site decided it from its own run config and set-up: the records, the public design,
    bounds and plan, the release (message type, step, share, its position in the plan) and the server's θ."""

    cfg: ExperimentConfig
    site: str
    index: int
    records: grouped_cox.SiteRecords
    design: grouped_cox.GroupedCoxDesign
    bounds: grouped_cox.ClipBounds
    plan: grouped_cox.NoisePlan
    kind: str
    step: int
    share: float
    position: int
    theta: np.ndarray | None


def _private_request(message: Message, context: Context, kind: str, *, secure: bool) -> _Private:
    """Check, charge and record one private release: refused (one line) unless the run is a private ``coxph`` whose
    path (clear for ``dp_sgd``, secure sum for ``distributed_dp``) this is, the release is the next of the site's own
    plan (each once, in order; no release beyond it) and θ is T + p finite numbers with every α in
    :data:`models.grouped_cox.ALPHA_RANGE`. Charged to the site's policy first (the first release with the whole
    run's plan, so that a policy site refuses a run it cannot fit up front), then marked as made."""
    from flwr_app.faults import inject_failure

    cfg = run_config(context)
    if cfg.model.name != COXPH or cfg.strategy not in ("dp_sgd", "distributed_dp"):
        raise ValueError(f"Cox query refused: this run (model.name {cfg.model.name!r}, strategy.name "
                         f"{cfg.strategy!r}) makes no private Cox release")
    if secure != (cfg.strategy == "distributed_dp"):
        raise ValueError(f"Cox query refused: strategy.name = {cfg.strategy!r} sends the private releases "
                         + ("only through the secure sum" if cfg.strategy == "distributed_dp" else "in the clear"))
    site, index = node_site(context, cfg)
    config = message.content.config_records.get(CONFIG, ConfigRecord())
    step = int(config.get("step", 0))
    inject_failure(cfg, site=site.name, server_round=step, message="cox")
    preprocessor, cuts = _own_setup(cfg, context)
    setup = site_setup(cfg, context, site)
    design = private_design(preprocessor, cuts, int(cfg.cox.grid))
    plan = private_plan(cfg, setup)
    releases = private_releases(plan)
    stored = context.state.config_records.get(PRIVATE_STATE)
    position = 0 if stored is None else int(stored["made"])
    if position >= len(releases) or releases[position][:2] != (kind, step):
        planned = "none (the plan is spent)" if position >= len(releases) else f"{releases[position][0]} step " \
                                                                                f"{releases[position][1]}"
        raise ValueError(f"Cox query refused: {kind} step {step} is not this site's next planned release ({planned}; "
                         f"{position} of {len(releases)} made): a release is made once, in the plan's order")
    arrays = decode(message.content) if message.content.array_records else {}
    if set(arrays) - {"theta"} or (kind == DP_COUNTS and arrays):
        raise ValueError(f"Cox query refused: a private release takes only the server's theta (none for the counts); "
                         f"the grid and design are the site's own, got {', '.join(sorted(arrays))}")
    theta = None if kind == DP_COUNTS else _private_theta(arrays.get("theta"), design)
    history = tuple(plan.history())
    request = site_policy.Request(cfg.strategy, context.run_id, step, "cox", f"private Cox {kind.split('_', 2)[-1]}",
                                  (history[position],), plan=history[position + 1:] if position == 0 else (),
                                  epsilon=cfg.privacy.epsilon if position == 0 else None, delta=cfg.privacy.delta)
    site_policy.enforce(context.node_config, site.name, request)
    context.state[PRIVATE_STATE] = ConfigRecord({"made": position + 1})
    x = CoxDesign.from_preprocessor(preprocessor).covariates(site.train.x)
    records = private_records(design, x, site.train.time, site.train.event)
    bounds = RECIPES[private_setting(cfg.strategy)].clip_bounds(design)
    return _Private(cfg, site.name, index, records, design, bounds, plan, kind, step, releases[position][2], position,
                    theta)


def _own_setup(cfg: ExperimentConfig, context: Context) -> tuple[Any, np.ndarray]:
    """The site's own copy of the set-up's preprocessor and time grid (never values from a Cox message): a deployed
    site's, as the server sent it at set-up and the site kept it in its node state; a simulated site computes the
    federation's set-up itself (deterministic in its own run config)."""
    from flwr_app import task

    if cfg.data.deployed:
        from flwr_app import deployment

        spec = deployment.stored_spec(context)
        return spec.preprocessor, np.asarray(spec.cuts, dtype=np.float64)
    return task.load_federation(cfg).preprocessor, np.asarray(task.federation_setup(cfg).cuts, dtype=np.float64)


def _private_theta(theta: np.ndarray | None, design: grouped_cox.GroupedCoxDesign) -> np.ndarray:
    """The server's θ as a site accepts it: T + p finite numbers, every α in ALPHA_RANGE (one line otherwise)."""
    if theta is None:
        raise ValueError("Cox query refused: the message carries no theta")
    theta = np.asarray(theta, dtype=np.float64)
    if theta.ndim != 1 or theta.size != design.dim or not np.all(np.isfinite(theta)):
        raise ValueError(f"Cox query refused: theta must be T + p = {design.dim} finite numbers, got shape "
                         f"{theta.shape}")
    low, high = grouped_cox.ALPHA_RANGE
    alpha = theta[:design.intervals]
    if np.any((alpha < low) | (alpha > high)):
        raise ValueError(f"Cox query refused: every alpha of theta must lie in [{low:.4g}, {high:.4g}] "
                         "(models.grouped_cox.ALPHA_RANGE)")
    return theta


def _private_rng(request: _Private) -> np.random.Generator:
    """The release's noise: a simulation's seeded stream, a deployed site's operating-system entropy
    (:func:`flwr_app.task.site_seed`)."""
    from flwr_app import task

    return np.random.default_rng([task.site_seed(request.cfg, request.position + 1, request.index), PRIVATE_STREAM])


def private_rows(request: _Private) -> np.ndarray:
    """Each record's normalised release (records, values), every row of L2 norm at most 1: its count cell (one-hot),
    or its outcome-blind weighted, truncated score or information (:func:`models.grouped_cox.site_step`'s terms,
    safety clip included) divided by the per-entry bounds, the information on its released entries only. Their sum
    times the bounds is :func:`models.grouped_cox.site_step`'s sum."""
    records, bounds, t = request.records, request.bounds, request.design.intervals
    if request.kind == DP_COUNTS:
        held = records.at_risk > 0
        cell = records.at_risk[held] - 1 + np.where(records.event[held], 0, t)
        return np.eye(2 * t)[cell]
    weight, horizon = grouped_cox.record_bounds(records, request.theta, bounds)
    cut = grouped_cox.truncate(records, horizon)
    if request.kind == DP_SCORE:
        g = grouped_cox.record_score(cut, request.theta) * weight[:, None]
        return g * grouped_cox.clip_factors(g, bounds.score)[:, None] / bounds.score
    factor = weight * grouped_cox.information_factor(records, request.theta, bounds, weight, horizon)
    v = np.where(bounds.released, grouped_cox.record_information(cut, request.theta), 0.0) * factor[:, None]
    v = v * grouped_cox.clip_factors(v, bounds.information)[:, None]
    return (v / bounds.information)[:, bounds.released]


def _private_clear(message: Message, context: Context, kind: str) -> Message:
    """A ``dp_sgd`` site's private release in the clear: :func:`models.grouped_cox.site_count_release` or
    :func:`models.grouped_cox.site_release` (the site adds the full noise of its plan)."""
    request = _private_request(message, context, kind, secure=False)
    rng = _private_rng(request)
    if kind == DP_COUNTS:
        arrays = {"counts": grouped_cox.site_count_release(request.records, request.plan, rng)}
    else:
        score_share = request.share if kind == DP_SCORE else 0.0
        release = grouped_cox.site_release(request.records, request.theta, request.bounds, request.plan,
                                           score_share=score_share, info_share=request.share - score_share, rng=rng)
        arrays = {"score": release.score} if kind == DP_SCORE else {"information": release.information}
    content = encode(arrays)
    content["site"] = ConfigRecord({"name": request.site})
    return Message(content=content, reply_to=message)


def dp_counts(message: Message, context: Context) -> Message:
    """``dp_sgd``: the site's noisy count histogram (once, first)."""
    return _private_clear(message, context, DP_COUNTS)


def dp_score(message: Message, context: Context) -> Message:
    """``dp_sgd``: the site's noisy outcome-blind score sum at the server's θ (each planned step once, in order)."""
    return _private_clear(message, context, DP_SCORE)


def dp_information(message: Message, context: Context) -> Message:
    """``dp_sgd``: the site's noisy packed information at the server's θ (once, the plan's)."""
    return _private_clear(message, context, DP_INFORMATION)


def private_vector(message: Message, context: Context, parties: int) -> np.ndarray:
    """A ``distributed_dp`` site's integer vector for a private release's secure sum: :func:`private_rows` through
    :func:`strategies.mechanisms.distributed_dp.gaussian_sum_contribution` with the plan of
    :func:`~flwr_app.cox_messages.private_sum_plan` at the release's multiplier, sized from the site's own policy
    (``privacy-min-honest-sites``) and the drop-outs its Shamir sharing tolerates, never from a figure the server
    sends but the parties and records of the round (which can only make the sum wrap, never shrink the share below
    what the honest count allows)."""
    from strategies import secure_aggregation as secagg
    from strategies.mechanisms.distributed_dp import gaussian_sum_contribution

    kind = str(message.content.config_records[CONFIG][SECURE_QUERY])
    request = _private_request(message, context, kind, secure=True)
    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    cfg = tolerated_dropouts(request.cfg, context, state)
    rows = private_rows(request)
    records = float(context.state.config_records[SECAGG_ROUND]["records"])
    plan = private_sum_plan(cfg, request.plan.multiplier(request.share), parties=parties, records=records,
                            size=rows.shape[1], honest_sites=own_honest_sites(context))
    return gaussian_sum_contribution(rows, plan, clip=1.0, rng=_private_rng(request))


def secure_vector(message: Message, context: Context, parties: int) -> np.ndarray:
    """The site's fixed-point vector for a secure sum's stage 2 (``cox.secure_sum``): the Cox query named by the
    message's :data:`~flwr_app.cox_messages.SECURE_QUERY` answered as in the clear (same checks, same ledger entry),
    then encoded by :func:`flwr_app.cox_messages.to_fixed` (refused, one line, if a value would overflow); a pooled
    Newton step's (``cox.strata = none``) in the layout of the server's grid, one entry per cell, and random but for
    its out-of-range count when its risk sums at the server's β and public scale are beyond the range."""
    config = message.content.config_records.get(CONFIG, ConfigRecord())
    query = str(config.get(SECURE_QUERY, ""))
    if query in DP_QUERIES:
        return private_vector(message, context, parties)
    handlers = {MOMENTS: moments, SUMS: sums, MEAT: meat, SCHOENFELD: schoenfeld}
    if query not in handlers:
        raise ValueError(f"Cox query refused: {query!r} has no secure sum (cox.secure_sum)")
    reply = handlers[query](message, context)
    arrays = decode(reply.content)
    pooled = query == SUMS and "risk_x" in arrays  # cox.strata = none: the risk-set sums on the server's grid
    first = "risk_x" if pooled else {MOMENTS: "total", SUMS: "score", MEAT: "meat", SCHOENFELD: "residual_sum"}[query]
    p = int(np.asarray(arrays[first]).shape[-1])  # the number of covariates
    m = int(np.asarray(arrays["risk_x"]).shape[0]) if pooled else None  # the grid's cells
    return to_fixed(arrays, query, p, parties=parties, site=str(reply.content.config_records["site"]["name"]), m=m)
