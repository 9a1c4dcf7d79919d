r"""Private vertical learning with one release per record (strategy ``private_split``).

The BVFLMSP protocol (:mod:`strategies.split`) releases every record's embedding once per epoch
and once per prediction pass, trains the encoders on raw records, and so either spends a huge ε
or learns nothing. This protocol spends the record's budget where it buys utility:

1. **Private preprocessing.** Each site fits its modality's preprocessing (clip ranges, means and
   standard deviations of the numeric columns; the categorical levels are schema) from noisy sums
   of its training records: the horizontal set-up's mechanism
   (:mod:`strategies.mechanisms.setup_statistics`) run at one site under replace-one adjacency,
   with the noise of ``privacy.setup_share`` of the budget. What the run's data dictionary
   (``data.dictionary``) lists for the site's columns is public and costs nothing; a column whose
   range does not stand out of the noise is left out of the site's model (a note to the label
   holder), and a site left without any column stops with the smallest training size its
   columns need (:func:`smallest_site`). With ``privacy.setup_share = 0`` a site releases no
   set-up statistic and nothing is charged for it: every numeric column's range must be in the
   dictionary (the site stops naming the first that is not); levels are schema either way.
2. **Private encoder.** Each site fits a linear encoder ``x ↦ Wᵀx`` from one Gaussian release of
   a statistic of its training records (``split.encoder``):

   ``score``
       One dimension: the direction of the Cox score at β = 0,
       :math:`U = \sum_i M_i v_i`, with :math:`v_i` the record's preprocessed features scaled to
       L2 norm ≤ 1 and :math:`M_i = \delta_i - \hat\Lambda_0(t_i)` the null model's martingale
       residual (clipped to ``[-RESIDUAL_CLIP, 1]``), which the label holder computes from its
       labels and sends to the site. Replace-one sensitivity of :math:`U`:
       ``2 · RESIDUAL_CLIP`` (a record's residual is fixed by its labels; its features move).
       The site learns the training records' residuals: the labels are disclosed to the sites
       (the ledger's assumptions say so).
   ``pca``
       ``split.embedding_dim`` dimensions: the top eigenvectors of the noisy second-moment matrix
       :math:`\sum_i v_i v_iᵀ` (Analyze Gauss, Dwork, Talwar, Thakurta & Zhang 2014; symmetric
       noise). Replace-one sensitivity in Frobenius norm: :math:`\sqrt 2`. No labels.
   ``features``
       The preprocessed features themselves (no fit, no release).
3. **One release per record.** Each record's embedding is clipped (L1 norm ``C`` for Laplace
   noise, L2 norm ``C`` for Gaussian; ``privacy.clip_norm``) and noised once; the site caches it
   and answers any later request for the record with the same values (no new release). Training
   records are released for training, held-out records when predicted.
4. **Training is post-processing.** The label holder trains its head on the cached training
   releases for as many epochs as it likes, and draws prediction uncertainty from its own
   Bayesian layers on a held-out record's single release.

Accounting (a record's features at every site together, replace-one): every Gaussian mechanism
(each site's set-up and encoder statistic, and with Gaussian release noise the embeddings)
composes by RDP without amplification; each Laplace release adds its pure ε. The plan, the noise
calibration and the record's ε are :mod:`strategies.accounting.private_split`.

References
----------
Dwork, Talwar, Thakurta & Zhang, "Analyze Gauss: optimal bounds for privacy-preserving principal
component analysis", STOC 2014; Mironov, "Rényi Differential Privacy", CSF 2017; Dwork & Roth,
"The Algorithmic Foundations of Differential Privacy", 2014 (Laplace mechanism, composition);
Therneau, Grambsch & Fleming, "Martingale-based residuals for survival models", Biometrika 1990.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from models.data.dictionary import DataDictionary, DataDictionaryError
from models.data.preprocess import Preprocessor, is_numeric_feature
from strategies.accounting.private_split import (
    FIT_SENSITIVITY,
    RESIDUAL_CLIP,
    NoisePlan,
    PrivateSplitPlan,
)
from strategies.mechanisms.setup_statistics import SCAN_THRESHOLD, SetupNoiseError, SetupPlan, run_setup

__all__ = [
    "PrivateSplitSite",
    "PrivateSplitSites",
    "clip_rows",
    "concatenate",
    "martingale_residuals",
    "site_rng",
    "smallest_site",
]

#: Noise standard deviations above the scan threshold at which :func:`smallest_site` puts a site's smallest size.
SMALLEST_MARGIN = 2.0


def _site_dictionary(dictionary: DataDictionary | None, columns: Sequence[str]) -> DataDictionary:
    """What is public about a site's columns: the run's dictionary entries for them (other
    modalities' entries and its time section do not concern the site), and a two-cut time grid: a
    site has no labels, so its set-up releases no time statistic."""
    public = dictionary or DataDictionary()
    return DataDictionary({c: r for c, r in public.numeric.items() if c in columns},
                          {c: k for c, k in public.categorical.items() if c in columns},
                          time_grid=(0.0, 1.0), time_max=1.0, source=public.source)


def smallest_site(plan: SetupPlan) -> int:
    """The fewest training records with which a column of a site's set-up ``plan`` keeps its range
    with probability at least 0.977 when all its values lie in one bin of the range grid.

    A column's range is found when a window of its range histogram stands out of the noise
    (:mod:`strategies.mechanisms.setup_statistics`); the fallback needs ``SCAN_THRESHOLD`` noise
    standard deviations ``s``, so ``n`` records in one bin pass with probability
    ``Phi(n / s - SCAN_THRESHOLD)`` (``Phi`` the standard normal CDF), at least ``Phi(2)`` from
    ``n = (SCAN_THRESHOLD + SMALLEST_MARGIN) s``. Values spread over ``w`` bins need about ``sqrt(w)``
    times as many. A function of the public plan only (a size fitted to the site's own values
    would be a release that is not private).
    """
    return math.ceil((SCAN_THRESHOLD + SMALLEST_MARGIN) * plan.noise_std("range_histograms"))


# --------------------------------------------------------------------------- label holder


def martingale_residuals(time: np.ndarray, event: np.ndarray) -> np.ndarray:
    r"""Null-model martingale residuals :math:`M_i = \delta_i - \hat\Lambda_0(t_i)`, clipped to ``[-RESIDUAL_CLIP, 1]``.

    :math:`\hat\Lambda_0` is the Nelson-Aalen estimate of the cumulative hazard (ties: each event
    adds ``1 / at risk`` in time order, the same at a tied time). :math:`\sum_i M_i v_i` is the
    Cox partial likelihood's score at β = 0 up to centring (Therneau et al. 1990).

    Examples
    --------
    >>> martingale_residuals(np.array([1.0, 2.0, 3.0]), np.array([1, 0, 1])).round(3).tolist()
    [0.667, -0.333, -0.333]
    """
    time = np.asarray(time, dtype=np.float64)
    event = np.asarray(event, dtype=np.float64)
    order = np.argsort(time, kind="stable")
    sorted_time = time[order]
    at_risk = time.size - np.searchsorted(sorted_time, sorted_time, side="left")
    increments = event[order] / at_risk
    cumulative = np.cumsum(increments)
    # a tied time takes the cumulative hazard after every event at that time
    last = np.searchsorted(sorted_time, sorted_time, side="right") - 1
    hazard = np.empty_like(time)
    hazard[order] = cumulative[last]
    return np.clip(event - hazard, -RESIDUAL_CLIP, 1.0)


# --------------------------------------------------------------------------- a site


def clip_rows(x: np.ndarray, clip_norm: float, order: int = 2) -> np.ndarray:
    """Scale each row to L``order`` norm at most ``clip_norm``."""
    norms = np.linalg.norm(x, ord=order, axis=1, keepdims=True)
    return x * np.minimum(1.0, clip_norm / np.maximum(norms, 1e-12))


def site_rng(base_seed: int, modality: str, call: int) -> np.random.Generator:
    """The noise generator of a site's ``call``-th message (0: the fit; ``r``: the ``r``-th release).

    ``base_seed`` is the site's secret: in a deployment fresh operating-system entropy for every
    message; in simulation derived from the run seed (reproducible).
    """
    return np.random.default_rng([int(base_seed) % 2**63, zlib.crc32(modality.encode()), int(call)])


class PrivateSplitSite:
    """A modality site of ``private_split``: private preprocessing, private encoder, one cached release per record.

    Parameters
    ----------
    plan : PrivateSplitPlan
    noise : NoisePlan
        :func:`plan_noise` of ``plan`` (the site recomputes it from the plan: it never takes the
        label holder's word for its own noise).
    features : pandas.DataFrame
        The site's modality, indexed by record ID (a row of all missing values: a record it lacks).
    categorical : sequence of str
    modality : str
        The modality's name (default ``source``).
    source : str
        Name of the data for error messages.
    dictionary : DataDictionary, optional
        The run's public data dictionary (``data.dictionary``); the entries for the site's columns
        are taken as public.
    """

    def __init__(self, plan: PrivateSplitPlan, noise: NoisePlan, features: pd.DataFrame,
                 categorical: Sequence[str] = (), *, modality: str = "", source: str = "site",
                 dictionary: DataDictionary | None = None) -> None:
        self.plan, self.noise, self.source, self.dictionary = plan, noise, source, dictionary
        self.modality = modality or source
        self.categorical = tuple(categorical)
        self.features = features.copy()
        self.features.index = pd.Index(self.features.index.astype(str))
        if self.features.index.has_duplicates:
            raise ValueError(f"{self.source}: duplicate record IDs")
        self.held = self.features.notna().any(axis=1)
        self.preprocessor: Preprocessor | None = None
        self.projection: np.ndarray | None = None
        self.released: dict[str, np.ndarray] = {}
        #: What the set-up's fallbacks did (:meth:`~strategies.mechanisms.setup_statistics.AgreedRanges.describe`).
        self.notes: tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        """The embedding's width (0 before :meth:`fit`)."""
        return 0 if self.projection is None else int(self.projection.shape[1])

    def fit(self, train_ids: Sequence[str], residuals: Mapping[str, float] | None, rng: np.random.Generator) -> None:
        """The private set-up, then the encoder from one noisy statistic of the training records it holds.

        ``residuals`` (``score`` only): the label holder's martingale residual of each training record.
        """
        if self.projection is not None:
            raise ValueError(f"{self.source}: the encoder is already fitted (a second fit would spend the budget "
                             "again)")
        training = self.features.index.isin([str(i) for i in train_ids]) & self.held.to_numpy()
        if not training.any():
            raise ValueError(f"{self.source}: holds none of the cohort's training records")
        train = self.features.loc[training]
        self.preprocessor, self.notes = self._setup(train, rng)
        x = self.preprocessor.transform(train)
        width = x.shape[1]
        v = clip_rows(x / math.sqrt(width), 1.0)  # rows of L2 norm <= 1: the statistics' per-record bound
        self.projection = self._encoder(v, train.index, residuals, rng)

    def _setup(self, train: pd.DataFrame, rng: np.random.Generator) -> tuple[Preprocessor, tuple[str, ...]]:
        """The site's private set-up over its training records: the preprocessing and the fallbacks' notes.

        Raises
        ------
        SetupNoiseError
            When no column is left (every numeric range hidden by the noise, no categorical
            column), naming the smallest training size (:func:`smallest_site`) and the keys that help.
        DataDictionaryError
            At ``privacy.setup_share = 0`` (no set-up release), when a numeric column has no range in the
            dictionary: before anything is released.
        """
        columns = tuple(map(str, self.features.columns))
        numeric = frozenset(c for c in columns
                            if c not in set(self.categorical) and is_numeric_feature(self.features[c]))
        plan = SetupPlan(columns, numeric, noise_multiplier=self.noise.setup_multiplier, adjacency="replace-one",
                         dictionary=_site_dictionary(self.dictionary, columns))
        hidden = plan.private_numeric
        if self.plan.private and self.noise.setup_multiplier == 0 and hidden:  # privacy.setup_share = 0
            raise DataDictionaryError(  # the column and the keys first: a console line shows its first 300 characters
                f"{self.source}: column '{hidden[0]}' has no range in data.dictionary, and privacy.setup_share = 0 gives "
                f"the set-up no budget: list it there or raise privacy.setup_share ({len(hidden)} such column(s); "
                f"dictionary {plan.dictionary.source})")
        zeros = np.zeros(len(train))
        shared, _ = run_setup(plan, {self.source: (train, zeros, zeros)}, {self.source: rng}, num_durations=2)
        if not shared.preprocessor.columns:
            raise SetupNoiseError(  # the size and the keys first: a console line shows its first 300 characters
                f"{self.source}: {len(train)} training records are too few at privacy.epsilon = {self.plan.epsilon:g}: a "
                f"column needs about {smallest_site(plan)}; raise privacy.epsilon or privacy.setup_share, or give "
                "ranges in data.dictionary (no column's range stood out of the set-up's noise, std "
                f"{plan.noise_std('range_histograms'):.3g} per bin; the size is for values in one bin of the range "
                "grid, about sqrt(w) times as many over w bins)")
        return shared.preprocessor, shared.notes

    def _encoder(self, v: np.ndarray, ids: pd.Index, residuals: Mapping[str, float] | None,
                 rng: np.random.Generator) -> np.ndarray:
        """The projection ``W`` from ``v`` (rows of L2 norm <= 1) and one noisy statistic (``split.encoder``)."""
        plan, noise, width = self.plan, self.noise, v.shape[1]
        if plan.encoder == "features":
            return np.eye(width)
        if plan.encoder == "score":
            if residuals is None:
                raise ValueError(f"{self.source}: the score encoder needs the training records' residuals")
            m = np.array([residuals.get(str(i), np.nan) for i in ids], dtype=np.float64)
            if not np.all(np.isfinite(m)) or m.min() < -RESIDUAL_CLIP or m.max() > 1.0:
                raise ValueError(f"{self.source}: the residuals must give every training record a value in "
                                 f"[-{RESIDUAL_CLIP:g}, 1]")
            score = v.T @ m + rng.normal(size=width) * noise.fit_multiplier * FIT_SENSITIVITY["score"]
            norm = np.linalg.norm(score)
            return (score / norm if norm > 0 else score)[:, None]
        upper = np.triu(rng.normal(size=(width, width))) * noise.fit_multiplier * FIT_SENSITIVITY["pca"]
        values, vectors = np.linalg.eigh(v.T @ v + upper + np.triu(upper, 1).T)  # symmetric noise
        return vectors[:, np.argsort(values)[::-1][:min(plan.dim, width)]]

    def embed(self, frame: pd.DataFrame) -> np.ndarray:
        """Embeddings before clipping and noise: the encoder ``x ↦ Wᵀx`` on the preprocessed features."""
        if self.preprocessor is None or self.projection is None:
            raise ValueError(f"{self.source}: release before set-up")
        return self.preprocessor.transform(frame) @ self.projection

    def release(self, ids: Sequence[str], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Released embeddings of ``ids`` (zeros where the site lacks the record) and the presence mask.

        A record released before gets its cached values: each record leaves the site once. Without
        noise (``privacy.epsilon = inf``) the embeddings are not clipped either.
        """
        ids = [str(i) for i in ids]
        present = self.held.reindex(ids, fill_value=False).to_numpy(dtype=bool)
        new = list(dict.fromkeys(i for i, here in zip(ids, present) if here and i not in self.released))
        if new:
            values = self.embed(self.features.loc[new])
            if self.plan.private:  # without noise there is nothing to bound: the embedding as it is
                order = 1 if self.plan.release_noise == "laplace" else 2
                values = clip_rows(values, self.plan.clip_norm, order)
            if self.noise.release_scale > 0:
                draw = rng.laplace if self.plan.release_noise == "laplace" else rng.normal
                values = values + draw(size=values.shape) * self.noise.release_scale
            self.released.update(zip(new, values))
        out = np.zeros((len(ids), self.dim))
        for row, (i, here) in enumerate(zip(ids, present)):
            if here:
                out[row] = self.released[i]
        return out, present

    def privacy_report(self) -> dict[str, float]:
        """``releases_max``: the most releases of any record (1 once anything was released: the cache)."""
        return {"releases_max": float(1 if self.released else 0)}

    def state_dict(self) -> tuple[dict[str, str], dict[str, np.ndarray]]:
        """What the site keeps between messages: the preprocessing (JSON) and the encoder and cache (arrays)."""
        if self.preprocessor is None or self.projection is None:
            raise ValueError(f"{self.source}: nothing to save before set-up")
        ids = list(self.released)
        values = np.array([self.released[i] for i in ids]).reshape(len(ids), self.dim)
        return ({"preprocessor": json.dumps(self.preprocessor.to_dict()), "released_ids": json.dumps(ids)},
                {"projection": self.projection, "released": values})

    def load_state_dict(self, text: Mapping[str, str], arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.preprocessor = Preprocessor.from_dict(json.loads(text["preprocessor"]))
        self.projection = np.asarray(arrays["projection"], dtype=np.float64)
        ids = json.loads(text["released_ids"])
        self.released = dict(zip(ids, np.asarray(arrays["released"], dtype=np.float64)))


# --------------------------------------------------------------------------- the protocol


class PrivateSplitSites:
    """In-process transport: the sites are objects in this process (tests, benchmarks, the centralised twin).

    Each site's noise comes from :func:`site_rng` of ``noise_seed`` (as in a simulation over
    Flower), so the same seeds give the same releases here and through the apps.
    """

    def __init__(self, plan: PrivateSplitPlan, noise: NoisePlan,
                 modalities: Mapping[str, tuple[pd.DataFrame, Sequence[str]]], *, noise_seed: int,
                 dictionary: DataDictionary | None = None) -> None:
        self.sites = {name: PrivateSplitSite(plan, noise, frame, categorical, modality=name, source=name,
                                             dictionary=dictionary)
                      for name, (frame, categorical) in modalities.items()}
        self.noise_seed = noise_seed
        self.calls = 0

    def fit(self, train_ids: Sequence[str], residuals: Mapping[str, float] | None) -> None:
        for name, site in self.sites.items():
            site.fit(train_ids, residuals, site_rng(self.noise_seed, name, 0))

    def release(self, ids: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        self.calls += 1
        return {name: site.release(ids, site_rng(self.noise_seed, name, self.calls))
                for name, site in self.sites.items()}


def concatenate(releases: Mapping[str, tuple[np.ndarray, np.ndarray]], modalities: Sequence[str]) -> np.ndarray:
    """A record's releases over the modalities side by side (zeros where a site lacks it), shape (n, Σ d_k)."""
    return np.hstack([np.where(releases[name][1][:, None], releases[name][0], 0.0) for name in modalities])
