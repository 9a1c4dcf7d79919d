r"""Distributed DP over secure aggregation (strategy ``distributed_dp``): one DP-SGD step on the union per round.

Round structure: every round is **one full-batch noisy gradient step on the union of the selected
sites' training records, at the global model** (sampling rate 1: no amplification is claimed).
Each site

1. computes every training record's gradient of the hazard model's loss at the global model, clips
   it to :math:`C` (``privacy.clip_norm``), scales it by :math:`\gamma` and rounds it coordinate-wise
   to integers, so one record's integer contribution has L2 norm at most
   :math:`\Delta = \gamma C + \sqrt d / 2` (:math:`\lVert \mathrm{round}(v) \rVert \le \lVert v \rVert +
   \lVert \mathrm{round}(v) - v \rVert`);
2. adds discrete Gaussian noise :math:`N_{\mathbb Z}(0, s^2)` per coordinate with
   :math:`s^2 = (z\Delta)^2 / (k - D - t)`, ``k`` the sites selected this round, ``D`` the tolerated
   drop-outs (``privacy.max_dropouts``), ``t`` the colluding sites (``privacy.colluding_sites``);
3. sends the integer vector masked by SecAgg+ (:mod:`strategies.secure_aggregation`).

The server unmasks only the sum (it refuses to unmask when fewer than ``k - D`` vectors came),
divides it by :math:`\gamma` and by the agreed record count of the included sites, and takes one
Adam step with learning rate ``train.lr`` (its optimiser state stays at the server:
post-processing). Any ``k - D - t`` honest survivors' noise sums to variance at least
:math:`(z\Delta)^2`; accounting (:mod:`strategies.accounting.distributed_dp`): the distributed
discrete Gaussian of Kairouz, Liu & Steinke (2021), Proposition 14, with ``k - D - t`` parties,
composed over rounds by RDP. Modular wrap-around: the server sees the sum mod :math:`M` (post-
processing of the integer sum); :math:`\gamma` is the largest scale for which wrap-around has
probability at most :data:`WRAP_PROBABILITY` per round (:func:`round_plan`).

Why one step per round: the released sum is then exactly the noisy clipped gradient sum of DP-SGD
on the union with :math:`q = 1`, so its sensitivity is one record's clipped gradient whichever site
holds it; several local steps would make a site's later gradients depend on its own earlier noise
and records, and the sum would no longer be one Gaussian-mechanism release.

No torch here: the site's numerics and the server's step are
:mod:`strategies.mechanisms.distributed_dp_training`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from strategies.accounting.calibration import calibrate_noise
from strategies.accounting.distributed_dp import DistributedAccountant, ddg_epsilon, ddg_tau, l1_bound
from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import epsilon_from_history
from strategies.config import ConfigError, ExperimentConfig
from strategies.mechanisms.base import SecureSumMechanism, SiteSetUp, horizontal_manifest
from strategies.mechanisms.manifest import Manifest, ReleasedValue, record_level_closing, setup_sentence
from strategies.mechanisms.setup_share import recalibrates, recalibration_multiplier
from strategies.mechanisms.discrete_gaussian import sample_discrete_gaussian
from strategies.mechanisms.dp_sgd import require_decomposable_loss

__all__ = ["REFUSAL_PROBABILITY", "DistributedDP", "RoundPlan", "SumBound", "WRAP_PROBABILITY", "count_std",
           "gaussian_bound", "gaussian_sum_contribution", "gaussian_sum_plan", "power_sum_contribution", "power_sum_plan", "round_plan"]

#: The largest probability that a round's integer sum wraps around the modulus (the choice of gamma).
WRAP_PROBABILITY = 1e-9
#: The record count the wrap-around bound allows for: this many times the agreed count, plus :data:`RECORD_SLACK`
#: (the agreed count is noisy under a private set-up).
RECORD_MARGIN = 2.0
RECORD_SLACK = 1000.0
#: The largest probability that the sum check refuses an honest round (the record-count tail, the noise's norm tail
#: and its coordinate tail each contribute at most a third of it).
REFUSAL_PROBABILITY = 1e-9


@dataclass(frozen=True)
class SumBound:
    """What the unmasked sum of an honest round cannot exceed, but with probability :data:`REFUSAL_PROBABILITY`.

    ``records``: the most training records the included sites can hold; ``data``: ``records * Delta``,
    the most their rounded clipped gradients can sum to in L2 norm; ``noise``: the noise sum's L2 tail;
    ``norm = data + noise``; ``coordinate``: the bound on every coordinate's absolute value.
    """

    records: float
    data: float
    noise: float
    norm: float
    coordinate: float


def count_std(prior: Sequence[tuple[float, float, int]]) -> float:
    """An upper bound on the noise standard deviation of a site's agreed record count, from its set-up history.

    The count is one of the set-up's Gaussian releases, of sensitivity 1 (add/remove), so its noise
    multiplier is its standard deviation; the largest multiplier in ``prior`` is at least that
    (0 for an exact set-up, whose counts are exact).
    """
    return max((float(z) for z, _, _ in prior), default=0.0)


@dataclass(frozen=True)
class RoundPlan:
    """The public parameters of one round (the same at every site and at the server).

    ``parties``: sites selected (k); ``honest``: k - D - t, the parties the accountant counts;
    ``records``: the agreed training-record count of the selected sites; ``dim``: model size d;
    ``modulus``: M; ``gamma``: the scale; ``l2``/``l1``: one record's sensitivity of the integer sum
    (Δ and its L1 bound); ``noise_multiplier``: z; ``local_sigma``: s.
    """

    parties: int
    honest: int
    records: float
    dim: int
    modulus: int
    gamma: float
    l2: float
    l1: float
    noise_multiplier: float
    local_sigma: float

    @property
    def record_bound(self) -> float:
        """The record count the wrap-around bound allows for."""
        return RECORD_MARGIN * self.records + RECORD_SLACK

    @property
    def coordinate_bound(self) -> float:
        """Every coordinate of an honest round's integer sum is below this in absolute value, but with
        probability :data:`WRAP_PROBABILITY` (data part plus the noise's sub-Gaussian tail)."""
        return self.record_bound * (self.l2 - math.sqrt(self.dim) / 2 + 0.5) + _tail(self) * self.l2

    @property
    def norm_bound(self) -> float:
        """An honest round's integer sum has L2 norm below this, but with probability :data:`WRAP_PROBABILITY`:
        at most ``record_bound`` records of norm Delta, plus noise below ``tail * Delta`` in every coordinate."""
        return self.record_bound * self.l2 + math.sqrt(self.dim) * _tail(self) * self.l2

    def sum_bound(self, *, records: float, sites: int, count_std: float = 0.0) -> SumBound:
        r"""The bound of an honest round's unmasked (centred) integer sum over ``sites`` included sites.

        ``records``: their agreed record count; ``count_std``: the noise standard deviation of one
        site's agreed count (0 when counts are exact). With :math:`p` = :data:`REFUSAL_PROBABILITY` / 3
        for each of the three tails (record count, noise norm, noise coordinates):

        * records: the true count is at most :math:`n_{\max} = \text{records} + m/2 + \sigma_c
          \sqrt{m}\sqrt{2\ln(1/p)}` (the agreed count is the noisy count rounded, Gaussian noise);
        * data: each record's rounded scaled clipped gradient has L2 norm at most :math:`\Delta = \gamma C
          + \sqrt d/2` and every coordinate at most :math:`\gamma C + 1/2`, so the data part is at most
          :math:`n_{\max}\Delta` in norm (triangle inequality: reached only when every record's gradient
          points the same way at norm :math:`C`);
        * noise: each coordinate of the sum of :math:`m` draws of :math:`N_{\mathbb Z}(0, s^2)` is
          :math:`ms^2`-sub-Gaussian (Canonne, Kamath & Steinke 2020), so :math:`E e^{\lambda X^2} \le
          (1 - 2\lambda m s^2)^{-1/2}` as for a Gaussian, and Laurent & Massart's chi-square tail (2000,
          Lemma 1; its proof uses only that bound) gives :math:`\lVert N \rVert^2 \le ms^2(d + 2\sqrt{dx}
          + 2x)`, :math:`x = \ln(1/p)`; per coordinate :math:`\sqrt m s \sqrt{2\ln(2d/p)}`.
        """
        sites = max(int(sites), 1)
        p = REFUSAL_PROBABILITY / 3
        x = math.log(1.0 / p)
        n_max = float(records) + sites / 2 + float(count_std) * math.sqrt(sites) * math.sqrt(2.0 * x)
        data = n_max * self.l2
        spread = math.sqrt(sites) * self.local_sigma
        noise = spread * math.sqrt(self.dim + 2.0 * math.sqrt(self.dim * x) + 2.0 * x)
        coordinate = n_max * (self.l2 - math.sqrt(self.dim) / 2 + 0.5) + spread * math.sqrt(
            2.0 * math.log(2.0 * self.dim / p))
        return SumBound(records=n_max, data=data, noise=noise, norm=data + noise, coordinate=coordinate)

    def refusal(self, total: np.ndarray, *, records: float, sites: int, count_std: float = 0.0) -> str:
        """Why the unmasked (centred) integer sum ``total`` of ``sites`` included sites holding ``records`` agreed
        records is beyond what honest sites can produce (:meth:`sum_bound`); "" when it is not."""
        bound = self.sum_bound(records=records, sites=sites, count_std=count_std)
        values = np.asarray(total, dtype=np.float64)
        norm, largest = float(np.linalg.norm(values)), float(np.max(np.abs(values), initial=0.0))
        if norm <= bound.norm and largest <= bound.coordinate:
            return ""
        return (f"the unmasked sum of {sites} sites has L2 norm {norm:.4g} and largest coordinate {largest:.4g}, "
                f"beyond what honest sites can produce ({bound.norm:.4g} = {bound.records:.6g} records x Delta "
                f"{self.l2:.4g} + noise tail {bound.noise:.4g}; coordinates {bound.coordinate:.4g}): a vector outside "
                "the protocol is in the sum, and secure aggregation cannot say whose contribution did it")

    def report(self) -> dict[str, float]:
        """The figures the ledger recomputes ε from (the server records them for every site that was asked)."""
        return {key: float(value) for key, value in asdict(self).items()}


def _tail_factor(z: float, parties: int, honest: int, dim: int) -> float:
    r"""c with :math:`P(\max_j |\text{noise}_j| > c\Delta) \le` :data:`WRAP_PROBABILITY`: the sum of at most
    ``parties`` :math:`N_{\mathbb Z}(0, s^2)` is :math:`k s^2`-sub-Gaussian (Canonne et al. 2020), union over d."""
    return z * math.sqrt(parties / honest) * math.sqrt(2.0 * math.log(2.0 * dim / WRAP_PROBABILITY))


def _tail(plan: RoundPlan) -> float:
    return _tail_factor(plan.noise_multiplier, plan.parties, plan.honest, plan.dim)


def _scale(z: float, *, parties: int, honest: int, records: float, dim: int, modulus: int, clip: float) -> float:
    """The largest gamma with n_max (gamma C + 1/2) + c (gamma C + sqrt(d)/2) < M/2 - 1."""
    n_max = RECORD_MARGIN * records + RECORD_SLACK
    c = _tail_factor(z, parties, honest, dim)
    return (modulus / 2 - 1 - n_max / 2 - c * math.sqrt(dim) / 2) / (clip * (n_max + c))


def _plan(z: float, *, parties: int, honest: int, records: float, dim: int, modulus: int, clip: float) -> RoundPlan:
    gamma = _scale(z, parties=parties, honest=honest, records=records, dim=dim, modulus=modulus, clip=clip)
    l2 = gamma * clip + math.sqrt(dim) / 2
    return RoundPlan(parties=parties, honest=honest, records=float(records), dim=dim, modulus=modulus, gamma=gamma,
                     l2=l2, l1=l1_bound(l2, dim), noise_multiplier=z, local_sigma=z * l2 / math.sqrt(honest))


@functools.lru_cache(maxsize=256)
def round_plan(*, epsilon: float, delta: float, rounds: int, parties: int, max_dropouts: int, colluding: int,
               records: float, dim: int, modulus_bits: int, clip: float,
               prior: tuple[tuple[float, float, int], ...] = (), honest_cap: int | None = None) -> RoundPlan:
    """The round's plan, z calibrated so that ``rounds`` such rounds after ``prior`` spend ``(epsilon, delta)``.

    ``honest_cap``: at most this many honest survivors' shares are counted (:func:`counted_honest`: the sites'
    own policies), whatever ``parties`` says; each share is sized for them.

    Raises ``ValueError`` when ``parties - max_dropouts - colluding < 1`` or when the modulus leaves no
    room (gamma C below sqrt(d): quantisation would dominate the sensitivity).
    """
    honest = _honest(parties, max_dropouts, colluding, honest_cap)
    if honest < 1:
        raise ValueError(f"{parties} selected sites leave {honest} honest survivors with {max_dropouts} drop-outs "
                         f"and {colluding} colluding sites")
    modulus = 2 ** modulus_bits

    def plan(z: float) -> RoundPlan:
        return _plan(z, parties=parties, honest=honest, records=records, dim=dim, modulus=modulus, clip=clip)

    def spent(z: float) -> float:
        p = plan(z)
        return ddg_epsilon(releases=[_release(p)] * rounds, delta=delta, prior=prior)

    try:
        result = plan(calibrate_noise(spent, epsilon, tolerance=1e-5 * epsilon))
    except ValueError:
        raise ValueError(f"no noise multiplier up to 1e7 reaches epsilon {epsilon:g} in {rounds} rounds") from None
    if result.gamma * clip < math.sqrt(dim):
        raise ValueError(f"a modulus of 2^{modulus_bits} leaves gamma*C = {result.gamma * clip:.3g} below sqrt(d) = "
                         f"{math.sqrt(dim):.3g}: rounding would dominate the sensitivity")
    return result


def _honest(parties: int, max_dropouts: int, colluding: int, cap: int | None) -> int:
    """The honest survivors whose shares a plan counts: ``parties - D - t``, at most ``cap`` (when the
    parties leave at least one)."""
    honest = parties - max_dropouts - colluding
    return honest if cap is None or honest < 1 else min(honest, cap)


def counted_honest(honest_sites: Sequence[float], max_dropouts: int) -> int | None:
    r"""The most honest survivors' shares a round may count when sites with a privacy policy take part: the
    smallest of their ``max(h - D, 1)``, ``h`` a policy's ``privacy-min-honest-sites`` (the honest sites, itself
    included, that site counts on; ``D`` of them may drop out, and the site's own share is in any sum its vector
    is in); ``None`` without a policy. A server that claims more participants cannot shrink a policy site's share:
    the site sizes its share, and charges its filter, with this count, never with the parties the server reports."""
    counts = [max(int(h) - max_dropouts, 1) for h in honest_sites]
    return min(counts) if counts else None


def _release(plan: RoundPlan) -> tuple[float, float, float, int, int]:
    return (plan.l2, plan.l1, plan.local_sigma, plan.honest, plan.dim)


# ------------------------------------------------------------------------- the recalibration's secure sum

#: The recalibration sum's noise is raised by this relative margin so that :func:`gaussian_bound` holds in
#: floating point (without it, 1/(1/z) can round below z).
BOUND_MARGIN = 1e-9


def gaussian_bound(plan: RoundPlan) -> float:
    r"""The noise multiplier :math:`z'` of a Gaussian mechanism (sample rate 1) whose RDP is at least that of
    the plan's release at every order.

    Proposition 14's third branch, an upper bound on the release's RDP, is
    :math:`\frac\alpha2(\Delta_2/(\sqrt n s) + \tau\sqrt d)^2 = \alpha/(2z'^2)`, the Gaussian
    mechanism's RDP at :math:`1/z' = \Delta_2/(\sqrt n s) + \tau\sqrt d` (n = ``plan.honest``).
    """
    tau = ddg_tau(plan.local_sigma, plan.honest)
    return 1.0 / (plan.l2 / (math.sqrt(plan.honest) * plan.local_sigma) + tau * math.sqrt(plan.dim))


def gaussian_sum_plan(*, multiplier: float, parties: int, max_dropouts: int, colluding: int, records: float,
                      size: int, clip: float, modulus_bits: int, honest_cap: int | None = None) -> RoundPlan:
    r"""The public plan of a secure sum that releases, with the noise of a Gaussian mechanism of noise multiplier
    ``multiplier`` (sample rate 1), the sum of ``size``-vectors each of L2 norm at most ``clip``: every record's
    vector scaled by :math:`\gamma`, rounded and summed with the sites' discrete Gaussian shares.

    The sites' noise multiplier is raised from ``multiplier`` to :math:`1/(1/z - \tau\sqrt{size})` (and
    :data:`BOUND_MARGIN`) so that :func:`gaussian_bound` of the plan is at least ``multiplier``: the release is then
    charged as the Gaussian entry ``(multiplier, 1, 1)``; raising it only raises :math:`s` and so lowers
    :math:`\tau`. ``honest_cap`` as for :func:`round_plan`. ``ValueError`` when no such plan exists.
    """
    honest = _honest(parties, max_dropouts, colluding, honest_cap)
    if honest < 1 or not multiplier > 0 or not clip > 0:
        raise ValueError(f"a secure sum of {parties} sites with {max_dropouts} drop-outs and {colluding} colluding "
                         f"sites at noise multiplier {multiplier:g} has no honest survivor or no noise")
    modulus = 2 ** modulus_bits

    def plan(z: float) -> RoundPlan:
        return _plan(z, parties=parties, honest=honest, records=records, dim=size, modulus=modulus, clip=clip)

    slack = 1.0 / multiplier - ddg_tau(plan(multiplier).local_sigma, honest) * math.sqrt(size)
    result = plan((1.0 + BOUND_MARGIN) / slack) if slack > 0 else None
    if result is None or result.gamma * clip < math.sqrt(size) or gaussian_bound(result) < multiplier:
        raise ValueError(f"a modulus of 2^{modulus_bits} leaves no secure sum of {size} values at noise multiplier "
                         f"{multiplier:g} over {honest} honest sites")
    return result


def gaussian_sum_contribution(terms: np.ndarray, plan: RoundPlan, *, clip: float,
                              rng: np.random.Generator) -> np.ndarray:
    r"""A site's integer vector of a :func:`gaussian_sum_plan` secure sum: :math:`\sum_i \mathrm{round}(\gamma
    v_i)` over its records' vectors ``terms`` (shape ``(records, plan.dim)``, each of L2 norm at most ``clip``, the
    plan's) plus :math:`N_{\mathbb Z}(0, s^2)` per coordinate, drawn from ``rng``. One record moves the rounded sum
    by at most :math:`\Delta = \gamma C + \sqrt d / 2` in L2 norm (the plan's ``l2``). ``ValueError`` for a row
    beyond ``clip``: the caller clips."""
    terms = np.asarray(terms, dtype=np.float64)
    if terms.ndim != 2 or terms.shape[1] != plan.dim or not np.all(np.isfinite(terms)):
        raise ValueError(f"secure-sum terms must be a finite (records, {plan.dim}) array, got shape {terms.shape}")
    if terms.size and float(np.max(np.linalg.norm(terms, axis=1))) > clip * (1.0 + 1e-9):
        raise ValueError(f"a record's secure-sum terms exceed their L2 bound {clip:g}")
    total = np.rint(plan.gamma * terms).astype(np.int64).sum(axis=0)  # exact: records * gamma C is far below 2^62
    return total + sample_discrete_gaussian(rng, plan.local_sigma ** 2, plan.dim)


def power_sum_plan(*, multiplier: float, parties: int, max_dropouts: int, colluding: int, records: float, size: int,
                   modulus_bits: int, honest_cap: int | None = None) -> RoundPlan:
    r"""The public plan of the recalibration's secure sum: ``size`` power sums (:mod:`models.recalibration`),
    each record's terms in [0, 1] (L2 norm at most :math:`\sqrt{size}`, the plan's clip): :func:`gaussian_sum_plan`."""
    return gaussian_sum_plan(multiplier=multiplier, parties=parties, max_dropouts=max_dropouts, colluding=colluding,
                             records=records, size=size, clip=math.sqrt(size), modulus_bits=modulus_bits,
                             honest_cap=honest_cap)


def power_sum_contribution(terms: np.ndarray, plan: RoundPlan, *, rng: np.random.Generator) -> np.ndarray:
    r"""A site's integer vector of the recalibration sum: its records' terms ``terms`` (shape ``(records,
    plan.dim)``, each in [0, 1]) through :func:`gaussian_sum_contribution`."""
    terms = np.asarray(terms, dtype=np.float64)
    if terms.ndim != 2 or terms.shape[1] != plan.dim or not np.all((terms >= 0.0) & (terms <= 1.0)):
        raise ValueError(f"recalibration terms must be (records, {plan.dim}) values in [0, 1], got shape {terms.shape}")
    return gaussian_sum_contribution(terms, plan, clip=math.sqrt(plan.dim), rng=rng)


class DistributedDP(SecureSumMechanism):
    """Record-level DP on the union of the sites, noise split across them, summed through SecAgg+.

    Accountant: RDP only (``privacy.accountant`` ``rdp``; ``auto`` resolves to it). The sum of
    discrete Gaussians is not a (discrete) Gaussian, and the bound the project has for it is
    Kairouz, Liu & Steinke's Rényi bound (Proposition 14); no privacy loss distribution of the sum
    is known in closed form, and a PLD of the continuous Gaussian it approaches would not be an
    upper bound. The ledger's ``epsilon_rdp`` equals its ``epsilon``.
    """

    name = "distributed_dp"
    unit = "record"
    adjacencies = ("add-remove",)
    delta_population = "union"  # one guarantee for the union of the sites' records (the noise adds up in the sum)
    refusals = {
        **{key: "has no effect on strategy 'distributed_dp', whose round is one full-batch gradient step at the global "
                "model, not local training (only the non-private centralised baseline would read it)"
           for key in ("train.local_epochs", "train.batch_size", "train.weight_decay", "train.proximal_mu")},
        "federation.server_optimizer": "would stack on the server Adam step (lr = train.lr) that strategy "
                                       "'distributed_dp' takes from the unmasked sum",
        "federation.aggregation": "cannot run with strategy 'distributed_dp', which gives the server only the sum",
        "federation.update_bound": "bounds FedAvg's weighted mean, which strategy 'distributed_dp' does not take (the "
                                   "server sees only the sum)",
        "resume.from": "is not offered for strategy 'distributed_dp' (the server's optimiser state is not in the "
                       "checkpoint)",
    }

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        require_decomposable_loss(self.name, cfg)
        sites = cfg.federation.num_sites
        selected = max(1, round(cfg.federation.fraction_train * sites)) if sites else 0
        if selected and selected - cfg.privacy.max_dropouts - cfg.privacy.colluding_sites < 1:
            raise ConfigError(
                f"run config: strategy 'distributed_dp' with about {selected} sites per round cannot tolerate "
                f"privacy.max_dropouts = {cfg.privacy.max_dropouts} and privacy.colluding_sites = "
                f"{cfg.privacy.colluding_sites}: k - privacy.max_dropouts - privacy.colluding_sites must be >= 1")
        d, t = cfg.privacy.max_dropouts, cfg.privacy.colluding_sites
        if selected and selected <= 2 * d + t:  # strategies.secure_aggregation.protocol_parameters' rule (no Flower)
            raise ConfigError(
                f"run config: privacy.max_dropouts = {d} is too many for secure aggregation of about {selected} sites "
                f"with privacy.colluding_sites = {t}: a server naming different survivors to different sites could "
                f"unmask a site unless k > 2 * max_dropouts + colluding_sites; set privacy.max_dropouts <= "
                f"{(selected - t - 1) // 2} or select more sites")

    def plan(self, cfg: ExperimentConfig, *, parties: int, records: float, dim: int, setup: SiteSetUp,
             honest_sites: Sequence[float] = ()) -> RoundPlan:
        """This round's public parameters (ConfigError naming the keys when they cannot be met); ``honest_sites``:
        the ``privacy-min-honest-sites`` of the policy sites taking part (:func:`counted_honest`)."""
        try:
            return round_plan(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, rounds=cfg.federation.rounds,
                              parties=parties, max_dropouts=cfg.privacy.max_dropouts,
                              colluding=cfg.privacy.colluding_sites, records=float(records), dim=dim,
                              modulus_bits=cfg.privacy.modulus_bits, clip=cfg.privacy.clip_norm,
                              prior=tuple(setup.prior),
                              honest_cap=counted_honest(honest_sites, cfg.privacy.max_dropouts))
        except ValueError as err:
            raise ConfigError(f"run config: strategy 'distributed_dp' (privacy.max_dropouts, privacy.colluding_sites, "
                              f"privacy.modulus_bits): {err}") from err

    def site_release(self, cfg: ExperimentConfig, plan: RoundPlan) -> tuple[tuple[float, float, int], ...]:
        """What one round's vector costs a site with a privacy policy, as a Gaussian history its filter charges:
        the Gaussian that bounds the release's RDP at every order (:func:`gaussian_bound`) over the plan's counted
        honest shares (the site's own plan, sized by its policy: :func:`counted_honest`)."""
        return ((gaussian_bound(plan), 1.0, 1),)

    def planned_release(self, cfg: ExperimentConfig, setup: SiteSetUp) -> tuple[tuple[float, float, int], ...]:
        """The run's rounds as a policy site plans them before its first release: ``rounds`` Gaussian releases at
        the noise multiplier that spends ``privacy.epsilon`` after ``setup.prior`` (the discrete plan's bound is
        within its tau term of it; each round is charged exactly by :meth:`site_release`)."""
        rounds, prior = cfg.federation.rounds, list(setup.prior)
        z = calibrate_noise(lambda z: epsilon_from_history([*prior, (z, 1.0, rounds)], delta=cfg.privacy.delta),
                            cfg.privacy.epsilon, tolerance=1e-5 * cfg.privacy.epsilon)
        return ((z, 1.0, rounds),)

    def contribution(self, model: Any, data: Any, cfg: ExperimentConfig, plan: RoundPlan, *, seed: int) -> np.ndarray:
        """The site's integer vector of the round (its rounded clipped gradient sum plus its noise share)."""
        from strategies.mechanisms.distributed_dp_training import site_contribution  # torch: only where a site trains

        return site_contribution(model, data, clip_norm=cfg.privacy.clip_norm, gamma=plan.gamma,
                                 local_sigma=plan.local_sigma, dim=plan.dim, seed=seed)

    def server_step(self, arrays: Mapping[str, np.ndarray], total: np.ndarray, plan: RoundPlan, *, count: float,
                    lr: float, state: dict[str, Any] | None, sites: int | None = None,
                    count_std: float = 0.0) -> tuple[dict[str, np.ndarray] | None, dict[str, Any], str]:
        """The server's step from the unmasked sum (centred integers): ``(new arrays, optimiser state, "")``, or
        ``(None, state, reason)`` when the sum is beyond what an honest round can produce (:meth:`RoundPlan.sum_bound`
        of the ``sites`` included sites, ``count`` their agreed records; ``sites`` defaults to the round's parties).

        The check is on the centred sum, the very integers the step divides: whatever a site's vector
        wrapped around the modulus to, the step can move the model no further than an honest round's sum
        would. The gradient estimate is ``total / (gamma * count)``, ``count`` the agreed record count of the
        sites whose vectors are in the sum; Adam (Kingma & Ba 2015; betas 0.9, 0.999, eps 1e-8) with
        learning rate ``lr``, its moments kept at the server.
        """
        sites = plan.parties if sites is None else sites
        if reason := plan.refusal(total, records=count, sites=sites, count_std=count_std):
            return None, state or {}, reason
        gradient = total.astype(np.float64) / (plan.gamma * count)
        state = dict(state or {"step": 0, "m": np.zeros(plan.dim), "v": np.zeros(plan.dim)})
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        step = int(state["step"]) + 1
        m = beta1 * state["m"] + (1 - beta1) * gradient
        v = beta2 * state["v"] + (1 - beta2) * gradient ** 2
        update = lr * (m / (1 - beta1 ** step)) / (np.sqrt(v / (1 - beta2 ** step)) + eps)
        new, offset = {}, 0
        for key, array in arrays.items():
            size = array.size
            new[key] = (array.astype(np.float64) - update[offset:offset + size].reshape(array.shape)).astype(array.dtype)
            offset += size
        return new, {"step": step, "m": m, "v": v}, ""

    def recalibration_spread(self, cfg: ExperimentConfig, sites: int) -> float:
        """The summed power sums' noise std over one release's: the ``sites`` shares over their ``k - D - t``
        honest survivors' (:func:`power_sum_plan`)."""
        honest = sites - cfg.privacy.max_dropouts - cfg.privacy.colluding_sites
        return math.sqrt(sites / honest) if honest >= 1 else math.inf

    def recalibration_plan(self, cfg: ExperimentConfig, *, parties: int, records: float, size: int,
                           honest_sites: Sequence[float] = ()) -> RoundPlan:
        """The recalibration sum's public plan (:func:`power_sum_plan` at the run's recalibration multiplier;
        ``honest_sites`` as for :meth:`plan`)."""
        try:
            return power_sum_plan(multiplier=recalibration_multiplier(cfg), parties=parties,
                                  max_dropouts=cfg.privacy.max_dropouts, colluding=cfg.privacy.colluding_sites,
                                  records=float(records), size=size, modulus_bits=cfg.privacy.modulus_bits,
                                  honest_cap=counted_honest(honest_sites, cfg.privacy.max_dropouts))
        except ValueError as err:
            raise ConfigError(f"run config: strategy 'distributed_dp' recalibration (privacy.max_dropouts, "
                              f"privacy.colluding_sites, privacy.modulus_bits): {err}") from err

    def recalibration_contribution(self, terms: np.ndarray, plan: RoundPlan, *, rng: np.random.Generator) -> np.ndarray:
        """The site's integer vector of the recalibration sum (:func:`power_sum_contribution`)."""
        return power_sum_contribution(terms, plan, rng=rng)

    def recalibration_sums(self, total: np.ndarray, plan: RoundPlan, *, count: float, sites: int,
                           count_std: float = 0.0) -> tuple[np.ndarray | None, str]:
        """The noisy power sums from the unmasked (centred) sum, or ``(None, reason)`` when it is refused
        (:meth:`RoundPlan.refusal`)."""
        if reason := plan.refusal(total, records=count, sites=sites, count_std=count_std):
            return None, reason
        return np.asarray(total, dtype=np.float64) / plan.gamma, ""

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        plans = [report for report in reports if report is not None]
        accountant = DistributedAccountant(prior=setup.prior)
        for p in plans:
            accountant.step(l2=p["l2"], l1=p["l1"], local_sigma=p["local_sigma"], parties=int(p["honest"]),
                            dim=int(p["dim"]))
        epsilon = accountant.epsilon(cfg.privacy.delta)
        last = plans[-1] if plans else {}
        return LedgerEntry(
            round=server_round, site=site, mechanism=self.name, unit="record", adjacency="add-remove",
            accountant="distributed discrete Gaussian (Kairouz et al. 2021, Prop. 14), RDP", epsilon=epsilon,
            delta=cfg.privacy.delta, noise_multiplier=last.get("noise_multiplier"), clip_norm=cfg.privacy.clip_norm,
            sample_rate=1.0, steps=len(plans), epsilon_rdp=epsilon, assumptions=self.assumptions(cfg),
            prior=tuple(setup.prior),
        )

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        d, t = cfg.privacy.max_dropouts, cfg.privacy.colluding_sites
        return (
            "record-level DP on the union of the sites (add/remove one record): each round is one full-batch "
            "gradient step at the global model over every selected site's training records (sampling rate 1, no "
            "amplification claimed)",
            "each record's gradient is clipped to clip_norm, scaled by gamma and rounded coordinate-wise to integers: "
            "one record changes the integer sum by at most Delta = gamma*clip_norm + sqrt(d)/2 in L2 norm "
            "(quantisation bound) and min(Delta^2, sqrt(d)*Delta) in L1 norm",
            f"noise split: with k sites selected, each adds discrete Gaussian noise N_Z(0, s^2) per coordinate, "
            f"s^2 = (noise_multiplier*Delta)^2/(k - D - t), D = {d} tolerated drop-outs, t = {t} colluding sites "
            "(who know their own noise): any k - D - t honest survivors' noise has variance >= "
            "(noise_multiplier*Delta)^2; a round in which more than D sites drop out is not unmasked",
            f"threat model: honest-but-curious server that follows the protocol; up to t = {t} sites "
            "(privacy.colluding_sites) collude with it; the server sees only the sum of the masked vectors",
            "what secure aggregation (SecAgg+) rests on: X25519 key agreement (cryptography library) and Fernet "
            "encryption of the Shamir shares (Flower's, over the cryptography library); Shamir secret sharing with a "
            "threshold above t (pycryptodome, in Flower's share format); masks expanded by the ChaCha20 stream cipher "
            "(cryptography library), each keyed by HKDF-SHA256 of the full secret: the 32-byte X25519 secret of a "
            "pair (pairwise masks) or a "
            "site's 31-byte random seed (its private mask), with fresh key pairs and seeds every round, so no secret "
            "is shorter than 128 bits and no stream repeats; a mask is uniform mod M, so a masked vector alone, or a "
            "sum missing an honest site's masks, tells nothing about the vectors (strategies.secure_aggregation)",
            f"modular wrap-around: the server sees the integer sum mod 2^{cfg.privacy.modulus_bits} (post-processing); "
            f"gamma is chosen so that a coordinate wraps with probability <= {WRAP_PROBABILITY:g} per round (the data "
            "part is at most n_max*(gamma*C + 1/2), the noise sum is sub-Gaussian)",
            "epsilon computed by the server with Kairouz, Liu & Steinke (2021), Prop. 14 (k - D - t parties), composed "
            "by RDP over the rounds in which the site was asked for its vector, converted at delta as for DP-SGD",
            setup_sentence(cfg, self.uses_private_setup(cfg)),
            *(("the recalibration after the last round goes through the same secure sum: each site's rounded sums "
               "(scale gamma) of its records' predicted survival powers plus its discrete Gaussian share; by Prop. 14's "
               "third branch its RDP is at most the Gaussian mechanism's at the prior's recalibration entry (noise "
               f"multiplier {recalibration_multiplier(cfg):.4g}, sample rate 1), the sites' noise raised until it is "
               "(power_sum_plan)",) if recalibrates(cfg) else ()),
            "the server divides the sum by gamma and the agreed record count and takes one Adam step (lr = train.lr): "
            "post-processing",
            "what secure aggregation cannot attribute: the server sees only the sum, so it cannot say whose vector is "
            "outside the protocol; it refuses an unmasked (centred) sum beyond what honest sites can produce (L2 norm "
            "n_max*Delta plus the noise's chi-square tail, n_max the included sites' agreed records plus their count "
            f"noise's tail; every coordinate likewise; an honest round is refused with probability <= "
            f"{REFUSAL_PROBABILITY:g}) as an unattributable round-level failure: the model stays, the round's spend "
            "counts, 3 consecutive refusals stop the run. A contribution that keeps the sum within that bound (e.g. "
            "one site's vector sign-flipped or scaled a few times) is neither detected nor named",
            *record_level_closing(cfg, self.manifest(cfg)),
        )

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        keys = ("one-time public keys (at the key set-up, or, for the next round's sum, with the unmask reply), "
                "encrypted Shamir shares and the shares revealed in unmasking")
        no_info = ("drawn fresh from the site's random source for this round, not computed from any record: carry "
                   "no information about the records")
        return horizontal_manifest(self, cfg, [
            ReleasedValue("masked vector", "the site's rounded clipped gradient sum plus its discrete Gaussian noise "
                          "share, masked by SecAgg+ (ChaCha20 masks keyed by the full secrets: uniform mod M alone)", "secure aggregation", True,
                          "the server learns only the sum of the survivors' vectors (SecAgg+, honest-but-curious "
                          "server, up to t colluding sites): covered by the distributed discrete Gaussian accountant "
                          "on the union", ("query.secagg_masked/masked.masked",)),
            ReleasedValue("secure-aggregation keys", keys, "secure aggregation", True, no_info,
                          ("query.secagg_setup/secagg.*", "query.secagg_share_keys/secagg.*",
                           "query.secagg_unmask/secagg.*")),
            ReleasedValue("disputed neighbours", "the neighbours whose encrypted share the site could not use (it did "
                          "not decrypt, named another sender or receiver, or held shares of the wrong length)", "secure aggregation", True,
                          "a fact about the other sites' messages, not computed from any record: carries no "
                          "information about the records", ("query.secagg_masked/secagg.disputed",)),
        ])
