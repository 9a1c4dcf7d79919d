"""Input validation for survival tables and federations.

Every check raises :class:`DataValidationError` whose message names the source (a file path or a
label such as ``"sksurv:flchain"``), the column, the problem and the offending rows. Rows are
1-based *data-row* numbers: row 1 is the first row after a CSV header (the first row of a frame).
Its public part (:attr:`DataValidationError.public`) names only the class of failure and the
run-config key of the column, never anything of the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

MAX_LISTED = 5
# An object column is a numeric column with bad entries when at least this share of its
# non-missing values are numbers (otherwise it is a categorical column).
NUMERIC_LOOKING_SHARE = 0.9


#: The classes of failure a :class:`DataValidationError` names in its public part (:attr:`DataValidationError.public`).
MISSING_COLUMN = "missing column"
NOT_TIME = "not a time column"
NOT_EVENT = "not an event column"
NOT_NUMERIC = "not numeric"
NOT_A_FEATURE = "not a feature"
ROLE_CONFLICT = "two roles"
NOT_SPLIT = "not a split column"
IDENTIFIER = "record identifier"
TOO_FEW_RECORDS = "too few records"
NO_TRAINING_EVENT = "no event in the training part"
UNREADABLE = "unreadable file"
DUPLICATE_COLUMNS = "duplicate column names"
FAILURES = (MISSING_COLUMN, NOT_TIME, NOT_EVENT, NOT_NUMERIC, NOT_A_FEATURE, ROLE_CONFLICT, NOT_SPLIT, IDENTIFIER,
            TOO_FEW_RECORDS, NO_TRAINING_EVENT, UNREADABLE, DUPLICATE_COLUMNS)
#: The run-config key of each outcome and feature column, in a public part.
TIME_KEY, EVENT_KEY, FEATURES_KEY = "data.time_col", "data.event_col", "data.feature_cols"


class DataValidationError(ValueError):
    """Raised when input data cannot be used; the message says where and why (file, column, rows, values).

    ``public``: what may be said of the error without anything of the file, as ``(class of failure, key)``
    pairs: a class of :data:`FAILURES` and the run-config key whose column failed (``"data.time_col"``; ``""``
    where no key names it). A deployed site tells the server this part only (:mod:`flwr_app.site_errors`).
    """

    def __init__(self, message: str, *, public: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.public = tuple(public)


def describe_rows(positions: Iterable[int]) -> str:
    """Format 0-based row positions as 1-based data-row numbers, the first five and a count.

    Parameters
    ----------
    positions
        0-based positions of the offending rows.

    Returns
    -------
    str
        For example ``"rows 2, 7, 9"`` or ``"rows 1, 2, 3, 4, 5, ... (12 in all)"``.
    """
    rows = [int(p) + 1 for p in positions]
    shown = ", ".join(str(r) for r in rows[:MAX_LISTED])
    if len(rows) > MAX_LISTED:
        return f"rows {shown}, ... ({len(rows)} in all)"
    return f"row {shown}" if len(rows) == 1 else f"rows {shown}"


def column_problem(source: str, column: str, problem: str, mask: np.ndarray, *, key: str = "") -> str:
    """One problem line: ``"<source>: column '<col>' (<key>): <n> <problem> (rows ...)"``; no ``(<key>)`` when
    ``key`` is "" (the run-config key that names the column)."""
    positions = np.flatnonzero(mask)
    return f"{source}: {_column(column, key)}: {positions.size} {problem} ({describe_rows(positions)})"


def _column(column: str, key: str = "") -> str:
    return f"column '{column}' ({key})" if key else f"column '{column}'"


def shown_values(series: pd.Series) -> str:
    """The distinct non-missing values of ``series`` with their counts, most frequent first, at most
    :data:`MAX_LISTED`: ``"'Alive' (3408), 'Dead' (616)"`` (text quoted, so that surrounding spaces show)."""
    counts = series.dropna().astype(object).map(_shown).value_counts(sort=True)
    listed = ", ".join(f"{value} ({count})" for value, count in counts.head(MAX_LISTED).items())
    return listed + (f", ... ({len(counts)} distinct values)" if len(counts) > MAX_LISTED else "")


def _shown(value: object) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return f"{value:.15g}"
    return repr(str(value))


def require_columns(columns: Iterable[str], present: Sequence[str], *, source: str,
                    keys: Mapping[str, str] | None = None) -> None:
    """Raise if any of ``columns`` is not among ``present``, listing the columns that exist.

    ``keys``: the run-config key that names each column; the error says which key names a missing column
    (``data.time_col names column 'duration', which the file does not have``), and the key is its public part
    (:class:`DataValidationError`).

    Raises
    ------
    DataValidationError
        In one line: every missing column (with its key), and the columns present.
    """
    missing = [c for c in columns if c not in present]
    if not missing:
        return
    keys = keys or {}
    named = [f"{keys[c]} names column '{c}'" for c in missing if keys.get(c)]
    unnamed = [f"'{c}'" for c in missing if not keys.get(c)]
    parts = [f"{', '.join(named)}, which the file does not have"] if named else []
    if unnamed:
        parts.append(f"missing {'column' if len(unnamed) == 1 else 'columns'} {', '.join(unnamed)}")
    raise DataValidationError(
        f"{source}: {'; '.join(parts)}; columns present: {', '.join(map(str, present))}",
        public=[(MISSING_COLUMN, keys.get(c, "")) for c in missing],
    )


def _non_numeric(series: pd.Series) -> tuple[pd.Series, np.ndarray]:
    """Coerce to float; also return the mask of values present but not numeric."""
    values = pd.to_numeric(series, errors="coerce").astype("float64")
    return values, (series.notna() & values.isna()).to_numpy()


def time_problems(series: pd.Series, *, source: str, column: str) -> tuple[np.ndarray, list[str]]:
    """Parse a time column (``data.time_col``); return the float64 times and a list of problem lines."""
    values, bad = _non_numeric(series)
    times = values.to_numpy()
    checks = {
        "non-numeric values": bad,
        "missing (NaN) values": series.isna().to_numpy(),
        "infinite values": np.isinf(times),
        "negative values": times < 0,
    }
    return times, [column_problem(source, column, p, m, key=TIME_KEY) for p, m in checks.items() if m.any()]


#: The keys (:func:`event_key`) of an event column's values read without ``data.event_values``: 0/1 and booleans.
BINARY_EVENTS = {"0": 0.0, "1": 1.0, "false": 0.0, "true": 1.0}
#: Values that usually mark an event: the example an error about a text event column suggests first.
EVENT_WORDS = ("dead", "death", "died", "deceased", "event", "yes", "relapse", "recurrence", "failure", "failed")


def event_key(value: object) -> str:
    """How an event value is compared with ``data.event_values``: a number by its value (``1``, ``1.0`` and
    ``" 1 "`` alike), a boolean as ``true``/``false``, other text without surrounding spaces and case-folded."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        return text.casefold()
    return f"{number:.17g}" if np.isfinite(number) else text.casefold()


