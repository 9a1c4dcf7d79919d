r"""The site's numerics of ``distributed_dp``: its rounded clipped gradient sum plus its discrete Gaussian noise.

:func:`site_contribution` computes, at the global model, every training record's gradient of the
hazard model's loss (the ghost-clipping factors of :func:`~strategies.mechanisms.dp_sgd_training.
clipped_sum_ghost`, expanded a chunk of records at a time), re-clips each in float64 to
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
    """:math:`\\sum_i \\mathrm{round}(\\gamma\\, \\mathrm{clip}_C(g_i))` (int64, state-dict order), no noise.

    Record ``i``'s gradient of a Linear layer is :math:`\\delta_i a_i^\\top` (and :math:`\\delta_i` for its
    bias), the ghost-clipping factors in float32; their products are exact in float64, where the norm
    is computed and the clipping factor applied (to ``clip_norm * (1 - CLIP_MARGIN)``). Each record's
    scaled gradient is rounded entry by entry; the rounded integers are summed in float64, exact while
    a chunk's sum stays below 2^53 (the chunk is shortened when gamma is large).
    """
    model = _require_hazard_model(model)
    parameters = dict(model.net.named_parameters())
    names = list(parameters)
    if list(model.net.state_dict()) != names:
        raise ValueError("distributed_dp needs a network whose state dict is exactly its parameters")
    torch.default_generator.manual_seed(seed)  # torch.manual_seed's CPU part, without its lazy CUDA call (~1 ms)
    model.net.train()
    sums = {name: torch.zeros(p.shape, dtype=torch.int64) for name, p in parameters.items()}
    name_of = {id(p): name for name, p in parameters.items()}
    chunk = int(max(1, min(CHUNK, 2.0 ** 52 / (gamma * clip_norm + 1.0))))
    xs, ts, es = (torch.as_tensor(a) for a in (np.asarray(x, np.float32), np.asarray(time), np.asarray(event)))
    for start in range(0, len(xs), chunk):
        _, _, _, per_sample = clipped_sum_ghost(model, xs[start:start + chunk], ts[start:start + chunk],
                                                es[start:start + chunk], clip_norm=clip_norm)
        inputs = [a.double() for a in per_sample._inputs]
        deltas = [d.double() for d in per_sample._deltas]
        squared = sum(d.pow(2).sum(1) * (a.pow(2).sum(1) + (1.0 if layer.bias is not None else 0.0))
                      for layer, a, d in zip(per_sample._linear, inputs, deltas))
        factor = torch.clamp(clip_norm * (1.0 - CLIP_MARGIN) / torch.clamp(squared.sqrt(), min=1e-300), max=1.0)
        for layer, a, d in zip(per_sample._linear, inputs, deltas):
            scaled = d * (factor * gamma).unsqueeze(1)
            if layer.weight is not None:  # a proportional net's baselines have none
                weight = (scaled.unsqueeze(2) * a.unsqueeze(1)).round_().sum(0)  # rounded in place: one n x out x in
                sums[name_of[id(layer.weight)]] += weight.to(torch.int64)
            if layer.bias is not None:
                sums[name_of[id(layer.bias)]] += torch.round(scaled).sum(0).to(torch.int64)
    model.net.zero_grad(set_to_none=True)
    return torch.cat([sums[name].reshape(-1) for name in names]).numpy()


def site_contribution(model: HazardModel, data, plan: RoundPlan, *, clip_norm: float, seed: int) -> np.ndarray:
    """The site's integer vector for this round: its rounded clipped gradient sum plus :math:`N_{\\mathbb Z}(0, s^2)^d`."""
    total = rounded_gradient_sum(model, data.x, data.time, data.event, clip_norm=clip_norm, gamma=plan.gamma,
                                 seed=seed)
    if total.size != plan.dim:
        raise ValueError(f"the model has {total.size} parameters, the round's plan {plan.dim}")
    noise = sample_discrete_gaussian(np.random.default_rng(seed), plan.local_sigma ** 2, plan.dim)
    return total + noise
