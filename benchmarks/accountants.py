"""The noise that RDP and PLD calibration give at the same budget, and what each accountant says of it.

``python -m benchmarks.accountants``

FLCHAIN at the defaults (5 i.i.d. sites, seed 0, the private set-up at ``privacy.setup_share``),
δ = 1e-5, ε = 1 and 10:

* ``dp_sgd`` (its recipe: 20 rounds of 3 local epochs at expected batch 512): the site with the
  smallest agreed count (the largest sampling rate, the most noise), its set-up releases composed
  before training;
* ``central_dp``: Gaussian rounds at the site level (q = 1), 20 rounds (its default) and 60;
* ``distributed_dp`` (its recipe: 60 rounds): the noise multiplier z of the distributed discrete
  Gaussian from Kairouz, Liu & Steinke's RDP bound, the one the strategy uses. PLD is not offered
  for it (the sum of discrete Gaussians is not a Gaussian); the row shows, for reference only,
  the PLD ε that a *continuous* Gaussian of the same z and the set-up would have (not a bound
  on the strategy's ε) and the z such a Gaussian would need.

For each: σ calibrated by RDP, σ calibrated by PLD (what the default now runs), the ratio, the
PLD ε of the RDP-calibrated σ and the RDP ε of the PLD-calibrated σ (what the ledger shows as
``epsilon_rdp``), and the seconds the PLD calibration took (cold cache, this machine).
"""

from __future__ import annotations

import time

from strategies.accounting.distributed_dp import ddg_epsilon
from strategies.accounting.rdp import calibrate_noise_multiplier, epsilon_from_history

DELTA = 1e-5
EPSILONS = (1.0, 10.0)


def _row(name: str, epsilon: float, rdp_sigma: float, pld_sigma: float | None, history, seconds: float | None,
         note: str = "") -> str:
    """One table row: ``history(σ)`` is the accountant history of the mechanism at noise multiplier σ."""
    pld_of_rdp = epsilon_from_history(history(rdp_sigma), delta=DELTA, accountant="pld")
    if pld_sigma is None:
        return (f"| {name} | {epsilon:g} | {rdp_sigma:.4f} | n/a | | {pld_of_rdp:.4f}{note} | n/a | |")
    rdp_of_pld = epsilon_from_history(history(pld_sigma), delta=DELTA, accountant="rdp")
    return (f"| {name} | {epsilon:g} | {rdp_sigma:.4f} | {pld_sigma:.4f} | {pld_sigma / rdp_sigma:.3f} | "
            f"{pld_of_rdp:.4f}{note} | {rdp_of_pld:.4f} | {seconds:.2f} |")


def _calibrate(epsilon: float, rate: float, steps: int, prior, accountant: str) -> tuple[float, float]:
    start = time.perf_counter()
    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=rate, steps=steps,
                                       accountant=accountant, prior=prior)
    return sigma, time.perf_counter() - start


def dp_sgd_rows() -> list[str]:
    from flwr_app import task
    from simulations.engine import resolve
    from strategies.mechanisms.setup_share import setup_multiplier
    from strategies.mechanisms.dp_sgd import poisson_schedule

    rows = []
    for epsilon in EPSILONS:
        cfg = resolve({"strategy.name": "dp_sgd", "privacy.epsilon": epsilon})[1]
        site = min(task.federation_setup(cfg).setups.values(), key=lambda setup: setup.count)
        rate, steps = poisson_schedule(site.count, batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
        steps *= cfg.federation.rounds
        prior = tuple(site.prior)
        rdp, _ = _calibrate(epsilon, rate, steps, prior, "rdp")
        pld, seconds = _calibrate(epsilon, rate, steps, prior, "pld")
        name = f"dp_sgd (n = {site.count:g}, q = {rate:.3f}, {steps} steps, set-up z = {setup_multiplier(cfg):.3g})"
        rows.append(_row(name, epsilon, rdp, pld, lambda s: [*prior, (s, rate, steps)], seconds))
    return rows


def central_dp_rows() -> list[str]:
    rows = []
    for rounds in (20, 60):
        for epsilon in EPSILONS:
            rdp, _ = _calibrate(epsilon, 1.0, rounds, (), "rdp")
            pld, seconds = _calibrate(epsilon, 1.0, rounds, (), "pld")
            rows.append(_row(f"central_dp ({rounds} rounds)", epsilon, rdp, pld,
                             lambda s, r=rounds: [(s, 1.0, r)], seconds))
    return rows


def distributed_dp_rows() -> list[str]:
    from flwr_app import task
    from simulations.engine import resolve
    from strategies.mechanisms.registry import get_mechanism

    rows = []
    for epsilon in EPSILONS:
        cfg = resolve({"strategy.name": "distributed_dp", "privacy.epsilon": epsilon})[1]
        dataset = task.load_federation(cfg)
        dim = sum(p.numel() for p in task.build_model(cfg, dataset).net.parameters())
        setups = task.federation_setup(cfg).setups
        site = max(setups.values(), key=lambda setup: len(setup.prior))
        plan = get_mechanism("distributed_dp").plan(cfg, parties=len(setups), dim=dim, setup=site,
                                                    records=sum(setup.count for setup in setups.values()))
        rounds, prior = cfg.federation.rounds, tuple(site.prior)
        spent = ddg_epsilon(releases=[(plan.l2, plan.l1, plan.local_sigma, plan.honest, plan.dim)] * rounds,
                            delta=DELTA, prior=prior)
        gaussian, _ = _calibrate(epsilon, 1.0, rounds, prior, "pld")
        name = (f"distributed_dp ({rounds} rounds, {plan.honest} honest of {plan.parties}, d = {dim}; DDG RDP "
                f"epsilon {spent:.4f})")
        rows.append(_row(name, epsilon, plan.noise_multiplier, None, lambda s: [*prior, (s, 1.0, rounds)], None,
                         note=f" (continuous Gaussian, not a bound; it would need z = {gaussian:.4f})"))
    return rows


def main() -> None:
    print(f"delta = {DELTA:g}; sigma: noise multiplier (distributed_dp: z); PLD = dp-accounting PLDAccountant, "
          "grid 1e-4, pessimistic")
    print("| mechanism | target epsilon | sigma (RDP) | sigma (PLD) | PLD/RDP | PLD epsilon of sigma (RDP) | "
          "RDP epsilon of sigma (PLD) | PLD calibration (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in [*dp_sgd_rows(), *central_dp_rows(), *distributed_dp_rows()]:
        print(row, flush=True)


if __name__ == "__main__":
    main()
