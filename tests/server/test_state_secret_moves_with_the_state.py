"""``state_dir/server.secret`` keys the records ``kvtier serve`` reads back from ``state_dir`` (the
erasures' tombstones, the fleet journal's records), so it moves with them. A start that would have
to make it anew over such records -- ``state_dir`` moved without it, or removed as an error advised
-- is refused, naming the secret, and leaves ``state_dir`` as it was; with the secret put back every
record is read again. (It was made silently: the tombstones were set aside, so an erased tenant's
old files put back were served again, and every block placed in the Mooncake fleet was deleted as
"failing authentication".) A secret the operator makes on purpose is taken: the tombstones are then
kept aside, not applied, as the error says. The state secret's own errors say it moves with the
state, not "remove it to make a new one".

Real processes: ``kvtier serve`` (and for the fleet, mooncake_master and a segment holder);
clients over TCP. (s32 r5: D1.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier.tiers.mooncake_launch import MooncakeCluster
from tests.server.conftest import keys_for
from tests.server.test_erasure_tombstones import _copy_aside, _put_back
from tests.server.test_fleet_erase_and_stalls import SECRET
from tests.server.test_restart import SLOT, Restartable, block_files, get, put, stopped_cleanly
from tests.tiers.mooncake_harness import mooncake_available

REFUSED = "server.secret that is not there"


def _write_secret(path: Path, secret: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)


def _erased_globex(tmp_path, name: str) -> tuple[Restartable, list]:
    """A disk server with its state in ``tmp_path/state`` that put globex's blocks, a backup of their
    files kept in ``tmp_path/backup``, then erased globex."""
    s = Restartable(tmp_path, state_dir=str(tmp_path / "state"))
    keys = keys_for(name, 3)
    put(s.start(), "globex", "chat", keys)
    stopped_cleanly(*s.stop())
    _copy_aside(block_files(s.disk), tmp_path / "backup")
    s.start()
    assert s.admin("erase", tenant="globex")["erased"] == 3
    stopped_cleanly(*s.stop())
    return s, keys


@pytest.mark.parametrize("how", ["state_dir moved without it", "removed"])
def test_a_start_that_would_make_the_state_secret_over_tombstones_is_refused(tmp_path, how):
    s, keys = _erased_globex(tmp_path, f"secret-moves/{how}")
    secret = (tmp_path / "state" / "server.secret").read_bytes()
    if how == "removed":
        (tmp_path / "state" / "server.secret").unlink()
    else:
        (tmp_path / "moved").mkdir(mode=0o700)
        shutil.copy2(tmp_path / "state" / "runtime.json", tmp_path / "moved" / "runtime.json")
        s.server["state_dir"] = str(tmp_path / "moved")
    state = Path(s.server["state_dir"])
    _put_back(tmp_path / "backup", s.disk)  # an old copy of globex's files
    with pytest.raises(RuntimeError, match=REFUSED) as refused:
        s.start()
    assert "1 erasure tombstones in runtime.json" in str(refused.value)
    assert "moves with the state" in str(refused.value)
    assert not (state / "server.secret").exists(), "a secret was made although the start was refused"
    _write_secret(state / "server.secret", secret)  # put back
    srv = s.start()
    try:
        assert get(srv, "globex", "chat", keys) == [False] * 3, "erased blocks served again from a restored copy"
        assert s.admin("stats")["recovered"]["erased"] == 3
    finally:
        stopped_cleanly(*s.stop())


def test_a_state_secret_made_anew_on_purpose_is_taken_its_tombstones_kept_aside(tmp_path):
    s, _ = _erased_globex(tmp_path, "secret-moves/on-purpose")
    (tmp_path / "state" / "server.secret").unlink()
    with pytest.raises(RuntimeError, match=REFUSED):
        s.start()
    _write_secret(tmp_path / "state" / "server.secret", os.urandom(32))  # as the error says, on purpose
    srv = s.start()
    try:
        assert "1 erasure records written under another key" in srv.log()
        assert s.admin("set_quota", tenant="acme", bytes=1 << 30)["ok"]  # the runtime state written again
    finally:
        stopped_cleanly(*s.stop())
    assert "foreign_erasures" in (tmp_path / "state" / "runtime.json").read_text(), "kept aside, in the file"


def test_the_state_secrets_errors_say_it_moves_with_the_state(tmp_path):
    s = Restartable(tmp_path, state_dir=str(tmp_path / "state"))
    s.start()
    stopped_cleanly(*s.stop())
    (tmp_path / "state" / "server.secret").chmod(0o644)
    with pytest.raises(RuntimeError, match="the state secret") as refused:
        s.start()
    assert "moves with the state_dir's runtime.json and fleet.journal" in str(refused.value)
    assert "make a new one" not in str(refused.value)
    (tmp_path / "state" / "server.secret").chmod(0o600)
    (tmp_path / "disk" / "server.secret").chmod(0o644)  # the disk's: a new one drops the spilled blocks only
    with pytest.raises(RuntimeError, match="the spill secret .*remove it to make a new one"):
        s.start()


@pytest.fixture(scope="module")
def cluster():
    if mooncake_available() is not None:
        pytest.skip(str(mooncake_available()))
    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def test_a_fleet_journal_whose_secret_is_gone_is_refused_then_read_with_it_back(tmp_path, cluster):
    """A server without a disk: DRAM for 4 blocks, so most of 12 go on to the fleet, journaled."""
    (tmp_path / "mooncake.secret").write_bytes(SECRET)
    (tmp_path / "mooncake.secret").chmod(0o600)
    s = Restartable(tmp_path, capacity=4 * SLOT, mooncake_master=cluster.master_address,
                    mooncake_metadata=cluster.metadata_url, mooncake_secret_file=str(tmp_path / "mooncake.secret"),
                    mooncake_timeout_s=0.5, state_dir=str(tmp_path / "state"))
    del s.server["disk_dir"], s.server["disk_capacity"]
    keys = keys_for("secret-moves/fleet", 12)
    put(s.start(), "acme", "kept", keys)
    stopped_cleanly(*s.stop())
    secret_path = tmp_path / "state" / "server.secret"
    secret = secret_path.read_bytes()
    secret_path.unlink()
    with pytest.raises(RuntimeError, match=REFUSED) as refused:
        s.start()
    assert "records of blocks placed in the Mooncake fleet in fleet.journal" in str(refused.value)
    _write_secret(secret_path, secret)
    srv = s.start()
    try:
        log = srv.log()
        assert "deleted: 0 failing authentication" in log, log[-2000:]
        assert sum(get(srv, "acme", "kept", keys)) >= 8, "the blocks placed in the fleet are not served"
    finally:
        stopped_cleanly(*s.stop())
