"""Horizontal deployment (``data.name = "site_files"``): every site trains on its own file.

A deployed SuperNode names its file in its node config (``data-path='/data/site.csv'``, optional
``site-name='hospital-a'``). The server holds no records, so before the first round it agrees the
shared parts of the model with the sites in two messages, and sends the result with each site's first message
of the run:

1. ``site_summary``: each site splits its file into training and test parts (by a hash of each
   record under the site's own key, :func:`~models.data.federated.split_site_table`; a run asking
   it to hold out more than its node config ``max-test-share`` is refused) and returns the
   additive statistics of its training features
   (:class:`models.data.FeatureStatistics`: counts, sums, sums of squares, category counts), the
   count, sum and sum of squares of its training times and its largest training time;
2. ``site_time_histogram``: each site counts its training events and censorings in
   ``TIME_HISTOGRAM_BINS`` equal intervals up to the largest time of any site;
3. the agreed set-up: the :class:`flwr_app.task.SiteSpec` built from the sums (the preprocessing, the
   time grid, the time scale) and the site's agreed count travel in the site's first message of round 1
   (:data:`~flwr_app.site_errors.CARRIED_SETUP`, :class:`RejoiningSites`); the site keeps them in its node
   state before it handles that message (:func:`store_setup`).

The summed statistics are exactly those of the pooled training parts, so the preprocessing equals
the simulation's (up to summation order) and the time grid is the simulation's rounded to the
histogram's resolution. Nothing else leaves a site before training; the statistics are sent
without noise (the privacy ledger says so). Evaluation is federated: each site reports the global
model's metrics on its own test part (a site with a privacy policy keeps them at the site).

A SuperNode that restarts (its node state is empty) gets the agreed set-up again with its next
message (:class:`RejoiningSites`): the same values every site received, its last privacy state as the
site sealed it and the rounds the server has charged it since (claims the site checks against its own
copy: :mod:`flwr_app.site_state`); nothing new leaves any site.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from flwr_app import site_policy, site_store, task
from flwr_app.site_errors import (CARRIED_SETUP, DELTA_TOO_LARGE, NO_SETUP, TEST_SHARE_TOO_LARGE, SiteError,
                                  check_column_roles)
from flwr_app.config import DEPLOYED_DATA, DataConfig, ExperimentConfig, PrivacyConfig, parse_run_config
from models.data import FeatureStatistics, Preprocessor, RawTable, SiteData
from models.data.dictionary import DataDictionary
from models.data.federated import preprocessed_site, raw_rows, record_identities, split_site_table
from models.data.preprocess import NumericStatistics
from models.data.validate import column_differences
from models.time_grid import time_grid_from_histograms, time_histogram
from strategies.accounting.filter import SiteFilter
from strategies.mechanisms.base import SiteSetUp, delta_refusal
from strategies.mechanisms.setup_share import recalibration_history
from strategies.mechanisms.registry import horizontal_mechanism
from strategies.replies import error_message
from strategies.mechanisms.setup_statistics import (
    AgreedRanges,
    MomentRelease,
    RangeRelease,
    RecalibrationPlan,
    SecureSetup,
    SetupNoiseError,
    SetupPlan,
    SharedSetup,
    agree_ranges,
    accountant_history,
    agreed_count,
    check_inputs,
    implausible_ranges,
    noisy_count,
    pass_history,
    release_moments,
    release_ranges,
    secure_contribution,
    secure_moments_sum,
    secure_ranges_sum,
    secure_segments,
    shared_setup,
    site_levels,
)

SUMMARY = "query.site_summary"
RANGES = "query.setup_ranges"
MOMENTS = "query.setup_moments"
HISTOGRAM = "query.site_time_histogram"
PAYLOAD = "deployment"
SPEC_STATE = "deployment.spec"
SETUP_STATE = "deployment.setup"
#: Node state: the set-up secure sums this site charged (its setup_ranges release) and sent in this run.
SETUP_SUMS = "deployment.setup_sums"
#: Asks a node that appears after the set-up which site it is (its site name only; nothing else).
IDENTITY = "query.setup_site_name"
#: The site's privacy state (its accountant) in its node state, across rounds.
PRIVACY_STATE = "privacy.state"
#: In the node state of a rejoined site: the sealed state the server handed back and the rounds it says it charged
#: after it (a claim: :func:`flwr_app.site_state.restore` checks both).
RETURNED_STATE = "deployment.returned_state"
#: A site reporting more training records than this many times the sites' median is refused at set-up.
MAX_COUNT_RATIO = 100.0
#: A site whose largest time, or a feature's spread or mean, stands this many times outside the sites' is refused.
MAX_RANGE_RATIO = 100.0
#: Resolution of the federated time grid: intervals of the sites' time histograms.
TIME_HISTOGRAM_BINS = 2000
#: Node config key: the largest share of its file a site holds out as its test part (:func:`check_test_share`).
MAX_TEST_SHARE = "max-test-share"
DEFAULT_MAX_TEST_SHARE = 0.2
#: Seconds between the server's looks for a deployed site's replies (Flower's gRPC grid sleeps 3 s between looks).
PULL_INTERVAL_S = 0.1


def _payload(content: Mapping[str, Any]) -> RecordDict:
    return RecordDict({PAYLOAD: ConfigRecord({"json": json.dumps(content)})})


def _read(message: Message) -> dict[str, Any]:
    return json.loads(str(message.content.config_records[PAYLOAD]["json"]))


def exchange(grid: Grid, messages: Iterable[Message], *, timeout: float | None,
             on_reply: Callable[[Message, int | None, float], None] | None = None) -> list[Message]:
    """Push ``messages``; pull their replies until all have come or ``timeout`` seconds have passed.

    Flower's ``Grid.send_and_receive`` does the same but sleeps 3 s between looks, which a deployed
    message's round trip pays on average half of, every message. This looks every
    :data:`PULL_INTERVAL_S` (a grid's own ``pull_interval`` where it has one: the in-memory grid of a
    simulation). ``on_reply(reply, node asked, seconds waited)`` sees each reply as it comes.
    """
    messages = list(messages)
    interval = float(getattr(grid, "pull_interval", PULL_INTERVAL_S))
    started = time.monotonic()
    ids = {message_id: message.metadata.dst_node_id
           for message_id, message in zip(grid.push_messages(messages), messages) if message_id}
    waiting = set(ids)
    replies: list[Message] = []
    while waiting:
        for reply in grid.pull_messages(list(waiting)):
            waiting.discard(reply.metadata.reply_to_message_id)
            if on_reply is not None:
                on_reply(reply, ids.get(reply.metadata.reply_to_message_id), time.monotonic() - started)
            replies.append(reply)
        if not waiting or (timeout is not None and time.monotonic() - started >= timeout):
            break
        time.sleep(interval)
    return replies


def _ask(
    grid: Grid, message_type: str, contents: Mapping[int, Mapping[str, Any]], timeout: float,
) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Send one message per node; return the decoded replies and, per failed node, why it failed."""
    messages = [Message(content=_payload(content), dst_node_id=node, message_type=message_type)
                for node, content in contents.items()]
    answered: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    replies = exchange(grid, messages, timeout=timeout)
    sent = {message.metadata.message_id: message.metadata.dst_node_id for message in messages
            if message.metadata.message_id}  # the grid names each message as it pushes it
    for reply in replies:  # a reply belongs to the node asked (the SuperLink answers for a node gone offline)
        node = sent.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        if node not in contents:
            continue
        if reply.has_error():
            failed[node] = error_message(reply.error.reason)
        else:
            answered[node] = _read(reply)
    failed.update({node: f"no reply to {message_type} within {timeout:.0f} s"
                   for node in contents if node not in answered and node not in failed})
    return answered, failed


