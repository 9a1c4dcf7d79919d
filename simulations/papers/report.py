"""The results page from the latest saved run of each reproduction: ``python -m simulations.papers.report``.

Nothing is trained or rerun. Each experiment command saved its runs under ``docs/results/``: one
folder per run (``results.csv``, a row per run with every metric and every ε, and ``meta.json``,
the commit of the code that produced it and what the run is), the tradeoff plans as JSON lines (a
``commit`` in every row) and one JSON object per benchmark. Older runs are not kept (git keeps
them); a variant of a run is a folder named by what differs. This command

1. rewrites each run's own ``table.md`` and figure from its ``results.csv``, with the module that
   ran it (its ``--report-only`` path): the adaptive-DP reproduction
   (:mod:`simulations.papers.adaptive_dp`), FSL-BDP's Table 3 and Figure 10
   (:mod:`simulations.papers.fsl_bdp`), BVFLMSP's Tables 1 and 2 (:mod:`simulations.papers.table1`,
   :mod:`simulations.papers.bvflmsp`) and the membership-inference audits
   (:mod:`simulations.papers.membership`);
2. writes ``docs/results.md``: per reproduction, the commit its run states, our figures beside the
   paper's, the audited ε beside the nominal one, the figures, the benchmark figures against their
   targets, and the page that documents its setup, commands and reading.

The uncertainty figures of BVFLMSP need per-record curves that are not saved; their summary table
is rebuilt from the saved ``summary.csv`` and the figures are linked as they were drawn.

Usage::

    python -m simulations.papers.report [--results docs/results] [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from flwr_app.config import PROJECT_ROOT, ConfigError
from simulations.papers import adaptive_dp, bvflmsp, fsl_bdp, membership, table1

_SIM_COX_ARGS = ["--epsilons", "0.6,0.7,0.8,0.9,1.0", "--metrics", "inbll,ibs,c_index"]
_FLCHAIN_ARGS = ["--epsilons", "3,4,5,7", "--metrics", "c_index,ibs,inbll", "--methods",
                 "no DP,NbAFL,ROW-DP(Std),ROW-DP(Var),ROW-DP(Range),ROW-DP(MAE),ROW-DP(IQR),LS-ADP,NbAFL exact,LS-ADP exact"]
#: The adaptive-DP runs (docs/results/adaptive_dp/<folder>): folder -> the arguments their commands ran with
#: (docs/results/adaptive_dp.md, "Commands").
ADAPTIVE_DP_GRIDS: dict[str, list[str]] = {"sim_cox": _SIM_COX_ARGS, "flchain": _FLCHAIN_ARGS}
#: FSL-BDP's runs (docs/results/fsl_bdp_sba/<folder>).
FSL_BDP_GRIDS: tuple[str, ...] = ("regions", "states")
TABLE1_DATA: tuple[str, ...] = ("metabric", "breast_cancer", "synthetic_multimodal")
#: BVFLMSP Table 2 and its variants (docs/results/bvflmsp/<folder>), each named by what differs.
TABLE2_GRIDS: tuple[str, ...] = ("table2", "table2_private_split", "table2_clean_inference", "table2_embedding16",
                                 "table2_embedding16_large_epsilon", "no_dp/split")
#: The membership-inference audits (docs/results/membership/<folder>).
MEMBERSHIP_GRIDS: tuple[str, ...] = ("flchain", "metabric_overfit")
UNCERTAINTY_DATA: tuple[str, ...] = ("metabric", "synthetic_multimodal")
#: Each run folder's metadata: the commit of the code that produced it and what it is.
META = "meta.json"


def run_meta(folder: Path) -> dict[str, str]:
    """A run folder's ``meta.json``: ``commit`` (the code that produced its rows), ``description``, ``note``
    (optional)."""
    path = folder / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; every run folder states its commit there "
                          '({"commit": "<hash>", "description": "<what the run is>"})') from None
    if not meta.get("commit") or not meta.get("description"):
        raise ConfigError(f"{path}: needs 'commit' and 'description'")
    return meta


def run_line(folder: Path) -> str:
    """The sentence naming a run's commit (and its note), read from its ``meta.json``."""
    meta = run_meta(folder)
    return f"Run with the code of commit {meta['commit']}" + (f" ({meta['note']})" if meta.get("note") else "") + "."


