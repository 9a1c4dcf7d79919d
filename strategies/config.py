"""The run configuration: one schema, typed frozen dataclasses, parsed once at the edge.

Every run-config key (``data.name``, ``privacy.epsilon``, ...) is a field of the dataclasses below,
and the field's metadata (:class:`Setting`) carries its default, its choices or bounds and its help
text. That is the single source: ``pyproject.toml``'s ``[tool.flwr.app.config]`` table, Hydra's
``conf/`` tree and ``docs/configuration.md`` are generated from it (``python -m flwr_app.config
--write``) and a test fails when one of them differs. The defaults that depend on a chosen group
option (a model's ``num_durations``, a data set's test share, a strategy's model and adjacency)
are the tables :data:`DATA_SETS`, :data:`MODELS` and :data:`STRATEGIES`; such a key's default is
``"auto"``, so that ``flwr run --run-config "model.name='cox_mlp'"`` and Hydra's ``model=cox_mlp``
give the same values.

:func:`parse_flat` reads a flat mapping of those keys into an :class:`ExperimentConfig`: types,
choices, bounds (NaN and infinities refused per key), the ``auto`` defaults and the rules that
pair keys (strategy, model and data set; deployments; injected failures). It imports neither
torch nor Flower. :func:`flwr_app.config.parse_run_config` adds the checks of the strategy's
privacy mechanism (:mod:`strategies.mechanisms.registry`, the one place a strategy name is
dispatched). Everything else (the mechanisms, the ServerApp and ClientApp, the simulations)
receives an :class:`ExperimentConfig` instead of a Flower ``Context`` or a Hydra ``DictConfig``.
The types live here, below ``flwr_app``, so that the mechanisms can take them without importing
Flower apps.
"""

from __future__ import annotations

import fnmatch
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

#: ``data.name`` of a deployment: every site reads its own file (node config ``data-path``); in a
#: vertical run the label holder reads ``data.labels_path``.
DEPLOYED_DATA = "site_files"
#: ``data.name`` of a user's own vertical data in simulation: a labels file (``data.labels_path``) and one file per
#: modality (``data.modality_paths``), as a vertical deployment's parties hold them.
VERTICAL_FILES = "vertical_files"
#: How every output labels a centralised baseline: it trains again on the federation's records, pooled at one place.
CENTRALIZED_LABEL = "not private, simulation reference"
#: The value of a key whose default is the chosen group option's (or the model kind's).
AUTO = "auto"


class ConfigError(ValueError):
    """A run-config key is unknown, has the wrong type or an invalid value."""


# ------------------------------------------------------------------ group options and their defaults


@dataclass(frozen=True)
class DataSet:
    """A ``data.name`` option: where it may be used and the defaults it brings."""

    help: str
    horizontal: bool = True
    vertical: bool = False
    test_fraction: float = 0.2


@dataclass(frozen=True)
class Model:
    """A ``model.name`` option: its kind and the ``model.num_durations`` it brings."""

    help: str
    vertical: bool
    num_durations: int


@dataclass(frozen=True)
class Strategy:
    """A ``strategy.name`` option: its kind and the defaults it brings.

    ``adjacency`` is what ``privacy.adjacency = "auto"`` resolves to: the first adjacency the
    strategy's mechanism offers (a test keeps it equal to the registry's). ``accountant`` is what
    ``privacy.accountant = "auto"`` resolves to: the tightest sound accountant of the mechanism
    (the first of its ``accountants``, a test keeps them equal). A vertical strategy trains
    :data:`DEFAULT_MODEL` ``["vertical"]`` when ``model.name = "auto"``.
    """

    help: str
    vertical: bool
    adjacency: str
    accountant: str = "rdp"
    recipe: Mapping[str, Any] = field(default_factory=dict)


#: What the training keys whose default is ``auto`` take when the strategy's :attr:`Strategy.recipe` does not set
#: them.
TRAINING_DEFAULTS: Mapping[str, Any] = {
    "train.local_epochs": 1, "train.batch_size": 128, "train.lr": 0.003, "privacy.clip_norm": 1.0,
    "federation.rounds": 20, "split.risk_layer": "proportional", "privacy.setup_share": 0.0,
    "model.risk_layer": "interval",
}
#: The DP-SGD recipe of dp_sgd and bdp: chosen on validation splits of public data sets that no result reports
#: (METABRIC, GBSG, WHAS; ``docs/privacy-methods.md``, "The DP training recipe"); the proportional risk layer on
#: validation splits of FLCHAIN, METABRIC, GBSG, WHAS and SBA (``benchmarks/risk_layer.py``).
DP_SGD_RECIPE: Mapping[str, Any] = {"train.local_epochs": 3, "train.batch_size": 512, "train.lr": 0.01,
                                    "privacy.clip_norm": 5.0, "privacy.setup_share": 0.3,
                                    "model.risk_layer": "proportional"}
#: privacy.setup_share of the recipes with a private set-up: chosen for dp_sgd through the apps on validation splits of
#: FLCHAIN, METABRIC, GBSG and WHAS (``benchmarks/setup_share.py``: 0.3 ranks first of 0.1, 0.2, 0.3, 0.45); taken
#: as it is by bdp and distributed_dp; private_split keeps the 0.2 its measurements were made at.


#: The recipe of distributed_dp (one full-batch step on the union per round): 60 rounds chosen on a validation split of
#: the SBA training records; the clip norm and learning rate through the apps on validation splits of FLCHAIN,
#: METABRIC, GBSG and WHAS (``benchmarks/distributed_recipe.py``; ``docs/privacy-methods.md``, "Distributed DP over
#: secure aggregation"); the proportional risk layer on validation splits of FLCHAIN, METABRIC, GBSG, WHAS and SBA
#: (``benchmarks/risk_layer.py``), where the clip norm and learning rate were checked again and kept.
DISTRIBUTED_DP_RECIPE: Mapping[str, Any] = {"federation.rounds": 60, "train.lr": 0.01, "privacy.clip_norm": 10.0,
                                            "privacy.setup_share": 0.3, "model.risk_layer": "proportional"}


#: The recipe of split (epochs of the no-DP split model), chosen with the ``split.*`` defaults on validation parts
#: of the training records of every vertical data set (``benchmarks/split_recipe.py``).
SPLIT_RECIPE: Mapping[str, Any] = {"federation.rounds": 40}


#: The recipe of private_split: the label holder's head trains for ``federation.rounds`` epochs on the cached releases
#: (post-processing, no privacy cost); the release clip norm and ``split.fit_share`` were chosen on validation splits
#: (``benchmarks/private_split.py select``); the head's risk layer is the default proportional one, chosen on
#: selection samples of 120 records (``benchmarks/small_cohort.py select``) and within 0.006 of the per-interval
#: layer on the validation splits of the full data.
PRIVATE_SPLIT_RECIPE: Mapping[str, Any] = {"federation.rounds": 50, "train.lr": 0.01, "train.batch_size": 256,
                                           "privacy.clip_norm": 0.25, "privacy.setup_share": 0.2}


def _recipe_auto(key: str) -> str:
    """The ``auto`` text of a training key: the recipes' values and the default's."""
    recipes = (("dp_sgd and bdp", DP_SGD_RECIPE), ("distributed_dp", DISTRIBUTED_DP_RECIPE), ("split", SPLIT_RECIPE),
               ("private_split", PRIVATE_SPLIT_RECIPE))
    return "; ".join([f"{names}: {_text(recipe[key])}" for names, recipe in recipes if key in recipe]
                     + [f"otherwise {_text(TRAINING_DEFAULTS[key])}"])


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


