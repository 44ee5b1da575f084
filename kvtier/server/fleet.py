"""The server's side of a Mooncake fleet below its tiers: what it placed there, kept across a
restart, and whether the fleet still holds what the index says it does.

The fleet cannot be listed (its names are one-way HMACs), and it drops blocks on its own
(eviction above ~90 % fill, a master restart, a holder lost) without telling anyone. So:

* :class:`~kvtier.server.fleet_journal.FleetJournal`: an append-only file,
  ``<state_dir>/fleet.journal`` (``state_dir`` defaults to ``disk_dir``), 0600.
  :class:`JournaledFleet`, the fleet tier as the server's store sees it (below the sealing
  tier with ``encrypt_at_rest``: it sees the names blocks are stored under), appends a record
  for each block *before* the fleet is asked to store it (fsync'd once per batch) -- the
  block's index entry as a disk spill's annotation carries it (:mod:`kvtier.server.spill`:
  owner, namespace, key, session, creation time, header, size, parent, a shared block's payer; HMAC'd under the
  server's state key, the secret in ``state_dir`` whether or not there is a disk, so that a
  disk added or dropped leaves them this server's; with encryption at rest sealed as a disk
  spill's: whole under a key of the owner's, inside the owner and creation time sealed under the
  master key's, so that a copy of the file tells the master key alone no more than those once an
  erasure shredded the owner's keys) -- and refuses to store a block the index no longer holds
  (erased meanwhile), or one of an owner whose keys are gone (shredded meanwhile). A record is forgotten once a delete of the block reached the fleet. One whose removal is
  *owed* -- the fleet could not be asked, or refused it even forced (a lease it would not
  break) -- stays, and the delete reports the block not removed (an erase
  then answers it ``refused``: a copy other servers of the fleet read whole is still there).
  Owed removals are retried periodically (:func:`settle_owed_removals`, from the server's
  sweep), not only at the next delete, which may never come; once they land, their records are
  forgotten and the journal is written anew without them. A restart before that finds the
  records: the erasure's tombstone covers them (recorded before the erasure deleted anything),
  so their blocks are deleted at start, never indexed again; the removal of one the fleet still
  does not answer for stays owed. A removal of some other block (not deleted by an erasure: a
  DELETE, an expiry) that a restart finds owed is indexed again, and a later delete reaches it.
  A delete passes every name to the fleet, recorded or not, even while it is down: a fleet
  shared by several servers under one secret names a block alike for all, so a block only DRAM
  or the disk held here may be another server's copy there; the fleet hides it and retries its
  removal until it lands -- up to a bound on the names it owes (an outage of hours): past it, such
  a removal of a block with no record here is given up, logged and counted
  (``kvtier_tier_owed_removals_given_up``), a recorded block's never. It is reported not removed
  only if this server placed it (a record) or the fleet owed its removal already (an earlier
  delete of it failed): a block only DRAM or the disk held, asked during an outage, is not
  reported left in the fleet. A put the fleet never
  sent (refused before any engine call: known down) has the record it began forgotten at once
  (:meth:`JournaledFleet.put_many`), so the blocks demoted during an outage count as never
  placed; so has one the fleet answered it did not store (FULL, TOO_LARGE). A crash between a
  record and its put leaves a record of a block the fleet may not hold: harmless (see below).
  After an erasure the sweep also deletes the blocks of the records it covers that the index no
  longer holds (:meth:`JournaledFleet.erase_unindexed_records`): the erasure reaches only the
  indexed ones.
* Erase against demotion: a placement recorded before an erase read :attr:`FleetJournal.seq`
  (``delete_many``) is forgotten by it, so its put must have landed before the fleet's delete.
  It has: a demotion into the fleet runs in the evicting tier's eviction, under that tier's
  lock (disk or DRAM), from its record to its put; ``TieredStore.delete`` deletes tier by tier
  from the top, taking each one's lock, so the fleet's delete comes after any such put; and
  write-behind copies are waited for (``WriteBehind.deleting``). A placement begun after the
  erase read the sequence number keeps its record (:meth:`FleetJournal.forget`).
* At start, :func:`rebuild_from_journal` reads the records back: one that does not
  authenticate or whose owner is no longer configured, or that an erasure tombstone covers
  (:mod:`kvtier.server.runtime_state`), has its block deleted from the fleet -- the tombstone
  judged before the record's name is checked against the owner's keys, as a disk file's is
  (:mod:`kvtier.server.recovery`): a shredded owner's names no longer derive. With encryption at
  rest, a record that authenticates but whose owner has no keys in the key store is kept, its
  block left in the fleet (not indexed): that key store may just not be the one it was written
  with (:class:`~kvtier.server.recovery.OwnersWithoutKeys`); only a tombstone erases. (A record
  whose owner's layer does not open -- its keys shredded, or made anew since -- tells owner and
  time only, :class:`~kvtier.server.spill.OwnerOnly`: an erasure of the whole owner covers it and
  deletes its block; otherwise it is rejected as one that does not describe its block, kept where
  the key store lacks the owner.) One of a
  block the fleet no longer holds (one batched lookup) is forgotten; the others are indexed again
  (tier ``mooncake``), merged with the disk's in age order, so that erase, TTL and quotas reach
  them as before the restart. The journal is then written anew with the live records only
  (and again whenever forgotten records outnumber them). Records an earlier version wrote under
  the disk spill's secret (it keyed them so wherever there was a disk) are read under it too and
  written anew under the state key at this rewrite: never deleted from the fleet for authenticating
  under another of the server's keys. So are records of the format sealed under the master key
  only (before the owner's layer), where the owner's key is there to seal them anew; those of an
  owner the key store lacks stay as they are. (Tombstones are authenticated under the same state key: an
  erasure cut short by a crash -- the index forgot the block, the fleet's delete never ran -- is
  completed at the next start.)
* Without any state directory (no ``disk_dir``, no ``state_dir``) nothing is journaled: a clean
  shutdown deletes from the fleet every block the server indexes (a restarted server could not
  reach them), and a crash leaves them to the fleet's own eviction (see the server module).
* :class:`FleetPresence`: index entries at the fleet are trusted only once it confirms them: a
  PUT of such a block is not answered "already stored" (content addressed) unless the fleet
  still holds it, and LOOKUP / CONTAINS ask it too. Asked in batches, on a thread of its own
  (never the event loop, nor the I/O threads that disk reads queue on): the requests that
  arrive while one batch is asked form the next. The sweep asks about a rotating slice of the
  entries at the fleet too (:class:`FleetAudit`), so that what it evicted on its own leaves the
  index and the journal though no client asks about it again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from typing import NamedTuple

from kvtier.core.payload import unpack_header
from kvtier.errors import ConfigError
from kvtier.server.auth import KeySpace
from kvtier.server.fleet_journal import FleetJournal
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.recovery import Found, OwnersWithoutKeys, Writers, annotation_of, recovered_entry
from kvtier.server.runtime_state import RuntimeState, blocks_held_in
from kvtier.server.spill import (OWNER_KEY_PURPOSE, NewestStamps, OwnerKeys, OwnerOnly, SpillAnnotation, SpillCodec,
                                 sealed_for_owner)
from kvtier.tiers.base import Status, refused_removals, report_refused, unanswered_lookups
from kvtier.tiers.mooncake import owed_removals_kept, unsent_puts
from kvtier.tiers.wrapper import WrappingTier

log = logging.getLogger(__name__)

#: names per fleet call at start (lookups, removals) and at a shutdown that clears the fleet
BATCH = 4096
#: a put's answers that say the fleet did not store the block (its record is forgotten at once)
_NOT_STORED = frozenset({Status.FULL, Status.TOO_LARGE})


class Authenticated(NamedTuple):
    """A record's annotation if it authenticates (owner and time only where the owner's layer does
    not open: :class:`~kvtier.server.spill.OwnerOnly`), and whether it is to be written anew: only
    an older key of the server's authenticates it, or it is of a format not sealed for its owner."""

    note: SpillAnnotation | OwnerOnly | None
    outdated: bool


