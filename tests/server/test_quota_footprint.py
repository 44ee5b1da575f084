"""Quotas charge the pool bytes a block takes, not its payload (a real ``kvtier serve``).

Before, the quota counted payload bytes while the pool gave every block a
whole ``max_block`` slot: a tenant with a tiny quota evicted every other
tenant by storing many tiny blocks.
"""

from __future__ import annotations

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

QUOTA = 64 * 1024
PAGE = 4096


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-quota")
    srv = ServerProcess.start(
        tenants(acme={"quota": QUOTA}), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(wd),
        server={"capacity": "8MiB", "max_block": "256KiB"},
    )
    yield srv
    srv.stop()


def test_a_tenant_with_a_tiny_quota_cannot_evict_others_with_tiny_blocks(quota_server):
    globex = remote(quota_server, "globex")
    theirs = keys_for("globex-held", 20)  # 20 x 64 KiB: 1.25 MiB of an 8 MiB pool
    assert globex.put_many(theirs, [block(k) for k in theirs]) == [Status.OK] * 20

    acme = remote(quota_server, "acme")
    tiny = keys_for("acme-tiny", 1000)  # 100 B each, 1000 of them: 100 KB of payload
    statuses = acme.put_many(tiny, [block(k, 100) for k in tiny])
    assert set(statuses) == {Status.OK}
    # A page and a bit each: payload charging would let 15 in (64 KiB / 4100 B), the pool spends 8 KiB on each.
    odd = keys_for("acme-odd", 40)
    assert set(acme.put_many(odd, [block(k, PAGE + 4) for k in odd])) == {Status.OK}

    assert globex.contains_many(theirs) == [True] * 20, "acme's tiny blocks evicted another tenant"
    present = acme.contains_many(odd)
    assert sum(present) == QUOTA // (2 * PAGE), f"acme holds {sum(present)} blocks of {PAGE + 4} B"
    assert present[-1] and not present[0], "acme's own least recent blocks went first"
    assert sum(acme.contains_many(tiny)) == 0, "its tiny blocks were older still"
    # Same-tenant control: what acme holds reads back intact.
    out = block(odd[-1], PAGE + 4).copy()
    out[:] = 0
    assert acme.get(odd[-1], out) is Status.OK and (out == block(odd[-1], PAGE + 4)).all()
    usage = admin_call(quota_server.tcp_url, TOKENS["admin"], "usage", {})["usage"]
    assert usage["acme"]["bytes"] == sum(present) * (PAGE + 4)
    assert usage["globex"]["blocks"] == 20


def test_a_block_whose_footprint_exceeds_the_quota_is_refused(quota_server):
    ops = remote(quota_server, "ops")
    assert admin_call(quota_server.tcp_url, TOKENS["admin"], "set_quota", {"tenant": "ops", "bytes": QUOTA + 100})["ok"]
    try:
        # Its payload is under the quota, but it takes 17 pages: 68 KiB of pool.
        over = keys_for("ops-over", 1)[0]
        assert ops.put(over, block(over, QUOTA + 50)) is Status.FULL
        fits = keys_for("ops-fits", 1)[0]  # 16 pages exactly
        assert ops.put(fits, block(fits, QUOTA)) is Status.OK
        assert ops.contains(fits) and not ops.contains(over)
    finally:
        admin_call(quota_server.tcp_url, TOKENS["admin"], "set_quota", {"tenant": "ops", "bytes": 0})
