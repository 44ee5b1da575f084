"""The router's event listeners (kvtier/router/events.py): what they do with holes in a worker's
stream (a message or event that cannot be applied), with a replay buffer that no longer starts at
0, and with a restarted kvtier server. Sequence gaps and publisher restarts: test_index.py."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time

import msgpack
import zmq
import zmq.asyncio

from kvtier.router.events import SharedTierEvents, VllmEvents
from kvtier.router.index import SHARED_BIT, BlockIndex, block_keys
from kvtier.router.workers import Worker

BS = 4
TOKENS = list(range(100, 100 + 2 * BS))
OTHER = [7] * BS


def message(seq, events):
    return [b"", struct.pack(">Q", seq), msgpack.packb([1.0, events, None])]


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


def listener(resyncs: list | None = None) -> tuple[BlockIndex, VllmEvents]:
    index = BlockIndex(BS)
    on_resync = (lambda w, reason: resyncs.append(reason)) if resyncs is not None else None
    return index, VllmEvents(Worker(0, "http://w0"), index, on_resync=on_resync)


def test_an_event_that_cannot_be_applied_is_a_hole_and_the_rest_of_its_batch_applies():
    """One try around the whole batch: an event that raised skipped every later one (a
    BlockRemoved: its blocks stayed credited), and next_seq had advanced, so nothing resynced."""
    reasons: list[str] = []
    index, events = listener(reasons)
    events.handle(message(0, [stored([11, 12], None, TOKENS)]))
    assert len(index.masks(block_keys(TOKENS, BS))) == 2                     # control
    bad = stored([[1]], None, [1] * BS)            # an unhashable block hash: TypeError in the index
    events.handle(message(1, [bad, {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "GPU"},
                              stored([21], None, OTHER)]))
    assert reasons == ["malformed"] and index.masks(block_keys(TOKENS, BS)) == []
    assert len(index.masks(block_keys(OTHER, BS))) == 1                       # the events after it apply
    events.handle(message(2, [stored([22], 21, OTHER)]))                      # the sequence goes on
    assert reasons == ["malformed"] and len(index.masks(block_keys(OTHER * 2, BS))) == 2


def test_an_undecodable_message_is_a_hole():
    """Skipped after next_seq advanced, whatever it said (removals included) was lost, yet the
    index kept what came before it."""
    reasons: list[str] = []
    index, events = listener(reasons)
    events.handle(message(0, [stored([11, 12], None, TOKENS)]))
    events.handle([b"", struct.pack(">Q", 1), b"\xc1"])          # e.g. the removal of 11, 12
    assert reasons == ["malformed"] and index.masks(block_keys(TOKENS, BS)) == []
    events.handle(message(2, [stored([21], None, OTHER)]))
    assert reasons == ["malformed"] and len(index.masks(block_keys(OTHER, BS))) == 1


def _serve_replay(endpoint: str, buffer: list[tuple[int, bytes]], requests: int = 1) -> threading.Thread:
    """A stand-in for vLLM's ZmqEventPublisher._service_replay (its frames), for ``requests`` asks."""
    def serve():
        sync = zmq.Context()
        router = sync.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        ready.set()
        try:
            for _ in range(requests):
                if not router.poll(5000):
                    return
                client, _, start = router.recv_multipart()
                start = int.from_bytes(start, "big")
                for seq, buf in buffer:
                    if seq >= start:
                        router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), buf])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        finally:
            router.close(0)
            sync.term()

    ready = threading.Event()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(5)
    return thread


def test_a_listener_without_state_replays_a_buffer_that_no_longer_starts_at_zero(tmp_path):
    """vLLM keeps its last buffer_steps batches: a router started next to a worker that had
    published more asked from 0, refused the buffer's first batch and started blind. With state
    (a gap to fill), a buffer that lost the batches needed is still refused."""
    endpoint = f"ipc://{tmp_path}/replay.sock"
    buffer = [(500, msgpack.packb([1.0, [stored([11, 12], None, TOKENS)], None])),
              (501, msgpack.packb([1.0, [], None]))]
    thread = _serve_replay(endpoint, buffer, requests=2)
    index = BlockIndex(BS)
    events = VllmEvents(Worker(0, "http://w0", "ipc:///unused", endpoint), index)

    async def main():
        ctx = zmq.asyncio.Context.instance()
        await events._replay(ctx, 0, timeout_s=5.0)
        assert events.replayed == 2 and events.next_seq == 502
        assert len(index.masks(block_keys(TOKENS, BS))) == 2
        events.next_seq = 400          # control: a gap from 400 that the buffer cannot fill
        await events._replay(ctx, 400, upto=600, timeout_s=5.0)
        assert events.replayed == 2

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        thread.join(5)


