r"""The baselines of the BVFLMSP paper's Table 1, fitted and evaluated through one entry point.

:func:`fit_evaluate` trains one model on the training records of a :class:`VerticalTable`
restricted to some modalities and scores it on the test records with
:func:`models.metrics.evaluate_survival` (Harrell's C, Antolini's C\ :sub:`td`, IBS and INBLL,
IPCW with the censoring Kaplan-Meier of the test records themselves, as every fedsurv figure:
``docs/evaluation.md``). Harrell's C ranks the test records
by the log-risk for Cox PH and DeepSurv and by :math:`-\mathrm{RMST}` of the predicted curve for
the other models (:func:`models.metrics.evaluate_survival`'s default).

========================== =========== ====================================================
name                       modalities  model
========================== =========== ====================================================
``cox_ph``                 one or more lifelines ``CoxPHFitter`` (Breslow baseline) on the
                                       modalities' design matrices side by side
``deepsurv``               one         the project's ``cox_mlp`` (Cox-MLP, Breslow baseline)
``deephit``                one         single-risk DeepHit, a PMF over the grid
                                       (:class:`DeepHitModel`)
``nnet_survival``          one         the project's ``hazard_mlp`` (logistic hazard)
``multisurv``              one or more MultiSurv: encoders + attention fusion, deterministic
``bayesian_multisurv``     one or more BayesianMultisurv: the same, Bayesian layers, MC mean
========================== =========== ====================================================

The unimodal models see the modality as a design matrix (:func:`design_matrix`: one-hot
categories, standardised continuous columns); the multimodal ones see each modality through
its own encoder (:func:`models.multimodal_training.modality_inputs`). Preprocessing is fitted on
the training records.

Training protocol of the neural models (the paper's: "a fixed number of epochs with early
stopping based on validation loss"): a stratified validation part of the training records
(``validation_fraction``) is held out; the model trains on the rest for at most ``epochs``
epochs, its own loss on the validation part is computed after every epoch, training stops when
it has not improved for ``patience`` epochs, and the weights of the best epoch are kept. The
test records play no part in any choice. Cox PH has nothing to tune and is fitted on all
training records; so are the Breslow baselines and the IPCW censoring distribution.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), Sec. 7, Table 1.
``cox_ph``: Cox (1972), JRSS-B 34:187; Breslow (1974), Biometrics 30:89.
``deepsurv``: Katzman et al. (2018), BMC Med. Res. Methodol. 18:24.
``deephit``: Lee, Zame, Yoon & van der Schaar (2018), AAAI.
``nnet_survival``: Gensheimer & Narasimhan (2019), PeerJ 7:e6257.
``multisurv``: Vale-Silva & Rohr (2021), Sci. Rep. 11:13505.
``bayesian_multisurv``: the BVFLMSP paper, Sec. 6.2; Blundell et al. (2015), ICML.
"""

from __future__ import annotations

import copy
import math
import time as clock
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.data.vertical import ModalityTransform, VerticalTable, split_train_test
from models.losses import deephit_loss, logistic_hazard_nll
from models.metrics import evaluate_survival
from models.multimodal import build_multisurv, part_seed, survival_band
from models.multimodal_training import (
    MultimodalData,
    discretised_labels,
    fit_transforms,
    modality_inputs,
    predict_multisurv,
    train_multisurv,
)
from models.survival import HazardMLP, SurvivalModel, build_survival_model, discretise
from models.time_grid import make_time_grid
from models.training import train_epochs

__all__ = [
    "METRICS",
    "MODELS",
    "MULTIMODAL_MODELS",
    "UNIMODAL_MODELS",
    "BaselineSettings",
    "DeepHitModel",
    "design_matrix",
    "fit_evaluate",
]

