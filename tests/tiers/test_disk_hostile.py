"""The disk tier among races, other processes and a tampered directory: what it reads, erases and
removes is only ever its own, and a block it merely lost track of is a miss, never a corruption
that takes other blocks along. (Each test failed before the fix it guards; see the comments.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers import direct_io
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, aligned_buffer
from kvtier.tiers.disk import STALE_TEMP_S, DiskTier
from kvtier.tiers.disk_extents import link_target
from tests.tiers.test_disk import _flip
from tests.tiers.test_disk_extents import ON_DISK, _as_symlinks, _retable, data, extents, k, put_chain, read_all


def _age(path, seconds: float = STALE_TEMP_S + 60) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old), follow_symlinks=False)


# -- a read that meets a block removed meanwhile -------------------------------------------------
def test_a_get_racing_the_delete_of_its_packed_block_is_a_miss_and_keeps_the_extent(tmp_path):
    """The delete lands after the get opened the extent and before it read the (now punched)
    bytes. It used to count a verify failure and, the entry being gone, unlink the path it read:
    the extent's own name, losing the other blocks."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(4)) == [Status.OK] * 4
        real_read = tier._io.read
        fired = []

        def read_after_a_racing_delete(fd, out, accept, *, base=0):
            if not fired:
                fired.append(tier.delete(k(1)))  # another thread's delete, between open and read
            return real_read(fd, out, accept, base=base)

        tier._io.read = read_after_a_racing_delete
        status = tier.get(k(1), aligned_buffer(ON_DISK - PAGE))
        tier._io.read = real_read
        assert fired == [True]
        assert status is Status.MISS and tier.stats.verify_failures == 0
        assert len(extents(tmp_path)) == 1
        statuses, outs = read_all(tier, [0, 2, 3])
        assert statuses == [Status.OK] * 3 and all(np.array_equal(o, data(i)) for i, o in zip([0, 2, 3], outs))
        tier.check_integrity(deep=True)


def test_get_many_whose_adoption_evicts_a_block_already_looked_up(tmp_path):
    """One thread: adopting k(9) (another process's) evicts k(0), already looked up by the same
    get_many; its read meets the hole. A miss, and pinned k(1) of the same extent is still served."""
    with DiskTier(tmp_path, 2 * ON_DISK) as tier:
        assert put_chain(tier, range(2)) == [Status.OK] * 2
        assert tier.pin(k(1))
        with DiskTier(tmp_path, 1 << 30) as other:
            assert other.put(k(9), data(9)) is Status.OK
        statuses, _ = read_all(tier, [0, 9])
        assert statuses == [Status.MISS, Status.OK] and tier.stats.verify_failures == 0
        assert len(extents(tmp_path)) == 1
        assert read_all(tier, [1])[0] == [Status.OK]
        tier.check_integrity()


