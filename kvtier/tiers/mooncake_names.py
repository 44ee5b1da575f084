"""How :class:`~kvtier.tiers.mooncake.MooncakeTier` names and tags its objects in a shared engine.

A block is stored under ``kvtier/<hex HMAC-SHA256(tenant secret, key)>``: unguessable,
unlinkable to prompts, and distinct per tenant. Its object starts with a header
(:mod:`kvtier.core.payload`) whose checksum field holds a *keyed* tag, HMAC(tenant secret,
name, size, BLAKE3(payload)): without the secret nobody makes an object that verifies.

The payload's hash inside the tag must be collision resistant, not merely fast: any fleet
client can list and read objects, and with xxh3-128 there (until 2026-12-03) it could build a
*different* payload with the same xxh3-128 in milliseconds (XXH3 adds each input word and the
product of its halves, masked by a public secret, into plain sums; words that keep both sums
are easy to solve for: ``tests/tiers/test_mooncake.py`` forges one) and write it under the
genuine header, which the tag then accepted. BLAKE3 runs at 4-5 GB/s a thread here (on all
cores for blocks of a MiB or more), beside the engine's 1.6-1.8 GB/s transfers.
"""

from __future__ import annotations

import hashlib
import hmac

import blake3
import numpy as np

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_CHECKSUM, pack_header

NAME_PREFIX = "kvtier/"
_NAME_LABEL = b"kvtier mooncake name\0"
_TAG_LABEL = b"kvtier mooncake tag\0"


#: payloads of at least this many bytes are hashed on every core (BLAKE3's tree splits them)
PARALLEL_HASH_MIN = 1 << 20


def payload_digest(view) -> bytes:
    """The collision-resistant hash of a payload that its keyed tag covers."""
    threads = blake3.blake3.AUTO if memoryview(view).nbytes >= PARALLEL_HASH_MIN else 1
    return blake3.blake3(view, max_threads=threads).digest()


def payload_hasher():
    """The same hash, fed piece by piece (``update``, then ``digest``)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


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

    def _tag(self, digest: bytes, nbytes: int, payload_hash: bytes) -> bytes:
        msg = _TAG_LABEL + digest + nbytes.to_bytes(8, "little") + payload_hash
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:16]


def header_row(tier: TenantNaming, digest: bytes, view: np.ndarray, meta) -> np.ndarray:
    """The header an object starts with: the block's name digest, size, keyed tag and meta."""
    n = view.nbytes
    tag = tier._tag(digest, n, payload_digest(view))
    return np.frombuffer(pack_header(digest, n, tag, meta, flags=FLAG_CHECKSUM), np.uint8)
