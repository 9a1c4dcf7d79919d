"""Privacy-utility sweeps: ``python -m simulations.sweep -m privacy.epsilon=... strategy=... seed=...``.

Examples
--------
``python -m simulations.sweep -m privacy.epsilon=0.5,1,2,10 strategy=fedavg,dp_sgd seed=0,1,2``
``python -m simulations.sweep -m strategy=fedavg,dp_sgd privacy.epsilon=1,5 federation.rounds=5 hydra.sweep.dir=/abs/dir``
``python -m simulations.sweep --gather /abs/dir``   rebuild the tables and figures from saved runs

Each Hydra job is one experiment, run exactly as ``simulations.run`` runs it
(:func:`simulations.engine.run_simulation` on the flattened config, output in the job's directory).
The jobs share the ``conf/`` tree; ``conf/sweep.yaml`` adds a Hydra callback that, after the last
job, gathers every job's ``summary.json`` under the sweep directory into

* ``results.csv``: one row per run (a failed run is a row with ``status = failed`` and its error;
  a run's centralised baseline, when ``baseline.centralized=true``, is a row of its own: strategy
  ``centralized`` without privacy, or ``centralized_dp_sgd`` / ``centralized_bdp`` with the run's
  target epsilon when the run's record-level mechanism was applied to the pooled data);
  its ``test_ibs_km_null`` is the IBS of the covariate-free Kaplan-Meier curve on the same test
  records (runs with server-side evaluation), the bar a useful model's ``test_ibs`` is below;
* ``summary.csv``: mean and standard deviation over seeds per setting x strategy x target epsilon
  (the printed table flags a setting whose mean IBS is not below the null's);
* ``privacy_utility.png``: test C-index and IBS against epsilon (log axis), one line per DP
  strategy with +-1 std error bars, non-DP strategies and the centralised baseline as horizontal
  reference lines; drawn for each setting whose DP rows span two or more target epsilons (one
  file per such setting). A sweep over other keys at one epsilon (e.g. ``train.lr``) writes
  ``by_setting.png`` instead: the test metrics per setting, one series per strategy and epsilon.

The centralised baseline is a non-private pooled reference trained with the federation's recipe
(:data:`CENTRALIZED_CAPTION`, printed under the table): its epsilon columns read "not private".

Rules
-----
Non-DP strategies run once. A strategy is a DP strategy when :func:`is_dp_strategy` says so: the
project's default configuration with that strategy and a finite ``privacy.epsilon`` is valid
(``fedavg`` refuses a finite epsilon, ``dp_sgd`` accepts it). A non-DP strategy is run with
``privacy.epsilon=inf`` whatever epsilon the sweep asks for, so the jobs of a sweep that differ
from an earlier one only by epsilon are duplicates: each job claims the key of its effective
configuration (the flattened config without ``output.dir``) in ``<sweep dir>/.claims``, and a job
whose key is already claimed is skipped with a one-line message (its directory holds only a
``status.json`` saying ``skipped``; it is not a row of ``results.csv``).

Epsilon. The achieved epsilon of a run is the headline epsilon of its ``summary.json`` (for
record-level DP-SGD, the maximum over sites: their records are disjoint). Per-site epsilons are
never read, let alone averaged; across seeds, ``summary.csv`` reports the largest headline epsilon
(``epsilon_max``), not a mean.

Ray. Jobs that run on Ray connect to one Ray cluster that the sweep starts before its first job and stops
after its last (:func:`simulations.engine.ray_cluster`), so each job saves Ray's start and stop (about 4 s
on 2 cores). With ``RAY_ADDRESS`` set, the jobs use that cluster instead (one of the user's, on one
machine or many: ``ray start --head`` and ``ray start --address=...`` on each worker) and leave it
running. The sweep starts its cluster only where its jobs run on Ray (``simulation.engine=ray``, or ``auto``
with more sites than the in-process grid takes); with ``auto`` and up to that many sites the jobs run over the
in-process grid, the faster engine there (:func:`simulations.engine.choose_engine`).

Failures. A job that raises (bad configuration, data error, a crash inside the simulation) does not
stop the sweep: the job writes ``status.json`` with the error and returns. After each job Ray is
shut down if Flower left it running, and the sweep reports any Ray process it spawned that is
still alive. Ctrl-C (SIGINT) or SIGTERM stops the sweep: the job in progress stops after its
current round with its checkpoint written (``resume.from`` continues it), the sweep exits with
130 or 143, and the Ray cluster is stopped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import sys
import textwrap
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from simulations.sweep_table import CENTRALIZED, SETTING_COLUMNS
from strategies.config import CENTRALIZED_LABEL

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
RESULTS_CSV = "results.csv"
SUMMARY_CSV = "summary.csv"
FIGURE = "privacy_utility.png"
BY_SETTING_FIGURE = "by_setting.png"
CLAIMS_DIR = ".claims"
TEST_METRICS = ("c_index", "c_index_td", "ibs", "inbll")
GROUP_COLUMNS = [*SETTING_COLUMNS, "strategy", "epsilon_target"]
BASE_COLUMNS = [
    "status", "strategy", "epsilon_target", "epsilon", "epsilon_rdp", "epsilon_classical", "epsilon_nominal",
    "epsilon_audited_formula", "delta", "unit", "accountant", "seed",
    "data", "model", "rounds", "num_sites", "variant",
    *(f"test_{m}" for m in TEST_METRICS),
]
TAIL_COLUMNS = ["wall_time_s", "output_dir", "error"]
# Overrides that a sweep varies on purpose; the others define the setting ("variant").
_SWEPT_KEYS = {"strategy", "strategy.name", "privacy.epsilon", "seed", "output.dir", "privacy"}
# Overrides already visible as columns of the tables.
_COLUMN_KEYS = {"data", "data.name", "model", "model.name", "federation.rounds", "federation.num_sites"}
# Overrides that change how a run is carried, not what it computes (both engines give the same run).
_ENGINE_KEYS = {"simulation.engine"}
_RAY_DAEMONS = {"raylet", "gcs_server"}


# --------------------------------------------------------------------------------------------
# Strategies and job identity
# --------------------------------------------------------------------------------------------


@functools.cache
def is_dp_strategy(name: str) -> bool:
    """Whether ``name`` is a differentially private strategy (one that takes a finite epsilon).

    Probed on the project's default configuration (``pyproject.toml``) with ``privacy.epsilon=1``:
    a DP strategy accepts it, a non-DP one (``fedavg``) raises ``ConfigError``. An unknown name is
    non-DP here; its job then fails with the configuration error.

    Parameters
    ----------
    name
        Value of ``strategy.name``.
    """
    from flwr_app.config import ConfigError
    from simulations.engine import resolve

    try:
        resolve({"strategy.name": name, "privacy.epsilon": 1.0})
    except ConfigError:
        return False
    return True


def dp_strategies() -> tuple[str, ...]:
    """The strategies of ``flwr_app.config.STRATEGIES`` for which :func:`is_dp_strategy` holds."""
    from flwr_app.config import STRATEGIES

    return tuple(name for name in STRATEGIES if is_dp_strategy(name))


def effective_config(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config a job really runs: epsilon set to ``inf`` for a non-DP strategy."""
    out = dict(flat)
    if not is_dp_strategy(str(out.get("strategy.name", ""))):
        out["privacy.epsilon"] = math.inf
    return out


