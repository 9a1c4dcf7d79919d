r"""What a mechanism object and its site's numerics must agree on: schedules, calibrations and constants.

A mechanism's object (checks, accounting, ledger; no torch) and the module that runs its site's
numerics (torch) both read these; each imports them from here, and neither imports the other at
module level. Nothing here imports a mechanism.

* :func:`poisson_schedule`: DP-SGD's sampling rate and step count (``dp_sgd``, ``bdp``), which the
  site trains with and the server's accountant recomputes;
* :data:`MIN_RECORDS`, :data:`PAIR_RECORDS`, :data:`PILOT_RECORDS`,
  :data:`GAMMA_STEP`: the Bayesian accountant's constants (``bdp``);
* :data:`WEIGHT_PERTURBATION` and :func:`calibrate_gaussian_noise_multiplier`: the weight
  perturbation strategies and the Gaussian calibration of their ``"exact"`` allocation (also the
  embedding noise of ``split``).

References
----------
Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (Poisson-sampled DP-SGD);
Triastcyn and Faltings, "Federated Learning with Bayesian Differential Privacy", IEEE Big Data 2019;
Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP ``α/(2z²)``).
"""

from __future__ import annotations

from strategies.accounting.calibration import calibrate_noise
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS
from strategies.validation import check_count, check_positive, check_probability

__all__ = [
    "GAMMA_STEP",
    "MIN_RECORDS",
    "PAIR_RECORDS",
    "PILOT_RECORDS",
    "WEIGHT_PERTURBATION",
    "calibrate_gaussian_noise_multiplier",
    "poisson_schedule",
]


def poisson_schedule(n: float, *, batch_size: int, epochs: int) -> tuple[float, int]:
    r"""Sampling rate and number of steps of ``epochs`` epochs of DP-SGD on ``n`` records.

    :math:`q = \min(1, B/n)` and :math:`T = \mathrm{round}(E/q)`, so that each record is
    visited ``epochs`` times in expectation. The accountant must be fed exactly these values.
    """
    if n < 1 or batch_size < 1 or epochs < 1:
        raise ValueError(f"n, batch_size and epochs must be >= 1, got {n}, {batch_size}, {epochs}")
    sample_rate = min(1.0, batch_size / n)
    return sample_rate, round(epochs / sample_rate)


#: ``bdp``: a site with fewer training records runs classical DP-SGD (its ε_μ is the classical ε).
MIN_RECORDS = 100
#: ``bdp``, replace-one: records per step whose pairwise distances estimate the step's cost.
PAIR_RECORDS = 16
#: ``bdp``: random records whose clipped gradients' distances calibrate the site's noise before training.
PILOT_RECORDS = 64
#: ``bdp``: the Bayesian accountant's γ per step (the probability its upper confidence bound fails).
GAMMA_STEP = 1e-12

#: The strategies that perturb weights before upload.
WEIGHT_PERTURBATION: tuple[str, ...] = ("nbafl", "ls_adp", "row_dp")


def calibrate_gaussian_noise_multiplier(*, epsilon: float, delta: float, releases: int) -> float:
    r"""Smallest ``z`` (ε within 1e-6 relative below the target) whose Gaussian RDP over ``releases`` gives ``(ε, δ)``.

    :func:`~strategies.accounting.calibration.calibrate_noise` on :func:`strategies.accounting.rdp.epsilon_gaussian_rounds` (sample rate 1,
    orders :data:`~strategies.mechanisms.adaptive_dp.AUDIT_RDP_ORDERS`), the accountant the audit
    uses, so an ``"exact"`` release's ``epsilon_rdp`` is the target up to the tolerance (never
    above it).
    """
    epsilon = check_positive(epsilon, "epsilon")
    delta = check_probability(delta, "delta")
    releases = check_count(releases, "releases")

    def spent(z: float) -> float:
        return epsilon_gaussian_rounds(noise_multiplier=z, rounds=releases, delta=delta, orders=list(AUDIT_RDP_ORDERS))

    return calibrate_noise(spent, epsilon, tolerance=1e-6 * epsilon)
