"""The vocabulary of a sweep's tables (``results.csv``, ``summary.csv``): written by :mod:`simulations.sweep`,
drawn by :mod:`simulations.plots`."""

__all__ = ["CENTRALIZED", "SETTING_COLUMNS"]

#: The strategy of a run's centralised baseline row (``centralized_<mechanism>`` with a record-level mechanism's noise).
CENTRALIZED = "centralized"
#: Columns that identify one experimental setting apart from the seed.
SETTING_COLUMNS = ["variant", "data", "model", "rounds", "num_sites"]
