r"""Federated Kaplan–Meier curves and log-rank tests from a DataFrame: :func:`kaplan_meier`,
:func:`logrank_test`, :func:`plot_kaplan_meier`.

>>> import fedsurv
>>> km = fedsurv.kaplan_meier(lung, time_col="time", event_col="status", site_col="inst", group_col="sex")
>>> km.loc[1]                      # sex == 1: survival, lower, upper, at_risk, events, censored by time
>>> fedsurv.logrank_test(lung, time_col="time", event_col="status", group_col="sex", site_col="inst")

The records of each value of ``site_col`` play one site (all records one site when it is None).
Each site computes counts from its own records only; the server adds them
(:mod:`models.km`). Sums of counts are the counts of the pooled records, so every figure is
*exactly* the one computed on the pooled records (lifelines' ``KaplanMeierFitter``,
``logrank_test``, ``multivariate_logrank_test``), and a stratified log-rank test is R's
``survdiff(Surv(time, status) ~ group + strata(site))``.

**What the sites release.** The counts are released *in the clear*: there is no differential
privacy, no noise and no secure aggregation here, and the server sees every site's counts. Each
function's docstring says which counts; the log-rank result lists them (``released``). Counts at
exact times can single out patients at a small site (a count of one event at a given day);
:func:`kaplan_meier`'s ``grid`` releases counts on coarser shared times instead.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from models import km

__all__ = ["EVENT_TEXT", "LogrankTestResult", "kaplan_meier", "logrank_test", "plot_kaplan_meier"]

#: Text accepted in an event column (matched after stripping spaces, in any case): event or censored.
EVENT_TEXT: dict[str, bool] = {"dead": True, "alive": False, "yes": True, "no": False,
                               "true": True, "false": False, "1": True, "0": False}

#: At most this many offending values are named in an error.
_LISTED = 6

#: Site label of the records when ``site_col`` is None.
ALL_RECORDS = "all"


# --------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Records:
    """Validated records: float times, boolean events, integer site and group codes with their labels."""

    time: np.ndarray
    event: np.ndarray
    site: np.ndarray
    site_labels: list
    group: np.ndarray
    group_labels: list

    def cells(self) -> list[tuple[int, int, np.ndarray]]:
        """``(site, group, row mask)`` of every non-empty site × group cell, by site then group."""
        out = []
        for s in range(len(self.site_labels)):
            for g in range(len(self.group_labels)):
                mask = (self.site == s) & (self.group == g)
                if mask.any():
                    out.append((s, g, mask))
        return out


def _records(
    data: Any, *, time_col: Hashable, event_col: Hashable, site_col: Hashable | None, group_col: Hashable | None,
) -> _Records:
    if not isinstance(data, pd.DataFrame):
        raise TypeError(f"data must be a pandas DataFrame, got {type(data).__name__}: "
                         "read the file first (pandas.read_csv)")
    for argument, column in (("time_col", time_col), ("event_col", event_col), ("site_col", site_col),
                             ("group_col", group_col)):
        if column is None and argument in ("site_col", "group_col"):
            continue
        if column not in data.columns:
            shown = ", ".join(map(str, list(data.columns)[:12])) + (", ..." if data.shape[1] > 12 else "")
            raise ValueError(f"{argument}={column!r} is not a column of data (columns: {shown}): "
                             f"give {argument} the name of one")
    if len(data) == 0:
        raise ValueError("data has no rows: pass the records to analyse")
    time = _parse_times(data[time_col], time_col)
    event = _parse_events(data[event_col], event_col)
    if site_col is None:
        site, site_labels = np.zeros(len(data), dtype=np.intp), [ALL_RECORDS]
    else:
        site, site_labels = _levels(data[site_col], "site_col", site_col)
    if group_col is None:
        group, group_labels = np.zeros(len(data), dtype=np.intp), [None]
    else:
        group, group_labels = _levels(data[group_col], "group_col", group_col)
    return _Records(time, event, site, site_labels, group, group_labels)


def _parse_times(series: pd.Series, column: Hashable) -> np.ndarray:
    """Float times; a one-line error naming the column and counting rows that are not non-negative, finite numbers."""
    if pd.api.types.is_bool_dtype(series):
        numbers = pd.Series(np.nan, index=series.index)
    elif pd.api.types.is_numeric_dtype(series):
        numbers = series
    else:
        numbers = pd.to_numeric(series, errors="coerce")
    time = numbers.to_numpy(dtype=np.float64, na_value=np.nan)
    missing, infinite, negative = np.isnan(time), np.isinf(time), time < 0
    bad = missing | infinite | negative
    if bad.any():
        kinds = [f"{int(count)} {what}" for count, what in ((missing.sum(), "missing or not a number"),
                                                          (negative.sum(), "negative"), (infinite.sum(), "infinite"))
                 if count]
        raise ValueError(f"time_col {column!r} must hold non-negative, finite numbers; {int(bad.sum())} of "
                         f"{time.size} rows do not ({', '.join(kinds)}): drop or fix those rows")
    return time


def _event_value(value: Any) -> bool | None:
    """True (event), False (censored) or None (not an accepted event value)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return {0: False, 1: True}.get(value) if value in (0, 1) else None
    if isinstance(value, str):
        return EVENT_TEXT.get(value.strip().lower())
    return None


