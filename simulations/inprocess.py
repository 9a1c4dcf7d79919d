"""Federations as in-process loops, for repetition-heavy reproductions and fast tests.

Horizontal:
:func:`run_federation` runs exactly the steps of the ServerApp and ClientApp of a horizontal
run — the same data, model, seeds, local training (``flwr_app.task``), privacy mechanism,
site-ordered weighted averaging (Flower's own ``aggregate_arrayrecords``) and federated Breslow
baseline — without Flower's messaging and Ray. Tests check that it reproduces a Flower
simulation's final model and privacy figures and the sites' evaluation; the reproduction scripts
use it to run hundreds of repetitions on a laptop, and the benchmarks as the bare loop the Flower
path is measured against. It does not replace the Flower path for users: it has no fault
handling, no per-round outputs and no deployment.

Any strategy: :func:`run_inprocess` runs the ServerApp and the ClientApp themselves, messages
included, over :class:`InProcessGrid` (a Flower ``Grid`` whose nodes are ClientApp calls in this
process) instead of Ray: fault handling, per-round outputs, checkpoints and resumption are the
ServerApp's own. Tests of those use it (seconds instead of a Ray start per run).

Vertical: :class:`LocalSplitTransport` holds the simulated modality sites as objects and
:func:`run_vertical_inprocess` runs the ServerApp's own :func:`flwr_app.vertical_server.run_vertical`
over it, outputs and ledger included; a test checks that it reproduces a Flower simulation of
the same run.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from dataclasses import asdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from uuid import uuid4

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from flwr_app import client_app, server_app, task, vertical_task
from flwr_app.config import ConfigError, ExperimentConfig
from flwr_app.outputs import RunOutputs
from flwr_app.vertical_server import EmbeddingAudit, run_vertical
from models.data import FederatedDataset
from models.survival import SurvivalModel
from simulations.engine import resolve
from strategies.horizontal import WEIGHT_KEY, weighted_nanmean
from strategies.mechanisms.registry import get_mechanism, horizontal_mechanism
from strategies.split import LocalSites, PredictRequest, SiteConfig, SiteReply, SiteRequest, SplitSite

__all__ = ["InProcessGrid", "LocalSplitTransport", "run_federation", "run_inprocess", "run_vertical_inprocess"]

RUN_ID = 1

_METRICS = ("c_index", "c_index_td", "ibs", "inbll")


def _set_federated_baseline(model: SurvivalModel, dataset: FederatedDataset) -> None:
    """The Breslow baseline from every site's ``(d_k, R_k)``, summed in site order (Cox models only)."""
    event_counts, risk_sums = None, None
    for site in sorted(dataset.sites, key=lambda site: site.name):
        counts, sums = model.breslow_aggregates(site.train.x, site.train.time, site.train.event)
        counts, sums = np.asarray(counts, dtype=np.float64), np.asarray(sums, dtype=np.float64)
        event_counts = counts if event_counts is None else event_counts + counts
        risk_sums = sums if risk_sums is None else risk_sums + sums
    model.set_baseline(event_counts, risk_sums)


def _evaluate(model: SurvivalModel, dataset: FederatedDataset, *, concordance_td: bool) -> tuple[dict[str, float], str]:
    """Federated Breslow baseline (Cox models) and pooled test metrics; NaN and why if diverged."""
    if not all(bool(torch.isfinite(value).all()) for value in model.net.state_dict().values()):
        return dict.fromkeys(_METRICS, math.nan), "diverged: non-finite weights"
    try:
        if model.needs_baseline:
            _set_federated_baseline(model, dataset)
        return task.evaluate(model, dataset.pooled("test"), concordance_td=concordance_td), ""
    except ValueError as err:  # e.g. risks that overflow to inf or underflow to an empty risk set
        return dict.fromkeys(_METRICS, math.nan), f"diverged: {err}"


