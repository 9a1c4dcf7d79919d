r"""Differentially private set-up statistics of a horizontal federation.

Before training, the sites agree on the parts of the model computed from their data: the feature
preprocessing (numeric clip ranges, means and standard deviations; categorical levels), the
discrete time grid, CoxTime's time scale and each site's record count (FedAvg weight, DP-SGD
sampling rate). Each of them is either **public**, taken from a data dictionary
(:class:`models.data.dictionary.DataDictionary`, no privacy cost), or **differentially
private**, computed here: every site releases noisy sums of its training records, the server adds
the sites' releases and derives everything from the sums (post-processing). No set-up value then
depends on the data except through the noisy releases, so DP-SGD's per-record sensitivity
argument holds for the encoded records.

Protocol (two passes; :class:`SetupPlan` is the public configuration, the same everywhere)
-----------------------------------------------------------------------------------------------
1. :func:`release_ranges` at each site (a :class:`RangeRelease`):

   ``record_count``
       :math:`n + \mathcal N(0, s^2)`.
   ``time_range``
       When no public time range exists, the counts of the training times in the bins of the
       public symmetric log grid :func:`range_edges` (:math:`\pm 10^{-3} \dots \pm 10^{9}`,
       ``RANGE_BINS_PER_DECADE`` bins a decade, a central bin around 0; values beyond the
       outermost edges counted in the outermost bins), each count plus noise. Its own release:
       a run cannot go on without a time range.
   ``range_histograms``
       The same histogram of the non-missing values of every numeric column without a public
       range, plus noise.
   levels
       The site's set of levels of every categorical column without public levels. **Not
       private**: this is schema, released as is.

2. :func:`agree_ranges` at the server, on the sum of the sites' range releases, with
   :math:`\sigma` the standard deviation of the summed noise per bin: a column's range starts
   from the windows of :math:`w` adjacent bins whose summed count exceeds
   ``RANGE_THRESHOLD`` :math:`\cdot \sigma \sqrt w`, at the narrowest :math:`w` of
   ``RANGE_WINDOWS`` where any window does (a histogram of pure noise passes with probability
   about :math:`2 \cdot 10^{-5}`), from the first such window to the last; it then grows outward
   one bin at a time while the next ``RANGE_EXTEND_WINDOW`` bins together exceed
   ``RANGE_EXTEND_THRESHOLD`` times their noise. The range is the lower edge of its first bin to
   the upper edge of its last; without noise, exactly the bins holding values, so nothing is
   clipped. Where no window passes, the fallback takes the window that stands the most noise
   standard deviations out if that is at least ``SCAN_THRESHOLD`` (``AgreedRanges.fallbacks``:
   ``"scan"``), and otherwise leaves the column out of the model (``"left out"``); both are
   said in one console line (:meth:`AgreedRanges.describe`) and in the ledger, and the left-out
   columns in ``summary.json``. Where every column would be left out, :func:`check_inputs`
   stops the run before the second pass (:class:`SetupNoiseError`). The time range is
   ``[0, upper edge]`` (the same fallback; with none, :class:`SetupNoiseError`). The number of
   time-histogram intervals,
   :func:`time_bins`, follows from the summed noisy count and the noise. Sent back to the sites
   (post-processing).

3. :func:`release_moments` at each site (a :class:`MomentRelease`):

   ``time_histogram``
       Events and censorings in the intervals of :func:`time_edges` over the time range (public
       or from step 2): half equal, half log-spaced from a thousandth of the range, as many as
       the noise allows; a time beyond the range counts as a censoring in the last interval (as
       :func:`models.survival.discretise` treats it). Plus noise.
   ``feature_moments``
       For every numeric column without a public range (every numeric column with
       ``SetupPlan.ranged_moments``), with
       :math:`v = (\mathrm{clip}(x, lo, hi) - m) / h \in [-1, 1]`
       (:math:`m, h` the range's midpoint and half-width): :math:`\sum v`, :math:`\sum v^2`
       and the number of non-missing values, each plus noise.

4. :func:`shared_setup` at the server, on the sums: the :class:`~models.data.Preprocessor`
   (a public range scales its column to ``[-1, 1]``, or with ``ranged_moments`` clips to it and
   standardises with the noisy mean and standard deviation; a private one clips to it and standardises
   with the noisy mean and standard deviation), the time grid (quantiles of the denoised event
   counts, each interval counting at least one noise standard deviation of events, interpolated
   within intervals: :func:`models.time_grid.event_quantile_grid`), the time scale (mean and
   standard deviation of the denoised histogram) and the denoised counts (``SharedSetup.time_counts``:
   the hazard model's start and the recalibration's target, :func:`recalibration_plan`).

Sensitivities (L2, one record of the site) and noise
----------------------------------------------------
=====================  ======================  =====================
release                add/remove one record   replace one record
=====================  ======================  =====================
``record_count``       1                       0
``time_range``         1                       :math:`\sqrt 2`
``range_histograms``   :math:`\sqrt{h}`        :math:`\sqrt{2h}`
``time_histogram``     1                       :math:`\sqrt 2`
``feature_moments``    :math:`\sqrt{3k}`       :math:`2\sqrt{k}`
=====================  ======================  =====================

with :math:`h` feature histograms and :math:`k` columns with moments. A record adds 1 to one bin of each
histogram; its moments :math:`(v, v^2, 1)` have norm at most :math:`\sqrt 3` per column; replacing
it moves one count per histogram (:math:`\sqrt 2`) and changes a column's moments by at most
:math:`\max_{v, u \in [-1, 1]} \lVert (v - u, v^2 - u^2, 0) \rVert = 2` (:math:`v = 1, u = -1`;
a missing value on one side gives at most :math:`\sqrt 3`). Each bound is attained.

One knob, the set-up noise multiplier :math:`z` (``SetupPlan.noise_multiplier``): release
:math:`i` adds :math:`\mathcal N(0, (z_i \Delta_i)^2 I)` with :math:`\Delta_i` its sensitivity
under the plan's adjacency and :math:`z_i = z / \sqrt{w_i}`, where the weights ``RELEASE_WEIGHTS``
of the releases made (those with :math:`\Delta_i > 0`) are normalised to sum to 1. Each release
is a Gaussian mechanism with noise multiplier :math:`z_i`, RDP :math:`\alpha / (2 z_i^2)`; a
site's releases compose (adaptively: pass 2 depends on pass 1's output) to
:math:`\sum_i \alpha / (2 z_i^2) = \alpha / (2 z^2)`, i.e. exactly one Gaussian mechanism with
noise multiplier :math:`z`. :func:`setup_releases` lists them (name, noise std, sensitivity per
adjacency) from the plan alone, so the server recomputes what each site spent. Under replace-one
adjacency the record count is public and released exactly.

Each site adds its own full noise (the server sees every site's release), so a sum over
:math:`K` sites carries :math:`\sqrt K` times the noise of one. The noise is drawn from the
``numpy.random.Generator`` the caller passes (from OS entropy in a deployment).

Through a secure sum (:class:`SecureSetup`: ``distributed_dp``; ``dp_sgd`` with ``privacy.setup_sum = secure``)
--------------------------------------------------------------------------------------------------------------
Where the run's mechanism has a secure sum, or a ``dp_sgd`` run chooses one for its set-up
(:meth:`strategies.mechanisms.dp_sgd.DPSGD.setup_sum`, from the run config alone), every release but the record count
(:data:`SECURE_RELEASES`) goes through SecAgg+ with the distributed discrete Gaussian instead: each
site sends, masked, the sum over its records of their rounded scaled vectors (a one-hot bin per
histogram; :math:`(v, v^2, 1)` per column) plus its discrete Gaussian share
(:func:`secure_contribution`; one vector per pass), and the server sees only the sum
(:func:`secure_ranges_sum`, :func:`secure_moments_sum`). Release :math:`i`'s plan is
:func:`strategies.mechanisms.distributed_dp.gaussian_sum_plan` at its multiplier :math:`z_i` and
its add/remove sensitivity above as the per-record L2 bound, so its RDP over any
:math:`k - D - t` honest survivors' shares is at most the Gaussian entry ``(z_i, 1, 1)``: the
accounting is unchanged, and the summed noise is about one Gaussian's, :math:`z_i \Delta_i \sqrt{k /
(k - D - t)}` per value with all :math:`k` sites in the sum (:func:`summed_noise`, the plan's figure,
which every threshold and floor above then uses), instead of :math:`z_i \Delta_i \sqrt k`. The record count stays a release of each site with its own noise:
the server weighs and bounds every later secure sum of the run by the agreed counts of the sites
included in it. Each sum's unmasked total is refused, in one line, when it is beyond what honest
sites can produce (:meth:`~strategies.mechanisms.distributed_dp.RoundPlan.refusal`);
:func:`implausible_ranges` needs a site's own release and does not apply.

The trust this takes: a summed release's bound holds for a site while :math:`k - D - t` of the :math:`k` summed
sites are honest survivors and SecAgg+ holds (honest-but-curious server); per site, a release's bound holds
whatever the other sites do. For ``distributed_dp`` that is the assumption its training makes already; for
``dp_sgd`` it is the one place its guarantee rests on the other sites (its training noise is the site's own), so
a dp_sgd run says which it chose in its ledger and manifest.

Denoising (post-processing): the summed time histogram's counts become non-negative by isotonic
regression of their cumulative sums (anchored at 0), which removes negative counts without the
upward bias of clamping each count at 0; a feature's noisy mean is clipped to its range and its
noisy variance floored at the noise level of :math:`\sum v^2 / n` (a column whose spread is
below the noise, e.g. a calendar year on a range of centuries, is better given a public range).

The budget
----------
The run's set-up noise multiplier is :func:`~strategies.accounting.setup_budget.setup_noise_multiplier` of ``privacy.epsilon``,
``privacy.delta`` and ``privacy.setup_share``: the set-up spends that share of the RDP budget of a
Gaussian mechanism spending the whole ε, so a larger ε gives finer statistics. A hazard model's
run also plans a recalibration release after training from the same share
(:data:`~strategies.accounting.setup_budget.RECALIBRATION_SHARE` of it; :func:`strategies.mechanisms.setup_share.setup_multiplier`). How often
a set-up falls back or stops over data sets, budgets and federations:
``python -m benchmarks.setup_failures``; how the share was chosen: ``python -m
benchmarks.setup_share`` (validation splits through the apps).

References
----------
Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", FnT TCS 9, 2014 (Gaussian
mechanism, histograms); Mironov, "Rényi Differential Privacy", CSF 2017 (Gaussian RDP,
adaptive composition); Hay, Rastogi, Miklau & Suciu, "Boosting the Accuracy of Differentially
Private Histograms Through Consistency", VLDB 2010 (isotonic post-processing of noisy counts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from models.data.dictionary import DataDictionary
from models.data.preprocess import RELATIVE_VARIANCE_FLOOR, Preprocessor, category_keys, is_numeric_feature
from models.recalibration import EXPONENTS
from models.time_grid import event_quantile_grid, histogram_survival
from strategies.accounting.setup_budget import setup_budget_refusal, setup_noise_multiplier
from strategies.config import ConfigError

__all__ = [
    "ADJACENCIES",
    "accountant_history",
    "agreed_count",
    "implausible_ranges",
    "modular_sum",
    "noisy_count",
    "run_secure_setup",
    "run_setup",
    "secure_contribution",
    "secure_moments_sum",
    "secure_ranges_sum",
    "secure_segments",
    "site_levels",
    "summed_noise",
    "DEFAULT_SETUP_NOISE_MULTIPLIER",
    "SECURE_RELEASES",
    "SecureSetup",
    "AgreedRanges",
    "MomentRelease",
    "RangeRelease",
    "Release",
    "SetupNoiseError",
    "SetupPlan",
    "SharedSetup",
    "agree_ranges",
    "check_inputs",
    "monotone_counts",
    "range_edges",
    "release_moments",
    "release_ranges",
    "setup_budget_refusal",
    "setup_noise_multiplier",
    "setup_releases",
    "shared_setup",
    "time_edges",
]

ADJACENCIES = ("add-remove", "replace-one")
#: Decades of the public symmetric log grid of the range histograms: ±10^-3 … ±10^9.
RANGE_DECADES = (-3, 9)
#: Bins per decade of the range grid (adjacent edges differ by the factor 10^(1/b)).
RANGE_BINS_PER_DECADE = 5
#: A range's core spans the windows of adjacent bins whose summed noisy count exceeds this many
#: noise standard deviations, at the narrowest of ``RANGE_WINDOWS`` where any does …
RANGE_THRESHOLD = 5.5
RANGE_WINDOWS = (1, 2, 4, 8, 16, 32)
#: … and grows outward by one bin while the next ``RANGE_EXTEND_WINDOW`` bins together exceed
#: this many noise standard deviations (of their sum).
RANGE_EXTEND_THRESHOLD = 1.5
RANGE_EXTEND_WINDOW = 4
#: The time histogram's intervals over ``[0, T]`` (:func:`time_edges`): as many as the noise allows
#: (:func:`time_bins`: about ``TIME_BIN_SIGNAL`` noise standard deviations of records per
#: interval), between ``TIME_BINS_MIN`` and ``TIME_BINS_MAX``; half of them equal, half
#: log-spaced from ``T * TIME_LOG_START`` (resolution where early events are).
TIME_BINS_MIN = 8
TIME_BINS_MAX = 100
TIME_BIN_SIGNAL = 4.0
TIME_LOG_START = 1e-3
#: The Kaplan-Meier curve of the time histogram ends at the last interval whose number at risk
#: exceeds this many noise standard deviations; later records count as censored there.
TAIL_THRESHOLD = 2.0
#: Shares of the set-up's privacy (1 / z_i^2 = w_i / z^2) of each release made.
RELEASE_WEIGHTS: Mapping[str, float] = {
    "record_count": 0.05, "time_range": 0.2, "range_histograms": 0.3, "time_histogram": 0.3, "feature_moments": 0.15,
}
#: When no window of a range histogram passes ``RANGE_THRESHOLD``, the fallback takes the window
#: whose summed count is the most noise standard deviations above 0, if that is at least this many
#: (pure noise reaches it in a few per cent of histograms); below it a feature column is left out.
SCAN_THRESHOLD = 4.0
#: The recalibration's horizons: these quantiles of the agreed follow-up.
RECALIBRATION_QUANTILES = (0.25, 0.5, 0.75)
#: The recalibration is planned only where the summed noise of a power sum is at most this share of the
#: records (the mean predicted survival it gives is then within about this much of the truth).
RECALIBRATION_MAX_ERROR = 0.03
#: Default set-up noise multiplier z of a bare :class:`SetupPlan` (the runs derive theirs from
#: ``privacy.setup_share``: :func:`setup_noise_multiplier`).
DEFAULT_SETUP_NOISE_MULTIPLIER = 10.0
_SCHEMES = ("quantiles", "equidistant")
#: How a range that did not pass the test was settled (:class:`AgreedRanges`).
FALLBACKS = ("scan", "left out")


def range_edges(bins_per_decade: int = RANGE_BINS_PER_DECADE, decades: tuple[int, int] = RANGE_DECADES) -> np.ndarray:
    r"""Public, data-independent edges :math:`-10^{b} < \dots < -10^{a} < 10^{a} < \dots < 10^{b}`.

    ``bins_per_decade`` log-spaced bins per decade on each side and one central bin
    :math:`[-10^a, 10^a)` holding 0; ``(a, b) = decades``.
    """
    low, high = decades
    positive = 10.0 ** np.linspace(low, high, (high - low) * bins_per_decade + 1)
    return np.concatenate([-positive[::-1], positive])


def time_edges(time_max: float, bins: int = TIME_BINS_MAX) -> np.ndarray:
    """Edges of the time histogram over ``[0, time_max]``: the union of ``bins // 2`` equal
    intervals and ``bins - bins // 2`` log-spaced ones from ``time_max * TIME_LOG_START``, so that
    early events get intervals down to a thousandth of the range. Public: a function of the
    agreed ``time_max`` and ``bins`` only (``bins`` intervals unless two edges coincide)."""
    if not TIME_BINS_MIN <= bins <= TIME_BINS_MAX:
        raise ValueError(f"time histogram bins must be in [{TIME_BINS_MIN}, {TIME_BINS_MAX}], got {bins}")
    linear = np.linspace(0.0, 1.0, bins // 2 + 1)
    log = np.geomspace(TIME_LOG_START, 1.0, bins - bins // 2 + 1)
    return float(time_max) * np.unique(np.concatenate([linear, log]))


def time_bins(plan: SetupPlan, count: float, sites: int, *, std: float | None = None) -> int:
    """Intervals of the time histogram for ``count`` records (the summed noisy record count, public
    after pass 1) over ``sites`` sites: about ``TIME_BIN_SIGNAL`` summed noise standard deviations
    of records per interval, within ``[TIME_BINS_MIN, TIME_BINS_MAX]`` (the most without noise).
    More budget, less noise: a finer histogram. ``std``: the summed noise of the time histogram where a
    secure sum gives it (:func:`summed_noise`); by default ``sites`` sites' own noise."""
    if std is None:
        std = math.sqrt(sites) * plan.noise_std("time_histogram")
    if std == 0:
        return TIME_BINS_MAX
    return int(np.clip(math.floor(max(count, 0.0) / (TIME_BIN_SIGNAL * std)), TIME_BINS_MIN, TIME_BINS_MAX))


