"""ClientApp: one site of a horizontal federation, or one modality site of a vertical one.

Message handling only: decode the global model, call the training / evaluation code in
``flwr_app.task``, encode the reply. Which records a node holds comes from its node config:
``partition-id`` (simulation) selects one site of the run's federated data set; in a deployment
(``data.name = "site_files"``) ``data-path`` names the site's own file, and the set-up messages
(``*.site_*``) are handled by :mod:`flwr_app.deployment`. The split-learning messages
(``*.split_*``) are handled by :mod:`flwr_app.vertical_client`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_app import deployment, site_policy, task, vertical_client
from flwr_app.config import ExperimentConfig, parse_run_config
from flwr_app.faults import inject_failure, tamper
from models.data import SiteData
from strategies.horizontal import (
    BASELINE_EVENTS,
    BASELINE_RISK,
    PRIVACY_STATE_KEY,
    RECALIBRATION_EXPONENTS,
    RECALIBRATION_HORIZONS,
    RESUMED_CATCH_UP,
    RESUMED_PRIVACY_STATE,
    SITE_KEY,
    UNDEFINED_KEY,
    WEIGHT_KEY,
)
from models.recalibration import power_sums
from strategies import secure_aggregation as secagg
from strategies.mechanisms.base import (
    HorizontalMechanism,
    LocalUpdateMechanism,
    SecureSumMechanism,
    SiteSetUp,
    recalibration_history,
    recalibration_multiplier,
)
from strategies.mechanisms.setup_statistics import RECALIBRATION_QUANTILES
from strategies.mechanisms.registry import horizontal_mechanism

app = ClientApp()
PRIVACY_STATE = deployment.PRIVACY_STATE
#: Node state of a secure-aggregation round: the site's protocol state, and the round's public figures.
SECAGG_STATE = "secagg.state"
SECAGG_ROUND = "secagg.round"
app.query("split_hello")(vertical_client.hello)
app.train("split_setup")(vertical_client.setup)
app.train("split_step")(vertical_client.step)
app.query("split_predict")(vertical_client.predict)
app.query("split_save")(vertical_client.save)
app.train("private_split_setup")(vertical_client.private_setup)
app.query("private_split_release")(vertical_client.private_release)
app.query("site_summary")(deployment.summary)
app.query("site_time_histogram")(deployment.histogram)
app.query("setup_ranges")(deployment.setup_ranges)
app.query("setup_moments")(deployment.setup_moments)
app.train("site_setup")(deployment.setup)
app.query("setup_site_name")(deployment.identity)


def _site(context: Context) -> tuple[SiteData, int]:
    """The node's site and its index in the seeds (simulation: ``partition-id``; deployment: the node ID)."""
    cfg = parse_run_config(context.run_config)
    if cfg.data.deployed:
        return deployment.deployed_site(cfg, context), context.node_id
    dataset = task.load_federation(cfg)
    if "partition-id" not in context.node_config:
        raise ValueError("node config has no 'partition-id': cannot tell which site this node is")
    index = int(context.node_config["partition-id"])
    if not 0 <= index < dataset.num_sites:
        raise ValueError(
            f"node config partition-id {index} is outside the federation's {dataset.num_sites} sites "
            f"({dataset.source}, partition '{cfg.federation.partition}'): run with num-supernodes = "
            f"{dataset.num_sites}"
        )
    return dataset.sites[index], index


def _model(context: Context, message: Message):
    cfg = parse_run_config(context.run_config)
    if cfg.data.deployed:
        model = task.model_from_spec(cfg, deployment.stored_spec(context))
    else:
        model = task.build_model(cfg, task.load_federation(cfg))
    model.net.load_state_dict(message.content["arrays"].to_torch_state_dict())
    return cfg, model


def _reply(message: Message, content: RecordDict, cfg: ExperimentConfig, site: SiteData, server_round: int,
           kind: str) -> Message:
    """The reply to ``message`` (tampered with only when ``debug.fail_mode`` makes this site hostile)."""
    return Message(content=tamper(cfg, content, site=site.name, server_round=server_round, message=kind),
                   reply_to=message)


