"""One AES-GCM use budget per data key across every process sharing a key store.

Real processes (``tests/crypto/nonce_budget_worker.py``) seal blocks through an
``EncryptedTier`` over one key store directory; encryptions are counted from the
sealed headers they produced. Small bounds (1000 encryptions per key, leases of 64)
stand in for 2^30 and 2^20.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.keys import BlockKey
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.errors import ConfigError
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from tests.crypto.nonce_budget_worker import MASTER, TENANT

REPO = Path(__file__).resolve().parents[2]
BOUND, LEASE = 1000, 64
PROCESSES, EACH = 4, 2000


def worker(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.crypto.nonce_budget_worker", *map(str, args)],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_processes_sharing_a_key_store_stay_within_the_bound_per_data_key(tmp_path):
    store = tmp_path / "keys"
    procs = [worker("seal", store, BOUND, LEASE, EACH) for _ in range(PROCESSES)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:  # start together, so that their leases interleave
            p.stdin.write("go\n")
            p.stdin.close()
            p.stdin = None  # (closed: communicate() must not flush it)
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * PROCESSES

    per_key: Counter = Counter()  # (epoch, key id) -> encryptions, all processes
    users = defaultdict(set)  # (epoch, key id) -> the processes that encrypted under it
    for out in outputs:
        lines = [json.loads(line) for line in out.splitlines() if line]
        assert sum(line["chunks"] for line in lines) >= EACH
        for line in lines:
            k = (line["epoch"], line["key_id"])
            per_key[k] += line["chunks"]
            users[k].add(line["pid"])

    over = {k: n for k, n in per_key.items() if n > BOUND}
    assert not over, f"data keys used past the bound of {BOUND} encryptions: {over}"
    # Controls: the budget was really shared and really spent -- keys were rotated, and
    # processes encrypted under the same key (else the bound would hold per process anyway).
    assert len(per_key) >= PROCESSES * EACH // BOUND, per_key
    assert any(len(pids) > 1 for pids in users.values()), users
    # The store agrees: what it leased per key is within the bound and covers every encryption.
    leased = Keyring(MASTER, store, rotate_after=BOUND, lease_size=LEASE).leased(TENANT)
    assert all(n <= BOUND for n in leased.values()), leased
    for (epoch, _), n in per_key.items():
        assert n <= leased[epoch]
    assert len({k[0] for k in per_key}) == len(per_key)  # one key per epoch


def test_a_process_killed_mid_lease_never_gets_its_budget_reused(tmp_path):
    store = tmp_path / "keys"
    victim = worker("hold", store, BOUND, LEASE, 5)  # 15 of its 64 encryptions spent
    try:
        lines = [json.loads(victim.stdout.readline()) for _ in range(6)]
        held = lines[-1]["lease"]
        assert (held["start"], held["end"], held["remaining"]) == (0, LEASE, LEASE - 15)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
    assert victim.returncode == -signal.SIGKILL
    epoch = held["epoch"]
    assert {line["epoch"] for line in lines[:-1]} == {epoch}

    survivor = Keyring(MASTER, store, rotate_after=BOUND, lease_size=LEASE)
    assert survivor.leased(TENANT) == {epoch: LEASE}  # the dead lease stays spent
    assert survivor.key_for_write(TENANT, 3).epoch == epoch
    lease = survivor.lease(TENANT)
    assert lease.epoch == epoch and lease.start >= held["end"]  # after the killed one's, never inside it
    assert survivor.leased(TENANT) == {epoch: 2 * LEASE}


def test_a_lease_continues_under_the_same_key_and_rotation_elsewhere_is_followed(tmp_path):
    one = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0, rotate_after=BOUND, lease_size=LEASE)
    other = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0, rotate_after=BOUND, lease_size=LEASE)
    for _ in range(21):
        assert one.key_for_write(TENANT, 3).epoch == 0  # 63 of the first lease
    assert one.key_for_write(TENANT, 3).epoch == 0  # 1 left, 2 more taken from a second lease
    assert one.lease(TENANT).remaining == LEASE - 2
    assert one.leases_taken == 2
    assert other.rotate(TENANT) == 1
    assert one.key_for_write(TENANT).epoch == 1  # the rest of the old lease is dropped, never used
    assert one.leased(TENANT) == {0: 2 * LEASE, 1: LEASE}


def test_streamed_seals_reserve_their_chunks_and_rotate(tmp_path):
    keys = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0, rotate_after=20, lease_size=8)
    tier = EncryptedTier(DiskTier(tmp_path / "disk", 1 << 24), keys, TENANT, chunk_bytes=4096, streams=2)
    blocks = [np.random.default_rng(i).integers(0, 256, 3 * 4096, dtype=np.uint8) for i in range(12)]
    names = [BlockKey(i.to_bytes(32, "big")) for i in range(12)]
    assert tier.put_many(names, blocks) == [Status.OK] * 12
    leased = keys.leased(TENANT)
    assert len(leased) >= 2 and all(n <= 20 for n in leased.values()), leased
    assert sum(leased.values()) >= 12 * 3  # every chunk sealed was reserved first
    for name, want in zip(names, blocks):
        out = np.empty_like(want)
        assert tier.get(name, out) is Status.OK and np.array_equal(out, want)
    tier.close()


def test_budget_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="rotate_after"):
        Keyring(MASTER, tmp_path / "keys", rotate_after=(1 << 32) + 1)
    with pytest.raises(ConfigError, match="lease_size"):
        Keyring(MASTER, tmp_path / "keys", lease_size=0)
    keys = Keyring(MASTER, tmp_path / "keys", rotate_after=10)
    with pytest.raises(ValueError, match="encryptions=11"):
        keys.key_for_write(TENANT, 11)
