"""``kvtier serve`` over a Mooncake fleet, restarted: erase and TTL still reach the blocks it placed in
the fleet, whose names are one-way and cannot be listed. With a state directory the server journals
what it places there (kvtier/server/fleet.py) and indexes it again at start, after a SIGTERM or a
crash; without one, its clean shutdown deletes them from the fleet. Real processes: mooncake_master, a
segment holder, the kvtier server, clients over TCP; a fleet client with the fleet's secret plays any
other server of the fleet.

(s27 retention audit, R1: after a restart `admin erase --tenant acme` answered erased: 0 while all of
acme's spilled blocks stayed readable whole in the fleet, and a namespace TTL never removed them.)"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.auth import KeySpace
from kvtier.server.fleet_journal import FleetJournal
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants
from tests.server.test_fleet_erase_and_stalls import SECRET, SLOT, _readable_in_fleet, _serve, cluster  # noqa: F401
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


def _put_spilling(srv, ns: str, n: int = 12) -> list[bytes]:
    """``n`` blocks of acme's; DRAM holds 4: the others go to the fleet."""
    keys = keys_for(ns, n)
    acme = remote(srv, "acme", namespace=ns)
    try:
        assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * n
    finally:
        acme.close()
    return keys


def _gets(srv, ns: str, keys) -> list[Status]:
    acme = remote(srv, "acme", namespace=ns)
    try:
        outs = [np.full(SLOT, 0xA5, np.uint8) for _ in keys]
        statuses = acme.get_many(keys, outs)
        for s, o, k in zip(statuses, outs, keys):
            assert s is not Status.OK or np.array_equal(o, block(k, SLOT)), "a wrong block came back"
        return statuses
    finally:
        acme.close()


def _crash(srv) -> None:
    srv.proc.kill()  # SIGKILL: no shutdown of any kind
    srv.proc.wait()
    srv.stop()


# -- without a state directory: the clean shutdown takes them out of the fleet -------------------------
def test_an_erase_after_a_restart_reaches_the_blocks_the_fleet_holds(tmp_path, cluster):  # noqa: F811
    with _serve(tmp_path, cluster) as srv:
        keys = _put_spilling(srv, "restart-erase")
        assert sum(_readable_in_fleet(cluster, "restart-erase", keys)) >= 8  # control: the fleet holds them
    with _serve(tmp_path, cluster) as srv:  # the same server, restarted (SIGTERM above)
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
        assert reply["ok"], reply
        left = _readable_in_fleet(cluster, "restart-erase", keys)
        assert not any(left), (f"after a restart, `erase --tenant acme` answered erased={reply['erased']} and "
                               f"{sum(left)} of acme's blocks are still readable whole in the fleet")


def test_blocks_in_the_fleet_expire_after_a_restart(tmp_path, cluster):  # noqa: F811
    keys = keys_for("restart-ttl", 12)
    acme_ttl = {"namespace_ttl_s": {"restart-ttl": 1.0}}
    with _serve(tmp_path, cluster, acme=acme_ttl, sweep_interval_s=0.1) as srv:
        keys = _put_spilling(srv, "restart-ttl")
    with _serve(tmp_path, cluster, acme=acme_ttl, sweep_interval_s=0.1):
        time.sleep(2.0)  # twice the TTL, twenty sweeps
        left = _readable_in_fleet(cluster, "restart-ttl", keys)
        assert not any(left), f"{sum(left)} blocks past their 1 s retention are still readable in the fleet"


def test_without_a_state_directory_the_shutdown_deletes_what_the_fleet_holds(tmp_path, cluster):  # noqa: F811
    with _serve(tmp_path, cluster) as srv:
        keys = _put_spilling(srv, "no-state")
        assert sum(_readable_in_fleet(cluster, "no-state", keys)) >= 8  # control: the fleet holds them
        assert _gets(srv, "no-state", keys) == [Status.OK] * 12  # and serves them while it runs
    assert not any(_readable_in_fleet(cluster, "no-state", keys))
    assert "deleted" in srv.log() and "Mooncake fleet" in srv.log()


# -- with a state directory: journaled, indexed again at start -----------------------------------------
def test_a_restarted_server_serves_then_erases_what_it_placed_in_the_fleet(tmp_path, cluster):  # noqa: F811
    state = {"state_dir": str(tmp_path / "state")}
    with _serve(tmp_path, cluster, **state) as srv:
        keys = _put_spilling(srv, "journaled")
    assert sum(_readable_in_fleet(cluster, "journaled", keys)) >= 8  # kept across the restart
    with _serve(tmp_path, cluster, **state) as srv:
        statuses = _gets(srv, "journaled", keys)
        assert statuses.count(Status.OK) >= 8, [s.name for s in statuses]  # DRAM's 4 were lost, the fleet's not
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
        assert reply["ok"] and reply["erased"] >= 8, reply
        assert not any(_readable_in_fleet(cluster, "journaled", keys))
        assert _gets(srv, "journaled", keys) == [Status.MISS] * 12
    with _serve(tmp_path, cluster, **state) as srv:  # and an erased block does not come back later
        assert _gets(srv, "journaled", keys) == [Status.MISS] * 12


