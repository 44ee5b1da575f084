"""A key another fleet client made unstorable: MooncakeTier against a real Mooncake Store.

Any process on the fleet can reserve, overwrite or resize an object whose name it knows (Mooncake
authenticates nobody), and the engine's put keeps whatever object a name already has. So:

* a put whose name another writer reserved and never published (killed mid-put) must not
  answer OK while nothing is stored (the engine's batch put answers 0, its put session -705,
  as for a stored object);
* an object of another size under a block's name (a resized forgery) is dropped when a read
  finds it (a miss, so a store asks its next tier) and replaced by a put, plain or sealed;
  a genuine block asked with a buffer of the wrong size stays a caller's mistake
  (``BAD_SIZE``), kept.

A real ``mooncake_master`` and holder processes on loopback (tests/tiers/mooncake_harness.py);
the dead writer is a real process of the tenant, SIGKILLed once its reservation was made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import both_transfer_paths, make_tier, mooncake_available, shared_cluster

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 256 * 1024
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def bare():
    """A plain Mooncake client, as any other process on the fleet could run."""
    from kvtier.tiers.mooncake_client import SharedClient

    cluster = shared_cluster()
    client = SharedClient.acquire(cluster.master_address, cluster.metadata_url, "127.0.0.1")
    yield client.store
    client.release()


def _resize(engine, name: str, how: str) -> None:
    """Replace the object under ``name`` by random bytes of another size."""
    size = engine.get_size(name)
    assert size == HEADER_NBYTES + BLOCK
    fake = block(2, size // 2 if how == "shorter" else size + 4096)
    assert engine.remove(name, True) == 0 and engine.put_from(name, fake.ctypes.data, fake.nbytes) == 0


# -- D4: a dead writer's unpublished reservation -----------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[6])
    from kvtier.core.payload import HEADER_NBYTES
    from kvtier.tiers.mooncake import MooncakeTier
    master, metadata, secret, key, nbytes = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4]), int(sys.argv[5])
    t = MooncakeTier(master, metadata, tenant="tenant", secret=secret)
    # the first step of a put session (kvtier.tiers.mooncake_writes._PutSession.run) ...
    codes = t._engine.batch_put_session_start([t.storage_name(key)], [nbytes + HEADER_NBYTES], t._config)
    print("reserved", codes, flush=True)
    time.sleep(60)  # ... and the writer is killed before it writes
""")


def test_a_put_over_a_killed_writers_reservation_is_an_error_not_ok_while_nothing_is_stored():
    """The master drops a dead writer's reservation only after put_start_discard_timeout_sec (30 s
    by default); until then the tenant's other processes' puts of the key must say ERROR (a server
    spilling to the fleet takes OK for stored and indexes the block there: lost). The put waits
    for the other writer until its own deadline (a live one publishes; the threads of
    test_contract.py's eviction race put the same blocks at once: OK), then says so."""
    cluster = shared_cluster()
    secret, key, other = os.urandom(32), os.urandom(32), os.urandom(32)
    data = block(7, 64 << 10)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, cluster.master_address, cluster.metadata_url,
                               secret.hex(), key.hex(), str(data.nbytes), str(REPO)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert writer.stdout.readline().strip() == "reserved [0]"
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
    tier = make_tier(cluster, tenant="tenant", secret=secret, timeout_s=1.0)
    try:
        started = time.monotonic()
        statuses = tier.put_many([key, other], [data, data])
        assert time.monotonic() - started < 1.0 + 0.5  # bounded by the put's deadline
        out = np.zeros_like(data)
        got = tier.get(key, out)
        assert got is not Status.OK and not tier.contains(key)  # nothing stored: the premise
        assert statuses[0] is Status.ERROR, f"put answered {statuses[0].name}, yet nothing is stored ({got.name})"
        # control: its neighbour in the batch, whose name nobody reserved, is stored and reads back
        assert statuses[1] is Status.OK
        assert tier.get(other, out) is Status.OK and np.array_equal(out, data)
        assert tier.put(other, data) is Status.OK  # and a put of a stored block is still OK
    finally:
        tier.close()


