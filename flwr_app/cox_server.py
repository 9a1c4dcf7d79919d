r"""The ServerApp's side of federated Cox regression (``model.name = "coxph"``): Newton-Raphson on the sites' sums.

:class:`CoxphRun` is the run kind (:class:`flwr_app.server_program.RunKind`) that
:func:`flwr_app.horizontal_server.run_horizontal` plugs into the one server program
(:func:`flwr_app.server_program.run_program`) once the sites are named and agree the preprocessing (the set-up every
horizontal run makes), in place of the FedAvg rounds. Then, with the messages of :mod:`flwr_app.cox_messages`
(answered by :mod:`flwr_app.cox_client`) and the sums of :mod:`models.cox`:

1. ``cox_moments``: the covariates' pooled mean and standard deviation (lifelines standardises every column with
   them, and applies its ridge penalty ``cox.penalizer`` on that scale);
2. (``cox.strata = none``) the pooled grid of the risk-set sums: every site's distinct event times
   (``cox.grid = events``: the exact pooled fit) or k points of the set-up's time grid (``cox.grid = k``);
3. Newton-Raphson (:func:`models.cox.newton_raphson`, step halving): each evaluation sends β to every site
   (``cox_sums``, per unit of the encoded columns) and adds the replies, :class:`~models.cox.CoxSums` within each
   site's stratum (``strata = site``, lifelines' ``CoxPHFitter(strata=["site"])``) or
   :class:`~models.cox.RiskSetSums` on the pooled grid (``strata = none``, ``CoxPHFitter()``), in the order of the
   sites' names. The sites are the same at every step: a site that fails, does not answer within
   ``federation.timeout_s`` or sends a malformed reply stops the run with one line naming it
   (:class:`CoxSiteError`), because a Newton fit on a changing set of sites mixes two likelihoods;
4. at the final β: the sandwich's meat (``cox.robust``, ``cox_meat``) and the proportional-hazards test's sums
   (``cox.ph_test``, ``cox_schoenfeld``);
5. the result per unit of the user's columns (:class:`models.cox.CoxResult`: a numeric column's coefficient is per
   unit of the raw column, the preprocessing's standardisation undone; a categorical column has one coefficient per
   level but its reference level, named in the outputs);
6. for predictions, the fitted linear model's federated Breslow baseline on the set-up's time grid and the sites'
   test metrics (the ``breslow`` and ``evaluate`` messages every Cox model of the app uses,
   :class:`strategies.horizontal.SurvivalFedAvg`). With ``cox.strata = site`` the baseline is the pooled Breslow
   estimator at the stratified fit's β (every site's records in one risk set): the usual "average baseline"
   prediction of a stratified model, which has no single baseline of its own. In a simulation the server also
   scores the model on the pooled test split (Harrell's C of the linear predictor, IBS, ...).

With ``cox.secure_sum`` (``cox.strata = site``, or ``none`` with ``cox.grid = k``) every query of steps 1, 3 and 4
is one run of SecAgg+ (:meth:`_Sites.secure_sum`: 4 round trips, no noise, the fixed point of
:mod:`flwr_app.cox_messages`): the server gets only the sum over sites (pooled: every cell's risk-set sums on the
public grid, from which it computes the Newton terms, the sandwich's broadcast and the PH test's Efron means and
Kaplan-Meier curve as in the clear), and a site failing or dropping out of it stops the run naming that site.

With ``strategy.name = dp_sgd`` / ``distributed_dp`` the fit is the private grouped-time model instead
(:class:`PrivateCoxphRun`: :mod:`models.grouped_cox` over messages, no predictions).

Outputs, beside the usual ``config.json``, ``manifest.json`` (every value a site sends, none covered by any ε),
``ledger.jsonl``, ``metrics.jsonl`` (one line per Newton evaluation, one for the evaluation), ``model.pt`` and
``preprocessing.json`` (:func:`models.predict.load_run` gives a :class:`models.cox_run.CoxRun`) and
``summary.json`` (its ``coxph`` entry holds the key figures): :data:`COXPH_JSON` (β, variances, names, reference
levels, log-likelihoods, n, events, steps, the PH test table) and :data:`COXPH_SUMMARY` (lifelines' summary
columns, one row per covariate).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from flwr_app import task
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.cox_messages import (
    AFTER_FIT,
    DP_COUNTS,
    DP_INFORMATION,
    DP_SCORE,
    EVENT_TIMES,
    MAX_ABS_BETA,
    MEAT,
    MOMENTS,
    OUT_OF_RANGE,
    RISK_SET,
    SCHOENFELD,
    SECURE_BOOKKEEPING,
    SECURE_MODULUS_BITS,
    SECURE_QUERY,
    SUMS,
    CoxDesign,
    coxph_manifest,
    decode,
    encode,
    from_fixed,
    k_point_grid,
    private_design,
    private_plan,
    private_release_size,
    private_releases,
    private_setting,
    private_sum_plan,
    secure_layout,
    secure_log_scale,
    secure_seen,
)
from flwr_app.outputs import RunOutputs, write_json
from models import cox
from models import grouped_cox as gc
from models.data import FederatedDataset
from models.metrics import km_null_check, km_null_warning
from models.survival import SurvivalModel
from strategies.accounting.ledger import LedgerEntry, PrivacyLedger
from strategies.config import CENTRALIZED_LABEL, CoxConfig, DataConfig
from strategies.horizontal import (
    NO_TEST_PART,
    SurvivalFedAvg,
    holds_test_part,
    site_average,
    site_metrics,
    weighted_nanmean,
)
from strategies.mechanisms.manifest import Manifest
from strategies.replies import error_message

__all__ = ["COXPH_JSON", "COXPH_SUMMARY", "CoxSetup", "CoxSiteError", "CoxphRun", "PrivateCoxphRun", "cox_run"]

#: The fit's figures (JSON) and lifelines' summary table (CSV) in the run's directory.
COXPH_JSON = "coxph.json"
COXPH_SUMMARY = "coxph_summary.csv"
#: The ``server-round`` of the Breslow and evaluation messages after the fit (and of the ledger's entries).
EVALUATION_ROUND = 1
#: The ledger's statement of a coxph run (every site, one entry).
NO_PRIVACY = ("Cox regression by Newton-Raphson on the sites' exact sums: every value in manifest.json reaches the "
              "server in the clear")
#: The ledger's statement of a coxph run with ``cox.secure_sum``; ``{seen}``: :func:`flwr_app.cox_messages.secure_seen`.
SECURE_NO_NOISE = ("Cox regression by Newton-Raphson on the sums over sites through SecAgg+ (cox.secure_sum, no "
                   "noise): the server sees {seen}, and " + SECURE_BOOKKEEPING)
#: The confidence level's complement of the summary's intervals (lifelines' default).
ALPHA = 0.05


class CoxSiteError(RuntimeError):
    """A site failed, did not answer or sent a malformed reply during the fit: the run stops (one line, naming it)."""


class _Sites:
    """The sites of the fit, in the order of their names (lifelines' stratum order), asked together each time."""

    def __init__(self, grid: Grid, node_sites: Mapping[int, str], *, timeout: float, directory: str,
                 secure: bool = False, p: int = 0, colluding: int = 0, seed: int = 0) -> None:
        self.grid = grid
        self.nodes = sorted(node_sites.items(), key=lambda item: item[1])
        self.names = dict(self.nodes)
        self.timeout = timeout
        self.directory = directory
        self.secure, self.p, self.colluding, self.seed = secure, p, colluding, seed
        self.secure_sums = 0

    def stop(self, what: str, site: str, node: int, reason: str) -> CoxSiteError:
        reason = " ".join(str(reason).split())
        return CoxSiteError(f"coxph stopped at {what}: site '{site}' (node {node}) {reason}; a Newton fit must use the "
                            f"same sites at every step, so the run stops (outputs so far in {self.directory})")

    def ask(self, message_type: str, what: str, arrays: Mapping[str, np.ndarray], *, step: int = AFTER_FIT,
            per_site: Mapping[str, Mapping[str, np.ndarray]] | None = None,
            expect: Mapping[str, Callable[[int], tuple[int, ...]] | tuple[int, ...]] | None = None,
            ) -> dict[str, dict[str, np.ndarray]]:
        """Send every site ``arrays`` (and its own ``per_site`` ones); return each site's reply arrays by name.

        ``expect``: the shape of each array a reply must carry (finite numbers; NaN nowhere). Any failure stops the
        run (:class:`CoxSiteError`). With ``cox.secure_sum`` (:meth:`secure_sum`) the one reply is the sum over
        sites, under the name :data:`SUM_OVER_SITES`.
        """
        if self.secure:
            return {SUM_OVER_SITES: self.secure_sum(message_type, what, arrays, step=step)}
        messages = [Message(content=encode({**arrays, **(per_site or {}).get(name, {})}, {"step": step}),
                            dst_node_id=node, message_type=message_type) for node, name in self.nodes]
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))  # a deployment's grid carries the agreed set-up
        sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages
                if message.metadata.message_id}
        answered: dict[str, dict[str, np.ndarray]] = {}
        for reply in replies:
            node = sent.get(reply.metadata.reply_to_message_id)
            if node is None or self.names[node] in answered:
                continue
            name = self.names[node]
            if reply.has_error():
                raise self.stop(what, name, node, f"failed: {error_message(reply.error.reason)}")
            site_record = reply.content.config_records.get("site")
            claimed = None if site_record is None else site_record.get("name")
            if claimed != name:
                raise self.stop(what, name, node, f"sent a reply claiming to come from site {claimed!r}: refused")
            try:
                found = decode(reply.content)
            except ValueError as err:
                raise self.stop(what, name, node, f"sent a malformed reply: {err}") from None
            for key, shape in (expect or {}).items():
                value = found.get(key)
                if value is None or value.shape != tuple(shape) or not np.all(np.isfinite(value)):
                    got = "nothing" if value is None else f"shape {value.shape}" + (
                        "" if np.all(np.isfinite(value)) else " with non-finite values")
                    raise self.stop(what, name, node, f"sent a malformed reply: '{key}' must be {tuple(shape)} "
                                                      f"finite numbers, got {got}")
            answered[name] = found
        for node, name in self.nodes:
            if name not in answered:
                raise self.stop(what, name, node, f"sent no reply within federation.timeout_s = {self.timeout:g} s")
        return answered


    def secure_sum(self, message_type: str, what: str, arrays: Mapping[str, np.ndarray], *, step: int
                   ) -> dict[str, np.ndarray]:
        """The sites' replies to ``message_type`` summed through SecAgg+ (no noise), in their clear shapes
        (:func:`~flwr_app.cox_messages.secure_layout`; a pooled Newton step's, which carries the ``grid``, per cell
        of it): every site must complete the protocol (:meth:`secure_total`; a Newton fit never steps on a changed
        population)."""
        from strategies.secure_aggregation import centred

        m = int(np.asarray(arrays["grid"]).size) if message_type == SUMS and "grid" in arrays else None
        dimension = sum(length for _, _, length in secure_layout(message_type, self.p, m))
        modulus = 2 ** SECURE_MODULUS_BITS
        total = self.secure_total(message_type, what, arrays, step=step, modulus=modulus, dimension=dimension)
        return from_fixed(centred(total, modulus).astype(np.float64), message_type, self.p, m)

    def secure_total(self, message_type: str, what: str, arrays: Mapping[str, np.ndarray], *, step: int, modulus: int,
                     dimension: int, records: float = 0.0, max_dropouts: int = 0) -> np.ndarray:
        """One SecAgg+ run over every site (stage 2 carrying ``arrays`` and the query's type) and its unmasked total
        modulo ``modulus``; the round's public figures are the sites and ``records``. Every site must complete it: a
        failure or drop-out at any stage stops the run naming the site."""
        from strategies.secure_aggregation import SecureSum, protocol_parameters

        nodes = [node for node, _ in self.nodes]
        num_shares, threshold = protocol_parameters(len(nodes), max_dropouts=max_dropouts, colluding=self.colluding)
        self.secure_sums += 1
        secure = SecureSum(modulus=modulus, num_shares=num_shares, threshold=threshold, dimension=dimension,
                           timeout=self.timeout, shuffle_seed=self.seed * 100_003 + self.secure_sums)
        result = secure.run(self.grid, nodes, setup={"parties": len(nodes), "records": float(records)},
                            masked_content=lambda node: encode(arrays, {"step": step, SECURE_QUERY: message_type}),
                            group=f"cox-{self.secure_sums}", min_included=len(nodes))
        for stage, node, reason in result.failures:
            if reason.startswith("the site failed: "):
                reason = "failed: " + error_message(reason.removeprefix("the site failed: "))
            raise self.stop(what, self.names.get(node, "?"), node, f"in the secure sum's "
                                                                    f"{stage.removeprefix('query.')} stage, {reason}")
        if result.total is None or sorted(result.included) != sorted(nodes):
            raise CoxSiteError(f"coxph stopped at {what}: the secure sum did not complete ({result.shortfall}); a "
                               f"Newton fit must use the same sites at every step (outputs so far in "
                               f"{self.directory})")
        return np.asarray(result.total)