def _schema_problems(names: Mapping[int, str], statistics: Mapping[int, FeatureStatistics]) -> dict[int, str]:
    """Sites whose feature columns (names, order, numeric or categorical) differ from the most common schema.

    The schema most sites share is the reference (ties: the one of the lowest node ID); returns
    node -> what differs, naming the columns and a site that has the reference schema.
    """
    def schema(stats: FeatureStatistics) -> tuple[tuple[str, ...], frozenset[str]]:
        return stats.order, frozenset(stats.numeric)

    counts = collections.Counter(schema(stats) for stats in statistics.values())
    reference_node = min((node for node, stats in statistics.items() if counts[schema(stats)] == max(counts.values())))
    reference, reference_name = statistics[reference_node], names[reference_node]
    def kinds(stats: FeatureStatistics) -> dict[str, str]:
        return {c: "numeric" if c in stats.numeric else "categorical" for c in stats.order}

    problems: dict[int, str] = {}
    for node, stats in statistics.items():
        found = column_differences(kinds(stats), kinds(reference), reference_name=reference_name)
        if not found and stats.order != reference.order:
            found.append(f"columns in another order than at site '{reference_name}'")
        if found:
            problems[node] = f"site '{names[node]}': schema differs from the other sites: " + "; ".join(found)
    return problems


@dataclass(frozen=True)
class SiteSetup:
    """The outcome of :func:`prepare_sites`.

    Attributes
    ----------
    spec
        What every participating site received (the server builds its model from it).
    sites
        Node ID -> site name of the sites that take part.
    setups
        Site name -> its set-up (its record count, the smallest count of the sites that take part).
    left_out
        Node ID -> why that site was left out (its error reply, naming file, column and problem;
        no reply; or a schema that differs from the others').
    notes
        How the private set-up settled ranges that did not stand out of its noise (one sentence:
        :meth:`~strategies.mechanisms.setup_statistics.AgreedRanges.describe`).
    recalibration
        The recalibration planned after training (a private set-up's hazard model), or None.
    left_out_columns
        The feature columns the private set-up left out of the model (no range stood out of its noise).
    """

    spec: task.SiteSpec
    sites: dict[int, str]
    left_out: dict[int, str]
    setups: dict[str, SiteSetUp]
    notes: tuple[str, ...] = ()
    recalibration: RecalibrationPlan | None = None
    left_out_columns: tuple[str, ...] = ()


class ParticipatingSites(Grid):
    """``grid`` seen through the sites that passed the set-up: a site left out is never sent another message.

    Every call is delegated; :meth:`get_node_ids` lists only the participating nodes that are
    connected, so the strategy samples, trains and evaluates without the others.
    """

    def __init__(self, grid: Grid, node_ids: Iterable[int]) -> None:
        self._grid = grid
        self._node_ids = sorted(node_ids)

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        connected = set(self._grid.get_node_ids())
        return [node for node in self._node_ids if node in connected]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