# -- D5: an object of another size under a block's name --------------------------------------------
@pytest.mark.parametrize("into", ["staging", "registered memory"])
@pytest.mark.parametrize("resize", ["shorter", "longer"])
def test_a_resized_forgery_is_a_dropped_miss_and_a_put_heals_the_key(bare, resize, into):
    """Shorter: the batch call answers -800 (a holder failure to the engine), the ranged read of a
    session a short count; longer: -600, or (ranged) a header of another size. Each was kept, and
    the engine's put then kept it too: every read failed, every put said OK, for good."""
    tier = make_tier()
    region = np.zeros(BLOCK, np.uint8)
    if into == "registered memory":
        tier.register_memory(region)
    try:
        key, data = os.urandom(32), block(1)
        assert tier.put(key, data) is Status.OK
        name = tier.storage_name(key)
        _resize(bare, name, resize)
        out = region if into == "registered memory" else np.zeros(BLOCK, np.uint8)
        assert tier.get(key, out) is Status.CORRUPT  # a miss: a store asks its next tier
        assert bare.is_exist(name) != 1, f"a {resize} forgery under the block's name was kept"
        assert tier.stats.verify_failures == 1
        assert tier.put(key, data) is Status.OK
        assert tier.get(key, out) is Status.OK and np.array_equal(out, data), "the key stays poisoned"
    finally:
        tier.close()


@pytest.mark.parametrize("resize", ["shorter", "longer"])
def test_a_put_over_a_resized_forgery_replaces_it(bare, resize):
    """No read found it first: the put is told the name exists (batch: 0; session: -705), at
    another size than the block's: it removes the object and writes the block."""
    tier = make_tier()
    try:
        keys = [os.urandom(32) for _ in range(2)]
        datas = [block(3), block(4)]
        assert tier.put_many(keys, datas) == [Status.OK] * 2
        _resize(bare, tier.storage_name(keys[0]), resize)
        assert tier.put_many(keys, datas) == [Status.OK] * 2
        assert bare.get_size(tier.storage_name(keys[0])) == HEADER_NBYTES + BLOCK
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert tier.get_many(keys, outs) == [Status.OK] * 2
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas))
    finally:
        tier.close()


@pytest.mark.parametrize("asked", ["smaller", "larger"])
def test_a_genuine_block_asked_with_a_buffer_of_another_size_is_bad_size_and_kept(bare, asked):
    """The control: the object is this block, whole and tagged, and only the caller's buffer is
    wrong: its mistake (BAD_SIZE), and the block stays for callers that ask right."""
    tier = make_tier()
    try:
        key, data = os.urandom(32), block(5)
        assert tier.put(key, data) is Status.OK
        wrong = np.zeros(BLOCK // 2 if asked == "smaller" else BLOCK + 4096, np.uint8)
        assert tier.get(key, wrong) is Status.BAD_SIZE
        assert bare.is_exist(tier.storage_name(key)) == 1
        out = np.zeros(BLOCK, np.uint8)
        assert tier.get(key, out) is Status.OK and np.array_equal(out, data)
        assert tier.stats.verify_failures == 0
    finally:
        tier.close()


@pytest.mark.parametrize("resize", ["shorter", "longer"])
def test_a_resized_forgery_under_a_sealed_block_is_dropped_and_a_put_heals_it(tmp_path, bare, resize):
    """Sealed (EncryptedTier over the fleet): the shorter object read in a batch call was an ERROR
    (-800, a holder failure), not BAD_SIZE, so the EncryptedTier's resize check never ran, and its
    put found the name present and answered OK: poisoned."""
    from tests.tiers.test_encrypted_mooncake import sealed_tier

    enc = sealed_tier(tmp_path)
    try:
        key, data = os.urandom(32), block(6)
        assert enc.put(key, data) is Status.OK
        name = enc.inner.storage_name(enc.storage_name(key))
        size = bare.get_size(name)
        fake = block(8, size // 2 if resize == "shorter" else size + 4096)
        assert bare.remove(name, True) == 0 and bare.put_from(name, fake.ctypes.data, fake.nbytes) == 0
        out = np.zeros(BLOCK, np.uint8)
        first = enc.get(key, out)
        assert first is not Status.OK and bare.is_exist(name) != 1, f"kept ({first.name})"
        assert enc.put(key, data) is Status.OK
        again = enc.get(key, out)
        assert again is Status.OK and np.array_equal(out, data), (
            f"the sealed key stays poisoned (first read {first.name}, after a put {again.name})")
    finally:
        enc.close()
