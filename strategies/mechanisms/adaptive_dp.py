r"""NbAFL noise and the adaptive budget allocations LS-ADP and ROW-DP.

Pure functions only (numpy; they take numpy arrays or torch tensors but import neither torch nor
Flower); the strategy layer calls them. LS-ADP's trial perturbation of a network's layers
(:func:`~strategies.mechanisms.weight_release.perturbed_layer_metrics`) is torch code and lives
with the site's release in :mod:`strategies.mechanisms.weight_release`.

NbAFL (Wei et al. 2020)
-----------------------
Each site clips its model weights to L2 norm ``C`` (:func:`clip_update`) and adds Gaussian
noise to every weight before upload; the server adds more before broadcast:

.. math::

    c = \sqrt{2 \ln(1.25/δ)}, \qquad Δs_U = \frac{2C}{m}, \qquad
    σ_U = \frac{c L Δs_U}{ε}, \qquad
    σ_D = \begin{cases} \dfrac{2 c C \sqrt{T^2 - L^2 N}}{m N ε} & T > L\sqrt N \\
                        0 & T \le L\sqrt N \end{cases}

with ``m`` the smallest site size, ``L`` the number of exposures (uploads) of a site, ``T`` the
number of rounds and ``N`` the number of sites. ``Δs_U`` is the L2 sensitivity of a site's
clipped weights to **replacing** one of its records (Wei et al., Lemma 1). The classical
constant ``c`` is only proved for ``ε < 1`` (Dwork & Roth 2014, Thm A.1); the functions do not
refuse larger ε (the paper uses up to ε = 7) but the RDP audit
(:func:`audited_epsilon_rdp`) is valid for every ε.

LS-ADP and ROW-DP (Niu et al. 2025)
-----------------------------------
Both give every *unit* (a layer for LS-ADP, a weight of one randomly chosen layer for ROW-DP)
an importance ``V`` (``Σ V = 1`` over the units allocated over) and a budget
``ε_unit = ε · K · V`` with ``K`` the number of those units, so the **mean** budget is ``ε``
(the paper's "average privacy budget"); each unit is then perturbed with the NbAFL ``σ_U`` of
its own budget (:func:`noise_std_from_budgets`).

Honest accounting. All units share one clip norm ``C`` on the whole update, so the release is
one Gaussian mechanism with diagonal covariance ``diag(σ_i²)``. Whitening it, its L2
sensitivity becomes ``||Δ/σ||_2 ≤ Δs_U / min_i σ_i``: its guarantee is that of isotropic noise
``min σ``, i.e. of the **largest** budget, not of the mean (:func:`audited_epsilon_nominal_formula`,
:func:`audited_epsilon_rdp`). The exact-budget variant (:func:`split_clip_norm`,
:func:`exact_budget_noise_stds`, :func:`joint_noise_multiplier`) clips each layer to its own
``C_i`` with ``Σ C_i² = C²`` and uses ``s_i = z C_i / \sqrt{V_i}``, which spends exactly the
budget of one Gaussian mechanism with noise multiplier ``z``.

The importance scores are computed from the site's private data (the site's evaluation metric
and its local iterates); they are not themselves privatised.

References
----------
Niu et al., "Adaptive Differential Privacy Cox-MLP Model Based on Federated Learning",
Mathematics 13(7):1096, 2025 ("LS-ADP / ROW-DP", doi:10.3390/math13071096);
Wei et al., "Federated learning with differential privacy: algorithms and performance
analysis", IEEE TIFS 15:3454–3469, 2020 (NbAFL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from strategies.accounting.rdp import DEFAULT_RDP_ORDERS, epsilon_gaussian_rounds
from strategies.config import DISPERSION_MEASURES  # the schema's choices of privacy.dispersion
from strategies.validation import check_choice, check_count, check_positive, check_probability, is_tensor

__all__ = [
    "AUDIT_RDP_ORDERS",
    "DISPERSION_MEASURES",
    "audited_epsilon_nominal_formula",
    "audited_epsilon_rdp",
    "clip_update",
    "dispersion",
    "exact_budget_noise_stds",
    "gaussian_constant",
    "joint_noise_multiplier",
    "layer_sensitivity_importance",
    "ls_adp_budgets",
    "nbafl_downlink_noise_std",
    "nbafl_sensitivity",
    "nbafl_uplink_noise_std",
    "noise_std_from_budgets",
    "row_dp_budgets",
    "row_dp_importance",
    "split_clip_norm",
]

#: RDP orders for :func:`audited_epsilon_rdp`: opacus' grid (up to 63) extended geometrically to
#: 65536. NbAFL's noise is large relative to ``Δs_U`` (multipliers in the hundreds), where the
#: optimal order lies far above 63; the Gaussian's RDP ``α/(2z²)`` is exact at every order.
AUDIT_RDP_ORDERS: tuple[float, ...] = tuple(DEFAULT_RDP_ORDERS) + tuple(
    float(round(64 * 2 ** (k / 4))) for k in range(1, 41)
)


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _to_numpy(values: Any) -> np.ndarray:
    """float64 numpy copy of an array, a tensor, or a sequence of equal-shape arrays/tensors."""
    if is_tensor(values):
        return values.detach().cpu().double().numpy()
    if isinstance(values, (list, tuple)) and values and is_tensor(values[0]):
        return np.stack([v.detach().cpu().double().numpy() for v in values])
    return np.array(values, dtype=np.float64)


def _check_importance(importance: Any, name: str = "importance") -> np.ndarray:
    """Finite, ≥ 0, not all zero; returned as float64 normalised to sum 1 (shape kept)."""
    array = _to_numpy(importance)
    if array.size == 0:
        raise ValueError(f"{name} must not be empty")
    if not np.all(np.isfinite(array)) or np.any(array < 0.0):
        raise ValueError(f"{name} must be finite and >= 0")
    total = float(array.sum())
    if total <= 0.0:
        raise ValueError(f"{name} must not be all zero")
    return array / total


def _check_uniform_mix(uniform_mix: float) -> float:
    checked = float(uniform_mix)
    if not math.isfinite(checked) or not 0.0 <= checked <= 1.0:
        raise ValueError(f"uniform_mix must lie in [0, 1], got {uniform_mix!r}")
    return checked


def _flat_stds(noise_stds: Any) -> np.ndarray:
    """All noise standard deviations as one flat float64 array (ragged lists allowed)."""
    if isinstance(noise_stds, (list, tuple)) and any(np.ndim(s) > 0 for s in noise_stds):
        parts = [_to_numpy(s).reshape(-1) for s in noise_stds]
        array = np.concatenate(parts) if parts else np.empty(0)
    else:
        array = _to_numpy(noise_stds).reshape(-1)
    if array.size == 0:
        raise ValueError("noise_stds must not be empty")
    if np.any(np.isnan(array)) or np.any(array <= 0.0):
        raise ValueError("noise_stds must be > 0 (math.inf allowed for a unit not released)")
    return array


# --------------------------------------------------------------------------------------------
# NbAFL
# --------------------------------------------------------------------------------------------


def gaussian_constant(delta: float) -> float:
    r"""The classical Gaussian-mechanism constant ``c = sqrt(2 ln(1.25/δ))``.

    ``N(0, (cΔ/ε)²)`` noise on a query of L2 sensitivity ``Δ`` is ``(ε, δ)``-DP for ``ε < 1``.

    Parameters
    ----------
    delta : float
        δ in (0, 1).

    Returns
    -------
    float
        ``c``.

    References
    ----------
    Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", 2014, Thm A.1;
    Niu et al., Mathematics 2025, Definition 2 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    delta = check_probability(delta, "delta")
    return math.sqrt(2.0 * math.log(1.25 / delta))


