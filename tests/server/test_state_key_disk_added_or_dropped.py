"""The records ``kvtier serve`` reads back from ``state_dir`` -- the fleet journal's records and the
erasures' tombstones -- are authenticated under one key whatever the tiers (``state_dir``'s own secret,
or the master key), so a ``disk_dir`` added to or dropped from the config leaves them this server's:

* a disk added or dropped keeps every block the server placed in the Mooncake fleet (they were all
  "failing authentication" and deleted from the fleet at the start);
* a run without the disk keeps the erasures' tombstones, so an old copy of erased files (a backup put
  back) is not served when the disk is back (they were dropped, then written away at the first save);
* records an earlier version wrote under the disk's secret (a disk and a ``state_dir`` of its own) are
  read and written anew under the state key, so the upgrade loses nothing, the disk dropped later
  (tombstones of a key the server does not hold stay in the file until a start holds it); the disk
  dropped at once, the start is refused, naming the disk_dir to configure for one start (s32 r5 D1:
  ``state_dir`` has no secret yet, and no key it holds reads the records).

Real processes: ``kvtier serve``, mooncake_master and a segment holder; clients over TCP. (s32 a3:
D1, D2.)"""

from __future__ import annotations

import re
import shutil

import pytest

from kvtier.tiers.mooncake_launch import MooncakeCluster
from tests.server.conftest import keys_for
from tests.server.test_erasure_tombstones import _copy_aside, _put_back
from tests.server.test_fleet_erase_and_stalls import SECRET
from tests.server.test_restart import SLOT, Restartable, block_files, get, put, stopped_cleanly
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

#: DRAM for 4 blocks, a disk for 2: of 12 blocks put, most go on to the fleet
SMALL = {"capacity": 4 * SLOT, "disk_capacity": f"{2 * SLOT + 8192}"}
STATE_FILES = ("runtime.json", "fleet.journal")


@pytest.fixture(scope="module")
def cluster():
    """One master and holder for the module (each test's keys its own)."""
    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def _server(tmp_path, cluster, *, disk: bool, state_dir: bool = True, **server) -> Restartable:
    """A server over the fleet, with a disk or not, its state in ``tmp_path/state`` (``state_dir``
    False: in ``disk_dir``, the default)."""
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    s = Restartable(tmp_path, mooncake_master=cluster.master_address, mooncake_metadata=cluster.metadata_url,
                    mooncake_secret_file=str(secret), mooncake_timeout_s=0.5, **server)
    if state_dir:
        s.server["state_dir"] = str(tmp_path / "state")
    if not disk:
        del s.server["disk_dir"], s.server["disk_capacity"]
    return s


def _as_an_earlier_version_left_them(tmp_path) -> None:
    """The state files a server with its state in ``disk_dir`` wrote (under the disk's secret), moved
    to a ``state_dir`` of their own: what an earlier version, which keyed them by the disk's secret
    wherever it had a disk, left in the ``state_dir`` of a server with a disk."""
    (tmp_path / "state").mkdir()
    for name in STATE_FILES:
        if (tmp_path / "disk" / name).exists():
            shutil.move(tmp_path / "disk" / name, tmp_path / "state" / name)


def _fleet_line(log: str) -> tuple[int, int]:
    """From the start's line: blocks indexed again from the fleet journal, and those deleted for
    failing authentication."""
    m = re.findall(r"indexed again (\d+) blocks placed in the Mooncake fleet .*?deleted: (\d+) failing "
                   r"authentication", log)
    assert m, log[-2000:]
    return int(m[-1][0]), int(m[-1][1])


# -- D2: the fleet's blocks ---------------------------------------------------------------------------
@pytest.mark.parametrize("first, then", [("fleet only", "disk"), ("disk", "fleet only"),
                                         ("earlier version's, disk", "fleet only")],
                         ids=["disk added", "disk dropped", "upgraded, then disk dropped"])
def test_the_blocks_placed_in_the_fleet_stay_when_a_disk_is_added_or_dropped(tmp_path, cluster, first, then):
    keys = keys_for(f"fleet-kept/{first}/{then}", 12)
    earlier = first.startswith("earlier")
    s = _server(tmp_path, cluster, disk=first != "fleet only", state_dir=not earlier, **SMALL)
    put(s.start(), "acme", "kept", keys)
    stopped_cleanly(*s.stop())
    if earlier:
        _as_an_earlier_version_left_them(tmp_path)
        s = _server(tmp_path, cluster, disk=True, **SMALL)  # the upgrade: the same config, its state_dir
        s.start()
        stopped_cleanly(*s.stop())
    s = _server(tmp_path, cluster, disk=then != "fleet only", **SMALL)
    srv = s.start()
    try:
        indexed, failing = _fleet_line(srv.log())
        assert failing == 0, f"{failing} blocks placed in the fleet deleted as failing authentication"
        assert indexed >= 4, f"only {indexed} of the blocks placed in the fleet indexed again"
        assert sum(get(srv, "acme", "kept", keys)) >= indexed, "the blocks indexed again are not served"
    finally:
        stopped_cleanly(*s.stop())


# -- D1: the erasures' tombstones ----------------------------------------------------------------------
@pytest.mark.parametrize("history", ["this version", "upgraded with the disk, then dropped",
                                     "upgraded without the disk"])
def test_erased_blocks_stay_erased_after_a_run_without_the_disk(tmp_path, cluster, history):
    """globex is erased; the server runs once without its disk (and changes a quota: the runtime state
    is written again); with the disk back, a backup of globex's files put back is not served."""
    earlier = history != "this version"
    keys = keys_for(f"globex-secret/{history}", 3)
    s = _server(tmp_path, cluster, disk=True, state_dir=not earlier)
    put(s.start(), "globex", "chat", keys)
    stopped_cleanly(*s.stop())
    _copy_aside(block_files(s.disk), tmp_path / "backup")  # a backup of globex's files
    s.start()
    assert s.admin("erase", tenant="globex")["erased"] == 3
    stopped_cleanly(*s.stop())
    if earlier:
        _as_an_earlier_version_left_them(tmp_path)
    if history == "upgraded with the disk, then dropped":
        s = _server(tmp_path, cluster, disk=True)
        s.start()
        stopped_cleanly(*s.stop())
    no_disk = _server(tmp_path, cluster, disk=False)  # one run with the disk left out of the config
    if history == "upgraded without the disk":
        # No key it holds reads them and state_dir has no secret yet: refused (a new secret would set
        # them aside, s32 r5 D1), naming the way through: one start with the disk
        with pytest.raises(RuntimeError, match="start once with that disk_dir configured"):
            no_disk.start()
        assert not (tmp_path / "state" / "server.secret").exists()
        s = _server(tmp_path, cluster, disk=True)
        s.start()
        stopped_cleanly(*s.stop())
    no_disk.start()
    assert no_disk.admin("set_quota", tenant="acme", bytes=1 << 30)["ok"]  # the runtime state written again
    stopped_cleanly(*no_disk.stop())
    _put_back(tmp_path / "backup", s.disk)
    s = _server(tmp_path, cluster, disk=True)
    srv = s.start()
    try:
        assert get(srv, "globex", "chat", keys) == [False] * 3, "erased blocks served again from a restored copy"
        assert s.admin("stats")["recovered"]["erased"] == 3, "the restored copy was not recognised as erased"
        assert s.admin("usage")["usage"]["acme"]["quota"] == 1 << 30  # (the run without the disk's change kept)
    finally:
        stopped_cleanly(*s.stop())
