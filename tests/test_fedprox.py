"""FedProx (``train.proximal_mu``): the proximal term's gradient, and its pull toward the global model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.survival import build_survival_model
from models.time_grid import make_time_grid
from models.training import ProximalTerm, train_epochs
from simulations.engine import run_inprocess
from strategies.mechanisms.dp_sgd_training import train_epochs_dp
from tests.test_dp_sgd import _flchain_like

SMALL = {"federation.num_sites": 3, "federation.rounds": 1, "baseline.centralized": False,
         "evaluation.server_side": False}


@pytest.fixture(scope="module")
def data():
    return _flchain_like(n=600)


def _model(data):
    x, time, event = data
    return build_survival_model("hazard_mlp", in_features=x.shape[1], cuts=make_time_grid(time, event, num_durations=10),
                                seed=0)


def _distance(net, start):
    return float(torch.sqrt(sum(((p.detach() - s) ** 2).sum() for p, s in zip(net.parameters(), start, strict=True))))


def test_the_proximal_gradient_is_autograds_gradient_of_the_term(data):
    model = _model(data)
    net = model.net
    proximal = ProximalTerm(net, mu=0.7)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))
    for p in net.parameters():
        p.grad = torch.ones_like(p)                                    # a data gradient already there
    proximal.add_gradient(net)
    expected = torch.autograd.grad(0.35 * sum(((p - a) ** 2).sum() for p, a in zip(net.parameters(), proximal.anchor)),
                                   list(net.parameters()))
    for p, g in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, 1.0 + g)
    with pytest.raises(ValueError, match="proximal mu must be >= 0"):
        ProximalTerm(net, mu=-1.0)


@pytest.mark.parametrize("private", [False, True])
def test_a_positive_mu_keeps_the_local_model_closer_to_where_it_started(data, private):
    """Same data, seed, batches and (DP) noise draws: only the proximal term differs. DP-SGD's schedule and
    figures (what the accountant uses) are unchanged by it."""
    x, time, event = data
    distances, figures = {}, {}
    for mu in (0.0, 1.0):
        model = _model(data)
        start = [p.detach().clone() for p in model.net.parameters()]
        common = dict(epochs=3, batch_size=64, lr=0.01, seed=3, proximal_mu=mu)
        if private:
            stats = train_epochs_dp(model, x, time, event, noise_multiplier=1.0, clip_norm=1.0, **common)
            figures[mu] = {key: stats[key] for key in ("num_steps", "sample_rate", "noise_multiplier", "clip_norm")}
        else:
            train_epochs(model, x, time, event, **common)
        distances[mu] = _distance(model.net, start)
    assert distances[1.0] < 0.9 * distances[0.0]
    if private:
        assert figures[1.0] == figures[0.0]


def _update_distances(overrides, tmp_path):
    """Each site's distance between the update it sent and the global model it was sent (round 1)."""
    distances = {}

    def observe(message, reply):
        if message.metadata.message_type == "train" and not reply.has_error():
            sent = message.content["arrays"]
            update = next(iter(reply.content.array_records.values()))
            distances[message.metadata.dst_node_id] = float(np.sqrt(sum(
                ((update[key].numpy() - sent[key].numpy()) ** 2).sum() for key in sent)))

    run_inprocess({**overrides, "output.dir": str(tmp_path)}, observe=observe)
    return distances


@pytest.mark.parametrize("strategy", ["fedavg", "dp_sgd"])
def test_every_site_sends_an_update_closer_to_the_global_model_through_flower(strategy, tmp_path):
    overrides = {**SMALL, "strategy.name": strategy, "train.local_epochs": 3,
                 **({"privacy.epsilon": 4.0} if strategy == "dp_sgd" else {})}
    plain = _update_distances(overrides, tmp_path / "plain")
    prox = _update_distances({**overrides, "train.proximal_mu": 1.0}, tmp_path / "prox")
    assert set(plain) == set(prox) and len(plain) == 3
    assert all(prox[node] < 0.9 * plain[node] for node in plain)
    if strategy == "dp_sgd":  # a function of the weights only: the ledger is the same
        assert (tmp_path / "plain" / "ledger.jsonl").read_text() == (tmp_path / "prox" / "ledger.jsonl").read_text()
