"""The ledger phase of a round: what the server keeps of who released what, round by round.

:class:`RoundBook` holds which node is which site, each round's :class:`~strategies.rounds.records.RoundRecord`
and its named failures. The privacy ledger (``end_of_round`` in :mod:`flwr_app.server_app`) charges every site in
a round's ``released``; a resumed run hands each site its own privacy position from these records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict

from strategies.rounds.records import (RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE, RoundRecord, failure,
                                       privacy_position)


class RoundBook:
    """The run's round records and the node -> site names fixed at set-up.

    Contract: :meth:`record` creates a round's record on first use; :meth:`fail` files a named failure under the
    site of ``node`` (``"unnamed site"`` for a node never named); nothing here sends a message.
    """

    def __init__(self) -> None:
        self.rounds: dict[int, RoundRecord] = {}
        self.node_sites: dict[int, str] = {}
        self._final_rounds: dict[int, dict[str, Any]] = {}  # rounds_state's conversion of the rounds before the latest

    def record(self, server_round: int) -> RoundRecord:
        """``server_round``'s record (a new, empty one the first time)."""
        return self.rounds.setdefault(server_round, RoundRecord())

    def fail(self, server_round: int, phase: str, node: int, reason: str) -> None:
        """File a named failure of ``phase`` under the site of ``node``."""
        self.record(server_round).failures.append(failure(phase, self.node_sites.get(node, "unnamed site"), node,
                                                          reason))

    def site_reports(self, site: str, last_round: int) -> list[dict[str, float] | None]:
        """``site``'s reports of every round up to ``last_round`` in which it released an update (None: refused)."""
        return [record.released[site] for server_round, record in sorted(self.rounds.items())
                if server_round <= last_round and site in record.released]

    def count_unanswered_as_released(self, record: RoundRecord, messages: Iterable[Message],
                                     replies: Iterable[Message]) -> None:
        """Mark in ``record.released`` (as ``None``) every known site sent a training message that no reply
        answers: a site that did not answer in time may still have trained and sent its update late (the
        server would then hold it), so its round counts as released."""
        answered = {reply.metadata.src_node_id for reply in replies}
        for message in messages:
            site = self.node_sites.get(message.metadata.dst_node_id)
            if site is not None and message.metadata.dst_node_id not in answered:
                record.released[site] = None

    def with_own_state(self, message: Message, *, array_key: str, config_key: str) -> Message:
        """``message`` with its destination site's own last privacy state as the server holds it, and the rounds
        charged to the site since (:func:`~strategies.rounds.records.privacy_position`), added to its config (if it
        has a state). No site sees another's."""
        site = self.node_sites.get(message.metadata.dst_node_id)
        state, since = privacy_position(self.rounds, site) if site is not None else (None, 0)
        if state is None:
            return message
        config = ConfigRecord(dict(message.content[config_key]))
        config[RESUMED_PRIVACY_STATE] = state
        if since:
            config[RESUMED_CATCH_UP] = since
        content = RecordDict({array_key: message.content[array_key], config_key: config})
        return Message(content=content, dst_node_id=message.metadata.dst_node_id,
                       message_type=message.metadata.message_type)

    def rounds_state(self) -> dict[int, dict[str, Any]]:
        """Every round's record as plain Python (a round before the latest is final: converted once)."""
        latest = max(self.rounds, default=0)
        for server_round, record in self.rounds.items():
            if server_round != latest and server_round not in self._final_rounds:
                self._final_rounds[server_round] = asdict(record)
        return {server_round: self._final_rounds[server_round] if server_round != latest else asdict(record)
                for server_round, record in self.rounds.items()}

    def load_rounds(self, rounds: dict[Any, dict[str, Any]]) -> None:
        """Restore :meth:`rounds_state`."""
        self.rounds = {int(server_round): RoundRecord(**record) for server_round, record in rounds.items()}
        self._final_rounds = {}