def event_problems(series: pd.Series, *, source: str, column: str,
                   event_values: Sequence[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Parse an event column (``data.event_col``); return float32 events in {0, 1} and problem lines.

    Without ``event_values`` the column holds 0/1 (numbers or text) or booleans (``True``/``False``, any case).
    With them (``data.event_values``), a record whose value matches one of them (:func:`event_key`: numbers by
    value, text ignoring case and surrounding spaces) is an event and any other value a censored record; a value
    of ``event_values`` that no row holds is a problem, naming the values found. A missing value is a problem
    either way, as is a 0/1 column without any 1. Other values than 0/1 without ``event_values`` are a problem
    naming the values found and, unless ``event_values`` is None (a caller that takes no
    ``data.event_values``), the key that maps them.
    """
    missing = series.isna().to_numpy()
    keys = series.astype(object).map(event_key, na_action="ignore")
    problems = [column_problem(source, column, "missing (NaN) values", missing, key=EVENT_KEY)] if missing.any() else []
    where = f"{source}: {_column(column, EVENT_KEY)}"
    if event_values:
        wanted = {event_key(value): value for value in event_values}
        unmatched = [repr(value) for key, value in wanted.items() if not (keys == key).any()]
        if unmatched:
            problems.append(f"{where}: data.event_values names {', '.join(unmatched)}, which no row holds; values "
                            f"found: {shown_values(series)}")
        return keys.isin(list(wanted)).to_numpy(dtype="float32"), problems
    other = (keys.notna() & ~keys.isin(list(BINARY_EVENTS))).to_numpy()
    if other.any():
        rows = describe_rows(np.flatnonzero(other))
        fix = ("" if event_values is None else f"; name the values that mark an event in data.event_values (e.g. "
               f"data.event_values={_example(series)}): every other value then marks a censored record")
        problems.append(f"{where}: {other.sum()} values other than 0/1 or true/false ({rows}); values found: "
                        f"{shown_values(series)}{fix}")
    events = keys.map(BINARY_EVENTS).to_numpy(dtype="float64", na_value=np.nan)
    if not problems and not (events == 1.0).any():
        problems.append(f"{where}: no events at all (all {events.size} rows are 0)")
    return events.astype("float32"), problems


def _example(series: pd.Series) -> str:
    """A plausible ``data.event_values`` for an event column that is not 0/1: a word that usually marks an event;
    for numbers with a 0, every other number (causes counted together; several as a list, ``[1,2]``), without a 0
    the largest (R's ``status`` 1 = censored, 2 = dead); else the least frequent value."""
    texts = series.dropna().astype(object).map(lambda value: str(value).strip())
    words = [text for text in texts.unique() if text.casefold() in EVENT_WORDS]
    if words:
        return words[0]
    numbers = pd.to_numeric(texts, errors="coerce")
    if numbers.notna().all():
        causes = [f"{number:.15g}" for number in sorted(set(numbers)) if number != 0]
        return (f"[{','.join(causes)}]" if len(causes) > 1 else causes[0]) if 0 in set(numbers) else causes[-1]
    return str(texts.value_counts().index[-1])


def feature_problems(frame: pd.DataFrame, *, source: str) -> list[str]:
    """Problems in feature columns: infinities, and non-numeric entries in numeric-looking columns.

    An object column counts as numeric when at least ``NUMERIC_LOOKING_SHARE`` of its non-missing
    values parse as numbers; its other values are then reported with their counts, and the two fixes:
    ``data.categorical_cols`` (the column is categories) or cleaning them. Other object, string,
    boolean and categorical columns (``data.categorical_cols`` makes a column categorical) are
    categorical features and need no check.
    """
    problems, mixed = [], []
    for column in frame.columns:
        series = frame[column]
        if pd.api.types.is_bool_dtype(series) or isinstance(series.dtype, pd.CategoricalDtype):
            continue
        if pd.api.types.is_numeric_dtype(series):
            inf = np.isinf(series.to_numpy(dtype="float64", na_value=np.nan))
            if inf.any():
                problems.append(column_problem(source, str(column), "infinite values", inf))
            continue
        values, bad = _non_numeric(series)
        if bad.any() and values.notna().sum() >= NUMERIC_LOOKING_SHARE * series.notna().sum():
            mixed.append(str(column))
            problems.append(column_problem(source, str(column), "non-numeric values in a numeric column", bad)
                            + f": {shown_values(series[bad])}; list the column in data.categorical_cols to use its "
                            "values as categories, or clean these values (an empty cell is a missing value)")
    if len(mixed) > 1:
        problems.append(f"{source}: to read these {len(mixed)} columns as categories, add them to "
                        f"data.categorical_cols: {','.join(mixed)}")
    return problems


#: Tables with fewer rows say nothing about whether a column is an identifier (every column of a tiny table may be unique).
ID_LIKE_MIN_ROWS = 20
#: A string column is identifier-like when it has more distinct levels than this share of its rows.
ID_LIKE_LEVEL_SHARE = 0.5
#: The keys that take a record ID column or a column that is not a feature.
ID_KEYS = "data.id_col (or data.drop_cols)"


def _is_string(series: pd.Series) -> bool:
    return not (pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series)
                or pd.api.types.is_datetime64_any_dtype(series))


def identifier_problems(frame: pd.DataFrame, *, source: str) -> list[str]:
    """Feature columns that look like record identifiers, one line each naming the file, the column and the key.

    The one rule, for user files (``data.name = csv``, deployed sites' files, vertical modality
    files): an integer or string column unique on every row, or a string column with more distinct
    levels than half its rows. Continuous (float) measurements are not identifiers, nor is any
    column of a table with fewer than :data:`ID_LIKE_MIN_ROWS` rows. An ID used as a feature
    lets a model learn the order in which records were collected, and one-hot encodes into a
    column per record, whose levels (the IDs) a federation would send to the server.
    """
    problems = []
    if len(frame) < ID_LIKE_MIN_ROWS:
        return problems
    for column in frame.columns:
        series = frame[column]
        integer = pd.api.types.is_integer_dtype(series) and not pd.api.types.is_bool_dtype(series)
        if not (integer or _is_string(series)):
            continue
        levels = int(series.dropna().astype(str).nunique())
        if levels == len(series):
            why = f"{'an integer' if integer else 'a string'} column unique on every row"
        elif not integer and levels > ID_LIKE_LEVEL_SHARE * len(series):
            why = f"a string column with {levels} distinct values in {len(series)} rows"
        else:
            continue
        problems.append(f"{source}: column '{column}' looks like a record identifier ({why}); name it in "
                        f"{ID_KEYS}, or list the features in data.feature_cols")
    return problems


#: An integer-valued numeric column with this many distinct values or fewer (and at least 3) may be category codes.
INTEGER_CODE_MAX_LEVELS = 12


def integer_code_notes(frame: pd.DataFrame, *, source: str) -> list[str]:
    """One line for each numeric feature whose values are a few integers (3 to :data:`INTEGER_CODE_MAX_LEVELS` distinct
    ones): it is standardised as a number, and if its values are codes of categories (a centre, a stage, a
    grade), ``data.categorical_cols`` should list it. A note, not an error: counts and scores are integers too."""
    notes = []
    for column in frame.columns:
        series = frame[column]
        if not pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series):
            continue
        values = series.dropna()
        levels = values.unique()
        if 3 <= len(levels) <= INTEGER_CODE_MAX_LEVELS and bool((values % 1 == 0).all()):
            shown = ", ".join(f"{level:g}" for level in sorted(levels))
            notes.append(f"{source}: column '{column}' holds {len(levels)} integer values ({shown}) and is used as a "
                         "number; if they are codes of categories, list it in data.categorical_cols")
    return notes


def duplicate_column_problems(header: Sequence[object], *, source: str) -> list[str]:
    """Column names that appear more than once in a file's raw header (pandas would rename them ``a.1`` and use both)."""
    names = [str(name) for name in header]
    return [f"{source}: column '{name}' appears {names.count(name)} times in the header (columns "
            f"{', '.join(str(i + 1) for i, other in enumerate(names) if other == name)}); rename or remove the "
            "duplicates" for name in dict.fromkeys(names) if names.count(name) > 1]


def validate_survival_frame(
    df: pd.DataFrame,
    *,
    source: str,
    time_col: str,
    event_col: str,
    feature_cols: Sequence[str],
    event_values: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Check a raw survival table and return its parsed time and event columns.

    Parameters
    ----------
    df
        Raw table, one record per row.
    source
        File path or label used in error messages.
    time_col, event_col
        Names of the time and event columns.
    feature_cols
        Feature columns to check.
    event_values
        The values of the event column that mark an event (``data.event_values``; :func:`event_problems`);
        empty: it holds 0/1 or booleans; None: the same, for a caller that takes no ``data.event_values``.

    Returns
    -------
    tuple of numpy.ndarray
        Times (float64) and events (float32, in {0, 1}).

    Raises
    ------
    DataValidationError
        For an empty table, missing columns, non-numeric or infinite values, negative or missing
        times, events outside {0, 1}, or a table without events. All problems found are listed,
        one per line.
    """
    if len(df) == 0:
        raise DataValidationError(f"{source}: empty file (a header line, no data rows); give one row per record "
                                  "under the header", public=[(TOO_FEW_RECORDS, "")])
    keys = {**{column: FEATURES_KEY for column in feature_cols}, event_col: EVENT_KEY, time_col: TIME_KEY}
    require_columns([time_col, event_col, *feature_cols], list(map(str, df.columns)), source=source, keys=keys)
    times, time_issues = time_problems(df[time_col], source=source, column=time_col)
    events, event_issues = event_problems(df[event_col], source=source, column=event_col, event_values=event_values)
    feature_issues = feature_problems(df[list(feature_cols)], source=source)
    public = [part for part, issues in (((NOT_TIME, TIME_KEY), time_issues), ((NOT_EVENT, EVENT_KEY), event_issues),
                                        ((NOT_NUMERIC, FEATURES_KEY), feature_issues)) if issues]
    if public:
        raise DataValidationError("\n".join(time_issues + event_issues + feature_issues), public=public)
    return times, events


def check_site_events(event_by_site: Mapping[str, np.ndarray], *, source: str, part: str) -> None:
    """Raise if any site has no events in ``part`` (e.g. ``"training"``), naming the sites.

    Raises
    ------
    DataValidationError
        Naming each site without events and its number of records.
    """
    empty = [f"site '{name}' ({len(e)} records)" for name, e in event_by_site.items() if not np.any(e == 1)]
    if empty:
        raise DataValidationError(
            f"{source}: no events in the {part} part of {', '.join(empty)}; a site needs at least "
            "one event (use fewer sites, another partition or a larger min_site_records)",
            public=[(NO_TRAINING_EVENT, EVENT_KEY)] if part == "training" else (),
        )


def _dtype_kind(dtype: object) -> str:
    """Coarse dtype family that decides how a column is preprocessed."""
    if pd.api.types.is_bool_dtype(dtype):
        return "boolean"
    if isinstance(dtype, pd.CategoricalDtype) or not pd.api.types.is_numeric_dtype(dtype):
        return "datetime" if pd.api.types.is_datetime64_any_dtype(dtype) else "categorical"
    return "numeric"


def column_differences(
    columns: Mapping[str, str], reference: Mapping[str, str], *, reference_name: str,
) -> list[str]:
    """How a site's columns differ from the reference site's: missing and extra columns, columns of another kind.

    ``columns`` and ``reference`` map each column name, in file order, to its kind (``"numeric"``,
    ``"categorical"``, ...). Each difference names the columns, the kinds and the reference site.
    """
    missing = [c for c in reference if c not in columns]
    extra = [c for c in columns if c not in reference]
    found = []
    if missing:
        found.append(f"missing columns {missing} (present at site '{reference_name}')")
    if extra:
        found.append(f"extra columns {extra} (absent at site '{reference_name}')")
    found += [f"column '{c}' is {columns[c]} but {reference[c]} at site '{reference_name}'"
              for c in reference if c in columns and columns[c] != reference[c]]
    return found


def check_same_schema(frames: Mapping[str, pd.DataFrame]) -> None:
    """Check that every site's frame has the columns and column kinds of the first site.

    Integer and float columns are both *numeric* (a site whose column holds missing values reads it
    as float); a mismatch is a change of kind: numeric, boolean, categorical or datetime.

    Parameters
    ----------
    frames
        Site name -> that site's raw table. The first site is the reference.

    Raises
    ------
    DataValidationError
        Naming each site that differs, its missing and extra columns, and its dtype mismatches.
    """
    if not frames:
        return
    reference_name, reference = next(iter(frames.items()))
    kinds = {str(c): _dtype_kind(t) for c, t in reference.dtypes.items()}
    problems = [
        f"site '{name}': {difference}"
        for name, frame in frames.items()
        for difference in column_differences({str(c): _dtype_kind(t) for c, t in frame.dtypes.items()},
                                             kinds, reference_name=reference_name)
    ]
    if problems:
        raise DataValidationError("schema differs across sites:\n" + "\n".join(problems))


def checked_outcomes(frame: pd.DataFrame, outcome: tuple[str, str],
                     event_values: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The frame's time and event columns: finite times, events 0/1 (or, with ``event_values``, the run's
    ``data.event_values``: an event where the column holds one of them, read as in training), else one line naming
    the columns."""
    missing = [column for column in outcome if column not in frame.columns]
    if missing:
        raise DataValidationError(f"labelled records: no outcome column(s) {', '.join(map(repr, missing))}")
    time = pd.to_numeric(frame[outcome[0]], errors="coerce").to_numpy(dtype=np.float64)
    if event_values:
        event, _ = event_problems(frame[outcome[1]], source="labelled records", column=outcome[1],
                                  event_values=event_values)
        event = np.where(frame[outcome[1]].isna().to_numpy(), np.nan, event)
    else:
        event = pd.to_numeric(frame[outcome[1]], errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(time) | ~np.isin(event, (0.0, 1.0))
    if bad.any():
        raise DataValidationError(f"labelled records: {int(bad.sum())} row(s) without a finite time in "
                                  f"'{outcome[0]}' or a 0/1 event in '{outcome[1]}' (first: row "
                                  f"{frame.index[np.argmax(bad)]!r})")
    return time, event.astype(np.int64)
