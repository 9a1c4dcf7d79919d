"""What a privacy mechanism is in fedsurv: one object per mechanism, found by name in the registry.

A :class:`Mechanism` owns everything about one way of protecting a site's records:

* the keys it honours (:attr:`Mechanism.honours`: any other key whose effect depends on the mechanism is
  refused at a value but its default, :meth:`Mechanism.check_keys`) and its configuration checks
  (:meth:`Mechanism.check`), run once when the run config is parsed;
* the site's step (:meth:`LocalUpdateMechanism.site_round`, or a :class:`SecureSumMechanism`'s contribution): local
  training and whatever noise the mechanism
  adds before the update leaves the site, with the site's privacy state carried between rounds;
* its accounting at the server (:meth:`Mechanism.ledger_entry`): the ledger entry of a site after a
  round, computed by the server from public configuration and the set-up it agreed with the sites,
  and :meth:`Mechanism.verify`, which recomputes what a site declares and names any mismatch;
* the assumptions its figures rest on (:meth:`Mechanism.assumptions`);
* its **release manifest** (:meth:`Mechanism.manifest`): every value a site sends in a run of this
  mechanism, each marked *covered* (by which accountant, or as a function of covered values and
  public inputs only) or *uncovered* (and why).

The registry (:mod:`strategies.mechanisms.registry`) maps each ``strategy.name`` to one object, as
opacus maps an accountant's name to its class. ``flwr_app`` decodes messages and calls these
objects; no other module branches on a strategy's name.

References
----------
opacus ``accountants`` (a registry of accountants with a common interface); the release
manifest follows the "privacy ledger" idea of Abadi et al. (2016), CCS, extended to every
value a site sends.
"""

from __future__ import annotations

import fnmatch
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from strategies.accounting.filter import SiteFilter
from strategies.accounting.rdp import ACCOUNTANT_NAMES
from strategies.accounting.ledger import LedgerEntry
from strategies.config import AUTO, KEYS, STRATEGIES, ConfigError, ExperimentConfig, key_value, mechanism_keys, run_defaults, show_value

if TYPE_CHECKING:  # the heavy imports only for type checkers
    from flwr.serverapp.strategy import Strategy

    from models.data import SurvivalArrays
    from models.survival import SurvivalModel

__all__ = [
    "AGGREGATION",
    "BUDGET",
    "DELTA_CHECK",
    "DELTA_POPULATIONS",
    "HORIZONTAL",
    "HorizontalMechanism",
    "LocalUpdateMechanism",
    "LOCAL_TRAINING",
    "PRIVATE_SETUP",
    "SERVER_OPTIMIZER",
    "SecureSumMechanism",
    "Manifest",
    "Mechanism",
    "ReleasedValue",
    "SiteSetUp",
    "SiteUpdate",
    "common_releases",
    "delta_refusal",
    "noise_source",
    "record_level_closing",
    "setup_sentence",
    "uncovered_sentence",
    "update_release",
]


# The keys a mechanism may honour (strategies.config.MECHANISM_KEYS), in the groups the mechanisms declare them by.

#: A horizontal federation's sites, partition and sampling, a site's network and resumption from a checkpoint (no
#: split-learning strategy reads them).
HORIZONTAL: frozenset[str] = frozenset({
    "federation.num_sites", "federation.partition", "federation.dirichlet_alpha", "federation.min_site_records",
    "federation.fraction_train", "federation.min_sites", "model.hidden", "model.activation", "model.dropout",
    "model.risk_layer", "resume.from"})
#: Local mini-batch training at a site (FedProx's term included).
LOCAL_TRAINING: frozenset[str] = frozenset({"train.local_epochs", "train.batch_size", "train.lr", "train.weight_decay",
                                            "train.proximal_mu"})
#: How the server combines the sites' updates: FedAvg's bounded weighted mean (its weights capped) or a robust
#: aggregator.
AGGREGATION: frozenset[str] = frozenset({"federation.aggregation", "federation.update_bound",
                                         "federation.max_weight_ratio", "federation.trim_fraction",
                                         "federation.max_malicious"})
#: Flower's server optimiser, stepped toward each round's aggregate.
SERVER_OPTIMIZER: frozenset[str] = frozenset({"federation.server_optimizer", "federation.server_lr",
                                              "federation.server_momentum"})
#: Every DP mechanism's target and clipping.
BUDGET: frozenset[str] = frozenset({"privacy.epsilon", "privacy.delta", "privacy.clip_norm", "privacy.accountant",
                                    "privacy.adjacency"})
#: A private set-up: its share of the budget and the public data dictionary it takes.
PRIVATE_SETUP: frozenset[str] = frozenset({"privacy.setup_share", "data.dictionary"})
#: The override of the refusal of a delta above 1/n (:func:`delta_refusal`), by the mechanisms that check it.
DELTA_CHECK: frozenset[str] = frozenset({"privacy.delta_override"})

