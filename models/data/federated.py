"""Federated survival data sets: sites, their training/test/out-of-time parts, preprocessed arrays."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from models.data.datasets import PARQUET_SUFFIXES, ColumnRoles, RawTable, load_table
from models.data.partition import (
    MIN_SITE_RECORDS,
    SCHEMES,
    check_site_count,
    natural_partition,
    partition_indices,
    stratified_split,
)
from models.data.preprocess import Preprocessor, category_keys
from models.data.sba import DEFAULT_OOT_START
from models.data.validate import DataValidationError, check_site_events

logger = logging.getLogger(__name__)

SPLITS = ("train", "test", "oot")
NO_OOT = "none"
# Independent random streams derived from the one seed.
SPLIT_STREAM, OOT_STREAM = 1, 2
#: How a federation agrees on the preprocessing: site name -> its raw training (features, time, event) in, the
#: agreed :class:`Preprocessor` out (:func:`build_federated_dataset`'s ``fit_preprocessor``).
_PreprocessorFit = Callable[[Mapping[str, tuple[pd.DataFrame, np.ndarray, np.ndarray]]], Preprocessor]


@dataclass(frozen=True)
class SurvivalArrays:
    """Preprocessed records: features ``x`` (float32, n x d), ``time`` (float64), ``event`` (float32, 0/1)."""

    x: np.ndarray
    time: np.ndarray
    event: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", np.asarray(self.x, dtype="float32"))
        object.__setattr__(self, "time", np.asarray(self.time, dtype="float64"))
        object.__setattr__(self, "event", np.asarray(self.event, dtype="float32"))
        if self.x.ndim != 2 or self.time.shape != (len(self.x),) or self.event.shape != (len(self.x),):
            raise ValueError(
                f"inconsistent shapes: x {self.x.shape}, time {self.time.shape}, event {self.event.shape}"
            )

    def __len__(self) -> int:
        return len(self.time)

    def subset(self, idx: np.ndarray | Sequence[int]) -> SurvivalArrays:
        """The records at positions (or boolean mask) ``idx``."""
        idx = np.asarray(idx)
        return SurvivalArrays(self.x[idx], self.time[idx], self.event[idx])

    @staticmethod
    def concat(parts: Sequence[SurvivalArrays]) -> SurvivalArrays:
        """All records of ``parts``, in order."""
        if not parts:
            raise ValueError("nothing to concatenate")
        return SurvivalArrays(
            np.concatenate([p.x for p in parts]),
            np.concatenate([p.time for p in parts]),
            np.concatenate([p.event for p in parts]),
        )


@dataclass(frozen=True)
class SiteData:
    """One site: its name and its training, test and (SBA) out-of-time parts."""

    name: str
    train: SurvivalArrays
    test: SurvivalArrays
    oot: SurvivalArrays | None = None


@dataclass(frozen=True)
class FederatedDataset:
    """Sites sharing one feature space, preprocessed with statistics of the training parts only.

    ``preprocessor`` is the federation's agreed preprocessing (raw columns -> ``x``): what a saved
    model needs to encode new records.
    """

    sites: tuple[SiteData, ...]
    preprocessor: Preprocessor
    source: str

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The encoded model inputs (columns of ``x``)."""
        return self.preprocessor.feature_names

    @property
    def num_sites(self) -> int:
        """Number of sites (for natural partitions: the number of groups kept)."""
        return len(self.sites)

    @property
    def in_features(self) -> int:
        """Width of ``x``."""
        return len(self.feature_names)

    def pooled(self, split: str) -> SurvivalArrays:
        """All sites' ``"train"``, ``"test"`` or ``"oot"`` parts, concatenated in site order."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}'; options: {', '.join(SPLITS)}")
        parts = [getattr(site, split) for site in self.sites]
        if any(p is None for p in parts):
            raise ValueError(f"{self.source}: no out-of-time part (set oot_start on a data set with dates)")
        return SurvivalArrays.concat(parts)


def out_of_time_mask(table: RawTable, name: str, oot_start: str) -> np.ndarray | None:
    """Records dated on/after ``oot_start`` (SBA default: 2005-01-01; ``"none"`` disables)."""
    start = oot_start or (DEFAULT_OOT_START if name == "sba" else "")
    if not start or start.lower() == NO_OOT:
        return None
    if table.period is None:
        raise DataValidationError(
            f"{table.source}: oot_start='{start}' needs record dates; data set '{name}' has none"
        )
    try:
        timestamp = pd.Timestamp(start)
    except ValueError:
        raise DataValidationError(f"oot_start='{start}' is not a date (use YYYY-MM-DD)") from None
    return (table.period >= timestamp).to_numpy()


def assign_sites(
    table: RawTable,
    partition: str,
    positions: np.ndarray,
    *,
    num_sites: int,
    seed: int,
    dirichlet_alpha: float,
    min_site_records: int,
) -> dict[str, np.ndarray]:
    """Site name -> table positions, partitioning the records at ``positions``.

    Raises
    ------
    DataValidationError
        Naming the table's source, when the records cannot give every site its minimum
        (:func:`~models.data.partition.check_site_count`, :func:`~models.data.partition.natural_partition`).
    """
    if partition in SCHEMES:
        minimum = max(min_site_records, MIN_SITE_RECORDS) if partition == "dirichlet" else MIN_SITE_RECORDS
        check_site_count(positions.size, num_sites, minimum=minimum, source=table.source)
        parts = partition_indices(
            partition, time=table.time[positions], event=table.event[positions], num_sites=num_sites,
            seed=seed, dirichlet_alpha=dirichlet_alpha, min_site_records=min_site_records,
        )  # fmt: skip
        return {f"site-{k}": positions[part] for k, part in enumerate(parts)}
    groups = table.groups[partition].iloc[positions]
    return {name: positions[part]
            for name, part in natural_partition(groups, min_site_records, source=table.source).items()}


def assign_out_of_time(
    table: RawTable, partition: str, positions: np.ndarray, site_names: Sequence[str], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Site name -> out-of-time positions: by group value (natural), else a random near-equal split."""
    if partition in SCHEMES:
        parts = np.array_split(rng.permutation(positions), len(site_names))
        return {name: np.sort(part) for name, part in zip(site_names, parts)}
    names = category_keys(table.groups[partition].iloc[positions])
    assigned = {name: positions[(names == name).to_numpy()] for name in site_names}
    unassigned = len(positions) - sum(map(len, assigned.values()))
    if unassigned:
        logger.warning("%d out-of-time records belong to no site (%s) and are left out", unassigned, partition)
    return assigned


