"""The server's side of its disk spill: annotate what it writes there, and index it again at start.

:class:`SpillBinding` connects three things: the server's
:class:`~kvtier.server.index.BlockIndex`, the raw
:class:`~kvtier.tiers.disk.DiskTier` under ``disk_dir`` (perhaps behind an
``EncryptedTier``) and the :class:`~kvtier.server.spill.SpillCodec`.

* Writing: the disk tier asks :meth:`SpillBinding.record` for each block it
  publishes (whoever writes it: the write-behind flusher, an eviction's
  demotion). The answer carries the block's index entry, authenticated, and its
  parent's disk name; a block the index no longer knows (deleted meanwhile) is
  refused, so an erased block is not written back behind the erasure.
* Starting: :meth:`SpillBinding.rebuild` reads every block's record, checks it
  (tag, owner still configured, the disk name derived again from the claimed
  owner, namespace and key, sizes) and adds the good ones to the index, oldest
  first (creation time kept: TTLs go on counting). Every other block file is
  deleted: nothing is served that the server cannot attribute -- unless, with
  encryption at rest, *none* authenticates: that is a master key or key store
  that is not the one they were written with, not a disk of forgeries, so the
  start is refused (:class:`~kvtier.errors.ConfigError`) and nothing deleted.
  A block an erasure covers (a tombstone in the runtime state,
  :mod:`kvtier.server.runtime_state`: same owner and scope, created at or before
  it) is deleted too: an old copy of erased files does not bring them back. It
  is judged on the authenticated annotation before the file's name is checked
  against the owner's keys (a shredded owner's names no longer derive), and does
  not count toward that refusal: the master key that authenticated it is the
  right one. (With encryption at rest the annotation is sealed under its owner's
  keys too, :mod:`kvtier.server.spill`: once they are shredded, the master key
  opens only the owner and the creation time, :class:`~kvtier.server.spill.OwnerOnly`,
  which the tombstone of an erasure of the whole owner covers.)
  Only a tombstone erases: a block whose annotation authenticates but
  whose owner has no keys in the key store is *not* taken for shredded -- a key
  store that merely lacks the owner (``keystore_dir`` pointed at another store
  of the same master key, a store restored from an older backup) looks the same,
  and its blocks come back once the right store is given. Such a block is
  rejected but kept on disk (not served; the disk tier evicts it when it needs
  the room), and the refusal above, or the warning when other blocks do
  authenticate, names its owner (:class:`OwnersWithoutKeys`).
  Tombstones are kept whatever is left on disk (a backup put back later is what
  they are for); :mod:`kvtier.server.runtime_state` bounds them.
* Blocks the server placed in a Mooncake fleet come back from its fleet journal
  (:mod:`kvtier.server.fleet`): :meth:`SpillBinding.rebuild` indexes them with the disk's,
  all in one age order (a block both hold is indexed as the disk's).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.core.payload import unpack_header
from kvtier.errors import ConfigError
from kvtier.server.auth import KeySpace
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.server.spill import (OWNER_KEY_PURPOSE, NewestStamps, OwnerOnly, SpillAnnotation, SpillCodec,
                                 monotonic_of, wall_of)
from kvtier.tiers.disk import BlockRecord, DiskTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Rebuilt:
    """What a start found on disk: entries indexed again, and files deleted by reason."""

    entries: list[tuple[bytes, BlockEntry]] = field(default_factory=list)
    rejected: int = 0  #: failed authentication or binding: never served (deleted, but see OwnersWithoutKeys)
    unattributed: int = 0  #: no annotation (written before annotations, or by something else)
    unknown_owner: int = 0  #: the owner is no longer configured
    #: the owners of the ``unknown_owner`` blocks (offboarded: ``admin erase`` still takes them)
    unconfigured: set[str] = field(default_factory=set)
    erased: int = 0  #: an erasure covers it (an old copy of erased files)

    def summary(self, tier: str | None = None) -> dict:
        """Counts; ``recovered``: the entries indexed at ``tier`` (None: all of them)."""
        recovered = sum(1 for _, e in self.entries if tier is None or e.tier == tier)
        return {"recovered": recovered, "rejected": self.rejected, "unattributed": self.unattributed,
                "unknown_owner": self.unknown_owner, "erased": self.erased}


#: (wall-clock creation, storage key, entry): a block found again at start, not yet indexed
Found = tuple[float, bytes, BlockEntry]

#: per shared namespace's owner (``shared/NAME``), the tenants configured to write it
Writers = Mapping[str, Collection[str]]


def annotation_of(entry: BlockEntry) -> SpillAnnotation:
    """What a block's disk annotation or fleet record says of it: its index entry, creation in wall time."""
    return SpillAnnotation(entry.owner, entry.namespace, entry.key, entry.session, wall_of(entry.created),
                           entry.header, entry.nbytes, entry.parent, entry.payer)


