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

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from models.breslow import baseline_hazard_increments, site_aggregates
from models.recalibration import apply_exponents
from models.losses import (
    cox_ph_loss,
    cox_time_loss,
    logistic_hazard_nll,
    sample_risk_set_controls,
)
from models.time_grid import check_time_event

__all__ = [
    "CoxMLP",
    "CoxModel",
    "CoxTimeModel",
    "CoxTimeNet",
    "HazardMLP",
    "HazardModel",
    "RISK_LAYERS",
    "SurvivalModel",
    "build_survival_model",
    "discretise",
    "restricted_mean_survival_time",
]

#: A baseline hazard is clipped to [HAZARD_CLIP, 1 - HAZARD_CLIP] before its logit becomes an output bias.
HAZARD_CLIP = 1e-5
#: How a hazard network's logits come from its last hidden layer: one linear map per interval, or one risk score
#: shifting every interval's baseline (:class:`HazardMLP`; the fusion head's :class:`models.multimodal.FusionHead`).
RISK_LAYERS = ("interval", "proportional")

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "selu": nn.SELU,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "tanh": nn.Tanh,
}


# --------------------------------------------------------------------------- discretisation


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
        Strictly increasing cut points (:func:`models.time_grid.make_time_grid`).

    Returns
    -------
    idx_durations : ndarray of int64, shape (n,)
    events : ndarray of float32, shape (n,)

    References
    ----------
    Kvamme & Borgan (2019), arXiv:1910.06724, Sec. 4 (pycox ``IdxDiscUnknownC``).
    """
    time, event = check_time_event(time, event)
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


class FirstIntervalTie(nn.Module):
    r"""Parameter-free: the covariate terms of intervals :math:`1, \dots, T-1`, shape (n, T - 1), become those of
    all :math:`T` intervals, interval 0 taking interval 1's (:class:`HazardMLP`'s ``interval`` layer)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x[:, :1], x], dim=1)


