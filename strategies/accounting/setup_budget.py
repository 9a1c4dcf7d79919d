r"""The private set-up's share of a run's budget: its noise multiplier, and the recalibration's part of it.

The set-up statistics (:mod:`strategies.mechanisms.setup_statistics`) are Gaussian releases that
together form one Gaussian mechanism of noise multiplier :func:`setup_noise_multiplier`, which
spends ``privacy.setup_share`` of the RDP budget of ``(privacy.epsilon, privacy.delta)``; a hazard
model's recalibration release after training takes :data:`RECALIBRATION_SHARE` of that share.
This module is what the mechanisms' accounting, the set-up and private split learning's
accountant agree on; it imports no pandas or scipy (opacus only where a multiplier is calibrated).

References
----------
Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP, adaptive composition).
"""

from __future__ import annotations

import functools
import math
import warnings

from strategies.config import ConfigError

__all__ = ["RECALIBRATION_SHARE", "SETUP_ACCOUNTING", "setup_budget_refusal", "setup_noise_multiplier"]

#: Share of ``privacy.setup_share`` that a hazard model's recalibration release takes (the set-up's
#: releases get the rest): :func:`~strategies.mechanisms.setup_statistics.recalibration_plan`,
#: :mod:`models.recalibration`.
RECALIBRATION_SHARE = 0.3
#: What the budget refusal says calibrates the set-up (:func:`setup_budget_refusal`).
SETUP_ACCOUNTING = "the private set-up's RDP accounting"


def setup_noise_multiplier(*, epsilon: float, delta: float, share: float) -> float:
    r"""The set-up's noise multiplier :math:`z = z_\varepsilon / \sqrt{s}` for share :math:`s` of the budget.

    :math:`z_\varepsilon` is the noise multiplier of the one Gaussian mechanism that spends
    :math:`(\varepsilon, \delta)` by itself (RDP, opacus' conversion). The set-up's releases
    compose to one Gaussian of multiplier :math:`z`, whose RDP :math:`\alpha / (2 z^2)` is
    exactly :math:`s` times that mechanism's at every order: the share of the RDP (zCDP) budget.
    A larger ε gives less noise and finer statistics. ``share`` 0 means an exact set-up (returns 0).

    Raises
    ------
    ConfigError
        In one line naming ``privacy.epsilon`` (:func:`setup_budget_refusal`), when ε is at or below
        the smallest the RDP conversion certifies at δ: no noise would do.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"set-up share must be in [0, 1), got {share!r}")
    if share == 0.0:
        return 0.0
    if refusal := setup_budget_refusal(epsilon=epsilon, delta=delta):
        raise ConfigError(refusal)
    return _full_budget_multiplier(float(epsilon), float(delta)) / math.sqrt(share)


def setup_budget_refusal(*, epsilon: float, delta: float) -> str:
    """Why a private set-up cannot be calibrated at ``(epsilon, delta)`` (one line naming the keys), or "".

    The set-up's multiplier comes from the Gaussian mechanism that spends ``(epsilon, delta)`` alone by
    RDP (:func:`setup_noise_multiplier`); no noise reaches an ε at or below
    :func:`strategies.accounting.rdp.epsilon_floor` of δ (:func:`strategies.accounting.rdp.floor_refusal`,
    which the configuration check calls before anything runs).
    """
    from strategies.accounting.rdp import floor_refusal

    return floor_refusal(epsilon=epsilon, delta=delta, what=SETUP_ACCOUNTING)


@functools.lru_cache(maxsize=64)
def _full_budget_multiplier(epsilon: float, delta: float) -> float:
    """The noise multiplier of the one Gaussian release that spends ``(epsilon, delta)`` alone (RDP)."""
    from strategies.accounting.rdp import calibrate_noise_multiplier

    with warnings.catch_warnings():  # at a large epsilon the best order is past opacus' grid: z is then a bit larger
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1,
                                          accountant="rdp")
