"""Benchmark: the utility cost of covering the set-up releases in a federated dp_sgd run.

The same federation (default: FLCHAIN, 5 IID sites, 20 rounds, the default hazard model) runs
``dp_sgd`` twice per (ε, seed): with the exact set-up (``privacy.setup_share=0``: record counts,
standardisation and time grid computed from the sites' data without noise, not covered by ε) and
with the private set-up (``privacy.setup_share`` = the default: those values are Gaussian releases
composed in every site's accountant, so DP-SGD gets what is left of the same ε). Both spend the same
target ε; the runs go through the ServerApp and ClientApp over the in-process grid
(:func:`simulations.engine.run_inprocess`). Prints one JSON object: per ε and set-up, the test
C-index and IBS of the global model on the pooled test split (mean ± std over seeds), the worst
site's ledger ε and DP-SGD noise multiplier.

Usage::

    python benchmarks/setup_cost.py [--epsilons 1,10] [--seeds 0,1,2] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import interrupt
from simulations.engine import resolve, run_inprocess  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from strategies.accounting.ledger import PrivacyLedger  # noqa: E402


def _summary(values: list[float]) -> list[float]:
    return [round(statistics.fmean(values), 4), round(statistics.stdev(values), 4) if len(values) > 1 else 0.0]


def _run(overrides: dict[str, Any]) -> dict[str, float]:
    """One run: the pooled test C-index and IBS, and the worst site's ledger ε and noise multiplier."""
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON only
        summary = run_inprocess({**overrides, "output.dir": out})
        worst = PrivacyLedger.read(Path(out) / "ledger.jsonl").worst()
    test = {key: math.nan if summary["test"].get(key) is None else summary["test"][key]  # null: NaN, diverged
            for key in ("c_index", "ibs")}
    return {**test, "epsilon": worst.epsilon, "noise_multiplier": worst.noise_multiplier}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", default="1,10")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("overrides", nargs="*", help="run-config key=value")
    args = parser.parse_args(argv)
    base = {"strategy.name": "dp_sgd", "baseline.centralized": False}
    base.update({key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)})
    default_share = resolve({})[1].privacy.setup_share
    result: dict = {"overrides": base, "setup_share": default_share, "metric": "pooled test split, mean ± std"}
    for epsilon in (float(e) for e in args.epsilons.split(",")):
        for label, share in (("exact set-up (not covered)", 0.0), ("private set-up (covered)", default_share)):
            runs = [_run({**base, "privacy.epsilon": epsilon, "privacy.setup_share": share, "seed": int(seed)})
                    for seed in args.seeds.split(",")]
            result[f"epsilon {epsilon:g}, {label}"] = {
                "c_index": _summary([run["c_index"] for run in runs]),
                "ibs": _summary([run["ibs"] for run in runs]),
                "ledger_epsilon": max(run["epsilon"] for run in runs),
                "noise_multiplier": _summary([run["noise_multiplier"] for run in runs]),
            }
            print(json.dumps({key: value for key, value in result.items() if key.startswith("epsilon")}), flush=True,
                  file=sys.stderr)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