def _parse_events(series: pd.Series, column: Hashable) -> np.ndarray:
    """Boolean events from 0/1, booleans or the text of :data:`EVENT_TEXT`; a one-line error otherwise."""
    if pd.api.types.is_bool_dtype(series) and not series.isna().any():
        return series.to_numpy(dtype=bool)
    codes, uniques = pd.factorize(series.astype(object), use_na_sentinel=True)
    mapped = [_event_value(u) for u in uniques]
    bad_values = [u for u, m in zip(uniques, mapped) if m is None]
    bad = np.isin(codes, [i for i, m in enumerate(mapped) if m is None]) | (codes < 0)
    if bad.any():
        if (codes < 0).any():
            bad_values.append(np.nan)
        found = ", ".join(_show(v) for v in bad_values[:_LISTED]) + (", ..." if len(bad_values) > _LISTED else "")
        raise ValueError(f"event_col {column!r} must hold 0/1, True/False or the text dead/alive, yes/no, "
                         f"true/false, 1/0 (any case); found {found} in {int(bad.sum())} of {codes.size} rows: "
                         "recode those values")
    return np.array(mapped, dtype=bool)[codes]


def _show(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:g}"
    return repr(value.item() if isinstance(value, np.generic) else value)


def _levels(series: pd.Series, argument: str, column: Hashable) -> tuple[np.ndarray, list]:
    """Integer codes and sorted labels of a site or group column (refusing missing values)."""
    missing = int(series.isna().sum())
    if missing:
        raise ValueError(f"{argument} {column!r} has {missing} missing value{'s' * (missing > 1)}: "
                         "drop those rows or give them a level of their own")
    try:
        codes, labels = pd.factorize(series, sort=True)
    except TypeError:  # labels of mixed types that do not sort: keep their order of appearance
        codes, labels = pd.factorize(series, sort=False)
    return codes.astype(np.intp), [v.item() if isinstance(v, np.generic) else v for v in labels]


def _as_int(values: np.ndarray) -> np.ndarray:
    """Unweighted counts as integers."""
    return np.rint(values).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Kaplan–Meier
# --------------------------------------------------------------------------------------------


