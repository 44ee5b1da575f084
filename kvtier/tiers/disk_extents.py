"""Packed extents of the disk tier: the blocks of one ``put_many`` in one file, a name per block.

An *extent* ``<dir>/<shard>/<first key hex>-<random>.kvx`` holds blocks back to back, each
exactly what a block file of its own holds (header page with key, sizes, checksum and
record, then the payload padded to a page), so every block still verifies on its own and a
span of a chain is read with one request. Each block keeps its own name,
``<dir>/<shard>/<key hex>.kvb``, as a symbolic link whose target is not a path but a
location, ``<shard>/<extent name>@<offset>:<length>``: one ``lstat`` + ``readlink`` finds a
block another process packed, a restart rebuilds the index from the links, and the link
never resolves, so nothing that opens the name reads another block's bytes by mistake.

Publication order keeps crashes harmless: the extent is written to a temp file, fsync'd
and renamed onto its name before any link points into it; a link is made under a temp name
and renamed onto the block's name. A crash leaves at worst an extent that some blocks'
links do not reach (a restart counts those bytes and removes an extent no link reaches).

Space: a block removed from an extent that still holds others is erased in place with
``fallocate(PUNCH_HOLE)`` (its space returns to the file system); where the file system
refuses, its bytes are overwritten with zeros and stay counted until the extent goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import uuid
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.direct_io import PAGE, pwrite_all

EXTENT_SUFFIX = ".kvx"
_NAME = re.compile(r"[0-9a-f]{64}-[0-9a-f]{8}\.kvx")
_TARGET = re.compile(r"([0-9a-f]{2}/[0-9a-f]{64}-[0-9a-f]{8}\.kvx)@([0-9]+):([0-9]+)")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@dataclass(slots=True)
class Extent:
    """One extent as a disk tier indexes it (under the tier's lock)."""

    rel: str  #: ``<shard>/<name>`` under the tier's directory
    live: int = 0  #: indexed blocks in it
    dead: int = 0  #: bytes of removed blocks still taking space (no hole punching here)


def extent_stem(first_key: bytes) -> str:
    """The name of a new extent without its suffix (no dots: temp-file names are parsed on dots)."""
    return f"{first_key.hex()}-{uuid.uuid4().hex[:8]}"


def is_extent_name(name: str) -> bool:
    """Whether a file name is one :func:`extent_stem` made (anything else is left alone)."""
    return _NAME.fullmatch(name) is not None


def link_target(rel: str, offset: int, length: int) -> str:
    return f"{rel}@{offset}:{length}"


def parse_link(target: str) -> tuple[str, int, int] | None:
    """``(extent rel, offset, length)`` of a block link's target; None for anything else
    (a path elsewhere, an offset off the page grid)."""
    m = _TARGET.fullmatch(target)
    if m is None:
        return None
    offset, length = int(m.group(2)), int(m.group(3))
    if offset % PAGE or length < PAGE or length % PAGE:
        return None
    return m.group(1), offset, length


def _load_fallocate():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``[offset, offset + length)`` of an open file, keeping its size (reads there
    return zeros); False where the file system or platform does not support it."""
    if _fallocate is None:
        return False
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def erase(path: str, offset: int, length: int) -> bool:
    """Erase one block's bytes inside an extent: punched out (True: its space is free again) or,
    where that is unsupported, overwritten with zeros (False: the space stays taken).
    Raises OSError if neither could be done (e.g. the extent is gone)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if punch_hole(fd, offset, length):
            return True
        zeros = np.zeros(min(length, 1 << 20), dtype=np.uint8)
        for off in range(0, length, zeros.nbytes):
            pwrite_all(fd, zeros[: min(zeros.nbytes, length - off)], offset + off)
        return False
    finally:
        os.close(fd)


def allocated_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk (holes excluded), at most its size."""
    return min(st.st_size, getattr(st, "st_blocks", st.st_size // 512) * 512)