#: The one "site" of a secure sum's reply: the sum over every site.
SUM_OVER_SITES = "(sum over sites)"


@dataclass
class _Newton:
    """The Newton-Raphson loop's view of the sites: one query per evaluation, the replies summed.

    With ``cox.secure_sum`` and ``cox.strata = none`` every pooled query carries the public scale ``log_scale``
    (one number per grid cell, the same for every site: :func:`~flwr_app.cox_messages.secure_log_scale`, at the
    start from the moments, then from the summed sums of each point Newton accepts, :meth:`accept`), and an
    evaluation at which sites were out of the fixed point's range (their number only; ``out_of_range`` lists
    ``(evaluation, sites)``) counts as a failed trial step: Newton halves it, as for a lower log-likelihood."""

    sites: _Sites
    design: CoxDesign
    std: np.ndarray
    strata: str
    grid: np.ndarray | None
    outputs: RunOutputs
    started: float
    calls: int = 0
    site_events: dict[str, int] = field(default_factory=dict)
    totals: dict[bytes, cox.RiskSetSums] = field(default_factory=dict)
    log_scale: np.ndarray | None = None
    out_of_range: list[tuple[int, int]] = field(default_factory=list)

    def __call__(self, beta_z: np.ndarray) -> cox.Terms:
        beta = beta_z / self.std
        p = beta.size
        if np.max(np.abs(beta), initial=0.0) > MAX_ABS_BETA:  # a step this long overflows: halve it, ask no site
            return -math.inf, np.zeros(p), np.eye(p)
        self.calls += 1
        if self.strata == "site":
            replies = self.sites.ask(SUMS, f"Newton step {self.calls}", {"beta": beta}, step=self.calls, expect={
                "loglik": (1,), "score": (p,), "information": (p, p), "n": (1,), "events": (1,)})
            parts = [cox.CoxSums(float(r["loglik"][0]), r["score"], r["information"], int(r["n"][0]),
                                 int(r["events"][0])) for r in replies.values()]
            self.site_events = {name: int(r["events"][0]) for name, r in replies.items()}
            total = sum(parts[1:], parts[0])
            loglik, score, information = total.terms()
        else:
            total = self.risk_set_sums(beta, self.calls)
            if total is None:  # sites out of the secure sum's range at this trial step: Newton halves it
                self.outputs.append_metrics({"round": self.calls, "phase": "newton", "log_likelihood": None,
                                             "out_of_range_sites": self.out_of_range[-1][1],
                                             "coef_encoded": beta.tolist(),
                                             "elapsed_s": time.perf_counter() - self.started})
                return -math.inf, np.zeros(p), np.eye(p)
            self.totals[beta_z.tobytes()] = total
            loglik, score, information = cox.pooled_newton_terms(total, beta)
        self.outputs.append_metrics({"round": self.calls, "phase": "newton", "log_likelihood": loglik,
                                     "coef_encoded": beta.tolist(), "elapsed_s": time.perf_counter() - self.started})
        # beta_z = beta * std: d/d(beta_z) = d/d(beta) / std
        return loglik, np.asarray(score) / self.std, np.asarray(information) / np.outer(self.std, self.std)

    def accept(self, beta_z: np.ndarray) -> None:
        """Newton's accepted point (``accepted`` of :func:`models.cox.newton_raphson`): with the secure sum, the
        next queries' public scale puts each cell's bound of its summed sums
        (:meth:`models.cox.RiskSetSums.risk_bound`) between 2^-17 and 2^-16 of the fixed point's range."""
        total = self.totals.get(beta_z.tobytes())
        if self.sites.secure and total is not None:
            self.log_scale = secure_log_scale(total.risk_bound(), len(self.sites.nodes))

    def risk_set_sums(self, beta: np.ndarray, step: int) -> cox.RiskSetSums | None:
        """The summed :class:`models.cox.RiskSetSums` of the sites at ``beta`` (encoded units) on the pooled grid.

        With the secure sum: asked at the public scale ``log_scale`` and multiplied back
        (:meth:`~models.cox.RiskSetSums.rescaled`); ``None`` when sites were out of range (their number appended to
        ``out_of_range``), or :class:`CoxSiteError` where no step can be halved (before any evaluation succeeded,
        and for the sums after the fit)."""
        assert self.grid is not None
        m, p = self.grid.size, beta.size
        shapes = {"events": (m,), "event_weight": (m,), "event_x": (m, p), "event_risk": (m,),
                  "event_risk_x": (m, p), "event_risk_xx": (m, p, p), "risk": (m,), "risk_x": (m, p),
                  "risk_xx": (m, p, p)}
        what = f"Newton step {step}" if step else "the final sums"
        arrays = {"beta": beta, "grid": self.grid}
        if self.sites.secure:
            assert self.log_scale is not None  # fit_coxph sets the start's
            arrays["log_scale"] = self.log_scale
        replies = self.sites.ask(SUMS, what, arrays, step=step, expect={"n": (1,), **shapes})
        out_of_range = int(replies.get(SUM_OVER_SITES, {}).get(OUT_OF_RANGE, [0])[0])
        if out_of_range:
            if step == AFTER_FIT or not self.totals:
                raise CoxSiteError(f"coxph stopped at {what}: {out_of_range} site(s) had risk sums beyond the secure "
                                   "sum's range at the server's public scale, where no Newton step can be halved "
                                   f"(outputs so far in {self.sites.directory})")
            self.out_of_range.append((step, out_of_range))
            return None
        parts = [cox.RiskSetSums(self.grid, int(r["n"][0]), **{name: r[name] for name in RISK_SET})
                 for r in replies.values()]
        self.site_events = {name: int(r["events"].sum()) for name, r in replies.items()}
        total = sum(parts[1:], parts[0])
        return total.rescaled(self.log_scale) if self.log_scale is not None else total

    def total_at(self, beta_z: np.ndarray) -> cox.RiskSetSums:
        """The pooled sums at ``beta_z`` (standardised units): those of that Newton evaluation, else asked again."""
        kept = self.totals.get(beta_z.tobytes())
        if kept is None:
            kept = self.risk_set_sums(beta_z / self.std, AFTER_FIT)
            assert kept is not None  # risk_set_sums raises instead after the fit
        return kept


