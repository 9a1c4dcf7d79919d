"""Each mechanism declares the keys it honours; a key it ignores, or whose effect would stack on its own, is refused.

``strategies.config.MECHANISM_KEYS`` names the keys whose effect depends on the strategy's mechanism,
``COMMON_KEYS`` those every strategy honours; ``Mechanism.honours`` lists the ones a mechanism reads, and
``Mechanism.check_keys`` (run by ``parse_run_config``) refuses any other at a value but its default, in one line.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from flwr_app.config import parse_run_config
from strategies.config import (
    KEYS,
    STRATEGIES,
    ConfigError,
    ExperimentConfig,
    key_value,
    mechanism_keys,
    parse_flat,
    run_defaults,
    unclassified_keys,
)
from strategies.mechanisms.registry import MECHANISMS


def base(strategy: str) -> dict:
    """The smallest valid run config of ``strategy``."""
    flat: dict = {"strategy.name": strategy}
    if STRATEGIES[strategy].vertical:
        flat["data.name"] = "synthetic_multimodal"
    if MECHANISMS[strategy].private:
        flat["privacy.epsilon"] = 1.0
    return flat


def other_value(name: str, default):
    """A value of key ``name`` of its kind that is not ``default``."""
    key = KEYS[name]
    if key.setting.choices:
        return next(choice for choice in key.setting.choices if choice != default)
    kind = key.kind
    if kind == "bool":
        return not default
    if kind == "str":
        return "/elsewhere/x.json"
    if kind == "list[str]":
        return ("a", "b")
    if kind == "list[int]":
        return (7,)
    if default is None or (isinstance(default, float) and math.isinf(default)):
        return 1 if kind == "int" else 0.5
    return default + 1


def with_value(cfg: ExperimentConfig, name: str, value) -> ExperimentConfig:
    key = KEYS[name]
    if not key.group:
        return dataclasses.replace(cfg, **{key.attribute: value})
    group = dataclasses.replace(getattr(cfg, key.group), **{key.attribute: value})
    return dataclasses.replace(cfg, **{key.group: group})


def test_every_key_of_the_schema_is_classified():
    assert unclassified_keys() == ()


@pytest.mark.parametrize("strategy", list(MECHANISMS))
def test_a_mechanism_declares_only_keys_that_depend_on_the_mechanism(strategy):
    mechanism = MECHANISMS[strategy]
    keys = set(mechanism_keys())
    assert mechanism.honours <= keys, sorted(mechanism.honours - keys)
    assert set(mechanism.refusals) <= keys - mechanism.honours, sorted(set(mechanism.refusals) & mechanism.honours)


@pytest.mark.parametrize("strategy", list(MECHANISMS))
def test_every_key_a_mechanism_does_not_honour_is_refused_at_any_other_value_in_one_line(strategy):
    mechanism = MECHANISMS[strategy]
    cfg = parse_run_config(base(strategy))
    defaults = run_defaults(cfg)
    mechanism.check_keys(cfg)  # the defaults pass
    refused = []
    for name in mechanism_keys():
        changed = with_value(cfg, name, other_value(name, defaults[name]))
        if name in mechanism.honours:
            mechanism.check_keys(changed)  # honoured: any value is the mechanism's to judge
            continue
        with pytest.raises(ConfigError) as caught:
            mechanism.check_keys(changed)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"run config: {name} = "), message
        assert f"'{strategy}'" in message, message
        assert "has no effect" in message or name in mechanism.refusals, message
        refused.append(name)
    assert set(refused) == set(mechanism_keys()) - mechanism.honours


def test_the_defaults_resolved_for_the_run_are_not_refused():
    cfg = parse_run_config({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "train.batch_size": "auto",
                            "train.local_epochs": 1, "federation.server_optimizer": "fedavg", "train.proximal_mu": 0})
    assert key_value(cfg, "train.local_epochs") == 1 and key_value(cfg, "train.lr") == 0.01


@pytest.mark.parametrize(("overrides", "message"), [
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "federation.server_optimizer": "fedadam"},
     "run config: federation.server_optimizer = 'fedadam' would stack on the server Adam step (lr = train.lr) that "
     "strategy 'distributed_dp' takes"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "train.proximal_mu": 0.1},
     "run config: train.proximal_mu = 0.1 has no effect on strategy 'distributed_dp', whose round is one full-batch "
     "gradient step"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "train.batch_size": 512},
     "run config: train.batch_size = 512 has no effect on strategy 'distributed_dp'"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "federation.aggregation": "median"},
     "run config: federation.aggregation = 'median' cannot run with strategy 'distributed_dp'"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "resume.from": "/x"},
     "run config: resume.from = '/x' is not offered for strategy 'distributed_dp'"),
    ({"strategy.name": "central_dp", "privacy.epsilon": 1.0, "federation.update_bound": 3},
     "run config: federation.update_bound = 3 bounds FedAvg's weighted mean, which strategy 'central_dp' does not "
     "take"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "federation.update_bound": 0},
     "run config: federation.update_bound = 0 bounds FedAvg's weighted mean, which strategy 'distributed_dp'"),
    ({"strategy.name": "central_dp", "privacy.epsilon": 1.0, "federation.aggregation": "krum"},
     "run config: federation.aggregation = 'krum' is not offered with strategy 'central_dp'"),
    ({"privacy.clip_norm": 2.0}, "run config: privacy.clip_norm = 2 has no effect on strategy 'fedavg'; leave it at "
                                 "auto (here 1); honoured by dp_sgd"),
    ({"privacy.delta": 1e-6}, "run config: privacy.delta = 1e-06 has no effect on strategy 'fedavg'"),
    ({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "privacy.allocation": "exact"},
     "run config: privacy.allocation = 'exact' has no effect on strategy 'dp_sgd'; leave it at 'paper'; honoured by "
     "nbafl, ls_adp, row_dp"),
    ({"strategy.name": "nbafl", "privacy.epsilon": 1.0, "privacy.dispersion": "iqr"},
     "run config: privacy.dispersion = 'iqr' has no effect on strategy 'nbafl'; leave it at 'var'; honoured by "
     "row_dp"),
    ({"strategy.name": "split", "data.name": "synthetic_multimodal", "federation.num_sites": 3},
     "run config: federation.num_sites = 3 has no effect on strategy 'split'"),
    ({"strategy.name": "split", "data.name": "synthetic_multimodal", "model.hidden": "32,32"},
     "run config: model.hidden = '32,32' has no effect on strategy 'split'"),
    ({"strategy.name": "fedavg", "split.embedding_dim": 8},
     "run config: split.embedding_dim = 8 has no effect on strategy 'fedavg'"),
    ({"strategy.name": "private_split", "data.name": "synthetic_multimodal", "split.head_layers": 3},
     "run config: split.head_layers = 3 has no effect on strategy 'private_split'"),
])
def test_an_ignored_or_stacked_key_is_refused_naming_the_key_its_value_and_the_strategy(overrides, message):
    with pytest.raises(ConfigError) as caught:
        parse_run_config(overrides)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_schema_alone_does_not_judge_the_mechanism_keys():
    """parse_flat takes what only the mechanism can judge; parse_run_config refuses it."""
    flat = {"strategy.name": "split", "data.name": "synthetic_multimodal", "train.proximal_mu": 0.1}
    assert parse_flat(flat).train.proximal_mu == 0.1
    with pytest.raises(ConfigError, match="train.proximal_mu = 0.1 has no effect on strategy 'split'"):
        parse_run_config(flat)
