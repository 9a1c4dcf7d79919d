"""A trained horizontal run's model applied to new raw records: :func:`load_run`, :class:`SavedRun`.

A horizontal run writes, beside ``model.pt`` (the network's weights, its configuration and, for
Cox models, the federated Breslow baseline), ``preprocessing.json``
(:data:`PREPROCESSING_FILE`): the federation's agreed preprocessing (the raw input columns,
each numeric column's mean, standard deviation and clip range, each categorical column's
levels), the time grid and CoxTime's time scale. For a run with a differentially private set-up
it is the agreed noisy preprocessing, the one the model was trained on. JSON, not a pickle:
reading it runs no code.

>>> run = load_run("outputs/20261123-120000-csv-fedavg-seed0")
>>> new = pd.read_csv("new_patients.csv")
>>> curves = run.predict_survival(new)             # one row per record, one column per time
>>> run.predict_median_survival(new)               # a Series, like run.risk_score(new)
>>> run.score(labelled)                            # {"c_index": ..., "c_index_td": ..., "ibs": ..., ...}
>>> run.plot_calibration(labelled)                 # matplotlib axes

New records are raw rows as in the training file: strings for categorical columns, empty cells
for missing values (imputed by the training mean; an unseen or missing category encodes as all
zeros, like in training). Columns the model does not use (the outcome, ``data.id_col``, others)
are ignored; a missing input column is refused with its name.

A split-learning run's model is spread over its sites (each modality's encoder at the site that
holds the modality, the fusion head in ``model.pt``): :func:`load_run` hands it to
:func:`models.split_run.load_split_run`, which finds the encoders the sites saved (in simulation,
under the run's directory) and returns a :class:`models.split_run.SplitRun` with the same methods.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.cox_run import COXPH_JSON, CoxRun
from models.data.datasets import DEFAULT_OUTCOME
from models.data.preprocess import Preprocessor
from models.saved_run import (
    CONFIG_FILE,
    MODEL_FILE,
    PREPROCESSING_FILE,
    PREPROCESSING_FORMAT,
    SavedRun,
    preprocessing_payload,
)
from models.split_run import SplitRun, load_split_run
from models.survival import SurvivalModel, build_survival_model

__all__ = ["PREPROCESSING_FILE", "SavedRun", "load_run", "preprocessing_payload"]


def load_run(directory: str | Path) -> SavedRun | SplitRun:
    """The trained model of a run's output directory, ready for ``predict_survival``, ``score``, ...

    A horizontal run gives a :class:`SavedRun` (a ``coxph`` run its subclass :class:`models.cox_run.CoxRun`); a
    split run a :class:`models.split_run.SplitRun` (:func:`models.split_run.load_split_run`, with its sites'
    folders where the simulation put them).

    Raises
    ------
    FileNotFoundError
        When the directory holds no ``model.pt`` or no :data:`PREPROCESSING_FILE` (a run that did not finish),
        or a split run's site folder is missing.
    ValueError
        For a ``private_split`` run (its sites keep no model), a private ``coxph`` run (no predictions), or a site
        folder of another run.
    """
    directory = Path(directory)
    model_path = directory / MODEL_FILE
    config_path = directory / CONFIG_FILE
    resolved = json.loads(config_path.read_text(encoding="utf-8"))["resolved"] if config_path.is_file() else {}
    if resolved.get("model", {}).get("name") == "coxph" and resolved.get("strategy") != "fedavg":
        raise ValueError(f"{directory}: a private coxph run (strategy {resolved.get('strategy')!r}) makes no "
                         "predictions and saves no model; its table is coxph_summary.csv (coxph.json)")
    if not model_path.is_file():
        raise FileNotFoundError(f"{directory}: no {MODEL_FILE} (not a run directory, or the run did not finish)")
    if resolved.get("strategy") in ("split", "private_split"):
        return load_split_run(directory)
    saved = torch.load(model_path, weights_only=True)
    spec_path = directory / PREPROCESSING_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"{directory}: no {PREPROCESSING_FILE} beside {MODEL_FILE} (written by runs of this "
                                "version on; an older run's preprocessing is not recorded)")
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    if spec.get("format") != PREPROCESSING_FORMAT:
        raise ValueError(f"{spec_path}: format {spec.get('format')!r}, expected {PREPROCESSING_FORMAT}")
    preprocessor = Preprocessor.from_dict(spec["preprocessor"])
    model = _model(saved["config"], preprocessor, spec)
    try:
        model.net.load_state_dict(saved["state_dict"])
    except RuntimeError as error:  # the network its configuration builds has other parameters
        raise ValueError(f"{model_path}: its weights do not fit the {saved['config']['model']['name']} network this "
                         f"version builds from the run's configuration (saved by another fedsurv version?); refit "
                         f"the run. {str(error).splitlines()[0]}") from None
    if model.needs_baseline:
        if saved.get("baseline") is None:
            raise ValueError(f"{model_path}: a {saved['config']['model']['name']} model without its baseline hazard")
        model.set_baseline(*(np.asarray(part, dtype=np.float64) for part in saved["baseline"]))
    if saved.get("exponents") is not None:  # a private run's recalibration (models.recalibration)
        model.set_exponents(np.asarray(saved["exponents"], dtype=np.float64))
    model.net.eval()
    outcome = tuple(spec.get("outcome", DEFAULT_OUTCOME))
    parts = (directory, model, preprocessor, str(spec.get("id_col", "")), (str(outcome[0]), str(outcome[1])),
             tuple(str(value) for value in spec.get("event_values", ())))
    if saved.get("model") == "coxph":  # Cox regression: its coefficients, tests and summary beside the model
        return CoxRun(*parts, fit=json.loads((directory / COXPH_JSON).read_text(encoding="utf-8")))
    return SavedRun(*parts)


def _model(config: Mapping[str, Any], preprocessor: Preprocessor, spec: Mapping[str, Any]) -> SurvivalModel:
    """The run's network, architecture from its configuration, grid and time scale from its preprocessing file."""
    model = config["model"]
    return build_survival_model(
        model["name"], in_features=len(preprocessor.feature_names), cuts=np.asarray(spec["cuts"], dtype=np.float64),
        hidden=None if model["hidden"] is None else tuple(model["hidden"]), dropout=model["dropout"],
        activation=model["activation"], penalty=model["penalty"],
        time_scale=(float(spec["time_scale"][0]), float(spec["time_scale"][1])), seed=int(config["seed"]),
        risk_layer=model.get("risk_layer", "interval"),  # runs saved before the key: the interval layer
    )