def test_a_crashed_server_still_erases_what_it_placed_in_the_fleet(tmp_path, cluster):  # noqa: F811
    state = {"state_dir": str(tmp_path / "state")}
    srv = _serve(tmp_path, cluster, **state)
    keys = _put_spilling(srv, "crashed")
    _crash(srv)
    assert sum(_readable_in_fleet(cluster, "crashed", keys)) >= 8  # control
    with _serve(tmp_path, cluster, **state) as srv:
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "crashed"})
        assert reply["ok"] and reply["erased"] >= 8, reply
        left = _readable_in_fleet(cluster, "crashed", keys)
        assert not any(left), f"{sum(left)} of the erased namespace's blocks are still readable in the fleet"


def test_blocks_a_crashed_server_placed_in_the_fleet_expire_after_its_restart(tmp_path, cluster):  # noqa: F811
    state = {"state_dir": str(tmp_path / "state")}
    acme_ttl = {"namespace_ttl_s": {"crash-ttl": 1.5}}
    srv = _serve(tmp_path, cluster, acme=acme_ttl, sweep_interval_s=0.1, **state)
    keys = _put_spilling(srv, "crash-ttl")
    _crash(srv)
    assert sum(_readable_in_fleet(cluster, "crash-ttl", keys)) >= 8  # control: not yet expired
    with _serve(tmp_path, cluster, acme=acme_ttl, sweep_interval_s=0.1, **state):
        time.sleep(2.5)
        left = _readable_in_fleet(cluster, "crash-ttl", keys)
        assert not any(left), f"{sum(left)} blocks past their retention are still readable in the fleet"


def test_with_a_disk_spill_erase_after_a_restart_reaches_both_disk_and_fleet(tmp_path, cluster):  # noqa: F811
    """DRAM → disk → fleet: the disk (room for 4) evicts into the fleet; its write-behind copies there too."""
    spill = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "256KiB"}
    with _serve(tmp_path, cluster, **spill) as srv:
        keys = _put_spilling(srv, "three-tiers", 16)
        deadline = time.monotonic() + 10  # the copies down run in the background
        while sum(_readable_in_fleet(cluster, "three-tiers", keys)) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert sum(_readable_in_fleet(cluster, "three-tiers", keys)) >= 8  # control
    with _serve(tmp_path, cluster, **spill) as srv:
        assert _gets(srv, "three-tiers", keys) == [Status.OK] * 16  # from disk and fleet, after the restart
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
        assert reply["ok"] and reply["erased"] == 16, reply
        assert not any(_readable_in_fleet(cluster, "three-tiers", keys))


MASTER = bytes.fromhex("5a" * 32)


def _serve_sealed(tmp_path, cluster, **server):  # noqa: F811
    """A server with encrypt_at_rest: DRAM (4 blocks), a disk (room for 4), the fleet."""
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    (tmp_path / "srv").mkdir(exist_ok=True)
    return ServerProcess.start(
        tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path / "srv"),
        env={"KVTIER_MASTER_KEY": MASTER.hex()},
        server={"capacity": 4 * SLOT, "max_block": SLOT, "mooncake_master": cluster.master_address,
                "mooncake_metadata": cluster.metadata_url, "mooncake_secret_file": str(secret),
                "disk_dir": str(tmp_path / "disk"), "disk_capacity": "256KiB", "encrypt_at_rest": True, **server})


def _sealed_names(tmp_path, ns: str, keys) -> list[bytes]:
    """The names the fleet holds acme's sealed blocks in ``ns`` under (keyed by its keys: derive them first)."""
    keyring = Keyring(StaticMasterKey(MASTER), tmp_path / "disk" / "keys")
    return [keyring.storage_key("acme", KeySpace.of("acme", ns).storage_key(k)) for k in keys]


def _in_fleet(cluster, names) -> int:  # noqa: F811
    reader = make_tier(cluster, tenant="kvtier-serve", secret=SECRET)
    try:
        return sum(reader.contains_many(names))
    finally:
        reader.close()


