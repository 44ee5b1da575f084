"""A restart with the wrong master key or without its key store refuses to start and deletes nothing.

Real ``kvtier serve`` processes (:class:`tests.server.test_restart.Restartable`): start, put,
SIGTERM, start misconfigured (refused, saying what to fix), restore the configuration, start
again: every block the first run stored is served.
"""

from __future__ import annotations

import shutil

import pytest

from kvtier.crypto.keystore_dir import CHECK_FILE
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
