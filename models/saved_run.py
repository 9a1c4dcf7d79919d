"""A trained horizontal run's model and the preprocessing it was trained on: :class:`SavedRun`.

A horizontal run writes, beside ``model.pt`` (the network's weights, its configuration and, for
Cox models, the federated Breslow baseline), ``preprocessing.json``
(:data:`PREPROCESSING_FILE`, :func:`preprocessing_payload`): the federation's agreed preprocessing (the raw
input columns, each numeric column's mean, standard deviation and clip range, each categorical column's
levels), the time grid and CoxTime's time scale. :func:`models.predict.load_run` reads both back into a
:class:`SavedRun`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from models.data.datasets import DEFAULT_OUTCOME, read_frame
from models.data.preprocess import Preprocessor
from models.data.validate import require_columns
from models.metrics import survival_at
from models.predictions import CurvePredictions

if TYPE_CHECKING:
    from models.survival import SurvivalModel

__all__ = ["PREPROCESSING_FILE", "SavedRun", "preprocessing_payload"]

#: The preprocessing file a horizontal run writes beside ``model.pt``.
PREPROCESSING_FILE = "preprocessing.json"
PREPROCESSING_FORMAT = 1
MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
Records = pd.DataFrame | str | Path


def preprocessing_payload(
    preprocessor: Preprocessor, *, cuts: np.ndarray, time_scale: Sequence[float], setup: str,
    id_col: str = "", outcome: Sequence[str] = DEFAULT_OUTCOME, event_values: Sequence[str] = (),
) -> dict[str, Any]:
    """What :data:`PREPROCESSING_FILE` holds (JSON values); :func:`models.predict.load_run` reads it back.

    ``setup`` says how the federation agreed the preprocessing (exact, or differentially private:
    noisy); ``id_col`` is the run's record ID column, used to label predictions; ``outcome`` the
    training table's time and event columns, where :meth:`SavedRun.score` looks for the outcomes, and
    ``event_values`` the run's ``data.event_values`` (how it reads the event column; () for 0/1 events).
    """
    return {
        "format": PREPROCESSING_FORMAT,
        "setup": setup,
        "input_columns": list(preprocessor.columns),
        "model_inputs": list(preprocessor.feature_names),
        "id_col": id_col,
        "outcome": [str(outcome[0]), str(outcome[1])],
        "event_values": [str(value) for value in event_values],
        "preprocessor": preprocessor.to_dict(),
        "cuts": [float(cut) for cut in cuts],
        "time_scale": [float(value) for value in time_scale],
    }


@dataclass(frozen=True)
class SavedRun(CurvePredictions):
    """A trained horizontal model with the preprocessing it was trained on.

    Predictions, scores, calibration and plots: :class:`models.predictions.CurvePredictions`. Every
    ``records`` argument is a frame of raw records with the training file's columns, or the path of
    a CSV or Parquet file holding them. Predictions are indexed like the records (by their
    ``id_col`` values where the run had an ID column and the records carry it).

    Attributes
    ----------
    directory
        The run's output directory.
    model
        The survival model (weights, time grid and, for Cox models, the federated baseline hazard).
    preprocessor
        The federation's agreed preprocessing of the raw input columns.
    id_col
        The run's ``data.id_col`` ("" when it had none).
    outcome
        The training table's time and event columns (where :meth:`score` finds the outcomes).
    event_values
        The run's ``data.event_values``: the event column's values that mark an event (() for 0/1 events).
    """

    directory: Path
    model: SurvivalModel
    preprocessor: Preprocessor
    id_col: str = ""
    outcome: tuple[str, str] = DEFAULT_OUTCOME
    event_values: tuple[str, ...] = ()

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The raw columns a new record needs."""
        return self.preprocessor.columns

    @property
    def times(self) -> np.ndarray:
        """The times of the predicted survival curves (the run's time grid)."""
        return self.model.cuts.copy()

    @property
    def summary(self) -> dict[str, Any]:
        """The run's ``summary.json``: its test figures, privacy ledger headline, calibration, ..."""
        return json.loads((self.directory / SUMMARY_FILE).read_text(encoding="utf-8"))

    def encode(self, records: Records) -> np.ndarray:
        """The model inputs ``x`` of raw ``records``, as in training.

        Raises
        ------
        models.data.DataValidationError
            Naming every input column the records lack.
        """
        frame = _frame(records)
        require_columns(self.input_columns, list(frame.columns), source="new records")
        return self.preprocessor.transform(_as_read(frame[list(self.input_columns)], self.preprocessor))

    def predict_survival(self, records: Records, times: Sequence[float] | None = None) -> pd.DataFrame:
        r"""Survival curves :math:`\hat S(t \mid x)`: one row per record, one column per time.

        ``times`` default to :attr:`times` (the run's grid); other times read the step curves
        (right-continuous, 1 before the first grid time: :func:`models.metrics.survival_at`).
        """
        frame = _frame(records)
        grid, surv = self.model.predict_survival(self.encode(frame))
        if times is not None:
            grid = np.asarray(times, dtype=np.float64)
            surv = survival_at(self.model.cuts, surv, grid)
        return pd.DataFrame(surv, index=self._index(frame), columns=pd.Index(grid, name="time"))

    def risk_score(self, records: Records) -> pd.Series:
        """The model's risk score of each record (higher: earlier event), as used for the C-index."""
        frame = _frame(records)
        return pd.Series(self.model.risk_score(self.encode(frame)), index=self._index(frame), name="risk")

    def _labelled(self, records: Records) -> pd.DataFrame:
        return _frame(records)

    def _index(self, frame: pd.DataFrame) -> pd.Index:
        if self.id_col and self.id_col in frame.columns:
            return pd.Index(frame[self.id_col], name=self.id_col)
        return frame.index


def _frame(records: Records) -> pd.DataFrame:
    """Raw records as a frame with string column names (a path is read as CSV or Parquet)."""
    frame = read_frame(records) if isinstance(records, (str, Path)) else records
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"records must be a pandas DataFrame or a CSV/Parquet path, got {type(records).__name__}")
    return frame.rename(columns=str)


def _as_read(frame: pd.DataFrame, preprocessor: Preprocessor) -> pd.DataFrame:
    """Categorical columns as a CSV reader gives them: a whole-number float column (integers with a
    missing value) becomes integers, so that level ``1`` is ``"1"`` as in training, not ``"1.0"``."""
    columns = {}
    for column in frame.columns:
        series = frame[column]
        if column in preprocessor.categories and pd.api.types.is_float_dtype(series):
            values = series.dropna()
            if bool(np.all(np.mod(values, 1) == 0)):
                columns[column] = series.astype("Int64")
    return frame.assign(**columns) if columns else frame
