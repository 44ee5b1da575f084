"""The read path of :class:`~kvtier.tiers.disk.DiskTier`: ``get``, ``get_many``, ``get_streams``, ``records``.

Every read is verified before it counts (header key and size, the record's check, xxh3-128 of
the payload; a sealed block only through a sink); a block that fails is
:attr:`~kvtier.tiers.base.Status.CORRUPT`, counted and removed, unless another process removed
or replaced it meanwhile (a plain miss; never removed unless the name still holds the very file
indexed and read, not merely one with its inode number): a block stored again elsewhere meanwhile
(a file of its own, another extent) is read there, once. ``get_many`` hands runs of blocks to
:meth:`~kvtier.tiers.direct_io.BlockIO.read_many` (a packed run is one request) and judges each
request's blocks at once as they land: header fields, records and payload hashes checked
together with numpy (a header object per block cost more than reading a 16 KiB block); a block
that fails there takes the one-block path, which says why. File I/O runs outside the tier's lock; counting and the index, under it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import FLAG_SEALED, header_mismatch, plain_headers, unpack_header
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, ReadJob, ReadOutcome, RunOutcome, as_bytes, round_up
from kvtier.tiers.disk_records import FLAG_RECORD, StoredRecord, _Entry, _record_in, _unlink, log, records_ok
from kvtier.tiers.streams import PayloadSink, SinkFeeder, Unverifiable


#: why a block's name that leads to a whole extent (indexed by a restart as a block file of its own:
#: the extent's own name went, a removal or a put of another process stopped halfway, and the scan
#: reads no page to tell) is a miss, removed but not counted as a failed verification: no block was
#: written there, so none is corrupt. Told on the first read, from the header page it reads anyway
#: (a file of another size than the block's: an extent holds two blocks or more and its table).
NAMED_EXTENT = "block {}'s name was the only one left of a whole extent; removed"


class DiskReads:
    """``get`` / ``get_many`` / ``get_streams`` and reading back records (a mixin of the tier)."""

    def get(self, key: BlockKey, out) -> Status:
        """Read a block into ``out`` (caller-owned, writable, exactly the block's size).

        On any status but OK the content of ``out`` is unspecified."""
        dst = as_bytes(out, writable=True)
        return self._get(key, dst.nbytes, lambda fd, base: self._read_verified(fd, base, key, dst), again=True)

    def get_streams(self, keys, sinks: list[PayloadSink]) -> list[Status]:
        if len(keys) != len(sinks):
            raise ValueError(f"get_streams: {len(keys)} keys but {len(sinks)} sinks")
        # a sink is fed once: a block found elsewhere after a read of a stale entry is not read again
        return [self._get(k, s.nbytes, lambda fd, base, k=k, s=s: self._read_into_sink(fd, base, k, s), again=False)
                for k, s in zip(keys, sinks)]

    def get_many(self, keys, outs) -> list[Status]:
        """:meth:`get` of several blocks, read back to back: a run of blocks packed one after
        another in one extent is one request; block (or run) i+1 is read, one request in
        flight, while a helper verifies the ones before. Blocks large enough to be read in
        pieces, and buffers that are not page aligned, go one by one through :meth:`get`."""
        return self._get_many(keys, outs, None)

    def get_many_as_ready(self, keys, outs, ready) -> list[Status]:
        """:meth:`get_many`, calling ``ready(indices, payloads)`` with each request's verified
        blocks as soon as they are verified, on the helper that verifies them while the next
        request is read, so that the caller's use of them hides behind the reads too.

        Blocks that fit the tier's staging chunks are read into them, not into ``outs`` (which stay
        untouched): ``payloads`` are views of a chunk, valid during the call only, and the chunk is
        read into again once ``ready`` returns. A read into memory reused at once ran 1.3-1.4x
        faster on this project's VMs than into a place of its own, and the caller's copy of the
        payload then reads it from cache. Other blocks land in ``outs`` and are handed over as such."""
        return self._get_many(keys, outs, ready)

    def _get_many(self, keys, outs, ready) -> list[Status]:
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        dsts = [as_bytes(out, writable=True) for out in outs]  # every caller mistake before any I/O
        statuses = [Status.MISS] * len(keys)
        staged = ready is not None  # read into the tier's staging, handed to ready from there
        streamed: list[int] = []
        read_entries: list[_Entry] = []  # what each streamed block's read is of (judged against the index after)
        jobs: list[ReadJob] = []
        # Small blocks cost Python per block: look them all up under one lock, and name each
        # extent file once (a span of blocks mostly lies in a few extents).
        small, alone = [], []
        for i, dst in enumerate(dsts):
            if staged:
                fits = self._io.stages(dst.nbytes)
            else:
                fits = dst.nbytes < direct_io.PIECED_MIN and direct_io.is_page_aligned(dst)
            (small if fits else alone).append(i)
        for i in alone:
            statuses[i] = self.get(keys[i], dsts[i])
        done = [i for i in alone if statuses[i] is Status.OK]  # ready before any request is read
        entries = self._lookup_many([keys[i] for i in small])
        paths: dict[int, str] = {}
        for i, entry in zip(small, entries):
            if entry is None:
                continue
            key, dst = keys[i], dsts[i]
            out = None if staged else dst
            if entry.extent is None:
                jobs.append(ReadJob(self.path_of(key), out, None, dst.nbytes))
            elif entry.size != PAGE + round_up(dst.nbytes):
                def read(fd, base, key=key, dst=dst):
                    return self._read_verified(fd, base, key, dst)

                statuses[i] = self._get_found(key, entry, dst.nbytes, read, again=True)
                if statuses[i] is Status.OK:
                    done.append(i)
                continue
            else:
                path = paths.get(id(entry.extent))
                if path is None:
                    path = paths[id(entry.extent)] = self._file_of(key, entry)
                jobs.append(ReadJob(path, out, entry.offset, dst.nbytes))
            streamed.append(i)
            read_entries.append(entry)

        def judge(run: RunOutcome) -> None:
            j, k = run.first, run.count
            # where the request's payloads are now: the staging chunk, or the caller's buffers
            payloads = run.payloads if run.payloads is not None else [dsts[i] for i in streamed[j : j + k]]
            if run.error is None and run.complete == k:
                whole = self._verified_whole([keys[i] for i in streamed[j : j + k]], payloads, jobs[j : j + k], run)
            else:
                whole = [False] * k
            for m in range(k):
                i = streamed[j + m]
                if whole[m]:
                    statuses[i] = Status.OK
                else:  # the slow path: it says why, and removes a bad block
                    statuses[i] = self._judge_read(keys[i], read_entries[j + m], payloads[m], jobs[j + m],
                                                   run.outcome(m))
            if any(whole):
                self._settle_ok(sum(payloads[m].nbytes for m in range(k) if whole[m]), sum(whole))
            if ready is not None:
                verified = [m for m in range(k) if statuses[streamed[j + m]] is Status.OK]
                if verified:
                    ready([streamed[j + m] for m in verified], [payloads[m] for m in verified])

        if ready is not None and done:
            ready(done, [dsts[i] for i in done])
        if staged:
            self._io.read_many_staged(jobs, judge)
        else:
            self._io.read_many(jobs, judge)
        return statuses

    @staticmethod
    def _verified_whole(keys, dsts, jobs, run: RunOutcome) -> list[bool]:
        """Which blocks of a request read whole verify: exactly what :meth:`_judge_read` accepts,
        checked for the request at once (a header object per block cost more than reading it)."""
        k = run.count
        key_rows = np.frombuffer(b"".join(keys), np.uint8).reshape(k, KEY_BYTES)
        ok, checksums, flags = plain_headers(run.pages, key_rows, np.fromiter((d.nbytes for d in dsts), np.uint64, k))
        if not ok.any():
            return [False] * k
        recorded = (flags & FLAG_RECORD) != 0
        if recorded.any():
            ok &= ~recorded | records_ok(run.pages, key_rows)
        own = [m for m, job in enumerate(jobs) if job.offset is None]  # files of their own: the size too
        for m in own:
            ok[m] &= run.inode.st_size == PAGE + round_up(dsts[m].nbytes)
        digests = np.frombuffer(b"".join(xxhash.xxh3_128_digest(d) for d in dsts), np.uint8).reshape(k, 16)
        ok &= (digests == checksums).all(axis=1)
        return ok.tolist()

    def _settle_ok(self, nbytes: int, blocks: int) -> None:
        """Count verified reads of ``blocks`` blocks, ``nbytes`` in all."""
        with self._lock:
            self.stats.hits += blocks
            self.stats.bytes_read += nbytes

    def _judge_read(self, key: BlockKey, entry: _Entry, dst: np.ndarray, job: ReadJob, got: ReadOutcome) -> Status:
        """A get's status from what :meth:`BlockIO.read_many` read of ``entry`` (as :meth:`_get`
        judges its own read); a block found elsewhere since is read into ``dst`` (:meth:`_read_moved`)."""
        status = self._judge_read_once(key, entry, dst, job, got)
        if status is not Status.MISS:
            return status
        return self._read_moved(key, entry, dst.nbytes, lambda fd, base: self._read_verified(fd, base, key, dst))

    def _judge_read_once(self, key: BlockKey, entry: _Entry, dst: np.ndarray, job: ReadJob,
                         got: ReadOutcome) -> Status:
        """:meth:`_judge_read` of ``entry`` itself (a stale entry: a miss)."""
        if isinstance(got.error, (FileNotFoundError, direct_io.NotAFile)):
            return self._vanished(key, entry)
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
        return self._settle(key, entry, dst.nbytes, status, why, got.inode)

    def _lookup(self, key: BlockKey) -> _Entry | None:
        """The entry of a block a get should read (a miss is counted here)."""
        return self._lookup_many((key,))[0]

    def _lookup_many(self, keys) -> list[_Entry | None]:
        """:meth:`_lookup` of several keys under one hold of the lock."""
        out = []
        with self._lock:
            for key in keys:
                entry = self._live(key)
                if entry is None:
                    self.stats.misses += 1
                else:
                    self._policy.on_access(key)
                out.append(entry)
        return out

    def _vanished(self, key: BlockKey, entry: _Entry) -> Status:
        """The file of ``entry`` went away since we indexed it, or its name now holds no regular
        file (another process removed or replaced it): a miss, the entry forgotten (a get reads
        whatever the name holds then: :meth:`_read_moved`). A packed block's name that still links to the very
        extent indexed (:meth:`_holds_exactly`: by its table, not its inode number, which a new
        extent of another process may have been given) is removed too: without the extent's own
        name neither another process nor a restart can find the block, and the name would hold the
        extent's space for nobody. A name that holds anything else is left alone."""
        with self._lock:
            if self._index.get(key) is entry:  # (not removed or published again meanwhile)
                if entry.extent is not None and self._holds_exactly(key, entry):
                    _unlink(self.path_of(key))
                self._forget(key)
            self.stats.misses += 1
        return Status.MISS

    def _get(self, key: BlockKey, nbytes: int, read, *, again: bool) -> Status:
        """A get of ``nbytes`` whose verified read ``read(fd, base) -> (status, why)`` is the caller's
        (``again``: see :meth:`_get_found`)."""
        entry = self._lookup(key)
        if entry is None:
            return Status.MISS
        return self._get_found(key, entry, nbytes, read, again=again)

    def _get_found(self, key: BlockKey, entry: _Entry, nbytes: int, read, *, again: bool) -> Status:
        """:meth:`_get` of an indexed ``entry``; ``again``: a read that found the entry stale may read
        the block where its name holds it now (:meth:`_read_moved`; not where ``read`` fed a sink)."""
        status = self._get_once(key, entry, nbytes, read)
        if status is not Status.MISS or not again:
            return status
        return self._read_moved(key, entry, nbytes, read)

    def _read_moved(self, key: BlockKey, entry: _Entry, nbytes: int, read) -> Status:
        """After a read of ``entry`` missed because the entry was stale (forgotten: another process
        removed the block, or stored it again elsewhere, as a file of its own or in an extent of its
        own), the block its name holds now, adopted (one lookup, as a get's) and read once, so that
        a block another process moved is still served; MISS where the name holds none."""
        with self._lock:
            if self._index.get(key) is entry:
                return Status.MISS  # a miss that kept its entry: not a stale one
            moved = self._live(key)
            if moved is None:
                return Status.MISS
            self.stats.misses -= 1  # one get, one count: the read goes on at the block's new place
            self._policy.on_access(key)
        return self._get_found(key, moved, nbytes, read, again=False)

    def _get_once(self, key: BlockKey, entry: _Entry, nbytes: int, read) -> Status:
        path = self._file_of(key, entry)
        packed = entry.extent is not None
        try:
            fd = self._io.open_read(path)
        except (FileNotFoundError, direct_io.NotAFile):  # removed or replaced by another process since we indexed it
            return self._vanished(key, entry)
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
        return self._settle(key, entry, nbytes, status, why, inode)

    def _settle(self, key: BlockKey, entry: _Entry, nbytes: int, status: Status, why: str,
                inode: os.stat_result) -> Status:
        """Count a judged read of ``entry``; a block that failed verification is removed."""
        with self._lock:
            if status is Status.OK:
                self.stats.hits += 1
                self.stats.bytes_read += nbytes
            elif why is NAMED_EXTENT:
                self.stats.misses += 1
                if self._drop_bad(key, entry, inode, corrupt=False):
                    log.info("disk tier %s: %s", self.path, NAMED_EXTENT.format(key.hex()))
            elif status in (Status.BAD_SIZE, Status.MISS):
                self.stats.misses += 1
            elif not self._drop_bad(key, entry, inode):
                self.stats.misses += 1
                return Status.MISS
            else:
                log.warning("disk tier %s: block %s failed verification (%s); removed", self.path, key.hex(), why)
        return status

    def _drop_bad(self, key: BlockKey, entry: _Entry, inode: os.stat_result, *, corrupt: bool = True) -> bool:
        """Remove a block whose read of ``entry`` (``inode``: the fstat of the file read)
        failed verification (under the lock; counted unless not ``corrupt``: a name that holds a
        whole extent, :data:`NAMED_EXTENT`); False if that read was not of the block indexed, still
        named: a plain miss, the entry forgotten. That is a block removed meanwhile, by a thread of
        ours or another process (perhaps erasing the bytes being read), or published again, or a
        name that now holds another file than the one indexed: another process's extent read as a
        block file of its own, or one that got the indexed file's inode number once it was freed
        (:meth:`_holds_exactly`); that file is never removed for a read of something else."""
        if self._index.get(key) is not entry:
            return False
        if not self._holds_exactly(key, entry, inode):
            self._forget(key)
            return False
        if corrupt:
            self.stats.verify_failures += 1
        self._discard(key, entry)
        return True

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
                    dropped = self._drop_bad(key, entry, inode)
                if dropped:
                    log.warning("disk tier %s: block %s has a bad header or record; removed", self.path, key.hex())
                continue
            yield StoredRecord(key, header.payload_nbytes, record.parent, record.annotation, header)

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


def _judge_size(page: bytes | None, size: int, key: bytes, want: int) -> tuple[Status, str]:
    """A file of ``size`` bytes that does not fit a payload of ``want``, with this header page
    (None: unreadable): a wrong caller buffer (BAD_SIZE), a bad file (CORRUPT), or a whole extent
    (a MISS, :data:`NAMED_EXTENT`)."""
    header = unpack_header(page) if page is not None else None
    if header is None and page is not None and disk_extents.starts_a_table(page):
        return Status.MISS, NAMED_EXTENT
    if header is None or header.key != key:
        return Status.CORRUPT, "unreadable header or wrong key"
    if size != PAGE + round_up(header.payload_nbytes):
        return Status.CORRUPT, "file size differs from its header (truncated?)"
    return Status.BAD_SIZE, ""
