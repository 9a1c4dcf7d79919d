r"""The site's release of NbAFL, LS-ADP and ROW-DP: clip and perturb a trained network's weights (torch).

:func:`release_weights` is what a site runs after its local training in the strategies
``nbafl``, ``ls_adp`` and ``row_dp`` (the allocations ``"paper"`` and ``"exact"`` are explained
in :mod:`strategies.mechanisms.nbafl`, whose :class:`~strategies.mechanisms.nbafl.WeightPerturbation`
calls it from ``site_round``). It clips the trained weights, computes the importances (LS-ADP:
layer sensitivity by :func:`perturbed_layer_metrics`; ROW-DP: dispersion × magnitude in one
random layer, :func:`select_layer`), turns them into noise standard deviations and perturbs the
weights in place. The pure formulas live in :mod:`strategies.mechanisms.adaptive_dp`; this module
strings them together on torch modules.

References
----------
Niu et al., "Adaptive Differential Privacy Cox-MLP Model Based on Federated Learning",
Mathematics 13(7):1096, 2025 ("LS-ADP / ROW-DP", doi:10.3390/math13071096);
Wei et al., "Federated learning with differential privacy: algorithms and performance
analysis", IEEE TIFS 15:3454–3469, 2020 (NbAFL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.config import ALLOCATIONS
from strategies.mechanisms.adaptive_dp import (
    AUDIT_RDP_ORDERS,
    DISPERSION_MEASURES,
    clip_update,
    exact_budget_noise_stds,
    gaussian_constant,
    joint_noise_multiplier,
    layer_sensitivity_importance,
    ls_adp_budgets,
    nbafl_sensitivity,
    nbafl_uplink_noise_std,
    noise_std_from_budgets,
    row_dp_budgets,
    row_dp_importance,
)
from strategies.mechanisms.schedules import WEIGHT_PERTURBATION, calibrate_gaussian_noise_multiplier
from strategies.validation import check_choice, check_positive

__all__ = [
    "Release",
    "layer_parameters",
    "parameterised_layers",
    "perturbed_layer_metrics",
    "release_weights",
    "select_layer",
]


@dataclass(frozen=True)
class Release:
    """What one upload spent and how (one site, one round).

    Attributes
    ----------
    weight_norm : float
        L2 norm of the trained weights before clipping.
    noise_min, noise_max : float
        Smallest and largest per-weight noise std (``inf`` for a unit not released).
    epsilon_nominal : float
        The paper's ε of the whole training: the mean budget (= the target, for both allocations).
    epsilon_audited_formula : float
        The paper's formula ``c·L/z`` at this release's effective noise multiplier ``z``: what
        ``L`` such releases would spend by the formula (linear composition; proved for ε < 1).
    epsilon_rdp : float
        What ``L`` such releases spend by Gaussian RDP at ``z`` (``"exact"``: the target).
    noise_multiplier : float
        ``z``, the effective noise multiplier of the release relative to ``Δs_U``:
        ``min σ / Δs_U`` for ``"paper"`` (one clip bounds the whole update, so the least noised
        unit sets the guarantee), the joint multiplier ``1/sqrt(Σ Δ_u²/s_u²)`` for ``"exact"``.
    importance : tuple of float
        LS-ADP: the layers' ``V`` (after ``uniform_mix``); empty for NbAFL and ROW-DP.
    selected_layer : int
        ROW-DP's layer index; -1 otherwise.
    """

    weight_norm: float
    noise_min: float
    noise_max: float
    epsilon_nominal: float
    epsilon_audited_formula: float
    epsilon_rdp: float
    noise_multiplier: float
    importance: tuple[float, ...]
    selected_layer: int


def layer_parameters(net: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each layer (module owning parameters), in ``named_modules`` order."""
    return [list(module.parameters(recurse=False)) for _, module in parameterised_layers(net)]


def select_layer(net: nn.Module, generator: torch.Generator) -> int:
    """ROW-DP's randomly selected layer: uniform over the layers of ``net``."""
    count = len(parameterised_layers(net))
    if count == 0:
        raise ValueError("model has no parameters")
    return int(torch.randint(count, (1,), generator=generator).item())


def parameterised_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that directly own parameters, in ``named_modules`` order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    ]


