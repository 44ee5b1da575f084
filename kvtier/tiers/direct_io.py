"""Aligned block I/O for file tiers: O_DIRECT where the file system allows it.

A block file is one header page (:data:`PAGE` bytes) followed by the payload
padded to a whole page, so that every read and write is page aligned and can
bypass the page cache. :class:`BlockIO` owns the page-aligned staging buffers
(anonymous mmaps, allocated once and leased per operation) and one small
thread pool that overlaps hashing and copies with the I/O: ``os.pwrite``,
``os.preadv``, ``numpy.copyto`` and xxh3 all release the GIL on large buffers.

* Writes come straight from the caller's buffer when it is page aligned (hashed
  on a helper during the write); other buffers go through two staging chunks,
  one copied and hashed while the other is written.
* Reads go straight into the caller's buffer when it is page aligned (the last
  partial page through a staging page). A small block is one ``preadv``, then
  hashed; a large one is read in a few shrinking pieces, one request in flight,
  piece k hashed on a helper while k+1 is read (:func:`read_pieces`).
  :meth:`BlockIO.read_many` reads many small blocks back to back while a helper
  verifies the request before (its blocks at once: :class:`RunOutcome`). Other buffers go through staging
  chunks, chunk k copied and hashed while k+1 is read.
* Payloads made or taken chunk by chunk (a sealed block, sealed or opened as it
  goes) use the same staging: ``write_filled`` / ``read_drained`` run the caller's
  fill / drain on the helper where a copy would run.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import queue
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.child_process import host_tag, process_gone
from kvtier.core.thread_pools import started_pool
from kvtier.private_files import FILE_MODE

PAGE = 4096  #: alignment of file offsets, lengths and buffers (>= any logical block size)
CHUNK = 2 << 20  #: staging chunk for buffers that are not page aligned
#: below this, handing work to another thread costs more than the overlap saves
OVERLAP_MIN = 1 << 20
#: a direct read of a payload this large or larger goes in pieces, hashed behind the reads
PIECED_MIN = 4 << 20
#: the last piece of a pieced read: what is still to hash once the last read is in
LAST_PIECE = 512 << 10


def read_pieces(nbytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the payload pieces of a pieced read: each piece three quarters
    of what is left (page multiples), down to at most :data:`LAST_PIECE` (which may end
    mid-page). Few pieces, because each new request starts on an idle device; shrinking,
    because hashing piece k (several times faster than reading it) hides behind reading
    piece k+1, a quarter of its size, and little is left to hash after the last read."""
    pieces = []
    off = 0
    while nbytes - off > LAST_PIECE:
        length = max(PAGE, (nbytes - off) * 3 // 4 // PAGE * PAGE)
        pieces.append((off, length))
        off += length
    if off < nbytes or not pieces:
        pieces.append((off, nbytes - off))
    return pieces


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def as_bytes(buf, *, writable: bool = False) -> np.ndarray:
    """A flat uint8 numpy view of any C-contiguous buffer (no copy)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("block buffers must be C-contiguous; copy with numpy.ascontiguousarray")
    if writable and not arr.flags.writeable:
        raise ValueError("the output buffer is read-only; pass a writable buffer (e.g. numpy.empty)")
    return arr.reshape(-1).view(np.uint8)


def is_page_aligned(arr: np.ndarray) -> bool:
    try:  # a writable buffer's address through ctypes: a quarter of the cost of the array interface
        return ctypes.addressof(ctypes.c_char.from_buffer(arr)) % PAGE == 0
    except (TypeError, ValueError):  # read-only or empty
        return arr.__array_interface__["data"][0] % PAGE == 0


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned, already faulted-in uint8 buffer of ``nbytes`` (an anonymous mmap)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, max(round_up(nbytes), PAGE), flags=flags)
    return np.frombuffer(m, dtype=np.uint8)[:nbytes]


#: the size of a transparent huge page (x86-64, and arm64 with 4 KiB pages)
HUGE_PAGE = 2 << 20


def io_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned, already faulted-in uint8 buffer for direct I/O to land in or leave
    from (staging): from transparent huge pages where the kernel gives them (2 MiB aligned,
    advised before the first touch), else from plain pages as :func:`aligned_buffer`.

    Why: an ``O_DIRECT`` read pins every page of its buffer and hands the device one segment
    per physically contiguous run. Into 4 KiB pages a 1 MiB read is 256 segments; into a huge
    page, one. Measured on this project's VMs (virtio disk), 1 MiB reads two at a time into a
    64 MiB region ran 0.96-1.31 GiB/s on 4 KiB pages and 1.48-2.21 GiB/s on huge pages
    (``BENCHMARKS.md``). Small buffers gain nothing and would waste most of a huge page."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return aligned_buffer(nbytes)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, or the range gets small pages
    except OSError:  # THP off or unsupported: plain pages, as aligned_buffer
        pass
    whole = np.frombuffer(m, dtype=np.uint8)
    skip = -whole.__array_interface__["data"][0] % HUGE_PAGE  # the first huge page boundary
    buf = whole[skip : skip + size]
    buf[::PAGE] = 0  # fault it in now (a huge page at a time where given), not during a timed read
    return buf[:nbytes]


def temp_tag() -> str:
    """``random.pid.host`` for temp-file names, the host being :func:`~kvtier.child_process.host_tag`
    (host name and PID namespace): a later scan can tell a dead writer's files."""
    return f"{uuid.uuid4().hex[:8]}.{os.getpid()}.{host_tag()}"


def stale_temp(name: str, mtime: float, now: float, max_age_s: float) -> bool:
    """Whether temp file ``.<what>.<temp_tag()>.tmp`` belongs to a dead writer: its process is gone
    from this host and PID namespace, or it is older than any write takes. The name is checked
    first: a file named otherwise is not ours, however old (a scan never removes others' files)."""
    parts = name[1:-4].split(".", 3)
    if (not name.startswith(".") or not name.endswith(".tmp") or len(parts) != 4 or len(parts[1]) != 8
            or not all(c in "0123456789abcdef" for c in parts[1]) or not parts[2].isdigit()):
        return False  # not ours: leave it
    if now - mtime > max_age_s:
        return True
    # another node of a shared mount, or a container on this host with its own PID namespace (its
    # pids mean nothing here), or a name from before the tag (a host name only): only age tells
    pid, host = int(parts[2]), parts[3]
    return host == host_tag() and process_gone(pid)


class NotAFile(OSError):
    """What a block's path names is no regular file (a symbolic link, a FIFO, a device put
    there): nothing of ours, never read or written through."""


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """Open the regular file at ``path``: never through a symbolic link there (it may lead out of
    the tier's directory), never blocking on a FIFO or device put there (O_NONBLOCK for the open
    only: it is cleared again, whatever a file system makes of it). Raises :class:`NotAFile` for
    anything else, OSError as ``os.open`` does."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a link; EINVAL: O_DIRECT on a FIFO, for one
        if exc.errno == errno.ELOOP or not _is_regular(path):
            raise NotAFile(exc.errno, "not a regular file", path) from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFile(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return True  # gone too: the open's own error stands


#: errnos of a write the file system has no room for (full, or the user's quota spent)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def probe_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` accept O_DIRECT page-aligned writes and reads. Raises
    OSError where the probe's file cannot be written (a :data:`NO_ROOM` errno on a full file
    system: :func:`probe_direct_read` can tell then)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".probe.{temp_tag()}.tmp")
    buf = aligned_buffer(PAGE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def probe_direct_read(path: str) -> bool:
    """Whether an existing regular file (a page long at least) reads with O_DIRECT: the probe of a
    file system too full for :func:`probe_direct_io`'s page. Raises OSError (:class:`NotAFile`
    included) where the file cannot be opened or read for another reason."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [aligned_buffer(PAGE)], 0)
        finally:
            os.close(fd)
    except NotAFile:
        raise
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the open or the aligned read refused: no O_DIRECT here
            return False
        raise
    return True


