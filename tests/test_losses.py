"""Losses against pycox, scikit-survival and closed forms."""

import numpy as np
import pytest
import torch
from pycox.models.data import pair_rank_mat
from pycox.models.loss import DeepHitSingleLoss, cox_cc_loss, cox_cc_loss_single_ctrl, nll_logistic_hazard
from pycox.models.loss import cox_ph_loss as pycox_cox_ph_loss
from sksurv.linear_model import CoxPHSurvivalAnalysis
from sksurv.util import Surv

from models.losses import cox_ph_loss, cox_time_loss, deephit_loss, logistic_hazard_nll, sample_risk_set_controls


def _hazard_batch(n=64, num_intervals=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, num_intervals, generator=g, dtype=torch.float64)
    idx = torch.randint(0, num_intervals, (n,), generator=g)
    events = torch.randint(0, 2, (n,), generator=g).to(torch.float64)
    return logits, idx, events


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_logistic_hazard_nll_matches_pycox(reduction):
    logits, idx, events = _hazard_batch()
    ours = logistic_hazard_nll(logits, idx, events, reduction=reduction)
    ref = nll_logistic_hazard(logits, idx, events, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_logistic_hazard_nll_closed_form():
    logits, idx, events = _hazard_batch(n=20, num_intervals=5, seed=1)
    h = torch.sigmoid(logits)
    expected = []
    for i in range(20):
        k = int(idx[i])
        survived = -torch.log1p(-h[i, :k]).sum()
        last = -(torch.log(h[i, k]) if events[i] == 1 else torch.log1p(-h[i, k]))
        expected.append(survived + last)
    torch.testing.assert_close(logistic_hazard_nll(logits, idx, events, "none"), torch.stack(expected))


def test_logistic_hazard_nll_is_per_sample_decomposable():
    logits, idx, events = _hazard_batch(n=8, num_intervals=6, seed=2)
    jac = torch.autograd.functional.jacobian(lambda z: logistic_hazard_nll(z, idx, events, "none"), logits)
    # d loss_i / d logits_j == 0 for i != j: one record's loss sees only its own output row
    off_diagonal = jac.sum(dim=2) * (1 - torch.eye(8, dtype=jac.dtype))
    assert torch.count_nonzero(off_diagonal) == 0
    assert torch.all(jac.sum(dim=2).diagonal().abs() > 0)


def test_logistic_hazard_nll_validates():
    logits, idx, events = _hazard_batch(n=4, num_intervals=3)
    with pytest.raises(ValueError, match="reduction"):
        logistic_hazard_nll(logits, idx, events, reduction="avg")
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        logistic_hazard_nll(logits, idx + 3, events)
    with pytest.raises(TypeError):
        logistic_hazard_nll(logits, idx.to(torch.int32), events)


def _breslow_double_loop(g, time, event):
    total = 0.0
    for i in range(len(g)):
        if event[i]:
            at_risk = time >= time[i]
            total += g[i] - np.log(np.exp(g[at_risk]).sum())
    return -total / max(1, event.sum())


def test_cox_ph_loss_matches_pycox_without_ties():
    rng = np.random.default_rng(0)
    g = torch.tensor(rng.normal(size=200))
    time = torch.tensor(rng.permutation(200).astype(np.float64))
    event = torch.tensor(rng.integers(0, 2, 200).astype(np.float64))
    ref = pycox_cox_ph_loss(g, time, event)  # pycox adds eps=1e-7 inside the log
    torch.testing.assert_close(cox_ph_loss(g, time, event), ref, rtol=1e-6, atol=1e-6)


def test_cox_ph_loss_breslow_ties_closed_form():
    rng = np.random.default_rng(1)
    g = rng.normal(size=150)
    time = rng.integers(0, 15, 150).astype(np.float64)  # heavy ties
    event = rng.integers(0, 2, 150)
    ours = cox_ph_loss(torch.tensor(g), torch.tensor(time), torch.tensor(event))
    assert ours.item() == pytest.approx(_breslow_double_loop(g, time, event), rel=1e-12)


def test_cox_ph_loss_minimiser_is_sksurv_breslow_fit():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 3))
    time = np.ceil(rng.exponential(np.exp(-x @ np.array([0.8, -0.5, 0.3]))) * 4)  # tied times
    event = rng.uniform(size=300) < 0.7
    ref = CoxPHSurvivalAnalysis(ties="breslow").fit(x, Surv.from_arrays(event, time)).coef_
    beta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    xt, tt, et = torch.tensor(x), torch.tensor(time), torch.tensor(event.astype(np.float64))
    opt = torch.optim.LBFGS([beta], max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure():
        opt.zero_grad()
        loss = cox_ph_loss(xt @ beta, tt, et)
        loss.backward()
        return loss

    opt.step(closure)
    np.testing.assert_allclose(beta.detach().numpy(), ref, atol=1e-5)
    efron = CoxPHSurvivalAnalysis(ties="efron").fit(x, Surv.from_arrays(event, time)).coef_
    assert np.abs(beta.detach().numpy() - efron).max() > 1e-3  # the ties really matter here


def test_cox_ph_loss_without_events_is_penalty_only_with_zero_likelihood_gradient():
    g = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    time, event = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3)
    loss = cox_ph_loss(g, time, event)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(g.grad, torch.zeros(3))
    penalised = cox_ph_loss(g, time, event, penalty=0.5)
    assert penalised.item() == pytest.approx(0.5 * (0.3 + 1.2 + 2.0) / 3)