#: ``data.name`` options (the loaders in :mod:`models.data`; a test keeps the names equal to theirs).
DATA_SETS: Mapping[str, DataSet] = {
    "flchain": DataSet("scikit-survival's FLCHAIN cohort (serum free light chain, 7,874 records)"),
    "metabric": DataSet("METABRIC breast cancer (DeepSurv's CSV); split: genomic x0-x3 | clinical x4-x8",
                        vertical=True),
    "gbsg": DataSet("GBSG breast cancer (DeepSurv's CSV)"),
    "whas": DataSet("Worcester Heart Attack Study (DeepSurv's CSV)"),
    "sba": DataSet("SBA 7(a) loans: time to charge-off within data.horizon_months; approvals from data.oot_start on "
                   "are the out-of-time set; natural sites State, region or division"),
    "sim_cox": DataSet("the simulated Cox data of Niu et al. (LS-ADP / ROW-DP), 50,000 records, split 70/30",
                       test_fraction=0.3),
    "csv": DataSet("any CSV or Parquet file: data.path, data.time_col, data.event_col"),
    "breast_cancer": DataSet("scikit-survival's breast-cancer cohort as two modalities (76 genes | clinical)",
                             horizontal=False, vertical=True),
    "synthetic_multimodal": DataSet("three simulated modalities (a, b, c) whose hazard needs all three",
                                    horizontal=False, vertical=True),
    VERTICAL_FILES: DataSet("your own vertical data: one CSV or Parquet file per modality (data.modality_paths) and "
                            "a labels file (data.labels_path), joined on data.id_col; one simulated site per modality",
                            horizontal=False, vertical=True),
    DEPLOYED_DATA: DataSet("a deployment: every site reads its own file (node config data-path)", vertical=True),
}
#: ``model.name`` options (the networks of :mod:`models.survival` and :mod:`models.multimodal`).
MODELS: Mapping[str, Model] = {
    "hazard_mlp": Model("discrete-time logistic hazard network", vertical=False, num_durations=20),
    "cox_mlp": Model("Cox-MLP (DeepSurv-style), Breslow baseline on a grid of 100 event-time quantiles",
                     vertical=False, num_durations=100),
    "cox_time": Model("Cox-Time (time-dependent relative risk), Breslow baseline on 100 quantiles",
                      vertical=False, num_durations=100),
    "bayesian_multisurv": Model("BVFLMSP's Bayesian multimodal network: encoders at the sites, fusion head at the "
                                "server; the paper's 30 intervals", vertical=True, num_durations=30),
    "multisurv": Model("MultiSurv: the same multimodal architecture with deterministic layers", vertical=True,
                       num_durations=30),
    "coxph": Model("Cox proportional-hazards regression (cox.*): fedavg, federated Newton-Raphson on the sites' exact "
                   "sums, Breslow baseline for predictions on 100 event-time quantiles; dp_sgd / distributed_dp, the "
                   "private grouped-time PH model on cox.grid points of the set-up's time grid (models.grouped_cox: "
                   "noisy counts, score steps and information; no predictions)",
                   vertical=False, num_durations=100),
}
#: The model that is fitted by Newton-Raphson on the sites' sums (:mod:`flwr_app.cox_server`), not trained by FedAvg.
COXPH = "coxph"
#: ``strategy.name`` options (the registry :mod:`strategies.mechanisms.registry` dispatches them;
#: a test keeps the names, kinds and adjacencies equal to its mechanisms').
STRATEGIES: Mapping[str, Strategy] = {
    "fedavg": Strategy("FedAvg without differential privacy", vertical=False, adjacency="add-remove"),
    "dp_sgd": Strategy("record-level DP-SGD at every site (hazard_mlp; coxph: every site adds the full noise to its "
                       "grouped-Cox releases)", vertical=False, adjacency="add-remove", accountant="pld",
                       recipe=DP_SGD_RECIPE),
    "bdp": Strategy("Bayesian DP (FSL-BDP) at every site (hazard_mlp)", vertical=False, adjacency="add-remove",
                    recipe=DP_SGD_RECIPE),
    "distributed_dp": Strategy("record-level DP on the union: one noisy gradient step per round, discrete Gaussian "
                               "noise split across the sites, summed through SecAgg+ (hazard_mlp; coxph: the grouped-Cox "
                               "releases summed so)", vertical=False,
                               adjacency="add-remove", recipe=DISTRIBUTED_DP_RECIPE),
    "central_dp": Strategy("Flower's client-level DP at the server (a whole site is protected)", vertical=False,
                           adjacency="add-remove", accountant="pld"),
    "nbafl": Strategy("NbAFL (Wei et al. 2020): weights clipped and perturbed before upload", vertical=False,
                      adjacency="replace-one"),
    "ls_adp": Strategy("LS-ADP (Niu et al. 2025): NbAFL noise with per-layer budgets from layer sensitivity",
                       vertical=False, adjacency="replace-one"),
    "row_dp": Strategy("ROW-DP (Niu et al. 2025): one random layer gets per-weight budgets (privacy.dispersion)",
                       vertical=False, adjacency="replace-one"),
    "split": Strategy("vertical split learning (BVFLMSP): one site per modality, labels and fusion head at the "
                      "server; with a finite privacy.epsilon each site clips and noises its embeddings",
                      vertical=True, adjacency="replace-one", recipe=SPLIT_RECIPE),
    "private_split": Strategy("vertical learning with complete record-level DP: each site fits its preprocessing "
                              "and encoder privately and releases each record's embedding once (clipped, noised); "
                              "the label holder trains its head on the cached releases", vertical=True,
                              adjacency="replace-one", recipe=PRIVATE_SPLIT_RECIPE),
}
#: What ``model.name = "auto"`` trains, by the strategy's kind.
DEFAULT_MODEL: Mapping[str, str] = {"horizontal": "hazard_mlp", "vertical": "bayesian_multisurv"}
#: ``model.hidden = "auto"`` with an explicit ``model.name`` (the networks' defaults, :mod:`models.survival`); with
#: ``model.name = "auto"`` it stays ``None`` in the parsed config: the widths are chosen after the set-up
#: (:func:`strategies.model_choice.choose_model`).
DEFAULT_HIDDEN: Mapping[str, tuple[int, ...]] = {"hazard_mlp": (128, 64, 64, 32, 32), "cox_mlp": (32, 32),
                                                 "cox_time": (32, 32)}
#: Hydra-only presets of the ``privacy`` group (``privacy=dp``): values they set over the defaults.
PRIVACY_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "none": {},
    "dp": {"epsilon": 1.0},
}

HORIZONTAL_DATASETS = tuple(name for name, data in DATA_SETS.items() if data.horizontal and name != DEPLOYED_DATA)
VERTICAL_DATASETS = tuple(name for name, data in DATA_SETS.items() if data.vertical and name != DEPLOYED_DATA)
HORIZONTAL_MODELS = tuple(name for name, model in MODELS.items() if not model.vertical)
VERTICAL_MODELS = tuple(name for name, model in MODELS.items() if model.vertical)
#: ``federation.update_bound``'s default (a mechanism or aggregator that ignores the key refuses any other value):
#: chosen on validation splits of honest heterogeneous federations and attacked ones (``benchmarks/robust_default.py``).
DEFAULT_UPDATE_BOUND = 1.0
#: An update farther than this many median distances from the sites' coordinate-wise median stands out: its site is
#: flagged (never failed: heterogeneous sites are normal) and named when its round is rolled back. Being bounded
#: (``federation.update_bound``, smaller) names nobody.
OUTLIER_SPREAD = 5.0
#: Robust aggregators offered (``federation.aggregation``), all Flower's own (:mod:`strategies.horizontal`).
AGGREGATIONS: tuple[str, ...] = ("fedavg", "trimmed_mean", "median", "krum")


@dataclass(frozen=True)
class ServerOptimizerOption:
    """A ``federation.server_optimizer`` option: Flower's strategy that turns a round's aggregate into the new model.

    ``flower_class`` names the strategy of :mod:`flwr.serverapp.strategy` ("" for the aggregate as it
    is); ``lr`` and ``momentum`` name its constructor's parameters that ``federation.server_lr`` and
    ``federation.server_momentum`` set ("" where it has none); ``lr_default`` and ``momentum_default`` are what
    ``auto`` gives them, in place of Flower's defaults (:data:`SERVER_OPTIMIZERS`: chosen on validation splits).
    """

    help: str
    flower_class: str = ""
    lr: str = ""
    momentum: str = ""
    lr_default: float | None = None
    momentum_default: float | None = None


#: ``federation.server_optimizer`` -> Flower's server optimiser (:mod:`strategies.server_optimizers` builds it).
#: The defaults of ``federation.server_lr`` and ``federation.server_momentum`` (``auto``) were chosen without DP
#: on validation splits of the training records of SBA's 4 census regions and 40 states
#: (``benchmarks/server_optimizers.py``; ``docs/results/server_optimizers.md``): the grid on seeds 0-1, each
#: optimiser's two best settings and FedAvg again on seeds 2-3, the best mean validation C over the four seeds:
#: FedAdam eta 0.1 (Flower's), FedYogi 0.03 (Flower's 0.01), FedAdagrad 0.03 (Flower's 0.1), FedAvgM learning
#: rate 1 with momentum 0.7 (Flower's momentum 0 would make it FedAvg). FedAdam's and FedYogi's beta_1 (0.9),
#: beta_2 and tau stay Flower's (not searched).
SERVER_OPTIMIZERS: Mapping[str, ServerOptimizerOption] = {
    "fedavg": ServerOptimizerOption("the aggregate is the new global model"),
    "fedadam": ServerOptimizerOption("Adam on the pseudo-gradient (aggregate - global model)", "FedAdam", "eta", "beta_1",
                                     lr_default=0.1),
    "fedyogi": ServerOptimizerOption("Yogi on the pseudo-gradient", "FedYogi", "eta", "beta_1", lr_default=0.03),
    "fedadagrad": ServerOptimizerOption("Adagrad on the pseudo-gradient", "FedAdagrad", "eta", lr_default=0.03),
    "fedavgm": ServerOptimizerOption("SGD with heavy-ball momentum on the pseudo-gradient", "FedAvgM",
                                     "server_learning_rate", "server_momentum", lr_default=1.0, momentum_default=0.7),
}


def _server_optimizer_auto(attribute: str) -> str:
    """The ``auto`` text of ``federation.server_lr`` (``lr``) or ``federation.server_momentum`` (``momentum``)."""
    chosen = ", ".join(f"{name} {_text(getattr(option, attribute + '_default'))}"
                       for name, option in SERVER_OPTIMIZERS.items()
                       if getattr(option, attribute) and getattr(option, attribute + "_default") is not None)
    flower = "fedadam and fedyogi 0.9 (Flower's); " if attribute == "momentum" else ""
    return f"{flower}{chosen} (chosen on validation splits of SBA regions and states: benchmarks/server_optimizers.py)"


#: Budget allocations of the weight-perturbation strategies: the paper's nominal rule, or the exact-budget variant.
ALLOCATIONS: tuple[str, ...] = ("paper", "exact")
#: Dispersion measures of ROW-DP (:func:`strategies.mechanisms.adaptive_dp.dispersion`).
DISPERSION_MEASURES: tuple[str, ...] = ("var", "std", "range", "iqr", "mae")
#: Hostile replies of an injected failure (:mod:`flwr_app.faults`).
HOSTILE_MODES: tuple[str, ...] = ("nan_weights", "wrong_shape", "inflated_count", "forged_epsilon", "spoofed_name",
                                  "forged_metrics", "poisoned_update")


# ------------------------------------------------------------------ one key: default, choices, bounds, help


