"""Quotas charge what a block keeps of the pool, tiny blocks included (a real ``kvtier serve``).

Before, the server's pool packed blocks under half a page into 64 KiB slabs and a quota
charged such a block its chunk (64 .. 2048 B), while the slab stayed taken as long as any
chunk of it lived: a tenant that kept one tiny block per slab, class after class, held
~13x its quota of the pool (charged a few KiB) and evicted other tenants to get it. The
server's pool now has no slabs: every block takes whole pages and is charged them.
(cf. tests/server/test_quota_footprint.py: the same contract for blocks of page runs.)
"""

from __future__ import annotations

import pytest

from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.host_alloc import SLAB_GRANULES, _class_sizes
from tests.server.conftest import BLOCK, block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

QUOTA = 256 * 1024
PAGE = 4096
SLAB = SLAB_GRANULES * PAGE
POOL = 8 << 20


@pytest.fixture
def quota_server(tmp_path):
    srv = ServerProcess.start(
        tenants(acme={"quota": QUOTA}), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
        server={"capacity": "8MiB", "max_block": "256KiB"},
    )
    yield srv
    srv.stop()


def test_sparse_tiny_blocks_do_not_let_a_tenant_exceed_its_quota(quota_server):
    globex = remote(quota_server, "globex")
    theirs = keys_for("globex-held", 96)  # 96 x 64 KiB = 6 MiB of an 8 MiB pool
    assert globex.put_many(theirs, [block(k) for k in theirs]) == [Status.OK] * 96

    acme = remote(quota_server, "acme")
    kept: list[tuple[bytes, int]] = []
    for chunk in _class_sizes(PAGE):  # every size class a slab allocator would have
        per_slab = SLAB // chunk
        charged = acme.server_stats()["charged_bytes"]
        keys = keys_for(f"acme-{chunk}", (QUOTA - charged) // chunk - 1)  # within its quota, at a chunk each
        for i in range(0, len(keys), 512):
            part = keys[i : i + 512]
            assert set(acme.put_many(part, [block(k, chunk) for k in part])) == {Status.OK}
        doomed = [k for i, k in enumerate(keys) if i % per_slab]  # one block left per slab's worth
        for i in range(0, len(doomed), 1024):
            acme.delete_many(doomed[i : i + 1024])
        kept += [(k, chunk) for i, k in enumerate(keys) if not i % per_slab]

    held = [kc for kc, there in zip(kept, acme.contains_many([k for k, _ in kept])) if there]
    charged = acme.server_stats()["charged_bytes"]
    lost = 96 - sum(globex.contains_many(theirs))
    assert lost == 0, (f"acme (quota {QUOTA >> 10} KiB) keeps {len(held)} tiny blocks, charged {charged} B, "
                       f"and evicted {lost} of globex's 64 KiB blocks")
    # acme is charged the pages its blocks keep, within its quota.
    assert charged == len(held) * PAGE <= QUOTA, (charged, len(held))
    # What acme is not charged for is free for others: globex fills the pool up to acme's
    # quota without losing a block (with slabs, acme's blocks pinned 3.25 MiB for 41 KiB charged).
    more = keys_for("globex-more", (POOL - QUOTA) // BLOCK - 96)
    assert set(globex.put_many(more, [block(k) for k in more])) == {Status.OK}
    assert sum(globex.contains_many(theirs + more)) == len(theirs + more)
    # Control: acme's blocks still read back intact.
    for key, n in held[-3:]:
        out = block(key, n).copy()
        out[:] = 0
        assert acme.get(key, out) is Status.OK and (out == block(key, n)).all()


def test_a_tenant_at_its_quota_of_large_blocks_evicts_its_own(quota_server):
    globex = remote(quota_server, "globex")
    theirs = keys_for("globex-large", 64)  # 4 MiB
    assert globex.put_many(theirs, [block(k) for k in theirs]) == [Status.OK] * 64

    acme = remote(quota_server, "acme")
    first = keys_for("acme-first", QUOTA // BLOCK)  # exactly its quota
    assert acme.put_many(first, [block(k) for k in first]) == [Status.OK] * len(first)
    assert acme.server_stats()["charged_bytes"] == QUOTA
    then = keys_for("acme-then", QUOTA // BLOCK)
    assert acme.put_many(then, [block(k) for k in then]) == [Status.OK] * len(then)
    assert acme.contains_many(then) == [True] * len(then)
    assert acme.contains_many(first) == [False] * len(first), "acme's own oldest blocks make room"
    assert acme.server_stats()["charged_bytes"] == QUOTA
    assert globex.contains_many(theirs) == [True] * 64, "acme's quota evicted another tenant"
