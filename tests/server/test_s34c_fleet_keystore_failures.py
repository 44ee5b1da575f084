"""A tenant's key-store file that cannot be read (audit s34 r10; kvtier/server/fleet.py, kvtier/tiers/encrypted.py).

* D1: the runtime erasure walk (``settle_owed_removals`` -> ``erase_unindexed_records``) opened every
  unindexed fleet record with its owner's key: one tenant's unreadable key file made the walk raise at
  every sweep, so no other tenant's erasure reached its unindexed blocks (and the owed removals were
  not retried). Only the owners a tombstone names are asked now, and a record whose owner's key
  cannot be read waits for the next walk.
* D2: with encryption at rest, the fleet audit's lookup of a tenant whose key store failed was
  answered "not held" by the encrypting tier without asking the fleet, and the audit dropped the
  entries of blocks the fleet held. Such a lookup is now told as unanswered.

Real keyring, journal, tombstones and encrypting tier over a stand-in fleet (test_fleet_journal.py's);
a key-store file is made unreadable by writing garbage over it (as a damaged rewrite leaves it)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvtier.core.keys import BlockKey
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.fleet import FleetPresence, FleetRecords, JournaledFleet, settle_owed_removals
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.server.index import BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.server.spill import SpillCodec
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.mooncake import unanswered_lookups  # (its first home: the alias stays importable)
from tests.server.test_fleet_journal import NBYTES, StandInFleet, _entry

MASTER = b"m" * 32
CODEC = SpillCodec.for_master_key(MASTER)


class UnreadableKeyFile:
    """A tenant's key-store file made unreadable (garbage written over it) and put back."""

    def __init__(self, keyring: Keyring, tenant: str) -> None:
        self.path = keyring._file(tenant)  # (where the keyring keeps the tenant's keys)
        self._saved = self.path.read_bytes()

    def damage(self) -> None:
        self.path.write_bytes(b"\xff not a key file")

    def restore(self) -> None:
        self.path.write_bytes(self._saved)


def _keyring(tmp_path) -> Keyring:
    return Keyring(StaticMasterKey(MASTER), tmp_path / "keys", refresh_s=0.0)  # (every call reads the files)


# -- D1 ---------------------------------------------------------------------------------------------
def _fleet_with_unindexed_records(tmp_path, keyring, owners,
                                  stand_in=StandInFleet) -> tuple[JournaledFleet, dict[bytes, str]]:
    """A journaled fleet (encryption at rest, tombstones) holding a block of each of ``owners`` (in
    namespace "chat") that the index let go (a demotion answered in error that landed all the same):
    their records stay, for the erasure walk. Name -> owner."""
    index = BlockIndex()
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    tombstones = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())
    fleet = JournaledFleet(stand_in(journal), journal, FleetRecords(index, CODEC, keyring), tombstones=tombstones)
    named = {}
    for i, owner in enumerate(owners, start=1):
        skey, entry = _entry(owner, "chat", i, created=time.monotonic() - 10)
        entry.disk_name = keyring.storage_key(owner, skey)  # what the sealing tier above names it
        index.add(skey, entry)
        assert fleet.put(entry.disk_name, np.zeros(NBYTES, np.uint8)) is Status.OK
        index.remove(skey)
        named[bytes(entry.disk_name)] = owner
    return fleet, named


def _of(named: dict[bytes, str], owner: str) -> set[bytes]:
    return {name for name, o in named.items() if o == owner}


def _recorded(fleet: JournaledFleet) -> set[bytes]:
    return {bytes(name) for name, _ in fleet.journal.records()}


def test_an_erasure_reaches_its_unindexed_blocks_while_another_tenants_key_store_is_unreadable(tmp_path):
    keyring = _keyring(tmp_path)
    fleet, named = _fleet_with_unindexed_records(tmp_path, keyring, ["acme"] * 3 + ["globex"] * 3)
    globex_keys = UnreadableKeyFile(keyring, "globex")
    # acme erased as `admin erase --tenant` does: its tombstone, then its keys shredded
    fleet.record_erasure("acme", None, None, time.time())
    assert keyring.shred_tenant("acme")
    globex_keys.damage()
    try:
        settle_owed_removals([fleet])  # what every sweep runs
    finally:
        globex_keys.restore()
    left = set(fleet.inner.objects)
    assert not left & _of(named, "acme"), "acme's erasure did not reach its unindexed blocks in the fleet"
    assert not _recorded(fleet) & _of(named, "acme"), "acme's erased blocks kept their records (owner, times)"
    assert left == _of(named, "globex") == _recorded(fleet)  # globex, erased by no one, keeps everything
    fleet.close()


