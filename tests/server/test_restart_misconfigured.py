"""A restart with the wrong master key or without its key store refuses to start and deletes nothing;
nor does one with another key store of the same master key, or a key store restored without a tenant.

Real ``kvtier serve`` processes (:class:`tests.server.test_restart.Restartable`): start, put,
SIGTERM, start misconfigured (refused, saying what to fix), restore the configuration, start
again: every block the first run stored is served.
"""

from __future__ import annotations

import re
import shutil

import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.keystore_dir import CHECK_FILE
from kvtier.crypto.providers import StaticMasterKey
from tests.server.conftest import keys_for
from tests.server.test_restart import Restartable, block_files, get, put, stopped_cleanly

RIGHT = {"KVTIER_MASTER_KEY": "5a" * 32}
WRONG = {"KVTIER_MASTER_KEY": "a5" * 32}
N = 6


def _stored(tmp_path, name: str) -> tuple[Restartable, list]:
    s = Restartable(tmp_path, encrypt_at_rest=True, keystore_dir=str(tmp_path / "keystore"))
    s.env = RIGHT
    srv = s.start()
    keys = keys_for(name, N)
    put(srv, "acme", "enc", keys)
    stopped_cleanly(*s.stop())
    assert len(block_files(s.disk)) == N
    return s, keys


def _served_again(s: Restartable, keys) -> None:
    s.env = RIGHT
    srv = s.start()
    try:
        assert get(srv, "acme", "enc", keys) == [True] * N
        assert s.admin("stats")["recovered"]["recovered"] == N
    finally:
        stopped_cleanly(*s.stop())


@pytest.mark.parametrize("mistake, refusal", [
    ("wrong_master_key", "the master key does not match the key store"),
    ("keystore_not_mounted", "key store .* is missing, but .* holds 6 spilled block files"),
    ("keystore_empty", "key store .* is empty, but .* holds 6 spilled block files"),
])
def test_a_misconfigured_restart_is_refused_and_keeps_the_encrypted_spill(tmp_path, mistake, refusal):
    s, keys = _stored(tmp_path, f"misconf-{mistake}")
    keystore = tmp_path / "keystore"
    if mistake == "wrong_master_key":
        s.env = WRONG
    else:
        keystore.rename(tmp_path / "keystore.offline")  # the volume is not there this time
        if mistake == "keystore_empty":
            keystore.mkdir()  # a mount point with nothing mounted on it
    with pytest.raises(RuntimeError, match=refusal):
        s.start()
    assert len(block_files(s.disk)) == N
    if mistake != "wrong_master_key":
        assert not keystore.exists() or list(keystore.iterdir()) == []  # no new keys were made
        shutil.rmtree(keystore, ignore_errors=True)
        (tmp_path / "keystore.offline").rename(keystore)
    _served_again(s, keys)


def test_a_store_from_before_the_check_with_the_wrong_key_is_refused_by_recovery(tmp_path):
    """Without the check file (an older version's store) the master key cannot be told wrong up
    front; then every sealed file failing authentication refuses the start instead of deleting."""
    s, keys = _stored(tmp_path, "misconf-old-store")
    check = tmp_path / "keystore" / CHECK_FILE
    check.unlink()
    store = sorted(p.name for p in check.parent.iterdir())
    s.env = WRONG
    with pytest.raises(RuntimeError, match=f"none of the {N} sealed block files .* authenticates"):
        s.start()
    assert len(block_files(s.disk)) == N
    assert sorted(p.name for p in check.parent.iterdir()) == store  # no check, no keys from the wrong key
    _served_again(s, keys)  # the right key: recovered, and the store gets its check now
    assert check.exists()
    s.env = WRONG
    with pytest.raises(RuntimeError, match="the master key does not match"):
        s.start()


# -- a key store that lacks a tenant: never taken for its keys shredded (s30 a10 D1) ----------------------
def _no_keys_of(tenant: str, n: int, what: str) -> str:
    return (rf"holds no keys of {tenant} \({n} {what}\): either it is not the key store they were written with, "
            rf"or their keys were shredded by an erasure whose tombstone was lost")


def test_another_key_store_of_the_same_master_key_is_refused_naming_the_tenant_and_deletes_nothing(tmp_path):
    """keystore_dir pointed at a sibling server's store (one master key for both: it passes the master
    key check) that holds globex's keys only. Before: acme taken for shredded, its 6 files deleted."""
    s, keys = _stored(tmp_path, "misconf-sibling")
    sibling = Keyring(StaticMasterKey(bytes.fromhex(RIGHT["KVTIER_MASTER_KEY"])), tmp_path / "sibling")
    sibling.storage_key("globex", bytes(32))  # (makes globex's keys)
    s.server["keystore_dir"] = str(tmp_path / "sibling")
    with pytest.raises(RuntimeError, match=f"none of the {N} sealed block files .*" + _no_keys_of("acme", N, "files")):
        s.start()
    assert len(block_files(s.disk)) == N
    s.server["keystore_dir"] = str(tmp_path / "keystore")
    _served_again(s, keys)


def test_a_key_store_restored_without_a_tenant_keeps_its_files_until_the_right_one_is_back(tmp_path):
    """The key store restored from a backup taken before acme's first write: globex's blocks are
    served, acme's files kept (not served, the log naming acme), and served once its keys are back.
    (Before: deleted as files that do not authenticate; since 0fe05d9, as shredded.)"""
    s = Restartable(tmp_path, encrypt_at_rest=True, keystore_dir=str(tmp_path / "keystore"))
    s.env = RIGHT
    srv = s.start()
    globex = keys_for("restored-globex", 2)
    put(srv, "globex", "enc", globex)
    shutil.copytree(tmp_path / "keystore", tmp_path / "backup", ignore=shutil.ignore_patterns("*.tmp*"))
    acme = keys_for("restored-acme", N)
    put(srv, "acme", "enc", acme)
    stopped_cleanly(*s.stop())
    (tmp_path / "keystore").rename(tmp_path / "keystore.current")
    shutil.copytree(tmp_path / "backup", tmp_path / "keystore")
    srv = s.start()
    try:
        recovered = s.admin("stats")["recovered"]
        assert (recovered["recovered"], recovered["rejected"]) == (2, N), recovered
        assert get(srv, "globex", "enc", globex) == [True, True]
        assert get(srv, "acme", "enc", acme) == [False] * N
    finally:
        _, log = s.stop()
    assert re.search(_no_keys_of("acme", N, "sealed block files"), log), log[-2000:]
    assert len(block_files(s.disk)) == N + 2, "the files of a tenant the restored key store lacks were deleted"
    shutil.rmtree(tmp_path / "keystore")
    (tmp_path / "keystore.current").rename(tmp_path / "keystore")
    srv = s.start()
    try:
        assert get(srv, "acme", "enc", acme) == [True] * N
        assert get(srv, "globex", "enc", globex) == [True, True]
    finally:
        stopped_cleanly(*s.stop())
