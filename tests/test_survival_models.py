"""Time grid, networks and model wrappers against pycox; training determinism."""

import numpy as np
import pytest
import torch
from pycox.models import CoxPH, CoxTime, LogisticHazard
from pycox.models.loss import nll_logistic_hazard
from pycox.preprocessing.label_transforms import LabTransDiscreteTime
from sksurv.datasets import load_flchain
from sksurv.metrics import concordance_index_censored
from torch import nn

from models.metrics import evaluate_survival
from models.survival import build_survival_model, discretise, restricted_mean_survival_time
from models.time_grid import make_time_grid
from models.training import train_epochs


@pytest.fixture(scope="module")
def flchain_outcomes():
    _, y = load_flchain()
    time, event = y["futime"].astype(np.float64), y["death"].astype(np.int64)
    rng = np.random.default_rng(0)
    train = rng.uniform(size=time.size) < 0.8
    return time[train], event[train], time[~train], event[~train]


@pytest.mark.parametrize("scheme", ["quantiles", "equidistant"])
@pytest.mark.parametrize("num_durations", [10, 20, 57])
def test_grid_and_discretisation_match_pycox(flchain_outcomes, scheme, num_durations):
    t_train, e_train, t_test, e_test = flchain_outcomes
    labtrans = LabTransDiscreteTime(num_durations, scheme=scheme)
    ref_train = labtrans.fit_transform(t_train, e_train)
    cuts = make_time_grid(t_train, e_train, num_durations=num_durations, scheme=scheme)
    np.testing.assert_array_equal(cuts, labtrans.cuts)
    for (idx, ev), (t, e) in [(ref_train, (t_train, e_train)), (labtrans.transform(t_test, e_test), (t_test, e_test))]:
        ours_idx, ours_ev = discretise(t, e, cuts)
        np.testing.assert_array_equal(ours_idx, idx)
        np.testing.assert_array_equal(ours_ev, ev)
        assert ours_idx.dtype == np.int64 and ours_ev.dtype == np.float32


