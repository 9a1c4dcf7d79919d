"""Vertically partitioned survival data: the same people, one modality per site.

A :class:`VerticalTable` holds, for one cohort, the labels (kept by the server, the active party)
and one feature table per modality (kept by the sites, the passive parties), all keyed by record
ID. :func:`align_modalities` is the check a split-learning run makes before training: every site
must hold IDs the label holder knows, without duplicates; a record a site lacks is *missing* for
that modality (a zero input and a fusion mask, as in the BVFLMSP paper), not an error.

Data sets:

* METABRIC (``metabric.csv``, found by :func:`models.data.files.data_file`): genomic ``x0..x3`` |
  clinical ``x4..x8``;
* scikit-survival's ``load_breast_cancer``: 76 gene-expression columns | clinical (age, ER,
  grade, size);
* :func:`simulate_multimodal`: three modalities whose true log-hazard is the sum of one score per
  modality, so that no pair of modalities recovers the risk ordering of all three;
* ``vertical_files``, a user's own files (:class:`VerticalFiles`, :func:`load_vertical_files`): one
  CSV or Parquet file per modality and a labels file, joined on the ID column, read by the same
  readers as a deployment's sites and label holder.

:func:`load_vertical` picks one by name. :func:`split_train_test` is the label holder's
train/test split of the record IDs (stratified by event); :class:`ModalityTransform` is a site's
own preprocessing of its modality (category codes, standardisation), fitted on the training
records it holds; :func:`read_modality_file` reads a site's modality file in a deployment and
:func:`read_labels_file` the label holder's file of IDs, times and events.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), §4–5 (modalities held by
separate clients, zero tensor for a missing modality).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from models.data.datasets import read_frame
from models.data.files import data_file
from models.data.partition import stratified_split
from models.data.validate import (
    DataValidationError,
    describe_rows,
    identifier_problems,
    validate_survival_frame,
)

__all__ = [
    "BUILT_IN_VERTICAL",
    "METABRIC_CATEGORICAL",
    "METABRIC_MODALITIES",
    "VERTICAL_DATASETS",
    "VERTICAL_FILES",
    "ModalityTransform",
    "VerticalAlignmentError",
    "VerticalFiles",
    "VerticalTable",
    "align_modalities",
    "fit_modality_transform",
    "load_breast_cancer_vertical",
    "load_metabric_vertical",
    "load_vertical",
    "load_vertical_files",
    "read_labels_file",
    "read_modality_file",
    "simulate_multimodal",
    "split_train_test",
]

#: ``data.name`` of a user's own vertical files (:class:`VerticalFiles`).
VERTICAL_FILES = "vertical_files"
#: The vertical data sets that need no file of the user's (the reproductions run on them).
BUILT_IN_VERTICAL = ("metabric", "breast_cancer", "synthetic_multimodal")
#: Vertical data sets by ``data.name``.
VERTICAL_DATASETS = (*BUILT_IN_VERTICAL, VERTICAL_FILES)

#: METABRIC's modalities (DeepSurv's preparation: MKI67, EGFR, PGR, ERBB2 | hormone treatment,
#: radiotherapy, chemotherapy, ER-positive, age).
METABRIC_MODALITIES: dict[str, tuple[str, ...]] = {
    "genomic": ("x0", "x1", "x2", "x3"),
    "clinical": ("x4", "x5", "x6", "x7", "x8"),
}
#: METABRIC's categorical (binary) clinical columns; age (``x8``) is continuous.
METABRIC_CATEGORICAL: dict[str, tuple[str, ...]] = {"clinical": ("x4", "x5", "x6", "x7")}


class VerticalAlignmentError(ValueError):
    """The sites' record IDs cannot be aligned with the label holder's."""


@dataclass(frozen=True)
class VerticalTable:
    """One cohort split by modality.

    Attributes
    ----------
    name : str
    ids : numpy.ndarray of str, shape (n,)
        Record IDs in label order (unique).
    time, event : numpy.ndarray, shape (n,)
        Labels, held by the server.
    modalities : dict of str to pandas.DataFrame
        Features of each modality, indexed by record ID (every ID of ``ids`` present).
    categorical : dict of str to tuple of str
        The categorical columns of each modality (absent: none); the others are continuous.
    sources : dict of str to str
        The file each modality was read from (absent: a built-in data set), for error messages.
    """

    name: str
    ids: np.ndarray
    time: np.ndarray
    event: np.ndarray
    modalities: dict[str, pd.DataFrame]
    categorical: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.ids.shape[0]
        if self.time.shape != (n,) or self.event.shape != (n,):
            raise ValueError(f"{self.name}: ids, time and event must have the same length")
        if len(set(self.ids.tolist())) != n:
            raise ValueError(f"{self.name}: record IDs must be unique")
        for modality, frame in self.modalities.items():
            if not frame.index.equals(pd.Index(self.ids)):
                raise ValueError(f"{self.name}: modality {modality!r} is not indexed by the label IDs in order")
        for modality, columns in self.categorical.items():
            if modality not in self.modalities or set(columns) - set(self.modalities[modality].columns):
                raise ValueError(f"{self.name}: categorical columns {columns} are not all in modality {modality!r}")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def subset(self, ids: Sequence[str]) -> VerticalTable:
        """The records ``ids`` (in that order), every modality and label included."""
        position = pd.Index(self.ids).get_indexer(list(ids))
        if np.any(position < 0):
            raise KeyError(f"{self.name}: {int(np.sum(position < 0))} of the requested IDs are not in the table")
        return VerticalTable(
            name=self.name, ids=self.ids[position], time=self.time[position], event=self.event[position],
            modalities={name: frame.iloc[position] for name, frame in self.modalities.items()},
            categorical=self.categorical, sources=self.sources,
        )

    def select(self, modalities: Sequence[str]) -> VerticalTable:
        """The same records with only ``modalities`` (in that order)."""
        unknown = [name for name in modalities if name not in self.modalities]
        if unknown or not modalities:
            raise ValueError(f"{self.name}: unknown modalities {unknown}; the data set has {list(self.modalities)}")
        return VerticalTable(
            name=self.name, ids=self.ids, time=self.time, event=self.event,
            modalities={name: self.modalities[name] for name in modalities},
            categorical={name: cols for name, cols in self.categorical.items() if name in modalities},
            sources={name: source for name, source in self.sources.items() if name in modalities},
        )


def align_modalities(label_ids: Sequence[str], site_ids: Mapping[str, Sequence[str]], *,
                     party: str = "site") -> np.ndarray:
    """Check the sites' record IDs against the label holder's; return which records each site has.

    Parameters
    ----------
    label_ids : sequence of str
        The server's record IDs (unique), in training order.
    site_ids : mapping of site (modality) name to sequence of str
        The IDs each site holds.
    party : str
        What the errors call a holder of ``site_ids`` (a site; a modality file in
        :func:`load_vertical_files`).

    Returns
    -------
    numpy.ndarray of bool, shape (len(label_ids), len(site_ids))
        ``present[i, k]``: site ``k`` (in mapping order) holds record ``i``. A record some site
        lacks is a missing modality for that record (zero input, masked in fusion).

    Raises
    ------
    VerticalAlignmentError
        Naming the site, the problem and up to five offending IDs: duplicate IDs at a site or
        at the label holder, IDs a site holds that the label holder does not know, a site that
        shares no record with the labels, or a record no site holds.
    """
    labels = pd.Index([str(value) for value in label_ids])
    if labels.has_duplicates:
        raise VerticalAlignmentError(f"label holder: duplicate record IDs {_examples(labels[labels.duplicated()])}")
    present = np.zeros((len(labels), len(site_ids)), dtype=bool)
    for column, (site, ids) in enumerate(site_ids.items()):
        held = pd.Index([str(value) for value in ids])
        if held.has_duplicates:
            raise VerticalAlignmentError(f"{party} {site!r}: duplicate record IDs {_examples(held[held.duplicated()])}")
        unknown = held.difference(labels)
        if len(unknown):
            raise VerticalAlignmentError(
                f"{party} {site!r}: {len(unknown)} record IDs are not in the label holder's cohort, e.g. "
                f"{_examples(unknown)} (the IDs must be the same pseudonyms at every {party})"
            )
        present[:, column] = labels.isin(held)
        if not present[:, column].any():
            raise VerticalAlignmentError(f"{party} {site!r} holds none of the label holder's {len(labels)} records")
    orphans = labels[~present.any(axis=1)]
    if len(orphans):
        raise VerticalAlignmentError(f"{len(orphans)} labelled records are held by no {party}, e.g. {_examples(orphans)}")
    return present


def _examples(values: pd.Index, limit: int = 5) -> str:
    shown = ", ".join(repr(value) for value in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _table(name: str, ids: np.ndarray, time: np.ndarray, event: np.ndarray,
           features: pd.DataFrame, modalities: Mapping[str, Sequence[str]],
           categorical: Mapping[str, Sequence[str]] | None = None) -> VerticalTable:
    features = features.set_axis(pd.Index(ids), axis=0)
    return VerticalTable(
        name=name, ids=ids, time=np.asarray(time, dtype=np.float64), event=np.asarray(event, dtype=np.int64),
        modalities={modality: features.loc[:, list(columns)] for modality, columns in modalities.items()},
        categorical={modality: tuple(columns) for modality, columns in (categorical or {}).items()},
    )


def load_metabric_vertical(data_dir: str | Path = "") -> VerticalTable:
    """METABRIC (1,904 patients) as genomic ``x0..x3`` | clinical ``x4..x8`` modalities.

    Record IDs are ``"metabric-<row>"``. Clinical ``x4..x7`` are binary (categorical), ``x8``
    (age) continuous. ``data_dir`` is the folder of ``metabric.csv`` ("" = ``$FEDSURV_DATA_DIR``,
    else the bundled copy; :func:`models.data.files.data_file`).
    """
    path = data_file("metabric", data_dir)
    frame = pd.read_csv(path)
    needed = {column for columns in METABRIC_MODALITIES.values() for column in columns} | {"duration", "event"}
    missing = sorted(needed - set(frame.columns))
    if missing:
        raise ValueError(f"{path}: missing columns {missing}")
    ids = np.array([f"metabric-{row}" for row in range(len(frame))])
    return _table("metabric", ids, frame["duration"].to_numpy(), frame["event"].to_numpy(), frame,
                  METABRIC_MODALITIES, METABRIC_CATEGORICAL)


def load_breast_cancer_vertical() -> VerticalTable:
    """scikit-survival's breast-cancer cohort (198 patients) as genes | clinical modalities.

    Genes: the 76 expression columns. Clinical: age, size (continuous), ER (1 = positive) and
    grade (categorical) as an ordinal code (1 well, 2 intermediate, 3 poorly differentiated; the data's ``"unkown"`` grade
    becomes the median code 2). Time: ``t.tdm`` (days to distant metastasis); event: ``e.tdm``.
    """
    from sksurv.datasets import load_breast_cancer

    features, labels = load_breast_cancer()
    clinical = pd.DataFrame({
        "age": features["age"].astype(float),
        "size": features["size"].astype(float),
        "er": (features["er"].astype(str) == "positive").astype(float),
        "grade": features["grade"].astype(str).map(
            {"well differentiated": 1.0, "intermediate": 2.0, "poorly differentiated": 3.0}).fillna(2.0),
    })
    genes = [column for column in features.columns if column not in ("age", "size", "er", "grade")]
    frame = pd.concat([features[genes].astype(float).reset_index(drop=True), clinical.reset_index(drop=True)], axis=1)
    ids = np.array([f"breast-{row}" for row in range(len(frame))])
    return _table("breast_cancer", ids, labels["t.tdm"], labels["e.tdm"].astype(int), frame,
                  {"genes": genes, "clinical": list(clinical.columns)}, {"clinical": ("er", "grade")})


def simulate_multimodal(
    n: int = 3000, *, features_per_modality: int = 8, signal: float = 1.0, censoring_rate: float = 0.3,
    seed: int = 0,
) -> VerticalTable:
    r"""Three modalities (``"a"``, ``"b"``, ``"c"``) whose hazard needs all three.

    Each modality ``k`` has ``features_per_modality`` standard-normal features ``x_k``; its score
    is ``s_k = signal · w_kᵀ x_k / ||w_k||`` with fixed random directions ``w_k``, so every score
    is N(0, signal²). The true model is Cox with a unit exponential baseline:

    .. math::

        h(t \mid x) = \exp(s_a + s_b + s_c),

    so every modality carries one third of the log-risk variance and any two recover only part of
    the ranking. Censoring is independent exponential with the rate that censors about
    ``censoring_rate`` of the records (set from the marginal event rate by bisection on a large
    pilot sample).

    Parameters
    ----------
    n : int
        Number of records.
    features_per_modality : int
    signal : float
        Standard deviation of each modality's score.
    censoring_rate : float
        Target share of censored records, in [0, 1).
    seed : int

    Returns
    -------
    VerticalTable
        IDs ``"sim-<row>"``.
    """
    if n < 1 or features_per_modality < 1 or signal < 0 or not 0.0 <= censoring_rate < 1.0:
        raise ValueError(f"invalid n={n}, features_per_modality={features_per_modality}, signal={signal}, "
                         f"censoring_rate={censoring_rate}")
    rng = np.random.default_rng(seed)
    directions = {k: rng.normal(size=features_per_modality) for k in "abc"}
    directions = {k: w / np.linalg.norm(w) for k, w in directions.items()}
    features = {k: rng.normal(size=(n, features_per_modality)) for k in "abc"}
    log_risk = sum(signal * features[k] @ directions[k] for k in "abc")
    event_time = rng.exponential(1.0, size=n) / np.exp(log_risk)
    rate = _censoring_rate(signal, censoring_rate, rng) if censoring_rate > 0 else 0.0
    censor_time = rng.exponential(1.0 / rate, size=n) if rate > 0 else np.full(n, np.inf)
    time = np.minimum(event_time, censor_time)
    event = (event_time <= censor_time).astype(int)
    columns = {k: [f"{k}{j}" for j in range(features_per_modality)] for k in "abc"}
    frame = pd.concat([pd.DataFrame(features[k], columns=columns[k]) for k in "abc"], axis=1)
    ids = np.array([f"sim-{row}" for row in range(n)])
    return _table("sim_multimodal", ids, time, event, frame, columns)


def _censoring_rate(signal: float, target: float, rng: np.random.Generator, pilot: int = 200_000) -> float:
    """Exponential censoring rate that censors ``target`` of the records (bisection on a pilot)."""
    log_risk = rng.normal(scale=signal * np.sqrt(3.0), size=pilot)
    event_time = rng.exponential(1.0, size=pilot) / np.exp(log_risk)
    unit = rng.exponential(1.0, size=pilot)
    low, high = 1e-6, 1e6
    for _ in range(100):
        middle = np.sqrt(low * high)
        censored = float(np.mean(unit / middle < event_time))
        if censored < target:
            low = middle
        else:
            high = middle
    return float(np.sqrt(low * high))


def load_vertical(name: str, *, data_dir: str | Path = "", seed: int = 0, n: int = 3000,
                  files: VerticalFiles | None = None) -> VerticalTable:
    """A vertical data set by name: ``metabric``, ``breast_cancer``, ``synthetic_multimodal`` or ``vertical_files``.

    ``data_dir`` is the folder of ``metabric.csv`` ("" = ``$FEDSURV_DATA_DIR``, else the bundled
    copy); ``seed`` and ``n`` apply to the generator only (its draw is part of the data set, so it
    uses ``seed`` 0 unless told otherwise); ``files`` describes the user's files of
    ``vertical_files`` (:func:`load_vertical_files`).
    """
    if name == "metabric":
        return load_metabric_vertical(data_dir)
    if name == "breast_cancer":
        return load_breast_cancer_vertical()
    if name == "synthetic_multimodal":
        return simulate_multimodal(n, seed=seed)
    if name == VERTICAL_FILES:
        if files is None:
            raise ValueError(f"{VERTICAL_FILES} needs its files: a labels file and one file per modality")
        return load_vertical_files(files)
    raise ValueError(f"unknown vertical data set {name!r}; options: {', '.join(VERTICAL_DATASETS)}")


def split_train_test(table: VerticalTable, *, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The label holder's split of the record IDs into training and test IDs, stratified by event.

    Each event class sends ``round(test_fraction · n_class)`` records to the test part
    (:func:`models.data.partition.stratified_split`); both parts keep the label order.
    """
    positions = np.arange(len(table))
    train, test = stratified_split(positions, table.event.astype(np.float64), test_fraction,
                                   np.random.default_rng(np.random.SeedSequence([seed, 17])))
    return table.ids[train], table.ids[test]


