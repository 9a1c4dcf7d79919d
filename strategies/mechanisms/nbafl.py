r"""Weight perturbation at a site before upload: NbAFL, LS-ADP and ROW-DP (the mechanism objects).

:class:`WeightPerturbation` holds what the strategies ``nbafl``, ``ls_adp`` and ``row_dp`` share:
checks, accounting, ledger entry, assumptions and manifest; each strategy is one subclass
(:class:`NbAFL`, :class:`LSADP`, :class:`ROWDP`) that says how its importances are found. The noise
calibration is :func:`~strategies.mechanisms.schedules.calibrate_gaussian_noise_multiplier`; this module
imports no torch. What a site runs after
its local training is :func:`strategies.mechanisms.weight_release.release_weights` (imported by
:meth:`WeightPerturbation.site_round`): it clips the trained weights, computes the importances
(LS-ADP: layer sensitivity; ROW-DP: dispersion × magnitude in one random layer), turns them into
noise standard deviations and perturbs the weights in place. The pure formulas live in
:mod:`strategies.mechanisms.adaptive_dp`.

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
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.config import ALLOCATIONS, ConfigError, ExperimentConfig
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS, gaussian_constant
from strategies.mechanisms.base import LocalUpdateMechanism, SiteSetUp, SiteUpdate, horizontal_manifest
from strategies.mechanisms.manifest import Manifest, ReleasedValue, record_level_closing, update_release
from strategies.mechanisms.schedules import calibrate_gaussian_noise_multiplier

__all__ = ["ALLOCATIONS", "LSADP", "NbAFL", "ROWDP", "WeightPerturbation"]

# --------------------------------------------------------------------------- the mechanism objects


def _min_records(min_site_records: int, setup: SiteSetUp) -> int:
    """``m``: ``min_site_records`` (``privacy.min_site_records``), else the smallest record count agreed at set-up."""
    return min_site_records or max(1, int(setup.min_count))


def _cumulative(delta: float, noise: Sequence[float]) -> dict[str, float]:
    """Ledger figures of releases with noise multipliers ``noise`` (one per round) at ``delta``."""
    inverse_square_sum = sum(1.0 / z**2 for z in noise)
    constant = gaussian_constant(delta)
    return {"epsilon": _composed_epsilon(inverse_square_sum, delta),
            "epsilon_audited_formula": sum(0.0 if math.isinf(z) else constant / z for z in noise),
            "steps": float(len(noise))}


@functools.lru_cache(maxsize=256)
def _uniform_noise_multiplier(*, epsilon: float, delta: float, exposures: int) -> float:
    """NbAFL's uniform noise relative to ``Δs_U``: ``c L / ε`` (every weight the budget ε)."""
    return gaussian_constant(delta) * exposures / epsilon


@dataclass
class ImportanceInputs:
    """What a site gathers while it trains for its release's importances (nothing for NbAFL).

    ``on_step`` runs after every local step; ``evaluate`` is LS-ADP's metric of a network (the site's training
    loss); ``iterates`` and ``selected_layer`` are ROW-DP's record of the selected layer's weights.
    """

    on_step: Callable[[], None] | None = None
    evaluate: Callable[[Any], float] | None = None
    iterates: list[Any] = field(default_factory=list)
    selected_layer: int = -1

    def release_arguments(self) -> dict[str, Any]:
        """The keywords of :func:`~strategies.mechanisms.weight_release.release_weights` they give."""
        import torch  # the site's numerics: imported only where a site trains

        return {"evaluate": self.evaluate, "iterates": torch.stack(self.iterates) if self.iterates else None,
                "selected_layer": self.selected_layer}