def test_discretise_beyond_last_cut_becomes_censored_and_rejects_bad_input():
    cuts = np.array([0.0, 1.0, 2.0])
    idx, ev = discretise(np.array([0.5, 0.5, 1.0, 1.0, 3.0]), np.array([1, 0, 1, 0, 1]), cuts)
    np.testing.assert_array_equal(idx, [1, 0, 1, 1, 2])
    np.testing.assert_array_equal(ev, [1, 0, 1, 0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        discretise(np.array([-1.0]), np.array([1]), cuts)
    with pytest.raises(ValueError, match="0/1"):
        discretise(np.array([1.0]), np.array([2]), cuts)
    with pytest.raises(ValueError, match="scheme"):
        make_time_grid(np.ones(3), np.ones(3), num_durations=3, scheme="log")


def _synthetic(n=600, p=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)).astype(np.float32)
    risk = x[:, 0] - 0.5 * x[:, 1]
    time = rng.exponential(np.exp(-risk))
    censor = rng.exponential(1.5, size=n)
    return x, np.minimum(time, censor), (time <= censor).astype(np.int64), risk


def test_hazard_mlp_architecture_and_no_batchnorm_by_default():
    cuts = np.linspace(0, 1, 7)
    model = build_survival_model("hazard_mlp", in_features=4, cuts=cuts)
    linears = [m for m in model.net.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (4, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 6)
    ]  # interval 0 (the point {0}) takes interval 1's covariate weights: T - 1 weight rows
    logits = model.net(torch.randn(9, 4)).detach()
    beta = model.net.baseline.detach()
    torch.testing.assert_close(logits[:, 0] - beta[0], logits[:, 1] - beta[1])
    assert sum(isinstance(m, nn.SELU) for m in model.net.modules()) == 5
    dropped = build_survival_model("hazard_mlp", in_features=4, cuts=cuts, dropout=0.2, hidden=(16, 8))
    assert sum(isinstance(m, nn.AlphaDropout) for m in dropped.net.modules()) == 2
    for kind in ("hazard_mlp", "cox_mlp", "cox_time"):
        net = build_survival_model(kind, in_features=4, cuts=cuts).net
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    cox = build_survival_model("cox_mlp", in_features=4, cuts=cuts)
    assert [m for m in cox.net.modules() if isinstance(m, nn.Linear)][-1].bias is None
    assert sum(isinstance(m, nn.Dropout) for m in cox.net.modules()) == 2
    with pytest.raises(ValueError, match="unknown model kind"):
        build_survival_model("deephit", in_features=4, cuts=cuts)
    with pytest.raises(ValueError, match="activation"):
        build_survival_model("cox_mlp", in_features=4, cuts=cuts, activation="swish")


def test_interval_hazard_mlp_ranks_the_first_interval_as_the_second_after_training():
    """Interval 0 is the point {0} of the grid (no event falls in it): its logit keeps interval 1's function of the
    record through training, so S(tau_0) = 1 - h_0(x) orders the records as h_1 does, not at chance."""
    x, time, event, _ = _synthetic()
    cuts = make_time_grid(time, event, num_durations=12)
    assert cuts[0] == 0.0 and not np.any(discretise(time, event, cuts)[1][discretise(time, event, cuts)[0] == 0])
    hazard = np.linspace(0.05, 0.3, cuts.size)
    model = build_survival_model("hazard_mlp", in_features=5, cuts=cuts, hidden=(16,), baseline_hazard=hazard)
    _, surv = model.predict_survival(x)
    np.testing.assert_allclose(surv, np.broadcast_to(np.cumprod(1.0 - hazard), surv.shape), rtol=1e-5)
    train_epochs(model, x, time, event, epochs=5, batch_size=64, lr=0.01, seed=0)
    logits = model.net(torch.from_numpy(x)).detach().double() - model.net.baseline.detach().double()
    torch.testing.assert_close(logits[:, 0], logits[:, 1], rtol=0, atol=1e-6)
    assert logits[:, 1:].std(0).min() > 0  # every later interval learnt a function of the record
    _, surv = model.predict_survival(x)
    assert np.array_equal(np.argsort(surv[:, 0], kind="stable"), np.argsort(-logits[:, 1].numpy(), kind="stable"))


def test_proportional_hazard_mlp_starts_at_the_baseline_and_ranks_records_alike_at_every_time():
    """The discrete logistic model: logit h_j(x) = beta_j + g(x). It starts at the given hazards for every record;
    after training its curves never cross, so Antolini's C_td equals Harrell's C on -RMST."""
    x, time, event, _ = _synthetic()
    cuts = make_time_grid(time, event, num_durations=12)
    hazard = np.linspace(0.05, 0.3, cuts.size)
    model = build_survival_model("hazard_mlp", in_features=5, cuts=cuts, hidden=(16,), risk_layer="proportional",
                                 baseline_hazard=hazard)
    linears = [m for m in model.net.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features, m.bias is None) for m in linears] == [(5, 16, False), (16, 1, True)]
    assert model.net.baseline.shape == (cuts.size,)
    _, surv = model.predict_survival(x)
    np.testing.assert_allclose(surv, np.broadcast_to(np.cumprod(1.0 - hazard), surv.shape), rtol=1e-5)
    train_epochs(model, x, time, event, epochs=5, batch_size=64, lr=0.01, seed=0)
    logits = model.net(torch.from_numpy(x)).detach().double() - model.net.baseline.detach().double()
    torch.testing.assert_close(logits, logits[:, :1].expand_as(logits), rtol=0, atol=1e-6)
    _, surv = model.predict_survival(x)
    order = np.argsort(surv[:, -1])
    assert np.all(np.diff(surv[order], axis=0) >= 0)  # one order of the records at every cut
    metrics = evaluate_survival(*model.predict_survival(x), time=time, event=event, risk=model.risk_score(x))
    assert metrics["c_index"] > 0.6 and metrics["c_index_td"] == pytest.approx(metrics["c_index"], abs=1e-9)
    with pytest.raises(ValueError, match="risk_layer"):
        build_survival_model("cox_mlp", in_features=5, cuts=cuts, risk_layer="proportional")
    with pytest.raises(ValueError, match="risk_layer"):
        build_survival_model("hazard_mlp", in_features=5, cuts=cuts, risk_layer="shared")


