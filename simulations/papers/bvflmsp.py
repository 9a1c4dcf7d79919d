"""Reproduce the shape of the BVFLMSP paper's Table 2: vertical (split) vs centralised C-index under embedding DP.

Every (setting, ε, calibration, seed) runs the ServerApp and ClientApp over the in-process grid
(:func:`simulations.engine.run_inprocess`), for ``--twin-seeds`` also its centralised twin, and a
feature-reconstruction audit on the embeddings the server received in the last epoch, as read from
the sites' replies (:class:`ReleasedEmbeddings`, :func:`reconstruction_audit`). One row per run is appended to
``OUT/results.csv`` as soon as it finishes (a rerun skips the rows already there); ``OUT/table.md``
holds mean ± std over seeds with every ε figure of the ledger (record-level RDP, per site, and the
paper formula's claim) and ``OUT/figure.png`` C-index and reconstruction R² against ε.

Usage::

    python -m simulations.papers.bvflmsp --out DIR --settings metabric:genomic,clinical synthetic_multimodal:a,b,c \\
        --epsilons inf,0.5,1,1.5,10 --calibrations rdp,paper --seeds 0,1,2,3,4 [--jobs 2] key=value ...

``--calibrations private_split`` runs strategy ``private_split`` instead (each record released
once, :mod:`strategies.private_split`), ε = inf included: the same protocol without noise.

``key=value`` are run-config overrides shared by every run (e.g. ``federation.rounds=40``).
``--paper-architecture`` adds :data:`PAPER_ARCHITECTURE` (the paper's network, which the
project's no-DP defaults replace; ``docs/results/bvflmsp.md``) before them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np

from flwr_app import interrupt
from simulations.hydra_config import parse_value
from simulations.results_file import append_runs, mean_std, read_rows

#: The paper's Table 2 (TCGA; validation C-index): modalities -> ε -> (federated, centralised).
PAPER_TABLE2: dict[str, dict[float, tuple[float, float]]] = {
    "clinical + miRNA": {math.inf: (0.732, 0.743), 0.5: (0.547, 0.724), 1.0: (0.559, 0.727),
                         1.5: (0.565, 0.731), 10.0: (0.712, 0.734)},
    "clinical + miRNA + DNAm": {math.inf: (0.715, 0.752), 0.5: (0.539, 0.737), 1.0: (0.537, 0.732),
                                1.5: (0.604, 0.741), 10.0: (0.662, 0.744)},
}
#: The BVFLMSP paper's network (Sec. 6.2.1) as run-config overrides: the ``split.*`` defaults that
#: replace it were chosen on validation parts (``benchmarks/split_recipe.py``).
PAPER_ARCHITECTURE: dict[str, Any] = {"split.embedding_dim": 512, "split.encoder_layers": 2, "split.head_layers": 4,
                                      "split.dropout": 0.5, "split.risk_layer": "interval", "model.num_durations": 30}
AUXILIARY_FRACTION = 0.3
#: The "calibration" of a row run with strategy private_split (each record released once; its own accountant).
PRIVATE = "private_split"
METRICS = ("c_index", "c_index_td", "ibs", "inbll")
FIELDS = ("setting", "modalities", "epsilon_target", "calibration", "seed",
          *(f"federated_{m}" for m in METRICS), *(f"centralised_{m}" for m in METRICS),
          "federated_band_width", "centralised_band_width", "noise_multiplier", "epsilon_record",
          "epsilon_site_max", "epsilon_paper", "r2", "round_trips_per_batch", "wall_s")


class ReleasedEmbeddings:
    """An ``observe`` of :func:`simulations.engine.run_inprocess`: the embeddings the server received.

    Each training round trip's reply (message ``train.split_step``) carries a site's embeddings of
    the records its request named; the last ones kept per (modality, record) are those of the last
    epoch, in which every training record is released once.
    """

    def __init__(self) -> None:
        self.released: dict[str, dict[str, tuple[np.ndarray, bool]]] = {}

    def __call__(self, message: Any, reply: Any) -> None:
        from flwr_app import split_messages as wire

        kind = message.metadata.message_type
        if kind not in (wire.STEP, wire.PRIVATE_RELEASE) or reply.has_error():
            return
        if kind == wire.PRIVATE_RELEASE:  # private_split: each record's one release
            ids = wire.decode_private_release(message.content)
            modality, embeddings, present, _ = wire.decode_private_release_reply(reply.content)
        else:
            ids = wire.decode_request(message.content).forward_ids
            if not ids:
                return
            modality, site_reply = wire.decode_reply(reply.content)
            embeddings, present = site_reply.embeddings, site_reply.present
        kept = self.released.setdefault(modality, {})
        for row, record in enumerate(ids):
            kept[record] = (embeddings[row], bool(present[row]))

    def rows(self, modality: str, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings (len(ids), dim) and presence mask of ``modality`` for records ``ids``."""
        kept = self.released.get(modality, {})
        missing = [record for record in map(str, ids) if record not in kept]
        if missing:
            raise ValueError(f"the server received no embedding of modality {modality!r} for "
                             f"{len(missing)} training record(s), e.g. {missing[0]!r}")
        return (np.stack([kept[str(record)][0] for record in ids]),
                np.array([kept[str(record)][1] for record in ids], dtype=bool))