#: Neural models that take one modality (BVFLMSP's Table 1 runs them on single modalities only).
UNIMODAL_MODELS = ("deepsurv", "deephit", "nnet_survival")
#: Multimodal networks: any non-empty set of modalities, one encoder each.
MULTIMODAL_MODELS = ("multisurv", "bayesian_multisurv")
#: Every model; ``cox_ph`` takes one modality or several side by side (the linear reference of a combination).
MODELS = ("cox_ph", *UNIMODAL_MODELS, *MULTIMODAL_MODELS)
#: Test metrics of every run (keys of :func:`models.metrics.evaluate_survival`).
METRICS = ("c_index", "c_index_td", "ibs", "inbll")

_TIME_COLUMN, _EVENT_COLUMN = "__time__", "__event__"
#: Events per variable below which Cox PH is fitted with a ridge penalty (Peduzzi et al. 1996).
_MIN_EVENTS_PER_VARIABLE = 10


@dataclass(frozen=True)
class BaselineSettings:
    """Hyper-parameters of the baselines (defaults: pycox's METABRIC examples and the BVFLMSP paper).

    Attributes
    ----------
    validation_fraction : float
        Share of the training records held out (stratified by event) for early stopping.
    patience : int
        Epochs without a lower validation loss before training stops.
    num_durations : int
        Cut points of the discrete-time grid (DeepHit, nnet-survival, the multimodal models; 30 in
        the paper), at quantiles of the training Kaplan-Meier.
    epochs, batch_size, lr, weight_decay, hidden, dropout
        Unimodal nets (DeepSurv, DeepHit, nnet-survival): at most ``epochs`` epochs of Adam on an
        MLP ``hidden`` (ReLU, dropout), as in pycox's METABRIC examples (32-32, dropout 0.1,
        batch 256, lr 0.01).
    deephit_alpha, deephit_sigma : float
        :func:`models.losses.deephit_loss` (pycox's defaults 0.2 and 0.1).
    cox_penalizer : float
        lifelines' ridge penalizer for Cox PH when the modality has fewer than 10 events per
        variable, or when the unpenalised fit does not converge; 0 otherwise.
    multimodal_epochs, multimodal_batch_size, multimodal_lr, multimodal_weight_decay
        MultiSurv and BayesianMultisurv: at most ``multimodal_epochs`` epochs of AdamW (the
        paper: 40 epochs, lr 0.005).
    learning_rates : tuple of (model, float)
        Per-model learning rates that replace ``lr`` or ``multimodal_lr``, e.g.
        ``(("bayesian_multisurv", 0.001),)``.
    dim, encoder_layers, head_layers, multimodal_dropout
        Their architecture (:func:`models.multimodal.build_multisurv`; the paper's 512, 2, 4, 0.5).
    mc_passes : int
        Stochastic passes of BayesianMultisurv at test time (its mean survival curve is scored).
    validation_passes : int
        Passes of BayesianMultisurv for its validation loss (the NLL of the mean curve).
    """

    validation_fraction: float = 0.2
    patience: int = 10
    num_durations: int = 30
    epochs: int = 200
    batch_size: int = 256
    lr: float = 0.01
    weight_decay: float = 0.0
    hidden: tuple[int, ...] = (32, 32)
    dropout: float = 0.1
    deephit_alpha: float = 0.2
    deephit_sigma: float = 0.1
    cox_penalizer: float = 0.1
    multimodal_epochs: int = 40
    multimodal_batch_size: int = 64
    multimodal_lr: float = 0.005
    multimodal_weight_decay: float = 1e-4
    dim: int = 512
    encoder_layers: int = 2
    head_layers: int = 4
    multimodal_dropout: float = 0.5
    mc_passes: int = 50
    validation_passes: int = 10
    learning_rates: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        counts = {name: getattr(self, name) for name in (
            "patience", "epochs", "batch_size", "multimodal_epochs", "multimodal_batch_size", "mc_passes",
            "validation_passes")}
        bad = {name: value for name, value in counts.items() if value < 1}
        if bad:
            raise ValueError(f"these settings must be >= 1: {bad}")
        if self.cox_penalizer <= 0:
            raise ValueError(f"cox_penalizer must be > 0, got {self.cox_penalizer}")
        trained = [model for model in MODELS if model != "cox_ph"]
        unknown = [model for model, _ in self.learning_rates if model not in trained]
        if unknown:
            raise ValueError(f"learning_rates names {unknown}; models trained with a learning rate: {trained}")
        if any(rate <= 0 for _, rate in self.learning_rates):
            raise ValueError(f"learning rates must be > 0, got {self.learning_rates}")

    def learning_rate(self, model: str) -> float:
        """``model``'s learning rate: its entry in ``learning_rates``, else ``multimodal_lr`` or ``lr``."""
        default = self.multimodal_lr if model in MULTIMODAL_MODELS else self.lr
        return dict(self.learning_rates).get(model, default)


