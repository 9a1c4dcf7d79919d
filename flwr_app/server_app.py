"""ServerApp: FedAvg over the sites, per-round metrics, outputs (split learning: :mod:`flwr_app.vertical_server`).

Message handling and bookkeeping only; the aggregation is
:class:`strategies.horizontal.SurvivalFedAvg`, the model and metrics come from ``flwr_app.task``.

In simulation the server also holds the pooled test split of the embedded data set, so it
evaluates the global model on it after each round (``evaluation.server_side``) and can train the
centralised baseline (``baseline.centralized``). Per-site figures always come from the sites
themselves (federated evaluation on each site's own test part). In a deployment
(``data.name = "site_files"``) the server holds no records: it agrees the preprocessing and the time
grid with the sites first (:func:`flwr_app.deployment.prepare_sites`), and the run's test figures
are the sites' own.

Fault tolerance: a site that fails or does not answer in a round is recorded in that round's
``failures`` and the round goes on with the others, down to ``federation.min_sites`` (see
:meth:`strategies.horizontal.SurvivalFedAvg.run_rounds`). After every round the server writes
``checkpoint.pt`` (the global model, the strategy's records, every site's last privacy state and
the configuration); ``resume.from`` continues a stopped run from its last checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flwr_app import deployment, interrupt, runlog, task, vertical_task
from flwr_app.config import ConfigError, ExperimentConfig, parse_run_config
from flwr_app.outputs import RunOutputs, load_checkpoint
from flwr_app.vertical_server import FlowerSplitTransport, run_vertical
from models.data import FederatedDataset
from models.plots import plot_survival_vs_km
from models.survival import SurvivalModel
from strategies.accounting.ledger import LedgerEntry, PrivacyLedger
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.horizontal import (
    PRIVACY_KEYS,
    SurvivalFedAvg,
    TooFewSitesError,
    weighted_nanmean,
    with_central_dp,
)
from strategies.mechanisms.nbafl import WEIGHT_PERTURBATION

app = ServerApp()
CHECKPOINT_FORMAT = 1
#: Seconds between the ServerApp's looks for replies in a simulation (Flower's in-memory grid waits 0.1 s).
SIMULATION_PULL_INTERVAL_S = 0.005


class RunStopped(RuntimeError):
    """``debug.stop_after_round`` stopped the run (a simulated crash of the server)."""

SHARED_STATISTICS = (
    "not covered: the shared time grid (quantiles of the pooled training times) and the preprocessing "
    "statistics (feature means, scales, categories) are computed from the sites' data without noise"
)
NO_PRIVACY = ("FedAvg without a privacy mechanism: each site's model update reaches the server in the clear",)
DP_SGD_ASSUMPTIONS = (
    "record-level DP-SGD at the site: per-record gradient clipped to clip_norm, Gaussian noise "
    "N(0, (noise_multiplier*clip_norm)^2) on the sum, divided by the expected batch size",
    "Poisson sampling of each record with probability sample_rate = batch_size/n_site at every step",
    "epsilon from opacus for the Poisson-subsampled Gaussian over all steps so far (add/remove-one adjacency)",
    "noise calibrated once for all rounds x local steps; the model updates, the global model and "
    "everything computed from them are post-processing",
    "covers the site's training records only: per-site test metrics are computed on held-out records "
    "and released without noise",
    "sites hold disjoint records: the run's guarantee is the maximum epsilon over sites (parallel composition)",
    SHARED_STATISTICS,
)


CENTRAL_DP_ASSUMPTIONS = (
    "client-level DP at the server (Flower DifferentialPrivacyServerSideFixedClipping): each site's update "
    "clipped to clip_norm, Gaussian noise with std noise_multiplier*clip_norm/num_sites added to the mean",
    "unit: a whole site's update; adjacency: add/remove one site with the denominator fixed at num_sites "
    "(under replace-one the sensitivity doubles)",
    "sites weighted equally; every site in every round: no sub-sampling amplification is credited",
    "epsilon from opacus RDP of the Gaussian mechanism composed over the releases so far (q = 1)",
    "the server sees each site's clipped update in the clear: the guarantee is against everyone who sees "
    "the released global models, not against the server",
    "per-site evaluation metrics (and Breslow aggregates for Cox models) are released without noise",
    SHARED_STATISTICS,
)


def bdp_assumptions(adjacency: str) -> tuple[str, ...]:
    """The ledger's statement of what a Bayesian-DP figure assumes, for one adjacency."""
    if adjacency == "add-remove":
        distances = ("epsilon_mu is estimated from the clipped-gradient norms of every record of each step's batch "
                     "(add/remove-one neighbours drawn from the data distribution), with a Student-t upper "
                     "confidence bound")
        classical = ("epsilon_classical: opacus RDP (worst case, add/remove-one, sensitivity C) of the same sigma, "
                     "q, steps. epsilon_mu converts Renyi bounds to a tail bound on the privacy loss (Triastcyn & "
                     "Faltings Thm 1, as Mironov 2017 Prop 3) while opacus uses the tighter conversion of Balle et "
                     "al. 2020: with every gradient clipped to C, epsilon_mu is about 1.2-1.3x epsilon_classical; "
                     "it is smaller only when many records' gradients are well below C")
    else:
        distances = ("epsilon_mu is estimated from pairwise distances of 16 clipped per-record gradients per step "
                     "(replace-one neighbours drawn from the data distribution), with a Student-t upper "
                     "confidence bound")
        classical = ("epsilon_classical: the same bound at the largest replace-one distance 2C, i.e. opacus RDP "
                     "of noise multiplier sigma/2 for the same q and steps (worst case, replace-one)")
    return (
        "Bayesian DP (Triastcyn & Faltings 2020; FSL-BDP): the DP-SGD update of dp_sgd (clip, Gaussian noise "
        "on the sum, Poisson sampling); epsilon is the average-case epsilon_mu with delta_mu = beta + gamma, "
        "beta = privacy.delta, gamma <= steps x 1e-12",
        distances,
        "the budget filter stops the site before a step that would exceed privacy.epsilon",
        "noise multiplier calibrated once from a pilot estimate on the site's own records; that "
        "data-dependent calibration is not itself accounted",
        classical,
        "sites with fewer than 100 records run classical DP-SGD instead (epsilon_mu = classical epsilon)",
        "covers the site's training records only; sites are disjoint: the run's figure is the maximum over sites",
        SHARED_STATISTICS,
    )


