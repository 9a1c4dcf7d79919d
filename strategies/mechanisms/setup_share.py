"""A run's private set-up and recalibration releases, from its run config: do they happen, and at what noise.

Where a horizontal mechanism releases its set-up with DP (:func:`~strategies.mechanisms.keys.has_private_setup`
and ``privacy.setup_share`` > 0), :func:`setup_multiplier` is the noise of the set-up's releases together and, for
a hazard model (:func:`recalibrates`), :func:`recalibration_multiplier` the noise of the recalibration release
after training (:data:`~strategies.accounting.setup_budget.RECALIBRATION_SHARE` of the set-up's share). The
server, every site and the ledger compute them from the same run config.
"""

from __future__ import annotations

import math

from strategies.accounting.setup_budget import RECALIBRATION_SHARE, setup_noise_multiplier
from strategies.config import STRATEGIES, ExperimentConfig
from strategies.mechanisms.keys import has_private_setup

__all__ = ["recalibrates", "recalibration_history", "recalibration_multiplier", "setup_multiplier"]


def recalibrates(cfg: ExperimentConfig) -> bool:
    """Whether the run recalibrates its curves privately after training: a hazard model trained by a
    mechanism with a private set-up (:mod:`models.recalibration`; the release is planned in the set-up's share)."""
    return (cfg.model.name == "hazard_mlp" and not STRATEGIES[cfg.strategy].vertical
            and has_private_setup(cfg.strategy) and cfg.privacy.setup_share > 0)


def _share_multiplier(cfg: ExperimentConfig) -> float:
    return setup_noise_multiplier(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, share=cfg.privacy.setup_share)


def setup_multiplier(cfg: ExperimentConfig) -> float:
    """The noise multiplier of a run's set-up releases (all of them together one Gaussian mechanism).

    ``privacy.setup_share`` of the budget (:func:`~strategies.accounting.setup_budget.setup_noise_multiplier`)
    goes to the set-up and, where the run recalibrates (:func:`recalibrates`), to the recalibration
    release too: the set-up then gets ``1 - RECALIBRATION_SHARE`` of it. 0: an exact set-up, or no DP.
    """
    if not cfg.privacy.enabled or cfg.privacy.setup_share == 0:
        return 0.0
    z = _share_multiplier(cfg)
    return z / math.sqrt(1.0 - RECALIBRATION_SHARE) if recalibrates(cfg) else z


def recalibration_multiplier(cfg: ExperimentConfig) -> float:
    """The noise multiplier of the recalibration release (``RECALIBRATION_SHARE`` of the set-up's share); 0 without one."""
    if not cfg.privacy.enabled or not recalibrates(cfg):
        return 0.0
    return _share_multiplier(cfg) / math.sqrt(RECALIBRATION_SHARE)


def recalibration_history(cfg: ExperimentConfig) -> tuple[tuple[float, float, int], ...]:
    """The recalibration release as accountant history (one Gaussian, sample rate 1), planned before training."""
    z = recalibration_multiplier(cfg)
    return ((z, 1.0, 1),) if z > 0 else ()

