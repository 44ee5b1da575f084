"""Crypto-shredding covers the spill annotations too (audit s34 a8 D1). Real servers.

With ``encrypt_at_rest`` each spilled block file's annotation (namespace, session, the client's key,
the served header with the xxh3-128 of the plaintext, parent, payer) was sealed under a key derived
from the master key alone: after ``admin erase --tenant acme`` shredded acme's keys, a backup of
``disk_dir`` still told all of it to the master key, which stays (every other tenant needs it).
Now the annotation is sealed under a key of its owner's as well; the master key's layer keeps only
the owner and the creation time, which a restart needs before it can ask the key store.
"""

from __future__ import annotations

import shutil

import xxhash

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server import spill
from kvtier.server.spill import SpillAnnotation, SpillCodec, secret_from_master_key
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import unpack_record
from tests.server.conftest import block, keys_for
from tests.server.test_restart import SLOT, Restartable, _rewrite_annotation, block_files, get, put, stopped_cleanly

MASTER = bytes.fromhex("5a" * 32)
MASTER_ENV = {"KVTIER_MASTER_KEY": MASTER.hex()}
MASTER_CODEC = SpillCodec.for_master_key(MASTER)


def _server(tmp_path) -> Restartable:
    s = Restartable(tmp_path, encrypt_at_rest=True, capacity=4 * SLOT)
    s.env = MASTER_ENV
    return s


def _annotation(path) -> tuple[bytes, bytes]:
    """A block file's disk name and the annotation in its record."""
    name = bytes.fromhex(path.stem)
    return name, unpack_record(path.read_bytes()[:PAGE], name).annotation


def _key_store(s: Restartable) -> Keyring:
    """The stopped server's key store (``<disk_dir>/keys``), read as the server reads it."""
    return Keyring(StaticMasterKey(MASTER), s.disk / "keys", refresh_s=0.0)


def _owner_keys(keyring: Keyring):
    return lambda owner: keyring.derived_key(owner, spill.OWNER_KEY_PURPOSE)


def test_after_an_erase_a_backup_of_the_tenants_spill_tells_the_master_key_only_owner_and_time(tmp_path):
    """The repro: acme's files backed up, acme erased (keys shredded). The backup's annotations no
    longer open with the master key (nor with the key store left), where they told acme's
    namespace, session, client keys and the plaintext's xxh3; put back, the restart deletes them
    as erased and recovers the blocks of the tenant still there."""
    s = _server(tmp_path)
    acme, globex = keys_for("shred-leak", 6), keys_for("still-here", 4)
    srv = s.start()
    put(srv, "acme", "private-model-ns", acme, session="alice-session-42")
    put(srv, "globex", "g", globex, session="bob")
    stopped_cleanly(*s.stop())
    backup = tmp_path / "backup"
    shutil.copytree(s.disk, backup, ignore=shutil.ignore_patterns("keys"))  # the block files only
    s.start()
    assert s.admin("erase", tenant="acme") == {"ok": True, "erased": 6, "keys_shredded": True}
    stopped_cleanly(*s.stop())

    keyring = _key_store(s)
    opened = [MASTER_CODEC.unpack(*_annotation(p)) for p in block_files(backup)]
    told = [(n.owner, n.namespace, n.session, n.key in acme,
             xxhash.xxh3_128_digest(block(n.key, SLOT).tobytes()) in n.header) for n in opened if n is not None]
    assert [t for t in told if t[0] == "acme"] == [], "the master key alone still opens the erased tenant's metadata"
    after_shred = [MASTER_CODEC.open(*_annotation(p), _owner_keys(keyring)) for p in block_files(backup)]
    assert sorted(type(n).__name__ + ":" + n.owner for n in after_shred) == (
        ["OwnerOnly:acme"] * 6 + ["SpillAnnotation:globex"] * 4)
    assert all(isinstance(n, spill.OwnerOnly) and set(n._fields) == {"owner", "created_wall"}
               for n in after_shred if n.owner == "acme")

    for path in block_files(backup):  # put back over the live disk_dir (its key store and tombstone kept)
        shutil.copy2(path, s.disk / path.relative_to(backup))
    srv = s.start()
    rebuilt = s.admin("stats")["recovered"]
    assert (rebuilt["recovered"], rebuilt["erased"], rebuilt["rejected"]) == (4, 6, 0), rebuilt
    assert get(srv, "globex", "g", globex) == [True] * 4
    assert get(srv, "acme", "private-model-ns", acme) == [False] * 6
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 4


