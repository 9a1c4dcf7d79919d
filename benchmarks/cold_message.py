"""What a deployed site pays per message: a ClientApp message handled in a new process, against a warm one.

In a deployment Flower's SuperNode starts a new ``flwr-clientapp`` process for every message (its
default subprocess isolation): the process imports the ClientApp and whatever the message needs,
handles one message and exits. This benchmark replays that part without the transport:

1. An in-process run (:func:`simulations.engine.run_inprocess`, FLCHAIN as a CSV file, as a site
   reads its own, 3 sites, 2 rounds) records the round-2 ``train`` message of site-1 with the node
   state the site held before it.
2. ``--replay`` processes (a new Python each, as Flower starts them) import the ClientApp, handle
   that message (cold) and then the same message again (warm: everything imported and memoised).
   Each prints its phases; the cold minus warm handling is what the process start costs a message,
   and the modules the cold handling imported say where it went.

Usage::

    python -m benchmarks.cold_message [--strategy dp_sgd] [--epsilon 1] [--repeats 3] [--out file.json]

The figures leave out Flower's own share of a deployed round trip (its process start, its polling
and the SuperLink's transport); ``docs/deployment.md`` gives those.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "opacus", "dp_accounting", "torch._dynamo", "scipy", "sksurv", "pandas", "flwr")


def record_message(strategy: str, epsilon: float, path: Path) -> None:
    """Run 2 rounds in process and pickle site-1's round-2 train message with its node state before it."""
    from simulations import engine

    captured: dict = {}
    deliver = engine.InProcessGrid._deliver

    def capture(grid, message):  # noqa: ANN001, ANN202
        stored = grid.contexts[message.metadata.dst_node_id]
        if (message.metadata.message_type == "train" and not captured
                and message.content["config"]["server-round"] == 2):
            captured["message"], captured["context"] = pickle.dumps(message), pickle.dumps(stored)
        return deliver(grid, message)

    engine.InProcessGrid._deliver = capture
    try:
        with tempfile.TemporaryDirectory() as out:
            from models.data.datasets import _sksurv_flchain

            data = path.with_name("flchain.csv")
            _sksurv_flchain().to_csv(data, index=False)
            engine.run_inprocess({"data.name": "csv", "data.path": str(data), "data.time_col": "futime",
                                  "data.event_col": "death", "strategy.name": strategy, "privacy.epsilon": epsilon,
                                  "federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False,
                                  "output.dir": str(Path(out) / "run")})
    finally:
        engine.InProcessGrid._deliver = deliver
    path.write_bytes(pickle.dumps(captured))


def replay(path: Path) -> dict:
    """In this (new) process: import the ClientApp, handle the recorded message cold, then warm."""
    start = time.perf_counter()
    from flwr_app.client_app import app

    imported = time.perf_counter()
    before = {name for name in HEAVY if name in sys.modules}
    captured = pickle.loads(path.read_bytes())
    timings = []
    for _ in range(2):
        message, context = pickle.loads(captured["message"]), pickle.loads(captured["context"])
        began = time.perf_counter()
        reply = app(message, context)
        timings.append(time.perf_counter() - began)
        if reply.has_error():
            raise RuntimeError(f"the replayed message failed: {reply.error.reason}")
    return {"import_s": imported - start, "cold_s": timings[0], "warm_s": timings[1],
            "imported_by_the_message": sorted({name for name in HEAVY if name in sys.modules} - before)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="dp_sgd")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--replay", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replay:
        print(json.dumps(replay(Path(args.replay))))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "message.pkl"
        record_message(args.strategy, args.epsilon, path)
        runs = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "benchmarks.cold_message", "--replay", str(path)],
                                  capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
            runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - began})
    median = {key: statistics.median(run[key] for run in runs) for key in ("process_s", "import_s", "cold_s", "warm_s")}
    # A flwr-clientapp process handles one message: its whole cost is the replay process less the warm repeat.
    result = {"strategy": args.strategy, "epsilon": args.epsilon, "runs": runs, "median": median,
              "message_in_a_new_process_s": median["process_s"] - median["warm_s"],
              "warm_message_s": median["warm_s"],
              "new_process_overhead_s": median["process_s"] - 2 * median["warm_s"]}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
