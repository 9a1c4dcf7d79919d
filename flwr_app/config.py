"""Run configuration: flat run-config keys -> typed, frozen configuration objects, and the files generated from the schema.

The schema is the dataclasses of :mod:`strategies.config` (every key's default, choices or bounds
and help text). From it this module generates ``pyproject.toml``'s ``[tool.flwr.app.config]``
table (what ``flwr run --run-config`` overrides), Hydra's ``conf/`` tree (one file per group
option) and ``docs/configuration.md`` (and, from the privacy mechanisms' declarations,
``docs/privacy-reference.md``); ``python -m flwr_app.config --write`` rewrites them and a
test fails when one differs (``--check`` lists those that do).

:func:`parse_run_config` is what the ServerApp, the ClientApp and the simulations call: the
schema's :func:`~strategies.config.parse_flat` (types, choices, bounds, ``auto`` defaults, keys
that go together; no torch) followed by the checks of the strategy's privacy mechanism.
:func:`resolve` fuses a run's overrides with ``pyproject.toml``'s defaults and parses them, and
:func:`check_inputs` reads the run's data file and checks its output directory: the checks a run
makes before it starts (``python -m simulations.run``; ``--check-run`` for ``make flwr``). An
unknown key is refused with the nearest known ones (:func:`did_you_mean`). Importing this module
imports neither torch nor Flower.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import math
import sys
import threading
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr_app.outputs import RunOutputs
from strategies.config import (
    AUTO,
    DATA_SETS,
    DEFAULT_MODEL,
    DEPLOYED_DATA,
    KEYS,
    MODELS,
    PRIVACY_PRESETS,
    STRATEGIES,
    ConfigError,
    DataConfig,
    DebugConfig,
    ExperimentConfig,
    FederationConfig,
    Key,
    ModelConfig,
    PrivacyConfig,
    SplitConfig,
    TrainConfig,
    parse_flat,
)

if TYPE_CHECKING:
    import pandas as pd

    from models.data.datasets import ColumnRoles

__all__ = [
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DEPLOYED_DATA",
    "ExperimentConfig",
    "FederationConfig",
    "ModelConfig",
    "PrivacyConfig",
    "PROJECT_ROOT",
    "SplitConfig",
    "STRATEGIES",
    "TrainConfig",
    "check_inputs",
    "column_roles",
    "did_you_mean",
    "generated_files",
    "parse_run_config",
    "project_run_config",
    "resolve",
    "stale_files",
    "write_files",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent


#: How many parsed run configs :func:`parse_run_config` keeps (a process serves one run's config, or a few).
PARSED_CONFIGS = 16
_parsed: collections.OrderedDict[tuple, ExperimentConfig] = collections.OrderedDict()
_parsed_lock = threading.Lock()


def _config_key(flat: Mapping[str, Any]) -> tuple | None:
    """A run config's content as a hashable key (each value with its type, so ``1``, ``1.0`` and ``True``
    differ), or None when a key is not a string."""
    if not all(isinstance(key, str) for key in flat):
        return None
    return tuple(sorted((key, type(value).__qualname__, repr(value)) for key, value in flat.items()))


def parse_run_config(flat: Mapping[str, Any]) -> ExperimentConfig:
    """Validate a flat run config (``{"data.name": "flchain", ...}``) into typed objects.

    The result is memoised by the config's content (:data:`PARSED_CONFIGS` of them, least recently
    used dropped first): the same flat config gives the same frozen object without re-running the
    checks (a site's every message carries its run's config). A config that fails is not kept.

    Raises
    ------
    ConfigError
        On an unknown key, data set, model or strategy, a value of the wrong type or out of
        range, keys that do not go together, a key the strategy's mechanism does not honour at a
        value but its default (:meth:`~strategies.mechanisms.base.Mechanism.check_keys`), or a
        configuration the mechanism cannot honour. The message names the key.
    """
    key = _config_key(flat)
    if key is not None:
        with _parsed_lock:
            if (cfg := _parsed.get(key)) is not None:
                _parsed.move_to_end(key)
                return cfg
    cfg = _parse(flat)
    if key is not None:
        with _parsed_lock:
            _parsed[key] = cfg
            while len(_parsed) > PARSED_CONFIGS:
                _parsed.popitem(last=False)
    return cfg


def _parse(flat: Mapping[str, Any]) -> ExperimentConfig:
    from strategies.mechanisms.registry import get_mechanism  # the mechanisms need torch; the schema does not

    cfg = parse_flat(flat)
    mechanism = get_mechanism(cfg.strategy)
    mechanism.check_keys(cfg)
    mechanism.check(cfg)
    return cfg


# ------------------------------------------------------------------ checks before a run (no torch, Ray or Flower)

#: Where every run-config key, data set, model and strategy is listed (an unknown name's error points there).
KEYS_PAGE = "docs/configuration.md"
#: How many near names an unknown name's error suggests at most.
SUGGESTIONS = 3


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean a or b?"`` with the names of ``known`` closest to ``name`` (:mod:`difflib`), or ``""`` when
    none is close. A dotted key is matched by its last part among its group's keys first (``federation.round`` ->
    ``federation.rounds``), then by its whole name, then by its last part among every key's (``rounds`` ->
    ``federation.rounds``)."""
    known = sorted(set(known) - {name})
    group, _, leaf = name.rpartition(".")

    def by_leaf(keys: list[str], cutoff: float) -> list[str]:
        leaves: dict[str, list[str]] = {}
        for key in keys:
            leaves.setdefault(key.rpartition(".")[2], []).append(key)
        matches = difflib.get_close_matches(leaf, list(leaves), n=SUGGESTIONS, cutoff=cutoff)
        return [key for match in matches for key in leaves[match]][:SUGGESTIONS]

    close = by_leaf([key for key in known if key.rpartition(".")[0] == group], 0.6) if group else []
    close = close or difflib.get_close_matches(name, known, n=SUGGESTIONS, cutoff=0.75) or by_leaf(known, 0.75)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def unknown_keys_error(unknown: Sequence[str], known: Iterable[str]) -> ConfigError:
    """One line for run-config keys that ``known`` lacks: each with its nearest known keys, and where every key is
    listed (:data:`KEYS_PAGE`), never the list itself."""
    known = list(known)
    if len(unknown) == 1:
        return ConfigError(f"run config: unknown key {unknown[0]}{did_you_mean(unknown[0], known)} "
                           f"(every key: {KEYS_PAGE})")
    named = ", ".join(f"{key} ({hint[2:]})" if (hint := did_you_mean(key, known)) else key for key in unknown)
    return ConfigError(f"run config: unknown keys {named}; every key: {KEYS_PAGE}")


