"""The one accountant interface (strategies.accounting.interface) and the one calibration solver
(strategies.accounting.calibration): every stateful accountant composes, reports and survives a checkpoint the
same way, and every calibration meets its contract."""

import math

import numpy as np
import pytest

from strategies.accounting.bayesian_dp import BayesianAccountant
from strategies.accounting.calibration import calibrate_noise
from strategies.accounting.distributed_dp import DistributedAccountant, ddg_epsilon
from strategies.accounting.filter import RenyiFilter
from strategies.accounting.interface import Accountant
from strategies.accounting.rdp import SiteAccountant, calibrate_noise_multiplier, epsilon_from_history
from strategies.mechanisms.schedules import calibrate_gaussian_noise_multiplier


def _accountants():
    rng = np.random.default_rng(0)
    return [
        (SiteAccountant("rdp"), dict(noise_multiplier=3.0, sample_rate=0.1, num_steps=50)),
        (RenyiFilter(epsilon=10.0, delta=1e-5), dict(noise_multiplier=3.0, sample_rate=0.1, num_steps=50)),
        (DistributedAccountant(prior=[(8.0, 1.0, 1)]),
         dict(l2=1000.0, l1=5000.0, local_sigma=20000.0, parties=3, dim=100)),
        (BayesianAccountant(), dict(sample_rate=0.1, noise_std=3.0, total_steps=50,
                                    distances=rng.uniform(0.0, 1.0, 64), num_steps=50)),
    ]


@pytest.mark.parametrize("index", range(4))
def test_every_stateful_accountant_composes_reports_and_survives_a_checkpoint_the_same_way(index):
    accountant, release = _accountants()[index]
    assert isinstance(accountant, Accountant)
    before = accountant.epsilon(1e-5)
    accountant.step(**release)
    after = accountant.epsilon(1e-5)
    assert after > before and math.isfinite(after)
    restored = type(accountant).from_state_dict(accountant.state_dict())
    assert restored.epsilon(1e-5) == pytest.approx(after, rel=1e-12)


def test_the_distributed_accountant_is_the_composition_of_its_releases():
    accountant = DistributedAccountant(prior=[(8.0, 1.0, 1)])
    releases = [(1000.0, 5000.0, 20000.0, 3, 100), (1000.0, 5000.0, 25000.0, 2, 100)]
    for l2, l1, sigma, parties, dim in releases:
        accountant.step(l2=l2, l1=l1, local_sigma=sigma, parties=parties, dim=dim)
    assert accountant.epsilon(1e-5) == ddg_epsilon(releases=releases, delta=1e-5, prior=[(8.0, 1.0, 1)])


def test_the_solver_meets_its_contract_and_says_when_no_noise_does():
    sigma = calibrate_noise(lambda s: 2.0 / s ** 2, 0.013, tolerance=1e-6)
    assert 0.013 - 1e-6 <= 2.0 / sigma ** 2 <= 0.013
    with pytest.raises(ValueError, match="no noise multiplier up to 1e7"):
        calibrate_noise(lambda s: 1.0 + 1.0 / s, 0.5, tolerance=1e-3)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 8.0])
def test_every_calibration_spends_just_below_its_target(epsilon):
    prior = ((30.0, 1.0, 1),)
    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=0.05, steps=300,
                                       accountant="rdp", prior=prior)
    spent = epsilon_from_history([*prior, (sigma, 0.05, 300)], delta=1e-5)
    assert epsilon - 0.01 <= spent <= epsilon
    z = calibrate_gaussian_noise_multiplier(epsilon=epsilon, delta=1e-5, releases=20)
    from strategies.accounting.rdp import epsilon_gaussian_rounds
    from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS

    spent = epsilon_gaussian_rounds(noise_multiplier=z, rounds=20, delta=1e-5, orders=list(AUDIT_RDP_ORDERS))
    assert epsilon * (1 - 1e-6) <= spent <= epsilon
