r"""Vertical learning with complete record-level DP (strategy ``private_split``): the mechanism object.

What a site does and how its noise is calibrated is :mod:`strategies.private_split`; this object
owns the run's checks, the ledger entries and the release manifest.

The unit is one record's features at every site together, under replace-one adjacency (the
server picks the IDs and sees which records a site holds, so presence is not what is protected).
A record meets, at each of the ``K`` sites: the site's private set-up (Gaussian), its encoder
statistic (Gaussian; none for ``features``) and the one release of its embedding (Laplace or
Gaussian). Each of them is counted once per site; the record-level ε composes all ``K`` sites'
(:func:`strategies.private_split.record_epsilon`): RDP for the Gaussian part, plus the Laplace
releases' pure ε. Nothing is amplified: the server knows which records were released.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from strategies.accounting.ledger import LedgerEntry
from strategies.config import ConfigError, ExperimentConfig
from strategies.mechanisms.base import Mechanism
from strategies.mechanisms.manifest import Manifest, ReleasedValue, uncovered_sentence
from strategies.mechanisms.embedding_dp import RECORD_LEVEL
from strategies.accounting.private_split import NoisePlan, PrivateSplitPlan, record_epsilon

__all__ = ["PrivateSplitDP"]


class PrivateSplitDP(Mechanism):
    """Strategy ``private_split``: private preprocessing and encoders at the sites, one release per record.

    With ``privacy.epsilon = inf`` the same protocol runs without noise (exact statistics, clipped
    embeddings in the clear): the reference for what the noise costs.
    """

    name = "private_split"
    unit = "record"
    adjacencies = ("replace-one",)
    vertical = True
    #: Whose count bounds privacy.delta (:func:`~strategies.mechanisms.base.delta_refusal`): the training records.
    delta_population = "records"
    refusals = {
        **{key: "belongs to strategy 'split' (BVFLMSP): strategy 'private_split' releases each record once, "
                "calibrated by its own accountant" for key in ("split.calibration", "split.clean_inference")},
        "resume.from": "is not offered for strategy 'private_split': a split run keeps each site's encoder in that "
                       "site's node state, which no server checkpoint can restore",
    }

    def check(self, cfg: ExperimentConfig) -> None:
        if cfg.privacy.adjacency not in self.adjacencies:
            raise ConfigError("run config: strategy 'private_split' protects a record's features under replace-one "
                              "adjacency (the server sees which records each site holds); add/remove is not offered")
        self.check_accountant(cfg)
        if cfg.privacy.setup_share == 0 and cfg.privacy.enabled and not cfg.data.dictionary:
            raise ConfigError("run config: privacy.setup_share = 0 needs data.dictionary with strategy 'private_split': "
                              "a site then releases no set-up statistic, so every numeric column's range must be public "
                              "there (an exact set-up from the records is not offered)")
        # A budget the set-up and encoder statistics leave nothing of is refused when the run knows its number of
        # sites (flwr_app.private_split_server), before any site fits or releases anything.

    def plan(self, cfg: ExperimentConfig, *, num_sites: int) -> PrivateSplitPlan:
        """The public plan of a run with ``num_sites`` modality sites."""
        return PrivateSplitPlan(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, num_sites=num_sites,
                                encoder=cfg.split.encoder, release_noise=cfg.split.release_noise,
                                clip_norm=cfg.privacy.clip_norm, dim=cfg.split.embedding_dim,
                                fit_share=cfg.split.fit_share, setup_share=cfg.privacy.setup_share)

    def ledger_entries(self, cfg: ExperimentConfig, plan: PrivateSplitPlan, noise: NoisePlan,
                       releases: Mapping[str, int], *, round_: int, notes: tuple[str, ...] = ()) -> list[LedgerEntry]:
        """One entry per modality site (its own mechanisms) and one for the record over every site.

        ``releases``: the most times any record's embedding left each site (1 with the cache; 0
        before the release). ``notes``: the sites' set-up notes (columns left out), added to the
        assumptions.
        """
        enabled = cfg.privacy.enabled
        assumptions = self.assumptions(cfg) + notes
        mechanism = f"private_split_{plan.encoder}_{plan.release_noise}" if enabled else "none"

        def entry(site: str, epsilon: float, count: int) -> LedgerEntry:
            return LedgerEntry(
                round=round_, site=site, mechanism=mechanism, unit="record" if enabled else "none",
                adjacency="replace-one" if enabled else "n/a",
                accountant="gaussian-rdp + laplace (basic composition), no amplification" if enabled else "none",
                epsilon=epsilon if enabled else None, delta=plan.delta if enabled else None,
                noise_multiplier=noise.release_scale if enabled else None,
                clip_norm=plan.clip_norm if enabled else None, sample_rate=1.0 if enabled else None, steps=count,
                epsilon_nominal=None, assumptions=assumptions,
            )

        one_site = dataclasses.replace(plan, num_sites=1)
        entries = [entry(site, record_epsilon(one_site, noise, count), count)
                   for site, count in sorted(releases.items())]
        most = max(releases.values(), default=0)
        entries.append(entry(RECORD_LEVEL, record_epsilon(plan, noise, most), sum(releases.values())))
        return entries

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        split = cfg.split
        if not cfg.privacy.enabled:
            return ("private_split without noise (privacy.epsilon = inf): exact preprocessing and encoder statistics, "
                    "each record's clipped embedding sent once in the clear; no guarantee",
                    "the server learns which record IDs each site holds (alignment)",
                    uncovered_sentence(self.manifest(cfg)))
        release = ("Laplace noise on each coordinate of the embedding clipped to L1 norm clip_norm (L1 sensitivity "
                   "2 clip_norm under replace-one; pure DP)" if split.release_noise == "laplace" else
                   "Gaussian noise on each coordinate of the embedding clipped to L2 norm clip_norm (sensitivity "
                   "2 clip_norm)")
        encoder = {
            "score": "encoder: the direction of the noisy Cox score sum_i M_i v_i at beta = 0 (v_i the record's "
                     "preprocessed features scaled to L2 norm <= 1, M_i its null martingale residual clipped to "
                     "[-2, 1]; replace-one sensitivity 4); the label holder sends the training records' residuals "
                     "to every site, so the sites learn the training labels",
            "pca": f"encoder: the top {split.embedding_dim} eigenvectors of the noisy second-moment matrix "
                   "sum_i v_i v_i^T (Frobenius sensitivity sqrt 2, symmetric Gaussian noise); no labels leave the "
                   "label holder",
            "features": "encoder: none (the privately preprocessed features are the embedding); no labels leave the "
                        "label holder",
        }[split.encoder]
        noise = ("noise: derived from the run seed in simulation (reproducible: not private against anyone who knows "
                 "the seed); drawn from the operating system's entropy at each site in a deployment, afresh for "
                 "every run (a node-config noise-seed is refused: reused, it would cancel the noise)")
        return (
            "unit: one record's features at every site together; adjacency replace-one; the server picks the IDs "
            "and knows which records were released, so no amplification is credited",
            self._setup_sentence(cfg.privacy.setup_share) + self._public(cfg.data.dictionary),
            encoder + "; computed and kept at the site, covered the same way",
            f"each record's embedding leaves each site once ({release}); the site caches it and answers any later "
            "request for the record with the same values; the label holder trains on the cached releases for as "
            "many epochs as it likes and draws prediction bands from its own Bayesian layers (post-processing)",
            f"calibration: the set-up spends privacy.setup_share = {cfg.privacy.setup_share:g} of the RDP budget, the "
            f"encoder statistics split.fit_share = {split.fit_share:g} of epsilon beyond it, the releases the rest, "
            "split equally over the sites; Gaussian mechanisms compose by RDP, the Laplace releases add their pure "
            "epsilon (basic composition)",
            f"per-site epsilon: that site's mechanisms only; '{RECORD_LEVEL}': every site's together (the record-level "
            "figure and the run's headline)",
            "not covered: which record IDs each site holds (the server learns it at alignment), and the categorical "
            "levels a site's preprocessing uses (schema; public where data.dictionary lists them)",
            noise,
            "semi-honest label holder: the sites apply the plan it sends (they recompute the noise from the public "
            "plan and refuse a second release of a record); the residuals it sends are labels, not a site's data",
            uncovered_sentence(self.manifest(cfg)),
        )

    @staticmethod
    def _setup_sentence(setup_share: float) -> str:
        """How the sites' preprocessing is fitted with ``privacy.setup_share = setup_share``: noisy sums of their
        training records, or (share 0) the dictionary."""
        if setup_share == 0:
            return ("each site takes its preprocessing from data.dictionary and releases no set-up statistic "
                    "(privacy.setup_share = 0: nothing is charged for it; a site with a numeric column the dictionary "
                    "does not list stops before it releases anything)")
        return ("each site fits its preprocessing from noisy sums of its training records (the set-up mechanism of the "
                f"horizontal strategies at one site, replace-one; every site's set-up together spends privacy.setup_share "
                f"= {setup_share:g} of the RDP budget of epsilon) and keeps it: the statistics never leave the "
                "site, and a record's influence on them, hence on every other record's release, is covered")

    @staticmethod
    def _public(dictionary: str) -> str:
        """What the run's data dictionary (``data.dictionary``, the file ``dictionary``) makes public at the sites (the
        horizontal set-up's wording)."""
        if not dictionary:
            return ""
        return (f"; public at no cost: the ranges and levels listed in {dictionary} for a site's columns (the "
                "label holder sends the dictionary to every site; its time section concerns no site)")

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        private = cfg.privacy.enabled
        released = ("clipped and noised once per record (Laplace: pure DP; Gaussian: RDP), composed with the set-up "
                    "and encoder statistics over every site" if private else "sent in the clear (no DP)")
        releases = [
            ReleasedValue("site name and modality", "the modality the site holds", "split hello, every reply", True,
                          "public: the site's role in the federation",
                          ("*/split.site.modality", "*/private_split.site.modality")),
            ReleasedValue("record IDs", "the IDs of the records the site holds", "split hello", False,
                          "the label holder aligns the modalities on them", ("query.split_hello/split.site.ids",)),
            ReleasedValue("embedding width", "the number of dimensions of the site's embedding", "private split set-up",
                          True, "a function of the public plan and the site's schema (its column count)",
                          ("train.private_split_setup/private_split.site.dim",)),
            ReleasedValue("embeddings", "each record's embedding, once", "private split release", private, released,
                          ("query.private_split_release/private_split.arrays.embeddings",)),
            ReleasedValue("presence mask", "which requested records the site holds", "private split release", False,
                          "the same information as the record IDs",
                          ("query.private_split_release/private_split.arrays.present",)),
            ReleasedValue("release count", "the most releases of any record at the site", "private split release",
                          True, "a function of the server's own requests",
                          ("query.private_split_release/private_split.privacy.*",)),
            ReleasedValue("set-up notes", "which of the site's columns its private set-up left out (no range stood "
                          "out of the noise) or settled by the scan fallback", "private split set-up", private,
                          "post-processing of the site's set-up releases" if private else "computed without noise",
                          ("train.private_split_setup/private_split.site.notes",)),
            ReleasedValue("categorical levels", "the levels the site's preprocessing one-hot encodes", "none (kept at "
                          "the site)", False, "schema: the set-up releases levels as they are; they shape the "
                          "embeddings' columns" + self._public(cfg.data.dictionary)),
        ]
        return Manifest(self.name, self.unit if private else "none", tuple(releases))