def train_test_positions(
    table: RawTable, positions: np.ndarray, *, test_fraction: float, rng: np.random.Generator, site: str,
) -> tuple[np.ndarray, np.ndarray]:
    """A site's training and test positions: the table's predefined split (``data.split_col``) where it has
    one, else a random split stratified by event (``test_fraction``).

    Raises
    ------
    DataValidationError
        When the split leaves the site without a test record (a random split: only for ``test_fraction > 0``).
    """
    if table.test_mask is None:
        train, test = stratified_split(positions, table.event, test_fraction, rng)
        if test_fraction > 0 and not test.size:
            raise DataValidationError(f"{table.source}: data.test_fraction = {test_fraction:g} gives site '{site}' "
                                      f"(its {positions.size} records) no test record; raise data.test_fraction or "
                                      "use fewer sites")
        return train, test
    test = table.test_mask[positions]
    if not test.any():
        raise DataValidationError(f"{table.source}: data.split_col labels none of site '{site}'s "
                                  f"{positions.size} records 'test'; every site needs test records")
    return positions[~test], positions[test]


def site_splits(
    table: RawTable, *, name: str, seed: int, num_sites: int, partition: str, dirichlet_alpha: float,
    test_fraction: float, min_site_records: int, oot_start: str,
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray] | None]:
    """Each site's training and test positions in ``table``, and its out-of-time positions (None without an
    out-of-time part): the in-time records partitioned into sites (:func:`assign_sites`), each site's split
    (:func:`train_test_positions`, seeded by ``seed``). Needs pandas and numpy only: a run checks its partition
    with it before it starts. The arguments are :func:`build_federated_dataset`'s (``table`` with its group
    column for a natural partition, :meth:`RawTable.with_group`).

    Raises
    ------
    DataValidationError
        Naming the table's source: too few records for the sites, a site without a test record or without an
        event in its training part, no in-time record.
    """
    oot = out_of_time_mask(table, name, oot_start)
    in_time = np.flatnonzero(~oot) if oot is not None else np.arange(len(table))
    if in_time.size == 0:
        raise DataValidationError(f"{table.source}: no records dated before oot_start; nothing to train on")
    sites = assign_sites(
        table, partition, in_time, num_sites=num_sites, seed=seed,
        dirichlet_alpha=dirichlet_alpha, min_site_records=min_site_records,
    )  # fmt: skip
    split_rng = np.random.default_rng([seed, SPLIT_STREAM])
    splits = {site: train_test_positions(table, pos, test_fraction=test_fraction, rng=split_rng, site=site)
              for site, pos in sites.items()}
    train_events = {site: table.event[train] for site, (train, _) in splits.items()}
    check_site_events(train_events, source=table.source, part="training")
    if oot is None:
        return splits, None
    oot_rng = np.random.default_rng([seed, OOT_STREAM])
    return splits, assign_out_of_time(table, partition, np.flatnonzero(oot), list(sites), oot_rng)