def project_run_config(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``pyproject.toml``'s ``[tool.flwr.app.config]`` as flat keys: the defaults that ``flwr run`` fuses a run's
    overrides into (as ``flwr.common.config.get_fused_config_from_dir`` reads them, without importing Flower). An
    installed package (no ``pyproject.toml`` beside it) takes the same table from the schema it is generated from
    (:func:`pyproject_table`)."""
    path = root / "pyproject.toml"
    if path.is_file():
        with path.open("rb") as file:
            table = tomllib.load(file)["tool"]["flwr"]["app"].get("config", {})
    else:
        table = tomllib.loads(pyproject_table())["tool"]["flwr"]["app"]["config"]
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(table, "")
    return flat


def resolve(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], ExperimentConfig]:
    """Fuse ``overrides`` with the pyproject defaults (:func:`project_run_config`) and validate the result.

    Imports neither torch, Ray nor Flower: a bad key or value is refused within a second.

    Raises
    ------
    ConfigError
        For a key the schema does not declare (one line: the nearest keys, :func:`unknown_keys_error`) or a bad
        value (:func:`parse_run_config`).
    """
    defaults = project_run_config()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise unknown_keys_error(unknown, defaults)
    fused = {**defaults, **overrides}
    return fused, parse_run_config(fused)


def column_roles(cfg: ExperimentConfig) -> ColumnRoles:
    """What the run config says about its table's columns (the simulated table and a deployed site's own file):
    ``data.id_col``, ``data.drop_cols``, ``data.split_col``, ``data.categorical_cols`` and ``data.event_values``."""
    from models.data.datasets import ColumnRoles

    return ColumnRoles(id_col=cfg.data.id_col, drop_cols=cfg.data.drop_cols, split_col=cfg.data.split_col,
                       categorical=cfg.data.categorical_cols, event_values=cfg.data.event_values)


def check_inputs(cfg: ExperimentConfig, frame: pd.DataFrame | None = None) -> None:
    """Check what a run writes and reads before it starts (pandas and numpy only; no torch, Ray or Flower).

    ``output.dir`` (or ``resume.from``) is checked first when the run config names one
    (:meth:`flwr_app.outputs.RunOutputs.create`; a new directory is created). Then a horizontal run's table is read
    and validated (:func:`models.data.load_table`: ``data.path`` names a file, its columns, outcome and column
    roles), or ``frame`` (the records of a ``data.name = csv`` run, given as a frame: validated as its file would
    be, errors naming ``data.path``), and its records are partitioned into sites and split as the run will
    (:func:`models.data.federated.site_splits`: enough records for every site, a test record and a training event
    at each).

    Raises
    ------
    models.data.DataValidationError
        For a file or partition that cannot be used, in one line naming the file, the column or the key, and the fix.
    ConfigError
        For an ``output.dir`` that holds another run or cannot be written.
    """
    from models.data import DATASETS, load_table
    from models.data.datasets import DEFAULT_OUTCOME, readable_file, table_from_frame
    from models.data.federated import site_splits
    from models.data.files import resolve_data_dir
    from models.data.partition import SCHEMES

    if cfg.output_dir or cfg.resume_from:
        RunOutputs.create(cfg)
    data, federation = cfg.data, cfg.federation
    if not STRATEGIES[cfg.strategy].vertical and data.name in DATASETS:
        if frame is not None:
            table = table_from_frame(frame, source=data.path, time_col=data.time_col or DEFAULT_OUTCOME[0],
                                     event_col=data.event_col or DEFAULT_OUTCOME[1], feature_cols=data.feature_cols,
                                     roles=column_roles(cfg), identifiers=True)
        else:
            if data.path:
                readable_file(data.path, key="data.path")
            table = load_table(data.name, path=data.path, data_dir=str(resolve_data_dir(data.dir)),
                               time_col=data.time_col, event_col=data.event_col, feature_cols=data.feature_cols,
                               sba_horizon_months=data.horizon_months, roles=column_roles(cfg), notes=False)
        if federation.partition not in SCHEMES:
            table = table.with_group(federation.partition)
        site_splits(table, name=data.name, seed=cfg.seed, num_sites=federation.num_sites,
                    partition=federation.partition, dirichlet_alpha=federation.dirichlet_alpha,
                    test_fraction=data.test_fraction, min_site_records=federation.min_site_records,
                    oot_start=data.oot_start)


# ------------------------------------------------------------------ the generated files

GENERATED_BY = "Generated from the schema (strategies/config.py) by `python -m flwr_app.config --write`; edit the " \
               "schema, not this file."
#: Hydra's config groups: the first part of their keys, and the option the defaults list picks.
HYDRA_GROUPS: Mapping[str, str] = {"data": KEYS["data.name"].default, "model": KEYS["model.name"].default,
                                   "strategy": KEYS["strategy.name"].default, "privacy": "none",
                                   "federation": "default"}
#: The data sets Hydra offers (a deployment runs through ``flwr run`` at the partner sites, not a simulation).
HYDRA_DATA_SETS = tuple(name for name in DATA_SETS if name != DEPLOYED_DATA)
PYPROJECT_TABLE = "[tool.flwr.app.config]"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _float(value, yaml=False)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def _yaml(value: Any) -> str:
    if isinstance(value, float):
        return _float(value, yaml=True)
    return _toml(value)  # a JSON string is a YAML double-quoted scalar


def _float(value: float, *, yaml: bool) -> str:
    if math.isinf(value):
        return (".inf" if yaml else "inf") if value > 0 else ("-.inf" if yaml else "-inf")
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        mantissa = mantissa if "." in mantissa or not yaml else f"{mantissa}.0"  # YAML 1.1 floats need the dot
        return f"{mantissa}e{int(exponent)}"
    return text


def _values(key: Key) -> str:
    """What a key accepts beyond its type: choices, bounds, ``auto``, ``inf``."""
    parts = []
    if key.setting.choices:
        parts.append(" | ".join(key.setting.choices))
    if key.setting.bounds is not None:
        parts.append(str(key.setting.bounds) if not key.kind.startswith("list") else f"each {key.setting.bounds}")
    if key.setting.auto:
        parts.append(f"auto = {key.setting.auto}")
    if key.setting.infinite:
        parts.append(f"inf = {key.setting.infinite}")
    return "; ".join(parts)


def _comment(key: Key) -> str:
    values = _values(key)
    return f"{key.setting.help}{f' ({values})' if values else ''}"


def pyproject_table() -> str:
    """The ``[tool.flwr.app.config]`` table: every key, its default and what it means."""
    lines = [PYPROJECT_TABLE, f"# {GENERATED_BY}", "# Lists are comma-separated strings (Flower's run config holds "
             "scalars); every key: docs/configuration.md"]
    for name, key in KEYS.items():
        lines.append(f"{f'{name} = {_toml(key.default)}':<40} # {_comment(key)}")
    return "\n".join(lines) + "\n"


def _yaml_block(entries: Mapping[str, Any], comments: Mapping[str, str], indent: int = 0) -> list[str]:
    """Nested YAML of dotted ``entries`` (in their order), each leaf with its comment."""
    lines: list[str] = []
    opened: list[str] = []
    for dotted, value in entries.items():
        parts = dotted.split(".")
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            lines.append(f"{' ' * (indent + 2 * depth)}{parts[depth]}:")
            opened.append(parts[depth])
        leaf = f"{' ' * (indent + 2 * (len(parts) - 1))}{parts[-1]}: {_yaml(value)}"
        lines.append(f"{leaf:<36} # {comments[dotted]}" if comments.get(dotted) else leaf)
    return lines


def _group_keys(group: str) -> dict[str, Key]:
    """The keys of a Hydra group, by their name within it (``data.name`` -> ``name``)."""
    return {name.split(".", 1)[1]: key for name, key in KEYS.items() if name.split(".")[0] == group}


def _option_file(group: str, help_text: str, values: Mapping[str, Any]) -> str:
    """A group option that takes ``base.yaml`` and sets ``values`` over it."""
    keys = _group_keys(group)
    body = _yaml_block(values, {name: keys[name].setting.help for name in values if name != "name"})
    return "\n".join([f"# {GENERATED_BY}", f"# {help_text}", "defaults:", "  - base", "  - _self_", "", *body]) + "\n"


def _full_group_file(group: str, help_text: str, overrides: Mapping[str, Any]) -> str:
    """A group file that lists every key of the group (``overrides`` over the defaults)."""
    keys = _group_keys(group)
    values = {name: overrides.get(name, key.default) for name, key in keys.items()}
    body = _yaml_block(values, {name: _comment(key) for name, key in keys.items()})
    return "\n".join([f"# {GENERATED_BY}", f"# {help_text}", *body]) + "\n"


def _config_yaml() -> str:
    top = {name: key for name, key in KEYS.items() if name.split(".")[0] not in HYDRA_GROUPS}
    body = _yaml_block({name: key.default for name, key in top.items()},
                       {name: _comment(key) for name, key in top.items()})
    return "\n".join([
        f"# {GENERATED_BY}",
        "# Hydra entry point for `python -m simulations.run` and `python -m simulations.sweep`; every key and group",
        "# option: docs/configuration.md.",
        "defaults:",
        *(f"  - {group}: {option}" for group, option in HYDRA_GROUPS.items()),
        "  # Log records to the console only (conf/hydra/job_logging/console.yaml): the run's run.log is",
        "  # the ServerApp's own (flwr_app/runlog.py).",
        "  - override hydra/job_logging: console",
        "  - _self_",
        "",
        *body,
        "",
        "hydra:",
        "  run:",
        "    dir: outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}-${data.name}-${strategy.name}",
        "  sweep:",
        "    dir: multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}",
        "    subdir: ${hydra.job.num}",
        "  job:",
        "    chdir: false",
    ]) + "\n"


def hydra_files() -> dict[str, str]:
    """Hydra's ``conf/`` tree (path under ``conf/`` -> text), but for the hand-written sweep and logging files."""
    files = {"config.yaml": _config_yaml()}
    files["data/base.yaml"] = _full_group_file("data", "Every data set's keys; each data set's file sets what is "
                                                       "its own.", {})
    for name in HYDRA_DATA_SETS:
        data = DATA_SETS[name]
        kind = "strategy=split only" if not data.horizontal else "also strategy=split" if data.vertical else ""
        files[f"data/{name}.yaml"] = _option_file(
            "data", f"{data.help}{f' ({kind})' if kind else ''}.", {"name": name, "test_fraction": data.test_fraction})
    files["model/base.yaml"] = _full_group_file("model", "Every model's keys; each model's file sets what is its own.",
                                                {})
    files[f"model/{AUTO}.yaml"] = _option_file(
        "model", f"The strategy's model: {DEFAULT_MODEL['horizontal']}, or {DEFAULT_MODEL['vertical']} for "
                 "strategy=split (model.name = auto).", {"name": AUTO})
    for name, model in MODELS.items():
        files[f"model/{name}.yaml"] = _option_file(
            "model", f"{model.help} ({'strategy=split' if model.vertical else 'horizontal strategies'}).",
            {"name": name, "num_durations": model.num_durations})
    for name, strategy in STRATEGIES.items():
        files[f"strategy/{name}.yaml"] = "\n".join([f"# {GENERATED_BY}", f"# {strategy.help}.",
                                                    f"name: {_yaml(name)}"]) + "\n"
    for name, preset in PRIVACY_PRESETS.items():
        sets = ", ".join(f"privacy.{key} = {_toml(value)}" for key, value in preset.items()) or "the defaults"
        files[f"privacy/{name}.yaml"] = _full_group_file("privacy", f"privacy={name}: {sets}.", preset)
    files["federation/default.yaml"] = _full_group_file("federation", "Sites, rounds, partition and aggregation.", {})
    return files


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _type(key: Key) -> str:
    kind = key.kind.replace("list[str]", "list of str").replace("list[int]", "list of int")
    return f"{kind} or auto" if key.setting.auto else kind


