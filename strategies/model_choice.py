r"""What ``model.name = "auto"`` trains in a horizontal federation, from quantities every party holds after the set-up.

:func:`choose_model` is a pure, deterministic rule (no data, no randomness, no Flower): the same inputs give the same
architecture at the server and at every site. Its inputs are public once the set-up has run: the sites' agreed
record counts (a private set-up's noisy released counts), the number of encoded covariates (the width of the agreed
preprocessing), the strategy, its target ε and the hazard model's output layer and time grid.

The rule (``docs/when-to-use-what.md``, "What model.name = auto trains"):

* Without DP noise (ε = inf, or a strategy that adds none) the default network (:data:`DEFAULT`).
* With DP noise, a candidate is admissible when its *records per parameter under noise*
  :math:`z = n_{\mathrm{eff}}\,\varepsilon / d` reaches :data:`DP_SIGNAL_THRESHOLD`, where :math:`d` counts the
  covariate weights of the network (:func:`covariate_parameters`; the interval baselines, which the set-up's
  Kaplan-Meier start fixes, are not counted) and :math:`n_{\mathrm{eff}}` the records one noisy release averages over
  (:func:`effective_records`): the noise every weight carries falls as :math:`1/(n\varepsilon)`, and a network has
  :math:`d` weights to learn from it. The largest admissible candidate of :data:`CANDIDATES` is chosen; the smallest
  is always admissible.

The threshold was measured on validation splits (``benchmarks/model_choice.py``), never on test records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strategies.config import DEFAULT_HIDDEN

#: The architectures the rule chooses from, smallest first: model kind and hidden widths. This tuple is the one place
#: a further candidate is added (e.g. ``coxph``, or the linear ``("hazard_mlp", ())``, which ranked below ``(32,)`` on
#: every validation split at the recipes' clip norms and tied it at a clip norm of 0.3: docs/when-to-use-what.md).
CANDIDATES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("hazard_mlp", (32,)),
    ("hazard_mlp", DEFAULT_HIDDEN["hazard_mlp"]),
)
#: The network trained without DP noise (``hazard_mlp``'s default widths, :data:`strategies.config.DEFAULT_HIDDEN`).
DEFAULT = CANDIDATES[-1]
#: :math:`z` a candidate needs under DP noise, measured on validation splits only (docs/when-to-use-what.md, "What
#: model.name = auto trains"). Below it: GBSG, six centres of 40-250 training records (``benchmarks/model_choice.py``,
#: 5 seeds), where the default network's z was 0.02-0.47 at ε = 1 and 10 and it never ranked above the 32-unit
#: layer (distributed_dp at ε = 10, z 0.47: 0.664 against 0.668 C); above it: SBA's 4 regions under distributed_dp
#: at ε = 1 (``benchmarks/large_federation_levers.py``, seeds 0-1), z 0.73, where the default network reached 0.890
#: validation C against 0.850. At z 1.4-47 (GBSG, distributed_dp, ε 30-1000) the default network was within 0.009 C
#: of the small one: the cost of choosing it there.
DP_SIGNAL_THRESHOLD = 0.6
#: Strategies that add no DP noise to what they train on (ε is inf for them).
NOT_PRIVATE = ("fedavg",)
#: Strategies whose noisy release is one gradient of the union of the sites' records.
UNION_RELEASE = ("distributed_dp",)
#: Strategies whose unit of privacy is a whole site (the noise is calibrated to one site's update).
SITE_LEVEL = ("central_dp",)


@dataclass(frozen=True)
class ModelChoice:
    """What :func:`choose_model` chose: the model kind, its hidden widths, why (one line) and from what."""

    name: str
    hidden: tuple[int, ...]
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """``summary.json``'s ``model_choice``: chosen (model.name and model.hidden), reason and inputs."""
        return {"chosen": {"model.name": self.name, "model.hidden": list(self.hidden)}, "reason": self.reason,
                "inputs": dict(self.inputs)}

    def line(self) -> str:
        """The console line of a run: ``model.name=auto: chose ... because ...``."""
        return f"model.name=auto: chose {describe(self.name, self.hidden)} because {self.reason}"


