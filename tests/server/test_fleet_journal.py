"""The server's fleet journal (kvtier/server/fleet.py, fleet_journal.py) over a stand-in fleet: a
record before each placement, forgotten after a delete the fleet was asked, read back at start (authenticated, erasures
and owners applied, blocks the fleet lost forgotten), a torn tail, damage in the middle, a journal of the first format,
compaction, sealed names, a shredded owner's records.
The same with a real fleet and server: test_fleet_restart.py."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from kvtier.core.payload import pack_header
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.errors import ConfigError
from kvtier.server.auth import KeySpace
from kvtier.server.fleet import FleetRebuilt, FleetRecords, JournaledFleet, rebuild_from_journal
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.server.spill import SpillCodec
from kvtier.tiers.base import Status, Tier

NBYTES = 64
CODEC = SpillCodec(b"s" * 32)


class StandInFleet(Tier):
    """A fleet: names → bytes; ``available`` False plays one that cannot be asked."""

    name = "mooncake"

    def __init__(self, journal: FleetJournal | None = None) -> None:
        super().__init__()
        self.objects: dict[bytes, bytes] = {}
        self.journal = journal  # to check that a record precedes each put
        self.recorded_first = True

    def contains(self, key) -> bool:
        return self.available and key in self.objects

    def get(self, key, out) -> Status:
        if key not in self.objects:
            return Status.MISS
        np.frombuffer(out, np.uint8)[:] = np.frombuffer(self.objects[key], np.uint8)
        return Status.OK

    def put(self, key, data, *, parent=None, meta=None) -> Status:
        if not self.available:
            return Status.ERROR
        if self.journal is not None and key not in dict(self.journal.records()):
            self.recorded_first = False
        self.objects[key] = bytes(data)
        return Status.OK

    def delete(self, key) -> bool:
        if not self.available:
            return False
        return self.objects.pop(key, None) is not None

    def keys(self):
        return iter(())

    @property
    def capacity_bytes(self) -> int:
        return 0

    @property
    def used_bytes(self) -> int:
        return 0


def _entry(owner: str, ns: str, i: int, session: str = "", created: float | None = None,
           disk_name: bytes | None = None) -> tuple[bytes, BlockEntry]:
    key = bytes([i]) * 32
    header = pack_header(key, NBYTES, bytes(16))
    skey = KeySpace.of(owner, ns).storage_key(key)
    return skey, BlockEntry(owner, ns, key, NBYTES, header, time.monotonic() if created is None else created,
                            session, "host", None, disk_name)


def _fleet(tmp_path, index: BlockIndex, keyring=None) -> JournaledFleet:
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    inner = StandInFleet(journal)
    return JournaledFleet(inner, journal, FleetRecords(index, CODEC, keyring))


def _reopened(tmp_path, keyring=None) -> tuple[JournaledFleet, BlockIndex]:
    index = BlockIndex()
    return _fleet(tmp_path, index, keyring), index


def _place(fleet: JournaledFleet, index: BlockIndex, *entries) -> list[bytes]:
    for skey, entry in entries:
        index.add(skey, entry)
    keys = [skey for skey, _ in entries]
    assert fleet.put_many(keys, [np.full(NBYTES, 7, np.uint8) for _ in keys]) == [Status.OK] * len(keys)
    return keys


def test_a_placement_is_recorded_before_the_put_and_forgotten_once_deleted(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    a, b = _place(fleet, index, _entry("acme", "chat", 1), _entry("acme", "chat", 2))
    assert fleet.inner.recorded_first and set(fleet.inner.objects) == {a, b}
    assert fleet.put(a, np.full(NBYTES, 7, np.uint8)) is Status.OK  # again: not recorded twice
    assert fleet.delete(a) is True
    fleet.close()
    again, _ = _reopened(tmp_path)
    assert [name for name, _ in again.journal.records()] == [b]


def test_a_block_the_index_no_longer_holds_is_not_placed(tmp_path):
    """(Erased meanwhile: a demotion must not store it behind its erasure, as the disk refuses it.)"""
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    held, gone = _entry("acme", "chat", 1), _entry("acme", "chat", 2)
    index.add(*held)
    statuses = fleet.put_many([held[0], gone[0]], [np.zeros(NBYTES, np.uint8)] * 2)
    assert statuses == [Status.OK, Status.ERROR] and set(fleet.inner.objects) == {held[0]}
    assert [name for name, _ in fleet.journal.records()] == [held[0]]


def test_a_delete_the_fleet_could_not_be_asked_about_keeps_its_record(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    (a,) = _place(fleet, index, _entry("acme", "chat", 1))
    fleet.inner.available = False
    fleet.delete(a)
    assert [name for name, _ in fleet.journal.records()] == [a]  # the removal is owed: asked again at start


def test_a_placement_that_began_during_a_delete_keeps_its_record(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    (a,) = _place(fleet, index, _entry("acme", "chat", 1))
    since = fleet.journal.seq  # a delete begins
    assert fleet.put(a, np.zeros(NBYTES, np.uint8)) is Status.OK  # a copy lands meanwhile
    fleet.journal.forget([a], since)  # the delete ends
    assert [name for name, _ in fleet.journal.records()] == [a]


def test_a_start_indexes_what_the_fleet_holds_and_deletes_what_it_must_not(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    old = time.monotonic() - 100
    kept = [_entry("acme", "chat", 1), _entry("acme", "docs", 2, session="s1", created=old)]
    erased = _entry("acme", "chat", 3, created=old)
    lost = _entry("acme", "chat", 4)
    stranger = _entry("initech", "chat", 5)
    forged = _entry("acme", "chat", 6)
    names = _place(fleet, index, *kept, erased, lost, stranger, forged)
    del fleet.inner.objects[lost[0]]  # the fleet evicted it on its own
    fleet.close()
    # a record altered by someone who can write the file (a well-formed entry): it no longer authenticates
    path = tmp_path / JOURNAL_FILE
    journal = FleetJournal(str(path))
    altered = bytearray(dict(journal.records())[forged[0]])
    altered[10] ^= 1
    journal.placed([(forged[0], bytes(altered), object())])
    journal.close()

    index2 = BlockIndex()
    journal = FleetJournal(str(path))
    inner = StandInFleet()
    inner.objects = {n: b"x" for n in names if n != lost[0]}
    again = JournaledFleet(inner, journal, FleetRecords(index2, CODEC))
    state = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())
    state.record_erasure("acme", "chat", None, time.time() - 50)  # covers "chat" blocks 100 s old, not new ones
    out = rebuild_from_journal(again, {"acme", "globex"}, state)
    assert sorted(skey for _, skey, _ in out.found) == sorted(skey for skey, _ in kept)
    assert (out.erased, out.unknown_owner, out.rejected, out.gone) == (1, 1, 1, 1)
    assert set(inner.objects) == {kept[0][0], kept[1][0]}  # erased, stranger's and forged blocks deleted
    found = {skey: e for _, skey, e in out.found}
    docs = found[kept[1][0]]
    assert (docs.owner, docs.namespace, docs.session, docs.tier, docs.header) == ("acme", "docs", "s1", "mooncake",
                                                                                 kept[1][1].header)
    assert abs(docs.created - old) < 1  # its age goes on counting
    journal.close()
    survivor = FleetJournal(str(path))  # written anew: the live records only
    assert sorted(n for n, _ in survivor.records()) == sorted(skey for skey, _ in kept)


def test_a_torn_last_append_is_cut_off_and_later_records_read_back(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    (a,) = _place(fleet, index, _entry("acme", "chat", 1))
    fleet.close()
    with open(tmp_path / JOURNAL_FILE, "ab") as f:
        f.write(b"P" + b"\x01" * 20)  # a crash while appending
    fleet, index = _reopened(tmp_path)
    (b,) = _place(fleet, index, _entry("acme", "chat", 2))
    fleet.close()
    again, _ = _reopened(tmp_path)
    assert sorted(n for n, _ in again.journal.records()) == sorted([a, b])


def _hundred_records(path) -> list[bytes]:
    journal = FleetJournal(str(path))
    names = [bytes([i]) * 32 for i in range(100)]
    for name in names:
        journal.placed([(name, b"record-" + name[:3], object())])
    journal.close()
    return names


def test_a_damaged_entry_in_the_middle_is_skipped_and_every_later_record_kept(tmp_path, caplog):
    """(s30 a3 D6: one flipped bit in the 11th record's length was taken for a torn tail: the 90
    records after it were dropped and cut off the file at open, with a warning.)"""
    path = tmp_path / JOURNAL_FILE
    names = _hundred_records(path)
    data = bytearray(path.read_bytes())
    data[data.index(names[10]) + 32 + 3] ^= 0x80  # the high byte of its length
    path.write_bytes(bytes(data))
    journal = FleetJournal(str(path))
    assert sorted(n for n, _ in journal.records()) == sorted(names[:10] + names[11:])
    assert "damaged" in caplog.text
    assert path.stat().st_size == len(data), "the file was cut at the damage"
    journal.placed([(b"z" * 32, b"later", object())])  # appended after the whole entries
    journal.close()
    again = FleetJournal(str(path))
    assert len(again) == 100 and dict(again.records())[b"z" * 32] == b"later"
    assert again.compact()  # (the damaged entry counts as dead: the next compaction drops it)
    again.close()
    assert len(FleetJournal(str(path))) == 100


def test_a_bad_last_entry_is_a_torn_tail_whatever_byte_is_bad(tmp_path):
    """The control to the damage above: no whole entry follows, so it is cut off."""
    path = tmp_path / JOURNAL_FILE
    names = _hundred_records(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last entry's checksum
    path.write_bytes(bytes(data))
    journal = FleetJournal(str(path))
    assert sorted(n for n, _ in journal.records()) == sorted(names[:-1])
    journal.close()
    assert path.stat().st_size < len(data)


_MAGIC_V1 = b"kvtier fleet journal v1\n"  # the first format's, as it was written


def _v1_entry(name: bytes, record: bytes | None = None) -> bytes:
    """An entry as the first format wrote it: no checksum."""
    return b"F" + name if record is None else b"P" + name + len(record).to_bytes(4, "little") + record


def test_a_journal_of_the_first_format_is_read_and_written_anew(tmp_path):
    """An upgrade loses no placement: the old journal's records are read, the file migrated."""
    path = tmp_path / JOURNAL_FILE
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    path.write_bytes(_MAGIC_V1 + _v1_entry(a, b"rec-a") + _v1_entry(b, b"rec-b") + _v1_entry(c, b"rec-c")
                     + _v1_entry(b) + b"P" + bytes(7))  # b forgotten, then a torn append
    journal = FleetJournal(str(path))
    assert dict(journal.records()) == {a: b"rec-a", c: b"rec-c"}
    assert _MAGIC_V1 not in path.read_bytes()  # written in this version's format
    journal.placed([(b, b"rec-b2", object())])
    journal.close()
    assert dict(FleetJournal(str(path)).records()) == {a: b"rec-a", b: b"rec-b2", c: b"rec-c"}