def reconstruction_audit(cfg: Any, received: ReleasedEmbeddings, *, fraction: float = AUXILIARY_FRACTION,
                         seed: int = 0) -> dict[str, float]:
    """The paper's feature-reconstruction attack by a curious server, as an audit of a simulated run.

    The server knows the (preprocessed) features of a random ``fraction`` of the training records
    (an auxiliary public split), fits a ridge decoder from the embeddings it received for them in
    the last epoch (``received``) to those features, and reconstructs the other training records'
    features from their embeddings; the result is the out-of-sample R² per modality
    (:func:`strategies.audits.reconstruction.reconstruction_attack`).
    """
    from flwr_app import vertical_task
    from models.multimodal_training import fit_transforms, modality_inputs
    from strategies.audits.reconstruction import reconstruction_attack

    table = vertical_task.load_table(cfg)
    train_ids = vertical_task.labels(cfg, table).train_ids
    transforms = fit_transforms(table, train_ids)
    inputs, _ = modality_inputs(table, train_ids, transforms)
    order = np.random.default_rng(seed).permutation(len(train_ids))
    auxiliary = np.zeros(len(train_ids), dtype=bool)
    auxiliary[order[: int(round(fraction * len(train_ids)))]] = True
    result = {}
    for name in vertical_task.modality_names(cfg.data.deployed, cfg.split.modalities, table):
        released, held = received.rows(name, train_ids)
        features = inputs[name].numpy()
        attack = reconstruction_attack(released[auxiliary & held], features[auxiliary & held],
                                       released[~auxiliary & held], features[~auxiliary & held])
        result[f"r2_{name}"] = attack.r2
    return result


def _run(job: tuple[str, tuple[str, ...], float, str, int, bool, dict[str, Any]]) -> dict[str, Any]:
    from simulations.engine import resolve, run_inprocess

    setting, modalities, epsilon, calibration, seed, twin, shared = job
    warnings.simplefilter("ignore", RuntimeWarning)
    started = time.perf_counter()
    protocol = {"strategy.name": PRIVATE} if calibration == PRIVATE else {"strategy.name": "split",
                                                                         "split.calibration": calibration}
    with TemporaryDirectory() as out:
        overrides = {"model.name": "bayesian_multisurv", **protocol, **shared, "data.name": setting,
                     "split.modalities": ",".join(modalities), "seed": seed,
                     "privacy.epsilon": "inf" if math.isinf(epsilon) else epsilon,
                     "baseline.centralized": twin, "output.dir": out}
        _, cfg = resolve(overrides)
        received = ReleasedEmbeddings()
        summary = run_inprocess(overrides, observe=received)
    audit = reconstruction_audit(cfg, received, seed=seed)
    sites = summary["privacy_sites"].values()
    central = summary.get("centralized", {"test": {}, "band_width": None})
    return {  # summary.json writes NaN and inf as null: a missing metric is NaN, a missing ε unbounded
        "setting": setting, "modalities": "+".join(modalities), "epsilon_target": epsilon,
        "calibration": calibration, "seed": seed,
        **{f"federated_{m}": _number(summary["test"].get(m), math.nan) for m in METRICS},
        **{f"centralised_{m}": _number(central["test"].get(m), math.nan) for m in METRICS},
        "federated_band_width": _number(summary["band_width"], math.nan),
        "centralised_band_width": _number(central["band_width"], math.nan),
        "noise_multiplier": summary["noise"]["release_scale"] if calibration == PRIVATE else summary["noise_multiplier"],
        "epsilon_record": _number(summary["privacy"]["epsilon"], math.inf),
        "epsilon_site_max": max((_number(site["epsilon"], math.inf) for site in sites), default=math.inf),
        "epsilon_paper": max((_number(site["epsilon_paper"], math.inf) for site in sites), default=math.inf),
        "r2": ";".join(f"{key[3:]}={value:.4f}" for key, value in audit.items()),
        "round_trips_per_batch": summary.get("round_trips_per_batch", math.nan),
        "wall_s": time.perf_counter() - started,
    }


