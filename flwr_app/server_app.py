"""ServerApp: FedAvg over the sites, per-round metrics, outputs (split learning: :mod:`flwr_app.vertical_server`;
Cox regression, ``model.name = "coxph"``: :mod:`flwr_app.cox_server`, after the same set-up).

Message handling and bookkeeping only; the aggregation is
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
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flwr_app import deployment, interrupt, runlog, task, vertical_task
from flwr_app.config import ConfigError, ExperimentConfig, parse_run_config
from flwr_app.cox_server import run_coxph
from flwr_app.outputs import RunOutputs, load_checkpoint
from flwr_app.private_split_server import run_private_split
from flwr_app.vertical_server import FlowerSplitTransport, run_vertical
from models.data import FederatedDataset
from models.metrics import km_null_check, km_null_warning
from models.plots import plot_survival_vs_km
from models.survival import SurvivalModel
from strategies.accounting.ledger import PrivacyLedger
from strategies.config import COXPH
from strategies.horizontal import (NO_TEST_PART, RoundRecord, SurvivalFedAvg, TooFewSitesError, holds_test_part,
                                   make_aggregator, privacy_position, robust_refusal, site_average, site_metrics,
                                   weighted_nanmean)
from strategies.mechanisms.base import HorizontalMechanism, delta_refusal
from strategies.mechanisms.private_split import PrivateSplitDP
from strategies.mechanisms.registry import get_mechanism, horizontal_mechanism
from strategies.model_choice import ModelChoice
from strategies.server_optimizers import make_server_optimizer

app = ServerApp()
CHECKPOINT_FORMAT = 1
#: Seconds between the ServerApp's looks for replies in a simulation (Flower's in-memory grid waits 0.1 s).
SIMULATION_PULL_INTERVAL_S = 0.005


class RunStopped(RuntimeError):
    """``debug.stop_after_round`` stopped the run (a simulated crash of the server)."""

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


@app.main()
@runlog.logged
def main(grid: Grid, context: Context) -> None:
    """Run ``federation.rounds`` rounds of FedAvg and write the run's outputs."""
    cfg = parse_run_config(context.run_config)
    mechanism = get_mechanism(cfg.strategy)
    if mechanism.vertical and not holds_test_part(cfg.data):
        raise ConfigError(f"run config: data.test_fraction = 0 needs a horizontal strategy; {cfg.strategy!r} (split "
                          "learning) predicts and scores the label holder's test records: set data.test_fraction "
                          "in (0, 1)")
    poll_replies_often(grid)
    outputs = RunOutputs.create(cfg)
    runlog.attach(outputs.directory)
    if not cfg.resume_from:  # a resumed run keeps the config.json of the run it continues (checked equal)
        outputs.write_config(cfg, context.run_config)
    started = time.perf_counter()
    if mechanism.vertical:
        table = vertical_task.load_table(cfg)
        wait_for_sites(grid, len(vertical_task.modality_names(cfg, table)), simulated=False)  # its sites may deploy
        run = run_private_split if isinstance(mechanism, PrivateSplitDP) else run_vertical
        run(cfg, FlowerSplitTransport(grid, timeout=cfg.federation.timeout_s), outputs, table=table, started=started)
        return
    run_horizontal(cfg, grid, outputs, started=started)


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


