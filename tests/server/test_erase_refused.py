"""An erasure a read-only disk could not carry out is not reported done, and a restart does not
bring the blocks back (the disk tier withholds what it could not remove; the erasure's tombstone,
kept in a state directory the disk's failure does not reach, covers the files at the next start)."""

import subprocess

import pytest

from tests.server.conftest import keys_for, remote
from tests.server.test_restart import Restartable, get, put, stopped_cleanly
from tests.tmpfs import mounted_tmpfs


@pytest.fixture
def tmpfs(tmp_path):
    """A small real tmpfs (root only) for disk_dir, unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt


def _spilled_server(tmp_path, tmpfs, name: str, keys) -> Restartable:
    work = tmp_path / "work"
    work.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    s = Restartable(work, disk_dir=str(tmpfs / "disk"), disk_capacity="8MiB", state_dir=str(state))
    s.disk = tmpfs / "disk"
    srv = s.start()
    put(srv, "acme", name, keys)
    stopped_cleanly(*s.stop())  # the SIGTERM flush spills every block to disk
    srv = s.start()
    assert get(srv, "acme", name, keys) == [True] * len(keys)
    return s


def test_an_erasure_a_read_only_disk_refused_is_reported_and_not_undone_by_a_restart(tmp_path, tmpfs):
    keys = keys_for("erase-ro", 4)
    s = _spilled_server(tmp_path, tmpfs, "a", keys)
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
        answer = s.admin("erase", tenant="acme", namespace="a")
        assert answer.get("refused") == 4 and answer.get("erased") == 0, answer
        assert "could not be removed" in answer.get("error", ""), answer
        assert get(s.srv, "acme", "a", keys) == [False] * 4, "a block whose erasure was refused is not served"
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
        s.stop()
        srv = s.start()
        assert remote(srv, "acme", namespace="a").lookup_prefix(keys) == 0, "the erased blocks came back"
        assert not list((tmpfs / "disk").rglob("*.kvb")), "the tombstone removed the files at the start"
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], capture_output=True)
        if s.srv is not None and s.srv.proc.poll() is None:
            s.stop()


def test_control_an_erasure_the_disk_carries_out_reports_every_block_erased(tmp_path, tmpfs):
    keys = keys_for("erase-rw", 4)
    s = _spilled_server(tmp_path, tmpfs, "b", keys)
    try:
        answer = s.admin("erase", tenant="acme", namespace="b")
        assert answer.get("erased") == 4 and "refused" not in answer, answer
        assert not list((tmpfs / "disk").rglob("*.kvb"))
    finally:
        if s.srv is not None and s.srv.proc.poll() is None:
            s.stop()
