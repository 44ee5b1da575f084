"""The write path of :class:`~kvtier.tiers.disk.DiskTier`: ``put``, ``put_many``, ``put_streams``.

A block is published crash safe: written to a temp file beside its final name, fsync'd, then
renamed there. ``put_many`` of several blocks packs them in one extent file (one fsync), then
links each block's name to its place in it (:mod:`kvtier.tiers.disk_extents`); a batch that
does not fit whole goes block by block (so does one whose extent the file system still has no
room for once written again after evicting for it, :data:`EXTENT_NO_ROOM_RETRIES`).
Each block's record (parent link, the annotator's annotation) is made before any I/O; room is
reserved under the lock and settled in the same locked step as the index.

Content addressed: a block already indexed is not written again, once its name is confirmed to
hold it still (one lstat, :meth:`~kvtier.tiers.disk.DiskTier._drop_stale`: another process sharing
the directory may have removed it). Two writers of ours publishing one key at once (a put and a
``put_many``, say): whichever rename or link reached the name last wins it, and the index takes
that copy whichever settles last (the other's file is gone, or its place in an extent dead).

A file system that runs out of space (ENOSPC, EDQUOT) before ``capacity_bytes`` is reached is the
limit from then on (``DiskTier._medium_full``): a put evicts the policy's victims worth what it
needs and is written again (:data:`NO_ROOM_RETRIES` times at most), rather than failing for good.
A ``put_many`` block whose name finds no room (a full ext4's directory wants a new block for it)
is put on its own likewise, not failed.

A put may carry the block's age (``created``: when it was first written into the store, wall
clock): the published file's mtime is set to it before the rename, so a restart reads the same
age; a block already older than the tier's TTL is not written (OK, counted as expired).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_CHECKSUM, FLAG_SEALED, BlockMeta, pack_header
from kvtier.private_files import make_private_dirs
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.base import Status, check_batch_lengths
from kvtier.tiers.direct_io import PAGE, as_bytes, round_up
from kvtier.tiers.disk_extents import EXTENT_SUFFIX
from kvtier.tiers.disk_records import FLAG_RECORD, TEMP_SUFFIX, BlockRecord, _Entry, _unlink, log, pack_record
from kvtier.tiers.streams import PayloadSource, PieceReader

#: how many times a put is written again after the file system ran out of space (each time
#: after evicting what it needs: others may fill the space first, or the file system count more)
NO_ROOM_RETRIES = 2
#: how many times an extent is written again after the file system ran out of space: room is made
#: for the whole file (its table too), so a rewrite that still finds none lost the room to others or
#: to the file system's own metadata, and its blocks go one by one rather than the whole extent again
EXTENT_NO_ROOM_RETRIES = 1
#: a block older than this (its ``created``) is written as a file of its own, never packed: an
#: extent's mtime is its blocks' age, and a restart in another process takes an extent no name
#: reaches yet (its writer still linking them) for a dead writer's once its mtime is older than
#: ``disk.STALE_TEMP_S`` (an hour): extents stay far from that.
PACK_AGE_MAX_S = 600.0


class _NoRoom(Exception):
    """A write the file system had no room for (ENOSPC, EDQUOT: ``quota``); nothing published."""

    def __init__(self, quota: bool) -> None:
        super().__init__("quota spent" if quota else "file system full")
        self.quota = quota


#: what a put's settle step answers when the write found no room and is to be made again
_AGAIN = object()


@dataclass(frozen=True, slots=True)
class _Placed:
    """A block written into an extent, to be indexed once its name is linked."""

    key: BlockKey
    size: int  #: bytes on disk (header page and padded payload)
    offset: int  #: where in the extent
    index: int  #: its entry in the extent's table
    born: float  #: its age (first written into the store)
    parent: BlockKey | None
    nbytes: int  #: payload bytes (counted written)


class DiskWrites:
    """``put`` / ``put_many`` / ``put_streams`` and publishing files (a mixin of the tier)."""

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None,
            created: float | None = None) -> Status:
        """Write a copy of ``data`` durably (fsync'd before it becomes visible).

        ``data`` stays the caller's and is not retained; a page-aligned buffer
        is written without a copy. ``created``: see the module docstring (None: now)."""
        _check_key(key)
        src = as_bytes(data)

        def write(fd: int, record: bytes, landed) -> None:
            self._io.write(fd, src, lambda digest: pack_header(
                key, src.nbytes, digest, meta, flags=FLAG_CHECKSUM | FLAG_RECORD) + record, sync=False)
            landed()
            os.fsync(fd)

        return self._put(key, src.nbytes, parent, write, created)

    def put_many(self, keys, datas, *, parents=None, metas=None, created=None) -> list[Status]:
        """:meth:`put` of several blocks (a chain unless ``parents`` says otherwise), packed in one
        extent file, fsync'd once, each block then linked under its own name (see
        :mod:`kvtier.tiers.disk_extents`). A batch that does not fit whole goes block by block.
        ``created``: one ``float | None`` per key (the extent's mtime is the oldest block's)."""
        check_batch_lengths("put_many", keys, datas, parents, metas, created)
        if parents is None:
            parents = [None, *keys[:-1]]
        metas = metas or [None] * len(keys)
        created = created or [None] * len(keys)
        for key in keys:
            _check_key(key)
        srcs = [as_bytes(d) for d in datas]
        statuses: list[Status | None] = [None] * len(keys)
        first_of: dict[BlockKey, int] = {}
        self._drop_stale(keys)  # blocks another process removed are written again, not taken as there
        with self._lock:
            for i, key in enumerate(keys):
                if key in first_of:
                    continue  # a repeat in the batch: the first one's status
                first_of[key] = i
                if self._live(key) is not None:
                    self._policy.on_access(key)  # content addressed: the same bytes are there
                    statuses[i] = Status.OK
                elif key in self._withheld:  # deleted, and its name still cannot be removed
                    self.stats.put_failures += 1
                    statuses[i] = Status.ERROR
                elif created[i] is not None and self._expired(created[i]):
                    self.stats.expirations += 1  # older than this tier keeps blocks: not written
                    statuses[i] = Status.OK
        todo = [i for i in first_of.values() if statuses[i] is None]
        now = time.time()
        packable = [i for i in todo if created[i] is None or now - created[i] < PACK_AGE_MAX_S]
        if len(packable) >= 2 and self.pack_batches:
            # an extent per EXTENT_BLOCKS at most: each block's name is a link to it, and file
            # systems bound an inode's links (ext4: 65,000)
            for start in range(0, len(packable), disk_extents.EXTENT_BLOCKS):
                self._put_packed(keys, srcs, parents, metas, created,
                                 packable[start:start + disk_extents.EXTENT_BLOCKS], statuses)
        for i in todo:
            if statuses[i] is None:  # not packed (no room for the whole batch, old): one by one (each makes room)
                statuses[i] = self.put(keys[i], srcs[i], parent=parents[i], meta=metas[i], created=created[i])
        return [statuses[first_of[key]] for key in keys]

    def _put_packed(self, keys, srcs, parents, metas, created, todo: list[int], statuses: list) -> None:
        """Publish blocks ``todo`` in one extent; sets their statuses (None: not written, to be put
        one by one: the batch did not fit whole, or the file system had no room for the extent,
        written again after evicting for it, :data:`EXTENT_NO_ROOM_RETRIES` times)."""
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
        if len(todo) < 2:
            return
        stem = disk_extents.extent_stem(keys[todo[0]])
        rel = f"{stem[:2]}/{stem}{EXTENT_SUFFIX}"
        table_len = disk_extents.table_bytes(rel, len(todo))
        offsets, off = {}, table_len
        for i in todo:
            offsets[i] = off
            off += sizes[i]
        now = time.time()
        born = {i: now if created[i] is None else min(created[i], now) for i in todo}
        # one mtime for the extent's names (hard links of one inode): the oldest block's, so that
        # after a restart none is served past its TTL (a younger one may expire early: a cache may lose)
        oldest = min(born.values()) if any(created[i] is not None for i in todo) else None

        def write_and_link(landed) -> tuple[Status, int | None, list[OSError | None]]:
            table = disk_extents.pack_table(rel, [(keys[i], offsets[i], sizes[i]) for i in todo])
            status, ino = self._write_extent(stem, rel, table, [
                (keys[i], srcs[i], metas[i], pack_record(keys[i], records[i]), offsets[i]) for i in todo],
                oldest, landed)
            return status, ino, (self._link_checked(rel, ino, [keys[i] for i in todo]) if status is Status.OK else [])

        retries = EXTENT_NO_ROOM_RETRIES

        def settle(written, full: _NoRoom | None):
            if full is not None:
                # no room for the extent (before capacity_bytes): written again once room is made for
                # it (out of inodes, one inode is what it needs, not one per block), else block by block
                return _AGAIN if retries > 0 else None
            status, ino, failures = written
            if status is not Status.OK:
                for i in todo:
                    statuses[i] = status
                self.stats.put_failures += len(todo)
                self.stats.errors += len(todo) if status is Status.ERROR else 0
                return
            placed = [_Placed(keys[i], sizes[i], offsets[i], index, born[i], records[i].parent, srcs[i].nbytes)
                      for index, i in enumerate(todo)]
            self._table_written(table_len)  # (first: a name that finds no room sets the limit anew, exactly)
            for i, done in zip(todo, self._index_extent(rel, ino, table_len, placed, failures)):
                statuses[i] = done

        # no room (statuses left None): block by block
        while self._reserved_write(self._extent_need(off, sum(sizes[i] for i in todo)), write_and_link, settle,
                                   when_no_room=lambda: None) is _AGAIN:
            retries -= 1

    def _extent_need(self, file_bytes: int, block_bytes: int) -> int:
        """The room to reserve for an extent of ``file_bytes``, ``block_bytes`` of them its blocks'.
        Against ``capacity_bytes``, its blocks: the table is metadata, like the names, which
        used_bytes leaves out (as a restart does). Against a limit the file system's room set, the
        whole file, its table page too: that limit is bytes statvfs shows, and room made for the
        blocks alone left a rewrite after evicting for it with no room again (once written, the
        page leaves the limit: :meth:`_table_written`). (Read without the lock: a limit that moves
        meanwhile sizes this one reservation only.)"""
        return file_bytes if self._limit < self._capacity else block_bytes

    def _table_written(self, table_bytes: int) -> None:
        """An extent's table page is on the medium (under the lock, as its blocks are indexed):
        used_bytes leaves it out, as a restart does, so under a limit the file system's room set
        (bytes statvfs shows) the limit loses it instead. Else each extent written since that limit
        was set leaves limit - used a page above the room the file system has, and a put sized
        within it evicts nothing and finds no room (a stream, read once, is refused FULL). This errs
        low: an extent that goes frees its page, which the limit regains when
        ``DiskTier._medium_freed`` next reads statvfs (before any eviction, and within one as soon
        as an extent goes whole). Not under a spent quota: its limit never rises until a reopen, so
        pages taken off it would never come back and the limit would shrink with every extent
        written; there a write that finds the quota spent sets the limit anew, exactly (a put is
        written again, a stream refused FULL)."""
        if self._limit < self._capacity and not self._quota_limited:
            self._limit = max(0, self._limit - table_bytes)

    def _index_extent(self, rel: str, ino: int | None, table_bytes: int, placed: list[_Placed],
                      failures: list[OSError | None]) -> list[Status | None]:
        """Index the blocks of extent ``rel`` (inode ``ino``, its table ``table_bytes``) whose names
        were linked (``failures[i]`` None), under the lock; each one's status: OK, ERROR (its name
        could not be made), or None where the file system had no room for its name (ENOSPC, EDQUOT:
        a full ext4's directory needs a block for it): then the limit is lowered and the block is
        to be put on its own, which evicts to make room; None too where the extent went while its
        names were linked (ENOENT): then the block is put on its own as a fresh write. A name not
        made leaves its place in the extent dead."""
        # an extent a lookup on another thread adopted while the names were linked is that same one
        extent = self._extent(rel, ino, table_bytes)
        extent.ino = ino
        out: list[Status | None] = []
        no_room: OSError | None = None
        for block, failure in zip(placed, failures):
            if failure is not None:
                extent.dead += block.size  # written, unreachable: still on disk until the extent goes
                self._used += block.size
                if failure.errno in direct_io.NO_ROOM:
                    no_room = failure
                    out.append(None)
                elif failure.errno == errno.ENOENT:
                    out.append(None)  # the extent went while its names were linked: put on its own
                else:
                    self.stats.put_failures += 1
                    self.stats.errors += 1
                    out.append(Status.ERROR)
                continue
            held = self._index.get(block.key)
            if held is not None and (held.extent is extent and held.offset == block.offset
                                     or not self._name_holds(block.key, ino)):
                # indexed already: adopted at our very place by a lookup on another thread, or another
                # thread of ours published it and its rename came after our link (the name holds its
                # copy, indexed; our place is unreachable)
                if held.extent is not extent or held.offset != block.offset:
                    extent.dead += block.size
                    self._used += block.size
                self._policy.on_access(block.key)
            else:
                if held is not None:
                    self._forget(block.key)  # our link replaced its file (or its place in an extent: dead now)
                self._index_block(block.key, _Entry(block.size, block.born, extent, block.offset, block.index),
                                  block.parent)
            self.stats.puts += 1
            self.stats.bytes_written += block.nbytes
            out.append(Status.OK)
        if no_room is not None:  # once the whole extent is counted: its bytes are all on the medium
            self._medium_full(no_room.errno == errno.EDQUOT)
        if extent.live == 0:
            self._drop_extent(extent)
        return out

    def _reserved_write(self, need: int, write, settle, *, when_no_room, read_once: bool = False):
        """Make room for ``need`` bytes and reserve them (under the lock), run ``write(landed)``
        (outside it), then return the reservation and ``settle(result, full)`` in one locked step, so
        that room is never counted twice or not at all: ``full`` is the :class:`_NoRoom` the write
        raised (its result None), after the medium lowered the limit. ``write`` calls ``landed()``
        once its bytes are written, before its fsync: from then on the file system's free room lacks
        them (see ``DiskTier._medium_full``). Returns what ``settle`` returns, or, where no room
        could be made, what ``when_no_room()`` returns (under the lock). A write that cannot be made
        again (``read_once``: a stream) starts only once the tier knows whether the file system has
        room for it (``DiskTier._medium_known_for``)."""
        with self._lock:
            if read_once:
                self._medium_known_for(need)
            if not self._make_room(need):
                return when_no_room()
            self._reserved += need
        landed: list[bool] = []

        def land() -> None:
            with self._lock:
                if not landed:
                    landed.append(True)
                    self._landed += need

        def release() -> None:
            self._reserved -= need
            self._landed -= need if landed else 0

        result = full = None
        try:
            result = write(land)
        except _NoRoom as exc:
            full = exc
        except BaseException:
            with self._lock:
                release()
            raise
        with self._lock:
            release()
            if full is not None:
                self._medium_full(full.quota)  # (our reservation returned first: not room the medium has)
            return settle(result, full)

    def _write_extent(self, stem: str, rel: str, table, blocks, mtime: float | None,
                      landed) -> tuple[Status, int | None]:
        """Write ``table`` and ``(key, payload, meta, record bytes, offset)`` blocks into extent
        ``rel``: temp file, ``landed()``, one fsync, its ``mtime`` (None: left), rename (nothing links
        into it yet, so a crash leaves no torn block reachable). Returns the status and the extent's
        inode (its names link to it); raises :class:`_NoRoom` as :meth:`_publish` does."""
        final = os.path.join(self.path, rel)
        inode: list[int] = []

        def write(fd: int) -> None:
            inode.append(os.fstat(fd).st_ino)
            direct_io.pwrite_all(fd, table, 0)
            for key, src, meta, record, offset in blocks:
                self._io.write(fd, src, lambda digest, key=key, src=src, meta=meta, record=record: pack_header(
                    key, src.nbytes, digest, meta, flags=FLAG_CHECKSUM | FLAG_RECORD) + record, base=offset, sync=False)
            landed()
            os.fsync(fd)

        status = self._publish(final, stem, write, what=f"extent {stem}", mtime=mtime)
        return status, (inode[0] if inode else None)

    def _link_checked(self, rel: str, ino: int, keys) -> list[OSError | None]:
        """:meth:`_link_all`, then a check (one lstat) that the extent's own name still holds it,
        inode ``ino``: where it went while the names were linked (another process removed what it
        judged the extent's last block name, or stopped halfway through removing it), the names
        just made would be the only links to a whole extent, blocks no get finds (and a restart
        takes such a name for a block file). Each one still linked to it is unlinked and its block
        marked (ENOENT) to be written on its own, as a fresh put. (A remover that unlinks the
        extent's own name after this check sees these names in its link count and names the
        extent again: ``DiskTier._keep_extent_named``.)"""
        extent = os.path.join(self.path, rel)
        done = self._link_all(rel, keys)
        if None in done and not _names(extent, ino):
            gone = OSError(errno.ENOENT, "the extent's own name went while its blocks were linked", extent)
            for i, key in enumerate(keys):
                if done[i] is None:
                    if _names(self.path_of(key), ino):  # (not a block another writer put there since)
                        _unlink(self.path_of(key))
                    done[i] = gone
        return done

    def _link_all(self, rel: str, keys) -> list[OSError | None]:
        """Give each block of extent ``rel`` its name: a hard link to the extent (a directory entry,
        no inode of its own), made under a temp name and renamed onto the name (atomic, whatever
        stood there before); per block, None where it was made, else why not (ENOENT: the extent
        went meanwhile, the block to be written on its own). Its place is in the table."""
        extent = os.path.join(self.path, rel)
        done = []
        for key in keys:
            final = self.path_of(key)
            temp = os.path.join(os.path.dirname(final), f".{key.hex()}.{direct_io.temp_tag()}{TEMP_SUFFIX}")
            try:
                try:
                    os.link(extent, temp)
                except FileNotFoundError:  # someone removed the shard directory
                    make_private_dirs(os.path.dirname(temp))
                    os.link(extent, temp)
                os.rename(temp, final)
                done.append(None)
            except OSError as exc:
                _unlink(temp)
                if exc.errno not in (*direct_io.NO_ROOM, errno.ENOENT):  # (both: the block is put on its own)
                    log.warning("disk tier %s: linking %s failed: %s", self.path, key.hex(), exc)
                done.append(exc)
        return done

    def put_streams(self, keys, sources: list[PayloadSource], *, parents=None, created=None) -> list[Status]:
        """``created``: one ``float | None`` per key, as :meth:`put_many` takes it."""
        if len(keys) != len(sources):
            raise ValueError(f"put_streams: {len(keys)} keys but {len(sources)} sources")
        parents = parents or [None] * len(keys)
        created = created or [None] * len(keys)
        for k in keys:
            _check_key(k)
        # a source is read once: a stream the file system has no room for is not written again
        return [self._put(k, s.nbytes, p, lambda fd, record, landed, k=k, s=s: self._write_stream(fd, k, s, record, landed),
                          c, rewritable=False)
                for k, s, p, c in zip(keys, sources, parents, created)]

    def _write_stream(self, fd: int, key: BlockKey, source: PayloadSource, record: bytes, landed) -> None:
        """Write ``source``'s block into ``fd``, ``landed()``, then fsync (as :meth:`put` does: while
        the fsync runs, the file system's free room lacks the bytes, so they count as written)."""
        reader = PieceReader(source)

        def header(digest: bytes) -> bytes:
            reader.finish()  # a source that made more than it announced never publishes
            return pack_header(key, source.nbytes, digest, flags=FLAG_CHECKSUM | FLAG_SEALED | FLAG_RECORD) + record

        self._io.write_filled(fd, source.nbytes, lambda off, view: reader.fill(view), header, sync=False)
        landed()
        os.fsync(fd)

    def _put(self, key: BlockKey, nbytes: int, parent: BlockKey | None, write, created: float | None = None,
             *, rewritable: bool = True) -> Status:
        """A put of ``nbytes`` whose file I/O ``write(fd, record_bytes, landed)`` is the caller's (it
        calls ``landed()`` once its bytes are written, before its fsync, where it can), of a
        block first written into the store at ``created`` (None: now). A file system that has no
        room for it (before ``capacity_bytes``) becomes the limit (see ``DiskTier._medium_full``):
        victims worth the block are evicted and, where ``write`` can run again (``rewritable``), it
        is written again, :data:`NO_ROOM_RETRIES` times at most."""
        need = PAGE + round_up(nbytes)
        self._drop_stale((key,))  # a block another process removed is written again, not taken as there
        with self._lock:
            if self._live(key) is not None:
                self._policy.on_access(key)  # content addressed: the same bytes are there
                return Status.OK
            if key in self._withheld:  # deleted, and its name still cannot be removed: not a new block's
                self.stats.put_failures += 1
                return Status.ERROR
            if created is not None and self._expired(created):
                self.stats.expirations += 1  # older than this tier keeps blocks: not written
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
        born = None if created is None else min(created, time.time())
        inode: list[int] = []

        def writing(fd: int, landed) -> None:
            inode.append(os.fstat(fd).st_ino)  # the rename keeps it: what our file is at the name
            write(fd, packed, landed)

        retries = NO_ROOM_RETRIES if rewritable else 0

        def settle(status: Status | None, full: _NoRoom | None):
            if full is not None and retries > 0:
                return _AGAIN  # (its temp file is gone) room is made for it first
            return self._settle_put(key, Status.FULL if full is not None else status, need, nbytes,
                                    inode[-1] if inode else None, born, parent)

        while True:
            outcome = self._reserved_write(need, lambda landed: self._write(key, lambda fd: writing(fd, landed), born),
                                           settle, when_no_room=self._refused_full, read_once=not rewritable)
            if outcome is not _AGAIN:
                return outcome
            retries -= 1

    def _refused_full(self) -> Status:
        """A put no room could be made for (under the lock)."""
        self.stats.put_failures += 1
        return Status.FULL

    def _settle_put(self, key: BlockKey, status: Status, need: int, nbytes: int, ino: int | None,
                    born: float | None, parent: BlockKey | None) -> Status:
        """Count a put's write (under the lock) and index its block where it was published
        (``ino``: the file at its name)."""
        if status is not Status.OK:
            self.stats.put_failures += 1
            self.stats.errors += status is Status.ERROR
            return status
        if key in self._index and not self._name_holds(key, ino):
            # another thread of ours published it meanwhile, its rename or link after ours: the
            # name holds its copy, which the index describes (ours is gone)
            self._policy.on_access(key)
        else:
            if key in self._index:  # published meanwhile, but our rename replaced it: its file is
                self._forget(key)   # gone, or its place in an extent unreachable (dead bytes)
            entry = self._index[key] = _Entry(need, time.time() if born is None else born, ino=ino)
            self._used += need
            self._policy.on_insert(key, parent)
            self._queue_age(key, entry)
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

    def _name_holds(self, key: BlockKey, ino: int | None) -> bool:
        """Whether ``key``'s name is file ``ino`` (one lstat; asked only when two writers of ours
        published the same key at once: the last rename or link wins the name)."""
        try:
            st = os.lstat(self.path_of(key))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_ino == ino

    # -- writing -------------------------------------------------------------------
    def _write(self, key: BlockKey, write, mtime: float | None = None) -> Status:
        return self._publish(self.path_of(key), key.hex(), write, what=key.hex(), mtime=mtime)

    def _publish(self, final: str, stem: str, write, *, what: str, mtime: float | None = None) -> Status:
        """Write a file through ``write(fd)`` under a temp name beside ``final``, set its ``mtime``
        (the age of its blocks, which a restart reads back; None: the write's time), then rename it
        there. Raises :class:`_NoRoom` where the file system had no room for it (temp file removed)."""
        temp = os.path.join(os.path.dirname(final), f".{stem}.{direct_io.temp_tag()}{TEMP_SUFFIX}")
        try:
            try:
                fd = self._io.open_write(temp)
            except FileNotFoundError:  # someone removed the shard directory
                make_private_dirs(os.path.dirname(temp))
                fd = self._io.open_write(temp)
            try:
                write(fd)
                if mtime is not None:  # last: writes set it. (A temp file over an hour old looks a dead
                    os.utime(fd, (mtime, mtime))  # writer's to a restart scan, for the moment until the rename.)
            finally:
                os.close(fd)
            # The directory entry is not fsync'd: a power cut may lose the
            # block (a cache may lose), never expose a torn one.
            os.rename(temp, final)
            return Status.OK
        except OSError as exc:
            _unlink(temp)
            if exc.errno in direct_io.NO_ROOM:
                raise _NoRoom(exc.errno == errno.EDQUOT) from exc
            log.warning("disk tier %s: writing %s failed: %s", self.path, what, exc)
            return Status.ERROR
        except ValueError as exc:  # a payload source that broke its word: nothing is published
            _unlink(temp)
            log.warning("disk tier %s: writing %s failed: %s", self.path, what, exc)
            return Status.ERROR
        except BaseException:
            _unlink(temp)
            raise


def _check_key(key) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(
            f"disk tier keys are {KEY_BYTES}-byte BlockKeys (kvtier.core.keys.block_keys), got {key!r:.40}"
        )


def _names(path: str, ino: int) -> bool:
    """Whether ``path`` is a name of regular file ``ino`` (one lstat)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_ino == ino
