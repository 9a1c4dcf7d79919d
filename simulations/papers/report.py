"""Every comparison table and figure, regenerated from saved runs: ``python -m simulations.papers.report``.

Nothing is trained or rerun. Each experiment command saved its runs under ``docs/results/``: one
``results.csv`` per grid (a row per run with every metric and every ε) and one JSON object per
benchmark. This command

1. rewrites each grid's own ``table.md`` and figure from its ``results.csv``, with the module that
   ran the grid (its ``--report-only`` path): the adaptive-DP reproduction
   (:mod:`simulations.papers.adaptive_dp`), FSL-BDP's Table 3 and Figure 10
   (:mod:`simulations.papers.fsl_bdp`), BVFLMSP's Tables 1 and 2 (:mod:`simulations.papers.table1`,
   :mod:`simulations.papers.bvflmsp`) and the membership-inference audits
   (:mod:`simulations.papers.membership`);
2. writes ``docs/results.md``: per paper, our figures beside the paper's, the audited ε beside the
   nominal one, the figures, the benchmark figures against their targets, and where each grid and
   its commands are documented;
3. writes ``docs/privacy.md`` from the mechanisms themselves: each one's assumptions and release
   manifest (every value a site sends, covered or not).

The uncertainty figures of BVFLMSP need per-record curves that are not saved; their summary table
is rebuilt from the saved ``summary.csv`` and the figures are linked as they were drawn.

Usage::

    python -m simulations.papers.report [--results docs/results] [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from flwr_app.config import PROJECT_ROOT, ConfigError
from simulations.papers import adaptive_dp, bvflmsp, fsl_bdp, membership, table1
from strategies.mechanisms.base import SecureSumMechanism
from strategies.mechanisms.registry import MECHANISMS, get_mechanism

_SIM_COX_ARGS = ["--epsilons", "0.6,0.7,0.8,0.9,1.0", "--metrics", "inbll,ibs,c_index"]
_FLCHAIN_ARGS = ["--epsilons", "3,4,5,7", "--metrics", "c_index,ibs,inbll", "--methods",
                 "no DP,NbAFL,ROW-DP(Std),ROW-DP(Var),ROW-DP(Range),ROW-DP(MAE),ROW-DP(IQR),LS-ADP,NbAFL exact,LS-ADP exact"]
#: The adaptive-DP grids (folder: title, the arguments their commands ran with; docs/results/adaptive_dp.md, "Commands").
ADAPTIVE_DP_GRIDS: dict[str, tuple[str, list[str]]] = {
    "flchain_62d9d39": ("flchain, the code of commit 62d9d39", _FLCHAIN_ARGS),
    "sim_cox_cf9d528": ("sim_cox, the code of commit cf9d528", _SIM_COX_ARGS),
    "sim_cox": ("sim_cox (commits 20086e3 and 59e12dd, the defaults of their time)", _SIM_COX_ARGS),
    "flchain": ("flchain (commit 26dd4a2, the defaults of its time)", _FLCHAIN_ARGS),
}
FSL_BDP_GRIDS: dict[str, str] = {
    "regions_529c944": "SBA loans, 4 census regions as sites, the defaults of commit 529c944 (5 seeds without DP, 3 "
                       "with)",
    "regions": "SBA loans, 4 census regions as sites (5 seeds; commit d452edc, the defaults of its time)",
    "states_3161f8e": "SBA loans, 40 states as sites, the defaults of commit 3161f8e (5 seeds without DP, 3 with)",
    "states": "SBA loans, 40 states as sites (5 seeds; commit d452edc, the defaults of its time)",
}
TABLE1_DATA: tuple[str, ...] = ("metabric", "breast_cancer", "synthetic_multimodal")
#: Table 1's folders (docs/results/bvflmsp/<folder>/<data>): folder -> the code that produced its rows.
TABLE1_GRIDS: dict[str, str] = {
    "table1_054062b": "the code of commit 054062b (BayesianMultisurv: seeds 0 and 1 only)",
    "table1": "commits ca7f039 and fb158fa (before the encoders without batch norm, bc677bf, and the IBS/INBLL "
              "censoring convention, 1664c29)",
}
#: Table 2's grids (docs/results/bvflmsp/<folder>): folder -> title naming the code that produced its rows.
TABLE2_GRIDS: dict[str, str] = {
    "table2_ba9875a": "table2_ba9875a: the code of commit ba9875a (seed 0)",
    "table2": "table2: commits 8ecba34 and 210b245 (the rows saved there; before bc677bf and 1664c29)",
    "table2_clean_inference": "table2_clean_inference: commit 8ecba34, the defaults of its time",
    "table2_embedding16": "table2_embedding16: commit 8ecba34, the defaults of its time",
    "table2_embedding16_large_epsilon": "table2_embedding16_large_epsilon: commit 8ecba34, the defaults of its time",
}
MEMBERSHIP_GRIDS: dict[str, str] = {
    "flchain_b96d482": "flchain, the code of commit b96d482 (distributed_dp's rows: a6e296a)",
    "metabric_overfit_b96d482": "metabric built to over-fit, the code of commit b96d482 (distributed_dp's rows: a6e296a)",
}
UNCERTAINTY_DATA: tuple[str, ...] = ("metabric", "synthetic_multimodal")
#: The uncertainty runs' folders (docs/results/bvflmsp/<folder>/<data>): folder -> the code that produced them.
UNCERTAINTY_GRIDS: dict[str, str] = {
    "uncertainty_054062b": "the code of commit 054062b",
    "uncertainty": "the code of commit 62850f5 (saved at 35cf494; before the encoders without batch norm, bc677bf)",
}


def _quietly(main: Callable[[list[str]], object], argv: list[str]) -> None:
    """Run a module's ``main(argv)`` without its printout (the tables are read back from its files)."""
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)


