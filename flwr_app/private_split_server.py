"""The label holder's side of strategy ``private_split``, over the split-learning transport.

:func:`run_private_split` reads top to bottom: align the sites' IDs with the labels, send every
site the public plan (and, for the ``score`` encoder, the training records' martingale
residuals), receive each training record's one release, train the head on the cached releases for
``federation.rounds`` epochs, receive each test record's one release, predict with
``split.mc_samples`` posterior samples of the head, and write the run's outputs and ledger. The
protocol and its accounting are :mod:`strategies.private_split`; the head is
:mod:`models.release_head`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from flwr_app import interrupt, vertical_task
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.outputs import RunOutputs
from flwr_app.vertical_server import FlowerSplitTransport, _fmt, _metrics, check_sites
from models.data.dictionary import DataDictionary
from models.data.vertical import VerticalTable, align_modalities
from models.multimodal import survival_band
from models.plots import plot_survival_bands
from models.release_head import fit_release_head, predict_release_head
from strategies.accounting.ledger import PrivacyLedger
from strategies.config import CENTRALIZED_LABEL
from strategies.mechanisms.base import delta_refusal
from strategies.mechanisms.embedding_dp import RECORD_LEVEL
from strategies.mechanisms.private_split import PrivateSplitDP
from strategies.mechanisms.registry import get_mechanism
from strategies.accounting.private_split import (
    NoisePlan,
    PrivateSplitPlan,
    plan_noise,
)
from strategies.private_split import (
    PrivateSplitSites,
    concatenate,
    martingale_residuals,
)
from strategies.split import SplitSiteError

__all__ = ["run_private_split"]


def _plan(cfg: ExperimentConfig, num_sites: int) -> tuple[PrivateSplitPlan, NoisePlan]:
    mechanism = get_mechanism(cfg.strategy)
    assert isinstance(mechanism, PrivateSplitDP)
    plan = mechanism.plan(cfg, num_sites=num_sites)
    try:
        return plan, plan_noise(plan)
    except ValueError as err:
        raise ConfigError(f"run config: {err}") from None


def _residuals(plan: PrivateSplitPlan, label_info: vertical_task.Labels) -> np.ndarray | None:
    """What the ``score`` encoder needs from the label holder: each training record's martingale residual."""
    if plan.encoder != "score":
        return None
    return martingale_residuals(label_info.train_time, label_info.train_event)


def _fit_head(cfg: ExperimentConfig, x: np.ndarray, label_info: vertical_task.Labels, on_epoch=None):
    return fit_release_head(torch.tensor(x), label_info.time_index, label_info.event,
                            num_durations=len(label_info.cuts), risk_layer=cfg.split.risk_layer,
                            bayesian=cfg.model.name == "bayesian_multisurv", lr=cfg.train.lr,
                            weight_decay=cfg.train.weight_decay, epochs=cfg.federation.rounds,
                            batch_size=cfg.train.batch_size, seed=cfg.seed, on_epoch=on_epoch)