def recovered_entry(note: SpillAnnotation, tier: str, disk_name: bytes | None, writers: Writers) -> BlockEntry:
    """The index entry of a block found again at start at ``tier`` from its authenticated annotation.
    Its payer is kept only while that tenant is still a configured writer of the shared namespace
    (``writers``), so that its quota is charged the block as before the restart; a writer dropped
    from the config since no longer pays, and the owner pays alone -- as for an annotation an older
    version wrote, which names no payer."""
    payer = note.payer if note.payer in writers.get(note.owner, ()) else ""
    return BlockEntry(note.owner, note.namespace, note.key, note.nbytes, note.header, monotonic_of(note.created_wall),
                      note.session, tier, note.parent, disk_name, payer=payer)


def index_oldest_first(index: BlockIndex, found: Sequence[Found]) -> list[tuple[bytes, BlockEntry]]:
    """Add ``found`` to ``index`` oldest first -- its age order, where a TTL sweep stops at the first
    young block of a namespace -- and return the entries added (not those of a key indexed already)."""
    added = []
    for _, skey, entry in sorted(found, key=lambda item: item[0]):
        if index.add(skey, entry):
            added.append((skey, entry))
    return added


def key_store_holds(keyring, owner: str) -> bool:
    """Whether the key store holds keys of ``owner``'s; it creates none (the check writes nothing)."""
    return keyring.existing_storage_key(owner, bytes(32)) is not None


class OwnersWithoutKeys:
    """With encryption at rest, the owners of blocks whose annotations authenticate but whose names
    do not derive because the key store holds no keys of theirs, and how many of their blocks were
    found. Such a block is kept (not deleted, not served), never taken for erased: an owner the key
    store lacks is one whose keys were shredded *or* one this key store never held (another store of
    the same master key, an older backup) -- only an erasure's tombstone tells them apart. The key
    store is asked once per owner (no keys are created). Not thread safe (one start uses it)."""

    def __init__(self, keyring) -> None:
        self.keyring = keyring
        self._lacks: dict[str, bool] = {}  # owner → whether the key store holds none of its keys
        #: owner → its blocks kept for lack of keys
        self.blocks: dict[str, int] = {}

    def kept(self, owner: str) -> bool:
        """Whether a block of ``owner``'s, its name not derived, is kept: the key store lacks the owner."""
        if owner not in self._lacks:
            self._lacks[owner] = self.keyring is not None and not key_store_holds(self.keyring, owner)
        if self._lacks[owner]:
            self.blocks[owner] = self.blocks.get(owner, 0) + 1
        return self._lacks[owner]

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def named(self, what: str) -> str:
        """The owners, each with its count of ``what``: ``acme (4 files), globex (1 files)``."""
        return ", ".join(f"{owner} ({n} {what})" for owner, n in sorted(self.blocks.items()))

    def explained(self, what: str) -> str:
        """A sentence naming the owners (with their counts of ``what``) and the two causes ("" if none)."""
        if not self.blocks:
            return ""
        return (f" The key store holds no keys of {self.named(what)}: either it is not the key store they were "
                f"written with, or their keys were shredded by an erasure whose tombstone was lost (the runtime "
                f"state lost or replaced; then nothing can read them any more).")


