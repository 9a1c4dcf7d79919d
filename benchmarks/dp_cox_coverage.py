r"""Coverage of the differentially private grouped-time Cox regression's confidence intervals, by simulation.

``python -m benchmarks.dp_cox_coverage [--reps 400] [--seed 2027] [--settings sum,per_site] [--compare]
[--out rows.jsonl]`` (about 10 s a configuration at 400 replicates on 2 cores)

The federation (:func:`simulate_federation`, sizes fixed, not drawn): 6 centres of 40, 70, 100, 150, 200 and 250
records (810 in all), 5 covariates (:data:`BETA` = 0.5, -0.5, 0.3, 0, 0 per unit: x1, x3, x5 standard normal cut at
±3, x2 Bernoulli(0.5), x4 Bernoulli(0.3)), continuous event times from a Weibull proportional-hazards model (shape
1.5), independent exponential censoring at the rate that censors 30 % (:func:`censoring_rate`). Public for the
simulation, as a data dictionary would make them: the covariates' ranges (±3 and 0..1), centres (their means) and
spreads on the model's scale, and the grid: :data:`INTERVALS` = 10 intervals cut at the quantiles j/11 of the event
times of a public reference sample (:func:`public_grid`; later times are censored at the last cut).

Privacy: ε = 1, δ = 1e-5 over all releases, add/remove one record; the noise multiplier of one Gaussian release at
(ε, δ) by the project's PLD accountant (:func:`calibrate_plan`), split over the releases by :data:`PLAN`. Settings:
``sum`` (``distributed_dp``'s: one Gaussian on the summed releases) and ``per_site`` (``dp_sgd``'s: every site adds
the full noise). Each replicate draws a federation, fits the private model
(:func:`models.grouped_cox.fit_private`) and the non-private maximum likelihood fit of the same model
(:func:`models.grouped_cox.fit_exact`: no clipping, no noise), and scores the 95 % intervals of the five
coefficients. Figures per setting: ``coverage`` over all interval-coefficient pairs (target 0.925-0.975 for
both settings), per coefficient, the median interval width beside the non-private width, the mean bias of β̂, and the
last-step delta method's coverage and width for comparison. ``--compare`` adds the design alternatives the choices
were made against (:data:`ALTERNATIVES`). Prints one JSON line per setting (``--out`` appends them)
and a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from models.grouped_cox import (
    ClipBounds,
    GroupedCoxDesign,
    RECIPES,
    NoisePlan,
    PrivateSettings,
    SiteRecords,
    fit_exact,
    fit_private,
    prepare_site,
    private_covariance,
)
from simulations.results_file import append_jsonl, code_commit
from strategies.accounting.rdp import calibrate_noise_multiplier, epsilon_from_history

#: True log hazard ratios per unit of each covariate.
BETA = np.array([0.5, -0.5, 0.3, 0.0, 0.0])
#: Records per centre (fixed across replicates).
SIZES = (40, 70, 100, 150, 200, 250)
#: Agreed ranges, centres (the covariates' means) and spreads on the model's scale (2·sd/(high - low)).
LOW = np.array([-3.0, 0.0, -3.0, 0.0, -3.0])
HIGH = np.array([3.0, 1.0, 3.0, 1.0, 3.0])
CENTER = np.array([0.0, 0.5, 0.0, 0.3, 0.0])
SCALES = np.array([1 / 3, 1.0, 1 / 3, 2 * np.sqrt(0.21), 1 / 3])
#: Weibull shape of the baseline hazard, the censored share, the number of intervals.
SHAPE, CENSORED, INTERVALS = 1.5, 0.30, 10
EPSILON, DELTA = 1.0, 1e-5
#: Budget shares per setting (counts, the score steps, the information at the final θ for the covariance): the app's.
PLAN = {name: {"count_share": r.count_share, "score_shares": r.score_shares, "info_shares": r.info_shares}
        for name, r in RECIPES.items()}
#: Design alternatives for ``--compare``: name -> (setting, plan, bounds and settings overrides, intervals).
ALTERNATIVES: dict[str, tuple[str, dict, dict, dict, int]] = {
    "last-step delta method": ("sum", {}, {}, {"covariance": "delta"}, INTERVALS),
    "no bias correction": ("sum", {}, {}, {"correction_draws": 0}, INTERVALS),
    "no alpha smoothing": ("sum", {}, {}, {"smooth": 0.0}, INTERVALS),
    "information as the steps' matrix (floor 0.9)": (
        "sum", {"score_shares": (0.08, 0.10, 0.12, 0.41), "info_shares": (0, 0.25, 0, 0, 0),
                "precondition": "released"}, {}, {"floor": 0.9}, INTERVALS),
    "block-diagonal information": ("sum", {}, {"info_cross": None}, {}, INTERVALS),
    "3 steps": ("sum", {"score_shares": (0.10, 0.15, 0.46), "info_shares": (0, 0, 0, 0.25)}, {}, {}, INTERVALS),
    "12 intervals": ("sum", {}, {}, {}, 12),
    "per site: information bounds halved": (
        "per_site", {}, {"info_diag": 0.5, "info_cross": 1.0, "info_beta": 6.0}, {}, INTERVALS),
    "per site: per-interval start": ("per_site", {}, {}, {"start_smooth": 0.0}, INTERVALS),
    "per site: no alpha move cap": ("per_site", {}, {}, {"max_alpha_move": float("inf")}, INTERVALS),
    "per site: the previous design (per-interval start, no cap)": (
        "per_site", {}, {}, {"start_smooth": 0.0, "max_alpha_move": float("inf")}, INTERVALS),
    "per site: the sum's design": (
        "per_site", PLAN["sum"], {}, dataclasses.asdict(RECIPES["sum"].settings), INTERVALS),
}


def covariates(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` records' covariates (n, 5), as the module docstring says."""
    x = np.empty((n, 5))
    x[:, [0, 2, 4]] = np.clip(rng.standard_normal((n, 3)), -3.0, 3.0)
    x[:, 1] = rng.random(n) < 0.5
    x[:, 3] = rng.random(n) < 0.3
    return x


