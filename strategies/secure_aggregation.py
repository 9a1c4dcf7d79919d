"""Secure aggregation (SecAgg+) of integer vectors on Flower's Message API, from well-kept cryptographic libraries.

The server learns the sum modulo ``M`` of the vectors of the sites that completed the protocol,
and nothing else about any one of them (honest-but-curious server, up to ``t`` colluding sites,
see below). Four stages, each one round trip of query messages, as in Flower's
``SecAggPlusWorkflow`` / ``secaggplus_mod`` (Bell et al., CCS 2020; Bonawitz et al., CCS 2017):

0. **setup** (:data:`SETUP`): each site makes two X25519 key pairs (``cryptography``; RFC 7748) and
   sends the public keys (32 bytes each). The server refuses a key of another length or of small order,
   and a key that two sites sent (it cannot tell which copied: both are left out of this sum), so that
   no honest site fails on a neighbour's key at stage 1;
1. **share keys** (:data:`SHARE_KEYS`): the server forwards to each site its neighbours' public keys;
   the site draws its private-mask seed ``b``, Shamir-shares ``b`` and its first secret key
   (:func:`create_shares`: the bytes of Flower's function, from pycryptodome's ``Shamir``) among its
   neighbours, each share encrypted to its recipient (Fernet, Flower's ``symmetric_encryption``, under
   :func:`channel_key`: HKDF-SHA256 of the X25519 secret of the two sites' second key pairs; the site
   keeps each neighbour's channel key for stage 2), and sends the ciphertexts;
2. **masked vector** (:data:`MASKED`): the server forwards the ciphertexts (a site names, rather than failing
   on, a neighbour's ciphertext it cannot use; the server leaves both out of the sum); the site computes its
   integer vector ``x`` (the caller's function) and sends ``y = x + PRG(b) + sum_v ±PRG(s_uv) mod M``
   (:func:`mask_stream`, ChaCha20 keyed by :func:`self_mask_key` / :func:`pairwise_mask_key`; ``s_uv``
   the X25519 secret of its first key pair and neighbour ``v``'s);
3. **unmask** (:data:`UNMASK`): the server names the surviving and the dropped neighbours; each site
   returns its shares of the survivors' ``b`` and of the dropped sites' first secret keys. With at
   least ``threshold`` shares each, the server removes every survivor's private mask and the
   pairwise masks the survivors share with dropped sites (a reconstructed secret key must be the
   one of the dropped site's public key); the pairwise masks between survivors cancel in the sum.

Consecutive sums over the same sites (training rounds) can be pipelined: the unmask message may also carry the next
sum's stage-0 values (:data:`NEXT_RECORD`), and the site, once this sum's state is finished, makes that sum's key
pairs as at stage 0 (:func:`site_setup`'s checks, against its own run config) and returns their public keys with its
shares (:attr:`SecureSumResult.advertised`). The next sum (``SecureSum.run(advertised=...)``) then sends stage 0 only
to its sites that sent no keys so (dropped out, new, restarted), and checks every key as at stage 0. Each key pair
still serves exactly one sum.

Neighbours: as in Flower's workflow, the selected sites are shuffled onto a ring and each site's
neighbours are the ``num_shares`` sites of the window around it (itself included); with
``num_shares = k`` every site is every site's neighbour. The ring-window graph with half-width
``h`` has vertex connectivity ``2h``, so removing ``D`` drop-outs and ``t`` colluding sites with
``D + t < 2h`` leaves the honest survivors connected: their pairwise masks only cancel in their
total, and the server with ``t`` colluders learns nothing but that total. A secret needs
``threshold > t`` shares, and ``threshold <= num_shares - D`` so that ``D`` drop-outs still leave
enough. :func:`protocol_parameters` picks both.

A server that names different survivors to different sites (Bonawitz et al. 2017's active server): a partner site
does not rely on the server here. Each holder of site ``u``'s shares reveals, at stage 3, its share of ``u``'s
seed ``b`` (told ``u`` survived) or of ``u``'s first secret key (told ``u`` dropped), never both, and a site
named dropped itself refuses; so by telling some holders one thing and the others the other, a lying server
gets both secrets of ``u`` (and with them ``u``'s vector) iff two disjoint sets of the ``n - t`` honest holders
(``n`` the holders, ``u`` itself among them, as it reveals its own share of its seed) each reach the threshold
with the ``t`` colluders' shares: iff ``2 * threshold <= n + t``. Every site refuses such parameters before it
makes a key or a share (:func:`_refuse_survivor_lies`, in :func:`site_setup` against ``num_shares`` and in
:func:`site_share_keys` against the neighbours it is actually given, ``t`` from its own run config), and
:func:`protocol_parameters` never picks them. When every site is every site's neighbour (``num_shares = k``,
federations of at most ``2(D + t) + 3`` sites), the same inequality also leaves too few first-key shares for the
other route to ``u``'s vector, ``b`` plus the first secret key of every neighbour: an honest site names at most
``n - threshold`` nodes dropped, and ``n - t - 1`` honest neighbours each need ``threshold - t`` of those.
Remaining limits: the sites cannot verify the neighbour graph or that a neighbour is a real site, as the server
forwards every public key (no PKI). A server that gives ``u`` neighbours whose keys it holds (Sybils) adds
colluders this count does not see; and with ring windows (``num_shares < k``), the holders of a neighbour's
shares lie partly outside ``u``'s window: a server that also lies about the graph, or (by a max-flow count of
the shares) one that follows the honest ring with ``D >= 4`` and enough sites (18 at ``D = 4``, ``t = 0``), can
name enough holders dropped to collect every neighbour's first secret key. Closing these needs a PKI, a graph
fixed by public randomness (Bell et al. 2020) and, for ``D >= 4``, a wider window than ``2(D + t) + 3``.

The mask generator: Flower's ``pseudo_rand_gen`` seeds numpy's MT19937 with 32 bits folded
from its 32-byte key, so 2^32 guesses strip a mask; it is not used. Every mask here is a ChaCha20
key stream (``cryptography``, which Flower installs) turned into integers mod M by :func:`mask_stream`;
each stream's 256-bit key is derived with HKDF-SHA256 from the full secret: the 32-byte X25519
secret of the pair's first key pairs for a pairwise mask (:func:`pairwise_mask_key`), the
31-byte (248-bit) Shamir-shared random seed for a site's private mask (:func:`self_mask_key`; 31 bytes
fill two 16-byte Shamir blocks with their padding byte, where 32 would take a third), with a label
that separates the two and, for a pair, the two node ids. Key pairs and seeds are drawn fresh at every
run of the protocol (:func:`site_setup`, :func:`site_share_keys`), so no key, and hence no stream,
repeats across rounds; a fixed nonce is therefore safe. No secret shorter than 128 bits is accepted
(:data:`MIN_SECRET_BYTES`). The site's masking and the server's unmasking call the same functions.
No cryptographic primitive is written here.

The key agreement: X25519 rather than Flower's P-384 key pairs (``flwr.supercore.primitives``).
A site makes 8 agreements a round with 4 neighbours, and one took 0.41 ms on P-384 against 0.05 ms on
X25519 here; X25519 is the 128-bit-security curve of TLS 1.3's default key exchange, the level every other
secret here has at least. Its keys are 32 raw bytes, so a dropped site's first secret key is shared and
reconstructed as those bytes and checked against its public key (:func:`secret_key`).

Site side: pure functions of a :class:`SiteState` (kept in the node state between stages) and the
message's values. Server side: :class:`SecureSum` runs the four stages over a ``Grid``. No
``flwr_app`` imports.
"""