@dataclass(frozen=True)
class Bounds:
    """The interval a number must lie in (``high = inf``: no upper bound)."""

    low: float
    high: float = math.inf
    low_closed: bool = False
    high_closed: bool = False

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = math.isinf(self.high) or (value <= self.high if self.high_closed else value < self.high)
        return above and below

    def __str__(self) -> str:
        if math.isinf(self.high):
            return f"{'>=' if self.low_closed else '>'} {self.low:g}"
        return f"in {'[' if self.low_closed else '('}{self.low:g}, {self.high:g}{']' if self.high_closed else ')'}"


POSITIVE = Bounds(0.0)
NON_NEGATIVE = Bounds(0.0, low_closed=True)
FRACTION = Bounds(0.0, 1.0)


@dataclass(frozen=True)
class Setting:
    """A run-config key: what a field of the schema carries in its metadata.

    ``default`` is the value of ``pyproject.toml`` and Hydra's ``conf/`` (TOML-able: a list's
    default is a comma-separated string); ``auto`` says what the value ``"auto"`` means when the
    key accepts it; ``infinite`` what ``inf`` means when it is allowed.
    """

    default: Any
    help: str
    choices: tuple[str, ...] = ()
    bounds: Bounds | None = None
    auto: str = ""
    infinite: str = ""
    key: str = ""


def setting(default: Any, help: str, *, choices: tuple[str, ...] = (), bounds: Bounds | None = None,
            auto: str = "", infinite: str = "", key: str = "") -> Any:
    """A dataclass field carrying its :class:`Setting` (``key``: the run-config key if not ``group.field``)."""
    return field(metadata={"setting": Setting(default, help, choices, bounds, auto, infinite, key)})


#: ``simulation.engine``'s values.
ENGINES = (AUTO, "ray", "inprocess")
#: ``simulation.engine = auto`` runs a federation of up to this many sites over the in-process grid, a larger one on
#: Ray (measured: docs/howto/experiments.md, "Which engine").
INPROCESS_MAX_SITES = 1000
#: The in-process engine runs a federation of at least this many sites in this process and in worker processes,
#: one per further CPU (``simulations.inprocess.site_processes``); a smaller one in this process only, where a
#: worker's start (its imports, then the site data: seconds) would cost more than it saves.
PARALLEL_MIN_SITES = 100


# ------------------------------------------------------------------ the schema


@dataclass(frozen=True)
class DataConfig:
    """Which data set, where it lives and how it is split.

    ``id_col`` names the record ID column (never a feature; the join key of vertical data),
    ``drop_cols`` columns that are not features, and ``split_col`` a column of train/test labels
    that replaces the random split.
    """

    name: str = setting("flchain", "the data set", choices=tuple(DATA_SETS))
    path: str = setting("", "CSV or Parquet file for data.name = csv")
    dir: str = setting("", 'folder of the metabric, gbsg, whas and sba files (plain or .gz); "" = $FEDSURV_DATA_DIR, '
                           "else the copy bundled with the package")
    time_col: str = setting("", 'time column (csv; "" = time)')
    event_col: str = setting("", 'event column: 0/1, booleans, or text with data.event_values (csv; "" = event)')
    event_values: tuple[str, ...] = setting("", "the values of data.event_col that mark an event (e.g. Dead, or 1,2 "
                                                "for two causes counted together); every other value present marks "
                                                'a censored record; "" = the column holds 0/1 or booleans')
    time_unit: str = setting("time", "the unit of data.time_col (days, months, ...): the time axis' label in "
                                     "every plot and table")
    feature_cols: tuple[str, ...] = setting("", 'feature columns; "" = every other column')
    id_col: str = setting("", 'a column that identifies records: never a feature; the join key of vertical data; '
                              '"" = none (vertical: id)')
    drop_cols: tuple[str, ...] = setting("", "columns never used")
    split_col: str = setting("", 'a column of train/test labels (train, test) that replaces the random split; '
                                 '"" = random split')
    test_fraction: float = setting(AUTO, "share of each site's records held out as its test part (simulation: "
                                         "stratified by event, seeded; a deployed site: by a keyed hash of each "
                                         "record, at most its max-test-share); 0 = no test part: a horizontal run "
                                         "trains on every record and reports no test figure",
                                   bounds=Bounds(0.0, 1.0, low_closed=True), auto="the data set's")
    horizon_months: int = setting(48, "SBA: observation window for time to charge-off", bounds=POSITIVE)
    oot_start: str = setting("", 'SBA: approvals on/after this date form the out-of-time set; "" = SBA\'s '
                                 "2005-01-01")
    synthetic_records: int = setting(3000, "synthetic_multimodal: number of records", bounds=POSITIVE)
    labels_path: str = setting("", "strategy split with data.name = vertical_files or site_files (a deployment): the "
                                   "label holder's CSV or Parquet file of id, time and event (data.id_col, "
                                   "data.time_col, data.event_col)")
    modality_paths: tuple[str, ...] = setting(
        "", "vertical_files: one CSV or Parquet file per modality, each holding the ID column and that modality's "
            "features: modality=path (clinical=/abs/clin.csv), or a path whose file name names the modality "
            "(/abs/clinical.csv)")
    categorical_cols: tuple[str, ...] = setting("", "columns read as category labels whatever they hold (codes, "
                                                    "numbers mixed with text such as missing), one-hot encoded "
                                                    "instead of standardised: in any table (csv, a deployed site's "
                                                    "file, a named data set) or whichever vertical_files modality file "
                                                    "holds them (a column holding only text is categorical without it)")
    dictionary: str = setting("", "a public data dictionary (JSON or YAML: numeric ranges, category levels, a time "
                                  "grid or the follow-up range) whose entries the private set-up of dp_sgd/bdp/"
                                  "distributed_dp and of private_split's sites takes as public, at no privacy cost")

    @property
    def deployed(self) -> bool:
        """True when the sites read their own files (``data.name = "site_files"``): a deployment."""
        return self.name == DEPLOYED_DATA

    @property
    def modality_files(self) -> dict[str, str]:
        """``data.modality_paths`` as ``{modality: path}``, in their order (checked by :func:`parse_flat`)."""
        return dict(modality_path(item) for item in self.modality_paths)


def modality_path(item: str) -> tuple[str, str]:
    """``"clinical=/abs/clin.csv"`` -> ``("clinical", "/abs/clin.csv")``; ``"/abs/clinical.csv"`` -> ``("clinical",
    "/abs/clinical.csv")`` (the file name up to its first dot names the modality)."""
    if "=" in item:
        name, path = item.split("=", 1)
        return name.strip(), path.strip()
    return re.split(r"[/\\]", item)[-1].split(".")[0], item


@dataclass(frozen=True)
class ModelConfig:
    """Survival network. ``None`` fields take the model kind's own default."""

    name: str = setting(AUTO, "the survival network", choices=tuple(MODELS),
                        auto=f"{DEFAULT_MODEL['horizontal']} with model.hidden chosen after the set-up from the "
                             "agreed record counts, covariates, strategy and epsilon (strategies.model_choice; "
                             f"docs/when-to-use-what.md), or {DEFAULT_MODEL['vertical']} for a vertical strategy")
    num_durations: int = setting(AUTO, "time intervals of the hazard model; grid of the federated Breslow estimator "
                                       "for Cox models", bounds=POSITIVE, auto="the model's")
    time_grid: str = setting("quantiles", "quantiles of event times or equidistant",
                             choices=("quantiles", "equidistant"))
    hidden: tuple[int, ...] | None = setting(AUTO, "hidden widths, e.g. 128,64,64,32,32; [] for a linear model "
                                                   "(flwr run: model.hidden='[]')", bounds=POSITIVE,
                                             auto="with model.name = auto, chosen after the set-up "
                                                  "(strategies.model_choice); otherwise the model's default")
    activation: str | None = setting(AUTO, "activation, e.g. selu, relu", auto="the model's")
    dropout: float | None = setting(AUTO, "dropout rate", bounds=Bounds(0.0, 1.0, low_closed=True),
                                    auto="the model's")
    penalty: float = setting(0.0, "Cox-MLP: lambda * sum |g| penalty of the LS-ADP paper (eq. 5)", bounds=NON_NEGATIVE)
    risk_layer: str = setting(AUTO, "hazard_mlp's output layer: interval (a logit per interval from the last hidden "
                                    "layer; interval 0, the point {0}, shares interval 1's weights) or proportional (one risk score shifts every interval's baseline logit: "
                                    "curves never cross, far fewer output weights)",
                              choices=("interval", "proportional"), auto=_recipe_auto("model.risk_layer"))


@dataclass(frozen=True)
class TrainConfig:
    """Local optimisation at each site (and for the centralised baseline)."""

    local_epochs: int = setting(AUTO, "local epochs per round at each site", bounds=POSITIVE,
                                auto=_recipe_auto("train.local_epochs"))
    batch_size: int = setting(AUTO, "mini-batch size (dp_sgd/bdp: expected size of a Poisson-sampled batch)",
                              bounds=POSITIVE, auto=_recipe_auto("train.batch_size"))
    lr: float = setting(AUTO, "Adam learning rate", bounds=POSITIVE, auto=_recipe_auto("train.lr"))
    weight_decay: float = setting(1e-4, "Adam weight decay", bounds=NON_NEGATIVE)
    num_threads: int = setting(1, "torch threads per site process", bounds=POSITIVE)
    proximal_mu: float = setting(0.0, "FedProx: mu of the proximal term (mu/2)||w - w_global||^2 added to each site's "
                                      "local objective (0 = none); dp_sgd/bdp add its gradient, which needs no "
                                      "record, to the privatised gradient", bounds=NON_NEGATIVE)