def test_a_restarted_shared_tier_server_clears_the_shared_marks(tmp_path):
    """A restarted kvtier server numbers from 0 again: its first messages go back, which counted
    as no gap, so every block marked shared before the restart (an in-memory tier lost them) stayed
    predicted as loadable by every worker."""
    from kvtier.server.events import EventPublisher

    endpoint = f"ipc://{tmp_path}/ev.sock"
    index = BlockIndex(BS)
    keys = block_keys(TOKENS, BS)
    index.add_shared(keys)

    async def until(cond, what, timeout=15.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}"
            await asyncio.sleep(0.05)

    async def main():
        pub = EventPublisher(endpoint, name_key=os.urandom(32), batch_s=0.01)
        shared = SharedTierEvents(index, endpoint, asyncio.get_running_loop())
        shared.start()
        try:
            for i in range(3):
                await until(lambda: shared.up, "subscribed")
                pub.emit("stored", "dram", "t", "ns", [os.urandom(8)], 1)
                await until(lambda: shared.messages >= i + 1, f"message {i}")
            assert index.mask(keys[0]) & SHARED_BIT and shared.resyncs == 0     # control: no clear so far
            pub.close()
            pub = EventPublisher(endpoint, name_key=os.urandom(32), batch_s=0.01)   # restarted: seq from 0
            # the subscriber renews its SUB every 5 s; the new server's SYNC (0) goes back
            await until(lambda: shared.resyncs >= 1, "the restart seen", timeout=20.0)
            await asyncio.sleep(0.2)
            assert not index.mask(keys[0]) & SHARED_BIT
        finally:
            pub.close()
            await asyncio.to_thread(shared.stop)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_late_listener_replays_a_buffer_longer_than_the_publishers_send_limit(tmp_path):
    """vLLM's publisher (the real one) answers a replay with its whole buffer at once, with no flow
    control: past the ROUTER's send high-water mark (1,000 messages) it drops the rest, end marker
    included. A router started next to a worker of 2,500 batches replayed the oldest 1,000 and
    none of the newest (the blocks the worker holds now). Control: every batch's block is indexed."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    n = 2500
    endpoint = f"ipc://{tmp_path}/pub.sock"
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=f"ipc://{tmp_path}/replay.sock",
                                  buffer_steps=10_000)
    seqs = [[100_000 + i] * BS for i in range(n)]  # one block of its own per batch
    try:
        for i, toks in enumerate(seqs):
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[i + 1], parent_block_hash=None, token_ids=toks, block_size=BS, lora_id=None,
                medium="GPU", lora_name=None)]))
        deadline = time.monotonic() + 20
        while len(publisher._buffer) < n and time.monotonic() < deadline:
            time.sleep(0.05)  # (its thread sends and buffers them)
        assert len(publisher._buffer) == n
        index = BlockIndex(BS)
        events = VllmEvents(Worker(0, "http://w0", endpoint, f"ipc://{tmp_path}/replay.sock"), index)

        async def main():
            await events._replay(zmq.asyncio.Context.instance(), 0, timeout_s=5.0)

        asyncio.run(asyncio.wait_for(main(), 60))
        assert events.replayed == n and events.next_seq == n, (events.replayed, events.next_seq)
        assert len(index.masks(block_keys(seqs[0], BS))) == 1          # the oldest
        assert len(index.masks(block_keys(seqs[-1], BS))) == 1, "the newest batches were never replayed"
    finally:
        publisher.shutdown()


def test_an_orphan_the_worker_removed_before_its_parent_came_is_not_credited(tmp_path):
    """Through vLLM's own publisher. The worker holds block P from before the router listened (or
    before a resync cleared it). It stores C (child of P): C waits as an orphan. vLLM evicts C (its
    BlockRemoved was ignored: an unknown hash), then evicts and recomputes P, publishing P again.
    P's arrival credited C although the worker had removed it, and vLLM never sends C's removal
    again: the stale credit stayed until the LRU or a resync dropped it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    p_tokens, c_tokens = TOKENS[:BS], TOKENS[BS:]
    p, c = 11, 12

    def store(h, parent, toks):
        return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=toks, block_size=BS,
                           lora_id=None, medium="GPU", lora_name=None)

    endpoint = f"ipc://{tmp_path}/w0.events"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=None, buffer_steps=100)
    index = BlockIndex(BS)
    worker = Worker(0, "http://w0", endpoint)
    events = VllmEvents(worker, index)
    keys = block_keys(TOKENS, BS)

    async def until(cond, what, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}"
            await asyncio.sleep(0.02)

    async def main():
        pub.publish(KVEventBatch(ts=time.time(), events=[store(p, None, p_tokens)]))   # before we listen
        await until(lambda: len(pub._buffer) == 1, "P sent")          # (its thread sends and buffers it)
        events.start()
        try:
            await until(lambda: worker.events_up, "connected")
            while events.messages == 0:      # (slow joiner: publish empty batches until one arrives)
                pub.publish(KVEventBatch(ts=time.time(), events=[]))
                await asyncio.sleep(0.05)
            assert index.masks(keys) == []                                     # control: P unknown
            base = events.messages
            for batch in ([store(c, p, c_tokens)],                                   # an orphan
                          [BlockRemoved(block_hashes=[c], medium="GPU")],             # evicted
                          [BlockRemoved(block_hashes=[p], medium="GPU")],             # the parent evicted
                          [store(p, None, p_tokens)]):                                # and recomputed
                pub.publish(KVEventBatch(ts=time.time(), events=batch))
            await until(lambda: events.messages >= base + 4, "the four batches")
            assert index.masks(keys[:1]) != [], "control: P is indexed"
            assert len(index.masks(keys)) == 1, "C was credited after the worker removed it"
            assert events.resyncs == 0
            index.check_integrity()
        finally:
            await events.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        pub.shutdown()


