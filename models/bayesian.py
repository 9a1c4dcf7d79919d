r"""Bayes-by-Backprop layers: mean-field Gaussian posteriors, a scale-mixture prior, Monte-Carlo KL.

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
:func:`seeded` makes every draw of a forward pass (posterior samples and dropout) a function of
one seed, so that two computations of the same pass (the split protocol and its centralised
twin, or a site recomputing a pass for its backward step) draw the same samples.

The multimodal networks built from these layers are in :mod:`models.multimodal`.

References
----------
Blundell, Cornebise, Kavukcuoglu & Wierstra (2015), "Weight Uncertainty in Neural Networks",
ICML (Bayes by Backprop). BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026),
Sec. 6.2.1 (spike-and-slab prior on weights and biases).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BayesianEmbedding",
    "BayesianLinear",
    "ScaleMixturePrior",
    "bayesian_layers",
    "kl_divergence",
    "posterior_mean",
    "seeded",
    "set_sampling",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


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


def bayesian_layers(module: nn.Module) -> Iterator[_BayesianModule]:
    """Every Bayesian layer in ``module`` (``module.modules()`` order)."""
    return (m for m in module.modules() if isinstance(m, _BayesianModule))


def kl_divergence(module: nn.Module) -> Tensor:
    r"""Sum of ``kl`` over every Bayesian layer in ``module`` (its last forward's Monte-Carlo estimates).

    Layers not run since construction contribute nothing; a layer run several times in one
    forward contributes only its last draw. Returns a scalar zero when there is nothing to sum.
    """
    kls = [m.kl for m in bayesian_layers(module) if m.kl is not None]
    if not kls:
        p = next(module.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return torch.stack(kls).sum()


def set_sampling(module: nn.Module, sample: bool) -> None:
    """Switch every Bayesian layer in ``module`` to posterior draws (True) or posterior means (False)."""
    for m in bayesian_layers(module):
        m.sample = bool(sample)


@contextmanager
def posterior_mean(module: nn.Module) -> Iterator[None]:
    """Context in which every Bayesian layer of ``module`` uses its posterior mean (restored on exit)."""
    layers = list(bayesian_layers(module))
    saved = [m.sample for m in layers]
    try:
        for m in layers:
            m.sample = False
        yield
    finally:
        for m, s in zip(layers, saved, strict=True):
            m.sample = s


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Context in which torch's global generator starts from ``seed``; its state is restored on exit.

    Bayesian layers without a ``generator`` of their own and dropout both draw from the global
    generator, so every random draw of a forward pass run inside ``seeded(s)`` is a function of
    ``s``: the same pass run twice (by a site, and by the centralised twin; or by a site again
    for its backward step) draws the same posterior samples and dropout masks.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield
