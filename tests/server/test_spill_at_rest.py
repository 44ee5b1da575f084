"""What a server's disk spill keeps at rest, and for how long (audit s26: D1, D2, D4). Real servers.

* D1: with ``encrypt_at_rest`` the spill annotation (owner, namespace, the client's key, session,
  the served header with the xxh3 of the plaintext) is sealed, not only HMAC'd: ``disk_dir`` holds
  nothing that confirms a guessed prompt or block, or names a session. Files written before (HMAC'd
  annotations) are still read.
* D2: an erased namespace or session does not come back from an old copy of its files: the
  erasure is a tombstone in the runtime state, authenticated, that the rebuild honours.
* D4: a block dropped on the event loop is deleted from the sealed tiers however many other
  blocks leave the index before its deletion runs (the owner travels with the deletion).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import xxhash

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.auth import KeySpace
from kvtier.server.spill import OWNER_KEY_PURPOSE, SpillAnnotation, SpillCodec, secret_from_master_key
from tests.server.conftest import block, keys_for, remote
from tests.server.test_restart import (SLOT, Restartable, _rewrite_annotation, block_files, get, put,
                                       stopped_cleanly)

MASTER_HEX = "5a" * 32
MASTER = {"KVTIER_MASTER_KEY": MASTER_HEX}


def _leaks(disk, keys, namespace: str, session: str, skip=()) -> dict:
    on_disk = b"".join(p.read_bytes() for p in block_files(disk) if p not in skip)
    return {
        "client block keys": sum(k in on_disk for k in keys),
        "plaintext xxh3-128 checksums": sum(xxhash.xxh3_128_digest(block(k, SLOT)) in on_disk for k in keys),
        "namespace": int(namespace.encode() in on_disk),
        "session id": int(session.encode() in on_disk),
    }


# -- D1 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sealed", [True, False], ids=["encrypt_at_rest", "plaintext (control)"])
def test_an_encrypted_spill_leaves_no_block_key_session_or_plaintext_hash_in_clear(tmp_path, sealed):
    """The control: the same spill without a master key still holds all of it (its annotation is
    HMAC'd, in clear, beside a plaintext payload), so the search below finds what is there."""
    s = Restartable(tmp_path, capacity=4 * SLOT, encrypt_at_rest=sealed)
    s.env = MASTER if sealed else None
    srv = s.start()
    keys = keys_for("at-rest-leak", 12)
    put(srv, "acme", "private-model-ns", keys, session="alice-session-42")
    stopped_cleanly(*s.stop())  # everything flushed to disk_dir
    assert len(block_files(s.disk)) == len(keys)
    leaks = _leaks(s.disk, keys, "private-model-ns", "alice-session-42")
    if sealed:
        assert leaks == dict.fromkeys(leaks, 0), f"in clear in the sealed spill files: {leaks}"
    else:
        assert leaks == {"client block keys": 12, "plaintext xxh3-128 checksums": 12, "namespace": 1,
                         "session id": 1}
    srv = s.start()  # and the annotations still index every block, session included
    assert s.admin("stats")["recovered"]["recovered"] == len(keys)
    assert get(srv, "acme", "private-model-ns", keys) == [True] * len(keys)
    assert s.admin("erase", tenant="acme", session="alice-session-42")["erased"] == len(keys)
    stopped_cleanly(*s.stop())


def test_spilled_files_from_before_sealing_are_still_read_and_new_ones_are_sealed(tmp_path):
    """An upgrade loses nothing: files whose annotation is HMAC'd under the master key's secret (what
    a server wrote before annotations were sealed) are indexed and served; what the upgraded
    server writes is sealed."""
    s = Restartable(tmp_path, capacity=4 * SLOT, encrypt_at_rest=True)
    s.env = MASTER
    srv = s.start()
    old = keys_for("before-sealing", 6)
    put(srv, "acme", "upgrade-namespace", old, session="s-old")
    stopped_cleanly(*s.stop())
    master = bytes.fromhex(MASTER_HEX)
    sealing, hmac_only = SpillCodec.for_master_key(master), SpillCodec(secret_from_master_key(master))
    keyring = Keyring(StaticMasterKey(master), s.disk / "keys")  # (sealed for their owner too: s34 a8 D1)

    def owner_keys(owner: str) -> bytes | None:
        return keyring.derived_key(owner, OWNER_KEY_PURPOSE)

    for path in block_files(s.disk):  # rewritten as the server before sealing wrote them
        name = bytes.fromhex(path.stem)
        _rewrite_annotation(path, lambda a, name=name: hmac_only.pack(name, sealing.open(name, a, owner_keys)))
    assert _leaks(s.disk, old, "upgrade-namespace", "s-old")["client block keys"] == 6  # the old format, in clear
    old_files = set(block_files(s.disk))

    srv = s.start()
    assert s.admin("stats")["recovered"]["recovered"] == 6
    assert get(srv, "acme", "upgrade-namespace", old) == [True] * 6
    new = keys_for("after-sealing", 6)
    put(srv, "acme", "upgrade-namespace", new, session="s-new")
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 12
    leaks = _leaks(s.disk, new, "upgrade-namespace", "s-new", skip=old_files)
    assert leaks == dict.fromkeys(leaks, 0), f"in clear in the new files: {leaks}"
    srv = s.start()
    assert get(srv, "acme", "upgrade-namespace", old + new) == [True] * 12
    assert s.admin("erase", tenant="acme", session="s-old")["erased"] == 6  # their sessions were read too
    stopped_cleanly(*s.stop())


def test_a_sealed_annotation_authenticates_only_where_it_was_written():
    master = bytes.fromhex(MASTER_HEX)
    codec = SpillCodec.for_master_key(master)
    note = SpillAnnotation("acme", "ns", b"k" * 32, "s", 1.0, b"h", 3, None)
    here, there = b"a" * 32, b"b" * 32
    sealed = codec.pack(here, note)
    assert codec.unpack(here, sealed) == note
    assert codec.pack(here, note) != sealed  # a key of its own each time
    assert codec.unpack(there, sealed) is None  # moved to another file
    assert codec.unpack(here, sealed[:-1] + bytes([sealed[-1] ^ 1])) is None  # edited
    assert SpillCodec.for_master_key(b"\x01" * 32).unpack(here, sealed) is None  # another master key
    assert SpillCodec(secret_from_master_key(master)).unpack(here, sealed) is None  # no sealing key: refused
    old = SpillCodec(secret_from_master_key(master)).pack(here, note)
    assert codec.unpack(here, old) == note and codec.unpack(there, old) is None  # before sealing: read


# -- D2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope,sealed", [({"session": "gone"}, True), ({"namespace": "chat"}, False)],
                         ids=["session, encrypt_at_rest", "namespace, plaintext spill"])