def kaplan_meier(
    data: pd.DataFrame, *, time_col: Hashable, event_col: Hashable, site_col: Hashable | None = None,
    group_col: Hashable | None = None, grid: Sequence[float] | np.ndarray | None = None, alpha: float = 0.05,
) -> pd.DataFrame:
    r"""Kaplan–Meier survival with Greenwood confidence bounds, from counts each site computes alone.

    Each site computes its counts per group (:func:`models.km.site_km_counts`), the server adds them
    (:func:`models.km.combine_km_counts`): the result is exactly lifelines' ``KaplanMeierFitter(alpha=alpha)``
    on the pooled records of each group (survival, log(−log) Greenwood interval, event table).

    Parameters
    ----------
    data, time_col, event_col
        One row per record; its follow-up time (non-negative, finite numbers) and event columns: 1 / ``True`` /
        ``"dead"`` / ``"yes"`` / ``"true"`` / ``"1"`` for an event, 0 / ``False`` / ``"alive"`` / ``"no"`` /
        ``"false"`` / ``"0"`` for a censored record (text in any case).
    site_col, group_col
        The column naming each record's site (any labels, no missing values; None: all records one site), and
        the column with one curve per level (e.g. a treatment arm; None: one curve).
    grid
        None: counts at every distinct time. Or shared, strictly increasing times at which the sites count instead
        (an event rounds up to the next grid time, a censoring down to the previous one; records censored before
        ``grid[0]`` are left out); it must reach the last event time. A grid holding every event time gives the
        exact curve at those times and hides the censoring times.
    alpha
        The confidence intervals are ``1 - alpha`` intervals.

    Returns
    -------
    DataFrame
        Columns ``survival, lower, upper`` (the ``1 - alpha`` confidence bounds), ``at_risk, events, censored``
        (pooled counts) and ``variance`` (Greenwood's variance of the survival). Without ``group_col`` it is
        indexed by ``time``; with it, by ``(group_col, time)``, so ``result.loc[level]`` is one group's curve (as
        a ``KaplanMeierFitter`` fitted to that group), ``result.groupby(level=0)`` iterates over the groups and
        ``result.reset_index()`` is a long table. Without a grid each curve starts with a row at time 0 (survival
        1, every record at risk) as lifelines' does, unless a record has time 0; with a grid the rows are the
        grid's times. ``result.attrs`` holds the column names and ``alpha`` (:func:`plot_kaplan_meier`'s labels).

    What each site releases
    -----------------------
    In the clear, exactly (no differential privacy, no noise, no secure aggregation): for each group it holds,
    without a grid every distinct time at which one of its records had an event or was censored, with the number
    of records at risk, events and censorings there; with a grid those three counts at each grid time. Its label
    set of ``group_col`` is thereby released too.

    Raises
    ------
    TypeError
        When ``data`` is not a DataFrame.
    ValueError
        One line naming the argument or column and the fix: a column not in ``data``; times that are missing,
        negative or infinite (with the number of rows); event values other than the accepted ones (with the values
        found); missing values in ``site_col`` or ``group_col``; a bad ``grid`` or ``alpha``.
    """
    records = _records(data, time_col=time_col, event_col=event_col, site_col=site_col, group_col=group_col)
    curves = _group_curves(records, None if grid is None else np.asarray(grid, dtype=np.float64), alpha)
    result = curves[0] if group_col is None else _stacked(curves, records.group_labels, group_col)
    result.attrs.update({"time_col": time_col, "event_col": event_col, "site_col": site_col,
                         "group_col": group_col, "alpha": alpha})
    return result


def _group_curves(records: _Records, times: np.ndarray | None, alpha: float) -> dict[int, pd.DataFrame]:
    """Each group's (by code) curve of :func:`kaplan_meier`: every site's counts of the group at ``times`` (None:
    at its own distinct times), added by the server, as :func:`_curve`'s frame."""
    curves = {}
    for g in range(len(records.group_labels)):
        counts = [km.site_km_counts(records.time[mask], records.event[mask], times)
                  for _, group, mask in records.cells() if group == g]
        curves[g] = _curve(km.combine_km_counts(counts), alpha, exact=times is None)
    return curves


def _stacked(curves: dict[int, pd.DataFrame], labels: list, group_col: Hashable) -> pd.DataFrame:
    """The groups' ``curves`` (by code) in one frame indexed by (group label, time); the group level is named
    ``group_col``, or ``"group"`` when that is ``"time"``."""
    name = "group" if group_col == "time" else group_col
    return pd.concat({labels[g]: frame for g, frame in curves.items()}, names=[name])