def drop_cache(fd: int) -> None:
    """Ask the kernel to forget a file's cached pages, so that the next read is cold."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def pwrite_all(fd: int, buf, offset: int) -> None:
    """Write all of ``buf`` at ``offset``; a medium that takes nothing more raises ENOSPC."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write: no space left on device")
        done += n


@dataclass(frozen=True, slots=True)
class ReadJob:
    path: str
    #: page aligned, exactly the payload's size; None for :meth:`BlockIO.read_many_staged`
    out: np.ndarray | None
    #: where the block starts in its file: None for a file of its own (whose size must be the
    #: block's); an offset for a block packed in a larger file (which must reach its end)
    offset: int | None = None
    size: int = 0  #: the payload's size where there is no ``out``

    @property
    def nbytes(self) -> int:
        return self.out.nbytes if self.out is not None else self.size

    @property
    def nbytes_on_disk(self) -> int:
        return PAGE + round_up(self.nbytes)


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """What :meth:`BlockIO.read_many` did with one file (the caller judges the bytes)."""

    error: OSError | None = None  #: opening or reading failed (FileNotFoundError: gone)
    inode: os.stat_result | None = None
    page: np.ndarray | None = None  #: the header page as read
    #: header page and payload read whole; for a file of another size, the header page read
    complete: bool = False


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What :meth:`BlockIO.read_many` did with one request: jobs ``first .. first + count - 1``
    (a run packed in one file, or one file of its own). Per block it is the
    :class:`ReadOutcome` that :meth:`outcome` gives; a caller verifying many small blocks reads
    the header pages together from ``pages`` instead."""

    first: int
    pages: np.ndarray  #: ``(count, PAGE)``: each block's header page as read
    #: how many of the jobs, from the first, were read whole (for a file of its own of another
    #: size than its job's: only its header page was read, and 1 says it was read whole)
    complete: int
    inode: os.stat_result | None = None
    error: OSError | None = None  #: opening or reading failed (FileNotFoundError: gone)
    #: :meth:`BlockIO.read_many_staged`: each job's payload as read, views of the staging
    #: (valid during the judge's call only); None where the payloads landed in the jobs' ``out``
    payloads: tuple[np.ndarray, ...] | None = None

    @property
    def count(self) -> int:
        return len(self.pages)

    def outcome(self, m: int) -> ReadOutcome:
        """The outcome of the request's ``m``-th job."""
        if self.error is not None:
            return ReadOutcome(error=self.error)
        return ReadOutcome(inode=self.inode, page=self.pages[m], complete=m < self.complete)