from __future__ import annotations

import base64
import functools
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir, _Element  # _Element: Shamir's own GF(2^128) arithmetic
from Crypto.Util.Padding import pad, unpad
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat, share_keys_plaintext_separate
from flwr.serverapp import Grid

from strategies.config import ConfigError

__all__ = [
    "MASKED",
    "NEXT_RECORD",
    "SETUP",
    "SHARE_KEYS",
    "STAGES",
    "UNMASK",
    "SecureSum",
    "SecureSumResult",
    "SiteState",
    "centred",
    "channel_key",
    "combine_shares",
    "create_shares",
    "mask_stream",
    "masked_reply",
    "pairwise_mask_key",
    "protocol_parameters",
    "secret_key",
    "self_mask_key",
    "share_index",
    "site_mask",
    "site_setup",
    "site_share_keys",
    "site_unmask",
]

SETUP = "query.secagg_setup"
SHARE_KEYS = "query.secagg_share_keys"
MASKED = "query.secagg_masked"
UNMASK = "query.secagg_unmask"
STAGES = (SETUP, SHARE_KEYS, MASKED, UNMASK)
#: The record carrying the next sum's stage-0 values in an :data:`UNMASK` message that pipelines that sum's stage 0.
NEXT_RECORD = "secagg.next"
#: The record carrying the protocol's values in every message and reply.
RECORD = "secagg"
#: The array record of the masked vector in a :data:`MASKED` reply.
MASKED_ARRAY = "masked"


def protocol_parameters(selected: int, *, max_dropouts: int, colluding: int) -> tuple[int, int]:
    """``(num_shares, threshold)`` for ``selected`` sites, ``max_dropouts`` drop-outs and ``colluding`` sites.

    ``num_shares = n = min(k, 2(D + t) + 3)`` (a ring window of half-width ``D + t + 1``, connectivity
    ``2(D + t) + 2 > D + t``) and ``threshold = n - D``, which exceeds ``t`` whenever ``k - D - t >= 1``.
    ``ConfigError`` when ``k - D - t < 1`` (no honest survivor) or when ``2 * threshold <= n + t``, under which a
    server naming different survivors to different sites could unmask a site (:func:`_refuse_survivor_lies`):
    that is ``k <= 2D + t`` (a full window always passes), and no other threshold helps, as ``D`` drop-outs need
    ``threshold <= n - D``. So ``k`` sites tolerate at most ``(k - t - 1) // 2`` drop-outs.
    """
    if selected - max_dropouts - colluding < 1 or selected < 2:
        raise ConfigError(f"secure aggregation of {selected} sites cannot tolerate privacy.max_dropouts = "
                          f"{max_dropouts} with privacy.colluding_sites = {colluding} (needs k - D - t >= 1 and "
                          "k >= 2): tolerate fewer drop-outs or select more sites")
    num_shares = min(selected, 2 * (max_dropouts + colluding) + 3)
    threshold = num_shares - max_dropouts
    if 2 * threshold <= num_shares + colluding:
        raise ConfigError(f"run config: privacy.max_dropouts = {max_dropouts} is too many for secure aggregation of "
                          f"{selected} sites with privacy.colluding_sites = {colluding}: a server naming different "
                          "survivors to different sites could unmask a site unless k > 2 * max_dropouts + "
                          f"colluding_sites; set privacy.max_dropouts <= {(selected - colluding - 1) // 2} or select "
                          "more sites")
    return num_shares, threshold


# ---------------------------------------------------------------------------------------------- the masks

#: The shortest secret a mask key is derived from (128 bits); the secrets used are 32 and 48 bytes.
MIN_SECRET_BYTES = 16
#: ChaCha20's 16-byte nonce (counter and nonce, all zero): each key expands exactly one stream.
_NONCE = bytes(16)
#: The longest mask: 2^31 words of 8 bytes (16 GiB; with rejection, fewer than twice as many words on average)
#: stays far inside the 2^32 64-byte blocks (256 GiB) of ChaCha20's 32-bit block counter: the stream never wraps.
MAX_DIMENSION = 2 ** 31
_SELF_LABEL = b"fedsurv secagg v1 self mask"
_PAIRWISE_LABEL = b"fedsurv secagg v2 pairwise mask"
_CHANNEL_LABEL = b"fedsurv secagg v2 channel"
#: The length of an X25519 private or public key (RFC 7748), raw.
KEY_BYTES = 32
#: The length of a site's private-mask seed: 248 bits, which with Flower's padding fill two Shamir blocks.
SEED_BYTES = 31


def _derive(secret: bytes, info: bytes) -> bytes:
    """A 256-bit ChaCha20 key: HKDF-SHA256 (no salt) of the whole ``secret``, bound to ``info``."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secure aggregation: a mask secret must be at least {MIN_SECRET_BYTES} bytes, got "
                         f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def self_mask_key(seed: bytes) -> bytes:
    """The key of a site's private mask: HKDF-SHA256 of its whole Shamir-shared seed (32 random bytes)."""
    return _derive(seed, _SELF_LABEL)


