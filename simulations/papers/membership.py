"""Membership-inference audit of every horizontal strategy: the server's loss-threshold attack vs the DP ceiling.

For every (strategy, ε, seed) the federation runs through the ServerApp and ClientApp themselves
(:func:`simulations.engine.run_inprocess`). The server then attacks, per site,

* the final **global** model, and
* the site's **update** in the last round (the weights the site sent, as the server received them;
  not for a strategy with a secure sum, whose server receives only masked vectors: :func:`targets`),

with Yeom et al.'s loss-threshold attack (:func:`strategies.audits.membership.loss_threshold_attack`
on :func:`~strategies.audits.membership.survival_log_loss`): members are the site's training
records, non-members its held-out test records (same population, never trained on). Beside each
attack: the ceiling any attack has against the record-level (ε, δ) the mechanism guarantees for
that release (:func:`record_level_budget`): AUC, advantage and TPR at 1 % FPR. One row per
(run, site, target) is appended to ``OUT/results.csv``; ``OUT/table.md`` and ``OUT/figure.png``
summarise them.

Usage::

    python -m simulations.papers.membership --out DIR [--strategies fedavg,dp_sgd,...] [--epsilons 1,3,10]
        [--seeds 0,1,2] [--jobs 2] [key=value ...]

References
----------
Yeom et al., CSF 2018; Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1 (the ceilings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np

from flwr_app import interrupt
from simulations.hydra_config import parse_value
from simulations.results_file import append_runs, mean_std, read_rows

STRATEGIES = ("fedavg", "dp_sgd", "distributed_dp", "bdp", "central_dp", "nbafl", "ls_adp", "row_dp")
TARGETS = ("global", "update")
FPR = 0.01
FIELDS = ("strategy", "epsilon_target", "seed", "site", "target", "auc", "auc_se", "advantage", "tpr_at_fpr",
          "ceiling_auc", "ceiling_advantage", "ceiling_tpr_at_fpr", "epsilon_record", "delta_record",
          "guarantee", "members", "non_members", "test_c_index")


def targets(strategy: str) -> tuple[str, ...]:
    """What the server can attack in a run of ``strategy``: the global model, and each site's update unless the
    sites send it into a secure sum (the server then receives masked vectors, uniform alone, and only their sum)."""
    from strategies.mechanisms.base import SecureSumMechanism
    from strategies.mechanisms.registry import horizontal_mechanism

    return ("global",) if isinstance(horizontal_mechanism(strategy), SecureSumMechanism) else TARGETS


def record_level_budget(entry: Mapping[str, Any] | None, *, target: str) -> tuple[float, float, str]:
    """The record-level (ε, δ) that bounds a membership attack on ``target``, from the site's last ledger entry.

    * ``dp_sgd``: the site's ε (add/remove one record) for the update and, by post-processing, the
      global model.
    * ``distributed_dp``: the site's ε (add/remove one record, on the union of the sites, under the
      secure sum's threat model) for the global model; its update is never seen (:func:`targets`).
    * ``nbafl``/``ls_adp``/``row_dp``: the site's RDP ε (replace-one record, under the paper's
      sensitivity assumption); the membership game with a fixed number of records is a
      replace-one experiment.
    * ``bdp``: its classical (worst-case) ε; the Bayesian ``ε_μ`` is an average over the data
      distribution and bounds no single attack.
    * ``central_dp``: the update reaches the server clipped but without noise (no bound). The
      global model is (ε, δ)-DP for adding or removing a whole site; changing one record changes
      one site's clipped update, i.e. replaces it, which doubles the sensitivity: the record-level
      ε is that of noise multiplier ``σ/2`` over the same rounds.
    * no mechanism: ``inf``.

    Returns ``(epsilon, delta, guarantee)``, ``guarantee`` a short label of which bound applies.
    """
    from strategies.accounting.rdp import epsilon_gaussian_rounds

    if entry is None or entry.get("epsilon") is None:
        return math.inf, 0.0, "none"
    mechanism = str(entry["mechanism"])
    delta = float(entry["delta"])
    if mechanism == "central_dp":
        if target == "update":
            return math.inf, 0.0, "none (the server sees the update before clipping and noise)"
        epsilon = epsilon_gaussian_rounds(noise_multiplier=float(entry["noise_multiplier"]) / 2.0,
                                          rounds=int(entry["steps"]), delta=delta)
        return epsilon, delta, "site-level DP, record via replace-one site (sigma/2)"
    if mechanism.startswith("bdp"):
        return float(entry["epsilon_classical"]), delta, "classical epsilon of the BDP run"
    return float(entry["epsilon"]), delta, f"record-level, {entry['adjacency']}"


def _audit(job: tuple[str, float, int, dict[str, Any]]) -> list[dict[str, Any]]:
    import torch

    from flwr_app import task
    from simulations.engine import resolve, run_inprocess, strategy_overrides
    from strategies.audits.membership import (
        loss_threshold_attack,
        max_advantage,
        max_auc,
        max_true_positive_rate,
        survival_log_loss,
    )

    strategy, epsilon, seed, shared = job
    shared, _ = strategy_overrides(strategy, shared)
    updates: dict[int, Any] = {}

    def observe(message, reply) -> None:  # keep each node's last training reply: the update the server sees
        if message.metadata.message_type.startswith("train") and not reply.has_error() and "arrays" in reply.content:
            updates[message.metadata.dst_node_id] = reply.content["arrays"]

    with TemporaryDirectory() as out:
        overrides = {**shared, "strategy.name": strategy, "seed": seed, "output.dir": out,
                     "privacy.epsilon": "inf" if math.isinf(epsilon) else epsilon}
        _, cfg = resolve(overrides)
        summary = run_inprocess(overrides, observe=observe)
        saved = torch.load(Path(out) / "model.pt", weights_only=False)
        ledger = [json.loads(line) for line in (Path(out) / "ledger.jsonl").read_text().splitlines()]
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    last_entry = {entry["site"]: entry for entry in ledger}
    rows = []
    for node, site in enumerate(dataset.sites, start=1):
        for target in targets(strategy):
            arrays = saved["state_dict"] if target == "global" else updates[node].to_torch_state_dict()
            model.net.load_state_dict(arrays)
            if model.needs_baseline and saved.get("baseline") is not None:
                model.set_baseline(*saved["baseline"])
            losses = []
            for part in (site.train, site.test):
                times, surv = model.predict_survival(part.x)
                losses.append(survival_log_loss(times, surv, part.time, part.event))
            attack = loss_threshold_attack(losses[0], losses[1], fpr=FPR)
            budget_epsilon, budget_delta, guarantee = record_level_budget(last_entry.get(site.name), target=target)
            rows.append({
                "strategy": strategy, "epsilon_target": epsilon, "seed": seed, "site": site.name, "target": target,
                "auc": attack.auc, "auc_se": attack.auc_standard_error, "advantage": attack.advantage,
                "tpr_at_fpr": attack.tpr_at_fpr,
                "ceiling_auc": max_auc(epsilon=budget_epsilon, delta=budget_delta),
                "ceiling_advantage": max_advantage(epsilon=budget_epsilon, delta=budget_delta),
                "ceiling_tpr_at_fpr": float(max_true_positive_rate(FPR, epsilon=budget_epsilon, delta=budget_delta)),
                "epsilon_record": budget_epsilon, "delta_record": budget_delta, "guarantee": guarantee,
                "members": attack.members, "non_members": attack.non_members,
                "test_c_index": summary["test"].get("c_index", math.nan),
            })
    return rows


def run_grid(out: Path, strategies: Sequence[str], epsilons: Sequence[float], seeds: Sequence[int],
             shared: dict[str, Any], jobs: int) -> list[dict[str, Any]]:
    """Run the missing (strategy, ε, seed) audits (FedAvg once per seed, at ε = inf); return every row."""
    from simulations.engine import strategy_overrides

    path = out / "results.csv"
    for strategy in strategies:
        if dropped := strategy_overrides(strategy, shared)[1]:
            print(f"membership grid: {strategy} runs without {', '.join(f'{k}={shared[k]}' for k in dropped)} "
                  "(keys it does not honour)", flush=True)
    done = {(row["strategy"], row["epsilon_target"], int(row["seed"])) for row in _read(path)}
    todo = [(strategy, epsilon, seed, shared) for seed in seeds for strategy in strategies
            for epsilon in ([math.inf] if strategy == "fedavg" else epsilons)
            if (strategy, epsilon, seed) not in done]
    append_runs(path, FIELDS, todo, _audit, workers=jobs, describe=lambda row: (
        f"{row['strategy']} eps={row['epsilon_target']} seed={row['seed']} {row['site']} {row['target']}: "
        f"AUC {row['auc']:.3f} (ceiling {row['ceiling_auc']:.3f}), TPR@1% {row['tpr_at_fpr']:.3f}"))
    return _read(path)


def _read(path: Path) -> list[dict[str, Any]]:
    return read_rows(path, text_fields=("strategy", "site", "target", "guarantee"))


def _run_c_index(group: list[dict[str, Any]]) -> str:
    """Mean ± std over the runs (one per seed) of the run's test C-index; "–" if every run diverged."""
    return mean_std(c for _, c in sorted({(r["seed"], r["test_c_index"]) for r in group}))