def run_federation(cfg: ExperimentConfig, *, concordance_td: bool = True, evaluate_sites: bool = False) -> dict[str, Any]:
    """Train ``cfg``'s federation for ``federation.rounds`` rounds in process; evaluate at the end.

    Every site trains in every round (``federation.fraction_train`` must be 1). With
    ``concordance_td=False`` the O(n²) Antolini C-index is skipped (NaN). With
    ``evaluate_sites=True`` every site also evaluates the global model on its own test part after
    every round, as the ClientApp does in a Flower run (the benchmarks' bare reference does the
    same work as the Flower path); ``sites_mean`` is then the test-size-weighted mean of the last
    round's site metrics, and without ``evaluation.server_side`` it is also ``test`` (as in the
    ServerApp's summary; the pooled test split is then not evaluated).

    Returns
    -------
    dict
        ``test``: metrics of the final global model on the pooled test split (as the ServerApp's
        server-side evaluation; NaN, with the reason in ``error``, when the model diverged, e.g.
        non-finite weights or risks that overflow); ``privacy``: the worst site's last ledger entry
        (as the ServerApp writes it), or ``None`` without DP; ``state_dict``: the final global weights;
        ``sites_mean`` (with ``evaluate_sites``).
    """
    if cfg.federation.fraction_train != 1.0:
        raise ValueError("run_federation trains every site in every round: set federation.fraction_train = 1")
    mechanism = horizontal_mechanism(cfg.strategy)
    if mechanism.server_side:
        raise ValueError(f"run_federation does not run strategy {cfg.strategy!r} (a server-side mechanism)")
    dataset = task.load_federation(cfg)
    model = task.build_model(cfg, dataset)
    setups = task.federation_setup(cfg).setups
    global_arrays = ArrayRecord(model.net.state_dict())
    order = sorted(range(dataset.num_sites), key=lambda index: dataset.sites[index].name)
    states: dict[int, dict | None] = dict.fromkeys(order)
    reports: dict[str, list[dict[str, float]]] = {dataset.sites[index].name: [] for index in order}
    for server_round in range(1, cfg.federation.rounds + 1):
        replies = []
        for index in order:
            site = dataset.sites[index]
            model.net.load_state_dict(global_arrays.to_torch_state_dict())
            update = mechanism.site_round(model, site.train, cfg, seed=task.round_seed(cfg.seed, server_round, index),
                                          state=states[index], setup=setups[site.name])
            states[index] = update.state
            reports[site.name].append(update.report)
            if update.contributes:
                replies.append(RecordDict({"arrays": ArrayRecord(model.net.state_dict()), "metrics": MetricRecord(
                    {WEIGHT_KEY: mechanism.aggregation_weight(setups[site.name])})}))
        if replies:
            global_arrays = aggregate_arrayrecords(replies, WEIGHT_KEY)
        if evaluate_sites:
            site_metrics = _evaluate_sites(model, global_arrays, dataset, concordance_td=concordance_td)
    model.net.load_state_dict(global_arrays.to_torch_state_dict())
    if evaluate_sites and not cfg.server_evaluation:  # as the ServerApp's summary: the sites' figures only
        test, error = site_metrics, ""
    else:
        test, error = _evaluate(model, dataset, concordance_td=concordance_td)
    entries = [mechanism.ledger_entry(cfg, cfg.federation.rounds, site, setup=setups[site], reports=site_reports)
               for site, site_reports in reports.items()]
    privacy = None
    if mechanism.private:
        privacy = asdict(max(entries, key=lambda entry: math.inf if entry.epsilon is None else entry.epsilon))
    result = {"test": test, "error": error, "privacy": privacy,
              "state_dict": {key: value.clone() for key, value in model.net.state_dict().items()}}
    if evaluate_sites:
        result["sites_mean"] = site_metrics
    return result


def _evaluate_sites(model: SurvivalModel, arrays: ArrayRecord, dataset: FederatedDataset, *,
                    concordance_td: bool) -> dict[str, float]:
    """Every site's metrics of the global model on its own test part, weighted by test size (as the ServerApp averages them)."""
    model.net.load_state_dict(arrays.to_torch_state_dict())
    if model.needs_baseline:
        _set_federated_baseline(model, dataset)
    return weighted_nanmean({site.name: {**task.evaluate(model, site.test, concordance_td=concordance_td),
                                         WEIGHT_KEY: len(site.test)} for site in dataset.sites})


