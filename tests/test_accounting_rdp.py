"""Classical accountants: golden values from the issue, opacus / dp-accounting agreement."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.rdp import RdpAccountant

from strategies.accounting.rdp import (
    DEFAULT_RDP_ORDERS,
    SiteAccountant,
    calibrate_noise_multiplier,
    epsilon_from_history,
    epsilon_gaussian_rounds,
    subsampled_gaussian_rdp,
)

DELTA = 1e-5


def _accountant(kind: str, sigma: float, q: float, steps: int) -> SiteAccountant:
    accountant = SiteAccountant(kind)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant


def test_rdp_golden_value() -> None:
    assert round(_accountant("rdp", 1.0, 0.01, 1000).epsilon(DELTA), 4) == 2.1014


def test_prv_golden_value() -> None:
    assert round(_accountant("prv", 1.0, 0.01, 1000).epsilon(DELTA), 4) == 1.8384


def test_rdp_golden_value_mnist_setting() -> None:
    assert round(_accountant("rdp", 1.1, 256 / 60000, 14062).epsilon(DELTA), 4) == 2.5966


@pytest.mark.parametrize("orders", [None, DEFAULT_RDP_ORDERS])
def test_google_dp_accounting_agrees(orders: tuple[float, ...] | None) -> None:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 1000
    )
    google = RdpAccountant() if orders is None else RdpAccountant(list(orders))
    google.compose(event)
    ours = _accountant("rdp", 1.0, 0.01, 1000).epsilon(DELTA)
    assert round(google.get_epsilon(DELTA), 4) == round(ours, 4) == 2.1014


def test_default_orders_are_opacus_default_grid() -> None:
    from opacus.accountants import RDPAccountant

    assert DEFAULT_RDP_ORDERS == tuple(RDPAccountant.DEFAULT_ALPHAS)


@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.1, 1.3, 77), (0.5, 0.6, 3), (1.0, 7.4, 1)])
def test_memoised_rdp_is_opacus_compute_rdp_bit_for_bit(q: float, sigma: float, steps: int) -> None:
    import numpy as np
    from opacus.accountants.analysis import rdp as rdp_analysis

    expected = rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(DEFAULT_RDP_ORDERS))
    for _ in range(2):  # computed, then from the memo
        assert np.array_equal(subsampled_gaussian_rdp(sample_rate=q, noise_multiplier=sigma, steps=steps,
                                                      orders=DEFAULT_RDP_ORDERS), expected)


@pytest.mark.parametrize(("epsilon", "q", "steps"), [(1.0, 1.0, 1), (10.0, 1.0, 1), (0.3, 1.0, 1), (1.0, 0.4, 140),
                                                    (8.0, 0.01, 1000)])
def test_rdp_calibration_is_opacus_get_noise_multiplier_float_for_float(epsilon: float, q: float, steps: int) -> None:
    import sys

    from opacus.accountants.utils import get_noise_multiplier

    ours = calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=q, steps=steps,
                                      accountant="rdp")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # its bracketing's large σ
        assert ours == get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=q, steps=steps,
                                            accountant="rdp")
    assert "opacus" in sys.modules  # imported above: the package's own analysis module is the one used


def test_the_rdp_accounting_runs_without_importing_the_opacus_package() -> None:
    """A deployed site handles each message in a new process: the accounting must not pay opacus' 2 s import."""
    import subprocess
    import sys

    code = ("import sys; from strategies.accounting.rdp import calibrate_noise_multiplier, epsilon_from_history; "
            "s = calibrate_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=1.0, steps=1, "
            "accountant='rdp'); e = epsilon_from_history([(s, 1.0, 1), (1.1, 0.4, 60)], delta=1e-5, accountant='rdp'); "
            "print(s, e, 'opacus' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    sigma, epsilon, imported = float(out[0]), float(out[1]), out[2]
    assert imported == "False"
    assert sigma == calibrate_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=1.0, steps=1,
                                               accountant="rdp")
    assert epsilon == epsilon_from_history([(sigma, 1.0, 1), (1.1, 0.4, 60)], delta=DELTA, accountant="rdp")


def test_steps_compose() -> None:
    split = SiteAccountant()
    split.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    split.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    whole = _accountant("rdp", 1.0, 0.01, 1000)
    assert split.history == [(1.0, 0.01, 1000)]
    assert split.spent_steps == 1000
    assert split.epsilon(DELTA) == whole.epsilon(DELTA)


