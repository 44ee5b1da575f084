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
  temp files of dead writers are removed.
* **Shared directories.** The in-process index is a cache of the directory:
  on an index miss, ``contains``/``get``/``put`` look for the file (one stat),
  so blocks other processes wrote are found; writers of the same key each use
  their own temp file and the renames are atomic.
* **Capacity** counts bytes on disk (header page + padded payload) of the blocks
  this process knows of; eviction asks the policy, skips pinned blocks and
  calls ``on_evict`` with the verified bytes before unlinking.

Thread safety: all methods are; file I/O of gets and puts runs outside the lock
(an unlinked file stays readable through an open descriptor, so a read racing
an eviction still gets whole, verified bytes). Eviction, including the demotion
hook, runs under the lock.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import (
    FLAG_CHECKSUM,
    FLAG_SEALED,
    HEADER_NBYTES,
    BlockHeader,
    BlockMeta,
    header_mismatch,
    pack_header,
    unpack_header,
)
from kvtier.errors import ConfigError, TierError
from kvtier.policy.eviction import EvictionPolicy, LRUPolicy
from kvtier.private_files import make_private_dirs
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.base import Status, Tier
from kvtier.tiers.direct_io import PAGE, BlockIO, ReadJob, ReadOutcome, as_bytes, round_up
from kvtier.tiers.disk_extents import EXTENT_SUFFIX, Extent
from kvtier.tiers.streams import PayloadSink, PayloadSource, PieceReader, SinkFeeder, StreamingTier, Unverifiable

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
#: a temp file older than this is a dead writer's, whatever host wrote it
STALE_TEMP_S = 3600.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

#: Header flag of disk files: a record (parent link, annotation) follows the header.
#: A high bit, apart from the payload-verification flags of :mod:`kvtier.core.payload`.
FLAG_RECORD = 0x100
_RECORD_MAGIC = b"KVR1"
_RECORD = struct.Struct("<4sB3x32sH2x")  # magic, has parent, parent, annotation length
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


