"""Loading raw survival tables: FLCHAIN, METABRIC, GBSG, WHAS, SBA loans, the simulated Cox data of
Niu et al. and any CSV/Parquet file.

:func:`load_table` returns a validated :class:`RawTable` of raw (unpreprocessed) features, times,
events, candidate partition columns and, where dates exist, the period used for out-of-time
validation.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from models.data.files import data_file
from models.data.sba import FEATURE_COLUMNS, PERIOD_COLUMN, RAW_COLUMNS, sba_records
from models.data.validate import (
    DUPLICATE_COLUMNS,
    IDENTIFIER,
    MISSING_COLUMN,
    NOT_A_FEATURE,
    NOT_SPLIT,
    ROLE_CONFLICT,
    TOO_FEW_RECORDS,
    UNREADABLE,
    DataValidationError,
    column_problem,
    duplicate_column_problems,
    identifier_problems,
    integer_code_notes,
    require_columns,
    validate_survival_frame,
)

logger = logging.getLogger(__name__)
DATASETS = ("flchain", "metabric", "gbsg", "whas", "sba", "sim_cox", "csv")
BENCHMARK_CSVS = ("metabric", "gbsg", "whas")
FLCHAIN_SOURCE = "sksurv:flchain"
FLCHAIN_LEAKING = ("chapter",)
PARQUET_SUFFIXES = (".parquet", ".pq")
#: The outcome columns (time, event) of each named data set's raw table; ``csv`` (and a deployed site's file)
#: has ``data.time_col`` / ``data.event_col``, by default :data:`DEFAULT_OUTCOME`.
OUTCOME_COLUMNS = {"flchain": ("futime", "death"), **{name: ("duration", "event") for name in BENCHMARK_CSVS},
                   "sba": ("time", "event"), "sim_cox": ("time", "event")}
DEFAULT_OUTCOME = ("time", "event")


def outcome_columns(name: str, time_col: str = "", event_col: str = "") -> tuple[str, str]:
    """The raw table's time and event columns: a named data set's own, else ``time_col``/``event_col`` ("" = default)."""
    if name in OUTCOME_COLUMNS:
        return OUTCOME_COLUMNS[name]
    return time_col or DEFAULT_OUTCOME[0], event_col or DEFAULT_OUTCOME[1]
#: The labels of a ``data.split_col`` column (case and surrounding spaces ignored).
SPLIT_LABELS = ("train", "test")


def column_named(name: str, columns: Sequence[str]) -> str:
    """The column a key names: ``name`` itself, else the one column that equals it but for surrounding spaces
    (a header such as ``"T Stage "``, which a run config's value cannot spell); else ``name``."""
    if not name or name in columns:
        return name
    matches = [column for column in map(str, columns) if column.strip() == name.strip()]
    return matches[0] if len(matches) == 1 else name


@dataclass(frozen=True)
class ColumnRoles:
    """What the run's keys say about a table's columns: the ones that are not features, the record ID
    (``data.id_col``), columns to leave out (``data.drop_cols``) and the column of train/test labels
    (``data.split_col``); the features read as categories whatever their values (``data.categorical_cols``);
    and the values of the event column that mark an event (``data.event_values``; empty: it holds 0/1 or
    booleans)."""

    id_col: str = ""
    drop_cols: tuple[str, ...] = ()
    split_col: str = ""
    categorical: tuple[str, ...] = ()
    event_values: tuple[str, ...] = ()

    def named_in(self, columns: Sequence[str]) -> ColumnRoles:
        """These roles with each column named as ``columns`` spell it (:func:`column_named`)."""
        return replace(self, id_col=column_named(self.id_col, columns),
                       drop_cols=tuple(column_named(c, columns) for c in self.drop_cols),
                       split_col=column_named(self.split_col, columns),
                       categorical=tuple(column_named(c, columns) for c in self.categorical))

    @property
    def keys(self) -> dict[str, str]:
        """Column -> the key that named it."""
        named = {column: "data.drop_cols" for column in self.drop_cols}
        named.update({column: key for column, key in ((self.id_col, "data.id_col"), (self.split_col, "data.split_col"))
                      if column})
        return named


@dataclass(frozen=True)
class RawTable:
    """A validated survival table before preprocessing.

    Attributes
    ----------
    features
        Raw feature columns (numeric, boolean, categorical or object), one row per record.
    time
        Follow-up times, float64, non-negative.
    event
        Event indicators, float32 in {0, 1}.
    source
        File path or label (``"sksurv:flchain"``) used in messages.
    groups
        Columns that are not features but may define a natural partition (e.g. SBA ``State``,
        ``region``, ``division``; the unused columns of a CSV).
    period
        Date of each record for out-of-time validation (SBA ``ApprovalDate``), else ``None``.
    test_mask
        The records of the predefined test part (``data.split_col``), else ``None`` (a random split).
    """

    features: pd.DataFrame
    time: np.ndarray
    event: np.ndarray
    source: str
    groups: pd.DataFrame
    period: pd.Series | None = None
    test_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.time)

    def with_group(self, column: str) -> RawTable:
        """This table with ``column`` available as a group; a feature column stops being a feature.

        Raises
        ------
        DataValidationError
            When the column does not exist, listing the partitions available.
        """
        column = column_named(column, [*self.groups.columns, *self.features.columns])
        if column in self.groups.columns:
            return self
        if column not in self.features.columns:
            options = ["iid", "dirichlet", *map(str, self.groups.columns), *map(str, self.features.columns)]
            raise DataValidationError(
                f"{self.source}: unknown partition '{column}' (not a scheme or a column); "
                f"options: {', '.join(options)}"
            )
        return replace(
            self,
            features=self.features.drop(columns=[column]),
            groups=self.groups.assign(**{column: self.features[column]}),
        )