#: The population a horizontal mechanism's delta is for (:attr:`HorizontalMechanism.delta_population`), in words.
DELTA_POPULATIONS: Mapping[str, str] = {
    "site": "each site's training records: record-level DP at every site",
    "union": "the union of the sites' training records: one guarantee for all of them",
    "sites": "the sites: site-level DP, one site is the unit",
    "records": "the vertical federation's training records, each with all its modalities",
}


def delta_refusal(cfg: ExperimentConfig, mechanism: Mechanism, counts: Mapping[str, float]) -> str:
    """Why ``privacy.delta`` is too large for the population the run protects ("" when it is not).

    A (ε, δ) guarantee with δ > 1/n allows a mechanism that publishes one of n records outright, so
    it is refused, in one line naming ``privacy.delta``, n and where it comes from, unless
    ``privacy.delta_override = true``. n (:attr:`HorizontalMechanism.delta_population`): each site's
    training record count (``counts``: site -> count, as agreed at set-up or, at a site, its own) for the
    record-level mechanisms of one site; their sum for ``distributed_dp`` and for the vertical strategies
    (``records``: the label holder's training records); the number of sites for ``central_dp``. No refusal
    without DP or for a mechanism that declares no population.
    """
    population = getattr(mechanism, "delta_population", "")
    if not mechanism.private or not cfg.privacy.enabled or cfg.privacy.delta_override or not population:
        return ""
    delta = cfg.privacy.delta
    if population == "site":
        over = {site: float(n) for site, n in sorted(counts.items()) if delta > 1.0 / max(float(n), 1.0)}
        if not over:
            return ""
        where = ", ".join(f"n = {n:.0f} at site '{site}'" for site, n in over.items())
        n = max(over.values())
    else:
        n = float(sum(counts.values())) if population in ("union", "records") else float(len(counts))
        if not counts or delta <= 1.0 / n:
            return ""
        where = {"union": f"n = {n:.0f} records of {len(counts)} sites together", "sites": f"n = {n:.0f} sites",
                 "records": f"n = {n:.0f} training records"}[population]
    return (f"run config: privacy.delta = {delta:g} exceeds 1/n = {1.0 / n:.3g}: {where}, n the population strategy "
            f"'{mechanism.name}' protects ({DELTA_POPULATIONS[population]}); a delta above 1/n allows releasing a "
            f"record outright: set privacy.delta <= {1.0 / n:.3g} (well below it, e.g. 1/n^1.1), or "
            "privacy.delta_override = true to accept it")


@dataclass(frozen=True)
class ReleasedValue:
    """One value a site sends, and whether the run's printed ε covers it.

    Attributes
    ----------
    value
        What is sent, in a few words (e.g. ``"model update"``, ``"record count"``).
    detail
        What exactly it is.
    message
        Which message carries it (``"set-up"``, ``"train"``, ``"evaluate"``, ``"breslow"``,
        ``"site name"``, ``"split step"``, ``"split predict"``).
    covered
        True when the value is a function of the mechanism's noisy output (accounted) or of public
        inputs only.
    reason
        Covered: by which accountant, or as post-processing of what. Uncovered: why.
    wire
        Where it travels: ``"<message type>/<record>.<key>"`` patterns (``fnmatch``), e.g.
        ``"train/arrays.*"`` for every array of a training reply, so that a test can check every
        key of every reply a site sends against the manifest.
    """

    value: str
    detail: str
    message: str
    covered: bool
    reason: str
    wire: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Every value a site sends in a run of one mechanism (see :class:`ReleasedValue`)."""

    mechanism: str
    unit: str
    releases: tuple[ReleasedValue, ...]

    @property
    def covered(self) -> tuple[ReleasedValue, ...]:
        return tuple(release for release in self.releases if release.covered)

    @property
    def uncovered(self) -> tuple[ReleasedValue, ...]:
        return tuple(release for release in self.releases if not release.covered)

    def covers(self, message_type: str, key: str) -> bool:
        """Whether a value the site sends as ``key`` (``"<record>.<key>"``) in a ``message_type`` reply is listed."""
        return any(fnmatch.fnmatchcase(f"{message_type}/{key}", pattern)
                   for release in self.releases for pattern in release.wire)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON form: ``{"mechanism", "unit", "covered": [...], "uncovered": [...]}``."""
        return {"mechanism": self.mechanism, "unit": self.unit,
                "covered": [asdict(release) for release in self.covered],
                "uncovered": [asdict(release) for release in self.uncovered]}

    def as_markdown(self) -> str:
        """A table of the releases (the privacy documentation is generated from it)."""
        rows = ["| value | what it is | message | covered | why |", "| --- | --- | --- | --- | --- |"]
        rows += [f"| {r.value} | {r.detail} | {r.message} | {'yes' if r.covered else '**no**'} | {r.reason} |"
                 for r in self.releases]
        return "\n".join(rows)