def draw_records(n: int, rng: np.random.Generator, rate: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, time, event)`` of ``n`` records: Weibull PH event times (cumulative baseline hazard t^SHAPE),
    exponential censoring of ``rate``."""
    x = covariates(n, rng)
    event_time = (rng.exponential(size=n) / np.exp(x @ BETA)) ** (1.0 / SHAPE)
    censor_time = rng.exponential(1.0 / rate, size=n)
    return x, np.minimum(event_time, censor_time), (event_time <= censor_time).astype(int)


@functools.cache
def censoring_rate(target: float = CENSORED) -> float:
    """The censoring rate that censors ``target`` of a public reference sample (200,000 records, seed 1)."""
    low, high = 1e-3, 10.0
    for _ in range(50):
        middle = float(np.sqrt(low * high))
        _, _, event = draw_records(200_000, np.random.default_rng(1), middle)
        low, high = (low, middle) if 1.0 - event.mean() > target else (middle, high)
    return float(np.sqrt(low * high))


@functools.cache
def public_grid(intervals: int = INTERVALS) -> tuple[float, ...]:
    """0 and the quantiles j/(T+1), j = 1..T, of the event times of a public reference sample (seed 2)."""
    _, time_, event = draw_records(200_000, np.random.default_rng(2), censoring_rate())
    cuts = np.quantile(time_[event == 1], np.arange(1, intervals + 1) / (intervals + 1))
    return (0.0, *map(float, cuts))


def design(intervals: int = INTERVALS) -> GroupedCoxDesign:
    """The public design of the simulation."""
    return GroupedCoxDesign(np.array(public_grid(intervals)), LOW, HIGH, names=("x1", "x2", "x3", "x4", "x5"),
                            center=CENTER, scales=SCALES)


def simulate_federation(model: GroupedCoxDesign, rng: np.random.Generator) -> list[SiteRecords]:
    """One federation: every centre's records (:data:`SIZES`) as the model sees them."""
    rate = censoring_rate()
    return [prepare_site(model, *draw_records(n, rng, rate)) for n in SIZES]


def calibrate_plan(*, epsilon: float = EPSILON, delta: float = DELTA, setting: str = "sum",
                   accountant: str = "pld", **shares: Any) -> NoisePlan:
    """The plan of ``shares`` whose releases together spend at most (ε, δ): the multiplier of one Gaussian
    mechanism calibrated by the project's accountant (:func:`strategies.accounting.rdp.calibrate_noise_multiplier`,
    q = 1, one step; ``pld`` by default, ``rdp`` offered), split by the shares (an exact composition). Checked:
    the accountant's ε of :meth:`NoisePlan.history` is within 1e-9 of its ε for the single release."""
    total = calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1,
                                       accountant=accountant)
    plan = NoisePlan(total=total, setting=setting, sites=len(SIZES), **shares)
    spent = epsilon_from_history(plan.history(), delta=delta, accountant=accountant)
    if spent > epsilon + 1e-9:
        raise RuntimeError(f"the plan spends epsilon {spent} > {epsilon}")
    return plan


