"""ClientApp: one site of a horizontal federation, or one modality site of a vertical one.

Message handling only: decode the global model, call the training / evaluation code in
``flwr_app.task``, encode the reply. Which records a node holds comes from its node config:
``partition-id`` (simulation) selects one site of the run's federated data set; in a deployment
(``data.name = "site_files"``) ``data-path`` names the site's own file, and the set-up messages
(``*.site_*``) are handled by :mod:`flwr_app.deployment`. The split-learning messages
(``*.split_*``) are handled by :mod:`flwr_app.vertical_client`, and the Cox regression messages (``query.cox_*``,
``model.name = "coxph"``) by :mod:`flwr_app.cox_client`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_app.config import ExperimentConfig, PrivacyConfig
from flwr_app.site_context import (PREPARED_ENTRIES, SECAGG_ROUND, SECAGG_STATE, Prepared, charge,
                                   node_site, own_honest_sites, run_config, site_setup, spec_json, tolerated_dropouts)
from flwr_app.site_errors import CARRIED_SETUP, recorded_messages, sanitised_errors
from strategies.config import COXPH

if TYPE_CHECKING:
    from models.data import SiteData
    from models.survival import SurvivalModel
    from strategies.mechanisms.base import HorizontalMechanism, LocalUpdateMechanism, SiteSetUp

# Everything heavy (torch, the data and model code, the mechanisms, the split-learning and set-up handlers) is
# imported where it is first used: in a deployment every message starts a new ``flwr-clientapp`` process, which
# then pays only for what its message needs (a training message never imports the metrics, the secure
# aggregation's cryptography or the split-learning code).



def carried_setup(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """ClientApp mod: a message that carries the deployment's agreed set-up (:data:`CARRIED_SETUP`, put there by
    :class:`flwr_app.deployment.RejoiningSites`) has it kept in the node state
    (:func:`flwr_app.deployment.store_setup`) before its handler runs (which reads only its own records)."""
    if message.has_content() and CARRIED_SETUP in message.content.config_records:
        from flwr_app import deployment

        deployment.store_setup(json.loads(str(message.content.config_records[CARRIED_SETUP]["json"])), context)
    return call_next(message, context)


# A deployed site records every message it handles at home, and its errors tell the server no detail.
app = ClientApp(mods=[recorded_messages, sanitised_errors, carried_setup])
#: Node state of a site's privacy accountant (:data:`flwr_app.deployment.PRIVACY_STATE`).
PRIVACY_STATE = "privacy.state"
#: Node state of the site's noise calibrations (:func:`strategies.mechanisms.dp_sgd.remembered_noise`).
NOISE_STATE = "noise.calibrations"


def _delegate(module: str, name: str) -> Callable[[Message, Context], Message]:
    """A handler that imports ``module`` when its first message arrives and calls its ``name``."""

    def handler(message: Message, context: Context) -> Message:
        return getattr(importlib.import_module(module), name)(message, context)

    handler.__name__ = handler.__qualname__ = f"_{module.rsplit('.', 1)[-1]}_{name}"
    handler.__doc__ = f"``{module}.{name}`` (imported with the first such message)."
    # A module attribute of that name: the simulation engine pickles the ClientApp with every message, and a
    # function that can be found by name pickles as its name.
    globals()[handler.__name__] = handler
    return handler


for _kind, _action, _module, _name in (
        ("query", "split_hello", "flwr_app.vertical_client", "hello"),
        ("train", "split_setup", "flwr_app.vertical_client", "setup"),
        ("train", "split_step", "flwr_app.vertical_client", "step"),
        ("query", "split_predict", "flwr_app.vertical_client", "predict"),
        ("query", "split_save", "flwr_app.vertical_client", "save"),
        ("train", "private_split_setup", "flwr_app.vertical_client", "private_setup"),
        ("query", "private_split_release", "flwr_app.vertical_client", "private_release"),
        ("query", "site_summary", "flwr_app.deployment", "summary"),
        ("query", "site_time_histogram", "flwr_app.deployment", "histogram"),
        ("query", "setup_ranges", "flwr_app.deployment", "setup_ranges"),
        ("query", "setup_moments", "flwr_app.deployment", "setup_moments"),
        ("query", "setup_site_name", "flwr_app.deployment", "identity"),
        ("query", "cox_moments", "flwr_app.cox_client", "moments"),
        ("query", "cox_event_times", "flwr_app.cox_client", "event_times"),
        ("query", "cox_sums", "flwr_app.cox_client", "sums"),
        ("query", "cox_meat", "flwr_app.cox_client", "meat"),
        ("query", "cox_schoenfeld", "flwr_app.cox_client", "schoenfeld"),
        ("query", "cox_dp_counts", "flwr_app.cox_client", "dp_counts"),
        ("query", "cox_dp_score", "flwr_app.cox_client", "dp_score"),
        ("query", "cox_dp_information", "flwr_app.cox_client", "dp_information")):
    getattr(app, _kind)(_action)(_delegate(_module, _name))


# ------------------------------------------------------------------ what a node keeps between messages
# (per process, not in Context.state: :mod:`flwr_app.site_context`)

#: Model skeletons (:class:`_Skeleton`) with their free copies.
MODELS = Prepared(PREPARED_ENTRIES)


class _Skeleton:
    """A run's model as built (never trained, never handed out) and the copies of it that no message holds now.

    A message takes a copy (:meth:`take`) and gives it back when its handler returns (:func:`_gives_back`): a
    process that serves its messages one after another copies the network once instead of building it for
    every message. A copy taken again is reset to the skeleton (everything :meth:`_reset` checks) before the
    message loads its global weights into it; one it cannot reset (a hook or an attribute left on the
    network) is dropped and a fresh copy made.
    """

    #: Free copies kept per skeleton (a process handles one message at a time; a hung one keeps its own).
    FREE = 2

    def __init__(self, model: SurvivalModel) -> None:
        self.model = model
        self.free: list[SurvivalModel] = []
        self.copies = 0  # copies made (tests count them)
        self._lock = threading.Lock()
        self._attributes = {name: value for name, value in vars(model).items() if name != "net"}
        self._modules = list(model.net.modules())
        self._parameters = list(model.net.parameters())
        persistent = model.net.state_dict().keys()
        self._transient = {name: buffer for name, buffer in model.net.named_buffers() if name not in persistent}

    def take(self) -> SurvivalModel:
        with self._lock:
            model = self.free.pop() if self.free else None
        if model is None or not self._reset(model):
            model = copy.deepcopy(self.model)
            with self._lock:
                self.copies += 1
        _held.__dict__.setdefault("models", []).append((self, model))
        return model

    def give_back(self, model: SurvivalModel) -> None:
        with self._lock:
            if len(self.free) < self.FREE:
                self.free.append(model)

    def _reset(self, model: SurvivalModel) -> bool:
        """Make a used copy the skeleton again but for its weights (which the message loads); False: drop it."""
        modules = list(model.net.modules())
        if len(modules) != len(self._modules):
            return False
        for module, original in zip(modules, self._modules, strict=True):
            if type(module) is not type(original) or vars(module).keys() != vars(original).keys():
                return False
            if any(getattr(module, hooks) for hooks in _HOOKS):
                return False
            vars(module)["training"] = original.training  # a plain flag: what Module.__setattr__ ends up doing
        parameters = list(model.net.parameters())
        if len(parameters) != len(self._parameters):
            return False
        for parameter, original in zip(parameters, self._parameters, strict=True):
            for name in set(vars(parameter)) - set(vars(original)):  # e.g. opacus' grad_sample
                delattr(parameter, name)
            parameter.grad = None
            parameter.requires_grad_(original.requires_grad)
        if self._transient:  # buffers the global weights do not carry
            for name, buffer in model.net.named_buffers():
                if name in self._transient:
                    buffer.data.copy_(self._transient[name])
        net = model.net
        vars(model).clear()
        vars(model).update({name: _fresh(value) for name, value in self._attributes.items()}, net=net)
        return True


def _fresh(value: Any) -> Any:
    """A copy of a skeleton's attribute for a model copy: ``copy.deepcopy``, a NumPy array's or a tensor's own copy
    (the same values, far cheaper; a deep copy does not share their memory either)."""
    import numpy as np
    import torch

    if type(value) is np.ndarray:
        return value.copy()
    if type(value) is torch.Tensor:
        return value.detach().clone()
    return copy.deepcopy(value)


#: A module's hook tables: a copy with any hook left in them is not reused.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks")
#: The model copies the current thread's message holds (given back when its handler returns).
_held = threading.local()


def _gives_back(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """``handler``, giving the model copies its message took back to their skeletons when it returns or raises."""

    @functools.wraps(handler)
    def wrapped(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        finally:
            for skeleton, model in _held.__dict__.pop("models", []):
                skeleton.give_back(model)

    return wrapped


def _skeleton(cfg: ExperimentConfig, context: Context) -> _Skeleton:
    """The run's model skeleton: simulation, one per run config; deployment, one per run config and set-up."""
    from flwr_app import task

    if cfg.data.deployed:
        from flwr_app import deployment

        spec = spec_json(context)
        return MODELS.get((cfg, spec), lambda: _Skeleton(task.model_from_spec(cfg, deployment.stored_spec(context))))
    return MODELS.get((cfg, None), lambda: _Skeleton(task.build_model(cfg, task.load_federation(cfg))))


