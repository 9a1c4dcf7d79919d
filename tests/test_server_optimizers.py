"""Server optimisers (``federation.server_optimizer``) end to end through Flower (the in-process engine).

Each run's global models are compared with the optimisers' closed forms (Reddi et al. 2021,
Algorithm 2; FedAvgM's heavy ball) applied to Flower's weighted mean of the replies the sites
actually sent, with the learning rates and FedAvgM's momentum of :data:`CHOSEN` (the ``auto`` defaults, chosen on
validation splits by ``benchmarks/server_optimizers.py``) and the other hyperparameters read from Flower's own
constructors.
"""

from __future__ import annotations

import inspect
import json
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.supercore.differential_privacy import compute_clip_model_update
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flwr_app.config import PROJECT_ROOT, ConfigError, parse_run_config
from flwr_app.horizontal_server import RunStopped
from simulations.engine import run_inprocess
from strategies import config, server_optimizers
from strategies.horizontal import SITE_KEY, WEIGHT_KEY

SMALL = {"federation.num_sites": 3, "federation.rounds": 2, "baseline.centralized": False,
         "evaluation.server_side": False}
#: The plain weighted mean (no bound on an update's pull), whose closed form the optimisers step from.
PLAIN = {"federation.update_bound": 0}
OPTIMIZERS = ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
#: What ``auto`` gives each optimiser (server_lr, server_momentum; None: it has none), as docs/results/server_optimizers.md
#: and docs/configuration.md state them.
CHOSEN = {"fedadam": (0.1, 0.9), "fedyogi": (0.03, 0.9), "fedadagrad": (0.03, None), "fedavgm": (1.0, 0.7)}


def _flower_default(class_name: str, parameter: str) -> float:
    return inspect.signature(getattr(flower_strategies, class_name)).parameters[parameter].default


def _run(tmp_path, overrides, observe=None):
    """Run ``overrides``; return the summary, each round's global model sent to the sites and each round's
    replies (site -> (arrays, weight)), and the final model."""
    sent: dict[int, dict[str, np.ndarray]] = {}
    replies: dict[int, dict[str, tuple[dict[str, np.ndarray], float]]] = {}

    def record(message, reply):
        if message.metadata.message_type != "train" or reply.has_error():
            return
        server_round = int(message.content["config"]["server-round"])
        sent[server_round] = {key: array.numpy() for key, array in message.content["arrays"].items()}
        site = str(reply.content[SITE_KEY]["name"])
        metrics = next(iter(reply.content.metric_records.values()))
        replies.setdefault(server_round, {})[site] = (
            {key: array.numpy() for key, array in next(iter(reply.content.array_records.values())).items()},
            float(metrics[WEIGHT_KEY]))

    summary = run_inprocess({**overrides, "output.dir": str(tmp_path)}, observe=observe or record)
    final = {key: value.numpy() for key, value in
             torch.load(tmp_path / "model.pt", weights_only=False)["state_dict"].items()}
    return summary, sent, replies, final


