r"""Survival losses: discrete-time logistic hazard, Cox partial likelihood, CoxTime case-control, DeepHit.

All functions take PyTorch tensors and are differentiable in their first argument(s).
Shapes are checked here, at the public boundary; nothing inside re-checks them.

Normalisation of :func:`cox_ph_loss`'s penalty. LS-ADP's eq. (5) prints
:math:`\lambda \sum_j \sum_{r \in \tilde R_j} |g(\xi_r)|`, which counts record :math:`r` once
per risk set it belongs to; that sum grows with the batch size and vanishes in a batch
without events. Here every record of the batch counts once and the sum is divided by the
batch size, :math:`\lambda \cdot \mathrm{mean}_{r \in B} |g_r|`, the same scale as pycox's
``shrink`` for CoxCC/CoxTime, so ``penalty`` means the same thing for every batch size.
Its role is to pin down the additive constant that the partial likelihood leaves free.

:func:`deephit_loss`'s ``alpha`` weighs its two terms as in pycox (``DeepHitSingleLoss``), not as in Lee et al.,
whose loss is :math:`\sum \ell_i + \beta \mathcal L_{\text{rank}}`: pycox's ``alpha`` is
:math:`1 / (1 + \beta)` up to an overall scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "cox_ph_loss",
    "cox_time_loss",
    "deephit_loss",
    "logistic_hazard_nll",
    "sample_risk_set_controls",
]

_REDUCTIONS = ("mean", "sum", "none")


def logistic_hazard_nll(
    logits: Tensor, idx_durations: Tensor, events: Tensor, reduction: str = "mean"
) -> Tensor:
    r"""Negative log-likelihood of the discrete-time logistic-hazard model.

    With hazards :math:`h_{il} = \sigma(\phi_{il})` on intervals :math:`l = 0, \dots, T-1`,
    record :math:`i` observed in interval :math:`\kappa_i` with event indicator :math:`\delta_i`
    contributes

    .. math::

        \ell_i = -\sum_{l=0}^{\kappa_i} \big[ y_{il} \log h_{il} + (1 - y_{il}) \log(1 - h_{il}) \big],
        \qquad y_{il} = \delta_i \, \mathbb{1}[l = \kappa_i],

    i.e. binary cross-entropy with target 1 at the event interval of an event and 0 for every
    interval survived up to and including :math:`\kappa_i`. The loss is a sum of per-record
    terms, so per-sample gradients (DP-SGD) apply directly with ``reduction="none"``.

    Parameters
    ----------
    logits : Tensor, shape (n, T)
        Hazard logits :math:`\phi`.
    idx_durations : LongTensor, shape (n,)
        Interval index :math:`\kappa_i \in \{0, \dots, T-1\}` (see ``survival.discretise``).
    events : Tensor, shape (n,)
        Event indicator (1 event, 0 censored), any numeric or bool dtype.
    reduction : {"mean", "sum", "none"}
        ``"none"`` returns the per-record losses :math:`\ell_i`, shape (n,).

    Returns
    -------
    Tensor
        Scalar, or shape (n,) for ``reduction="none"``.

    References
    ----------
    Gensheimer & Narasimhan (2019), PeerJ 7:e6257 (nnet-survival); Kvamme & Borgan (2019),
    arXiv:1910.06724, eq. (8) (pycox ``nll_logistic_hazard``); FSL-BDP paper, eq. (1).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_discrete_labels(logits, idx_durations, events)
    idx = idx_durations.reshape(-1, 1)
    targets = torch.zeros_like(logits).scatter(1, idx, events.to(logits.dtype).reshape(-1, 1))
    bce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    per_sample = bce.cumsum(1).gather(1, idx).reshape(-1)
    if reduction == "mean":
        return per_sample.mean()
    if reduction == "sum":
        return per_sample.sum()
    return per_sample


