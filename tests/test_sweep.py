"""Privacy-utility sweeps: gathering, the summary table, figures, and one real tiny sweep."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulations import sweep
from simulations.plots import plot_privacy_utility

ROOT = Path(__file__).resolve().parent.parent


def _summary(strategy: str, seed: int, c_index: float, ibs: float, epsilon: float | None,
             *, site_eps: tuple[float, ...] = (), centralized: float | None = None) -> dict[str, Any]:
    dp = epsilon is not None
    out: dict[str, Any] = {
        "test": {"c_index": c_index, "c_index_td": c_index, "ibs": ibs, "inbll": 3 * ibs},
        "sites": {f"site-{k}": {"c_index": c_index, "epsilon": e} for k, e in enumerate(site_eps)},
        "privacy": {"epsilon": epsilon, "delta": 1e-5 if dp else None,
                    "unit": "record" if dp else "none", "accountant": "opacus-rdp" if dp else "none"},
        "strategy": strategy, "data": {"name": "flchain"}, "model": "hazard_mlp", "num_sites": 2, "rounds": 3,
        "seed": seed, "wall_time_s": 10.0 + seed,
    }
    if centralized is not None:
        out["centralized"] = {"epochs": 3, "test": {"c_index": centralized, "c_index_td": centralized,
                                                    "ibs": 0.09, "inbll": 0.3}, "privacy": "none (no DP)"}
    return out


def _job(root: Path, num: int, status: str, target: float, summary: dict[str, Any] | None = None,
         **extra: Any) -> Path:
    job = root / str(num)
    job.mkdir(parents=True)
    strategy = summary["strategy"] if summary else extra.pop("strategy", "dp_sgd")
    (job / sweep.STATUS_FILE).write_text(json.dumps({
        "status": status, "strategy": strategy, "epsilon_target": target, "seed": extra.pop("seed", 0),
        "data": "flchain", "model": "hazard_mlp", "rounds": 3, "num_sites": 2, "variant": "", **extra}))
    if summary is not None:
        (job / sweep.SUMMARY_FILE).write_text(json.dumps(summary))
    return job


@pytest.fixture()
def sweep_dir(tmp_path: Path) -> Path:
    """fedavg x 2 seeds (with baselines), dp_sgd at eps 1 and 4 x 2 seeds, a failed and a skipped job."""
    root = tmp_path / "sweep"
    _job(root, 0, "ok", math.inf, _summary("fedavg", 0, 0.80, 0.10, None, centralized=0.81))
    _job(root, 1, "skipped", math.inf, duplicate_of=str(root / "0"), strategy="fedavg")
    _job(root, 2, "ok", math.inf, _summary("fedavg", 1, 0.82, 0.12, None, centralized=0.83))
    _job(root, 3, "ok", 1.0, _summary("dp_sgd", 0, 0.70, 0.20, 0.9, site_eps=(0.5, 0.9), centralized=0.81))
    _job(root, 4, "ok", 1.0, _summary("dp_sgd", 1, 0.74, 0.16, 0.95, site_eps=(0.95, 0.1), centralized=0.83))
    _job(root, 5, "ok", 4.0, _summary("dp_sgd", 0, 0.76, 0.14, 3.9, centralized=0.81))
    _job(root, 6, "failed", 4.0, None, seed=1, error="ConfigError: run config: bad value")
    return root


def test_gather_one_row_per_run(sweep_dir: Path) -> None:
    results = sweep.gather(sweep_dir)
    ok = results[results["status"] == "ok"]
    # fedavg twice (the skipped duplicate is no row), dp_sgd three times, centralised once per seed.
    assert ok["strategy"].value_counts().to_dict() == {"fedavg": 2, "dp_sgd": 3, "centralized": 2}
    assert len(results) == 8
    fedavg = ok[ok["strategy"] == "fedavg"]
    assert fedavg["epsilon_target"].map(math.isinf).all()
    assert fedavg["epsilon"].isna().all() and (fedavg["unit"] == "none").all()
    central = ok[ok["strategy"] == "centralized"]
    assert sorted(central["test_c_index"]) == [0.81, 0.83]
    assert (central["unit"] == "none").all() and central["epsilon_target"].map(math.isinf).all()
    for column in ("epsilon", "delta", "accountant", "seed", "test_c_index", "test_ibs", "wall_time_s", "output_dir"):
        assert column in results


def test_failed_job_is_a_row_with_its_error(sweep_dir: Path) -> None:
    results = sweep.gather(sweep_dir)
    failed = results[results["status"] == "failed"]
    assert len(failed) == 1
    row = failed.iloc[0]
    assert row["strategy"] == "dp_sgd" and row["epsilon_target"] == 4.0 and row["seed"] == 1
    assert "bad value" in row["error"]


def test_headline_epsilon_never_site_average(sweep_dir: Path) -> None:
    results = sweep.gather(sweep_dir)
    dp = results[(results["strategy"] == "dp_sgd") & (results["epsilon_target"] == 1.0)]
    # Headline epsilons are 0.9 and 0.95; the sites' mean would be 0.7 and 0.525.
    assert sorted(dp["epsilon"]) == [0.9, 0.95]
    summary = sweep.summarize(results)
    row = summary[(summary["strategy"] == "dp_sgd") & (summary["epsilon_target"] == 1.0)].iloc[0]
    assert row["epsilon_max"] == 0.95


def test_summary_mean_std_over_seeds(sweep_dir: Path) -> None:
    summary = sweep.summarize(sweep.gather(sweep_dir))
    key = summary.set_index(["strategy", "epsilon_target"])
    dp1 = key.loc[("dp_sgd", 1.0)]
    assert dp1["n_runs"] == 2 and dp1["n_failed"] == 0 and dp1["seeds"] == "0,1"
    assert dp1["test_c_index_mean"] == pytest.approx(0.72)
    assert dp1["test_c_index_std"] == pytest.approx(pd.Series([0.70, 0.74]).std(ddof=1))
    assert dp1["test_ibs_mean"] == pytest.approx(0.18)
    dp4 = key.loc[("dp_sgd", 4.0)]
    assert dp4["n_runs"] == 1 and dp4["n_failed"] == 1 and math.isnan(dp4["test_c_index_std"])
    fedavg = key.loc[("fedavg", math.inf)]
    assert fedavg["n_runs"] == 2 and fedavg["test_c_index_mean"] == pytest.approx(0.81)
    assert math.isnan(fedavg["epsilon_max"])
    central = key.loc[("centralized", math.inf)]
    assert central["n_runs"] == 2 and central["test_c_index_mean"] == pytest.approx(0.82)
    text = sweep.format_summary(summary)
    assert "±" in text
    (row,) = [line for line in text.splitlines() if line.lstrip().startswith("centralized [")]
    assert "not private" in row.split("]", 1)[1] and "inf" not in row  # no epsilon beside the reference
    assert sweep.CENTRALIZED_CAPTION.split(":")[0] in text


def test_write_report_files(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, _ = sweep.write_report(sweep_dir)
    for name in (sweep.RESULTS_CSV, sweep.SUMMARY_CSV, sweep.FIGURE):
        assert (sweep_dir / name).stat().st_size > 0
    assert len(pd.read_csv(sweep_dir / sweep.RESULTS_CSV)) == len(results)
    assert "dp_sgd" in capsys.readouterr().out
    # Rebuilding from the saved runs gives the same table (the CSVs themselves are not runs).
    again = sweep.gather(sweep_dir)
    assert len(again) == len(results)


def test_gather_cli(sweep_dir: Path) -> None:
    sweep.cli(["--gather", str(sweep_dir)])
    assert (sweep_dir / sweep.SUMMARY_CSV).exists()


def test_no_privacy_utility_figure_without_dp_rows(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _job(root, 0, "ok", math.inf, _summary("fedavg", 0, 0.8, 0.1, None))
    files = plot_privacy_utility(sweep.summarize(sweep.gather(root)), tmp_path / "fig.png")
    assert files == [] and not (tmp_path / "fig.png").exists()
    sweep.write_report(root, quiet=True)  # one setting, no epsilon: no figure at all
    assert not list(root.glob("*.png"))


def test_dp_strategies_and_duplicates(tmp_path: Path) -> None:
    assert sweep.is_dp_strategy("dp_sgd") and not sweep.is_dp_strategy("fedavg")
    assert "dp_sgd" in sweep.dp_strategies() and "fedavg" not in sweep.dp_strategies()
    flat = {"strategy.name": "fedavg", "privacy.epsilon": 2.0, "seed": 0, "output.dir": "/a"}
    effective = sweep.effective_config(flat)
    assert math.isinf(effective["privacy.epsilon"])
    other = sweep.effective_config({**flat, "privacy.epsilon": 5.0, "output.dir": "/b"})
    assert sweep.run_key(effective) == sweep.run_key(other)
    dp = sweep.effective_config({**flat, "strategy.name": "dp_sgd"})
    assert dp["privacy.epsilon"] == 2.0
    assert sweep.claim(tmp_path / "c", sweep.run_key(effective), tmp_path / "0") is None
    assert sweep.claim(tmp_path / "c", sweep.run_key(other), tmp_path / "1") == str(tmp_path / "0")
    assert sweep.variant_of(["strategy=fedavg", "privacy.epsilon=1", "seed=2", "model=cox_mlp", "train.lr=0.01",
                             "hydra.sweep.dir=/x"]) == "train.lr=0.01"


def test_failing_job_does_not_raise(tmp_path: Path) -> None:
    flat = {"strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "no.such.key": 1, "output.dir": ""}
    assert sweep.run_job(flat, tmp_path / "0", ["strategy=dp_sgd"], tmp_path / ".claims") is None
    status = json.loads((tmp_path / "0" / sweep.STATUS_FILE).read_text())
    assert status["status"] == "failed" and "no.such.key" in status["error"]


@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "simulations.sweep", "-m", "strategy=fedavg,dp_sgd", "privacy.epsilon=1,5",
        "federation.rounds=1", "federation.num_sites=2", "baseline.centralized=false", f"hydra.sweep.dir={out}",
    ]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    assert "skip" in output and "no Ray process left behind" in output

    results = pd.read_csv(out / sweep.RESULTS_CSV)
    assert (results["status"] == "ok").all(), results[["strategy", "error"]]
    assert results["strategy"].value_counts().to_dict() == {"dp_sgd": 2, "fedavg": 1}
    dp = results[results["strategy"] == "dp_sgd"]
    assert sorted(dp["epsilon_target"]) == [1.0, 5.0]
    assert (dp["epsilon"] <= dp["epsilon_target"] + 1e-9).all() and (dp["epsilon"] > 0).all()
    assert math.isinf(results.loc[results["strategy"] == "fedavg", "epsilon_target"].iloc[0])
    assert (out / sweep.SUMMARY_CSV).exists() and (out / sweep.FIGURE).stat().st_size > 0

    time.sleep(1.0)
    assert sweep.ray_processes(proc.pid) == []


def test_the_table_flags_a_setting_whose_ibs_is_not_below_the_kaplan_meier_null(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    for num, (strategy, target, ibs, null) in enumerate([("fedavg", math.inf, 0.10, 0.14), ("dp_sgd", 1.0, 0.15, 0.14),
                                                          ("dp_sgd", 1.0, 0.14, 0.14)]):
        summary = _summary(strategy, num, 0.7, ibs, None if strategy == "fedavg" else 1.0)
        summary["km_null"] = {"ibs": ibs, "ibs_km_null": null, "below_null": ibs < null}
        _job(root, num, "ok", target, summary, seed=num)
    results = sweep.gather(root)
    assert sorted(results["test_ibs_km_null"]) == [0.14, 0.14, 0.14]
    lines = sweep.format_summary(sweep.summarize(results)).splitlines()
    dp, fedavg = next(line for line in lines if "dp_sgd" in line), next(line for line in lines if "fedavg" in line)
    assert "0.1400 (model IBS not below)" in dp and "not below" not in fedavg and "0.1400" in fedavg