@dataclass
class CoxFit:
    """What :func:`fit_coxph` found: the result per user unit, β per encoded unit, the PH test, the figures."""

    result: cox.CoxResult
    beta: np.ndarray
    design: CoxDesign
    ph_test: pd.DataFrame | None
    ph_note: str
    grid_points: int | None
    newton_calls: int
    out_of_range: tuple[tuple[int, int], ...] = ()


def _pooled_grid(grid: str, sites: _Sites, cuts: np.ndarray) -> np.ndarray:
    """The risk-set sums' grid for the run's ``cox.grid``: every site's distinct event times (``events``) or the k
    set-up cuts of :func:`~flwr_app.cox_messages.k_point_grid` (``k``: the only grid a site answers on)."""
    if grid == "events":
        replies = sites.ask(EVENT_TIMES, "the event times", {})
        for name, reply in replies.items():
            times = reply.get("times")
            if times is None or times.ndim != 1 or not np.all(np.isfinite(times)):
                node = next(node for node, site in sites.nodes if site == name)
                raise sites.stop("the event times", name, node, "sent a malformed reply: 'times' must be finite times")
        return np.unique(np.concatenate([reply["times"] for reply in replies.values()]))
    return k_point_grid(cuts, int(grid))


def fit_coxph(cfg: ExperimentConfig, sites: _Sites, design: CoxDesign, cuts: np.ndarray, outputs: RunOutputs,
              started: float) -> CoxFit:
    """Newton-Raphson over the sites (steps 1-4 of the module's description)."""
    p = design.p
    moments_replies = sites.ask(MOMENTS, "the covariate moments", {}, expect={"n": (1,), "total": (p,),
                                                                              "total_sq": (p,)})
    parts = [cox.ColumnMoments(int(r["n"][0]), r["total"], r["total_sq"]) for r in moments_replies.values()]
    moments = sum(parts[1:], parts[0])
    std = moments.std
    constant = [name for name, value in zip(design.names, std) if not value > 1e-9]
    if constant:
        raise ConfigError(f"coxph: covariate(s) {', '.join(constant)} take a single value over every site's training "
                          "records (no effect can be estimated): drop the column(s) with data.drop_cols")
    strata = cfg.cox.strata
    grid = _pooled_grid(cfg.cox.grid, sites, cuts) if strata == "none" else None
    newton_sums = _Newton(sites, design, std, strata, grid, outputs, started)
    if sites.secure and grid is not None:  # at beta = 0: S0 <= n and every (S2)jj <= the covariate's sum of squares
        newton_sums.log_scale = secure_log_scale(np.full(grid.size, max(float(moments.n), np.max(moments.total_sq))),
                                                 len(sites.nodes))
    newton = cox.newton_raphson(newton_sums, p, penalizer=cfg.cox.penalizer * moments.n, max_steps=cfg.cox.max_steps,
                                tol=cfg.cox.tol, accepted=newton_sums.accept, names=design.names)
    beta = newton.beta / std
    events = sum(newton_sums.site_events.values())
    meat = None
    if cfg.cox.robust:
        arrays: dict[str, np.ndarray] = {"beta": beta}
        if strata == "none":
            increment, mean_x = cox.pooled_residual_terms(newton_sums.total_at(newton.beta))
            arrays.update(grid=grid, hazard_increment=increment, mean_x=mean_x)
        replies = sites.ask(MEAT, "the robust variance's sums", arrays, expect={"meat": (p, p)})
        meat = sum(r["meat"] for r in replies.values()) / np.outer(std, std)  # score residuals per unit of beta_z
    result = cox.CoxResult.from_newton(newton, design.names, std * design.scale, n=moments.n, events=events,
                                       meat=meat, alpha=ALPHA)
    ph_test, ph_note = None, ""
    if cfg.cox.ph_test != "none":
        try:
            ph_test = _ph_test(cfg.cox, sites, newton_sums, newton.beta, result, design)
        except ValueError as err:  # fewer than two events, or every transformed event time equal
            ph_note = f"no proportional-hazards test: {err}"
    return CoxFit(result, beta, design, ph_test, ph_note, None if grid is None else int(grid.size), newton_sums.calls,
                  tuple(newton_sums.out_of_range))