def cox_ph_loss(log_risk: Tensor, time: Tensor, event: Tensor, *, penalty: float = 0.0) -> Tensor:
    r"""Negative Cox partial log-likelihood within a batch (Breslow ties) plus an L1 penalty.

    For a batch :math:`B` of :math:`n` records with log-risk :math:`g_i`, times :math:`T_i` and
    event indicators :math:`\delta_i`,

    .. math::

        \ell = -\frac{1}{\max(1, d)} \sum_{i \in B:\, \delta_i = 1}
               \Big[ g_i - \log \sum_{j \in B:\, T_j \ge T_i} e^{g_j} \Big]
               \;+\; \lambda \, \frac{1}{n} \sum_{r \in B} |g_r|,
        \qquad d = \sum_{i \in B} \delta_i .

    Risk sets are restricted to the batch (:math:`\tilde R_i`). Tied event times use Breslow's
    approximation: every tied event sees the full risk set :math:`\{j: T_j \ge T_i\}`.
    A batch without events gives likelihood term 0 with zero gradient (the loss is then the
    penalty alone), never NaN. The penalty is a mean over the batch (module docstring: why).

    Parameters
    ----------
    log_risk : Tensor, shape (n,)
        :math:`g(x_i)`.
    time : Tensor, shape (n,)
        Observed times (only their order matters).
    event : Tensor, shape (n,)
        Event indicators (1 event, 0 censored).
    penalty : float, default 0
        :math:`\lambda \ge 0`.

    Returns
    -------
    Tensor
        Scalar loss.

    References
    ----------
    Cox (1972), JRSS-B 34:187; Breslow (1974), Biometrics 30:89; Katzman et al. (2018), BMC Med.
    Res. Methodol. 18:24 (DeepSurv); Kvamme, Borgan & Scheel (2019), JMLR 20(129) (batch risk
    sets); Niu et al. (2025), Mathematics (LS-ADP), eqs. (4)-(5).
    """
    _check_cox_batch(log_risk, time, event, penalty)
    order = torch.argsort(time)
    time_sorted = time[order].contiguous()
    g = log_risk[order]
    e = event[order].to(g.dtype)
    # log sum_{k >= i} exp(g_k) in ascending time order; the first index of a group of tied
    # times holds the whole Breslow risk set {j : T_j >= T_i}.
    log_tail = torch.logcumsumexp(g.flip(0), dim=0).flip(0)
    first_of_tie = torch.searchsorted(time_sorted, time_sorted, side="left")
    partial = (g - log_tail[first_of_tie]) * e
    nll = -partial.sum() / e.sum().clamp(min=1.0)
    return nll + penalty * log_risk.abs().mean()


def _check_cox_batch(log_risk: Tensor, time: Tensor, event: Tensor, penalty: float) -> None:
    """A ValueError unless ``log_risk``, ``time`` and ``event`` are 1-D of one non-zero length and ``penalty >= 0``
    (:func:`cox_ph_loss`)."""
    if log_risk.ndim != 1 or time.shape != log_risk.shape or event.shape != log_risk.shape:
        raise ValueError(
            "log_risk, time and event must be 1-D of equal length, got "
            f"{tuple(log_risk.shape)}, {tuple(time.shape)}, {tuple(event.shape)}"
        )
    if log_risk.numel() == 0:
        raise ValueError("cox_ph_loss needs a non-empty batch")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")


def cox_time_loss(g_case: Tensor, g_control: Tensor, *, penalty: float = 0.0) -> Tensor:
    r"""Case-control approximation of the Cox partial likelihood (CoxCC / CoxTime).

    For cases :math:`i = 1, \dots, n` (records with an event) and :math:`m` controls
    :math:`j` sampled from each case's risk set, all evaluated at the case's time
    :math:`T_i` (CoxTime: :math:`g(T_i, x)`),

    .. math::

        \ell = \frac{1}{n} \sum_{i=1}^{n} \log\Big(1 + \sum_{k=1}^{m} e^{g_{ik}^{c} - g_i}\Big)
               + \frac{\lambda}{m} \Big( \mathrm{mean}_i |g_i|
                 + \sum_{k=1}^{m} \mathrm{mean}_i |g_{ik}^{c}| \Big),

    computed with a stable log-sum-exp. The penalty is pycox's ``shrink``. With no cases the
    loss is 0 (still attached to the autograd graph, so ``backward`` works).

    Parameters
    ----------
    g_case : Tensor, shape (n,)
        :math:`g(T_i, x_i)` for the cases.
    g_control : Tensor, shape (n,) or (n, m)
        :math:`g(T_i, x_j)` for the sampled controls, one column per control.
    penalty : float, default 0
        :math:`\lambda \ge 0`.

    Returns
    -------
    Tensor
        Scalar loss.

    References
    ----------
    Kvamme, Borgan & Scheel (2019), JMLR 20(129), eqs. (9)-(12) (pycox ``cox_cc_loss``).
    """
    if g_case.ndim != 1:
        raise ValueError(f"g_case must be 1-D, got shape {tuple(g_case.shape)}")
    controls = g_control.reshape(-1, 1) if g_control.ndim == 1 else g_control
    if controls.ndim != 2 or controls.shape[0] != g_case.shape[0]:
        raise ValueError(
            f"g_control must have shape ({g_case.shape[0]},) or ({g_case.shape[0]}, m), "
            f"got {tuple(g_control.shape)}"
        )
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    if g_case.numel() == 0:
        return g_case.sum() + controls.sum()
    diff = controls - g_case.reshape(-1, 1)
    zeros = torch.zeros_like(g_case).reshape(-1, 1)
    nll = torch.logsumexp(torch.cat([zeros, diff], dim=1), dim=1).mean()
    shrink = (g_case.abs().mean() + controls.abs().mean(0).sum()) / controls.shape[1]
    return nll + penalty * shrink


