"""Record-level DP-SGD (strategies.mechanisms.dp_sgd): per-sample gradients, clipping, noise,
Poisson sampling, the update itself, refusal of Cox models, and private training."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from models.survival import RISK_LAYERS, build_survival_model
from models.time_grid import make_time_grid
from strategies.mechanisms.dp_sgd_training import (
    DecomposabilityError,
    clip_per_sample,
    clipped_sum_ghost,
    dp_sgd_step,
    flatten_per_sample,
    hazard_per_sample_loss_fn,
    noisy_sum,
    per_sample_gradients,
    per_sample_gradients_opacus,
    poisson_batches,
    train_epochs_dp,
)

BACKENDS = ["ghost", "torch_func", "opacus"]


def _flchain_like(n=1500, p=19, seed=0):
    """Synthetic cohort shaped like FLCHAIN: 19 standardised features, Weibull-ish times in days
    up to ~5000 with a proportional-hazards signal, uniform censoring, about half deaths."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)).astype(np.float32)
    beta = np.zeros(p)
    beta[:5] = [0.9, 0.6, -0.5, 0.4, 0.3]
    t_event = 4000.0 * rng.weibull(1.5, size=n) * np.exp(-(x @ beta) / 1.5)
    t_censor = rng.uniform(1000.0, 5200.0, size=n)
    time = np.minimum(t_event, t_censor)
    event = (t_event <= t_censor).astype(np.int64)
    return x, time, event


@pytest.fixture(scope="module")
def data():
    return _flchain_like()


def _hazard(data, seed=0, dtype=torch.float32, num_durations=20, risk_layer="interval"):
    x, time, event = data
    cuts = make_time_grid(time, event, num_durations=num_durations)
    model = build_survival_model("hazard_mlp", in_features=x.shape[1], cuts=cuts, seed=seed, risk_layer=risk_layer)
    model.net.to(dtype)
    return model


def _batch(data, size=64, dtype=torch.float32, start=0):
    x, time, event = data
    sl = slice(start, start + size)
    return (torch.tensor(x[sl], dtype=dtype), torch.tensor(time[sl]), torch.tensor(event[sl], dtype=torch.float32))


def _loop_gradients(model, x, time, event):
    """Reference: one ordinary backward pass per record."""
    out = {name: [] for name, _ in model.net.named_parameters()}
    for i in range(x.shape[0]):
        model.net.zero_grad(set_to_none=True)
        model.per_sample_loss(x[i : i + 1], time[i : i + 1], event[i : i + 1]).sum().backward()
        for name, p in model.net.named_parameters():
            out[name].append(p.grad.detach().clone())
    model.net.zero_grad(set_to_none=True)
    return {name: torch.stack(g) for name, g in out.items()}


# --------------------------------------------------------------------------- per-sample gradients


def test_per_sample_loss_fn_matches_model_including_ties_and_times_beyond_last_cut(data):
    model = _hazard(data, dtype=torch.float64)
    x, time, event = _batch(data, 40, torch.float64)
    cuts = torch.from_numpy(model.cuts)
    time[:4] = cuts[[0, 3, 7, -1]]  # exactly on cut points
    time[4:6] = cuts[-1] + 10.0  # beyond the grid: censored at the last interval
    event[:6] = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    loss_fn = hazard_per_sample_loss_fn(model)
    params = dict(model.net.named_parameters())
    ours = torch.stack([loss_fn(params, x[i], time[i], event[i]) for i in range(x.shape[0])])
    torch.testing.assert_close(ours, model.per_sample_loss(x, time, event), rtol=0, atol=1e-12)


