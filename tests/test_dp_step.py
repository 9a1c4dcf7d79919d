"""The fused ghost-clipping DP-SGD step (``dp_sgd_step(backend="ghost")``) against opacus.

The reference is the textbook recipe on opacus' materialised per-sample gradients
(``GradSampleModule``): clip every record's flat gradient to C, sum, add N(0, σ²C²) drawn
parameter by parameter from the same generator, divide by the expected batch size. The fused step
(one backward to the layer outputs, per-layer norms from two matrix products, noise drawn into
``.grad`` and the clipped sum added with one ``addmm``/``addmv`` per parameter) must give the same
``.grad`` to 1e-6 relative for every hazard MLP the mechanisms train (activations, dropout,
float32/float64), on the first step and on later steps that reuse ``.grad``.
"""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from models.survival import build_survival_model
from models.time_grid import make_time_grid
from strategies.mechanisms.dp_sgd_training import (
    DecomposabilityError,
    clip_per_sample,
    clipped_sum_ghost,
    dp_sgd_step,
    per_sample_gradients_opacus,
)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    n, p = 300, 19
    x = rng.normal(size=(n, p)).astype(np.float32)
    t_event = 4000.0 * rng.weibull(1.5, size=n) * np.exp(-0.5 * x[:, 0])
    t_censor = rng.uniform(1000.0, 5200.0, size=n)
    return x, np.minimum(t_event, t_censor), (t_event <= t_censor).astype(np.float32)


def _model(data, dtype=torch.float64, **net):
    x, time, event = data
    cuts = make_time_grid(time, event, num_durations=15)
    model = build_survival_model("hazard_mlp", in_features=x.shape[1], cuts=cuts, seed=1, **net)
    model.net.to(dtype)
    return model


def _batch(data, size, dtype, start=0):
    x, time, event = data
    sl = slice(start, start + size)
    return torch.tensor(x[sl], dtype=dtype), torch.tensor(time[sl]), torch.tensor(event[sl])


def _reference_grads(model, x, time, event, *, sigma, clip_norm, divisor, generator, seed):
    """(Σ clip(g_i) + σC z) / divisor from opacus' per-sample gradients, z drawn per parameter in order."""
    torch.manual_seed(seed)  # the same dropout masks as the fused step's forward pass
    grads, _ = per_sample_gradients_opacus(model, x, time, event)
    clipped, _ = clip_per_sample(grads, clip_norm=clip_norm)
    out = []
    for name, p in model.net.named_parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=p.dtype) if sigma > 0 else torch.zeros_like(p)
        out.append((clipped[name].sum(0) + sigma * clip_norm * noise) / divisor)
    return torch.cat([g.flatten() for g in out])


def _fused_grads(model, x, time, event, *, sigma, clip_norm, divisor, generator, seed):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.net.parameters(), lr=0.0)  # keep the weights, read .grad
    stats = dp_sgd_step(model, opt, x, time, event, noise_multiplier=sigma, clip_norm=clip_norm,
                        expected_batch_size=divisor, generator=generator, backend="ghost")
    return torch.cat([p.grad.flatten() for p in model.net.parameters()]), stats


def _relative_error(ours, ref):
    return float((ours - ref).norm() / ref.norm())


NETS = [
    pytest.param({}, id="selu"),
    pytest.param({"activation": "elu"}, id="elu"),
    pytest.param({"activation": "relu"}, id="relu"),
    pytest.param({"activation": "tanh", "hidden": (16, 8)}, id="tanh-small"),
    pytest.param({"dropout": 0.2}, id="selu-alphadropout"),
    pytest.param({"activation": "elu", "dropout": 0.3}, id="elu-dropout"),
]


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("clip_norm", [0.05, 1.0, 1e6])
def test_fused_step_equals_opacus_per_sample_clipping(data, net, dtype, tol, clip_norm):
    x, time, event = _batch(data, 48, dtype)
    sigma = 0.7
    ours, stats = _fused_grads(_model(data, dtype, **net), x, time, event, sigma=sigma, clip_norm=clip_norm,
                               divisor=40.0, generator=torch.Generator().manual_seed(5), seed=11)
    ref = _reference_grads(_model(data, dtype, **net), x, time, event, sigma=sigma, clip_norm=clip_norm,
                           divisor=40.0, generator=torch.Generator().manual_seed(5), seed=11)
    assert _relative_error(ours, ref) <= tol
    # the clipped sum alone (no noise), where the noise would hide a clipping error
    ours0, _ = _fused_grads(_model(data, dtype, **net), x, time, event, sigma=0.0, clip_norm=clip_norm,
                            divisor=1.0, generator=torch.Generator(), seed=11)
    ref0 = _reference_grads(_model(data, dtype, **net), x, time, event, sigma=0.0, clip_norm=clip_norm,
                            divisor=1.0, generator=torch.Generator(), seed=11)
    assert _relative_error(ours0, ref0) <= tol
    assert ours0.norm() <= 48 * clip_norm * (1 + 1e-6)
    assert stats["num_clipped"] == (48 if clip_norm == 0.05 else 0 if clip_norm == 1e6 else stats["num_clipped"])


