"""``federation.weight_average``: the server evaluates, recalibrates and saves an average of the global models.

The averages are checked against their closed forms, and end to end (the real ServerApp and ClientApp over the
in-process grid): the model in every evaluate message is the EMA of the global models the train messages carried,
the training messages and the ledger are those of the run without averaging, and a resumed run keeps the average.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flwr_app.config import ConfigError
from flwr_app.horizontal_server import RunStopped
from simulations.engine import resolve, run_inprocess
from strategies.arrays import values
from strategies.horizontal import average_weight, moved_toward
from strategies.rounds.records import CARRIED_EVALUATION

DECAY = 0.5
ROUNDS = 4
RUN = {"federation.num_sites": 3, "baseline.centralized": False, "evaluation.server_side": True,
       "strategy.name": "dp_sgd", "privacy.epsilon": 2.0, "federation.rounds": ROUNDS}
EMA = {"federation.weight_average": "ema", "federation.ema_decay": DECAY}


def _federation(**keys):
    return resolve({"federation.rounds": 7, **keys})[1].federation


def _running(federation, iterates, start):
    """The running averages after each of ``iterates`` (rounds 1, 2, ...) from ``start``."""
    average, out = ArrayRecord({"w": Array(start)}), []
    for server_round, x in enumerate(iterates, start=1):
        average = moved_toward(average, ArrayRecord({"w": Array(x)}), average_weight(federation, server_round))
        out.append(values(average["w"]))
    return out


@pytest.mark.parametrize("decay", [0.5, 0.9])
def test_ema_is_the_bias_corrected_moving_average_of_rounds_one_to_t(decay):
    rng = np.random.default_rng(0)
    iterates = [rng.normal(size=(3, 2)) for _ in range(7)]
    averages = _running(_federation(**{"federation.weight_average": "ema", "federation.ema_decay": decay}),
                        iterates, start=rng.normal(size=(3, 2)))
    for t, average in enumerate(averages, start=1):
        weights = np.array([(1 - decay) * decay ** (t - s) for s in range(1, t + 1)])
        expected = np.tensordot(weights / weights.sum(), np.stack(iterates[:t]), axes=1)
        np.testing.assert_allclose(average, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fraction", [0.5, 0.3, 1.0])
def test_tail_is_the_mean_of_the_last_rounds(fraction):
    rng = np.random.default_rng(1)
    iterates = [rng.normal(size=4) for _ in range(7)]
    averages = _running(_federation(**{"federation.weight_average": "tail", "federation.tail_fraction": fraction}),
                        iterates, start=rng.normal(size=4))
    first = 7 - math.ceil(fraction * 7) + 1
    for t, average in enumerate(averages, start=1):
        expected = iterates[t - 1] if t < first else np.mean(iterates[first - 1:t], axis=0)
        np.testing.assert_allclose(average, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(averages[-1], iterates[-1])


def test_none_is_the_global_model_itself():
    arrays = ArrayRecord({"w": Array(np.ones(3))})
    federation = _federation()
    assert all(moved_toward(ArrayRecord({"w": Array(np.zeros(3))}), arrays, average_weight(federation, t)) is arrays
               for t in range(1, 8))


@pytest.mark.parametrize("overrides, match", [
    ({"federation.ema_decay": 0.8}, "ema_decay = 0.8 is read only with federation.weight_average = 'ema'"),
    ({"federation.weight_average": "ema", "federation.tail_fraction": 0.2}, "tail_fraction = 0.2 is read only"),
    ({"federation.weight_average": "ema", "model.name": "coxph"}, "weight_average = 'ema'.*coxph"),
    ({"federation.weight_average": "tail", "strategy.name": "split", "data.name": "synthetic_multimodal"},
     "weight_average = 'tail'.*'split'"),
])
def test_a_key_the_run_would_ignore_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        resolve(overrides)


def _observed_run(overrides):
    """Run ``overrides``; return the summary and, by round, the arrays of the train messages and of the evaluate
    messages (one list per round)."""
    sent = {"train": {}, "evaluate": {}}

    def observe(message, reply):
        kind = message.metadata.message_type
        if kind in sent and "arrays" in message.content:
            arrays = {key: values(array).copy() for key, array in message.content["arrays"].items()}
            server_round = int(message.content["config"]["server-round"])
            sent[kind].setdefault(server_round, []).append(arrays)
            if message.content["config"].get(CARRIED_EVALUATION) is True:  # it asks for the previous round's too
                sent["evaluate"].setdefault(server_round - 1, []).append(arrays)

    return run_inprocess(overrides, observe=observe), sent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plain_dir, ema_dir = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("ema")
    plain = _observed_run({**RUN, "output.dir": str(plain_dir)})
    ema = _observed_run({**RUN, **EMA, "output.dir": str(ema_dir)})
    return (plain_dir, *plain), (ema_dir, *ema)


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[key], b[key]) for key in a)


def test_the_evaluated_and_saved_model_is_the_ema_of_the_global_models(runs):
    _, (directory, summary, sent) = runs
    checkpoint = torch.load(directory / "checkpoint.pt", weights_only=False)
    # the global model after round t is what round t + 1's train messages carry; the last one is in the checkpoint
    iterates = [sent["train"][t + 1][0] for t in range(1, ROUNDS)]
    iterates.append({key: tensor.numpy() for key, tensor in checkpoint["strategy"]["iterate"].items()})
    for t in range(1, ROUNDS + 1):
        weights = np.array([(1 - DECAY) * DECAY ** (t - s) for s in range(1, t + 1)])
        weights /= weights.sum()
        for evaluated in sent["evaluate"][t]:
            for key, value in evaluated.items():
                expected = sum(w * iterates[s][key].astype(np.float64) for s, w in enumerate(weights))
                np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    saved = torch.load(directory / "model.pt", weights_only=False)["state_dict"]
    final = sent["evaluate"][ROUNDS][0]
    assert _same({key: tensor.numpy() for key, tensor in saved.items()}, final)
    assert _same({key: tensor.numpy() for key, tensor in checkpoint["arrays"].items()}, final)
    assert not _same(final, iterates[-1])
    assert summary["test"]["c_index"] > 0.5


def test_averaging_changes_no_training_message_nor_the_ledger(runs):
    (plain_dir, plain, plain_sent), (ema_dir, ema, ema_sent) = runs
    assert plain_sent["train"].keys() == ema_sent["train"].keys() == set(range(1, ROUNDS + 1))
    for t in plain_sent["train"]:
        assert len(plain_sent["train"][t]) == len(ema_sent["train"][t]) == 3
        assert all(_same(a, b) for a, b in zip(plain_sent["train"][t], ema_sent["train"][t], strict=True))
    ledgers = [(path / "ledger.jsonl").read_text(encoding="utf-8") for path in (plain_dir, ema_dir)]
    assert ledgers[0] == ledgers[1] and ledgers[0]
    trains = [[json.loads(line)["train"] for line in (path / "metrics.jsonl").read_text().splitlines()]
              for path in (plain_dir, ema_dir)]
    assert trains[0] == trains[1]
    assert plain["privacy"] == ema["privacy"]
    # the round-1 average is the round-1 model; later the evaluated models differ
    assert _same(plain_sent["evaluate"][1][0], ema_sent["evaluate"][1][0])
    assert not _same(plain_sent["evaluate"][ROUNDS][0], ema_sent["evaluate"][ROUNDS][0])


def test_a_resumed_run_keeps_the_average(runs, tmp_path):
    _, (full_dir, full, full_sent) = runs
    with pytest.raises(RunStopped):
        run_inprocess({**RUN, **EMA, "output.dir": str(tmp_path), "debug.stop_after_round": 2})
    resumed, sent = _observed_run({**RUN, **EMA, "resume.from": str(tmp_path)})
    assert resumed["resumed_after_round"] == 2
    for t in (3, 4):
        assert all(_same(a, b) for a, b in zip(sent["train"][t], full_sent["train"][t], strict=True))
        assert all(_same(a, b) for a, b in zip(sent["evaluate"][t], full_sent["evaluate"][t], strict=True))
    models = [torch.load(path / "model.pt", weights_only=False)["state_dict"] for path in (tmp_path, full_dir)]
    assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])
    assert resumed["test"] == pytest.approx(full["test"], rel=1e-9)