def test_a_listener_cleared_by_a_disconnect_rebuilds_the_whole_index_from_the_buffer(tmp_path):
    """Through vLLM's own publisher. A worker's event connection drops for a moment (a heartbeat
    missed on a loaded host) and the publisher goes on: the listener clears the worker's entries
    (``resync("disconnected")``), and the next live message, queued before the reconnect was
    announced, set the sequence going again. The index then started from the middle of the
    stream: every block the worker held from before was lost (a router in CI held 305 of a
    worker's 646 blocks, and a late router caught up to more than the one that listened all
    along). A message after a resync now replays the buffer before it first."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    endpoint, replay = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=100)
    blocks = [[300 + i] * BS for i in range(6)]

    def publish(i):
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[i + 1], parent_block_hash=None, token_ids=blocks[i], block_size=BS, lora_id=None,
            medium="GPU", lora_name=None)]))

    def held(i):
        return bool(index.masks(block_keys(blocks[i], BS)))

    index = BlockIndex(BS)
    resyncs: list[str] = []
    events = VllmEvents(Worker(0, "http://w0", endpoint, replay), index,
                        on_resync=lambda w, reason: resyncs.append(reason))

    async def until(cond, what):
        deadline = time.monotonic() + 15
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def main():
        events.start()
        try:
            for i in range(5):
                publish(i)
            await until(lambda: all(held(i) for i in range(5)), "control: the first five blocks were indexed")
            events.resync("disconnected")   # what the monitor's DISCONNECTED does; the publisher goes on
            assert not any(held(i) for i in range(5))
            publish(5)
            await until(lambda: held(5), "the block published after the resync was never indexed")
            lost = [i for i in range(5) if not held(i)]
            assert not lost, f"blocks {lost}, held by the worker from before the resync, were never indexed again"
        finally:
            await events.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        publisher.shutdown()
    assert resyncs == ["disconnected"]