class FleetRecords:
    """What a block's record says: its index entry, as a disk spill annotates it."""

    def __init__(self, index: BlockIndex, codec: SpillCodec, keyring=None, *,
                 older_codecs: Sequence[SpillCodec] = (), stamps: NewestStamps | None = None) -> None:
        self.index = index
        #: writes the records, and reads them (the server's state key: the same with or without a disk)
        self.codec = codec
        #: read too: other keys of this server that earlier versions wrote records under (a disk's secret)
        self.older_codecs = tuple(older_codecs)
        #: with encryption at rest the fleet names a block by its owner's keyed HMAC (as the disk does)
        self.keyring = keyring
        #: where each record's wall-clock creation is noted (an erasure's tombstone is never older)
        self.stamps = stamps if stamps is not None else NewestStamps()

    def record(self, name: bytes) -> tuple[bytes, BlockEntry] | None:
        """The record of the block stored under ``name`` and the entry it was made from; None if the
        index no longer holds it (deleted since: it must not be stored behind its erasure)."""
        skey = name if self.keyring is None else self.index.storage_key_of(name)
        entry = self.index.get(skey) if skey is not None else None
        if entry is None:
            return None
        note = annotation_of(entry)
        record = self.packed(name, note)
        if record is None:
            return None  # its owner's keys were shredded since (an erasure): it must not be stored
        self.stamps.note(note.owner, note.created_wall)
        return record, entry

    def _owner_key(self, owner: str) -> bytes | None:
        """With encryption at rest, the key of ``owner``'s own its records are sealed under too (as its
        spill annotations: :mod:`kvtier.server.spill`), so that shredding its keys leaves no copy of
        them readable; None without, or where the key store holds no keys of ``owner``'s."""
        return None if self.keyring is None else self.keyring.derived_key(owner, OWNER_KEY_PURPOSE)

    def indexed(self, name: bytes) -> bool:
        """Whether the index holds the block stored under ``name``."""
        skey = name if self.keyring is None else self.index.storage_key_of(name)
        return skey is not None and self.index.get(skey) is not None

    def authenticated(self, name: bytes, record: bytes, owner_keys: OwnerKeys | None = None) -> Authenticated:
        """The annotation of a record if it authenticates for ``name`` under one of the server's keys
        (whether it describes the block so named is :meth:`describes`; None if none does; owner and
        time only where its owner's key does not open the rest), and whether it is outdated: only an
        older key authenticates it -- no stranger's record, its block must not be deleted for it --
        or, with encryption at rest, it is not sealed for its owner (an earlier version's). Either is
        written anew (:meth:`packed`): an older key may not be there at the next start (a disk
        dropped from the config), and the master key alone opens the earlier format whole.
        ``owner_keys``: the owner keys to open records with (default: each owner's, :meth:`_owner_key`)."""
        note = self.codec.open(name, record, owner_keys or self._owner_key)
        if note is not None:
            return Authenticated(note, isinstance(note, SpillAnnotation) and self._sealed_for_master_only(record))
        for codec in self.older_codecs:
            if (note := codec.unpack(name, record)) is not None:
                return Authenticated(note, True)
        return Authenticated(None, False)

    def _sealed_for_master_only(self, record: bytes) -> bool:
        return self.codec.seals and self.keyring is not None and not sealed_for_owner(record)

    def packed(self, name: bytes, note: SpillAnnotation) -> bytes | None:
        """The record of ``note`` for ``name`` under the current key, in the current format: with
        encryption at rest sealed for its owner too; None where the key store holds no keys of the
        owner's (shredded: nothing is to be recorded of it; or one :meth:`authenticated` found
        outdated is kept as it is)."""
        owner_key = self._owner_key(note.owner)
        if owner_key is None and self.keyring is not None:
            return None
        return self.codec.pack(name, note, owner_key)

    def describes(self, name: bytes, note: SpillAnnotation | OwnerOnly) -> bool:
        """Whether an authenticated annotation describes the block named ``name``: the name derives
        from its owner, namespace and key (as a disk file's does), and its header from its key and size.
        (Never one whose owner's layer does not open: nothing binds it.)"""
        if isinstance(note, OwnerOnly):
            return False
        skey = KeySpace.of(note.owner, note.namespace).storage_key(note.key)
        # (existing_storage_key: checking a name creates no keys for an owner the store lacks)
        if name != (skey if self.keyring is None else self.keyring.existing_storage_key(note.owner, skey)):
            return False
        header = unpack_header(note.header)
        return header is not None and header.key == note.key and header.payload_nbytes == note.nbytes


