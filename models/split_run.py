"""A split-learning run's model applied to new raw records: :func:`load_split_run`.

A split run (``strategy.name = split``) trains one model in parts: each modality's encoder (with
its preprocessing of the modality's raw columns) at the site that holds the modality, the fusion
head at the label holder. The label holder writes its head in the run's ``model.pt``; at the end
of the run each site writes its own part on its own disk (:func:`write_site_model`), in the folder
its node config names (``model-dir``; a site without one saves nothing). In simulation that folder
is ``<run directory>/sites/<modality>/`` (:data:`SITES_DIR`), so a simulated run's directory holds
the whole model:

>>> run = load_split_run("outputs/20261123-120000-synthetic_multimodal-split-seed0")
>>> curves = run.predict_survival({"a": frame_a, "b": frame_b, "c": frame_c})  # one row per record

A site's folder holds ``encoder.pt`` (the encoder's weights: :func:`torch.load` with
``weights_only=True``) and ``site.json`` (the site's configuration from the label holder, without
the cohort's training IDs, its fitted preprocessing and the run's token, which ties the folder to
the label holder's ``model.pt``): no pickles, reading them runs no code.

What :meth:`SplitRun.predict_survival` computes: the run's model, not a release. Every encoder's
embedding is clipped as the site clipped it (``privacy.clip_norm`` of a private run) but gets no
embedding noise; records missing a modality (absent from its frame, or every value of its columns
empty) are masked in the fusion as in training. For the Bayesian model (``bayesian_multisurv``) the
curve is the mean survival over ``split.mc_samples`` posterior passes, with the seeds the run's own
evaluation used (:data:`models.multimodal_training.PREDICT_SALT` on), so for a run without embedding
noise (no DP, or ``split.clean_inference``) it is the run's own test curve
(``survival_bands.npz``'s ``mean``); the deterministic model (``multisurv``) takes one pass.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from models.bayesian import seeded
from models.data.datasets import DEFAULT_OUTCOME, read_frame
from models.data.validate import DataValidationError
from models.data.vertical import ModalityTransform
from models.multimodal import HEAD_SEED_NAME, FusionHead, build_encoder, part_seed
from models.multimodal_training import PREDICT_SALT
from models.metrics import survival_at
from models.predictions import CurvePredictions
from models.survival import restricted_mean_survival_time

__all__ = [
    "SITES_DIR",
    "SITE_SPEC_FILE",
    "SITE_WEIGHTS_FILE",
    "SiteModel",
    "SplitRun",
    "load_site_model",
    "load_split_run",
    "write_site_model",
]

#: Where a simulated split run's sites write their parts: ``<run directory>/sites/<modality>/``.
SITES_DIR = "sites"
#: A site's encoder weights (a ``torch.save`` of tensors only).
SITE_WEIGHTS_FILE = "encoder.pt"
#: A site's configuration, preprocessing and run token (JSON).
SITE_SPEC_FILE = "site.json"
SITE_FORMAT = 1
MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"
#: The strategies whose model this module loads; ``private_split``'s sites keep no model (see :func:`load_split_run`).
SPLIT_STRATEGY = "split"


# --------------------------------------------------------------------------- a site's part


def _transform_payload(transform: ModalityTransform) -> dict[str, Any]:
    return {"categorical": list(transform.categorical), "continuous": list(transform.continuous),
            "levels": [list(levels) for levels in transform.levels],
            "mean": [float(value) for value in transform.mean], "scale": [float(value) for value in transform.scale]}


def _transform_from_payload(payload: Mapping[str, Any]) -> ModalityTransform:
    levels = tuple(tuple(str(level) for level in values) if values and isinstance(values[0], str)
                   else tuple(float(level) for level in values) for values in payload["levels"])
    return ModalityTransform(categorical=tuple(payload["categorical"]), continuous=tuple(payload["continuous"]),
                             levels=levels, mean=np.asarray(payload["mean"], dtype=np.float64),
                             scale=np.asarray(payload["scale"], dtype=np.float64))


def _replace(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary file in its folder (a reader never sees half a file)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_site_model(directory: str | Path, *, modality: str, config: Mapping[str, Any],
                     transform: ModalityTransform, encoder: nn.Module, run_token: str) -> Path:
    """Write a split site's trained part into ``directory`` (created): :data:`SITE_WEIGHTS_FILE` and :data:`SITE_SPEC_FILE`.

    ``config`` is the site's :class:`strategies.split.SiteConfig` as a mapping (its ``train_ids``, the
    cohort's training IDs, are left out: they are no part of the model); ``run_token`` ties the folder
    to the label holder's ``model.pt`` of the same run. A folder holding an earlier run's part is
    overwritten. Returns ``directory``.
    """
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    weights = {key: value.detach().cpu().clone() for key, value in encoder.state_dict().items()}
    spec = {"format": SITE_FORMAT, "modality": modality, "run_token": run_token,
            "config": {key: value for key, value in config.items() if key != "train_ids"},
            "input_columns": [*transform.categorical, *transform.continuous],
            "preprocessing": _transform_payload(transform)}
    _replace(directory / SITE_WEIGHTS_FILE, lambda path: torch.save(weights, path))
    _replace(directory / SITE_SPEC_FILE,
             lambda path: path.write_text(json.dumps(spec, indent=1, allow_nan=False), encoding="utf-8"))
    return directory


@dataclass(frozen=True)
class SiteModel:
    """One site's trained part: its encoder (eval mode) and its preprocessing of the modality's raw columns.

    Attributes
    ----------
    directory : Path
    modality : str
    config : dict
        The site's configuration (:class:`strategies.split.SiteConfig` fields but ``train_ids``).
    transform : ModalityTransform
    encoder : torch.nn.Module
    run_token : str
    """

    directory: Path
    modality: str
    config: dict[str, Any]
    transform: ModalityTransform
    encoder: nn.Module
    run_token: str

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The raw columns of the modality the encoder reads."""
        return (*self.transform.categorical, *self.transform.continuous)

    def inputs(self, frame: pd.DataFrame, *, source: str) -> tuple[Tensor, np.ndarray]:
        """The encoder's inputs of ``frame``'s rows (zeros where a row is empty) and which rows hold the modality."""
        missing = [column for column in self.input_columns if column not in frame.columns]
        if missing:
            raise DataValidationError(f"{source}: modality {self.modality!r} needs columns {missing}; columns "
                                      f"present: {list(frame.columns)[:10]}")
        columns = frame[list(self.input_columns)]
        held = columns.notna().any(axis=1).to_numpy()
        x = np.zeros((len(frame), len(self.input_columns)), dtype=np.float32)
        if held.any():
            x[held] = self.transform.transform(columns.loc[held], source=source)
        return torch.from_numpy(x), held

    def embed(self, x: Tensor, step: int) -> Tensor:
        """The embedding of pass ``step`` as the site computed it for prediction, clipped, without noise."""
        with seeded(part_seed(int(self.config["seed"]), self.modality, step)):
            embeddings = self.encoder(x)
        clip_norm = self.config.get("clip_norm")
        if clip_norm is None:
            return embeddings
        # strategies.mechanisms.embedding_noise.clip_embeddings (models does not import strategies)
        norms = torch.linalg.vector_norm(embeddings, dim=1, keepdim=True)
        return embeddings * torch.clamp(float(clip_norm) / norms.clamp_min(1e-12), max=1.0)


