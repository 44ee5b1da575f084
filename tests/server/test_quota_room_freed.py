"""A tenant at its quota never takes another tenant's DRAM, and no upload waits for deletions.

A quota eviction leaves the index (and the charge) at once. Its DRAM was freed on an I/O thread:
in a fresh-clone CI run under load the I/O threads fell behind a tenant uploading small blocks at
its quota, the pool ran full and the reservation of its next block evicted the least recently
used blocks of the pool, another tenant's, for room its quota had already made ("acme keeps 2
tiny blocks, charged 8192 B, and evicted 2 of globex's 64 KiB blocks"). Uploads then waited for
those deletions, which let a one-page PUT wait behind every deletion queued with a disk tier, and
a PUT refused outright wait 7.5 s first (audit s29 a1 D2, D6). The DRAM is freed at once now, on
the event loop, and only the lower tiers' copies are deleted on the I/O threads.

The server here is the real one, run in this process so that its deletions can be slowed down
(the load CI had, a slow disk), over a real socket with the real client.
"""

from __future__ import annotations

import time

import pytest

from kvtier.tiers.base import Status
from tests.server.conftest import BLOCK, block, keys_for
from tests.server.inprocess import PAGE, POOL, InProcessServer

QUOTA = 64 * PAGE
SLOW_DELETE_S = 0.02  # per deletion: far behind an upload of one page


@pytest.fixture
def slow_server(tmp_path):
    srv = InProcessServer(tmp_path, {"acme": {"quota": QUOTA}})
    yield srv
    srv.stop()


