"""Removing a packed block's last name: on a full disk, and racing another process's writer.

A block's last name is renamed to a temp name of its remover before the extent's own name and that
temp are unlinked (so that a kill halfway leaves nothing a restart takes for a block). Two ways
that went wrong (audit s34 a1):

- D2: the rename to the longer temp name may need a new directory block, which a full file system
  or a spent quota refuses (ENOSPC, EDQUOT) where an unlink never does: the delete was refused and
  eviction freed nothing on the one medium where it has to. Such a name is now unlinked in place.
- D3: two processes sharing the directory: a remover that judged a name its extent's last, racing
  the writer linking another block's name into that extent, removed the extent's own name and left
  the new name the only link to a whole extent: the writer's put said OK, its get missed, and a
  restart counted a corrupt block. The remover now keeps the extent named when another name links
  to it after all, the writer checks the extent's own name after linking (a block whose extent went
  is written again on its own), and a restart's first read of such a name is a miss, not a corrupt
  block.

Two tiers on one directory stand for two processes; threads and events force the interleaving.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.child_process import host_tag
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, aligned_buffer
from kvtier.tiers.disk import DiskTier

NBYTES = 3 * PAGE + 100


def _key(i: int) -> bytes:
    return hashlib.sha256(b"s34-disk-last-name/%d" % i).digest()


def _payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def _read_back(tier: DiskTier, i: int) -> Status:
    """``tier.get`` of block ``i``; OK only with its very bytes."""
    out = np.empty(NBYTES, np.uint8)
    status = tier.get(_key(i), out)
    assert status is not Status.OK or np.array_equal(out, _payload(i))
    return status


def _put_last_names(path: Path, extents: int) -> None:
    """``extents`` extents of two blocks each, the first of each deleted: each extent is reached by
    one block's name (blocks 1, 3, 5, ...), its last."""
    with DiskTier(path, 1 << 30) as tier:
        for e in range(extents):
            first, second = 2 * e, 2 * e + 1
            assert tier.put_many([_key(first), _key(second)], [_payload(first), _payload(second)]) == [Status.OK] * 2
            assert tier.delete(_key(first))
    assert len(list(path.rglob("*.kvx"))) == extents


def _refuse_parking(monkeypatch, code: int) -> list[str]:
    """Fail every rename of a block's name to its remover's temp name with ``code`` (what a
    directory that cannot grow answers); the refused targets are listed."""
    real_rename, refused = os.rename, []

    def rename(src, dst, *args, **kwargs):
        if str(src).endswith(".kvb") and os.path.basename(dst).startswith(".") and str(dst).endswith(".tmp"):
            refused.append(dst)
            raise OSError(code, os.strerror(code), dst)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    return refused


# -- D2: a full disk ---------------------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EMLINK], ids=["ENOSPC", "EDQUOT", "EMLINK"])
def test_a_last_name_that_cannot_be_parked_is_unlinked_in_place_with_its_extent(tmp_path, monkeypatch, code):
    _put_last_names(tmp_path, 1)
    with DiskTier(tmp_path, 1 << 30) as tier:
        refused = _refuse_parking(monkeypatch, code)
        assert tier.delete(_key(1)) is True, "an unlink needs no room: the delete is done"
        assert refused
        assert tier.stats.errors == 0 and tier.used_bytes == 0
        assert _read_back(tier, 1) is Status.MISS
        tier.check_integrity(deep=True)
    assert _files(tmp_path) == [], "the block's name and its extent went, and no temp was left"


def test_eviction_frees_room_on_a_full_disk_where_names_cannot_be_parked(tmp_path, monkeypatch):
    _put_last_names(tmp_path, 4)
    with DiskTier(tmp_path, 1 << 30) as tier:
        used = tier.used_bytes
    with DiskTier(tmp_path, used) as tier:  # exactly full: a put evicts a last name first
        _refuse_parking(monkeypatch, errno.ENOSPC)
        assert tier.put(_key(100), _payload(100)) is Status.OK
        assert tier.stats.evictions >= 1 and tier.stats.errors == 0
        assert _read_back(tier, 100) is Status.OK
        tier.check_integrity(deep=True)
    assert len(list(tmp_path.rglob("*.kvx"))) < 4


def _dead_writers_name(extent: Path) -> Path:
    """``extent`` as a writer that has died would have named it (a pid no process holds)."""
    first, rand, _pid, tag = extent.name[: -len(".kvx")].split("-")
    assert tag == host_tag()
    return extent.with_name(f"{first}-{rand}-{2 ** 22 + 12345}-{tag}.kvx")


@pytest.mark.parametrize("judged_by", ["its writer is dead", "it is stale"])
def test_a_remover_killed_between_the_in_place_unlinks_leaves_an_extent_a_restart_reclaims(tmp_path, judged_by):
    """The in-place removal unlinks the block's name, then the extent's own name: a kill between
    them leaves an extent no block reaches, which a restart removes once its writer is known dead
    or it is older than any write takes (here this live process wrote it: named, or aged, as the
    restart would find it later)."""
    _put_last_names(tmp_path, 1)
    with DiskTier(tmp_path, 1 << 30) as tier:
        os.unlink(tier.path_of(_key(1)))  # what the remover did before it was killed
    (extent,) = tmp_path.rglob("*.kvx")
    if judged_by == "its writer is dead":
        extent.rename(_dead_writers_name(extent))
    else:
        old = extent.stat().st_mtime - 2 * 3600
        os.utime(extent, (old, old))
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert _read_back(tier, 1) is Status.MISS
        assert tier.used_bytes == 0 and tier.stats.verify_failures == 0
        tier.check_integrity(deep=True)
    assert _files(tmp_path) == []