def readable_file(path: str | Path, *, key: str = "") -> Path:
    """``path``, when it names a file; ``key``: the run-config key that names it (e.g. ``data.path``), named by
    the error.

    Raises
    ------
    DataValidationError
        In one line, naming the path (and ``key``) and the fix: no such file, or a folder.
    """
    path = Path(path)
    named = f"{key} = '{path}'" if key else str(path)
    if path.is_dir():
        inside = sorted(child.name for child in path.iterdir() if child.is_file()
                        and any(child.name.lower().endswith(suffix) for suffix in (".csv", ".csv.gz", *PARQUET_SUFFIXES)))
        listed = f" ({', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''})" if inside else ""
        raise DataValidationError(f"{named} is a folder, not a file: give the CSV or Parquet file inside it{listed}",
                                  public=[(UNREADABLE, key)])
    if not path.is_file():
        raise DataValidationError(f"{named}: file not found; give the path of an existing CSV or Parquet file "
                                  "(a relative path starts from the folder the run is started in)",
                                  public=[(UNREADABLE, key)])
    return path


def read_frame(path: str | Path, *, key: str = "") -> pd.DataFrame:
    """Read a CSV or Parquet file (``key``: the run-config key that names it, for :func:`readable_file`'s errors).

    Raises
    ------
    DataValidationError
        When the path names no file (:func:`readable_file`), or the file is empty or unreadable.
    """
    path = readable_file(path, key=key)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return pd.read_parquet(path)
    try:
        header = pd.read_csv(path, header=None, nrows=1, dtype=str).iloc[0].tolist()
        duplicates = duplicate_column_problems(header, source=str(path))
        if duplicates:
            raise DataValidationError("\n".join(duplicates), public=[(DUPLICATE_COLUMNS, "")])
        return pd.read_csv(path, low_memory=False)
    except pd.errors.EmptyDataError:
        raise DataValidationError(f"{path}: empty file (no header, no data rows); give a file with a header line "
                                  "naming the columns and one row per record",
                                  public=[(TOO_FEW_RECORDS, "")]) from None
    except UnicodeDecodeError as err:
        raise DataValidationError(f"{path}: not UTF-8 text at byte {err.start} (a binary file, or another encoding: "
                                  "save it as UTF-8 CSV, optionally .gz, or as Parquet)",
                                  public=[(UNREADABLE, "")]) from None
    except (pd.errors.ParserError, OSError, EOFError) as err:  # a malformed CSV, a corrupt .gz or .zip
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataValidationError(f"{path}: not a readable CSV file ({first[:200]})",
                                  public=[(UNREADABLE, "")]) from None