def run_private_split(cfg: ExperimentConfig, transport: FlowerSplitTransport, outputs: RunOutputs, *,
                      table: VerticalTable | None = None, started: float | None = None) -> dict[str, Any]:
    """Run strategy ``private_split`` over ``transport``; write and return the summary.

    ``table`` holds the labels (in simulation the whole data set, which also computes the
    centralised twin when ``baseline.centralized``); default :func:`vertical_task.load_table`.
    """
    started = time.perf_counter() if started is None else started
    torch.set_num_threads(cfg.train.num_threads)
    table = vertical_task.load_table(cfg) if table is None else table
    modalities = vertical_task.modality_names(cfg, table)
    held = transport.hello()
    check_sites(held, modalities)
    present = align_modalities(table.ids, {name: held[name] for name in modalities})
    label_info = vertical_task.labels(cfg, table)
    mechanism = get_mechanism(cfg.strategy)
    assert isinstance(mechanism, PrivateSplitDP)
    if refusal := delta_refusal(cfg, mechanism, {"label holder": len(label_info.train_ids)}):
        raise ConfigError(refusal)  # before any site releases anything
    plan, noise = _plan(cfg, len(modalities))
    dictionary = DataDictionary.load(cfg.data.dictionary) if cfg.data.dictionary else None
    outputs.write_manifest(mechanism.manifest(cfg).as_dict())
    ledger = PrivacyLedger(outputs.ledger_path)
    train_ids = [str(i) for i in label_info.train_ids]
    test_ids = [str(i) for i in label_info.test_ids]
    print(f"fedsurv: private_split | {cfg.data.name} ({len(modalities)} modality sites: {', '.join(modalities)}; "
          f"{len(train_ids)} training / {len(test_ids)} test records, {int((~present).sum())} missing modality "
          f"entries) | encoder {plan.encoder}, {plan.release_noise} release"
          + (f" (scale {noise.release_scale:.4g}), epsilon {noise.epsilon:.4g} per record" if plan.private
             else ", no DP") + f" | head: {cfg.federation.rounds} epochs -> {outputs.directory}", flush=True)

    try:
        widths, site_notes = transport.private_setup(plan, train_ids, _residuals(plan, label_info), dictionary)
        x_train = concatenate(transport.private_release(train_ids), modalities)
    except SplitSiteError as err:
        for entry in mechanism.ledger_entries(cfg, plan, noise, {name: 1 for name in modalities}, round_=0):
            ledger.record(entry)  # an upper bound: a site may have released before the failure
        raise SplitSiteError(f"{err} (during the set-up and training release). The run stops; "
                             f"{outputs.ledger_path.name} in {outputs.directory} bounds the privacy spent") from err
    notes = tuple(f"site {name!r}: {note}" for name in modalities for note in site_notes[name])
    for note in notes:
        print(note, flush=True)
    released = {name: 1 for name in modalities}
    for entry in mechanism.ledger_entries(cfg, plan, noise, released, round_=0, notes=notes):
        ledger.record(entry)

    def on_epoch(epoch: int, loss: float) -> None:
        outputs.append_metrics({"round": epoch + 1, "train": {"loss": loss}, "privacy": ledger.headline(),
                                "elapsed_s": time.perf_counter() - started})
        if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == cfg.federation.rounds:
            print(f"epoch {epoch + 1:3d}/{cfg.federation.rounds}  loss per record {loss:.4f} (on the cached "
                  "releases: no new release)", flush=True)
        interrupt.raise_if_requested(epoch + 1, of=cfg.federation.rounds, directory=outputs.directory,
                                     resumable=False, unit="epoch")

    head, losses = _fit_head(cfg, x_train, label_info, on_epoch)
    try:
        x_test = concatenate(transport.private_release(test_ids), modalities)
    except SplitSiteError as err:
        raise SplitSiteError(f"{err} (during the test release). The run stops; {outputs.ledger_path.name} holds "
                             "the privacy spent (each record at most once per site)") from err
    final = mechanism.ledger_entries(cfg, plan, noise, released, round_=cfg.federation.rounds, notes=notes)
    for entry in final:
        ledger.record(entry)
    logits = predict_release_head(head, torch.tensor(x_test), passes=cfg.split.mc_samples, seed=cfg.seed)
    mean, lower, upper = survival_band(logits)
    test = _metrics(label_info, mean.numpy(), time_=label_info.test_time, event=label_info.test_event)
    headline = {key: value for key, value in ledger.headline().items() if key != "site"}
    summary: dict[str, Any] = {
        "test": test,
        "test_source": f"mean survival of {cfg.split.mc_samples} posterior samples of the label holder's head on "
                       "each test record's one release",
        "band_width": float((upper - lower).mean()),
        "privacy": headline,
        "privacy_sites": {entry.site: {"epsilon": entry.epsilon, "releases_max": float(entry.steps),
                                       "epsilon_paper": None} for entry in final if entry.site != RECORD_LEVEL},
        "noise": {"setup_multiplier": noise.setup_multiplier, "fit_multiplier": noise.fit_multiplier,
                  "release_scale": noise.release_scale, "epsilon_before_release": noise.epsilon_before_release},
        "strategy": cfg.strategy, "data": {"name": cfg.data.name}, "model": cfg.model.name,
        "modalities": list(modalities), "widths": widths, "setup_notes": list(notes), "encoder": plan.encoder,
        "release_noise": plan.release_noise, "epochs": cfg.federation.rounds, "seed": cfg.seed,
        "train_loss": losses,
    }
    torch.save({"head": head.state_dict(), "cuts": label_info.cuts, "config": cfg.as_dict(),
                "modalities": modalities, "widths": widths}, outputs.model_path)
    np.savez_compressed(outputs.directory / "survival_bands.npz", ids=np.asarray(test_ids, dtype=str),
                        cuts=label_info.cuts, mean=mean.numpy(), lower=lower.numpy(), upper=upper.numpy())
    plot_survival_bands(label_info.cuts, mean.numpy(), lower.numpy(), upper.numpy(),
                        outputs.directory / "survival_bands.png", labels=test_ids,
                        title=f"private_split on {cfg.data.name}: 95% band over {cfg.split.mc_samples} samples",
                        time_unit=cfg.data.time_unit)
    summary["wall_time_s"] = time.perf_counter() - started
    if cfg.centralized_baseline:
        print("computing the centralised twin (the same protocol, seeds and noise in one process) ...", flush=True)
        summary["centralized"] = centralized_twin(cfg, table, label_info, plan, noise, dictionary)
    outputs.write_summary(summary)
    print(f"final test: {_fmt(test)}  (95% band width {summary['band_width']:.4f})", flush=True)
    if headline["epsilon"] is not None and math.isfinite(headline["epsilon"]):
        print(f"privacy: epsilon {headline['epsilon']:.4f} at delta {headline['delta']:g} per record over all "
              f"modalities ({headline['accountant']}; assumptions in ledger.jsonl)", flush=True)
    if "centralized" in summary:
        print(f"centralised twin ({summary['centralized']['mechanism']}) test: {_fmt(summary['centralized']['test'])}",
              flush=True)
    print(f"outputs: {outputs.directory}", flush=True)
    return summary