def sample_risk_set_controls(
    time: Tensor, event: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    r"""Sample one control per case from the case's risk set within the batch.

    For every record :math:`i` with :math:`\delta_i = 1`, draw :math:`j` uniformly from
    :math:`\tilde R_i = \{j \in B : T_j \ge T_i\}` (the case itself included, as in pycox's
    CoxCC/CoxTime sampler).

    Parameters
    ----------
    time : Tensor, shape (n,)
        Observed times.
    event : Tensor, shape (n,)
        Event indicators.
    generator : torch.Generator, optional
        Source of randomness (the global generator when None).

    Returns
    -------
    case_idx, control_idx : LongTensor, shape (d,)
        Batch indices of the cases (in batch order) and of one control for each.

    References
    ----------
    Kvamme, Borgan & Scheel (2019), JMLR 20(129), Sec. 3.2.
    """
    if time.ndim != 1 or event.shape != time.shape:
        raise ValueError(
            f"time and event must be 1-D of equal length, got {tuple(time.shape)}, "
            f"{tuple(event.shape)}"
        )
    case_idx = torch.nonzero(event != 0).reshape(-1)
    order = torch.argsort(time)
    time_sorted = time[order].contiguous()
    first_at_risk = torch.searchsorted(time_sorted, time[case_idx].contiguous(), side="left")
    at_risk = time.numel() - first_at_risk
    u = torch.rand(case_idx.numel(), generator=generator, dtype=torch.float64)
    offset = torch.minimum((u * at_risk).long(), at_risk - 1)
    return case_idx, order[first_at_risk + offset]


def _check_discrete_labels(logits: Tensor, idx_durations: Tensor, events: Tensor) -> tuple[int, int]:
    """Shapes, dtype and range of a discrete-time loss's inputs; returns ``(n, T)``."""
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape (n, T), got {tuple(logits.shape)}")
    n, num_intervals = logits.shape
    if idx_durations.shape != (n,) or events.shape != (n,):
        raise ValueError(
            f"idx_durations and events must have shape ({n},), got "
            f"{tuple(idx_durations.shape)} and {tuple(events.shape)}"
        )
    if idx_durations.dtype != torch.int64:
        raise TypeError(f"idx_durations must be int64, got {idx_durations.dtype}")
    if n and (idx_durations.min() < 0 or idx_durations.max() >= num_intervals):
        raise ValueError(f"idx_durations must lie in [0, {num_intervals - 1}]")
    return n, num_intervals


def deephit_loss(
    logits: Tensor, idx_durations: Tensor, events: Tensor, *, alpha: float = 0.2, sigma: float = 0.1
) -> Tensor:
    r"""Single-risk DeepHit loss: PMF negative log-likelihood and the pairwise ranking loss.

    The net's :math:`T` logits :math:`\phi_i` and a fixed 0 appended for the mass beyond the last
    grid point give the probability mass function and its CDF on the grid,

    .. math::

        f_{il} = \operatorname{softmax}([\phi_{i0}, \dots, \phi_{i,T-1}, 0])_l, \qquad
        F_i(j) = \sum_{l \le j} f_{il}, \qquad S_i(\tau_j) = 1 - F_i(j).

    For records observed in interval :math:`\kappa_i` with event indicator :math:`\delta_i`,

    .. math::

        \mathcal L = \alpha \, \frac1n \sum_i \ell_i + (1 - \alpha) \, \mathcal L_{\text{rank}},
        \qquad
        \ell_i = -\delta_i \log f_{i\kappa_i} - (1 - \delta_i) \log\big(1 - F_i(\kappa_i)\big),

        \mathcal L_{\text{rank}} = \frac{1}{n^2} \sum_{i,j} A_{ij}
            \exp\Big(-\frac{F_i(\kappa_i) - F_j(\kappa_i)}{\sigma}\Big),
        \qquad
        A_{ij} = \delta_i \, \mathbb 1\big[\kappa_i < \kappa_j \text{ or }
                 (\kappa_i = \kappa_j,\ \delta_j = 0)\big].

    ``alpha`` weighs the two terms as pycox does (module docstring). The ranking term couples every pair of the
    batch, so the loss is not a sum of per-record terms.

    Parameters
    ----------
    logits : Tensor, shape (n, T)
        :math:`\phi`.
    idx_durations : LongTensor, shape (n,)
        Interval index :math:`\kappa_i \in \{0, \dots, T-1\}` (see ``survival.discretise``).
    events : Tensor, shape (n,)
        Event indicator (1 event, 0 censored).
    alpha : float, default 0.2
        Weight of the likelihood, in [0, 1] (pycox's default).
    sigma : float, default 0.1
        Scale :math:`\sigma > 0` of the ranking loss (pycox's default).

    Returns
    -------
    Tensor
        Scalar loss.

    References
    ----------
    Lee, Zame, Yoon & van der Schaar (2018), AAAI, "DeepHit: a deep learning approach to survival
    analysis with competing risks", eqs. (2)-(4); Kvamme, Borgan & Scheel (2019), JMLR 20(129)
    (pycox ``DeepHitSingleLoss``, ``nll_pmf``, ``rank_loss_deephit_single``).
    """
    _check_deephit_batch(logits, idx_durations, events, alpha=alpha, sigma=sigma)
    log_pmf = F.log_softmax(F.pad(logits, (0, 1)), dim=1)
    is_event = events.to(torch.bool)
    nll = _pmf_nll(log_pmf, idx_durations, is_event)
    return alpha * nll + (1.0 - alpha) * _deephit_rank(log_pmf, idx_durations, is_event, sigma)


def _check_deephit_batch(logits: Tensor, idx_durations: Tensor, events: Tensor, *, alpha: float,
                         sigma: float) -> None:
    """:func:`deephit_loss`'s checks: the labels of :func:`_check_discrete_labels`, a non-empty batch, ``alpha`` in
    [0, 1] and ``sigma > 0`` (a ValueError, or a TypeError for non-int64 ``idx_durations``)."""
    n, _ = _check_discrete_labels(logits, idx_durations, events)
    if n == 0:
        raise ValueError("deephit_loss needs a non-empty batch")
    if not 0.0 <= alpha <= 1.0 or sigma <= 0:
        raise ValueError(f"need alpha in [0, 1] and sigma > 0, got alpha={alpha}, sigma={sigma}")


def _pmf_nll(log_pmf: Tensor, idx_durations: Tensor, is_event: Tensor) -> Tensor:
    r""":func:`deephit_loss`'s likelihood term :math:`\frac1n \sum_i \ell_i` from the log-PMF (n, T + 1), the
    padded column last: :math:`-\log f_{i\kappa_i}` for an event, :math:`-\log(1 - F_i(\kappa_i))` otherwise."""
    idx = idx_durations.reshape(-1, 1)
    log_event = log_pmf.gather(1, idx).reshape(-1)
    # log(1 - F_i(kappa_i)) = log sum_{l > kappa_i} f_il, including the padded column.
    after = torch.arange(log_pmf.shape[1], device=log_pmf.device).reshape(1, -1) > idx
    log_survival = torch.logsumexp(log_pmf.masked_fill(~after, float("-inf")), dim=1)
    return -torch.where(is_event, log_event, log_survival).mean()


def _deephit_rank(log_pmf: Tensor, idx_durations: Tensor, is_event: Tensor, sigma: float) -> Tensor:
    r""":func:`deephit_loss`'s ranking term :math:`\mathcal L_{\text{rank}}` (mean over the n x n pairs) from the
    log-PMF (n, T + 1)."""
    idx = idx_durations.reshape(-1, 1)
    cdf = log_pmf.exp().cumsum(1)
    cdf_at_own_time = cdf.gather(1, idx)  # (n, 1): F_i(kappa_i)
    cdf_of_others = cdf[:, idx_durations].T  # (n, n): [i, j] = F_j(kappa_i)
    earlier = idx_durations.reshape(-1, 1) < idx_durations.reshape(1, -1)
    tied_with_censored = (idx_durations.reshape(-1, 1) == idx_durations.reshape(1, -1)) & ~is_event.reshape(1, -1)
    pairs = (is_event.reshape(-1, 1) & (earlier | tied_with_censored)).to(log_pmf.dtype)
    return (pairs * torch.exp(-(cdf_at_own_time - cdf_of_others) / sigma)).mean()
