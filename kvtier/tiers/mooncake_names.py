"""How :class:`~kvtier.tiers.mooncake.MooncakeTier` names and tags its objects in a shared engine.

A block is stored under ``kvtier/<hex HMAC-SHA256(tenant secret, key)>``: unguessable,
unlinkable to prompts, and distinct per tenant. Its object starts with a header
(:mod:`kvtier.core.payload`) whose checksum field holds a *keyed* tag, HMAC(tenant secret,
name, size, xxh3-128(payload)): without the secret nobody makes an object that verifies.
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_CHECKSUM, pack_header

NAME_PREFIX = "kvtier/"
_NAME_LABEL = b"kvtier mooncake name\0"
_TAG_LABEL = b"kvtier mooncake tag\0"


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
    tag = tier._tag(digest, n, xxhash.xxh3_128_digest(view))
    return np.frombuffer(pack_header(digest, n, tag, meta, flags=FLAG_CHECKSUM), np.uint8)