def test_single_steps_merge_and_mixed_history() -> None:
    accountant = SiteAccountant()
    for _ in range(3):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    accountant.step(noise_multiplier=2.0, sample_rate=0.01)
    accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    assert accountant.history == [(1.0, 0.01, 4), (2.0, 0.01, 1)]
    assert len(accountant) == 5
    expected = epsilon_from_history([(1.0, 0.01, 4), (2.0, 0.01, 1)], delta=DELTA)
    assert accountant.epsilon(DELTA) == expected


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_state_dict_round_trip(kind: str) -> None:
    accountant = SiteAccountant(kind)
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=300)
    accountant.step(noise_multiplier=1.3, sample_rate=0.02, num_steps=200)
    state = json.loads(json.dumps(accountant.state_dict()))
    restored = SiteAccountant(kind)
    restored.load_state_dict(state)
    assert restored.history == accountant.history
    assert restored.epsilon(DELTA) == accountant.epsilon(DELTA)
    assert SiteAccountant.from_state_dict(state).epsilon(DELTA) == accountant.epsilon(DELTA)
    assert state["adjacency"] == "add-remove" and state["unit"] == "record"


def test_state_dict_mechanism_mismatch() -> None:
    state = _accountant("rdp", 1.0, 0.01, 10).state_dict()
    with pytest.raises(ValueError, match="rdp"):
        SiteAccountant("prv").load_state_dict(state)


def test_empty_accountant_spent_nothing() -> None:
    assert SiteAccountant().epsilon(DELTA) == 0.0
    assert SiteAccountant("prv").epsilon(DELTA) == 0.0


def test_adjacency_and_unit() -> None:
    assert SiteAccountant.adjacency == "add-remove"
    assert SiteAccountant.unit == "record"


def test_calibration_round_trip() -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=1.0, target_delta=DELTA, sample_rate=0.01, steps=1000
    )
    epsilon = _accountant("rdp", sigma, 0.01, 1000).epsilon(DELTA)
    assert epsilon <= 1.0
    assert 1.0 - epsilon <= 0.01


def test_calibration_prv() -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=2.0, target_delta=DELTA, sample_rate=0.01, steps=1000, accountant="prv"
    )
    epsilon = _accountant("prv", sigma, 0.01, 1000).epsilon(DELTA)
    assert 2.0 - 0.01 <= epsilon <= 2.0


def test_gaussian_rounds_no_amplification() -> None:
    # q = 1: plain Gaussian mechanism, RDP_α = rounds·α/(2σ²); check against the closed form
    # with opacus' conversion on the same orders.
    sigma, rounds = 2.0, 10
    orders = [2.0, 4.0, 8.0, 16.0, 32.0]
    expected = min(
        rounds * a / (2 * sigma**2) + math.log((a - 1) / a) - (math.log(DELTA) + math.log(a)) / (a - 1)
        for a in orders
    )
    got = epsilon_gaussian_rounds(noise_multiplier=sigma, rounds=rounds, delta=DELTA, orders=orders)
    assert got == pytest.approx(expected, rel=1e-9)
    # sampling sites amplifies
    sampled = epsilon_gaussian_rounds(noise_multiplier=sigma, rounds=rounds, delta=DELTA, sample_rate=0.1)
    assert sampled < epsilon_gaussian_rounds(noise_multiplier=sigma, rounds=rounds, delta=DELTA)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"noise_multiplier": 0.0, "sample_rate": 0.1}, ValueError),
        ({"noise_multiplier": 1.0, "sample_rate": 0.0}, ValueError),
        ({"noise_multiplier": 1.0, "sample_rate": 1.5}, ValueError),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "num_steps": 0}, ValueError),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "num_steps": 1.5}, TypeError),
    ],
)
def test_step_validation(kwargs: dict[str, float], error: type[Exception]) -> None:
    with pytest.raises(error):
        SiteAccountant().step(**kwargs)


def test_other_validation() -> None:
    with pytest.raises(ValueError):
        SiteAccountant("gdp")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _accountant("rdp", 1.0, 0.01, 10).epsilon(0.0)
    with pytest.raises(ValueError):
        calibrate_noise_multiplier(target_epsilon=-1.0, target_delta=DELTA, sample_rate=0.01, steps=10)
    with pytest.raises(ValueError):
        epsilon_gaussian_rounds(noise_multiplier=1.0, rounds=0, delta=DELTA)
