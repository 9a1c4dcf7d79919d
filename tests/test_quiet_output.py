"""A normal run prints no warnings (issue 27, item 5): every warning it used to print is fixed at its
source, and these tests turn warnings into errors around the code paths that printed them."""

import re
import warnings

import numpy as np
import pandas as pd

from flwr_app.config import PROJECT_ROOT
from models.time_grid import make_time_grid, time_grid_from_counts
from simulations import engine


def test_tied_times_give_fewer_cuts_without_a_warning():
    """Times in whole years: the quantile levels share cuts, the grid is shorter, nothing is printed."""
    rng = np.random.default_rng(0)
    time = rng.integers(1, 6, 400).astype(float)
    event = (rng.random(400) < 0.6).astype(float)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cuts = make_time_grid(time, event, num_durations=20)
        counted = time_grid_from_counts(np.arange(1.0, 6.0), np.full(5, 10.0), np.full(5, 5.0), num_durations=20)
    assert cuts[0] == 0 and cuts.size < 20 and np.all(np.diff(cuts) > 0)
    assert counted[0] == 0 and counted.size < 20


def test_a_run_on_a_user_csv_with_tied_times_prints_no_warning(tmp_path):
    """The whole run (load, split, time grid, training, evaluation, outputs) on a CSV whose times are
    whole years, warnings as errors."""
    rng = np.random.default_rng(1)
    n = 300
    frame = pd.DataFrame({"age": rng.normal(60, 10, n), "stage": rng.integers(1, 4, n).astype(float),
                          "years": rng.integers(1, 8, n), "died": (rng.random(n) < 0.5).astype(int)})
    path = tmp_path / "site.csv"
    frame.to_csv(path, index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = engine.run_inprocess({
            "data.name": "csv", "data.path": str(path), "data.time_col": "years", "data.event_col": "died",
            "federation.num_sites": 2, "federation.rounds": 1, "baseline.centralized": False,
            "output.dir": str(tmp_path / "run"),
        })
    assert summary["rounds"] == 1


def test_ray_gets_the_setting_its_future_warning_asks_for(monkeypatch):
    """Ray warns at every ``ray.init`` unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is set; the engine
    sets it (the sites use no GPU) before a run or a sweep's cluster starts Ray, and `make flwr` and
    the activated environment set it for `flwr run`."""
    monkeypatch.delenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", raising=False)
    engine._ray_environment()
    import os
    assert os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
    makefile = (PROJECT_ROOT / "Makefile").read_text(encoding="utf-8")
    settings = re.search(r"^FLWR_SETTINGS := (.*?)\n\S", makefile, flags=re.S | re.M).group(1)
    for name in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1"):
        assert name in settings
    assert "'export $(FLWR_SETTINGS)'" in makefile, "the activate script exports them"
