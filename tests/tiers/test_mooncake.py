"""MooncakeTier against a real Mooncake Store: isolation, integrity, faults.

The contract suite (test_contract.py) runs on the session's shared cluster; the fault tests here
kill and freeze processes, so they get a cluster of their own (a master + two holders).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES, pack_header, unpack_header
from kvtier.tiers.base import Status
from kvtier.tiers.mooncake_launch import _wait_stopped
from tests.tiers.mooncake_harness import (both_transfer_paths, CLIENT_TTL_S, fresh_secret, make_tier, mooncake_available,
                                          shared_cluster, start_cluster)

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    """Every test on both of the tier's transfer paths (small blocks in batch calls, large ones in
    put/get sessions)."""
    return both_transfer_paths(request, monkeypatch)

BLOCK = 256 * 1024


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(i: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def tier():
    t = make_tier(tenant="acme")
    yield t
    t.close()


# -- isolation -------------------------------------------------------------------------------------
def test_another_tenant_misses_where_the_same_tenant_hits():
    secret = b"s" * 32
    writer = make_tier(tenant="acme", secret=secret)
    same = make_tier(tenant="acme", secret=secret)  # another process of acme, as far as names go
    other_tenant = make_tier(tenant="globex", secret=secret)  # same secret, other tenant: other names
    other_secret = make_tier(tenant="acme", secret=b"x" * 32)  # claims acme without its secret
    try:
        assert writer.put(key(1), block(1)) is Status.OK
        out = np.zeros(BLOCK, np.uint8)
        assert same.get(key(1), out) is Status.OK and np.array_equal(out, block(1))  # the control
        assert same.lookup_prefix([key(1)]) == 1
        for t in (other_tenant, other_secret):
            assert t.get(key(1), out) is Status.MISS
            assert not t.contains(key(1)) and t.lookup_prefix([key(1)]) == 0
            assert t.delete(key(1)) is False  # cannot remove what it cannot name
        assert same.get(key(1), out) is Status.OK
    finally:
        for t in (writer, same, other_tenant, other_secret):
            t.close()


def test_names_are_keyed_and_unlinkable_to_block_keys(tier):
    name = tier.storage_name(key(1))
    assert key(1).hex() not in name and name.startswith("kvtier/")
    assert make_tier(tenant="acme").storage_name(key(1)) != name  # another secret, another name


def test_sealed_blocks_of_another_tenant_miss(tmp_path):
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys")
    secret = b"s" * 32
    a = EncryptedTier(make_tier(tenant="a", secret=secret), keyring, "a")
    a2 = EncryptedTier(make_tier(tenant="a", secret=secret), keyring, "a")
    b = EncryptedTier(make_tier(tenant="b", secret=secret), keyring, "b")
    try:
        assert a.put(key(2), block(2)) is Status.OK
        out = np.zeros(BLOCK, np.uint8)
        assert a2.get(key(2), out) is Status.OK and np.array_equal(out, block(2))
        assert b.get(key(2), out) is Status.MISS and not b.contains(key(2))
    finally:
        for t in (a, a2, b):
            t.close()


# -- integrity ---------------------------------------------------------------------------------------
def _bare_client():
    """A plain Mooncake client, as any other process on the fleet could run."""
    from kvtier.tiers.mooncake_client import SharedClient

    c = shared_cluster()
    return SharedClient.acquire(c.master_address, c.metadata_url, "127.0.0.1")


@pytest.mark.parametrize("forgery", ["garbage", "plain-checksum", "moved", "same-xxh3", "other-write", "resalted"])
def test_a_tampered_object_is_a_miss_and_is_dropped(tier, forgery):
    """Overwritten through a bare client (upsert): random bytes, a well-formed header with a
    correct unkeyed xxh3 checksum over other bytes, another block's genuine object moved here, or
    the genuine header over another payload with the same XXH3-128 (which a tag over xxh3-128
    accepted: the payload hash inside the keyed tag must be collision resistant)."""
    import xxhash

    from tests.tiers.xxh3_forgery import same_xxh3_128

    assert tier.put(key(3), block(3)) is Status.OK
    name = tier.storage_name(key(3))
    bare = _bare_client()
    try:
        engine = bare.store
        size = engine.get_size(name)
        assert size == HEADER_NBYTES + BLOCK
        if forgery == "garbage":
            fake = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
        elif forgery == "plain-checksum":
            digest = bytes.fromhex(name[len("kvtier/"):])
            other = block(99)
            fake = np.concatenate([np.frombuffer(pack_header(digest, BLOCK, xxhash.xxh3_128_digest(other)), np.uint8),
                                   other])
        elif forgery == "same-xxh3":
            genuine = np.zeros(size, np.uint8)
            assert engine.get_into(name, genuine.ctypes.data, size) == size
            payload = genuine[HEADER_NBYTES:].tobytes()
            forged = same_xxh3_128(payload)
            assert forged != payload and xxhash.xxh3_128_digest(forged) == xxhash.xxh3_128_digest(payload)
            fake = np.concatenate([genuine[:HEADER_NBYTES], np.frombuffer(forged, np.uint8)])
        elif forgery in ("other-write", "resalted"):
            # the same block written again with other bytes (a recompute an ulp off): each write
            # has its own salt, hence its own MAC key; one write's header must not pass the other's
            # payload, nor a header rebuilt (its check is unkeyed) to carry the other write's salt
            first = np.zeros(size, np.uint8)
            assert engine.get_into(name, first.ctypes.data, size) == size
            assert engine.remove(name, True) == 0
            assert tier.put(key(3), block(33)) is Status.OK
            second = np.zeros(size, np.uint8)
            assert engine.get_into(name, second.ctypes.data, size) == size
            h1, h2 = unpack_header(first[:HEADER_NBYTES]), unpack_header(second[:HEADER_NBYTES])
            assert h1.key[:16] == h2.key[:16] and h1.key[16:] != h2.key[16:]   # one name, two salts
            if forgery == "other-write":
                fake = np.concatenate([first[:HEADER_NBYTES], second[HEADER_NBYTES:]])
            else:
                fake = np.concatenate([np.frombuffer(pack_header(h1.key, BLOCK, h2.checksum, flags=h2.flags), np.uint8),
                                       second[HEADER_NBYTES:]])
            # positive control: the first write, whole, is a genuine object of this block and verifies
            assert engine.upsert_from(name, first.ctypes.data, size) == 0
            control = np.zeros(BLOCK, np.uint8)
            assert tier.get(key(3), control) is Status.OK and np.array_equal(control, block(3))
        else:
            assert tier.put(key(4), block(4)) is Status.OK
            fake = np.zeros(size, np.uint8)
            assert engine.get_into(tier.storage_name(key(4)), fake.ctypes.data, size) == size
        assert engine.upsert_from(name, fake.ctypes.data, size) == 0
        out = np.zeros(BLOCK, np.uint8)
        failures = tier.stats.verify_failures
        assert tier.get(key(3), out) is Status.CORRUPT
        assert tier.stats.verify_failures == failures + 1
        assert engine.is_exist(name) == 0, "a block that can never verify was kept"
        assert tier.get(key(3), out) is Status.MISS
        assert tier.put(key(3), block(3)) is Status.OK  # and a fresh put heals it
        assert tier.get(key(3), out) is Status.OK and np.array_equal(out, block(3))
    finally:
        bare.release()


@pytest.mark.parametrize("leased_by", ["a read", "a lookup"])
def test_a_delete_under_a_lease_leaves_no_copy_another_process_of_the_tenant_reads(leased_by):
    """Every process of a tenant shares its secret: what one deletes, none may read whole, not even
    one started later (what a tier only hid in its own memory was served again after a restart).
    A read and a lookup both make the engine grant a lease that refuses a plain remove (-706)."""
    secret = fresh_secret()
    mine, theirs = make_tier(tenant="acme", secret=secret), make_tier(tenant="acme", secret=secret)
    out = np.zeros(BLOCK, np.uint8)
    try:
        assert mine.put(key(5), block(5)) is Status.OK
        assert theirs.get(key(5), out) is Status.OK and np.array_equal(out, block(5))  # control: shared
        assert (mine.get(key(5), out) is Status.OK) if leased_by == "a read" else mine.contains(key(5))
        assert mine.delete(key(5)) is True
        out[:] = 0xA5
        assert mine.get(key(5), out) is Status.MISS and not mine.contains(key(5))
        assert theirs.get(key(5), out) is Status.MISS and not theirs.contains(key(5)), \
            "an acknowledged delete left a copy the tenant's other processes read"
        assert mine.put(key(5), block(5)) is Status.OK  # a put brings it back, for everyone
        assert theirs.get(key(5), out) is Status.OK and np.array_equal(out, block(5))
    finally:
        mine.close()
        theirs.close()


def test_a_master_nothing_listens_at_is_refused_within_the_deadline():
    """The engine's own setup retries such a master for ~90 s holding the GIL (so no thread can time
    it out); a child process, since the old behaviour cannot be interrupted."""
    child = ("from kvtier.tiers.mooncake import MooncakeTier\n"
             "try:\n    MooncakeTier('127.0.0.1:1', tenant='acme', secret=b's' * 32, timeout_s=1.0)\n"
             "except ConnectionError as exc:\n    print('refused:', exc)\n")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30,
                              cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        pytest.fail(f"MooncakeTier() against a master that is down had not returned after {time.monotonic() - start:.0f} s")
    assert "refused:" in done.stdout and "127.0.0.1:1" in done.stdout, done.stdout + done.stderr[-2000:]
    assert time.monotonic() - start < 20


# -- faults ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(holders=2, segment_bytes=96 << 20)
    yield c
    c.stop()


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_a_frozen_holder_costs_at_most_the_deadline_and_then_recovers(cluster):
    t = make_tier(cluster, timeout_s=1.0, replicas=1)
    try:
        keys = [key(100 + i) for i in range(8)]
        assert t.put_many(keys, [block(100 + i) for i in range(8)]) == [Status.OK] * 8
        cluster.signal_holder(0, signal.SIGSTOP)
        try:
            outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
            start = time.monotonic()
            statuses = t.get_many(keys, outs)
            took = time.monotonic() - start
            assert took < 1.0 + 0.5, f"a read took {took:.1f} s past a 1 s deadline"
            for i, s in enumerate(statuses):  # what came back is whole
                assert s in (Status.OK, Status.ERROR, Status.MISS)
                assert s is not Status.OK or np.array_equal(outs[i], block(100 + i))
            assert Status.ERROR in statuses, "no block was on the frozen holder: the test froze nothing"
            start = time.monotonic()
            assert t.lookup_prefix(keys) == 0  # backing off: at once, promising nothing
            assert time.monotonic() - start < 0.5
        finally:
            cluster.signal_holder(0, signal.SIGCONT)
        # back: the overrun call ends, its staging returns to the pool, reads verify again
        assert _wait(lambda: t.get_many(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]) == [Status.OK] * 8, 20)
    finally:
        t.close()


def test_killing_a_holder_mid_traffic_never_returns_a_wrong_block_and_replicas_keep_every_block(cluster):
    t = make_tier(cluster, timeout_s=2.0, replicas=2)
    n = 24
    keys = [key(200 + i) for i in range(n)]
    try:
        assert t.put_many(keys, [block(200 + i) for i in range(n)]) == [Status.OK] * n
        wrong: list[int] = []
        hits = [0]
        seen: dict = {}   # statuses, for the failure message
        stop = threading.Event()

        def reader() -> None:
            out = np.zeros(BLOCK, np.uint8)
            j = 0
            while not stop.is_set():
                i = j % n
                out.fill(0xA5)
                s = t.get(keys[i], out)
                seen[s] = seen.get(s, 0) + 1
                if s is Status.OK:
                    hits[0] += 1
                    if not np.array_equal(out, block(200 + i)):
                        wrong.append(i)
                j += 1

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        cluster.kill_holder(1)
        killed_at = time.monotonic()
        time.sleep(1.0)
        stop.set()
        for th in threads:
            th.join(30)
        assert not wrong, f"wrong bytes for blocks {wrong}"
        assert hits[0] > 0, f"no read hit in 1.5 s; statuses {seen}, tier stats {t.stats}"
        # every block still hits from the surviving replica once the master has dropped the dead
        # holder (its client_ttl); until then a read whose replica was the dead one may miss
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert _wait(lambda: t.get_many(keys, outs) == [Status.OK] * n, CLIENT_TTL_S + 10), \
            "a block was lost with one of two replicas"
        print(f"every block hit again {time.monotonic() - killed_at:.1f} s after the kill")
        assert all(np.array_equal(o, block(200 + i)) for i, o in enumerate(outs))
        # and the tier keeps serving: new blocks go to the survivor once the master has dropped
        # the dead holder (reads of old blocks come back sooner, through the replica fallback;
        # a put the master still places on the dead holder fails, and is a lost store, not data)
        assert _wait(lambda: t.put(key(299), block(299)) is Status.OK, CLIENT_TTL_S + 10), \
            "no put succeeded on the surviving holder"
        assert t.get(key(299), outs[0]) is Status.OK and np.array_equal(outs[0], block(299))
    finally:
        t.close()
        cluster.start_holder(1)


def test_a_delete_the_fleet_could_not_be_asked_is_hidden_at_once_and_done_once_it_answers(cluster):
    secret = fresh_secret()
    mine = make_tier(cluster, tenant="acme", secret=secret, timeout_s=0.5, backoff_s=2.0, max_backoff_s=2.0)
    theirs = make_tier(cluster, tenant="acme", secret=secret)
    out = np.zeros(BLOCK, np.uint8)
    try:
        assert mine.put(key(310), block(310)) is Status.OK and mine.put(key(311), block(311)) is Status.OK
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        # (SIGSTOP acts as each thread is next scheduled: on a loaded box the lookup was served first)
        _wait_stopped(cluster.master.pid, 5.0)
        try:
            assert mine.contains(key(311)) is False  # the master does not answer: the tier backs off 2 s
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert mine.delete(key(310)) is False  # backing off: the fleet is not asked
        assert _wait(lambda: mine.healthy(), 10)
        assert mine.get(key(310), out) is Status.MISS and not mine.contains(key(310))  # hidden at once
        assert theirs.get(key(310), out) is Status.OK  # control: the fleet still holds it
        time.sleep(1.1)  # removals owed are retried at most once a second, on the next delete or put
        assert mine.delete(key(311)) is True
        assert theirs.get(key(310), out) is Status.MISS, "a delete the fleet could not be asked was never done"
    finally:
        mine.close()
        theirs.close()


@pytest.fixture(scope="module")
def outage_cluster():
    """For freezing the master longer than ``CLIENT_TTL_S``: with the engine's default client_ttl
    (10 s), so that the master, woken, does not drop the holders' segments (their heartbeats
    queued behind the freeze) and the blocks on them."""
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def test_a_long_outage_costs_one_deadline_not_one_per_backoff(outage_cluster):
    """Once its backoff was over, the tier's next call found out whether the master answered: during
    a long freeze every backoff cost one caller the whole deadline (a host eviction demoting to the
    fleet holds the DRAM tier's lock meanwhile). A health check on its own thread decides now."""
    t = make_tier(outage_cluster, timeout_s=1.0, backoff_s=0.2, max_backoff_s=0.4)
    out = np.zeros(BLOCK, np.uint8)
    try:
        assert t.put(key(320), block(320)) is Status.OK
        os.killpg(outage_cluster.master.pid, signal.SIGSTOP)
        _wait_stopped(outage_cluster.master.pid, 5.0)  # (SIGSTOP acts as each thread is next scheduled)
        try:
            start = time.monotonic()
            assert t.contains(key(320)) is False  # the call that finds the outage: one deadline
            assert time.monotonic() - start < 1.5
            slowest, calls = 0.0, 0
            until = time.monotonic() + 3.0  # several backoffs
            while time.monotonic() < until:
                start = time.monotonic()
                assert t.get(key(320), out) is Status.ERROR
                slowest, calls = max(slowest, time.monotonic() - start), calls + 1
                time.sleep(0.05)
        finally:
            os.killpg(outage_cluster.master.pid, signal.SIGCONT)
        assert calls > 15 and slowest < 0.3, f"a call during the outage took {slowest:.2f} s"
        assert not t.available
        assert _wait(lambda: t.get(key(320), out) is Status.OK, 15), t.last_error  # and it comes back
        assert np.array_equal(out, block(320)) and t.available
    finally:
        t.close()


_CLOSE_UNDER_A_LATE_CALL = """
import os, signal, sys
import numpy as np
from kvtier.tiers.mooncake import MooncakeTier
master, metadata, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = MooncakeTier(master, metadata, tenant="acme", secret=os.urandom(32), timeout_s=0.5)
key = bytes(32)
assert t.put(key, np.ones(1 << 18, np.uint8)).name == "OK"
os.killpg(pid, signal.SIGSTOP)
try:
    print("while frozen:", t.get(key, np.zeros(1 << 18, np.uint8)).name, flush=True)
    t.close()  # the read is still in the engine
    print("closed", flush=True)
finally:
    os.killpg(pid, signal.SIGCONT)
"""


def test_closing_a_tier_while_an_engine_call_still_runs_does_not_crash_the_process(outage_cluster):
    """A frozen master keeps an overrun call in the engine; closing the client under it was a
    segmentation fault (a server's shutdown during a fleet outage). A child process: the old
    behaviour kills whatever runs it."""
    try:
        done = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_A_LATE_CALL, outage_cluster.master_address,
                               outage_cluster.metadata_url, str(outage_cluster.master.pid)], capture_output=True, text=True,
                              timeout=60, cwd=str(Path(__file__).resolve().parents[2]))
    finally:
        os.killpg(outage_cluster.master.pid, signal.SIGCONT)
    assert "while frozen: ERROR" in done.stdout, done.stdout + done.stderr[-3000:]  # control: it overran
    assert done.returncode == 0 and "closed" in done.stdout, f"exit {done.returncode}: {done.stderr[-3000:]}"


