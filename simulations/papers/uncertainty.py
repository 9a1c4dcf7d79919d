"""Predictive uncertainty of BayesianMultisurv with and without a modality (BVFLMSP paper, Sec. 8, Figure 8).

For every seed: split the records (label holder's stratified split), train the centralised
BayesianMultisurv on every modality, and for every modality ``k`` (a) predict with ``k`` masked
in the presence mask ("masked at prediction") and (b) train the same architecture, from the same
seeds, on the other modalities ("trained without"). Each model gives ``--passes`` stochastic
passes over the test records; :mod:`simulations.papers.uncertainty_bands` turns them into 95% band widths.

Usage::

    python -m simulations.papers.uncertainty --data synthetic_multimodal --out docs/results/bvflmsp/uncertainty \\
        [--passes 100] [--seeds 0,1,2,3,4] [--epochs 20] [--lr 0.005] [--batch-size 128] ...

Writes into ``OUT/<data>/``:

* ``runs.csv``: one row per (seed, setup, modality): test C-index and IBS of the mean curve,
  mean band width over the grid and at the early / middle / late times (25 / 50 / 75 % quantiles
  of the training event times), the noise-to-signal ratio on the logit scale
  (:func:`simulations.papers.uncertainty_bands.noise_to_signal`), and against the same seed's full model: width
  difference, ratio and share of records whose band widened;
* ``summary.csv`` and ``summary.json``: mean ± std over seeds of every column, the number of
  seeds whose band widened, and (JSON) the settings and the mean width at every grid time;
* ``curves_without_<k>.png``: three test records (10th, 50th, 90th percentile of the full
  model's predicted risk) with their mean survival curve and 95% band, all modalities vs trained
  without ``k`` vs ``k`` masked (first seed);
* ``violins_without_<k>.png``: the passes' predicted survival of the median-risk test record at
  the early, middle and late times, for the three setups (the shape of the paper's Figure 8;
  first seed);
* ``width_by_time.png``: mean band width against time, mean ± std over seeds, per setup.

Figures are drawn with ``matplotlib.figure.Figure`` on the Agg canvas (no GUI backend).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from models.data.vertical import (
    BUILT_IN_VERTICAL,
    ModalityTransform,
    VerticalTable,
    load_vertical,
    split_train_test,
)
from models.metrics import evaluate_survival
from models.multimodal import BayesianMultisurv, build_multisurv, survival_band
from models.multimodal_training import (
    MultimodalData,
    discretised_labels,
    fit_transforms,
    modality_inputs,
    predict_multisurv,
    train_multisurv,
)
from models.time_grid import make_time_grid
from simulations.papers.uncertainty_bands import (
    compare_bands,
    mask_modality,
    noise_to_signal,
    summarise_band,
    survival_passes,
    time_columns,
)

ALL = "all modalities"
TRAINED_WITHOUT = "trained without"
MASKED = "masked at prediction"
SETUP_COLOURS = {ALL: "tab:blue", TRAINED_WITHOUT: "tab:orange", MASKED: "tab:green"}
#: Early, middle and late times: these quantiles of the training event times.
PHASES = {"early": 0.25, "middle": 0.5, "late": 0.75}
METRICS = ("c_index", "ibs", "mean_width", *(f"width_{phase}" for phase in PHASES), "noise_to_signal",
           "difference", "ratio", "share_wider")


@dataclass(frozen=True)
class Settings:
    """Training and prediction settings shared by every model of a run."""

    data: str
    data_dir: str
    n: int
    test_fraction: float
    num_durations: int
    dim: int
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    passes: int
    level: float


@dataclass(frozen=True)
class Passes:
    """Hazard logits (passes, n_test, T) of one model on the test records, with its setup."""

    setup: str
    modality: str
    logits: torch.Tensor


def train_model(table: VerticalTable, train_ids: np.ndarray, cuts: np.ndarray, seed: int,
                settings: Settings) -> tuple[BayesianMultisurv, dict[str, ModalityTransform]]:
    """BayesianMultisurv trained on ``table``'s modalities (records ``train_ids``), and its preprocessing."""
    transforms = fit_transforms(table, train_ids)
    inputs, present = modality_inputs(table, train_ids, transforms)
    train = table.subset(train_ids)
    time_index, event = discretised_labels(train.time, train.event, cuts)
    model = build_multisurv({name: transform.input_shape for name, transform in transforms.items()}, seed=seed,
                            dim=settings.dim, num_durations=cuts.size)
    train_multisurv(model, MultimodalData(inputs, present, time_index, event), epochs=settings.epochs,
                    batch_size=settings.batch_size, lr=settings.lr, weight_decay=settings.weight_decay, seed=seed)
    return model, transforms


