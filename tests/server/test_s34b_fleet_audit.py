"""The fleet audit's three defects (audit s34 r6; kvtier/server/fleet.py).

* D1: FleetPresence took a lookup that was never sent (the tier down: all False) for the fleet's
  answer when the health check that very lookup started ended the outage before ``available`` was
  read: the audit then dropped, and deleted from the fleet, blocks it held. Forced here with a
  real Mooncake master frozen and woken, and a wrapper that returns the lookup only once the
  health check has ended (the interleave a loaded server meets now and then).
* D2: erase_unindexed_records deleted, and forgot the new record of, a block put again after the
  erasure and demoted to the fleet while the walk and the batches' deletes ran.
* D3: a pass of the audit took len(index) / 4096 sweeps, whatever fleet_audit_interval_s said.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

import kvtier.server.fleet as fleet_module
from kvtier.server.fleet import FleetAudit, FleetPresence, FleetRecords, JournaledFleet
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.tiers.base import Status
from tests.polling import wait_until
from tests.server.test_fleet_journal import CODEC, NBYTES, StandInFleet, _entry
from tests.tiers.mooncake_harness import make_tier, mooncake_available

needs_mooncake = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


# -- D1 ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def own_cluster():
    """A master of this module's own, frozen by its tests (the engine's default client_ttl: the
    holders' segments outlive a short freeze)."""
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    cluster = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield cluster
    cluster.stop()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


#: the fleet tiers' backoff after a failure (at most: it doubles up to max_backoff_s)
BACKOFF_S = 0.3


def _outage_over_backoff(cluster, tier, keys) -> None:
    """Take ``tier`` down the way a frozen master does (its lookup overruns), then wake the master
    and let the backoff run out: the next call starts the health check that ends the outage."""
    os.killpg(cluster.master.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: _stopped(cluster.master.pid), 5.0)
        assert tier.contains_many(keys) == [False] * len(keys)  # overruns: down, backing off
    finally:
        os.killpg(cluster.master.pid, signal.SIGCONT)
    assert not tier.available
    time.sleep(BACKOFF_S + 0.1)  # (the backoff over: no call has started the health check yet)
    assert not tier.available