def _bin_counts(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Counts of ``values`` in ``[edges[j], edges[j+1])``; values outside go to the outermost bins."""
    bins = edges.size - 1
    index = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, bins - 1)
    return np.bincount(index, minlength=bins).astype(np.float64)


def monotone_counts(noisy: np.ndarray) -> np.ndarray:
    r"""Non-negative counts whose cumulative sums are the isotonic (L2) fit of the noisy ones.

    :math:`\hat c = \mathrm{diff}(\hat F)` where :math:`\hat F` is the non-decreasing sequence
    closest to :math:`(0, c_1, c_1 + c_2, \dots)` with its first element held at 0 (pool
    adjacent violators). Exact counts are returned unchanged.
    """
    from scipy.optimize import isotonic_regression  # scipy.optimize (~0.3 s): the server's set-up only, not a site's

    noisy = np.asarray(noisy, dtype=np.float64)
    cumulative = np.concatenate(([0.0], np.cumsum(noisy)))
    weights = np.ones_like(cumulative)
    weights[0] = 1e9 * cumulative.size  # pins the fit's start at 0
    fit = isotonic_regression(cumulative, weights=weights, increasing=True).x
    return np.maximum(np.diff(fit), 0.0)


class SetupNoiseError(ValueError):
    """The set-up noise hides a column's values entirely: it needs a public range (or less noise)."""


@dataclass(frozen=True)
class Release:
    """One Gaussian release of a site: a vector plus :math:`\\mathcal N(0, \\text{noise\\_std}^2 I)`.

    ``sensitivity`` maps each adjacency (``"add-remove"``, ``"replace-one"``) to the L2
    sensitivity of the vector to one record of the site.
    """

    name: str
    size: int
    noise_std: float
    sensitivity: Mapping[str, float]

    def noise_multiplier(self, adjacency: str) -> float:
        """``noise_std / sensitivity`` under ``adjacency`` (``inf`` when the sensitivity is 0: no cost).

        The release's RDP is :math:`\\alpha / (2 z^2)` (opacus ``compute_rdp(q=1, noise_multiplier=z, steps=1)``).
        """
        if adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {adjacency!r}")
        sensitivity = self.sensitivity[adjacency]
        return math.inf if sensitivity == 0 else self.noise_std / sensitivity


@dataclass(frozen=True)
class SetupPlan:
    """Public configuration of the set-up releases; every site and the server build the same one.

    Attributes
    ----------
    columns
        Feature columns in order (schema).
    numeric
        The numeric (standardised) ones; the others are categorical (one-hot). Schema.
    noise_multiplier
        Set-up noise multiplier :math:`z \\ge 0`: all releases of a site together are one Gaussian
        mechanism with this multiplier under ``adjacency``. 0 releases exact sums (no privacy;
        for reference runs only).
    adjacency
        ``"add-remove"`` or ``"replace-one"``: the sensitivities the noise is scaled to.
    dictionary
        Public ranges, levels, time grid or time range; ``None``: everything is private.
    time_grid
        Scheme of the time grid, ``"quantiles"`` or ``"equidistant"`` (with a public time
        range, an equidistant grid needs no release).
    ranged_moments
        Whether the numeric columns with a public range release their moments too (``True``: every
        numeric column is standardised by its noisy mean and standard deviation, clipped to its public
        range; ``False``: a public range gives the centre and spread, its midpoint and half-width).
    """

    columns: tuple[str, ...]
    numeric: frozenset[str]
    noise_multiplier: float = DEFAULT_SETUP_NOISE_MULTIPLIER
    adjacency: str = "add-remove"
    dictionary: DataDictionary | None = None
    time_grid: str = "quantiles"
    ranged_moments: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(map(str, self.columns)))
        object.__setattr__(self, "numeric", frozenset(map(str, self.numeric)))
        if not self.numeric <= set(self.columns):
            raise ValueError(f"numeric columns {sorted(self.numeric - set(self.columns))} are not among the columns")
        z = float(self.noise_multiplier)
        if not math.isfinite(z) or z < 0:
            raise ValueError(f"set-up noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}")
        if self.adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {self.adjacency!r}")
        if self.time_grid not in _SCHEMES:
            raise ValueError(f"time_grid must be one of {_SCHEMES}, got {self.time_grid!r}")
        if self.dictionary is not None:
            self.dictionary.check_columns(self.numeric, set(self.categorical))

    @classmethod
    def for_features(cls, features: pd.DataFrame, **options: Any) -> SetupPlan:
        """The plan for a table's schema (numeric = :func:`~models.data.preprocess.is_numeric_feature`)."""
        numeric = frozenset(str(c) for c in features.columns if is_numeric_feature(features[c]))
        return cls(tuple(map(str, features.columns)), numeric, **options)

    @property
    def categorical(self) -> tuple[str, ...]:
        """Categorical columns, in order."""
        return tuple(c for c in self.columns if c not in self.numeric)

    @property
    def private_numeric(self) -> tuple[str, ...]:
        """Numeric columns without a public range (range histogram and moments released), in order."""
        public = self.dictionary.numeric if self.dictionary else {}
        return tuple(c for c in self.columns if c in self.numeric and c not in public)

    @property
    def moment_columns(self) -> tuple[str, ...]:
        """Numeric columns whose moments are released, in order: those without a public range, and with
        ``ranged_moments`` every numeric column."""
        if self.ranged_moments:
            return tuple(c for c in self.columns if c in self.numeric)
        return self.private_numeric

    @property
    def private_levels(self) -> tuple[str, ...]:
        """Categorical columns without public levels (each site sends its set of levels)."""
        public = self.dictionary.categorical if self.dictionary else {}
        return tuple(c for c in self.categorical if c not in public)

    @property
    def releases_time_histogram(self) -> bool:
        """Whether the grid or time scale needs the time histogram (no public grid; no public
        time range with an equidistant grid)."""
        d = self.dictionary
        return not (d is not None and (d.time_grid is not None or (d.time_max is not None
                                                                    and self.time_grid == "equidistant")))

    @property
    def releases_time_range(self) -> bool:
        """Whether the training times get a range histogram (time histogram without public time range)."""
        return self.releases_time_histogram and (self.dictionary is None or self.dictionary.time_max is None)

    def releases(self) -> tuple[Release, ...]:
        """See :func:`setup_releases`."""
        histograms = len(self.private_numeric)
        moments = len(self.moment_columns)
        bins = range_edges().size - 1
        candidates = [("record_count", 1, 1.0, 0.0)]
        if self.releases_time_range:
            candidates.append(("time_range", bins, 1.0, math.sqrt(2)))
        if histograms:
            candidates.append(("range_histograms", histograms * bins, math.sqrt(histograms),
                               math.sqrt(2 * histograms)))
        if self.releases_time_histogram:
            candidates.append(("time_histogram", 2 * TIME_BINS_MAX, 1.0, math.sqrt(2)))
        if moments:
            candidates.append(("feature_moments", 3 * moments, math.sqrt(3 * moments), 2 * math.sqrt(moments)))
        sensitivities = [{"add-remove": ar, "replace-one": ro} for _, _, ar, ro in candidates]
        noisy = [s[self.adjacency] > 0 for s in sensitivities]
        total = sum(RELEASE_WEIGHTS[name] for (name, *_), made in zip(candidates, noisy) if made)
        releases = []
        for (name, size, *_), sensitivity, made in zip(candidates, sensitivities, noisy):
            z_i = self.noise_multiplier / math.sqrt(RELEASE_WEIGHTS[name] / total) if made else 0.0
            releases.append(Release(name, size, z_i * sensitivity[self.adjacency], sensitivity))
        return tuple(releases)

    def noise_std(self, name: str) -> float:
        """Noise standard deviation of release ``name`` at one site (0 when it is not made)."""
        return next((r.noise_std for r in self.releases() if r.name == name), 0.0)