class JournaledFleet(WrappingTier):
    """The fleet tier with its journal (see the module's docstring). Everything else is the fleet's
    own: lookups and reads go straight to it, and so do the attributes a sealing tier above asks
    of it (registered memory, unhashed reads)."""

    def __init__(self, inner, journal: FleetJournal, records: FleetRecords,
                 tombstones: RuntimeState | None = None) -> None:
        super().__init__(inner)
        self.name = inner.name
        self.journal = journal
        self.records = records
        #: where erasures are recorded (:meth:`record_erasure`; the server's runtime state)
        self.tombstones = tombstones
        self._owed_lock = threading.Lock()
        #: name → the journal's seq read before the delete whose removal is owed (see settle_removals)
        self._owed: dict[bytes, int] = {}
        #: the erasures the records were last judged against (:meth:`erase_unindexed_records`; the
        #: start judges them against those recorded by then: :func:`rebuild_from_journal`)
        self._erasures_judged = tombstones.erasures() if tombstones is not None else {}

    def __getattr__(self, attr: str):
        if attr == "inner":  # (not set yet)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    # -- writes: recorded first --------------------------------------------------------------------
    def _record(self, keys: Sequence[bytes]) -> tuple[list[bool], int]:
        """Record each key's placement; False for one the index no longer holds, or all of them when
        the journal cannot be written (never placed without a record). Also the placement's
        sequence number (:meth:`_forgetting_unsent`)."""
        made = [self.records.record(bytes(k)) for k in keys]
        items = [(bytes(k), m[0], m[1]) for k, m in zip(keys, made) if m is not None]
        seq = self.journal.seq
        if items:
            try:
                seq = self.journal.placed(items)
            except OSError as exc:
                log.warning("fleet journal %s cannot be written (%s): %d blocks not placed in the fleet",
                            self.journal.path, exc, len(keys))
                return [False] * len(keys), seq
        return [m is not None for m in made], seq

    def _refused(self, n: int) -> None:
        with self._lock:  # (counted into the fleet's counters, as the wrapper's stats are)
            self.inner.stats.put_failures += n

    def put(self, key, data, *, parent=None, meta=None, **kw) -> Status:
        ok, seq = self._record([key])
        if not ok[0]:
            self._refused(1)
            return Status.ERROR
        with self._forgetting_unsent(seq):
            status = self.inner.put(key, data, parent=parent, meta=meta, **kw)
        self._forget_not_stored([key], [status], seq)
        return status

    def put_many(self, keys, datas, *, parents=None, metas=None, **kw) -> list[Status]:
        ok, seq = self._record(keys)
        if all(ok):
            with self._forgetting_unsent(seq):
                statuses = self.inner.put_many(keys, datas, parents=parents, metas=metas, **kw)
            self._forget_not_stored(keys, statuses, seq)
            return statuses
        if parents is None:
            parents = [None, *keys[:-1]]
        out = [Status.ERROR] * len(keys)
        todo = [i for i, good in enumerate(ok) if good]
        self._refused(len(keys) - len(todo))
        if todo:
            pick = lambda items: None if items is None else [items[i] for i in todo]  # noqa: E731
            with self._forgetting_unsent(seq):
                statuses = self.inner.put_many(pick(keys), pick(datas), parents=pick(parents), metas=pick(metas),
                                               **{k: pick(v) for k, v in kw.items()})
            self._forget_not_stored(pick(keys), statuses, seq)
            for i, status in zip(todo, statuses):
                out[i] = status
        return out

    def _forget_not_stored(self, keys, statuses: Sequence[Status], seq: int) -> None:
        """Forget the records placement ``seq`` began of the blocks the fleet answered it did not
        store (:data:`_NOT_STORED`; not ERROR, nor an overrun: such a put may have landed), if it
        began them (:meth:`~kvtier.server.fleet_journal.FleetJournal.unplace`). Kept, nothing ever
        forgot them: the index lets such a block go without a delete (it is in no tier), so every
        refused demotion left its record, owner and client key in the file for good, beyond an
        erasure of its namespace (audit s34 a3 D2)."""
        refused = [bytes(k) for k, status in zip(keys, statuses) if status in _NOT_STORED]
        if refused:
            self.journal.unplace(refused, seq)

    @contextmanager
    def _forgetting_unsent(self, seq: int) -> Iterator[None]:
        """Around the fleet's put of blocks recorded by placement ``seq``: the records of those it
        never sent (refused before any engine call: the fleet known down) are forgotten at once, if
        it began them (:meth:`~kvtier.server.fleet_journal.FleetJournal.unplace`).
        Kept, they would count as placed, and a delete or erase during the outage would report a
        block the fleet never received as left in it. (Not an ``available`` check beforehand: the
        health check may end the outage in between, and a block would reach the fleet unrecorded.)"""
        with unsent_puts() as unsent:
            yield
        if unsent:
            self.journal.unplace(unsent, seq)

    # -- removal: forgotten once it landed -----------------------------------------------------------
    def delete(self, key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys, *, since: int | None = None) -> list[bool]:
        """As the fleet's; the records of the blocks whose removal landed are forgotten. Every name
        is passed on, the fleet down or not: a block this server never placed may be another
        server's copy (a fleet shared under one secret names it alike), and a fleet that cannot be
        asked hides it and retries its removal until it lands. What is reported on to the caller
        collecting :func:`~kvtier.tiers.base.refused_removals` (an erase: not done) is a removal the
        fleet owes of a block placed here (a record: a record precedes each put; a placement in
        flight has its record already), or of one whose removal it owed before this delete (an
        earlier attempt failed: a copy may be left). A removal owed of a block only DRAM or the disk
        held is retried, not reported: the common case during an outage, never placed anywhere. Those
        are what the fleet tier gives up past its bound on owed names (an outage of hours); a recorded
        block's removal is kept owed whatever the bound (:func:`~kvtier.tiers.mooncake.owed_removals_kept`).
        A placed block's owed removal keeps its record until :meth:`settle_removals` sees it land.
        ``since``: the journal's :attr:`~FleetJournal.seq` read before the caller judged these blocks
        to go (default: now); the record of a placement after it is kept (:meth:`FleetJournal.forget`)."""
        names = [bytes(k) for k in keys]
        if since is None:
            since = self.journal.seq
        recorded = self.journal.recorded_among(names)
        owed_before = self._owed_by_fleet(keys)
        with refused_removals() as refused, owed_removals_kept(recorded):
            out = self.inner.delete_many(keys)
        owed = set()
        for r in refused:
            if r.key in recorded or r.key in owed_before:
                report_refused(r.key, r.path, r.error)
                owed.add(r.key)
        if not self.inner.available:  # (a fleet that owes without saying so: a placed block not removed stays owed)
            owed |= {name for name, done in zip(names, out) if name in recorded and not done}
        self.journal.forget([name for name in names if name not in owed], since)
        if owed:
            with self._owed_lock:
                self._owed.update(dict.fromkeys(owed, since))
        return out

    def _owed_by_fleet(self, keys) -> set[bytes]:
        """Those of ``keys`` whose removal the fleet owes already (hidden: a delete of them failed)."""
        retry = getattr(self.inner, "retry_removals", None)
        if retry is None:  # (a fleet that owes nothing: it reports no removal refused)
            return set()
        return {bytes(k) for k, still in zip(keys, retry(keys)) if still}

    def erase_unindexed_records(self) -> int:
        """After an erasure (one recorded since the last call): delete from the fleet the blocks of
        the records it covers that the index no longer holds, forget their records (but those
        whose removal the fleet owes: retried, :meth:`settle_removals`) and write the journal anew;
        returns how many. The erasure reaches the blocks the index holds; these it never saw: a
        block the index let go though the fleet may hold it (a demotion that failed, perhaps
        after it landed) left its record, owner and client key in the file after its namespace
        was erased (audit s34 a3 D2). Judged as a start judges them (:func:`rebuild_from_journal`).
        Off the event loop: a walk of the records and network calls. Not thread safe (the sweep's)."""
        erasures = self.tombstones.erasures() if self.tombstones is not None else {}
        if erasures == self._erasures_judged:
            return 0
        walked_at = self.journal.seq  # (a placement after it is not of a record the walk judged)
        owner_keys = _ErasedOwnersKeys(self.records, {owner for owner, _, _ in erasures})
        covered = [name for name, record in self.journal.records()
                   if not self.records.indexed(name) and self._erased(name, record, owner_keys)]
        erased = 0
        for part in _batches(covered):
            part = self._still_unindexed(part, walked_at)
            if part:
                self.delete_many(part, since=walked_at)  # (forgets the records of those whose removal landed)
                erased += len(part)
        if owner_keys.failed:
            # (judged again at the next walk, until their keys can be read: the erasure must reach them)
            log.warning("the fleet journal records of %s were not judged against their erasures: their key store "
                        "could not be read (%s); tried again at the next sweep",
                        ", ".join(sorted(owner_keys.failed)), owner_keys.first_failure)
        else:
            self._erasures_judged = erasures
        if erased:
            try:
                self.journal.compact()
            except OSError as exc:
                log.warning("fleet journal %s could not be written anew after %d records of erased blocks were "
                            "forgotten: %s", self.journal.path, erased, exc)
        return erased

    def _still_unindexed(self, names: list[bytes], walked_at: int) -> list[bytes]:
        """Those of ``names`` (judged unindexed by a walk begun at journal seq ``walked_at``) that the
        index still does not hold and that no placement recorded since: the walk and each earlier
        batch's delete (network calls) leave time for the tenant to put the same block again (one
        content, one name) and for it to be demoted to the fleet. Deleted, and its record forgotten
        with the seq read at the delete, that acknowledged block was lost while the index placed it
        at the fleet (audit s34 r6 D2)."""
        again = self.journal.placed_after(names, walked_at)
        return [name for name in names if name not in again and not self.records.indexed(name)]

    def _erased(self, name: bytes, record: bytes, owner_keys: _ErasedOwnersKeys) -> bool:
        try:
            note = self.records.authenticated(name, record, owner_keys).note
        except _OwnerKeyUnreadable:
            return False  # (left for the next walk: owner_keys notes its owner)
        return note is not None and erasure_covers(self.tombstones, note)

    def settle_removals(self) -> int:
        """Retry the removals the fleet owes now (see :meth:`delete_many`); forget the records of
        those that landed and write the journal anew without them (they may be an erasure's: no
        record of an erased block stays in the file). Returns how many landed. Thread safe."""
        retry = getattr(self.inner, "retry_removals", None)
        if retry is None:  # (a fleet that owes nothing: it reports no removal refused)
            return 0
        if not self.inner.available:
            # Nothing can land: only the fleet's own retry is started (and with it, once its backoff
            # is over, the health check that ends the outage). Asking about each owed name would cost
            # every sweep in proportion to what the outage left owed.
            retry([])
            return 0
        with self._owed_lock:
            owed = list(self._owed.items())
        still = retry([name for name, _ in owed])
        landed = [(name, since) for (name, since), s in zip(owed, still) if not s]
        if not landed:
            return 0
        with self._owed_lock:
            for name, since in landed:
                if self._owed.get(name) == since:  # (not owed again by a later delete meanwhile)
                    del self._owed[name]
        # (a record placed again after its delete is kept: forget() judges by the seq it read)
        landed.sort(key=lambda item: item[1])
        for since, part in groupby(landed, key=lambda item: item[1]):
            self.journal.forget([name for name, _ in part], since)
        try:
            self.journal.compact()
        except OSError as exc:
            log.warning("fleet journal %s could not be written anew after %d owed removals landed: %s",
                        self.journal.path, len(landed), exc)
        log.info("%d removals the Mooncake fleet owed landed; the fleet journal keeps no record of them", len(landed))
        return len(landed)

    # -- erasures ---------------------------------------------------------------------------------
    def record_erasure(self, owner: str, namespace: str | None, session: str | None, erased_at: float) -> None:
        """Make an erasure outlast a restart (before its blocks are deleted; raises OSError if it
        cannot be written): :func:`rebuild_from_journal` deletes every block its tombstone covers
        rather than index it again -- one whose removal the fleet still owed when the server stopped
        (it did not answer) stays erased. Nothing is recorded without ``tombstones``."""
        if self.tombstones is not None:
            self.tombstones.record_erasure(owner, namespace, session, erased_at,
                                           live_blocks=blocks_held_in(self.records.index))

    # -- the rest, as the fleet -------------------------------------------------------------------
    def contains(self, key) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys) -> list[bool]:
        return self.inner.contains_many(keys)

    def lookup_prefix(self, keys) -> int:
        return self.inner.lookup_prefix(keys)

    def get(self, key, out) -> Status:
        return self.inner.get(key, out)

    def get_many(self, keys, outs, **kw) -> list[Status]:
        return self.inner.get_many(keys, outs, **kw)

    def get_many_as_ready(self, keys, outs, ready) -> list[Status]:
        return self.inner.get_many_as_ready(keys, outs, ready)

    def keys(self):
        return self.inner.keys()

    def close(self) -> None:
        self.inner.close()
        self.journal.close()


