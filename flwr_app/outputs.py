"""Files a run writes into its output directory (DESIGN §7, §10).

``config.json``      resolved configuration (typed) and the raw run config it came from
``metrics.jsonl``    one JSON line per round, appended and flushed as the round ends
``ledger.jsonl``     privacy ledger, one line per site and round (strategies.accounting.ledger)
``summary.json``     final test metrics and the headline privacy claim
``model.pt``         final global model (``state_dict`` plus what is needed to rebuild it)
``survival_vs_km.png``  mean predicted survival vs Kaplan–Meier per site
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flwr_app.config import ExperimentConfig


def _jsonable(value: Any) -> Any:
    """Replace non-finite floats by ``None`` (strict JSON has no NaN/inf) and tuples by lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` atomically (temporary file, then rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class RunOutputs:
    """Paths of one run's output files."""

    directory: Path

    @classmethod
    def create(cls, cfg: ExperimentConfig) -> RunOutputs:
        """The run's directory: ``output.dir`` or ``./outputs/<time>-<data>-<strategy>``."""
        if cfg.output_dir:
            directory = Path(cfg.output_dir)
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            directory = Path.cwd() / "outputs" / f"{stamp}-{cfg.data.name}-{cfg.strategy}-seed{cfg.seed}"
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory)

    @property
    def metrics_path(self) -> Path:
        return self.directory / "metrics.jsonl"

    @property
    def ledger_path(self) -> Path:
        return self.directory / "ledger.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.directory / "summary.json"

    @property
    def model_path(self) -> Path:
        return self.directory / "model.pt"

    @property
    def plot_path(self) -> Path:
        return self.directory / "survival_vs_km.png"

    def write_config(self, cfg: ExperimentConfig, run_config: Mapping[str, Any]) -> None:
        write_json(self.directory / "config.json", {"resolved": cfg.as_dict(), "run_config": dict(run_config)})

    def append_metrics(self, line: Mapping[str, Any]) -> None:
        """Append one round's metrics and flush, so a crash later loses nothing written."""
        with self.metrics_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(_jsonable(line), allow_nan=False) + "\n")

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        write_json(self.summary_path, summary)

    def save_model(self, state_dict: Mapping[str, torch.Tensor], **metadata: Any) -> None:
        torch.save({"state_dict": dict(state_dict), **metadata}, self.model_path)