class RejoiningSites(ParticipatingSites):
    """A deployment's grid: the sites that passed the set-up; each gets the agreed set-up with its first message, and
    again with its next message after its SuperNode restarted or came back late.

    The agreed set-up (:func:`_setup_content`: the preprocessing, time grid, agreed counts and set-up history; the
    same values every site received, nothing new from any site) travels in the message itself, under
    :data:`~flwr_app.site_errors.CARRIED_SETUP`: the site keeps it before it handles the message
    (:func:`flwr_app.client_app.carried_setup`), so the set-up costs no sequential message of its own. It goes with
    every message to a node until the node answers one without error.

    A SuperNode killed and restarted keeps its node ID (Flower binds it to the registered key) but
    its node state is empty: it would fail every later message (``NO_SETUP``). Such a node gets the set-up
    again, with its own last privacy state as the server holds it and the rounds the server has charged it since
    (``history``, :func:`privacy_position`; the site charges them to its accountant before it trains again, so its
    budget never restarts), with its next message

    * when the SuperLink says it was activated again since the set-up (``last_activated_at``), or
    * when it answers a message with the ``NO_SETUP`` error;

    a node ID that was not at the set-up is asked only which site it is (:data:`IDENTITY`) and takes
    that site's place if it is a site of the set-up whose node is no longer connected (one node per
    site: never a live site's); any other is never sent a message.

    The SuperLink's error reply for a node that went offline is given the seconds the server
    waited for it (``"node went offline ... (seen after 47 s)"``); the strategy files it once,
    under the site of the node asked.
    """

    def __init__(self, grid: Grid, setup: SiteSetup, node_sites: dict[int, str], *,
                 history: Callable[[str], tuple[str | None, int]] | None = None, timeout: float = 600.0) -> None:
        super().__init__(grid, node_sites)
        self._setup = setup
        self._node_sites = node_sites  # the strategy's own mapping: a node that takes a site's place is named there
        self._history = history or (lambda site: (None, 0))
        self._timeout = timeout
        self._activated = self._activations()
        self._pending: set[int] = set(setup.sites)  # nodes whose next message carries the set-up
        self._rejoining: set[int] = set()  # of those, the nodes that had it before
        self._refused: dict[int, str] = dict(setup.left_out)  # a site left out at set-up is never asked again

    def _activations(self) -> dict[int, str]:
        """Node -> when the SuperLink last activated it (empty where the grid does not say)."""
        try:
            return {int(info.node_id): str(info.last_activated_at) for info in self._grid.get_nodes()
                    if getattr(info, "last_activated_at", "")}
        except (AttributeError, NotImplementedError):
            return {}

    def get_node_ids(self) -> Iterable[int]:
        connected = set(self._grid.get_node_ids())
        for node, activated in self._activations().items():
            if node in self._node_sites and node in self._activated and activated != self._activated[node]:
                print(f"site '{self._node_sites[node]}' (node {node}) connected again (activated {activated}): "
                      "the agreed set-up goes with its next message", flush=True)
                self._rejoin(node)
            self._activated[node] = activated
        newcomers = sorted(connected - set(self._node_sites) - set(self._refused))
        if newcomers:
            self._name(newcomers, connected)
        return [node for node in sorted(self._node_sites) if node in connected]

    def _name(self, nodes: list[int], connected: set[int]) -> None:
        """Ask each new node which site it is; one claiming a set-up site whose node is gone takes its place."""
        messages = [Message(content=_payload({}), dst_node_id=node, message_type=IDENTITY) for node in nodes]
        claims: dict[int, str] = {}
        for reply in exchange(self._grid, messages, timeout=min(self._timeout, 60.0)):
            if not reply.has_error():
                claims[reply.metadata.src_node_id] = str(_read(reply).get("site", ""))
        for node in nodes:
            name = claims.get(node)
            holder = next((held for held, site in self._node_sites.items() if site == name), None)
            if name is None:
                self._refused[node] = "did not say which site it is"
            elif name not in self._setup.setups:
                self._refused[node] = f"claims to be {name!r}, which is not a site of this run's set-up"
            elif holder is not None and holder in connected:
                self._refused[node] = f"claims to be site {name!r}, whose node {holder} is connected"
            else:
                if holder is not None:
                    del self._node_sites[holder]
                self._node_sites[node] = name
                self._rejoin(node)
                print(f"site '{name}' is back as node {node}" + (f" (was node {holder})" if holder is not None else "")
                      + ": the agreed set-up goes with its next message", flush=True)
                continue
            print(f"node {node} joined after the set-up and is sent no message: {self._refused[node]}", flush=True)

    def _rejoin(self, node: int) -> None:
        self._pending.add(node)
        self._rejoining.add(node)

    def _carry_setup(self, message: Message) -> None:
        """Put the agreed set-up (as every site received it, with the site's own privacy position) into ``message``,
        a copy of its content (a strategy may send one content to many nodes)."""
        node = message.metadata.dst_node_id
        site = self._node_sites[node]
        state, catch_up = self._history(site) if node in self._rejoining else (None, 0)
        content = {**_setup_content(self._setup.spec, self._setup.setups[site]), "privacy_state": state,
                   "catch_up": catch_up}
        message.content = RecordDict({**message.content, CARRIED_SETUP: ConfigRecord({"json": json.dumps(content)})})

    def _settle(self, node: int) -> None:
        """``node`` answered a message that carried the set-up without error: it holds it, no later message carries it."""
        self._pending.discard(node)
        if node in self._rejoining:
            self._rejoining.discard(node)
            print(f"site '{self._node_sites[node]}' (node {node}) rejoined: it holds the agreed set-up again",
                  flush=True)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        carrying = {message.metadata.dst_node_id for message in messages} & self._pending
        for message in messages:
            if message.metadata.dst_node_id in carrying:
                self._carry_setup(message)

        def on_reply(reply: Message, node: int | None, elapsed: float) -> None:
            self._explain(reply, node, elapsed)
            if node in carrying and not reply.has_error():
                self._settle(node)

        return exchange(self._grid, messages, timeout=timeout, on_reply=on_reply)

    def _explain(self, reply: Message, node: int | None, elapsed: float) -> None:
        """Give the SuperLink's offline error its detection time; note a node that has lost its set-up."""
        if not reply.has_error() or node is None:
            return
        if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
            reply.error = Error(code=ErrorCode.NODE_UNAVAILABLE, reason=(
                f"no reply: node {node} went offline (no heartbeat within the SuperLink's patience; seen after "
                f"{elapsed:.0f} s)"))
        elif NO_SETUP in reply.error.reason and node in self._node_sites:
            self._rejoin(node)
            reply.error = Error(code=reply.error.code, reason=(
                "its node state holds no set-up (its SuperNode restarted): the agreed set-up goes to it again "
                "with its next message"))


def prepare_sites(grid: Grid, cfg: ExperimentConfig, *, timeout: float = 600.0) -> SiteSetup:
    """Agree the preprocessing, the time grid and the record counts with the connected sites and send them the result.

    With a mechanism whose set-up is private (``dp_sgd``, ``bdp``, ``distributed_dp`` with
    ``privacy.setup_share`` > 0) the sites release noisy statistics in two passes (:func:`_private_setup`); otherwise they
    send exact sums (:func:`_exact_setup`).

    A site whose file cannot be used replies with an error naming the file, the column and the
    problem; so is a site whose columns differ from the schema most sites share, or whose
    statistics stand far outside the others'. Each is reported and left out, and the run goes on
    with the others if at least ``federation.min_sites`` remain (run the rounds over
    :class:`ParticipatingSites`).

    Raises
    ------
    RuntimeError
        When fewer than ``federation.min_sites`` sites can take part (listing why each failed).
    """
    if horizontal_mechanism(cfg.strategy).uses_private_setup(cfg):
        return _private_setup(grid, cfg, timeout=timeout)
    return _exact_setup(grid, cfg, timeout=timeout)


def _named(summaries: Mapping[int, Mapping[str, Any]], left_out: dict[int, str]) -> dict[int, str]:
    """Node -> the site name it claims; a name already claimed by another node is left out."""
    names: dict[int, str] = {}
    for node, summary in sorted(summaries.items()):
        name = str(summary.get("site", ""))
        if name in names.values():
            left_out[node] = f"claims to be site {name!r}, which another node already is"
        else:
            names[node] = name
    return names


def _enough(min_sites: int, kept: Iterable[int], nodes: list[int], left_out: Mapping[int, str], *,
            report: bool = True) -> None:
    """Print why each site was left out (``report``); raise when fewer than ``min_sites`` (``federation.min_sites``)
    are kept."""
    if report:
        for node, reason in sorted(left_out.items()):
            print(f"site at node {node} left out: {reason}", flush=True)
    kept = list(kept)
    if len(kept) < min_sites:
        reasons = "\n".join(f"node {node}: {reason}" for node, reason in sorted(left_out.items()))
        raise RuntimeError(f"only {len(kept)} of {len(nodes)} sites can take part, fewer than "
                           f"federation.min_sites = {min_sites}:\n{reasons}")


