"""The registry: each ``strategy.name`` maps to its one privacy-mechanism object.

As opacus maps an accountant's name to its class, fedsurv maps a strategy's name to the object that
owns its configuration checks, site step, accounting, ledger entry and release manifest
(:class:`~strategies.mechanisms.base.Mechanism`). This is the only place where a strategy's name
is dispatched; a new mechanism is added here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from strategies.config import ConfigError
from strategies.mechanisms.base import HorizontalMechanism, Mechanism
from strategies.mechanisms.bdp import BayesianDP
from strategies.mechanisms.central_dp import CentralDP
from strategies.mechanisms.distributed_dp import DistributedDP
from strategies.mechanisms.dp_sgd import DPSGD
from strategies.mechanisms.embedding_dp import EmbeddingDP
from strategies.mechanisms.nbafl import LSADP, ROWDP, NbAFL
from strategies.mechanisms.none import NoPrivacy
from strategies.mechanisms.private_split import PrivateSplitDP

__all__ = ["MECHANISMS", "STRATEGIES", "get_mechanism", "horizontal_mechanism"]

#: ``strategy.name`` -> its mechanism.
MECHANISMS: Mapping[str, Mechanism] = MappingProxyType({mechanism.name: mechanism for mechanism in (
    NoPrivacy(), DPSGD(), BayesianDP(), DistributedDP(), CentralDP(), NbAFL(), LSADP(), ROWDP(), EmbeddingDP(),
    PrivateSplitDP(),
)})
#: Every strategy name, in the registry's order.
STRATEGIES: tuple[str, ...] = tuple(MECHANISMS)


def get_mechanism(name: str) -> Mechanism:
    """The mechanism of strategy ``name`` (``ConfigError`` listing the known names otherwise)."""
    if name not in MECHANISMS:
        raise ConfigError(f"run config: 'strategy.name' = {name!r}; choose one of {', '.join(STRATEGIES)}")
    return MECHANISMS[name]


def horizontal_mechanism(name: str) -> HorizontalMechanism:
    """The mechanism of a horizontal strategy (``ConfigError`` for the split-learning protocol)."""
    mechanism = get_mechanism(name)
    if not isinstance(mechanism, HorizontalMechanism):
        raise ConfigError(f"run config: strategy {name!r} is not a horizontal federation")
    return mechanism
