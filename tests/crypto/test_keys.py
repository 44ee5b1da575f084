import os

import numpy as np
import pytest

from kvtier.crypto import keyring as keyring_mod
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import EnvMasterKey, FileMasterKey, StaticMasterKey
from kvtier.errors import ConfigError
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

B = 256 * 1024


def block(i):
    return np.random.default_rng(i).integers(0, 256, B, dtype=np.uint8)


def enc_host(keyring, tenant, host=None):
    host = host or HostTier(32 * (B + 8192), B + 8192)
    return EncryptedTier(host, keyring, tenant, chunk_bytes=64 * 1024, threads=1), host


def test_storage_keys_are_keyed_and_per_tenant(keyring):
    k = b"k" * 32
    a, b = keyring.storage_key("a", k), keyring.storage_key("b", k)
    assert a != b and k not in (a, b)
    # controls: the same tenant and key name the same block, in this process and in a new one
    assert keyring.storage_key("a", k) == a
    assert Keyring(StaticMasterKey(bytes(range(32))), keyring.dir).storage_key("a", k) == a
    other = Keyring(StaticMasterKey(b"\1" * 32), keyring.dir.parent / "other")
    assert other.storage_key("a", k) != a


def test_rotation_keeps_old_epochs_readable(keyring):
    tier, _ = enc_host(keyring, "acme")
    tier.put(b"1" * 32, block(1))
    assert keyring.rotate("acme") == 1
    tier.put(b"2" * 32, block(2))
    out = np.empty(B, np.uint8)
    for i in (1, 2):
        assert tier.get(str(i).encode() * 32, out) is Status.OK
        assert np.array_equal(out, block(i))
    assert keyring.epochs("acme") == [0, 1]


def test_retiring_an_epoch_shreds_its_blocks_only(keyring):
    tier, _ = enc_host(keyring, "acme")
    tier.put(b"1" * 32, block(1))
    keyring.rotate("acme")
    tier.put(b"2" * 32, block(2))
    out = np.empty(B, np.uint8)
    assert tier.get(b"1" * 32, out) is Status.OK and np.array_equal(out, block(1))  # control: readable until retired
    keyring.retire("acme", 0)
    out = np.empty(B, np.uint8)
    # a retired key is a key nobody holds: a miss (never the block), not a failed tag
    assert tier.get(b"1" * 32, out) is Status.MISS
    assert tier.get(b"2" * 32, out) is Status.OK and np.array_equal(out, block(2))
    assert tier.stats.verify_failures == 0


def test_shredding_a_tenant_makes_its_disk_files_noise(keyring, tmp_path):
    from kvtier.tiers.disk import DiskTier

    disk = DiskTier(tmp_path / "d", 64 * B)
    tier = EncryptedTier(disk, keyring, "acme", chunk_bytes=64 * 1024, threads=1)
    ctrl = EncryptedTier(disk, keyring, "other", chunk_bytes=64 * 1024, threads=1)
    for i in range(3):
        tier.put(bytes([i]) * 32, block(i))
    ctrl.put(b"c" * 32, block(9))
    files = list((tmp_path / "d").rglob("*.kvb"))
    assert len(files) == 4
    payload = b"".join(f.read_bytes() for f in files)
    assert block(0).tobytes()[:4096] not in payload  # nothing in clear on disk
    # Control: the keys persisted. A new process (fresh keyring and disk tier on the same
    # directories) opens every block; so the misses after the shred are the shred's doing.
    before = Keyring(StaticMasterKey(bytes(range(32))), keyring.dir)
    t = EncryptedTier(DiskTier(tmp_path / "d", 64 * B), before, "acme", chunk_bytes=64 * 1024, threads=1)
    for i in range(3):
        out = np.zeros(B, np.uint8)
        assert t.get(bytes([i]) * 32, out) is Status.OK and np.array_equal(out, block(i))
    assert keyring.shred_tenant("acme")
    # A new process (fresh keyring on the same key store) cannot read them either.
    fresh = Keyring(StaticMasterKey(bytes(range(32))), keyring.dir)
    for kr in (keyring, fresh):
        t = EncryptedTier(DiskTier(tmp_path / "d", 64 * B), kr, "acme", chunk_bytes=64 * 1024, threads=1)
        out = np.empty(B, np.uint8)
        assert all(t.get(bytes([i]) * 32, out) is not Status.OK for i in range(3))
    out = np.empty(B, np.uint8)
    assert ctrl.get(b"c" * 32, out) is Status.OK and np.array_equal(out, block(9))