class _Lease:
    """One operation's staging: a header page and a tail page, and two chunks on huge pages (:func:`io_buffer`)."""

    __slots__ = ("page", "tail", "chunks", "ring")

    def __init__(self, chunk_bytes: int) -> None:
        pages = aligned_buffer(2 * PAGE)
        self.page = pages[:PAGE]
        self.tail = pages[PAGE:]
        #: staged reads, and a run's header pages (read_many); one ring for read_many_staged
        self.ring = io_buffer(2 * chunk_bytes)
        self.chunks = (self.ring[:chunk_bytes], self.ring[chunk_bytes:])


#: ``fill(offset, view)``: put payload bytes ``[offset, offset + len(view))`` into ``view``
Fill = Callable[[int, np.ndarray], None]
#: ``drain(offset, view)``: take payload bytes ``[offset, offset + len(view))`` from ``view``
Drain = Callable[[int, np.ndarray], None]


def _drain_stage(drain: Drain, hasher, off: int, staged: np.ndarray) -> None:
    """Helper side of a staged read: hand staged bytes on, hash them (still in cache)."""
    drain(off, staged)
    hasher.update(staged)


def _fill_stage(fill: Fill, hasher, off: int, length: int, stage: np.ndarray) -> None:
    """Helper side of a staged write: fill one chunk of page-aligned staging, zero-pad, hash."""
    view = stage[:length]
    fill(off, view)
    stage[length : round_up(length)] = 0
    hasher.update(view)


def copy_from(data: np.ndarray) -> Fill:
    return lambda off, view: np.copyto(view, data[off : off + view.nbytes])


def copy_into(out: np.ndarray) -> Drain:
    return lambda off, view: np.copyto(out[off : off + view.nbytes], view)