def load_site_model(directory: str | Path) -> SiteModel:
    """Read a site's part written by :func:`write_site_model`.

    Raises
    ------
    FileNotFoundError
        Naming the folder, when it lacks either file.
    ValueError
        For a file of another format.
    """
    directory = Path(directory).expanduser()
    absent = [name for name in (SITE_WEIGHTS_FILE, SITE_SPEC_FILE) if not (directory / name).is_file()]
    if absent:
        raise FileNotFoundError(f"{directory}: no {' or '.join(absent)} (not a split site's model folder)")
    spec = json.loads((directory / SITE_SPEC_FILE).read_text(encoding="utf-8"))
    if spec.get("format") != SITE_FORMAT:
        raise ValueError(f"{directory / SITE_SPEC_FILE}: format {spec.get('format')!r}, expected {SITE_FORMAT}")
    config = dict(spec["config"])
    transform = _transform_from_payload(spec["preprocessing"])
    with seeded(0):  # the initial weights are replaced below
        encoder = build_encoder(cardinalities=transform.cardinalities, num_continuous=len(transform.continuous),
                                dim=int(config["dim"]), hidden_layers=int(config["encoder_layers"]),
                                dropout=float(config["dropout"]), bayesian=bool(config["bayesian"]))
    encoder.load_state_dict(torch.load(directory / SITE_WEIGHTS_FILE, weights_only=True))
    encoder.eval()
    return SiteModel(directory, str(spec["modality"]), config, transform, encoder, str(spec["run_token"]))


# --------------------------------------------------------------------------- the whole model


Records = Mapping[str, pd.DataFrame] | pd.DataFrame | str | Path