def configuration_page() -> str:
    """``docs/configuration.md``: how to set keys, every key, and the defaults each group option brings."""
    lines = [*_page_intro(), *_key_tables(), *_mechanism_keys_section(), *_group_defaults()]
    return "\n".join(lines) + "\n"


def _page_intro() -> list[str]:
    """The lines of :func:`configuration_page` up to its ``## Keys`` heading: how to set keys in each front end."""
    return [
        "# Configuration",
        "",
        f"<!-- {GENERATED_BY} -->",
        "",
        "Every run reads the same keys, whichever way it is started. Their single source is the schema in",
        "`strategies/config.py`; `pyproject.toml` (`[tool.flwr.app.config]`, what `flwr run` reads), Hydra's `conf/`",
        "(what `python -m simulations.run` and `simulations.sweep` read) and this page are generated from it, and a",
        "test fails when one of them differs (`python -m flwr_app.config --write` rewrites them, `--check` lists those",
        "that differ). `strategies.config.parse_flat` validates a flat mapping of keys without",
        "importing torch or Flower; `flwr_app.config.parse_run_config` adds the checks of the strategy's privacy",
        "mechanism. An unknown key, a value of the wrong type, a name outside its choices, a number outside its",
        "bounds, NaN, or `inf` where it means nothing is refused with an error that names the key.",
        "",
        "## Setting keys",
        "",
        "| what | Hydra (`python -m simulations.run ...`) | `flwr run . local --run-config \"...\"` | Python "
        "(`simulations.engine`) |",
        "| --- | --- | --- | --- |",
        "| a number | `federation.rounds=30` | `federation.rounds=30` | `{\"federation.rounds\": 30}` |",
        "| a string | `data.name=metabric` | `data.name='metabric'` | `{\"data.name\": \"metabric\"}` |",
        "| a list | `'data.feature_cols=[age,sex]'` | `data.feature_cols='age,sex'` | `{\"data.feature_cols\": "
        "\"age,sex\"}` |",
        "| no DP | `privacy=none` (the default) | `privacy.epsilon=inf` | `{\"privacy.epsilon\": math.inf}` |",
        "| a group option | `model=cox_mlp` | `model.name='cox_mlp'` | `{\"model.name\": \"cox_mlp\"}` |",
        "",
        "Lists: Hydra reads `key=a,b` as a sweep over `a` and `b` and refuses it (\"Ambiguous value\"); write the",
        "list in brackets and quote it for the shell (`'split.modalities=[genomic,clinical]'`). `flwr run` takes",
        "scalars only, so a list there is one comma-separated string. Both forms work everywhere; `\"\"` is the",
        "empty list.",
        "",
        "Group options: Hydra's `data=`, `model=` and `strategy=` pick a file of `conf/<group>/` that sets the",
        "option's name and its own defaults; `privacy=dp` is a Hydra preset (`privacy.epsilon=1`). A key whose",
        "default is `auto` takes the chosen option's value, so `model=cox_mlp` (Hydra) and `model.name='cox_mlp'`",
        "(`flwr run`) give the same `model.num_durations`; set the key to override it. `strategy=split` trains",
        f"`{DEFAULT_MODEL['vertical']}` unless `model.name` names another vertical model; naming a horizontal model",
        "with `split`, or a vertical one without it, is an error.",
        "",
        "## Keys",
    ]