def test_seed_fixes_initialisation_and_leaves_global_rng_alone():
    cuts = np.linspace(0, 1, 5)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_survival_model("cox_time", in_features=3, cuts=cuts, seed=5).net.state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    b = build_survival_model("cox_time", in_features=3, cuts=cuts, seed=5).net.state_dict()
    c = build_survival_model("cox_time", in_features=3, cuts=cuts, seed=6).net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_hazard_model_loss_and_survival_match_pycox():
    x, time, event, _ = _synthetic()
    cuts = make_time_grid(time, event, num_durations=15)
    model = build_survival_model("hazard_mlp", in_features=5, cuts=cuts, seed=1)
    idx, ev = discretise(time, event, cuts)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        ref = nll_logistic_hazard(model.net(xt), torch.from_numpy(idx), torch.from_numpy(ev), reduction="none")
        ours = model.per_sample_loss(xt, torch.from_numpy(time), torch.from_numpy(event))
        torch.testing.assert_close(ours, ref)
        torch.testing.assert_close(model.loss(xt, torch.from_numpy(time), torch.from_numpy(event)), ref.mean())
    times, surv = model.predict_survival(x)
    ref_surv = LogisticHazard(model.net, duration_index=cuts).predict_surv(x)
    np.testing.assert_array_equal(times, cuts)
    np.testing.assert_allclose(surv, ref_surv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.risk_score(x), -restricted_mean_survival_time(times, surv))


def test_cox_model_breslow_survival_matches_pycox_coxph():
    x, time, event, _ = _synthetic(seed=1)
    time = np.round(time, 2)
    grid = np.unique(time)
    model = build_survival_model("cox_mlp", in_features=5, cuts=grid, seed=2)
    with pytest.raises(RuntimeError, match="no baseline"):
        model.predict_survival(x)
    model.set_baseline(*model.breslow_aggregates(x, time, event))
    times, surv = model.predict_survival(x[:50])
    ref = CoxPH(model.net)
    ref.compute_baseline_hazards(x, (time.astype(np.float32), event.astype(np.float32)))
    ref_surv = ref.predict_surv_df(x[:50])
    np.testing.assert_allclose(times, ref_surv.index.to_numpy(), rtol=1e-6)
    np.testing.assert_allclose(surv, ref_surv.to_numpy().T, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        model.net.eval()
        np.testing.assert_allclose(model.risk_score(x[:50]), model.net(torch.from_numpy(x[:50])).numpy(), rtol=1e-6)


def test_cox_time_model_breslow_survival_matches_pycox_coxtime():
    x, time, event, _ = _synthetic(n=200, seed=2)
    # no tied times: pycox's CoxTime risk set drops censorings tied with (and sorted before) an event
    time = time.astype(np.float32).astype(np.float64)
    assert np.unique(time).size == time.size
    order = np.argsort(time, kind="stable")
    x, time, event = x[order], time[order], event[order]
    grid = np.unique(time)
    model = build_survival_model("cox_time", in_features=5, cuts=grid, seed=3)  # time_scale (0, 1)
    model.set_baseline(*model.breslow_aggregates(x, time, event))
    times, surv = model.predict_survival(x[:20])
    ref = CoxTime(model.net)
    ref.compute_baseline_hazards(x, (time.astype(np.float32), event.astype(np.float32)))
    ref_surv = ref.predict_surv_df(x[:20])
    np.testing.assert_allclose(ref_surv.index.to_numpy(), times, rtol=1e-6)
    np.testing.assert_allclose(surv, ref_surv.to_numpy().T, rtol=1e-4, atol=1e-6)


def test_cox_time_survival_in_row_blocks_equals_direct_evaluation():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1000, 3)).astype(np.float32)
    grid = np.linspace(0.0, 5.0, 1100)  # 1.1M evaluations: more than one row block
    model = build_survival_model("cox_time", in_features=3, cuts=grid, time_scale=(2.5, 1.5), seed=0)
    increments = rng.uniform(0, 0.002, grid.size)
    model.set_baseline(increments, np.ones(grid.size))
    _, surv = model.predict_survival(x)
    model.net.eval()
    cols = [0, 550, 1099]
    with torch.no_grad():
        g = np.stack([
            model.net(torch.from_numpy(x), torch.full((1000,), (t - 2.5) / 1.5)).double().numpy() for t in grid
        ], axis=1)
    expected = np.exp(-np.cumsum(increments * np.exp(g), axis=1))
    np.testing.assert_allclose(surv[:, cols], expected[:, cols], rtol=1e-6)