def _model(context: Context, message: Message, cfg: ExperimentConfig | None = None):
    """The run config and the global model of ``message``: a copy of the run's model skeleton with its weights."""
    cfg = cfg or run_config(context)
    model = _skeleton(cfg, context).take()
    _load_weights(model.net, message.content["arrays"])
    return cfg, model


def _load_weights(net: Any, arrays: ArrayRecord) -> None:
    """``net.load_state_dict(arrays.to_torch_state_dict())``, copying each array's values straight into the network's
    own tensors (:func:`strategies.arrays.values`: no header parsed twice, no intermediate array or tensor per
    message); anything but matching NumPy arrays of the same names, dtypes and shapes takes ``load_state_dict``
    (and its errors)."""
    import numpy as np

    from strategies.arrays import values

    targets = net.state_dict()
    sources = []
    if targets.keys() == arrays.keys():
        for name, target in targets.items():
            array = arrays[name]
            if array.stype != "numpy.ndarray" or not target.is_contiguous() or target.device.type != "cpu":
                break
            source, own = values(array), target.numpy()
            if source.dtype != own.dtype or source.shape != own.shape:
                break
            sources.append((own, source))
        else:
            for own, source in sources:
                np.copyto(own, source)
            return
    net.load_state_dict(arrays.to_torch_state_dict())