def _key_tables() -> list[str]:
    """:func:`configuration_page`'s table of every key (name, type, default, values, meaning), one per section."""
    lines: list[str] = []
    sections: dict[str, list[str]] = {}
    for name, key in KEYS.items():
        group = name.split(".")[0]
        section = group if group in HYDRA_GROUPS or group in ("train", "split", "cox", "debug") else "run"
        sections.setdefault(section, []).append(
            f"| `{name}` | {_type(key)} | `{_toml(key.default)}` | {_cell(_values(key))} | {_cell(key.setting.help)} |")
    for section, rows in sections.items():
        lines += ["", f"### {section}", "", "| key | type | default | values | meaning |", "| --- | --- | --- | --- | --- |",
                  *rows]
    return lines


def _group_defaults() -> list[str]:
    """:func:`configuration_page`'s ``## Group defaults``: what each data set, model, strategy and Hydra privacy
    preset sets."""
    lines = ["", "## Group defaults", "", "### Data sets (`data.name`; Hydra `data=<name>`)", "",
              "| data set | horizontal | split | `data.test_fraction` (auto) | what it is |", "| --- | --- | --- | --- | --- |"]
    for name, data in DATA_SETS.items():
        lines.append(f"| `{name}` | {'yes' if data.horizontal else 'no'} | {'yes' if data.vertical else 'no'} | "
                     f"{data.test_fraction:g} | {_cell(data.help)} |")
    lines += ["", "### Models (`model.name`; Hydra `model=<name>`)", "",
              "| model | kind | `model.num_durations` (auto) | what it is |", "| --- | --- | --- | --- |"]
    for name, model in MODELS.items():
        lines.append(f"| `{name}` | {'vertical' if model.vertical else 'horizontal'} | {model.num_durations} | "
                     f"{_cell(model.help)} |")
    lines += ["", "### Strategies (`strategy.name`; Hydra `strategy=<name>`)", "",
              "| strategy | kind | `model.name` (auto) | `privacy.adjacency` (auto) | what it is |",
              "| --- | --- | --- | --- | --- |"]
    for name, strategy in STRATEGIES.items():
        kind = "vertical" if strategy.vertical else "horizontal"
        lines.append(f"| `{name}` | {kind} | `{DEFAULT_MODEL[kind]}` | {strategy.adjacency} | {_cell(strategy.help)} |")
    lines += ["", "### Hydra privacy presets (`privacy=<preset>`)", "", "| preset | sets |", "| --- | --- |"]
    for name, preset in PRIVACY_PRESETS.items():
        sets = ", ".join(f"`privacy.{key}={_toml(value)}`" for key, value in preset.items()) or "nothing (the defaults)"
        lines.append(f"| `{name}` | {sets} |")
    return lines


