"""An erasure's tombstone outlasts every restart: an old copy of the erased files put back later
(a backup restored, someone who can write ``disk_dir``) is deleted at the next start, not served;
with encryption at rest, a whole-tenant erase the disk refused (its keys shredded all the same)
does not stop the next start: its tombstone erases the files. Without the tombstone nothing tells
shredded keys from a key store that never held them: the files are kept, and the start names the
tenant. Past the bound on tombstones, a fold never reaches a block the server keeps, and what must
go is logged. Real ``kvtier serve`` processes, clients over TCP.

(s30 audit a2: D1, the tombstone was dropped at the first start after which any younger block was
left on disk; D2, the shredded tenant's files made the start refuse with "wrong master key". s30 a10
D1: its fix took any owner without keys for shredded, and a wrong key store deleted every file.)"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

import pytest

from kvtier.server import runtime_state
from kvtier.server.runtime_state import RuntimeState
from tests.server.conftest import keys_for
from tests.server.test_restart import Restartable, block_files, get, put, stopped_cleanly
from tests.tmpfs import mounted_tmpfs


def _encrypted(base, **server) -> dict:
    master = base / "master.key"
    master.write_bytes(os.urandom(32))
    master.chmod(0o600)
    return {"encrypt_at_rest": True, "master_key_file": str(master), "keystore_dir": str(base / "keys"), **server}


def _copy_aside(files, into) -> None:
    into.mkdir()
    for path in files:
        shutil.copy2(path, into / path.name)


def _put_back(saved, disk) -> None:
    """The copy restored where the disk tier looks for it (its shard directory)."""
    for path in saved.iterdir():
        dest = disk / path.name[:2] / path.name
        dest.parent.mkdir(exist_ok=True)
        shutil.copy2(path, dest)


@pytest.mark.parametrize("encrypted,scope", [(False, {}), (True, {"namespace": "chat"})],
                         ids=["plain-tenant", "sealed-namespace"])
def test_an_old_copy_of_erased_files_put_back_after_restarts_is_not_served(tmp_path, encrypted, scope):
    """(A namespace erase shreds no keys: with encryption at rest too, only the tombstone stops the copy.)"""
    s = Restartable(tmp_path, **(_encrypted(tmp_path) if encrypted else {}))
    secret = keys_for("globex-secret", 3)
    srv = s.start()
    put(srv, "globex", "chat", secret)
    stopped_cleanly(*s.stop())  # flushed to disk
    _copy_aside(block_files(s.disk), tmp_path / "backup")  # a backup of globex's files
    srv = s.start()
    assert s.admin("erase", tenant="globex", **scope)["erased"] == 3
    put(srv, "acme", "chat", keys_for("acme-later", 2))  # younger blocks, of another tenant
    stopped_cleanly(*s.stop())
    s.start()  # a start with the younger blocks on disk: it kept the tombstone
    stopped_cleanly(*s.stop())
    _put_back(tmp_path / "backup", s.disk)
    srv = s.start()
    try:
        assert s.admin("stats")["recovered"]["erased"] == 3, "the restored copy was not recognised as erased"
        assert get(srv, "globex", "chat", secret) == [False] * 3, "erased blocks served again from a restored copy"
        assert get(srv, "acme", "chat", keys_for("acme-later", 2)) == [True, True]  # control: kept
    finally:
        stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 2, "the restored copy was left on disk"


# -- D2: a whole-tenant erase a read-only disk refused, with encryption at rest ----------------------------
@pytest.fixture
def tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt


def _refused_tenant_erase(tmp_path, tmpfs, others=()) -> tuple[Restartable, list[bytes]]:
    """globex's 4 sealed files on disk (and acme's ``others``), globex's erase refused by the read-only
    disk: its keys shredded."""
    (tmp_path / "work").mkdir()
    s = Restartable(tmp_path / "work", **_encrypted(tmp_path, disk_dir=str(tmpfs / "disk"), disk_capacity="8MiB",
                                                    state_dir=str(tmp_path / "state")))
    s.disk = tmpfs / "disk"
    keys = keys_for("globex-shred", 4)
    srv = s.start()
    put(srv, "globex", "chat", keys)
    if others:
        put(srv, "acme", "chat", others)
    stopped_cleanly(*s.stop())  # flushed, sealed, to disk
    s.start()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        answer = s.admin("erase", tenant="globex")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert answer["refused"] == 4 and answer["keys_shredded"] is True, answer
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == 4 + len(others)  # the control: the files stayed
    return s, keys


def _starts_and_deletes_them(s: Restartable, keys) -> None:
    try:
        srv = s.start()  # before the fix: "none of the 4 sealed block files ... authenticates under this master key"
    except RuntimeError as exc:
        pytest.fail(f"the start after a refused erasure was refused: {str(exc)[-400:]}")
    try:
        recovered = s.admin("stats")["recovered"]
        assert (recovered["erased"], recovered["rejected"]) == (4, 0), recovered
        assert get(srv, "globex", "chat", keys) == [False] * 4
    finally:
        stopped_cleanly(*s.stop())
    assert block_files(s.disk) == [], "the shredded tenant's files were left on disk"


def test_a_tenant_erase_the_disk_refused_does_not_stop_the_next_start(tmp_path, tmpfs):
    s, keys = _refused_tenant_erase(tmp_path, tmpfs)
    _starts_and_deletes_them(s, keys)  # the tombstone covers them


# -- without the tombstone: an owner the key store lacks is never taken for shredded (s30 a10 D1) ----------
_NO_KEYS = (r"holds no keys of globex \(4 {what}\): either it is not the key store they were written with, or their "
            r"keys were shredded by an erasure whose tombstone was lost")


def test_a_shredded_tenants_files_without_its_tombstone_are_kept_and_the_start_names_it(tmp_path, tmpfs):
    """The tombstone lost with the state directory: nothing tells globex's shredded keys from a key
    store that never held them (another store of the same master key, an older backup), so its files
    are not deleted, and the start, no other file authenticating, is refused naming globex and both
    causes. (Before: taken for shredded -- and so were every tenant's files under a wrong key store.)"""
    s, _ = _refused_tenant_erase(tmp_path, tmpfs)
    (tmp_path / "state" / "runtime.json").unlink()
    with pytest.raises(RuntimeError, match=r"none of the 4 sealed block files .*" + _NO_KEYS.format(what="files")):
        s.start()
    assert len(block_files(s.disk)) == 4, "the files of a tenant the key store lacks were deleted"


def test_without_its_tombstone_a_shredded_tenants_files_are_kept_unserved_beside_the_others(tmp_path, tmpfs):
    """acme's files authenticate: the start goes on; globex's are rejected, kept, not served, and the
    log names globex."""
    acme = keys_for("acme-kept", 2)
    s, keys = _refused_tenant_erase(tmp_path, tmpfs, others=acme)
    (tmp_path / "state" / "runtime.json").unlink()
    srv = s.start()
    try:
        recovered = s.admin("stats")["recovered"]
        assert (recovered["recovered"], recovered["rejected"], recovered["erased"]) == (2, 4, 0), recovered
        assert get(srv, "globex", "chat", keys) == [False] * 4
        assert get(srv, "acme", "chat", acme) == [True, True]
    finally:
        _, log = s.stop()
    assert re.search(_NO_KEYS.format(what="sealed block files"), log), log[-2000:]
    assert len(block_files(s.disk)) == 6, "the files of a tenant the key store lacks were deleted"


# -- the bound: folding reaches no block the server keeps, and forgets nothing it need not ----------------
def _state(tmp_path, monkeypatch, bound: int) -> RuntimeState:
    monkeypatch.setattr(runtime_state, "MAX_ERASURES", bound)
    return RuntimeState(str(tmp_path / "runtime.json"), erasure_key=b"e" * 32)


def test_a_fold_never_covers_a_block_the_server_keeps(tmp_path, monkeypatch, caplog):
    """acme keeps a block of namespace "keep" created at 50 while session after session of "chat"
    is erased. The tombstones before it fold into one of the whole tenant (before 50); the others
    stay, each, until the bound forces the oldest out -- logged."""
    state = _state(tmp_path, monkeypatch, 8)
    held = [("keep", "", 50.0)]
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        for i in range(6):  # 10..35: before the kept block
            state.record_erasure("acme", "chat", f"s{i}", 10.0 + 5 * i, live_blocks=lambda owner: held)
        assert not caplog.records  # within the bound: nothing folded, nothing dropped
        for i in range(6, 12):  # 60..85: after it
            state.record_erasure("acme", "chat", f"s{i}", 30.0 + 5 * i, live_blocks=lambda owner: held)
    assert not state.erased("acme", "keep", "", 50.0), "a folded tombstone reaches a block the server keeps"
    for i in range(12):  # every erased session is still covered (the early ones by the fold)
        at = 10.0 + 5 * i if i < 6 else 30.0 + 5 * i
        assert state.erased("acme", "chat", f"s{i}", at), f"session s{i}'s erasure was forgotten"
    assert not caplog.records, "tombstones dropped though folding kept them within the bound"
    assert len(state.erasures()) <= 8
    assert RuntimeState(state.path, erasure_key=b"e" * 32).erasures() == state.erasures()  # as persisted


def test_tombstones_past_the_bound_that_cannot_fold_go_oldest_first_and_logged(tmp_path, monkeypatch, caplog):
    """A kept block older than every erasure: nothing may fold; the oldest go, with a log line."""
    state = _state(tmp_path, monkeypatch, 4)
    held = [("keep", "", 1.0)]
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        for i in range(6):
            state.record_erasure("acme", "chat", f"s{i}", 10.0 + i, live_blocks=lambda owner: held)
    assert not state.erased("acme", "keep", "", 1.0)
    assert sorted(state.erasures().values()) == [12.0, 13.0, 14.0, 15.0]  # the 4 youngest
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and all("1 erasure tombstones dropped" in m for m in dropped), dropped