class DeepHitModel(SurvivalModel):
    r"""Single-risk DeepHit on the time grid ``cuts``: :math:`S_i(\tau_j) = 1 - \sum_{l \le j} f_{il}`.

    The net's :math:`T` outputs and a fixed 0 are the logits of the probability mass function over
    the :math:`T` intervals and "beyond the grid" (pycox ``DeepHitSingle``); the training loss is
    :func:`models.losses.deephit_loss` on the records' interval indices
    (:func:`models.survival.discretise`). The risk score is :math:`-\mathrm{RMST}`.

    References
    ----------
    Lee, Zame, Yoon & van der Schaar (2018), AAAI (DeepHit); Kvamme, Borgan & Scheel (2019), JMLR
    20(129) (pycox ``DeepHitSingle``).
    """

    kind = "deephit"
    needs_baseline = False

    def __init__(self, net: nn.Module, cuts: np.ndarray, in_features: int, *, alpha: float, sigma: float) -> None:
        super().__init__(net, cuts, in_features)
        self.alpha = alpha
        self.sigma = sigma

    def _loss(self, x: Tensor, time: Tensor, event: Tensor, generator: torch.Generator | None) -> Tensor:
        idx, events = discretise(time.numpy(), event.numpy(), self.cuts)
        return deephit_loss(self.net(x), torch.from_numpy(idx), torch.from_numpy(events),
                            alpha=self.alpha, sigma=self.sigma)

    def _survival(self, x: Tensor) -> np.ndarray:
        pmf = torch.softmax(F.pad(self.net(x).double(), (0, 1)), dim=1)[:, :-1]
        return (1.0 - pmf.cumsum(1)).numpy()


def design_matrix(transform: ModalityTransform, frame: pd.DataFrame, *, source: str) -> tuple[np.ndarray, list[str]]:
    r"""A modality's records as a numeric design matrix: one-hot categories, then standardised columns.

    A categorical column with training levels :math:`l_0 < \dots < l_{L-1}` becomes :math:`L - 1`
    indicators of :math:`l_1, \dots, l_{L-1}` (:math:`l_0` is the reference); a missing or unseen
    value counts as the reference level. Continuous columns are standardised with the training
    mean and standard deviation (:class:`models.data.vertical.ModalityTransform`).

    Returns
    -------
    x : numpy.ndarray of float32, shape (n, p)
    names : list of str
        ``"column=level"`` for the indicators, the column name for the continuous columns.
    """
    coded = transform.transform(frame, source=source)
    k = len(transform.categorical)
    blocks, names = [], []
    for j, (column, levels) in enumerate(zip(transform.categorical, transform.levels, strict=True)):
        blocks.append(coded[:, [j]] == np.arange(1, len(levels), dtype=np.float32))
        names += [f"{column}={level}" if isinstance(level, str) else f"{column}={level:g}" for level in levels[1:]]
    x = np.concatenate([*blocks, coded[:, k:]], axis=1).astype(np.float32)
    return x, names + list(transform.continuous)


