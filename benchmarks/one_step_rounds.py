"""Many short rounds: a 1000-round run in which every site takes ONE local step per round, through Flower and bare.

A round of one DP-SGD step per site is what a distributed-DP round over secure aggregation needs
(each round's sum is one step on the union), and it is where Flower's per-round cost weighs most:
the local work is one full-batch step, so the messages, the checks of every reply, the ledger,
the metrics line and the checkpoint of each round are the bulk of the time. The run is dp_sgd with
``train.batch_size`` at least every site's size and ``train.local_epochs = 1`` (sampling rate
``q = 1``: one step per round, which the script checks in the ledger), evaluated at the sites
every round.

The Flower path is :func:`simulations.engine.run_inprocess` (the real ServerApp and ClientApp over
the in-process grid, no Ray); the reference is the bare loop of the same maths
(:func:`benchmarks.flower_overhead.bare_federation`: same data, model, seeds, site steps and
weighted mean, no messages, checks, ledger or outputs). The script prints one JSON object: seconds
per round of both (whole run / rounds, set-up included; and Flower's rounds after the first, from
``metrics.jsonl``), their ratio and the final C-index of both (equal up to summation order). Both paths
run once for two rounds first, so that neither pays the first-use costs (data loading, torch's
kernels) in the timed run.

Usage::

    python benchmarks/one_step_rounds.py [--rounds 1000] [--sites 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.flower_overhead import bare_federation  # noqa: E402
from flwr_app import interrupt, task  # noqa: E402
from simulations.engine import resolve, run_inprocess  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402

#: A batch no site reaches: with local_epochs = 1, every site takes one full-batch step per round.
WHOLE_SITE_BATCH = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="run-config overrides key=value")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (a round after the first is timed)")
    overrides: dict = {
        "strategy.name": "dp_sgd",
        "privacy.epsilon": 10.0,
        "federation.rounds": args.rounds,
        "federation.num_sites": args.sites,
        "train.local_epochs": 1,
        "train.batch_size": WHOLE_SITE_BATCH,
        "evaluation.server_side": False,
        "baseline.centralized": False,
    }
    overrides.update({key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)})
    torch.set_num_threads(1)
    _, cfg = resolve(overrides)
    largest = max(setup.count for setup in task.federation_setup(cfg).setups.values())
    if cfg.train.local_epochs != 1 or cfg.train.batch_size < largest:
        raise SystemExit(f"one step per round needs train.local_epochs = 1 and train.batch_size >= {largest:g} "
                         f"(the largest site), got {cfg.train.local_epochs} and {cfg.train.batch_size}")

    # warm-up: both paths once for two rounds (first-use costs: data loading, torch's kernels, imports)
    _, short = resolve({**overrides, "federation.rounds": 2})
    bare_federation(short)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        run_inprocess({**overrides, "federation.rounds": 2, "output.dir": out})

    started = time.perf_counter()
    bare = bare_federation(cfg)
    bare_s = time.perf_counter() - started

    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # a line per round
            summary = run_inprocess({**overrides, "output.dir": out})
        flower_s = time.perf_counter() - started
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        ledger = [json.loads(line) for line in (Path(out) / "ledger.jsonl").read_text().splitlines()]
    elapsed = [line["elapsed_s"] for line in lines]
    tenth = max(len(elapsed) // 10, 1)
    steps = {entry["steps"] for entry in ledger if entry["round"] == args.rounds}
    if cfg.strategy == "dp_sgd" and steps != {args.rounds}:
        raise SystemExit(f"expected one DP-SGD step per site and round ({args.rounds} in all), the ledger says {steps}")

    print(json.dumps({
        "benchmark": "one_step_rounds",
        "rounds": args.rounds,
        "sites": args.sites,
        "overrides": overrides,
        "steps_per_site": sorted(steps) if cfg.strategy == "dp_sgd" else None,
        "bare_loop_s_per_round": round(bare_s / args.rounds, 5),
        "flower_s_per_round": round(flower_s / args.rounds, 5),
        "ratio_flower_over_bare": round(flower_s / bare_s, 3),
        "flower_s_per_round_after_the_first": round((elapsed[-1] - elapsed[0]) / max(len(elapsed) - 1, 1), 5),
        # a round's cost grows with the rounds before it where something is O(rounds) per round (e.g. the checkpoint)
        "flower_s_per_round_first_tenth": round((elapsed[tenth] - elapsed[0]) / tenth, 5),
        "flower_s_per_round_last_tenth": round((elapsed[-1] - elapsed[-1 - tenth]) / tenth, 5),
        "bare_loop_wall_s": round(bare_s, 2),
        "flower_wall_s": round(flower_s, 2),
        "epsilon": summary["privacy"]["epsilon"],
        "bare_sites_mean_c_index": bare["c_index"],
        "flower_sites_mean_c_index": summary["test"].get("c_index"),
    }, indent=2))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
