"""``disk``: blocks as files in a directory on local NVMe or a shared POSIX mount.

Layout: ``<dir>/<first two hex digits of the key>/<key hex>.kvb``; a file is
the block header (:func:`kvtier.core.payload.pack_header`) in its first 4 KiB
page, then the payload padded to 4 KiB (see :mod:`kvtier.tiers.direct_io`).
``put_many`` of several blocks (a chain, a write-behind batch) packs them back to
back in one *extent* file, each block the same bytes as a file of its own, and
``<key hex>.kvb`` is then a link to its place (:mod:`kvtier.tiers.disk_extents`):
``get_many`` reads a run of packed blocks with one request.

* **Crash-safe publish.** A block is written to a temp file in its final
  directory, fsync'd, then renamed onto its final name: a final name only ever
  holds a complete block, whichever process wrote it and whenever it died.
* **Every read is verified** (header key and size, xxh3-128 of the payload). A
  mismatch is :attr:`Status.CORRUPT`: counted, logged, the file removed.
  ``get_many`` keeps the reads back to back: block i+1 is read while block i is
  verified (see :meth:`~kvtier.tiers.direct_io.BlockIO.read_many`).
* **Streams** (:class:`~kvtier.tiers.streams.StreamingTier`): a sealed payload is
  written as its source seals it, chunk k+1 sealed while chunk k is written, and
  read into the sink chunk by chunk, chunk k opened while k+1 is read. Such files
  are flagged sealed (besides their checksum) and a plain ``get`` refuses them.
* **A record per block.** The header page also holds, after the header, the
  block's parent link and an optional opaque *annotation* (a few hundred bytes
  its owner attaches, e.g. the server's metadata), with an xxh3-128 over the
  storage key and both: a flipped bit there is :attr:`Status.CORRUPT` like one
  in the payload, and a record copied onto another key does not verify. The
  header flags the record (the header's own check covers the flag), so it
  cannot be stripped either. Annotations come from :attr:`DiskTier.annotator`,
  asked at publication; :meth:`DiskTier.records` reads them back.
* **Restart recovery.** Opening scans the directory: every published block is
  indexed again (LRU order = publication order; with a policy that uses
  parents, each block's recorded parent link is restored, parents first), and
  temp files of dead writers are removed. Only the directory's own entries are
  touched: no shard that is a link elsewhere is entered, no file named otherwise removed.
* **A hostile directory.** Files are opened without following a symbolic link
  and without blocking on a FIFO; what is not a regular file is a miss, and an
  extent is written to only while it is still the file indexed.
* **Shared directories.** The in-process index is a cache of the directory:
  on an index miss, ``contains``/``get``/``put`` look for the file (one stat),
  so blocks other processes wrote are found; writers of the same key each use
  their own temp file and the renames are atomic. On a hit, ``put``/``put_many``/``contains``
  (and ``contains_many``) confirm the entry (one lstat: the name still holds the indexed file,
  or still links to the indexed place, a symbolic link's target compared as the place it names),
  since another process may have removed the block (evicted, expired, deleted): an entry that
  fails is forgotten (a packed block's place counted dead), and the block written again / not
  claimed; a place adopted again after that is counted live once, no longer dead. Reads (and ``lookup_prefix``) trust the entry:
  a get that finds the file gone, or the name holding another file than indexed, forgets the entry
  and reads the block where the name holds it now (a miss where none). A name is removed for a
  block gone or bad only while it holds the very file indexed and read (an extent known by its
  table, not by its inode number alone, which the file system hands out again once it is free).
* **Deletes the file system refuses** (read-only, EACCES, EIO) are not reported done:
  ``delete`` returns False, the block is *withheld* (never served, listed or adopted again,
  still counted) and its removal retried; see :meth:`DiskTier.delete`.
* **Capacity** counts bytes on disk (header page + padded payload) of the blocks
  this process knows of; eviction asks the policy, skips pinned blocks and
  calls ``on_evict`` with the verified bytes (read into memory of their own, never a file mapping: a file that shrank under one killed the process with SIGBUS) before unlinking.
  A file system that runs out of room first (shared with other writers, or smaller than
  ``capacity_bytes``) is the limit from then on: puts evict to make room and are written again
  (see :meth:`DiskTier._medium_full`; out of inodes, until one is free: a block file of its own,
  or a packed block with the rest of its extent, where no block of it is pinned and no other
  process's name links to it); a full directory still opens (its O_DIRECT probe, which
  needs a page, told by reading a block file instead).

Thread safety: all methods are; file I/O of gets and puts runs outside the lock
(an unlinked file stays readable through an open descriptor, so a read racing
an eviction still gets whole, verified bytes). Eviction, including the demotion
hook, runs under the lock.

This module holds the tier itself (configuration, recovery, the index, eviction, removal,
pins, TTL); its parts live beside it: :mod:`~kvtier.tiers.disk_records` (the record format,
file names, an index entry), :mod:`~kvtier.tiers.disk_reads` (gets, verification, records read
back), :mod:`~kvtier.tiers.disk_writes` (puts, extents, publishing) and
:mod:`~kvtier.tiers.disk_extents` (packed extents).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import BlockMeta, unpack_header
from kvtier.errors import ConfigError, TierError
from kvtier.policy.eviction import EvictionPolicy, LRUPolicy
from kvtier.private_files import make_private_dirs
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.base import AgeQueue, Tier, check_ttl, report_refused
from kvtier.tiers.direct_io import PAGE, BlockIO, round_up
from kvtier.tiers.disk_extents import Extent
from kvtier.tiers.disk_reads import DiskReads
from kvtier.tiers.disk_records import (
    FLAG_RECORD,
    MAX_ANNOTATION,
    SUFFIX,
    TEMP_SUFFIX,
    Annotator,
    BlockRecord,
    StoredRecord,
    _Entry,
    _record_in,
    _unlink,
    _unlink_name,
    log,
    pack_record,
    unpack_record,
)
from kvtier.tiers.disk_writes import DiskWrites
from kvtier.tiers.streams import StreamingTier

__all__ = [
    "FLAG_RECORD",
    "MAX_ANNOTATION",
    "STALE_TEMP_S",
    "SUFFIX",
    "TEMP_SUFFIX",
    "Annotator",
    "BlockRecord",
    "DiskTier",
    "StoredRecord",
    "pack_record",
    "unpack_record",
]

#: a temp file older than this is a dead writer's, whatever host wrote it
STALE_TEMP_S = 3600.0
#: why a rename of a block's last name to its remover's temp name may fail where an unlink would
#: not: a directory that must grow for the longer name on a full file system or a spent quota
#: (ext4, XFS), or (EMLINK) one whose entries are at their limit
_PARK_REFUSED = (*direct_io.NO_ROOM, errno.EMLINK)


class DiskTier(DiskReads, DiskWrites, Tier, StreamingTier):
    """Blocks as files under ``path``, at most ``capacity_bytes`` of them on disk.

    ``direct_io``: "auto" probes O_DIRECT at open and falls back to buffered
    I/O; True requires it; False never uses it. ``ttl_s``: blocks older than
    this are misses and are removed; a block's age counts from its first write into
    the store (``created`` on a put: a block demoted or copied down keeps its age;
    else its publication), kept in its file's mtime, so a restart reads the same age
    (blocks packed in one extent share the oldest one's). ``pack_batches``:
    ``put_many`` of several blocks writes one extent (False: a file per block,
    as every ``put`` and sealed stream does; blocks of both kinds are read).
    """

    name = "disk"
    keeps_age = True

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        ttl_s: float | None = None,
        direct_io: bool | str = "auto",
        pack_batches: bool = True,
    ) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be positive, got {capacity_bytes}")
        ttl_s = check_ttl(ttl_s)
        if direct_io not in ("auto", True, False):
            raise ConfigError(f"direct_io must be 'auto', True or False, got {direct_io!r}")
        self.path = os.path.abspath(os.fspath(path))
        _make_tier_dirs(self.path)
        self.direct_io = _uses_direct_io(self.path, direct_io)
        self._io = BlockIO(self.direct_io)
        self._capacity = capacity_bytes
        #: the bytes eviction keeps the tier to: ``capacity_bytes``, or fewer while the file system
        #: holds less than that for it (see :meth:`_medium_full`)
        self._limit = capacity_bytes
        self._quota_limited = False  # whether a spent quota set the limit (statvfs does not show it)
        self._ttl_s = ttl_s
        self.pack_batches = pack_batches
        self._policy = policy if policy is not None else LRUPolicy()  # an empty policy is falsy
        self._index: dict[BlockKey, _Entry] = {}  # insertion order ~ publication order
        #: indexed blocks by age, for expiry (only with a TTL): ages carried in by puts, and blocks
        #: adopted from other processes, arrive in any order
        self._ages = AgeQueue(lambda: ((e.created, k, e) for k, e in self._index.items())) if ttl_s is not None else None
        self._extents: dict[str, Extent] = {}  # rel → extent holding indexed blocks
        #: rel → bytes of its table pages, for the extents in ``_extents`` that have a table: on the
        #: medium, freed with the extent's last block, yet left out of used_bytes (as a restart counts)
        self._tables: dict[str, int] = {}
        #: places in those extents that :meth:`_forget` counted dead (rel → offset → size): one a name
        #: reaches again and :meth:`_adopt` indexes anew moves back from dead to live, never counted twice
        self._forgotten: dict[str, dict[int, int]] = {}
        self._pins: dict[BlockKey, int] = {}
        #: indexed blocks whose removal the file system refused: never served, listed, adopted or
        #: demoted again; their bytes stay counted; every later look at the key retries (see delete)
        self._withheld: set[BlockKey] = set()
        self._used = 0
        self._reserved = 0  # room promised to puts in flight
        #: of ``_reserved``: the bytes of puts in flight written already (their fsync under way), which
        #: the file system's free room lacks (see :meth:`_medium_full`)
        self._landed = 0
        #: a write found no free inode: a put evicts until statvfs shows one (see :meth:`_inode_free`)
        self._inodes_short = False
        self._inodes_warned = False  # (logged once: a shared medium may run out again and again)
        #: see :data:`Annotator`; called outside the lock, once per block published
        self.annotator: Annotator | None = None
        self._recover()

    # -- contract -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: BlockKey) -> bool:
        return self.contains_many((key,))[0]

    def contains_many(self, keys) -> list[bool]:
        """Whether each block is here, its indexed entry confirmed against the directory (one lstat
        per indexed key, outside the lock: see :meth:`_drop_stale`); what it does not index is
        looked for as a get would (one stat)."""
        self._drop_stale(keys)
        with self._lock:
            return [self._live(key) is not None for key in keys]

    def lookup_prefix(self, keys) -> int:
        """Leading ``keys`` held, under one hold of the lock. Trusts the index, like a get (no stat
        for an indexed block: one another process removed since is a miss when read)."""
        n = 0
        with self._lock:
            for key in keys:
                if self._live(key) is None:
                    break
                n += 1
        return n

    def streams_available(self) -> bool:
        return True

    def _file_of(self, key: BlockKey, entry: _Entry) -> str:
        """The file that holds a block: its own, or its extent."""
        return self.path_of(key) if entry.extent is None else os.path.join(self.path, entry.extent.rel)

    def delete(self, key: BlockKey) -> bool:
        """Remove a block at once, pinned or not: readers holding it open keep whole bytes.

        True: it was here and is removed. False: nothing of it was here (a name already gone,
        ENOENT, is a normal delete), or the file system refused to remove it (read-only, EACCES,
        EBUSY, EIO): the block is then *withheld* -- it stays indexed and counted (its bytes are
        still on the medium) but is never served, listed, pinned, demoted or adopted again by this
        tier, and its removal is retried at every later look at the key (a get, contains, put or
        delete), at each :meth:`expire` and when eviction reaches it; it is counted in
        ``stats.errors``, logged, and reported to a caller collecting
        :func:`~kvtier.tiers.base.refused_removals` (as ``TieredStore.delete`` does, which
        then raises), so that an erasure the disk could not carry out is not reported done. A
        restart knows nothing of it: a caller that must keep an erasure across restarts keeps
        its own record of what it could not remove."""
        with self._lock:
            # a block another process packed is indexed first, so that its bytes are erased too
            if key in self._index or self._adopt(key) is not None:
                error = self._remove(key)
                path = self.path_of(key)
            else:
                path, error = self.path_of(key), None
                try:
                    # a stray name (expired, no block): removed too; a directory there is none of ours
                    found = not stat.S_ISDIR(os.lstat(path).st_mode) and _unlink_name(path)
                except FileNotFoundError:
                    found = False
                except OSError as exc:
                    found, error = False, exc
                if error is None:
                    self.stats.deletes += found
                    return found
            if error is not None:
                self.stats.errors += 1
                log.warning("disk tier %s: cannot delete %s (%s); withheld until its removal succeeds",
                            self.path, key.hex(), error)
                report_refused(key, getattr(error, "filename", None) or path, error)
                return False
            self.stats.deletes += 1
            return True

    def keys(self) -> Iterator[BlockKey]:
        """The indexed keys (a snapshot; blocks other processes wrote since are not listed)."""
        with self._lock:
            return iter([key for key in self._index if key not in self._withheld])

    def pin(self, key: BlockKey) -> bool:
        """Keep a block from eviction and expiry until :meth:`unpin`; False if absent."""
        with self._lock:
            if self._live(key) is None:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: BlockKey) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise ValueError("unpin of a block that is not pinned; pair each unpin with a pin")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def created_of(self, key: BlockKey) -> float | None:
        """When an indexed block was first written into the store (wall clock: its file's mtime);
        None if not indexed (or withheld). Expired blocks not yet removed answer too (an
        ``on_evict`` hook asks about its victim)."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None or key in self._withheld else entry.created

    def locate(self, key: BlockKey) -> tuple[str, int] | None:
        """``(file, offset)`` of an indexed block's bytes (its header page first): its own file at
        offset 0, or its extent (for tools and tests that inspect or damage a block in place)."""
        with self._lock:
            entry = self._live(key)
            return None if entry is None else (self._file_of(key, entry), entry.offset)

    def path_of(self, key: bytes) -> str:
        """Where ``key``'s block file lives (whether or not it exists)."""
        name = key.hex()
        return os.path.join(self.path, name[:2], name + SUFFIX)

    def admits(self, created: float | None) -> bool:
        """False for a block already past ``ttl_s`` (a put of it writes nothing)."""
        return created is None or not self._expired(created)

    def expire(self) -> int:
        """Remove expired blocks now (they are also removed lazily); returns how many. Retries the
        removal of withheld blocks too (see :meth:`delete`)."""
        with self._lock:
            for key in list(self._withheld):
                if self._remove(key) is None:
                    self.stats.deletes += 1
            return self._purge_expired()

    def check_integrity(self, *, deep: bool = False) -> None:
        """Raise AssertionError if the accounting is inconsistent; ``deep`` also stats
        every indexed file (only meaningful when no other process shares the directory)."""
        with self._lock:
            total = sum(e.size for e in self._index.values()) + sum(x.dead for x in self._extents.values())
            assert total == self._used, f"indexed and dead sizes sum to {total}, used_bytes is {self._used}"
            live: dict[str, int] = {}
            for entry in self._index.values():
                if entry.extent is not None:
                    assert self._extents.get(entry.extent.rel) is entry.extent, f"unknown extent {entry.extent.rel}"
                    live[entry.extent.rel] = live.get(entry.extent.rel, 0) + 1
            for rel, extent in self._extents.items():
                indexed = live.get(rel, 0)
                assert extent.live == indexed > 0, f"extent {rel}: {extent.live} live, the index has {indexed}"
                assert extent.dead >= 0, f"extent {rel}: negative dead bytes"
                forgotten = sum(self._forgotten.get(rel, {}).values())
                assert forgotten <= extent.dead, f"extent {rel}: {forgotten} bytes forgotten, {extent.dead} dead"
            assert self._forgotten.keys() <= self._extents.keys(), "places forgotten in an extent not counted"
            assert self._tables.keys() <= self._extents.keys(), "a table counted for an extent not indexed"
            assert self._used <= self._capacity, f"used {self._used} > capacity {self._capacity}"
            assert 0 <= self._limit <= self._capacity, f"limit {self._limit}, capacity {self._capacity}"
            assert 0 <= self._landed <= self._reserved, f"{self._landed} of {self._reserved} reserved landed"
            assert len(self._policy) == len(self._index), (
                f"policy tracks {len(self._policy)} keys, index holds {len(self._index)}"
            )
            assert all(c > 0 for c in self._pins.values()), "non-positive pin count"
            assert self._withheld <= self._index.keys(), "a withheld block is not indexed"
            for key, entry in self._index.items():
                assert entry.size >= PAGE and entry.size % PAGE == 0, f"odd size {entry.size} for {key.hex()}"
                if deep and entry.extent is None:
                    size = os.stat(self.path_of(key)).st_size
                    assert size == entry.size, f"{key.hex()}: file has {size} bytes, index says {entry.size}"
                elif deep:
                    size = os.stat(self._file_of(key, entry)).st_size
                    assert size >= entry.offset + entry.size, f"{key.hex()}: extent of {size} bytes ends before it"

    def close(self) -> None:
        self._io.close()

    # -- index (all under the lock) ----------------------------------------------
    def _expired(self, created: float, now: float | None = None) -> bool:
        return self._ttl_s is not None and (now or time.time()) - created > self._ttl_s

    def _live(self, key: BlockKey) -> _Entry | None:
        entry = self._index.get(key)
        if entry is None:
            return self._adopt(key)
        if key in self._withheld:  # deleted, but the file system refused: try again, serve never
            if self._remove(key) is None:
                self.stats.deletes += 1
            return None
        if self._expired(entry.created) and key not in self._pins:
            self._remove(key)
            self.stats.expirations += 1
            return None
        return entry

    def _adopt(self, key: BlockKey) -> _Entry | None:
        """Index a block another process published (one stat), making room for it."""
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return None
        path = self.path_of(key)
        try:
            st = os.lstat(path)
            table = self._table_behind(path, st) if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 else None
            if stat.S_ISLNK(st.st_mode):
                packed = self._packed_location(path)
            else:
                packed = self._tabled_location(key, table, st) if table is not None else None
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode) or table is not None:
            if packed is None or self._expired(st.st_mtime):
                return None  # the reader that opens it (or a restart) sorts it out
            rel, offset, size, index = packed
            extent = self._extent(rel, None if index < 0 else st.st_ino, table.nbytes if table is not None else 0)
            self._index_block(key, _Entry(size, st.st_mtime, extent, offset, index), None)
        else:
            # a block file of its own: a regular file (a directory put at the name is no block,
            # and its size would pass for one: ext4's are a page)
            if not stat.S_ISREG(st.st_mode) or not _plausible(st.st_size) or self._expired(st.st_mtime):
                return None
            self._index_block(key, _Entry(st.st_size, st.st_mtime, ino=st.st_ino), None)
        self._make_room(0)
        return self._index.get(key)

    def _packed_location(self, path: str) -> tuple[str, int, int, int] | None:
        """``(extent rel, offset, length, -1)`` of a block's symbolic link (an extent from before
        tables) whose extent is a regular file (not a link out of the directory) reaching its end."""
        place = disk_extents.parse_link(os.readlink(path))
        if place is None:
            return None
        try:
            st = os.lstat(os.path.join(self.path, place[0]))
        except OSError:
            return None
        return (*place, -1) if stat.S_ISREG(st.st_mode) and place[1] + place[2] <= st.st_size else None

    @staticmethod
    def _table_behind(path: str, st: os.stat_result) -> disk_extents.Table | None:
        """The table at the start of a block's name that has several links (``st``, its lstat): an
        extent's name. None: no table there, a block file of its own that is also linked elsewhere
        (a hard-link snapshot of the directory, a backup). Raises OSError if the name now holds
        another file than ``st``, or none."""
        fd = direct_io.open_regular(path)  # no following a link, no blocking on a FIFO swapped in since the lstat
        try:
            now = os.fstat(fd)
            if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                raise FileNotFoundError(path)  # replaced since the lstat
            return disk_extents.read_table(fd, now.st_size)
        finally:
            os.close(fd)

    @classmethod
    def _still_links(cls, path: str, st: os.stat_result, rel: str) -> bool:
        """Whether a block's name (``st``, its lstat in the restart scan) still links to extent
        ``rel``, which the scan matched to it by inode number: the same file, whose table (where it
        has one) is ``rel``'s. Asked before the name is removed: by then the number may be
        another file's, one that got it after the one the scan saw was removed."""
        try:
            table = cls._table_behind(path, st)
        except OSError:
            return False
        return table is None or table.rel == rel

    def _tabled_location(self, key: BlockKey, table: disk_extents.Table,
                         st: os.stat_result) -> tuple[str, int, int, int] | None:
        """``(extent rel, offset, length, table index)`` of a block whose name (``st``) is a hard link
        to an extent: from the table it opens, if the extent's own name is that same file."""
        if key not in table.blocks or not self._is_extent(table, st):
            return None  # (the table names another file: not an extent of this directory)
        index, offset, length = table.blocks[key]
        return table.rel, offset, length, index

    def _extent(self, rel: str, ino: int | None = None, table_bytes: int = 0) -> Extent:
        """The extent indexed at ``rel``, counted from now if it was not (``table_bytes``: its table's
        pages, where known: 0 for an extent from before tables, or one met by a name alone)."""
        extent = self._extents.get(rel)
        if extent is None:
            extent = self._extents[rel] = Extent(rel, ino=ino)
        if table_bytes and rel not in self._tables:
            self._tables[rel] = table_bytes
        return extent

    def _index_block(self, key: BlockKey, entry: _Entry, parent: BlockKey | None) -> None:
        self._index[key] = entry
        self._used += entry.size
        if entry.extent is not None:
            entry.extent.live += 1
            self._revive(entry.extent, entry.offset, entry.size)  # (a place forgotten, then adopted again)
        self._policy.on_insert(key, parent)
        self._queue_age(key, entry)

    def _queue_age(self, key: BlockKey, entry: _Entry) -> None:
        """Queue a block just indexed for expiry (with a TTL)."""
        if self._ages is not None:
            self._ages.push(entry.created, key, entry, held=len(self._index))

    def _make_room(self, need: int) -> bool:
        """Evict the policy's victims (never pinned ones) until ``need`` more bytes fit under the
        limit, besides the puts in flight, and, for a put (``need`` > 0) while a write found no free
        inode, until statvfs shows one for its file; False where they cannot. Under a limit the
        medium lowered, a put larger than the tier holds plus the bytes left (a spent quota's: than
        the limit) is refused before anything is evicted (:meth:`_room_with_nothing_held`): it
        would evict the whole tier and fail all the same (an inode is no such reason: evicting a
        block file frees one). While an inode is wanted, only victims whose
        eviction frees one are taken (:meth:`_frees_inode`): a block file of its own, or a packed
        block whose whole extent can go with it; the others are skipped, evicted for nothing."""
        def fits() -> bool:
            # the inode asked first, every time: an eviction may have freed one while the bytes are
            # still short, and only _inode_free ends the watch (else the victims skipped for their
            # inode are never taken for their bytes, and the put is refused with room to be made)
            inode = need == 0 or self._inode_free()
            return inode and self._used + self._reserved + need <= self._limit

        if fits() or (self._medium_freed() and fits()):
            return True
        if self._limit < self._capacity and need > self._room_with_nothing_held():
            return False  # more than the medium would hold with the whole tier evicted: evict nothing for it
        if self._purge_expired():
            self._medium_freed()  # (the expired blocks' extents may have gone whole: see the loop)
        victims = self._policy.victims()
        skipped_for_inode = False
        while not fits():
            key = next(victims, None)
            if key is None and skipped_for_inode and not self._inodes_short:
                # an inode is free now, the bytes still short: the victims skipped for no inode count again
                victims, skipped_for_inode = self._policy.victims(), False
                continue
            if key is None:
                return self._medium_freed() and fits()  # (another process may have freed room meanwhile)
            extent = self._index[key].extent
            if need == 0 or not self._inodes_short:
                self._evict(key)
            elif not self._frees_inode(extent):
                self._policy.on_access(key)  # evicting it frees no inode: the next victim
                skipped_for_inode = True
            elif self._evict(key) and extent is not None:
                self._evict_mates(extent)
            if extent is not None and self._extents.get(extent.rel) is not extent:
                # its last block went, and with it (where no other name links to it) its table page,
                # which used_bytes never counted: only statvfs shows that room, else a block more is
                # evicted for it (and left free, unused)
                self._medium_freed()
        return True

    def _frees_inode(self, extent: Extent | None) -> bool:
        """Whether evicting a victim in ``extent`` (None: a block file of its own) frees an inode: a
        packed block's name is a link, so only with its whole extent, which can go only with no
        block of it pinned and no name linked to it but the extent's own and those indexed here
        (another process sharing the directory may index others). An extent from before tables
        (its names symbolic links) is left to a restart: none."""
        if extent is None:
            return True
        if extent.ino is None or any((entry := self._index.get(key)) is not None and entry.extent is extent
                                     for key in self._pins):
            return False
        try:
            st = os.lstat(os.path.join(self.path, extent.rel))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_ino == extent.ino and st.st_nlink == extent.live + 1

    def _evict(self, key: BlockKey) -> bool:
        """Evict a victim (under the lock); whether it went. A pinned one stays, and so does one the
        file system refuses to remove (withheld: see :meth:`delete`), each touched so that the policy
        offers the next; a withheld one met again (deleted already) has its removal retried, its
        bytes never demoted."""
        if key in self._pins:
            self._policy.on_access(key)
            return False
        withheld = key in self._withheld
        if not withheld and self.on_evict is not None:
            self._demote(key)
        if self._remove(key) is not None:
            self._policy.on_access(key)
            return False
        if withheld:
            self.stats.deletes += 1
        else:
            self.stats.evictions += 1
        return True

    def _evict_mates(self, extent: Extent) -> None:
        """While no inode is free, after a victim packed in ``extent`` (one :meth:`_frees_inode`
        judged free to go whole): evict the extent's other blocks indexed here, until an inode is
        free. A packed block's name is a link, not an inode: the extent's inode goes only with its
        last block, so victims taken one by one in the policy's order, a block of each of many
        extents, would free none. (A ``put_many``'s blocks are mostly one span of a chain, which
        the policy takes together anyway; a child of one of them packed elsewhere stays, a root
        now, as after a delete.)"""
        for key in self._mates(extent):
            if self._inode_free():
                return
            self._evict(key)

    def _mates(self, extent: Extent) -> list[BlockKey]:
        """The blocks of ``extent`` indexed here, as its table lists them (one read); none where the
        table cannot be read or the extent has none (from before tables)."""
        if extent.ino is None or extent.live == 0 or self._extents.get(extent.rel) is not extent:
            return []
        try:
            fd = direct_io.open_regular(os.path.join(self.path, extent.rel))
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            table = disk_extents.read_table(fd, st.st_size) if st.st_ino == extent.ino else None
        except OSError:
            table = None
        finally:
            os.close(fd)
        if table is None:
            return []
        return [key for key in table.blocks
                if (entry := self._index.get(key)) is not None and entry.extent is extent]

    def _medium_full(self, quota: bool) -> None:
        """A write found no room on the file system before ``capacity_bytes`` was reached: other
        writers share it, or it holds less than that. The medium is the limit from now on: what
        this tier holds, with the bytes puts in flight wrote already, plus the bytes the file
        system has left (statvfs; none for a spent quota, EDQUOT, which statvfs does not show), so
        that puts evict the policy's victims to make room, as at capacity, instead of failing one
        after another. A full file system's limit rises again as it frees space
        (:meth:`_medium_freed`); a quota's holds until the tier is reopened. A put in flight is
        counted whole in ``_reserved`` by :meth:`_make_room`; the part of it already written
        (``_landed``: the write returned, the fsync, most of a put's time, under way) is missing
        from the room statvfs shows, so the limit counts it back: else it would be counted twice
        (a put that fits once a block is evicted evicted it and was refused FULL all the same),
        and a reservation not yet written is counted once (the room still holds it). Where no
        inode is free (an ext4 full of others' small files, a tmpfs with ``nr_inodes``), a put
        evicts until one is (:meth:`_inode_free`), whatever the bytes say."""
        before = self._limit
        space = self._medium_space()
        self._quota_limited = quota
        self._inodes_short = space.no_inode
        self._limit = min(self._capacity, self._used + self._landed + (0 if quota else space.free))
        if before == self._capacity > self._limit:
            log.warning("disk tier %s: no room on the file system (%s) with %d of capacity_bytes %d used "
                        "here; evicting to make room (pass a capacity_bytes the file system holds)",
                        self.path, "quota spent" if quota else "full", self._used, self._capacity)
        if space.no_inode and not self._inodes_warned:
            self._inodes_warned = True
            log.warning("disk tier %s: no free inode on the file system (%d bytes free); evicting to "
                        "free one for each new file (give the tier a file system with inodes to spare)",
                        self.path, space.free)

    def _medium_known_for(self, need: int) -> None:
        """Before a write that cannot be made again (a stream, read once) of ``need`` bytes: the
        tier does not know whether the file system has room for it, neither while the limit is
        still ``capacity_bytes`` (a fresh open or a restart on a full disk, no write has found it
        full yet, or :meth:`_medium_freed` rose back there) nor under a limit the medium set
        (counted since by this tier's own writes and removals: another process on a shared file
        system may have taken the room this tier freed). A stream that finds no room is refused
        FULL where evicting would have made it (a plain put is written again). So statvfs is asked
        (one call per stream): where it shows less room than the write and the reservations not
        yet written need, or no free inode, the medium is the limit from now, as the write's ENOSPC
        would have set it (:meth:`_medium_full`), and :meth:`_make_room` then evicts for it. A
        spent quota does not show there: its EDQUOT still refuses the stream (then the limit is
        exact)."""
        if self._quota_limited:
            return  # statvfs does not show a quota: the limit it set stays
        space = self._statvfs()
        if space is not None and (space.no_inode or space.free < need + self._reserved - self._landed):
            self._medium_full(quota=False)

    def _medium_freed(self) -> bool:
        """Whether the limit :meth:`_medium_full` lowered for a full file system rose again, to what
        this tier holds (with the bytes of puts in flight written already) plus the bytes the file
        system has free now (someone freed some), at most ``capacity_bytes``. Puts under way may
        take some of that room first: a write that then finds no room lowers the limit again."""
        if self._limit >= self._capacity or self._quota_limited:
            return False
        limit = min(self._capacity, self._used + self._landed + self._medium_space().free)
        if limit <= self._limit:
            return False
        self._limit = limit
        return True

    def _room_with_nothing_held(self) -> int:
        """The most bytes the medium would let this tier hold with every block of it evicted (asked
        under a limit :meth:`_medium_full` set): under a spent quota, the limit itself (all that is
        known of a quota: statvfs does not show it, so its free bytes are the disk's, not ours);
        else what the tier holds, its extents' table pages (freed with their last blocks, though
        used_bytes leaves them out) and what the file system has free. At most: an extent another
        process also links to keeps its table, so a put within this may still evict and fail."""
        if self._quota_limited:
            return self._limit
        return self._used + sum(self._tables.values()) + self._medium_space().free

    def _inode_free(self) -> bool:
        """Whether a new file would get an inode: yes, unless a write found none; then statvfs
        tells (one call), and the first free inode it shows ends the watch (a write that finds
        none again starts it anew)."""
        if self._inodes_short and not self._medium_space().no_inode:
            self._inodes_short = False
        return not self._inodes_short

    def _medium_space(self) -> _Space:
        """What the file system has free for this user (statvfs): nothing where that fails."""
        return self._statvfs() or _Space(0, False)

    def _statvfs(self) -> _Space | None:
        """What the file system has free for this user; None where statvfs fails (no reason to
        think it full)."""
        try:
            fs = os.statvfs(self.path)
        except OSError:
            return None
        return _Space(fs.f_bavail * fs.f_frsize, bool(fs.f_files) and not fs.f_favail)

    def _demote(self, key: BlockKey) -> None:
        """Hand a victim's verified bytes to ``on_evict`` (read into memory of their own: a mapping
        of the file would kill the process with SIGBUS where the file shrank under it, which a
        process sharing the directory or an NFS server may do, and eviction is rare enough for
        one copy)."""
        entry = self._index[key]
        try:
            fd = direct_io.open_regular(self._file_of(key, entry))
        except OSError:
            return  # gone, unreadable or no file of ours: nothing to demote
        try:
            size = os.fstat(fd).st_size - entry.offset
            if entry.extent is not None:
                size = min(size, entry.size)
            if not _plausible(size):
                return
            block = np.empty(size, np.uint8)
            if os.preadv(fd, [block], entry.offset) != size:
                return  # shrank since the fstat: nothing whole to demote
        except OSError:
            return
        finally:
            os.close(fd)
        page = block[:PAGE].tobytes()
        header = unpack_header(page)
        if (header is None or header.key != key or size != PAGE + round_up(header.payload_nbytes)
                or _record_in(page, header, key) is None):
            self.stats.verify_failures += 1
            return
        payload = memoryview(block)[PAGE : PAGE + header.payload_nbytes]
        if xxhash.xxh3_128_digest(payload) != header.checksum:
            self.stats.verify_failures += 1
            return
        meta = BlockMeta(header.dtype, header.shape, header.token_count)
        try:
            self.on_evict(key, payload.toreadonly(), meta)
        except Exception:  # noqa: BLE001 - a failed demotion only loses a cached block
            self.stats.errors += 1
            log.exception("disk tier %s: on_evict failed for %s", self.path, key.hex())

    def _purge_expired(self) -> int:
        """Remove the expired blocks, taken from the age queue, not the index's leading run: blocks
        arrive out of age order (ages carried in by puts, blocks adopted from other processes), and
        an expired block behind a young one would stay, counted, until evicted. Pinned ones stay
        queued; withheld ones are retried by :meth:`expire` and look-ups."""
        if self._ages is None:
            return 0
        doomed, pinned = [], []
        for key, entry in self._ages.due(time.time() - self._ttl_s):
            if self._index.get(key) is not entry or key in self._withheld:
                continue  # gone (or indexed anew: queued again then)
            (pinned if key in self._pins else doomed).append((key, entry))
        for key, entry in pinned:
            self._ages.push(entry.created, key, entry, held=len(self._index))
        removed = sum(self._remove(key) is None for key, _ in doomed)
        self.stats.expirations += removed
        return removed

    def _remove(self, key: BlockKey) -> OSError | None:
        """Unindex a block and remove its bytes: its file, or its name and its place in its extent
        (the whole extent when no other name links to it). None once done; the error where the
        file system refused to remove a name: the block then stays indexed, *withheld* (see
        :meth:`delete`), and the next call retries. An erasure in place that fails once the name
        is gone is only logged: nothing reaches those bytes, still counted until the extent goes."""
        entry = self._index[key]
        whole = False
        try:
            if entry.extent is not None and self._last_name(key, entry):
                whole = self._remove_last_name(key, entry.extent)
            else:
                _unlink_name(self.path_of(key))
        except OSError as exc:
            if key not in self._withheld:
                self._withheld.add(key)
                self._policy.on_access(key)  # (eviction order: not the first victim again at once)
            return exc
        self._withheld.discard(key)
        freed = entry.extent is not None and (whole or self._erase(key, entry))
        self._forget(key)
        if freed:  # (an extent no longer counted here took its dead bytes along: nothing to revive)
            self._revive(entry.extent, entry.offset, entry.size)
        return None

    def _remove_last_name(self, key: BlockKey, extent: Extent) -> bool:
        """Remove the last block name of ``extent`` and the extent (True if its own name went with
        it; False: only the block's name went, its place to be erased). The name is first renamed to
        a temp name of this process: a crash at any point leaves a dead writer's temp file, which a
        restart's scan reaps by its name (reading nothing), and an extent no block reaches, which it
        reclaims. Unlinked in place, a crash between the two unlinks left the block's name as the
        only link to the whole extent, a file a restart took for a block and whose first read
        counted a corrupt block (s33 CI); recognising that at restart cost a page read per block
        file (audit s33 r11 D1). A rename the file system refuses for want of room unlinks in
        place (:meth:`_unlink_last_name_in_place`); a name another process linked to the extent
        meanwhile keeps it (:meth:`_keep_extent_named`)."""
        name = self.path_of(key)
        parked = os.path.join(os.path.dirname(name), f".{key.hex()}.{direct_io.temp_tag()}{TEMP_SUFFIX}")
        own = os.path.join(self.path, extent.rel)
        try:
            os.rename(name, parked)
        except FileNotFoundError:
            parked = None  # removed already (another process sharing the directory)
        except OSError as exc:
            if exc.errno not in _PARK_REFUSED:
                raise
            return self._unlink_last_name_in_place(name, extent)
        try:
            whole = _unlink_name(own)
        except OSError:
            if parked is not None:  # refused: the block stays whole under its name, withheld, and
                os.rename(parked, name)  # the retry takes this path again (audit s33 r12 D1)
            raise
        if parked is not None:
            if self._keep_extent_named(parked, own, extent):
                whole = False
            try:
                _unlink_name(parked)
            except OSError as exc:  # the name is gone already; a later scan reaps the temp
                log.warning("disk tier %s: parked name %s not removed: %s", self.path, parked, exc)
        return whole

    def _unlink_last_name_in_place(self, name: str, extent: Extent) -> bool:
        """Remove a last block name that could not be parked (ENOSPC, EDQUOT: a rename to the longer
        temp name may need a new directory block, which a full file system or a spent quota
        refuses where an unlink never does; EMLINK): the block's name, then the extent's own name
        where no other name links to it (True). A crash between the two leaves an extent no block
        reaches, which a restart reclaims; on a full disk, eviction has to free room."""
        _unlink_name(name)  # (a refusal raises: the block is withheld, as any refused removal)
        return self._unlink_unnamed_extent(extent)

    def _keep_extent_named(self, parked: str, own: str, extent: Extent) -> bool:
        """After the extent's own name was unlinked: whether a name other than ``parked`` still links
        to the extent, which then keeps (gets back) its own name, so that no block's name is left
        the only link to a whole extent (a MISS to its writer, a "corrupt" block after a restart).
        Another process may have linked a block's name to it after :meth:`_last_name` judged
        ``parked`` its last: its writer links from the extent's own name, so such a name was made
        before the unlink, and the link count shows it now (the writer checks that name after
        linking: ``DiskWrites._link_checked``)."""
        try:
            linked = os.lstat(parked)
        except OSError:
            return False
        if linked.st_ino != extent.ino or linked.st_nlink < 2:
            return False
        try:
            os.link(parked, own)
        except FileExistsError:
            pass  # named again already (the other name's writer, or another remover, restored it)
        except OSError as exc:
            log.warning("disk tier %s: extent %s lost its own name while other names link to it: %s",
                        self.path, extent.rel, exc)
        return True

    def _last_name(self, key: BlockKey, entry: _Entry) -> bool:
        """Whether ``key``'s name is the only one still linked to its extent (the extent's own name
        and this one: two links), the extent's only block indexed here."""
        extent = entry.extent
        if extent.ino is None or extent.live != 1:
            return False
        try:
            own = os.lstat(os.path.join(self.path, extent.rel))
            name = os.lstat(self.path_of(key))
        except OSError:
            return False
        return (stat.S_ISREG(own.st_mode) and own.st_ino == extent.ino == name.st_ino
                and own.st_dev == name.st_dev and own.st_nlink == 2)

    def _erase(self, key: BlockKey, entry: _Entry) -> bool:
        """Erase a packed block in its extent (the last one indexed here too: other processes may
        hold the extent's other blocks); whether its space is free again."""
        extent = entry.extent
        try:
            # None: its name (or table entry) led to a place that is not exactly a block of this key,
            # as tampering can: those bytes may be another block's, not ours to erase
            return bool(disk_extents.erase_block(os.path.join(self.path, extent.rel), extent.rel, entry.offset,
                                                 entry.size, key, entry.index if entry.index >= 0 else None,
                                                 extent.ino))
        except (FileNotFoundError, direct_io.NotAFile):
            return False  # the extent is gone (its bytes with it), or what is at its name is not ours
        except OSError as exc:
            log.warning("disk tier %s: cannot erase %s in %s: %s", self.path, key.hex(), extent.rel, exc)
            return False

    def _forget(self, key: BlockKey) -> _Entry | None:
        """Unindex a block (its bytes left where they are: a packed block's still count until
        erased, or until no block indexed here is in its extent)."""
        entry = self._index.pop(key, None)
        self._withheld.discard(key)
        if entry is not None:
            self._used -= entry.size
            self._policy.on_remove(key)
            extent = entry.extent
            if extent is not None:
                extent.live -= 1
                extent.dead += entry.size
                self._used += entry.size
                if extent.live == 0:
                    self._drop_extent(extent)
                else:
                    self._forgotten.setdefault(extent.rel, {})[entry.offset] = entry.size
        return entry

    def _revive(self, extent: Extent, offset: int, size: int) -> None:
        """A place :meth:`_forget` counted dead is no longer dead: indexed again (a name reaches it
        once more) or erased. Its bytes leave the dead count (once); any other place: nothing."""
        places = self._forgotten.get(extent.rel)
        if places is None or places.get(offset) != size or self._extents.get(extent.rel) is not extent:
            return
        del places[offset]
        if not places:
            del self._forgotten[extent.rel]
        extent.dead -= size
        self._used -= size

    def _drop_extent(self, extent: Extent) -> None:
        """Stop counting an extent no indexed block is in, and remove it once no block's name links
        to it: other processes may index blocks of it that this one never did (each name is a hard
        link, so the extent's link count tells). An extent from before tables (symbolic links, which
        the count does not show) is left to a restart, which removes it when no link reaches it."""
        if self._extents.get(extent.rel) is extent:  # (never another object counted at its name)
            del self._extents[extent.rel]
            self._forgotten.pop(extent.rel, None)
            self._tables.pop(extent.rel, None)
        self._used -= extent.dead
        extent.dead = 0
        if extent.ino is not None:
            self._unlink_unnamed_extent(extent)

    def _unlink_unnamed_extent(self, extent: Extent) -> bool:
        """Unlink ``extent``'s own name if no block's name links to it any more (its link count 1);
        whether it went (a refusal is logged: a restart reclaims an extent no name reaches)."""
        path = os.path.join(self.path, extent.rel)
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_ino == extent.ino and st.st_nlink == 1 and _unlink(path)

    def _holds_exactly(self, key: BlockKey, entry: _Entry, read: os.stat_result | None = None) -> bool:
        """Whether ``key``'s name still holds the very block ``entry`` indexed (and, given ``read``, the
        fstat of the file a failed read of ``entry`` opened, the very file read): asked before a
        name is removed for a block that vanished or failed verification (under the lock, on those
        paths only: one open and one page read). An inode number alone does not tell, since a file
        system hands a freed one out again (ext4 at once): another process may have removed the
        indexed extent and packed the key again in a new extent that got its number, or replaced a
        block file of its own with a link into an extent. So a packed block's name must be the
        indexed extent by its table (which names the extent, a name no other extent has); a block
        file of its own must be no extent of the directory (:meth:`_is_extent`) and be the file read,
        unchanged (same device, inode, ctime and size; whichever process put it there: a bad file
        at the name is bad for every reader), else the indexed inode. A symbolic link names its
        place itself."""
        extent = entry.extent
        if extent is not None and extent.ino is None:
            return self._holds(key, entry)
        try:
            fd = direct_io.open_regular(self.path_of(key))
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            table = disk_extents.read_table(fd, st.st_size)
            first_page = os.pread(fd, PAGE, 0) if table is None and extent is not None else b""
        except OSError:
            return False
        finally:
            os.close(fd)
        if extent is None:  # read by its name: what the name holds is what is judged, unless an extent
            return (not self._is_extent(table, st)
                    and (_same_file(st, read) if read is not None else entry.ino in (None, st.st_ino)))
        # an extent's ctime moves with every name linked or unlinked: its table tells it instead.
        # One whose table is unreadable (damaged) is the indexed extent only if it cannot be a block
        # file of its own: another process may have stored the key again as one, and the file
        # system handed it the freed extent's number (a block file has no table, a header instead)
        named = table.rel == extent.rel if table is not None else unpack_header(first_page) is None
        return (st.st_ino == extent.ino and named
                and (read is None or (st.st_dev, st.st_ino) == (read.st_dev, read.st_ino)))

    def _is_extent(self, table: disk_extents.Table | None, st: os.stat_result) -> bool:
        """Whether a file (``st``, ``table``: its table or None) is an extent of this directory, its
        own name still that same file: another process's blocks, never a damaged block file. One
        its own name no longer reaches (a remover, or a writer, killed halfway) is only the name's."""
        if table is None or not disk_extents.is_extent_rel(table.rel):
            return False
        try:
            own = os.lstat(os.path.join(self.path, table.rel))
        except OSError:
            return False
        return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)

    def _holds(self, key: BlockKey, entry: _Entry) -> bool:
        """Whether ``key``'s name still holds the block ``entry`` describes (one lstat, or one
        readlink; no lock needed): a file of its own is a regular file of the entry's size (and
        inode, where known); a packed block's name links to the indexed extent. An inode number the
        file system gave a new extent of the key once the indexed one was gone passes: the entry
        then stays, stale but harmless (the name does hold the block, and a read of the entry finds
        its extent gone and reads it there); nothing is removed on this check alone."""
        path = self.path_of(key)
        try:
            if entry.extent is None:
                st = os.lstat(path)
                return (stat.S_ISREG(st.st_mode) and st.st_size == entry.size
                        and entry.ino in (None, st.st_ino))
            if entry.extent.ino is not None:  # a hard link: the same extent (its place is fixed in it)
                st = os.lstat(path)
                return stat.S_ISREG(st.st_mode) and st.st_ino == entry.extent.ino
            target = os.readlink(path)
        except OSError:
            return False
        # the place the target names, as adoption reads it (not its spelling: "@04096" is "@4096")
        return disk_extents.parse_link(target) == (entry.extent.rel, entry.offset, entry.size)

    def _drop_stale(self, keys) -> None:
        """Forget the indexed blocks among ``keys`` whose name no longer holds what the index says
        (another process sharing the directory removed or replaced them): one lstat per indexed key,
        outside the lock, so a batch never holds it across its stats (a slow mount's round trips).
        Their bytes are another process's business now (a packed one's place counts as dead until
        its extent goes); a later look adopts whatever the name holds then. Withheld blocks are left
        to :meth:`_live` (which retries their removal)."""
        with self._lock:
            held = [(key, entry) for key in dict.fromkeys(keys)
                    if (entry := self._index.get(key)) is not None and key not in self._withheld]
        gone = [(key, entry) for key, entry in held if not self._holds(key, entry)]
        if gone:
            with self._lock:
                for key, entry in gone:
                    if self._index.get(key) is entry:  # (not published or removed again meanwhile)
                        self._forget(key)

    def _discard(self, key: BlockKey, entry: _Entry) -> None:
        """Drop a block that failed verification (``entry``, still indexed, its name confirmed by
        :meth:`_holds_exactly` to hold the very file read: checked by the caller): a packed block is
        erased from its extent, which stays while other blocks' names link to it; a file of its own
        is unlinked."""
        if entry.extent is not None:
            self._remove(key)
            return
        self._forget(key)
        _unlink(self.path_of(key))

    def _recover(self) -> None:
        """Index every published block under ``path`` (files of their own, and links into extents);
        remove dead writers' temp files, broken links and extents no link reaches. Only this
        directory's own entries are looked at: a shard that is a link elsewhere, a file not named
        as this tier names files, or something other than a file at an extent's name is left alone.
        Another process may be publishing meanwhile: an extent no name reaches yet, or a name
        whose extent the scan passed before it was renamed in, is judged only once older than
        :data:`STALE_TEMP_S` (as a temp file), or, for the extent, once its writer is known dead
        (:func:`~kvtier.tiers.disk_extents.writer_gone`). A shard this user cannot list is a
        :class:`TierError` that names it."""
        now = time.time()
        # (mtime, key, size, place in an extent or None, inode of a file of its own or None)
        found: list[tuple[float, BlockKey, int, tuple[str, int, int] | None, int | None]] = []
        links: list[tuple[float, BlockKey, str]] = []
        named: list[tuple[os.stat_result, BlockKey, str]] = []
        extents: dict[str, os.stat_result] = {}
        for shard in _listed(self.path):
            if shard.name.endswith(TEMP_SUFFIX):
                _reap_temp(shard, now)  # a dead prober's
            if not (shard.is_dir(follow_symlinks=False) and len(shard.name) == 2 and _is_hex(shard.name)):
                continue
            for item in _listed(shard.path):
                if item.name.endswith(TEMP_SUFFIX):
                    _reap_temp(item, now)
                    continue
                if disk_extents.is_extent_name(item.name):
                    try:
                        st = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        extents[f"{shard.name}/{item.name}"] = st
                    continue
                stem = item.name[: -len(SUFFIX)]
                if not item.name.endswith(SUFFIX) or len(stem) != 2 * KEY_BYTES or not _is_hex(stem):
                    continue  # not ours: leave it alone
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = BlockKey(bytes.fromhex(stem))
                if stat.S_ISLNK(st.st_mode):
                    links.append((st.st_mtime, key, item.path))
                elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    named.append((st, key, item.path))  # a hard link to an extent (found by its table below)
                elif stat.S_ISREG(st.st_mode):
                    self._scanned_file(found, st, key, item.path, now)
        live: dict[str, int] = {}
        for mtime, key, path in links:
            try:
                place = disk_extents.parse_link(os.readlink(path))
            except OSError:
                continue
            inode = extents.get(place[0]) if place is not None else None
            if inode is None or place[1] + place[2] > inode.st_size:
                self.stats.verify_failures += 1  # a link to nothing (or past its extent's end)
                _unlink(path)
            elif self._expired(mtime, now):
                self.stats.expirations += 1
                _unlink(path)  # its bytes are counted below as dead until its extent goes
            else:
                found.append((mtime, key, place[2], (place[0], place[1], -1), None))
                live[place[0]] = live.get(place[0], 0) + place[2]
        tables = self._tables_of(extents, {(st.st_ino, st.st_dev) for st, _, _ in named})
        for st, key, path in named:
            rel, table = tables.get((st.st_ino, st.st_dev), (None, None))
            if rel is None:  # no extent the scan found
                try:
                    behind = self._table_behind(path, st)
                except OSError:
                    continue  # gone or replaced meanwhile
                if behind is None:  # a block file of its own with another name too (a hard-link snapshot)
                    self._scanned_file(found, st, key, path, now)
                    continue
                if now - st.st_mtime <= STALE_TEMP_S:
                    continue  # its extent may have been renamed in after the scan passed it: a later look finds it
            where = table.blocks.get(key) if table is not None else None
            if where is None and rel is not None and not self._still_links(path, st, rel):
                continue  # the name holds another file now: its number was the extent's only by reuse
            if where is None:
                self.stats.verify_failures += 1  # its extent is gone, or its table does not list it
                _unlink(path)
            elif self._expired(st.st_mtime, now):
                self.stats.expirations += 1
                _unlink(path)
            else:
                index, offset, length = where
                found.append((st.st_mtime, key, length, (rel, offset, index), None))
                live[rel] = live.get(rel, 0) + length
        table_bytes = {rel: table.nbytes for rel, table in tables.values() if table is not None}
        for rel, inode in extents.items():
            if rel not in live:
                # no block reaches it: a writer died before linking (or a remover before unlinking it)
                if now - inode.st_mtime > STALE_TEMP_S or disk_extents.writer_gone(rel.partition("/")[2]):
                    _unlink(os.path.join(self.path, rel))
                # else: its writer is alive (or on another host) and may be linking its names now:
                # its space is its own to count
            else:
                ino = inode.st_ino if rel in table_bytes else None
                self._extent(rel, ino, table_bytes.get(rel, 0)).dead = max(
                    0, disk_extents.allocated_bytes(os.path.join(self.path, rel), inode)
                    - live[rel] - table_bytes.get(rel, 0))
                self._used += self._extents[rel].dead
        found.sort(key=lambda item: (item[0], item[1]))
        # LRU ignores parent links: do not read a page per block for nothing.
        parents = (self._recorded_parents([(k, p) for _, k, _, p, _ in found])
                   if not isinstance(self._policy, LRUPolicy) else {})
        for mtime, key, size, place, ino in _parents_first(found, parents):
            if place is None:
                entry = _Entry(size, mtime, ino=ino)
            else:
                entry = _Entry(size, mtime, self._extent(place[0]), place[1], place[2])
            self._index_block(key, entry, parents.get(key))
        self._make_room(0)

    def _scanned_file(self, found: list, st: os.stat_result, key: BlockKey, path: str, now: float) -> None:
        """A block file of its own the restart scan met: to be indexed (into ``found``), or removed
        if it cannot be a block or has expired."""
        if not _plausible(st.st_size):
            self.stats.verify_failures += 1
            _unlink(path)
        elif self._expired(st.st_mtime, now):
            self.stats.expirations += 1
            _unlink(path)
        else:
            found.append((st.st_mtime, key, st.st_size, None, st.st_ino))

    def _tables_of(self, extents: dict[str, os.stat_result], wanted: set[tuple[int, int]]) -> dict:
        """``(inode, device) -> (rel, table)`` for the extents some name links to (one read each);
        the table None where the extent has none or it names another file."""
        out: dict[tuple[int, int], tuple[str, disk_extents.Table | None]] = {}
        for rel, inode in extents.items():
            ident = (inode.st_ino, inode.st_dev)
            if ident not in wanted:
                continue
            try:
                fd = direct_io.open_regular(os.path.join(self.path, rel))
            except OSError:
                continue
            try:
                now = os.fstat(fd)
                same = (now.st_ino, now.st_dev) == ident  # not replaced since the scan
                table = disk_extents.read_table(fd, inode.st_size) if same else None
            finally:
                os.close(fd)
            if not same:
                continue
            out[ident] = (rel, table if table is not None and table.rel == rel else None)
        return out

    def _recorded_parents(self, blocks: list[tuple[BlockKey, tuple[str, int] | None]]) -> dict[BlockKey, BlockKey]:
        """key → recorded parent, for the blocks whose header page records one (unverified
        pages are left to the read that verifies them: a wrong link only orders eviction)."""
        out: dict[BlockKey, BlockKey] = {}
        for key, place in blocks:
            path, base = (self.path_of(key), 0) if place is None else (os.path.join(self.path, place[0]), place[1])
            try:
                fd = direct_io.open_regular(path)
            except OSError:
                continue
            try:
                page = os.pread(fd, PAGE, base)
            except OSError:
                continue
            finally:
                os.close(fd)
            header = unpack_header(page)
            record = _record_in(page, header, key) if header is not None and header.key == key else None
            if record is not None and record.parent is not None:
                out[key] = BlockKey(record.parent)
        return out


