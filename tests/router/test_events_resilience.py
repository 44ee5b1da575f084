"""The router's listeners against what a network and a publisher do to them (kvtier/router/events.py),
through real ZMQ sockets: a worker's connection that dies in silence, a shared tier that sends a
message that cannot be read, a listener that fails, a shared tier that goes away."""

from __future__ import annotations

import asyncio
import struct
import threading
import time

import msgpack
import pytest
import zmq

import kvtier.server.events as server_events
from kvtier.router.events import SharedTierEvents, VllmEvents
from kvtier.router.index import SHARED_BIT, BlockIndex, block_keys
from kvtier.router.workers import Worker
from tests.silent_proxy import SilentProxy, free_port

BS = 4
OLD = [101, 102, 103, 104]
NEW = [201, 202, 203, 204]
_SEQ = struct.Struct(">Q").pack


def _stored(h, toks):
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": toks,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_a_silently_dead_worker_event_connection_is_noticed():
    """The SUB set no heartbeat: it sends nothing after subscribing, so a flow that died without a
    FIN or RST reaching the router (a crashed host, a NAT's idle timeout) was never noticed. The
    worker restarted on the same address and published again, but the SUB stayed on the dead flow:
    no 'disconnected' resync, the old blocks stayed credited, events_up stayed 1, and the restarted
    worker's blocks were never indexed. (Shipped heartbeat settings: noticed in about 8 s.)"""
    ctx = zmq.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    proxy = SilentProxy(port)
    index = BlockIndex(BS)
    worker = Worker(0, "http://w0", f"tcp://127.0.0.1:{proxy.port}")
    reasons: list[str] = []
    listener = VllmEvents(worker, index, on_resync=lambda w, reason: reasons.append(reason))
    old, new = block_keys(OLD, BS), block_keys(NEW, BS)
    seq = 0

    def send(sock, events):
        nonlocal seq
        sock.send_multipart([b"", _SEQ(seq), msgpack.packb([time.time(), events, None])])
        seq += 1

    async def main():
        nonlocal pub, seq
        listener.start()
        try:
            deadline = time.monotonic() + 10
            while not index.masks(old):      # (slow joiner: send until one arrives)
                assert time.monotonic() < deadline, "control: the old block was never indexed"
                send(pub, [_stored(1, OLD)])
                await asyncio.sleep(0.05)
            assert worker.events_up and reasons == []                           # control
            proxy.blackhole()                        # the flow dies in silence
            pub.close(0)                             # the worker restarts on its address
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            for _ in range(100):                     # (ZMQ closes the old listening socket asynchronously)
                try:
                    pub.bind(f"tcp://127.0.0.1:{port}")
                    break
                except zmq.ZMQError:
                    await asyncio.sleep(0.05)
            seq = 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (index.masks(old) or not index.masks(new)):
                send(pub, [_stored(2, NEW)])
                await asyncio.sleep(0.2)
            assert not index.masks(old) and index.masks(new), (
                f"after 20 s: old block still credited={bool(index.masks(old))}, restarted worker's "
                f"block indexed={bool(index.masks(new))}, resyncs={reasons}, events_up={worker.events_up}")
            assert "disconnected" in reasons and worker.events_up and proxy.connections >= 2
        finally:
            await listener.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 40))
    finally:
        pub.close(0)
        proxy.close()
        ctx.term()


