"""A block an encrypted tier withholds (its delete refused by the keyring) stays withheld until its
removal has landed below. The mark was dropped before the tier below was asked, whatever it then
answered: a remote tier in backoff (its delete False, nothing refused) ended the hold with the
sealed copy still stored, no later call tried again, and once the remote tier answered again the
block whose erasure was refused was served (audit s33 r4 D2)."""

from __future__ import annotations

import time

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from tests.polling import wait_until
from tests.server.conftest import keys_for
from tests.server.inprocess import InProcessServer

NBYTES = 4096


def test_a_withheld_block_stays_withheld_while_the_tier_below_cannot_remove_it(tmp_path):
    srv = InProcessServer(tmp_path)
    stalled = []
    srv.before_deletions(lambda _: time.sleep(1.0) if stalled else None)
    remote = srv.remote("acme", timeout_s=0.3, backoff_s=0.3, max_backoff_s=0.3)
    keyring = Keyring(StaticMasterKey(bytes(range(32))), tmp_path / "keys", refresh_s=0.0)
    enc = EncryptedTier(remote, keyring, "acme", threads=1)
    key, other = (BlockKey(k) for k in keys_for("s33c-withheld", 2))
    out = np.zeros(NBYTES, np.uint8)
    try:
        assert enc.put(key, np.full(NBYTES, 5, np.uint8)) is Status.OK
        assert enc.put(other, np.full(NBYTES, 6, np.uint8)) is Status.OK
        (key_file,) = [f for f in (tmp_path / "keys").glob("*.json") if f.name != "keystore-check.json"]
        saved = key_file.read_bytes()
        key_file.unlink()
        key_file.mkdir()  # the tenant's key file unreadable: the delete is refused, the block withheld
        assert enc.delete(key) is False
        key_file.rmdir()
        key_file.write_bytes(saved)  # the key file reads again ...
        stalled.append(True)
        assert enc.delete(other) is False  # ... but a server stall times a call out: the remote tier backs off
        stalled.clear()
        assert not remote.available
        # the withheld block's removal cannot land now: the call answers ERROR, the block stays withheld
        assert enc.get(key, out) is Status.ERROR
        assert not out.any()
        assert wait_until(lambda: enc.contains(other) or remote.available, 10.0)  # the remote tier is back
        # the removal is tried again and lands: a miss, never the block whose erasure was refused
        assert enc.get(key, out) is Status.MISS
        assert not out.any()
        assert not remote.contains(enc.storage_name(key))
    finally:
        enc.close()
        remote.close()
        srv.stop()