def _reply(message: Message, content: RecordDict, cfg: ExperimentConfig, site: SiteData, server_round: int,
           kind: str) -> Message:
    """The reply to ``message`` (tampered with only when ``debug.fail_mode`` makes this site hostile)."""
    from flwr_app.faults import tamper

    return Message(content=tamper(cfg, content, site=site.name, server_round=server_round, message=kind),
                   reply_to=message)


def _content(site: SiteData, metrics: dict[str, float], arrays: ArrayRecord | None = None, *,
             privacy_state: str | None = None, undefined: dict[str, str] | None = None) -> RecordDict:
    from strategies.horizontal import PRIVACY_STATE_KEY, SITE_KEY, UNDEFINED_KEY

    site_record = ConfigRecord({"name": site.name})
    if undefined:
        site_record[UNDEFINED_KEY] = json.dumps(undefined)
    if privacy_state is not None:
        site_record[PRIVACY_STATE_KEY] = privacy_state
    content = RecordDict({"metrics": MetricRecord(metrics), SITE_KEY: site_record})
    if arrays is not None:
        content["arrays"] = arrays
    return content


def _recall_noise(context: Context) -> None:
    """Take the noise calibrations this site kept in its node state (a deployed site's every message is a new
    process; only its first one calibrates σ)."""
    from strategies.mechanisms import dp_sgd

    stored = context.state.config_records.get(NOISE_STATE)
    dp_sgd.remember_noise(None if stored is None else str(stored["json"]))


def _keep_noise(context: Context) -> None:
    """Keep the noise calibrations this message used in the site's node state, when they changed."""
    from strategies.mechanisms import dp_sgd

    text = dp_sgd.remembered_noise()
    stored = context.state.config_records.get(NOISE_STATE)
    if text != "[]" and (stored is None or str(stored["json"]) != text):
        context.state[NOISE_STATE] = ConfigRecord({"json": text})


def _privacy_state(context: Context, config: ConfigRecord, site: SiteData, server_round: int, *, deployed: bool,
                   rounds: int) -> tuple[dict | None, int]:
    """The site's privacy state and the rounds it still has to charge: its node state's (nothing to charge), else
    :func:`flwr_app.site_state.restore` (``deployed``: ``data.deployed``; at most ``rounds``: ``federation.rounds``)
    of its own copy or of the sealed state the server handed back (a restarted deployed site: in the set-up sent
    again; a resumed run, whose node states start empty: in the train config)."""
    from flwr_app import site_state
    from flwr_app.deployment import RETURNED_STATE
    from strategies.horizontal import RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE

    stored = context.state.config_records.get(PRIVACY_STATE)
    if stored is not None:
        return json.loads(str(stored["json"])), 0
    returned = context.state.config_records.get(RETURNED_STATE)
    if returned is not None:
        handed_back, catch_up = returned.get("json"), int(returned["catch_up"])
    else:
        handed_back, catch_up = config.get(RESUMED_PRIVACY_STATE), int(config.get(RESUMED_CATCH_UP, 0))
    return site_state.restore(context.node_config, deployed=deployed, site=site.name, run=context.run_id,
                              server_round=server_round, handed_back=None if handed_back is None else str(handed_back),
                              catch_up=catch_up, max_rounds=rounds)


def _caught_up(context: Context, config: ConfigRecord, cfg: ExperimentConfig, mechanism: LocalUpdateMechanism,
               model: Any, site: SiteData, setup: SiteSetUp, seed: int, server_round: int) -> dict | None:
    """The site's privacy state (:func:`_privacy_state`), with the rounds the server charged it after a state it
    handed back.

    The server counts a round it asked the site for and got no reply to (or refused) as released (the
    update may have left); a sealed state handed back lacks those rounds. The site runs its mechanism's
    round that many times (at most the rounds since the sealed state) on a copy of the model, releasing
    nothing, so that its accountant charges them too. The result is kept in the node state.
    """
    from flwr_app.deployment import RETURNED_STATE

    state, rounds = _privacy_state(context, config, site, server_round, deployed=cfg.data.deployed,
                                   rounds=cfg.federation.rounds)
    for _ in range(rounds):
        update = mechanism.site_round(copy.deepcopy(model), site.train, cfg, seed=seed, state=state, setup=setup)
        if update.state is None:  # a mechanism without a privacy state has nothing to catch up
            break
        state = update.state
    if RETURNED_STATE in context.state.config_records:
        del context.state[RETURNED_STATE]
    if state is not None and PRIVACY_STATE not in context.state.config_records:
        context.state[PRIVACY_STATE] = ConfigRecord({"json": json.dumps(state)})
    return state


