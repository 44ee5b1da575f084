"""The engine never waits on a broken tier: dead, silent, lying or vanishing servers are misses."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np

from kvtier.core.payload import pack_header as pack_block_header
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import (
    HEADER_NBYTES,
    NO_PARENT,
    Op,
    pack_header,
    pack_msgpack,
    unpack_header,
)
from tests.server.conftest import BLOCK, block, connect, frame, hello_frame, keys_for, read_frame, remote
from tests.server.harness import SHARED, TOKENS, tenants


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_is_a_fast_miss_then_backoff():
    tier = RemoteTier(f"tcp://127.0.0.1:{_free_port()}", "t", timeout_s=1, backoff_s=0.2)
    out = np.zeros(BLOCK, np.uint8)
    t0 = time.monotonic()
    assert tier.get(keys_for("dead", 1)[0], out) is Status.ERROR
    assert tier.put(keys_for("dead", 1)[0], out) is Status.ERROR
    assert tier.lookup_prefix(keys_for("dead", 4)) == 0
    assert tier.contains(keys_for("dead", 1)[0]) is False
    assert time.monotonic() - t0 < 1.0
    assert not tier.available and tier.stats.errors >= 1


def test_silent_server_times_out_within_the_bound():
    # Accepts connections and reads, never answers: the slowest kind of broken.
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        ls.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(ls.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        port = ls.getsockname()[1]
        tier = RemoteTier(f"tcp://127.0.0.1:{port}", "t", timeout_s=0.5, connect_timeout_s=0.5)
        t0 = time.monotonic()
        assert tier.lookup_prefix(keys_for("silent", 2)) == 0
        assert time.monotonic() - t0 < 1.5
        assert "Timeout" in (tier.last_error or "") or "timed out" in (tier.last_error or "")
    finally:
        stop.set()
        th.join()
        for s in held:
            s.close()
        ls.close()


def test_reconnects_after_a_server_restart(tmp_path):
    port = _free_port()
    listen = {"listen": [f"tcp://127.0.0.1:{port}"]}
    srv = ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server=listen, tcp=False)
    try:
        tier = RemoteTier(f"tcp://127.0.0.1:{port}", TOKENS["acme"], timeout_s=2, backoff_s=0.05, max_backoff_s=0.2)
        keys = keys_for("restart", 2)
        assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 2
        srv.stop()
        assert tier.lookup_prefix(keys) == 0  # the pooled connection is dead: a miss
        srv = ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server=listen, tcp=False)
        deadline = time.monotonic() + 5
        while not tier.ping() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.put(keys[0], block(keys[0])) is Status.OK  # back, without a new RemoteTier
        assert tier.lookup_prefix(keys) == 1  # (a restart forgets: it is a cache)
    finally:
        srv.stop()


def test_corrupt_reply_is_a_verified_miss():
    """A server (or a network) that returns other bytes than it was given is caught by the checksum."""
    key = keys_for("lying", 1)[0]
    payload = block(key)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)

    def liar():
        c, _ = ls.accept()
        h = unpack_header(c.recv(HEADER_NBYTES, socket.MSG_WAITALL))
        c.recv(h.meta_len, socket.MSG_WAITALL)
        c.sendall(pack_header(Op.HELLO, h.req_id, len(m := pack_msgpack({"max_block": 1 << 20})), 0) + m)
        h = unpack_header(c.recv(HEADER_NBYTES, socket.MSG_WAITALL))
        c.recv(h.meta_len, socket.MSG_WAITALL)
        from kvtier.core.payload import checksum

        header = pack_block_header(key, BLOCK, checksum(payload))
        tampered = payload.copy()
        tampered[100] ^= 1
        c.sendall(pack_header(Op.GET, h.req_id, len(header), BLOCK, 0) + header + tampered.tobytes())
        c.recv(1)
        c.close()

    th = threading.Thread(target=liar, daemon=True)
    th.start()
    tier = RemoteTier(f"tcp://127.0.0.1:{ls.getsockname()[1]}", "t", timeout_s=2)
    assert tier.get(key, np.zeros(BLOCK, np.uint8)) is Status.CORRUPT
    assert tier.stats.verify_failures == 1
    tier.close()
    th.join(5)
    ls.close()


def test_torn_or_corrupt_upload_is_never_stored(server):
    key = keys_for("torn", 1)[0]
    data = block(key)
    header = pack_block_header(key, BLOCK, bytes(16))
    meta = header + NO_PARENT + b"sess"
    # 1. a wrong checksum trailer: answered CORRUPT, connection still usable, nothing stored
    s = connect(server.tcp_url)
    s.sendall(hello_frame(TOKENS["acme"], "torn"))
    read_frame(s)
    s.sendall(frame(Op.PUT, meta, data.tobytes() + bytes(16), req_id=2))
    h, _, _ = read_frame(s)
    assert h.op == Op.PUT and h.code == Status.CORRUPT
    s.sendall(frame(Op.PING, req_id=3))
    assert read_frame(s)[0].op == Op.PING
    # 2. the client vanishes halfway through the payload
    s.sendall(frame(Op.PUT, meta, data.tobytes()[: BLOCK // 2], req_id=4, data_len=BLOCK + 16))
    s.close()
    time.sleep(0.2)
    tier = remote(server, "acme", namespace="torn")
    assert tier.lookup_prefix([key]) == 0
    assert tier.put(key, data) is Status.OK and tier.lookup_prefix([key]) == 1


def test_pooled_connections_closed_for_idling_are_replaced_without_a_miss(tmp_path):
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path),
                             server={"idle_timeout_s": 0.5, "capacity": "8MiB", "max_block": "1MiB"}) as srv:
        tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="idle")
        keys = keys_for("idle", 2)
        assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 2
        time.sleep(1.2)  # the server closes the pooled connection (ERROR TIMEOUT, then EOF)
        assert tier.lookup_prefix(keys) == 2
        time.sleep(0.45)  # idle for most of the allowance: replaced before use, not raced
        assert tier.lookup_prefix(keys) == 2
        assert tier.stats.errors == 0 and tier.last_error is None


def test_a_long_outage_of_a_frozen_server_costs_one_deadline_not_one_per_backoff(tmp_path):
    """Once its backoff was over, the tier's next call tried to reconnect: a frozen server (the
    kernel still accepts, nothing answers the HELLO) cost one caller the whole deadline every
    backoff, all outage long. A connection attempt on a thread of its own decides now."""
    srv = ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path))
    tier = remote(srv, timeout_s=1.0, connect_timeout_s=1.0, backoff_s=0.2, max_backoff_s=0.4)
    k = keys_for("outage", 1)[0]
    out = np.zeros(BLOCK, np.uint8)
    try:
        assert tier.put(k, block(k)) is Status.OK
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert tier.get(k, out) is Status.ERROR  # the call that finds the outage: one deadline
            assert time.monotonic() - start < 1.5
            slowest, calls = 0.0, 0
            until = time.monotonic() + 3.0  # several backoffs
            while time.monotonic() < until:
                start = time.monotonic()
                assert tier.get(k, out) is Status.ERROR
                slowest, calls = max(slowest, time.monotonic() - start), calls + 1
                time.sleep(0.05)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert calls > 15 and slowest < 0.3, f"a call during the outage took {slowest:.2f} s"
        end = time.monotonic() + 10
        while tier.get(k, out) is not Status.OK and time.monotonic() < end:
            time.sleep(0.1)  # it comes back
        assert np.array_equal(out, block(k)) and tier.available
    finally:
        tier.close()
        srv.stop()