def split_labels(series: pd.Series, *, source: str, column: str) -> np.ndarray:
    """The test mask of a ``data.split_col`` column of ``train``/``test`` labels.

    Raises
    ------
    DataValidationError
        For any other label or a missing one (naming the rows and the accepted labels), or a split
        without a training or a test record.
    """
    labels = series.astype(object).where(series.notna()).map(lambda value: str(value).strip().lower(),
                                                              na_action="ignore")
    bad = ~labels.isin(SPLIT_LABELS).to_numpy()
    if bad.any():
        found = ", ".join(sorted({repr(value) for value in series[bad].tolist()})[:5])
        raise DataValidationError(column_problem(source, column, f"labels other than {' or '.join(SPLIT_LABELS)} "
                                                 f"(found {found}; data.split_col accepts {', '.join(SPLIT_LABELS)})",
                                                 bad), public=[(NOT_SPLIT, "data.split_col")])
    test = (labels == "test").to_numpy()
    if test.all() or not test.any():
        raise DataValidationError(f"{source}: column '{column}' (data.split_col): every row is labelled "
                                  f"'{'test' if test.all() else 'train'}'; both train and test rows are needed",
                                  public=[(NOT_SPLIT, "data.split_col")])
    return test


def table_from_frame(
    frame: pd.DataFrame, *, source: str, time_col: str, event_col: str, feature_cols: Sequence[str] = (),
    exclude: Sequence[str] = (), roles: ColumnRoles = ColumnRoles(), identifiers: bool = False,
) -> RawTable:
    """Validate a frame and split it into features, outcome and group columns.

    Parameters
    ----------
    frame
        Raw table.
    source
        File path or label used in messages.
    time_col, event_col
        Outcome columns.
    feature_cols
        Feature columns; empty means every column except the outcome and ``exclude``. These
        names, and those of ``roles``, find a column whose header differs only by surrounding
        spaces (:func:`column_named`).
    exclude
        Columns that are neither features nor groups (e.g. DeepSurv's ``split``).
    roles
        The record ID, the columns to leave out and the train/test labels: never features nor
        groups; the labels give :attr:`RawTable.test_mask`. Its categorical columns become
        pandas categoricals of text labels (:func:`categorical_labels`) and its event values define
        the events (:func:`~models.data.validate.event_problems`).
    identifiers
        Also refuse feature columns that look like record identifiers
        (:func:`~models.data.validate.identifier_problems`; for users' files), listed with the
        other problems of the table (once the outcome columns exist).

    Raises
    ------
    DataValidationError
        For a duplicated column name, a column of ``roles`` that does not exist or is also listed
        in ``feature_cols``, bad train/test labels, every problem of
        :func:`~models.data.validate.validate_survival_frame` and, with ``identifiers``, the columns
        that look like record identifiers.
    """
    frame = frame.rename(columns=str).reset_index(drop=True)
    duplicates = duplicate_column_problems(list(frame.columns), source=source)
    if duplicates:
        raise DataValidationError("\n".join(duplicates), public=[(DUPLICATE_COLUMNS, "")])
    columns = list(frame.columns)
    time_col, event_col = column_named(time_col, columns), column_named(event_col, columns)
    feature_cols, roles = [column_named(c, columns) for c in feature_cols], roles.named_in(columns)
    outcome = (time_col, event_col)
    named = roles.keys
    _check_role_columns(named, list(frame.columns), feature_cols, outcome, source=source)
    exclude = (*exclude, *named)
    if not feature_cols:
        feature_cols = [c for c in frame.columns if c not in (*outcome, *exclude)]
    frame = _categories(frame, roles.categorical, feature_cols, source=source)
    time, event = _outcome(frame, source=source, time_col=time_col, event_col=event_col, feature_cols=feature_cols,
                           event_values=roles.event_values, identifiers=identifiers)
    test_mask = split_labels(frame[roles.split_col], source=source, column=roles.split_col) if roles.split_col else None
    rest = [c for c in frame.columns if c not in (*outcome, *feature_cols, *exclude)]
    return RawTable(frame[list(feature_cols)], time, event, source, frame[rest], test_mask=test_mask)


def _check_role_columns(named: Mapping[str, str], columns: Sequence[str], feature_cols: Sequence[str],
                        outcome: tuple[str, str], *, source: str) -> None:
    """:func:`table_from_frame`'s DataValidationError for a column of ``named`` (column -> the key naming it) that is
    not among ``columns``, or that is also a feature (``feature_cols``) or an ``outcome`` column."""
    for column, key in named.items():
        if column not in columns:
            raise DataValidationError(f"{source}: {key} names column '{column}', which the file does not have; "
                                      f"columns present: {', '.join(columns)}", public=[(MISSING_COLUMN, key)])
        if column in feature_cols or column in outcome:
            raise DataValidationError(f"{source}: column '{column}' is named by {key} and is also "
                                      f"{'an outcome column' if column in outcome else 'listed in data.feature_cols'}",
                                      public=[(ROLE_CONFLICT, key)])