def _private_setup(grid: Grid, cfg: ExperimentConfig, *, timeout: float) -> SiteSetup:
    """The differentially private set-up (:mod:`strategies.mechanisms.setup_statistics`), over messages.

    1. ``setup_ranges``: each site sends its schema (columns, which are numeric, category levels)
       and its noisy record count and range histograms; the server keeps the sites that share the
       most common schema and whose releases fit the plan and are plausible, and agrees the clip
       ranges;
    2. ``setup_moments``: each site sends its noisy time histogram and clipped moments on those
       ranges;
    3. the agreed set-up: the preprocessing, the grid, the site's agreed count, the smallest count and the
       accountant history of the set-up releases, which go with each site's first message of round 1
       (:class:`RejoiningSites`).

    With a secure set-up sum (``distributed_dp``, or ``dp_sgd`` whose ``privacy.setup_sum`` resolves to ``secure``:
    :func:`flwr_app.task.secure_setup`), pass 1 carries the schema, the noisy
    count and the levels only, and each pass's histograms and moments go through SecAgg+ with the
    distributed discrete Gaussian instead (:func:`_secure_setup_sums`): the server sees their sums only,
    with one Gaussian's noise. Every noise draw happens at the sites (their OS entropy); the server only
    adds and derives.
    """
    nodes = sorted(grid.get_node_ids())
    dictionary = DataDictionary.load(cfg.data.dictionary) if cfg.data.dictionary else None
    options = _plan_options(cfg, dictionary)
    public = None if dictionary is None else dictionary.to_dict()  # only the server needs the file
    first, left_out = _ask(grid, RANGES, {node: {"dictionary": public} for node in nodes}, timeout)
    names = _named(first, left_out)
    schemas, reference = _common_schema(first, names, left_out)
    _enough(cfg.federation.min_sites, [node for node in schemas if node not in left_out], nodes, left_out, report=False)
    plan = SetupPlan(reference[0], frozenset(reference[1]), **options)
    secure = task.secure_setup(cfg, len(nodes)) is not None  # the run's mechanism sums the set-up securely
    releases = _range_releases(first, [node for node in schemas if node not in left_out], names, left_out, plan,
                               secure=secure)
    left_out.update(_count_problems(names, {node: agreed_count(release.count) for node, release in releases.items()}))
    releases = {node: release for node, release in releases.items() if node not in left_out}
    _enough(cfg.federation.min_sites, releases, nodes, left_out)
    if secure:
        honest = tuple(float(f.honest_sites) for node in releases if (f := _announced(first[node])) is not None)
        shared, kept = _secure_setup_sums(grid, cfg, plan, releases, names, public, timeout=timeout,
                                          honest_sites=honest)
        for node in set(releases) - set(kept):
            left_out[node] = f"site '{names[node]}': its vector is not in the set-up's first secure sum"
        releases = kept
        _enough(cfg.federation.min_sites, releases, nodes, left_out)
    else:
        shared = _plain_setup_sums(grid, cfg.model.num_durations, plan, releases, names, public, timeout=timeout)
    spec = task.SiteSpec(shared.preprocessor, shared.cuts, shared.time_scale)
    counts = {node: agreed_count(release.count) for node, release in releases.items()}
    recalibration = task.plan_recalibration(cfg, shared, counts)
    filters = {node: announced for node in counts if (announced := _announced(first[node])) is not None}
    agreed = _agreed_setup(cfg, spec, counts, names, left_out, task.setup_history(cfg, plan, recalibration),
                           filters=filters)
    return dataclasses.replace(agreed, notes=shared.notes, recalibration=recalibration,
                               left_out_columns=shared.left_out)


def _common_schema(first: Mapping[int, Mapping[str, Any]], names: Mapping[int, str],
                   left_out: dict[int, str]) -> tuple[dict[int, tuple[tuple, tuple]], tuple[tuple, tuple]]:
    """Each named site's schema (its columns, its sorted numeric columns) from its pass-1 reply in ``first``, and
    the most common one; a site with another schema is added to ``left_out`` with the reason."""
    schemas = {node: (tuple(reply["columns"]), tuple(sorted(reply["numeric"]))) for node, reply in first.items()
               if node in names}
    reference = collections.Counter(schemas.values()).most_common(1)[0][0] if schemas else ((), ())
    for node, schema in schemas.items():
        if schema != reference:
            left_out[node] = (f"site '{names[node]}': schema differs from the other sites' (columns "
                              f"{list(schema[0])}, numeric {list(schema[1])}; most sites: {list(reference[0])}, "
                              f"numeric {list(reference[1])})")
    return schemas, reference


def _range_releases(first: Mapping[int, Mapping[str, Any]], nodes: list[int], names: Mapping[int, str],
                    left_out: dict[int, str], plan: SetupPlan, *, secure: bool) -> dict[int, RangeRelease]:
    """The pass-1 releases (:meth:`RangeRelease.from_dict`) of ``nodes`` that fit ``plan`` and are plausible
    (:func:`implausible_ranges`); a site whose release is refused is added to ``left_out`` with the reason."""
    releases: dict[int, RangeRelease] = {}
    for node in nodes:
        try:
            releases[node] = RangeRelease.from_dict(first[node], plan, secure=secure)
        except (KeyError, TypeError, ValueError) as err:
            left_out[node] = f"site '{names[node]}': set-up release refused: {err}"
            continue
        reason = implausible_ranges(releases[node], plan)
        if reason:
            del releases[node]
            left_out[node] = f"site '{names[node]}': set-up release refused: {reason}"
    return releases

def _agreed_ranges(plan: SetupPlan, summed: RangeRelease) -> AgreedRanges:
    """:func:`agree_ranges` and :func:`check_inputs` of pass 1's sum; a set-up the noise hides stops in one line."""
    try:
        ranges = agree_ranges(plan, summed)
        check_inputs(plan, ranges, summed)  # before the second pass
    except SetupNoiseError as err:
        raise RuntimeError(f"set-up: {err}") from None
    return ranges


def _plain_setup_sums(grid: Grid, num_durations: int, plan: SetupPlan, releases: Mapping[int, RangeRelease],
                      names: Mapping[int, str], public: Mapping[str, Any] | None, *, timeout: float) -> SharedSetup:
    """The shared set-up (its time grid of ``num_durations`` intervals) from the sites' own noisy releases: pass 1's
    (``releases``) summed here, then pass 2 (``setup_moments``) asked of every one of them."""
    summed = functools.reduce(operator.add, releases.values())
    ranges = _agreed_ranges(plan, summed)
    second, failed = _ask(grid, MOMENTS, {node: {"ranges": ranges.to_dict(), "dictionary": public}
                                          for node in releases}, timeout)
    moments = {}
    for node, reply in second.items():
        try:
            moments[node] = MomentRelease.from_dict(reply, plan, ranges)
        except (KeyError, TypeError, ValueError) as err:
            failed[node] = f"site '{names[node]}': set-up release refused: {err}"
    if failed:
        raise RuntimeError(f"sites failed in the second pass of the set-up (every site of the first pass is needed: "
                           f"its ranges count in the clip ranges): {failed}")
    return shared_setup(plan, ranges, summed, functools.reduce(operator.add, moments.values()),
                        num_durations=num_durations)