def _grid_blocks(out: Path, main: Callable[[list[str]], object], folders: dict[str, Path],
                 argv: dict[str, list[str]] | None = None) -> list[str]:
    """Each grid's ``table.md`` and ``figure.png`` rewritten by ``main --report-only``; the table and figure as report blocks."""
    blocks: list[str] = []
    for name, folder in folders.items():
        _quietly(main, ["--out", str(folder), "--report-only", *(argv or {}).get(name, [])])
        blocks += [f"### {name}", "", _demote((folder / "table.md").read_text(encoding="utf-8")), "",
                   f"![{name}]({(folder / 'figure.png').relative_to(out.parent)})", ""]
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
    blocks = _grid_blocks(out, adaptive_dp.main,
                          {title: results / "adaptive_dp" / grid for grid, (title, _) in ADAPTIVE_DP_GRIDS.items()},
                          {title: argv for title, argv in ADAPTIVE_DP_GRIDS.values()})
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
    for grid, title in FSL_BDP_GRIDS.items():
        folder = results / "fsl_bdp_sba" / grid
        fsl_bdp.write_saved(folder, title)
        table = pd.read_csv(folder / "table3.csv", float_precision="round_trip")
        targets = sorted(table["epsilon_target"].unique())
        blocks += [f"### {title}", "",
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
    blocks = []
    for (grid, code), data in itertools.product(TABLE1_GRIDS.items(), TABLE1_DATA):
        folder = results / "bvflmsp" / grid / data
        _quietly(table1.main, ["--data", data, "--out", str(folder), "--report-only"])
        blocks += [f"### {data}, {code}", "", (folder / "table.md").read_text(encoding="utf-8"), ""]
    blocks += ["### The paper's Table 1 (TCGA, C-index; a different data set, for reference)", "",
               "| Model | " + " | ".join(table1.PAPER_TABLE1_COLUMNS) + " |",
               "| --- |" + " --- |" * len(table1.PAPER_TABLE1_COLUMNS)]
    for model, values in table1.PAPER_TABLE1_C_INDEX.items():
        blocks.append(f"| {model} | " + " | ".join(_number(value) for value in values) + " |")
    blocks += ["", f"Setup, commands, the paper's other metrics and reading: {_link(results / 'bvflmsp_table1.md', out)}."]
    return "\n".join(blocks)


def bvflmsp_table2_section(results: Path, out: Path) -> str:
    """BVFLMSP Table 2: split learning under embedding DP; record-level RDP ε beside the paper's ε claim."""
    blocks = _grid_blocks(out, bvflmsp.main, {title: results / "bvflmsp" / grid for grid, title in TABLE2_GRIDS.items()})
    blocks.append(f"Setup, commands, the diagnostics and reading: {_link(results / 'bvflmsp.md', out)}.")
    return "\n".join(blocks)


def uncertainty_section(results: Path, out: Path) -> str:
    """BVFLMSP uncertainty bands: mean 95 % band width per setup (from the saved summaries)."""
    blocks = ["Mean width of the 95 % band of the survival curve over test records (mean ± std over seeds), "
              "with all modalities, with one modality masked at prediction, and retrained without it; "
              "\"wider\" counts the seeds on which the band is wider than with all modalities.", ""]
    for (grid, code), data in itertools.product(UNCERTAINTY_GRIDS.items(), UNCERTAINTY_DATA):
        folder = results / "bvflmsp" / grid / data
        summary = pd.read_csv(folder / "summary.csv", float_precision="round_trip")
        blocks += [f"### {data}, {code}", "", "| setup | modality | band width | C-index | difference | wider |",
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
    blocks = _grid_blocks(out, membership.main,
                          {title: results / "membership" / grid for grid, title in MEMBERSHIP_GRIDS.items()})
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
        for row in loop["rows"]:
            target = (f"≤ {loop['targets']['distributed_dp_round_s']:g} s a round" if row["strategy"] == "distributed_dp"
                      else f"≤ {loop['targets']['message_round_trip_s']:g} s a message")
            lines.append(f"| loopback deployment (TLS, SuperNode auth, 3 SuperNodes on this machine), {row['strategy']}, "
                         f"{'evaluated every round' if row.get('evaluation_every', 1) == 1 else 'evaluated every ' + str(row['evaluation_every']) + ' rounds'}, "
                         f"SuperNodes' executor polling every {row['executor_poll_s']:g} s | {row['round_s']:.1f} s a round, "
                         f"{row['message_round_trip_s']:.1f} s a message ({row['messages_per_round']} a round) | – | – | "
                         f"{target} |")
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
        "Measured on 2026-11-24 with the code of commits f964595 and bfdfc0e (where these rows were saved): before "
        "the private set-up took a share of ε, before the Kaplan–Meier start and the private recalibration, and "
        "with distributed_dp's earlier recipe (clip 1, lr 0.02). The current defaults are in the section above.",
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
             "Generated by `python -m simulations.papers.report` from the runs saved under `docs/results/`; do not edit "
             "by hand. Every ε is the one the run's privacy ledger reports (the audited ε of the mechanism that "
             "ran), next to the target or the paper's nominal figure; no ε is averaged over sites.", ""]
    parts += [f"- [{title}](#{_anchor(title)})" for title, _ in SECTIONS] + [""]
    for title, section in SECTIONS:
        parts += [f"## {title}", "", section(results, out).rstrip(), ""]
    text = "\n".join(parts)
    out.write_text(text, encoding="utf-8")
    return text


#: Options that change what a mechanism's sites send, shown under each mechanism of the privacy page.
PRIVACY_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("a Cox model (model.name = cox_mlp or cox_time)", {"model.name": "cox_mlp"}),
    ("privacy.allocation = exact", {"privacy.allocation": "exact"}),
    ("split.clean_inference = true", {"split.clean_inference": True}),
)