class LookupOutlivedByHealthCheck:
    """The fleet tier as FleetPresence asks it, its lookups handed back only once the tier is up
    again: the health check a refused lookup starts has ended the outage by the time the caller
    reads ``available``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def contains_many(self, keys):
        held = self.inner.contains_many(keys)
        assert wait_until(lambda: self.inner.available, 10.0), "the health check never ended the outage"
        return held

    @property
    def available(self) -> bool:
        return self.inner.available


@needs_mooncake
def test_a_lookup_never_sent_is_no_answer_though_the_outage_ended_before_it_was_judged(own_cluster):
    tier = make_tier(own_cluster, timeout_s=0.5, backoff_s=BACKOFF_S, max_backoff_s=BACKOFF_S)
    presence = FleetPresence(LookupOutlivedByHealthCheck(tier))
    keys = [os.urandom(32) for _ in range(8)]
    try:
        assert tier.put_many(keys, [np.full(4096, 7, np.uint8) for _ in keys]) == [Status.OK] * 8
        _outage_over_backoff(own_cluster, tier, keys)
        held = asyncio.run(presence.held(keys))
        assert tier.available and tier.contains_many(keys) == [True] * 8  # (the fleet holds them all)
        assert held is None, f"a lookup never sent was taken for the fleet's answer: {held}"
        assert asyncio.run(presence.held(keys)) == [True] * 8  # and, up, the fleet's word is taken
    finally:
        presence.close()
        tier.close()


@needs_mooncake
def test_the_fleet_tier_tells_which_lookups_it_did_not_answer(own_cluster):
    from kvtier.tiers.mooncake import unanswered_lookups  # (imported here: the other tests run on older trees)

    tier = make_tier(own_cluster, timeout_s=0.5, backoff_s=BACKOFF_S, max_backoff_s=BACKOFF_S)
    keys = [os.urandom(32) for _ in range(3)]
    try:
        assert tier.put_many(keys, [np.full(4096, 7, np.uint8) for _ in keys]) == [Status.OK] * 3
        with unanswered_lookups() as unanswered:
            assert tier.contains_many(keys) == [True] * 3
            assert tier.contains(os.urandom(32)) is False  # (a miss the fleet answered)
        assert unanswered == []
        _outage_over_backoff(own_cluster, tier, keys)
        with unanswered_lookups() as unanswered:
            assert tier.contains_many(keys) == [False] * 3  # refused: the health check only begins
        assert unanswered == [3]
    finally:
        tier.close()


# -- D2 ---------------------------------------------------------------------------------------------
def _erasable_fleet(tmp_path) -> tuple[JournaledFleet, BlockIndex]:
    index = BlockIndex()
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    tombstones = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())
    return JournaledFleet(StandInFleet(journal), journal, FleetRecords(index, CODEC), tombstones=tombstones), index


def _placed_then_let_go(fleet: JournaledFleet, index: BlockIndex, i: int) -> bytes:
    """A block of acme/chat placed in the fleet that the index let go (a demotion answered in error
    that landed all the same): its record stays, for erase_unindexed_records."""
    skey, entry = _entry("acme", "chat", i, created=time.monotonic() - 5)
    index.add(skey, entry)
    assert fleet.put_many([skey], [np.full(NBYTES, i, np.uint8)]) == [Status.OK]
    index.remove(skey)
    return skey


def _put_again_and_demoted(fleet: JournaledFleet, index: BlockIndex, skey: bytes, i: int) -> None:
    """The tenant puts the same block again (after the erasure) and it is demoted into the fleet."""
    _, entry = _entry("acme", "chat", i)
    index.add(skey, entry)
    index.set_tier(skey, fleet.name)
    assert fleet.put_many([skey], [np.full(NBYTES, i, np.uint8)]) == [Status.OK]


def _erase_chat(fleet: JournaledFleet) -> None:
    fleet.record_erasure("acme", "chat", None, time.time())
    time.sleep(0.05)  # (a block put again from now on is newer than the erasure)


def _assert_kept(fleet: JournaledFleet, index: BlockIndex, skey: bytes) -> None:
    assert index.get(skey).tier == fleet.name
    assert fleet.contains(skey), "the block put (and acknowledged) after the erasure was deleted from the fleet"
    assert skey in dict(fleet.journal.records()), "the new placement's record was forgotten"


def test_a_block_put_again_while_the_walk_runs_is_not_erased(tmp_path):
    fleet, index = _erasable_fleet(tmp_path)
    again, gone = _placed_then_let_go(fleet, index, 1), _placed_then_let_go(fleet, index, 2)
    _erase_chat(fleet)
    walked = fleet.records.indexed

    def indexed_then_put_again(name: bytes) -> bool:  # the walk judges it unindexed, then the put comes
        unindexed = walked(name)
        if name == again and index.get(again) is None:
            _put_again_and_demoted(fleet, index, again, 1)
        return unindexed
    fleet.records.indexed = indexed_then_put_again
    erased = fleet.erase_unindexed_records()
    _assert_kept(fleet, index, again)
    assert erased == 1
    assert not fleet.contains(gone) and gone not in dict(fleet.journal.records())  # (the erasure's own)


def test_a_block_put_again_while_an_earlier_batch_is_deleted_is_not_erased(tmp_path, monkeypatch):
    fleet, index = _erasable_fleet(tmp_path)
    first, again = _placed_then_let_go(fleet, index, 1), _placed_then_let_go(fleet, index, 2)
    _erase_chat(fleet)
    monkeypatch.setattr(fleet_module, "BATCH", 1)  # (4096: one batch a name, without 4096 blocks)
    deleting = fleet.inner.delete

    def delete_then_put_again(key) -> bool:  # the first batch's fleet call; meanwhile the re-put
        removed = deleting(key)
        if key == first:
            _put_again_and_demoted(fleet, index, again, 2)
        return removed
    fleet.inner.delete = delete_then_put_again
    erased = fleet.erase_unindexed_records()
    _assert_kept(fleet, index, again)
    assert erased == 1


# -- D3 ---------------------------------------------------------------------------------------------
def _indexed_at(index: BlockIndex, tier: str, n: int) -> list[bytes]:
    skeys = [os.urandom(32) for _ in range(n)]
    for skey in skeys:
        index.add(skey, BlockEntry("acme", "chat", skey, NBYTES, b"", time.monotonic(), tier=tier))
    return skeys


def _sweeps_for_a_pass(audit: FleetAudit) -> tuple[int, list[bytes]]:
    seen: list[bytes] = []
    sweeps = 0
    while (part := audit.next_slice()) or not sweeps:
        sweeps += 1
        seen += part
    return sweeps, seen


def test_a_pass_over_a_large_index_spans_about_the_audit_interval():
    index = BlockIndex()
    at_fleet = _indexed_at(index, "mooncake", 240_000)
    _indexed_at(index, "host", 100_000)  # (not the fleet's: not looked at, nor counted in the pass)
    audit = FleetAudit(index, "mooncake", pass_interval_s=30.0, sweep_interval_s=1.0)
    sweeps, seen = _sweeps_for_a_pass(audit)
    assert sorted(seen) == sorted(at_fleet), "a pass looks at each key at the fleet once, and only those"
    assert 25 <= sweeps <= 30, f"a pass of 30 s at a sweep a second took {sweeps} sweeps"
    assert audit.next_slice() == []  # (the next pass begins 30 s after this one)


def test_a_small_index_is_one_sweep_and_a_huge_one_a_bounded_slice_a_sweep():
    index = BlockIndex()
    _indexed_at(index, "mooncake", 10)
    sweeps, seen = _sweeps_for_a_pass(FleetAudit(index, "mooncake", pass_interval_s=30.0, sweep_interval_s=1.0))
    assert (sweeps, len(seen)) == (1, 10)
    _indexed_at(index, "mooncake", 4 * FleetAudit.MAX_PER_SWEEP - 10)
    audit = FleetAudit(index, "mooncake", pass_interval_s=30.0, sweep_interval_s=10.0)  # (3 sweeps a pass)
    assert _sweeps_for_a_pass(audit)[0] == 4  # (bounded a sweep: the pass takes longer)
    fast = FleetAudit(index, "mooncake", pass_interval_s=1.0, sweep_interval_s=1.0)  # (one sweep a pass)
    assert len(fast.next_slice()) == FleetAudit.MAX_PER_SWEEP, "one sweep was left a whole huge index"
