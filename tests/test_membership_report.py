"""The membership-audit grid: which (ε, δ) bounds each release, and a small grid end to end."""

import math

import pytest

from simulations.engine import strategy_overrides
from simulations.papers.membership import record_level_budget, run_grid, targets, write_report
from strategies.accounting.rdp import epsilon_gaussian_rounds
from strategies.audits.membership import max_auc


def test_record_level_budget_per_mechanism() -> None:
    dp_sgd = {"mechanism": "dp_sgd", "epsilon": 2.0, "delta": 1e-5, "adjacency": "add-remove"}
    assert record_level_budget(dp_sgd, target="update") == (2.0, 1e-5, "record-level, add-remove")
    bdp = {"mechanism": "bdp", "epsilon": 0.4, "epsilon_classical": 1.7, "delta": 1e-5, "adjacency": "add-remove"}
    assert record_level_budget(bdp, target="global")[0] == 1.7  # the worst case, not the Bayesian epsilon_mu
    central = {"mechanism": "central_dp", "epsilon": 3.0, "delta": 1e-5, "noise_multiplier": 4.0, "steps": 20}
    epsilon, delta, _ = record_level_budget(central, target="global")
    assert epsilon == pytest.approx(epsilon_gaussian_rounds(noise_multiplier=2.0, rounds=20, delta=1e-5))
    assert epsilon > 3.0 and delta == 1e-5  # one record replaces its site's update: twice the site-level sensitivity
    assert record_level_budget(central, target="update")[0] == math.inf  # the update reaches the server unnoised
    assert record_level_budget({"mechanism": "none", "epsilon": None}, target="global")[0] == math.inf
    assert record_level_budget(None, target="global")[0] == math.inf


def test_small_grid_rows_ceilings_and_report(tmp_path) -> None:
    shared = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False,
              "evaluation.server_side": True}
    rows = run_grid(tmp_path, ["fedavg", "dp_sgd"], [2.0], [0], shared, jobs=1)
    assert len(rows) == 2 * 3 * 2  # (fedavg at inf, dp_sgd at 2) x 3 sites x (global, update)
    for row in rows:
        assert 0.0 <= row["auc"] <= 1.0 and row["members"] > row["non_members"] > 0
        assert row["ceiling_auc"] == pytest.approx(max_auc(epsilon=row["epsilon_record"], delta=row["delta_record"]))
        if row["strategy"] == "dp_sgd":
            assert 0 < row["epsilon_record"] <= 2.0 + 1e-9 and row["ceiling_auc"] < 1.0
    assert run_grid(tmp_path, ["fedavg", "dp_sgd"], [2.0], [0], shared, jobs=1) == rows  # a rerun adds nothing
    text = write_report(tmp_path, rows)
    assert text.count("| dp_sgd | 2 |") == 2 and (tmp_path / "figure.png").exists()


def test_a_secure_sum_run_is_attacked_on_its_global_model_only_without_keys_it_refuses(tmp_path) -> None:
    assert targets("distributed_dp") == ("global",) and targets("dp_sgd") == targets("fedavg") == ("global", "update")
    shared = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False,
              "evaluation.server_side": True, "train.local_epochs": 2}  # the grid's key distributed_dp would refuse
    assert strategy_overrides("distributed_dp", shared)[1] == ("train.local_epochs",)
    assert strategy_overrides("dp_sgd", shared) == (shared, ())
    rows = run_grid(tmp_path, ["distributed_dp"], [2.0], [0], shared, jobs=1)
    assert [row["target"] for row in rows] == ["global"] * 3  # the server never sees a site's update, only the sum
    for row in rows:
        assert 0 < row["epsilon_record"] <= 2.0 + 1e-9 and row["guarantee"] == "record-level, add-remove"
        assert row["ceiling_auc"] == pytest.approx(max_auc(epsilon=row["epsilon_record"], delta=row["delta_record"]))
    assert write_report(tmp_path, rows).count("| distributed_dp | 2 | global |") == 1
