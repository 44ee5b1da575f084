"""What a restarted ``kvtier serve`` reads back, and where it keeps it (s33 a6: D1, D2, D3).

* D1: a block indexed again at start (from disk, or the fleet journal) is charged its pool footprint,
  as its PUT was: a tenant at its quota of tiny blocks is at it after a restart too, reads that bring
  the blocks back into DRAM change nothing, and a put then evicts the tenant's own blocks. (They were
  charged their payload only: 10 blocks of 64 B charged 640 B instead of 10 pages, and the tenant put
  9 more, 19 pages under a 10-page quota.)
* D2: with a fleet and the state kept in ``disk_dir`` (no ``state_dir``), ``disk_dir/server.secret``
  keys the fleet journal and the erasures' tombstones too: its errors do not advise removing it, and a
  start that would make it anew over them is refused before any secret is made. (Removed as its error
  advised, the next start deleted every block placed in the fleet and set the tombstones aside.)
* D3: ``state_dir`` set on a server whose ``disk_dir`` still holds ``runtime.json`` (or
  ``fleet.journal``) is refused, naming the files to move; moved, the tombstones and overrides hold.
  (The start ignored them: an erased tenant's files put back were served again.)

Real ``kvtier serve`` processes (and for the fleet, mooncake_master and a segment holder); clients
over TCP."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.mooncake_launch import MooncakeCluster
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import tenants
from tests.server.test_erasure_tombstones import _copy_aside, _put_back
from tests.server.test_fleet_erase_and_stalls import SECRET
from tests.server.test_restart import SLOT, Restartable, block_files, get, put, stopped_cleanly
from tests.tiers.mooncake_harness import mooncake_available

PAGE, TINY = 4096, 64
QUOTA = 10 * PAGE


# -- D1: the quota charge across a restart ------------------------------------------------------------
def _put_tiny(srv, keys) -> None:
    acme = remote(srv, "acme", namespace="tiny")
    try:
        assert [acme.put(k, block(k, TINY)) for k in keys] == [Status.OK] * len(keys)
    finally:
        acme.close()


def _read_tiny(srv, keys) -> int:
    """How many of ``keys`` read back with their bytes (each read promotes a block found on disk)."""
    acme = remote(srv, "acme", namespace="tiny")
    try:
        outs = [np.zeros(TINY, np.uint8) for _ in keys]
        statuses = acme.get_many(keys, outs)
        return sum(s is Status.OK and np.array_equal(o, block(k, TINY)) for s, o, k in zip(statuses, outs, keys))
    finally:
        acme.close()


def test_blocks_read_back_at_start_are_charged_their_footprint_as_at_their_put(tmp_path):
    s = Restartable(tmp_path, tenants(acme={"quota": QUOTA}), capacity="8MiB", max_block="256KiB")
    keys = keys_for("s33-charge", 10)
    _put_tiny(s.start(), keys)
    before = s.admin("usage")["usage"]["acme"]
    assert before["charged_bytes"] == QUOTA, before  # a page each: at its quota
    stopped_cleanly(*s.stop())
    srv = s.start()
    try:
        assert s.admin("usage")["usage"]["acme"] == before, "the same blocks charged otherwise after the restart"
        assert _read_tiny(srv, keys) == 10
        assert s.admin("usage")["usage"]["acme"] == before, "blocks read back into DRAM charged otherwise"
        _put_tiny(srv, keys_for("s33-charge-more", 9))  # at its quota: each evicts one of acme's own
        after = s.admin("usage")["usage"]["acme"]
        assert after["blocks"] == 10 and after["charged_bytes"] <= QUOTA, after
    finally:
        stopped_cleanly(*s.stop())


# -- D2: the state kept in disk_dir beside a fleet -------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    if mooncake_available() is not None:
        pytest.skip(str(mooncake_available()))
    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def _fleet_line(log: str) -> tuple[int, int]:
    """From the start's line: blocks indexed again from the fleet journal, and those deleted for
    failing authentication."""
    found = re.findall(r"indexed again (\d+) blocks placed in the Mooncake fleet .*?deleted: (\d+) failing "
                       r"authentication", log)
    assert found, log[-2000:]
    return int(found[-1][0]), int(found[-1][1])


def test_the_disk_secret_that_keys_a_fleet_journal_beside_it_is_never_made_anew(tmp_path, cluster):
    """DRAM for 4 blocks, a disk for 2: most of acme's 12 blocks go on to the fleet, journaled in
    disk_dir; globex erased (a tombstone in disk_dir/runtime.json)."""
    (tmp_path / "mooncake.secret").write_bytes(SECRET)
    (tmp_path / "mooncake.secret").chmod(0o600)
    s = Restartable(tmp_path, capacity=4 * SLOT, disk_capacity=f"{2 * SLOT + 8192}",
                    mooncake_master=cluster.master_address, mooncake_metadata=cluster.metadata_url,
                    mooncake_secret_file=str(tmp_path / "mooncake.secret"), mooncake_timeout_s=0.5)
    keys = keys_for("s33-fleet-secret", 12)
    put(s.start(), "acme", "kept", keys)
    put(s.srv, "globex", "chat", keys_for("s33-fleet-secret/globex", 2))
    assert s.admin("erase", tenant="globex")["ok"]
    stopped_cleanly(*s.stop())
    secret_path = s.disk / "server.secret"
    secret = secret_path.read_bytes()

    secret_path.chmod(0o640)
    with pytest.raises(RuntimeError, match="the state secret") as refused:
        s.start()
    assert "remove it" not in str(refused.value) and "moves with the state" in str(refused.value)
    secret_path.unlink()  # what the old error advised
    with pytest.raises(RuntimeError, match="server.secret that is not there") as refused:
        s.start()
    assert "1 erasure tombstones in runtime.json" in str(refused.value)
    assert "records of blocks placed in the Mooncake fleet in fleet.journal" in str(refused.value)
    assert not secret_path.exists(), "a secret was made although the start was refused"

    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # put back
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    srv = s.start()
    try:
        indexed, failing = _fleet_line(srv.log())
        assert failing == 0, f"{failing} blocks placed in the fleet deleted as failing authentication"
        assert indexed >= 4 and sum(get(srv, "acme", "kept", keys)) >= indexed, "the fleet's blocks not served"
        assert "not applied" not in srv.log(), "the erasures' tombstones set aside"
    finally:
        stopped_cleanly(*s.stop())


# -- D3: state_dir added while disk_dir holds the state --------------------------------------------------
def test_a_state_dir_set_while_disk_dir_holds_the_state_is_refused_until_it_is_moved(tmp_path):
    s = Restartable(tmp_path)
    keys = keys_for("s33-state-moved", 3)
    put(s.start(), "globex", "chat", keys)
    assert s.admin("set_quota", tenant="acme", bytes=1 << 20)["ok"]
    stopped_cleanly(*s.stop())
    _copy_aside(block_files(s.disk), tmp_path / "backup")  # a backup of globex's files
    s.start()
    assert s.admin("erase", tenant="globex")["erased"] == 3
    stopped_cleanly(*s.stop())
    _put_back(tmp_path / "backup", s.disk)

    state = tmp_path / "state"
    s.server["state_dir"] = str(state)
    with pytest.raises(RuntimeError, match="still holds the state") as refused:
        s.start()
    assert f"mv -n {s.disk / 'runtime.json'} {state}/" in str(refused.value)
    assert not state.exists(), "the refused start made state_dir"

    state.mkdir(mode=0o700)
    shutil.move(s.disk / "runtime.json", state / "runtime.json")  # as the error says
    srv = s.start()
    try:
        assert get(srv, "globex", "chat", keys) == [False] * 3, "erased blocks served again"
        assert s.admin("usage")["usage"]["acme"]["quota"] == 1 << 20, "the quota override lost"
    finally:
        stopped_cleanly(*s.stop())
    assert Path(state / "server.secret").exists() and (s.disk / "server.secret").exists()
