"""The key store under races, crashes, damage and a hostile or wrong directory.

Two processes are two ``Keyring`` objects over one store (as in test_keys_from_elsewhere.py);
the other one's change is placed at the exact point of a race by wrapping a method of this one.
A crash mid-write is a real child process killed between the temp write and the rename.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

import kvtier.crypto.keyring as keyring_mod
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.keystore_dir import CHECK_FILE
from kvtier.crypto.providers import StaticMasterKey
from kvtier.errors import ConfigError

MASTER = StaticMasterKey(bytes(range(32)))
OTHER_MASTER = StaticMasterKey(bytes(range(1, 33)))
TENANT = "acme"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _keyring(tmp_path, master=MASTER, **kw) -> Keyring:
    return Keyring(master, tmp_path / "keys", refresh_s=0.0, **kw)


def _after_next_read(reader: Keyring, change) -> list:
    """Run ``change`` (the other process) right after ``reader``'s next read of a key file;
    the returned list is non-empty once it ran (the race was placed, not missed)."""
    original, fired = reader._read_doc, []

    def read_then_change(tenant):
        read = original(tenant)
        if not fired:
            fired.append(True)
            change()
        return read

    reader._read_doc = read_then_change
    return fired


def _recoverable_keys(keyring: Keyring, tenant: str) -> list[tuple[str, str]]:
    """(file, what) for each wrapped key of ``tenant`` that still unwraps from any file of the store."""
    found = []
    for path in sorted(keyring.dir.iterdir()):
        try:
            doc = json.loads(path.read_bytes())
        except (ValueError, OSError):
            continue
        if not isinstance(doc, dict):
            continue
        wrapped = [("index", doc.get("index_key"))] + [
            (f"data/{e}", entry.get("key")) for e, entry in (doc.get("epochs") or {}).items()]
        for purpose, text in wrapped:
            try:
                keyring._unwrap(tenant, purpose, text)
                found.append((path.name, purpose))
            except (ConfigError, TypeError):
                pass
    return found


# -- C1: the cached version is the one the content was read from -----------------------------
def test_an_epoch_retired_elsewhere_during_a_reload_is_seen_retired_here(tmp_path):
    other = _keyring(tmp_path)
    old = other.key_for_write(TENANT)  # epoch 0
    other.rotate(TENANT)  # epoch 1 current; epoch 0 still readable
    me = _keyring(tmp_path)  # refresh_s=0: looks at the file on every use
    assert me.key_for_read(TENANT, 0, old.key_id) is not None  # control: readable here before
    me._tenants.clear()

    fired = _after_next_read(me, lambda: other.retire(TENANT, 0))
    me.epochs(TENANT)  # this process reloads; the retirement lands mid-load
    assert fired
    assert other.key_for_read(TENANT, 0, old.key_id) is None
    assert me.key_for_read(TENANT, 0, old.key_id) is None, "a retired data key still opens blocks here"
    assert me.retired(TENANT, 0)


def test_a_tenant_shredded_elsewhere_during_a_reload_is_a_clean_miss(tmp_path):
    other = _keyring(tmp_path)
    key = other.key_for_write(TENANT)
    me = _keyring(tmp_path)
    fired = _after_next_read(me, lambda: other.shred_tenant(TENANT))
    assert me.key_for_read(TENANT, key.epoch, key.key_id) is None  # not FileNotFoundError
    assert fired


# -- C2: a retirement is durable before it is reported ----------------------------------------
def _record_renames_and_syncs(monkeypatch) -> list:
    events: list = []
    real_rename, real_fsync_dir = os.rename, keyring_mod.fsync_dir

    def rename(src, dst, *a, **kw):
        real_rename(src, dst, *a, **kw)
        events.append("rename")

    def fsync_dir(path):
        real_fsync_dir(path)
        events.append("fsync_dir")

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(keyring_mod, "fsync_dir", fsync_dir)
    return events


def _durable(events: list) -> bool:
    """Some rename happened, and the last one is followed by a sync of the directory."""
    return "rename" in events and "fsync_dir" in events[len(events) - events[::-1].index("rename"):]


def test_retire_syncs_the_directory_before_reporting_the_key_gone(tmp_path, monkeypatch):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)
    kr.rotate(TENANT)
    events = _record_renames_and_syncs(monkeypatch)
    assert kr.retire(TENANT, 0)
    assert _durable(events), events


def test_retention_retirement_is_durable(tmp_path, monkeypatch):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)
    kr.rotate(TENANT)
    monkeypatch.setattr(keyring_mod.time, "time", lambda real=keyring_mod.time.time: real() + 3600)
    events = _record_renames_and_syncs(monkeypatch)
    assert 0 in kr.retire_older_than(TENANT, 60)
    assert _durable(events), events


# -- C3: a shredded tenant leaves no copy of its keys in temp files ---------------------------
CRASH_MID_WRITE = textwrap.dedent(f"""
    import os, signal, sys
    sys.path.insert(0, {REPO!r})
    import kvtier.crypto.keyring as km
    from kvtier.crypto.providers import StaticMasterKey
    kr = km.Keyring(StaticMasterKey(bytes(range(32))), sys.argv[1])
    kr.key_for_write({TENANT!r})
    os.rename = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # dies before the rename
    kr.rotate({TENANT!r})
