"""How a remote tier closes the connections it does not keep, against the real server.

A connection closed in step (its call complete: the pool was full) is shut down and waits for the
server's EOF, and it is let go once the server has closed its side, seen as calls end: kept until a
cap refusal asked, every such close kept its descriptor, without bound (audit s33 a2 D2). A
connection closed mid-call -- here a caller's sink that raises with the rest of the reply unread --
is closed outright: only shut down, the server went on sending it the reply until its frame
timeout (30 s), holding the tenant's connection slot and the blocks it lent (D3)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.remote_wire import CallerError
from tests.polling import wait_until
from tests.server.conftest import keys_for
from tests.server.inprocess import PAGE, InProcessServer


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_connections_closed_for_a_full_pool_are_let_go_once_the_server_closed_them(tmp_path):
    srv = InProcessServer(tmp_path)
    srv.before_deletions(lambda _: time.sleep(0.05))  # each call holds its connection ~50 ms
    tier = srv.remote("acme", pool_size=1)
    threads, rounds = 4, 10
    keys = keys_for("s33-closes", threads * rounds)
    try:
        assert tier.put_many(keys, [np.full(PAGE, 1, np.uint8)] * len(keys)) == [Status.OK] * len(keys)
        before = _open_fds()
        barrier = threading.Barrier(threads)
        results = []

        def deleting(t: int) -> None:
            for r in range(rounds):
                barrier.wait(10)
                results.append(tier.delete_many([keys[r * threads + t]]))

        workers = [threading.Thread(target=deleting, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert results == [[True]] * len(keys)
        # three of four calls of each round found the pool full: ~30 connections closed
        time.sleep(0.5)  # the server has read every close and closed its side long since
        assert tier.ping()  # a call's end looks at them
        assert _open_fds() - before <= 1, "closed connections keep their descriptors"
    finally:
        tier.close()
        srv.stop()


class _BrokenSink:
    nbytes = 256 << 10

    def pieces(self):
        raise RuntimeError("the caller's sink breaks")
        yield  # (a generator)


class _Sink:
    nbytes = 256 << 10

    def __init__(self) -> None:
        self.buf = bytearray(self.nbytes)

    def pieces(self):
        yield memoryview(self.buf)
        return None


def test_a_connection_left_mid_reply_by_a_broken_sink_is_closed_outright(tmp_path):
    srv = InProcessServer(tmp_path, capacity=48 << 20)
    tier = srv.remote("acme", pool_size=4)
    keys = keys_for("s33-mid-reply", 64)  # 16 MiB of reply: more than the loopback socket buffers hold
    try:
        assert tier.put_many(keys, [np.full(256 << 10, i, np.uint8) for i in range(64)]) == [Status.OK] * 64
        with pytest.raises(CallerError, match="sink breaks"):
            tier.get_streams(keys, [_BrokenSink()] + [_Sink() for _ in keys[1:]])
        # the reply unread is reset, and the server lets the connection go at once (not after 30 s)
        assert wait_until(lambda: not srv.server.connections, 5.0), "the server still sends the dead call's reply"
        assert tier.available  # the caller's mistake: the tier stays up
        good = [_Sink()]
        assert tier.get_streams(keys[:1], good) == [Status.OK]
        assert bytes(good[0].buf) == bytes([0]) * (256 << 10)
    finally:
        tier.close()
        srv.stop()