class _Space(NamedTuple):
    """A file system's free room, as statvfs shows it."""

    free: int  #: bytes free for this user
    #: no inode free for a new file (bytes are no room then; never on a file system that shows no
    #: inode count, ``f_files`` 0: btrfs, some network mounts)
    no_inode: bool


def _parents_first(found: list[tuple], parents: dict[BlockKey, BlockKey]):
    """``found`` in its order, except that a block's recorded ancestors (when found) come first,
    so that a policy that links children to known parents sees every chain."""
    by_key = {key: item for item in found for key in (item[1],)}
    done: set[BlockKey] = set()
    for item in found:
        chain = []
        key = item[1]
        while key in by_key and key not in done:
            done.add(key)
            chain.append(by_key[key])
            key = parents.get(key)
        yield from reversed(chain)


def _make_tier_dirs(path: str) -> None:
    """``path`` and its 256 shard directories (0700), missing ones made. A shard a full file system
    has no room for (ENOSPC, EDQUOT) is left to the first write into it, which makes it."""
    try:
        make_private_dirs(path)
        for shard in range(256):
            try:
                make_private_dirs(os.path.join(path, f"{shard:02x}"))
            except OSError as exc:
                if exc.errno not in direct_io.NO_ROOM:
                    raise
    except OSError as exc:
        raise TierError(f"cannot use {path!r} as a disk tier ({exc}); pass a writable directory") from exc