@pytest.mark.parametrize("risk_layer", RISK_LAYERS)
def test_torch_func_per_sample_gradients_equal_a_loop_of_single_record_backward_passes(data, risk_layer):
    model = _hazard(data, dtype=torch.float64, risk_layer=risk_layer)
    x, time, event = _batch(data, 32, torch.float64)
    grads, losses = per_sample_gradients(model.net, hazard_per_sample_loss_fn(model), x, time, event, return_loss=True)
    reference = _loop_gradients(model, x, time, event)
    assert list(grads) == list(reference)
    for name in reference:
        assert grads[name].shape == (32, *dict(model.net.named_parameters())[name].shape)
        torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=1e-6)
    torch.testing.assert_close(losses, model.per_sample_loss(x, time, event).detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("risk_layer", RISK_LAYERS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-6), (torch.float32, 1e-6)])
def test_opacus_and_ghost_agree_with_torch_func(data, dtype, atol, risk_layer):
    """Also for the proportional net, whose interval baselines the ghost plan takes as a bias-only layer."""
    model = _hazard(data, dtype=dtype, risk_layer=risk_layer)
    x, time, event = _batch(data, 64, dtype)
    ref = per_sample_gradients(model.net, hazard_per_sample_loss_fn(model), x, time, event)
    scale = max(g.abs().max().item() for g in ref.values())
    opacus, _ = per_sample_gradients_opacus(model, x, time, event)
    for name in ref:  # float32: agreement relative to the gradients' scale
        torch.testing.assert_close(opacus[name], ref[name], rtol=0, atol=atol * max(1.0, scale))
    for clip_norm in (0.1, 1.0, 1e6):
        clipped, norms = clip_per_sample(ref, clip_norm=clip_norm)
        summed, ghost_norms, _, per_sample = clipped_sum_ghost(model, x, time, event, clip_norm=clip_norm)
        torch.testing.assert_close(ghost_norms, norms, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=atol)
        flat = flatten_per_sample(clipped)
        torch.testing.assert_close(per_sample.gradients(), flat, rtol=0, atol=atol * max(1.0, scale))
        gram = flat.double() @ flat.double().T  # the factored Gram matrix equals the materialised one
        # float32: both carry round-off of the order of the largest entries (1e-7 of them against float64), so
        # entries near zero are compared to that scale
        gram_atol = 1e-6 * max(1.0, scale ** 2, gram.abs().max().item() if dtype == torch.float32 else 0.0)
        torch.testing.assert_close(per_sample.gram(), gram, rtol=1e-5, atol=gram_atol)
        torch.testing.assert_close(per_sample.gram(5), gram[:5, :5], rtol=1e-5, atol=gram_atol)
        for name in ref:
            torch.testing.assert_close(summed[name], clipped[name].sum(0), rtol=1e-5, atol=atol * max(1.0, scale))
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.net.parameters())


def test_empty_batch_gives_empty_per_sample_gradients(data):
    model = _hazard(data)
    x, time, event = _batch(data, 0)
    grads = per_sample_gradients(model.net, hazard_per_sample_loss_fn(model), x, time, event)
    assert all(g.shape[0] == 0 for g in grads.values())


# --------------------------------------------------------------------------- clipping and noise


def test_clipped_norms_are_at_most_c_and_small_gradients_are_unchanged(data):
    model = _hazard(data)
    x, time, event = _batch(data, 64)
    grads = per_sample_gradients(model.net, hazard_per_sample_loss_fn(model), x, time, event)
    grads = {name: g.double() for name, g in grads.items()}
    raw_norms = flatten_per_sample(grads).norm(dim=1)
    middle = raw_norms.sort().values[31:33]
    clip_norm = float(middle.mean())  # half the records above C, half below, none at C
    clipped, norms = clip_per_sample(grads, clip_norm=clip_norm)
    torch.testing.assert_close(norms, raw_norms)
    new_norms = flatten_per_sample(clipped).norm(dim=1)
    assert torch.all(new_norms <= clip_norm * (1 + 1e-12))
    above = raw_norms > clip_norm
    assert 0 < above.sum() < 64
    torch.testing.assert_close(new_norms[above], torch.full_like(new_norms[above], clip_norm))
    assert torch.equal(flatten_per_sample(clipped)[~above], flatten_per_sample(grads)[~above])
    # direction preserved, zero gradient stays zero (no 0/0)
    cos = (flatten_per_sample(clipped) * flatten_per_sample(grads)).sum(1) / (new_norms * raw_norms)
    torch.testing.assert_close(cos, torch.ones_like(cos))
    zero_clipped, zero_norms = clip_per_sample({"w": torch.zeros(3, 4)}, clip_norm=1.0)
    assert torch.equal(zero_clipped["w"], torch.zeros(3, 4)) and torch.equal(zero_norms, torch.zeros(3))