def _keep_state(context: Context, deployed: bool, site: SiteData, server_round: int, state: dict) -> str:
    """Keep the site's new privacy state (node state; a ``deployed`` site's own directory too, before the reply
    leaves) and return it sealed for the reply (:func:`flwr_app.site_state.seal`)."""
    from flwr_app import site_state

    context.state[PRIVACY_STATE] = ConfigRecord({"json": json.dumps(state)})
    sealed = site_state.seal(state, key=site_state.state_key(context.node_config, deployed), site=site.name,
                             run=context.run_id, server_round=server_round)
    if deployed:
        site_state.save_own(context.node_config, sealed, context.run_id)
    return sealed


def _secure_sum_details(privacy: PrivacyConfig, context: Context, parties: int, counted: int) -> tuple:
    """What a policy site's ledger records of a secure-sum release: the honest sites it counts on (h), the shares
    it counted, the tolerated drop-outs (D, ``privacy.max_dropouts``), the colluding sites (t,
    ``privacy.colluding_sites``) and the parties the server reported."""
    own = own_honest_sites(context)
    return (("honest_sites", int(own[0]) if own else None), ("counted_shares", int(counted)),
            ("max_dropouts", privacy.max_dropouts), ("colluding_sites", privacy.colluding_sites),
            ("parties_reported", int(parties)))


def _message(message: Message, context: Context, kind: str) -> tuple[SiteData, int, int, ExperimentConfig, Any]:
    """What a message about the global model starts with: the site and its seed index, the round, the run config
    (parsed once for the whole message) and the global model; then the injected failure of a simulation test."""
    from flwr_app.faults import inject_failure

    cfg = run_config(context)
    if cfg.model.name == COXPH and cfg.strategy != "fedavg":
        raise ValueError(f"{kind} query refused: this run fits the private Cox model (model.name = {COXPH!r}, "
                         f"strategy {cfg.strategy!r}), whose sites release only its planned noisy sums "
                         "(query.cox_dp_*)")
    site, index = node_site(context, cfg)
    server_round = int(message.content["config"]["server-round"])
    _, model = _model(context, message, cfg)
    inject_failure(cfg, site=site.name, server_round=server_round, message=kind)
    return site, index, server_round, cfg, model


def _training_message(message: Message, context: Context) -> tuple[SiteData, int, int, ExperimentConfig, Any,
                                                                  HorizontalMechanism]:
    """What a training message (plain or secure) starts with: the site, the round, the run config and the global
    model, the injected failure of a simulation test, the thread count and the run's mechanism."""
    import torch

    from strategies.mechanisms.registry import horizontal_mechanism

    site, index, server_round, cfg, model = _message(message, context, "train")
    torch.set_num_threads(cfg.train.num_threads)
    return site, index, server_round, cfg, model, horizontal_mechanism(cfg.strategy)


@app.train()
@_gives_back
def train(message: Message, context: Context) -> Message:
    """One round of the run's mechanism on the site's training part, starting from the global model; first, when the
    message asks for it and the site's own run config plans it, the site's test metrics of that model or its Breslow
    sums (:func:`_carried`), in records of their own."""
    from flwr_app import task
    from strategies.arrays import array_record
    from strategies.horizontal import WEIGHT_KEY
    from strategies.mechanisms.base import LocalUpdateMechanism

    site, index, server_round, cfg, model, mechanism = _training_message(message, context)
    if not isinstance(mechanism, LocalUpdateMechanism):
        raise ValueError(f"strategy '{cfg.strategy}' sites answer the secure-aggregation messages, not 'train'")
    config = message.content["config"]
    carried = _carried(context, site, server_round, cfg, model, config)
    setup = site_setup(cfg, context, site)
    _recall_noise(context)
    previous = _caught_up(context, config, cfg, mechanism, model, site, setup, task.site_seed(cfg, server_round, index),
                          server_round)
    update = mechanism.site_round(model, site.train, cfg, seed=task.site_seed(cfg, server_round, index),
                                  state=previous, setup=setup)
    charge(context, cfg, site, server_round, "train", "model update",
            mechanism.round_release(cfg, setup, update, previous))
    _keep_noise(context)
    # The reply carries the state sealed, so that the server's checkpoint can hand it back to a resumed run.
    privacy_state = (None if update.state is None
                     else _keep_state(context, cfg.data.deployed, site, server_round, update.state))
    metrics = {**update.report, WEIGHT_KEY: setup.count if update.contributes else 0.0}
    content = _content(site, metrics, array_record(model.net.state_dict()), privacy_state=privacy_state)
    content.update(carried)
    return _reply(message, content, cfg, site, server_round, "train")