def perturbed_layer_metrics(
    model: nn.Module,
    evaluate: Callable[[nn.Module], float],
    *,
    noise_std: float,
    generator: torch.Generator | None = None,
) -> tuple[float, list[float], list[str]]:
    r"""Metric of the model with one layer at a time perturbed (LS-ADP's ``p`` and ``p_i``).

    A *layer* is every module that directly owns parameters (e.g. an ``nn.Linear``: weight and
    bias), in ``model.named_modules()`` order. For layer ``i``: ``w_i ← w_i + x_i`` with
    ``x_i ~ N(0, noise_std² I)`` drawn independently per weight, all other weights unchanged;
    ``p_i = evaluate(model)``; then ``w_i`` is restored exactly (also if ``evaluate`` raises).

    Parameters
    ----------
    model : torch.nn.Module
        The locally trained model; its parameters are modified temporarily, in place.
    evaluate : callable
        ``evaluate(model) -> float``, e.g. a validation loss or C-index on the site's data. It
        is responsible for ``model.eval()`` and ``torch.no_grad`` if it needs them (this
        function runs it under ``torch.no_grad()``).
    noise_std : float
        Std of the perturbation (the paper uses NbAFL's ``σ_U``).
    generator : torch.Generator, optional
        Source of the noise (on the parameters' device); torch's global generator if omitted.

    Returns
    -------
    baseline : float
        ``p``, the metric of the unperturbed model.
    perturbed : list of float
        ``p_i``, one per layer.
    names : list of str
        The layers' module names (``""`` if the model itself owns parameters).

    References
    ----------
    Niu et al., Mathematics 2025, §3.1, eqs. (9)–(11) ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096).
    """
    noise_std = check_positive(noise_std, "noise_std")
    layers = parameterised_layers(model)
    if not layers:
        raise ValueError("model has no parameters")
    with torch.no_grad():
        baseline = float(evaluate(model))
        perturbed: list[float] = []
        for _, layer in layers:
            params = list(layer.parameters(recurse=False))
            saved = [p.detach().clone() for p in params]
            try:
                for p in params:
                    noise = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                    p.add_(noise * noise_std)
                perturbed.append(float(evaluate(model)))
            finally:
                for p, original in zip(params, saved, strict=True):
                    p.copy_(original)
    return baseline, perturbed, [name for name, _ in layers]



def _clip_per_unit(units: Sequence[torch.Tensor], clip_norms: np.ndarray) -> None:
    """Scale each unit (a flat view of weights) in place to L2 norm at most its ``C_u``."""
    for values, bound in zip(units, clip_norms, strict=True):
        norm = float(torch.linalg.vector_norm(values.double()))
        if norm > bound:
            values.mul_(bound / norm)


def release_weights(
    net: nn.Module, *, method: str, allocation: str, epsilon: float, delta: float, clip_norm: float,
    min_site_records: int, exposures: int, generator: torch.Generator, public_state: dict[str, torch.Tensor],
    evaluate: Callable[[nn.Module], float] | None = None, iterates: torch.Tensor | None = None,
    selected_layer: int = -1, dispersion_measure: str = "var", uniform_mix: float = 0.0,
) -> Release:
    r"""Clip and perturb ``net``'s weights in place for upload (NbAFL / LS-ADP / ROW-DP).

    Parameters
    ----------
    net : torch.nn.Module
        The trained network, its parameters replaced by the released values; no buffers (no noise covers them).
    method, allocation : str
        ``"nbafl"``, ``"ls_adp"`` or ``"row_dp"``; ``"paper"`` or ``"exact"`` (see the module docstring).
    epsilon, delta : float
        The target: the paper's average budget ε of the whole training, and δ.
    clip_norm : float
        ``C``, the L2 bound of all weights together.
    min_site_records, exposures : int
        ``m``, the smallest site's number of training records, and ``L``, the most uploads a site makes
        (the number of rounds when every site trains in every round).
    generator : torch.Generator
        Source of all noise (LS-ADP's trial perturbations included).
    public_state : dict
        The global model the site started from (``net.state_dict()`` keys), released for a unit of budget 0.
    evaluate : callable, optional
        LS-ADP only: ``evaluate(net) -> float`` (the site's metric ``p``, e.g. its loss).
    iterates : torch.Tensor, optional
        ROW-DP only: shape ``(m, size)``, the selected layer's flattened weights after each local step
        (the last row is the final weights before clipping).
    selected_layer : int
        ROW-DP only: index of the selected layer (:func:`select_layer`).
    dispersion_measure : {"var", "std", "range", "iqr", "mae"}
        ROW-DP's ``f``.
    uniform_mix : float
        λ in [0, 1]: importance mixed with the uniform one (0 = the paper's rule).

    Returns
    -------
    Release
        The audit record (Niu et al. 2025, Algorithm 2, §3.1–3.2; Wei et al. 2020, Algorithm 1).
    """
    method = check_choice(method, WEIGHT_PERTURBATION, "method")
    allocation = check_choice(allocation, ALLOCATIONS, "allocation")
    dispersion_measure = check_choice(dispersion_measure, DISPERSION_MEASURES, "dispersion_measure")
    layers, sizes = _releasable_layers(net)
    privacy = {"delta": delta, "clip_norm": clip_norm, "min_site_records": min_site_records, "exposures": exposures}
    uniform_noise = nbafl_uplink_noise_std(epsilon=epsilon, **privacy)
    selected = selected_layer if method == "row_dp" else -1
    with torch.no_grad():
        flat, weight_norm = _clip_layers(layers, sizes, allocation=allocation, clip_norm=clip_norm)
        budgets, importance = _weight_budgets(
            net, layers, flat, sizes, method=method, allocation=allocation, epsilon=epsilon, clip_norm=clip_norm,
            trial_noise=uniform_noise, generator=generator, evaluate=evaluate, iterates=iterates,
            selected_layer=selected_layer, dispersion_measure=dispersion_measure, uniform_mix=uniform_mix)
        stds, effective = _noise_stds(budgets, sizes, allocation=allocation, selected_layer=selected,
                                      epsilon=epsilon, **privacy)
        _perturb_layers(layers, flat, stds, _public_layers(net, public_state), generator)
    return _release_record(stds, effective, weight_norm=weight_norm, epsilon=epsilon, delta=delta,
                           exposures=exposures, importance=importance, selected_layer=selected)