def _privacy_config(strategy: str, **overrides: Any) -> Any:
    """The run configuration the privacy page documents for ``strategy`` (its defaults, epsilon 1)."""
    from simulations.engine import resolve

    base: dict[str, Any] = {"strategy.name": strategy}
    if get_mechanism(strategy).vertical:
        base |= {"data.name": "metabric", "model.name": "bayesian_multisurv"}
    base["privacy.epsilon"] = "inf" if not get_mechanism(strategy).private and not get_mechanism(strategy).vertical else 1.0
    return resolve({**base, **overrides})[1]


def privacy_page() -> str:
    """``docs/privacy.md``: for every mechanism, its assumptions and its release manifest.

    Generated from the mechanisms themselves (:mod:`strategies.mechanisms`), the objects that also
    write every run's ledger and ``manifest.json``, so the page cannot drift from what runs.
    """
    parts = ["# What each privacy mechanism protects, and what every site sends", "",
             "Generated by `python -m simulations.papers.report` from the mechanisms' own release manifests and "
             "assumptions (the objects that write every run's `ledger.jsonl` and `manifest.json`); do not edit by "
             "hand. *Covered* means the value is a function of the mechanism's noisy output or of public inputs "
             "only; every other value a site sends is listed as not covered, with the reason. Each run writes the "
             "manifest of its own configuration to `manifest.json`; below is each mechanism at its defaults "
             "(`privacy.epsilon = 1`).", ""]
    parts += _accounting_section()
    for name, mechanism in MECHANISMS.items():
        cfg = _privacy_config(name)
        manifest = mechanism.manifest(cfg)
        parts += [f"## `{name}`", "",
                  f"Unit protected: **{manifest.unit}**; adjacency: {', '.join(mechanism.adjacencies)}.", "",
                  "What the ledger's figures assume:", ""]
        parts += [f"- {sentence}" for sentence in mechanism.assumptions(cfg)]
        parts += ["", manifest.as_markdown(), ""]
        if isinstance(mechanism, SecureSumMechanism):
            parts += [SECURE_SUM_TEXT, ""]
        for label, overrides in PRIVACY_VARIANTS:
            try:
                variant = mechanism.manifest(_privacy_config(name, **overrides))
            except ConfigError:
                continue  # the option does not apply to this mechanism
            before = {release.value: release.covered for release in manifest.releases}
            changed = [f"{release.value} ({'covered' if release.covered else 'not covered'})"
                       for release in variant.releases if before.get(release.value) != release.covered]
            if changed:
                parts += [f"With {label}: {'; '.join(changed)}.", ""]
    return "\n".join(parts).rstrip() + "\n"


