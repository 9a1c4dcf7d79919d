"""A deployed site gets the agreed set-up with its first message, and again with its next message when its SuperNode
restarts (empty node state), and trains (:class:`flwr_app.deployment.RejoiningSites`, with a grid whose nodes run the
site-side mod and handlers directly)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from flwr_app import client_app, deployment, task
from flwr_app.deployment import RejoiningSites, SiteSetup
from flwr_app.site_errors import CARRIED_SETUP
from strategies.horizontal import privacy_position
from models.data import FeatureStatistics, Preprocessor
from strategies.horizontal import RoundRecord
from strategies.mechanisms.base import SiteSetUp, SiteUpdate

TRAIN = "train"


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages built outside a run need the identity the in-process runner sets."""
    from flwr.supercore.task_identity import TaskIdentity

    from simulations.engine import SUPERLINK_NODE_ID, new_run_id

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, new_run_id(), SUPERLINK_NODE_ID


def _setup() -> SiteSetup:
    frame = pd.DataFrame({"age": [50.0, 60.0, 70.0], "sex": ["F", "M", "F"]})
    spec = task.SiteSpec(Preprocessor.from_statistics(FeatureStatistics.from_frame(frame)),
                         np.array([0.0, 10.0, 20.0]), (10.0, 5.0))
    prior = ((3.0, 1.0, 1),)
    setups = {"site-a": SiteSetUp(count=100.0, min_count=80.0, prior=prior),
              "site-b": SiteSetUp(count=80.0, min_count=80.0, prior=prior)}
    return SiteSetup(spec, {1: "site-a", 2: "site-b"}, {9: "left out at set-up"}, setups)


class NodeGrid:
    """Nodes that answer through the site's set-up mod (:func:`flwr_app.client_app.carried_setup`) and the deployment's
    site-side handlers; ``TRAIN`` needs the set-up in the node state. ``messaged``: (node, message type, whether the
    message carried the set-up)."""

    def __init__(self, setup: SiteSetup) -> None:
        self.nodes = {node: SimpleNamespace(state=RecordDict(), node_config={"site-name": site}, node_id=node)
                      for node, site in setup.sites.items()}
        self.online = set(self.nodes)
        self.activated = {node: "t0" for node in self.nodes}
        self.messaged: list[tuple[int, str, bool]] = []
        self.pushed: dict[str, Message] = {}
        self.failing: set[int] = set()  # nodes whose handler fails (after the mod kept the set-up)

    def restart(self, node: int, *, activated: str = "t1", site: str | None = None) -> None:
        """The node's SuperNode restarts: its node state is empty (``site``: under that site's name)."""
        name = site or self.nodes.get(node, SimpleNamespace(node_config={})).node_config.get("site-name")
        self.nodes[node] = SimpleNamespace(state=RecordDict(), node_config={"site-name": name}, node_id=node)
        self.online.add(node)
        self.activated[node] = activated

    def get_node_ids(self):
        return sorted(self.online)

    def get_nodes(self):
        return [SimpleNamespace(node_id=node, last_activated_at=self.activated[node]) for node in sorted(self.online)]

    def _answer(self, message: Message) -> Message:
        node, kind = message.metadata.dst_node_id, message.metadata.message_type
        self.messaged.append((node, kind, CARRIED_SETUP in message.content))
        context = self.nodes[node]
        try:
            return client_app.carried_setup(message, context, self._handle)
        except ValueError as err:
            return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=message)

    def _handle(self, message: Message, context) -> Message:
        if message.metadata.dst_node_id in self.failing:
            raise ValueError("the site's disk is full")
        if message.metadata.message_type == deployment.IDENTITY:
            return deployment.identity(message, context)
        deployment.stored_spec(context)
        deployment.stored_setup(context)
        return Message(content=RecordDict({"c": ConfigRecord({"ok": 1})}), reply_to=message)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id
            self.pushed[message.metadata.message_id] = message
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for message_id in message_ids:
            message = self.pushed.pop(message_id)
            if message.metadata.dst_node_id in self.online:
                replies.append(self._answer(message))
            else:  # the SuperLink's reply for a node that stopped sending heartbeats
                replies.append(Message(error=Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"),
                                       reply_to=message))
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def _round(grid: RejoiningSites) -> dict[int, Message]:
    """One message to every participating node; node -> its reply (by the message it answers)."""
    messages = [Message(content=RecordDict(), dst_node_id=node, message_type=TRAIN) for node in grid.get_node_ids()]
    replies = list(grid.send_and_receive(messages, timeout=5))
    sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages}
    return {sent[reply.metadata.reply_to_message_id]: reply for reply in replies}


