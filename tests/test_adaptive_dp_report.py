"""The adaptive-DP reproduction script's tables, and diverged models reported instead of crashing."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord

from flwr_app import task
from flwr_app.horizontal_server import _evaluate_global, _load_final
from simulations.papers.adaptive_dp import PAPER, write_report
from simulations.engine import resolve
from simulations.hydra_config import parse_value


def _row(method: str, epsilon: float, seed: int, inbll: float, **extra: float) -> dict:
    return {"method": method, "epsilon_target": epsilon, "seed": seed, "c_index": 0.8, "ibs": 0.05,
            "inbll": inbll, "epsilon_rdp": extra.get("rdp", 0.1), "epsilon_audited_formula": extra.get("formula", 0.6),
            "epsilon_nominal": epsilon, "noise_multiplier": 400.0, "wall_s": 1.0, "error": ""}


def test_report_puts_the_papers_figure_beside_mean_and_std_and_counts_diverged_runs(tmp_path) -> None:
    rows = [_row("no DP", math.inf, seed, 0.07 + 0.01 * seed) for seed in range(2)]
    rows += [_row("NbAFL", 0.6, 0, 0.40, rdp=0.05), _row("NbAFL", 0.6, 1, 0.44, rdp=0.06)]
    rows += [_row("ROW-DP(Var)", 0.6, 0, math.nan, formula=50.0), _row("ROW-DP(Var)", 0.6, 1, 0.5, formula=40.0)]
    text = write_report(tmp_path, rows, ["no DP", "NbAFL", "ROW-DP(Var)"], [0.6], ["inbll"])
    assert (tmp_path / "table.md").read_text() == text
    assert (tmp_path / "figure.png").stat().st_size > 0
    lines: dict[str, str] = {}
    for line in text.splitlines():  # the metric table comes first; the ε table repeats the names
        if line.startswith("| "):
            lines.setdefault(line.split(" | ")[0], line)
    # mean ± sample std, the paper's value in brackets; the no-DP row is the same runs at every ε
    assert "0.0750 ± 0.0071 [0.2309]" in lines["| no DP"]
    assert "0.4200 ± 0.0283 [0.2753]" in lines["| NbAFL"]
    assert "0.5000 ± 0.0000 (1/2 diverged) [0.2681]" in lines["| ROW-DP(Var)"]
    # the ε table: the worst run's nominal / formula / RDP figures
    eps_lines = [line for line in text.splitlines() if line.startswith("| ROW-DP(Var) |")]
    assert eps_lines[-1].endswith("| 0.6 / 50 / 0.1 |")
    assert PAPER["c_index"]["LS-ADP"][3.0] == 0.7627


def test_command_line_values_are_typed_like_toml() -> None:
    assert parse_value("50") == 50 and parse_value("0.3") == 0.3 and parse_value("1e-5") == 1e-5
    assert parse_value("inf") == math.inf and parse_value("true") is True and parse_value("sim_cox") == "sim_cox"


@pytest.fixture(scope="module")
def cox_setup():
    _, cfg = resolve({"model.name": "cox_mlp", "model.num_durations": 20, "federation.num_sites": 2})
    dataset = task.load_federation(cfg)
    return cfg, dataset


def _diverge(model, how: str) -> None:
    with torch.no_grad():
        if how == "non-finite":
            next(model.net.parameters()).fill_(math.inf)
        else:  # every log-risk hugely negative: exp underflows, the risk sets are empty
            linears = [m for m in model.net.modules() if isinstance(m, torch.nn.Linear)]
            linears[-2].weight.zero_()
            linears[-2].bias.fill_(1.0)
            linears[-1].weight.fill_(-1e4)


def _baseline(model, dataset):
    """The federated Breslow baseline of ``model``: every site's ``(d_k, R_k)`` summed."""
    return tuple(sum(parts) for parts in zip(*(
        model.breslow_aggregates(s.train.x, s.train.time, s.train.event) for s in dataset.sites), strict=True))


@pytest.mark.parametrize(("how", "reason"), [("non-finite", "non-finite weights"), ("underflow", "empty risk set")])
def test_a_diverged_model_gets_no_metrics_and_the_reason(cox_setup, how: str, reason: str) -> None:
    """The ServerApp: a diverged global model is reported (the summary's ``diverged``), not raised."""
    cfg, dataset = cox_setup
    model = task.build_model(cfg, dataset)
    _diverge(model, how)
    arrays = ArrayRecord(model.net.state_dict())
    baseline = _baseline(model, dataset) if how == "underflow" else None
    fresh = task.build_model(cfg, dataset)
    metrics, error = _evaluate_global(fresh, arrays, baseline, dataset)
    assert metrics == {} and error.startswith("global model diverged") and reason in error


def test_the_final_model_is_loaded_for_saving_even_when_its_baseline_does_not_exist(cox_setup) -> None:
    """A run whose last model diverged (no Breslow baseline) writes its results instead of raising at the end."""
    cfg, dataset = cox_setup
    model = task.build_model(cfg, dataset)
    _diverge(model, "underflow")
    arrays, baseline = ArrayRecord(model.net.state_dict()), _baseline(model, dataset)
    fresh = task.build_model(cfg, dataset)
    assert "empty risk set" in _load_final(fresh, arrays, baseline, None)
    assert all(torch.equal(fresh.net.state_dict()[key], value) for key, value in model.net.state_dict().items())
    healthy = task.build_model(cfg, dataset)
    assert _load_final(task.build_model(cfg, dataset), ArrayRecord(healthy.net.state_dict()),
                       _baseline(healthy, dataset), None) == ""


def test_a_cox_model_without_breslow_aggregates_gets_no_metrics_and_the_reason(cox_setup) -> None:
    """Every site's Breslow reply failed (they do when the model has diverged): the round is recorded, not raised."""
    cfg, dataset = cox_setup
    model = task.build_model(cfg, dataset)
    metrics, error = _evaluate_global(task.build_model(cfg, dataset), ArrayRecord(model.net.state_dict()), None, dataset)
    assert metrics == {} and "no site's Breslow aggregates came back" in error


def test_a_healthy_model_is_evaluated(cox_setup) -> None:
    cfg, dataset = cox_setup
    model = task.build_model(cfg, dataset)
    fresh = task.build_model(cfg, dataset)
    metrics, error = _evaluate_global(fresh, ArrayRecord(model.net.state_dict()), _baseline(model, dataset), dataset)
    assert error == "" and 0.0 < metrics["c_index"] < 1.0 and math.isfinite(metrics["ibs"])


def test_the_reproductions_shared_privacy_keys_reach_the_dp_methods_and_not_the_no_dp_baseline() -> None:
    """The documented commands pass ``privacy.clip_norm`` to every run; FedAvg refuses a key it ignores."""
    from simulations.papers.adaptive_dp import _run

    shared = {"data.name": "sim_cox", "model.name": "cox_mlp", "federation.rounds": 1, "privacy.clip_norm": 5.0}
    baseline = _run(("no DP", math.inf, 0, shared))
    assert math.isfinite(baseline["c_index"]) and not baseline["error"] and math.isnan(baseline["epsilon_rdp"])
    private = _run(("NbAFL", 1.0, 0, shared))
    assert math.isfinite(private["epsilon_rdp"]) and private["noise_multiplier"] > 0
