"""distributed_dp: SecAgg+ on the Message API, the discrete Gaussian, the accountant, and whole runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from simulations.engine import resolve, run_inprocess
from strategies import secure_aggregation as secagg
from strategies.accounting.distributed_dp import ddg_epsilon, ddg_rdp, ddg_rho, ddg_tau, l1_bound
from strategies.accounting.rdp import DEFAULT_RDP_ORDERS
from strategies.config import ConfigError
from strategies.horizontal import MAX_REFUSED_SUMS, TooFewSitesError
from strategies.mechanisms.discrete_gaussian import discrete_gaussian_moments, sample_discrete_gaussian
from strategies.mechanisms.distributed_dp import DistributedDP, round_plan

# ---------------------------------------------------------------------------------------------- the protocol


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages built outside a run need the identity the in-process runner sets."""
    from flwr.supercore.task_identity import TaskIdentity

    from simulations.engine import SUPERLINK_NODE_ID, new_run_id

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, new_run_id(), SUPERLINK_NODE_ID


class SiteGrid:
    """A grid whose nodes run the site-side stage functions directly; ``drop`` = {node: stage it vanishes at}."""

    def __init__(self, vectors: dict[int, np.ndarray], drop: dict[int, str] | None = None) -> None:
        self.vectors, self.drop = vectors, drop or {}
        self.states: dict[int, secagg.SiteState] = {}
        self.masked: dict[int, np.ndarray] = {}

    def get_node_ids(self):
        return sorted(self.vectors)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node, stage = message.metadata.dst_node_id, message.metadata.message_type
            if self.drop.get(node) == stage:
                continue
            record = message.content[secagg.RECORD]
            if stage == secagg.SETUP:
                self.states[node], values = secagg.site_setup(node, record)
            elif stage == secagg.SHARE_KEYS:
                values = secagg.site_share_keys(self.states[node], {int(n): tuple(v) for n, v in record.items()})
            elif stage == secagg.MASKED:
                self.masked[node], disputed = secagg.site_mask(self.states[node], record["sources"],
                                                               record["ciphertexts"], self.vectors[node])
                content = RecordDict({secagg.MASKED_ARRAY: secagg.masked_reply(self.masked[node]),
                                      secagg.RECORD: ConfigRecord({"disputed": disputed})})
                replies.append(Message(content=content, reply_to=message))
                continue
            else:
                values = secagg.site_unmask(self.states[node], record["survivors"], record["dropped"])
            replies.append(Message(content=RecordDict({secagg.RECORD: ConfigRecord(values)}), reply_to=message))
        return replies


def _secure_sum(vectors, *, drop=None, max_dropouts=1, modulus=2 ** 40, min_included=1):
    num_shares, threshold = secagg.protocol_parameters(len(vectors), max_dropouts=max_dropouts, colluding=0)
    grid = SiteGrid(vectors, drop)
    secure = secagg.SecureSum(modulus=modulus, num_shares=num_shares, threshold=threshold,
                              dimension=len(next(iter(vectors.values()))), timeout=10.0, shuffle_seed=3)
    result = secure.run(grid, sorted(vectors), setup={}, masked_content=lambda node: RecordDict(), group="1",
                        min_included=min_included)
    return result, grid