@dataclass(frozen=True)
class FederationConfig:
    """Sites, rounds and how records are partitioned among sites."""

    num_sites: int = setting(5, "number of sites for iid and dirichlet partitions", bounds=POSITIVE)
    rounds: int = setting(AUTO, "FedAvg rounds (distributed_dp: gradient steps on the union; split: epochs)",
                          bounds=POSITIVE, auto=_recipe_auto("federation.rounds"))
    partition: str = setting("iid", "iid, dirichlet (event x time-quartile skew), or a column name for a natural "
                                    "partition (region, State, ...)")
    dirichlet_alpha: float = setting(0.5, "concentration of the Dirichlet partition (smaller = more skewed)",
                                     bounds=POSITIVE)
    min_site_records: int = setting(0, "natural partitions: drop groups smaller than this (a site of fewer than 10 "
                                       "records is refused: set 10 or more to leave such centres out)",
                                    bounds=NON_NEGATIVE)
    fraction_train: float = setting(1.0, "share of sites sampled per round",
                                    bounds=Bounds(0.0, 1.0, high_closed=True))
    min_sites: int = setting(2, "fewest sites whose training a round aggregates; below it the run stops (resumable)",
                             bounds=POSITIVE)
    timeout_s: float = setting(3600.0, "seconds the server waits for the sites' replies to a round's messages "
                                       "(split: to each round trip)", bounds=POSITIVE)
    aggregation: str = setting("fedavg", "fedavg (weighted mean), or Flower's robust aggregators (not with "
                                         "central_dp)", choices=AGGREGATIONS)
    update_bound: float = setting(DEFAULT_UPDATE_BOUND, "fedavg: each update's pull away from the sites' coordinate-"
                                        "wise median is bounded to update_bound x the median of those distances "
                                        "(centred clipping, 3 or more updates a round; not with central_dp or "
                                        "distributed_dp), so that a minority coalition moves the mean by at most its "
                                        "share of the weight x that distance; a site farther than "
                                        f"{OUTLIER_SPREAD:g} x (or update_bound x, if larger) is flagged; 0: the plain weighted mean",
                                  bounds=NON_NEGATIVE)
    max_weight_ratio: float = setting(3.0, "a site's weight in the training mean (its agreed record count) is capped "
                                           "at max_weight_ratio x the median of the round's sites' weights (a capped "
                                           "site is flagged, not refused); 0: no cap", bounds=NON_NEGATIVE)
    trim_fraction: float = setting(0.2, "trimmed_mean: share of the sites cut off at each tail (int(trim_fraction x "
                                        "sites) of a round; refused when that is 0: below ceil(1 / trim_fraction) "
                                        "sites a round)", bounds=Bounds(0.0, 0.5, low_closed=True))
    max_malicious: int = setting(1, "krum: sites it tolerates (refused below 2 x max_malicious + 3 sites a round; "
                                    "median below 3)", bounds=NON_NEGATIVE)
    server_optimizer: str = setting("fedavg", "Flower's server optimiser applied to each round's aggregate (after "
                                              "central_dp's noise and any robust aggregator): fedavg (none), fedadam, "
                                              "fedyogi, fedadagrad, fedavgm", choices=tuple(SERVER_OPTIMIZERS))
    server_lr: float | None = setting(AUTO, "server learning rate of fedadam, fedyogi, fedadagrad (Flower's eta) "
                                            "and fedavgm", bounds=POSITIVE, auto=_server_optimizer_auto("lr"))
    server_momentum: float | None = setting(AUTO, "momentum of fedadam and fedyogi (Flower's beta_1) and fedavgm",
                                            bounds=Bounds(0.0, 1.0, low_closed=True),
                                            auto=_server_optimizer_auto("momentum"))
    weight_average: str = setting("none", "the model the run evaluates, recalibrates and saves: none (the last global "
                                          "model), ema (the bias-corrected exponential moving average of the global "
                                          "models of rounds 1..t) or tail (the mean of the global models from the "
                                          "last tail_fraction of the rounds on); the sites train from the global "
                                          "model itself: post-processing of the released models, no privacy cost",
                                  choices=("none", "ema", "tail"))
    ema_decay: float = setting(0.9, "weight_average = ema: the decay d (round s weighs (1 - d) d^(t - s))",
                               bounds=Bounds(0.0, 1.0))
    tail_fraction: float = setting(0.5, "weight_average = tail: the share of the rounds averaged (the last ones)",
                                   bounds=Bounds(0.0, 1.0, high_closed=True))


@dataclass(frozen=True)
class PrivacyConfig:
    """Target privacy budget and mechanism parameters; ``epsilon`` of ``inf`` means no DP."""

    epsilon: float = setting(math.inf, "target epsilon", bounds=POSITIVE, infinite="no differential privacy")
    delta: float = setting(1e-5, "target delta", bounds=FRACTION)
    delta_override: bool = setting(False, "true: accept privacy.delta > 1/n, n the population the strategy protects "
                                          "(each site's training records; distributed_dp: the union's; central_dp: "
                                          "the sites), which is refused otherwise: such a delta allows releasing a "
                                          "record outright")
    clip_norm: float = setting(AUTO, "dp_sgd/bdp: per-record gradient clip norm C; central_dp: per-site update clip "
                                    "norm; nbafl/ls_adp/row_dp: clip norm of all model weights together; split: L2 "
                                    "clip of each record's embedding", bounds=POSITIVE,
                                auto=_recipe_auto("privacy.clip_norm"))
    accountant: str = setting(AUTO, "accountant that calibrates the noise and gives the headline epsilon (dp_sgd, "
                                    "central_dp: pld, prv or rdp; the others: rdp); the ledger adds the RDP epsilon",
                              choices=("pld", "prv", "rdp"), auto="pld for dp_sgd and central_dp, rdp otherwise")
    adjacency: str = setting(AUTO, "neighbouring data sets the guarantee is for (bdp offers both; dp_sgd and "
                                   "central_dp add-remove; nbafl/ls_adp/row_dp and split replace-one)",
                             choices=("add-remove", "replace-one"), auto="the strategy's")
    allocation: str = setting("paper", "nbafl/ls_adp/row_dp: paper (budgets average to epsilon; audited epsilon "
                                       "reported beside) or exact (per-layer clip norms and noise shares whose joint "
                                       "RDP is the target)", choices=ALLOCATIONS)
    dispersion: str = setting("var", "row_dp: dispersion of a weight's local iterates", choices=DISPERSION_MEASURES)
    uniform_mix: float = setting(0.0, "ls_adp/row_dp: importance mixed with the uniform one, (1-l)V + l/K (0 = the "
                                      "paper's rule)", bounds=Bounds(0.0, 1.0, low_closed=True, high_closed=True))
    min_site_records: int = setting(0, "nbafl/ls_adp/row_dp: m in the sensitivity 2C/m; 0 = the smallest site's "
                                       "training records (simulation only)", bounds=NON_NEGATIVE)
    setup_share: float = setting(AUTO, "dp_sgd/bdp/distributed_dp/private_split: share of the privacy budget spent "
                                       "on the set-up releases (counts, ranges, moments, time histogram; a hazard "
                                       "model's recalibration): their noise is that of one Gaussian mechanism "
                                       "spending this share of the RDP budget of epsilon (private_split: every "
                                       "site's set-up together), so a larger epsilon gives finer statistics; 0 = "
                                       "exact set-up (not covered by epsilon); private_split: no set-up release and "
                                       "nothing charged, every numeric column's range public in data.dictionary "
                                       "(needed)",
                                 bounds=Bounds(0.0, 1.0, low_closed=True), auto=_recipe_auto("privacy.setup_share"))
    setup_sum: str = setting(AUTO, "dp_sgd: how the private set-up's histograms and moments reach the server: "
                                   "per_site (each site adds its own full noise; the server sees every site's "
                                   "release) or secure (through SecAgg+ with distributed discrete Gaussian noise, as "
                                   "distributed_dp's: the server sees only the sum, whose guarantee then needs the "
                                   "honest sites of privacy.max_dropouts and privacy.colluding_sites); auto = secure "
                                   "where the per-site noise summed over federation.num_sites sites would hide the "
                                   "ranges (strategies.mechanisms.dp_sgd.setup_sum), per_site otherwise",
                             choices=(AUTO, "per_site", "secure"))
    max_dropouts: int = setting(1, "distributed_dp (and dp_sgd's secure set-up sum): sites that may drop out of a "
                                   "round's secure aggregation; the others' noise still meets epsilon (more "
                                   "drop-outs: the round is not unmasked)",
                                bounds=NON_NEGATIVE)
    colluding_sites: int = setting(0, "distributed_dp (and dp_sgd's secure set-up sum): sites that may collude with "
                                      "the server (their own noise is not counted)", bounds=NON_NEGATIVE)
    modulus_bits: int = setting(48, "distributed_dp (and dp_sgd's secure set-up sum): secure aggregation works modulo "
                                    "2^bits; the quantisation scale is the largest that keeps wrap-around below 1e-9 "
                                    "per round",
                                bounds=Bounds(16.0, 62.0, low_closed=True, high_closed=True))

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.epsilon)