# -- start ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class FleetRebuilt:
    """What a start found in the fleet journal."""

    found: list[Found] = field(default_factory=list)  #: to index (the fleet holds them, or could not say)
    #: a record that does not authenticate or describe its block: its block deleted (but one whose
    #: owner has no keys in the key store: kept, see OwnersWithoutKeys)
    rejected: int = 0
    unknown_owner: int = 0  #: the owner is no longer configured: deleted
    erased: int = 0  #: an erasure covers it: deleted
    gone: int = 0  #: the fleet no longer holds it: forgotten

    def summary(self) -> dict:
        return {"recovered": len(self.found), "rejected": self.rejected, "unknown_owner": self.unknown_owner,
                "erased": self.erased, "gone": self.gone}


def rebuild_from_journal(fleet: JournaledFleet, owners: set[str], erasures=None, *,
                         writers: Writers | None = None) -> FleetRebuilt:
    """Read the journal back at start (see the module's docstring); the index is not touched: the
    entries to add are in ``found`` (a shared block's payer kept only if among its namespace's
    configured ``writers``: :func:`~kvtier.server.recovery.recovered_entry`). Deletes what must not stay in the fleet, then writes the
    journal anew. With encryption at rest, records none of which authenticates (while some exist)
    are a master key or key store other than the one they were written with: the start is refused
    and nothing deleted, as for the disk (:mod:`kvtier.server.recovery`)."""
    journal, records, raw = fleet.journal, fleet.records, fleet.inner
    out = FleetRebuilt()
    good: list[tuple[bytes, SpillAnnotation]] = []
    doomed: list[bytes] = []
    keyless = OwnersWithoutKeys(records.keyring)
    kept: list[bytes] = []  # records of owners the key store has no keys of: left as they are
    # name → its record under the current key and format, where an older one's (written at the rewrite)
    rekeyed: dict[bytes, bytes] = {}
    for name, record in journal.records():
        note, outdated = records.authenticated(name, record)
        if outdated and (fresh := records.packed(name, note)) is not None:
            rekeyed[name] = fresh
        # An erasure's tombstone is judged before the name is checked: a shredded owner's names no
        # longer derive (nor does its records' owner layer open), and its records say nothing about
        # the master key.
        if note is not None and erasures is not None and erasure_covers(erasures, note):
            out.erased += 1
        elif note is None or not records.describes(name, note):
            out.rejected += 1
            if note is not None and keyless.kept(note.owner):
                kept.append(name)
                continue
        elif note.owner not in owners:
            out.unknown_owner += 1
        else:
            good.append((name, note))
            continue
        doomed.append(name)
    if records.keyring is not None and out.rejected and not good and not out.unknown_owner and not out.erased:
        raise ConfigError(
            f"none of the {out.rejected} records of blocks placed in the Mooncake fleet ({journal.path}) authenticates "
            f"under this master key and key store ({records.keyring.dir}): start with the master key and "
            f"keystore_dir they were written with.{keyless.explained('records')} Nothing was deleted; to leave "
            f"those blocks to the fleet's own eviction, move the journal away")
    if keyless:
        log.warning("fleet journal %s, key store %s:%s Their blocks are left in the Mooncake fleet, not served, "
                    "their records kept: restart with the keystore_dir they were written with; if their keys were "
                    "shredded, the fleet evicts them on its own", journal.path, records.keyring.dir,
                    keyless.explained("records"))
    if out.rejected > len(kept):
        log.warning("fleet journal %s: %d records do not authenticate; their blocks are deleted from the fleet",
                    journal.path, out.rejected - len(kept))
    journal.replace_records(rekeyed)  # (written at the rewrite below)
    for part in _batches(doomed):
        fleet.delete_many(part)  # (what the fleet owes keeps its record: retried while the server runs)
    for part in _batches(kept):  # (their records go once the fleet no longer holds them)
        _held(raw, journal, part)
    for part in _batches(good):
        held = _held(raw, journal, [name for name, _ in part])
        out.gone += held.count(False)
        for (name, note), h in zip(part, held):
            if h:
                records.stamps.note(note.owner, note.created_wall)
                skey = KeySpace.of(note.owner, note.namespace).storage_key(note.key)
                out.found.append((note.created_wall, skey, recovered_entry(
                    note, fleet.name, name if records.keyring is not None else None, writers or {})))
    journal.rewrite()
    return out


