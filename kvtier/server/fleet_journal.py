"""The fleet journal's file: what ``kvtier serve`` placed in a Mooncake fleet, one record per block.

``<state_dir>/fleet.journal`` (0600, never through a symbolic link) is a magic line, then
entries appended one ``write`` each: ``P`` (placed), the block's name (32 bytes), a u32 length
and its record; ``F`` (forgotten) and the name; each entry ends with the xxh3-64 of what comes
before it in the entry. A placement is fsync'd before it returns; a forgetting is not (one lost
to a power cut names a block the next start looks up and finds gone, or one whose removal was
owed). At open, a bad entry that no whole entry follows is a torn last append (a crash while
writing it): it is cut off, and what came before is whole. A bad entry that whole entries follow
is damage (a flipped bit, a bad sector): it is skipped, the reading goes on at the next whole
entry, and the start goes on with every record but the damaged ones, logged (the blocks those
named are left to the fleet's own eviction); nothing after the damage is cut off. (Whole entries
are found again by their checksum; a record's bytes that imitate one -- a tenant's namespace,
say -- yield a record that does not authenticate at the start, :mod:`kvtier.server.fleet`.) A
damaged magic line that a whole entry follows, at once or after damaged bytes (one bad sector
may cover the magic and the first entries), is damage too (logged; the file is written anew at
open with a good one): only a file with no whole entry after its first line is refused -- but for
an empty journal (its first line alone) with at most :data:`_MAGIC_FLIPS_ACCEPTED` bits of it
flipped, which holds nothing at stake: opened empty, logged, written anew. A journal of the first
format (magic ``v1``: no checksums, so a bad entry ends the reading as a torn tail did) is read,
then written anew in this format at open: an upgrade loses no record. A first line that reads as
``v1`` but is followed by a whole checksummed entry, at once or after damaged bytes, is this
format's, damaged (two bits): read in this format, logged, written anew.

The file is written anew (temp, fsync, rename) with the live records only: at start; after an
admin erasure (:meth:`FleetJournal.compact`), so that no record of an erased block (owner,
namespace, session, the client's key: in clear without encryption at rest) stays in the file;
and whenever forgotten entries outnumber the live records and number more than
:data:`_COMPACT_AFTER` -- a rewrite costs O(live records), so it comes at most once per that many
forgettings and once per as many as there are live records: O(1) each, amortised.

What a record says and who writes it: :mod:`kvtier.server.fleet`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import threading
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from kvtier.errors import ConfigError
from kvtier.private_files import FILE_MODE, fsync_dir, make_private_dirs

log = logging.getLogger(__name__)

JOURNAL_FILE = "fleet.journal"
_MAGIC = b"kvtier fleet journal v2\n"
#: the first format's: the same entries without their checksums (read, then written anew)
_MAGIC_V1 = b"kvtier fleet journal v1\n"
_PLACED, _FORGOTTEN = b"P", b"F"  # an entry: kind, name (32 bytes), then for P a u32 length and the record
_NAME_NBYTES = 32
_LEN = struct.Struct("<I")
_CHECK_NBYTES = 8  # each entry's xxh3-64, after the rest of it
_KIND = re.compile(b"[PF]")  # where an entry may begin (the search for the next whole one)
_MAX_RECORD = 64 << 10
#: forgotten entries the file may carry before it is written anew (and at least as many as live records)
_COMPACT_AFTER = 4096
#: bits of an empty journal's magic line that may be flipped for it to be read as one (a bad bit or byte)
_MAGIC_FLIPS_ACCEPTED = 8


class FleetJournal:
    """The records of the blocks placed in the fleet, by the name the fleet tier stores them under.
    Thread safe. Appends are one ``write`` each; a placement is fsync'd before it returns, a
    forgetting is not (a forgotten record that comes back after a power cut names a block the
    start's lookup finds gone, or one whose removal was owed)."""

    def __init__(self, path: str) -> None:
        self._start_empty(path)
        try:
            make_private_dirs(os.path.dirname(path) or ".")
            # never through a symbolic link; created 0600
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
            try:
                whole, appendable = self._read(fd)
                if whole == 0:  # a new journal (or one whose creation a crash cut short)
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    _write_all(fd, _MAGIC)
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path) or ".")
                    whole, appendable = len(_MAGIC), True
                if appendable:
                    os.ftruncate(fd, whole)  # a torn last append goes: what is appended next must be readable
                    os.lseek(fd, whole, os.SEEK_SET)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._size = fd, whole
            if not appendable:  # the first format, or a damaged magic: appends must follow a good v2 head
                self._rewrite_locked()  # (on failure the old file stays as it was)
        except OSError as exc:
            self.close()
            raise ConfigError(f"fleet journal {path!r}: {exc}; give the server a state_dir (or disk_dir) it can "
                              f"write: the journal is what lets erase and TTL reach the blocks it placed in the "
                              f"Mooncake fleet after a restart") from None

    def _start_empty(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._live: dict[bytes, bytes] = {}  # name → record
        self._written_for: dict[bytes, object] = {}  # name → the index entry its record was made from
        self._placed_seq: dict[bytes, int] = {}  # name → the placement that last wrote it
        self._created_by: dict[bytes, int] = {}  # name → the placement its live record began with (none: read at open)
        self._seq = 0
        self._dead = 0  # forgotten (or overwritten) records still in the file
        self._fd: int | None = None
        self._size = 0

    @classmethod
    def records_in(cls, path: str) -> list[tuple[bytes, bytes]]:
        """(name, record) of every live record of the journal at ``path`` as an open reads them, but
        read only: nothing is created, cut off or written anew (no file: none). For a look before the
        server commits to a key (``kvtier.server.server``). Raises ConfigError for a file that is no
        journal, OSError for one that cannot be read (a symbolic link is not followed)."""
        reader = cls.__new__(cls)
        reader._start_empty(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            reader._read(fd)
        finally:
            os.close(fd)
        return reader.records()

    def _read(self, fd: int) -> tuple[int, bool]:
        """Load the file's records; returns how many of its bytes end in a whole entry (0: empty) and
        whether appends may follow them as the file is (else it is written anew at open: the first
        format, without checksums, or a damaged magic line)."""
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        if _MAGIC.startswith(data) or _MAGIC_V1.startswith(data):  # empty, or its first write cut short
            return 0, True
        check, appendable = _CHECK_NBYTES, True
        if not data.startswith(_MAGIC):  # the first format, or a damaged first line: written anew at open
            appendable = False
            if not data.startswith(_MAGIC_V1):
                self._check_damaged_magic(data)
            elif not self._v2_under_v1_magic(data):
                check = 0  # the first format: entries without checksums
        pos, end = len(_MAGIC), len(data)
        damaged = skipped = 0
        while pos < end:
            entry = _entry_at(data, pos, check)
            if entry is None:
                resume = _next_entry_after(data, pos, check) if check else None
                if resume is None:
                    break  # a torn last append (a crash while writing it): what came before is whole
                damaged += 1
                skipped += resume - pos
                self._dead += 1  # (a compaction writes the file without it)
                pos = resume
                continue
            self._load(entry)
            pos = entry.end
        if damaged:
            log.error("fleet journal %s: %d damaged entries skipped (%d bytes; whole entries follow them, so no "
                      "torn append): the blocks they named in the Mooncake fleet are left to its own eviction; "
                      "every other record is kept", self.path, damaged, skipped)
        if pos < end:
            log.warning("fleet journal %s: %d bytes at its end are not a whole record; ignored", self.path, end - pos)
            self._dead += 1
        return pos, appendable

    def _v2_under_v1_magic(self, data: bytes) -> bool:
        """Whether a file whose first line reads as the first format's holds this format's entries: a
        whole checksummed one right after it or further on (the v2 magic damaged into v1's: two bits;
        the bad sector may reach the first entries too, as in :meth:`_check_damaged_magic`). Read as
        v1, with no checksums, the reading would stop at the first entry's checksum, or at the first
        damaged entry, and the rewrite at open would keep what came before it only. (A v1 file holds
        something that reads as a whole checksummed entry with a chance of 2^-64 per place.)"""
        start = len(_MAGIC_V1)
        if _entry_at(data, start, _CHECK_NBYTES) is None and _next_entry_after(data, start, _CHECK_NBYTES) is None:
            return False
        log.error("fleet journal %s: its first line reads as the first format's, but checksummed entries follow "
                  "it: the first line is damaged; read in this format and written anew with a good first line",
                  self.path)
        return True

    def _check_damaged_magic(self, data: bytes) -> None:
        """Accept a file whose magic line is damaged (a flipped bit, a bad first sector) if a whole
        entry of this format follows it, right after it or further on (the damage may reach the
        first entries too; the reading then skips them as damaged): every entry carries its own
        checksum, so the damage is the file's, not another kind of file, and refusing the start would
        leave every block the journal names beyond the reach of erase and TTL. (Random bytes hold a
        whole entry with a chance of 2^-64 per place.) Raises ConfigError for a file that is no
        journal (no whole entry after its first line)."""
        start = len(_MAGIC)
        if _is_damaged_magic_alone(data):
            log.error("fleet journal %s: it holds no entry and its first line is damaged (%r): an empty journal, "
                      "written anew", self.path, data)
            return
        if _entry_at(data, start, _CHECK_NBYTES) is None and _next_entry_after(data, start, _CHECK_NBYTES) is None:
            raise ConfigError(f"fleet journal {self.path!r} is not a kvtier fleet journal; move it away (blocks "
                              f"it names in the Mooncake fleet are then left to the fleet's own eviction)")
        log.error("fleet journal %s: its first line is damaged (%r) but whole entries follow it: read as a "
                  "journal and written anew with a good first line", self.path, data[:len(_MAGIC)])

    def _load(self, entry: "_Entry") -> None:
        if entry.kind == _FORGOTTEN:
            self._dead += 1 + (self._live.pop(entry.name, None) is not None)
            return
        if entry.name in self._live:
            self._dead += 1
        self._live[entry.name] = entry.record

    # -- reads (at start) ------------------------------------------------------------------------
    def records(self) -> list[tuple[bytes, bytes]]:
        """(name, record) of every live record."""
        with self._lock:
            return list(self._live.items())

    def __len__(self) -> int:
        return len(self._live)

    def recorded_among(self, names: Sequence[bytes]) -> set[bytes]:
        """Those of ``names`` with a live record: placed in the fleet, or being placed (a record
        precedes its put). Only those can be in the fleet by this server's doing."""
        with self._lock:
            return {name for name in names if name in self._live}

    def placed_after(self, names: Sequence[bytes], seq: int) -> set[bytes]:
        """Those of ``names`` a placement later than ``seq`` (:attr:`seq` read earlier) recorded:
        put in the fleet again since."""
        with self._lock:
            return {name for name in names if self._placed_seq.get(name, 0) > seq}

    @property
    def seq(self) -> int:
        """A number that grows with each placement (see :meth:`forget`)."""
        return self._seq

    # -- writes ----------------------------------------------------------------------------------
    def replace_records(self, records: dict[bytes, bytes]) -> None:
        """Give live records new bytes (name → record: the same block's, under another key), written
        at the next :meth:`rewrite`; a name with no live record is left out."""
        with self._lock:
            for name, record in records.items():
                if name in self._live:
                    self._live[name] = record

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
        blob = b"".join([_MAGIC, *(_placed_entry(name, record) for name, record in self._live.items())])
        temp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            _write_all(fd, blob)
            os.fsync(fd)
            os.replace(temp, self.path)
        except BaseException:  # the file at the path is still the old one: appends go on there
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)  # (it holds every live record)
            raise
        # From the rename on, the file at the path is the new one, whatever the directory's sync
        # says next: appends must go there. (Switched after that sync, a failed one left them going
        # to the old file, unlinked: acknowledged placements were lost at the next start, and an fd
        # leaked per failure: audit s34 a3 D1.)
        old, self._fd, self._size, self._dead = self._fd, fd, len(blob), 0
        try:
            fsync_dir(os.path.dirname(self.path) or ".")
        finally:
            if old is not None:
                os.close(old)

    def placed(self, items: Sequence[tuple[bytes, bytes, object]]) -> int:
        """Record ``(name, record, entry)`` placements, durable before it returns (raises OSError
        otherwise: nothing then is to be stored); returns this placement's sequence number (see
        :meth:`unplace`). A name whose record was made from the same index entry is not written again."""
        with self._lock:
            todo = [(n, r, e) for n, r, e in items if self._written_for.get(n) is not e]
            self._seq += 1
            if todo:
                blob = b"".join(_placed_entry(name, record) for name, record, _ in todo)
                self._append_locked(blob, durable=True)  # raises: nothing is placed, nothing kept
                for name, record, entry in todo:
                    if name in self._live:
                        self._dead += 1
                    else:
                        self._created_by[name] = self._seq
                    self._live[name] = record
                    self._written_for[name] = entry
            # Only once recorded: a name whose append failed is never placed, and never reaches
            # ``_live``, so :meth:`forget` would never pop its entry here.
            for name, _, _ in items:
                self._placed_seq[name] = self._seq
            return self._seq

    def unplace(self, names: Sequence[bytes], seq: int) -> None:
        """Forget the records that placement ``seq`` began, of blocks whose put was never sent: not
        one whose record was live before it (an earlier placement of the name may have landed),
        nor one a later placement recorded again (its put may be sent). Best effort, as :meth:`forget`."""
        with self._lock:
            self._forget_locked([n for n in names if self._created_by.get(n) == seq == self._placed_seq.get(n)])

    def forget(self, names: Sequence[bytes], since: int) -> None:
        """Forget the records of ``names`` whose blocks the fleet no longer holds, unless a
        placement of the name began after ``since`` (:attr:`seq` read before the delete): that
        copy may have landed after it. Best effort: a record that cannot be forgotten stays (the
        next start looks it up)."""
        with self._lock:
            self._forget_locked([n for n in names if n in self._live and self._placed_seq.get(n, 0) <= since])

    def _forget_locked(self, gone: list[bytes]) -> None:
        if not gone:
            return
        try:
            self._append_locked(b"".join(_checked(_FORGOTTEN + n) for n in gone), durable=False)
        except OSError as exc:
            log.warning("fleet journal %s: could not forget %d records: %s", self.path, len(gone), exc)
            return
        for name in gone:
            del self._live[name]
            self._written_for.pop(name, None)
            self._placed_seq.pop(name, None)
            self._created_by.pop(name, None)
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


def _is_damaged_magic_alone(data: bytes) -> bool:
    """Whether ``data`` is a magic line alone (an empty journal) with at most
    :data:`_MAGIC_FLIPS_ACCEPTED` bits of it flipped: nothing in such a file is at stake, so it is
    no reason to refuse a start. (Random bytes come that close with a chance under 2^-140.)"""
    if len(data) != len(_MAGIC):
        return False
    return min(_bits_apart(data, magic) for magic in (_MAGIC, _MAGIC_V1)) <= _MAGIC_FLIPS_ACCEPTED


def _bits_apart(a: bytes, b: bytes) -> int:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).bit_count()


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]