def _content(site: SiteData, metrics: dict[str, float], arrays: ArrayRecord | None = None, *,
             privacy_state: str | None = None, undefined: dict[str, str] | None = None) -> RecordDict:
    site_record = ConfigRecord({"name": site.name})
    if undefined:
        site_record[UNDEFINED_KEY] = json.dumps(undefined)
    if privacy_state is not None:
        site_record[PRIVACY_STATE_KEY] = privacy_state
    content = RecordDict({"metrics": MetricRecord(metrics), SITE_KEY: site_record})
    if arrays is not None:
        content["arrays"] = arrays
    return content


def _privacy_state(context: Context, config: ConfigRecord) -> dict | None:
    """The site's privacy state: its node state, else (a resumed run, whose node states start empty) the checkpoint's."""
    stored = context.state.config_records.get(PRIVACY_STATE)
    if stored is not None:
        return json.loads(str(stored["json"]))
    if RESUMED_PRIVACY_STATE in config:
        return json.loads(str(config[RESUMED_PRIVACY_STATE]))
    return None


def _caught_up(context: Context, config: ConfigRecord, cfg: ExperimentConfig, mechanism: LocalUpdateMechanism,
               model: Any, site: SiteData, setup: SiteSetUp, seed: int) -> dict | None:
    """The site's privacy state (:func:`_privacy_state`), with the rounds the server charged it while it held none.

    The server counts a round it asked the site for and got no reply to (or refused) as released (the
    update may have left); a state handed back to the site (a rejoined deployed site: in its node
    state; a resumed run, whose node states start empty: :data:`RESUMED_CATCH_UP` in the config) lacks
    those rounds. The site runs its mechanism's round that many times on a copy of the model,
    releasing nothing, so that its accountant charges them too (its reports then match the server's
    ledger and its budget stays as the ledger has it).
    """
    state = _privacy_state(context, config)
    pending = context.state.config_records.get(deployment.CATCH_UP_STATE)
    rounds = int(pending["rounds"]) if pending is not None else 0
    if pending is None and PRIVACY_STATE not in context.state.config_records and state is not None:
        rounds = int(config.get(RESUMED_CATCH_UP, 0))
    for _ in range(rounds):
        update = mechanism.site_round(copy.deepcopy(model), site.train, cfg, seed=seed, state=state, setup=setup)
        if update.state is None:  # a mechanism without a privacy state has nothing to catch up
            break
        state = update.state
    if pending is not None:
        del context.state[deployment.CATCH_UP_STATE]
    if rounds and state is not None:
        context.state[PRIVACY_STATE] = ConfigRecord({"json": json.dumps(state)})
    return state


def _setup(cfg: ExperimentConfig, context: Context, site: SiteData) -> SiteSetUp:
    """The site's set-up: its record count as agreed with the server, and the smallest agreed count."""
    if cfg.data.deployed:
        return deployment.stored_setup(context)
    return task.federation_setup(cfg).setups[site.name]


def _charge(context: Context, cfg: ExperimentConfig, site: SiteData, server_round: int, message: str, values: str,
            history: tuple[tuple[float, float, int], ...] | None) -> None:
    """Charge a release to the site's own privacy policy before it leaves (:mod:`flwr_app.site_policy`; a no-op
    without one): a refusal raises, and the reply becomes an error filed under the site's name."""
    site_policy.enforce(context.node_config, site.name, site_policy.Request(
        cfg.strategy, context.run_id, server_round, message, values, history))