def test_a_damaged_block_read_back_by_records_is_erased_but_not_its_extent(tmp_path):
    """Control of the same path with a real failure: records() removes a block whose header page is
    damaged, erasing it in place; the extent and its other blocks stay."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(3)) == [Status.OK] * 3
        path, base = tier.locate(k(1))
        _flip(path, base + HEADER_NBYTES + 9)  # in its record: the record's check no longer holds
        assert sorted(r.key for r in tier.records()) == [k(0), k(2)]
        assert tier.stats.verify_failures == 1 and not os.path.lexists(tier.path_of(k(1)))
        assert len(extents(tmp_path)) == 1 and read_all(tier, [0, 2])[0] == [Status.OK] * 2
        tier.check_integrity(deep=True)


# -- extents shared with other processes ----------------------------------------------------------
def test_another_instance_removing_the_only_block_it_adopted_keeps_the_extent(tmp_path):
    """It started first, adopted k(0) on a lookup, evicted it: its last indexed block of the extent.
    It used to unlink the extent's own name then, and the writer's three other blocks were lost
    (misses, their space held by their names and counted by nobody). Now it erases k(0) in place."""
    with DiskTier(tmp_path, 2 * ON_DISK) as other:
        with DiskTier(tmp_path, 1 << 30) as writer:
            assert put_chain(writer, range(4)) == [Status.OK] * 4
            assert other.contains(k(0))
            assert other.put(k(100), data(100)) is Status.OK
            assert other.put(k(101), data(101)) is Status.OK  # evicts k(0) (LRU)
            assert not other.contains(k(0))
            assert len(extents(tmp_path)) == 1
            statuses, outs = read_all(writer, [1, 2, 3])
            assert statuses == [Status.OK] * 3 and all(np.array_equal(o, data(i)) for i, o in zip([1, 2, 3], outs))
            assert read_all(writer, [0])[0] == [Status.MISS]  # erased elsewhere: a miss
            path, base = writer.locate(k(1))[0], PAGE  # k(0) is the first block, after one table page
            with open(path, "rb") as f:
                f.seek(base)
                assert f.read(ON_DISK) == bytes(ON_DISK), "k(0) was not erased"
            other.check_integrity()
            writer.check_integrity()
            # control: once no block's name is left, the last instance to drop it removes the extent
            for i in (1, 2, 3):
                assert writer.delete(k(i))
            assert extents(tmp_path) == [] and writer.used_bytes == 0


def test_an_extent_from_before_tables_is_left_to_a_restart(tmp_path):
    """Symbolic-link names do not show in the extent's link count: removing the last block this
    process indexed erases it but leaves the file (another process may index its other blocks).
    Control: a restart, finding no link to it, removes it."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(2)) == [Status.OK] * 2
        _as_symlinks(tier, range(2))
    with DiskTier(tmp_path, 1 << 30) as tier:
        (extent,) = extents(tmp_path)
        assert tier.delete(k(0)) and tier.delete(k(1))
        assert extent.exists() and tier.used_bytes == 0
        tier.check_integrity()
    _age(extent)
    with DiskTier(tmp_path, 1 << 30):
        assert not extent.exists()


# -- a tampered directory ------------------------------------------------------------------------
def test_an_extent_name_swapped_for_a_link_out_of_the_directory_is_never_written(tmp_path):
    """After k(1) was indexed, its extent's name becomes a symbolic link to a file elsewhere.
    Removing k(1) used to open it (following the link) and punch or zero the place there."""
    victim = tmp_path / "victim.db"
    victim.write_bytes(b"A" * (4 * ON_DISK))
    root = tmp_path / "cache"
    with DiskTier(root, 1 << 30) as tier:
        assert put_chain(tier, range(3)) == [Status.OK] * 3
        (extent,) = extents(root)
        os.rename(extent, root / "00" / "moved-away")
        os.symlink(victim, extent)
        assert tier.delete(k(1))
        assert read_all(tier, [0])[0] == [Status.MISS]  # its extent is no file of ours now
    assert victim.read_bytes() == b"A" * (4 * ON_DISK), "the tier wrote into a file outside its directory"