def run_seed(table: VerticalTable, seed: int, settings: Settings) -> tuple[list[dict], list[Passes], dict]:
    """Every model of one seed: rows for ``runs.csv``, the passes of every setup, and the seed's context.

    The context holds the grid ``cuts``, the ``phase_times`` and the test records' ``ids``, ``time`` and
    ``event``.
    """
    train_ids, test_ids = split_train_test(table, test_fraction=settings.test_fraction, seed=seed)
    train, test = table.subset(train_ids), table.subset(test_ids)
    cuts = make_time_grid(train.time, train.event, num_durations=settings.num_durations)
    phase_times = np.quantile(train.time[train.event == 1], list(PHASES.values()))
    phase_columns = time_columns(cuts, phase_times)

    started = time.perf_counter()
    model, transforms = train_model(table, train_ids, cuts, seed, settings)
    print(f"seed {seed}: all modalities trained in {time.perf_counter() - started:.0f} s", flush=True)
    test_inputs, test_present = modality_inputs(table, test_ids, transforms)
    full_logits = predict_multisurv(model, test_inputs, test_present, passes=settings.passes, seed=seed)
    passes = [Passes(ALL, "", full_logits)]
    for name in model.modalities:
        masked = mask_modality(test_present, model.modalities, name)
        passes.append(Passes(MASKED, name, predict_multisurv(model, test_inputs, masked, passes=settings.passes,
                                                             seed=seed)))
        started = time.perf_counter()
        reduced = table.select([other for other in model.modalities if other != name])
        reduced_model, reduced_transforms = train_model(reduced, train_ids, cuts, seed, settings)
        print(f"seed {seed}: without {name} trained in {time.perf_counter() - started:.0f} s", flush=True)
        reduced_inputs, reduced_present = modality_inputs(reduced, test_ids, reduced_transforms)
        passes.append(Passes(TRAINED_WITHOUT, name, predict_multisurv(
            reduced_model, reduced_inputs, reduced_present, passes=settings.passes, seed=seed)))

    rows = []
    for item in passes:
        summary = summarise_band(item.logits, level=settings.level)
        mean_curve = survival_passes(item.logits).mean(axis=0)
        metrics = evaluate_survival(cuts, mean_curve, time=test.time, event=test.event,
                                    concordance_td=False)
        row = {"seed": seed, "setup": item.setup, "modality": item.modality, "c_index": metrics["c_index"],
               "ibs": metrics["ibs"], "mean_width": summary.mean_width,
               **{f"width_{phase}": float(summary.width_by_time[column])
                  for phase, column in zip(PHASES, phase_columns, strict=True)},
               "noise_to_signal": noise_to_signal(item.logits),
               **{f"time_{phase}": float(value) for phase, value in zip(PHASES, phase_times, strict=True)},
               "width_by_time": summary.width_by_time.tolist()}
        if item.setup != ALL:
            comparison = compare_bands(full_logits, item.logits, level=settings.level)
            row |= {"difference": comparison.difference, "ratio": comparison.ratio,
                    "share_wider": comparison.share_wider}
        rows.append(row)
        print(f"  {item.setup:22s} {item.modality:10s} C {row['c_index']:.3f}  IBS {row['ibs']:.4f}  "
              f"width {row['mean_width']:.4f}" + (f"  ratio {row['ratio']:.3f}" if "ratio" in row else ""), flush=True)
    context = {"cuts": cuts, "phase_times": phase_times, "ids": test.ids, "time": test.time, "event": test.event}
    return rows, passes, context


def _padded(profiles: Sequence[Sequence[float]]) -> np.ndarray:
    """Profiles over grid indices as rows of one array, NaN-padded (a seed's grid may have fewer points)."""
    out = np.full((len(profiles), max(len(profile) for profile in profiles)), np.nan)
    for row, profile in enumerate(profiles):
        out[row, :len(profile)] = profile
    return out