def test_a_tenant_at_its_quota_waits_for_its_evictions_rather_than_evicting_others(slow_server):
    globex = slow_server.remote("globex")
    # globex holds all the pool but 96 pages: acme's quota (64 pages) fits, and 32 pages more
    # are free; past them, acme's uploads fit only if its evicted blocks' pages are free again.
    theirs = keys_for("globex-held", (POOL - 96 * PAGE) // BLOCK)
    assert set(globex.put_many(theirs, [block(k) for k in theirs])) == {Status.OK}
    ran = slow_server.slow_deletions(SLOW_DELETE_S)

    acme = slow_server.remote("acme")
    mine = keys_for("acme-small", 4 * QUOTA // PAGE)  # 4x its quota, a page each: 192 quota evictions
    for i in range(0, len(mine), 64):
        part = mine[i : i + 64]
        assert set(acme.put_many(part, [block(k, 512) for k in part])) == {Status.OK}

    # Positive control: the deletions lagged behind the uploads (the lag CI had): some were
    # still under way when the last upload was acknowledged, and they all run in the end.
    pending = len(mine) - QUOTA // PAGE - len(ran)
    assert pending > 0, f"the slowed deletions kept up with the uploads ({len(ran)} ran): no lag to test"
    deadline = time.monotonic() + 30
    while len(ran) < len(mine) - QUOTA // PAGE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ran) >= len(mine) - QUOTA // PAGE, len(ran)
    lost = len(theirs) - sum(globex.contains_many(theirs))
    assert lost == 0, f"acme, at its quota of {QUOTA // PAGE} pages, evicted {lost} of globex's blocks"
    held = sum(acme.contains_many(mine))
    assert 0 < held <= QUOTA // PAGE
    assert acme.server_stats()["charged_bytes"] == held * PAGE <= QUOTA
    # Control: the newest of acme's blocks read back intact.
    out = block(mine[-1], 512).copy()
    out[:] = 0
    assert acme.get(mine[-1], out) is Status.OK and (out == block(mine[-1], 512)).all()


def _disk(tmp_path, with_disk: bool) -> dict:
    return {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"} if with_disk else {}


def _acme_at_quota_behind_its_deletions(srv, slow_s: float):
    """globex holds all the pool but 80 pages; acme fills its quota with one-page blocks, then
    uploads a 16-page block: 16 quota evictions, whose deletions are slowed. Returns the two
    tenants' clients, globex's keys, and the deletions run."""
    globex = srv.remote("globex", timeout_s=30)
    theirs = keys_for("globex-held", (POOL - 80 * PAGE) // BLOCK)
    assert set(globex.put_many(theirs, [block(k) for k in theirs])) == {Status.OK}
    acme = srv.remote("acme", timeout_s=60)
    mine = keys_for("acme-small", QUOTA // PAGE)
    assert set(acme.put_many(mine, [block(k, 512) for k in mine])) == {Status.OK}
    ran = srv.slow_deletions(slow_s)
    big = keys_for("acme-big", 1)
    assert acme.put_many(big, [block(big[0])]) == [Status.OK]
    return {"acme": acme, "globex": globex}, theirs, ran


@pytest.mark.parametrize("who", ["acme", "globex"])
@pytest.mark.parametrize("with_disk", [False, True], ids=["dram", "disk"])
def test_a_put_into_a_full_pool_waits_for_no_deletion(tmp_path, with_disk, who):
    """Regression audits s28 R2, s29 a1 D2: a one-page PUT into a full pool waited for its tenant's
    deletions under way (16 slowed ones, 2 s, past its 1 s frame deadline); with a disk tier, even
    once the block fitted, its reservation went to the I/O threads whenever less than a whole
    max_block was free, behind every deletion queued: acme's and globex's PUTs alike (2.04 s)."""
    srv = InProcessServer(tmp_path, {"acme": {"quota": QUOTA}}, frame_timeout_s=1.0, **_disk(tmp_path, with_disk))
    try:
        clients, theirs, ran = _acme_at_quota_behind_its_deletions(srv, 0.25)
        # Positive control: the deletions of acme's 16 victims lag (their tiers' part, 4 s).
        assert len(ran) < 16, f"the deletions kept up ({len(ran)} ran): no lag to test"
        one = keys_for(f"{who}-one", 1)
        t0 = time.monotonic()
        got = clients[who].put_many(one, [block(one[0], 512)])
        took = time.monotonic() - t0
        assert got == [Status.OK] and took < 1.0, (f"{who}'s one-page PUT answered {got} after {took:.2f} s, "
                                                   f"behind {16 - len(ran)} deletions still under way")
        # (with DRAM only, a block evicted is lost: none is, for room the quota's evictions made)
        assert sum(clients["globex"].contains_many(theirs)) == len(theirs), "a block of globex's was evicted"
    finally:
        srv.stop()


def test_an_upload_that_must_evict_waits_for_no_deletion(tmp_path):
    """With a disk tier, a reservation that evicts (the eviction writes to disk) runs on the I/O
    threads: urgent, ahead of every deletion, on a thread deletions never all take. It queued
    behind every deletion (FIFO), 2 s here."""
    srv = InProcessServer(tmp_path, {"acme": {"quota": QUOTA}}, frame_timeout_s=1.0, **_disk(tmp_path, True))
    try:
        clients, theirs, ran = _acme_at_quota_behind_its_deletions(srv, 0.25)
        globex = clients["globex"]
        assert len(ran) < 16, f"the deletions kept up ({len(ran)} ran): no lag to test"
        evictions = srv.service.host.stats.evictions
        more = keys_for("globex-more", 2)
        took = []
        for key, nbytes in zip(more, (BLOCK, 512)):  # the pool's last 16 pages, then one more: it evicts
            t0 = time.monotonic()
            assert globex.put_many([key], [block(key, nbytes)]) == [Status.OK]
            took.append(time.monotonic() - t0)
        # Positive control: a reservation evicted (demoted to disk).
        assert srv.service.host.stats.evictions > evictions, "no reservation had to evict: nothing to test"
        assert max(took) < 1.0, f"globex's PUTs took {took} s behind {16 - len(ran)} deletions of acme's"
        assert sum(globex.contains_many(theirs + more)) == len(theirs) + 2  # (the evicted one is on disk)
    finally:
        srv.stop()


def test_a_tenant_at_its_quota_in_a_full_pool_evicts_its_own_block_not_anothers(tmp_path):
    """Audit s29 a1 D4: with no lag at all, the first upload of a tenant at its quota into a full pool
    had its reservation evict the pool's least recently used block, another tenant's, and then
    one of its own for the quota. The reservation evicts the quota's victims first now."""
    srv = InProcessServer(tmp_path, {"acme": {"quota": QUOTA}})
    try:
        globex, acme = srv.remote("globex"), srv.remote("acme")
        theirs = keys_for("globex", (POOL - QUOTA) // BLOCK)  # all the pool but acme's quota
        assert set(globex.put_many(theirs, [block(k) for k in theirs])) == {Status.OK}
        mine = keys_for("acme", QUOTA // PAGE)  # acme fills its quota: the pool is full
        assert set(acme.put_many(mine, [block(k, PAGE) for k in mine])) == {Status.OK}
        assert not srv.service.host.fits_now(PAGE), "the pool has room: nothing to test"
        more = keys_for("acme-more", 1)
        assert acme.put_many(more, [block(more[0], PAGE)]) == [Status.OK]
        lost = len(theirs) - sum(globex.contains_many(theirs))
        assert lost == 0, f"acme, at its quota, evicted {lost} of globex's blocks"
        held = acme.contains_many(mine + more)
        assert held == [False] + [True] * len(mine), "acme's least recently used block makes the room"
        assert acme.server_stats()["charged_bytes"] == QUOTA
        out = block(more[0], PAGE).copy()
        out[:] = 0
        assert acme.get(more[0], out) is Status.OK and (out == block(more[0], PAGE)).all()
    finally:
        srv.stop()


def test_a_put_refused_for_its_quota_is_answered_at_once(tmp_path):
    """Audit s29 a1 D6: a PUT of a block larger than its tenant's whole quota (refused FULL whatever
    happens) first waited a quarter of frame_timeout_s (7.5 s by default) for its tenant's
    deletions to make room it would never use."""
    srv = InProcessServer(tmp_path, {"acme": {"quota": QUOTA}}, max_block="1MiB")  # frame_timeout_s: 30 s
    try:
        clients, _, ran = _acme_at_quota_behind_its_deletions(srv, 1.0)
        assert len(ran) < 16, "the deletions kept up: no lag to test"
        huge = keys_for("acme-huge", 1)
        t0 = time.monotonic()
        got = clients["acme"].put_many(huge, [block(huge[0], 2 * QUOTA)])
        took = time.monotonic() - t0
        frame_timeout_s = srv.server.config.frame_timeout_s
        assert got == [Status.FULL] and took < frame_timeout_s / 8, f"refused after {took:.2f} s"
    finally:
        srv.stop()