def test_noise_on_the_sum_has_std_sigma_c():
    sigma, clip_norm = 1.3, 0.7
    clipped = {"w": torch.zeros(5, 400, 250, dtype=torch.float64), "b": torch.ones(5, 3, dtype=torch.float64)}
    out = noisy_sum(clipped, noise_multiplier=sigma, clip_norm=clip_norm, generator=torch.Generator().manual_seed(1))
    noise = out["w"].flatten()
    assert abs(noise.mean().item()) < 5 * sigma * clip_norm / math.sqrt(noise.numel())
    assert noise.std().item() == pytest.approx(sigma * clip_norm, rel=0.01)  # 100k draws: sd of std ~0.2%
    # no noise: the plain sum over the batch
    exact = noisy_sum(clipped, noise_multiplier=0.0, clip_norm=clip_norm, generator=torch.Generator())
    assert torch.equal(exact["b"], torch.full((3,), 5.0, dtype=torch.float64))
    # empty batch: noise alone
    empty = noisy_sum({"w": torch.zeros(0, 50_000)}, noise_multiplier=2.0, clip_norm=1.0,
                      generator=torch.Generator().manual_seed(2))
    assert empty["w"].shape == (50_000,) and empty["w"].std().item() == pytest.approx(2.0, rel=0.02)


def test_privacy_parameters_are_keyword_only_and_validated():
    grads = {"w": torch.ones(2, 3)}
    with pytest.raises(TypeError):
        clip_per_sample(grads, 1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_norm"):
            clip_per_sample(grads, clip_norm=bad)
    with pytest.raises(ValueError, match="noise_multiplier"):
        noisy_sum(grads, noise_multiplier=-0.1, clip_norm=1.0, generator=torch.Generator())
    with pytest.raises(TypeError, match="generator"):
        noisy_sum(grads, noise_multiplier=1.0, clip_norm=1.0, generator=None)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="sample_rate"):
            list(poisson_batches(10, sample_rate=bad, steps=1, generator=torch.Generator()))
    with pytest.raises(ValueError, match="steps"):
        list(poisson_batches(10, sample_rate=0.5, steps=-1, generator=torch.Generator()))


# --------------------------------------------------------------------------- Poisson sampling


