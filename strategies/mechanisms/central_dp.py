r"""Client-level central DP at the server (strategy ``central_dp``): Flower's fixed-clipping wrapper.

Each round the server clips every site's update :math:`\Delta_k` to L2 norm ``C`` and adds
:math:`N(0, (\sigma C / m)^2)` to the mean of the ``m = num_sites`` updates (Flower's
``DifferentialPrivacyServerSideFixedClipping``): a Gaussian mechanism with noise multiplier
:math:`\sigma` for adding or removing one site's update, the denominator fixed at ``m``. Sites are
weighted equally (weight 1), or one site's influence on a weighted mean would exceed ``C/m``;
every site takes part in every round, so no amplification is credited and a round without every
site is not released.

The unit is a whole site, and the server sees each site's clipped update in the clear: the
guarantee is against whoever sees the released global models, not against the server.

References
----------
McMahan, Ramage, Talwar & Zhang (2018), "Learning differentially private recurrent language
models", ICLR (DP-FedAvg); Mironov (2017), "Rényi differential privacy", CSF; Gopi, Lee &
Wutschitz (2021), "Numerical composition of differential privacy", NeurIPS (PRV); Doroshenko,
Ghazi, Kamath, Kumar & Manurangsi (2022), "Connect the dots", PETS (PLD, the default accountant:
``rounds`` Gaussian releases compose exactly into one Gaussian, so the PLD figure is the exact ε
of the analytic Gaussian mechanism, Balle & Wang 2018, up to the grid).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import (
    ACCOUNTANT_LABELS,
    ACCOUNTANT_NAMES,
    calibrate_noise_multiplier,
    epsilon_from_history,
)
from strategies.config import ConfigError, ExperimentConfig
from strategies.mechanisms.base import LocalUpdateMechanism, SiteSetUp, SiteUpdate, horizontal_manifest
from strategies.mechanisms.manifest import Manifest, uncovered_sentence, update_release

if TYPE_CHECKING:  # Flower's strategy type, for type checkers only
    from flwr.serverapp.strategy import Strategy

__all__ = ["CentralDP", "central_noise_multiplier", "central_epsilon"]


@functools.lru_cache(maxsize=256)
def central_noise_multiplier(*, epsilon: float, delta: float, rounds: int, accountant: str = "rdp") -> float:
    """σ such that ``rounds`` Gaussian releases (q = 1, sensitivity ``C``) spend ``(ε, δ)`` by ``accountant``."""
    return calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=rounds,
                                      accountant=accountant)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def central_epsilon(*, noise_multiplier: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """ε of ``rounds`` Gaussian releases of noise multiplier σ without amplification, by ``accountant``."""
    return epsilon_from_history([(noise_multiplier, 1.0, rounds)], delta=delta,
                                accountant=accountant)  # type: ignore[arg-type]


class CentralDP(LocalUpdateMechanism):
    """Flower's server-side fixed-clipping DP around FedAvg; unit: one site."""

    name = "central_dp"
    unit = "site"
    server_side = True
    adjacencies = ("add-remove",)
    accountants = ("pld", "prv", "rdp")
    delta_population = "sites"  # site-level DP: n is the number of sites
    refusals = {
        "federation.aggregation": "is not offered with strategy 'central_dp', which calibrates its noise to the mean "
                                  "of the clipped updates",
        "federation.update_bound": "bounds FedAvg's weighted mean, which strategy 'central_dp' does not take (its "
                                   "noise is calibrated to the plain mean of the clipped updates)",
    }

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.federation.fraction_train != 1.0:
            raise ConfigError(
                "run config: strategy 'central_dp' is accounted without sub-sampling amplification and needs every "
                "site in every round: set federation.fraction_train = 1.0")

    def noise_multiplier(self, cfg: ExperimentConfig) -> float:
        privacy = cfg.privacy
        return central_noise_multiplier(epsilon=privacy.epsilon, delta=privacy.delta, rounds=cfg.federation.rounds,
                                        accountant=privacy.accountant)

    def site_round(self, model: Any, data: Any, cfg: ExperimentConfig, *, seed: int, state: dict[str, Any] | None,
                   setup: SiteSetUp) -> SiteUpdate:
        from models.training import train_epochs  # torch: only where a site trains

        train = cfg.train
        train_epochs(model, data.x, data.time, data.event, epochs=train.local_epochs, batch_size=train.batch_size,
                     lr=train.lr, weight_decay=train.weight_decay, seed=seed, proximal_mu=train.proximal_mu)
        return SiteUpdate({})

    def wrap_strategy(self, strategy: Strategy, cfg: ExperimentConfig, *, num_sites: int) -> Strategy:
        from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping  # only where the server runs

        return DifferentialPrivacyServerSideFixedClipping(
            strategy, noise_multiplier=self.noise_multiplier(cfg), clipping_norm=cfg.privacy.clip_norm,
            num_sampled_clients=num_sites)

    def min_train_sites(self, cfg: ExperimentConfig, *, num_sites: int) -> int:
        return num_sites  # the noise is calibrated to the mean of num_sites updates

    def aggregation_weight(self, setup: SiteSetUp) -> float:
        return 1.0

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        sigma, accountant, delta = self.noise_multiplier(cfg), cfg.privacy.accountant, cfg.privacy.delta
        return LedgerEntry(
            round=server_round, site=site, mechanism=self.name, unit="site", adjacency="add-remove",
            accountant=ACCOUNTANT_LABELS[accountant],
            epsilon=central_epsilon(noise_multiplier=sigma, rounds=len(reports), delta=delta, accountant=accountant),
            delta=delta, noise_multiplier=sigma, clip_norm=cfg.privacy.clip_norm, sample_rate=1.0,
            steps=len(reports),
            epsilon_rdp=central_epsilon(noise_multiplier=sigma, rounds=len(reports), delta=delta, accountant="rdp"),
            assumptions=self.assumptions(cfg),
        )

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return (
            "client-level DP at the server (Flower DifferentialPrivacyServerSideFixedClipping): each site's update "
            "clipped to clip_norm, Gaussian noise with std noise_multiplier*clip_norm/num_sites added to the mean",
            "unit: a whole site's update; adjacency: add/remove one site with the denominator fixed at num_sites "
            "(under replace-one the sensitivity doubles)",
            "sites weighted equally; every site in every round: no sub-sampling amplification is credited",
            f"epsilon from {ACCOUNTANT_NAMES[cfg.privacy.accountant]} of the Gaussian mechanism composed over the "
            "releases so far (q = 1); epsilon_rdp: opacus RDP of the same releases",
            "the server sees each site's clipped update in the clear: the guarantee is against everyone who sees "
            "the released global models, not against the server; the server's noise is its own (not seeded)",
            uncovered_sentence(self.manifest(cfg)),
        )

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        return horizontal_manifest(self, cfg, [
            update_release(False, "reaches the server in the clear; the server clips it and adds the noise, so the "
                           "guarantee (one site) holds against those who see the global models, not the server"),
        ])