@dataclass(frozen=True)
class SiteSetUp:
    """What the federation agreed about a site before training (the same at the server and the site).

    Attributes
    ----------
    count
        The site's record count as agreed at set-up: its FedAvg weight and, for DP-SGD, the
        ``n`` of its sampling rate ``q = B/n``.
    min_count
        The smallest agreed count of any site (NbAFL's ``m`` when ``privacy.min_site_records`` is 0).
    prior
        The site's releases at set-up as accountant history, ``(noise multiplier, 1.0, 1)`` per
        Gaussian release under the run's adjacency (empty when the set-up was exact or public):
        the mechanism composes them with its training releases.
    filter
        A deployed site with its own privacy policy (:mod:`flwr_app.site_policy`): its Rényi
        filter as it announced it at set-up, before the run's first release (:class:`SiteFilter`);
        the site's noise is calibrated to fit it too. ``None`` without one.
    """

    count: float
    min_count: float
    prior: tuple[tuple[float, float, int], ...] = ()
    filter: SiteFilter | None = None



@dataclass
class SiteUpdate:
    """What a site's step returns to the ClientApp.

    Attributes
    ----------
    report
        The figures the site sends with its update (every key is in the mechanism's manifest).
    state
        JSON-serialisable state the site keeps between rounds (its node state; the server's
        checkpoint keeps a copy for resumption). ``None`` for stateless mechanisms.
    contributes
        False when the site has nothing new to contribute (its budget is spent): the server gives
        its update weight 0.
    """

    report: dict[str, float]
    state: dict[str, Any] | None = None
    contributes: bool = True


def noise_source(cfg: ExperimentConfig) -> str:
    """The ledger's statement of where a site's noise comes from (deployment: OS entropy; simulation: the seed)."""
    if cfg.data.deployed:
        return ("deployment: every noise draw comes from generators seeded per round with 63 bits of the site's "
                "operating-system entropy (secrets), never from anything the server sends: nobody can reproduce it")
    return ("simulation: noise seeded from the run's seed, the round and the site; not private against anyone who "
            "knows the seed")


def recalibrates(cfg: ExperimentConfig) -> bool:
    """Whether the run recalibrates its curves privately after training: a hazard model trained by a
    mechanism with a private set-up (:mod:`models.recalibration`; the release is planned in the set-up's share)."""
    from strategies.mechanisms.registry import horizontal_mechanism  # the registry imports this module

    return (cfg.model.name == "hazard_mlp" and not STRATEGIES[cfg.strategy].vertical
            and horizontal_mechanism(cfg.strategy).uses_private_setup(cfg))


def _share_multiplier(cfg: ExperimentConfig) -> float:
    from strategies.mechanisms.setup_statistics import setup_noise_multiplier  # pandas and scipy: where a set-up runs

    return setup_noise_multiplier(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, share=cfg.privacy.setup_share)


def setup_multiplier(cfg: ExperimentConfig) -> float:
    """The noise multiplier of a run's set-up releases (all of them together one Gaussian mechanism).

    ``privacy.setup_share`` of the budget (:func:`~strategies.mechanisms.setup_statistics.setup_noise_multiplier`)
    goes to the set-up and, where the run recalibrates (:func:`recalibrates`), to the recalibration
    release too: the set-up then gets ``1 - RECALIBRATION_SHARE`` of it. 0: an exact set-up, or no DP.
    """
    if not cfg.privacy.enabled or cfg.privacy.setup_share == 0:
        return 0.0
    from strategies.mechanisms.setup_statistics import RECALIBRATION_SHARE

    z = _share_multiplier(cfg)
    return z / math.sqrt(1.0 - RECALIBRATION_SHARE) if recalibrates(cfg) else z


def recalibration_multiplier(cfg: ExperimentConfig) -> float:
    """The noise multiplier of the recalibration release (``RECALIBRATION_SHARE`` of the set-up's share); 0 without one."""
    if not cfg.privacy.enabled or not recalibrates(cfg):
        return 0.0
    from strategies.mechanisms.setup_statistics import RECALIBRATION_SHARE

    return _share_multiplier(cfg) / math.sqrt(RECALIBRATION_SHARE)


def recalibration_history(cfg: ExperimentConfig) -> tuple[tuple[float, float, int], ...]:
    """The recalibration release as accountant history (one Gaussian, sample rate 1), planned before training."""
    z = recalibration_multiplier(cfg)
    return ((z, 1.0, 1),) if z > 0 else ()


def record_level_closing(cfg: ExperimentConfig, manifest: Manifest) -> tuple[str, ...]:
    """The ledger's closing sentences of every record-level mechanism: scope, noise source, what is not covered."""
    return ("covers the site's training records; the held-out records its test metrics are computed on are not "
            "protected; sites hold disjoint records: the run's guarantee is the maximum epsilon over sites (parallel "
            "composition)",
            noise_source(cfg),
            uncovered_sentence(manifest))