def setup_releases(plan: SetupPlan) -> tuple[Release, ...]:
    """The Gaussian releases a site makes under ``plan``, in order: ``record_count``, then
    ``time_range``, ``range_histograms``, ``time_histogram``, ``feature_moments`` where made.

    A function of the public plan only: the server and each site get the same list. Their
    noise multipliers under ``plan.adjacency`` compose by RDP to ``plan.noise_multiplier``
    (:math:`\\sum_i z_i^{-2} = z^{-2}`; a release with sensitivity 0, the record count under
    replace-one, is exact and costs nothing).
    """
    return plan.releases()


def _noisy(values: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    return values + rng.normal(0.0, std, values.shape) if std > 0 else values.copy()


def _numeric_values(series: pd.Series) -> np.ndarray:
    values = pd.to_numeric(series, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
    return values[~np.isnan(values)]


def _check_vector(value: Any, size: int, what: str) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.shape != (size,) or not np.all(np.isfinite(array)):
        raise ValueError(f"{what} must be {size} finite numbers, got shape {array.shape}")
    return array


@dataclass(frozen=True)
class RangeRelease:
    """Pass 1 of one site (or the sum over ``sites`` sites): noisy count, noisy range histograms
    on :func:`range_edges`, and the (not private) sets of category levels."""

    count: float
    histograms: Mapping[str, np.ndarray]
    time: np.ndarray | None
    levels: Mapping[str, tuple[str, ...]]
    sites: int = 1
    #: Noise standard deviation of each release in it (``time_range``, ``range_histograms``) where a secure sum
    #: set it (:func:`secure_ranges_sum`); ``None``: each of the ``sites`` sites added its own, the plan's.
    noise: Mapping[str, float] | None = None

    def __add__(self, other: RangeRelease) -> RangeRelease:
        if set(self.histograms) != set(other.histograms) or (self.time is None) != (other.time is None):
            raise ValueError("cannot add range releases of different plans")
        if self.noise is not None or other.noise is not None:
            raise ValueError("a secure sum's release is the sum already: it is not added to another")
        return RangeRelease(
            self.count + other.count,
            {c: h + other.histograms[c] for c, h in self.histograms.items()},
            None if self.time is None else self.time + other.time,
            {c: tuple(sorted(set(k) | set(other.levels[c]))) for c, k in self.levels.items()},
            self.sites + other.sites,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form of one site's release (what a deployed site sends); :meth:`from_dict` inverts it."""
        return {"count": self.count, "histograms": {c: h.tolist() for c, h in self.histograms.items()},
                "time": None if self.time is None else self.time.tolist(),
                "levels": {c: list(k) for c, k in self.levels.items()}}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any], plan: SetupPlan, *, secure: bool = False) -> RangeRelease:
        """One site's release from :meth:`to_dict`'s form, checked against ``plan`` (keys, sizes, finite numbers);
        ``secure``: its histograms go through the secure sum, so it holds the count and levels only.

        Raises
        ------
        ValueError
            Naming what does not fit the plan.
        """
        bins = range_edges().size - 1
        if set(payload["histograms"]) != (set() if secure else set(plan.private_numeric)):
            raise ValueError(f"range histograms for columns {sorted(payload['histograms'])}, expected "
                             f"{[] if secure else list(plan.private_numeric)}")
        if set(payload["levels"]) != set(plan.private_levels):
            raise ValueError(f"levels for columns {sorted(payload['levels'])}, expected {list(plan.private_levels)}")
        if (payload["time"] is None) == (plan.releases_time_range and not secure):
            raise ValueError("time range histogram present where the plan has none, or missing")
        count = float(payload["count"])
        if not math.isfinite(count):
            raise ValueError(f"record count must be a finite number, got {payload['count']!r}")
        return cls(
            count,
            {str(c): _check_vector(h, bins, f"range histogram of '{c}'") for c, h in payload["histograms"].items()},
            None if payload["time"] is None else _check_vector(payload["time"], bins, "time range histogram"),
            {str(c): tuple(sorted(map(str, k))) for c, k in payload["levels"].items()},
        )


@dataclass(frozen=True)
class AgreedRanges:
    """Clip range of every numeric column (public or private) and the end of the time histogram
    (``None`` when none is released). What the server sends the sites between the passes.

    ``fallbacks`` maps a column (or ``"time"``) whose range did not pass the test of
    :func:`agree_ranges` to how it was found (``"scan"``) or that it is ``"left out"`` of the
    model: a left-out column keeps a nominal range (its moments are still released, so the plan
    stays public) but the agreed preprocessing does not use it.
    """

    features: Mapping[str, tuple[float, float]]
    time_max: float | None
    fallbacks: Mapping[str, str] = field(default_factory=dict)
    #: Intervals of the time histogram (:func:`time_bins`; ``None`` when none is released).
    time_bins: int | None = None

    def __post_init__(self) -> None:
        # The sensitivities hold for any ranges; these checks only keep the arithmetic finite.
        for column, (lo, hi) in self.features.items():
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"range of column '{column}' must be finite [lo, hi] with lo < hi, got [{lo}, {hi}]")
        if self.time_max is not None and not (math.isfinite(self.time_max) and self.time_max > 0):
            raise ValueError(f"time_max must be a finite number > 0, got {self.time_max}")
        if self.time_bins is not None and not TIME_BINS_MIN <= self.time_bins <= TIME_BINS_MAX:
            raise ValueError(f"time_bins must be in [{TIME_BINS_MIN}, {TIME_BINS_MAX}], got {self.time_bins}")
        for column, how in self.fallbacks.items():
            if how not in FALLBACKS or (column not in self.features and column != "time"):
                raise ValueError(f"fallback of '{column}' must be one of {FALLBACKS} for a column or 'time', got {how!r}")

    @property
    def left_out(self) -> frozenset[str]:
        """Columns the agreed preprocessing leaves out (no range stood out of the noise)."""
        return frozenset(c for c, how in self.fallbacks.items() if how == "left out")

    def to_dict(self) -> dict[str, Any]:
        return {"features": {c: list(r) for c, r in self.features.items()}, "time_max": self.time_max,
                "fallbacks": dict(self.fallbacks), "time_bins": self.time_bins}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> AgreedRanges:
        time_max = payload["time_max"]
        bins = payload.get("time_bins")
        return cls({str(c): (float(lo), float(hi)) for c, (lo, hi) in payload["features"].items()},
                   None if time_max is None else float(time_max),
                   {str(c): str(how) for c, how in payload.get("fallbacks", {}).items()},
                   None if bins is None else int(bins))

    def time_edges(self) -> np.ndarray:
        """:func:`time_edges` of the agreed time range and number of intervals."""
        if self.time_max is None or self.time_bins is None:
            raise ValueError("these ranges have no time histogram")
        return time_edges(self.time_max, self.time_bins)

    def describe(self, columns: int | None = None) -> tuple[str, ...]:
        """The fallbacks in one sentence, for the console and the ledger (``()`` when there are none).

        It names the columns left out of the model, those ranged by the scan fallback and the
        training times where the scan ranged them (at most ``NAMED_COLUMNS`` names each, then how
        many more), and the keys that help; ``columns``: how many feature columns the plan has
        (numeric and categorical), to say "k of n".
        """
        named = {how: [c for c, fallback in sorted(self.fallbacks.items()) if fallback == how and c != "time"]
                 for how in FALLBACKS}
        parts = []
        if named["left out"]:
            count = len(named["left out"])
            of = f" of {columns} columns" if columns else f" column{'s' if count > 1 else ''}"
            parts.append(f"{count}{of} left out of the model ({_names(named['left out'])})")
        if named["scan"]:
            count = len(named["scan"])
            parts.append(f"{count} column{'s' if count > 1 else ''} ranged by the scan fallback, the histogram's "
                         f"most significant window ({_names(named['scan'])})")
        if self.fallbacks.get("time") == "scan":
            parts.append("the training times ranged by the scan fallback")
        if not parts:
            return ()
        return ("private set-up: " + "; ".join(parts) + ": no range stood out of the noise; give their "
                "ranges in data.dictionary (numeric: {column: [lo, hi]}; time: {max: ...}) or raise "
                "privacy.setup_share",)


