r"""The private grouped-time Cox regression on real data, beside the exact full-data fits.

``python -m benchmarks.dp_cox_real [--data gbsg,whas] [--seeds 10] [--settings sum,per_site] [--out rows.jsonl]``
(about 5 s a fit on 2 cores)

Each seed builds the app's federation (``data.name``, 6 sites, ``cox.strata = none``, ``cox.grid = 11``, ε = 1,
δ = 1e-5, the data dictionary of public column ranges in :data:`DICTIONARIES`), its private set-up and the public
design every party builds from it (:func:`flwr_app.cox_messages.private_design`), and runs the private fit in one
process exactly as the app's server steps run it (:func:`models.grouped_cox.run_private` and
:func:`~models.grouped_cox.private_covariance`, the plan of :func:`~flwr_app.cox_messages.private_plan`; under
``sum`` a continuous Gaussian on the sum, where the app's secure sum adds slightly more). It is compared with two
fits of the pooled training records on the model's scale of the covariates, without noise, and with the private
fit's own estimand:

- ``lifelines``: ``lifelines.CoxPHFitter`` (Efron ties) on the original times and the columns as the user has them
  (not clipped to their ranges), mapped linearly to the model's scale: the exact full-data fit;
- ``grouped``: the grouped-time MLE on the private design's grid and covariates (clipped to the ranges);
- ``root``: the root of the recipe's outcome-blind clipped, penalised score on the same records (what the private
  fit estimates), with the grouped MLE's standard errors.

Figures per data set and setting: ``steps``; noise-free (noise multiplier 1e-9: the recipe's own steps), the largest
distance of β̂ from each reference over the coefficients, in the reference's standard errors; with noise, over the
seeds, the share of coefficients whose 95 % interval covers each reference, per coefficient the mean
:math:`(\hat\beta - \beta_{ref})/SE_{ref}`, and the median ratio of the interval's SE to the lifelines SE. One JSON
line per data set and setting (``--out`` appends them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simulations.results_file import code_commit

#: Public column ranges (a data dictionary), per data set: WHAS's 0/1 columns, age and BMI; GBSG's as in its
#: documentation. Other data sets (METABRIC, FLCHAIN) take every range from the private set-up.
DICTIONARIES = {
    "whas": {"numeric": {"x0": [0, 1], "x1": [20, 110], "x2": [0, 1], "x3": [10, 60], "x4": [0, 1], "x5": [0, 1]}},
    "gbsg": {"numeric": {"x0": [0, 1], "x1": [0, 2], "x2": [0, 1], "x3": [18, 100], "x4": [0, 60],
                         "x5": [0, 3000], "x6": [0, 2500]}},
}
SITES, POINTS, EPSILON = 6, 11, 1.0
#: Recipe alternatives for ``--variant``: name -> per setting the fields of :class:`models.grouped_cox.Recipe` and
#: of its :class:`~models.grouped_cox.PrivateSettings` (key ``settings``) that change.
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "chosen": {"sum": {}, "per_site": {}},
    "released P": {"sum": {"score_shares": (0.06, 0.10, 0.15, 0.40), "info_shares": (0.0, 0.25, 0.0, 0.0, 0.0),
                           "precondition": "released"},
                   "per_site": {"score_shares": (0.08, 0.12, 0.51), "info_shares": (0.0, 0.25, 0.0, 0.0),
                                "precondition": "released"}},
    "6 steps": {"sum": {"score_shares": (0.04, 0.05, 0.07, 0.10, 0.15, 0.30), "info_shares": (0.0,) * 6 + (0.25,)},
                "per_site": {"score_shares": (0.04, 0.05, 0.07, 0.10, 0.15, 0.30),
                             "info_shares": (0.0,) * 6 + (0.25,)}},
    "8 steps": {"sum": {"score_shares": (0.03, 0.03, 0.04, 0.05, 0.07, 0.09, 0.12, 0.28),
                        "info_shares": (0.0,) * 8 + (0.25,)},
                "per_site": {"score_shares": (0.03, 0.03, 0.04, 0.05, 0.07, 0.09, 0.12, 0.28),
                             "info_shares": (0.0,) * 8 + (0.25,)}},
    "released P at theta0": {
        "sum": {"score_shares": (0.06, 0.12, 0.53), "info_shares": (0.25, 0.0, 0.0, 0.0), "precondition": "released"},
        "per_site": {"score_shares": (0.06, 0.12, 0.53), "info_shares": (0.25, 0.0, 0.0, 0.0),
                     "precondition": "released"}},
    "released P at theta0, floor 0.5": {
        "sum": {"score_shares": (0.06, 0.12, 0.53), "info_shares": (0.25, 0.0, 0.0, 0.0), "precondition": "released",
                "settings": {"floor": 0.5}},
        "per_site": {"score_shares": (0.06, 0.12, 0.53), "info_shares": (0.25, 0.0, 0.0, 0.0),
                     "precondition": "released", "settings": {"floor": 0.5}}},
    "floor 0.2": {"sum": {"settings": {"floor": 0.2}}, "per_site": {"settings": {"floor": 0.2}}},
    "floor 0.05": {"sum": {"settings": {"floor": 0.05}}, "per_site": {"settings": {"floor": 0.05}}},
    "bounds x2, 6 steps": {
        setting: {"bounds": (("score_alpha", 4.0), ("score_beta", 6.0), ("info_diag", 1.0), ("info_cross", 2.0),
                             ("info_beta", 12.0)),
                  "score_shares": (0.04, 0.05, 0.07, 0.10, 0.15, 0.30), "info_shares": (0.0,) * 6 + (0.25,)}
        for setting in ("sum", "per_site")},
    "bounds x1.5": {
        setting: {"bounds": (("score_alpha", 3.0), ("score_beta", 4.5), ("info_diag", 1.0), ("info_cross", 2.0),
                             ("info_beta", 12.0))}
        for setting in ("sum", "per_site")},
    "bounds x2": {"sum": {"bounds": (("score_alpha", 4.0), ("score_beta", 6.0), ("info_diag", 1.0),
                                     ("info_cross", 2.0), ("info_beta", 12.0))},
                  "per_site": {"bounds": (("score_alpha", 4.0), ("score_beta", 6.0), ("info_diag", 1.0),
                                          ("info_cross", 2.0), ("info_beta", 12.0))}},
}


def recipe(setting: str, variant: str = "chosen"):
    """The recipe of ``setting`` with the changes of ``variant`` (:data:`VARIANTS`)."""
    from models import grouped_cox as gc

    change = dict(VARIANTS[variant][setting])
    base = gc.RECIPES[setting]
    settings = dataclasses.replace(base.settings, **change.pop("settings", {}))
    return dataclasses.replace(base, settings=settings, **change)
STRATEGY = {"sum": "distributed_dp", "per_site": "dp_sgd"}


def federation(data: str, setting: str, seed: int, directory: Path) -> dict[str, Any]:
    """The seed's federation: config, set-up, public design, the sites' records and the pooled (u, time, event)."""
    from flwr_app import task
    from flwr_app.cox_messages import CoxDesign, private_design, private_records
    from flwr_app.config import resolve

    overrides = {"model.name": "coxph", "data.name": data, "federation.num_sites": SITES, "cox.strata": "none",
                 "cox.grid": str(POINTS), "privacy.epsilon": EPSILON, "strategy.name": STRATEGY[setting], "seed": seed}
    if data in DICTIONARIES:
        path = directory / f"{data}.json"
        path.write_text(json.dumps(DICTIONARIES[data]))
        overrides["data.dictionary"] = str(path)
    _, cfg = resolve(overrides)
    dataset, setup = task.load_federation(cfg), task.federation_setup(cfg)
    design = private_design(dataset.preprocessor, setup.cuts, POINTS)
    columns = CoxDesign.from_preprocessor(dataset.preprocessor)
    ordered = sorted(dataset.sites, key=lambda site: site.name)
    sites = [private_records(design, columns.covariates(s.train.x), s.train.time, s.train.event) for s in ordered]
    x = np.concatenate([columns.covariates(s.train.x) for s in ordered])
    u = 2.0 * (x - design.low) / (design.high - design.low) - 1.0 - design._unit(design.center)  # not clipped
    time_ = np.concatenate([np.asarray(s.train.time, dtype=np.float64) for s in ordered])
    event = np.concatenate([np.asarray(s.train.event) > 0 for s in ordered])
    return {"cfg": cfg, "setup": setup, "design": design, "sites": sites, "u": u, "time": time_, "event": event}


def references(fed: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """β and SE on the model's scale of the two exact fits (module docstring); NaN for a column the set-up left
    out (constant on every record)."""
    from lifelines import CoxPHFitter

    live = fed["u"].std(axis=0) > 0  # a column the set-up left out is constant: no coefficient to compare
    frame = pd.DataFrame(fed["u"][:, live], columns=[f"u{k}" for k in np.flatnonzero(live)])
    frame["T"], frame["E"] = fed["time"], fed["event"].astype(int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = CoxPHFitter().fit(frame, "T", "E")
    beta, se = np.full(live.size, np.nan), np.full(live.size, np.nan)
    beta[live], se[live] = fitted.params_.to_numpy(), fitted.standard_errors_.to_numpy()
    grouped = grouped_mle(fed["design"], fed["sites"])
    return {"lifelines": (beta, se),
            "grouped": (np.where(live, grouped[0], np.nan), np.where(live, grouped[1], np.nan))}


def grouped_mle(design, sites, steps: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """β and SE of the grouped-time MLE on ``design``'s grid, by Fisher scoring with every α kept in
    :data:`~models.grouped_cox.ALPHA_RANGE` (an interval without events, or whose hazard is 1, has no finite α)."""
    from models import grouped_cox as gc

    t = design.intervals
    counts = sum(gc.site_counts(s) for s in sites)
    theta = np.concatenate([gc.alpha_start(counts, t), np.zeros(design.covariates)])
    ridge = np.eye(t + design.covariates) * 1e-9
    for _ in range(steps):
        score = sum(gc.record_score(s, theta).sum(axis=0) for s in sites)
        info = gc.information_matrix(sum(gc.record_information(s, theta).sum(axis=0) for s in sites), t,
                                     design.covariates) + ridge
        move = np.linalg.solve(info, score)
        theta = theta + move * min(1.0, 2.0 / max(float(np.max(np.abs(move))), 1e-300))
        theta[:t] = np.clip(theta[:t], *gc.ALPHA_RANGE)
    covariance = np.linalg.inv(info)
    return theta[t:], np.sqrt(np.diag(covariance)[t:])


def clipped_root(fed: dict[str, Any], setting: str, variant: str, steps: int = 40) -> np.ndarray:
    """β of the root of the recipe's outcome-blind clipped, penalised score without noise (the private fit's
    estimand on these records), by steps whose matrix is the exact information plus the penalty."""
    from models import grouped_cox as gc

    design, sites, chosen = fed["design"], fed["sites"], recipe(setting, variant)
    bounds, t, p = chosen.clip_bounds(design), design.intervals, design.covariates
    penalty = gc.smoothing_penalty(design, chosen.settings.smooth)
    counts = sum(gc.site_counts(s) for s in sites)
    theta = np.concatenate([gc.alpha_start(counts, t), np.zeros(p)])
    for _ in range(steps):
        score = sum(gc.site_step(s, theta, bounds, with_information=False).score for s in sites)
        info = gc.information_matrix(sum(gc.record_information(s, theta).sum(axis=0) for s in sites), t, p)
        theta = gc.newton_update(theta, score, info + penalty + np.eye(t + p) * 1e-9, penalty, t)
    return theta[t:]


def private_fit(fed: dict[str, Any], setting: str, variant: str, rng: np.random.Generator, *, noise: bool = True):
    """The private fit on the model's scale: (β, SE, steps)."""
    from flwr_app.cox_messages import private_plan
    from models import grouped_cox as gc

    chosen = recipe(setting, variant)
    total = private_plan(fed["cfg"], fed["setup"].setups["site-0"], sites=SITES).total
    plan = chosen.plan(total, setting=setting, sites=SITES)
    if not noise:
        plan = dataclasses.replace(plan, total=1e-9)
    bounds = chosen.clip_bounds(fed["design"])
    trace = gc.run_private(fed["design"], fed["sites"], plan, bounds, chosen.settings, rng)
    covariance = gc.private_covariance(trace, fed["design"], plan, bounds, chosen.settings, rng)
    t = fed["design"].intervals
    return trace.thetas[-1][t:], np.sqrt(np.diag(covariance)[t:]), plan.steps