def summarise_runs(rows: Sequence[Mapping]) -> list[dict]:
    """Mean ± std (ddof 1) over seeds of every metric, per (setup, modality), and the seeds whose band widened.

    ``difference_over_seed_std`` is the mean paired width difference divided by its standard
    deviation over seeds; ``seeds_wider`` counts the seeds with a positive difference;
    ``width_by_time_mean`` / ``_std`` profile the mean band width over the grid indices.
    """
    groups: dict[tuple[str, str], list[Mapping]] = {}
    for row in rows:
        groups.setdefault((row["setup"], row["modality"]), []).append(row)
    summary = []
    for (setup, modality), members in groups.items():
        entry: dict = {"setup": setup, "modality": modality, "seeds": len(members)}
        for metric in METRICS:
            values = np.array([member[metric] for member in members if metric in member], dtype=np.float64)
            if values.size:
                entry[f"{metric}_mean"] = float(values.mean())
                entry[f"{metric}_std"] = float(values.std(ddof=1)) if values.size > 1 else float("nan")
        if setup != ALL:
            differences = np.array([member["difference"] for member in members])
            entry["seeds_wider"] = int(np.sum(differences > 0))
            spread = differences.std(ddof=1) if differences.size > 1 else float("nan")
            entry["difference_over_seed_std"] = float(differences.mean() / spread) if spread > 0 else float("nan")
        by_time = _padded([member["width_by_time"] for member in members])
        entry["width_by_time_mean"] = np.nanmean(by_time, axis=0).tolist()
        entry["width_by_time_std"] = np.nanstd(by_time, axis=0, ddof=1).tolist() if len(members) > 1 else None
        summary.append(entry)
    return summary


def _figure(width: float, height: float) -> Figure:
    """A figure drawn by the Agg canvas (no GUI backend, no pyplot state)."""
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _records_by_risk(full_logits: torch.Tensor, column: int, quantiles: Sequence[float]) -> list[int]:
    """Test records at the given quantiles of the full model's predicted risk 1 - mean S(τ_column)."""
    risk = 1.0 - survival_passes(full_logits)[:, :, column].mean(axis=0)
    order = np.argsort(risk, kind="stable")
    return [int(order[int(round(q * (risk.size - 1)))]) for q in quantiles]


