"""A tenant at its quota never takes another tenant's DRAM while its own evictions are being freed.

A quota eviction leaves the index (and the charge) at once, but the block's DRAM is freed on an
I/O thread. In a fresh-clone CI run under load the I/O threads fell behind a tenant uploading
small blocks at its quota: the pool ran full and the reservation of its next block evicted the
least recently used blocks of the pool, another tenant's, for room its quota had already made
("acme keeps 2 tiny blocks, charged 8192 B, and evicted 2 of globex's 64 KiB blocks"). Uploads
now wait for the deletions of their tenant's blocks to have run.

The server here is the real one, run in this process so that a fault-injecting wrapper can slow
its deletions down (the load CI had), over a real socket with the real client.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvtier.server.config import load_config
from kvtier.server.launch import write_config
from kvtier.server.server import Server
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import BLOCK, block, keys_for
from tests.server.harness import SHARED, TOKENS, fresh_namespace, tenants

PAGE = 4096
POOL = 4 << 20
QUOTA = 64 * PAGE
SLOW_DELETE_S = 0.02  # per deletion: far behind an upload of one page


class _InProcessServer:
    """``kvtier serve`` on a thread of this process: its service stays reachable to wrap."""

    def __init__(self, tmp_path, quota: int, **server):
        path = str(tmp_path / "kvtier.toml")
        write_config(path, {"listen": ["tcp://127.0.0.1:0"], "capacity": POOL, "max_block": "256KiB", **server},
                     tenants(acme={"quota": quota}), SHARED, TOKENS["admin"])
        self.server = Server(load_config(path, env={}))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.addresses = await self.server.start()
            started.set()
            await self.server.serve_until_stopped()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(20), "the in-process server did not start"
        self.url = self.addresses["listen"][0]

    def slow_deletions(self, seconds: float) -> list[int]:
        service = self.server.service
        real = service._delete_from_tiers
        ran = []

        def slowly(skey, owner):
            time.sleep(seconds)
            ran.append(1)
            return real(skey, owner)

        service._delete_from_tiers = slowly
        return ran

    def remote(self, who: str) -> RemoteTier:
        return RemoteTier(self.url, TOKENS[who], namespace=fresh_namespace())

    def stop(self):
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(30)


@pytest.fixture
def slow_server(tmp_path):
    srv = _InProcessServer(tmp_path, QUOTA)
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


@pytest.fixture
def short_frames(tmp_path):
    srv = _InProcessServer(tmp_path, QUOTA, frame_timeout_s=1.0)
    yield srv
    srv.stop()


def test_a_put_waits_only_until_its_block_fits_not_for_every_deletion(short_frames):
    """Regression audit s28 R2: a PUT into a full pool waited for every deletion under way of its
    tenant's blocks, however little room it needed: 16 slowed deletions (2 s) behind a one-page
    PUT whose frame deadline is 1 s, and the PUT failed. It waits only until its block fits."""
    slow = 0.25
    globex = short_frames.remote("globex")
    theirs = keys_for("globex-held", (POOL - 80 * PAGE) // BLOCK)  # all the pool but 80 pages
    assert set(globex.put_many(theirs, [block(k) for k in theirs])) == {Status.OK}
    acme = short_frames.remote("acme")
    mine = keys_for("acme-small", QUOTA // PAGE)  # acme at its quota, a page each
    assert set(acme.put_many(mine, [block(k, 512) for k in mine])) == {Status.OK}
    ran = short_frames.slow_deletions(slow)
    big = keys_for("acme-big", 1)
    assert acme.put_many(big, [block(big[0])]) == [Status.OK]  # 16 pages: 16 quota evictions
    service = short_frames.server.service
    # Positive control: the deletions lag and the pool has no room for one more page.
    assert len(service._freeing.get("acme", ())) >= 8 and not service.host.fits_now(512), "no lag to test"

    one = keys_for("acme-one", 1)
    t0 = time.monotonic()
    got = acme.put_many(one, [block(one[0], 512)])
    took = time.monotonic() - t0
    assert got == [Status.OK] and took < 1.0, (f"a one-page PUT answered {got} after {took:.2f} s, behind "
                                               f"{len(ran)} of its tenant's deletions")
    assert sum(globex.contains_many(theirs)) == len(theirs), "the wait's purpose: no other tenant's block lost"