def replicate(model: GroupedCoxDesign, plan: NoisePlan, bounds: ClipBounds, settings: PrivateSettings,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One federation's private and non-private fits: errors, interval half-widths (z·SE) and coverage."""
    sites = simulate_federation(model, rng)
    exact = fit_exact(model, sites)
    fit, trace = fit_private(model, sites, plan, bounds, rng=rng, settings=settings)
    delta = private_covariance(trace, model, plan, bounds, dataclasses.replace(settings, covariance="delta"), rng)
    delta_se = np.sqrt(np.diag(delta)[model.intervals:]) * model.per_unit()
    z = 1.959963984540054
    return {"error": fit.beta - BETA, "width": 2 * z * fit.standard_errors, "exact_error": exact.beta - BETA,
            "exact_width": 2 * z * exact.standard_errors, "delta_width": 2 * z * delta_se,
            "truncated": np.array(trace.diagnostics[-1][1] / sum(SIZES))}


def summarise(rows: Sequence[dict[str, np.ndarray]], name: str, plan: NoisePlan) -> dict[str, Any]:
    """The figures of one setting from its replicates (module docstring)."""
    get = {key: np.array([row[key] for row in rows]) for key in rows[0]}
    covered = np.abs(get["error"]) <= get["width"] / 2
    exact_covered = np.abs(get["exact_error"]) <= get["exact_width"] / 2
    delta_covered = np.abs(get["error"]) <= get["delta_width"] / 2
    return {
        "benchmark": "dp_cox_coverage", "setting": name, "epsilon": EPSILON, "delta": DELTA,
        "noise_multiplier": plan.total, "replicates": len(rows), "pairs": int(covered.size),
        "coverage": float(covered.mean()), "coverage_by_coefficient": covered.mean(axis=0).round(3).tolist(),
        "median_width": float(np.median(get["width"])), "median_width_no_dp": float(np.median(get["exact_width"])),
        "coverage_no_dp": float(exact_covered.mean()), "mean_bias": get["error"].mean(axis=0).round(4).tolist(),
        "mean_bias_no_dp": get["exact_error"].mean(axis=0).round(4).tolist(),
        "rmse": np.sqrt((get["error"] ** 2).mean(axis=0)).round(4).tolist(),
        "delta_method_coverage": float(delta_covered.mean()),
        "delta_method_median_width": float(np.median(get["delta_width"])),
        "truncated_share": float(get["truncated"].mean()), "commit": code_commit(),
    }


def run_setting(name: str, setting: str, *, reps: int, seed: int, plan_overrides: dict | None = None,
                bound_overrides: dict | None = None, setting_overrides: dict | None = None,
                intervals: int = INTERVALS) -> dict[str, Any]:
    """``reps`` replicates of one configuration (seeded: ``seed``), summarised."""
    model = design(intervals)
    plan = calibrate_plan(setting=setting, **{**PLAN[setting], **(plan_overrides or {})})
    bounds = ClipBounds.from_scalars(model, **{**dict(RECIPES[setting].bounds), **(bound_overrides or {})})
    settings = dataclasses.replace(RECIPES[setting].settings, **(setting_overrides or {}))
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    rows = [replicate(model, plan, bounds, settings, rng) for _ in range(reps)]
    return {**summarise(rows, name, plan), "seed": seed, "seconds": round(time.perf_counter() - start, 1)}


def table(results: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of ``results``."""
    header = ("| setting | pairs | coverage | per coefficient | median width (no DP) | mean bias of β̂ | RMSE of β̂ "
              "| last-step delta: coverage, width |")
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| {r['setting']} | {r['pairs']} | {r['coverage']:.3f} | "
            f"{', '.join(f'{c:.3f}' for c in r['coverage_by_coefficient'])} | "
            f"{r['median_width']:.3f} ({r['median_width_no_dp']:.3f}) | "
            f"{', '.join(f'{b:+.3f}' for b in r['mean_bias'])} | "
            f"{', '.join(f'{e:.3f}' for e in r['rmse'])} | "
            f"{r['delta_method_coverage']:.3f}, {r['delta_method_median_width']:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400, help="replicates per setting (5 pairs each)")
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--settings", default="sum,per_site", help="comma-separated: sum, per_site")
    parser.add_argument("--compare", action="store_true", help="also the design alternatives (ALTERNATIVES)")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    jobs = [(f"{setting} (chosen)", setting, {}, {}, {}, INTERVALS) for setting in args.settings.split(",")]
    if args.compare:
        jobs += [(name, *spec) for name, spec in ALTERNATIVES.items()]
    results = []
    for name, setting, plan_overrides, bound_overrides, setting_overrides, intervals in jobs:
        row = run_setting(name, setting, reps=args.reps, seed=args.seed, plan_overrides=plan_overrides,
                          bound_overrides=bound_overrides, setting_overrides=setting_overrides, intervals=intervals)
        print(json.dumps(row), flush=True)
        if args.out:
            append_jsonl(args.out, row)
        results.append(row)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