def test_an_erased_scope_does_not_come_back_from_an_old_copy_of_its_files(tmp_path, scope, sealed):
    """``admin erase`` of a session or namespace deletes the files (and shreds no key: only a whole
    tenant's erasure does). A copy taken before (a snapshot put back, a crash between the index
    forgetting a block and its unlink, someone with write access to disk_dir) authenticated at the
    next start and was served again. Controls: a block of the tenant outside the erased scope, and
    one put into it after the erasure, do come back."""
    s = Restartable(tmp_path, capacity=4 * SLOT, encrypt_at_rest=sealed)
    s.env = MASTER if sealed else None
    srv = s.start()
    erased, kept, later = keys_for("erased-scope", 6), keys_for("kept-scope", 3), keys_for("after-erase", 2)
    put(srv, "acme", "chat", erased, session="gone")
    put(srv, "acme", "keep", kept, session="stay")
    stopped_cleanly(*s.stop())
    backup = tmp_path / "backup"
    shutil.copytree(s.disk, backup, ignore=shutil.ignore_patterns("runtime.json"))  # what the copy kept

    srv = s.start()
    assert s.admin("erase", tenant="acme", **scope)["erased"] == 6
    assert remote(srv, "acme", namespace="chat").lookup_prefix(erased) == 0
    put(srv, "acme", "chat", later, session="gone")  # after the erasure: not covered by it
    stopped_cleanly(*s.stop())
    for path in block_files(backup):  # the old files put back
        dest = s.disk / path.relative_to(backup)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)

    srv = s.start()
    assert get(srv, "acme", "chat", erased) == [False] * 6, "erased blocks back after a restart"
    assert get(srv, "acme", "keep", kept) == [True] * 3
    assert get(srv, "acme", "chat", later) == [True] * 2
    recovered = s.admin("stats")["recovered"]
    assert (recovered["recovered"], recovered.get("erased")) == (3 + 2, 6), recovered
    assert len(block_files(s.disk)) == 3 + 2  # the copies are deleted, not only unindexed
    stopped_cleanly(*s.stop())


def test_an_edited_erasure_record_stops_the_start_naming_the_file(tmp_path):
    """Tombstones are authenticated: moving an erasure's time back (so that it covers nothing) is
    refused, not obeyed. The control: the untouched file starts."""
    s = Restartable(tmp_path)
    srv = s.start()
    put(srv, "acme", "chat", keys_for("edited-tombstone", 2), session="gone")
    assert s.admin("erase", tenant="acme", session="gone")["erased"] == 2
    stopped_cleanly(*s.stop())
    state = s.disk / "runtime.json"
    doc = json.loads(state.read_text())
    assert [e[:3] for e in doc["erasures"]] == [["acme", None, "gone"]] and doc["erasures_mac"]
    s.start()
    stopped_cleanly(*s.stop())
    doc["erasures"][0][3] -= 3600
    state.write_text(json.dumps(doc))
    with pytest.raises(RuntimeError, match="runtime.json"):
        s.start()


