"""How a worker's event listener (kvtier/router/events.py) rebuilds that worker's index entries after
a hole, with the publisher's replay buffer: from the buffer's start, never from the middle of the
stream; never from a dropped connection's leftovers; without holding up live events when the
replay endpoint does not answer, yet asking it again after a back-off. Real ZMQ sockets, through a
stand-in for vLLM's publisher whose every send the test decides (test_events.py drives vLLM's own),
and a clock for the back-off that the test moves on."""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections import deque

import msgpack
import zmq

from kvtier.router.events import VllmEvents
from kvtier.router.index import BlockIndex, block_keys
from kvtier.router.workers import Worker

BS = 4
OLD, NEW = 0, 100   # block numbers of a publisher and of its restarted process
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block(i: int) -> list[int]:
    return [1000 + i] * BS


def stored(i: int) -> dict:
    """Block ``i``: a root block of its own (hash i + 1)."""
    return {"type": "BlockStored", "block_hashes": [i + 1], "parent_block_hash": None, "token_ids": block(i),
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


class StandInPublisher:
    """vLLM's ZmqEventPublisher as a listener sees it (``[topic, seq, payload]`` live; a replay ROUTER
    answering ``["", topic, seq, payload]``… then the end marker, over its last ``buffer_steps``
    batches), with what goes out live, what is only buffered (lost on the way) and whether the
    replay answers left to the test. Its PUB is an XPUB, which says when the listener's
    subscription arrived: no batch is lost to a slow joiner."""

    def __init__(self, tmp_path, buffer_steps: int = 100, answers: bool = True) -> None:
        self.endpoint, self.replay_endpoint = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 5000)       # close() delivers what was sent before it
        self.handshakes = self.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.pub.bind(self.endpoint)
        self.buffer: deque = deque(maxlen=buffer_steps)
        self.seq = 0
        self.answers = answers
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def publish(self, i: int, live: bool = True) -> None:
        """Block ``i``'s batch: buffered, and sent unless ``live`` is false (lost on the way)."""
        payload = msgpack.packb([time.time(), [stored(i)], None])
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"kv", struct.pack(">Q", seq), payload])

    def restart_sequence(self) -> None:
        """As a restarted publisher: numbered from 0 again, with an empty buffer."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def subscribed(self) -> bool:
        """Whether a subscription came (each is told once)."""
        return bool(self.pub.poll(0)) and self.pub.recv().startswith(b"\x01")

    def wait_connected(self) -> None:
        """Blocks until a subscriber's connection finished its handshake (the I/O threads' work: the
        subscriber's event loop may be held meanwhile)."""
        assert self.handshakes.poll(10_000), "the listener never connected"
        self.handshakes.recv_multipart()

    def _serve_replay(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.replay_endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _, start = router.recv_multipart()
                self.requests += 1
                if self.answers:
                    start = int.from_bytes(start, "big")
                    with self._lock:
                        batches = [(seq, payload) for seq, payload in self.buffer if seq >= start]
                    for seq, payload in batches:
                        router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
                    router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close(0)

    def close(self) -> None:
        """Blocks until what was published is delivered (the PUB's linger)."""
        self._stop.set()
        self._thread.join(5)
        self.pub.disable_monitor()
        self.handshakes.close(0)
        self.pub.close()
        self.ctx.term()


class SteppedClock:
    """The listener's clock for its replay back-off: stands still until the test moves it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def listener(pub: StandInPublisher, resyncs: list[str]) -> tuple[BlockIndex, VllmEvents]:
    index = BlockIndex(BS)
    return index, VllmEvents(Worker(0, "http://w0", pub.endpoint, pub.replay_endpoint), index,
                             on_resync=lambda worker, reason: resyncs.append(reason))


def held(index: BlockIndex) -> set[int]:
    """The blocks (of both processes' numbers) the index credits."""
    return {i for i in (*range(OLD, OLD + 50), *range(NEW, NEW + 50)) if index.masks(block_keys(block(i), BS))}


async def until(cond, what: str, timeout_s: float = 15.0) -> None:
    """Waits for a condition (the deadline only says what never came)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


async def in_step(pub: StandInPublisher, events: VllmEvents) -> None:
    """The listener connected (its replay on connecting done) and its subscription arrived."""
    await until(lambda: events.worker.events_up, "connected")
    await until(pub.subscribed, "subscribed")


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_gap_the_buffer_only_partly_holds_rebuilds_from_the_buffers_start(tmp_path):
    """Batches 1-5 lost on the way; when 6 comes the buffer (4 steps) holds 3-6. The gap replay
    refused the buffer (it no longer starts at 1), the gap cleared the worker and only 6 was
    indexed: 3-5, which a router started at that moment replays, were never indexed by the one
    that listened all along."""
    pub = StandInPublisher(tmp_path, buffer_steps=4)
    resyncs: list[str] = []
    index, events = listener(pub, resyncs)

    async def main():
        events.start()
        try:
            await in_step(pub, events)
            pub.publish(0)
            await until(lambda: held(index) == {0}, "control: block 0 indexed")
            for i in range(1, 6):
                pub.publish(i, live=False)
            pub.publish(6)
            await until(lambda: 6 in held(index), "block 6 indexed")
            assert resyncs == ["gap"]
            assert held(index) == {3, 4, 5, 6}, "the buffer's blocks before the live one were not replayed"
        finally:
            await events.stop()

    try:
        run(main)
    finally:
        pub.close()


def test_a_sequence_that_goes_back_rebuilds_from_the_restarted_publishers_buffer(tmp_path):
    """The publisher numbers from 0 again (a restart) and the listener hears its batch 3 first: the
    restart cleared the worker and only 3 was indexed, not the 0-2 its buffer holds."""
    pub = StandInPublisher(tmp_path)
    resyncs: list[str] = []
    index, events = listener(pub, resyncs)

    async def main():
        events.start()
        try:
            await in_step(pub, events)
            for i in range(5):
                pub.publish(OLD + i)
            await until(lambda: held(index) == set(range(OLD, OLD + 5)), "control: the first five indexed")
            pub.restart_sequence()
            for i in range(3):
                pub.publish(NEW + i, live=False)
            pub.publish(NEW + 3)
            await until(lambda: NEW + 3 in held(index), "the restarted publisher's live block indexed")
            assert resyncs == ["restarted"]
            assert held(index) == set(range(NEW, NEW + 4)), "the restarted publisher's buffer was not replayed"
        finally:
            await events.stop()

    try:
        run(main)
    finally:
        pub.close()


def test_a_dropped_connections_queued_messages_are_not_spliced_onto_a_restarted_publisher(tmp_path):
    """The worker's process restarts while its last batches (5-9) still wait in the listener's SUB
    (its event loop busy). The disconnect was handled first, then those leftovers: 5 replayed 0-4
    from the restarted process's buffer and the dead process's 5-9 were applied on top as their
    continuation (credited for good: the new process never removes them), and the new process's
    live 20 read as a gap. The loop is held here by running the restart inside it: everything
    it then finds (leftovers, disconnect, reconnect) was queued before it looks."""
    first = StandInPublisher(tmp_path)
    resyncs: list[str] = []
    index, events = listener(first, resyncs)
    restarted: list[StandInPublisher] = []

    def restart_while_the_loop_is_busy():
        for i in range(5, 10):
            first.publish(OLD + i)                 # live: queued in the listener's SUB
        first.close()                              # delivered, then the process is gone
        new = StandInPublisher(tmp_path)           # back on the same endpoints, numbered from 0
        restarted.append(new)
        for i in range(20):
            new.publish(NEW + i, live=False)       # before the listener resubscribed: buffer only
        new.wait_connected()                       # the SUB reconnected: connected is queued too

    async def main():
        events.start()
        try:
            await in_step(first, events)
            for i in range(5):
                first.publish(OLD + i)
            await until(lambda: held(index) == set(range(OLD, OLD + 5)), "control: the first five indexed")
            restart_while_the_loop_is_busy()
            new = restarted[0]
            await until(new.subscribed, "subscribed to the restarted publisher")
            new.publish(NEW + 20)
            await until(lambda: NEW + 20 in held(index), "the restarted publisher's live block indexed")
            phantoms = sorted(held(index) & set(range(OLD, OLD + 10)))
            assert not phantoms, f"the dead process's blocks {phantoms} are credited to the restarted worker"
            assert held(index) == set(range(NEW, NEW + 21))
            assert resyncs == ["disconnected"], "the restarted publisher's stream was read as a hole"
        finally:
            await events.stop()

    try:
        run(main)
    finally:
        for pub in (first, *restarted):
            if not pub.ctx.closed:
                pub.close()


def test_a_replay_endpoint_that_does_not_answer_does_not_hold_up_live_events(tmp_path, caplog):
    """vLLM started without ``replay_endpoint`` (while the router's config points at one), or a stuck
    publisher thread: requests are taken and never answered. Every hole then waited out the replay's
    whole timeout before the live message that showed it was applied (the worker's entries, just
    cleared, stayed empty meanwhile). Not asked again while its back-off lasts (the clock stands
    still here): the connection's own replay is the only request, and the silence is logged once."""
    pub = StandInPublisher(tmp_path, answers=False)
    resyncs: list[str] = []
    index, events = listener(pub, resyncs)
    events.replay_timeout_s = 0.5
    events.clock = SteppedClock()

    async def main():
        events.start()
        try:
            await in_step(pub, events)           # after the connection's replay went unanswered
            await until(lambda: pub.requests == 1, "control: the connection's replay asked")
            for i in range(5):
                pub.publish(i)
            await until(lambda: held(index) == set(range(5)), "control: the listener is in step")
            for lost, live in ((5, 6), (7, 8)):  # two holes
                pub.publish(lost, live=False)
                pub.publish(live)
                await until(lambda: live in held(index), f"block {live} indexed")
                assert pub.requests == 1, "the replay endpoint was asked again, the live message held up meanwhile"
            events.resync("disconnected")        # what the monitor's disconnect does; the publisher goes on
            pub.publish(9)
            await until(lambda: 9 in held(index), "block 9 indexed")
            assert pub.requests == 1
            assert resyncs == ["gap", "gap", "disconnected"] and held(index) == {9}
            assert events.replays_unanswered == 1
        finally:
            await events.stop()

    with caplog.at_level(logging.INFO, logger="kvtier.router.events"):
        try:
            run(main)
        finally:
            pub.close()
    said = [r for r in caplog.records if "replay endpoint" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]


async def hole(pub: StandInPublisher, index: BlockIndex, lost: int, live: int) -> None:
    """Batch ``lost`` buffered only (lost on the way), then ``live`` sent, and indexed."""
    pub.publish(lost, live=False)
    pub.publish(live)
    await until(lambda: live in held(index), f"block {live} indexed")


def silent_listener(tmp_path, backoff_s: float):
    """A listener of a publisher whose replay endpoint does not answer yet, on a stepped clock:
    (publisher, resyncs, index, listener, clock)."""
    pub = StandInPublisher(tmp_path, answers=False)
    resyncs: list[str] = []
    index, events = listener(pub, resyncs)
    events.replay_timeout_s = 0.5
    events.replay_backoff_s = backoff_s
    clock = events.clock = SteppedClock()
    return pub, resyncs, index, events, clock


async def in_step_after_silence(pub: StandInPublisher, events: VllmEvents, index: BlockIndex, answers: bool) -> None:
    """Connected, its first replay unanswered; then (``answers``: the endpoint answering from now
    on) blocks 0-4 published and indexed."""
    await in_step(pub, events)
    await until(lambda: events.replays_unanswered == 1, "control: the connection's replay unanswered")
    pub.answers = answers
    for i in range(5):
        pub.publish(i)
    await until(lambda: held(index) == set(range(5)), "control: the listener is in step")


def test_a_replay_endpoint_silent_once_fills_holes_again_after_its_back_off(tmp_path):
    """a9 D2: the publisher's replay thread stalled past ``replay_timeout_s`` once (a GC or GIL pause
    in a busy engine core) and answered every request after that, but was never asked again on that
    connection, which lasts as long as the worker: every later hole its buffer held cleared the
    worker's entries. Now it rests for its back-off (10 s here): a hole meanwhile is a resync, the
    live message not held up; the first hole after it is filled from the buffer. An answer ends
    the doubling: the next silence rests it 10 s again, not 20."""
    pub, resyncs, index, events, clock = silent_listener(tmp_path, backoff_s=10.0)

    async def main():
        events.start()
        try:
            await in_step_after_silence(pub, events, index, answers=True)   # (the stall is over)
            await hole(pub, index, 5, 6)
            assert pub.requests == 1 and resyncs == ["gap"], "asked during its back-off, the live message held up"
            clock.now += 10.0
            await hole(pub, index, 7, 8)
            assert pub.requests == 2, "the replay endpoint was not asked again after its back-off"
            assert resyncs == ["gap"] and held(index) == {6, 7, 8}, "a hole the buffer held cleared the worker"
            pub.answers = False                          # silent again: rests 10 s (it answered since)
            await hole(pub, index, 9, 10)
            assert pub.requests == 3 and events.replays_unanswered == 2
            clock.now += 10.0
            await hole(pub, index, 11, 12)
            assert pub.requests == 4, "an endpoint that answered since its last silence rested longer"
            assert resyncs == ["gap"] * 3 and events.replays_unanswered == 3
        finally:
            await events.stop()

    try:
        run(main)
    finally:
        pub.close()


def test_a_replay_endpoint_that_stays_silent_rests_twice_as_long_up_to_five_minutes(tmp_path, caplog):
    """a9 D2: an endpoint that never answers (vLLM started without ``replay_endpoint``) is asked again
    after each back-off, each silence doubling the next (200 s, then 300 s: the 400 s past the 5
    minute cap), and the silence is logged once."""
    pub, resyncs, index, events, clock = silent_listener(tmp_path, backoff_s=200.0)

    async def main():
        events.start()
        try:
            await in_step_after_silence(pub, events, index, answers=False)
            clock.now += 200.0
            await hole(pub, index, 5, 6)
            assert pub.requests == 2, "not asked again after its back-off"
            clock.now += 299.0
            await hole(pub, index, 7, 8)
            assert pub.requests == 2, "asked again before its doubled back-off ended"
            clock.now += 1.0
            await hole(pub, index, 9, 10)
            assert pub.requests == 3, "its back-off grew past five minutes"
            assert resyncs == ["gap"] * 3 and held(index) == {10} and events.replays_unanswered == 3
        finally:
            await events.stop()

    with caplog.at_level(logging.INFO, logger="kvtier.router.events"):
        try:
            run(main)
        finally:
            pub.close()
    said = [r for r in caplog.records if "replay endpoint" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