def _uses_direct_io(path: str, wanted: bool | str) -> bool:
    """Whether the tier in ``path`` does its I/O with O_DIRECT (``wanted``: its ``direct_io``; False:
    never, and no probe written). A directory this user cannot write to is refused. A file system
    too full for the probe's page (ENOSPC, EDQUOT) is no reason to refuse the tier: its blocks are
    readable and its puts evict to make room (:meth:`DiskTier._medium_full`); a block file already
    there, read with O_DIRECT, tells then, and with none to read, buffered I/O ("auto"), or
    O_DIRECT as required (True: its writes fail, as ERROR, if the file system refuses it)."""
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierError(f"cannot write in {path!r} (read-only, or not this user's to write); "
                        f"pass a writable directory")
    if wanted is False:
        return False
    try:
        supported = direct_io.probe_direct_io(path)
    except OSError as exc:
        if exc.errno not in direct_io.NO_ROOM:
            raise TierError(f"cannot write in {path!r} ({exc}); pass a writable directory") from exc
        supported = _probe_by_reading(path, exc)
    if wanted is True and supported is False:
        raise TierError(f"{path!r} does not support O_DIRECT; pass direct_io='auto' or False")
    return supported is True or (supported is None and wanted is True)


def _probe_by_reading(path: str, full: OSError) -> bool | None:
    """Whether O_DIRECT works in ``path``, whose file system had no room for the probe (``full``),
    told by reading a block file there; None where none could be read."""
    for file in _block_files(path):
        try:
            supported = direct_io.probe_direct_read(file)
        except OSError:
            continue  # removed meanwhile, or unreadable: another one tells
        log.warning("disk tier %s: no room to probe O_DIRECT (%s); reading a block file says it %s",
                    path, full, "works" if supported else "does not")
        return supported
    log.warning("disk tier %s: no room to probe O_DIRECT (%s) and no block file to read it with; "
                "direct_io='auto' does buffered I/O", path, full)
    return None


