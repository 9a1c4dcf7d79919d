"""What a deployed site's error tells the server: its name, a class of failure and a key, nothing of its file.

At a deployed site (the run's ``data.name = "site_files"``, or any node whose node config makes it no
simulated partition: no ``partition-id``) the server is not trusted, yet it chooses the run config,
column roles included, and the text of every exception a handler raises reaches it as the error
reply. :func:`sanitised_errors`, a ClientApp mod, therefore replaces that text: the full detail (the
traceback, the original message with its counts, rows, values and column names) goes to the site's
own log file (``site.log`` in :func:`flwr_app.site_store.site_dir`) and to stderr, and the server gets
``site '<name>': <public part> (the site's log has the detail)``, the public part built from a closed
vocabulary only (:func:`phrases`, :data:`KIND_PHRASES`, :data:`PUBLIC_KEYS`):

* an exception with a public part (``public``: ``(class of failure, key)`` pairs), a
  :class:`~models.data.validate.DataValidationError` or a :class:`SiteError`: each class's phrase
  with its key, e.g. ``the column given as data.time_col is not a valid time column``;
* any other exception: the phrase of its kind (a privacy policy's refusal, a run config the site
  cannot use, a file it cannot read or write, ...);
* the set-up marker :data:`NO_SETUP` is kept in front, so that the server
  recognises a site that lost its set-up and sends it again.

A simulation's sites are the operator's own process (the operator runs the server and every site):
their errors keep their detail.

A site with a privacy policy also reads its file only with its own column roles
(:func:`check_column_roles`): its node config declares them (:data:`ROLE_KEYS`; ``data-time-col``
and ``data-event-col`` are required; any site that declares one is held to them too), and a run
config that names other ones is refused before the file is read, with a reply that depends on no
record (Flower's ``--node-config`` takes quoted strings; lists comma-separated, as in the run config)::

    flower-supernode --node-config "data-path='/data/site.csv' data-time-col='futime' data-event-col='death' \\
        data-event-values='Dead' data-categorical-cols='flc.grp' privacy-ledger='/var/fedsurv/ledger.jsonl' \\
        privacy-max-epsilon=1"
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Message

from flwr_app.config import DEPLOYED_DATA, DataConfig, ExperimentConfig

__all__ = ["CARRIED_SETUP", "LOG_FILE", "MESSAGES_FILE", "NO_SETUP", "ROLE_KEYS", "SITE_PHRASES", "SiteError", "SiteFailure",
           "check_column_roles", "deployed", "phrases", "public_text", "sanitised_errors"]

#: The site's log of its errors' detail, in its own directory.
LOG_FILE = "site.log"
#: The site's record of every message it handled (JSON Lines: time, run, type, round, outcome), in its own directory.
MESSAGES_FILE = "messages.jsonl"
#: Classes of failure of :class:`SiteError` (beside the data classes of :mod:`models.data.validate`).
ROLES_DIFFER = "roles differ"
ROLES_UNDECLARED = "roles undeclared"
DELTA_TOO_LARGE = "delta too large"
TEST_SHARE_TOO_LARGE = "test share too large"
#: Begins the error a site raises when its node state holds no set-up (the server recognises it and sends it again).
NO_SETUP = "[no set-up]"
#: Message content: a deployment's agreed set-up travelling with a site's message (JSON in a ConfigRecord), sent by
#: :class:`flwr_app.deployment.RejoiningSites` and kept by the site's mod :func:`flwr_app.client_app.carried_setup`.
CARRIED_SETUP = "deployment.carried_setup"
#: Run-config key -> the node-config key in which a site declares it (the keys that decide how it reads its file).
ROLE_KEYS = {"data.time_col": "data-time-col", "data.event_col": "data-event-col",
             "data.feature_cols": "data-feature-cols", "data.id_col": "data-id-col",
             "data.drop_cols": "data-drop-cols", "data.split_col": "data-split-col",
             "data.categorical_cols": "data-categorical-cols", "data.event_values": "data-event-values"}
#: The node-config keys a site with a privacy policy must set (the others default to the run config's defaults).
REQUIRED_ROLE_KEYS = ("data-time-col", "data-event-col")
#: The keys a public text may name; any other key is left out.
PUBLIC_KEYS = frozenset({*ROLE_KEYS, *ROLE_KEYS.values(), "privacy.delta", "data.test_fraction"})

#: The phrase of each class of failure of :class:`SiteError`; ``{cols}``: "the column given as K" (or columns, K and
#: L), ``{is_}``/``{has}``: the verb, ``{keys}``: the keys.
SITE_PHRASES = {
    ROLES_DIFFER: ("the run config's column roles (data.*) differ from this site's node config (data-*); the site "
                   "reads its file only with its own column roles"),
    ROLES_UNDECLARED: ("this site has a privacy policy and reads its file only with the column roles its node config "
                       "declares; its node config lacks {keys} (e.g. --node-config \"data-time-col='time' "
                       "data-event-col='event'\")"),
    DELTA_TOO_LARGE: "{keys} is more than 1/n for the site's training records; the site releases nothing",
    TEST_SHARE_TOO_LARGE: ("{keys} is above this site's node config max-test-share (the share of its records it "
                           "holds out; default 0.2): run with a smaller {keys}"),
}


@functools.cache
def phrases() -> dict[str, str]:
    """Class of failure -> its public phrase: the data classes of :mod:`models.data.validate` (imported with the first
    failure: a message that succeeds never loads the data code) and :data:`SITE_PHRASES`."""
    from models.data import validate as v

    return {
        v.MISSING_COLUMN: "{cols} {is_} not in the site's file",
        v.NOT_TIME: "{cols} {is_} not a valid time column",
        v.NOT_EVENT: "{cols} {is_} not a valid event column",
        v.NOT_NUMERIC: "a column given as {keys} is not numeric",
        v.NOT_A_FEATURE: "{cols} {is_} not a feature column of the site's file",
        v.ROLE_CONFLICT: "{cols} also {has} another role (an outcome or a listed feature)",
        v.NOT_SPLIT: "{cols} {is_} not a valid train/test split column",
        v.IDENTIFIER: "a feature column looks like a record identifier (name it in data.id_col or data.drop_cols)",
        v.TOO_FEW_RECORDS: "the site's file has too few records",
        v.NO_TRAINING_EVENT: "the training part of the site's file has no event",
        v.UNREADABLE: "the site's file cannot be read",
        v.DUPLICATE_COLUMNS: "the site's file has duplicate column names",
        **SITE_PHRASES,
    }


#: Phrases of a data error without a public part, and of any other exception, by its kind (first match).
DATA_INVALID = "the site's file is not valid for this run"
POLICY_REFUSED = "the site's privacy policy refused the request; nothing released"
KIND_PHRASES: tuple[tuple[str, str], ...] = (
    ("flwr_app.site_policy.PolicyRefusal", POLICY_REFUSED),
    ("flwr_app.site_store.LedgerTampered", "the site's privacy ledger does not match its head; the site releases "
                                           "nothing until its operator acts"),
    ("flwr_app.site_state.StateRefused", "the privacy state the server handed back was not sealed by this site; "
                                         "nothing trained"),
    ("strategies.config.ConfigError", "the site cannot use the run config"),
    ("models.data.validate.DataValidationError", DATA_INVALID),
    ("builtins.OSError", "the site could not read or write one of its files"),
    ("builtins.MemoryError", "the site ran out of memory"),
    ("builtins.Exception", "the site could not handle the message"),
)


class SiteError(ValueError):
    """A site's refusal with a public part: ``public``, ``(class of failure, key)`` pairs (a class of
    :data:`SITE_PHRASES`); the message is the detail, which stays at a deployed site."""

    def __init__(self, message: str, *, public: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.public = tuple(public)


class SiteFailure(Exception):
    """What a deployed site raises instead of a handler's exception: its message is :func:`public_text`."""


