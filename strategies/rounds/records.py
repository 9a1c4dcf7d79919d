"""What a round's messages carry and what the server keeps of them: the message keys, the limits on a reply, the
per-round record (:class:`RoundRecord`), a named failure (:func:`failure`) and the readers of a reply's records.

Pure data and functions; the phases of a round (:mod:`strategies.rounds`) share them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from strategies.arrays import values
from strategies.config import DataConfig, ExperimentConfig

SITE_KEY = "site"
#: What a run whose sites hold out no test part (:func:`holds_test_part`) reports in place of test figures.
NO_TEST_PART = ("none: data.test_fraction = 0, so no site held out a test part and the model trained on every "
                "record; no test figure, site test metric, calibration table, Kaplan–Meier null or survival_vs_km.png, "
                "and a round's model is rolled back on its weights alone, not on the sites' predictions (score the "
                "saved model on other records: fedsurv.load_run(dir).score)")
WEIGHT_KEY = "num-examples"
BRESLOW_QUERY = "query.breslow"
BASELINE_EVENTS = "baseline.event_counts"
BASELINE_RISK = "baseline.risk_sums"
#: Query for a site's noisy recalibration sums of the final model (:mod:`models.recalibration`).
RECALIBRATION_QUERY = "query.recalibration"
#: In the recalibration query's config: the horizons (public plan).
RECALIBRATION_HORIZONS = "recalibration.horizons"
#: In the final round's evaluate config: the recalibration exponent at every cut.
RECALIBRATION_EXPONENTS = "recalibration.exponents"
#: In an evaluate reply's site record: why each undefined (NaN) metric is undefined (JSON: metric -> a code of
#: :data:`models.metrics.UNDEFINED_REASONS`; absent when every metric is defined).
UNDEFINED_KEY = "undefined"
#: In an evaluate reply's site record: ``True`` when the site kept its test metrics (its metric record is empty).
KEPT_LOCAL_KEY = "kept_local"
#: In a train reply's site record: the site's privacy state (JSON: its accountant), kept in the checkpoint.
PRIVACY_STATE_KEY = "privacy_state"
#: In a resumed run's train config: the receiving site's own privacy state from the checkpoint (JSON), for a
#: site whose node state is empty (a new run starts with empty node states). Each site gets only its own.
RESUMED_PRIVACY_STATE = "resume.privacy_state"
#: In a resumed run's train config, beside :data:`RESUMED_PRIVACY_STATE`: the rounds the server has charged the site
#: since that state (released without an accepted reply), which the site charges to its accountant before training.
RESUMED_CATCH_UP = "resume.catch_up"
#: In a training config: ``True`` when the message also asks the site for its test metrics of the model the message
#: carries, the previous round's (:func:`carried_round` says which round a site evaluates so, from its own config).
CARRIED_EVALUATION = "evaluate.carried"
#: In a training reply: the test metrics of that model (an evaluate reply's metric record), and their site record
#: (an evaluate reply's: the site's name, why a metric is undefined, whether it kept its metrics).
EVALUATION_RECORD = "evaluation"
EVALUATION_SITE = "evaluation_site"
#: In a training config of a model with a federated baseline: ``True`` when the message also asks the site for the
#: Breslow sums of the model the message carries (in place of :data:`CARRIED_EVALUATION`); in the training reply,
#: the record that carries them (a Breslow reply's metric record).
CARRIED_BRESLOW = "breslow.carried"
BRESLOW_RECORD = "breslow"
#: Query asking a node which site it is (the server names every node once, at the start of a run).
SITE_NAME_QUERY = "query.site_name"
#: The most a site's privacy state may weigh (it is kept in every checkpoint).
MAX_PRIVACY_STATE_CHARS = 1_000_000


class TooFewSitesError(RuntimeError):
    """Fewer sites' updates were accepted in a round than the federation's minimum; the run cannot go on."""


#: A failure's reason is cut to this many characters (a hostile reply must not flood metrics.jsonl and checkpoints).
MAX_REASON_CHARS = 1000
#: A reply's metric record may carry at most this many keys (more are refused by count, unread).
MAX_METRIC_KEYS = 64
#: A reply may carry at most this many bytes besides a model's worth of arrays (more are refused by count, unread).
MAX_REPLY_EXTRA_BYTES = 2_000_000


def failure(phase: str, site: str, node: int, reason: str) -> dict[str, Any]:
    """One named failure of a round: which message, which site (and node), why (cut to ``MAX_REASON_CHARS``)."""
    if len(reason) > MAX_REASON_CHARS:
        reason = f"{reason[:MAX_REASON_CHARS - 40]} ... ({len(reason) - MAX_REASON_CHARS + 40} characters cut)"
    return {"phase": phase, "site": site[:200], "node": int(node), "reason": reason}


@dataclass
class RoundRecord:
    """What the strategy learnt about one round.

    ``released``: every site whose training reply arrived, with its report if the server accepted
    it and ``None`` if it refused it (the update reached the server either way, so the ledger
    counts it), and every site that did not answer in time (``None``: it may have sent its update
    late). A site whose ClientApp failed (an error reply) released nothing that round. ``train_sites``: the accepted reports. ``privacy_states``: the state each accepted
    site reported (JSON). ``failures``: ``{"phase", "site", "node", "reason"}`` of every error,
    missing or refused reply. ``evaluate_flags``: sites whose test metrics stand far outside the
    others' (kept unless ``evaluation.screen``), and why; ``train_flags``: sites whose update's pull
    was bounded (:func:`centred_clip`), and why; ``update_spread``: each update's distance from the
    coordinate-wise median over the median distance. ``shortfall`` says why the round was not
    aggregated (too few sites), empty otherwise. ``rolled_back``: when the round's new global model
    diverged (:func:`divergence`, or most sites' predictions not finite), ``{"to_round", "reason",
    "sites"}``: the round kept the model of round ``to_round``; ``sites`` are the sites whose updates
    stood out that round (none named when no update did). ``evaluate_local``: sites that kept their test
    metrics at the site (their evaluation reply carries none; they are in no per-site or pooled figure).
    ``weight_flags``: sites whose weight was capped (:func:`capped_weights`), and why. With a robust aggregator,
    ``discarded``: each aggregated site's share of what the aggregator left out of its update (its coordinates
    outside the kept values, :func:`discarded_shares`; krum: 1 when its update was not selected, 0 when it was);
    ``discarded_most``: the sites left out more than the aggregator's even spread (:func:`discard_limit`) that round;
    ``aggregate_flags``: sites left out in more than half of the rounds they took part in (at least 2), and why.
    """

    train_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    released: dict[str, dict[str, float] | None] = field(default_factory=dict)
    evaluate_sites: dict[str, dict[str, float]] = field(default_factory=dict)
    evaluate_undefined: dict[str, dict[str, str]] = field(default_factory=dict)
    evaluate_flags: dict[str, str] = field(default_factory=dict)
    train_flags: dict[str, str] = field(default_factory=dict)
    update_spread: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    privacy_states: dict[str, str] = field(default_factory=dict)
    shortfall: str = ""
    rolled_back: dict[str, Any] = field(default_factory=dict)
    evaluate_local: list[str] = field(default_factory=list)
    weight_flags: dict[str, str] = field(default_factory=dict)
    discarded: dict[str, float] = field(default_factory=dict)
    discarded_most: list[str] = field(default_factory=list)
    aggregate_flags: dict[str, str] = field(default_factory=dict)


def holds_test_part(data: DataConfig) -> bool:
    """Whether the run's sites hold out test parts: ``data.split_col`` labels them, or ``data.test_fraction`` > 0."""
    return bool(data.split_col) or data.test_fraction > 0