def test_retention_retires_old_epochs(keyring, monkeypatch):
    keyring.key_for_write("acme")
    keyring.rotate("acme")
    import time

    real = time.time
    monkeypatch.setattr(keyring_mod.time, "time", lambda: real() + 3600)
    retired = keyring.retire_older_than("acme", 60)
    assert retired == [0, 1]
    assert keyring.epochs("acme") == [2]


def test_rotation_before_the_nonce_bound(tmp_path):
    keyring = Keyring(StaticMasterKey(bytes(range(32))), tmp_path / "keys", refresh_s=0.0, rotate_after=10,
                      lease_size=4)
    assert keyring.key_for_write("acme", 9).epoch == 0  # reserved before use
    assert keyring.current_epoch("acme") == 0
    assert keyring.key_for_write("acme", 1).epoch == 0  # the 10th: the bound, not past it
    assert keyring.key_for_write("acme", 1).epoch == 1  # the 11th needs a new key
    assert keyring.current_epoch("acme") == 1
    assert keyring.leased("acme") == {0: 10, 1: 4}


def test_key_providers_validate(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_MASTER_KEY", raising=False)
    with pytest.raises(ConfigError, match="set KVTIER_MASTER_KEY"):
        EnvMasterKey().master_key()
    monkeypatch.setenv("KVTIER_MASTER_KEY", "ab" * 32)
    assert EnvMasterKey().master_key() == b"\xab" * 32
    monkeypatch.setenv("KVTIER_MASTER_KEY", "short")
    with pytest.raises(ConfigError, match="64 hex digits"):
        EnvMasterKey().master_key()
    path = tmp_path / "master.key"
    path.write_text("cd" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        FileMasterKey(path).master_key()
    os.chmod(path, 0o600)
    assert FileMasterKey(path).master_key() == b"\xcd" * 32


def test_keystore_files_do_not_name_tenants(keyring):
    keyring.key_for_write("acme-corp")
    names = [p.name for p in keyring.dir.iterdir()]
    assert names and not any("acme" in n for n in names)


def test_batches_are_pipelined_and_a_tampered_block_fails_alone(keyring):
    tier, host = enc_host(keyring, "acme")
    keys = [bytes([i]) * 32 for i in range(6)]
    assert tier.put_many(keys, [block(i) for i in range(6)]) == [Status.OK] * 6
    # flip one byte of block 3's sealed bytes inside the host pool
    with host.borrow(tier.storage_name(keys[3])) as view:
        view.flags.writeable = True  # test only: simulate corruption below the AEAD
        view[1000] ^= 0xFF
    outs = [np.empty(B, np.uint8) for _ in range(6)]
    statuses = tier.get_many(keys + [b"x" * 32], outs + [np.empty(B, np.uint8)])
    assert statuses == [Status.OK] * 3 + [Status.CORRUPT] + [Status.OK] * 2 + [Status.MISS]
    assert all(np.array_equal(outs[i], block(i)) for i in (0, 1, 2, 4, 5))
    assert tier.put_many(keys[:2], [block(0), block(1)]) == [Status.OK] * 2  # present: no-op


def test_batches_over_several_groups_keep_each_blocks_status_and_bytes(keyring, monkeypatch):
    """A batch larger than one fetch group (two blocks here) is fetched group by group while
    the previous group opens: statuses and bytes stay those of each block, a miss and a
    tampered block in different groups fail alone, and outputs are poisoned first so a group
    that is never opened cannot pass."""
    from kvtier.tiers import encrypted

    monkeypatch.setattr(encrypted, "GROUP_BYTES", 2 * (B + 8192))
    tier, host = enc_host(keyring, "acme")
    keys = [bytes([i]) * 32 for i in range(7)]
    assert tier.put_many(keys, [block(i) for i in range(7)]) == [Status.OK] * 7
    with host.borrow(tier.storage_name(keys[5])) as view:
        view.flags.writeable = True  # test only: simulate corruption below the AEAD
        view[4321] ^= 0x01
    asked = keys[:2] + [b"x" * 32] + keys[2:]  # the miss sits in the second group
    outs = [np.full(B, 0xAA, np.uint8) for _ in asked]
    statuses = tier.get_many(asked, outs)
    assert statuses == [Status.OK] * 2 + [Status.MISS] + [Status.OK] * 3 + [Status.CORRUPT] + [Status.OK]
    for pos, i in ((0, 0), (1, 1), (3, 2), (4, 3), (5, 4), (7, 6)):
        assert np.array_equal(outs[pos], block(i)), pos
    # control: with one group the same batch gives the same answer
    monkeypatch.setattr(encrypted, "GROUP_BYTES", 64 << 20)
    assert tier.get_many(keys[:5], [np.empty(B, np.uint8) for _ in range(5)]) == [Status.OK] * 5
