"""The on-disk format of :class:`~kvtier.tiers.disk.DiskTier`, and the small helpers its parts share.

A block file's header page holds, after the block header, a *record*: the block's parent link
and its owner's optional annotation, with an xxh3-128 over the storage key and both
(:func:`pack_record` / :func:`unpack_record`); the header flags it (:data:`FLAG_RECORD`).
Here too: the file names (:data:`SUFFIX`, :data:`TEMP_SUFFIX`), an index entry (where a block
lies: its own file or its place in an extent), and removing a file. Pure: nothing here holds
a tier's state, so the tier (:mod:`~kvtier.tiers.disk`) and its read and write paths
(:mod:`~kvtier.tiers.disk_reads`, :mod:`~kvtier.tiers.disk_writes`) all import it.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES
from kvtier.core.payload import HEADER_NBYTES, BlockHeader
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk_extents import Extent

#: the disk tier's logger, whichever of its modules logs
log = logging.getLogger("kvtier.tiers.disk")

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"

#: Header flag of disk files: a record (parent link, annotation) follows the header.
#: A high bit, apart from the payload-verification flags of :mod:`kvtier.core.payload`.
FLAG_RECORD = 0x100
_RECORD_MAGIC = b"KVR1"
_RECORD = struct.Struct("<4sB3x32sH2x")  # magic, has parent, parent, annotation length
_HAS_PARENT_AT, _LENGTH_AT = 4, 40  # where _RECORD packs those two (records_ok reads them in place)
_RECORD_CHECK_NBYTES = 16
#: the largest annotation a block carries (what is left of the header page)
MAX_ANNOTATION = PAGE - HEADER_NBYTES - _RECORD.size - _RECORD_CHECK_NBYTES


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a block file says about itself besides its bytes: its parent link and annotation."""

    parent: bytes | None = None
    annotation: bytes | None = None


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One published block as :meth:`DiskTier.records` reads it back (header and record verified)."""

    key: bytes
    nbytes: int  #: payload bytes
    parent: bytes | None
    annotation: bytes | None
    header: BlockHeader


#: ``annotator(key) -> BlockRecord | None``: asked when a block is published; its parent
#: fills in for a put that passed none (a demotion knows no parent). None refuses the block
#: (e.g. its owner deleted it meanwhile): the put fails and nothing is published.
Annotator = Callable[[bytes], "BlockRecord | None"]


def pack_record(key: bytes, record: BlockRecord) -> bytes:
    """The bytes that follow the header in the header page."""
    annotation = record.annotation or b""
    if len(annotation) > MAX_ANNOTATION:
        raise ValueError(f"a block annotation holds at most {MAX_ANNOTATION} bytes, got {len(annotation)}")
    parent = record.parent
    if parent is not None and len(parent) != KEY_BYTES:
        raise ValueError(f"a parent link is a {KEY_BYTES}-byte key, got {len(parent)} bytes")
    head = _RECORD.pack(_RECORD_MAGIC, parent is not None, parent or bytes(KEY_BYTES), len(annotation))
    return head + annotation + xxhash.xxh3_128_digest(key + head + annotation)


def unpack_record(page, key: bytes) -> BlockRecord | None:
    """The record after the header in ``page`` if it is whole and bound to ``key``; else None."""
    mv = memoryview(page).cast("B")
    start = HEADER_NBYTES
    if mv.nbytes < start + _RECORD.size:
        return None
    magic, has_parent, parent, length = _RECORD.unpack_from(mv, start)
    end = start + _RECORD.size + length
    if magic != _RECORD_MAGIC or has_parent > 1 or length > MAX_ANNOTATION or end + _RECORD_CHECK_NBYTES > mv.nbytes:
        return None
    head = bytes(mv[start : start + _RECORD.size])
    annotation = bytes(mv[start + _RECORD.size : end])
    if xxhash.xxh3_128_digest(key + head + annotation) != bytes(mv[end : end + _RECORD_CHECK_NBYTES]):
        return None
    return BlockRecord(parent if has_parent else None, annotation or None)


@dataclass(slots=True)
class _Entry:
    size: int  #: bytes on disk: header page + payload padded to a page
    created: float  #: publication time, wall clock (file mtime after a restart)
    extent: Extent | None = None  #: the extent it is packed in; None: a file of its own
    offset: int = 0  #: where it starts in its extent
    index: int = -1  #: its entry in its extent's table (-1: none, an extent from before tables)
    #: a file of its own: its inode, which its name must still hold for a put or ``contains`` to
    #: trust the entry (a packed block's is its extent's, ``extent.ino``); None: not known
    ino: int | None = None


def records_ok(heads: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each header page (a row of ``heads``, ``(k, PAGE)`` uint8) whether
    :func:`unpack_record` finds a record bound to that row's key (a row of ``keys``, ``(k,
    32)`` uint8) in it; no objects built (the fast path of reading many small blocks). Pages
    whose annotations differ in length are checked one by one."""
    start = HEADER_NBYTES
    k = len(heads)
    lengths = heads[:, start + _LENGTH_AT : start + _LENGTH_AT + 2].copy().view("<u2").reshape(k)
    if k == 0 or (lengths != lengths[0]).any():
        return np.fromiter((unpack_record(page, key.tobytes()) is not None for page, key in zip(heads, keys)),
                           bool, k)
    length = int(lengths[0])
    end = start + _RECORD.size + length
    if length > MAX_ANNOTATION or end + _RECORD_CHECK_NBYTES > heads.shape[1]:
        return np.zeros(k, bool)
    ok = ((heads[:, start : start + 4] == np.frombuffer(_RECORD_MAGIC, np.uint8)).all(axis=1)
          & (heads[:, start + _HAS_PARENT_AT] <= 1))
    signed = np.concatenate([keys, heads[:, start:end]], axis=1)  # what each check covers: key + record
    checks = np.frombuffer(b"".join(xxhash.xxh3_128_digest(row) for row in signed), np.uint8).reshape(k, -1)
    return ok & (checks == heads[:, end : end + _RECORD_CHECK_NBYTES]).all(axis=1)


def _record_in(page, header: BlockHeader, key: bytes) -> BlockRecord | None:
    """The verified record of a header page; an empty one for files written before records."""
    if not header.flags & FLAG_RECORD:
        return BlockRecord()
    return unpack_record(page, key)


def _unlink(path: str) -> bool:
    """Remove a file; False if it was not there (or cannot be removed: logged)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("disk tier: cannot remove %s: %s", path, exc)
        return False


def _unlink_name(path: str) -> bool:
    """Remove a block's name (or an extent's): True; False if nothing was there (ENOENT: removed
    already, a normal delete). Raises OSError where the file system refuses (read-only, EACCES,
    EBUSY, EIO): the caller must not take the name for gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