def plot_curves(path: Path, setups: Sequence[Passes], context: Mapping, level: float, records: Sequence[int],
                title: str) -> None:
    """Mean survival curve and ``level`` band of each record (one panel each) for every setup."""
    fig = _figure(4.2 * len(records), 3.8)
    axes = fig.subplots(1, len(records), squeeze=False)[0]
    cuts = context["cuts"]
    for ax, record in zip(axes, records, strict=True):
        for item in setups:
            mean, lower, upper = (curve[0].numpy() for curve in survival_band(item.logits[:, record:record + 1],
                                                                              level=level))
            colour = SETUP_COLOURS[item.setup]
            ax.step(cuts, mean, where="post", color=colour, label=item.setup)
            ax.fill_between(cuts, lower, upper, step="post", color=colour, alpha=0.2, linewidth=0)
        observed = context["time"][record]
        ax.axvline(observed, color="black", linestyle=":", linewidth=1,
                   label="observed event" if context["event"][record] else "censored")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("time")
        ax.set_title(f"record {context['ids'][record]}", fontsize=9)
    axes[0].set_ylabel(f"survival: mean and {level:.0%} band")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_violins(path: Path, setups: Sequence[Passes], context: Mapping, record: int, title: str) -> None:
    """The passes' predicted survival of ``record`` at the early, middle and late times, per setup."""
    columns = time_columns(context["cuts"], context["phase_times"])
    fig = _figure(3.4 * len(PHASES), 3.8)
    axes = fig.subplots(1, len(PHASES), squeeze=False)[0]
    for ax, phase, column, at in zip(axes, PHASES, columns, context["phase_times"], strict=True):
        values = [survival_passes(item.logits[:, record:record + 1])[:, 0, column] for item in setups]
        parts = ax.violinplot(values, showmeans=True)
        for body, item in zip(parts["bodies"], setups, strict=True):
            body.set_facecolor(SETUP_COLOURS[item.setup])
            body.set_alpha(0.5)
        for lines in ("cbars", "cmins", "cmaxes", "cmeans"):
            parts[lines].set_color("black")
            parts[lines].set_linewidth(0.8)
        ax.set_xticks(range(1, len(setups) + 1), [item.setup.replace(" ", "\n", 1) for item in setups], fontsize=7)
        ax.set_title(f"{phase} (t = {at:.3g})", fontsize=9)
    axes[0].set_ylabel("predicted survival (one value per pass)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_width_by_time(path: Path, summary: Sequence[Mapping], modalities: Sequence[str], title: str) -> None:
    """Mean band width at every grid index, mean ± std over seeds, one panel per removed modality."""
    fig = _figure(4.2 * len(modalities), 3.6)
    axes = fig.subplots(1, len(modalities), squeeze=False, sharey=True)[0]
    for ax, name in zip(axes, modalities, strict=True):
        for entry in summary:
            if entry["setup"] != ALL and entry["modality"] != name:
                continue
            mean = np.asarray(entry["width_by_time_mean"])
            grid = np.arange(mean.size)
            colour = SETUP_COLOURS[entry["setup"]]
            ax.plot(grid, mean, color=colour, label=entry["setup"])
            if entry["width_by_time_std"] is not None:
                std = np.asarray(entry["width_by_time_std"])
                ax.fill_between(grid, mean - std, mean + std, color=colour, alpha=0.2, linewidth=0)
        ax.set_title(f"removing {name}", fontsize=9)
        ax.set_xlabel("grid index j")
    axes[0].set_ylabel("mean 95% band width of S(τ_j)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write_csv(path: Path, rows: Sequence[Mapping], columns: Sequence[str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)


def run(settings: Settings, seeds: Sequence[int], out: Path) -> list[dict]:
    """Train and predict for every seed, write the tables and figures into ``out``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    table = load_vertical(settings.data, data_dir=settings.data_dir, n=settings.n)
    rows: list[dict] = []
    figure_passes: list[Passes] = []
    figure_context: dict = {}
    for index, seed in enumerate(seeds):
        seed_rows, passes, context = run_seed(table, seed, settings)
        rows += seed_rows
        if index == 0:
            figure_passes, figure_context = passes, context
    summary = summarise_runs(rows)
    run_columns = ["seed", "setup", "modality", *METRICS, *(f"time_{phase}" for phase in PHASES)]
    _write_csv(out / "runs.csv", rows, run_columns)
    summary_columns = ["setup", "modality", "seeds", *(f"{metric}_{stat}" for metric in METRICS
                                                        for stat in ("mean", "std")),
                       "seeds_wider", "difference_over_seed_std"]
    _write_csv(out / "summary.csv", summary, summary_columns)
    (out / "summary.json").write_text(json.dumps({"settings": asdict(settings), "seeds": list(seeds),
                                                  "phase_quantiles": PHASES, "summary": summary}, indent=1))

    modalities = list(table.modalities)
    full = figure_passes[0]
    middle = int(time_columns(figure_context["cuts"], figure_context["phase_times"][1:2])[0])
    records = _records_by_risk(full.logits, middle, (0.1, 0.5, 0.9))
    for name in modalities:
        setups = [full, *(item for item in figure_passes if item.modality == name)]
        plot_curves(out / f"curves_without_{name}.png", setups, figure_context, settings.level, records,
                    f"{settings.data}, seed {seeds[0]}: all modalities vs without {name!r}")
        plot_violins(out / f"violins_without_{name}.png", setups, figure_context, records[1],
                     f"{settings.data}, seed {seeds[0]}, record {figure_context['ids'][records[1]]} (median risk): "
                     f"{settings.passes} passes")
    plot_width_by_time(out / "width_by_time.png", summary, modalities,
                       f"{settings.data}: mean over test records, mean ± std over {len(seeds)} seeds")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=BUILT_IN_VERTICAL, default="synthetic_multimodal")
    parser.add_argument("--data-dir", default="",
                        help="folder of metabric.csv (default: $FEDSURV_DATA_DIR, else the bundled copy)")
    parser.add_argument("--out", type=Path, required=True, help="results go to OUT/<data>/")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (split, initialisation, passes)")
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--level", type=float, default=0.95)
    parser.add_argument("--n", type=int, default=3000, help="records of the synthetic generator")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--num-durations", type=int, default=30)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    args = parser.parse_args(argv)
    settings = Settings(data=args.data, data_dir=args.data_dir, n=args.n, test_fraction=args.test_fraction,
                        num_durations=args.num_durations, dim=args.dim, epochs=args.epochs,
                        batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        passes=args.passes, level=args.level)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    summary = run(settings, seeds, args.out / args.data)
    for entry in summary:
        line = f"{entry['setup']:22s} {entry['modality']:10s} width {entry['mean_width_mean']:.4f} ± " \
               f"{entry['mean_width_std']:.4f}  C {entry['c_index_mean']:.3f} ± {entry['c_index_std']:.3f}"
        if entry["setup"] != ALL:
            line += (f"  difference {entry['difference_mean']:+.4f} ± {entry['difference_std']:.4f} "
                     f"({entry['seeds_wider']}/{entry['seeds']} seeds wider)")
        print(line)


if __name__ == "__main__":
    main()
