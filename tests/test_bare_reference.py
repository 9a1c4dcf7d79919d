"""The Flower-overhead benchmark's bare loop does the work of the real apps and gets their figures."""

from __future__ import annotations

import pytest

from benchmarks.flower_overhead import bare_federation
from simulations.engine import resolve, run_inprocess


@pytest.mark.parametrize("model", ["hazard_mlp", "cox_mlp"])
def test_the_bare_loop_evaluates_every_site_as_the_client_app_does(model, tmp_path):
    overrides = {"model.name": model, "federation.num_sites": 3, "federation.rounds": 2,
                 "evaluation.server_side": False, "baseline.centralized": False, "federation.update_bound": 0}
    summary = run_inprocess({**overrides, "output.dir": str(tmp_path)})
    assert summary["test_source"] == "weighted mean of the sites' own test metrics"
    bare = bare_federation(resolve(overrides)[1])
    for key in ("c_index", "c_index_td", "ibs", "inbll"):
        assert bare[key] == pytest.approx(summary["test"][key], rel=0, abs=1e-9), key


def test_the_bare_loop_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match="evaluation.server_side = false"):
        bare_federation(resolve({"evaluation.server_side": True})[1])
    with pytest.raises(ValueError, match="federation.server_optimizer = 'fedavg'"):
        bare_federation(resolve({"evaluation.server_side": False, "federation.update_bound": 0,
                                 "federation.server_optimizer": "fedadam"})[1])
    with pytest.raises(ValueError, match="federation.update_bound = 0"):
        bare_federation(resolve({"evaluation.server_side": False})[1])