def _number(value: float | None, missing: float) -> float:
    """A figure of summary.json, ``missing`` where it holds null."""
    return missing if value is None else float(value)


def _read(path: Path) -> list[dict[str, Any]]:
    rows = read_rows(path, text_fields=("setting", "modalities", "calibration", "r2"))
    for row in rows:
        row["r2"] = {part.split("=")[0]: float(part.split("=")[1]) for part in row["r2"].split(";") if part}
    return rows


def run_grid(out: Path, settings: list[tuple[str, tuple[str, ...]]], epsilons: list[float], calibrations: list[str],
             seeds: list[int], twin_seeds: set[int], shared: dict[str, Any], jobs: int) -> list[dict[str, Any]]:
    """Run the grid's missing runs (ε = inf once per setting and seed) and return every row.

    The centralised twin runs beside the seeds in ``twin_seeds`` only: it computes the split run's
    steps exactly (its C-index differs by floating-point error), so one seed documents that.
    """
    path = out / "results.csv"
    done = {(row["setting"], row["modalities"], row["epsilon_target"], row["calibration"], int(row["seed"]))
            for row in _read(path)}
    todo = []
    for seed in seeds:
        for setting, modalities in settings:
            for epsilon in epsilons:
                for calibration in (["rdp"] if math.isinf(epsilon) and PRIVATE not in calibrations
                                    else calibrations):
                    key = (setting, "+".join(modalities), epsilon, calibration, seed)
                    if key not in done:
                        todo.append((setting, modalities, epsilon, calibration, seed, seed in twin_seeds, shared))
    append_runs(path, FIELDS, todo, _run, workers=jobs, describe=lambda row: (
        f"{row['setting']} {row['modalities']} eps={row['epsilon_target']} {row['calibration']} seed={row['seed']}: "
        f"federated C {row['federated_c_index']:.4f}, centralised C {row['centralised_c_index']:.4f}, "
        f"eps_record {row['epsilon_record']:.3g}, R2 {row['r2']} ({row['wall_s']:.0f} s)"))
    return _read(path)


def _eps(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.3g}"