def test_poisson_batches_have_mean_size_qn_and_include_records_independently():
    n, q, steps = 400, 0.05, 4000
    batches = list(poisson_batches(n, sample_rate=q, steps=steps, generator=torch.Generator().manual_seed(0)))
    assert len(batches) == steps
    sizes = torch.tensor([b.numel() for b in batches], dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(q * n, abs=5 * math.sqrt(n * q * (1 - q) / steps))
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.1)  # binomial, not fixed size
    member = torch.zeros(steps, n)
    for t, b in enumerate(batches):
        assert torch.equal(b, torch.unique(b))  # sorted, no duplicates
        member[t, b] = 1.0
    # every position is included at rate q: no dependence on where a record sits in the data
    per_record = member.mean(0)
    sd = math.sqrt(q * (1 - q) / steps)
    assert (per_record - q).abs().max().item() < 5 * sd
    first, second = per_record[: n // 2].mean().item(), per_record[n // 2 :].mean().item()
    assert abs(first - second) < 5 * sd * math.sqrt(4 / n)
    # pairs are included jointly at rate q^2 (independent records), consecutive steps independent
    joint = (member.T @ member / steps)[~torch.eye(n, dtype=torch.bool)].mean().item()
    assert joint == pytest.approx(q * q, rel=0.05)
    lag_corr = np.corrcoef(sizes[:-1].numpy(), sizes[1:].numpy())[0, 1]
    assert abs(lag_corr) < 5 / math.sqrt(steps)


def test_poisson_batches_allow_empty_batches_and_are_reproducible():
    batches = list(poisson_batches(10, sample_rate=0.05, steps=200, generator=torch.Generator().manual_seed(3)))
    assert sum(b.numel() == 0 for b in batches) > 50  # P(empty) = 0.95^10 ~ 0.6
    again = list(poisson_batches(10, sample_rate=0.05, steps=200, generator=torch.Generator().manual_seed(3)))
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    full = list(poisson_batches(7, sample_rate=1.0, steps=3, generator=torch.Generator()))
    assert all(torch.equal(b, torch.arange(7)) for b in full)


# --------------------------------------------------------------------------- the update


@pytest.mark.parametrize("backend", BACKENDS)
def test_noiseless_unclipped_full_batch_step_equals_an_ordinary_sgd_step(data, backend):
    x, time, event = _batch(data, 50, torch.float64)
    dp_model, plain_model = _hazard(data, dtype=torch.float64), _hazard(data, dtype=torch.float64)
    dp_opt = torch.optim.SGD(dp_model.net.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain_model.net.parameters(), lr=0.1)
    stats = dp_sgd_step(
        dp_model, dp_opt, x, time, event, noise_multiplier=0.0, clip_norm=1e12,
        expected_batch_size=1.0 * x.shape[0], generator=torch.Generator().manual_seed(0), backend=backend,
    )
    plain_opt.zero_grad()
    loss = plain_model.loss(x, time, event)
    loss.backward()
    plain_opt.step()
    for (name, p_dp), (_, p_plain) in zip(dp_model.net.named_parameters(), plain_model.net.named_parameters()):
        torch.testing.assert_close(p_dp, p_plain, rtol=0, atol=1e-10, msg=name)
    assert stats["batch_size"] == 50 and stats["num_clipped"] == 0
    assert stats["loss_sum"] == pytest.approx(50 * loss.item(), rel=1e-12)


def test_step_divides_by_the_expected_not_the_realised_batch_size(data):
    x, time, event = _batch(data, 20, torch.float64)
    grads = {}
    for expected in (20.0, 40.0):
        model = _hazard(data, dtype=torch.float64)
        opt = torch.optim.SGD(model.net.parameters(), lr=0.0)  # keep the gradient, no move
        dp_sgd_step(model, opt, x, time, event, noise_multiplier=0.0, clip_norm=1e12,
                    expected_batch_size=expected, generator=torch.Generator())
        grads[expected] = torch.cat([p.grad.flatten() for p in model.net.parameters()])
    torch.testing.assert_close(grads[40.0], grads[20.0] / 2)


def test_empty_batch_step_still_adds_noise(data):
    x, time, event = _batch(data, 0)
    for sigma, moves in ((1.0, True), (0.0, False)):
        model = _hazard(data)
        before = [p.detach().clone() for p in model.net.parameters()]
        opt = torch.optim.SGD(model.net.parameters(), lr=0.1)
        stats = dp_sgd_step(model, opt, x, time, event, noise_multiplier=sigma, clip_norm=1.0,
                            expected_batch_size=5.0, generator=torch.Generator().manual_seed(0))
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.net.parameters()))
        assert changed is moves and stats["batch_size"] == 0