def fit_evaluate(
    name: str, table: VerticalTable, modalities: Sequence[str], train_ids: np.ndarray, test_ids: np.ndarray, *,
    seed: int, settings: BaselineSettings | None = None,
) -> dict[str, object]:
    """Fit baseline ``name`` on ``train_ids`` using ``modalities`` and score it on ``test_ids``.

    Parameters
    ----------
    name : str
        One of :data:`MODELS`.
    table : VerticalTable
    modalities : sequence of str
        Modalities the model sees: exactly one for :data:`UNIMODAL_MODELS`, one or more for
        ``cox_ph`` (their design matrices side by side) and :data:`MULTIMODAL_MODELS`.
    train_ids, test_ids : numpy.ndarray of str
        Disjoint record IDs (e.g. from :func:`models.data.vertical.split_train_test`).
    seed : int
        Drives the validation split, the initialisation, the batches, dropout and the Bayesian
        draws.
    settings : BaselineSettings, optional

    Returns
    -------
    dict
        ``model``, ``data``, ``modalities`` (joined with ``+``), ``seed``; the test metrics
        :data:`METRICS`; ``n_train``, ``n_fit`` (records the weights were fitted on),
        ``n_validation``, ``n_test``; ``epochs_trained``, ``best_epoch`` (the epoch whose weights
        were kept) and ``validation_loss`` (the model's own loss on the validation records at that
        epoch; for the multimodal models the NLL of the mean curve), NaN for Cox PH;
        ``cox_penalizer`` (NaN for the other models); ``seconds`` (wall time).

    Raises
    ------
    ValueError
        Unknown model or modality, no modality, more than one modality for a unimodal model,
        overlapping or unknown IDs.
    """
    settings = settings or BaselineSettings()
    modalities = list(modalities)
    _check_request(name, table, modalities, train_ids, test_ids)
    selected = table.select(modalities)
    train, test = selected.subset(train_ids), selected.subset(test_ids)
    started = clock.perf_counter()
    outcome = _fit(name, selected, train_ids, test_ids, seed=seed, settings=settings)
    metrics = evaluate_survival(outcome.times, outcome.surv, time=test.time, event=test.event, risk=outcome.risk)
    return {
        "model": name, "data": table.name, "modalities": "+".join(modalities), "seed": seed,
        **{metric: metrics[metric] for metric in METRICS},
        "n_train": len(train), "n_fit": outcome.n_fit, "n_validation": outcome.n_validation, "n_test": len(test),
        "epochs_trained": outcome.epochs_trained, "best_epoch": outcome.best_epoch,
        "validation_loss": outcome.validation_loss, "cox_penalizer": outcome.cox_penalizer,
        "seconds": clock.perf_counter() - started,
    }


def _check_request(name: str, table: VerticalTable, modalities: list[str], train_ids: np.ndarray,
                   test_ids: np.ndarray) -> None:
    """:func:`fit_evaluate`'s ValueError for an unknown model, no modality, more than one modality for a unimodal
    model, or record IDs in both ``train_ids`` and ``test_ids``."""
    if name not in MODELS:
        raise ValueError(f"unknown baseline {name!r}; options: {', '.join(MODELS)}")
    if not modalities:
        raise ValueError(f"{name} on {table.name}: no modality given; the data set has {list(table.modalities)}")
    if name in UNIMODAL_MODELS and len(modalities) > 1:
        raise ValueError(
            f"{name} is a unimodal baseline (BVFLMSP Table 1 runs it on single modalities only) and cannot take "
            f"{len(modalities)} modalities {modalities} of {table.name}; use one of {', '.join(MULTIMODAL_MODELS)} "
            "for a combination")
    overlap = np.intersect1d(train_ids, test_ids)
    if overlap.size:
        raise ValueError(f"{table.name}: {overlap.size} record IDs are in both the training and the test IDs, "
                         f"e.g. {overlap[:3].tolist()}")


def _fit(name: str, selected: VerticalTable, train_ids: np.ndarray, test_ids: np.ndarray, *, seed: int,
         settings: BaselineSettings) -> _Outcome:
    """Fit baseline ``name`` on ``selected``'s ``train_ids`` (validation split among them) and predict
    ``test_ids``: :func:`_fit_cox_ph`, :func:`_fit_unimodal` or :func:`_fit_multimodal`."""
    if name == "cox_ph":
        return _fit_cox_ph(selected, train_ids, test_ids, settings=settings)
    if name in UNIMODAL_MODELS:
        return _fit_unimodal(name, selected, train_ids, test_ids, seed=seed, settings=settings)
    return _fit_multimodal(name, selected, train_ids, test_ids, seed=seed, settings=settings)


