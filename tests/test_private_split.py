"""private_split: the accounting against dp-accounting, the site's releases, the residuals, the head."""

from __future__ import annotations

import dataclasses
import math

import dp_accounting
import numpy as np
import pandas as pd
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from lifelines import CoxPHFitter, NelsonAalenFitter

from models.data.vertical import simulate_multimodal, split_train_test
from models.multimodal_training import discretised_labels
from models.release_head import fit_release_head, predict_release_head
from models.time_grid import make_time_grid
from strategies.accounting.rdp import DEFAULT_RDP_ORDERS
from strategies.accounting.private_split import (
    FIT_SENSITIVITY,
    PrivateSplitPlan,
    plan_noise,
    record_epsilon,
    setup_multiplier,
)
from strategies.private_split import (
    PrivateSplitSite,
    PrivateSplitSites,
    concatenate,
    martingale_residuals,
)

OPTIONS = [("score", "laplace"), ("score", "gaussian"), ("pca", "gaussian"), ("pca", "laplace"),
           ("features", "gaussian"), ("features", "laplace")]


def _google_epsilon(plan: PrivateSplitPlan, noise) -> tuple[float, float]:
    """dp-accounting's figures for the same mechanisms: RDP of the Gaussian part plus the Laplace part's pure ε
    (the protocol's basic composition), and the PLD accountant of everything together (tighter)."""
    gaussians = [noise.setup_multiplier] * plan.num_sites
    if FIT_SENSITIVITY[plan.encoder] > 0:
        gaussians += [noise.fit_multiplier] * plan.num_sites
    if plan.release_noise == "gaussian":
        gaussians += [noise.release_scale / (2 * plan.clip_norm)] * plan.num_sites
    rdp = RdpAccountant(list(DEFAULT_RDP_ORDERS))
    pld = PLDAccountant()
    for z in gaussians:
        rdp.compose(dp_accounting.GaussianDpEvent(z))
        pld.compose(dp_accounting.GaussianDpEvent(z))
    pure = 0.0
    if plan.release_noise == "laplace":
        # a Laplace release of L1 sensitivity 2C and scale b: dp-accounting's parameter is b / sensitivity
        for _ in range(plan.num_sites):
            pld.compose(dp_accounting.LaplaceDpEvent(noise.release_scale / (2 * plan.clip_norm)))
        pure = plan.num_sites * 2 * plan.clip_norm / noise.release_scale
    return rdp.get_epsilon(plan.delta) + pure, pld.get_epsilon(plan.delta)


@pytest.mark.parametrize(("encoder", "release_noise"), OPTIONS)
@pytest.mark.parametrize("epsilon", [3.0, 10.0])
def test_each_option_spends_its_budget_as_dp_accounting_counts_it(encoder, release_noise, epsilon):
    plan = PrivateSplitPlan(epsilon=epsilon, delta=1e-5, num_sites=3, encoder=encoder, release_noise=release_noise,
                            clip_norm=0.7)
    noise = plan_noise(plan)
    assert noise.setup_multiplier == setup_multiplier(plan) > 0
    assert (noise.fit_multiplier > 0) == (encoder != "features")
    assert noise.epsilon == pytest.approx(epsilon, rel=1e-4)  # the whole budget, nothing more
    assert noise.epsilon_before_release < noise.epsilon
    ours, tight = _google_epsilon(plan, noise)
    assert record_epsilon(plan, noise) == pytest.approx(ours, rel=1e-4)
    assert tight <= ours + 1e-9  # the PLD accountant of the same mechanisms is never looser
    # a record released twice (no cache) would spend more: the cache is what makes the figure hold
    assert record_epsilon(plan, noise, releases=2) > epsilon + 0.5


@pytest.mark.parametrize("sites", [1, 2, 3])
@pytest.mark.parametrize(("epsilon", "share"), [(1.0, 0.2), (10.0, 0.2), (10.0, 0.05), (3.0, 0.5)])
def test_the_sites_set_ups_together_spend_the_set_up_share_as_dp_accounting_counts_it(epsilon, share, sites):
    plan = PrivateSplitPlan(epsilon=epsilon, delta=1e-5, num_sites=sites, setup_share=share)
    z = plan_noise(plan).setup_multiplier
    # the K set-ups (one Gaussian of multiplier z each, RDP K alpha / 2z^2) compose to one Gaussian of z / sqrt(K) ...
    together = RdpAccountant(list(DEFAULT_RDP_ORDERS))
    together.compose(dp_accounting.GaussianDpEvent(z), sites)
    assert together.get_epsilon(1e-5) == pytest.approx(_single(z / math.sqrt(sites)), rel=1e-9)
    # ... whose RDP is `share` times that of the one Gaussian spending (epsilon, delta) alone
    full = z * math.sqrt(share / sites)
    assert _single(full) == pytest.approx(epsilon, rel=2e-2)  # opacus' calibration, dp-accounting's orders
    assert _single(full * 1.05) < epsilon < _single(full / 1.05)
    # the whole plan still spends exactly epsilon, with more set-up noise for a smaller share
    assert plan_noise(plan).epsilon == pytest.approx(epsilon, rel=1e-4)
    if share > 0.05:
        assert plan_noise(dataclasses.replace(plan, setup_share=share / 2)).setup_multiplier > z