def _quietly(main: Callable[[list[str]], object], argv: list[str]) -> None:
    """Run a module's ``main(argv)`` without its printout (the tables are read back from its files)."""
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)


def _grid_blocks(out: Path, main: Callable[[list[str]], object], folders: Sequence[Path],
                 argv: dict[str, list[str]] | None = None) -> list[str]:
    """Each run's ``table.md`` and ``figure.png`` rewritten by ``main --report-only``; its description, commit,
    table and figure as report blocks."""
    blocks: list[str] = []
    for folder in folders:
        _quietly(main, ["--out", str(folder), "--report-only", *(argv or {}).get(folder.name, [])])
        title = run_meta(folder)["description"]
        blocks += [f"### {title}", "", run_line(folder), "",
                   _demote((folder / "table.md").read_text(encoding="utf-8")), "",
                   f"![{title}]({(folder / 'figure.png').relative_to(out.parent)})", ""]
    return blocks


def _demote(markdown: str, top: int = 4) -> str:
    """Shift the headings of a grid's table so that its highest becomes level ``top`` (under this report's ###)."""
    levels = [len(line) - len(line.lstrip("#")) for line in markdown.splitlines() if line.startswith("#")]
    shift = top - min(levels) if levels else 0
    return "\n".join("#" * shift + line if line.startswith("#") else line for line in markdown.splitlines())


def _link(path: Path, out: Path, text: str | None = None) -> str:
    relative = path.relative_to(out.parent)
    return f"[{text or relative}]({relative})"


