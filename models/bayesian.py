r"""Bayesian multimodal survival networks (BVFLMSP): Bayes-by-Backprop layers, encoders, fusion, loss.

Every Bayesian layer holds a mean-field Gaussian variational posterior
:math:`q(w \mid \theta) = \prod_j \mathcal N(w_j; \mu_j, \sigma_j^2)`, :math:`\sigma_j = \operatorname{softplus}(\rho_j)`,
on its weights *and* biases, and a scale-mixture ("spike and slab") prior

.. math::

    p(w) = \prod_j \big[\pi\, \mathcal N(w_j; 0, \sigma_1^2) + (1 - \pi)\, \mathcal N(w_j; 0, \sigma_2^2)\big],
    \qquad \pi = 0.5,\ \sigma_1 = 0.3\ (\text{slab}),\ \sigma_2 = 0.001\ (\text{spike}).

Each forward pass draws fresh weights :math:`w = \mu + \sigma \odot \varepsilon`,
:math:`\varepsilon \sim \mathcal N(0, I)` (in train *and* eval mode, so ``m`` passes give ``m``
posterior draws for predictive uncertainty), and stores the one-sample Monte-Carlo KL estimate
:math:`\log q(w \mid \theta) - \log p(w)` of that draw in ``layer.kl``; :func:`kl_divergence` sums them.
The KL of the scale-mixture prior has no closed form, hence the Monte-Carlo estimate
(Blundell et al. 2015, Sec. 3.2). Setting ``layer.sample = False`` (or :func:`set_sampling`,
:func:`posterior_mean`) uses the posterior mean instead, which makes the network deterministic.

Modules:

* :class:`BayesianLinear`, :class:`BayesianEmbedding`: the layers.
* :class:`BayesianClinicalNet`: encoder of a clinical table (Bayesian embeddings + batch norm).
* :class:`BayesianFC`: encoder of an omics table and the prediction head; width rule
  :func:`hidden_width`.
* :class:`AttentionFusion`: per-modality tanh scores, masked softmax, weighted sum.
* :class:`BayesianMultisurv`: the centralised twin, encoders -> fusion -> head -> risk layer
  (discrete-time hazard logits).
* :func:`bvflmsp_loss`: discrete-time NLL + KL / N + 0.05 x (1 - cosine) alignment term.
* :func:`mc_survival`: ``m`` stochastic passes -> mean survival curve and a credible band.

Only torch: the vertical split protocol (sites, server, embedding noise) lives elsewhere.

References
----------
Blundell, Cornebise, Kavukcuoglu & Wierstra (2015), "Weight Uncertainty in Neural Networks",
ICML (Bayes by Backprop). BVFLMSP paper (``shared/papers/bvflmsp-vertical-bayesian-survival.txt``),
Secs. 4.2-4.5, 6.2. Vale-Silva & Rohr (2021), Sci. Rep. 11:13505 (MultiSurv).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.losses import logistic_hazard_nll

__all__ = [
    "AttentionFusion",
    "BayesianClinicalNet",
    "BayesianEmbedding",
    "BayesianFC",
    "BayesianLinear",
    "BayesianMultisurv",
    "ScaleMixturePrior",
    "bvflmsp_loss",
    "hidden_width",
    "kl_divergence",
    "mc_survival",
    "posterior_mean",
    "set_sampling",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_WIDTHS = (128, 256, 512, 1024)


# --------------------------------------------------------------------------- prior


class ScaleMixturePrior(nn.Module):
    r"""Scale mixture of two zero-mean Gaussians, :math:`\pi \mathcal N(0, \sigma_1^2) + (1-\pi) \mathcal N(0, \sigma_2^2)`.

    With the defaults this is the BVFLMSP "spike and slab" prior
    :math:`0.5\,\mathcal N(0, 0.3^2) + 0.5\,\mathcal N(0, 0.001^2)`, the same for every weight and bias.
    The log density is evaluated as a ``logsumexp`` of the two components' log densities, so it
    stays finite where either component's density underflows (e.g. :math:`|w| \gg \sigma_2`).

    Parameters
    ----------
    pi : float, default 0.5
        Weight of the first (slab) component, in (0, 1).
    sigma1, sigma2 : float, default 0.3, 0.001
        Standard deviations of the slab and of the spike.

    References
    ----------
    Blundell et al. (2015), ICML, eq. (7); BVFLMSP paper, Sec. 6.2.1.
    """

    def __init__(self, pi: float = 0.5, sigma1: float = 0.3, sigma2: float = 0.001) -> None:
        super().__init__()
        if not 0.0 < pi < 1.0:
            raise ValueError(f"pi must lie in (0, 1), got {pi}")
        if sigma1 <= 0 or sigma2 <= 0:
            raise ValueError(f"sigma1 and sigma2 must be positive, got {sigma1}, {sigma2}")
        self.pi = float(pi)
        self.sigma1 = float(sigma1)
        self.sigma2 = float(sigma2)
        # log(weight_c) - log(sigma_c) - log(2 pi)/2 per component c
        self._log_const = (
            math.log(self.pi) - math.log(self.sigma1) - _HALF_LOG_2PI,
            math.log1p(-self.pi) - math.log(self.sigma2) - _HALF_LOG_2PI,
        )

    def log_density(self, w: Tensor) -> Tensor:
        """Elementwise :math:`\\log p(w_j)`, same shape as ``w``."""
        c1, c2 = self._log_const
        log1 = c1 - 0.5 * (w / self.sigma1) ** 2
        log2 = c2 - 0.5 * (w / self.sigma2) ** 2
        return torch.logaddexp(log1, log2)

    def log_prob(self, w: Tensor) -> Tensor:
        r""":math:`\sum_j \log p(w_j)` over every element of ``w`` (scalar tensor)."""
        return self.log_density(w).sum()

    def extra_repr(self) -> str:
        return f"pi={self.pi}, sigma1={self.sigma1}, sigma2={self.sigma2}"


# --------------------------------------------------------------------------- layers


def _inverse_softplus(y: float) -> float:
    """:math:`\\rho` with :math:`\\operatorname{softplus}(\\rho) = y` (stable for small and large y)."""
    return y + math.log(-math.expm1(-y))


def _gaussian_log_prob(w: Tensor, mu: Tensor, sigma: Tensor) -> Tensor:
    return (-0.5 * ((w - mu) / sigma) ** 2 - torch.log(sigma) - _HALF_LOG_2PI).sum()


class _BayesianModule(nn.Module):
    """Shared machinery: (mu, rho) pairs, reparameterised sampling, Monte-Carlo KL in ``self.kl``."""

    kl: Tensor | None

    def __init__(self, prior: ScaleMixturePrior | None, generator: torch.Generator | None) -> None:
        super().__init__()
        self.prior = prior if prior is not None else ScaleMixturePrior()
        self.generator = generator
        self.sample = True
        self.kl = None

    def _draw(self, mu: Tensor, rho: Tensor) -> tuple[Tensor, Tensor]:
        """A reparameterised draw ``mu + softplus(rho) * eps`` and its ``log q - log p``."""
        sigma = F.softplus(rho)
        eps = torch.randn(mu.shape, generator=self.generator, device=mu.device, dtype=mu.dtype)
        w = mu + sigma * eps
        kl = _gaussian_log_prob(w, mu, sigma) - self.prior.log_prob(w)
        return w, kl

    def _weights(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """Weights for this forward (draws, or means when ``sample`` is False) and ``self.kl``.

        In posterior-mean mode the KL estimate still comes from a fresh draw (it does not enter
        the output), so a loss built from ``self.kl`` is the same estimator in both modes.
        """
        draws = [self._draw(mu, rho) for mu, rho in pairs]
        self.kl = torch.stack([kl for _, kl in draws]).sum()
        if self.sample:
            return [w for w, _ in draws]
        return [mu for mu, _ in pairs]


class BayesianLinear(_BayesianModule):
    r"""Linear layer :math:`y = x W^\top + b` with a Gaussian mean-field posterior on :math:`W` and :math:`b`.

    Initialisation: :math:`\mu_W` as ``nn.Linear`` (Kaiming-uniform with :math:`a = \sqrt 5`,
    i.e. :math:`U(\pm 1/\sqrt{\text{fan\_in}})`), :math:`\mu_b \sim U(\pm 1/\sqrt{\text{fan\_in}})`, and
    :math:`\rho` constant with :math:`\sigma_0 = \operatorname{softplus}(\rho) =
    \min(0.05,\ 0.1/\sqrt{\text{fan\_in}})` unless ``init_sigma`` is given. This keeps the initial
    weight noise's contribution to a unit's pre-activation variance,
    :math:`\text{fan\_in}\,\sigma_0^2 \le 0.01` per unit-variance input, small next to the
    signal's (:math:`1/3`), so wide layers start close to their deterministic counterpart;
    :math:`\sigma_0` lies in :math:`[10^{-3}, 5 \cdot 10^{-2}]` for fan-in up to :math:`10^4`.

    Parameters
    ----------
    in_features, out_features : int
    prior : ScaleMixturePrior, optional
        Default ``ScaleMixturePrior()`` (BVFLMSP spike and slab).
    init_sigma : float, optional
        Initial posterior standard deviation :math:`\sigma_0` of every weight and bias.
    generator : torch.Generator, optional
        Source of the :math:`\varepsilon` draws (on the parameters' device), for reproducible sampling.

    Attributes
    ----------
    sample : bool
        ``True`` (default, train and eval mode): a fresh posterior draw per forward;
        ``False``: the posterior mean.
    kl : Tensor or None
        Monte-Carlo estimate :math:`\log q(w \mid \theta) - \log p(w)` from the last forward
        (differentiable in :math:`\mu, \rho`).

    References
    ----------
    Blundell et al. (2015), ICML, Secs. 3.1-3.2 (reparameterisation, Monte-Carlo KL).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        prior: ScaleMixturePrior | None = None,
        *,
        init_sigma: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(prior, generator)
        if in_features < 1 or out_features < 1:
            raise ValueError(f"layer sizes must be positive, got {in_features}, {out_features}")
        self.in_features = in_features
        self.out_features = out_features
        if init_sigma is None:
            init_sigma = min(0.05, 0.1 / math.sqrt(in_features))
        if init_sigma <= 0:
            raise ValueError(f"init_sigma must be positive, got {init_sigma}")
        rho0 = _inverse_softplus(init_sigma)
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_rho = nn.Parameter(torch.full((out_features, in_features), rho0))
        self.bias_mu = nn.Parameter(torch.empty(out_features))
        self.bias_rho = nn.Parameter(torch.full((out_features,), rho0))
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.bias_mu, -bound, bound)

    @property
    def weight_sigma(self) -> Tensor:
        return F.softplus(self.weight_rho)

    @property
    def bias_sigma(self) -> Tensor:
        return F.softplus(self.bias_rho)

    def forward(self, x: Tensor) -> Tensor:
        """Output for input ``x`` of shape (..., in_features); sets ``self.kl``."""
        weight, bias = self._weights([(self.weight_mu, self.weight_rho), (self.bias_mu, self.bias_rho)])
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sample={self.sample}"


