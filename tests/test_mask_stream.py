"""SecAgg+ masks (issue 26): ChaCha20 key streams keyed by HKDF-SHA256 of the full secrets, uniform mod M.

Every check is at fixed keys, so deterministic: the thresholds (p > 1e-4, |r| < 0.02, ...) are many
standard deviations wide for a uniform stream and are not a source of flakiness.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from strategies import secure_aggregation as secagg
from strategies.secure_aggregation import mask_stream, pairwise_mask_key, self_mask_key
from tests.test_distributed_dp import _secure_sum, _task_identity, _vectors  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parent.parent
N = 100_000
KEY = bytes(range(32))


def _chi_square_p(buckets: np.ndarray, count: int) -> float:
    observed = np.bincount(buckets, minlength=count)
    assert observed.size == count
    return float(stats.chisquare(observed).pvalue)


def _check_mean_and_variance(values: np.ndarray, modulus: int) -> None:
    """Mean and variance of ``values / M`` against the uniform on {0, ..., M - 1}'s (M - 1)/(2M) and
    (M^2 - 1)/(12 M^2) (sd at n = 10^5 at most 0.0009 and 0.0002)."""
    unit = values.astype(np.float64) / modulus
    assert abs(unit.mean() - (modulus - 1) / (2 * modulus)) < 0.005
    assert abs(unit.var() - (1 - 1 / modulus ** 2) / 12) < 0.002


# ---------------------------------------------------------------------------------------------- uniformity


def test_a_power_of_two_modulus_gives_uniform_values():
    modulus = 2 ** 48
    values = mask_stream(KEY, modulus=modulus, dimension=N)
    assert values.dtype == np.int64 and values.shape == (N,)
    assert values.min() >= 0 and values.max() < modulus
    assert _chi_square_p(values >> 40, 256) > 1e-4          # the top 8 of the 48 bits
    assert _chi_square_p(values & 0xFF, 256) > 1e-4         # the low 8 bits
    _check_mean_and_variance(values, modulus)


@pytest.mark.parametrize("modulus", [7, 10 ** 12 + 39, 3 * 2 ** 61])
def test_a_modulus_that_is_not_a_power_of_two_gives_uniform_values_by_rejection(modulus):
    values = mask_stream(KEY, modulus=modulus, dimension=N)
    assert values.min() >= 0 and values.max() < modulus
    if modulus == 7:
        buckets, count = values, 7
    elif modulus == 3 * 2 ** 61:
        buckets, count = values >> 56, 96                    # M = 96 * 2^56: 96 equal buckets
    else:
        buckets, count = (values.astype(object) * 200 // modulus).astype(np.int64), 200
    assert _chi_square_p(buckets, count) > 1e-4
    _check_mean_and_variance(values, modulus)


def test_the_chi_square_check_sees_the_bias_rejection_removes():
    """``w mod M`` without rejection, for M = 3 * 2^61, puts twice the mass on [0, 2^62): the test sees it."""
    modulus = 3 * 2 ** 61
    words = mask_stream(KEY, modulus=2 ** 63, dimension=N).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    biased = (words % np.uint64(modulus)).astype(np.int64)
    assert _chi_square_p(biased >> 56, 96) < 1e-100


# ---------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("modulus", [2 ** 40, 10 ** 9 + 7])
def test_the_same_key_gives_the_same_stream_and_shorter_streams_are_prefixes(modulus):
    full = mask_stream(KEY, modulus=modulus, dimension=5000)
    assert np.array_equal(full, mask_stream(KEY, modulus=modulus, dimension=5000))
    assert np.array_equal(full[:37], mask_stream(KEY, modulus=modulus, dimension=37))
    assert mask_stream(KEY, modulus=modulus, dimension=0).shape == (0,)


def test_both_ends_of_a_pair_and_the_server_derive_the_same_pairwise_key():
    state_u, _ = secagg.site_setup(3, {"modulus": 2 ** 40, "num_shares": 2, "threshold": 2})
    state_v, _ = secagg.site_setup(8, {"modulus": 2 ** 40, "num_shares": 2, "threshold": 2})
    at_u = pairwise_mask_key(state_u.sk1, state_v.pk1, (3, 8))
    at_v = pairwise_mask_key(state_v.sk1, state_u.pk1, (8, 3))
    assert at_u == at_v and len(at_u) == 32


# ---------------------------------------------------------------------------------------------- independence


def _assert_independent(a: bytes, b: bytes, modulus: int = 2 ** 48) -> None:
    assert a != b
    x, y = mask_stream(a, modulus=modulus, dimension=N), mask_stream(b, modulus=modulus, dimension=N)
    r = np.corrcoef(x.astype(np.float64), y.astype(np.float64))[0, 1]
    assert abs(r) < 0.02, r
    equal_low_bytes = np.mean((x & 0xFF) == (y & 0xFF))
    assert abs(equal_low_bytes - 1 / 256) < 0.0015, equal_low_bytes   # sd 0.0002
    assert abs(np.mean(x == y)) < 1e-4


def _pair(node_u: int, node_v: int):
    config = {"modulus": 2 ** 40, "num_shares": 2, "threshold": 2}
    return secagg.site_setup(node_u, config)[0], secagg.site_setup(node_v, config)[0]


def test_keys_that_differ_give_independent_streams():
    seed = bytes(range(100, 132))
    flipped = bytes([seed[0] ^ 1]) + seed[1:]
    _assert_independent(self_mask_key(seed), self_mask_key(flipped))           # one bit of the secret
    u, v = _pair(1, 2)
    pairwise = pairwise_mask_key(u.sk1, v.pk1, (1, 2))
    _assert_independent(self_mask_key(seed), pairwise)               # self vs pairwise
    _assert_independent(pairwise, pairwise_mask_key(u.sk1, v.pk1, (1, 3)))     # the pair's label
    # the same pairwise secret under the two labels (HKDF's info separates them)
    secret = bytes(range(48))
    _assert_independent(secagg._derive(secret, secagg._SELF_LABEL), secagg._derive(secret, secagg._PAIRWISE_LABEL))


def test_every_run_of_the_protocol_draws_fresh_keys_so_no_stream_repeats_across_rounds():
    """Key pairs are made at every set-up (one per round) and the private-mask seed at every key sharing."""
    round_1, round_2 = _pair(1, 2), _pair(1, 2)
    assert round_1[0].sk1 != round_2[0].sk1 and round_1[1].pk1 != round_2[1].pk1
    _assert_independent(pairwise_mask_key(round_1[0].sk1, round_1[1].pk1, (1, 2)),
                        pairwise_mask_key(round_2[0].sk1, round_2[1].pk1, (1, 2)))
    seeds = []
    for _ in range(2):
        state, _ = secagg.site_setup(1, {"modulus": 2 ** 40, "num_shares": 2, "threshold": 2})
        other, _ = secagg.site_setup(2, {"modulus": 2 ** 40, "num_shares": 2, "threshold": 2})
        secagg.site_share_keys(state, {1: (state.pk1, state.pk2), 2: (other.pk1, other.pk2)})
        seeds.append(state.seed)
    assert len(seeds[0]) == 31 and seeds[0] != seeds[1]


# ---------------------------------------------------------------------------------------------- the sum


@pytest.mark.parametrize("drop", [None, secagg.MASKED])
def test_the_unmasked_sum_is_exact_through_the_new_generator(monkeypatch, drop):
    """4 sites at M = 2^62 (one dropped after the key sharing, or none): the sum equals the plain integer sum mod M
    exactly, and every mask of the sites and of the server's unmasking came from :func:`mask_stream` with a
    32-byte key derived from a secret of at least 128 bits."""
    modulus = 2 ** 62
    calls, secrets = [], []
    stream, derive = secagg.mask_stream, secagg._derive

    def spy_stream(key, **kwargs):
        calls.append((key, kwargs))
        return stream(key, **kwargs)

    def spy_derive(secret, info):
        secrets.append(secret)
        return derive(secret, info)

    monkeypatch.setattr(secagg, "mask_stream", spy_stream)
    monkeypatch.setattr(secagg, "_derive", spy_derive)
    vectors = _vectors(4, 3000, seed=5)
    result, grid = _secure_sum(vectors, drop={4: drop} if drop else None, modulus=modulus)
    included = [node for node in vectors if not drop or node != 4]
    assert result.included == included
    expected = np.mod(sum(vectors[node] for node in included), modulus)
    assert np.array_equal(result.total, expected)
    # masking: each masking site draws its private mask and one pairwise mask per other site (4 sites: all are
    # neighbours); unmasking: the server redraws each survivor's private mask and the drop-out's 3 pairwise masks
    sites = len(grid.masked)
    assert len(calls) == sites * 4 + len(included) + (3 if drop else 0)
    assert all(len(key) == 32 and kwargs == {"modulus": modulus, "dimension": 3000} for key, kwargs in calls)
    assert secrets and min(len(s) for s in secrets) >= 16
    assert sorted({len(s) for s in secrets}) == [31, 32]   # the private-mask seed; the raw X25519 secret


def test_a_masked_vector_is_uniform_whatever_the_site_vector():
    modulus = 2 ** 40
    vectors = {node: np.zeros(N // 4, dtype=np.int64) for node in range(1, 5)}
    _, grid = _secure_sum(vectors, modulus=modulus)
    masked = np.concatenate(list(grid.masked.values()))
    assert _chi_square_p(masked >> 32, 256) > 1e-4
    _check_mean_and_variance(masked, modulus)


# ---------------------------------------------------------------------------------------------- no short seeds


def test_no_secret_shorter_than_128_bits_and_no_other_key_length_is_accepted():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        self_mask_key(bytes(4))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        self_mask_key(bytes(15))
    assert len(self_mask_key(bytes(16))) == 32
    for key in (bytes(4), bytes(16), bytes(33)):
        with pytest.raises(ValueError, match="32 bytes"):
            mask_stream(key, modulus=2 ** 40, dimension=10)
    with pytest.raises(ValueError, match="dimension"):
        mask_stream(KEY, modulus=2 ** 40, dimension=2 ** 31 + 1)   # the stream would near the counter's wrap


def test_flowers_32_bit_mask_generator_is_used_nowhere_in_the_project():
    """A guard: ``pseudo_rand_gen`` seeds MT19937 with 32 bits; no project module may import or name it in code
    (nor numpy's ``RandomState``), docstrings aside."""
    banned = {"pseudo_rand_gen", "RandomState"}
    offenders = []
    for folder in ("strategies", "flwr_app", "simulations", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                        else node.name if isinstance(node, ast.alias) else None)
                if name in banned:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno if hasattr(node, 'lineno') else ''}")
    assert offenders == []


