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
from typing import TYPE_CHECKING, Any

import pandas as pd

from flwr_app.config import ConfigError, check_inputs, resolve
from models.data.validate import DUPLICATE_COLUMNS, DataValidationError, duplicate_column_problems

if TYPE_CHECKING:
    from models.predict import SavedRun

# torch, Ray and Flower are imported once the run config, the data and the output directory are checked
# (flwr_app.config.resolve and check_inputs), so that a bad key, value or file is refused within a second or two.

__all__ = ["DATA_FILE", "FRAME_SOURCE", "fit"]

#: The copy of a DataFrame given to :func:`fit`, written in the run's directory (the sites read it): Parquet, so
#: that the frame's dtypes (category, string, boolean, nullable integers) reach the sites as they are.
DATA_FILE = "input.parquet"
#: How an error about a DataFrame given to :func:`fit` names it (instead of :data:`DATA_FILE`'s path).
FRAME_SOURCE = "the DataFrame given to fedsurv.fit"
#: The run-config keys :func:`fit` takes as arguments: its errors about the data name the argument.
ARGUMENT_KEYS = {"data.time_col": "time_col", "data.event_col": "event_col", "data.event_values": "event_values",
                 "data.id_col": "id_col", "data.categorical_cols": "categorical_cols", "data.drop_cols": "drop_cols",
                 "data.path": "data", "federation.num_sites": "sites", "federation.partition": "site_col"}


def fit(
    data: pd.DataFrame | str | Path, *, time_col: str = "time", event_col: str = "event",
    event_values: Sequence[str] = (), id_col: str = "", categorical_cols: Sequence[str] = (),
    drop_cols: Sequence[str] = (), site_col: str = "", sites: int = 5, strategy: str = "fedavg",
    epsilon: float | None = None, model: str = "auto", rounds: int | None = None, seed: int = 0,
    output_dir: str | Path | None = None, config: Mapping[str, Any] | None = None,
) -> SavedRun:
    """Train a survival model over a simulated federation of ``data``'s records and return it.

    Each argument sets the run-config key named below (``docs/configuration.md``); ``config`` sets any other.

    Parameters
    ----------
    data
        The records (a frame, or a CSV/Parquet path: ``data.path``), one per row, every column but the outcome a
        feature. A frame is written, dtypes kept, to ``<output_dir>/input.parquet`` (:data:`DATA_FILE`) for the
        sites: a category column is categorical, an object column mixing numbers and text is text.
    time_col, event_col, event_values, id_col, categorical_cols, drop_cols
        ``data.<argument>``: the outcome columns (events 0/1 or booleans, or the values in ``event_values``, e.g.
        ``["Dead"]``, the others censored), an identifier column (never a feature), columns read as categories
        whatever they hold (codes; text is categorical anyway), columns to drop.
    site_col, sites
        ``federation.partition``: a column naming each record's site (one site per value), or "" to split the
        records at random over ``sites`` sites (``federation.num_sites``).
    strategy, epsilon, model, rounds, seed
        ``strategy.name`` (``fedavg``, ``dp_sgd``, ``distributed_dp``, ...), its target ``privacy.epsilon`` (None:
        no differential privacy), ``model.name``, ``federation.rounds`` (None: the strategy's default), ``seed``;
        ``"coxph"``: a Cox regression by Newton-Raphson (``fedavg``, no ``rounds``; docs/howto/cox-regression.md).
    output_dir, config
        The run's directory (must not hold another run; default ``outputs/api/<time>-<strategy>``), and any other
        run-config key, e.g. ``{"train.lr": 0.003, "federation.server_optimizer": "fedadam"}``.

    Returns
    -------
    SavedRun
        The trained model (``predict_survival``, ``score``, ``plot_calibration``, ...), its ``summary`` (test figures,
        privacy ledger headline); for ``coxph`` a :class:`models.cox_run.CoxRun` (``hazard_ratios``, ...).

    Raises
    ------
    flwr_app.config.ConfigError
        For a bad or unknown key (with the nearest known ones), a key given both as an argument and in ``config``,
        or an ``output_dir`` that holds another run.
    models.data.DataValidationError
        For bad data or too few records for ``sites``, naming the file (or :data:`FRAME_SOURCE`), the column, the
        rows (row 1: the first) and the argument, before anything is written or torch, Ray or Flower imported.
    """
    directory = Path(output_dir) if output_dir is not None else _default_directory(strategy)
    overrides = _with_config({
        "data.name": "csv", "data.time_col": time_col, "data.event_col": event_col,
        "data.event_values": event_values if isinstance(event_values, str) else ",".join(map(str, event_values)),
        "data.id_col": id_col, "data.categorical_cols": ",".join(categorical_cols),
        "data.drop_cols": ",".join(drop_cols), "federation.partition": site_col or "iid", "federation.num_sites": sites,
        "strategy.name": strategy, "privacy.epsilon": float("inf") if epsilon is None else float(epsilon),
        "model.name": model, "federation.rounds": "auto" if rounds is None else rounds, "seed": seed,
        "output.dir": str(directory),
    }, config)
    frame = data if isinstance(data, pd.DataFrame) else None
    path = directory.resolve() / DATA_FILE if frame is not None else Path(data).resolve()
    return _train({**overrides, "data.path": str(path)}, frame, path, directory)


