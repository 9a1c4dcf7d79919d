"""Train a simulated federation from Python: :func:`fit` (no Hydra, no command line).

>>> import fedsurv
>>> run = fedsurv.fit(frame, time_col="time", event_col="event", sites=5)   # FedAvg over 5 simulated sites
>>> run.score(held_out)                                                      # C, time-dependent C, IBS

:func:`fit` runs the same ServerApp and ClientApp as ``python -m simulations.run`` (Flower's
simulation engine, :func:`simulations.engine.run_simulation`) and returns the trained run
(:class:`models.predict.SavedRun`). Keyword arguments name the common settings; ``config`` takes any
other run-config key (``docs/configuration.md``).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from flwr_app.config import ConfigError
from models.data.validate import DUPLICATE_COLUMNS, DataValidationError, duplicate_column_problems
from models.predict import SavedRun, load_run

__all__ = ["DATA_FILE", "FRAME_SOURCE", "fit"]

#: The copy of a DataFrame given to :func:`fit`, written in the run's directory (the sites read it): Parquet, so
#: that the frame's dtypes (category, string, boolean, nullable integers) reach the sites as they are.
DATA_FILE = "input.parquet"
#: How an error about a DataFrame given to :func:`fit` names it (instead of :data:`DATA_FILE`'s path).
FRAME_SOURCE = "the DataFrame given to fedsurv.fit"
#: The run-config keys :func:`fit` takes as keyword arguments: its errors about a frame name the argument.
ARGUMENT_KEYS = {"data.time_col": "time_col", "data.event_col": "event_col", "data.event_values": "event_values",
                 "data.id_col": "id_col", "data.categorical_cols": "categorical_cols", "data.drop_cols": "drop_cols"}


def fit(
    data: pd.DataFrame | str | Path,
    *,
    time_col: str = "time",
    event_col: str = "event",
    event_values: Sequence[str] = (),
    id_col: str = "",
    categorical_cols: Sequence[str] = (),
    drop_cols: Sequence[str] = (),
    site_col: str = "",
    sites: int = 5,
    strategy: str = "fedavg",
    epsilon: float | None = None,
    model: str = "auto",
    rounds: int | None = None,
    seed: int = 0,
    output_dir: str | Path | None = None,
    config: Mapping[str, Any] | None = None,
) -> SavedRun:
    """Train a survival model over a simulated federation of ``data``'s records and return it.

    Parameters
    ----------
    data
        The records (a frame, or a CSV/Parquet path): one row per record, outcome columns
        ``time_col`` and ``event_col``, every other column a feature. A frame is written, dtypes
        kept, to ``<output_dir>/input.parquet`` (:data:`DATA_FILE`), which the simulated sites read
        (an object column mixing numbers and text as text); a column of category dtype is
        categorical. Its errors name it as :data:`FRAME_SOURCE`, its columns and rows (row 1: its
        first row), and the keyword arguments below for their keys.
    time_col, event_col, event_values, id_col, categorical_cols, drop_cols
        ``data.time_col``, ``data.event_col`` (0/1 or booleans, or any values with ``event_values``),
        ``data.event_values`` (the values of ``event_col`` that mark an event, e.g. ``["Dead"]``;
        every other value is censored), ``data.id_col`` (a record-identifier column, never a feature),
        ``data.categorical_cols`` (columns read as categories whatever they hold: codes, numbers mixed
        with words; text columns are categorical anyway) and ``data.drop_cols``.
    site_col
        A column naming each record's site (a natural partition: one site per value,
        ``federation.partition``); "" splits the records at random over ``sites`` sites.
    sites
        ``federation.num_sites`` of a random split.
    strategy, epsilon
        ``strategy.name`` (``fedavg``, ``dp_sgd``, ``distributed_dp``, ...) and its target
        ``privacy.epsilon`` (None: no differential privacy).
    model, rounds, seed
        ``model.name``, ``federation.rounds`` (None: the strategy's default) and ``seed``. ``model="coxph"``
        fits a Cox regression by Newton-Raphson on the sites' sums (strategy ``fedavg``, no ``rounds``;
        ``docs/howto/cox-regression.md``) and returns a :class:`models.cox_run.CoxRun` (``hazard_ratios``,
        ``summary_table()``, ``print_summary()``, ``proportional_hazard_test()``, ``plot_coefficients()``).
    output_dir
        The run's directory (must not hold another run); default ``outputs/api/<time>-<strategy>``.
    config
        Any other run-config key, e.g. ``{"train.lr": 0.003, "federation.server_optimizer": "fedadam"}``.

    Returns
    -------
    SavedRun
        The trained model (``predict_survival``, ``score``, ``plot_calibration``, ...) and its
        ``summary`` (test figures, privacy ledger headline).

    Raises
    ------
    flwr_app.config.ConfigError
        For a bad or unknown key, or a key given both as an argument and in ``config``.
    models.data.DataValidationError
        For bad data (naming the file, or :data:`FRAME_SOURCE`, the column and the rows).
    """
    directory = Path(output_dir) if output_dir is not None else _default_directory(strategy)
    overrides = {
        "data.name": "csv", "data.time_col": time_col, "data.event_col": event_col,
        "data.event_values": event_values if isinstance(event_values, str) else ",".join(map(str, event_values)),
        "data.id_col": id_col,
        "data.categorical_cols": ",".join(categorical_cols), "data.drop_cols": ",".join(drop_cols),
        "federation.partition": site_col or "iid", "federation.num_sites": sites, "strategy.name": strategy,
        "privacy.epsilon": float("inf") if epsilon is None else float(epsilon), "model.name": model,
        "federation.rounds": "auto" if rounds is None else rounds, "seed": seed, "output.dir": str(directory),
    }
    both = sorted(set(overrides) & set(config or {}))
    if both:
        raise ConfigError(f"fit: {', '.join(both)} given both as an argument and in config; give it once")
    overrides.update(config or {})
    from simulations.engine import resolve, run_simulation  # Flower and Ray: imported when a run starts

    path = directory.resolve() / DATA_FILE if isinstance(data, pd.DataFrame) else Path(data).resolve()
    overrides["data.path"] = str(path)
    resolve(overrides)  # a bad key or value is refused before anything is written
    if not isinstance(data, pd.DataFrame):
        run_simulation(overrides)
        return load_run(directory)
    _write_frame(data, path)
    try:
        run_simulation(overrides)
    except DataValidationError as err:
        raise DataValidationError(_frame_message(str(err), path), public=err.public) from None
    return load_run(directory)


def _frame_message(message: str, path: Path) -> str:
    """An error about the copy at ``path`` of the frame given to :func:`fit`, naming the frame and the arguments."""
    message = message.replace(str(path), FRAME_SOURCE)
    for key, argument in ARGUMENT_KEYS.items():
        message = message.replace(key, argument)
    return message


def _default_directory(strategy: str) -> Path:
    return Path("outputs") / "api" / f"{datetime.datetime.now():%Y%m%d-%H%M%S-%f}-{strategy}"


def _write_frame(frame: pd.DataFrame, path: Path) -> None:
    """Write ``frame`` as the run's Parquet input, dtypes kept, in a directory that holds no other run.

    An object column that mixes numbers and text (which Parquet cannot store) is written as text, as a
    CSV file would hold it. Raises :class:`DataValidationError` for duplicate column names.
    """
    from flwr_app.outputs import RUN_FILES

    held = sorted(name for name in (*RUN_FILES, DATA_FILE) if (path.parent / name).exists())
    if held:
        raise ConfigError(f"output.dir = '{path.parent}' already holds {', '.join(held)}: give fit a new output_dir")
    frame = frame.rename(columns=str).reset_index(drop=True)
    duplicates = duplicate_column_problems(list(frame.columns), source=FRAME_SOURCE)
    if duplicates:
        raise DataValidationError("\n".join(duplicates), public=[(DUPLICATE_COLUMNS, "")])
    mixed = [column for column in frame.columns if frame[column].dtype == object
             and pd.api.types.infer_dtype(frame[column], skipna=True).startswith("mixed")]
    frame = frame.assign(**{column: frame[column].map(str, na_action="ignore") for column in mixed})
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
