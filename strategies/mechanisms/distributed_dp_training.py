r"""The site's numerics of ``distributed_dp``: its rounded clipped gradient sum plus its discrete Gaussian noise.

:func:`site_contribution` computes, at the global model, every training record's gradient of the
hazard model's loss (the ghost-clipping factors of :func:`~strategies.mechanisms.dp_sgd_training.
clipped_sum_ghost`, materialised a chunk of records at a time), re-clips each in float64 to
:math:`C(1 - 10^{-9})` so that its exact norm is at most :math:`C` whatever the float32 round-off,
scales it by :math:`\gamma`, rounds each coordinate to the nearest integer, sums the records and
adds :math:`N_{\mathbb Z}(0, s^2)` per coordinate. The flat layout is the model's state-dict order
(the order of the ArrayRecord the server holds).
"""

from __future__ import annotations

import numpy as np
import torch

from models.survival import HazardModel
from strategies.mechanisms.discrete_gaussian import sample_discrete_gaussian
from strategies.mechanisms.distributed_dp import RoundPlan
from strategies.mechanisms.dp_sgd_training import _require_hazard_model, clipped_sum_ghost

__all__ = ["rounded_gradient_sum", "site_contribution"]

#: Records whose per-sample gradients are materialised at once.
CHUNK = 256
#: Each record's gradient is re-clipped in float64 to clip_norm * (1 - CLIP_MARGIN).
CLIP_MARGIN = 1e-9


def rounded_gradient_sum(model: HazardModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, clip_norm: float,
                         gamma: float, seed: int) -> np.ndarray:
    """:math:`\\sum_i \\mathrm{round}(\\gamma\\, \\mathrm{clip}_C(g_i))` (int64, state-dict order), no noise."""
    model = _require_hazard_model(model)
    names = [name for name, _ in model.net.named_parameters()]
    if list(model.net.state_dict()) != names:
        raise ValueError("distributed_dp needs a network whose state dict is exactly its parameters")
    torch.manual_seed(seed)
    model.net.train()
    dim = sum(p.numel() for p in model.net.parameters())
    total = torch.zeros(dim, dtype=torch.int64)
    xs, ts, es = (torch.as_tensor(a) for a in (np.asarray(x, np.float32), np.asarray(time), np.asarray(event)))
    for start in range(0, len(xs), CHUNK):
        _, _, _, per_sample = clipped_sum_ghost(model, xs[start:start + CHUNK], ts[start:start + CHUNK],
                                                es[start:start + CHUNK], clip_norm=clip_norm)
        grads = per_sample.gradients().detach().double()
        norms = grads.norm(dim=1, keepdim=True)
        grads = grads * torch.clamp(clip_norm * (1.0 - CLIP_MARGIN) / torch.clamp(norms, min=1e-300), max=1.0)
        total += torch.round(grads * gamma).to(torch.int64).sum(0)
    model.net.zero_grad(set_to_none=True)
    return total.numpy()


def site_contribution(model: HazardModel, data, plan: RoundPlan, *, clip_norm: float, seed: int) -> np.ndarray:
    """The site's integer vector for this round: its rounded clipped gradient sum plus :math:`N_{\\mathbb Z}(0, s^2)^d`."""
    total = rounded_gradient_sum(model, data.x, data.time, data.event, clip_norm=clip_norm, gamma=plan.gamma,
                                 seed=seed)
    if total.size != plan.dim:
        raise ValueError(f"the model has {total.size} parameters, the round's plan {plan.dim}")
    noise = sample_discrete_gaussian(np.random.default_rng(seed), plan.local_sigma ** 2, plan.dim)
    return total + noise