def _vectors(sites: int, dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {node: rng.integers(-10 ** 9, 10 ** 9, size=dim, dtype=np.int64) for node in range(1, sites + 1)}


@pytest.mark.parametrize("sites", [3, 9])
def test_the_unmasked_sum_is_the_plain_integer_sum(sites):
    vectors = _vectors(sites, 500)
    result, _ = _secure_sum(vectors)
    assert not result.failures and result.included == sorted(vectors)
    assert np.array_equal(secagg.centred(result.total, 2 ** 40), sum(vectors.values()))


@pytest.mark.parametrize("stage", [secagg.MASKED, secagg.UNMASK])
def test_a_site_that_drops_out_is_handled_the_secagg_plus_way(stage):
    vectors = _vectors(9, 300, seed=1)
    result, _ = _secure_sum(vectors, drop={4: stage})
    expected = sum(v for node, v in vectors.items() if node != 4 or stage == secagg.UNMASK)
    assert [f[1] for f in result.failures] == [4]
    assert np.array_equal(secagg.centred(result.total, 2 ** 40), expected)


def test_more_drop_outs_than_tolerated_are_not_unmasked():
    vectors = _vectors(5, 50, seed=2)
    result, _ = _secure_sum(vectors, drop={2: secagg.MASKED, 3: secagg.MASKED}, min_included=4)
    assert result.total is None and "more drop-outs than tolerated" in result.shortfall


def test_a_masked_vector_alone_carries_nothing_about_the_site_vector():
    dim, modulus = 200_000, 2 ** 40
    vectors = _vectors(3, dim, seed=4)
    vectors[1] = np.arange(dim, dtype=np.int64) * 1000  # a strongly structured update
    result, grid = _secure_sum(vectors, modulus=modulus)
    masked = grid.masked[1].astype(np.float64)
    assert abs(np.corrcoef(masked, vectors[1].astype(np.float64))[0, 1]) < 0.01
    counts = np.histogram(masked / modulus, bins=20, range=(0.0, 1.0))[0]  # uniform mod M: chi-square, 19 df
    expected = dim / 20
    assert ((counts - expected) ** 2 / expected).sum() < 60.0
    assert np.array_equal(secagg.centred(result.total, modulus), sum(vectors.values()))


def test_protocol_parameters_need_an_honest_survivor():
    assert secagg.protocol_parameters(40, max_dropouts=1, colluding=0) == (5, 4)
    assert secagg.protocol_parameters(3, max_dropouts=1, colluding=0) == (3, 2)
    with pytest.raises(ValueError, match="k - D - t"):
        secagg.protocol_parameters(3, max_dropouts=2, colluding=1)


# ---------------------------------------------------------------------------------------------- the noise


@pytest.mark.parametrize("sigma2", [0.3, 2.0, 50.0, 4.0e6])
def test_the_discrete_gaussian_has_the_exact_mean_and_variance(sigma2):
    draws = sample_discrete_gaussian(np.random.default_rng(7), sigma2, 200_000).astype(np.float64)
    mean, variance = discrete_gaussian_moments(sigma2)
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert variance < sigma2 + 1e-9  # the discrete Gaussian's variance is below sigma^2
    standard_error = math.sqrt(variance / draws.size)
    assert abs(draws.mean() - mean) < 5 * standard_error
    assert abs(draws.var() - variance) < 5 * variance * math.sqrt(2.0 / draws.size) + 1e-9
    assert np.all(draws == np.round(draws))


# ---------------------------------------------------------------------------------------------- the accountant


def _dp_accounting_epsilon(event, count, delta=1e-5):
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_RDP_ORDERS))
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("local_sigma", "parties", "rounds"), [(2.0e6, 4, 20), (40.0, 3, 5), (0.8, 5, 3)])
def test_epsilon_equals_dp_accountings_for_the_mechanism_on_the_union(local_sigma, parties, rounds):
    import dp_accounting

    l2, dim = 3.0 * local_sigma, 1000
    l1 = l1_bound(l2, dim)
    rho = ddg_rho(l2_sensitivity=l2, l1_sensitivity=l1, local_sigma=local_sigma, num_parties=parties, dim=dim)
    ours = ddg_epsilon(releases=[(l2, l1, local_sigma, parties, dim)] * rounds, delta=1e-5)
    theirs = _dp_accounting_epsilon(dp_accounting.dp_event.ZCDpEvent(rho), rounds)
    # Prop. 14's first branch can only lower the RDP curve below the zCDP branches
    assert ours <= theirs * (1 + 1e-9)
    if ddg_tau(local_sigma, parties) * dim < 1e-12:  # tau -> 0: exactly the Gaussian mechanism on the union
        assert ours == pytest.approx(theirs, rel=1e-9)
        gaussian = dp_accounting.dp_event.GaussianDpEvent(math.sqrt(parties) * local_sigma / l2)
        assert ours == pytest.approx(_dp_accounting_epsilon(gaussian, rounds), rel=1e-9)
        assert rho == pytest.approx(l2 ** 2 / (2 * parties * local_sigma ** 2), rel=1e-12)


def test_the_rdp_is_the_minimum_of_the_three_branches_and_tau_follows_the_paper():
    s, n, d, l2 = 0.7, 4, 50, 2.0
    tau = 10 * sum(math.exp(-2 * math.pi ** 2 * s ** 2 * k / (k + 1)) for k in range(1, n))
    assert ddg_tau(s, n) == pytest.approx(tau, rel=1e-15)
    a, l1 = np.array([2.0, 8.0, 32.0]), l1_bound(l2, d)
    x, y = l2 / (math.sqrt(n) * s), l1 / (math.sqrt(n) * s)
    branches = np.stack([a / 2 * x ** 2 + tau * d, a / 2 * (x ** 2 + 2 * y * tau + tau ** 2 * d),
                         a / 2 * (x + math.sqrt(d) * tau) ** 2])
    assert np.allclose(ddg_rdp(a, l2_sensitivity=l2, l1_sensitivity=l1, local_sigma=s, num_parties=n, dim=d),
                       branches.min(0), rtol=1e-14)