def pairwise_mask_key(private_key: bytes | x25519.X25519PrivateKey, public_key: bytes,
                      nodes: tuple[int, int]) -> bytes:
    """The key of the pairwise mask of ``nodes``: HKDF-SHA256 of the X25519 secret of ``private_key`` (one node's
    first secret key, raw or loaded) and ``public_key`` (the other's first public key, raw), bound to the two node
    ids (in increasing order, so both ends, and the server with a reconstructed key, get the same key)."""
    low, high = sorted(int(node) for node in nodes)
    return _derive(_agreement(private_key, public_key), _PAIRWISE_LABEL + f" {low} {high}".encode())


def channel_key(private_key: bytes | x25519.X25519PrivateKey, public_key: bytes) -> bytes:
    """The Fernet key of two sites' channel (Flower's ``encrypt`` / ``decrypt``): HKDF-SHA256 of the X25519 secret of
    one site's second secret key and the other's second public key, base64url-encoded as Fernet wants it (what
    Flower's ``generate_shared_key`` does for a P-384 secret), under its own label."""
    return base64.urlsafe_b64encode(_derive(_agreement(private_key, public_key), _CHANNEL_LABEL))


def _agreement(private_key: bytes | x25519.X25519PrivateKey, public_key: bytes) -> bytes:
    """The raw X25519 shared secret (32 bytes; ``ValueError`` for a malformed key or an all-zero secret)."""
    if not isinstance(private_key, x25519.X25519PrivateKey):
        private_key = x25519.X25519PrivateKey.from_private_bytes(private_key)
    return private_key.exchange(x25519.X25519PublicKey.from_public_bytes(public_key))


