"""Assigning records to sites, and each site's records to training and test parts.

Three schemes:

- ``"iid"``: a seeded permutation cut into ``num_sites`` near-equal parts;
- ``"dirichlet"``: label- and time-skewed; records are stratified by event x time quartile, and
  each stratum is shared among the sites in proportions drawn from ``Dir(alpha * 1_K)`` (small
  ``alpha`` -> strongly skewed sites);
- natural: any other name is a column; one site per value of that column.

Every site needs at least :data:`MIN_SITE_RECORDS` records (and ``min_site_records`` where a run sets it):
``iid`` and ``dirichlet`` refuse more sites than the records can fill (:func:`check_site_count`), a natural
partition refuses a group that small unless ``min_site_records`` leaves such groups out.

All functions return sorted index arrays and are deterministic given their generator or seed.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from models.data.preprocess import category_keys
from models.data.validate import TOO_FEW_RECORDS, DataValidationError

logger = logging.getLogger(__name__)

SCHEMES = ("iid", "dirichlet")
#: The fewest records a site may hold: below this a site's training part (about 80% of it) fits a survival model on
#: a handful of records, often without an event, and its test part holds one or two records, so its figures mean
#: nothing (and a site of fewer records fails later, in its training or its calibration table).
MIN_SITE_RECORDS = 10
DIRICHLET_MAX_DRAWS = 1000


def check_site_count(records: int, num_sites: int, *, minimum: int = MIN_SITE_RECORDS, source: str = "") -> None:
    """Raise unless ``records`` records give ``num_sites`` sites of at least ``minimum`` records each.

    Raises
    ------
    DataValidationError
        In one line: the source, the record count, ``federation.num_sites`` and the largest number of sites the
        records allow (or, with too few records for one site, that the file needs more).
    """
    if num_sites * minimum <= records:
        return
    largest = records // minimum
    fix = (f"use federation.num_sites={largest} or fewer" if largest else
           f"a federation needs a file of at least {minimum} records")
    raise DataValidationError(
        f"{source + ': ' if source else ''}{records} records cannot give federation.num_sites = {num_sites} sites of "
        f"at least {minimum} records each (the fewest a site can train and be tested on); {fix}",
        public=[(TOO_FEW_RECORDS, "federation.num_sites")])


def iid_partition(n: int, num_sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random near-equal parts of ``range(n)`` (sizes differ by at most one), each of at least
    :data:`MIN_SITE_RECORDS` records (:func:`check_site_count`)."""
    check_site_count(n, num_sites)
    return [np.sort(part) for part in np.array_split(rng.permutation(n), num_sites)]


def time_event_strata(time: np.ndarray, event: np.ndarray) -> np.ndarray:
    """Stratum label per record: event (0/1) x quartile of time (0..3), coded ``4*event + quartile``."""
    quartile = pd.qcut(pd.Series(time).rank(method="first"), 4, labels=False).to_numpy()
    return 4 * event.astype(int) + quartile