def _releasable_layers(net: nn.Module) -> tuple[list[list[nn.Parameter]], list[int]]:
    """``net``'s parameters grouped by layer, and each layer's size; ValueError if it has buffers or no parameters."""
    if next(net.buffers(), None) is not None:
        raise ValueError("weight perturbation covers parameters only; this network has buffers (e.g. BatchNorm "
                         "running statistics), which would be released without noise")
    layers = layer_parameters(net)
    if not layers:
        raise ValueError("model has no parameters")
    return layers, [sum(p.numel() for p in params) for params in layers]


def _clip_layers(
    layers: list[list[nn.Parameter]], sizes: list[int], *, allocation: str, clip_norm: float,
) -> tuple[list[torch.Tensor], float]:
    """Clip the layers' weights in place (call under ``torch.no_grad()``).

    ``"paper"`` clips all weights together to ``clip_norm``; ``"exact"`` clips each layer to its own
    ``C_u = C·sqrt(size_u/P)`` (ROW-DP's per-weight units of the selected layer are clipped later, by
    :func:`_row_dp_budgets`). Returns the clipped values as flat float64 tensors, one per layer, and the
    L2 norm of all weights before clipping.
    """
    flat = [torch.cat([p.detach().reshape(-1) for p in params]).double() for params in layers]
    weight_norm = math.sqrt(sum(float(values.square().sum()) for values in flat))
    if allocation == "paper":
        flat, _ = clip_update(flat, clip_norm)
    else:
        _clip_per_unit(flat, clip_norm * np.sqrt(np.asarray(sizes, dtype=np.float64) / sum(sizes)))
    _write_layers(layers, flat)
    return flat, weight_norm


def _weight_budgets(
    net: nn.Module, layers: list[list[nn.Parameter]], flat: list[torch.Tensor], sizes: list[int], *, method: str,
    allocation: str, epsilon: float, clip_norm: float, trial_noise: float, generator: torch.Generator,
    evaluate: Callable[[nn.Module], float] | None, iterates: torch.Tensor | None, selected_layer: int,
    dispersion_measure: str, uniform_mix: float,
) -> tuple[list[np.ndarray], tuple[float, ...]]:
    """Per-weight budgets of ``method`` by the paper's rule (mean over the units allocated over = ε).

    Returns the budgets, one array per layer, and LS-ADP's layer importances (``()`` otherwise).
    NbAFL: ε everywhere; LS-ADP: :func:`_ls_adp_budgets` (trial noise std ``trial_noise``);
    ROW-DP: :func:`_row_dp_budgets`.
    """
    if method == "nbafl":
        return [np.full(size, epsilon) for size in sizes], ()
    if method == "ls_adp":
        return _ls_adp_budgets(net, sizes, evaluate, noise_std=trial_noise, generator=generator,
                               epsilon=epsilon, uniform_mix=uniform_mix)
    return _row_dp_budgets(layers, flat, sizes, iterates, selected_layer, allocation=allocation, epsilon=epsilon,
                           clip_norm=clip_norm, dispersion_measure=dispersion_measure, uniform_mix=uniform_mix), ()