class DiskTier(Tier, StreamingTier):
    """Blocks as files under ``path``, at most ``capacity_bytes`` of them on disk.

    ``direct_io``: "auto" probes O_DIRECT at open and falls back to buffered
    I/O; True requires it; False never uses it. ``ttl_s``: blocks older than
    this (since publication) are misses and are removed. ``pack_batches``:
    ``put_many`` of several blocks writes one extent (False: a file per block,
    as every ``put`` and sealed stream does; blocks of both kinds are read).
    """

    name = "disk"

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
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"ttl_s must be positive or None (no expiry), got {ttl_s}")
        if direct_io not in ("auto", True, False):
            raise ConfigError(f"direct_io must be 'auto', True or False, got {direct_io!r}")
        self.path = os.path.abspath(os.fspath(path))
        try:
            make_private_dirs(self.path)
            for shard in range(256):
                make_private_dirs(os.path.join(self.path, f"{shard:02x}"))
        except OSError as exc:
            raise TierError(f"cannot use {self.path!r} as a disk tier ({exc}); pass a writable directory") from exc
        supported = _probe(self.path)
        if direct_io is True and not supported:
            raise TierError(f"{self.path!r} does not support O_DIRECT; pass direct_io='auto' or False")
        self.direct_io = bool(supported and direct_io)
        self._io = BlockIO(self.direct_io)
        self._capacity = capacity_bytes
        self._ttl_s = ttl_s
        self.pack_batches = pack_batches
        self._policy = policy if policy is not None else LRUPolicy()  # an empty policy is falsy
        self._index: dict[BlockKey, _Entry] = {}  # insertion order ~ publication order (for TTL)
        self._extents: dict[str, Extent] = {}  # rel → extent holding indexed blocks
        self._pins: dict[BlockKey, int] = {}
        self._used = 0
        self._reserved = 0  # room promised to puts in flight
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
        with self._lock:
            return self._live(key) is not None

    def get(self, key: BlockKey, out) -> Status:
        """Read a block into ``out`` (caller-owned, writable, exactly the block's size).

        On any status but OK the content of ``out`` is unspecified."""
        dst = as_bytes(out, writable=True)
        return self._get(key, dst.nbytes, lambda fd, base: self._read_verified(fd, base, key, dst))

    def get_streams(self, keys, sinks: list[PayloadSink]) -> list[Status]:
        if len(keys) != len(sinks):
            raise ValueError(f"get_streams: {len(keys)} keys but {len(sinks)} sinks")
        return [self._get(k, s.nbytes, lambda fd, base, k=k, s=s: self._read_into_sink(fd, base, k, s))
                for k, s in zip(keys, sinks)]

    def streams_available(self) -> bool:
        return True

    def get_many(self, keys, outs) -> list[Status]:
        """:meth:`get` of several blocks, read back to back: a run of blocks packed one after
        another in one extent is one request; block (or run) i+1 is read, one request in
        flight, while a helper verifies the ones before. Blocks large enough to be read in
        pieces, and buffers that are not page aligned, go one by one through :meth:`get`."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        dsts = [as_bytes(out, writable=True) for out in outs]  # every caller mistake before any I/O
        statuses = [Status.MISS] * len(keys)
        streamed: list[int] = []
        jobs: list[ReadJob] = []
        for i, (key, dst) in enumerate(zip(keys, dsts)):
            if dst.nbytes >= direct_io.PIECED_MIN or not direct_io.is_page_aligned(dst):
                statuses[i] = self.get(key, dst)
                continue
            entry = self._lookup(key)
            if entry is None:
                continue
            if entry.extent is not None and entry.size != PAGE + round_up(dst.nbytes):
                def read(fd, base, key=key, dst=dst):
                    return self._read_verified(fd, base, key, dst)

                statuses[i] = self._get_found(key, entry, dst.nbytes, read)
                continue
            streamed.append(i)
            jobs.append(ReadJob(self._file_of(key, entry), dst, None if entry.extent is None else entry.offset))

        def judge(j: int, got: ReadOutcome) -> None:
            i = streamed[j]
            statuses[i] = self._judge_read(keys[i], dsts[i], jobs[j], got)

        self._io.read_many(jobs, judge)
        return statuses

    def _judge_read(self, key: BlockKey, dst: np.ndarray, job: ReadJob, got: ReadOutcome) -> Status:
        """A get's status from what :meth:`BlockIO.read_many` read (as :meth:`_get` judges its own read)."""
        if isinstance(got.error, FileNotFoundError):
            return self._vanished(key)
        if got.error is not None:
            return self._failed_get(key, got.error)
        if job.offset is None and got.inode.st_size != PAGE + round_up(dst.nbytes):
            status, why = _judge_size(got.page.tobytes() if got.complete else None, got.inode.st_size, key, dst.nbytes)
        elif not got.complete:
            status, why = Status.CORRUPT, "the file is shorter than its index says (truncated?)"
        else:
            def digest(accept):
                if not accept(got.page):
                    return None
                return xxhash.xxh3_128_digest(dst)

            status, why = self._read_checked(key, dst.nbytes, digest, sealed=False)
        return self._settle(key, dst.nbytes, status, why, job.path, got.inode)

    def _lookup(self, key: BlockKey) -> _Entry | None:
        """The entry of a block a get should read (a miss is counted here)."""
        with self._lock:
            entry = self._live(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._policy.on_access(key)
            return entry

    def _file_of(self, key: BlockKey, entry: _Entry) -> str:
        """The file that holds a block: its own, or its extent."""
        return self.path_of(key) if entry.extent is None else os.path.join(self.path, entry.extent.rel)

    def _vanished(self, key: BlockKey) -> Status:
        """The file went away since we indexed it (another process removed it): a miss."""
        with self._lock:
            self._forget(key)
            self.stats.misses += 1
        return Status.MISS

    def _get(self, key: BlockKey, nbytes: int, read) -> Status:
        """A get of ``nbytes`` whose verified read ``read(fd, base) -> (status, why)`` is the caller's."""
        entry = self._lookup(key)
        if entry is None:
            return Status.MISS
        return self._get_found(key, entry, nbytes, read)

    def _get_found(self, key: BlockKey, entry: _Entry, nbytes: int, read) -> Status:
        path = self._file_of(key, entry)
        packed = entry.extent is not None
        try:
            fd = self._io.open_read(path)
        except FileNotFoundError:  # removed by another process since we indexed it
            return self._vanished(key)
        except OSError as exc:
            return self._failed_get(key, exc)
        try:
            inode = os.fstat(fd)
            want = PAGE + round_up(nbytes)
            if packed and inode.st_size < entry.offset + entry.size:
                status, why = Status.CORRUPT, "the extent is shorter than its index says (truncated?)"
            elif packed and entry.size != want:
                status, why = _judge_size(self._io.read_header_page(fd, entry.offset), entry.size, key, nbytes)
            elif not packed and inode.st_size != want:
                status, why = self._size_mismatch(fd, key, nbytes)
            else:
                status, why = read(fd, entry.offset)
        except OSError as exc:
            return self._failed_get(key, exc)
        finally:
            os.close(fd)
        return self._settle(key, nbytes, status, why, path, inode)

    def _settle(self, key: BlockKey, nbytes: int, status: Status, why: str, path: str,
                inode: os.stat_result) -> Status:
        """Count a judged read; a block that failed verification is removed."""
        with self._lock:
            if status is Status.OK:
                self.stats.hits += 1
                self.stats.bytes_read += nbytes
            elif status in (Status.BAD_SIZE, Status.MISS):
                self.stats.misses += 1
            elif not self._still_there(key):
                self._forget(key)  # another process removed (and erased) it meanwhile: a plain miss
                self.stats.misses += 1
                return Status.MISS
            else:
                self.stats.verify_failures += 1
                log.warning("disk tier %s: block %s failed verification (%s); removed", self.path, key.hex(), why)
                self._discard(key, path, inode)
        return status

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None) -> Status:
        """Write a copy of ``data`` durably (fsync'd before it becomes visible).

        ``data`` stays the caller's and is not retained; a page-aligned buffer
        is written without a copy."""
        _check_key(key)
        src = as_bytes(data)

        def write(fd: int, record: bytes) -> None:
            self._io.write(fd, src, lambda digest: pack_header(
                key, src.nbytes, digest, meta, flags=FLAG_CHECKSUM | FLAG_RECORD) + record)

        return self._put(key, src.nbytes, parent, write)

    def put_many(self, keys, datas, *, parents=None, metas=None) -> list[Status]:
        """:meth:`put` of several blocks (a chain unless ``parents`` says otherwise), packed in one
        extent file, fsync'd once, each block then linked under its own name (see
        :mod:`kvtier.tiers.disk_extents`). A batch that does not fit whole goes block by block."""
        if len(keys) != len(datas):
            raise ValueError(f"put_many: {len(keys)} keys but {len(datas)} buffers")
        if parents is None:
            parents = [None, *keys[:-1]]
        metas = metas or [None] * len(keys)
        for key in keys:
            _check_key(key)
        srcs = [as_bytes(d) for d in datas]
        statuses: list[Status | None] = [None] * len(keys)
        first_of: dict[BlockKey, int] = {}
        with self._lock:
            for i, key in enumerate(keys):
                if key in first_of:
                    continue  # a repeat in the batch: the first one's status
                first_of[key] = i
                if self._live(key) is not None:
                    self._policy.on_access(key)  # content addressed: the same bytes are there
                    statuses[i] = Status.OK
        todo = [i for i in first_of.values() if statuses[i] is None]
        if len(todo) >= 2 and self.pack_batches:
            self._put_packed(keys, srcs, parents, metas, todo, statuses)
        for i in todo:
            if statuses[i] is None:  # the batch did not fit whole: one by one (each makes room)
                statuses[i] = self.put(keys[i], srcs[i], parent=parents[i], meta=metas[i])
        return [statuses[first_of[key]] for key in keys]

    def _put_packed(self, keys, srcs, parents, metas, todo: list[int], statuses: list) -> None:
        """Publish blocks ``todo`` in one extent; sets their statuses (None: not attempted, too big)."""
        records = {}
        for i in todo:
            record = self._record_of(keys[i], parents[i])
            if record is None:
                statuses[i] = Status.ERROR
                with self._lock:
                    self.stats.put_failures += 1
                continue
            records[i] = record
        todo = [i for i in todo if i in records]
        sizes = {i: PAGE + round_up(srcs[i].nbytes) for i in todo}
        for i in todo:
            if sizes[i] > self._capacity:
                statuses[i] = Status.TOO_LARGE
                with self._lock:
                    self.stats.put_failures += 1
        todo = [i for i in todo if statuses[i] is None]
        need = sum(sizes[i] for i in todo)
        if len(todo) < 2:
            return
        with self._lock:
            if need > self._capacity or not self._make_room(need):
                return  # block by block: what fits, fits
            self._reserved += need
        stem = disk_extents.extent_stem(keys[todo[0]])
        rel = f"{stem[:2]}/{stem}{EXTENT_SUFFIX}"
        offsets, off = {}, 0
        for i in todo:
            offsets[i] = off
            off += sizes[i]
        try:
            status = self._write_extent(stem, rel, [(keys[i], srcs[i], metas[i], pack_record(keys[i], records[i]),
                                                      offsets[i]) for i in todo])
            linked = self._link_all(rel, [(keys[i], offsets[i], sizes[i]) for i in todo]) if status is Status.OK else []
        except BaseException:
            with self._lock:
                self._reserved -= need
            raise
        with self._lock:
            self._reserved -= need  # in the same locked step as the index: room is never counted twice or not at all
            if status is not Status.OK:
                for i in todo:
                    statuses[i] = status
                self.stats.put_failures += len(todo)
                self.stats.errors += len(todo) if status is Status.ERROR else 0
                return
            extent = Extent(rel)
            self._extents[rel] = extent
            now = time.time()
            for i, ok in zip(todo, linked):
                key = keys[i]
                if not ok:
                    statuses[i] = Status.ERROR
                    self.stats.put_failures += 1
                    self.stats.errors += 1
                    extent.dead += sizes[i]  # written, unreachable: still on disk until the extent goes
                    self._used += sizes[i]
                    continue
                if key in self._index:  # another thread of ours published it meanwhile: our link replaced it
                    self._forget(key)
                extent.live += 1
                self._index[key] = _Entry(sizes[i], now, extent, offsets[i])
                self._used += sizes[i]
                self._policy.on_insert(key, records[i].parent)
                self.stats.puts += 1
                self.stats.bytes_written += srcs[i].nbytes
                statuses[i] = Status.OK
            if extent.live == 0:
                self._drop_extent(extent)

    def _write_extent(self, stem: str, rel: str, blocks) -> Status:
        """Write ``(key, payload, meta, record bytes, offset)`` blocks into extent ``rel``: temp file,
        one fsync, rename (nothing links into it yet, so a crash leaves no torn block reachable)."""
        final = os.path.join(self.path, rel)

        def write(fd: int) -> None:
            for key, src, meta, record, offset in blocks:
                self._io.write(fd, src, lambda digest, key=key, src=src, meta=meta, record=record: pack_header(
                    key, src.nbytes, digest, meta, flags=FLAG_CHECKSUM | FLAG_RECORD) + record, base=offset, sync=False)
            os.fsync(fd)

        return self._publish(final, stem, write, what=f"extent {stem}")

    def _link_all(self, rel: str, blocks) -> list[bool]:
        """Point each block's name at its place in extent ``rel`` (a temp link renamed onto the
        name: atomic, whatever stood there before); whether each link was made."""
        done = []
        for key, offset, size in blocks:
            final = self.path_of(key)
            temp = os.path.join(os.path.dirname(final), f".{key.hex()}.{direct_io.temp_tag()}{TEMP_SUFFIX}")
            try:
                try:
                    os.symlink(disk_extents.link_target(rel, offset, size), temp)
                except FileNotFoundError:  # someone removed the shard directory
                    make_private_dirs(os.path.dirname(temp))
                    os.symlink(disk_extents.link_target(rel, offset, size), temp)
                os.rename(temp, final)
                done.append(True)
            except OSError as exc:
                _unlink(temp)
                log.warning("disk tier %s: linking %s failed: %s", self.path, key.hex(), exc)
                done.append(False)
        return done

    def put_streams(self, keys, sources: list[PayloadSource], *, parents=None) -> list[Status]:
        if len(keys) != len(sources):
            raise ValueError(f"put_streams: {len(keys)} keys but {len(sources)} sources")
        parents = parents or [None] * len(keys)
        for k in keys:
            _check_key(k)
        return [self._put(k, s.nbytes, p, lambda fd, record, k=k, s=s: self._write_stream(fd, k, s, record))
                for k, s, p in zip(keys, sources, parents)]

    def _write_stream(self, fd: int, key: BlockKey, source: PayloadSource, record: bytes) -> None:
        reader = PieceReader(source)

        def header(digest: bytes) -> bytes:
            reader.finish()  # a source that made more than it announced never publishes
            return pack_header(key, source.nbytes, digest, flags=FLAG_CHECKSUM | FLAG_SEALED | FLAG_RECORD) + record

        self._io.write_filled(fd, source.nbytes, lambda off, view: reader.fill(view), header)

    def _put(self, key: BlockKey, nbytes: int, parent: BlockKey | None, write) -> Status:
        """A put of ``nbytes`` whose file I/O ``write(fd, record_bytes)`` is the caller's."""
        need = PAGE + round_up(nbytes)
        with self._lock:
            if self._live(key) is not None:
                self._policy.on_access(key)  # content addressed: the same bytes are there
                return Status.OK
        record = self._record_of(key, parent)
        if record is None:
            with self._lock:
                self.stats.put_failures += 1
            return Status.ERROR
        parent = record.parent
        packed = pack_record(key, record)
        with self._lock:
            if need > self._capacity:
                self.stats.put_failures += 1
                return Status.TOO_LARGE
            if not self._make_room(need):
                self.stats.put_failures += 1
                return Status.FULL
            self._reserved += need
        try:
            status = self._write(key, lambda fd: write(fd, packed))
        except BaseException:
            with self._lock:
                self._reserved -= need
            raise
        with self._lock:
            self._reserved -= need  # in the same locked step as the index: room is never counted twice or not at all
            if status is not Status.OK:
                self.stats.put_failures += 1
                self.stats.errors += status is Status.ERROR
                return status
            if key in self._index:  # another thread of ours published it meanwhile
                self._policy.on_access(key)
            else:
                self._index[key] = _Entry(need, time.time())
                self._used += need
                self._policy.on_insert(key, parent)
            self.stats.puts += 1
            self.stats.bytes_written += nbytes
        return Status.OK

    def _record_of(self, key: BlockKey, parent: BlockKey | None) -> BlockRecord | None:
        """The record to publish with ``key``: the annotator's (its parent when the put gave none);
        None if the annotator refused the block or failed (it is not published without what its
        owner needs)."""
        if self.annotator is None:
            return BlockRecord(parent, None)
        try:
            made = self.annotator(key)
            if made is None:
                return None
            record = BlockRecord(parent if parent is not None else made.parent, made.annotation)
            pack_record(key, record)  # sizes checked before any I/O
            return record
        except Exception:  # noqa: BLE001 - a block we cannot annotate is not published (a cache may lose)
            log.exception("disk tier %s: annotating %s failed; not stored", self.path, key.hex())
            return None

    def records(self) -> Iterator[StoredRecord]:
        """Read back the header and record of every indexed block (one page each, outside the lock).

        A block whose header or record fails its check is removed (counted in
        ``verify_failures``) and not listed; one that vanished meanwhile is skipped."""
        for key in list(self.keys()):
            with self._lock:
                entry = self._index.get(key)
            if entry is None:
                continue
            path = self._file_of(key, entry)
            try:
                fd = self._io.open_read(path)
            except OSError:
                continue
            try:
                inode = os.fstat(fd)
                page = self._io.read_header_page(fd, entry.offset)
            except OSError:
                os.close(fd)
                continue
            os.close(fd)
            header = unpack_header(page) if page is not None else None
            record = _record_in(page, header, key) if header is not None and header.key == key else None
            size = entry.size if entry.extent is not None else inode.st_size
            if (record is None or size != PAGE + round_up(header.payload_nbytes)
                    or inode.st_size < entry.offset + size):
                with self._lock:
                    self.stats.verify_failures += 1
                    self._discard(key, path, inode)
                log.warning("disk tier %s: block %s has a bad header or record; removed", self.path, key.hex())
                continue
            yield StoredRecord(key, header.payload_nbytes, record.parent, record.annotation, header)

    def delete(self, key: BlockKey) -> bool:
        """Remove a block at once, pinned or not: readers holding it open keep whole bytes."""
        with self._lock:
            # a block another process packed is indexed first, so that its bytes are erased too
            if key in self._index or self._adopt(key) is not None:
                self._remove(key)
                found = True
            else:
                found = _unlink(self.path_of(key))
            self.stats.deletes += found
            return found

    def keys(self) -> Iterator[BlockKey]:
        """The indexed keys (a snapshot; blocks other processes wrote since are not listed)."""
        with self._lock:
            return iter(list(self._index))

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

    def expire(self) -> int:
        """Remove expired blocks now (they are also removed lazily); returns how many."""
        with self._lock:
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
            assert self._used <= self._capacity, f"used {self._used} > capacity {self._capacity}"
            assert self._reserved >= 0, f"negative reservation {self._reserved}"
            assert len(self._policy) == len(self._index), (
                f"policy tracks {len(self._policy)} keys, index holds {len(self._index)}"
            )
            assert all(c > 0 for c in self._pins.values()), "non-positive pin count"
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

    # -- reading -------------------------------------------------------------------
    def _read_verified(self, fd: int, base: int, key: bytes, dst: np.ndarray) -> tuple[Status, str]:
        return self._read_checked(key, dst.nbytes, lambda accept: self._io.read(fd, dst, accept, base=base),
                                  sealed=False)

    def _read_into_sink(self, fd: int, base: int, key: bytes, sink: PayloadSink) -> tuple[Status, str]:
        feeder = SinkFeeder(sink)

        def read_payload(accept):
            return self._io.read_drained(fd, sink.nbytes, lambda off, view: feeder.feed(view), accept, base=base)

        status, why = self._read_checked(key, sink.nbytes, read_payload, sealed=True)
        verdict = feeder.verdict()
        if status is Status.OK and isinstance(verdict, Unverifiable):
            return Status.MISS, verdict  # the reader lacks the key, the block may be fine: keep it
        if status is Status.OK and verdict is not None:
            return Status.CORRUPT, verdict
        return status, why

    @staticmethod
    def _read_checked(key: bytes, nbytes: int, read_payload, *, sealed: bool) -> tuple[Status, str]:
        """Run ``read_payload(accept_header) -> digest | None`` and judge what it read. A plain read
        (not ``sealed``) refuses a sealed block: its bytes are only good to the sink that opens them."""
        seen: dict = {}

        def accept(page: np.ndarray) -> bool:  # checked before the rest is read
            header = unpack_header(page)
            seen["header"] = header
            seen["record"] = _record_in(page, header, key) if header is not None else None
            return (header is not None and header_mismatch(header, key, nbytes) is None
                    and seen["record"] is not None and (sealed or not header.flags & FLAG_SEALED))

        digest = read_payload(accept)
        header = seen.get("header")
        if header is None:
            return Status.CORRUPT, "unreadable header"
        if header.key == key and seen["record"] is None:
            return Status.CORRUPT, "the block's record (parent link, annotation) fails its check"
        if header.key == key and header.payload_nbytes != nbytes:
            return Status.BAD_SIZE, ""  # same page count, other size: the caller's mistake
        why = header_mismatch(header, key, nbytes)
        if why is not None:
            return Status.CORRUPT, why
        if not sealed and header.flags & FLAG_SEALED:
            return Status.CORRUPT, "a sealed block, read as a plain one"
        if digest is None:
            return Status.CORRUPT, "file is shorter than its header says"
        if digest != header.checksum:
            return Status.CORRUPT, "payload checksum differs"
        return Status.OK, ""

    def _size_mismatch(self, fd: int, key: bytes, want: int) -> tuple[Status, str]:
        """The file's size does not fit ``want``: a wrong caller buffer (BAD_SIZE) or a bad file."""
        return _judge_size(self._io.read_header_page(fd), os.fstat(fd).st_size, key, want)

    def _failed_get(self, key: BlockKey, exc: OSError) -> Status:
        with self._lock:
            self.stats.errors += 1
        log.warning("disk tier %s: reading %s failed: %s", self.path, key.hex(), exc)
        return Status.ERROR

    # -- writing -------------------------------------------------------------------
    def _write(self, key: BlockKey, write) -> Status:
        return self._publish(self.path_of(key), key.hex(), write, what=key.hex())

    def _publish(self, final: str, stem: str, write, *, what: str) -> Status:
        """Write a file through ``write(fd)`` under a temp name beside ``final``, then rename it there."""
        temp = os.path.join(os.path.dirname(final), f".{stem}.{direct_io.temp_tag()}{TEMP_SUFFIX}")
        try:
            try:
                fd = self._io.open_write(temp)
            except FileNotFoundError:  # someone removed the shard directory
                make_private_dirs(os.path.dirname(temp))
                fd = self._io.open_write(temp)
            try:
                write(fd)
            finally:
                os.close(fd)
            # The directory entry is not fsync'd: a power cut may lose the
            # block (a cache may lose), never expose a torn one.
            os.rename(temp, final)
            return Status.OK
        except OSError as exc:
            _unlink(temp)
            if exc.errno in _FULL_ERRNOS:
                return Status.FULL
            log.warning("disk tier %s: writing %s failed: %s", self.path, what, exc)
            return Status.ERROR
        except ValueError as exc:  # a payload source that broke its word: nothing is published
            _unlink(temp)
            log.warning("disk tier %s: writing %s failed: %s", self.path, what, exc)
            return Status.ERROR
        except BaseException:
            _unlink(temp)
            raise

    # -- index (all under the lock) ----------------------------------------------
    def _expired(self, created: float, now: float | None = None) -> bool:
        return self._ttl_s is not None and (now or time.time()) - created > self._ttl_s

    def _live(self, key: BlockKey) -> _Entry | None:
        entry = self._index.get(key)
        if entry is None:
            return self._adopt(key)
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
            packed = self._packed_location(path) if stat.S_ISLNK(st.st_mode) else None
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            if packed is None or self._expired(st.st_mtime):
                return None  # the reader that opens it (or a restart) sorts it out
            rel, offset, size = packed
            self._index_block(key, _Entry(size, st.st_mtime, self._extent(rel), offset), None)
        else:
            if not _plausible(st.st_size) or self._expired(st.st_mtime):
                return None
            self._index_block(key, _Entry(st.st_size, st.st_mtime), None)
        self._make_room(0)
        return self._index.get(key)

    def _packed_location(self, path: str) -> tuple[str, int, int] | None:
        """``(extent rel, offset, length)`` of a block link whose extent exists and reaches its end."""
        place = disk_extents.parse_link(os.readlink(path))
        if place is None:
            return None
        try:
            size = os.stat(os.path.join(self.path, place[0])).st_size
        except OSError:
            return None
        return place if place[1] + place[2] <= size else None

    def _extent(self, rel: str) -> Extent:
        extent = self._extents.get(rel)
        if extent is None:
            extent = self._extents[rel] = Extent(rel)
        return extent

    def _index_block(self, key: BlockKey, entry: _Entry, parent: BlockKey | None) -> None:
        self._index[key] = entry
        self._used += entry.size
        if entry.extent is not None:
            entry.extent.live += 1
        self._policy.on_insert(key, parent)

    def _make_room(self, need: int) -> bool:
        def fits() -> bool:
            return self._used + self._reserved + need <= self._capacity

        if fits():
            return True
        self._purge_expired()
        victims = self._policy.victims()
        while not fits():
            key = next(victims, None)
            if key is None:
                return False
            if key in self._pins:
                self._policy.on_access(key)
                continue
            if self.on_evict is not None:
                self._demote(key)
            self._remove(key)
            self.stats.evictions += 1
        return True

    def _demote(self, key: BlockKey) -> None:
        """Hand a victim's verified bytes to ``on_evict`` (a read-only view of a file mapping)."""
        entry = self._index[key]
        try:
            with open(self._file_of(key, entry), "rb") as f:
                size = os.fstat(f.fileno()).st_size - entry.offset
                if entry.extent is not None:
                    size = min(size, entry.size)
                if not _plausible(size):
                    return
                mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ, offset=entry.offset)
        except OSError:
            return  # gone or unreadable: nothing to demote
        try:
            page = mapped[: PAGE]
            header = unpack_header(page)
            if (header is None or header.key != key or size != PAGE + round_up(header.payload_nbytes)
                    or _record_in(page, header, key) is None):
                self.stats.verify_failures += 1
                return
            payload = memoryview(mapped)[PAGE : PAGE + header.payload_nbytes]
            if xxhash.xxh3_128_digest(payload) != header.checksum:
                self.stats.verify_failures += 1
                return
            meta = BlockMeta(header.dtype, header.shape, header.token_count)
            try:
                self.on_evict(key, payload.toreadonly(), meta)
            except Exception:  # noqa: BLE001 - a failed demotion only loses a cached block
                self.stats.errors += 1
                log.exception("disk tier %s: on_evict failed for %s", self.path, key.hex())
            payload.release()
        finally:
            try:
                mapped.close()
            except BufferError:
                pass  # the hook kept a view; the mapping goes with it

    def _purge_expired(self) -> int:
        # Entries are indexed in publication order, so the expired ones lead
        # (blocks adopted from other processes may sit a little out of order).
        if self._ttl_s is None:
            return 0
        now = time.time()
        doomed = []
        for key, entry in self._index.items():
            if not self._expired(entry.created, now):
                break
            if key not in self._pins:
                doomed.append(key)
        for key in doomed:
            self._remove(key)
        self.stats.expirations += len(doomed)
        return len(doomed)

    def _remove(self, key: BlockKey) -> None:
        """Unindex a block and remove its bytes: its file, or its name and its place in its extent."""
        entry = self._index.get(key)
        _unlink(self.path_of(key))
        if entry is None or entry.extent is None:
            self._forget(key)
            return
        extent = entry.extent
        self._forget(key)
        if extent.live == 0:
            return  # the extent went with its last block
        try:
            freed = disk_extents.erase(os.path.join(self.path, extent.rel), entry.offset, entry.size)
        except OSError as exc:
            log.warning("disk tier %s: cannot erase %s in %s: %s", self.path, key.hex(), extent.rel, exc)
            return
        if freed:
            extent.dead -= entry.size
            self._used -= entry.size

    def _forget(self, key: BlockKey) -> _Entry | None:
        """Unindex a block (its bytes left where they are: a packed block's still count until
        erased, or until its extent goes with the last block indexed in it)."""
        entry = self._index.pop(key, None)
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
        return entry

    def _drop_extent(self, extent: Extent) -> None:
        """Remove an extent no indexed block is in (its space no longer counted)."""
        self._extents.pop(extent.rel, None)
        self._used -= extent.dead
        extent.dead = 0
        _unlink(os.path.join(self.path, extent.rel))

    def _still_there(self, key: BlockKey) -> bool:
        """False if a packed block's name no longer links to where we read it (another process
        removed it, perhaps erasing its bytes: what we read is not a damaged block of ours)."""
        entry = self._index.get(key)
        if entry is None or entry.extent is None:
            return True
        try:
            target = os.readlink(self.path_of(key))
        except OSError:
            return False
        return target == disk_extents.link_target(entry.extent.rel, entry.offset, entry.size)

    def _discard(self, key: BlockKey, path: str, bad: os.stat_result) -> None:
        """Drop a block that failed verification, unless its name now holds another file
        (a good copy another process published meanwhile)."""
        entry = self._index.get(key)
        if entry is not None and entry.extent is not None:
            self._remove(key)  # its name still links to the bytes that failed (checked by the caller)
            return
        self._forget(key)
        try:
            st = os.stat(path)
        except OSError:
            return
        if (st.st_ino, st.st_dev) == (bad.st_ino, bad.st_dev):
            _unlink(path)

    def _recover(self) -> None:
        """Index every published block under ``path`` (files of their own, and links into extents);
        remove dead writers' temp files, broken links and extents no link reaches."""
        now = time.time()
        found: list[tuple[float, BlockKey, int, tuple[str, int] | None]] = []
        links: list[tuple[float, BlockKey, str]] = []
        extents: dict[str, os.stat_result] = {}
        for shard in os.scandir(self.path):
            if shard.name.endswith(TEMP_SUFFIX):
                _reap_temp(shard, now)  # a dead prober's
            if not (shard.is_dir() and len(shard.name) == 2 and _is_hex(shard.name)):
                continue
            for item in os.scandir(shard.path):
                if item.name.endswith(TEMP_SUFFIX):
                    _reap_temp(item, now)
                    continue
                if disk_extents.is_extent_name(item.name):
                    try:
                        extents[f"{shard.name}/{item.name}"] = item.stat(follow_symlinks=False)
                    except OSError:
                        pass
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
                elif not _plausible(st.st_size):
                    self.stats.verify_failures += 1
                    _unlink(item.path)
                elif self._expired(st.st_mtime, now):
                    self.stats.expirations += 1
                    _unlink(item.path)
                else:
                    found.append((st.st_mtime, key, st.st_size, None))
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
                found.append((mtime, key, place[2], (place[0], place[1])))
                live[place[0]] = live.get(place[0], 0) + place[2]
        for rel, inode in extents.items():
            if rel not in live:
                _unlink(os.path.join(self.path, rel))  # no block reaches it (a writer died before linking)
            else:
                self._extent(rel).dead = max(0, disk_extents.allocated_bytes(inode) - live[rel])
                self._used += self._extents[rel].dead
        found.sort(key=lambda item: (item[0], item[1]))
        # LRU ignores parent links: do not read a page per block for nothing.
        parents = (self._recorded_parents([(k, p) for _, k, _, p in found])
                   if not isinstance(self._policy, LRUPolicy) else {})
        for mtime, key, size, place in _parents_first(found, parents):
            if place is None:
                entry = _Entry(size, mtime)
            else:
                entry = _Entry(size, mtime, self._extent(place[0]), place[1])
            self._index_block(key, entry, parents.get(key))
        self._make_room(0)

    def _recorded_parents(self, blocks: list[tuple[BlockKey, tuple[str, int] | None]]) -> dict[BlockKey, BlockKey]:
        """key → recorded parent, for the blocks whose header page records one (unverified
        pages are left to the read that verifies them: a wrong link only orders eviction)."""
        out: dict[BlockKey, BlockKey] = {}
        for key, place in blocks:
            path, base = (self.path_of(key), 0) if place is None else (os.path.join(self.path, place[0]), place[1])
            try:
                fd = os.open(path, os.O_RDONLY)
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


