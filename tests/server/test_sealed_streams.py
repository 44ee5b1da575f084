"""End-to-end encryption over a real server: sealed streams, lanes, tampering, and the wire rules."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.core.payload import FLAG_SEALED
from kvtier.core.payload import pack_header as pack_block_header
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.remote_protocol import CHECKSUM_NBYTES, ErrorCode, Op, pack_put_meta
from tests.server.conftest import (
    BLOCK,
    block,
    closed_by_peer,
    connect,
    frame,
    hello_frame,
    keys_for,
    read_frame,
    remote,
)
from tests.server.harness import TOKENS

CHUNK = 16 * 1024  # several chunks per 64 KiB block


@pytest.fixture
def keyring(tmp_path):
    return Keyring(StaticMasterKey(os.urandom(32)), tmp_path / "keys", refresh_s=0.0)


def sealed_tier(server, keyring, tenant="acme", namespace="e2e", **kw):
    inner = remote(server, "acme", namespace=namespace, pool_size=4)
    return EncryptedTier(inner, keyring, tenant, chunk_bytes=CHUNK, **kw), inner


class RawSink:
    """Takes whatever bytes the server holds under a name (no verification: a test's eyes)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.data = bytearray(nbytes)

    def pieces(self):
        yield memoryview(self.data)
        return None


class RawSource:
    """Sends given bytes as a sealed payload (what a tampering client or disk could leave)."""

    def __init__(self, data: bytes) -> None:
        self.nbytes = len(data)
        self._data = data

    def pieces(self):
        yield memoryview(self._data)


def test_blocks_stream_in_lanes_and_the_server_holds_only_ciphertext(server, keyring):
    tier, inner = sealed_tier(server, keyring, streams=3)
    assert inner.streams_available() and "sealed" in inner._server_info["features"]
    keys = keys_for("e2e-lanes", 7)
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 7
    absent = keys_for("e2e-never", 1)
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(8)]
    assert tier.get_many(keys[:4] + absent + keys[4:], outs) == [Status.OK] * 4 + [Status.MISS] + [Status.OK] * 3
    assert all(np.array_equal(o, block(k)) for o, k in zip(outs[:4] + outs[5:], keys))
    assert tier.lookup_prefix(keys) == 7

    names = [tier.storage_name(k) for k in keys]
    sinks = [RawSink(tier._sealed_size(BLOCK)) for _ in names]
    assert inner.get_streams(names, sinks) == [Status.OK] * 7
    for k, sink in zip(keys, sinks):
        assert block(k).tobytes()[:256] not in sink.data, "the server holds plaintext"
    # A plain read never takes a sealed block: it has no checksum to verify.
    assert inner.get(names[0], np.zeros(len(sinks[0].data), np.uint8)) is Status.CORRUPT
    assert inner.get(keys[0], np.zeros(BLOCK, np.uint8)) is Status.MISS  # client keys never reach it
    tier.close()


def test_a_tampered_block_is_a_miss_alone_and_is_dropped(server, keyring):
    tier, inner = sealed_tier(server, keyring, namespace="e2e-tamper")
    keys = keys_for("e2e-tamper", 5)
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 5
    name = tier.storage_name(keys[2])
    sink = RawSink(tier._sealed_size(BLOCK))
    assert inner.get_streams([name], [sink]) == [Status.OK]
    tampered = bytearray(sink.data)
    tampered[len(tampered) // 2] ^= 0x10  # a bit flipped in the middle of a chunk, on the server
    assert inner.delete(name) and inner.put_streams([name], [RawSource(bytes(tampered))]) == [Status.OK]

    failures = inner.stats.verify_failures
    outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert tier.get_many(keys, outs) == [Status.OK, Status.OK, Status.CORRUPT, Status.OK, Status.OK]
    assert all(np.array_equal(outs[i], block(keys[i])) for i in (0, 1, 3, 4))
    assert inner.stats.verify_failures == failures + 1
    assert not inner.contains(name), "a block that can never verify is dropped"
    assert tier.get(keys[2], outs[2]) is Status.MISS
    tier.close()


def test_blocks_staged_on_a_server_without_streams_stay_readable(server, keyring, monkeypatch):
    writer, winner = sealed_tier(server, keyring, namespace="e2e-staged")
    monkeypatch.setattr(winner, "streams_available", lambda: False)  # as against an older server
    keys = keys_for("e2e-staged", 3)
    assert writer.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
    reader, _ = sealed_tier(server, keyring, namespace="e2e-staged")
    outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert reader.get_many(keys, outs) == [Status.OK] * 3
    assert all(np.array_equal(o, block(k)) for o, k in zip(outs, keys))
    assert writer.get_many(keys, outs) == [Status.OK] * 3  # and the staged reader reads its own
    writer.close()
    reader.close()


def test_zero_trust_isolation_two_tenants_one_server_namespace(server, keyring):
    """Both tenants write through the same server token and namespace: only the keys tell them apart."""
    a, _ = sealed_tier(server, keyring, "tenant-a", namespace="e2e-shared")
    b, _ = sealed_tier(server, keyring, "tenant-b", namespace="e2e-shared")
    keys = keys_for("e2e-shared", 6)
    assert a.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 6
    outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert a.lookup_prefix(keys) == 6 and a.get_many(keys, outs) == [Status.OK] * 6  # control
    assert b.lookup_prefix(keys) == 0
    assert b.get_many(keys, outs) == [Status.MISS] * 6
    a.close()
    b.close()


def _sealed_put(key: bytes, payload: bytes, trailer: bytes, flags: int) -> bytes:
    header = pack_block_header(key, len(payload), bytes(16), flags=flags)
    return frame(Op.PUT, pack_put_meta(header, None, ""), payload + trailer, req_id=2)


def test_server_takes_a_sealed_put_only_with_a_zero_trailer(server):
    s = connect(server.tcp_url)
    s.sendall(hello_frame(TOKENS["acme"], "e2e-wire"))
    read_frame(s)
    key = keys_for("e2e-wire", 1)[0]
    s.sendall(_sealed_put(key, b"x" * 1000, b"\1" * CHECKSUM_NBYTES, FLAG_SEALED))
    h, _, _ = read_frame(s)
    assert h.op == Op.PUT and h.code == Status.CORRUPT
    s.sendall(_sealed_put(key, b"x" * 1000, bytes(CHECKSUM_NBYTES), FLAG_SEALED))
    h, _, _ = read_frame(s)
    assert h.op == Op.PUT and h.code == Status.OK
    # A header that names no way to verify its payload breaks the protocol.
    s.sendall(_sealed_put(keys_for("e2e-wire", 2)[1], b"x" * 1000, bytes(CHECKSUM_NBYTES), 0))
    h, meta, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.BAD_META and b"checksum or a sealed" in meta
    assert closed_by_peer(s)