@dataclass(frozen=True)
class SplitRun(CurvePredictions):
    """A split run's model: the label holder's fusion head and every site's encoder from the same run.

    Attributes
    ----------
    directory : Path
        The run's output directory.
    modalities : tuple of str
        In the fusion's order.
    times : numpy.ndarray
        The time grid of the predicted curves.
    head : FusionHead
        The label holder's part (eval mode).
    sites : dict of str to SiteModel
    id_col : str
        The run's record ID column (``data.id_col``, default ``id``).
    passes : int
        Posterior passes averaged per prediction (``split.mc_samples``; 1 for the deterministic model).
    seed : int
        The run's seed (the passes' seeds derive from it).
    outcome : tuple of str
        The time and event columns :meth:`score` reads from labelled records (one frame, or the
        mapping's frame that holds them), as in a labels file.

    Predictions, scores, calibration and plots: :class:`models.predictions.CurvePredictions`.
    """

    directory: Path
    modalities: tuple[str, ...]
    times: np.ndarray
    head: FusionHead = field(repr=False)
    sites: dict[str, SiteModel] = field(repr=False)
    id_col: str = "id"
    passes: int = 1
    seed: int = 0
    outcome: tuple[str, str] = DEFAULT_OUTCOME

    @property
    def input_columns(self) -> dict[str, tuple[str, ...]]:
        """Each modality's raw columns."""
        return {name: self.sites[name].input_columns for name in self.modalities}

    def _frames(self, records: Records) -> tuple[pd.Index, dict[str, pd.DataFrame]]:
        """The records' IDs and each given modality's frame indexed by them (as strings)."""
        if isinstance(records, (str, Path)):
            records = read_frame(records)
        if isinstance(records, pd.DataFrame):
            frame = self._indexed(records, "records")
            absent = sorted({column for name in self.modalities for column in self.sites[name].input_columns
                             if column not in frame.columns})
            if absent:
                raise DataValidationError(f"records: no columns {absent} (one frame must hold every modality's "
                                          "columns; pass a mapping of modality to frame to leave a modality out)")
            return frame.index, {name: frame for name in self.modalities}
        unknown = sorted(set(records) - set(self.modalities))
        if unknown:
            raise ValueError(f"records: unknown modalities {unknown}; the run's modalities are {list(self.modalities)}")
        frames = {name: self._indexed(records[name], f"records of modality {name!r}")
                  for name in self.modalities if name in records}
        if not frames:
            raise ValueError(f"records: no modality given; the run's modalities are {list(self.modalities)}")
        ids = pd.Index([], dtype=object)
        for frame in frames.values():
            ids = ids.append(frame.index.difference(ids, sort=False))
        return pd.Index(ids, name=self.id_col), frames

    def _indexed(self, frame: pd.DataFrame, source: str) -> pd.DataFrame:
        frame = frame.rename(columns=str)
        if self.id_col in frame.columns:
            frame = frame.set_index(self.id_col)
        frame = frame.set_axis(pd.Index(frame.index.astype(str), name=self.id_col), axis=0)
        if frame.index.has_duplicates:
            raise DataValidationError(f"{source}: duplicate record IDs "
                                      f"{list(frame.index[frame.index.duplicated()][:5])}")
        return frame

    @torch.no_grad()
    def hazard_logits(self, records: Records) -> tuple[pd.Index, Tensor]:
        """The records' IDs and the hazard logits of every pass, shape (passes, records, times)."""
        ids, frames = self._frames(records)
        inputs, present = {}, []
        for name in self.modalities:
            if name in frames:
                x, held = self.sites[name].inputs(frames[name].reindex(ids), source=f"records of modality {name!r}")
            else:
                x, held = torch.zeros(len(ids), len(self.sites[name].input_columns)), np.zeros(len(ids), bool)
            inputs[name] = x
            present.append(held)
        mask = torch.from_numpy(np.stack(present, axis=1))
        empty = ~mask.any(dim=1)
        if bool(empty.any()):
            raise DataValidationError(f"records {list(ids[empty.numpy()][:5])}: hold none of the modalities "
                                      f"{list(self.modalities)}")
        out = []
        for j in range(self.passes):
            step = PREDICT_SALT + j
            stacked = torch.stack([self.sites[name].embed(inputs[name], step) for name in self.modalities], dim=-2)
            with seeded(part_seed(self.seed, HEAD_SEED_NAME, step)):
                out.append(self.head(stacked.masked_fill(~mask.unsqueeze(-1), 0.0), mask))
        return ids, torch.stack(out)

    def predict_survival(self, records: Records, times: Sequence[float] | None = None) -> pd.DataFrame:
        """Survival curves of raw records: one row per record (index: the record IDs), one column per time.

        ``records``: a mapping of modality to frame (each indexed by the record IDs, or holding the
        ID column ``id_col``, like the modality files; a modality left out, or a record absent from a
        modality's frame, is a missing modality), or one frame (or CSV/Parquet file) with the ID
        column or index and every modality's columns. The rows follow the records' order (a mapping:
        the first frame's records, then those new in each next one).
        """
        ids, logits = self.hazard_logits(records)
        survival = torch.cumprod(1.0 - torch.sigmoid(logits), dim=2).mean(dim=0).numpy()
        grid = self.times
        if times is not None:  # the step curves read at other times (models.metrics.survival_at)
            grid, survival = np.asarray(times, dtype=np.float64), survival_at(self.times, survival, times)
        return pd.DataFrame(survival, index=ids, columns=pd.Index(grid, name="time"))

    def _labelled(self, records: Records) -> pd.DataFrame:
        """The frame holding :attr:`outcome` (the one frame, or the mapping's first that has them), in the
        predictions' row order."""
        ids, frames = self._frames(records)
        held = [frame for frame in frames.values() if set(self.outcome) <= set(frame.columns)]
        return held[0].reindex(ids) if held else pd.DataFrame(index=ids)

    def _score_risk(self, records: Records) -> None:
        return None  # risk_score is the curves' -RMST: score ranks by the curves it already has

    def risk_score(self, records: Records) -> pd.Series:
        """The risk score of raw records (higher: earlier event): minus the restricted mean survival time over
        the grid, as the run's own evaluation ranks records for the C-index."""
        curves = self.predict_survival(records)
        return pd.Series(-restricted_mean_survival_time(self.times, curves.to_numpy()), index=curves.index,
                         name="risk")


