"""The label holder's side of a vertical run (strategy ``split``), over any transport.

:func:`run_vertical` is what the ServerApp runs for ``strategy.name = "split"``: it asks every
site which modality and record IDs it holds, checks the alignment, sends each site its
configuration (the training IDs, the architecture, the embedding noise σ), trains the split model
with one round trip per batch (:func:`strategies.split.run_split_training`), predicts the test
records with ``split.mc_samples`` stochastic passes, asks every site to keep its trained encoder
on its own disk (``split_save``: where its node config sets ``model-dir``), and writes the run's
outputs (its own part of the model, the fusion head, in ``model.pt``) and privacy ledger: the
server program :func:`flwr_app.server_program.run_program` with :class:`SplitRun` plugged in
(:func:`split_setting`, :func:`opening_line` and :func:`write_bands` are shared with
:mod:`flwr_app.private_split_server`). The transport is :class:`FlowerSplitTransport`: Flower
messages through the grid (Flower's simulation engine, the in-process grid of
:mod:`simulations.engine`, or a deployment's SuperLink).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from flwr_app import deployment
from flwr_app import split_messages as wire
from flwr_app import vertical_task
from flwr_app.config import ExperimentConfig
from flwr_app.outputs import RunOutputs
from flwr_app.server_program import end_of_epoch, run_program
from models.data.dictionary import DataDictionary
from models.data.vertical import VerticalTable, align_modalities
from models.metrics import evaluate_survival, restricted_mean_survival_time
from models.multimodal import build_multisurv, survival_band
from models.multimodal_training import MultimodalData, fit_transforms, modality_inputs, predict_multisurv, train_multisurv
from models.plots import plot_survival_bands
from strategies.accounting.ledger import PrivacyLedger
from strategies.config import CENTRALIZED_LABEL, ConfigError
from strategies.mechanisms.base import Mechanism, delta_refusal
from strategies.mechanisms.embedding_dp import EmbeddingDP, embedding_epsilon
from strategies.mechanisms.registry import get_mechanism
from strategies.accounting.private_split import PrivateSplitPlan
from strategies.replies import check_embeddings, error_message
from strategies.split import (
    PredictRequest,
    SiteConfig,
    SiteReply,
    SiteRequest,
    SplitSiteError,
    embedding_hook,
    paper_epsilon,
    predict_split,
    run_split_training,
)

__all__ = ["FlowerSplitTransport", "SplitRun", "SplitSetting", "SplitTransport", "check_sites", "opening_line",
           "run_vertical", "split_setting", "write_bands"]


class SplitTransport(Protocol):
    """How the label holder reaches the modality sites."""

    round_trips: int

    def hello(self) -> dict[str, list[str]]:
        """Each site's modality and the record IDs it holds."""

    def setup(self, configs: Mapping[str, SiteConfig]) -> None:
        """Send every site its configuration (it builds its encoder)."""

    def exchange(self, requests: Mapping[str, SiteRequest]) -> dict[str, SiteReply]:
        """One training round trip with every site."""

    def predict(self, requests: Mapping[str, PredictRequest]) -> dict[str, SiteReply]:
        """Prediction passes at every site."""

    def save(self, run_token: str) -> dict[str, bool]:
        """Ask every site to keep its trained part on its own disk; which did (:mod:`models.split_run`)."""


