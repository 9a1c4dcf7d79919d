r"""The site's numerics of ``distributed_dp``: its rounded clipped gradient sum plus its discrete Gaussian noise.

:func:`site_contribution` computes, at the global model, every training record's gradient of the
hazard model's loss (the factors of ghost clipping, :func:`~strategies.mechanisms.dp_sgd_training.
clipped_sum_ghost`: one forward and backward pass in float32, expanded a chunk of records at a time),
clips each in float64 to :math:`C(1 - 10^{-9})` so that its exact norm is at most :math:`C` whatever the
round-off, scales it by :math:`\gamma`, rounds each coordinate to the nearest integer, sums the records and
adds :math:`N_{\mathbb Z}(0, s^2)` per coordinate. The flat layout is the model's state-dict order
(the order of the ArrayRecord the server holds).
"""

from __future__ import annotations

import numpy as np
import torch

from models.survival import HazardModel
from strategies.mechanisms.discrete_gaussian import sample_discrete_gaussian
from strategies.mechanisms.dp_sgd_training import _ghost_backward, _ghost_plan, _require_hazard_model

__all__ = ["rounded_gradient_sum", "site_contribution"]

#: Records whose per-sample gradients are materialised at once.
CHUNK = 256
#: Each record's gradient is re-clipped in float64 to clip_norm * (1 - CLIP_MARGIN).
CLIP_MARGIN = 1e-9


def rounded_gradient_sum(model: HazardModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, clip_norm: float,
                         gamma: float, seed: int) -> np.ndarray:
    """:math:`\\sum_i \\mathrm{round}(\\gamma\\, \\mathrm{clip}_C(g_i))` (int64, state-dict order), no noise.

    Record ``i``'s gradient of a Linear layer is :math:`\\delta_i a_i^\\top` (and :math:`\\delta_i` for its
    bias), from one forward and backward pass in float32 (the ghost-clipping factors); their products are
    exact in float64, where the norm is computed and the clipping factor applied (to ``clip_norm * (1 -
    CLIP_MARGIN)``). Each record's scaled gradient is rounded entry by entry; the rounded integers are
    summed in float64, exact while a chunk's sum stays below 2^53 (the chunk is shortened when gamma is large).
    """
    model = _require_hazard_model(model)
    plan = _ghost_plan(model.net)
    if plan is None:
        raise ValueError("distributed_dp needs a HazardMLP of Linear layers and parameter-free modules")
    if list(model.net.state_dict()) != plan.names:
        raise ValueError("distributed_dp needs a network whose state dict is exactly its parameters")
    torch.default_generator.manual_seed(seed)  # torch.manual_seed's CPU part, without its lazy CUDA call (~1 ms)
    model.net.train()
    sums = [torch.zeros(p.shape, dtype=torch.int64) for p in plan.params]  # plan.params is state-dict order
    chunk = int(max(1, min(CHUNK, 2.0 ** 52 / (gamma * clip_norm + 1.0))))
    xs, ts, es = (torch.as_tensor(a) for a in (np.asarray(x, np.float32), np.asarray(time), np.asarray(event)))
    for start in range(0, len(xs), chunk):
        rows = slice(start, start + chunk)
        inputs, deltas, _ = _ghost_backward(model, plan, xs[rows], ts[rows], es[rows])
        inputs, deltas = [a.double() for a in inputs], [d.double() for d in deltas]
        squared = sum(d.pow(2).sum(1) * (a.pow(2).sum(1) + (1.0 if layer.bias is not None else 0.0))
                      for layer, a, d in zip(plan.linear, inputs, deltas))
        factor = torch.clamp(clip_norm * (1.0 - CLIP_MARGIN) / torch.clamp(squared.sqrt(), min=1e-300), max=1.0)
        position = 0
        for layer, a, d in zip(plan.linear, inputs, deltas):
            scaled = d * (factor * gamma).unsqueeze(1)
            if layer.weight is not None:  # a proportional net's baselines have none
                sums[position] += (scaled.unsqueeze(2) * a.unsqueeze(1)).round_().sum(0).to(torch.int64)
                position += 1  # rounded in place: one n x out x in temporary
            if layer.bias is not None:
                sums[position] += scaled.round_().sum(0).to(torch.int64)
                position += 1
    return torch.cat([total.reshape(-1) for total in sums]).numpy()


def site_contribution(model: HazardModel, data, *, clip_norm: float, gamma: float, local_sigma: float, dim: int,
                      seed: int) -> np.ndarray:
    """The site's integer vector for this round: its rounded clipped gradient sum plus :math:`N_{\\mathbb Z}(0, s^2)^d`.

    ``gamma``, ``local_sigma`` (s) and ``dim`` (d) are the round's public plan
    (:class:`~strategies.mechanisms.distributed_dp.RoundPlan`); ValueError when the model has not ``dim`` parameters.
    """
    total = rounded_gradient_sum(model, data.x, data.time, data.event, clip_norm=clip_norm, gamma=gamma, seed=seed)
    if total.size != dim:
        raise ValueError(f"the model has {total.size} parameters, the round's plan {dim}")
    noise = sample_discrete_gaussian(np.random.default_rng(seed), local_sigma ** 2, dim)
    return total + noise