def centralized_twin(cfg: ExperimentConfig, table: VerticalTable, label_info: vertical_task.Labels,
                     plan: PrivateSplitPlan, noise: NoisePlan, dictionary: DataDictionary | None = None,
                     ) -> dict[str, Any]:
    """The same protocol with every site in this process (:class:`strategies.private_split.PrivateSplitSites`).

    Same plan, noise, noise seeds, head and seeds: its figures equal the run's
    (``tests/test_private_split_run.py``), which shows that the transport changes nothing.
    """
    modalities = tuple(table.modalities)
    sites = PrivateSplitSites(plan, noise,
                              {name: (table.modalities[name], table.categorical.get(name, ())) for name in modalities},
                              noise_seed=vertical_task.simulation_noise_seed(cfg), dictionary=dictionary)
    residuals = _residuals(plan, label_info)
    train_ids = [str(i) for i in label_info.train_ids]
    sites.fit(train_ids, None if residuals is None else dict(zip(train_ids, residuals.tolist())))
    head, _ = _fit_head(cfg, concatenate(sites.release(train_ids), modalities), label_info)
    x_test = concatenate(sites.release([str(i) for i in label_info.test_ids]), modalities)
    mean, lower, upper = survival_band(predict_release_head(head, torch.tensor(x_test), passes=cfg.split.mc_samples,
                                                            seed=cfg.seed))
    return {"test": _metrics(label_info, mean.numpy(), time_=label_info.test_time, event=label_info.test_event),
            "band_width": float((upper - lower).mean()), "label": CENTRALIZED_LABEL,
            "mechanism": "the same protocol in one process (same noise)" if plan.private else "none (no DP)"}