def test_later_steps_reuse_grad_and_continue_the_noise_stream(data):
    """Two steps (weights kept): the second overwrites the first's .grad in place, with the next draws."""
    model, ref_model = _model(data), _model(data)
    generator, ref_generator = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for start in (0, 64):
        x, time, event = _batch(data, 32, torch.float64, start)
        for p in model.net.parameters():  # stale values must not leak into the new gradient
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        ours, _ = _fused_grads(model, x, time, event, sigma=1.3, clip_norm=0.5, divisor=30.0,
                               generator=generator, seed=0)
        ref = _reference_grads(ref_model, x, time, event, sigma=1.3, clip_norm=0.5, divisor=30.0,
                               generator=ref_generator, seed=0)
        assert _relative_error(ours, ref) <= 1e-10
    assert torch.equal(generator.get_state(), ref_generator.get_state())


def test_noiseless_step_draws_nothing_and_empty_batch_gives_noise_alone(data):
    model = _model(data)
    generator = torch.Generator().manual_seed(2)
    state = generator.get_state()
    x, time, event = _batch(data, 16, torch.float64)
    _fused_grads(model, x, time, event, sigma=0.0, clip_norm=1.0, divisor=16.0, generator=generator, seed=0)
    assert torch.equal(generator.get_state(), state)
    x, time, event = _batch(data, 0, torch.float64)
    ours, stats = _fused_grads(model, x, time, event, sigma=2.0, clip_norm=0.5, divisor=8.0,
                               generator=torch.Generator().manual_seed(4), seed=0)
    noise_gen = torch.Generator().manual_seed(4)
    expected = torch.cat([torch.randn(p.shape, generator=noise_gen, dtype=p.dtype).flatten() * 2.0 * 0.5 / 8.0
                          for p in model.net.parameters()])
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=0)
    assert stats["batch_size"] == 0


def test_a_replaced_layer_chain_is_picked_up(data):
    """The per-net plan is rebuilt when ``net.layers`` changes (other widths, no hidden bias)."""
    model, ref_model = _model(data), _model(data)
    x, time, event = _batch(data, 24, torch.float64)
    _fused_grads(model, x, time, event, sigma=1.0, clip_norm=1.0, divisor=24.0, generator=torch.Generator(), seed=0)
    for m in (model, ref_model):
        torch.manual_seed(0)
        m.net.layers = nn.Sequential(nn.Linear(19, 7, bias=False), nn.ELU(), nn.Linear(7, m.cuts.size)).double()
        m.net.layers[0].weight.grad = None
    ours, _ = _fused_grads(model, x, time, event, sigma=1.0, clip_norm=0.3, divisor=24.0,
                           generator=torch.Generator().manual_seed(1), seed=0)
    ref = _reference_grads(ref_model, x, time, event, sigma=1.0, clip_norm=0.3, divisor=24.0,
                           generator=torch.Generator().manual_seed(1), seed=0)
    assert ours.numel() == model.cuts.size + 19 * 7 + 7 * model.cuts.size + model.cuts.size  # baselines first
    assert _relative_error(ours, ref) <= 1e-10


def test_clipped_sum_ghost_equals_opacus_ghost_clipping(data):
    """Our clipped sum against opacus' own ghost clipping (two backward passes), float64."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    x, time, event = _batch(data, 64, torch.float64)
    ours, _, _, _ = clipped_sum_ghost(_model(data), x, time, event, clip_norm=0.2)
    model = _model(data)
    fgc = GradSampleModuleFastGradientClipping(model.net, batch_first=True, loss_reduction="sum",
                                               max_grad_norm=0.2, use_ghost_clipping=True)
    try:
        with warnings.catch_warnings():  # the inputs need no gradient; the hooks still see every layer
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses = model.per_sample_loss(x, time, event)
            losses.sum().backward(retain_graph=True)
            coefficients = fgc.get_clipping_coef()
            model.net.zero_grad(set_to_none=True)
            fgc.disable_hooks()
            (coefficients.detach() * losses).sum().backward()
        ref = torch.cat([p.grad.flatten() for p in model.net.parameters()])
    finally:
        fgc._close()
    # opacus clips with C / (||g_i|| + 1e-6), we with C / max(C, ||g_i||): 1e-6 relative, not float64 round-off
    assert _relative_error(torch.cat([g.flatten() for g in ours.values()]), ref) <= 1e-6


@pytest.mark.parametrize("kind", ["cox_mlp", "cox_time"])
def test_cox_kinds_stay_refused(data, kind):
    """The Cox losses couple the records of a batch (risk sets): no per-record clipping, as before."""
    x, time, _ = data
    model = build_survival_model(kind, in_features=x.shape[1], cuts=np.linspace(0, time.max(), 10), seed=0)
    xb, tb, eb = _batch(data, 8, torch.float32)
    with pytest.raises(DecomposabilityError):
        dp_sgd_step(model, torch.optim.SGD(model.net.parameters(), lr=0.1), xb, tb, eb, noise_multiplier=1.0,
                    clip_norm=1.0, expected_batch_size=8.0, generator=torch.Generator())