def run_horizontal(cfg: ExperimentConfig, grid: Grid, outputs: RunOutputs, *, started: float) -> None:
    """A horizontal federation: set-up, ``federation.rounds`` rounds with every reply checked, outputs."""
    mechanism = horizontal_mechanism(cfg.strategy)
    dataset: FederatedDataset | None = None
    left_out: dict[int, str] = {}
    if cfg.data.deployed:
        _check_aggregation(cfg, mechanism, cfg.federation.num_sites)  # before the set-up releases anything
        wait_for_sites(grid, cfg.federation.num_sites, simulated=False)
        setup = deployment.prepare_sites(grid, cfg)
        model, setups, left_out = task.model_from_spec(cfg, setup.spec), setup.setups, setup.left_out
        node_sites, spec, setup_notes = dict(setup.sites), setup.spec, setup.notes
        recalibration, dropped = setup.recalibration, setup.left_out_columns
    else:
        dataset = task.load_federation(cfg)
        _check_aggregation(cfg, mechanism, dataset.num_sites)
        agreed = task.federation_setup(cfg)
        model, setups, setup_notes = task.build_model(cfg, dataset), agreed.setups, agreed.notes
        recalibration, dropped = agreed.recalibration, agreed.left_out
        spec = task.run_spec(cfg, dataset)
        wait_for_sites(grid, dataset.num_sites, simulated=True)
        node_sites = {}
    num_sites = len(setups)
    choice = task.model_choice(cfg, {name: agreed.count for name, agreed in setups.items()},
                               len(spec.preprocessor.feature_names))  # the widths model_from_spec/build_model took
    # delta against the protected population, before any training release (in a deployment each site has refused
    # a delta above 1/its own count before its set-up release; here the agreed counts, and distributed_dp's union)
    if refusal := delta_refusal(cfg, mechanism, {name: setup.count for name, setup in setups.items()}):
        raise ConfigError(refusal)
    fedavg_kwargs: dict[str, Any] = dict(
        fraction_train=cfg.federation.fraction_train, fraction_evaluate=1.0,
        min_train_nodes=mechanism.min_train_sites(cfg, num_sites=num_sites),
        min_evaluate_nodes=cfg.federation.min_sites, min_available_nodes=cfg.federation.min_sites,
    )
    survival = SurvivalFedAvg(
        mechanism=mechanism, cfg=cfg, setups=setups,
        needs_baseline=model.needs_baseline, grid_size=len(model.cuts), timeout=cfg.federation.timeout_s,
        aggregator=make_aggregator(cfg.federation.aggregation, trim_fraction=cfg.federation.trim_fraction,
                                   malicious=cfg.federation.max_malicious, weighted_by_key="num-examples",
                                   sites=_sites_per_round(cfg, mechanism, num_sites),
                                   **fedavg_kwargs),
        server_optimizer=make_server_optimizer(cfg.federation),
        **fedavg_kwargs,
    )
    if recalibration is not None:
        survival.recalibration = (recalibration, np.asarray(model.cuts, dtype=np.float64))
    if node_sites:
        survival.node_sites = node_sites
    else:  # simulation: every node says once which site it is; a node that cannot is left out
        left_out = survival.identify_sites(grid)
        survival.require_named(left_out)  # too few named: the run stops before any further message
    if cfg.data.deployed:  # the sites left out get no further message; a restarted site gets the set-up again
        grid = deployment.RejoiningSites(grid, setup, survival.node_sites, timeout=cfg.federation.timeout_s,
                                         history=lambda site: privacy_position(survival.rounds, site))
    elif left_out:
        grid = deployment.ParticipatingSites(grid, survival.node_sites)  # the sites left out get no further message
    if cfg.model.name == COXPH:  # Newton-Raphson on the sites' sums instead of FedAvg rounds (flwr_app.cox_server)
        return run_coxph(cfg, grid, outputs, survival=survival, model=model, dataset=dataset, spec=spec,
                         left_out=left_out, notes=setup_notes, started=started)
    description = (f"{len(survival.node_sites)} sites' own files" if cfg.data.deployed else
                   f"{len(survival.node_sites)} sites, partition '{cfg.federation.partition}'")
    description += f", {len(left_out)} left out" if left_out else ""
    if cfg.federation.server_optimizer != "fedavg":
        description += f", server optimiser {cfg.federation.server_optimizer}"
    strategy: Strategy = mechanism.wrap_strategy(survival, cfg, num_sites=num_sites)
    resumed = _resume(cfg, outputs, survival) if cfg.resume_from else None
    ledger = resumed.ledger if resumed else PrivacyLedger(outputs.ledger_path)
    manifest = mechanism.manifest(cfg)
    outputs.write_manifest(manifest.as_dict())
    print(
        f"fedsurv: {cfg.strategy} | {cfg.data.name} ({description}) | {cfg.model.name} | "
        f"{cfg.federation.rounds} rounds -> {outputs.directory}",
        flush=True,
    )
    if choice is not None:
        print(choice.line(), flush=True)
    for note in setup_notes:
        print(note, flush=True)
    if not holds_test_part(cfg.data):
        print(f"test figures: {NO_TEST_PART}", flush=True)

    def end_of_round(server_round: int, arrays: ArrayRecord) -> None:
        record = survival.rounds.get(server_round)
        released = record.released if record else {}
        entries = []
        for site in sorted(released):
            entry = mechanism.ledger_entry(cfg, server_round, site, setup=setups[site],
                                           reports=survival.site_reports(site, server_round))
            entry = dataclasses.replace(entry, assumptions=entry.assumptions + setup_notes)
            if released[site] is None:
                entry = dataclasses.replace(entry, assumptions=entry.assumptions + (
                    f"round {server_round}: no accepted reply from this site (refused, or none within "
                    "federation.timeout_s: it may have sent its update late); the round counts as released",))
            entries.append(entry)
        ledger.record(*entries)
        global_test: dict[str, float] = {}
        diverged = ""
        if cfg.server_evaluation and survival.evaluates(server_round):
            global_test, diverged = _evaluate_global(model, arrays, survival.baseline, dataset, survival.exponents)
        line: dict[str, Any] = {
            "round": server_round,
            "train": weighted_nanmean({site: {**report, "num-examples": setups[site].count}
                                       for site, report in (record.train_sites.items() if record else ())
                                       if "train_loss" in report}),
            "privacy": ledger.headline(),
            "global_test": global_test,
            "sites_mean": weighted_nanmean(record.evaluate_sites) if record else {},
            "sites_average": site_average(record.evaluate_sites) if record else {},
            "sites": site_metrics(record) if record else {},
            "sites_kept_local": sorted(record.evaluate_local) if record else [],
            "failures": record.failures if record else [],
            "flags": _flags(record) if record else [],
            "update_spread": dict(sorted(record.update_spread.items())) if record else {},
            "discarded": dict(sorted(record.discarded.items())) if record else {},
            "elapsed_s": time.perf_counter() - started,
        }
        if diverged:
            line["diverged"] = diverged
        if record and record.rolled_back:
            line["rolled_back"] = record.rolled_back
        if record and record.shortfall:
            line["not_aggregated"] = record.shortfall
        outputs.append_metrics(line)
        outputs.save_checkpoint({
            "format": CHECKPOINT_FORMAT, "round": server_round, "config": json.dumps(run_identity(cfg)),
            "arrays": arrays.to_torch_state_dict(), "strategy": survival.state_dict(),
        })
        shown = global_test or line["sites_mean"]
        train_loss = line["train"].get("train_loss")
        print(
            f"round {server_round:3d}/{cfg.federation.rounds}"
            + (f"  train_loss {train_loss:.4f}" if train_loss is not None and math.isfinite(train_loss) else "")
            + ("" if not holds_test_part(cfg.data) else
               f"  {'test' if global_test else 'sites'}: {_fmt(shown)}" if survival.evaluates(server_round)
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
            + (f"  [{_rollback_text(record.rolled_back)}]" if record and record.rolled_back else ""),
            flush=True,
        )
        if server_round == cfg.debug.stop_after_round:
            raise RunStopped(f"debug.stop_after_round = {server_round}: the run stops after round {server_round} "
                             f"(a simulated crash of the server); continue it with resume.from = "
                             f"'{outputs.directory}'")
        interrupt.raise_if_requested(server_round, of=cfg.federation.rounds, directory=outputs.directory)

    try:
        arrays = survival.run_rounds(
            grid, arrays=resumed.arrays if resumed else ArrayRecord(model.net.state_dict()),
            first_round=resumed.last_round + 1 if resumed else 1, last_round=cfg.federation.rounds,
            end_of_round=end_of_round, outer=strategy, resumed=resumed is not None,
        )
    except TooFewSitesError as err:
        raise TooFewSitesError(f"{err}. The outputs up to this round and its checkpoint are in {outputs.directory}; "
                               f"once the sites are back, continue with resume.from = '{outputs.directory}'") from err
    _write_results(cfg, mechanism, dataset, spec, num_sites, model, arrays, survival, ledger, outputs,
                   time.perf_counter() - started, resumed_after_round=resumed.last_round if resumed else 0,
                   left_out=left_out, setup={"left_out_columns": list(dropped), "notes": list(setup_notes)},
                   choice=choice)


def _write_results(
    cfg: ExperimentConfig, mechanism: HorizontalMechanism, dataset: FederatedDataset | None, spec: task.SiteSpec,
    num_sites: int, model: SurvivalModel,
    arrays: ArrayRecord, strategy: SurvivalFedAvg, ledger: PrivacyLedger, outputs: RunOutputs, wall_time_s: float,
    *, resumed_after_round: int = 0, left_out: Mapping[int, str] | None = None, setup: Mapping[str, Any] | None = None,
    choice: ModelChoice | None = None,
) -> None:
    """Write the summary, the model and (with the pooled data of a simulation) calibration and the baseline.

    ``dataset`` is ``None`` in a deployment, where ``evaluation.server_side`` and
    ``baseline.centralized`` are off (checked by :func:`flwr_app.config.parse_run_config`).
    ``left_out``: the deployed sites left out at set-up, node ID -> why (``summary["left_out"]``).
    ``spec``: the agreed preprocessing, time grid and time scale, saved beside the model
    (``preprocessing.json``); ``summary["data"]["features"]`` names its input columns and model inputs.
    ``setup``: with a private set-up, ``summary["setup"]``: the columns it left out of the model (no range stood out
    of its noise, ``left_out_columns``) and its console line on the fallbacks (``notes``).
    ``choice``: what ``model.name = "auto"`` chose (``summary["model_choice"]``); the model is saved with the
    architecture it was trained with (``spec``'s widths), which :func:`models.predict.load_run` rebuilds.
    """
    last = strategy.rounds.get(cfg.federation.rounds)
    sites = dict(sorted(last.evaluate_sites.items())) if last else {}
    diverged = ""
    tested = holds_test_part(cfg.data)
    if cfg.server_evaluation:
        test, diverged = _evaluate_global(model, arrays, strategy.baseline, dataset, strategy.exponents)
        test_source = "global model on the pooled test split (server-side, simulation)" if tested else NO_TEST_PART
    else:
        test = weighted_nanmean(sites)
        test_source = "weighted mean of the sites' own test metrics" if tested else NO_TEST_PART
    summary: dict[str, Any] = {
        "test": {key: value for key, value in test.items() if not key.startswith("oot_")},
        "test_source": test_source,
        "sites": site_metrics(last) if last else {},
        "sites_mean": weighted_nanmean(sites),
        "sites_average": site_average(sites),
        "privacy": {**{key: value for key, value in ledger.headline().items() if key != "site"},
                    "uncovered": [release.value for release in mechanism.manifest(cfg).uncovered]},
        "strategy": cfg.strategy,
        "data": {"name": cfg.data.name, "features": {"input_columns": list(spec.preprocessor.columns),
                                                      "model_inputs": list(spec.preprocessor.feature_names)}},
        "model": cfg.model.name,
        "num_sites": num_sites,
        "rounds": cfg.federation.rounds,
        "seed": cfg.seed,
        "wall_time_s": wall_time_s,
    }
    if choice is not None:
        summary["model_choice"] = choice.as_dict()
    if setup is not None and task.uses_private_setup(cfg):
        summary["setup"] = dict(setup)
    if left_out:
        summary["left_out"] = {f"node {node}": reason for node, reason in sorted(left_out.items())}
    if last and last.evaluate_local:  # their policy keeps their test metrics at the site: in no figure above
        summary["sites_kept_local"] = sorted(last.evaluate_local)
    if resumed_after_round:
        summary["resumed_after_round"] = resumed_after_round  # wall_time_s then counts the resumed part only
    oot = {key[4:]: value for key, value in test.items() if key.startswith("oot_")}
    if oot:
        summary["oot"] = oot
    loaded = _load_final(model, arrays, strategy.baseline, strategy.exponents)
    diverged = diverged or loaded
    if diverged:
        summary["diverged"] = diverged
    model.net.eval()
    outputs.save_model(model.net.state_dict(), model=cfg.model.name, config=task.spec_config(cfg, spec).as_dict(),
                       baseline=strategy.baseline,
                       preprocessing=task.preprocessing(cfg, spec),
                       exponents=None if strategy.exponents is None else strategy.exponents.tolist())
    if cfg.server_evaluation and not diverged and tested:
        summary["calibration"] = task.calibration(model, dataset)
        summary["km_null"] = km_null_check(summary["test"].get("ibs", math.nan), summary["calibration"]["ibs_km_null"])
        plot_survival_vs_km(model, dataset, outputs.plot_path, title=f"{cfg.strategy} on {cfg.data.name}",
                            time_unit=cfg.data.time_unit)
    if cfg.centralized_baseline:
        print("training the centralised baseline on the pooled training data ...", flush=True)
        summary["centralized"] = task.train_centralized(cfg, dataset)
    outputs.write_summary(summary)
    if tested:
        print(f"final test ({test_source}): {_fmt(summary['test'])}", flush=True)
    if len(sites) > 1:
        print(f"final mean over the {len(sites)} sites' own test sets (each site once): "
              f"{_fmt(summary['sites_average'])}", flush=True)
    if "calibration" in summary:
        print(_calibration_line(summary["calibration"]), flush=True)
    if "km_null" in summary and not summary["km_null"]["below_null"]:
        print(km_null_warning(summary["km_null"], "the pooled test split"), flush=True)
    if summary["privacy"]["epsilon"] is not None:
        privacy = summary["privacy"]
        classical = (f"; classical epsilon of the same mechanism {privacy['epsilon_classical']:.4f}"
                     if "epsilon_classical" in privacy else "")
        if privacy.get("epsilon_rdp") is not None and privacy["epsilon_rdp"] != privacy["epsilon"]:
            classical += f"; RDP epsilon of the same releases {privacy['epsilon_rdp']:.4f}"
        if "epsilon_nominal" in privacy:
            classical += (f"; the paper's nominal epsilon {privacy['epsilon_nominal']:.4f}, its formula at the "
                          f"smallest noise {privacy['epsilon_audited_formula']:.4f}")
        print(f"privacy: epsilon {privacy['epsilon']:.4f} at delta {privacy['delta']:g} per {privacy['unit']} "
              f"(worst site; {privacy['accountant']}{classical}; assumptions in ledger.jsonl)", flush=True)
    if oot:
        print(f"final out-of-time: {_fmt(oot)}", flush=True)
    if summary["privacy"]["uncovered"]:
        print(f"not covered by epsilon: {', '.join(summary['privacy']['uncovered'])} (manifest.json)", flush=True)
    if "centralized" in summary and tested:
        central = summary["centralized"]
        mechanism_name = central["privacy"]["mechanism"] if isinstance(central["privacy"], dict) else "none"
        print(f"centralised baseline ({central['label']}; mechanism {mechanism_name}) test: "
              f"{_fmt(central['test'])}", flush=True)
    print(f"outputs: {outputs.directory}", flush=True)