def write_report(out: Path, rows: list[dict[str, Any]]) -> str:
    """``table.md`` (per strategy, ε and target: attack figures over sites and seeds beside the ceilings) and ``figure.png``."""
    lines = [f"Loss-threshold membership attack by the server; members: a site's training records, non-members: its "
             f"test records. Mean ± std over sites × seeds; ceilings at the record-level (ε, δ) of that release "
             f"(the smallest over sites and seeds); TPR at {FPR:.0%} FPR. \"above ceiling\": attacks whose AUC "
             f"exceeds its ceiling by more than 1.96 Hanley-McNeil standard errors (TPR at {FPR:.0%} FPR rests on a "
             f"handful of non-members per site and is not tested against its ceiling).", "",
             "| strategy | target ε | attacked | AUC | ceiling AUC | advantage | ceiling advantage | "
             f"TPR@{FPR:.0%} | ceiling TPR@{FPR:.0%} | record ε (max) | above ceiling | test C | guarantee |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["strategy"], r["epsilon_target"], r["target"]) for r in rows},
                  key=lambda k: (STRATEGIES.index(k[0]) if k[0] in STRATEGIES else 99, k[1], TARGETS.index(k[2])))
    for strategy, epsilon, target in keys:
        group = [r for r in rows if (r["strategy"], r["epsilon_target"], r["target"]) == (strategy, epsilon, target)]
        above = sum(r["auc"] - 1.96 * r["auc_se"] > r["ceiling_auc"] for r in group)
        lines.append(
            f"| {strategy} | {'∞' if math.isinf(epsilon) else f'{epsilon:g}'} | {target} | "
            f"{mean_std([r['auc'] for r in group])} | {min(r['ceiling_auc'] for r in group):.3f} | "
            f"{mean_std([r['advantage'] for r in group])} | {min(r['ceiling_advantage'] for r in group):.3f} | "
            f"{mean_std([r['tpr_at_fpr'] for r in group])} | {min(r['ceiling_tpr_at_fpr'] for r in group):.3f} | "
            f"{max(r['epsilon_record'] for r in group):.3g} | {above}/{len(group)} | "
            f"{_run_c_index(group)} | "
            f"{group[0]['guarantee']} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    _figure(out / "figure.png", rows)
    return text


def _figure(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TARGETS), figsize=(11, 4.2), squeeze=False)
    finite = sorted({r["epsilon_target"] for r in rows if math.isfinite(r["epsilon_target"])})
    for axis, target in zip(axes[0], TARGETS, strict=True):
        chosen = [r for r in rows if r["target"] == target]
        if finite:
            grid = np.geomspace(min(finite), max(finite), 100)
            axis.plot(grid, np.exp(grid) / (1 + np.exp(grid)), "k:", label="e^ε/(1+e^ε) (δ = 0)")
        for index, strategy in enumerate(s for s in STRATEGIES if s != "fedavg"):
            points = [(e, np.mean([r["auc"] for r in chosen if r["strategy"] == strategy and r["epsilon_target"] == e]))
                      for e in finite if any(r["strategy"] == strategy and r["epsilon_target"] == e for r in chosen)]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", color=f"C{index}", label=strategy)
        no_dp = [r["auc"] for r in chosen if r["strategy"] == "fedavg"]
        if no_dp:
            axis.axhline(np.mean(no_dp), color="grey", linestyle="--", label="FedAvg (no DP)")
        axis.set_xscale("log")
        axis.set_ylim(0.45, 1.0)
        axis.set_xlabel("target ε")
        axis.set_ylabel("attack AUC")
        axis.set_title(f"attack on the {target} model" if target == "global" else "attack on a site's update")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--epsilons", default="1,3,10")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument("--report-only", action="store_true", help="rewrite table.md/figure.png from results.csv")
    parser.add_argument("overrides", nargs="*", help="run-config key=value shared by every run")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",")]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    shared = {"evaluation.server_side": True, "baseline.centralized": False,
              **{key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}}
    rows = (_read(args.out / "results.csv") if args.report_only else
            run_grid(args.out, strategies, [float(e) for e in args.epsilons.split(",")],
                     [int(s) for s in args.seeds.split(",")], shared, args.jobs))
    print(write_report(args.out, rows))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