def _flower_mean(replies: dict[str, tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """Flower's weighted mean of the replies, in site order (as the server sums them)."""
    contents = [RecordDict({"arrays": ArrayRecord({key: Array(value) for key, value in arrays.items()}),
                            "metrics": MetricRecord({WEIGHT_KEY: weight})})
                for _, (arrays, weight) in sorted(replies.items())]
    return {key: array.numpy() for key, array in aggregate_arrayrecords(contents, WEIGHT_KEY).items()}


class ClosedForm:
    """The optimisers' update rules written out (float64), with Flower's default hyperparameters."""

    def __init__(self, name: str, *, lr: float | None = None, momentum: float | None = None) -> None:
        self.name = name
        cls = {"fedadam": "FedAdam", "fedyogi": "FedYogi", "fedadagrad": "FedAdagrad", "fedavgm": "FedAvgM"}[name]
        self.lr = CHOSEN[name][0] if lr is None else lr
        if name == "fedavgm":
            self.beta_1 = CHOSEN[name][1] if momentum is None else momentum
        else:
            self.beta_1 = 0.0 if name == "fedadagrad" else _flower_default(cls, "beta_1")
            self.beta_2 = 0.0 if name == "fedadagrad" else _flower_default(cls, "beta_2")
            self.tau = _flower_default(cls, "tau")
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, server_round: int, x: dict[str, np.ndarray], mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        new = {}
        for key in x:
            x_k, d = x[key].astype(np.float64), mean[key].astype(np.float64) - x[key].astype(np.float64)
            if self.name == "fedavgm":  # heavy ball on the pseudo-gradient x - mean
                self.m[key] = -d if key not in self.m else self.beta_1 * self.m[key] - d
                new[key] = x_k - self.lr * self.m[key]
                continue
            self.m[key] = self.beta_1 * self.m.get(key, 0.0) + (1 - self.beta_1) * d
            v = self.v.get(key, np.zeros_like(d))
            if self.name == "fedadam":
                self.v[key] = self.beta_2 * v + (1 - self.beta_2) * d ** 2
                lr = self.lr * np.sqrt(1 - self.beta_2 ** (server_round + 1)) / (1 - self.beta_1 ** (server_round + 1))
            elif self.name == "fedyogi":
                self.v[key] = v - (1 - self.beta_2) * d ** 2 * np.sign(v - d ** 2)
                lr = self.lr
            else:  # fedadagrad
                self.v[key] = v + d ** 2
                lr = self.lr
            new[key] = x_k + lr * self.m[key] / (np.sqrt(self.v[key]) + self.tau)
        return new


def _assert_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(actual) == set(expected)
    for key in actual:
        assert actual[key].dtype == np.float32  # the global model keeps its dtype
        np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_runs_through_flower_and_steps_by_its_closed_form(name, tmp_path):
    """Rounds 1 and 2: the global model is the optimiser's update from the model the sites were sent, given
    Flower's weighted mean of the updates they sent back (state carried from round 1 to round 2)."""
    extra = {"federation.server_lr": 0.5} if name == "fedavgm" else {}  # with lr 1 its first step is the mean
    summary, sent, replies, final = _run(tmp_path, {**SMALL, **PLAIN, "federation.server_optimizer": name, **extra})
    assert set(replies[1]) == set(replies[2]) == {"site-0", "site-1", "site-2"}
    reference = ClosedForm(name, lr=extra.get("federation.server_lr"))
    after_round_1 = reference.step(1, sent[1], _flower_mean(replies[1]))
    _assert_close(sent[2], after_round_1)
    _assert_close(final, reference.step(2, sent[2], _flower_mean(replies[2])))
    mean = _flower_mean(replies[1])
    assert max(float(np.abs(sent[2][key] - mean[key]).max()) for key in mean) > 1e-3  # not the plain mean
    assert np.isfinite(summary["test"]["c_index"])


def test_fedavgm_without_momentum_is_fedavg_bit_for_bit(tmp_path):
    _, _, _, fedavg = _run(tmp_path / "fedavg", SMALL)
    _, _, _, fedavgm = _run(tmp_path / "fedavgm", {**SMALL, "federation.server_optimizer": "fedavgm",
                                                   "federation.server_momentum": 0.0})
    assert all(np.array_equal(fedavg[key], fedavgm[key]) for key in fedavg)


def test_under_central_dp_the_optimizer_steps_on_the_noised_mean(tmp_path, monkeypatch):
    """The aggregate the optimiser receives is the clipped mean plus Flower's noise of std sigma C / m, and the
    new global model is FedAdam's step given that noised aggregate."""
    seen = []
    step = server_optimizers.ServerOptimizer.step

    def spy(self, server_round, global_arrays, aggregate):
        seen.append((server_round, {key: array.numpy() for key, array in global_arrays.items()},
                     {key: array.numpy() for key, array in aggregate.items()}))
        return step(self, server_round, global_arrays, aggregate)

    monkeypatch.setattr(server_optimizers.ServerOptimizer, "step", spy)
    overrides = {**SMALL, "strategy.name": "central_dp", "privacy.epsilon": 4.0, "privacy.clip_norm": 0.1,
                 "federation.server_optimizer": "fedadam"}
    _, sent, replies, _ = _run(tmp_path, overrides)
    sigma = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[0])["noise_multiplier"]
    server_round, global_arrays, aggregate = seen[0]
    assert server_round == 1
    keys = list(global_arrays)
    clipped = []
    for _, (arrays, _) in sorted(replies[1].items()):
        update = [arrays[key].copy() for key in keys]
        compute_clip_model_update(update, [global_arrays[key] for key in keys], 0.1)
        clipped.append(update)
    clean_mean = [np.mean([site[index] for site in clipped], axis=0) for index in range(len(keys))]
    noise = np.concatenate([(aggregate[key] - clean_mean[index]).ravel() for index, key in enumerate(keys)])
    assert noise.size > 1000
    assert np.std(noise) == pytest.approx(sigma * 0.1 / 3, rel=0.1)   # Flower's noise is in what the optimiser saw
    _assert_close(sent[2], ClosedForm("fedadam").step(1, global_arrays, aggregate))


def test_with_a_robust_aggregator_the_optimizer_steps_on_the_robust_aggregate(tmp_path):
    """federation.aggregation = median with fedadagrad: the new global model is Adagrad's step given the
    coordinate-wise median of the sites' updates (Flower's FedMedian), not given their mean."""
    _, sent, replies, _ = _run(tmp_path, {**SMALL, "federation.aggregation": "median",
                                          "federation.server_optimizer": "fedadagrad"})
    median = {key: np.median(np.stack([arrays[key] for arrays, _ in replies[1].values()]), axis=0)
              for key in sent[1]}
    _assert_close(sent[2], ClosedForm("fedadagrad").step(1, sent[1], median))


@pytest.mark.parametrize("strategy", ["dp_sgd", "central_dp"])
def test_the_ledger_is_the_same_with_every_optimizer(strategy, tmp_path):
    """Post-processing: the sites' privacy figures and every ledger entry are those of the run with fedavg."""
    overrides = {**SMALL, "strategy.name": strategy, "privacy.epsilon": 4.0,
                 **({"privacy.clip_norm": 0.1} if strategy == "central_dp" else {})}
    ledgers = {}
    for name in ("fedavg",) + OPTIMIZERS:
        summary, _, _, _ = _run(tmp_path / name, {**overrides, "federation.server_optimizer": name})
        ledgers[name] = (tmp_path / name / "ledger.jsonl").read_text()
        assert summary["privacy"]["epsilon"] <= 4.0 + 1e-9
    assert len(ledgers["fedavg"].splitlines()) == 2 * 3
    assert all(ledger == ledgers["fedavg"] for ledger in ledgers.values())


@pytest.mark.parametrize("name, extra", [("fedadam", {}), ("fedavgm", {"federation.server_lr": 0.5})])
def test_a_resumed_run_continues_the_optimizer_state(name, extra, tmp_path):
    """Stopped after round 1 and resumed, the run ends bit for bit as the uninterrupted one: the moments (FedAdam)
    and the momentum (FedAvgM) come back from the checkpoint (a fresh optimiser would step differently)."""
    overrides = {**SMALL, "federation.rounds": 3, "federation.server_optimizer": name, **extra}
    _, _, _, full = _run(tmp_path / "full", overrides)
    with pytest.raises(RunStopped):
        run_inprocess({**overrides, "output.dir": str(tmp_path / "resumed"), "debug.stop_after_round": 1})
    saved = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["strategy"]["server_optimizer"]
    assert saved["name"] == name and all(value is not None for value in saved.values())
    summary = run_inprocess({**overrides, "resume.from": str(tmp_path / "resumed")})
    assert summary["resumed_after_round"] == 1
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=False)["state_dict"]
    assert all(np.array_equal(resumed[key].numpy(), full[key]) for key in full)


