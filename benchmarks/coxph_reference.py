r"""Federated Cox regression (``model.name=coxph``), Kaplan–Meier and log-rank against lifelines, for the record.

``python -m benchmarks.coxph_reference [--checks stratified,pooled,grid,secure,km] [--data flchain,...]
[--show gbsg] [--secure-ph-test auto] [--out rows.jsonl]`` (all rows: about half a minute on 2 cores)

Every Cox fit runs through the ServerApp and ClientApp over the in-process grid
(:func:`simulations.engine.run_inprocess`, no server-side evaluation, no centralised baseline) and is read back with
:func:`models.predict.load_run`. The reference is lifelines fitted on the same training records and the same
covariates (:func:`reference_frame`: the federation's sites, their preprocessing undone, the site's name as
``site``), with tight convergence (:data:`TIGHT`). Data sets (:data:`DATA_SETS`): FLCHAIN, METABRIC, GBSG (3 i.i.d.
sites), WHAS (4) and SBA over its census regions with ``cox.penalizer=0.01`` (lifelines' ridge of the same size:
SBA's rare industry levels without a charge-off make the unpenalised likelihood monotone). Rows:

``stratified``
    ``cox.strata=site`` (the default) against ``CoxPHFitter(strata=["site"])``. Figures: ``coef_rel`` = max over
    covariates of :math:`|\beta-\beta_{ll}| / \max(|\beta_{ll}|, SE_{ll})` (target 1e-4); ``se_rel`` = max
    :math:`|SE/SE_{ll}-1|` (1e-4); ``p_abs`` = max :math:`|p-p_{ll}|` of the Wald tests (1e-3); ``loglik_rel`` =
    :math:`|\ell-\ell_{ll}|/|\ell_{ll}|` (1e-8); ``coef_over_se`` = max :math:`|\beta-\beta_{ll}|/SE_{ll}` (no
    target); the run's proportional-hazards test (its ``cox.ph_test`` default, ``rank`` for this fit) against
    lifelines' ``proportional_hazard_test(cph, frame, time_transform=<same>)``: ``ph_stat_abs`` and ``ph_p_abs`` =
    max absolute differences of the statistic and p over covariates (1e-4 each).
``pooled``
    ``cox.strata=none cox.grid=events`` (risk-set sums at every distinct event time) against the pooled
    ``CoxPHFitter()`` (no strata): the same figures; the PH test with the ``km`` transform (the default here).
``grid``
    ``cox.strata=none cox.grid=100`` (risk-set sums on 100 points of the set-up's time grid,
    ``model.num_durations=100``; fewer where the set-up's quantile grid has fewer distinct points: ``grid_points``;
    no PH test) against lifelines' pooled fit on the exact times: ``coef_over_se`` (target 0.1); the other figures
    for the record (no target), and ``on_grid_coef_over_se``: the same against lifelines on the times rounded to
    the run's grid as the sites round them (:func:`on_grid_figure`), which leaves out the grid's rounding.
``secure``
    ``cox.secure_sum=true`` against the same run in the clear, stratified and pooled with ``cox.grid=20``: ``coef_rel``
    = max :math:`|\beta_s-\beta_c| / \max(|\beta_c|, SE_c)` and ``se_rel`` = max :math:`|SE_s/SE_c-1|` (1e-6 each);
    ``ph_stat_rel`` = max relative difference of the PH test statistics (the secure run's transform in both runs; no
    target). The PH test is the config's default (``log`` stratified, ``km`` pooled) unless ``--secure-ph-test``
    names another. A run that stops is a failed row with its one-line message.
``km``
    :func:`fedsurv.kaplan_meier` and :func:`fedsurv.logrank_test` (``stratified=False``: the pooled test lifelines
    computes) on public data with groups and sites (:data:`KM_SETS`: NCCTG lung over its institutions by sex, the
    Veterans' trial over 3 random centres by cell type, Waltons over 3 random sites by group) against
    ``KaplanMeierFitter`` per group and ``logrank_test`` (two groups) or ``multivariate_logrank_test``:
    ``survival_abs`` and ``ci_abs`` = max absolute difference of the survival and of the Greenwood (log −log)
    bounds over every group's timeline, ``statistic_abs`` and ``p_abs`` of the test (1e-4 each); ``counts_equal``:
    the at-risk, event and censoring counts equal lifelines' event table (target true).

The saved rows (``docs/results/benchmarks/coxph_reference.jsonl``, every check) meet every target but the ``grid``
one on WHAS (0.30), FLCHAIN (0.18) and GBSG (0.13); METABRIC (0.058) and SBA (0.093) meet it. Against lifelines on
the times rounded to the grid they agree to 3e-8, so the federated sums are exact for the grouped data and the
distance is the grouping's: records censored inside a cell leave before its events. Tried on the pooled training
records with lifelines (weights standing in for partial risk-set membership): counting a censored record at risk
for half of its cell's events, for a share linear in its time, or for the share of its site's own events before
it brings WHAS, FLCHAIN, GBSG and METABRIC to at most 0.086 (the site's share: 0.018) but SBA to 1.3-1.8, where
a loan's term sets both its censoring time and the ``Term`` covariate (SE 0.001); more points do not help WHAS
(0.29 at 203 points) or GBSG (0.13 at 390); a grid on the quantiles of every observed time helps some sets and
hurts others. The plain rounding stays.

Any fit that raises gives a failed row (``error``: its first line) instead of stopping the benchmark. Prints one
JSON line per row as it finishes (``--out`` appends them), then the Markdown tables and, for ``--show`` (default
``gbsg``; ``none`` to skip), the stratified run's ``summary_table()`` and lifelines' ``cph.summary``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from lifelines import CoxPHFitter

from flwr_app import interrupt, task
from simulations.engine import resolve, run_inprocess
from simulations.results_file import append_jsonl, code_commit

#: lifelines' convergence criteria for the reference fits (far tighter than its defaults).
TIGHT = {"precision": 1e-12, "r_precision": 1e-15}
#: Keys of every run: the fit alone, no server-side evaluation or centralised baseline.
FAST = {"model.name": "coxph", "evaluation.server_side": False, "baseline.centralized": False}
#: The bundled data sets and the overrides of their federation.
DATA_SETS: dict[str, dict[str, Any]] = {
    "flchain": {"data.name": "flchain", "federation.num_sites": 3},
    "metabric": {"data.name": "metabric", "federation.num_sites": 3},
    "gbsg": {"data.name": "gbsg", "federation.num_sites": 3},
    "whas": {"data.name": "whas", "federation.num_sites": 4},
    "sba": {"data.name": "sba", "federation.partition": "region", "cox.penalizer": 0.01},
}
#: The Cox checks against lifelines: name -> (run overrides, lifelines stratified by site?).
COX_CHECKS: dict[str, tuple[dict[str, Any], bool]] = {
    "stratified": ({"cox.strata": "site"}, True),
    "pooled": ({"cox.strata": "none", "cox.grid": "events"}, False),
    "grid": ({"cox.strata": "none", "cox.grid": "100", "model.num_durations": 100, "cox.ph_test": "none"}, False),
}
#: The secure-sum checks: name -> run overrides (run with cox.secure_sum true and false).
SECURE_CHECKS: dict[str, dict[str, Any]] = {
    "secure stratified": {"cox.strata": "site"},
    "secure pooled, grid 20": {"cox.strata": "none", "cox.grid": "20"},
}
CHECKS = ("stratified", "pooled", "grid", "secure", "km")
#: The largest value each figure may take (a boolean figure: its required value); the others are for the record.
COX_TARGETS = {"coef_rel": 1e-4, "se_rel": 1e-4, "p_abs": 1e-3, "loglik_rel": 1e-8, "ph_stat_abs": 1e-4,
               "ph_p_abs": 1e-4}
TARGETS: dict[str, dict[str, Any]] = {
    "stratified": COX_TARGETS, "pooled": COX_TARGETS, "grid": {"coef_over_se": 0.1},
    "secure": {"coef_rel": 1e-6, "se_rel": 1e-6},
    "km": {"survival_abs": 1e-4, "ci_abs": 1e-4, "statistic_abs": 1e-4, "p_abs": 1e-4, "counts_equal": True},
}


# --------------------------------------------------------------------------- the reference


def reference_frame(overrides: Mapping[str, Any]) -> tuple[pd.DataFrame, list[str]]:
    """Every site's training records as lifelines sees them, built from the data set and its preprocessing alone:
    numeric columns in their raw units (the standardisation undone), one 0/1 column per categorical level but the
    first (the reference), ``T`` and ``E``, and the site's name as ``site``; with the covariate names in the run's
    order. ``overrides``: the run config of the federation (``model.name`` is set to ``coxph``)."""
    _, cfg = resolve({"model.name": "coxph", **overrides})
    dataset = task.load_federation(cfg)
    pre = dataset.preprocessor
    names, columns, position = [], [], 0
    for column in pre.columns:
        if column in pre.means:
            names.append(column)
            columns.append((position, pre.stds[column], pre.means[column]))
            position += 1
        else:
            levels = pre.categories[column]
            names += [f"{column}={level}" for level in levels[1:]]
            columns += [(position + k, 1.0, 0.0) for k in range(1, len(levels))]
            position += len(levels)
    frames = []
    for site in dataset.sites:
        x = np.asarray(site.train.x, dtype=np.float64)
        values = np.column_stack([x[:, j] * scale + shift for j, scale, shift in columns])
        frames.append(pd.DataFrame(values, columns=names).assign(T=site.train.time, E=site.train.event,
                                                                  site=site.name))
    return pd.concat(frames, ignore_index=True), names


def lifelines_fit(frame: pd.DataFrame, *, strata: bool = True, penalizer: float = 0.0, robust: bool = False
                  ) -> CoxPHFitter:
    """lifelines' ``CoxPHFitter`` on a :func:`reference_frame` (``T``, ``E``), stratified by ``site`` or pooled
    (the ``site`` column dropped), with the ridge ``penalizer`` and robust errors if asked, to :data:`TIGHT`.

    Where lifelines' Newton-Raphson diverges at its default step (0.95; FLCHAIN pooled), the fit is made again with
    step 0.5: the same maximum of the concave partial likelihood, reached more slowly."""
    from lifelines.exceptions import ConvergenceError

    data = frame if strata else frame.drop(columns="site")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return CoxPHFitter(penalizer=penalizer).fit(data, "T", "E", strata=["site"] if strata else None,
                                                         robust=robust, fit_options=TIGHT)
        except ConvergenceError:
            return CoxPHFitter(penalizer=penalizer).fit(data, "T", "E", strata=["site"] if strata else None,
                                                         robust=robust, fit_options={**TIGHT, "step_size": 0.5})


@functools.cache
def _reference(name: str) -> tuple[pd.DataFrame, list[str]]:
    """:func:`reference_frame` of :data:`DATA_SETS` ``[name]``, built once."""
    return reference_frame(DATA_SETS[name])


@functools.cache
def _lifelines(name: str, strata: bool) -> CoxPHFitter:
    """:func:`lifelines_fit` on :data:`DATA_SETS` ``[name]`` with its penalizer, made once."""
    return lifelines_fit(_reference(name)[0], strata=strata, penalizer=DATA_SETS[name].get("cox.penalizer", 0.0))


def lifelines_ph_test(cph: CoxPHFitter, frame: pd.DataFrame, transform: str, *, strata: bool) -> pd.DataFrame:
    """lifelines' ``proportional_hazard_test`` of ``cph`` on its training ``frame`` (``site`` dropped unless
    stratified) with ``time_transform=transform``: ``test_statistic`` and ``p`` per covariate."""
    from lifelines.statistics import proportional_hazard_test

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = proportional_hazard_test(cph, frame if strata else frame.drop(columns="site"),
                                          time_transform=transform)
    table = result.summary
    if isinstance(table.index, pd.MultiIndex):  # one transform: (covariate, transform) rows
        table = table.droplevel(-1)
    return table


# --------------------------------------------------------------------------- runs


def fit_run(overrides: Mapping[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """One ``coxph`` run through the apps, its printed output swallowed: the :class:`models.cox_run.CoxRun` read
    back, the run's summary and its resolved config. Whatever the run raises propagates."""
    from models.predict import load_run

    keys = {**FAST, **overrides}
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        summary = run_inprocess({**keys, "output.dir": tmp})
        run = load_run(tmp)  # coxph.json is read here, while the directory exists
    return run, summary, resolve(keys)[1]