def _ph_test(settings: CoxConfig, sites: _Sites, newton: _Newton, beta_z: np.ndarray, result: cox.CoxResult,
             design: CoxDesign) -> pd.DataFrame:
    """The sites' :class:`models.cox.SchoenfeldSums` at the final β, summed, tested per covariate (encoded units: the
    statistic does not depend on the columns' scale) with the time transform ``settings.ph_test``, per stratum when
    ``settings.strata = site``."""
    beta = beta_z / newton.std
    p = design.p
    arrays: dict[str, np.ndarray] = {"beta": beta}
    per_site: dict[str, dict[str, np.ndarray]] = {}
    if settings.strata == "site":
        # lifelines' ranks run over the strata in the order of their labels; only rank needs the offsets (and
        # cox.secure_sum, which hides each site's events, refuses it)
        offset = 0
        for _, name in sites.nodes if settings.ph_test == "rank" else ():
            per_site[name] = {"rank_offset": np.array([offset])}
            offset += newton.site_events.get(name, 0)
    else:
        total = newton.total_at(beta_z)
        arrays.update(grid=newton.grid, event_means=cox.efron_event_means(total))
        if settings.ph_test == "km":
            zero = newton.total_at(np.zeros_like(beta_z))  # at beta = 0 the risk sums count the records at risk
            with np.errstate(divide="ignore", invalid="ignore"):
                arrays["km"] = np.cumprod(np.where(zero.risk > 0, 1.0 - zero.events / zero.risk, 1.0))
    replies = sites.ask(SCHOENFELD, "the proportional-hazards test's sums", arrays, per_site=per_site, expect={
        "events": (1,), "g_sum": (1,), "g_sq_sum": (1,), "residual_sum": (p,), "g_residual_sum": (p,)})
    parts = [cox.SchoenfeldSums(int(r["events"][0]), float(r["g_sum"][0]), float(r["g_sq_sum"][0]), r["residual_sum"],
                                r["g_residual_sum"]) for r in replies.values()]
    total = sum(parts[1:], parts[0])
    variance = result.variance.values * np.outer(design.scale, design.scale)
    return cox.proportional_hazard_test(total, variance, result.standard_errors.values * design.scale, design.names)


def _centralised(cfg: ExperimentConfig, dataset: FederatedDataset, fit: CoxFit, grid: np.ndarray | None,
                 node_names: list[str]) -> dict[str, Any]:
    """The same fit in one process on the sites' pooled training records (:func:`models.cox.fit_stratified` or
    :func:`models.cox.fit_pooled`), scored like the federated model (its Breslow baseline from the pooled training
    records): a check that the federation changed nothing."""
    design = fit.design
    by_name = {site.name: site for site in dataset.sites}
    sites = [cox.SiteData(design.covariates(by_name[name].train.x) * design.scale + design.shift,
                          by_name[name].train.time, by_name[name].train.event) for name in node_names]
    options = {"penalizer": cfg.cox.penalizer, "robust": cfg.cox.robust, "alpha": ALPHA}
    reference = (cox.fit_stratified(sites, design.names, **options) if cfg.cox.strata == "site"
                 else cox.fit_pooled(sites, design.names, grid=grid, **options))
    federated = fit.result
    scale = np.maximum(np.abs(reference.params.values), reference.standard_errors.values)
    model = task.build_model(cfg, dataset)
    _set_weights(model, design, reference.params.values * design.scale)
    train = dataset.pooled("train")
    model.set_baseline(*model.breslow_aggregates(train.x, train.time, train.event))
    return {"label": CENTRALIZED_LABEL, "what": "the same Cox fit on the sites' pooled training records, in one "
                                                "process (models.cox)", "privacy": "none (no DP)",
            "test": task.evaluate(model, dataset.pooled("test")) if holds_test_part(cfg.data) else {},
            "max_abs_coef_diff_over_se": float(np.max(np.abs(federated.params.values - reference.params.values)
                                                      / scale)),
            "max_rel_se_diff": float(np.max(np.abs(federated.standard_errors.values
                                                   / reference.standard_errors.values - 1))),
            "coef": dict(zip(design.names, reference.params.values.tolist()))}


def _set_weights(model: SurvivalModel, design: CoxDesign, beta: np.ndarray) -> ArrayRecord:
    """Load β (encoded units; 0 for the reference levels) into the linear network; return its arrays."""
    weights = np.zeros(model.in_features, dtype=np.float32)
    weights[design.kept] = beta
    with torch.no_grad():
        model.net.layers[0].weight.copy_(torch.from_numpy(weights)[None, :])
    model.net.eval()
    return ArrayRecord(model.net.state_dict())


def _table(fit: CoxFit) -> dict[str, Any]:
    """:data:`COXPH_JSON`'s content."""
    result = fit.result
    return {
        "format": 1,
        "names": list(result.params.index),
        "coef": result.params.tolist(),
        "se": result.standard_errors.tolist(),
        "variance": result.variance.values.tolist(),
        "robust_variance": None if result.robust_variance is None else result.robust_variance.values.tolist(),
        "log_likelihood": result.log_likelihood,
        "log_likelihood_null": result.log_likelihood_null,
        "n": result.n,
        "events": result.events,
        "alpha": result.alpha,
        "converged": result.converged,
        "steps": result.steps,
        "references": dict(fit.design.references),
        "coef_encoded": fit.beta.tolist(),
        "encoded_columns": [int(i) for i in fit.design.kept],
        "unit_scale": fit.design.scale.tolist(),
        "unit_shift": fit.design.shift.tolist(),
        "ph_test": None if fit.ph_test is None else {
            "covariates": list(fit.ph_test.index), "test_statistic": fit.ph_test["test_statistic"].tolist(),
            "p": fit.ph_test["p"].tolist()},
        "ph_test_note": fit.ph_note,
    }