def mask_stream(key: bytes, *, modulus: int, dimension: int) -> np.ndarray:
    """``dimension`` integers uniform on ``[0, modulus)`` (int64) from the ChaCha20 key stream of ``key``.

    ``key``: 32 bytes, used for this one stream only (:func:`self_mask_key`, :func:`pairwise_mask_key`),
    with an all-zero nonce. The key stream is read as 64-bit little-endian words (vectorised, no loop over
    coordinates). When ``modulus`` is a power of two (``2 <= M <= 2^63``), each word is masked to its low
    ``log2(M)`` bits, which is exactly uniform. Otherwise words are drawn by rejection sampling: a word
    ``w >= 2^64 - (2^64 mod M)`` is discarded and the others give ``w mod M`` (exactly uniform; fewer than
    half the words are discarded), taken in stream order, so the output is a prefix-stable function of the
    key. Deterministic: the same key, modulus and dimension give the same vector.
    """
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError("mask_stream: the key must be 32 bytes")
    if not 2 <= modulus <= 2 ** 63:
        raise ValueError(f"mask_stream: the modulus must be in [2, 2^63], got {modulus}")
    if not 0 <= dimension <= MAX_DIMENSION:
        raise ValueError(f"mask_stream: the dimension must be in [0, 2^31], got {dimension}")
    stream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()
    if modulus & (modulus - 1) == 0:
        words = np.frombuffer(stream.update(bytes(8 * dimension)), dtype="<u8")
        return (words & np.uint64(modulus - 1)).astype(np.int64)
    limit = np.uint64(2 ** 64 - 2 ** 64 % modulus)
    out = np.empty(dimension, dtype=np.int64)
    filled = 0
    while filled < dimension:
        need = dimension - filled
        words = np.frombuffer(stream.update(bytes(8 * (need + need // 2 + 16))), dtype="<u8")
        kept = words[words < limit][:need]
        out[filled:filled + kept.size] = (kept % np.uint64(modulus)).astype(np.int64)
        filled += kept.size
    return out


# ---------------------------------------------------------------------------------------------- the shares

#: Shamir's scheme shares 16-byte blocks (pycryptodome's ``Shamir``, over GF(2^128)).
SHARE_BLOCK = 16


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` Shamir shares of ``secret``, any ``threshold`` of which recover it (:func:`combine_shares`).

    The bytes of Flower's ``create_shares``: the secret padded to whole 16-byte blocks (PKCS#7), each block
    split with pycryptodome's ``Shamir.split`` (the library Flower calls); share ``i`` is ``i`` (4 bytes,
    little-endian) followed by its share of every block. Flower's function starts a thread pool per call,
    which costs more than the shares of a 31- or 32-byte secret (pycryptodome holds the GIL); this one does not.
    """
    padded = pad(secret, SHARE_BLOCK)
    shares = [bytearray(index.to_bytes(4, "little", signed=False)) for index in range(1, num + 1)]
    for start in range(0, len(padded), SHARE_BLOCK):
        for index, share in Shamir.split(threshold, num, padded[start:start + SHARE_BLOCK], ssss=False):
            shares[index - 1] += share
    return [bytes(share) for share in shares]


def combine_shares(shares: list[bytes]) -> bytes:
    """The secret of :func:`create_shares` (or Flower's) from at least ``threshold`` of its shares.

    The value of pycryptodome's ``Shamir.combine`` on every block (tested against it), with the Lagrange
    coefficients at 0 computed once per set of share indices (:func:`_lagrange_at_zero`) instead of once per
    block and call: they depend on the indices only, and a server combines every node's shares with the same
    few index sets. Raises ``ValueError`` when the shares are malformed or do not combine into a padded secret
    (a wrong share gives random bytes, whose padding is valid with probability about 1/255).
    """
    if not shares or any(len(share) != len(shares[0]) or (len(share) - 4) % SHARE_BLOCK for share in shares):
        raise ValueError("the shares are not equally long runs of an index and 16-byte blocks")
    shares = sorted(shares, key=share_index)
    indices = tuple(share_index(share) for share in shares)
    if len(set(indices)) != len(indices) or 0 in indices:
        raise ValueError("the shares' indices must be distinct and positive")
    coefficients = _lagrange_at_zero(indices)
    padded = bytearray()
    for start in range(4, len(shares[0]), SHARE_BLOCK):
        block = 0
        for share, coefficient in zip(shares, coefficients, strict=True):
            block ^= int(_Element(share[start:start + SHARE_BLOCK]) * coefficient)  # + in GF(2^128) is XOR
        padded += _Element(block).encode()
    try:
        return unpad(bytes(padded), SHARE_BLOCK)
    except ValueError:
        raise ValueError("Failed to combine shares") from None


def share_index(share: bytes) -> int:
    """A share's index (its first 4 bytes, little-endian: Flower's layout, :func:`create_shares`)."""
    return int.from_bytes(share[:4], "little", signed=False)


@functools.lru_cache(maxsize=1024)
def _lagrange_at_zero(indices: tuple[int, ...]) -> tuple[_Element, ...]:
    r"""The Lagrange basis at 0 of the points ``indices`` in pycryptodome's GF(2^128), as ``Shamir.combine``
    computes them: :math:`l_j(0) = \prod_{m \ne j} x_m / (x_j + x_m)` (subtraction is addition in
    characteristic 2), so a block's secret is :math:`\sum_j y_j l_j(0)`."""
    points = [_Element(index) for index in indices]
    basis = []
    for j, x_j in enumerate(points):
        numerator, denominator = _Element(1), _Element(1)
        for m, x_m in enumerate(points):
            if m != j:
                numerator *= x_m
                denominator *= x_j + x_m
        basis.append(numerator * denominator.inverse())
    return tuple(basis)


def secret_key(secret: bytes, public_key: bytes) -> x25519.X25519PrivateKey:
    """The X25519 private key whose raw bytes are ``secret`` (a dropped site's reconstructed first secret key),
    checked against that site's raw ``public_key``; ``ValueError`` when it is not 32 bytes or not that key."""
    if len(secret) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(secret)}")
    key = x25519.X25519PrivateKey.from_private_bytes(secret)
    if key.public_key().public_bytes_raw() != public_key:
        raise ValueError("the reconstructed secret key is not the one of the node's public key")
    return key


def centred(total: np.ndarray, modulus: int) -> np.ndarray:
    """The representative of ``total`` mod ``modulus`` in ``[-M/2, M/2)`` (int64)."""
    total = np.mod(total.astype(np.int64), modulus)
    return np.where(total >= modulus // 2, total - modulus, total)


# ---------------------------------------------------------------------------------------------- the site


@dataclass
class SiteState:
    """A site's SecAgg+ state between stages (a ConfigRecord in its node state: :meth:`to_record`)."""

    node: int = 0
    stage: str = ""
    modulus: int = 0
    num_shares: int = 0
    threshold: int = 0
    colluding: int = 0
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    seed: bytes = b""
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    seed_shares: dict[int, bytes] = field(default_factory=dict)
    sk1_shares: dict[int, bytes] = field(default_factory=dict)
    channel_keys: dict[int, bytes] = field(default_factory=dict)

    def to_record(self) -> ConfigRecord:
        nodes = sorted(self.public_keys)
        return ConfigRecord({
            "node": self.node, "stage": self.stage, "modulus": self.modulus, "num_shares": self.num_shares,
            "threshold": self.threshold, "colluding": self.colluding, "sk1": self.sk1, "pk1": self.pk1,
            "sk2": self.sk2, "pk2": self.pk2,
            "seed": self.seed, "keys.nodes": nodes, "keys.pk1": [self.public_keys[n][0] for n in nodes],
            "keys.pk2": [self.public_keys[n][1] for n in nodes],
            "seed_shares.nodes": sorted(self.seed_shares), "seed_shares": [self.seed_shares[n] for n in sorted(self.seed_shares)],
            "sk1_shares.nodes": sorted(self.sk1_shares), "sk1_shares": [self.sk1_shares[n] for n in sorted(self.sk1_shares)],
            "channel_keys.nodes": sorted(self.channel_keys),
            "channel_keys": [self.channel_keys[n] for n in sorted(self.channel_keys)],
        })

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SiteState:
        def pairs(nodes: str, values: str) -> dict[int, bytes]:
            return dict(zip((int(n) for n in record.get(nodes, [])), record.get(values, []), strict=True))

        return cls(
            node=int(record["node"]), stage=str(record["stage"]), modulus=int(record["modulus"]),
            num_shares=int(record["num_shares"]), threshold=int(record["threshold"]),
            colluding=int(record.get("colluding", 0)), sk1=record["sk1"],
            pk1=record["pk1"], sk2=record["sk2"], pk2=record["pk2"], seed=record["seed"],
            public_keys={int(n): (a, b) for n, a, b in zip(record.get("keys.nodes", []), record.get("keys.pk1", []),
                                                           record.get("keys.pk2", []), strict=True)},
            seed_shares=pairs("seed_shares.nodes", "seed_shares"), sk1_shares=pairs("sk1_shares.nodes", "sk1_shares"),
            channel_keys=pairs("channel_keys.nodes", "channel_keys"),
        )


def _expect(state: SiteState, stage: str) -> None:
    order = {SETUP: SHARE_KEYS, SHARE_KEYS: MASKED, MASKED: UNMASK}
    if order.get(state.stage) != stage:
        raise ValueError(f"secure aggregation: a {stage} message after stage {state.stage or 'none'}")


def _refuse_survivor_lies(threshold: int, holders: int, colluding: int) -> None:
    """``ValueError`` unless ``2 * threshold > holders + colluding``.

    ``holders``: the sites that get a share of this site's secrets, itself included; ``colluding``: the sites that
    may collude with the server. Otherwise a server naming this site surviving to some holders and dropped to the
    others could collect ``threshold`` shares of both its seed and its first secret key (module docstring).
    """
    if 2 * threshold <= holders + colluding:
        raise ValueError(f"secure aggregation: threshold={threshold} with {holders} share holders and "
                         f"colluding_sites={colluding} lets a server that names different survivors to different "
                         "sites unmask this site (needs 2 * threshold > holders + colluding_sites): tolerate fewer "
                         "drop-outs (privacy.max_dropouts) or select more sites")


def site_setup(node: int, config: Mapping[str, Any], *, colluding: int = 0) -> tuple[SiteState, dict[str, bytes]]:
    """Stage 0: two fresh key pairs; returns the state and ``{"pk1", "pk2"}`` to send.

    ``colluding``: the sites that may collude with the server, from the site's own run config
    (``privacy.colluding_sites``). Parameters under which a server lying about survivors could unmask this site
    are refused (:func:`_refuse_survivor_lies` with ``num_shares`` holders) before any key is made.
    """
    modulus, num_shares, threshold = (int(config[key]) for key in ("modulus", "num_shares", "threshold"))
    if modulus < 2 or modulus & (modulus - 1) or not 1 <= threshold <= num_shares or colluding < 0:
        raise ValueError(f"secure aggregation: bad parameters modulus={modulus}, num_shares={num_shares}, "
                         f"threshold={threshold}, colluding_sites={colluding}")
    _refuse_survivor_lies(threshold, num_shares, colluding)
    sk1, sk2 = x25519.X25519PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    state = SiteState(node=node, stage=SETUP, modulus=modulus, num_shares=num_shares, threshold=threshold,
                      colluding=colluding, sk1=sk1.private_bytes_raw(), pk1=sk1.public_key().public_bytes_raw(),
                      sk2=sk2.private_bytes_raw(), pk2=sk2.public_key().public_bytes_raw())
    return state, {"pk1": state.pk1, "pk2": state.pk2}


def site_share_keys(state: SiteState, public_keys: Mapping[int, tuple[bytes, bytes]]) -> dict[str, list]:
    """Stage 1: share the mask seed and the first secret key among the neighbours, each share encrypted to it.

    ``public_keys``: neighbour node -> ``(pk1, pk2)``, this site included. Returns
    ``{"destinations", "ciphertexts"}``. Refused before any share is made when the neighbours given, this site
    included, are too many for the threshold (:func:`_refuse_survivor_lies`).
    """
    _expect(state, SHARE_KEYS)
    if len(public_keys) < state.threshold:
        raise ValueError(f"secure aggregation: {len(public_keys)} neighbours, fewer than the threshold "
                         f"{state.threshold}")
    _refuse_survivor_lies(state.threshold, len(public_keys), state.colluding)
    if public_keys.get(state.node) != (state.pk1, state.pk2):
        raise ValueError("secure aggregation: the server did not forward this site's own public keys unchanged")
    flat = [key for pair in public_keys.values() for key in pair]
    if len(set(flat)) != len(flat):
        raise ValueError("secure aggregation: two neighbours have the same public key")
    state.public_keys = dict(public_keys)
    state.seed = os.urandom(SEED_BYTES)
    seed_shares = create_shares(state.seed, state.threshold, len(public_keys))
    sk1_shares = create_shares(state.sk1, state.threshold, len(public_keys))
    destinations, ciphertexts = [], []
    sk2 = x25519.X25519PrivateKey.from_private_bytes(state.sk2)  # loaded once, not once per neighbour
    for index, (node, (_, pk2)) in enumerate(sorted(public_keys.items())):
        if node == state.node:
            state.seed_shares[node], state.sk1_shares[node] = seed_shares[index], sk1_shares[index]
            continue
        key = state.channel_keys[node] = channel_key(sk2, pk2)
        plaintext = share_keys_plaintext_concat(state.node, node, seed_shares[index], sk1_shares[index])
        destinations.append(node)
        ciphertexts.append(encrypt(key, plaintext))
    state.stage = SHARE_KEYS
    return {"destinations": destinations, "ciphertexts": ciphertexts}


def site_mask(state: SiteState, sources: Iterable[int], ciphertexts: Iterable[bytes],
              vector: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Stage 2: store the shares the neighbours sent; return ``vector`` masked, mod M (int64), and the neighbours
    whose share this site could not use (:func:`_share_from`), which the server leaves out of the sum with it."""
    _expect(state, MASKED)
    vector = np.asarray(vector)
    if vector.ndim != 1 or vector.dtype != np.int64:
        raise ValueError("secure aggregation: the vector to mask must be a flat int64 array")
    neighbours, disputed = [], []
    sk1 = x25519.X25519PrivateKey.from_private_bytes(state.sk1)  # loaded once, not per neighbour
    for source, ciphertext in zip(sources, ciphertexts, strict=True):
        source = int(source)
        if source not in state.public_keys or source == state.node:
            raise ValueError(f"secure aggregation: a share from node {source}, which is not a neighbour")
        shares = _share_from(state, source, ciphertext)
        if shares is None:
            disputed.append(source)
            continue
        state.seed_shares[source], state.sk1_shares[source] = shares
        neighbours.append(source)
    if len(neighbours) + 1 < state.threshold:
        raise ValueError(f"secure aggregation: shares from {len(neighbours)} neighbours, fewer than the threshold "
                         f"{state.threshold} with this site")
    size = vector.size
    masked = vector + mask_stream(self_mask_key(state.seed), modulus=state.modulus, dimension=size)
    for node in neighbours:
        key = pairwise_mask_key(sk1, state.public_keys[node][0], (state.node, node))
        mask = mask_stream(key, modulus=state.modulus, dimension=size)
        masked = masked + mask if state.node > node else masked - mask
    state.stage = MASKED
    return np.mod(masked, state.modulus).astype(np.int64), disputed


def _share_from(state: SiteState, source: int, ciphertext: bytes) -> tuple[bytes, bytes] | None:
    """``source``'s shares of its seed and first secret key for this site, or None when the ciphertext does not
    decrypt under their channel key, names another sender or receiver, or carries shares of the wrong length."""
    try:
        sender, receiver, seed_share, sk1_share = share_keys_plaintext_separate(
            decrypt(state.channel_keys[source], ciphertext))
    except InvalidToken:
        return None
    lengths = (4 + SHARE_BLOCK * (SEED_BYTES // SHARE_BLOCK + 1), 4 + SHARE_BLOCK * (KEY_BYTES // SHARE_BLOCK + 1))
    if (sender, receiver) != (source, state.node) or (len(seed_share), len(sk1_share)) != lengths:
        return None
    return seed_share, sk1_share


def site_unmask(state: SiteState, survivors: Iterable[int], dropped: Iterable[int]) -> dict[str, list]:
    """Stage 3: the shares of the survivors' mask seeds and of the dropped sites' first secret keys.

    A site answers once and never reveals both shares of one node (a node named both surviving and dropped is
    refused), nor its own share of its first secret key (named dropped while it answers: refused). Shares revealed
    to a server naming different survivors to different sites: module docstring.
    """
    _expect(state, UNMASK)
    survivors, dropped = [int(n) for n in survivors], [int(n) for n in dropped]
    if set(survivors) & set(dropped):
        raise ValueError("secure aggregation: a node named both surviving and dropped")
    if state.node in dropped:
        raise ValueError(f"secure aggregation: this site (node {state.node}) is named dropped while it answers")
    if len(survivors) < state.threshold:
        raise ValueError(f"secure aggregation: {len(survivors)} surviving neighbours, fewer than the threshold "
                         f"{state.threshold}")
    unknown = [n for n in survivors if n not in state.seed_shares] + [n for n in dropped if n not in state.sk1_shares]
    if unknown:
        raise ValueError(f"secure aggregation: no share of node(s) {unknown}")
    state.stage = UNMASK
    return {"nodes": survivors + dropped,
            "shares": [state.seed_shares[n] for n in survivors] + [state.sk1_shares[n] for n in dropped]}


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class SecureSumResult:
    """What one run of the protocol gave the server.

    ``total``: the sum mod M of the included sites' vectors (``None`` when the protocol failed);
    ``included``: their nodes; ``sent``: every node that was asked for its vector (it may have
    computed and sent it); ``failures``: ``(stage, node, reason)``; ``shortfall``: why no sum;
    ``advertised``: the ``(pk1, pk2)`` of the next sum, as sent (checked when that sum uses them), of every site
    whose well-formed unmask reply answered :data:`NEXT_RECORD`.
    """

    total: np.ndarray | None = None
    included: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    failures: list[tuple[str, int, str]] = field(default_factory=list)
    shortfall: str = ""
    advertised: dict[int, tuple[Any, Any]] = field(default_factory=dict)


class SecureSum:
    """The server's side of SecAgg+ for one sum, over a Flower ``Grid``.

    Parameters
    ----------
    modulus, num_shares, threshold
        ``M`` (a power of two at most 2^62) and the Shamir parameters (:func:`protocol_parameters`).
    dimension
        The length of every site's vector.
    timeout
        Seconds to wait for the replies of each stage.
    shuffle_seed
        Seeds the ring order of the sites (reproducible simulations).
    """

    def __init__(self, *, modulus: int, num_shares: int, threshold: int, dimension: int, timeout: float,
                 shuffle_seed: int) -> None:
        if modulus < 2 or modulus & (modulus - 1) or modulus > 2 ** 62:
            raise ValueError(f"modulus must be a power of two in [2, 2^62], got {modulus}")
        self.modulus, self.num_shares, self.threshold = modulus, num_shares, threshold
        self.dimension, self.timeout, self.shuffle_seed = dimension, timeout, shuffle_seed

    def _exchange(self, grid: Grid, stage: str, contents: Mapping[int, RecordDict], result: SecureSumResult,
                  group: str) -> dict[int, Message]:
        messages = [Message(content=content, dst_node_id=node, message_type=stage, group_id=group)
                    for node, content in sorted(contents.items())]
        replies = {reply.metadata.src_node_id: reply for reply in grid.send_and_receive(messages, timeout=self.timeout)}
        answered: dict[int, Message] = {}
        for node in sorted(contents):
            reply = replies.get(node)
            if reply is None:
                result.failures.append((stage, node, f"no reply within {self.timeout:g} s"))
            elif reply.has_error():
                result.failures.append((stage, node, f"the site failed: {reply.error.reason}"))
            elif RECORD not in reply.content.config_records:
                result.failures.append((stage, node, f"the reply carries no '{RECORD}' record"))
            else:
                answered[node] = reply
        return answered

    def _refuse(self, result: SecureSumResult, stage: str, node: int, reason: str) -> None:
        result.failures.append((stage, node, reason))

    def run(self, grid: Grid, nodes: Iterable[int], *, setup: Mapping[str, Any],
            masked_content: Callable[[int], RecordDict], group: str, min_included: int = 1,
            advertised: Mapping[int, tuple[Any, Any]] | None = None,
            next_setup: Mapping[str, Any] | None = None) -> SecureSumResult:
        """Sum the vectors of ``nodes``; ``masked_content(node)`` is the rest of a site's stage-2 message
        (e.g. the global model), ``setup`` the public values every site gets at stage 0. The sum is not
        unmasked when fewer than ``min_included`` vectors were accepted.

        ``advertised``: the public keys that sites sent for this sum with the previous sum's unmask reply (the
        caller's to give only under this sum's ``setup`` and parameters, :meth:`stage_zero`); stage 0 goes to the
        other nodes, and every key is checked as at stage 0. ``next_setup``: the next sum's stage-0 values
        (:meth:`stage_zero` of its ``SecureSum``), sent with the unmask message; the keys returned are in
        ``result.advertised``."""
        result = SecureSumResult()
        nodes = sorted(nodes)
        neighbours = self._ring_neighbours(nodes)
        keys = self._public_keys(grid, nodes, setup, result, group, advertised or {})
        if not self._enough(result, neighbours, set(keys), "after the key set-up"):
            return result
        forwarded = self._forwarded_shares(grid, keys, neighbours, result, group)
        shared = set(forwarded)
        if not self._enough(result, neighbours, shared, "after the key sharing"):
            return result
        total, included = self._masked_total(grid, forwarded, masked_content, result, group)
        dropped = shared - included
        if len(included) < min_included:
            result.shortfall = (f"{len(included)} of {len(nodes)} sites' masked vectors were accepted, fewer than "
                                f"{min_included}: more drop-outs than tolerated, so the sum is not unmasked (the "
                                "survivors' noise would not meet epsilon)")
            return result
        if not self._enough(result, neighbours, included, "after the masked vectors"):
            return result
        shares = self._unmasking_shares(grid, neighbours, included, dropped, result, group, next_setup)
        total = self._unmasked(total, shares, keys, neighbours, included, result)
        if total is not None:
            result.total, result.included = total, sorted(included)
        return result

    def _ring_neighbours(self, nodes: list[int]) -> dict[int, set[int]]:
        """Each node's ``num_shares`` neighbours (itself included) on the ring of ``nodes`` shuffled by
        ``shuffle_seed``."""
        ring = list(nodes)
        random.Random(self.shuffle_seed).shuffle(ring)
        half = self.num_shares // 2
        return {node: {ring[(index + offset) % len(ring)] for offset in range(-half, self.num_shares - half)}
                for index, node in enumerate(ring)}

    def stage_zero(self, setup: Mapping[str, Any]) -> dict[str, Any]:
        """What every site gets at stage 0: ``setup`` and the protocol parameters."""
        return {**setup, "modulus": self.modulus, "num_shares": self.num_shares, "threshold": self.threshold}

    def _public_keys(self, grid: Grid, nodes: list[int], setup: Mapping[str, Any], result: SecureSumResult,
                     group: str, advertised: Mapping[int, tuple[Any, Any]]) -> dict[int, tuple[bytes, bytes]]:
        """Stage 0: send :meth:`stage_zero` to the nodes not in ``advertised``; the two public keys of every site
        that sent (at stage 0 or in ``advertised``) well-formed, non-small-order keys no other site repeats (the
        others are refused in ``result``)."""
        asked = [node for node in nodes if node not in advertised]
        replies = self._exchange(grid, SETUP, {node: RecordDict({RECORD: ConfigRecord(self.stage_zero(setup))})
                                               for node in asked}, result, group) if asked else {}
        sent = {node: (record.get("pk1"), record.get("pk2")) for node, reply in replies.items()
                for record in (reply.content.config_records[RECORD],)}
        sent.update({node: advertised[node] for node in nodes if node in advertised})
        keys: dict[int, tuple[bytes, bytes]] = {}
        for node, (pk1, pk2) in sorted(sent.items()):
            if not all(isinstance(key, bytes) and len(key) == KEY_BYTES for key in (pk1, pk2)):
                self._refuse(result, SETUP, node, f"the reply must carry two public keys ({KEY_BYTES} bytes each)")
            elif _small_order(pk1) or _small_order(pk2):
                self._refuse(result, SETUP, node, "a public key of small order, with which no key can be agreed")
            else:
                keys[node] = (pk1, pk2)
        for node, others in _shared_keys(keys).items():
            self._refuse(result, SETUP, node, f"a public key that node(s) {others} sent too: one of them copied it")
            keys.pop(node)
        return keys

    def _forwarded_shares(self, grid: Grid, keys: Mapping[int, tuple[bytes, bytes]],
                          neighbours: Mapping[int, set[int]], result: SecureSumResult,
                          group: str) -> dict[int, list[tuple[int, bytes]]]:
        """Stage 1: send every keyed site its neighbours' public keys; per site whose reply lists neighbours and
        one ciphertext each, the ``(source, ciphertext)`` pairs addressed to it by such sites (others refused)."""
        replies = self._exchange(grid, SHARE_KEYS, {
            node: RecordDict({RECORD: ConfigRecord({str(n): list(keys[n]) for n in sorted(neighbours[node] & set(keys))})})
            for node in keys}, result, group)
        forwarded: dict[int, list[tuple[int, bytes]]] = {node: [] for node in replies}
        for node, reply in replies.items():
            record = reply.content.config_records[RECORD]
            destinations, ciphertexts = record.get("destinations", []), record.get("ciphertexts", [])
            if (not isinstance(destinations, list) or not isinstance(ciphertexts, list)
                    or len(destinations) != len(ciphertexts)
                    or any(type(d) is not int or d not in neighbours[node] for d in destinations)
                    or any(not isinstance(c, bytes) for c in ciphertexts)):
                self._refuse(result, SHARE_KEYS, node, "the reply must list neighbours and one ciphertext (bytes) "
                                                       "for each")
                forwarded.pop(node)
                continue
        shared = set(forwarded)
        for node, reply in replies.items():
            if node not in shared:
                continue
            record = reply.content.config_records[RECORD]
            for destination, ciphertext in zip(record["destinations"], record["ciphertexts"], strict=True):
                if destination in shared:
                    forwarded[destination].append((node, ciphertext))
        return forwarded

    def _masked_total(self, grid: Grid, forwarded: Mapping[int, list[tuple[int, bytes]]],
                      masked_content: Callable[[int], RecordDict], result: SecureSumResult,
                      group: str) -> tuple[np.ndarray, set[int]]:
        """Stage 2: send each sharing site ``masked_content(node)`` and its shares (``result.sent``); the sum
        mod M of the accepted masked vectors (:meth:`_accepted_vectors`) and their nodes."""
        contents = {}
        for node in sorted(forwarded):
            content = masked_content(node)
            content[RECORD] = ConfigRecord({"sources": [s for s, _ in forwarded[node]],
                                            "ciphertexts": [c for _, c in forwarded[node]]})
            contents[node] = content
        result.sent = sorted(contents)
        replies = self._exchange(grid, MASKED, contents, result, group)
        vectors = self._accepted_vectors(result, replies, forwarded)
        total = np.zeros(self.dimension, dtype=np.int64)
        for vector in vectors.values():
            total = np.mod(total + vector, self.modulus)
        return total, set(vectors)

    def _unmasking_shares(self, grid: Grid, neighbours: Mapping[int, set[int]], included: set[int],
                          dropped: set[int], result: SecureSumResult, group: str,
                          next_setup: Mapping[str, Any] | None) -> dict[int, list[bytes]]:
        """Stage 3: ask each included site for its shares of its neighbours' mask seeds (``included``) and secret
        keys (``dropped``); per node of either set, the shares returned in well-formed replies (others refused).
        With ``next_setup`` (:data:`NEXT_RECORD`), the next sum's public keys of those replies go to
        ``result.advertised``."""
        def content(node: int) -> RecordDict:
            record = RecordDict({RECORD: ConfigRecord({"survivors": sorted(neighbours[node] & included),
                                                       "dropped": sorted(neighbours[node] & dropped)})})
            if next_setup is not None:
                record[NEXT_RECORD] = ConfigRecord(dict(next_setup))
            return record

        replies = self._exchange(grid, UNMASK, {node: content(node) for node in sorted(included)}, result, group)
        shares: dict[int, list[bytes]] = {node: [] for node in included | dropped}
        for node, reply in replies.items():
            record = reply.content.config_records[RECORD]
            owners, values = record.get("nodes", []), record.get("shares", [])
            allowed = neighbours[node] & (included | dropped)
            if (not isinstance(owners, list) or not isinstance(values, list) or len(owners) != len(values)
                    or any(type(o) is not int or o not in allowed for o in owners)
                    or any(not isinstance(v, bytes) for v in values)):
                self._refuse(result, UNMASK, node, "the reply must list neighbours and one share (bytes) for each")
                continue
            for owner, value in zip(owners, values, strict=True):
                shares[owner].append(value)
            if next_setup is not None:
                result.advertised[node] = (record.get("pk1"), record.get("pk2"))
        return shares

    def _unmasked(self, total: np.ndarray, shares: Mapping[int, list[bytes]], keys: Mapping[int, tuple[bytes, bytes]],
                  neighbours: Mapping[int, set[int]], included: set[int],
                  result: SecureSumResult) -> np.ndarray | None:
        """``total`` less the included sites' self masks and the dropped sites' pairwise masks, rebuilt from
        ``shares`` (nodes in ascending order); ``None``, with ``result.shortfall`` set, when a node has fewer
        than ``threshold`` shares or its shares do not combine into a valid secret."""
        for node in sorted(shares):
            if len(shares[node]) < self.threshold:
                result.shortfall = (f"only {len(shares[node])} shares of node {node}'s "
                                    f"{'mask seed' if node in included else 'secret key'} came back, fewer than the "
                                    f"threshold {self.threshold}: the sum cannot be unmasked")
                return None
            try:
                # any threshold shares determine the secret: the lowest indices, whose Lagrange basis is mostly cached
                secret = combine_shares(sorted(shares[node], key=share_index)[:self.threshold])
                if node in included:
                    mask = mask_stream(self_mask_key(secret), modulus=self.modulus, dimension=self.dimension)
                    total = np.mod(total - mask, self.modulus)
                    continue
                dropped_key = secret_key(secret, keys[node][0])
                for other in sorted(neighbours[node] & included):
                    key = pairwise_mask_key(dropped_key, keys[other][0], (node, other))
                    mask = mask_stream(key, modulus=self.modulus, dimension=self.dimension)
                    total = np.mod(total + mask if node > other else total - mask, self.modulus)
            except ValueError as err:
                result.shortfall = f"node {node}'s shares do not combine into a valid secret ({err}): no sum"
                return None
        return total

    def _accepted_vectors(self, result: SecureSumResult, replies: Mapping[int, Message],
                          forwarded: Mapping[int, list[tuple[int, bytes]]]) -> dict[int, np.ndarray]:
        """Stage 2's well-formed masked vectors, less both sites of every dispute: a site that could not use a
        neighbour's share names it, and as the server cannot tell which of the two is at fault, both are named
        and left out of this sum (drop-outs, whose masks the unmasking removes)."""
        vectors: dict[int, np.ndarray] = {}
        disputes: list[tuple[int, int]] = []
        for node, reply in sorted(replies.items()):
            vector, reason = self._masked_vector(reply)
            disputed = reply.content.config_records[RECORD].get("disputed", [])
            senders = {source for source, _ in forwarded[node]}
            if not reason and (not isinstance(disputed, list)
                               or any(type(source) is not int or source not in senders for source in disputed)):
                reason = "the reply's disputed neighbours must be nodes that sent it a share"
            if reason:
                self._refuse(result, MASKED, node, reason)
                continue
            vectors[node] = vector
            disputes += [(node, source) for source in disputed]
        for reporter, source in disputes:
            both = "both are left out of this sum (the server cannot tell which one is at fault)"
            self._refuse(result, SHARE_KEYS, source, f"node {reporter} could not use its encrypted share: {both}")
            self._refuse(result, MASKED, reporter, f"it could not use node {source}'s encrypted share: {both}")
            vectors.pop(reporter, None)
            vectors.pop(source, None)
        return vectors

    def _masked_vector(self, reply: Message) -> tuple[np.ndarray | None, str]:
        records = reply.content.array_records
        if MASKED_ARRAY not in records or list(records[MASKED_ARRAY].keys()) != [MASKED_ARRAY]:
            return None, f"the reply must carry the masked vector as the one array '{MASKED_ARRAY}'"
        vector = records[MASKED_ARRAY][MASKED_ARRAY].numpy()
        if vector.dtype != np.int64:
            return None, f"the masked vector must be int64, got {vector.dtype}"
        if vector.shape != (self.dimension,):
            return None, f"the masked vector has shape {vector.shape}, not ({self.dimension},)"
        if vector.min(initial=0) < 0 or vector.max(initial=0) >= self.modulus:
            return None, f"the masked vector has values outside [0, {self.modulus})"
        return vector, ""

    def _enough(self, result: SecureSumResult, neighbours: Mapping[int, set[int]], alive: set[int], when: str) -> bool:
        """Whether every live site still has ``threshold`` live neighbours (else: the round's shortfall)."""
        short = sorted(node for node in alive if len(neighbours[node] & alive) < self.threshold)
        if not alive or short:
            result.shortfall = (f"{when}, {len(alive)} sites remain and site node(s) {short} have fewer than "
                                f"{self.threshold} live neighbours: the sum cannot be completed (more drop-outs than "
                                "tolerated)") if alive else f"{when}, no site remains"
            return False
        return True


def _small_order(public_key: bytes) -> bool:
    """Whether X25519 agrees only the all-zero secret with ``public_key`` (a point of small order: with any private
    key, as X25519 clamps every scalar to a multiple of the cofactor), which ``cryptography`` refuses. The server
    refuses such a key at stage 0, so that no honest neighbour fails on it at stage 1."""
    try:
        x25519.X25519PrivateKey.generate().exchange(x25519.X25519PublicKey.from_public_bytes(public_key))
    except ValueError:
        return True
    return False


def _shared_keys(keys: Mapping[int, tuple[bytes, bytes]]) -> dict[int, list[int]]:
    """Each node one of whose public keys another node (or its own other key) repeats, with those nodes: the
    server refuses them at stage 0, as an honest site refuses a neighbourhood with a repeated key."""
    owners: dict[bytes, list[int]] = {}
    for node, pair in sorted(keys.items()):
        for key in pair:
            owners.setdefault(key, []).append(node)
    repeated: dict[int, set[int]] = {}
    for nodes in owners.values():
        if len(nodes) > 1:
            for node in nodes:
                repeated.setdefault(node, set()).update(nodes)
    return {node: sorted(nodes - {node}) or [node] for node, nodes in sorted(repeated.items())}


def masked_reply(vector: np.ndarray) -> ArrayRecord:
    """The array record carrying a masked vector in a :data:`MASKED` reply."""
    return ArrayRecord({MASKED_ARRAY: Array(np.ascontiguousarray(vector, dtype=np.int64))})