def _secure_setup_sums(grid: Grid, cfg: ExperimentConfig, plan: SetupPlan, releases: Mapping[int, RangeRelease],
                       names: Mapping[int, str], public: Mapping[str, Any] | None, *, timeout: float,
                       honest_sites: tuple[float, ...] = ()) -> tuple[SharedSetup, dict[int, RangeRelease]]:
    """The shared set-up from two secure sums (:data:`~strategies.mechanisms.setup_statistics.SECURE_RELEASES`,
    :func:`_setup_sum`) over the sites whose pass-1 count and levels (``releases``) were kept; the sites of the
    first sum are those of the second and of the run (a site dropping out of the first is left out; of the second,
    the set-up stops). ``honest_sites``: the honest sites the policy sites announced they count on, so that the
    summed noise the server derives from is the one their shares give."""
    records = sum(agreed_count(release.count) for release in releases.values())
    secure = task.secure_setup(cfg, len(releases), honest_sites)
    total, included = _setup_sum(grid, cfg.privacy, plan, sorted(releases), 1, records, public, None, seed=cfg.seed,
                                  timeout=timeout)
    kept = {node: releases[node] for node in included}
    levels = {c: tuple(sorted(set().union(*(r.levels[c] for r in kept.values())))) for c in plan.private_levels}
    try:
        summed = secure_ranges_sum(plan, secure, total, counts={str(node): r.count for node, r in kept.items()},
                                   levels=levels, records=records)
    except ValueError as err:
        raise RuntimeError(f"set-up: {err}") from None
    ranges = _agreed_ranges(plan, summed)
    secure = task.secure_setup(cfg, len(kept), honest_sites)
    records = sum(agreed_count(release.count) for release in kept.values())
    total, included = _setup_sum(grid, cfg.privacy, plan, sorted(kept), 2, records, public, ranges, seed=cfg.seed,
                                  timeout=timeout)
    if set(included) != set(kept):
        raise RuntimeError(f"sites failed in the second secure sum of the set-up (every site of the first is needed: "
                           f"its values count in the clip ranges): {sorted(names[n] for n in set(kept) - set(included))}")
    try:
        moments = secure_moments_sum(plan, secure, ranges, total, records=records, sites=len(kept))
    except ValueError as err:
        raise RuntimeError(f"set-up: {err}") from None
    return shared_setup(plan, ranges, summed, moments, num_durations=cfg.model.num_durations), kept


#: In a set-up secure sum's stage-2 message: which pass it sums (1 or 2), and the public plan's inputs (JSON).
SETUP_PASS = "setup.pass"
SETUP_PUBLIC = "setup.public"


def _setup_sum(grid: Grid, privacy: PrivacyConfig, plan: SetupPlan, nodes: list[int], setup_pass: int, records: float,
               public: Mapping[str, Any] | None, ranges: AgreedRanges | None, *, seed: int,
               timeout: float) -> tuple[np.ndarray, list[int]]:
    """One SecAgg+ sum (:class:`strategies.secure_aggregation.SecureSum`) of the sites' pass-``setup_pass`` vectors
    (:func:`setup_vector`), with the drop-outs, colluders and modulus of ``privacy`` and the node order shuffled from
    the run's ``seed``; the centred sum and the nodes in it (no sum, and every node, where the pass has no private
    value). ``RuntimeError`` in one line when it fails."""
    from strategies.secure_aggregation import SecureSum, centred, protocol_parameters

    num_shares, threshold = protocol_parameters(len(nodes), max_dropouts=privacy.max_dropouts,
                                                colluding=privacy.colluding_sites)
    dim = sum(size for _, size in secure_segments(plan, setup_pass, ranges))
    if dim == 0:  # everything this pass would sum is public (data.dictionary): nothing to ask
        return np.zeros(0, dtype=np.int64), list(nodes)
    modulus = 2 ** privacy.modulus_bits
    payload = json.dumps({"dictionary": public, "ranges": None if ranges is None else ranges.to_dict()})
    result = SecureSum(modulus=modulus, num_shares=num_shares, threshold=threshold, dimension=dim, timeout=timeout,
                       shuffle_seed=seed * 100_003 + setup_pass).run(
        grid, nodes, setup={"parties": len(nodes), "records": float(records)},
        masked_content=lambda node: RecordDict({"config": ConfigRecord({SETUP_PASS: setup_pass,
                                                                        SETUP_PUBLIC: payload})}),
        group=f"setup-{setup_pass}", min_included=len(nodes) - privacy.max_dropouts)
    if result.total is None:
        failures = "; ".join(f"node {node} ({stage}): {reason}" for stage, node, reason in result.failures)
        raise RuntimeError(f"set-up: secure sum {setup_pass} of the set-up failed: {result.shortfall} {failures}")
    return centred(result.total, modulus), sorted(result.included)


def setup_vector(message: Message, context: Context, secure: SecureSetup, records: float) -> np.ndarray:
    """A site's vector of one of the set-up's secure sums (:func:`~strategies.mechanisms.setup_statistics.
    secure_contribution`), its noise from OS entropy; ``secure``: the sum's public parameters as the site's own run
    config and policy give them (its honest count never the server's). Pass 1 was charged with the site's
    ``setup_ranges`` release and needs it; pass 2 is charged here. Each pass is released once per run."""
    cfg = parse_run_config(context.run_config)
    config = message.content["config"]
    setup_pass, request = int(config[SETUP_PASS]), json.loads(str(config[SETUP_PUBLIC]))
    released = json.loads(str(context.state.config_records[SETUP_SUMS]["json"])) if (
        SETUP_SUMS in context.state.config_records) else {}
    if setup_pass not in (1, 2) or str(setup_pass) in released.get("sent", []) or "charged" not in released or (
            released.get("run") != context.run_id):
        raise ValueError(f"set-up secure sum {setup_pass} refused: this site releases each pass once, after its "
                         "setup_ranges release of this run")
    table, train, _ = _site_table(cfg, context, notes=False)
    features = table.features.iloc[train].reset_index(drop=True)
    plan = SetupPlan.for_features(features, **_site_plan_options(cfg, request))
    ranges = None if request["ranges"] is None else AgreedRanges.from_dict(request["ranges"])
    if setup_pass == 2:
        _charge_setup(cfg, context, "setup_moments", pass_history(plan, 2))
    released["sent"] = [*released.get("sent", []), str(setup_pass)]
    context.state[SETUP_SUMS] = ConfigRecord({"json": json.dumps(released)})
    return secure_contribution(plan, secure, setup_pass, features, table.time[train], table.event[train],
                               records=records, rng=np.random.default_rng(), ranges=ranges)  # OS entropy


def _announced(reply: Mapping[str, Any]) -> SiteFilter | None:
    """The privacy filter a site announced with its first set-up release (``None`` if none, or not a valid one: the
    site's own filter still refuses what it cannot hold)."""
    try:
        announced = SiteFilter(*map(float, reply["filter"]))
    except (KeyError, TypeError, ValueError):
        return None
    valid = (announced.order == int(announced.order) >= 2 and 0 <= announced.spent and 0 < announced.delta < 1
             and announced.epsilon > 0 and announced.honest_sites == int(announced.honest_sites) >= 1
             and all(math.isfinite(value) and value >= 0 for value in dataclasses.astuple(announced)))
    return announced if valid else None


