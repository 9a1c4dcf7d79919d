r"""The site's numerics of record-level DP-SGD (strategy ``dp_sgd``): per-sample gradients, clipping, noise.

One step on a Poisson-sampled batch :math:`B` (each of the :math:`n` records independently with
probability :math:`q`):

.. math::

    \tilde g = \frac{1}{q n} \Big( \sum_{i \in B} g_i \min\big(1, C / \lVert g_i \rVert_2\big)
               + \mathcal N(0, \sigma^2 C^2 I) \Big),

with :math:`g_i` the gradient of record :math:`i`'s loss over **all** parameters (flat L2
norm), clip norm :math:`C`, noise multiplier :math:`\sigma`. The divisor is the *expected*
batch size :math:`qn`, not the realised :math:`|B|` (which would itself depend on the data), and
an empty batch still releases noise. The optimiser (Adam here, as in
:func:`models.training.train_epochs`) only post-processes :math:`\tilde g`.

Only the discrete-time hazard model qualifies: its negative log-likelihood is a sum of
per-record terms. The Cox partial likelihood is not (each record sits in other records' risk
sets), so per-sample clipping would not bound one record's influence and is refused.

Three interchangeable backends give the same update (tested to float32 round-off):
``"torch_func"`` materialises per-sample gradients with ``functional_call`` + ``vmap`` + ``grad``
(:func:`per_sample_gradients`), ``"opacus"`` with opacus' ``GradSampleModule`` hooks
(:func:`per_sample_gradients_opacus`), and ``"ghost"`` (default) never materialises them: one
forward pass and one backward pass to the Linear layers' outputs give every layer's inputs
:math:`a_{il}` and output gradients :math:`\delta_{il}` (:func:`_ghost_backward`); the exact
per-record norms :math:`\lVert g_i\rVert^2 = \sum_l \lVert\delta_{il}\rVert^2(\lVert a_{il}\rVert^2 + 1)`
of all layers come from two matrix products (:func:`_ghost_clip`), and the noisy clipped sum is
written straight into ``.grad`` with one ``addmm``/``addmv`` per parameter,
:math:`\tfrac{\sigma C}{qn} z + \tfrac1{qn}(f \odot \delta_l)^\top A_l` (:func:`_ghost_noisy_grads`);
``on_step`` gets the Gram matrix from the same factors. On the FSL-BDP hazard MLP (batch 128, one
thread) a ``"ghost"`` step costs about 1.2 plain steps, the other two 8 to 17
(``benchmarks/dp_step.py``).

No Flower imports here. The mechanism object and its schedule maths (torch-free) are
:mod:`strategies.mechanisms.dp_sgd`; its ``site_round`` imports this module.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from models.losses import logistic_hazard_nll
from models.optim import Adam
from models.survival import HazardMLP, HazardModel, SurvivalModel, _discretise_tensor
from models.training import ProximalTerm, training_tensors
from strategies.mechanisms.schedules import poisson_schedule
from strategies.validation import check_positive, check_sample_rate

__all__ = [
    "DEFAULT_BACKEND",
    "DecomposabilityError",
    "GhostPerSample",
    "PerSampleView",
    "clip_per_sample",
    "clipped_sum_ghost",
    "dp_sgd_step",
    "flatten_per_sample",
    "hazard_per_sample_loss_fn",
    "noisy_sum",
    "per_sample_gradients",
    "per_sample_gradients_opacus",
    "poisson_batches",
    "train_epochs_dp",
]

PerSampleLossFn = Callable[[dict[str, Tensor], Tensor, Tensor, Tensor], Tensor]
Backend = Literal["ghost", "torch_func", "opacus"]

#: Per-sample gradient backend used by :func:`train_epochs_dp` unless told otherwise
#: (the faster on the FSL-BDP hazard MLP, batch 128, one CPU thread; ``benchmarks/dp_step.py``).
DEFAULT_BACKEND: Backend = "ghost"
_BACKENDS = ("ghost", "torch_func", "opacus")


class DecomposabilityError(ValueError):
    """The model's loss is not a sum of per-record terms, so record-level DP-SGD does not apply."""


# --------------------------------------------------------------------------- validation


def _check_noise_multiplier(noise_multiplier: float) -> float:
    noise_multiplier = float(noise_multiplier)
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    return noise_multiplier


def _require_hazard_model(model: SurvivalModel) -> HazardModel:
    if not isinstance(model, HazardModel):
        raise DecomposabilityError(
            f"record-level DP-SGD needs a per-sample decomposable loss; {type(model).__name__} "
            f"(kind {getattr(model, 'kind', '?')!r}) uses the Cox partial likelihood, which is not "
            "per-sample decomposable (each record sits in other records' risk sets), so per-sample "
            "clipping does not bound one record's influence. Use kind 'hazard_mlp', or a site-level "
            "mechanism (central_dp / nbafl) and say so in the privacy ledger."
        )
    return model


# --------------------------------------------------------------------------- per-sample gradients


def _hazard_targets(cuts: Tensor, time: Tensor, event: Tensor) -> tuple[Tensor, Tensor]:
    """Interval index and event flag as :func:`models.survival.discretise`, any shape, vmap-safe.

    Events move right (``searchsorted(side="left")`` = number of cuts below ``t``), censorings
    left (number of cuts at or below ``t``, minus 1); times beyond the last cut are censorings.
    """
    t = time.to(cuts.dtype).unsqueeze(-1)
    is_event = (event != 0) & (time.to(cuts.dtype) <= cuts[-1])
    event_idx = (cuts < t).sum(-1)
    censor_idx = (cuts <= t).sum(-1) - 1
    return torch.where(is_event, event_idx, censor_idx), is_event


