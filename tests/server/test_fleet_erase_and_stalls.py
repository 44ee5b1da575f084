"""``kvtier serve`` over a Mooncake fleet, where the fleet is slow, frozen or hiccups: an erase leaves
no readable copy in the fleet, and no tenant's request waits on a fleet call made for another.
Real processes: mooncake_master, a segment holder, the kvtier server, clients over TCP; a fleet
client with the fleet's secret plays any other server of the fleet."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.auth import KeySpace
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.mooncake_launch import MooncakeCluster
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

SLOT = 64 * 1024
SECRET = b"f" * 32


@pytest.fixture(scope="module")
def cluster():
    # Its own, as tests here freeze its master; with the engine's default client_ttl (10 s): under
    # load a frozen master woke to find the holder's heartbeats late and dropped its segment.
    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def _serve(tmp_path, cluster, acme=None, **server):
    (tmp_path / "srv").mkdir(exist_ok=True)
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return ServerProcess.start(
        tenants(**({"acme": acme} if acme else {})), shared=SHARED, admin_token=TOKENS["admin"],
        workdir=str(tmp_path / "srv"),
        server={"capacity": 4 * SLOT, "max_block": SLOT, "mooncake_master": cluster.master_address,
                "mooncake_metadata": cluster.metadata_url, "mooncake_secret_file": str(secret), **server})


def _readable_in_fleet(cluster, ns: str, keys) -> list[bool]:
    """Which of acme's blocks in ``ns`` any fleet client with the fleet's secret reads whole."""
    reader = make_tier(cluster, tenant="kvtier-serve", secret=SECRET)
    try:
        space = KeySpace.of("acme", ns)
        found = []
        for k in keys:
            out = np.zeros(SLOT, np.uint8)
            found.append(reader.get(space.storage_key(k), out) is Status.OK and np.array_equal(out, block(k, SLOT)))
        return found
    finally:
        reader.close()


def _frozen_while(cluster, background, probe, hold_s: float = 0.0) -> float:
    """Freeze the master, start ``background`` on a thread, time ``probe`` on this one; thaw once
    ``background`` ended and ``hold_s`` passed (past the tier's deadline: its calls fail)."""
    os.killpg(cluster.master.pid, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        t = threading.Thread(target=background)
        t.start()
        time.sleep(0.3)
        start = time.monotonic()
        probe()
        took = time.monotonic() - start
        t.join(10)
        time.sleep(max(0.0, frozen + hold_s - time.monotonic()))
    finally:
        os.killpg(cluster.master.pid, signal.SIGCONT)
    return took


# -- erasure -----------------------------------------------------------------------------------------
def test_an_erase_right_after_a_read_leaves_no_copy_in_the_fleet(tmp_path, cluster):
    """The server's own read of a spilled block makes the engine grant a lease that refuses a plain
    remove: the erase was acknowledged while every other server of the fleet read the block whole."""
    with _serve(tmp_path, cluster, mooncake_timeout_s=1.0) as srv:
        acme = remote(srv, "acme", namespace="leased")
        try:
            keys = keys_for("leased", 12)
            assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12  # 8 spill
            assert sum(_readable_in_fleet(cluster, "leased", keys)) >= 8  # control: the fleet holds them
            outs = [np.zeros(SLOT, np.uint8) for _ in keys]
            assert acme.get_many(keys[:4], outs[:4]) == [Status.OK] * 4  # read back from the fleet: leased
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
            assert reply["ok"] and reply["erased"] == 12
            assert acme.get_many(keys, outs) == [Status.MISS] * 12
            left = _readable_in_fleet(cluster, "leased", keys)
            assert not any(left), f"{sum(left)} erased blocks are still readable whole from the fleet"
        finally:
            acme.close()


def test_a_read_during_a_fleet_hiccup_keeps_the_block_indexed_and_erasable(tmp_path, cluster):
    """A fleet that does not answer is an ERROR, not a MISS: dropping the index entry then orphaned
    the fleet's copy (an erase of the tenant could no longer reach it) and lost it to its tenant."""
    with _serve(tmp_path, cluster, mooncake_timeout_s=0.5) as srv:
        acme = remote(srv, "acme", namespace="hiccup")
        try:
            keys = keys_for("hiccup", 12)
            assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
            spilled = keys[:8]  # DRAM holds 4 blocks: the 8 oldest went to the fleet
            os.killpg(cluster.master.pid, signal.SIGSTOP)
            try:
                statuses = acme.get_many(spilled, [np.zeros(SLOT, np.uint8) for _ in spilled])
                assert Status.OK not in statuses  # the fleet does not answer: misses, as they should be
            finally:
                os.killpg(cluster.master.pid, signal.SIGCONT)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # the fleet is back once the tier's backoff is over
                outs = [np.full(SLOT, 0xA5, np.uint8) for _ in spilled]
                after = acme.get_many(spilled, outs)
                if after == [Status.OK] * 8:
                    break
                time.sleep(0.5)
            assert after == [Status.OK] * 8, f"after the hiccup the server answered {[s.name for s in after]}\n{srv.log()[-3000:]}"
            assert all(np.array_equal(o, block(k, SLOT)) for o, k in zip(outs, spilled))
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
            assert reply["ok"] and reply["erased"] == 12
            assert not any(_readable_in_fleet(cluster, "hiccup", spilled))
        finally:
            acme.close()


# -- one tenant's fleet calls never stall another's requests ------------------------------------------
def test_an_expiring_block_on_a_frozen_fleet_does_not_stall_other_tenants(tmp_path, cluster):
    with _serve(tmp_path, cluster, acme={"namespace_ttl_s": {"scratch": 0.5}}, sweep_interval_s=3600,
                mooncake_timeout_s=2.0) as srv:
        acme, globex = remote(srv, "acme", namespace="scratch"), remote(srv, "globex", namespace="other")
        try:
            mine, theirs = keys_for("expiring", 1), keys_for("globex", 1)
            assert acme.put(mine[0], block(mine[0], SLOT)) is Status.OK
            assert globex.put(theirs[0], block(theirs[0], SLOT)) is Status.OK
            time.sleep(0.8)  # acme's block expired (the sweeper is not due for an hour): a lookup drops it
            took = _frozen_while(cluster, lambda: acme.contains(mine[0]), lambda: globex.contains(theirs[0]))
            assert took < 0.5, f"globex's CONTAINS took {took:.2f} s: the event loop waited on the frozen fleet"
            assert not acme.contains(mine[0]) and globex.contains(theirs[0])
        finally:
            acme.close()
            globex.close()


def test_evicting_a_block_the_fleet_holds_does_not_stall_reads_of_dram_blocks(tmp_path, cluster):
    """Where an evicted block went was asked of the fleet under the DRAM tier's lock, which every GET
    of a DRAM block (on the event loop) takes. The block evicted here is one the fleet holds already
    (promoted from it, so its eviction copies nothing): only that question touches the fleet.
    (Left as designed: a block the fleet does not hold yet is copied down under that lock.)"""
    with _serve(tmp_path, cluster, mooncake_timeout_s=2.0) as srv:
        acme, globex = remote(srv, "acme", namespace="fill"), remote(srv, "globex", namespace="other")
        try:
            fill = keys_for("fill", 5)
            out = np.zeros(SLOT, np.uint8)
            assert acme.put_many(fill, [block(k, SLOT) for k in fill]) == [Status.OK] * 5  # fill[0] → the fleet
            assert acme.get(fill[0], out) is Status.OK  # promoted back (fill[1] goes down), clean
            for k in fill[2:]:
                assert acme.get(k, out) is Status.OK  # DRAM hits: fill[0] is now the oldest
            hot = keys_for("globex-hot", 1)[0]
            took = _frozen_while(cluster, lambda: globex.put(hot, block(hot, SLOT)),  # evicts fill[0]
                                 lambda: acme.get(fill[4], out), hold_s=3.0)
            assert took < 0.5, f"a GET of a DRAM block took {took:.2f} s: the DRAM lock was held over a fleet call"
            assert np.array_equal(out, block(fill[4], SLOT))
            # Once the fleet answers again every block is served: the evicted one from the fleet. (A
            # lookup the frozen fleet could not answer once made the index forget it: lost for good.)
            deadline = time.monotonic() + 10
            while acme.get(fill[0], out) is not Status.OK and time.monotonic() < deadline:
                time.sleep(0.3)
            assert np.array_equal(out, block(fill[0], SLOT)), "the block evicted during the freeze was lost"
            for k in fill[1:]:
                assert acme.get(k, out) is Status.OK and np.array_equal(out, block(k, SLOT))
        finally:
            acme.close()
            globex.close()
