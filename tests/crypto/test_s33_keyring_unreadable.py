"""A key file that cannot be read fails closed, and is asked once per ``refresh_s``.

The keys a process holds are not used past ``refresh_s`` once their file cannot be read: what
failed may be a retirement's rewrite, or a shredded file on a shared mount (ESTALE), and a retired
or shredded key must never go on opening blocks. A failing file is not read again at every call
either (each get re-opened it, a hung key store stalling every one): the failure is remembered for
``refresh_s``. (0254380's docstring promised that the keys held survive a failed read: true only
until ``refresh_s`` passed: audit s33 a2 D4.)"""

from __future__ import annotations

import time

import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey

MASTER = StaticMasterKey(bytes(range(32)))
REFRESH_S = 1.0


def _key_file(keys_dir):
    (path,) = (f for f in keys_dir.glob("*.json") if f.name != "keystore-check.json")  # the tenant's keys
    return path


def _unreadable(path) -> bytes:
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()  # reading it fails: IsADirectoryError
    return saved


def _readable(path, saved: bytes) -> None:
    path.rmdir()
    path.write_bytes(saved)


def test_a_key_file_that_cannot_be_read_fails_closed_and_is_read_again_only_after_refresh_s(tmp_path):
    keys = Keyring(MASTER, tmp_path / "keys", refresh_s=REFRESH_S)
    held = keys.key_for_write("acme")
    path = _key_file(tmp_path / "keys")
    saved = _unreadable(path)
    assert keys.key_for_read("acme", held.epoch, held.key_id) is held  # checked < refresh_s ago
    time.sleep(REFRESH_S + 0.1)
    with pytest.raises(IsADirectoryError):
        keys.key_for_read("acme", held.epoch, held.key_id)  # the keys held are not used past refresh_s
    _readable(path, saved)
    with pytest.raises(IsADirectoryError):  # read again at every call: the file read back at once
        keys.key_for_read("acme", held.epoch, held.key_id)  # the failure stands for refresh_s
    time.sleep(REFRESH_S + 0.1)
    assert keys.key_for_read("acme", held.epoch, held.key_id).key_id == held.key_id  # read again: back


def test_a_retirement_elsewhere_then_an_unreadable_file_never_leaves_the_retired_key_in_use(tmp_path):
    mine = Keyring(MASTER, tmp_path / "keys", refresh_s=REFRESH_S)
    retired = mine.key_for_write("acme")
    other = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    other.rotate("acme")
    assert other.retire("acme", retired.epoch)  # its blocks must be unreadable everywhere from now on
    _unreadable(_key_file(tmp_path / "keys"))
    time.sleep(REFRESH_S + 0.1)
    for _ in range(2):  # (the second from the failure remembered)
        with pytest.raises(IsADirectoryError):
            mine.key_for_read("acme", retired.epoch, retired.key_id)