def weight_perturbation_assumptions(cfg: ExperimentConfig) -> tuple[str, ...]:
    """The ledger's statement of what an NbAFL / LS-ADP / ROW-DP figure assumes."""
    privacy, rounds = cfg.privacy, cfg.federation.rounds
    importance = {
        "nbafl": "equal budgets for every weight (NbAFL)",
        "ls_adp": "per-layer budgets from layer sensitivity: each layer perturbed in turn with NbAFL's uniform noise "
                  "and the change of the site's training loss measured (LS-ADP)",
        "row_dp": f"one layer drawn at random each round; its weights' budgets from {privacy.dispersion} over the "
                  "local iterates x final magnitude, other layers equal budgets (ROW-DP)",
    }[cfg.strategy]
    if privacy.allocation == "paper":
        allocation = ("allocation 'paper': one clip norm C on all weights, unit budgets averaging to epsilon_nominal, "
                      "NbAFL noise sigma = c L (2C/m) / budget per unit. The release is a Gaussian mechanism with "
                      "diagonal covariance under one L2 bound, so its guarantee is set by the smallest sigma (the "
                      "largest budget): epsilon is audited there, not at the average")
    else:
        allocation = ("allocation 'exact': unit u (a layer; for row_dp each weight of the selected layer) clipped to "
                      "C_u = C sqrt(size_u/P), noise s_u = z (2 C_u/m) / sqrt(V_u) with V_u its share of the paper's "
                      "budgets; the joint release is one Gaussian mechanism of noise multiplier z, calibrated by RDP "
                      "to the target")
    return (
        f"weight perturbation before upload ({cfg.strategy}): the site's trained weights clipped and perturbed with "
        f"Gaussian noise; {importance}",
        allocation,
        "sensitivity 2C/m to replacing one record of the smallest site (m records) is NbAFL's Lemma 1 (Wei et al. "
        "2020), the paper's bound taken as given: it is not proved for weights trained by SGD, nor for the Cox "
        "partial likelihood, which is not a sum over records",
        "epsilon: RDP of the Gaussian releases so far (noise multiplier = release's effective sigma / (2C/m)), "
        "composed over rounds; epsilon_audited_formula: the paper's formula c L Delta/sigma_min at the smallest noise, "
        "composed linearly (it holds for epsilon < 1 only, and composes delta L times); epsilon_nominal: the paper's "
        "average budget over the whole training",
        f"L = {rounds} exposures (every site may upload in every round); downlink noise sigma_D = 0 because "
        f"T <= L sqrt(N)",
        "importance scores are computed from the site's private data (its training loss, its local iterates) and are "
        "not themselves privatised",
        "weights whose budget is 0 release the public global value they started from",
        "per-site test metrics (and Breslow aggregates for Cox models) are released without noise",
        "sites hold disjoint records: the run's figure is the maximum over sites",
        SHARED_STATISTICS,
    )


