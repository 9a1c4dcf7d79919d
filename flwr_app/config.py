"""Run configuration: flat run-config keys -> typed, frozen configuration objects.

One schema serves both entry points. The keys and their defaults are declared once in
``pyproject.toml`` under ``[tool.flwr.app.config]`` (what ``flwr run --run-config`` overrides);
the Hydra tree in ``conf/`` produces the same dotted keys (a test keeps the two in step).
:func:`parse_run_config` is the only place that reads those keys: it validates them and returns an
:class:`ExperimentConfig` that the rest of the code receives instead of a Flower ``Context`` or a
Hydra ``DictConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from flwr_app.faults import HOSTILE_MODES
from models.data import DATASETS
from models.data.vertical import VERTICAL_DATASETS
from strategies.config import (
    DEPLOYED_DATA,
    HORIZONTAL_MODELS,
    VERTICAL_MODELS,
    ConfigError,
    DataConfig,
    DebugConfig,
    ExperimentConfig,
    FederationConfig,
    ModelConfig,
    PrivacyConfig,
    SplitConfig,
    TrainConfig,
)
from strategies.horizontal import AGGREGATIONS
from strategies.mechanisms.adaptive_dp import DISPERSION_MEASURES
from strategies.mechanisms.base import Mechanism
from strategies.mechanisms.nbafl import ALLOCATIONS
from strategies.mechanisms.registry import STRATEGIES, get_mechanism

__all__ = [
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DEPLOYED_DATA",
    "ExperimentConfig",
    "FederationConfig",
    "ModelConfig",
    "PrivacyConfig",
    "PROJECT_ROOT",
    "SplitConfig",
    "STRATEGIES",
    "TrainConfig",
    "parse_run_config",
]

MODELS = HORIZONTAL_MODELS + VERTICAL_MODELS
ALL_DATASETS = DATASETS + tuple(name for name in VERTICAL_DATASETS if name not in DATASETS) + (DEPLOYED_DATA,)
SPLIT_CALIBRATIONS = ("rdp", "paper")

ACCOUNTANTS = ("rdp", "prv")
FAIL_MESSAGES = ("train", "evaluate", "breslow")
FAIL_MODES = ("raise", "hang") + HOSTILE_MODES
ADJACENCIES = ("auto", "add-remove", "replace-one")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


#: The float keys for which ``inf`` means something (every other float key must be finite).
INFINITE_MEANS = {"privacy.epsilon": "no differential privacy"}


def _finite(key: str, value: float) -> float:
    """``value`` unless it is NaN, ``-inf``, or ``inf`` for a key outside :data:`INFINITE_MEANS`."""
    if math.isnan(value):
        raise ConfigError(f"run config: '{key}' must be a number, got nan")
    if math.isinf(value) and (value < 0 or key not in INFINITE_MEANS):
        allowed = "; only " + ", ".join(f"{name} may be inf ({meaning})" for name, meaning in INFINITE_MEANS.items()) \
            if value > 0 else ""
        raise ConfigError(f"run config: '{key}' must be finite, got {value}{allowed}")
    return value


def _get(flat: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in flat:
        raise ConfigError(f"run config: missing key '{key}'")
    value = flat[key]
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(key, float(value))
    if kind is float and isinstance(value, str) and value.strip().lower() in ("inf", "+inf"):
        return _finite(key, math.inf)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"run config: '{key}' must be {kind.__name__}, got {value!r} ({type(value).__name__})"
        )
    return value


def _choice(key: str, value: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"run config: '{key}' = {value!r}; choose one of {', '.join(options)}")
    return value


def _positive(key: str, value: float, *, allow_zero: bool = False) -> float:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"run config: '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _auto(flat: Mapping[str, Any], key: str) -> str | None:
    """String value where ``"auto"`` (or empty) means: the model kind's default; a number in it must be finite."""
    value = flat.get(key, "auto")
    if isinstance(value, str) and value.strip().lower() in ("", "auto"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    _finite(key, number)
    return str(value)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def parse_run_config(flat: Mapping[str, Any]) -> ExperimentConfig:
    """Validate a flat run config (``{"data.name": "flchain", ...}``) into typed objects.

    Raises
    ------
    ConfigError
        On an unknown data set, model or strategy, a value of the wrong type, or a value out of
        range. The message names the key.
    """
    data = DataConfig(
        name=_choice("data.name", _get(flat, "data.name", str), ALL_DATASETS),
        path=_get(flat, "data.path", str),
        dir=_get(flat, "data.dir", str),
        time_col=_get(flat, "data.time_col", str),
        event_col=_get(flat, "data.event_col", str),
        feature_cols=_csv(_get(flat, "data.feature_cols", str)),
        test_fraction=_get(flat, "data.test_fraction", float),
        horizon_months=_get(flat, "data.horizon_months", int),
        oot_start=_get(flat, "data.oot_start", str),
        synthetic_records=int(_positive("data.synthetic_records", _get(flat, "data.synthetic_records", int))),
        labels_path=_get(flat, "data.labels_path", str),
        dictionary=_get(flat, "data.dictionary", str),
        id_col=_get(flat, "data.id_col", str),
        drop_cols=_csv(_get(flat, "data.drop_cols", str)),
        split_col=_get(flat, "data.split_col", str),
    )
    if not 0.0 < data.test_fraction < 1.0:
        raise ConfigError(f"run config: 'data.test_fraction' must be in (0, 1), got {data.test_fraction}")
    if data.name == "csv" and not data.path:
        raise ConfigError("run config: data.name='csv' needs 'data.path' (and 'data.time_col', 'data.event_col' "
                          "unless the columns are called 'time' and 'event')")

    hidden = _auto(flat, "model.hidden")
    dropout = _auto(flat, "model.dropout")
    try:
        hidden_layers = None if hidden is None else tuple(int(width) for width in _csv(hidden))
        dropout_rate = None if dropout is None else float(dropout)
    except ValueError as err:
        raise ConfigError(f"run config: 'model.hidden' / 'model.dropout' malformed: {err}") from None
    model = ModelConfig(
        name=_choice("model.name", _get(flat, "model.name", str), MODELS),
        num_durations=int(_positive("model.num_durations", _get(flat, "model.num_durations", int))),
        time_grid=_choice("model.time_grid", _get(flat, "model.time_grid", str), ("quantiles", "equidistant")),
        hidden=hidden_layers,
        activation=_auto(flat, "model.activation"),
        dropout=dropout_rate,
        penalty=_positive("model.penalty", _get(flat, "model.penalty", float), allow_zero=True),
    )
    train = TrainConfig(
        local_epochs=int(_positive("train.local_epochs", _get(flat, "train.local_epochs", int))),
        batch_size=int(_positive("train.batch_size", _get(flat, "train.batch_size", int))),
        lr=_positive("train.lr", _get(flat, "train.lr", float)),
        weight_decay=_positive("train.weight_decay", _get(flat, "train.weight_decay", float), allow_zero=True),
        num_threads=int(_positive("train.num_threads", _get(flat, "train.num_threads", int))),
    )
    federation = FederationConfig(
        num_sites=int(_positive("federation.num_sites", _get(flat, "federation.num_sites", int))),
        rounds=int(_positive("federation.rounds", _get(flat, "federation.rounds", int))),
        partition=_get(flat, "federation.partition", str),
        dirichlet_alpha=_positive("federation.dirichlet_alpha", _get(flat, "federation.dirichlet_alpha", float)),
        min_site_records=int(
            _positive("federation.min_site_records", _get(flat, "federation.min_site_records", int), allow_zero=True)
        ),
        fraction_train=_get(flat, "federation.fraction_train", float),
        min_sites=int(_positive("federation.min_sites", _get(flat, "federation.min_sites", int))),
        timeout_s=_positive("federation.timeout_s", _get(flat, "federation.timeout_s", float)),
        aggregation=_choice("federation.aggregation", _get(flat, "federation.aggregation", str), AGGREGATIONS),
        trim_fraction=_get(flat, "federation.trim_fraction", float),
        max_malicious=int(_positive("federation.max_malicious", _get(flat, "federation.max_malicious", int),
                                    allow_zero=True)),
    )
    if not 0.0 <= federation.trim_fraction < 0.5:
        raise ConfigError(f"run config: 'federation.trim_fraction' must be in [0, 0.5), got {federation.trim_fraction}")
    if not 0.0 < federation.fraction_train <= 1.0:
        raise ConfigError(
            f"run config: 'federation.fraction_train' must be in (0, 1], got {federation.fraction_train}"
        )
    privacy = PrivacyConfig(
        epsilon=_positive("privacy.epsilon", _get(flat, "privacy.epsilon", float)),
        delta=_get(flat, "privacy.delta", float),
        clip_norm=_positive("privacy.clip_norm", _get(flat, "privacy.clip_norm", float)),
        accountant=_choice("privacy.accountant", _get(flat, "privacy.accountant", str), ACCOUNTANTS),
        adjacency=_choice("privacy.adjacency", _get(flat, "privacy.adjacency", str), ADJACENCIES),
        allocation=_choice("privacy.allocation", _get(flat, "privacy.allocation", str), ALLOCATIONS),
        dispersion=_choice("privacy.dispersion", _get(flat, "privacy.dispersion", str), DISPERSION_MEASURES),
        uniform_mix=_get(flat, "privacy.uniform_mix", float),
        min_site_records=int(
            _positive("privacy.min_site_records", _get(flat, "privacy.min_site_records", int), allow_zero=True)
        ),
        setup_noise=_positive("privacy.setup_noise", _get(flat, "privacy.setup_noise", float), allow_zero=True),
    )
    if not 0.0 <= privacy.uniform_mix <= 1.0:
        raise ConfigError(f"run config: 'privacy.uniform_mix' must be in [0, 1], got {privacy.uniform_mix}")
    if not 0.0 < privacy.delta < 1.0:
        raise ConfigError(f"run config: 'privacy.delta' must be in (0, 1), got {privacy.delta}")
    strategy = _choice("strategy.name", _get(flat, "strategy.name", str), STRATEGIES)
    mechanism = get_mechanism(strategy)
    split = SplitConfig(
        modalities=_csv(_get(flat, "split.modalities", str)),
        embedding_dim=int(_positive("split.embedding_dim", _get(flat, "split.embedding_dim", int))),
        encoder_layers=int(_positive("split.encoder_layers", _get(flat, "split.encoder_layers", int), allow_zero=True)),
        head_layers=int(_positive("split.head_layers", _get(flat, "split.head_layers", int), allow_zero=True)),
        dropout=_get(flat, "split.dropout", float),
        similarity_weight=_positive("split.similarity_weight", _get(flat, "split.similarity_weight", float),
                                    allow_zero=True),
        calibration=_choice("split.calibration", _get(flat, "split.calibration", str), SPLIT_CALIBRATIONS),
        mc_samples=int(_positive("split.mc_samples", _get(flat, "split.mc_samples", int))),
        clean_inference=_get(flat, "split.clean_inference", bool),
    )
    if not 0.0 <= split.dropout < 1.0:
        raise ConfigError(f"run config: 'split.dropout' must be in [0, 1), got {split.dropout}")
    privacy = _resolve_adjacency(mechanism, privacy)
    if not mechanism.vertical:
        _check_horizontal(data, model)
    server_evaluation = _get(flat, "evaluation.server_side", bool)
    centralized_baseline = _get(flat, "baseline.centralized", bool)
    debug = DebugConfig(
        fail_site=_get(flat, "debug.fail_site", str).strip(),
        fail_round=int(_positive("debug.fail_round", _get(flat, "debug.fail_round", int))),
        fail_message=_choice("debug.fail_message", _get(flat, "debug.fail_message", str), FAIL_MESSAGES),
        fail_mode=_choice("debug.fail_mode", _get(flat, "debug.fail_mode", str), FAIL_MODES),
        stop_after_round=int(_positive("debug.stop_after_round", _get(flat, "debug.stop_after_round", int),
                                       allow_zero=True)),
    )
    resume_from = _get(flat, "resume.from", str).strip()
    _check_faults(mechanism, data, debug, resume_from)
    if data.deployed:
        _check_deployment(mechanism, split, data, server_evaluation=server_evaluation,
                          centralized_baseline=centralized_baseline)
    cfg = ExperimentConfig(
        seed=int(_get(flat, "seed", int)),
        strategy=strategy,
        data=data,
        model=model,
        train=train,
        federation=federation,
        privacy=privacy,
        split=split,
        output_dir=_get(flat, "output.dir", str),
        server_evaluation=server_evaluation,
        centralized_baseline=centralized_baseline,
        resume_from=resume_from,
        debug=debug,
    )
    mechanism.check(cfg)
    return cfg


def _check_faults(mechanism: Mechanism, data: DataConfig, debug: DebugConfig, resume_from: str) -> None:
    """Injected failures are for simulations; split runs have no checkpoints and no Breslow or evaluate messages."""
    if data.deployed and (debug.fail_site or debug.stop_after_round):
        raise ConfigError("run config: 'debug.fail_site' and 'debug.stop_after_round' inject failures into "
                          f"simulations only; a deployment (data.name = {DEPLOYED_DATA!r}) must leave them at their "
                          "defaults ('' and 0)")
    if not mechanism.vertical:
        return
    if resume_from or debug.stop_after_round:
        raise ConfigError("run config: 'resume.from' and 'debug.stop_after_round' apply to horizontal runs only: a "
                          "split run keeps each site's encoder in that site's node state, which no server checkpoint "
                          "can restore")
    if debug.fail_site and debug.fail_message != "train":
        raise ConfigError(f"run config: a split run's sites answer training round trips only; "
                          f"'debug.fail_message' = {debug.fail_message!r} never happens there (use 'train')")


def _resolve_adjacency(mechanism: Mechanism, privacy: PrivacyConfig) -> PrivacyConfig:
    """``privacy.adjacency = "auto"``: the mechanism's first offered adjacency (split: replace-one, else add-remove)."""
    if privacy.adjacency != "auto":
        return privacy
    return replace(privacy, adjacency=mechanism.adjacencies[0])


def _check_horizontal(data: DataConfig, model: ModelConfig) -> None:
    """Horizontal runs refuse the vertical models and the vertical-only data sets."""
    if model.name in VERTICAL_MODELS:
        raise ConfigError(f"run config: model {model.name!r} is a vertical (multimodal) model; use strategy.name = "
                          f"'split'")
    if data.name not in DATASETS + (DEPLOYED_DATA,):
        raise ConfigError(f"run config: data set {data.name!r} is vertical (one modality per site); use "
                          f"strategy.name = 'split'")


def _check_deployment(mechanism: Mechanism, split: SplitConfig, data: DataConfig, *,
                      server_evaluation: bool, centralized_baseline: bool) -> None:
    """A deployment (``data.name = "site_files"``): the server holds no pooled data."""
    if server_evaluation or centralized_baseline:
        raise ConfigError(
            f"run config: data.name = {DEPLOYED_DATA!r} (a deployment) leaves no pooled data at the server: set "
            "evaluation.server_side = false (each site evaluates on its own held-out part) and "
            "baseline.centralized = false"
        )
    if mechanism.vertical and (not data.labels_path or not split.modalities):
        raise ConfigError(
            f"run config: a vertical deployment (strategy 'split', data.name = {DEPLOYED_DATA!r}) needs "
            "'data.labels_path' (the label holder's file of id, time and event) and 'split.modalities' "
            "(the modality of every site, e.g. 'clinical,genomic')"
        )