def test_killing_the_master_gives_misses_within_the_deadline_and_recovery_after_restart(cluster):
    t = make_tier(cluster, timeout_s=1.0, max_backoff_s=0.5)
    try:
        assert t.put(key(300), block(300)) is Status.OK
        cluster.kill_master()
        out = np.zeros(BLOCK, np.uint8)
        for op in (lambda: t.get(key(300), out), lambda: t.contains(key(300)), lambda: t.put(key(301), block(301)),
                   lambda: t.lookup_prefix([key(300)]), lambda: t.delete(key(300))):
            start = time.monotonic()
            result = op()
            took = time.monotonic() - start
            assert result in (Status.ERROR, False, 0), result
            assert took < 1.0 + 0.5, f"a call took {took:.1f} s past a 1 s deadline"
        cluster.start_master()
        # Its index starts empty (no snapshot/HA configured): what was stored before is gone, a
        # miss; holders and clients reconnect, and blocks stored from now on hit.
        assert _wait(lambda: t.put(key(302), block(302)) is Status.OK, 30), t.last_error
        assert t.get(key(302), out) is Status.OK and np.array_equal(out, block(302))
        assert t.get(key(300), out) in (Status.MISS, Status.OK)
    finally:
        t.close()


# -- configuration: an embedded store host → Mooncake, as engines build it -------------------------
def test_two_stores_configured_alike_share_blocks_through_the_fleet(tmp_path, small_layout):
    """Engine A's store writes through to Mooncake; engine B's (own host tier, same tenant and
    secret file) loads the same blocks from the fleet; a store of another tenant misses."""
    from kvtier.store.config import StoreConfig, build_store

    c = shared_cluster()
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(b"t" * 32)
    secret.chmod(0o600)   # the rule for a fleet secret (store.config refuses one others can read)
    cfg = StoreConfig(host_bytes="1MiB", tenant="acme", mooncake_master=c.master_address,
                      mooncake_metadata=c.metadata_url, mooncake_secret_file=str(secret), write_mode="write-through")
    nbytes = small_layout.block_nbytes
    keys = [key(400 + i) for i in range(4)]
    a, b, other = (build_store(cfg, small_layout), build_store(cfg, small_layout),
                   build_store(cfg.replace(tenant="globex"), small_layout))
    try:
        a.put(keys, [block(400 + i, nbytes) for i in range(4)])
        assert b.lookup(keys).hit_blocks == 4 and b.lookup(keys).tiers == ["mooncake"] * 4
        outs = [np.zeros(nbytes, np.uint8) for _ in keys]
        got = b.get(keys, outs)
        assert got.loaded == 4 and all(np.array_equal(o, block(400 + i, nbytes)) for i, o in enumerate(outs))
        assert other.lookup(keys).hit_blocks == 0
    finally:
        for s in (a, b, other):
            s.close()


