"""Feature-reconstruction attack on embeddings: R² against known cases and its fall with noise."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from sklearn.linear_model import RidgeCV
from sklearn.metrics import r2_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from strategies.audits.reconstruction import reconstruction_attack
from strategies.mechanisms.embedding_noise import privatize_embeddings


def _encoded(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and an injective nonlinear 'encoder' output of them (wider than the features)."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, 5))
    mixing = np.random.default_rng(99).normal(size=(5, 32))
    return features, np.tanh(0.3 * features @ mixing)


def test_linear_embeddings_are_reconstructed_exactly_and_r2_matches_sklearn() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(400, 4))
    embeddings = features @ rng.normal(size=(4, 16))
    result = reconstruction_attack(embeddings[:300], features[:300], embeddings[300:], features[300:])
    assert result.r2 > 0.999
    assert result.r2_per_feature.shape == (4,)
    # the same per-feature R² as sklearn on a slightly noisy case
    noisy = embeddings + rng.normal(scale=2.0, size=embeddings.shape)
    result = reconstruction_attack(noisy[:300], features[:300], noisy[300:], features[300:])
    model = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-6, 6, 13))).fit(noisy[:300], features[:300])
    expected = r2_score(features[300:], model.predict(noisy[300:]), multioutput="raw_values")
    assert np.allclose(result.r2_per_feature, expected)


def test_r2_falls_as_the_embedding_noise_grows() -> None:
    features, embeddings = _encoded(1500, seed=1)
    r2 = []
    for sigma in (0.0, 0.05, 0.2, 1.0, 4.0):
        released = privatize_embeddings(torch.as_tensor(embeddings), clip_norm=1.0, noise_multiplier=sigma,
                                        generator=torch.Generator().manual_seed(0)).numpy()
        r2.append(reconstruction_attack(released[:1000], features[:1000], released[1000:], features[1000:]).r2)
    assert r2[0] > 0.9, r2
    assert all(a > b for a, b in pairwise(r2)), r2
    assert r2[-1] < 0.1, r2


def test_independent_embeddings_give_r2_near_zero() -> None:
    rng = np.random.default_rng(2)
    features = rng.normal(size=(2000, 3))
    embeddings = rng.normal(size=(2000, 8))
    result = reconstruction_attack(embeddings[:1000], features[:1000], embeddings[1000:], features[1000:])
    assert abs(result.r2) < 0.02


def test_mlp_decoder_beats_ridge_on_a_nonlinear_encoder() -> None:
    rng = np.random.default_rng(3)
    features = rng.uniform(-2, 2, size=(3000, 2))
    embeddings = np.column_stack([np.sin(features[:, 0]), np.cos(features[:, 0]), features[:, 1] ** 3])
    split = 2000
    ridge = reconstruction_attack(embeddings[:split], features[:split], embeddings[split:], features[split:])
    mlp = reconstruction_attack(embeddings[:split], features[:split], embeddings[split:], features[split:],
                                decoder="mlp")
    assert mlp.r2 > ridge.r2 + 0.05, (mlp.r2, ridge.r2)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="decoder"):
        reconstruction_attack(np.zeros((3, 2)), np.zeros((3, 1)), np.zeros((3, 2)), np.zeros((3, 1)), decoder="gan")
    with pytest.raises(ValueError, match="one row per record"):
        reconstruction_attack(np.zeros((3, 2)), np.zeros((4, 1)), np.zeros((3, 2)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="widths"):
        reconstruction_attack(np.zeros((3, 2)), np.zeros((3, 1)), np.zeros((3, 5)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="finite"):
        reconstruction_attack(np.full((3, 2), np.nan), np.zeros((3, 1)), np.zeros((3, 2)), np.zeros((3, 1)))
