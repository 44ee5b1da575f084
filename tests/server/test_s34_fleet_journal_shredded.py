"""The fleet journal's records after crypto-shredding (audit s34 a8 D1, its last bullet): with
encrypt_at_rest they were sealed under the master key's alone, so a copy of the journal (a backup
of state_dir) still told whoever holds the master key an erased tenant's namespaces, sessions and
client keys after ``admin erase --tenant`` shredded its keys. Now sealed as the disk's annotations
are: whole under a key of the owner's, inside owner and creation time under the master key's; the
records of the earlier format are still read, and written anew in this one at the next start.
Against a real Mooncake master and holder (tests/server/test_fleet_restart.py's)."""

from __future__ import annotations

import shutil
import time

import pytest

from kvtier.cli.admin import admin_call
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.fleet_journal import FleetJournal
from kvtier.server.spill import OWNER_KEY_PURPOSE, OwnerOnly, SpillAnnotation, SpillCodec
from kvtier.tiers.base import Status
from tests.server.harness import TOKENS
from tests.server import test_fleet_erase_and_stalls
from tests.server.test_fleet_restart import (MASTER, _erased_while_the_fleet_is_stopped, _gets, _serve_sealed,
                                             _spilled_sealed)
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

CODEC = SpillCodec.for_master_key(MASTER)
#: a Mooncake master and holder of this module's own (the fixture test_fleet_restart.py's tests take)
cluster = test_fleet_erase_and_stalls.cluster


def _owner_keys(tmp_path):
    """What the server's key store holds of each owner's record keys (None: no keys of the owner's)."""
    keyring = Keyring(StaticMasterKey(MASTER), tmp_path / "disk" / "keys")
    return lambda owner: keyring.derived_key(owner, OWNER_KEY_PURPOSE)


def _whole_to_the_master_key(name: bytes, record: bytes) -> bool:
    """Whether the master key alone opens a record whole (the format before the owner's layer)."""
    return CODEC.unpack(name, record) is not None


def test_after_an_erase_a_journal_copy_tells_the_master_key_only_owner_and_time(tmp_path, cluster):
    """acme erased (its keys shredded) while the fleet could not be asked: its records stay in the
    journal until the removals land. A copy of it, opened with the master key and the key store,
    says whose blocks they were and when they were made, and nothing else (it said namespace,
    session and the client's key of each)."""
    started = time.time()
    _, owed = _erased_while_the_fleet_is_stopped(tmp_path, cluster)
    backup = tmp_path / "backup.journal"
    shutil.copyfile(tmp_path / "disk" / "fleet.journal", backup)
    records = FleetJournal.records_in(str(backup))
    assert len(records) == owed >= 8  # the control: acme's records are in the copy
    opened = [CODEC.open(name, record, _owner_keys(tmp_path)) for name, record in records]
    assert all(isinstance(o, OwnerOnly) for o in opened), opened
    assert {o.owner for o in opened} == {"acme"}
    assert all(started - 1 <= o.created_wall <= time.time() for o in opened)
    assert not any(_whole_to_the_master_key(name, record) for name, record in records)
    assert not any(b"shredded" in record for _, record in records)  # (the namespace, in clear or not)


def _mixed_formats(tmp_path, owner_key: bytes) -> int:
    """Every other record of the journal written anew in the format before the owner's layer (sealed
    under the master key's alone, as an earlier version wrote them), the rest in the current one;
    returns how many records there are."""
    journal = FleetJournal(str(tmp_path / "disk" / "fleet.journal"))
    try:
        notes = {name: CODEC.open(name, record, lambda owner: owner_key) for name, record in journal.records()}
        assert all(isinstance(note, SpillAnnotation) for note in notes.values()), notes
        journal.replace_records({name: CODEC.pack(name, note, None if i % 2 else owner_key)
                                 for i, (name, note) in enumerate(notes.items())})
        journal.rewrite()
    finally:
        journal.close()
    mixed = FleetJournal.records_in(str(tmp_path / "disk" / "fleet.journal"))
    assert {_whole_to_the_master_key(*item) for item in mixed} == {True, False}  # the control: both formats
    return len(mixed)


def test_a_restart_reads_records_of_both_formats_and_writes_the_new_one(tmp_path, cluster):
    """A journal an upgrade finds half in the earlier format: every record is read (none rejected,
    no block deleted from the fleet), acme's blocks are served, and the journal is written anew with
    every record sealed for its owner, which the master key alone no longer opens whole."""
    with _serve_sealed(tmp_path, cluster) as srv:
        keys, _ = _spilled_sealed(tmp_path, cluster, srv, "mixed")
    assert _mixed_formats(tmp_path, _owner_keys(tmp_path)("acme")) >= 8
    with _serve_sealed(tmp_path, cluster) as srv:
        fleet = admin_call(srv.tcp_url, TOKENS["admin"], "stats", {})["recovered"]["fleet"]
        # (recovered: those indexed at the fleet; a block the disk holds too is indexed there)
        assert (fleet["rejected"], fleet["erased"], fleet["unknown_owner"]) == (0, 0, 0) and fleet["recovered"], fleet
        assert _gets(srv, "mixed", keys) == [Status.OK] * len(keys)
    after = FleetJournal.records_in(str(tmp_path / "disk" / "fleet.journal"))
    assert after and not any(_whole_to_the_master_key(name, record) for name, record in after)
    assert all(isinstance(CODEC.open(name, record, _owner_keys(tmp_path)), SpillAnnotation) for name, record in after)
