"""``model.name = "coxph"`` with ``cox.secure_sum``: the sites' sums through SecAgg+ (no noise) give the clear fit,
stratified or pooled on a k-point grid (its risk sums at a public scale, a trial step out of the fixed point's range
halved), the server never receives one site's sums, a drop-out stops the fit naming the site, and what is not
supported is refused in one line. About 5 s in all (each run below is well under a second)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flwr_app.config import ConfigError, parse_run_config
from flwr_app.cox_messages import (
    ARRAYS,
    MEAT,
    OUT_OF_RANGE,
    RISK_SET,
    SCHOENFELD,
    SECURE_MODULUS_BITS,
    SUMS,
    coxph_manifest,
    from_fixed,
    secure_layout,
    secure_limit,
    secure_log_scale,
    to_fixed,
)
from flwr_app.cox_server import CoxSiteError
from simulations.engine import resolve, run_inprocess
from strategies.secure_aggregation import centred

FAST = {"evaluation.server_side": False, "baseline.centralized": False}
RUN = {"model.name": "coxph", "data.name": "gbsg", "federation.num_sites": 3, "cox.robust": True, **FAST}
#: The pooled fit (one baseline) on 20 points of the set-up's public time grid.
POOLED = {**RUN, "cox.strata": "none", "cox.grid": "20"}


def _coxph(directory) -> dict:
    return json.loads((directory / "coxph.json").read_text(encoding="utf-8"))


def test_the_secure_sum_gives_the_clear_fit_and_the_server_never_sees_one_sites_sums(tmp_path):
    clear = run_inprocess({**RUN, "cox.ph_test": "identity", "output.dir": str(tmp_path / "clear")})
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


def test_the_pooled_secure_sum_on_a_k_point_grid_gives_the_clear_pooled_fit_on_that_grid(tmp_path):
    clear = run_inprocess({**POOLED, "output.dir": str(tmp_path / "clear")})
    from tests.test_manifest import sent_keys

    kinds: set[str] = set()
    keys: set[tuple[str, str]] = set()
    masked = []

    def observe(message, reply):
        if not reply.has_error():
            kinds.add(message.metadata.message_type)
            keys.update((message.metadata.message_type, key) for key in sent_keys(reply.content))
            masked.extend([message.metadata.message_type] * (message.metadata.message_type == "query.secagg_masked"))

    secure = run_inprocess({**POOLED, "cox.secure_sum": True, "output.dir": str(tmp_path / "secure")},
                           observe=observe)
    ours, ref = _coxph(tmp_path / "secure"), _coxph(tmp_path / "clear")
    assert secure["coxph"]["strata"] == "none" and secure["coxph"]["grid_points"] == clear["coxph"]["grid_points"] == 20
    assert ours["names"] == ref["names"] and ours["converged"] and ours["steps"] == ref["steps"]
    np.testing.assert_allclose(ours["coef"], ref["coef"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(ours["se"], ref["se"], rtol=1e-6, atol=0)
    assert ours["robust_variance"] is not None and ours["n"] == ref["n"] and ours["events"] == ref["events"]
    assert ours["log_likelihood"] == pytest.approx(ref["log_likelihood"], abs=1e-6)
    assert ours["ph_test"]["p"] == pytest.approx(ref["ph_test"]["p"], rel=1e-6, abs=1e-9)  # km: zero-beta totals
    # no Cox reply and no event time in the clear: moments, every Newton evaluation, meat and PH test summed securely
    assert not {kind for kind in kinds if kind.startswith("query.cox_")}, kinds
    assert len(masked) == 3 * (secure["coxph"]["newton_evaluations"] + 3)
    ledger = [json.loads(line) for line in (tmp_path / "secure" / "ledger.jsonl").read_text().splitlines()]
    assert ledger and all("per cell of the public grid" in entry["assumptions"][0] and "how many sites' risk sums "
                          "were beyond the fixed point's range" in entry["assumptions"][0] for entry in ledger)
    _, cfg = resolve({**POOLED, "cox.secure_sum": True})
    assert cfg.cox.ph_test == "km"
    unlisted = sorted({f"{kind}/{key}" for kind, key in keys if not coxph_manifest(cfg).covers(kind, key)})
    assert not unlisted, unlisted
    reasons = [release.reason for release in coxph_manifest(cfg).releases if release.message == "cox"
               and not release.covered]
    assert reasons and all("only the sum over sites" in reason and "per cell of the public grid" in reason
                           and "a count, not which sites" in reason for reason in reasons)


#: The pooled fit on FLCHAIN (5 sites): Newton's first trial step takes the risk sums of 3 sites beyond the range
#: (about 2e12; the clear fit rejects that step too: a lower log-likelihood); WHAS never leaves it.
@pytest.mark.parametrize("name, out_of_range", [("flchain", [[2, 3]]), ("whas", [])])
def test_the_pooled_secure_fit_scales_the_risk_sums_and_halves_a_step_out_of_range_as_the_clear_fit(
        name, out_of_range, tmp_path):
    overrides = {"model.name": "coxph", "data.name": name, "cox.strata": "none", "cox.grid": "20", **FAST}
    clear = run_inprocess({**overrides, "output.dir": str(tmp_path / "clear")})
    secure = run_inprocess({**overrides, "cox.secure_sum": True, "output.dir": str(tmp_path / "secure")})
    ours, ref = _coxph(tmp_path / "secure"), _coxph(tmp_path / "clear")
    assert ours["converged"] and ours["steps"] == ref["steps"]
    assert secure["coxph"]["newton_evaluations"] == clear["coxph"]["newton_evaluations"]
    np.testing.assert_allclose(ours["coef"], ref["coef"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(ours["se"], ref["se"], rtol=1e-6, atol=0)
    assert ours["log_likelihood"] == pytest.approx(ref["log_likelihood"], abs=1e-6)
    assert secure["coxph"]["out_of_range"] == out_of_range and "out_of_range" not in clear["coxph"]
    newton = [json.loads(line) for line in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["phase"] == "newton"]
    assert [[line["round"], line["out_of_range_sites"]] for line in newton if "out_of_range_sites" in line] \
        == out_of_range
    assert all(line["log_likelihood"] is None for line in newton if "out_of_range_sites" in line)


def test_a_value_beyond_the_fixed_points_range_stops_the_run_naming_the_site_and_the_key(tmp_path, monkeypatch):
    """On the bundled data every value fits (the PH test's times are scaled, the risk sums pooled at a public scale);
    a range shrunk to 100 makes a site's record count (about 600) the value that could wrap."""
    from flwr_app import cox_messages

    monkeypatch.setattr(cox_messages, "secure_limit", lambda parties: 100.0)
    with pytest.raises(CoxSiteError, match=r"site 'site-0' would send n\[0\] = .*set cox.secure_sum = false") as caught:
        run_inprocess({**RUN, "cox.robust": False, "cox.secure_sum": True, "output.dir": str(tmp_path)})
    assert "\n" not in str(caught.value)


def test_a_site_dropping_out_of_a_newton_steps_secure_sum_stops_the_fit_naming_it(tmp_path):
    with pytest.raises(CoxSiteError) as caught:
        run_inprocess({**RUN, "cox.robust": False, "cox.ph_test": "none", "cox.secure_sum": True,
                       "debug.fail_site": "site-1", "debug.fail_message": "cox", "debug.fail_round": 2,
                       "output.dir": str(tmp_path)})
    text = str(caught.value)
    assert "\n" not in text and "Newton step 2" in text and "site 'site-1'" in text and "secagg_masked" in text


@pytest.mark.parametrize("overrides, message", [
    ({"cox.strata": "none"}, r"cox.grid = 'events' is refused: .*union of every site's event times.*set cox.grid = "
                             r"k .*or cox.secure_sum = false"),
    ({"cox.strata": "none", "cox.grid": "events"}, r"cox.secure_sum = true with cox.strata = 'none' and cox.grid = "
                                                   r"'events' is refused"),
    ({"cox.ph_test": "rank"}, r"cox.ph_test = 'rank' needs each site's number of events .* cox.secure_sum = true"),
])
def test_what_the_secure_sum_does_not_support_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_run_config({"model.name": "coxph", "cox.secure_sum": True, **overrides})
    assert "\n" not in str(caught.value)


def test_auto_ph_test_is_identity_with_the_secure_sum_and_the_manifest_says_what_the_server_sees():
    _, cfg = resolve({"model.name": "coxph", "cox.secure_sum": True, "cox.robust": True})
    assert cfg.cox.ph_test == "identity"
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


def test_the_pooled_layout_sends_each_cells_upper_triangles_and_round_trips():
    p, m = 3, 4
    rng = np.random.default_rng(1)
    a = rng.normal(size=(m, p, p))
    arrays = {"n": np.array([500]), "events": np.array([3, 0, 5, 1]), "event_weight": rng.random(m) * 5,
              "event_x": rng.normal(size=(m, p)), "event_risk": rng.random(m), "event_risk_x": rng.normal(size=(m, p)),
              "event_risk_xx": a @ np.swapaxes(a, 1, 2), "risk": rng.random(m) * 100,
              "risk_x": rng.normal(size=(m, p)) * 10, "risk_xx": a @ np.swapaxes(a, 1, 2) * 100}
    layout = secure_layout(SUMS, p, m)
    assert [name for name, _, _ in layout] == ["n", *RISK_SET, OUT_OF_RANGE]
    assert sum(length for _, _, length in layout) == 2 + 4 * m + 3 * m * p + 2 * m * p * (p + 1) // 2
    fixed = to_fixed(arrays, SUMS, p, parties=3, site="site-0", m=m)
    found = from_fixed(centred(fixed, 2 ** SECURE_MODULUS_BITS).astype(np.float64), SUMS, p, m)
    for name, value in arrays.items():
        assert found[name].shape == value.shape and np.max(np.abs(found[name] - value)) <= 2.0 ** -32
    assert found["events"].dtype == np.int64 and found["events"].tolist() == [3, 0, 5, 1]
    assert found[OUT_OF_RANGE].tolist() == [0]
    with pytest.raises(ValueError, match=r"'risk_xx' has shape \(4, 3\), not \(4, 3, 3\)"):
        to_fixed({**arrays, "risk_xx": np.zeros((m, p))}, SUMS, p, parties=3, site="site-0", m=m)


def test_a_trial_beta_beyond_the_range_is_scaled_into_it_or_sent_as_an_out_of_range_count_only():
    from models import cox

    rng = np.random.default_rng(2)
    n, p, parties = 400, 3, 3
    x = rng.normal(size=(n, p))
    x[:, 0] = 5.0 + 0.3 * x[:, 0]  # far from 0 in every record (as a level most records have)
    time, event = rng.exponential(size=n), rng.random(n) < 0.6
    grid = np.quantile(time[event], np.linspace(0.05, 1, 8))
    halves = [(x[:200], time[:200], event[:200]), (x[200:], time[200:], event[200:])]
    beta = np.array([4.0, 0.3, -0.2])  # exp(x'beta) about exp(20): risk sums up to 1e12, far beyond 2^29 / 3
    clear = [cox.site_risk_set_sums(*half, beta, grid) for half in halves]
    limit = secure_limit(parties)
    assert clear[0].risk_xx.max() > 1e3 * limit

    def secure_sum(parts):  # the sites' vectors summed modulo 2^62, decoded
        vectors = [to_fixed({"n": [part.n], **{name: getattr(part, name) for name in RISK_SET}}, SUMS, p,
                            parties=parties, site=f"site-{i}", m=grid.size) for i, part in enumerate(parts)]
        total = np.mod(np.sum(vectors, axis=0), 2 ** SECURE_MODULUS_BITS)
        return from_fixed(centred(total, 2 ** SECURE_MODULUS_BITS).astype(np.float64), SUMS, p, grid.size)

    # unscaled: both sites are out of range and send random numbers: the server learns 2, not their n
    found = secure_sum(clear)
    assert found[OUT_OF_RANGE].tolist() == [2] and found["n"][0] != 400
    # at the public scale of the pooled bound (2^-16 of the range, per cell), both sites are in range, and the fit's
    # terms are the clear ones
    total = clear[0] + clear[1]
    c = secure_log_scale(total.risk_bound(), parties)
    scaled = [cox.site_risk_set_sums(*half, beta, grid, log_scale=c) for half in halves]
    assert max(part.risk_xx.max() for part in scaled) <= limit / 2 ** 16
    found = secure_sum(scaled)
    assert found[OUT_OF_RANGE].tolist() == [0]
    summed = cox.RiskSetSums(grid, int(found["n"][0]), **{name: found[name] for name in RISK_SET}).rescaled(c)
    for ours, ref in zip(cox.pooled_newton_terms(summed, beta), cox.pooled_newton_terms(total, beta)):
        np.testing.assert_allclose(ours, ref, rtol=1e-9)  # the information cancels x0^2 = 25 to its variance 0.09
    # a value that no step changes (an event count or covariate sum) beyond the range still stops the run
    with pytest.raises(ValueError, match=r"site 'site-0' would send event_x\[0\] = 1e\+09"):
        to_fixed({"n": [200], **{name: getattr(scaled[0], name) for name in RISK_SET},
                  "event_x": np.full((grid.size, p), 1e9)}, SUMS, p, parties=parties, site="site-0", m=grid.size)


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