class _FakeServer:
    """A ROUTER speaking kvtier serve's events protocol: answers the n-th SUB with ``replies[n]``
    (the last one for every later SUB)."""

    def __init__(self, endpoint: str, replies: list[list[list[bytes]]]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.replies = replies
        self.subs = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *body = self.sock.recv_multipart()
            if body[:1] != [b"SUB"]:
                continue
            msgs = self.replies[min(self.subs, len(self.replies) - 1)]
            self.subs += 1
            for m in msgs:
                self.sock.send_multipart([ident, *m])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fast_renewals(monkeypatch):
    """The listener's subscriber renews every 0.3 s instead of 5 s (it builds it with the default)."""
    real_init = server_events.EventSubscriber.__init__
    monkeypatch.setattr(server_events.EventSubscriber, "__init__",
                        lambda self, *a, **kw: real_init(self, *a, **{**kw, "renew_s": 0.3}))


GOOD = msgpack.packb([1.0, [{"type": "stored", "tier": "host", "owner": "t", "namespace": "n",
                             "blocks": [b"x" * 32], "nbytes": 1}]])


def _shared_run(endpoint: str, replies: list[list[list[bytes]]], until) -> tuple[SharedTierEvents, bool]:
    """A SharedTierEvents over a fake server giving ``replies`` (see _FakeServer), until ``until``
    (or 6 s); returns it (stopped) and whether the shared mark outlived the run."""
    server = _FakeServer(endpoint, replies)
    index = BlockIndex(BS)
    keys = block_keys(OLD, BS)
    index.add_shared(keys)

    async def main():
        shared = SharedTierEvents(index, endpoint, asyncio.get_running_loop())
        shared.start()
        try:
            deadline = time.monotonic() + 6.0     # renewals every 0.3 s
            while not until(shared, server) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            return shared
        finally:
            await asyncio.to_thread(shared.stop)

    try:
        shared = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        server.close()
    return shared, bool(index.mask(keys[0]) & SHARED_BIT)


def test_one_malformed_message_from_the_shared_tier_does_not_end_its_listener(tmp_path, fast_renewals):
    """EventSubscriber.recv raised on an EV whose payload is not msgpack (or a SYNC / EV with a
    missing or short frame), and SharedTierEvents ran its loop in one try: the thread logged
    'stopped' and ended for good. From then on a restarted server or lost events cleared nothing,
    and every block marked shared stayed predicted as loadable although the server had lost it.
    Now an unreadable message is lost events (the marks cleared), and the listener goes on."""
    restarted = [[b"SYNC", _SEQ(0)]]          # every renewal: a restarted server's SYNC 0
    shared, marked = _shared_run(f"ipc://{tmp_path}/ev-good.sock",
                                 [[[b"EV", _SEQ(5), GOOD], [b"EV", _SEQ(6), GOOD], [b"SYNC", _SEQ(7)]], restarted],
                                 until=lambda shared, server: shared.resyncs >= 1)
    assert shared.resyncs == 1 and not marked                                 # control: the restart clears
    # each message that cannot be read is a hole (the marks cleared), and the listener goes on: the
    # EV after it is counted
    for i, bad in enumerate(([b"EV", _SEQ(6), b"\xc1"],                      # not msgpack
                             [b"EV", _SEQ(6), msgpack.packb([1.0])],          # no events
                             [b"EV", _SEQ(6), msgpack.packb([1.0, 7])],       # events not a list
                             [b"EV", _SEQ(6)], [b"EV", b"\x06", GOOD],        # frames missing or short
                             [b"SYNC"], [b"SYNC", b""], [b"?"])):
        shared, marked = _shared_run(f"ipc://{tmp_path}/ev-bad{i}.sock",
                                     [[[b"EV", _SEQ(5), GOOD], bad, [b"EV", _SEQ(7), GOOD]], [[b"SYNC", _SEQ(8)]]],
                                     until=lambda shared, server: shared.messages >= 2 and server.subs >= 2)
        assert shared.messages >= 2, f"after one unreadable message {bad!r} the listener was dead"
        assert shared.resyncs >= 1 and not marked and shared.up, (bad, shared.resyncs)


def test_an_error_in_the_shared_tier_listener_clears_the_marks_and_it_goes_on(tmp_path, fast_renewals, monkeypatch):
    """Any error of the listener (not only a malformed message) ended its thread for good. Now it
    clears the shared marks, backs off briefly and listens again with a new subscriber."""
    real_recv = server_events.EventSubscriber.recv
    calls = [0]

    def failing_once(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise zmq.ZMQError(zmq.EFAULT, "injected")
        return real_recv(self, *a, **kw)

    monkeypatch.setattr(server_events.EventSubscriber, "recv", failing_once)
    # the first subscriber gets EV 5, then fails; the second gets EV 6
    shared, marked = _shared_run(f"ipc://{tmp_path}/ev.sock",
                                 [[[b"EV", _SEQ(5), GOOD]], [[b"EV", _SEQ(6), GOOD], [b"SYNC", _SEQ(7)]],
                                  [[b"SYNC", _SEQ(7)]]],
                                 until=lambda shared, server: shared.messages >= 2)
    assert calls[0] > 2, "the listener ended with the error"
    assert shared.resyncs == 1 and not marked
    assert shared.messages >= 2, "the listener did not listen again after the error"


def test_the_shared_tier_counts_as_down_while_its_server_does_not_answer(tmp_path, fast_renewals):
    """``up`` was set once and never went back to False while the server was down."""
    endpoint = f"ipc://{tmp_path}/ev.sock"
    server = _FakeServer(endpoint, [[[b"SYNC", _SEQ(0)]]])
    index = BlockIndex(BS)

    async def until(cond, what, timeout):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}"
            await asyncio.sleep(0.05)

    async def main():
        nonlocal server
        shared = SharedTierEvents(index, endpoint, asyncio.get_running_loop())
        shared.start()
        try:
            await until(lambda: shared.up, "up", 5)                             # control
            server.close()
            await until(lambda: not shared.up, "down after the server went away", 5)
            server = _FakeServer(endpoint, [[[b"SYNC", _SEQ(0)]]])
            await until(lambda: shared.up, "up again", 10)
        finally:
            await asyncio.to_thread(shared.stop)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.close()