def _agreed_setup(cfg: ExperimentConfig, spec: task.SiteSpec, counts: Mapping[int, float], names: Mapping[int, str],
                  left_out: dict[int, str], prior: tuple[tuple[float, float, int], ...], *,
                  filters: Mapping[int, SiteFilter] | None = None) -> SiteSetup:
    """The outcome of :func:`prepare_sites`: every kept site's shared set-up, agreed count and the filter it announced
    (``filters``), which :class:`RejoiningSites` sends with each site's first message. With ``model.name = "auto"``
    the spec carries the widths chosen from the agreed counts (:func:`flwr_app.task.with_model_choice`)."""
    spec = task.with_model_choice(cfg, spec, counts)
    smallest, filters = min(counts.values()), filters or {}
    setups = {names[node]: SiteSetUp(count=count, min_count=smallest, prior=prior, filter=filters.get(node))
              for node, count in counts.items()}
    print(f"{len(counts)} sites ({', '.join(sorted(names[node] for node in counts))}): "
          f"about {int(sum(counts.values()))} training records, {len(spec.preprocessor.feature_names)} encoded "
          f"features, {len(spec.cuts)} time-grid points" + (" (private set-up)" if prior else "")
          + "; each site gets the agreed set-up with its first message", flush=True)
    return SiteSetup(spec, {node: names[node] for node in counts}, left_out, setups)


def _setup_content(spec: task.SiteSpec, agreed: SiteSetUp) -> dict[str, Any]:
    """The set-up message of one site: the shared preprocessing and grid, its agreed count and history, its filter."""
    return {"spec": spec.to_json(), "count": agreed.count, "min_count": agreed.min_count,
            "prior": [list(entry) for entry in agreed.prior],
            "filter": None if agreed.filter is None else list(dataclasses.astuple(agreed.filter))}


def _plan_options(cfg: ExperimentConfig, dictionary: DataDictionary | None) -> dict[str, Any]:
    """The run's set-up plan options (every site and the server build the same plan)."""
    return task.setup_plan_options(cfg, dictionary)


def _exact_setup(grid: Grid, cfg: ExperimentConfig, *, timeout: float) -> SiteSetup:
    """The set-up from exact sums (``site_summary``, ``site_time_histogram``): no noise."""
    nodes = sorted(grid.get_node_ids())
    summaries, left_out = _ask(grid, SUMMARY, {node: {} for node in nodes}, timeout)
    names = _named(summaries, left_out)
    summaries = {node: summary for node, summary in summaries.items() if node in names}
    left_out.update(_count_problems(names, {node: summary["time"][0] for node, summary in summaries.items()}))
    summaries = {node: summary for node, summary in summaries.items() if node not in left_out}
    statistics = {node: FeatureStatistics.from_dict(summary["features"]) for node, summary in summaries.items()}
    left_out.update(_schema_problems(names, statistics) if statistics else {})
    left_out.update(_range_problems(names, {node: statistics[node] for node in statistics if node not in left_out},
                                    {node: float(summaries[node]["max_time"]) for node in summaries}))
    summaries = {node: summary for node, summary in summaries.items() if node not in left_out}
    statistics = {node: statistics[node] for node in summaries}
    _enough(cfg.federation.min_sites, summaries, nodes, left_out)
    features = functools.reduce(operator.add, statistics.values())
    times = sum((NumericStatistics(*summary["time"]) for summary in summaries.values()), start=NumericStatistics())
    max_time = max(float(summary["max_time"]) for summary in summaries.values())
    histograms, failed = _ask(grid, HISTOGRAM, {node: {"max_time": max_time, "bins": TIME_HISTOGRAM_BINS}
                                                for node in summaries}, timeout)
    if failed:
        raise RuntimeError(f"sites failed to send their time histograms: {failed}")
    cuts = time_grid_from_histograms(
        np.linspace(0.0, max_time, TIME_HISTOGRAM_BINS + 1),
        np.sum([h["events"] for h in histograms.values()], axis=0),
        np.sum([h["censored"] for h in histograms.values()], axis=0),
        num_durations=cfg.model.num_durations, scheme=cfg.model.time_grid,
    )
    spec = task.SiteSpec(Preprocessor.from_statistics(features), cuts, (times.mean, times.std))
    counts = {node: float(summary["time"][0]) for node, summary in summaries.items()}
    return _agreed_setup(cfg, spec, counts, names, left_out, ())


def site_name(context: Context) -> str:
    """The site's name in metrics and the ledger: node config ``site-name``, else ``node-<id>``."""
    return str(context.node_config.get("site-name", f"node-{context.node_id}"))


def max_test_share(node_config: Mapping[str, Any]) -> float:
    """The largest share of its file a site holds out as its test part: node config :data:`MAX_TEST_SHARE`
    (default :data:`DEFAULT_MAX_TEST_SHARE`), a number in (0, 1); ``ValueError`` naming the key."""
    raw = node_config.get(MAX_TEST_SHARE, DEFAULT_MAX_TEST_SHARE)
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not 0.0 < value < 1.0:
        raise ValueError(f"node config {MAX_TEST_SHARE} = {raw!r} must be a number in (0, 1), e.g. --node-config "
                         f"\"{MAX_TEST_SHARE}=0.2\"")
    return value


def check_test_share(test_fraction: float, context: Context) -> None:
    """Refuse a run whose ``data.test_fraction`` (``test_fraction``) exceeds the site's :func:`max_test_share` (before
    the file is read):
    the test part's metrics leave the site without noise, so the site caps how many of its records they cover
    (:class:`~flwr_app.site_errors.SiteError` naming ``data.test_fraction``)."""
    limit = max_test_share(context.node_config)
    if test_fraction > limit:
        raise SiteError(f"site '{site_name(context)}' refuses data.test_fraction = {test_fraction:g}: more "
                        f"than its node config {MAX_TEST_SHARE} = {limit:g} (the share of its records it holds out "
                        f"for test metrics); run with data.test_fraction <= {limit:g}",
                        public=[(TEST_SHARE_TOO_LARGE, "data.test_fraction")])


def _site_split(data: DataConfig, context: Context, table: RawTable) -> tuple[np.ndarray, np.ndarray]:
    """The site's keyed split of ``table`` (:func:`~models.data.federated.split_site_table`) holding out
    ``data.test_fraction``: each record's identity (``data.id_col``, else its row) hashed under the site's own split
    key (:func:`flwr_app.site_store.derived_key`)."""
    path = str(context.node_config["data-path"])
    identities = record_identities(raw_rows(path), id_col=data.id_col, source=table.source)
    key = site_store.derived_key(site_store.site_dir(context.node_config), "split")
    return split_site_table(table, identities, name=site_name(context), key=key,
                            test_fraction=data.test_fraction)


