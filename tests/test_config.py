"""One configuration schema: the generated files, both entry points, and the checks that name the key."""

import json
import math
import re
import subprocess
import sys

import pytest
from flwr.common.config import get_fused_config_from_dir, parse_config_args
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from flwr_app.config import PROJECT_ROOT, ConfigError, hydra_files, parse_run_config, stale_files
from simulations.hydra_config import flatten
from strategies.config import DATA_SETS, DEPLOYED_DATA, KEYS, MODELS, STRATEGIES, defaults, parse_flat

CONF = PROJECT_ROOT / "conf"


def flower(overrides: dict | None = None):
    """What ``flwr run --run-config`` gives the apps: pyproject's table fused with the overrides, parsed."""
    return parse_run_config(get_fused_config_from_dir(PROJECT_ROOT, overrides or {}))


def hydra_flat(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return flatten(compose(config_name="config", overrides=list(overrides)))


def test_generated_files_match_the_schema():
    """pyproject.toml's table, conf/ and docs/configuration.md: `python -m flwr_app.config --write` rewrites them."""
    assert stale_files() == []


def test_pyproject_declares_every_key_with_the_schema_default():
    table = get_fused_config_from_dir(PROJECT_ROOT, {})
    assert list(table) == list(KEYS)
    for key, value in defaults().items():
        assert table[key] == value or (isinstance(value, float) and math.isinf(value) and math.isinf(table[key])), key


def test_parsing_imports_neither_torch_nor_flower():
    """The schema and every strategy's mechanism checks run without torch, opacus, Flower or pandas.

    One fresh interpreter parses a valid run config of every strategy with the apps' parser (the
    schema, then the mechanism's own checks from the registry) and lists what got imported; the
    DP set-up's module is torch-free too.
    """
    flats = {name: _option_overrides("strategy", name)[1] for name in STRATEGIES}
    code = ("import json, sys\n"
            "from flwr_app.config import parse_run_config\n"
            "from strategies.config import parse_flat\n"
            "cfg = parse_flat({'model.name': 'cox_mlp', 'data.feature_cols': 'age,sex', 'privacy.epsilon': 'inf'})\n"
            "assert cfg.model.num_durations == 100 and cfg.data.feature_cols == ('age', 'sex')\n"
            "for name, flat in json.loads(sys.argv[1]).items():\n"
            "    assert parse_run_config(flat).strategy == name, name\n"
            "print(sorted(name for name in ('torch', 'flwr', 'opacus', 'pandas') if name in sys.modules))\n"
            "import strategies.mechanisms.setup_statistics  # the DP set-up's planning: numpy and pandas\n"
            "print(sorted(name for name in ('torch', 'flwr', 'opacus') if name in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(flats)], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "[]"], out.stdout + out.stderr


def test_the_schema_names_the_registry_strategies_with_their_kind_and_adjacency():
    from strategies.mechanisms.registry import MECHANISMS

    assert list(STRATEGIES) == list(MECHANISMS)
    for name, mechanism in MECHANISMS.items():
        assert STRATEGIES[name].vertical == mechanism.vertical, name
        assert STRATEGIES[name].adjacency == mechanism.adjacencies[0], name
        assert STRATEGIES[name].accountant == mechanism.accountants[0], name


def test_the_schema_names_the_data_loaders_and_fault_modes():
    from flwr_app.faults import _TAMPERED_MESSAGE
    from models.data import DATASETS
    from models.data.vertical import VERTICAL_DATASETS
    from strategies.config import HORIZONTAL_DATASETS, HOSTILE_MODES
    from strategies.config import VERTICAL_DATASETS as SCHEMA_VERTICAL

    assert HORIZONTAL_DATASETS == DATASETS and SCHEMA_VERTICAL == VERTICAL_DATASETS
    assert set(DATA_SETS) == set(DATASETS) | set(VERTICAL_DATASETS) | {DEPLOYED_DATA}
    assert set(_TAMPERED_MESSAGE) == set(HOSTILE_MODES)


def test_the_schema_names_the_risk_layers_of_the_fusion_head_and_the_hazard_model():
    from models.survival import RISK_LAYERS

    assert set(KEYS["split.risk_layer"].setting.choices) == set(RISK_LAYERS)
    assert set(KEYS["model.risk_layer"].setting.choices) == set(RISK_LAYERS)


def test_model_risk_layer_is_read_by_the_hazard_model_only():
    from strategies.config import DP_SGD_RECIPE, TRAINING_DEFAULTS

    assert parse_flat({"model.risk_layer": "proportional"}).model.risk_layer == "proportional"
    assert parse_flat({}).model.risk_layer == TRAINING_DEFAULTS["model.risk_layer"]
    dp_sgd = parse_flat({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    assert dp_sgd.model.risk_layer == DP_SGD_RECIPE.get("model.risk_layer", TRAINING_DEFAULTS["model.risk_layer"])
    for model in ("cox_mlp", "cox_time"):
        with pytest.raises(ConfigError, match=r"model.risk_layer = 'interval' is read only by model.name = 'hazard_mlp'"):
            parse_flat({"model.name": model, "model.risk_layer": "interval"})
    with pytest.raises(ConfigError, match=r"model.risk_layer .*split.risk_layer"):
        parse_flat({"strategy.name": "split", "data.name": "synthetic_multimodal", "model.risk_layer": "proportional"})


def _option_overrides(group: str, option: str) -> tuple[list[str], dict]:
    """Hydra overrides and flwr run-config overrides choosing ``option`` of ``group`` (with what it needs)."""
    hydra, flat = [f"{group}={option}"], {f"{group}.name": option}
    vertical = (group == "data" and not DATA_SETS[option].horizontal) or (group == "model" and option in MODELS and MODELS[option].vertical) \
        or (group == "strategy" and STRATEGIES[option].vertical)
    if vertical:
        if group != "strategy":
            hydra.append("strategy=split")
            flat["strategy.name"] = "split"
        if group != "data":
            hydra.append("data=metabric")
            flat["data.name"] = "metabric"
    if group == "data" and option == "csv":
        hydra.append("data.path=/x.csv")
        flat["data.path"] = "/x.csv"
    if group == "data" and option == "vertical_files":  # Hydra reads name=path items in a quoted string
        hydra += ["data.labels_path=/l.csv", 'data.modality_paths="clinical=/c.csv,/d/genomic.parquet"']
        flat.update({"data.labels_path": "/l.csv", "data.modality_paths": "clinical=/c.csv,/d/genomic.parquet"})
    if group == "strategy" and option not in ("fedavg", "split"):
        hydra.append("privacy=dp")
        flat["privacy.epsilon"] = 1.0
    if group == "strategy" and option == "private_split":  # its private set-up alone needs about epsilon 1
        hydra.append("privacy.epsilon=10")
        flat["privacy.epsilon"] = 10.0
    return hydra, flat


@pytest.mark.parametrize(("group", "option"), [(group, path.stem) for group in ("data", "model", "strategy")
                                               for path in sorted((CONF / group).glob("*.yaml"))
                                               if path.stem != "base"])
def test_a_hydra_group_option_and_its_flwr_run_config_give_the_same_run(group, option):
    hydra, flat = _option_overrides(group, option)
    via_hydra = parse_run_config(hydra_flat(*hydra))
    via_flower = flower(flat)
    assert via_hydra == via_flower
    if group == "strategy":
        assert via_flower.strategy == option
    elif option != "auto":
        assert getattr(via_flower, group).name == option


def test_hydra_defaults_are_the_schema_defaults():
    assert parse_run_config(hydra_flat()) == parse_run_config({}) == flower()


def test_a_cox_model_gets_its_grid_of_100_from_either_entry_point():
    """`model=cox_mlp` (Hydra) and `--run-config "model.name='cox_mlp'"` agree: the results used 100."""
    via_flower = flower(parse_config_args(["model.name='cox_mlp' federation.rounds=7"]))
    assert via_flower == parse_run_config(hydra_flat("model=cox_mlp", "federation.rounds=7"))
    assert via_flower.model.num_durations == 100
    assert flower({"model.name": "cox_mlp", "model.num_durations": 50}).model.num_durations == 50
    assert parse_run_config(hydra_flat("model=cox_mlp", "model.num_durations=50")).model.num_durations == 50
    assert flower({"data.name": "sim_cox"}).data.test_fraction == 0.3 == parse_run_config(
        hydra_flat("data=sim_cox")).data.test_fraction


def test_split_trains_a_vertical_model_unless_told_otherwise():
    via_hydra = parse_run_config(hydra_flat("strategy=split", "data=metabric"))
    via_flower = flower({"strategy.name": "split", "data.name": "metabric"})
    assert via_hydra == via_flower
    assert via_flower.model.name == "bayesian_multisurv" and via_flower.model.num_durations == 30
    assert flower({"strategy.name": "split", "data.name": "metabric", "model.name": "multisurv"}).model.name \
        == "multisurv"
    with pytest.raises(ConfigError, match="'model.name' = 'hazard_mlp' is a horizontal model; strategy 'split'"):
        parse_run_config(hydra_flat("strategy=split", "data=metabric", "model=hazard_mlp"))
    with pytest.raises(ConfigError, match="'model.name' = 'multisurv' is a vertical .* use strategy.name = 'split'"):
        flower({"model.name": "multisurv"})


def test_lists_take_hydra_brackets_and_flower_strings():
    via_hydra = parse_run_config(hydra_flat("data.feature_cols=[age,sex]", "data.drop_cols=[pid]",
                                            "model.hidden=[64,32]"))
    via_flower = flower(parse_config_args(["data.feature_cols='age,sex' data.drop_cols='pid' model.hidden='64, 32'"]))
    assert via_hydra == via_flower
    assert via_flower.data.feature_cols == ("age", "sex") and via_flower.data.drop_cols == ("pid",)
    assert via_flower.model.hidden == (64, 32)
    split = parse_run_config(hydra_flat("strategy=split", "data=metabric", "split.modalities=[genomic,clinical]"))
    assert split.split.modalities == ("genomic", "clinical")
    with pytest.raises(ConfigCompositionException, match="Ambiguous value"):  # why docs/configuration.md writes brackets
        hydra_flat("split.modalities=genomic,clinical")


def test_the_user_data_keys():
    cfg = parse_run_config({"data.id_col": "patient", "data.drop_cols": "site,batch", "data.split_col": "fold"})
    assert (cfg.data.id_col, cfg.data.drop_cols, cfg.data.split_col) == ("patient", ("site", "batch"), "fold")
    assert flower().data.id_col == "" and flower().data.drop_cols == () and flower().data.split_col == ""


def test_unknown_key_is_refused_with_the_known_keys():
    with pytest.raises(ConfigError, match="unknown run-config key.*federation.num_site\\b.*known keys"):
        parse_run_config({"federation.num_site": 3})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"model.name": "resnet"}, "'model.name' = 'resnet'; choose one of hazard_mlp"),
        ({"federation.rounds": 0}, "'federation.rounds' must be > 0"),
        ({"federation.rounds": "ten"}, "'federation.rounds' must be int"),
        ({"data.test_fraction": 1.5}, "'data.test_fraction' must be in \\[0, 1\\)"),
        ({"model.dropout": 1.0}, "'model.dropout' must be in \\[0, 1\\)"),
        ({"model.hidden": "64,0"}, "'model.hidden' must be > 0"),
        ({"model.num_durations": "many"}, "'model.num_durations' must be int or 'auto'"),
        ({"privacy.epsilon": 1.0}, "strategy 'fedavg' adds no noise"),
        ({"strategy.name": "dp_sgd"}, "'dp_sgd' needs a finite 'privacy.epsilon'"),
        ({"strategy.name": "bdp", "privacy.epsilon": 1.0, "model.name": "cox_time"}, "not per-sample decomposable"),
        ({"strategy.name": "central_dp", "privacy.epsilon": 1.0, "federation.fraction_train": 0.5},
         "without sub-sampling amplification"),
        ({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "model.name": "cox_mlp"}, "not per-sample decomposable"),
        ({"privacy.accountant": "gdp"}, "'privacy.accountant' = 'gdp'; choose one of pld, prv, rdp"),
        ({"data.name": "csv"}, "data.name='csv' needs 'data.path'"),
        ({"model.hidden": "64,x"}, "'model.hidden'"),
        ({"strategy.name": "split"}, "strategy 'split' needs a vertical data set"),
        ({"strategy.name": "split", "data.name": "metabric", "model.name": "cox_mlp"},
         "'model.name' = 'cox_mlp' is a horizontal model; strategy 'split' trains bayesian_multisurv or multisurv"),
        ({"strategy.name": "split", "data.name": "metabric", "privacy.adjacency": "add-remove"},
         "add/remove is not offered"),
        ({"strategy.name": "split", "data.name": "metabric", "split.calibration": "x"},
         "'split.calibration' = 'x'; choose one of rdp, paper"),
        ({"data.name": "synthetic_multimodal"}, "is vertical"),
        ({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "privacy.adjacency": "replace-one"},
         "is not offered for strategy 'dp_sgd'"),
        ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "privacy.accountant": "pld"},
         "privacy.accountant = 'pld' is not offered for strategy 'distributed_dp'"),
        ({"strategy.name": "nbafl", "privacy.epsilon": 1.0, "privacy.accountant": "prv"},
         "privacy.accountant = 'prv' is not offered for strategy 'nbafl'"),
        ({"strategy.name": "split", "data.name": "metabric", "privacy.epsilon": 1.0, "privacy.accountant": "pld"},
         "privacy.accountant = 'pld' is not offered for strategy 'split'"),
        ({"split.clean_inference": "yes"}, "'split.clean_inference' must be bool"),
        ({"data.feature_cols": 3}, "'data.feature_cols' must be a list or a comma-separated string"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(override)


def test_auto_means_model_default_and_lists_parse():
    cfg = parse_run_config({"model.hidden": "64, 32", "model.dropout": "0.2"})
    assert cfg.model.hidden == (64, 32) and cfg.model.dropout == pytest.approx(0.2)
    cfg = parse_run_config({})
    assert cfg.model.hidden is None and cfg.model.dropout is None and not cfg.privacy.enabled


@pytest.mark.parametrize(("strategy", "expected"), [("dp_sgd", "pld"), ("central_dp", "pld"),
                                                    ("distributed_dp", "rdp"), ("bdp", "rdp"), ("nbafl", "rdp")])
def test_accountant_auto_is_the_tightest_sound_one_of_the_strategy(strategy, expected):
    cfg = parse_run_config({"strategy.name": strategy, "privacy.epsilon": 1.0})
    assert cfg.privacy.accountant == expected
    assert parse_run_config({"strategy.name": strategy, "privacy.epsilon": 1.0,
                             "privacy.accountant": "rdp"}).privacy.accountant == "rdp"


def test_adjacency_auto_is_replace_one_for_split_and_add_remove_otherwise():
    horizontal = parse_run_config({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    assert horizontal.privacy.adjacency == "add-remove"
    vertical = parse_run_config({"strategy.name": "split", "data.name": "metabric", "privacy.epsilon": 1.0,
                                 "split.modalities": "clinical, genomic"})
    assert vertical.privacy.adjacency == "replace-one" and vertical.split.modalities == ("clinical", "genomic")
    plain = parse_run_config({"strategy.name": "split", "data.name": "metabric", "model.name": "multisurv"})
    assert not plain.privacy.enabled  # split learning without embedding noise is allowed (no DP)


def test_a_deployment_needs_federated_evaluation_and_a_vertical_one_its_labels_file():
    deployed = {"data.name": "site_files"}
    with pytest.raises(ConfigError, match="evaluation.server_side = false"):
        parse_run_config(deployed)
    local = {"evaluation.server_side": False, "baseline.centralized": False}
    assert parse_run_config({**deployed, **local}).data.deployed
    vertical = {**deployed, **local, "strategy.name": "split"}
    with pytest.raises(ConfigError, match="'data.labels_path'"):
        parse_run_config(vertical)
    cfg = parse_run_config({**vertical, "data.labels_path": "/l.csv", "split.modalities": "a,b"})
    assert cfg.split.modalities == ("a", "b") and cfg.model.name == "bayesian_multisurv"


FLOAT_KEYS = sorted(name for name, key in KEYS.items() if key.kind == "float")
INT_KEYS = sorted(name for name, key in KEYS.items() if key.kind == "int")


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_and_infinity_are_refused_for_every_float_key(key):
    """NaN passes every comparison (``nan < 0`` is false), so each range check would let it through."""
    with pytest.raises(ConfigError, match=f"'{re.escape(key)}' must be a number, got nan"):
        parse_flat({key: math.nan})
    with pytest.raises(ConfigError, match=f"'{re.escape(key)}' must be finite, got -inf"):
        parse_flat({key: -math.inf})
    if KEYS[key].setting.infinite:  # privacy.epsilon = inf: no differential privacy
        assert math.isinf(parse_flat({key: math.inf}).privacy.epsilon)
        assert math.isinf(parse_flat({key: "inf"}).privacy.epsilon)
    else:
        for value in (math.inf, "inf"):
            with pytest.raises(ConfigError, match=f"'{re.escape(key)}' must be finite, got inf"):
                parse_flat({key: value})


@pytest.mark.parametrize("key", INT_KEYS)
def test_nan_is_refused_for_every_integer_key(key):
    with pytest.raises(ConfigError, match=f"'{re.escape(key)}' must be int, got nan"):
        parse_flat({key: math.nan})


def test_nan_reaches_the_check_from_both_command_lines():
    """``train.lr=nan`` is a float NaN on the Hydra command line and in ``flwr run --run-config``."""
    with pytest.raises(ConfigError, match="'train.lr' must be a number, got nan"):
        parse_flat(hydra_flat("train.lr=nan"))
    with pytest.raises(ConfigError, match="'privacy.clip_norm' must be a number, got nan"):
        parse_flat(get_fused_config_from_dir(PROJECT_ROOT, parse_config_args(["privacy.clip_norm=nan"])))
    for key in ("model.dropout", "model.hidden", "model.num_durations", "data.test_fraction"):
        with pytest.raises(ConfigError, match=f"'{key}' must be a number, got nan"):
            parse_flat({key: "nan"})


def test_every_hydra_group_file_is_generated():
    generated = set(hydra_files())
    on_disk = {str(path.relative_to(CONF)) for path in CONF.rglob("*.yaml")}
    assert on_disk - generated == {"sweep.yaml", "hydra/job_logging/console.yaml"}


def test_training_keys_left_at_auto_take_the_strategys_recipe_and_an_explicit_value_wins():
    from strategies.config import (
        DISTRIBUTED_DP_RECIPE,
        DP_SGD_RECIPE,
        PRIVATE_SPLIT_RECIPE,
        SPLIT_RECIPE,
        TRAINING_DEFAULTS,
    )

    def training(cfg):
        return {"train.local_epochs": cfg.train.local_epochs, "train.batch_size": cfg.train.batch_size,
                "train.lr": cfg.train.lr, "privacy.clip_norm": cfg.privacy.clip_norm,
                "federation.rounds": cfg.federation.rounds, "split.risk_layer": cfg.split.risk_layer,
                "privacy.setup_share": cfg.privacy.setup_share, "model.risk_layer": cfg.model.risk_layer}

    assert training(parse_flat({"strategy.name": "fedavg"})) == dict(TRAINING_DEFAULTS)
    for strategy in ("dp_sgd", "bdp"):
        assert training(parse_flat({"strategy.name": strategy})) == {**TRAINING_DEFAULTS, **DP_SGD_RECIPE}
    assert training(parse_flat({"strategy.name": "distributed_dp"})) == {**TRAINING_DEFAULTS, **DISTRIBUTED_DP_RECIPE}
    split = parse_flat({"strategy.name": "split", "data.name": "metabric", "model.name": "bayesian_multisurv"})
    assert training(split) == {**TRAINING_DEFAULTS, **SPLIT_RECIPE}
    private = parse_flat({"strategy.name": "private_split", "data.name": "metabric", "privacy.epsilon": 10.0})
    assert training(private) == {**TRAINING_DEFAULTS, **PRIVATE_SPLIT_RECIPE}
    assert private.split.risk_layer == split.split.risk_layer == "proportional"
    assert DP_SGD_RECIPE["train.lr"] != 0.005 and TRAINING_DEFAULTS["train.lr"] != 0.005
    explicit = parse_flat({"strategy.name": "dp_sgd", "train.lr": 0.005, "privacy.clip_norm": "auto"})
    assert explicit.train.lr == 0.005 and explicit.privacy.clip_norm == DP_SGD_RECIPE["privacy.clip_norm"]