def describe(name: str, hidden: tuple[int, ...]) -> str:
    """``hazard_mlp, model.hidden=[]`` (linear) or ``hazard_mlp, model.hidden=[32]``."""
    return f"{name}, model.hidden=[{','.join(map(str, hidden))}]" + (" (linear)" if not hidden else "")


def covariate_parameters(hidden: Sequence[int], covariates: int, *, num_durations: int, risk_layer: str) -> int:
    """Weights of a hazard network that multiply covariates or hidden units: the hidden layers with their biases and
    the output layer (``num_durations - 1`` logits for the ``interval`` layer, one risk score for ``proportional``;
    no output bias: the interval baselines carry it)."""
    widths = [covariates, *hidden]
    layers = sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(widths, widths[1:]))
    return layers + widths[-1] * (num_durations - 1 if risk_layer == "interval" else 1)


def effective_records(records_per_site: Sequence[float], strategy: str) -> float:
    r"""Records one noisy release averages over: the union's for :data:`UNION_RELEASE`, the number of sites for
    :data:`SITE_LEVEL`, and otherwise :math:`n / \sqrt{S}` (each of the :math:`S` sites adds its own noise to its
    update, so the mean of the updates carries :math:`\sqrt{S}` times the noise of one release of all :math:`n`
    records)."""
    total, sites = float(sum(records_per_site)), len(records_per_site)
    if strategy in UNION_RELEASE:
        return total
    if strategy in SITE_LEVEL:
        return float(sites)
    return total / math.sqrt(sites)


def choose_model(records_per_site: Sequence[float], covariates: int, epsilon: float, strategy: str, *,
                 num_durations: int, risk_layer: str) -> ModelChoice:
    """The architecture ``model.name = "auto"`` trains (module docstring: the rule and its threshold).

    ``records_per_site``: the sites' agreed record counts; ``covariates``: the encoded inputs of the model;
    ``epsilon``: the run's target ε (inf without DP); ``num_durations`` and ``risk_layer``: the hazard model's
    time grid and output layer, which set the output layer's size."""
    if not records_per_site or covariates < 1 or num_durations < 2:
        raise ValueError("choose_model needs at least one site's count, one covariate and two intervals")
    inputs = {"records_per_site": [round(float(count), 1) for count in records_per_site], "covariates": covariates,
              "epsilon": epsilon, "strategy": strategy, "num_sites": len(records_per_site),
              "num_durations": num_durations, "risk_layer": risk_layer}
    if math.isinf(epsilon) or strategy in NOT_PRIVATE:
        return ModelChoice(*DEFAULT, "no DP noise: the default network", inputs)
    n_eff = effective_records(records_per_site, strategy)
    chosen = CANDIDATES[0]
    for candidate in CANDIDATES[1:]:
        if _signal(n_eff, epsilon, candidate[1], covariates, num_durations, risk_layer) >= DP_SIGNAL_THRESHOLD:
            chosen = candidate
    z = _signal(n_eff, epsilon, chosen[1], covariates, num_durations, risk_layer)
    larger = CANDIDATES.index(chosen) + 1
    reason = (f"records per parameter under noise z = n_eff*epsilon/d = {n_eff:.0f}*{epsilon:g}/"
              f"{covariate_parameters(chosen[1], covariates, num_durations=num_durations, risk_layer=risk_layer)}"
              f" = {z:.2f}")
    if larger < len(CANDIDATES):
        bigger = CANDIDATES[larger]
        reason += (f"; {describe(*bigger)} would have z = "
                   f"{_signal(n_eff, epsilon, bigger[1], covariates, num_durations, risk_layer):.2f}"
                   f" < {DP_SIGNAL_THRESHOLD:g}")
    else:
        reason += f" >= {DP_SIGNAL_THRESHOLD:g}"
    return ModelChoice(*chosen, reason, {**inputs, "effective_records": round(n_eff, 1)})


def _signal(n_eff: float, epsilon: float, hidden: tuple[int, ...], covariates: int, num_durations: int,
            risk_layer: str) -> float:
    d = covariate_parameters(hidden, covariates, num_durations=num_durations, risk_layer=risk_layer)
    return n_eff * epsilon / d
