r"""Record-level DP-SGD for per-sample decomposable survival losses (strategy ``dp_sgd``): the mechanism.

One step on a Poisson-sampled batch :math:`B` (each of the :math:`n` records independently with
probability :math:`q`):

.. math::

    \tilde g = \frac{1}{q n} \Big( \sum_{i \in B} g_i \min\big(1, C / \lVert g_i \rVert_2\big)
               + \mathcal N(0, \sigma^2 C^2 I) \Big),

with :math:`g_i` the gradient of record :math:`i`'s loss over **all** parameters, clip norm
:math:`C`, noise multiplier :math:`\sigma`. Only the discrete-time hazard model qualifies: its
negative log-likelihood is a sum of per-record terms, the Cox partial likelihood is not
(:func:`require_decomposable_loss`).

This module holds the mechanism object (:class:`DPSGD`: checks, accounting, ledger entry,
assumptions, manifest) and its pure schedule maths (:func:`poisson_schedule`, the calibrated
noise multiplier and ε); it imports no torch. The site's numerics (per-sample gradients, clipping,
noise, the training loop) are :mod:`strategies.mechanisms.dp_sgd_training`, imported by
:meth:`DPSGD.site_round`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from strategies.accounting.filter import fitting_noise_multiplier
from strategies.accounting.ledger import LedgerEntry
from strategies.accounting.rdp import (
    ACCOUNTANT_LABELS,
    ACCOUNTANT_NAMES,
    SiteAccountant,
    calibrate_noise_multiplier,
    epsilon_from_history,
)
from strategies.config import AUTO, ConfigError, ExperimentConfig, defaults
from strategies.mechanisms.base import LocalUpdateMechanism, SiteSetUp, SiteUpdate, horizontal_manifest
from strategies.mechanisms.manifest import (
    Manifest,
    ReleasedValue,
    common_releases,
    record_level_closing,
    setup_sentence,
    update_release,
)
from strategies.mechanisms.schedules import poisson_schedule
from strategies.mechanisms.setup_share import setup_multiplier

if TYPE_CHECKING:  # the site's model type, for type checkers only
    from models.survival import SurvivalModel

__all__ = [
    "AUTO_SECURE_SETUP_NOISE",
    "DPSGD",
    "calibrated_noise_multiplier",
    "clipped_epsilon",
    "remember_noise",
    "remembered_noise",
    "require_decomposable_loss",
]


# --------------------------------------------------------------------------- the mechanism object


#: ``privacy.setup_sum = auto`` sends a dp_sgd run's private set-up through the secure sum where the per-site
#: plan's summed set-up noise, :math:`\sqrt K z` (the noise standard deviation of one record count spending the
#: set-up's whole noise multiplier :math:`z` at each of the ``federation.num_sites`` = :math:`K` sites, summed over
#: them), exceeds this many records. On 900 bundled records over :math:`K` sites at ε = 1 (WHAS, GBSG; seeds 0-2)
#: the per-site set-up ran on every seed at :math:`\sqrt K z \le 25` (6 and 8 sites) and, without a data
#: dictionary, stopped on 1 to 3 of 3 seeds from 31 on (12, 16, 24 sites); at ε = 2 it ran at 24 sites (23).
#: Public: a function of the run config alone.
AUTO_SECURE_SETUP_NOISE = 30.0
#: The secure sum's keys, read by dp_sgd only when its set-up goes through it (``privacy.setup_sum``).
SECURE_SUM_KEYS = ("privacy.max_dropouts", "privacy.colluding_sites", "privacy.modulus_bits")


def require_decomposable_loss(strategy: str, cfg: ExperimentConfig) -> None:
    """Record-level DP-SGD needs a loss that is a sum of per-record terms: the hazard model's, not Cox's. ``coxph``
    passes: under this strategy it is no network but the private grouped-time model (:mod:`flwr_app.cox_server`)."""
    if cfg.model.name not in ("hazard_mlp", "coxph"):
        raise ConfigError(
            f"run config: strategy '{strategy}' gives a record-level guarantee only for a loss that is a sum of "
            f"per-record terms; the partial likelihood of model '{cfg.model.name}' is not per-sample decomposable "
            f"(each record sits in others' risk sets), so per-sample clipping does not bound one record's "
            f"influence. Use model.name = 'hazard_mlp'")


#: σ by calibration inputs: this process's calibrations and those a site kept in its node state
#: (:func:`remembered_noise`, :func:`remember_noise`); at most :data:`_NOISE_MEMO_SIZE`, the oldest dropped first.
_NOISE: dict[tuple, float] = {}
_NOISE_MEMO_SIZE = 1024
#: The calibrations each thread used since its last :func:`remember_noise` (a simulation's sites share a process).
_used = threading.local()


def _noise_key(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
               prior: Sequence[Sequence[float]]) -> tuple:
    return (float(epsilon), float(delta), float(sample_rate), int(steps), str(accountant),
            tuple((float(noise), float(rate), int(count)) for noise, rate, count in prior))


def calibrated_noise_multiplier(*, epsilon: float, delta: float, sample_rate: float, steps: int,
                                accountant: str, prior: tuple[tuple[float, float, int], ...] = ()) -> float:
    """σ for ``steps`` Poisson-subsampled Gaussian steps at rate ``q`` to spend ``(ε, δ)`` after ``prior`` (memoised)."""
    key = _noise_key(epsilon, delta, sample_rate, steps, accountant, prior)
    _used.__dict__.setdefault("keys", set()).add(key)
    if key not in _NOISE:
        if len(_NOISE) >= _NOISE_MEMO_SIZE:
            del _NOISE[next(iter(_NOISE))]
        _NOISE[key] = calibrate_noise_multiplier(  # type: ignore[arg-type]
            target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant,
            prior=prior)
    return _NOISE[key]


def remembered_noise() -> str:
    """The calibrations this thread used since its last :func:`remember_noise`, as JSON: what a deployed site keeps
    in its node state, whose every message is handled in a new process, so that only its first message calibrates
    σ (0.5-1.5 s on 2 cores)."""
    keys = sorted(_used.__dict__.get("keys", ()))
    return json.dumps([[*key[:5], [list(entry) for entry in key[5]], _NOISE[key]] for key in keys if key in _NOISE])


def remember_noise(text: str | None) -> None:
    """Take back calibrations of :func:`remembered_noise` (the site's own node state; the server never writes it),
    and start this thread's record of the calibrations used afresh."""
    _used.keys = set()
    for *head, prior, sigma in json.loads(text or "[]"):
        _NOISE.setdefault(_noise_key(*head, prior), float(sigma))


@functools.lru_cache(maxsize=4096)
def clipped_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str,
                    prior: tuple[tuple[float, float, int], ...] = ()) -> float:
    """ε of ``prior`` and ``steps`` Poisson-subsampled Gaussian steps (σ, q), add/remove adjacency (memoised)."""
    return epsilon_from_history([*prior, (noise_multiplier, sample_rate, steps)], delta=delta,
                                accountant=accountant)  # type: ignore[arg-type]


