"""fedsurv's Python API: train a simulated federation, and apply a trained run's model to records.

>>> import fedsurv
>>> run = fedsurv.fit(train, time_col="time", event_col="event", sites=5)   # or fedsurv.load_run("outputs/...")
>>> run.score(held_out)                      # {"c_index": ..., "c_index_td": ..., "ibs": ..., "inbll": ...}
>>> run.predict_survival(held_out.head())    # DataFrame: one row per record, one column per time
>>> fedsurv.kaplan_meier(frame, time_col="time", event_col="event", site_col="centre", group_col="arm")
>>> fedsurv.logrank_test(frame, time_col="time", event_col="event", group_col="arm", site_col="centre")
>>> cross_val_score(fedsurv.FederatedSurvival(sites=5), X, y, cv=3)   # scikit-learn's tools: Harrell's C per fold
>>> run.permutation_importance(held_out)     # drop in C and rise in IBS per shuffled feature column

See :func:`fedsurv.api.fit`, :class:`models.predict.SavedRun` (horizontal runs) and
:class:`models.split_run.SplitRun` (split runs), both :class:`models.predictions.CurvePredictions`, and
:mod:`fedsurv.analysis` (federated Kaplan–Meier curves and log-rank tests from per-site counts), and
:class:`fedsurv.estimator.FederatedSurvival` (a scikit-learn estimator, scikit-survival's conventions: ``fit(X, y)``,
``predict``, ``score``, ``predict_survival_function``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsurv.analysis import LogrankTestResult, kaplan_meier, logrank_test, plot_kaplan_meier
    from fedsurv.api import fit
    from fedsurv.estimator import FederatedSurvival
    from models.cox_run import CoxRun
    from models.predict import SavedRun, load_run
    from models.split_run import SplitRun, load_split_run

#: Where each public name is defined: imported on first use (module ``__getattr__``), so that ``import fedsurv``
#: imports neither torch nor scipy and :func:`fit` refuses a bad key or file within a second or two.
_LAZY = {
    "CoxRun": "models.cox_run",
    "FederatedSurvival": "fedsurv.estimator",
    "LogrankTestResult": "fedsurv.analysis",
    "SavedRun": "models.predict",
    "SplitRun": "models.split_run",
    "fit": "fedsurv.api",
    "kaplan_meier": "fedsurv.analysis",
    "load_run": "models.predict",
    "load_split_run": "models.split_run",
    "logrank_test": "fedsurv.analysis",
    "plot_kaplan_meier": "fedsurv.analysis",
}
_SUBMODULES = ("analysis", "api", "estimator")


def __getattr__(name: str) -> Any:
    """A public name (:data:`__all__`) or submodule, imported on first use and kept."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


__all__ = [
    "CoxRun",
    "FederatedSurvival",
    "LogrankTestResult",
    "SavedRun",
    "SplitRun",
    "fit",
    "kaplan_meier",
    "load_run",
    "load_split_run",
    "logrank_test",
    "plot_kaplan_meier",
]