@dataclass(frozen=True)
class SplitConfig:
    """Vertical split learning (strategy ``split``): modalities, architecture, embedding privacy.

    ``modalities`` empty means every modality of the data set. ``calibration`` is ``"rdp"`` (σ
    from an RDP accountant without amplification, for the record's releases at every site) or
    ``"paper"`` (the BVFLMSP formula, labelled as such). ``mc_samples`` is the number of
    stochastic prediction passes per held-out record (each one a release unless
    ``clean_inference``).
    """

    modalities: tuple[str, ...] = setting("", 'modalities of the vertical data set (genomic,clinical; a,b,c); "" = all')
    embedding_dim: int = setting(16, "embedding a site sends (BVFLMSP: 512)", bounds=POSITIVE)
    encoder_layers: int = setting(0, "hidden blocks of an omics site's BayesianFC encoder (0: linear; BVFLMSP: 2)",
                                  bounds=NON_NEGATIVE)
    head_layers: int = setting(1, "hidden blocks of the server's prediction head (BVFLMSP: 4)", bounds=NON_NEGATIVE)
    dropout: float = setting(0.1, "dropout of the encoders and the head (BVFLMSP: 0.5)",
                             bounds=Bounds(0.0, 1.0, low_closed=True))
    similarity_weight: float = setting(0.05, "weight of the 1 - cos alignment term between modality embeddings",
                                       bounds=NON_NEGATIVE)
    calibration: str = setting("rdp", "rdp (sigma for the record's releases at every site, no amplification) or "
                                      "paper (BVFLMSP formula, labelled)", choices=("rdp", "paper"))
    mc_samples: int = setting(20, "stochastic prediction passes per test record (each one a release)",
                              bounds=POSITIVE)
    clean_inference: bool = setting(False, "true: prediction embeddings without noise (clipped only; those records "
                                           "get no guarantee)")
    risk_layer: str = setting(AUTO, "the head's risk layer: proportional (one risk score shifts every interval's "
                                    "baseline logit) or interval (BVFLMSP: a linear map per interval)",
                              choices=("proportional", "interval"), auto=_recipe_auto("split.risk_layer"))
    encoder: str = setting("score", "private_split: each site's encoder, fitted from one noisy statistic: score (1 "
                                    "dimension, the Cox score direction from the label holder's residuals: discloses "
                                    "the training labels to the sites), pca (split.embedding_dim components of a noisy "
                                    "second-moment matrix; no labels) or features (the preprocessed features, no fit)",
                           choices=("score", "pca", "features"))
    release_noise: str = setting("laplace", "private_split: noise of the one release of each record's embedding: "
                                            "laplace (L1 clip, pure DP) or gaussian (L2 clip, RDP)",
                                 choices=("laplace", "gaussian"))
    fit_share: float = setting(0.05, "private_split: share of privacy.epsilon spent on the encoder statistics (beyond "
                                     "the private set-up); the releases get the rest",
                               bounds=Bounds(0.0, 1.0))


#: ``cox.ph_test`` values: the time transform of the proportional-hazards test (lifelines' ``time_transform``), or none.
COX_PH_TESTS = ("rank", "km", "identity", "log", "none")


@dataclass(frozen=True)
class CoxConfig:
    """Cox proportional-hazards regression (``model.name = "coxph"``): Newton-Raphson on the sites' exact sums
    (``strategy.name = fedavg``), or the private grouped-time model (``dp_sgd``, ``distributed_dp``:
    ``cox.strata = none`` on ``cox.grid = k`` points, :mod:`flwr_app.cox_server`).

    ``strata = "site"`` fits lifelines' ``CoxPHFitter(strata=["site"])`` (each site its own baseline hazard), ``"none"``
    one pooled baseline from risk-set sums on ``grid`` (:mod:`models.cox`). Every key is read only with
    ``model.name = "coxph"``.
    """

    strata: str = setting("site", "site: stratified by site, each site its own baseline hazard (lifelines' "
                                  "strata=['site']); none: one pooled baseline, from per-site risk-set sums on "
                                  "cox.grid", choices=("site", "none"))
    grid: str = setting("events", "cox.strata = none: the grid of the risk-set sums: events (every distinct training "
                                  "event time: the exact pooled fit, and every site reveals its event times) or an "
                                  "integer k (k points of the set-up's time grid, model.num_durations quantiles: "
                                  "events within a cell are tied at its end)")
    penalizer: float = setting(0.0, "ridge penalty, lifelines' penalizer c: n c ||beta||^2 / 2 on standardised "
                                    "columns", bounds=NON_NEGATIVE)
    robust: bool = setting(False, "sandwich (Lin-Wei) standard errors: one more release per site, a p x p matrix of "
                                  "its score residuals' cross-products")
    max_steps: int = setting(50, "most Newton-Raphson steps (each one query to every site)", bounds=POSITIVE)
    tol: float = setting(1e-12, "Newton stops when the decrement U'I^-1U/2 (the log-likelihood gain the next step "
                                "would bring) is below it", bounds=POSITIVE)
    ph_test: str = setting(AUTO, "proportional-hazards test (scaled Schoenfeld residuals, one more release per site: "
                                 "2p + 3 sums) with this time transform, or none", choices=COX_PH_TESTS,
                           auto="rank for cox.strata = site (identity with cox.secure_sum: log fails on a time-0 "
                                "event), km for none")
    secure_sum: bool = setting(False, "every site's sums (moments, Newton steps, robust meat, PH test) travel through "
                                      "SecAgg+ without noise, so the server sees only their sum over sites (4 round "
                                      "trips per query; fixed point 2^-32 modulo 2^62): cox.strata = site, or none "
                                      "with cox.grid = k (sums per cell of the public grid; the events grid would "
                                      "reveal every site's event times)")


@dataclass(frozen=True)
class DebugConfig:
    """Injected failures for tests of fault tolerance (simulation only).

    ``fail_site`` (a horizontal site's name, ``site-<i>``, or a split run's modality; empty: none)
    fails on every ``fail_message`` (``train``, ``evaluate``, ``breslow``) from round (split:
    epoch) ``fail_round`` on, by raising (``fail_mode = "raise"``: an error reply) or by never
    answering (``"hang"``). ``stop_after_round`` > 0 stops the ServerApp once that round's
    outputs and checkpoint are written, as a crash of the server would.
    """

    fail_site: str = setting("", 'simulation tests: the site that fails (site-<i>; split: the modality); "" = none')
    fail_round: int = setting(1, "the round (split: epoch) from which it fails", bounds=POSITIVE)
    fail_message: str = setting("train", "the message it fails on (split: train, every round trip; coxph: cox, its "
                                         "Newton steps from step fail_round on)",
                                choices=("train", "evaluate", "breslow", "cox"))
    fail_mode: str = setting("raise", "raise (an error reply), hang (no reply within federation.timeout_s), or a "
                                      "hostile reply the server must refuse (poisoned_update: a well-formed one, "
                                      "which only bounds or a robust federation.aggregation stop)", choices=("raise", "hang") + HOSTILE_MODES)
    fail_scale: float = setting(-10.0, "poisoned_update: the factor of every weight of the hostile site's update")
    stop_after_round: int = setting(0, "simulation tests: the ServerApp stops after this round's checkpoint (0 = "
                                       "never), as a crash would", bounds=NON_NEGATIVE)


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs, parsed once at the edge."""

    seed: int = setting(0, "one seed drives splits, partitions, initialisation and local shuffling",
                        bounds=NON_NEGATIVE)
    strategy: str = setting("fedavg", "the federation and its privacy mechanism", choices=tuple(STRATEGIES),
                            key="strategy.name")
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    split: SplitConfig
    cox: CoxConfig
    output_dir: str = setting("", 'run directory; "" = outputs/<date>/<time>-<data>-<strategy> (Hydra) or '
                                  "outputs/<time>-<data>-<strategy> (flwr run)", key="output.dir")
    server_evaluation: bool = setting(True, "simulation only: evaluate the global model on the pooled test split "
                                            "each round", key="evaluation.server_side")
    evaluation_screen: bool = setting(False, "leave a site whose test metrics stand far outside the other sites' out of "
                                             "the sites' mean, as a named failure; off: its metrics are kept and "
                                             "flagged (heterogeneous sites are normal)", key="evaluation.screen")
    evaluation_every: int = setting(1, "horizontal: evaluate the global model (the sites on their test parts, and in a "
                                       "simulation the server on the pooled test split) after every k-th round and "
                                       "the last; the rounds between send the sites no evaluation message",
                                    bounds=POSITIVE, key="evaluation.every")
    centralized_baseline: bool = setting(True, "simulation only: also train the same model on the pooled training "
                                               "data", key="baseline.centralized")
    resume_from: str = setting("", "horizontal: a run directory (or its checkpoint.pt) to continue after its last "
                                   "completed round", key="resume.from")
    engine: str = setting(AUTO, "simulation only: what carries the messages of python -m simulations.run, its sweeps "
                                "and fedsurv.fit: ray (Flower's simulation engine, the sites in parallel) or "
                                f"inprocess (the same apps over an in-process grid; from {PARALLEL_MIN_SITES} sites on, one "
                                f"process per CPU); auto = inprocess up to {INPROCESS_MAX_SITES} sites, ray above or on "
                                "a running Ray cluster "
                                "(RAY_ADDRESS: a sweep's, or yours)", choices=ENGINES, key="simulation.engine")
    debug: DebugConfig

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dictionary (JSON-serialisable) of the resolved configuration."""
        return asdict(self)


# ------------------------------------------------------------------ the keys, walked from the dataclasses


@dataclass(frozen=True)
class Key:
    """One run-config key: its name, where it lives (group field, attribute) and its :class:`Setting`."""

    name: str
    group: str  # the ExperimentConfig field holding it ("" for a top-level key)
    attribute: str
    kind: str  # str | int | float | bool | list[str] | list[int]
    setting: Setting

    @property
    def default(self) -> Any:
        return self.setting.default


_KINDS = {str: "str", int: "int", float: "float", bool: "bool", tuple[str, ...]: "list[str]",
          tuple[int, ...]: "list[int]"}


def _kind(annotation: Any) -> str:
    """``tuple[int, ...] | None`` -> ``"list[int]"``: the type without the ``None`` of an auto key."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return _KINDS[annotation]


def _walk(cls: type, group: str) -> Iterator[Key]:
    hints = typing.get_type_hints(cls)
    for item in fields(cls):
        if is_dataclass(hints[item.name]):
            yield from _walk(hints[item.name], item.name)
            continue
        meta: Setting = item.metadata["setting"]
        name = meta.key or (f"{group}.{item.name}" if group else item.name)
        yield Key(name, group, item.name, _kind(hints[item.name]), meta)


#: Every run-config key, in the order of ``pyproject.toml`` and the docs.
KEYS: Mapping[str, Key] = {key.name: key for key in _walk(ExperimentConfig, "")}


def defaults() -> dict[str, Any]:
    """``{"data.name": "flchain", ...}``: every key's default (as ``pyproject.toml`` declares it)."""
    return {name: key.default for name, key in KEYS.items()}


