"""The evaluation carried by the next training message: fewer sequential messages per round.

Round ``r``'s global model ``m_r`` is what round ``r + 1``'s training message sends every site. When ``r`` is an
evaluated round (:func:`~strategies.rounds.records.carried_round`: before the last, the global model itself evaluated,
every site sent every training message), that message also asks about ``m_r``:

* a model without a federated baseline: for the site's test metrics of ``m_r``
  (:data:`~strategies.rounds.records.CARRIED_EVALUATION`); the training reply carries them in records of their own
  (:data:`~strategies.rounds.records.EVALUATION_RECORD`, :data:`~strategies.rounds.records.EVALUATION_SITE`). One
  sequential message a round (train, then the last round's evaluate message).
* a Cox-type model: for the Breslow sums ``(d_k, R_k)`` of ``m_r`` on the site's training part
  (:data:`~strategies.rounds.records.CARRIED_BRESLOW`, in :data:`~strategies.rounds.records.BRESLOW_RECORD`); their
  sum over sites is ``m_r``'s baseline, which its evaluate message carries (the test metrics need the baseline of the
  same model, so they cannot come before it). Two sequential messages a round (train with the Breslow sums,
  evaluate) in place of three.

With a secure sum (``distributed_dp``) the message that carries the model is the masked stage's: it asks the same.
The unmask message of a round also carries the next round's key set-up
(:class:`~strategies.rounds.secure_sum.SecureSumRelease`), so a round after the first is three sequential messages
(share keys, masked, unmask), five before.

The server takes each reply apart (:func:`training_part`, :func:`carried_part`): the carried part goes through the
checks of an evaluate (or Breslow) reply and is filed under round ``r``, the training part through those of a
training reply under round ``r + 1``. A refused carried part leaves the site's update as it is (as a refused evaluate
or Breslow reply did). A site whose training reply is an error, does not come, or is refused before it is read
(several replies to one message, one labelled as another node) is asked in a message of its own, as before. Round
``r`` is closed (its metrics line, ledger entries and checkpoint) before round ``r + 1``'s training replies are read.
The last round, a round not aggregated, a round after which the run stops and the runs whose sites cannot be asked
alone keep the messages of their own.

The figures are those of separate messages, but for one case: a model whose predictions most sites find not finite
(:meth:`~strategies.rounds.evaluation.ModelKeeper.predictions_checked`) is rolled back once round ``r + 1``'s sites
have trained from it; their updates are then not aggregated (released all the same: their spend counts) and round
``r + 1`` keeps the last good model (:meth:`~strategies.rounds.evaluation.ModelKeeper.trained_from_rolled_back`),
where separate messages would have trained round ``r + 1`` from the last good model. And a site that fails while it
evaluates or sums (it does so before it trains, so it has released nothing) fails the whole message: its update of
round ``r + 1`` is missing too, where a separate message would have failed alone.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from strategies.config import ExperimentConfig
from strategies.rounds.records import (BRESLOW_RECORD, CARRIED_BRESLOW, CARRIED_EVALUATION, EVALUATION_RECORD,
                                       EVALUATION_SITE, KEPT_LOCAL_KEY, SITE_KEY, UNDEFINED_KEY, carried_round,
                                       site_record)

#: What closes the carried round: the messages answered by one reply each, from the node each was sent to, not an
#: error; the carried parts of those replies; and the other nodes (sent a message, or connected: a secure sum's
#: drop-out before its masked stage).
Close = Callable[[list[Message], list[Message], list[int]], None]


def training_part(reply: Message) -> Message:
    """``reply`` without its carried records (an error reply as it is)."""
    if reply.has_error():
        return reply
    content = RecordDict({name: record for name, record in reply.content.items()
                          if name not in (EVALUATION_RECORD, EVALUATION_SITE, BRESLOW_RECORD)})
    return Message(metadata=reply.metadata, content=content)


def carried_part(reply: Message, request: str) -> Message:
    """``reply``'s carried part as an evaluate (``request`` :data:`CARRIED_EVALUATION`) or Breslow reply reads it: its
    metric record (none if the reply carries none) and a site record: the evaluation's own (the name, why a metric is
    undefined, whether the site kept its metrics; nothing else is read), else the name of the reply's."""
    content = RecordDict()
    metrics = reply.content.get(EVALUATION_RECORD if request == CARRIED_EVALUATION else BRESLOW_RECORD)
    own = reply.content.get(EVALUATION_SITE) if request == CARRIED_EVALUATION else None
    if isinstance(metrics, MetricRecord):
        content["metrics"] = metrics
    if isinstance(own, ConfigRecord):
        content[SITE_KEY] = ConfigRecord({key: own[key] for key in ("name", UNDEFINED_KEY, KEPT_LOCAL_KEY)
                                          if key in own})
    elif (site := site_record(reply.content)) is not None and "name" in site:
        content[SITE_KEY] = ConfigRecord({"name": site["name"]})
    return Message(metadata=reply.metadata, content=content)