#: :meth:`AgreedRanges.describe` names at most this many columns of each kind, then says how many more.
NAMED_COLUMNS = 30


def _names(columns: list[str]) -> str:
    shown = ", ".join(columns[:NAMED_COLUMNS])
    return shown + (f" and {len(columns) - NAMED_COLUMNS} more" if len(columns) > NAMED_COLUMNS else "")


@dataclass(frozen=True)
class MomentRelease:
    """Pass 2 of one site (or the sum over ``sites`` sites): the noisy time histogram on
    :func:`time_edges` and the noisy moments ``[Σv, Σv², n]`` of the private numeric columns."""

    events: np.ndarray | None
    censored: np.ndarray | None
    moments: Mapping[str, np.ndarray]
    sites: int = 1
    #: Noise standard deviation of each release in it (``time_histogram``, ``feature_moments``) where a secure sum
    #: set it (:func:`secure_moments_sum`); ``None``: each of the ``sites`` sites added its own, the plan's.
    noise: Mapping[str, float] | None = None

    def __add__(self, other: MomentRelease) -> MomentRelease:
        if set(self.moments) != set(other.moments) or (self.events is None) != (other.events is None):
            raise ValueError("cannot add moment releases of different plans")
        if self.noise is not None or other.noise is not None:
            raise ValueError("a secure sum's release is the sum already: it is not added to another")
        return MomentRelease(
            None if self.events is None else self.events + other.events,
            None if self.censored is None else self.censored + other.censored,
            {c: m + other.moments[c] for c, m in self.moments.items()},
            self.sites + other.sites,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form of one site's release (what a deployed site sends); :meth:`from_dict` inverts it."""
        return {"events": None if self.events is None else self.events.tolist(),
                "censored": None if self.censored is None else self.censored.tolist(),
                "moments": {c: m.tolist() for c, m in self.moments.items()}}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any], plan: SetupPlan, ranges: AgreedRanges) -> MomentRelease:
        """One site's release from :meth:`to_dict`'s form, checked against ``plan`` and the ``ranges`` it answered.

        Raises
        ------
        ValueError
            Naming what does not fit the plan.
        """
        if set(payload["moments"]) != set(plan.moment_columns):
            raise ValueError(f"moments for columns {sorted(payload['moments'])}, expected {list(plan.moment_columns)}")
        if (payload["events"] is None) == plan.releases_time_histogram:
            raise ValueError("time histogram present where the plan has none, or missing")
        events = censored = None
        if payload["events"] is not None:
            bins = ranges.time_edges().size - 1
            events = _check_vector(payload["events"], bins, "time histogram (events)")
            censored = _check_vector(payload["censored"], bins, "time histogram (censorings)")
        return cls(events, censored,
                   {str(c): _check_vector(m, 3, f"moments of '{c}'") for c, m in payload["moments"].items()})


@dataclass(frozen=True)
class SharedSetup:
    """What the federation agrees before training: preprocessing, time grid, CoxTime time scale.

    ``time_counts``: ``(points, events, censored)``, the denoised counts of events and censorings
    at the right edges of the time histogram's bins (post-processing of its release); None
    without a time histogram.
    """

    preprocessor: Preprocessor
    cuts: np.ndarray
    time_scale: tuple[float, float]
    #: ``(points, events, censored)``: the denoised counts of events and censorings at the right
    #: edges of the time histogram's intervals (post-processing; ``None`` without a histogram).
    time_counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    #: :meth:`AgreedRanges.describe` of the ranges the set-up settled by a fallback (one sentence, or none).
    notes: tuple[str, ...] = ()
    #: :attr:`AgreedRanges.fallbacks`: column (or ``"time"``) -> ``"scan"`` or ``"left out"``, in the plan's order.
    fallbacks: Mapping[str, str] = field(default_factory=dict)

    @property
    def left_out(self) -> tuple[str, ...]:
        """The columns the model leaves out (no range stood out of the noise), in the plan's order."""
        return tuple(c for c, how in self.fallbacks.items() if how == "left out")


# --------------------------------------------------------------------------- site side


def release_ranges(
    plan: SetupPlan, features: pd.DataFrame, time: np.ndarray, rng: np.random.Generator,
) -> RangeRelease:
    """Pass 1 at a site: noisy record count and range histograms, and the site's category levels.

    Parameters
    ----------
    plan
        The federation's plan (its columns must be ``features``' columns).
    features
        The site's raw training features.
    time
        The site's training times.
    rng
        Source of the Gaussian noise.
    """
    time = np.asarray(time, dtype=np.float64)
    if len(features) != time.size:
        raise ValueError(f"features have {len(features)} rows but time has {time.size} values")
    edges = range_edges()
    std = plan.noise_std("range_histograms")
    histograms = {c: _noisy(_bin_counts(_numeric_values(features[c]), edges), std, rng)
                  for c in plan.private_numeric}
    time_counts = (_noisy(_bin_counts(time, edges), plan.noise_std("time_range"), rng) if plan.releases_time_range
                   else None)
    return RangeRelease(noisy_count(plan, time.size, rng), histograms, time_counts, site_levels(plan, features))


