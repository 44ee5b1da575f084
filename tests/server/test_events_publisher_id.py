"""A restarted kvtier server told apart by its publisher id (kvtier/server/events.py, audit s32 a6 D2).

A subscriber hears from a restarted server only at its next renewal. Writes to the new server
meanwhile advance its numbers; when they had reached the subscriber's next number, the renewal's
SYNC looked like continuity: no restart, no gap, ever (a router kept every shared mark of the old
server's lost tier). And a SYNC ahead of the next number was ignored until the next EV. Real
publishers and subscribers over ipc; a raw ROUTER for frames of the old shape."""

from __future__ import annotations

import os
import struct
import time

import msgpack
import zmq

from kvtier.server.events import EventPublisher, EventSubscriber

_SEQ = struct.Struct(">Q").pack
_PAYLOAD = msgpack.packb([1.0, [{"type": "stored", "tier": "host", "owner": "t", "namespace": "n",
                                 "blocks": [b"x" * 32], "nbytes": 1}]])


def _publisher(endpoint: str, **kw) -> EventPublisher:
    return EventPublisher(endpoint, name_key=os.urandom(32), batch_s=0.001, **kw)


def _emit(pub: EventPublisher, messages: int) -> None:
    """``messages`` messages of one event each, all published before this returns."""
    for i in range(messages):
        start = pub.seq
        pub.emit("stored", "host", "acme", "ns", [os.urandom(32)], 1)
        deadline = time.monotonic() + 5
        while pub.seq == start:
            assert time.monotonic() < deadline, "the publisher did not publish"
            time.sleep(0.005)


def _recv_until(sub: EventSubscriber, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        sub.recv(timeout_s=0.1)


def _emit_once_registered(pub: EventPublisher, sub: EventSubscriber) -> None:
    _recv_until(sub, lambda: sub.next_seq == 0)
    _emit(pub, 1)
    _recv_until(sub, lambda: sub.next_seq == 1)
    assert (sub.next_seq, sub.gaps, sub.restarts) == (1, 0, 0)


def test_a_restarted_server_whose_numbers_caught_up_is_a_restart(tmp_path):
    endpoint = f"ipc://{tmp_path}/ev.sock"
    old = _publisher(endpoint)
    sub = EventSubscriber(endpoint, renew_s=60.0)   # renewed below, when the test says
    new = None
    try:
        _recv_until(sub, lambda: sub.next_seq == 0)
        _emit(old, 3)
        _recv_until(sub, lambda: sub.next_seq == 3)
        assert (sub.next_seq, sub.restarts, sub.gaps) == (3, 0, 0)
        old.close()
        new = _publisher(endpoint)   # a restarted server: its in-memory tier is empty
        _emit(new, 3)                # its first writes, before the subscriber renews: numbers 0, 1, 2
        assert new.seq == 3 == sub.next_seq
        sub.renew_s = 0.1
        _recv_until(sub, lambda: sub.restarts > 0)
        assert (sub.restarts, sub.gaps, sub.next_seq) == (1, 0, 3), "the restart went unnoticed"
        assert sub.publisher_id == new.publisher_id != old.publisher_id
        _emit(new, 1)
        _recv_until(sub, lambda: sub.next_seq == 4)
        assert (sub.restarts, sub.gaps, sub.next_seq) == (1, 0, 4), "the new server's stream is followed"
    finally:
        sub.close()
        (new or old).close()


def test_a_sync_ahead_of_the_next_number_is_a_gap_at_once(tmp_path):
    pub = _publisher(f"ipc://{tmp_path}/ev.sock", peer_ttl_s=0.3)
    sub = EventSubscriber(pub.endpoint, renew_s=60.0)
    try:
        _emit_once_registered(pub, sub)
        time.sleep(0.6)   # the registration lapses: what is published now does not reach the subscriber
        _emit(pub, 2)
        sub.renew_s = 0.1
        _recv_until(sub, lambda: sub.next_seq == 3)   # the renewal's SYNC: 3, where 1 was expected
        assert (sub.gaps, sub.restarts) == (2, 0), "the SYNC's hole was not counted"
    finally:
        sub.close()
        pub.close()


def test_frames_of_the_old_shape_are_followed_and_a_bad_id_is_lost_events(tmp_path):
    """A server from before the id sends SYNC and EV without it: no error, a restart told by numbers
    only. An id of another length is a message that cannot be read; frames after the id are ignored."""
    endpoint = f"ipc://{tmp_path}/ev.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)
    sub = EventSubscriber(endpoint)
    upgraded = os.urandom(16)   # a publisher id (PUBLISHER_ID_BYTES)
    try:
        assert server.poll(5000)
        ident = server.recv_multipart()[0]

        def answer(*frames: bytes) -> tuple[int | None, int, int, int]:
            """What the subscriber makes of one message: the EV's number it returns (None: it
            returned none), and its restarts, gaps and malformed messages so far."""
            server.send_multipart([ident, *frames])
            got = sub.recv(timeout_s=0.3)
            return (None if got is None else got[0]), sub.restarts, sub.gaps, sub.malformed

        assert answer(b"SYNC", _SEQ(0)) == (None, 0, 0, 0)
        assert answer(b"EV", _SEQ(0), _PAYLOAD) == (0, 0, 0, 0)
        assert answer(b"SYNC", _SEQ(1)) == (None, 0, 0, 0) and sub.publisher_id is None
        assert answer(b"SYNC", _SEQ(0)) == (None, 1, 0, 0), "numbers that went back: a restart"
        assert answer(b"SYNC", _SEQ(0), upgraded) == (None, 2, 0, 0), "the server upgraded: a restart"
        assert answer(b"EV", _SEQ(0), _PAYLOAD, upgraded, b"later") == (0, 2, 0, 0)
        assert answer(b"EV", _SEQ(1), _PAYLOAD, b"short") == (None, 2, 1, 1)
        assert answer(b"SYNC", _SEQ(1), upgraded[:8]) == (None, 2, 2, 2)
        assert answer(b"EV", _SEQ(1), _PAYLOAD, upgraded) == (1, 2, 2, 2) and sub.publisher_id == upgraded
    finally:
        sub.close()
        server.close()
        ctx.term()
