"""MooncakeTier with its master frozen (a hung process, or a partition that drops packets): every call
of the tier stays within its deadline, its staging buffers' (un)registrations included.

Registering a buffer with the engine, or unregistering it, updates the metadata server (the
master's HTTP server): with the master frozen, 6 s and 3 s each, outside any deadline. A get of
blocks that needed new staging paid that per block on the caller's thread (a get of 4 blocks against
a 1 s deadline took 24 s; the vLLM connector runs small loads in the forward step, trusting
``bounded_reads``), and a close paid 3 s per staging buffer the pool kept.

A cluster of its own (a master + one holder, the engine's default client_ttl so that a thawed master
keeps its holder), so that this process's client, and its staging pool, start empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.mooncake import MooncakeTier
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 * 1024
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster():
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def block(i: int) -> np.ndarray:
    return np.random.default_rng(9500 + i).integers(0, 256, BLOCK, dtype=np.uint8)


def test_a_get_that_needs_new_staging_with_the_master_frozen_returns_at_its_deadline(cluster, monkeypatch):
    monkeypatch.setattr(MooncakeTier, "_session_min_bytes", 1 << 40)  # batch calls: staging taken before the call
    t = make_tier(cluster, timeout_s=TIMEOUT_S, max_backoff_s=0.2)
    keys = [os.urandom(32) for _ in range(2)]
    try:
        assert t.put_many(keys, [block(i) for i in range(2)]) == [Status.OK] * 2  # (puts take no staging)
        assert not t._staging._free, "premise: the pool keeps no staging yet"
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            statuses = t.get_many(keys, [np.zeros(BLOCK, np.uint8) for _ in keys])
            took = time.monotonic() - start
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert Status.OK not in statuses, "premise: the frozen master answered"
        assert took < TIMEOUT_S + 0.5, f"a get with the master frozen took {took:.1f} s against {TIMEOUT_S} s"
        # and the staging handed out meanwhile (registered late, or not at all) reads right once it thaws
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        deadline = time.monotonic() + 20
        while t.get_many(keys, outs) != [Status.OK] * 2:
            assert time.monotonic() < deadline, f"never served again: {t.last_error}"
            time.sleep(0.2)
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
    finally:
        t.close()


def sealed(cluster, tmp_path, secret: bytes):
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"m" * 32), tmp_path / "keys")
    inner = make_tier(cluster, tenant="acme", secret=secret, timeout_s=TIMEOUT_S, max_backoff_s=0.2)
    return EncryptedTier(inner, keyring, "acme", chunk_bytes=64 * 1024)


def test_a_sealed_get_that_needs_a_new_buffer_with_the_master_frozen_returns_at_its_deadline(cluster, tmp_path):
    """An EncryptedTier registers its batch staging with the Mooncake tier (sealed blocks land where
    they are opened): a reader that never wrote (a fresh pool) registered its first buffer on the
    caller's thread, 6 s with the master frozen."""
    secret = os.urandom(32)
    writer, reader = sealed(cluster, tmp_path, secret), sealed(cluster, tmp_path, secret)
    keys = [os.urandom(32) for _ in range(2)]
    try:
        assert writer.put_many(keys, [block(i) for i in range(2)]) == [Status.OK] * 2
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            statuses = reader.get_many(keys, [np.zeros(BLOCK, np.uint8) for _ in keys])
            took = time.monotonic() - start
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert Status.OK not in statuses, "premise: the frozen master answered"
        assert took < TIMEOUT_S + 0.5, f"a sealed get with the master frozen took {took:.1f} s against {TIMEOUT_S} s"
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        deadline = time.monotonic() + 20
        while reader.get_many(keys, outs) != [Status.OK] * 2:
            assert time.monotonic() < deadline, f"never served again: {reader.inner.last_error}"
            time.sleep(0.2)
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
        assert reader.stats.verify_failures == 0
    finally:
        writer.close()
        reader.close()


_CLOSE_WITH_STAGING_KEPT = """
import os, signal, sys, time
import numpy as np
from kvtier.tiers.mooncake import MooncakeTier
master, metadata, pid, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = MooncakeTier(master, metadata, tenant="acme", secret=os.urandom(32), timeout_s=1.0)
keys = [os.urandom(32) for _ in range(n)]
assert {s.name for s in t.put_many(keys, [np.full(64 << 10, i, np.uint8) for i in range(n)])} == {"OK"}
assert {s.name for s in t.get_many(keys, [np.zeros(64 << 10, np.uint8) for _ in keys])} == {"OK"}
print("staging kept:", sum(len(v) for v in t._staging._free.values()), flush=True)
os.killpg(pid, signal.SIGSTOP)
try:
    start = time.monotonic()
    t.close()
    print(f"closed in {time.monotonic() - start:.2f} s", flush=True)
finally:
    os.killpg(pid, signal.SIGCONT)
"""


def test_closing_with_staging_kept_and_the_master_frozen_takes_at_most_its_timeout_and_exits_cleanly(cluster):
    """A server's shutdown during a fleet outage: the last tier's close unregistered every staging
    buffer the pool kept, 3 s each (the pool keeps up to 256 MiB: thousands of small buffers), and
    outlasted any grace period. A child process: the client is its own, and its exit is checked too
    (a registration thread still in the engine as the interpreter ends aborts the process)."""
    n = 4
    try:
        done = subprocess.run([sys.executable, "-c", _CLOSE_WITH_STAGING_KEPT, cluster.master_address,
                               cluster.metadata_url, str(cluster.master.pid), str(n)], capture_output=True,
                              text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    finally:
        os.killpg(cluster.master.pid, signal.SIGCONT)
    assert f"staging kept: {n}" in done.stdout, done.stdout + done.stderr[-3000:]  # premise
    took = [float(line.split()[2]) for line in done.stdout.splitlines() if line.startswith("closed in")]
    assert took, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert took[0] < 2 * 1.0 + 0.5, f"close with {n} staging buffers kept took {took[0]:.1f} s (timeout_s 1.0)"
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