def hazard_per_sample_loss_fn(model: HazardModel) -> PerSampleLossFn:
    r"""Per-record logistic-hazard loss of ``model`` as a function of its parameters.

    Returns ``loss_fn(params_and_buffers, x_i, t_i, e_i) -> scalar`` computing, for one record
    with features ``x_i`` (shape (p,)), time ``t_i`` and event ``e_i`` (0-d),

    .. math::

        \ell_i = -\sum_{l=0}^{\kappa_i} \big[ y_{l} \log h_{l} + (1 - y_{l}) \log(1 - h_{l}) \big],
        \qquad y_l = \delta_i \mathbb 1[l = \kappa_i],

    where :math:`\kappa_i` is the interval index on ``model.cuts`` (events move right,
    censorings left, times beyond the last cut become censorings) exactly as
    :func:`models.survival.discretise`, written without data-dependent control flow so that
    ``torch.func.vmap`` can batch it. Equals ``model.per_sample_loss`` record by record.
    Times below ``cuts[0]`` are not checked here (callers validate once per data set).

    Parameters
    ----------
    model : HazardModel

    Returns
    -------
    callable
        For :func:`per_sample_gradients`.

    References
    ----------
    Gensheimer & Narasimhan (2019), PeerJ 7:e6257; Kvamme & Borgan (2019), arXiv:1910.06724, eq. (8).
    """
    model = _require_hazard_model(model)
    net = model.net
    cuts = model._cuts_tensor  # float64, strictly increasing

    def loss_fn(params_and_buffers: dict[str, Tensor], x_i: Tensor, t_i: Tensor, e_i: Tensor) -> Tensor:
        logits = functional_call(net, params_and_buffers, (x_i.unsqueeze(0),)).squeeze(0)
        idx, is_event = _hazard_targets(cuts, t_i, e_i)
        positions = torch.arange(logits.shape[-1], device=logits.device)
        target = ((positions == idx) & is_event).to(logits.dtype)
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        return bce.cumsum(0).gather(0, idx.reshape(1)).squeeze(0)

    return loss_fn


def per_sample_gradients(
    model: nn.Module,
    loss_fn: PerSampleLossFn,
    x: Tensor,
    time: Tensor,
    event: Tensor,
    *,
    return_loss: bool = False,
) -> dict[str, Tensor] | tuple[dict[str, Tensor], Tensor]:
    r"""Gradients of each record's loss, :math:`g_i = \nabla_\theta \ell(\theta; x_i, t_i, e_i)`.

    Vectorised with ``torch.func``: ``vmap(grad(loss_fn), in_dims=(None, 0, 0, 0))`` over the
    batch, the parameters passed through ``functional_call`` (``randomness="different"``, so
    dropout draws an independent mask per record).

    Parameters
    ----------
    model : nn.Module
        Network whose trainable parameters are differentiated (buffers are passed unchanged).
    loss_fn : callable
        ``loss_fn(params_and_buffers, x_i, t_i, e_i) -> scalar`` for ONE record (unbatched
        slices); e.g. :func:`hazard_per_sample_loss_fn`.
    x : Tensor, shape (B, p)
    time, event : Tensor, shape (B,)
    return_loss : bool, default False
        Also return the per-record losses, shape (B,).

    Returns
    -------
    dict[str, Tensor]
        Parameter name -> per-sample gradient of shape ``(B, *param.shape)``; or
        ``(grads, losses)`` when ``return_loss``. An empty batch gives zeros of shape
        ``(0, *param.shape)``.

    References
    ----------
    Abadi et al. (2016), CCS, "Deep Learning with Differential Privacy", Alg. 1 (per-example
    gradients); PyTorch ``torch.func`` per-sample-gradients tutorial.
    """
    if x.ndim != 2 or time.shape != (x.shape[0],) or event.shape != (x.shape[0],):
        raise ValueError(
            f"need x (B, p), time (B,), event (B,); got {tuple(x.shape)}, {tuple(time.shape)}, {tuple(event.shape)}"
        )
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    if x.shape[0] == 0:
        grads = {name: p.new_zeros((0, *p.shape)) for name, p in params.items()}
        return (grads, x.new_zeros(0)) if return_loss else grads

    def loss_of_params(p: dict[str, Tensor], x_i: Tensor, t_i: Tensor, e_i: Tensor) -> Tensor:
        return loss_fn({**p, **buffers}, x_i, t_i, e_i)

    grads, losses = vmap(
        grad_and_value(loss_of_params), in_dims=(None, 0, 0, 0), randomness="different"
    )(params, x, time, event)
    return (grads, losses) if return_loss else grads


def _baseline_grad_sample(layer: HazardMLP, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter,
                                                                                                  Tensor]:
    r"""opacus' grad sampler for a :class:`models.survival.HazardMLP`'s own parameter, its interval baselines
    :math:`\beta`, added to the logits: the per-sample gradient is the logits' output gradient."""
    return {layer.baseline: backprops}


def per_sample_gradients_opacus(
    model: HazardModel, x: Tensor, time: Tensor, event: Tensor, *, grad_sample_module: nn.Module | None = None
) -> tuple[dict[str, Tensor], Tensor]:
    r"""Per-sample gradients of ``model.per_sample_loss`` with opacus' ``GradSampleModule``.

    Backward hooks on each layer form :math:`g_i` from the layer's activations and output
    gradients (for ``Linear``: :math:`\partial\ell_i/\partial W = \delta_i a_i^\top`) after one
    backward pass of :math:`\sum_i \ell_i`.

    Parameters
    ----------
    model : HazardModel
    x : Tensor, shape (B, p)
    time, event : Tensor, shape (B,)
    grad_sample_module : opacus.GradSampleModule, optional
        An existing wrapper of ``model.net`` (reused across steps); otherwise one is created
        for this call and its hooks are removed afterwards.

    Returns
    -------
    grads : dict[str, Tensor]
        Parameter name (as in ``model.net.named_parameters()``) -> shape ``(B, *param.shape)``.
    losses : Tensor, shape (B,)

    References
    ----------
    Yousefpour et al. (2021), arXiv:2109.12298 (Opacus); Goodfellow (2015), arXiv:1510.01799.
    """
    from opacus import GradSampleModule
    from opacus.grad_sample import register_grad_sampler

    register_grad_sampler(HazardMLP)(_baseline_grad_sample)  # the net's own parameter: not a vmap of the whole net
    model = _require_hazard_model(model)
    net = model.net
    params = {name: p for name, p in net.named_parameters() if p.requires_grad}
    if x.shape[0] == 0:
        return {name: p.detach().new_zeros((0, *p.shape)) for name, p in params.items()}, x.new_zeros(0)
    own = grad_sample_module is None
    gsm = GradSampleModule(net, batch_first=True, loss_reduction="sum") if own else grad_sample_module
    try:
        for p in params.values():
            p.grad_sample = None
            p.grad = None
        losses = model.per_sample_loss(x, time, event)
        with warnings.catch_warnings():
            # The inputs need no gradient; opacus' hooks still see every layer's output grads.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses.sum().backward()
        grads = {name: p.grad_sample for name, p in params.items()}
        for p in params.values():
            p.grad_sample = None
            p.grad = None
    finally:
        if own:
            gsm.cleanup()
    return grads, losses.detach()


