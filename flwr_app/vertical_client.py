"""ClientApp side of a vertical run (strategy ``split``): one modality site.

Message handling only. Which modality and records a node holds comes from its node config
(:func:`flwr_app.vertical_task.site_from_node_config`); the site's encoder, optimiser moments and
release counts live in ``context.state`` between messages (each message may run in a new
process), and its computations are :class:`strategies.split.SplitSite`'s.
"""

from __future__ import annotations

import dataclasses
import json

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flwr_app import split_messages as wire
from flwr_app import deployment, site_policy, vertical_task
from flwr_app.config import parse_run_config
from flwr_app.faults import inject_failure
from models.multimodal_training import epoch_batches
from models.data.dictionary import DataDictionary
from strategies.accounting.private_split import PrivateSplitPlan, plan_noise
from strategies.private_split import PrivateSplitSite, site_rng
from strategies.split import SiteConfig, SiteReply, SplitSite

CONFIG_STATE = "split.config"
SITE_STATE = "split.site"
#: Node config key: the folder (on the site's own disk) where a split site saves its trained encoder at the end of
#: a run; without it the site saves nothing. In simulation :mod:`simulations.engine` sets ``<run>/sites/<modality>``.
MODEL_DIR_KEY = "model-dir"
PRIVATE_CONFIG_STATE = "private_split.config"
PRIVATE_SITE_STATE = "private_split.site"


def _site_data(context: Context) -> vertical_task.SiteData:
    return vertical_task.site_from_node_config(parse_run_config(context.run_config), context.node_config)


def _build(config: SiteConfig, context: Context) -> SplitSite:
    data = _site_data(context)
    if config.modality != data.modality:
        raise ValueError(f"the label holder configured modality {config.modality!r} but this site holds "
                         f"{data.modality!r} ({data.source})")
    return SplitSite(config, data.features, data.categorical, noise_base_seed=data.noise_base_seed,
                     source=data.source)


def _save(site: SplitSite, context: Context) -> None:
    context.state[SITE_STATE] = ArrayRecord({key: Array(value) for key, value in site.state_dict().items()})


def _restore(context: Context) -> SplitSite:
    if CONFIG_STATE not in context.state.config_records:
        raise ValueError("split-learning step before set-up: this site has no configuration in its state")
    site = _build(SiteConfig.from_json(str(context.state.config_records[CONFIG_STATE]["json"])), context)
    arrays = context.state.array_records[SITE_STATE]
    site.load_state_dict({key: arrays[key].numpy() for key in arrays})
    return site


def hello(message: Message, context: Context) -> Message:
    """Reply with this site's modality and the record IDs it holds (refused by a site's privacy policy, whose filter
    cannot charge split learning's releases: :mod:`flwr_app.site_policy`)."""
    cfg = parse_run_config(context.run_config)
    site_policy.enforce(context.node_config, deployment.site_name(context),
                        site_policy.Request(cfg.strategy, context.run_id, 0, "split_hello", "record IDs", None))
    data = _site_data(context)
    held = data.features.index[data.features.notna().any(axis=1).to_numpy()]
    return Message(content=wire.encode_hello_reply(data.modality, [str(i) for i in held]), reply_to=message)


def setup(message: Message, context: Context) -> Message:
    """Build the encoder from the label holder's configuration and keep it in the node state."""
    config = wire.decode_setup(message.content)
    site = _build(config, context)
    context.state[CONFIG_STATE] = ConfigRecord({"json": config.to_json()})
    _save(site, context)
    return Message(content=RecordDict({"split.site": ConfigRecord({"modality": config.modality})}),
                   reply_to=message)


