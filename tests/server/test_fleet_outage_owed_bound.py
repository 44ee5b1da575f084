"""A Mooncake outage does not pile up, without bound, the removals of blocks never placed in the fleet.

During an outage the server passes every block it drops (DELETE, TTL, quota) to the fleet tier,
which hides the name and retries its removal once the fleet answers: a fleet shared by several
servers may hold another server's copy under it. Every such name stayed in memory for the whole
outage, also those of blocks only DRAM ever held, and all of them were retried after it (s32 a3 D4).
Past ``max_owed_removals`` names, the tier now gives up new ones (counted, logged, exported), except
those the server placed in the fleet (a journal record): their removal, an erasure's, stays owed and
lands once the fleet answers. Real processes: mooncake_master (frozen with SIGSTOP), a segment holder;
the kvtier server in process (its fleet tier's bound set low), clients over TCP."""

from __future__ import annotations

import os
import signal

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.auth import KeySpace
from kvtier.tiers.base import Status, refused_removals
from tests.server.conftest import block, keys_for
from tests.server.harness import TOKENS
from tests.server.inprocess import InProcessServer
from tests.server import test_fleet_erase_and_stalls as fleet_tests
from tests.server.test_fleet_erase_and_stalls import SECRET, SLOT, _readable_in_fleet
from tests.server.test_fleet_erase_outage import _wait_for
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BOUND = 20
SMALL = 4096
cluster = fleet_tests.cluster  # a cluster of this module's own: its master is frozen here


def _serve(tmp_path, cluster) -> InProcessServer:
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return InProcessServer(tmp_path, capacity=4 * SLOT, max_block=SLOT, mooncake_master=cluster.master_address,
                           mooncake_metadata=cluster.metadata_url, mooncake_secret_file=str(secret),
                           mooncake_timeout_s=0.5, state_dir=str(tmp_path / "state"))


def _put_then_delete(s: InProcessServer, ns: str, keys, nbytes: int, deleted=None) -> None:
    t = s.remote("acme", ns)
    try:
        assert t.put_many(keys, [block(k, nbytes) for k in keys]) == [Status.OK] * len(keys)
        if deleted is not None:
            t.delete_many(deleted)
    finally:
        t.close()


def test_an_outage_gives_up_removals_of_blocks_never_placed_past_the_bound_never_those_placed(tmp_path, cluster):
    s = _serve(tmp_path, cluster)
    try:
        fleet = s.server.fleet
        tier = fleet.inner
        deletions = s.before_deletions(lambda _: None)
        placed = keys_for("placed", 8)
        # DRAM holds 4 blocks: the 4 oldest go to the fleet, recorded; the 4 DRAM holds are deleted
        _put_then_delete(s, "placed", placed, SLOT, deleted=placed[4:])
        assert _wait_for(lambda: len(fleet.journal) == 4, 10), f"control: {len(fleet.journal)} blocks placed"
        assert all(_readable_in_fleet(cluster, "placed", placed[:4])), "control: the fleet holds them"
        assert _wait_for(lambda: len(deletions) == 4, 10)
        tier.max_owed_removals = BOUND
        churn = [k for round_ in range(4) for k in keys_for(f"churn-{round_}", 30)]
        churned = len(churn)
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            for i in range(0, churned, 30):  # a tenant's churn: blocks DRAM alone ever held
                _put_then_delete(s, "churn", churn[i:i + 30], SMALL, deleted=churn[i:i + 30])
            assert _wait_for(lambda: len(deletions) >= 4 + churned, 20), f"{len(deletions) - 4} of {churned} deletions ran"
            # which of them the fleet tier holds as owed (hidden, retried once the fleet answers)
            owed = sum(tier.retry_removals([KeySpace.of("acme", "churn").storage_key(k) for k in churn]))
            assert owed == BOUND, f"{owed} names of blocks never placed in the fleet held as owed removals"
            assert tier.owed_removals_given_up == churned - BOUND
            # Past the bound, the blocks this server placed: their removal stays owed, the erase refused.
            reply = admin_call(s.url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "placed"})
            assert reply["ok"] and reply.get("refused") == 4 and reply["erased"] == 0, reply
            assert tier.owed_removals == BOUND + 4, "the removal of a block placed in the fleet was given up"
            assert tier.owed_removals_given_up == churned - BOUND
            exported = s.service.metrics.render().decode()
            assert f'kvtier_tier_owed_removals_given_up_total{{tier="{fleet.name}"}} {churned - BOUND}.0' in exported
            assert f'kvtier_tier_owed_removals{{tier="{fleet.name}"}} {BOUND + 4}.0' in exported
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert _wait_for(lambda: not any(_readable_in_fleet(cluster, "placed", placed[:4])), 30), \
            "the erased blocks stay readable in the fleet after the outage"
        assert _wait_for(lambda: len(fleet.journal) == 0, 30), "their records outlive the removal"
    finally:
        s.stop()


def test_the_bound_keeps_what_is_owed_already_and_what_the_caller_keeps(cluster):
    from kvtier.tiers.mooncake import owed_removals_kept

    tier = make_tier(cluster, timeout_s=0.5)
    keys = [os.urandom(32) for _ in range(7)]
    try:
        tier.max_owed_removals = 3
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            with refused_removals() as refused:
                assert tier.delete_many(keys[:5]) == [False] * 5
            assert sorted(r.key for r in refused) == sorted(keys[:5]), "a removal given up was reported done"
            assert (tier.owed_removals, tier.owed_removals_given_up) == (3, 2)
            tier.delete_many(keys[:1])  # owed already: neither given up nor owed twice
            assert (tier.owed_removals, tier.owed_removals_given_up) == (3, 2)
            with owed_removals_kept({keys[5]}):
                tier.delete_many(keys[5:])
            assert (tier.owed_removals, tier.owed_removals_given_up) == (4, 3)
            assert tier.retry_removals([keys[0], keys[3], keys[5], keys[6]]) == [True, False, True, False]
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert _wait_for(lambda: not any(tier.retry_removals(keys)), 30), "the owed removals never landed"
        assert tier.owed_removals == 0
    finally:
        tier.close()
