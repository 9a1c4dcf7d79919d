"""Benchmark: hostile sites that attack the model update, not just its weights, under each aggregator.

The real ServerApp and ClientApp run in process (FLCHAIN, ``--sites`` IID sites, 3 rounds). A site's update is
Δ = w − g: its reply's weights w minus the global model g that the message it answers carried. Between the sites
and the server, the attackers' training replies are replaced (:func:`tampered_training`) as an attacker who reads
the code would make them, seeing every reply of the round (an omniscient coalition):

* ``sign_flip_x5``: site-1 sends g − 5Δ; ``scale_1e6``: site-1 sends g + 1e6·Δ;
* ``collude_x3``: the coalition (:func:`coalition_size`: 1 of 3, 2 of 5, 3 of 10 sites, site-1 on) each send
  g − 3·m, m the mean of the honest sites' updates;
* ``adaptive_inside``: the coalition each send g − λ·m, λ placing them at 0.98 × ``federation.update_bound``
  × the median distance from the coordinate-wise median of all updates, exactly as the default aggregator's
  centred clipping measures it (:func:`strategies.horizontal.centred_clip`): just inside what it bounds, so never
  clipped nor flagged; the same update under the robust aggregators. ``adaptive_spread15``: the same at 15 ×;
* ``little_is_enough``: the coalition each send g + μ − z·σ, μ and σ the honest updates' coordinate-wise mean and
  standard deviation, z from the federation's size (Baruch et al. 2019, :func:`alie_z`): inside the honest spread
  in every coordinate; ``inner_product``: the coalition each send g − 0.5·m (Xie et al. 2020, inner-product
  manipulation at ε = 0.5: small, against the honest direction);
* ``free_rider``: site-1 sends g unchanged;
* ``label_flip``: site-1 trains honestly on its records with the events inverted and the times reversed. This
  one attacks the data, so it runs as a deployment (``data.name = site_files``, one FLCHAIN file per site, IID by
  the seed) in which site-1 reads a corrupted file; its C is the mean of the honest sites' own test C (the server
  holds no pooled test split there) and its reference is the clean run on the same files (``clean_site_files``).
* ``count_x99``: site-1 trains on its file repeated 99 times, so that every count it releases at the (exact) set-up,
  and the count it is agreed, is 99 times its own, and it sends g − Δ (its update negated): a deployment like
  ``label_flip``, its C the honest sites' own, against ``clean_site_files``.
  Every other attack runs on the simulated FLCHAIN partition, its C the global model's on the pooled test split.

The weight-level and protocol modes of the earlier benchmark stay available by name (not run by default):
``weights_x1e3``, ``weights_x1e6``, ``weights_x-5`` (site-1's weights times a factor), ``stale`` (its round-1
update sent again), ``duplicate`` (its reply sent twice), ``relabelled`` (its reply labelled as node 1).

``federation.aggregation`` takes ``fedavg`` (with centred clipping at the default ``update_bound``), ``median``,
``trimmed_mean`` (``trim_fraction`` 0.2, or 0.34 below 5 sites, where 0.2 trims nothing) and ``krum``
(``max_malicious`` the coalition's size where 2f + 3 sites allow it, else the most they allow). For each
(sites, aggregation, seed) the clean run is the reference. A row a run: whether it finished, which sites it named
(a failure, a flag, or a rolled-back round's cause), the attackers, the final C. Rows are appended to ``--out``
as runs end, and cells already there are skipped (resumable). The table: attack × aggregation, the mean ± std
over seeds of C − clean C, attackers named, runs that named an honest site::

    python -m benchmarks.hostile_matrix --sites 5 --aggregations fedavg,median --seeds 0 \\
        --out docs/results/benchmarks/hostile_updates.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from flwr.app import Array, ArrayRecord, Message

from flwr_app import interrupt
from simulations import engine
from simulations.results_file import append_jsonl
from strategies.config import DEFAULT_UPDATE_BOUND
from strategies.horizontal import centred_clip

HOSTILE_NODE, HOSTILE_SITE = 2, "site-1"
RUN = {"federation.rounds": 3, "baseline.centralized": False}
#: ``--data`` -> the run-config keys of the federation (FLCHAIN's sites are IID, ``--sites`` of them).
DATA: dict[str, dict[str, Any]] = {"flchain": {}, "sba_regions": {"data.name": "sba", "federation.partition": "region"}}
#: Where the adaptive coalition stands, as a share of the bound it keeps inside.
INSIDE = 0.98
CLEAN, CLEAN_FILES, LABEL_FLIP, COUNT_X99 = "clean", "clean_site_files", "label_flip", "count_x99"
#: Attacks that run as a deployment on one file per site (their reference: :data:`CLEAN_FILES`).
DEPLOYED = (LABEL_FLIP, COUNT_X99)
#: How many copies of its file the count-inflating site trains on.
COPIES = 99

#: A tamper function: (the round's training replies, the global model each answered message carried by message
#: ID, memory kept over the run) -> the replies the server gets.
Tamper = Callable[[list[Message], dict[str, ArrayRecord], dict], list[Message]]


def coalition_size(sites: int) -> int:
    """Colluding sites among ``sites``: 30 % rounded, at least 1, and a minority (1 of 3, 2 of 5, 3 of 10)."""
    return max(1, min((sites - 1) // 2, int(0.3 * sites + 0.5)))


def attacker_nodes(attack: str, sites: int) -> list[int]:
    """The attackers' node IDs (node i + 1 is site-i): the coalition for a colluding attack, else site-1's node."""
    if attack in (CLEAN, CLEAN_FILES):
        return []
    size = coalition_size(sites) if attack in COLLUDING else 1
    return list(range(HOSTILE_NODE, HOSTILE_NODE + size))


def as_vector(record: ArrayRecord) -> np.ndarray:
    """The arrays of ``record`` flattened in its key order into one float64 vector (as the server stacks them)."""
    return np.concatenate([array.numpy().astype(np.float64).ravel() for array in record.values()])


def as_record(vector: np.ndarray, like: ArrayRecord) -> ArrayRecord:
    """``vector`` cut back into the arrays of ``like`` (same keys, shapes and dtypes)."""
    arrays, start = {}, 0
    for key, array in like.items():
        template = array.numpy()
        arrays[key] = Array(vector[start:start + template.size].reshape(template.shape).astype(template.dtype))
        start += template.size
    return ArrayRecord(arrays)


def _updates(replies: list[Message], sent: dict[str, ArrayRecord]) -> dict[int, tuple[Message, np.ndarray, np.ndarray]]:
    """Each well-formed training reply by node: the reply, the global model g it answers, its update w − g."""
    found = {}
    for reply in replies:
        if reply.has_error() or "arrays" not in reply.content:
            continue
        base = as_vector(sent[reply.metadata.reply_to_message_id])
        found[reply.metadata.src_node_id] = (reply, base, as_vector(reply.content["arrays"]) - base)
    return found


def _sign_flipped(scale: float, nodes: Sequence[int]) -> Tamper:
    """The attackers each send g + ``scale`` × their own update."""
    def tamper(replies: list[Message], sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        for node, (reply, base, update) in _updates(replies, sent).items():
            if node in nodes:
                reply.content["arrays"] = as_record(base + scale * update, reply.content["arrays"])
        return replies
    return tamper


def _free_rider(nodes: Sequence[int]) -> Tamper:
    """The attackers send back exactly the global model they were sent."""
    def tamper(replies: list[Message], sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        for reply in replies:
            if reply.metadata.src_node_id in nodes and not reply.has_error():
                reply.content["arrays"] = ArrayRecord({key: Array(array.numpy().copy()) for key, array
                                                       in sent[reply.metadata.reply_to_message_id].items()})
        return replies
    return tamper


def _honest_mean(updates: dict[int, tuple[Message, np.ndarray, np.ndarray]], nodes: Sequence[int]) -> np.ndarray:
    return np.mean([update for node, (_, _, update) in updates.items() if node not in nodes], axis=0)


def _colluding(scale: float, nodes: Sequence[int]) -> Tamper:
    """The coalition each send g − ``scale`` × the mean of the honest sites' updates."""
    def tamper(replies: list[Message], sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        updates = _updates(replies, sent)
        mean = _honest_mean(updates, nodes)
        for node, (reply, base, _update) in updates.items():
            if node in nodes:
                reply.content["arrays"] = as_record(base - scale * mean, reply.content["arrays"])
        return replies
    return tamper


def spread_of(honest: np.ndarray, placed: np.ndarray, copies: int) -> float:
    """The spread that :func:`~strategies.horizontal.centred_clip` gives ``copies`` identical rows ``placed`` among the
    rows ``honest`` (their distance from the coordinate-wise median of all rows over the median distance)."""
    rows = np.vstack([honest, np.tile(placed, (copies, 1))])
    return float(centred_clip(rows, np.full(len(rows), 1.0 / len(rows)), DEFAULT_UPDATE_BOUND)[2][-1])


def placement(honest: np.ndarray, base: np.ndarray, direction: np.ndarray, copies: int, target: float) -> float:
    """λ at which ``copies`` rows ``base + λ·direction`` stand at spread ``target`` among ``honest`` (bisection
    between a λ below the target, 0 or else −1, and one above it, found by doubling)."""
    def gap(scale: float) -> float:
        return spread_of(honest, base + scale * direction, copies) - target

    low = 0.0 if gap(0.0) < 0 else -1.0
    if gap(low) >= 0:
        raise ValueError(f"even at the honest mean the coalition stands beyond spread {target:g}")
    high = 1.0
    for _ in range(64):
        if gap(high) > 0:
            break
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if middle in (low, high):
            break
        low, high = (middle, high) if gap(middle) < 0 else (low, middle)
    return low


def _adaptive(target: float, nodes: Sequence[int]) -> Tamper:
    """The coalition each send g − λ·m (m the honest sites' mean update), λ placing them at spread ``target``."""
    def tamper(replies: list[Message], sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        updates = _updates(replies, sent)
        coalition = [node for node in updates if node in nodes]
        if not coalition:
            return replies
        honest = np.array([base + update for node, (_, base, update) in updates.items() if node not in nodes])
        base = updates[coalition[0]][1]
        mean = _honest_mean(updates, nodes)
        scale = placement(honest, base, -mean, len(coalition), target)
        for node in coalition:
            reply = updates[node][0]
            reply.content["arrays"] = as_record(base - scale * mean, reply.content["arrays"])
        return replies
    return tamper


def alie_z(sites: int, colluders: int) -> float:
    """Baruch, Baruch & Goldberg (NeurIPS 2019, "A little is enough"): the coalition stands ``z`` honest standard
    deviations from the mean in every coordinate, ``z = Φ⁻¹((n − s) / n)`` with ``s = ⌊n / 2⌋ + 1 − f`` the honest
    sites it needs on its side to pass as the majority."""
    from scipy.stats import norm

    needed = sites // 2 + 1 - colluders
    return float(norm.ppf((sites - needed) / sites))


def _little_is_enough(nodes: Sequence[int]) -> Tamper:
    """The coalition each send g + μ − z·σ (μ, σ: the honest updates' coordinate-wise mean and standard deviation,
    z :func:`alie_z`): inside the honest spread in every coordinate, against the direction of the mean."""
    def tamper(replies: list[Message], sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        updates = _updates(replies, sent)
        honest = np.array([update for node, (_, _, update) in updates.items() if node not in nodes])
        coalition = [node for node in updates if node in nodes]
        if not coalition or len(honest) < 2:
            return replies
        shift = honest.mean(axis=0) - alie_z(len(updates), len(coalition)) * honest.std(axis=0, ddof=1)
        for node in coalition:
            reply, base, _update = updates[node]
            reply.content["arrays"] = as_record(base + shift, reply.content["arrays"])
        return replies
    return tamper


def _scaled_weights(factor: float, nodes: Sequence[int]) -> Tamper:
    def tamper(replies: list[Message], _sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        for reply in replies:
            if reply.metadata.src_node_id in nodes and not reply.has_error():
                reply.content["arrays"] = ArrayRecord({key: Array(array.numpy() * factor)
                                                       for key, array in reply.content["arrays"].items()})
        return replies
    return tamper


def _stale(nodes: Sequence[int]) -> Tamper:
    def tamper(replies: list[Message], _sent: dict[str, ArrayRecord], memory: dict) -> list[Message]:
        for reply in replies:
            if reply.metadata.src_node_id in nodes and not reply.has_error():
                reply.content["arrays"] = memory.setdefault("arrays", reply.content["arrays"])
        return replies
    return tamper


def _duplicate(nodes: Sequence[int]) -> Tamper:
    def tamper(replies: list[Message], _sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        return replies + [reply for reply in replies if reply.metadata.src_node_id in nodes]
    return tamper


def _relabelled(nodes: Sequence[int]) -> Tamper:
    def tamper(replies: list[Message], _sent: dict[str, ArrayRecord], _: dict) -> list[Message]:
        for reply in replies:
            if reply.metadata.src_node_id in nodes:
                reply.metadata.__dict__["_src_node_id"] = 1
        return replies
    return tamper


#: Attack name -> a factory of its tamper function given the attackers' nodes and the run's ``update_bound``
#: (``label_flip``: none, the data).
ATTACKS: dict[str, Callable[[Sequence[int], float], Tamper] | None] = {
    "sign_flip_x5": lambda nodes, _bound: _sign_flipped(-5.0, nodes),
    "scale_1e6": lambda nodes, _bound: _sign_flipped(1e6, nodes),
    "collude_x3": lambda nodes, _bound: _colluding(3.0, nodes),
    "adaptive_inside": lambda nodes, bound: _adaptive(INSIDE * bound, nodes),
    "adaptive_spread15": lambda nodes, _bound: _adaptive(15.0, nodes),
    "little_is_enough": lambda nodes, _bound: _little_is_enough(nodes),
    "inner_product": lambda nodes, _bound: _colluding(0.5, nodes),
    "free_rider": lambda nodes, _bound: _free_rider(nodes),
    LABEL_FLIP: None,
    COUNT_X99: lambda nodes, _bound: _sign_flipped(-1.0, nodes),
}
LEGACY: dict[str, Callable[[Sequence[int], float], Tamper]] = {
    "weights_x1e3": lambda nodes, _bound: _scaled_weights(1e3, nodes),
    "weights_x1e6": lambda nodes, _bound: _scaled_weights(1e6, nodes),
    "weights_x-5": lambda nodes, _bound: _scaled_weights(-5.0, nodes),
    "stale": lambda nodes, _bound: _stale(nodes), "duplicate": lambda nodes, _bound: _duplicate(nodes),
    "relabelled": lambda nodes, _bound: _relabelled(nodes),
}
COLLUDING = ("collude_x3", "adaptive_inside", "adaptive_spread15", "little_is_enough", "inner_product")


def make_tamper(attack: str, sites: int, *, bound: float = DEFAULT_UPDATE_BOUND) -> Tamper | None:
    """The tamper function of ``attack`` in a federation of ``sites`` whose ``federation.update_bound`` is ``bound``
    (None for the clean runs and ``label_flip``)."""
    factory = {**ATTACKS, **LEGACY}.get(attack)
    return None if factory is None else factory(attacker_nodes(attack, sites), bound)


def _same_model(one: ArrayRecord, other: ArrayRecord) -> bool:
    return one.keys() == other.keys() and all(np.array_equal(one[key].numpy(), other[key].numpy()) for key in one)


@contextlib.contextmanager
def tampered_training(tamper: Tamper | None) -> Iterator[dict[str, int]]:
    """While open, the in-process grid passes every round's training replies through ``tamper`` with the global
    model each answered message carried (None: untouched). Yields a count, filled as the run goes, of the rounds
    followed by an evaluation (``rounds``) and of those whose training left the global model bit for bit as it was
    (``unmoved``: the model the evaluation was sent is the one the round's training was sent)."""
    original = engine.InProcessGrid.send_and_receive
    memory: dict[str, Any] = {}
    counts = {"rounds": 0, "unmoved": 0}
    trained: list[ArrayRecord] = []

    def send_and_receive(grid, messages, *, timeout=None):
        messages = list(messages)
        replies = list(original(grid, messages, timeout=timeout))  # the grid gives each message its ID
        kind = messages[0].metadata.message_type if messages else ""
        if kind == "train":
            trained[:] = [messages[0].content["arrays"]]
            if tamper is not None:
                replies = tamper(replies, {message.metadata.message_id: message.content["arrays"]
                                           for message in messages}, memory)
        elif kind == "evaluate" and trained and "arrays" in messages[0].content:
            counts["rounds"] += 1
            counts["unmoved"] += _same_model(trained.pop(), messages[0].content["arrays"])
        return replies

    engine.InProcessGrid.send_and_receive = send_and_receive
    try:
        yield counts
    finally:
        engine.InProcessGrid.send_and_receive = original


def flipped_labels(frame, time_col: str = "futime", event_col: str = "death"):
    """``frame`` with its events inverted (1 − event) and its times reversed (min + max − time)."""
    times = frame[time_col]
    return frame.assign(**{time_col: times.min() + times.max() - times, event_col: 1 - frame[event_col]})


def site_files(folder: Path, sites: int, seed: int, *, flipped: int | None = None,
               inflated: int | None = None, source: pd.DataFrame | None = None) -> list[dict[str, Any]]:
    """Node configs of a deployment of FLCHAIN (or of ``source``'s records, with FLCHAIN's columns ``futime`` and
    ``death``: a validation file) cut IID (by ``seed``) into ``sites`` files, site ``flipped``'s with
    :func:`flipped_labels`, site ``inflated``'s its records repeated :data:`COPIES` times (every count it
    releases at the set-up, and so its agreed count, is then x99, consistently). Each site keys its train/test split from a key derived from the seed and its index, so
    the honest sites hold the same test parts in every run of that seed."""
    from models.data.datasets import load_flchain

    if source is None:
        table = load_flchain()
        source = table.features.assign(futime=table.time, death=table.event)
    frame = source
    configs, folder = [], folder / f"files-{sites}-{seed}"
    for index, rows in enumerate(np.array_split(np.random.default_rng(seed).permutation(len(frame)), sites)):
        part = frame.iloc[rows].reset_index(drop=True)
        home = folder / f"site-{index}"
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = home / {flipped: "flipped.csv", inflated: "inflated.csv"}.get(index, "records.csv")
        if index == flipped:
            part = flipped_labels(part)
        if index == inflated:
            part = pd.concat([part] * COPIES, ignore_index=True)
        part.to_csv(path, index=False)
        key = home / "site.key"
        if not key.exists():
            key.write_bytes(hashlib.sha256(f"hostile-matrix/{sites}/{seed}/{index}".encode()).digest())
            key.chmod(0o600)
        configs.append({"data-path": str(path), "site-name": f"site-{index}", "site-dir": str(home)})
    return configs


def naming(directory: Path) -> dict[str, list[str]]:
    """Every site a run named, with how: ``failure:<phase>``, ``flag:<phase>``, or ``rollback`` (the cause of a
    rolled-back round)."""
    named: dict[str, set[str]] = {}
    for text in (directory / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        for kind in ("failures", "flags"):
            for entry in line[kind]:
                named.setdefault(entry["site"], set()).add(f"{kind[:-1]}:{entry.get('phase', '?')}")
        for site in line.get("rolled_back", {}).get("sites", []):
            named.setdefault(site, set()).add("rollback")
    return {site: sorted(ways) for site, ways in sorted(named.items())}


def named_sites(directory: Path) -> set[str]:
    """Every site a run named: in a failure, a flag, or as the cause of a rolled-back round."""
    return set(naming(directory))


def aggregation_keys(aggregation: str, sites: int) -> dict[str, Any]:
    """The run config of ``aggregation`` for ``sites`` sites (trim fraction or tolerated sites where it needs them)."""
    keys: dict[str, Any] = {"federation.aggregation": aggregation}
    if aggregation == "trimmed_mean":
        keys["federation.trim_fraction"] = 0.2 if sites >= 5 else 0.34
    if aggregation == "krum":
        keys["federation.max_malicious"] = min(coalition_size(sites), (sites - 3) // 2)
    return keys


def site_name(config: dict[str, Any], node: int) -> str:
    """The name of the site at ``node`` (node i + 1 is the federation's i-th site): ``site-<i>`` for IID sites and
    site files, the partition's value (a region) for a natural partition."""
    if "federation.partition" not in config or config.get("data.name") == "site_files":
        return f"site-{node - 1}"
    from flwr_app import task

    return task.load_federation(engine.resolve(config)[1]).sites[node - 1].name


def run_cell(sites: int, aggregation: str, seed: int, attack: str, folder: Path, *,
             rounds: int = RUN["federation.rounds"], overrides: dict[str, Any] | None = None,
             source: pd.DataFrame | None = None) -> dict[str, Any]:
    """One run of ``attack`` (or a clean reference) over ``rounds`` rounds, with run-config ``overrides`` (a data
    file, a bound): finished, who was named, the attackers, the final C."""
    out = folder / f"{sites}-{aggregation}-{seed}-{attack}-{rounds}"
    overrides = overrides or {}
    size = {} if "federation.partition" in overrides else {"federation.num_sites": sites}
    config = {**RUN, **aggregation_keys(aggregation, sites), **size, "seed": seed, "federation.rounds": rounds,
              "output.dir": str(out), **overrides}
    attackers = [site_name(config, node) for node in attacker_nodes(attack, sites)]
    bound = float(config.get("federation.update_bound", DEFAULT_UPDATE_BOUND))
    row: dict[str, Any] = {"sites": sites, "aggregation": aggregation, "seed": seed, "attack": attack,
                           "attackers": attackers, "rounds": rounds,
                           "data": next((name for name, keys in DATA.items() if keys and keys.items() <= overrides.items()),
                                        "flchain")}
    node_configs = None
    if attack in DEPLOYED or attack == CLEAN_FILES:
        config.update({"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                       "data.categorical_cols": "flc.grp", "evaluation.server_side": False})
        node_configs = site_files(folder, sites, seed, flipped=1 if attack == LABEL_FLIP else None,
                                  inflated=1 if attack == COUNT_X99 else None, source=source)
    started = time.perf_counter()
    try:
        with tampered_training(make_tamper(attack, sites, bound=bound)) as counts:
            summary = engine.run_inprocess(config, node_configs=node_configs)
    except interrupt.StopRequested:
        raise
    except Exception as err:  # noqa: BLE001 - a run the attack stopped is a result here
        named = naming(out) if (out / "metrics.jsonl").exists() else {}
        return {**row, "finished": False, "error": f"{type(err).__name__}: {err}"[:300], "named": sorted(named),
                "named_for": named, **counts, "wall_s": time.perf_counter() - started}
    row.update({"finished": True, "named": sorted(naming(out)), "named_for": naming(out), **counts})
    if node_configs is None:
        c_index, source = summary["test"]["c_index"], "global model on the pooled test split"
    else:
        honest = [metrics["c_index"] for site, metrics in summary["sites"].items() if site != HOSTILE_SITE]
        c_index, source = float(np.mean(honest)), "mean of the honest sites' own test C (site-1 left out)"
    return {**row, "c_index": c_index, "c_source": source, "wall_s": time.perf_counter() - started}


def reference(attack: str) -> str:
    """The clean run ``attack`` is measured against."""
    return CLEAN_FILES if attack in DEPLOYED else CLEAN


def _cell(runs: list[dict[str, Any]], clean: dict[int, float]) -> str:
    """``ΔC mean ± std · attackers named / attackers (how) · runs naming an honest site / runs`` of one attack and
    aggregation, then the stopped runs and the rounds that left the global model unmoved, where there are any."""
    if not runs:
        return "not run"
    finished = [row for row in runs if row["finished"]]
    deltas = [row["c_index"] - clean[row["seed"]] for row in finished if row["seed"] in clean]
    attackers = sum(len(row["attackers"]) for row in runs)
    named = sum(len(set(row["attackers"]) & set(row["named"])) for row in runs)
    ways = sorted({way for row in runs for site in row["attackers"] for way in row.get("named_for", {}).get(site, [])})
    honest = sum(any(site not in row["attackers"] for site in row["named"]) for row in runs)
    unmoved, rounds = sum(row.get("unmoved", 0) for row in runs), sum(row.get("rounds", 0) for row in runs)
    if not deltas:
        figure = "–"
    elif len(deltas) == 1:
        figure = f"{deltas[0]:+.3f}"
    else:
        figure = f"{statistics.mean(deltas):+.3f} ± {statistics.stdev(deltas):.3f}"
    stopped = f" · stopped {len(runs) - len(finished)}/{len(runs)}" if len(finished) < len(runs) else ""
    frozen = f" · unmoved {unmoved}/{rounds} rounds" if unmoved else ""
    how = f" ({', '.join(ways)})" if ways else ""
    return f"{figure} · {named}/{attackers}{how} · {honest}/{len(runs)}{stopped}{frozen}"


def _clean_cell(runs: list[dict[str, Any]]) -> str:
    """``C mean ± std · – · runs naming a site`` of a clean reference."""
    if not runs:
        return "not run"
    values = [row["c_index"] for row in runs if row["finished"]]
    figure = f"C {statistics.mean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "") \
        if values else "–"
    stopped = f" · stopped {len(runs) - len(values)}/{len(runs)}" if len(values) < len(runs) else ""
    return f"{figure} · – · {sum(bool(row['named']) for row in runs)}/{len(runs)}{stopped}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown, one line per (sites, attack), one column per aggregation: the mean ± std over seeds of C − the clean
    C of the same (sites, aggregation, seed), attackers named / attackers, runs that named an honest site / runs."""
    aggregations = list(dict.fromkeys(row["aggregation"] for row in rows))
    lines = ["| sites | attack | " + " | ".join(aggregations) + " |", "| --- | --- |" + " --- |" * len(aggregations)]
    for sites in sorted({row["sites"] for row in rows}):
        attacks = list(dict.fromkeys(row["attack"] for row in rows if row["sites"] == sites))
        for attack in sorted(attacks, key=lambda name: (name not in (CLEAN, CLEAN_FILES), name != CLEAN)):
            cells = []
            for aggregation in aggregations:
                runs = [row for row in rows if (row["sites"], row["aggregation"], row["attack"])
                        == (sites, aggregation, attack)]
                if attack in (CLEAN, CLEAN_FILES):
                    cells.append(_clean_cell(runs))
                    continue
                clean = {row["seed"]: row["c_index"] for row in rows if row["finished"] and (
                    row["sites"], row["aggregation"], row["attack"]) == (sites, aggregation, reference(attack))}
                cells.append(_cell(runs, clean))
            lines.append(f"| {sites} | {attack} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="3,5,10", help="federation sizes, comma-separated")
    parser.add_argument("--aggregations", default="fedavg,median,trimmed_mean,krum")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help=f"comma-separated, of {', '.join([*ATTACKS, *LEGACY])}")
    parser.add_argument("--data", choices=tuple(DATA), default="flchain",
                        help="flchain: --sites IID sites; sba_regions: SBA's 4 census regions (--sites 4)")
    parser.add_argument("--rounds", type=int, default=RUN["federation.rounds"], help="rounds a run")
    parser.add_argument("--out", type=Path, default=None, help="append the rows here (JSON lines; cells there skip)")
    args = parser.parse_args(argv)
    attacks = _names(args.attacks)
    unknown = [name for name in attacks if name not in ATTACKS and name not in LEGACY]
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}")
    references = [CLEAN] + ([CLEAN_FILES] if set(DEPLOYED) & set(attacks) else [])
    rows = [json.loads(line) for line in args.out.read_text(encoding="utf-8").splitlines()] \
        if args.out and args.out.exists() else []
    rows = [row for row in rows if row.get("rounds", RUN["federation.rounds"]) == args.rounds
            and row.get("data", "flchain") == args.data]
    done = {(row["sites"], row["aggregation"], row["seed"], row["attack"]) for row in rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    wanted = [(int(sites), aggregation, int(seed), attack) for sites in _names(args.sites)
              for aggregation in _names(args.aggregations) for seed in _names(args.seeds)
              for attack in references + attacks]
    with tempfile.TemporaryDirectory() as folder:
        for cell in wanted:
            if cell in done:
                continue
            rows.append(run_cell(*cell, Path(folder), rounds=args.rounds, overrides=DATA[args.data]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.out:
                append_jsonl(args.out, rows[-1])
    keys = set(wanted)
    print(table([row for row in rows if (row["sites"], row["aggregation"], row["seed"], row["attack"]) in keys]))
    return 0


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