def test_the_plan_keeps_the_wrap_around_bound_and_meets_epsilon():
    plan = round_plan(epsilon=1.0, delta=1e-5, rounds=20, parties=5, max_dropouts=1, colluding=0, records=6000.0,
                      dim=17_000, modulus_bits=48, clip=1.0)
    assert plan.honest == 4 and plan.local_sigma == pytest.approx(plan.noise_multiplier * plan.l2 / 2)
    assert plan.coordinate_bound < 2 ** 47
    assert plan.l2 == pytest.approx(plan.gamma + math.sqrt(17_000) / 2)
    spent = ddg_epsilon(releases=[(plan.l2, plan.l1, plan.local_sigma, plan.honest, plan.dim)] * 20, delta=1e-5)
    assert 0.999 < spent <= 1.0


@pytest.mark.parametrize("risk_layer", ["interval", "proportional"])
def test_one_records_rounded_contribution_is_within_the_quantisation_bound(risk_layer):
    from strategies.mechanisms.distributed_dp_training import rounded_gradient_sum
    from models.survival import build_survival_model

    rng = np.random.default_rng(0)
    model = build_survival_model("hazard_mlp", in_features=6, cuts=np.linspace(0.0, 10.0, 8), hidden=(16, 8),
                                 dropout=0.0, activation="relu", penalty=0.0, time_scale=(5.0, 2.0),
                                 risk_layer=risk_layer)
    x, time, event = rng.normal(size=(40, 6)) * 5, rng.uniform(0.1, 10.0, 40), rng.integers(0, 2, 40)
    dim = sum(p.numel() for p in model.net.parameters())
    gamma, clip = 1e4, 0.5
    for i in range(3):
        one = rounded_gradient_sum(model, x[i:i + 1], time[i:i + 1], event[i:i + 1], clip_norm=clip, gamma=gamma,
                                   seed=0)
        assert np.linalg.norm(one) <= gamma * clip + math.sqrt(dim) / 2
    total = rounded_gradient_sum(model, x, time, event, clip_norm=clip, gamma=gamma, seed=0)
    exact = sum(rounded_gradient_sum(model, x[i:i + 1], time[i:i + 1], event[i:i + 1], clip_norm=clip, gamma=gamma,
                                     seed=0) for i in range(40))
    # rounded record by record, then summed: equal up to the float32 rounding of the batched pass (MKL's AVX-512
    # kernels may round a product of the 40-record batch differently from the one-record pass: +-1, in rare entries),
    # where rounding the sum instead would move entries by up to 40 x 0.5
    assert np.abs(total - exact).max() <= 1 and np.count_nonzero(total - exact) <= 0.01 * dim


# ---------------------------------------------------------------------------------------------- whole runs

RUN = {"strategy.name": "distributed_dp", "privacy.epsilon": 1.0, "data.name": "flchain", "federation.rounds": 2,
       "federation.num_sites": 4, "baseline.centralized": False}