class CoxphRun:
    """A ``coxph`` run (``strategy.name = fedavg``) as a :class:`flwr_app.server_program.RunKind`: Newton-Raphson on
    the sites' sums (:func:`fit_coxph`), then the fitted model's Breslow baseline and test figures, written with its
    tables; its centralised baseline is the same fit in one process (:func:`_centralised`).

    ``survival`` has named the sites (its ``node_sites``) and serves the Breslow and evaluation messages; ``grid``
    reaches the sites that take part only."""

    baseline_notice = "fitting the same Cox model in one process on the pooled training records ..."

    def __init__(self, cfg: ExperimentConfig, outputs: RunOutputs, grid: Grid, survival: SurvivalFedAvg,
                 setup: CoxSetup, started: float) -> None:
        self.cfg, self.outputs, self.grid, self.survival, self.setup, self.started = (cfg, outputs, grid, survival,
                                                                                      setup, started)
        self.design = CoxDesign.from_preprocessor(setup.spec.preprocessor)
        self.sites = _Sites(grid, survival.node_sites, timeout=cfg.federation.timeout_s,
                            directory=str(outputs.directory), secure=cfg.cox.secure_sum, p=self.design.p,
                            colluding=cfg.privacy.colluding_sites, seed=cfg.seed)
        self.names = [name for _, name in self.sites.nodes]

    def manifest(self) -> Manifest:
        return coxph_manifest(self.cfg)

    def start(self) -> list[str]:
        return _announce(self.cfg, len(self.names), self.design.p, self.outputs, self.setup)

    def train(self) -> None:
        cfg = self.cfg
        self.fit = fit_coxph(cfg, self.sites, self.design, np.asarray(self.setup.spec.cuts, dtype=np.float64),
                             self.outputs, self.started)
        self.ledger = PrivacyLedger(self.outputs.ledger_path)
        statement = SECURE_NO_NOISE.format(seen=secure_seen(cfg.cox)) if cfg.cox.secure_sum else NO_PRIVACY
        self.ledger.record(*(LedgerEntry(round=EVALUATION_ROUND, site=name, mechanism="none", unit="none",
                                         adjacency="n/a", accountant="none", epsilon=None, delta=None,
                                         assumptions=(statement, *self.setup.notes)) for name in self.names))

    def results(self) -> dict[str, Any]:
        cfg, outputs, fit, model, dataset = self.cfg, self.outputs, self.fit, self.setup.model, self.setup.dataset
        evaluation = _evaluate_fit(cfg.data, cfg.server_evaluation, self.grid, self.survival, model, self.design, fit,
                                   dataset)
        fit.result.summary.to_csv(outputs.directory / COXPH_SUMMARY)
        write_json(outputs.directory / COXPH_JSON, _table(fit))
        record = evaluation.record
        outputs.append_metrics({"round": fit.newton_calls + 1, "phase": "evaluate", "global_test": evaluation.test,
                                "sites": site_metrics(record) if record else {},
                                "failures": record.failures if record else [],
                                "elapsed_s": time.perf_counter() - self.started})
        summary = _summary(cfg, fit, self.design, evaluation, self.setup.spec, sites=self.names,
                           privacy={**{key: value for key, value in self.ledger.headline().items() if key != "site"},
                                    "uncovered": [release.value for release in self.manifest().uncovered]},
                           left_out=self.setup.left_out)
        outputs.save_model(model.net.state_dict(), model=cfg.model.name, config=cfg.as_dict(),
                           baseline=self.survival.baseline, preprocessing=task.preprocessing(cfg, self.setup.spec),
                           exponents=None)
        if cfg.server_evaluation and dataset is not None and not evaluation.diverged and holds_test_part(cfg.data):
            from models.plots import plot_survival_vs_km

            summary["calibration"] = task.calibration(model, dataset)
            summary["km_null"] = km_null_check(evaluation.test.get("ibs", math.nan),
                                               summary["calibration"]["ibs_km_null"])
            plot_survival_vs_km(model, dataset, outputs.plot_path, title=f"coxph on {cfg.data.name}",
                                time_unit=cfg.data.time_unit)
        return summary

    def centralized(self) -> dict[str, Any]:
        cfg, dataset = self.cfg, self.setup.dataset
        grid = None if cfg.cox.strata == "site" else _grid_of(cfg.cox.grid, dataset, self.setup.spec)
        return _centralised(cfg, dataset, self.fit, grid, self.names)

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        return _final_lines(self.cfg, self.fit, summary)


@dataclass(frozen=True)
class CoxSetup:
    """What the horizontal set-up agreed for a Cox fit: the model (a linear network on the agreed preprocessing),
    the pooled data (a simulation's only), the preprocessing and time grid (``spec``), the nodes left out (node ID
    -> why) and the set-up's console notes."""

    model: SurvivalModel
    dataset: FederatedDataset | None
    spec: task.SiteSpec
    left_out: Mapping[int, str]
    notes: tuple[str, ...]


def cox_run(cfg: ExperimentConfig, outputs: RunOutputs, grid: Grid, survival: SurvivalFedAvg, setup: CoxSetup,
            started: float) -> CoxphRun | PrivateCoxphRun:
    """The run kind of a ``coxph`` run: :class:`CoxphRun`, or :class:`PrivateCoxphRun` for ``dp_sgd`` and
    ``distributed_dp``."""
    if cfg.strategy == "fedavg":
        return CoxphRun(cfg, outputs, grid, survival, setup, started)
    return PrivateCoxphRun(cfg, outputs, grid, survival, setup, started)


def _announce(cfg: ExperimentConfig, num_sites: int, p: int, outputs: RunOutputs, setup: CoxSetup) -> list[str]:
    """The run's first console lines: what is fitted, on what, by which sums; the set-up's notes."""
    where = f"{num_sites} sites' own files" if cfg.data.deployed else (
        f"{num_sites} sites, partition '{cfg.federation.partition}'")
    strata = "stratified by site" if cfg.cox.strata == "site" else f"pooled baseline, grid {cfg.cox.grid}"
    how = "Newton-Raphson on " + ("the sums over sites through SecAgg+" if cfg.cox.secure_sum else
                                  "the sites' exact sums")
    if cfg.strategy != "fedavg":
        how = f"private grouped-time fit on the sites' noisy sums ({cfg.strategy}, epsilon {cfg.privacy.epsilon:g})"
    left_out = f", {len(setup.left_out)} left out" if setup.left_out else ""
    return [f"fedsurv: coxph ({strata}; {how}) | {cfg.data.name} ({where}{left_out}) | {p} covariates -> "
            f"{outputs.directory}", *setup.notes]


@dataclass(frozen=True)
class _Evaluation:
    """The fitted model's test figures (``test``, and where they come from), the sites' own (``record``'s), and why
    there is no baseline hazard (``diverged``; empty when there is one)."""

    test: dict[str, float]
    test_source: str
    record: Any
    sites_test: dict[str, Any]
    diverged: str


def _evaluate_fit(data: DataConfig, server_evaluation: bool, grid: Grid, survival: SurvivalFedAvg,
                  model: SurvivalModel, design: CoxDesign, fit: CoxFit, dataset: FederatedDataset | None
                  ) -> _Evaluation:
    """The fitted β in ``model``, its federated Breslow baseline and the sites' test metrics (one evaluation round,
    when ``data`` gives the sites a test part), and, in a simulation (``dataset``) with ``server_evaluation``, its
    figures on the pooled test split."""
    arrays = _set_weights(model, design, fit.beta)
    survival._evaluate(grid, EVALUATION_ROUND, arrays, survival)  # the Breslow baseline, then the sites' test metrics
    record = survival.rounds.get(EVALUATION_ROUND)
    diverged = ""
    if survival.baseline is not None:
        try:
            model.set_baseline(*survival.baseline)
        except ValueError as err:
            diverged = f"no baseline hazard: {err}"
    else:
        diverged = "no baseline hazard: no site's Breslow aggregates came back"
    sites_test = dict(sorted(record.evaluate_sites.items())) if record else {}
    if not holds_test_part(data):  # no evaluate message went out (SurvivalFedAvg._evaluate)
        return _Evaluation({}, NO_TEST_PART, record, sites_test, diverged)
    if server_evaluation and dataset is not None and not diverged:
        return _Evaluation(task.evaluate(model, dataset.pooled("test")),
                           "the fitted model on the pooled test split (server-side, simulation)", record, sites_test,
                           diverged)
    return _Evaluation(weighted_nanmean(sites_test), "weighted mean of the sites' own test metrics", record,
                       sites_test, diverged)