""")


def test_a_tenant_shredded_after_a_crash_mid_write_has_no_recoverable_key(tmp_path):
    keys = tmp_path / "keys"
    proc = subprocess.run([sys.executable, "-c", CRASH_MID_WRITE, str(keys)], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    temps = [p for p in keys.iterdir() if ".tmp" in p.name]
    assert [sorted(json.loads(p.read_bytes())["epochs"]) for p in temps] == [["0", "1"]]  # control: the
    # crash left the whole key document, the new epoch's key too, in a temp file

    kr = _keyring(tmp_path)  # the restarted server: sweeps what dead writers left
    assert [p.name for p in keys.iterdir() if ".tmp" in p.name] == []
    assert kr.epochs(TENANT) == [0]
    assert kr.shred_tenant(TENANT)
    assert _recoverable_keys(kr, TENANT) == []


def test_shred_removes_a_temp_file_left_beside_the_key_file(tmp_path):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)
    path = kr._file(TENANT)
    leftover = path.with_name(f"{path.stem}.tmp4242.1")  # an older version's name; its writer died
    leftover.write_bytes(path.read_bytes())
    assert (leftover.name, "index") in _recoverable_keys(kr, TENANT)  # control: the check sees it
    assert kr.shred_tenant(TENANT)
    assert _recoverable_keys(kr, TENANT) == []


def test_a_failed_key_store_write_leaves_no_copy_of_the_keys_behind(tmp_path, monkeypatch):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        kr.rotate(TENANT)
    monkeypatch.undo()
    assert [p.name for p in kr.dir.iterdir() if ".tmp" in p.name] == []
    assert kr.shred_tenant(TENANT)
    assert _recoverable_keys(kr, TENANT) == []


# -- C5: a damaged key file is a ConfigError naming it, never replaced ------------------------
@pytest.mark.parametrize("how", ["truncated", "empty", "not_a_key_document", "wrapped_key_altered"])
def test_a_damaged_key_store_file_is_a_clear_config_error(tmp_path, how):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)
    path = kr._file(TENANT)
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "empty":
        path.write_text("")
    elif how == "not_a_key_document":
        path.write_text(json.dumps({"version": 1}))
    else:
        doc = json.loads(text)
        wrapped = doc["epochs"]["0"]["key"]
        doc["epochs"]["0"]["key"] = wrapped[:-4] + ("AAAA" if wrapped[-4:] != "AAAA" else "BBBB")
        path.write_text(json.dumps(doc))
    damaged = path.read_bytes()
    fresh = _keyring(tmp_path)  # a restarted process
    with pytest.raises(ConfigError, match=path.name):
        fresh.key_for_write(TENANT)
    assert path.read_bytes() == damaged  # never replaced by new keys


# -- C6: private directories, no write through a planted link ---------------------------------
def test_the_key_store_directories_are_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        Keyring(MASTER, tmp_path / "var-lib-kvtier" / "keys")
    finally:
        os.umask(old)
    for d in (tmp_path / "var-lib-kvtier", tmp_path / "var-lib-kvtier" / "keys"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_a_key_store_write_does_not_follow_a_planted_symlink(tmp_path, monkeypatch):
    kr = _keyring(tmp_path)
    kr.key_for_write(TENANT)
    victim = tmp_path / "victim.conf"
    victim.write_text("important\n")
    path = kr._file(TENANT)
    os.symlink(victim, path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}"))  # the old, predictable name
    assert kr.rotate(TENANT) == 1
    assert victim.read_text() == "important\n" and not path.is_symlink()
    # a link at the very name the write picks (its random suffix pinned here) is refused, not followed
    monkeypatch.setattr("kvtier.private_files.secrets.token_hex", lambda n: "feedf00d")
    os.symlink(victim, path.with_suffix(f".tmp{os.getpid()}.feedf00d"))
    with pytest.raises(FileExistsError):
        kr.rotate(TENANT)
    assert victim.read_text() == "important\n" and not path.is_symlink()


def test_a_planted_lock_file_link_is_not_followed(tmp_path):
    kr = _keyring(tmp_path)
    elsewhere = tmp_path / "created-elsewhere"
    os.symlink(elsewhere, kr._file(TENANT).with_suffix(".lock"))
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        kr.key_for_write(TENANT)
    assert not elsewhere.exists()


# -- C7: rotate racing a shred elsewhere ------------------------------------------------------
def test_rotate_racing_a_shred_elsewhere_returns_the_new_current_epoch(tmp_path):
    me, other = _keyring(tmp_path), _keyring(tmp_path)
    me.key_for_write(TENANT)
    real_update, shredded = me._update, []

    def shred_first(tenant, mutate, **kw):  # the other process's erase lands between load and update
        shredded.append(other.shred_tenant(tenant))
        return real_update(tenant, mutate, **kw)

    me._update = shred_first
    epoch = me.rotate(TENANT)
    assert shredded == [True]
    assert epoch == me.current_epoch(TENANT)


def test_retire_of_a_tenant_shredded_elsewhere_creates_nothing(tmp_path):
    me, other = _keyring(tmp_path), _keyring(tmp_path)
    me.key_for_write(TENANT)
    other.shred_tenant(TENANT)
    assert not me.retire(TENANT, 0)
    assert not me._file(TENANT).exists()


# -- C4: the store belongs to one master key --------------------------------------------------
def test_another_master_keys_store_is_refused_and_left_untouched(tmp_path):
    _keyring(tmp_path).key_for_write(TENANT)
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "keys").iterdir())
    with pytest.raises(ConfigError, match="master key does not match the key store"):
        _keyring(tmp_path, OTHER_MASTER)
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "keys").iterdir()) == before
    assert _keyring(tmp_path).epochs(TENANT) == [0]  # control: the right key still opens it


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_store_required_by_existing_data_is_never_made_afresh(tmp_path, state):
    if state == "empty":
        (tmp_path / "keys").mkdir()
    with pytest.raises(ConfigError, match=f"key store .* is {state}, but 6 blocks need it"):
        _keyring(tmp_path, required_by="6 blocks need it")
    if state == "empty":
        assert list((tmp_path / "keys").iterdir()) == []  # nothing written
    else:
        assert not (tmp_path / "keys").exists()
    _keyring(tmp_path).key_for_write(TENANT)  # control: a store that exists is accepted
    assert _keyring(tmp_path, required_by="6 blocks need it").epochs(TENANT) == [0]


def test_a_store_from_before_the_check_keeps_working_and_gets_one(tmp_path):
    key = _keyring(tmp_path).key_for_write(TENANT)
    check = tmp_path / "keys" / CHECK_FILE
    check.unlink()  # what an older version left
    # another master key cannot tell whether the store is its own: it is not refused, but
    # writes no check (one from the wrong key would lock the right one out)
    _keyring(tmp_path, OTHER_MASTER).epochs(TENANT)
    assert not check.exists()
    right = _keyring(tmp_path)
    assert not check.exists()  # written once one of the store's files opens under the key
    assert right.key_for_read(TENANT, key.epoch, key.key_id) is not None
    assert check.exists() and stat.S_IMODE(check.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="master key does not match"):
        _keyring(tmp_path, OTHER_MASTER)