class InProcessGrid(Grid):
    """A Flower ``Grid`` whose nodes are calls of ``client_app`` in this process (simulated sites).

    Node ``i + 1`` is partition ``i`` (node config ``partition-id``, ``num-partitions``) with its
    own ``context.state``, which, as in Flower's simulation engine, changes only when the ClientApp
    returns; a ClientApp that raises gives an error reply (worded as Flower's) and leaves the node
    state as it was. Messages run one at a time in the order
    given, each in a thread that is waited for up to ``timeout`` seconds (the real sites run in
    parallel, each within the round's timeout); a ClientApp that has not returned by then gives no
    reply and keeps running in its daemon thread, as a hung site would.

    ``observe(message, reply)``, when given, sees every message and the reply it got (audits that
    need what the server received, e.g. the sites' updates; tests of what a site was sent).
    ``node_configs`` replaces the simulated partitions with the given node configs (a deployment's
    ``data-path`` per site, ``data.name = "site_files"``), node ``i + 1`` getting ``node_configs[i]``.
    """

    def __init__(self, app: ClientApp, run_config: Mapping[str, Any], num_nodes: int, *,
                 observe: Callable[[Message, Message], None] | None = None,
                 node_configs: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.app = app
        self.observe = observe
        self._run = Run.create_empty(run_id=RUN_ID)
        if node_configs is None:
            node_configs = [{PARTITION_ID_KEY: index, NUM_PARTITIONS_KEY: num_nodes} for index in range(num_nodes)]
        elif len(node_configs) != num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        self.contexts = {
            node: Context(run_id=RUN_ID, node_id=node, node_config=dict(config), state=RecordDict(),
                          run_config=dict(run_config))
            for node, config in enumerate(node_configs, start=1)
        }
        self.replies: dict[str, Message] = {}
        self.timeout: float | None = None
        self.observer_error: Exception | None = None
        self._lock = threading.Lock()

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _deliver(self, message: Message) -> None:
        """Run the node's ClientApp on ``message``; keep its reply (or error) and, on success, its node state."""
        node = message.metadata.dst_node_id
        stored = self.contexts[node]
        context = Context(run_id=stored.run_id, node_id=node, node_config=stored.node_config,
                          state=copy.deepcopy(stored.state), run_config=stored.run_config)
        try:
            reply = self.app(message, context)
            with self._lock:
                stored.state = context.state
        except Exception as err:  # as Flower's simulation engine: every exception becomes an error reply
            wrapped = ClientAppException(str(err))
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(wrapped)}:<'{wrapped}'>"),
                            reply_to=message)
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        if self.observe is not None:
            try:
                self.observe(message, reply)
            except Exception as err:  # an observer's bug must fail the run, not leave the server waiting
                self.observer_error = err
        with self._lock:
            self.replies[message.metadata.message_id] = reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message in turn, waiting up to :attr:`timeout` seconds for its ClientApp."""
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"no node {message.metadata.dst_node_id} in this in-process federation")
            message.metadata.__dict__["_message_id"] = str(uuid4())
            worker = threading.Thread(target=self._deliver, args=(message,), daemon=True)
            worker.start()
            worker.join(self.timeout)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._lock:
            return [self.replies.pop(message_id) for message_id in message_ids if message_id in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        self.timeout = timeout
        replies = self.pull_messages(self.push_messages(messages))
        if self.observer_error is not None:
            raise RuntimeError(f"the observer of InProcessGrid raised: {self.observer_error!r}") from self.observer_error
        return replies


def run_inprocess(overrides: Mapping[str, Any], *, observe: Callable[[Message, Message], None] | None = None,
                  node_configs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Run one experiment with the ServerApp and ClientApp over :class:`InProcessGrid`; return its summary.

    ``observe`` and ``node_configs`` (one node per entry: a deployment's sites, each reading its
    own file) are passed to :class:`InProcessGrid`.

    The run config is fused and validated as :func:`simulations.engine.run_simulation` does, with
    one node per site (split: per modality). Whatever the ServerApp raises (a failed run) propagates.
    """
    fused, cfg = resolve(overrides)
    if not cfg.output_dir and not cfg.resume_from:
        raise ConfigError("run_inprocess needs 'output.dir' (or 'resume.from') so that it can read the run's summary")
    if node_configs is not None:
        num_nodes = len(node_configs)
    elif get_mechanism(cfg.strategy).vertical:
        num_nodes = len(vertical_task.load_table(cfg).modalities)
    else:
        num_nodes = task.load_federation(cfg).num_sites
    outputs = RunOutputs.create(cfg)  # refuses a directory that holds another run, as the ServerApp does
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, RUN_ID, SUPERLINK_NODE_ID
    grid = InProcessGrid(client_app.app, fused, num_nodes, observe=observe, node_configs=node_configs)
    server_app.app(grid, Context(run_id=RUN_ID, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                                 run_config=fused))
    return json.loads(outputs.summary_path.read_text(encoding="utf-8"))


class LocalSplitTransport:
    """The simulated modality sites of ``cfg`` as objects in this process (partition ``i`` = modality ``i``)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.data = [vertical_task.simulated_site(cfg, index)
                     for index in range(len(vertical_task.load_table(cfg).modalities))]
        self.sites = LocalSites({})
        self.round_trips = 0

    def hello(self) -> dict[str, list[str]]:
        return {data.modality: [str(i) for i in data.features.index[data.features.notna().any(axis=1).to_numpy()]]
                for data in self.data}

    def setup(self, configs: dict[str, SiteConfig]) -> None:
        by_modality = {data.modality: data for data in self.data}
        self.sites = LocalSites({
            name: SplitSite(config, by_modality[name].features, by_modality[name].categorical,
                            noise_base_seed=by_modality[name].noise_base_seed, source=by_modality[name].source)
            for name, config in configs.items()})

    def exchange(self, requests: dict[str, SiteRequest]) -> dict[str, SiteReply]:
        self.round_trips += 1
        return self.sites(requests)

    def predict(self, requests: dict[str, PredictRequest]) -> dict[str, SiteReply]:
        return self.sites.predict(requests)


def run_vertical_inprocess(cfg: ExperimentConfig, *, audit: EmbeddingAudit | None = None) -> dict[str, Any]:
    """Run ``cfg`` (strategy ``split``) with the ServerApp's code over :class:`LocalSplitTransport`."""
    if not get_mechanism(cfg.strategy).vertical:
        raise ValueError("run_vertical_inprocess runs the split-learning protocol (strategy 'split')")
    outputs = RunOutputs.create(cfg)
    outputs.write_config(cfg, {})
    return run_vertical(cfg, LocalSplitTransport(cfg), outputs, audit=audit)