def _carried(context: Context, site: SiteData, server_round: int, cfg: ExperimentConfig, model: Any,
             config: ConfigRecord) -> dict[str, Any]:
    """The records a training reply carries about the message's model, the previous round's (none when the message
    does not ask): the site's test metrics of it (an evaluate reply's metric record and site record,
    :func:`_evaluation_content`), or, for a model with a federated baseline, its Breslow sums (:func:`_breslow_sums`),
    as the site of round :func:`~strategies.rounds.records.carried_round` would send them in a message of their own
    (a test site's injected failure and tampering included). The network is left in the mode the message gave it.

    The site decides from its own run config alone: a message that asks for anything else, or when that round is not
    one its config evaluates (or the model is not the one evaluated: a running average; or not every site trains
    each round), is refused. A site that holds out no test part sends no test metrics."""
    from flwr_app.faults import inject_failure, tamper
    from strategies.rounds.records import (BRESLOW_RECORD, CARRIED_BRESLOW, CARRIED_EVALUATION, EVALUATION_RECORD,
                                           EVALUATION_SITE, SITE_KEY, carried_round)

    asked = [key for key in (CARRIED_EVALUATION, CARRIED_BRESLOW) if config.get(key) is True]
    if not asked:
        return {}
    wanted, previous = CARRIED_BRESLOW if model.needs_baseline else CARRIED_EVALUATION, carried_round(cfg, server_round)
    if previous is None or asked != [wanted]:
        raise ValueError(f"query refused: this site's run config plans {'nothing' if previous is None else wanted} "
                         f"in round {server_round}'s training message, not {', '.join(asked)} (evaluation.every, "
                         "federation.rounds, federation.weight_average, federation.fraction_train, model.name)")
    mode = model.net.training
    try:
        if model.needs_baseline:
            inject_failure(cfg, site=site.name, server_round=previous, message="breslow")
            return {BRESLOW_RECORD: MetricRecord(_breslow_sums(context, cfg, site, previous, model))}
        if not len(site.test):
            return {}
        inject_failure(cfg, site=site.name, server_round=previous, message="evaluate")
        content = tamper(cfg, _evaluation_content(context, site, previous, model, ConfigRecord()), site=site.name,
                         server_round=previous, message="evaluate")
        return {EVALUATION_RECORD: content["metrics"], EVALUATION_SITE: content[SITE_KEY]}
    finally:
        model.net.train(mode)


@app.evaluate()
@_gives_back
def evaluate(message: Message, context: Context) -> Message:
    """Test metrics of the global model on the site's own held-out part (:func:`_evaluation_content`). A site that
    holds out no test part (``data.test_fraction = 0``: the server sends no evaluate message then) refuses."""
    site, _, server_round, cfg, model = _message(message, context, "evaluate")
    if not len(site.test):
        raise ValueError(f"site '{site.name}' holds out no test part (data.test_fraction = 0): it has no test "
                         "metrics to evaluate")
    return _reply(message, _evaluation_content(context, site, server_round, model, message.content["config"]), cfg,
                  site, server_round, "evaluate")


def _evaluation_content(context: Context, site: SiteData, server_round: int, model: Any,
                        config: ConfigRecord) -> RecordDict:
    """An evaluate reply's content: the site's test metrics of ``model`` (computed from its held-out part alone, with
    the baseline hazard and recalibration exponents ``config`` carries), and why each undefined one is; no record
    count (the server weights the sites' metrics by their agreed counts). A site whose node config sets a privacy
    policy keeps its metrics (:func:`_kept_local`) and sends none."""
    import numpy as np

    from flwr_app import task
    from flwr_app.site_policy import SitePolicy
    from strategies.horizontal import BASELINE_EVENTS, BASELINE_RISK, RECALIBRATION_EXPONENTS

    if model.needs_baseline:
        if BASELINE_EVENTS not in config:
            raise ValueError("Cox model evaluation needs the federated baseline hazard in the message")
        model.set_baseline(np.asarray(config[BASELINE_EVENTS]), np.asarray(config[BASELINE_RISK]))
    if RECALIBRATION_EXPONENTS in config:
        model.set_exponents(np.asarray(config[RECALIBRATION_EXPONENTS], dtype=np.float64))
    metrics, undefined = task.evaluate_with_reasons(model, site.test)
    if site.oot is not None and len(site.oot):
        oot, oot_undefined = task.evaluate_with_reasons(model, site.oot)
        metrics.update({f"oot_{key}": value for key, value in oot.items()})
        undefined.update({f"oot_{key}": code for key, code in oot_undefined.items()})
    if SitePolicy.from_node_config(context.node_config) is not None:  # a site with its own budget keeps them
        return _kept_local(context, site, server_round, metrics, undefined)
    # No record count: the server weights a site's test metrics by the count agreed at set-up (the held-out
    # count would reveal the site's size far more exactly than the set-up's noisy count does).
    return _content(site, metrics, undefined=undefined)


#: A policy site's own record of its test metrics (JSON Lines, in its site directory).
EVALUATION_FILE = "evaluation.jsonl"