def _block_files(path: str) -> Iterator[str]:
    """The block files and extents in the shards of ``path`` (regular files, as named), lazily."""
    for shard in range(256):
        try:
            with os.scandir(os.path.join(path, f"{shard:02x}")) as items:
                for item in items:
                    if (item.name.endswith((SUFFIX, disk_extents.EXTENT_SUFFIX))
                            and item.is_file(follow_symlinks=False)):
                        yield item.path
        except OSError:
            pass  # a shard missing or unreadable: the others tell


def _listed(path: str) -> list[os.DirEntry]:
    """The entries of a directory of the tier; TierError (naming the fix) where it cannot be listed:
    its blocks would be neither found nor counted, nor its dead writers' files removed."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError as exc:
        raise TierError(f"cannot list {path!r} ({exc}); make it readable and searchable by this user "
                        f"(or remove it), or pass another directory") from exc


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two stats are of one file, unchanged between them: its inode number, which a file
    system reuses once the file is gone, with its ctime and size (a new file at the old number was
    made, or renamed in, at another time)."""
    return (a.st_dev, a.st_ino, a.st_ctime_ns, a.st_size) == (b.st_dev, b.st_ino, b.st_ctime_ns, b.st_size)


def _plausible(size: int) -> bool:
    return size >= PAGE and size % PAGE == 0


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _reap_temp(item: os.DirEntry, now: float) -> None:
    try:
        if direct_io.stale_temp(item.name, item.stat(follow_symlinks=False).st_mtime, now, STALE_TEMP_S):
            _unlink(item.path)
    except OSError:
        pass  # raced with its writer's rename or another reaper
