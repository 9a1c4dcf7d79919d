r"""A site's embedding release in vertical split learning (BVFLMSP): clip each record's embedding, add noise.

:func:`privatize_embeddings` is the torch code a site runs on every batch of embeddings before
sending them to the server; what the release protects, its sensitivity and its accounting are
:mod:`strategies.mechanisms.embedding_dp` (the mechanism object, torch-free).

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), §5.
"""

from __future__ import annotations

import math

import torch

from strategies.validation import check_positive

__all__ = ["clip_embeddings", "privatize_embeddings"]


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