def test_an_extent_name_swapped_for_another_file_is_never_written(tmp_path):
    """The same with another regular file renamed onto the extent's name: not the inode the tier
    indexed, so nothing is erased in it. Control: the extent itself, still in place, is erased."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(3)) == [Status.OK] * 3
        (extent,) = extents(tmp_path)
        stranger = tmp_path / "00" / "stranger"
        stranger.write_bytes(Path(extent).read_bytes())
        os.rename(extent, tmp_path / "00" / "kept")
        os.rename(stranger, extent)
        assert tier.delete(k(1))
        assert Path(extent).read_bytes() == (tmp_path / "00" / "kept").read_bytes()
        os.rename(tmp_path / "00" / "kept", extent)  # control: back in place, the next delete erases
        assert tier.delete(k(2))
        with open(extent, "rb") as f:
            f.seek(PAGE + 2 * ON_DISK)
            assert f.read(ON_DISK) == bytes(ON_DISK)


def test_a_link_to_an_extent_that_is_a_link_out_of_the_directory_is_not_adopted(tmp_path):
    """Block links from before tables, planted to lead into an "extent" that is itself a link to a
    file elsewhere: not adopted (so never erased there)."""
    victim = tmp_path / "victim.db"
    victim.write_bytes(b"A" * (3 * PAGE))
    root = tmp_path / "cache"
    with DiskTier(root, 1 << 30) as tier:
        rel = f"ab/{'ab' * 32}-00000000.kvx"
        os.symlink(victim, root / rel)
        for i, offset in ((1, 0), (2, PAGE)):
            os.symlink(link_target(rel, offset, PAGE), tier.path_of(k(i)))
        assert not tier.contains(k(1)) and not tier.contains(k(2))
        tier.delete(k(1))
    with DiskTier(root, 1 << 30) as again:  # nor at a restart
        assert not again.contains(k(2))
        again.delete(k(2))
    assert victim.read_bytes() == b"A" * (3 * PAGE)


@pytest.mark.parametrize("how", ["offset one page into k(4)", "length spanning k(3)", "symlink into k(4)"])
def test_removing_a_tampered_key_never_erases_another_block(tmp_path, how):
    """k(2)'s place, rewritten, starts inside k(4)'s payload (no header there to tell) or spans k(3)
    (its own header first). Removing k(2) used to punch the neighbour. Control: k(2)'s entry and name
    go, and an untampered key's removal still erases its block."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(6)) == [Status.OK] * 6
        off2, off4 = tier.locate(k(2))[1], tier.locate(k(4))[1]
        if how == "offset one page into k(4)":
            _retable(tier, {2: (off4 + PAGE, ON_DISK)})
        elif how == "length spanning k(3)":
            _retable(tier, {2: (off2, 2 * ON_DISK)})
        else:  # an extent from before tables
            _as_symlinks(tier, range(6))
            rel = os.path.relpath(tier.locate(k(0))[0], tier.path)
            os.unlink(tier.path_of(k(2)))
            os.symlink(link_target(rel, off4 + PAGE, ON_DISK), tier.path_of(k(2)))
        path = tier.locate(k(0))[0]
    with DiskTier(tmp_path, 1 << 30) as again:
        assert read_all(again, [2])[0] != [Status.OK]  # not served, and removed
        assert not os.path.lexists(again.path_of(k(2)))
        victim = 3 if how.startswith("length") else 4
        statuses, outs = read_all(again, [victim])
        assert statuses == [Status.OK] and np.array_equal(outs[0], data(victim))
        assert again.delete(k(5))
        with open(path, "rb") as f:
            f.seek(again.locate(k(0))[1] + 5 * ON_DISK)
            assert f.read(ON_DISK) == bytes(ON_DISK)
        again.check_integrity()


def _get_in_thread(tier: DiskTier, key: bytes, path: str, many: bool) -> list:
    result = []

    def get():
        out = aligned_buffer(ON_DISK - PAGE)
        result.append(tier.get_many([key], [out])[0] if many else tier.get(key, out))

    th = threading.Thread(target=get, daemon=True)
    th.start()
    th.join(5)
    if th.is_alive():  # release the stuck open so that the test process can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        th.join(5)
        return ["hung"]
    return result


@pytest.mark.parametrize("direct", ["auto", False])
@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("where", ["extent", "file of its own"])
def test_a_fifo_swapped_in_for_a_file_is_a_miss_not_a_hang(tmp_path, where, many, direct):
    """A get used to open what it had indexed without O_NONBLOCK and block on a FIFO put there
    (with O_DIRECT, the open failed instead: an error). Control: the other blocks are still served."""
    with DiskTier(tmp_path, 1 << 30, direct_io=direct) as tier:
        assert put_chain(tier, range(3)) == [Status.OK] * 3
        assert tier.put(k(7), data(7)) is Status.OK
        key = k(1) if where == "extent" else k(7)
        path = tier.locate(key)[0]
        fifo = str(tmp_path / "00" / "planted")
        os.mkfifo(fifo)
        os.rename(fifo, path)
        assert _get_in_thread(tier, key, path, many) == [Status.MISS]
        others = [0, 2] if where == "file of its own" else []
        assert read_all(tier, others)[0] == [Status.OK] * len(others)