class DPSGD(LocalUpdateMechanism):
    r"""Record-level DP-SGD at every site (strategy ``dp_sgd``).

    Each round a site runs ``train.local_epochs`` epochs of
    :func:`~strategies.mechanisms.dp_sgd_training.train_epochs_dp`: Poisson
    sampling at :math:`q = \min(1, B/n)`, per-record gradients clipped to ``privacy.clip_norm``,
    Gaussian noise :math:`N(0, σ^2C^2)` on their sum, divided by :math:`qn`. ``n`` is the
    site's record count agreed at set-up, so :math:`q`, the number of steps and :math:`σ`
    (calibrated once for ``federation.rounds`` rounds of steps and the set-up releases by
    ``privacy.accountant``: dp-accounting's PLD by default, opacus' PRV or RDP) are functions of
    that count and the public configuration: the server recomputes them, and each site's ε,
    itself. The ledger gives the RDP ε of the same releases beside the headline.
    """

    name = "dp_sgd"
    pooled_baseline = True
    unit = "record"
    adjacencies = ("add-remove",)
    accountants = ("pld", "prv", "rdp")

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        require_decomposable_loss(self.name, cfg)
        self.check_setup_sum(cfg)

    def setup_sum(self, cfg: ExperimentConfig) -> str:
        r"""How the run's private set-up reaches the server: ``"secure"`` (its histograms and moments through SecAgg+
        with the distributed discrete Gaussian: :class:`~strategies.mechanisms.setup_statistics.SecureSetup`) or
        ``"per_site"`` (each site's own noisy releases). ``privacy.setup_sum``, with ``auto`` resolved from public
        quantities of the run config only, the same at the server and every site: ``"secure"`` where
        ``federation.num_sites`` :math:`K` admits a secure sum (:math:`K > 2D + t`, ``privacy.max_dropouts`` and
        ``privacy.colluding_sites``) and the per-site plan's summed noise :math:`\sqrt K z` exceeds
        :data:`AUTO_SECURE_SETUP_NOISE` (:math:`z`: the set-up's noise multiplier, 0 without a private set-up)."""
        if cfg.privacy.setup_sum != AUTO:
            return cfg.privacy.setup_sum
        sites, privacy = cfg.federation.num_sites, cfg.privacy
        admits = sites > 2 * privacy.max_dropouts + privacy.colluding_sites
        noisy = math.sqrt(sites) * setup_multiplier(cfg) > AUTO_SECURE_SETUP_NOISE
        return "secure" if admits and noisy and self.uses_private_setup(cfg) else "per_site"

    def check_setup_sum(self, cfg: ExperimentConfig) -> None:
        """Refuse, in one line naming the keys: ``privacy.setup_sum`` set where the run has no private set-up; a
        secure set-up sum that ``federation.num_sites`` cannot run with ``privacy.max_dropouts`` and
        ``privacy.colluding_sites`` (SecAgg+ needs ``k > 2 max_dropouts + colluding_sites``); the secure sum's keys
        away from their defaults where the set-up is summed per site (they would be ignored)."""
        privacy, default = cfg.privacy, defaults()
        if privacy.setup_sum != AUTO and not (privacy.enabled and self.uses_private_setup(cfg)):
            raise ConfigError(f"run config: privacy.setup_sum = {privacy.setup_sum!r} chooses how the private set-up "
                              "is summed, but this run has none (privacy.epsilon = inf or privacy.setup_share = 0): "
                              f"leave it at {AUTO!r}")
        if self.setup_sum(cfg) == "per_site":
            for key in SECURE_SUM_KEYS:
                value = getattr(privacy, key.split(".")[1])
                if value != default[key]:
                    raise ConfigError(f"run config: {key} = {value} is read by strategy 'dp_sgd' only for its secure "
                                      f"set-up sum, and privacy.setup_sum = {privacy.setup_sum!r} sums the set-up per "
                                      f"site here: leave it at {default[key]} or set privacy.setup_sum = 'secure'")
            return
        k, d, t = cfg.federation.num_sites, privacy.max_dropouts, privacy.colluding_sites
        if k <= 2 * d + t:  # strategies.secure_aggregation.protocol_parameters' rule (no Flower)
            raise ConfigError(f"run config: privacy.setup_sum = 'secure' with federation.num_sites = {k} cannot "
                              f"tolerate privacy.max_dropouts = {d} and privacy.colluding_sites = {t}: secure "
                              "aggregation needs k > 2 * max_dropouts + colluding_sites (a server naming different "
                              "survivors to different sites could unmask a site); lower them, add sites, or set "
                              "privacy.setup_sum = 'per_site'")

    def schedule(self, cfg: ExperimentConfig, setup: SiteSetUp) -> tuple[float, int, float]:
        """``(q, steps per round, σ)`` of a site with set-up ``setup``.

        σ is calibrated so that the site's set-up releases (``setup.prior``) and all its steps of
        all rounds together spend ``privacy.epsilon``; for a site with its own privacy filter
        (``setup.filter``), so that they also fit what the filter has left, whichever needs more noise.
        """
        sample_rate, steps = poisson_schedule(setup.count, batch_size=cfg.train.batch_size,
                                              epochs=cfg.train.local_epochs)
        sigma = calibrated_noise_multiplier(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta,
                                            sample_rate=sample_rate, steps=steps * cfg.federation.rounds,
                                            accountant=cfg.privacy.accountant, prior=tuple(setup.prior))
        if setup.filter is not None:  # a site's own filter: enough noise for it to admit the whole run
            sigma = max(sigma, fitting_noise_multiplier(
                order=setup.filter.order, budget=setup.filter.remaining, prior=tuple(setup.prior),
                sample_rate=sample_rate, steps=steps * cfg.federation.rounds))
        return sample_rate, steps, sigma

    def site_round(self, model: SurvivalModel, data: Any, cfg: ExperimentConfig, *, seed: int,
                   state: dict[str, Any] | None, setup: SiteSetUp) -> SiteUpdate:
        from strategies.mechanisms.dp_sgd_training import train_epochs_dp  # torch: only where a site trains

        sample_rate, _, sigma = self.schedule(cfg, setup)
        stats = train_epochs_dp(
            model, data.x, data.time, data.event, epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size,
            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, seed=seed, noise_multiplier=sigma,
            clip_norm=cfg.privacy.clip_norm, num_records=setup.count, proximal_mu=cfg.train.proximal_mu,
        )
        if state and "accountant" in state:
            accountant = SiteAccountant.from_state_dict(state["accountant"])
        else:  # a new accountant starts with the site's set-up releases
            accountant = SiteAccountant(cfg.privacy.accountant)  # type: ignore[arg-type]
            for noise, rate, count in setup.prior:
                accountant.step(noise_multiplier=noise, sample_rate=rate, num_steps=count)
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate, num_steps=int(stats["num_steps"]))
        steps = accountant.spent_steps - sum(count for _, _, count in setup.prior)
        report = {"noise_multiplier": sigma, "steps": float(steps), "epsilon": accountant.epsilon(cfg.privacy.delta)}
        return SiteUpdate(report, {"accountant": accountant.state_dict(), "steps": steps})

    def round_release(self, cfg: ExperimentConfig, setup: SiteSetUp, update: SiteUpdate,
                      previous: dict[str, Any] | None) -> tuple[tuple[float, float, int], ...]:
        sample_rate, steps, sigma = self.schedule(cfg, setup)
        return ((sigma, sample_rate, steps),)

    def planned_release(self, cfg: ExperimentConfig, setup: SiteSetUp) -> tuple[tuple[float, float, int], ...]:
        sample_rate, steps, sigma = self.schedule(cfg, setup)
        return ((sigma, sample_rate, steps * cfg.federation.rounds),)

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return ("noise_multiplier", "steps", "epsilon")

    def expected_report(self, cfg: ExperimentConfig, *, setup: SiteSetUp,
                        previous: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
        sample_rate, steps, sigma = self.schedule(cfg, setup)
        spent = (len(previous) + 1) * steps
        epsilon = clipped_epsilon(sigma, sample_rate, spent, cfg.privacy.delta, cfg.privacy.accountant,
                                  tuple(setup.prior))
        return {"noise_multiplier": sigma, "steps": float(spent), "epsilon": epsilon}

    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        sample_rate, _, sigma = self.schedule(cfg, setup)
        spent = self.expected_report(cfg, setup=setup, previous=reports[:-1])
        epsilon_rdp = clipped_epsilon(sigma, sample_rate, int(spent["steps"]), cfg.privacy.delta, "rdp",
                                      tuple(setup.prior))
        return LedgerEntry(
            round=server_round, site=site, mechanism=self.name, unit="record", adjacency="add-remove",
            accountant=ACCOUNTANT_LABELS[cfg.privacy.accountant], epsilon=spent["epsilon"], delta=cfg.privacy.delta,
            noise_multiplier=sigma, clip_norm=cfg.privacy.clip_norm, sample_rate=sample_rate,
            steps=int(spent["steps"]), epsilon_rdp=epsilon_rdp, assumptions=self.assumptions(cfg),
            prior=tuple(setup.prior),
            epsilon_filter=None if setup.filter is None else setup.filter.epsilon_after(
                [*setup.prior, (sigma, sample_rate, int(spent["steps"]))]),
        )

    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return (
            "record-level DP-SGD at the site: per-record gradient clipped to clip_norm, Gaussian noise "
            "N(0, (noise_multiplier*clip_norm)^2) on the sum, divided by the expected batch size q n",
            "Poisson sampling of each record with probability sample_rate = q = batch_size/n at every step; n is the "
            "site's record count agreed at set-up",
            setup_sentence(cfg, self.uses_private_setup(cfg)),
            *self._setup_sum_sentence(cfg),
            f"epsilon computed by the server ({ACCOUNTANT_NAMES[cfg.privacy.accountant]}, Poisson-subsampled Gaussian, "
            "add/remove-one adjacency) over every step of every round the site released an update, from the agreed "
            "count and the run configuration; the figures a site reports are checked against it; epsilon_rdp: "
            "opacus RDP of the same releases",
            "noise calibrated once for all rounds x local steps; the model updates, the global model and everything "
            "computed from them are post-processing",
            *record_level_closing(cfg, self.manifest(cfg)),
        )

    def sums_setup_securely(self, cfg: ExperimentConfig) -> bool:
        """Whether the run has a private set-up and sends it through the secure sum (:meth:`setup_sum`)."""
        return self.uses_private_setup(cfg) and self.setup_sum(cfg) == "secure"

    def _setup_sum_sentence(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        """The ledger's statement of how the private set-up reached the server (``privacy.setup_sum``); none without
        a private set-up."""
        if not self.uses_private_setup(cfg):
            return ()
        if not self.sums_setup_securely(cfg):
            return (f"set-up summed per site (privacy.setup_sum = {cfg.privacy.setup_sum}): the server sees every "
                    "site's own set-up releases, each with the site's full noise, so their guarantee assumes nothing "
                    "of the other sites; privacy.setup_sum = secure (auto: where sqrt(federation.num_sites) x the "
                    f"set-up's noise multiplier exceeds {AUTO_SECURE_SETUP_NOISE:g}) sends the histograms and moments "
                    "through SecAgg+ instead (the server then sees only their sum), whose bound then holds only "
                    "while k - D - t of the k summed sites are honest survivors (privacy.max_dropouts, "
                    "privacy.colluding_sites) and secure aggregation holds",)
        d, t = cfg.privacy.max_dropouts, cfg.privacy.colluding_sites
        return (f"set-up summed securely (privacy.setup_sum = {cfg.privacy.setup_sum}): the set-up's range "
                "histograms, time histogram and clipped moments go through SecAgg+ (modulo "
                f"2^{cfg.privacy.modulus_bits}), each site adding a discrete Gaussian share, so the server sees only "
                "their sum over the k sites; each of these releases is charged as the Gaussian entry above, which "
                f"bounds its RDP only while k - D - t of the k sites are honest survivors (D = {d} tolerated "
                f"drop-outs, t = {t} sites colluding with the server; Kairouz, Liu & Steinke 2021, Prop. 14) and "
                "secure aggregation holds (honest-but-curious server, as for distributed_dp); the record count stays "
                "the site's own release with its full noise, and training is the site's own DP-SGD, assuming "
                "nothing of the other sites",)

    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        accountant = f"DP-SGD, {ACCOUNTANT_NAMES[cfg.privacy.accountant]} accountant (add/remove one record)"
        covered = self.uses_private_setup(cfg)
        why = ("functions of the site's agreed (noisy) record count and the public configuration" if covered else
               "functions of the site's record count (uncovered) and the public configuration")
        manifest = horizontal_manifest(self, cfg, [
            update_release(True, accountant),
            ReleasedValue("declared parameters", "noise_multiplier, steps and epsilon, which the server checks", "train",
                          covered, why, tuple(f"train/metrics.{key}" for key in self.report_keys(cfg))),
            ReleasedValue("privacy state", "the site's accountant history (noise multiplier, sampling rate, steps), "
                          "kept in the server's checkpoint for resumption", "train", covered, why,
                          ("train/site.privacy_state",)),
        ])
        return self._secure_setup_manifest(cfg, manifest) if self.sums_setup_securely(cfg) else manifest

    def _secure_setup_manifest(self, cfg: ExperimentConfig, manifest: Manifest) -> Manifest:
        """``manifest`` with the set-up's histograms and moments through the secure sum (``privacy.setup_sum``) and
        what the site sends in its two SecAgg+ sums."""
        d, t = cfg.privacy.max_dropouts, cfg.privacy.colluding_sites
        trust = (f"; covered only while k - D - t of the k summed sites are honest survivors (D = {d}, t = {t}: "
                 "privacy.max_dropouts, privacy.colluding_sites) and secure aggregation holds against an "
                 "honest-but-curious server: unlike training, this guarantee rests on the other sites "
                 "(privacy.setup_sum = secure)")
        summed = {release.value: dataclasses.replace(release, reason=release.reason + trust)
                  for release in common_releases(cfg, private=True, record_level=True, private_setup=True,
                                                 secure_sum=True)
                  if release.value in ("feature statistics", "time grid")}
        no_info = ("drawn fresh from the site's random source for this sum, not computed from any record: carry no "
                   "information about the records")
        secagg = [
            ReleasedValue("masked set-up vectors", "in each of the set-up's two secure sums, the site's rounded range "
                          "histograms (pass 1) or time histogram and clipped moments (pass 2) plus its discrete "
                          "Gaussian share, masked by SecAgg+ (ChaCha20 masks keyed by the full secrets: uniform mod M "
                          "alone)", "set-up", True, "the server learns only the sum of the survivors' vectors" + trust,
                          ("query.secagg_masked/masked.masked",)),
            ReleasedValue("secure-aggregation keys", "one-time public keys, encrypted Shamir shares and the shares "
                          "revealed in unmasking, of the set-up's two secure sums", "set-up", True, no_info,
                          ("query.secagg_setup/secagg.*", "query.secagg_share_keys/secagg.*",
                           "query.secagg_unmask/secagg.*")),
            ReleasedValue("disputed neighbours", "the neighbours whose encrypted share the site could not use in a "
                          "set-up sum", "set-up", True, "a fact about the other sites' messages, not computed from "
                          "any record: carries no information about the records",
                          ("query.secagg_masked/secagg.disputed",)),
        ]
        releases = tuple(summed.get(release.value, release) for release in manifest.releases)
        return dataclasses.replace(manifest, releases=releases + tuple(secagg))
