"""Mini-batch training of a :class:`models.survival.SurvivalModel`.

The same function runs a federated client's local epochs and the centralised baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from models.optim import Adam
from models.survival import SurvivalModel

__all__ = ["ProximalTerm", "train_epochs", "training_tensors"]


class ProximalTerm:
    r"""FedProx's proximal term :math:`\frac{\mu}{2}\lVert w - w_0\rVert_2^2` around the weights :math:`w_0` of ``net``
    when it is created (a site: the global model it was sent).

    :meth:`add_gradient` adds its gradient :math:`\mu (w - w_0)` to every parameter's ``.grad``
    before an optimiser step. It needs no record: under DP-SGD it is added to the privatised
    gradient, as post-processing. ``mu = 0`` adds nothing.

    References
    ----------
    Li et al. (2020), "Federated optimization in heterogeneous networks", MLSys (FedProx).
    """

    def __init__(self, net: torch.nn.Module, mu: float) -> None:
        if not mu >= 0:
            raise ValueError(f"proximal mu must be >= 0, got {mu}")
        self.mu = float(mu)
        self.anchor = [p.detach().clone() for p in net.parameters()] if self.mu > 0 else []

    @torch.no_grad()
    def add_gradient(self, net: torch.nn.Module) -> None:
        """Add ``mu (w - w_0)`` to the gradient of each of ``net``'s parameters (setting it where it is None)."""
        if self.mu == 0:
            return
        for param, anchor in zip(net.parameters(), self.anchor, strict=True):
            pull = (param - anchor) * self.mu
            if param.grad is None:
                param.grad = pull
            else:
                param.grad.add_(pull)


def train_epochs(
    model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, epochs: int, batch_size: int,
    lr: float, weight_decay: float = 0.0, seed: int, on_step: Callable[[], None] | None = None,
    proximal_mu: float = 0.0,
) -> dict[str, float]:
    """Train ``model.net`` in place with Adam on shuffled mini-batches of ``model.loss``.

    Each epoch visits every record once in a fresh random order (the last batch may be smaller). A fresh Adam
    optimiser is created per call, as a federated client does each round. Data become tensors once (features
    float32, times float64 so the hazard model discretises exactly as :func:`models.survival.discretise`).
    Shuffling, dropout and CoxTime's control sampling all draw from generators seeded by ``seed``; the global
    torch RNG is restored afterwards, and ``torch.set_num_threads`` is left to the caller.

    Parameters
    ----------
    model : SurvivalModel
    x : ndarray, shape (n, p)
    time, event : ndarray, shape (n,)
    epochs, batch_size, seed : int
    lr, weight_decay : float
        Adam's learning rate and L2 weight decay (default 0).
    on_step : callable, optional
        Called with no arguments after every optimiser step (e.g. to record the weights' iterates, as ROW-DP does).
    proximal_mu : float, default 0
        FedProx: adds (mu/2) ||w - w_0||^2 (``w_0``: the weights at the call) to the objective
        (:class:`ProximalTerm`); the returned loss is the data loss only.

    Returns
    -------
    dict
        ``loss``: mean of the batch losses of the last epoch, weighted by batch size; ``num_steps``: optimiser
        steps taken.

    References
    ----------
    Kingma & Ba (2015), ICLR (Adam).
    """
    tensors = training_tensors(x, time, event)
    if epochs < 0 or batch_size < 1 or lr <= 0 or weight_decay < 0:
        raise ValueError(f"invalid epochs={epochs}, batch_size={batch_size}, lr={lr}, weight_decay={weight_decay}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = Adam(model.net.parameters(), lr=lr, weight_decay=weight_decay)
    proximal = ProximalTerm(model.net, proximal_mu)
    model.net.train()
    num_steps = 0
    epoch_loss = float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # dropout draws from it (torch.manual_seed: + CUDA, ~1 ms)
        for _ in range(epochs):
            epoch_loss, steps = _epoch(model, tensors, batch_size=batch_size, generator=generator,
                                       optimizer=optimizer, proximal=proximal, on_step=on_step)
            num_steps += steps
    return {"loss": epoch_loss, "num_steps": num_steps}


def training_tensors(x: np.ndarray, time: np.ndarray, event: np.ndarray) -> tuple[torch.Tensor, ...]:
    """``x`` (float32), ``time`` (float64) and ``event`` (float32) as tensors; a ValueError unless they are
    (n, p), (n,) and (n,) with n > 0."""
    x_t = torch.as_tensor(np.asarray(x, dtype=np.float32))
    time_t = torch.as_tensor(np.asarray(time, dtype=np.float64))
    event_t = torch.as_tensor(np.asarray(event, dtype=np.float32))
    n = x_t.shape[0]
    if x_t.ndim != 2 or time_t.shape != (n,) or event_t.shape != (n,) or n == 0:
        raise ValueError(f"need x (n, p), time (n,), event (n,) with n > 0; got {tuple(x_t.shape)}, "
                         f"{tuple(time_t.shape)}, {tuple(event_t.shape)}")
    return x_t, time_t, event_t


def _epoch(model: SurvivalModel, tensors: tuple[torch.Tensor, ...], *, batch_size: int,
           generator: torch.Generator, optimizer: Adam, proximal: ProximalTerm,
           on_step: Callable[[], None] | None) -> tuple[float, int]:
    """One epoch of :func:`train_epochs` over ``tensors`` (features, times, events) in the order of a permutation
    drawn from ``generator``: the mean batch loss weighted by batch size, and the optimiser steps taken."""
    x_t, time_t, event_t = tensors
    n = x_t.shape[0]
    total = 0.0
    steps = 0
    for batch in torch.randperm(n, generator=generator).split(batch_size):
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(x_t[batch], time_t[batch], event_t[batch], generator=generator)
        loss.backward()
        proximal.add_gradient(model.net)
        optimizer.step()
        if on_step is not None:
            on_step()
        total += loss.item() * batch.numel()
        steps += 1
    return total / n, steps