class _Offset:
    r"""A proportional :class:`models.survival.HazardMLP`'s interval baselines as the chain's first layer: a bias
    without weight or input (``in_features`` 0) added to the logits, so its per-sample gradient is the logits'
    output gradient :math:`\delta_i` and its squared norm :math:`\lVert\delta_i\rVert^2 (0 + 1)`. First, as the
    net's own parameter comes first in ``net.named_parameters()``."""

    weight = None

    def __init__(self, baseline: nn.Parameter) -> None:
        self.bias, self.in_features, self.out_features = baseline, 0, baseline.numel()


class _GhostPlan:
    """A :class:`models.survival.HazardMLP`'s chain of Linear and parameter-free layers, worked out once.

    ``linear`` are the Linear layers (after a proportional net's :class:`_Offset`, ``offset``),
    ``params`` their weights and biases in ``net.named_parameters()`` order (which is also the order
    of the noise draws) with their ``names``; ``split`` cuts a (B, sum of widths) matrix into
    per-layer column blocks. :meth:`indicators` gives the 0/1 matrices that turn squared entries into
    per-layer squared norms with one matrix product (:func:`_ghost_clip`).
    """

    def __init__(self, layers: tuple[nn.Module, ...], linear: list[nn.Linear | _Offset], names: list[str]) -> None:
        self.layers, self.linear, self.names = layers, tuple(linear), names
        self.offset = linear[0] if isinstance(linear[0], _Offset) else None
        self.params = [p for layer in linear for p in (layer.weight, layer.bias) if p is not None]
        self._in = [layer.in_features for layer in linear]
        self._out = [layer.out_features for layer in linear]
        self._has_bias = [layer.bias is not None for layer in linear]
        self._indicators: dict[torch.dtype, tuple[Tensor, Tensor, Tensor]] = {}

    def indicators(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """``(S_in, b, S_out)``, shapes (L, sum of widths), (L, 1), (L, sum of widths):
        ``S[l, k] = 1`` when column ``k`` belongs to layer ``l``; ``b[l] = 1`` when layer ``l``
        has a bias."""
        if dtype not in self._indicators:
            def block(widths: list[int]) -> Tensor:
                return torch.block_diag(*[torch.ones(1, w, dtype=dtype) for w in widths])
            bias = torch.tensor(self._has_bias, dtype=dtype).unsqueeze(1)
            self._indicators[dtype] = (block(self._in), bias, block(self._out))
        return self._indicators[dtype]

    def split(self, matrix: Tensor) -> list[Tensor]:
        """Column blocks of a (B, sum of output widths) matrix, one per Linear layer."""
        return list(matrix.split(self._out, dim=1))


#: One plan per net, rebuilt when ``net.layers`` no longer holds the same modules.
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module, ...], _GhostPlan | None]] = (
    weakref.WeakKeyDictionary()
)


def _ghost_plan(net: nn.Module) -> _GhostPlan | None:
    """The :class:`_GhostPlan` of a HazardMLP whose layers are all ``nn.Linear`` or parameter- and
    buffer-free (activations, dropout) and whose parameters are exactly those layers' (and a proportional
    net's ``baseline``, an :class:`_Offset`); else None.
    Cached per net and checked against the current ``net.layers`` on every call."""
    layers = getattr(net, "layers", None)
    if not isinstance(net, HazardMLP) or not isinstance(layers, nn.Sequential):
        return None
    key = tuple(layers)
    cached = _PLANS.get(net)
    if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    plan = None
    if all(isinstance(layer, nn.Linear) or not (any(True for _ in layer.parameters())
                                                or any(True for _ in layer.buffers())) for layer in key):
        linear: list[nn.Linear | _Offset] = [layer for layer in key if isinstance(layer, nn.Linear)]
        baseline = getattr(net, "baseline", None)
        if isinstance(baseline, nn.Parameter):
            linear.insert(0, _Offset(baseline))
        named = list(net.named_parameters())
        chain = [p for layer in linear for p in (layer.weight, layer.bias) if p is not None]
        if len(named) == len(chain) and all(p is q for (_, p), q in zip(named, chain)):
            plan = _GhostPlan(key, linear, [name for name, _ in named])
    _PLANS[net] = (key, plan)
    return plan


def _linear_chain(net: nn.Module) -> list[nn.Module] | None:
    """The layers of a HazardMLP that :func:`clipped_sum_ghost` handles (see :func:`_ghost_plan`); else None."""
    plan = _ghost_plan(net)
    return None if plan is None else list(plan.layers)


class PerSampleView:
    """The clipped per-sample gradients of one batch, as handed to ``on_step``.

    ``clipped_norms()`` gives every record's clipped-gradient norm, ``gram(rows)`` the inner
    products of the first ``rows`` records' clipped gradients (float64), ``gradients(rows)`` the
    gradients themselves, flattened in parameter order (as :func:`flatten_per_sample` of
    :func:`clip_per_sample`'s output).
    """

    def __init__(self, flat: Tensor, clipped_norms: Tensor) -> None:
        self._flat, self._norms = flat, clipped_norms

    def clipped_norms(self) -> Tensor:
        """Tensor (B,): ``||clip(g_i)||`` of every record of the batch."""
        return self._norms

    def gradients(self, rows: int | None = None) -> Tensor:
        """Tensor (M, P): the flattened clipped gradients of the first ``rows`` records."""
        return self._flat[:rows]

    def gram(self, rows: int | None = None) -> Tensor:
        """Tensor (M, M), float64: ``⟨clip(g_i), clip(g_j)⟩`` of the first ``rows`` records."""
        flat = self._flat[:rows].double()
        return flat @ flat.T