def noisy_count(plan: SetupPlan, records: int, rng: np.random.Generator) -> float:
    """A site's ``record_count`` release: its ``records`` plus the plan's noise, drawn from ``rng``."""
    return float(_noisy(np.array(float(records)), plan.noise_std("record_count"), rng))


def site_levels(plan: SetupPlan, features: pd.DataFrame) -> dict[str, tuple[str, ...]]:
    """The site's set of levels of every categorical column without public levels (schema: not private)."""
    return {c: tuple(sorted(set(category_keys(features[c]).dropna()))) for c in plan.private_levels}


def release_moments(
    plan: SetupPlan, ranges: AgreedRanges, features: pd.DataFrame, time: np.ndarray, event: np.ndarray,
    rng: np.random.Generator,
) -> MomentRelease:
    """Pass 2 at a site: noisy time histogram on ``ranges.time_edges()`` and noisy
    moments of :attr:`SetupPlan.moment_columns` clipped to ``ranges`` (see the module docs)."""
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event, dtype=np.float64)
    events = censored = None
    if plan.releases_time_histogram:
        edges = ranges.time_edges()
        is_event = (event == 1) & (time <= edges[-1])
        std = plan.noise_std("time_histogram")
        events = _noisy(_bin_counts(time[is_event], edges), std, rng)
        censored = _noisy(_bin_counts(time[~is_event], edges), std, rng)
    std = plan.noise_std("feature_moments")
    moments = {}
    for column in plan.moment_columns:
        lo, hi = ranges.features[column]
        scaled = (np.clip(_numeric_values(features[column]), lo, hi) - (lo + hi) / 2) / ((hi - lo) / 2)
        scaled = np.clip(scaled, -1.0, 1.0)  # round-off at the edges
        moments[column] = _noisy(np.array([scaled.sum(), np.square(scaled).sum(), scaled.size]), std, rng)
    return MomentRelease(events, censored, moments)


# --------------------------------------------------------------------------- server side


def _summed_std(plan: SetupPlan, name: str, summed: RangeRelease | MomentRelease) -> float:
    """Noise standard deviation of release ``name`` in ``summed``: the secure sum's (:attr:`RangeRelease.noise`),
    else that of ``summed.sites`` sites' own noise, each the plan's."""
    if summed.noise is not None:
        return float(summed.noise.get(name, 0.0))
    return math.sqrt(summed.sites) * plan.noise_std(name)


def _span(counts: np.ndarray, std: float) -> tuple[int, int] | None:
    """First and last bin of a range (see :func:`agree_ranges`) from noisy counts with noise
    ``std`` per bin; ``None`` when no window stands out of the noise."""
    for width in RANGE_WINDOWS:
        sums = np.convolve(counts, np.ones(width), mode="valid")  # sums[j]: bins j … j + width - 1
        above = np.flatnonzero(sums > RANGE_THRESHOLD * std * math.sqrt(width))
        if above.size:
            return _extend(counts, int(above[0]), int(above[-1]) + width - 1, std)
    return None


def _scan(counts: np.ndarray, std: float) -> tuple[int, int] | None:
    """The fallback range: the window (of any width in ``RANGE_WINDOWS``) whose summed count is
    the most noise standard deviations above 0, grown as :func:`_span` grows its range; ``None``
    when even that window is below ``SCAN_THRESHOLD``."""
    best, window = -math.inf, (0, 0)
    for width in RANGE_WINDOWS:
        scores = np.convolve(counts, np.ones(width), mode="valid") / (std * math.sqrt(width))
        j = int(np.argmax(scores))
        if scores[j] > best:
            best, window = float(scores[j]), (j, j + width - 1)
    return _extend(counts, *window, std) if best >= SCAN_THRESHOLD else None


def _extend(counts: np.ndarray, first: int, last: int, std: float) -> tuple[int, int]:
    """Bins ``first … last`` without empty ends, grown outward while the next
    ``RANGE_EXTEND_WINDOW`` bins stand out (``RANGE_EXTEND_THRESHOLD``)."""
    while first < last and counts[first] <= 0:  # a wide window's empty end
        first += 1
    while last > first and counts[last] <= 0:
        last -= 1
    ahead = RANGE_EXTEND_WINDOW
    extend = RANGE_EXTEND_THRESHOLD * std * math.sqrt(ahead)
    while first > 0 and counts[max(first - ahead, 0):first].sum() > extend:
        first -= 1
    while last < counts.size - 1 and counts[last + 1:last + 1 + ahead].sum() > extend:
        last += 1
    return first, last


def _settle(counts: np.ndarray, std: float, what: str, fallbacks: dict[str, str]) -> tuple[int, int] | None:
    """:func:`_span`, else :func:`_scan` (noted in ``fallbacks[what]``), else ``None`` (noted as left out)."""
    found = _span(counts, std)
    if found is None:
        found = _scan(counts, std)
        fallbacks[what] = "scan" if found is not None else "left out"
    return found


def agree_ranges(plan: SetupPlan, summed: RangeRelease) -> AgreedRanges:
    """Clip ranges and time range from the sum of the sites' :class:`RangeRelease` (post-processing).

    A private column's range is ``[edges[a], edges[b + 1]]`` with bins ``a`` and ``b`` found as the
    module docs describe (noise std :math:`\\sqrt{K} s` per bin for :math:`K` sites, or the secure
    sum's: :attr:`RangeRelease.noise`); without
    noise, the first and last non-empty bins, so the range holds every value. Where no window
    passes the test, the most significant window is taken if it reaches ``SCAN_THRESHOLD``
    (``fallbacks[column] = "scan"``); otherwise the column is left out of the model (``"left
    out"``, with a nominal range). The time range is ``[0, edges[b + 1]]`` (the same fallback).
    Public ranges and a public time range are taken as they are.

    Raises
    ------
    SetupNoiseError
        When even the fallback finds nothing in the training times' histogram: one line naming the
        dictionary's follow-up range and, where columns were left out too, their ranges.
    """
    edges = range_edges()
    std = _summed_std(plan, "range_histograms", summed)
    features = dict(plan.dictionary.numeric) if plan.dictionary else {}
    fallbacks: dict[str, str] = {}
    for column in plan.private_numeric:
        found = _settle(summed.histograms[column], std, column, fallbacks)
        features[column] = (float(edges[found[0]]), float(edges[found[1] + 1])) if found else (0.0, 1.0)
    time_max = None
    if plan.releases_time_range:
        central = int(np.searchsorted(edges, 0.0)) - 1  # the bin holding 0; times are never negative
        time_std = _summed_std(plan, "time_range", summed)
        found = _settle(summed.time[central:], time_std, "time", fallbacks)
        if found is None:
            hidden = sum(how == "left out" for column, how in fallbacks.items() if column != "time")
            columns = (f" and numeric: {{column: [lo, hi]}} for the {hidden} column{'s' * (hidden > 1)} hidden too"
                       if hidden else "")
            raise SetupNoiseError(  # the keys first: a console line shows its first 300 characters
                "set-up statistics: the training times' range histogram does not stand out of the noise: give the "
                f"follow-up range in data.dictionary (time: {{max: ...}}{columns}; no privacy cost), raise "
                f"privacy.setup_share or privacy.epsilon{_secure_hint(summed)}, or use fewer, larger sites (std "
                f"{time_std:.3g} per bin, "
                f"summed over {summed.sites} sites, about {max(summed.count, 0):.0f} records)")
        time_max = float(edges[central + found[1] + 1])
    elif plan.releases_time_histogram:
        time_max = plan.dictionary.time_max
    bins = None
    if plan.releases_time_histogram:
        bins = time_bins(plan, summed.count, summed.sites, std=None if summed.noise is None else summed.noise[
            "time_histogram"])
    return AgreedRanges({c: features[c] for c in plan.columns if c in plan.numeric}, time_max, fallbacks, bins)


def _secure_hint(summed: RangeRelease) -> str:
    """The key that sums a per-site set-up securely, for a message about its noise ("" where it was summed so)."""
    return ", sum it securely (dp_sgd: privacy.setup_sum = secure)" if summed.noise is None else ""


def check_inputs(plan: SetupPlan, ranges: AgreedRanges, summed: RangeRelease) -> None:
    """Stop a set-up that would leave the model no input column, before its second pass releases anything.

    Raises
    ------
    SetupNoiseError
        In one line, when every feature column is left out (:attr:`AgreedRanges.left_out`: no
        categorical column, no public range, and no numeric range stood out of the noise), naming
        the noise, the sites and records, and the keys that help.
    """
    if not plan.columns or any(c not in ranges.left_out for c in plan.columns):
        return
    std = _summed_std(plan, "range_histograms", summed)
    raise SetupNoiseError(  # the keys first: a console line shows its first 300 characters
        f"set-up statistics: no column's range stood out of the noise, so all {len(plan.columns)} columns would be "
        "left out and the model would have no input: give their ranges in data.dictionary (numeric: {column: [lo, "
        f"hi]}}; no privacy cost), raise privacy.setup_share or privacy.epsilon{_secure_hint(summed)}, or use fewer, "
        f"larger sites (std {std:.3g} per bin, summed over {summed.sites} sites, about {max(summed.count, 0):.0f} "
        "records)")