class BayesianEmbedding(_BayesianModule):
    r"""Embedding table with a Gaussian mean-field posterior on every entry.

    The whole table is drawn per forward and ``kl`` covers the whole table (every parameter
    carries the prior, not only the rows looked up). :math:`\mu \sim \mathcal N(0, 0.3^2)`
    (the slab's scale; ``nn.Embedding`` uses :math:`\mathcal N(0, 1)`, which the prior would
    penalise heavily) and :math:`\sigma_0 = 0.01` unless ``init_sigma`` is given.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
    prior : ScaleMixturePrior, optional
    init_sigma : float, default 0.01
    generator : torch.Generator, optional

    References
    ----------
    Blundell et al. (2015), ICML; BVFLMSP paper, Sec. 6.2.1 (Bayesian embeddings for categoricals).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        prior: ScaleMixturePrior | None = None,
        *,
        init_sigma: float = 0.01,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(prior, generator)
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"sizes must be positive, got {num_embeddings}, {embedding_dim}")
        if init_sigma <= 0:
            raise ValueError(f"init_sigma must be positive, got {init_sigma}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight_mu = nn.Parameter(torch.randn(num_embeddings, embedding_dim) * 0.3)
        self.weight_rho = nn.Parameter(torch.full((num_embeddings, embedding_dim), _inverse_softplus(init_sigma)))

    @property
    def weight_sigma(self) -> Tensor:
        return F.softplus(self.weight_rho)

    def forward(self, idx: Tensor) -> Tensor:
        """Rows for integer codes ``idx`` (LongTensor, any shape); output shape ``idx.shape + (dim,)``."""
        (weight,) = self._weights([(self.weight_mu, self.weight_rho)])
        return F.embedding(idx, weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, sample={self.sample}"


def _bayesian_layers(module: nn.Module) -> Iterator[_BayesianModule]:
    return (m for m in module.modules() if isinstance(m, _BayesianModule))


def kl_divergence(module: nn.Module) -> Tensor:
    r"""Sum of ``kl`` over every Bayesian layer in ``module`` (its last forward's Monte-Carlo estimates).

    Layers not run since construction contribute nothing; a layer run several times in one
    forward contributes only its last draw. Returns a scalar zero when there is nothing to sum.
    """
    kls = [m.kl for m in _bayesian_layers(module) if m.kl is not None]
    if not kls:
        p = next(module.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return torch.stack(kls).sum()


def set_sampling(module: nn.Module, sample: bool) -> None:
    """Switch every Bayesian layer in ``module`` to posterior draws (True) or posterior means (False)."""
    for m in _bayesian_layers(module):
        m.sample = bool(sample)


@contextmanager
def posterior_mean(module: nn.Module) -> Iterator[None]:
    """Context in which every Bayesian layer of ``module`` uses its posterior mean (restored on exit)."""
    layers = list(_bayesian_layers(module))
    saved = [m.sample for m in layers]
    try:
        for m in layers:
            m.sample = False
        yield
    finally:
        for m, s in zip(layers, saved, strict=True):
            m.sample = s


# --------------------------------------------------------------------------- encoders


class BayesianClinicalNet(nn.Module):
    r"""Encoder of a clinical table: Bayesian embeddings (categoricals) + batch norm (continuous) -> 512.

    ``x`` -> [embeddings of the categorical codes, concatenated -> Dropout(``dropout``)] ++
    [BatchNorm1d(continuous)] -> BayesianLinear(``hidden``) -> ReLU -> BayesianLinear(``out_features``).

    Input convention: one float tensor of shape ``(n, num_categorical + num_continuous)`` whose
    first ``len(cardinalities)`` columns hold integer category codes ``0 .. cardinality - 1``
    (stored as floats, e.g. ``2.0``; they are cast to int64), followed by the continuous columns.
    One tensor keeps the encoder interchangeable with :class:`BayesianFC` in
    :class:`BayesianMultisurv` and in the split protocol. Codes outside their range or not
    integer-valued raise ``ValueError``; encode missing categories as a category of their own.

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
            BayesianEmbedding(c, d, prior) for c, d in zip(self.cardinalities, dims, strict=True)
        )
        self.embedding_dropout = nn.Dropout(dropout)
        self.batch_norm = nn.BatchNorm1d(num_continuous) if num_continuous else None
        self.fc1 = BayesianLinear(sum(dims) + num_continuous, hidden, prior)
        self.fc2 = BayesianLinear(hidden, out_features, prior)
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
        if self.batch_norm is not None:
            parts.append(self.batch_norm(x[:, k:]))
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
    r"""Bayesian MLP: ``num_hidden_layers`` blocks [BayesianLinear -> ReLU -> BatchNorm1d -> Dropout], then BayesianLinear.

    Every hidden layer has width :func:`hidden_width` ``(in_features, scale)``. Used as the
    encoder of omics modalities (paper: miRNA 1881 inputs, 3 layers, scale 2; DNAm 3774, 5
    layers, scale 2; mRNA 1000, 3 layers) and as the prediction head (512 -> 512, 4 layers).

    Parameters
    ----------
    in_features, out_features : int
    num_hidden_layers : int
        Number of hidden blocks (0: a single Bayesian linear layer).
    scale : int, default 1
    dropout : float, default 0.5
        Dropout probability of every block (the paper does not state it; 0.5 as its clinical net).
    prior : ScaleMixturePrior, optional

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
            layers += [BayesianLinear(width_in, width, prior), nn.ReLU(), nn.BatchNorm1d(width), nn.Dropout(dropout)]
            width_in = width
        layers.append(BayesianLinear(width_in, out_features, prior))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Output, shape (n, out_features)."""
        return self.layers(x)


