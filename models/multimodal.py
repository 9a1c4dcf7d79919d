r"""Multimodal survival networks (BVFLMSP and MultiSurv): encoders, attention fusion, head, loss.

One architecture, two kinds of layers. With ``bayesian=True`` (the default) every linear and
embedding layer is a Bayes-by-Backprop layer of :mod:`models.bayesian` (BVFLMSP's
``BayesianMultisurv``); with ``bayesian=False`` they are ``nn.Linear`` / ``nn.Embedding`` and the
network is the frequentist MultiSurv of Vale-Silva & Rohr (2021), whose KL term is zero.

* :class:`BayesianClinicalNet`: encoder of a clinical table (embeddings + continuous columns -> 512).
* :class:`BayesianFC`: encoder of an omics table and the prediction head; width rule
  :func:`hidden_width`. :func:`build_encoder` picks a modality's encoder.
* :class:`AttentionFusion`: per-modality tanh scores, masked softmax, weighted sum.
* :class:`FusionHead`: fusion -> head -> risk layer (discrete-time hazard logits). In vertical
  split learning this is the server's part; the encoders are the sites'. The risk layer is
  :data:`RISK_LAYERS` ``"interval"`` (the paper's: one linear map per interval) or
  ``"proportional"`` (:class:`ProportionalRisk`: one risk score shifting every interval's
  baseline logit).
* :class:`BayesianMultisurv` / :class:`MultiSurv`: encoders + :class:`FusionHead`, the
  centralised models; :func:`build_multisurv` builds either from the modalities' input shapes,
  initialising every part from its own seed (:func:`part_seed`), so that a site building its
  encoder alone gets exactly the centralised model's encoder.
* :func:`bvflmsp_loss`: discrete-time NLL + KL / N + 0.05 x (1 - cosine) alignment term.
* :func:`survival_band`: mean survival curve and credible band over ``m`` stochastic passes
  (the passes: :func:`models.multimodal_training.predict_multisurv`).

Deviation from the paper: no batch norm in the encoders. The paper's clinical net batch-normalises
its continuous columns and its BayesianFC blocks are Linear -> ReLU -> BatchNorm -> Dropout. In
training, batch norm standardises with the statistics of the batch, so a record's embedding would
depend on every other record of its batch; in split learning the embeddings are what the sites
release under differential privacy, with the clip norm bounding one record's sensitivity, and that
bound fails when replacing one record moves the other records' embeddings too. The encoders
(:func:`build_encoder`) therefore map each record alone, in training as in prediction: the
continuous columns enter as the site's preprocessing standardised them (training mean and scale),
and the encoder's FC blocks are Linear -> ReLU -> Dropout. Layer norm (which normalises within a
record) was the other candidate; without noise it lost more test C-index on METABRIC and
synthetic_multimodal than no normalisation, which matched the paper's architecture to within the
seeds' spread at the default two encoder blocks (with four, both lost some, layer norm more). The
prediction head keeps the paper's batch norm: it runs at the label holder on the released
embeddings, so what it computes is post-processing of the sites' releases.

Only torch: the vertical split protocol (sites, server, embedding noise) is
:mod:`strategies.split`.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Secs. 4.2-4.5, 6.2;
Vale-Silva & Rohr (2021), "Long-term cancer survival prediction using multimodal deep learning",
Sci. Rep. 11:13505 (MultiSurv); Blundell et al. (2015), ICML (Bayes by Backprop).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.bayesian import (
    BayesianEmbedding,
    BayesianLinear,
    ScaleMixturePrior,
    bayesian_layers,
    seeded,
)
from models.losses import logistic_hazard_nll
from models.survival import RISK_LAYERS

__all__ = [
    "HEAD_SEED_NAME",
    "AttentionFusion",
    "BayesianClinicalNet",
    "BayesianFC",
    "BayesianMultisurv",
    "FusionHead",
    "MultiSurv",
    "ProportionalRisk",
    "RISK_LAYERS",
    "build_encoder",
    "build_multisurv",
    "bvflmsp_loss",
    "hidden_width",
    "part_seed",
    "survival_band",
]

_WIDTHS = (128, 256, 512, 1024)
#: Name under which the fusion head's seeds are derived (:func:`part_seed`); no modality may use it.
HEAD_SEED_NAME = "fusion_head"


def _linear(in_features: int, out_features: int, prior: ScaleMixturePrior | None, bayesian: bool) -> nn.Module:
    return BayesianLinear(in_features, out_features, prior) if bayesian else nn.Linear(in_features, out_features)


def part_seed(seed: int, name: str, *salt: int) -> int:
    """A seed for one part of the network (a modality's encoder, or :data:`HEAD_SEED_NAME`).

    Derived from the run's ``seed``, the part's name (CRC-32, stable across processes and
    machines) and optional integers (e.g. epoch and batch), so that every party computes the
    same seed for the same draw without communicating.
    """
    return int(np.random.SeedSequence([int(seed), zlib.crc32(name.encode("utf-8")), *map(int, salt)])
               .generate_state(1)[0])


# --------------------------------------------------------------------------- encoders


class BayesianClinicalNet(nn.Module):
    r"""Encoder of a clinical table: embeddings (categoricals) + continuous columns -> 512.

    ``x`` -> [embeddings of the categorical codes, concatenated -> Dropout(``dropout``)] ++
    [continuous columns] -> Linear(``hidden``) -> ReLU -> Linear(``out_features``), with
    Bayesian embeddings and linear layers unless ``bayesian=False`` (MultiSurv's clinical net).
    Each output row depends on its own input row only (given the weights and the random draws).

    The paper (and MultiSurv) batch-normalise the continuous columns; here they enter as given,
    standardised by the site's preprocessing (:class:`models.data.vertical.ModalityTransform`),
    so that no record's embedding depends on the rest of its batch (see the module docstring).
    The per-column scale and shift that batch norm would learn are absorbed by ``fc1``.

    Input convention: one float tensor of shape ``(n, num_categorical + num_continuous)`` whose
    first ``len(cardinalities)`` columns hold integer category codes ``0 .. cardinality - 1``
    (stored as floats, e.g. ``2.0``; they are cast to int64), followed by the continuous columns
    (the layout of :meth:`models.data.vertical.ModalityTransform.transform`). One tensor keeps
    the encoder interchangeable with :class:`BayesianFC` in the model and in the split protocol.
    Codes outside their range or not integer-valued raise ``ValueError``; encode missing
    categories as a category of their own.

    Parameters
    ----------
    cardinalities : sequence of int
        Number of categories of each categorical column (may be empty).
    num_continuous : int
        Number of continuous columns (may be 0, but not together with no categoricals).
    embedding_dim : int, optional
        Dimension of every categorical embedding; default per column
        :math:`\min(50, \lceil c / 2 \rceil)` for cardinality :math:`c` (MultiSurv's rule).
    hidden, out_features : int, default 256, 512
    dropout : float, default 0.5
        Dropout on the concatenated embeddings.
    prior : ScaleMixturePrior, optional
    bayesian : bool, default True

    References
    ----------
    BVFLMSP paper, Sec. 6.2.1 (BayesianClinicalNet); Vale-Silva & Rohr (2021) (MultiSurv clinical net).
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        num_continuous: int,
        embedding_dim: int | None = None,
        hidden: int = 256,
        out_features: int = 512,
        dropout: float = 0.5,
        prior: ScaleMixturePrior | None = None,
        *,
        bayesian: bool = True,
    ) -> None:
        super().__init__()
        self.cardinalities = tuple(int(c) for c in cardinalities)
        if any(c < 1 for c in self.cardinalities) or num_continuous < 0:
            raise ValueError(f"invalid cardinalities {self.cardinalities} or num_continuous {num_continuous}")
        if not self.cardinalities and num_continuous == 0:
            raise ValueError("need at least one categorical or continuous column")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_continuous = num_continuous
        dims = [embedding_dim or min(50, (c + 1) // 2) for c in self.cardinalities]
        self.embeddings = nn.ModuleList(
            BayesianEmbedding(c, d, prior) if bayesian else nn.Embedding(c, d)
            for c, d in zip(self.cardinalities, dims, strict=True)
        )
        self.embedding_dropout = nn.Dropout(dropout)
        self.fc1 = _linear(sum(dims) + num_continuous, hidden, prior, bayesian)
        self.fc2 = _linear(hidden, out_features, prior, bayesian)
        self.out_features = out_features

    @property
    def in_features(self) -> int:
        return len(self.cardinalities) + self.num_continuous

    def forward(self, x: Tensor) -> Tensor:
        """Embedding, shape (n, out_features), of ``x`` (n, num_categorical + num_continuous)."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must have shape (n, {self.in_features}), got {tuple(x.shape)}")
        k = len(self.cardinalities)
        parts: list[Tensor] = []
        if k:
            codes_f = x[:, :k]
            codes = codes_f.round().to(torch.int64)
            limits = torch.tensor(self.cardinalities, device=x.device)
            if bool(((codes_f - codes).abs() > 1e-6).any() | (codes < 0).any() | (codes >= limits).any()):
                raise ValueError(f"categorical codes must be integers in [0, cardinality) for {self.cardinalities}")
            emb = torch.cat([layer(codes[:, j]) for j, layer in enumerate(self.embeddings)], dim=1)
            parts.append(self.embedding_dropout(emb))
        if self.num_continuous:
            parts.append(x[:, k:])
        return self.fc2(F.relu(self.fc1(torch.cat(parts, dim=1))))


def hidden_width(input_size: int, scale: int = 1) -> int:
    """Smallest of {128, 256, 512, 1024} that is >= ``input_size`` (1024 if none), times ``scale``.

    References
    ----------
    BVFLMSP paper, Sec. 6.2.1 (BayesianFC); Vale-Silva & Rohr (2021) (MultiSurv ``FC``).
    """
    if input_size < 1 or scale < 1:
        raise ValueError(f"input_size and scale must be positive, got {input_size}, {scale}")
    return next((w for w in _WIDTHS if w >= input_size), _WIDTHS[-1]) * scale


class BayesianFC(nn.Module):
    r"""MLP: ``num_hidden_layers`` blocks [Linear -> ReLU -> BatchNorm1d -> Dropout], then Linear.

    Every hidden layer has width :func:`hidden_width` ``(in_features, scale)``; the linear layers
    are Bayesian unless ``bayesian=False`` (MultiSurv's ``FC``). Used as the encoder of omics
    modalities (paper: miRNA 1881 inputs, 3 layers, scale 2; DNAm 3774, 5 layers, scale 2;
    mRNA 1000, 3 layers), there without the batch norm (``batch_norm=False``, see
    :func:`build_encoder`), and as the prediction head (512 -> 512, 4 layers), with it.

    Parameters
    ----------
    in_features, out_features : int
    num_hidden_layers : int
        Number of hidden blocks (0: a single linear layer).
    scale : int, default 1
    dropout : float, default 0.5
        Dropout probability of every block (the paper does not state it; 0.5 as its clinical net).
    prior : ScaleMixturePrior, optional
    bayesian : bool, default True
    batch_norm : bool, default True
        The paper's BatchNorm1d in every block. In training it couples the records of a batch;
        ``False`` (blocks Linear -> ReLU -> Dropout) makes each output row a function of its
        own input row.

    References
    ----------
    BVFLMSP paper, Sec. 6.2.1 (BayesianFC).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_hidden_layers: int,
        scale: int = 1,
        dropout: float = 0.5,
        prior: ScaleMixturePrior | None = None,
        *,
        bayesian: bool = True,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        if num_hidden_layers < 0:
            raise ValueError(f"num_hidden_layers must be >= 0, got {num_hidden_layers}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_features = in_features
        self.out_features = out_features
        width = hidden_width(in_features, scale)
        layers: list[nn.Module] = []
        width_in = in_features
        for _ in range(num_hidden_layers):
            layers += [_linear(width_in, width, prior, bayesian), nn.ReLU(),
                       *([nn.BatchNorm1d(width)] if batch_norm else []), nn.Dropout(dropout)]
            width_in = width
        layers.append(_linear(width_in, out_features, prior, bayesian))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Output, shape (n, out_features)."""
        return self.layers(x)


def build_encoder(
    *,
    cardinalities: Sequence[int],
    num_continuous: int,
    dim: int = 512,
    hidden_layers: int = 2,
    scale: int = 1,
    dropout: float = 0.5,
    bayesian: bool = True,
    prior: ScaleMixturePrior | None = None,
) -> nn.Module:
    """The encoder of one modality: :class:`BayesianClinicalNet` when it has categorical columns,
    else :class:`BayesianFC` with ``hidden_layers`` blocks (both output ``dim``).

    The paper's encoders without their batch norm: each record's embedding is a function of that
    record's input, the weights and the random draws (posterior sample, dropout masks) alone,
    also in training mode, so that the embedding a split-learning site releases for one record
    moves by at most ``2C`` (after clipping to ``C``) when that record is replaced and the other
    records' do not move. The encoders hold no buffers. See the module docstring for the
    deviation and why no layer norm replaces it.
    """
    if cardinalities:
        return BayesianClinicalNet(cardinalities, num_continuous, out_features=dim, dropout=dropout, prior=prior,
                                   bayesian=bayesian)
    return BayesianFC(num_continuous, dim, hidden_layers, scale=scale, dropout=dropout, prior=prior,
                      bayesian=bayesian, batch_norm=False)


# --------------------------------------------------------------------------- fusion and model


class AttentionFusion(nn.Module):
    r"""Attention fusion of ``M`` modality embeddings: :math:`z_i = \sum_k \alpha_{ik} E_i^{(k)}`.

    Scores :math:`s_{ik} = \tanh(\text{Linear}(E_i^{(k)}))` (one layer shared by all modalities;
    Bayesian unless ``bayesian=False``), :math:`\alpha_{i\cdot} = \operatorname{softmax}_k(s_{ik})`
    over the modalities present for record :math:`i`. A missing modality gets weight exactly 0
    and its embedding (which may hold anything, even NaN) does not reach the output; a record
    with no modality present gets :math:`z_i = 0` and all-zero weights.

    References
    ----------
    BVFLMSP paper, Secs. 4.2 and 6.2.1 (fusion module); Vale-Silva & Rohr (2021) (MultiSurv fusion).
    """

    def __init__(self, dim: int = 512, prior: ScaleMixturePrior | None = None, *, bayesian: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.score = _linear(dim, 1, prior, bayesian)

    def forward(self, embeddings: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Fuse ``embeddings`` (B, M, dim) with optional boolean ``mask`` (B, M) of present modalities.

        Returns
        -------
        fused : Tensor, shape (B, dim)
        weights : Tensor, shape (B, M)
            Attention weights; each row sums to 1 over present modalities (0 if none present).
        """
        if embeddings.ndim != 3 or embeddings.shape[2] != self.dim:
            raise ValueError(f"embeddings must have shape (B, M, {self.dim}), got {tuple(embeddings.shape)}")
        if mask is None:
            mask = torch.ones(embeddings.shape[:2], dtype=torch.bool, device=embeddings.device)
        elif mask.shape != embeddings.shape[:2] or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor of shape {tuple(embeddings.shape[:2])}")
        embeddings = embeddings.masked_fill(~mask.unsqueeze(-1), 0.0)
        scores = torch.tanh(self.score(embeddings)).squeeze(-1)
        none_present = ~mask.any(dim=1, keepdim=True)
        scores = scores.masked_fill(~mask, float("-inf")).masked_fill(none_present, 0.0)
        weights = torch.softmax(scores, dim=1) * mask
        fused = (weights.unsqueeze(-1) * embeddings).sum(dim=1)
        return fused, weights


class ProportionalRisk(nn.Module):
    r"""Risk layer with one score per record: :math:`\phi_{il} = \beta_l + w^\top x_i`.

    The score :math:`w^\top x_i` (a Bayesian ``Linear(dim, 1)`` unless ``bayesian=False``; its
    bias, redundant with :math:`\beta`, stays near 0 under the prior) shifts every interval's baseline logit :math:`\beta_l` alike: the discrete
    logistic proportional-odds model (Cox 1972, Sec. 6), whose ranking of records is the same at
    every time. The baselines :math:`\beta` are point estimates (like a Breslow baseline; no prior)
    and start at the constant hazard with survival 1/2 at the end of the grid. Against the
    paper's per-interval layer (``Linear(dim, T)``, :math:`T \cdot \text{dim}` weights under the
    prior) it has ``dim`` weights: the records' ranking is learnt from every interval's events at
    once.

    References
    ----------
    Cox (1972), JRSS-B 34:187, Sec. 6 (the discrete logistic model); Gensheimer & Narasimhan
    (2019), PeerJ 7:e6257 (its proportional variant).
    """

    def __init__(self, dim: int, num_durations: int, prior: ScaleMixturePrior | None = None, *,
                 bayesian: bool = True) -> None:
        super().__init__()
        self.score = _linear(dim, 1, prior, bayesian)
        self.baseline = nn.Parameter(torch.full((num_durations,), _half_survival_logit(num_durations)))

    def forward(self, x: Tensor) -> Tensor:
        """Hazard logits (n, T) of inputs (n, dim)."""
        return self.baseline + self.score(x)


def build_risk_layer(dim: int, num_durations: int, prior: ScaleMixturePrior | None = None, *, bayesian: bool = True,
                     kind: str = "proportional") -> nn.Module:
    """The risk layer of ``kind`` (:data:`RISK_LAYERS`): :class:`ProportionalRisk`, or ``"interval"``'s
    ``Linear(dim, T)`` with its bias at the constant hazard of survival 1/2 at the end of the grid."""
    if kind not in RISK_LAYERS:
        raise ValueError(f"risk_layer must be one of {RISK_LAYERS}, got {kind!r}")
    if kind == "proportional":
        return ProportionalRisk(dim, num_durations, prior, bayesian=bayesian)
    layer = _linear(dim, num_durations, prior, bayesian)
    nn.init.constant_(layer.bias_mu if bayesian else layer.bias, _half_survival_logit(num_durations))
    return layer


def _half_survival_logit(num_durations: int) -> float:
    """Logit of the constant hazard whose survival is 1/2 at the end of a ``num_durations`` grid."""
    hazard = 1.0 - 0.5 ** (1.0 / num_durations)
    return math.log(hazard / (1.0 - hazard))


class FusionHead(nn.Module):
    r"""Attention fusion -> prediction head -> risk layer: :math:`\phi_i = \text{risk}(\text{head}(\text{Attn}(E_i)))`.

    ``head = BayesianFC(dim, dim, head_hidden_layers)`` and the risk layer give the hazard logits
    :math:`\phi_{il}`, :math:`h_{il} = \sigma(\phi_{il})`. ``risk_layer="interval"`` is the
    paper's ``Linear(dim, T)``, whose bias (mean) starts at the constant hazard with survival 1/2
    at the end of the grid (as :class:`models.survival.HazardMLP`); ``"proportional"`` is
    :class:`ProportionalRisk`. In split learning this module is the server's; its head keeps the
    paper's batch norm, which only mixes released embeddings (post-processing of the sites'
    releases).

    Parameters
    ----------
    dim : int, default 512
    num_durations : int, default 30
    head_hidden_layers : int, default 4
    head_dropout : float, default 0.5
    prior : ScaleMixturePrior, optional
    bayesian : bool, default True
    risk_layer : {"interval", "proportional"}, default "interval"
        The defaults are the paper's architecture.
    """

    def __init__(
        self,
        dim: int = 512,
        num_durations: int = 30,
        head_hidden_layers: int = 4,
        head_dropout: float = 0.5,
        prior: ScaleMixturePrior | None = None,
        *,
        bayesian: bool = True,
        risk_layer: str = "interval",
    ) -> None:
        super().__init__()
        if num_durations < 1:
            raise ValueError(f"num_durations must be positive, got {num_durations}")
        if risk_layer not in RISK_LAYERS:
            raise ValueError(f"risk_layer must be one of {RISK_LAYERS}, got {risk_layer!r}")
        self.dim = dim
        self.num_durations = num_durations
        self.fusion = AttentionFusion(dim, prior, bayesian=bayesian)
        self.head = BayesianFC(dim, dim, head_hidden_layers, dropout=head_dropout, prior=prior, bayesian=bayesian)
        self.risk = build_risk_layer(dim, num_durations, prior, bayesian=bayesian, kind=risk_layer)

    def forward(self, embeddings: Tensor, mask: Tensor | None = None) -> Tensor:
        """Hazard logits (B, T) from stacked embeddings (B, M, dim) and the presence mask (B, M)."""
        fused, _ = self.fusion(embeddings, mask)
        return self.risk(self.head(fused))


class BayesianMultisurv(nn.Module):
    r"""Centralised multimodal survival net: encoders -> :class:`FusionHead`.

    The same modules, split between sites (``encoders[k]``) and server (``fusion_head``), form
    the BVFLMSP vertical model. ``bayesian=False`` makes the fusion head deterministic; give it
    deterministic encoders too (or use :class:`MultiSurv`).

    Parameters
    ----------
    modality_encoders : dict of str to nn.Module
        One encoder per modality, each mapping its input (n, p_k) to (n, dim); the dict order
        is the modality order of the embeddings and of the mask.
    dim : int, default 512
    num_durations : int, default 30
    head_hidden_layers : int, default 4
    head_dropout : float, default 0.5
    prior : ScaleMixturePrior, optional
        Prior of the fusion, head and risk layers (the encoders bring their own).
    bayesian : bool, default True
    fusion_head : FusionHead, optional
        A ready-made server part (overrides the architecture arguments).

    References
    ----------
    BVFLMSP paper, Sec. 6.2.1; Vale-Silva & Rohr (2021) (MultiSurv).
    """

    def __init__(
        self,
        modality_encoders: Mapping[str, nn.Module],
        dim: int = 512,
        num_durations: int = 30,
        head_hidden_layers: int = 4,
        head_dropout: float = 0.5,
        prior: ScaleMixturePrior | None = None,
        *,
        bayesian: bool = True,
        fusion_head: FusionHead | None = None,
    ) -> None:
        super().__init__()
        if not modality_encoders:
            raise ValueError("need at least one modality encoder")
        if HEAD_SEED_NAME in modality_encoders:
            raise ValueError(f"{HEAD_SEED_NAME!r} is reserved and cannot name a modality")
        self.modalities = tuple(modality_encoders)
        self.encoders = nn.ModuleDict(dict(modality_encoders))
        self.fusion_head = fusion_head if fusion_head is not None else FusionHead(
            dim, num_durations, head_hidden_layers, head_dropout, prior, bayesian=bayesian)
        self.dim = self.fusion_head.dim
        self.num_durations = self.fusion_head.num_durations

    def encode(
        self, inputs: Mapping[str, Tensor], mask: Tensor | None = None, *, seeds: Mapping[str, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Stacked embeddings (B, M, dim) and the mask (B, M).

        A modality absent from ``inputs`` becomes a zero embedding, masked out for every record.
        With ``seeds``, encoder ``k`` runs inside :func:`models.bayesian.seeded` ``(seeds[k])``.
        """
        unknown = set(inputs) - set(self.modalities)
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}; expected {self.modalities}")
        present = [name for name in self.modalities if name in inputs]
        if not present:
            raise ValueError("inputs hold no modality")
        encoded = {}
        for name in present:
            if seeds is None:
                encoded[name] = self.encoders[name](inputs[name])
            else:
                with seeded(seeds[name]):
                    encoded[name] = self.encoders[name](inputs[name])
        ref = encoded[present[0]]
        batch = ref.shape[0]
        zeros = ref.new_zeros(batch, self.dim)
        embeddings = torch.stack([encoded.get(name, zeros) for name in self.modalities], dim=1)
        if embeddings.shape != (batch, len(self.modalities), self.dim):
            raise ValueError(f"encoders must return (B, {self.dim}); got stacked shape {tuple(embeddings.shape)}")
        available = torch.tensor([name in inputs for name in self.modalities], device=ref.device)
        available = available.unsqueeze(0).expand(batch, -1)
        mask = available if mask is None else mask.to(torch.bool) & available
        return embeddings, mask

    def forward(
        self, inputs: Mapping[str, Tensor], mask: Tensor | None = None, *, seeds: Mapping[str, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Hazard logits (B, T) and the per-modality embeddings (B, M, dim) (for the alignment term).

        Parameters
        ----------
        inputs : dict of str to Tensor
            Each modality's input batch, records aligned across modalities.
        mask : BoolTensor, shape (B, M), optional
            Modalities present per record (missing ones: any input, e.g. zeros, masked in fusion).
        seeds : dict of str to int, optional
            Seeds of the pass, per modality and :data:`HEAD_SEED_NAME` for the fusion head: each
            part runs inside :func:`models.bayesian.seeded` of its seed, as the sites and the
            server of the split protocol do.
        """
        embeddings, mask = self.encode(inputs, mask, seeds=seeds)
        if seeds is None:
            return self.fusion_head(embeddings, mask), embeddings
        with seeded(seeds[HEAD_SEED_NAME]):
            return self.fusion_head(embeddings, mask), embeddings


class MultiSurv(BayesianMultisurv):
    """The frequentist MultiSurv: :class:`BayesianMultisurv`'s architecture with deterministic layers.

    Its encoders must hold no Bayesian layer; its KL term (:func:`models.bayesian.kl_divergence`)
    is 0, so :func:`bvflmsp_loss` reduces to NLL + the alignment term.

    References
    ----------
    Vale-Silva & Rohr (2021), Sci. Rep. 11:13505.
    """

    def __init__(
        self,
        modality_encoders: Mapping[str, nn.Module],
        dim: int = 512,
        num_durations: int = 30,
        head_hidden_layers: int = 4,
        head_dropout: float = 0.5,
        *,
        fusion_head: FusionHead | None = None,
    ) -> None:
        parts = [*modality_encoders.values(), *([fusion_head] if fusion_head is not None else [])]
        if any(next(bayesian_layers(part), None) is not None for part in parts):
            raise ValueError("MultiSurv takes deterministic encoders and fusion head (bayesian=False)")
        super().__init__(modality_encoders, dim, num_durations, head_hidden_layers, head_dropout, bayesian=False,
                         fusion_head=fusion_head)


def build_multisurv(
    inputs: Mapping[str, tuple[Sequence[int], int]],
    *,
    seed: int,
    bayesian: bool = True,
    dim: int = 512,
    num_durations: int = 30,
    encoder_layers: int = 2,
    head_layers: int = 4,
    dropout: float = 0.5,
    risk_layer: str = "interval",
) -> BayesianMultisurv:
    """A :class:`BayesianMultisurv` (or :class:`MultiSurv`) for modalities of the given input shapes.

    Each encoder is initialised inside :func:`models.bayesian.seeded` ``(part_seed(seed, k))`` and
    the fusion head inside ``seeded(part_seed(seed, HEAD_SEED_NAME))``: a site that builds its
    own encoder with :func:`build_encoder` under the same seed holds exactly this model's encoder.

    Parameters
    ----------
    inputs : dict of modality name to (cardinalities, num_continuous)
        Input shape of each modality (:attr:`models.data.vertical.ModalityTransform.input_shape`).
    seed : int
    bayesian : bool, default True
    dim, num_durations, encoder_layers, head_layers, dropout, risk_layer
        Architecture (:func:`build_encoder`, :class:`FusionHead`); the defaults are the paper's.
    """
    encoders = {}
    for name, (cardinalities, num_continuous) in inputs.items():
        with seeded(part_seed(seed, name)):
            encoders[name] = build_encoder(cardinalities=cardinalities, num_continuous=num_continuous, dim=dim,
                                           hidden_layers=encoder_layers, dropout=dropout, bayesian=bayesian)
    with seeded(part_seed(seed, HEAD_SEED_NAME)):
        head = FusionHead(dim, num_durations, head_layers, dropout, bayesian=bayesian, risk_layer=risk_layer)
    return (BayesianMultisurv if bayesian else MultiSurv)(encoders, fusion_head=head)


# --------------------------------------------------------------------------- loss and prediction


def _similarity_term(embeddings: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of 1 - cos over (record, modality pair k < l) with both modalities present."""
    num_modalities = embeddings.shape[1]
    if num_modalities < 2:
        return embeddings.new_zeros(())
    k, l_ = torch.triu_indices(num_modalities, num_modalities, offset=1, device=embeddings.device)
    dissim = 1.0 - F.cosine_similarity(embeddings[:, k], embeddings[:, l_], dim=-1)  # (B, P)
    if mask is None:
        return dissim.mean()
    valid = (mask[:, k] & mask[:, l_]).to(dissim.dtype)
    return (dissim * valid).sum() / valid.sum().clamp(min=1.0)


def bvflmsp_loss(
    logits: Tensor, time_index: Tensor, event: Tensor, embeddings: Tensor | Sequence[Tensor], *,
    kl: Tensor | float, num_train: int, similarity_weight: float = 0.05, mask: Tensor | None = None,
) -> Tensor:
    r"""BVFLMSP training objective for one batch (paper eq. (4)).

    .. math::

        \mathcal L = \frac1B \sum_{i=1}^B \ell_i
        + \frac{\mathrm{KL}}{N_{\text{train}}}
        + \lambda \, \frac{1}{B\,P} \sum_{i=1}^B \sum_{k<l} \big(1 - \cos(E_i^{(k)}, E_i^{(l)})\big),

    where :math:`\ell_i` is the discrete-time logistic-hazard NLL
    (:func:`models.losses.logistic_hazard_nll`), :math:`\mathrm{KL}` the summed Monte-Carlo KL
    of every Bayesian layer (:func:`models.bayesian.kl_divergence`; in split learning the
    server passes its own and each site adds the gradient of its KL / N), :math:`P = M(M-1)/2`
    the number of modality pairs and :math:`\lambda` = ``similarity_weight`` (0.05 in the
    paper). Dividing the KL of the whole data set by :math:`N_{\text{train}}` per batch-mean loss
    is Blundell et al.'s minibatch weighting with the NLL scaled to a per-record mean. With
    ``mask`` the alignment term averages only over (record, pair) with both modalities present
    (0 if none); with fewer than two modalities it is 0.

    Parameters
    ----------
    logits : Tensor, shape (B, T)
    time_index : LongTensor, shape (B,)
    event : Tensor, shape (B,)
    embeddings : Tensor (B, M, d) or sequence of M tensors (B, d)
    kl : Tensor or float
    num_train : int
        Number of training records :math:`N_{\text{train}}`.
    similarity_weight : float, default 0.05
    mask : BoolTensor, shape (B, M), optional

    Returns
    -------
    Tensor
        Scalar.

    References
    ----------
    BVFLMSP paper, Sec. 4.5, eq. (4) and the auxiliary loss; Blundell et al. (2015), ICML,
    Sec. 3.4 (minibatch KL weighting); Gensheimer & Narasimhan (2019) (discrete-time NLL).
    """
    if num_train < 1:
        raise ValueError(f"num_train must be positive, got {num_train}")
    embeddings = _batch_embeddings(embeddings, logits.shape[0], mask)
    nll = logistic_hazard_nll(logits, time_index, event)
    loss = nll + kl / num_train
    if similarity_weight:
        loss = loss + similarity_weight * _similarity_term(embeddings, None if mask is None else mask.to(torch.bool))
    return loss


def _batch_embeddings(embeddings: Tensor | Sequence[Tensor], batch: int, mask: Tensor | None) -> Tensor:
    """:func:`bvflmsp_loss`'s embeddings as one (B, M, d) tensor (a sequence of M (B, d) tensors stacked); a
    ValueError unless B is ``batch`` and ``mask`` (if given) is (B, M)."""
    if not isinstance(embeddings, Tensor):
        embeddings = torch.stack(list(embeddings), dim=1)
    if embeddings.ndim != 3 or embeddings.shape[0] != batch:
        raise ValueError(f"embeddings must have shape ({batch}, M, d), got {tuple(embeddings.shape)}")
    if mask is not None and mask.shape != embeddings.shape[:2]:
        raise ValueError(f"mask must have shape {tuple(embeddings.shape[:2])}, got {tuple(mask.shape)}")
    return embeddings

def survival_band(logits: Tensor, *, level: float = 0.95) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean survival curve and pointwise equal-tailed band over ``m`` passes of hazard logits.

    Parameters
    ----------
    logits : Tensor, shape (m, B, T)
        Hazard logits of ``m`` stochastic passes.
    level : float, default 0.95

    Returns
    -------
    mean, lower, upper : Tensor, shape (B, T)
        :math:`\bar S_i(\tau_j)` and the :math:`(1 \mp \text{level})/2` quantiles over passes of
        :math:`S_i(\tau_j) = \prod_{l \le j} (1 - \sigma(\phi_{il}))`.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must have shape (m, B, T), got {tuple(logits.shape)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    curves = torch.cumprod(1.0 - torch.sigmoid(logits), dim=2)
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=curves.dtype, device=curves.device)
    lower, upper = torch.quantile(curves, q, dim=0)
    return curves.mean(dim=0), lower, upper
