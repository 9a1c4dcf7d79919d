"""Cost of one DP-SGD step relative to one plain (non-private) step on the hazard MLP.

Same model (FSL-BDP architecture: Input -> 128 -> 64 -> 64 -> 32 -> 32 -> T, SELU), same data
(FLCHAIN-like synthetic, 19 features), same batch (128 records), Adam, one CPU thread, measured
in one run after a warm-up, the variants interleaved block by block. DP variants (backends of
:func:`strategies.mechanisms.dp_sgd_training.dp_sgd_step`): ``ghost`` (one backward pass to the
Linear layers' outputs, every layer's exact per-sample norms from two matrix products, the clipped
sum plus noise written into ``.grad`` with one ``addmm``/``addmv`` per parameter), ``torch_func``
(per-sample gradients by ``vmap``) and ``opacus`` (``GradSampleModule``, reused across steps as
``train_epochs_dp`` does), and, for comparison, opacus' own ghost clipping
(``GradSampleModuleFastGradientClipping``: per-sample norms in a first backward pass, the clipped
sum in a second; its clipped sum is checked against ours and the difference printed). Each DP
step = per-sample gradients/norms + clip + noisy sum / (q n) + Adam step. Prints one JSON object;
``ratio_*`` are ratios of the mean step times, ``median_round_ratio_*`` the median over the rounds
of each round's ratio (the variants of a round run back to back: steadier on a loaded machine);
``ratio_dp_over_plain`` is for the default backend.

Usage::

    python benchmarks/dp_step.py [--repeats 200] [--batch-size 128] [--features 19]

Targets: ratio_dp_over_plain <= 1.4; ratio_bdp_over_dp <= 1.3 (BDP
with the default add-remove adjacency; ``ratio_bdp_replace_one_over_dp`` is the FSL-BDP replace-one variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.survival import build_survival_model
from models.time_grid import make_time_grid
from strategies.accounting.bayesian_dp import BayesianAccountant
from strategies.mechanisms.bdp_training import account_step
from strategies.mechanisms.dp_sgd_training import (
    DEFAULT_BACKEND,
    clipped_sum_ghost,
    dp_sgd_step,
)


def _time_per_call(step: Callable[[], object], *, warmup: int, repeats: int, rounds: int) -> dict[str, float]:
    """Mean and median over ``rounds`` blocks of ``repeats`` calls, seconds per call."""
    for _ in range(warmup):
        step()
    blocks = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        blocks.append((time.perf_counter() - start) / repeats)
    return {"mean_s": statistics.fmean(blocks), "median_s": statistics.median(blocks), "min_s": min(blocks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per variant (interleaved)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--features", type=int, default=19)
    parser.add_argument("--num-durations", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rng = np.random.default_rng(0)
    n = 4 * args.batch_size
    x = rng.normal(size=(n, args.features)).astype(np.float32)
    t = rng.exponential(1500.0, size=n)
    e = (rng.random(n) < 0.3).astype(np.float32)
    cuts = make_time_grid(t, e, num_durations=args.num_durations)
    batch = slice(0, args.batch_size)
    xb, tb, eb = torch.from_numpy(x[batch]), torch.from_numpy(t[batch]), torch.from_numpy(e[batch])

    def fresh():
        model = build_survival_model("hazard_mlp", in_features=args.features, cuts=cuts, seed=0)
        return model, torch.optim.Adam(model.net.parameters(), lr=1e-4)

    plain_model, plain_opt = fresh()

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        plain_model.loss(xb, tb, eb).backward()
        plain_opt.step()

    generator = torch.Generator().manual_seed(0)
    steps: dict[str, Callable[[], object]] = {"plain": plain_step}
    from opacus import GradSampleModule

    modules = {}
    for backend in ("ghost", "torch_func", "opacus"):
        model, optimizer = fresh()
        gsm = GradSampleModule(model.net, batch_first=True, loss_reduction="sum") if backend == "opacus" else None
        modules[backend] = gsm
        steps[f"dp_{backend}"] = partial(
            dp_sgd_step, model, optimizer, xb, tb, eb, noise_multiplier=1.0, clip_norm=1.0,
            expected_batch_size=float(args.batch_size), generator=generator, backend=backend,
            grad_sample_module=gsm,
        )
    # opacus' own ghost clipping (GradSampleModuleFastGradientClipping, two backward passes), the
    # library alternative to our "ghost" backend: its clipped sum is checked against ours, then the
    # same noise and Adam step are timed.
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    fgc_model, fgc_optimizer = fresh()
    fgc = GradSampleModuleFastGradientClipping(fgc_model.net, batch_first=True, loss_reduction="sum",
                                               max_grad_norm=1.0, use_ghost_clipping=True)

    def opacus_clipped_sum() -> list[torch.Tensor]:
        fgc.enable_hooks()
        fgc_optimizer.zero_grad(set_to_none=True)
        losses = fgc_model.per_sample_loss(xb, tb, eb)
        losses.sum().backward(retain_graph=True)
        coefficients = fgc.get_clipping_coef()
        fgc_optimizer.zero_grad(set_to_none=True)
        fgc.disable_hooks()
        (coefficients.detach() * losses).sum().backward()
        return [p.grad.detach().clone() for p in fgc_model.net.parameters()]

    ours, _, _, _ = clipped_sum_ghost(fresh()[0], xb, tb, eb, clip_norm=1.0)
    opacus_ghost_max_abs_diff = max(float((a - b).abs().max()) for a, b in zip(opacus_clipped_sum(), ours.values()))

    def opacus_ghost_step() -> None:
        opacus_clipped_sum()
        for p in fgc_model.net.parameters():
            noise = torch.normal(0.0, 1.0, size=p.shape, generator=generator)
            p.grad = (p.grad + noise) / float(args.batch_size)
        fgc_optimizer.step()

    steps["dp_opacus_ghost"] = opacus_ghost_step
    # Bayesian DP: the same DP-SGD step plus the budget filter and accounting of account_step
    # (add-remove: the clipped norms of the batch; replace-one: pairwise distances of 16 records
    # from the Gram matrix of their clipped gradients; per-order costs, UCB); a budget it never hits.
    for name, adjacency in (("bdp", "add-remove"), ("bdp_replace_one", "replace-one")):
        bdp_model, bdp_optimizer = fresh()
        account = partial(account_step, BayesianAccountant(adjacency=adjacency), sample_rate=0.1, noise_std=1.0,
                          total_steps=10**6, target_epsilon_mu=1e12, beta=1e-5)
        steps[name] = partial(
            dp_sgd_step, bdp_model, bdp_optimizer, xb, tb, eb, noise_multiplier=1.0, clip_norm=1.0,
            expected_batch_size=float(args.batch_size), generator=generator, backend=DEFAULT_BACKEND,
            on_step=account,
        )
    # Interleave the variants block by block so that load drift hits all of them alike.
    blocks: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(10):
            step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            blocks[name].append(_time_per_call(step, warmup=0, repeats=args.repeats, rounds=1)["mean_s"])
    modules["opacus"]._close()

    mean = {name: statistics.fmean(values) for name, values in blocks.items()}
    # Same-round ratios (each round's blocks run back to back), their median: robust to load drift.
    def round_ratio(top: str, bottom: str) -> float:
        return statistics.median(a / b for a, b in zip(blocks[top], blocks[bottom]))

    median = {name: statistics.median(values) for name, values in blocks.items()}
    result = {
        "model": f"hazard_mlp {args.features}->128->64->64->32->32->{cuts.size} SELU",
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "calls_per_variant": args.repeats * args.rounds,
        "plain_step_ms": 1e3 * mean["plain"],
        **{f"{name}_step_ms": 1e3 * mean[name] for name in steps if name != "plain"},
        "median_block_ms": {name: 1e3 * value for name, value in median.items()},
        "default_backend": DEFAULT_BACKEND,
        "ratio_dp_over_plain": mean[f"dp_{DEFAULT_BACKEND}"] / mean["plain"],
        **{f"ratio_{name}_over_plain": mean[name] / mean["plain"] for name in steps if name != "plain"},
        "median_round_ratio_dp_over_plain": round_ratio(f"dp_{DEFAULT_BACKEND}", "plain"),
        "median_round_ratio_bdp_over_dp": round_ratio("bdp", f"dp_{DEFAULT_BACKEND}"),
        "opacus_ghost_clipped_sum_max_abs_diff_vs_ours": opacus_ghost_max_abs_diff,
        "target_ratio": 1.4,
        "ratio_bdp_over_dp": mean["bdp"] / mean[f"dp_{DEFAULT_BACKEND}"],
        "ratio_bdp_replace_one_over_dp": mean["bdp_replace_one"] / mean[f"dp_{DEFAULT_BACKEND}"],
        "target_ratio_bdp_over_dp": 1.3,
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