class FlowerSplitTransport:
    """The protocol over Flower messages: one message per site per round trip, sent in parallel.

    A site that replies with an error, does not reply within ``timeout`` seconds, or sends a
    reply the server refuses (another modality's name, embeddings of the wrong shape or not
    finite, a malformed presence mask: :func:`strategies.replies.check_embeddings`) stops the run
    with :class:`strategies.split.SplitSiteError` naming its modality, node and reason
    (:func:`run_vertical` adds the epoch): every site holds a part of each record.

    ``deployed``: the grid reaches real SuperNodes, whose replies are looked for every 0.1 s
    (:func:`flwr_app.deployment.exchange`; Flower's deployed grid looks every 3 s, once per batch round trip).
    """

    def __init__(self, grid: Grid, *, timeout: float | None = 600.0, deployed: bool = False) -> None:
        self.grid = grid
        self.timeout = timeout
        self.deployed = deployed
        self.nodes: dict[str, int] = {}
        self.round_trips = 0
        self.dim = 0
        self.configs: dict[str, SiteConfig] = {}
        self.requested: dict[str, collections.Counter[str]] = {}
        self.widths: dict[str, int] = {}
        self.released_any: dict[str, bool] = {}

    def _send(self, message_type: str, contents: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        messages = [Message(content=content, dst_node_id=node, message_type=message_type)
                    for node, content in contents.items()]
        replies = (deployment.exchange(self.grid, messages, timeout=self.timeout) if self.deployed
                   else list(self.grid.send_and_receive(messages, timeout=self.timeout)))
        names = {node: name for name, node in self.nodes.items()}
        received: dict[int, RecordDict] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                raise SplitSiteError(f"site {names.get(node, '?')!r} (node {node}) failed on {message_type}: "
                                     f"{error_message(reply.error.reason)}")
            received[node] = reply.content
        silent = [f"{names.get(node, '?')!r} (node {node})" for node in contents if node not in received]
        if silent:
            raise SplitSiteError(f"sites {', '.join(silent)} did not answer {message_type} within {self.timeout} s")
        return received

    def hello(self) -> dict[str, list[str]]:
        replies = self._send(wire.HELLO, {node: RecordDict() for node in self.grid.get_node_ids()})
        held: dict[str, list[str]] = {}
        for node, content in sorted(replies.items()):
            modality, ids = wire.decode_hello_reply(content)
            if modality in self.nodes:
                raise SplitSiteError(f"nodes {self.nodes[modality]} and {node} both hold modality {modality!r}")
            self.nodes[modality] = node
            held[modality] = ids
        return held

    def _by_modality(self, message_type: str, contents: Mapping[str, RecordDict]) -> dict[str, RecordDict]:
        unknown = [name for name in contents if name not in self.nodes]
        if unknown:
            raise SplitSiteError(f"no site holds modality {unknown}")
        replies = self._send(message_type, {self.nodes[name]: content for name, content in contents.items()})
        return {name: replies[self.nodes[name]] for name in contents}

    def setup(self, configs: Mapping[str, SiteConfig]) -> None:
        self.dim = next(iter(configs.values())).dim
        self.configs = dict(configs)
        self.requested = {name: collections.Counter() for name in configs}
        self._by_modality(wire.SETUP, {name: wire.encode_setup(config) for name, config in configs.items()})

    def exchange(self, requests: Mapping[str, SiteRequest]) -> dict[str, SiteReply]:
        self.round_trips += 1
        replies = self._by_modality(wire.STEP, {name: wire.encode_request(r) for name, r in requests.items()})
        return {name: self._checked(name, content, wire.STEP, requests[name].forward_ids or [], None)
                for name, content in replies.items()}

    def predict(self, requests: Mapping[str, PredictRequest]) -> dict[str, SiteReply]:
        replies = self._by_modality(wire.PREDICT, {name: wire.encode_predict(r) for name, r in requests.items()})
        return {name: self._checked(name, content, wire.PREDICT, requests[name].ids, requests[name].passes,
                                    noisy=not requests[name].clean)
                for name, content in replies.items()}

    def save(self, run_token: str) -> dict[str, bool]:
        """Every site's answer to the save request: True where it wrote its encoder (its node config sets
        ``model-dir``); a reply naming another modality or carrying anything but the modality is refused."""
        replies = self._by_modality(wire.SAVE, {name: wire.encode_save(run_token) for name in self.nodes})
        saved = {}
        for name, reply in replies.items():
            modality = self._decoded(name, wire.decode_save_reply, reply, "save")
            if modality is not None and modality != name:
                raise SplitSiteError(f"site {name!r} (node {self.nodes[name]}) sent a refused save reply: the reply "
                                     f"claims modality {modality!r}")
            saved[name] = modality is not None
        return saved

    # ------------------------------------------------------------------ private_split

    def private_setup(self, plan: PrivateSplitPlan, train_ids: list[str], residuals: np.ndarray | None,
                      dictionary: DataDictionary | None = None) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
        """Send every site the plan, the public data dictionary (and the residuals); returns each site's
        embedding width and its set-up's notes (the columns its fallbacks settled or left out)."""
        content = wire.encode_private_setup
        replies = self._by_modality(wire.PRIVATE_SETUP, {name: content(plan, name, train_ids, residuals, dictionary)
                                                         for name in self.nodes})
        widths, notes = {}, {}
        for name, reply in replies.items():
            modality, width, notes[name] = self._decoded(name, wire.decode_private_setup_reply, reply, "set-up")
            if modality != name or width < 1:
                raise SplitSiteError(f"site {name!r} (node {self.nodes[name]}) sent a refused set-up reply: "
                                     f"modality {modality!r}, width {width}")
            widths[name] = width
        self.widths = widths
        return widths, notes

    def private_release(self, ids: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every site's one release of ``ids``, checked: shape, finite values, a release count of 1."""
        replies = self._by_modality(wire.PRIVATE_RELEASE, {name: wire.encode_private_release(ids)
                                                           for name in self.nodes})
        released = {}
        for name, reply in replies.items():
            modality, embeddings, present, privacy = self._decoded(name, wire.decode_private_release_reply, reply,
                                                                   "release")
            reason = (f"the reply claims modality {modality!r}" if modality != name else
                      check_embeddings(embeddings, present, rows=len(ids), dim=self.widths[name], passes=None))
            released_before = self.released_any.get(name, False) or bool(present.any())
            if not reason and privacy.get("releases_max") != (1.0 if released_before else 0.0):
                reason = (f"the privacy report counts {privacy.get('releases_max')!r} releases of a record; each "
                          "record leaves a site once")
            if reason:
                raise SplitSiteError(f"site {name!r} (node {self.nodes[name]}) sent a refused release reply: {reason}")
            released[name] = (embeddings, present)
            self.released_any[name] = released_before
        return released

    def _decoded(self, name: str, decode: Callable[[RecordDict], Any], content: RecordDict, kind: str) -> Any:
        """``decode(content)`` of site ``name``'s reply; a reply it cannot read stops the run naming the site."""
        try:
            return decode(content)
        except (KeyError, TypeError, ValueError) as err:
            raise SplitSiteError(f"site {name!r} (node {self.nodes[name]}) sent an unreadable {kind} reply: "
                                 f"{err}") from None

    def _checked(self, name: str, content: RecordDict, message_type: str, ids: list[str], passes: int | None, *,
                 noisy: bool = True) -> SiteReply:
        """The decoded reply of site ``name``, checked (:func:`strategies.replies.check_embeddings`), and its
        privacy report checked against the server's own count of the releases it asked for."""
        rows = len(ids)
        node = self.nodes[name]
        modality, reply = self._decoded(name, wire.decode_reply, content, message_type)
        reason = (f"the reply claims modality {modality!r}" if modality != name else
                  check_embeddings(reply.embeddings, reply.present, rows=rows, dim=self.dim, passes=passes))
        if not reason and name in self.configs:
            if noisy:
                self.requested[name].update(str(i) for i, held in zip(ids, reply.present, strict=True) if held
                                            for _ in range(passes or 1))
            reason = _report_problem(self.configs[name], reply.privacy, max(self.requested[name].values(), default=0))
        if reason:
            raise SplitSiteError(f"site {name!r} (node {node}) sent a refused {message_type} reply: {reason}")
        return reply


def check_sites(held: Mapping[str, list[str]], modalities: tuple[str, ...]) -> None:
    """Refuse a federation without exactly one site per modality (``held``: the sites' hello replies)."""
    unexpected = sorted(set(held) - set(modalities))
    absent = [name for name in modalities if name not in held]
    if unexpected or absent:
        raise SplitSiteError(f"the run needs one site per modality {list(modalities)}; "
                             f"{'no site holds ' + str(absent) if absent else ''}"
                             f"{'; unexpected sites ' + str(unexpected) if unexpected else ''}")


def _report_problem(config: SiteConfig, report: Mapping[str, float], releases: int) -> str:
    """Why a split site's privacy report is not what its configuration and the server's requests give ("" if it is).

    The server counts every release it asked the site for (per record it holds); the site's
    ``releases_max`` and noise multiplier must be those, and its ε the RDP figure of them.
    """
    if report.get("releases_max") != releases:
        return (f"the privacy report counts {report.get('releases_max')!r} releases of its most released record; "
                f"the server asked for {releases}")
    if report.get("noise_multiplier") != config.noise_multiplier:
        return (f"the privacy report's noise multiplier {report.get('noise_multiplier')!r} is not the configured "
                f"{config.noise_multiplier:g}")
    if releases and config.noise_multiplier > 0:
        expected = embedding_epsilon(noise_multiplier=config.noise_multiplier, epochs=releases, delta=config.delta,
                                     adjacency=config.adjacency)
        if not math.isclose(float(report.get("epsilon", math.nan)), expected, rel_tol=1e-6):
            return f"the privacy report's epsilon {report.get('epsilon')!r} does not match {expected:.6g}"
    return ""


def _upper_bound_reports(configs: Mapping[str, SiteConfig], releases: int) -> dict[str, dict[str, float]]:
    """Every site's privacy position as if each record had been released ``releases`` times.

    A run that stops during an epoch (or during prediction) may have released records more often
    than its last ledger entries say, and the replies of the failed round trip are lost; counting
    the most releases any record can have had by then bounds what was released, the failed site
    included.
    """
    return {name: {"epsilon": math.inf if config.noise_multiplier == 0 else embedding_epsilon(
                       noise_multiplier=config.noise_multiplier, epochs=releases, delta=config.delta,
                       adjacency=config.adjacency),
                   "epsilon_paper": paper_epsilon(config), "releases_max": float(releases),
                   "noise_multiplier": config.noise_multiplier}
            for name, config in configs.items()}


def _metrics(label_info: vertical_task.Labels, survival: np.ndarray, *, time_: np.ndarray, event: np.ndarray,
             concordance_td: bool = True) -> dict[str, float]:
    """The label holder's test metrics, scored as a horizontal site scores its own (:func:`flwr_app.task.evaluate`:
    the IPCW censoring of the evaluated records themselves)."""
    return evaluate_survival(label_info.cuts, survival, time=time_, event=event,
                             risk=-restricted_mean_survival_time(label_info.cuts, survival),
                             concordance_td=concordance_td)


def _save_site_models(transport: SplitTransport, run_token: str) -> dict[str, str]:
    """Ask every site to keep its trained encoder (:meth:`SplitTransport.save`); what each did, for the summary.

    A site that fails to save does not fail the trained run: the summary and the printed line say so.
    """
    try:
        saved = transport.save(run_token)
    except SplitSiteError as err:
        print(f"fedsurv: the sites' encoders may not all be saved: {err}", flush=True)
        return {"error": str(err)}
    return {name: "saved in its model-dir" if done else "not saved (no model-dir in its node config)"
            for name, done in sorted(saved.items())}


def _fmt(metrics: Mapping[str, float]) -> str:
    return "  ".join(f"{key} {value:.4f}" for key, value in metrics.items() if math.isfinite(value))


@dataclasses.dataclass
class SplitSetting:
    """What a split run (``split`` or ``private_split``) agreed with its sites before anything is released: the
    table with the labels, the modalities (one site each), which records each site holds (``present``), the label
    holder's split and time grid, and the strategy's mechanism."""

    table: VerticalTable
    modalities: tuple[str, ...]
    present: np.ndarray
    label_info: vertical_task.Labels
    mechanism: Mechanism


def split_setting(cfg: ExperimentConfig, transport: SplitTransport, table: VerticalTable | None,
                  mechanism_type: type) -> SplitSetting:
    """Ask the sites what they hold, check one site per modality and the alignment, and refuse a ``privacy.delta``
    above what the label holder's training records allow (``ConfigError``), before any site releases anything.

    ``table`` holds the labels (default :func:`vertical_task.load_table`); ``mechanism_type``: the class the
    strategy's mechanism must be.
    """
    torch.set_num_threads(cfg.train.num_threads)
    table = vertical_task.load_table(cfg) if table is None else table
    modalities = vertical_task.modality_names(cfg.data.deployed, cfg.split.modalities, table)
    held = transport.hello()
    check_sites(held, modalities)
    present = align_modalities(table.ids, {name: held[name] for name in modalities})
    label_info = vertical_task.labels(cfg, table)
    mechanism = get_mechanism(cfg.strategy)
    assert isinstance(mechanism, mechanism_type)
    if refusal := delta_refusal(cfg, mechanism, {"label holder": len(label_info.train_ids)}):
        raise ConfigError(refusal)  # before any site releases anything
    return SplitSetting(table, modalities, present, label_info, mechanism)


def opening_line(strategy: str, data_name: str, setting: SplitSetting, outputs: RunOutputs, method: str) -> str:
    """A split run's first console line (the run's ``strategy`` on data set ``data_name``); ``method``: what the sites
    release, and how noisy."""
    labels = setting.label_info
    return (f"fedsurv: {strategy} | {data_name} ({len(setting.modalities)} modality sites: "
            f"{', '.join(setting.modalities)}; {len(labels.train_ids)} training / {len(labels.test_ids)} test records, "
            f"{int((~setting.present).sum())} missing modality entries) | {method} -> {outputs.directory}")


def write_bands(time_unit: str, outputs: RunOutputs, label_info: vertical_task.Labels, logits: torch.Tensor,
                title: str) -> dict[str, Any]:
    """Score the test records' survival band (``logits``: passes × records × intervals), write it
    (``survival_bands.npz``, ``survival_bands.png`` with times in ``time_unit``); return the summary's ``test`` and
    ``band_width``."""
    mean, lower, upper = survival_band(logits)
    ids = [str(i) for i in label_info.test_ids]
    np.savez_compressed(outputs.directory / "survival_bands.npz", ids=np.asarray(ids, dtype=str),
                        cuts=label_info.cuts, mean=mean.numpy(), lower=lower.numpy(), upper=upper.numpy())
    plot_survival_bands(label_info.cuts, mean.numpy(), lower.numpy(), upper.numpy(),
                        outputs.directory / "survival_bands.png", labels=ids, title=title,
                        time_unit=time_unit)
    return {"test": _metrics(label_info, mean.numpy(), time_=label_info.test_time, event=label_info.test_event),
            "band_width": float((upper - lower).mean())}


def run_vertical(cfg: ExperimentConfig, transport: SplitTransport, outputs: RunOutputs, *,
                 table: VerticalTable | None = None, started: float | None = None) -> dict[str, Any]:
    """Train and evaluate the split model over ``transport``; write and return the summary.

    ``table`` holds the labels (in simulation the whole data set, which also trains the
    centralised twin when ``baseline.centralized``; in a deployment the labels file
    ``data.labels_path`` only); default :func:`vertical_task.load_table`.
    """
    started = time.perf_counter() if started is None else started
    setting = split_setting(cfg, transport, table, EmbeddingDP)
    return run_program(SplitRun(cfg, transport, outputs, setting, started), cfg, outputs, started=started)


class SplitRun:
    """Strategy ``split`` as a :class:`flwr_app.server_program.RunKind`: one round trip per batch for
    ``federation.rounds`` epochs, then ``split.mc_samples`` prediction passes over the test records."""

    baseline_notice = "training the centralised twin (same network, seeds and embedding mechanism) ..."

    def __init__(self, cfg: ExperimentConfig, transport: SplitTransport, outputs: RunOutputs, setting: SplitSetting,
                 started: float) -> None:
        self.cfg, self.transport, self.outputs, self.setting, self.started = cfg, transport, outputs, setting, started
        self.mechanism: EmbeddingDP = setting.mechanism
        self.ledger = PrivacyLedger(outputs.ledger_path)
        self.completed_epochs = 0

    def manifest(self) -> Any:
        return self.mechanism.manifest(self.cfg)

    def start(self) -> list[str]:
        """Calibrate the embedding noise and send every site its configuration."""
        cfg, setting = self.cfg, self.setting
        self.noise_multiplier = self.mechanism.noise_multiplier(cfg, num_modalities=len(setting.modalities),
                                                                num_train=len(setting.label_info.train_ids))
        self.site_configs = {name: vertical_task.site_config(cfg, name, setting.label_info, self.noise_multiplier)
                             for name in setting.modalities}
        self.transport.setup(self.site_configs)
        self.server = vertical_task.server(cfg, setting.modalities, setting.label_info)
        noise = (f" | embedding noise sigma {self.noise_multiplier:.4g} ({cfg.split.calibration})"
                 if cfg.privacy.enabled else " | no DP")
        return [opening_line(cfg.strategy, cfg.data.name, setting, self.outputs,
                             f"{cfg.model.name} | {cfg.federation.rounds} epochs{noise}")]

    def train(self) -> None:
        """Train, then predict the test records; a site's failure stops the run with the ledger bounding what
        was released."""
        cfg = self.cfg
        try:
            self.history = run_split_training(self.server, self.transport.exchange, epochs=cfg.federation.rounds,
                                              batch_size=cfg.train.batch_size, on_epoch=self._on_epoch)
            self.logits, self.reports = predict_split(self.server, self.transport.predict,
                                                      list(self.setting.label_info.test_ids),
                                                      passes=cfg.split.mc_samples, clean=cfg.split.clean_inference)
        except SplitSiteError as err:
            raise self._stopped(err) from err
        for entry in self.mechanism.ledger_entries(cfg, cfg.federation.rounds, self.reports, self.noise_multiplier):
            self.ledger.record(entry)

    def _on_epoch(self, epoch: int, info: dict[str, Any]) -> None:
        cfg, label_info = self.cfg, self.setting.label_info
        self.completed_epochs = epoch + 1
        for entry in self.mechanism.ledger_entries(cfg, epoch + 1, info["privacy"], self.noise_multiplier):
            self.ledger.record(entry)
        positions = info["positions"].numpy()
        survival = torch.cumprod(1.0 - torch.sigmoid(info["logits"]), dim=1).numpy()
        train = _metrics(label_info, survival, time_=label_info.train_time[positions],
                         event=label_info.train_event[positions], concordance_td=False)
        line = {"round": epoch + 1, "train": {"loss": info["loss"], **train}, "privacy": self.ledger.headline(),
                "round_trips": self.transport.round_trips, "elapsed_s": time.perf_counter() - self.started}
        epsilon = line["privacy"]["epsilon"]
        end_of_epoch(cfg.federation.rounds, self.outputs, line,
                     f"epoch {epoch + 1:3d}/{cfg.federation.rounds}  loss {info['loss']:.4f}  training (as seen while "
                     f"training): c_index {train['c_index']:.4f}" + (f"  epsilon {epsilon:.3f}" if epsilon is not None
                                                                     else ""))

    def _stopped(self, err: SplitSiteError) -> SplitSiteError:
        """Record an upper bound of what was released up to ``err`` (every site holds a part of each record:
        without one the split model cannot go on); the error that stops the run."""
        cfg, completed_epochs = self.cfg, self.completed_epochs
        training = completed_epochs < cfg.federation.rounds
        during = f"epoch {completed_epochs + 1} of {cfg.federation.rounds}" if training else "prediction"
        # A record is released once per epoch at each site (and a test record once per prediction pass); the
        # round trip that ends an epoch also carries the next epoch's first batch.
        releases = min(completed_epochs + 2, cfg.federation.rounds) if training else max(
            completed_epochs, 0 if cfg.split.clean_inference else cfg.split.mc_samples)
        note = (f"the run stopped during {during} ({err}): this entry bounds what was released by counting "
                f"{releases} release(s) of every record at every site")
        for entry in self.mechanism.ledger_entries(cfg, min(completed_epochs + 1, cfg.federation.rounds),
                                                   _upper_bound_reports(self.site_configs, releases),
                                                   self.noise_multiplier):
            self.ledger.record(dataclasses.replace(entry, assumptions=entry.assumptions + (note,)))
        outputs = self.outputs
        return SplitSiteError(f"{err} (during {during}). The run stops: {outputs.metrics_path.name} in "
                              f"{outputs.directory} holds epochs 1 to {completed_epochs}, {outputs.ledger_path.name} "
                              f"the privacy spent up to the failure (an upper bound); no model or summary was "
                              "written")

    def results(self) -> dict[str, Any]:
        """Ask the sites to keep their encoders; write the fusion head and the test records' survival bands."""
        cfg, label_info, history = self.cfg, self.setting.label_info, self.history
        round_trips = self.transport.round_trips
        run_token = uuid.uuid4().hex
        site_models = _save_site_models(self.transport, run_token)
        # Tensors, strings and numbers only: models.split_run.load_split_run reads it with
        # torch.load(weights_only=True).
        torch.save({"fusion_head": self.server.fusion_head.state_dict(),
                    "cuts": torch.as_tensor(np.asarray(label_info.cuts, dtype=np.float64)), "config": cfg.as_dict(),
                    "modalities": self.setting.modalities, "run_token": run_token}, self.outputs.model_path)
        bands = write_bands(cfg.data.time_unit, self.outputs, label_info, self.logits,
                            f"split {cfg.model.name} on {cfg.data.name}: 95% band over {cfg.split.mc_samples} passes")
        return {
            "test": bands["test"],
            "test_source": f"mean survival of {cfg.split.mc_samples} stochastic passes on the label holder's test "
                           "split",
            "band_width": bands["band_width"],
            "privacy": {key: value for key, value in self.ledger.headline().items() if key != "site"},
            "privacy_sites": {name: dict(report) for name, report in sorted(self.reports.items())},
            "noise_multiplier": self.noise_multiplier,
            "calibration": cfg.split.calibration if cfg.privacy.enabled else None,
            "strategy": cfg.strategy, "data": {"name": cfg.data.name}, "model": cfg.model.name,
            "modalities": list(self.setting.modalities), "epochs": cfg.federation.rounds, "seed": cfg.seed,
            "batches": history.batches, "round_trips": round_trips,
            "round_trips_per_batch": round_trips / max(history.batches, 1),
            "train_loss": history.epoch_loss,
            "site_models": site_models,
        }

    def centralized(self) -> dict[str, Any]:
        return train_centralized_twin(self.cfg, self.setting.table, self.setting.label_info, self.noise_multiplier)

    def final_lines(self, summary: Mapping[str, Any]) -> list[str]:
        headline = summary["privacy"]
        lines = [f"final test: {_fmt(summary['test'])}  (95% band width {summary['band_width']:.4f}; "
                 f"{summary['round_trips']} round trips for {summary['batches']} batches)"]
        if headline["epsilon"] is not None:
            lines.append(f"privacy: epsilon {headline['epsilon']:.4f} at delta {headline['delta']:g} per record over "
                         f"all modalities ({headline['accountant']}; the paper's formula would claim "
                         f"{headline.get('epsilon_nominal', math.nan):.4f} per site; assumptions in ledger.jsonl)")
        if "centralized" in summary:
            lines.append(f"centralised twin ({CENTRALIZED_LABEL}) test: {_fmt(summary['centralized']['test'])}")
        return lines


def train_centralized_twin(cfg: ExperimentConfig, table: VerticalTable, label_info: vertical_task.Labels,
                           noise_multiplier: float) -> dict[str, Any]:
    """The same network, seeds, batches and embedding mechanism trained on the pooled modalities.

    Its figures equal the split run's up to floating-point error (the protocol computes exactly
    the centralised steps; ``tests/test_split.py``): the comparison shows that the split itself
    costs nothing, and any gap between them is numerical.
    """
    transforms = fit_transforms(table, label_info.train_ids)
    inputs, present = modality_inputs(table, label_info.train_ids, transforms)
    data = MultimodalData(inputs, present, label_info.time_index, label_info.event)
    model = build_multisurv({name: t.input_shape for name, t in transforms.items()}, seed=cfg.seed,
                            bayesian=cfg.model.name == "bayesian_multisurv", dim=cfg.split.embedding_dim,
                            num_durations=len(label_info.cuts), encoder_layers=cfg.split.encoder_layers,
                            head_layers=cfg.split.head_layers, dropout=cfg.split.dropout,
                            risk_layer=cfg.split.risk_layer)
    hook = (embedding_hook(noise_base_seed=vertical_task.simulation_noise_seed(cfg.seed),
                           clip_norm=cfg.privacy.clip_norm, noise_multiplier=noise_multiplier)
            if cfg.privacy.enabled else None)
    train_multisurv(model, data, epochs=cfg.federation.rounds, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
                    weight_decay=cfg.train.weight_decay, seed=cfg.seed, similarity_weight=cfg.split.similarity_weight,
                    hook=hook)
    test_inputs, test_present = modality_inputs(table, label_info.test_ids, transforms)
    clean_hook = None
    if cfg.privacy.enabled and cfg.split.clean_inference:
        clean_hook = embedding_hook(noise_base_seed=0, clip_norm=cfg.privacy.clip_norm, noise_multiplier=0.0)
    logits = predict_multisurv(model, test_inputs, test_present, passes=cfg.split.mc_samples, seed=cfg.seed,
                               hook=clean_hook if cfg.split.clean_inference else hook)
    mean, lower, upper = survival_band(logits)
    return {"test": _metrics(label_info, mean.numpy(), time_=label_info.test_time, event=label_info.test_event),
            "band_width": float((upper - lower).mean()),
            "label": CENTRALIZED_LABEL,
            "mechanism": "the split run's embedding noise (same sigma)" if cfg.privacy.enabled else "none (no DP)"}
