"""The run's typed configuration: frozen dataclasses, parsed once at the edge.

:func:`flwr_app.config.parse_run_config` is the only place that reads the flat run-config keys
(``data.name``, ``privacy.epsilon``, ...) and builds these objects; everything else (the privacy
mechanisms in :mod:`strategies.mechanisms`, the ServerApp and ClientApp, the simulations) receives
an :class:`ExperimentConfig` instead of a Flower ``Context`` or a Hydra ``DictConfig``. The types
live here, below ``flwr_app``, so that the mechanisms can take them without importing Flower apps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: ``data.name`` of a deployment: every site reads its own file (node config ``data-path``); in a
#: vertical run the label holder reads ``data.labels_path``.
DEPLOYED_DATA = "site_files"
#: How every output labels a centralised baseline: it trains again on the federation's records, pooled at one place.
CENTRALIZED_LABEL = "not private, simulation reference"
#: Models of a horizontal federation (one survival network) and of split learning (one encoder per modality).
HORIZONTAL_MODELS = ("hazard_mlp", "cox_mlp", "cox_time")
VERTICAL_MODELS = ("bayesian_multisurv", "multisurv")


class ConfigError(ValueError):
    """A run-config key is unknown, has the wrong type or an invalid value."""


@dataclass(frozen=True)
class DataConfig:
    """Which data set, where it lives and how it is split.

    ``id_col`` names the record ID column (never a feature; the join key of vertical data),
    ``drop_cols`` columns that are not features, and ``split_col`` a column of train/test labels
    that replaces the random split.
    """

    name: str
    path: str
    dir: str
    time_col: str
    event_col: str
    feature_cols: tuple[str, ...]
    test_fraction: float
    horizon_months: int
    oot_start: str
    synthetic_records: int
    labels_path: str
    dictionary: str = ""
    id_col: str = ""
    drop_cols: tuple[str, ...] = ()
    split_col: str = ""

    @property
    def deployed(self) -> bool:
        """True when the sites read their own files (``data.name = "site_files"``): a deployment."""
        return self.name == DEPLOYED_DATA


@dataclass(frozen=True)
class ModelConfig:
    """Survival network. ``None`` fields take the model kind's own default."""

    name: str
    num_durations: int
    time_grid: str
    hidden: tuple[int, ...] | None
    activation: str | None
    dropout: float | None
    penalty: float


@dataclass(frozen=True)
class TrainConfig:
    """Local optimisation at each site (and for the centralised baseline)."""

    local_epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    num_threads: int


@dataclass(frozen=True)
class FederationConfig:
    """Sites, rounds and how records are partitioned among sites."""

    num_sites: int
    rounds: int
    partition: str
    dirichlet_alpha: float
    min_site_records: int
    fraction_train: float
    min_sites: int
    timeout_s: float
    aggregation: str = "fedavg"
    trim_fraction: float = 0.2
    max_malicious: int = 1


@dataclass(frozen=True)
class DebugConfig:
    """Injected failures for tests of fault tolerance (simulation only; README "Fault tolerance and checkpoints").

    ``fail_site`` (a horizontal site's name, ``site-<i>``, or a split run's modality; empty: none)
    fails on every ``fail_message`` (``train``, ``evaluate``, ``breslow``) from round (split:
    epoch) ``fail_round`` on, by raising (``fail_mode = "raise"``: an error reply) or by never
    answering (``"hang"``). ``stop_after_round`` > 0 stops the ServerApp once that round's
    outputs and checkpoint are written, as a crash of the server would.
    """

    fail_site: str
    fail_round: int
    fail_message: str
    fail_mode: str
    stop_after_round: int


@dataclass(frozen=True)
class PrivacyConfig:
    """Target privacy budget and mechanism parameters; ``epsilon`` of ``inf`` means no DP."""

    epsilon: float
    delta: float
    clip_norm: float
    accountant: str
    adjacency: str
    allocation: str
    dispersion: str
    uniform_mix: float
    min_site_records: int
    setup_noise: float = 10.0

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.epsilon)


@dataclass(frozen=True)
class SplitConfig:
    """Vertical split learning (strategy ``split``): modalities, architecture, embedding privacy.

    ``modalities`` empty means every modality of the data set. ``calibration`` is ``"rdp"`` (σ
    from an RDP accountant without amplification, for the record's releases at every site) or
    ``"paper"`` (the BVFLMSP formula, labelled as such). ``mc_samples`` is the number of
    stochastic prediction passes per held-out record (each one a release unless
    ``clean_inference``).
    """

    modalities: tuple[str, ...]
    embedding_dim: int
    encoder_layers: int
    head_layers: int
    dropout: float
    similarity_weight: float
    calibration: str
    mc_samples: int
    clean_inference: bool


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs, parsed once at the edge."""

    seed: int
    strategy: str
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    split: SplitConfig
    output_dir: str
    server_evaluation: bool
    centralized_baseline: bool
    resume_from: str
    debug: DebugConfig

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dictionary (JSON-serialisable) of the resolved configuration."""
        return asdict(self)