def _single(z: float) -> float:
    accountant = RdpAccountant(list(DEFAULT_RDP_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    return accountant.get_epsilon(1e-5)


def test_a_budget_the_set_up_eats_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match="privacy.epsilon or lower privacy.setup_share or split.fit_share"):
        plan_noise(PrivateSplitPlan(epsilon=1.0, delta=1e-5, num_sites=3, setup_share=0.9))
    assert math.isinf(record_epsilon(PrivateSplitPlan(epsilon=math.inf, delta=1e-5, num_sites=2),
                                     plan_noise(PrivateSplitPlan(epsilon=math.inf, delta=1e-5, num_sites=2))))


def test_martingale_residuals_are_event_minus_nelson_aalen_and_sum_to_zero():
    rng = np.random.default_rng(0)
    time = np.round(rng.exponential(size=300), 1)  # ties
    event = rng.integers(0, 2, size=300)
    residuals = martingale_residuals(time, event)
    fitter = NelsonAalenFitter(nelson_aalen_smoothing=False).fit(time, event)
    hazard = fitter.cumulative_hazard_at_times(time).to_numpy()
    unclipped = event - hazard
    assert np.allclose(residuals, np.clip(unclipped, -2.0, 1.0))
    assert abs(unclipped.sum()) < 1e-8  # the null model's martingale residuals sum to 0


def test_the_statistics_sensitivities_hold_for_the_worst_records():
    # pca: ||v v^T - u u^T||_F <= sqrt(2) for rows of norm <= 1 (attained by orthogonal unit rows)
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(2000):
        v, u = rng.normal(size=(2, 6))
        v, u = v / max(1.0, np.linalg.norm(v)), u / max(1.0, np.linalg.norm(u))
        worst = max(worst, np.linalg.norm(np.outer(v, v) - np.outer(u, u)))
    e = np.eye(6)
    assert worst <= FIT_SENSITIVITY["pca"] + 1e-12
    assert np.linalg.norm(np.outer(e[0], e[0]) - np.outer(e[1], e[1])) == pytest.approx(FIT_SENSITIVITY["pca"])
    # score: a residual in [-2, 1] times a row of norm <= 1, replaced by another: at most 2 * 2
    residual = -2.0  # fixed by the labels; the features move from e0 to -e0
    assert np.linalg.norm(residual * e[0] - residual * (-e[0])) == pytest.approx(FIT_SENSITIVITY["score"])


def _site(encoder="score", epsilon=10.0, n=2000):
    table = simulate_multimodal(n, seed=0)
    train_ids, _ = split_train_test(table, test_fraction=0.25, seed=0)
    plan = PrivateSplitPlan(epsilon=epsilon, delta=1e-5, num_sites=1, encoder=encoder)
    site = PrivateSplitSite(plan, plan_noise(plan), table.modalities["a"])
    train = table.subset(train_ids)
    site.fit(train_ids, dict(zip(map(str, train_ids), martingale_residuals(train.time, train.event))),
             np.random.default_rng(5))
    return site, table


def _copy(site: PrivateSplitSite, features: pd.DataFrame) -> PrivateSplitSite:
    """A site holding ``features`` with ``site``'s fitted preprocessing and encoder."""
    other = PrivateSplitSite(site.plan, site.noise, features)
    text, arrays = site.state_dict()
    other.load_state_dict(text, arrays)
    return other


def test_a_record_leaves_its_site_once_and_its_release_depends_on_it_alone():
    site, table = _site()
    ids = [str(i) for i in table.ids[:5]]
    first, present = site.release(ids, np.random.default_rng(1))
    again, _ = site.release(ids[::-1], np.random.default_rng(2))
    assert present.all() and np.array_equal(again[::-1], first)  # cached: the same values, no new noise
    assert first.shape == (5, 1) and np.abs(first).max() > 0 and site.privacy_report() == {"releases_max": 1.0}
    # the cache survives the node state (each message may run in a new process)
    restored = _copy(site, site.features)
    assert np.array_equal(restored.release(ids, np.random.default_rng(3))[0], first)
    with pytest.raises(ValueError, match="already fitted"):
        restored.fit(ids, None, np.random.default_rng(0))
    # another record's features do not move this record's release (given the fitted encoder and the noise)
    fresh = PrivateSplitSite(site.plan, site.noise, site.features)
    fresh.load_state_dict(site.state_dict()[0] | {"released_ids": "[]"},
                          site.state_dict()[1] | {"released": np.zeros((0, 1))})
    changed = site.features.copy()
    changed.loc[ids[1]] = -changed.loc[ids[1]]
    moved = _copy(fresh, changed)
    before = fresh.release(ids[:2], np.random.default_rng(4))[0]
    after = moved.release(ids[:2], np.random.default_rng(4))[0]
    assert np.array_equal(before[0], after[0]) and not np.array_equal(before[1], after[1])
    missing = site.release(["nobody"], np.random.default_rng(0))
    assert not missing[1].any() and not missing[0].any()


def test_the_score_encoder_finds_the_cox_direction_of_its_modality_without_noise():
    table = simulate_multimodal(3000, seed=0)
    frame = table.modalities["a"]
    train_ids, _ = split_train_test(table, test_fraction=0.2, seed=0)
    train = table.subset(train_ids)
    plan = PrivateSplitPlan(epsilon=math.inf, delta=1e-5, num_sites=1)
    site = PrivateSplitSite(plan, plan_noise(plan), frame)
    site.fit(train_ids, dict(zip(map(str, train_ids), martingale_residuals(train.time, train.event))),
             np.random.default_rng(0))
    released, _ = site.release([str(i) for i in table.ids], np.random.default_rng(0))
    cox = CoxPHFitter().fit(frame.assign(T=table.time, E=table.event), "T", "E")
    linear_predictor = frame.to_numpy() @ cox.params_[list(frame.columns)].to_numpy()
    assert np.abs(released).max() > plan.clip_norm  # without noise nothing is clipped
    assert np.corrcoef(linear_predictor, released[:, 0])[0, 1] > 0.95


def test_the_head_learns_from_releases_and_its_per_record_loss_falls():
    table = simulate_multimodal(2000, seed=0).select(("a", "b"))
    train_ids, test_ids = split_train_test(table, test_fraction=0.2, seed=0)
    train, test = table.subset(train_ids), table.subset(test_ids)
    plan = PrivateSplitPlan(epsilon=math.inf, delta=1e-5, num_sites=2)
    sites = PrivateSplitSites(plan, plan_noise(plan), {m: (table.modalities[m], ()) for m in ("a", "b")},
                              noise_seed=0)
    sites.fit(train_ids, dict(zip(map(str, train_ids), martingale_residuals(train.time, train.event))))
    x = concatenate(sites.release(train_ids), ("a", "b"))
    cuts = make_time_grid(train.time, train.event, num_durations=10, scheme="quantiles")
    time_index, event = discretised_labels(train.time, train.event, cuts)
    head, losses = fit_release_head(torch.tensor(x), time_index, event, num_durations=len(cuts), epochs=30, seed=0)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) and losses[0] < 10  # per record, not summed
    logits = predict_release_head(head, torch.tensor(concatenate(sites.release(test_ids), ("a", "b"))), passes=5, seed=0)
    assert logits.shape == (5, len(test_ids), len(cuts))
    assert not torch.equal(logits[0], logits[1])  # the band comes from the head's own posterior samples
    from sksurv.metrics import concordance_index_censored

    survival = torch.cumprod(torch.sigmoid(-logits), dim=-1).mean(0).numpy()
    c = concordance_index_censored(test.event.astype(bool), test.time, -survival.sum(1))[0]
    assert c > 0.72  # two of three modalities, no noise: about the linear Cox fit's 0.75


