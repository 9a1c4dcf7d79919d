"""Benchmark: a secure-aggregation round (strategy ``distributed_dp``) against a plain round, at 5, 40 and 200 sites.

Both runs use the same ServerApp and ClientApp over the in-process grid
(:func:`simulations.engine.run_inprocess`), the same data (FLCHAIN split IID over the sites), the same
hazard MLP and the same per-round evaluation; the set-up is exact in both (``privacy.setup_share =
0``: timing only). A round's time is ``(elapsed after the last round - elapsed after round 1) /
(rounds - 1)`` from ``metrics.jsonl``, so the set-up is not counted.

* ``plain_round_s``: a FedAvg round (each site one local epoch, weights sent in the clear);
* ``secure_round_s``: a ``distributed_dp`` round (each site one full-batch clipped, rounded, noised
  gradient sum, sent through the four SecAgg+ stages, unmasked, one server step);
* ``protocol_s``: the part of a secure round spent in the protocol itself (the four stages without the
  sites' gradient and noise computation);
* ``ratio = secure_round_s / plain_round_s`` (target: at most 2 at 40 sites).

The plain and the secure run are made ``--pairs`` times in turn (the same runs each time: only the machine's
timing differs); each figure is the median over the pairs, and ``pair_ratios`` lists every pair's ratio, so
the spread of a shared machine shows beside the median. The defaults (6 rounds, 5 pairs: five timed rounds
a run) replace 3 and 3, whose pairs on the same code spread from 1.6 to 2.7 at 40 sites. Prints one JSON object.

Usage::

    python benchmarks/secure_aggregation.py [--sites 5,40,200] [--rounds 6] [--pairs 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import interrupt
from simulations.engine import run_inprocess  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from strategies import secure_aggregation  # noqa: E402
from strategies.mechanisms.distributed_dp import DistributedDP  # noqa: E402


def _round_s(overrides: dict, rounds: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        run_inprocess({**overrides, "federation.rounds": rounds, "output.dir": f"{directory}/out"})
        lines = [json.loads(line) for line in Path(directory, "out", "metrics.jsonl").read_text().splitlines()]
    return (lines[-1]["elapsed_s"] - lines[0]["elapsed_s"]) / (rounds - 1)


class _Timed:
    """Adds up the wall time of the protocol runs and of the sites' contributions (the protocol's own share)."""

    def __init__(self) -> None:
        self.protocol_s = self.contribution_s = 0.0
        self.runs = 0

    def __enter__(self) -> _Timed:
        self._run, self._contribution = secure_aggregation.SecureSum.run, DistributedDP.contribution
        timer = self

        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return timer._run(self, *args, **kwargs)
            finally:
                timer.protocol_s += time.perf_counter() - start
                timer.runs += 1

        def contribution(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return timer._contribution(self, *args, **kwargs)
            finally:
                timer.contribution_s += time.perf_counter() - start

        secure_aggregation.SecureSum.run, DistributedDP.contribution = run, contribution
        return self

    def __exit__(self, *exc: object) -> None:
        secure_aggregation.SecureSum.run, DistributedDP.contribution = self._run, self._contribution


def measure(num_sites: int, rounds: int, extra: dict, pairs: int) -> dict:
    """The medians over ``pairs`` plain and secure runs made in turn, and each pair's ratio."""
    common = {"data.name": "flchain", "federation.num_sites": num_sites, "baseline.centralized": False,
              "privacy.setup_share": 0.0, **extra}
    plain, secure, protocol = [], [], []
    for _ in range(pairs):
        plain.append(_round_s({**common, "strategy.name": "fedavg"}, rounds))
        with _Timed() as timed:
            secure.append(_round_s({**common, "strategy.name": "distributed_dp", "privacy.epsilon": 1.0}, rounds))
        protocol.append((timed.protocol_s - timed.contribution_s) / max(1, timed.runs))
    ratios = [s / p for s, p in zip(secure, plain, strict=True)]
    return {"sites": num_sites, "plain_round_s": round(statistics.median(plain), 3),
            "secure_round_s": round(statistics.median(secure), 3), "protocol_s": round(statistics.median(protocol), 3),
            "ratio": round(statistics.median(ratios), 2), "pair_ratios": [round(ratio, 2) for ratio in ratios]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="5,40,200", help="comma-separated numbers of sites")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (>= 2; the first is not timed)")
    parser.add_argument("--pairs", type=int, default=5, help="plain and secure runs made in turn (>= 1)")
    parser.add_argument("overrides", nargs="*", help="run-config key=value")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    extra = dict(item.split("=", 1) for item in args.overrides)
    extra = {key: parse_value(value) for key, value in extra.items()}
    results = {"benchmark": "secure_aggregation", "data": "flchain", "target_ratio_at_40_sites": 2.0,
               "rounds": args.rounds, "pairs": args.pairs,
               "runs": [measure(int(n), args.rounds, extra, args.pairs) for n in args.sites.split(",")]}
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
