r"""Membership-inference audit: a loss-threshold attack and the ceilings DP puts on any attack.

The attacker (the server, holding the global model or a site's update) scores each candidate
record by the model's loss on it and guesses "member" when the loss is below a threshold (Yeom et
al. 2018). Sweeping the threshold gives the attack's ROC curve on known members (a site's
training records) and non-members (held-out records from the same population);
:func:`loss_threshold_attack` reports its AUC, its advantage :math:`\max_t (\mathrm{TPR} - \mathrm{FPR})`
and its TPR at a low FPR (the regime that matters for a targeted attack; Carlini et al. 2022).

An :math:`(\varepsilon, \delta)`-DP mechanism bounds every such test, whatever its score
(Kairouz, Oh & Viswanath 2015, Thm 2.1): with false-negative rate :math:`1 - \mathrm{TPR}`,

.. math::

    1 - \mathrm{TPR} + e^{\varepsilon}\,\mathrm{FPR} \ge 1 - \delta, \qquad
    \mathrm{FPR} + e^{\varepsilon}\,(1 - \mathrm{TPR}) \ge 1 - \delta,

so :math:`\mathrm{TPR} \le \min(e^{\varepsilon}\mathrm{FPR} + \delta,\; 1 - e^{-\varepsilon}(1 - \delta - \mathrm{FPR}))`
(:func:`max_true_positive_rate`). Integrating and maximising that boundary gives the ceilings on
the AUC (:func:`max_auc`), the advantage (:func:`max_advantage`) and the balanced accuracy
:math:`(e^{\varepsilon} + \delta)/(1 + e^{\varepsilon})` (:func:`max_accuracy`; with
:math:`\delta = 0` it is :math:`e^{\varepsilon}/(1 + e^{\varepsilon})`, which is also the AUC ceiling).
The ceilings hold for the unit the ε is about: a record-level ε bounds the attack on one record;
a site-level ε (client-level DP) bounds it on a whole site, and on one record only through group
privacy.

The attack's score is :func:`survival_log_loss`, the likelihood of a record's outcome under its
predicted survival curve, so that it applies to every model (Cox models have no per-record
training loss; for the hazard model it is its own).

References
----------
Yeom, Giacomelli, Fredrikson & Jha, "Privacy risk in machine learning: analyzing the connection
to overfitting", CSF 2018; Kairouz, Oh & Viswanath, "The composition theorem for differential
privacy", ICML 2015, Thm 2.1; Carlini, Chien, Nasr, Song, Terzis & Tramèr, "Membership inference
attacks from first principles", IEEE S&P 2022.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_curve

from strategies.validation import check_probability

__all__ = [
    "MembershipAudit",
    "auc_standard_error",
    "loss_threshold_attack",
    "max_accuracy",
    "max_advantage",
    "max_auc",
    "max_true_positive_rate",
    "survival_log_loss",
]


@dataclass(frozen=True)
class MembershipAudit:
    """What the loss-threshold attack achieved on one set of members and non-members.

    Attributes
    ----------
    auc : float
        Area under the attack's ROC curve (0.5 = guessing).
    auc_standard_error : float
        Hanley & McNeil's (1982) standard error of ``auc``: a measured AUC is above a ceiling
        only if it exceeds it by more than sampling error.
    advantage : float
        :math:`\\max_t (\\mathrm{TPR}_t - \\mathrm{FPR}_t)` over thresholds (0 = guessing).
    tpr_at_fpr : float
        Largest TPR of a threshold whose FPR is at most ``fpr``.
    fpr : float
        The FPR level of ``tpr_at_fpr``.
    members, non_members : int
        How many records of each kind were scored.
    """

    auc: float
    auc_standard_error: float
    advantage: float
    tpr_at_fpr: float
    fpr: float
    members: int
    non_members: int


def survival_log_loss(
    times: np.ndarray, surv: np.ndarray, time: np.ndarray, event: np.ndarray, *, floor: float = 1e-12,
) -> np.ndarray:
    r"""Per-record negative log-likelihood of the observed (time, event) under curves predicted on a grid.

    The outcome is discretised on the grid as the models' own labels are
    (:func:`models.survival.discretise`, pycox's convention: an event moves to the first grid
    point at or after it, a censoring to the last at or before it, a time beyond the grid is a
    censoring at its end; a time before the first point counts as at it). With
    :math:`S_i(\tau_{-1}) = 1`,

    .. math::

        \ell_i = -\delta_i \log\big(S_i(\tau_{\kappa_i - 1}) - S_i(\tau_{\kappa_i})\big)
                  - (1 - \delta_i) \log S_i(\tau_{\kappa_i}),

    probabilities floored at ``floor``. For the discrete-time hazard model this is its own
    per-record training loss (the logistic-hazard NLL); for Cox models it is the likelihood of the
    grid-discretised outcome under the Breslow curves. Over-fitting shows as smaller losses on
    training records, which is what the attack exploits.

    Parameters
    ----------
    times : ndarray, shape (m,)
        Strictly increasing grid of the curves (``m >= 2``).
    surv : ndarray, shape (n, m)
        :math:`S_i(\tau_j)`.
    time, event : ndarray, shape (n,)
        Observed times and event indicators (1 event, 0 censored).
    floor : float
        Lower bound on the probabilities inside the logarithm.
    """
    from models.survival import discretise

    times = np.asarray(times, dtype=np.float64)
    surv = np.asarray(surv, dtype=np.float64)
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event)
    if surv.ndim != 2 or times.ndim != 1 or surv.shape[1] != times.size:
        raise ValueError(f"surv must have shape (n, {times.size}), got {surv.shape}")
    if time.shape != (surv.shape[0],) or event.shape != (surv.shape[0],):
        raise ValueError(f"time and event must have shape ({surv.shape[0]},), got {time.shape} and {event.shape}")
    if not np.isin(event, (0, 1)).all():
        raise ValueError("event must be 0 or 1")
    index, observed = discretise(np.maximum(time, times[0]), event.astype(np.float64), times)
    rows = np.arange(surv.shape[0])
    at = surv[rows, index]
    before = np.where(index > 0, surv[rows, np.maximum(index - 1, 0)], 1.0)
    probability = np.where(observed == 1, before - at, at)
    return -np.log(np.clip(probability, floor, 1.0))


def loss_threshold_attack(
    member_losses: np.ndarray, non_member_losses: np.ndarray, *, fpr: float = 0.01,
) -> MembershipAudit:
    """Yeom et al.'s attack: guess "member" when the loss is at most a threshold; every threshold.

    Parameters
    ----------
    member_losses, non_member_losses : ndarray, shape (n1,), (n0,)
        Per-record losses (e.g. :func:`survival_log_loss`) of known members and non-members.
        Non-finite losses are refused.
    fpr : float, default 0.01
        FPR level for :attr:`MembershipAudit.tpr_at_fpr`.
    """
    members = np.asarray(member_losses, dtype=np.float64).ravel()
    non_members = np.asarray(non_member_losses, dtype=np.float64).ravel()
    if members.size == 0 or non_members.size == 0:
        raise ValueError("the attack needs at least one member and one non-member")
    if not (np.isfinite(members).all() and np.isfinite(non_members).all()):
        raise ValueError("losses must be finite")
    fpr = check_probability(fpr, "fpr")
    labels = np.concatenate([np.ones(members.size), np.zeros(non_members.size)])
    scores = -np.concatenate([members, non_members])
    false_positive, true_positive, _ = roc_curve(labels, scores, drop_intermediate=False)
    auc = float(np.trapezoid(true_positive, false_positive))
    return MembershipAudit(
        auc=auc,
        auc_standard_error=auc_standard_error(auc, members=members.size, non_members=non_members.size),
        advantage=float(np.max(true_positive - false_positive)),
        tpr_at_fpr=float(np.max(true_positive[false_positive <= fpr])),
        fpr=fpr,
        members=int(members.size),
        non_members=int(non_members.size),
    )


def auc_standard_error(auc: float, *, members: int, non_members: int) -> float:
    r"""Hanley & McNeil's standard error of an AUC from ``members`` positives and ``non_members`` negatives.

    .. math::

        \mathrm{SE}^2 = \frac{A(1 - A) + (n_1 - 1)(Q_1 - A^2) + (n_0 - 1)(Q_2 - A^2)}{n_1 n_0},
        \quad Q_1 = \frac{A}{2 - A}, \quad Q_2 = \frac{2A^2}{1 + A}.

    References
    ----------
    Hanley & McNeil, "The meaning and use of the area under a receiver operating characteristic
    (ROC) curve", Radiology 143 (1982), eq. (2).
    """
    q1, q2 = auc / (2.0 - auc), 2.0 * auc**2 / (1.0 + auc)
    variance = (auc * (1.0 - auc) + (members - 1) * (q1 - auc**2) + (non_members - 1) * (q2 - auc**2)) / (
        members * non_members)
    return math.sqrt(max(variance, 0.0))


#: Above this ε, e^ε overflows a float and every ceiling is 1 to within 1e-300: treated as no bound.
_NO_BOUND_EPSILON = 700.0


def _check_budget(epsilon: float, delta: float) -> tuple[float, float]:
    """ε in [0, inf] (anything above :data:`_NO_BOUND_EPSILON` as inf) and δ in [0, 1)."""
    epsilon, delta = float(epsilon), float(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0 (inf allowed), got {epsilon}")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta}")
    return (math.inf if epsilon > _NO_BOUND_EPSILON else epsilon), delta


def max_true_positive_rate(fpr: float | np.ndarray, *, epsilon: float, delta: float = 0.0) -> np.ndarray:
    r"""Largest TPR any membership test can reach at false-positive rate ``fpr`` against (ε, δ)-DP.

    :math:`\min\big(1,\; e^{\varepsilon}\alpha + \delta,\; 1 - e^{-\varepsilon}(1 - \delta - \alpha)\big)`.
    ``epsilon = inf`` gives 1 (no ceiling).

    References
    ----------
    Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1.
    """
    alpha = np.asarray(fpr, dtype=np.float64)
    if np.any((alpha < 0) | (alpha > 1)):
        raise ValueError("fpr must lie in [0, 1]")
    epsilon, delta = _check_budget(epsilon, delta)
    if math.isinf(epsilon):
        return np.ones_like(alpha)
    return np.minimum.reduce([np.ones_like(alpha), math.exp(epsilon) * alpha + delta,
                              1.0 - math.exp(-epsilon) * (1.0 - delta - alpha)])


def max_advantage(*, epsilon: float, delta: float = 0.0) -> float:
    r"""Largest :math:`\mathrm{TPR} - \mathrm{FPR}` against (ε, δ)-DP.

    :math:`(e^{\varepsilon} - 1 + 2\delta)/(e^{\varepsilon} + 1)`.

    References
    ----------
    Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1 (the corner of the region).
    """
    epsilon, delta = _check_budget(epsilon, delta)
    if math.isinf(epsilon):
        return 1.0
    return min(1.0, (math.expm1(epsilon) + 2.0 * delta) / (math.exp(epsilon) + 1.0))


def max_accuracy(*, epsilon: float, delta: float = 0.0) -> float:
    r"""Largest balanced accuracy against (ε, δ)-DP: :math:`(e^{\varepsilon} + \delta)/(1 + e^{\varepsilon})`.

    With δ = 0 it is :math:`e^{\varepsilon}/(1 + e^{\varepsilon})` (Yeom et al. 2018, Thm 1, for ε-DP).

    References
    ----------
    Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1; Yeom et al., CSF 2018.
    """
    return (1.0 + max_advantage(epsilon=epsilon, delta=delta)) / 2.0


def max_auc(*, epsilon: float, delta: float = 0.0) -> float:
    r"""Largest AUC of any membership test against (ε, δ)-DP: the area under :func:`max_true_positive_rate`.

    With :math:`a = (1 - \delta)/(1 + e^{\varepsilon})` (where the two constraints cross),

    .. math::

        \mathrm{AUC} \le \tfrac12 e^{\varepsilon} a^2 + \delta a + (1 - \delta - a)
            - \tfrac12 e^{-\varepsilon} (1 - \delta - a)^2 + \delta,

    which is :math:`e^{\varepsilon}/(1 + e^{\varepsilon})` when δ = 0.

    References
    ----------
    Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1.
    """
    epsilon, delta = _check_budget(epsilon, delta)
    if math.isinf(epsilon):
        return 1.0
    crossing = (1.0 - delta) / (1.0 + math.exp(epsilon))
    rest = 1.0 - delta - crossing
    area = (0.5 * math.exp(epsilon) * crossing**2 + delta * crossing
            + rest - 0.5 * math.exp(-epsilon) * rest**2 + delta)
    return min(1.0, area)