def test_a_record_whose_owners_key_store_is_unreadable_waits_for_the_next_walk(tmp_path):
    keyring = _keyring(tmp_path)
    fleet, named = _fleet_with_unindexed_records(tmp_path, keyring, ["acme", "globex", "globex"])
    globex_keys = UnreadableKeyFile(keyring, "globex")
    # globex's namespace erased (keys kept: its records must be opened whole to be judged) and acme's
    # whole tenant; while globex's key store cannot be read, the walk does what it can
    fleet.record_erasure("globex", "chat", None, time.time())
    fleet.record_erasure("acme", None, None, time.time())
    assert keyring.shred_tenant("acme")
    globex_keys.damage()
    try:
        assert fleet.erase_unindexed_records() == 1  # acme's
        assert set(fleet.inner.objects) == _of(named, "globex") == _recorded(fleet)
    finally:
        globex_keys.restore()
    # the key store readable again: the next walk judges globex's records (no new erasure meanwhile)
    assert fleet.erase_unindexed_records() == 2
    assert fleet.inner.objects == {} and _recorded(fleet) == set()
    assert fleet.erase_unindexed_records() == 0  # (all judged: no walk until the next erasure)
    fleet.close()


class OwingFleetWhoseDeletesFail(StandInFleet):
    """A fleet that owes the removals it could not be asked about (retried: ``retry_removals``, as a
    Mooncake tier's) and whose deletes, once it can be asked, fail with an error of its own."""

    def __init__(self, journal=None) -> None:
        super().__init__(journal)
        self.owed: set[bytes] = set()

    def delete_many(self, keys) -> list[bool]:
        if self.available:
            raise RuntimeError("the fleet's delete failed")
        self.owed.update(bytes(k) for k in keys)
        return [False] * len(keys)

    def retry_removals(self, keys=()) -> list[bool]:
        if self.available:
            for key in list(self.owed):
                self.objects.pop(key, None)
            self.owed.clear()
        return [bytes(k) in self.owed for k in keys]


def test_owed_removals_are_retried_though_the_erasure_walk_failed(tmp_path):
    keyring = _keyring(tmp_path)
    fleet, named = _fleet_with_unindexed_records(tmp_path, keyring, ["acme", "globex"], OwingFleetWhoseDeletesFail)
    [globex] = _of(named, "globex")
    fleet.inner.available = False
    fleet.delete_many([globex])  # (its removal owed: the record kept until it lands)
    fleet.inner.available = True
    fleet.record_erasure("acme", None, None, time.time())  # (the walk's delete of acme's block fails)
    with pytest.raises(RuntimeError, match="delete failed"):
        settle_owed_removals([fleet])
    assert globex not in fleet.inner.objects, "the owed removal was not retried: the erasure walk failed before it"
    assert globex not in _recorded(fleet)
    fleet.close()


# -- D2 ---------------------------------------------------------------------------------------------
def _encrypted_fleet_holding(tmp_path, keys) -> tuple[EncryptedTier, Keyring]:
    """An encrypting tier (acme's blocks) over a fleet that holds ``keys``."""
    keyring = _keyring(tmp_path)
    tier = EncryptedTier(StandInFleet(), keyring, tenant_of=lambda key: "acme")
    assert tier.put_many(keys, [np.full(NBYTES, 7, np.uint8) for _ in keys]) == [Status.OK] * len(keys)
    return tier, keyring


def test_a_lookup_the_key_store_kept_from_the_fleet_is_no_answer_to_the_fleet_audit(tmp_path):
    keys = [BlockKey(bytes([i]) * 32) for i in range(4)]
    tier, keyring = _encrypted_fleet_holding(tmp_path, keys)
    presence = FleetPresence(tier)
    acme_keys = UnreadableKeyFile(keyring, "acme")
    try:
        assert asyncio.run(presence.held(keys)) == [True] * 4  # (the control: the fleet's word)
        acme_keys.damage()
        held = asyncio.run(presence.held(keys))
        assert held is None, f"a lookup never sent (acme's key store unreadable) was taken for the fleet's: {held}"
        acme_keys.restore()
        assert asyncio.run(presence.held(keys)) == [True] * 4
    finally:
        presence.close()


def test_the_encrypting_tier_tells_which_lookups_its_keyring_kept_from_the_tier_below(tmp_path):
    keys = [BlockKey(bytes([i]) * 32) for i in range(3)]
    tier, keyring = _encrypted_fleet_holding(tmp_path, keys)
    with unanswered_lookups() as unanswered:
        assert tier.contains_many(keys) == [True] * 3 and tier.lookup_prefix(keys) == 3
        assert tier.contains(BlockKey(b"\x09" * 32)) is False  # (a miss the fleet answered)
    assert unanswered == []
    UnreadableKeyFile(keyring, "acme").damage()
    with unanswered_lookups() as unanswered:
        assert tier.contains_many(keys) == [False] * 3
        assert tier.contains(keys[0]) is False
        assert tier.lookup_prefix(keys) == 0
    assert sum(unanswered) == 3 + 1 + 3, unanswered