def nbafl_sensitivity(*, clip_norm: float, min_site_records: int) -> float:
    r"""Uplink L2 sensitivity ``Δs_U = 2C/m`` of a site's clipped weights (replace one record).

    Parameters
    ----------
    clip_norm : float
        ``C``, the L2 norm the site's weights are clipped to.
    min_site_records : int
        ``m``, the number of records of the smallest site.

    Returns
    -------
    float
        ``2C/m``.

    References
    ----------
    Wei et al. 2020 IEEE TIFS, "Federated learning with differential privacy: algorithms and
    performance analysis", Lemma 1; Niu et al., Mathematics 2025, §3.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    min_site_records = check_count(min_site_records, "min_site_records")
    return 2.0 * clip_norm / min_site_records


def nbafl_uplink_noise_std(
    *, epsilon: float, delta: float, clip_norm: float, min_site_records: int, exposures: int
) -> float:
    r"""NbAFL uplink noise std per weight, ``σ_U = c · L · Δs_U / ε``.

    With ``c = sqrt(2 ln(1.25/δ))`` (:func:`gaussian_constant`) and ``Δs_U = 2C/m``
    (:func:`nbafl_sensitivity`).

    Parameters
    ----------
    epsilon : float
        ε > 0 of a site over the whole training (``c`` is proved for ε < 1 only).
    delta : float
        δ in (0, 1).
    clip_norm : float
        ``C``, the clip norm of the site's weights.
    min_site_records : int
        ``m``, the smallest site size.
    exposures : int
        ``L``, how many times a site uploads its (noisy) weights.

    Returns
    -------
    float
        ``σ_U``.

    References
    ----------
    Wei et al. 2020 IEEE TIFS, "Federated learning with differential privacy: algorithms and
    performance analysis", Thm 1; Niu et al., Mathematics 2025, eq. (11)
    ("LS-ADP / ROW-DP", doi:10.3390/math13071096).
    """
    epsilon = check_positive(epsilon, "epsilon")
    exposures = check_count(exposures, "exposures")
    sensitivity = nbafl_sensitivity(clip_norm=clip_norm, min_site_records=min_site_records)
    return gaussian_constant(delta) * exposures * sensitivity / epsilon


def nbafl_downlink_noise_std(
    *,
    epsilon: float,
    delta: float,
    clip_norm: float,
    min_site_records: int,
    exposures: int,
    rounds: int,
    num_sites: int,
) -> float:
    r"""NbAFL server (downlink) noise std per weight.

    .. math::

        σ_D = \frac{2 c C \sqrt{T^2 - L^2 N}}{m N ε} \text{ if } T > L\sqrt N,
        \quad 0 \text{ otherwise.}

    Parameters
    ----------
    epsilon, delta : float
        The budget, ε > 0 and δ in (0, 1).
    clip_norm : float
        ``C``.
    min_site_records : int
        ``m``, the smallest site size.
    exposures : int
        ``L``, uploads per site.
    rounds : int
        ``T``, aggregation rounds.
    num_sites : int
        ``N``, sites per round.

    Returns
    -------
    float
        ``σ_D`` (exactly ``0.0`` when ``T ≤ L·sqrt(N)``: the uplink noise already suffices).

    References
    ----------
    Wei et al. 2020 IEEE TIFS, "Federated learning with differential privacy: algorithms and
    performance analysis", Thm 2; Niu et al., Mathematics 2025, eq. (13)
    ("LS-ADP / ROW-DP", doi:10.3390/math13071096).
    """
    epsilon = check_positive(epsilon, "epsilon")
    clip_norm = check_positive(clip_norm, "clip_norm")
    min_site_records = check_count(min_site_records, "min_site_records")
    exposures = check_count(exposures, "exposures")
    rounds = check_count(rounds, "rounds")
    num_sites = check_count(num_sites, "num_sites")
    c = gaussian_constant(delta)
    excess = rounds**2 - exposures**2 * num_sites  # integers: the T > L·sqrt(N) test is exact
    if excess <= 0:
        return 0.0
    return 2.0 * c * clip_norm * math.sqrt(excess) / (min_site_records * num_sites * epsilon)


def clip_update(arrays: Sequence[Any], clip_norm: float) -> tuple[list[Any], float]:
    r"""Scale arrays jointly so that their global L2 norm is at most ``C`` (NbAFL clipping).

    ``w ← w · min(1, C / ||w||_2)`` with ``||w||_2 = sqrt(Σ_k ||w_k||²)`` over all arrays.

    Parameters
    ----------
    arrays : sequence of numpy.ndarray or torch.Tensor
        The model's weights (or update), one array per parameter tensor.
    clip_norm : float
        ``C`` > 0.

    Returns
    -------
    clipped : list
        New arrays of the same types, dtypes and shapes (the inputs are not modified; when the
        norm is already ≤ C the values are bit-identical to the inputs).
    norm : float
        The global L2 norm **before** clipping.

    References
    ----------
    Wei et al. 2020 IEEE TIFS, "Federated learning with differential privacy: algorithms and
    performance analysis", Algorithm 1 (``w ← w / max(1, ||w||/C)``).
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    squared = 0.0
    for array in arrays:
        if is_tensor(array):
            squared += float((array.detach().double() ** 2).sum())
        else:
            squared += float(np.sum(np.asarray(array, dtype=np.float64) ** 2))
    norm = math.sqrt(squared)
    if not math.isfinite(norm):
        raise ValueError("arrays must be finite")
    if norm <= clip_norm:
        clipped = [a.clone() if is_tensor(a) else np.array(a, copy=True) for a in arrays]
        return clipped, norm
    scale = clip_norm / norm
    clipped = [a * scale if is_tensor(a) else np.asarray(a) * scale for a in arrays]
    return clipped, norm