class SpillBinding:
    def __init__(self, index: BlockIndex, disk: DiskTier, codec: SpillCodec, keyring=None,
                 erasures: RuntimeState | None = None) -> None:
        self.index = index
        self.disk = disk
        self.codec = codec
        #: where erasures are recorded and read back (the server's runtime state; None: not kept)
        self.erasures = erasures
        #: each annotation's wall-clock creation, noted there: an erasure's tombstone is never older
        self.stamps = erasures.stamps if erasures is not None else NewestStamps()
        #: with encryption at rest, files are named by the owner's keyed HMAC of the storage key
        self.keyring = keyring
        #: the server's summary of the last :meth:`rebuild` (admin ``stats`` shows it)
        self.last_rebuild: dict = {}
        #: owners no longer configured whose blocks the last :meth:`rebuild` found (and deleted):
        #: offboarded tenants an ``admin erase`` still takes, to record their tombstone
        self.unconfigured_owners: frozenset[str] = frozenset()

    def disk_name(self, owner: str, skey: bytes) -> bytes:
        return skey if self.keyring is None else self.keyring.storage_key(owner, skey)

    def disk_name_or_none(self, owner: str, skey: bytes) -> bytes | None:
        """What :class:`BlockEntry.disk_name` holds: only names that differ from the storage key."""
        return None if self.keyring is None else self.keyring.storage_key(owner, skey)

    def record_erasure(self, owner: str, namespace: str | None, session: str | None, erased_at: float) -> None:
        """Make an erasure outlast a restart (before its files are deleted; raises OSError if it
        cannot be written): :meth:`rebuild` then drops any copy of the blocks it covers."""
        if self.erasures is not None:
            self.erasures.record_erasure(owner, namespace, session, erased_at, live_blocks=self._held_blocks)

    def _held_blocks(self, owner: str):
        """``owner``'s indexed blocks as (namespace, session, wall-clock creation): what a folded
        tombstone must not reach (asked only when there are too many tombstones)."""
        for skey in self.index.select(owner):
            entry = self.index.get(skey)
            if entry is not None:
                yield entry.namespace, entry.session, wall_of(entry.created)

    # -- writing ---------------------------------------------------------------------------
    def record(self, disk_key: bytes) -> BlockRecord | None:
        skey = disk_key if self.keyring is None else self.index.storage_key_of(disk_key)
        entry = self.index.get(skey) if skey is not None else None
        if entry is None:
            return None  # deleted (erased, expired, dropped) since it was queued: do not write it
        owner_key = self._owner_key(entry.owner)
        if owner_key is None and self.keyring is not None:
            return None  # its owner's keys were shredded since it was queued (an erasure): do not write it
        parent = self.disk_name(entry.owner, entry.parent) if entry.parent is not None else None
        note = annotation_of(entry)
        self.stamps.note(note.owner, note.created_wall)
        return BlockRecord(parent, self.codec.pack(disk_key, note, owner_key))

    def _owner_key(self, owner: str) -> bytes | None:
        """With encryption at rest, the key of ``owner``'s own its annotations are sealed under too, so
        that shredding its keys leaves no copy of them readable (:mod:`kvtier.server.spill`); None
        without, or where the key store holds no keys of ``owner``'s."""
        return None if self.keyring is None else self.keyring.derived_key(owner, OWNER_KEY_PURPOSE)

    # -- starting --------------------------------------------------------------------------
    def rebuild(self, owners: set[str], also: Sequence[Found] = (), *, writers: Writers | None = None) -> Rebuilt:
        """Index every attributable block on disk (call once, before serving), and ``also`` (the
        blocks a fleet journal found, :func:`kvtier.server.fleet.rebuild_from_journal`) but those
        the disk holds. ``writers``: each shared namespace's configured writers; a shared block's
        payer is kept only if among them (:func:`recovered_entry`)."""
        out = Rebuilt()
        found: list[tuple[float, bytes, SpillAnnotation]] = []
        rejected: list[bytes] = []
        doomed: list[bytes] = []
        keyless = OwnersWithoutKeys(self.keyring)
        for rec in self.disk.records():
            note = self.codec.open(rec.key, rec.annotation, self._owner_key)
            if rec.annotation is None:
                out.unattributed += 1
            elif note is not None and self._erased(note):
                out.erased += 1  # (its name is not checked: a shredded owner's no longer derives)
            elif note is None or not self._bound(rec, note):
                out.rejected += 1
                if note is None or not keyless.kept(note.owner):
                    rejected.append(rec.key)
                continue
            elif note.owner not in owners:
                out.unknown_owner += 1
                out.unconfigured.add(note.owner)
            else:
                found.append((note.created_wall, rec.key, note))
                continue
            doomed.append(rec.key)
        if self.keyring is not None and out.rejected and not found and not out.unknown_owner and not out.erased:
            raise ConfigError(
                f"none of the {out.rejected} sealed block files in {self.disk.path} authenticates under this "
                f"master key and key store ({self.keyring.dir}): start with the master key and keystore_dir "
                f"they were written with.{keyless.explained('files')} Nothing was deleted; to discard them, "
                f"delete them yourself")
        if keyless:
            log.warning("key store %s:%s They are kept on disk, not served: restart with the keystore_dir they "
                        "were written with; if their keys were shredded, they go as the disk tier needs the room",
                        self.keyring.dir, keyless.explained("sealed block files"))
        for key in rejected:
            log.warning("disk block %s… has an annotation that does not authenticate; deleted", key.hex()[:16])
        for key in rejected + doomed:
            self.disk.delete(key)
        self.unconfigured_owners = frozenset(out.unconfigured)
        entries: list[Found] = []
        for created_wall, disk_key, note in found:
            self.stamps.note(note.owner, created_wall)  # (perhaps ahead of the clock now: stepped back since)
            skey = KeySpace.of(note.owner, note.namespace).storage_key(note.key)
            entries.append((created_wall, skey, recovered_entry(
                note, self.disk.name, disk_key if self.keyring is not None else None, writers or {})))
        on_disk = {skey for _, skey, _ in entries}
        out.entries = index_oldest_first(self.index, entries + [f for f in also if f[1] not in on_disk])
        return out

    def _erased(self, note: SpillAnnotation | OwnerOnly) -> bool:
        """Whether an erasure's tombstone covers the block an authenticated annotation describes. Of
        one whose owner's layer does not open (:class:`OwnerOnly`: its keys shredded), only an
        erasure of the whole owner can be judged: namespace and session are sealed under those keys."""
        if self.erasures is None:
            return False
        if isinstance(note, OwnerOnly):  # (no namespace is empty: only the owner's whole tombstone matches)
            return self.erasures.erased(note.owner, "", "", note.created_wall)
        return self.erasures.erased(note.owner, note.namespace, note.session, note.created_wall)

    def _bound(self, rec, note: SpillAnnotation | OwnerOnly) -> bool:
        """The annotation describes the file it is in: its disk name derives from the claimed
        owner, namespace and key; the served header and the sizes agree. (Never one whose owner's
        layer does not open: nothing binds it.)"""
        if isinstance(note, OwnerOnly):
            return False
        skey = KeySpace.of(note.owner, note.namespace).storage_key(note.key)
        # existing_storage_key: checking a name must not create keys for an owner the store
        # lacks (a misconfigured start would leave them behind)
        name = skey if self.keyring is None else self.keyring.existing_storage_key(note.owner, skey)
        if name != rec.key:
            return False
        header = unpack_header(note.header)
        if header is None or header.key != note.key or header.payload_nbytes != note.nbytes:
            return False
        # a plain spill stores the payload as is; a sealed one is larger by its seal
        return rec.nbytes == note.nbytes if self.keyring is None else rec.nbytes >= note.nbytes
