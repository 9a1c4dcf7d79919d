"""``model.name = "coxph"`` with ``cox.secure_sum``: the sites' sums through SecAgg+ (no noise) give the clear fit,
the server never receives one site's sums, a drop-out stops the fit naming the site, and what is not supported is
refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flwr_app.config import ConfigError, parse_run_config
from flwr_app.cox_messages import (
    ARRAYS,
    MEAT,
    SCHOENFELD,
    SECURE_MODULUS_BITS,
    SUMS,
    coxph_manifest,
    from_fixed,
    to_fixed,
)
from flwr_app.cox_server import CoxSiteError
from simulations.engine import resolve, run_inprocess
from strategies.secure_aggregation import centred

FAST = {"evaluation.server_side": False, "baseline.centralized": False}
RUN = {"model.name": "coxph", "data.name": "gbsg", "federation.num_sites": 3, "cox.robust": True, **FAST}


def _coxph(directory) -> dict:
    return json.loads((directory / "coxph.json").read_text(encoding="utf-8"))


def test_the_secure_sum_gives_the_clear_fit_and_the_server_never_sees_one_sites_sums(tmp_path):
    clear = run_inprocess({**RUN, "cox.ph_test": "log", "output.dir": str(tmp_path / "clear")})
    from tests.test_manifest import sent_keys

    seen: list[tuple[str, set[str], set[str]]] = []
    keys: set[tuple[str, str]] = set()

    def observe(message, reply):
        if not reply.has_error():
            seen.append((message.metadata.message_type, set(reply.content.array_records),
                         set(reply.content.config_records)))
            keys.update((message.metadata.message_type, key) for key in sent_keys(reply.content))

    secure = run_inprocess({**RUN, "cox.secure_sum": True, "output.dir": str(tmp_path / "secure")}, observe=observe)
    ours, ref = _coxph(tmp_path / "secure"), _coxph(tmp_path / "clear")
    assert ours["names"] == ref["names"] and ours["converged"] and ours["steps"] == ref["steps"]
    coef, se = np.array(ours["coef"]), np.array(ours["se"])
    ref_coef, ref_se = np.array(ref["coef"]), np.array(ref["se"])
    assert np.max(np.abs(coef - ref_coef)) < 1e-6
    assert np.max(np.abs(se / ref_se - 1)) < 1e-6
    assert ours["robust_variance"] is not None
    assert ours["log_likelihood"] == pytest.approx(ref["log_likelihood"], abs=1e-6)
    assert ours["n"] == ref["n"] and ours["events"] == ref["events"]
    assert ours["ph_test"]["p"] == pytest.approx(ref["ph_test"]["p"], rel=1e-6, abs=1e-9)
    assert secure["coxph"]["concordance_test"] == pytest.approx(clear["coxph"]["concordance_test"], abs=1e-9)
    # the server received no Cox reply in the clear: every site's sums came masked, through the secure sum
    kinds = {kind for kind, _, _ in seen}
    assert not {kind for kind in kinds if kind.startswith("query.cox_")}, kinds
    assert {"query.secagg_setup", "query.secagg_share_keys", "query.secagg_masked", "query.secagg_unmask"} <= kinds
    assert not any(ARRAYS in arrays for _, arrays, _ in seen)
    masked = [arrays for kind, arrays, _ in seen if kind == "query.secagg_masked"]
    assert masked and all(arrays == {"masked"} for arrays in masked)
    assert len(masked) == 3 * (ours["steps"] + 1 + 1 + 1 + 1)  # moments, Newton evaluations, meat, PH test
    ledger = [json.loads(line) for line in (tmp_path / "secure" / "ledger.jsonl").read_text().splitlines()]
    assert ledger and all("sums over sites through SecAgg+" in " ".join(entry["assumptions"]) for entry in ledger)
    manifest = json.loads((tmp_path / "secure" / "manifest.json").read_text())
    assert "only the sum over sites" in json.dumps(manifest)
    _, cfg = resolve({**RUN, "cox.secure_sum": True})
    unlisted = sorted({f"{kind}/{key}" for kind, key in keys if not coxph_manifest(cfg).covers(kind, key)})
    assert not unlisted, unlisted


def test_a_value_beyond_the_fixed_points_range_stops_the_run_naming_the_site_and_the_key(tmp_path):
    # identity: the sum of squared event times in days (about 1e9 at a flchain site) is beyond 2^29 / 3
    with pytest.raises(CoxSiteError, match=r"site 'site-0' would send g_sq_sum\[0\] = .*set cox.secure_sum = "
                                           r"false") as caught:
        run_inprocess({**RUN, "data.name": "flchain", "cox.robust": False, "cox.ph_test": "identity",
                       "cox.secure_sum": True, "output.dir": str(tmp_path)})
    assert "\n" not in str(caught.value)


def test_a_site_dropping_out_of_a_newton_steps_secure_sum_stops_the_fit_naming_it(tmp_path):
    with pytest.raises(CoxSiteError) as caught:
        run_inprocess({**RUN, "cox.robust": False, "cox.ph_test": "none", "cox.secure_sum": True,
                       "debug.fail_site": "site-1", "debug.fail_message": "cox", "debug.fail_round": 2,
                       "output.dir": str(tmp_path)})
    text = str(caught.value)
    assert "\n" not in text and "Newton step 2" in text and "site 'site-1'" in text and "secagg_masked" in text


@pytest.mark.parametrize("overrides, message", [
    ({"cox.strata": "none"}, r"cox.secure_sum = true supports cox.strata = 'site' only"),
    ({"cox.ph_test": "rank"}, r"cox.ph_test = 'rank' needs each site's number of events .* cox.secure_sum = true"),
])
def test_what_the_secure_sum_does_not_support_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_run_config({"model.name": "coxph", "cox.secure_sum": True, **overrides})
    assert "\n" not in str(caught.value)


def test_auto_ph_test_is_log_with_the_secure_sum_and_the_manifest_says_what_the_server_sees():
    _, cfg = resolve({"model.name": "coxph", "cox.secure_sum": True, "cox.robust": True})
    assert cfg.cox.ph_test == "log"
    manifest = coxph_manifest(cfg)
    cox_values = [release for release in manifest.releases if release.message == "cox" and not release.covered]
    assert cox_values and all("only the sum over sites" in release.reason and "drop" in release.reason
                              for release in cox_values)
    assert manifest.covers("query.secagg_masked", "masked.masked")
    assert not manifest.covers("query.cox_sums", f"{ARRAYS}.score")


def test_the_fixed_point_round_trips_and_refuses_a_value_that_could_wrap():
    p = 3
    rng = np.random.default_rng(0)
    a = rng.normal(size=(p, p))
    arrays = {"loglik": np.array([-4321.123456789]), "score": rng.normal(size=p) * 100, "information": a @ a.T * 1e3,
              "n": np.array([700]), "events": np.array([300])}
    fixed = to_fixed(arrays, SUMS, p, parties=4, site="site-0")
    assert fixed.dtype == np.int64 and fixed.min() >= 0 and fixed.max() < 2 ** SECURE_MODULUS_BITS
    found = from_fixed(centred(fixed, 2 ** SECURE_MODULUS_BITS).astype(np.float64), SUMS, p)
    for name, value in arrays.items():
        assert np.max(np.abs(found[name] - value)) <= 2.0 ** -32
    assert found["n"].dtype == np.int64 and found["n"][0] == 700
    with pytest.raises(ValueError, match=r"site 'site-2' would send meat\[0\] = 2e\+08.*cox.secure_sum") as caught:
        to_fixed({"meat": np.eye(p) * 2e8}, MEAT, p, parties=4, site="site-2")
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"g_sq_sum\[0\] = inf"):
        to_fixed({"events": [1], "g_sum": [1.0], "g_sq_sum": [np.inf], "residual_sum": np.zeros(p),
                  "g_residual_sum": np.zeros(p)}, SCHOENFELD, p, parties=2, site="site-0")


def test_a_site_with_secure_sum_refuses_a_query_in_the_clear():
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from flwr_app import cox_client
    from flwr_app.cox_messages import encode

    fused, _ = resolve({"model.name": "coxph", "cox.secure_sum": True, "data.name": "gbsg",
                        "federation.num_sites": 3, **FAST})
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config=fused)
    message = Message(content=encode({"beta": np.zeros(2)}, {"step": 1}), dst_node_id=1, message_type=SUMS)
    with pytest.raises(ValueError, match=r"cox.secure_sum = true\) sends the site's sums only through the secure") \
            as caught:
        cox_client.sums(message, context)
    assert "\n" not in str(caught.value)
