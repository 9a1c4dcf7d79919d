"""Public data dictionary: what a federation knows about its columns without looking at any record.

A data dictionary is written from public knowledge (a study protocol, a codebook, clinical
reference ranges), never from the training data. Whatever it supplies costs no privacy: a numeric
column with a range is clipped to it and scaled from it, a categorical column with levels is
one-hot encoded over them, and an explicit time grid is the grid. The set-up statistics it does
not supply are computed with differential privacy
(:mod:`strategies.mechanisms.setup_statistics`).

File format (JSON, or YAML with the same keys; every section optional)::

    {
      "numeric":     {"age": [50, 110], "creatinine": [0, 15]},
      "categorical": {"sex": ["F", "M"], "flc.grp": ["1", "2", "3"]},
      "time":        {"grid": [0, 365, 730, 1095, 1460]}
    }

``numeric``
    Column -> ``[lo, hi]``, finite, ``lo < hi``, in the column's own units. Values outside are
    clipped to the range; the column is encoded as :math:`(x - m) / h` with
    :math:`m = (lo + hi) / 2`, :math:`h = (hi - lo) / 2` (so the range maps onto ``[-1, 1]``);
    missing values become 0 (the midpoint).
``categorical``
    Column -> its levels, a non-empty list without repeats, compared with the data's values
    written as text (``1`` matches the value 1, ``true`` the boolean True as ``"True"``). A
    value not listed is encoded as all zeros, like an unseen category.
``time``
    At most one of ``"grid"``: the cut points of the discrete time grid (finite, strictly
    increasing, starting at 0, at least two) in the data's time unit, or ``"max"``: the largest
    follow-up time the study can have (> 0), giving the public time range ``[0, max]``: the
    equidistant grid over it, the range of the time histogram, and CoxTime's time scale.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.data.validate import DataValidationError

SECTIONS = ("numeric", "categorical", "time")
TIME_KEYS = ("grid", "max")


class DataDictionaryError(DataValidationError):
    """A data dictionary entry cannot be used; the message names the file, the column and the problem."""


def _number(value: Any) -> float | None:
    """``value`` as a finite float, else ``None`` (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class DataDictionary:
    """Public ranges, levels and time grid of a federation's columns (see the module docs).

    Attributes
    ----------
    numeric
        Column -> ``(lo, hi)`` clip range.
    categorical
        Column -> levels (text).
    time_grid
        Explicit cut points, or ``None``.
    time_max
        Public largest follow-up time, or ``None``; when ``time_grid`` is given, its last cut.
    source
        Where the dictionary came from (a file path), named in error messages.
    """

    numeric: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    categorical: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    time_grid: tuple[float, ...] | None = None
    time_max: float | None = None
    source: str = "data dictionary"

    @classmethod
    def load(cls, path: str | Path) -> DataDictionary:
        """Read a ``.json``, ``.yaml`` or ``.yml`` file.

        Raises
        ------
        DataDictionaryError
            One line naming the file and, for a bad entry, the column and the problem.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise DataDictionaryError(f"{path}: cannot read the data dictionary: {err.strerror}") from None
        suffix = path.suffix.lower()
        if suffix == ".json":
            try:
                payload = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataDictionaryError(f"{path}: not valid JSON: {err}") from None
        elif suffix in (".yaml", ".yml"):
            import yaml  # PyYAML comes with hydra-core

            try:
                payload = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise DataDictionaryError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
        else:
            raise DataDictionaryError(f"{path}: a data dictionary must be a .json, .yaml or .yml file")
        return cls.from_mapping(payload, source=str(path))

    @classmethod
    def from_mapping(cls, payload: Any, *, source: str = "data dictionary") -> DataDictionary:
        """Validate the parsed content of a dictionary file (the module docs give the format)."""
        if payload is None:
            payload = {}
        if not isinstance(payload, Mapping):
            raise DataDictionaryError(f"{source}: a data dictionary must be a mapping with keys {', '.join(SECTIONS)}")
        unknown = sorted(set(map(str, payload)) - set(SECTIONS))
        if unknown:
            raise DataDictionaryError(f"{source}: unknown section(s) {', '.join(unknown)}; "
                                      f"sections are {', '.join(SECTIONS)}")
        numeric = {
            str(column): cls._range(entry, source, str(column))
            for column, entry in cls._section(payload, "numeric", source).items()
        }
        categorical = {
            str(column): cls._levels(entry, source, str(column))
            for column, entry in cls._section(payload, "categorical", source).items()
        }
        both = sorted(set(numeric) & set(categorical))
        if both:
            raise DataDictionaryError(f"{source}: column '{both[0]}' is listed as both numeric and categorical")
        time = cls._section(payload, "time", source)
        unknown = sorted(set(map(str, time)) - set(TIME_KEYS))
        if unknown or len(time) > 1:
            raise DataDictionaryError(f"{source}: time: give one of 'grid' or 'max', got {', '.join(map(str, time))}")
        grid = cls._grid(time["grid"], source) if "grid" in time else None
        if "max" in time:
            time_max = _number(time["max"])
            if time_max is None or time_max <= 0:
                raise DataDictionaryError(f"{source}: time: 'max' must be a finite number > 0, got {time['max']!r}")
        else:
            time_max = grid[-1] if grid is not None else None
        return cls(numeric, categorical, grid, time_max, source)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_mapping` inverts it."""
        payload: dict[str, Any] = {"numeric": {c: list(r) for c, r in self.numeric.items()},
                                   "categorical": {c: list(k) for c, k in self.categorical.items()}}
        if self.time_grid is not None:
            payload["time"] = {"grid": list(self.time_grid)}
        elif self.time_max is not None:
            payload["time"] = {"max": self.time_max}
        return payload

    @staticmethod
    def _section(payload: Mapping[str, Any], name: str, source: str) -> Mapping[str, Any]:
        section = payload.get(name) or {}
        if not isinstance(section, Mapping):
            raise DataDictionaryError(f"{source}: '{name}' must be a mapping of column to entry")
        return section

    @staticmethod
    def _range(entry: Any, source: str, column: str) -> tuple[float, float]:
        values = [_number(v) for v in entry] if isinstance(entry, (list, tuple)) else []
        if len(values) != 2 or None in values or not values[0] < values[1]:
            raise DataDictionaryError(f"{source}: numeric column '{column}': range must be [lo, hi] with finite "
                                      f"numbers lo < hi, got {entry!r}")
        return float(values[0]), float(values[1])

    @staticmethod
    def _levels(entry: Any, source: str, column: str) -> tuple[str, ...]:
        if not isinstance(entry, (list, tuple)) or not entry or any(isinstance(v, (list, dict)) or v is None
                                                                     for v in entry):
            raise DataDictionaryError(f"{source}: categorical column '{column}': levels must be a non-empty list "
                                      f"of values, got {entry!r}")
        levels = tuple(str(v) for v in entry)
        repeated = sorted({level for level in levels if levels.count(level) > 1})
        if repeated:
            raise DataDictionaryError(f"{source}: categorical column '{column}': level '{repeated[0]}' is listed "
                                      "more than once")
        return levels

    @staticmethod
    def _grid(entry: Any, source: str) -> tuple[float, ...]:
        values = [_number(v) for v in entry] if isinstance(entry, (list, tuple)) else [None]
        if (len(values) < 2 or None in values or values[0] != 0.0
                or any(b <= a for a, b in zip(values, values[1:]))):
            raise DataDictionaryError(f"{source}: time: 'grid' must be at least two finite, strictly increasing "
                                      f"cut points starting at 0, got {entry!r}")
        return tuple(float(v) for v in values)

    def check_columns(self, numeric: set[str] | frozenset[str], categorical: set[str] | frozenset[str]) -> None:
        """Raise unless every listed column exists in the data with the same kind.

        Parameters
        ----------
        numeric, categorical
            The data's numeric (standardised) and categorical (one-hot) feature columns.

        Raises
        ------
        DataDictionaryError
            Naming the dictionary, the column and the problem.
        """
        for listed, kind, same, other in ((self.numeric, "numeric", numeric, categorical),
                                          (self.categorical, "categorical", categorical, numeric)):
            for column in listed:
                if column in other:
                    other_kind = "categorical" if kind == "numeric" else "numeric"
                    raise DataDictionaryError(f"{self.source}: column '{column}' is listed as {kind} but is "
                                              f"{other_kind} in the data")
                if column not in same:
                    raise DataDictionaryError(f"{self.source}: {kind} column '{column}' is not a feature column "
                                              "of the data")
