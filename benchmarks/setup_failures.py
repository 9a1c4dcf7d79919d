"""Benchmark: how often the private set-up fails or falls back, over data sets, budgets, federations and seeds.

For every bundled horizontal data set, named (``data.name=metabric``) and as the same table in a
CSV file (``data.name=csv``), under ``dp_sgd`` and ``distributed_dp`` at each ``--epsilons``, with
``--sites`` IID sites and seeds ``0 … --seeds - 1``, it runs the federation's set-up as a
simulation does (:func:`flwr_app.task.federation_setup`: both passes of noisy releases at every
site, agreed at the server; ``distributed_dp``'s through its secure sum, with ``privacy.max_dropouts = 0`` for 2
sites) and counts the runs whose set-up stops (an error) and the ranges it
settled by a fallback (scan, or a column left out). The small-federation rows do the same for
``--small-sites`` sites (24; 0: none) sharing 900 records of WHAS and of GBSG (about 30 training records a site, as
``tests/test_small_federations.py`` builds them), with no data dictionary and with the follow-up (``time.max``)
alone public; ``dp_sgd`` at ``privacy.setup_sum = auto`` (:meth:`strategies.mechanisms.dp_sgd.DPSGD.setup_sum`; each
row says what it resolved to). ``--degraded`` does the same for each data set with half of the values of two numeric
columns missing at random and one log-normal heavy-tailed column added (``dp_sgd``, the first ε). Training cannot
change the set-up, so none is run.

Prints one JSON object (``--out`` also writes it)::

    python -m benchmarks.setup_failures [--data flchain,metabric,...] [--epsilons 1,10] [--sites 2,5,10]
        [--small-sites 24] [--seeds 10] [--degraded] [--out docs/results/benchmarks/setup_failures.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from flwr_app.task import federation_setup
from models.data import load_table
from models.data.files import resolve_data_dir
from simulations.engine import resolve
from strategies.mechanisms.dp_sgd import DPSGD

DATA = ("flchain", "metabric", "gbsg", "whas", "sba", "sim_cox")
MECHANISMS = ("dp_sgd", "distributed_dp")
#: The small federations' data sets, their records and their public follow-up (``time.max``), as the tests build them.
SMALL_FOLLOW_UP = {"whas": 2400.0, "gbsg": 90.0}
SMALL_RECORDS = 900


def table_csv(name: str, folder: Path, *, degrade: bool = False, seed: int = 0) -> Path:
    """The named data set's table (features, ``time``, ``event``) as a CSV file; ``degrade``: half of two
    numeric columns missing at random and a log-normal column ``heavy`` (sigma 2) added."""
    table = load_table(name, data_dir=str(resolve_data_dir("")))
    frame = table.features.copy()
    if degrade:
        rng = np.random.default_rng(seed)
        numeric = [c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c].dtype)][:2]
        for column in numeric:
            frame[column] = frame[column].astype("float64").mask(rng.random(len(frame)) < 0.5)
        frame["heavy"] = rng.lognormal(0.0, 2.0, len(frame))
    frame["time"], frame["event"] = table.time, table.event.astype(int)
    path = folder / f"{name}{'_degraded' if degrade else ''}.csv"
    frame.to_csv(path, index=False)
    return path


def small_sources(folder: Path) -> dict[str, dict]:
    """The small federations' sources: ``"<data>, no dictionary"`` and ``"<data>, time.max"`` -> their run-config
    overrides (``SMALL_RECORDS`` records of the bundled CSV, ``random_state = 0``)."""
    sources = {}
    for name, follow_up in SMALL_FOLLOW_UP.items():
        frame = pd.read_csv(resolve_data_dir("") / f"{name}.csv").drop(columns="split")
        path = folder / f"{name}_small.csv"
        frame.sample(n=SMALL_RECORDS, random_state=0).to_csv(path, index=False)
        dictionary = folder / f"{name}_small_time.json"
        dictionary.write_text(json.dumps({"time": {"max": follow_up}}))
        data = {"data.name": "csv", "data.path": str(path), "data.time_col": "duration", "data.event_col": "event"}
        sources[f"{name}, no dictionary"] = data
        sources[f"{name}, time.max"] = {**data, "data.dictionary": str(dictionary)}
    return sources


def small_rows(sources: dict[str, dict], epsilons: list[float], sites: int, seeds: int) -> list[dict]:
    """One row per small source, mechanism and ε: the set-up outcomes of ``sites`` sites over ``seeds`` seeds, and
    (``dp_sgd``) what ``privacy.setup_sum = auto`` resolved to."""
    rows = []
    for source, data in sources.items():
        for mechanism in MECHANISMS:
            for epsilon in epsilons:
                overrides = {**data, "strategy.name": mechanism, "privacy.epsilon": epsilon,
                             "federation.num_sites": sites}
                summed = (DPSGD().setup_sum(resolve(overrides)[1]) if mechanism == "dp_sgd" else "secure")
                rows.append({"data": source.split(",")[0], "source": f"{SMALL_RECORDS} records, {source}",
                             "strategy": mechanism, "epsilon": epsilon, "sites": sites, "setup_sum": summed,
                             **count(overrides, seeds)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def secure_sum_options(mechanism: str, sites: int) -> dict:
    """``distributed_dp`` with 2 sites: no tolerated drop-out (the config refuses one: SecAgg+ of 2 sites cannot
    survive a drop-out without unmasking); otherwise the defaults."""
    return {"privacy.max_dropouts": 0} if mechanism == "distributed_dp" and sites == 2 else {}


def count(overrides: dict, seeds: int) -> dict:
    """Set-up outcomes over seeds: failures (with their first message), fallbacks by kind."""
    failures, fallbacks, first_error = 0, collections.Counter(), ""
    for seed in range(seeds):
        try:
            settled = federation_setup(resolve({**overrides, "seed": seed})[1]).fallbacks
        except Exception as err:  # noqa: BLE001 - every failure is what is counted
            failures += 1
            first_error = first_error or f"{type(err).__name__}: {err}"[:300]
            continue
        fallbacks.update(settled.values())
    return {"runs": seeds, "failures": failures, "fallbacks": dict(fallbacks), "first_error": first_error}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=",".join(DATA))
    parser.add_argument("--epsilons", default="1,10")
    parser.add_argument("--sites", default="2,5,10")
    parser.add_argument("--small-sites", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--degraded", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    started, rows = time.time(), []
    epsilons = [float(e) for e in args.epsilons.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.data.split(","):
            sources = {"named": {"data.name": name},
                       "csv": {"data.name": "csv", "data.path": str(table_csv(name, Path(folder)))}}
            if args.degraded:
                sources = {"degraded csv": {"data.name": "csv",
                                            "data.path": str(table_csv(name, Path(folder), degrade=True))}}
            for source, data in sources.items():
                for mechanism in MECHANISMS[:1] if args.degraded else MECHANISMS:
                    for epsilon in epsilons[:1] if args.degraded else epsilons:
                        for sites in (int(k) for k in args.sites.split(",")):
                            overrides = {**data, "strategy.name": mechanism, "privacy.epsilon": epsilon,
                                         "federation.num_sites": sites, **secure_sum_options(mechanism, sites)}
                            row = {"data": name, "source": source, "strategy": mechanism, "epsilon": epsilon,
                                   "sites": sites, **count(overrides, args.seeds)}
                            rows.append(row)
                            print(json.dumps(row), file=sys.stderr, flush=True)
        small = ([] if args.degraded or not args.small_sites else
                 small_rows(small_sources(Path(folder)), epsilons, args.small_sites, args.seeds))
    rows += small
    result = {"rows": rows, "failures": sum(r["failures"] for r in rows), "runs": sum(r["runs"] for r in rows),
              "small_failures": {m: sum(r["failures"] for r in small if r["strategy"] == m) for m in MECHANISMS},
              "seconds": round(time.time() - started, 1)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return result


if __name__ == "__main__":
    main()
