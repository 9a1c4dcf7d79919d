"""Adam for a site's local training: torch's own Adam update, without ``torch.optim.Optimizer``.

The first ``torch.optim`` optimiser a process builds imports ``torch._dynamo`` (``Optimizer``'s
methods are wrapped by ``torch._disable_dynamo``, which imports it on first call): about 1.5 s on
2 cores. A deployed site handles each message in a new process (Flower's subprocess isolation)
and builds one optimiser per training message, so it paid that every round
(``benchmarks/cold_message.py``). :class:`Adam` keeps ``torch.optim.Adam``'s state (``step`` a
float32 tensor, ``exp_avg``, ``exp_avg_sq``) and calls ``torch.optim.adam._single_tensor_adam``,
the function ``torch.optim.Adam.step`` calls for CPU tensors, with the arguments it passes: the
parameters are bit for bit ``torch.optim.Adam``'s (``tests/test_optim.py``, which fails if a
torch upgrade changes the private function; torch is pinned in ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adam import _single_tensor_adam
from torch.optim.optimizer import _get_scalar_dtype

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
        """One Adam step for every parameter with a gradient (torch's ``_init_group`` and ``adam`` for CPU)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            if index not in self.state:
                self.state[index] = (torch.tensor(0.0, dtype=_get_scalar_dtype()),
                                     torch.zeros_like(param, memory_format=torch.preserve_format),
                                     torch.zeros_like(param, memory_format=torch.preserve_format))
            step, exp_avg, exp_avg_sq = self.state[index]
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(exp_avg)
            exp_avg_sqs.append(exp_avg_sq)
            steps.append(step)
        _single_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, grad_scale=None, found_inf=None,
                            amsgrad=False, has_complex=False, beta1=self.betas[0], beta2=self.betas[1], lr=self.lr,
                            weight_decay=self.weight_decay, eps=self.eps, maximize=False, capturable=False,
                            differentiable=False, decoupled_weight_decay=False)
