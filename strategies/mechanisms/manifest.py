"""What a site sends and what the ledger says about it: the release manifest and the ledger's shared sentences.

A mechanism's **release manifest** (:class:`Manifest`) lists every value a site sends in a run of
it, each marked *covered* (by which accountant, or as a function of covered values and public
inputs only) or *uncovered* (and why), with the wire keys it travels under (a test checks every key
of every reply against it). :func:`common_releases` are the releases every horizontal mechanism
shares (set-up, identity, evaluation, Breslow, participation); :func:`record_level_closing`,
:func:`setup_sentence`, :func:`noise_source` and :func:`uncovered_sentence` are the ledger's
sentences that several mechanisms state alike.

References
----------
The release manifest follows the "privacy ledger" idea of Abadi et al. (2016), CCS, extended to
every value a site sends.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass
from typing import Any

from strategies.accounting.rdp import ACCOUNTANT_NAMES
from strategies.config import ExperimentConfig
from strategies.mechanisms.setup_share import recalibrates, recalibration_multiplier, setup_multiplier

__all__ = [
    "Manifest",
    "ReleasedValue",
    "common_releases",
    "noise_source",
    "record_level_closing",
    "setup_sentence",
    "uncovered_sentence",
    "update_release",
]


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


def noise_source(deployed: bool) -> str:
    """The ledger's statement of where a site's noise comes from (``deployed``, i.e. ``data.deployed``: OS entropy;
    simulation: the seed)."""
    if deployed:
        return ("deployment: every noise draw comes from generators seeded per round with 63 bits of the site's "
                "operating-system entropy (secrets), never from anything the server sends: nobody can reproduce it")
    return ("simulation: noise seeded from the run's seed, the round and the site; not private against anyone who "
            "knows the seed")


def record_level_closing(cfg: ExperimentConfig, manifest: Manifest) -> tuple[str, ...]:
    """The ledger's closing sentences of every record-level mechanism: scope, noise source, what is not covered."""
    return ("covers the site's training records; the held-out records its test metrics are computed on are not "
            "protected; sites hold disjoint records: the run's guarantee is the maximum epsilon over sites (parallel "
            "composition)",
            noise_source(cfg.data.deployed),
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
    return "not covered by epsilon (release manifest in docs/privacy-reference.md): " + ", ".join(names)


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
                                      "over the training records, of each evaluated round's model (with the next "
                                      "round's training reply where that message carries the model)",
                                      "breslow, or the next train", False, "sent without noise",
                                      ("query.breslow/metrics.*", "train/breslow.*", "query.secagg_masked/breslow.*")))
    return releases


def _identity_releases(held_out: bool) -> list[ReleasedValue]:
    """Site name, test metrics and participation; ``held_out``: the evaluation is post-processing for the
    protected unit (a record-level DP mechanism ran), so the held-out records are named unprotected."""
    return [
        ReleasedValue("site name", "the site's name (node config site-name, or its simulated partition)", "every reply",
                      True, "public: not a function of any record",
                      ("*/site.name", "train/evaluation_site.name", "query.secagg_masked/evaluation_site.name",
                       "query.site_summary/deployment.site", "query.setup_ranges/deployment.site")),
        ReleasedValue("test metrics", "c_index, c_index_td, ibs, inbll (oot_* where an out-of-time set exists) of the "
                      "global model on the site's held-out records and, for each undefined metric, a code saying why "
                      "(e.g. no events); no record count (the server weights them by the count agreed at set-up); a deployed "
                      "site with a privacy policy sends none, only a mark that it kept them; where the next round's "
                      "training message carries the round's model (strategies.rounds.records.carried_round), they "
                      "travel with its reply (distributed_dp: the masked stage's), in records of their own, and only "
                      "in the rounds the site's own run config evaluates", "evaluate, or the next train", held_out,
                      "a function of the released global model and the site's held-out records only (censoring "
                      "weights from the held-out records too): post-processing for the training records; the "
                      "held-out records are not protected" if held_out else
                      "computed from the site's held-out records without noise",
                      ("evaluate/metrics.*", "evaluate/site.undefined", "evaluate/site.kept_local",
                       *(f"{kind}/{key}" for kind in ("train", "query.secagg_masked")
                         for key in ("evaluation.*", "evaluation_site.undefined", "evaluation_site.kept_local")))),
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