def _ls_adp_budgets(
    net: nn.Module, sizes: list[int], evaluate: Callable[[nn.Module], float] | None, *, noise_std: float,
    generator: torch.Generator, epsilon: float, uniform_mix: float,
) -> tuple[list[np.ndarray], tuple[float, ...]]:
    """LS-ADP's per-weight budgets (mean over all layers = ε) and the layers' importances.

    Draws the trial perturbations of :func:`perturbed_layer_metrics` (std ``noise_std``) from
    ``generator``; raises ValueError if ``evaluate`` is None.
    """
    if evaluate is None:
        raise ValueError("ls_adp needs evaluate(net) -> metric")
    baseline, perturbed, _ = perturbed_layer_metrics(net, evaluate, noise_std=noise_std, generator=generator)
    weights = layer_sensitivity_importance(baseline, perturbed)
    layer_budgets = ls_adp_budgets(weights, epsilon=epsilon, uniform_mix=uniform_mix)
    importance = tuple(float(v) for v in layer_budgets / (epsilon * len(sizes)))
    return [np.full(size, budget) for size, budget in zip(sizes, layer_budgets, strict=True)], importance


def _row_dp_budgets(
    layers: list[list[nn.Parameter]], flat: list[torch.Tensor], sizes: list[int], iterates: torch.Tensor | None,
    selected_layer: int, *, allocation: str, epsilon: float, clip_norm: float, dispersion_measure: str,
    uniform_mix: float,
) -> list[np.ndarray]:
    """ROW-DP's per-weight budgets (the paper's rule) from the selected layer's ``iterates``.

    With ``allocation="exact"`` each weight of the selected layer is one unit, clamped to
    ``C_u = C/sqrt(P)`` in ``flat`` and in the parameters. Raises ValueError if the iterates or
    the index are missing or the iterates' shape is not ``(m, size)``.
    """
    if iterates is None or not 0 <= selected_layer < len(sizes):
        raise ValueError("row_dp needs the selected layer's iterates and its index")
    if iterates.ndim != 2 or iterates.shape[1] != sizes[selected_layer]:
        raise ValueError(f"iterates must have shape (m, {sizes[selected_layer]}), got {tuple(iterates.shape)}")
    weights = row_dp_importance(iterates, dispersion_measure)
    budgets = row_dp_budgets(sizes, selected_layer, weights, epsilon=epsilon, uniform_mix=uniform_mix)
    if allocation == "exact":
        bound = clip_norm / math.sqrt(sum(sizes))
        flat[selected_layer] = flat[selected_layer].clamp(-bound, bound)
        _write_layers(layers, flat)
    return budgets


def _noise_stds(
    budgets: list[np.ndarray], sizes: list[int], *, allocation: str, selected_layer: int, epsilon: float,
    delta: float, clip_norm: float, min_site_records: int, exposures: int,
) -> tuple[list[np.ndarray], float]:
    """Per-weight noise standard deviations of the budgets and the effective noise multiplier.

    ``"paper"``: each weight's std from its budget, and the multiplier of the smallest std over the
    NbAFL sensitivity; ``"exact"``: :func:`_exact_stds` (``selected_layer`` -1 unless ROW-DP).
    """
    if allocation == "paper":
        stds = [noise_std_from_budgets(b, delta=delta, clip_norm=clip_norm, min_site_records=min_site_records,
                                       exposures=exposures) for b in budgets]
        smallest = float(min(s.min() for s in stds))
        return stds, smallest / nbafl_sensitivity(clip_norm=clip_norm, min_site_records=min_site_records)
    return _exact_stds(budgets, sizes, selected_layer, epsilon=epsilon, clip_norm=clip_norm,
                       min_site_records=min_site_records, delta=delta, exposures=exposures)


