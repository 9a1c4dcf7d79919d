"""Feature preprocessing fitted from additive statistics.

Numeric columns are mean-imputed and standardised; categorical, boolean and object columns are
one-hot encoded over the categories seen in training (unseen or missing values -> all zeros).
A numeric column may also have a clip range ``[lo, hi]`` (public, from a data dictionary, or
differentially private, :mod:`strategies.mechanisms.setup_statistics`): its values are clipped
to the range before they are standardised. The exact fit below clips nothing.

The fit needs only per-column counts, sums and sums of squares (numeric) and per-category counts
(categorical). These statistics are *additive*: the statistics of a union of tables are the sum of
the tables' statistics. Fitting on the pooled training parts of all sites therefore gives the same
means, standard deviations and category sets (up to floating-point summation order) as a
federation that sums per-site statistics, e.g. with secure aggregation, without any site sharing
records: the pooled fit stands for that secure federated aggregate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from models.data.validate import require_columns

# A variance this small relative to the mean square is rounding noise of a constant column.
RELATIVE_VARIANCE_FLOOR = 1e-12


def is_numeric_feature(series: pd.Series) -> bool:
    """True for numeric columns that are standardised; booleans and categoricals are one-hot."""
    return (
        pd.api.types.is_numeric_dtype(series)
        and not pd.api.types.is_bool_dtype(series)
        and not isinstance(series.dtype, pd.CategoricalDtype)
    )


def category_keys(series: pd.Series) -> pd.Series:
    """Category labels as strings, missing values kept missing; an integer-valued float reads as the integer
    (``2.0`` -> ``"2"``, as :func:`models.data.datasets.categorical_labels` labels a code column with missing
    values, which pandas reads as floats)."""
    return series.astype(object).where(series.notna()).map(_label, na_action="ignore")


def _label(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class NumericStatistics:
    """Additive statistics of one numeric column over its non-missing values."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def __add__(self, other: NumericStatistics) -> NumericStatistics:
        return NumericStatistics(
            self.count + other.count, self.total + other.total, self.total_sq + other.total_sq
        )

    @property
    def mean(self) -> float:
        """Mean of the observed values (0 when there are none)."""
        return self.total / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation; 1 for constant or empty columns."""
        if not self.count:
            return 1.0
        mean_sq = self.total_sq / self.count
        variance = mean_sq - self.mean**2
        return float(np.sqrt(variance)) if variance > RELATIVE_VARIANCE_FLOOR * mean_sq else 1.0


@dataclass(frozen=True)
class FeatureStatistics:
    """Additive statistics of a feature table: sum them across sites, then build a Preprocessor.

    Attributes
    ----------
    numeric
        Column -> count, sum and sum of squares of its non-missing values.
    categorical
        Column -> category label -> number of records.
    order
        Column order of the table.
    """

    numeric: Mapping[str, NumericStatistics] = field(default_factory=dict)
    categorical: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    order: tuple[str, ...] = ()

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> FeatureStatistics:
        """Compute the statistics of one table of raw features."""
        numeric, categorical = {}, {}
        for column in frame.columns:
            series = frame[column]
            if is_numeric_feature(series):
                values = series.to_numpy(dtype="float64", na_value=np.nan)
                values = values[~np.isnan(values)]
                numeric[str(column)] = NumericStatistics(
                    values.size, float(values.sum()), float(np.square(values).sum())
                )
            else:
                categorical[str(column)] = dict(Counter(category_keys(series).dropna()))
        return cls(numeric, categorical, tuple(map(str, frame.columns)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what a deployed site sends the server); :meth:`from_dict` inverts it."""
        return {
            "numeric": {c: [s.count, s.total, s.total_sq] for c, s in self.numeric.items()},
            "categorical": {c: dict(counts) for c, counts in self.categorical.items()},
            "order": list(self.order),
        }

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> FeatureStatistics:
        """Statistics from :meth:`to_dict`'s form."""
        return cls(
            {str(c): NumericStatistics(int(n), float(t), float(q)) for c, (n, t, q) in payload["numeric"].items()},
            {str(c): {str(k): int(v) for k, v in counts.items()} for c, counts in payload["categorical"].items()},
            tuple(map(str, payload["order"])),
        )

    def __add__(self, other: FeatureStatistics) -> FeatureStatistics:
        if self.order != other.order or set(self.numeric) != set(other.numeric):
            raise ValueError("cannot add statistics of tables with different columns")
        numeric = {c: s + other.numeric[c] for c, s in self.numeric.items()}
        categorical = {
            c: dict(Counter(counts) + Counter(other.categorical[c])) for c, counts in self.categorical.items()
        }
        return FeatureStatistics(numeric, categorical, self.order)