def _feature_scaling(
    plan: SetupPlan, ranges: AgreedRanges, summed: MomentRelease,
) -> tuple[dict[str, float], dict[str, float]]:
    """Means and standard deviations of the numeric columns (public: the range's midpoint and
    half-width; private: the noisy moments, see the module docs)."""
    means, stds = {}, {}
    floor_std = _summed_std(plan, "feature_moments", summed)
    for column in (c for c in plan.columns if c in plan.numeric):
        lo, hi = ranges.features[column]
        middle, half = (lo + hi) / 2, (hi - lo) / 2
        if column not in summed.moments:
            means[column], stds[column] = middle, half
            continue
        total, total_sq, count = summed.moments[column]
        count = max(count, 1.0)
        mean = float(np.clip(total / count, -1.0, 1.0))
        mean_sq = float(np.clip(total_sq / count, 0.0, 1.0))
        variance = max(mean_sq - mean**2, floor_std / count)
        means[column] = middle + half * mean
        stds[column] = half * math.sqrt(variance) if variance > RELATIVE_VARIANCE_FLOOR * mean_sq else 1.0
    return means, stds


def _trim_tail(events: np.ndarray, censored: np.ndarray, std: float) -> tuple[np.ndarray, np.ndarray]:
    """Censor the records of the last intervals at the last one whose number at risk exceeds
    ``TAIL_THRESHOLD`` times its noise (without noise: the last interval holding a record)."""
    at_risk = np.cumsum((events + censored)[::-1])[::-1]
    noise = std * np.sqrt(2.0 * np.arange(events.size, 0, -1))  # at risk in interval j sums 2 (B - j) counts
    kept = np.flatnonzero(at_risk > TAIL_THRESHOLD * noise)
    if kept.size == 0 or kept[-1] == events.size - 1:
        return events, censored
    last = kept[-1]
    events, censored = events.copy(), censored.copy()
    censored[last] += events[last + 1:].sum() + censored[last + 1:].sum()
    events[last + 1:] = censored[last + 1:] = 0.0
    return events, censored


def shared_setup(
    plan: SetupPlan, ranges: AgreedRanges, summed_ranges: RangeRelease, summed_moments: MomentRelease, *,
    num_durations: int,
) -> SharedSetup:
    """Preprocessing, time grid and time scale from the summed releases and the public dictionary.

    Parameters
    ----------
    plan
        The federation's plan.
    ranges
        :func:`agree_ranges` of ``summed_ranges``.
    summed_ranges, summed_moments
        Sums over the sites of their :class:`RangeRelease` and :class:`MomentRelease`.
    num_durations
        Number of cut points of the time grid (ignored with a public grid, which is used as is).

    Returns
    -------
    SharedSetup
        ``preprocessor``: numeric columns clipped to ``ranges`` and standardised (public range:
        onto ``[-1, 1]``; private: with the noisy mean and standard deviation); categories from
        the dictionary, else the union of the sites' levels (sorted). ``cuts``: the public grid;
        or ``linspace(0, time_max, num_durations)`` for ``"equidistant"``; or the quantiles of
        the denoised event counts (:func:`monotone_counts`) with every interval counting one more
        summed noise standard deviation of events (:func:`models.time_grid.event_quantile_grid`):
        each cell holds about as many events as the histogram shows, and where the noise hides
        them (a small federation) the cuts fall back towards the histogram's own public intervals,
        half equal and half log-spaced, instead of crowding where the noise put its mass; the grid
        ends at the agreed time range, so no event lies beyond it. Exact counts (no noise) give the
        event quantiles as they are. ``time_scale``: mean and standard deviation of the
        denoised histogram (records at the intervals' midpoints), or with no histogram the
        public range's midpoint and half-width. ``fallbacks``: how the ranges that did not stand out were
        settled (:attr:`AgreedRanges.fallbacks`).
    """
    preprocessor = _shared_preprocessor(plan, ranges, summed_ranges, summed_moments)
    notes, fallbacks = ranges.describe(len(plan.columns)), dict(ranges.fallbacks)
    if not plan.releases_time_histogram:
        d = plan.dictionary
        cuts = (np.asarray(d.time_grid, dtype=np.float64) if d.time_grid is not None
                else np.linspace(0.0, d.time_max, num_durations))
        return SharedSetup(preprocessor, cuts, (cuts[-1] / 2, cuts[-1] / 2), None, notes, fallbacks)
    edges = ranges.time_edges()
    events, censored = monotone_counts(summed_moments.events), monotone_counts(summed_moments.censored)
    counts = events + censored
    noise = _summed_std(plan, "time_histogram", summed_moments)
    trimmed = _trim_tail(events, censored, noise)
    if plan.time_grid == "quantiles":
        floor = noise if noise > 0 or events.sum() > 0 else 1.0  # no noise, no event: the histogram's own intervals
        cuts = event_quantile_grid(edges, events, num_durations=num_durations, floor=floor)
    else:
        cuts = np.linspace(0.0, ranges.time_max, num_durations)
    time_scale = _histogram_time_scale(edges, counts, time_max=ranges.time_max)
    return SharedSetup(preprocessor, cuts, time_scale, (edges[1:], *trimmed), notes, fallbacks)


def _shared_preprocessor(plan: SetupPlan, ranges: AgreedRanges, summed_ranges: RangeRelease,
                         summed_moments: MomentRelease) -> Preprocessor:
    """The shared preprocessing of :func:`shared_setup`: the columns not left out, clipped to ``ranges`` and
    standardised (:func:`_feature_scaling`); categories from the dictionary, else the sites' summed levels."""
    means, stds = _feature_scaling(plan, ranges, summed_moments)
    public_levels = plan.dictionary.categorical if plan.dictionary else {}
    categories = {c: tuple(public_levels[c]) if c in public_levels else summed_ranges.levels[c]
                  for c in plan.categorical}
    out = ranges.left_out
    return Preprocessor(tuple(c for c in plan.columns if c not in out),
                        {c: m for c, m in means.items() if c not in out}, stds, categories,
                        {c: r for c, r in ranges.features.items() if c not in out})


def _histogram_time_scale(edges: np.ndarray, counts: np.ndarray, *, time_max: float) -> tuple[float, float]:
    """Mean and standard deviation of the time histogram ``counts`` (records at the intervals' midpoints); the
    range's midpoint and half-width ``(time_max / 2, time_max / 2)`` when that deviation is not positive."""
    middles = (edges[:-1] + edges[1:]) / 2
    if counts.sum() > 0:
        mean = float(np.average(middles, weights=counts))
        std = float(np.sqrt(np.average(np.square(middles - mean), weights=counts)))
    else:
        mean = std = 0.0
    return (mean, std) if std > 0 else (time_max / 2, time_max / 2)


# --------------------------------------------------------------------------- through a secure sum


#: The releases that go through a secure sum where the run has one (``distributed_dp``; ``dp_sgd`` with
#: ``privacy.setup_sum = secure``): all but the record count, which each site still releases on its own with its own
#: noise (the server weighs and bounds every later secure sum by the agreed counts of the sites included in it, so it
#: needs each site's).
SECURE_RELEASES = ("time_range", "range_histograms", "time_histogram", "feature_moments")


@dataclass(frozen=True)
class SecureSetup:
    r"""The public parameters of a set-up whose releases (:data:`SECURE_RELEASES`) go through SecAgg+ with the
    distributed discrete Gaussian (:func:`strategies.mechanisms.distributed_dp.gaussian_sum_plan`): the same at
    every site and at the server.

    ``parties``: the sites in the sum; ``max_dropouts``, ``colluding``: the drop-outs and colluding sites it
    tolerates (``privacy.max_dropouts``, ``privacy.colluding_sites``); ``modulus_bits``: ``privacy.modulus_bits``;
    ``honest_cap``: the honest survivors a site's own policy counts on
    (:func:`strategies.mechanisms.distributed_dp.counted_honest`), ``None`` without one.

    Release :math:`i` (noise multiplier :math:`z_i`, L2 sensitivity :math:`\Delta_i` to adding or removing one
    record: :func:`setup_releases`) is a sum of per-record vectors of L2 norm at most :math:`\Delta_i` (a record
    adds 1 to one bin of each histogram; its moments :math:`(v, v^2, 1)` per column), so its plan is
    ``gaussian_sum_plan(multiplier=z_i, clip=Delta_i)``: any ``parties - max_dropouts - colluding`` honest
    survivors' shares give the released sum an RDP at most the Gaussian mechanism's at :math:`z_i`, the entry
    ``(z_i, 1, 1)`` the site's accountant already composes. The server sees the sum with the noise of about one
    Gaussian of std :math:`z_i \Delta_i \sqrt{k / (k - D - t)}` (:func:`summed_noise`), not :math:`\sqrt k` times it.
    """

    parties: int
    max_dropouts: int = 0
    colluding: int = 0
    modulus_bits: int = 48
    honest_cap: int | None = None

    def sum_plan(self, plan: SetupPlan, name: str, size: int, records: float) -> Any:
        """The :class:`~strategies.mechanisms.distributed_dp.RoundPlan` of release ``name`` of ``size`` values
        over ``records`` agreed records (the sum of the sites' agreed counts: the wrap-around scale only).

        Raises ``ValueError`` for a plan whose adjacency is not ``"add-remove"`` or that has no such release;
        :class:`~strategies.config.ConfigError` naming the keys when no secure sum meets the plan
        (:func:`~strategies.mechanisms.distributed_dp.gaussian_sum_plan`)."""
        from strategies.mechanisms.distributed_dp import gaussian_sum_plan

        if plan.adjacency != "add-remove":
            raise ValueError(f"a secure set-up sum bounds add/remove-one sensitivities, not {plan.adjacency!r}")
        release = next((r for r in plan.releases() if r.name == name), None)
        if release is None or name not in SECURE_RELEASES or plan.noise_multiplier == 0:
            raise ValueError(f"the plan makes no noisy release {name!r} for a secure sum")
        try:
            return gaussian_sum_plan(multiplier=release.noise_multiplier("add-remove"), parties=self.parties,
                                     max_dropouts=self.max_dropouts, colluding=self.colluding,
                                     records=float(records), size=int(size), clip=release.sensitivity["add-remove"],
                                     modulus_bits=self.modulus_bits, honest_cap=self.honest_cap)
        except ValueError as err:
            raise ConfigError(f"run config: the private set-up's secure sum (privacy.modulus_bits, "
                              f"privacy.max_dropouts, privacy.colluding_sites): {err}") from None

    @property
    def modulus(self) -> int:
        """The secure sum's modulus M."""
        return 2 ** self.modulus_bits


