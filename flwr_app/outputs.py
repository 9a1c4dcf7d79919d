"""Files a run writes into its output directory.

``config.json``      resolved configuration (typed) and the raw run config it came from
``metrics.jsonl``    one JSON line per round, appended and flushed as the round ends
``ledger.jsonl``     privacy ledger, one line per site and round (strategies.accounting.ledger)
``manifest.json``    the release manifest: every value a site sends, covered or not (strategies.mechanisms)
``summary.json``     final test metrics and the headline privacy claim
``model.pt``         final global model (``state_dict`` plus what is needed to rebuild it)
``preprocessing.json``  horizontal runs: the agreed preprocessing, time grid and time scale the model was
                     trained on (JSON; :func:`models.predict.load_run` applies the model to new raw records)
``checkpoint.pt``    horizontal runs: everything needed to continue after the last completed round
``survival_vs_km.png``  mean predicted survival vs Kaplan–Meier per site
``run.log``          what the ServerApp printed, and the error (with its traceback) that ended a failed run
                     (:mod:`flwr_app.runlog`)
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from strategies.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    import torch

# torch (and models.predict, which imports it) are imported by the methods that write or read a model: a run's
# checks before it starts (RunOutputs.create) need neither.

CHECKPOINT = "checkpoint.pt"
#: Files whose presence means that a directory already holds a run (a new run there is refused).
RUN_FILES = ("config.json", "metrics.jsonl", "ledger.jsonl", "summary.json", "model.pt", CHECKPOINT)


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
        """The run's directory: ``output.dir`` or ``./outputs/<time>-<data>-<strategy>``.

        A resumed run (``resume.from``) continues in the directory of its checkpoint; ``output.dir``
        must then be empty or name that directory. Otherwise the directory must not hold another
        run's files (:data:`RUN_FILES`): a new run would append its rounds to that run's metrics
        and ledger. An empty directory, or one with other files only (Hydra's ``.hydra/``, a
        ``run.log``), is fine.

        Raises
        ------
        ConfigError
            When ``output.dir`` holds a run's files, or names another directory than ``resume.from``.
        """
        if cfg.resume_from:
            directory = resume_directory(cfg.resume_from)
            if cfg.output_dir and Path(cfg.output_dir).resolve() != directory:
                raise ConfigError(f"run config: resume.from = {cfg.resume_from!r} continues the run in {directory}, "
                                  f"but output.dir = {cfg.output_dir!r} names another directory; leave output.dir empty")
            return cls(directory)
        if cfg.output_dir:
            directory = Path(cfg.output_dir)
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            directory = Path.cwd() / "outputs" / f"{stamp}-{cfg.data.name}-{cfg.strategy}-seed{cfg.seed}"
        directory = directory.resolve()
        held = sorted(name for name in RUN_FILES if (directory / name).exists())
        if held:
            raise ConfigError(f"run config: output.dir = {str(directory)!r} already holds a run ({', '.join(held)}); "
                              f"choose a new directory, or continue that run with resume.from = {str(directory)!r}")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".fedsurv-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"run config: output.dir = {str(directory)!r} cannot be written: "
                              f"{err.strerror or err}") from None
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

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / CHECKPOINT

    def write_config(self, cfg: ExperimentConfig, run_config: Mapping[str, Any]) -> None:
        write_json(self.directory / "config.json", {"resolved": cfg.as_dict(), "run_config": dict(run_config)})

    def append_metrics(self, line: Mapping[str, Any]) -> None:
        """Append one round's metrics and flush, so a crash later loses nothing written."""
        with self.metrics_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(_jsonable(line), allow_nan=False) + "\n")

    def keep_metrics_until(self, last_round: int) -> int:
        """Drop the metrics lines of rounds after ``last_round`` (rewritten atomically); return how many were dropped.

        A run that crashed after writing a round's line but before that round's checkpoint leaves
        such lines; the resumed run writes them again.
        """
        if not self.metrics_path.exists():
            return 0
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if json.loads(line)["round"] <= last_round]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.metrics_path)
        return len(lines) - len(kept)

    def save_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """Write ``checkpoint.pt`` atomically (temporary file, then ``os.replace``): a crash leaves the previous one."""
        import torch

        tmp = self.checkpoint_path.with_suffix(".pt.tmp")
        torch.save(dict(checkpoint), tmp)
        os.replace(tmp, self.checkpoint_path)

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        write_json(self.directory / "manifest.json", manifest)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        write_json(self.summary_path, summary)

    @property
    def preprocessing_path(self) -> Path:
        from models.predict import PREPROCESSING_FILE

        return self.directory / PREPROCESSING_FILE

    def save_model(self, state_dict: Mapping[str, torch.Tensor], *, preprocessing: Mapping[str, Any],
                   baseline: tuple[np.ndarray, np.ndarray] | None = None, **metadata: Any) -> None:
        """Write ``model.pt`` (loadable with ``weights_only``: the Breslow ``baseline`` as lists) and, beside it,
        the ``preprocessing`` it was trained on (:func:`models.predict.preprocessing_payload`) as JSON."""
        import torch

        torch.save({"state_dict": dict(state_dict), **metadata,
                    "baseline": None if baseline is None else [np.asarray(part).tolist() for part in baseline]},
                   self.model_path)
        write_json(self.preprocessing_path, preprocessing)


def resume_directory(resume_from: str) -> Path:
    """The run directory that ``resume.from`` (a run directory or its ``checkpoint.pt``) names."""
    path = Path(resume_from).resolve()
    return path if path.is_dir() else path.parent


def load_checkpoint(resume_from: str) -> dict[str, Any]:
    """The checkpoint that ``resume.from`` names (tensors and plain Python only: loaded with ``weights_only``)."""
    path = Path(resume_from).resolve()
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"run config: resume.from = {resume_from!r}: no checkpoint at {path} (a horizontal run "
                          "writes one after every round)")
    import torch

    return torch.load(path, weights_only=True)