def _mechanism_keys_section() -> list[str]:
    """Which strategies honour each key whose effect depends on the mechanism (``Mechanism.honours``)."""
    from strategies.config import mechanism_keys
    from strategies.mechanisms.registry import MECHANISMS  # no torch: the mechanisms import it where a site trains

    lines = ["", "## Keys that depend on the strategy", "",
             "Each strategy's mechanism declares the keys below that it honours; `parse_run_config` refuses any other",
             "of them at a value but its default (for an `auto` key: what `auto` gives that strategy), in one line",
             "that names the key, its value, the strategy and why (the strategy ignores it, or its effect would stack",
             "on the mechanism's own). Every other key applies to every strategy.", "",
             "| key | honoured by | refused by |", "| --- | --- | --- |"]
    for name in mechanism_keys():
        honoured = [strategy for strategy, mechanism in MECHANISMS.items() if name in mechanism.honours]
        refused = [strategy for strategy in MECHANISMS if strategy not in honoured]
        lines.append(f"| `{name}` | {', '.join(honoured) or 'none'} | {', '.join(refused) or 'none'} |")
    return lines


def generated_files(root: Path = PROJECT_ROOT) -> dict[Path, str]:
    """Every generated file's path and the text the schema gives it (``pyproject.toml`` with its table replaced), and
    the privacy reference the mechanisms' declarations give (:func:`~strategies.mechanisms.reference.reference_page`)."""
    from strategies.mechanisms.reference import REFERENCE_PAGE, reference_page  # the mechanisms' declarations

    files = {root / "conf" / path: text for path, text in hydra_files().items()}
    files[root / "docs" / "configuration.md"] = configuration_page()
    files[root / REFERENCE_PAGE] = reference_page()
    pyproject = root / "pyproject.toml"
    files[pyproject] = _with_table(pyproject.read_text(encoding="utf-8"))
    return files