class GhostPerSample(PerSampleView):
    r""":class:`PerSampleView` kept in factored form (Linear layers); nothing is materialised
    unless :meth:`gradients` is called.

    Layer :math:`l` contributes :math:`\bar g_i^{W_l} = f_i \delta_{il} a_{il}^\top` and
    :math:`\bar g_i^{b_l} = f_i \delta_{il}`; ``deltas`` already hold :math:`f_i \delta_{il}`.
    """

    def __init__(self, model: HazardModel, linear: list[nn.Linear | _Offset], inputs: list[Tensor],
                 deltas: list[Tensor], clipped_norms: Tensor) -> None:
        self._model, self._linear, self._inputs, self._deltas = model, linear, inputs, deltas
        self._norms = clipped_norms

    def gradients(self, rows: int | None = None) -> Tensor:
        names = {id(p): name for name, p in self._model.net.named_parameters()}
        per_param: dict[str, Tensor] = {}
        for layer, a, d in zip(self._linear, self._inputs, self._deltas):
            a, d = a[:rows], d[:rows]
            if layer.weight is not None:
                per_param[names[id(layer.weight)]] = (d.unsqueeze(2) * a.unsqueeze(1)).reshape(d.shape[0], -1)
            if layer.bias is not None:
                per_param[names[id(layer.bias)]] = d
        return torch.cat([per_param[name] for name, _ in self._model.net.named_parameters()], dim=1)

    def gram(self, rows: int | None = None) -> Tensor:
        r""":math:`G_{ij} = \sum_l (\delta_{il}\cdot\delta_{jl})(a_{il}\cdot a_{jl} + 1)` (the
        ``+ 1`` for a bias), without forming the gradients."""
        gram = None
        for layer, a, d in zip(self._linear, self._inputs, self._deltas):
            a, d = a[:rows].double(), d[:rows].double()
            term = (d @ d.T) * (a @ a.T + (1.0 if layer.bias is not None else 0.0))
            gram = term if gram is None else gram + term
        assert gram is not None
        return gram


def clipped_sum_ghost(
    model: HazardModel, x: Tensor, time: Tensor, event: Tensor, *, clip_norm: float
) -> tuple[dict[str, Tensor], Tensor, Tensor, GhostPerSample]:
    r"""Sum of clipped per-sample gradients without materialising them (MLP of Linear layers).

    For a Linear layer with input :math:`a_i` and output gradient :math:`\delta_i =
    \partial \ell_i / \partial z_i` (record :math:`i`'s output depends only on its input), the
    per-sample gradients are :math:`g_i^W = \delta_i a_i^\top` (rank one) and :math:`g_i^b =
    \delta_i`, so exactly

    .. math::

        \lVert g_i \rVert_2^2 = \sum_{\text{layers}} \lVert \delta_i \rVert^2
            \big(\lVert a_i \rVert^2 + 1\big), \qquad
        \sum_i f_i g_i^W = (f \odot \delta)^\top A, \qquad
        f_i = \min\big(1, C / \lVert g_i \rVert_2\big),

    at the cost of one forward and one backward pass plus a few matrix products.

    Parameters
    ----------
    model : HazardModel
        Its net must be a :class:`models.survival.HazardMLP` of Linear layers and
        parameter-free activations/dropout, with either risk layer (the default; raises
        ``ValueError`` otherwise).
    x : Tensor, shape (B, p)
    time, event : Tensor, shape (B,)
    clip_norm : float
        :math:`C > 0`.

    Returns
    -------
    summed : dict[str, Tensor]
        :math:`\sum_i \bar g_i` per parameter (names of ``model.net.named_parameters()``).
    norms : Tensor, shape (B,)
        :math:`\lVert g_i \rVert_2` before clipping.
    losses : Tensor, shape (B,)
        Per-record losses (detached).
    per_sample : GhostPerSample
        The clipped per-sample gradients in factored form (:class:`PerSampleView`):
        ``.gradients(rows)`` materialises them, ``.gram(rows)`` gives their inner products and
        ``.clipped_norms()`` their norms without doing so.

    References
    ----------
    Goodfellow (2015), arXiv:1510.01799 (per-example gradient norms); Lee & Kifer (2021),
    PoPETs 2021(1) (fast per-example clipping); Li et al. (2022), ICLR (ghost clipping);
    Abadi et al. (2016), CCS, Alg. 1.
    """
    model = _require_hazard_model(model)
    clip_norm = check_positive(clip_norm, "clip_norm")
    plan = _ghost_plan(model.net)
    if plan is None:
        raise ValueError("clipped_sum_ghost needs a HazardMLP of Linear layers and parameter-free modules")
    inputs, deltas, losses = _ghost_backward(model, plan, x, time, event)
    norms, _, scaled = _ghost_clip(plan, inputs, deltas, clip_norm)
    ordered = _ghost_summed(plan, inputs, scaled)
    per_sample = GhostPerSample(model, list(plan.linear), inputs, scaled,
                                torch.minimum(norms, norms.new_tensor(clip_norm)))
    return ordered, norms, losses, per_sample


def _ghost_summed(plan: _GhostPlan, inputs: list[Tensor], scaled: list[Tensor]) -> dict[str, Tensor]:
    r"""Per parameter name of ``plan``, :math:`\sum_i \bar g_i` from the layers' inputs and clipped output gradients.

    Weight :math:`(f \odot \delta)^\top A`, bias :math:`\sum_i f_i \delta_i` (``scaled`` is :math:`f \odot \delta`).
    """
    summed: list[Tensor] = []  # plan.params order: weight, bias of each layer
    for layer, a, d in zip(plan.linear, inputs, scaled):
        if layer.weight is not None:
            summed.append(d.T @ a)
        if layer.bias is not None:
            summed.append(d.sum(0))
    return dict(zip(plan.names, summed))
