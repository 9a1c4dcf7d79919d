"""Which run-config keys each strategy's mechanism honours: one table, read by the mechanisms and their checks.

:data:`HONOURS` maps each ``strategy.name`` to the keys of :data:`strategies.config.MECHANISM_KEYS`
its mechanism reads (:attr:`strategies.mechanisms.base.Mechanism.honours`); any other of them must keep
its default (:meth:`~strategies.mechanisms.base.Mechanism.check_keys`), and the refusal names the
strategies that do honour it (:func:`takers`). The table is data, in the registry's order: a
mechanism differs from another in the keys it reads, not in code that tests its name. A horizontal
mechanism that honours ``privacy.setup_share`` releases its set-up with DP (:func:`has_private_setup`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "AGGREGATION",
    "BUDGET",
    "DELTA_CHECK",
    "HONOURS",
    "HORIZONTAL",
    "LOCAL_TRAINING",
    "PRIVATE_SETUP",
    "SERVER_OPTIMIZER",
    "has_private_setup",
    "takers",
]

# The keys a mechanism may honour (strategies.config.MECHANISM_KEYS), in the groups the mechanisms declare them by.

#: A horizontal federation's sites, partition and sampling, a site's network and resumption from a checkpoint (no
#: split-learning strategy reads them).
HORIZONTAL: frozenset[str] = frozenset({
    "federation.num_sites", "federation.partition", "federation.dirichlet_alpha", "federation.min_site_records",
    "federation.fraction_train", "federation.min_sites", "model.hidden", "model.activation", "model.dropout",
    "model.risk_layer", "resume.from"})
#: Local mini-batch training at a site (FedProx's term included).
LOCAL_TRAINING: frozenset[str] = frozenset({"train.local_epochs", "train.batch_size", "train.lr", "train.weight_decay",
                                            "train.proximal_mu"})
#: How the server combines the sites' updates: FedAvg's bounded weighted mean (its weights capped) or a robust
#: aggregator.
AGGREGATION: frozenset[str] = frozenset({"federation.aggregation", "federation.update_bound",
                                         "federation.max_weight_ratio", "federation.trim_fraction",
                                         "federation.max_malicious"})
#: Flower's server optimiser, stepped toward each round's aggregate.
SERVER_OPTIMIZER: frozenset[str] = frozenset({"federation.server_optimizer", "federation.server_lr",
                                              "federation.server_momentum"})
#: Every DP mechanism's target and clipping.
BUDGET: frozenset[str] = frozenset({"privacy.epsilon", "privacy.delta", "privacy.clip_norm", "privacy.accountant",
                                    "privacy.adjacency"})
#: A private set-up: its share of the budget and the public data dictionary it takes.
PRIVATE_SETUP: frozenset[str] = frozenset({"privacy.setup_share", "data.dictionary"})
#: The override of the refusal of a delta above 1/n (:func:`strategies.mechanisms.base.delta_refusal`), by the
#: mechanisms that check it.
DELTA_CHECK: frozenset[str] = frozenset({"privacy.delta_override"})

_FEDAVG = HORIZONTAL | LOCAL_TRAINING | AGGREGATION | SERVER_OPTIMIZER
_DP_SGD = _FEDAVG | BUDGET | DELTA_CHECK | PRIVATE_SETUP
_WEIGHT_PERTURBATION = (_FEDAVG | BUDGET | DELTA_CHECK
                        | {"model.penalty", "privacy.allocation", "privacy.min_site_records"})
_SPLIT_TRAINING = BUDGET | DELTA_CHECK | {"train.batch_size", "train.lr", "train.weight_decay", "split.modalities",
                                          "split.embedding_dim", "split.mc_samples", "split.risk_layer"}

#: ``strategy.name`` -> the keys its mechanism honours, in the registry's order.
HONOURS: Mapping[str, frozenset[str]] = MappingProxyType({
    "fedavg": _FEDAVG | {"model.penalty"},
    "dp_sgd": _DP_SGD | {"privacy.setup_sum", "privacy.max_dropouts", "privacy.colluding_sites",
                         "privacy.modulus_bits"},  # the last three: its secure set-up sum (dp_sgd.DPSGD.check)
    "bdp": _DP_SGD,
    "distributed_dp": (HORIZONTAL - {"resume.from"}) | BUDGET | DELTA_CHECK | PRIVATE_SETUP | {
        "train.lr", "privacy.max_dropouts", "privacy.colluding_sites", "privacy.modulus_bits"},
    "central_dp": HORIZONTAL | LOCAL_TRAINING | SERVER_OPTIMIZER | BUDGET | DELTA_CHECK | {"model.penalty"},
    "nbafl": _WEIGHT_PERTURBATION,
    "ls_adp": _WEIGHT_PERTURBATION | {"privacy.uniform_mix"},
    "row_dp": _WEIGHT_PERTURBATION | {"privacy.uniform_mix", "privacy.dispersion"},
    "split": _SPLIT_TRAINING | {"split.encoder_layers", "split.head_layers", "split.dropout",
                                "split.similarity_weight", "split.calibration", "split.clean_inference"},
    "private_split": _SPLIT_TRAINING | PRIVATE_SETUP | {"split.encoder", "split.release_noise", "split.fit_share"},
})


def takers(key: str) -> tuple[str, ...]:
    """The strategies whose mechanism honours ``key``, in the registry's order."""
    return tuple(name for name, honoured in HONOURS.items() if key in honoured)


def has_private_setup(strategy: str) -> bool:
    """Whether a horizontal ``strategy`` releases its set-up statistics with DP when ``privacy.setup_share`` > 0
    (its mechanism honours the share; :mod:`strategies.mechanisms.setup_statistics`)."""
    return "privacy.setup_share" in HONOURS[strategy]
