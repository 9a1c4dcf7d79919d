"""Tests of models.bayesian: Bayes-by-Backprop layers, encoders, fusion, BVFLMSP loss."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.integrate
import scipy.special
import scipy.stats
import torch
import torch.nn.functional as F
from sksurv.metrics import concordance_index_censored
from torch import nn

from models.bayesian import (
    AttentionFusion,
    BayesianClinicalNet,
    BayesianEmbedding,
    BayesianFC,
    BayesianLinear,
    BayesianMultisurv,
    ScaleMixturePrior,
    bvflmsp_loss,
    hidden_width,
    kl_divergence,
    mc_survival,
    posterior_mean,
    set_sampling,
)
from models.losses import logistic_hazard_nll
from models.survival import discretise, make_time_grid


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
        assert np.isneginf(np.log(0.5 * scipy.stats.norm.pdf(large, 0, 0.3) + 0.5 * scipy.stats.norm.pdf(large, 0, 0.001)))[-3:].all()
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


# --------------------------------------------------------------------------- encoders


def test_hidden_width_rule() -> None:
    assert hidden_width(100) == 128
    assert hidden_width(128) == 128
    assert hidden_width(129) == 256
    assert hidden_width(1000) == 1024
    assert hidden_width(1881, 2) == 2048
    assert hidden_width(3774) == 1024
    assert hidden_width(3774, 2) == 2048
    with pytest.raises(ValueError):
        hidden_width(0)


def test_bayesian_fc_structure() -> None:
    fc = BayesianFC(200, 64, 3, scale=2, dropout=0.1)
    kinds = [type(m).__name__ for m in fc.layers]
    assert kinds == ["BayesianLinear", "ReLU", "BatchNorm1d", "Dropout"] * 3 + ["BayesianLinear"]
    assert [m.out_features for m in fc.layers if isinstance(m, BayesianLinear)] == [512, 512, 512, 64]
    assert fc(torch.randn(4, 200)).shape == (4, 64)
    assert kl_divergence(fc).ndim == 0
    assert BayesianFC(5, 2, 0)(torch.randn(3, 5)).shape == (3, 2)


def test_clinical_net_shapes_and_input_convention() -> None:
    net = BayesianClinicalNet([3, 5], num_continuous=2, hidden=16, out_features=8)
    assert [e.embedding_dim for e in net.embeddings] == [2, 3]
    x = torch.tensor([[0.0, 4.0, 0.5, -1.0], [2.0, 0.0, 1.5, 2.0], [1.0, 1.0, -0.3, 0.0]])
    out = net(x)
    assert out.shape == (3, 8)
    assert net.fc1.in_features == 2 + 3 + 2
    with pytest.raises(ValueError):
        net(torch.tensor([[3.0, 0.0, 0.0, 0.0]]))  # code out of range
    with pytest.raises(ValueError):
        net(torch.tensor([[0.5, 0.0, 0.0, 0.0]]))  # not an integer code
    # categorical columns reach the output through their embedding rows
    net.eval()
    with posterior_mean(net):
        a = net(x)
        x2 = x.clone()
        x2[0, 0] = 1.0
        b = net(x2)
    assert not torch.allclose(a[0], b[0]) and torch.allclose(a[1:], b[1:])
    assert BayesianClinicalNet([], num_continuous=3, out_features=4)(torch.randn(5, 3)).shape == (5, 4)


# --------------------------------------------------------------------------- fusion


def test_attention_fusion_weights_and_mask() -> None:
    torch.manual_seed(0)
    fusion = AttentionFusion(dim=6)
    e = torch.randn(4, 3, 6)
    mask = torch.tensor([[True, True, True], [True, False, True], [False, True, False], [False, False, False]])
    fused, w = fusion(e, mask)
    assert fused.shape == (4, 6) and w.shape == (4, 3)
    torch.testing.assert_close(w[:3].sum(1), torch.ones(3))
    assert torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(fused[3], torch.zeros(6)) and torch.isfinite(fused).all()
    assert torch.equal(w[2], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(fused[2], e[2, 1])
    # the weights are a softmax of tanh(Bayesian linear) scores (posterior mean for a fixed check)
    fusion.score.sample = False
    fused, w = fusion(e, mask)
    s = torch.tanh(F.linear(e[0], fusion.score.weight_mu, fusion.score.bias_mu)).squeeze(-1)
    torch.testing.assert_close(w[0], torch.softmax(s, 0))
    torch.testing.assert_close(fused[0], (w[0, :, None] * e[0]).sum(0))
    # changing (even poisoning) a masked modality's embedding changes nothing
    e2 = e.clone()
    e2[1, 1] = 1e6
    e2[3] = float("nan")
    fused2, w2 = fusion(e2, mask)
    torch.testing.assert_close(fused2, fused, rtol=0, atol=0)
    torch.testing.assert_close(w2, w, rtol=0, atol=0)
    # gradients stay finite with missing modalities
    e3 = e.clone().requires_grad_(True)
    fusion(e3, mask)[0].sum().backward()
    assert torch.isfinite(e3.grad).all() and torch.equal(e3.grad[3], torch.zeros(3, 6))
    # no mask: all modalities weighted
    _, w_all = fusion(e)
    torch.testing.assert_close(w_all.sum(1), torch.ones(4))


# --------------------------------------------------------------------------- model and loss


def _small_model(num_durations: int = 5, dim: int = 16, **kw) -> BayesianMultisurv:
    return BayesianMultisurv(
        {
            "clinical": BayesianClinicalNet([3], num_continuous=2, hidden=16, out_features=dim, dropout=0.1),
            "omics": BayesianFC(10, dim, 1, dropout=0.1),
        },
        dim=dim,
        num_durations=num_durations,
        head_hidden_layers=kw.pop("head_hidden_layers", 1),
        head_dropout=kw.pop("head_dropout", 0.1),
        **kw,
    )


def test_multisurv_shapes_missing_modality_and_uncertainty() -> None:
    torch.manual_seed(0)
    model = _small_model(num_durations=7)
    inputs = {"clinical": torch.cat([torch.randint(0, 3, (9, 1)).float(), torch.randn(9, 2)], 1), "omics": torch.randn(9, 10)}
    logits, emb = model(inputs)
    assert logits.shape == (9, 7) and emb.shape == (9, 2, 16)
    assert float(kl_divergence(model).detach()) != 0.0
    # modality absent from the dict -> zero embedding, masked
    logits_c, emb_c = model({"clinical": inputs["clinical"]})
    assert logits_c.shape == (9, 7) and torch.equal(emb_c[:, 1], torch.zeros(9, 16))
    # eval mode: m stochastic passes differ; posterior-mean mode is deterministic
    model.eval()
    passes = torch.stack([model(inputs)[0] for _ in range(5)])
    assert (passes.std(0) > 0).all()
    with posterior_mean(model):
        torch.testing.assert_close(model(inputs)[0], model(inputs)[0], rtol=0, atol=0)
    mean, lo, hi = mc_survival(model, inputs, num_samples=20)
    assert mean.shape == (9, 7) and (lo <= mean + 1e-6).all() and (mean <= hi + 1e-6).all() and (hi > lo).any()
    assert (mean.diff(dim=1) <= 1e-6).all() and not model.training


def _synthetic(n: int, generator: np.random.Generator) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
    """Hazard exp(1.5 * omics[:, 0] + 1.0 * [category == 2]); censoring independent."""
    cat = generator.integers(0, 3, n)
    cont = generator.normal(size=(n, 2))
    omics = generator.normal(size=(n, 10))
    log_hazard = 1.5 * omics[:, 0] + 1.0 * (cat == 2)
    t_event = generator.exponential(1.0 / np.exp(log_hazard))
    t_cens = generator.exponential(2.0, n)
    time, event = np.minimum(t_event, t_cens), (t_event <= t_cens).astype(np.int64)
    inputs = {
        "clinical": torch.tensor(np.column_stack([cat, cont]), dtype=torch.float32),
        "omics": torch.tensor(omics, dtype=torch.float32),
    }
    return inputs, time, event


def test_multisurv_learns_synthetic_hazard() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    train_x, train_t, train_e = _synthetic(400, rng)
    test_x, test_t, test_e = _synthetic(400, rng)
    cuts = make_time_grid(train_t, train_e, num_durations=8)
    idx, ev = (torch.from_numpy(a) for a in discretise(train_t, train_e, cuts))
    test_idx, test_ev = (torch.from_numpy(a) for a in discretise(np.minimum(test_t, cuts[-1]), test_e * (test_t <= cuts[-1]), cuts))
    model = _small_model(num_durations=cuts.size)

    def evaluate() -> tuple[float, float]:
        model.eval()
        with torch.no_grad(), posterior_mean(model):
            logits, _ = model(test_x)
        model.train()
        surv_end = torch.cumprod(1 - torch.sigmoid(logits), 1)[:, -1].numpy()
        cindex = concordance_index_censored(test_e.astype(bool), test_t, 1 - surv_end)[0]
        return float(logistic_hazard_nll(logits, test_idx, test_ev)), float(cindex)

    nll0, c0 = evaluate()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        logits, emb = model(train_x)
        loss = bvflmsp_loss(logits, idx, ev, emb, kl=kl_divergence(model), num_train=400)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    nll1, c1 = evaluate()
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.2
    assert nll1 < nll0 - 0.1
    assert c1 > 0.7 and c1 > c0 + 0.1


def test_loss_reduces_to_nll_and_similarity_hand_computation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    idx = torch.tensor([0, 1, 3, 2, 2, 0])
    ev = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    emb = torch.randn(6, 2, 5)
    plain = bvflmsp_loss(logits, idx, ev, emb, kl=0.0, num_train=100, similarity_weight=0.0)
    torch.testing.assert_close(plain, logistic_hazard_nll(logits, idx, ev))
    # KL term: kl / num_train
    with_kl = bvflmsp_loss(logits, idx, ev, emb, kl=torch.tensor(30.0), num_train=100, similarity_weight=0.0)
    torch.testing.assert_close(with_kl, plain + 0.3)
    # similarity term for two modalities, by hand
    a, b = emb[:, 0].numpy().astype(np.float64), emb[:, 1].numpy().astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    expected = float(plain) + 0.05 * np.mean(1 - cos)
    got = bvflmsp_loss(logits, idx, ev, [emb[:, 0], emb[:, 1]], kl=0.0, num_train=100)
    assert float(got) == pytest.approx(expected, rel=1e-5)
    # three modalities: mean over the three pairs; with a mask only pairs with both present
    emb3 = torch.randn(6, 3, 5)
    pairs = list(itertools.combinations(range(3), 2))
    by_hand = np.mean([[1 - float(F.cosine_similarity(emb3[i, k], emb3[i, l], dim=0)) for k, l in pairs] for i in range(6)])
    got3 = bvflmsp_loss(logits, idx, ev, emb3, kl=0.0, num_train=1, similarity_weight=1.0) - plain
    assert float(got3) == pytest.approx(by_hand, rel=1e-5)
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[:, 2] = False
    got_m = bvflmsp_loss(logits, idx, ev, emb3, kl=0.0, num_train=1, similarity_weight=1.0, mask=mask) - plain
    by_hand_m = np.mean([1 - float(F.cosine_similarity(emb3[i, 0], emb3[i, 1], dim=0)) for i in range(6)])
    assert float(got_m) == pytest.approx(by_hand_m, rel=1e-5)