def _ghost_backward(model: HazardModel, plan: _GhostPlan, x: Tensor, time: Tensor,
                    event: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
    r"""One forward and one backward pass giving every Linear layer's inputs and output gradients.

    Returns :math:`a_{il}` (the input of Linear layer :math:`l` for record :math:`i`, detached),
    :math:`\delta_{il} = \partial \ell_i / \partial z_{il}` (the gradient of :math:`\sum_j \ell_j`
    with respect to the layer's output :math:`z_{il}`, which only record :math:`i`'s loss depends on)
    and the per-record losses :math:`\ell_i` (detached). No parameter gradient is formed, and
    ``.grad`` is left alone. Dropout layers draw from the global generator, as in ``model.net(x)``.
    """
    inputs: list[Tensor] = []
    outputs: list[Tensor] = []
    h = x
    for layer in plan.layers:
        if isinstance(layer, nn.Linear):
            inputs.append(h.detach())
            h = layer(h)
            outputs.append(h)
        else:
            h = layer(h)
    if plan.offset is not None:  # the baselines (first in the plan): no input, the logits' gradient
        inputs.insert(0, h.new_zeros(h.shape[0], 0))
        h = h + plan.offset.bias
        outputs.insert(0, h)
    idx, events = _discretise_tensor(time, event, model._cuts_tensor)  # as model.per_sample_loss
    losses = logistic_hazard_nll(h, idx, events, reduction="none")
    if x.shape[0] == 0:
        return inputs, [out.detach() for out in outputs], losses.detach()
    return inputs, list(torch.autograd.grad(losses.sum(), outputs)), losses.detach()


def _ghost_clip(plan: _GhostPlan, inputs: list[Tensor], deltas: list[Tensor],
                clip_norm: float) -> tuple[Tensor, Tensor, list[Tensor]]:
    r"""Per-record gradient norms, clipping factors and clipped output gradients, fused over layers.

    .. math::

        \lVert g_i \rVert_2^2 = \sum_l \lVert \delta_{il} \rVert^2 \big(\lVert a_{il} \rVert^2 + b_l\big)
            = \sum_l \big[S_{\text{in}} (A \odot A)^\top + b\big]_{li} \big[S_{\text{out}} (D \odot D)^\top\big]_{li},
        \qquad f_i = \min\big(1, C / \lVert g_i \rVert_2\big) = C / \max(C, \lVert g_i \rVert_2),

    where :math:`A` and :math:`D` are the layers' inputs and output gradients side by side, the 0/1
    matrices :math:`S` sum each layer's columns (:meth:`_GhostPlan.indicators`) and :math:`b_l = 1`
    for a layer with a bias (:math:`g_i^W = \delta_i a_i^\top` has norm
    :math:`\lVert\delta_i\rVert\lVert a_i\rVert`, :math:`g_i^b = \delta_i`): two matrix products for
    every layer's norms at once. Returns ``(norms, f, [f ⊙ δ_l per layer])`` (the last are column
    blocks of one matrix).
    """
    s_in, bias, s_out = plan.indicators(deltas[0].dtype)
    stacked = torch.cat(deltas, dim=1)
    input_sq = torch.addmm(bias, s_in, torch.cat(inputs, dim=1).square().T)  # (L, B); (L, W) first: faster
    norms = (input_sq * (s_out @ stacked.square().T)).sum(0).sqrt()
    factor = clip_norm / torch.clamp(norms, min=clip_norm)
    return norms, factor, plan.split(stacked * factor.unsqueeze(1))


def _ghost_noisy_grads(plan: _GhostPlan, inputs: list[Tensor], scaled: list[Tensor], *, std: float,
                       divisor: float, generator: torch.Generator) -> None:
    r"""Write the privatised gradient into every parameter's ``.grad``, one fused product each.

    .. math::

        \tilde g^{W_l} = \frac{1}{qn}\Big(\sum_i f_i \delta_{il} a_{il}^\top + \sigma C z\Big)
            = \tfrac{\sigma C}{qn} z + \tfrac{1}{qn} (f\odot\delta_l)^\top A_l \quad (\texttt{addmm}),
        \qquad \tilde g^{b_l} = \tfrac{\sigma C}{qn} z' + \tfrac{1}{qn} (f\odot\delta_l)^\top \mathbf 1
            \quad (\texttt{addmv}),

    :math:`z, z' \sim \mathcal N(0, I)` drawn from ``generator`` parameter by parameter in
    ``plan.params`` order (``net.named_parameters()``), exactly the draws of :func:`_add_noise`;
    none when ``std`` is 0 (``beta = 0`` then ignores the buffer's contents). The noise is drawn
    into the existing ``.grad`` and the product added in place (a new tensor where ``.grad`` is
    missing). Equals ``(clipped sum + std * noise) / divisor`` up to float round-off.
    """
    beta, alpha = std / divisor, 1.0 / divisor
    ones = scaled[0].new_ones(scaled[0].shape[0])
    for layer, a, d in zip(plan.linear, inputs, scaled):
        for param in (layer.weight, layer.bias):
            if param is None:
                continue
            grad = param.grad  # torch keeps a .grad of the parameter's shape and dtype
            if grad is None:
                grad = param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
            if std > 0:
                grad.normal_(generator=generator)
            if param is layer.weight:
                grad.addmm_(d.T, a, beta=beta, alpha=alpha)
            else:  # sum_i f_i delta_i = (f ⊙ delta)^T 1
                grad.addmv_(d.T, ones, beta=beta, alpha=alpha)


def flatten_per_sample(grads: Mapping[str, Tensor]) -> Tensor:
    """Concatenate per-sample gradients into one matrix of shape (B, P), in dict order."""
    tensors = list(grads.values())
    if not tensors:
        raise ValueError("no gradients to flatten")
    batch = tensors[0].shape[0]
    return torch.cat([g.reshape(batch, -1) for g in tensors], dim=1)


# --------------------------------------------------------------------------- clip, noise, step


def clip_per_sample(grads: Mapping[str, Tensor], *, clip_norm: float) -> tuple[dict[str, Tensor], Tensor]:
    r"""Clip each record's gradient to L2 norm at most :math:`C` over all parameters jointly.

    .. math::

        \bar g_i = g_i \min\Big(1, \frac{C}{\lVert g_i \rVert_2}\Big), \qquad
        \lVert g_i \rVert_2^2 = \sum_{\text{params}} \lVert g_i^{(\text{param})} \rVert_2^2 .

    Parameters
    ----------
    grads : mapping str -> Tensor of shape (B, ...)
        Per-sample gradients (:func:`per_sample_gradients`).
    clip_norm : float
        :math:`C > 0`.

    Returns
    -------
    clipped : dict[str, Tensor]
        Same keys and shapes.
    norms : Tensor, shape (B,)
        Norms :math:`\lVert g_i \rVert_2` before clipping.

    References
    ----------
    Abadi et al. (2016), CCS, "Deep Learning with Differential Privacy", Alg. 1 (clip gradient).
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    if not grads:
        raise ValueError("grads is empty")
    batch = {g.shape[0] for g in grads.values()}
    if len(batch) != 1:
        raise ValueError(f"every per-sample gradient needs the same batch dimension, got {sorted(batch)}")
    (size,) = batch
    squares = [g.reshape(size, -1).pow(2).sum(1) for g in grads.values()]
    norms = torch.stack(squares, dim=1).sum(1).sqrt()
    # min(1, C / ||g||) written as C / max(C, ||g||): no division by zero for a zero gradient.
    factor = clip_norm / torch.clamp(norms, min=clip_norm)
    clipped = {name: g * factor.reshape(size, *([1] * (g.ndim - 1))) for name, g in grads.items()}
    return clipped, norms


def noisy_sum(
    clipped: Mapping[str, Tensor],
    *,
    noise_multiplier: float,
    clip_norm: float,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    r"""Sum of clipped per-sample gradients plus Gaussian noise on every coordinate.

    .. math::

        \tilde s = \sum_{i \in B} \bar g_i + z, \qquad z \sim \mathcal N(0, \sigma^2 C^2 I).

    An empty batch (dimension 0 of size 0) gives noise alone.

    Parameters
    ----------
    clipped : mapping str -> Tensor of shape (B, ...)
        Clipped per-sample gradients (:func:`clip_per_sample`).
    noise_multiplier : float
        :math:`\sigma \ge 0` (0 disables the noise: no privacy).
    clip_norm : float
        :math:`C > 0`, the sensitivity of the sum under add/remove-one adjacency.
    generator : torch.Generator
        Source of the noise (CPU).

    Returns
    -------
    dict[str, Tensor]
        Parameter name -> noisy sum, shape of the parameter.

    References
    ----------
    Abadi et al. (2016), CCS, "Deep Learning with Differential Privacy", Alg. 1 (add noise).
    """
    noise_multiplier = _check_noise_multiplier(noise_multiplier)
    clip_norm = check_positive(clip_norm, "clip_norm")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return _add_noise({name: g.sum(0) for name, g in clipped.items()}, noise_multiplier * clip_norm, generator)


def _add_noise(summed: Mapping[str, Tensor], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """``summed + std * N(0, I)`` per parameter, drawn in the mapping's order."""
    out: dict[str, Tensor] = {}
    for name, total in summed.items():
        if std > 0:
            noise = torch.randn(total.shape, generator=generator, dtype=total.dtype, device=total.device)
            total = total + std * noise
        out[name] = total
    return out


def poisson_batches(n: int, *, sample_rate: float, steps: int, generator: torch.Generator) -> Iterator[Tensor]:
    r"""Poisson-sampled batches: at every step each record is included independently.

    .. math::

        B_t = \{ i : U_{t,i} < q \}, \qquad U_{t,i} \sim \mathrm{Uniform}(0, 1) \text{ i.i.d.},

    so :math:`|B_t| \sim \mathrm{Bin}(n, q)` and empty batches occur (the step still adds noise).
    Membership of record :math:`i` depends only on its own uniform draw, not on the order of the
    data. This is the sampling under which the RDP accountant's amplification by subsampling
    holds.

    Parameters
    ----------
    n : int
        Number of records (> 0).
    sample_rate : float
        :math:`q \in (0, 1]`.
    steps : int
        Number of batches (>= 0).
    generator : torch.Generator

    Yields
    ------
    LongTensor, shape (|B_t|,)
        Sorted record indices.

    References
    ----------
    Abadi et al. (2016), CCS, Sec. 3.1 (lot sampling); Mironov, Talwar & Zhang (2019),
    arXiv:1908.10530 (sampled Gaussian mechanism).
    """
    if int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}")
    sample_rate = check_sample_rate(sample_rate)
    for _ in range(int(steps)):
        yield torch.nonzero(torch.rand(int(n), generator=generator) < sample_rate).reshape(-1)