# --------------------------------------------------------------------------- fusion and model


class AttentionFusion(nn.Module):
    r"""Attention fusion of ``M`` modality embeddings: :math:`z_i = \sum_k \alpha_{ik} E_i^{(k)}`.

    Scores :math:`s_{ik} = \tanh(\text{BayesianLinear}(E_i^{(k)}))` (one layer shared by all
    modalities), :math:`\alpha_{i\cdot} = \operatorname{softmax}_k(s_{ik})` over the modalities
    present for record :math:`i`. A missing modality gets weight exactly 0 and its embedding
    (which may hold anything, even NaN) does not reach the output; a record with no modality
    present gets :math:`z_i = 0` and all-zero weights.

    References
    ----------
    BVFLMSP paper, Secs. 4.2 and 6.2.1 (fusion module); Vale-Silva & Rohr (2021) (MultiSurv fusion).
    """

    def __init__(self, dim: int = 512, prior: ScaleMixturePrior | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.score = BayesianLinear(dim, 1, prior)

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


class BayesianMultisurv(nn.Module):
    r"""Centralised Bayesian multimodal survival net: encoders -> attention fusion -> head -> risk layer.

    :math:`\phi_i = \text{risk}(\text{head}(\text{Attn}(E_i^{(1)}, \dots, E_i^{(M)})))`, with
    ``head = BayesianFC(dim, dim, head_hidden_layers)`` and ``risk = BayesianLinear(dim, T)``
    giving the hazard logits :math:`\phi_{il}`, :math:`h_{il} = \sigma(\phi_{il})`. The risk
    layer's bias means start at the constant hazard with survival 1/2 at the end of the grid
    (as :class:`models.survival.HazardMLP`). The same modules, split between sites and server,
    form the BVFLMSP vertical model.

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
    ) -> None:
        super().__init__()
        if not modality_encoders:
            raise ValueError("need at least one modality encoder")
        if num_durations < 1:
            raise ValueError(f"num_durations must be positive, got {num_durations}")
        self.modalities = tuple(modality_encoders)
        self.encoders = nn.ModuleDict(dict(modality_encoders))
        self.dim = dim
        self.num_durations = num_durations
        self.fusion = AttentionFusion(dim, prior)
        self.head = BayesianFC(dim, dim, head_hidden_layers, dropout=head_dropout, prior=prior)
        self.risk = BayesianLinear(dim, num_durations, prior)
        hazard = 1.0 - 0.5 ** (1.0 / num_durations)
        nn.init.constant_(self.risk.bias_mu, math.log(hazard / (1.0 - hazard)))

    def encode(self, inputs: Mapping[str, Tensor], mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Stacked embeddings (B, M, dim) and the mask (B, M).

        A modality absent from ``inputs`` becomes a zero embedding, masked out for every record.
        """
        unknown = set(inputs) - set(self.modalities)
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}; expected {self.modalities}")
        present = [name for name in self.modalities if name in inputs]
        if not present:
            raise ValueError("inputs hold no modality")
        encoded = {name: self.encoders[name](inputs[name]) for name in present}
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

    def forward(self, inputs: Mapping[str, Tensor], mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Hazard logits (B, T) and the per-modality embeddings (B, M, dim) (for the alignment term).

        Parameters
        ----------
        inputs : dict of str to Tensor
            Each modality's input batch, records aligned across modalities.
        mask : BoolTensor, shape (B, M), optional
            Modalities present per record (missing ones: any input, e.g. zeros, masked in fusion).
        """
        embeddings, mask = self.encode(inputs, mask)
        fused, _ = self.fusion(embeddings, mask)
        return self.risk(self.head(fused)), embeddings


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
    logits: Tensor,
    time_index: Tensor,
    event: Tensor,
    embeddings: Tensor | Sequence[Tensor],
    *,
    kl: Tensor | float,
    num_train: int,
    similarity_weight: float = 0.05,
    mask: Tensor | None = None,
) -> Tensor:
    r"""BVFLMSP training objective for one batch (paper eq. (4)).

    .. math::

        \mathcal L = \frac1B \sum_{i=1}^B \ell_i
        + \frac{\mathrm{KL}}{N_{\text{train}}}
        + \lambda \, \frac{1}{B\,P} \sum_{i=1}^B \sum_{k<l} \big(1 - \cos(E_i^{(k)}, E_i^{(l)})\big),

    where :math:`\ell_i` is the discrete-time logistic-hazard NLL
    (:func:`models.losses.logistic_hazard_nll`), :math:`\mathrm{KL}` the summed Monte-Carlo KL
    of every Bayesian layer (:func:`kl_divergence`; pass the sites' and the server's sum in the
    centralised twin), :math:`P = M(M-1)/2` the number of modality pairs and
    :math:`\lambda` = ``similarity_weight`` (0.05 in the paper). Dividing the KL of the whole
    data set by :math:`N_{\text{train}}` per batch-mean loss is Blundell et al.'s minibatch
    weighting with the NLL scaled to a per-record mean. With ``mask`` the alignment term
    averages only over (record, pair) with both modalities present (0 if none); with fewer than
    two modalities it is 0.

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
    if not isinstance(embeddings, Tensor):
        embeddings = torch.stack(list(embeddings), dim=1)
    if embeddings.ndim != 3 or embeddings.shape[0] != logits.shape[0]:
        raise ValueError(f"embeddings must have shape ({logits.shape[0]}, M, d), got {tuple(embeddings.shape)}")
    if mask is not None and mask.shape != embeddings.shape[:2]:
        raise ValueError(f"mask must have shape {tuple(embeddings.shape[:2])}, got {tuple(mask.shape)}")
    nll = logistic_hazard_nll(logits, time_index, event)
    loss = nll + kl / num_train
    if similarity_weight:
        loss = loss + similarity_weight * _similarity_term(embeddings, None if mask is None else mask.to(torch.bool))
    return loss


@torch.no_grad()
def mc_survival(
    model: BayesianMultisurv,
    inputs: Mapping[str, Tensor],
    *,
    num_samples: int = 50,
    mask: Tensor | None = None,
    level: float = 0.95,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``num_samples`` stochastic passes in eval mode -> mean survival curve and an equal-tailed credible band.

    Each pass draws fresh weights in every Bayesian layer and gives
    :math:`S_i(\tau_j) = \prod_{l \le j} (1 - \sigma(\phi_{il}))`; the band is the pointwise
    :math:`(1 \mp \text{level})/2` quantiles over passes. The model's train/eval state and
    sampling switches are restored afterwards (sampling is forced on during the passes).

    Returns
    -------
    mean, lower, upper : Tensor, shape (B, T)
    """
    if num_samples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need num_samples >= 1 and level in (0, 1), got {num_samples}, {level}")
    was_training = model.training
    layers = list(_bayesian_layers(model))
    saved = [m.sample for m in layers]
    model.eval()
    try:
        for m in layers:
            m.sample = True
        curves = torch.stack(
            [torch.cumprod(1.0 - torch.sigmoid(model(inputs, mask)[0]), dim=1) for _ in range(num_samples)]
        )
    finally:
        model.train(was_training)
        for m, s in zip(layers, saved, strict=True):
            m.sample = s
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=curves.dtype, device=curves.device)
    lower, upper = torch.quantile(curves, q, dim=0)
    return curves.mean(dim=0), lower, upper
