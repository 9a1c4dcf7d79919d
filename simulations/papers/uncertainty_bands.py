r"""Predictive uncertainty of a Bayesian survival model from ``m`` stochastic passes.

Every function takes the hazard logits of ``m`` stochastic forward passes for ``n`` records on a
grid of ``T`` times, an array (numpy or torch) of shape ``(m, n, T)``: what
:func:`models.multimodal_training.predict_multisurv` returns for the centralised
BayesianMultisurv and what the vertical split model returns for the same records. Pass ``s``
gives the survival curve

.. math::

    S^{(s)}_i(\tau_j) = \prod_{l \le j} \big(1 - \sigma(\phi^{(s)}_{il})\big),

and the pointwise equal-tailed band at level :math:`1 - \alpha` (0.95 by default) is
:math:`[q_{\alpha/2}, q_{1 - \alpha/2}]` of :math:`\{S^{(s)}_i(\tau_j)\}_{s=1}^m`, the quantiles
linearly interpolated (numpy's and ``torch.quantile``'s default, so the band is the one of
:func:`models.multimodal.survival_band`). Its width

.. math::

    w_{ij} = q_{1 - \alpha/2}\big(S_i(\tau_j)\big) - q_{\alpha/2}\big(S_i(\tau_j)\big)

is on the survival-probability scale, the scale of the BVFLMSP paper's Figure 8.

Two questions about a modality ``k`` are answered by :func:`compare_bands` applied to two sets of
passes over the same records:

* *trained without k*: the reference is the model trained with every modality, the
  alternative the same architecture trained (from the same seeds) on the other modalities only;
  it asks how uncertain a federation that never had modality ``k`` is;
* *masked at prediction*: the alternative is the full model with ``k`` marked absent in the
  presence mask (:func:`mask_modality`), i.e. a record whose site for ``k`` does not answer; it
  asks what the trained model's band says when one input is missing.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Sec. 8 and Figure 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import expit
from torch import Tensor

__all__ = [
    "BandComparison",
    "BandSummary",
    "band_widths",
    "compare_bands",
    "grid_columns",
    "mask_modality",
    "mean_band_width",
    "noise_to_signal",
    "pass_spread",
    "summarise_band",
    "survival_passes",
    "time_columns",
]

LogitPasses = np.ndarray | Tensor


def _as_passes(logits: LogitPasses) -> np.ndarray:
    array = logits.detach().cpu().numpy() if isinstance(logits, Tensor) else np.asarray(logits)
    array = array.astype(np.float64, copy=False)
    if array.ndim != 3 or min(array.shape) < 1:
        raise ValueError(f"logits must have shape (passes, records, times) with every size >= 1, got {array.shape}")
    return array


def _columns(columns: np.ndarray | Sequence[int] | None, num_times: int) -> np.ndarray:
    if columns is None:
        return np.arange(num_times)
    columns = np.asarray(columns, dtype=np.int64)
    if columns.ndim != 1 or columns.size == 0 or columns.min() < 0 or columns.max() >= num_times:
        raise ValueError(f"columns must be a non-empty list of grid indices in [0, {num_times}), got {columns}")
    return columns


def survival_passes(logits: LogitPasses) -> np.ndarray:
    r"""Survival curves of every pass, :math:`S^{(s)}_i(\tau_j) = \prod_{l \le j} (1 - \sigma(\phi^{(s)}_{il}))`.

    Parameters
    ----------
    logits : array or Tensor, shape (m, n, T)
        Hazard logits of ``m`` passes.

    Returns
    -------
    numpy.ndarray of float64, shape (m, n, T)
    """
    return np.cumprod(expit(-_as_passes(logits)), axis=2)


def band_widths(logits: LogitPasses, *, level: float = 0.95) -> np.ndarray:
    r"""Width :math:`w_{ij} = q_{1-\alpha/2} - q_{\alpha/2}` of each record's pointwise band at each grid time.

    Parameters
    ----------
    logits : array or Tensor, shape (m, n, T)
    level : float, default 0.95
        :math:`1 - \alpha`, in (0, 1).

    Returns
    -------
    numpy.ndarray, shape (n, T)
        Upper minus lower quantile over passes of :math:`S_i(\tau_j)` (linear interpolation).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    alpha = (1.0 - level) / 2.0
    lower, upper = np.quantile(survival_passes(logits), [alpha, 1.0 - alpha], axis=0)
    return upper - lower