# --------------------------------------------------------------------------------------------
# LS-ADP: layer sensitivity
# --------------------------------------------------------------------------------------------


def layer_sensitivity_importance(baseline_metric: float, perturbed_metrics: Sequence[float]) -> np.ndarray:
    r"""LS-ADP layer importance ``V_i = |p_i − p| / Σ_j |p_j − p|``.

    Parameters
    ----------
    baseline_metric : float
        ``p``, the evaluation metric of the unperturbed local model.
    perturbed_metrics : sequence of float
        ``p_i``, the metric with only layer ``i`` perturbed
        (:func:`~strategies.mechanisms.weight_release.perturbed_layer_metrics`).

    Returns
    -------
    numpy.ndarray, shape (K,)
        ``V`` (sums to 1). If every change ``|p_i − p|`` is 0 (no layer moved the metric) the
        uniform vector ``1/K`` is returned, i.e. LS-ADP falls back to NbAFL's equal budgets.

    References
    ----------
    Niu et al., Mathematics 2025, §3.1, eq. (12) ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    baseline = float(baseline_metric)
    perturbed = np.asarray(perturbed_metrics, dtype=np.float64).reshape(-1)
    if perturbed.size == 0:
        raise ValueError("perturbed_metrics must not be empty")
    if not math.isfinite(baseline):
        raise ValueError(f"baseline_metric must be finite, got {baseline_metric!r}")
    if not np.all(np.isfinite(perturbed)):
        raise ValueError("perturbed_metrics must be finite")
    changes = np.abs(perturbed - baseline)
    total = float(changes.sum())
    if total == 0.0:
        return np.full(perturbed.size, 1.0 / perturbed.size)
    return changes / total


# --------------------------------------------------------------------------------------------
# ROW-DP: dispersion × magnitude
# --------------------------------------------------------------------------------------------


def dispersion(iterates: Any, measure: str) -> np.ndarray:
    r"""Dispersion ``f`` of each weight over its local iterates (axis 0).

    For iterates ``w^(1), …, w^(m)`` of one weight, with mean ``w̄``:

    * ``"var"``: ``(1/m) Σ_k (w^(k) − w̄)²`` (population variance, ``ddof = 0``);
    * ``"std"``: the square root of ``"var"``;
    * ``"range"``: ``max_k w^(k) − min_k w^(k)``;
    * ``"iqr"``: 75th − 25th percentile (numpy's default linear interpolation);
    * ``"mae"``: mean absolute deviation from the mean, ``(1/m) Σ_k |w^(k) − w̄|``.

    Parameters
    ----------
    iterates : array-like or torch.Tensor, shape (m, ...), or a sequence of m equal-shape arrays
        The weights after each of the ``m ≥ 1`` local iterations.
    measure : {"var", "std", "range", "iqr", "mae"}

    Returns
    -------
    numpy.ndarray, shape iterates.shape[1:]
        ``f`` per weight (float64, ≥ 0).

    References
    ----------
    Niu et al., Mathematics 2025, §3.2 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    measure = check_choice(measure, DISPERSION_MEASURES, "measure")
    array = _to_numpy(iterates)
    if array.ndim < 1 or array.shape[0] < 1:
        raise ValueError(f"iterates must have shape (m, ...) with m >= 1, got {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError("iterates must be finite")
    if measure == "var":
        return np.var(array, axis=0)
    if measure == "std":
        return np.std(array, axis=0)
    if measure == "range":
        return np.ptp(array, axis=0)
    if measure == "iqr":
        upper, lower = np.percentile(array, [75.0, 25.0], axis=0)
        return upper - lower
    return np.mean(np.abs(array - array.mean(axis=0)), axis=0)


def row_dp_importance(iterates: Any, measure: str) -> np.ndarray:
    r"""ROW-DP per-weight importance in one layer, ``V_ij = f(w_ij)·|w_ij^(m)| / Σ_j f·|w^(m)|``.

    Parameters
    ----------
    iterates : array-like or torch.Tensor, shape (m, ...)
        The selected layer's weights after each of the ``m`` local iterations; ``w^(m)`` is the
        last one. For a layer with several parameter tensors (weight and bias), flatten and
        concatenate them along axis 1 first: the sum runs over every entry of ``iterates[0]``.
    measure : {"var", "std", "range", "iqr", "mae"}
        The dispersion ``f`` (:func:`dispersion`).

    Returns
    -------
    numpy.ndarray, shape iterates.shape[1:]
        ``V`` (sums to 1). If every ``f·|w^(m)|`` is 0 (e.g. ``m = 1``, or no weight moved) the
        uniform vector is returned: the layer falls back to NbAFL's equal budgets.

    References
    ----------
    Niu et al., Mathematics 2025, §3.2, eq. (14) ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    spread = dispersion(iterates, measure)
    last = np.abs(_to_numpy(iterates)[-1])
    scores = spread * last
    total = float(scores.sum())
    if scores.size == 0:
        raise ValueError("iterates must contain at least one weight")
    if total == 0.0:
        return np.full(scores.shape, 1.0 / scores.size)
    return scores / total


# --------------------------------------------------------------------------------------------
# budget allocation (the paper's nominal rule) and the noise it implies
# --------------------------------------------------------------------------------------------


def ls_adp_budgets(importance: Any, *, epsilon: float, uniform_mix: float = 0.0) -> np.ndarray:
    r"""LS-ADP per-layer budgets ``ε_i = ε · K · V_i``, whose mean over the K layers is ``ε``.

    With ``uniform_mix = λ`` the importance is first mixed with the uniform one,
    ``V_i ← (1 − λ) V_i + λ/K``, which keeps ``Σ V = 1`` (so the mean budget stays exactly ε)
    and guarantees every layer at least ``λ · ε``.

    Parameters
    ----------
    importance : array-like, shape (K,)
        ``V`` (:func:`layer_sensitivity_importance`); ≥ 0, not all 0; normalised to sum 1 here.
    epsilon : float
        The paper's ε, the **mean** budget per layer.
    uniform_mix : float
        λ in [0, 1]; 0 (default) is the paper's rule, 1 is NbAFL's equal budgets.

    Returns
    -------
    numpy.ndarray, shape (K,)
        ``ε_i``. A layer with ``V_i = 0`` (and ``λ = 0``) gets budget ``0``: no finite noise
        protects it, and :func:`noise_std_from_budgets` returns ``inf`` for it — the layer must
        not be released (or use ``uniform_mix > 0``). The guarantee of the whole release is set
        by ``max ε_i``, not by the mean (:func:`audited_epsilon_nominal_formula`).

    References
    ----------
    Niu et al., Mathematics 2025, §3.1, eq. (12) and the "average privacy budget" of §4
    ("LS-ADP / ROW-DP", doi:10.3390/math13071096).
    """
    epsilon = check_positive(epsilon, "epsilon")
    uniform_mix = _check_uniform_mix(uniform_mix)
    weights = _check_importance(importance).reshape(-1)
    count = weights.size
    weights = (1.0 - uniform_mix) * weights + uniform_mix / count
    return epsilon * count * weights


def row_dp_budgets(
    layer_sizes: Sequence[int],
    selected_layer: int,
    importance_of_selected: Any,
    *,
    epsilon: float,
    uniform_mix: float = 0.0,
) -> list[np.ndarray]:
    r"""ROW-DP per-weight budgets: ``ε · M_s · V_j`` in the selected layer, ``ε`` elsewhere.

    ``M_s`` is the number of weights of the selected layer; its budgets average to exactly
    ``ε`` (so do all weights' budgets). ``uniform_mix = λ`` mixes ``V`` with the uniform
    importance first, as in :func:`ls_adp_budgets`.

    Parameters
    ----------
    layer_sizes : sequence of int
        Number of weights of each layer.
    selected_layer : int
        Index of the randomly selected layer (the caller draws it).
    importance_of_selected : array-like
        ``V`` of the selected layer's weights (:func:`row_dp_importance`), any shape with
        ``layer_sizes[selected_layer]`` entries; normalised to sum 1 here.
    epsilon : float
        The paper's ε, the mean budget per weight.
    uniform_mix : float
        λ in [0, 1] (default 0: the paper's rule).

    Returns
    -------
    list of numpy.ndarray
        One array per layer: the selected one with the shape of ``importance_of_selected``,
        the others flat of length ``layer_sizes[i]`` filled with ``ε``. A weight with
        ``V_j = 0`` gets budget 0 (infinite noise from :func:`noise_std_from_budgets`; see
        :func:`ls_adp_budgets`).

    References
    ----------
    Niu et al., Mathematics 2025, §3.2, eqs. (15)–(16) ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    epsilon = check_positive(epsilon, "epsilon")
    sizes = [check_count(size, "layer_sizes") for size in layer_sizes]
    if not sizes:
        raise ValueError("layer_sizes must not be empty")
    selected_layer = check_count(selected_layer, "selected_layer", minimum=0)
    if selected_layer >= len(sizes):
        raise ValueError(f"selected_layer must be < {len(sizes)} (number of layers), got {selected_layer}")
    weights = _check_importance(importance_of_selected, "importance_of_selected")
    if weights.size != sizes[selected_layer]:
        raise ValueError(
            f"importance_of_selected has {weights.size} entries, layer {selected_layer} has "
            f"{sizes[selected_layer]} weights"
        )
    selected = ls_adp_budgets(weights, epsilon=epsilon, uniform_mix=uniform_mix).reshape(weights.shape)
    return [selected if i == selected_layer else np.full(size, epsilon) for i, size in enumerate(sizes)]


def noise_std_from_budgets(
    budgets: Any, *, delta: float, clip_norm: float, min_site_records: int, exposures: int
) -> np.ndarray:
    r"""NbAFL uplink noise std of each unit with its own budget, ``σ = c · L · Δs_U / ε_unit``.

    Parameters
    ----------
    budgets : array-like
        ``ε_unit`` ≥ 0 per unit (:func:`ls_adp_budgets`, or one array of
        :func:`row_dp_budgets`).
    delta, clip_norm, min_site_records, exposures
        As in :func:`nbafl_uplink_noise_std`.

    Returns
    -------
    numpy.ndarray, shape of ``budgets``
        ``σ`` per unit; ``math.inf`` where the budget is 0 (the unit cannot be released with
        finite noise: do not release it, or avoid zero budgets with ``uniform_mix``).

    References
    ----------
    Niu et al., Mathematics 2025, Algorithm 2 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096); Wei et al. 2020 IEEE TIFS (NbAFL σ_U).
    """
    array = _to_numpy(budgets)
    if not np.all(np.isfinite(array)) or np.any(array < 0.0):
        raise ValueError("budgets must be finite and >= 0")
    exposures = check_count(exposures, "exposures")
    scale = gaussian_constant(delta) * exposures * nbafl_sensitivity(
        clip_norm=clip_norm, min_site_records=min_site_records
    )
    stds = np.full(array.shape, math.inf)
    positive = array > 0.0
    stds[positive] = scale / array[positive]
    return stds


# --------------------------------------------------------------------------------------------
# audited ε of a layer-wise (diagonal-covariance) Gaussian release under one clip norm
# --------------------------------------------------------------------------------------------


def audited_epsilon_nominal_formula(
    noise_stds: Any, *, delta: float, clip_norm: float, min_site_records: int, exposures: int
) -> float:
    r"""ε of unit-wise noise under one clip norm, by the paper's own formula: ``c·L·Δs_U / min σ``.

    The update is clipped as a whole, so one record can move it by up to ``Δs_U`` in any
    direction, all of it in the least-noised unit. Whitening the release by ``diag(σ)`` shows
    it is no more private than isotropic noise ``min σ``; inverting
    :func:`nbafl_uplink_noise_std` at ``σ_min`` gives ``ε = c L Δs_U / σ_min``, which equals
    the **largest** unit budget when the σ come from :func:`noise_std_from_budgets`. It is ≥
    the paper's nominal (mean) ε, with equality only for equal budgets. Like the paper's
    formula it relies on the classical constant ``c`` (proved for ε < 1); see
    :func:`audited_epsilon_rdp` for a figure valid at every ε.

    Parameters
    ----------
    noise_stds : array-like, or a sequence of arrays (one per layer)
        Noise std of every unit/weight; ``inf`` entries (units not released) are allowed.
    delta, clip_norm, min_site_records, exposures
        As in :func:`nbafl_uplink_noise_std`.

    Returns
    -------
    float
        The audited ε (``0.0`` if every σ is infinite).

    References
    ----------
    Module docstring, "Honest accounting"; Niu et al., Mathematics 2025, §3 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096); Wei et al. 2020 IEEE TIFS (NbAFL σ_U).
    """
    smallest = float(np.min(_flat_stds(noise_stds)))
    exposures = check_count(exposures, "exposures")
    scale = gaussian_constant(delta) * exposures * nbafl_sensitivity(
        clip_norm=clip_norm, min_site_records=min_site_records
    )
    return 0.0 if math.isinf(smallest) else scale / smallest


def audited_epsilon_rdp(
    noise_stds: Any,
    *,
    delta: float,
    clip_norm: float,
    min_site_records: int,
    exposures: int,
    orders: Sequence[float] = AUDIT_RDP_ORDERS,
) -> float:
    r"""RDP ε of unit-wise noise under one clip norm: Gaussian, multiplier ``σ_min/Δs_U``, L times.

    By the whitening argument of :func:`audited_epsilon_nominal_formula` each upload is at most
    as private as the Gaussian mechanism with noise multiplier ``z = σ_min / Δs_U``, whose RDP
    is ``α / (2 z²)``; composed over ``L = exposures`` uploads and converted to ``(ε, δ)`` with
    :func:`strategies.accounting.rdp.epsilon_gaussian_rounds` (sample rate 1). The adjacency is
    the one ``Δs_U = 2C/m`` is the sensitivity for (replace one record of the smallest site).

    Parameters
    ----------
    noise_stds : array-like, or a sequence of arrays (one per layer)
        Noise std of every unit/weight; ``inf`` entries are allowed.
    delta, clip_norm, min_site_records, exposures
        As in :func:`nbafl_uplink_noise_std`.
    orders : sequence of float
        RDP orders for the conversion (default :data:`AUDIT_RDP_ORDERS`).

    Returns
    -------
    float
        ε (``0.0`` if every σ is infinite). Because RDP composes the ``L`` uploads far more
        tightly than the linear ``L`` in ``σ_U``, this is usually much **smaller** than the
        paper's nominal ε even for the largest budget: both figures belong in the ledger.

    References
    ----------
    Module docstring, "Honest accounting"; Mironov, "Rényi Differential Privacy", CSF 2017; Niu et
    al., Mathematics 2025 ("LS-ADP / ROW-DP", doi:10.3390/math13071096).
    """
    smallest = float(np.min(_flat_stds(noise_stds)))
    delta = check_probability(delta, "delta")
    exposures = check_count(exposures, "exposures")
    sensitivity = nbafl_sensitivity(clip_norm=clip_norm, min_site_records=min_site_records)
    if math.isinf(smallest):
        return 0.0
    return epsilon_gaussian_rounds(
        noise_multiplier=smallest / sensitivity, rounds=exposures, delta=delta, orders=list(orders)
    )


# --------------------------------------------------------------------------------------------
# exact-budget variant: per-layer clip norms
# --------------------------------------------------------------------------------------------


def split_clip_norm(layer_sizes: Sequence[int], *, clip_norm: float) -> np.ndarray:
    r"""Per-layer clip norms ``C_i = C · sqrt(m_i / Σ_j m_j)``, so that ``Σ C_i² = C²``.

    Clipping each layer to its ``C_i`` bounds the whole update by ``C`` (and a layer's share of
    ``C²`` is proportional to its number of weights).

    Parameters
    ----------
    layer_sizes : sequence of int
        ``m_i``, number of weights of each layer.
    clip_norm : float
        ``C``, the clip norm of the whole update.

    Returns
    -------
    numpy.ndarray, shape (K,)
        ``C_i``.

    References
    ----------
    Module docstring, "Honest accounting" (exact-budget allocation); McMahan et al., "Learning
    Differentially Private Recurrent Language Models", ICLR 2018 (per-layer clipping).
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    sizes = np.array([check_count(size, "layer_sizes") for size in layer_sizes], dtype=np.float64)
    if sizes.size == 0:
        raise ValueError("layer_sizes must not be empty")
    return clip_norm * np.sqrt(sizes / sizes.sum())


def exact_budget_noise_stds(importance: Any, clip_norms: Any, *, noise_multiplier: float) -> np.ndarray:
    r"""Per-unit noise ``s_i = z · C_i / sqrt(V_i)`` that spends exactly a multiplier-``z`` budget.

    With ``Σ V_i = 1``: ``Σ_i C_i² / s_i² = Σ_i V_i / z² = 1/z²``, so the joint release (each
    unit clipped to ``C_i``, noised with ``s_i``) has the RDP of one Gaussian mechanism with
    noise multiplier ``z`` (:func:`joint_noise_multiplier`). More important units (larger
    ``V_i``) get less noise relative to their clip norm.

    Parameters
    ----------
    importance : array-like, shape (K,)
        ``V_i > 0`` (normalised to sum 1 here). A zero entry is refused: it would need
        infinite noise; mix with the uniform importance first if that can happen.
    clip_norms : array-like, shape (K,)
        ``C_i > 0`` (:func:`split_clip_norm`), or the per-unit sensitivities (e.g. ``2C_i/m``
        for NbAFL), in which case ``z`` is relative to those.
    noise_multiplier : float
        ``z`` > 0, e.g. calibrated so that ``epsilon_gaussian_rounds(z, L, δ)`` is the target.

    Returns
    -------
    numpy.ndarray, shape (K,)
        ``s_i``.

    References
    ----------
    Module docstring, "Honest accounting"; Mironov, "Rényi Differential Privacy", CSF 2017
    (Gaussian RDP); Niu et al., Mathematics 2025 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096) for the importances.
    """
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    weights = _check_importance(importance).reshape(-1)
    if np.any(weights <= 0.0):
        raise ValueError("importance must be > 0 for every unit (a zero needs infinite noise)")
    norms = _to_numpy(clip_norms).reshape(-1)
    if norms.size != weights.size:
        raise ValueError(f"clip_norms has {norms.size} entries, importance has {weights.size}")
    if not np.all(np.isfinite(norms)) or np.any(norms <= 0.0):
        raise ValueError("clip_norms must be finite and > 0")
    return noise_multiplier * norms / np.sqrt(weights)


def joint_noise_multiplier(clip_norms: Any, noise_stds: Any) -> float:
    r"""Noise multiplier of units clipped to ``C_i`` and noised with ``s_i``: ``1/sqrt(Σ C_i²/s_i²)``.

    The release is a Gaussian mechanism with covariance ``diag(s_i²)`` and sensitivity set
    ``{Δ : ||Δ_i|| ≤ C_i}``; whitened, its L2 sensitivity is ``sqrt(Σ C_i²/s_i²)``, so its RDP
    is ``α/(2 z²)`` with the ``z`` returned here.

    Parameters
    ----------
    clip_norms : array-like, shape (K,)
        ``C_i > 0``.
    noise_stds : array-like, shape (K,)
        ``s_i > 0`` (``inf`` allowed: that unit contributes nothing).

    Returns
    -------
    float
        ``z`` (``inf`` if every ``s_i`` is infinite).

    References
    ----------
    Module docstring, "Honest accounting"; Mironov, "Rényi Differential Privacy", CSF 2017.
    """
    norms = _to_numpy(clip_norms).reshape(-1)
    stds = _flat_stds(noise_stds)
    if norms.size != stds.size:
        raise ValueError(f"clip_norms has {norms.size} entries, noise_stds has {stds.size}")
    if not np.all(np.isfinite(norms)) or np.any(norms <= 0.0):
        raise ValueError("clip_norms must be finite and > 0")
    whitened = float(np.sum((norms / stds) ** 2))
    return math.inf if whitened == 0.0 else 1.0 / math.sqrt(whitened)