def secure_segments(plan: SetupPlan, setup_pass: int, ranges: AgreedRanges | None = None) -> tuple[tuple[str, int], ...]:
    """The releases of one pass's secure-sum vector, in order, with their sizes: pass 1 ``time_range`` (where made)
    and ``range_histograms`` (the private numeric columns' histograms, in the plan's order); pass 2
    ``time_histogram`` (events, then censorings, on ``ranges.time_edges()``) and ``feature_moments``
    (``[sum v, sum v^2, n]`` per column). Public: a function of the plan and the agreed ranges."""
    bins, numeric, moments = range_edges().size - 1, len(plan.private_numeric), len(plan.moment_columns)
    if setup_pass == 1:
        parts = [("time_range", bins) if plan.releases_time_range else None,
                 ("range_histograms", bins * numeric) if numeric else None]
    else:
        intervals = ranges.time_edges().size - 1 if plan.releases_time_histogram else 0
        parts = [("time_histogram", 2 * intervals) if intervals else None,
                 ("feature_moments", 3 * moments) if moments else None]
    return tuple(part for part in parts if part is not None)


def _rounded_range_sums(plan: SetupPlan, features: pd.DataFrame, time: np.ndarray, scale: Mapping[str, int]) -> dict:
    """Pass 1's sums of the records' rounded scaled vectors: a record's one-hot bin times the integer ``scale``."""
    edges = range_edges()
    sums = {}
    if plan.releases_time_range:
        sums["time_range"] = scale["time_range"] * _bin_counts(np.asarray(time, dtype=np.float64), edges)
    if plan.private_numeric:
        sums["range_histograms"] = scale["range_histograms"] * np.concatenate(
            [_bin_counts(_numeric_values(features[c]), edges) for c in plan.private_numeric])
    return sums


def _rounded_moment_sums(plan: SetupPlan, ranges: AgreedRanges, features: pd.DataFrame, time: np.ndarray,
                         event: np.ndarray, scale: Mapping[str, int]) -> dict:
    """Pass 2's sums of the records' rounded scaled vectors (one-hot time bins; each record's moments rounded)."""
    sums = {}
    if plan.releases_time_histogram:
        edges = ranges.time_edges()
        is_event = (np.asarray(event) == 1) & (time <= edges[-1])
        sums["time_histogram"] = scale["time_histogram"] * np.concatenate(
            [_bin_counts(time[is_event], edges), _bin_counts(time[~is_event], edges)])
    if plan.moment_columns:
        g, parts = scale["feature_moments"], []
        for column in plan.moment_columns:
            lo, hi = ranges.features[column]
            v = np.clip((np.clip(_numeric_values(features[column]), lo, hi) - (lo + hi) / 2) / ((hi - lo) / 2), -1, 1)
            parts.append([np.rint(g * v).sum(), np.rint(g * v * v).sum(), g * v.size])
        sums["feature_moments"] = np.concatenate(parts)
    return sums


def secure_contribution(plan: SetupPlan, secure: SecureSetup, setup_pass: int, features: pd.DataFrame,
                        time: np.ndarray, event: np.ndarray | None, *, records: float, rng: np.random.Generator,
                        ranges: AgreedRanges | None = None) -> np.ndarray:
    r"""A site's integer vector of one pass's secure sum (:func:`secure_segments`), before SecAgg+ masks it.

    Per release, with the plan :meth:`SecureSetup.sum_plan` (scale :math:`\gamma`) and the integer scale
    :math:`g = \lfloor\gamma\rfloor`: the sum over the site's records of :math:`\mathrm{round}(g u)`, :math:`u`
    the record's vector (L2 norm at most the release's sensitivity :math:`C`), so one record moves it by at most
    :math:`gC + \sqrt d/2 \le \Delta` (the plan's ``l2``); plus :math:`N_{\mathbb Z}(0, s^2)` per value (the
    plan's ``local_sigma``) drawn from ``rng``. ``records``: the agreed records of the sites in the sum.
    """
    from strategies.mechanisms.discrete_gaussian import sample_discrete_gaussian

    time = np.asarray(time, dtype=np.float64)
    if len(features) != time.size:
        raise ValueError(f"features have {len(features)} rows but time has {time.size} values")
    segments = secure_segments(plan, setup_pass, ranges)
    plans = {name: secure.sum_plan(plan, name, size, records) for name, size in segments}
    scale = {name: int(math.floor(p.gamma)) for name, p in plans.items()}
    sums = (_rounded_range_sums(plan, features, time, scale) if setup_pass == 1
            else _rounded_moment_sums(plan, ranges, features, time, np.asarray(event), scale))
    return np.concatenate([np.rint(sums[name]).astype(np.int64)
                           + sample_discrete_gaussian(rng, plans[name].local_sigma ** 2, size)
                           for name, size in segments] or [np.zeros(0, dtype=np.int64)])


def summed_noise(plan: SetupPlan, secure: SecureSetup, name: str, size: int, *, records: float,
                 sites: int) -> float:
    """Noise standard deviation per value of release ``name`` (``size`` values) in the secure sum of ``sites``
    included sites: their discrete Gaussian shares (variance ``sites * s^2``) over the integer scale."""
    p = secure.sum_plan(plan, name, size, records)
    return math.sqrt(sites) * p.local_sigma / math.floor(p.gamma)