class WeightPerturbation(LocalUpdateMechanism):
    r"""What NbAFL, LS-ADP and ROW-DP share (strategies ``nbafl``, ``ls_adp``, ``row_dp``): perturb the weights
    before upload.

    Each round a site trains as plain FedAvg does, gathering what its importances need
    (:meth:`importance_inputs`), then :func:`~strategies.mechanisms.weight_release.release_weights` clips and
    perturbs its weights. A subclass per strategy sets :attr:`uniform_budgets` and says how its importances are
    found (:meth:`importance_inputs`, :meth:`importance_words`).
    ``m`` of the sensitivity ``2C/m`` is ``privacy.min_site_records`` or, if 0, the smallest
    record count agreed at set-up; ``L`` (exposures) is ``federation.rounds``. The privacy spent
    so far composes each round's release, a Gaussian mechanism of noise multiplier ``z_r``
    relative to ``Δs_U``: by RDP one Gaussian with ``1/z² = Σ_r 1/z_r²``; by the paper's formula
    (linear composition) ``Σ_r c/z_r``.
    """

    unit = "record"
    adjacencies = ("replace-one",)  # NbAFL's Lemma 1: the sensitivity 2C/m of replacing one record
    #: True when every weight gets the same budget: nothing about the allocation depends on the site's data.
    uniform_budgets: bool = False

    def importance_inputs(self, model: Any, data: Any, *, generator: Any, seed: int) -> ImportanceInputs:
        """What the site gathers for its importances while it trains (called before its local training)."""
        return ImportanceInputs()

    @abstractmethod
    def importance_words(self, cfg: ExperimentConfig) -> str:
        """How the units' budgets are found, in words (the ledger's assumptions)."""

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.data.deployed and cfg.privacy.min_site_records == 0:
            raise ConfigError(
                f"run config: strategy '{self.name}' in a deployment needs 'privacy.min_site_records' (m in the "
                "sensitivity 2C/m, the smallest site's number of training records)")

    def _public_noise(self, cfg: ExperimentConfig) -> float | None:
        """This mechanism's noise multiplier per release when it does not depend on the data, else None."""
        privacy, rounds = cfg.privacy, cfg.federation.rounds
        if privacy.allocation == "exact":
            return calibrate_gaussian_noise_multiplier(epsilon=privacy.epsilon, delta=privacy.delta, releases=rounds)
        if self.uniform_budgets:
            return _uniform_noise_multiplier(epsilon=privacy.epsilon, delta=privacy.delta, exposures=rounds)
        return None

    def site_round(self, model: Any, data: Any, cfg: ExperimentConfig, *, seed: int, state: dict[str, Any] | None,
                   setup: SiteSetUp) -> SiteUpdate:
        import torch  # the site's numerics: imported only where a site trains

        from models.training import train_epochs
        from strategies.mechanisms.weight_release import release_weights

        privacy, train = cfg.privacy, cfg.train
        public_state = {key: value.detach().clone() for key, value in model.net.state_dict().items()}
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 1]).generate_state(1)[0]))
        inputs = self.importance_inputs(model, data, generator=generator, seed=seed)
        train_epochs(model, data.x, data.time, data.event, epochs=train.local_epochs, batch_size=train.batch_size,
                     lr=train.lr, weight_decay=train.weight_decay, seed=seed, on_step=inputs.on_step,
                     proximal_mu=train.proximal_mu)
        release = release_weights(
            model.net, method=self.name, allocation=privacy.allocation, epsilon=privacy.epsilon, delta=privacy.delta,
            clip_norm=privacy.clip_norm, min_site_records=_min_records(privacy.min_site_records, setup),
            exposures=cfg.federation.rounds, generator=generator, public_state=public_state,
            dispersion_measure=privacy.dispersion, uniform_mix=privacy.uniform_mix, **inputs.release_arguments(),
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

    def expected_report(self, cfg: ExperimentConfig, *, setup: SiteSetUp,
                        previous: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
        z = self._public_noise(cfg)
        if z is None:  # data-dependent noise (LS-ADP / ROW-DP paper allocation): only the count of releases
            return {"steps": float(len(previous) + 1)}
        return {"noise_multiplier": z, **_cumulative(cfg.privacy.delta, [z] * (len(previous) + 1))}

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
        expected = _cumulative(cfg.privacy.delta, [item["noise_multiplier"] for item in previous] + [z])
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
            figures = _cumulative(cfg.privacy.delta, noise)
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
        importance = self.importance_words(cfg)
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
            "are not themselves privatised" if not self.uniform_budgets else
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
        return horizontal_manifest(self, cfg, releases)


class NbAFL(WeightPerturbation):
    """NbAFL (strategy ``nbafl``, Wei et al. 2020): every weight the same budget, so the noise is public."""

    name = "nbafl"
    uniform_budgets = True

    def importance_words(self, cfg: ExperimentConfig) -> str:
        return "equal budgets for every weight (NbAFL)"


class LSADP(WeightPerturbation):
    """LS-ADP (strategy ``ls_adp``, Niu et al. 2025): per-layer budgets from the layers' sensitivity, measured on the
    site's training loss."""

    name = "ls_adp"

    def importance_inputs(self, model: Any, data: Any, *, generator: Any, seed: int) -> ImportanceInputs:
        """LS-ADP's metric p: the model's loss on the site's training part (eval mode)."""
        import torch  # the site's numerics: imported only where a site trains

        x_t = torch.as_tensor(np.asarray(data.x, dtype=np.float32))
        time_t = torch.as_tensor(np.asarray(data.time, dtype=np.float64))
        event_t = torch.as_tensor(np.asarray(data.event, dtype=np.float32))

        def site_loss(net: torch.nn.Module) -> float:
            net.eval()
            return float(model.loss(x_t, time_t, event_t, generator=torch.Generator().manual_seed(seed)))

        return ImportanceInputs(evaluate=site_loss)

    def importance_words(self, cfg: ExperimentConfig) -> str:
        return ("per-layer budgets from layer sensitivity: each layer perturbed in turn with NbAFL's uniform noise "
                "and the change of the site's training loss measured (LS-ADP)")


class ROWDP(WeightPerturbation):
    """ROW-DP (strategy ``row_dp``, Niu et al. 2025): one random layer's weights get budgets from the dispersion of
    their local iterates (``privacy.dispersion``) times their final magnitude."""

    name = "row_dp"

    def importance_inputs(self, model: Any, data: Any, *, generator: Any, seed: int) -> ImportanceInputs:
        """The selected layer (drawn from ``generator``) and its weights after every local step."""
        import torch  # the site's numerics: imported only where a site trains

        from strategies.mechanisms.weight_release import layer_parameters, select_layer

        selected = select_layer(model.net, generator)
        params = layer_parameters(model.net)[selected]
        inputs = ImportanceInputs(selected_layer=selected)

        def on_step() -> None:
            inputs.iterates.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())

        inputs.on_step = on_step
        return inputs

    def importance_words(self, cfg: ExperimentConfig) -> str:
        return (f"one layer drawn at random each round; its weights' budgets from {cfg.privacy.dispersion} over the "
                "local iterates x final magnitude, other layers equal budgets (ROW-DP)")


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(inverse_square_sum: float, delta: float) -> float:
    """ε of Gaussian releases whose noise multipliers satisfy ``Σ 1/z² = inverse_square_sum`` (0: nothing released)."""
    if inverse_square_sum == 0.0:
        return 0.0
    return epsilon_gaussian_rounds(noise_multiplier=inverse_square_sum ** -0.5, rounds=1, delta=delta,
                                   orders=list(AUDIT_RDP_ORDERS))