def test_cox_ph_loss_penalty_and_invariances():
    rng = np.random.default_rng(3)
    g = torch.tensor(rng.normal(size=50))
    time = torch.tensor(rng.integers(0, 10, 50).astype(np.float64))
    event = torch.tensor(rng.integers(0, 2, 50).astype(np.float64))
    base = cox_ph_loss(g, time, event)
    assert cox_ph_loss(g, time, event, penalty=0.2).item() == pytest.approx(base.item() + 0.2 * g.abs().mean().item())
    assert cox_ph_loss(g + 3.0, time, event).item() == pytest.approx(base.item())  # shift-invariant
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    assert cox_ph_loss(g[perm], time[perm], event[perm]).item() == pytest.approx(base.item())
    with pytest.raises(ValueError):
        cox_ph_loss(g, time[:-1], event)
    with pytest.raises(ValueError):
        cox_ph_loss(g, time, event, penalty=-1.0)


def test_cox_time_loss_matches_pycox_cox_cc_loss():
    gen = torch.Generator().manual_seed(4)
    g_case = torch.randn(40, generator=gen, dtype=torch.float64)
    controls = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    ref = cox_cc_loss(g_case, list(controls.T), shrink=0.1)
    torch.testing.assert_close(cox_time_loss(g_case, controls, penalty=0.1), ref)
    single = cox_cc_loss_single_ctrl(g_case, controls[:, 0], shrink=0.1)
    torch.testing.assert_close(cox_time_loss(g_case, controls[:, 0], penalty=0.1), single)


def test_cox_time_loss_without_cases_is_zero_and_differentiable():
    g = torch.zeros(0, requires_grad=True)
    loss = cox_time_loss(g * 2, g * 3)
    loss.backward()
    assert loss.item() == 0.0


def test_sample_risk_set_controls_draws_uniformly_from_risk_set():
    time = torch.tensor([3.0, 1.0, 2.0, 2.0, 5.0, 4.0])
    event = torch.tensor([1, 1, 0, 1, 0, 0])
    gen = torch.Generator().manual_seed(0)
    draws = 6000
    counts = {i: np.zeros(6) for i in (0, 1, 3)}
    for _ in range(draws):
        case, control = sample_risk_set_controls(time, event, gen)
        assert case.tolist() == [0, 1, 3]
        assert torch.all(time[control] >= time[case])
        for c, j in zip(case.tolist(), control.tolist()):
            counts[c][j] += 1
    for c in (0, 1, 3):
        risk_set = (time >= time[c]).numpy()
        freq = counts[c][risk_set] / draws
        np.testing.assert_allclose(freq, 1 / risk_set.sum(), atol=0.03)
    a = sample_risk_set_controls(time, event, torch.Generator().manual_seed(7))
    b = sample_risk_set_controls(time, event, torch.Generator().manual_seed(7))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_deephit_loss_and_gradient_match_pycox_deephit_single_loss(alpha, scale):
    gen = torch.Generator().manual_seed(5)
    logits = (scale * torch.randn(80, 10, generator=gen)).requires_grad_(True)
    idx = torch.randint(0, 10, (80,), generator=gen)  # many tied intervals
    events = torch.randint(0, 2, (80,), generator=gen).to(torch.float32)
    rank_mat = torch.from_numpy(pair_rank_mat(idx.numpy(), events.numpy()))
    ref = DeepHitSingleLoss(alpha, 0.1)(logits, idx, events, rank_mat)
    ours = deephit_loss(logits, idx, events, alpha=alpha, sigma=0.1)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=2e-5)  # float32; pycox adds 1e-7 in its logs
    grad_ref, = torch.autograd.grad(ref, logits)
    grad_ours, = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-4, atol=2e-5)


def test_deephit_loss_validates():
    logits, idx, events = _hazard_batch(n=4, num_intervals=3)
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        deephit_loss(logits, idx + 3, events)
    with pytest.raises(ValueError, match="alpha"):
        deephit_loss(logits, idx, events, alpha=1.5)
    with pytest.raises(TypeError):
        deephit_loss(logits, idx.to(torch.int32), events)