class _OwnerKeyUnreadable(Exception):
    """The key store could not give an owner's key (its file unreadable, damaged, ...)."""


class _ErasedOwnersKeys:
    """The owner keys an erasure walk opens records with (:meth:`JournaledFleet.erase_unindexed_records`):
    only those of ``owners``, the owners a tombstone names. Any other owner's record opens as
    :class:`~kvtier.server.spill.OwnerOnly`, which no tombstone covers (:func:`erasure_covers`): asked
    for every owner's key, one tenant's unreadable key-store file made every walk raise, and no
    other tenant's erasure reached its unindexed blocks (audit s34 r10 D1). An owner whose key cannot
    be read raises :class:`_OwnerKeyUnreadable` (its record is left for the next walk) and is noted in
    :attr:`failed`; it is not asked again in this walk."""

    def __init__(self, records: FleetRecords, owners: set[str]) -> None:
        self._records = records
        self._owners = owners
        self.failed: set[str] = set()
        self.first_failure: Exception | None = None

    def __call__(self, owner: str) -> bytes | None:
        if owner not in self._owners:
            return None
        if owner in self.failed:
            raise _OwnerKeyUnreadable(owner)
        try:
            return self._records._owner_key(owner)
        except Exception as exc:  # noqa: BLE001 - whatever the key store raised: that owner's records wait
            self.failed.add(owner)
            self.first_failure = self.first_failure or exc
            raise _OwnerKeyUnreadable(owner) from exc


