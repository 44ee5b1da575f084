"""DELETE does its disk work off the event loop, and none for keys the server does not hold.

Every key of a DELETE went through the store's delete on the event loop -- a disk tier's
system calls per key, held or not: a tenant pipelining DELETEs of 16 k absent keys stalled
another tenant's PING for hundreds of milliseconds.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import MAX_KEYS, Op
from tests.server.conftest import block, frame, keys_for, logged_in, read_frame
from tests.server.harness import SHARED, TOKENS, tenants
from tests.server.test_restart import SLOT, Restartable


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-delete")
    s = ServerProcess.start(tenants(), shared=SHARED, workdir=str(wd),
                            server={"capacity": "8MiB", "max_block": "256KiB", "disk_dir": str(wd / "disk"),
                                    "disk_capacity": "64MiB"})
    yield s
    s.stop()




def test_delete_answers_per_key_and_removes_held_blocks_from_every_tier(tmp_path):
    """Control: held blocks are still deleted from DRAM and disk (a restart, which rebuilds the
    index from disk, does not bring them back), and a deleted key can be stored again."""
    server = Restartable(tmp_path)
    srv = server.start()
    keys = keys_for("del", 4)
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="del", timeout_s=10)
    try:
        assert tier.put_many(keys[:3], [block(k, SLOT) for k in keys[:3]]) == [Status.OK] * 3
        time.sleep(0.5)  # the write-behind copies them to disk
        assert tier.delete_many([keys[0], keys[3], keys[1]]) == [True, False, True]
        assert tier.contains_many(keys) == [False, False, True, False]
        assert tier.put(keys[0], block(keys[0], SLOT)) is Status.OK
        assert tier.contains_many(keys) == [True, False, True, False]
    finally:
        tier.close()
    assert server.stop()[0] == 0
    srv = server.start()
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="del", timeout_s=10)
    try:
        assert tier.contains_many(keys) == [True, False, True, False]
    finally:
        tier.close()
        server.stop()


def _worst_ping_behind(srv, op: int, frames: int = 4) -> float:
    hog = logged_in(srv.tcp_url, TOKENS["acme"], "hog")
    victim = logged_in(srv.tcp_url, TOKENS["globex"], "victim")
    meta = os.urandom(32 * MAX_KEYS)  # keys the server never held
    hog.sendall(b"".join(frame(op, meta, req_id=i + 1) for i in range(frames)))
    worst = 0.0
    done = threading.Event()

    def drain_hog():
        for _ in range(frames):
            read_frame(hog)
        done.set()

    threading.Thread(target=drain_hog, daemon=True).start()
    i = 100
    while not done.is_set():
        i += 1
        t0 = time.monotonic()
        victim.sendall(frame(Op.PING, req_id=i))
        read_frame(victim)
        worst = max(worst, time.monotonic() - t0)
    hog.close()
    victim.close()
    return worst


def test_deletes_of_absent_keys_cost_no_more_than_as_many_lookups(srv):
    contains = _worst_ping_behind(srv, Op.CONTAINS)  # control: the same hashing and index look-ups
    delete = _worst_ping_behind(srv, Op.DELETE)
    assert delete < max(0.05, 3 * contains), (
        f"another tenant's PING waited {delete * 1000:.0f} ms behind DELETEs of absent keys, "
        f"{contains * 1000:.0f} ms behind as many CONTAINS")