def _with_config(overrides: dict[str, Any], config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``overrides`` (the keys :func:`fit`'s arguments set) updated with ``config``; a
    :class:`~flwr_app.config.ConfigError` for a key given both ways."""
    both = sorted(set(overrides) & set(config or {}))
    if both:
        raise ConfigError(f"fit: {', '.join(both)} given both as an argument and in config; give it once")
    overrides.update(config or {})
    return overrides


def _train(overrides: dict[str, Any], frame: pd.DataFrame | None, path: Path, directory: Path) -> SavedRun:
    """:func:`fit`'s run: check the run config ``overrides`` and the data (``frame``, else the file at ``path``),
    write ``frame`` to ``path`` in the unused ``directory``, run the simulation and load the trained run. Errors
    about the data name :func:`fit`'s arguments (:func:`_data_message`)."""
    _, cfg = resolve(overrides)  # a bad key or value is refused before anything is read or written
    try:
        if frame is not None:
            _check_unused(directory)
            frame = _prepared_frame(frame)
        check_inputs(cfg, frame)
        if frame is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(path, index=False)
        from simulations.engine import run_simulation  # torch, Ray and Flower

        run_simulation(overrides)
    except DataValidationError as err:
        raise DataValidationError(_data_message(str(err), path if frame is not None else None),
                                  public=err.public) from None
    from models.predict import load_run

    return load_run(directory)


def _data_message(message: str, frame_path: Path | None) -> str:
    """An error about :func:`fit`'s data naming its arguments (:data:`ARGUMENT_KEYS`) for their keys, and, for a
    frame written to ``frame_path``, the frame (:data:`FRAME_SOURCE`) for that file."""
    if frame_path is not None:
        message = message.replace(str(frame_path), FRAME_SOURCE)
    for key, argument in ARGUMENT_KEYS.items():
        message = message.replace(key, argument)
    return message


def _default_directory(strategy: str) -> Path:
    return Path("outputs") / "api" / f"{datetime.datetime.now():%Y%m%d-%H%M%S-%f}-{strategy}"


def _check_unused(directory: Path) -> None:
    """Refuse an ``output_dir`` that holds another run's files or another frame's copy (:data:`DATA_FILE`)."""
    from flwr_app.outputs import RUN_FILES

    held = sorted(name for name in (*RUN_FILES, DATA_FILE) if (directory / name).exists())
    if held:
        raise ConfigError(f"output.dir = '{directory}' already holds {', '.join(held)}: give fit a new output_dir")


def _prepared_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` as the run's Parquet input will hold it (:data:`DATA_FILE`), dtypes kept: column names as text,
    a plain index, and an object column that mixes numbers and text (which Parquet cannot store) as text, as a
    CSV file would hold it. Raises :class:`DataValidationError` for duplicate column names."""
    frame = frame.rename(columns=str).reset_index(drop=True)
    duplicates = duplicate_column_problems(list(frame.columns), source=FRAME_SOURCE)
    if duplicates:
        raise DataValidationError("\n".join(duplicates), public=[(DUPLICATE_COLUMNS, "")])
    mixed = [column for column in frame.columns if frame[column].dtype == object
             and pd.api.types.infer_dtype(frame[column], skipna=True).startswith("mixed")]
    return frame.assign(**{column: frame[column].map(str, na_action="ignore") for column in mixed})
