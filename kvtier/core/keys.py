"""Chained block keys: ``key_i = H(key_{i-1}, tokens_i)`` with ``key_{-1}`` the namespace root.

A key therefore names a block *and its whole prefix*: equal keys mean equal
namespace and equal tokens from the first one. SHA-256 is used because it is
collision resistant (a weak hash lets an attacker forge a prefix hit, cf.
CVE-2025-25183) and, with SHA-NI, the fastest of the strong hashes on 1 KiB
inputs here (0.9 ms for the 512 blocks of a 128 k-token prompt).

The chain is sequential, so its cost at small blocks is per block, not per
byte: 8192 blocks of 16 tokens paid ~0.8 us each in Python (hashlib's object
and OpenSSL's context set-up per call, beside 0.1 us of hashing). Every block's
framed bytes are therefore laid out in one numpy pass, and the loop over them
runs in C (:mod:`kvtier.core._chainhash`, OpenSSL's SHA-256) when that optional
extension is built; :func:`block_keys_reference` is the plain definition both
paths are tested against.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterable, Sequence
from typing import NewType

import numpy as np

from kvtier.core.framing import frame_head
from kvtier.core.namespace import Namespace

try:  # optional C loop (setup.py builds it when a compiler and OpenSSL's headers exist)
    from kvtier.core._chainhash import chain as _c_chain
except ImportError:  # pragma: no cover - depends on the install
    _c_chain = None

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 32

_T_PARENT = 32
_T_TOKENS = 33
_T_EXTERNAL = 34
_PARENT_HEAD = frame_head(_T_PARENT, KEY_BYTES)
_HEAD_BYTES = len(_PARENT_HEAD)  #: every frame head: tag byte + 4-byte length


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian uint32 array (no copy if already one)."""
    if isinstance(tokens, (list, tuple)) and sys.byteorder == "little":
        # array.array converts a list of Python ints 3x faster than numpy and
        # range-checks each value for free.
        try:
            return np.frombuffer(array.array("I", tokens), dtype="<u4")
        except OverflowError:
            raise ValueError("token ids must be in 0 .. 2**32-1") from None
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != np.dtype("<u4"):
        # A float array would be truncated by the cast: tokens k + 0.5 would share k's keys.
        # (An empty array has no token to misread: np.asarray([]) is float64.)
        if arr.dtype.kind not in "iu" and arr.size:
            raise ValueError(f"token ids must be integers, got an array of {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in 0 .. 2**32-1")
        arr = arr.astype("<u4")
    return np.ascontiguousarray(arr)


def block_keys(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    *,
    parent: bytes | None = None,
) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens`` (a partial tail has no key).

    ``parent`` continues an existing chain: pass the key of the block that
    precedes ``tokens[0]`` to key only a suffix.
    """
    block_tokens = namespace.layout.block_tokens
    arr = as_token_array(tokens)
    n_full = arr.size // block_tokens
    step = block_tokens * 4
    # Every block's hashed bytes after the parent key, framed in one pass:
    # row i = tokens head | tokens of block i.
    frames = np.empty((n_full, _HEAD_BYTES + step), np.uint8)
    frames[:, :_HEAD_BYTES] = np.frombuffer(frame_head(_T_TOKENS, step), np.uint8)
    frames[:, _HEAD_BYTES:] = arr[: n_full * block_tokens].view(np.uint8).reshape(n_full, step)
    return _chain(_parent_key(namespace, parent), frames)


def _parent_key(namespace: Namespace, parent: bytes | None) -> bytes:
    """The key a chain starts from, as ``bytes`` (any bytes-like parent is read as its bytes, on
    every path alike), refused unless it is a key: the parent frame's head says ``KEY_BYTES``."""
    if parent is None:
        return namespace.root
    # memoryview, not bytes(): bytes(32) would be 32 zero bytes, a key made up from an int
    prev = parent if type(parent) is bytes else memoryview(parent).tobytes()
    if len(prev) != KEY_BYTES:
        raise ValueError(f"a parent key is {KEY_BYTES} bytes, got {len(prev)}")
    return prev


