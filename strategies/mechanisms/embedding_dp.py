r"""Differentially private embeddings for vertical split learning (BVFLMSP, DESIGN.md §5).

Each site clips every record's embedding to L2 norm ``C`` and adds ``N(0, σ²C²)`` to each
coordinate before sending it to the server (:func:`privatize_embeddings`).

What one record's release is: the server chooses the batches and knows which IDs exist, so a
record's *features* are what is protected. Replacing them moves its clipped embedding by at most
``2C`` (replace-one, the default here); the add/remove view (a row present or absent, sensitivity
``C``) is offered for comparison. Each record is embedded once per epoch, and because the server,
not a random sampler, picks the batches, no sub-sampling amplification applies: ``E`` epochs are
``E`` Gaussian releases of noise multiplier ``σ/Δ`` (``Δ = 2`` or ``1`` in units of ``C``),
composed by RDP (:func:`embedding_epsilon`, :func:`calibrate_embedding_noise`).

The paper's calibration (:func:`paper_embedding_noise`) is ``σ = 2p·sqrt(τ ln(1/δ))/ε`` with
``p = B/N`` and ``τ = E·N/B`` iterations. It credits Poisson sub-sampling at rate ``p`` that does
not happen, and it is an asymptotic bound; it gives far less noise than the RDP accountant needs.
The ledger labels it as such and still reports the RDP ε of the noise that ran.

Not covered by either figure: the gradients the server sends back, and a record's influence on the
site's encoder weights, which shape every later embedding of every other record.

References
----------
BVFLMSP paper (../shared/papers/bvflmsp-vertical-bayesian-survival.txt), §5, Theorem 1 and
eq. (8)–(9); Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP ``α Δ²/(2σ²)``).
"""

from __future__ import annotations

import math

import torch

from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS
from strategies.mechanisms.nbafl import calibrate_gaussian_noise_multiplier
from strategies.validation import check_choice, check_count, check_positive, check_probability

__all__ = [
    "EMBEDDING_ADJACENCIES",
    "calibrate_embedding_noise",
    "clip_embeddings",
    "embedding_epsilon",
    "paper_embedding_noise",
    "privatize_embeddings",
]

#: Neighbouring data sets for an embedding release, with the sensitivity in units of ``C``.
EMBEDDING_ADJACENCIES: dict[str, float] = {"replace-one": 2.0, "add-remove": 1.0}


def clip_embeddings(embeddings: torch.Tensor, clip_norm: float) -> torch.Tensor:
    r"""Scale each row to L2 norm at most ``C``: ``e_i ← e_i · min(1, C/||e_i||)``.

    Parameters
    ----------
    embeddings : torch.Tensor, shape (n, d)
    clip_norm : float
        ``C`` > 0.

    Returns
    -------
    torch.Tensor
        A new tensor (differentiable: the gradient flows through the scaling, as it does at the
        site in split learning).
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must have shape (n, d), got {tuple(embeddings.shape)}")
    norms = torch.linalg.vector_norm(embeddings, dim=1, keepdim=True)
    return embeddings * torch.clamp(clip_norm / norms.clamp_min(1e-12), max=1.0)


def privatize_embeddings(
    embeddings: torch.Tensor, *, clip_norm: float, noise_multiplier: float, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip each record's embedding to ``C`` and add ``N(0, (σC)²)`` to every coordinate.

    Parameters
    ----------
    embeddings : torch.Tensor, shape (n, d)
    clip_norm : float
        ``C``.
    noise_multiplier : float
        ``σ`` ≥ 0 (0: clipping only, no privacy).
    generator : torch.Generator, optional
        Source of the noise (torch's global generator if omitted).

    Returns
    -------
    torch.Tensor, shape (n, d)
    """
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    clipped = clip_embeddings(embeddings, clip_norm)
    if noise_multiplier == 0:
        return clipped
    noise = torch.randn(clipped.shape, generator=generator, dtype=clipped.dtype, device=clipped.device)
    return clipped + noise * (noise_multiplier * clip_norm)


def embedding_epsilon(*, noise_multiplier: float, epochs: int, delta: float, adjacency: str = "replace-one") -> float:
    r"""ε of ``epochs`` releases of each record's embedding, without amplification (RDP).

    Each release is a Gaussian mechanism of sensitivity ``Δ·C`` (``Δ`` = 2 for replace-one, 1 for
    add/remove) and noise ``σC``: noise multiplier ``σ/Δ``, composed over ``epochs``.

    References
    ----------
    Mironov, "Rényi Differential Privacy", CSF 2017.
    """
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    adjacency = check_choice(adjacency, tuple(EMBEDDING_ADJACENCIES), "adjacency")
    return epsilon_gaussian_rounds(
        noise_multiplier=noise_multiplier / EMBEDDING_ADJACENCIES[adjacency], rounds=check_count(epochs, "epochs"),
        delta=check_probability(delta, "delta"), orders=list(AUDIT_RDP_ORDERS),
    )


def calibrate_embedding_noise(*, epsilon: float, delta: float, epochs: int, adjacency: str = "replace-one") -> float:
    """Smallest ``σ`` (noise std ``σC``) whose :func:`embedding_epsilon` over ``epochs`` is ``≤ ε``."""
    adjacency = check_choice(adjacency, tuple(EMBEDDING_ADJACENCIES), "adjacency")
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=delta, releases=check_count(epochs, "epochs"))
    return z * EMBEDDING_ADJACENCIES[adjacency]


def paper_embedding_noise(*, epsilon: float, delta: float, batch_size: int, train_size: int, epochs: int) -> float:
    r"""The paper's calibration ``σ = 2p·sqrt(τ ln(1/δ))/ε`` (its eq. 8 with ``c_2 = 1``).

    ``p = B/N`` and ``τ = E·⌈N/B⌉`` iterations, as the paper instantiates them. The derivation
    credits sub-sampling at rate ``p``; in split learning the server picks the batches, so that
    credit does not apply. Report :func:`embedding_epsilon` of the returned σ beside it.

    References
    ----------
    BVFLMSP paper (../shared/papers/bvflmsp-vertical-bayesian-survival.txt), Theorem 1, eq. (8),
    and §6 (instantiation of p, τ, δ, C).
    """
    epsilon = check_positive(epsilon, "epsilon")
    delta = check_probability(delta, "delta")
    batch_size = check_count(batch_size, "batch_size")
    train_size = check_count(train_size, "train_size")
    if batch_size > train_size:
        raise ValueError(f"batch_size {batch_size} exceeds train_size {train_size}")
    sample_rate = batch_size / train_size
    iterations = check_count(epochs, "epochs") * math.ceil(train_size / batch_size)
    return 2.0 * sample_rate * math.sqrt(iterations * math.log(1.0 / delta)) / epsilon