def _outcome(frame: pd.DataFrame, *, source: str, time_col: str, event_col: str, feature_cols: Sequence[str],
             event_values: Sequence[str], identifiers: bool) -> tuple[np.ndarray, np.ndarray]:
    """The times and events of :func:`~models.data.validate.validate_survival_frame`; with ``identifiers`` (and
    both outcome columns present: else an outcome column is taken for a feature), the features that look like
    record identifiers are refused too, in the same error as the table's other problems."""
    checked = identifiers and time_col in frame.columns and event_col in frame.columns
    suspects = identifier_problems(frame[[c for c in feature_cols if c in frame.columns]], source=source) \
        if checked else []
    try:
        time, event = validate_survival_frame(frame, source=source, time_col=time_col, event_col=event_col,
                                              feature_cols=feature_cols, event_values=event_values)
    except DataValidationError as err:
        if not suspects:
            raise
        raise DataValidationError("\n".join([str(err), *suspects]),
                                  public=[*err.public, (IDENTIFIER, "data.id_col")]) from None
    if suspects:
        raise DataValidationError("\n".join(suspects), public=[(IDENTIFIER, "data.id_col")])
    return time, event


def _categories(frame: pd.DataFrame, columns: Sequence[str], features: Sequence[str], *, source: str) -> pd.DataFrame:
    """``frame`` with the features ``columns`` (``data.categorical_cols``) as :func:`categorical_labels`."""
    if not columns:
        return frame
    frame = frame.copy()
    for column in columns:
        if column not in features:
            where = "the file does not have" if column not in frame.columns else "is not a feature of the run"
            raise DataValidationError(f"{source}: data.categorical_cols names column '{column}', which {where}; "
                                      f"features: {', '.join(map(str, features))}", public=[(
                                          MISSING_COLUMN if column not in frame.columns else NOT_A_FEATURE,
                                          "data.categorical_cols")])
        frame[column] = categorical_labels(frame[column])
    return frame


def categorical_labels(series: pd.Series) -> pd.Series:
    """A column read as categories whatever its values: a pandas categorical of text labels (numbers, words,
    codes such as ``missing`` alike; an integer-valued number without its ``.0``: ``2.0`` -> ``"2"``), missing
    values kept missing. Every later step (validation, preprocessing, the private set-up's schema) treats a
    categorical as categories, one-hot encoded."""
    values = pd.to_numeric(series, errors="coerce")
    if pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series) \
            and bool((values.dropna() % 1 == 0).all()):
        series = values.astype("Int64")
    labels = series.astype(object).where(series.notna()).map(str, na_action="ignore")
    return pd.Series(pd.Categorical(labels), index=series.index, name=series.name)


@functools.cache
def _sksurv_flchain() -> pd.DataFrame:
    """FLCHAIN as shipped by scikit-survival, with ``futime`` and ``death`` columns (cached)."""
    from sksurv.datasets import load_flchain  # slow import (~3 s): only when FLCHAIN is asked for

    features, outcome = load_flchain()
    time_col, event_col = OUTCOME_COLUMNS["flchain"]
    return features.assign(**{time_col: outcome["futime"], event_col: outcome["death"]})


def load_flchain(feature_cols: Sequence[str] = (), roles: ColumnRoles = ColumnRoles()) -> RawTable:
    """FLCHAIN (7874 records, 27.5 % deaths) without the leaking ``chapter`` column.

    ``sex``, ``flc.grp`` and ``mgus`` stay categorical; ``sample.yr`` (a calendar year) is numeric.
    """
    frame = _sksurv_flchain().drop(columns=list(FLCHAIN_LEAKING))
    frame["sample.yr"] = frame["sample.yr"].astype(int)
    return table_from_frame(
        frame, source=FLCHAIN_SOURCE, time_col=OUTCOME_COLUMNS["flchain"][0], event_col=OUTCOME_COLUMNS["flchain"][1],
        feature_cols=feature_cols, roles=roles,
    )