# ------------------------------------------------------------------ which keys depend on the strategy's mechanism

#: The keys whose effect depends on the strategy's mechanism (``fnmatch`` patterns): each mechanism declares the
#: ones it honours (:attr:`strategies.mechanisms.base.Mechanism.honours`) and refuses any other at a value but its
#: default (:meth:`~strategies.mechanisms.base.Mechanism.check_keys`). A new key of these groups is refused by
#: every mechanism until one declares it.
MECHANISM_KEYS: tuple[str, ...] = (
    "privacy.*", "split.*", "train.local_epochs", "train.batch_size", "train.lr", "train.weight_decay",
    "train.proximal_mu", "model.hidden", "model.activation", "model.dropout", "model.penalty", "model.risk_layer",
    "data.dictionary",
    "federation.num_sites", "federation.partition", "federation.dirichlet_alpha", "federation.min_site_records",
    "federation.fraction_train", "federation.min_sites", "federation.aggregation", "federation.update_bound",
    "federation.max_weight_ratio", "federation.trim_fraction", "federation.max_malicious",
    "federation.server_optimizer", "federation.server_lr", "federation.server_momentum", "resume.from",
)
#: The keys every strategy honours (``fnmatch`` patterns; a key that :data:`MECHANISM_KEYS` names is not one of
#: them). A test fails on a key that neither list names.
COMMON_KEYS: tuple[str, ...] = (
    "seed", "strategy.name", "data.*", "model.name", "model.num_durations", "model.time_grid", "train.num_threads",
    "federation.rounds", "federation.timeout_s", "federation.weight_average", "federation.ema_decay",
    "federation.tail_fraction", "output.dir", "evaluation.*", "baseline.*", "debug.*",
    "simulation.*", "cox.*",
)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def mechanism_keys() -> tuple[str, ...]:
    """Every key of :data:`MECHANISM_KEYS`, in the schema's order."""
    return tuple(name for name in KEYS if _matches(name, MECHANISM_KEYS))


def unclassified_keys() -> tuple[str, ...]:
    """The keys that neither :data:`MECHANISM_KEYS` nor :data:`COMMON_KEYS` names (a test keeps it empty)."""
    return tuple(name for name in KEYS if not _matches(name, MECHANISM_KEYS) and not _matches(name, COMMON_KEYS))


def key_value(cfg: ExperimentConfig, name: str) -> Any:
    """The value of run-config key ``name`` in ``cfg`` (``"privacy.clip_norm"`` -> ``cfg.privacy.clip_norm``)."""
    key = KEYS[name]
    return getattr(getattr(cfg, key.group) if key.group else cfg, key.attribute)


def run_defaults(cfg: ExperimentConfig) -> dict[str, Any]:
    """Every key's default for ``cfg``'s strategy, model and data set (``auto`` resolved as :func:`parse_flat` does)."""
    values = {name: None if key.setting.auto and _is_auto(key.default) else _value(key, key.default)
              for name, key in KEYS.items()}
    values.update({"strategy.name": cfg.strategy, "model.name": cfg.model.name, "data.name": cfg.data.name})
    _resolve_auto(values)
    return values


