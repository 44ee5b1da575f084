"""The serialized form of a block: a small versioned header, then the KV bytes.

Used wherever a block leaves process memory (disk files, the wire). The header
binds the bytes to their key, layout and checksum, so a renamed, truncated,
stale-format or corrupted block fails :func:`check_header` / :func:`checksum`
comparison and is served as a miss, never as data.

Layout (little-endian, :data:`HEADER_NBYTES` bytes)::

    magic "KVTB" | version u16 | flags u16 | key 32s | payload_nbytes u64 |
    token_count u32 | dtype 16s | ndim u8 | pad 3 | shape 6*u32 |
    checksum 16s (xxh3-128 of the payload) | created_ns u64 | header_check u64

``flags`` says how the payload is verified: :data:`FLAG_CHECKSUM` (the checksum
field holds its xxh3-128) or :data:`FLAG_SEALED` (the payload is a sealed AEAD
block, :mod:`kvtier.crypto.aead`, that its reader authenticates; no checksum is
kept, since the tags are a stronger check than any hash a tier could add), or
:data:`FLAG_KEYED_MAC` (a shared engine's object, :mod:`kvtier.tiers.mooncake_names`: the
checksum field holds a MAC under a key of the object's own, the key field names the block
in its first half and holds that key's salt in its second).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.layout import KVLayout

MAGIC = b"KVTB"
FORMAT_VERSION = 1
FLAG_CHECKSUM = 0x1
FLAG_SEALED = 0x2
FLAG_KEYED_MAC = 0x4

_BODY = struct.Struct("<4sHH32sQI16sB3x6I16sQ")
_CHECK = struct.Struct("<Q")
HEADER_NBYTES = _BODY.size + _CHECK.size


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    payload_nbytes: int
    token_count: int
    dtype: str
    shape: tuple[int, ...]
    checksum: bytes
    created_ns: int
    version: int = FORMAT_VERSION
    flags: int = FLAG_CHECKSUM


def checksum(payload) -> bytes:
    """xxh3-128 of a buffer (releases the GIL; > 10 GB/s here)."""
    return xxhash.xxh3_128_digest(payload)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a writer may say about a block beyond its bytes (recorded, not trusted)."""

    dtype: str = ""
    shape: tuple[int, ...] = ()
    token_count: int = 0

    @classmethod
    def of_layout(cls, layout: KVLayout) -> "BlockMeta":
        return cls(layout.dtype, layout.block_shape, layout.block_tokens)


def pack_header(key: bytes, payload_nbytes: int, payload_checksum: bytes, meta: BlockMeta | None = None,
                flags: int = FLAG_CHECKSUM) -> bytes:
    meta = meta or BlockMeta()
    shape = meta.shape
    if len(shape) > 6:
        raise ValueError(f"block shape {shape} has more than 6 dimensions")
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        flags,
        key,
        payload_nbytes,
        meta.token_count,
        meta.dtype.encode("ascii")[:16],
        len(shape),
        *shape,
        *([0] * (6 - len(shape))),
        payload_checksum,
        time.time_ns(),
    )
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def unpack_header(buf) -> BlockHeader | None:
    """Parse a header; ``None`` if it is not a well-formed header of a known version."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_NBYTES:
        return None
    body = mv[: _BODY.size]
    (expected,) = _CHECK.unpack_from(mv, _BODY.size)
    if xxhash.xxh3_64_intdigest(body) != expected:
        return None
    fields = _BODY.unpack(body)
    magic, version, flags, key, nbytes, tokens, dtype, ndim = fields[:8]
    shape = fields[8:14]
    digest, created = fields[14], fields[15]
    if magic != MAGIC or version != FORMAT_VERSION or ndim > 6:
        return None
    return BlockHeader(
        key=key,
        payload_nbytes=nbytes,
        token_count=tokens,
        dtype=dtype.rstrip(b"\0").decode("ascii", "replace"),
        shape=tuple(shape[:ndim]),
        checksum=digest,
        created_ns=created,
        version=version,
        flags=flags,
    )


#: the fields of a header that :func:`plain_headers` checks, where :data:`_BODY` packs them
_FIELDS = np.dtype({"names": ["magic", "version", "flags", "key", "nbytes", "ndim", "checksum", "check"],
                    "formats": ["S4", "<u2", "<u2", ("u1", 32), "<u8", "u1", ("u1", 16), "<u8"],
                    "offsets": [0, 4, 6, 8, 40, 68, 96, 120], "itemsize": HEADER_NBYTES})


def plain_headers(heads: np.ndarray, keys: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ok, checksums, flags)`` of the headers at the start of each row of ``heads`` (a
    ``(k, n >= HEADER_NBYTES)`` uint8 array) for plain (not sealed) blocks of ``keys`` (``(k,
    32)`` uint8) and ``nbytes``: ``ok[m]`` says row m is a header that :func:`unpack_header`
    parses and :func:`header_mismatch` passes, not sealed; ``checksums`` is ``(k, 16)``.

    The fast path of a reader that verifies many small blocks at once: a :class:`BlockHeader`
    per block costs more than hashing a 16 KiB payload. Where ``ok`` is False the reader takes
    the slow path, which says why."""
    k = len(heads)
    fields = np.ascontiguousarray(heads[:, :HEADER_NBYTES]).view(_FIELDS).reshape(k)
    ok = ((fields["magic"] == MAGIC) & (fields["version"] == FORMAT_VERSION) & (fields["ndim"] <= 6)
          & (fields["flags"] & FLAG_SEALED == 0) & (fields["nbytes"] == nbytes) & (fields["key"] == keys).all(axis=1))
    body = heads[:, : _BODY.size]
    check = np.fromiter((xxhash.xxh3_64_intdigest(row) for row in body), np.uint64, k)
    ok &= check == fields["check"]
    return ok, fields["checksum"], fields["flags"]


def header_mismatch(header: BlockHeader, key: bytes, nbytes: int) -> str | None:
    """Why ``header`` does not describe a block of ``key`` and ``nbytes``; None if it does."""
    if header.key != key:
        return "key differs (block renamed or swapped)"
    if header.payload_nbytes != nbytes:
        return f"payload is {header.payload_nbytes} bytes, reader expects {nbytes}"
    return None