def test_the_smallest_site_size_keeps_a_one_bin_column_with_probability_phi_2():
    from strategies.private_split import _site_dictionary, smallest_site
    from strategies.mechanisms.setup_statistics import SetupPlan

    plan = PrivateSplitPlan(epsilon=1.0, delta=1e-5, num_sites=2, encoder="features")
    noise = plan_noise(plan)
    setup = SetupPlan(("x",), {"x"}, noise_multiplier=noise.setup_multiplier, adjacency="replace-one",
                      dictionary=_site_dictionary(None, ("x",)))
    smallest, std = smallest_site(setup), setup.noise_std("range_histograms")
    assert smallest == math.ceil(6 * std)

    def kept(n: int, trials: int = 200) -> float:
        frame = pd.DataFrame({"x": np.full(n, 5.0) + np.linspace(0, 0.1, n)}, index=[f"r{i}" for i in range(n)])
        count = 0
        for trial in range(trials):
            site = PrivateSplitSite(plan, noise, frame)
            try:
                site.fit(list(frame.index), None, np.random.default_rng(trial))
                count += 1
            except ValueError as err:
                assert f"a column needs about {smallest};" in str(err)
        return count / trials

    assert kept(smallest) >= 0.95  # Phi(2) = 0.977
    assert kept(math.ceil(3 * std)) < 0.5  # Phi(-1) = 0.16, plus the chance of a noise window elsewhere