def _key_figures(cfg: ExperimentConfig, fit: CoxFit, design: CoxDesign, test: Mapping[str, float]) -> dict[str, Any]:
    """``summary.json``'s ``coxph`` entry: the fit's key figures."""
    result = fit.result
    lr = result.log_likelihood_ratio_test() if result.log_likelihood_null is not None else None
    figures: dict[str, Any] = {
        "strata": cfg.cox.strata, "n": result.n, "events": result.events, "covariates": design.p,
        "newton_steps": result.steps, "newton_evaluations": fit.newton_calls, "converged": result.converged,
        "log_likelihood": result.log_likelihood, "log_likelihood_null": result.log_likelihood_null,
        "likelihood_ratio_test": None if lr is None else lr._asdict(),
        "standard_errors": "robust (sandwich)" if cfg.cox.robust else "model-based",
        "references": dict(design.references),
        "coef": result.params.to_dict(), "hazard_ratio": result.hazard_ratios.to_dict(),
        "se": result.standard_errors.to_dict(), "p": result.summary["p"].to_dict(),
        "concordance_test": test.get("c_index"),
        "ph_test_p": None if fit.ph_test is None else fit.ph_test["p"].to_dict(),
    }
    if fit.grid_points is not None:
        figures["grid_points"] = fit.grid_points
    if cfg.cox.secure_sum and cfg.cox.strata == "none":  # (Newton evaluation, sites out of the fixed point's range)
        figures["out_of_range"] = [list(entry) for entry in fit.out_of_range]
    if not result.converged:
        figures["not_converged"] = _not_converged(cfg.cox.max_steps, result)
    return figures


def _summary(cfg: ExperimentConfig, fit: CoxFit, design: CoxDesign, evaluation: _Evaluation, spec: task.SiteSpec, *,
             sites: list[str], privacy: dict[str, Any], left_out: Mapping[int, str]) -> dict[str, Any]:
    """``summary.json`` of a ``coxph`` run, but for the calibration, the in-process reference and the wall time."""
    record, sites_test = evaluation.record, evaluation.sites_test
    summary: dict[str, Any] = {
        "test": evaluation.test, "test_source": evaluation.test_source,
        "sites": site_metrics(record) if record else {},
        "sites_mean": weighted_nanmean(sites_test), "sites_average": site_average(sites_test),
        "privacy": privacy, "strategy": cfg.strategy,
        "data": {"name": cfg.data.name, "features": {"input_columns": list(spec.preprocessor.columns),
                                                      "model_inputs": list(spec.preprocessor.feature_names),
                                                      "covariates": list(design.names)}},
        "model": cfg.model.name, "coxph": _key_figures(cfg, fit, design, evaluation.test), "num_sites": len(sites),
        "rounds": fit.newton_calls, "seed": cfg.seed,
    }
    if left_out:
        summary["left_out"] = {f"node {node}": reason for node, reason in sorted(left_out.items())}
    if record and record.failures:
        summary["failures"] = record.failures
    if evaluation.diverged:
        summary["diverged"] = evaluation.diverged
    return summary


def _grid_of(grid: str, dataset: FederatedDataset, spec: task.SiteSpec) -> np.ndarray:
    """The pooled grid a federated fit with ``cox.grid = grid`` used (for the in-process reference)."""
    if grid == "events":
        train = dataset.pooled("train")
        return np.unique(train.time[train.event > 0])
    return k_point_grid(spec.cuts, int(grid))


def _not_converged(max_steps: int, result: cox.CoxResult) -> str:
    """Why Newton-Raphson stopped before converging within ``cox.max_steps = max_steps``, and what to do."""
    if result.steps >= max_steps:
        return f"cox.max_steps = {max_steps} steps were not enough (raise it, or set cox.penalizer > 0)"
    return ("step halving found no higher likelihood: a covariate may separate the events (e.g. a category level "
            "without events) or two covariates be collinear; set cox.penalizer > 0 or drop or merge them")


def _final_lines(cfg: ExperimentConfig, fit: CoxFit, summary: Mapping[str, Any]) -> list[str]:
    """The end of the run's console output: lifelines' print_summary, the reference levels, the PH test, the test
    figures, the in-process reference's agreement and what no ε covers."""
    result = fit.result
    lines = [f"Newton-Raphson: {result.steps} steps ({fit.newton_calls} queries to every site)"
             + ("" if result.converged else f", NOT CONVERGED: {_not_converged(cfg.cox.max_steps, result)}")]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result.print_summary()
    lines += printed.getvalue().splitlines()
    if fit.design.references:
        lines.append("reference levels: " + ", ".join(f"{column}={level}"
                                                       for column, level in fit.design.references.items()))
    if fit.ph_test is not None:
        lines.append(f"proportional-hazards test (scaled Schoenfeld residuals, time transform {cfg.cox.ph_test}):")
        lines += fit.ph_test.to_string(float_format=lambda v: f"{v:.3f}").splitlines()
    elif fit.ph_note:
        lines.append(fit.ph_note)
    shown = "  ".join(f"{key} {value:.4f}" for key, value in summary["test"].items()
                      if key in ("c_index", "c_index_td", "ibs", "inbll") and math.isfinite(value))
    lines.append(f"test ({summary['test_source']}): {shown}")
    if "km_null" in summary and not summary["km_null"]["below_null"]:
        lines.append(km_null_warning(summary["km_null"], "the pooled test split"))
    if "centralized" in summary:
        central = summary["centralized"]
        lines.append(f"in-process reference on the pooled training records ({central['label']}): max |coef difference|"
                     f" / max(|coef|, se) {central['max_abs_coef_diff_over_se']:.2e}")
    if summary.get("diverged"):
        lines.append(summary["diverged"])
    lines.append(f"not covered by any epsilon: {', '.join(summary['privacy']['uncovered'])} (manifest.json)")
    return lines


# ------------------------------------------------------------------ the private fit (dp_sgd, distributed_dp)

#: The server's stream for the interval bootstrap's redraws (post-processing of released values: public).
PRIVATE_BOOTSTRAP_STREAM = 31
#: summary.json's statement of the private fit's intervals.
PRIVATE_INTERVALS = ("propagated delta method with parametric-bootstrap correction "
                     "(models.grouped_cox.private_covariance)")
#: What a private coxph run's table can and cannot be trusted for (printed, and in summary.json's coxph.privacy).
PRIVATE_CAVEAT = ("experimental: the table estimates the grouped-time Cox model under outcome-blind clipping, which "
                  "gives the late follow-up of high-risk records less weight; where the PH model holds that is Cox's "
                  "log hazard ratios (simulations: 93-97 % of the 95 % intervals cover them), but on real data (GBSG, "
                  "WHAS, METABRIC; 6 sites, epsilon 1) the intervals, which include the privacy noise, cover the "
                  "full-data Cox fit for 86-92 % of coefficients overall and for only 30-67 % of runs on a strong or "
                  "skewed covariate, whose target sits up to 6.6 exact SEs from that fit (docs/dp-cox.md, Real data)")
#: Why a private coxph run makes no predictions.
NO_PREDICTIONS = ("none: the private fit releases no baseline hazard on the set-up's prediction grid and no test "
                  "metrics (the Breslow aggregates and the evaluation would be exact releases outside the budget)")


@dataclass
class _PrivateRun:
    """The server's view of a private fit: the sites, the public design, bounds and settings, the plan (with the
    summed noise's actual level, ``noise_factor``), the sites' totals and, with ``distributed_dp``, each release's
    secure-sum plan and the summed noise's standard deviation per normalised entry (``sums``)."""

    cfg: ExperimentConfig
    sites: _Sites
    design: gc.GroupedCoxDesign
    bounds: gc.ClipBounds
    plan: gc.NoisePlan
    totals: dict[str, float]
    sums: dict[tuple[str, int], tuple[Any, float]]


