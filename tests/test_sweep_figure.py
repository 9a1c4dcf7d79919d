"""The sweep's privacy-utility figure states its real seed count and draws error bars."""

import math

import pandas as pd
from matplotlib.container import ErrorbarContainer

from simulations.plots import _title, privacy_utility_figure


def _rows(n_runs: int, std: float) -> pd.DataFrame:
    base = {"variant": "", "data": "flchain", "model": "hazard_mlp", "rounds": 20, "num_sites": 5, "n_runs": n_runs}
    rows = [{**base, "strategy": "dp_sgd", "epsilon_target": eps, "test_c_index_mean": c,
             "test_c_index_std": std, "test_ibs_mean": 0.10 + 0.001 * i, "test_ibs_std": std / 10}
            for i, (eps, c) in enumerate([(1.0, 0.800), (3.0, 0.805), (10.0, 0.810)])]
    rows.append({**base, "strategy": "fedavg", "epsilon_target": math.inf, "test_c_index_mean": 0.809,
                 "test_c_index_std": std, "test_ibs_mean": 0.1, "test_ibs_std": std / 10})
    return pd.DataFrame(rows)


def test_title_states_the_seed_count():
    assert _title(_rows(5, 0.01)).endswith("(mean ± std over 5 seeds)")
    assert _title(_rows(1, float("nan"))).endswith("(1 seed (no error bars))")
    mixed = _rows(5, 0.01)
    mixed.loc[0, "n_runs"] = 3
    assert _title(mixed).endswith("(mean ± std over 3–5 seeds per point)")
    assert "up to" not in _title(mixed)


def test_error_bars_and_a_c_axis_that_is_not_zoomed_to_noise():
    setting = _rows(5, 0.004)
    fig = privacy_utility_figure(setting, ["test_c_index", "test_ibs"])
    c_axis = fig.axes[0]
    bars = [c for c in c_axis.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1 and bars[0].has_yerr
    low, high = c_axis.get_ylim()
    assert high - low >= 0.05, (low, high)  # the points span 0.010 (0.800-0.810); the axis does not zoom to it
    # one seed: the points, and no bars of zero length pretending to be error bars
    one = _rows(1, float("nan"))
    fig = privacy_utility_figure(one, ["test_c_index"])
    (bars,) = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert not bars.has_yerr
