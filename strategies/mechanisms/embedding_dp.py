r"""Differentially private embeddings for vertical split learning (BVFLMSP).

Each site clips every record's embedding to L2 norm ``C`` and adds ``N(0, σ²C²)`` to each
coordinate before sending it to the server
(:func:`strategies.mechanisms.embedding_noise.privatize_embeddings`, the site's torch code; this
module, the mechanism object and its calibration, imports no torch).

What one record's release is: the server chooses the batches and knows which IDs exist, so a
record's *features* are what is protected. Replacing them moves its clipped embedding by at most
``2C`` (replace-one, the default here); the add/remove view (a row present or absent, sensitivity
``C``) is offered for comparison. Each record is embedded once per epoch, and because the server,
not a random sampler, picks the batches, no sub-sampling amplification applies: ``E`` epochs are
``E`` Gaussian releases of noise multiplier ``σ/Δ`` (``Δ = 2`` or ``1`` in units of ``C``),
composed by RDP (:func:`embedding_epsilon`, :func:`calibrate_embedding_noise`).

The paper's calibration (:func:`paper_embedding_noise`) is ``σ = 2p·sqrt(τ ln(1/δ))/ε`` with
``p = B/N`` and ``τ = E·N/B`` iterations. It credits Poisson sub-sampling at rate ``p`` that does
not happen, and it is an asymptotic bound; it gives far less noise than the RDP accountant needs.
The ledger labels it as such and still reports the RDP ε of the noise that ran.

Not covered by either figure: the gradients the server sends back, and a record's influence on the
site's encoder weights and on its preprocessing statistics, which shape every later embedding of
every other record.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), §5, Theorem 1 and
eq. (8)–(9); Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP ``α Δ²/(2σ²)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.config import ConfigError, ExperimentConfig, PrivacyConfig
from strategies.mechanisms.base import Mechanism
from strategies.mechanisms.manifest import Manifest, ReleasedValue, uncovered_sentence
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS
from strategies.mechanisms.schedules import calibrate_gaussian_noise_multiplier
from strategies.validation import check_choice, check_count, check_positive, check_probability

__all__ = [
    "EMBEDDING_ADJACENCIES",
    "RECORD_LEVEL",
    "EmbeddingDP",
    "calibrate_embedding_noise",
    "embedding_epsilon",
    "paper_embedding_noise",
]

#: Neighbouring data sets for an embedding release, with the sensitivity in units of ``C``.
EMBEDDING_ADJACENCIES: dict[str, float] = {"replace-one": 2.0, "add-remove": 1.0}


def embedding_epsilon(*, noise_multiplier: float, epochs: int, delta: float, adjacency: str = "replace-one") -> float:
    r"""ε of ``epochs`` releases of each record's embedding, without amplification (RDP).

    Each release is a Gaussian mechanism of sensitivity ``Δ·C`` (``Δ`` = 2 for replace-one, 1 for
    add/remove) and noise ``σC``: noise multiplier ``σ/Δ``, composed over ``epochs``.

    References
    ----------
    Mironov, "Rényi Differential Privacy", CSF 2017.
    """
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    adjacency = check_choice(adjacency, tuple(EMBEDDING_ADJACENCIES), "adjacency")
    return epsilon_gaussian_rounds(
        noise_multiplier=noise_multiplier / EMBEDDING_ADJACENCIES[adjacency], rounds=check_count(epochs, "epochs"),
        delta=check_probability(delta, "delta"), orders=list(AUDIT_RDP_ORDERS),
    )


def calibrate_embedding_noise(*, epsilon: float, delta: float, epochs: int, adjacency: str = "replace-one") -> float:
    """Smallest ``σ`` (noise std ``σC``) whose :func:`embedding_epsilon` over ``epochs`` is ``≤ ε``."""
    adjacency = check_choice(adjacency, tuple(EMBEDDING_ADJACENCIES), "adjacency")
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=delta, releases=check_count(epochs, "epochs"))
    return z * EMBEDDING_ADJACENCIES[adjacency]


def paper_embedding_noise(*, epsilon: float, delta: float, batch_size: int, train_size: int, epochs: int) -> float:
    r"""The paper's calibration ``σ = 2p·sqrt(τ ln(1/δ))/ε`` (its eq. 8 with ``c_2 = 1``).

    ``p = B/N`` and ``τ = E·⌈N/B⌉`` iterations, as the paper instantiates them. The derivation
    credits sub-sampling at rate ``p``; in split learning the server picks the batches, so that
    credit does not apply. Report :func:`embedding_epsilon` of the returned σ beside it.

    References
    ----------
    BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Theorem 1, eq. (8),
    and §6 (instantiation of p, τ, δ, C).
    """
    epsilon = check_positive(epsilon, "epsilon")
    delta = check_probability(delta, "delta")
    batch_size = check_count(batch_size, "batch_size")
    train_size = check_count(train_size, "train_size")
    if batch_size > train_size:
        raise ValueError(f"batch_size {batch_size} exceeds train_size {train_size}")
    sample_rate = batch_size / train_size
    iterations = check_count(epochs, "epochs") * math.ceil(train_size / batch_size)
    return 2.0 * sample_rate * math.sqrt(iterations * math.log(1.0 / delta)) / epsilon


# --------------------------------------------------------------------------- the mechanism object

#: The ledger's site name of a split run's record-level entry (every modality's releases together).
RECORD_LEVEL = "all modalities"


class EmbeddingDP(Mechanism):
    r"""Split learning (strategy ``split``) with differentially private embeddings, or without DP.

    Each modality site clips every record's embedding to ``privacy.clip_norm`` and adds
    :math:`N(0, σ^2C^2)` before sending it; a record's embedding leaves each site once per epoch
    and once per prediction pass. σ is calibrated (``split.calibration = "rdp"``) so that the
    record's releases at every site together, without amplification, spend ``privacy.epsilon``;
    ``"paper"`` uses the BVFLMSP formula and the ledger reports the RDP ε of the σ it gives.
    With ``privacy.epsilon = inf`` the embeddings are sent in the clear.
    """

    name = "split"
    unit = "record"
    adjacencies = ("replace-one",)
    vertical = True
    #: Whose count bounds privacy.delta (:func:`~strategies.mechanisms.base.delta_refusal`): the training records.
    delta_population = "records"
    refusals = {
        "data.dictionary": "has no effect on strategy 'split', whose sites have no private set-up",
        "resume.from": "is not offered for strategy 'split': a split run keeps each site's encoder in that site's node "
                       "state, which no server checkpoint can restore",
    }

    def check(self, cfg: ExperimentConfig) -> None:
        # The vertical data set and model are the schema's checks (strategies.config.parse_flat).
        if cfg.privacy.adjacency not in self.adjacencies:
            raise ConfigError("run config: strategy 'split' protects a record's features under replace-one "
                              "adjacency; add/remove is not offered because the server picks the batch IDs and sees "
                              "which records a site holds")
        self.check_accountant(cfg)

    def planned_releases(self, cfg: ExperimentConfig) -> int:
        """The most times any record's embedding leaves one site: once per epoch (training records) or
        once per prediction pass (held-out records; 0 with clean inference)."""
        return max(cfg.federation.rounds, 0 if cfg.split.clean_inference else cfg.split.mc_samples)

    def noise_multiplier(self, cfg: ExperimentConfig, *, num_modalities: int, num_train: int) -> float:
        """σ of every site's embedding release (0 without DP).

        ``split.calibration = "rdp"``: the smallest σ whose RDP (no amplification, replace-one
        sensitivity 2C) over all of one record's releases, ``num_modalities × planned_releases``,
        stays within ``privacy.epsilon``: the record's features at every site together are the
        unit. ``"paper"``: the BVFLMSP formula for one site, ``2p·sqrt(τ ln(1/δ))/ε`` with
        ``p = B/N`` and ``τ = E⌈N/B⌉``.
        """
        privacy = cfg.privacy
        if not privacy.enabled:
            return 0.0
        if cfg.split.calibration == "paper":
            return paper_embedding_noise(epsilon=privacy.epsilon, delta=privacy.delta,
                                         batch_size=min(cfg.train.batch_size, num_train), train_size=num_train,
                                         epochs=cfg.federation.rounds)
        return calibrate_embedding_noise(epsilon=privacy.epsilon, delta=privacy.delta,
                                         epochs=num_modalities * self.planned_releases(cfg),
                                         adjacency=privacy.adjacency)

    def record_epsilon(self, privacy: PrivacyConfig, reports: Mapping[str, Mapping[str, float]]) -> float:
        """Record-level ε over every site at ``privacy.delta`` and ``privacy.adjacency``: the RDP composition of all
        sites' releases of one record.

        A record's features are split over the sites, so its guarantee composes the sites' Gaussian
        releases (no parallel composition across modalities): with ``R_k`` releases of noise
        multiplier ``σ_k/Δ`` at site ``k``, one Gaussian of ``1/z² = Σ_k R_k (Δ/σ_k)²``. ``R_k`` is
        the most releases of any record at site ``k`` (an upper bound, tight when every record is
        released equally often). 0 when nothing was released, ``inf`` when something was released
        without noise.
        """
        sensitivity = EMBEDDING_ADJACENCIES[privacy.adjacency]
        inverse_square = 0.0
        for report in reports.values():
            releases, sigma = report["releases_max"], report["noise_multiplier"]
            if releases == 0:
                continue
            if sigma == 0:
                return math.inf
            inverse_square += releases * (sensitivity / sigma) ** 2
        if inverse_square == 0:
            return 0.0
        return epsilon_gaussian_rounds(noise_multiplier=inverse_square ** -0.5, rounds=1, delta=privacy.delta,
                                       orders=list(AUDIT_RDP_ORDERS))

    def ledger_entries(self, cfg: ExperimentConfig, epoch: int, reports: Mapping[str, Mapping[str, float]],
                       noise_multiplier: float) -> list[LedgerEntry]:
        """One entry per modality site and one for the record over all modalities (:data:`RECORD_LEVEL`)."""
        enabled = cfg.privacy.enabled
        assumptions = self.assumptions(cfg)

        def entry(site: str, epsilon: float | None, nominal: float | None, releases: int) -> LedgerEntry:
            return LedgerEntry(
                round=epoch, site=site, mechanism=f"embedding_gaussian_{cfg.split.calibration}" if enabled else "none",
                unit="record" if enabled else "none", adjacency=cfg.privacy.adjacency if enabled else "n/a",
                accountant="gaussian-rdp (no amplification)" if enabled else "none",
                epsilon=epsilon if enabled else None, delta=cfg.privacy.delta if enabled else None,
                noise_multiplier=noise_multiplier if enabled else None,
                clip_norm=cfg.privacy.clip_norm if enabled else None, sample_rate=1.0 if enabled else None,
                steps=releases, epsilon_nominal=nominal if enabled else None, assumptions=assumptions,
            )

        entries = [entry(site, report["epsilon"], report["epsilon_paper"], int(report["releases_max"]))
                   for site, report in sorted(reports.items())]
        entries.append(entry(RECORD_LEVEL, self.record_epsilon(cfg.privacy, reports),
                             max(report["epsilon_paper"] for report in reports.values()),
                             int(sum(report["releases_max"] for report in reports.values()))))
        return entries

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        if not cfg.privacy.enabled:
            return ("split learning without a privacy mechanism: each site's embeddings reach the server in the clear",
                    "the server learns which record IDs each site holds (alignment)")
        calibration = (
            "sigma calibrated by RDP without amplification so that one record's releases at every site together "
            f"(sites x {self.planned_releases(cfg)} releases) spend privacy.epsilon"
            if cfg.split.calibration == "rdp" else
            "sigma from the BVFLMSP paper's formula 2p sqrt(tau ln(1/delta))/epsilon (p = B/N, tau = epochs x "
            "batches; Theorem 1 with c2 = 1): it credits sub-sampling that does not happen and composes nothing "
            "across sites; epsilon_nominal is that formula's claim, epsilon the RDP figure of this sigma")
        noise = ("noise seed: derived from the run seed in simulation (reproducible: not private against anyone who "
                 "knows the seed); drawn from the operating system's entropy (secrets) at each site in a deployment, "
                 "afresh for every run (a node-config noise-seed is refused: reused, it would cancel the noise)")
        return (
            "each site clips every record's embedding to L2 norm clip_norm and adds N(0, (sigma clip_norm)^2) per "
            "coordinate before sending it (BVFLMSP embedding perturbation)",
            calibration,
            "unit: one record's features; adjacency replace-one (sensitivity 2 clip_norm: each released embedding is "
            "a function of its own record's features, the site's current encoder weights and preprocessing, and the "
            "step's seeds; the encoders have no batch norm, so replacing one record moves no other record's release); "
            "a record's embedding is released once per epoch and once per prediction pass; the server picks the "
            "batches, so no sub-sampling amplification is credited",
            "per-site epsilon: RDP of that site's releases (protects the record's features held there); "
            f"'{RECORD_LEVEL}': RDP composition of every site's releases of the record (the record-level figure and "
            "the run's headline): a record's features are split over the sites, so no parallel composition applies",
            "not covered: the gradients the server sends back to the sites, and a record's influence on its site's "
            "encoder weights and preprocessing statistics (training mean and scale of each continuous column, "
            "categories seen), which shape every later embedding of other records: the guarantee covers the direct "
            "embedding releases only (per-sample DP-SGD of the encoders is not implemented)",
            "not covered: the labels (the server holds them) and which record IDs each site holds (the server learns "
            "it at alignment)",
            "clean inference: prediction embeddings released without noise; those records get no guarantee"
            if cfg.split.clean_inference else
            "prediction embeddings carry the same clipping and noise and are counted",
            noise,
            "semi-honest label holder: the sites apply the sigma, clip norm and number of releases it configures; "
            "a server that deviates from the protocol (sigma 0, extra prediction requests) is not defended against",
            uncovered_sentence(self.manifest(cfg)),
        )

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        private = cfg.privacy.enabled
        embeddings = ("clipped and noised per record; Gaussian RDP without amplification over every release at every "
                      "site (replace-one)") if private else "sent in the clear (no DP)"
        releases = [
            ReleasedValue("site name and modality", "the modality the site holds", "split hello, every reply", True,
                          "public: the site's role in the federation", ("*/split.site.modality",)),
            ReleasedValue("record IDs", "the IDs of the records the site holds", "split hello", False,
                          "the label holder aligns the modalities on them", ("query.split_hello/split.site.ids",)),
            ReleasedValue("training embeddings", "each requested record's embedding, once per epoch", "split step",
                          private, embeddings, ("train.split_step/split.arrays.embeddings",)),
            ReleasedValue("prediction embeddings", f"{cfg.split.mc_samples} embeddings per held-out record",
                          "split predict", private and not cfg.split.clean_inference,
                          "released without noise (split.clean_inference)" if cfg.split.clean_inference and private
                          else embeddings, ("query.split_predict/split.arrays.embeddings",)),
            ReleasedValue("presence mask", "which requested records the site holds", "split step, split predict", False,
                          "the same information as the record IDs", ("*/split.arrays.present",)),
            ReleasedValue("privacy report", "release counts and the epsilons derived from them", "split step", True,
                          "functions of the server's own requests and the public configuration",
                          ("*/split.privacy.*",)),
            ReleasedValue("encoder influence", "a record's effect on the site's encoder weights and preprocessing "
                          "statistics, hence on every later embedding of other records", "split step", False,
                          "the encoders train on raw records without DP-SGD; the preprocessing is fitted on them"),
        ]
        return Manifest(self.name, self.unit if private else "none", tuple(releases))