def measure(data: str, setting: str, seeds: int, variant: str = "chosen") -> dict[str, Any]:
    """The figures of one data set and setting over ``seeds`` seeds (module docstring)."""
    z = {"lifelines": [], "grouped": [], "root": []}
    noise_free = {"lifelines": [], "grouped": [], "root": []}
    root_gap = {"lifelines": [], "grouped": [], "steps": []}
    ratios, steps = [], 0
    with tempfile.TemporaryDirectory() as directory:
        for seed in range(seeds):
            fed = federation(data, setting, seed, Path(directory))
            refs = references(fed)
            beta, se, steps = private_fit(fed, setting, variant, np.random.default_rng([seed, 7]))
            clean, _, _ = private_fit(fed, setting, variant, np.random.default_rng(0), noise=False)
            root = clipped_root(fed, setting, variant)
            refs["root"] = (root, refs["grouped"][1])
            for name, (ref, ref_se) in refs.items():
                z[name].append(np.column_stack([(beta - ref) / se, (beta - ref) / ref_se]))
                noise_free[name].append((clean - ref) / ref_se)
                if name in root_gap:
                    root_gap[name].append((root - ref) / ref_se)
            root_gap["steps"].append((clean - root) / refs["lifelines"][1])
            ratios.append(se / refs["lifelines"][1])
    row: dict[str, Any] = {"variant": variant, "data": data, "setting": setting, "seeds": seeds, "steps": steps,
                           "sites": SITES,
                           "epsilon": EPSILON, "median_se_ratio": float(np.median(ratios))}
    for name, gaps in root_gap.items():  # root - reference; "steps": noise-free fit - root (lifelines SEs)
        row[f"root_z_{name}"] = np.round(np.nanmean(gaps, axis=0), 2).tolist()
    for name in z:
        stacked = np.array(z[name])  # seeds, p, 2
        covered = np.where(np.isnan(stacked[:, :, 0]), np.nan, np.abs(stacked[:, :, 0]) <= 1.959964)
        row[f"coverage_{name}"] = float(np.nanmean(covered))
        row[f"coverage_{name}_per_coef"] = np.round(np.nanmean(covered, axis=0), 2).tolist()
        row[f"mean_z_{name}"] = np.round(np.nanmean(stacked[:, :, 1], axis=0), 2).tolist()
        clean = np.array(noise_free[name])
        row[f"noise_free_max_se_{name}"] = round(float(np.nanmax(np.abs(clean))), 2)
        row[f"noise_free_z_{name}"] = np.round(np.nanmean(clean, axis=0), 2).tolist()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="gbsg,whas")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--settings", default="sum,per_site")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", default="chosen", choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    for data in args.data.split(","):
        for setting in args.settings.split(","):
            started = time.perf_counter()
            row = measure(data, setting, args.seeds, args.variant)
            row["seconds"] = round(time.perf_counter() - started, 1)
            row["commit"] = code_commit()
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as handle:
                    handle.write(line + "\n")


if __name__ == "__main__":
    main()
