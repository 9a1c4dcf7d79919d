r"""Server optimisers (``federation.server_optimizer``): Flower's FedAdam, FedYogi, FedAdagrad and FedAvgM.

Each round the server first combines the accepted updates into one aggregate (the weighted mean,
a robust aggregator, or central_dp's clipped and noised mean); a server optimiser then takes the
pseudo-gradient :math:`\Delta_t = \text{aggregate} - x_t` against the global model :math:`x_t`
and returns the new global model by Flower's own maths (Reddi et al. 2021 for the adaptive ones,
Hsu et al. 2019 for momentum). Nothing here re-implements them: :class:`ServerOptimizer` hands the
aggregate to a Flower strategy as the round's only reply, with weight 1 (Flower's weighted mean of
one reply is that reply, exactly), after the strategy's own ``configure_train`` has recorded the
global model the sites trained from.

The optimiser sees only the aggregate that the run releases, so it is post-processing: it changes
no site's privacy figures and no ledger entry. Under central_dp it acts on the already-noised mean
(Flower's DP wrapper adds its noise inside its own ``aggregate_train``, and the optimiser runs on
what that returns); acting before the noise would make the noise's calibration (sensitivity
``C / m`` of the mean) wrong. With a robust aggregator it acts on the robust aggregate.

Its state (FedOpt's moments ``m_t``, ``v_t``; FedAvgM's momentum and model) is part of the
strategy's checkpoint, so a resumed run continues the same optimisation.

References
----------
Reddi et al. (2021), "Adaptive federated optimization", ICLR; Hsu, Qi & Brown (2019), "Measuring
the effects of non-identical data distribution for federated visual classification", arXiv:1909.06335.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import FedAvg

from strategies.config import SERVER_OPTIMIZERS, FederationConfig

__all__ = ["ServerOptimizer", "make_server_optimizer"]

#: The array state of each kind of Flower optimiser (attributes of the strategy), kept in checkpoints.
_FEDOPT_STATE = ("m_t", "v_t")
_FEDAVGM_STATE = ("momentum_vector", "current_arrays")


class ServerOptimizer:
    """One of Flower's server optimisers, stepped once per round on the round's aggregate.

    Parameters
    ----------
    name
        A ``federation.server_optimizer`` other than ``fedavg``.
    lr, momentum
        Its server learning rate and momentum (``None``, the run config's ``auto``: the defaults of
        :data:`~strategies.config.SERVER_OPTIMIZERS`, chosen on validation splits; Flower's where it has none).
    """

    def __init__(self, name: str, *, lr: float | None = None, momentum: float | None = None) -> None:
        option = SERVER_OPTIMIZERS[name]
        if not option.flower_class:
            raise ValueError(f"server optimiser {name!r} has no Flower strategy (it is the aggregate itself)")
        lr = option.lr_default if lr is None else lr
        momentum = option.momentum_default if momentum is None else momentum
        kwargs = {**({option.lr: lr} if lr is not None else {}),
                  **({option.momentum: momentum} if momentum is not None else {})}
        self.name = name
        self.strategy = cast(FedAvg, getattr(flower_strategies, option.flower_class)(**kwargs))
        # configure_train then only records the global model (FedOpt: current_arrays; FedAvgM: the first one) and
        # samples no node: the sites are sampled and sent their messages by the run's own strategy.
        self.strategy.fraction_train = 0.0

    def step(self, server_round: int, global_arrays: ArrayRecord, aggregate: ArrayRecord) -> ArrayRecord:
        """The new global model: Flower's step from ``global_arrays`` (what the sites trained from) given ``aggregate``.

        The result keeps the global model's keys and dtypes (Flower's FedAdam computes in float64).
        """
        self.strategy.configure_train(server_round, global_arrays, ConfigRecord(), cast(Grid, None))
        reply = Message(content=RecordDict({self.strategy.arrayrecord_key: aggregate,
                                            "metrics": MetricRecord({self.strategy.weighted_by_key: 1.0})}),
                        dst_node_id=0, message_type=MessageType.TRAIN)
        stepped, _ = self.strategy.aggregate_train(server_round, [reply])
        if stepped is None:
            raise RuntimeError(f"round {server_round}: Flower's {type(self.strategy).__name__} returned no model")
        return ArrayRecord({key: Array(np.asarray(stepped[key].numpy(), dtype=array.numpy().dtype))
                            for key, array in global_arrays.items()})

    # ------------------------------------------------------------------ checkpoints

    def _attributes(self) -> tuple[str, ...]:
        return _FEDAVGM_STATE if isinstance(self.strategy, flower_strategies.FedAvgM) else _FEDOPT_STATE

    def state_dict(self) -> dict[str, Any]:
        """The optimiser's state: its name and each state attribute as a torch state dict (``None`` before round 1)."""
        state: dict[str, Any] = {"name": self.name}
        for attribute in self._attributes():
            value = getattr(self.strategy, attribute)
            if isinstance(value, list):  # FedAvgM's momentum: a list in the model's key order
                value = {str(index): array for index, array in enumerate(value)}
            if isinstance(value, dict):
                value = ArrayRecord({key: Array(np.asarray(array)) for key, array in value.items()})
            state[attribute] = None if value is None else value.to_torch_state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (refused when it is another optimiser's)."""
        if state.get("name") != self.name:
            raise ValueError(f"the checkpoint holds server optimiser {state.get('name')!r}'s state, not {self.name!r}'s")
        for attribute in self._attributes():
            saved = state[attribute]
            value: Any = None if saved is None else ArrayRecord(saved)
            if value is not None and attribute == "momentum_vector":
                value = [value[str(index)].numpy() for index in range(len(value))]
            elif value is not None and attribute in _FEDOPT_STATE:
                value = {key: array.numpy() for key, array in value.items()}
            setattr(self.strategy, attribute, value)


def make_server_optimizer(federation: FederationConfig) -> ServerOptimizer | None:
    """The run's server optimiser (``None`` for ``fedavg``: the aggregate is the new global model)."""
    if not SERVER_OPTIMIZERS[federation.server_optimizer].flower_class:
        return None
    return ServerOptimizer(federation.server_optimizer, lr=federation.server_lr, momentum=federation.server_momentum)
