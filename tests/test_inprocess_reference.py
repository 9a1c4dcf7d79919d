"""The bare in-process loop (the benchmarks' reference) does the work of the real apps and gets their figures."""

from __future__ import annotations

import pytest

from simulations.engine import resolve
from simulations.inprocess import run_federation, run_inprocess


@pytest.mark.parametrize("model", ["hazard_mlp", "cox_mlp"])
def test_the_bare_loop_evaluates_every_site_as_the_client_app_does(model, tmp_path):
    overrides = {"model.name": model, "federation.num_sites": 3, "federation.rounds": 2,
                 "evaluation.server_side": False, "baseline.centralized": False}
    summary = run_inprocess({**overrides, "output.dir": str(tmp_path)})
    assert summary["test_source"] == "weighted mean of the sites' own test metrics"
    bare = run_federation(resolve(overrides)[1], evaluate_sites=True)
    for key in ("c_index", "c_index_td", "ibs", "inbll"):
        assert bare["sites_mean"][key] == pytest.approx(summary["test"][key], rel=0, abs=1e-9), key
