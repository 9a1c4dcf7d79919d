"""SecAgg+ against a server that names different survivors to different sites (strategies.secure_aggregation).

The attack is played with the module's own site functions on a complete neighbour graph: the server tells the
holders in ``told_dropped`` that the target dropped and the others that it survived, so it collects shares of
the target's mask seed from the ones and of its first secret key from the others, and tries to unmask the
target's masked vector.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from simulations.engine import resolve
from strategies import secure_aggregation as secagg
from strategies.config import ConfigError
from tests.test_distributed_dp import RUN, _secure_sum, _task_identity, _vectors  # noqa: F401  (autouse fixture)

MODULUS = 2 ** 40
TARGET = 1


def _stages_0_to_2(vectors, num_shares, threshold, colluding=0):
    """Stages 0-2 among all of ``vectors``' sites (every site every site's neighbour): states, keys, masked vectors."""
    config = {"modulus": MODULUS, "num_shares": num_shares, "threshold": threshold}
    states, keys = {}, {}
    for node in sorted(vectors):
        states[node], sent = secagg.site_setup(node, config, colluding=colluding)
        keys[node] = (sent["pk1"], sent["pk2"])
    inbox = {node: [] for node in vectors}
    for node in sorted(vectors):
        out = secagg.site_share_keys(states[node], keys)
        for destination, ciphertext in zip(out["destinations"], out["ciphertexts"], strict=True):
            inbox[destination].append((node, ciphertext))
    masked = {}
    for node, vector in sorted(vectors.items()):
        masked[node], disputed = secagg.site_mask(states[node], [s for s, _ in inbox[node]],
                                                  [c for _, c in inbox[node]], vector)
        assert disputed == []
    return states, keys, masked


def _lie(states, told_dropped, colluders=()):
    """Stage 3 by a lying server: the target's seed shares and first-key shares it collects (a colluder hands over
    both of its shares; every honest site answers once, as told)."""
    seed_shares, key_shares = [], []
    everyone = sorted(states)
    for node, state in sorted(states.items()):
        if node in colluders:
            seed_shares.append(state.seed_shares[TARGET])
            key_shares.append(state.sk1_shares[TARGET])
            continue
        lied = node in told_dropped
        reply = secagg.site_unmask(state, [n for n in everyone if not lied or n != TARGET], [TARGET] if lied else [])
        for owner, share in zip(reply["nodes"], reply["shares"], strict=True):
            if owner == TARGET:
                (key_shares if lied else seed_shares).append(share)
    return seed_shares, key_shares


def _unmask_target(seed_shares, key_shares, keys, masked):
    """The target's vector from its masked vector, its seed and its first secret key; None when the shares do not
    give both (a wrong first key never passes :func:`secagg.secret_key`'s check against the public key)."""
    try:
        seed = secagg.combine_shares(seed_shares)
        key = secagg.secret_key(secagg.combine_shares(key_shares), keys[TARGET][0])
        vector = masked[TARGET] - secagg.mask_stream(secagg.self_mask_key(seed), modulus=MODULUS,
                                                     dimension=masked[TARGET].size)
    except ValueError:
        return None
    for other in sorted(keys):
        if other != TARGET:
            mask = secagg.mask_stream(secagg.pairwise_mask_key(key, keys[other][0], (TARGET, other)), modulus=MODULUS,
                                      dimension=vector.size)
            vector = vector - mask if TARGET > other else vector + mask
    return secagg.centred(vector, MODULUS)


# (sites, max_dropouts, colluding, the Shamir parameters protocol_parameters gave before the refusal, the colluder)
REFUSED = [(4, 2, 0, (4, 2), ()), (5, 2, 1, (5, 3), (5,))]


@pytest.mark.parametrize(("sites", "dropouts", "colluding", "parameters", "colluders"), REFUSED)
def test_with_the_refusal_bypassed_a_lying_server_reads_the_targets_exact_vector(
        monkeypatch, sites, dropouts, colluding, parameters, colluders):
    monkeypatch.setattr(secagg, "_refuse_survivor_lies", lambda *args: None)
    vectors = _vectors(sites, 64, seed=sites)
    states, keys, masked = _stages_0_to_2(vectors, *parameters, colluding=colluding)
    seed_shares, key_shares = _lie(states, told_dropped={3, 4}, colluders=colluders)
    assert not np.array_equal(secagg.centred(masked[TARGET], MODULUS), vectors[TARGET])
    assert np.array_equal(_unmask_target(seed_shares, key_shares, keys, masked), vectors[TARGET])


@pytest.mark.parametrize(("sites", "dropouts", "colluding", "parameters", "colluders"), REFUSED)
def test_those_parameters_are_refused_by_the_server_and_by_every_site_before_any_key_or_share(
        sites, dropouts, colluding, parameters, colluders):
    with pytest.raises(ConfigError, match=rf"privacy.max_dropouts = {dropouts} is too many.*privacy.max_dropouts <="):
        secagg.protocol_parameters(sites, max_dropouts=dropouts, colluding=colluding)
    num_shares, threshold = parameters
    config = {"modulus": MODULUS, "num_shares": num_shares, "threshold": threshold}
    with pytest.raises(ValueError, match=r"needs 2 \* threshold > holders \+ colluding_sites.*privacy.max_dropouts"):
        secagg.site_setup(1, config, colluding=colluding)


def test_a_site_refuses_more_neighbours_than_its_threshold_allows_before_making_a_share():
    """A server cannot get round the set-up check by forwarding more neighbours than ``num_shares`` said."""
    states, keys = {}, {}
    for node in range(1, 5):
        states[node], sent = secagg.site_setup(node, {"modulus": MODULUS, "num_shares": 3, "threshold": 2})
        keys[node] = (sent["pk1"], sent["pk2"])
    with pytest.raises(ValueError, match=r"threshold=2 with 4 share holders"):
        secagg.site_share_keys(states[1], keys)
    assert states[1].seed == b"" and states[1].seed_shares == {} and states[1].sk1_shares == {}
    secagg.site_share_keys(states[2], {n: keys[n] for n in (1, 2, 3)})  # the 3 it was set up for: accepted


def test_a_site_named_dropped_while_it_answers_reveals_nothing():
    states, _, _ = _stages_0_to_2(_vectors(3, 8), 3, 2)
    with pytest.raises(ValueError, match="node 2.* named dropped while it answers"):
        secagg.site_unmask(states[2], [1, 3], [2])


def _site_options(state, nodes):
    """Every stage-3 answer the site gives to some (survivors, dropped) pair: which secrets' shares it reveals, as
    a 0/1 row (seed of each node, then first key of each node). Survivors are all the others named, WLOG."""
    options = set()
    others = [n for n in nodes if n != state.node]
    for size in range(len(others) + 1):
        for dropped in itertools.combinations(others, size):
            state.stage = secagg.MASKED
            try:
                reply = secagg.site_unmask(state, [n for n in nodes if n not in dropped], list(dropped))
            except ValueError:
                continue
            row = [0] * (2 * len(nodes))
            for owner in reply["nodes"]:
                row[nodes.index(owner) + (len(nodes) if owner in dropped else 0)] = 1
            options.add(tuple(row))
    state.stage = secagg.MASKED
    return np.array(sorted(options), dtype=np.int16)


def _unmaskable(states, threshold, colluders):
    """Whether some assignment of survivor lists to the honest sites gives the server ``threshold`` shares of the
    target's seed and either of its first secret key or of every other node's (each pairwise mask removable)."""
    nodes = sorted(states)
    combos = np.ones((1, 2 * len(nodes)), dtype=np.int16) * len(colluders)
    for node in nodes:
        if node not in colluders:
            options = _site_options(states[node], nodes)
            combos = (combos[:, None, :] + options[None, :, :]).reshape(-1, 2 * len(nodes))
    index = nodes.index(TARGET)
    seed, keys = combos[:, :len(nodes)], combos[:, len(nodes):]
    others = [i for i, n in enumerate(nodes) if n != TARGET and n not in colluders]
    by_keys = (keys[:, others] >= threshold).all(axis=1)
    return bool(((seed[:, index] >= threshold) & ((keys[:, index] >= threshold) | by_keys)).any())


# (sites, colluding, colluders, Shamir parameters): allowed ones, then a refused one bypassed (the control)
@pytest.mark.parametrize(("sites", "colluding", "colluders", "parameters", "refused"), [
    (4, 0, (), (4, 3), False), (5, 0, (), (5, 3), False), (5, 1, (5,), (5, 4), False), (4, 0, (), (4, 2), True),
    (5, 1, (5,), (5, 3), True)])
def test_no_survivor_lists_unmask_a_site_under_allowed_parameters(monkeypatch, sites, colluding, colluders,
                                                                  parameters, refused):
    if refused:
        monkeypatch.setattr(secagg, "_refuse_survivor_lies", lambda *args: None)
    else:
        max_dropouts = parameters[0] - parameters[1]
        assert secagg.protocol_parameters(sites, max_dropouts=max_dropouts, colluding=colluding) == parameters
    states, _, _ = _stages_0_to_2(_vectors(sites, 8), *parameters, colluding=colluding)
    assert _unmaskable(states, parameters[1], colluders) is refused


@pytest.mark.parametrize(("sites", "colluding", "colluders", "parameters"), [
    (4, 0, (), (4, 3)), (5, 0, (), (5, 3)), (5, 1, (5,), (5, 4))])
def test_the_lie_that_broke_the_refused_parameters_recovers_nothing_under_allowed_ones(sites, colluding, colluders,
                                                                                         parameters):
    vectors = _vectors(sites, 64, seed=sites)
    states, keys, masked = _stages_0_to_2(vectors, *parameters, colluding=colluding)
    told_dropped = set(range(2, sites + 1)) - set(colluders)  # every honest holder but the target
    seed_shares, key_shares = _lie(states, told_dropped, colluders)
    recovered = _unmask_target(seed_shares, key_shares, keys, masked)
    assert recovered is None or not np.array_equal(recovered, vectors[TARGET])


def test_protocol_parameters_refuse_exactly_the_sets_a_lying_server_could_exploit():
    for sites, dropouts, colluding in itertools.product(range(2, 30), range(7), range(4)):
        if sites - dropouts - colluding < 1 or sites <= 2 * dropouts + colluding:
            with pytest.raises(ConfigError, match="privacy.max_dropouts"):
                secagg.protocol_parameters(sites, max_dropouts=dropouts, colluding=colluding)
            continue
        num_shares, threshold = secagg.protocol_parameters(sites, max_dropouts=dropouts, colluding=colluding)
        assert num_shares <= sites and colluding < threshold <= num_shares - dropouts
        assert 2 * threshold > num_shares + colluding


@pytest.mark.parametrize(("sites", "dropouts", "drop"), [(4, 1, (2,)), (5, 2, (2, 4)), (3, 1, (3,)), (9, 3, (1, 5, 6))])
def test_an_honest_run_with_allowed_parameters_still_sums_exactly(sites, dropouts, drop):
    vectors = _vectors(sites, 200, seed=sites)
    result, _ = _secure_sum(vectors, max_dropouts=dropouts, drop={node: secagg.MASKED for node in drop})
    assert result.included == sorted(set(vectors) - set(drop))
    expected = sum(vectors[node] for node in result.included)
    assert np.array_equal(secagg.centred(result.total, MODULUS), expected)


def test_a_run_config_a_lying_server_could_exploit_is_refused_at_resolve():
    with pytest.raises(ConfigError, match="privacy.max_dropouts = 2 is too many.*4 sites"):
        resolve({**RUN, "federation.num_sites": 4, "privacy.max_dropouts": 2})
    resolve({**RUN, "federation.num_sites": 5, "privacy.max_dropouts": 2})


def test_the_run_config_check_refuses_what_protocol_parameters_refuses():
    """The mechanism's Flower-free check and the secure sum's parameters follow one rule."""
    from flwr_app.config import parse_run_config

    for sites, dropouts, colluding in itertools.product(range(2, 9), range(4), range(3)):
        flat = {**RUN, "federation.num_sites": sites, "privacy.max_dropouts": dropouts,
                "privacy.colluding_sites": colluding}
        try:
            secagg.protocol_parameters(sites, max_dropouts=dropouts, colluding=colluding)
        except ConfigError:
            with pytest.raises(ConfigError, match="privacy.max_dropouts"):
                parse_run_config(flat)
        else:
            parse_run_config(flat)


def test_the_site_handler_counts_the_colluding_sites_of_its_own_run_config():
    """Five holders and threshold 3 pass with no colluder (6 > 5) but not with one (6 > 6 fails)."""
    from flwr_app.client_app import SECAGG_STATE, secagg_setup

    def setup(colluding):
        content = RecordDict({secagg.RECORD: ConfigRecord({"modulus": MODULUS, "num_shares": 5, "threshold": 3,
                                                           "parties": 5, "records": 100.0})})
        message = Message(content=content, dst_node_id=7, message_type=secagg.SETUP)
        context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(),
                          run_config={**RUN, "privacy.colluding_sites": colluding})
        secagg_setup(message, context)
        return context

    assert SECAGG_STATE in setup(0).state.config_records
    with pytest.raises(ValueError, match="colluding_sites=1"):
        setup(1)
