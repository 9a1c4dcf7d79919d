r"""Survival networks and the model wrappers that training, federation and evaluation use.

Three kinds, built by :func:`build_survival_model`:

``hazard_mlp``
    Discrete-time logistic hazard (nnet-survival / pycox ``LogisticHazard``): the net outputs one
    logit per interval of the time grid, :math:`S(\tau_j) = \prod_{l \le j} (1 - h_l)`.
``cox_mlp``
    DeepSurv-style log-risk :math:`g(x)`, Cox partial likelihood within the batch, baseline
    hazard by (federated) Breslow, :math:`S(t \mid x) = \exp(-H_0(t) e^{g(x)})`.
``cox_time``
    Kvamme et al.'s CoxTime :math:`g(t, x)` with standardised time as an extra input, case-control
    loss, :math:`S(t \mid x) = \exp(-\sum_{\tau_k \le t} \Delta H_0(\tau_k) e^{g(\tau_k, x)})`.

Every wrapper exposes ``net`` (the module whose ``state_dict`` FedAvg averages), ``loss``,
``predict_survival`` and ``risk_score``; the Cox kinds add ``breslow_aggregates`` and
``set_baseline`` for the federated Breslow estimator (:mod:`models.breslow`).
No BatchNorm by default: it breaks per-sample gradients (DP-SGD) and FedAvg of running stats.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from models.breslow import baseline_hazard_increments, site_aggregates
from models.losses import (
    cox_ph_loss,
    cox_time_loss,
    logistic_hazard_nll,
    sample_risk_set_controls,
)

__all__ = [
    "CoxMLP",
    "CoxModel",
    "CoxTimeModel",
    "CoxTimeNet",
    "HazardMLP",
    "HazardModel",
    "SurvivalModel",
    "build_survival_model",
    "discretise",
    "make_time_grid",
    "restricted_mean_survival_time",
    "time_grid_from_counts",
    "time_grid_from_histograms",
    "time_histogram",
]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "selu": nn.SELU,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "tanh": nn.Tanh,
}
_SCHEMES = ("quantiles", "equidistant")


# --------------------------------------------------------------------------- time grid


def _kaplan_meier(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Kaplan-Meier :math:`\hat S(t) = \prod_{t_i \le t} (1 - d_i / n_i)` at the unique times,
    with :math:`(0, 1)` prepended when every time is positive (as pycox ``kaplan_meier``)."""
    unique_time, inverse = np.unique(time, return_inverse=True)
    deaths = np.bincount(inverse, weights=event, minlength=unique_time.size)
    leaving = np.bincount(inverse, minlength=unique_time.size)
    return _kaplan_meier_counts(unique_time, deaths, leaving)


