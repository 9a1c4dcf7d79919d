"""The one server program of every run, with what differs between run kinds plugged in.

:func:`run_program` reads top to bottom: write the release manifest, start (the set-up messages
the manifest covers, the run's console lines), train, evaluate and write the model, the optional
centralised baseline, the summary and the final console lines. What differs is a
:class:`RunKind`, set up with the sites before the program starts (refusing, with
:class:`flwr_app.config.ConfigError`, what cannot run, before any release the manifest does not
describe): :class:`flwr_app.horizontal_server.HorizontalRun` (rounds of FedAvg),
:class:`flwr_app.vertical_server.SplitRun` (split learning, one round trip per batch) and
:class:`flwr_app.private_split_server.PrivateSplitRun` (one cached release per record), and, after the
horizontal set-up, :class:`flwr_app.cox_server.CoxphRun` (Newton-Raphson on the sites' sums) and
:class:`flwr_app.cox_server.PrivateCoxphRun` (the private grouped-time Cox fit).

Also shared: how the server waits for the federation's sites (:func:`wait_for_sites`,
:func:`poll_replies_often`) and how an epoch of a split run ends (:func:`end_of_epoch`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from flwr.serverapp import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flwr_app import interrupt
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.outputs import RunOutputs
from strategies.mechanisms.base import Manifest

#: Seconds between the ServerApp's looks for replies in a simulation (Flower's in-memory grid waits 0.1 s).
SIMULATION_PULL_INTERVAL_S = 0.005


class RunKind(Protocol):
    """The parts of :func:`run_program` that differ between horizontal, split and private-split runs."""

    #: The console line printed before the centralised baseline is trained (``baseline.centralized``); empty for a
    #: kind that has none (a private Cox fit), whose :meth:`centralized` is then not called.
    baseline_notice: str

    def manifest(self) -> Manifest:
        """The run's release manifest (``manifest.json``): every value a site sends, covered by ε or not."""

    def start(self) -> list[str]:
        """Send what must precede training (the sites' configurations); return the run's opening console lines."""

    def train(self) -> None:
        """Train: per round or epoch, a ``metrics.jsonl`` line, the ledger entries and a console line."""

    def results(self) -> dict[str, Any]:
        """Evaluate the trained model, write it (and its plots); return the summary so far."""

    def centralized(self) -> dict[str, Any]:
        """The centralised baseline's figures (``summary["centralized"]``)."""

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        """The console lines on the written summary (before the ``outputs:`` line)."""


def run_program(kind: RunKind, cfg: ExperimentConfig, outputs: RunOutputs, *, started: float) -> dict[str, Any]:
    """Run ``kind`` from its manifest to its summary; return the summary (also written to ``summary.json``).

    ``summary["wall_time_s"]``: seconds from ``started`` to the written model, before the centralised
    baseline (a resumed run counts its resumed part only).
    """
    outputs.write_manifest(kind.manifest().as_dict())
    for line in kind.start():
        print(line, flush=True)
    kind.train()
    summary = kind.results()
    summary["wall_time_s"] = time.perf_counter() - started
    if cfg.centralized_baseline and kind.baseline_notice:
        print(kind.baseline_notice, flush=True)
        summary["centralized"] = kind.centralized()
    outputs.write_summary(summary)
    for line in kind.final_lines(summary):
        print(line, flush=True)
    print(f"outputs: {outputs.directory}", flush=True)
    return summary


def end_of_epoch(rounds: int, outputs: RunOutputs, line: Mapping[str, Any], console: str | None) -> None:
    """End an epoch of a split run of ``rounds`` epochs: append its ``metrics.jsonl`` ``line``, print ``console`` (if
    any), and stop the run there if an interrupt was requested (a split run cannot be resumed)."""
    outputs.append_metrics(line)
    if console is not None:
        print(console, flush=True)
    interrupt.raise_if_requested(line["round"], of=rounds, directory=outputs.directory,
                                 resumable=False, unit="epoch")


def poll_replies_often(grid: Grid) -> None:
    """In a simulation, look for the sites' replies every :data:`SIMULATION_PULL_INTERVAL_S` seconds per 25 sites.

    Flower's in-memory grid sleeps 0.1 s between looks, which adds about 50 ms to every message
    round trip: two per round of FedAvg, one per batch of split learning. A look checks every
    outstanding message in an in-memory store, so its cost grows with the number of sites: the
    interval grows with it (up to Flower's 0.1 s from 500 sites on), which keeps looking a small
    share of the work. Deployments (a gRPC grid to a real SuperLink) keep Flower's interval.
    """
    if isinstance(grid, InMemoryGrid):
        sites = len(list(grid.get_node_ids()))
        grid.pull_interval = min(0.1, SIMULATION_PULL_INTERVAL_S * max(1.0, sites / 25))


def wait_for_sites(grid: Grid, expected: int, *, simulated: bool, timeout_s: float = 300.0,
                   settle_s: float = 15.0) -> int:
    """Wait until ``expected`` sites are connected (or ``timeout_s`` passes); return how many are.

    Without this the first round samples whichever nodes happen to be registered when it starts
    (in simulation, Flower registers the virtual SuperNodes while the ServerApp is already
    running), and a site can silently miss round 1. A deployment starts with the sites connected
    by then. A simulation whose SuperNode count has stayed below ``expected`` for ``settle_s``
    seconds was started with too few (``flwr run`` with Flower's default of 2): it is refused at
    once, naming the option that fixes it.

    Raises
    ------
    ConfigError
        For a simulation with fewer virtual SuperNodes than sites.
    """
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while (connected := len(list(grid.get_node_ids()))) < expected and time.monotonic() < deadline:
        if connected != last:
            last, since = connected, time.monotonic()
        elif simulated and connected and time.monotonic() - since > settle_s:
            raise ConfigError(f"the simulation has {connected} SuperNode(s) but the federation has {expected} sites: "
                              f"run with flwr run . --federation-config \"num-supernodes={expected}\" (or set "
                              "federation.num_sites to the SuperNode count for an iid or dirichlet partition)")
        time.sleep(0.2)
    if connected < expected:
        print(f"warning: {connected} of {expected} sites connected after {timeout_s:.0f} s; starting with them",
              flush=True)
    return connected