def show_value(value: Any) -> str:
    """A value as a refusal writes it: ``'fedadam'``, ``0.1``, ``inf``, ``true``, ``'a,b'``, ``auto``."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return repr(",".join(str(item) for item in value))
    return repr(value) if isinstance(value, str) else str(value)


# ------------------------------------------------------------------ parsing


def _finite(key: Key, value: float) -> float:
    """``value`` unless it is NaN, ``-inf``, or ``inf`` for a key that gives ``inf`` no meaning."""
    if math.isnan(value):
        raise ConfigError(f"run config: '{key.name}' must be a number, got nan")
    if math.isinf(value) and (value < 0 or not key.setting.infinite):
        allowed = "; only " + ", ".join(f"{other.name} may be inf ({other.setting.infinite})"
                                        for other in KEYS.values() if other.setting.infinite) if value > 0 else ""
        raise ConfigError(f"run config: '{key.name}' must be finite, got {value}{allowed}")
    return value


_INTEGER = re.compile(r"[+-]?\d+")


def _number(key: Key, value: Any, kind: type) -> Any:
    """An int or float of ``key``; a string only where it is how the value is written (``"inf"``, an auto key)."""
    written = isinstance(value, str)
    if written:
        text = value.strip().lower()
        if not key.setting.auto and text not in ("inf", "+inf", "-inf", "nan"):
            raise ConfigError(f"run config: '{key.name}' must be {kind.__name__}, got {value!r} (str)")
        try:
            value = int(text) if kind is int and _INTEGER.fullmatch(text) else float(text)
        except ValueError:
            raise ConfigError(f"run config: '{key.name}' must be {kind.__name__} or {AUTO!r}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"run config: '{key.name}' must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    if kind is float:
        return _finite(key, float(value))
    if isinstance(value, float):
        if not value.is_integer():
            if written:  # "nan" or "inf" in a string: say what is wrong with it
                _finite(key, value)
            raise ConfigError(f"run config: '{key.name}' must be int, got {value!r} (float)")
        return int(value)
    return value


def _items(key: Key, value: Any) -> list[Any]:
    """A list key's items: a list (Hydra's ``'key=[a,b]'``) or a comma-separated string (``flwr run``; ``"[]"``: the
    empty list, e.g. ``model.hidden="[]"``, a linear model)."""
    if isinstance(value, str) and value.strip() == "[]":
        return []
    if isinstance(value, (list, tuple)):
        return [item.strip() if isinstance(item, str) else item for item in value
                if not (isinstance(item, str) and not item.strip())]
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    raise ConfigError(f"run config: '{key.name}' must be a list or a comma-separated string, got {value!r}")


def _value(key: Key, value: Any) -> Any:
    """``value`` of ``key`` converted to its kind and checked against its choices and bounds."""
    kind = key.kind
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"run config: '{key.name}' must be bool, got {value!r} ({type(value).__name__})")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"run config: '{key.name}' must be str, got {value!r} ({type(value).__name__})")
        value = value.strip()
        if key.setting.choices and value not in key.setting.choices:
            raise ConfigError(f"run config: '{key.name}' = {value!r}; choose one of {', '.join(key.setting.choices)}"
                              + (f" (or {AUTO!r}: {key.setting.auto})" if key.setting.auto else ""))
        return value
    if kind == "list[str]":
        return tuple(str(item) for item in _items(key, value))
    if kind == "list[int]":
        return tuple(_bounded(key, _number(key, item, int)) for item in _items(key, value))
    return _bounded(key, _number(key, value, int if kind == "int" else float))


def _bounded(key: Key, value: float) -> Any:
    if key.setting.bounds is not None and value not in key.setting.bounds:
        raise ConfigError(f"run config: '{key.name}' must be {key.setting.bounds}, got {value}")
    return value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in (AUTO, "")


def parse_flat(flat: Mapping[str, Any]) -> ExperimentConfig:
    """Validate a flat run config (``{"data.name": "flchain", ...}``) into an :class:`ExperimentConfig`.

    A key that ``flat`` leaves out takes its schema default. Imports neither torch nor Flower; the
    strategy's mechanism checks the result further (:func:`flwr_app.config.parse_run_config`).

    Raises
    ------
    ConfigError
        On an unknown key, an unknown data set, model or strategy, a value of the wrong type, or a
        value out of range, and on keys that do not go together. The message names the key.
    """
    unknown = sorted(set(flat) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(KEYS))}")
    raw = {**defaults(), **flat}
    values: dict[str, Any] = {}
    for name, key in KEYS.items():
        if key.setting.auto and _is_auto(raw[name]):
            values[name] = None
        else:
            values[name] = _value(key, raw[name])
    _check_coxph(values)
    _resolve_auto(values)
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for name, key in KEYS.items():
        (groups.setdefault(key.group, {}) if key.group else top)[key.attribute] = values[name]
    hints = typing.get_type_hints(ExperimentConfig)
    cfg = ExperimentConfig(**top, **{group: hints[group](**items) for group, items in groups.items()})
    _check_pairing(cfg)
    _check_dependent_keys(cfg)
    _check_server_optimizer(cfg.federation)
    _check_weight_average(cfg)
    _check_faults(cfg)
    _check_vertical_files(cfg.data, cfg.split.modalities)
    _check_event_values(cfg)
    if cfg.data.deployed:
        _check_deployment(cfg)
    return cfg


#: The keys that Newton-Raphson on the sites' sums (``model.name = "coxph"``) never reads: each is refused at any value
#: but its default (``auto`` for an auto key).
COXPH_IGNORES: tuple[str, ...] = (
    "model.hidden", "model.activation", "model.dropout", "model.penalty", "train.local_epochs", "train.batch_size",
    "train.lr", "train.weight_decay", "train.proximal_mu", "federation.rounds", "federation.fraction_train",
    "federation.aggregation", "federation.update_bound", "federation.max_weight_ratio", "federation.trim_fraction",
    "federation.max_malicious", "federation.server_optimizer", "federation.server_lr", "federation.server_momentum",
    "resume.from", "evaluation.every", "debug.stop_after_round",
)


#: The strategies ``model.name = "coxph"`` runs with: exact Newton-Raphson (``fedavg``) and the private grouped-time
#: model (``dp_sgd``: every site adds the full noise; ``distributed_dp``: noise shares summed through SecAgg+).
COXPH_STRATEGIES = ("fedavg", "dp_sgd", "distributed_dp")
#: The keys the private grouped-time fit (``coxph`` with ``dp_sgd`` or ``distributed_dp``) never reads: each is refused
#: at any value but its default (``auto`` for an auto key). Its design is :data:`models.grouped_cox.RECIPES`.
COXPH_PRIVATE_IGNORES: tuple[str, ...] = (
    "cox.robust", "cox.secure_sum", "cox.penalizer", "cox.max_steps", "cox.tol", "privacy.clip_norm",
    "evaluation.server_side", "evaluation.screen", "baseline.centralized",
)


def _check_private_coxph(values: Mapping[str, Any]) -> None:
    """``coxph`` under ``dp_sgd`` / ``distributed_dp`` (:mod:`models.grouped_cox` over the app): a finite
    ``privacy.epsilon``, ``cox.strata = none`` (one pooled baseline: the grouped model's α's), ``cox.grid = k`` (k
    points of the set-up's time grid: the public grid), ``cox.ph_test`` auto or none; :data:`COXPH_PRIVATE_IGNORES`
    at their defaults."""
    strategy = values["strategy.name"]
    if not math.isfinite(values["privacy.epsilon"]):
        raise ConfigError(f"run config: model.name = {COXPH!r} with strategy.name = {strategy!r} needs a finite "
                          "privacy.epsilon (e.g. 1); for the exact fit use strategy.name = 'fedavg'")
    if values["cox.strata"] != "none":
        raise ConfigError(f"run config: cox.strata = {values['cox.strata']!r} is not offered with strategy.name = "
                          f"{strategy!r}: the private fit has one pooled baseline (the grouped model's interval "
                          "hazards); set cox.strata = 'none'")
    if values["cox.grid"] == "events":
        raise ConfigError(f"run config: cox.grid = 'events' is refused with strategy.name = {strategy!r}: the union "
                          "of the sites' event times is not public; set cox.grid = k (k points of the set-up's time "
                          "grid, e.g. 11 for 10 intervals)")
    if values["cox.ph_test"] not in (None, "none"):
        raise ConfigError(f"run config: cox.ph_test = {values['cox.ph_test']!r} is not offered with strategy.name = "
                          f"{strategy!r} (the private fit releases no Schoenfeld sums); leave it at auto or none")
    _refuse_set(values, COXPH_PRIVATE_IGNORES, f"model.name = {COXPH!r} with strategy.name = {strategy!r} (the "
                "private grouped-time fit: its clip bounds and steps are models.grouped_cox.RECIPES', and it makes no "
                "predictions to evaluate)")


def _default_text(key: Key) -> str:
    """A key's default as a refusal writes it (``auto`` for an auto key)."""
    return AUTO if key.setting.auto else show_value(_value(key, key.default))


def _refuse_set(values: Mapping[str, Any], names: Sequence[str], what: str) -> None:
    """Refuse, in one line, the first of ``names`` set to other than its default: it has no effect on ``what``."""
    for name in names:
        key = KEYS[name]
        if values[name] != (None if key.setting.auto else _value(key, key.default)):
            raise ConfigError(f"run config: {name} = {show_value(values[name])} has no effect on {what}; leave it at "
                              f"{_default_text(key)}")


def _check_coxph(values: Mapping[str, Any]) -> None:
    """``model.name = "coxph"`` runs with the strategies of :data:`COXPH_STRATEGIES` (the private ones checked further
    by :func:`_check_private_coxph`) and refuses the keys it never reads (:data:`COXPH_IGNORES`); the ``cox.*`` keys
    are read only by it. ``values``: the parsed keys, ``None`` for
    ``auto``, before :func:`_resolve_auto`."""
    coxph = values["model.name"] == COXPH
    cox_keys = [name for name in KEYS if name.startswith("cox.")]
    if not coxph:
        for name in cox_keys:
            if values[name] != (None if KEYS[name].setting.auto else _value(KEYS[name], KEYS[name].default)):
                raise ConfigError(f"run config: {name} = {show_value(values[name])} is read only with model.name = "
                                  f"{COXPH!r}; leave it at {_default_text(KEYS[name])}")
        if values["debug.fail_message"] == "cox":
            raise ConfigError(f"run config: debug.fail_message = 'cox' fails model.name = {COXPH!r}'s Newton steps; "
                              "this run has none (use train, evaluate or breslow)")
        return
    if values["strategy.name"] not in COXPH_STRATEGIES:
        raise ConfigError(f"run config: model.name = {COXPH!r} runs with strategy.name in "
                          f"{', '.join(COXPH_STRATEGIES)} (fedavg: exact Newton-Raphson; dp_sgd, distributed_dp: the "
                          f"private grouped-time model), got strategy.name = {values['strategy.name']!r}")
    _refuse_set(values, COXPH_IGNORES, f"model.name = {COXPH!r} (Newton-Raphson on the sites' sums: no network, no "
                "training rounds)")
    strata, grid = values["cox.strata"], values["cox.grid"]
    if grid != "events" and not (re.fullmatch(r"\d+", grid) and int(grid) >= 2):
        raise ConfigError(f"run config: cox.grid = {grid!r} must be 'events' or an integer k >= 2 (k points of the "
                          "set-up's time grid)")
    if values["strategy.name"] != "fedavg":
        _check_private_coxph(values)
    elif strata == "site" and grid != "events":
        raise ConfigError(f"run config: cox.grid = {grid!r} is read only with cox.strata = 'none' (a stratified fit "
                          "uses each site's own event times, which never leave it); leave it at 'events'")
    points = values["model.num_durations"] or MODELS[COXPH].num_durations
    if grid != "events" and int(grid) > points:
        raise ConfigError(f"run config: cox.grid = {grid} is more points than the set-up's time grid has "
                          f"(model.num_durations = {points}): raise model.num_durations or "
                          "lower cox.grid")
    if values["strategy.name"] != "fedavg":
        return
    ph_test = values["cox.ph_test"]
    if values["cox.secure_sum"] and strata == "none" and grid == "events":
        raise ConfigError("run config: cox.secure_sum = true with cox.strata = 'none' and cox.grid = 'events' is "
                          "refused: that grid is the union of every site's event times, sent in the clear, which is "
                          "what the secure sum would hide; set cox.grid = k (k points of the set-up's public time "
                          "grid, e.g. 20) or cox.secure_sum = false")
    if values["cox.secure_sum"] and ph_test == "rank":
        raise ConfigError("run config: cox.ph_test = 'rank' needs each site's number of events (its rank offset), "
                          "which cox.secure_sum = true hides: set cox.ph_test to log, identity or none")
    if ph_test == "rank" and strata == "none":
        raise ConfigError("run config: cox.ph_test = 'rank' needs the pooled order of every event time across sites; "
                          "with cox.strata = 'none' use km, identity or log")
    if ph_test == "km" and strata == "site":
        raise ConfigError("run config: cox.ph_test = 'km' needs the pooled Kaplan-Meier curve at every event time, "
                          "which a stratified fit does not collect; with cox.strata = 'site' use rank, identity or log")


def _resolve_auto(values: dict[str, Any]) -> None:
    """Replace the ``auto`` (``None``) values whose default is a group option's."""
    strategy = STRATEGIES[values["strategy.name"]]
    if values["model.name"] is None:  # model.hidden left None: chosen after the set-up (strategies.model_choice)
        values["model.name"] = DEFAULT_MODEL["vertical" if strategy.vertical else "horizontal"]
    elif values["model.hidden"] is None and values["model.name"] in DEFAULT_HIDDEN:
        values["model.hidden"] = DEFAULT_HIDDEN[values["model.name"]]
    if values["model.name"] != "hazard_mlp":  # the other models have no risk layer to choose
        if values["model.risk_layer"] is not None:
            raise ConfigError(f"run config: model.risk_layer = {values['model.risk_layer']!r} is read only by "
                              f"model.name = 'hazard_mlp', which {values['model.name']!r} is not; leave it at "
                              f"{AUTO!r}" + (" (the fusion head's is split.risk_layer)" if strategy.vertical else ""))
        values["model.risk_layer"] = "interval"
    if values["model.num_durations"] is None:
        values["model.num_durations"] = MODELS[values["model.name"]].num_durations
    if values["cox.ph_test"] is None:
        values["cox.ph_test"] = ("identity" if values["cox.secure_sum"] else "rank") \
            if values["cox.strata"] == "site" else "km"
    if values["data.test_fraction"] is None:
        values["data.test_fraction"] = DATA_SETS[values["data.name"]].test_fraction
    if values["privacy.adjacency"] is None:
        values["privacy.adjacency"] = strategy.adjacency
    if values["privacy.accountant"] is None:
        values["privacy.accountant"] = strategy.accountant
    for name, default in TRAINING_DEFAULTS.items():
        if values[name] is None:
            values[name] = strategy.recipe.get(name, default)


#: Models whose loss takes ``model.penalty`` (the Cox kinds).
PENALISED_MODELS = ("cox_mlp", "cox_time")


def _check_dependent_keys(cfg: ExperimentConfig) -> None:
    """Refuse a key that only one value of another key reads, set away from its default with any other value (the
    run would ignore it), and an ``update_bound`` below 1."""
    federation, default = cfg.federation, defaults()
    if 0 < federation.update_bound < 1:
        raise ConfigError(f"run config: federation.update_bound = {federation.update_bound:g} would bound most honest "
                          "updates (it multiplies the median distance): use 0 (off) or a value >= 1")
    readers = (("federation.trim_fraction", federation.trim_fraction, federation.aggregation == "trimmed_mean",
                "federation.aggregation = 'trimmed_mean'", f"federation.aggregation = {federation.aggregation!r}"),
               ("federation.max_malicious", federation.max_malicious, federation.aggregation == "krum",
                "federation.aggregation = 'krum'", f"federation.aggregation = {federation.aggregation!r}"),
               ("federation.update_bound", federation.update_bound, federation.aggregation == "fedavg",
                "FedAvg's weighted mean (federation.aggregation = 'fedavg')",
                f"federation.aggregation = {federation.aggregation!r}"),
               ("model.penalty", cfg.model.penalty, cfg.model.name in PENALISED_MODELS,
                f"model.name = {' or '.join(map(repr, PENALISED_MODELS))}", f"model.name = {cfg.model.name!r}"))
    for key, value, read, reader, other in readers:
        if not read and value != default[key]:
            raise ConfigError(f"run config: {key} = {value:g} is read only with {reader}, which {other} is not; "
                              f"leave it at {default[key]:g}")


def _check_pairing(cfg: ExperimentConfig) -> None:
    """A vertical strategy trains a vertical model on a vertical data set; a horizontal one the others."""
    strategy = STRATEGIES[cfg.strategy]
    model = MODELS[cfg.model.name]
    data = DATA_SETS[cfg.data.name]
    if strategy.vertical:
        if not model.vertical:
            raise ConfigError(f"run config: 'model.name' = {cfg.model.name!r} is a horizontal model; strategy "
                              f"{cfg.strategy!r} trains {' or '.join(VERTICAL_MODELS)} ('auto': "
                              f"{DEFAULT_MODEL['vertical']})")
        if not data.vertical:
            raise ConfigError(f"run config: strategy {cfg.strategy!r} needs a vertical data set (data.name one of "
                              f"{', '.join(VERTICAL_DATASETS + (DEPLOYED_DATA,))}), got {cfg.data.name!r}")
        return
    if model.vertical:
        raise ConfigError(f"run config: 'model.name' = {cfg.model.name!r} is a vertical (multimodal) model; use "
                          f"strategy.name = 'split' (or model.name = 'auto': {DEFAULT_MODEL['horizontal']})")
    if not data.horizontal:
        raise ConfigError(f"run config: data set {cfg.data.name!r} is vertical (one modality per site); use "
                          f"strategy.name = 'split'")
    if cfg.data.name == "csv" and not cfg.data.path:
        raise ConfigError("run config: data.name='csv' needs 'data.path' (and 'data.time_col', 'data.event_col' "
                          "unless the columns are called 'time' and 'event')")


def _check_server_optimizer(federation: FederationConfig) -> None:
    """The ``federation`` group's server optimiser learning rate and momentum only where it has them (which
    strategies take a server optimiser or FedProx's term at all is each mechanism's declaration,
    ``Mechanism.honours``)."""
    option = SERVER_OPTIMIZERS[federation.server_optimizer]
    for key, value, parameter in (("server_lr", federation.server_lr, option.lr),
                                  ("server_momentum", federation.server_momentum, option.momentum)):
        if value is not None and not parameter:
            takers = ", ".join(name for name, other in SERVER_OPTIMIZERS.items()
                               if (other.lr if key == "server_lr" else other.momentum))
            raise ConfigError(f"run config: 'federation.{key}' = {value:g} does not apply to "
                              f"federation.server_optimizer = {federation.server_optimizer!r} (only to {takers}); "
                              f"leave it at {AUTO!r}")


def _check_weight_average(cfg: ExperimentConfig) -> None:
    """``federation.weight_average`` only where FedAvg rounds run (a horizontal strategy, not ``model.name =
    'coxph'``); its decay or tail share only with the average that reads it."""
    federation, default = cfg.federation, defaults()
    if federation.weight_average != "none" and (STRATEGIES[cfg.strategy].vertical or cfg.model.name == COXPH):
        runs = f"strategy {cfg.strategy!r}" if STRATEGIES[cfg.strategy].vertical else f"model.name = {COXPH!r}"
        raise ConfigError(f"run config: federation.weight_average = {federation.weight_average!r} averages FedAvg "
                          f"rounds' global models, which {runs} does not run; leave it at 'none'")
    for key, value, reader in (("ema_decay", federation.ema_decay, "ema"),
                               ("tail_fraction", federation.tail_fraction, "tail")):
        if federation.weight_average != reader and value != default[f"federation.{key}"]:
            raise ConfigError(f"run config: federation.{key} = {value:g} is read only with federation.weight_average "
                              f"= {reader!r}, not {federation.weight_average!r}; leave it at "
                              f"{default[f'federation.{key}']:g}")


def _check_faults(cfg: ExperimentConfig) -> None:
    """Injected failures are for simulations; split runs have no checkpoints, no Breslow or evaluate messages and
    no evaluation schedule."""
    debug = cfg.debug
    if cfg.data.deployed and (debug.fail_site or debug.stop_after_round):
        raise ConfigError("run config: 'debug.fail_site' and 'debug.stop_after_round' inject failures into "
                          f"simulations only; a deployment (data.name = {DEPLOYED_DATA!r}) must leave them at their "
                          "defaults ('' and 0)")
    if not STRATEGIES[cfg.strategy].vertical:
        return
    if cfg.evaluation_every != 1:
        raise ConfigError(f"run config: 'evaluation.every' = {cfg.evaluation_every} applies to horizontal runs only: "
                          f"strategy {cfg.strategy!r} evaluates once, after its last epoch (leave it at 1)")
    if debug.stop_after_round:  # resume.from: the split mechanisms do not honour it (Mechanism.honours)
        raise ConfigError("run config: 'debug.stop_after_round' applies to horizontal runs only: a split run keeps "
                          "each site's encoder in that site's node state, which no server checkpoint can restore")
    if debug.fail_site and debug.fail_message != "train":
        raise ConfigError(f"run config: a split run's sites answer training round trips only; "
                          f"'debug.fail_message' = {debug.fail_message!r} never happens there (use 'train')")


def _check_vertical_files(data: DataConfig, modalities: tuple[str, ...]) -> None:
    """``vertical_files`` names a labels file and its modality files, among which every one of ``modalities``
    (``split.modalities``); the keys of those files belong to it (and ``data.labels_path`` to a vertical
    deployment)."""
    if data.name != VERTICAL_FILES:
        stray = [key for key, value in (("data.modality_paths", data.modality_paths),
                                        ("data.labels_path", "" if data.deployed else data.labels_path)) if value]
        if stray:
            raise ConfigError(f"run config: {', '.join(repr(key) for key in stray)} name(s) the files of "
                              f"data.name = {VERTICAL_FILES!r} (data.labels_path also those of a vertical deployment, "
                              f"{DEPLOYED_DATA!r}); data.name = {data.name!r} has none")
        return
    if not data.labels_path or not data.modality_paths:
        raise ConfigError(f"run config: data.name = {VERTICAL_FILES!r} needs 'data.labels_path' (the labels file of "
                          "id, time and event) and 'data.modality_paths' (one file per modality, e.g. "
                          "'clinical=/abs/clin.csv,genomic=/abs/gen.parquet')")
    pairs = [modality_path(item) for item in data.modality_paths]
    for item, (name, path) in zip(data.modality_paths, pairs, strict=True):
        if not name or not path or not re.fullmatch(r"[\w.-]+", name):
            raise ConfigError(f"run config: 'data.modality_paths' item {item!r} is not modality=path (a modality "
                              "name of letters, digits, '_', '-' or '.', and a file)")
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"run config: 'data.modality_paths' names modality {repeated} more than once: one file per "
                          "modality (name them modality=path)")
    unknown = [name for name in modalities if name not in names]
    if unknown:
        raise ConfigError(f"run config: 'split.modalities' names {unknown}, which 'data.modality_paths' does not "
                          f"({', '.join(names)})")