def _site_table(cfg: ExperimentConfig, context: Context, *, notes: bool = True
                ) -> tuple[RawTable, np.ndarray, np.ndarray]:
    """The site's file, split into training and test parts; ``notes``: log its integer-code notes (set-up only)."""
    check_column_roles(cfg, context)  # a policy site reads its file only with its own column roles
    if "data-path" not in context.node_config:
        raise ValueError(f"node config has no 'data-path': in a deployment (data.name = {DEPLOYED_DATA!r}) every "
                         "SuperNode names its data file, e.g. --node-config \"data-path='/data/site.csv'\"")
    check_test_share(cfg.data.test_fraction, context)
    table = task.load_site_table(cfg, str(context.node_config["data-path"]), notes=notes)
    train, test = _site_split(cfg.data, context, table)
    return table, train, test


def _refuse_delta(cfg: ExperimentConfig, context: Context, train: np.ndarray) -> None:
    """A site refuses to release anything when ``privacy.delta`` exceeds 1/n, n its own training record count, for a
    mechanism that protects each site's records (:func:`~strategies.mechanisms.base.delta_refusal`; the server checks
    ``distributed_dp``'s union and ``central_dp``'s sites after the set-up). A site with a policy ignores the run's
    ``privacy.delta_override``."""
    mechanism = horizontal_mechanism(cfg.strategy)
    if site_policy.SitePolicy.from_node_config(context.node_config) is not None:  # the override is the server's key
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, delta_override=False))
    if mechanism.delta_population == "site" and (reason := delta_refusal(cfg, mechanism, {site_name(context): len(train)})):
        raise SiteError(f"site '{site_name(context)}' releases nothing: {reason}",
                        public=[(DELTA_TOO_LARGE, "privacy.delta")])


def _charge_setup(cfg: ExperimentConfig, context: Context, message: str, history: tuple | None,
                  plan: tuple | None = None) -> None:
    """Charge a set-up release to the site's own privacy policy (:mod:`flwr_app.site_policy`) before it leaves;
    ``plan``: the rest of the run, checked with the first release (with the ε the run asks for)."""
    site_policy.enforce(context.node_config, site_name(context), site_policy.Request(
        cfg.strategy, context.run_id, 0, message, "set-up statistics" if history is not None else
        "exact set-up statistics", history, plan or (), None if plan is None else cfg.privacy.epsilon,
        delta=cfg.privacy.delta))


def _planned_after_pass_1(cfg: ExperimentConfig, plan: SetupPlan, count: int, announced: SiteFilter | None) -> tuple:
    """What the run will make the site release after the set-up's first pass, as planned from its own count and the
    filter it announces: the second pass, the recalibration and every round's training (checked by a site's policy
    before the first release; where even the set-up does not fit what the filter has left, the set-up alone)."""
    if announced is None:
        return ()
    prior = accountant_history(plan) + recalibration_history(cfg)
    try:
        training = horizontal_mechanism(cfg.strategy).planned_release(
            cfg, SiteSetUp(count=count, min_count=count, prior=prior, filter=announced))
    except ValueError:  # no noise fits what is left after the set-up: the set-up's plan alone is refused
        training = ()
    return pass_history(plan, 2) + recalibration_history(cfg) + training


def stored_spec(context: Context) -> task.SiteSpec:
    """The shared preprocessing and time grid this site received at set-up."""
    if SPEC_STATE not in context.state.config_records:
        raise ValueError(f"{NO_SETUP} this site has no shared preprocessing in its node state: the server's set-up "
                         "did not reach it (or its SuperNode restarted)")
    return task.SiteSpec.from_json(str(context.state.config_records[SPEC_STATE]["json"]))


def deployed_site(cfg: ExperimentConfig, context: Context) -> SiteData:
    """This site's training and test parts, encoded with the shared preprocessing (the file's notes were logged at
    set-up: a deployed site reads its file again for every message)."""
    table, train, test = _site_table(cfg, context, notes=False)
    return preprocessed_site(table, train, test, stored_spec(context).preprocessor, name=site_name(context))


def summary(message: Message, context: Context) -> Message:
    """Additive statistics of the site's training part (features, times) and its largest training time."""
    cfg = parse_run_config(context.run_config)
    table, train, _ = _site_table(cfg, context)
    _refuse_delta(cfg, context, train)
    _charge_setup(cfg, context, "site_summary", None)
    time = table.time[train]
    return Message(content=_payload({
        "site": site_name(context),
        "features": FeatureStatistics.from_frame(table.features.iloc[train]).to_dict(),
        "time": [int(time.size), float(time.sum()), float(np.square(time).sum())],
        "max_time": float(time.max()),
    }), reply_to=message)


def _site_plan_options(cfg: ExperimentConfig, request: Mapping[str, Any]) -> dict[str, Any]:
    """A site's plan options: the run's, with the data dictionary the server sent in ``request``."""
    payload = request.get("dictionary")
    dictionary = DataDictionary.from_mapping(payload, source="the server's data dictionary") if payload else None
    return _plan_options(cfg, dictionary)


def setup_ranges(message: Message, context: Context) -> Message:
    """Pass 1 of the private set-up: the site's schema and its noisy count and range histograms."""
    cfg = parse_run_config(context.run_config)
    table, train, _ = _site_table(cfg, context)
    _refuse_delta(cfg, context, train)
    features = table.features.iloc[train].reset_index(drop=True)
    plan = SetupPlan.for_features(features, **_site_plan_options(cfg, _read(message)))
    announced = site_policy.announce(context.node_config)
    _charge_setup(cfg, context, "setup_ranges", pass_history(plan, 1),
                  _planned_after_pass_1(cfg, plan, len(train), announced))
    if task.secure_setup(cfg, 1) is not None:  # the histograms go through the secure sum: count and levels only
        if SETUP_SUMS in context.state.config_records:
            raise ValueError("setup_ranges refused: this site released its set-up count in this run already")
        release = RangeRelease(noisy_count(plan, len(train), np.random.default_rng()), {}, None,
                               site_levels(plan, features))  # OS entropy
        context.state[SETUP_SUMS] = ConfigRecord({"json": json.dumps({"run": context.run_id, "charged": 1})})
    else:
        release = release_ranges(plan, features, table.time[train], np.random.default_rng())  # OS entropy
    filter_ = {} if announced is None else {"filter": dataclasses.astuple(announced)}
    return Message(content=_payload({"site": site_name(context), "columns": list(plan.columns),
                                     "numeric": sorted(plan.numeric), **release.to_dict(), **filter_}),
                   reply_to=message)