def ledger_entry(
    cfg: ExperimentConfig, server_round: int, site: str, metrics: dict[str, float], *,
    central_noise_multiplier: float | None = None,
) -> LedgerEntry:
    """What ``site`` has spent after ``server_round`` (its own report, or the server's mechanism)."""
    if cfg.strategy == "bdp":
        return LedgerEntry(
            round=server_round, site=site, mechanism="bdp_fallback_dp_sgd" if metrics["fallback"] else "bdp",
            unit="record", adjacency=cfg.privacy.adjacency, accountant="bayesian-dp (UCB) + opacus-rdp",
            epsilon=metrics["epsilon_mu"], delta=cfg.privacy.delta, noise_multiplier=metrics["noise_multiplier"],
            clip_norm=metrics["clip_norm"], sample_rate=metrics["sample_rate"], steps=int(metrics["steps"]),
            epsilon_classical=metrics["epsilon"], assumptions=bdp_assumptions(cfg.privacy.adjacency),
        )
    if cfg.strategy == "central_dp":
        assert central_noise_multiplier is not None
        return LedgerEntry(
            round=server_round, site=site, mechanism="central_dp", unit="site", adjacency="add-remove",
            accountant=f"opacus-{cfg.privacy.accountant}",
            epsilon=epsilon_gaussian_rounds(noise_multiplier=central_noise_multiplier, rounds=server_round,
                                            delta=cfg.privacy.delta),
            delta=cfg.privacy.delta, noise_multiplier=central_noise_multiplier, clip_norm=cfg.privacy.clip_norm,
            sample_rate=1.0, steps=server_round, assumptions=CENTRAL_DP_ASSUMPTIONS,
        )
    if cfg.strategy in WEIGHT_PERTURBATION:
        return LedgerEntry(
            round=server_round, site=site, mechanism=f"{cfg.strategy}_{cfg.privacy.allocation}", unit="record",
            adjacency="replace-one", accountant="gaussian-rdp (audit) + paper formula",
            epsilon=metrics["epsilon"], delta=cfg.privacy.delta, noise_multiplier=metrics["noise_multiplier"],
            clip_norm=metrics["clip_norm"], sample_rate=1.0, steps=int(metrics["steps"]),
            epsilon_nominal=metrics["epsilon_nominal"], epsilon_audited_formula=metrics["epsilon_audited_formula"],
            assumptions=weight_perturbation_assumptions(cfg),
        )
    if cfg.strategy == "dp_sgd":
        return LedgerEntry(
            round=server_round, site=site, mechanism="dp_sgd", unit="record", adjacency="add-remove",
            accountant=f"opacus-{cfg.privacy.accountant}", epsilon=metrics["epsilon"], delta=cfg.privacy.delta,
            noise_multiplier=metrics["noise_multiplier"], clip_norm=metrics["clip_norm"],
            sample_rate=metrics["sample_rate"], steps=int(metrics["steps"]), assumptions=DP_SGD_ASSUMPTIONS,
        )
    return LedgerEntry(
        round=server_round, site=site, mechanism="none", unit="none", adjacency="n/a",
        accountant="none", epsilon=None, delta=None, assumptions=NO_PRIVACY,
    )


def _fmt(metrics: dict[str, float], keys: tuple[str, ...] = ("c_index", "c_index_td", "ibs", "inbll")) -> str:
    return "  ".join(f"{key} {metrics[key]:.4f}" for key in keys if key in metrics and math.isfinite(metrics[key]))


