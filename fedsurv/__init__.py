"""fedsurv's Python API: apply a trained run's model to new raw records.

>>> from fedsurv import load_run
>>> run = load_run("outputs/20261123-120000-csv-fedavg-seed0")
>>> curves = run.predict_survival(new_records)  # DataFrame: one row per record, one column per time

See :mod:`models.predict` (horizontal runs; a split-learning run's encoders stay at its sites).
"""

from models.predict import SavedRun, load_run

__all__ = ["SavedRun", "load_run"]