def _training_message(message: Message, context: Context) -> tuple[SiteData, int, int, ExperimentConfig, Any,
                                                                  HorizontalMechanism]:
    """What a training message (plain or secure) starts with: the site, the round, the run config and the global
    model, the injected failure of a simulation test, the thread count and the run's mechanism."""
    site, index = _site(context)
    server_round = int(message.content["config"]["server-round"])
    cfg, model = _model(context, message)
    inject_failure(cfg, site=site.name, server_round=server_round, message="train")
    torch.set_num_threads(cfg.train.num_threads)
    return site, index, server_round, cfg, model, horizontal_mechanism(cfg.strategy)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of the run's mechanism on the site's training part, starting from the global model."""
    site, index, server_round, cfg, model, mechanism = _training_message(message, context)
    if not isinstance(mechanism, LocalUpdateMechanism):
        raise ValueError(f"strategy '{cfg.strategy}' sites answer the secure-aggregation messages, not 'train'")
    config = message.content["config"]
    setup = _setup(cfg, context, site)
    previous = _caught_up(context, config, cfg, mechanism, model, site, setup, task.site_seed(cfg, server_round, index))
    update = mechanism.site_round(model, site.train, cfg, seed=task.site_seed(cfg, server_round, index),
                                  state=previous, setup=setup)
    _charge(context, cfg, site, server_round, "train", "model update",
            mechanism.round_release(cfg, setup, update, previous))
    privacy_state = None
    if update.state is not None:
        # The site's accountant lives in its node state across rounds; the reply carries it too, so that the
        # server's checkpoint can give it back to a resumed run.
        privacy_state = json.dumps(update.state)
        context.state[PRIVACY_STATE] = ConfigRecord({"json": privacy_state})
    metrics = {**update.report, WEIGHT_KEY: setup.count if update.contributes else 0.0}
    content = _content(site, metrics, ArrayRecord(model.net.state_dict()), privacy_state=privacy_state)
    return _reply(message, content, cfg, site, server_round, "train")


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Test metrics of the global model on the site's own held-out part (computed from it alone); the reply
    carries no record count (the server weights the sites' metrics by their agreed counts)."""
    site, _ = _site(context)
    config = message.content["config"]
    server_round = int(config["server-round"])
    cfg, model = _model(context, message)
    inject_failure(cfg, site=site.name, server_round=server_round, message="evaluate")
    if model.needs_baseline:
        if BASELINE_EVENTS not in config:
            raise ValueError("Cox model evaluation needs the federated baseline hazard in the message")
        model.set_baseline(np.asarray(config[BASELINE_EVENTS]), np.asarray(config[BASELINE_RISK]))
    if RECALIBRATION_EXPONENTS in config:
        model.set_exponents(np.asarray(config[RECALIBRATION_EXPONENTS], dtype=np.float64))
    metrics = task.evaluate(model, site.test)
    undefined = task.undefined_metrics(model, site.test, metrics)
    if site.oot is not None and len(site.oot):
        oot = task.evaluate(model, site.oot)
        metrics.update({f"oot_{key}": value for key, value in oot.items()})
        undefined.update({f"oot_{key}": code for key, code in task.undefined_metrics(model, site.oot, oot).items()})
    # No record count: the server weights a site's test metrics by the count agreed at set-up (the held-out
    # count would reveal the site's size far more exactly than the set-up's noisy count does).
    return _reply(message, _content(site, metrics, undefined=undefined), cfg, site, server_round, "evaluate")


@app.query("site_name")
def site_name(message: Message, context: Context) -> Message:
    """Which site this node is (asked once, at the start of a run: the server names every node)."""
    site, _ = _site(context)
    return Message(content=_content(site, {}), reply_to=message)


@app.query("breslow")
def breslow(message: Message, context: Context) -> Message:
    """Sufficient statistics of the site's training part for the federated Breslow estimator."""
    site, _ = _site(context)
    server_round = int(message.content["config"]["server-round"])
    cfg, model = _model(context, message)
    inject_failure(cfg, site=site.name, server_round=server_round, message="breslow")
    _charge(context, cfg, site, server_round, "breslow", "Breslow aggregates", None)
    event_counts, risk_sums = model.breslow_aggregates(site.train.x, site.train.time, site.train.event)
    metrics = {"event_counts": event_counts.tolist(), "risk_sums": risk_sums.tolist()}
    return _reply(message, _content(site, metrics), cfg, site, server_round, "breslow")


#: Stream of a site's recalibration noise (beside its round's other draws from the same seed).
RECALIBRATION_STREAM = 23


