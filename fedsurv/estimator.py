"""fedsurv as a scikit-learn estimator: :class:`FederatedSurvival` (``fit``, ``predict``, ``score``, ...).

>>> from sksurv.util import Surv
>>> from sklearn.model_selection import cross_val_score
>>> y = Surv.from_arrays(event=frame["event"] == 1, time=frame["time"])
>>> X = frame.drop(columns=["time", "event"])
>>> cross_val_score(fedsurv.FederatedSurvival(sites=3, rounds=10), X, y, cv=3)   # Harrell's C of each fold

Each ``fit`` trains a simulated federation on every record of ``X`` with :func:`fedsurv.fit` (the
same ServerApp and ClientApp as every run, with ``data.test_fraction = 0``: no site holds out a test
part, the held-out scoring is scikit-learn's) and keeps the trained model in memory; predictions
follow scikit-survival's conventions (:class:`sksurv.base.SurvivalAnalysisMixin`): ``predict`` is a
risk score (higher: earlier event), ``score`` Harrell's C of it, ``predict_survival_function`` step
functions on the model's time grid. So ``cross_val_score``, ``GridSearchCV``, ``Pipeline`` and
``sklearn.inspection.permutation_importance`` take it like any scikit-survival estimator.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted, validate_data
from sksurv.base import SurvivalAnalysisMixin
from sksurv.functions import StepFunction
from sksurv.util import check_array_survival

from flwr_app.config import ConfigError
from models.predictions import checked_outcomes

__all__ = ["FederatedSurvival"]


class FederatedSurvival(SurvivalAnalysisMixin, BaseEstimator):
    """A survival model trained by a simulated federation on every record of ``X`` (:func:`fedsurv.fit`).

    The parameters are :func:`fedsurv.fit`'s; scikit-learn's contract holds: they are stored as given and
    checked by ``fit``, fitted attributes end in ``_``, and :func:`sklearn.base.clone` gives an unfitted copy.

    Parameters
    ----------
    strategy, epsilon, model, rounds, sites, seed, categorical_cols
        :func:`fedsurv.fit`'s ``strategy`` (``fedavg``, ``dp_sgd``, ...), ``epsilon`` (None: no differential
        privacy), ``model`` (``auto``, ``hazard_mlp``, ``coxph``, ...), ``rounds`` (None: the strategy's default),
        ``sites`` (sites of a random split of the records), ``seed`` and ``categorical_cols`` (numeric columns of
        category codes).
    lr
        ``train.lr``, the sites' learning rate (None: the strategy's default).
    site_col
        A column of ``X`` naming each record's site (a natural partition, not a feature); "" splits the records at
        random over ``sites`` sites.
    time_col, event_col
        Where ``fit`` and ``score`` find the outcomes in a frame ``X`` when ``y`` is None; otherwise the names
        the run gives the outcome columns of ``y`` (no column of ``X`` may carry them).
    config
        Any other run-config key (``docs/configuration.md``). Two defaults differ from a run's here:
        ``data.test_fraction`` is 0 (the sites train on every record of ``X``; a run that holds out a test part
        of each site, ``config={"data.test_fraction": 0.2}``, trains on the rest only) and
        ``baseline.centralized`` is False (the estimator uses the federated model only).
    output_dir
        None: each ``fit`` runs in a temporary directory, removed once the trained model is loaded (the run's
        ``summary.json`` is kept in :attr:`summary_`). A folder: each ``fit`` writes a new run directory in it
        (:attr:`run_dir_`), kept.

    Attributes
    ----------
    run_ : models.predict.SavedRun
        The trained run, its model in memory (a :class:`models.cox_run.CoxRun` for ``model="coxph"``:
        ``hazard_ratios``, ...). With ``output_dir=None`` its ``directory`` no longer exists.
    summary_ : dict
        The run's ``summary.json``: privacy ledger headline, sites, ...; no test figure (``"test"`` is ``{}``,
        ``"test_source"`` says why) unless ``config`` sets ``data.test_fraction`` above 0.
    run_dir_ : pathlib.Path or None
        The run's directory under ``output_dir``; None for a temporary one.
    unique_times_ : ndarray
        The model's time grid: the times of ``predict_survival_function(X, return_array=True)``.
    input_columns_ : list of str
        The names the run knows ``X``'s columns by (a frame's own names; ``x0``, ``x1``, ... for an array).
    n_features_in_, feature_names_in_
        scikit-learn's: the number of columns of ``X`` and, for a frame with string column names, their names.
    """

    def __init__(self, strategy: str = "fedavg", epsilon: float | None = None, model: str = "auto",
                 rounds: int | None = None, lr: float | None = None, sites: int = 5, site_col: str = "",
                 seed: int = 0, categorical_cols: Sequence[str] = (), time_col: str = "time",
                 event_col: str = "event", config: Mapping[str, Any] | None = None,
                 output_dir: str | Path | None = None) -> None:
        self.strategy = strategy
        self.epsilon = epsilon
        self.model = model
        self.rounds = rounds
        self.lr = lr
        self.sites = sites
        self.site_col = site_col
        self.seed = seed
        self.categorical_cols = categorical_cols
        self.time_col = time_col
        self.event_col = event_col
        self.config = config
        self.output_dir = output_dir

    def fit(self, X: Any, y: Any = None) -> FederatedSurvival:
        """Train a simulated federation on the records ``X`` with outcomes ``y`` and keep its model.

        ``y``: a structured array (``sksurv.util.Surv.from_arrays``: an event indicator field, then a time
        field), or None to read the outcomes from the columns :attr:`time_col` and :attr:`event_col` of a frame
        ``X`` (0/1 events), which are then not features.

        Raises
        ------
        ValueError
            For bad outcomes, a ``site_col`` that is not a column of ``X``, or an outcome name ``X`` already uses.
        flwr_app.config.ConfigError, models.data.DataValidationError
            As :func:`fedsurv.fit` (a bad key or value; bad data, naming the column).
        """
        features, event, time = self._outcomes(X, y)
        features = self._frame(features, reset=True)
        columns = list(features.columns)
        taken = [name for name in (self.time_col, self.event_col) if name in columns]
        if taken:
            raise ValueError(f"X has a column {taken[0]!r}, the name fit gives an outcome column of y; pass "
                             "time_col/event_col names that X does not use")
        if self.site_col and self.site_col not in columns:
            raise ValueError(f"site_col={self.site_col!r} is not a column of X (columns: {columns})")
        frame = features.reset_index(drop=True).assign(**{self.time_col: time, self.event_col: event.astype(int)})
        self.run_, self.summary_, self.run_dir_ = self._train(frame)
        self.input_columns_, self.unique_times_ = columns, self.run_.times
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "run_")

    def _train(self, frame: pd.DataFrame) -> tuple[Any, dict[str, Any], Path | None]:
        """Run :func:`fedsurv.fit` on ``frame`` in a new directory; the run, its summary and the kept directory."""
        from fedsurv.api import fit

        config = dict(self.config or {})
        if self.lr is not None:
            if "train.lr" in config:
                raise ConfigError("FederatedSurvival: lr and config['train.lr'] both given; give it once")
            config["train.lr"] = self.lr
        config.setdefault("data.test_fraction", 0.0)
        config.setdefault("baseline.centralized", False)
        parent = None if self.output_dir is None else Path(self.output_dir)
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=f"fedsurv-{self.strategy}-", dir=parent))
        try:
            run = fit(frame, time_col=self.time_col, event_col=self.event_col,
                      categorical_cols=list(self.categorical_cols), site_col=self.site_col, sites=self.sites,
                      strategy=self.strategy, epsilon=self.epsilon, model=self.model, rounds=self.rounds,
                      seed=self.seed, output_dir=directory, config=config)
            return run, run.summary, directory if parent is not None else None
        finally:
            if parent is None:
                shutil.rmtree(directory, ignore_errors=True)

    def predict(self, X: Any) -> np.ndarray:
        """The risk score of each record (higher: earlier event), as scikit-survival's estimators predict it."""
        records = self._records(X)
        return self.run_.risk_score(records).to_numpy()

    def predict_survival_function(self, X: Any, return_array: bool = False) -> np.ndarray:
        r"""Survival functions :math:`\hat S(t \mid x)`: one :class:`sksurv.functions.StepFunction` per record, or
        with ``return_array`` an array of shape (records, len(:attr:`unique_times_`)) of their values there."""
        records = self._records(X)
        curves = self.run_.predict_survival(records).to_numpy()
        return curves if return_array else _step_functions(self.unique_times_, curves, before=1.0)

    def predict_cumulative_hazard_function(self, X: Any, return_array: bool = False) -> np.ndarray:
        r"""Cumulative hazards :math:`-\log \hat S(t \mid x)`, as :meth:`predict_survival_function` (``inf`` where
        the predicted survival is 0)."""
        records = self._records(X)
        hazards = self.run_.predict_cumulative_hazard(records).to_numpy()
        return hazards if return_array else _step_functions(self.unique_times_, hazards, before=0.0)

    def score(self, X: Any, y: Any = None) -> float:
        """Harrell's C of :meth:`predict` (``sksurv.metrics.concordance_index_censored``, as scikit-survival's
        estimators score); ``y`` as in :meth:`fit`."""
        from sksurv.metrics import concordance_index_censored

        _, event, time = self._outcomes(X, y)
        return float(concordance_index_censored(event, time, self.predict(X))[0])

    def _outcomes(self, X: Any, y: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        """The features, the events (bool) and the times of ``X`` and ``y`` (None: ``X``'s outcome columns)."""
        if y is not None:
            event, time = check_array_survival(X, y)
            return X, event, time
        if not isinstance(X, pd.DataFrame):
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None and X is a "
                             f"{type(X).__name__}, not a DataFrame with the outcome columns {self.time_col!r} and "
                             f"{self.event_col!r}; pass y (sksurv.util.Surv.from_arrays)")
        time, event = checked_outcomes(X.rename(columns=str), (self.time_col, self.event_col))
        return X.drop(columns=[self.time_col, self.event_col]), event.astype(bool), time

    def _records(self, X: Any) -> pd.DataFrame:
        """``X`` as the run's records, checked against the columns seen in ``fit`` (outcome columns ignored)."""
        check_is_fitted(self)
        if isinstance(X, pd.DataFrame):
            X = X.drop(columns=[name for name in (self.time_col, self.event_col)
                                if name in X.columns and name not in self.input_columns_])
        return self._frame(X, reset=False)

    def _frame(self, X: Any, *, reset: bool) -> pd.DataFrame:
        """``X`` as a frame named by its own columns (an array: ``x0``, ``x1``, ...); sets or checks
        ``n_features_in_`` and ``feature_names_in_`` (scikit-learn's ``validate_data``)."""
        validate_data(self, X, reset=reset, skip_check_array=True)
        if not isinstance(X, pd.DataFrame):
            values = np.asarray(X)
            if values.ndim != 2:
                raise ValueError(f"X must be 2-dimensional (records x columns), got shape {values.shape}")
            X = pd.DataFrame(values, columns=[f"x{i}" for i in range(values.shape[1])])
        names = [str(column) for column in X.columns] if reset else self.input_columns_
        return X.set_axis(names, axis=1)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.string = True  # text columns are categorical features
        tags.input_tags.categorical = True
        tags.input_tags.allow_nan = True  # a missing value is imputed as in the run's preprocessing
        return tags


def _step_functions(times: np.ndarray, values: np.ndarray, *, before: float) -> np.ndarray:
    """One :class:`~sksurv.functions.StepFunction` per row of ``values`` on ``times`` (``before``: the value from
    0 to the first time, where the grid does not start at 0)."""
    if times[0] > 0:
        times = np.concatenate([[0.0], times])
        values = np.concatenate([np.full((len(values), 1), before), values], axis=1)
    return np.array([StepFunction(times, row) for row in values], dtype=object)