class CarryingGrid:
    """The grid a round's training messages go through when they carry the previous round's ``request``
    (:data:`CARRIED_EVALUATION` or :data:`CARRIED_BRESLOW`): it marks the messages' config, sends them through
    ``grid``, hands the carried parts to ``close`` and returns the training parts."""

    def __init__(self, grid: Grid, close: Close, *, request: str) -> None:
        self.grid, self.close, self.request = grid, close, request

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Send ``messages`` asking for the carried part; close the carried round; the training parts. Messages that
        carry no training config (a secure sum's key stages) go through as they are."""
        messages = list(messages)
        if not messages or any("server-round" not in message.content.config_records.get("config", {})
                               for message in messages):
            return list(self.grid.send_and_receive(messages, timeout=timeout))
        for message in messages:
            config = message.content["config"]
            config[self.request] = True
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages
                if message.metadata.message_id}
        by_target: dict[int | None, list[Message]] = collections.defaultdict(list)
        for reply in replies:
            target = sent.get(reply.metadata.reply_to_message_id) if sent else reply.metadata.src_node_id
            by_target[target].append(reply)
        usable = {target: group[0] for target, group in by_target.items() if len(group) == 1
                  and not group[0].has_error() and group[0].metadata.src_node_id == target}
        asked = {message.metadata.dst_node_id for message in messages} | set(self.grid.get_node_ids())
        self.close([message for message in messages if message.metadata.dst_node_id in usable],
                   [carried_part(reply, self.request) for reply in usable.values()], sorted(asked - set(usable)))
        return [training_part(reply) for reply in replies]


class CarriedEvaluation:
    """Which round the next training message also asks about, and what closing it found.

    ``request``: what that message asks for (:data:`CARRIED_BRESLOW` for a model with a federated baseline, else
    :data:`CARRIED_EVALUATION`); ``pending``: that round, its global model and the model evaluated (None: the next
    training message asks about none); ``rolled_back``: the carried round whose model was rolled back after its
    evaluation (the training replies that came with it were trained from that model; None otherwise);
    ``stopping()``: whether a stop was requested; ``held``: what closing a carried round raised with a stop requested
    (raised once the next round is closed too).
    """

    def __init__(self, cfg: ExperimentConfig, *, needs_baseline: bool) -> None:
        self.cfg = cfg
        self.request = CARRIED_BRESLOW if needs_baseline else CARRIED_EVALUATION
        self.pending: tuple[int, ArrayRecord, ArrayRecord] | None = None
        self.rolled_back: int | None = None
        self.stopping: Callable[[], bool] = lambda: False
        self.held: Exception | None = None

    def defers(self, server_round: int, last_round: int) -> bool:
        """Whether round ``server_round + 1``'s training message asks about ``server_round``'s model
        (:func:`~strategies.rounds.records.carried_round`; with a secure sum, its masked stage), that message comes
        (not the run's last round) and the run does not stop after this round (no stop requested, not
        ``debug.stop_after_round``: it stops with this round's outputs, before the next round's training)."""
        return (server_round < last_round and self.held is None and not self.stopping()
                and server_round != self.cfg.debug.stop_after_round
                and carried_round(self.cfg, server_round + 1) == server_round)