#: What the server of a secure-sum mechanism can and cannot attribute (``docs/privacy.md``, after its manifest); the
#: figures are from ``tests/test_distributed_dp.py``'s runs and the issue-25 check (4 FLCHAIN sites, 3 rounds, eps 1).
SECURE_SUM_TEXT = (
    "**What secure aggregation cannot attribute.** The server sees only the unmasked sum of the included sites' "
    "vectors: it can judge the sum, never say whose vector made it wrong. It refuses a sum whose centred L2 norm "
    "exceeds n_max·Δ + √m·s·√(d + 2√(dx) + 2x), or any of whose coordinates exceeds n_max(γC + 1/2) + "
    "√m·s·√(2 ln(2d/p)) (m included sites, each adding N_Z(0, s²) per coordinate; n_max = their agreed records "
    "+ m/2 + σ_c√m√(2x), σ_c the set-up count's noise; p = 10⁻⁹/3, x = ln(1/p)): an honest round exceeds either "
    "with probability at most 10⁻⁹ (the discrete Gaussian is sub-Gaussian, so the chi-square tail of Laurent & "
    "Massart holds for the noise sum; the data part is the triangle bound, every record's gradient at the clip norm "
    "in one direction; `RoundPlan.sum_bound`). The check is on the centred sum, the very integers the step divides, "
    "so a vector that wraps around the modulus cannot hide: a sum pushed across M/2 reads as a large centred value. "
    "A refused sum is a failure of phase `secagg_sum` under the site name `unattributable` that names the stage "
    "(the sum check, after the masked-vector collection and the unmasking), the sites in the sum and the drop-outs "
    "before it; the round keeps the global model and the server's optimiser state, every site asked still counts "
    "the round in its spend (it released its vector), and the run goes on; a sum refused in 3 consecutive rounds "
    "stops the run with that error. What the protocol can check is still named by site: a masked vector of the "
    "wrong shape, type or range is refused under its site at the masked-vector stage (a drop-out), and a site "
    "that does not answer is named at its stage; more drop-outs than `privacy.max_dropouts` stop the round.\n\n"
    "What the check cannot see: a contribution that keeps the sum within the honest worst case. With noise "
    "dominating, that is far above an actual honest sum: at ε = 1 on 4 FLCHAIN sites the bound is 8.4·10¹³ and an "
    "honest sum about 1.35·10¹³ (the data part about 1.3·10¹²), so one site's vector scaled by up to about ±12 "
    "before masking passes. ×−5 is not detected and lowered the pooled test C-index from 0.746 to 0.347 over 3 "
    "rounds, with no failure filed; ×10³ before masking, and an all-zero, replayed or mod-M/2 masked vector, are "
    "refused in every round they are sent. Keeping such contributions out needs each site to prove its vector's "
    "bound inside the protocol (zero-knowledge norm proofs, e.g. EIFFeL, Roy Chowdhury et al. 2022; RoFL, Lycklama "
    "et al. 2023), which this project does not implement."
)