@dataclass(frozen=True)
class ModalityTransform:
    """A site's preprocessing of its modality, fitted on the training records it holds.

    Categorical columns become integer codes ``0 .. L-1`` of the levels seen in training, with
    code ``L`` for a missing or unseen value. Levels are numbers, or strings for a column that
    holds text (such a column is categorical whether or not it was named so); continuous columns are standardised with the
    training mean and standard deviation (1 if constant), and a missing value becomes 0 (the
    mean). :meth:`transform` lays the codes first, then the continuous columns: the input
    convention of :class:`models.multimodal.BayesianClinicalNet` (:class:`BayesianFC` when there
    is no categorical column).

    Attributes
    ----------
    categorical, continuous : tuple of str
    levels : tuple of tuple of float or str
        Training levels of each categorical column (strings for a text column).
    mean, scale : numpy.ndarray
        Of the continuous columns.
    """

    categorical: tuple[str, ...]
    continuous: tuple[str, ...]
    levels: tuple[tuple[float, ...] | tuple[str, ...], ...]
    mean: np.ndarray
    scale: np.ndarray

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Number of codes of each categorical column (its levels + 1 for missing/unseen)."""
        return tuple(len(levels) + 1 for levels in self.levels)

    @property
    def input_shape(self) -> tuple[tuple[int, ...], int]:
        """``(cardinalities, num_continuous)``: what :func:`models.multimodal.build_encoder` takes."""
        return self.cardinalities, len(self.continuous)

    def transform(self, frame: pd.DataFrame, *, source: str = "modality") -> np.ndarray:
        """float32 array (n, num_categorical + num_continuous) of ``frame``'s rows.

        Raises ``ValueError`` naming ``source`` and the column when a column is missing or holds
        non-numeric values.
        """
        k = len(self.categorical)
        values = _numeric(frame, self.continuous, source)
        out = np.empty((len(frame), k + len(self.continuous)), dtype=np.float32)
        for j, (column, levels) in enumerate(zip(self.categorical, self.levels, strict=True)):
            if column not in frame.columns:
                raise ValueError(f"{source}: missing columns {[column]}; columns present: {list(frame.columns)[:10]}")
            if levels and isinstance(levels[0], str):
                keys = frame[column].astype("string")
            else:
                keys = pd.Series(_numeric(frame, (column,), source)[:, 0], index=frame.index)
            codes = keys.map({level: code for code, level in enumerate(levels)})
            out[:, j] = codes.astype("float64").fillna(len(levels)).to_numpy()
        out[:, k:] = np.nan_to_num((values - self.mean) / self.scale, nan=0.0)
        return out


def _numeric(frame: pd.DataFrame, columns: Sequence[str], source: str) -> np.ndarray:
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise DataValidationError(f"{source}: missing columns {missing}; columns present: {list(frame.columns)[:10]}")
    out = np.empty((len(frame), len(columns)), dtype=np.float64)
    for j, column in enumerate(columns):
        converted = pd.to_numeric(frame[column], errors="coerce")
        bad = converted.isna() & frame[column].notna()
        if bad.any():
            rows = list(frame.index[bad.to_numpy()][:5])
            raise DataValidationError(f"{source}: column {column!r}: {int(bad.sum())} non-numeric values "
                                      f"(records {rows})")
        out[:, j] = converted.to_numpy(dtype=np.float64)
    return out


def _is_text(series: pd.Series) -> bool:
    """A column holding text: some non-empty value is not a number."""
    present = series.dropna()
    return bool(len(present)) and bool(pd.to_numeric(present, errors="coerce").isna().any())


def _levels(series: pd.Series, text: bool, source: str) -> tuple[float, ...] | tuple[str, ...]:
    """The sorted training levels of a categorical column (strings for a text column)."""
    if text:
        return tuple(sorted(str(value) for value in series.dropna().astype("string").unique()))
    values = _numeric(series.to_frame(), (series.name,), source)[:, 0]
    return tuple(float(v) for v in np.unique(values[~np.isnan(values)]))


def fit_modality_transform(
    frame: pd.DataFrame, *, categorical: Sequence[str] = (), source: str = "modality",
) -> ModalityTransform:
    """Fit :class:`ModalityTransform` on ``frame`` (the site's training records of its modality).

    Parameters
    ----------
    frame : pandas.DataFrame
        Training records (rows) of the modality's columns.
    categorical : sequence of str
        Columns to encode as categories; so is every column that holds text (a non-numeric value,
        such as ``"ductal"``); every other column is continuous.
    source : str
        Name of the file or site, for error messages.
    """
    if len(frame) == 0:
        raise ValueError(f"{source}: no training records to fit the preprocessing on")
    unknown = [column for column in categorical if column not in frame.columns]
    if unknown:
        raise ValueError(f"{source}: categorical columns {unknown} are not in the data")
    text = tuple(column for column in frame.columns if column not in categorical and _is_text(frame[column]))
    categorical = tuple(categorical) + text
    continuous = tuple(column for column in frame.columns if column not in categorical)
    levels = tuple(_levels(frame[column], column in text, source) for column in categorical)
    values = _numeric(frame, continuous, source)
    with np.errstate(all="ignore"):
        mean = np.nanmean(values, axis=0) if continuous else np.empty(0)
        scale = np.nanstd(values, axis=0) if continuous else np.empty(0)
    mean = np.nan_to_num(mean, nan=0.0)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    return ModalityTransform(categorical=categorical, continuous=continuous, levels=levels, mean=mean, scale=scale)


def _record_ids(frame: pd.DataFrame, path: Path, id_column: str) -> pd.Index:
    """The ID column of a site's or the label holder's file as strings; errors name the file and the column."""
    if id_column not in frame.columns:
        raise DataValidationError(f"{path}: no ID column {id_column!r} (data.id_col); columns present: "
                                  f"{list(frame.columns)[:10]}")
    ids = frame[id_column]
    if ids.isna().any():
        raise DataValidationError(f"{path}: column {id_column!r}: {int(ids.isna().sum())} empty IDs "
                                  f"({describe_rows(np.flatnonzero(ids.isna().to_numpy()))})")
    ids = ids.astype(str)
    if ids.duplicated().any():
        raise DataValidationError(f"{path}: column {id_column!r}: duplicate IDs "
                                  f"{_examples(pd.Index(ids[ids.duplicated()]))}")
    return pd.Index(ids, name=id_column)


def read_modality_file(path: str | Path, *, id_column: str = "id", drop_cols: Sequence[str] = ()) -> pd.DataFrame:
    """A site's modality file (CSV or Parquet): one row per record, an ID column (``data.id_col``) and feature columns.

    Returns the features (every column but the ID and ``drop_cols``) indexed by the IDs (as
    strings). Errors (:class:`~models.data.validate.DataValidationError`) name the file, the column
    and the problem: file missing, no ID column, duplicate or empty IDs, a duplicated column name, a
    ``drop_cols`` column the file lacks, a feature that looks like another record identifier
    (:func:`~models.data.validate.identifier_problems`), no feature column.
    """
    path = Path(path)
    if not path.exists():
        raise DataValidationError(f"{path}: modality file not found")
    frame = read_frame(path)
    absent = [column for column in drop_cols if column not in frame.columns]
    if absent:
        raise DataValidationError(f"{path}: data.drop_cols names {absent}, which the file does not have; "
                                  f"columns present: {', '.join(map(str, frame.columns))}")
    return _modality_features(frame, path, id_column, drop_cols)


def _modality_features(frame: pd.DataFrame, path: Path, id_column: str, drop_cols: Sequence[str]) -> pd.DataFrame:
    """The features of a modality file's ``frame`` indexed by its IDs (the checks of :func:`read_modality_file`)."""
    ids = _record_ids(frame, path, id_column)
    features = frame.drop(columns=[id_column, *drop_cols]).set_axis(ids, axis=0)
    if features.shape[1] == 0:
        raise DataValidationError(f"{path}: no feature columns besides {id_column!r}")
    problems = identifier_problems(features.reset_index(drop=True), source=str(path))
    if problems:
        raise DataValidationError("\n".join(problems))
    return features


def read_labels_file(
    path: str | Path, *, id_column: str = "id", time_col: str = "time", event_col: str = "event",
) -> VerticalTable:
    """The label holder's file in a vertical deployment (CSV or Parquet): record IDs, times, events.

    Returns a :class:`VerticalTable` without modalities (the sites hold them). The times and
    events are checked like any survival table (:func:`models.data.validate.validate_survival_frame`:
    missing columns, non-numeric, negative or missing times, events outside {0, 1}, no events),
    the IDs like a site's; every error names the file, the column and the rows.
    """
    path = Path(path)
    frame = read_frame(path)
    ids = _record_ids(frame, path, id_column)
    time, event = validate_survival_frame(frame, source=str(path), time_col=time_col, event_col=event_col,
                                          feature_cols=())
    return VerticalTable(name=path.stem, ids=ids.to_numpy(dtype=str), time=time, event=event.astype(np.int64),
                         modalities={})


@dataclass(frozen=True)
class VerticalFiles:
    """A user's own vertical data (``data.name = "vertical_files"``): what a deployment's parties hold, in one place.

    Attributes
    ----------
    labels : str
        The label holder's CSV or Parquet file: record IDs, times, events (``data.labels_path``).
    modalities : tuple of (str, str)
        ``(modality, file)`` pairs, one CSV or Parquet file per modality (``data.modality_paths``),
        each with the ID column and that modality's features; the run simulates one site per file.
    id_column, time_col, event_col : str
        The join key of every file, and the labels file's time and event columns.
    categorical : tuple of str
        Numeric columns to encode as categories, in whichever modality file holds them (a column
        holding text always is one); what a deployed site's node config ``categorical`` says.
    drop_cols : tuple of str
        Columns never used, in whichever modality file holds them.
    """

    labels: str
    modalities: tuple[tuple[str, str], ...]
    id_column: str = "id"
    time_col: str = "time"
    event_col: str = "event"
    categorical: tuple[str, ...] = ()
    drop_cols: tuple[str, ...] = ()


def load_vertical_files(files: VerticalFiles) -> VerticalTable:
    """The :class:`VerticalTable` of a user's files, read as a deployment's label holder and sites read theirs.

    The labels come from :func:`read_labels_file` and each modality from the checks of
    :func:`read_modality_file`; the files are joined on ``files.id_column``
    (:func:`align_modalities`): a record a modality file lacks is a missing modality (all
    values missing, masked in the fusion), an ID a modality file holds that the labels file lacks
    is an error. Every error is a :class:`~models.data.validate.DataValidationError` of one line
    naming the file (or key), the column and the rows or records: besides those of the readers, a
    ``categorical`` or ``drop_cols`` column that no modality file has, a ``categorical`` column
    holding text (as a site refuses it), and a modality file holding the labels' time or event
    column.
    """
    labels = read_labels_file(files.labels, id_column=files.id_column, time_col=files.time_col,
                              event_col=files.event_col)
    frames = {name: read_frame(path) for name, path in files.modalities}
    paths = dict(files.modalities)
    columns = {column for frame in frames.values() for column in frame.columns}
    for key, named in (("data.drop_cols", files.drop_cols), ("data.categorical_cols", files.categorical)):
        absent = [column for column in named if column not in columns or column == files.id_column]
        if absent:
            raise DataValidationError(f"{key} names {absent}, which no modality file has as a feature "
                                      f"({', '.join(paths.values())})")
    features = {name: _modality_features(frame, Path(paths[name]), files.id_column,
                                         [column for column in files.drop_cols if column in frame.columns])
                for name, frame in frames.items()}
    categorical = {name: tuple(column for column in files.categorical if column in frame.columns)
                   for name, frame in features.items()}
    labels_columns = (files.time_col, files.event_col)
    for name, frame in features.items():
        leaked = [column for column in labels_columns if column in frame.columns]
        if leaked:
            raise DataValidationError(f"{paths[name]}: columns {leaked} are the labels' time and event columns "
                                      "(data.time_col, data.event_col): a modality file holds features only "
                                      "(data.drop_cols leaves a column out)")
        try:  # a named categorical holding text is refused, as a site refuses it
            _numeric(frame, categorical[name], paths[name])
        except DataValidationError as err:
            raise DataValidationError(f"{err}: data.categorical_cols lists numeric codes (a column holding "
                                      "text is categorical without it)") from None
    try:
        align_modalities(labels.ids, {paths[name]: frame.index for name, frame in features.items()},
                         party="modality file")
    except VerticalAlignmentError as err:
        raise DataValidationError(f"{err} (labels: {files.labels}, data.id_col {files.id_column!r})") from None
    return VerticalTable(
        name=VERTICAL_FILES, ids=labels.ids, time=labels.time, event=labels.event,
        modalities={name: frame.reindex(pd.Index(labels.ids)) for name, frame in features.items()},
        categorical={name: columns for name, columns in categorical.items() if columns},
        sources=paths,
    )
