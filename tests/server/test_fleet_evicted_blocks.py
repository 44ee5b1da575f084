"""``kvtier serve`` over a Mooncake fleet that evicts on its own (above ~90 % fill): the server's index
entries at the fleet are claims the fleet confirms, never facts. A PUT of a block the fleet dropped
stores it (content-addressed dedup once answered OK and stored nothing), and LOOKUP / CONTAINS no
longer promise it; a block the fleet still holds is deduplicated as before.

Real processes: a private mooncake_master (short leases, so that eviction can act within a test), one
32 MiB holder, the kvtier server, a RemoteTier client, and a second fleet client filling the fleet.
(s27 Mooncake audit, D1.)"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.auth import KeySpace
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

SLOT = 128 * 1024
SECRET = b"e" * 32


@pytest.fixture
def small_fleet():
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    cluster = MooncakeCluster.start(holders=1, segment_bytes=32 << 20,
                                    master_flags=["--client_ttl=3", "--default_kv_lease_ttl=200"])
    try:
        yield cluster
    finally:
        cluster.stop()


def _serve(tmp_path, fleet, **server) -> ServerProcess:
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    (tmp_path / "srv").mkdir()
    return ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path / "srv"),
                               server={"capacity": 4 * SLOT, "max_block": SLOT,
                                       "mooncake_master": fleet.master_address,
                                       "mooncake_metadata": fleet.metadata_url, "mooncake_secret_file": str(secret),
                                       **server})


def _fill_fleet(cluster) -> None:
    """Another fleet client (another tenant) writes twice the fleet's memory: Mooncake evicts."""
    other = make_tier(cluster, tenant="filler")
    try:
        for r in range(16):
            keys = [os.urandom(32) for _ in range(4)]
            other.put_many(keys, [np.full(1 << 20, r, np.uint8) for _ in keys])
            time.sleep(0.05)
    finally:
        other.close()


def _in_fleet(cluster, ns: str, keys) -> list[bool]:
    """Which of acme's blocks the fleet holds (asked as any server of the fleet would)."""
    reader = make_tier(cluster, tenant="kvtier-serve", secret=SECRET)
    try:
        return reader.contains_many([KeySpace.of("acme", ns).storage_key(k) for k in keys])
    finally:
        reader.close()


def _spill_then_fill(srv, cluster, ns: str) -> tuple[object, list[bytes], list]:
    tier = remote(srv, "acme", namespace=ns)
    keys = keys_for(ns, 12)
    datas = [block(k, SLOT) for k in keys]
    assert tier.put_many(keys, datas) == [Status.OK] * 12  # 8 of them spill to the fleet
    # control: before the fleet fills, every block comes back (8 of them from the fleet)
    assert tier.get_many(keys, [np.zeros(SLOT, np.uint8) for _ in keys]) == [Status.OK] * 12
    time.sleep(1.0)  # the lookups' leases (200 ms here) lapse
    _fill_fleet(cluster)
    return tier, keys, datas


def test_a_put_acknowledged_after_the_fleet_evicted_the_block_stores_it(tmp_path, small_fleet):
    with _serve(tmp_path, small_fleet) as srv:
        tier, keys, datas = _spill_then_fill(srv, small_fleet, "evicted")
        try:
            # The client stores its blocks again: every PUT is acknowledged...
            assert tier.put_many(keys, datas) == [Status.OK] * 12
            # ...so every block must come back whole.
            outs = [np.zeros(SLOT, np.uint8) for _ in keys]
            statuses = tier.get_many(keys, outs)
            lost = [i for i, s in enumerate(statuses) if s is not Status.OK]
            assert not lost, (f"PUT answered OK, yet blocks {lost} are stored nowhere "
                              f"(statuses {[s.name for s in statuses]})")
            for o, d in zip(outs, datas):
                assert np.array_equal(o, d)
        finally:
            tier.close()


def test_lookups_no_longer_promise_what_the_fleet_evicted(tmp_path, small_fleet):
    # The lookups, not the sweep's audit of the entries at the fleet, must be what drops the evicted
    # blocks' entries: a pass between the two counts of the tenant's blocks would drop them first
    # and make `after == before - len(gone)` fail. One pass begins at the first sweep, a second
    # after start: before the fill (_spill_then_fill waits a second after its puts), so the fleet
    # still holds all it asks about; the next would begin fleet_audit_interval_s later: a day here.
    with _serve(tmp_path, small_fleet, fleet_audit_interval_s=86400) as srv:
        tier, keys, _ = _spill_then_fill(srv, small_fleet, "promised")
        try:
            held = _in_fleet(small_fleet, "promised", keys)
            before = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]["acme"]["blocks"]
            answers = tier.contains_many(keys)
            assert all(a for a, h in zip(answers, held) if h), "a block the fleet holds is no longer promised"
            assert sum(a and not h for a, h in zip(answers, held)) <= 4  # DRAM's own (4 slots)
            gone = [i for i, a in enumerate(answers) if not a]
            assert gone, f"the fill evicted none of the server's blocks (fleet holds {held}): nothing was tested"
            assert tier.lookup_prefix(keys) == min(gone)
            after = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]["acme"]["blocks"]
            assert after == before - len(gone), "the blocks the fleet evicted are still charged to the tenant"
        finally:
            tier.close()


def test_a_put_of_a_block_the_fleet_still_holds_is_deduplicated(tmp_path, small_fleet):
    """Control: no fill; a PUT of each of the 12 again stores nothing new (no DRAM commit), and all
    come back whole."""
    with _serve(tmp_path, small_fleet) as srv:
        tier = remote(srv, "acme", namespace="held")
        try:
            keys = keys_for("held", 12)
            datas = [block(k, SLOT) for k in keys]
            assert tier.put_many(keys, datas) == [Status.OK] * 12
            assert all(_in_fleet(small_fleet, "held", keys[:8]))  # the 8 oldest went to the fleet
            commits = admin_call(srv.tcp_url, TOKENS["admin"], "stats", {})["store"]["tiers"]["host"]["puts"]
            assert tier.put_many(keys, datas) == [Status.OK] * 12
            again = admin_call(srv.tcp_url, TOKENS["admin"], "stats", {})["store"]["tiers"]["host"]["puts"]
            assert again == commits, "a block the fleet holds was stored again"
            assert tier.contains_many(keys) == [True] * 12 and tier.lookup_prefix(keys) == 12
            outs = [np.zeros(SLOT, np.uint8) for _ in keys]
            assert tier.get_many(keys, outs) == [Status.OK] * 12
            assert all(np.array_equal(o, d) for o, d in zip(outs, datas))
        finally:
            tier.close()
