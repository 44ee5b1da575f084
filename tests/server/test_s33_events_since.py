"""``EventSubscriber(since=N)`` counts the numbers it asked for and never got (audit s33 a8 D3).

A replay from N whose ring had moved on to M > N took M as the start of the stream and counted
no gap, as did a replay answered ``BUSY``: the caller was never told that N..M-1 were lost,
which the module docstring says must make it clear what it learnt and start again.
"""

from __future__ import annotations

import time

import pytest

from kvtier.server.events import EventPublisher, EventSubscriber, replay

MESSAGES = 40
RING_EVENTS = 10


@pytest.fixture
def publisher(tmp_path):
    """A real publisher (ipc) that sent MESSAGES messages of one event each; its ring keeps the
    last RING_EVENTS. Replays are rate-limited per key (one a minute; over ipc every peer has the
    same key), so a second replay is answered ``BUSY``."""
    pub = EventPublisher(f"ipc://{tmp_path}/ev.sock", name_key=b"k" * 32, buffer=RING_EVENTS, batch_s=0.001,
                         replay_interval_s=60)
    try:
        for i in range(MESSAGES):
            pub.emit("stored", "host", "acme", "ns", [bytes([i]) * 16], 100)
            time.sleep(0.005)   # one message each: the batch is sent before the next event comes
        deadline = time.monotonic() + 5
        while pub.seq < MESSAGES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.seq == MESSAGES
        yield pub
    finally:
        pub.close()


def _receive_until(sub: EventSubscriber, last_seq: int, timeout_s: float = 5.0) -> list[int]:
    seqs: list[int] = []
    deadline = time.monotonic() + timeout_s
    while (not seqs or seqs[-1] < last_seq) and time.monotonic() < deadline:
        got = sub.recv(timeout_s=0.2)
        if got is not None:
            seqs.append(got[0])
    return seqs


def test_a_replay_from_a_number_the_ring_moved_past_counts_the_lost_ones_as_gaps(publisher):
    sub = EventSubscriber(publisher.endpoint, since=0)
    try:
        seqs = _receive_until(sub, MESSAGES - 1)
    finally:
        sub.close()
    first = MESSAGES - RING_EVENTS
    assert seqs == list(range(first, MESSAGES)), seqs   # the ring kept the newest only
    assert (sub.gaps, sub.restarts) == (first, 0), "numbers 0..first-1 never arrived"   # was 0 gaps


def test_control_a_replay_from_a_number_the_ring_holds_counts_no_gap(publisher):
    first = MESSAGES - RING_EVENTS   # the oldest message kept: one event each
    sub = EventSubscriber(publisher.endpoint, since=first)
    try:
        seqs = _receive_until(sub, MESSAGES - 1)
    finally:
        sub.close()
    assert seqs == list(range(first, MESSAGES)) and (sub.gaps, sub.restarts) == (0, 0)


def test_a_replay_answered_busy_counts_what_it_asked_for_as_gaps_when_the_stream_comes(publisher):
    replay(publisher.endpoint, since=0)   # the key's replay for the next minute
    since = 5
    sub = EventSubscriber(publisher.endpoint, since=since)
    try:
        assert sub.recv(timeout_s=0.5) is None   # BUSY: nothing is replayed
        publisher.emit("stored", "host", "acme", "ns", [b"late" * 4], 100)   # the live stream goes on
        seqs = _receive_until(sub, MESSAGES)
    finally:
        sub.close()
    assert seqs == [MESSAGES], "a replay was answered, not BUSY"
    assert (sub.gaps, sub.restarts) == (MESSAGES - since, 0), "numbers 5..39 were asked for, never sent"