def test_a_file_that_is_no_journal_stops_the_start_naming_it(tmp_path):
    (tmp_path / JOURNAL_FILE).write_bytes(b"something else entirely\n")
    with pytest.raises(ConfigError, match="not a kvtier fleet journal"):
        FleetJournal(str(tmp_path / JOURNAL_FILE))


def test_the_journal_stays_about_the_size_of_what_it_holds(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    for i in range(40):
        entries = [_entry("acme", f"ns{i}", j) for j in range(250)]
        keys = _place(fleet, index, *entries)
        fleet.delete_many(keys)
        for skey in keys:
            index.remove(skey)
    assert len(fleet.journal) == 0
    assert os.path.getsize(tmp_path / JOURNAL_FILE) < 4 * 4096 * 300  # 10,000 placements, compacted
    assert os.stat(tmp_path / JOURNAL_FILE).st_mode & 0o777 == 0o600


def test_sealed_names_map_back_to_their_blocks_and_another_master_key_deletes_nothing(tmp_path):
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    index = BlockIndex()
    fleet = _fleet(tmp_path, index, keyring)
    skey, entry = _entry("acme", "chat", 1)
    name = keyring.storage_key("acme", skey)  # what the sealing tier above names it
    entry.disk_name = name
    index.add(skey, entry)
    assert fleet.put(name, np.zeros(NBYTES, np.uint8)) is Status.OK
    fleet.close()
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    inner = StandInFleet()
    inner.objects = {name: b"x"}
    out = rebuild_from_journal(JournaledFleet(inner, journal, FleetRecords(BlockIndex(), CODEC, keyring)), {"acme"})
    [(_, found_skey, found)] = out.found
    assert found_skey == skey and found.disk_name == name
    journal.close()
    # another master key (and its codec): nothing authenticates, nothing is deleted
    other = Keyring(StaticMasterKey(b"o" * 32), tmp_path / "other-keys", refresh_s=0.0)
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    with pytest.raises(ConfigError, match="master key"):
        rebuild_from_journal(JournaledFleet(inner, journal, FleetRecords(BlockIndex(), SpillCodec(b"o" * 32), other)),
                             {"acme"})
    assert set(inner.objects) == {name} and len(journal) == 1


def _owed_records_of_a_shredded_tenant(tmp_path, keyring, others=()) -> tuple[list[bytes], list[bytes]]:
    """acme's two sealed blocks (and ``others``' one each) placed; acme erased while the fleet could not
    be asked (its removals owed, its records kept), its tombstone recorded and its keys shredded, as
    the server's erase does. The names of acme's blocks and of the others'."""
    index = BlockIndex()
    fleet = _fleet(tmp_path, index, keyring)
    named = {}
    for i, owner in enumerate(["acme", "acme", *others], start=1):
        skey, entry = _entry(owner, "chat", i, created=time.monotonic() - 10)
        entry.disk_name = keyring.storage_key(owner, skey)  # what the sealing tier above names it
        index.add(skey, entry)
        named[entry.disk_name] = owner
    assert fleet.put_many(list(named), [np.zeros(NBYTES, np.uint8)] * len(named)) == [Status.OK] * len(named)
    acme = [name for name, owner in named.items() if owner == "acme"]
    fleet.inner.available = False  # the erase: the fleet cannot be asked, the removal is owed
    fleet.delete_many(acme)
    _tombstones(tmp_path).record_erasure("acme", None, None, time.time())
    assert keyring.shred_tenant("acme")
    fleet.close()
    return acme, [name for name, owner in named.items() if owner != "acme"]


def _tombstones(tmp_path) -> RuntimeState:
    return RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())


