"""Classical (worst-case) privacy accounting for DP-SGD and for client-level central DP.

Everything here delegates the mathematics to opacus and dp-accounting: the Rényi-DP of the
Poisson-subsampled Gaussian mechanism (``opacus.accountants.analysis.rdp``), its conversion to
``(ε, δ)``, the PRV accountant (numerical composition of privacy loss random variables), the
noise calibration ``opacus.accountants.utils.get_noise_multiplier``, and dp-accounting's PLD
accountant (:mod:`strategies.accounting.pld`: the tightest of the three). This module adds only
validation, a per-site stateful wrapper that survives checkpoints, and names for what is
protected.

Which accountant
----------------
``"rdp"``: Rényi DP converted to ``(ε, δ)`` (Balle et al. 2020); an upper bound that loses about
10 % of ε at this project's budgets, but additive over adaptively chosen releases, which makes
it the accountant of a site's privacy filter. ``"prv"``: opacus' PRV accountant, an upper bound
from its error bound. ``"pld"``: dp-accounting's ``PLDAccountant`` with pessimistic
(connect-the-dots) discretisation, an upper bound within about ``1e-3`` of the exact ε of the
composition (:mod:`strategies.accounting.pld`).

Adjacency and unit
------------------
opacus' analysis of the Poisson-subsampled Gaussian mechanism is for **add/remove-one**
neighbouring datasets: one record (``unit = "record"``) is present or absent, its clipped
gradient has norm at most ``C`` and the noise on the *sum* of clipped gradients has standard
deviation ``σ·C``. Under replace-one adjacency the sensitivity of the sum doubles (``2C``); the
figures here are **not** replace-one figures.

For Flower's client-level central DP (:func:`epsilon_gaussian_rounds`) the unit is a whole site:
each site's clipped update has norm at most ``C`` and the server adds ``N(0, σ²C²)`` to the sum
(Flower's ``DifferentialPrivacyServerSideFixedClipping`` adds ``σC/m`` to the mean of ``m``
updates, which is the same mechanism).

opacus is imported on first use, not with this module: importing it costs about a second, which
every process of a simulation (each Ray actor) would otherwise pay even in a run without DP.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from strategies.accounting.calibration import calibrate_noise
from strategies.validation import check_count, check_positive, check_probability, check_sample_rate

AccountantName = Literal["rdp", "prv", "pld"]

#: Orders used for the RDP → (ε, δ) conversion: opacus' default grid
#: (``RDPAccountant.DEFAULT_ALPHAS``: 1.1, 1.2, …, 10.9, then 12, 13, …, 63; a test keeps them equal).
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

_ACCOUNTANTS: tuple[str, ...] = ("pld", "prv", "rdp")


@functools.cache
def opacus_rdp_analysis() -> ModuleType:
    """opacus' ``accountants/analysis/rdp.py``: the RDP of the subsampled Gaussian and its conversion to (ε, δ).

    Imported as ``opacus.accountants.analysis.rdp`` it runs ``opacus/__init__.py`` first, which imports the
    privacy engine, its optimisers and ``torch.distributed`` (about 2 s on 2 cores), none of which the accounting
    uses; a deployed site pays that for every message, each handled in a new process. The module itself imports
    only math, numpy and scipy, so the installed file is loaded on its own (the same code, the same floats); the
    package's module is returned when opacus is already imported.
    """
    name = "opacus.accountants.analysis.rdp"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("opacus")  # locates the package without importing it
    if package is None or package.origin is None:
        raise ModuleNotFoundError("opacus is not installed")
    path = Path(package.origin).parent / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location("fedsurv_opacus_rdp_analysis", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rdp_to_epsilon(orders: Sequence[float], rdp: Any, *, delta: float) -> float:
    """ε at ``delta`` of the RDP curve ``rdp`` over ``orders``: opacus' ``get_privacy_spent`` (Balle et al. 2020).

    Where the best order is an end of the grid, opacus warns that a wider grid could be tighter;
    the figure is still a valid bound, the one an independent recomputation on the same orders
    gives, so the warning is not passed on to the run's output.
    """
    rdp_analysis = opacus_rdp_analysis()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha")
        eps, _ = rdp_analysis.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


def epsilon_floor(delta: float, orders: Sequence[float] = DEFAULT_RDP_ORDERS) -> float:
    r"""The smallest ε that :func:`rdp_to_epsilon` gives at ``delta`` for any RDP curve over ``orders``.

    opacus' conversion is :math:`\varepsilon = \min_\alpha [\mathrm{RDP}(\alpha) + \log((\alpha - 1)/\alpha)
    - (\log \delta + \log \alpha)/(\alpha - 1)]`; as the noise grows the RDP tends to 0 and ε to this floor
    (0.103 at δ = 1e-5 on the default orders, up to 63). A target at or below it is met by no noise multiplier:
    the RDP calibrations then fail (opacus: "The privacy budget is too low.").
    """
    delta = check_probability(delta, "delta")
    return min(math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1) for a in orders if a > 1)


def floor_refusal(*, epsilon: float, delta: float, what: str) -> str:
    """Why ``what`` (an RDP calibration of the run's budget) cannot meet ``privacy.epsilon`` at ``privacy.delta``:
    one line naming the keys and :func:`epsilon_floor`; "" when ε is above the floor. Cheap: no calibration."""
    floor = epsilon_floor(delta)
    if epsilon > floor:
        return ""
    return (f"run config: privacy.epsilon = {epsilon:g} is at or below {floor:.4g}, the smallest epsilon {what} "
            f"certifies at privacy.delta = {delta:g} however large its noise: raise privacy.epsilon above {floor:.3g} "
            "(the noise grows without bound as it nears that: a federation needs well above it) or privacy.delta")


#: What each accountant is called in the ledger (``LedgerEntry.accountant``) and in the texts.
ACCOUNTANT_LABELS: dict[str, str] = {"pld": "dp-accounting-pld", "prv": "opacus-prv", "rdp": "opacus-rdp"}
ACCOUNTANT_NAMES: dict[str, str] = {"pld": "dp-accounting PLD", "prv": "opacus PRV", "rdp": "opacus RDP"}


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def subsampled_gaussian_rdp(*, sample_rate: float, noise_multiplier: float, steps: int,
                            orders: Sequence[float]) -> Any:
    """RDP at ``orders`` of ``steps`` Poisson-subsampled Gaussian steps (σ, q): opacus' ``compute_rdp``.

    opacus' value is ``steps`` times one step's, computed order by order by a series that is slow at
    fractional orders and small σ (a second per call); one step's vector is memoised per ``(q, σ, orders)``,
    so a ledger that recomputes ε every round pays it once. The result equals ``compute_rdp``'s bit for bit.
    """
    return _step_rdp(float(sample_rate), float(noise_multiplier), tuple(float(a) for a in orders)) * int(steps)


@functools.lru_cache(maxsize=1024)
def _step_rdp(sample_rate: float, noise_multiplier: float, orders: tuple[float, ...]) -> Any:
    rdp = opacus_rdp_analysis().compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                            orders=list(orders))
    rdp.flags.writeable = False
    return rdp


def _check_accountant(accountant: str) -> str:
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {sorted(_ACCOUNTANTS)}, got {accountant!r}")
    return accountant


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------


def epsilon_from_history(
    history: list[tuple[float, float, int]], *, delta: float, accountant: AccountantName = "rdp",
    orders: tuple[float, ...] | list[float] | None = None,
) -> float:
    r"""ε spent by a composition of Poisson-subsampled Gaussian mechanisms.

    Parameters
    ----------
    history : list of (noise_multiplier, sample_rate, num_steps)
        Each entry is ``num_steps`` applications of the mechanism that adds ``N(0, σ²C²)`` to the
        sum of per-record gradients clipped to ``C``, each record included independently with
        probability ``q``.
    delta : float
        Target δ in (0, 1).
    accountant : {"rdp", "prv", "pld"}
        ``"rdp"``: ``ε = min_α [Σ_t RDP_α(σ_t, q_t) + log((α−1)/α) − (log δ + log α)/(α−1)]``
        (opacus' conversion); ``"prv"``: the upper bound of the PRV accountant; ``"pld"``:
        dp-accounting's PLD accountant (:func:`strategies.accounting.pld.pld_epsilon`).
    orders : sequence of float, optional
        RDP orders α (only for ``"rdp"``); opacus' default grid when omitted.

    Returns
    -------
    float
        ε under add/remove-one adjacency; ``0.0`` for an empty history.

    References
    ----------
    Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism",
    arXiv:1908.10530 (2019); Balle et al., "Hypothesis Testing Interpretations and Rényi
    Differential Privacy", AISTATS 2020 (conversion); Gopi, Lee, Wutschitz, "Numerical
    Composition of Differential Privacy", NeurIPS 2021 (PRV); Doroshenko et al., "Connect the
    Dots", PETS 2022 (PLD).
    """
    delta = check_probability(delta, "delta")
    _check_accountant(accountant)
    if not history:
        return 0.0
    if accountant == "pld":
        if orders is not None:
            raise ValueError("orders only apply to the 'rdp' accountant")
        from strategies.accounting.pld import pld_epsilon

        return pld_epsilon(history, delta=delta)
    for noise_multiplier, sample_rate, num_steps in history:
        check_positive(noise_multiplier, "noise_multiplier")
        check_sample_rate(sample_rate)
        check_count(num_steps, "num_steps")
    if accountant == "rdp":
        alphas = list(DEFAULT_RDP_ORDERS if orders is None else orders)
        rdp = sum(subsampled_gaussian_rdp(sample_rate=q, noise_multiplier=s, steps=n, orders=alphas)
                  for s, q, n in history)
        return rdp_to_epsilon(alphas, rdp, delta=delta)
    if orders is not None:
        raise ValueError("orders only apply to the 'rdp' accountant")
    return _prv_epsilon(history, delta=delta)


def _prv_epsilon(history: Sequence[tuple[float, float, int]], *, delta: float) -> float:
    """The upper bound of opacus' PRV accountant on ε at ``delta`` of a checked, non-empty ``history``."""
    from opacus.accountants import PRVAccountant

    prv = PRVAccountant()
    prv.history = [(float(s), float(q), int(n)) for s, q, n in history]
    with warnings.catch_warnings():  # its domain comes from an RDP bound, whose grid-end warning says nothing of ε
        warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha")
        return float(prv.get_epsilon(delta=delta))


def calibrate_noise_multiplier(
    *, target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: AccountantName = "rdp",
    epsilon_tolerance: float = 0.01, prior: Sequence[tuple[float, float, int]] = (),
) -> float:
    r"""Smallest noise multiplier (to ``epsilon_tolerance``) meeting ``(ε, δ)`` after ``steps``.

    ``steps`` is the number of noisy steps over **all** local steps of **all** rounds at the
    site; the returned σ satisfies ``target_ε − epsilon_tolerance ≤ ε(σ, q, steps, δ) ≤ target_ε``
    (opacus' bisection on ``σ``, accountant as in :func:`epsilon_from_history`).

    Parameters
    ----------
    target_epsilon, target_delta : float
        The budget; ε > 0, δ in (0, 1).
    sample_rate : float
        Poisson sampling rate ``q = B / n_k`` in (0, 1].
    steps : int
        Total number of noisy steps.
    accountant : {"rdp", "prv", "pld"}
        ``"pld"``: :func:`strategies.accounting.pld.calibrate_pld_noise_multiplier` (the same
        contract, a tighter accountant: a smaller σ).
    epsilon_tolerance : float
        Bisection stops once ``target − ε ≤ epsilon_tolerance``.
    prior : sequence of (noise_multiplier, sample_rate, num_steps)
        Releases made before training that the same accountant composes with it (e.g. the
        federation's set-up statistics, Gaussian releases with ``sample_rate`` 1): σ is then the
        smallest for which ``prior`` plus ``steps`` steps spend at most the target
        (:func:`~strategies.accounting.calibration.calibrate_noise` on :func:`epsilon_from_history`;
        without a prior, opacus' ``get_noise_multiplier``). ``ValueError`` when the prior alone
        spends the target.

    Returns
    -------
    float
        The noise multiplier σ (noise std ``σ·C`` on the sum of clipped gradients).

    References
    ----------
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; Mironov, Talwar, Zhang,
    arXiv:1908.10530 (2019); opacus ``get_noise_multiplier``.
    """
    target_epsilon, target_delta, sample_rate, steps = _checked_calibration(
        target_epsilon, target_delta, sample_rate, steps, accountant=accountant, epsilon_tolerance=epsilon_tolerance)
    if accountant == "pld":
        from strategies.accounting.pld import calibrate_pld_noise_multiplier

        return calibrate_pld_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                              sample_rate=sample_rate, steps=steps, prior=prior,
                                              epsilon_tolerance=epsilon_tolerance)
    if prior:
        return _calibrate_after(prior, target_epsilon=target_epsilon, target_delta=target_delta,
                                sample_rate=sample_rate, steps=steps, accountant=accountant,
                                epsilon_tolerance=epsilon_tolerance)
    if accountant == "rdp":
        return _opacus_rdp_bisection(target_epsilon=target_epsilon, target_delta=target_delta,
                                     sample_rate=sample_rate, steps=steps, epsilon_tolerance=epsilon_tolerance)
    return _opacus_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                    sample_rate=sample_rate, steps=steps, accountant=accountant,
                                    epsilon_tolerance=epsilon_tolerance)


def _checked_calibration(target_epsilon: float, target_delta: float, sample_rate: float, steps: int, *,
                         accountant: str, epsilon_tolerance: float) -> tuple[float, float, float, int]:
    """The checked ``(target_epsilon, target_delta, sample_rate, steps)`` of :func:`calibrate_noise_multiplier`.

    Raises ValueError for an ε that is not finite and > 0, an invalid δ or sample rate, fewer than one step,
    an unknown accountant, or ``epsilon_tolerance <= 0``; TypeError for a step count that is not an integer.
    """
    target_epsilon = float(target_epsilon)
    if not math.isfinite(target_epsilon) or target_epsilon <= 0.0:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    target_delta = check_probability(target_delta, "delta")
    sample_rate = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps")
    _check_accountant(accountant)
    if not epsilon_tolerance > 0.0:
        raise ValueError(f"epsilon_tolerance must be > 0, got {epsilon_tolerance!r}")
    return target_epsilon, target_delta, sample_rate, steps


def _opacus_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                             accountant: str, epsilon_tolerance: float) -> float:
    """opacus' ``get_noise_multiplier`` for ``accountant`` (no prior), as a float."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        # The bracketing phase tries very large σ, whose optimal order is the largest α; the
        # warning opacus emits there says nothing about the returned σ.
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=epsilon_tolerance,
        )
    return float(sigma)


#: opacus' bound on the bracketing search of ``get_noise_multiplier`` (``opacus.accountants.utils.MAX_SIGMA``).
_OPACUS_MAX_SIGMA = 1e6


def _opacus_rdp_bisection(*, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                          epsilon_tolerance: float) -> float:
    """opacus' ``get_noise_multiplier(accountant="rdp")``, step for step and float for float (a test compares them),
    over :func:`opacus_rdp_analysis` instead of opacus' ``RDPAccountant``, whose import costs a deployed site 2 s a
    message. Doubling from 20 until ε ≤ target, then bisection until ε is within the tolerance below it."""
    def epsilon(sigma: float) -> float:
        return epsilon_from_history([(sigma, sample_rate, steps)], delta=target_delta, accountant="rdp")

    eps_high, sigma_low, sigma_high = float("inf"), 0.0, 10.0
    while eps_high > target_epsilon:
        sigma_high = 2 * sigma_high
        eps_high = epsilon(sigma_high)
        if sigma_high > _OPACUS_MAX_SIGMA:
            raise ValueError(f"The privacy budget is too low: privacy.epsilon = {target_epsilon:g} is at or below "
                             f"{epsilon_floor(target_delta):.4g}, the smallest epsilon RDP accounting certifies at delta "
                             f"{target_delta:g} however large the noise; raise privacy.epsilon (or privacy.delta)")
    while target_epsilon - eps_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        eps = epsilon(sigma)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return float(sigma_high)


def _calibrate_after(
    prior: Sequence[tuple[float, float, int]], *, target_epsilon: float, target_delta: float, sample_rate: float,
    steps: int, accountant: AccountantName, epsilon_tolerance: float,
) -> float:
    """:func:`calibrate_noise_multiplier` with releases before training (see its ``prior``)."""
    prior = [entry for entry in prior if math.isfinite(entry[0])]  # an exact release of nothing sensitive is free
    spent = epsilon_from_history(list(prior), delta=target_delta, accountant=accountant) if prior else 0.0
    if spent >= target_epsilon:
        raise ValueError(f"the releases before training alone spend epsilon {spent:.4g} of the target "
                         f"{target_epsilon:g}: nothing is left for training")

    def epsilon(sigma: float) -> float:
        return epsilon_from_history([*prior, (sigma, sample_rate, steps)], delta=target_delta, accountant=accountant)

    return calibrate_noise(epsilon, target_epsilon, tolerance=epsilon_tolerance)


def epsilon_gaussian_rounds(
    *,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    sample_rate: float = 1.0,
    orders: tuple[float, ...] | list[float] | None = None,
) -> float:
    r"""ε of client-level central DP (a whole site is the unit) after ``rounds`` rounds.

    Each round the server adds ``N(0, σ²C²)`` to the sum of the sites' updates, each clipped to
    ``C``. With ``sample_rate = 1`` (every site every round) there is **no** amplification and
    the per-round RDP is that of the Gaussian mechanism, ``RDP_α = α / (2σ²)``, composed over
    ``rounds``; with sites Poisson-sampled at rate ``q < 1`` opacus' subsampled-Gaussian RDP
    applies. Adjacency: add/remove one site.

    Parameters
    ----------
    noise_multiplier : float
        σ, noise std relative to the clipping norm ``C`` of a site's update.
    rounds : int
        Number of rounds in which the site took part (or could have, when sampled).
    delta : float
        Target δ in (0, 1).
    sample_rate : float
        Probability that a site is sampled in a round (default 1: no amplification).
    orders : sequence of float, optional
        RDP orders; opacus' default grid when omitted.

    Returns
    -------
    float
        ε (RDP accountant, opacus conversion).

    References
    ----------
    McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018
    (client-level DP); Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP);
    Mironov, Talwar, Zhang, arXiv:1908.10530 (2019).
    """
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    rounds = check_count(rounds, "rounds")
    sample_rate = check_sample_rate(sample_rate)
    return epsilon_from_history(
        [(noise_multiplier, sample_rate, rounds)], delta=delta, accountant="rdp", orders=orders
    )


# --------------------------------------------------------------------------------------------
# stateful accountant
# --------------------------------------------------------------------------------------------


class SiteAccountant:
    r"""Record-level DP-SGD accountant for one site, kept across rounds.

    A thin wrapper over :func:`epsilon_from_history` (opacus' RDP or PRV, dp-accounting's PLD): the history is a list of
    ``(σ, q, num_steps)`` for the Poisson-subsampled Gaussian mechanism (noise ``N(0, σ²C²)`` on
    the sum of per-record gradients clipped to ``C``). Entries with the same ``(σ, q)`` are merged
    (composition is commutative), so a site that runs many rounds with one setting keeps one
    entry. Adjacency is add/remove one record.

    Parameters
    ----------
    accountant : {"rdp", "prv", "pld"}
        Which accountant turns the history into ε.

    Attributes
    ----------
    adjacency : str
        ``"add-remove"``.
    unit : str
        ``"record"``.

    References
    ----------
    Mironov, Talwar, Zhang, arXiv:1908.10530 (2019) (RDP); Gopi, Lee, Wutschitz, NeurIPS 2021
    (PRV).
    """

    adjacency: str = "add-remove"
    unit: str = "record"

    def __init__(self, accountant: AccountantName = "rdp") -> None:
        self.mechanism: str = _check_accountant(accountant)
        self.history: list[tuple[float, float, int]] = []

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` noisy steps with noise multiplier σ and sampling rate q."""
        noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
        sample_rate = check_sample_rate(sample_rate)
        num_steps = check_count(num_steps, "num_steps")
        for index, (sigma, q, count) in enumerate(self.history):
            if sigma == noise_multiplier and q == sample_rate:
                self.history[index] = (sigma, q, count + num_steps)
                return
        self.history.append((noise_multiplier, sample_rate, num_steps))

    @property
    def spent_steps(self) -> int:
        """Total number of noisy steps recorded."""
        return sum(count for _, _, count in self.history)

    def __len__(self) -> int:
        return self.spent_steps

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (see :func:`epsilon_from_history`)."""
        return epsilon_from_history(self.history, delta=delta, accountant=self.mechanism)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON-serialisable) for checkpoints and Flower's ``context.state``."""
        return {
            "mechanism": self.mechanism,
            "adjacency": self.adjacency,
            "unit": self.unit,
            "history": [[float(s), float(q), int(n)] for s, q, n in self.history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the restored accountant reports the same ε."""
        if "history" not in state_dict:
            raise KeyError("state_dict has no 'history'")
        mechanism = state_dict.get("mechanism", self.mechanism)
        if mechanism != self.mechanism:
            raise ValueError(
                f"state_dict is for a {mechanism!r} accountant, this one is {self.mechanism!r}"
            )
        history: list[tuple[float, float, int]] = []
        for entry in state_dict["history"]:
            if len(entry) != 3:
                raise ValueError(f"history entries are (sigma, q, steps), got {entry!r}")
            sigma, q, count = entry
            history.append(
                (
                    check_positive(sigma, "noise_multiplier"),
                    check_sample_rate(q),
                    check_count(int(count), "num_steps"),
                )
            )
        self.history = history

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any]) -> SiteAccountant:
        """New accountant restored from :meth:`state_dict`."""
        accountant = cls(state_dict.get("mechanism", "rdp"))
        accountant.load_state_dict(state_dict)
        return accountant

    def __repr__(self) -> str:
        return f"SiteAccountant(accountant={self.mechanism!r}, history={self.history!r})"
