"""Tests of models.multimodal: encoders, attention fusion, BayesianMultisurv / MultiSurv, BVFLMSP loss."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sksurv.metrics import concordance_index_censored
from torch import nn

from models.bayesian import BayesianLinear, kl_divergence, posterior_mean, seeded
from models.losses import logistic_hazard_nll
from models.multimodal import (
    HEAD_SEED_NAME,
    AttentionFusion,
    BayesianClinicalNet,
    BayesianFC,
    BayesianMultisurv,
    FusionHead,
    MultiSurv,
    build_encoder,
    build_multisurv,
    bvflmsp_loss,
    hidden_width,
    part_seed,
    survival_band,
)
from models.multimodal_training import predict_multisurv
from models.survival import discretise

# --------------------------------------------------------------------------- encoders
from models.time_grid import make_time_grid

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
    kinds = [type(m).__name__ for m in BayesianFC(200, 64, 2, batch_norm=False).layers]
    assert kinds == ["BayesianLinear", "ReLU", "Dropout"] * 2 + ["BayesianLinear"]


@pytest.mark.parametrize("cardinalities", [(), (3, 2)])
def test_encoders_map_each_record_alone_in_training_mode(cardinalities: tuple[int, ...]) -> None:
    """Released path: an encoder's output row i depends on input row i alone, also in train mode.

    No normalisation across the batch (batch norm), so one record's features cannot move another
    record's embedding: checked by changing one input row under the same posterior draw and
    dropout masks, and structurally (no batch norm, no buffers).
    """
    torch.manual_seed(0)
    encoder = build_encoder(cardinalities=cardinalities, num_continuous=4, dim=16, hidden_layers=3, dropout=0.3)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in encoder.modules())
    assert not list(encoder.buffers())
    codes = torch.stack([torch.randint(0, c, (32,)) for c in cardinalities], 1).float() if cardinalities else None
    x = torch.randn(32, 4) if codes is None else torch.cat([codes, torch.randn(32, 4)], 1)
    changed = x.clone()
    changed[7, len(cardinalities):] = 10.0
    if cardinalities:
        changed[7, 0] = (changed[7, 0] + 1) % cardinalities[0]
    encoder.train()
    with seeded(4):
        out = encoder(x)
    with seeded(4):
        out_changed = encoder(changed)
    assert not torch.allclose(out[7], out_changed[7])
    torch.testing.assert_close(torch.cat([out[:7], out[8:]]), torch.cat([out_changed[:7], out_changed[8:]]),
                               rtol=1e-6, atol=1e-6)


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
    logits = predict_multisurv(model, inputs, torch.ones(9, 2, dtype=torch.bool), passes=20, seed=0)
    mean, lo, hi = survival_band(logits)
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
    censored_at_horizon = discretise(np.minimum(test_t, cuts[-1]), test_e * (test_t <= cuts[-1]), cuts)
    test_idx, test_ev = (torch.from_numpy(a) for a in censored_at_horizon)
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
    by_hand = np.mean([[1 - float(F.cosine_similarity(emb3[i, k], emb3[i, j], dim=0)) for k, j in pairs] for i in range(6)])
    got3 = bvflmsp_loss(logits, idx, ev, emb3, kl=0.0, num_train=1, similarity_weight=1.0) - plain
    assert float(got3) == pytest.approx(by_hand, rel=1e-5)
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[:, 2] = False
    got_m = bvflmsp_loss(logits, idx, ev, emb3, kl=0.0, num_train=1, similarity_weight=1.0, mask=mask) - plain
    by_hand_m = np.mean([1 - float(F.cosine_similarity(emb3[i, 0], emb3[i, 1], dim=0)) for i in range(6)])
    assert float(got_m) == pytest.approx(by_hand_m, rel=1e-5)


# --------------------------------------------------------------------------- MultiSurv, builder, seeds


def test_multisurv_is_the_same_architecture_with_deterministic_layers() -> None:
    inputs = {"clinical": ([3, 2], 2), "omics": ((), 10)}
    bayes = build_multisurv(inputs, seed=0, dim=16, num_durations=5, head_layers=1, dropout=0.1)
    freq = build_multisurv(inputs, seed=0, dim=16, num_durations=5, head_layers=1, dropout=0.1, bayesian=False)
    assert isinstance(freq, MultiSurv) and type(bayes) is BayesianMultisurv
    assert not any(isinstance(m, BayesianLinear) for m in freq.modules())
    def kinds(model: nn.Module) -> list[str]:
        return [type(m).__name__.replace("Bayesian", "") for m in model.modules() if type(m).__name__ != "ScaleMixturePrior"]

    assert kinds(bayes)[1:] == kinds(freq)[1:]
    x = {"clinical": torch.tensor([[0.0, 1.0, 0.3, -1.0], [2.0, 0.0, 1.0, 0.5]]), "omics": torch.randn(2, 10)}
    freq.eval()
    torch.testing.assert_close(freq(x)[0], freq(x)[0], rtol=0, atol=0)  # no sampling
    assert float(kl_divergence(freq)) == 0.0
    with pytest.raises(ValueError, match="deterministic"):
        MultiSurv({"omics": BayesianFC(10, 16, 0)}, dim=16)


def test_parts_built_alone_from_their_seeds_equal_the_models_parts() -> None:
    inputs = {"clinical": ([3], 2), "omics": ((), 10)}
    model = build_multisurv(inputs, seed=5, dim=16, num_durations=4, head_layers=1)
    with seeded(part_seed(5, "omics")):
        omics = build_encoder(cardinalities=(), num_continuous=10, dim=16)
    with seeded(part_seed(5, HEAD_SEED_NAME)):
        head = FusionHead(16, 4, 1, 0.5)
    for name, value in omics.state_dict().items():
        torch.testing.assert_close(value, model.encoders["omics"].state_dict()[name], rtol=0, atol=0)
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, model.fusion_head.state_dict()[name], rtol=0, atol=0)
    other = build_multisurv(inputs, seed=6, dim=16, num_durations=4, head_layers=1)
    assert not torch.equal(other.encoders["omics"].layers[0].weight_mu, model.encoders["omics"].layers[0].weight_mu)
    assert part_seed(5, "omics", 1, 2) == part_seed(5, "omics", 1, 2) != part_seed(5, "omics", 2, 1)
    with pytest.raises(ValueError, match="reserved"):
        BayesianMultisurv({HEAD_SEED_NAME: omics}, dim=16)


def test_forward_with_seeds_equals_parts_run_separately_under_their_seeds() -> None:
    inputs = {"clinical": ([3], 2), "omics": ((), 10)}
    model = build_multisurv(inputs, seed=1, dim=16, num_durations=4, head_layers=1, dropout=0.3)
    x = {"clinical": torch.tensor([[0.0, 0.3, -1.0], [2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]), "omics": torch.randn(3, 10)}
    seeds = {"clinical": 11, "omics": 12, HEAD_SEED_NAME: 13}
    logits, emb = model(x, seeds=seeds)
    with seeded(11):
        e_c = model.encoders["clinical"](x["clinical"])
    with seeded(12):
        e_o = model.encoders["omics"](x["omics"])
    with seeded(13):
        by_parts = model.fusion_head(torch.stack([e_c, e_o], 1))
    torch.testing.assert_close(logits, by_parts, rtol=0, atol=0)
    torch.testing.assert_close(emb, torch.stack([e_c, e_o], 1), rtol=0, atol=0)
    assert not torch.equal(model(x, seeds={**seeds, "omics": 99})[0], logits)


def test_survival_band_from_passes() -> None:
    logits = torch.randn(200, 3, 6)
    mean, lower, upper = survival_band(logits, level=0.9)
    curves = torch.cumprod(1 - torch.sigmoid(logits), 2)
    torch.testing.assert_close(mean, curves.mean(0))
    torch.testing.assert_close(lower, torch.quantile(curves, 0.05, dim=0))
    inside = ((curves >= lower) & (curves <= upper)).float().mean()
    assert 0.88 <= float(inside) <= 0.93
    with pytest.raises(ValueError):
        survival_band(logits[0])


# --------------------------------------------------------------------------- the risk layer and the default recipe


@pytest.mark.parametrize("bayesian", [True, False])
def test_proportional_risk_layer_ranks_records_alike_at_every_interval(bayesian: bool) -> None:
    torch.manual_seed(0)
    head = FusionHead(8, 6, 1, 0.1, bayesian=bayesian, risk_layer="proportional")
    interval = FusionHead(8, 6, 1, 0.1, bayesian=bayesian)
    assert sum(p.numel() for p in head.risk.parameters()) == (2 if bayesian else 1) * (8 + 1) + 6
    assert sum(p.numel() for p in interval.risk.parameters()) == (2 if bayesian else 1) * (8 * 6 + 6)
    head.eval()
    with seeded(3):
        logits = head(torch.randn(5, 2, 8))
    # one score per record: the difference between two records is the same in every interval
    difference = logits[0] - logits[1:]
    assert torch.allclose(difference, difference[:, :1].expand_as(difference), atol=1e-5)
    assert not torch.allclose(logits[0], logits[1])
    hazard = torch.sigmoid(head.risk.baseline.detach())
    assert torch.allclose(torch.prod(1 - hazard), torch.tensor(0.5), atol=1e-5)  # starts at survival 1/2
    with pytest.raises(ValueError, match="risk_layer must be one of"):
        FusionHead(8, 6, 1, 0.1, risk_layer="cox")


def test_the_default_recipes_per_record_loss_falls_over_epochs_on_a_small_data_set() -> None:
    """The split run's defaults: the epoch loss is the per-record objective (NLL/record + KL/N +
    similarity term), so it is of the size of one record's loss (a sum would be ~N times larger),
    and it falls in expectation over epochs."""
    from models.data.vertical import simulate_multimodal
    from models.multimodal_training import (
        MultimodalData,
        batch_loss,
        discretised_labels,
        fit_transforms,
        modality_inputs,
        train_multisurv,
    )
    from strategies.config import parse_flat

    split = parse_flat({"strategy.name": "split", "data.name": "synthetic_multimodal"}).split
    table = simulate_multimodal(240, seed=0)
    cuts = make_time_grid(table.time, table.event, num_durations=30)
    transforms = fit_transforms(table, table.ids)
    data = MultimodalData(*modality_inputs(table, table.ids, transforms),
                          *discretised_labels(table.time, table.event, cuts))
    model = build_multisurv({name: t.input_shape for name, t in transforms.items()}, seed=0, num_durations=len(cuts),
                            dim=split.embedding_dim, encoder_layers=split.encoder_layers,
                            head_layers=split.head_layers, dropout=split.dropout, risk_layer=split.risk_layer)
    history = train_multisurv(model, data, epochs=30, batch_size=64, lr=0.003, weight_decay=1e-4, seed=0,
                              similarity_weight=split.similarity_weight)
    assert np.mean(history[-5:]) < np.mean(history[:5]) - 0.5
    # the last epoch's loss is the whole data set's per-record objective at the end of training
    whole = [float(batch_loss(model, data, torch.arange(len(data)), step=10**6 + k, seed=0,
                              similarity_weight=split.similarity_weight)[0].detach()) for k in range(20)]
    assert abs(history[-1] - np.mean(whole)) < 0.1 * np.mean(whole)
    nll = float(logistic_hazard_nll(predict_multisurv(model, data.inputs, data.present, passes=1, seed=0)[0],
                                    data.time_index, data.event))
    assert 1.0 < nll < 4.0 and np.mean(whole) < 10 * len(data) ** 0.5  # summed over 240 records it would be > 240
