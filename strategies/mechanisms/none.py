"""No privacy mechanism (strategy ``fedavg``): each site's trained model reaches the server in the clear."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strategies.accounting.ledger import LedgerEntry
from strategies.config import ExperimentConfig
from strategies.mechanisms.base import LocalUpdateMechanism, SiteSetUp, SiteUpdate, horizontal_manifest
from strategies.mechanisms.manifest import Manifest, ReleasedValue, update_release

__all__ = ["NoPrivacy"]


class NoPrivacy(LocalUpdateMechanism):
    """FedAvg without noise: the ledger says, per site and round, that nothing is protected."""

    name = "fedavg"
    pooled_baseline = True
    unit = "none"
    private = False
    delta_population = ""
    refusals = {"privacy.epsilon": "cannot be met: strategy 'fedavg' adds no noise (or choose a DP strategy)"}

    def site_round(self, model: Any, data: Any, cfg: ExperimentConfig, *, seed: int, state: dict[str, Any] | None,
                   setup: SiteSetUp) -> SiteUpdate:
        from models.training import train_epochs  # torch: only where a site trains

        train = cfg.train
        stats = train_epochs(model, data.x, data.time, data.event, epochs=train.local_epochs,
                             batch_size=train.batch_size, lr=train.lr, weight_decay=train.weight_decay, seed=seed,
                             proximal_mu=train.proximal_mu)
        return SiteUpdate({"train_loss": float(stats["loss"])})

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return ("train_loss",)

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        return LedgerEntry(round=server_round, site=site, mechanism="none", unit="none", adjacency="n/a",
                           accountant="none", epsilon=None, delta=None, assumptions=self.assumptions(cfg))

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return ("FedAvg without a privacy mechanism: each site's model update reaches the server in the clear",)

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        return horizontal_manifest(self, cfg, [
            update_release(False, "no noise: the trained weights in the clear"),
            ReleasedValue("train_loss", "the mean training loss of the site's last local epoch", "train", False,
                          "computed from the training records without noise", ("train/metrics.train_loss",)),
        ])