def load_benchmark_csv(path: Path, feature_cols: Sequence[str] = (), roles: ColumnRoles = ColumnRoles()) -> RawTable:
    """METABRIC, GBSG or WHAS as prepared for DeepSurv: ``x*`` features, ``duration``, ``event``.

    The ``split`` column holds DeepSurv's own train/test split: used with ``data.split_col = split``,
    else not at all.
    """
    frame = read_frame(path)
    if not feature_cols:
        feature_cols = [c for c in map(str, frame.columns) if re.fullmatch(r"x\d+", c) and c not in roles.keys]
    return table_from_frame(
        frame, source=str(path), time_col=OUTCOME_COLUMNS["metabric"][0], event_col=OUTCOME_COLUMNS["metabric"][1],
        feature_cols=feature_cols, exclude=("split",), roles=roles,
    )  # fmt: skip


SIM_COX_COEFFICIENTS = (2.2, 5.5, 8.8, 0.0)
SIM_COX_RECORDS = 50_000
SIM_COX_SEED = 20250101
SIM_COX_SOURCE = "simulated:niu2025-cox"


def simulate_cox_frame(
    records: int = SIM_COX_RECORDS, *, coefficients: Sequence[float] = SIM_COX_COEFFICIENTS,
    censoring_ratio: float = 3.0 / 7.0, seed: int = SIM_COX_SEED,
) -> pd.DataFrame:
    r"""The simulated proportional-hazards data of Niu et al. (LS-ADP / ROW-DP paper, §4.1).

    Covariates :math:`X_1, X_2 \sim N(0, 1)`, :math:`X_3 \sim \mathrm{Bin}(1, 1/2)`,
    :math:`X_4 \sim U(0, 1)`; event hazard :math:`h(t \mid x) = h_0 \exp(\beta^\top x)` with
    :math:`h_0 = 1`, :math:`\beta = (2.2, 5.5, 8.8, 0)`; censoring hazard
    :math:`\tfrac{3}{7} h_0 \exp(\beta^\top x)`. Both are exponential given :math:`x`, so a
    record is censored with probability :math:`(3/7)/(1 + 3/7) = 0.3` whatever :math:`x`, and
    ``time = min(T, C)``. The paper does not give the covariates' parameters; these standard ones
    are our choice.

    Parameters
    ----------
    records
        Number of records (the paper: 50,000, split 70/30).
    coefficients
        :math:`\beta`.
    censoring_ratio
        Censoring hazard over event hazard (3/7: 30 % censored).
    seed
        Seed of the generator (fixed by default, so that ``data.name=sim_cox`` is one data set).

    References
    ----------
    Niu et al., "LS-ADP / ROW-DP", Mathematics 13(7):1096, 2025, §4.1.
    """
    rng = np.random.default_rng(seed)
    x = np.column_stack([
        rng.normal(size=records), rng.normal(size=records),
        rng.binomial(1, 0.5, size=records).astype(float), rng.uniform(size=records),
    ])
    rate = np.exp(x @ np.asarray(coefficients, dtype=float))
    event_time = rng.exponential(1.0 / rate)
    censor_time = rng.exponential(1.0 / (censoring_ratio * rate))
    return pd.DataFrame({
        "x1": x[:, 0], "x2": x[:, 1], "x3": x[:, 2], "x4": x[:, 3],
        "time": np.minimum(event_time, censor_time), "event": (event_time <= censor_time).astype(float),
    })


def load_simulated_cox(feature_cols: Sequence[str] = (), roles: ColumnRoles = ColumnRoles()) -> RawTable:
    """:func:`simulate_cox_frame` with its defaults, as a validated table."""
    return table_from_frame(simulate_cox_frame(), source=SIM_COX_SOURCE, time_col=OUTCOME_COLUMNS["sim_cox"][0],
                            event_col=OUTCOME_COLUMNS["sim_cox"][1],
                            feature_cols=feature_cols, roles=roles)


def load_sba(path: Path, horizon_months: int, feature_cols: Sequence[str] = (),
             roles: ColumnRoles = ColumnRoles()) -> RawTable:
    """SBA loans as time-to-default records (see :mod:`models.data.sba`); period = ``ApprovalDate``."""
    raw = read_frame(path)
    if len(raw) == 0:
        raise DataValidationError(f"{path}: empty file (no data rows)")
    require_columns(RAW_COLUMNS, list(map(str, raw.columns)), source=str(path))
    records = sba_records(raw, horizon_months)
    table = table_from_frame(
        records.drop(columns=[PERIOD_COLUMN]), source=str(path), time_col=OUTCOME_COLUMNS["sba"][0],
        event_col=OUTCOME_COLUMNS["sba"][1],
        feature_cols=feature_cols or [c for c in FEATURE_COLUMNS if c not in roles.keys], roles=roles,
    )  # fmt: skip
    return replace(table, period=records[PERIOD_COLUMN])