# --------------------------------------------------------------------------- internals


@dataclass(frozen=True)
class _Outcome:
    """Test-set predictions of one fitted model and how it was fitted."""

    times: np.ndarray
    surv: np.ndarray
    risk: np.ndarray | None
    n_fit: int
    n_validation: int
    epochs_trained: float = math.nan
    best_epoch: float = math.nan
    validation_loss: float = math.nan
    cox_penalizer: float = math.nan


class _PatienceExhausted(Exception):
    """Raised from a training callback to end training (the validation loss stopped improving)."""


class _EarlyStopping:
    """Tracks the validation loss after each epoch, keeps the best weights, stops after ``patience`` epochs.

    Epochs count from 1; ``best_epoch`` 0 means no epoch gave a finite validation loss (the initial
    weights are then restored).
    """

    def __init__(self, module: nn.Module, validation_loss: Callable[[], float], patience: int) -> None:
        self.module = module
        self.validation_loss = validation_loss
        self.patience = patience
        self.epochs = 0
        self.best_epoch = 0
        self.best_loss = math.inf
        self.best_state = copy.deepcopy(module.state_dict())

    def end_of_epoch(self) -> None:
        self.epochs += 1
        loss = self.validation_loss()
        if loss < self.best_loss:
            self.best_loss, self.best_epoch = loss, self.epochs
            self.best_state = copy.deepcopy(self.module.state_dict())
        elif self.epochs - self.best_epoch >= self.patience:
            raise _PatienceExhausted

    def restore_best(self) -> None:
        self.module.load_state_dict(self.best_state)