def _load(model: SurvivalModel, arrays: ArrayRecord, strategy: SurvivalFedAvg) -> None:
    model.net.load_state_dict(arrays.to_torch_state_dict())
    if model.needs_baseline and strategy.baseline is not None:
        model.set_baseline(*strategy.baseline)


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


def wait_for_sites(grid: Grid, expected: int, *, timeout_s: float = 300.0) -> int:
    """Wait until ``expected`` sites are connected (or ``timeout_s`` passes); return how many are.

    Without this the first round samples whichever nodes happen to be registered when it starts
    (in simulation, Flower registers the virtual SuperNodes while the ServerApp is already
    running), and a site can silently miss round 1.
    """
    deadline = time.monotonic() + timeout_s
    while (connected := len(list(grid.get_node_ids()))) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    if connected < expected:
        print(f"warning: {connected} of {expected} sites connected after {timeout_s:.0f} s; starting with them",
              flush=True)
    return connected


def _evaluate_global(
    model: SurvivalModel, arrays: ArrayRecord, strategy: SurvivalFedAvg, dataset: FederatedDataset,
) -> tuple[dict[str, float], str]:
    """Load the global model and evaluate it on the pooled test split.

    Returns ``(metrics, "")``, or ``({}, reason)`` when the model has diverged (non-finite
    weights, or risks that overflow so that no baseline hazard or survival curve exists): a
    noisy DP run can do that, and its round is then recorded as diverged instead of ending the run.
    """
    try:
        _load(model, arrays, strategy)
        if not all(bool(torch.isfinite(value).all()) for value in model.net.state_dict().values()):
            raise ValueError("non-finite weights")
        return _global_metrics(model, dataset), ""
    except ValueError as err:
        return {}, f"global model diverged: {err}"


def _global_metrics(model: SurvivalModel, dataset: FederatedDataset) -> dict[str, float]:
    metrics = task.evaluate(model, dataset.pooled("test"), dataset.pooled("train"))
    if any(site.oot is not None and len(site.oot) for site in dataset.sites):
        oot = task.evaluate(model, dataset.pooled("oot"), dataset.pooled("train"))
        metrics.update({f"oot_{key}": value for key, value in oot.items()})
    return metrics


def run_identity(cfg: ExperimentConfig) -> dict[str, Any]:
    """The configuration a resumed run must share with its checkpoint, as JSON values.

    Everything but where the outputs go, ``resume.from``, the injected failures (``debug.*``) and
    ``federation.timeout_s``: in particular ``federation.rounds``, for which the sites calibrated
    their noise (extending a run would spend more than ``privacy.epsilon``).
    """
    identity = cfg.as_dict()
    for key in ("output_dir", "resume_from", "debug"):
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
    """Where a resumed run starts: the global model after ``last_round`` and every site's privacy state."""

    arrays: ArrayRecord
    last_round: int
    ledger: PrivacyLedger
    privacy_states: dict[str, str]


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
    return _Resumed(ArrayRecord(checkpoint["arrays"]), last_round, ledger, dict(checkpoint["privacy_states"]))


