"""Bayesian-DP training at one site (FSL-BDP): the site's numerics of strategy ``bdp``.

:func:`train_epochs_bdp` runs :func:`strategies.mechanisms.dp_sgd_training.train_epochs_dp` with
the Bayesian accountant's budget filter (:func:`account_step`) before every step, σ calibrated
once from a pilot estimate of the site's gradient distances (:func:`pilot_distances`). The
mechanism object, its constants and what it means are :mod:`strategies.mechanisms.bdp`
(torch-free); its ``site_round`` imports this module.

References
----------
Triastcyn & Faltings, "Bayesian Differential Privacy for Machine Learning", ICML 2020,
Theorems 2–3; FSL-BDP (arXiv:2601.11134), Algorithms 1–2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from models.survival import SurvivalModel
from strategies.accounting.bayesian_dp import (
    BayesianAccountant,
    calibrate_noise_for_bdp,
    classical_noise_multiplier,
    distances_from_gram,
    gaussian_release_costs,
    step_costs,
)
from strategies.accounting.rdp import SiteAccountant, calibrate_noise_multiplier
from strategies.mechanisms.dp_sgd_training import PerSampleView, clipped_sum_ghost, train_epochs_dp
from strategies.mechanisms.schedules import GAMMA_STEP, MIN_RECORDS, PAIR_RECORDS, PILOT_RECORDS, poisson_schedule

__all__ = ["BudgetExhausted", "account_step", "pilot_distances", "train_epochs_bdp"]


class BudgetExhausted(Exception):
    """Raised inside the training loop, before a step that would overspend."""


def account_step(
    accountant: BayesianAccountant, per_sample: PerSampleView, *, sample_rate: float, noise_std: float,
    total_steps: int, target_epsilon_mu: float, beta: float, fallback_distances: np.ndarray | None = None,
) -> np.ndarray:
    """Budget filter and accounting of one step, before it is taken.

    The neighbour distances under ``accountant.adjacency`` of the (randomly sampled) batch's
    records estimate the step's cost: under add/remove the clipped-gradient norms of every
    record of the batch (free: DP-SGD computes them anyway), under replace-one the pairwise
    distances of the first ``PAIR_RECORDS`` records, from the Gram matrix of their clipped
    gradients (:func:`distances_from_gram`). If adding the step's cost (:func:`step_costs`: the
    UCB over the distances of ``max(c_L, c_R)``) would take ``ε_μ`` past ``target_epsilon_mu``,
    :class:`BudgetExhausted` is raised and nothing is accounted; else the cost is committed. The
    same happens once ``total_steps`` steps are accounted: the UCB's Hölder horizon ``T`` would be
    too short for another one (a site run for more rounds than it was calibrated for). A batch of
    fewer than two records gives no variance estimate: the previous step's distances
    (``fallback_distances``) stand in.

    Returns
    -------
    The distances used (to stand in for a later batch without pairs).
    """
    if accountant.spent_steps >= total_steps:
        raise BudgetExhausted(f"the UCB horizon of {total_steps} steps is spent")
    if per_sample.clipped_norms().shape[0] >= 2:
        # the batch is a random sample of the site's records
        if accountant.adjacency == "add-remove":
            distances = per_sample.clipped_norms().double().numpy()
        else:
            distances = distances_from_gram(per_sample.gram(PAIR_RECORDS), adjacency="replace-one")
    elif fallback_distances is not None:
        distances = fallback_distances
    else:
        raise BudgetExhausted("fewer than two records in the first batch: no distance estimate to account it")
    costs = step_costs(distances, orders=accountant.orders, sample_rate=sample_rate, noise_std=noise_std,
                       total_steps=total_steps, gamma_step=GAMMA_STEP)
    if accountant.would_exceed(target_epsilon_mu=target_epsilon_mu, beta=beta, next_costs=costs):
        raise BudgetExhausted
    accountant.commit(costs, total_steps=total_steps, gamma_step=GAMMA_STEP)
    return distances


def pilot_distances(model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *,
                    clip_norm: float, seed: int, adjacency: str) -> np.ndarray:
    """Neighbour distances of the clipped per-record gradients of ``PILOT_RECORDS`` random records."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(x), size=min(PILOT_RECORDS, len(x)), replace=False)
    _, _, _, per_sample = clipped_sum_ghost(
        model, torch.from_numpy(x[idx]), torch.from_numpy(time[idx]), torch.from_numpy(event[idx]),
        clip_norm=clip_norm,
    )
    return distances_from_gram(per_sample.gram(), adjacency=adjacency)