@dataclass(frozen=True)
class Preprocessor:
    r"""Mean imputation + standardisation of numeric columns, one-hot encoding of the others.

    Build it with :meth:`fit` on the training records only (or :meth:`from_statistics` on summed
    per-site statistics: the result is identical), then :meth:`transform` any split.

    A numeric column ``c`` is encoded as :math:`(\min(\max(x, lo_c), hi_c) - \mu_c) / s_c` where
    ``ranges`` holds ``(lo_c, hi_c)`` and as :math:`(x - \mu_c) / s_c` where it does not; a
    missing value becomes 0 (the mean).
    """

    columns: tuple[str, ...]
    means: Mapping[str, float]
    stds: Mapping[str, float]
    categories: Mapping[str, tuple[str, ...]]
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for column, (lo, hi) in self.ranges.items():
            if column not in self.means or not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
                raise ValueError(f"clip range of column '{column}' must be finite [lo, hi] with lo < hi of a "
                                 f"numeric column, got [{lo}, {hi}]")

    @classmethod
    def from_statistics(cls, stats: FeatureStatistics) -> Preprocessor:
        """Preprocessor defined by (possibly summed) feature statistics."""
        return cls(
            columns=stats.order,
            means={c: s.mean for c, s in stats.numeric.items()},
            stds={c: s.std for c, s in stats.numeric.items()},
            categories={
                c: tuple(sorted(k for k, n in counts.items() if n > 0)) for c, counts in stats.categorical.items()
            },
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what a deployment's server sends the sites); :meth:`from_dict` inverts it."""
        return {"columns": list(self.columns), "means": dict(self.means), "stds": dict(self.stds),
                "categories": {c: list(k) for c, k in self.categories.items()},
                "ranges": {c: list(r) for c, r in self.ranges.items()}}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> Preprocessor:
        """Preprocessor from :meth:`to_dict`'s form."""
        return cls(
            columns=tuple(map(str, payload["columns"])),
            means={str(c): float(v) for c, v in payload["means"].items()},
            stds={str(c): float(v) for c, v in payload["stds"].items()},
            categories={str(c): tuple(map(str, k)) for c, k in payload["categories"].items()},
            ranges={str(c): (float(lo), float(hi)) for c, (lo, hi) in payload["ranges"].items()},
        )

    @classmethod
    def fit(cls, frame: pd.DataFrame) -> Preprocessor:
        """Fit on a table of raw training features.

        Equivalent to ``from_statistics`` of the sum of per-site statistics (see module docs).
        """
        return cls.from_statistics(FeatureStatistics.from_frame(frame))

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Output column names: ``col`` for numeric, ``col=category`` for one-hot columns."""
        return tuple(
            name
            for column in self.columns
            for name in (
                [column] if column in self.means else [f"{column}={k}" for k in self.categories[column]]
            )
        )

    def transform(self, frame: pd.DataFrame) -> np.ndarray:
        """Encode a table of raw features with the fitted statistics.

        Returns
        -------
        numpy.ndarray
            float32 array of shape ``(len(frame), len(feature_names))``, without NaN.
        """
        require_columns(self.columns, list(map(str, frame.columns)), source="preprocessing input")
        blocks = [
            self._numeric(frame[c], c) if c in self.means else self._one_hot(frame[c], c) for c in self.columns
        ]
        if not blocks:
            return np.zeros((len(frame), 0), dtype="float32")
        return np.concatenate(blocks, axis=1).astype("float32")

    def _numeric(self, series: pd.Series, column: str) -> np.ndarray:
        values = pd.to_numeric(series, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
        if column in self.ranges:
            values = np.clip(values, *self.ranges[column])
        standardised = (values - self.means[column]) / self.stds[column]
        return np.nan_to_num(standardised, nan=0.0)[:, None]

    def _one_hot(self, series: pd.Series, column: str) -> np.ndarray:
        categories = self.categories[column]
        codes = pd.Categorical(category_keys(series), categories=categories).codes
        encoded = np.zeros((len(series), len(categories)), dtype="float32")
        known = codes >= 0
        encoded[np.flatnonzero(known), codes[known]] = 1.0
        return encoded