def test_predictions_are_valid_curves_and_restore_training_mode():
    x, time, event, _ = _synthetic(n=300)
    cuts = make_time_grid(time, event, num_durations=20)
    for kind in ("hazard_mlp", "cox_mlp", "cox_time"):
        model = build_survival_model(kind, in_features=5, cuts=cuts, dropout=0.3, time_scale=(1.0, 1.0))
        if model.needs_baseline:
            model.set_baseline(*model.breslow_aggregates(x, time, event))
        model.net.train()
        times, surv = model.predict_survival(x)
        assert model.net.training
        assert surv.shape == (300, times.size) and np.all((surv >= 0) & (surv <= 1))
        assert np.all(np.diff(surv, axis=1) <= 1e-12)
        np.testing.assert_array_equal(surv, model.predict_survival(x)[1])  # eval mode: no dropout noise
        assert model.risk_score(x).shape == (300,)
        together = model.predict(x)  # the curves predicted once: the same arrays as the two calls
        for got, expected in zip(together, (times, surv, model.risk_score(x)), strict=True):
            np.testing.assert_array_equal(got, expected)
        assert model.net.training
    with pytest.raises(ValueError, match="shape"):
        model.predict_survival(x[:, :3])


@pytest.mark.parametrize("kind", ["hazard_mlp", "cox_mlp", "cox_time"])
def test_training_is_deterministic_and_learns_the_true_ranking(kind):
    x, time, event, risk = _synthetic(n=800, seed=4)
    cuts = make_time_grid(time, event, num_durations=20)

    def fit(seed):
        model = build_survival_model(kind, in_features=5, cuts=cuts, time_scale=(time.mean(), time.std()), seed=0)
        info = train_epochs(model, x, time, event, epochs=8, batch_size=64, lr=3e-3, seed=seed)
        return model, info

    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    model_a, info_a = fit(seed=1)
    assert torch.equal(torch.rand(1), expected_next)  # global RNG untouched
    model_b, info_b = fit(seed=1)
    model_c, _ = fit(seed=2)
    state_a, state_b, state_c = (m.net.state_dict() for m in (model_a, model_b, model_c))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    assert info_a == info_b and info_a["num_steps"] == 8 * 13 and np.isfinite(info_a["loss"])
    if model_a.needs_baseline:
        model_a.set_baseline(*model_a.breslow_aggregates(x, time, event))
    c_model = concordance_index_censored(event.astype(bool), time, model_a.risk_score(x))[0]
    c_true = concordance_index_censored(event.astype(bool), time, risk)[0]
    assert c_model > c_true - 0.03


def test_hazard_loss_rejects_times_before_first_cut():
    model = build_survival_model("hazard_mlp", in_features=2, cuts=np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="first cut"):
        model.loss(torch.zeros(2, 2), torch.tensor([0.5, 2.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        model.loss(torch.zeros(2, 3), torch.tensor([1.5, 2.0]), torch.tensor([0.0, 1.0]))


def test_restricted_mean_survival_time_closed_form():
    times = np.array([0.0, 1.0, 3.0, 4.0])
    surv = np.array([[1.0, 0.5, 0.25, 0.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(restricted_mean_survival_time(times, surv), [1.0 + 1.0 + 0.25, 4.0])