def setup_sentence(cfg: ExperimentConfig, private_setup: bool) -> str:
    """The ledger's statement of how the set-up statistics were released."""
    if not private_setup:
        return ("set-up statistics (record counts, standardisation, time grid) computed from the sites' data without "
                "noise: not covered (privacy.setup_share = 0, or a mechanism without a private set-up)")
    public = (f"; public at no cost: the ranges, levels and time grid or range listed in {cfg.data.dictionary}"
              if cfg.data.dictionary else "")
    return ("set-up statistics (record count, range histograms of the numeric columns without a public range and of "
            "the training times, time histogram, clipped moments): Gaussian releases of the site's training records, "
            f"together one Gaussian mechanism with noise multiplier {setup_multiplier(cfg):.4g} (privacy.setup_share = "
            f"{cfg.privacy.setup_share:g} of the RDP budget of epsilon) under {cfg.privacy.adjacency} adjacency, "
            f"composed by {ACCOUNTANT_NAMES[cfg.privacy.accountant]} with the site's training; the preprocessing, time grid, "
            "CoxTime time scale, FedAvg weights and sampling rate are post-processing of them" + public
            + (f"; after training, where the federation is large enough for it (the entry's prior then lists it), a "
               "recalibration release (noisy sums of the final model's predicted survival powers over the site's "
               f"training records, noise multiplier {recalibration_multiplier(cfg):.4g}, RECALIBRATION_SHARE of "
               "privacy.setup_share) planned before training and composed with them"
               if recalibrates(cfg) else ""))


def update_release(covered: bool, reason: str) -> ReleasedValue:
    """The model update a site sends with every training reply."""
    return ReleasedValue("model update", "every weight of the site's model after its local training", "train", covered,
                         reason, ("train/arrays.*",))


def uncovered_sentence(manifest: Manifest) -> str:
    """The ledger's one-sentence list of what the printed epsilon does not cover."""
    names = [release.value for release in manifest.uncovered]
    if not names:
        return "every value a site sends is covered (release manifest)"
    return "not covered by epsilon (release manifest in privacy.md): " + ", ".join(names)


def common_releases(cfg: ExperimentConfig, *, private: bool, record_level: bool,
                    private_setup: bool = False, secure_sum: bool = False) -> list[ReleasedValue]:
    """The releases every horizontal mechanism shares: set-up, identity, evaluation, Breslow, participation.

    ``private``: a DP mechanism ran; ``record_level``: its unit is one record (the held-out records
    are then outside the protected unit, and the evaluation is post-processing for it);
    ``private_setup``: the set-up statistics were released with DP
    (:mod:`strategies.mechanisms.setup_statistics`) and composed in the site's accountant;
    ``secure_sum``: the sites send their set-up histograms and moments and their recalibration sums through the
    mechanism's secure sum.
    """
    held_out = private and record_level
    releases = _identity_releases(held_out)
    releases += _private_setup_releases(cfg, secure_sum=secure_sum) if private_setup else _plain_setup_releases()
    if private_setup and recalibrates(cfg):
        releases += _recalibration_releases(cfg, secure_sum=secure_sum)
    if cfg.model.name in ("cox_mlp", "cox_time", "coxph"):
        releases.append(ReleasedValue("Breslow aggregates", "events and sums of exp(risk) at risk per grid interval "
                                      "over the training records", "breslow", False, "sent without noise",
                                      ("query.breslow/metrics.*",)))
    return releases


def _identity_releases(held_out: bool) -> list[ReleasedValue]:
    """Site name, test metrics and participation; ``held_out``: the evaluation is post-processing for the
    protected unit (a record-level DP mechanism ran), so the held-out records are named unprotected."""
    return [
        ReleasedValue("site name", "the site's name (node config site-name, or its simulated partition)", "every reply",
                      True, "public: not a function of any record",
                      ("*/site.name", "query.site_summary/deployment.site", "query.setup_ranges/deployment.site")),
        ReleasedValue("test metrics", "c_index, c_index_td, ibs, inbll (oot_* where an out-of-time set exists) of the "
                      "global model on the site's held-out records and, for each undefined metric, a code saying why "
                      "(e.g. no events); no record count (the server weights them by the count agreed at set-up); a deployed "
                      "site with a privacy policy sends none, only a mark that it kept them", "evaluate", held_out,
                      "a function of the released global model and the site's held-out records only (censoring "
                      "weights from the held-out records too): post-processing for the training records; the "
                      "held-out records are not protected" if held_out else
                      "computed from the site's held-out records without noise", ("evaluate/metrics.*", "evaluate/site.undefined", "evaluate/site.kept_local")),
        ReleasedValue("participation", "which rounds the site answered (the number of rounds is public)",
                      "every message", False, "the server sees whether and when a site replies"),
    ]