def _spilled_sealed(tmp_path, cluster, srv, ns: str) -> tuple[list[bytes], list[bytes]]:  # noqa: F811
    """16 of acme's blocks put, at least 8 of them in the fleet (the copies down run in the
    background); their keys and fleet names."""
    keys = _put_spilling(srv, ns, 16)
    names = _sealed_names(tmp_path, ns, keys)
    deadline = time.monotonic() + 10
    while _in_fleet(cluster, names) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_fleet(cluster, names) >= 8  # control: the fleet holds them, sealed
    return keys, names


def test_sealed_blocks_in_the_fleet_are_erased_after_a_restart(tmp_path, cluster):  # noqa: F811
    """With encrypt_at_rest: the fleet holds sealed blocks under their owner's keyed names, and the
    journal names them so (its records sealed too); a namespace erase (no key shredding) after a
    restart removes them."""
    with _serve_sealed(tmp_path, cluster) as srv:
        keys, names = _spilled_sealed(tmp_path, cluster, srv, "sealed")
    assert not any(_readable_in_fleet(cluster, "sealed", keys))  # (never in plaintext)
    journal = tmp_path / "disk" / "fleet.journal"
    assert journal.exists() and b"sealed" not in journal.read_bytes()  # its records are sealed too
    with _serve_sealed(tmp_path, cluster) as srv:
        assert _gets(srv, "sealed", keys) == [Status.OK] * 16
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "sealed"})
        assert reply["ok"] and reply["erased"] == 16, reply
        assert _in_fleet(cluster, names) == 0


def _erased_while_the_fleet_is_stopped(tmp_path, cluster) -> tuple[list[bytes], int]:  # noqa: F811
    """A tenant erase while the fleet does not answer: acme's keys are shredded, its fleet deletes
    owed, their records kept. The names of its blocks in the fleet and how many records stayed.
    (No sweep while it runs: the sweep retries owed removals once the fleet answers, and these tests
    need them still owed at the stop, as after a crash or a fleet that stayed down.)"""
    with _serve_sealed(tmp_path, cluster, mooncake_timeout_s=0.5, sweep_interval_s=3600) as srv:
        _, names = _spilled_sealed(tmp_path, cluster, srv, "shredded")
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert reply["keys_shredded"] and reply.get("refused", 0) >= 8, reply  # (sealed: reported not erased too)
    owed = len(FleetJournal(str(tmp_path / "disk" / "fleet.journal")))
    assert owed >= 8  # the control: their records stayed
    return names, owed


def test_a_shredded_tenants_owed_fleet_deletes_do_not_stop_the_next_start(tmp_path, cluster):  # noqa: F811
    """Those records authenticate under the master key but their names no longer derive: the next
    start deletes their blocks (the tombstone, judged before the name, covers them), where it
    refused "none of the records ... authenticates under this master key" (the name was checked first)."""
    names, owed = _erased_while_the_fleet_is_stopped(tmp_path, cluster)
    try:
        srv = _serve_sealed(tmp_path, cluster)
    except RuntimeError as exc:  # (its log's line that says why, not the fleet client's chatter after it)
        why = next((line for line in str(exc).splitlines() if line.startswith("kvtier serve: ")), str(exc)[-400:])
        pytest.fail(f"the start after a shredded tenant's owed fleet deletes was refused: {why}")
    with srv:
        fleet = admin_call(srv.tcp_url, TOKENS["admin"], "stats", {})["recovered"]["fleet"]
        assert (fleet["erased"], fleet["rejected"], fleet["recovered"]) == (owed, 0, 0), fleet
        assert _in_fleet(cluster, names) == 0
    assert len(FleetJournal(str(tmp_path / "disk" / "fleet.journal"))) == 0


def test_untombstoned_shredded_tenants_fleet_records_stay_and_the_start_names_it(tmp_path, cluster):  # noqa: F811
    """The runtime state lost: nothing tells acme's shredded keys from a key store that never held
    them (another store of the same master key, an older backup). Nothing of acme's is deleted, and
    the start -- no other record, no disk file -- is refused naming acme and both causes. (s30 a10
    D1: taken for shredded, as a wrong key store's tenants all were.)"""
    names, owed = _erased_while_the_fleet_is_stopped(tmp_path, cluster)
    held = _in_fleet(cluster, names)
    (tmp_path / "disk" / "runtime.json").unlink()
    with pytest.raises(RuntimeError, match=rf"holds no keys of acme \({owed} records\): either it is not the key "
                                           rf"store they were written with, or their keys were shredded"):
        _serve_sealed(tmp_path, cluster)
    assert len(FleetJournal(str(tmp_path / "disk" / "fleet.journal"))) == owed
    assert _in_fleet(cluster, names) == held