def _private_run(cfg: ExperimentConfig, sites: _Sites, spec: task.SiteSpec, setups: Mapping[str, Any]) -> _PrivateRun:
    """The plan the server expects every site to follow (:func:`~flwr_app.cox_messages.private_plan` of each site's
    set-up) with the summed noise's actual level as ``noise_factor``: ``per_site``, the root mean square of the
    sites' multipliers over the first's; ``sum``, the largest over the releases of the secure sum's actual standard
    deviation (every site's discrete share, ``K s^2``, and the rounding of every record, ``n/12``, over ``γ^2``) over
    the nominal multiplier. A ``sum`` run whose sites' multipliers differ stops (their shares would not match)."""
    names = [name for _, name in sites.nodes]
    plans = {name: private_plan(cfg, setups[name], sites=len(names)) for name in names}
    totals = {name: plan.total for name, plan in plans.items()}
    plan = plans[names[0]]
    design = private_design(spec.preprocessor, np.asarray(spec.cuts, dtype=np.float64), int(cfg.cox.grid))
    bounds = gc.RECIPES[private_setting(cfg.strategy)].clip_bounds(design)
    factor = math.sqrt(np.mean([(total / plan.total) ** 2 for total in totals.values()]))
    sums: dict[tuple[str, int], tuple[Any, float]] = {}
    if private_setting(cfg.strategy) == "sum":
        if max(totals.values()) - min(totals.values()) > 1e-9 * plan.total:
            raise ConfigError(f"coxph with strategy 'distributed_dp': the sites' noise multipliers differ ({totals}: "
                              "their set-up releases or privacy filters differ), so their secure-sum shares would not "
                              "match")
        records = float(sum(setups[name].count for name in names))
        honest = tuple(float(setups[name].filter.honest_sites) for name in names if setups[name].filter is not None)
        for kind, step, share in private_releases(plan):
            secure = private_sum_plan(cfg, plan.multiplier(share), parties=len(names), records=records,
                                      size=private_release_size(kind, design, bounds), honest_sites=honest)
            sums[(kind, step)] = (secure, math.sqrt(len(names) * secure.local_sigma ** 2 + records / 12.0)
                                  / secure.gamma)
        factor = max(sd / plan.multiplier(share) for (kind, step, share), (_, sd)
                     in zip(private_releases(plan), sums.values(), strict=True))
    return _PrivateRun(cfg, sites, design, bounds, dataclasses.replace(plan, noise_factor=factor), totals, sums)


def _private_release(run: _PrivateRun, kind: str, step: int, theta: np.ndarray | None) -> np.ndarray:
    """The sum over sites of one private release (counts, score or full packed information, original units): the
    sites' noisy sums added (``dp_sgd``), or the secure sum's integer total divided by γ and multiplied back by the
    per-entry bounds (``distributed_dp``)."""
    from strategies.secure_aggregation import centred

    what = "the private counts" if kind == DP_COUNTS else (
        f"private {'score' if kind == DP_SCORE else 'information'} at step {step}")
    arrays = {} if theta is None else {"theta": theta}
    design, bounds = run.design, run.bounds
    name = {DP_COUNTS: "counts", DP_SCORE: "score", DP_INFORMATION: "information"}[kind]
    if not run.sites.secure:
        size = {DP_COUNTS: 2 * design.intervals, DP_SCORE: design.dim, DP_INFORMATION: bounds.information.size}[kind]
        replies = run.sites.ask(kind, what, arrays, step=step, expect={name: (size,)})
        return sum(reply[name] for reply in replies.values())
    scale = {DP_COUNTS: np.ones(2 * design.intervals), DP_SCORE: bounds.score,
             DP_INFORMATION: bounds.information[bounds.released]}[kind]
    secure, _ = run.sums[(kind, step)]
    modulus = 2 ** run.cfg.privacy.modulus_bits
    total = run.sites.secure_total(kind, what, arrays, step=step, modulus=modulus, dimension=scale.size,
                                   records=secure.records, max_dropouts=run.cfg.privacy.max_dropouts)
    summed = centred(total, modulus).astype(np.float64) / secure.gamma * scale
    if kind != DP_INFORMATION:
        return summed
    packed = np.zeros(bounds.information.size)
    packed[bounds.released] = summed
    return packed


def fit_private(run: _PrivateRun) -> tuple[gc.GroupedCoxFit, gc.PrivateTrace, np.ndarray]:
    """The private fit over messages: each release of :func:`~flwr_app.cox_messages.private_releases`, summed over
    the sites at the public θ of a :class:`models.grouped_cox.PrivateServer` (the server steps of
    :func:`models.grouped_cox.run_private`), fed to it in order; then
    :func:`~models.grouped_cox.private_covariance`. Returns the fit, the trace and the summed counts."""
    settings = gc.RECIPES["sum" if run.sites.secure else "per_site"].settings
    server = gc.PrivateServer(run.design, run.plan, run.bounds, settings)
    counts = _private_release(run, DP_COUNTS, 0, None)
    server.counts(counts)
    for kind, step, share in private_releases(run.plan)[1:]:
        summed = _private_release(run, kind, step, server.theta)
        if kind == DP_INFORMATION:
            server.information(summed, step, share)
        else:
            server.score(summed)
    trace = server.trace()
    rng = np.random.default_rng([run.cfg.seed, PRIVATE_BOOTSTRAP_STREAM])
    covariance = gc.private_covariance(trace, run.design, run.plan, run.bounds, settings, rng)
    return gc.GroupedCoxFit(run.design, server.theta, covariance, alpha=ALPHA, steps=run.plan.steps), trace, counts


def _private_result(fit: gc.GroupedCoxFit, design: CoxDesign, counts: np.ndarray) -> cox.CoxResult:
    """The private fit per unit of the user's columns (:class:`models.cox.CoxResult`'s table: coef, se, intervals, z,
    p): β per encoded unit divided by the preprocessing's scale; n and events the noisy counts' sums (rounded); no
    log-likelihood (none is released)."""
    t = fit.design.intervals
    unit = fit.design.per_unit() / design.scale
    index = pd.Index(design.names, name="covariate")
    variance = fit.covariance[t:, t:] * np.outer(unit, unit)
    return cox.CoxResult(params=pd.Series(fit.theta[t:] * unit, index=index, name="coef"),
                         variance=pd.DataFrame(variance, index=design.names, columns=design.names),
                         standard_errors=pd.Series(np.sqrt(np.diag(variance)), index=index, name="se"),
                         log_likelihood=math.nan, log_likelihood_null=None,
                         n=int(max(round(float(counts.sum())), 0)), events=int(max(round(float(counts[:t].sum())), 0)),
                         alpha=ALPHA, converged=True, steps=fit.steps)


def _private_privacy(run: _PrivateRun, manifest: Any) -> dict[str, Any]:
    """summary.json's ``coxph.privacy``: the setting, budget, multipliers, the summed noise's level and the interval
    method."""
    plan = run.plan
    figures: dict[str, Any] = {
        "setting": private_setting(run.cfg.strategy), "epsilon": run.cfg.privacy.epsilon,
        "delta": run.cfg.privacy.delta,
        "accountant": run.cfg.privacy.accountant, "setup_share": run.cfg.privacy.setup_share,
        "total_multiplier": {name: total for name, total in run.totals.items()},
        "releases": [{"message": kind, "step": step, "share": share, "multiplier": plan.multiplier(share)}
                     for kind, step, share in private_releases(plan)],
        "summed_noise_factor": plan.noise_factor, "intervals": PRIVATE_INTERVALS, "predictions": NO_PREDICTIONS,
        "caveat": PRIVATE_CAVEAT,
        "uncovered": [release.value for release in manifest.uncovered],
    }
    if run.sums:
        figures["secure_sums"] = [{"message": kind, "step": step, "gamma": secure.gamma, "honest": secure.honest,
                                   "local_sigma": secure.local_sigma, "noise_sd_normalised": sd}
                                  for (kind, step), (secure, sd) in run.sums.items()]
    return figures