# -- D4 ---------------------------------------------------------------------------------------
def test_a_block_dropped_on_the_event_loop_leaves_the_sealed_spill_however_late_its_deletion_runs(
        tmp_path, monkeypatch):
    """``Service.drop_soon`` (expiry on lookup, quota victims, misses) unindexes at once and deletes
    from the tiers later, on an I/O thread. The sealed tier names a file by its owner's HMAC and
    found the owner in the index's bounded memory of removed blocks (65,536): once that many others
    left first, the deletion aimed at no file, the sealed file stayed, and the next start served the
    block again. The server's own objects, in process, on the spill a real server wrote."""
    from kvtier.server.config import load_config
    from kvtier.server.index import BlockEntry
    from kvtier.server.server import Server

    s = Restartable(tmp_path, capacity=4 * SLOT, encrypt_at_rest=True)
    s.env = MASTER
    srv = s.start()
    keys = keys_for("dropped-late", 4)
    put(srv, "acme", "chat", keys)
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 4

    monkeypatch.setenv("KVTIER_MASTER_KEY", MASTER_HEX)
    server = Server(load_config(tmp_path / "kvtier.toml", env={}))
    svc = server.service
    try:
        assert server.recovered["recovered"] == 4
        skey = KeySpace.of("acme", "chat").storage_key(keys[0])
        file = server.spill.disk.path_of(server.keyring.storage_key("acme", skey))
        assert os.path.exists(file)
        gate = threading.Event()
        # the I/O threads are busy
        busy = [svc.io.submit("test", gate.wait, urgent=True) for _ in range(svc.io.workers)]
        assert svc.drop_soon(skey) is not None  # unindexed; the tiers' delete queued
        for i in range(1, (1 << 16) + 2):  # other blocks leave the index meanwhile
            other = i.to_bytes(32, "little")
            svc.index.add(other, BlockEntry("globex", "chat", other, 1, b"", time.monotonic()))
            svc.index.remove(other)
        gate.set()
        for f in busy:
            f.result()
    finally:
        svc.close()  # waits for the I/O threads: the queued deletion has run
        server.store.close(flush_timeout_s=0)
    assert not os.path.exists(file), "the sealed copy of a dropped block is left on disk"
    assert len(block_files(s.disk)) == 3  # the control: the other blocks' files stay
    srv = s.start()
    assert s.admin("stats")["recovered"]["recovered"] == 3
    assert get(srv, "acme", "chat", keys) == [False, True, True, True]
    stopped_cleanly(*s.stop())


def test_erasure_records_stay_few(tmp_path, monkeypatch):
    """Bounded: per scope the latest erasure; one a wider, later one covers goes; past the cap an
    owner's tombstones older than its oldest held block fold into one of the whole owner (it covers
    more, never less; test_erasure_tombstones.py: never a block the server keeps)."""
    from kvtier.server import runtime_state
    from kvtier.server.runtime_state import RuntimeState

    monkeypatch.setattr(runtime_state, "MAX_ERASURES", 8)
    path = str(tmp_path / "runtime.json")
    state = RuntimeState(path, erasure_key=b"e" * 32)
    state.record_erasure("acme", "chat", "s1", 10.0)
    state.record_erasure("acme", "chat", "s1", 20.0)
    state.record_erasure("acme", None, "s2", 15.0)
    state.record_erasure("acme", "chat", "s2", 12.0)  # covered by the wider, later one above
    assert state.erasures() == {("acme", "chat", "s1"): 20.0, ("acme", None, "s2"): 15.0}
    state.record_erasure("acme", "chat", None, 30.0)  # the whole namespace, later: s1 in it goes
    assert state.erasures() == {("acme", None, "s2"): 15.0, ("acme", "chat", None): 30.0}
    assert state.erased("acme", "chat", "s9", 30.0) and not state.erased("acme", "chat", "s9", 30.5)
    assert state.erased("acme", "other", "s2", 15.0) and not state.erased("acme", "other", "s3", 1.0)
    assert not state.erased("globex", "chat", "s2", 1.0)
    assert not state.erased("acme", "other", "", 1.0)  # no session: only owner or namespace scopes
    for i in range(20):  # many sessions of globex, which holds no block
        state.record_erasure("globex", "ns", f"g{i}", 100.0 + i, live_blocks=lambda owner: ())
    held = state.erasures()
    assert len(held) <= 8
    for i in range(20):  # every erased session is still covered (some by the folded, wider one)
        assert state.erased("globex", "ns", f"g{i}", 100.0 + i)
    assert RuntimeState(path, erasure_key=b"e" * 32).erasures() == held  # as persisted
    # under another key (tests/server/test_erasure_tombstones_key_change.py) the tombstones are not
    # applied (kept in the file), not a refused start
    assert RuntimeState(path, erasure_key=b"f" * 32).erasures() == {}
    assert RuntimeState(path).erasures() == {}  # a server without a spill neither reads nor drops them