def load_table(
    name: str = "flchain", *, path: str = "", data_dir: str = "", time_col: str = "", event_col: str = "",
    feature_cols: Sequence[str] = (), sba_horizon_months: int = 48, roles: ColumnRoles = ColumnRoles(),
    notes: bool = True,
) -> RawTable:
    """Load and validate one survival table.

    Parameters
    ----------
    name
        ``"flchain"`` (scikit-survival), ``"metabric"``, ``"gbsg"``, ``"whas"``, ``"sba"``,
        ``"sim_cox"`` (:func:`simulate_cox_frame`) or ``"csv"`` (any CSV or Parquet file at ``path``).
    path
        File to read; for the named CSV data sets it overrides the data folder's file.
    data_dir
        Folder of the named data sets' files ("" = ``$FEDSURV_DATA_DIR``, else the copy bundled
        with the package; see :func:`models.data.files.data_file`).
    time_col, event_col
        Outcome columns of a ``"csv"`` table (default ``"time"`` and ``"event"``); the named data
        sets have fixed ones.
    feature_cols
        Features to use (default: all features of the data set; for ``"csv"`` every column except
        the outcome; the column of a natural partition is removed later by :meth:`RawTable.with_group`).
    sba_horizon_months
        Observation horizon of the SBA default outcome.
    roles
        The record ID, the columns to leave out, the train/test labels, the categorical columns and,
        for ``"csv"`` only, the values that mark an event (:class:`ColumnRoles`).
    notes
        Log a warning for each ``"csv"`` feature whose values look like category codes
        (:func:`~models.data.validate.integer_code_notes`); a deployed site, which reads its file for
        every message, logs them at set-up only.

    Raises
    ------
    DataValidationError
        For an unknown data set and for every data problem (see :mod:`models.data.validate`); a
        ``"csv"`` table is also refused when a feature column looks like a record identifier
        (:func:`~models.data.validate.identifier_problems`), and a named data set when ``roles``
        has event values (its outcome is fixed).
    """
    if roles.event_values and name in OUTCOME_COLUMNS:
        raise DataValidationError(f"data set '{name}' has a fixed 0/1 event column '{OUTCOME_COLUMNS[name][1]}': "
                                  "data.event_values applies to data.name = csv and a deployed site's file only")
    if name == "flchain":
        return load_flchain(feature_cols, roles)
    if name in BENCHMARK_CSVS:
        return load_benchmark_csv(Path(path) if path else data_file(name, data_dir), feature_cols, roles)
    if name == "sba":
        return load_sba(Path(path) if path else data_file(name, data_dir), sba_horizon_months, feature_cols, roles)
    if name == "sim_cox":
        return load_simulated_cox(feature_cols, roles)
    if name == "csv":
        return _load_user_file(path, time_col=time_col, event_col=event_col, feature_cols=feature_cols, roles=roles,
                               notes=notes)
    raise DataValidationError(f"unknown data set '{name}'; options: {', '.join(DATASETS)}")


def _load_user_file(path: str, *, time_col: str, event_col: str, feature_cols: Sequence[str], roles: ColumnRoles,
                    notes: bool) -> RawTable:
    """:func:`load_table` for ``"csv"``: the CSV or Parquet file at ``path`` (outcome columns default
    :data:`DEFAULT_OUTCOME`), refusing features that look like record identifiers; with ``notes``, a logged
    warning for each feature whose values look like category codes."""
    if not path:
        raise DataValidationError("data set 'csv' needs a path to a CSV or Parquet file")
    table = table_from_frame(
        read_frame(path), source=str(path), time_col=time_col or DEFAULT_OUTCOME[0],
        event_col=event_col or DEFAULT_OUTCOME[1],
        feature_cols=feature_cols, roles=roles, identifiers=True,
    )  # fmt: skip
    for note in integer_code_notes(table.features, source=table.source) if notes else ():
        logger.warning(note)
    return table
