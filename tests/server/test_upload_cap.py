"""Uploads in flight are capped in pool bytes, not in uploads counted as blocks of ``max_block``.

The caps were half and an eighth of ``capacity ÷ max_block`` uploads. With 64 MiB and an 8 MiB
``max_block`` a tenant had one upload at a time: its second concurrent write of a 128 KiB block
was refused FULL (lost), 6-12 % of two workers' writes past capacity, while the pool had room
for hundreds of such blocks. The route bench's shared tier on an agent trace lost blocks so.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.core.payload import pack_header as pack_block_header
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import NO_PARENT, Op
from tests.server.conftest import block, connect, frame, hello_frame, keys_for, read_frame
from tests.server.harness import SHARED, TOKENS, tenants

SMALL = 128 << 10
BIG = 8 << 20


@pytest.fixture(scope="module")
def few_slots(tmp_path_factory):
    """8 blocks of the largest size: the old per-tenant cap was one upload."""
    srv = ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path_factory.mktemp("kvtier-cap")),
                              server={"capacity": "64MiB", "max_block": "8MiB", "frame_timeout_s": 15.0})
    yield srv
    srv.stop()


def test_concurrent_small_uploads_of_one_tenant_are_not_refused(few_slots):
    """Two writers of one tenant put 3x the pool in 128 KiB blocks, each reading back the block
    it put 20 before (LRU keeps it): every put is stored and every such block is there."""
    results: dict[int, list] = {}

    def writer(w: int) -> None:
        tier = RemoteTier(few_slots.tcp_url, TOKENS["acme"], namespace="cap", timeout_s=10)
        keys = keys_for(f"writer-{w}", 768)
        out = np.empty(SMALL, np.uint8)
        refused, missing = 0, 0
        for i, key in enumerate(keys):
            refused += tier.put(key, block(key, SMALL)) is not Status.OK
            if i >= 20:
                missing += tier.get(keys[i - 20], out) is not Status.OK
        results[w] = [refused, missing]
        tier.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: [0, 0], 1: [0, 0]}, results


def _slow_put(url: str, token: str, key: bytes, nbytes: int):
    """An upload that sends its header and no payload: it holds its reservation until cut off."""
    s = connect(url)
    s.sendall(hello_frame(token, "cap-slow"))
    read_frame(s)  # the HELLO's reply
    s.sendall(frame(Op.PUT, pack_block_header(key, nbytes, bytes(16)) + NO_PARENT, b"", req_id=2,
                    data_len=nbytes + 16))
    return s


def test_a_tenants_uploads_in_flight_are_still_capped(few_slots):
    """Control: the cap still holds. A tenant's stalled upload of 8 MiB reserves an eighth of the
    pool, so its next one is refused (FULL), while another tenant's upload is stored; once the
    stalled one is gone, the tenant's upload is stored again."""
    url = few_slots.tcp_url
    stalled = _slow_put(url, TOKENS["globex"], keys_for("slow-big", 1)[0], BIG)
    globex = RemoteTier(url, TOKENS["globex"], namespace="cap-next", timeout_s=10)
    other = RemoteTier(url, TOKENS["acme"], namespace="cap-other", timeout_s=10)
    try:
        # refused once the server has taken the stalled upload's reservation (a loaded machine
        # may take a while to read its header: each try is a new key, as a stored one is not put again)
        deadline = time.monotonic() + 10
        for attempt in range(1000):
            key = keys_for(f"next-big-{attempt}", 1)[0]
            status = globex.put(key, block(key, BIG))
            if status is Status.FULL or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status is Status.FULL, status
        small = keys_for("other-tenant", 1)[0]
        assert other.put(small, block(small, SMALL)) is Status.OK
        stalled.close()
        deadline = time.monotonic() + 5
        while globex.put(key, block(key, BIG)) is not Status.OK:
            assert time.monotonic() < deadline, "the stalled upload's reservation was never returned"
            time.sleep(0.1)
    finally:
        stalled.close()
        globex.close()
        other.close()


@pytest.fixture(scope="module")
def publisher(tmp_path_factory):
    """ops publishes into three shared namespaces besides its own: four owners to write for."""
    shared = [{"name": n, "writers": ["ops"]} for n in ("a", "b", "c", "system-prompts")]
    srv = ServerProcess.start(tenants(), shared=shared, workdir=str(tmp_path_factory.mktemp("kvtier-cap-writer")),
                              server={"capacity": "8MiB", "max_block": "1MiB", "frame_timeout_s": 20.0})
    yield srv
    srv.stop()


def test_the_per_tenant_cap_counts_the_writer_not_the_owner_of_the_namespace(publisher):
    """The cap was kept per owner of the space written: a tenant stalling an upload of an eighth of
    the pool in its own namespace and in three shared ones held the whole global cap (half the
    pool), and every other tenant's PUT was refused FULL. Now its second stalled upload is
    refused, and another tenant is served."""
    url = publisher.tcp_url
    first = _slow_put(url, TOKENS["ops"], keys_for("stall-own", 1)[0], 1 << 20)  # capacity // 8
    ops = RemoteTier(url, TOKENS["ops"], namespace="shared/a", timeout_s=10)
    globex = RemoteTier(url, TOKENS["globex"], namespace="mine", timeout_s=10)
    try:
        deadline = time.monotonic() + 10
        for attempt in range(1000):  # refused once the server has taken the stalled reservation
            key = keys_for(f"stall-shared-{attempt}", 1)[0]
            status = ops.put(key, block(key, 1 << 20))
            if status is Status.FULL or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status is Status.FULL, status
        small = keys_for("globex-small", 1)[0]
        assert globex.put(small, block(small, SMALL)) is Status.OK  # control: another tenant is served
    finally:
        first.close()
        ops.close()
        globex.close()