def write_report(out: Path, rows: list[dict[str, Any]]) -> str:
    """``table.md``: one table per calibration, rows (setting, ε), and ``figure.png``."""
    lines: list[str] = []
    settings = list(dict.fromkeys((row["setting"], row["modalities"]) for row in rows))
    calibrations = [c for c in ("rdp", "paper", PRIVATE) if any(row["calibration"] == c for row in rows)]
    for calibration in calibrations:
        lines += [f"### calibration `{calibration}` (mean ± std over the row's seeds; test split)", "",
                  "| data | modalities | target ε | seeds | σ | record ε (RDP, all sites) | per-site ε (RDP) | "
                  "paper's ε claim | federated C | centralised twin C | no DP C | federated − twin | 95% band width | "
                  "reconstruction R² |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for setting, modalities in settings:
            chosen = [row for row in rows if row["setting"] == setting and row["modalities"] == modalities]
            no_dp = [row["federated_c_index"] for row in chosen if math.isinf(row["epsilon_target"])
                     and (row["calibration"] == PRIVATE) == (calibration == PRIVATE)]
            for epsilon in sorted({row["epsilon_target"] for row in chosen}, key=lambda e: (math.isinf(e), e)):
                group = [row for row in chosen if row["epsilon_target"] == epsilon
                         and (row["calibration"] == calibration or (math.isinf(epsilon) and calibration != PRIVATE
                                                                      and row["calibration"] != PRIVATE))]
                if not group:
                    continue
                differences = [abs(row["federated_c_index"] - row["centralised_c_index"]) for row in group
                               if math.isfinite(row["centralised_c_index"])]
                r2 = {name: [row["r2"][name] for row in group] for name in group[0]["r2"]}
                lines.append(
                    f"| {setting} | {modalities} | {_eps(epsilon)} | {len(group)} | "
                    f"{_eps(max(r['noise_multiplier'] for r in group))} | "
                    f"{_eps(max(r['epsilon_record'] for r in group))} | {_eps(max(r['epsilon_site_max'] for r in group))} | "
                    f"{_eps(max(r['epsilon_paper'] for r in group))} | "
                    f"{mean_std([r['federated_c_index'] for r in group])} | "
                    f"{mean_std([r['centralised_c_index'] for r in group])} | {mean_std(no_dp)} | "
                    f"{f'max {max(differences):.1e}' if differences else '–'} | "
                    f"{mean_std([r['federated_band_width'] for r in group])} | "
                    + ", ".join(f"{name} {mean_std(values, 2)}" for name, values in r2.items()) + " |")
        lines.append("")
    lines += ["### The paper's Table 2 (TCGA, validation C-index; a different data set, for the shape only)", "",
              "| modalities | ε | federated | centralised |", "| --- | --- | --- | --- |"]
    for modalities, by_epsilon in PAPER_TABLE2.items():
        for epsilon, (federated, centralised) in by_epsilon.items():
            lines.append(f"| {modalities} | {_eps(epsilon)} | {federated:.3f} | {centralised:.3f} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    _figure(out / "figure.png", rows, settings, calibrations)
    return text


def _figure(path: Path, rows: list[dict[str, Any]], settings: list[tuple[str, str]], calibrations: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(settings), figsize=(4.6 * len(settings), 7.5), squeeze=False)
    for column, (setting, modalities) in enumerate(settings):
        chosen = [row for row in rows if row["setting"] == setting and row["modalities"] == modalities]
        finite = sorted({row["epsilon_target"] for row in chosen if math.isfinite(row["epsilon_target"])})
        no_dp = [row for row in chosen if math.isinf(row["epsilon_target"])]
        top, bottom = axes[0, column], axes[1, column]
        if no_dp:
            top.axhline(np.mean([row["federated_c_index"] for row in no_dp]), color="k", linestyle="--",
                        label="no DP")
            for index, name in enumerate(no_dp[0]["r2"]):
                bottom.axhline(np.mean([row["r2"][name] for row in no_dp]), color=f"C{index}", linestyle="--",
                               label=f"{name}, no DP")
        for style, calibration in zip(("-", ":"), calibrations, strict=False):
            groups = [[row for row in chosen if row["epsilon_target"] == eps and row["calibration"] == calibration]
                      for eps in finite]
            top.errorbar(finite, [np.mean([r["federated_c_index"] for r in g]) for g in groups],
                         yerr=[np.std([r["federated_c_index"] for r in g]) for g in groups], marker="o",
                         linestyle=style, capsize=2, label=f"split, {calibration}")
            if groups and groups[0]:
                for index, name in enumerate(groups[0][0]["r2"]):
                    bottom.plot(finite, [np.mean([r["r2"][name] for r in g]) for g in groups], marker="o",
                                linestyle=style, color=f"C{index}", label=f"{name}, {calibration}")
        for axis in (top, bottom):
            axis.set_xscale("log")
            axis.set_xlabel("target ε")
            axis.legend(fontsize=6)
        top.set_title(f"{setting}: {modalities}", fontsize=9)
        top.set_ylabel("test C-index")
        bottom.set_ylabel("reconstruction R² (ridge, 30% auxiliary)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", nargs="+", default=["metabric:genomic,clinical"],
                        help="data:modality,modality ... (one per setting)")
    parser.add_argument("--epsilons", default="inf,0.5,1,1.5,10")
    parser.add_argument("--calibrations", default="rdp,paper")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--twin-seeds", default="0", help="seeds whose runs also train the centralised twin")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--report-only", action="store_true", help="rewrite table.md/figure.png from results.csv")
    parser.add_argument("--paper-architecture", action="store_true",
                        help="run the paper's network (embedding 512, 2 encoder and 4 head blocks, dropout 0.5, "
                             "per-interval risk layer, 30 intervals) instead of the project's defaults")
    parser.add_argument("overrides", nargs="*", help="run-config key=value shared by every run")
    args = parser.parse_args(argv)
    shared = {**(PAPER_ARCHITECTURE if args.paper_architecture else {}),
              **{key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}}
    settings = [(text.split(":")[0], tuple(text.split(":")[1].split(","))) for text in args.settings]
    rows = (_read(args.out / "results.csv") if args.report_only else
            run_grid(args.out, settings, [float(e) for e in args.epsilons.split(",")],
                     args.calibrations.split(","), [int(s) for s in args.seeds.split(",")],
                     {int(s) for s in args.twin_seeds.split(",") if s}, shared, args.jobs))
    print(write_report(args.out, rows))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
