"""What kvtier creates on disk is its owner's only: files 0600, directories 0700, under any umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvtier.private_files import make_private_dirs
from kvtier.server.audit import AuditLog
from kvtier.server.runtime_state import RuntimeState
from kvtier.tiers import direct_io
from kvtier.tiers.disk import DiskTier


@pytest.fixture
def umask_022():
    """The usual umask, which leaves 0644 files and 0755 directories unless modes are set on purpose."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_disk_tier_blocks_are_0600_and_its_directories_0700(tmp_path, umask_022):
    root = tmp_path / "missing-parent" / "tier"  # both made by the tier
    with DiskTier(root, 64 << 20) as tier:
        block = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
        for i in range(8):
            assert tier.put(bytes([i]) * 32, block).ok
        # a shard directory someone removed is made again by the next write into it
        victim = root / "ab"
        victim.rmdir()
        assert tier.put(bytes([0xAB]) * 32, block).ok
    files = [p for p in root.rglob("*") if p.is_file()]
    dirs = [root.parent, root, *(p for p in root.rglob("*") if p.is_dir())]
    assert len(files) == 9 and victim.is_dir()
    assert {oct(mode(p)) for p in files} == {"0o600"}, "block files readable by other users"
    assert {oct(mode(p)) for p in dirs} == {"0o700"}, "tier directories listable by other users"


def test_files_opened_for_writing_are_0600(tmp_path, umask_022, monkeypatch):
    """Temp files (published by rename, so their mode is the block's) and the O_DIRECT probe."""
    io = direct_io.BlockIO(False)
    fd = io.open_write(str(tmp_path / "t.tmp"))
    os.close(fd)
    assert mode(tmp_path / "t.tmp") == 0o600
    io.close()
    seen = []
    real_open = os.open

    def spy(path, flags, m=0o777, *a, **k):
        if flags & os.O_CREAT:
            seen.append(m)
        return real_open(path, flags, m, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    direct_io.probe_direct_io(str(tmp_path))
    monkeypatch.undo()
    assert seen and all(m == 0o600 for m in seen)


def test_existing_directories_keep_their_mode(tmp_path, umask_022):
    """The operator's directory (a shared mount, say) is theirs to set up; only what kvtier makes is 0700."""
    given = tmp_path / "given"
    given.mkdir(mode=0o755)
    make_private_dirs(given / "a" / "b")
    assert (mode(given), mode(given / "a"), mode(given / "a" / "b")) == (0o755, 0o700, 0o700)


def test_server_state_and_audit_files_are_private(tmp_path, umask_022):
    state = RuntimeState(str(tmp_path / "state" / "runtime.json"))
    state.set_quota("acme", 1 << 20)
    assert mode(tmp_path / "state") == 0o700
    assert mode(tmp_path / "state" / "runtime.json") == 0o600
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    audit.write("login_failed", peer="10.0.0.1")
    audit.close()
    assert mode(tmp_path / "audit.jsonl") == 0o600