def test_a_restart_recovers_the_blocks_of_live_tenants_in_the_new_format_and_the_previous_one(tmp_path):
    """An upgrade loses no block: files whose annotation is sealed once, under the master key's
    key (what the previous version wrote, and the same codec still writes without an owner key),
    or only HMAC'd (before sealing) are indexed and served beside the new ones; what the server
    writes is sealed for its owner too."""
    s = _server(tmp_path)
    keys = keys_for("upgrade", 6)
    srv = s.start()
    put(srv, "acme", "ns", keys, session="s-1")
    stopped_cleanly(*s.stop())
    owner_keys = _owner_keys(_key_store(s))
    assert all(MASTER_CODEC.unpack(*_annotation(p)) is None for p in block_files(s.disk))  # all new format
    sealed_once = SpillCodec.for_master_key(MASTER)  # the previous code path: pack() with no owner key
    hmac_only = SpillCodec(secret_from_master_key(MASTER))  # before annotations were sealed
    for path, old in zip(block_files(s.disk)[:3], (sealed_once, sealed_once, hmac_only)):
        name = bytes.fromhex(path.stem)
        _rewrite_annotation(path, lambda a, name=name, old=old: old.pack(name, MASTER_CODEC.open(name, a, owner_keys)))
    previous = [p for p in block_files(s.disk) if MASTER_CODEC.unpack(*_annotation(p)) is not None]
    assert len(previous) == 3

    srv = s.start()
    assert s.admin("stats")["recovered"]["recovered"] == 6
    assert get(srv, "acme", "ns", keys) == [True] * 6
    assert s.admin("erase", tenant="acme", session="s-1")["erased"] == 6  # their sessions were read too
    more = keys_for("after-upgrade", 4)
    put(srv, "acme", "ns", more, session="s-2")
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 4
    assert all(MASTER_CODEC.unpack(*_annotation(p)) is None for p in block_files(s.disk))
    srv = s.start()
    assert s.admin("stats")["recovered"]["recovered"] == 4
    assert get(srv, "acme", "ns", more) == [True] * 4
    stopped_cleanly(*s.stop())


def test_an_annotation_sealed_for_its_owner_opens_only_there_and_only_with_that_owners_key():
    note = SpillAnnotation("acme", "ns-secret", b"k" * 32, "session-42", 7.5, b"h" * 40, 3, b"p" * 32, "")
    here, there = b"a" * 32, b"b" * 32
    mine, another = b"\x11" * 32, b"\x22" * 32
    sealed = MASTER_CODEC.pack(here, note, mine)
    assert not any(name in sealed for name in (b"acme", b"ns-secret", b"session-42", b"k" * 32, b"h" * 40))
    assert MASTER_CODEC.open(here, sealed, lambda owner: mine if owner == "acme" else None) == note
    assert MASTER_CODEC.open(here, sealed, lambda owner: None) == spill.OwnerOnly("acme", 7.5)  # keys shredded
    assert MASTER_CODEC.open(here, sealed, lambda owner: another) == spill.OwnerOnly("acme", 7.5)  # keys made anew
    assert MASTER_CODEC.unpack(here, sealed) is None  # the master key alone: no annotation
    assert MASTER_CODEC.open(there, sealed, lambda owner: mine) is None  # moved to another file
    assert MASTER_CODEC.open(here, sealed[:-1] + bytes([sealed[-1] ^ 1]), lambda owner: mine) is None  # edited
    assert SpillCodec.for_master_key(b"\x01" * 32).open(here, sealed, lambda owner: mine) is None  # another master
    assert MASTER_CODEC.pack(here, note, mine) != sealed  # keys of its own each time