def _kept_local(context: Context, site: SiteData, server_round: int, metrics: dict[str, float],
                undefined: dict[str, str]) -> RecordDict:
    """Keep a policy site's test metrics at the site: append them (one line per run and round) to
    :data:`EVALUATION_FILE` in its directory (:func:`flwr_app.site_store.site_dir`), synced, and print one line;
    return the reply's content: an empty metric record and the site record marked
    :data:`~strategies.horizontal.KEPT_LOCAL_KEY`."""
    import datetime
    import math

    from flwr_app import site_store
    from strategies.horizontal import KEPT_LOCAL_KEY, SITE_KEY

    path = site_store.site_dir(context.node_config) / EVALUATION_FILE
    line = {"run": int(context.run_id), "round": server_round, "site": site.name, "test_records": len(site.test),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "metrics": {key: None if math.isnan(value) else value for key, value in sorted(metrics.items())},
            "undefined": dict(sorted(undefined.items()))}
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    shown = ", ".join(f"{key} {value:.4f}" for key, value in sorted(metrics.items()) if math.isfinite(value))
    print(f"site '{site.name}' round {server_round}: test metrics kept at the site ({shown or 'none defined'}) "
          f"-> {path}", flush=True)
    content = _content(site, {})
    content[SITE_KEY][KEPT_LOCAL_KEY] = True
    return content


@app.query("site_name")
def site_name(message: Message, context: Context) -> Message:
    """Which site this node is (asked once, at the start of a run: the server names every node)."""
    site, _ = node_site(context)
    return Message(content=_content(site, {}), reply_to=message)


@app.query("breslow")
@_gives_back
def breslow(message: Message, context: Context) -> Message:
    """Sufficient statistics of the site's training part for the federated Breslow estimator."""
    site, _, server_round, cfg, model = _message(message, context, "breslow")
    return _reply(message, _content(site, _breslow_sums(context, cfg, site, server_round, model)), cfg, site,
                  server_round, "breslow")


def _breslow_sums(context: Context, cfg: ExperimentConfig, site: SiteData, server_round: int,
                  model: Any) -> dict[str, list[float]]:
    """``model``'s Breslow sums ``(d_k, R_k)`` on the site's training part, charged to its policy first."""
    charge(context, cfg, site, server_round, "breslow", "Breslow aggregates", None)
    event_counts, risk_sums = model.breslow_aggregates(site.train.x, site.train.time, site.train.event)
    return {"event_counts": event_counts.tolist(), "risk_sums": risk_sums.tolist()}


#: Stream of a site's recalibration noise (beside its round's other draws from the same seed).
RECALIBRATION_STREAM = 23
#: Node state: the site released its recalibration sums in this run (it releases them once).
RECALIBRATED = "recalibration.released"


def _recalibration_terms(message: Message, context: Context) -> tuple[SiteData, int, int, ExperimentConfig, Any]:
    """What a recalibration release starts with: the site, its seed index, the round, the run config and its
    training records' power terms at the message's horizons (:func:`models.recalibration.power_terms`, shape
    ``(records, size)``). Refused unless the site's own config plans the release, the horizons are 1 to
    ``len(RECALIBRATION_QUANTILES)`` finite times and the site has not released its sums in this run; charged
    to the site's policy (:func:`_charge`) before anything is computed."""
    import numpy as np

    from models.recalibration import power_terms
    from strategies.horizontal import RECALIBRATION_HORIZONS
    from strategies.mechanisms.setup_share import recalibration_history, recalibration_multiplier
    from strategies.mechanisms.setup_statistics import RECALIBRATION_QUANTILES

    site, index, server_round, cfg, model = _message(message, context, "recalibration")
    horizons = np.asarray(message.content["config"][RECALIBRATION_HORIZONS], dtype=np.float64)
    planned = horizons.ndim == 1 and 1 <= horizons.size <= len(RECALIBRATION_QUANTILES)
    if recalibration_multiplier(cfg) <= 0 or not planned or not np.all(np.isfinite(horizons)):
        raise ValueError("recalibration query refused: this run's config plans no recalibration release, or the "
                         f"horizons are not 1 to {len(RECALIBRATION_QUANTILES)} finite times ({horizons.tolist()})")
    if RECALIBRATED in context.state.config_records:
        raise ValueError("recalibration query refused: this site released its recalibration sums in this run already "
                         "(the run's plan has one release)")
    charge(context, cfg, site, server_round, "recalibration", "recalibration sums", recalibration_history(cfg))
    context.state[RECALIBRATED] = ConfigRecord({"round": server_round})
    times, surv = model.predict_survival(site.train.x)
    at = np.clip(np.searchsorted(times, horizons, side="right") - 1, 0, times.size - 1)  # right-continuous steps
    terms = power_terms(surv[:, at])
    return site, index, server_round, cfg, terms.reshape(terms.shape[0], -1)


