r"""Vertical split learning (BVFLMSP): the sites' and the label holder's steps, and the protocol.

Roles:

* :class:`SplitSite`, a passive party: holds one modality of the cohort, its encoder
  (:func:`models.multimodal.build_encoder`) and the encoder's AdamW optimiser. It releases each
  requested record's embedding clipped to L2 norm ``C`` with ``N(0, σ²C²)`` added
  (:func:`release_embeddings`), counts every release per record, and applies the gradient the
  server returns (plus the gradient of its own KL / N).
* :class:`SplitServer`, the active party: holds the labels, the fusion head
  (:class:`models.multimodal.FusionHead`: attention fusion, prediction head, risk layer) and its
  AdamW optimiser; it computes the BVFLMSP loss on the received embeddings and returns
  ``∂L/∂E_k`` to each site.
* :func:`run_split_training`: the per-batch protocol over an ``exchange`` callable (the transport:
  :class:`LocalSites` in process, or Flower messages in ``flwr_app``). Request ``t`` carries the
  gradient of batch ``t − 1`` *and* the IDs of batch ``t``; its reply carries the embeddings of
  batch ``t``. Training of ``S`` batches takes ``S + 1`` round trips (one per batch, plus the
  last gradient).

Equivalence with the centralised model. Every random draw of step ``t`` is a function of
``part_seed(seed, part, t)`` (posterior samples and dropout of each encoder and of the fusion
head) and of the site's noise seed; a site recomputes the forward pass of batch ``t − 1`` to
back-propagate the returned gradient (the encoders hold no batch statistics or other state that
a forward pass updates, so the recomputed pass is the released one). With the same seeds, the
split model takes exactly the steps of :func:`models.multimodal_training.train_multisurv` with
:func:`embedding_hook` as its hook: the tests check the gradients (σ = 0, no clipping) and the
trained weights.

Privacy (the ledger says all of this): a record's released embedding is a function of that
record's features alone, given the site's current encoder weights and preprocessing, the step's
seeds and the noise (the encoders have no batch norm: :func:`models.multimodal.build_encoder`), so
replacing one record's features moves its own release only, by at most ``2C``. A record's
embedding is released once per epoch and once per prediction pass; the server picks the batches,
so no sub-sampling amplification applies and the site's guarantee is RDP of ``R`` Gaussian
releases, ``R`` the most releases of any record (:mod:`strategies.mechanisms.embedding_dp`). Not
covered: the gradients sent back to the sites, a record's influence on its site's encoder weights
and preprocessing (the training mean and scale of each continuous column, the categories seen) and
through them on every later embedding of other records, the labels (the server holds them), and
which IDs each site holds (the server learns it at alignment). The noise must be secret to the
site: in simulation it is derived from the run seed (reproducible, so a server that knows the seed
could remove it); in a deployment each site draws it from its own secret seed or the operating
system's entropy.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Algorithm 1, §5–6;
Vepakomma et al. (2018), "Split learning for health", arXiv:1812.00564.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from models.bayesian import kl_divergence, seeded
from models.data.vertical import ModalityTransform, fit_modality_transform
from models.multimodal import HEAD_SEED_NAME, FusionHead, build_encoder, bvflmsp_loss, part_seed
from models.multimodal_training import PREDICT_SALT, EmbeddingHook, epoch_batches
from models.split_run import write_site_model
from strategies.mechanisms.embedding_dp import embedding_epsilon
from strategies.mechanisms.embedding_noise import clip_embeddings, privatize_embeddings

__all__ = [
    "NOISE_SALT",
    "LocalSites",
    "PredictRequest",
    "SiteConfig",
    "SiteReply",
    "SiteRequest",
    "SplitServer",
    "SplitSite",
    "SplitSiteError",
    "embedding_hook",
    "noise_seed",
    "predict_split",
    "release_embeddings",
    "run_split_training",
]

#: Salt that keeps a site's noise seeds apart from its encoder's sampling seeds.
NOISE_SALT = 1


class SplitSiteError(RuntimeError):
    """A site failed or is missing; the message names the modality and the reason."""


def noise_seed(base_seed: int, modality: str, step: int) -> int:
    """Seed of the embedding noise a site adds at ``step`` (from the site's own ``base_seed``)."""
    return part_seed(base_seed, modality, step, NOISE_SALT)


def release_embeddings(
    embeddings: Tensor, *, clip_norm: float | None, noise_multiplier: float, noise_seed: int,
) -> Tensor:
    """What the server receives: each row clipped to ``C`` plus ``N(0, (σC)²)`` (differentiable in the rows).

    ``clip_norm=None`` releases the raw embeddings (no privacy; σ must then be 0).
    """
    if clip_norm is None:
        if noise_multiplier:
            raise ValueError("embedding noise needs a clip norm (the noise scale is sigma * C)")
        return embeddings
    generator = torch.Generator().manual_seed(noise_seed)
    return privatize_embeddings(embeddings, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                                generator=generator)


def embedding_hook(*, noise_base_seed: int, clip_norm: float | None, noise_multiplier: float) -> EmbeddingHook:
    """The sites' release as a hook for :func:`models.multimodal_training.train_multisurv` (the centralised twin)."""

    def hook(modality: str, embeddings: Tensor, step: int) -> Tensor:
        return release_embeddings(embeddings, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                                  noise_seed=noise_seed(noise_base_seed, modality, step))

    return hook


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class SiteRequest:
    """One round trip's request to a site: the gradient of one batch and/or the IDs of the next.

    Attributes
    ----------
    backward_ids : list of str or None
        IDs of the batch whose gradient this request carries (batch ``backward_step``).
    backward_step : int
    gradient : numpy.ndarray or None, shape (len(backward_ids), dim)
        ``∂L/∂E`` of those records' released embeddings (zero rows for records the site lacks).
    forward_ids : list of str or None
        IDs of the batch to embed next (batch ``forward_step``).
    forward_step : int
    """

    backward_ids: list[str] | None = None
    backward_step: int = -1
    gradient: np.ndarray | None = None
    forward_ids: list[str] | None = None
    forward_step: int = -1


@dataclass(frozen=True)
class PredictRequest:
    """Embed ``ids`` ``passes`` times (prediction pass ``j`` is step ``first_step + j``).

    ``clean=True`` releases clipped embeddings without noise (an explicit option, labelled
    in the ledger: those records get no guarantee).
    """

    ids: list[str]
    passes: int
    first_step: int = PREDICT_SALT
    clean: bool = False


@dataclass(frozen=True)
class SiteReply:
    """A site's answer: embeddings of the requested records and its privacy position.

    Attributes
    ----------
    embeddings : numpy.ndarray, shape (b, dim) or (passes, b, dim)
        Released embeddings (zero rows where ``present`` is False); empty for a gradient-only request.
    present : numpy.ndarray of bool, shape (b,)
    privacy : dict
        :meth:`SplitSite.privacy_report`.
    """

    embeddings: np.ndarray
    present: np.ndarray
    privacy: dict[str, float]


# --------------------------------------------------------------------------- the site


@dataclass(frozen=True)
class SiteConfig:
    """What the label holder tells every site at set-up (JSON-serialisable).

    Attributes
    ----------
    modality : str
    seed : int
        The run's seed (encoder initialisation, posterior samples, dropout).
    train_ids : tuple of str
        The cohort's training IDs: the site fits its preprocessing on those it holds, and reports
        its privacy separately for training and held-out records.
    num_train : int
        ``N`` of the KL weight ``KL / N``.
    dim, encoder_layers, dropout, bayesian
        Encoder architecture (:func:`models.multimodal.build_encoder`).
    lr, weight_decay : float
        AdamW of the encoder.
    clip_norm : float or None
        ``C`` of the embedding release (None: no clipping and no noise).
    noise_multiplier : float
        ``σ`` (noise std ``σC``).
    delta : float
    adjacency : str
        ``"replace-one"`` (sensitivity 2C) or ``"add-remove"`` (C).
    batch_size, epochs : int
        For the paper's formula ε of ``σ`` (reported beside the RDP ε).
    """

    modality: str
    seed: int
    train_ids: tuple[str, ...]
    num_train: int
    dim: int = 512
    encoder_layers: int = 2
    dropout: float = 0.5
    bayesian: bool = True
    lr: float = 0.001
    weight_decay: float = 1e-4
    clip_norm: float | None = 1.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    adjacency: str = "replace-one"
    batch_size: int = 128
    epochs: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SiteConfig:
        values = json.loads(text)
        values["train_ids"] = tuple(values["train_ids"])
        return cls(**values)


class SplitSite:
    """A passive party: one modality of the cohort, its encoder and its embedding release.

    Parameters
    ----------
    config : SiteConfig
    features : pandas.DataFrame
        The site's modality, one row per record it holds, indexed by record ID (a row of all
        missing values counts as a record the site lacks).
    categorical : sequence of str
        Its categorical columns.
    noise_base_seed : int
        The site's secret seed for the embedding noise (:func:`noise_seed`).
    source : str
        Name of the site's data (file or data set), for error messages.
    """

    def __init__(
        self, config: SiteConfig, features: pd.DataFrame, categorical: Sequence[str] = (), *,
        noise_base_seed: int, source: str = "",
    ) -> None:
        if config.clip_norm is None and config.noise_multiplier:
            raise ValueError("embedding noise needs a clip norm")
        self.config = config
        self.source = source or f"site {config.modality!r}"
        self.noise_base_seed = int(noise_base_seed)
        index = pd.Index(features.index.astype(str))
        if index.has_duplicates:
            raise ValueError(f"{self.source}: duplicate record IDs")
        self.index = index
        held = features.notna().any(axis=1).to_numpy()
        training = index.isin(list(config.train_ids)) & held
        if not training.any():
            raise ValueError(f"{self.source}: holds none of the cohort's training records")
        self.transform: ModalityTransform = fit_modality_transform(
            features.loc[training], categorical=categorical, source=self.source)
        x = self.transform.transform(features, source=self.source)
        x[~held] = 0.0
        self.x = torch.from_numpy(x)
        self.held = torch.from_numpy(held)
        self.is_training = index.isin(list(config.train_ids))
        with seeded(part_seed(config.seed, config.modality)):
            self.encoder = build_encoder(
                cardinalities=self.transform.cardinalities, num_continuous=len(self.transform.continuous),
                dim=config.dim, hidden_layers=config.encoder_layers, dropout=config.dropout,
                bayesian=config.bayesian)
        self.optimizer = torch.optim.AdamW(self.encoder.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.releases = np.zeros(len(index), dtype=np.int64)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, np.ndarray]:
        """Encoder weights and buffers, optimiser moments and release counts as named arrays."""
        arrays = {f"encoder.{key}": value.detach().numpy().copy() for key, value in self.encoder.state_dict().items()}
        optimizer = self.optimizer.state_dict()
        for index, values in optimizer["state"].items():
            for key, value in values.items():
                arrays[f"optimizer.{index}.{key}"] = torch.as_tensor(value).detach().numpy().copy()
        arrays["releases"] = self.releases.copy()
        return arrays

    def load_state_dict(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` saved (the site must have the same config and data)."""
        self.encoder.load_state_dict({key[len("encoder."):]: torch.from_numpy(np.array(value))
                                      for key, value in arrays.items() if key.startswith("encoder.")})
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in arrays.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = torch.from_numpy(np.array(value))
        saved = self.optimizer.state_dict()
        saved["state"] = state
        self.optimizer.load_state_dict(saved)
        self.releases = np.array(arrays["releases"], dtype=np.int64)

    def save(self, directory: str | Path, *, run_token: str) -> Path:
        """Write the trained part this site keeps (encoder weights, configuration, fitted preprocessing) into
        ``directory`` on the site's own disk (:func:`models.split_run.write_site_model`); nothing is sent."""
        return write_site_model(directory, modality=self.config.modality, config=asdict(self.config),
                                transform=self.transform, encoder=self.encoder, run_token=run_token)

    # ------------------------------------------------------------------ steps

    def _rows(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        positions = self.index.get_indexer(list(ids))
        present = positions >= 0
        present[present] = self.held.numpy()[positions[present]]
        return positions, present

    def _inputs(self, positions: np.ndarray, present: np.ndarray) -> Tensor:
        x = torch.zeros(len(positions), self.x.shape[1])
        x[torch.from_numpy(present)] = self.x[torch.from_numpy(positions[present])]
        return x

    def _encode(self, x: Tensor, step: int) -> Tensor:
        with seeded(part_seed(self.config.seed, self.config.modality, step)):
            return self.encoder(x)

    def _release(self, embeddings: Tensor, step: int, *, noise: bool = True) -> Tensor:
        config = self.config
        if not noise:
            return embeddings if config.clip_norm is None else clip_embeddings(embeddings, config.clip_norm)
        return release_embeddings(embeddings, clip_norm=config.clip_norm, noise_multiplier=config.noise_multiplier,
                                  noise_seed=noise_seed(self.noise_base_seed, config.modality, step))

    def backward(self, ids: Sequence[str], gradient: np.ndarray, step: int) -> None:
        """Apply ``∂L/∂E`` of batch ``step`` (recomputing its forward pass) plus ``∂(KL/N)``; one AdamW step."""
        positions, present = self._rows(ids)
        gradient = torch.as_tensor(np.asarray(gradient, dtype=np.float32))
        if gradient.shape != (len(ids), self.config.dim):
            raise ValueError(f"{self.source}: gradient of shape {tuple(gradient.shape)} for {len(ids)} records")
        self.encoder.train()
        embeddings = self._encode(self._inputs(positions, present), step)
        released = self._release(embeddings, step, noise=False)  # the noise is additive: same Jacobian
        mask = torch.from_numpy(present).unsqueeze(1)
        loss = (released * gradient * mask).sum() + kl_divergence(self.encoder) / self.config.num_train
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def embed(self, ids: Sequence[str], step: int) -> tuple[np.ndarray, np.ndarray]:
        """Release the embeddings of batch ``step`` (train mode); count one release per record held."""
        positions, present = self._rows(ids)
        self.encoder.train()
        released = self._release(self._encode(self._inputs(positions, present), step), step)
        released[~torch.from_numpy(present)] = 0.0
        self.releases[positions[present]] += 1
        return released.numpy(), present

    @torch.no_grad()
    def predict(self, request: PredictRequest) -> tuple[np.ndarray, np.ndarray]:
        """``passes`` released embeddings of ``ids`` in eval mode, shape (passes, b, dim)."""
        positions, present = self._rows(request.ids)
        x = self._inputs(positions, present)
        was_training = self.encoder.training
        self.encoder.eval()
        try:
            passes = []
            for j in range(request.passes):
                step = request.first_step + j
                passes.append(self._release(self._encode(x, step), step, noise=not request.clean))
        finally:
            self.encoder.train(was_training)
        out = torch.stack(passes)
        out[:, ~torch.from_numpy(present)] = 0.0
        if not request.clean:
            self.releases[positions[present]] += request.passes
        return out.numpy(), present

    def handle(self, request: SiteRequest) -> SiteReply:
        """One round trip: the gradient of the previous batch first, then the next batch's embeddings."""
        if request.backward_ids is not None:
            if request.gradient is None:
                raise ValueError(f"{self.source}: a backward request without its gradient")
            self.backward(request.backward_ids, request.gradient, request.backward_step)
        if request.forward_ids is None:
            return SiteReply(np.zeros((0, self.config.dim), np.float32), np.zeros(0, bool), self.privacy_report())
        embeddings, present = self.embed(request.forward_ids, request.forward_step)
        return SiteReply(embeddings, present, self.privacy_report())

    # ------------------------------------------------------------------ privacy

    def privacy_report(self) -> dict[str, float]:
        """The site's privacy position after everything it has released.

        ``epsilon``: RDP ε (no amplification) of the most-released record; ``epsilon_training``
        and ``epsilon_held_out``: the same over training and other records; ``releases_max``;
        ``epsilon_paper``: what the paper's formula (Theorem 1) claims for this σ over the
        planned epochs; ``noise_multiplier``, ``clip_norm``. ε is ``inf`` when records were released
        without noise and ``nan`` when nothing was released.
        """
        config = self.config

        def epsilon(releases: np.ndarray) -> float:
            most = int(releases.max(initial=0))
            if most == 0:
                return math.nan
            if config.noise_multiplier == 0:
                return math.inf
            return embedding_epsilon(noise_multiplier=config.noise_multiplier, epochs=most, delta=config.delta,
                                     adjacency=config.adjacency)

        train = self.releases[self.is_training]
        held_out = self.releases[~self.is_training]
        report = {
            "epsilon": epsilon(self.releases),
            "epsilon_training": epsilon(train),
            "epsilon_held_out": epsilon(held_out),
            "releases_max": float(self.releases.max(initial=0)),
            "noise_multiplier": float(config.noise_multiplier),
            "clip_norm": math.nan if config.clip_norm is None else float(config.clip_norm),
            "epsilon_paper": paper_epsilon(config),
        }
        return report


def paper_epsilon(config: SiteConfig) -> float:
    r"""The ε the paper's Theorem 1 claims for σ: :math:`ε = 2p\sqrt{τ \ln(1/δ)}/σ`, ``p = B/N``, ``τ = E⌈N/B⌉``.

    ``inf`` without noise. The formula credits sub-sampling that does not happen here; the ledger
    reports it beside the RDP ε only as the paper's claim.

    References
    ----------
    BVFLMSP paper, Theorem 1, eq. (8), and §6.2.4.
    """
    if config.noise_multiplier == 0:
        return math.inf
    sample_rate = min(config.batch_size / config.num_train, 1.0)
    iterations = config.epochs * math.ceil(config.num_train / config.batch_size)
    return 2.0 * sample_rate * math.sqrt(iterations * math.log(1.0 / config.delta)) / config.noise_multiplier


# --------------------------------------------------------------------------- the server


class SplitServer:
    """The active party: labels of the training records, the fusion head and its optimiser.

    Parameters
    ----------
    modalities : tuple of str
        Modality order (of the fusion's inputs).
    fusion_head : FusionHead
    time_index, event : Tensor, shape (N,)
        Discretised labels of the training records, in ``train_ids`` order.
    train_ids : sequence of str
    seed : int
    lr, weight_decay : float
        AdamW of the fusion head.
    similarity_weight : float, default 0.05
    """

    def __init__(
        self, *, modalities: tuple[str, ...], fusion_head: FusionHead, time_index: Tensor, event: Tensor,
        train_ids: Sequence[str], seed: int, lr: float, weight_decay: float, similarity_weight: float = 0.05,
    ) -> None:
        if len(train_ids) != time_index.shape[0] or event.shape != time_index.shape:
            raise ValueError("train_ids, time_index and event must have one entry per training record")
        self.modalities = modalities
        self.fusion_head = fusion_head
        self.time_index = time_index
        self.event = event
        self.train_ids = np.asarray(train_ids, dtype=object)
        self.seed = seed
        self.similarity_weight = similarity_weight
        self.optimizer = torch.optim.AdamW(fusion_head.parameters(), lr=lr, weight_decay=weight_decay)

    @property
    def num_train(self) -> int:
        return len(self.train_ids)

    def _stack(self, embeddings: Mapping[str, np.ndarray], present: Mapping[str, np.ndarray]) -> tuple[Tensor, Tensor]:
        missing = [name for name in self.modalities if name not in embeddings]
        if missing:
            raise SplitSiteError(f"no embeddings from the sites of modalities {missing}")
        stacked = torch.stack([torch.as_tensor(embeddings[name]) for name in self.modalities], dim=-2)
        mask = torch.stack([torch.as_tensor(present[name]) for name in self.modalities], dim=-1)
        return stacked, mask

    def step(
        self, step: int, batch: Tensor, embeddings: Mapping[str, np.ndarray], present: Mapping[str, np.ndarray],
    ) -> tuple[float, Tensor, dict[str, np.ndarray]]:
        """One optimiser step on batch ``batch`` (positions in ``train_ids``); returns loss, logits and ``∂L/∂E_k``."""
        stacked, mask = self._stack(embeddings, present)
        stacked = stacked.detach().requires_grad_(True)
        self.fusion_head.train()
        masked = stacked.masked_fill(~mask.unsqueeze(-1), 0.0)
        with seeded(part_seed(self.seed, HEAD_SEED_NAME, step)):
            logits = self.fusion_head(masked, mask)
        loss = bvflmsp_loss(logits, self.time_index[batch], self.event[batch], masked,
                            kl=kl_divergence(self.fusion_head), num_train=self.num_train,
                            similarity_weight=self.similarity_weight, mask=mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        gradients = {name: stacked.grad[:, k].numpy().copy() for k, name in enumerate(self.modalities)}
        return float(loss.detach()), logits.detach(), gradients

    @torch.no_grad()
    def predict(self, embeddings: Mapping[str, np.ndarray], present: Mapping[str, np.ndarray], *,
                first_step: int = PREDICT_SALT) -> Tensor:
        """Hazard logits (passes, b, T) from each site's (passes, b, dim) prediction embeddings."""
        stacked, mask = self._stack(embeddings, present)
        was_training = self.fusion_head.training
        self.fusion_head.eval()
        try:
            out = []
            for j in range(stacked.shape[0]):
                with seeded(part_seed(self.seed, HEAD_SEED_NAME, first_step + j)):
                    out.append(self.fusion_head(stacked[j].masked_fill(~mask.unsqueeze(-1), 0.0), mask))
        finally:
            self.fusion_head.train(was_training)
        return torch.stack(out)


# --------------------------------------------------------------------------- the protocol

#: The transport: one request per modality -> one reply per modality (raises SplitSiteError).
Exchange = Callable[[Mapping[str, SiteRequest]], Mapping[str, SiteReply]]


@dataclass
class SplitHistory:
    """What :func:`run_split_training` observed.

    Attributes
    ----------
    epoch_loss : list of float
        Mean training loss per epoch.
    round_trips : int
    batches : int
    privacy : dict
        Each site's last :meth:`SplitSite.privacy_report`.
    """

    epoch_loss: list[float] = field(default_factory=list)
    round_trips: int = 0
    batches: int = 0
    privacy: dict[str, dict[str, float]] = field(default_factory=dict)


def run_split_training(
    server: SplitServer,
    exchange: Exchange,
    *,
    epochs: int,
    batch_size: int,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
) -> SplitHistory:
    """Train the split model: one round trip per batch (gradient of batch ``t−1`` + IDs of batch ``t``).

    The batches are the label holder's (:func:`models.multimodal_training.epoch_batches` with
    ``server.seed``). ``on_epoch(epoch, info)`` is called once the epoch's last gradient has been
    applied, with ``info`` holding ``loss`` (mean over the epoch), ``logits`` and ``positions``
    (the server's predictions for every training record as it trained on them, for a running
    training C-index at no privacy cost) and ``privacy`` (each site's report).
    """
    schedule = [(epoch, batch) for epoch in range(epochs)
                for batch in epoch_batches(server.num_train, batch_size=batch_size, seed=server.seed, epoch=epoch)]
    history = SplitHistory(batches=len(schedule))
    if not schedule:
        return history

    def ids(batch: Tensor) -> list[str]:
        return [str(value) for value in server.train_ids[batch.numpy()]]

    replies = exchange({name: SiteRequest(forward_ids=ids(schedule[0][1]), forward_step=0)
                        for name in server.modalities})
    history.round_trips = 1
    total, logits_seen, positions_seen = 0.0, [], []
    for step, (epoch, batch) in enumerate(schedule):
        loss, logits, gradients = server.step(step, batch, {name: reply.embeddings for name, reply in replies.items()},
                                              {name: reply.present for name, reply in replies.items()})
        total += loss * batch.numel()
        logits_seen.append(logits)
        positions_seen.append(batch)
        following = schedule[step + 1][1] if step + 1 < len(schedule) else None
        replies = exchange({
            name: SiteRequest(backward_ids=ids(batch), backward_step=step, gradient=gradients[name],
                              forward_ids=None if following is None else ids(following), forward_step=step + 1)
            for name in server.modalities
        })
        history.round_trips += 1
        history.privacy = {name: reply.privacy for name, reply in replies.items()}
        if following is None or schedule[step + 1][0] != epoch:
            history.epoch_loss.append(total / server.num_train)
            if on_epoch is not None:
                on_epoch(epoch, {"loss": history.epoch_loss[-1], "logits": torch.cat(logits_seen),
                                 "positions": torch.cat(positions_seen), "privacy": history.privacy})
            total, logits_seen, positions_seen = 0.0, [], []
    return history


def predict_split(
    server: SplitServer, predict: Callable[[Mapping[str, PredictRequest]], Mapping[str, SiteReply]],
    ids: Sequence[str], *, passes: int, first_step: int = PREDICT_SALT, clean: bool = False,
) -> tuple[Tensor, dict[str, dict[str, float]]]:
    """Hazard logits (passes, len(ids), T) of the split model for records ``ids``, and the sites' privacy reports."""
    request = PredictRequest(ids=[str(value) for value in ids], passes=passes, first_step=first_step, clean=clean)
    replies = predict({name: request for name in server.modalities})
    logits = server.predict({name: reply.embeddings for name, reply in replies.items()},
                            {name: reply.present for name, reply in replies.items()}, first_step=first_step)
    return logits, {name: reply.privacy for name, reply in replies.items()}


class LocalSites:
    """In-process transport: the sites are objects in this process (the protocol's tests, the split-epoch benchmark).

    Call it with training requests, or use :meth:`predict` for prediction requests.
    """

    def __init__(self, sites: Mapping[str, SplitSite]) -> None:
        self.sites = dict(sites)
        self.round_trips = 0

    def __call__(self, requests: Mapping[str, SiteRequest]) -> dict[str, SiteReply]:
        self.round_trips += 1
        return {name: self._site(name).handle(request) for name, request in requests.items()}

    def predict(self, requests: Mapping[str, PredictRequest]) -> dict[str, SiteReply]:
        replies = {}
        for name, request in requests.items():
            embeddings, present = self._site(name).predict(request)
            replies[name] = SiteReply(embeddings, present, self._site(name).privacy_report())
        return replies

    def _site(self, name: str) -> SplitSite:
        if name not in self.sites:
            raise SplitSiteError(f"no site holds modality {name!r}")
        return self.sites[name]