def _check_backend(backend: str) -> None:
    """Raise ValueError unless ``backend`` is one of the per-sample gradient backends."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def dp_sgd_step(
    model: HazardModel, optimizer: Adam | torch.optim.Optimizer, x: Tensor, time: Tensor, event: Tensor, *,
    noise_multiplier: float, clip_norm: float, expected_batch_size: float, generator: torch.Generator,
    backend: Backend = DEFAULT_BACKEND, grad_sample_module: nn.Module | None = None,
    on_step: Callable[[PerSampleView], None] | None = None, proximal: ProximalTerm | None = None,
) -> dict[str, float]:
    r"""One DP-SGD update of ``model.net`` on a (Poisson-sampled) batch (Abadi et al. 2016, CCS, Alg. 1).

    .. math::

        \theta.\mathrm{grad} = \frac{1}{q n}\Big(\sum_{i \in B} \bar g_i + \mathcal N(0, \sigma^2 C^2 I)\Big),
        \qquad \bar g_i = g_i \min(1, C / \lVert g_i \rVert_2),

    (plus FedProx's :math:`\mu(\theta - \theta_0)` with ``proximal``), then ``optimizer.step()``. The
    divisor is the expected batch size :math:`qn`, never the realised :math:`|B|`.

    Parameters
    ----------
    model : HazardModel
    optimizer : models.optim.Adam or torch.optim.Optimizer
        Over ``model.net.parameters()`` only (the ``"ghost"`` backend overwrites their ``.grad`` without ``zero_grad``).
    x, time, event : Tensor
        The batch, shapes (B, p) float32, (B,) and (B,) (``B`` may be 0).
    noise_multiplier, clip_norm, expected_batch_size : float
        :math:`\sigma \ge 0`, :math:`C > 0` and :math:`q n > 0`.
    generator : torch.Generator
        Noise source.
    backend : {"ghost", "torch_func", "opacus"}
        Per-sample gradients by ``"ghost"`` (:func:`clipped_sum_ghost`, exact for the HazardMLP, fastest),
        ``"torch_func"`` (:func:`per_sample_gradients`) or ``"opacus"`` (:func:`per_sample_gradients_opacus`).
    grad_sample_module : opacus.GradSampleModule, optional
        Reused wrapper of ``model.net`` for the opacus backend.
    on_step : callable, optional
        Called before the noise, for a non-empty batch, with its clipped per-sample gradients as a
        :class:`PerSampleView` (norms, Gram matrix, gradients): the Bayesian accountant's neighbour distances.
    proximal : ProximalTerm, optional
        FedProx's term, its gradient (of the weights only, no record) added to the privatised one: post-processing.

    Returns
    -------
    dict
        ``batch_size`` (realised), ``num_clipped`` (records with :math:`\lVert g_i\rVert > C`),
        ``loss_sum`` (sum of the per-record losses before the update; not private).
    """
    model = _require_hazard_model(model)
    expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")
    _check_backend(backend)
    noise_multiplier = _check_noise_multiplier(noise_multiplier)
    clip_norm = check_positive(clip_norm, "clip_norm")
    noise = {"noise_multiplier": noise_multiplier, "clip_norm": clip_norm, "expected_batch_size": expected_batch_size,
             "generator": generator, "on_step": on_step}
    if backend == "ghost":
        norms, losses = _ghost_step_grads(model, x, time, event, **noise)
    else:
        norms, losses = _materialised_step_grads(model, optimizer, x, time, event, backend, grad_sample_module, **noise)
    if proximal is not None:
        proximal.add_gradient(model.net)
    optimizer.step()
    return {"batch_size": float(x.shape[0]), "num_clipped": float((norms > clip_norm).sum()),
            "loss_sum": float(losses.detach().sum())}


def _ghost_step_grads(
    model: HazardModel, x: Tensor, time: Tensor, event: Tensor, *, noise_multiplier: float, clip_norm: float,
    expected_batch_size: float, generator: torch.Generator, on_step: Callable[[PerSampleView], None] | None,
) -> tuple[Tensor, Tensor]:
    """The ``"ghost"`` backend of :func:`dp_sgd_step`: overwrite every ``.grad`` of ``model.net`` with the noisy mean.

    One forward and one backward pass to the layer outputs, fused norms and sums; ``on_step`` gets the
    clipped per-sample gradients of a non-empty batch before the noise. Returns the per-record norms
    before clipping and the per-record losses. Raises ValueError unless the net is a HazardMLP of Linear
    layers and parameter-free modules.
    """
    plan = _ghost_plan(model.net)
    if plan is None:
        raise ValueError("the ghost backend needs a HazardMLP of Linear layers and parameter-free modules")
    inputs, deltas, losses = _ghost_backward(model, plan, x, time, event)
    norms, _, scaled = _ghost_clip(plan, inputs, deltas, clip_norm)
    if on_step is not None and x.shape[0] > 0:
        on_step(GhostPerSample(model, list(plan.linear), inputs, scaled,
                               torch.minimum(norms, norms.new_tensor(clip_norm))))
    # every parameter of the net (the optimizer's, see dp_sgd_step) gets its .grad overwritten
    _ghost_noisy_grads(plan, inputs, scaled, std=noise_multiplier * clip_norm, divisor=expected_batch_size,
                       generator=generator)
    return norms, losses


def _materialised_step_grads(
    model: HazardModel, optimizer: Adam | torch.optim.Optimizer, x: Tensor, time: Tensor, event: Tensor,
    backend: Backend, grad_sample_module: nn.Module | None, *, noise_multiplier: float, clip_norm: float,
    expected_batch_size: float, generator: torch.Generator, on_step: Callable[[PerSampleView], None] | None,
) -> tuple[Tensor, Tensor]:
    """The ``"opacus"``/``"torch_func"`` backends of :func:`dp_sgd_step`: set ``.grad`` to the noisy mean.

    Materialises the per-sample gradients, clips them (``on_step`` gets them for a non-empty batch
    before the noise), adds the noise by :func:`noisy_sum` and replaces the gradients after
    ``optimizer.zero_grad``. Returns the per-record norms before clipping and the per-record losses.
    """
    if backend == "opacus":
        per_record, losses = per_sample_gradients_opacus(
            model, x, time, event, grad_sample_module=grad_sample_module
        )
    else:
        per_record, losses = per_sample_gradients(
            model.net, hazard_per_sample_loss_fn(model), x, time, event, return_loss=True
        )
    clipped, norms = clip_per_sample(per_record, clip_norm=clip_norm)
    if on_step is not None and x.shape[0] > 0:
        on_step(PerSampleView(flatten_per_sample(clipped).detach(),
                              torch.minimum(norms, norms.new_tensor(clip_norm)).detach()))
    summed = noisy_sum(clipped, noise_multiplier=noise_multiplier, clip_norm=clip_norm, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    for name, p in model.net.named_parameters():
        if name in summed:
            p.grad = (summed[name] / expected_batch_size).to(p.dtype)
    return norms, losses


# --------------------------------------------------------------------------- local training


def train_epochs_dp(
    model: SurvivalModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, epochs: int, batch_size: int,
    lr: float, weight_decay: float = 0.0, seed: int, noise_multiplier: float, clip_norm: float,
    backend: Backend = DEFAULT_BACKEND, on_step: Callable[[PerSampleView], None] | None = None,
    num_records: float | None = None, proximal_mu: float = 0.0,
) -> dict[str, float]:
    r"""DP-SGD counterpart of :func:`models.training.train_epochs` (Adam, in place; Abadi et al. 2016, Alg. 1).

    Poisson sampling with :math:`q = \min(1, B/n)` for :math:`T = \mathrm{round}(\text{epochs}/q)` steps
    (as many records visited in expectation as ``epochs`` epochs of batch ``B``), each a :func:`dp_sgd_step`.
    The accountant must use exactly the returned ``sample_rate``, ``noise_multiplier`` and ``num_steps``.
    Sampling and noise draw from a generator seeded by ``seed`` (dropout from the global RNG seeded by
    ``seed`` and restored afterwards): the same seed gives identical parameters.

    Parameters
    ----------
    model : SurvivalModel
        A :class:`models.survival.HazardModel`; Cox kinds raise :class:`DecomposabilityError` (their
        loss is not per-sample decomposable).
    x, time, event : ndarray, shapes (n, p), (n,) and (n,)
    epochs, batch_size, seed : int
        Expected passes over the data, expected batch size, and the seed of every draw.
    lr, weight_decay : float
        Adam's learning rate and L2 weight decay (default 0; applied to the privatised gradient: post-processing).
    noise_multiplier, clip_norm : float
        :math:`\sigma \ge 0` and :math:`C > 0`.
    backend, on_step
        See :func:`dp_sgd_step` (``on_step`` receives each step's clipped per-sample gradients).
    num_records : float, optional
        The record count the schedule is computed from (default ``len(x)``): in a federation, the count the
        site agreed at set-up, so that :math:`q`, the number of steps and the divisor :math:`qn` depend on released
        (or public) values only. Poisson sampling still draws each of the ``len(x)`` records with probability :math:`q`.
    proximal_mu : float, default 0
        FedProx's :math:`\mu` around the weights at the call (:class:`models.training.ProximalTerm`): its
        gradient is added to each step's privatised gradient.

    Returns
    -------
    dict
        ``loss``: mean per-record loss over the last :math:`\lceil 1/q \rceil` steps (the last "epoch"; computed
        before each update, not privatised, like ``train_epochs``'s loss); ``num_steps``, ``sample_rate``,
        ``noise_multiplier``, ``clip_norm``; ``mean_clip_fraction``: fraction of all sampled records clipped.
    """
    model = _require_hazard_model(model)
    noise_multiplier = _check_noise_multiplier(noise_multiplier)
    clip_norm = check_positive(clip_norm, "clip_norm")
    _check_backend(backend)
    data = _training_tensors(model, x, time, event, epochs=epochs, batch_size=batch_size, lr=lr,
                             weight_decay=weight_decay)
    count = data[0].shape[0] if num_records is None else check_positive(num_records, "num_records")
    sample_rate, steps = poisson_schedule(count, batch_size=batch_size, epochs=epochs)
    optimizer = Adam(model.net.parameters(), lr=lr, weight_decay=weight_decay)
    proximal = ProximalTerm(model.net, proximal_mu)
    model.net.train()
    loss, clip_fraction = _run_dp_steps(
        model, optimizer, data, sample_rate=sample_rate, steps=steps, expected_batch_size=sample_rate * count,
        seed=seed, noise_multiplier=noise_multiplier, clip_norm=clip_norm, backend=backend,
        on_step=on_step, proximal=proximal)
    return {"loss": loss, "num_steps": steps, "sample_rate": sample_rate, "noise_multiplier": noise_multiplier,
            "clip_norm": clip_norm, "mean_clip_fraction": clip_fraction}


def _training_tensors(
    model: HazardModel, x: np.ndarray, time: np.ndarray, event: np.ndarray, *, epochs: int, batch_size: int,
    lr: float, weight_decay: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` (float32), ``time`` (float64) and ``event`` (float32) as tensors, after checking them and the options.

    Raises ValueError for mismatched shapes or no record, a feature count other than the model's,
    ``epochs`` not an integer >= 0, ``batch_size`` not an integer >= 1, ``lr <= 0``, ``weight_decay < 0``,
    or a time that is not finite or lies before the model's first cut point.
    """
    x_t, time_t, event_t = training_tensors(x, time, event)
    if x_t.shape[1] != model.in_features:
        raise ValueError(f"x must have {model.in_features} features, got {x_t.shape[1]}")
    if int(epochs) != epochs or epochs < 0 or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"epochs must be an integer >= 0 and batch_size >= 1, got {epochs}, {batch_size}")
    if lr <= 0 or weight_decay < 0:
        raise ValueError(f"invalid lr={lr}, weight_decay={weight_decay}")
    if torch.any(time_t < model.cuts[0]) or not torch.all(torch.isfinite(time_t)):
        raise ValueError(f"every time must be finite and >= the first cut point {model.cuts[0]}")
    return x_t, time_t, event_t


def _run_dp_steps(
    model: HazardModel, optimizer: Adam, data: tuple[Tensor, Tensor, Tensor], *, sample_rate: float, steps: int,
    expected_batch_size: float, seed: int, noise_multiplier: float, clip_norm: float, backend: Backend,
    on_step: Callable[[PerSampleView], None] | None, proximal: ProximalTerm,
) -> tuple[float, float]:
    r"""Run ``steps`` :func:`dp_sgd_step` calls on Poisson batches of ``data``.

    Sampling and noise draw from one generator seeded by ``seed``; dropout from the global RNG, seeded by
    ``seed`` inside a fork that restores it afterwards. ``"ghost"`` falls back to ``"torch_func"`` (the same
    update) for a net that is not a chain of Linear layers. Returns the mean per-record loss of the last
    :math:`\lceil 1/q \rceil` steps and the fraction of sampled records that were clipped (NaN when no
    record was sampled).
    """
    x_t, time_t, event_t = data
    generator = torch.Generator().manual_seed(seed)
    if backend == "ghost" and _linear_chain(model.net) is None:
        backend = "torch_func"  # same update, for nets that are not a chain of Linear layers
    last_epoch_steps = math.ceil(1.0 / sample_rate)
    gsm = None
    if backend == "opacus":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model.net, batch_first=True, loss_reduction="sum")
    seen = clipped = 0.0
    last_loss = last_count = 0.0
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # dropout draws from it (torch.manual_seed: + CUDA)
            batches = poisson_batches(x_t.shape[0], sample_rate=sample_rate, steps=steps, generator=generator)
            for step, batch in enumerate(batches):
                stats = dp_sgd_step(
                    model, optimizer, x_t[batch], time_t[batch], event_t[batch],
                    noise_multiplier=noise_multiplier, clip_norm=clip_norm,
                    expected_batch_size=expected_batch_size, generator=generator,
                    backend=backend, grad_sample_module=gsm, on_step=on_step, proximal=proximal,
                )
                seen += stats["batch_size"]
                clipped += stats["num_clipped"]
                if step >= steps - last_epoch_steps:
                    last_loss += stats["loss_sum"]
                    last_count += stats["batch_size"]
    finally:
        if gsm is not None:
            gsm.cleanup()
    return last_loss / last_count if last_count else float("nan"), clipped / seen if seen else float("nan")
