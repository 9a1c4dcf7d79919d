"""Binds a typed :class:`ExperimentConfig` to the data and model code.

The ServerApp, the ClientApp, the centralised baseline and the benchmark all build their data
and model here, so that every path trains exactly the same network on exactly the same split.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from flwr_app.config import ExperimentConfig, column_roles
from strategies.config import CENTRALIZED_LABEL, DEFAULT_HIDDEN
from strategies.model_choice import CANDIDATES, ModelChoice, choose_model
from models.data import (
    FederatedDataset,
    Preprocessor,
    RawTable,
    SurvivalArrays,
    build_federated_dataset,
    load_table,
)
from models.data.datasets import outcome_columns
from models.data.dictionary import DataDictionary
from models.data.files import resolve_data_dir
from models.survival import SurvivalModel, build_survival_model
from models.time_grid import histogram_survival, interval_hazard, make_time_grid, time_counts
from strategies.mechanisms.base import SecureSumMechanism, SiteSetUp
from strategies.mechanisms.dp_sgd import DPSGD
from strategies.mechanisms.setup_share import (
    recalibrates,
    recalibration_history,
    recalibration_multiplier,
    setup_multiplier,
)
from strategies.horizontal import holds_test_part
from strategies.mechanisms.none import NoPrivacy
from strategies.mechanisms.registry import horizontal_mechanism
from strategies.mechanisms.setup_statistics import (
    RecalibrationPlan,
    SecureSetup,
    SetupPlan,
    SharedSetup,
    accountant_history,
    recalibration_plan,
    run_setup,
)



@dataclass(frozen=True)
class FederationSetUp:
    """What a simulated federation agreed before training, the same at the server and at every site.

    Attributes
    ----------
    cuts, time_scale
        The shared time grid and CoxTime's time scale.
    setups
        Every site's set-up by name: its agreed record count and the accountant history of its
        set-up releases.
    plan
        The differentially private set-up's plan (:mod:`strategies.mechanisms.setup_statistics`),
        or ``None`` when the set-up was exact (fitted on the pooled training data, which stands
        for the sites' exact sums).
    time_counts
        ``(points, events, censored)`` of the training times: the private set-up's denoised time
        histogram (``SharedSetup.time_counts``), or the exact pooled counts
        (:func:`models.time_grid.time_counts`); None when the private set-up released no time
        histogram (a public time grid).
    notes
        How the private set-up settled ranges that did not stand out of its noise (one sentence:
        :meth:`~strategies.mechanisms.setup_statistics.AgreedRanges.describe`).
    recalibration
        The planned recalibration after training (a private set-up's hazard model with enough records), or None.
    fallbacks
        How the private set-up settled the ranges that did not stand out of its noise: column (or ``"time"``)
        -> ``"scan"`` or ``"left out"`` (:attr:`~strategies.mechanisms.setup_statistics.AgreedRanges.fallbacks`).
    """

    cuts: np.ndarray
    time_scale: tuple[float, float]
    setups: dict[str, SiteSetUp]
    plan: SetupPlan | None
    time_counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    notes: tuple[str, ...] = ()
    recalibration: RecalibrationPlan | None = None
    fallbacks: Mapping[str, str] = field(default_factory=dict)

    @property
    def left_out(self) -> tuple[str, ...]:
        """The feature columns the private set-up left out of the model, in the table's order."""
        return tuple(c for c, how in self.fallbacks.items() if how == "left out")


#: Stream of the simulated sites' set-up noise (beside the partition's and the split's).
SETUP_STREAM = 11


def uses_private_setup(cfg: ExperimentConfig) -> bool:
    """Whether the run agrees its set-up with DP: its mechanism needs it (``private_setup``: the
    record-level DP-SGD mechanisms) and ``privacy.setup_share`` is not 0."""
    return horizontal_mechanism(cfg.strategy).uses_private_setup(cfg)


def setup_plan(cfg: ExperimentConfig, features: pd.DataFrame) -> SetupPlan | None:
    """The run's DP set-up plan for a table of ``features``' schema, or None for an exact set-up.

    ``data.dictionary`` makes what it lists public.
    """
    if not uses_private_setup(cfg):
        return None
    dictionary = DataDictionary.load(cfg.data.dictionary) if cfg.data.dictionary else None
    return SetupPlan.for_features(features, **setup_plan_options(cfg, dictionary))


def setup_plan_options(cfg: ExperimentConfig, dictionary: DataDictionary | None) -> dict[str, Any]:
    """The run's :class:`SetupPlan` options (every site and the server build the same plan from their own run
    config): the set-up noise, adjacency, ``dictionary`` and time grid; ``model.name = "coxph"`` releases the moments
    of columns with a public range too (its design's centre and spread are the columns' own, not the range's)."""
    return {"noise_multiplier": setup_multiplier(cfg), "adjacency": cfg.privacy.adjacency, "dictionary": dictionary,
            "time_grid": cfg.model.time_grid, "ranged_moments": cfg.model.name == "coxph"}


def secure_setup(cfg: ExperimentConfig, parties: int, honest_sites: tuple[float, ...] = ()) -> SecureSetup | None:
    """How the set-up's releases go through a secure sum (a mechanism with one, ``distributed_dp``; ``dp_sgd`` where
    its ``privacy.setup_sum`` resolves to ``secure``: :meth:`~strategies.mechanisms.dp_sgd.DPSGD.setup_sum`), over
    ``parties`` sites tolerating ``privacy.max_dropouts`` drop-outs and ``privacy.colluding_sites``; ``honest_sites``:
    the ``privacy-min-honest-sites`` of a site's own policy (:func:`~strategies.mechanisms.distributed_dp.counted_honest`).
    None without a secure sum (each site adds its own noise). Whether there is one is a function of the run config
    alone (never of ``parties``, which a deployed site learns from the server), so the server and every site decide
    it alike."""
    mechanism = horizontal_mechanism(cfg.strategy)
    if not (isinstance(mechanism, SecureSumMechanism)
            or (isinstance(mechanism, DPSGD) and mechanism.setup_sum(cfg) == "secure")):
        return None
    from strategies.mechanisms.distributed_dp import counted_honest

    privacy = cfg.privacy
    return SecureSetup(parties, privacy.max_dropouts, privacy.colluding_sites, privacy.modulus_bits,
                       counted_honest(honest_sites, privacy.max_dropouts))


def setup_history(cfg: ExperimentConfig, plan: SetupPlan,
                  recalibration: RecalibrationPlan | None) -> tuple[tuple[float, float, int], ...]:
    """What a site's accountant composes before training: the set-up's releases and, where a
    recalibration is planned, its release (after training)."""
    return accountant_history(plan) + (recalibration_history(cfg) if recalibration is not None else ())


def plan_recalibration(cfg: ExperimentConfig, shared: SharedSetup, counts: Mapping[str, float]) -> RecalibrationPlan | None:
    """The run's recalibration plan (:func:`~strategies.mechanisms.setup_statistics.recalibration_plan`), or None."""
    if not recalibrates(cfg):
        return None
    spread = horizontal_mechanism(cfg.strategy).recalibration_spread(cfg, len(counts))
    return recalibration_plan(shared.time_counts, count=sum(counts.values()), spread=spread,
                              multiplier=recalibration_multiplier(cfg))


@functools.lru_cache(maxsize=4)
def _simulation(cfg: ExperimentConfig) -> tuple[FederatedDataset, FederationSetUp]:
    data, federation = cfg.data, cfg.federation
    agreed: dict[str, object] = {}

    def private_fit(sites: Mapping[str, tuple[pd.DataFrame, np.ndarray, np.ndarray]]) -> Preprocessor:
        plan = setup_plan(cfg, next(iter(sites.values()))[0])
        assert plan is not None
        rngs = {name: np.random.default_rng([cfg.seed, SETUP_STREAM, index]) for index, name in enumerate(sites)}
        shared, counts = run_setup(plan, sites, rngs, num_durations=cfg.model.num_durations, require_inputs=True,
                                   secure=secure_setup(cfg, len(sites)))
        agreed.update(plan=plan, shared=shared, counts=counts)
        return shared.preprocessor

    dataset = build_federated_dataset(
        name=data.name, seed=cfg.seed, num_sites=federation.num_sites, partition=federation.partition,
        dirichlet_alpha=federation.dirichlet_alpha, test_fraction=data.test_fraction, path=data.path,
        data_dir=str(resolve_data_dir(data.dir)), time_col=data.time_col, event_col=data.event_col,
        feature_cols=data.feature_cols, min_site_records=federation.min_site_records,
        sba_horizon_months=data.horizon_months, oot_start=data.oot_start,
        fit_preprocessor=private_fit if uses_private_setup(cfg) else None, roles=column_roles(cfg),
    )
    if agreed:
        shared, counts, plan = agreed["shared"], agreed["counts"], agreed["plan"]
        recalibration = plan_recalibration(cfg, shared, counts)
        cuts, time_scale, prior = shared.cuts, shared.time_scale, setup_history(cfg, plan, recalibration)
        counted = shared.time_counts
    else:
        train = dataset.pooled("train")
        cuts = make_time_grid(train.time, train.event, num_durations=cfg.model.num_durations,
                              scheme=cfg.model.time_grid)
        time_scale, plan, prior = (float(np.mean(train.time)), float(np.std(train.time))), None, ()
        counted, recalibration = time_counts(train.time, train.event), None
        counts = {site.name: float(len(site.train)) for site in dataset.sites}
    smallest = min(counts.values())
    setups = {name: SiteSetUp(count=count, min_count=smallest, prior=prior) for name, count in counts.items()}
    notes, fallbacks = (agreed["shared"].notes, agreed["shared"].fallbacks) if agreed else ((), {})
    return dataset, FederationSetUp(cuts, time_scale, setups, plan, counted, notes, recalibration, fallbacks)


def _simulation_key(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` without what does not change the data or the set-up (so that one cache entry serves a run); the
    last few configs' keys are kept by identity (a run's messages share one parsed config object)."""
    kept = _SIMULATION_KEYS.get(id(cfg))
    if kept is not None and kept[0] is cfg:
        return kept[1]
    key = replace(cfg, output_dir="", resume_from="", debug=replace(cfg.debug, fail_site="", stop_after_round=0),
                  federation=replace(cfg.federation, timeout_s=0.0), server_evaluation=False,
                  centralized_baseline=False)
    if len(_SIMULATION_KEYS) >= 16:
        _SIMULATION_KEYS.clear()
    _SIMULATION_KEYS[id(cfg)] = (cfg, key)
    return key


#: :func:`_simulation_key`'s recent results: id(cfg) -> (cfg, key) (the config is held, so its id is not reused).
_SIMULATION_KEYS: dict[int, tuple[ExperimentConfig, ExperimentConfig]] = {}


def load_federation(cfg: ExperimentConfig) -> FederatedDataset:
    """The federated data set of a run (deterministic in ``cfg.seed``; memoised per process).

    The cache holds immutable arrays only, so a process that serves several simulated sites
    (a Ray actor) loads and preprocesses the data once instead of once per message.
    """
    return _simulation(_simulation_key(cfg))[0]


def federation_setup(cfg: ExperimentConfig) -> FederationSetUp:
    """What the simulated sites agreed before training (:class:`FederationSetUp`; memoised with the data)."""
    return _simulation(_simulation_key(cfg))[1]


def build_model(cfg: ExperimentConfig, dataset: FederatedDataset) -> SurvivalModel:
    """The run's survival model on the federation's agreed time grid (and CoxTime time scale).

    The grid (discrete-time intervals for the hazard model, the Breslow grid for Cox models) is
    shared by all sites, like the model architecture. The hazard model starts at the set-up's
    Kaplan–Meier hazard (:func:`baseline_hazard`).
    """
    setup = federation_setup(cfg)
    choice = model_choice(cfg, {name: agreed.count for name, agreed in setup.setups.items()}, dataset.in_features)
    return build_network(chosen_config(cfg, choice), in_features=dataset.in_features, cuts=setup.cuts,
                         time_scale=setup.time_scale, baseline_hazard=baseline_hazard(cfg, setup.cuts,
                                                                                      setup.time_counts))


def model_choice(cfg: ExperimentConfig, counts: Mapping[object, float], in_features: int) -> ModelChoice | None:
    """What ``model.name = "auto"`` trains (:func:`strategies.model_choice.choose_model`) from the set-up's public
    quantities: the agreed record ``counts`` (site -> count; a private set-up's noisy released counts) and the
    agreed preprocessing's ``in_features``; None when the run config fixes ``model.hidden``.

    Deterministic in its inputs, which the server and (in simulation) every site hold alike; a deployed site
    receives the chosen widths with its set-up (:attr:`SiteSpec.hidden`)."""
    if cfg.model.hidden is not None or cfg.model.name not in DEFAULT_HIDDEN:
        return None
    return choose_model(sorted(counts.values()), in_features, cfg.privacy.epsilon, cfg.strategy,
                        num_durations=cfg.model.num_durations, risk_layer=cfg.model.risk_layer)


def chosen_config(cfg: ExperimentConfig, choice: ModelChoice | None) -> ExperimentConfig:
    """``cfg`` with ``model.name`` and ``model.hidden`` of ``choice`` (``cfg`` itself when None): the
    configuration the network is built from and saved with (:func:`models.predict.load_run` rebuilds it)."""
    if choice is None:
        return cfg
    return replace(cfg, model=replace(cfg.model, name=choice.name, hidden=choice.hidden))


def baseline_hazard(cfg: ExperimentConfig, cuts: np.ndarray,
                    counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """The hazard model's starting hazard per interval: :func:`models.time_grid.interval_hazard` of the
    set-up's time ``counts`` on ``cuts`` (a private set-up's histogram: the curve of
    :func:`models.time_grid.histogram_survival` at the cuts, which follow the histogram's events; a cell
    where the denoised histogram holds no event starts at the smallest hazard the model takes).

    Post-processing of what the set-up released (a private set-up's noisy time histogram; an exact
    set-up's pooled times), so it costs no privacy. None for the Cox models (their baseline is the
    Breslow estimator) and when there are no counts or no event among them (the data-independent start).
    """
    if cfg.model.name != "hazard_mlp" or counts is None or not np.sum(counts[1]) > 0:
        return None
    if uses_private_setup(cfg):  # counts per interval of a histogram: its curve, linear within intervals
        points, events, censored = counts
        surv = histogram_survival(np.concatenate(([0.0], points)), events, censored, cuts)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.clip(1.0 - surv / np.concatenate(([1.0], surv[:-1])), 0.0, 1.0)
    return interval_hazard(*counts, cuts)


def build_network(
    cfg: ExperimentConfig, *, in_features: int, cuts: np.ndarray, time_scale: tuple[float, float],
    baseline_hazard: np.ndarray | None = None,
) -> SurvivalModel:
    """The run's survival model for ``in_features`` inputs on the time grid ``cuts``.

    ``time_scale`` is the mean and standard deviation of the training times (CoxTime's time input);
    ``baseline_hazard``: the hazard model's start (:func:`models.survival.build_survival_model`).
    """
    return build_survival_model(
        cfg.model.name,
        in_features=in_features,
        cuts=cuts,
        hidden=cfg.model.hidden,
        dropout=cfg.model.dropout,
        activation=cfg.model.activation,
        penalty=cfg.model.penalty,
        time_scale=time_scale,
        baseline_hazard=baseline_hazard,
        risk_layer=cfg.model.risk_layer,
        seed=cfg.seed,
    )


@dataclass(frozen=True)
class SiteSpec:
    """What a deployment's server sends every site before training: the shared preprocessing
    (fitted from the sites' summed feature statistics), the time grid (from their summed time
    histograms) and the training times' mean and standard deviation (from their summed sums)."""

    preprocessor: Preprocessor
    cuts: np.ndarray
    time_scale: tuple[float, float]
    #: ``model.name = "auto"``: the hidden widths chosen from the set-up (:func:`with_model_choice`); None otherwise.
    hidden: tuple[int, ...] | None = None

    def to_json(self) -> str:
        return json.dumps({"preprocessor": self.preprocessor.to_dict(), "cuts": self.cuts.tolist(),
                           "time_scale": list(self.time_scale),
                           "hidden": None if self.hidden is None else list(self.hidden)})

    @classmethod
    def from_json(cls, text: str) -> SiteSpec:
        payload = json.loads(text)
        hidden = payload.get("hidden")
        return cls(Preprocessor.from_dict(payload["preprocessor"]), np.asarray(payload["cuts"], dtype=np.float64),
                   (float(payload["time_scale"][0]), float(payload["time_scale"][1])),
                   None if hidden is None else tuple(int(width) for width in hidden))


def with_model_choice(cfg: ExperimentConfig, spec: SiteSpec, counts: Mapping[object, float]) -> SiteSpec:
    """``spec`` with the widths ``model.name = "auto"`` chose from the agreed ``counts`` and ``spec``'s
    preprocessing (:func:`model_choice`); ``spec`` itself when the run config fixes them."""
    choice = model_choice(cfg, counts, len(spec.preprocessor.feature_names))
    return spec if choice is None else replace(spec, hidden=choice.hidden)


def run_spec(cfg: ExperimentConfig, dataset: FederatedDataset) -> SiteSpec:
    """A simulation's agreed preprocessing, time grid, time scale and (``model.name = "auto"``) chosen widths (a
    deployment's is the one it sent the sites).

    With a differentially private set-up it is the agreed noisy preprocessing: the one the model was trained on.
    """
    setup = federation_setup(cfg)
    return with_model_choice(cfg, SiteSpec(dataset.preprocessor, setup.cuts, setup.time_scale),
                             {name: agreed.count for name, agreed in setup.setups.items()})


def preprocessing(cfg: ExperimentConfig, spec: SiteSpec) -> dict[str, object]:
    """What a run saves beside its model (``preprocessing.json``, read by :func:`models.predict.load_run`)."""
    setup = ("differentially private: the noisy statistics the federation agreed (privacy.setup_share), "
             "on which the model was trained" if uses_private_setup(cfg) else "exact")
    from models.predict import preprocessing_payload

    return preprocessing_payload(spec.preprocessor, cuts=spec.cuts, time_scale=spec.time_scale, setup=setup,
                                 id_col=cfg.data.id_col,
                                 outcome=outcome_columns(cfg.data.name, cfg.data.time_col, cfg.data.event_col),
                                 event_values=cfg.data.event_values)


def model_from_spec(cfg: ExperimentConfig, spec: SiteSpec) -> SurvivalModel:
    """The run's survival model in a deployment (the same network at the server and every site).

    With ``model.name = "auto"`` its widths are the set-up's :attr:`SiteSpec.hidden`, which must be one of
    :data:`strategies.model_choice.CANDIDATES` (none changes what a site releases: its noise and clipping come from
    its own run config); a run config that fixes ``model.hidden`` refuses other widths. ``ValueError`` naming the
    key otherwise."""
    return build_network(spec_config(cfg, spec), in_features=len(spec.preprocessor.feature_names), cuts=spec.cuts,
                         time_scale=spec.time_scale)


def spec_config(cfg: ExperimentConfig, spec: SiteSpec) -> ExperimentConfig:
    """``cfg`` with the architecture of ``spec`` (:func:`model_from_spec`'s checks)."""
    if cfg.model.hidden is not None or cfg.model.name not in DEFAULT_HIDDEN:
        if spec.hidden is not None and spec.hidden != cfg.model.hidden:
            raise ValueError(f"set-up refused: it names model.hidden = {list(spec.hidden)}, but this run config "
                             f"fixes model.hidden = {list(cfg.model.hidden or ())} (model.name = {cfg.model.name!r})")
        return cfg
    if spec.hidden is None or (cfg.model.name, spec.hidden) not in CANDIDATES:
        raise ValueError(f"set-up refused: model.name = 'auto' needs the widths chosen at set-up, one of "
                         f"{[list(hidden) for _, hidden in CANDIDATES]}; it names "
                         f"{None if spec.hidden is None else list(spec.hidden)} (server and site of other versions?)")
    return replace(cfg, model=replace(cfg.model, hidden=spec.hidden))


def load_site_table(cfg: ExperimentConfig, path: str, *, notes: bool = True) -> RawTable:
    """A deployed site's own file (CSV or Parquet), validated like ``data.name = "csv"``.

    Outcome columns ``data.time_col`` and ``data.event_col`` ("" = ``time``, ``event``), features
    ``data.feature_cols`` ("" = every other column but ``data.id_col``, ``data.drop_cols`` and
    ``data.split_col``); errors name the file, the column and the rows. A column that looks like a
    record identifier is refused here, before anything derived from the file leaves the site.
    ``notes``: log the notes on integer-coded columns (:func:`models.data.load_table`).
    """
    return load_table("csv", path=path, time_col=cfg.data.time_col, event_col=cfg.data.event_col,
                      feature_cols=cfg.data.feature_cols, roles=column_roles(cfg), notes=notes)


def evaluate(model: SurvivalModel, test: SurvivalArrays, *, concordance_td: bool = True,
             predictions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict[str, float]:
    """Test metrics of ``model`` on the held-out records ``test``, computed from them alone.

    The IPCW censoring distribution (IBS, INBLL) is the Kaplan–Meier estimate of the held-out
    records' own censoring, and the evaluation grid comes from their times (fedsurv's one
    convention, :mod:`models.metrics`): a site's figures depend on the global model and its
    held-out records only, never on its training records. ``predictions``: the model's ``(times, survival,
    risk)`` on ``test`` where the caller has them already.
    """
    from models.metrics import evaluate_survival  # scikit-survival: imported by the messages that evaluate

    times, surv, risk = predictions if predictions is not None else model.predict(test.x)
    return evaluate_survival(times, surv, time=test.time, event=test.event, risk=risk, concordance_td=concordance_td)


def undefined_metrics(model: SurvivalModel, test: SurvivalArrays, metrics: Mapping[str, float], *,
                      concordance_td: bool = True) -> dict[str, str]:
    """Why each NaN metric of :func:`evaluate` on ``test`` is undefined: metric -> code of
    :data:`models.metrics.UNDEFINED_REASONS` (what a site sends beside its metrics)."""
    from models.metrics import undefined_reasons

    _, surv, risk = model.predict(test.x)
    finite = bool(np.isfinite(surv).all() and np.isfinite(risk).all())
    return undefined_reasons(dict(metrics), time=test.time, event=test.event, finite=finite,
                             concordance_td=concordance_td)


def evaluate_with_reasons(model: SurvivalModel, test: SurvivalArrays, *,
                          concordance_td: bool = True) -> tuple[dict[str, float], dict[str, str]]:
    """:func:`evaluate` and :func:`undefined_metrics` of ``model`` on ``test`` together, predicting once
    (what a site's evaluation reply carries)."""
    from models.metrics import undefined_reasons

    times, surv, risk = model.predict(test.x)
    metrics = evaluate(model, test, concordance_td=concordance_td, predictions=(times, surv, risk))
    finite = bool(np.isfinite(surv).all() and np.isfinite(risk).all())
    return metrics, undefined_reasons(dict(metrics), time=test.time, event=test.event, finite=finite,
                                      concordance_td=concordance_td)


#: Levels of the follow-up quantiles at which :func:`calibration` compares curves with Kaplan–Meier.
FOLLOW_UP_LEVELS = (0.25, 0.5, 0.75)


def calibration(model: SurvivalModel, dataset: FederatedDataset) -> dict[str, object]:
    """Mean predicted survival vs Kaplan–Meier (95% CI) on the pooled test split and each site's.

    Horizons: the quartiles (:data:`FOLLOW_UP_LEVELS`) of the pooled *training* follow-up times
    (every record's observed time, event or censoring), so the test split enters only the
    Kaplan–Meier side. ``median_gap`` is |mean predicted − Kaplan–Meier| of the pooled test split
    at the median follow-up; ``ibs_km_null`` is the IBS of the covariate-free pooled training
    Kaplan–Meier curve on the pooled test split, scored as :func:`evaluate` scores the model (the
    bar a useful model's IBS is below). Simulation only: it needs the pooled records.
    """
    from models.metrics import calibration_table, evaluate_survival, kaplan_meier_curves

    train, test = dataset.pooled("train"), dataset.pooled("test")
    horizons = np.quantile(train.time, FOLLOW_UP_LEVELS)
    parts = [("pooled test", test)] + [(site.name, site.test) for site in dataset.sites]
    tables = {}
    for name, part in parts:
        times, surv = model.predict_survival(part.x)
        tables[name] = calibration_table(times, surv, time=part.time, event=part.event,
                                         horizons=horizons).to_dict("records")
    median = tables["pooled test"][FOLLOW_UP_LEVELS.index(0.5)]
    km_times, km_surv = kaplan_meier_curves(train.time, train.event, len(test))
    null = evaluate_survival(km_times, km_surv, time=test.time, event=test.event, risk=np.zeros(len(test)),
                             concordance_td=False)
    return {"horizons": "quartiles of the pooled training follow-up times", "median_gap":
            abs(median["predicted"] - median["km"]), "ibs_km_null": null["ibs"], "tables": tables}


def round_seed(seed: int, server_round: int, site_index: int) -> int:
    """The training seed of one simulated site in one round (independent streams per site and round)."""
    return int(np.random.SeedSequence([seed, server_round, site_index]).generate_state(1)[0])


def site_seed(cfg: ExperimentConfig, server_round: int, site_index: int) -> int:
    """The seed of everything random in a site's round: batches, dropout and the privacy noise.

    Simulation: :func:`round_seed` of the run's seed, so that runs are reproducible (and the noise is
    known to anyone who knows the seed, as the ledger says). Deployment: 63 bits of the site's
    operating-system entropy (``secrets``), drawn afresh for every round and never derived from
    anything the server sends, so nobody can reproduce the noise.
    """
    if cfg.data.deployed:
        return secrets.randbits(63)
    return round_seed(cfg.seed, server_round, site_index)


def train_centralized(cfg: ExperimentConfig, dataset: FederatedDataset) -> dict[str, object]:
    """The centralised baseline: the same model, initialisation and mechanism on the pooled data.

    It makes ``federation.rounds`` rounds of the run's mechanism as one site holding every
    training record (``train.local_epochs`` epochs each: as many passes as every record gets in
    the federation), with the same seeds, and is evaluated on the same test split (``"test"``: ``{}`` when
    the sites hold out none, :func:`~strategies.horizontal.holds_test_part`). For a record-level DP
    mechanism it adds that mechanism's noise for the same target; client-level
    central DP has no centralised counterpart and the weight-perturbation strategies' paper
    compares with the no-DP model, so those baselines train without DP.

    Whatever mechanism ran, the baseline is **not private**: the pooled records are the same
    records the federation trained on, so its release composes with the federation's, and it needs
    the pooled data at one place. It is a simulation reference and labelled so.
    """
    model = build_model(cfg, dataset)
    train = dataset.pooled("train")
    torch.set_num_threads(cfg.train.num_threads)
    mechanism = horizontal_mechanism(cfg.strategy)
    if not mechanism.pooled_baseline:
        mechanism = NoPrivacy()
    setup = SiteSetUp(count=float(len(train)), min_count=float(len(train)))
    state, report = None, {}
    for server_round in range(1, cfg.federation.rounds + 1):
        update = mechanism.site_round(model, train, cfg, seed=round_seed(cfg.seed, server_round, dataset.num_sites),
                                      state=state, setup=setup)
        state, report = update.state, update.report
    if model.needs_baseline:
        model.set_baseline(*model.breslow_aggregates(train.x, train.time, train.event))
    result: dict[str, object] = {
        "label": CENTRALIZED_LABEL,
        "epochs": cfg.federation.rounds * cfg.train.local_epochs,
        "privacy": ({"mechanism": mechanism.name, **{key: float(value) for key, value in report.items()}}
                    if mechanism.private else "none (no DP)"),
        "test": evaluate(model, dataset.pooled("test")) if holds_test_part(cfg.data) else {},
    }
    if any(site.oot is not None and len(site.oot) for site in dataset.sites):
        result["oot"] = evaluate(model, dataset.pooled("oot"))
    return result
