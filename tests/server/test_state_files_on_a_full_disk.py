"""The server's small state files on a disk that fills up: ``runtime.json`` (admin changes,
erasure tombstones) and ``server.secret`` (the spill secret) are written whole or not at all, so
that a full disk never leaves a file that stops every later start. Real files on a small tmpfs.

(s30 audit a3: D3, a write of runtime.json the full disk cut short was reported saved, then the
next start refused the torn file; D5, a secret whose write failed was left empty in place, and every
later start refused it.)"""

from __future__ import annotations

import os
import stat
import threading

import pytest

from kvtier.errors import ConfigError
from kvtier.server.runtime_state import RuntimeState
from kvtier.server.spill import SECRET_FILE, secret_in
from tests.tmpfs import mounted_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _fill(mnt, leave: int = 0):
    """Fill the file system at ``mnt`` but for about ``leave`` bytes; returns the filler's path."""
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        try:
            while _free(mnt) > leave:
                f.write(b"x" * 4096)
                f.flush()
        except OSError:
            pass  # full
    return filler


def _free(mnt) -> int:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


def test_a_runtime_change_the_full_disk_cuts_short_is_refused_and_the_old_file_kept(small_disk):
    path = small_disk / "state" / "runtime.json"
    state = RuntimeState(str(path))
    for i in range(3000):  # an operator's per-namespace TTLs: about 130 KB of JSON
        state.namespace_ttl_s[("acme", f"ns-{i:05d}")] = 600.0
    state.set_ttl("acme", 600.0, None)
    saved = path.read_bytes()
    filler = _fill(small_disk, leave=48 << 10)  # room for part of it: a write is cut short, with no error
    with pytest.raises(OSError):
        state.set_quota("acme", 1 << 30)
    assert "acme" not in state.quota  # not saved: not changed
    assert path.read_bytes() == saved
    assert os.listdir(path.parent) == ["runtime.json"], "a temp file was left behind"
    filler.unlink()
    restarted = RuntimeState(str(path))  # before the fix: "runtime overrides ... are unreadable"
    assert restarted.tenant_ttl_s == {"acme": 600.0} and len(restarted.namespace_ttl_s) == 3000
    restarted.set_quota("acme", 1 << 30)  # with room again, a change is kept
    assert RuntimeState(str(path)).quota == {"acme": 1 << 30}


def test_a_secret_the_full_disk_refused_is_made_at_the_next_start(small_disk):
    disk_dir = small_disk / "disk"
    disk_dir.mkdir()
    filler = _fill(small_disk)
    with pytest.raises(OSError):
        secret_in(str(disk_dir))
    assert os.listdir(disk_dir) == [], "a secret cut short (or its temp file) was left behind"
    filler.unlink()
    secret = secret_in(str(disk_dir))  # before the fix: "is not a 32-byte secret; remove it"
    assert len(secret) == 32 and secret_in(str(disk_dir)) == secret
    assert stat.S_IMODE((disk_dir / SECRET_FILE).stat().st_mode) == 0o600
    assert os.listdir(disk_dir) == [SECRET_FILE]


def _secret_file(disk_dir, data: bytes, mode: int = 0o600):
    path = disk_dir / SECRET_FILE
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_an_empty_secret_an_older_version_left_is_made_anew(tmp_path):
    """(An older version created it in place: a crash before its write left it empty; no block was
    annotated under it.)"""
    path = _secret_file(tmp_path, b"")
    secret = secret_in(str(tmp_path))
    assert len(secret) == 32 and path.read_bytes() == secret and secret_in(str(tmp_path)) == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("data,mode,refusal", [(b"s" * 16, 0o600, "32-byte"), (b"", 0o644, "mode 0600")],
                         ids=["short", "empty-but-readable-by-others"])
def test_a_secret_of_another_length_or_mode_is_still_refused(tmp_path, data, mode, refusal):
    path = _secret_file(tmp_path, data, mode)
    with pytest.raises(ConfigError, match=refusal):
        secret_in(str(tmp_path))
    assert path.read_bytes() == data  # left as it was, for its owner to judge


@pytest.mark.parametrize("empty_before", [False, True], ids=["none", "empty"])
def test_starters_racing_on_one_directory_all_get_the_same_secret(tmp_path, empty_before):
    if empty_before:
        _secret_file(tmp_path, b"")
    got, go = [], threading.Barrier(8)

    def start():
        go.wait()
        got.append(secret_in(str(tmp_path)))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and len(set(got)) == 1 and (tmp_path / SECRET_FILE).read_bytes() == got[0]
    assert os.listdir(tmp_path) == [SECRET_FILE]
