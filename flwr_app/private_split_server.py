"""The label holder's side of strategy ``private_split``, over the split-learning transport.

:func:`run_private_split` reads top to bottom: align the sites' IDs with the labels, send every
site the public plan (and, for the ``score`` encoder, the training records' martingale
residuals), receive each training record's one release, train the head on the cached releases for
``federation.rounds`` epochs, receive each test record's one release, predict with
``split.mc_samples`` posterior samples of the head, and write the run's outputs and ledger: the
server program :func:`flwr_app.server_program.run_program` with :class:`PrivateSplitRun` plugged
in. The protocol and its accounting are :mod:`strategies.private_split`; the head is
:mod:`models.release_head`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flwr_app import vertical_task
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.outputs import RunOutputs
from flwr_app.server_program import end_of_epoch, run_program
from flwr_app.vertical_server import (FlowerSplitTransport, SplitSetting, _fmt, _metrics, opening_line, split_setting,
                                     write_bands)
from models.data.dictionary import DataDictionary
from models.data.vertical import VerticalTable
from models.multimodal import survival_band
from models.release_head import fit_release_head, predict_release_head
from strategies.accounting.ledger import PrivacyLedger
from strategies.config import CENTRALIZED_LABEL
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

__all__ = ["PrivateSplitRun", "run_private_split"]


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
    setting = split_setting(cfg, transport, table, PrivateSplitDP)
    return run_program(PrivateSplitRun(cfg, transport, outputs, setting, started), cfg, outputs, started=started)


class PrivateSplitRun:
    """Strategy ``private_split`` as a :class:`flwr_app.server_program.RunKind`: the sites' set-up and one release
    of each training record, the head trained for ``federation.rounds`` epochs on the cached releases, one release
    of each test record, ``split.mc_samples`` posterior samples of the head."""

    baseline_notice = "computing the centralised twin (the same protocol, seeds and noise in one process) ..."

    def __init__(self, cfg: ExperimentConfig, transport: FlowerSplitTransport, outputs: RunOutputs,
                 setting: SplitSetting, started: float) -> None:
        self.cfg, self.transport, self.outputs, self.setting, self.started = cfg, transport, outputs, setting, started
        self.mechanism: PrivateSplitDP = setting.mechanism
        self.plan, self.noise = _plan(cfg, len(setting.modalities))
        self.dictionary = DataDictionary.load(cfg.data.dictionary) if cfg.data.dictionary else None
        self.ledger = PrivacyLedger(outputs.ledger_path)
        self.modalities = setting.modalities
        self.train_ids = [str(i) for i in setting.label_info.train_ids]
        self.test_ids = [str(i) for i in setting.label_info.test_ids]

    def manifest(self) -> Any:
        return self.mechanism.manifest(self.cfg)

    def start(self) -> list[str]:
        plan, noise = self.plan, self.noise
        return [opening_line(self.cfg.strategy, self.cfg.data.name, self.setting, self.outputs,
                             f"encoder {plan.encoder}, {plan.release_noise} release"
                             + (f" (scale {noise.release_scale:.4g}), epsilon {noise.epsilon:.4g} per record"
                                if plan.private else ", no DP") + f" | head: {self.cfg.federation.rounds} epochs")]

    def train(self) -> None:
        cfg, plan, noise = self.cfg, self.plan, self.noise
        x_train = self._training_release()
        released = {name: 1 for name in self.modalities}
        for entry in self.mechanism.ledger_entries(cfg, plan, noise, released, round_=0, notes=self.notes):
            self.ledger.record(entry)
        self.head, self.losses = _fit_head(cfg, x_train, self.setting.label_info, self._on_epoch)
        try:
            x_test = concatenate(self.transport.private_release(self.test_ids), self.modalities)
        except SplitSiteError as err:
            raise SplitSiteError(f"{err} (during the test release). The run stops; {self.outputs.ledger_path.name} "
                                 "holds the privacy spent (each record at most once per site)") from err
        self.final = self.mechanism.ledger_entries(cfg, plan, noise, released, round_=cfg.federation.rounds,
                                                   notes=self.notes)
        for entry in self.final:
            self.ledger.record(entry)
        self.logits = predict_release_head(self.head, torch.tensor(x_test), passes=cfg.split.mc_samples,
                                           seed=cfg.seed)

    def _training_release(self) -> np.ndarray:
        """Send the sites the plan; receive each training record's one release (concatenated over the sites).
        Sets ``widths`` and ``notes`` (the sites' set-up notes, printed)."""
        cfg, plan, outputs = self.cfg, self.plan, self.outputs
        try:
            self.widths, site_notes = self.transport.private_setup(
                plan, self.train_ids, _residuals(plan, self.setting.label_info), self.dictionary)
            x_train = concatenate(self.transport.private_release(self.train_ids), self.modalities)
        except SplitSiteError as err:
            for entry in self.mechanism.ledger_entries(cfg, plan, self.noise, {name: 1 for name in self.modalities},
                                                       round_=0):
                self.ledger.record(entry)  # an upper bound: a site may have released before the failure
            raise SplitSiteError(f"{err} (during the set-up and training release). The run stops; "
                                 f"{outputs.ledger_path.name} in {outputs.directory} bounds the privacy spent") from err
        self.notes = tuple(f"site {name!r}: {note}" for name in self.modalities for note in site_notes[name])
        for note in self.notes:
            print(note, flush=True)
        return x_train

    def _on_epoch(self, epoch: int, loss: float) -> None:
        rounds = self.cfg.federation.rounds
        end_of_epoch(rounds, self.outputs, {"round": epoch + 1, "train": {"loss": loss},
                                            "privacy": self.ledger.headline(),
                                            "elapsed_s": time.perf_counter() - self.started},
                     f"epoch {epoch + 1:3d}/{rounds}  loss per record {loss:.4f} (on the cached releases: no new "
                     "release)" if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == rounds else None)

    def results(self) -> dict[str, Any]:
        """Write the head and the test records' survival bands."""
        cfg, plan, noise, label_info = self.cfg, self.plan, self.noise, self.setting.label_info
        torch.save({"head": self.head.state_dict(), "cuts": label_info.cuts, "config": cfg.as_dict(),
                    "modalities": self.modalities, "widths": self.widths}, self.outputs.model_path)
        bands = write_bands(cfg.data.time_unit, self.outputs, label_info, self.logits,
                            f"private_split on {cfg.data.name}: 95% band over {cfg.split.mc_samples} samples")
        return {
            "test": bands["test"],
            "test_source": f"mean survival of {cfg.split.mc_samples} posterior samples of the label holder's head on "
                           "each test record's one release",
            "band_width": bands["band_width"],
            "privacy": {key: value for key, value in self.ledger.headline().items() if key != "site"},
            "privacy_sites": {entry.site: {"epsilon": entry.epsilon, "releases_max": float(entry.steps),
                                           "epsilon_paper": None}
                              for entry in self.final if entry.site != RECORD_LEVEL},
            "noise": {"setup_multiplier": noise.setup_multiplier, "fit_multiplier": noise.fit_multiplier,
                      "release_scale": noise.release_scale, "epsilon_before_release": noise.epsilon_before_release},
            "strategy": cfg.strategy, "data": {"name": cfg.data.name}, "model": cfg.model.name,
            "modalities": list(self.modalities), "widths": self.widths, "setup_notes": list(self.notes),
            "encoder": plan.encoder, "release_noise": plan.release_noise, "epochs": cfg.federation.rounds,
            "seed": cfg.seed, "train_loss": self.losses,
        }

    def centralized(self) -> dict[str, Any]:
        return centralized_twin(self.cfg, self.setting.table, self.setting.label_info, self.plan, self.noise,
                                self.dictionary)

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        headline = summary["privacy"]
        lines = [f"final test: {_fmt(summary['test'])}  (95% band width {summary['band_width']:.4f})"]
        if headline["epsilon"] is not None and math.isfinite(headline["epsilon"]):
            lines.append(f"privacy: epsilon {headline['epsilon']:.4f} at delta {headline['delta']:g} per record over "
                         f"all modalities ({headline['accountant']}; assumptions in ledger.jsonl)")
        if "centralized" in summary:
            lines.append(f"centralised twin ({summary['centralized']['mechanism']}) test: "
                         f"{_fmt(summary['centralized']['test'])}")
        return lines


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
                              noise_seed=vertical_task.simulation_noise_seed(cfg.seed), dictionary=dictionary)
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
