"""``model.name = auto``: the rule of :mod:`strategies.model_choice`, the linear hazard model it may choose, and how
the choice reaches the console, ``summary.json``, the sites and the saved model."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from lifelines.utils import concordance_index
from torch import nn

from flwr_app import task
from models.predict import load_run
from models.survival import CoxMLP, HazardMLP, build_survival_model
from simulations.engine import resolve, run_inprocess
from strategies.config import DEFAULT_HIDDEN, parse_flat
from strategies.model_choice import (CANDIDATES, DP_SIGNAL_THRESHOLD, choose_model, covariate_parameters,
                                     effective_records)

SIZES = [40, 100, 150, 200, 250, 250]  # the six centres of benchmarks/model_choice.py
SMALL, DEFAULT = (hidden for _, hidden in CANDIDATES)


def _choose(counts, epsilon, strategy, covariates=7, risk_layer="proportional"):
    return choose_model(counts, covariates, epsilon, strategy, num_durations=20, risk_layer=risk_layer).hidden


@pytest.mark.parametrize("hidden", [(), (32,), (128, 64, 64, 32, 32)])
@pytest.mark.parametrize("risk_layer", ["interval", "proportional"])
def test_parameters_counted_are_the_networks_weights_but_the_interval_baselines(hidden, risk_layer):
    net = build_survival_model("hazard_mlp", in_features=7, cuts=np.linspace(0, 1, 20), hidden=hidden,
                               risk_layer=risk_layer).net
    weights = sum(p.numel() for p in net.parameters()) - net.baseline.numel()
    assert covariate_parameters(hidden, 7, num_durations=20, risk_layer=risk_layer) == weights


def test_default_widths_are_the_networks_own():
    for name, net in (("hazard_mlp", HazardMLP), ("cox_mlp", CoxMLP)):
        assert DEFAULT_HIDDEN[name] == inspect.signature(net).parameters["hidden"].default
    assert CANDIDATES[-1] == ("hazard_mlp", DEFAULT_HIDDEN["hazard_mlp"])


def test_golden_cases_of_the_rule():
    # six centres, 990 records, 7 covariates, proportional layer: d = 288 ([32]), 16608 (default)
    assert effective_records(SIZES, "dp_sgd") == pytest.approx(990 / math.sqrt(6))
    assert effective_records(SIZES, "distributed_dp") == 990 and effective_records(SIZES, "central_dp") == 6
    assert _choose(SIZES, 1.0, "dp_sgd") == SMALL  # [32]: 404 / 288 = 1.40; default: 0.02
    assert _choose(SIZES, 1.0, "distributed_dp") == SMALL  # [32]: 990 / 288 = 3.44
    assert _choose(SIZES, 10.0, "dp_sgd") == SMALL  # default: 4042 / 16608 = 0.24
    assert _choose(SIZES, 0.01, "dp_sgd") == SMALL  # the smallest candidate is always admissible
    assert _choose(SIZES, math.inf, "fedavg") == DEFAULT == _choose([30, 30], math.inf, "fedavg")
    assert _choose(SIZES, 11.0, "distributed_dp") == DEFAULT  # 10890 / 16608 = 0.66
    assert _choose(SIZES, 10.0, "distributed_dp") == SMALL  # 0.596
    assert _choose([1e6] * 6, 1.0, "central_dp") == SMALL  # a site is the unit: 6 * 1 / 16608
    edge = DP_SIGNAL_THRESHOLD * 16608  # the default reaches the threshold exactly at this many union records
    assert _choose([edge], 1.0, "distributed_dp") == DEFAULT
    assert _choose([edge - 1], 1.0, "distributed_dp") == SMALL
    # the interval layer has 19 output weights per last hidden unit: the default has d = 16608 + 18 * 32
    assert _choose([edge], 1.0, "distributed_dp", risk_layer="interval") == SMALL
    assert _choose([DP_SIGNAL_THRESHOLD * (16608 + 18 * 32)], 1.0, "distributed_dp", risk_layer="interval") == DEFAULT


def test_the_choice_says_why_and_from_what():
    choice = choose_model(SIZES, 7, 1.0, "dp_sgd", num_durations=20, risk_layer="proportional")
    assert choice.line() == ("model.name=auto: chose hazard_mlp, model.hidden=[32] because records per parameter "
                             "under noise z = n_eff*epsilon/d = 404*1/288 = 1.40; hazard_mlp, "
                             "model.hidden=[128,64,64,32,32] would have z = 0.02 < 0.6")
    record = choice.as_dict()
    assert record["chosen"] == {"model.name": "hazard_mlp", "model.hidden": [32]}
    assert record["inputs"]["records_per_site"] == SIZES and record["inputs"]["covariates"] == 7


def test_an_explicit_model_or_width_is_never_overridden():
    cfg = parse_flat({"model.name": "hazard_mlp", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    assert cfg.model.hidden == DEFAULT_HIDDEN["hazard_mlp"]
    assert task.model_choice(cfg, {"a": 40, "b": 40}, 7) is None
    fixed = parse_flat({"model.hidden": [64], "strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    assert fixed.model.hidden == (64,) and task.model_choice(fixed, {"a": 40}, 7) is None
    auto = parse_flat({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    assert auto.model.hidden is None and task.model_choice(auto, {"a": 40, "b": 40}, 7).hidden == SMALL


def test_a_deployed_site_builds_the_widths_of_its_set_up_and_refuses_others():
    auto = parse_flat({"strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    cfg = resolve({"data.name": "gbsg"})[1]
    spec = task.run_spec(cfg, task.load_federation(cfg))
    chosen = task.SiteSpec.from_json(task.with_model_choice(auto, spec, {"a": 40, "b": 40}).to_json())
    assert chosen.hidden == SMALL
    net = task.model_from_spec(auto, chosen).net
    assert [tuple(layer.weight.shape) for layer in net.layers if isinstance(layer, nn.Linear)] == [
        (32, len(spec.preprocessor.feature_names)), (1, 32)]
    with pytest.raises(ValueError, match=r"model.name = 'auto' needs the widths chosen at set-up"):
        task.model_from_spec(auto, task.SiteSpec(spec.preprocessor, spec.cuts, spec.time_scale, hidden=()))
    explicit = parse_flat({"model.name": "hazard_mlp", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0})
    with pytest.raises(ValueError, match=r"this run config fixes model.hidden = \[128, 64, 64, 32, 32\]"):
        task.model_from_spec(explicit, chosen)


def _gbsg_dp_sgd(tmp_path, **overrides):
    return {"data.name": "gbsg", "strategy.name": "dp_sgd", "privacy.epsilon": 1.0, "federation.rounds": 2,
            "baseline.centralized": False, "output.dir": str(tmp_path), **overrides}


def test_a_linear_model_trains_under_dp_sgd_through_flower_and_its_reloaded_predictions_match(tmp_path):
    run = _gbsg_dp_sgd(tmp_path, **{"model.hidden": "[]"})
    summary = run_inprocess(run)
    assert "model_choice" not in summary and summary["privacy"]["epsilon"] <= 1.0 + 1e-9
    test = task.load_federation(resolve(run)[1]).pooled("test")
    model = load_run(tmp_path).model
    (linear,) = [layer for layer in model.net.layers if isinstance(layer, nn.Linear)]
    assert linear.weight.shape == (1, test.x.shape[1])  # proportional (the recipe's): one risk score, no hidden layer
    logits = test.x @ linear.weight.detach().numpy().T + model.net.baseline.detach().numpy()
    reference = np.cumprod(1.0 / (1.0 + np.exp(logits)), axis=1)  # prod (1 - sigmoid(logit))
    times, surv = model.predict_survival(test.x)
    np.testing.assert_allclose(surv, reference, rtol=1e-5)
    rmst = surv[:, :-1] @ np.diff(times)
    assert summary["test"]["c_index"] == pytest.approx(concordance_index(test.time, rmst, test.event), abs=1e-6)


def test_auto_prints_its_choice_writes_it_to_the_summary_and_saves_the_chosen_network(tmp_path, capsys):
    summary = run_inprocess(_gbsg_dp_sgd(tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model.name=auto")]
    record = summary["model_choice"]
    inputs = record["inputs"]
    again = choose_model(inputs["records_per_site"], inputs["covariates"], inputs["epsilon"], inputs["strategy"],
                         num_durations=inputs["num_durations"], risk_layer=inputs["risk_layer"])
    assert lines == [again.line()] and record["reason"] == again.reason
    assert record["chosen"] == {"model.name": "hazard_mlp", "model.hidden": [32]} and inputs["num_sites"] == 5
    widths = [tuple(layer.weight.shape) for layer in load_run(tmp_path).model.net.layers
              if isinstance(layer, nn.Linear)]
    assert widths == [(32, inputs["covariates"]), (1, 32)]


@pytest.mark.parametrize("name", ["hazard_mlp", "cox_mlp"])
@pytest.mark.parametrize("written", ["[]", []])
def test_an_empty_width_list_is_a_linear_model(name, written):
    cfg = parse_flat({"model.name": name, "model.hidden": written})
    assert cfg.model.hidden == ()
    model = task.build_network(cfg, in_features=7, cuts=np.linspace(0.0, 10.0, 20), time_scale=(0.0, 1.0))
    assert [type(layer) for layer in model.net.layers][:1] == [nn.Linear]
    assert sum(isinstance(layer, nn.Linear) for layer in model.net.modules()) == 1
    x = np.random.default_rng(0).normal(size=(5, 7))
    (linear,) = [layer for layer in model.net.layers if isinstance(layer, nn.Linear)]
    if name == "cox_mlp":  # Cox regression: the log-risk is x'beta
        np.testing.assert_allclose(model.risk_score(x), x @ linear.weight.detach().numpy().ravel(), rtol=1e-5)