def setup_moments(message: Message, context: Context) -> Message:
    """Pass 2 of the private set-up: the noisy time histogram and clipped moments on the agreed ranges (refused
    where the run's mechanism sums them securely: :func:`setup_vector`)."""
    cfg = parse_run_config(context.run_config)
    if task.secure_setup(cfg, 1) is not None:
        raise ValueError(f"setup_moments refused: strategy '{cfg.strategy}' sends its set-up sums through its "
                         "secure sum only")
    table, train, _ = _site_table(cfg, context)
    features = table.features.iloc[train].reset_index(drop=True)
    plan = SetupPlan.for_features(features, **_site_plan_options(cfg, _read(message)))
    ranges = AgreedRanges.from_dict(_read(message)["ranges"])
    _charge_setup(cfg, context, "setup_moments", pass_history(plan, 2))
    release = release_moments(plan, ranges, features, table.time[train], table.event[train],
                              np.random.default_rng())  # OS entropy
    return Message(content=_payload(release.to_dict()), reply_to=message)


def histogram(message: Message, context: Context) -> Message:
    """Training events and censorings per interval of the server's histogram."""
    request = _read(message)
    cfg = parse_run_config(context.run_config)
    table, train, _ = _site_table(cfg, context)
    _charge_setup(cfg, context, "site_time_histogram", None)
    edges = np.linspace(0.0, float(request["max_time"]), int(request["bins"]) + 1)
    events, censored = time_histogram(table.time[train], table.event[train], edges)
    return Message(content=_payload({"events": events.tolist(), "censored": censored.tolist()}), reply_to=message)


def store_setup(request: Mapping[str, Any], context: Context) -> None:
    """Keep the server's shared preprocessing, time grid and the agreed record counts (``request``, a set-up carried by
    a message: :class:`RejoiningSites`) in the node state.

    A set-up sent again to a restarted SuperNode also carries the site's last privacy state as the server holds it
    (sealed by the site) and ``catch_up``, the rounds the server says it charged the site since: kept, where the node
    state holds no privacy state, as a claim that the site checks before it next trains
    (:func:`flwr_app.site_state.restore`: its own copy wins; a state it did not seal is refused; ``catch_up`` is
    bounded by the rounds since the sealed state).
    """
    context.state[SPEC_STATE] = ConfigRecord({"json": str(request["spec"])})
    context.state[SETUP_STATE] = ConfigRecord({"count": float(request["count"]),
                                               "min_count": float(request["min_count"]),
                                               "prior": json.dumps(request.get("prior", [])),
                                               "filter": json.dumps(request.get("filter"))})
    catch_up, handed_back = int(request.get("catch_up", 0)), request.get("privacy_state")
    if PRIVACY_STATE not in context.state.config_records and (handed_back is not None or catch_up > 0):
        returned = ConfigRecord({"catch_up": catch_up})
        if handed_back is not None:
            returned["json"] = str(handed_back)
        context.state[RETURNED_STATE] = returned


def identity(message: Message, context: Context) -> Message:
    """Which site this node is (its node config's ``site-name``): asked of a node that appears after the set-up."""
    return Message(content=_payload({"site": site_name(context)}), reply_to=message)


def stored_setup(context: Context) -> SiteSetUp:
    """The record counts this site agreed with the server at set-up."""
    if SETUP_STATE not in context.state.config_records:
        raise ValueError(f"{NO_SETUP} this site has no agreed record count in its node state: the server's set-up "
                         "did not reach it (or its SuperNode restarted)")
    record = context.state.config_records[SETUP_STATE]
    prior = tuple((float(noise), float(rate), int(count)) for noise, rate, count in json.loads(str(record["prior"])))
    announced = json.loads(str(record["filter"])) if "filter" in record else None
    return SiteSetUp(count=float(record["count"]), min_count=float(record["min_count"]), prior=prior,
                     filter=None if announced is None else SiteFilter(*map(float, announced)))


def _range_problems(names: Mapping[int, str], statistics: Mapping[int, FeatureStatistics],
                    max_times: Mapping[int, float]) -> dict[int, str]:
    """Sites whose set-up statistics stand far outside the other sites' (node -> why).

    With three sites or more: a largest training time above :data:`MAX_RANGE_RATIO` times the
    sites' median (one such site would stretch everyone's time grid), or a numeric feature whose
    mean lies more than :data:`MAX_RANGE_RATIO` of the sites' median standard deviations from the
    sites' median mean, or whose standard deviation exceeds :data:`MAX_RANGE_RATIO` times that
    median (one such site would set everyone's standardisation). Such a site is refused, naming the
    column.
    """
    problems: dict[int, str] = {}
    nodes = [node for node in statistics if node in max_times]
    if len(nodes) < 3:
        return problems
    middle = float(np.median([max_times[node] for node in nodes]))
    for node in nodes:
        if not math.isfinite(max_times[node]) or max_times[node] > MAX_RANGE_RATIO * max(middle, 1e-12):
            problems[node] = (f"site '{names[node]}': largest training time {max_times[node]:g}, more than "
                              f"{MAX_RANGE_RATIO:g} times the sites' median {middle:g}")
    columns = set.intersection(*(set(statistics[node].numeric) for node in nodes))
    for column in sorted(columns):
        stats = {node: statistics[node].numeric[column] for node in nodes if statistics[node].numeric[column].count}
        if len(stats) < 3:
            continue
        centre = float(np.median([s.mean for s in stats.values()]))
        spread = float(np.median([s.std for s in stats.values()]))
        for node, stat in stats.items():
            if node in problems:
                continue
            if abs(stat.mean - centre) > MAX_RANGE_RATIO * spread or stat.std > MAX_RANGE_RATIO * spread:
                problems[node] = (f"site '{names[node]}': column '{column}' has mean {stat.mean:g} and standard "
                                  f"deviation {stat.std:g}, far outside the sites' (median mean {centre:g}, median "
                                  f"standard deviation {spread:g})")
    return problems


def _count_problems(names: Mapping[int, str], counts: Mapping[int, float]) -> dict[int, str]:
    """Sites whose training record count is not a positive whole number or is far above the others'.

    A site reporting more than :data:`MAX_COUNT_RATIO` times the median count of the sites would
    take over the weighted average: it is refused (node -> why).
    """
    problems: dict[int, str] = {}
    valid = {node: float(count) for node, count in counts.items()
             if isinstance(count, (int, float)) and math.isfinite(count) and count >= 1 and count == int(count)}
    for node in counts:
        if node not in valid:
            problems[node] = f"site '{names[node]}': record count {counts[node]!r} is not a positive whole number"
    if valid:
        middle = float(np.median(list(valid.values())))
        for node, count in valid.items():
            if count > MAX_COUNT_RATIO * middle:
                problems[node] = (f"site '{names[node]}': {count:g} training records, more than {MAX_COUNT_RATIO:g} "
                                  f"times the sites' median {middle:g}")
    return problems