def _restart(tmp_path, keyring, held: list[bytes], erasures) -> tuple[FleetRebuilt, StandInFleet, FleetJournal]:
    """:func:`rebuild_from_journal` over a fleet that holds ``held``."""
    inner = StandInFleet()
    inner.objects = {name: b"x" for name in held}
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    try:
        out = rebuild_from_journal(JournaledFleet(inner, journal, FleetRecords(BlockIndex(), CODEC, keyring)),
                                   {"acme", "globex"}, erasures)
    except ConfigError:
        journal.close()
        raise
    return out, inner, journal


def test_a_shredded_owners_records_covered_by_its_tombstone_are_erased(tmp_path):
    """With encryption at rest: a tenant erased and its keys shredded while its fleet deletes were
    owed leaves records whose names no longer derive. Its tombstone, judged before the name, erases
    them: their blocks are deleted at the next start, which the name check, made first, refused as
    "authenticates under this master key"."""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    acme, _ = _owed_records_of_a_shredded_tenant(tmp_path, keyring)
    assert len(FleetJournal(str(tmp_path / JOURNAL_FILE))) == 2  # the control: the owed records stayed
    try:
        out, inner, journal = _restart(tmp_path, keyring, acme, _tombstones(tmp_path))
    except ConfigError as exc:
        pytest.fail(f"the start after a shredded tenant's owed fleet deletes was refused: {exc}")
    assert (out.erased, out.rejected, out.found) == (2, 0, [])
    assert inner.objects == {} and len(journal) == 0  # deleted from the fleet, then forgotten
    journal.close()