@app.query("recalibration")
@_gives_back
def recalibration(message: Message, context: Context) -> Message:
    """The site's noisy recalibration release: power sums of its training records' predicted survival at the
    plan's horizons (:func:`models.recalibration.power_sums`) plus Gaussian noise whose level the site takes
    from its own run config (:func:`~strategies.mechanisms.setup_share.recalibration_multiplier`), never from the message.
    A strategy with a secure sum refuses it: its sites send these sums through the secure sum only."""
    import numpy as np

    from flwr_app import task
    from strategies.mechanisms.base import SecureSumMechanism
    from strategies.mechanisms.setup_share import recalibration_multiplier
    from strategies.mechanisms.registry import horizontal_mechanism

    cfg = run_config(context)
    if isinstance(horizontal_mechanism(cfg.strategy), SecureSumMechanism):
        raise ValueError(f"recalibration query refused: strategy '{cfg.strategy}' sends its recalibration sums "
                         "through its secure sum only")
    site, index, server_round, cfg, terms = _recalibration_terms(message, context)
    sums = terms.sum(axis=0)
    rng = np.random.default_rng([task.site_seed(cfg, server_round, index), RECALIBRATION_STREAM])
    noisy = sums + rng.normal(0.0, recalibration_multiplier(cfg) * np.sqrt(sums.size), sums.size)
    return _reply(message, _content(site, {"power_sums": noisy.tolist()}), cfg, site, server_round, "recalibration")


# ------------------------------------------------------------------ secure aggregation (strategies with a secure sum)


def _secagg_reply(message: Message, values: dict) -> Message:
    from strategies import secure_aggregation as secagg

    return Message(content=RecordDict({secagg.RECORD: ConfigRecord(values)}), reply_to=message)


@app.query("secagg_setup")
def secagg_setup(message: Message, context: Context) -> Message:
    """Stage 0 (:func:`_secagg_keys`)."""
    from strategies import secure_aggregation as secagg

    return _secagg_reply(message, _secagg_keys(message.content[secagg.RECORD], context))


def _secagg_keys(record: ConfigRecord, context: Context) -> dict[str, bytes]:
    """Stage 0 of a sum with the values of ``record``: fresh key pairs, which replace any state in the node state;
    the sum's public figures (sites selected, their agreed records) are kept. The site refuses Shamir parameters a
    server lying about survivors could exploit, counting the colluding sites of its own run config
    (``privacy.colluding_sites``). Returns the public keys to send."""
    from strategies import secure_aggregation as secagg

    state, keys = secagg.site_setup(context.node_id, record, colluding=run_config(context).privacy.colluding_sites)
    context.state[SECAGG_STATE] = state.to_record()
    context.state[SECAGG_ROUND] = ConfigRecord({"parties": int(record["parties"]), "records": float(record["records"])})
    return keys


@app.query("secagg_share_keys")
def secagg_share_keys(message: Message, context: Context) -> Message:
    """Stage 1: the mask seed and secret key shared among the neighbours, each share encrypted to its holder."""
    from strategies import secure_aggregation as secagg

    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    keys = {int(node): (pair[0], pair[1]) for node, pair in message.content[secagg.RECORD].items()}
    values = secagg.site_share_keys(state, keys)
    context.state[SECAGG_STATE] = state.to_record()
    return _secagg_reply(message, values)