def evaluated_round(cfg: ExperimentConfig, server_round: int) -> bool:
    """Whether ``server_round``'s model is evaluated: every ``evaluation.every``-th round, and the last."""
    return server_round % cfg.evaluation_every == 0 or server_round >= cfg.federation.rounds


def carried_round(cfg: ExperimentConfig, server_round: int) -> int | None:
    """The round whose model a training message of ``server_round`` also asks about under ``cfg``, or None: for the
    site's test metrics of it (:data:`CARRIED_EVALUATION`), or, for a model with a federated baseline, for its
    Breslow sums (:data:`CARRIED_BRESLOW`; its evaluation, which needs the sum of every site's, follows in an
    evaluate message).

    The previous round's, when it is an evaluated round (:func:`evaluated_round`) before the last, the sites hold test
    parts, and that model is the one the training message carries: every site is sent every training message
    (``federation.fraction_train = 1``) and the run evaluates its global model (``federation.weight_average = none``,
    not a running average). A site computes it from its own run config, the server from the run's: the server cannot
    ask a site about more rounds than its config evaluates.
    """
    previous = server_round - 1
    if (cfg.federation.weight_average != "none" or cfg.federation.fraction_train != 1.0
            or not holds_test_part(cfg.data) or previous < 1 or previous >= cfg.federation.rounds):
        return None
    return previous if evaluated_round(cfg, previous) else None