def _with_table(text: str) -> str:
    """``pyproject.toml``'s text with its ``[tool.flwr.app.config]`` table generated from the schema."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == PYPROJECT_TABLE)
    except StopIteration:
        raise ConfigError(f"pyproject.toml has no {PYPROJECT_TABLE} table") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return "".join(lines[:start]) + pyproject_table() + "".join(lines[end:])


def stale_files(root: Path = PROJECT_ROOT) -> list[str]:
    """Generated files that differ from the schema, and group files in ``conf/`` the schema does not make."""
    files = generated_files(root)
    stale = [str(path.relative_to(root)) for path, text in files.items()
             if not path.is_file() or path.read_text(encoding="utf-8") != text]
    for group in HYDRA_GROUPS:
        stale += [f"{path.relative_to(root)} (no such option in the schema)"
                  for path in sorted((root / "conf" / group).glob("*.yaml")) if path not in files]
    return stale


def write_files(root: Path = PROJECT_ROOT) -> list[str]:
    """Write every generated file, delete group files the schema does not make; the paths changed."""
    changed = []
    files = generated_files(root)
    for group in HYDRA_GROUPS:
        for path in sorted((root / "conf" / group).glob("*.yaml")):
            if path not in files:
                path.unlink()
                changed.append(str(path.relative_to(root)))
    for path, text in files.items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(str(path.relative_to(root)))
    return changed


def check_run_config(text: str) -> int:
    """``flwr run --run-config text``'s run, checked as a run checks it before it starts (:func:`resolve`,
    :func:`check_inputs`); 0 if it may start, else 2 after one line on stderr (``make flwr`` calls this first: a
    ServerApp's error would reach the user as Flower's traceback)."""
    from flwr.common.config import parse_config_args  # how `flwr run` reads the string
    from models.data import DataValidationError

    try:
        _, cfg = resolve(parse_config_args([text]) if text.strip() else {})
        check_inputs(cfg)
    except (ConfigError, DataValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or check the files generated from the configuration schema "
                                                 "(pyproject.toml's run-config table, conf/, docs/configuration.md, "
                                                 "docs/privacy-reference.md).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite the generated files")
    action.add_argument("--check", action="store_true", help="list the files that differ; exit 1 if any")
    action.add_argument("--check-run", metavar="RUN_CONFIG",
                        help="check a `flwr run --run-config` string before the run is submitted: its keys and values, "
                             "the data file and output.dir; on a problem print one line and exit 2")
    args = parser.parse_args(argv)
    if args.check_run is not None:
        return check_run_config(args.check_run)
    if args.write:
        for path in write_files():
            print(f"wrote {path}")
        return 0
    stale = stale_files()
    for path in stale:
        print(f"differs from the schema: {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