def _private_setup_releases(cfg: ExperimentConfig, *, secure_sum: bool) -> list[ReleasedValue]:
    """The set-up releases when the set-up statistics were released with DP and composed in the site's
    accountant (``secure_sum``: the histograms and moments went through the secure sum)."""
    accounted = (f"Gaussian releases at set-up (noise multiplier {setup_multiplier(cfg):.4g} for all of them "
                 f"together, {cfg.privacy.adjacency}), composed by the site's accountant with its training")
    public = " and the public data dictionary" if cfg.data.dictionary else ""
    summed = ("; each site's vector carries its share of a distributed discrete Gaussian through SecAgg+, so the "
              "server unmasks only the sum over sites (strategies.mechanisms.setup_statistics, SecureSetup)"
              if secure_sum else "")
    return [
        ReleasedValue("schema", "column names, which of them are numeric, and the category levels of the columns "
                      "the data dictionary does not list", "set-up", False,
                      "the federation must agree on the columns; a category level is a record's value",
                      ("query.setup_ranges/deployment.columns", "query.setup_ranges/deployment.numeric",
                       "query.setup_ranges/deployment.levels")),
        ReleasedValue("record count", "the training record count plus noise; the agreed count (FedAvg weight, "
                      "sampling rate) is it rounded", "set-up, train", True, accounted,
                      ("query.setup_ranges/deployment.count", "train/metrics.num-examples")),
        ReleasedValue("feature statistics", "range histograms of the numeric columns on a public log grid and "
                      "the moments of the clipped values, plus noise (the shared clipping and standardisation)",
                      "set-up", True, accounted + summed + public,
                      ("query.setup_ranges/deployment.histograms", "query.setup_moments/deployment.moments")),
        ReleasedValue("time grid", "range histogram of the training times and the time histogram of events and "
                      "censorings, plus noise (the shared time grid and CoxTime's time scale)", "set-up", True,
                      accounted + summed + public,
                      ("query.setup_ranges/deployment.time", "query.setup_moments/deployment.events",
                       "query.setup_moments/deployment.censored")),
        ReleasedValue("privacy filter", "a deployed site with its own privacy policy: its Rényi filter's order, "
                      "the RDP it has spent on this data set, its limit (epsilon, delta) and the honest sites it "
                      "counts on in a secure sum, so that the run's noise is planned to fit it", "set-up", True,
                      "public: the site's own policy and the cost of what it released before (a function of "
                      "earlier plans and of noise multipliers it already released), not of any record",
                      ("query.setup_ranges/deployment.filter",)),
    ]


def _plain_setup_releases() -> list[ReleasedValue]:
    """The set-up releases when the set-up statistics were sent without noise."""
    return [
        ReleasedValue("schema", "column names and kinds, category levels", "set-up", False,
                      "the federation must agree on the columns; a category level is a record's value (a level "
                      "held by one record identifies it)", ("query.site_summary/deployment.features",)),
        ReleasedValue("feature statistics", "counts, sums, sums of squares and category counts of the training "
                      "features (the shared standardisation)", "set-up", False,
                      "sent without noise (simulation: fitted on the pooled training parts, standing for the "
                      "sites' summed statistics)", ("query.site_summary/deployment.features",)),
        ReleasedValue("time grid", "time histogram of the training events and censorings, the largest training "
                      "time, and the training times' sum and sum of squares (the shared time grid and CoxTime's "
                      "time scale)", "set-up", False, "sent without noise",
                      ("query.site_summary/deployment.time", "query.site_summary/deployment.max_time",
                       "query.site_time_histogram/deployment.*")),
        ReleasedValue("record count", "the number of training records (num-examples, the site's FedAvg weight)",
                      "set-up, train", False, "sent without noise; under add/remove adjacency the count itself is "
                      "sensitive", ("train/metrics.num-examples", "query.site_summary/deployment.time")),
    ]


def _recalibration_releases(cfg: ExperimentConfig, *, secure_sum: bool) -> list[ReleasedValue]:
    """The recalibration release after training (call only when the set-up is private and the run
    recalibrates): through the secure sum with ``secure_sum``, else a Gaussian release."""
    if secure_sum:
        return [ReleasedValue(
            "recalibration sums", "after the last round, through the secure sum: the site's rounded sums (scale "
            "gamma) over its training records of the final model's predicted survival at the plan's horizons raised "
            "to each exponent of models.recalibration, plus its discrete Gaussian share, masked by SecAgg+ (the "
            "recalibrated curves)", "recalibration", True,
            "the server learns only the sites' sum, a distributed discrete Gaussian release (Kairouz et al. 2021, "
            "Prop. 14) whose Renyi divergence is at most a Gaussian mechanism's at noise multiplier "
            f"{recalibration_multiplier(cfg):.4g} at every order (the sites' noise is raised until it is), the entry "
            "planned before training and composed by the site's accountant with the set-up and its training",
            ("query.secagg_masked/masked.masked",))]
    return [ReleasedValue(
        "recalibration sums", "after the last round: the sums over the site's training records of the final "
        "model's predicted survival at the plan's horizons raised to each exponent of models.recalibration, "
        "plus noise (the recalibrated curves)", "recalibration", True,
        f"a Gaussian release (noise multiplier {recalibration_multiplier(cfg):.4g}, sensitivity the square root "
        "of its size) planned before training and composed by the site's accountant with the set-up and its "
        "training", ("query.recalibration/metrics.power_sums",))]