def erasure_covers(erasures: RuntimeState, note: SpillAnnotation | OwnerOnly) -> bool:
    """Whether an erasure's tombstone covers the block an authenticated record describes. Of one whose
    owner's layer does not open (:class:`~kvtier.server.spill.OwnerOnly`: its keys shredded), only an
    erasure of the whole owner can be judged: namespace and session are sealed under those keys (as
    for a disk file's annotation, :mod:`kvtier.server.recovery`)."""
    if isinstance(note, OwnerOnly):  # (no namespace is empty: only the owner's whole tombstone matches)
        return erasures.erased(note.owner, "", "", note.created_wall)
    return erasures.erased(note.owner, note.namespace, note.session, note.created_wall)


def _held(raw, journal: FleetJournal, names: list[bytes]) -> list[bool]:
    """Whether the fleet holds each of ``names``; the records of those it does not are forgotten. All
    True when the fleet could not say (kept: a GET that misses drops it); a lookup it did not answer
    (never sent: the tier down at start) says nothing, whatever ``available`` reads after it (as in
    :meth:`FleetPresence._ask`: audit s34 r6 D1), else those records were forgotten and their blocks
    left where no erase or TTL reaches them."""
    with unanswered_lookups() as unanswered:
        held = raw.contains_many(names)
    if unanswered or not raw.available:
        return [True] * len(names)
    journal.forget([name for name, h in zip(names, held) if not h], journal.seq)
    return held