def _curve(counts: km.KMCounts, alpha: float, *, exact: bool) -> pd.DataFrame:
    """One curve in the result's columns, with a first row at time 0 on exact times."""
    table = km.kaplan_meier(counts, alpha=alpha)
    frame = pd.DataFrame({
        "survival": table["survival"], "lower": table["lower"], "upper": table["upper"],
        "at_risk": _as_int(table["at_risk"].to_numpy()), "events": _as_int(table["events"].to_numpy()),
        "censored": _as_int(table["censored"].to_numpy()), "variance": table["variance"],
    }, index=table.index)
    if exact and (frame.empty or frame.index[0] > 0):
        start = pd.DataFrame({"survival": [1.0], "lower": [1.0], "upper": [1.0],
                              "at_risk": [int(frame["at_risk"].iloc[0]) if len(frame) else 0],
                              "events": [0], "censored": [0], "variance": [0.0]},
                             index=pd.Index([0.0], name="time"))
        frame = pd.concat([start, frame])
    return frame


def plot_kaplan_meier(
    result: pd.DataFrame, ax: Any | None = None, *, ci: bool = True, censors: bool = False, title: str | None = None,
    time_unit: str = "time",
) -> Any:
    """Draw :func:`kaplan_meier`'s curves (one per group, in natural order of the groups' names) as steps, with their
    confidence bands.

    ``ax``: the matplotlib axes to draw on (default a new pyplot figure, never the current axes);
    ``ci``: shade each curve's confidence band; ``censors``: mark the times with censorings
    (``|``); ``time_unit``: the unit of the time column, in the time axis' label (e.g. "days":
    "time (days)"; the default "time" adds none). Returns the axes.
    """
    from models.plots import SURVIVAL_LABEL, natural_key, new_axes, time_label

    ax = new_axes(ax)
    if result.index.nlevels == 2:
        parts = sorted(((str(label), part.droplevel(0)) for label, part in result.groupby(level=0, sort=False)),
                       key=lambda item: natural_key(item[0]))  # site-2 before site-10
        legend_title = str(result.index.names[0])
    else:
        parts, legend_title = [("Kaplan–Meier", result)], None
    alpha = result.attrs.get("alpha", 0.05)
    for i, (label, part) in enumerate(parts):
        colour = f"C{i % 10}"
        times = part.index.to_numpy(dtype=np.float64)
        survival, lower, upper = (part[c].to_numpy(dtype=np.float64) for c in ("survival", "lower", "upper"))
        if times.size and times[0] > 0:
            times, survival = np.r_[0.0, times], np.r_[1.0, survival]
            lower, upper = np.r_[1.0, lower], np.r_[1.0, upper]
        ax.step(times, survival, where="post", color=colour, label=label)
        if ci:
            ax.fill_between(times, lower, upper, step="post", alpha=0.2, color=colour, linewidth=0)
        if censors:
            marked = part["censored"].to_numpy() > 0
            ax.plot(part.index.to_numpy(dtype=np.float64)[marked], part["survival"].to_numpy()[marked], "|",
                    color=colour, markersize=6)
    ax.set_xlabel(time_label(time_unit, str(result.attrs.get("time_col") or "time")))
    ax.set_ylabel(f"{SURVIVAL_LABEL} ({1 - alpha:.0%} CI)" if ci else SURVIVAL_LABEL)
    ax.set_ylim(0, 1.02)
    if legend_title is not None and len(parts) <= 12:
        ax.legend(fontsize=8, title=legend_title)
    if title:
        ax.set_title(title)
    return ax