def _perturb_layers(
    layers: list[list[nn.Parameter]], flat: list[torch.Tensor], stds: list[np.ndarray],
    public: list[torch.Tensor], generator: torch.Generator,
) -> None:
    """Write ``flat + N(0, std²)`` into the parameters, one draw per weight in layer order.

    A weight whose std is infinite (budget 0) gets its ``public`` value instead (its noise is still drawn).
    """
    released = []
    for values, noise_std, start in zip(flat, stds, public, strict=True):
        noise_std_t = torch.as_tensor(noise_std, dtype=torch.float64).reshape(-1)
        finite = torch.isfinite(noise_std_t)
        noise = torch.randn(values.shape, generator=generator, dtype=torch.float64)
        released.append(torch.where(finite, values + noise * torch.where(finite, noise_std_t, 0.0), start))
    _write_layers(layers, released)


def _release_record(
    stds: list[np.ndarray], effective: float, *, weight_norm: float, epsilon: float, delta: float, exposures: int,
    importance: tuple[float, ...], selected_layer: int,
) -> Release:
    """The :class:`Release` of a perturbation: noise range and the ε audits of the effective multiplier."""
    all_stds = np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1) for s in stds])
    return Release(
        weight_norm=weight_norm, noise_min=float(all_stds.min()), noise_max=float(all_stds.max()),
        epsilon_nominal=epsilon,
        epsilon_audited_formula=0.0 if math.isinf(effective) else gaussian_constant(delta) * exposures / effective,
        epsilon_rdp=0.0 if math.isinf(effective) else epsilon_gaussian_rounds(
            noise_multiplier=effective, rounds=exposures, delta=delta, orders=list(AUDIT_RDP_ORDERS)),
        noise_multiplier=float(effective), importance=importance, selected_layer=selected_layer,
    )


def _exact_stds(
    budgets: list[np.ndarray], sizes: list[int], selected_layer: int, *, epsilon: float, clip_norm: float,
    min_site_records: int, delta: float, exposures: int,
) -> tuple[list[np.ndarray], float]:
    """Per-weight noise of the exact-budget allocation and its joint noise multiplier.

    Units: every layer, except that the selected layer of ROW-DP is split into one unit per
    weight (the caller clips each unit to its ``C_u``). ``V_u`` = the unit's share of the paper's budgets (``Σ V_u = 1``),
    ``Δ_u = 2C_u/m`` with ``C_u = C·sqrt(size_u/P)``, and ``s_u = z·Δ_u/sqrt(V_u)``.
    """
    total_size = sum(sizes)
    total_budget = float(sum(b.sum() for b in budgets))
    layer_of, shares, counts = [], [], []
    for index, layer_budgets in enumerate(budgets):
        if index == selected_layer:
            layer_of += [index] * layer_budgets.size
            shares.append(layer_budgets / total_budget)
            counts.append(np.ones(layer_budgets.size))
        else:
            layer_of.append(index)
            shares.append(np.array([layer_budgets.sum() / total_budget]))
            counts.append(np.array([float(layer_budgets.size)]))
    share = np.concatenate(shares)
    sensitivity = 2.0 * clip_norm * np.sqrt(np.concatenate(counts) / total_size) / min_site_records
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=delta, releases=exposures)
    unit_noise = np.full(share.shape, math.inf)
    positive = share > 0.0
    # Units with a zero share are not released (they send the public global value); the others'
    # shares still sum to 1.
    unit_noise[positive] = exact_budget_noise_stds(share[positive], sensitivity[positive], noise_multiplier=z)
    layer_index = np.asarray(layer_of)
    stds = [unit_noise[layer_index == index] if index == selected_layer
            else np.full(size, unit_noise[layer_index == index][0]) for index, size in enumerate(sizes)]
    return stds, joint_noise_multiplier(sensitivity, unit_noise)


def _public_layers(net: nn.Module, public_state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The global model's values of each layer, flattened like :func:`layer_parameters`."""
    names = {id(p): name for name, p in net.named_parameters()}
    result = []
    for params in layer_parameters(net):
        missing = [names[id(p)] for p in params if names[id(p)] not in public_state]
        if missing:
            raise ValueError(f"public_state lacks {missing}")
        result.append(torch.cat([public_state[names[id(p)]].detach().reshape(-1) for p in params]).double())
    return result


def _write_layers(layers: list[list[nn.Parameter]], flat: list[torch.Tensor]) -> None:
    """Copy flat per-layer values back into the parameters."""
    for params, values in zip(layers, flat, strict=True):
        offset = 0
        for p in params:
            count = p.numel()
            p.copy_(values[offset:offset + count].reshape(p.shape).to(p.dtype))
            offset += count