def _is_kind(err: BaseException, qualified: str) -> bool:
    """Whether ``err`` is an instance of the class named ``module.Class`` (by its MRO: nothing is imported)."""
    module, _, name = qualified.rpartition(".")
    return any(cls.__module__ == module and cls.__qualname__ == name for cls in type(err).__mro__)


def _phrase(failure: str, keys: Sequence[str]) -> str:
    """The public phrase of one class of failure and the keys it is about (only keys of :data:`PUBLIC_KEYS`)."""
    keys = [key for key in dict.fromkeys(keys) if key in PUBLIC_KEYS]
    template = phrases()[failure]
    if "{" in template and not keys:
        return DATA_INVALID
    plural = len(keys) > 1
    listed = " and ".join(keys)
    return template.format(
        cols=f"the column{'s' if plural else ''} given as {listed}", is_="are" if plural else "is",
        has="have" if plural else "has", keys=listed)


def public_text(err: BaseException, site: str) -> str:
    """The reply text of ``err`` at the deployed site ``site``: its name, the public phrases of ``err`` and where the
    detail is; :data:`NO_SETUP` in front of an error that begins with it."""
    if str(err).startswith(NO_SETUP):
        return (f"{NO_SETUP} site '{site}': its node state holds no set-up (its SuperNode restarted, or the set-up "
                "did not reach it)")
    grouped: dict[str, list[str]] = {}
    for part in getattr(err, "public", None) or ():
        failure, key = (tuple(part) + ("", ""))[:2] if isinstance(part, (tuple, list)) else ("", "")
        if isinstance(failure, str) and failure in phrases():
            grouped.setdefault(failure, []).append(str(key))
    said = [_phrase(failure, keys) for failure, keys in grouped.items()]
    if not said:
        said = [next(phrase for kind, phrase in KIND_PHRASES if _is_kind(err, kind))]
    return f"site '{site}': {'; '.join(dict.fromkeys(said))} (the site's log has the detail)"