def run_key(flat: Mapping[str, Any]) -> str:
    """Hash of a flat config without ``output.dir``: equal keys mean the same experiment."""
    items = {key: flat[key] for key in sorted(flat) if key != "output.dir"}
    return hashlib.sha1(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim(claims_dir: Path, key: str, job_dir: Path) -> str | None:
    """Claim ``key`` for ``job_dir``; return ``None`` on success, else the directory that owns it."""
    claims_dir.mkdir(parents=True, exist_ok=True)
    path = claims_dir / key
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return path.read_text(encoding="utf-8").strip() or "?"
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(str(job_dir))
    return None


def variant_of(overrides: Iterable[str]) -> str:
    """The Hydra overrides that define a setting beyond the table's columns (sorted, space-joined).

    Left out: the swept keys (strategy, epsilon, seed), keys shown as columns (data, model,
    rounds, sites), ``simulation.engine`` (the engines give the same run) and ``hydra.*``.
    """
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in _SWEPT_KEYS or key in _COLUMN_KEYS or key in _ENGINE_KEYS or key.startswith("hydra."):
            continue
        kept.append(override)
    return " ".join(sorted(kept))


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")


def run_job(flat: Mapping[str, Any], job_dir: Path, overrides: Sequence[str], claims_dir: Path | None) -> float | None:
    """Run one sweep job; never raises. Returns the test C-index, or ``None`` if skipped/failed.

    Parameters
    ----------
    flat
        Flattened Hydra config (``simulations.hydra_config.flatten``).
    job_dir
        The job's output directory (``output.dir`` unless the config sets one).
    overrides
        The job's Hydra task overrides (for the ``variant`` column).
    claims_dir
        Where jobs claim their effective configuration; ``None`` disables duplicate skipping.
    """
    from flwr_app.interrupt import StopRequested
    from simulations.engine import run_simulation

    requested = flat.get("privacy.epsilon")
    config = effective_config(flat)
    if not config.get("output.dir"):
        config["output.dir"] = str(job_dir)
    status: dict[str, Any] = {
        "strategy": config.get("strategy.name"),
        "epsilon_requested": requested,
        "epsilon_target": config.get("privacy.epsilon"),
        "seed": config.get("seed"),
        "data": config.get("data.name"),
        "model": config.get("model.name"),
        "rounds": config.get("federation.rounds"),
        "num_sites": config.get("federation.num_sites"),
        "variant": variant_of(overrides),
        "overrides": list(overrides),
        "output_dir": config["output.dir"],
    }
    owner = claim(claims_dir, run_key(config), job_dir) if claims_dir is not None else None
    if owner is not None:
        print(
            f"sweep: skip {' '.join(overrides)}: strategy '{status['strategy']}' is not DP, "
            f"its run with privacy.epsilon=inf is {owner}",
            flush=True,
        )
        _write_json(job_dir / STATUS_FILE, {**status, "status": "skipped", "duplicate_of": owner})
        return None
    try:
        summary = run_simulation(config)
    except BaseException as err:  # one bad job must not end the sweep
        if isinstance(err, (KeyboardInterrupt, StopRequested)):  # a signal stops the sweep
            raise
        message = f"{type(err).__name__}: {err}"
        print(f"sweep: job {' '.join(overrides)} failed: {message}", file=sys.stderr, flush=True)
        _write_json(job_dir / STATUS_FILE, {**status, "status": "failed", "error": message,
                                             "traceback": traceback.format_exc()})
        return None
    finally:
        shutdown_ray()
    _write_json(job_dir / STATUS_FILE, {**status, "status": "ok"})
    return summary.get("test", {}).get("c_index")


# --------------------------------------------------------------------------------------------
# Ray hygiene
# --------------------------------------------------------------------------------------------


def shutdown_ray() -> None:
    """``ray.shutdown()`` if this process still has Ray initialised (Flower normally does it)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _is_ray_process(proc: Any) -> bool:
    name = proc.info.get("name") or ""
    cmdline = proc.info.get("cmdline") or []
    first = cmdline[0] if cmdline else ""
    return name in _RAY_DAEMONS or name.startswith("ray::") or first.startswith("ray::") or \
        any(first.endswith(f"/{daemon}") for daemon in _RAY_DAEMONS)


def ray_processes(driver_pid: int | None = None) -> list[dict[str, Any]]:
    """Live Ray processes (``raylet``, ``gcs_server``, ``ray::*``), optionally only a driver's.

    Parameters
    ----------
    driver_pid
        Keep only processes started by this driver: its descendants, and processes whose command
        line names a Ray session of this driver (Ray session directories end in ``_<driver pid>``)
        or whose parent does (a worker of that session's raylet).
    """
    import psutil

    procs = [p for p in psutil.process_iter(["pid", "ppid", "name", "cmdline"]) if _is_ray_process(p)]
    if driver_pid is not None:
        tag = re.compile(rf"session_[0-9_-]+_{driver_pid}(/|\b)")
        own = {p.info["pid"] for p in procs if tag.search(" ".join(p.info.get("cmdline") or []))}
        try:
            own |= {child.pid for child in psutil.Process(driver_pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        procs = [p for p in procs if p.info["pid"] in own or p.info["ppid"] in own]
    return [{"pid": p.info["pid"], "name": p.info["name"], "cmdline": " ".join(p.info.get("cmdline") or [])[:120]}
            for p in procs]


# --------------------------------------------------------------------------------------------
# Gathering
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def run_dirs(sweep_dir: Path) -> list[Path]:
    """Directories under ``sweep_dir`` holding a ``summary.json`` or a ``status.json``."""
    found = {p.parent for name in (SUMMARY_FILE, STATUS_FILE) for p in Path(sweep_dir).rglob(name)}
    return sorted((d for d in found if CLAIMS_DIR not in d.parts), key=_natural_key)


def _float(value: Any) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf if str(value).strip().lower() in ("inf", "+inf", "infinity") else math.nan


def _metrics(prefix: str, metrics: Mapping[str, Any] | None) -> dict[str, float]:
    return {f"{prefix}_{key}": _float(value) for key, value in (metrics or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _epsilon_target(summary: Mapping[str, Any], status: Mapping[str, Any], run_dir: Path) -> float:
    """Target epsilon: from ``status.json``, else ``config.json``'s run config; ``inf`` without DP."""
    privacy = summary.get("privacy") or {}
    if isinstance(privacy, Mapping) and privacy.get("epsilon") is None and privacy.get("unit") in (None, "none"):
        return math.inf
    if "epsilon_target" in status:
        return _float(status["epsilon_target"])
    config = _read_json(run_dir / "config.json") or {}
    return _float((config.get("run_config") or {}).get("privacy.epsilon"))


def _variant(status: Mapping[str, Any]) -> str:
    """Setting of a job: recomputed from its overrides when ``status.json`` keeps them."""
    if isinstance(status.get("overrides"), list):
        return variant_of(status["overrides"])
    return str(status.get("variant", "") or "")


def _data_name(data: Any) -> str | None:
    """The data set of a summary's ``data`` entry: ``{"name": ..., "features": ...}``, or the bare name
    that summaries saved before the run recorded its features hold."""
    return data.get("name") if isinstance(data, Mapping) else data


def _run_row(summary: Mapping[str, Any], status: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    privacy = summary.get("privacy") if isinstance(summary.get("privacy"), Mapping) else {}
    return {
        "status": status.get("status", "ok"),
        "strategy": summary.get("strategy", status.get("strategy")),
        "epsilon_target": _epsilon_target(summary, status, run_dir),
        "epsilon": _float(privacy.get("epsilon")),  # the headline epsilon only, never per site
        # the RDP figure of the same releases, beside a headline from a tighter accountant (PLD, PRV)
        "epsilon_rdp": _float(privacy.get("epsilon_rdp")),
        # Bayesian DP: the worst-case epsilon of the same mechanism, beside epsilon_mu above
        "epsilon_classical": _float(privacy.get("epsilon_classical")),
        # NbAFL / LS-ADP / ROW-DP: the paper's average budget and its formula at the smallest noise
        "epsilon_nominal": _float(privacy.get("epsilon_nominal")),
        "epsilon_audited_formula": _float(privacy.get("epsilon_audited_formula")),
        "delta": _float(privacy.get("delta")),
        "unit": privacy.get("unit", "none"),
        "accountant": privacy.get("accountant", "none"),
        "seed": summary.get("seed", status.get("seed")),
        "data": _data_name(summary.get("data")) or status.get("data"),
        "model": summary.get("model", status.get("model")),
        "rounds": summary.get("rounds", status.get("rounds")),
        "num_sites": summary.get("num_sites", status.get("num_sites")),
        "variant": _variant(status),
        **_metrics("test", summary.get("test")),
        # the covariate-free Kaplan-Meier curve's IBS on the same test records (server-side evaluation only)
        "test_ibs_km_null": _float((summary.get("km_null") or {}).get("ibs_km_null")),
        **_metrics("oot", summary.get("oot")),
        "wall_time_s": _float(summary.get("wall_time_s")),
        "output_dir": str(run_dir),
        "error": status.get("error", ""),
    }


def _centralized_row(run: Mapping[str, Any], summary: Mapping[str, Any]) -> dict[str, Any]:
    """The run's centralised baseline as a row: strategy ``centralized`` without DP, or
    ``centralized_<mechanism>`` when it ran the run's record-level mechanism on the pooled data
    (then its ε is the baseline's own: ε_μ for ``bdp``)."""
    central = summary["centralized"]
    privacy = central.get("privacy")
    private = isinstance(privacy, Mapping)
    return {
        **{key: run[key] for key in ("seed", "data", "model", "rounds", "num_sites", "variant", "output_dir")},
        "status": "ok",
        "strategy": f"{CENTRALIZED}_{privacy['mechanism']}" if private else CENTRALIZED,
        "epsilon_target": run["epsilon_target"] if private else math.inf,
        "epsilon": _float(privacy.get("epsilon_mu", privacy.get("epsilon"))) if private else math.nan,
        "epsilon_rdp": math.nan,
        "epsilon_classical": _float(privacy.get("epsilon")) if private and "epsilon_mu" in privacy else math.nan,
        "epsilon_nominal": math.nan,
        "epsilon_audited_formula": math.nan,
        "delta": run["delta"] if private else math.nan,
        "unit": "record" if private else "none",
        "accountant": run["accountant"] if private else "none",
        **_metrics("test", central.get("test")),
        **_metrics("oot", central.get("oot")),
        "wall_time_s": _float(central.get("wall_time_s")),
        "label": CENTRALIZED_LABEL,
        "error": "",
    }


def _failed_row(status: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    return {
        **{key: status.get(key) for key in ("strategy", "seed", "data", "model", "rounds", "num_sites")},
        "status": status.get("status", "failed"),
        "epsilon_target": _float(status.get("epsilon_target")),
        "epsilon": math.nan,
        "variant": _variant(status),
        "output_dir": str(run_dir),
        "error": status.get("error", "no summary.json"),
    }


def _order_columns(frame: pd.DataFrame) -> pd.DataFrame:
    for column in [*BASE_COLUMNS, *TAIL_COLUMNS]:
        if column not in frame:
            frame[column] = math.nan if column not in ("error", "variant", "status") else ""
    extra = sorted(c for c in frame.columns if c not in BASE_COLUMNS and c not in TAIL_COLUMNS)
    return frame[[*BASE_COLUMNS, *extra, *TAIL_COLUMNS]]


def gather(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per run found under ``sweep_dir`` (see the module docstring for the columns).

    Skipped jobs (duplicates of a non-DP run) are left out; a job with a ``status.json`` but no
    ``summary.json`` is a ``failed`` row carrying its error. A run's centralised baseline is a row
    with strategy ``centralized``; identical baselines (same setting and seed, trained once per
    job) are kept once.
    """
    rows: list[dict[str, Any]] = []
    for run_dir in run_dirs(Path(sweep_dir)):
        status = _read_json(run_dir / STATUS_FILE) or {}
        if status.get("status") == "skipped":
            continue
        summary = _read_json(run_dir / SUMMARY_FILE)
        if summary is None:
            rows.append(_failed_row({"status": "failed", **status}, run_dir))
            continue
        row = _run_row(summary, status, run_dir)
        rows.append(row)
        if isinstance(summary.get("centralized"), Mapping):
            rows.append(_centralized_row(row, summary))
    frame = _order_columns(pd.DataFrame(rows))
    central = frame["strategy"] == CENTRALIZED
    duplicated = frame[central].duplicated(subset=[*SETTING_COLUMNS, "seed"], keep="first")
    frame = frame.drop(index=duplicated[duplicated].index)
    return frame.reset_index(drop=True)


def metric_columns(frame: pd.DataFrame) -> list[str]:
    """The ``test_*`` and ``oot_*`` columns of a results table."""
    return [c for c in frame.columns if c.startswith(("test_", "oot_"))]


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation (ddof=1) over seeds per setting x strategy x target epsilon.

    Columns: the group keys, ``n_runs`` (successful), ``n_failed``, ``seeds``, ``epsilon_max``
    (largest headline epsilon over the seeds; never a mean of sites' epsilons), ``epsilon_classical_max``
    (for Bayesian DP: the largest worst-case epsilon of the same mechanism), ``epsilon_nominal_max`` and
    ``epsilon_audited_formula_max`` (NbAFL / LS-ADP / ROW-DP: the paper's figures), ``<metric>_mean``
    and ``<metric>_std`` for every test/OOT metric, and ``wall_time_s_mean``.
    """
    frame = results.copy()
    for column in SETTING_COLUMNS:
        frame[column] = frame[column].fillna("").astype(str)
    ok = frame[frame["status"] == "ok"]
    metrics = metric_columns(frame)
    groups = ok.groupby(GROUP_COLUMNS, dropna=False, sort=True)
    table = groups.agg(
        n_runs=("status", "size"),
        seeds=("seed", lambda s: ",".join(str(v) for v in sorted(s.dropna().unique()))),
        epsilon_max=("epsilon", "max"),
        epsilon_classical_max=("epsilon_classical", "max"),
        epsilon_nominal_max=("epsilon_nominal", "max"),
        epsilon_audited_formula_max=("epsilon_audited_formula", "max"),
        wall_time_s_mean=("wall_time_s", "mean"),
    )
    for metric in metrics:
        table[f"{metric}_mean"] = groups[metric].mean()
        table[f"{metric}_std"] = groups[metric].std(ddof=1)
    failed = frame[frame["status"] != "ok"].groupby(GROUP_COLUMNS, dropna=False).size().rename("n_failed")
    table = table.join(failed, how="outer")
    table["n_runs"] = table["n_runs"].fillna(0).astype(int)
    table["n_failed"] = table["n_failed"].fillna(0).astype(int)
    front = ["n_runs", "n_failed", "seeds", "epsilon_max", "epsilon_classical_max", "epsilon_nominal_max",
             "epsilon_audited_formula_max"]
    table = table[[*front, *(c for c in table.columns if c not in front)]]
    return table.reset_index()


#: The caption of a table with centralised rows: what they are, and why they can score below the federation.
CENTRALIZED_CAPTION = (
    f"{CENTRALIZED}*: the same model trained again on the sites' training records pooled at one place: "
    f"{CENTRALIZED_LABEL}, so no ε is claimed for it (its release composes with the federation's). "
    f"{CENTRALIZED}_<mechanism> adds that record-level mechanism's noise for the row's eps_target to the pooled "
    "training. It is the federation's recipe on pooled data, not a tuned upper bound: a horizontal network's baseline "
    "takes the run's train.lr, train.batch_size and federation.rounds x train.local_epochs passes over the records "
    "(flwr_app.task.train_centralized), with no tuning, early "
    "stopping or model selection of its own (its last model is scored on the same test split), so it can score "
    "below the federated model."
)


def _epsilon_cells(row: pd.Series) -> dict[str, str]:
    """The ε columns of a row: the target and the largest headline ε; none for a centralised (non-private) row."""
    target, central = row["epsilon_target"], str(row["strategy"]).startswith(CENTRALIZED)
    if central:
        return {"eps_target": "—" if math.isinf(target) else f"{target:g} (noise)", "eps_max": "not private"}
    return {"eps_target": "inf" if math.isinf(target) else f"{target:g}",
            "eps_max": "-" if pd.isna(row["epsilon_max"]) else f"{row['epsilon_max']:.3f}"}


def format_summary(summary: pd.DataFrame, metrics: Sequence[str] = ("test_c_index", "test_ibs")) -> str:
    """Readable ``mean ± std`` table of :func:`summarize`'s output; :data:`CENTRALIZED_CAPTION` below it when it has
    centralised rows (their ε columns read "not private")."""
    lines = []
    for _, row in summary.iterrows():
        central = str(row["strategy"]).startswith(CENTRALIZED)
        cells = {
            "strategy": row["strategy"] + (f" [{CENTRALIZED_LABEL}]" if central else ""),
            **_epsilon_cells(row),
            "runs": f"{row['n_runs']}" + (f" ({row['n_failed']} failed)" if row["n_failed"] else ""),
        }
        for metric in metrics:
            mean, std = row.get(f"{metric}_mean"), row.get(f"{metric}_std")
            cells[metric.removeprefix("test_")] = "-" if pd.isna(mean) else (
                f"{mean:.4f} ± {std:.4f}" if not pd.isna(std) else f"{mean:.4f}")
        null, ibs = row.get("test_ibs_km_null_mean"), row.get("test_ibs_mean")
        if null is not None and not pd.isna(null):
            cells["km_null_ibs"] = f"{null:.4f}" + ("" if ibs < null else " (model IBS not below)")
        if row["variant"] or len(summary[SETTING_COLUMNS].drop_duplicates()) > 1:
            cells["setting"] = " ".join(str(row[c]) for c in SETTING_COLUMNS if str(row[c]))
        lines.append(cells)
    if not lines:
        return "(no runs)"
    table = pd.DataFrame(lines).to_string(index=False)
    central = summary["strategy"].astype(str).str.startswith(CENTRALIZED).any()
    return table + ("\n\n" + textwrap.fill(CENTRALIZED_CAPTION, width=110) if central else "")


def write_report(sweep_dir: str | Path, *, quiet: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Gather ``sweep_dir`` into ``results.csv``, ``summary.csv`` and the figures; print the summary.

    The figures: ``privacy_utility.png`` for each setting whose DP rows span two or more target ε;
    else, for a sweep over settings at one ε (e.g. ``train.lr``), ``by_setting.png``; else none.
    """
    from simulations.plots import plot_by_setting, plot_privacy_utility

    sweep_dir = Path(sweep_dir)
    results = gather(sweep_dir)
    summary = summarize(results)
    results.to_csv(sweep_dir / RESULTS_CSV, index=False)
    summary.to_csv(sweep_dir / SUMMARY_CSV, index=False)
    figures = plot_privacy_utility(summary, sweep_dir / FIGURE) if len(summary) else []
    if len(summary) and not figures:
        figures = plot_by_setting(summary, sweep_dir / BY_SETTING_FIGURE)
    if not quiet:
        print(f"\nsweep {sweep_dir}: {len(results)} row(s) -> {RESULTS_CSV}, {SUMMARY_CSV}"
              + "".join(f", {f.name}" for f in figures))
        print(format_summary(summary), flush=True)
        failed = results[results["status"] != "ok"]
        for _, row in failed.iterrows():
            print(f"failed: {row['strategy']} eps={row['epsilon_target']} seed={row['seed']}: {row['error']}")
    return results, summary


# --------------------------------------------------------------------------------------------
# Hydra entry point
# --------------------------------------------------------------------------------------------

try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object  # type: ignore[assignment,misc]


class SweepReport(_Callback):  # type: ignore[misc]
    """Hydra callback (``conf/sweep.yaml``): one Ray cluster for all jobs; the report after the last job."""

    def __init__(self) -> None:
        self._ray = contextlib.ExitStack()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Start the Ray cluster the jobs connect to (:func:`simulations.engine.ray_cluster`) where they run on Ray:
        ``simulation.engine=ray``, or ``auto`` with more than :data:`~strategies.config.INPROCESS_MAX_SITES` sites
        (the base config's: a swept key keeps its default here); ``auto`` below that runs in process, which is
        faster (``docs/howto/experiments.md``, "Which engine")."""
        from omegaconf import OmegaConf

        from simulations.engine import AUTO, RAY, ray_cluster
        from strategies.config import INPROCESS_MAX_SITES

        engine = OmegaConf.select(config, "simulation.engine", default=AUTO)
        sites = OmegaConf.select(config, "federation.num_sites", default=0) or 0
        if engine == RAY or (engine == AUTO and int(sites) > INPROCESS_MAX_SITES):
            self._ray.enter_context(ray_cluster())

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Stop the cluster, gather the sweep directory and check that the sweep left no Ray process running."""
        shutdown_ray()
        self._ray.close()
        write_report(config.hydra.sweep.dir)
        leftover = ray_processes(os.getpid())
        if leftover:
            print(f"sweep: warning: {len(leftover)} Ray process(es) still alive: {leftover}", file=sys.stderr)
        else:
            print("sweep: no Ray process left behind", flush=True)


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from flwr_app.interrupt import StopRequested
    from simulations.hydra_config import CONFIG_PATH, flatten
    from simulations.run import TASK_STARTED, describe_failure, exit_with, run_hydra

    @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="sweep")
    def main(cfg: DictConfig) -> float | None:
        TASK_STARTED.set()
        hydra_cfg = HydraConfig.get()
        job_dir = Path(hydra_cfg.runtime.output_dir)
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        claims = Path(hydra_cfg.sweep.dir) / CLAIMS_DIR if multirun else None
        flat = flatten(cfg)
        try:
            return run_job(flat, job_dir, list(hydra_cfg.overrides.task), claims)
        except (StopRequested, KeyboardInterrupt) as stop:  # the sweep stops; the jobs done so far stay
            exit_with(*describe_failure(stop, {**flat, "output.dir": flat["output.dir"] or str(job_dir)}))

    run_hydra(main)


def cli(argv: Sequence[str] | None = None) -> None:
    """``--gather DIR`` rebuilds the report of a finished sweep; anything else goes to Hydra, once its keys and
    group options are known (:func:`simulations.run.check_command_line`: an unknown one ends the sweep before its
    first job with one line naming the nearest, exit status 2)."""
    from simulations.run import check_command_line

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--gather":
        if len(args) != 2:
            sys.exit("usage: python -m simulations.sweep --gather SWEEP_DIR")
        if not Path(args[1]).is_dir():
            sys.exit(f"error: {args[1]} is not a directory")
        write_report(args[1])
        return
    check_command_line(args)
    _hydra_main()


if __name__ == "__main__":
    cli()