# -- D3: racing another process's writer ---------------------------------------------------

class _PausedWriter:
    """Tier ``writer`` putting blocks 1 and 2 packed in one extent on a thread of its own, paused
    once block 1's name is linked (``linked_first``) until ``go`` is set; ``after_last(final)``
    runs on it once block 2's name is linked."""

    def __init__(self, writer: DiskTier, monkeypatch, after_last=lambda final: None) -> None:
        self.linked_first, self.go = threading.Event(), threading.Event()
        self.statuses: list[Status] | None = None
        real_rename, finals = os.rename, []

        def rename(src, dst, *args, **kwargs):
            done = real_rename(src, dst, *args, **kwargs)
            if threading.current_thread() is self.thread and str(dst).endswith(".kvb"):
                finals.append(dst)
                if len(finals) == 1:
                    self.linked_first.set()
                    assert self.go.wait(10)
                elif len(finals) == 2:
                    after_last(dst)
            return done

        monkeypatch.setattr(os, "rename", rename)
        self.thread = threading.Thread(target=self._put, args=(writer,))
        self.thread.start()
        assert self.linked_first.wait(10)

    def _put(self, writer: DiskTier) -> None:
        self.statuses = writer.put_many([_key(1), _key(2)], [_payload(1), _payload(2)])

    def finish(self) -> list[Status]:
        self.go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.statuses


def _bytes_on_disk(path: Path, i: int) -> bool:
    """Whether block ``i``'s payload is in any file under ``path``."""
    return any(_payload(i).tobytes() in p.read_bytes() for p in _files(path))


def test_a_name_linked_while_a_remover_took_the_extents_last_name_keeps_its_block(tmp_path, monkeypatch):
    """The remover judged block 1's name the extent's last; the writer then linked block 2's name
    (and finished its put) before the remover unlinked anything. Block 2 stays readable to its
    writer and after a restart; block 1's bytes are erased."""
    remover, writer = DiskTier(tmp_path, 1 << 30), DiskTier(tmp_path, 1 << 30)
    paused = _PausedWriter(writer, monkeypatch)
    judged = remover._last_name

    def last_name_then_the_writer_links(key, entry):
        last = judged(key, entry)
        assert paused.finish() == [Status.OK, Status.OK]
        return last

    remover._last_name = last_name_then_the_writer_links
    try:
        assert remover.delete(_key(1)) is True
        assert _read_back(writer, 2) is Status.OK, "the writer was told OK: its block is there"
        assert _read_back(remover, 2) is Status.OK
        assert _read_back(remover, 1) is Status.MISS
        assert writer.stats.verify_failures == remover.stats.verify_failures == 0
        writer.check_integrity(deep=True)
        remover.check_integrity(deep=True)
    finally:
        remover.close()
        writer.close()
    assert not _bytes_on_disk(tmp_path, 1), "a deleted block's bytes are erased"
    with DiskTier(tmp_path, 1 << 30) as restarted:
        assert _read_back(restarted, 2) is Status.OK
        assert _read_back(restarted, 1) is Status.MISS
        assert restarted.stats.verify_failures == 0
        restarted.check_integrity(deep=True)


def test_a_put_whose_extent_loses_its_own_name_while_linking_writes_its_blocks_again(tmp_path, monkeypatch):
    """The extent's own name goes after the writer linked its blocks' names (a remover of another
    process took it for the last and stopped halfway): the names would be the only links to a whole
    extent, blocks no get finds. The writer's check sees it and writes the blocks again on their own."""
    writer = DiskTier(tmp_path, 1 << 30)

    def remove_the_extents_own_name(final):
        (extent,) = tmp_path.rglob("*.kvx")
        extent.unlink()

    paused = _PausedWriter(writer, monkeypatch, after_last=remove_the_extents_own_name)
    try:
        assert paused.finish() == [Status.OK, Status.OK]
        assert _read_back(writer, 1) is Status.OK and _read_back(writer, 2) is Status.OK
        assert writer.stats.verify_failures == 0
        writer.check_integrity(deep=True)
    finally:
        writer.close()
    with DiskTier(tmp_path, 1 << 30) as restarted:
        assert _read_back(restarted, 1) is Status.OK and _read_back(restarted, 2) is Status.OK
        assert restarted.stats.verify_failures == 0
        restarted.check_integrity(deep=True)
    assert not list(tmp_path.rglob("*.kvx")) and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("read", ["get", "get_many"])
def test_a_name_left_the_only_link_to_a_whole_extent_is_a_miss_after_a_restart_not_a_corrupt_block(
        tmp_path, read):
    """A restart indexes such a name as a block file of its own (it reads no page per block file);
    the first read sees the extent's table where a header should be: a miss, the name removed (the
    extent's space with it), no failed verification."""
    _put_last_names(tmp_path, 1)
    (extent,) = tmp_path.rglob("*.kvx")
    extent.unlink()  # (a remover or writer of an older version, stopped halfway)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert tier.used_bytes > 0, "indexed by its name, as a block file"
        if read == "get":
            status = _read_back(tier, 1)
        else:
            (status,) = tier.get_many([_key(1)], [aligned_buffer(NBYTES)])
        assert status is Status.MISS
        assert tier.stats.verify_failures == 0, "no block was written there: none is corrupt"
        assert tier.used_bytes == 0 and _key(1) not in set(tier.keys())
        tier.check_integrity(deep=True)
    assert _files(tmp_path) == []
