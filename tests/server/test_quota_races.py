"""Quota evictions happen when a block is committed, against what is committed then.

They happened when an upload *started*, against committed blocks only:

* an upload that then failed (bad checksum, torn connection) stored nothing, yet had evicted the
  tenant's least recently used blocks;
* concurrent uploads each counted on the room the first one's victim made: 6 uploads at once took
  a tenant with a 4-block quota to 9 blocks.
"""

from __future__ import annotations

import time

import pytest
import xxhash

from kvtier.core.payload import FLAG_CHECKSUM
from kvtier.core.payload import pack_header as pack_block_header
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import NO_PARENT, Op
from tests.server.conftest import block, frame, keys_for, logged_in, read_frame
from tests.server.harness import SHARED, TOKENS, tenants

SMALL = 16 * 1024  # whole pages: footprint == payload
QUOTA = 4 * SMALL


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess.start(tenants(acme={"quota": QUOTA}), shared=SHARED,
                            workdir=str(tmp_path_factory.mktemp("kvtier-quota-races")),
                            server={"capacity": "8MiB", "max_block": "256KiB", "frame_timeout_s": 20.0})
    yield s
    s.stop()




def put_head(key: bytes, n: int, req_id: int = 2) -> bytes:
    meta = pack_block_header(key, n, bytes(16), None, flags=FLAG_CHECKSUM) + NO_PARENT
    return frame(Op.PUT, meta, b"", req_id=req_id, data_len=n + 16)


def fill(srv, ns: str) -> tuple[RemoteTier, list[bytes]]:
    """acme at its quota in namespace ``ns``: 4 blocks, oldest first."""
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=ns, timeout_s=10)
    keys = keys_for(ns, 4)
    for key in keys:
        assert tier.put(key, block(key, SMALL)) is Status.OK
    return tier, keys


@pytest.mark.parametrize("how", ["bad_checksum", "torn"])
def test_a_failed_upload_does_not_evict_the_tenants_blocks(srv, how):
    ns = f"victims-{how}"
    tier, keys = fill(srv, ns)
    bad = keys_for(f"{ns}/bad", 1)[0]
    data = block(bad, SMALL).tobytes()
    s = logged_in(srv.tcp_url, TOKENS["acme"], ns)
    if how == "bad_checksum":
        s.sendall(put_head(bad, SMALL) + data + bytes(16))
        assert read_frame(s)[0].code == Status.CORRUPT
    else:
        s.sendall(put_head(bad, SMALL) + data[:100])
        time.sleep(0.5)
    s.close()
    time.sleep(0.3)
    try:
        assert tier.contains_many(keys) == [True] * 4
        # control: a block that is stored still evicts the least recently used one
        new = keys_for(f"{ns}/good", 1)[0]
        assert tier.put(new, block(new, SMALL)) is Status.OK
        assert tier.contains_many([*keys, new]) == [False, True, True, True, True]
        assert tier.server_stats()["charged_bytes"] == QUOTA
    finally:
        tier.close()


def test_concurrent_uploads_do_not_take_a_tenant_past_its_quota(srv):
    ns = "overshoot"
    tier, keys = fill(srv, ns)
    new = keys_for(f"{ns}/new", 6)
    socks = []
    for i, key in enumerate(new):  # 6 workers of the tenant start together, each stalls half way
        s = logged_in(srv.tcp_url, TOKENS["acme" if i % 2 else "acme2"], ns)
        s.sendall(put_head(key, SMALL) + block(key, SMALL).tobytes()[: SMALL // 2])
        socks.append(s)
    time.sleep(1.0)
    for s, key in zip(socks, new):
        data = block(key, SMALL).tobytes()
        s.sendall(data[SMALL // 2:] + xxhash.xxh3_128(data).digest())
    assert [read_frame(s)[0].code for s in socks] == [Status.OK] * 6
    for s in socks:
        s.close()
    try:
        stats = tier.server_stats()
        assert stats["charged_bytes"] <= QUOTA, stats
        assert tier.contains_many(keys) == [False] * 4  # the least recently used went first
    finally:
        tier.close()
