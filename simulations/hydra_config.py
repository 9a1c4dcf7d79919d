"""Hydra ``DictConfig`` -> the flat run-config keys shared with ``flwr run``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

_CHECKOUT = Path(__file__).resolve().parent.parent
#: Whether this is a source checkout (its ``conf/``, which ``python -m flwr_app.config --write`` generates, beside
#: ``pyproject.toml``) rather than an installed wheel, which carries the same tree as ``simulations/conf``.
_IN_CHECKOUT = (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "conf" / "config.yaml").is_file()
#: Hydra's configuration tree.
CONF_DIR = _CHECKOUT / "conf" if _IN_CHECKOUT else Path(__file__).resolve().parent / "conf"
#: ``config_path`` of the Hydra entry points (``simulations.run``, ``simulations.sweep``), relative to this folder.
CONFIG_PATH = "../conf" if _IN_CHECKOUT else "conf"


def flatten(cfg: DictConfig) -> dict[str, Any]:
    """``{"data": {"name": "flchain"}}`` -> ``{"data.name": "flchain"}`` (the ``hydra`` node dropped)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if prefix == "" and key == "hydra":
                    continue
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(container, "")
    return flat


def parse_value(text: str) -> Any:
    """A command-line value as a TOML literal (``50``, ``0.3``, ``1e-5``, ``inf``, ``true``), else a string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