def train_epochs_bdp(
    model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, epochs: int, batch_size: int,
    lr: float, weight_decay: float, seed: int, clip_norm: float, target_epsilon_mu: float, beta: float, rounds: int,
    state: dict[str, Any] | None, adjacency: str = "add-remove", num_records: float | None = None,
    prior: Sequence[tuple[float, float, int]] = (), proximal_mu: float = 0.0,
) -> tuple[dict[str, float], dict[str, Any]]:
    """One round of Bayesian-DP training at a site; ``state`` carries σ and both accountants.

    Parameters
    ----------
    target_epsilon_mu, beta
        Budget ``ε_μ`` and the β of ``δ_μ = β + γ``.
    rounds
        Rounds the site takes part in: σ is calibrated for ``rounds × steps per round`` steps.
    state
        ``None`` before the first round, else the state returned by the previous round.
    adjacency
        ``"add-remove"`` or ``"replace-one"``: the neighbours of both ε_μ and the classical ε.
    num_records
        The record count the schedule (``q``, steps) and the small-site fallback are computed from
        (default ``len(x)``): in a federation, the count the site agreed at set-up.
    prior
        The site's releases before training as accountant history (``(noise multiplier, 1.0, 1)`` per Gaussian
        set-up release under ``adjacency``): both accountants start with them (ε_μ's costs by
        :func:`~strategies.accounting.bayesian_dp.gaussian_release_costs`); σ is calibrated for what is left.
    proximal_mu
        FedProx's mu (:func:`~strategies.mechanisms.dp_sgd_training.train_epochs_dp`): its gradient is
        added to the privatised gradient; neither the distances nor the accounting see it.

    Returns
    -------
    metrics
        ``train_loss``, ``epsilon_mu``, ``epsilon`` (classical RDP ε of the same σ, q, steps at δ = β under the
        same adjacency), ``noise_multiplier``, ``sample_rate``, ``clip_norm``, ``steps`` (cumulative), ``stopped``
        (1 once the budget filter stopped the site) and ``fallback`` (1: a site too small ran classical DP-SGD).
    state
        JSON-serialisable state for the next round.
    """
    n = len(x) if num_records is None else num_records
    sample_rate, steps = poisson_schedule(n, batch_size=batch_size, epochs=epochs)
    state = dict(state or {})
    plan = {"target_epsilon_mu": target_epsilon_mu, "beta": beta, "sample_rate": sample_rate, "clip_norm": clip_norm,
            "total_steps": steps * rounds, "fallback": n < MIN_RECORDS, "adjacency": adjacency}
    prior = tuple(entry for entry in prior if math.isfinite(entry[0]))
    prior_costs = gaussian_release_costs([noise for noise, _, _ in prior])
    if "noise_multiplier" not in state:
        state["noise_multiplier"] = _calibrate_site_noise(model, x, time, event, seed=seed, prior=prior,
                                                          prior_costs=prior_costs, **plan)
    noise_multiplier = float(state["noise_multiplier"])
    bayes, classical = _site_accountants(state, adjacency=adjacency, prior=prior, prior_costs=prior_costs)
    loss, stopped = float("nan"), bool(state.get("stopped", False))
    if not stopped:
        loss, stopped = _train_accounted(model, x, time, event, bayes=bayes, classical=classical, training={
            "epochs": epochs, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "seed": seed,
            "num_records": n, "proximal_mu": proximal_mu}, noise_multiplier=noise_multiplier, **plan)
    metrics = _round_metrics(bayes, classical, loss=loss, stopped=stopped, fallback=plan["fallback"], beta=beta,
                             prior=prior, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                             clip_norm=clip_norm)
    return metrics, state | {"bayes": bayes.state_dict(), "classical": classical.state_dict(), "stopped": stopped,
                             "steps": metrics["steps"]}


def _round_metrics(
    bayes: BayesianAccountant, classical: SiteAccountant, *, loss: float, stopped: bool, fallback: bool, beta: float,
    prior: Sequence[tuple[float, float, int]], noise_multiplier: float, sample_rate: float, clip_norm: float,
) -> dict[str, float]:
    """The metrics of :func:`train_epochs_bdp` from the accountants after the round.

    ε and ε_μ at δ = β are 0 while nothing (no step, no prior release) is accounted; a ``fallback``
    site reports its classical ε as ε_μ. ``steps`` counts the training steps, not the ``prior`` releases.
    """
    prior_steps = sum(count for _, _, count in prior)
    spent = bool(classical.spent_steps)  # any step, or a release before training
    epsilon = classical.epsilon(beta) if spent else 0.0
    return {
        "train_loss": loss, "epsilon_mu": epsilon if fallback else bayes.epsilon(beta) if spent else 0.0,
        "epsilon": epsilon, "noise_multiplier": noise_multiplier, "sample_rate": sample_rate, "clip_norm": clip_norm,
        "steps": classical.spent_steps - prior_steps, "stopped": float(stopped), "fallback": float(fallback),
    }