#: The accounting section of ``docs/privacy.md`` (before the table generated from the mechanisms' ``accountants``).
ACCOUNTING_TEXT = (
    "Each mechanism's ε comes from one accountant, named in every ledger entry (`accountant`). Where a tight "
    "accountant is sound for the mechanism, `privacy.accountant = auto` (the default) picks it, the noise is "
    "calibrated with it (so the same ε buys less noise) and the ledger gives, beside that headline, the Rényi-DP "
    "figure of the same releases (`epsilon_rdp`, opacus' RDP and its conversion at δ). `pld` is dp-accounting's "
    "`PLDAccountant` (pessimistic connect-the-dots privacy loss distributions on a grid of 1e-4, tails counted in δ: "
    "an upper bound within about 1e-3 of the exact ε); `prv` is opacus' PRV accountant (an upper bound from its error "
    "bound); `rdp` converts Rényi DP to (ε, δ), which loses about 10 % of ε at these budgets "
    "(`python -m benchmarks.accountants`).",
    "A deployed site can hold its own budget (node config `privacy-ledger`, `privacy-max-epsilon`, …; "
    "docs/deployment.md, \"A site's own privacy budget\"): its SuperNode charges every set-up pass, training round "
    "and recalibration of dp_sgd or distributed_dp to a Rényi filter of one fixed order, computed from the noise it "
    "adds itself and never from the server's plan, writes each to its tamper-evident ledger before it leaves, and "
    "refuses, before anything is released, what the filter cannot hold (a run whose plan exceeds what is left, a "
    "strategy it does not accept or cannot charge: bdp, whose noise and stopping time depend on the site's records, "
    "among them). RDP of one order adds up over releases chosen adaptively, which is what a filter needs "
    "(Feldman & Zrnic 2021). The site tells the server where its filter stands with its first set-up release, and the "
    "server plans that site's noise to fit it (the larger of what the run's accountant and the filter need); the "
    "ledger gives the tight figure for the plan actually run and, for such a site, its filter figure "
    "(`epsilon_filter`), which is higher. A distributed_dp site with a policy sizes its noise share, and charges it, "
    "on the honest sites its own policy counts on (`privacy-min-honest-sites`), never on the participant count the "
    "server reports. What a dishonest server can and cannot make a site spend or tell, and each remaining limit: "
    "docs/deployment.md, \"What a dishonest server can and cannot do\". "
    "distributed_dp keeps RDP: the sum of the sites' discrete Gaussians is not a Gaussian, and the bound it has "
    "(Kairouz, Liu & Steinke 2021, Proposition 14) is a Rényi bound; a PLD of the continuous Gaussian would not bound "
    "it. bdp's headline is the Bayesian accountant's ε_μ (data-dependent, average case), which no PLD replaces; its "
    "`epsilon_classical` stays RDP. The weight-perturbation and split strategies have their own Rényi or formula "
    "accountants.",
)


def _accounting_section() -> list[str]:
    """The accounting section: the prose and which ``privacy.accountant`` each mechanism offers."""
    parts = ["## Accounting", "", *[line for text in ACCOUNTING_TEXT for line in (text, "")],
             "| strategy | `privacy.accountant` offered (`auto` first) |", "| --- | --- |"]
    parts += [f"| `{name}` | {', '.join(mechanism.accountants) if mechanism.private else 'none (no guarantee)'} |"
              for name, mechanism in MECHANISMS.items()]
    return parts + [""]


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "docs" / "results",
                        help="folder of the saved runs (default: docs/results)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "results.md")
    parser.add_argument("--privacy-out", type=Path, default=PROJECT_ROOT / "docs" / "privacy.md",
                        help="where the mechanisms' privacy page goes (default: docs/privacy.md)")
    args = parser.parse_args(argv)
    write(args.results.resolve(), args.out.resolve())
    args.privacy_out.write_text(privacy_page(), encoding="utf-8")
    print(f"wrote {args.out} and {args.privacy_out}")


if __name__ == "__main__":
    main()
