"""Record-level privacy mechanisms applied at a site (no Flower imports).

:mod:`strategies.mechanisms.dp_sgd` implements DP-SGD (Abadi et al. 2016) for the
per-sample decomposable discrete-time hazard model.
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