# --------------------------------------------------------------------------------------------
# Log-rank
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class LogrankTestResult:
    """A federated log-rank test: the chi-squared ``statistic`` on ``degrees_of_freedom``, its
    ``p_value``, ``observed`` and ``expected`` events per group (summed over the strata), and
    ``released``: every count the sites sent (one row per site, shared event time and group the
    site holds: ``site, time, group, at_risk, events``).

    ``summary`` is lifelines' ``StatisticalResult.summary`` (``test_statistic, p, -log2(p)``);
    ``print_summary()`` (and ``repr``) print in lifelines' layout, with the per-group table.
    """

    statistic: float
    p_value: float
    degrees_of_freedom: int
    observed: pd.Series
    expected: pd.Series
    stratified: bool
    test_name: str
    group_col: Hashable
    site_col: Hashable | None
    sites: tuple
    released: pd.DataFrame = field(compare=False)

    @property
    def test_statistic(self) -> float:
        """``statistic`` (lifelines' name)."""
        return self.statistic

    @property
    def groups(self) -> tuple:
        return tuple(self.observed.index)

    @property
    def summary(self) -> pd.DataFrame:
        """One row: ``test_statistic, p, -log2(p)``."""
        return pd.DataFrame({"test_statistic": [self.statistic], "p": [self.p_value],
                             "-log2(p)": [-math.log2(self.p_value) if self.p_value > 0 else math.inf]})

    @property
    def table(self) -> pd.DataFrame:
        """Per group: ``observed``, ``expected`` events and ``observed / expected``."""
        frame = pd.DataFrame({"observed": self.observed, "expected": self.expected})
        frame["O/E"] = frame["observed"] / frame["expected"]
        return frame

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain Python values (no ``released``)."""
        return {"test_name": self.test_name, "statistic": self.statistic, "p_value": self.p_value,
                "degrees_of_freedom": self.degrees_of_freedom, "stratified": self.stratified,
                "observed": self.observed.to_dict(), "expected": self.expected.to_dict()}

    def to_ascii(self, decimals: int = 2) -> str:
        threshold = 0.5 * 10 ** (-decimals)
        floats = lambda f: f"{f:4.{decimals}f}"
        p_text = lambda p: f"<{threshold}" if p < threshold else f"{p:4.{decimals}f}"
        strata = (f"{self.site_col} ({len(self.sites)} sites)" if self.stratified
                  else f"none (pooled over {len(self.sites)} site{'s' * (len(self.sites) > 1)})")
        meta = {"group_col": self.group_col, "strata": strata, "null_distribution": "chi squared",
                "degrees_of_freedom": self.degrees_of_freedom, "test_name": self.test_name,
                "released": f"at-risk and event counts per site, event time and group ({len(self.released)} rows, "
                            "in the clear: no DP)"}
        width = max(map(len, meta))
        lines = [f"<fedsurv.LogrankTestResult: {self.test_name}>"]
        lines += [f"{key.rjust(width)} = {value}" for key, value in meta.items()]
        lines += ["", "---", self.summary.to_string(index=False, float_format=floats, formatters={"p": p_text}),
                  "", "---", self.table.to_string(float_format=floats)]
        return "\n".join(lines)

    def print_summary(self, decimals: int = 2) -> None:
        print(self.to_ascii(decimals))

    def __repr__(self) -> str:
        return self.to_ascii()


def logrank_test(
    data: pd.DataFrame, *, time_col: Hashable, event_col: Hashable, group_col: Hashable,
    site_col: Hashable | None = None, stratified: bool | None = None,
) -> LogrankTestResult:
    r"""Log-rank test of equal survival across the levels of ``group_col``, from per-site counts.

    Two rounds. (1) Each site sends its distinct event times; the server sends back their union. (2) At each of
    these times each site sends, per group, its number of records at risk and of events
    (:func:`models.km.site_logrank_sums`; a censoring rounds down to the previous event time, which leaves every
    at-risk set at an event time unchanged). The server computes the test (:func:`models.km.logrank_test`):

    - **stratified** (the default when ``site_col`` is given: the multi-centre analysis): observed − expected
      events and their covariance are computed within each site and summed, so a site effect on survival is not
      mistaken for a group effect: R's ``survdiff(Surv(time, status) ~ group + strata(site))``;
    - **pooled** (``stratified=False``, the default without ``site_col``): the counts are added first, giving
      exactly lifelines' ``logrank_test`` (two groups) or ``multivariate_logrank_test`` on the pooled records.

    Parameters
    ----------
    data, time_col, event_col, site_col
        As for :func:`kaplan_meier`.
    group_col
        The groups compared (two or more levels, no missing values).
    stratified
        None: stratify by site exactly when ``site_col`` is given. ``True`` needs ``site_col``.

    Returns
    -------
    LogrankTestResult
        ``statistic`` (chi-squared on groups − 1 ``degrees_of_freedom``), ``p_value``, ``observed`` and
        ``expected`` (Series by group), ``test_name``, and ``released`` (the manifest of every count sent).

    What each site releases
    -----------------------
    In the clear, exactly (no differential privacy, no noise, no secure aggregation): its distinct event times,
    then at every shared event time and for each group it holds, its number of records at risk and its number of
    events (the rows of ``released``; a site's own event times are those with ``events > 0``). Its label set of
    ``group_col`` is thereby released too.

    Raises
    ------
    ValueError
        As :func:`kaplan_meier`'s, and: ``group_col`` with a single level; no event at all; ``stratified=True``
        without ``site_col``; stratified with no site holding two groups.
    """
    stratified = site_col is not None if stratified is None else stratified
    records = _logrank_records(data, time_col=time_col, event_col=event_col, site_col=site_col, group_col=group_col,
                               stratified=stratified)
    shared, sums = _logrank_rounds(records)
    result = km.logrank_test(sums, stratified=stratified)
    labels = pd.Index([records.group_labels[code] for code in result.groups], name=group_col)
    groups = len(labels)
    name = "stratified_logrank_test" if stratified else ("logrank_test" if groups == 2 else "multivariate_logrank_test")
    return LogrankTestResult(
        statistic=result.statistic, p_value=result.p_value, degrees_of_freedom=result.degrees_of_freedom,
        observed=pd.Series(result.observed, index=labels, name="observed"),
        expected=pd.Series(result.expected, index=labels, name="expected"),
        stratified=stratified, test_name=name, group_col=group_col, site_col=site_col,
        sites=tuple(records.site_labels), released=_released(records, sums, shared),
    )


def _logrank_rounds(records: _Records) -> tuple[np.ndarray, list[km.LogrankSums]]:
    """:func:`logrank_test`'s two rounds: the union of the sites' distinct event times, and each site's at-risk and
    event counts per group (groups coded 0..G-1) at those times (:func:`models.km.site_logrank_sums`)."""
    sites = range(len(records.site_labels))
    # Round 1: each site's distinct event times; the server's union.
    shared = np.unique(np.concatenate([np.unique(records.time[(records.site == s) & records.event]) for s in sites]))
    # Round 2: each site's at-risk and event counts per group at the shared times.
    sums = [km.site_logrank_sums(records.time[records.site == s], records.event[records.site == s],
                                 records.group[records.site == s], shared) for s in sites]
    return shared, sums


def _logrank_records(data: pd.DataFrame, *, time_col: Hashable, event_col: Hashable, site_col: Hashable | None,
                     group_col: Hashable | None, stratified: bool) -> _Records:
    """The records of :func:`logrank_test`, refusing in one line what no log-rank test can be computed from."""
    if group_col is None:
        raise ValueError("group_col is None: name the column of the groups to compare (e.g. the treatment arm)")
    if stratified and site_col is None:
        raise ValueError("stratified=True needs site_col: name the column of each record's site, "
                         "or pass stratified=False")
    records = _records(data, time_col=time_col, event_col=event_col, site_col=site_col, group_col=group_col)
    if len(records.group_labels) < 2:
        raise ValueError(f"group_col {group_col!r} has a single level ({records.group_labels[0]!r}): "
                         "the log-rank test compares two or more groups")
    if not records.event.any():
        raise ValueError(f"event_col {event_col!r} has no events ({records.event.size} censored records): "
                         "the log-rank test needs at least one event")
    sites = range(len(records.site_labels))
    if stratified and not any(np.unique(records.group[records.site == s]).size > 1 for s in sites):
        raise ValueError(f"no site of site_col {site_col!r} holds two levels of group_col {group_col!r}: "
                         "a stratified test has no information; pass stratified=False")
    return records


def _released(records: _Records, sums: list[km.LogrankSums], shared: np.ndarray) -> pd.DataFrame:
    """What the sites released: one row per (site, shared event time, group the site holds) with its counts, in the
    order of the sites' and groups' codes, labelled as the user gave them."""
    rows = [pd.DataFrame({"site": s, "time": shared, "group": code, "at_risk": _as_int(part.at_risk[:, j]),
                          "events": _as_int(part.events[:, j])})
            for s, part in enumerate(sums) for j, code in enumerate(part.groups)]
    released = pd.concat(rows, ignore_index=True).sort_values(["site", "time", "group"], ignore_index=True)
    released["site"] = [records.site_labels[code] for code in released["site"]]
    released["group"] = [records.group_labels[code] for code in released["group"]]
    return released

