"""Slow clients hold only their own connection: others keep full service, the slow ones are cut off."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvtier.core.payload import pack_header as pack_block_header
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import NO_PARENT, ErrorCode, Op, unpack_header
from tests.server.conftest import block, connect, frame, hello_frame, keys_for
from tests.server.harness import SHARED, TOKENS, tenants

FRAME_TIMEOUT = 1.0
IDLE_TIMEOUT = 1.5
BIG = 256 * 1024


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-slow")
    srv = ServerProcess.start(tenants(), shared=SHARED, workdir=str(wd), server={
        "capacity": "16MiB", "max_block": "256KiB", "frame_timeout_s": FRAME_TIMEOUT,
        "idle_timeout_s": IDLE_TIMEOUT, "max_connections": 512, "metrics": "127.0.0.1:0",
        # every slow socket here comes from 127.0.0.1: room for all, so that each is cut off by its timeout
        "max_connections_per_peer": 128, "max_unauthenticated": 256, "hello_timeout_s": 30})
    yield srv
    srv.stop()


def _drain(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def _last_error_code(data: bytes) -> int | None:
    pos, code = 0, None
    while pos + 22 <= len(data):
        h = unpack_header(data[pos : pos + 22])
        code = h.code if h.op == Op.ERROR else None
        pos += 22 + h.meta_len + h.data_len
    return code


def test_slowloris_does_not_block_others_and_is_cut_off(slow_server):
    url = slow_server.tcp_url
    hello = hello_frame(TOKENS["acme"], "x")
    # 1. pre-auth: a HELLO one byte at a time
    dribblers = [connect(url) for _ in range(100)]
    # 2. authenticated uploads that trickle their payload (they hold reserved pool slots)
    uploaders = []
    for i in range(12):
        s = connect(url)
        s.sendall(hello_frame(TOKENS["globex"], "slow"))
        key = keys_for("slow-upload", 12)[i]
        meta = pack_block_header(key, BIG, bytes(16)) + NO_PARENT
        s.sendall(frame(Op.PUT, meta, b"", req_id=2, data_len=BIG + 16))
        uploaders.append(s)
    # 3. connected and silent
    idlers = [connect(url) for _ in range(20)]
    # 4. a reader that never reads its (large) replies
    nonreader = connect(url)
    nonreader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    nonreader.sendall(hello_frame(TOKENS["acme"], "normal"))

    stop = threading.Event()

    def dribble():
        i = 0
        while not stop.is_set():
            for s in dribblers:
                try:
                    s.send(hello[i % len(hello) : i % len(hello) + 1])
                except OSError:
                    pass
            for s in uploaders:
                try:
                    s.send(b"\0")
                except OSError:
                    pass
            i += 1
            time.sleep(0.1)

    th = threading.Thread(target=dribble, daemon=True)
    th.start()

    tier = RemoteTier(url, TOKENS["acme"], namespace="normal", timeout_s=2)
    keys = keys_for("normal", 8)
    assert tier.put_many(keys, [block(k, BIG) for k in keys]) == [Status.OK] * 8
    from kvtier.tiers.remote_protocol import GET_ITEM

    nonreader.sendall(frame(Op.GET, b"".join(GET_ITEM.pack(k, BIG) for k in keys) * 8, req_id=2))

    latencies, ops = [], 0
    out = np.zeros(BIG, np.uint8)
    t_end = time.monotonic() + FRAME_TIMEOUT + IDLE_TIMEOUT + 0.5
    while time.monotonic() < t_end:
        k = keys[ops % len(keys)]
        t0 = time.monotonic()
        assert tier.get(k, out) is Status.OK, tier.last_error
        assert np.array_equal(out, block(k, BIG))
        new = keys_for(f"normal-{ops}", 1)[0]
        assert tier.put(new, block(new, BIG)) is Status.OK, tier.last_error
        latencies.append(time.monotonic() - t0)
        ops += 1
    stop.set()
    th.join()
    assert ops >= 20, f"only {ops} operations while slow clients were connected"
    assert max(latencies) < 0.75, f"an operation waited {max(latencies):.2f}s behind slow clients"

    for group, name in ((dribblers, "dribbler"), (uploaders, "uploader"), (idlers, "idler")):
        for s in group:
            data = _drain(s, 3.0)
            assert _last_error_code(data) == ErrorCode.TIMEOUT, f"a {name} was not cut off: {data[-40:]!r}"
            s.close()
    # The non-reader is closed too (its reply stalled), which releases the slot it pinned.
    nonreader.settimeout(5)
    deadline = time.monotonic() + 5
    closed = False
    while time.monotonic() < deadline and not closed:
        try:
            closed = nonreader.recv(1 << 20) == b""
        except (ConnectionResetError, socket.timeout):
            closed = True
    assert closed, "a client that does not read its replies was kept forever"
    nonreader.close()
    # The server agrees: only the well-behaved client's connection is left, the rest timed out.
    import urllib.request

    text = urllib.request.urlopen(f"http://{slow_server.info['metrics']}/metrics", timeout=5).read().decode()
    gauge = [line for line in text.splitlines() if line.startswith("kvtier_connections ")]
    assert float(gauge[0].split()[1]) <= 2, gauge
    timeouts = [line for line in text.splitlines() if line.startswith('kvtier_protocol_errors_total{code="TIMEOUT"}')]
    assert float(timeouts[0].split()[1]) >= len(dribblers) + len(uploaders) + len(idlers) + 1
    # ... and the pool is whole again: all the slow uploads' reservations were returned.
    more = keys_for("after-slow", 40)
    assert tier.put_many(more, [block(k, BIG) for k in more]) == [Status.OK] * 40
