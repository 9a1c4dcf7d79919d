"""Benchmark: time per round and peak memory of a Flower simulation with 10, 100 and 1000 sites.

Each size runs the same FedAvg experiment (hazard MLP on the paper's simulated Cox data,
50,000 records split IID over the sites, so that even 1000 sites hold about 35 training records
each) through Flower's simulation engine, for ``--rounds`` rounds. Reported per size:

* ``round_s``: wall time of the rounds after the first (the first also pays Ray's start-up and
  the actors' imports, reported apart as ``first_round_s``);
* ``peak_rss_gb``: the largest resident memory of this process and all its descendants (Ray's
  raylet, GCS and workers) together, sampled every 0.2 s;
* the same-run reference ``inprocess_round_s`` (and its ``inprocess_peak_rss_gb``): one round of the same run
  with the same ServerApp and ClientApp over the in-process grid (:func:`simulations.engine.run_inprocess`:
  the same messages and work, no Ray; the sites one after the other in this process and, from 100 sites on, in
  one worker process per further CPU, ``inprocess_processes`` in all; half the difference between 3 rounds
  and 1, so the workers' start is not counted), so ``overhead_ratio = round_s / inprocess_round_s`` is what
  Ray costs a round against the default engine.
  (``benchmarks/flower_overhead.py`` measures the whole Flower path against a bare loop.)

Prints one JSON object. Targets: 1000 sites, one round of the default engine (``simulation.engine =
auto``: in process up to 1000 sites) ≤ 8 s and ≤ 3 GB on 2 cores.

Usage::

    python benchmarks/many_sites.py [--sites 10,100,1000] [--rounds 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import interrupt
from simulations.engine import run_inprocess, run_simulation  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402


class PeakMemory:
    """Largest summed RSS of this process and its descendants while the block runs (sampled)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        root = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for process in [root, *root.children(recursive=True)]:
                try:
                    total += process.memory_info().rss
                except psutil.Error:  # a process that ended between listing and reading
                    continue
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _wall_s(run, overrides: dict) -> tuple[float, list[float], dict]:
    """Wall time, the elapsed time at the end of every round (metrics.jsonl) and the summary of one run."""
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        summary = run({**overrides, "output.dir": out})
        wall_s = time.perf_counter() - started
        elapsed = [json.loads(line)["elapsed_s"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return wall_s, elapsed, summary


def measure(num_sites: int, rounds: int, extra: dict) -> dict:
    """One size: Flower round time and peak memory, and the in-process grid's round time."""
    overrides = {"data.name": "sim_cox", "federation.num_sites": num_sites, "federation.rounds": rounds,
                 "baseline.centralized": False, "evaluation.server_side": True, **extra}
    with PeakMemory() as memory:
        wall_s, elapsed, summary = _wall_s(functools.partial(run_simulation, engine="ray"), overrides)
    later = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    inprocess_s, inprocess_summary = {}, {}
    with PeakMemory() as inprocess_memory:
        for inprocess_rounds in (1, 3):  # the difference removes the set-up and the final evaluation
            inprocess_s[inprocess_rounds], _, inprocess_summary = _wall_s(
                run_inprocess, {**overrides, "federation.rounds": inprocess_rounds})
    inprocess_round_s = (inprocess_s[3] - inprocess_s[1]) / 2
    round_s = sum(later) / len(later) if later else elapsed[0]
    return {
        "sites": num_sites, "rounds": rounds, "wall_s": wall_s, "first_round_s": elapsed[0], "round_s": round_s,
        "peak_rss_gb": memory.peak_bytes / 2**30, "inprocess_round_s": inprocess_round_s,
        "inprocess_peak_rss_gb": inprocess_memory.peak_bytes / 2**30,
        "inprocess_processes": inprocess_summary["engine"]["processes"],
        "overhead_ratio": round_s / inprocess_round_s, "final_c_index": summary["test"].get("c_index"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="10,100,1000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="run-config key=value shared by every size")
    args = parser.parse_args(argv)
    extra = {key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}
    results = [measure(int(n), args.rounds, extra) for n in args.sites.split(",")]
    report = {"benchmark": "many_sites", "cpus": psutil.cpu_count(), "targets": {"sites": 1000, "round_s": 8,
                                                                              "peak_rss_gb": 3}, "sizes": results}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
