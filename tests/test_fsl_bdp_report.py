"""FSL-BDP comparison report: Table 3 shape, per-site win counts, federation effect."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import binomtest

from simulations import sweep
from simulations.papers import fsl_bdp

SITES = ("CA", "FL", "NY", "TX")


def _summary(strategy: str, seed: int, c_index: float, epsilon: float | None, site_c: dict[str, float],
             central: tuple[str, float] | None, epsilon_classical: float | None = None) -> dict[str, Any]:
    privacy: dict[str, Any] = {"epsilon": epsilon, "delta": 1e-5 if epsilon else None,
                               "unit": "record" if epsilon else "none", "accountant": "x"}
    if epsilon_classical is not None:
        privacy["epsilon_classical"] = epsilon_classical
    out: dict[str, Any] = {
        "test": {"c_index": c_index, "ibs": 0.02}, "oot": {"c_index": c_index - 0.1, "ibs": 0.05},
        "sites": {site: {"c_index": value, "oot_c_index": value - 0.1} for site, value in site_c.items()},
        "privacy": privacy, "strategy": strategy, "data": "sba", "model": "hazard_mlp", "num_sites": 4,
        "rounds": 20, "seed": seed, "wall_time_s": 1.0,
    }
    if central is not None:
        mechanism, value = central
        out["centralized"] = {
            "epochs": 20, "test": {"c_index": value, "ibs": 0.02}, "oot": {"c_index": value - 0.1, "ibs": 0.05},
            "privacy": "none (no DP)" if mechanism == "none" else {"mechanism": mechanism, "epsilon": 0.9,
                                                                    **({"epsilon_mu": 0.95} if mechanism == "bdp" else {})},
        }
    return out


def _job(root: Path, name: str, strategy: str, target: float, seed: int, summary: dict[str, Any]) -> None:
    job = root / name
    job.mkdir(parents=True)
    (job / sweep.STATUS_FILE).write_text(json.dumps({
        "status": "ok", "strategy": strategy, "epsilon_target": target, "seed": seed, "data": "sba",
        "model": "hazard_mlp", "rounds": 20, "num_sites": 4, "variant": "federation.partition=State"}))
    (job / sweep.SUMMARY_FILE).write_text(json.dumps(summary))


@pytest.fixture()
def sweeps(tmp_path: Path) -> list[Path]:
    """Two sweeps (as run side by side): fedavg + dp_sgd, and bdp; 2 seeds, target ε = 1."""
    first, second = tmp_path / "a", tmp_path / "b"
    for seed in (0, 1):
        _job(first, f"fedavg{seed}", "fedavg", math.inf, seed,
             _summary("fedavg", seed, 0.90 + 0.02 * seed, None, dict.fromkeys(SITES, 0.9), ("none", 0.92)))
        _job(first, f"dp{seed}", "dp_sgd", 1.0, seed,
             _summary("dp_sgd", seed, 0.70 + 0.02 * seed, 0.99, dict.fromkeys(SITES, 0.70), ("dp_sgd", 0.80)))
        # BDP beats DP at CA, FL, NY, loses at TX
        site_c = {"CA": 0.75, "FL": 0.72, "NY": 0.71, "TX": 0.60}
        _job(second, f"bdp{seed}", "bdp", 1.0, seed,
             _summary("bdp", seed, 0.72 + 0.02 * seed, 0.98, site_c, ("bdp", 0.78), epsilon_classical=0.77))
    return [first, second]


def test_table3_has_the_papers_rows_with_mean_and_std(sweeps: list[Path]) -> None:
    results = fsl_bdp.load_results(sweeps)
    table = fsl_bdp.table3(results).set_index("scenario")
    assert list(table.index) == [label for label, _ in fsl_bdp.SCENARIOS]
    assert table.loc["Federated (No DP)", "Test CI"] == "0.910 ± 0.014"
    assert table.loc["Centralized (No DP)", "Test CI"] == "0.920 ± 0.000"  # one baseline per seed
    assert table.loc["Federated (Classical DP)", "Test CI"] == "0.710 ± 0.014"
    assert table.loc["Federated (BDP)", "OOT CI"] == "0.630 ± 0.014"
    assert table.loc["Centralized (Classical DP)", "Test CI"] == "0.800 ± 0.000"
    assert table.loc["Federated (BDP)", "epsilon (max over seeds)"] == "0.980"
    assert table.loc["Federated (BDP)", "classical epsilon of BDP"] == "0.770"
    assert table.loc["Centralized (BDP)", "epsilon (max over seeds)"] == "0.950"  # its epsilon_mu
    assert table.loc["Federated (Classical DP)", "classical epsilon of BDP"] == "–"


def test_site_wins_and_binomial_test(sweeps: list[Path]) -> None:
    results = fsl_bdp.load_results(sweeps)
    sites = fsl_bdp.site_comparison(results).set_index("site")
    assert sites.loc["CA", "difference"] == pytest.approx(0.05)
    assert list(sites["bdp_wins"]) == [True, True, True, False]
    wins = fsl_bdp.win_counts(sites.reset_index()).set_index("epsilon_target")
    assert wins.loc["1", "bdp_wins"] == "3/4" and wins.loc["all", "oot_bdp_wins"] == "3/4"
    assert wins.loc["1", "p_value"] == pytest.approx(binomtest(3, 4, 0.5, alternative="greater").pvalue)


def test_federation_effect_and_files(sweeps: list[Path], tmp_path: Path) -> None:
    effect = fsl_bdp.federation_effect(fsl_bdp.load_results(sweeps)).set_index("mechanism")
    assert effect.loc["No DP", "effect"] == pytest.approx(0.91 - 0.92)
    assert effect.loc["Classical DP", "effect"] == pytest.approx(0.71 - 0.80)
    assert effect.loc["BDP", "effect"] == pytest.approx(0.73 - 0.78)
    files = fsl_bdp.write(sweeps, tmp_path / "out", title="test")
    assert all(path.exists() for path in files.values())
    assert "Federated (BDP)" in files["table3"].read_text()


def test_report_only_rebuilds_the_same_tables_from_the_saved_csvs(sweeps: list[Path], tmp_path: Path) -> None:
    """The sweeps' run directories are not kept; results.csv and site_wins.csv are enough."""
    out = tmp_path / "out"
    fsl_bdp.write(sweeps, out, title="test")
    written = {name: (out / name).read_text() for name in ("table3.md", "table3.csv", "site_wins.md")}
    for name in written:
        (out / name).unlink()
    for sweep_dir in sweeps:  # the run directories are gone
        for summary in sweep_dir.rglob(sweep.SUMMARY_FILE):
            summary.unlink()
    fsl_bdp.main(["--report-only", "--out", str(out), "--title", "test"])
    assert {name: (out / name).read_text() for name in written} == written