def _chain(prev: bytes, frames: np.ndarray) -> list[BlockKey]:
    """``key_i = SHA-256(parent head | key_{i-1} | frames[i])`` for every row of ``frames``;
    ``prev`` a checked key (:func:`_parent_key`)."""
    if _c_chain is not None:
        return _c_chain(prev, _PARENT_HEAD, frames, frames.shape[1])
    # Python: a copy of a started hash is cheaper than a new one; bytes slices of
    # one blob are cheaper than numpy rows.
    width = frames.shape[1]
    blob = frames.tobytes()
    started = hashlib.sha256(_PARENT_HEAD)
    keys: list[BlockKey] = []
    for offset in range(0, len(blob), width):
        h = started.copy()
        h.update(prev + blob[offset : offset + width])
        prev = h.digest()
        keys.append(prev)
    return keys


def block_keys_reference(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, *, parent: bytes | None = None
) -> list[BlockKey]:
    """The definition of :func:`block_keys`, one hash object per block: what the fast path must equal."""
    block_tokens = namespace.layout.block_tokens
    arr = as_token_array(tokens)
    raw = memoryview(arr[: arr.size // block_tokens * block_tokens]).cast("B")
    step = block_tokens * 4
    prev = _parent_key(namespace, parent)
    keys: list[BlockKey] = []
    for i in range(arr.size // block_tokens):
        h = hashlib.sha256(_PARENT_HEAD)
        h.update(prev)
        h.update(frame_head(_T_TOKENS, step))
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(BlockKey(prev))
    return keys


def _hash_bytes(hashes: Iterable[bytes]) -> list[bytes]:
    """``hashes`` as a list of ``bytes``: an iterator is read once, and a bytes-like hash is framed
    with its byte count (``len()`` of a uint32 array counts its items)."""
    return [h if type(h) is bytes else memoryview(h).tobytes() for h in hashes]


def chain_external_hashes(
    namespace: Namespace, hashes: Iterable[bytes], *, parent: bytes | None = None
) -> list[BlockKey]:
    """Keys chained over an engine's own block hashes (e.g. vLLM's) instead of tokens.

    The engine's hashes already chain over tokens, salt and LoRA; chaining them
    again under the namespace root binds them to model, layout and tenant.
    """
    prev = _parent_key(namespace, parent)
    hashes = _hash_bytes(hashes)
    if hashes and _c_chain is not None:
        sizes = set(map(len, hashes))
        if len(sizes) == 1:  # vLLM's: all one digest size; framed in one numpy pass
            width = sizes.pop()
            frames = np.empty((len(hashes), _HEAD_BYTES + width), np.uint8)
            frames[:, :_HEAD_BYTES] = np.frombuffer(frame_head(_T_EXTERNAL, width), np.uint8)
            frames[:, _HEAD_BYTES:] = np.frombuffer(b"".join(hashes), np.uint8).reshape(len(hashes), width)
            return _c_chain(prev, _PARENT_HEAD, frames, frames.shape[1])
    return chain_external_hashes_reference(namespace, hashes, parent=prev)


def chain_external_hashes_reference(
    namespace: Namespace, hashes: Iterable[bytes], *, parent: bytes | None = None
) -> list[BlockKey]:
    """The definition of :func:`chain_external_hashes` (and its path for hashes of mixed sizes)."""
    prev = _parent_key(namespace, parent)
    keys: list[BlockKey] = []
    for value in _hash_bytes(hashes):
        h = hashlib.sha256(_PARENT_HEAD)
        h.update(prev)
        h.update(frame_head(_T_EXTERNAL, len(value)))
        h.update(value)
        prev = h.digest()
        keys.append(BlockKey(prev))
    return keys


def key_hex(key: bytes) -> str:
    return key.hex()