def _calibrate_site_noise(
    model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, fallback: bool, adjacency: str,
    clip_norm: float, seed: int, prior: Sequence[tuple[float, float, int]], prior_costs: np.ndarray,
    target_epsilon_mu: float, beta: float, sample_rate: float, total_steps: int,
) -> float:
    """σ of a site's first round, for ``total_steps`` steps after the ``prior`` releases.

    A small site (``fallback``) gets the σ whose classical RDP ε under ``adjacency`` at δ = β meets
    ``target_epsilon_mu``; any other site :func:`calibrate_noise_for_bdp` from the pilot distances
    (:func:`pilot_distances`, seeded by ``seed``).
    """
    if fallback:
        # σ whose classical ε under this adjacency meets the target (σ/2 is what is accounted
        # under replace-one, see classical_noise_multiplier)
        scale = 1.0 / classical_noise_multiplier(1.0, adjacency=adjacency)
        return scale * calibrate_noise_multiplier(
            target_epsilon=target_epsilon_mu, target_delta=beta, sample_rate=sample_rate, steps=total_steps,
            prior=prior)
    return calibrate_noise_for_bdp(
        target_epsilon_mu=target_epsilon_mu, beta=beta,
        distances_pilot=pilot_distances(model, x, time, event, clip_norm=clip_norm, seed=seed,
                                        adjacency=adjacency),
        sample_rate=sample_rate, steps=total_steps, clip_norm=clip_norm, gamma_step=GAMMA_STEP,
        prior_costs=prior_costs,
    )


def _site_accountants(
    state: dict[str, Any], *, adjacency: str, prior: Sequence[tuple[float, float, int]], prior_costs: np.ndarray,
) -> tuple[BayesianAccountant, SiteAccountant]:
    """The site's Bayesian and classical accountants: restored from ``state``, else new ones holding ``prior``.

    Raises ValueError if the restored Bayesian accountant's adjacency is not ``adjacency``.
    """
    bayes = (BayesianAccountant.from_state_dict(state["bayes"]) if "bayes" in state
             else BayesianAccountant(adjacency=adjacency, prior_costs=prior_costs))
    if bayes.adjacency != adjacency:
        raise ValueError(f"the site's accountant is {bayes.adjacency}, the run asks for {adjacency}")
    if "classical" in state:
        return bayes, SiteAccountant.from_state_dict(state["classical"])
    classical = SiteAccountant()
    for noise, rate, count in prior:
        classical.step(noise_multiplier=noise, sample_rate=rate, num_steps=count)
    return bayes, classical


def _train_accounted(
    model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, bayes: BayesianAccountant,
    classical: SiteAccountant, fallback: bool, adjacency: str, noise_multiplier: float, clip_norm: float,
    training: dict[str, Any], target_epsilon_mu: float, beta: float, sample_rate: float, total_steps: int,
) -> tuple[float, bool]:
    """One round of :func:`train_epochs_dp` (options ``training``) with the budget filter before every step.

    Unless ``fallback``, each step is first accounted in ``bayes`` by :func:`account_step`, and empty
    Poisson batches (noise only) like the last accounted step; the steps taken are then accounted in
    ``classical``. Returns the round's training loss (NaN if the filter stopped it) and whether the
    filter stopped the site.
    """
    taken = 0
    last_distances: list[np.ndarray] = []
    loss, stopped = float("nan"), False

    def account(per_sample: PerSampleView) -> None:
        nonlocal taken
        if not fallback:
            last_distances[:] = [account_step(
                bayes, per_sample, sample_rate=sample_rate, noise_std=noise_multiplier * clip_norm,
                total_steps=total_steps, target_epsilon_mu=target_epsilon_mu, beta=beta,
                fallback_distances=last_distances[-1] if last_distances else None,
            )]
        taken += 1

    try:
        stats = train_epochs_dp(model, x, time, event, noise_multiplier=noise_multiplier, clip_norm=clip_norm,
                                on_step=account, **training)
        loss = float(stats["loss"])
        # empty Poisson batches release noise only; account them like the last step
        untracked = int(stats["num_steps"]) - taken
        if untracked > 0 and not fallback and last_distances:
            bayes.step(distances=last_distances[-1], sample_rate=sample_rate,
                       noise_std=noise_multiplier * clip_norm, total_steps=total_steps,
                       gamma_step=GAMMA_STEP, num_steps=untracked)
        taken = int(stats["num_steps"])
    except BudgetExhausted:
        stopped = True
    if taken:
        classical.step(noise_multiplier=classical_noise_multiplier(noise_multiplier, adjacency=adjacency),
                       sample_rate=sample_rate, num_steps=taken)
    return loss, stopped