class Mechanism(ABC):
    """One privacy mechanism (or none): its checks, assumptions and release manifest.

    Instances are stateless: everything about a run comes in through the
    :class:`~strategies.config.ExperimentConfig` and the arguments, so one object serves every run
    and every process. Horizontal mechanisms are :class:`HorizontalMechanism` objects; the
    split-learning protocol's embedding mechanism has its own site and server steps
    (:mod:`strategies.mechanisms.embedding_dp`).

    Attributes
    ----------
    name
        The ``strategy.name`` it is registered under.
    unit
        What one guarantee protects: ``"record"``, ``"site"`` or ``"none"``.
    adjacencies
        The neighbouring-data-set relations offered; the first is what ``privacy.adjacency =
        "auto"`` resolves to.
    accountants
        The ``privacy.accountant`` values offered, tightest sound first (what ``"auto"`` resolves
        to). ``("rdp",)`` for a mechanism whose releases only its own (Rényi) accountant bounds.
    vertical
        True for the split-learning protocol (one modality per site).
    private
        False only for :class:`~strategies.mechanisms.none.NoPrivacy`.
    honours
        The keys of :data:`strategies.config.MECHANISM_KEYS` this mechanism reads; any other of
        them must keep its default (:meth:`check_keys`), so a key it would ignore, or one whose
        effect would stack on its own, is refused rather than accepted.
    refusals
        Why it refuses some keys it does not honour, as the words that follow ``<key> = <value>``
        in the refusal (e.g. ``"would stack on ..."``); otherwise ``"has no effect on strategy ..."``.
    """

    name: str = ""
    unit: str = "record"
    adjacencies: tuple[str, ...] = ("add-remove",)
    accountants: tuple[str, ...] = ("rdp",)
    vertical: bool = False
    private: bool = True
    honours: frozenset[str] = frozenset()
    refusals: Mapping[str, str] = {}

    # ---------------------------------------------------------------- configuration

    def check(self, cfg: ExperimentConfig) -> None:
        """Refuse a configuration this mechanism cannot honour (``ConfigError`` naming the key).

        The base checks: a DP mechanism needs a finite ``privacy.epsilon``, the adjacency must be
        one the mechanism's accountant bounds, and ``privacy.accountant`` one it offers.
        """
        if self.private and not cfg.privacy.enabled:
            raise ConfigError(f"run config: strategy '{self.name}' needs a finite 'privacy.epsilon' (the target "
                              "budget)")
        if cfg.privacy.adjacency not in self.adjacencies:
            raise ConfigError(
                f"run config: privacy.adjacency = {cfg.privacy.adjacency!r} is not offered for strategy "
                f"'{self.name}'; its accountant bounds {' or '.join(self.adjacencies)} neighbours")
        if self.private:
            self.check_accountant(cfg)

    def check_keys(self, cfg: ExperimentConfig) -> None:
        """Refuse, in one line naming the key, its value, the strategy and why, any key of
        :data:`~strategies.config.MECHANISM_KEYS` that this mechanism does not honour (:attr:`honours`) at a value
        but its default for the run (``auto`` resolved for the run's strategy, model and data set)."""
        from strategies.mechanisms.registry import MECHANISMS  # the registry imports this module

        default = run_defaults(cfg)
        for name in mechanism_keys():
            value = key_value(cfg, name)
            if name in self.honours or value == default[name]:
                continue
            why = self.refusals.get(name, f"has no effect on strategy '{self.name}'")
            keep = show_value(default[name])
            if KEYS[name].setting.auto and keep != AUTO:
                keep = f"{AUTO} (here {keep})"
            takers = [other.name for other in MECHANISMS.values() if name in other.honours]
            raise ConfigError(f"run config: {name} = {show_value(value)} {why}; leave it at {keep}; "
                              + (f"honoured by {', '.join(takers)}" if takers else "no strategy honours it"))

    def check_accountant(self, cfg: ExperimentConfig) -> None:
        """``privacy.accountant`` must be one of :attr:`accountants` (``ConfigError`` naming the key)."""
        if cfg.privacy.enabled and cfg.privacy.accountant not in self.accountants:
            raise ConfigError(
                f"run config: privacy.accountant = {cfg.privacy.accountant!r} is not offered for strategy "
                f"'{self.name}' (offered: {', '.join(self.accountants)}; 'auto': {self.accountants[0]}); "
                "docs/privacy.md, 'Accounting', says which accountant bounds which mechanism")

    @abstractmethod
    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        """What the ledger's figures assume and do not cover, one sentence each."""

    @abstractmethod
    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        """Every value a site sends in this run, covered or uncovered."""


