"""The split-learning protocol (strategies.split) against its centralised twin, in process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.bayesian import kl_divergence, seeded
from models.data.vertical import VerticalTable, simulate_multimodal, split_train_test
from models.multimodal import HEAD_SEED_NAME, FusionHead, build_multisurv, part_seed
from models.multimodal_training import (
    MultimodalData,
    batch_loss,
    discretised_labels,
    epoch_batches,
    fit_transforms,
    modality_inputs,
    predict_multisurv,
    train_multisurv,
)
from models.time_grid import make_time_grid
from strategies.mechanisms.embedding_dp import embedding_epsilon
from strategies.split import (
    LocalSites,
    PredictRequest,
    SiteConfig,
    SiteRequest,
    SplitServer,
    SplitSite,
    SplitSiteError,
    embedding_hook,
    predict_split,
    run_split_training,
)

SEED = 3
ARCH = {"dim": 16, "encoder_layers": 1, "dropout": 0.3}


def _setup(table: VerticalTable, *, clip_norm: float | None = None, noise_multiplier: float = 0.0, bayesian=True,
           lr: float = 0.01, epochs: int = 1, batch_size: int = 64):
    """Centralised twin, split server and sites for the same table, seeds and architecture."""
    train_ids, test_ids = split_train_test(table, test_fraction=0.25, seed=SEED)
    train = table.subset(train_ids)
    cuts = make_time_grid(train.time, train.event, num_durations=6)
    transforms = fit_transforms(table, train_ids)
    inputs, present = modality_inputs(table, train_ids, transforms)
    time_index, event = discretised_labels(train.time, train.event, cuts)
    data = MultimodalData(inputs, present, time_index, event)
    model = build_multisurv({k: t.input_shape for k, t in transforms.items()}, seed=SEED, bayesian=bayesian,
                            num_durations=len(cuts), head_layers=1, **{"dim": ARCH["dim"],
                            "encoder_layers": ARCH["encoder_layers"], "dropout": ARCH["dropout"]})
    with seeded(part_seed(SEED, HEAD_SEED_NAME)):
        head = FusionHead(ARCH["dim"], len(cuts), 1, ARCH["dropout"], bayesian=bayesian)
    server = SplitServer(modalities=tuple(table.modalities), fusion_head=head, time_index=time_index, event=event,
                         train_ids=list(train_ids), seed=SEED, lr=lr, weight_decay=1e-4)
    sites = {}
    for name, frame in table.modalities.items():
        config = SiteConfig(modality=name, seed=SEED, train_ids=tuple(train_ids), num_train=len(train_ids),
                            bayesian=bayesian, lr=lr, weight_decay=1e-4, clip_norm=clip_norm,
                            noise_multiplier=noise_multiplier, batch_size=batch_size, epochs=epochs, **ARCH)
        sites[name] = SplitSite(config, frame, table.categorical.get(name, ()), noise_base_seed=SEED)
    return model, data, server, sites, train_ids, test_ids, transforms


def _table(n: int = 160) -> VerticalTable:
    table = simulate_multimodal(n, features_per_modality=4, seed=0)
    # a categorical column in modality "a", so that one site runs the clinical net
    frame = table.modalities["a"].copy()
    frame["a0"] = (frame["a0"] > 0).astype(float) + (frame["a0"] > 1).astype(float)
    return VerticalTable(table.name, table.ids, table.time, table.event, {**table.modalities, "a": frame},
                         categorical={"a": ("a0",)})


def test_sites_and_server_start_from_the_centralised_models_weights() -> None:
    model, _, server, sites, *_ = _setup(_table())
    assert type(sites["a"].encoder).__name__ == "BayesianClinicalNet"
    for name, site in sites.items():
        for key, value in site.encoder.state_dict().items():
            torch.testing.assert_close(value, model.encoders[name].state_dict()[key], rtol=0, atol=0)
    for key, value in server.fusion_head.state_dict().items():
        torch.testing.assert_close(value, model.fusion_head.state_dict()[key], rtol=0, atol=0)


@pytest.mark.parametrize("bayesian", [True, False])
def test_split_gradients_equal_the_centralised_gradients_without_noise_or_clipping(bayesian: bool) -> None:
    """Must-show: sigma = 0, no clipping -> same parameter gradients on the same batch and posterior samples."""
    model, data, server, sites, train_ids, *_ = _setup(_table(), bayesian=bayesian)
    batch = epoch_batches(len(data), batch_size=64, seed=SEED, epoch=0)[0]
    loss, _ = batch_loss(model, data, batch, step=0, seed=SEED)
    model.zero_grad()
    loss.backward()
    ids = [str(i) for i in np.asarray(train_ids)[batch.numpy()]]
    replies = {name: site.handle(SiteRequest(forward_ids=ids, forward_step=0)) for name, site in sites.items()}
    split_loss, _, gradients = server.step(0, batch, {k: r.embeddings for k, r in replies.items()},
                                           {k: r.present for k, r in replies.items()})
    # the server's loss holds its own KL; each site adds the gradient of its KL / N
    site_kl = sum(float(kl_divergence(site.encoder)) for site in sites.values()) / len(data)
    assert split_loss + site_kl == pytest.approx(float(loss.detach()), rel=1e-6)
    for name, site in sites.items():
        site.handle(SiteRequest(backward_ids=ids, backward_step=0, gradient=gradients[name]))
    compared = 0
    for prefix, part in [(f"encoders.{name}.", site.encoder) for name, site in sites.items()] + [
            ("fusion_head.", server.fusion_head)]:
        for key, parameter in part.named_parameters():
            reference = dict(model.named_parameters())[prefix + key].grad
            torch.testing.assert_close(parameter.grad, reference, rtol=1e-5, atol=1e-7)
            compared += 1
    assert compared == len(list(model.parameters()))


def test_split_training_with_clipping_and_noise_takes_the_centralised_twins_steps() -> None:
    model, data, server, sites, train_ids, test_ids, transforms = _setup(
        _table(), clip_norm=1.0, noise_multiplier=0.7, epochs=2)
    transport = LocalSites(sites)
    history = run_split_training(server, transport, epochs=2, batch_size=64)
    train_multisurv(model, data, epochs=2, batch_size=64, lr=0.01, weight_decay=1e-4, seed=SEED,
                    hook=embedding_hook(noise_base_seed=SEED, clip_norm=1.0, noise_multiplier=0.7))
    batches = sum(len(epoch_batches(len(data), batch_size=64, seed=SEED, epoch=e)) for e in range(2))
    assert history.batches == batches and history.round_trips == batches + 1 == transport.round_trips
    for name, site in sites.items():
        for key, value in site.encoder.state_dict().items():
            torch.testing.assert_close(value, model.encoders[name].state_dict()[key], rtol=1e-4, atol=1e-6)
    for key, value in server.fusion_head.state_dict().items():
        torch.testing.assert_close(value, model.fusion_head.state_dict()[key], rtol=1e-4, atol=1e-6)
    # prediction: the same passes, the same noise
    table = _table()
    inputs, present = modality_inputs(table, test_ids, transforms)
    central = predict_multisurv(model, inputs, present, passes=3, seed=SEED,
                                hook=embedding_hook(noise_base_seed=SEED, clip_norm=1.0, noise_multiplier=0.7))
    split, privacy = predict_split(server, transport.predict, list(test_ids), passes=3)
    torch.testing.assert_close(split, central, rtol=1e-4, atol=1e-5)
    # every training record released once per epoch, every test record once per pass
    expected_train = embedding_epsilon(noise_multiplier=0.7, epochs=2, delta=1e-5, adjacency="replace-one")
    expected_test = embedding_epsilon(noise_multiplier=0.7, epochs=3, delta=1e-5, adjacency="replace-one")
    for report in privacy.values():
        assert report["epsilon_training"] == pytest.approx(expected_train)
        assert report["epsilon_held_out"] == pytest.approx(expected_test)
        assert report["epsilon"] == pytest.approx(max(expected_train, expected_test)) and report["releases_max"] == 3


def test_a_site_restored_from_its_state_continues_exactly() -> None:
    _, data, server, sites, train_ids, *_ = _setup(_table(), clip_norm=1.0, noise_multiplier=0.5)
    site = sites["a"]
    batches = epoch_batches(len(data), batch_size=32, seed=SEED, epoch=0)
    ids = [[str(i) for i in np.asarray(train_ids)[b.numpy()]] for b in batches]
    rng = np.random.default_rng(0)
    first = site.handle(SiteRequest(forward_ids=ids[0], forward_step=0))
    gradient = rng.normal(size=first.embeddings.shape).astype(np.float32)
    site.handle(SiteRequest(backward_ids=ids[0], backward_step=0, gradient=gradient, forward_ids=ids[1],
                            forward_step=1))
    restored = SplitSite(site.config, _table().modalities["a"], ("a0",), noise_base_seed=SEED)
    restored.load_state_dict(site.state_dict())
    gradient = rng.normal(size=first.embeddings.shape).astype(np.float32)[: len(ids[1])]
    request = SiteRequest(backward_ids=ids[1], backward_step=1, gradient=gradient, forward_ids=ids[2], forward_step=2)
    a, b = site.handle(request), restored.handle(request)
    np.testing.assert_array_equal(a.embeddings, b.embeddings)
    for key, value in site.state_dict().items():
        np.testing.assert_array_equal(value, restored.state_dict()[key])


def test_missing_modality_records_are_masked_and_not_counted() -> None:
    table = _table()
    frame = table.modalities["b"].copy()
    frame.iloc[::4] = np.nan  # every 4th record lacks modality b
    table = VerticalTable(table.name, table.ids, table.time, table.event, {**table.modalities, "b": frame},
                          categorical=table.categorical)
    model, data, server, sites, train_ids, *_ = _setup(table, clip_norm=1.0, noise_multiplier=0.3)
    lacking = set(table.ids[::4])
    assert not data.present[:, 1][np.isin(np.asarray(train_ids), list(lacking))].any()
    history = run_split_training(server, LocalSites(sites), epochs=1, batch_size=64)
    assert math.isfinite(history.epoch_loss[0])
    releases = dict(zip(sites["b"].index, sites["b"].releases, strict=True))
    assert all(releases[i] == 0 for i in lacking) and all(releases[i] == 1 for i in train_ids if i not in lacking)
    # and the split model still equals its twin (masking happens the same way on both sides)
    train_multisurv(model, data, epochs=1, batch_size=64, lr=0.01, weight_decay=1e-4, seed=SEED,
                    hook=embedding_hook(noise_base_seed=SEED, clip_norm=1.0, noise_multiplier=0.3))
    for key, value in server.fusion_head.state_dict().items():
        torch.testing.assert_close(value, model.fusion_head.state_dict()[key], rtol=1e-4, atol=1e-6)


def test_noise_has_the_configured_scale_and_clipping_bounds_the_norm() -> None:
    _, data, _, sites, train_ids, *_ = _setup(_table(), clip_norm=2.0, noise_multiplier=0.0)
    ids = [str(i) for i in train_ids[:50]]
    clean = sites["c"].handle(SiteRequest(forward_ids=ids, forward_step=0)).embeddings
    assert np.linalg.norm(clean, axis=1).max() <= 2.0 + 1e-5
    _, _, _, noisy_sites, *_ = _setup(_table(), clip_norm=2.0, noise_multiplier=3.0)
    noisy = noisy_sites["c"].handle(SiteRequest(forward_ids=ids, forward_step=0)).embeddings
    assert np.std(noisy - clean) == pytest.approx(6.0, rel=0.05)  # sigma * C


def test_unknown_modality_and_bad_gradient_fail_clearly() -> None:
    _, _, server, sites, train_ids, *_ = _setup(_table())
    with pytest.raises(SplitSiteError, match="no site holds modality 'c'"):
        run_split_training(server, LocalSites({k: v for k, v in sites.items() if k != "c"}), epochs=1, batch_size=64)
    ids = [str(i) for i in train_ids[:4]]
    with pytest.raises(ValueError, match="gradient of shape"):
        sites["a"].handle(SiteRequest(backward_ids=ids, backward_step=0, gradient=np.zeros((3, 16), np.float32)))


@pytest.mark.parametrize("clip_norm", [0.1, 1.0])
def test_replacing_one_record_moves_only_its_own_released_embedding(clip_norm: float) -> None:
    """Must-show (sensitivity): a training release of record i depends on record i alone.

    Two copies of each site (same encoder weights, seeds and noise) release the same batch in
    training mode; in the second, record ``i``'s preprocessed features are replaced by an
    outlier (its categorical codes by other codes). Every other record's released row must stay
    put (to float32 round-off) and record ``i``'s may move by at most ``2C``: the replace-one
    sensitivity the accountant charges. The same holds for a prediction pass (eval mode).
    """
    import copy

    _, data, _, sites, train_ids, *_ = _setup(_table(), clip_norm=clip_norm, noise_multiplier=0.5)
    batch = epoch_batches(len(data), batch_size=64, seed=SEED, epoch=0)[0]
    ids = [str(i) for i in np.asarray(train_ids)[batch.numpy()]]
    for name, site in sites.items():
        position = site.index.get_loc(ids[5])
        changed = copy.deepcopy(site)
        k = len(site.transform.categorical)
        row = changed.x[position]
        row[k:] = 4.0 * row[k:] + 3.0
        row[:k] = (row[:k] + 1) % torch.tensor(site.transform.cardinalities, dtype=row.dtype)
        before, _ = site.embed(ids, 0)
        after, _ = changed.embed(ids, 0)
        passes_before, _ = site.predict(PredictRequest(ids=ids, passes=2))
        passes_after, _ = changed.predict(PredictRequest(ids=ids, passes=2))
        for released, released_changed in [(before, after), *zip(passes_before, passes_after, strict=True)]:
            movement = np.linalg.norm(released_changed - released, axis=1) / clip_norm
            others = np.delete(movement, 5)
            assert movement[5] > 0.01 and movement[5] <= 2.0 + 1e-5
            assert others.max() <= 1e-5, f"site {name}: other records' releases moved by up to {others.max():.3g} C"