def step(message: Message, context: Context) -> Message:
    """One round trip: apply the previous batch's gradient, release the next batch's embeddings."""
    site = _restore(context)
    request = wire.decode_request(message.content)
    config = site.config
    batches_per_epoch = len(epoch_batches(config.num_train, batch_size=config.batch_size, seed=config.seed, epoch=0))
    step = request.backward_step if request.backward_step >= 0 else request.forward_step
    inject_failure(parse_run_config(context.run_config), site=config.modality,
                   server_round=step // batches_per_epoch + 1, message="train")
    reply = site.handle(request)
    _save(site, context)
    return Message(content=wire.encode_reply(site.config.modality, reply), reply_to=message)


def predict(message: Message, context: Context) -> Message:
    """Prediction passes for the requested records."""
    site = _restore(context)
    request = wire.decode_predict(message.content)
    embeddings, present = site.predict(request)
    _save(site, context)
    return Message(content=wire.encode_reply(site.config.modality, SiteReply(embeddings, present,
                                                                             site.privacy_report())),
                   reply_to=message)


def save(message: Message, context: Context) -> Message:
    """Keep this site's trained part: write it into the folder of node config ``model-dir`` (its encoder weights,
    configuration and fitted preprocessing: :meth:`strategies.split.SplitSite.save`) and reply with the modality
    only; without ``model-dir`` save nothing and reply with nothing. Nothing of the encoder leaves the site."""
    run_token = wire.decode_save(message.content)
    site = _restore(context)
    directory = str(context.node_config.get(MODEL_DIR_KEY, "")).strip()
    if not directory:
        return Message(content=wire.encode_save_reply(None), reply_to=message)
    site.save(directory, run_token=run_token)
    return Message(content=wire.encode_save_reply(site.config.modality), reply_to=message)


# --------------------------------------------------------------------------- private_split


def _private_site(plan: PrivateSplitPlan, modality: str, context: Context,
                  dictionary: DataDictionary | None = None) -> tuple[PrivateSplitSite, int]:
    """The site of ``plan`` over this node's modality, and its noise seed. The noise is recomputed here from
    the public plan: a site never takes the label holder's word for its own noise. ``dictionary``: the run's
    public data dictionary, as the label holder sent it (the set-up's entries for this site's columns)."""
    data = _site_data(context)
    if modality != data.modality:
        raise ValueError(f"the label holder configured modality {modality!r} but this site holds "
                         f"{data.modality!r} ({data.source})")
    site = PrivateSplitSite(plan, plan_noise(plan), data.features, data.categorical, modality=modality,
                            source=data.source, dictionary=dictionary)
    return site, data.noise_base_seed


def _private_save(site: PrivateSplitSite, calls: int, context: Context) -> None:
    text, arrays = site.state_dict()
    context.state[PRIVATE_CONFIG_STATE] = ConfigRecord({
        "plan": json.dumps(dataclasses.asdict(site.plan)), "modality": site.modality, "calls": calls, **text})
    context.state[PRIVATE_SITE_STATE] = ArrayRecord({key: Array(value) for key, value in arrays.items()})


def private_setup(message: Message, context: Context) -> Message:
    """Private set-up and encoder fit from the label holder's plan (training IDs, residuals for ``score``, and the
    public data dictionary)."""
    plan, modality, train_ids, residuals, dictionary = wire.decode_private_setup(message.content)
    if PRIVATE_CONFIG_STATE in context.state.config_records:
        raise ValueError("this site has already fitted its encoder in this run (a second fit would spend the "
                         "budget again)")
    site, seed = _private_site(plan, modality, context, dictionary)
    if residuals is not None and len(residuals) != len(train_ids):
        raise ValueError(f"{len(residuals)} residuals for {len(train_ids)} training records")
    site.fit(train_ids, None if residuals is None else dict(zip(train_ids, residuals.tolist())),
             site_rng(seed, modality, 0))
    _private_save(site, 0, context)
    return Message(content=wire.encode_private_setup_reply(modality, site.dim, site.notes), reply_to=message)


def private_release(message: Message, context: Context) -> Message:
    """Each requested record's one release (from the cache when it left the site before)."""
    if PRIVATE_CONFIG_STATE not in context.state.config_records:
        raise ValueError("private_split release before set-up: this site has no encoder in its state")
    state = context.state.config_records[PRIVATE_CONFIG_STATE]
    plan = PrivateSplitPlan(**json.loads(str(state["plan"])))
    site, seed = _private_site(plan, str(state["modality"]), context)
    arrays = context.state.array_records[PRIVATE_SITE_STATE]
    site.load_state_dict({key: str(state[key]) for key in ("preprocessor", "released_ids")},
                         {key: arrays[key].numpy() for key in arrays})
    inject_failure(parse_run_config(context.run_config), site=site.modality, server_round=1, message="train")
    calls = int(state["calls"]) + 1
    embeddings, present = site.release(wire.decode_private_release(message.content), site_rng(seed, site.modality,
                                                                                              calls))
    _private_save(site, calls, context)
    return Message(content=wire.encode_private_release_reply(site.modality, embeddings, present,
                                                             site.privacy_report()), reply_to=message)
