"""A PUT either stores its block and indexes it, or leaves no trace: no orphan pool slot, no lost
acknowledged block.

* A block header with a non-ASCII dtype was committed to the pool, then failed (INTERNAL) when the
  server packed its header: the slot was held by no index entry and charged to no quota. The key
  was poisoned (a correct re-PUT answered OK, every GET a MISS) and a tenant with a 64 KiB quota
  could fill the pool with such orphans, evicting every other tenant's blocks.
* A PUT of a key whose upload was in flight on another connection was answered OK and its payload
  dropped; when the first upload then failed, the acknowledged block never existed -- across
  tenants too, for two publishers of one shared namespace.
"""

from __future__ import annotations

import time

import pytest
import xxhash

from kvtier.core.payload import _BODY, _CHECK, FLAG_CHECKSUM, FORMAT_VERSION, MAGIC
from kvtier.core.payload import pack_header as pack_block_header
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import GET_ITEM, NO_PARENT, ErrorCode, Op
from tests.server.conftest import block, frame, keys_for, logged_in, read_frame
from tests.server.harness import TOKENS, tenants

SMALL = 16 * 1024  # whole pages: footprint == payload
QUOTA = 4 * SMALL
N = 64 * 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    shared = [{"name": "system-prompts", "writers": ["ops", "globex"]}]  # two publishers
    s = ServerProcess.start(tenants(acme={"quota": QUOTA}), shared=shared,
                            workdir=str(tmp_path_factory.mktemp("kvtier-put-integrity")),
                            server={"capacity": "2MiB", "max_block": "256KiB", "frame_timeout_s": 20.0})
    yield s
    s.stop()




def put_head(key: bytes, n: int, header: bytes | None = None, req_id: int = 2) -> bytes:
    """A PUT's frame header and meta: its payload and checksum trailer are to follow."""
    header = header or pack_block_header(key, n, bytes(16), None, flags=FLAG_CHECKSUM)
    return frame(Op.PUT, header + NO_PARENT, b"", req_id=req_id, data_len=n + 16)


def put(s, key: bytes, data: bytes, header: bytes | None = None, trailer: bytes | None = None):
    s.sendall(put_head(key, len(data), header) + data + (trailer or xxhash.xxh3_128(data).digest()))
    return read_frame(s)


def get(s, key: bytes, n: int):
    s.sendall(frame(Op.GET, GET_ITEM.pack(key, n), req_id=3))
    h, _, data = read_frame(s)
    return h.code, data


def non_ascii_dtype_header(key: bytes, n: int) -> bytes:
    body = _BODY.pack(MAGIC, FORMAT_VERSION, FLAG_CHECKSUM, key, n, 0, b"\xff" * 4, 0, *([0] * 6), bytes(16), 0)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def test_a_non_ascii_dtype_is_refused_and_does_not_poison_the_key(srv):
    key = keys_for("poisoned", 1)[0]
    data = block(key, SMALL).tobytes()
    s = logged_in(srv.tcp_url, TOKENS["acme"], "evil")
    h, meta, _ = put(s, key, data, header=non_ascii_dtype_header(key, SMALL))
    assert h.op == Op.ERROR and h.code == ErrorCode.BAD_META, (h, meta)
    s.close()
    s = logged_in(srv.tcp_url, TOKENS["acme"], "evil")  # control: a well-formed PUT of the same key is stored
    h, _, _ = put(s, key, data)
    assert h.code == Status.OK
    assert get(s, key, SMALL) == (Status.OK, data)
    s.close()


def test_malformed_puts_leave_no_orphans_to_evict_another_tenant(srv):
    globex = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace="victim", timeout_s=10)
    keys = keys_for("globex-victim", 48)  # 768 KiB of a 2 MiB pool
    assert globex.put_many(keys, [block(k, SMALL) for k in keys]) == [Status.OK] * len(keys)
    for key in keys_for("evil", 160):  # 2.5 MiB from a tenant with a 64 KiB quota
        s = logged_in(srv.tcp_url, TOKENS["acme"], "evil")
        h, meta, _ = put(s, key, block(key, SMALL).tobytes(), header=non_ascii_dtype_header(key, SMALL))
        s.close()
        assert h.op == Op.ERROR and h.code == ErrorCode.BAD_META, (h, meta)
    try:
        assert globex.contains_many(keys) == [True] * len(keys)
    finally:
        globex.close()


@pytest.mark.parametrize("how", ["torn", "bad_checksum"])
def test_a_put_acknowledged_while_the_same_key_was_in_flight_survives_the_first_uploads_failure(srv, how):
    key = keys_for(f"same-key-{how}", 1)[0]
    data = block(key, N).tobytes()
    first = logged_in(srv.tcp_url, TOKENS["acme"], "ns")
    first.sendall(put_head(key, N) + data[: N // 2])  # stalls half way, holding its reservation
    time.sleep(0.5)
    second = logged_in(srv.tcp_url, TOKENS["acme2"], "ns")  # another worker of the tenant
    assert put(second, key, data)[0].code == Status.OK
    if how == "torn":
        first.close()
    else:
        first.sendall(data[N // 2:] + bytes(16))  # a wrong trailer
        assert read_frame(first)[0].code == Status.CORRUPT
        first.close()
    time.sleep(0.3)
    assert get(second, key, N) == (Status.OK, data)
    second.close()


def test_same_key_uploads_both_succeed_and_the_block_is_stored_once(srv):
    """Control: when both uploads succeed, both are acknowledged and the block is indexed once."""
    key = keys_for("same-key-both", 1)[0]
    data = block(key, N).tobytes()
    first = logged_in(srv.tcp_url, TOKENS["acme"], "both")
    first.sendall(put_head(key, N) + data[: N // 2])
    time.sleep(0.3)
    second = logged_in(srv.tcp_url, TOKENS["acme2"], "both")
    assert put(second, key, data)[0].code == Status.OK
    first.sendall(data[N // 2:] + xxhash.xxh3_128(data).digest())
    assert read_frame(first)[0].code == Status.OK
    assert get(first, key, N) == (Status.OK, data)
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="both", timeout_s=10)
    try:
        assert tier.server_stats()["namespace_blocks"] == 1
    finally:
        tier.close()
    first.close()
    second.close()


def test_one_publishers_failed_upload_does_not_lose_anothers_acknowledged_block(srv):
    key = keys_for("shared-same-key", 1)[0]
    data = block(key, N).tobytes()
    ops = logged_in(srv.tcp_url, TOKENS["ops"], "shared/system-prompts")
    ops.sendall(put_head(key, N) + data[:1000])
    time.sleep(0.5)
    globex = logged_in(srv.tcp_url, TOKENS["globex"], "shared/system-prompts")
    assert put(globex, key, data)[0].code == Status.OK
    ops.close()
    globex.close()
    time.sleep(0.3)
    reader = logged_in(srv.tcp_url, TOKENS["acme"], "mine")  # a granted reader
    assert get(reader, key, N) == (Status.OK, data)
    reader.close()
