"""Time-to-default records from the raw U.S. SBA national loan file.

Outcome (as in the FSL-BDP credit-risk paper): a loan *defaults* when ``MIS_Status == "CHGOFF"``
and the charge-off falls within ``horizon`` months of disbursement; the time is then the number of
months from ``DisbursementDate`` to ``ChgOffDate``. Every other loan is censored at
``min(horizon, Term)`` months (a loan charged off after the horizon is censored at the horizon).

Rows are dropped (and counted in the log) when the status is missing or unknown, a date needed for
the outcome is missing or unparseable, ``Term`` is missing, or the charge-off precedes the
disbursement. Features are origination-time attributes only; columns that leak the outcome
(``ChgOffDate``, ``ChgOffPrinGr``, ``MIS_Status``, ``BalanceGross``), identifiers and free text
(``LoanNr_ChkDgt``, ``Name``, ``City``, ``Zip``, ``Bank``) and calendar time (``ApprovalFY``; the
approval date is the out-of-time period instead) are not features.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

logger = logging.getLogger(__name__)

DEFAULT_OOT_START = "2005-01-01"
DAYS_PER_MONTH = 365.25 / 12
REAL_ESTATE_TERM_MONTHS = 240
RAW_COLUMNS = (
    "State", "BankState", "NAICS", "ApprovalDate", "Term", "NoEmp", "NewExist", "CreateJob",
    "RetainedJob", "FranchiseCode", "UrbanRural", "RevLineCr", "LowDoc", "ChgOffDate",
    "DisbursementDate", "DisbursementGross", "MIS_Status", "GrAppv", "SBA_Appv",
)  # fmt: skip
FEATURE_COLUMNS = (
    "Term", "log1p_NoEmp", "log1p_CreateJob", "log1p_RetainedJob", "log1p_DisbursementGross", "log1p_GrAppv",
    "log1p_SBA_Appv", "sba_share", "real_estate", "franchise", "same_state_bank", "new_business", "urban_rural",
    "revolving_credit", "low_doc", "naics_sector",
)  # fmt: skip
PERIOD_COLUMN = "ApprovalDate"
LOG_AMOUNTS = ("NoEmp", "CreateJob", "RetainedJob", "DisbursementGross", "GrAppv", "SBA_Appv")
DATE_FORMATS = ("%m/%d/%Y", "%d-%b-%y", "%Y-%m-%d", "%d-%b-%Y")

# U.S. Census Bureau regions and divisions (DC belongs to the South Atlantic division).
CENSUS_DIVISIONS = {
    ("Northeast", "New England"): "CT ME MA NH RI VT",
    ("Northeast", "Middle Atlantic"): "NJ NY PA",
    ("Midwest", "East North Central"): "IL IN MI OH WI",
    ("Midwest", "West North Central"): "IA KS MN MO NE ND SD",
    ("South", "South Atlantic"): "DE DC FL GA MD NC SC VA WV",
    ("South", "East South Central"): "AL KY MS TN",
    ("South", "West South Central"): "AR LA OK TX",
    ("West", "Mountain"): "AZ CO ID MT NV NM UT WY",
    ("West", "Pacific"): "AK CA HI OR WA",
}
STATE_REGION = {s: r for (r, _), states in CENSUS_DIVISIONS.items() for s in states.split()}
STATE_DIVISION = {s: d for (_, d), states in CENSUS_DIVISIONS.items() for s in states.split()}

# NAICS sectors that span several 2-digit codes.
NAICS_SECTORS = {
    "31": "31-33", "32": "31-33", "33": "31-33", "44": "44-45", "45": "44-45", "48": "48-49", "49": "48-49",
}  # fmt: skip


def parse_money(series: pd.Series) -> pd.Series:
    """Amounts as floats; strings such as ``"$60,000.00 "`` are accepted."""
    if pd.api.types.is_numeric_dtype(series):
        return series.astype("float64")
    cleaned = series.astype("string").str.replace(r"[$,\s]", "", regex=True)
    return pd.to_numeric(cleaned, errors="coerce").astype("float64")


def parse_dates(series: pd.Series) -> pd.Series:
    """Dates in any of ``DATE_FORMATS`` (first match wins); unparseable -> NaT.

    Two-digit years follow Python's ``%y``: 69-99 -> 1969-1999, 00-68 -> 2000-2068.
    """
    text = series.astype("string").str.strip()
    dates = pd.Series(pd.NaT, index=series.index, dtype="datetime64[ns]")
    for date_format in DATE_FORMATS:
        todo = dates.isna() & text.notna()
        if not todo.any():
            break
        dates[todo] = pd.to_datetime(text[todo], format=date_format, errors="coerce")
    return dates


def _float(series: pd.Series) -> pd.Series:
    """Nullable values as float64 with NaN for missing."""
    return pd.Series(series.to_numpy(dtype="float64", na_value=np.nan), index=series.index)


def _text(series: pd.Series) -> pd.Series:
    """Codes as stripped upper-case strings (``1.0`` -> ``"1"``), missing kept missing."""
    return series.astype("string").str.strip().str.upper().str.removesuffix(".0")


def _category(series: pd.Series, mapping: dict[str, str]) -> pd.Series:
    """Codes translated by ``mapping``; any other code -> missing (one-hot zeros)."""
    return _text(series).map(mapping).astype(object)


def naics_sector(naics: pd.Series) -> pd.Series:
    """NAICS 2-digit sector (manufacturing, retail and transport merged); code 0 or missing -> missing."""
    code = _text(naics)
    sector = code.str[:2].where(code.str.len() >= 2)
    return sector.map(lambda s: NAICS_SECTORS.get(s, s), na_action="ignore").astype(object)


def origination_features(raw: pd.DataFrame) -> pd.DataFrame:
    """Features known when a loan is approved (see module docs)."""
    amounts = {c: parse_money(raw[c]) for c in LOG_AMOUNTS}
    term = pd.to_numeric(raw["Term"], errors="coerce")
    franchise_code = pd.to_numeric(raw["FranchiseCode"], errors="coerce")
    features = {
        "Term": term,
        **{f"log1p_{c}": np.log1p(v.where(v >= 0)) for c, v in amounts.items()},
        "sba_share": amounts["SBA_Appv"] / amounts["GrAppv"].where(amounts["GrAppv"] > 0),
        "real_estate": _float((term >= REAL_ESTATE_TERM_MONTHS).astype("boolean").where(term.notna())),
        "franchise": _float((franchise_code > 1).astype("boolean").where(franchise_code.notna())),
        "same_state_bank": _float(_text(raw["BankState"]) == _text(raw["State"])),
        "new_business": _category(raw["NewExist"], {"1": "existing", "2": "new"}),
        "urban_rural": _category(raw["UrbanRural"], {"1": "urban", "2": "rural"}),
        "revolving_credit": _category(raw["RevLineCr"], {"Y": "Y", "N": "N"}),
        "low_doc": _category(raw["LowDoc"], {"Y": "Y", "N": "N"}),
        "naics_sector": naics_sector(raw["NAICS"]),
    }
    return pd.DataFrame(features, index=raw.index)


def census_groups(raw: pd.DataFrame) -> pd.DataFrame:
    """``State``, census ``region`` and ``division`` of each loan (missing outside the 50 states + DC)."""
    state = _text(raw["State"])
    groups = {"State": state, "region": state.map(STATE_REGION), "division": state.map(STATE_DIVISION)}
    return pd.DataFrame({name: values.astype(object) for name, values in groups.items()}, index=raw.index)


def usable_rows(
    status: pd.Series, dates: dict[str, pd.Series], term: pd.Series, months: pd.Series
) -> pd.Series:
    """Rows whose outcome can be built; the reasons for dropping the others are logged."""
    charged_off = (status == "CHGOFF").fillna(False)
    reasons = {
        "missing or unknown MIS_Status": ~status.isin(["CHGOFF", "P I F"]).fillna(False),
        "missing DisbursementDate": dates["DisbursementDate"].isna(),
        f"missing {PERIOD_COLUMN}": dates[PERIOD_COLUMN].isna(),
        "missing Term": term.isna(),
        "CHGOFF without ChgOffDate": charged_off & dates["ChgOffDate"].isna(),
        "charge-off before disbursement": charged_off & (months < 0),
    }
    usable = ~pd.concat(reasons, axis=1).any(axis=1)
    counts = ", ".join(f"{name}: {int(mask.sum())}" for name, mask in reasons.items() if mask.any())
    logger.info(
        "SBA: kept %d of %d loans; dropped %d (%s)", usable.sum(), len(usable), (~usable).sum(), counts or "none"
    )
    return usable


def sba_records(raw: pd.DataFrame, horizon_months: int) -> pd.DataFrame:
    """Tidy SBA table of usable loans: features, ``time``, ``event``, group columns, ``ApprovalDate``.

    Parameters
    ----------
    raw
        The raw loan file (columns ``RAW_COLUMNS`` at least).
    horizon_months
        Observation horizon in months.
    """
    if horizon_months <= 0:
        raise ValueError(f"sba_horizon_months must be positive, got {horizon_months}")
    status = _text(raw["MIS_Status"])
    dates = {c: parse_dates(raw[c]) for c in (PERIOD_COLUMN, "DisbursementDate", "ChgOffDate")}
    term = pd.to_numeric(raw["Term"], errors="coerce")
    months = (dates["ChgOffDate"] - dates["DisbursementDate"]).dt.days / DAYS_PER_MONTH
    event = ((status == "CHGOFF").fillna(False) & (months <= horizon_months)).astype(float)
    time = months.where(event == 1, np.minimum(term, horizon_months))
    outcome = pd.DataFrame({"time": time, "event": event, PERIOD_COLUMN: dates[PERIOD_COLUMN]})
    frame = pd.concat([origination_features(raw), census_groups(raw), outcome], axis=1)
    return frame[usable_rows(status, dates, term, months).to_numpy()].reset_index(drop=True)