# ---------------------------------------------------------------------------------------------- Shamir shares


@pytest.mark.parametrize("length", [31, 32, 48])
def test_shares_are_flowers_bytes_and_combine_either_way(length):
    """``create_shares`` / ``combine_shares`` are Flower's functions without their thread pool: Flower combines
    our shares and we combine Flower's, from any ``threshold`` of them, into the secret."""
    from flwr.common.secure_aggregation.crypto import shamir as flower

    rng = np.random.default_rng(length)
    for _ in range(5):
        secret = rng.bytes(length)
        ours, theirs = secagg.create_shares(secret, 3, 5), flower.create_shares(secret, 3, 5)
        assert [len(share) for share in ours] == [len(share) for share in theirs] == [4 + 16 * (length // 16 + 1)] * 5
        assert [share[:4] for share in ours] == [share[:4] for share in theirs]   # the same index prefixes
        for subset in ([0, 1, 2], [4, 2, 1], [0, 1, 2, 3, 4]):
            assert flower.combine_shares([ours[i] for i in subset]) == secret
            assert secagg.combine_shares([theirs[i] for i in subset]) == secret


def test_the_cached_lagrange_basis_gives_pycryptodomes_combine_on_any_blocks():
    """``combine_shares`` weights each block by the basis of its index set, computed once per set: on arbitrary
    blocks (not only valid shares) and index sets, the weighted XOR is what ``Shamir.combine`` returns."""
    from Crypto.Protocol.SecretSharing import Shamir, _Element

    rng = np.random.default_rng(11)
    for _ in range(20):
        indices = tuple(int(i) for i in rng.choice(np.arange(1, 40), size=int(rng.integers(1, 7)), replace=False))
        blocks = [rng.bytes(16) for _ in indices]
        basis = secagg._lagrange_at_zero(indices)
        ours = 0
        for block, coefficient in zip(blocks, basis, strict=True):
            ours ^= int(_Element(block) * coefficient)
        assert _Element(ours).encode() == Shamir.combine(list(zip(indices, blocks, strict=True)), ssss=False)
    shares = secagg.create_shares(bytes(31), 4, 6)
    assert secagg.combine_shares([shares[i] for i in (5, 0, 3, 2)]) == bytes(31)   # any order


def test_fewer_shares_than_the_threshold_or_malformed_shares_do_not_give_the_secret():
    secret = bytes(range(32))
    shares = secagg.create_shares(secret, 3, 5)
    for pair in ([0, 1], [1, 4], [2, 3]):   # two of three: a bad padding or another secret
        try:
            combined = secagg.combine_shares([shares[i] for i in pair])
        except ValueError:
            continue
        assert combined != secret
    with pytest.raises(ValueError, match="distinct"):
        secagg.combine_shares([shares[0], shares[0], shares[1]])
    with pytest.raises(ValueError, match="equally long"):
        secagg.combine_shares([shares[0], shares[1][:-1], shares[2]])


def test_a_dropped_sites_reconstructed_key_is_checked_against_its_public_key():
    state, _ = secagg.site_setup(1, {"modulus": 2 ** 20, "num_shares": 3, "threshold": 2})
    other, _ = secagg.site_setup(2, {"modulus": 2 ** 20, "num_shares": 3, "threshold": 2})
    assert {len(key) for key in (state.sk1, state.pk1, state.sk2, state.pk2)} == {32}
    key = secagg.secret_key(secagg.combine_shares(secagg.create_shares(state.sk1, 2, 3)[1:]), state.pk1)
    assert pairwise_mask_key(key, other.pk1, (1, 2)) == pairwise_mask_key(state.sk1, other.pk1, (1, 2))
    assert pairwise_mask_key(other.sk1, state.pk1, (2, 1)) == pairwise_mask_key(state.sk1, other.pk1, (1, 2))
    assert secagg.channel_key(state.sk2, other.pk2) == secagg.channel_key(other.sk2, state.pk2)
    assert secagg.channel_key(state.sk1, other.pk1) != secagg.channel_key(state.sk2, other.pk2)
    with pytest.raises(ValueError, match="not the one of the node's public key"):
        secagg.secret_key(state.sk1, other.pk1)
    with pytest.raises(ValueError, match="32 bytes"):
        secagg.secret_key(state.sk1[1:], state.pk1)


def test_a_public_key_of_the_wrong_length_is_a_named_refusal_and_the_others_are_summed(monkeypatch):
    vectors = _vectors(4, 50, seed=1)
    original = secagg.site_setup

    def short_key(node, config):
        state, values = original(node, config)
        return state, ({**values, "pk1": values["pk1"][:31]} if node == 2 else values)

    monkeypatch.setattr(secagg, "site_setup", short_key)
    result, _ = _secure_sum(vectors, modulus=2 ** 40)
    assert result.failures == [(secagg.SETUP, 2, "the reply must carry two public keys (32 bytes each)")]
    assert result.included == [1, 3, 4]
    assert np.array_equal(result.total, np.mod(vectors[1] + vectors[3] + vectors[4], 2 ** 40))


@pytest.mark.parametrize("bad", ["small order", "copied"])
def test_a_public_key_no_neighbour_could_use_is_refused_at_stage_0_and_no_honest_site_fails(monkeypatch, bad):
    """A hostile site's small-order key (X25519 agrees only the zero secret with it, which ``cryptography`` refuses)
    or a copy of another site's key would make its honest neighbours fail at stage 1; the server refuses it first."""
    vectors = _vectors(6, 40, seed=2)
    original, sent = secagg.site_setup, {}

    def hostile(node, config):
        state, values = original(node, config)
        sent[node] = values
        if node == 3:
            values = {**values, "pk2": bytes(32) if bad == "small order" else sent[1]["pk1"]}
        return state, values

    monkeypatch.setattr(secagg, "site_setup", hostile)
    result, _ = _secure_sum(vectors, modulus=2 ** 40, max_dropouts=2)
    refused = {node: reason for stage, node, reason in result.failures if stage == secagg.SETUP}
    if bad == "small order":
        assert refused == {3: "a public key of small order, with which no key can be agreed"}
    else:   # the server cannot tell which of the two copied: both are left out of this sum, the copy named
        assert refused == {1: "a public key that node(s) [3] sent too: one of them copied it",
                           3: "a public key that node(s) [1] sent too: one of them copied it"}
    assert [failure for failure in result.failures if failure[0] != secagg.SETUP] == []   # no honest site failed
    assert result.included == sorted(set(vectors) - set(refused))
    assert np.array_equal(result.total, np.mod(sum(vectors[node] for node in result.included), 2 ** 40))


@pytest.mark.parametrize("bad", ["not a token", "misaddressed"])
def test_a_share_a_site_cannot_use_is_a_dispute_both_sites_leave_the_sum_and_no_site_fails(monkeypatch, bad):
    """Site 3 sends site 1 a ciphertext that does not decrypt, or a valid one addressed to site 2: site 1 does not
    fail but names it; the server cannot tell which of the two lies, so both are named and left out, and the others'
    sum is exact (their pairwise masks with the two removed from the two's reconstructed keys)."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    vectors = _vectors(6, 40, seed=4)
    original = secagg.site_share_keys

    def hostile(state, public_keys):
        values = original(state, public_keys)
        if state.node == 3:
            at = values["destinations"].index(1)
            values["ciphertexts"][at] = (b"not a Fernet token" if bad == "not a token" else encrypt(
                state.channel_keys[1], share_keys_plaintext_concat(3, 2, bytes(36), bytes(52))))
        return values

    monkeypatch.setattr(secagg, "site_share_keys", hostile)
    result, _ = _secure_sum(vectors, modulus=2 ** 40, max_dropouts=2)
    both = "both are left out of this sum (the server cannot tell which one is at fault)"
    assert result.failures == [(secagg.SHARE_KEYS, 3, f"node 1 could not use its encrypted share: {both}"),
                               (secagg.MASKED, 1, f"it could not use node 3's encrypted share: {both}")]
    assert result.included == [2, 4, 5, 6]
    assert np.array_equal(result.total, np.mod(sum(vectors[node] for node in result.included), 2 ** 40))
