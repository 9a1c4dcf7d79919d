"""A site's side of federated Cox regression (``model.name = "coxph"``; messages: :mod:`flwr_app.cox_messages`).

Every reply is computed from the site's *training* records only, encoded with the federation's shared preprocessing
(:class:`flwr_app.cox_messages.CoxDesign`), by the functions of :mod:`models.cox`. What the site computes is decided
by its own run config (``cox.strata``, ``cox.robust``, ``cox.ph_test``, ``cox.grid``): a query for anything else is
refused, and so is a β that is not ``p`` finite numbers of a plausible size and, with ``cox.grid = k``, any grid but
the k points of the set-up's time grid (:func:`flwr_app.cox_messages.k_point_grid` of the site's own copy). With
``cox.secure_sum`` the site answers only through the secure sum (:func:`secure_vector`, from
:func:`flwr_app.client_app.secagg_masked`; stratified, or pooled on the server's grid of ``cox.grid = k`` points)
and refuses a query in the clear (and without it, the reverse). Each reply is charged to the site's privacy policy
first (:func:`flwr_app.client_app._charge`: a site with a policy refuses these exact releases).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from flwr.app import ConfigRecord, Context, Message

from flwr_app.client_app import _charge, _run_config, _site
from flwr_app.cox_messages import (
    CONFIG,
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
    to_fixed,
)
from models import cox
from strategies.config import COXPH, ExperimentConfig

__all__ = ["event_times", "meat", "moments", "schoenfeld", "secure_vector", "sums"]


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
    from flwr_app import task
    from flwr_app.faults import inject_failure

    cfg = _run_config(context)
    if cfg.model.name != COXPH:
        raise ValueError(f"Cox query refused: this run's model.name is {cfg.model.name!r}, not {COXPH!r}")
    site, _ = _site(context, cfg)
    config = message.content.config_records.get(CONFIG, ConfigRecord())
    step = int(config.get("step", 0))
    secure = SECURE_QUERY in config
    if secure != cfg.cox.secure_sum:
        raise ValueError("Cox query refused: this run's config (cox.secure_sum = "
                         f"{str(cfg.cox.secure_sum).lower()}) sends the site's sums "
                         + ("only through the secure sum" if cfg.cox.secure_sum else "in the clear, not through a "
                            "secure sum"))
    inject_failure(cfg, site=site.name, server_round=step, message="cox")
    if cfg.data.deployed:  # the set-up the server sent this site, kept in its node state
        from flwr_app import deployment

        spec = deployment.stored_spec(context)
        preprocessor, cuts = spec.preprocessor, spec.cuts
    else:  # a simulated site computes the federation's set-up itself (deterministic in its own run config)
        preprocessor, cuts = task.load_federation(cfg).preprocessor, task.federation_setup(cfg).cuts
    design = CoxDesign.from_preprocessor(preprocessor)
    _charge(context, cfg, site, step, "cox", what, None)
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


def secure_vector(message: Message, context: Context, parties: int) -> np.ndarray:
    """The site's fixed-point vector for a secure sum's stage 2 (``cox.secure_sum``): the Cox query named by the
    message's :data:`~flwr_app.cox_messages.SECURE_QUERY` answered as in the clear (same checks, same ledger entry),
    then encoded by :func:`flwr_app.cox_messages.to_fixed` (refused, one line, if a value would overflow); a pooled
    Newton step's (``cox.strata = none``) in the layout of the server's grid, one entry per cell, and random but for
    its out-of-range count when its risk sums at the server's β and public scale are beyond the range."""
    config = message.content.config_records.get(CONFIG, ConfigRecord())
    query = str(config.get(SECURE_QUERY, ""))
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