class HazardMLP(nn.Module):
    r"""MLP giving one hazard logit per interval, :math:`h_j(x) = \sigma(\phi_j(x))`,
    :math:`\phi_j(x) = \beta_j + w_j^\top z(x)`: an interval baseline :math:`\beta_j` (``baseline``) plus a linear
    function of the last hidden layer :math:`z(x)`.

    Default architecture is FSL-BDP's Input -> 128 -> 64 -> 64 -> 32 -> 32 -> T with SELU. ``hidden=()`` is linear,
    :math:`z(x) = x`: with the ``proportional`` layer the discrete-time proportional-hazards model
    :math:`\phi_j(x) = \beta_j + w^\top x`.

    ``risk_layer`` (:data:`RISK_LAYERS`) is how the covariate weights :math:`w_j` are shared:

    ``"interval"``
        Every interval has its own weights, so curves of two records may cross; interval 0 shares interval 1's,
        :math:`w_0 = w_1` (``layers`` ends in ``Linear(width, T - 1)`` without bias and :class:`FirstIntervalTie`).
        The grid starts at :math:`\tau_0 = 0` (:func:`models.time_grid.make_time_grid`), so interval 0 is the
        point :math:`\{0\}`: no event falls in it, its own weights would learn from nothing (every record only
        survives it, and Adam moves weights at full speed however small their gradient), and
        :math:`\hat S(\tau_0) = 1 - h_0(x)`, which a right-continuous step curve keeps until :math:`\tau_1`, would
        order the records at chance for every event of the first interval. Tied, it orders them as interval 1's
        hazard does, while :math:`\beta_0` keeps :math:`h_0` near zero.
    ``"proportional"``
        One risk score shifting every interval's baseline logit alike, :math:`w_j = w`
        (``layers`` ends in ``Linear(width, 1)`` without bias): the discrete logistic model of Cox (1972, Sec. 6),
        as :class:`models.multimodal.ProportionalRisk`. The curves never cross, so the ranking of records is the
        same at every time, and the output layer has ``width`` weights instead of ``width * (T - 1)``: under DP
        noise every interval's events train one score.

    Start: with ``baseline_hazard`` :math:`\bar h` (e.g. :func:`models.time_grid.interval_hazard`
    of the set-up's released counts), the output weights start at zero and :math:`\beta_j` at
    :math:`\operatorname{logit}(\bar h_j)` (clipped to :data:`HAZARD_CLIP`), so the untrained net predicts
    :math:`\prod_{l \le j}(1 - \bar h_l)` for every record: the covariate-free Kaplan-Meier curve at the cuts.
    Without it, a data-independent constant hazard :math:`h` with :math:`(1 - h)^T = 1/2`: with zero baselines
    every interval would start at :math:`h = 1/2` (survival :math:`2^{-T}` at the end), and the first rounds, or a
    noisy DP-SGD run's whole budget, would go into unlearning that.

    References
    ----------
    FSL-BDP paper, Sec. 3 (architecture); Gensheimer & Narasimhan (2019), PeerJ 7:e6257; Cox (1972),
    JRSS-B 34:187, Sec. 6.
    """

    def __init__(
        self,
        in_features: int,
        num_durations: int,
        hidden: tuple[int, ...] = (128, 64, 64, 32, 32),
        activation: str = "selu",
        dropout: float = 0.0,
        baseline_hazard: np.ndarray | None = None,
        risk_layer: str = "interval",
    ) -> None:
        super().__init__()
        if risk_layer not in RISK_LAYERS:
            raise ValueError(f"risk_layer must be one of {RISK_LAYERS}, got {risk_layer!r}")
        if num_durations < 2:
            raise ValueError(f"num_durations must be at least 2 (interval 0 is the point {{0}}), got {num_durations}")
        if baseline_hazard is None:
            hazard = np.full(num_durations, 1.0 - 0.5 ** (1.0 / num_durations))
        else:
            hazard = np.clip(np.asarray(baseline_hazard, dtype=np.float64), HAZARD_CLIP, 1.0 - HAZARD_CLIP)
            if hazard.shape != (num_durations,) or not np.all(np.isfinite(hazard)):
                raise ValueError(f"baseline_hazard must be {num_durations} finite hazards, got shape {hazard.shape}")
        self.baseline = nn.Parameter(torch.from_numpy(np.log(hazard / (1.0 - hazard))).float())
        interval = risk_layer == "interval"
        self.layers = _mlp(in_features, tuple(hidden), num_durations - 1 if interval else 1, activation=activation,
                           dropout=dropout, output_bias=False)
        if baseline_hazard is not None:
            nn.init.zeros_(self.layers[-1].weight)
        if interval:
            self.layers.append(FirstIntervalTie())

    def forward(self, x: Tensor) -> Tensor:
        """Logits, shape (n, T)."""
        return self.layers(x) + self.baseline