def journaled_fleet_in(tiers) -> JournaledFleet | None:
    """The journaled fleet among ``tiers`` (under any wrapper); None if there is none."""
    for tier in tiers:
        while tier is not None:
            if isinstance(tier, JournaledFleet):
                return tier
            tier = getattr(tier, "inner", None)
    return None


def settle_owed_removals(tiers) -> int:
    """Retry the removals a Mooncake fleet among ``tiers`` (under any wrapper) owes; how many
    landed. The journaled fleet forgets their records too (:meth:`JournaledFleet.settle_removals`),
    and after a new erasure deletes the blocks of the records it covers that the index no longer
    holds (:meth:`JournaledFleet.erase_unindexed_records`). Network calls: off the event loop."""
    for tier in tiers:
        while tier is not None:
            # (asked of the class: a wrapper forwarding attributes would answer for the tier it wraps)
            if isinstance(tier, JournaledFleet):
                try:
                    tier.erase_unindexed_records()
                finally:  # (owed removals are retried whatever the erasure walk did)
                    landed = tier.settle_removals()
                return landed
            if callable(getattr(type(tier), "retry_removals", None)):
                tier.retry_removals()
                return 0
            tier = getattr(tier, "inner", None)
    return 0


def _batches(items: list) -> list[list]:
    return [items[i:i + BATCH] for i in range(0, len(items), BATCH)]


