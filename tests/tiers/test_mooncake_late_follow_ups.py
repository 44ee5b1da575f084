"""A poll or a retry started late in an operation is no fleet outage: MooncakeTier against a real
Mooncake Store.

A put that meets another writer's unfinished put polls the master until its deadline; a read
that a dead holder failed (-800) is retried. Started with the operation's deadline nearly spent,
such a call overran, and the tier took the overrun for a master that does not answer: the whole
tier went down (every read, put and lookup a miss for the backoff), though the master answered
every call in time. Found by the fresh-clone CI run (a put over a killed writer's reservation,
under the suite's load) and audit s31 a6 (D1, D4).

A real ``mooncake_master`` and holder processes on loopback (tests/tiers/mooncake_harness.py); the
dead writer is a real process of the tenant, SIGKILLed once its reservation was made; the dead
holder a real holder process, SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import both_transfer_paths, make_tier, mooncake_available, shared_cluster
from tests.tiers.test_mooncake_poisoning import REPO, WRITER

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


def block(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@contextmanager
def a_busy_process():
    """This process doing other work, as a loaded server does: a thread that never sleeps, and the
    interpreter's switch interval of a process under load (a waiting thread gets the GIL back only
    after milliseconds, so a call's answer comes late by as much)."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(before)


def reserved_by_a_killed_writer(cluster, secret: bytes, key: bytes, nbytes: int) -> None:
    """Another process of the tenant reserves ``key``'s name (a put session's start) and is killed
    before it writes: the master keeps the reservation for put_start_discard_timeout_sec (30 s)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, cluster.master_address, cluster.metadata_url,
                               secret.hex(), key.hex(), str(nbytes), str(REPO)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert writer.stdout.readline().strip() == "reserved [0]"
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()


def test_a_put_that_waits_out_another_writers_reservation_under_load_leaves_the_tier_up():
    """The put polls the unfinished name until its deadline, then answers ERROR for it (nothing is
    stored) and OK for its neighbour. Its last poll was made with what was left of the deadline --
    often nothing, under load -- and overran: the tier went down and the neighbour, stored fine,
    read ERROR. Several puts, each over a name of its own (a reservation outlives the put)."""
    cluster = shared_cluster()
    secret = os.urandom(32)
    timeout_s = 1.0  # (under this load the put's own calls, not follow-ups, take up to a few 100 ms)
    downed = []
    with a_busy_process():
        for trial in range(8):
            key, other, data = os.urandom(32), os.urandom(32), block(trial)
            reserved_by_a_killed_writer(cluster, secret, key, data.nbytes)
            tier = make_tier(cluster, tenant="tenant", secret=secret, timeout_s=timeout_s)
            try:
                started = time.monotonic()
                statuses = tier.put_many([key, other], [data, data])
                took = time.monotonic() - started
                up_after_put = tier.available
                out = np.zeros_like(data)
                read = tier.get(other, out)
                assert statuses == [Status.ERROR, Status.OK], statuses  # the premise, and the put's answer
                # bounded (tightly, without the load: test_mooncake_poisoning.py); a loaded process stalls
                assert took < 2 * timeout_s, f"a put took {took:.2f} s, with a {timeout_s} s deadline"
                if not up_after_put or read is not Status.OK:
                    downed.append(f"trial {trial}: tier up after the put {up_after_put}, a stored block read "
                                  f"{read.name} ({tier.last_error})")
                else:
                    assert np.array_equal(out, data)
            finally:
                tier.close()
    assert not downed, "a put that waited out another writer's reservation took the tier down:\n" + "\n".join(downed)


@pytest.fixture
def fleet_losing_a_holder():
    """A fleet of its own (one holder, then a second one started for the test to kill), with the
    engine's default client_ttl (10 s): the master keeps handing out the dead holder's replicas,
    whose reads answer -800 after ~1 s, for as long as the test runs."""
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    cluster = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield cluster
    cluster.stop()


def replica_endpoint(tier, key: bytes) -> str:
    name = tier.storage_name(key)
    replica = tier._engine.batch_get_replica_desc([name])[name][0]
    return replica.get_memory_descriptor().buffer_descriptor.transport_endpoint


def test_reading_a_dead_holders_block_leaves_blocks_on_live_holders_readable(fleet_losing_a_holder):
    """One replica (``replicas=1``): a block whose only holder died is a miss (an ERROR) until the
    master drops the holder. Its read was retried while the deadline had not passed, with what
    was left of it; the retry overran, the tier went down, and blocks on the live holder read
    ERROR -- again at each read of a dead holder's block, for the whole client_ttl."""
    cluster = fleet_losing_a_holder
    timeout_s = 1.5
    tier = make_tier(cluster, timeout_s=timeout_s, replicas=1)
    try:
        probes = [os.urandom(32) for _ in range(8)]
        assert tier.put_many(probes, [block(i) for i in range(8)]) == [Status.OK] * 8
        live = {replica_endpoint(tier, k) for k in probes}
        cluster.holders.append(None)
        cluster.start_holder(1)
        keys = [os.urandom(32) for _ in range(24)]
        datas = [block(100 + i) for i in range(24)]
        assert tier.put_many(keys, datas) == [Status.OK] * 24
        on_dead = [i for i, k in enumerate(keys) if replica_endpoint(tier, k) not in live]
        on_live = [i for i in range(24) if i not in on_dead]
        assert len(on_dead) >= 3 and len(on_live) >= 3, f"{len(on_dead)} blocks on the holder to kill"
        cluster.kill_holder(1)
        failed = []
        # Two reads of a dead holder's block: the first fails at once (its connection closes), the
        # second after ~1 s a call (refused, the engine retrying). Later ones wait longer (the
        # engine's backoff grows) and overrun their first call, whose deadline was whole: that, as
        # for a frozen holder, does take the tier down.
        for d, a in list(zip(on_dead, on_live))[:2]:
            out = np.zeros(BLOCK, np.uint8)
            started = time.monotonic()
            dead_read = tier.get(keys[d], out)
            took = time.monotonic() - started
            assert dead_read is not Status.OK  # the premise: its only copy is on the dead holder
            assert took < timeout_s + 0.5, f"a read took {took:.2f} s past a {timeout_s} s deadline"
            live_read = tier.get(keys[a], out)
            if live_read is not Status.OK or not np.array_equal(out, datas[a]):
                failed.append(f"after a read of a dead holder's block ({dead_read.name} in {took:.2f} s), a block "
                              f"on the live holder read {live_read.name} ({tier.last_error})")
        assert tier.available and not failed, "\n".join(failed)
    finally:
        tier.close()
