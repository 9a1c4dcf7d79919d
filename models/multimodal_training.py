"""Centralised training and prediction of the multimodal survival nets (BayesianMultisurv, MultiSurv).

The loop is written in the split protocol's terms so that the vertical federation
(:mod:`strategies.split`) and this centralised twin compute the same thing: the label holder's
batch order (:func:`epoch_batches`), one seed per part and step for every random draw
(:func:`models.multimodal.part_seed`), and an optional hook applied to each modality's embeddings
before fusion (the sites' clipping and noise, when the twin runs under the same privacy
mechanism). With the same seeds a split run and this loop take the same steps.

Optimiser: AdamW (the paper's), one for all parameters; Adam's update is elementwise, so this is
the same as one AdamW per party with the same hyper-parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.bayesian import kl_divergence, seeded
from models.data.vertical import ModalityTransform, VerticalTable, fit_modality_transform
from models.multimodal import HEAD_SEED_NAME, BayesianMultisurv, bvflmsp_loss, part_seed
from models.survival import discretise

__all__ = [
    "BATCH_SEED_NAME",
    "PREDICT_SALT",
    "EmbeddingHook",
    "MultimodalData",
    "batch_loss",
    "discretised_labels",
    "epoch_batches",
    "fit_transforms",
    "modality_inputs",
    "predict_multisurv",
    "step_seeds",
    "train_multisurv",
]

#: Name under which the label holder's batch permutation seeds are derived.
BATCH_SEED_NAME = "batches"
#: First step of prediction passes (kept apart from training steps, which count up from 0).
PREDICT_SALT = 2**31 - 1

#: ``hook(modality, embeddings, step)`` -> what the server receives in place of ``embeddings``.
EmbeddingHook = Callable[[str, Tensor, int], Tensor]


@dataclass(frozen=True)
class MultimodalData:
    """Aligned records of every modality, with labels on the model's time grid.

    Attributes
    ----------
    inputs : dict of str to Tensor
        Each modality's float32 input (n, p_k) (zeros where the record lacks the modality).
    present : BoolTensor, shape (n, M)
        ``present[i, k]``: record ``i`` has modality ``k`` (``inputs`` order).
    time_index : LongTensor, shape (n,)
    event : Tensor, shape (n,)
    """

    inputs: dict[str, Tensor]
    present: Tensor
    time_index: Tensor
    event: Tensor

    def __post_init__(self) -> None:
        n = self.time_index.shape[0]
        if self.present.shape != (n, len(self.inputs)) or self.present.dtype != torch.bool:
            raise ValueError(f"present must be a bool tensor of shape ({n}, {len(self.inputs)})")
        if self.event.shape != (n,) or any(x.shape[0] != n for x in self.inputs.values()):
            raise ValueError("inputs, time_index and event must have one row per record")

    def __len__(self) -> int:
        return int(self.time_index.shape[0])


def epoch_batches(n: int, *, batch_size: int, seed: int, epoch: int) -> list[Tensor]:
    """The label holder's batches of epoch ``epoch``: a seeded permutation of ``range(n)`` cut into batches.

    The last batch may be smaller. A batch of one record is merged into the one before it
    (the prediction head's batch norm needs two records per batch in training).
    """
    if n < 2 or batch_size < 2:
        raise ValueError(f"need n >= 2 and batch_size >= 2, got {n}, {batch_size}")
    generator = torch.Generator().manual_seed(part_seed(seed, BATCH_SEED_NAME, epoch))
    batches = list(torch.randperm(n, generator=generator).split(batch_size))
    if batches[-1].numel() == 1:
        batches[-2:] = [torch.cat(batches[-2:])]
    return batches


def step_seeds(seed: int, modalities: tuple[str, ...], step: int) -> dict[str, int]:
    """The seeds of one training step: one per modality's encoder and one for the fusion head."""
    return {name: part_seed(seed, name, step) for name in (*modalities, HEAD_SEED_NAME)}


def _forward(model: BayesianMultisurv, inputs: Mapping[str, Tensor], present: Tensor, seeds: Mapping[str, int],
             step: int, hook: EmbeddingHook | None) -> tuple[Tensor, Tensor]:
    embeddings, mask = model.encode(inputs, seeds=seeds)
    mask = mask & present
    if hook is not None:
        embeddings = torch.stack([hook(name, embeddings[:, k], step) for k, name in enumerate(model.modalities)], 1)
    embeddings = embeddings.masked_fill(~mask.unsqueeze(-1), 0.0)
    with seeded(seeds[HEAD_SEED_NAME]):
        return model.fusion_head(embeddings, mask), embeddings


def batch_loss(
    model: BayesianMultisurv, data: MultimodalData, batch: Tensor, *, step: int, seed: int,
    similarity_weight: float = 0.05, hook: EmbeddingHook | None = None,
) -> tuple[Tensor, Tensor]:
    """Loss and hazard logits of training step ``step`` on the records ``batch`` (positions in ``data``).

    Encoder ``k`` runs under ``seeded(part_seed(seed, k, step))``, ``hook(k, E_k, step)`` replaces
    its embeddings (e.g. the sites' clip and noise), missing modalities are zeroed, the fusion head
    runs under ``seeded(part_seed(seed, HEAD_SEED_NAME, step))``, and the loss is
    :func:`models.multimodal.bvflmsp_loss` with the KL of every Bayesian layer over ``N = len(data)``.
    """
    inputs = {name: x[batch] for name, x in data.inputs.items()}
    present = data.present[batch]
    logits, embeddings = _forward(model, inputs, present, step_seeds(seed, model.modalities, step), step, hook)
    loss = bvflmsp_loss(logits, data.time_index[batch], data.event[batch], embeddings, kl=kl_divergence(model),
                        num_train=len(data), similarity_weight=similarity_weight, mask=present)
    return loss, logits


def train_multisurv(
    model: BayesianMultisurv,
    data: MultimodalData,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
    similarity_weight: float = 0.05,
    hook: EmbeddingHook | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place on ``data`` (records of one training set) for ``epochs`` epochs.

    Step ``t`` (counted over epochs) takes one AdamW step on :func:`batch_loss` of the label
    holder's batch ``t`` (:func:`epoch_batches`).

    Returns
    -------
    list of float
        Mean training loss of each epoch (weighted by batch size).
    """
    if epochs < 0 or lr <= 0 or weight_decay < 0:
        raise ValueError(f"invalid epochs={epochs}, lr={lr}, weight_decay={weight_decay}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    n = len(data)
    history = []
    step = 0
    for epoch in range(epochs):
        total = 0.0
        for batch in epoch_batches(n, batch_size=batch_size, seed=seed, epoch=epoch):
            optimizer.zero_grad(set_to_none=True)
            loss, _ = batch_loss(model, data, batch, step=step, seed=seed, similarity_weight=similarity_weight,
                                 hook=hook)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * batch.numel()
            step += 1
        history.append(total / n)
        if on_epoch is not None:
            on_epoch(epoch, history[-1])
    return history


@torch.no_grad()
def predict_multisurv(
    model: BayesianMultisurv,
    inputs: Mapping[str, Tensor],
    present: Tensor,
    *,
    passes: int,
    seed: int,
    first_step: int = PREDICT_SALT,
    hook: EmbeddingHook | None = None,
) -> Tensor:
    """Hazard logits of ``passes`` stochastic passes in eval mode, shape (passes, n, T).

    Pass ``j`` is step ``first_step + j``: every part runs under ``part_seed(seed, part, first_step + j)``
    and the hook (if any) sees that step, as in the split protocol's prediction. Bayesian layers
    draw fresh weights in every pass (a deterministic MultiSurv gives ``passes`` equal rows unless
    the hook adds noise).
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    was_training = model.training
    model.eval()
    try:
        out = []
        for j in range(passes):
            step = first_step + j
            out.append(_forward(model, inputs, present, step_seeds(seed, model.modalities, step), step, hook)[0])
    finally:
        model.train(was_training)
    return torch.stack(out)


def discretised_labels(time: np.ndarray, event: np.ndarray, cuts: np.ndarray) -> tuple[Tensor, Tensor]:
    """Interval indices and event indicators on ``cuts`` as tensors (see :func:`models.survival.discretise`)."""
    idx, ev = discretise(np.asarray(time, dtype=np.float64), np.asarray(event), cuts)
    return torch.from_numpy(idx), torch.from_numpy(ev)


def fit_transforms(table: VerticalTable, train_ids: np.ndarray) -> dict[str, ModalityTransform]:
    """Each modality's preprocessing fitted on its training records (what every site does alone)."""
    train = table.subset(train_ids)
    return {name: fit_modality_transform(frame.dropna(how="all"), categorical=table.categorical.get(name, ()),
                                         source=f"{table.name} modality {name!r}")
            for name, frame in train.modalities.items()}


def modality_inputs(
    table: VerticalTable, ids: np.ndarray, transforms: Mapping[str, ModalityTransform],
) -> tuple[dict[str, Tensor], Tensor]:
    """Preprocessed inputs of records ``ids`` and the presence mask (a record lacks a modality when
    all its values there are missing; its input is then zeros)."""
    part = table.subset(ids)
    inputs, present = {}, []
    for name, frame in part.modalities.items():
        has = frame.notna().any(axis=1).to_numpy()
        x = transforms[name].transform(frame, source=f"{table.name} modality {name!r}")
        x[~has] = 0.0
        inputs[name] = torch.from_numpy(x)
        present.append(torch.from_numpy(has))
    return inputs, torch.stack(present, dim=1)