# -- presence --------------------------------------------------------------------------------------
class FleetAudit:
    """Which index entries the server's sweep asks the fleet about next: the fleet evicts on its
    own and tells no one, and most blocks demoted there are never asked for again, so their entries
    (and records) stayed for the life of the process, growing with every block ever demoted
    (audit s34 a3 D3). A pass begins at most every ``pass_interval_s`` (the server's
    ``fleet_audit_interval_s``) with a snapshot of the keys indexed at the fleet (tier ``tier``), and
    looks at each once, a slice a sweep: sized for the pass to take about ``pass_interval_s`` at one
    sweep every ``sweep_interval_s`` -- at least :data:`BATCH` keys (a small index is done in one
    sweep, and not asked about again until the next pass), at most :attr:`MAX_PER_SWEEP` (bounded
    work a sweep: past that many keys per sweep of a pass, a pass takes longer). (A slice of BATCH
    keys of every tier made a pass of a 1M-block index take 245 sweeps, whatever the setting said:
    audit s34 r6 D3.) The sweep's alone: not thread safe."""

    #: the most keys one sweep looks at (asked of the fleet in lookups of BATCH names each)
    MAX_PER_SWEEP = 8 * BATCH
    #: the server sweeps at most this often, whatever ``sweep_interval_s`` says (kvtier/server/server.py)
    _SWEEP_FLOOR_S = 0.05

    def __init__(self, index: BlockIndex, tier: str, *, pass_interval_s: float, sweep_interval_s: float) -> None:
        self._index = index
        self._tier = tier
        self.pass_interval_s = pass_interval_s
        #: the sweeps one pass is spread over
        self._sweeps_a_pass = max(1, int(pass_interval_s / max(sweep_interval_s, self._SWEEP_FLOOR_S)))
        self.per_sweep = BATCH  # (this pass's slice: set as it begins)
        self._todo: deque[bytes] = deque()
        self._next_pass = 0.0  # (the first sweep begins one: after a restart, what the journal brought back)

    def next_slice(self) -> list[bytes]:
        """The next keys to look at (indexed at the fleet when the pass began: the caller checks that
        they still are); none between passes. Off the event loop: a pass begins with a walk of the
        index's keys."""
        if not self._todo:
            now = time.monotonic()
            if now < self._next_pass:
                return []
            self._next_pass = now + self.pass_interval_s
            self._todo.extend(self._keys_at_fleet())
            spread = -(-len(self._todo) // self._sweeps_a_pass)  # (rounded up: the pass ends in time)
            self.per_sweep = min(self.MAX_PER_SWEEP, max(BATCH, spread))
        return [self._todo.popleft() for _ in range(min(self.per_sweep, len(self._todo)))]

    def _keys_at_fleet(self) -> list[bytes]:
        entry_of, tier = self._index.get, self._tier
        return [skey for skey in self._index.keys() if (entry := entry_of(skey)) is not None and entry.tier == tier]


class FleetPresence:
    """Asks the fleet which of the blocks the index places there it still holds: in batches, on a
    thread of its own. Event loop only (:meth:`held`), but for the thread it runs the calls on."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-serve-fleet")
        self._queued: list[tuple[list[bytes], asyncio.Future]] = []
        self._asking = False

    async def held(self, skeys: Sequence[bytes]) -> list[bool] | None:
        """Per storage key, whether the fleet holds it; None when the fleet could not say (down,
        backing off: its misses say nothing)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued.append((list(skeys), future))
        if not self._asking:
            self._ask_next(loop)
        return await future

    def _ask_next(self, loop) -> None:
        batch, self._queued = self._queued, []
        self._asking = bool(batch)
        if not batch:
            return
        keys = [k for ks, _ in batch for k in ks]
        try:
            done = loop.run_in_executor(self._pool, self._ask, keys)
        except RuntimeError:  # shut down: nothing can be confirmed
            self._asking = False
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
            return
        done.add_done_callback(lambda f: self._answer(loop, batch, f))

    def _ask(self, keys: list[bytes]) -> list[bool] | None:
        # A lookup the fleet did not answer (never sent: the tier down) answers all False. Judged
        # by ``available`` alone, read after it, such misses were taken for the fleet's word when
        # the health check that very lookup started ended the outage in between: the audit then
        # dropped, and deleted from the fleet, blocks it held (audit s34 r6 D1). (``available`` is
        # still asked: a fleet other than Mooncake's tells no more.) An encrypting tier above the
        # fleet tells so too of a lookup its keyring kept from the fleet (audit s34 r10 D2).
        with unanswered_lookups() as unanswered:
            held = self.tier.contains_many(keys)
        return None if unanswered or not self.tier.available else held

    def _answer(self, loop, batch, done) -> None:
        if done.cancelled():
            held = None
        elif done.exception() is not None:
            log.warning("asking the fleet which blocks it holds failed: %r", done.exception())
            held = None
        else:
            held = done.result()
        at = 0
        for keys, future in batch:
            if not future.done():
                future.set_result(None if held is None else held[at:at + len(keys)])
            at += len(keys)
        self._ask_next(loop)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def clear_fleet(fleet, index: BlockIndex, limit_s: float) -> tuple[int, int]:
    """Delete from ``fleet`` every block ``index`` holds, within about ``limit_s`` (the shutdown of a
    server with no state directory: nothing could reach them after a restart). Returns (removed,
    left): the blocks the fleet was asked to remove (or did not hold), and those left to its own
    eviction (out of time, or the fleet not answering)."""
    keys = index.keys()
    deadline = time.monotonic() + limit_s
    removed = 0
    for part in _batches(keys):
        if time.monotonic() > deadline:
            break
        fleet.delete_many(part)
        if not fleet.available:  # not asked: owed, and this process is ending
            break
        removed += len(part)
    return removed, len(keys) - removed
