"""Bayesian-DP training at a site: budget filter, carried state, small-site fallback, the cost rule
of calibration, filter and accountant."""

import numpy as np
import pytest

from models.survival import build_survival_model
from models.time_grid import make_time_grid
from strategies.accounting import bayesian_dp
from strategies.accounting.rdp import epsilon_from_history
from strategies.mechanisms import bdp_training
from strategies.mechanisms.bdp_training import train_epochs_bdp
from strategies.mechanisms.schedules import GAMMA_STEP, MIN_RECORDS, poisson_schedule


def site(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    time = rng.exponential(1.0 / np.exp(0.7 * x[:, 0])) + 0.01
    event = (rng.random(n) < 0.6).astype(np.float32)
    model = build_survival_model("hazard_mlp", in_features=6, cuts=make_time_grid(time, event, num_durations=8),
                                 hidden=(16, 16), seed=seed)
    return model, x, time, event


def run(model, x, time, event, state, *, target, round_seed, rounds=3, adjacency="add-remove"):
    return train_epochs_bdp(model, x, time, event, epochs=1, batch_size=32, lr=3e-3, weight_decay=0.0,
                            seed=round_seed, clip_norm=1.0, target_epsilon_mu=target, beta=1e-5,
                            rounds=rounds, state=state, adjacency=adjacency)


@pytest.mark.filterwarnings("error:.*UCB horizon:RuntimeWarning")
@pytest.mark.parametrize("adjacency", ["add-remove", "replace-one"])
def test_a_site_never_trains_past_its_budget_and_then_stops_for_good(adjacency):
    model, x, time, event = site(400)
    state, history = None, []
    for round_seed in range(6):  # more rounds than calibrated for: the filter must hold the line
        metrics, state = run(model, x, time, event, state, target=1.0, round_seed=round_seed, adjacency=adjacency)
        history.append(metrics)
        assert metrics["epsilon_mu"] <= 1.0
    assert history[-1]["stopped"] == 1.0
    steps = [metrics["steps"] for metrics in history]
    assert steps == sorted(steps) and steps[-1] == steps[-2]  # no step after stopping
    assert steps[-1] <= 3 * steps[0]  # nor past the UCB horizon it was calibrated for (3 rounds)
    last = history[-1]
    # the classical figure beside eps_mu, under the same adjacency (replace-one: sensitivity 2C)
    sigma = last["noise_multiplier"] / (2.0 if adjacency == "replace-one" else 1.0)
    classical = epsilon_from_history([(sigma, last["sample_rate"], int(last["steps"]))], delta=1e-5)
    assert last["epsilon"] == pytest.approx(classical, rel=1e-9)


def test_same_seed_same_epsilon_and_model():
    results = []
    for _ in range(2):
        model, x, time, event = site(300)
        metrics, state = run(model, x, time, event, None, target=2.0, round_seed=7)
        results.append((metrics, [p.detach().clone() for p in model.net.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("adjacency", ["add-remove", "replace-one"])
def test_small_sites_fall_back_to_classical_dp(adjacency):
    model, x, time, event = site(MIN_RECORDS - 1)
    metrics, _ = run(model, x, time, event, None, target=1.0, round_seed=0, rounds=1, adjacency=adjacency)
    assert metrics["fallback"] == 1.0 and metrics["epsilon_mu"] == metrics["epsilon"]
    assert 0.99 <= metrics["epsilon"] <= 1.0  # calibrated to the target under this adjacency


def test_a_site_calibrates_filters_and_accounts_under_max_of_left_and_right(monkeypatch):
    """The training path uses FSL-BDP's per-distance cost max(c_L, c_R) throughout: σ is calibrated
    so that the pilot projection under that rule meets the target (c_L alone would project far
    less), and every committed step cost is the UCB of max(c_L, c_R) over that step's distances."""
    model, x, time, event = site(400)
    rounds, target, beta = 2, 1.0, 1e-5
    pilot = bdp_training.pilot_distances(model, x, time, event, clip_norm=1.0, seed=0, adjacency="add-remove")
    calls, commits = [], []
    real_step_costs, real_commit = bayesian_dp.step_costs, bayesian_dp.BayesianAccountant.commit

    def recording_step_costs(distances, **kwargs):
        calls.append((np.asarray(distances, dtype=np.float64).copy(), kwargs))
        return real_step_costs(distances, **kwargs)

    def recording_commit(self, costs, **kwargs):
        commits.append((np.asarray(costs).copy(), calls[-1]))
        return real_commit(self, costs, **kwargs)

    monkeypatch.setattr(bdp_training, "step_costs", recording_step_costs)
    monkeypatch.setattr(bayesian_dp, "step_costs", recording_step_costs)
    monkeypatch.setattr(bayesian_dp.BayesianAccountant, "commit", recording_commit)
    metrics, state = run(model, x, time, event, None, target=target, round_seed=0, rounds=rounds)

    q, steps = poisson_schedule(len(x), batch_size=32, epochs=1)
    assert metrics["fallback"] == 0.0 and metrics["stopped"] == 0.0
    sigma, total = metrics["noise_multiplier"], steps * rounds
    projected = bayesian_dp.project_epsilon_mu(noise_multiplier=sigma, distances=pilot, sample_rate=q, steps=total,
                                               clip_norm=1.0, beta=beta)
    assert target - 1e-3 <= projected <= target
    left = [bayesian_dp.ucb_cost(
        bayesian_dp.log_binomial_cost(order, pilot, sample_rate=q, noise_std=sigma, side="left"),
        total_steps=total, gamma_step=GAMMA_STEP) for order in bayesian_dp.DEFAULT_ORDERS]
    assert bayesian_dp.epsilon_mu(total * np.asarray(left), bayesian_dp.DEFAULT_ORDERS, beta=beta) < 0.9 * target

    assert len(commits) >= steps - 1
    for costs, (distances, kwargs) in commits:
        assert kwargs["noise_std"] == sigma * 1.0 and kwargs["sample_rate"] == q
        for row, order in enumerate(bayesian_dp.DEFAULT_ORDERS):
            per_distance = {side: bayesian_dp.log_binomial_cost(order, distances, sample_rate=q, noise_std=sigma,
                                                                side=side) for side in ("left", "right")}
            ucb = {side: bayesian_dp.ucb_cost(values, total_steps=total, gamma_step=GAMMA_STEP)
                   for side, values in {**per_distance,
                                        "max": np.maximum(per_distance["left"], per_distance["right"])}.items()}
            assert costs[row] == pytest.approx(ucb["max"], rel=1e-12)
            assert costs[row] > ucb["left"]