def test_a_mooncake_tier_without_a_secret_is_a_config_error(small_layout, monkeypatch):
    from kvtier.errors import ConfigError
    from kvtier.store.config import StoreConfig, build_store

    monkeypatch.delenv("KVTIER_MASTER_KEY", raising=False)
    with pytest.raises(ConfigError, match="mooncake_secret_file"):
        build_store(StoreConfig(host_bytes=0, mooncake_master="127.0.0.1:1"), small_layout)


def test_a_timeout_past_a_day_is_refused_and_no_call_waits_past_one(tmp_path):
    """``mooncake_timeout_s = 1e10`` ("never give up") passed validation, then the tier's start
    raised a bare OverflowError (Python's waits refuse more than threading.TIMEOUT_MAX, ~9.2e9 s);
    had it started, every call's wait would have raised and the tier stayed down for good."""
    from kvtier.errors import ConfigError
    from kvtier.store.config import StoreConfig
    from kvtier.tiers.mooncake import MooncakeTier

    c = shared_cluster()
    with pytest.raises(ConfigError, match="mooncake_timeout_s"):
        StoreConfig(host_bytes=0, mooncake_master=c.master_address, mooncake_metadata=c.metadata_url,
                    mooncake_timeout_s=1e10)
    with pytest.raises(ValueError, match="timeout_s"):  # a Python caller: before anything is connected
        MooncakeTier(c.master_address, c.metadata_url, tenant="t", secret=fresh_secret(), timeout_s=1e10)
    # the deadline of a large call (bytes / min_rate_bytes_s) is capped at a day: a tiny rate works
    t = make_tier(c, min_rate_bytes_s=1e-300)
    try:
        assert t.put(key(500), block(500)) is Status.OK
        out = np.zeros(BLOCK, np.uint8)
        assert t.get(key(500), out) is Status.OK and np.array_equal(out, block(500))
        assert t.contains(key(500)) and t.delete(key(500))
    finally:
        t.close()


