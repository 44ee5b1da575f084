"""How :class:`~kvtier.tiers.mooncake.MooncakeTier` names and tags its objects in a shared engine.

A block is stored under ``kvtier/<hex HMAC-SHA256(tenant secret, key)>``: unguessable,
unlinkable to prompts, and distinct per tenant. Its object starts with a header
(:mod:`kvtier.core.payload`, flag ``FLAG_KEYED_MAC``) whose checksum field holds a keyed tag
over the payload: without the tenant's secret nobody makes an object that verifies.

The tag is a GMAC (AES-256-GCM over no plaintext, the payload as associated data) under a key of
the object's own, HMAC-SHA256(secret, name digest, size, salt), with a fresh random 16-byte
salt per write kept in the header (the second half of its key field; the first half repeats
the name digest's). Why this shape:

- It must be a MAC over the whole payload, not a fast hash inside one: any fleet client can
  list, read and overwrite objects. With xxh3-128 inside the tag (until 2026-12-03) a client
  built a *different* payload with the same xxh3-128 in milliseconds and wrote it under the
  genuine header (``tests/tiers/test_mooncake.py`` forges one).
- GMAC is the cheapest secure MAC at hand: 5-6.5 GB/s a core here against BLAKE3's 3 (and
  many times that on CPUs with VAES/VPCLMULQDQ), and verifying every read on cores that the
  transfer already fills was the whole gap to the bare Mooncake client (BENCHMARKS.md).
- GMAC breaks if a key ever authenticates two payloads under one nonce (its hash key leaks).
  The same block may be written twice with different bytes (a recompute in another batch shape
  differs by an ulp), so the key is per write: the salt, not a counter, makes it so without
  coordination between writers, and binding the name digest and size into the key means an
  object moved under another name, or cut short, verifies under no key its reader derives.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_KEYED_MAC, BlockHeader, pack_header

NAME_PREFIX = "kvtier/"
_NAME_LABEL = b"kvtier mooncake name\0"
_MAC_KEY_LABEL = b"kvtier mooncake gmac key\0"
#: the per-write salt, kept in the second half of the header's key field
SALT_BYTES = 16
NAME_ID_BYTES = 32 - SALT_BYTES
#: every per-write key is used once, so one fixed nonce is safe (GCM's 96-bit form)
_NONCE = bytes(12)
#: a payload is fed to the MAC in pieces no larger than this (the binding's single-call limit is 2 GiB)
_MAC_PIECE = 1 << 30


class PayloadMac:
    """The GMAC of one object's payload, fed piece by piece (``update``, then ``tag``)."""

    __slots__ = ("_ctx",)

    def __init__(self, key: bytes) -> None:
        self._ctx = Cipher(algorithms.AES(key), modes.GCM(_NONCE)).encryptor()

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        for start in range(0, view.nbytes, _MAC_PIECE):
            self._ctx.authenticate_additional_data(view[start:start + _MAC_PIECE])

    def tag(self) -> bytes:
        self._ctx.finalize()
        return self._ctx.tag


class TenantNaming:
    """Names and tags under one tenant's secret (the tier's ``_secret``, derived per tenant)."""

    _secret: bytes

    def _digest(self, key: BlockKey) -> bytes:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"keys are {KEY_BYTES} bytes (kvtier.core.keys), got {key!r:.40}")
        return hmac.new(self._secret, _NAME_LABEL + bytes(key), hashlib.sha256).digest()

    def storage_name(self, key: BlockKey) -> str:
        """The engine's name of a block: one-way, and distinct per tenant."""
        return NAME_PREFIX + self._digest(key).hex()

    def payload_mac(self, digest: bytes, nbytes: int, salt: bytes) -> PayloadMac:
        """The MAC of the object written under ``digest`` with ``nbytes`` of payload and ``salt``."""
        msg = _MAC_KEY_LABEL + digest + nbytes.to_bytes(8, "little") + salt
        return PayloadMac(hmac.new(self._secret, msg, hashlib.sha256).digest())

    def payload_tag(self, digest: bytes, salt: bytes, view) -> bytes:
        mac = self.payload_mac(digest, memoryview(view).nbytes, salt)
        mac.update(view)
        return mac.tag()


def header_id(digest: bytes, salt: bytes) -> bytes:
    """The header's key field of an object: the name digest's first half, then the write's salt."""
    return digest[:NAME_ID_BYTES] + salt


def names_block(header: BlockHeader, digest: bytes, nbytes: int) -> bool:
    """Whether ``header`` is this format's and says it holds the block of ``digest`` at ``nbytes``."""
    return (bool(header.flags & FLAG_KEYED_MAC) and header.key[:NAME_ID_BYTES] == digest[:NAME_ID_BYTES]
            and header.payload_nbytes == nbytes)


def salt_of(header: BlockHeader) -> bytes:
    return header.key[NAME_ID_BYTES:]


def header_row(tier: TenantNaming, digest: bytes, view: np.ndarray, meta) -> np.ndarray:
    """The header an object starts with: the block's name, size, salt, keyed tag and meta."""
    salt = os.urandom(SALT_BYTES)
    tag = tier.payload_tag(digest, salt, view)
    return np.frombuffer(pack_header(header_id(digest, salt), view.nbytes, tag, meta, flags=FLAG_KEYED_MAC), np.uint8)
