"""A horizontal federation's server (FedAvg over the sites): set-up, rounds, outputs.

:func:`run_horizontal` reads top to bottom: agree the set-up with the sites, build the strategy,
name the sites, then run the server program (:func:`flwr_app.server_program.run_program`) with
:class:`HorizontalRun` plugged in, or, for ``model.name = "coxph"``, the Cox fit's run kind
(:func:`flwr_app.cox_server.cox_run`). Message handling and bookkeeping only; the aggregation is
:class:`strategies.horizontal.SurvivalFedAvg`, the model and metrics come from ``flwr_app.task``.

In simulation the server also holds the pooled test split of the embedded data set, so it
evaluates the global model on it after each round (``evaluation.server_side``) and can train the
centralised baseline (``baseline.centralized``). Per-site figures always come from the sites
themselves (federated evaluation on each site's own test part). In a deployment
(``data.name = "site_files"``) the server holds no records: it agrees the preprocessing and the time
grid with the sites first (:func:`flwr_app.deployment.prepare_sites`), and the run's test figures
are the sites' own. With ``data.test_fraction = 0`` no site holds out a test part: the sites train on
every record, no evaluate message is sent (the Breslow baseline and recalibration still are) and the
run reports no test figure (``summary["test"] = {}``, ``test_source`` saying why).

Fault tolerance: a site that fails or does not answer in a round is recorded in that round's
``failures`` and the round goes on with the others, down to ``federation.min_sites`` (see
:meth:`strategies.horizontal.SurvivalFedAvg.run_rounds`). After every round the server writes
``checkpoint.pt`` (the global model, the strategy's records, with every site's privacy states, and
the configuration); ``resume.from`` continues a stopped run from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from flwr_app import deployment, interrupt, task
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.cox_server import CoxSetup, cox_run
from flwr_app.outputs import RunOutputs, load_checkpoint
from flwr_app.server_program import run_program, wait_for_sites
from models.data import FederatedDataset
from models.metrics import km_null_check, km_null_warning
from models.plots import plot_survival_vs_km
from models.survival import SurvivalModel
from strategies.accounting.ledger import LedgerEntry, PrivacyLedger
from strategies.config import COXPH
from strategies.horizontal import (NO_TEST_PART, RoundRecord, SurvivalFedAvg, TooFewSitesError, holds_test_part,
                                   make_aggregator, privacy_position, robust_refusal, site_average, site_metrics,
                                   weighted_nanmean)
from strategies.mechanisms.base import HorizontalMechanism, Manifest, delta_refusal
from strategies.mechanisms.registry import horizontal_mechanism
from strategies.model_choice import ModelChoice
from strategies.server_optimizers import make_server_optimizer

CHECKPOINT_FORMAT = 1


class RunStopped(RuntimeError):
    """``debug.stop_after_round`` stopped the run (a simulated crash of the server)."""


def run_horizontal(cfg: ExperimentConfig, grid: Grid, outputs: RunOutputs, *, started: float) -> None:
    """A horizontal federation: set-up, ``federation.rounds`` rounds with every reply checked, outputs."""
    mechanism = horizontal_mechanism(cfg.strategy)
    agreed = _deployed_setup(cfg, grid, mechanism) if cfg.data.deployed else _simulated_setup(cfg, grid, mechanism)
    counts = {name: setup.count for name, setup in agreed.setups.items()}
    choice = task.model_choice(cfg, counts, len(agreed.spec.preprocessor.feature_names))  # the widths the model took
    # delta against the protected population, before any training release (in a deployment each site has refused
    # a delta above 1/its own count before its set-up release; here the agreed counts, and distributed_dp's union)
    if refusal := delta_refusal(cfg, mechanism, counts):
        raise ConfigError(refusal)
    survival = _survival_fedavg(cfg, mechanism, agreed)
    grid, left_out = _name_sites(cfg.federation.timeout_s, grid, survival, agreed)
    if cfg.model.name == COXPH:  # Newton-Raphson on the sites' sums instead of FedAvg rounds (flwr_app.cox_server)
        kind = cox_run(cfg, outputs, grid, survival, CoxSetup(agreed.model, agreed.dataset, agreed.spec, left_out,
                                                              agreed.notes), started)
    else:
        kind = HorizontalRun(cfg, outputs, Federation(mechanism, agreed, survival, grid, left_out, choice), started)
    run_program(kind, cfg, outputs, started=started)


@dataclass
class _Agreed:
    """What the set-up agreed with the sites: the pooled data (a simulation's only), the model, every site's agreed
    set-up (its record count), the preprocessing and time grid (``spec``), the set-up's console notes and the
    columns it left out, the recalibration aggregates, and, in a deployment, its sites (node ID -> name), the nodes
    it left out (node ID -> why) and :func:`flwr_app.deployment.prepare_sites`' result."""

    dataset: FederatedDataset | None
    model: SurvivalModel
    setups: Mapping[str, Any]
    spec: task.SiteSpec
    notes: tuple[str, ...]
    dropped: tuple[str, ...]
    recalibration: Any
    node_sites: dict[int, str]
    left_out: dict[int, str]
    deployed: deployment.SiteSetup | None = None


def _deployed_setup(cfg: ExperimentConfig, grid: Grid, mechanism: HorizontalMechanism) -> _Agreed:
    """A deployment's set-up: the sites agree the preprocessing and time grid (:func:`deployment.prepare_sites`)."""
    _check_aggregation(cfg, mechanism, cfg.federation.num_sites)  # before the set-up releases anything
    wait_for_sites(grid, cfg.federation.num_sites, simulated=False)
    setup = deployment.prepare_sites(grid, cfg)
    return _Agreed(None, task.model_from_spec(cfg, setup.spec), setup.setups, setup.spec, setup.notes,
                   setup.left_out_columns, setup.recalibration, dict(setup.sites), setup.left_out, setup)


def _simulated_setup(cfg: ExperimentConfig, grid: Grid, mechanism: HorizontalMechanism) -> _Agreed:
    """A simulation's set-up, from the embedded data set's partition (:func:`task.federation_setup`)."""
    dataset = task.load_federation(cfg)
    _check_aggregation(cfg, mechanism, dataset.num_sites)
    agreed = task.federation_setup(cfg)
    model = task.build_model(cfg, dataset)
    spec = task.run_spec(cfg, dataset)
    wait_for_sites(grid, dataset.num_sites, simulated=True)
    return _Agreed(dataset, model, agreed.setups, spec, agreed.notes, agreed.left_out, agreed.recalibration, {}, {})


def _survival_fedavg(cfg: ExperimentConfig, mechanism: HorizontalMechanism, agreed: _Agreed) -> SurvivalFedAvg:
    """The strategy: FedAvg over the agreed sites with the configured aggregator and server optimiser."""
    num_sites, model = len(agreed.setups), agreed.model
    fedavg_kwargs: dict[str, Any] = dict(
        fraction_train=cfg.federation.fraction_train, fraction_evaluate=1.0,
        min_train_nodes=mechanism.min_train_sites(cfg, num_sites=num_sites),
        min_evaluate_nodes=cfg.federation.min_sites, min_available_nodes=cfg.federation.min_sites,
    )
    survival = SurvivalFedAvg(
        mechanism=mechanism, cfg=cfg, setups=agreed.setups,
        needs_baseline=model.needs_baseline, grid_size=len(model.cuts), timeout=cfg.federation.timeout_s,
        aggregator=make_aggregator(cfg.federation.aggregation, trim_fraction=cfg.federation.trim_fraction,
                                   malicious=cfg.federation.max_malicious, weighted_by_key="num-examples",
                                   sites=_sites_per_round(cfg, mechanism, num_sites),
                                   **fedavg_kwargs),
        server_optimizer=make_server_optimizer(cfg.federation),
        **fedavg_kwargs,
    )
    if agreed.recalibration is not None:
        survival.recalibration = (agreed.recalibration, np.asarray(model.cuts, dtype=np.float64))
    return survival


def _name_sites(timeout_s: float, grid: Grid, survival: SurvivalFedAvg,
                agreed: _Agreed) -> tuple[Grid, dict[int, str]]:
    """Tell ``survival`` which node is which site; return the grid that reaches the sites taking part only (in a
    deployment, waiting ``timeout_s`` (``federation.timeout_s``) for a rejoining site), and the nodes left out (node
    ID -> why). In a simulation every node says once which site it is, and a node that
    cannot is left out (too few named: the run stops before any further message)."""
    left_out = agreed.left_out
    if agreed.node_sites:
        survival.node_sites = agreed.node_sites
    else:
        left_out = survival.identify_sites(grid)
        survival.require_named(left_out)
    if agreed.deployed is not None:  # the sites left out get no further message; a restarted site gets the set-up
        grid = deployment.RejoiningSites(grid, agreed.deployed, survival.node_sites, timeout=timeout_s,
                                         history=lambda site: privacy_position(survival.rounds, site))
    elif left_out:
        grid = deployment.ParticipatingSites(grid, survival.node_sites)  # the sites left out get no further message
    return grid, left_out


@dataclass
class Federation:
    """A horizontal federation ready to train: its mechanism, set-up, strategy, the grid to the sites taking part,
    the nodes left out (node ID -> why) and what ``model.name = "auto"`` chose."""

    mechanism: HorizontalMechanism
    agreed: _Agreed
    survival: SurvivalFedAvg
    grid: Grid
    left_out: dict[int, str]
    choice: ModelChoice | None


class HorizontalRun:
    """A horizontal run as a :class:`flwr_app.server_program.RunKind`: ``federation.rounds`` rounds of
    :class:`strategies.horizontal.SurvivalFedAvg` (from ``resume.from``'s checkpoint, if set), a metrics line, the
    ledger entries and a checkpoint after each; the global model evaluated, saved and calibrated. Constructing it
    wraps the strategy (the mechanism's outer strategy) and, with ``resume.from``, loads the checkpoint and cuts the
    outputs back to it."""

    baseline_notice = "training the centralised baseline on the pooled training data ..."

    def __init__(self, cfg: ExperimentConfig, outputs: RunOutputs, federation: Federation, started: float) -> None:
        self.cfg, self.outputs, self.fed, self.started = cfg, outputs, federation, started
        self.survival, self.model, self.setups = federation.survival, federation.agreed.model, federation.agreed.setups
        self.strategy: Strategy = federation.mechanism.wrap_strategy(self.survival, cfg, num_sites=len(self.setups))
        self.resumed = _resume(cfg, outputs, self.survival) if cfg.resume_from else None
        self.ledger = self.resumed.ledger if self.resumed else PrivacyLedger(outputs.ledger_path)

    def manifest(self) -> Manifest:
        return self.fed.mechanism.manifest(self.cfg)

    def start(self) -> list[str]:
        cfg, fed = self.cfg, self.fed
        sites = len(self.survival.node_sites)
        description = (f"{sites} sites' own files" if cfg.data.deployed else
                       f"{sites} sites, partition '{cfg.federation.partition}'")
        description += f", {len(fed.left_out)} left out" if fed.left_out else ""
        if cfg.federation.server_optimizer != "fedavg":
            description += f", server optimiser {cfg.federation.server_optimizer}"
        lines = [f"fedsurv: {cfg.strategy} | {cfg.data.name} ({description}) | {cfg.model.name} | "
                 f"{cfg.federation.rounds} rounds -> {self.outputs.directory}"]
        lines += [fed.choice.line()] if fed.choice is not None else []
        lines += list(fed.agreed.notes)
        lines += [] if holds_test_part(cfg.data) else [f"test figures: {NO_TEST_PART}"]
        return lines

    def train(self) -> None:
        resumed, outputs = self.resumed, self.outputs
        try:
            self.arrays = self.survival.run_rounds(
                self.fed.grid, arrays=resumed.arrays if resumed else ArrayRecord(self.model.net.state_dict()),
                first_round=resumed.last_round + 1 if resumed else 1, last_round=self.cfg.federation.rounds,
                end_of_round=self._end_of_round, outer=self.strategy, resumed=resumed is not None,
                stopping=lambda: interrupt.requested() is not None,
            )
        except TooFewSitesError as err:
            raise TooFewSitesError(f"{err}. The outputs up to this round and its checkpoint are in "
                                   f"{outputs.directory}; once the sites are back, continue with resume.from = "
                                   f"'{outputs.directory}'") from err

    def _end_of_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Record the round (ledger, metrics line, checkpoint), print its line; stop if asked to."""
        cfg, outputs = self.cfg, self.outputs
        record = self.survival.rounds.get(server_round)
        self.ledger.record(*self._ledger_entries(server_round, record))
        line = self._metrics_line(server_round, arrays, record)
        outputs.append_metrics(line)
        outputs.save_checkpoint({
            "format": CHECKPOINT_FORMAT, "round": server_round, "config": json.dumps(run_identity(cfg)),
            "arrays": arrays.to_torch_state_dict(), "strategy": self.survival.state_dict(),
        })
        print(self._round_line(server_round, line, record), flush=True)
        if server_round == cfg.debug.stop_after_round:
            raise RunStopped(f"debug.stop_after_round = {server_round}: the run stops after round {server_round} "
                             f"(a simulated crash of the server); continue it with resume.from = "
                             f"'{outputs.directory}'")
        interrupt.raise_if_requested(server_round, of=cfg.federation.rounds, directory=outputs.directory)

    def _ledger_entries(self, server_round: int, record: RoundRecord | None) -> list[LedgerEntry]:
        """The round's ledger entry of every site it released (a site with no accepted reply counts as released)."""
        cfg, notes = self.cfg, self.fed.agreed.notes
        released = record.released if record else {}
        entries = []
        for site in sorted(released):
            entry = self.fed.mechanism.ledger_entry(cfg, server_round, site, setup=self.setups[site],
                                                    reports=self.survival.site_reports(site, server_round))
            entry = dataclasses.replace(entry, assumptions=entry.assumptions + notes)
            if released[site] is None:
                entry = dataclasses.replace(entry, assumptions=entry.assumptions + (
                    f"round {server_round}: no accepted reply from this site (refused, or none within "
                    "federation.timeout_s: it may have sent its update late); the round counts as released",))
            entries.append(entry)
        return entries

    def _metrics_line(self, server_round: int, arrays: ArrayRecord, record: RoundRecord | None) -> dict[str, Any]:
        """The round's ``metrics.jsonl`` line (the global model evaluated on the pooled test split where the server
        holds it and the round is evaluated)."""
        survival = self.survival
        global_test: dict[str, float] = {}
        diverged = ""
        if self.cfg.server_evaluation and survival.evaluates(server_round):
            global_test, diverged = _evaluate_global(self.model, arrays, survival.baseline, self.fed.agreed.dataset,
                                                     survival.exponents)
        line: dict[str, Any] = {
            "round": server_round,
            "train": weighted_nanmean({site: {**report, "num-examples": self.setups[site].count}
                                       for site, report in (record.train_sites.items() if record else ())
                                       if "train_loss" in report}),
            "privacy": self.ledger.headline(),
            "global_test": global_test,
            "sites_mean": weighted_nanmean(record.evaluate_sites) if record else {},
            "sites_average": site_average(record.evaluate_sites) if record else {},
            "sites": site_metrics(record) if record else {},
            "sites_kept_local": sorted(record.evaluate_local) if record else [],
            "failures": record.failures if record else [],
            "flags": _flags(record) if record else [],
            "update_spread": dict(sorted(record.update_spread.items())) if record else {},
            "discarded": dict(sorted(record.discarded.items())) if record else {},
            "elapsed_s": time.perf_counter() - self.started,
        }
        if diverged:
            line["diverged"] = diverged
        if record and record.rolled_back:
            line["rolled_back"] = record.rolled_back
        if record and record.shortfall:
            line["not_aggregated"] = record.shortfall
        return line

    def _round_line(self, server_round: int, line: Mapping[str, Any], record: RoundRecord | None) -> str:
        """The round's console line."""
        cfg, global_test, diverged = self.cfg, line["global_test"], line.get("diverged", "")
        shown = global_test or line["sites_mean"]
        train_loss = line["train"].get("train_loss")
        return (
            f"round {server_round:3d}/{cfg.federation.rounds}"
            + (f"  train_loss {train_loss:.4f}" if train_loss is not None and math.isfinite(train_loss) else "")
            + ("" if not holds_test_part(cfg.data) else
               f"  {'test' if global_test else 'sites'}: {_fmt(shown)}" if self.survival.evaluates(server_round)
               else f"  (not evaluated: evaluation.every = {cfg.evaluation_every})")
            + (f"  epsilon {line['privacy']['epsilon']:.3f}" if line["privacy"]["epsilon"] is not None else "")
            + (f"  [{len(line['failures'])} failed: "
               + ", ".join(sorted({f"{f['site']} ({f['phase']})" for f in line["failures"]})) + "]"
               if line["failures"] else "")
            + (f"  [{len(line['flags'])} flagged: " + ", ".join(f"{f['site']} ({f['phase']})" for f in line["flags"])
               + "]"
               if line["flags"] else "")
            + (f"  [test metrics kept at the site: {', '.join(line['sites_kept_local'])}]"
               if line["sites_kept_local"] else "")
            + (f"  [{diverged}]" if diverged else "")
            + (f"  [{_rollback_text(record.rolled_back)}]" if record and record.rolled_back else "")
        )

    def results(self) -> dict[str, Any]:
        """Evaluate the final global model, save it (``model.pt``, ``preprocessing.json``) and, with the pooled data
        of a simulation, its calibration and plot.

        In a deployment ``evaluation.server_side`` and ``baseline.centralized`` are off (checked by
        :func:`flwr_app.config.parse_run_config`): the test figures are the sites' own.
        """
        cfg, survival, model, dataset = self.cfg, self.survival, self.model, self.fed.agreed.dataset
        last = survival.rounds.get(cfg.federation.rounds)
        self.sites = dict(sorted(last.evaluate_sites.items())) if last else {}
        diverged = ""
        if cfg.server_evaluation:
            test, diverged = _evaluate_global(model, self.arrays, survival.baseline, dataset, survival.exponents)
        else:
            test = weighted_nanmean(self.sites)
        summary = self._summary(last, test)
        diverged = diverged or _load_final(model, self.arrays, survival.baseline, survival.exponents)
        if diverged:
            summary["diverged"] = diverged
        model.net.eval()
        spec = self.fed.agreed.spec
        self.outputs.save_model(model.net.state_dict(), model=cfg.model.name,
                                config=task.spec_config(cfg, spec).as_dict(), baseline=survival.baseline,
                                preprocessing=task.preprocessing(cfg, spec),
                                exponents=None if survival.exponents is None else survival.exponents.tolist())
        if cfg.server_evaluation and not diverged and holds_test_part(cfg.data):
            summary["calibration"] = task.calibration(model, dataset)
            summary["km_null"] = km_null_check(summary["test"].get("ibs", math.nan),
                                               summary["calibration"]["ibs_km_null"])
            plot_survival_vs_km(model, dataset, self.outputs.plot_path, title=f"{cfg.strategy} on {cfg.data.name}",
                                time_unit=cfg.data.time_unit)
        return summary

    def _summary(self, last: RoundRecord | None, test: Mapping[str, float]) -> dict[str, Any]:
        """The summary's figures (``test``: the final test metrics, ``oot_`` keys on the out-of-time part) and its
        account of the run.

        ``summary["data"]["features"]`` names the agreed preprocessing's input columns and model inputs;
        ``summary["setup"]``, with a private set-up: the columns it left out of the model (no range stood out of its
        noise) and its notes on the fallbacks; ``summary["model_choice"]``: what ``model.name = "auto"`` chose (the
        model is saved with the architecture it was trained with, which :func:`models.predict.load_run` rebuilds);
        ``summary["left_out"]``: the deployed sites left out at set-up.
        """
        cfg, fed, sites = self.cfg, self.fed, self.sites
        source = ("global model on the pooled test split (server-side, simulation)" if cfg.server_evaluation
                  else "weighted mean of the sites' own test metrics")
        preprocessor = fed.agreed.spec.preprocessor
        summary: dict[str, Any] = {
            "test": {key: value for key, value in test.items() if not key.startswith("oot_")},
            "test_source": source if holds_test_part(cfg.data) else NO_TEST_PART,
            "sites": site_metrics(last) if last else {},
            "sites_mean": weighted_nanmean(sites),
            "sites_average": site_average(sites),
            "privacy": {**{key: value for key, value in self.ledger.headline().items() if key != "site"},
                        "uncovered": [release.value for release in self.manifest().uncovered]},
            "strategy": cfg.strategy,
            "data": {"name": cfg.data.name, "features": {"input_columns": list(preprocessor.columns),
                                                          "model_inputs": list(preprocessor.feature_names)}},
            "model": cfg.model.name,
            "num_sites": len(self.setups),
            "rounds": cfg.federation.rounds,
            "seed": cfg.seed,
        }
        if fed.choice is not None:
            summary["model_choice"] = fed.choice.as_dict()
        if task.uses_private_setup(cfg):
            summary["setup"] = {"left_out_columns": list(fed.agreed.dropped), "notes": list(fed.agreed.notes)}
        if fed.left_out:
            summary["left_out"] = {f"node {node}": reason for node, reason in sorted(fed.left_out.items())}
        if last and last.evaluate_local:  # their policy keeps their test metrics at the site: in no figure above
            summary["sites_kept_local"] = sorted(last.evaluate_local)
        if self.resumed:
            summary["resumed_after_round"] = self.resumed.last_round  # wall_time_s then counts the resumed part only
        oot = {key[4:]: value for key, value in test.items() if key.startswith("oot_")}
        if oot:
            summary["oot"] = oot
        return summary

    def centralized(self) -> dict[str, Any]:
        return task.train_centralized(self.cfg, self.fed.agreed.dataset)

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        tested = holds_test_part(self.cfg.data)
        lines = [f"final test ({summary['test_source']}): {_fmt(summary['test'])}"] if tested else []
        if len(self.sites) > 1:
            lines.append(f"final mean over the {len(self.sites)} sites' own test sets (each site once): "
                         f"{_fmt(summary['sites_average'])}")
        if "calibration" in summary:
            lines.append(_calibration_line(summary["calibration"]))
        if "km_null" in summary and not summary["km_null"]["below_null"]:
            lines.append(km_null_warning(summary["km_null"], "the pooled test split"))
        if summary["privacy"]["epsilon"] is not None:
            lines.append(_privacy_line(summary["privacy"]))
        if "oot" in summary:
            lines.append(f"final out-of-time: {_fmt(summary['oot'])}")
        if summary["privacy"]["uncovered"]:
            lines.append(f"not covered by epsilon: {', '.join(summary['privacy']['uncovered'])} (manifest.json)")
        if "centralized" in summary and tested:
            central = summary["centralized"]
            mechanism_name = central["privacy"]["mechanism"] if isinstance(central["privacy"], dict) else "none"
            lines.append(f"centralised baseline ({central['label']}; mechanism {mechanism_name}) test: "
                         f"{_fmt(central['test'])}")
        return lines


def _privacy_line(privacy: Mapping[str, Any]) -> str:
    """The console line on the run's ε (``summary["privacy"]``) and the other accountings of the same releases."""
    classical = (f"; classical epsilon of the same mechanism {privacy['epsilon_classical']:.4f}"
                 if "epsilon_classical" in privacy else "")
    if privacy.get("epsilon_rdp") is not None and privacy["epsilon_rdp"] != privacy["epsilon"]:
        classical += f"; RDP epsilon of the same releases {privacy['epsilon_rdp']:.4f}"
    if "epsilon_nominal" in privacy:
        classical += (f"; the paper's nominal epsilon {privacy['epsilon_nominal']:.4f}, its formula at the "
                      f"smallest noise {privacy['epsilon_audited_formula']:.4f}")
    return (f"privacy: epsilon {privacy['epsilon']:.4f} at delta {privacy['delta']:g} per {privacy['unit']} "
            f"(worst site; {privacy['accountant']}{classical}; assumptions in ledger.jsonl)")


def _fmt(metrics: dict[str, float], keys: tuple[str, ...] = ("c_index", "c_index_td", "ibs", "inbll")) -> str:
    return "  ".join(f"{key} {metrics[key]:.4f}" for key in keys if key in metrics and math.isfinite(metrics[key]))


def _calibration_line(calibration: Mapping[str, Any]) -> str:
    """One console line of :func:`flwr_app.task.calibration`: predicted / Kaplan–Meier at each follow-up quartile."""
    rows = calibration["tables"]["pooled test"]
    pairs = "  ".join(f"t={row['horizon']:.4g} {row['predicted']:.3f}/{row['km']:.3f}" for row in rows)
    return (f"calibration (pooled test, mean predicted/Kaplan–Meier at the training follow-up quartiles): {pairs}; "
            f"|gap| at the median {calibration['median_gap']:.3f}; Kaplan–Meier null IBS "
            f"{calibration['ibs_km_null']:.4f}")


def _rollback_text(rolled_back: Mapping[str, Any]) -> str:
    """A console line's account of a round whose model diverged and was rolled back."""
    cause = (f"updates that stood out: {', '.join(rolled_back['sites'])}" if rolled_back["sites"]
             else "no site's update stood out")
    return f"rolled back to round {rolled_back['to_round']}'s model: {rolled_back['reason']}; {cause}"


def _flags(record: RoundRecord) -> list[dict[str, str]]:
    """A round's flags (kept sites, not failures), ``{"phase", "site", "reason"}``: ``train`` (an update's pull
    bounded), ``weight`` (a weight capped), ``aggregate`` (left out by the robust aggregator in most of its rounds),
    ``evaluate`` (unusual test metrics)."""
    return [{"phase": phase, "site": site, "reason": reason}
            for phase, flags in (("train", record.train_flags), ("weight", record.weight_flags),
                                 ("aggregate", record.aggregate_flags), ("evaluate", record.evaluate_flags))
            for site, reason in sorted(flags.items())]


def _load(model: SurvivalModel, arrays: ArrayRecord, baseline: tuple[np.ndarray, np.ndarray] | None,
          exponents: np.ndarray | None = None) -> None:
    model.net.load_state_dict(arrays.to_torch_state_dict())
    if model.needs_baseline and baseline is not None:
        model.set_baseline(*baseline)
    if exponents is not None:
        model.set_exponents(exponents)


def _load_final(model: SurvivalModel, arrays: ArrayRecord, baseline: tuple[np.ndarray, np.ndarray] | None,
                exponents: np.ndarray | None) -> str:
    """Load the run's final global model for saving; return "" or why it has diverged.

    A diverged Cox model's Breslow aggregates can give no baseline hazard (an interval with events and an
    empty risk set): the network alone is then loaded, and the run still writes its summary and model.
    """
    try:
        _load(model, arrays, baseline, exponents)
        return ""
    except ValueError as err:
        model.net.load_state_dict(arrays.to_torch_state_dict())
        return f"global model diverged: {err}"



def _evaluate_global(
    model: SurvivalModel, arrays: ArrayRecord, baseline: tuple[np.ndarray, np.ndarray] | None,
    dataset: FederatedDataset, exponents: np.ndarray | None = None,
) -> tuple[dict[str, float], str]:
    """Load the global model (and, for Cox models, the federated Breslow ``baseline``) and evaluate it
    on the pooled test split.

    Returns ``(metrics, "")``, or ``({}, reason)`` when the model has diverged (non-finite
    weights, or risks that overflow so that no baseline hazard or survival curve exists) or, for a
    Cox model, when no site's Breslow aggregates came back (a diverged model's sites fail to compute
    them): a noisy DP run can do that, and its round is then recorded instead of ending the run.
    """
    try:
        _load(model, arrays, baseline, exponents)
        if not all(bool(torch.isfinite(value).all()) for value in model.net.state_dict().values()):
            raise ValueError("non-finite weights")
        if model.needs_baseline and baseline is None:
            return {}, "no test metrics: no site's Breslow aggregates came back, so the model has no baseline hazard"
        return _global_metrics(model, dataset), ""
    except ValueError as err:
        return {}, f"global model diverged: {err}"


def _global_metrics(model: SurvivalModel, dataset: FederatedDataset) -> dict[str, float]:
    """The model's figures on the pooled test split (none where the sites hold no test record) and, with ``oot_``
    keys, on the pooled out-of-time part where there is one."""
    test = dataset.pooled("test")
    metrics = task.evaluate(model, test) if len(test) else {}
    if any(site.oot is not None and len(site.oot) for site in dataset.sites):
        oot = task.evaluate(model, dataset.pooled("oot"))
        metrics.update({f"oot_{key}": value for key, value in oot.items()})
    return metrics


def run_identity(cfg: ExperimentConfig) -> dict[str, Any]:
    """The configuration a resumed run must share with its checkpoint, as JSON values.

    Everything but where the outputs go, ``resume.from``, the injected failures (``debug.*``),
    ``federation.timeout_s`` and ``evaluation.every`` (which rounds are evaluated: neither training
    nor privacy): in particular ``federation.rounds``, for which the sites calibrated their noise
    (extending a run would spend more than ``privacy.epsilon``).
    """
    identity = cfg.as_dict()
    for key in ("output_dir", "resume_from", "debug", "evaluation_every"):
        identity.pop(key)
    identity["federation"].pop("timeout_s")
    return json.loads(json.dumps(identity))


def _differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths where two nested configurations differ."""
    paths = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            paths += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            paths.append(f"{prefix}{key} ({a!r} in the checkpoint, {b!r} now)")
    return paths


@dataclass
class _Resumed:
    """Where a resumed run starts: the global model after ``last_round`` and the ledger (the strategy's round records,
    with every site's privacy states, are loaded into it)."""

    arrays: ArrayRecord
    last_round: int
    ledger: PrivacyLedger


def _resume(cfg: ExperimentConfig, outputs: RunOutputs, survival: SurvivalFedAvg) -> _Resumed:
    """Load ``resume.from``'s checkpoint, check it belongs to this configuration, cut the outputs back to it.

    Metrics lines and ledger entries of rounds after the checkpoint's (a crash between writing
    them and the checkpoint) are dropped: those rounds run again with the same seeds.
    """
    checkpoint = load_checkpoint(cfg.resume_from)
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"run config: resume.from = {cfg.resume_from!r} is not a fedsurv checkpoint of format "
                          f"{CHECKPOINT_FORMAT}")
    differences = _differences(json.loads(checkpoint["config"]), run_identity(cfg))
    if differences:
        raise ConfigError(f"run config: resume.from = {cfg.resume_from!r} was written by a run with another "
                          f"configuration; a resumed run must keep it (only output.dir, resume.from, debug.* and "
                          f"federation.timeout_s may change): {'; '.join(differences)}")
    last_round = int(checkpoint["round"])
    dropped = outputs.keep_metrics_until(last_round)
    ledger = PrivacyLedger.resume(outputs.ledger_path, last_round=last_round)
    survival.load_state_dict(checkpoint["strategy"])
    print(f"resuming {outputs.directory} after round {last_round} of {cfg.federation.rounds}"
          + (f" (dropped {dropped} metrics line(s) of later rounds written before the checkpoint)" if dropped else ""),
          flush=True)
    return _Resumed(ArrayRecord(checkpoint["arrays"]), last_round, ledger)


def _sites_per_round(cfg: ExperimentConfig, mechanism: HorizontalMechanism, num_sites: int) -> int:
    """How many sites Flower samples for a round's training (``fraction_train`` of them, at least the minimum)."""
    return min(num_sites, max(int(num_sites * cfg.federation.fraction_train),
                              mechanism.min_train_sites(cfg, num_sites=num_sites)))


def _check_aggregation(cfg: ExperimentConfig, mechanism: HorizontalMechanism, num_sites: int) -> None:
    """Refuse a robust aggregator that the sites of a round are too few for (``ConfigError`` naming the keys)."""
    federation = cfg.federation
    if reason := robust_refusal(federation.aggregation, trim_fraction=federation.trim_fraction,
                                malicious=federation.max_malicious, sites=_sites_per_round(cfg, mechanism, num_sites)):
        raise ConfigError(f"run config: {reason}")