def build_federated_dataset(
    *, name: str, seed: int, num_sites: int, partition: str = "iid", dirichlet_alpha: float = 0.5,
    test_fraction: float = 0.2, path: str = "", data_dir: str = "", time_col: str = "", event_col: str = "",
    feature_cols: Sequence[str] = (), min_site_records: int = 0, sba_horizon_months: int = 48, oot_start: str = "",
    fit_preprocessor: _PreprocessorFit | None = None, roles: ColumnRoles = ColumnRoles(),
) -> FederatedDataset:
    """Load, validate, partition, split and preprocess a data set for a horizontal federation.

    The in-time records are partitioned into sites; each site's records are split into training and test parts,
    stratified by event; out-of-time records (SBA) form each site's ``oot`` part. Preprocessing is fitted on the
    union of the sites' training parts only (equal to the secure federated aggregate of per-site statistics, see
    :mod:`models.data.preprocess`) and applied to every part. Everything is deterministic given ``seed``.

    Parameters
    ----------
    name
        Data set: ``flchain``, ``metabric``, ``gbsg``, ``whas``, ``sba`` or ``csv``.
    seed
        Seed of the partition, the train/test splits and the out-of-time assignment.
    num_sites
        Number of sites for ``iid`` and ``dirichlet``; ignored by natural partitions, whose site
        count is the number of groups kept (read :attr:`FederatedDataset.num_sites`).
    partition
        ``"iid"``, ``"dirichlet"`` or a column name (natural partition: one site per value, named
        by it, sorted by name; the column is not a feature).
    dirichlet_alpha
        Concentration of the Dirichlet partition (small -> skewed).
    test_fraction
        Share of each site's records (per event class) in its test part (unused with ``roles.split_col``).
    path, data_dir, time_col, event_col, feature_cols, sba_horizon_months, roles
        Passed to :func:`models.data.datasets.load_table`; a ``roles.split_col`` replaces the random
        train/test split by its labels.
    min_site_records
        Natural partitions drop groups with fewer in-time records; Dirichlet draws need at least
        ``max(min_site_records, MIN_SITE_RECORDS)`` records per site. Every site needs at least
        :data:`~models.data.partition.MIN_SITE_RECORDS` records (:func:`site_splits`).
    oot_start
        First date (YYYY-MM-DD) of the out-of-time part; default ``2005-01-01`` for ``sba`` and no
        out-of-time part for the others; ``"none"`` disables it.
    fit_preprocessor
        How the federation agrees on the preprocessing: called with every site's raw training features, times
        and events (site name -> ``(features, time, event)``), e.g. the differentially private set-up of
        :mod:`strategies.mechanisms.setup_statistics`. Default: :meth:`Preprocessor.fit` on the pooled training parts.

    Raises
    ------
    DataValidationError
        For bad input, an unknown partition, or a site without events in its training part.
    """
    table = load_table(
        name, path=path, data_dir=data_dir, time_col=time_col, event_col=event_col,
        feature_cols=feature_cols, sba_horizon_months=sba_horizon_months, roles=roles,
    )  # fmt: skip
    if partition not in SCHEMES:
        table = table.with_group(partition)
    splits, oot_sites = site_splits(
        table, name=name, seed=seed, num_sites=num_sites, partition=partition, dirichlet_alpha=dirichlet_alpha,
        test_fraction=test_fraction, min_site_records=min_site_records, oot_start=oot_start,
    )  # fmt: skip
    return _preprocessed_sites(table, splits, oot_sites, _fitted_preprocessor(table, splits, fit_preprocessor))


def _fitted_preprocessor(table: RawTable, splits: Mapping[str, tuple[np.ndarray, np.ndarray]],
                         fit_preprocessor: _PreprocessorFit | None) -> Preprocessor:
    """The preprocessing of :func:`build_federated_dataset`, fitted on the sites' training parts of ``table``
    only (``splits``: site -> training and test positions): ``fit_preprocessor`` called with each site's raw
    training ``(features, time, event)``, or by default :meth:`Preprocessor.fit` on the pooled training parts."""
    if fit_preprocessor is None:
        return Preprocessor.fit(table.features.iloc[np.concatenate([train for train, _ in splits.values()])])
    return fit_preprocessor({site: (table.features.iloc[train].reset_index(drop=True), table.time[train],
                                    table.event[train]) for site, (train, _) in splits.items()})


