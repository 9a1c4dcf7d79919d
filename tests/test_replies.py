"""strategies.replies.suspect_evaluations: the leave-one-out screen, exact and in O(n log n)."""

from __future__ import annotations

import math
from statistics import median

import numpy as np
import pytest

from strategies.replies import suspect_evaluations


def one_at_a_time(per_site, *, spread_factor=6.0):
    """The rule as its docstring states it, computed site by site (O(n^2)): the reference."""
    floor = {"c_index": 0.15, "c_index_td": 0.15, "ibs": 0.5, "inbll": 0.5}
    suspects = {}
    keys = sorted({key for metrics in per_site.values() for key in metrics} & set(floor))
    for site, metrics in per_site.items():
        for key in keys:
            value = metrics.get(key, math.nan)
            others = [float(other[key]) for name, other in per_site.items()
                      if name != site and key in other and math.isfinite(float(other[key]))]
            if not math.isfinite(value) or len(others) < 2:
                continue
            centre = median(others)
            spread = 1.4826 * median(abs(other - centre) for other in others)
            tolerance = max(floor[key] * (abs(centre) if key in {"ibs", "inbll"} else 1.0), spread_factor * spread)
            if abs(value - centre) > tolerance:
                suspects[site] = (f"{key} = {value:.4g} stands outside the other sites' {centre:.4g} +/- "
                                  f"{tolerance:.3g} (median +/- max(floor, {spread_factor:g} x spread))")
                break
    return suspects


@pytest.mark.parametrize("seed", range(40))
def test_the_screen_is_the_site_by_site_rule_exactly(seed):
    rng = np.random.default_rng(seed)
    sites = int(rng.integers(1, 60))
    per_site = {}
    for index in range(sites):
        metrics = {"c_index": float(rng.normal(0.75, 0.05)), "ibs": float(rng.gamma(5, 0.02)),
                   "c_index_td": float(np.round(rng.normal(0.7, 0.05), 2))}  # rounded: ties
        if rng.random() < 0.1:
            metrics["c_index"] = float(rng.choice([0.02, 0.99, math.nan]))  # forged or undefined
        if rng.random() < 0.1:
            del metrics["ibs"]
        per_site[f"site-{index}"] = metrics
    assert suspect_evaluations(per_site) == one_at_a_time(per_site)


def test_a_forged_site_among_a_thousand_is_named_alone():
    rng = np.random.default_rng(0)
    per_site = {f"site-{i}": {"c_index": float(rng.normal(0.78, 0.03)), "ibs": float(rng.normal(0.1, 0.01))}
                for i in range(1000)}
    per_site["site-7"]["c_index"] = 0.2
    assert list(suspect_evaluations(per_site)) == ["site-7"]