def deployed(context: Context) -> bool:
    """Whether the node is a deployed site: the run says so (``data.name = "site_files"``), or its node config is not
    a simulated partition's (no ``partition-id``): a server cannot make a deployed SuperNode keep detailed errors
    by naming another data set."""
    return str(context.run_config.get("data.name", "")).strip() == DEPLOYED_DATA or \
        "partition-id" not in context.node_config


def _log_detail(context: Context, site: str, message: Message, err: BaseException, public: str) -> None:
    """Write the full detail of ``err`` to stderr and to the site's log file (stderr alone when the file fails)."""
    from flwr_app import site_store

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    detail = (f"{stamp} site '{site}' run {context.run_id} message {message.metadata.message_type}: "
              f"{type(err).__module__}.{type(err).__qualname__}: {err}\n"
              + "".join(traceback.format_exception(err)) + f"the server was told: {public}\n")
    print(detail, file=sys.stderr, flush=True)
    try:
        path = site_store.site_dir(context.node_config) / LOG_FILE
        with path.open("a", encoding="utf-8") as handle:
            handle.write(detail + "\n")
        path.chmod(0o600)
    except (OSError, ValueError) as failure:
        print(f"site '{site}': its log file could not be written ({failure!r}); the detail is above", file=sys.stderr,
              flush=True)