def test_records_of_an_owner_without_keys_or_tombstone_are_kept_and_the_start_names_it(tmp_path):
    """The tombstone lost (the runtime state replaced): nothing tells acme's shredded keys from a key
    store that never held them (another store of the same master key, an older backup), so nothing
    of acme's is deleted; with no other record the start is refused naming acme and both causes.
    (s30 a10 D1: an owner without keys was taken for shredded, its blocks deleted.)"""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    acme, _ = _owed_records_of_a_shredded_tenant(tmp_path, keyring)
    with pytest.raises(ConfigError, match=r"holds no keys of acme \(2 records\): either it is not the key store they "
                                          r"were written with, or their keys were shredded .* tombstone was lost"):
        _restart(tmp_path, keyring, acme, erasures=None)
    assert len(FleetJournal(str(tmp_path / JOURNAL_FILE))) == 2  # nothing forgotten


def test_records_of_an_owner_without_keys_are_kept_while_the_others_are_indexed(tmp_path, caplog):
    """globex's record authenticates and is indexed; acme's (no keys, no tombstone) stay in the journal
    and their blocks in the fleet, not indexed, the log naming acme -- until the fleet drops them."""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    acme, others = _owed_records_of_a_shredded_tenant(tmp_path, keyring, others=["globex"])
    with caplog.at_level(logging.WARNING, logger="kvtier.server.fleet"):
        out, inner, journal = _restart(tmp_path, keyring, acme + others, erasures=None)
    assert [e.owner for _, _, e in out.found] == ["globex"]
    assert (out.rejected, out.erased) == (2, 0)
    assert set(inner.objects) == set(acme + others), "blocks of an owner the key store lacks were deleted"
    assert sorted(n for n, _ in journal.records()) == sorted(acme + others)
    assert any("holds no keys of acme (2 records)" in r.getMessage() for r in caplog.records), caplog.text
    journal.close()
    out, inner, journal = _restart(tmp_path, keyring, others, erasures=None)  # the fleet evicted acme's
    assert (len(out.found), out.rejected) == (1, 2)
    assert [n for n, _ in journal.records()] == others  # their records forgotten
    journal.close()


