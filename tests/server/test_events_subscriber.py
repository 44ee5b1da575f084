"""The events subscriber a router runs (kvtier/server/events.py ``EventSubscriber``) against what
a server and a network do to it: messages it cannot read, a connection that dies in silence,
a server that stays away."""

from __future__ import annotations

import os
import struct
import threading
import time

import msgpack
import zmq

from kvtier.server.events import EventPublisher, EventSubscriber
from tests.silent_proxy import SilentProxy, free_port

_SEQ = struct.Struct(">Q").pack


def _events(n: int) -> bytes:
    return msgpack.packb([1.0, [{"type": "stored", "tier": "host", "owner": "t", "namespace": "n",
                                 "blocks": [bytes([n]) * 32], "nbytes": 1}]])


def test_a_message_that_cannot_be_read_is_lost_events_not_an_error(tmp_path):
    """recv raised on an EV whose payload was not msgpack or not ``[ts, [event…]]``, and on a SYNC
    or EV with a missing or short frame: the router's listener thread ended with it. Each is now a
    gap (its events are lost) and recv goes on to the next message."""
    endpoint = f"ipc://{tmp_path}/ev.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)
    sub = EventSubscriber(endpoint)
    try:
        assert server.poll(5000)
        ident, kind, since = server.recv_multipart()
        assert (kind, since) == (b"SUB", b"")
        bad = [[b"EV", _SEQ(1), b"\xc1"], [b"EV", _SEQ(2), msgpack.packb([1.0])],
               [b"EV", _SEQ(3), msgpack.packb([1.0, {"type": "stored"}])], [b"EV", _SEQ(4)],
               [b"EV", b"\x05", _events(5)], [b"SYNC"], [b"SYNC", b"\x00"], [b"NEWS", b"?"]]
        messages = [[b"SYNC", _SEQ(0)], [b"EV", _SEQ(0), _events(0)], *bad, [b"EV", _SEQ(5), _events(5)],
                    [b"EV", _SEQ(6), _events(6)]]
        for m in messages:
            server.send_multipart([ident, *m])
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            msg = sub.recv(timeout_s=0.5)
            if msg is not None:
                got.append(msg)
        assert [seq for seq, _ in got] == [0, 5, 6]
        assert got[1][1][0]["blocks"] == [bytes([5]) * 32]
        # eight unreadable messages (EVs 1 to 3 take their numbers), and EV 4 never came whole
        assert sub.malformed == len(bad) and sub.gaps == len(bad) + 1 and sub.restarts == 0
        assert sub.next_seq == 7 and sub.status == b"EV"
        # control: a message after the unreadable ones that skips a number is a gap of its own
        server.send_multipart([ident, b"EV", _SEQ(9), _events(9)])
        assert sub.recv(timeout_s=5)[0] == 9 and sub.gaps == len(bad) + 3
    finally:
        sub.close()
        server.close(0)
        ctx.term()


def test_renewals_do_not_block_while_the_server_is_away(tmp_path):
    """Each renewal was queued on the DEALER while no server answered; at its high-water mark (1,000
    renewals, ~83 minutes at the default 5 s) the next one blocked the listener's thread until the
    server came back, and the router's stop() gave up on it."""
    sub = EventSubscriber(f"ipc://{tmp_path}/nobody.sock", renew_s=0.0005)   # nobody there
    done = threading.Event()

    def listen():
        for _ in range(3):
            sub.recv(timeout_s=0.3)     # thousands of renewals
        done.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        assert done.wait(10), "a renewal blocked the subscriber's thread"
    finally:
        if done.is_set():
            sub.close()


def test_a_subscriber_whose_connection_died_in_silence_hears_the_restarted_server():
    """EventSubscriber's DEALER set no heartbeat and sent only a renewal every 5 s: over a flow that
    died without a FIN or RST reaching it, its renewals went into the dead flow for good, so a
    server restarted on the same address (a lost in-memory tier) was never heard: no restart seen,
    the router's shared marks never cleared. CURVE over TCP, as a router listens."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    public, secret = (k.decode() for k in zmq.curve_keypair())

    def publisher() -> EventPublisher:
        for _ in range(100):
            try:
                return EventPublisher(endpoint, name_key=os.urandom(32), curve_secret=server_secret,
                                      subscribers={public: "*"}, batch_s=0.01)
            except zmq.ZMQError:
                time.sleep(0.05)   # (the old one's port, released asynchronously)
        raise AssertionError("cannot bind the restarted publisher")

    pub = publisher()
    proxy = SilentProxy(port)
    sub = EventSubscriber(f"tcp://127.0.0.1:{proxy.port}", server_public=server_public, public=public,
                          secret=secret, renew_s=0.5)
    try:
        deadline = time.monotonic() + 10
        while sub.next_seq is None:
            assert time.monotonic() < deadline, "control: never registered"
            sub.recv(timeout_s=0.2)
        for i in range(3):
            pub.emit("stored", "host", "t", "ns", [os.urandom(8)], 1)
            got = None
            while got is None:
                assert time.monotonic() < deadline, "control: no event"
                got = sub.recv(timeout_s=0.2)
        assert sub.next_seq == 3 and sub.restarts == 0                          # control
        proxy.blackhole()                  # the flow dies in silence
        pub.close()
        pub = publisher()                  # the server restarts on its address: numbers from 0
        deadline = time.monotonic() + 20
        while sub.restarts == 0 and time.monotonic() < deadline:
            sub.recv(timeout_s=0.5)
        assert sub.restarts == 1, "after 20 s the subscriber still listened on the dead flow"
        pub.emit("stored", "host", "t", "ns", [os.urandom(8)], 1)
        got = None
        while got is None and time.monotonic() < deadline + 5:
            got = sub.recv(timeout_s=0.5)
        assert got is not None and got[0] == 0 and proxy.connections >= 2
    finally:
        sub.close()
        pub.close()
        proxy.close()