def _validation_split(table: VerticalTable, train_ids: np.ndarray, *, fraction: float,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fit and validation IDs: a stratified split of the training IDs with its own seed."""
    return split_train_test(table.subset(train_ids), test_fraction=fraction, seed=part_seed(seed, "validation"))


def _fit_unimodal(name: str, table: VerticalTable, train_ids: np.ndarray, test_ids: np.ndarray, *, seed: int,
                  settings: BaselineSettings) -> _Outcome:
    (modality,) = table.modalities
    transform = fit_transforms(table, train_ids)[modality]
    source = f"{table.name} modality {modality!r}"

    def features(ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
        return design_matrix(transform, table.subset(ids).modalities[modality], source=source)

    train = table.subset(train_ids)
    (x_train, _), (x_test, _) = features(train_ids), features(test_ids)
    fit_ids, validation_ids = _validation_split(table, train_ids, fraction=settings.validation_fraction, seed=seed)
    fit, validation = table.subset(fit_ids), table.subset(validation_ids)
    (x_fit, _), (x_validation, _) = features(fit_ids), features(validation_ids)
    model = _build_unimodal_net(name, x_train.shape[1], train, settings=settings, seed=seed)
    stopper = _EarlyStopping(model.net, lambda: _validation_loss(model, x_validation, validation), settings.patience)
    steps_per_epoch = math.ceil(len(fit) / settings.batch_size)
    steps = 0

    def after_step() -> None:
        nonlocal steps
        steps += 1
        if steps % steps_per_epoch == 0:
            stopper.end_of_epoch()

    try:
        train_epochs(model, x_fit, fit.time, fit.event, epochs=settings.epochs, batch_size=settings.batch_size,
                     lr=settings.learning_rate(name), weight_decay=settings.weight_decay, seed=seed,
                     on_step=after_step)
    except _PatienceExhausted:
        pass
    stopper.restore_best()
    if model.needs_baseline:  # DeepSurv: Breslow on all training records, on every training time
        model.set_baseline(*model.breslow_aggregates(x_train, train.time, train.event))
    times, surv = model.predict_survival(x_test)
    return _Outcome(times, surv, model.risk_score(x_test), n_fit=len(fit), n_validation=len(validation),
                    epochs_trained=stopper.epochs, best_epoch=stopper.best_epoch,
                    validation_loss=stopper.best_loss)


def _build_unimodal_net(name: str, in_features: int, train: VerticalTable, *, settings: BaselineSettings,
                        seed: int) -> SurvivalModel:
    """DeepSurv (Breslow grid: every training time), nnet-survival or DeepHit (the quantile grid).

    References
    ----------
    Katzman et al. (2018), BMC Med. Res. Methodol. 18:24; Gensheimer & Narasimhan (2019), PeerJ
    7:e6257; Lee et al. (2018), AAAI.
    """
    architecture = {"hidden": settings.hidden, "dropout": settings.dropout, "activation": "relu"}
    if name == "deepsurv":
        return build_survival_model("cox_mlp", in_features=in_features, cuts=np.unique(train.time), seed=seed,
                                    **architecture)
    cuts = make_time_grid(train.time, train.event, num_durations=settings.num_durations)
    if name == "nnet_survival":
        return build_survival_model("hazard_mlp", in_features=in_features, cuts=cuts, seed=seed, **architecture)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = HazardMLP(in_features, cuts.size, **architecture)  # T logits, read as DeepHit's PMF logits
    return DeepHitModel(net, cuts, in_features, alpha=settings.deephit_alpha, sigma=settings.deephit_sigma)


def _validation_loss(model: SurvivalModel, x: np.ndarray, records: VerticalTable) -> float:
    """The model's own training loss on the validation records (one batch), in eval mode."""
    was_training = model.net.training
    model.net.eval()
    try:
        with torch.no_grad():
            return float(model.loss(torch.from_numpy(x), torch.from_numpy(records.time),
                                    torch.from_numpy(records.event.astype(np.float32))))
    finally:
        model.net.train(was_training)


def _fit_cox_ph(table: VerticalTable, train_ids: np.ndarray, test_ids: np.ndarray, *,
                settings: BaselineSettings) -> _Outcome:
    """lifelines' CoxPHFitter (Breslow baseline) on every modality of ``table`` side by side (columns
    ``<modality>:<column>``); ridge-penalised when events per variable < 10 or when the unpenalised fit
    does not converge.

    References
    ----------
    Cox (1972), JRSS-B 34:187; Peduzzi et al. (1996), J. Clin. Epidemiol. 49:1373 (events per variable).
    """
    from lifelines import CoxPHFitter
    from lifelines.exceptions import ConvergenceError, ConvergenceWarning

    transforms = fit_transforms(table, train_ids)
    source = f"{table.name} modalities {'+'.join(table.modalities)}"

    def features(ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
        part = table.subset(ids)
        blocks = [design_matrix(transforms[name], part.modalities[name], source=f"{table.name} modality {name!r}")
                  for name in table.modalities]
        return (np.hstack([x for x, _ in blocks]),
                [f"{name}:{column}" for name, (_, columns) in zip(table.modalities, blocks, strict=True)
                 for column in columns])

    train = table.subset(train_ids)
    (x_train, names), (x_test, _) = features(train_ids), features(test_ids)
    frame = pd.DataFrame(x_train, columns=names).assign(**{_TIME_COLUMN: train.time, _EVENT_COLUMN: train.event})
    enough_events = train.event.sum() >= _MIN_EVENTS_PER_VARIABLE * x_train.shape[1]
    penalizers = [0.0, settings.cox_penalizer] if enough_events else [settings.cox_penalizer]
    for penalizer in penalizers:
        fitter = CoxPHFitter(penalizer=penalizer, baseline_estimation_method="breslow")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", ConvergenceWarning)
                fitter.fit(frame, duration_col=_TIME_COLUMN, event_col=_EVENT_COLUMN)
            break
        except (ConvergenceError, ConvergenceWarning) as error:
            failure = error
    else:
        raise ValueError(f"Cox PH on {source}: lifelines did not converge with penalizer {penalizers[-1]}: {failure}")
    test = pd.DataFrame(x_test, columns=names)
    curves = fitter.predict_survival_function(test)  # rows: the training times; columns: records
    return _Outcome(curves.index.to_numpy(dtype=np.float64), curves.to_numpy(dtype=np.float64).T,
                    fitter.predict_log_partial_hazard(test).to_numpy(dtype=np.float64),
                    n_fit=len(train), n_validation=0, cox_penalizer=penalizer)


def _fit_multimodal(name: str, table: VerticalTable, train_ids: np.ndarray, test_ids: np.ndarray, *, seed: int,
                    settings: BaselineSettings) -> _Outcome:
    """MultiSurv or BayesianMultisurv on every modality of ``table``; the test curve is the mean over passes.

    References
    ----------
    Vale-Silva & Rohr (2021), Sci. Rep. 11:13505; BVFLMSP paper, Secs. 4.5 and 6.2.
    """
    bayesian = name == "bayesian_multisurv"
    train = table.subset(train_ids)
    cuts = make_time_grid(train.time, train.event, num_durations=settings.num_durations)
    transforms = fit_transforms(table, train_ids)
    fit_ids, validation_ids = _validation_split(table, train_ids, fraction=settings.validation_fraction, seed=seed)
    fit, validation = table.subset(fit_ids), table.subset(validation_ids)
    data = MultimodalData(*modality_inputs(table, fit_ids, transforms), *discretised_labels(fit.time, fit.event, cuts))
    validation_inputs, validation_present = modality_inputs(table, validation_ids, transforms)
    validation_index, validation_event = discretised_labels(validation.time, validation.event, cuts)
    model = build_multisurv({modality: transform.input_shape for modality, transform in transforms.items()},
                            seed=seed, bayesian=bayesian, dim=settings.dim, num_durations=cuts.size,
                            encoder_layers=settings.encoder_layers, head_layers=settings.head_layers,
                            dropout=settings.multimodal_dropout)
    validation_passes = settings.validation_passes if bayesian else 1

    def validation_loss() -> float:
        logits = predict_multisurv(model, validation_inputs, validation_present, passes=validation_passes, seed=seed)
        return _predictive_nll(logits, validation_index, validation_event)

    stopper = _EarlyStopping(model, validation_loss, settings.patience)
    try:
        train_multisurv(model, data, epochs=settings.multimodal_epochs, batch_size=settings.multimodal_batch_size,
                        lr=settings.learning_rate(name), weight_decay=settings.multimodal_weight_decay, seed=seed,
                        on_epoch=lambda epoch, loss: stopper.end_of_epoch())
    except _PatienceExhausted:
        pass
    stopper.restore_best()
    test_inputs, test_present = modality_inputs(table, test_ids, transforms)
    logits = predict_multisurv(model, test_inputs, test_present, passes=settings.mc_passes if bayesian else 1,
                               seed=seed)
    mean_survival, _, _ = survival_band(logits.double())
    return _Outcome(cuts, mean_survival.numpy(), None, n_fit=len(fit), n_validation=len(validation),
                    epochs_trained=stopper.epochs, best_epoch=stopper.best_epoch,
                    validation_loss=stopper.best_loss)


def _predictive_nll(logits: Tensor, idx_durations: Tensor, events: Tensor) -> float:
    r"""Mean NLL of the MC mean curve: :math:`-\frac1n \sum_i \log \frac1m \sum_j e^{-\ell_{ij}}`.

    :math:`\ell_{ij}` is record :math:`i`'s discrete-time NLL under pass :math:`j`
    (:func:`models.losses.logistic_hazard_nll`); averaging the likelihoods over passes is the
    likelihood of the mean survival curve. With one pass it is the NLL itself.
    """
    per_pass = torch.stack([logistic_hazard_nll(pass_logits.double(), idx_durations, events, reduction="none")
                            for pass_logits in logits])  # (m, n)
    log_mean_likelihood = torch.logsumexp(-per_pass, dim=0) - math.log(per_pass.shape[0])
    return float(-log_mean_likelihood.mean())
