"""Adam for a site's local training: torch's Adam update in public tensor operations, without ``torch.optim``.

The first ``torch.optim`` optimiser a process builds imports ``torch._dynamo`` (``Optimizer``'s
methods are wrapped by ``torch._disable_dynamo``, which imports it on first call): about 1.5 s on
2 cores. A deployed site handles each message in a new process (Flower's subprocess isolation)
and builds one optimiser per training message, so it paid that every round
(``benchmarks/cold_message.py``). :class:`Adam` keeps ``torch.optim.Adam``'s state (``step`` a
float32 tensor, ``exp_avg``, ``exp_avg_sq``) and applies the update ``torch.optim.Adam.step`` applies
to CPU tensors (Kingma & Ba 2015, Algorithm 1, with L2 weight decay added to the gradient), operation
for operation: the parameters are bit for bit ``torch.optim.Adam``'s (``tests/test_optim.py``, which
fails if a torch version computes its update otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Adam"]


class Adam:
    """``torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)`` (L2 weight decay, no amsgrad) for CPU tensors.

    Only ``zero_grad(set_to_none=True)`` and ``step()``: what the training loops use.

    Example
    -------
    >>> net = torch.nn.Linear(3, 1)
    >>> optimizer = Adam(net.parameters(), lr=0.01)
    >>> net(torch.ones(2, 3)).sum().backward()
    >>> optimizer.step()
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if not lr > 0 or weight_decay < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps >= 0:
            raise ValueError(f"invalid Adam settings: lr={lr}, weight_decay={weight_decay}, betas={betas}, eps={eps}")
        self.params = list(params)
        self.lr, self.weight_decay, self.betas, self.eps = float(lr), float(weight_decay), betas, float(eps)
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step for every parameter with a gradient (a parameter without one keeps its moments)."""
        beta1, beta2 = self.betas
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            if index not in self.state:
                self.state[index] = (torch.tensor(0.0, dtype=torch.float32),
                                     torch.zeros_like(param, memory_format=torch.preserve_format),
                                     torch.zeros_like(param, memory_format=torch.preserve_format))
            step, exp_avg, exp_avg_sq = self.state[index]
            grad = param.grad if self.weight_decay == 0 else param.grad.add(param, alpha=self.weight_decay)
            step += 1
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            count = step.item()
            step_size = self.lr / (1 - beta1**count)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**count) ** 0.5).add_(self.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)
