"""The fleet journal's file: what ``kvtier serve`` placed in a Mooncake fleet, one record per block.

``<state_dir>/fleet.journal`` (0600, never through a symbolic link) is a magic line, then
entries appended one ``write`` each: ``P`` (placed), the block's name (32 bytes), a u32 length
and its record; ``F`` (forgotten) and the name. A placement is fsync'd before it returns; a
forgetting is not (one lost to a power cut names a block the next start looks up and finds
gone, or one whose removal was owed). A torn last entry (a crash while appending) is cut off at
open; what came before is whole. The file is written anew (temp, fsync, rename) with the live
records only: at start; after an admin erasure (:meth:`FleetJournal.compact`), so that no record
of an erased block (owner, namespace, session, the client's key: in clear without encryption at
rest) stays in the file; and whenever forgotten entries outnumber the live records and number
more than :data:`_COMPACT_AFTER` -- a rewrite costs O(live records), so it comes at most once per
that many forgettings and once per as many as there are live records: O(1) each, amortised.

What a record says and who writes it: :mod:`kvtier.server.fleet`.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Sequence

from kvtier.errors import ConfigError
from kvtier.private_files import FILE_MODE, fsync_dir, make_private_dirs

log = logging.getLogger(__name__)

JOURNAL_FILE = "fleet.journal"
_MAGIC = b"kvtier fleet journal v1\n"
_PLACED, _FORGOTTEN = b"P", b"F"  # an entry: kind, name (32 bytes), then for P a u32 length and the record
_NAME_NBYTES = 32
_LEN = struct.Struct("<I")
_MAX_RECORD = 64 << 10
#: forgotten entries the file may carry before it is written anew (and at least as many as live records)
_COMPACT_AFTER = 4096


class FleetJournal:
    """The records of the blocks placed in the fleet, by the name the fleet tier stores them under.
    Thread safe. Appends are one ``write`` each; a placement is fsync'd before it returns, a
    forgetting is not (a forgotten record that comes back after a power cut names a block the
    start's lookup finds gone, or one whose removal was owed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._live: dict[bytes, bytes] = {}  # name → record
        self._written_for: dict[bytes, object] = {}  # name → the index entry its record was made from
        self._placed_seq: dict[bytes, int] = {}  # name → the placement that last wrote it
        self._seq = 0
        self._dead = 0  # forgotten (or overwritten) records still in the file
        self._fd: int | None = None
        self._size = 0
        try:
            make_private_dirs(os.path.dirname(path) or ".")
            # never through a symbolic link; created 0600
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
            try:
                whole = self._read(fd)
                if whole == 0:  # a new journal (or one whose creation a crash cut short)
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    _write_all(fd, _MAGIC)
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path) or ".")
                    whole = len(_MAGIC)
                os.ftruncate(fd, whole)  # a torn last append goes: what is appended next must be readable
                os.lseek(fd, whole, os.SEEK_SET)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            raise ConfigError(f"fleet journal {path!r}: {exc}; give the server a state_dir (or disk_dir) it can "
                              f"write: the journal is what lets erase and TTL reach the blocks it placed in the "
                              f"Mooncake fleet after a restart") from None
        self._fd, self._size = fd, whole

    def _read(self, fd: int) -> int:
        """Load the file's records; returns how many of its bytes are whole entries (0: empty)."""
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        if _MAGIC.startswith(data):  # empty, or its first write cut short
            return 0
        if not data.startswith(_MAGIC):
            raise ConfigError(f"fleet journal {self.path!r} is not a kvtier fleet journal; move it away (blocks "
                              f"it names in the Mooncake fleet are then left to the fleet's own eviction)")
        pos, end = len(_MAGIC), len(data)
        while pos < end:
            kind, name_end = data[pos:pos + 1], pos + 1 + _NAME_NBYTES
            if kind not in (_PLACED, _FORGOTTEN) or name_end > end:
                break
            name = data[pos + 1:name_end]
            if kind == _FORGOTTEN:
                self._dead += 1 + (self._live.pop(name, None) is not None)
                pos = name_end
                continue
            if name_end + _LEN.size > end:
                break
            (n,) = _LEN.unpack_from(data, name_end)
            start = name_end + _LEN.size
            if n > _MAX_RECORD or start + n > end:
                break
            if name in self._live:
                self._dead += 1
            self._live[name] = data[start:start + n]
            pos = start + n
        if pos < end:  # a torn last append (a crash while writing it): what came before is whole
            log.warning("fleet journal %s: %d bytes at its end are not a whole record; ignored", self.path, end - pos)
            self._dead += 1
        return pos

    # -- reads (at start) ------------------------------------------------------------------------
    def records(self) -> list[tuple[bytes, bytes]]:
        """(name, record) of every live record."""
        with self._lock:
            return list(self._live.items())

    def __len__(self) -> int:
        return len(self._live)

    @property
    def seq(self) -> int:
        """A number that grows with each placement (see :meth:`forget`)."""
        return self._seq

    # -- writes ----------------------------------------------------------------------------------
    def rewrite(self) -> None:
        """Write the live records anew (temp + fsync + rename) and append after them from now on."""
        with self._lock:
            self._rewrite_locked()

    def compact(self) -> bool:
        """Write the file anew if it holds any forgotten entry (an erasure's: its records must not
        stay readable in the file); returns whether it did. Raises OSError if it could not."""
        with self._lock:
            if not self._dead:
                return False
            self._rewrite_locked()
            return True

    def _rewrite_locked(self) -> None:
        parts = [_MAGIC]
        for name, record in self._live.items():
            parts += [_PLACED, name, _LEN.pack(len(record)), record]
        blob = b"".join(parts)
        temp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            _write_all(fd, blob)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(temp)
            raise
        os.replace(temp, self.path)
        fsync_dir(os.path.dirname(self.path) or ".")
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size, self._dead = fd, len(blob), 0
        os.lseek(fd, 0, os.SEEK_END)

    def placed(self, items: Sequence[tuple[bytes, bytes, object]]) -> None:
        """Record ``(name, record, entry)`` placements, durable before it returns (raises OSError
        otherwise: nothing then is to be stored). A name whose record was made from the same index
        entry is not written again."""
        with self._lock:
            todo = [(n, r, e) for n, r, e in items if self._written_for.get(n) is not e]
            self._seq += 1
            if todo:
                parts = []
                for name, record, _ in todo:
                    parts += [_PLACED, name, _LEN.pack(len(record)), record]
                self._append_locked(b"".join(parts), durable=True)  # raises: nothing is placed, nothing kept
                for name, record, entry in todo:
                    self._dead += name in self._live
                    self._live[name] = record
                    self._written_for[name] = entry
            # Only once recorded: a name whose append failed is never placed, and never reaches
            # ``_live``, so :meth:`forget` would never pop its entry here.
            for name, _, _ in items:
                self._placed_seq[name] = self._seq

    def forget(self, names: Sequence[bytes], since: int) -> None:
        """Forget the records of ``names`` whose blocks the fleet no longer holds, unless a
        placement of the name began after ``since`` (:attr:`seq` read before the delete): that
        copy may have landed after it. Best effort: a record that cannot be forgotten stays (the
        next start looks it up)."""
        with self._lock:
            gone = [n for n in names if n in self._live and self._placed_seq.get(n, 0) <= since]
            if not gone:
                return
            try:
                self._append_locked(b"".join(_FORGOTTEN + n for n in gone), durable=False)
            except OSError as exc:
                log.warning("fleet journal %s: could not forget %d records: %s", self.path, len(gone), exc)
                return
            for name in gone:
                del self._live[name]
                self._written_for.pop(name, None)
                self._placed_seq.pop(name, None)
            self._dead += 2 * len(gone)  # the P entry and its F
            if self._dead > max(_COMPACT_AFTER, len(self._live)):
                try:
                    self._rewrite_locked()
                except OSError as exc:
                    log.warning("fleet journal %s: could not be compacted: %s", self.path, exc)

    def _append_locked(self, blob: bytes, *, durable: bool) -> None:
        if self._fd is None:
            raise OSError(f"fleet journal {self.path} is not open")
        try:
            _write_all(self._fd, blob)
            if durable:
                os.fdatasync(self._fd)
        except OSError:
            # A torn append would end the file's readable part there: cut it off (else stop using it)
            try:
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            except OSError:
                os.close(self._fd)
                self._fd = None
            raise
        self._size += len(blob)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def journal_under(tier) -> FleetJournal | None:
    """The fleet journal of ``tier`` or of a tier it wraps (the server's fleet tier may be under a
    sealing tier); None if it has none."""
    while tier is not None:
        journal = getattr(tier, "journal", None)
        if isinstance(journal, FleetJournal):
            return journal
        tier = getattr(tier, "inner", None)
    return None


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]