def test_a_restart_never_follows_a_shard_link_out_of_the_directory(tmp_path):
    """A shard that is a symbolic link elsewhere: the scan used to enter it and remove an
    extent-named file (no name reaching it) and an old ``.tmp`` there."""
    outside = tmp_path / "someone_elses"
    outside.mkdir()
    precious = [outside / f"{'ab' * 32}-00000000.kvx", outside / "report.tmp"]
    for p in precious:
        p.write_bytes(b"precious")
        _age(p)
    root = tmp_path / "cache"
    root.mkdir()
    os.symlink(outside, root / "ab")
    with DiskTier(root, 1 << 30):
        pass
    assert all(p.exists() for p in precious)


def test_only_our_own_temp_names_are_ever_stale():
    """An old temp file is a dead writer's only if its name is one a writer of ours made; control:
    such a name, old, is stale."""
    now = time.time()
    old = now - 2 * STALE_TEMP_S
    ours = f".{k(1).hex()}.{direct_io.temp_tag()}.tmp"
    assert direct_io.stale_temp(ours, old, now, STALE_TEMP_S)
    assert not direct_io.stale_temp(ours, now, now, STALE_TEMP_S)  # ours, live, young
    for name in ("report.tmp", ".report.tmp", ".a.b.c.d.tmp", f".{k(1).hex()}.xyz.1.host.tmp"):
        assert not direct_io.stale_temp(name, old, now, STALE_TEMP_S), name


# -- a restart while another process publishes ---------------------------------------------------
def test_a_restart_while_another_process_links_its_batch_keeps_the_batch(tmp_path):
    """Another tier starts between the writer's rename of its extent and the links of its names:
    its scan used to remove the extent at once (no name reached it yet), and the batch failed."""
    with DiskTier(tmp_path, 1 << 30) as writer:
        real = writer._link_all
        started = []

        def link_after_another_start(rel, keys):
            started.append(DiskTier(tmp_path, 1 << 30))
            return real(rel, keys)

        writer._link_all = link_after_another_start
        statuses = put_chain(writer, range(4))
        writer._link_all = real
        assert started and started[0].used_bytes == 0  # the writer counts its own extent
        assert statuses == [Status.OK] * 4 and len(extents(tmp_path)) == 1
        assert read_all(started[0], range(4))[0] == [Status.OK] * 4  # found by their names now
        started[0].close()


@pytest.mark.parametrize("old", [False, True])
def test_a_name_whose_extent_the_scan_did_not_find_is_judged_only_when_old(tmp_path, old):
    """A name linked to an extent the scan passed before it was renamed in (here: moved away
    during the restart) is left alone while young, and found once the extent is there; an old one
    is a dead extent's name and removed (control)."""
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert put_chain(tier, range(2)) == [Status.OK] * 2
    (extent,) = extents(tmp_path)
    if old:
        _age(extent)
    os.rename(extent, tmp_path / "00" / "in-flight")
    with DiskTier(tmp_path, 1 << 30) as again:
        os.rename(tmp_path / "00" / "in-flight", extent)
        assert os.path.exists(again.path_of(k(1))) is not old
        assert read_all(again, [0, 1])[0] == [Status.MISS if old else Status.OK] * 2


def test_a_block_file_with_a_second_link_is_a_block_of_its_own(tmp_path):
    """A hard-link snapshot (``cp -al``) gives a plain block file a second name: it used to be taken
    for an extent's name and removed at a restart, and missed by another process."""
    root = tmp_path / "cache"
    with DiskTier(root, 1 << 30) as tier:
        assert tier.put(k(7), data(7)) is Status.OK
        name = tier.path_of(k(7))
        os.link(name, tmp_path / "snapshot.kvb")
        with DiskTier(root, 1 << 30) as other:  # another process finds it by its name
            statuses, outs = read_all(other, [7])
            assert statuses == [Status.OK] and np.array_equal(outs[0], data(7))
    with DiskTier(root, 1 << 30) as again:
        statuses, outs = read_all(again, [7])
        assert statuses == [Status.OK] and np.array_equal(outs[0], data(7))
        again.check_integrity(deep=True)
    assert os.path.exists(name)