@pytest.mark.parametrize("risk_layer", RISK_LAYERS)
def test_backends_give_the_same_noisy_update(data, risk_layer):
    x, time, event = _batch(data, 64)
    params = {}
    for backend in BACKENDS:
        model = _hazard(data, risk_layer=risk_layer)
        opt = torch.optim.SGD(model.net.parameters(), lr=0.05)
        dp_sgd_step(model, opt, x, time, event, noise_multiplier=1.0, clip_norm=0.5, expected_batch_size=64.0,
                    generator=torch.Generator().manual_seed(7), backend=backend)
        params[backend] = torch.cat([p.detach().flatten() for p in model.net.parameters()])
    torch.testing.assert_close(params["ghost"], params["torch_func"], rtol=0, atol=1e-6)
    torch.testing.assert_close(params["opacus"], params["torch_func"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["ghost", "torch_func"])
def test_on_step_receives_the_clipped_per_sample_gradients(data, backend):
    model = _hazard(data)
    x, time, event = _batch(data, 24)
    reference, _ = clip_per_sample(
        per_sample_gradients(model.net, hazard_per_sample_loss_fn(model), x, time, event), clip_norm=0.5
    )
    seen = []
    dp_sgd_step(model, torch.optim.SGD(model.net.parameters(), lr=0.1), x, time, event, noise_multiplier=1.0,
                clip_norm=0.5, expected_batch_size=24.0, generator=torch.Generator(), backend=backend,
                on_step=seen.append)
    flat = flatten_per_sample(reference)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0].gradients(), flat, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(seen[0].clipped_norms(), flat.norm(dim=1), rtol=1e-5, atol=1e-7)
    assert torch.all(seen[0].clipped_norms() <= 0.5 * (1 + 1e-5))
    gram = seen[0].gram(16)
    assert gram.shape == (16, 16) and gram.dtype == torch.float64
    torch.testing.assert_close(gram, flat[:16].double() @ flat[:16].double().T, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- Cox refused


@pytest.mark.parametrize("kind", ["cox_mlp", "cox_time"])
def test_cox_models_are_refused_because_their_loss_is_not_per_sample_decomposable(data, kind):
    x, time, event = data
    model = build_survival_model(kind, in_features=x.shape[1], cuts=np.linspace(0, time.max(), 10), seed=0)
    with pytest.raises(DecomposabilityError, match="not per-sample decomposable"):
        train_epochs_dp(model, x, time, event, epochs=1, batch_size=32, lr=1e-3, seed=0,
                        noise_multiplier=1.0, clip_norm=1.0)
    xb, tb, eb = _batch(data, 8)
    with pytest.raises(DecomposabilityError, match="decomposable"):
        dp_sgd_step(model, torch.optim.SGD(model.net.parameters(), lr=0.1), xb, tb, eb, noise_multiplier=1.0,
                    clip_norm=1.0, expected_batch_size=8.0, generator=torch.Generator())
    assert issubclass(DecomposabilityError, ValueError)


# --------------------------------------------------------------------------- training


def _mean_loss(model, data):
    x, time, event = data
    with torch.no_grad():
        return model.loss(torch.from_numpy(x), torch.from_numpy(time), torch.from_numpy(event).float()).item()


def test_training_with_moderate_noise_still_lowers_the_loss(data):
    x, time, event = data
    clipped_only = _hazard(data)
    before = _mean_loss(clipped_only, data)
    train_epochs_dp(clipped_only, x, time, event, epochs=4, batch_size=64, lr=1e-3, seed=0,
                    noise_multiplier=0.0, clip_norm=1.0)
    noise_free_gain = before - _mean_loss(clipped_only, data)
    model = _hazard(data)
    out = train_epochs_dp(model, x, time, event, epochs=4, batch_size=64, lr=1e-3, seed=0,
                          noise_multiplier=1.0, clip_norm=1.0)
    gain = before - _mean_loss(model, data)
    # σ = 1 on batches of ~64: most of the noise-free (clipped) improvement survives
    assert noise_free_gain > 0.05 * before and gain > 0.75 * noise_free_gain, (before, noise_free_gain, gain)
    assert set(out) == {"loss", "num_steps", "sample_rate", "noise_multiplier", "clip_norm", "mean_clip_fraction"}
    assert out["sample_rate"] == pytest.approx(64 / 1500)
    assert out["num_steps"] == round(4 / (64 / 1500))
    assert out["noise_multiplier"] == 1.0 and out["clip_norm"] == 1.0
    assert 0.0 <= out["mean_clip_fraction"] <= 1.0 and math.isfinite(out["loss"])


def test_training_is_deterministic_per_seed(data):
    x, time, event = data
    small = (x[:300], time[:300], event[:300])
    states = []
    for seed in (5, 5, 6):
        model = _hazard(data)
        train_epochs_dp(model, *small, epochs=1, batch_size=32, lr=1e-3, seed=seed, noise_multiplier=1.0,
                        clip_norm=1.0)
        states.append(torch.cat([p.detach().flatten() for p in model.net.parameters()]))
    assert torch.equal(states[0], states[1])
    assert not torch.equal(states[0], states[2])


def test_training_restores_the_global_rng_and_records_the_clip_fraction(data):
    x, time, event = data
    state = torch.get_rng_state()
    model = _hazard(data)
    out = train_epochs_dp(model, x[:200], time[:200], event[:200], epochs=1, batch_size=20, lr=1e-3, seed=0,
                          noise_multiplier=0.5, clip_norm=1e-6)
    assert torch.equal(torch.get_rng_state(), state)
    assert out["mean_clip_fraction"] == 1.0  # every gradient is larger than a tiny C
    with pytest.raises(ValueError, match="first cut"):
        train_epochs_dp(model, x[:5], -np.ones(5), event[:5], epochs=1, batch_size=2, lr=1e-3, seed=0,
                        noise_multiplier=1.0, clip_norm=1.0)


def test_ghost_falls_back_for_nets_that_are_not_a_linear_chain(data):
    x, time, event = data
    model = _hazard(data)
    model.net.layers = nn.Sequential(nn.Linear(19, 8), nn.LayerNorm(8), nn.Linear(8, model.cuts.size))
    out = train_epochs_dp(model, x[:100], time[:100], event[:100], epochs=1, batch_size=20, lr=1e-3, seed=0,
                          noise_multiplier=1.0, clip_norm=1.0)
    assert out["num_steps"] == 5
    xb, tb, eb = _batch(data, 4)
    with pytest.raises(ValueError, match="Linear"):
        clipped_sum_ghost(model, xb, tb, eb, clip_norm=1.0)


def test_a_sites_calibrations_survive_in_its_node_state_and_are_not_redone(monkeypatch):
    """A deployed site handles each message in a new process: σ kept as JSON in its node state comes back exactly."""
    from strategies.mechanisms import dp_sgd

    import json
    import threading

    kwargs = dict(epsilon=1.0, delta=1e-5, sample_rate=512 / 1260, steps=140, accountant="pld",
                  prior=((7.38, 1.0, 1),))
    dp_sgd.remember_noise(None)  # a message starts
    sigma = dp_sgd.calibrated_noise_multiplier(**kwargs)
    other = threading.Thread(target=dp_sgd.calibrated_noise_multiplier,  # another simulated site's message
                             kwargs={**kwargs, "sample_rate": 0.5})
    other.start()
    other.join()
    kept = dp_sgd.remembered_noise()
    assert len(json.loads(kept)) == 1  # only what this message used goes into this site's state
    monkeypatch.setattr(dp_sgd, "_NOISE", {})  # a new process
    monkeypatch.setattr(dp_sgd, "calibrate_noise_multiplier", lambda **_: pytest.fail("calibrated again"))
    dp_sgd.remember_noise(kept)
    assert dp_sgd.calibrated_noise_multiplier(**kwargs) == sigma
    assert dp_sgd.calibrated_noise_multiplier(**{**kwargs, "prior": [[7.38, 1.0, 1]]}) == sigma  # the same inputs