class BlockIO:
    """Reads and writes block files (header page + padded payload). Thread safe.

    ``leases`` operations run at once; more wait for a free set of staging
    buffers, so memory stays bounded at ``leases * (2 * chunk_bytes + 8 KiB)``.
    Buffers passed in stay owned by the caller and are not retained.
    """

    def __init__(self, direct: bool, *, chunk_bytes: int = CHUNK, leases: int = 4) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE}, got {chunk_bytes}")
        self.direct = direct
        self.chunk_bytes = chunk_bytes
        self._leases: queue.LifoQueue[_Lease] = queue.LifoQueue()
        for _ in range(leases):
            self._leases.put(_Lease(chunk_bytes))
        # One task per lease is in flight at most, so this pool never starves. Started now: the
        # helpers verify behind the first load's reads, which should not wait for their start.
        self._pool = started_pool(leases, "kvtier-disk")

    def open_write(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        return os.open(path, flags, FILE_MODE)  # blocks are prompts in another form: owner only

    def open_read(self, path: str) -> int:
        """A block's file (or extent) opened for reading: see :func:`open_regular`."""
        return open_regular(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))

    @contextmanager
    def _lease(self):
        lease = self._leases.get()
        try:
            yield lease
        finally:
            self._leases.put(lease)

    # -- write -------------------------------------------------------------------
    # NOTE: the calling thread always does the I/O and helpers only hash or copy
    # ahead of it: on a busy machine a woken thread may wait milliseconds for a
    # core, which is harmless beside a long pwrite but not in front of one.
    def write(self, fd: int, data: np.ndarray, header: Callable[[bytes], bytes], *, base: int = 0,
              sync: bool = True) -> None:
        """Write payload ``data`` after the header page, then ``header(xxh3-128 digest)``
        into the header page, then fsync (unless not ``sync``: a caller writing several
        blocks into one file syncs once). ``base``: where the block starts in the file
        (a page multiple). Raises OSError (e.g. ENOSPC) on failure."""
        with self._lease() as lease:
            if is_page_aligned(data):
                digest = self._write_direct(fd, data, lease, base)
            else:
                digest = self._write_chunks(fd, data.nbytes, copy_from(data), lease, base)
            self._write_header(fd, header(digest), lease, base)
        if sync:
            os.fsync(fd)

    def write_filled(self, fd: int, nbytes: int, fill: Fill, header: Callable[[bytes], bytes], *,
                     sync: bool = True) -> None:
        """:meth:`write` of an ``nbytes`` payload that ``fill`` produces chunk by chunk, in order,
        on a helper while the chunk before is written (e.g. sealed as it goes); fsync'd unless not
        ``sync`` (the caller syncs: e.g. after counting the written bytes as on the medium)."""
        with self._lease() as lease:
            digest = self._write_chunks(fd, nbytes, fill, lease)
            self._write_header(fd, header(digest), lease)
        if sync:
            os.fsync(fd)

    @staticmethod
    def _write_header(fd: int, head: bytes, lease: _Lease, base: int = 0) -> None:
        lease.page[:] = 0
        lease.page[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        pwrite_all(fd, lease.page, base)

    def _write_direct(self, fd: int, data: np.ndarray, lease: _Lease, base: int = 0) -> bytes:
        hashing = self._pool.submit(xxhash.xxh3_128_digest, data) if data.nbytes >= OVERLAP_MIN else None
        try:
            full = data.nbytes - data.nbytes % PAGE
            if full:
                pwrite_all(fd, data[:full], base + PAGE)
            tail = data.nbytes - full
            if tail:
                lease.tail[tail:] = 0
                np.copyto(lease.tail[:tail], data[full:])
                pwrite_all(fd, lease.tail, base + PAGE + full)
        finally:
            digest = hashing.result() if hashing is not None else None
        return digest if digest is not None else xxhash.xxh3_128_digest(data)

    def _write_chunks(self, fd: int, nbytes: int, fill: Fill, lease: _Lease, base: int = 0) -> bytes:
        """Chunk k+1 is filled into staging and hashed on a helper while chunk k is written."""
        hasher = xxhash.xxh3_128()
        chunk = self.chunk_bytes
        offsets = range(0, nbytes, chunk)
        if not offsets:
            return hasher.digest()
        _fill_stage(fill, hasher, 0, min(chunk, nbytes), lease.chunks[0])
        for k, off in enumerate(offsets):
            nxt = off + chunk
            ahead = None
            if nxt < nbytes:
                stage = lease.chunks[(k + 1) % 2]
                ahead = self._pool.submit(_fill_stage, fill, hasher, nxt, min(chunk, nbytes - nxt), stage)
            try:
                length = round_up(min(chunk, nbytes - off))
                pwrite_all(fd, lease.chunks[k % 2][:length], base + PAGE + off)
            finally:
                if ahead is not None:
                    ahead.result()  # never leave a helper on a lease we return
        return hasher.digest()

    # -- read --------------------------------------------------------------------
    def read(self, fd: int, out: np.ndarray, accept_header: Callable[[np.ndarray], bool], *,
             base: int = 0) -> bytes | None:
        """Read a block (at ``base`` in its file) into ``out`` (exactly the payload size) and
        return the xxh3-128 digest of what was read; None when the file is short or
        ``accept_header(header_page)`` rejects the header.
        ``out``'s content is unspecified unless the caller's checks pass."""
        with self._lease() as lease:
            if is_page_aligned(out):
                return self._read_direct(fd, out, accept_header, lease, base)
            return self._read_chunks(fd, out.nbytes, copy_into(out), accept_header, lease, base)

    def read_many(self, jobs: Sequence[ReadJob], judge: Callable[[RunOutcome], None]) -> None:
        """Read small blocks back to back, one request in flight, on the calling thread, while a
        helper runs ``judge(run outcome)`` on each request read before, in order (verifying its
        blocks, say). Returns when every job is judged; the first exception a ``judge`` raised is
        raised here (the reads stop; judged ones stay judged).

        A *run* of jobs, blocks packed one after another in one file (each job's ``offset`` the
        end of the one before), is read with one request: one ``preadv`` of every block's header
        page and payload. A block of a file of its own is one request.

        A job's ``out`` (page aligned) holds the block's payload when ``judge`` sees it; an
        outcome's ``pages`` (the header pages) are valid during that call only. Of a file of
        another size than the job's only the header page is read. (The reads stay on the calling
        thread: on a busy machine a woken helper may wait milliseconds for a core, which delays
        only the verification behind the reads, not the device.) The last request's blocks are
        judged on the calling thread once the helper is done with the others: nothing is left to
        read behind them, and the helper needs no wake-up to take them nor the caller one to learn
        that they are judged (a request alone needs no helper at all)."""
        with self._lease() as lease:
            # staging that direct reads leave unused: header pages, and the tails of payloads
            # that end mid-page (a run's request lands them there)
            pages, tails = lease.chunks
            group = pages.nbytes // PAGE
            for first in range(0, len(jobs), group):
                self._read_group(jobs, first, min(len(jobs), first + group), pages, tails, judge)

    def _read_group(self, jobs, first: int, end: int, pages: np.ndarray, tails: np.ndarray, judge) -> None:
        requests = []  # (start, stop) of each request's jobs
        i = first
        while i < end:
            requests.append((i, _run_end(jobs, i, end)))
            i = requests[-1][1]
        heads = pages[: (end - first) * PAGE].reshape(end - first, PAGE)  # a header page per job

        def slot(region: np.ndarray, i: int) -> np.ndarray:
            return region[(i - first) * PAGE : (i - first + 1) * PAGE]

        extents: dict[str, tuple[int, os.stat_result] | OSError] = {}  # one open per packed file

        def read(r: int) -> RunOutcome:
            i, stop = requests[r]
            if stop == i + 1 and jobs[i].offset is None:
                return self._read_one(i, jobs[i], heads[i - first : i - first + 1], slot(tails, i))
            return self._read_run(i, jobs[i:stop], heads[i - first : stop - first], tails[(i - first) * PAGE:], extents)

        try:
            self._judged_behind(len(requests), read, judge)
        finally:
            _close_opened(extents)

    def _judged_behind(self, count: int, read: Callable[[int], RunOutcome], judge: Callable[[RunOutcome], None],
                       need: Callable[[int], int] | None = None) -> None:
        """Requests ``0 .. count - 1``: ``read(r)`` each on this thread while a helper runs ``judge``
        on each one read before, in order; the last is judged here once the helper is done. With
        ``need``, request ``r`` is read only once ``need(r)`` requests are judged (it lands where
        they did). The first exception a ``judge`` raised is raised here; the reads stop at it."""
        last = count - 1  # the helper judges the requests before this one; the caller, it
        judged = [0]  # requests judged, in order
        freed = threading.Condition()
        done: queue.SimpleQueue = queue.SimpleQueue()
        failed: list[BaseException] = []

        def judging() -> None:
            for _ in range(last):  # exits by itself after its last one: no wake-up to stop it
                batch = done.get()  # one request's blocks: a wake-up per request, not per block
                if batch is None:
                    return  # the reads stopped
                try:
                    if not failed:
                        judge(batch)
                except BaseException as exc:  # handed to the caller
                    failed.append(exc)
                finally:
                    if need is not None:
                        with freed:
                            judged[0] += 1
                            freed.notify()

        helper = self._pool.submit(judging) if last > 0 else None
        batch = None
        try:
            for r in range(count):
                if need is not None:
                    wanted = need(r)
                    with freed:
                        freed.wait_for(lambda: judged[0] >= wanted or failed)
                if failed:
                    break
                batch = read(r)
                if r < last:
                    done.put(batch)
                    batch = None
        finally:
            done.put(None)  # a no-op if the helper had every request: it stopped after its last
            if helper is not None:
                helper.result()  # never leave a helper on a lease (or a caller's buffer) we return
        if batch is not None and not failed:  # the last request, in order after the helper's
            judge(batch)
        if failed:
            raise failed[0]

    def stages(self, nbytes: int) -> bool:
        """Whether :meth:`read_many_staged` can read a block of an ``nbytes`` payload."""
        return PAGE + round_up(nbytes) <= self.chunk_bytes

    def read_many_staged(self, jobs: Sequence[ReadJob], judge: Callable[[RunOutcome], None]) -> None:
        """:meth:`read_many` of jobs without an ``out``: each request lands whole, header pages and
        payloads as on disk, in a lease's staging (its two chunks as one ring, requests one after
        another), and ``judge`` gets its payloads as views of it (``RunOutcome.payloads``), valid
        during that call only: once it returns, later requests may land there. A request waits
        for the judging of the ones whose place it takes (a ring of 4 MiB holds three 1 MiB
        requests: two in hand while one is read). Every job must fit a chunk (:meth:`stages`).

        Why: the caller copies the blocks on anyway (into an engine's KV cache, say); a read into
        memory it reuses at once ran 1.3-1.4x faster on this project's VMs than into a place of its
        own, even on huge pages (``BENCHMARKS.md``), and the copy then reads the bytes from cache."""
        if any(not self.stages(job.nbytes) for job in jobs):
            raise ValueError(f"read_many_staged: a block larger than a staging chunk ({self.chunk_bytes} bytes)")
        with self._lease() as lease:
            self._read_staged(jobs, lease.ring, judge)

    def _read_staged(self, jobs: Sequence[ReadJob], ring: np.ndarray, judge) -> None:
        requests = []  # (start, stop) of each request's jobs: a run that fits a chunk
        i = 0
        while i < len(jobs):
            requests.append((i, _run_end(jobs, i, len(jobs), self.chunk_bytes)))
            i = requests[-1][1]
        if not requests:
            return
        # where each request lands in the ring: after the one before, or back at the start
        places, at = [], 0
        for i, stop in requests:
            size = sum(job.nbytes_on_disk for job in jobs[i:stop])
            if at + size > ring.nbytes:
                at = 0
            places.append((at, at + size))
            at += size

        def overlapped(r: int) -> int:
            """How many requests must be judged before request ``r`` may land: up to the last
            one before it whose place overlaps its own."""
            start, end = places[r]
            for q in range(r - 1, -1, -1):
                if places[q][0] < end and start < places[q][1]:
                    return q + 1
            return 0

        opened: dict[str, tuple[int, os.stat_result] | OSError] = {}  # one open per packed file

        def read(r: int) -> RunOutcome:
            (i, stop), (start, end) = requests[r], places[r]
            return self._read_image(i, jobs[i:stop], ring[start:end], opened)

        try:
            self._judged_behind(len(requests), read, judge, need=overlapped)
        finally:
            _close_opened(opened)

    def _read_image(self, i: int, run: Sequence[ReadJob], chunk: np.ndarray, opened: dict) -> RunOutcome:
        """Jobs ``i ..`` (a packed run, or a file of its own) read as on disk into ``chunk`` with one
        request of one buffer. A file of its own of another size than its job's: its header page only."""
        starts, upto = [], 0
        for job in run:
            starts.append(upto)
            upto += job.nbytes_on_disk
        pages = np.empty((len(run), PAGE), dtype=np.uint8)  # each header page, copied out of the chunk
        payloads = tuple(chunk[start + PAGE : start + PAGE + job.nbytes] for start, job in zip(starts, run))
        own = run[0].offset is None
        try:
            if own:
                fd = self.open_read(run[0].path)
                try:
                    inode = os.fstat(fd)
                    if inode.st_size != upto:  # the header says whose mistake: read it alone
                        complete = int(os.preadv(fd, [chunk[:PAGE]], 0) == PAGE)
                        pages[0] = chunk[:PAGE]
                        return RunOutcome(i, pages, complete, inode, payloads=payloads)
                    got = os.preadv(fd, [chunk[:upto]], 0)
                finally:
                    os.close(fd)
            else:
                opened_ = self._opened(run[0].path, opened)
                if isinstance(opened_, OSError):
                    return RunOutcome(i, pages, 0, error=opened_, payloads=payloads)
                fd, inode = opened_
                got = os.preadv(fd, [chunk[:upto]], run[0].offset)
        except OSError as exc:
            return RunOutcome(i, pages, 0, error=exc, payloads=payloads)
        ends = starts[1:] + [upto]
        complete = len(run) if got >= upto else bisect.bisect_right(ends, got)
        for m, start in enumerate(starts):
            pages[m] = chunk[start : start + PAGE]
        return RunOutcome(i, pages, complete, inode, payloads=payloads)

    def _opened(self, path: str, opened: dict) -> tuple[int, os.stat_result] | OSError:
        """``(fd, inode)`` of ``path`` opened for reading once per call (``opened`` keeps it), or the error."""
        if path not in opened:
            try:
                fd = self.open_read(path)
            except OSError as exc:
                opened[path] = exc
            else:
                try:
                    opened[path] = (fd, os.fstat(fd))
                except OSError as exc:
                    os.close(fd)
                    opened[path] = exc
        return opened[path]

    def _read_one(self, i: int, job: ReadJob, head: np.ndarray, tail: np.ndarray) -> RunOutcome:
        """Job ``i``, a file of its own (``head``: its ``(1, PAGE)`` header page)."""
        try:
            fd = self.open_read(job.path)
        except OSError as exc:
            return RunOutcome(i, head, 0, error=exc)
        try:
            inode = os.fstat(fd)
            want = job.nbytes_on_disk
            if inode.st_size != want:  # the header says whose mistake: read it alone
                return RunOutcome(i, head, int(os.preadv(fd, [head[0]], 0) == PAGE), inode)
            iov, finish = _block_iov(job.out, head[0], tail)
            got = os.preadv(fd, iov, 0)
            if got == want:
                finish()
            return RunOutcome(i, head, int(got == want), inode)
        except OSError as exc:
            return RunOutcome(i, head, 0, error=exc)
        finally:
            os.close(fd)

    def _read_run(self, i: int, run: Sequence[ReadJob], heads: np.ndarray, tails: np.ndarray,
                  opened: dict) -> RunOutcome:
        """One request for jobs ``i ..``, blocks packed back to back in one file (a block the file
        does not hold whole is incomplete). ``heads``: a header page per job; ``tails``: a page
        per job for payloads that end mid-page. ``opened``: path → (fd, inode) or the error
        opening it, kept by the caller for the runs after (it closes them)."""
        fd_inode = self._opened(run[0].path, opened)
        if isinstance(fd_inode, OSError):
            return RunOutcome(i, heads, 0, error=fd_inode)
        fd, inode = fd_inode
        iov, finishes, ends, upto = [], [], [], 0
        for m, job in enumerate(run):
            out = job.out
            n = out.nbytes
            if n % PAGE == 0 and n:  # the usual block: header page and payload land in place
                iov.append(heads[m])
                iov.append(out)
                upto += PAGE + n
            else:
                vecs, finish = _block_iov(out, heads[m], tails[m * PAGE : (m + 1) * PAGE])
                iov.extend(vecs)
                finishes.append((m, finish))
                upto += PAGE + round_up(n)
            ends.append(upto)
        try:
            got = os.preadv(fd, iov, run[0].offset)
        except OSError as exc:
            return RunOutcome(i, heads, 0, error=exc)
        complete = len(run) if got >= upto else bisect.bisect_right(ends, got)
        for m, finish in finishes:
            if m < complete:
                finish()
        return RunOutcome(i, heads, complete, inode)

    def read_drained(self, fd: int, nbytes: int, drain: Drain,
                     accept_header: Callable[[np.ndarray], bool], *, base: int = 0) -> bytes | None:
        """:meth:`read` of an ``nbytes`` payload handed to ``drain`` chunk by chunk, in order,
        on a helper while the next chunk is read (e.g. opened as it comes)."""
        with self._lease() as lease:
            return self._read_chunks(fd, nbytes, drain, accept_header, lease, base)

    def _read_direct(self, fd, out, accept_header, lease, base: int = 0) -> bytes | None:
        n = out.nbytes
        if n >= PIECED_MIN:
            return self._read_pieces(fd, out, accept_header, lease, base)
        # One preadv for the whole file, then one hash: for small blocks, smaller
        # I/Os cost more than the hash they would hide.
        full = n - n % PAGE
        iov = [lease.page, out[:full]] if full else [lease.page]
        if full < n:
            iov.append(lease.tail)
        if os.preadv(fd, iov, base) != PAGE + round_up(n):
            return None
        if not accept_header(lease.page):
            return None
        np.copyto(out[full:], lease.tail[: n - full])
        return xxhash.xxh3_128_digest(out)

    def _read_pieces(self, fd, out, accept_header, lease, base: int = 0) -> bytes | None:
        """Pieces read back to back here, one request in flight; a helper hashes each piece
        read while the next is read. (The reads stay on this thread: a woken helper may wait
        for a core on a busy machine, which then delays the hash, never the device.)"""
        n = out.nbytes
        full = n - n % PAGE
        hasher = xxhash.xxh3_128()
        read: queue.SimpleQueue = queue.SimpleQueue()

        def hashing() -> None:
            while (piece := read.get()) is not None:
                hasher.update(piece)

        helper = None
        try:
            for off, length in read_pieces(n):
                end = min(off + length, full)
                iov = [lease.page] if off == 0 else []
                if end > off:
                    iov.append(out[off:end])
                if off + length > full:  # the last partial page, through staging
                    iov.append(lease.tail)
                if os.preadv(fd, iov, base + (0 if off == 0 else PAGE + off)) != sum(v.nbytes for v in iov):
                    return None
                if off == 0:
                    if not accept_header(lease.page):
                        return None
                    helper = self._pool.submit(hashing)
                if off + length > full:
                    np.copyto(out[full:], lease.tail[: n - full])
                read.put(out[off : off + length])
        finally:
            read.put(None)
            if helper is not None:
                helper.result()  # never leave a helper on a buffer we return
        return hasher.digest()

    def _read_chunks(self, fd, n: int, drain: Drain, accept_header, lease, base: int = 0) -> bytes | None:
        """Chunk k is drained and hashed on a helper while chunk k+1 is read."""
        hasher = xxhash.xxh3_128()
        pending: Future | None = None
        try:
            off, k = 0, 0
            while k == 0 or off < n:
                length = min(self.chunk_bytes, n - off)
                stage = lease.chunks[k % 2]
                iov = [lease.page, stage[: round_up(length)]] if k == 0 else [stage[: round_up(length)]]
                want = sum(v.nbytes for v in iov)
                if os.preadv(fd, iov, base + (0 if k == 0 else PAGE + off)) != want:
                    return None
                if k == 0 and not accept_header(lease.page):
                    return None
                if pending is not None:
                    pending.result()
                if n >= OVERLAP_MIN:
                    pending = self._pool.submit(_drain_stage, drain, hasher, off, stage[:length])
                else:
                    _drain_stage(drain, hasher, off, stage[:length])
                off += length
                k += 1
        finally:
            if pending is not None:
                pending.result()
        return hasher.digest()

    def read_header_page(self, fd: int, base: int = 0) -> bytes | None:
        """The header page of the block at ``base`` (a copy), or None if the file is shorter."""
        with self._lease() as lease:
            if os.preadv(fd, [lease.page], base) != PAGE:
                return None
            return lease.page.tobytes()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


#: at most this many buffers in one ``preadv`` (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024
#: a run of packed blocks is read in requests of about this many bytes: large enough that a
#: request costs little beside its bytes, small enough that verifying one request's blocks
#: (hashing runs ~3x faster than the reads) hides behind the next request, leaving only the
#: last one's to wait for
RUN_REQUEST_BYTES = 1 << 20


def run_request_blocks(payload_nbytes: int) -> int:
    """How many packed blocks of ``payload_nbytes`` one request of a run reads (see :func:`_run_end`)."""
    return max(1, -(-RUN_REQUEST_BYTES // (PAGE + round_up(payload_nbytes))))


def _run_end(jobs: Sequence[ReadJob], i: int, end: int, most_bytes: int | None = None) -> int:
    """The end of the run of packed blocks that starts at job ``i``: same file, each starting where
    the one before ends, about :data:`RUN_REQUEST_BYTES` in all (at least one block), at most
    :data:`_IOV_MAX` buffers, and at most ``most_bytes`` on disk (a staging chunk) when given."""
    if jobs[i].offset is None:
        return i + 1
    vecs = 3
    nbytes = jobs[i].nbytes_on_disk
    j = i + 1
    while (j < end and nbytes < RUN_REQUEST_BYTES and jobs[j].offset is not None and jobs[j].path == jobs[i].path
           and vecs + 3 <= _IOV_MAX and jobs[j].offset == jobs[j - 1].offset + jobs[j - 1].nbytes_on_disk
           and (most_bytes is None or nbytes + jobs[j].nbytes_on_disk <= most_bytes)):
        vecs += 3
        nbytes += jobs[j].nbytes_on_disk
        j += 1
    return j


def _close_opened(opened: dict) -> None:
    """Close the files of a ``path -> (fd, inode) | OSError`` map (:meth:`BlockIO._opened`)."""
    for fd_inode in opened.values():
        if not isinstance(fd_inode, OSError):
            os.close(fd_inode[0])


def _block_iov(out: np.ndarray, page: np.ndarray, tail: np.ndarray):
    """The buffers one block's bytes on disk land in (header page, payload, a staged last partial
    page) and what to do once they are read (copy the tail into ``out``)."""
    n = out.nbytes
    full = n - n % PAGE
    iov = [page, out[:full]] if full else [page]
    if full == n:
        return iov, _nothing
    iov.append(tail)
    return iov, lambda: np.copyto(out[full:], tail[: n - full])


def _nothing() -> None:
    pass