def one_line(error: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def judged(row: dict[str, Any], targets: Mapping[str, float]) -> dict[str, Any]:
    """``row`` with ``targets`` and ``ok``: no ``error`` and every targeted figure present, finite and within its
    target (a boolean figure's target is True)."""
    ok = "error" not in row and all(meets(row.get(key), target) for key, target in targets.items())
    return {**row, "targets": dict(targets), "ok": ok}


def meets(value: Any, target: Any) -> bool:
    """A boolean figure is its target; any other is a finite number at most its target."""
    if isinstance(target, bool):
        return value is target
    return value is not None and math.isfinite(value) and value <= target


# --------------------------------------------------------------------------- Cox against lifelines


def cox_figures(run: Any, cph: CoxPHFitter, names: list[str]) -> dict[str, float]:
    """The run's coefficients, standard errors, Wald p and log-likelihood against lifelines' (see the module text)."""
    ours, ref = run.summary_table(), cph.summary.loc[names]
    if list(ours.index) != names:
        raise ValueError(f"the run's covariates {list(ours.index)} are not lifelines' {names}")
    diff = (ours["coef"] - ref["coef"]).abs()
    return {"coef_rel": float((diff / np.maximum(ref["coef"].abs(), ref["se(coef)"])).max()),
            "se_rel": float(((ours["se(coef)"] / ref["se(coef)"]) - 1).abs().max()),
            "p_abs": float((ours["p"] - ref["p"]).abs().max()),
            "loglik_rel": abs(run.result.log_likelihood - cph.log_likelihood_) / abs(cph.log_likelihood_),
            "coef_over_se": float((diff / ref["se(coef)"]).max())}


def ph_figures(run: Any, cph: CoxPHFitter, frame: pd.DataFrame, names: list[str], transform: str, *,
               strata: bool) -> dict[str, Any]:
    """The run's proportional-hazards test against lifelines' with the same time transform."""
    ours = run.proportional_hazard_test().loc[names]
    theirs = lifelines_ph_test(cph, frame, transform, strata=strata).loc[names]
    return {"ph_transform": transform,
            "ph_stat_abs": float((ours["test_statistic"] - theirs["test_statistic"]).abs().max()),
            "ph_p_abs": float((ours["p"] - theirs["p"]).abs().max())}


def on_grid_figure(run: Any, cfg: Any, name: str) -> float:
    """``grid``'s diagnostic: max :math:`|\beta-\beta_{ll}|/SE_{ll}` against lifelines' pooled fit on the training
    times rounded to the run's grid as the sites round them (:func:`models.km.grid_index`: an event up to the next
    grid point, a censoring down to the previous one, a record censored before the first point left out), so that
    it measures everything but the grid's rounding."""
    from flwr_app.cox_messages import k_point_grid
    from models.km import grid_index

    frame, names = _reference(name)
    grid = k_point_grid(task.federation_setup(cfg).cuts, int(cfg.cox.grid))
    cell = grid_index(frame["T"].to_numpy(), frame["E"].to_numpy(), grid)
    rounded = frame.loc[cell >= 0].assign(T=grid[cell[cell >= 0]])
    cph = lifelines_fit(rounded, strata=False, penalizer=DATA_SETS[name].get("cox.penalizer", 0.0))
    ref = cph.summary.loc[names]
    return float(((run.summary_table()["coef"] - ref["coef"]).abs() / ref["se(coef)"]).max())


def check_cox(check: str, name: str) -> dict[str, Any]:
    """One row of ``stratified``, ``pooled`` or ``grid`` on the data set ``name``: a failed row if the run raises
    (``error`` starts ``run:``) or the reference does (``reference:``)."""
    overrides, strata = COX_CHECKS[check]
    row: dict[str, Any] = {"check": check, "data": name}
    start, stage = time.perf_counter(), "run"
    try:
        run, summary, cfg = fit_run({**DATA_SETS[name], **overrides})
        row.update(sites=summary["num_sites"], events=summary["coxph"]["events"],
                   grid_points=summary["coxph"].get("grid_points"))
        stage = "reference"
        frame, names = _reference(name)
        cph = _lifelines(name, strata)
        row.update(cox_figures(run, cph, names))
        if cfg.cox.ph_test != "none":
            row.update(ph_figures(run, cph, frame, names, cfg.cox.ph_test, strata=strata))
        if check == "grid":
            row["on_grid_coef_over_se"] = on_grid_figure(run, cfg, name)
        if check == "stratified" and name == _SHOWN.get("name"):
            _SHOWN["tables"] = (run.summary_table(), cph.summary.loc[names])
    except Exception as error:  # noqa: BLE001 - a failed run is a row of the record
        row["error"] = f"{stage}: {one_line(error)}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return judged(row, TARGETS[check])


#: The data set whose stratified summary is shown (``--show``) and, once run, its two tables.
_SHOWN: dict[str, Any] = {}


# --------------------------------------------------------------------------- secure sum against clear


def secure_figures(secure: Any, clear: Any) -> dict[str, float]:
    """The secure run's coefficients, standard errors and PH test statistics against the clear run's."""
    s, c = secure.result, clear.result
    figures = {"coef_rel": float(((s.params - c.params).abs() / np.maximum(c.params.abs(), c.standard_errors)).max()),
               "se_rel": float(((s.standard_errors / c.standard_errors) - 1).abs().max())}
    with contextlib.suppress(ValueError):  # a run without a PH test
        ours, theirs = secure.proportional_hazard_test(), clear.proportional_hazard_test()
        figures["ph_stat_rel"] = float(((ours["test_statistic"] - theirs["test_statistic"]).abs()
                                        / theirs["test_statistic"].abs().clip(lower=1e-300)).max())
    return figures


def check_secure(check: str, name: str, ph_test: str = "auto") -> dict[str, Any]:
    """One ``secure`` row: the data set ``name`` with :data:`SECURE_CHECKS` ``[check]``, secure and in the clear (the
    clear run given the secure run's PH-test transform: ``ph_test``, or the config's default for ``auto``); a
    failed row if either run raises."""
    row: dict[str, Any] = {"check": check, "data": name}
    start = time.perf_counter()
    try:
        keys = {**DATA_SETS[name], **SECURE_CHECKS[check], **({} if ph_test == "auto" else {"cox.ph_test": ph_test})}
        secure, summary, cfg = fit_run({**keys, "cox.secure_sum": True})
        clear, _, _ = fit_run({**keys, "cox.secure_sum": False, "cox.ph_test": cfg.cox.ph_test})
        row.update(sites=summary["num_sites"], events=summary["coxph"]["events"], ph_transform=cfg.cox.ph_test,
                   **secure_figures(secure, clear))
    except Exception as error:  # noqa: BLE001 - a failed run is a row of the record
        row["error"] = one_line(error)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return judged(row, TARGETS["secure"])


# --------------------------------------------------------------------------- Kaplan–Meier and log-rank


def _lung() -> pd.DataFrame:
    from lifelines.datasets import load_lung

    return load_lung().dropna(subset=["inst"]).reset_index(drop=True)


def _veterans() -> pd.DataFrame:
    from sksurv.datasets import load_veterans_lung_cancer

    x, y = load_veterans_lung_cancer()
    frame = x.assign(time=y["Survival_in_days"], status=y["Status"].astype(int))
    return frame.assign(centre=np.random.default_rng(3).choice(["north", "south", "east"], len(frame)))


def _waltons() -> pd.DataFrame:
    from lifelines.datasets import load_waltons

    return load_waltons().assign(site=lambda d: np.random.default_rng(2).integers(0, 3, len(d)))


#: Public data with groups and sites: name -> (reader, time, event, group, site column).
KM_SETS: dict[str, tuple[Callable[[], pd.DataFrame], str, str, str, str]] = {
    "lung (inst, sex)": (_lung, "time", "status", "sex", "inst"),
    "veterans (centre, Celltype)": (_veterans, "time", "status", "Celltype", "centre"),
    "waltons (site, group)": (_waltons, "T", "E", "group", "site"),
}


def km_figures(frame: pd.DataFrame, time_col: str, event_col: str, group_col: str, site_col: str
               ) -> dict[str, Any]:
    """fedsurv's Kaplan–Meier curves per group and pooled log-rank test against lifelines' (see the module text)."""
    from lifelines import KaplanMeierFitter
    from lifelines.statistics import logrank_test, multivariate_logrank_test

    import fedsurv

    columns = {"time_col": time_col, "event_col": event_col, "site_col": site_col, "group_col": group_col}
    curves = fedsurv.kaplan_meier(frame, **columns)
    survival, bounds, counts = 0.0, 0.0, True
    parts = dict(list(frame.groupby(group_col, observed=True)))
    for level, part in parts.items():
        ours, ref = curves.loc[level], KaplanMeierFitter().fit(part[time_col], part[event_col])
        if not np.array_equal(ours.index.to_numpy(), ref.survival_function_.index.to_numpy()):
            raise ValueError(f"group {level!r}: fedsurv's timeline is not lifelines'")
        survival = max(survival, float((ours["survival"] - ref.survival_function_.iloc[:, 0]).abs().max()))
        for column, k in (("lower", 0), ("upper", 1)):
            bounds = max(bounds, float((ours[column] - ref.confidence_interval_.iloc[:, k]).abs().max()))
        table = ref.event_table
        counts &= all(np.array_equal(ours[a].to_numpy(), table[b].to_numpy())
                      for a, b in (("at_risk", "at_risk"), ("events", "observed"), ("censored", "censored")))
    test = fedsurv.logrank_test(frame, **columns, stratified=False)
    if len(parts) == 2:
        a, b = parts.values()
        ref_test = logrank_test(a[time_col], b[time_col], a[event_col], b[event_col])
    else:
        ref_test = multivariate_logrank_test(frame[time_col], frame[group_col], frame[event_col])
    return {"sites": int(frame[site_col].nunique()), "groups": len(parts), "records": len(frame),
            "survival_abs": survival, "ci_abs": bounds, "counts_equal": bool(counts), "test": test.test_name,
            "statistic": test.statistic, "statistic_abs": abs(test.statistic - ref_test.test_statistic),
            "p_abs": abs(test.p_value - ref_test.p_value)}


def check_km(name: str) -> dict[str, Any]:
    """One ``km`` row on :data:`KM_SETS` ``[name]`` (a failed row if fedsurv raises)."""
    read, *columns = KM_SETS[name]
    row: dict[str, Any] = {"check": "km", "data": name}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.update(km_figures(read(), *columns))
    except Exception as error:  # noqa: BLE001 - a failed check is a row of the record
        row["error"] = one_line(error)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return judged(row, TARGETS["km"])


# --------------------------------------------------------------------------- the record


#: The tables: title, the checks they hold, and their columns (row key, header).
TABLES: tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = (
    ("Cox through Flower against lifelines' CoxPHFitter on the same training records",
     ("stratified", "pooled", "grid"),
     (("check", "check"), ("data", "data"), ("sites", "sites"), ("events", "events"),
      ("coef_rel", "max |Δβ|/max(|β|,SE)"), ("se_rel", "max |SE/SE_ll−1|"), ("p_abs", "max |Δp|"),
      ("loglik_rel", "rel Δ loglik"), ("ph_transform", "PH transform"), ("ph_stat_abs", "PH max |Δstat|"),
      ("ph_p_abs", "PH max |Δp|"), ("coef_over_se", "max |Δβ|/SE"), ("grid_points", "grid points"),
      ("on_grid_coef_over_se", "on grid: max |Δβ|/SE"), ("seconds", "s"))),
    ("Secure sum (cox.secure_sum=true) against the same run in the clear",
     ("secure stratified", "secure pooled, grid 20"),
     (("check", "check"), ("data", "data"), ("sites", "sites"), ("events", "events"),
      ("coef_rel", "max |Δβ|/max(|β|,SE)"), ("se_rel", "max |SE_s/SE_c−1|"), ("ph_transform", "PH transform"),
      ("ph_stat_rel", "PH max rel Δstat"), ("seconds", "s"))),
    ("fedsurv.kaplan_meier and fedsurv.logrank_test against lifelines", ("km",),
     (("data", "data (sites, groups)"), ("sites", "sites"), ("groups", "groups"), ("survival_abs", "max |ΔS|"),
      ("ci_abs", "max |ΔCI|"), ("counts_equal", "counts equal"), ("test", "test"), ("statistic", "statistic"),
      ("statistic_abs", "|Δstat|"), ("p_abs", "|Δp|"), ("seconds", "s"))),
)


def cell(value: Any) -> str:
    """A table cell: floats in scientific notation, booleans as yes/no, missing as –."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1e}" if value and (abs(value) < 1e-2 or abs(value) >= 1e4) else f"{value:.3g}"
    return str(value).replace("|", "/")


def verdict(row: dict[str, Any]) -> str:
    """``yes``, ``no (<the figures that missed>)`` or ``failed: <message>``."""
    if "error" in row:
        return f"failed: {cell(row['error'])}"
    if row["ok"]:
        return "yes"
    missed = [key for key, target in row["targets"].items() if not meets(row.get(key), target)]
    return f"**no** ({', '.join(missed)})"


def print_tables(rows: list[dict[str, Any]]) -> None:
    """The Markdown tables of the rows, one per kind of check, with their targets."""
    for title, checks, columns in TABLES:
        chosen = [row for row in rows if row["check"] in checks]
        if not chosen:
            continue
        targets = {f"{row['check']}: " + ", ".join(f"{k} ≤ {cell(v)}" if not isinstance(v, bool) else k
                                                   for k, v in row["targets"].items()) for row in chosen}
        print(f"\n### {title}\n\nTargets: " + "; ".join(sorted(targets)) + "\n")
        print("| " + " | ".join(header.replace("|", r"\|") for _, header in columns) + " | meets targets |")
        print("|" + "---|" * (len(columns) + 1))
        for row in chosen:
            print("| " + " | ".join(cell(row.get(key)) for key, _ in columns) + f" | {verdict(row)} |")


def print_shown(name: str) -> None:
    """The stratified run's ``summary_table()`` of ``name`` and lifelines' ``cph.summary`` of the same covariates."""
    if "tables" not in _SHOWN:
        print(f"\n(--show {name}: its stratified run did not complete or was not selected)")
        return
    ours, theirs = _SHOWN["tables"]
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        for label, table in ((f"fedsurv coxph (strata=site), {name}: run.summary_table()", ours),
                             (f"lifelines CoxPHFitter(strata=['site']), {name}: cph.summary", theirs)):
            print(f"\n{label}\n```\n{table.to_string(float_format=lambda v: f'{v:.6g}')}\n```")


def main(argv: list[str] | None = None) -> None:
    """Run the chosen checks, print each row as JSON (appending it to ``--out``), then the tables and ``--show``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--data", default=",".join(DATA_SETS), help="the bundled sets of the Cox checks")
    parser.add_argument("--show", default="gbsg", help="the data set whose stratified summary is printed, or none")
    parser.add_argument("--secure-ph-test", default="auto", help="cox.ph_test of the secure rows (auto: the "
                        "config's default, log stratified and km pooled)")
    parser.add_argument("--out", default="", help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    checks, names = args.checks.split(","), args.data.split(",")
    unknown = sorted(set(checks) - set(CHECKS)) + sorted(set(names) - set(DATA_SETS))
    if unknown:
        raise SystemExit(f"unknown checks or data sets {unknown}: choose from {CHECKS} and {tuple(DATA_SETS)}")
    if args.show != "none":
        _SHOWN["name"] = args.show
    jobs = [functools.partial(check_cox, check, name) for check in COX_CHECKS if check in checks for name in names]
    jobs += [functools.partial(check_secure, check, name, args.secure_ph_test) for check in SECURE_CHECKS
             if "secure" in checks for name in names]
    jobs += [functools.partial(check_km, name) for name in KM_SETS if "km" in checks]
    rows, commit, start = [], code_commit(), time.perf_counter()
    for job in jobs:
        row = {"benchmark": "coxph_reference", "commit": commit, **job()}
        rows.append(row)
        print(json.dumps(row, default=float), flush=True)
        if args.out:
            append_jsonl(args.out, row)
    print_tables(rows)
    failed = sum(not row["ok"] for row in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} rows meet their targets; {time.perf_counter() - start:.0f} s")
    if args.show != "none" and "stratified" in checks:
        print_shown(args.show)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