@app.main()
@runlog.logged
def main(grid: Grid, context: Context) -> None:
    """Run ``federation.rounds`` rounds of FedAvg and write the run's outputs."""
    cfg = parse_run_config(context.run_config)
    poll_replies_often(grid)
    outputs = RunOutputs.create(cfg)
    runlog.attach(outputs.directory)
    if not cfg.resume_from:  # a resumed run keeps the config.json of the run it continues (checked equal)
        outputs.write_config(cfg, context.run_config)
    started = time.perf_counter()
    if cfg.strategy == "split":
        table = vertical_task.load_table(cfg)
        wait_for_sites(grid, len(vertical_task.modality_names(cfg, table)))
        run_vertical(cfg, FlowerSplitTransport(grid, timeout=cfg.federation.timeout_s), outputs, table=table,
                     started=started)
        return

    dataset: FederatedDataset | None = None
    left_out: dict[int, str] = {}
    if cfg.data.deployed:
        wait_for_sites(grid, cfg.federation.num_sites)
        setup = deployment.prepare_sites(grid, cfg)
        grid = deployment.ParticipatingSites(grid, setup.sites)  # the sites left out get no further message
        model, num_sites, left_out = task.model_from_spec(cfg, setup.spec), len(setup.sites), setup.left_out
        description = f"{num_sites} sites' own files" + (f", {len(left_out)} left out" if left_out else "")
    else:
        dataset = task.load_federation(cfg)
        model, num_sites = task.build_model(cfg, dataset), dataset.num_sites
        description = f"{num_sites} sites, partition '{cfg.federation.partition}'"
        wait_for_sites(grid, num_sites)
    # Central DP's noise is calibrated to the mean of num_sites updates: a round without every site is not released.
    min_sites = num_sites if cfg.strategy == "central_dp" else cfg.federation.min_sites
    survival = SurvivalFedAvg(
        needs_baseline=model.needs_baseline,
        timeout=cfg.federation.timeout_s,
        fraction_train=cfg.federation.fraction_train,
        fraction_evaluate=1.0,
        min_train_nodes=min_sites,
        min_evaluate_nodes=cfg.federation.min_sites,
        min_available_nodes=cfg.federation.min_sites,
    )
    strategy: Strategy = survival
    central_noise_multiplier = None
    if cfg.strategy == "central_dp":
        strategy, central_noise_multiplier = with_central_dp(
            survival, epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, rounds=cfg.federation.rounds,
            clip_norm=cfg.privacy.clip_norm, num_sites=num_sites, accountant=cfg.privacy.accountant,
        )
    resumed = _resume(cfg, outputs, survival) if cfg.resume_from else None
    ledger = resumed.ledger if resumed else PrivacyLedger(outputs.ledger_path)
    privacy_states = resumed.privacy_states if resumed else {}
    print(
        f"fedsurv: {cfg.strategy} | {cfg.data.name} ({description}) | {cfg.model.name} | "
        f"{cfg.federation.rounds} rounds -> {outputs.directory}",
        flush=True,
    )

    def end_of_round(server_round: int, arrays: ArrayRecord) -> None:
        record = survival.rounds.get(server_round)
        train_sites = record.train_sites if record else {}
        for site in sorted(train_sites):
            ledger.record(ledger_entry(cfg, server_round, site, train_sites[site],
                                       central_noise_multiplier=central_noise_multiplier))
        global_test: dict[str, float] = {}
        diverged = ""
        if cfg.server_evaluation:
            global_test, diverged = _evaluate_global(model, arrays, survival, dataset)
        line: dict[str, Any] = {
            "round": server_round,
            "train": weighted_nanmean({site: {key: value for key, value in metrics.items() if key not in PRIVACY_KEYS}
                                       for site, metrics in train_sites.items()}),
            "privacy": ledger.headline(),
            "global_test": global_test,
            "sites_mean": weighted_nanmean(record.evaluate_sites) if record else {},
            "sites": dict(sorted(record.evaluate_sites.items())) if record else {},
            "failures": record.failures if record else [],
            "elapsed_s": time.perf_counter() - started,
        }
        if diverged:
            line["diverged"] = diverged
        if record and record.shortfall:
            line["not_aggregated"] = record.shortfall
        outputs.append_metrics(line)
        privacy_states.update(record.privacy_states if record else {})
        outputs.save_checkpoint({
            "format": CHECKPOINT_FORMAT, "round": server_round, "config": json.dumps(run_identity(cfg)),
            "arrays": arrays.to_torch_state_dict(), "strategy": survival.state_dict(),
            "privacy_states": dict(privacy_states),
        })
        shown = global_test or line["sites_mean"]
        print(
            f"round {server_round:3d}/{cfg.federation.rounds}  train_loss {line['train'].get('train_loss', math.nan):.4f}  "
            f"{'test' if global_test else 'sites'}: {_fmt(shown)}"
            + (f"  epsilon {line['privacy']['epsilon']:.3f}" if line["privacy"]["epsilon"] is not None else "")
            + (f"  [{len(line['failures'])} failed]" if line["failures"] else "")
            + (f"  [{diverged}]" if diverged else ""),
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
            end_of_round=end_of_round, outer=strategy, site_states=dict(privacy_states),
        )
    except TooFewSitesError as err:
        raise TooFewSitesError(f"{err}. The outputs up to this round and its checkpoint are in {outputs.directory}; "
                               f"once the sites are back, continue with resume.from = '{outputs.directory}'") from err
    _write_results(cfg, dataset, num_sites, model, arrays, survival, ledger, outputs, time.perf_counter() - started,
                   resumed_after_round=resumed.last_round if resumed else 0, left_out=left_out)