@app.query("recalibration")
def recalibration(message: Message, context: Context) -> Message:
    """The site's noisy recalibration release: power sums of its training records' predicted survival at the
    plan's horizons (:func:`models.recalibration.power_sums`) plus Gaussian noise whose level the site takes
    from its own run config (:func:`~strategies.mechanisms.base.recalibration_multiplier`), never from the message."""
    site, index = _site(context)
    config = message.content["config"]
    server_round = int(config["server-round"])
    cfg, model = _model(context, message)
    inject_failure(cfg, site=site.name, server_round=server_round, message="recalibration")
    horizons = np.asarray(config[RECALIBRATION_HORIZONS], dtype=np.float64)
    multiplier = recalibration_multiplier(cfg)
    planned = horizons.ndim == 1 and 1 <= horizons.size <= len(RECALIBRATION_QUANTILES)
    if multiplier <= 0 or not planned or not np.all(np.isfinite(horizons)):
        raise ValueError("recalibration query refused: this run's config plans no recalibration release, or the "
                         f"horizons are not 1 to {len(RECALIBRATION_QUANTILES)} finite times ({horizons.tolist()})")
    _charge(context, cfg, site, server_round, "recalibration", "recalibration sums", recalibration_history(cfg))
    times, surv = model.predict_survival(site.train.x)
    at = np.clip(np.searchsorted(times, horizons, side="right") - 1, 0, times.size - 1)  # right-continuous steps
    sums = power_sums(surv[:, at]).ravel()
    rng = np.random.default_rng([task.site_seed(cfg, server_round, index), RECALIBRATION_STREAM])
    noisy = sums + rng.normal(0.0, multiplier * np.sqrt(sums.size), sums.size)
    return _reply(message, _content(site, {"power_sums": noisy.tolist()}), cfg, site, server_round, "recalibration")


# ------------------------------------------------------------------ secure aggregation (strategies with a secure sum)


def _secagg_reply(message: Message, values: dict) -> Message:
    return Message(content=RecordDict({secagg.RECORD: ConfigRecord(values)}), reply_to=message)


@app.query("secagg_setup")
def secagg_setup(message: Message, context: Context) -> Message:
    """Stage 0: fresh key pairs; the round's public figures (sites selected, their agreed records) are kept."""
    record = message.content[secagg.RECORD]
    state, keys = secagg.site_setup(context.node_id, record)
    context.state[SECAGG_STATE] = state.to_record()
    context.state[SECAGG_ROUND] = ConfigRecord({"parties": int(record["parties"]), "records": float(record["records"])})
    return _secagg_reply(message, keys)


@app.query("secagg_share_keys")
def secagg_share_keys(message: Message, context: Context) -> Message:
    """Stage 1: the mask seed and secret key shared among the neighbours, each share encrypted to its holder."""
    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    keys = {int(node): (pair[0], pair[1]) for node, pair in message.content[secagg.RECORD].items()}
    values = secagg.site_share_keys(state, keys)
    context.state[SECAGG_STATE] = state.to_record()
    return _secagg_reply(message, values)


@app.query("secagg_masked")
def secagg_masked(message: Message, context: Context) -> Message:
    """Stage 2: the site's contribution of the round (its mechanism's), masked; this is the site's training reply."""
    site, index, server_round, cfg, model, mechanism = _training_message(message, context)
    if not isinstance(mechanism, SecureSumMechanism):
        raise ValueError(f"strategy '{cfg.strategy}' has no secure sum: its sites answer 'train'")
    public = context.state.config_records[SECAGG_ROUND]
    plan = mechanism.plan(cfg, parties=int(public["parties"]), records=float(public["records"]),
                          dim=sum(p.numel() for p in model.net.parameters()), setup=_setup(cfg, context, site))
    _charge(context, cfg, site, server_round, "train", "masked contribution", None)
    vector = mechanism.contribution(model, site.train, cfg, plan, seed=task.site_seed(cfg, server_round, index))
    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    record = message.content[secagg.RECORD]
    masked = secagg.site_mask(state, record["sources"], record["ciphertexts"], vector)
    context.state[SECAGG_STATE] = state.to_record()
    content = RecordDict({secagg.MASKED_ARRAY: secagg.masked_reply(masked), secagg.RECORD: ConfigRecord({})})
    return _reply(message, content, cfg, site, server_round, "train")


@app.query("secagg_unmask")
def secagg_unmask(message: Message, context: Context) -> Message:
    """Stage 3: shares of the surviving neighbours' mask seeds and of the dropped neighbours' secret keys."""
    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    record = message.content[secagg.RECORD]
    values = secagg.site_unmask(state, record["survivors"], record["dropped"])
    context.state[SECAGG_STATE] = state.to_record()
    return _secagg_reply(message, values)