def records_of(content: RecordDict, kind: type) -> list:
    """The records of type ``kind`` in ``content``, in order, as ``content.array_records.values()`` & co. list them
    (those properties build and type-check a new dictionary at every access: a large federation reads them often)."""
    return [record for record in content.values() if isinstance(record, kind)]


def site_record(content: RecordDict) -> ConfigRecord | None:
    """``content.config_records.get(SITE_KEY)``."""
    record = content.get(SITE_KEY)
    return record if isinstance(record, ConfigRecord) else None


def claimed_name(message: Message) -> str | None:
    record = site_record(message.content)
    return None if record is None or "name" not in record else str(record["name"])


def metric_record(message: Message) -> MetricRecord | None:
    records = records_of(message.content, MetricRecord)
    return records[0] if len(records) == 1 else None



def digest(arrays: ArrayRecord) -> bytes:
    """A digest of a model's names and bytes (to recognise the same update sent twice)."""
    digest = hashlib.blake2b(digest_size=16)
    for key, array in arrays.items():
        digest.update(key.encode())
        digest.update(array.data)
    return digest.digest()


def privacy_position(rounds: Mapping[int, Any], site: str) -> tuple[str | None, int]:
    """``site``'s last privacy state the server holds and how many rounds it has charged the site since.

    ``rounds``: the strategy's round records (``privacy_states``: the state of each accepted training
    reply; ``released``: every round the server counts as released by the site, accepted, refused or
    unanswered). Returns ``(state JSON or None, rounds charged after it)``.
    """
    state, since = None, 0
    for server_round in sorted(rounds):
        record = rounds[server_round]
        if site in record.privacy_states:
            state, since = record.privacy_states[site], 0
        elif site in record.released:
            since += 1
    return state, since


def _value_bytes(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, list):
        return sum(_value_bytes(item) for item in value)
    return 8


def payload_bytes(content: RecordDict) -> int:
    """The bytes a message's records carry: its arrays' data, each key, 8 per number, each string's length."""
    arrays = sum(len(array.data) for record in records_of(content, ArrayRecord) for array in record.values())
    values = sum(len(key) + _value_bytes(value)
                 for record in (*records_of(content, MetricRecord), *records_of(content, ConfigRecord))
                 for key, value in record.items())
    return arrays + values


def numbers(record: MetricRecord) -> dict[str, Any]:
    return {key: value for key, value in record.items() if not isinstance(value, list)}



class GlobalModel:
    """The global model sent in the current round (``arrays``, None before the first), with its digest and its arrays
    as views (:func:`strategies.arrays.values`), read once a round (:meth:`of_round`)."""

    def __init__(self) -> None:
        self.arrays: ArrayRecord | None = None
        self._cached: tuple[int, bytes, dict[str, np.ndarray]] = (0, b"", {})  # round, digest, arrays as views

    def of_round(self, server_round: int) -> tuple[bytes, dict[str, np.ndarray]]:
        """The digest and the arrays (views) of the global model sent in ``server_round``."""
        assert self.arrays is not None
        if self._cached[0] != server_round:
            self._cached = (server_round, digest(self.arrays),
                            {key: values(array) for key, array in self.arrays.items()})
        return self._cached[1], self._cached[2]

    def reply_limit(self) -> int:
        """The most bytes a reply may carry: the global model's arrays and :data:`MAX_REPLY_EXTRA_BYTES`."""
        return MAX_REPLY_EXTRA_BYTES + (0 if self.arrays is None else sum(len(a.data) for a in self.arrays.values()))