def _dirichlet_draw(
    strata: list[np.ndarray], num_sites: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """One draw: share every stratum (record positions) among the sites in ``Dir(alpha)`` proportions."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
    for members in strata:
        cuts = (np.cumsum(rng.dirichlet(np.full(num_sites, alpha))) * members.size).astype(int)[:-1]
        for site, chunk in enumerate(np.split(rng.permutation(members), cuts)):
            parts[site].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def dirichlet_partition(
    time: np.ndarray,
    event: np.ndarray,
    num_sites: int,
    alpha: float,
    rng: np.random.Generator,
    min_site_records: int = 0,
) -> list[np.ndarray]:
    """Label/time-skewed partition; re-drawn until every site is usable.

    A draw is accepted when every site has at least ``max(min_site_records, MIN_SITE_RECORDS)`` records
    and at least one event; at most ``DIRICHLET_MAX_DRAWS`` draws are tried.

    Raises
    ------
    DataValidationError
        When no acceptable draw is found.
    """
    if alpha <= 0:
        raise DataValidationError(f"dirichlet_alpha must be positive, got {alpha}")
    minimum = max(min_site_records, MIN_SITE_RECORDS)
    check_site_count(time.size, num_sites, minimum=minimum)
    labels = time_event_strata(time, event)
    strata = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    for _ in range(DIRICHLET_MAX_DRAWS):
        parts = _dirichlet_draw(strata, num_sites, alpha, rng)
        if all(p.size >= minimum and event[p].any() for p in parts):
            return parts
    raise DataValidationError(
        f"no Dirichlet partition (alpha={alpha}) of {time.size} records into {num_sites} sites gives "
        f"every site >= {minimum} records and >= 1 event after {DIRICHLET_MAX_DRAWS} draws; "
        "raise dirichlet_alpha or lower num_sites / min_site_records"
    )


def natural_partition(groups: pd.Series, min_site_records: int = 0, *, source: str = "") -> dict[str, np.ndarray]:
    """One site per value of ``groups``, named by the value and sorted by name.

    Records with a missing group value, and values with fewer than ``min_site_records`` records,
    are left out with a logged warning.

    Raises
    ------
    DataValidationError
        When no value is left, or (one line naming ``source``, the column and the values) when a value kept has
        fewer than :data:`MIN_SITE_RECORDS` records: ``federation.min_site_records`` leaves such sites out.
    """
    names = category_keys(groups).reset_index(drop=True)
    missing = int(names.isna().sum())
    if missing:
        logger.warning("%s: %d records without a value are left out of the partition", groups.name, missing)
    counts = names.value_counts()
    small = counts[counts < min_site_records]
    if len(small):
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(small.items()))
        logger.warning(
            "%s: %d values with fewer than %d records dropped: %s",
            groups.name, len(small), min_site_records, listed,
        )  # fmt: skip
    kept = sorted(counts.index.difference(small.index))
    where = f"{source + ': ' if source else ''}column '{groups.name}' (federation.partition)"
    if not kept:
        raise DataValidationError(f"{where}: no value has at least {min_site_records} records "
                                  "(federation.min_site_records); lower federation.min_site_records",
                                  public=[(TOO_FEW_RECORDS, "federation.min_site_records")])
    tiny = sorted((name, int(counts[name])) for name in kept if counts[name] < MIN_SITE_RECORDS)
    if tiny:
        listed = ", ".join(f"'{name}' ({n})" for name, n in tiny[:5]) + (" ..." if len(tiny) > 5 else "")
        raise DataValidationError(
            f"{where}: {len(tiny)} site(s) with fewer than {MIN_SITE_RECORDS} records: {listed}; leave them out "
            f"with federation.min_site_records={MIN_SITE_RECORDS}, or merge them into other sites",
            public=[(TOO_FEW_RECORDS, "federation.partition")])
    positions = names.groupby(names).indices
    return {name: np.sort(positions[name]) for name in kept}


def partition_indices(
    scheme: str,
    *,
    time: np.ndarray,
    event: np.ndarray,
    num_sites: int,
    seed: int,
    dirichlet_alpha: float = 0.5,
    min_site_records: int = 0,
    groups: pd.Series | None = None,
) -> list[np.ndarray]:
    """Split the records into sites.

    Parameters
    ----------
    scheme
        ``"iid"``, ``"dirichlet"``, or the name of the column given as ``groups`` (natural
        partition: one site per value, in name order; ``num_sites`` is then ignored).
    time, event
        Times and events of all records (used by ``"dirichlet"``; their length is ``n``).
    num_sites
        Number of sites for ``"iid"`` and ``"dirichlet"``.
    seed
        Seed of the random draws.
    dirichlet_alpha
        Concentration of the Dirichlet proportions.
    min_site_records
        Smallest acceptable site (Dirichlet, with :data:`MIN_SITE_RECORDS` at least) or group (natural:
        smaller groups are left out) size.
    groups
        The partition column for a natural partition.

    Returns
    -------
    list of numpy.ndarray
        Sorted, disjoint record positions per site; together they cover every record (natural
        partitions leave out missing and too-small groups).
    """
    if scheme in SCHEMES and num_sites < 1:
        raise DataValidationError(f"num_sites must be at least 1, got {num_sites}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        return iid_partition(len(time), num_sites, rng)
    if scheme == "dirichlet":
        return dirichlet_partition(time, event, num_sites, dirichlet_alpha, rng, min_site_records)
    if groups is None or groups.name != scheme:
        raise DataValidationError(
            f"unknown partition '{scheme}'; options: {', '.join(SCHEMES)} or a column name"
        )
    return list(natural_partition(groups, min_site_records).values())


def stratified_split(
    indices: np.ndarray, event: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one site's records into training and test parts, stratified by event.

    Each event class puts ``round(test_fraction * n_class)`` records in the test part but keeps at
    least one in training.

    Parameters
    ----------
    indices
        The site's record positions.
    event
        Events of *all* records (indexed by ``indices``).
    test_fraction
        Share of each class that goes to the test part, in ``[0, 1)``.
    rng
        Random generator.

    Returns
    -------
    tuple of numpy.ndarray
        Sorted training and test positions.
    """
    if not 0 <= test_fraction < 1:
        raise DataValidationError(f"test_fraction must be in [0, 1), got {test_fraction}")
    test = []
    for label in (0.0, 1.0):
        members = rng.permutation(indices[event[indices] == label])
        test.append(members[: min(round(test_fraction * members.size), max(members.size - 1, 0))])
    test_idx = np.sort(np.concatenate(test))
    return np.setdiff1d(indices, test_idx), test_idx