class HorizontalMechanism(Mechanism):
    """A mechanism of a horizontal federation: what the server checks and accounts, whatever the site sends.

    A site sends either its own update in a training reply (:class:`LocalUpdateMechanism`: the
    site's :meth:`~LocalUpdateMechanism.site_round`) or an integer vector into a secure sum
    (:class:`SecureSumMechanism`: the round's plan, the site's contribution, the server's step).
    Subclasses implement :meth:`ledger_entry`, :meth:`assumptions` and :meth:`manifest`, and
    declare the figures a site reports (:meth:`report_keys`) and those the server recomputes
    (:meth:`expected_report`).

    Attributes
    ----------
    pooled_baseline
        True when the centralised baseline runs this mechanism on the pooled training data (one
        site holding every record); otherwise it trains without DP.
    server_side
        True when the server adds the noise (through :meth:`wrap_strategy`).
    private_setup
        True when the run's set-up statistics (record counts, clip ranges and standardisation,
        time grid) are released with DP and composed with training
        (:mod:`strategies.mechanisms.setup_statistics`; ``privacy.setup_share``).
    delta_population
        Whose count ``n`` bounds ``privacy.delta`` (δ > 1/n is refused, :func:`delta_refusal`).
    """

    pooled_baseline: bool = False
    server_side: bool = False
    private_setup: bool = False
    #: Whose count n bounds ``privacy.delta`` (:func:`delta_refusal`, :data:`DELTA_POPULATIONS`): ``"site"`` (each
    #: site's records), ``"union"`` (all sites' records), ``"sites"`` (the number of sites) or ``""`` (no DP).
    delta_population: str = "site"

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.privacy.enabled and self.uses_private_setup(cfg):  # before any site releases anything
            from strategies.accounting.rdp import floor_refusal  # no pandas: the set-up's own module is not needed

            if refusal := floor_refusal(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta,
                                        what="the private set-up's RDP accounting"):
                raise ConfigError(refusal)
        if cfg.data.dictionary and not self.uses_private_setup(cfg):
            raise ConfigError(
                f"run config: 'data.dictionary' = {cfg.data.dictionary!r} makes the private set-up's ranges, levels "
                f"and time grid public; strategy '{self.name}' with privacy.setup_share = {cfg.privacy.setup_share:g} "
                "has no private set-up (dp_sgd, bdp and distributed_dp do, with privacy.setup_share > 0)")
        if cfg.data.deployed and cfg.resume_from and self.uses_private_setup(cfg):
            raise ConfigError(
                "run config: 'resume.from' in a deployment would run the private set-up again: a second release of "
                "the set-up statistics that the ledger does not count, and a different preprocessing; resuming a "
                "deployed run needs privacy.setup_share = 0 (an exact set-up, not covered by epsilon)")

    # ---------------------------------------------------------------- the server

    def wrap_strategy(self, strategy: Strategy, cfg: ExperimentConfig, *, num_sites: int) -> Strategy:
        """The strategy that aggregates the sites' updates (a server-side mechanism wraps it)."""
        return strategy

    def min_train_sites(self, cfg: ExperimentConfig, *, num_sites: int) -> int:
        """The fewest sites whose training replies a round may aggregate."""
        return cfg.federation.min_sites

    def aggregation_weight(self, setup: SiteSetUp) -> float:
        """A site's FedAvg weight: its agreed record count (equal weights where the mechanism needs them)."""
        return float(setup.count)

    def recalibration_spread(self, cfg: ExperimentConfig, sites: int) -> float:
        """The noise std of the recalibration's summed power sums over one release's (:func:`recalibration_multiplier`
        times the sensitivity): ``sqrt(sites)`` where each of ``sites`` sites adds all of its own noise."""
        return math.sqrt(sites)

    def expected_report(self, cfg: ExperimentConfig, *, setup: SiteSetUp,
                        previous: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
        """The figures an honest site reports after this round, recomputed from public inputs.

        ``previous``: the site's reports of the earlier rounds in which it released an update
        (``None`` where a report was refused). Only the figures the server can recompute;
        :meth:`verify` compares them with the report.
        """
        return {}

    def verify(self, cfg: ExperimentConfig, report: Mapping[str, float], *, setup: SiteSetUp,
               previous: Sequence[Mapping[str, float] | None]) -> str:
        """Why a site's report is not what the mechanism would produce ("" when it is).

        Checks that the report carries exactly the mechanism's figures (:meth:`report_keys`), as
        finite numbers, and that every figure the server can recompute (:meth:`expected_report`)
        matches to a relative 1e-6.
        """
        allowed = set(self.report_keys(cfg))
        unexpected = sorted(set(report) - allowed)
        if unexpected:
            return f"reply carries figures this mechanism does not send: {', '.join(unexpected)}"
        missing = sorted(allowed - set(report))
        if missing:
            return f"reply lacks the mechanism's figures: {', '.join(missing)}"
        for key, value in report.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                return f"{key} = {value!r} is not a finite number"
        for key, expected in self.expected_report(cfg, setup=setup, previous=previous).items():
            if not math.isclose(float(report[key]), expected, rel_tol=1e-6, abs_tol=1e-12):
                return (f"{key} = {float(report[key]):.6g} does not match {expected:.6g}, recomputed at the server "
                        "from the mechanism's parameters")
        return ""

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        """The figures a site sends with every training update (its report; listed in the manifest)."""
        return ()

    @abstractmethod
    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        """``site``'s privacy position after ``server_round``.

        ``reports``: the site's reports of every round in which it released an update, this one
        last (``None`` where the server refused a report; the entry then takes the most an honest
        site could have spent, or no bound where none can be given).
        """

    # ---------------------------------------------------------------- helpers for subclasses

    def planned_release(self, cfg: ExperimentConfig, setup: SiteSetUp) -> tuple[tuple[float, float, int], ...]:
        """Every round's releases of a site together, as planned before the first (``()`` where the mechanism chooses
        them as it goes): a site's policy checks the plan before it releases anything."""
        return ()

    def uses_private_setup(self, cfg: ExperimentConfig) -> bool:
        """Whether the run agrees its set-up with DP (:attr:`private_setup` and ``privacy.setup_share`` > 0)."""
        return self.private_setup and cfg.privacy.setup_share > 0

    def _manifest(self, cfg: ExperimentConfig, own: Iterable[ReleasedValue], *, record_level: bool | None = None) -> Manifest:
        record_level = self.unit == "record" if record_level is None else record_level
        releases = list(own) + common_releases(cfg, private=self.private, record_level=record_level,
                                               private_setup=self.uses_private_setup(cfg),
                                               secure_sum=isinstance(self, SecureSumMechanism))
        return Manifest(self.name, self.unit, tuple(releases))


class LocalUpdateMechanism(HorizontalMechanism):
    """A mechanism whose site trains from the global model and sends its (privatised) update in a training reply."""

    # ---------------------------------------------------------------- the site

    @abstractmethod
    def site_round(self, model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int,
                   state: dict[str, Any] | None, setup: SiteSetUp) -> SiteUpdate:
        """One round at a site: train ``model`` in place from the global weights and privatise it."""

    def round_release(self, cfg: ExperimentConfig, setup: SiteSetUp, update: SiteUpdate,
                      previous: dict[str, Any] | None) -> tuple[tuple[float, float, int], ...] | None:
        """What a site's update of one round releases, as accountant history ``(noise multiplier, sample rate,
        steps)`` under add/remove adjacency, from what the site itself ran (``previous``: its privacy state before
        the round); ``None`` when the releases are not such a history: a site's privacy filter cannot charge them
        (:mod:`flwr_app.site_policy` refuses the mechanism)."""
        return None


class SecureSumMechanism(HorizontalMechanism):
    """A mechanism whose sites send integer vectors into a secure sum (:mod:`strategies.secure_aggregation`); the
    server sees only the sum. Each round: the public :meth:`plan`, each site's :meth:`contribution`, and the
    server's :meth:`server_step` from the unmasked sum."""

    @abstractmethod
    def plan(self, cfg: ExperimentConfig, *, parties: int, records: float, dim: int, setup: SiteSetUp,
             honest_sites: Sequence[float] = ()) -> Any:
        """The round's public parameters, the same at the server and every site; ``honest_sites``: the honest sites
        that the policies of the sites taking part count on (a site passes its own, the server those announced)."""

    def site_release(self, cfg: ExperimentConfig, plan: Any) -> tuple[tuple[float, float, int], ...] | None:
        """What a site's vector of one round costs, as a Gaussian history a site's filter charges; ``None`` when it
        is not such a history (:mod:`flwr_app.site_policy` refuses the mechanism)."""
        return None

    @abstractmethod
    def contribution(self, model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, plan: Any, *,
                     seed: int) -> Any:
        """The site's integer vector of the round (before masking)."""

    @abstractmethod
    def server_step(self, arrays: Mapping[str, Any], total: Any, plan: Any, *, count: float, lr: float,
                    state: dict[str, Any] | None, sites: int | None = None,
                    count_std: float = 0.0) -> tuple[dict[str, Any] | None, dict[str, Any], str]:
        """The server's step from the unmasked sum: ``(new arrays, its state, "")``, or ``(None, state, reason)``
        when the sum is refused."""

    @abstractmethod
    def recalibration_plan(self, cfg: ExperimentConfig, *, parties: int, records: float, size: int,
                           honest_sites: Sequence[float] = ()) -> Any:
        """The public plan of the recalibration's secure sum of ``size`` power sums (:mod:`models.recalibration`)."""

    @abstractmethod
    def recalibration_contribution(self, terms: Any, plan: Any, *, rng: Any) -> Any:
        """The site's integer vector of the recalibration sum from its records' power terms (before masking)."""

    @abstractmethod
    def recalibration_sums(self, total: Any, plan: Any, *, count: float, sites: int,
                           count_std: float = 0.0) -> tuple[Any, str]:
        """The noisy power sums from the unmasked sum: ``(sums, "")``, or ``(None, reason)`` when it is refused."""
