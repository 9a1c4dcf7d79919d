"""Privacy mechanisms: one module, and one object, per mechanism.

:mod:`strategies.mechanisms.registry` maps each ``strategy.name`` to its
:class:`~strategies.mechanisms.base.Mechanism` (checks, site step, accounting, ledger entry,
assumptions, release manifest): :mod:`~strategies.mechanisms.none` (``fedavg``),
:mod:`~strategies.mechanisms.dp_sgd`, :mod:`~strategies.mechanisms.bdp`,
:mod:`~strategies.mechanisms.central_dp`, :mod:`~strategies.mechanisms.nbafl` (``nbafl``,
``ls_adp``, ``row_dp``) and :mod:`~strategies.mechanisms.embedding_dp` (``split``). The pure
mathematics lives beside each object in its module (and in :mod:`strategies.accounting`);
:mod:`~strategies.mechanisms.setup_statistics` releases a federation's set-up with DP. This
package re-exports the DP-SGD functions.
"""

from strategies.mechanisms.dp_sgd import (
    DEFAULT_BACKEND,
    DecomposabilityError,
    clip_per_sample,
    clipped_sum_ghost,
    dp_sgd_step,
    flatten_per_sample,
    hazard_per_sample_loss_fn,
    noisy_sum,
    per_sample_gradients,
    per_sample_gradients_opacus,
    poisson_batches,
    poisson_schedule,
    train_epochs_dp,
)

__all__ = [
    "DEFAULT_BACKEND",
    "DecomposabilityError",
    "clip_per_sample",
    "clipped_sum_ghost",
    "dp_sgd_step",
    "flatten_per_sample",
    "hazard_per_sample_loss_fn",
    "noisy_sum",
    "per_sample_gradients",
    "per_sample_gradients_opacus",
    "poisson_batches",
    "poisson_schedule",
    "train_epochs_dp",
]