def test_an_optimizer_state_of_another_optimizer_is_refused():
    state = server_optimizers.ServerOptimizer("fedadam").state_dict()
    with pytest.raises(ValueError, match="'fedadam'.*'fedyogi'"):
        server_optimizers.ServerOptimizer("fedyogi").load_state_dict(state)


@pytest.mark.parametrize("overrides, message", [
    ({"federation.server_lr": 0.1}, "'federation.server_lr' = 0.1 does not apply to federation.server_optimizer = "
                                    "'fedavg'"),
    ({"federation.server_optimizer": "fedadagrad", "federation.server_momentum": 0.5},
     "'federation.server_momentum' = 0.5 does not apply to federation.server_optimizer = 'fedadagrad'"),
    ({"federation.server_optimizer": "fedadam", "federation.server_momentum": 1.0},
     "'federation.server_momentum' must be in"),
    ({"federation.server_optimizer": "sgd"}, "'federation.server_optimizer' = 'sgd'; choose one of"),
    ({"strategy.name": "split", "data.name": "synthetic_multimodal", "federation.server_optimizer": "fedadam"},
     "federation.server_optimizer = 'fedadam' has no effect on strategy 'split'"),
    ({"strategy.name": "split", "data.name": "synthetic_multimodal", "train.proximal_mu": 0.1},
     "train.proximal_mu = 0.1 has no effect on strategy 'split'"),
    ({"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "federation.server_optimizer": "fedadam"},
     "federation.server_optimizer = 'fedadam' would stack on the server Adam step"),
])
def test_bad_optimizer_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_run_config(overrides)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_auto_hands_flower_the_documented_defaults(name):
    """``auto`` (the run config's default) gives Flower's strategy the learning rate and momentum of :data:`CHOSEN`,
    and docs/configuration.md states those values; an explicit value replaces them."""
    option = config.SERVER_OPTIMIZERS[name]
    lr, momentum = CHOSEN[name]
    strategy = server_optimizers.make_server_optimizer(
        parse_run_config({"federation.server_optimizer": name}).federation).strategy
    assert getattr(strategy, option.lr) == lr
    assert (getattr(strategy, option.momentum) if option.momentum else None) == momentum
    if option.momentum == "beta_1":
        assert momentum == _flower_default(option.flower_class, "beta_1")  # documented as Flower's
    rows = {line.split("|")[1].strip(): line for line in (PROJECT_ROOT / "docs" / "configuration.md")
            .read_text(encoding="utf-8").splitlines() if line.startswith("| `federation.server_") and "auto = " in line}
    assert re.search(rf"\b{name} {re.escape(f'{lr:g}')}[, ]", rows["`federation.server_lr`"])
    if name == "fedavgm":
        assert re.search(rf"\bfedavgm {re.escape(f'{momentum:g}')}[, ]", rows["`federation.server_momentum`"])
    explicit = server_optimizers.make_server_optimizer(parse_run_config(
        {"federation.server_optimizer": name, "federation.server_lr": 0.123}).federation).strategy
    assert getattr(explicit, option.lr) == 0.123


def test_each_optimizer_is_built_from_its_flower_class():
    for name, cls in (("fedadam", "FedAdam"), ("fedyogi", "FedYogi"), ("fedadagrad", "FedAdagrad"),
                      ("fedavgm", "FedAvgM")):
        optimizer = server_optimizers.make_server_optimizer(
            parse_run_config({"federation.server_optimizer": name}).federation)
        assert type(optimizer.strategy) is getattr(flower_strategies, cls)
    assert server_optimizers.make_server_optimizer(parse_run_config({}).federation) is None