def test_a_tier_used_during_or_after_close_misses_and_never_raises():
    """A call that passed the closed check as close() shut the call pool down got RuntimeError
    from it (not a miss); after close, remove_unverifiable raised the same, and register_memory
    called into an engine close() may have closed."""
    from kvtier.tiers.mooncake_client import SharedClient

    c = shared_cluster()
    keep = SharedClient.acquire(c.master_address, c.metadata_url, "127.0.0.1")  # keeps the engine open
    t = make_tier(c)
    try:
        assert t.put(key(600), block(600)) is Status.OK
        t._caller.close()  # the moment close() shuts the pool down under a call already past its check
        out = np.zeros(BLOCK, np.uint8)
        assert t.get(key(600), out) is Status.ERROR and t.put(key(601), block(601)) is Status.ERROR
        assert t.contains_many([key(600)]) == [False] and t.delete_many([key(600)]) == [False]
        t.remove_unverifiable(key(600))
        t.close()
        t.remove_unverifiable(key(600))  # after close: nothing to do, nothing raised
        with pytest.raises(RuntimeError, match="closed"):
            t.register_memory(np.zeros(BLOCK, np.uint8))
        t.unregister_memory(out)
        assert t.get(key(600), out) is not Status.OK and t.put(key(600), block(600)) is not Status.OK
    finally:
        t.close()
        keep.release()
