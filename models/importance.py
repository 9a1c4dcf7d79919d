"""Which features a trained run's model relies on: permutation importance on labelled records.

:func:`permutation_importance` shuffles one feature column of the records at a time (the column's values
among the records; every other column and the outcomes stay) and reads how much Harrell's C drops and the
integrated Brier score rises against the unshuffled records (Breiman 2001; Fisher, Rudin & Dominici 2019,
"model reliance"). It is computed wherever the labelled records are, from the trained model alone: post-
processing of the released model, sending nothing and spending no privacy budget; the records' own
figures are as private as the records.

>>> run.permutation_importance(test, n_repeats=5, seed=0)   # one row per feature column, most important first
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from models.data.datasets import read_frame
from models.data.validate import checked_outcomes
from models.metrics import evaluate_survival

__all__ = ["permutation_importance"]


def permutation_importance(
    run: Any, records: pd.DataFrame | str | Path, *, n_repeats: int = 5, seed: int = 0,
    columns: Sequence[str] | None = None,
) -> pd.DataFrame:
    """The drop in Harrell's C and the rise in the IBS when each feature column of ``records`` is shuffled.

    Each column is shuffled ``n_repeats`` times (permutations from ``numpy.random.default_rng(seed)``, drawn
    column after column in the table's order) and the model scored on the shuffled records as
    :meth:`~models.predictions.CurvePredictions.score` scores (:func:`models.metrics.evaluate_survival`, IPCW
    from the records themselves). Near 0: the model's predictions do not use the column (or another column
    carries the same information); negative values within the spread are noise.

    Parameters
    ----------
    run
        A trained run (:class:`models.saved_run.SavedRun`, :class:`models.split_run.SplitRun`).
    records
        One frame (or CSV/Parquet path) of raw records with the run's input columns and the outcome
        columns ``run.outcome``.
    n_repeats, seed
        Shuffles per column, and the seed of the permutations.
    columns
        The columns to shuffle; default every input column of the run.

    Returns
    -------
    pandas.DataFrame
        One row per column (index ``feature``): ``c_index_drop_mean``, ``c_index_drop_std``, ``ibs_rise_mean``,
        ``ibs_rise_std`` (mean and population standard deviation over the repeats), sorted by
        ``c_index_drop_mean``, largest first. ``attrs["baseline"]``: the unshuffled ``c_index`` and ``ibs``.

    Raises
    ------
    ValueError
        For ``n_repeats < 1``, or a column that is not an input column of the run.
    models.data.DataValidationError
        For records without usable outcomes (:func:`models.data.validate.checked_outcomes`).
    """
    if int(n_repeats) < 1:
        raise ValueError(f"n_repeats must be at least 1, got {n_repeats!r}")
    frame = _records_frame(records)
    inputs = _input_columns(run)
    columns = list(inputs if columns is None else columns)
    unknown = [column for column in columns if column not in inputs]
    if unknown:
        raise ValueError(f"columns {unknown} are not input columns of the run (its inputs: {list(inputs)})")
    time, event = checked_outcomes(run._labelled(frame), run.outcome, run.event_values)
    base = _scores(run, frame, time, event)
    rng = np.random.default_rng(seed)
    drops = np.empty((len(columns), int(n_repeats), 2))
    for i, column in enumerate(columns):
        values = frame[column].to_numpy()
        for r in range(int(n_repeats)):
            shuffled = frame.assign(**{column: values[rng.permutation(len(frame))]})
            drops[i, r] = base - _scores(run, shuffled, time, event)
    return _importance_table(drops, columns, base)


def _records_frame(records: pd.DataFrame | str | Path) -> pd.DataFrame:
    """:func:`permutation_importance`'s records as one frame with text column names (a path read with
    :func:`~models.data.datasets.read_frame`); a TypeError for anything else."""
    frame = read_frame(records) if isinstance(records, (str, Path)) else records
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"records must be one DataFrame (or a CSV/Parquet path) holding every input column and the "
                        f"outcome, got {type(records).__name__}")
    return frame.rename(columns=str)


def _importance_table(drops: np.ndarray, columns: list[str], base: np.ndarray) -> pd.DataFrame:
    """:func:`permutation_importance`'s table from ``drops`` (column, repeat, (C drop, IBS drop)) and the unshuffled
    scores ``base`` (C, IBS)."""
    table = pd.DataFrame({
        "c_index_drop_mean": drops[:, :, 0].mean(axis=1), "c_index_drop_std": drops[:, :, 0].std(axis=1),
        "ibs_rise_mean": -drops[:, :, 1].mean(axis=1), "ibs_rise_std": drops[:, :, 1].std(axis=1),
    }, index=pd.Index(columns, name="feature"))
    table = table.sort_values("c_index_drop_mean", ascending=False, kind="stable")
    table.attrs["baseline"] = {"c_index": float(base[0]), "ibs": float(base[1])}
    return table


def _input_columns(run: Any) -> list[str]:
    """The run's raw input columns (a split run's: every modality's, in the modalities' order)."""
    inputs = run.input_columns
    if isinstance(inputs, dict):
        return list(dict.fromkeys(column for columns in inputs.values() for column in columns))
    return list(inputs)


def _scores(run: Any, frame: pd.DataFrame, time: np.ndarray, event: np.ndarray) -> np.ndarray:
    """Harrell's C and the IBS of the run's predictions on ``frame``, as its ``score`` computes them."""
    curves = run.predict_survival(frame).to_numpy()
    figures = evaluate_survival(run.times, curves, time=time, event=event, risk=run._score_risk(frame),
                                concordance_td=False)
    return np.array([figures["c_index"], figures["ibs"]])
