"""Packed extents of the disk tier: the blocks of one ``put_many`` in one file, a name per block.

An *extent* ``<dir>/<shard>/<first key hex>-<random>-<pid>-<host tag>.kvx`` (its writer's process,
host and PID namespace: :func:`writer_gone`; extents named before that lack them) starts with a *table* (a page or a
few: the extent's own name and, per block, its key, offset and length, each entry with its own
check) and then holds blocks back to back, each exactly what a block file of its own holds
(header page with key, sizes, checksum and record, then the payload padded to a page), so every
block still verifies on its own and a span of a chain is read with one request. Each block
keeps its own name, ``<dir>/<shard>/<key hex>.kvb``, as a *hard link* to its extent: a name
costs a directory entry, not an inode (a symbolic link per block made one inode per block,
0.15-0.9 ms of kernel CPU each on the VM measured, against 6 us for a hard link). The block's
place comes from the table: one ``lstat`` of the name gives its extent (the inode), one read
of the table its offset; a restart reads each extent's table once. A name opened as a file
shows the table first, not a block.

Extents written before tables (``<key hex>.kvb`` a *symbolic* link whose target is the
location, ``<shard>/<extent name>@<offset>:<length>``, never a path that resolves) are still
read, found by another process and recovered at a restart: :func:`parse_link`.

Publication order keeps crashes harmless: the extent (table included) is written to a temp
file, fsync'd and renamed onto its name before any name links to it; a name is linked under a
temp name and renamed onto the block's name. A crash leaves at worst an extent that some
blocks' names do not reach (a restart counts those bytes, and removes an extent no name reaches
once its writer is known dead -- it ran on this host and its pid is gone -- or once it is older
than any write takes: a younger one of a live writer, or of another host, may be about to link).
The last block of an extent (no other name links to it) takes the extent with it: the block's
name is first renamed to a temp name of the remover, then the extent's own name and that temp are
unlinked; a crash in between leaves a dead writer's temp file (reaped by its name at restart) and an
extent no block reaches (reclaimed), never a block's name leading to a whole extent. Where the file
system refuses that rename for want of room (a full disk, a spent quota), the block's name and then
the extent's own name are unlinked in place (a crash between leaves an extent no block reaches).
Processes sharing the directory: a name another one linked to the extent meanwhile shows in the
link count once the extent's own name is unlinked, and the remover names the extent again; the
writer checks the extent's own name after linking and writes its blocks again on their own where
it went. A name left the only link to a whole extent all the same (a process of an older version
stopped halfway) is a miss at its first read after a restart, removed, not a corrupt block
(:func:`starts_a_table`).

Space: a removed block is erased in place with ``fallocate(PUNCH_HOLE)`` (its space returns to
the file system), and its table entry is zeroed (the key is gone from the file too); where the
file system refuses, its bytes are overwritten with zeros and stay counted until the extent
goes. Only a place that is exactly one whole block of the removed key is erased (a tampered
entry may lead into another block). Processes sharing the directory may each index some blocks
of an extent: the extent's own name is removed only once no block's name links to it (its link
count is 1), whichever process removes the last; an extent from before tables (whose symbolic
links the count does not show) is left to a restart. The table is metadata, like the names:
not counted against the tier's capacity.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.payload import unpack_header
from kvtier.child_process import host_tag, process_gone
from kvtier.tiers.direct_io import PAGE, aligned_buffer, open_regular, pwrite_all, round_up

EXTENT_SUFFIX = ".kvx"
_NAME = re.compile(r"[0-9a-f]{64}-[0-9a-f]{8}(?:-([0-9]{1,10})-([0-9a-f]{8}))?\.kvx")
_TARGET = re.compile(r"([0-9a-f]{2}/[0-9a-f]{64}-[0-9a-f]{8}(?:-[0-9]{1,10}-[0-9a-f]{8})?\.kvx)@([0-9]+):([0-9]+)")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@dataclass(slots=True)
class Extent:
    """One extent as a disk tier indexes it (under the tier's lock)."""

    rel: str  #: ``<shard>/<name>`` under the tier's directory
    live: int = 0  #: indexed blocks in it
    dead: int = 0  #: bytes of removed blocks still taking space (no hole punching here)
    #: its inode (names are hard links to it); None: an extent from before tables, whose
    #: names are symbolic links (:func:`parse_link`)
    ino: int | None = None


# -- the table at the start of an extent ------------------------------------------------
_TABLE_MAGIC = b"KVXT"
_TABLE_VERSION = 1
_HEAD = struct.Struct("<4sBxHI4x")  # magic, version, name length, entries
_ENTRY = struct.Struct("<32sQQQ")  # key, offset, length, check
_CHECK = struct.Struct("<Q")
#: blocks packed in one extent at most (a larger put_many writes several): each has a name
#: linked to the extent, and file systems bound an inode's links (ext4: 65,000)
EXTENT_BLOCKS = 4096
#: entries a table may claim: a bound on what a damaged one makes us read
MAX_TABLE_ENTRIES = EXTENT_BLOCKS


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _entries_at(name_len: int) -> int:
    """Where a table's entries start, after its head, name and the check over both."""
    return _HEAD.size + _pad8(name_len) + _CHECK.size


def table_bytes(rel: str, count: int) -> int:
    """Bytes (whole pages) the table of an extent named ``rel`` with ``count`` blocks takes."""
    raw = _entries_at(len(rel.encode())) + count * _ENTRY.size
    return -(-raw // PAGE) * PAGE


def _entry_check(rel: bytes, key: bytes, offset: int, length: int) -> int:
    # bound to the extent's name: an entry copied from another extent's table does not verify
    return xxhash.xxh3_64_intdigest(rel + key + offset.to_bytes(8, "little") + length.to_bytes(8, "little"))


def pack_table(rel: str, blocks: list[tuple[bytes, int, int]]) -> np.ndarray:
    """The table of extent ``rel`` holding ``(key, offset, length)`` blocks, in a page-aligned
    buffer of :func:`table_bytes` (written with the extent's direct I/O)."""
    name = rel.encode()
    out = aligned_buffer(table_bytes(rel, len(blocks)))
    out[:] = 0
    view = memoryview(out)
    head = _HEAD.pack(_TABLE_MAGIC, _TABLE_VERSION, len(name), len(blocks))
    view[: _HEAD.size] = head
    view[_HEAD.size: _HEAD.size + len(name)] = name
    _CHECK.pack_into(view, _entries_at(len(name)) - _CHECK.size, xxhash.xxh3_64_intdigest(head + name))
    pos = _entries_at(len(name))
    for key, offset, length in blocks:
        _ENTRY.pack_into(view, pos, key, offset, length, _entry_check(name, key, offset, length))
        pos += _ENTRY.size
    return out


@dataclass(slots=True)
class Table:
    """An extent's table as read back: its name, and each block's ``(index, offset, length)``."""

    rel: str
    nbytes: int  #: the table's pages
    blocks: dict[bytes, tuple[int, int, int]]


def _table_head(page: bytes) -> tuple[bytes, int, int] | None:
    """``(name, entries, where the entries start)`` of a page that starts with a table whose head
    verifies; None for any other page."""
    if len(page) < _HEAD.size:
        return None
    magic, version, name_len, count = _HEAD.unpack_from(page, 0)
    if magic != _TABLE_MAGIC or version != _TABLE_VERSION or count > MAX_TABLE_ENTRIES:
        return None
    pos = _entries_at(name_len)
    if pos > len(page):
        return None
    name = page[_HEAD.size: _HEAD.size + name_len]
    if _CHECK.unpack_from(page, pos - _CHECK.size)[0] != xxhash.xxh3_64_intdigest(page[: _HEAD.size] + name):
        return None
    return name, count, pos


def starts_a_table(page: bytes) -> bool:
    """Whether ``page``, read as a block's header page, is an extent's table instead: what a
    block's name shows where it links to an extent as a file of its own (one whose own name went,
    a removal or a put of another process stopped halfway; a restart indexes it by its name)."""
    return _table_head(page) is not None


def read_table(fd: int, file_size: int) -> Table | None:
    """The table at the start of an open extent; None if there is none (an extent from before
    tables, or a damaged head). Entries that do not verify (zeroed by an erasure, damaged) or
    that point outside the file or off the page grid are left out."""
    try:
        page = os.pread(fd, PAGE, 0)
    except OSError:
        return None
    head = _table_head(page)
    if head is None:
        return None
    name, count, pos = head
    try:
        rel = name.decode()
    except UnicodeDecodeError:
        return None
    nbytes = table_bytes(rel, count)
    if nbytes > len(page):
        try:
            page = os.pread(fd, nbytes, 0)
        except OSError:
            return None
        if len(page) < nbytes:
            return None
    blocks: dict[bytes, tuple[int, int, int]] = {}
    for index in range(count):
        key, offset, length, check = _ENTRY.unpack_from(page, pos + index * _ENTRY.size)
        if check != _entry_check(name, key, offset, length):
            continue  # zeroed by an erasure, or damaged: that block is not findable here
        if offset < nbytes or offset % PAGE or length < PAGE or length % PAGE or offset + length > file_size:
            continue
        blocks.setdefault(key, (index, offset, length))
    return Table(rel, nbytes, blocks)


def extent_stem(first_key: bytes) -> str:
    """The name of a new extent without its suffix: the first key, a random part, then its
    writer's pid and :func:`~kvtier.child_process.host_tag` (host name and PID namespace), so that
    a restart can tell a dead writer's extent that no name reaches from a live one's about to be
    linked (no dots: temp-file names are parsed on dots)."""
    return f"{first_key.hex()}-{uuid.uuid4().hex[:8]}-{os.getpid()}-{host_tag()}"


def writer_gone(name: str) -> bool:
    """Whether the process that wrote extent ``name`` is known to be dead: it ran on this host and
    in this PID namespace (its host tag is ours) and its pid is gone (never this process). False
    for an extent named before names carried their writer, and for another host's or container's
    (a shared mount, or containers on one host with the host's name: only age tells). A name whose
    tag hashed the host name alone (before the PID namespace was in it) is another host's so."""
    match = _NAME.fullmatch(name)
    if match is None or match.group(1) is None or match.group(2) != host_tag():
        return False
    return process_gone(int(match.group(1)))


def is_extent_name(name: str) -> bool:
    """Whether a file name is one :func:`extent_stem` made (anything else is left alone)."""
    return _NAME.fullmatch(name) is not None


def is_extent_rel(rel: str) -> bool:
    """Whether ``rel`` is ``<shard>/<extent name>`` as this tier names extents (a table's name
    is checked before anything is opened under it)."""
    shard, _, name = rel.partition("/")
    return is_extent_name(name) and name.startswith(shard) and len(shard) == 2


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


def erase_block(path: str, rel: str, offset: int, length: int, key: bytes, entry: int | None,
                ino: int | None) -> bool | None:
    """Erase one block of extent ``path`` (named ``rel``, inode ``ino`` where known) in place: its
    bytes punched out (True: its space is free again) or, where that is unsupported, overwritten
    with zeros (False: the space stays taken), and its table entry ``entry`` (an index, None: an
    extent from before tables) zeroed, where the table written under that name put it (never where
    a damaged head would say). None: the bytes are left alone (their space stays taken) and only
    the entry is zeroed, unless the place is exactly one whole block of ``key`` (its header names
    the key and its payload fills the length): a place a tampered entry or link gives may start
    inside another block or span one, and a damaged header cannot tell. Nothing is written where
    ``path`` is not a regular file, or not the extent ``ino`` (something put at its name: a link
    out of the directory, another file). The extent's modification time is kept: it is every
    block's publication time (their names are links to it), which retention and restart order go by.
    Raises OSError if it could not be done (e.g. the extent is gone)."""
    fd = open_regular(path, os.O_RDWR)
    try:
        before = os.fstat(fd)
        if ino is not None and before.st_ino != ino:
            return None
        header = unpack_header(os.pread(fd, PAGE, offset))
        whole = header is not None and header.key == key and PAGE + round_up(header.payload_nbytes) == length
        freed = _erase_range(fd, offset, length) if whole else None
        if entry is not None:
            os.pwrite(fd, bytes(_ENTRY.size), _entries_at(len(rel.encode())) + entry * _ENTRY.size)
        os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
        return freed
    finally:
        os.close(fd)


def _erase_range(fd: int, offset: int, length: int) -> bool:
    if punch_hole(fd, offset, length):
        return True
    zeros = np.zeros(min(length, 1 << 20), dtype=np.uint8)
    for off in range(0, length, zeros.nbytes):
        pwrite_all(fd, zeros[: min(zeros.nbytes, length - off)], offset + off)
    return False


def allocated_bytes(path: str, st: os.stat_result) -> int:
    """Bytes of data the file at ``path`` (``st``, its stat) holds: its size less its holes, found
    with ``SEEK_DATA`` / ``SEEK_HOLE``. Not ``st_blocks``, but where those cannot tell: it counts
    the file system's own map of the file as well (ext4 takes a page for it once punched holes
    split a file into more extents than its inode holds), which a restart then counted as a
    removed block's bytes still on disk: a page too many, in about half the runs of a test."""
    fallback = min(st.st_size, getattr(st, "st_blocks", st.st_size // 512) * 512)
    try:
        fd = open_regular(path)
    except OSError:
        return fallback
    try:
        total = pos = 0
        while pos < st.st_size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:   # no data past pos
                    break
                return fallback                # not supported here
            pos = min(os.lseek(fd, start, os.SEEK_HOLE), st.st_size)
            total += pos - start
        return total
    except OSError:
        return fallback
    finally:
        os.close(fd)