def _number(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------


def flchain_sweep(results: Path, out: Path) -> str:
    """FLCHAIN, every horizontal strategy at every ε (the ε-sweep benchmark's runs)."""
    sweep = json.loads((results / "benchmarks" / "epsilon_sweep.json").read_text(encoding="utf-8"))
    rows = pd.DataFrame(sweep["rows"])
    epsilons = sorted(e for e in rows["epsilon"].dropna().unique())
    lines = ["Test C-index of the final global model (pooled test split, 1 seed; 5 IID sites, 20 rounds, hazard MLP) "
             "and the ε the run reports (its ledger's headline: the worst site's record-level ε, or ε_μ for BDP; "
             "for the weight-perturbation strategies the audited RDP ε of the noise that was added, not the paper's "
             "nominal budget) beside the target.", "",
             "| strategy | " + " | ".join(f"target ε = {e:g}" for e in epsilons) + " |",
             "| --- |" + " --- |" * len(epsilons)]
    for strategy, part in rows.groupby("strategy", sort=False):
        if part["epsilon"].isna().all():
            cell = f"C {part['c_index'].iloc[0]:.3f} (no DP)"
            lines.append(f"| {strategy} | " + " | ".join([cell] * len(epsilons)) + " |")
            continue
        cells = []
        for epsilon in epsilons:
            run = part[part["epsilon"] == epsilon]
            cells.append("–" if run.empty else
                         f"C {run['c_index'].iloc[0]:.3f}, ε {_number(float(run['epsilon_spent'].iloc[0]))}")
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    produced = (f"produced by commit {sweep['commit']}" if sweep.get("commit") else
                "measured on 2026-11-23, before the private set-up, the recalibration and the DP recipes of today")
    lines += ["", f"Source: {_link(results / 'benchmarks' / 'epsilon_sweep.json', out)} "
              f"(`python benchmarks/epsilon_sweep.py`), {produced}."]
    return "\n".join(lines)


def adaptive_dp_section(results: Path, out: Path) -> str:
    """LS-ADP / ROW-DP / NbAFL (the adaptive-DP Cox-MLP paper): tables with the paper's numbers in brackets."""
    blocks = _grid_blocks(out, adaptive_dp.main, [results / "adaptive_dp" / grid for grid in ADAPTIVE_DP_GRIDS],
                          ADAPTIVE_DP_GRIDS)
    blocks.append(f"Setup, commands and reading: {_link(results / 'adaptive_dp.md', out)}.")
    return "\n".join(blocks)


#: FSL-BDP's Table 3, SBA rows (test / out-of-time C-index and IBS, mean ± std over 5 runs; the
#: table does not say at which ε).
PAPER_FSL_BDP_SBA: dict[str, tuple[str, str, str, str]] = {
    "Centralized (No DP)": ("0.748 ± 0.034", "0.019 ± 0.007", "0.639 ± 0.047", "0.089 ± 0.036"),
    "Centralized (Classical DP)": ("0.696 ± 0.044", "0.020 ± 0.008", "0.596 ± 0.056", "0.096 ± 0.041"),
    "Centralized (BDP)": ("0.692 ± 0.036", "0.020 ± 0.008", "0.612 ± 0.053", "0.094 ± 0.039"),
    "Federated (No DP)": ("0.738 ± 0.041", "0.019 ± 0.007", "0.631 ± 0.044", "0.077 ± 0.033"),
    "Federated (Classical DP)": ("0.699 ± 0.047", "0.021 ± 0.008", "0.576 ± 0.057", "0.099 ± 0.042"),
    "Federated (BDP)": ("0.704 ± 0.043", "0.020 ± 0.008", "0.598 ± 0.056", "0.095 ± 0.040"),
}


def fsl_bdp_section(results: Path, out: Path) -> str:
    """FSL-BDP on the SBA loans: Table 3 with the paper's SBA rows beside ours; per-site wins; Figure 10."""
    blocks = []
    for grid in FSL_BDP_GRIDS:
        folder = results / "fsl_bdp_sba" / grid
        title = run_meta(folder)["description"]
        fsl_bdp.write_saved(folder, title)
        table = pd.read_csv(folder / "table3.csv", float_precision="round_trip")
        targets = sorted(table["epsilon_target"].unique())
        blocks += [f"### {title}", "", run_line(folder), "",
                   "Test C-index, ours (mean ± std over seeds) at each target ε, beside the paper's SBA row (its "
                   "table gives no ε). The ε columns of the full table are the runs' headline ε (largest over "
                   "sites and seeds; ε_μ for BDP, with the classical ε of the same noise beside it).", "",
                   "| scenario | paper | " + " | ".join(f"ours, ε = {t:g}" for t in targets) + " |",
                   "| --- | --- |" + " --- |" * len(targets)]
        for scenario, paper in PAPER_FSL_BDP_SBA.items():
            cells = []
            for target in targets:
                row = table[(table["epsilon_target"] == target) & (table["scenario"] == scenario)]
                cells.append("–" if row.empty else f"{row['Test CI'].iloc[0]} (ε {row['epsilon (max over seeds)'].iloc[0]})")
            blocks.append(f"| {scenario} | {paper[0]} | " + " | ".join(cells) + " |")
        blocks += ["", "Full table (test and out-of-time C-index and IBS, ε):", "",
                   _demote((folder / "table3.md").read_text(encoding="utf-8")), "",
                   _demote((folder / "site_wins.md").read_text(encoding="utf-8")), "",
                   f"![{title}]({(folder / 'fig10.png').relative_to(out.parent)})", ""]
    blocks.append(f"Setup, commands and reading (why the SBA C-indices exceed the paper's): "
                  f"{_link(results / 'fsl_bdp_sba.md', out)}.")
    return "\n".join(blocks)


def bvflmsp_table1_section(results: Path, out: Path) -> str:
    """BVFLMSP Table 1: centralised baselines on three data sets, the paper's TCGA C-indices beside them."""
    run = results / "bvflmsp" / "table1"
    blocks = [f"{run_meta(run)['description'].capitalize()}. {run_line(run)}", ""]
    for data in TABLE1_DATA:
        folder = run / data
        _quietly(table1.main, ["--data", data, "--out", str(folder), "--report-only"])
        blocks += [f"### {data}", "", (folder / "table.md").read_text(encoding="utf-8"), ""]
    blocks += ["### The paper's Table 1 (TCGA, C-index; a different data set, for reference)", "",
               "| Model | " + " | ".join(table1.PAPER_TABLE1_COLUMNS) + " |",
               "| --- |" + " --- |" * len(table1.PAPER_TABLE1_COLUMNS)]
    for model, values in table1.PAPER_TABLE1_C_INDEX.items():
        blocks.append(f"| {model} | " + " | ".join(_number(value) for value in values) + " |")
    blocks += ["", f"Setup, commands, the paper's other metrics and reading: {_link(results / 'bvflmsp_table1.md', out)}."]
    return "\n".join(blocks)


def bvflmsp_table2_section(results: Path, out: Path) -> str:
    """BVFLMSP Table 2: split learning under embedding DP; record-level RDP ε beside the paper's ε claim."""
    blocks = _grid_blocks(out, bvflmsp.main, [results / "bvflmsp" / grid for grid in TABLE2_GRIDS])
    blocks.append(f"Setup, commands, the diagnostics and reading: {_link(results / 'bvflmsp.md', out)}.")
    return "\n".join(blocks)


def uncertainty_section(results: Path, out: Path) -> str:
    """BVFLMSP uncertainty bands: mean 95 % band width per setup (from the saved summaries)."""
    blocks = ["Mean width of the 95 % band of the survival curve over test records (mean ± std over seeds), "
              "with all modalities, with one modality masked at prediction, and retrained without it; "
              "\"wider\" counts the seeds on which the band is wider than with all modalities. "
              + run_line(results / "bvflmsp" / "uncertainty"), ""]
    for data in UNCERTAINTY_DATA:
        folder = results / "bvflmsp" / "uncertainty" / data
        summary = pd.read_csv(folder / "summary.csv", float_precision="round_trip")
        blocks += [f"### {data}", "", "| setup | modality | band width | C-index | difference | wider |",
                   "| --- | --- | --- | --- | --- | --- |"]
        for _, row in summary.iterrows():
            modality = row["modality"] if isinstance(row["modality"], str) else "–"
            difference = ("–" if pd.isna(row.get("difference_mean")) else
                          f"{row['difference_mean']:+.4f} ± {row['difference_std']:.4f}")
            wider = "–" if pd.isna(row.get("seeds_wider")) else f"{int(row['seeds_wider'])}/{int(row['seeds'])}"
            blocks.append(f"| {row['setup']} | {modality} | {row['mean_width_mean']:.4f} ± {row['mean_width_std']:.4f} | "
                          f"{row['c_index_mean']:.3f} ± {row['c_index_std']:.3f} | {difference} | {wider} |")
        blocks += ["", f"![{data}]({(folder / 'width_by_time.png').relative_to(out.parent)})", ""]
    blocks.append(f"Figures per modality and reading: {_link(results / 'bvflmsp_uncertainty.md', out)}.")
    return "\n".join(blocks)


def membership_section(results: Path, out: Path) -> str:
    """Membership-inference audit: attack AUC per strategy and ε beside the DP ceiling of the release."""
    blocks = _grid_blocks(out, membership.main, [results / "membership" / grid for grid in MEMBERSHIP_GRIDS])
    blocks.append(f"Threat model, commands and reading: {_link(results / 'membership.md', out)}.")
    return "\n".join(blocks)


def benchmarks_section(results: Path, out: Path) -> str:
    """The benchmark figures against their targets, each beside its reference measured in the same run."""
    folder = results / "benchmarks"

    def load(name: str) -> dict | None:
        path = folder / f"{name}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None

    lines = ["| benchmark | figure | same-run reference | ratio | target |", "| --- | --- | --- | --- | --- |"]
    if overhead := load("flower_overhead"):
        name = f"{overhead['rounds']}-round FLCHAIN FedAvg, {overhead['sites']} sites"
        if "default_engine_wall_s" in overhead:  # saved since simulation.engine: the target is the default engine's
            lines.append(f"| Flower ServerApp and ClientApp, {name}, default engine (simulation.engine = auto) | "
                         f"{overhead['default_engine_wall_s']} s | bare loop {overhead['bare_loop_wall_s']} s | "
                         f"{overhead['ratio_default_engine_over_bare']} | ≤ {overhead['target_ratio']} |")
        lines.append(f"| Flower simulation on Ray, {name} | "
                     f"{overhead['flower_wall_s']} s (Ray started by the run); {overhead['flower_shared_ray_wall_s']} s "
                     f"(on a running Ray cluster) | bare loop {overhead['bare_loop_wall_s']} s | "
                     f"{overhead['ratio_flower_over_bare']}; {overhead['ratio_flower_shared_ray_over_bare']} | "
                     + ("– |" if "default_engine_wall_s" in overhead else f"≤ {overhead['target_ratio']} |"))
        if "flower_round_after_the_first_s" in overhead:
            round_s, bare_round_s = overhead["flower_round_after_the_first_s"], overhead["bare_loop_wall_per_round_s"]
            lines.append(f"| the same, one round after the first (on a running Ray cluster) | {round_s:.3f} s | bare loop "
                         f"{bare_round_s:.3f} s (its wall time / rounds) | {round_s / bare_round_s:.2f} | – |")
    if steps := load("one_step_rounds"):
        lines.append(f"| {steps['rounds']} rounds of one {steps['overrides']['strategy.name']} step per site, "
                     f"{steps['sites']} sites, through Flower in process | {steps['flower_s_per_round']:.4f} s per round "
                     f"({steps['flower_s_per_round_first_tenth']:.3f} s in the first tenth of the rounds, "
                     f"{steps['flower_s_per_round_last_tenth']:.3f} s in the last) | "
                     f"bare loop {steps['bare_loop_s_per_round']:.4f} s per round | "
                     f"{steps['ratio_flower_over_bare']:.2f} | – |")
    if secure := load("secure_aggregation"):
        for run in secure["runs"]:
            lines.append(f"| distributed_dp round (SecAgg+, {run['sites']} FLCHAIN sites, in process) | "
                         f"{run['secure_round_s']:.3f} s ({run['protocol_s']:.3f} s of protocol) | plain FedAvg round "
                         f"{run['plain_round_s']:.3f} s | {run['ratio']:.2f}"
                         + (f" (median of the pairs {', '.join(f'{ratio:.2f}' for ratio in run['pair_ratios'])})"
                            if "pair_ratios" in run else "") + " | "
                         + (f"≤ {secure['target_ratio_at_40_sites']:g} |" if run["sites"] == 40 else "– |"))
    if step := load("dp_step"):
        dp_ms = step[f"dp_{step['default_backend']}_step_ms"]
        lines.append(f"| DP-SGD step ({step['default_backend']} clipping), hazard MLP, batch {step['batch_size']} | "
                     f"{dp_ms:.2f} ms | plain step {step['plain_step_ms']:.2f} ms | {step['ratio_dp_over_plain']:.2f} | "
                     f"≤ {step['target_ratio']} |")
        lines.append(f"| BDP step (add-remove adjacency) | {step['bdp_step_ms']:.2f} ms | DP-SGD step {dp_ms:.2f} ms | "
                     f"{step['ratio_bdp_over_dp']:.2f} | ≤ {step['target_ratio_bdp_over_dp']} |")
    if epoch := load("vertical_epoch"):
        central = epoch["centralised_epoch_s"]
        lines.append(f"| split-learning epoch in process, {epoch['data']} | {epoch['split_inprocess_epoch_s']:.2f} s | "
                     f"centralised epoch {central:.2f} s | {epoch['ratio_split_inprocess_over_centralised']:.2f} | – |")
        if "split_flower_epoch_s" in epoch:
            lines.append(f"| split-learning epoch through Flower, {epoch['data']} | {epoch['split_flower_epoch_s']:.2f} s "
                         f"({epoch['split_flower_round_trips_per_batch']:.3f} round trips per batch) | centralised epoch "
                         f"{central:.2f} s | {epoch['ratio_split_flower_over_centralised']:.2f} | one round trip per batch |")
    if sites := load("many_sites"):
        targets = sites["targets"]
        for size in sites["sizes"]:
            target = (f"≤ {targets['round_s']:g} s and ≤ {targets['peak_rss_gb']:g} GB |"
                      if size["sites"] == targets["sites"] else "– |")
            if "inprocess_peak_rss_gb" in size:  # saved since auto runs 1000 sites in process: the target is its
                lines.append(f"| {size['sites']} simulated sites, one round in process (the default engine) | "
                             f"{size['inprocess_round_s']:.2f} s, peak {size['inprocess_peak_rss_gb']:.2f} GB | – | – | "
                             + target)
                target = "– |"
            reference = (f"in-process round {size['inprocess_round_s']:.2f} s" if "inprocess_round_s" in size
                         else f"bare round {size['bare_round_s']:.2f} s")
            lines.append(f"| {size['sites']} simulated sites, one round on Ray | {size['round_s']:.2f} s, peak "
                         f"{size['peak_rss_gb']:.2f} GB (this process and Ray's) | {reference} | "
                         f"{size['overhead_ratio']:.1f} | " + target)
    if cold := load("cold_message"):
        median = cold["median"]
        lines.append(f"| one {cold['strategy']} training message in a new process (a deployed site's every message) | "
                     f"{cold['message_in_a_new_process_s']:.2f} s | the same message warm {median['warm_s']:.2f} s | "
                     f"{cold['message_in_a_new_process_s'] / median['warm_s']:.0f} | – (loopback round trip ≤ 3 s) |")
    if loop := load("loopback"):
        targets = loop["targets"]
        for row in loop["rows"]:
            round_target = targets["distributed_dp_round_s" if row["strategy"] == "distributed_dp"
                                  else "fedavg_dp_sgd_round_s"]
            carrier = "query.secagg_masked" if row["strategy"] == "distributed_dp" else "train"
            own = row["phases"][carrier]["own_s"]  # the message that carries the model and the site's training
            executor = "the warm executor" if row["executor"] == "warm" else "Flower's executor"
            lines.append(f"| loopback deployment (TLS, SuperNode auth, 3 SuperNodes on this machine), {row['strategy']}, "
                         f"{executor}, {row.get('machine', 'loaded')} machine | {row['round_s']:.1f} s a round, a site's own time per training message {own:.2f} s | – | – | ≤ {round_target:g} s "
                         f"a round, ≤ {targets['site_own_s_per_message']:g} s a message |")
    if sweep := load("epsilon_sweep"):
        lines.append(f"| ε sweep, {sweep['runs']} runs on FLCHAIN | {sweep['flower_total_s']} s | in process "
                     f"{sweep['inprocess_total_s']} s | {sweep['ratio']} | < {sweep['target_flower_total_s']} s |")
    lines += ["", "Each benchmark is a script under `benchmarks/` that prints the JSON saved in "
              f"{_link(folder, out, 'docs/results/benchmarks/')}; the keys of each JSON say what was measured."]
    return "\n".join(lines)


def field_section(results: Path, out: Path) -> str:
    """Every bundled real data set with the current defaults: no DP, dp_sgd and distributed_dp at ε 1 and 10."""
    from simulations.papers import tradeoffs

    folder = results / "tradeoffs"
    rows = tradeoffs.load_rows(folder, "field")
    return "\n".join([
        "At ε = 1 (the README's table; mean ± std over seeds 0–4, the ledger's ε):", "",
        tradeoffs.field_headline(rows), "",
        "FLCHAIN, METABRIC, GBSG and WHAS at 5 i.i.d. sites and SBA over its 4 census regions, hazard MLP, the "
        "defaults (the DP recipes, the private set-up and the recalibration), mean ± std over seeds 0–4 on the "
        "pooled test split. C_td is Antolini's time-dependent C; the Kaplan–Meier IBS is that of the covariate-free "
        "training Kaplan–Meier curve (the bar a useful model is below); the gap is |mean predicted − Kaplan–Meier "
        "survival| at the median training follow-up. The commit column names the code that produced the rows "
        "(what each shows: " + _link(out.parent / "when-to-use-what.md", out, "when-to-use-what.md") + "):", "",
        tradeoffs.field_table(rows), "",
        f"Source: {_link(folder / 'field.jsonl', out)} (`python -m simulations.papers.tradeoffs run field --out ROWS`)."])


def tradeoffs_section(results: Path, out: Path) -> str:
    """The DP recipe and distributed DP at 5 seeds: the README's table, a figure, and every setting measured."""
    from simulations.papers import tradeoffs

    folder = results / "tradeoffs"
    rows = tradeoffs.load_rows(folder, "main", "distributed")
    figure = folder / "privacy_utility.png"
    tradeoffs.plot_against_epsilon(rows, figure)
    everything = tradeoffs.load_rows(folder, "main", "old_recipe", "distributed", "states", "site_size",
                                     "central_dp_sites")
    return "\n".join([
        run_line(folder) + " Before the private set-up took a share of ε, before the Kaplan–Meier start and the "
        "private recalibration, and with distributed_dp's earlier recipe (clip 1, lr 0.02). The current defaults are "
        "in the section above.",
        "",
        "Test C-index and integrated Brier score (IBS) of the final global model (pooled test split), 20 rounds "
        "(distributed_dp: 60), hazard MLP, mean ± std over 5 seeds, with the defaults (the DP recipes) of then; ε "
        "is the ledger's, the worst site's:", "", tradeoffs.headline(rows), "",
        f"![Test C-index and IBS of dp_sgd against ε, FLCHAIN and SBA]({figure.relative_to(out.parent).as_posix()})",
        "", "Every setting measured (what each means and what it shows: "
        f"{_link(out.parent / 'when-to-use-what.md', out, 'when-to-use-what.md')}):", "",
        tradeoffs.table(everything), "",
        f"Source: {_link(folder, out)} (`python -m simulations.papers.tradeoffs run PLAN --out ROWS`)."])


SECTIONS: tuple[tuple[str, Callable[[Path, Path], str]], ...] = (
    ("Every bundled data set with the current defaults", field_section),
    ("Private training with the DP recipe and distributed DP (earlier commits)", tradeoffs_section),
    ("Horizontal strategies on FLCHAIN", flchain_sweep),
    ("NbAFL, LS-ADP and ROW-DP (adaptive-DP Cox-MLP paper)", adaptive_dp_section),
    ("FSL-BDP: Bayesian vs classical DP on SBA loans", fsl_bdp_section),
    ("BVFLMSP Table 1: centralised baselines", bvflmsp_table1_section),
    ("BVFLMSP Table 2: vertical split learning under embedding DP", bvflmsp_table2_section),
    ("BVFLMSP uncertainty bands", uncertainty_section),
    ("Membership-inference audit", membership_section),
    ("Benchmarks", benchmarks_section),
)


def write(results: Path, out: Path) -> str:
    """Regenerate every grid's tables and figures under ``results`` and write the report to ``out``."""
    parts = ["# fedsurv results", "",
             "Generated by `python -m simulations.papers.report` from the latest run of each reproduction saved under "
             "`docs/results/`; do not edit by hand. Each section names the commit of the code that produced its run "
             "(the run folder's `meta.json`, or each row's `commit`). Every ε is the one the run's privacy ledger "
             "reports (the audited ε of the mechanism that ran), next to the target or the paper's nominal figure; no "
             "ε is averaged over sites. The setup, commands and reading of each reproduction are on the page its "
             "section links to.", ""]
    parts += [f"- [{title}](#{_anchor(title)})" for title, _ in SECTIONS] + [""]
    for title, section in SECTIONS:
        parts += [f"## {title}", "", section(results, out).rstrip(), ""]
    text = "\n".join(parts)
    out.write_text(text, encoding="utf-8")
    return text


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "docs" / "results",
                        help="folder of the saved runs (default: docs/results)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "results.md")
    args = parser.parse_args(argv)
    write(args.results.resolve(), args.out.resolve())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