def _judge_size(page: bytes | None, size: int, key: bytes, want: int) -> tuple[Status, str]:
    """A file of ``size`` bytes that does not fit a payload of ``want``, with this header page
    (None: unreadable): a wrong caller buffer (BAD_SIZE) or a bad file (CORRUPT)."""
    header = unpack_header(page) if page is not None else None
    if header is None or header.key != key:
        return Status.CORRUPT, "unreadable header or wrong key"
    if size != PAGE + round_up(header.payload_nbytes):
        return Status.CORRUPT, "file size differs from its header (truncated?)"
    return Status.BAD_SIZE, ""


def _record_in(page, header: BlockHeader, key: bytes) -> BlockRecord | None:
    """The verified record of a header page; an empty one for files written before records."""
    if not header.flags & FLAG_RECORD:
        return BlockRecord()
    return unpack_record(page, key)


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


def _probe(path: str) -> bool:
    try:
        return direct_io.probe_direct_io(path)
    except OSError as exc:
        raise TierError(f"cannot write in {path!r} ({exc}); pass a writable directory") from exc


def _check_key(key) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(
            f"disk tier keys are {KEY_BYTES}-byte BlockKeys (kvtier.core.keys.block_keys), got {key!r:.40}"
        )


def _plausible(size: int) -> bool:
    return size >= PAGE and size % PAGE == 0


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


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


def _reap_temp(item: os.DirEntry, now: float) -> None:
    try:
        if direct_io.stale_temp(item.name, item.stat(follow_symlinks=False).st_mtime, now, STALE_TEMP_S):
            _unlink(item.path)
    except OSError:
        pass  # raced with its writer's rename or another reaper
