"""The screening phase of a round: who the sites are, and which replies the server uses.

:func:`identify_sites` names every node once, at the start of a simulated run; :class:`ReplyScreen` files every
error, missing, mislabelled, duplicated or oversized reply of any phase as a named failure and checks a reply's
identity and metric record; :class:`TrainScreen` checks each training reply (:mod:`strategies.replies`, the
mechanism's :meth:`~strategies.mechanisms.base.HorizontalMechanism.verify`) and rebuilds the accepted ones with the
weight the server gives them.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from strategies.arrays import values
from strategies.config import ExperimentConfig
from strategies.mechanisms.base import HorizontalMechanism, SiteSetUp
from strategies.replies import check_arrays, check_count, error_message
from strategies.rounds.ledger import RoundBook
from strategies.rounds.records import (MAX_METRIC_KEYS, MAX_PRIVACY_STATE_CHARS, MAX_REPLY_EXTRA_BYTES,
                                       PRIVACY_STATE_KEY, SITE_NAME_QUERY, WEIGHT_KEY, GlobalModel, TooFewSitesError,
                                       claimed_name, digest, failure, metric_record, numbers, payload_bytes,
                                       records_of, site_record)
from strategies.rounds.robust import capped_weights


def identify_sites(book: RoundBook, grid: Grid, *, setups: Mapping[str, SiteSetUp], timeout: float,
                   config_key: str) -> dict[int, str]:
    """Ask every connected node which site it is (:data:`~strategies.rounds.records.SITE_NAME_QUERY`); fix each
    node's name in ``book.node_sites``.

    A node whose claimed name is not a site of the federation, or is already held by another
    node, or that does not answer, is left out; returns node -> why, for those.
    """
    nodes = sorted(grid.get_node_ids())
    messages = [Message(content=RecordDict({config_key: ConfigRecord()}), dst_node_id=node,
                        message_type=SITE_NAME_QUERY) for node in nodes]
    left_out: dict[int, str] = {}
    replies = sorted(grid.send_and_receive(messages, timeout=timeout), key=lambda reply: reply.metadata.src_node_id)
    for reply in replies:
        node = reply.metadata.src_node_id
        name = None if reply.has_error() else claimed_name(reply)
        if reply.has_error():
            left_out[node] = f"failed to say which site it is: {error_message(reply.error.reason)}"
        elif name is None or name not in setups:
            left_out[node] = f"claims to be {name!r}, which is not a site of this federation"
        elif name in book.node_sites.values():
            left_out[node] = f"claims to be site {name!r}, which another node already is"
        else:
            book.node_sites[node] = name
    for node in nodes:
        if node not in book.node_sites and node not in left_out:
            left_out[node] = f"did not say which site it is within {timeout:g} s"
    return left_out


def require_named(named: int, left_out: Mapping[int, str], *, needed: int, min_sites: int, strategy: str,
                  timeout: float) -> None:
    """:class:`~strategies.rounds.records.TooFewSitesError` when ``named`` sites are fewer than the ``needed`` a
    round of ``strategy`` needs (``min_train_nodes``, at least ``min_sites``: ``federation.min_sites``): one line
    naming every node left out and why (a node that did not answer: within ``timeout``, ``federation.timeout_s``)."""
    if named >= needed:
        return
    rule = f"federation.min_sites = {min_sites}" + (f"; strategy '{strategy}' needs {needed}"
                                                    if needed != min_sites else "")
    raise TooFewSitesError(
        f"{named} of {named + len(left_out)} nodes said which site they are within federation.timeout_s = "
        f"{timeout:g} s, fewer than the {needed} sites a round needs ({rule}); the run stops before any "
        "training: " + "; ".join(f"node {node} {reason}" for node, reason in sorted(left_out.items())))


class ReplyScreen:
    """The checks every phase's replies pass before any is read: attribution, identity, size and metric record.

    Contract: every reply it does not return is filed in ``book`` as a named failure of the round (an error reply is
    filed and returned: the caller skips it); a missing reply is filed as ``no reply within timeout``.
    """

    def __init__(self, book: RoundBook, model: GlobalModel, *, timeout: float) -> None:
        self.book = book
        self.model = model
        self.timeout = timeout

    def identity(self, message: Message) -> tuple[str | None, str]:
        """The site a reply comes from (by its node) and why it is refused on identity ("" if not)."""
        node = message.metadata.src_node_id
        site = self.book.node_sites.get(node)
        if site is None:
            return None, "a node that was not named at set-up"
        claimed = claimed_name(message)
        if claimed is not None and claimed != site:
            return site, f"the reply claims to come from site {claimed!r}, but node {node} is site {site!r}"
        return site, ""

    def record_failures(self, server_round: int, phase: str, messages: Iterable[Message],
                        replies: Iterable[Message]) -> list[Message]:
        """Record every error reply and every message left unanswered; return the usable replies, sorted by node.

        A reply belongs to the node its message was sent to (``reply_to_message_id``), whatever node it
        says it comes from: an error reply is filed under that node's site; a reply labelled as another
        node, and every reply of a node that answered one message more than once, is refused and filed
        under the node the message went to, never under the node it names. A reply to no message of
        the round is filed as unattributable. A reply heavier than the model's :meth:`GlobalModel.reply_limit`
        is refused by its size.
        """
        messages = list(messages)
        sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages
                if message.metadata.message_id}
        by_target: dict[int, list[Message]] = collections.defaultdict(list)
        for reply in replies:
            target = sent.get(reply.metadata.reply_to_message_id) if sent else reply.metadata.src_node_id
            if target is None:
                self.book.record(server_round).failures.append(failure(
                    phase, "unattributable", reply.metadata.src_node_id, "a reply to no message of this round"))
                continue
            by_target[target].append(reply)
        limit = self.model.reply_limit()
        kept = [reply for target, group in sorted(by_target.items())
                if (reply := self._usable(server_round, phase, target, group, limit)) is not None]
        for node in sorted({message.metadata.dst_node_id for message in messages} - set(by_target)):
            self.book.fail(server_round, phase, node, f"no reply within {self.timeout:g} s")
        return kept

    def _usable(self, server_round: int, phase: str, target: int, group: list[Message], limit: int) -> Message | None:
        """The reply of node ``target`` that :meth:`record_failures` keeps (an error reply too, filed), or None;
        ``limit``: the most bytes a reply may carry."""
        reply, fail = group[0], self.book.fail
        if len(group) > 1:
            fail(server_round, phase, target, f"{len(group)} replies to one message: none is used")
        elif reply.has_error():
            fail(server_round, phase, target, error_message(reply.error.reason))
            return reply
        elif reply.metadata.src_node_id != target:
            fail(server_round, phase, target,
                 f"its reply came back labelled as node {reply.metadata.src_node_id}: refused")
        elif (size := payload_bytes(reply.content)) > limit:
            fail(server_round, phase, target, f"its reply carries {size} bytes, more than the "
                 f"{limit} a reply may (a model's worth of arrays + {MAX_REPLY_EXTRA_BYTES})")
        else:
            return reply
        return None

    def accepted_metrics(
        self, server_round: int, phase: str, replies: Iterable[Message],
        check: Callable[[str, MetricRecord], str],
    ) -> Iterator[tuple[Message, str, int, MetricRecord]]:
        """``(reply, site, node, metric record)`` of each reply of ``phase`` that passes the identity check,
        carries exactly one metric record and passes ``check(site, record)`` (a reason, "" if none); every
        other reply but the error replies becomes a named failure of the round."""
        for message in replies:
            if message.has_error():
                continue
            node = message.metadata.src_node_id
            site, reason = self.identity(message)
            metrics = metric_record(message)
            if not reason and metrics is not None and len(metrics) > MAX_METRIC_KEYS:
                reason = f"the reply's metric record has {len(metrics)} keys; at most {MAX_METRIC_KEYS} are read"
            if not reason:
                reason = "the reply must carry exactly one metric record" if metrics is None else check(site, metrics)
            if reason:
                self.book.fail(server_round, phase, node, reason)
                continue
            yield message, site, node, metrics


class TrainScreen:
    """Checks every training reply and rebuilds the accepted ones for aggregation.

    Contract (:meth:`screen`): every reply of a named node counts in the round's ``released`` (its report, or None
    when refused); an accepted reply's report and privacy state are recorded; each accepted reply is rebuilt with
    only its model update and the weight the server gives it, in site order.
    """

    def __init__(self, book: RoundBook, replies: ReplyScreen, *, mechanism: HorizontalMechanism,
                 cfg: ExperimentConfig, setups: Mapping[str, SiteSetUp], array_key: str) -> None:
        self.book = book
        self.replies = replies
        self.mechanism = mechanism
        self.cfg = cfg
        self.setups = setups
        self.array_key = array_key
        self._sent_updates: dict[str, dict[bytes, tuple[int, bytes]]] = {}  # site -> digest -> (round, model digest)

    def check(self, server_round: int, message: Message, site: str) -> tuple[str, dict[str, float] | None,
                                                                             float, str | None]:
        """Why a training reply is refused ("" when accepted), its report, its reported count and privacy state."""
        updates = records_of(message.content, ArrayRecord)
        if len(updates) != 1:
            return "the reply must carry exactly one model update", None, 0.0, None
        record = metric_record(message)
        if record is None:
            return "the reply must carry exactly one metric record", None, 0.0, None
        figures = numbers(record)
        count = figures.pop(WEIGHT_KEY, None)
        reason = check_count(count, self.setups[site].count)
        if reason:
            return reason, None, 0.0, None
        reason = check_arrays(self.replies.model.of_round(server_round)[1],
                              {key: values(array) for key, array in updates[0].items()})
        if not reason:
            reason = self._replay(server_round, site, updates[0]) or self.mechanism.verify(
                self.cfg, figures, setup=self.setups[site], previous=self.book.site_reports(site, server_round - 1))
        if reason:
            return reason, None, float(count), None
        state = _privacy_state(site_record(message.content))
        if state is False:
            return "the privacy state is not a JSON object of reasonable size", None, float(count), None
        return "", {key: float(value) for key, value in figures.items()}, float(count), state

    def _replay(self, server_round: int, site: str, update: ArrayRecord) -> str:
        """Why ``update`` is refused as a replay ("" if it is not): bit for bit an update ``site`` sent in an earlier
        round, when it was sent another global model (training from another model never gives the same bits; from
        the same one, after a rolled-back round, it can)."""
        model = self.replies.model.of_round(server_round)[0]
        seen = self._sent_updates.setdefault(site, {})
        earlier = seen.setdefault(digest(update), (server_round, model))
        if earlier[1] != model:
            return (f"its update is bit for bit the one it sent in round {earlier[0]}, when it was sent another "
                    "global model: a replay")
        return ""

    def screen(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Check every training reply; record accepted reports and named failures; return the accepted replies.

        Each accepted reply is rebuilt with only its model update and the weight the server gives
        it (:meth:`~strategies.mechanisms.base.HorizontalMechanism.aggregation_weight` of the
        site's set-up, or 0 when the site has nothing new, capped by :meth:`_cap_weights`), in site
        order so that the sums of the aggregation, and so a rerun, are reproducible.
        """
        record = self.book.record(server_round)
        accepted: list[tuple[str, Message]] = []
        for message in replies:
            if message.has_error():
                continue
            node = message.metadata.src_node_id
            site, reason = self.replies.identity(message)
            if site is None:
                self.book.fail(server_round, "train", node, reason)
                continue
            report, count, state = None, 0.0, None
            if not reason:
                reason, report, count, state = self.check(server_round, message, site)
            record.released[site] = report
            if reason:
                self.book.fail(server_round, "train", node, reason)
                continue
            assert report is not None
            record.train_sites[site] = report
            if state is not None:
                record.privacy_states[site] = state
            weight = self.mechanism.aggregation_weight(self.setups[site]) if count > 0 else 0.0
            content = RecordDict({self.array_key: records_of(message.content, ArrayRecord)[0],
                                  "metrics": MetricRecord({WEIGHT_KEY: weight})})
            accepted.append((site, Message(content=content, dst_node_id=node,
                                           message_type=message.metadata.message_type)))
        accepted.sort(key=lambda pair: pair[0])
        self._cap_weights(server_round, accepted)
        return [message for _, message in accepted]

    def _cap_weights(self, server_round: int, accepted: list[tuple[str, Message]]) -> None:
        """Cap the weights of the round's ``(site, rebuilt reply)`` pairs in place at ``federation.max_weight_ratio``
        x their median (:func:`~strategies.rounds.robust.capped_weights`); flag each site capped (a large honest
        site is normal: not a failure). Every consumer of the weights (the weighted mean, centred clipping,
        multi-krum's mean, a DP wrapper) reads the capped ones."""
        ratio = self.cfg.federation.max_weight_ratio
        records = [records_of(message.content, MetricRecord)[0] for _, message in accepted]
        weights = np.array([float(record[WEIGHT_KEY]) for record in records])
        capped = capped_weights(weights, ratio)
        if not accepted or np.array_equal(capped, weights):
            return
        median = float(np.median(weights[weights > 0]))
        flags = self.book.record(server_round).weight_flags
        for (site, _), record, weight, cap in zip(accepted, records, weights, capped, strict=True):
            if cap < weight:
                record[WEIGHT_KEY] = float(cap)
                flags[site] = (f"weight {weight:g} (its agreed count) is {weight / median:.3g} x the median of the "
                               f"round's {int(np.sum(weights > 0))} sites' ({median:g}): capped at {ratio:g} x the "
                               "median (federation.max_weight_ratio)")


def _privacy_state(record: ConfigRecord | None) -> str | None | bool:
    """The privacy state a training reply's site record carries (JSON), None when it carries none, False when it is
    not a JSON object of at most :data:`~strategies.rounds.records.MAX_PRIVACY_STATE_CHARS` characters."""
    if record is None or PRIVACY_STATE_KEY not in record:
        return None
    state = str(record[PRIVACY_STATE_KEY])
    try:
        if len(state) > MAX_PRIVACY_STATE_CHARS or not isinstance(json.loads(state), dict):
            return False
    except ValueError:
        return False
    return state