def _check_event_values(cfg: ExperimentConfig) -> None:
    """``data.event_values`` only where a horizontal run reads ``data.event_col`` from a user's file (``csv``, a
    deployed site's file): a named data set's event column is fixed, and a vertical labels file is read as 0/1."""
    values = cfg.data.event_values
    if not values or (cfg.data.name in ("csv", DEPLOYED_DATA) and not STRATEGIES[cfg.strategy].vertical):
        return
    reader = (f"strategy {cfg.strategy!r} (its labels file holds 0/1 events)" if STRATEGIES[cfg.strategy].vertical
              else f"data.name = {cfg.data.name!r} (its event column is fixed, 0/1)")
    raise ConfigError(f"run config: data.event_values = {show_value(values)} has no effect on {reader}; it applies to "
                      f"data.name = 'csv' and {DEPLOYED_DATA!r} (horizontal): leave it at ''")


def _check_deployment(cfg: ExperimentConfig) -> None:
    """A deployment (``data.name = "site_files"``): the server holds no pooled data, and no simulation engine carries
    its messages."""
    if cfg.engine != AUTO:
        raise ConfigError(
            f"run config: 'simulation.engine' = {cfg.engine!r} chooses how a simulation carries its messages; a "
            f"deployment (data.name = {DEPLOYED_DATA!r}) runs over its SuperLink and must leave it at {AUTO!r}"
        )
    if cfg.server_evaluation or cfg.centralized_baseline:
        raise ConfigError(
            f"run config: data.name = {DEPLOYED_DATA!r} (a deployment) leaves no pooled data at the server: set "
            "evaluation.server_side = false (each site evaluates on its own held-out part) and "
            "baseline.centralized = false"
        )
    if STRATEGIES[cfg.strategy].vertical and (not cfg.data.labels_path or not cfg.split.modalities):
        raise ConfigError(
            f"run config: a vertical deployment (strategy 'split', data.name = {DEPLOYED_DATA!r}) needs "
            "'data.labels_path' (the label holder's file of id, time and event) and 'split.modalities' "
            "(the modality of every site, e.g. 'clinical,genomic')"
        )
