"""How distributed_dp's recipe was chosen: its clip norm and learning rate through the apps on validation splits.

``python -m benchmarks.distributed_recipe [--clips 1,5] [--lrs 0.02,0.05] [--data flchain,metabric,gbsg,whas]
[--epsilons 1,10] [--seeds 0] [--out rows.jsonl]``

The validation files are those of :mod:`benchmarks.setup_share` (each seed's training records of the default
federation, 80 % ``train`` and 20 % ``test``; the seed's test records are never read). Each (clip norm, learning
rate) runs ``distributed_dp`` at each ε for ``federation.rounds`` = 60 through the ServerApp and ClientApp
(SecAgg+, the private set-up, the recalibration) and is scored by Harrell's C, the IBS and the gap between mean
predicted and Kaplan-Meier survival at the median follow-up on the pooled validation parts. A setting's score is
its mean rank over data sets, ε, seeds and the three figures (the lowest wins). Prints one JSON line per run and
the ranking at the end.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.setup_share import ranking, validation_csv
from simulations.engine import run_inprocess
from simulations.results_file import append_jsonl


def run(name: str, path: Path, clip: float, lr: float, epsilon: float, seed: int, out: Path) -> dict:
    summary = run_inprocess({"data.name": "csv", "data.path": str(path), "data.split_col": "split",
                             "strategy.name": "distributed_dp", "privacy.epsilon": epsilon,
                             "privacy.clip_norm": clip, "train.lr": lr, "seed": seed,
                             "baseline.centralized": False, "output.dir": str(out)})
    return {"data": name, "setting": f"clip {clip:g}, lr {lr:g}", "epsilon": epsilon, "seed": seed,
            "c_index": summary["test"]["c_index"], "ibs": summary["test"]["ibs"],
            "gap": summary.get("calibration", {}).get("median_gap", float("nan")),
            "ledger_epsilon": summary["privacy"]["epsilon"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="1,5")
    parser.add_argument("--lrs", default="0.02,0.05")
    parser.add_argument("--data", default="flchain,metabric,gbsg,whas")
    parser.add_argument("--epsilons", default="1,10")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.data.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                path = validation_csv(name, seed, Path(folder))
                for epsilon in (float(e) for e in args.epsilons.split(",")):
                    for clip in (float(c) for c in args.clips.split(",")):
                        for lr in (float(r) for r in args.lrs.split(",")):
                            out = Path(folder) / f"run_{name}_{seed}_{epsilon:g}_{clip:g}_{lr:g}"
                            row = run(name, path, clip, lr, epsilon, seed, out)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                            if args.out:
                                append_jsonl(args.out, row)
    print(json.dumps({"ranking (mean rank, setting)": ranking(rows, "setting")}))


if __name__ == "__main__":
    main()
