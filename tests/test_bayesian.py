"""Tests of models.bayesian: Bayes-by-Backprop layers, the scale-mixture prior, Monte-Carlo KL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.special
import scipy.stats
import torch
import torch.nn.functional as F
from torch import nn

from models.bayesian import (
    BayesianEmbedding,
    BayesianLinear,
    ScaleMixturePrior,
    kl_divergence,
    posterior_mean,
    seeded,
    set_sampling,
)


def _scipy_log_prior(w: np.ndarray, pi: float = 0.5, s1: float = 0.3, s2: float = 0.001) -> np.ndarray:
    """Log of the mixture density, via logsumexp of scipy's component log densities."""
    comps = np.stack([np.log(pi) + scipy.stats.norm.logpdf(w, 0, s1), np.log1p(-pi) + scipy.stats.norm.logpdf(w, 0, s2)])
    return scipy.special.logsumexp(comps, axis=0)


# --------------------------------------------------------------------------- prior


def test_prior_log_prob_matches_scipy_mixture() -> None:
    prior = ScaleMixturePrior()
    small = np.array([0.0, 1e-4, -5e-4, 0.002, 0.01, -0.1, 0.3])
    naive = np.log(0.5 * scipy.stats.norm.pdf(small, 0, 0.3) + 0.5 * scipy.stats.norm.pdf(small, 0, 0.001))
    got = prior.log_density(torch.tensor(small, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(got, naive, rtol=1e-10, atol=1e-10)
    # large |w|: the spike's pdf underflows to 0 and, from |w| ~ 12, the slab's too (naive -> -inf)
    large = np.array([0.5, -2.0, 5.0, 12.0, -30.0, 100.0])
    with np.errstate(divide="ignore"):
        mixture = 0.5 * scipy.stats.norm.pdf(large, 0, 0.3) + 0.5 * scipy.stats.norm.pdf(large, 0, 0.001)
        assert np.isneginf(np.log(mixture))[-3:].all()
    got = prior.log_density(torch.tensor(large, dtype=torch.float64)).numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _scipy_log_prior(large), rtol=1e-12)
    # log_prob sums, also in float32 at large |w|
    all_w = np.concatenate([small, large])
    total = prior.log_prob(torch.tensor(all_w, dtype=torch.float32))
    assert total.shape == ()
    assert math.isclose(float(total), float(_scipy_log_prior(all_w).sum()), rel_tol=1e-5)
    other = ScaleMixturePrior(pi=0.25, sigma1=1.0, sigma2=0.05)
    w = np.linspace(-3, 3, 13)
    np.testing.assert_allclose(
        other.log_density(torch.tensor(w, dtype=torch.float64)).numpy(), _scipy_log_prior(w, 0.25, 1.0, 0.05), rtol=1e-12
    )


# --------------------------------------------------------------------------- BayesianLinear


def test_bayesian_linear_samples_have_posterior_mean_and_std() -> None:
    torch.manual_seed(0)
    layer = BayesianLinear(50, 40, init_sigma=0.05, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.weight_rho.uniform_(-4.0, -1.0)  # heterogeneous sigma in [0.018, 0.31]
    samples = []
    for _ in range(2000):
        w, _ = layer._draw(layer.weight_mu, layer.weight_rho)
        samples.append(w.detach())
    s = torch.stack(samples)
    mu, sigma = layer.weight_mu.detach(), layer.weight_sigma.detach()
    se_mean = sigma / math.sqrt(len(samples))
    assert ((s.mean(0) - mu).abs() <= 5 * se_mean).float().mean() > 0.999
    rel = s.std(0) / sigma
    assert (rel - 1).abs().max() < 0.1  # sd of the sample sd ~ 1/sqrt(2 n) = 1.6%
    # the forward pass uses a draw with that law: bias + weights seen through x = 0 and x = e_j
    outs = torch.stack([layer(torch.zeros(1, 50)).detach()[0] for _ in range(2000)])
    np.testing.assert_allclose(outs.mean(0).numpy(), layer.bias_mu.detach().numpy(), atol=5 * 0.31 / math.sqrt(2000))
    np.testing.assert_allclose((outs.std(0) / layer.bias_sigma.detach()).numpy(), 1.0, atol=0.1)


def test_bayesian_linear_forward_draws_weights_with_posterior_moments() -> None:
    layer = BayesianLinear(30, 20, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.weight_rho.uniform_(-4.0, -1.0)
        layer.bias_rho.fill_(-60.0)  # bias sigma ~ 1e-26: output - bias isolates W
    n = 3000
    x = torch.eye(30)
    with torch.no_grad():
        w = torch.stack([(layer(x) - layer.bias_mu).T for _ in range(n)])  # (n, 20, 30)
    mu, sigma = layer.weight_mu.detach(), layer.weight_sigma.detach()
    z = (w.mean(0) - mu) / (sigma / math.sqrt(n))
    assert z.abs().max() < 5.0
    assert z.std() == pytest.approx(1.0, abs=0.1)
    assert (w.std(0) / sigma - 1).abs().max() < 0.1


def _exact_kl_per_weight(mu: float, sigma: float) -> float:
    """E_q[log q(w) - log p(w)] for q = N(mu, sigma^2) by adaptive quadrature."""

    def integrand(w: float) -> float:
        return scipy.stats.norm.pdf(w, mu, sigma) * (scipy.stats.norm.logpdf(w, mu, sigma) - _scipy_log_prior(np.array(w)))

    # the log prior has a sharp kink near |w| ~ 0.004 (spike -> slab): tell quad where it is
    points = [p for p in (-0.004, 0.0, 0.004) if mu - 12 * sigma < p < mu + 12 * sigma]
    val, _ = scipy.integrate.quad(integrand, mu - 12 * sigma, mu + 12 * sigma, points=points or None, limit=400)
    return float(val)


def test_bayesian_linear_mc_kl_matches_numerical_integration() -> None:
    torch.manual_seed(0)
    layer = BayesianLinear(3, 2, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        layer.weight_mu.copy_(torch.tensor([[0.0, 0.2, -0.5], [0.003, -0.05, 1.0]]))
        layer.weight_rho.copy_(torch.log(torch.expm1(torch.tensor([[0.001, 0.05, 0.2], [0.01, 0.02, 0.3]]))))
        layer.bias_mu.copy_(torch.tensor([0.1, -0.002]))
        layer.bias_rho.copy_(torch.log(torch.expm1(torch.tensor([0.1, 0.004]))))
    mus = torch.cat([layer.weight_mu.flatten(), layer.bias_mu]).double().tolist()
    sigmas = torch.cat([layer.weight_sigma.flatten(), layer.bias_sigma]).double().tolist()
    exact = sum(_exact_kl_per_weight(m, s) for m, s in zip(mus, sigmas, strict=True))
    x = torch.zeros(1, 3)
    n = 6000
    with torch.no_grad():
        kls = []
        for _ in range(n):
            layer(x)
            kls.append(float(layer.kl))
    kls = torch.tensor(kls, dtype=torch.float64)
    se = float(kls.std()) / math.sqrt(n)
    assert abs(float(kls.mean()) - exact) < 4 * se + 1e-3
    assert se < 0.05 * abs(exact)  # the check is informative


def test_bayesian_linear_gradients_reach_mu_and_rho() -> None:
    layer = BayesianLinear(4, 3)
    x = torch.randn(8, 4)
    (layer(x).pow(2).sum() + layer.kl).backward()
    for p in (layer.weight_mu, layer.weight_rho, layer.bias_mu, layer.bias_rho):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    # the KL estimate alone is differentiable in rho (it drives sigma)
    layer.zero_grad()
    layer(x)
    layer.kl.backward()
    assert layer.weight_rho.grad.abs().sum() > 0


def test_bayesian_linear_sigma_to_zero_and_posterior_mean_equal_linear() -> None:
    layer = BayesianLinear(6, 5)
    x = torch.randn(7, 6)
    expected = F.linear(x, layer.weight_mu, layer.bias_mu)
    with torch.no_grad():
        layer.weight_rho.fill_(-40.0)
        layer.bias_rho.fill_(-40.0)
    torch.testing.assert_close(layer(x), expected)
    layer2 = BayesianLinear(6, 5)
    layer2.sample = False
    torch.testing.assert_close(layer2(x), F.linear(x, layer2.weight_mu, layer2.bias_mu), rtol=0, atol=0)
    assert layer2.kl is not None and layer2.kl.requires_grad


def test_bayesian_linear_default_init_and_generator_reproducibility() -> None:
    layer = BayesianLinear(400, 10)
    assert torch.allclose(layer.weight_sigma, torch.tensor(0.005))  # min(0.05, 0.1 / sqrt(400))
    assert layer.weight_mu.abs().max() <= 1 / math.sqrt(400)
    assert torch.allclose(BayesianLinear(2, 3).weight_sigma, torch.tensor(0.05))
    a = BayesianLinear(5, 4, generator=torch.Generator().manual_seed(11))
    b = BayesianLinear(5, 4, generator=torch.Generator().manual_seed(11))
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 5)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.equal(a(x), a(x))  # fresh draw every forward


def test_bayesian_embedding_samples_and_kl() -> None:
    emb = BayesianEmbedding(4, 3, init_sigma=0.1, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([0, 2, 2, 3])
    with torch.no_grad():
        draws = torch.stack([emb(idx) for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), emb.weight_mu[idx].detach(), atol=0.01, rtol=0)
    torch.testing.assert_close(draws.std(0), torch.full((4, 3), 0.1), atol=0.006, rtol=0)
    # the KL covers the whole table: equals the hand formula for a draw with known eps
    emb.generator = torch.Generator().manual_seed(5)
    emb(idx)
    eps = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    w = emb.weight_mu + emb.weight_sigma * eps
    log_q = torch.distributions.Normal(emb.weight_mu, emb.weight_sigma).log_prob(w).sum()
    torch.testing.assert_close(emb.kl, log_q - ScaleMixturePrior().log_prob(w))
    emb.sample = False
    torch.testing.assert_close(emb(idx), emb.weight_mu[idx], rtol=0, atol=0)


def test_kl_divergence_sums_layers_and_switches() -> None:
    net = nn.Sequential(BayesianLinear(3, 4), nn.ReLU(), BayesianLinear(4, 2))
    assert float(kl_divergence(net)) == 0.0
    net(torch.randn(5, 3))
    torch.testing.assert_close(kl_divergence(net), net[0].kl + net[2].kl)
    set_sampling(net, False)
    x = torch.randn(5, 3)
    torch.testing.assert_close(net(x), net(x), rtol=0, atol=0)
    set_sampling(net, True)
    with posterior_mean(net):
        assert not net[0].sample and not net[2].sample
    assert net[0].sample and net[2].sample


def test_seeded_fixes_posterior_draws_and_dropout_and_restores_the_global_stream() -> None:
    net = nn.Sequential(BayesianLinear(6, 8), nn.Dropout(0.5), BayesianLinear(8, 3))
    x = torch.randn(4, 6)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with seeded(7):
        a = net(x)
        kl_a = kl_divergence(net)
    torch.testing.assert_close(torch.rand(3), expected_next, rtol=0, atol=0)  # global stream untouched
    with seeded(7):
        b = net(x)
        kl_b = kl_divergence(net)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(kl_a, kl_b, rtol=0, atol=0)
    with seeded(8):
        c = net(x)
    assert not torch.equal(a, c)
