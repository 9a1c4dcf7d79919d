r"""Accounting of strategy ``private_split``: the public plan, the noise calibration, the record's ε.

A record meets, at each of the ``K`` modality sites, the site's private set-up (one Gaussian
mechanism, replace-one, whose noise multiplier gives the ``K`` sites' set-ups together the share
``privacy.setup_share`` of the record's RDP budget: :func:`setup_multiplier`), its encoder
statistic (one Gaussian mechanism; none for the ``features`` encoder) and the one release of its embedding
(Laplace or Gaussian). The Gaussian mechanisms of every site compose by RDP without amplification
(opacus, sample rate 1) into ``ε_G`` at δ; each Laplace release of an embedding clipped to L1
norm ``C`` with scale ``b`` is pure :math:`2C/b`-DP; the record's ε is their sum (basic
composition). What the sites do is :mod:`strategies.private_split`; this module imports neither
torch nor pandas at import time (the run config's checks use it).

References
----------
Mironov, "Rényi Differential Privacy", CSF 2017; Dwork & Roth, "The Algorithmic Foundations of
Differential Privacy", 2014 (Laplace mechanism, basic composition); Dwork, Talwar, Thakurta & Zhang,
"Analyze Gauss", STOC 2014.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from strategies.accounting.calibration import calibrate_noise
from strategies.accounting.rdp import epsilon_from_history
from strategies.accounting.setup_budget import setup_noise_multiplier

__all__ = [
    "ENCODERS",
    "FIT_SENSITIVITY",
    "RELEASE_NOISES",
    "RESIDUAL_CLIP",
    "NoisePlan",
    "PrivateSplitPlan",
    "plan_noise",
    "record_epsilon",
    "setup_multiplier",
]

#: ``split.encoder`` options of ``private_split``.
ENCODERS: tuple[str, ...] = ("score", "pca", "features")
#: ``split.release_noise`` options.
RELEASE_NOISES: tuple[str, ...] = ("laplace", "gaussian")
#: Martingale residuals are clipped to ``[-RESIDUAL_CLIP, 1]`` (a residual is at most 1 by definition).
RESIDUAL_CLIP = 2.0
#: Sensitivity (replace-one, in units of the statistic's clip) of each encoder's Gaussian release.
FIT_SENSITIVITY: Mapping[str, float] = {"score": 2.0 * RESIDUAL_CLIP, "pca": math.sqrt(2.0), "features": 0.0}


@dataclass(frozen=True)
class PrivateSplitPlan:
    """The public configuration every party builds the same way.

    Attributes
    ----------
    epsilon, delta : float
        The record's budget over every site (``inf``: no noise anywhere, exact statistics).
    num_sites : int
    encoder : str
        One of :data:`ENCODERS`.
    release_noise : str
        One of :data:`RELEASE_NOISES`.
    clip_norm : float
        ``C`` of the released embedding (L1 norm for Laplace, L2 for Gaussian).
    dim : int
        Embedding dimensions of the ``pca`` encoder.
    fit_share : float
        Share of ε spent on the encoder statistics beyond the set-up, in (0, 1).
    setup_share : float
        Share of the record's RDP budget spent on the ``num_sites`` sites' set-ups together, in
        [0, 1) (``privacy.setup_share``; :func:`setup_multiplier`). 0: no set-up release at all (every
        numeric column's range public in ``data.dictionary``; a site with another numeric column stops).
    """

    epsilon: float
    delta: float
    num_sites: int
    encoder: str = "score"
    release_noise: str = "laplace"
    clip_norm: float = 1.0
    dim: int = 4
    fit_share: float = 0.1
    setup_share: float = 0.2

    def __post_init__(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {self.encoder!r}")
        if self.release_noise not in RELEASE_NOISES:
            raise ValueError(f"release_noise must be one of {RELEASE_NOISES}, got {self.release_noise!r}")
        if not 0.0 < self.fit_share < 1.0:
            raise ValueError(f"fit_share must be in (0, 1), got {self.fit_share}")
        if not 0.0 <= self.setup_share < 1.0:
            raise ValueError(f"setup_share must be in [0, 1), got {self.setup_share}")
        if self.num_sites < 1 or self.dim < 1 or not self.clip_norm > 0 or not self.epsilon > 0:
            raise ValueError("num_sites, dim, clip_norm and epsilon must be positive")

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)


@dataclass(frozen=True)
class NoisePlan:
    """The noise every site adds (from :func:`plan_noise`; public, the same at every party).

    ``setup_multiplier``: ``z`` of the site's set-up releases (all of them together one Gaussian
    mechanism of that multiplier, whatever the site's columns; 0: no set-up release). ``fit_multiplier``: noise std of
    the encoder statistic over its sensitivity (0: none made). ``release_scale``: Laplace scale
    ``b`` or Gaussian std of each embedding coordinate (0: no noise). ``epsilon``: the record's ε
    over every site after one release (:func:`record_epsilon`); ``epsilon_before_release``: the
    set-up's and the encoder statistics'.
    """

    setup_multiplier: float
    fit_multiplier: float
    release_scale: float
    epsilon: float = math.inf
    epsilon_before_release: float = math.inf


def _gaussian_history(plan: PrivateSplitPlan, setup: float, fit: float, release: float = 0.0,
                      ) -> list[tuple[float, float, int]]:
    """Every Gaussian mechanism a record meets, one entry per site each: ``(z, 1.0, 1)`` (opacus' history form)."""
    history = []
    for multiplier in (setup, fit, release):
        if multiplier > 0:
            history += [(multiplier, 1.0, 1)] * plan.num_sites
    return history


def record_epsilon(plan: PrivateSplitPlan, noise: NoisePlan, releases: int = 1) -> float:
    r"""ε of one record's features at every site: set-up, encoder statistic and ``releases`` embedding releases.

    Gaussian mechanisms compose by RDP (opacus, sample rate 1, replace-one noise multipliers) into
    ``ε_G``; each Laplace release adds :math:`2C/b` (basic composition with the pure part).
    ``releases`` is the most times a record's embedding left one site (1 with the cache; 0 before
    any release). ``inf`` without noise.
    """
    if not plan.private:
        return math.inf
    release = 0.0
    if plan.release_noise == "gaussian" and releases:
        release = noise.release_scale / (2.0 * plan.clip_norm) / math.sqrt(releases)
    fit = noise.fit_multiplier if FIT_SENSITIVITY[plan.encoder] > 0 else 0.0
    epsilon = epsilon_from_history(_gaussian_history(plan, noise.setup_multiplier, fit, release), delta=plan.delta)
    if plan.release_noise == "laplace":
        epsilon += releases * plan.num_sites * 2.0 * plan.clip_norm / noise.release_scale
    return epsilon


def setup_multiplier(plan: PrivateSplitPlan) -> float:
    r"""Noise multiplier of each site's set-up: the ``K`` sites' set-ups spend ``plan.setup_share`` of the RDP budget.

    A record meets the set-up once at each of the ``K`` sites; each site's releases compose to one
    Gaussian mechanism of multiplier :math:`z`, so the record's set-up RDP is
    :math:`K \alpha / (2 z^2)`. With :math:`z = z_\varepsilon \sqrt{K / s}`
    (:func:`strategies.accounting.setup_budget.setup_noise_multiplier` at share :math:`s / K`)
    that is exactly :math:`s` times the RDP of the one Gaussian mechanism spending
    :math:`(\varepsilon, \delta)` alone, at every order. 0 without noise, and at share 0 (no set-up release).
    """
    if not plan.private:
        return 0.0
    return setup_noise_multiplier(epsilon=plan.epsilon, delta=plan.delta, share=plan.setup_share / plan.num_sites)


@functools.lru_cache(maxsize=32)
def plan_noise(plan: PrivateSplitPlan) -> NoisePlan:
    """Calibrate the set-up's, the encoder statistic's and the releases' noise to ``plan.epsilon``.

    The set-up takes :func:`setup_multiplier` at every site (``setup_share`` of the RDP budget);
    the encoder statistics then spend ``fit_share · ε`` more (calibrated on their noise
    multiplier, :func:`~strategies.accounting.calibration.calibrate_noise`); the releases spend what is left: Laplace scale ``b = 2C · K / (ε − ε_before)``,
    or the smallest Gaussian std whose RDP composition with everything before stays within ε.
    Memoised: the label holder and every site compute it from the same public plan, message
    after message.

    Raises
    ------
    ValueError
        When the set-up and the encoder statistics leave nothing for the release.
    """
    if not plan.private:
        return NoisePlan(0.0, 0.0, 0.0)
    delta, setup = plan.delta, setup_multiplier(plan)
    setup_epsilon = epsilon_from_history(_gaussian_history(plan, setup, 0.0), delta=delta)
    fit = 0.0
    if FIT_SENSITIVITY[plan.encoder] > 0:
        target = setup_epsilon + plan.fit_share * plan.epsilon
        fit = calibrate_noise(lambda z: epsilon_from_history(_gaussian_history(plan, setup, z), delta=delta), target,
                              tolerance=1e-9 * target)
    before = epsilon_from_history(_gaussian_history(plan, setup, fit), delta=delta)
    if before >= 0.9 * plan.epsilon:
        raise ValueError(f"the private set-up and encoder statistics of {plan.num_sites} sites spend epsilon "
                         f"{before:.3g} of privacy.epsilon = {plan.epsilon:g}, leaving too little for the release: "
                         f"raise privacy.epsilon or lower privacy.setup_share or split.fit_share")
    if plan.release_noise == "laplace":
        scale = 2.0 * plan.clip_norm * plan.num_sites / (plan.epsilon - before)
    else:
        z = calibrate_noise(lambda z: epsilon_from_history(_gaussian_history(plan, setup, fit, z), delta=delta),
                            plan.epsilon, tolerance=1e-9 * plan.epsilon)
        scale = z * 2.0 * plan.clip_norm
    noise = NoisePlan(setup, fit, scale)
    return NoisePlan(setup, fit, scale, record_epsilon(plan, noise), before)