def test_each_site_gets_the_setup_with_its_first_message_only():
    setup = _setup()
    nodes = NodeGrid(setup)
    grid = RejoiningSites(nodes, setup, dict(setup.sites), timeout=5)
    assert all(not reply.has_error() for reply in _round(grid).values())
    assert sorted(nodes.messaged) == [(1, TRAIN, True), (2, TRAIN, True)]  # no message of its own
    for node, site in setup.sites.items():
        assert deployment.stored_setup(nodes.nodes[node]) == setup.setups[site]
        assert deployment.stored_spec(nodes.nodes[node]).to_json() == setup.spec.to_json()
        assert deployment.RETURNED_STATE not in nodes.nodes[node].state.config_records
    nodes.messaged.clear()
    _round(grid)
    assert sorted(nodes.messaged) == [(1, TRAIN, False), (2, TRAIN, False)]


def test_a_site_whose_first_message_fails_gets_the_setup_again_with_its_next():
    setup = _setup()
    nodes = NodeGrid(setup)
    grid = RejoiningSites(nodes, setup, dict(setup.sites), timeout=5)
    nodes.failing.add(2)  # its first message fails
    replies = _round(grid)
    assert replies[2].has_error() and not replies[1].has_error()
    nodes.failing.clear()
    nodes.messaged.clear()
    replies = _round(grid)
    assert sorted(nodes.messaged) == [(1, TRAIN, False), (2, TRAIN, True)]
    assert not any(reply.has_error() for reply in replies.values())


def test_a_restarted_node_gets_the_agreed_setup_again_with_its_privacy_position_with_its_next_message():
    setup = _setup()
    nodes = NodeGrid(setup)
    node_sites = dict(setup.sites)
    rounds = {1: RoundRecord(released={"site-a": {}, "site-b": {}}, privacy_states={"site-a": '{"s": 1}',
                                                                                     "site-b": '{"s": 1}'}),
              2: RoundRecord(released={"site-a": {}, "site-b": None}, privacy_states={"site-a": '{"s": 2}'})}
    grid = RejoiningSites(nodes, setup, node_sites, history=lambda site: privacy_position(rounds, site), timeout=5)
    assert all(not reply.has_error() for reply in _round(grid).values())
    nodes.restart(2)  # same node ID (Flower binds it to the key), empty node state, activated again
    nodes.messaged.clear()
    replies = _round(grid)
    assert all(not reply.has_error() for reply in replies.values()) and set(replies) == {1, 2}
    assert sorted(nodes.messaged) == [(1, TRAIN, False), (2, TRAIN, True)]  # the set-up to node 2 only
    state = nodes.nodes[2].state.config_records
    assert deployment.stored_setup(nodes.nodes[2]) == setup.setups["site-b"]
    assert deployment.stored_spec(nodes.nodes[2]).to_json() == setup.spec.to_json()
    assert state[deployment.RETURNED_STATE]["json"] == '{"s": 1}'  # its own last state, never another site's
    assert state[deployment.RETURNED_STATE]["catch_up"] == 1  # round 2 was charged to it without its state
    assert deployment.PRIVACY_STATE not in state  # a claim the site checks before it trains, not its state
    nodes.messaged.clear()
    _round(grid)
    assert sorted(nodes.messaged) == [(1, TRAIN, False), (2, TRAIN, False)]  # sent once


