"""The router's shared-tier listener (kvtier/router/events.py ``SharedTierEvents``) against a real
kvtier events publisher that restarts (audit s32 a6 D2).

The listener hears from a restarted server only at its next renewal. When the new server's writes
meanwhile had brought its numbers up to the ones the listener expected, the renewal's SYNC looked
like continuity: the shared marks of the old server's tier (an in-memory tier, lost with it) were
kept, and every worker went on predicting those blocks as loadable."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import kvtier.server.events as server_events
from kvtier.router.events import SharedTierEvents
from kvtier.router.index import SHARED_BIT, BlockIndex, block_keys

BS = 4


@pytest.fixture
def subscribers(monkeypatch) -> list[server_events.EventSubscriber]:
    """The subscribers the listener builds, renewing only when the test lowers their ``renew_s``."""
    made = []
    real_init = server_events.EventSubscriber.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **{**kw, "renew_s": 60.0})
        made.append(self)

    monkeypatch.setattr(server_events.EventSubscriber, "__init__", init)
    return made


def _publisher(endpoint: str) -> server_events.EventPublisher:
    return server_events.EventPublisher(endpoint, name_key=b"k" * 32, batch_s=0.001)


def _emit_one(pub: server_events.EventPublisher) -> None:
    start = pub.seq
    pub.emit("stored", "disk", "acme", "ns", [os.urandom(32)], 100)
    deadline = time.monotonic() + 5
    while pub.seq == start:
        assert time.monotonic() < deadline, "the publisher did not publish"
        time.sleep(0.005)


async def _until(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


def test_a_restarted_server_whose_numbers_caught_up_clears_the_shared_marks(tmp_path, subscribers):
    endpoint = f"ipc://{tmp_path}/ev.sock"
    index = BlockIndex(BS)
    keys = block_keys([1, 2, 3, 4], BS)
    index.add_shared(keys)
    pubs = [_publisher(endpoint)]

    async def main():
        shared = SharedTierEvents(index, endpoint, asyncio.get_running_loop())
        shared.start()
        try:
            await _until(lambda: shared.up, "the listener hears the server")
            _emit_one(pubs[0])
            await _until(lambda: shared.messages == 1, "the first server's event")
            assert shared.resyncs == 0 and index.mask(keys[0]) & SHARED_BIT   # control: marks kept
            pubs[0].close()
            pubs.append(_publisher(endpoint))   # restarted, its tier empty
            _emit_one(pubs[1])                  # before the listener renews: its number 0, as the old one's
            assert pubs[1].seq == 1
            subscribers[-1].renew_s = 0.1
            await _until(lambda: shared.resyncs > 0, "the restart seen (the marks cleared)")
            await asyncio.sleep(0.05)   # the clear runs on this loop
            assert not index.mask(keys[0]) & SHARED_BIT, "the old tier's shared marks were kept"
            assert shared.up
        finally:
            await asyncio.to_thread(shared.stop)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        pubs[-1].close()