def pass_spread(logits: LogitPasses) -> np.ndarray:
    r"""Standard deviation over passes of each record's survival at each grid time.

    .. math::

        s_{ij} = \Big(\frac{1}{m - 1} \sum_{s=1}^m \big(S^{(s)}_i(\tau_j) - \bar S_i(\tau_j)\big)^2\Big)^{1/2}

    (0 when ``m = 1``).

    Returns
    -------
    numpy.ndarray, shape (n, T)
    """
    curves = survival_passes(logits)
    if curves.shape[0] == 1:
        return np.zeros(curves.shape[1:])
    return curves.std(axis=0, ddof=1)


def noise_to_signal(logits: LogitPasses) -> float:
    r"""Spread of the passes relative to the spread of the predictions across records, on the logit scale.

    .. math::

        \rho = \frac{\frac{1}{T} \sum_j \frac{1}{n} \sum_i \operatorname{sd}_s\big(\phi^{(s)}_{ij}\big)}
                     {\frac{1}{T} \sum_j \operatorname{sd}_i\big(\bar\phi_{ij}\big)},
        \qquad \bar\phi_{ij} = \frac1m \sum_s \phi^{(s)}_{ij},

    with standard deviations of ddof 1 (``m`` and ``n`` at least 2). A model whose band narrows only
    because its predictions are less dispersed (a weaker risk signal squeezes the curves together)
    keeps the same :math:`\rho`; a model that is more uncertain about the same signal has a larger one.
    """
    array = _as_passes(logits)
    if array.shape[0] < 2 or array.shape[1] < 2:
        raise ValueError(f"need at least 2 passes and 2 records, got shape {array.shape}")
    within = array.std(axis=0, ddof=1).mean()
    between = array.mean(axis=0).std(axis=0, ddof=1).mean()
    return float(within / between)


def grid_columns(cuts: np.ndarray, start: float, stop: float) -> np.ndarray:
    r"""Indices :math:`j` of the grid times with :math:`\text{start} \le \tau_j \le \text{stop}`.

    Raises ``ValueError`` when no grid time lies in the range.
    """
    cuts = np.asarray(cuts, dtype=np.float64)
    columns = np.flatnonzero((cuts >= start) & (cuts <= stop))
    if columns.size == 0:
        raise ValueError(f"no grid time in [{start}, {stop}] (grid from {cuts.min()} to {cuts.max()})")
    return columns