@app.query("secagg_masked")
@_gives_back
def secagg_masked(message: Message, context: Context) -> Message:
    """Stage 2: the site's contribution, masked: its mechanism's vector of the round (its training reply), when the
    message carries the recalibration's horizons its recalibration sums' vector (:func:`_recalibration_terms`),
    when it names a pass of the private set-up that pass's vector (:func:`flwr_app.deployment.setup_vector`, its
    parameters from the site's own run config and policy), or, when it names a Cox query (``coxph`` with
    ``cox.secure_sum``), that query's sums in fixed point (:func:`flwr_app.cox_client.secure_vector`). A training
    vector's reply also carries what the message asks about the previous round's model (:func:`_carried`)."""
    import numpy as np

    from flwr_app import task
    from strategies import secure_aggregation as secagg
    from strategies.horizontal import RECALIBRATION_HORIZONS
    from strategies.mechanisms.base import SecureSumMechanism
    from strategies.mechanisms.registry import horizontal_mechanism

    public = context.state.config_records[SECAGG_ROUND]
    parties, records = int(public["parties"]), float(public["records"])
    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    from flwr_app.cox_messages import SECURE_QUERY
    from flwr_app.deployment import SETUP_PASS, setup_vector

    if SETUP_PASS in message.content.config_records.get("config", ConfigRecord()):  # the private set-up's sums
        cfg = run_config(context)
        secure = task.secure_setup(tolerated_dropouts(cfg, context, state), parties, own_honest_sites(context))
        return Message(content=_masked(message, context, state, setup_vector(message, context, secure, records)),
                       reply_to=message)
    if SECURE_QUERY in message.content.config_records.get("config", ConfigRecord()):  # coxph, cox.secure_sum
        from flwr_app.cox_client import secure_vector

        return Message(content=_masked(message, context, state, secure_vector(message, context, parties)),
                       reply_to=message)
    if RECALIBRATION_HORIZONS in message.content["config"]:  # after the last round: the recalibration sums
        cfg = run_config(context)
        mechanism = horizontal_mechanism(cfg.strategy)
        if not isinstance(mechanism, SecureSumMechanism):
            raise ValueError(f"strategy '{cfg.strategy}' has no secure sum: its sites answer 'recalibration'")
        site, index, server_round, cfg, terms = _recalibration_terms(message, context)
        cfg = tolerated_dropouts(cfg, context, state)
        plan = mechanism.recalibration_plan(cfg, parties=parties, records=records, size=terms.shape[1],
                                            honest_sites=own_honest_sites(context))
        rng = np.random.default_rng([task.site_seed(cfg, server_round, index), RECALIBRATION_STREAM])
        vector, phase = mechanism.recalibration_contribution(terms, plan, rng=rng), "recalibration"
        carried: dict[str, Any] = {}
    else:
        site, index, server_round, cfg, model, mechanism = _training_message(message, context)
        if not isinstance(mechanism, SecureSumMechanism):
            raise ValueError(f"strategy '{cfg.strategy}' has no secure sum: its sites answer 'train'")
        carried = _carried(context, site, server_round, cfg, model, message.content["config"])
        cfg = tolerated_dropouts(cfg, context, state)
        plan = mechanism.plan(cfg, parties=parties, records=records,
                              dim=sum(p.numel() for p in model.net.parameters()), setup=site_setup(cfg, context, site),
                              honest_sites=own_honest_sites(context))
        charge(context, cfg, site, server_round, "train", "masked contribution", mechanism.site_release(cfg, plan),
                details=_secure_sum_details(cfg.privacy, context, parties, plan.honest))
        vector = mechanism.contribution(model, site.train, cfg, plan, seed=task.site_seed(cfg, server_round, index))
        phase = "train"
    content = _masked(message, context, state, vector)
    content.update(carried)
    return _reply(message, content, cfg, site, server_round, phase)


def _masked(message: Message, context: Context, state: Any, vector: Any) -> RecordDict:
    """The masked ``vector`` for the neighbours and ciphertexts ``message`` names, and the neighbours disputed; the
    site's protocol ``state`` (a :class:`strategies.secure_aggregation.SiteState`) kept in the node state."""
    from strategies import secure_aggregation as secagg

    record = message.content[secagg.RECORD]
    masked, disputed = secagg.site_mask(state, record["sources"], record["ciphertexts"], vector)
    context.state[SECAGG_STATE] = state.to_record()
    return RecordDict({secagg.MASKED_ARRAY: secagg.masked_reply(masked),
                       secagg.RECORD: ConfigRecord({"disputed": disputed})})


@app.query("secagg_unmask")
def secagg_unmask(message: Message, context: Context) -> Message:
    """Stage 3: shares of the surviving neighbours' mask seeds and of the dropped neighbours' secret keys. When the
    message also carries the next sum's stage-0 values (:data:`strategies.secure_aggregation.NEXT_RECORD`), this
    sum's state is kept finished first, then that sum's stage 0 runs with stage 0's own checks (:func:`_secagg_keys`)
    and its public keys go with the shares; if it refuses, the reply is that error and this sum's state stays
    finished (no second unmask)."""
    from strategies import secure_aggregation as secagg

    state = secagg.SiteState.from_record(context.state.config_records[SECAGG_STATE])
    record = message.content[secagg.RECORD]
    values = secagg.site_unmask(state, record["survivors"], record["dropped"])
    context.state[SECAGG_STATE] = state.to_record()
    if secagg.NEXT_RECORD in message.content.config_records:
        values.update(_secagg_keys(message.content.config_records[secagg.NEXT_RECORD], context))
    return _secagg_reply(message, values)


class SimulatedSites(ClientApp):
    """:data:`app` for the virtual SuperNodes of one simulated run (Flower's ``flwr.simulation.run_simulation``).

    That runtime gives every node an empty run config and node config ``partition-id`` and
    ``num-partitions`` only. Each message goes to :data:`app` with the node's own context (its
    state, kept between messages) but run config ``run_config`` and, added to the node config,
    ``extra_node_config[partition-id]`` where given (a split site's ``model-dir``). Nothing else
    changes: the handlers, their mods and the replies are :data:`app`'s.
    """

    def __init__(self, run_config: Mapping[str, Any],
                 extra_node_config: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self.run_config = dict(run_config)
        self.extra_node_config = {int(partition): dict(config)
                                  for partition, config in (extra_node_config or {}).items()}

    def __call__(self, message: Message, context: Context) -> Message:
        extra = self.extra_node_config.get(int(context.node_config["partition-id"]), {})
        run_context = Context(run_id=context.run_id, node_id=context.node_id,
                              node_config={**context.node_config, **extra}, state=context.state,
                              run_config=dict(self.run_config))
        reply = app(message, run_context)
        context.state = run_context.state
        return reply