def _private_ledger(run: _PrivateRun, setups: Mapping[str, Any], path: Any, notes: tuple[str, ...]) -> PrivacyLedger:
    """One ledger entry per site per release, ε cumulative over the set-up's releases (``prior``) and the releases so
    far (the entry's own multiplier, q = 1, one step, composed after ``prior``)."""
    from strategies.accounting.rdp import epsilon_from_history

    cfg = run.cfg
    ledger = PrivacyLedger(path)
    unit = "the union of the sites' records against the server (assuming honest shares)" if run.sums else \
        "each site's own records"
    assumption = (f"private grouped-time Cox regression (models.grouped_cox), record-level add/remove on {unit}; "
                  "every release a Gaussian mechanism of the entry's multiplier without subsampling")
    for position, (kind, step, share) in enumerate(private_releases(run.plan)):
        for _, name in run.sites.nodes:
            plan = dataclasses.replace(run.plan, total=run.totals[name])
            history = plan.history()
            prior = (*setups[name].prior, *history[:position])
            epsilon = epsilon_from_history([*prior, history[position]], delta=cfg.privacy.delta,
                                           accountant=cfg.privacy.accountant)
            rdp = epsilon_from_history([*prior, history[position]], delta=cfg.privacy.delta, accountant="rdp")
            ledger.record(LedgerEntry(round=position + 1, site=name, mechanism=f"{cfg.strategy} (coxph)",
                                      unit="record", adjacency="add-remove", accountant=cfg.privacy.accountant,
                                      epsilon=epsilon, delta=cfg.privacy.delta, noise_multiplier=history[position][0],
                                      sample_rate=1.0, steps=1, epsilon_rdp=rdp,
                                      assumptions=(assumption, f"release {kind} step {step}, share {share:g}", *notes),
                                      prior=tuple(prior)))
    return ledger



class PrivateCoxphRun:
    """A private ``coxph`` run (``dp_sgd``: releases in the clear, each site's full noise; ``distributed_dp``: every
    release through SecAgg+ as a distributed discrete Gaussian) as a :class:`flwr_app.server_program.RunKind`:
    :func:`fit_private`, then ``ledger.jsonl`` (every site, every release), :data:`COXPH_JSON`,
    :data:`COXPH_SUMMARY` and ``summary.json`` with ``coxph.privacy``. No predictions (:data:`NO_PREDICTIONS`) and
    no centralised baseline (``baseline_notice`` is empty). Constructing it plans every release
    (:func:`_private_run`; a ``distributed_dp`` run whose sites' noise differs is refused there)."""

    baseline_notice = ""

    def __init__(self, cfg: ExperimentConfig, outputs: RunOutputs, grid: Grid, survival: SurvivalFedAvg,
                 setup: CoxSetup, started: float) -> None:
        self.cfg, self.outputs, self.setup, self.started = cfg, outputs, setup, started
        self.design = CoxDesign.from_preprocessor(setup.spec.preprocessor)
        sites = _Sites(grid, survival.node_sites, timeout=cfg.federation.timeout_s, directory=str(outputs.directory),
                       secure=cfg.strategy == "distributed_dp", p=self.design.p,
                       colluding=cfg.privacy.colluding_sites, seed=cfg.seed)
        self.setups = {name: survival.setups[name] for _, name in sites.nodes}
        self.run = _private_run(cfg, sites, setup.spec, self.setups)

    def manifest(self) -> Manifest:
        return coxph_manifest(self.cfg, self.setups[self.run.sites.nodes[0][1]])

    def start(self) -> list[str]:
        return _announce(self.cfg, len(self.run.sites.nodes), self.design.p, self.outputs, self.setup)

    def train(self) -> None:
        self.fit, self.trace, self.counts = fit_private(self.run)

    def results(self) -> dict[str, Any]:
        cfg, design, outputs, fit, run = self.cfg, self.design, self.outputs, self.fit, self.run
        ledger = _private_ledger(run, self.setups, outputs.ledger_path, self.setup.notes)
        self.result = result = _private_result(fit, design, self.counts)
        result.summary.to_csv(outputs.directory / COXPH_SUMMARY)
        write_json(outputs.directory / COXPH_JSON, {
            "format": 1, "names": list(result.params.index), "coef": result.params.tolist(),
            "se": result.standard_errors.tolist(), "variance": result.variance.values.tolist(), "alpha": ALPHA,
            "n": result.n, "events": result.events, "steps": fit.steps, "references": dict(design.references),
            "theta": fit.theta.tolist(), "grid": run.design.grid.tolist(),
            "thetas": [theta.tolist() for theta in self.trace.thetas]})
        outputs.append_metrics({"round": len(self.trace.thetas), "phase": "private fit",
                                "coef": result.params.to_dict(), "elapsed_s": time.perf_counter() - self.started})
        figures = {"strata": "none", "grid_points": int(run.design.grid.size), "n": result.n, "events": result.events,
                   "covariates": design.p, "steps": fit.steps, "standard_errors": PRIVATE_INTERVALS,
                   "references": dict(design.references), "coef": result.params.to_dict(),
                   "hazard_ratio": result.hazard_ratios.to_dict(), "se": result.standard_errors.to_dict(),
                   "p": result.summary["p"].to_dict(), "privacy": _private_privacy(run, self.manifest())}
        summary: dict[str, Any] = {
            "privacy": {**{key: value for key, value in ledger.headline().items() if key != "site"},
                        "uncovered": figures["privacy"]["uncovered"]},
            "strategy": cfg.strategy, "model": cfg.model.name, "coxph": figures, "num_sites": len(self.setups),
            "data": {"name": cfg.data.name, "features": {"input_columns": list(self.setup.spec.preprocessor.columns),
                                                          "covariates": list(design.names)}},
            "test": {}, "test_source": NO_PREDICTIONS, "predictions": NO_PREDICTIONS, "seed": cfg.seed}
        if self.setup.left_out:
            summary["left_out"] = {f"node {node}": reason for node, reason in sorted(self.setup.left_out.items())}
        return summary

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        return _private_lines(self.result, summary["coxph"])


def _private_lines(result: cox.CoxResult, figures: Mapping[str, Any]) -> list[str]:
    """The private run's closing console lines: the table, the budget, the reference levels and the caveat."""
    privacy = figures["privacy"]
    lines = [f"private grouped-time Cox ({privacy['setting']}; epsilon {privacy['epsilon']:g}, delta "
             f"{privacy['delta']:g}; {figures['steps']} steps on {figures['grid_points'] - 1} intervals): noisy n "
             f"{result.n}, noisy events {result.events}; intervals: {PRIVATE_INTERVALS}",
             *result.summary.to_string(float_format=lambda v: f"{v:.3f}").splitlines()]
    if figures["references"]:
        lines.append("reference levels: " + ", ".join(f"{column}={level}"
                                                       for column, level in figures["references"].items()))
    return [*lines, f"predictions: {NO_PREDICTIONS}", f"WARNING private coxph: {PRIVATE_CAVEAT}"]