def test_a_placement_whose_record_could_not_be_written_leaves_nothing_behind(tmp_path, monkeypatch):
    """``placed`` noted the placement's sequence number before the append: a failed write left an
    entry for a name that never reached the live records, so nothing ever removed it."""
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))

    def refuse(blob, *, durable):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "_append_locked", refuse)
    with pytest.raises(OSError):
        journal.placed([(b"n" * 32, b"record", object())])
    assert journal._placed_seq == {} and len(journal) == 0
    monkeypatch.undo()
    journal.placed([(b"m" * 32, b"record", object())])  # the control: a written one is noted
    assert list(journal._placed_seq) == [b"m" * 32] and len(journal) == 1
    journal.close()


class _SlowFleet(StandInFleet):
    """A fleet whose puts wait for ``go`` (``entered`` set when one is under way)."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.entered, self.go = threading.Event(), threading.Event()

    def put(self, key, data, *, parent=None, meta=None) -> Status:
        self.entered.set()
        assert self.go.wait(10)
        return super().put(key, data, parent=parent, meta=meta)


def test_an_erase_racing_a_demotion_into_the_fleet_leaves_no_copy_and_no_record(tmp_path):
    """A disk eviction demotes a block into the fleet (recorded while the index still held it)
    and its put lands late; an erase of the block runs meanwhile. The demotion runs under the
    disk tier's lock and the store deletes tier by tier from the top, so the erase's fleet delete
    (and its journal sequence number) comes after the put landed: no copy, no record is left.
    Pins that ordering (kvtier/server/fleet.py, "Erase against demotion")."""
    import threading

    from kvtier.core.payload import BlockMeta
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier

    index = BlockIndex()
    slow = _SlowFleet()
    fleet = JournaledFleet(slow, FleetJournal(str(tmp_path / JOURNAL_FILE)), FleetRecords(index, CODEC))
    disk = DiskTier(str(tmp_path / "disk"), 2 * 8192, pack_batches=False)  # two blocks
    store = TieredStore([HostTier(1 << 20, 4096), disk, fleet])
    entries = [_entry("acme", "ns", i) for i in range(3)]
    meta = BlockMeta("uint8", (NBYTES,), 0)
    for skey, entry in entries[:2]:
        index.add(skey, entry)
        assert disk.put(skey, np.full(NBYTES, 7, np.uint8), meta=meta) is Status.OK
    victim = entries[0][0]
    evicting = threading.Thread(target=disk.put, args=(entries[2][0], np.full(NBYTES, 7, np.uint8)),
                                kwargs={"meta": meta})
    evicting.start()  # evicts the oldest: its demotion's fleet put waits
    try:
        assert slow.entered.wait(10), "no demotion into the fleet"
        assert victim in dict(fleet.journal.records())
        index.remove(victim)  # the erase: out of the index, then out of every tier
        erasing = threading.Thread(target=store.delete, args=([victim],))
        erasing.start()
        time.sleep(0.3)
        assert erasing.is_alive(), "the erase did not wait for the demotion under way"
    finally:
        slow.go.set()
        evicting.join(10)
    erasing.join(10)
    assert victim not in slow.objects, "the erased block stayed in the fleet"
    assert victim not in dict(fleet.journal.records()), "the erased block's record stayed"
    store.close()


class NeverAskedFleet(StandInFleet):
    """A fleet whose lookups are never sent (down at the start) and whose health check ends the outage
    before the caller reads ``available``: its misses are noted unanswered, as a Mooncake tier notes
    them (:func:`kvtier.tiers.mooncake.unanswered_lookups`)."""

    def contains_many(self, keys) -> list[bool]:
        from kvtier.tiers.mooncake import _UNANSWERED

        noted = _UNANSWERED.get()
        if noted is not None:
            noted.append(len(keys))
        return [False] * len(keys)


def test_a_start_whose_fleet_lookups_went_unanswered_keeps_every_record(tmp_path):
    """A start's lookup the fleet never answered said "not held" for every block while ``available``
    read True after it: the journal forgot their records, leaving blocks no erase or TTL reaches
    (the pattern of audit s34 r6 D1, at the start)."""
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    names = _place(fleet, index, _entry("acme", "chat", 1), _entry("acme", "chat", 2))
    fleet.close()
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    again = JournaledFleet(NeverAskedFleet(), journal, FleetRecords(BlockIndex(), CODEC))
    state = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())
    out = rebuild_from_journal(again, {"acme"}, state)
    assert sorted(skey for _, skey, _ in out.found) == sorted(names)
    assert sorted(n for n, _ in journal.records()) == sorted(names)
    journal.close()