def _preprocessed_sites(table: RawTable, splits: Mapping[str, tuple[np.ndarray, np.ndarray]],
                        oot_sites: Mapping[str, np.ndarray] | None, preprocessor: Preprocessor) -> FederatedDataset:
    """``table`` transformed by ``preprocessor`` and cut into each site's training, test and (with ``oot_sites``)
    out-of-time parts at the positions of ``splits`` and ``oot_sites``."""
    arrays = SurvivalArrays(preprocessor.transform(table.features), table.time, table.event)
    return FederatedDataset(
        sites=tuple(
            SiteData(
                site, arrays.subset(train), arrays.subset(test),
                None if oot_sites is None else arrays.subset(oot_sites[site]),
            )  # fmt: skip
            for site, (train, test) in splits.items()
        ),
        preprocessor=preprocessor,
        source=table.source,
    )


def raw_rows(path: str | Path) -> pd.DataFrame:
    """A site file's rows as its raw values, every column in the file's order: a CSV's fields as the text
    written (no number parsing, an empty field ``""``), a Parquet file's values as stored."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return pd.read_parquet(path)
    return pd.read_csv(path, dtype=str, keep_default_na=False, low_memory=False)


def _raw_text(value: object) -> str:
    """One raw value as text: a missing value ``""`` (as a CSV writes it), anything else ``str``."""
    if isinstance(value, str):
        return value
    try:
        missing = value is None or bool(pd.isna(value))
    except (TypeError, ValueError):  # an array-like value (a Parquet list column)
        missing = False
    return "" if missing else str(value)


def record_identities(rows: pd.DataFrame, *, id_col: str = "", source: str = "") -> list[bytes]:
    """Each record's identity for :func:`split_site_table`: its ``id_col`` value where the run names an
    ID column (``data.id_col``), else the row's content, a canonical encoding (JSON) of its raw values
    (:func:`raw_rows`), all columns in the file's order.

    Identical rows have one identity (without an ID column they fall on the same side of the split);
    changing any value of a row, or the file's columns, gives it another.

    Raises
    ------
    DataValidationError
        When ``id_col`` is not a column of ``rows``, or a row has no ID (naming ``source`` and the rows).
    """
    if id_col:
        if id_col not in rows.columns:
            raise DataValidationError(f"{source}: data.id_col names column '{id_col}', which the file does not have")
        ids = [_raw_text(value) for value in rows[id_col].tolist()]
        missing = np.flatnonzero([not value.strip() for value in ids])
        if missing.size:
            raise DataValidationError(f"{source}: column '{id_col}' (data.id_col): {missing.size} row(s) without an "
                                      f"ID (rows {', '.join(str(row + 2) for row in missing[:5])}); give every "
                                      "record an ID, or run without data.id_col")
        return [b"id\x00" + value.encode() for value in ids]
    return [b"row\x00" + json.dumps([_raw_text(value) for value in row], ensure_ascii=False,
                                    separators=(",", ":")).encode()
            for row in rows.itertuples(index=False, name=None)]


def keyed_shares(identities: Sequence[bytes], key: bytes) -> np.ndarray:
    """Each identity's HMAC-SHA256 under ``key``, its first 53 bits read as a uniform number in [0, 1)."""
    return np.array([(int.from_bytes(hmac.new(key, identity, hashlib.sha256).digest()[:8], "big") >> 11) / 2.0 ** 53
                     for identity in identities], dtype=np.float64)


def split_site_table(table: RawTable, identities: Sequence[bytes], *, name: str, key: bytes,
                     test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A deployed site's split of its own table into training and test positions, decided by its own key.

    A record is in the test part when its keyed share (:func:`keyed_shares` of its identity,
    :func:`record_identities`, under the site's secret ``key``) is below ``test_fraction``. Nothing
    the server chooses moves a record but ``test_fraction``, and a larger fraction only adds records
    to the test part; each record's side depends on its own identity alone, so adding or removing
    records moves no other record. Where the file labels its records (``data.split_col``), the
    labels decide. The split is not stratified by event. A simulated site keeps the seeded split
    (:func:`train_test_positions`).

    Raises
    ------
    DataValidationError
        When the training part has no event, naming the site and the file.
    """
    if len(identities) != len(table):
        raise ValueError(f"{table.source}: {len(identities)} record identities for {len(table)} records")
    if table.test_mask is not None:
        test = np.asarray(table.test_mask, dtype=bool)
    else:
        test = keyed_shares(identities, key) < test_fraction
    train, held_out = np.flatnonzero(~test), np.flatnonzero(test)
    check_site_events({name: table.event[train]}, source=table.source, part="training")
    return train, held_out


def preprocessed_site(
    table: RawTable, train: np.ndarray, test: np.ndarray, preprocessor: Preprocessor, *, name: str,
) -> SiteData:
    """One site's training and test parts, encoded with the federation's shared ``preprocessor``."""
    arrays = SurvivalArrays(preprocessor.transform(table.features), table.time, table.event)
    return SiteData(name, arrays.subset(train), arrays.subset(test))
