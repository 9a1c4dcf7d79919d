"""Binds a typed :class:`ExperimentConfig` of a vertical run (strategy ``split``) to data, model and privacy.

The ServerApp (label holder), the ClientApp (modality sites), the in-process runner and the
benchmark all build their parts here, so every path trains the same network on the same split
with the same noise.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from flwr_app.config import ConfigError, ExperimentConfig
from models.bayesian import seeded
from models.data.files import resolve_data_dir
from models.data.vertical import (
    VERTICAL_FILES,
    VerticalFiles,
    VerticalTable,
    load_vertical,
    read_labels_file,
    read_modality_file,
    split_train_test,
)
from models.multimodal import HEAD_SEED_NAME, FusionHead, part_seed
from models.multimodal_training import discretised_labels
from models.time_grid import make_time_grid
from strategies.split import SiteConfig, SplitServer

__all__ = [
    "Labels",
    "SiteData",
    "labels",
    "load_table",
    "modality_names",
    "record_id_column",
    "server",
    "simulated_site",
    "simulation_noise_seed",
    "site_config",
    "site_from_node_config",
    "vertical_files",
]


@functools.lru_cache(maxsize=4)
def _table(name: str, data_dir: str, records: int, modalities: tuple[str, ...], files: VerticalFiles | None,
           stamps: tuple[tuple[int, int], ...]) -> VerticalTable:
    """``stamps`` (each file's modification time and size) makes a changed file a new entry."""
    table = load_vertical(name, data_dir=data_dir, n=records, files=files)
    return table.select(modalities) if modalities else table


def vertical_files(cfg: ExperimentConfig) -> VerticalFiles | None:
    """The user's files of ``data.name = "vertical_files"`` (``None`` for the other data sets)."""
    if cfg.data.name != VERTICAL_FILES:
        return None
    return VerticalFiles(labels=cfg.data.labels_path, modalities=tuple(cfg.data.modality_files.items()),
                         id_column=record_id_column(cfg.data.id_col), time_col=cfg.data.time_col or "time",
                         event_col=cfg.data.event_col or "event", categorical=cfg.data.categorical_cols,
                         drop_cols=cfg.data.drop_cols)


def _stamp(path: str) -> tuple[int, int]:
    try:
        status = Path(path).stat()
    except OSError:
        return (0, -1)  # the reader names the missing file
    return (status.st_mtime_ns, status.st_size)


def load_table(cfg: ExperimentConfig) -> VerticalTable:
    """The run's vertical data set with the modalities of ``split.modalities`` (memoised per process).

    In simulation the label holder reads the labels from it, and each simulated site its modality.
    The synthetic data set is drawn with seed 0 (it is a data set, not part of the run's randomness).
    ``data.name = "vertical_files"`` reads the user's labels file and modality files
    (:func:`models.data.vertical.load_vertical_files`, with the readers of a deployment); a file
    changed since it was read is read again. In a deployment (``data.name = "site_files"``) it is
    the label holder's file ``data.labels_path`` (columns ``data.id_col``, ``data.time_col`` and
    ``data.event_col``; "" = ``id``, ``time``, ``event``), without modalities: the sites hold them.

    Raises
    ------
    ConfigError
        For ``data.split_col`` (a split run splits the label holder's IDs at random,
        ``data.test_fraction``), and for ``data.id_col`` or ``data.drop_cols`` with a built-in data set
        (it has no files to name columns of).
    models.data.DataValidationError
        For a file that cannot be used, naming the file, the column and the rows.
    """
    if cfg.data.split_col:
        raise ConfigError("run config: data.split_col is for horizontal runs; split learning splits the label "
                          "holder's record IDs at random (data.test_fraction)")
    if cfg.data.deployed:
        return read_labels_file(cfg.data.labels_path, id_column=record_id_column(cfg.data.id_col),
                                time_col=cfg.data.time_col or "time", event_col=cfg.data.event_col or "event")
    files = vertical_files(cfg)
    if files is None and (cfg.data.id_col or cfg.data.drop_cols):
        raise ConfigError(f"run config: data.id_col and data.drop_cols name columns of vertical files (data.name = "
                          f"{VERTICAL_FILES} or site_files); the built-in data set {cfg.data.name!r} has none")
    stamps = tuple(_stamp(path) for path in (files.labels, *dict(files.modalities).values())) if files else ()
    return _table(cfg.data.name, str(resolve_data_dir(cfg.data.dir)), cfg.data.synthetic_records, cfg.split.modalities,
                  files, stamps)


def record_id_column(id_col: str) -> str:
    """The join key of a vertical deployment's files: ``id_col`` (``data.id_col``), default ``id``."""
    return id_col or "id"


def modality_names(deployed: bool, modalities: tuple[str, ...], table: VerticalTable) -> tuple[str, ...]:
    """The run's modalities, one site each: the table's in a simulation, ``modalities`` (``split.modalities``) in a
    deployment (``deployed``: ``data.deployed``)."""
    return modalities if deployed else tuple(table.modalities)


@dataclass(frozen=True)
class Labels:
    """What the label holder derives from its labels: the split, the time grid, discretised labels."""

    train_ids: np.ndarray
    test_ids: np.ndarray
    cuts: np.ndarray
    time_index: torch.Tensor
    event: torch.Tensor
    train_time: np.ndarray
    train_event: np.ndarray
    test_time: np.ndarray
    test_event: np.ndarray


def labels(cfg: ExperimentConfig, table: VerticalTable) -> Labels:
    """Train/test split of the record IDs (stratified by event, ``data.test_fraction``), the time grid
    (``model.num_durations`` on the training labels) and the discretised training labels."""
    train_ids, test_ids = split_train_test(table, test_fraction=cfg.data.test_fraction, seed=cfg.seed)
    train, test = table.subset(train_ids), table.subset(test_ids)
    cuts = make_time_grid(train.time, train.event, num_durations=cfg.model.num_durations, scheme=cfg.model.time_grid)
    time_index, event = discretised_labels(train.time, train.event, cuts)
    return Labels(train_ids=train_ids, test_ids=test_ids, cuts=cuts, time_index=time_index, event=event,
                  train_time=train.time, train_event=train.event, test_time=test.time, test_event=test.event)


def site_config(cfg: ExperimentConfig, modality: str, label_info: Labels, noise_multiplier: float) -> SiteConfig:
    """What the label holder sends a site at set-up."""
    return SiteConfig(
        modality=modality, seed=cfg.seed, train_ids=tuple(str(i) for i in label_info.train_ids),
        num_train=len(label_info.train_ids), dim=cfg.split.embedding_dim, encoder_layers=cfg.split.encoder_layers,
        dropout=cfg.split.dropout, bayesian=cfg.model.name == "bayesian_multisurv", lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay, clip_norm=cfg.privacy.clip_norm if cfg.privacy.enabled else None,
        noise_multiplier=noise_multiplier, delta=cfg.privacy.delta,
        adjacency=cfg.privacy.adjacency, batch_size=cfg.train.batch_size, epochs=cfg.federation.rounds,
    )


def server(cfg: ExperimentConfig, modalities: tuple[str, ...], label_info: Labels) -> SplitServer:
    """The label holder's part: the fusion head (initialised from its own seed) and its optimiser."""
    with seeded(part_seed(cfg.seed, HEAD_SEED_NAME)):
        head = FusionHead(cfg.split.embedding_dim, len(label_info.cuts), cfg.split.head_layers, cfg.split.dropout,
                          bayesian=cfg.model.name == "bayesian_multisurv", risk_layer=cfg.split.risk_layer)
    return SplitServer(modalities=modalities, fusion_head=head, time_index=label_info.time_index,
                       event=label_info.event, train_ids=[str(i) for i in label_info.train_ids], seed=cfg.seed,
                       lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                       similarity_weight=cfg.split.similarity_weight)


@dataclass(frozen=True)
class SiteData:
    """One site's modality: features indexed by record ID, its categorical columns, the noise seed."""

    modality: str
    features: pd.DataFrame
    categorical: tuple[str, ...]
    noise_base_seed: int
    source: str


def simulated_site(cfg: ExperimentConfig, partition_id: int) -> SiteData:
    """Site ``partition_id`` of a simulation: the ``partition_id``-th modality of the run's data set.

    Its noise seed is derived from the run seed, so simulations are reproducible; in a deployment
    each site's noise comes from its own secret (:func:`site_from_node_config`).
    """
    table = load_table(cfg)
    modalities = list(table.modalities)
    if not 0 <= partition_id < len(modalities):
        raise ValueError(f"partition-id {partition_id} is outside the {len(modalities)} modalities {modalities} of "
                         f"{cfg.data.name}: run with num-supernodes = {len(modalities)}")
    modality = modalities[partition_id]
    return SiteData(modality=modality, features=table.modalities[modality],
                    categorical=table.categorical.get(modality, ()),
                    noise_base_seed=simulation_noise_seed(cfg.seed),
                    source=table.sources.get(modality, f"{cfg.data.name} modality {modality!r}"))


def simulation_noise_seed(seed: int) -> int:
    """The simulated sites' noise seed, from the run's ``seed`` (:func:`strategies.split.noise_seed` adds the
    modality and step). Known to anyone who knows the run seed: simulation only."""
    return part_seed(seed, "noise")


def site_from_node_config(cfg: ExperimentConfig, node_config: Mapping[str, object]) -> SiteData:
    """A site's modality from its node config.

    Simulation (``partition-id``): :func:`simulated_site`. Deployment: ``modality`` names the
    modality and ``data-path`` its file (CSV or Parquet with the ID column ``data.id_col``, default
    ``id``, and without the columns of ``data.drop_cols``); ``categorical`` lists categorical columns
    (comma-separated). Every deployed site draws its noise seed from the operating system's entropy,
    afresh for each run: a ``noise-seed`` in node config is refused, since two runs with the same
    seed would release noise that cancels between them.
    """
    if "partition-id" in node_config:
        return simulated_site(cfg, int(node_config["partition-id"]))
    if "noise-seed" in node_config:
        raise ValueError("node config sets 'noise-seed': a fixed noise seed makes two runs' releases differ by the "
                         "data alone (the noise cancels); remove it: a deployed site draws its noise from the "
                         "operating system for every run")
    missing = [key for key in ("modality", "data-path") if key not in node_config]
    if missing:
        raise ValueError(f"node config lacks {missing}: a vertical site needs 'modality' and 'data-path'")
    path = str(node_config["data-path"])
    features = read_modality_file(path, id_column=record_id_column(cfg.data.id_col), drop_cols=cfg.data.drop_cols)
    categorical = tuple(part.strip() for part in str(node_config.get("categorical", "")).split(",") if part.strip())
    return SiteData(modality=str(node_config["modality"]), features=features, categorical=categorical,
                    noise_base_seed=secrets.randbits(63), source=path)