def _write_results(
    cfg: ExperimentConfig, dataset: FederatedDataset | None, num_sites: int, model: SurvivalModel,
    arrays: ArrayRecord, strategy: SurvivalFedAvg, ledger: PrivacyLedger, outputs: RunOutputs, wall_time_s: float,
    *, resumed_after_round: int = 0, left_out: Mapping[int, str] | None = None,
) -> None:
    """Write the summary, the model and (with the pooled data of a simulation) calibration and the baseline.

    ``dataset`` is ``None`` in a deployment, where ``evaluation.server_side`` and
    ``baseline.centralized`` are off (checked by :func:`flwr_app.config.parse_run_config`).
    ``left_out``: the deployed sites left out at set-up, node ID -> why (``summary["left_out"]``).
    """
    last = strategy.rounds.get(cfg.federation.rounds)
    sites = dict(sorted(last.evaluate_sites.items())) if last else {}
    diverged = ""
    if cfg.server_evaluation:
        test, diverged = _evaluate_global(model, arrays, strategy, dataset)
        test_source = "global model on the pooled test split (server-side, simulation)"
    else:
        test = weighted_nanmean(sites)
        test_source = "weighted mean of the sites' own test metrics"
    summary: dict[str, Any] = {
        "test": {key: value for key, value in test.items() if not key.startswith("oot_")},
        "test_source": test_source,
        "sites": sites,
        "privacy": {key: value for key, value in ledger.headline().items() if key != "site"},
        "strategy": cfg.strategy,
        "data": cfg.data.name,
        "model": cfg.model.name,
        "num_sites": num_sites,
        "rounds": cfg.federation.rounds,
        "seed": cfg.seed,
        "wall_time_s": wall_time_s,
    }
    if left_out:
        summary["left_out"] = {f"node {node}": reason for node, reason in sorted(left_out.items())}
    if resumed_after_round:
        summary["resumed_after_round"] = resumed_after_round  # wall_time_s then counts the resumed part only
    oot = {key[4:]: value for key, value in test.items() if key.startswith("oot_")}
    if oot:
        summary["oot"] = oot
    if diverged:
        summary["diverged"] = diverged
    model.net.load_state_dict(arrays.to_torch_state_dict())
    model.net.eval()
    outputs.save_model(model.net.state_dict(), model=cfg.model.name, config=cfg.as_dict(),
                       baseline=strategy.baseline)
    if cfg.server_evaluation and not diverged:
        summary["calibration"] = task.calibration(model, dataset)
        plot_survival_vs_km(model, dataset, outputs.plot_path, title=f"{cfg.strategy} on {cfg.data.name}")
    if cfg.centralized_baseline:
        print("training the centralised baseline on the pooled training data ...", flush=True)
        summary["centralized"] = task.train_centralized(cfg, dataset)
    outputs.write_summary(summary)
    print(f"final test ({test_source}): {_fmt(summary['test'])}", flush=True)
    if summary["privacy"]["epsilon"] is not None:
        privacy = summary["privacy"]
        classical = (f"; classical epsilon of the same mechanism {privacy['epsilon_classical']:.4f}"
                     if "epsilon_classical" in privacy else "")
        if "epsilon_nominal" in privacy:
            classical += (f"; the paper's nominal epsilon {privacy['epsilon_nominal']:.4f}, its formula at the "
                          f"smallest noise {privacy['epsilon_audited_formula']:.4f}")
        print(f"privacy: epsilon {privacy['epsilon']:.4f} at delta {privacy['delta']:g} per {privacy['unit']} "
              f"(worst site; {privacy['accountant']}{classical}; assumptions in ledger.jsonl)", flush=True)
    if oot:
        print(f"final out-of-time: {_fmt(oot)}", flush=True)
    if "centralized" in summary:
        central = summary["centralized"]
        label = "no DP" if isinstance(central["privacy"], str) else (
            f"{cfg.strategy}, epsilon {central['privacy'].get('epsilon_mu', central['privacy']['epsilon']):.3f}")
        print(f"centralised baseline ({label}) test: {_fmt(central['test'])}", flush=True)
    print(f"outputs: {outputs.directory}", flush=True)