def _kaplan_meier_counts(
    points: np.ndarray, deaths: np.ndarray, leaving: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_kaplan_meier` of records given as ``deaths`` events and ``leaving`` records in all
    at each of the increasing time ``points`` (counts may be fractional)."""
    at_risk = np.cumsum(leaving[::-1])[::-1]  # records at or after each point (>= deaths there, also in floats)
    with np.errstate(divide="ignore"):
        surv = np.exp(np.cumsum(np.log(1.0 - deaths / at_risk)))
    if points[0] > 0:
        points = np.concatenate(([0.0], points))
        surv = np.concatenate(([1.0], surv))
    return points, surv


def _check_time_event(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event)
    if time.ndim != 1 or event.shape != time.shape or time.size == 0:
        raise ValueError(
            f"time and event must be non-empty 1-D arrays of equal length, got {time.shape}, {event.shape}"
        )
    if not np.all(np.isfinite(time)) or np.any(time < 0):
        raise ValueError("time must be finite and non-negative")
    if not np.all(np.isin(event, (0, 1))):
        raise ValueError("event must contain only 0/1")
    return time, event.astype(np.float64)


def make_time_grid(
    time: np.ndarray, event: np.ndarray, *, num_durations: int, scheme: str = "quantiles"
) -> np.ndarray:
    r"""Cut points :math:`\tau_0 = 0 < \tau_1 < \dots < \tau_{T-1} = \max_i T_i`.

    ``"equidistant"``: :math:`\tau_j = j \max_i T_i / (T-1)`.
    ``"quantiles"``: equally spaced levels :math:`s_j` of the Kaplan-Meier curve
    :math:`\hat S` between its minimum and 1; :math:`\tau_j` is the first time at which
    :math:`\hat S \le s_j` (so the intervals hold roughly equal numbers of events);
    duplicates are dropped (with a warning) and :math:`\tau_0` is set to 0.
    Identical to pycox ``LabTransDiscreteTime(num_durations, scheme).fit(time, event).cuts``.

    Parameters
    ----------
    time, event : ndarray, shape (n,)
        Training times (non-negative) and event indicators.
    num_durations : int
        Number of cut points :math:`T \ge 2` (the hazard net's output size).
    scheme : {"quantiles", "equidistant"}

    Returns
    -------
    ndarray of float64, shape (T,) (fewer for "quantiles" when levels coincide)

    References
    ----------
    Kvamme & Borgan (2019), arXiv:1910.06724, Sec. 4 (pycox ``make_cuts``).
    """
    time, event = _check_time_event(time, event)
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    if scheme == "equidistant":
        cuts = np.linspace(0.0, time.max(), num_durations)
        if np.any(np.diff(cuts) == 0):
            raise ValueError("equidistant cuts are not unique: all times are 0")
        return cuts
    return _quantile_cuts(*_kaplan_meier(time, event), num_durations)


def _quantile_cuts(km_time: np.ndarray, km_surv: np.ndarray, num_durations: int) -> np.ndarray:
    """The ``"quantiles"`` cut points of :func:`make_time_grid` from a Kaplan-Meier curve."""
    levels = np.linspace(km_surv.min(), km_surv.max(), num_durations)
    first_below = np.searchsorted(km_surv[::-1], levels)[::-1]
    cuts = np.unique(km_time[::-1][first_below])
    if cuts.size != num_durations:
        warnings.warn(
            f"quantile cuts are not unique: continuing with {cuts.size} cuts instead of {num_durations}",
            stacklevel=3,
        )
    cuts[0] = 0.0
    return cuts


def time_histogram(time: np.ndarray, event: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Events and censorings per interval of ``edges`` (the last interval includes its right edge).

    A deployed site's contribution to :func:`time_grid_from_histograms`: counts only, no time.
    """
    time, event = _check_time_event(time, event)
    events, _ = np.histogram(time[event == 1], bins=edges)
    censored, _ = np.histogram(time[event == 0], bins=edges)
    return events, censored


def time_grid_from_histograms(
    edges: np.ndarray, events: np.ndarray, censored: np.ndarray, *, num_durations: int, scheme: str = "quantiles",
) -> np.ndarray:
    """:func:`make_time_grid` of the records summarised by the summed :func:`time_histogram` counts.

    Each record is placed at the right edge of its interval, so the grid is that of the pooled
    times rounded up to the histogram's resolution (``edges[-1]``, the largest time, is exact);
    with ``"equidistant"`` it equals :func:`make_time_grid` of the pooled times.
    """
    edges = np.asarray(edges, dtype=np.float64)
    return time_grid_from_counts(edges[1:], events, censored, num_durations=num_durations, scheme=scheme)


def time_grid_from_counts(
    points: np.ndarray, events: np.ndarray, censored: np.ndarray, *, num_durations: int, scheme: str = "quantiles",
) -> np.ndarray:
    """:func:`make_time_grid` of records given as counts of events and censorings at time points.

    ``events[j]`` events and ``censored[j]`` censorings happen at ``points[j]``; counts may be
    fractional (e.g. denoised noisy counts), the Kaplan-Meier curve weighs them as they are. With
    integer counts the result is :func:`make_time_grid` of the records the counts stand for;
    ``"equidistant"`` ends at the last point holding a record.

    Parameters
    ----------
    points : ndarray, shape (m,)
        Strictly increasing, non-negative times.
    events, censored : ndarray, shape (m,)
        Non-negative counts; at least one positive.
    num_durations, scheme
        As in :func:`make_time_grid`.
    """
    points = np.asarray(points, dtype=np.float64)
    events = np.asarray(events, dtype=np.float64)
    censored = np.asarray(censored, dtype=np.float64)
    if points.ndim != 1 or events.shape != points.shape or censored.shape != points.shape:
        raise ValueError(f"points, events and censored must be 1-D of one length, got {points.shape}, "
                         f"{events.shape}, {censored.shape}")
    if not np.all(np.isfinite(points)) or np.any(points < 0) or np.any(np.diff(points) <= 0):
        raise ValueError("points must be finite, non-negative and strictly increasing")
    counts = events + censored
    if not (np.all(np.isfinite(counts)) and np.all(events >= 0) and np.all(censored >= 0) and counts.sum() > 0):
        raise ValueError("events and censored must be finite, non-negative counts, not all zero")
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
    if num_durations < 2:
        raise ValueError(f"num_durations must be >= 2, got {num_durations}")
    held = counts > 0
    points, events, counts = points[held], events[held], counts[held]
    if scheme == "equidistant":
        if points[-1] == 0:
            raise ValueError("equidistant cuts are not unique: all times are 0")
        return np.linspace(0.0, points[-1], num_durations)
    return _quantile_cuts(*_kaplan_meier_counts(points, events, counts), num_durations)


def _discretise_tensor(time: Tensor, event: Tensor, cuts: Tensor) -> tuple[Tensor, Tensor]:
    """Tensor core of :func:`discretise` (no checks; ``time >= cuts[0]`` assumed)."""
    time = time.to(cuts.dtype)
    is_event = (event != 0) & (time <= cuts[-1])
    event_idx = torch.searchsorted(cuts, time, side="left")
    censor_idx = torch.searchsorted(cuts, time, side="right") - 1
    return torch.where(is_event, event_idx, censor_idx), is_event.to(torch.float32)


def discretise(
    time: np.ndarray, event: np.ndarray, cuts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    r"""Map continuous (time, event) pairs to interval indices on the cut points.

    An event at :math:`T` moves right to :math:`\kappa = \min\{j : \tau_j \ge T\}`; a censoring
    moves left to :math:`\kappa = \max\{j : \tau_j \le T\}`; a time beyond :math:`\tau_{T-1}`
    becomes a censoring at :math:`T-1`. Identical to pycox ``LabTransDiscreteTime.transform``.

    Parameters
    ----------
    time, event : ndarray, shape (n,)
        Times (:math:`\ge \tau_0`) and event indicators.
    cuts : ndarray, shape (T,)
        Strictly increasing cut points (:func:`make_time_grid`).

    Returns
    -------
    idx_durations : ndarray of int64, shape (n,)
    events : ndarray of float32, shape (n,)

    References
    ----------
    Kvamme & Borgan (2019), arXiv:1910.06724, Sec. 4 (pycox ``IdxDiscUnknownC``).
    """
    time, event = _check_time_event(time, event)
    cuts = _check_cuts(cuts)
    if np.any(time < cuts[0]):
        raise ValueError(f"every time must be >= the first cut point {cuts[0]}")
    idx, events = _discretise_tensor(torch.from_numpy(time), torch.from_numpy(event), torch.from_numpy(cuts))
    return idx.numpy(), events.numpy()


def _check_cuts(cuts: np.ndarray) -> np.ndarray:
    cuts = np.asarray(cuts, dtype=np.float64)
    if cuts.ndim != 1 or cuts.size < 2 or not np.all(np.isfinite(cuts)) or np.any(np.diff(cuts) <= 0):
        raise ValueError("cuts must be a finite, strictly increasing 1-D array of length >= 2")
    return cuts


def restricted_mean_survival_time(times: np.ndarray, surv: np.ndarray) -> np.ndarray:
    r"""Restricted mean survival time of right-continuous step curves over the grid.

    .. math::

        \mathrm{RMST}_i = \int_{\tau_0}^{\tau_{m-1}} S_i(t)\,dt
                        = \sum_{j=0}^{m-2} S_i(\tau_j)\,(\tau_{j+1} - \tau_j).

    Parameters
    ----------
    times : ndarray, shape (m,)
        Increasing grid.
    surv : ndarray, shape (n, m)
        :math:`S_i(\tau_j)`.

    Returns
    -------
    ndarray, shape (n,)

    References
    ----------
    Royston & Parmar (2013), BMC Med. Res. Methodol. 13:152.
    """
    times = np.asarray(times, dtype=np.float64)
    surv = np.asarray(surv, dtype=np.float64)
    if times.ndim != 1 or surv.ndim != 2 or surv.shape[1] != times.size:
        raise ValueError(f"need times (m,) and surv (n, m), got {times.shape} and {surv.shape}")
    return surv[:, :-1] @ np.diff(times)


# --------------------------------------------------------------------------- networks


def _mlp(
    in_features: int,
    hidden: tuple[int, ...],
    out_features: int,
    *,
    activation: str,
    dropout: float,
    batch_norm: bool = False,
    output_bias: bool = True,
) -> nn.Sequential:
    """Linear -> activation [-> BatchNorm] [-> dropout] blocks, then a linear output layer.

    SELU nets get LeCun-normal weights and AlphaDropout, which keep SELU's self-normalisation
    (Klambauer et al. 2017, NeurIPS); other activations use PyTorch's default initialisation.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if in_features < 1 or out_features < 1 or any(w < 1 for w in hidden):
        raise ValueError(f"layer sizes must be positive, got {in_features}, {hidden}, {out_features}")
    layers: list[nn.Module] = []
    width_in = in_features
    for width in hidden:
        layers += [nn.Linear(width_in, width), _ACTIVATIONS[activation]()]
        if batch_norm:
            layers.append(nn.BatchNorm1d(width))
        if dropout > 0:
            layers.append(nn.AlphaDropout(dropout) if activation == "selu" else nn.Dropout(dropout))
        width_in = width
    layers.append(nn.Linear(width_in, out_features, bias=output_bias))
    net = nn.Sequential(*layers)
    if activation == "selu":
        for layer in net:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="linear")
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
    return net


class HazardMLP(nn.Module):
    r"""MLP giving one hazard logit per interval, :math:`h_j(x) = \sigma(\phi_j(x))`.

    Default architecture is FSL-BDP's Input -> 128 -> 64 -> 64 -> 32 -> 32 -> T with SELU.

    References
    ----------
    FSL-BDP paper, Sec. 3 (architecture); Gensheimer & Narasimhan (2019), PeerJ 7:e6257.
    """

    def __init__(
        self,
        in_features: int,
        num_durations: int,
        hidden: tuple[int, ...] = (128, 64, 64, 32, 32),
        activation: str = "selu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.layers = _mlp(in_features, tuple(hidden), num_durations, activation=activation, dropout=dropout)
        # Data-independent start: a constant hazard h with survival 1/2 at the end of the grid,
        # (1 − h)^T = 1/2. With zero output biases every interval starts at h = 1/2 (survival
        # 2^-T at the end), and the first rounds, or a noisy DP-SGD run's whole budget, go into
        # unlearning that.
        hazard = 1.0 - 0.5 ** (1.0 / num_durations)
        nn.init.constant_(self.layers[-1].bias, math.log(hazard / (1.0 - hazard)))

    def forward(self, x: Tensor) -> Tensor:
        """Logits, shape (n, T)."""
        return self.layers(x)


class CoxMLP(nn.Module):
    r"""DeepSurv-style log-risk network :math:`g(x)`; no output bias (the partial likelihood
    does not identify a constant).

    References
    ----------
    Katzman et al. (2018), BMC Med. Res. Methodol. 18:24.
    """

    def __init__(
        self,
        in_features: int,
        hidden: tuple[int, ...] = (32, 32),
        activation: str = "relu",
        dropout: float = 0.1,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layers = _mlp(
            in_features, tuple(hidden), 1, activation=activation, dropout=dropout,
            batch_norm=batch_norm, output_bias=False,
        )

    def forward(self, x: Tensor) -> Tensor:
        """Log-risk, shape (n,)."""
        return self.layers(x).squeeze(-1)


class CoxTimeNet(nn.Module):
    r"""CoxTime network :math:`g(t, x)`: the MLP sees :math:`[x, \tilde t]`, standardised time
    appended as a last feature (pycox ``MLPVanillaCoxTime``); no output bias.

    References
    ----------
    Kvamme, Borgan & Scheel (2019), JMLR 20(129), Sec. 4.
    """

    def __init__(
        self,
        in_features: int,
        hidden: tuple[int, ...] = (32, 32),
        activation: str = "relu",
        dropout: float = 0.1,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layers = _mlp(
            in_features + 1, tuple(hidden), 1, activation=activation, dropout=dropout,
            batch_norm=batch_norm, output_bias=False,
        )

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        """Log-risk at standardised time ``t`` (shape (n,)), shape (n,)."""
        return self.layers(torch.cat([x, t.reshape(-1, 1).to(x.dtype)], dim=1)).squeeze(-1)


# --------------------------------------------------------------------------- wrappers


@contextmanager
def _inference(net: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd inside; the previous mode is restored afterwards."""
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        net.train(was_training)


def _features(x: np.ndarray, in_features: int) -> Tensor:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must have shape (n, {in_features}), got {x.shape}")
    return torch.from_numpy(x)


class SurvivalModel(ABC):
    """Uniform interface over the three survival model kinds.

    Attributes
    ----------
    net : nn.Module
        All trainable state (FedAvg averages ``net.state_dict()``).
    cuts : ndarray, shape (K,)
        Time grid: the hazard intervals, or the Breslow grid of the Cox kinds.
    in_features : int
    kind : str
    needs_baseline : bool
        True when survival curves need :meth:`set_baseline` after training.
    """

    kind: ClassVar[str]
    needs_baseline: ClassVar[bool]

    def __init__(self, net: nn.Module, cuts: np.ndarray, in_features: int) -> None:
        self.net = net
        self.cuts = _check_cuts(cuts)
        self.in_features = in_features
        self._cuts_tensor = torch.from_numpy(self.cuts)

    def loss(self, x: Tensor, time: Tensor, event: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
        """Mini-batch training loss (a scalar tensor, mean over the batch).

        Parameters
        ----------
        x : Tensor, shape (n, p), float32
        time : Tensor, shape (n,), non-negative
        event : Tensor, shape (n,), 0/1
        generator : torch.Generator, optional
            Randomness of the loss itself (CoxTime's control sampling).
        """
        self._check_batch(x, time, event)
        return self._loss(x, time, event, generator)

    def _check_batch(self, x: Tensor, time: Tensor, event: Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must have shape (n, {self.in_features}), got {tuple(x.shape)}")
        if time.shape != (x.shape[0],) or event.shape != (x.shape[0],):
            raise ValueError(f"time and event must have shape ({x.shape[0]},)")
        if x.shape[0] == 0:
            raise ValueError("empty batch")

    def predict_survival(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r"""Survival curves on the model's grid, in eval mode without autograd.

        Returns
        -------
        times : ndarray, shape (m,)
        surv : ndarray, shape (n, m)
            :math:`S(\tau_j \mid x_i)`, right-continuous steps between grid points.
        """
        features = _features(x, self.in_features)
        with _inference(self.net):
            surv = self._survival(features)
        return self.cuts.copy(), surv

    def risk_score(self, x: np.ndarray) -> np.ndarray:
        r"""Risk score, higher = higher risk: :math:`-\mathrm{RMST}` over the grid by default
        (see :func:`restricted_mean_survival_time`)."""
        times, surv = self.predict_survival(x)
        return -restricted_mean_survival_time(times, surv)

    @abstractmethod
    def _loss(self, x: Tensor, time: Tensor, event: Tensor, generator: torch.Generator | None) -> Tensor: ...

    @abstractmethod
    def _survival(self, x: Tensor) -> np.ndarray: ...


class HazardModel(SurvivalModel):
    r"""Discrete-time logistic hazard model; :math:`S(\tau_j) = \prod_{l \le j} (1 - h_l)`.

    The training loss discretises (time, event) on ``cuts`` (:func:`discretise`) and applies
    :func:`models.losses.logistic_hazard_nll`.
    """

    kind = "hazard_mlp"
    needs_baseline = False

    def _loss(self, x: Tensor, time: Tensor, event: Tensor, generator: torch.Generator | None) -> Tensor:
        return self._per_sample_loss(x, time, event).mean()

    def per_sample_loss(self, x: Tensor, time: Tensor, event: Tensor) -> Tensor:
        """Per-record negative log-likelihood, shape (n,) (``reduction="none"``; for DP-SGD).

        The batch mean equals :meth:`loss`; record i's term depends only on record i.
        """
        self._check_batch(x, time, event)
        return self._per_sample_loss(x, time, event)

    def _per_sample_loss(self, x: Tensor, time: Tensor, event: Tensor) -> Tensor:
        idx, events = _discretise_tensor(time, event, self._cuts_tensor)
        if idx.numel() and idx.min() < 0:
            raise ValueError(f"every time must be >= the first cut point {self.cuts[0]}")
        return logistic_hazard_nll(self.net(x), idx, events, reduction="none")

    def _survival(self, x: Tensor) -> np.ndarray:
        log_one_minus_h = nn.functional.logsigmoid(-self.net(x).double())
        return torch.exp(torch.cumsum(log_one_minus_h, dim=1)).numpy()


class _BreslowModel(SurvivalModel):
    """Shared baseline handling of the Cox kinds (federated Breslow on ``cuts``)."""

    needs_baseline = True

    def __init__(self, net: nn.Module, cuts: np.ndarray, in_features: int, penalty: float) -> None:
        super().__init__(net, cuts, in_features)
        if penalty < 0:
            raise ValueError(f"penalty must be >= 0, got {penalty}")
        self.penalty = penalty
        self.baseline_hazard: np.ndarray | None = None

    def breslow_aggregates(
        self, x: np.ndarray, time: np.ndarray, event: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        r"""This site's :math:`(d_k, R_k)` on ``cuts`` (:func:`models.breslow.site_aggregates`).

        Only these two vectors leave the site; the server sums them and calls
        :meth:`set_baseline`.
        """
        features = _features(x, self.in_features)
        with _inference(self.net):
            log_risk = self._log_risk_on_grid(features)
        return site_aggregates(time, event, log_risk, self.cuts)

    def set_baseline(self, event_counts: np.ndarray, risk_sums: np.ndarray) -> None:
        r"""Set :math:`\Delta H_0(\tau_k) = \sum_s d_k / \sum_s R_k` from aggregates summed over sites."""
        increments = baseline_hazard_increments(event_counts, risk_sums)
        if increments.shape != self.cuts.shape:
            raise ValueError(f"aggregates must have shape {self.cuts.shape}, got {increments.shape}")
        self.baseline_hazard = increments

    def _require_baseline(self) -> np.ndarray:
        if self.baseline_hazard is None:
            raise RuntimeError(
                f"{type(self).__name__} has no baseline hazard: call set_baseline(*breslow_aggregates(...)) "
                "(summed over sites) after training"
            )
        return self.baseline_hazard

    @abstractmethod
    def _log_risk_on_grid(self, x: Tensor) -> np.ndarray: ...


class CoxModel(_BreslowModel):
    r"""Cox-MLP: :math:`S(t \mid x) = \exp(-H_0(t)\, e^{g(x)})`, loss
    :func:`models.losses.cox_ph_loss` with the LS-ADP penalty."""

    kind = "cox_mlp"

    def _loss(self, x: Tensor, time: Tensor, event: Tensor, generator: torch.Generator | None) -> Tensor:
        return cox_ph_loss(self.net(x), time, event, penalty=self.penalty)

    def _log_risk_on_grid(self, x: Tensor) -> np.ndarray:
        return self.net(x).double().numpy()

    def _survival(self, x: Tensor) -> np.ndarray:
        cumulative = np.cumsum(self._require_baseline())
        return np.exp(-np.outer(np.exp(self._log_risk_on_grid(x)), cumulative))

    def risk_score(self, x: np.ndarray) -> np.ndarray:
        """Log-risk :math:`g(x)` (needs no baseline)."""
        features = _features(x, self.in_features)
        with _inference(self.net):
            return self._log_risk_on_grid(features)


class CoxTimeModel(_BreslowModel):
    r"""CoxTime: :math:`S(t \mid x) = \exp(-\sum_{\tau_k \le t} \Delta H_0(\tau_k) e^{g(\tau_k, x)})`.

    Time enters the net standardised, :math:`\tilde t = (t - \mu) / s` with
    ``time_scale = (mu, s)`` (pycox ``LabTransCoxTime`` uses the mean and standard deviation
    of the training durations). The loss samples one control per case from the batch risk
    set (:func:`models.losses.sample_risk_set_controls`) and applies
    :func:`models.losses.cox_time_loss`; the risk score is :math:`-\mathrm{RMST}`.
    """

    kind = "cox_time"

    def __init__(
        self, net: nn.Module, cuts: np.ndarray, in_features: int, penalty: float,
        time_scale: tuple[float, float],
    ) -> None:
        super().__init__(net, cuts, in_features, penalty)
        shift, scale = (float(v) for v in time_scale)
        if not (np.isfinite(shift) and np.isfinite(scale) and scale > 0):
            raise ValueError(f"time_scale must be (shift, scale) with scale > 0, got {time_scale}")
        self.time_scale = (shift, scale)

    def _standardise(self, time: Tensor) -> Tensor:
        return (time - self.time_scale[0]) / self.time_scale[1]

    def _loss(self, x: Tensor, time: Tensor, event: Tensor, generator: torch.Generator | None) -> Tensor:
        case, control = sample_risk_set_controls(time, event, generator)
        case_time = self._standardise(time[case])
        g_case = self.net(x[case], case_time)
        g_control = self.net(x[control], case_time)
        return cox_time_loss(g_case, g_control, penalty=self.penalty)

    def _log_risk_on_grid(self, x: Tensor) -> np.ndarray:
        r""":math:`g(\tau_k, x_i)`, shape (n, K), in row blocks of at most ~2^20 evaluations."""
        num_points = self.cuts.size
        grid = self._standardise(self._cuts_tensor).to(x.dtype)
        rows = max(1, 2**20 // num_points)
        blocks = []
        for block in x.split(rows):
            g = self.net(block.repeat_interleave(num_points, dim=0), grid.repeat(block.shape[0]))
            blocks.append(g.view(block.shape[0], num_points).double().numpy())
        return np.concatenate(blocks)

    def _survival(self, x: Tensor) -> np.ndarray:
        increments = self._require_baseline()
        return np.exp(-np.cumsum(increments[None, :] * np.exp(self._log_risk_on_grid(x)), axis=1))


_NETS: dict[str, type[nn.Module]] = {"hazard_mlp": HazardMLP, "cox_mlp": CoxMLP, "cox_time": CoxTimeNet}


def build_survival_model(
    kind: str,
    *,
    in_features: int,
    cuts: np.ndarray,
    hidden: tuple[int, ...] | None = None,
    dropout: float | None = None,
    activation: str | None = None,
    penalty: float = 0.0,
    time_scale: tuple[float, float] = (0.0, 1.0),
    seed: int = 0,
) -> SurvivalModel:
    r"""Build a survival model wrapper with a freshly initialised network.

    Parameters
    ----------
    kind : {"hazard_mlp", "cox_mlp", "cox_time"}
    in_features : int
        Number of input features.
    cuts : ndarray, shape (K,)
        Time grid: hazard intervals (``hazard_mlp``, output size K) or the shared Breslow grid
        (Cox kinds). From :func:`make_time_grid`, or any strictly increasing grid.
    hidden, dropout, activation : optional
        Network overrides; None keeps the kind's default (see :class:`HazardMLP`,
        :class:`CoxMLP`, :class:`CoxTimeNet`).
    penalty : float, default 0
        :math:`\lambda` of the Cox kinds' |g| penalty (ignored by ``hazard_mlp``).
    time_scale : (float, float), default (0, 1)
        (shift, scale) standardising time for ``cox_time`` (ignored otherwise).
    seed : int, default 0
        Seeds the initialisation (the global torch RNG is left untouched).

    Returns
    -------
    SurvivalModel
    """
    if kind not in _NETS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(_NETS)}")
    cuts = _check_cuts(cuts)
    overrides = {
        name: value
        for name, value in (("hidden", hidden), ("dropout", dropout), ("activation", activation))
        if value is not None
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "hazard_mlp":
            return HazardModel(HazardMLP(in_features, cuts.size, **overrides), cuts, in_features)
        net = _NETS[kind](in_features, **overrides)
    if kind == "cox_mlp":
        return CoxModel(net, cuts, in_features, penalty)
    return CoxTimeModel(net, cuts, in_features, penalty, time_scale)
