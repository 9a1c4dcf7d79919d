"""What a privacy mechanism is in fedsurv: one object per mechanism, found by name in the registry.

A :class:`Mechanism` owns everything about one way of protecting a site's records, in roles, each a
small abstract class that the mechanism implements and a caller may depend on alone:

* its configuration: the keys it honours (:attr:`Mechanism.honours`, its row of
  :data:`strategies.mechanisms.keys.HONOURS`; any other key whose effect depends on the mechanism is
  refused at a value but its default, :meth:`Mechanism.check_keys`) and its checks
  (:meth:`Mechanism.check`), run once when the run config is parsed;
* what a site runs: :class:`LocalSiteStep` (local training and whatever noise the mechanism adds
  before the update leaves the site, the site's privacy state carried between rounds) or
  :class:`SecureSumSiteStep` (the site's integer vector of a secure sum), each with the plan of its
  releases (:class:`SitePlan`);
* what the server verifies and does: :class:`ReportVerification` (it recomputes what a site declares and
  names any mismatch), :class:`ServerAggregation` and, for a secure sum, :class:`SecureSumServerStep`;
* what the ledger states: :class:`LedgerStatement` (the assumptions its figures rest on and its
  **release manifest**, :mod:`strategies.mechanisms.manifest`: every value a site sends, covered or
  not) and :class:`RoundLedger` (a site's entry after a round, computed by the server from public
  configuration and the set-up it agreed with the sites).

:class:`HorizontalMechanism` is a horizontal federation's mechanism (:class:`LocalUpdateMechanism` or
:class:`SecureSumMechanism`); the split-learning mechanisms are plain :class:`Mechanism` objects with
their own site and server steps. The registry (:mod:`strategies.mechanisms.registry`) maps each
``strategy.name`` to one object, as opacus maps an accountant's name to its class. ``flwr_app``
decodes messages and calls these objects; no module branches on a strategy's name.

References
----------
opacus ``accountants`` (a registry of accountants with a common interface).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strategies.accounting.filter import SiteFilter
from strategies.accounting.ledger import LedgerEntry
from strategies.config import AUTO, KEYS, ConfigError, ExperimentConfig, key_value, mechanism_keys, run_defaults, show_value
from strategies.mechanisms.keys import HONOURS, has_private_setup, takers
from strategies.mechanisms.manifest import Manifest, ReleasedValue, common_releases

if TYPE_CHECKING:  # the heavy imports only for type checkers
    from flwr.serverapp.strategy import Strategy

    from models.data import SurvivalArrays
    from models.survival import SurvivalModel

__all__ = [
    "DELTA_POPULATIONS",
    "HorizontalMechanism",
    "LedgerStatement",
    "LocalSiteStep",
    "LocalUpdateMechanism",
    "Mechanism",
    "ReportVerification",
    "RoundLedger",
    "SecureSumMechanism",
    "SecureSumServerStep",
    "SecureSumSiteStep",
    "ServerAggregation",
    "SitePlan",
    "SiteSetUp",
    "SiteUpdate",
    "delta_refusal",
    "horizontal_manifest",
]


#: The population a horizontal mechanism's delta is for (:attr:`HorizontalMechanism.delta_population`), in words.
DELTA_POPULATIONS: Mapping[str, str] = {
    "site": "each site's training records: record-level DP at every site",
    "union": "the union of the sites' training records: one guarantee for all of them",
    "sites": "the sites: site-level DP, one site is the unit",
    "records": "the vertical federation's training records, each with all its modalities",
}


def delta_refusal(cfg: ExperimentConfig, mechanism: Mechanism, counts: Mapping[str, float]) -> str:
    """Why ``privacy.delta`` is too large for the population the run protects ("" when it is not).

    A (ε, δ) guarantee with δ > 1/n allows a mechanism that publishes one of n records outright, so
    it is refused, in one line naming ``privacy.delta``, n and where it comes from, unless
    ``privacy.delta_override = true``. n (:attr:`HorizontalMechanism.delta_population`): each site's
    training record count (``counts``: site -> count, as agreed at set-up or, at a site, its own) for the
    record-level mechanisms of one site; their sum for ``distributed_dp`` and for the vertical strategies
    (``records``: the label holder's training records); the number of sites for ``central_dp``. No refusal
    without DP or for a mechanism that declares no population.
    """
    population = getattr(mechanism, "delta_population", "")
    if not mechanism.private or not cfg.privacy.enabled or cfg.privacy.delta_override or not population:
        return ""
    delta = cfg.privacy.delta
    if population == "site":
        over = {site: float(n) for site, n in sorted(counts.items()) if delta > 1.0 / max(float(n), 1.0)}
        if not over:
            return ""
        where = ", ".join(f"n = {n:.0f} at site '{site}'" for site, n in over.items())
        n = max(over.values())
    else:
        n = float(sum(counts.values())) if population in ("union", "records") else float(len(counts))
        if not counts or delta <= 1.0 / n:
            return ""
        where = {"union": f"n = {n:.0f} records of {len(counts)} sites together", "sites": f"n = {n:.0f} sites",
                 "records": f"n = {n:.0f} training records"}[population]
    return (f"run config: privacy.delta = {delta:g} exceeds 1/n = {1.0 / n:.3g}: {where}, n the population strategy "
            f"'{mechanism.name}' protects ({DELTA_POPULATIONS[population]}); a delta above 1/n allows releasing a "
            f"record outright: set privacy.delta <= {1.0 / n:.3g} (well below it, e.g. 1/n^1.1), or "
            "privacy.delta_override = true to accept it")


@dataclass(frozen=True)
class SiteSetUp:
    """What the federation agreed about a site before training (the same at the server and the site).

    Attributes
    ----------
    count
        The site's record count as agreed at set-up: its FedAvg weight and, for DP-SGD, the
        ``n`` of its sampling rate ``q = B/n``.
    min_count
        The smallest agreed count of any site (NbAFL's ``m`` when ``privacy.min_site_records`` is 0).
    prior
        The site's releases at set-up as accountant history, ``(noise multiplier, 1.0, 1)`` per
        Gaussian release under the run's adjacency (empty when the set-up was exact or public):
        the mechanism composes them with its training releases.
    filter
        A deployed site with its own privacy policy (:mod:`flwr_app.site_policy`): its Rényi
        filter as it announced it at set-up, before the run's first release (:class:`SiteFilter`);
        the site's noise is calibrated to fit it too. ``None`` without one.
    """

    count: float
    min_count: float
    prior: tuple[tuple[float, float, int], ...] = ()
    filter: SiteFilter | None = None



@dataclass
class SiteUpdate:
    """What a site's step returns to the ClientApp.

    Attributes
    ----------
    report
        The figures the site sends with its update (every key is in the mechanism's manifest).
    state
        JSON-serialisable state the site keeps between rounds (its node state; the server's
        checkpoint keeps a copy for resumption). ``None`` for stateless mechanisms.
    contributes
        False when the site has nothing new to contribute (its budget is spent): the server gives
        its update weight 0.
    """

    report: dict[str, float]
    state: dict[str, Any] | None = None
    contributes: bool = True


# ---------------------------------------------------------------- what the ledger states


class LedgerStatement(ABC):
    """What the ledger states of every mechanism: the assumptions of its figures and its release manifest."""

    @abstractmethod
    def assumptions(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        """What the ledger's figures assume and do not cover, one sentence each."""

    @abstractmethod
    def manifest(self, cfg: ExperimentConfig) -> Manifest:
        """Every value a site sends in this run, covered or uncovered."""


class RoundLedger(LedgerStatement):
    """A horizontal mechanism's ledger entry of a site after a round, computed by the server from public
    configuration, the set-up it agreed with the sites and the site's reports."""

    @abstractmethod
    def ledger_entry(self, cfg: ExperimentConfig, server_round: int, site: str, *, setup: SiteSetUp,
                     reports: Sequence[Mapping[str, float] | None]) -> LedgerEntry:
        """``site``'s privacy position after ``server_round``.

        ``reports``: the site's reports of every round in which it released an update, this one
        last (``None`` where the server refused a report; the entry then takes the most an honest
        site could have spent, or no bound where none can be given).
        """


# ---------------------------------------------------------------- what the server verifies and does


class ReportVerification(ABC):
    """What the server verifies of a site's training reply: the figures it declares (:meth:`report_keys`), against
    those the server recomputes from public inputs (:meth:`expected_report`)."""

    def report_keys(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        """The figures a site sends with every training update (its report; listed in the manifest)."""
        return ()

    def expected_report(self, cfg: ExperimentConfig, *, setup: SiteSetUp,
                        previous: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
        """The figures an honest site reports after this round, recomputed from public inputs.

        ``previous``: the site's reports of the earlier rounds in which it released an update
        (``None`` where a report was refused). Only the figures the server can recompute;
        :meth:`verify` compares them with the report.
        """
        return {}

    def verify(self, cfg: ExperimentConfig, report: Mapping[str, float], *, setup: SiteSetUp,
               previous: Sequence[Mapping[str, float] | None]) -> str:
        """Why a site's report is not what the mechanism would produce ("" when it is).

        Checks that the report carries exactly the mechanism's figures (:meth:`report_keys`), as
        finite numbers, and that every figure the server can recompute (:meth:`expected_report`)
        matches to a relative 1e-6.
        """
        allowed = set(self.report_keys(cfg))
        unexpected = sorted(set(report) - allowed)
        if unexpected:
            return f"reply carries figures this mechanism does not send: {', '.join(unexpected)}"
        missing = sorted(allowed - set(report))
        if missing:
            return f"reply lacks the mechanism's figures: {', '.join(missing)}"
        for key, value in report.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                return f"{key} = {value!r} is not a finite number"
        for key, expected in self.expected_report(cfg, setup=setup, previous=previous).items():
            if not math.isclose(float(report[key]), expected, rel_tol=1e-6, abs_tol=1e-12):
                return (f"{key} = {float(report[key]):.6g} does not match {expected:.6g}, recomputed at the server "
                        "from the mechanism's parameters")
        return ""


class ServerAggregation(ABC):
    """How the server aggregates the sites' updates under a mechanism (by default FedAvg's weighted mean)."""

    def wrap_strategy(self, strategy: Strategy, cfg: ExperimentConfig, *, num_sites: int) -> Strategy:
        """The strategy that aggregates the sites' updates (a server-side mechanism wraps it)."""
        return strategy

    def min_train_sites(self, cfg: ExperimentConfig, *, num_sites: int) -> int:
        """The fewest sites whose training replies a round may aggregate."""
        return cfg.federation.min_sites

    def aggregation_weight(self, setup: SiteSetUp) -> float:
        """A site's FedAvg weight: its agreed record count (equal weights where the mechanism needs them)."""
        return float(setup.count)

    def recalibration_spread(self, cfg: ExperimentConfig, sites: int) -> float:
        """The noise std of the recalibration's summed power sums over one release's
        (:func:`~strategies.mechanisms.setup_share.recalibration_multiplier` times the sensitivity): ``sqrt(sites)``
        where each of ``sites`` sites adds all of its own noise."""
        return math.sqrt(sites)


class SecureSumServerStep(ABC):
    """The server's steps from the unmasked sums of a secure-sum mechanism (the round's, the recalibration's)."""

    @abstractmethod
    def server_step(self, arrays: Mapping[str, Any], total: Any, plan: Any, *, count: float, lr: float,
                    state: dict[str, Any] | None, sites: int | None = None,
                    count_std: float = 0.0) -> tuple[dict[str, Any] | None, dict[str, Any], str]:
        """The server's step from the unmasked sum: ``(new arrays, its state, "")``, or ``(None, state, reason)``
        when the sum is refused."""

    @abstractmethod
    def recalibration_sums(self, total: Any, plan: Any, *, count: float, sites: int,
                           count_std: float = 0.0) -> tuple[Any, str]:
        """The noisy power sums from the unmasked sum: ``(sums, "")``, or ``(None, reason)`` when it is refused."""


# ---------------------------------------------------------------- what a site runs


class SitePlan(ABC):
    """What a site plans to release over the run, checked by its policy before its first release."""

    def planned_release(self, cfg: ExperimentConfig, setup: SiteSetUp) -> tuple[tuple[float, float, int], ...]:
        """Every round's releases of a site together, as planned before the first (``()`` where the mechanism chooses
        them as it goes): a site's policy checks the plan before it releases anything."""
        return ()


class LocalSiteStep(SitePlan):
    """A site that trains from the global model and sends its own (privatised) update in a training reply."""

    @abstractmethod
    def site_round(self, model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int,
                   state: dict[str, Any] | None, setup: SiteSetUp) -> SiteUpdate:
        """One round at a site: train ``model`` in place from the global weights and privatise it."""

    def round_release(self, cfg: ExperimentConfig, setup: SiteSetUp, update: SiteUpdate,
                      previous: dict[str, Any] | None) -> tuple[tuple[float, float, int], ...] | None:
        """What a site's update of one round releases, as accountant history ``(noise multiplier, sample rate,
        steps)`` under add/remove adjacency, from what the site itself ran (``previous``: its privacy state before
        the round); ``None`` when the releases are not such a history: a site's privacy filter cannot charge them
        (:mod:`flwr_app.site_policy` refuses the mechanism)."""
        return None


class SecureSumSiteStep(SitePlan):
    """A site that sends integer vectors into a secure sum (:mod:`strategies.secure_aggregation`): the public plans
    of the round and of the recalibration, and the site's vectors."""

    @abstractmethod
    def plan(self, cfg: ExperimentConfig, *, parties: int, records: float, dim: int, setup: SiteSetUp,
             honest_sites: Sequence[float] = ()) -> Any:
        """The round's public parameters, the same at the server and every site; ``honest_sites``: the honest sites
        that the policies of the sites taking part count on (a site passes its own, the server those announced)."""

    @abstractmethod
    def recalibration_plan(self, cfg: ExperimentConfig, *, parties: int, records: float, size: int,
                           honest_sites: Sequence[float] = ()) -> Any:
        """The public plan of the recalibration's secure sum of ``size`` power sums (:mod:`models.recalibration`)."""

    @abstractmethod
    def contribution(self, model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, plan: Any, *,
                     seed: int) -> Any:
        """The site's integer vector of the round (before masking)."""

    @abstractmethod
    def recalibration_contribution(self, terms: Any, plan: Any, *, rng: Any) -> Any:
        """The site's integer vector of the recalibration sum from its records' power terms (before masking)."""

    def site_release(self, cfg: ExperimentConfig, plan: Any) -> tuple[tuple[float, float, int], ...] | None:
        """What a site's vector of one round costs, as a Gaussian history a site's filter charges; ``None`` when it
        is not such a history (:mod:`flwr_app.site_policy` refuses the mechanism)."""
        return None


# ---------------------------------------------------------------- the mechanisms


class Mechanism(LedgerStatement):
    """One privacy mechanism (or none): its checks, assumptions and release manifest.

    Instances are stateless: everything about a run comes in through the
    :class:`~strategies.config.ExperimentConfig` and the arguments, so one object serves every run
    and every process. Horizontal mechanisms are :class:`HorizontalMechanism` objects; the
    split-learning protocol's embedding mechanism has its own site and server steps
    (:mod:`strategies.mechanisms.embedding_dp`).

    Attributes
    ----------
    name
        The ``strategy.name`` it is registered under.
    unit
        What one guarantee protects: ``"record"``, ``"site"`` or ``"none"``.
    adjacencies
        The neighbouring-data-set relations offered; the first is what ``privacy.adjacency =
        "auto"`` resolves to.
    accountants
        The ``privacy.accountant`` values offered, tightest sound first (what ``"auto"`` resolves
        to). ``("rdp",)`` for a mechanism whose releases only its own (Rényi) accountant bounds.
    vertical
        True for the split-learning protocol (one modality per site).
    private
        False only for :class:`~strategies.mechanisms.none.NoPrivacy`.
    honours
        The keys of :data:`strategies.config.MECHANISM_KEYS` this mechanism reads (its row of
        :data:`strategies.mechanisms.keys.HONOURS`); any other of them must keep its default
        (:meth:`check_keys`), so a key it would ignore, or one whose effect would stack on its own,
        is refused rather than accepted.
    refusals
        Why it refuses some keys it does not honour, as the words that follow ``<key> = <value>``
        in the refusal (e.g. ``"would stack on ..."``); otherwise ``"has no effect on strategy ..."``.
    """

    name: str = ""
    unit: str = "record"
    adjacencies: tuple[str, ...] = ("add-remove",)
    accountants: tuple[str, ...] = ("rdp",)
    vertical: bool = False
    private: bool = True
    refusals: Mapping[str, str] = {}

    @property
    def honours(self) -> frozenset[str]:
        return HONOURS[self.name]

    # ---------------------------------------------------------------- configuration

    def check(self, cfg: ExperimentConfig) -> None:
        """Refuse a configuration this mechanism cannot honour (``ConfigError`` naming the key).

        The base checks: a DP mechanism needs a finite ``privacy.epsilon``, the adjacency must be
        one the mechanism's accountant bounds, and ``privacy.accountant`` one it offers.
        """
        if self.private and not cfg.privacy.enabled:
            raise ConfigError(f"run config: strategy '{self.name}' needs a finite 'privacy.epsilon' (the target "
                              "budget)")
        if cfg.privacy.adjacency not in self.adjacencies:
            raise ConfigError(
                f"run config: privacy.adjacency = {cfg.privacy.adjacency!r} is not offered for strategy "
                f"'{self.name}'; its accountant bounds {' or '.join(self.adjacencies)} neighbours")
        if self.private:
            self.check_accountant(cfg)

    def check_keys(self, cfg: ExperimentConfig) -> None:
        """Refuse, in one line naming the key, its value, the strategy and why, any key of
        :data:`~strategies.config.MECHANISM_KEYS` that this mechanism does not honour (:attr:`honours`) at a value
        but its default for the run (``auto`` resolved for the run's strategy, model and data set)."""
        default = run_defaults(cfg)
        for name in mechanism_keys():
            value = key_value(cfg, name)
            if name in self.honours or value == default[name]:
                continue
            why = self.refusals.get(name, f"has no effect on strategy '{self.name}'")
            keep = show_value(default[name])
            if KEYS[name].setting.auto and keep != AUTO:
                keep = f"{AUTO} (here {keep})"
            others = takers(name)
            raise ConfigError(f"run config: {name} = {show_value(value)} {why}; leave it at {keep}; "
                              + (f"honoured by {', '.join(others)}" if others else "no strategy honours it"))

    def check_accountant(self, cfg: ExperimentConfig) -> None:
        """``privacy.accountant`` must be one of :attr:`accountants` (``ConfigError`` naming the key)."""
        if cfg.privacy.enabled and cfg.privacy.accountant not in self.accountants:
            raise ConfigError(
                f"run config: privacy.accountant = {cfg.privacy.accountant!r} is not offered for strategy "
                f"'{self.name}' (offered: {', '.join(self.accountants)}; 'auto': {self.accountants[0]}); "
                "docs/privacy.md, 'Accounting', says which accountant bounds which mechanism")


class HorizontalMechanism(Mechanism, RoundLedger, ReportVerification, ServerAggregation):
    """A mechanism of a horizontal federation: what the server checks and accounts, whatever the site sends.

    A site sends either its own update in a training reply (:class:`LocalUpdateMechanism`: the
    site's :meth:`~LocalUpdateMechanism.site_round`) or an integer vector into a secure sum
    (:class:`SecureSumMechanism`: the round's plan, the site's contribution, the server's step).
    Subclasses implement :meth:`ledger_entry`, :meth:`assumptions` and :meth:`manifest`, and
    declare the figures a site reports (:meth:`report_keys`) and those the server recomputes
    (:meth:`expected_report`).

    Attributes
    ----------
    pooled_baseline
        True when the centralised baseline runs this mechanism on the pooled training data (one
        site holding every record); otherwise it trains without DP.
    server_side
        True when the server adds the noise (through :meth:`wrap_strategy`).
    private_setup
        True when the run's set-up statistics (record counts, clip ranges and standardisation,
        time grid) are released with DP and composed with training
        (:mod:`strategies.mechanisms.setup_statistics`; ``privacy.setup_share``): the mechanism
        honours ``privacy.setup_share`` (:func:`~strategies.mechanisms.keys.has_private_setup`).
    delta_population
        Whose count ``n`` bounds ``privacy.delta`` (δ > 1/n is refused, :func:`delta_refusal`).
    """

    pooled_baseline: bool = False
    server_side: bool = False
    #: Whose count n bounds ``privacy.delta`` (:func:`delta_refusal`, :data:`DELTA_POPULATIONS`): ``"site"`` (each
    #: site's records), ``"union"`` (all sites' records), ``"sites"`` (the number of sites) or ``""`` (no DP).
    delta_population: str = "site"

    @property
    def private_setup(self) -> bool:
        return has_private_setup(self.name)

    def check(self, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.privacy.enabled and self.uses_private_setup(cfg):  # before any site releases anything
            from strategies.accounting.rdp import floor_refusal  # no pandas: the set-up's own module is not needed

            if refusal := floor_refusal(epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta,
                                        what="the private set-up's RDP accounting"):
                raise ConfigError(refusal)
        if cfg.data.dictionary and not self.uses_private_setup(cfg):
            raise ConfigError(
                f"run config: 'data.dictionary' = {cfg.data.dictionary!r} makes the private set-up's ranges, levels "
                f"and time grid public; strategy '{self.name}' with privacy.setup_share = {cfg.privacy.setup_share:g} "
                "has no private set-up (dp_sgd, bdp and distributed_dp do, with privacy.setup_share > 0)")
        if cfg.data.deployed and cfg.resume_from and self.uses_private_setup(cfg):
            raise ConfigError(
                "run config: 'resume.from' in a deployment would run the private set-up again: a second release of "
                "the set-up statistics that the ledger does not count, and a different preprocessing; resuming a "
                "deployed run needs privacy.setup_share = 0 (an exact set-up, not covered by epsilon)")

    def uses_private_setup(self, cfg: ExperimentConfig) -> bool:
        """Whether the run agrees its set-up with DP (:attr:`private_setup` and ``privacy.setup_share`` > 0)."""
        return self.private_setup and cfg.privacy.setup_share > 0


class LocalUpdateMechanism(HorizontalMechanism, LocalSiteStep):
    """A mechanism whose site trains from the global model and sends its (privatised) update in a training reply."""


class SecureSumMechanism(HorizontalMechanism, SecureSumSiteStep, SecureSumServerStep):
    """A mechanism whose sites send integer vectors into a secure sum (:mod:`strategies.secure_aggregation`); the
    server sees only the sum. Each round: the public :meth:`plan`, each site's :meth:`contribution`, and the
    server's :meth:`server_step` from the unmasked sum."""


def horizontal_manifest(mechanism: HorizontalMechanism, cfg: ExperimentConfig, own: Iterable[ReleasedValue], *,
                        record_level: bool | None = None) -> Manifest:
    """A horizontal mechanism's manifest: its ``own`` releases and those every horizontal mechanism shares
    (:func:`~strategies.mechanisms.manifest.common_releases`); ``record_level`` defaults to its unit being a record."""
    record_level = mechanism.unit == "record" if record_level is None else record_level
    releases = list(own) + common_releases(cfg, private=mechanism.private, record_level=record_level,
                                           private_setup=mechanism.uses_private_setup(cfg),
                                           secure_sum=isinstance(mechanism, SecureSumMechanism))
    return Manifest(mechanism.name, mechanism.unit, tuple(releases))