class CoxMLP(nn.Module):
    r"""DeepSurv-style log-risk network :math:`g(x)`; no output bias (the partial likelihood
    does not identify a constant). ``hidden=()`` is Cox regression, :math:`g(x) = x^\top\beta`.

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
        return self._risk(x, *self.predict_survival(x))

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(times, surv, risk)``: :meth:`predict_survival` and :meth:`risk_score` of ``x``, the curves predicted once."""
        times, surv = self.predict_survival(x)
        return times, surv, self._risk(x, times, surv)

    def _risk(self, x: np.ndarray, times: np.ndarray, surv: np.ndarray) -> np.ndarray:
        """The risk score of the records ``x``, whose predicted curves are ``surv``."""
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

    #: Recalibration exponents, one per cut (:func:`models.recalibration.apply_exponents`); None: the network's curves.
    exponents: np.ndarray | None = None

    def set_exponents(self, exponents: np.ndarray | None) -> None:
        """Recalibrate the predicted curves to :math:`S(\\tau_j \\mid x)^{c_j}` (None: no recalibration)."""
        if exponents is not None:
            exponents = np.asarray(exponents, dtype=np.float64)
            if exponents.shape != self.cuts.shape or not np.all(np.isfinite(exponents) & (exponents > 0)):
                raise ValueError(f"recalibration needs {self.cuts.size} positive exponents, got shape {exponents.shape}")
        self.exponents = exponents

    def _survival(self, x: Tensor) -> np.ndarray:
        log_one_minus_h = nn.functional.logsigmoid(-self.net(x).double())
        surv = torch.exp(torch.cumsum(log_one_minus_h, dim=1)).numpy()
        return surv if self.exponents is None else apply_exponents(surv, self.exponents)


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

    def _risk(self, x: np.ndarray, times: np.ndarray, surv: np.ndarray) -> np.ndarray:
        return self.risk_score(x)


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
    kind: str, *, in_features: int, cuts: np.ndarray, hidden: tuple[int, ...] | None = None,
    dropout: float | None = None, activation: str | None = None, penalty: float = 0.0,
    time_scale: tuple[float, float] = (0.0, 1.0), baseline_hazard: np.ndarray | None = None,
    risk_layer: str = "interval", seed: int = 0,
) -> SurvivalModel:
    r"""Build a survival model wrapper with a freshly initialised network.

    Parameters
    ----------
    kind : {"hazard_mlp", "cox_mlp", "cox_time", "coxph"}
        ``coxph``: the linear log-risk :math:`x^\top\beta` (a ``cox_mlp`` net without hidden layers or
        dropout) whose weights :mod:`flwr_app.cox_server` sets from its Newton-Raphson fit.
    in_features : int
        Number of input features.
    cuts : ndarray, shape (K,)
        Time grid: hazard intervals (``hazard_mlp``, output size K) or the shared Breslow grid
        (Cox kinds). From :func:`models.time_grid.make_time_grid`, or any strictly increasing grid.
    hidden, dropout, activation : optional
        Network overrides; None keeps the kind's default (see :class:`HazardMLP`,
        :class:`CoxMLP`, :class:`CoxTimeNet`).
    penalty : float, default 0
        :math:`\lambda` of the Cox kinds' |g| penalty (ignored by ``hazard_mlp``).
    time_scale : (float, float), default (0, 1)
        (shift, scale) standardising time for ``cox_time`` (ignored otherwise).
    baseline_hazard : ndarray, shape (K,), optional
        ``hazard_mlp``: the hazard per interval the untrained net predicts for every record (see
        :class:`HazardMLP`); None keeps the data-independent start. Ignored by the Cox kinds,
        whose baseline is the Breslow estimator after training.
    risk_layer : {"interval", "proportional"}, default "interval"
        ``hazard_mlp``: its output layer (see :class:`HazardMLP`); only ``"interval"`` for the Cox
        kinds, whose net gives one log-risk already.
    seed : int, default 0
        Seeds the initialisation (the global torch RNG is left untouched).

    Returns
    -------
    SurvivalModel
    """
    if kind == "coxph":  # linear Cox regression fitted by Newton-Raphson (flwr_app.cox_server): g(x) = x'beta
        if hidden or dropout or activation:
            raise ValueError("coxph is linear: no hidden layers, dropout or activation")
        return CoxModel(CoxMLP(in_features, hidden=(), dropout=0.0), _check_cuts(cuts), in_features, 0.0)
    if kind not in _NETS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(_NETS)} or 'coxph'")
    cuts = _check_cuts(cuts)
    if kind != "hazard_mlp" and risk_layer != "interval":
        raise ValueError(f"risk_layer {risk_layer!r} is for hazard_mlp; {kind} gives one log-risk already")
    overrides = _net_overrides(hidden=hidden, dropout=dropout, activation=activation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "hazard_mlp":
            net = HazardMLP(in_features, cuts.size, baseline_hazard=baseline_hazard, risk_layer=risk_layer,
                            **overrides)
            return HazardModel(net, cuts, in_features)
        net = _NETS[kind](in_features, **overrides)
    if kind == "cox_mlp":
        return CoxModel(net, cuts, in_features, penalty)
    return CoxTimeModel(net, cuts, in_features, penalty, time_scale)


def _net_overrides(**settings: object) -> dict[str, object]:
    """The network settings of :func:`build_survival_model` that are given (not None), by name."""
    return {name: value for name, value in settings.items() if value is not None}
