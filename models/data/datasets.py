"""Loading raw survival tables: FLCHAIN, METABRIC, GBSG, WHAS, SBA loans, the simulated Cox data of
Niu et al. and any CSV/Parquet file.

:func:`load_table` returns a validated :class:`RawTable` of raw (unpreprocessed) features, times,
events, candidate partition columns and, where dates exist, the period used for out-of-time
validation.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from models.data import sba
from models.data.files import data_file
from models.data.validate import DataValidationError, require_columns, validate_survival_frame

DATASETS = ("flchain", "metabric", "gbsg", "whas", "sba", "sim_cox", "csv")
BENCHMARK_CSVS = ("metabric", "gbsg", "whas")
FLCHAIN_SOURCE = "sksurv:flchain"
FLCHAIN_LEAKING = ("chapter",)
PARQUET_SUFFIXES = (".parquet", ".pq")


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
    """

    features: pd.DataFrame
    time: np.ndarray
    event: np.ndarray
    source: str
    groups: pd.DataFrame
    period: pd.Series | None = None

    def __len__(self) -> int:
        return len(self.time)

    def with_group(self, column: str) -> RawTable:
        """This table with ``column`` available as a group; a feature column stops being a feature.

        Raises
        ------
        DataValidationError
            When the column does not exist, listing the partitions available.
        """
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


def read_frame(path: str | Path) -> pd.DataFrame:
    """Read a CSV or Parquet file.

    Raises
    ------
    DataValidationError
        When the file does not exist or is empty.
    """
    path = Path(path)
    if not path.is_file():
        raise DataValidationError(f"{path}: file not found")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return pd.read_parquet(path)
    try:
        return pd.read_csv(path, low_memory=False)
    except pd.errors.EmptyDataError:
        raise DataValidationError(f"{path}: empty file (no header, no data rows)") from None


def table_from_frame(
    frame: pd.DataFrame,
    *,
    source: str,
    time_col: str,
    event_col: str,
    feature_cols: Sequence[str] = (),
    exclude: Sequence[str] = (),
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
        Feature columns; empty means every column except the outcome and ``exclude``.
    exclude
        Columns that are neither features nor groups (e.g. DeepSurv's ``split``).
    """
    frame = frame.rename(columns=str).reset_index(drop=True)
    outcome = (time_col, event_col)
    if not feature_cols:
        feature_cols = [c for c in frame.columns if c not in (*outcome, *exclude)]
    time, event = validate_survival_frame(
        frame, source=source, time_col=time_col, event_col=event_col, feature_cols=feature_cols
    )
    rest = [c for c in frame.columns if c not in (*outcome, *feature_cols, *exclude)]
    return RawTable(frame[list(feature_cols)], time, event, source, frame[rest])


@functools.cache
def _sksurv_flchain() -> pd.DataFrame:
    """FLCHAIN as shipped by scikit-survival, with ``futime`` and ``death`` columns (cached)."""
    from sksurv.datasets import load_flchain  # slow import (~3 s): only when FLCHAIN is asked for

    features, outcome = load_flchain()
    return features.assign(futime=outcome["futime"], death=outcome["death"])


def load_flchain(feature_cols: Sequence[str] = ()) -> RawTable:
    """FLCHAIN (7874 records, 27.5 % deaths) without the leaking ``chapter`` column.

    ``sex``, ``flc.grp`` and ``mgus`` stay categorical; ``sample.yr`` (a calendar year) is numeric.
    """
    frame = _sksurv_flchain().drop(columns=list(FLCHAIN_LEAKING))
    frame["sample.yr"] = frame["sample.yr"].astype(int)
    return table_from_frame(
        frame, source=FLCHAIN_SOURCE, time_col="futime", event_col="death", feature_cols=feature_cols
    )


def load_benchmark_csv(path: Path, feature_cols: Sequence[str] = ()) -> RawTable:
    """METABRIC, GBSG or WHAS as prepared for DeepSurv: ``x*`` features, ``duration``, ``event``.

    The ``split`` column (DeepSurv's own train/test split) is not used.
    """
    frame = read_frame(path)
    if not feature_cols:
        feature_cols = [c for c in map(str, frame.columns) if re.fullmatch(r"x\d+", c)]
    return table_from_frame(
        frame, source=str(path), time_col="duration", event_col="event", feature_cols=feature_cols,
        exclude=("split",),
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


def load_simulated_cox(feature_cols: Sequence[str] = ()) -> RawTable:
    """:func:`simulate_cox_frame` with its defaults, as a validated table."""
    return table_from_frame(simulate_cox_frame(), source=SIM_COX_SOURCE, time_col="time", event_col="event",
                            feature_cols=feature_cols)


def load_sba(path: Path, horizon_months: int, feature_cols: Sequence[str] = ()) -> RawTable:
    """SBA loans as time-to-default records (see :mod:`models.data.sba`); period = ``ApprovalDate``."""
    raw = read_frame(path)
    if len(raw) == 0:
        raise DataValidationError(f"{path}: empty file (no data rows)")
    require_columns(sba.RAW_COLUMNS, list(map(str, raw.columns)), source=str(path))
    records = sba.sba_records(raw, horizon_months)
    table = table_from_frame(
        records.drop(columns=[sba.PERIOD_COLUMN]), source=str(path), time_col="time", event_col="event",
        feature_cols=feature_cols or sba.FEATURE_COLUMNS,
    )  # fmt: skip
    return replace(table, period=records[sba.PERIOD_COLUMN])


def load_table(
    name: str = "flchain",
    *,
    path: str = "",
    data_dir: str = "",
    time_col: str = "",
    event_col: str = "",
    feature_cols: Sequence[str] = (),
    sba_horizon_months: int = 48,
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

    Raises
    ------
    DataValidationError
        For an unknown data set and for every data problem (see :mod:`models.data.validate`).
    """
    if name == "flchain":
        return load_flchain(feature_cols)
    if name in BENCHMARK_CSVS:
        return load_benchmark_csv(Path(path) if path else data_file(name, data_dir), feature_cols)
    if name == "sba":
        return load_sba(Path(path) if path else data_file(name, data_dir), sba_horizon_months, feature_cols)
    if name == "sim_cox":
        return load_simulated_cox(feature_cols)
    if name == "csv":
        if not path:
            raise DataValidationError("data set 'csv' needs a path to a CSV or Parquet file")
        return table_from_frame(
            read_frame(path), source=str(path), time_col=time_col or "time", event_col=event_col or "event",
            feature_cols=feature_cols,
        )  # fmt: skip
    raise DataValidationError(f"unknown data set '{name}'; options: {', '.join(DATASETS)}")