# -- entries ---------------------------------------------------------------------------------------
class _Entry(NamedTuple):
    kind: bytes
    name: bytes
    record: bytes | None  #: a placement's (None: a forgetting)
    end: int  #: where the next entry begins


def _placed_entry(name: bytes, record: bytes) -> bytes:
    return _checked(_PLACED + name + _LEN.pack(len(record)) + record)


def _checked(body: bytes) -> bytes:
    return body + xxhash.xxh3_64_digest(body)


def _entry_at(data: bytes, pos: int, check: int) -> _Entry | None:
    """The whole entry at ``pos`` of ``data`` (``check``: its checksum's size, 0 in the first format);
    None if there is none: cut short, malformed, or its checksum does not match."""
    kind, name_end = data[pos:pos + 1], pos + 1 + _NAME_NBYTES
    if kind not in (_PLACED, _FORGOTTEN) or name_end > len(data):
        return None
    record, body_end = None, name_end
    if kind == _PLACED:
        if name_end + _LEN.size > len(data):
            return None
        (n,) = _LEN.unpack_from(data, name_end)
        if n > _MAX_RECORD:
            return None
        body_end = name_end + _LEN.size + n
        record = data[name_end + _LEN.size:body_end]
    end = body_end + check
    if end > len(data):
        return None
    if check and data[body_end:end] != xxhash.xxh3_64_digest(memoryview(data)[pos:body_end]):
        return None
    return _Entry(kind, data[pos + 1:name_end], record, end)


def _next_entry_after(data: bytes, pos: int, check: int) -> int | None:
    """Where the first whole entry after a bad one at ``pos`` begins; None if none follows (a torn
    last append)."""
    for candidate in _KIND.finditer(data, pos + 1):
        if _entry_at(data, candidate.start(), check) is not None:
            return candidate.start()
    return None
