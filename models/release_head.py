r"""The label holder's model of ``private_split``: a (Bayesian) logistic-hazard network on released embeddings.

The sites release each record's embedding once; the label holder concatenates a record's releases
over the modalities (zeros where a site lacks the record) and fits this head to the training
records for as many epochs as it likes: post-processing, no privacy cost. Prediction draws
``passes`` posterior samples of the head's Bayesian layers on a held-out record's single release,
so the credible band costs nothing either.

.. math::

    h_{il} = \sigma(\phi_{il}), \qquad \phi_i = \text{risk}\big((e_i - \mu) / s\big),

with :math:`e_i` the concatenated releases, :math:`\mu, s` their mean and standard deviation over
the training records, the risk layer :class:`models.multimodal.ProportionalRisk` (one score
shifts every interval's baseline logit) or, with ``risk_layer="interval"``, a linear map per
interval (:func:`models.multimodal.build_risk_layer`), and the loss
:math:`\frac1B\sum_i \ell_i + \mathrm{KL}/N` per batch (:func:`models.losses.logistic_hazard_nll`;
Blundell et al. 2015's minibatch weighting): the printed loss is per record.

Examples
--------
>>> import torch
>>> x = torch.randn(200, 2); t = torch.randint(0, 5, (200,)); e = torch.randint(0, 2, (200,)).float()
>>> head, losses = fit_release_head(x, t, e, num_durations=5, epochs=3, seed=0)
>>> predict_release_head(head, x[:3], passes=4, seed=0).shape
torch.Size([4, 3, 5])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from models.bayesian import kl_divergence, seeded
from models.losses import logistic_hazard_nll
from models.multimodal import build_risk_layer, part_seed

__all__ = ["ReleaseHead", "fit_release_head", "predict_release_head"]


class ReleaseHead(nn.Module):
    """Standardise the concatenated releases, then the risk layer to ``T`` hazard logits."""

    def __init__(self, mean: Tensor, scale: Tensor, num_durations: int, *, bayesian: bool,
                 risk_layer: str = "proportional") -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("scale", scale)
        self.risk = build_risk_layer(mean.numel(), num_durations, bayesian=bayesian, kind=risk_layer)

    def forward(self, x: Tensor) -> Tensor:
        return self.risk((x - self.mean) / self.scale)


def fit_release_head(
    x: Tensor, time_index: Tensor, event: Tensor, *, num_durations: int, risk_layer: str = "proportional",
    bayesian: bool = True, lr: float = 0.01, weight_decay: float = 1e-4, epochs: int = 100,
    batch_size: int = 256, seed: int = 0, on_epoch: Callable[[int, float], None] | None = None,
) -> tuple[ReleaseHead, list[float]]:
    """Fit the head to released embeddings ``x`` (n, D) with discretised labels; returns it and the loss per epoch.

    Every random draw (initialisation, batches, posterior samples, dropout) is a function of ``seed``.
    ``on_epoch(epoch, loss)`` is called after every epoch with its mean loss per record.
    """
    x = x.float()
    if x.ndim != 2 or x.shape[0] != time_index.shape[0] or event.shape != time_index.shape:
        raise ValueError("x must be (n, D) with one time index and event per row")
    scale = x.std(dim=0).clamp_min(1e-6)
    with seeded(part_seed(seed, "release_head")):
        head = ReleaseHead(x.mean(dim=0), scale, num_durations, bayesian=bayesian, risk_layer=risk_layer)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    n = x.shape[0]
    losses = []
    head.train()
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(part_seed(seed, "release_batches", epoch))
        total = 0.0
        for step, batch in enumerate(torch.randperm(n, generator=generator).split(batch_size)):
            with seeded(part_seed(seed, "release_step", epoch, step)):
                logits = head(x[batch])
                loss = logistic_hazard_nll(logits, time_index[batch], event[batch]) + kl_divergence(head) / n
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * batch.numel()
        losses.append(total / n)
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    return head, losses


@torch.no_grad()
def predict_release_head(head: ReleaseHead, x: Tensor, *, passes: int, seed: int) -> Tensor:
    """Hazard logits (passes, n, T): ``passes`` posterior samples of the head on the same releases (eval mode)."""
    head.eval()
    out = []
    for j in range(passes):
        with seeded(part_seed(seed, "release_predict", j)):
            out.append(head(x.float()))
    return torch.stack(out)