def _decoded(plan: SetupPlan, secure: SecureSetup, segments: tuple[tuple[str, int], ...], total: np.ndarray, *,
             records: float, sites: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Each release's real-valued sum from the centred integer ``total`` of ``sites`` sites, and its noise std.

    Raises ``ValueError`` (one line) when a release's sum is beyond what honest sites can produce
    (:meth:`~strategies.mechanisms.distributed_dp.RoundPlan.refusal`)."""
    total = np.asarray(total, dtype=np.int64)
    if total.shape != (sum(size for _, size in segments),):
        raise ValueError(f"the set-up's secure sum has shape {total.shape}, expected {sum(s for _, s in segments)}")
    values, noise, start = {}, {}, 0
    for name, size in segments:
        p, part = secure.sum_plan(plan, name, size, records), total[start:start + size]
        if reason := p.refusal(part, records=records, sites=sites, count_std=plan.noise_std("record_count")):
            raise ValueError(f"set-up release {name!r}: {reason}")
        values[name] = part.astype(np.float64) / math.floor(p.gamma)
        noise[name] = summed_noise(plan, secure, name, size, records=records, sites=sites)
        start += size
    return values, noise


def secure_ranges_sum(plan: SetupPlan, secure: SecureSetup, total: np.ndarray, *, counts: Mapping[str, float],
                      levels: Mapping[str, tuple[str, ...]], records: float | None = None) -> RangeRelease:
    """The server's pass-1 sum from the secure sum's centred integer ``total`` over the sites of ``counts`` (each
    site's noisy record count, released on its own) and their union of ``levels``: a :class:`RangeRelease` whose
    ``noise`` is the secure sum's, with pass 2's time histogram's as planned at its largest size over these sites
    (pass 2's intervals, :func:`time_bins`, follow from it). ``records``: the agreed records the sites' plans were
    sized for (by default those of ``counts``; more where sites of the sum dropped out)."""
    if records is None:
        records = sum(agreed_count(c) for c in counts.values())
    values, noise = _decoded(plan, secure, secure_segments(plan, 1), total, records=records, sites=len(counts))
    bins, stacked = range_edges().size - 1, values.get("range_histograms", np.zeros(0))
    histograms = {c: stacked[i * bins:(i + 1) * bins] for i, c in enumerate(plan.private_numeric)}
    if plan.releases_time_histogram:
        second = dataclasses.replace(secure, parties=len(counts))  # pass 2 sums the sites of this one
        noise["time_histogram"] = summed_noise(plan, second, "time_histogram", 2 * TIME_BINS_MAX, records=records,
                                               sites=len(counts))
    return RangeRelease(float(sum(counts.values())), histograms, values.get("time_range"), dict(levels),
                        len(counts), noise)


def secure_moments_sum(plan: SetupPlan, secure: SecureSetup, ranges: AgreedRanges, total: np.ndarray, *,
                       records: float, sites: int) -> MomentRelease:
    """The server's pass-2 sum from the secure sum's centred integer ``total`` of ``sites`` sites holding ``records``
    agreed records: a :class:`MomentRelease` whose ``noise`` is the secure sum's."""
    values, noise = _decoded(plan, secure, secure_segments(plan, 2, ranges), total, records=records, sites=sites)
    events = censored = None
    if "time_histogram" in values:
        events, censored = np.split(values["time_histogram"], 2)
    stacked = values.get("feature_moments", np.zeros(0))
    moments = {c: stacked[3 * i:3 * i + 3] for i, c in enumerate(plan.moment_columns)}
    return MomentRelease(events, censored, moments, sites, noise)


def modular_sum(vectors: list[np.ndarray], modulus: int) -> np.ndarray:
    """What SecAgg+ unmasks from ``vectors``, centred: their sum mod ``modulus`` in ``[-M/2, M/2)`` (the masks
    cancel in the sum; :func:`strategies.secure_aggregation.centred`)."""
    from strategies.secure_aggregation import centred

    return centred(functools.reduce(lambda a, b: np.mod(a + b, modulus), [np.mod(v, modulus) for v in vectors]),
                   modulus)


# --------------------------------------------------------------------------- the whole set-up


#: The releases of each pass of the set-up: pass 1 (:func:`release_ranges`), pass 2 (:func:`release_moments`).
SETUP_PASSES: Mapping[int, tuple[str, ...]] = {1: ("record_count", "time_range", "range_histograms"),
                                               2: ("time_histogram", "feature_moments")}


def pass_history(plan: SetupPlan, setup_pass: int) -> tuple[tuple[float, float, int], ...]:
    """The releases of one pass of the set-up (:data:`SETUP_PASSES`) as accountant history (see :func:`accountant_history`)."""
    if plan.noise_multiplier == 0:
        return ()
    return tuple((release.noise_multiplier(plan.adjacency), 1.0, 1) for release in setup_releases(plan)
                 if release.name in SETUP_PASSES[setup_pass] and math.isfinite(release.noise_multiplier(plan.adjacency)))


def accountant_history(plan: SetupPlan) -> tuple[tuple[float, float, int], ...]:
    """The plan's releases as RDP accountant history: ``(z_i, 1.0, 1)`` per release that costs anything.

    Each release is a Gaussian mechanism without subsampling (sample rate 1) of noise multiplier
    ``z_i`` under ``plan.adjacency``; opacus' ``compute_rdp(q=1, noise_multiplier=z_i, steps=1)``
    is its RDP, so the site's accountant composes them with its DP-SGD steps. Empty for an exact
    set-up (``noise_multiplier`` 0: no guarantee, nothing to compose).
    """
    return pass_history(plan, 1) + pass_history(plan, 2)


def agreed_count(noisy: float) -> float:
    """A site's agreed record count from its noisy release: rounded, at least 1 (post-processing)."""
    return float(max(1, round(noisy)))


def run_setup(
    plan: SetupPlan, sites: Mapping[str, tuple[pd.DataFrame, np.ndarray, np.ndarray]],
    rngs: Mapping[str, np.random.Generator], *, num_durations: int, require_inputs: bool = False,
    secure: SecureSetup | None = None,
) -> tuple[SharedSetup, dict[str, float]]:
    """Both passes of the set-up over sites held in one process (a simulation), as a deployment runs them.

    ``sites``: name -> the site's raw training features, times and events; ``rngs``: name -> the
    site's noise generator. Returns the shared set-up and every site's agreed record count
    (:func:`agreed_count` of its noisy count). ``require_inputs``: stop after the first pass where
    every column is left out (:func:`check_inputs`), as a horizontal federation's set-up does.
    ``secure``: the releases of :data:`SECURE_RELEASES` go through the secure sum (:func:`run_secure_setup`).
    """
    if secure is not None:
        return run_secure_setup(plan, secure, sites, rngs, num_durations=num_durations, require_inputs=require_inputs)
    first = {name: release_ranges(plan, features, time, rngs[name]) for name, (features, time, _) in sites.items()}
    ranges = agree_ranges(plan, functools.reduce(operator.add, first.values()))
    if require_inputs:
        check_inputs(plan, ranges, functools.reduce(operator.add, first.values()))
    second = [release_moments(plan, ranges, features, time, event, rngs[name])
              for name, (features, time, event) in sites.items()]
    shared = shared_setup(plan, ranges, functools.reduce(operator.add, first.values()),
                          functools.reduce(operator.add, second), num_durations=num_durations)
    return shared, {name: agreed_count(release.count) for name, release in first.items()}


def run_secure_setup(
    plan: SetupPlan, secure: SecureSetup, sites: Mapping[str, tuple[pd.DataFrame, np.ndarray, np.ndarray]],
    rngs: Mapping[str, np.random.Generator], *, num_durations: int, require_inputs: bool = False,
) -> tuple[SharedSetup, dict[str, float]]:
    """:func:`run_setup` with the releases of :data:`SECURE_RELEASES` through the secure sum, in one process.

    Each site releases its noisy record count and its levels on its own; the agreed counts' sum sizes the secure
    sums (:meth:`SecureSetup.sum_plan`); each pass's vector of every site (:func:`secure_contribution`, its noise
    from the site's ``rngs``) is summed modulo M as SecAgg+ unmasks it (:func:`modular_sum`: the masks cancel);
    the server derives everything from the sums (:func:`secure_ranges_sum`, :func:`secure_moments_sum`).
    """
    counts = {name: noisy_count(plan, len(time), rngs[name]) for name, (_, time, _) in sites.items()}
    records = sum(agreed_count(count) for count in counts.values())
    levels = {c: tuple(sorted(set().union(*(site_levels(plan, f)[c] for f, _, _ in sites.values()))))
              for c in plan.private_levels}
    first = secure_ranges_sum(plan, secure, modular_sum(
        [secure_contribution(plan, secure, 1, features, time, None, records=records, rng=rngs[name])
         for name, (features, time, _) in sites.items()], secure.modulus), counts=counts, levels=levels)
    ranges = agree_ranges(plan, first)
    if require_inputs:
        check_inputs(plan, ranges, first)
    second = secure_moments_sum(plan, secure, ranges, modular_sum(
        [secure_contribution(plan, secure, 2, features, time, event, records=records, rng=rngs[name], ranges=ranges)
         for name, (features, time, event) in sites.items()], secure.modulus), records=records, sites=len(sites))
    shared = shared_setup(plan, ranges, first, second, num_durations=num_durations)
    return shared, {name: agreed_count(count) for name, count in counts.items()}


def implausible_ranges(release: RangeRelease, plan: SetupPlan, *, tolerance: float = 10.0) -> str:
    """Why one site's pass-1 release cannot come from an honest site ("" when it can).

    An honest site's range histogram of a column counts at most its records: every bin lies in
    ``[-t s, n + t s]`` and the bins sum to at most ``n + t s sqrt(bins)``, with ``n`` its noisy
    record count, ``s`` the bins' noise std and ``t`` = ``tolerance`` (a margin no honest noise
    reaches). A site that injects counts to stretch the federation's clip ranges fails this.
    """
    count = release.count + tolerance * plan.noise_std("record_count")
    histograms = {column: (counts, plan.noise_std("range_histograms")) for column, counts in release.histograms.items()}
    if release.time is not None:  # the times' histogram is its own release, with its own noise
        histograms["time"] = (release.time, plan.noise_std("time_range"))
    for column, (counts, std) in histograms.items():
        if counts.min() < -tolerance * std or counts.max() > count + tolerance * std:
            return f"the range histogram of '{column}' has bins outside [0, {count:.0f}] beyond its noise"
        if counts.sum() > count + tolerance * std * math.sqrt(counts.size):
            return f"the range histogram of '{column}' counts {counts.sum():.0f} values for about {count:.0f} records"
    return ""


# --------------------------------------------------------------------------- recalibration after training


@dataclass(frozen=True)
class RecalibrationPlan:
    """The public plan of the recalibration release (:mod:`models.recalibration`).

    ``horizons``: ``RECALIBRATION_QUANTILES`` of the agreed follow-up (records of the denoised time
    histogram); ``target``: the Kaplan-Meier survival of that histogram at the horizons
    (:func:`models.time_grid.histogram_survival`). Both are post-processing of the set-up's releases.
    """

    horizons: np.ndarray
    target: np.ndarray

    @property
    def size(self) -> int:
        """Numbers a site releases: one power sum per horizon and exponent."""
        return self.horizons.size * len(EXPONENTS)

    def sensitivity(self) -> float:
        """L2 sensitivity of a site's power sums to one record (each term in [0, 1]; either adjacency)."""
        return math.sqrt(self.size)


def recalibration_plan(time_counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None, *, count: float,
                       spread: float, multiplier: float) -> RecalibrationPlan | None:
    """The plan from the set-up's denoised time histogram (``SharedSetup.time_counts``), for ``count``
    records (the agreed counts' sum), a release of noise multiplier ``multiplier`` whose summed noise is
    ``spread`` times one release's (the square root of the site count where each site adds all of its own,
    less through a secure sum: ``HorizontalMechanism.recalibration_spread``). None without a histogram,
    or when the summed noise of one power sum would exceed ``RECALIBRATION_MAX_ERROR`` of ``count`` (too
    few records for the budget: the release is then not planned, and training gets its share).
    Post-processing of public values only."""
    size = len(RECALIBRATION_QUANTILES) * len(EXPONENTS)
    if time_counts is None or multiplier * math.sqrt(size) * spread > RECALIBRATION_MAX_ERROR * count:
        return None
    points, events, censored = (np.asarray(part, dtype=np.float64) for part in time_counts)
    records = events + censored
    if events.sum() <= 0:
        return None
    share = np.cumsum(records) / records.sum()
    horizons = np.unique(np.interp(RECALIBRATION_QUANTILES, share, points))
    target = histogram_survival(np.concatenate(([0.0], points)), events, censored, horizons)
    return RecalibrationPlan(horizons, target)
