r"""Weight perturbation at a site before upload: NbAFL, LS-ADP and ROW-DP.

:func:`release_weights` is what a site runs after its local training in the strategies
``nbafl``, ``ls_adp`` and ``row_dp``. It clips the trained weights, computes the importances
(LS-ADP: layer sensitivity; ROW-DP: dispersion × magnitude in one random layer), turns them into
noise standard deviations and perturbs the weights in place. The pure formulas live in
:mod:`strategies.mechanisms.adaptive_dp`; this module only strings them together.

Two allocations (``allocation``):

``"paper"``
    The paper's rule: one clip norm ``C`` on all weights; every unit (layer or weight) gets the
    budget ``ε_unit`` of its importance, averaging to ``ε``, and NbAFL noise
    ``σ_unit = c·L·Δs_U/ε_unit``. The *nominal* ε is the mean budget (the target). Because one
    clip bounds the whole update, the release is only as private as its smallest noise: the
    *audited* ε is reported beside it, by the paper's own formula at ``min σ`` and by RDP.
``"exact"``
    Spends exactly the target, by RDP: each unit ``u`` is clipped to its own
    ``C_u = C·sqrt(size_u/P)`` (``Σ C_u² = C²``) and noised with
    ``s_u = z·Δ_u / sqrt(V_u)``, ``Δ_u = 2C_u/m``, where ``V_u`` is the unit's share of the
    paper's budgets (``Σ V_u = 1``) and ``z`` is the noise multiplier whose Gaussian RDP over
    ``L`` uploads gives the target ``(ε, δ)``. The joint release is then a Gaussian mechanism
    with noise multiplier exactly ``z`` (:func:`~strategies.mechanisms.adaptive_dp.joint_noise_multiplier`).
    The units are the layers, and for ROW-DP each weight of the selected layer (each clipped to
    ``|w| ≤ C/sqrt(P)``).

In both, the sensitivity ``Δs_U = 2C/m`` of a site's clipped weights to replacing one record is
NbAFL's Lemma 1 (Wei et al. 2020), taken as given: it is the paper's bound, not a proof for
weights trained by SGD (nor for the Cox partial likelihood, which is not a sum over records).
A unit whose budget is 0 releases the global model's value it started from (public), not the
local one. Importances are computed from the site's private data and are not themselves
privatised.

References
----------
Niu et al., "Adaptive Differential Privacy Cox-MLP Model Based on Federated Learning",
Mathematics 13(7):1096, 2025 ("LS-ADP / ROW-DP", doi:10.3390/math13071096);
Wei et al., "Federated learning with differential privacy: algorithms and performance
analysis", IEEE TIFS 15:3454–3469, 2020 (NbAFL); Mironov, "Rényi Differential Privacy", CSF 2017.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from models.training import train_epochs
from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.config import ALLOCATIONS, ConfigError, ExperimentConfig
from strategies.mechanisms.base import (
    Manifest,
    HorizontalMechanism,
    ReleasedValue,
    SiteSetUp,
    SiteUpdate,
    record_level_closing,
    update_release,
)
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
    parameterised_layers,
    perturbed_layer_metrics,
    row_dp_budgets,
    row_dp_importance,
)
from strategies.validation import check_choice, check_count, check_positive, check_probability

__all__ = [
    "ALLOCATIONS",
    "WEIGHT_PERTURBATION",
    "Release",
    "WeightPerturbation",
    "calibrate_gaussian_noise_multiplier",
    "layer_parameters",
    "release_weights",
    "select_layer",
]

#: The strategies that perturb weights before upload.
WEIGHT_PERTURBATION: tuple[str, ...] = ("nbafl", "ls_adp", "row_dp")


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


def calibrate_gaussian_noise_multiplier(*, epsilon: float, delta: float, releases: int) -> float:
    r"""Smallest ``z`` (to 1e-6 relative) whose Gaussian RDP over ``releases`` gives ``(ε, δ)``.

    Bisection on :func:`strategies.accounting.rdp.epsilon_gaussian_rounds` (sample rate 1,
    orders :data:`~strategies.mechanisms.adaptive_dp.AUDIT_RDP_ORDERS`), the accountant the audit
    uses, so an ``"exact"`` release's ``epsilon_rdp`` is the target up to the tolerance (never
    above it).

    References
    ----------
    Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP ``α/(2z²)``).
    """
    epsilon = check_positive(epsilon, "epsilon")
    delta = check_probability(delta, "delta")
    releases = check_count(releases, "releases")

    def spent(z: float) -> float:
        return epsilon_gaussian_rounds(noise_multiplier=z, rounds=releases, delta=delta, orders=list(AUDIT_RDP_ORDERS))

    low, high = 1e-3, 1.0
    while spent(high) > epsilon:
        low, high = high, high * 2.0
        if high > 1e9:
            raise ValueError(f"no noise multiplier reaches epsilon {epsilon} at delta {delta}")
    while (high - low) > 1e-6 * high:
        middle = 0.5 * (low + high)
        if spent(middle) > epsilon:
            low = middle
        else:
            high = middle
    return high


def _clip_per_unit(units: Sequence[torch.Tensor], clip_norms: np.ndarray) -> None:
    """Scale each unit (a flat view of weights) in place to L2 norm at most its ``C_u``."""
    for values, bound in zip(units, clip_norms, strict=True):
        norm = float(torch.linalg.vector_norm(values.double()))
        if norm > bound:
            values.mul_(bound / norm)


def release_weights(
    net: nn.Module,
    *,
    method: str,
    allocation: str,
    epsilon: float,
    delta: float,
    clip_norm: float,
    min_site_records: int,
    exposures: int,
    generator: torch.Generator,
    public_state: dict[str, torch.Tensor],
    evaluate: Callable[[nn.Module], float] | None = None,
    iterates: torch.Tensor | None = None,
    selected_layer: int = -1,
    dispersion_measure: str = "var",
    uniform_mix: float = 0.0,
) -> Release:
    r"""Clip and perturb ``net``'s weights in place for upload (NbAFL / LS-ADP / ROW-DP).

    Parameters
    ----------
    net : torch.nn.Module
        The locally trained network; its parameters are replaced by the released values. It
        must have no buffers (e.g. BatchNorm statistics), which no noise would cover.
    method : {"nbafl", "ls_adp", "row_dp"}
    allocation : {"paper", "exact"}
        See the module docstring.
    epsilon, delta : float
        The target: the paper's average budget ε of the whole training, and δ.
    clip_norm : float
        ``C``, the L2 bound of all weights together.
    min_site_records : int
        ``m``, the smallest site's number of training records.
    exposures : int
        ``L``, the most uploads a site makes (the number of rounds when every site trains in
        every round).
    generator : torch.Generator
        Source of all noise (LS-ADP's trial perturbations included).
    public_state : dict
        The global model the site started from (``net.state_dict()`` keys): released instead
        of the local value for a unit whose budget is 0.
    evaluate : callable, optional
        LS-ADP only: ``evaluate(net) -> float`` (the site's metric ``p``, e.g. its loss).
    iterates : torch.Tensor, optional
        ROW-DP only: shape ``(m, size)``, the selected layer's flattened weights after each
        local step (the last row is the final weights before clipping).
    selected_layer : int
        ROW-DP only: index of the selected layer (:func:`select_layer`).
    dispersion_measure : {"var", "std", "range", "iqr", "mae"}
        ROW-DP's ``f``.
    uniform_mix : float
        λ in [0, 1]: importance mixed with the uniform one (0 = the paper's rule).

    Returns
    -------
    Release

    References
    ----------
    Niu et al., Mathematics 2025, Algorithm 2 and §3.1–3.2 ("LS-ADP / ROW-DP",
    doi:10.3390/math13071096); Wei et al. 2020 IEEE TIFS, Algorithm 1 (NbAFL).
    """
    method = check_choice(method, WEIGHT_PERTURBATION, "method")
    allocation = check_choice(allocation, ALLOCATIONS, "allocation")
    dispersion_measure = check_choice(dispersion_measure, DISPERSION_MEASURES, "dispersion_measure")
    if next(net.buffers(), None) is not None:
        raise ValueError("weight perturbation covers parameters only; this network has buffers (e.g. BatchNorm "
                         "running statistics), which would be released without noise")
    layers = layer_parameters(net)
    if not layers:
        raise ValueError("model has no parameters")
    privacy = {"delta": delta, "clip_norm": clip_norm, "min_site_records": min_site_records, "exposures": exposures}
    uniform_noise = nbafl_uplink_noise_std(epsilon=epsilon, **privacy)
    sizes = [sum(p.numel() for p in params) for params in layers]
    total_size = sum(sizes)

    with torch.no_grad():
        flat = [torch.cat([p.detach().reshape(-1) for p in params]).double() for params in layers]
        weight_norm = math.sqrt(sum(float(values.square().sum()) for values in flat))
        if allocation == "paper":
            flat, _ = clip_update(flat, clip_norm)
        else:  # each unit to its own C_u; ROW-DP's per-weight units of the selected layer come later
            _clip_per_unit(flat, clip_norm * np.sqrt(np.asarray(sizes, dtype=np.float64) / total_size))
        _write_layers(layers, flat)

        # Per-weight budgets by the paper's rule (mean over the units allocated over = ε).
        importance: tuple[float, ...] = ()
        if method == "nbafl":
            budgets = [np.full(size, epsilon) for size in sizes]
        elif method == "ls_adp":
            if evaluate is None:
                raise ValueError("ls_adp needs evaluate(net) -> metric")
            baseline, perturbed, _ = perturbed_layer_metrics(net, evaluate, noise_std=uniform_noise,
                                                             generator=generator)
            weights = layer_sensitivity_importance(baseline, perturbed)
            layer_budgets = ls_adp_budgets(weights, epsilon=epsilon, uniform_mix=uniform_mix)
            importance = tuple(float(v) for v in layer_budgets / (epsilon * len(sizes)))
            budgets = [np.full(size, budget) for size, budget in zip(sizes, layer_budgets, strict=True)]
        else:
            if iterates is None or not 0 <= selected_layer < len(sizes):
                raise ValueError("row_dp needs the selected layer's iterates and its index")
            if iterates.ndim != 2 or iterates.shape[1] != sizes[selected_layer]:
                raise ValueError(f"iterates must have shape (m, {sizes[selected_layer]}), got {tuple(iterates.shape)}")
            weights = row_dp_importance(iterates, dispersion_measure)
            budgets = row_dp_budgets(sizes, selected_layer, weights, epsilon=epsilon, uniform_mix=uniform_mix)
            if allocation == "exact":  # one unit per weight: each clipped to C_u = C/sqrt(P)
                bound = clip_norm / math.sqrt(total_size)
                flat[selected_layer] = flat[selected_layer].clamp(-bound, bound)
                _write_layers(layers, flat)

        if allocation == "paper":
            stds = [noise_std_from_budgets(b, **privacy) for b in budgets]
            smallest = float(min(s.min() for s in stds))
            effective = smallest / nbafl_sensitivity(clip_norm=clip_norm, min_site_records=min_site_records)
        else:
            stds, effective = _exact_stds(budgets, sizes, selected_layer if method == "row_dp" else -1,
                                          epsilon=epsilon, clip_norm=clip_norm,
                                          min_site_records=min_site_records, delta=delta, exposures=exposures)

        public = _public_layers(net, public_state)
        released = []
        for values, noise_std, start in zip(flat, stds, public, strict=True):
            noise_std_t = torch.as_tensor(noise_std, dtype=torch.float64).reshape(-1)
            finite = torch.isfinite(noise_std_t)
            noise = torch.randn(values.shape, generator=generator, dtype=torch.float64)
            released.append(torch.where(finite, values + noise * torch.where(finite, noise_std_t, 0.0), start))
        _write_layers(layers, released)
    all_stds = np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1) for s in stds])
    return Release(
        weight_norm=weight_norm, noise_min=float(all_stds.min()), noise_max=float(all_stds.max()),
        epsilon_nominal=epsilon,
        epsilon_audited_formula=0.0 if math.isinf(effective) else gaussian_constant(delta) * exposures / effective,
        epsilon_rdp=0.0 if math.isinf(effective) else epsilon_gaussian_rounds(
            noise_multiplier=effective, rounds=exposures, delta=delta, orders=list(AUDIT_RDP_ORDERS)),
        noise_multiplier=float(effective), importance=importance,
        selected_layer=selected_layer if method == "row_dp" else -1,
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


# --------------------------------------------------------------------------- the mechanism objects


@functools.lru_cache(maxsize=256)
def _uniform_noise_multiplier(*, epsilon: float, delta: float, exposures: int) -> float:
    """NbAFL's uniform noise relative to ``Δs_U``: ``c L / ε`` (every weight the budget ε)."""
    return gaussian_constant(delta) * exposures / epsilon


class WeightPerturbation(HorizontalMechanism):
    r"""NbAFL, LS-ADP or ROW-DP (strategies ``nbafl``, ``ls_adp``, ``row_dp``): perturb the weights before upload.

    Each round a site trains as plain FedAvg does (ROW-DP also records the selected layer's
    weights after every step), then :func:`release_weights` clips and perturbs its weights.
    ``m`` of the sensitivity ``2C/m`` is ``privacy.min_site_records`` or, if 0, the smallest
    record count agreed at set-up; ``L`` (exposures) is ``federation.rounds``. The privacy spent
    so far composes each round's release, a Gaussian mechanism of noise multiplier ``z_r``
    relative to ``Δs_U``: by RDP one Gaussian with ``1/z² = Σ_r 1/z_r²``; by the paper's formula
    (linear composition) ``Σ_r c/z_r``.
    """

    unit = "record"
    adjacencies = ("replace-one",)  # NbAFL's Lemma 1: the sensitivity 2C/m of replacing one record

    def __init__(self, method: str) -> None:
        self.name = check_choice(method, WEIGHT_PERTURBATION, "method")

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.data.deployed and cfg.privacy.min_site_records == 0:
            raise ConfigError(
                f"run config: strategy '{self.name}' in a deployment needs 'privacy.min_site_records' (m in the "
                "sensitivity 2C/m, the smallest site's number of training records)")

    def min_records(self, cfg: ExperimentConfig, setup: SiteSetUp) -> int:
        """``m``: ``privacy.min_site_records``, else the smallest record count agreed at set-up."""
        return cfg.privacy.min_site_records or max(1, int(setup.min_count))

    def _public_noise(self, cfg: ExperimentConfig) -> float | None:
        """This mechanism's noise multiplier per release when it does not depend on the data, else None."""
        privacy, rounds = cfg.privacy, cfg.federation.rounds
        if privacy.allocation == "exact":
            return calibrate_gaussian_noise_multiplier(epsilon=privacy.epsilon, delta=privacy.delta, releases=rounds)
        if self.name == "nbafl":
            return _uniform_noise_multiplier(epsilon=privacy.epsilon, delta=privacy.delta, exposures=rounds)
        return None

    def site_round(self, model: Any, data: Any, cfg: ExperimentConfig, *, seed: int, state: dict[str, Any] | None,
                   setup: SiteSetUp) -> SiteUpdate:
        privacy, train = cfg.privacy, cfg.train
        public_state = {key: value.detach().clone() for key, value in model.net.state_dict().items()}
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 1]).generate_state(1)[0]))
        selected, iterates = -1, []
        on_step = None
        if self.name == "row_dp":
            selected = select_layer(model.net, generator)
            params = layer_parameters(model.net)[selected]

            def on_step() -> None:
                iterates.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())

        train_epochs(model, data.x, data.time, data.event, epochs=train.local_epochs, batch_size=train.batch_size,
                     lr=train.lr, weight_decay=train.weight_decay, seed=seed, on_step=on_step)
        site_loss = None
        if self.name == "ls_adp":  # LS-ADP's metric p: the model's loss on the site's training part (eval mode)
            x_t = torch.as_tensor(np.asarray(data.x, dtype=np.float32))
            time_t = torch.as_tensor(np.asarray(data.time, dtype=np.float64))
            event_t = torch.as_tensor(np.asarray(data.event, dtype=np.float32))

            def site_loss(net: nn.Module) -> float:
                net.eval()
                return float(model.loss(x_t, time_t, event_t, generator=torch.Generator().manual_seed(seed)))

        release = release_weights(
            model.net, method=self.name, allocation=privacy.allocation, epsilon=privacy.epsilon, delta=privacy.delta,
            clip_norm=privacy.clip_norm, min_site_records=self.min_records(cfg, setup),
            exposures=cfg.federation.rounds, generator=generator, public_state=public_state, evaluate=site_loss,
            iterates=torch.stack(iterates) if iterates else None, selected_layer=selected,
            dispersion_measure=privacy.dispersion, uniform_mix=privacy.uniform_mix,
        )
        state = dict(state or {"inverse_square_sum": 0.0, "formula_sum": 0.0, "steps": 0})
        state["inverse_square_sum"] += 1.0 / release.noise_multiplier**2
        state["formula_sum"] += release.epsilon_audited_formula / cfg.federation.rounds
        state["steps"] += 1
        report = {
            "epsilon": _composed_epsilon(state["inverse_square_sum"], privacy.delta),
            "epsilon_audited_formula": state["formula_sum"],
            "noise_multiplier": release.noise_multiplier,
            "steps": float(state["steps"]),
        }
        return SiteUpdate(report, state)

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return ("epsilon", "epsilon_audited_formula", "noise_multiplier", "steps")

    def _cumulative(self, cfg: ExperimentConfig, noise: Sequence[float]) -> dict[str, float]:
        """Ledger figures of releases with noise multipliers ``noise`` (one per round)."""
        inverse_square_sum = sum(1.0 / z**2 for z in noise)
        constant = gaussian_constant(cfg.privacy.delta)
        return {"epsilon": _composed_epsilon(inverse_square_sum, cfg.privacy.delta),
                "epsilon_audited_formula": sum(0.0 if math.isinf(z) else constant / z for z in noise),
                "steps": float(len(noise))}

    def expected_report(self, cfg: ExperimentConfig, *, setup: SiteSetUp,
                        previous: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
        z = self._public_noise(cfg)
        if z is None:  # data-dependent noise (LS-ADP / ROW-DP paper allocation): only the count of releases
            return {"steps": float(len(previous) + 1)}
        return {"noise_multiplier": z, **self._cumulative(cfg, [z] * (len(previous) + 1))}

    def verify(self, cfg: ExperimentConfig, report: Mapping[str, float], *, setup: SiteSetUp,
               previous: Sequence[Mapping[str, float] | None]) -> str:
        reason = super().verify(cfg, report, setup=setup, previous=previous)
        if reason or self._public_noise(cfg) is not None:
            return reason
        # Data-dependent noise: the release is at least as noisy as its least noised unit, whose budget is at
        # least the mean: z <= NbAFL's uniform z. Recompute the cumulative figures from the reported noise.
        uniform = _uniform_noise_multiplier(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta,
                                            exposures=cfg.federation.rounds)
        z = report["noise_multiplier"]
        if not 0 < z <= uniform * (1 + 1e-9):
            return (f"noise_multiplier = {z:g} outside (0, {uniform:.6g}]: the least noised unit's budget is at least "
                    "the mean budget")
        if any(item is None for item in previous):
            return ""  # an earlier report was refused: the cumulative figures cannot be recomputed
        expected = self._cumulative(cfg, [item["noise_multiplier"] for item in previous] + [z])
        for key in ("epsilon", "epsilon_audited_formula"):
            if not math.isclose(report[key], expected[key], rel_tol=1e-6, abs_tol=1e-12):
                return (f"{key} = {report[key]:.6g} does not match {expected[key]:.6g}, recomputed at the server from "
                        "the noise multipliers the site declared")
        return ""

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        public = self._public_noise(cfg)
        assumptions = self.assumptions(cfg)
        if public is not None:
            noise = [public] * len(reports)
        elif all(report is not None for report in reports):
            noise = [report["noise_multiplier"] for report in reports]
        else:
            noise = []
        if noise:
            figures = self._cumulative(cfg, noise)
            epsilon, formula = figures["epsilon"], figures["epsilon_audited_formula"]
        else:
            epsilon = formula = None
            assumptions += ("a report of this site was refused and its noise depends on its data: no bound is given "
                            "for its releases",)
        return LedgerEntry(
            round=server_round, site=site, mechanism=f"{self.name}_{cfg.privacy.allocation}", unit="record",
            adjacency=cfg.privacy.adjacency, accountant="gaussian-rdp (audit) + paper formula", epsilon=epsilon,
            delta=cfg.privacy.delta, noise_multiplier=noise[-1] if noise else None, clip_norm=cfg.privacy.clip_norm,
            sample_rate=1.0, steps=len(reports), epsilon_nominal=cfg.privacy.epsilon,
            epsilon_audited_formula=formula, assumptions=assumptions,
        )

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        privacy, rounds = cfg.privacy, cfg.federation.rounds
        importance = {
            "nbafl": "equal budgets for every weight (NbAFL)",
            "ls_adp": "per-layer budgets from layer sensitivity: each layer perturbed in turn with NbAFL's uniform "
                      "noise and the change of the site's training loss measured (LS-ADP)",
            "row_dp": f"one layer drawn at random each round; its weights' budgets from {privacy.dispersion} over the "
                      "local iterates x final magnitude, other layers equal budgets (ROW-DP)",
        }[self.name]
        if privacy.allocation == "paper":
            allocation = ("allocation 'paper': one clip norm C on all weights, unit budgets averaging to "
                          "epsilon_nominal, NbAFL noise sigma = c L (2C/m) / budget per unit. The release is a "
                          "Gaussian mechanism with diagonal covariance under one L2 bound, so its guarantee is set by "
                          "the smallest sigma (the largest budget): epsilon is audited there, not at the average")
        else:
            allocation = ("allocation 'exact': unit u (a layer; for row_dp each weight of the selected layer) clipped "
                          "to C_u = C sqrt(size_u/P), noise s_u = z (2 C_u/m) / sqrt(V_u) with V_u its share of the "
                          "paper's budgets; the joint release is one Gaussian mechanism of noise multiplier z, "
                          "calibrated by RDP to the target")
        m = (f"m = privacy.min_site_records = {privacy.min_site_records}" if privacy.min_site_records else
             "m = the smallest record count agreed at set-up")
        return (
            f"weight perturbation before upload ({self.name}): the site's trained weights clipped and perturbed with "
            f"Gaussian noise; {importance}",
            allocation,
            f"sensitivity 2C/m ({m}) to replacing one record of the smallest site is NbAFL's Lemma 1 (Wei et al. "
            "2020), the paper's bound taken as given: it is not proved for weights trained by SGD, nor for the Cox "
            "partial likelihood, which is not a sum over records",
            "epsilon: RDP of the Gaussian releases so far (noise multiplier = release's effective sigma / (2C/m)), "
            "composed over rounds; epsilon_audited_formula: the paper's formula c L Delta/sigma_min at the smallest "
            "noise, composed linearly (it holds for epsilon < 1 only, and composes delta L times); epsilon_nominal: "
            "the paper's average budget over the whole training",
            f"L = {rounds} exposures (every site may upload in every round); downlink noise sigma_D = 0 because "
            "T <= L sqrt(N)",
            "importance scores are computed from the site's private data (its training loss, its local iterates) and "
            "are not themselves privatised" if self.name != "nbafl" else
            "every weight gets the same budget: nothing about the allocation depends on the data",
            "weights whose budget is 0 release the public global value they started from",
            *record_level_closing(cfg, self.manifest(cfg)),
        )

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        public = self._public_noise(cfg) is not None
        releases = [
            update_release(True, "clipped and perturbed weights: Gaussian RDP audit at the release's smallest noise "
                           "(replace-one, sensitivity 2C/m, NbAFL's Lemma 1 taken as given)"),
            ReleasedValue("declared figures", "epsilon, epsilon_audited_formula, noise_multiplier, steps", "train",
                          public, "functions of the public configuration" if public else
                          "the noise multiplier is set by importances computed from the site's private data",
                          tuple(f"train/metrics.{key}" for key in self.report_keys(cfg))),
            ReleasedValue("privacy state", "the composed sums of the site's releases, kept in the server's checkpoint",
                          "train", public, "functions of the public configuration" if public else
                          "sums over the data-dependent noise multipliers", ("train/site.privacy_state",)),
        ]
        return self._manifest(cfg, releases)


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(inverse_square_sum: float, delta: float) -> float:
    """ε of Gaussian releases whose noise multipliers satisfy ``Σ 1/z² = inverse_square_sum`` (0: nothing released)."""
    if inverse_square_sum == 0.0:
        return 0.0
    return epsilon_gaussian_rounds(noise_multiplier=inverse_square_sum ** -0.5, rounds=1, delta=delta,
                                   orders=list(AUDIT_RDP_ORDERS))