def time_columns(cuts: np.ndarray, times: np.ndarray | Sequence[float]) -> np.ndarray:
    r"""Index of the last grid time at or before each time: :math:`j(t) = \max\{j : \tau_j \le t\}`.

    The survival curve of a discrete-time model is a step function on the grid, so
    :math:`S(t) = S(\tau_{j(t)})`. Times before :math:`\tau_0` raise ``ValueError``.
    """
    cuts = np.asarray(cuts, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    columns = np.searchsorted(cuts, times, side="right") - 1
    if np.any(columns < 0):
        raise ValueError(f"times {times[columns < 0]} lie before the first grid time {cuts[0]}")
    return columns


def mean_band_width(
    logits: LogitPasses, *, level: float = 0.95, columns: np.ndarray | Sequence[int] | None = None,
) -> np.ndarray:
    r"""Each record's band width averaged over grid times: :math:`\bar w_i = \frac{1}{|J|} \sum_{j \in J} w_{ij}`.

    Parameters
    ----------
    logits : array or Tensor, shape (m, n, T)
    level : float, default 0.95
    columns : sequence of int, optional
        The grid indices :math:`J` (e.g. :func:`grid_columns`); default all ``T``.

    Returns
    -------
    numpy.ndarray, shape (n,)
    """
    widths = band_widths(logits, level=level)
    return widths[:, _columns(columns, widths.shape[1])].mean(axis=1)


@dataclass(frozen=True)
class BandSummary:
    r"""Band widths of one set of passes.

    Attributes
    ----------
    mean_width : float
        :math:`\frac{1}{n |J|} \sum_i \sum_{j \in J} w_{ij}`.
    width_by_record : numpy.ndarray, shape (n,)
        :math:`\bar w_i` over :math:`J` (:func:`mean_band_width`).
    width_by_time : numpy.ndarray, shape (T,)
        :math:`\frac1n \sum_i w_{ij}` at every grid time (all ``T``, whatever :math:`J`).
    spread_by_time : numpy.ndarray, shape (T,)
        :math:`\frac1n \sum_i s_{ij}`, the mean standard deviation over passes (:func:`pass_spread`).
    """

    mean_width: float
    width_by_record: np.ndarray
    width_by_time: np.ndarray
    spread_by_time: np.ndarray


def summarise_band(
    logits: LogitPasses, *, level: float = 0.95, columns: np.ndarray | Sequence[int] | None = None,
) -> BandSummary:
    """Mean band width over records and the grid indices ``columns`` (default all), and its profiles.

    See :class:`BandSummary` for the formulas.
    """
    widths = band_widths(logits, level=level)
    by_record = widths[:, _columns(columns, widths.shape[1])].mean(axis=1)
    return BandSummary(
        mean_width=float(by_record.mean()),
        width_by_record=by_record,
        width_by_time=widths.mean(axis=0),
        spread_by_time=pass_spread(logits).mean(axis=0),
    )


@dataclass(frozen=True)
class BandComparison:
    r"""Band widths of a reference and an alternative set of passes over the same records.

    Attributes
    ----------
    reference_width, alternative_width : float
        Mean widths :math:`W_{\text{ref}}, W_{\text{alt}}` (:attr:`BandSummary.mean_width`).
    difference : float
        :math:`W_{\text{alt}} - W_{\text{ref}}` (positive: the alternative's band is wider).
    ratio : float
        :math:`W_{\text{alt}} / W_{\text{ref}}` (``inf`` when :math:`W_{\text{ref}} = 0 < W_{\text{alt}}`,
        ``nan`` when both are 0).
    share_wider : float
        Share of records with :math:`\bar w^{\text{alt}}_i > \bar w^{\text{ref}}_i`.
    difference_by_record : numpy.ndarray, shape (n,)
        :math:`\bar w^{\text{alt}}_i - \bar w^{\text{ref}}_i`.
    """

    reference_width: float
    alternative_width: float
    difference: float
    ratio: float
    share_wider: float
    difference_by_record: np.ndarray


def compare_bands(
    reference_logits: LogitPasses,
    alternative_logits: LogitPasses,
    *,
    level: float = 0.95,
    columns: np.ndarray | Sequence[int] | None = None,
) -> BandComparison:
    """Compare the bands of two sets of passes over the same ``n`` records and ``T`` grid times.

    ``reference_logits`` is typically the model with every modality; ``alternative_logits`` the
    model trained without modality ``k``, or the full model with ``k`` masked
    (:func:`mask_modality`). The two may have different numbers of passes. See
    :class:`BandComparison` for the formulas.
    """
    reference = _as_passes(reference_logits)
    alternative = _as_passes(alternative_logits)
    if reference.shape[1:] != alternative.shape[1:]:
        raise ValueError(f"the passes must cover the same records and times: {reference.shape[1:]} vs "
                         f"{alternative.shape[1:]}")
    ref = mean_band_width(reference, level=level, columns=columns)
    alt = mean_band_width(alternative, level=level, columns=columns)
    reference_width, alternative_width = float(ref.mean()), float(alt.mean())
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.divide(alternative_width, reference_width))
    return BandComparison(
        reference_width=reference_width,
        alternative_width=alternative_width,
        difference=alternative_width - reference_width,
        ratio=ratio,
        share_wider=float(np.mean(alt > ref)),
        difference_by_record=alt - ref,
    )


def mask_modality(present: np.ndarray | Tensor, modalities: Sequence[str], name: str) -> np.ndarray | Tensor:
    """A copy of the presence mask (n, M) with modality ``name`` marked absent for every record.

    ``modalities`` names the mask's columns in order (e.g. ``model.modalities``). Passing the
    result to the prediction makes the model fuse the other modalities only (the
    "masked at prediction" comparison).
    """
    if name not in modalities:
        raise ValueError(f"unknown modality {name!r}; the mask's columns are {list(modalities)}")
    if present.ndim != 2 or present.shape[1] != len(modalities):
        raise ValueError(f"present must have shape (n, {len(modalities)}), got {tuple(present.shape)}")
    masked = present.clone() if isinstance(present, Tensor) else np.array(present, dtype=bool)
    masked[:, list(modalities).index(name)] = False
    return masked