def test_a_node_that_says_it_has_no_setup_gets_it_with_its_next_message():
    setup = _setup()
    nodes = NodeGrid(setup)
    grid = RejoiningSites(nodes, setup, dict(setup.sites), timeout=5)
    _round(grid)
    nodes.restart(2, activated="t0")  # the SuperLink does not say it was activated again
    replies = _round(grid)
    assert replies[2].has_error() and "holds no set-up" in replies[2].error.reason
    assert "no set-up" in replies[2].error.reason and not replies[1].has_error()
    nodes.messaged.clear()
    replies = _round(grid)
    assert sorted(nodes.messaged) == [(1, TRAIN, False), (2, TRAIN, True)]
    assert not any(reply.has_error() for reply in replies.values())


def test_the_superlinks_offline_reply_says_when_the_server_saw_it():
    setup = _setup()
    nodes = NodeGrid(setup)
    grid = RejoiningSites(nodes, setup, dict(setup.sites), timeout=5)
    messages = [Message(content=RecordDict(), dst_node_id=node, message_type=TRAIN) for node in grid.get_node_ids()]
    nodes.online.discard(2)
    replies = {reply.metadata.reply_to_message_id: reply for reply in grid.send_and_receive(messages, timeout=5)}
    error = replies[messages[1].metadata.message_id].error
    assert error.code == ErrorCode.NODE_UNAVAILABLE
    assert error.reason.startswith("no reply: node 2 went offline") and "seen after 0 s" in error.reason
    assert grid.get_node_ids() == [1]


def test_a_new_node_takes_a_site_only_when_that_sites_node_is_gone():
    setup = _setup()
    nodes = NodeGrid(setup)
    node_sites = dict(setup.sites)
    grid = RejoiningSites(nodes, setup, node_sites, timeout=5)
    nodes.restart(7, site="site-a")  # claims a live site
    nodes.restart(8, site="site-z")  # not a site of the set-up
    nodes.restart(9, site="site-b")  # left out at set-up: never asked again, though it claims a site
    assert grid.get_node_ids() == [1, 2] and node_sites == setup.sites
    nodes.online.discard(2)
    nodes.restart(5, site="site-b")  # site-b's key registered again: a new node ID, the old node gone
    nodes.messaged.clear()
    assert grid.get_node_ids() == [1, 5] and node_sites == {1: "site-a", 5: "site-b"}
    assert nodes.messaged == [(5, deployment.IDENTITY, False)]  # 7, 8 and 9 are asked nothing again
    assert not any(reply.has_error() for reply in _round(grid).values())
    assert (5, TRAIN, True) in nodes.messaged and all(node not in (7, 8, 9) for node, _, _ in nodes.messaged)


def test_privacy_position_counts_the_rounds_charged_after_the_last_state():
    rounds = {1: RoundRecord(released={"a": {}}, privacy_states={"a": "s1"}),
              2: RoundRecord(released={"a": None}), 3: RoundRecord(), 4: RoundRecord(released={"a": None})}
    assert privacy_position(rounds, "a") == ("s1", 2)
    assert privacy_position(rounds, "b") == (None, 0)
    assert privacy_position({1: RoundRecord(released={"a": None})}, "a") == (None, 1)


def test_a_handed_back_state_never_replaces_the_sites_own():
    setup = _setup()
    context = SimpleNamespace(state=RecordDict({deployment.PRIVACY_STATE: ConfigRecord({"json": '{"own": 1}'})}))
    agreed = setup.setups["site-a"]
    deployment.store_setup({"spec": setup.spec.to_json(), "count": agreed.count, "min_count": agreed.min_count,
                            "prior": [], "privacy_state": '{"server": 1}', "catch_up": 2}, context)
    assert context.state.config_records[deployment.PRIVACY_STATE]["json"] == '{"own": 1}'
    assert deployment.RETURNED_STATE not in context.state.config_records


class _Counting:
    def site_round(self, model, data, cfg, *, seed, state, setup):
        return SiteUpdate({}, {"rounds": (state or {"rounds": 0})["rounds"] + 1})


def _site_context(tmp_path, state=None, run=7):
    return SimpleNamespace(state=state or RecordDict(), node_config={"site-dir": str(tmp_path / "site")}, run_id=run)


DEPLOYED = SimpleNamespace(data=SimpleNamespace(deployed=True), federation=SimpleNamespace(rounds=10))


