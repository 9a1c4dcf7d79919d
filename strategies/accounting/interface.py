"""The one interface of a stateful privacy accountant: compose a release, report ε at δ, survive a checkpoint.

Every accountant that keeps a site's (or a run's) position between rounds implements it:

* :class:`strategies.accounting.rdp.SiteAccountant` (DP-SGD and the private set-up: RDP, PRV or PLD);
* :class:`strategies.accounting.bayesian_dp.BayesianAccountant` (Bayesian DP, ε_μ at β);
* :class:`strategies.accounting.distributed_dp.DistributedAccountant` (the distributed discrete Gaussian);
* :class:`strategies.accounting.filter.RenyiFilter` (a site's own budget, :mod:`flwr_app.site_policy`).

``step`` takes the release's parameters as keywords (each accountant names its own); the ledger and
the checkpoints use only ``epsilon`` and ``state_dict``. The weight-perturbation strategies and
central DP account in closed form from the run configuration (no state to keep), and private split
learning's releases happen once per data set (:mod:`strategies.accounting.private_split`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Accountant"]


@runtime_checkable
class Accountant(Protocol):
    """A stateful accountant (see the module docstring)."""

    def step(self, **release: Any) -> Any:
        """Compose one release (its parameters as keywords)."""

    def epsilon(self, delta: float) -> float:
        """ε at ``delta`` of everything composed so far."""

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state, from which the accountant can be restored."""