def sanitised_errors(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """ClientApp mod: at a deployed site (:func:`deployed`) a handler's exception is logged at the site in full and
    replaced by a :class:`SiteFailure` whose message is :func:`public_text`; a simulated site's passes unchanged."""
    try:
        return call_next(message, context)
    except Exception as err:
        if not deployed(context):
            raise
        site = str(context.node_config.get("site-name", f"node-{context.node_id}"))
        public = public_text(err, site)
        _log_detail(context, site, message, err, public)
        raise SiteFailure(public) from None


def recorded_messages(message: Message, context: Context,
                      call_next: Callable[[Message, Context], Message]) -> Message:
    """ClientApp mod: a deployed site (:func:`deployed`) appends one line per message it handles to
    :data:`MESSAGES_FILE` in its own directory (UTC time, run, message type, ``server-round`` where the message
    carries one, and ``replied`` or the error the server was told); nothing of it is sent. A simulated site records
    nothing. The record never stops the message: a file that cannot be written is reported on stderr."""
    if not deployed(context):
        return call_next(message, context)
    config = message.content.config_records.get("config")
    entry = {"run": context.run_id, "type": message.metadata.message_type,
             "round": config.get("server-round") if config is not None else None}
    try:
        reply = call_next(message, context)
        entry["outcome"] = "error: " + reply.error.reason if reply.has_error() else "replied"
        return reply
    except Exception as err:
        entry["outcome"] = f"error: {err}"
        raise
    finally:
        _append_record(context, entry)


def _append_record(context: Context, entry: dict[str, Any]) -> None:
    from flwr_app import site_store

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        path = site_store.site_dir(context.node_config) / MESSAGES_FILE
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"time": stamp, **entry}) + "\n")
        path.chmod(0o600)
    except (OSError, ValueError) as failure:
        print(f"node {context.node_id}: its message record could not be written ({failure!r})", file=sys.stderr,
              flush=True)


# ------------------------------------------------------------------ a policy site's own column roles


def _run_roles(data: DataConfig) -> dict[str, object]:
    """The column roles of the run config's ``data`` group, as compared (outcome defaults filled in; unordered lists as
    sets)."""
    return {"data.time_col": data.time_col or "time", "data.event_col": data.event_col or "event",
            "data.feature_cols": tuple(data.feature_cols), "data.id_col": data.id_col,
            "data.drop_cols": frozenset(data.drop_cols), "data.split_col": data.split_col,
            "data.categorical_cols": frozenset(data.categorical_cols),
            "data.event_values": frozenset(str(value).strip().lower() for value in data.event_values)}


def _node_roles(node_config: Mapping[str, Any]) -> dict[str, object]:
    """The column roles a node config declares (``""`` where it declares none), read as the run config reads them."""
    def text(key: str, default: str = "") -> str:
        return str(node_config.get(key, "")).strip() or default

    def items(key: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in str(node_config.get(key, "")).split(",") if part.strip())

    return {"data.time_col": text("data-time-col", "time"), "data.event_col": text("data-event-col", "event"),
            "data.feature_cols": items("data-feature-cols"), "data.id_col": text("data-id-col"),
            "data.drop_cols": frozenset(items("data-drop-cols")), "data.split_col": text("data-split-col"),
            "data.categorical_cols": frozenset(items("data-categorical-cols")),
            "data.event_values": frozenset(value.lower() for value in items("data-event-values"))}


def check_column_roles(cfg: ExperimentConfig, context: Context) -> None:
    """Refuse, before the file is read, a run whose column roles differ from those the site's node config declares.

    Checked at a site whose node config sets a privacy policy (which must declare :data:`REQUIRED_ROLE_KEYS`) or
    declares any key of :data:`ROLE_KEYS`; a role the node config leaves out is its default (none, or every other
    column). Raises :class:`SiteError` naming the keys only: its reply depends on nothing of the file.
    """
    from flwr_app.site_policy import SitePolicy

    node_config = context.node_config
    site = str(node_config.get("site-name", f"node-{context.node_id}"))
    declared = [key for key in ROLE_KEYS.values() if key in node_config]
    if SitePolicy.from_node_config(node_config) is not None:
        missing = [key for key in REQUIRED_ROLE_KEYS if key not in node_config]
        if missing:
            raise SiteError(f"site '{site}': node config has a privacy policy but not {', '.join(missing)}: a policy "
                            "site reads its file only with the column roles its node config declares",
                            public=[(ROLES_UNDECLARED, key) for key in missing])
    elif not declared:
        return
    run, own = _run_roles(cfg.data), _node_roles(node_config)
    differ = [key for key in ROLE_KEYS if run[key] != own[key]]
    if differ:
        detail = "; ".join(f"{key} = {run[key]!r}, node config {ROLE_KEYS[key]} = {own[key]!r}" for key in differ)
        raise SiteError(f"site '{site}': the run config's column roles differ from the node config's: {detail}",
                        public=[(ROLES_DIFFER, key) for key in differ])