def _sealed(context, state, server_round, site="site-a", run=None):
    from flwr_app import site_state

    return site_state.seal(state, key=site_state.state_key(context.node_config, True), site=site,
                           run=context.run_id if run is None else run, server_round=server_round)


def test_a_rejoined_site_charges_the_rounds_it_missed_before_it_trains(tmp_path):
    """A restarted site without its own copy: the sealed state handed back, and the rounds charged after it, bounded
    by the rounds since that state (a server claiming a million charges one)."""
    context = _site_context(tmp_path)
    sealed = _sealed(context, {"rounds": 1}, server_round=1)
    context.state[deployment.RETURNED_STATE] = ConfigRecord({"json": sealed, "catch_up": 1_000_000})
    site = SimpleNamespace(train=None, name="site-a")
    state = client_app._caught_up(context, ConfigRecord(), DEPLOYED, _Counting(), object(), site, None, 0, 3)
    assert state == {"rounds": 2}  # round 2 only: the state is of round 1, this is round 3
    assert json.loads(context.state.config_records[deployment.PRIVACY_STATE]["json"]) == {"rounds": 2}
    assert deployment.RETURNED_STATE not in context.state.config_records
    assert client_app._caught_up(context, ConfigRecord(), DEPLOYED, _Counting(), object(), site, None, 0, 3) == state


def test_a_resumed_site_charges_the_rounds_released_after_its_checkpointed_state_once(tmp_path):
    """A resumed run: the node state is empty; the train config hands back the site's last state and the rounds the
    server charged it since (a round it did not answer before the crash); the site charges them once."""
    from strategies.horizontal import RESUMED_CATCH_UP, RESUMED_PRIVACY_STATE

    context = _site_context(tmp_path, run=8)
    config = ConfigRecord({RESUMED_PRIVACY_STATE: _sealed(context, {"rounds": 1}, 1, run=7), RESUMED_CATCH_UP: 2})
    site = SimpleNamespace(train=None, name="site-a")
    assert client_app._caught_up(context, config, DEPLOYED, _Counting(), object(), site, None, 0, 4) == {"rounds": 3}
    assert client_app._caught_up(context, config, DEPLOYED, _Counting(), object(), site, None, 0, 4) == {"rounds": 3}


class SlowGrid:
    """Answers each message on the third look for it (or never, for the nodes in ``silent``)."""

    def __init__(self, silent=()) -> None:
        self.silent, self.looks, self.pushed = set(silent), 0, {}

    def push_messages(self, messages):
        ids = []
        for number, message in enumerate(messages):
            message.metadata.__dict__["_message_id"] = f"m{number}"
            self.pushed[f"m{number}"] = message
            ids.append(f"m{number}")
        return ids

    def pull_messages(self, message_ids):
        self.looks += 1
        if self.looks < 3:
            return []
        return [Message(content=RecordDict(), reply_to=self.pushed[message_id]) for message_id in message_ids
                if self.pushed[message_id].metadata.dst_node_id not in self.silent]


def test_exchange_looks_for_replies_every_tenth_of_a_second_and_gives_up_at_the_timeout():
    """Flower's grid sleeps 3 s between looks; the deployment's exchange looks every PULL_INTERVAL_S, names the node
    each reply answers for, and stops at the timeout with the replies it has."""
    messages = [Message(content=RecordDict(), dst_node_id=node, message_type=TRAIN) for node in (7, 8)]
    seen = []
    started = time.monotonic()
    replies = deployment.exchange(SlowGrid(), messages, timeout=30,
                                  on_reply=lambda reply, node, waited: seen.append((node, waited)))
    assert len(replies) == 2 and sorted(node for node, _ in seen) == [7, 8]
    assert time.monotonic() - started < 2 * 3 * deployment.PULL_INTERVAL_S + 0.5
    started = time.monotonic()
    messages = [Message(content=RecordDict(), dst_node_id=node, message_type=TRAIN) for node in (7, 8)]
    replies = deployment.exchange(SlowGrid(silent={8}), messages, timeout=1.0)
    assert [reply.metadata.reply_to_message_id for reply in replies] == ["m0"]
    assert 1.0 <= time.monotonic() - started < 1.0 + 3 * deployment.PULL_INTERVAL_S