def load_split_run(directory: str | Path, *, sites: Mapping[str, str | Path] | None = None) -> SplitRun:
    """The trained model of a split run's output directory, ready for :meth:`SplitRun.predict_survival`.

    ``sites`` names each modality's folder where it is not ``<directory>/sites/<modality>/`` (a
    deployment's sites write theirs on their own disks, in the folder of their ``model-dir`` node config).

    Raises
    ------
    FileNotFoundError
        When the directory holds no ``model.pt`` (not a run, or the run did not finish), or a site's folder is
        missing or incomplete (its site was given no ``model-dir``): the message names the folder.
    ValueError
        For a ``private_split`` run (its sites keep no model: only the released embeddings of the records it
        scored), for another strategy's run, or for a site's folder written by another run.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    strategy = (json.loads(config_path.read_text(encoding="utf-8"))["resolved"]["strategy"]
                if config_path.is_file() else SPLIT_STRATEGY)
    if strategy == "private_split":
        raise ValueError(f"{directory}: a private_split run: its sites keep no model (each record's embedding is "
                         "released once, for the records the run scored), so new records cannot be scored; "
                         "load_split_run takes split runs")
    if strategy != SPLIT_STRATEGY:
        raise ValueError(f"{directory}: a {strategy} run, not a split run (load it with models.predict.load_run)")
    model_path = directory / MODEL_FILE
    if not model_path.is_file():
        raise FileNotFoundError(f"{directory}: no {MODEL_FILE} (not a run directory, or the run did not finish)")
    saved = torch.load(model_path, weights_only=True)
    if "run_token" not in saved:
        raise ValueError(f"{model_path}: written before the sites saved their encoders (no run token); the run's "
                         "encoders were not kept")
    config = saved["config"]
    modalities = tuple(saved["modalities"])
    folders = {name: Path(sites[name]) if sites and name in sites else directory / SITES_DIR / name
               for name in modalities}
    missing = [str(folder) for folder in folders.values() if not (folder / SITE_SPEC_FILE).is_file()
               or not (folder / SITE_WEIGHTS_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: no saved encoder in {', '.join(missing)}: the split sites save "
                                "their encoder only where their node config sets model-dir")
    parts = {name: load_site_model(folder) for name, folder in folders.items()}
    for name, part in parts.items():
        if part.modality != name or part.run_token != saved["run_token"]:
            raise ValueError(f"{part.directory}: the encoder of modality {part.modality!r} from another run "
                             f"(run token {part.run_token!r}), not modality {name!r} of {directory}")
    split, model = config["split"], config["model"]
    bayesian = model["name"] == "bayesian_multisurv"
    cuts = np.asarray(saved["cuts"], dtype=np.float64)
    with seeded(0):  # the initial weights are replaced below
        head = FusionHead(int(split["embedding_dim"]), len(cuts), int(split["head_layers"]), float(split["dropout"]),
                          bayesian=bayesian, risk_layer=str(split["risk_layer"]))
    head.load_state_dict(saved["fusion_head"])
    head.eval()
    return SplitRun(directory=directory, modalities=modalities, times=cuts, head=head, sites=parts,
                    id_col=str(config["data"].get("id_col") or "id"),
                    passes=int(split["mc_samples"]) if bayesian else 1, seed=int(config["seed"]))
