"""Private embeddings for split learning: clipping, noise, and both calibrations."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS
from strategies.mechanisms.embedding_dp import calibrate_embedding_noise, embedding_epsilon, paper_embedding_noise
from strategies.mechanisms.embedding_noise import clip_embeddings, privatize_embeddings


def test_rows_are_clipped_to_the_norm_and_short_rows_kept() -> None:
    embeddings = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped = clip_embeddings(embeddings, 1.0)
    assert torch.allclose(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))


def test_noise_has_std_sigma_times_c_and_is_reproducible() -> None:
    embeddings = torch.zeros(2000, 64)
    released = privatize_embeddings(embeddings, clip_norm=0.5, noise_multiplier=3.0,
                                    generator=torch.Generator().manual_seed(0))
    assert float(released.std()) == pytest.approx(1.5, rel=0.01)  # 128,000 draws
    again = privatize_embeddings(embeddings, clip_norm=0.5, noise_multiplier=3.0,
                                 generator=torch.Generator().manual_seed(0))
    assert torch.equal(released, again)
    assert torch.equal(privatize_embeddings(embeddings, clip_norm=0.5, noise_multiplier=0.0), embeddings)


def test_gradient_flows_through_clipping_to_the_encoder() -> None:
    embeddings = torch.tensor([[3.0, 4.0]], requires_grad=True)
    clip_embeddings(embeddings, 1.0).sum().backward()
    # d/de of (e / ||e||) summed: (1·||e||² − e·Σe) / ||e||³ per coordinate
    expected = torch.tensor([(25 - 3 * 7) / 125, (25 - 4 * 7) / 125])
    assert torch.allclose(embeddings.grad[0], expected)


def test_epsilon_is_gaussian_rdp_at_sigma_over_sensitivity_without_amplification() -> None:
    sigma, epochs = 6.0, 40
    replace = embedding_epsilon(noise_multiplier=sigma, epochs=epochs, delta=1e-5)
    add_remove = embedding_epsilon(noise_multiplier=sigma, epochs=epochs, delta=1e-5, adjacency="add-remove")
    assert replace == pytest.approx(epsilon_gaussian_rounds(noise_multiplier=3.0, rounds=epochs, delta=1e-5,
                                                            orders=list(AUDIT_RDP_ORDERS)), rel=1e-12)
    assert add_remove == pytest.approx(epsilon_gaussian_rounds(noise_multiplier=6.0, rounds=epochs, delta=1e-5,
                                                               orders=list(AUDIT_RDP_ORDERS)), rel=1e-12)
    assert replace > add_remove


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 1.5, 10.0])
def test_calibration_spends_at_most_the_target(epsilon: float) -> None:
    sigma = calibrate_embedding_noise(epsilon=epsilon, delta=1e-5, epochs=40)
    spent = embedding_epsilon(noise_multiplier=sigma, epochs=40, delta=1e-5)
    assert spent <= epsilon and spent == pytest.approx(epsilon, abs=1e-3)
    assert calibrate_embedding_noise(epsilon=epsilon, delta=1e-5, epochs=40, adjacency="add-remove") == \
        pytest.approx(sigma / 2, rel=1e-12)


def test_paper_calibration_hand_value_and_its_true_cost() -> None:
    # p = 64/1000, tau = 40 x 16 = 640 iterations, delta = 1e-5, epsilon = 1
    sigma = paper_embedding_noise(epsilon=1.0, delta=1e-5, batch_size=64, train_size=1000, epochs=40)
    assert sigma == pytest.approx(2 * 0.064 * math.sqrt(640 * math.log(1e5)), rel=1e-12)
    assert sigma == pytest.approx(10.9873, abs=1e-4)  # 0.128 x sqrt(640 x 11.5129)
    # Without the sub-sampling credit the same noise spends more than the target it was set for
    # when the batch is a large share of the data ...
    big_batch = paper_embedding_noise(epsilon=1.0, delta=1e-5, batch_size=500, train_size=1000, epochs=40)
    assert embedding_epsilon(noise_multiplier=big_batch, epochs=40, delta=1e-5) > 1.0
    # ... and in every case it is far less noise than the accountant needs without amplification.
    small = paper_embedding_noise(epsilon=1.0, delta=1e-5, batch_size=8, train_size=1000, epochs=40)
    assert small < calibrate_embedding_noise(epsilon=1.0, delta=1e-5, epochs=40) / 10


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        clip_embeddings(torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        privatize_embeddings(torch.zeros(1, 2), clip_norm=1.0, noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="adjacency"):
        embedding_epsilon(noise_multiplier=1.0, epochs=1, delta=1e-5, adjacency="swap")
    with pytest.raises(ValueError, match="batch_size"):
        paper_embedding_noise(epsilon=1.0, delta=1e-5, batch_size=10, train_size=5, epochs=1)