def test_a_run_finishes_and_the_server_sum_is_the_sites_noisy_sum(tmp_path, monkeypatch):
    sums, contributions = [], []
    run_secure = secagg.SecureSum.run
    contribution = DistributedDP.contribution

    def recorded_run(self, *args, **kwargs):
        result = run_secure(self, *args, **kwargs)
        sums.append(secagg.centred(result.total, self.modulus))
        return result

    def recorded_contribution(self, *args, **kwargs):
        vector = contribution(self, *args, **kwargs)
        contributions.append(vector)
        return vector

    def recorded_recalibration(self, *args, **kwargs):
        vector = recalibration(self, *args, **kwargs)
        recalibrations.append(vector)
        return vector

    recalibration, recalibrations = DistributedDP.recalibration_contribution, []
    monkeypatch.setattr(secagg.SecureSum, "run", recorded_run)
    monkeypatch.setattr(DistributedDP, "contribution", recorded_contribution)
    monkeypatch.setattr(DistributedDP, "recalibration_contribution", recorded_recalibration)
    summary = run_inprocess({**RUN, "output.dir": str(tmp_path / "out")})
    # two training rounds, then the recalibration sums (a hazard model under a private set-up)
    assert len(sums) == 3 and len(contributions) == 8 and len(recalibrations) == 4
    assert np.array_equal(sums[0], sum(contributions[:4])) and np.array_equal(sums[1], sum(contributions[4:]))
    assert np.array_equal(sums[2], sum(recalibrations))
    assert 0.5 < summary["test"]["c_index"] <= 1.0
    assert summary["privacy"]["epsilon"] == pytest.approx(1.0, abs=1e-3)
    ledger = [json.loads(line) for line in (tmp_path / "out" / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 8 and {e["mechanism"] for e in ledger} == {"distributed_dp"}
    last = ledger[-1]
    assert last["steps"] == 2 and last["sample_rate"] == 1.0 and last["adjacency"] == "add-remove"
    text = " ".join(last["assumptions"])
    for phrase in ("on the union", "noise split", "D = 1", "t = 0", "honest-but-curious", "SecAgg+",
                   "quantisation bound", "wrap-around", "cannot attribute",
                   f"{MAX_REFUSED_SUMS} consecutive refusals stop the run"):
        assert phrase in text, phrase


@pytest.mark.parametrize("mode", ["wrong_shape", "nan_weights", "raise"])
def test_a_hostile_or_failing_site_is_a_named_drop_out(tmp_path, mode):
    summary = run_inprocess({**RUN, "federation.rounds": 1, "debug.fail_site": "site-1", "debug.fail_mode": mode,
                             "output.dir": str(tmp_path / "out")})
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    failures = lines[-1]["failures"]
    assert [(f["site"], f["phase"]) for f in failures] == [("site-1", "secagg_masked")]
    assert "not_aggregated" not in lines[-1] and summary["test"]["c_index"] > 0.5


def test_more_drop_outs_than_tolerated_stop_the_round_and_keep_its_spend(tmp_path):
    with pytest.raises(TooFewSitesError, match="more drop-outs than tolerated"):
        run_inprocess({**RUN, "federation.rounds": 1, "privacy.max_dropouts": 0, "debug.fail_site": "site-1",
                       "output.dir": str(tmp_path / "out")})
    ledger = [json.loads(line) for line in (tmp_path / "out" / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 4 and all(entry["epsilon"] > 0 for entry in ledger)


def test_configs_without_an_honest_survivor_are_refused():
    with pytest.raises(ConfigError, match="privacy.max_dropouts.*privacy.colluding_sites"):
        resolve({**RUN, "federation.num_sites": 3, "privacy.max_dropouts": 2, "privacy.colluding_sites": 1})
    with pytest.raises(ConfigError, match="hazard_mlp"):
        resolve({**RUN, "model.name": "cox_mlp"})



# ---------------------------------------------------------------------------------------------- the sum check


def _small_plan(parties=4, records=400.0, dim=60):
    return round_plan(epsilon=1.0, delta=1e-5, rounds=3, parties=parties, max_dropouts=1, colluding=0,
                      records=records, dim=dim, modulus_bits=48, clip=1.0)


def _honest_sum(plan, rng, sizes, *, aligned):
    """The integer sum of honest sites: each record's gradient at the clip norm, all in one direction (the worst
    case) or in random ones, scaled, rounded, summed, plus each site's N_Z(0, s^2) noise."""
    direction = rng.normal(size=plan.dim)
    total = np.zeros(plan.dim, dtype=np.int64)
    for n in sizes:
        g = np.tile(direction, (n, 1)) if aligned else rng.normal(size=(n, plan.dim))
        g *= plan.gamma / np.linalg.norm(g, axis=1, keepdims=True)  # gamma * C, C = 1
        total += np.round(g).astype(np.int64).sum(0)
        total += sample_discrete_gaussian(rng, plan.local_sigma ** 2, plan.dim)
    return total


@pytest.mark.parametrize("aligned", [True, False])
def test_honest_sums_are_never_refused(aligned):
    """Honest rounds (worst-case aligned gradients and random ones; 1 to 4 included sites) stay within the bound."""
    plan = _small_plan()
    mechanism = DistributedDP()
    arrays = {"w": np.zeros(plan.dim, dtype=np.float32)}
    rng = np.random.default_rng(11)
    for trial in range(300):
        sites = 1 + trial % 4
        sizes = [100] * sites
        total = _honest_sum(plan, rng, sizes, aligned=aligned)
        new, _, reason = mechanism.server_step(arrays, total, plan, count=float(sum(sizes)), lr=0.01, state=None,
                                               sites=sites)
        assert reason == "" and new is not None, (trial, reason)
        bound = plan.sum_bound(records=float(sum(sizes)), sites=sites)
        assert np.linalg.norm(total) <= bound.norm and np.abs(total).max() <= bound.coordinate


def test_the_bound_is_records_times_delta_plus_the_noise_tail():
    plan = _small_plan()
    bound = plan.sum_bound(records=300.0, sites=3)
    assert bound.records == pytest.approx(301.5)  # exact counts: the agreed count plus half a record per site
    assert bound.data == pytest.approx(301.5 * plan.l2)
    x = math.log(3 / 1e-9)
    noise = math.sqrt(3) * plan.local_sigma * math.sqrt(plan.dim + 2 * math.sqrt(plan.dim * x) + 2 * x)
    assert bound.noise == pytest.approx(noise) and bound.norm == pytest.approx(bound.data + noise)
    # a noisy set-up count widens it by the count's Gaussian tail, and it is far below the wrap-around bound
    noisy = plan.sum_bound(records=300.0, sites=3, count_std=20.0)
    assert noisy.records == pytest.approx(301.5 + 20.0 * math.sqrt(3) * math.sqrt(2 * x))
    assert noisy.norm < plan.norm_bound


@pytest.mark.parametrize("scale", [1e3, -1e3, 50.0])
def test_a_contribution_scaled_beyond_the_honest_bound_is_refused_and_names_no_site(scale):
    plan = _small_plan()
    rng = np.random.default_rng(5)
    honest = _honest_sum(plan, rng, [100] * 3, aligned=True)
    hostile = _honest_sum(plan, rng, [100], aligned=True)
    total = honest + np.round(hostile * scale).astype(np.int64)
    new, state, reason = DistributedDP().server_step({"w": np.zeros(plan.dim, np.float32)}, total, plan,
                                                     count=400.0, lr=0.01, state=None, sites=4)
    assert new is None and state == {}
    assert "beyond what honest sites can produce" in reason and "cannot say whose contribution" in reason
    assert "site-" not in reason


def test_a_scaled_contribution_within_the_honest_worst_case_passes_the_check():
    """The limit of a check on the sum alone: x -5 of one of four sites whose gradients all point one way gives a
    sum of -2 sites' worth, which honest sites can produce; it is not refused (docs/privacy.md says so)."""
    plan = _small_plan()
    rng = np.random.default_rng(6)
    sites = [_honest_sum(plan, rng, [100], aligned=True) for _ in range(4)]
    direction = sites[0] / np.linalg.norm(sites[0])
    sites = [np.round(direction * np.linalg.norm(s)).astype(np.int64) for s in sites]  # one direction
    total = sites[0] + sites[1] + sites[2] - 5 * sites[3]
    _, _, reason = DistributedDP().server_step({"w": np.zeros(plan.dim, np.float32)}, total, plan, count=400.0,
                                               lr=0.01, state=None, sites=4)
    assert reason == ""


def test_a_wrapped_sum_is_judged_on_its_centred_value():
    """Whatever a vector wrapped to mod M, the check bounds the centred sum, the integers the step divides: a sum
    pushed across the modulus reads as a large centred value and is refused."""
    plan = _small_plan()
    honest = _honest_sum(plan, np.random.default_rng(8), [100] * 4, aligned=False)
    for shift in (plan.modulus // 2, plan.modulus // 4, 3 * plan.modulus // 4):
        wrapped = secagg.centred(np.mod(honest + shift, plan.modulus), plan.modulus)
        _, _, reason = DistributedDP().server_step({"w": np.zeros(plan.dim, np.float32)}, wrapped, plan,
                                                   count=400.0, lr=0.01, state=None, sites=4)
        assert "beyond what honest sites can produce" in reason, shift


def _hostile_vectors(monkeypatch, mode):
    """site-1 (``task.round_seed(seed, round, 1)``) sends, through the real ClientApp: its contribution x 1e3 before
    masking (``scale``), an all-zero masked vector (``zero``), its masked vector reduced mod M/2
    (``wrong_modulus``), or its previous round's masked vector (``replayed``, from round 2 on)."""
    import threading

    from flwr_app import task

    local, previous = threading.local(), {}
    contribution, site_mask = DistributedDP.contribution, secagg.site_mask

    def hostile_contribution(self, model, data, cfg, plan, *, seed):
        vector = contribution(self, model, data, cfg, plan, seed=seed)
        local.hostile = any(seed == task.round_seed(cfg.seed, r, 1) for r in range(1, cfg.federation.rounds + 1))
        return vector * 1000 if local.hostile and mode == "scale" else vector

    def hostile_mask(state, sources, ciphertexts, vector):
        masked, disputed = site_mask(state, sources, ciphertexts, vector)
        if not getattr(local, "hostile", False):
            return masked, disputed
        if mode == "zero":
            return np.zeros_like(masked), disputed
        if mode == "wrong_modulus":
            return np.mod(masked, state.modulus // 2), disputed
        if mode == "replayed":
            masked, previous["masked"] = previous.get("masked", masked), masked
        return masked, disputed

    def honest_recalibration(self, terms, plan, *, rng):  # these tests are about the training sums: every site
        local.hostile = False                            # sends its recalibration sums honestly (their own test:
        return recalibration(self, terms, plan, rng=rng)  # tests/test_distributed_recalibration.py)

    recalibration = DistributedDP.recalibration_contribution
    monkeypatch.setattr(DistributedDP, "contribution", hostile_contribution)
    monkeypatch.setattr(DistributedDP, "recalibration_contribution", honest_recalibration)
    monkeypatch.setattr(secagg, "site_mask", hostile_mask)


@pytest.mark.parametrize("mode", ["poisoned_update", "scale", "zero", "wrong_modulus", "replayed"])
def test_a_sum_outside_the_protocol_is_refused_unattributed_and_the_run_goes_on(tmp_path, monkeypatch, mode):
    steps = []
    server_step = DistributedDP.server_step

    def recorded(self, *args, **kwargs):
        new, state, reason = server_step(self, *args, **kwargs)
        steps.append(reason)
        return new, state, reason

    monkeypatch.setattr(DistributedDP, "server_step", recorded)
    overrides = {"debug.fail_site": "site-1", "debug.fail_mode": "poisoned_update"}
    if mode != "poisoned_update":  # poisoned_update: the masked vector x -10 mod M (flwr_app.faults)
        _hostile_vectors(monkeypatch, mode)
        overrides = {}
    summary = run_inprocess({**RUN, **overrides, "output.dir": str(tmp_path / "out")})
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    refused = [1, 2] if mode != "replayed" else [2]  # a replay needs a previous round
    assert [bool(reason) for reason in steps] == [r in refused for r in (1, 2)]
    for line in lines:
        failures = [(f["phase"], f["site"]) for f in line["failures"]]
        assert failures == ([("secagg_sum", "unattributable")] if line["round"] in refused else []), failures
        assert "not_aggregated" not in line
        if failures:
            reason = line["failures"][0]["reason"]
            for words in ("stage: the sum check", "cannot say whose contribution", "drop-outs and failures before "
                          "it: none", "1 consecutive refused round" if line["round"] == refused[0] else "2 consec"):
                assert words in reason, words
    assert summary["test"]["c_index"] > 0.3
    # the spend of a refused round counts: every site was asked for its vector in both rounds
    ledger = [json.loads(line) for line in (tmp_path / "out" / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 8 and ledger[-1]["steps"] == 2
    assert summary["privacy"]["epsilon"] == pytest.approx(1.0, abs=1e-3)


def test_a_sum_refused_in_three_consecutive_rounds_stops_the_run_with_a_named_error(tmp_path):
    with pytest.raises(TooFewSitesError, match="refused in 3 consecutive rounds.*cannot say which"):
        run_inprocess({**RUN, "federation.rounds": 3, "debug.fail_site": "site-1", "debug.fail_mode": "poisoned_update",
                       "output.dir": str(tmp_path / "out")})
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3] and "not_aggregated" in lines[-1]


def test_a_refused_sum_names_the_drop_outs_before_it(tmp_path, monkeypatch):
    """site-2 fails (a named drop-out at the masked-vector stage); site-1's all-zero masked vector spoils the sum
    of the others, which is refused naming no site but listing site-2's drop-out."""
    _hostile_vectors(monkeypatch, "zero")
    run_inprocess({**RUN, "federation.rounds": 1, "debug.fail_site": "site-2", "output.dir": str(tmp_path / "out")})
    line = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert [(f["phase"], f["site"]) for f in line["failures"]] == [("secagg_masked", "site-2"),
                                                                   ("secagg_sum", "unattributable")]
    reason = line["failures"][1]["reason"]
    assert "unmasked sum of 3 sites" in reason and "site-2 (secagg_masked)" in reason
    assert "Sites in the sum: site-0, site-1, site-3" in reason
