"""Bayesian-DP training at one site (FSL-BDP): the DP-SGD update under a Bayesian accountant.

The update is exactly :func:`strategies.mechanisms.dp_sgd_training.train_epochs_dp` (per-record clipping
to ``C``, Gaussian noise ``N(0, σ²C²)`` on the sum, Poisson sampling at ``q``). What changes is
the accounting (:class:`strategies.accounting.bayesian_dp.BayesianAccountant`): before each step
the per-record clipped gradients of the batch give neighbour distances (every record's norm
under add/remove adjacency, the pairwise distances of ``PAIR_RECORDS`` records under
replace-one), their privacy cost is estimated (per distance ``max(c_L, c_R)`` of FSL-BDP's
Algorithm 2, then an upper confidence bound over the batch), and the step is taken only if it
keeps ``ε_μ`` within budget (the budget filter); otherwise the site stops for good. The classical
(worst-case) ε of the same ``(σ, q, steps)`` under the same adjacency is tracked beside it by
opacus (:func:`~strategies.accounting.bayesian_dp.classical_noise_multiplier`).

σ is calibrated once, before the site's first step, from a pilot estimate of the distance
distribution on the site's own records at the received global model, under the same cost rule
as the accountant and the budget filter; that calibration is data-dependent and is not itself
accounted (the ledger says so). Sites with fewer than ``MIN_RECORDS`` records fall back to
classical DP-SGD (too few records for the estimate).

This module holds the mechanism object and imports no torch (its constants are in
:mod:`strategies.mechanisms.schedules`); the site's
training loop is :mod:`strategies.mechanisms.bdp_training`, imported by
:meth:`BayesianDP.site_round`.

References
----------
Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020,
Theorems 2–3; FSL-BDP (arXiv:2601.11134), Algorithms 1–2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from strategies.accounting.bayesian_dp import DEFAULT_ORDERS, classical_noise_multiplier, epsilon_mu, gaussian_release_costs
from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import epsilon_from_history
from strategies.config import ExperimentConfig
from strategies.mechanisms.base import LocalUpdateMechanism, SiteSetUp, SiteUpdate, horizontal_manifest
from strategies.mechanisms.manifest import Manifest, ReleasedValue, record_level_closing, setup_sentence, update_release
from strategies.mechanisms.dp_sgd import require_decomposable_loss
from strategies.mechanisms.schedules import MIN_RECORDS, poisson_schedule

if TYPE_CHECKING:  # the site's model type, for type checkers only
    from models.survival import SurvivalModel

__all__ = ["BayesianDP"]


# --------------------------------------------------------------------------- the mechanism object


class BayesianDP(LocalUpdateMechanism):
    r"""Bayesian DP at every site (strategy ``bdp``, FSL-BDP): DP-SGD's update, Bayesian accountant.

    Each round a site runs :func:`~strategies.mechanisms.bdp_training.train_epochs_bdp` with budget
    ``ε_μ = privacy.epsilon`` and ``β = privacy.delta``, neighbours per ``privacy.adjacency``. ε_μ is estimated from the site's
    own clipped-gradient distances, so the server cannot recompute it: it checks that the
    reported ε_μ lies between the accountant's floor and the budget, and recomputes the classical
    (worst-case) ε of the reported noise, sampling rate and steps.
    """

    name = "bdp"
    pooled_baseline = True
    unit = "record"
    adjacencies = ("add-remove", "replace-one")

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        require_decomposable_loss(self.name, cfg)

    def site_round(self, model: SurvivalModel, data: Any, cfg: ExperimentConfig, *, seed: int,
                   state: dict[str, Any] | None, setup: SiteSetUp) -> SiteUpdate:
        from strategies.mechanisms.bdp_training import train_epochs_bdp  # torch: only where a site trains

        train, privacy = cfg.train, cfg.privacy
        previous_steps = int(state["steps"]) if state else 0
        metrics, new_state = train_epochs_bdp(
            model, data.x, data.time, data.event, epochs=train.local_epochs, batch_size=train.batch_size,
            lr=train.lr, weight_decay=train.weight_decay, seed=seed, clip_norm=privacy.clip_norm,
            target_epsilon_mu=privacy.epsilon, beta=privacy.delta, rounds=cfg.federation.rounds, state=state,
            adjacency=privacy.adjacency, num_records=setup.count, prior=setup.prior, proximal_mu=train.proximal_mu,
        )
        report = {key: float(metrics[key]) for key in self.report_keys(cfg)}
        return SiteUpdate(report, new_state, contributes=int(new_state["steps"]) > previous_steps)

    def round_release(self, cfg: ExperimentConfig, setup: SiteSetUp, update: SiteUpdate,
                      previous: dict[str, Any] | None) -> tuple[tuple[float, float, int], ...]:
        """The round's steps at the classical (worst-case) noise multiplier of the σ the site's accountant chose."""
        steps = int(update.state["steps"]) - (int(previous["steps"]) if previous else 0) if update.state else 0
        if steps <= 0:
            return ()
        sample_rate, _ = poisson_schedule(setup.count, batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
        sigma = classical_noise_multiplier(update.report["noise_multiplier"], adjacency=cfg.privacy.adjacency)
        return ((sigma, sample_rate, steps),)

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return ("epsilon_mu", "epsilon", "noise_multiplier", "steps", "stopped", "fallback")

    def _classical(self, cfg: ExperimentConfig, setup: SiteSetUp, noise_multiplier: float, steps: int) -> float:
        """The classical ε of the set-up releases and ``steps`` steps of noise multiplier σ (0: nothing released)."""
        sample_rate, _ = poisson_schedule(setup.count, batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
        prior = tuple(entry for entry in setup.prior if math.isfinite(entry[0]))
        history = list(prior) + ([(classical_noise_multiplier(noise_multiplier, adjacency=cfg.privacy.adjacency),
                                   sample_rate, steps)] if steps else [])
        return epsilon_from_history(history, delta=cfg.privacy.delta) if history else 0.0

    def verify(self, cfg: ExperimentConfig, report: Mapping[str, float], *, setup: SiteSetUp,
               previous: Sequence[Mapping[str, float] | None]) -> str:
        reason = super().verify(cfg, report, setup=setup, previous=previous)
        if reason:
            return reason
        rounds = len(previous) + 1
        _, steps_per_round = poisson_schedule(setup.count, batch_size=cfg.train.batch_size,
                                              epochs=cfg.train.local_epochs)
        steps, sigma = report["steps"], report["noise_multiplier"]
        if steps != int(steps) or not 0 <= steps <= rounds * steps_per_round:
            return f"steps = {steps:g} is not a whole number of steps within {rounds} round(s) of {steps_per_round}"
        if sigma <= 0:
            return f"noise_multiplier = {sigma:g} is not positive"
        if report["fallback"] not in (0.0, 1.0) or report["stopped"] not in (0.0, 1.0):
            return "fallback and stopped must be 0 or 1"
        if bool(report["fallback"]) != (setup.count < MIN_RECORDS):
            return f"fallback = {report['fallback']:g} for a site of {setup.count:g} records (the rule: < {MIN_RECORDS})"
        classical = self._classical(cfg, setup, sigma, int(steps))
        if not math.isclose(report["epsilon"], classical, rel_tol=1e-6, abs_tol=1e-12):
            return (f"epsilon = {report['epsilon']:.6g} does not match the classical epsilon {classical:.6g} "
                    "recomputed at the server from the declared noise multiplier and steps")
        prior_costs = gaussian_release_costs([noise for noise, _, _ in setup.prior])
        floor = (classical if report["fallback"] else epsilon_mu(prior_costs, DEFAULT_ORDERS, beta=cfg.privacy.delta)
                 if steps or setup.prior else 0.0)
        if report["fallback"] and not math.isclose(report["epsilon_mu"], classical, rel_tol=1e-6, abs_tol=1e-12):
            return "a site below the Bayesian minimum runs classical DP-SGD: its epsilon_mu must equal its epsilon"
        if not floor - 1e-9 <= report["epsilon_mu"] <= cfg.privacy.epsilon + 1e-6:
            return (f"epsilon_mu = {report['epsilon_mu']:.6g} lies outside [{floor:.6g}, {cfg.privacy.epsilon:g}] "
                    "(the accountant's floor and the budget its filter enforces)")
        return ""

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        report = reports[-1]
        sample_rate, _ = poisson_schedule(setup.count, batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
        assumptions = self.assumptions(cfg)
        if report is None:
            epsilon, classical, sigma, steps, fallback = cfg.privacy.epsilon, None, None, None, False
            assumptions += (f"round {server_round}: the site's report was refused (see the round's failures); "
                            "epsilon is the budget its filter enforces, the most an honest site spends",)
        else:
            sigma, steps, fallback = report["noise_multiplier"], int(report["steps"]), bool(report["fallback"])
            classical = self._classical(cfg, setup, sigma, steps)
            epsilon = report["epsilon_mu"]
        return LedgerEntry(
            round=server_round, site=site, mechanism="bdp_fallback_dp_sgd" if fallback else "bdp", unit="record",
            adjacency=cfg.privacy.adjacency, accountant="bayesian-dp (UCB) + opacus-rdp", epsilon=epsilon,
            delta=cfg.privacy.delta, noise_multiplier=sigma, clip_norm=cfg.privacy.clip_norm, sample_rate=sample_rate,
            steps=steps, epsilon_classical=classical, assumptions=assumptions, prior=tuple(setup.prior),
        )

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        if cfg.privacy.adjacency == "add-remove":
            distances = ("epsilon_mu is estimated from the clipped-gradient norms of every record of each step's "
                         "batch (add/remove-one neighbours drawn from the data distribution), with a Student-t upper "
                         "confidence bound")
            classical = ("epsilon_classical: opacus RDP (worst case, add/remove-one, sensitivity C) of the same sigma, "
                         "q, steps. epsilon_mu uses the larger right term c_R (first order in q where RDP is second "
                         "order) and converts Renyi bounds to a tail bound (Triastcyn & Faltings Thm 1, as Mironov 2017 "
                         "Prop 3), while opacus uses c_L with the tighter conversion of Balle et al. 2020: with every "
                         "gradient clipped to C, epsilon_mu is about 1.3x (q = 0.5) to 3.5x (q = 0.01) "
                         "epsilon_classical at epsilon_mu = 1 (1.6x at q = 0.1, 200 steps); it is smaller only when "
                         "most records' gradients are well below C")
        else:
            distances = ("epsilon_mu is estimated from pairwise distances of 16 clipped per-record gradients per step "
                         "(replace-one neighbours drawn from the data distribution), with a Student-t upper "
                         "confidence bound")
            classical = ("epsilon_classical: opacus RDP of noise multiplier sigma/2 for the same q and steps (worst "
                         "case, replace-one: distance 2C at sigma costs what C costs at sigma/2); epsilon_mu's "
                         "right-term cost at d = 2C is larger than that RDP")
        rule = ("per-step cost: for each sampled distance d, max(c_L, c_R) with c_L = log E_{K~Bin(lambda+1,q)} "
                "exp(K(K-1) d^2/(2 s^2)) and c_R = log E_{K~Bin(lambda,q)} exp(K(K+1) d^2/(2 s^2)), s = sigma*C "
                "(Triastcyn & Faltings 2020, Thm 2; FSL-BDP Algorithm 2), the maximum taken per distance before the "
                "Student-t upper confidence bound; the maximum is always c_R, and c_L alone (the exact Renyi bound "
                "of the pair, lambda*RDP_{lambda+1} at d = C) would give a smaller epsilon_mu")
        return (
            "Bayesian DP (Triastcyn & Faltings 2020; FSL-BDP): the DP-SGD update of dp_sgd (clip, Gaussian noise "
            "on the sum, Poisson sampling at q = batch_size/n, n the site's agreed record count); epsilon is the "
            "average-case epsilon_mu with delta_mu = beta + gamma, beta = privacy.delta, gamma <= steps x 1e-12",
            distances,
            setup_sentence(cfg, self.uses_private_setup(cfg)),
            rule,
            "the budget filter stops the site before a step that would exceed privacy.epsilon",
            "noise multiplier calibrated once from a pilot estimate on the site's own records; that "
            "data-dependent calibration is not itself accounted",
            classical,
            f"sites with fewer than {MIN_RECORDS} records run classical DP-SGD instead (epsilon_mu = classical "
            "epsilon)",
            "epsilon_mu is reported by the site (the server cannot recompute it): the server checks it lies between "
            "the accountant's floor and the budget, and recomputes epsilon_classical",
            *record_level_closing(cfg, self.manifest(cfg)),
        )

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        data_dependent = ("data-dependent: estimated from the site's own clipped-gradient distances; no accountant "
                          "bounds what its value reveals")
        return horizontal_manifest(self, cfg, [
            update_release(True, "DP-SGD update: average-case epsilon_mu (Bayesian accountant) and the worst-case "
                           f"classical epsilon of the same noise (opacus RDP, {cfg.privacy.adjacency})"),
            ReleasedValue("epsilon_mu", "the site's Bayesian epsilon so far", "train", False, data_dependent,
                          ("train/metrics.epsilon_mu",)),
            ReleasedValue("stopped and steps", "whether the budget filter stopped the site, and the steps it took",
                          "train", False, data_dependent + " (the stopping time follows epsilon_mu)",
                          ("train/metrics.stopped", "train/metrics.steps")),
            ReleasedValue("noise_multiplier", "sigma of the site's noise", "train", False,
                          "calibrated from a pilot estimate of the site's own gradient distances",
                          ("train/metrics.noise_multiplier",)),
            ReleasedValue("epsilon and fallback", "the classical epsilon and whether the site runs classical DP-SGD",
                          "train", False, "functions of the noise multiplier and the steps (both data-dependent)",
                          ("train/metrics.epsilon", "train/metrics.fallback")),
            ReleasedValue("privacy state", "the site's two accountants (Bayesian costs, classical history), kept in "
                          "the server's checkpoint for resumption", "train", False, data_dependent,
                          ("train/site.privacy_state",)),
        ])
