"""The disk tier's packed extents: ``put_many`` writes one file, ``get_many`` reads a run of it with
few requests, every block still verified on its own; erasure, eviction, restarts, other processes.
Reads land in page-aligned buffers poisoned before them (the direct paths, not the staged ones)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers import direct_io, disk_extents
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, aligned_buffer
from kvtier.tiers.disk import STALE_TEMP_S, DiskTier
from kvtier.tiers.disk_extents import link_target, pack_table, parse_link, read_table
from tests.tiers.test_disk import _flip  # one byte flipped in place

ROOT = Path(__file__).resolve().parents[2]
NB = 64 * 1024  # 16 KiB-token-sized blocks would do as well; small keeps the tests fast
ON_DISK = PAGE + NB
POISON = 0xA5


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int, nbytes: int = NB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def poisoned(nbytes: int = NB) -> np.ndarray:
    out = aligned_buffer(nbytes)
    out.fill(POISON)
    return out


def put_chain(tier: DiskTier, ids, nbytes: int = NB) -> list[Status]:
    return tier.put_many([k(i) for i in ids], [data(i, nbytes) for i in ids])


def read_all(tier: DiskTier, ids, nbytes: int = NB) -> tuple[list[Status], list[np.ndarray]]:
    outs = [poisoned(nbytes) for _ in ids]
    return tier.get_many([k(i) for i in ids], outs), outs


def extents(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvx"))


def count_preadv(monkeypatch) -> list[int]:
    calls = []
    real = os.preadv

    def spy(fd, iov, offset):
        calls.append(sum(memoryview(v).nbytes for v in iov))
        return real(fd, iov, offset)

    monkeypatch.setattr(direct_io.os, "preadv", spy)
    return calls


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "d", 1 << 30)
    yield t
    t.close()


@pytest.mark.parametrize("nbytes", [NB, NB + 100, 1])
def test_put_many_packs_one_extent_and_get_many_reads_it_in_few_requests(tier, tmp_path, monkeypatch, nbytes):
    ids = range(16)
    assert put_chain(tier, ids, nbytes) == [Status.OK] * 16
    assert len(extents(tmp_path / "d")) == 1
    names = [Path(tier.path_of(k(i))) for i in ids]
    extent = os.stat(extents(tmp_path / "d")[0])
    # each block keeps its name, a hard link to the extent: a directory entry, not an inode per block
    assert all(stat.S_ISREG(os.lstat(p).st_mode) and os.lstat(p).st_ino == extent.st_ino for p in names)
    assert extent.st_nlink == 1 + 16
    with open(names[3], "rb") as f:  # a name opened as a file shows the table, not a block
        assert f.read(4) == b"KVXT"
    tier.check_integrity(deep=True)
    calls = count_preadv(monkeypatch)
    statuses, outs = read_all(tier, ids, nbytes)
    assert statuses == [Status.OK] * 16
    assert all(np.array_equal(o, data(i, nbytes)) for i, o in zip(ids, outs))
    per_request = -(-direct_io.RUN_REQUEST_BYTES // (PAGE + direct_io.round_up(nbytes)))
    assert len(calls) == -(-16 // per_request), calls
    # Positive control: the same blocks written one file each take a request per block.
    with DiskTier(tmp_path / "files", 1 << 30, pack_batches=False) as files:
        assert put_chain(files, ids, nbytes) == [Status.OK] * 16
        assert extents(tmp_path / "files") == []
        calls.clear()
        assert read_all(files, ids, nbytes)[0] == [Status.OK] * 16
        assert len(calls) == 16


def test_get_many_in_any_order_and_mixed_with_files_and_misses(tier):
    assert put_chain(tier, range(8)) == [Status.OK] * 8
    assert tier.put(k(20), data(20)) is Status.OK  # a file of its own
    ids = [5, 20, 0, 99, 1, 2, 7, 6]
    statuses, outs = read_all(tier, ids)
    assert statuses == [Status.MISS if i == 99 else Status.OK for i in ids]
    assert all(np.array_equal(o, data(i)) for i, o, s in zip(ids, outs, statuses) if s is Status.OK)
    for i in range(8):  # and one by one (get, the sealed-stream path's reader)
        out = poisoned()
        assert tier.get(k(i), out) is Status.OK and np.array_equal(out, data(i))


def test_a_batch_with_blocks_already_there_and_repeats(tier):
    assert tier.put(k(1), data(1)) is Status.OK
    keys = [k(0), k(1), k(2), k(2), k(3)]
    assert tier.put_many(keys, [data(0), data(1), data(2), data(2), data(3)]) == [Status.OK] * 5
    assert tier.stats.puts == 4  # k(1) was there, the repeat of k(2) is the same block
    tier.check_integrity(deep=True)
    assert read_all(tier, [0, 1, 2, 3])[0] == [Status.OK] * 4


@pytest.mark.parametrize("damage", ["payload", "header", "record", "last-byte"])
def test_a_damaged_block_in_an_extent_is_a_miss_and_only_it_goes(tier, damage):
    assert put_chain(tier, range(6)) == [Status.OK] * 6
    path, base = tier.locate(k(3))
    offset = {"payload": PAGE + NB // 2, "header": 40, "record": HEADER_NBYTES + 9, "last-byte": PAGE + NB - 1}[damage]
    _flip(path, base + offset)
    statuses, outs = read_all(tier, range(6))
    assert statuses == [Status.CORRUPT if i == 3 else Status.OK for i in range(6)]
    assert all(np.array_equal(outs[i], data(i)) for i in range(6) if i != 3)
    assert tier.stats.verify_failures == 1
    assert not tier.contains(k(3)) and not os.path.lexists(tier.path_of(k(3)))
    with open(path, "rb") as f:
        f.seek(base)
        erased = f.read(ON_DISK) == bytes(ON_DISK)
    if damage == "header":
        # a damaged header cannot tell that the place is exactly k(3)'s block (a tampered place may
        # lie inside a neighbour): its bytes are left, and their space stays counted until the extent goes
        assert not erased and tier.used_bytes == 6 * ON_DISK
    else:  # its bytes are erased (a hole) and its space is no longer counted
        assert erased and tier.used_bytes == 5 * ON_DISK
    tier.check_integrity(deep=True)


def _as_symlinks(tier: DiskTier, ids) -> None:
    """Give blocks ``ids`` the names extents had before tables: a symbolic link whose target is
    the block's place (``<rel>@<offset>:<length>``), as directories written then hold."""
    for i in ids:
        path, offset = tier.locate(k(i))
        name = tier.path_of(k(i))
        os.unlink(name)
        os.symlink(link_target(os.path.relpath(path, tier.path), offset, ON_DISK), name)


def _retable(tier: DiskTier, moves: dict[int, int | tuple[int, int] | None]) -> None:
    """Rewrite the extent's table (with valid checks: anyone who can write the file can) so that
    block ``a`` is listed at block ``b``'s place, for each ``a: b`` of ``moves`` (``b`` an
    ``(offset, length)``: there; None: ``a`` no longer listed)."""
    path = tier.locate(k(0))[0]
    rel = os.path.relpath(path, tier.path)
    with open(path, "rb") as f:
        table = read_table(f.fileno(), os.fstat(f.fileno()).st_size)
    places = {key: (offset, length) for key, (_, offset, length) in table.blocks.items()}
    for a, b in moves.items():
        if b is None:
            del places[k(a)]
        else:
            places[k(a)] = b if isinstance(b, tuple) else places[k(b)]
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, pack_table(rel, [(key, o, n) for key, (o, n) in places.items()]).tobytes(), 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("names", ["hard links", "symlinks"])
def test_a_name_moved_onto_another_block_returns_neither(tier, names):
    """Tampering: k(2)'s place is now k(4)'s (its table entry rewritten, or, in a directory
    from before tables, its link). Reading k(2) must not return k(4)'s bytes (the header names
    its key), nor fail the read of k(4) itself."""
    assert put_chain(tier, range(6)) == [Status.OK] * 6
    if names == "symlinks":
        _as_symlinks(tier, range(6))
        rel = parse_link(os.readlink(tier.path_of(k(4))))
        os.unlink(tier.path_of(k(2)))
        os.symlink(link_target(*rel), tier.path_of(k(2)))
    else:
        _retable(tier, {2: 4})
    tier.close()
    with DiskTier(tier.path, 1 << 30) as again:
        # k(2) first, on its own: removing it must not erase the bytes its name led to (k(4)'s)
        statuses, outs = read_all(again, [2])
        assert statuses == [Status.CORRUPT]
        assert (outs[0] == POISON).all() or not np.array_equal(outs[0], data(2))
        statuses, outs = read_all(again, [4])
        assert statuses == [Status.OK] and np.array_equal(outs[0], data(4))


@pytest.mark.parametrize("target", ["../../etc/passwd", "00/nothing.kvx@0:69632", "{rel}@4097:69632", "{rel}@0:100"])
def test_links_that_point_nowhere_valid_are_dropped_at_restart(tier, target):
    """A directory from before tables: symbolic links that lead nowhere valid."""
    assert put_chain(tier, range(3)) == [Status.OK] * 3
    _as_symlinks(tier, range(3))
    rel = parse_link(os.readlink(tier.path_of(k(0))))[0]
    os.unlink(tier.path_of(k(1)))
    os.symlink(target.format(rel=rel), tier.path_of(k(1)))
    tier.close()
    with DiskTier(tier.path, 1 << 30) as again:
        assert not again.contains(k(1))
        assert read_all(again, [0, 2])[0] == [Status.OK] * 2
        again.check_integrity(deep=True)


@pytest.mark.parametrize("how", ["a file that is no extent", "another extent", "its entry gone", "none"])
def test_names_an_extent_table_does_not_list_are_dropped_at_restart_and_not_adopted(tier, tmp_path, how):
    """k(1)'s name is a hard link to something whose table does not list k(1): it is not
    served after a restart, nor to another process; the other blocks are. (A file with no table
    at all is taken for a block file of its own that is also linked elsewhere: its header, not
    k(1)'s, fails its read.) Control (``none``): untouched, k(1) is served both ways."""
    assert put_chain(tier, range(3)) == [Status.OK] * 3
    assert put_chain(tier, range(10, 13)) == [Status.OK] * 3
    name = tier.path_of(k(1))
    if how == "a file that is no extent":
        other = tmp_path / "d" / "00" / "stray"
        other.write_bytes(data(99).tobytes())
        os.unlink(name)
        os.link(other, name)
        os.link(other, tmp_path / "d" / "00" / "stray2")  # two names, as an extent's have
    elif how == "another extent":
        os.unlink(name)
        os.link(tier.locate(k(10))[0], name)
    elif how == "its entry gone":
        _retable(tier, {1: None})

    def served(t: DiskTier) -> bool:
        statuses, outs = read_all(t, [1])
        return statuses == [Status.OK] and np.array_equal(outs[0], data(1))

    with DiskTier(tier.path, 1 << 30) as other:  # another process, finding blocks by their names
        assert served(other) is (how == "none")
        assert other.contains(k(0)) and other.contains(k(11))
    tier.close()
    with DiskTier(tier.path, 1 << 30) as again:
        assert served(again) is (how == "none")
        assert read_all(again, [0, 2, 10, 11, 12])[0] == [Status.OK] * 5
        again.check_integrity(deep=True)


def test_an_erased_block_leaves_no_trace_of_its_key_in_the_extent(tier):
    """Erasure punches the block out and zeroes its table entry: its key is gone from the file.
    Control: a block kept is still listed, and its key is in the file. (Unrelated blocks: a
    chain's records would name a removed parent in its child's header.)"""
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    assert tier.put_many(keys, [data(i) for i in range(4)], parents=[None] * 4) == [Status.OK] * 4
    path = tier.locate(keys[0])[0]
    assert tier.delete(keys[2])
    raw = Path(path).read_bytes()
    assert keys[2] not in raw and keys[1] in raw
    with open(path, "rb") as f:
        listed = read_table(f.fileno(), os.fstat(f.fileno()).st_size).blocks
    assert set(listed) == {keys[0], keys[1], keys[3]}


def test_a_restart_rebuilds_the_index_from_the_links(tmp_path):
    with DiskTier(tmp_path, 1 << 30) as t:
        assert put_chain(t, range(10)) == [Status.OK] * 10
        assert put_chain(t, range(10, 14)) == [Status.OK] * 4
        assert t.put(k(50), data(50)) is Status.OK
        assert t.delete(k(3))
        used = t.used_bytes
    with DiskTier(tmp_path, 1 << 30) as t:
        assert sorted(t.keys()) == sorted(k(i) for i in [*range(10), *range(10, 14), 50] if i != 3)
        assert t.used_bytes == used == 14 * ON_DISK  # k(3)'s hole is not counted again
        statuses, outs = read_all(t, [i for i in range(14) if i != 3])
        assert statuses == [Status.OK] * 13
        t.check_integrity(deep=True)


def test_deleting_blocks_frees_their_space_and_the_last_one_the_extent(tier, tmp_path):
    assert put_chain(tier, range(8)) == [Status.OK] * 8
    (extent,) = extents(tmp_path / "d")
    allocated = os.stat(extent).st_blocks
    assert tier.delete(k(2)) and tier.delete(k(5))
    assert tier.used_bytes == 6 * ON_DISK
    # (the file system may take a page for its own extent map when a hole splits an extent)
    assert (allocated - os.stat(extent).st_blocks) * 512 >= 2 * ON_DISK - 2 * PAGE, "the holes were not punched"
    assert read_all(tier, [0, 1, 3, 4, 6, 7])[0] == [Status.OK] * 6
    assert read_all(tier, [2, 5])[0] == [Status.MISS] * 2
    tier.check_integrity(deep=True)
    for i in (0, 1, 3, 4, 6, 7):
        assert tier.delete(k(i))
    assert extents(tmp_path / "d") == [] and tier.used_bytes == 0
    tier.check_integrity(deep=True)


def test_without_hole_punching_the_space_stays_counted_until_the_extent_goes(tier, monkeypatch):
    monkeypatch.setattr("kvtier.tiers.disk_extents.punch_hole", lambda fd, offset, length: False)
    assert put_chain(tier, range(4)) == [Status.OK] * 4
    path, base = tier.locate(k(1))
    assert tier.delete(k(1))
    with open(path, "rb") as f:  # still erased: overwritten with zeros
        f.seek(base)
        assert f.read(ON_DISK) == bytes(ON_DISK)
    assert tier.used_bytes == 4 * ON_DISK, "bytes still on disk must still be counted"
    tier.check_integrity()
    for i in (0, 2, 3):
        assert tier.delete(k(i))
    assert tier.used_bytes == 0 and not os.path.exists(path)
    tier.check_integrity()


def test_eviction_of_packed_blocks_keeps_the_accounting_and_removes_empty_extents(tmp_path):
    with DiskTier(tmp_path, 12 * ON_DISK) as t:
        evicted = []
        t.on_evict = lambda key, view, meta: evicted.append((key, bytes(view[:64])))
        for batch in range(5):
            ids = range(batch * 4, batch * 4 + 4)
            assert put_chain(t, ids) == [Status.OK] * 4
            t.check_integrity(deep=True)
            assert t.used_bytes <= t.capacity_bytes
        assert [key for key, _ in evicted] == [k(i) for i in range(8)]  # LRU: the oldest batches
        assert all(head == data(int.from_bytes(key, "big"))[:64].tobytes() for key, head in evicted)
        assert len(extents(tmp_path)) == 3, "the extents of wholly evicted batches are gone"
        assert read_all(t, range(8, 20))[0] == [Status.OK] * 12


def test_a_batch_that_does_not_fit_whole_goes_block_by_block(tmp_path):
    with DiskTier(tmp_path, 3 * ON_DISK) as t:
        statuses = put_chain(t, range(5))
        assert statuses == [Status.OK] * 5  # each put made room for itself
        assert sorted(t.keys()) == [k(2), k(3), k(4)]
        assert extents(tmp_path) == []
        t.check_integrity(deep=True)


def test_a_full_disk_mid_extent_publishes_nothing(tier, tmp_path, monkeypatch):
    import errno

    real = direct_io.pwrite_all
    written = []

    def fill_up(fd, buf, offset):
        written.append(offset)
        if len(written) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, buf, offset)

    monkeypatch.setattr(direct_io, "pwrite_all", fill_up)
    assert put_chain(tier, range(6)) == [Status.FULL] * 6
    monkeypatch.undo()
    assert list((tmp_path / "d").rglob("*")) == [p for p in (tmp_path / "d").rglob("*") if p.is_dir()]
    assert tier.used_bytes == 0 and not any(tier.contains(k(i)) for i in range(6))
    tier.check_integrity()
    assert put_chain(tier, range(6)) == [Status.OK] * 6  # nothing was reserved for good


def test_another_process_finds_packed_blocks_and_its_delete_is_a_miss_here(tmp_path):
    with DiskTier(tmp_path, 1 << 30) as mine:
        assert put_chain(mine, range(4)) == [Status.OK] * 4
        code = (
            "import sys; import numpy as np\n"
            "from kvtier.tiers.disk import DiskTier\n"
            "from kvtier.tiers.direct_io import aligned_buffer\n"
            f"t = DiskTier({str(tmp_path)!r}, 1 << 30)\n"
            "keys = [i.to_bytes(32, 'big') for i in range(4)]\n"
            f"outs = [aligned_buffer({NB}) for _ in keys]\n"
            "print(','.join(s.name for s in t.get_many(keys, outs)))\n"
            "want = np.random.default_rng(2).integers(0, 256, 8, dtype=np.uint8)\n"
            "print(int(want.tolist() == outs[2][:8].tolist()))\n"
            "print(t.delete(keys[1]))\n"
        )
        # a restart-free view: the other process opens while this one still holds the blocks
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["OK,OK,OK,OK", "1", "True"]
        statuses, outs = read_all(mine, range(4))
        assert statuses == [Status.OK, Status.MISS, Status.OK, Status.OK]  # erased elsewhere: a miss, not corrupt
        assert mine.stats.verify_failures == 0
        assert (outs[1] == POISON).all() or not np.array_equal(outs[1], data(1))
        mine.check_integrity()


def test_a_truncated_extent_serves_what_it_still_holds_whole(tier, tmp_path):
    assert put_chain(tier, range(6)) == [Status.OK] * 6
    (extent,) = extents(tmp_path / "d")
    os.truncate(extent, 3 * ON_DISK + ON_DISK // 2)
    statuses, outs = read_all(tier, range(6))
    assert statuses[:3] == [Status.OK] * 3 and all(s is not Status.OK for s in statuses[3:])
    assert all(np.array_equal(outs[i], data(i)) for i in range(3))
    tier.close()
    with DiskTier(tier.path, 1 << 30) as again:  # a restart drops links past the end
        assert sorted(again.keys()) == [k(0), k(1), k(2)]
        again.check_integrity(deep=True)


def test_a_restart_removes_extents_no_link_reaches_and_leaves_other_files(tmp_path):
    """An extent no name reaches is a dead writer's once older than any write takes; a younger one
    may be a live writer's, about to link its names (control: it stays, not counted here)."""
    with DiskTier(tmp_path, 1 << 30) as t:
        assert put_chain(t, range(3)) == [Status.OK] * 3
        assert put_chain(t, range(3, 6)) == [Status.OK] * 3
        assert put_chain(t, range(6, 9)) == [Status.OK] * 3
        orphan, young = Path(t.locate(k(3))[0]), Path(t.locate(k(6))[0])
        for i in range(3, 9):  # as if the writer died after publishing the extent, before linking
            os.unlink(t.path_of(k(i)))
    old = time.time() - STALE_TEMP_S - 60
    os.utime(orphan, (old, old))
    foreign = tmp_path / "00" / "notes.kvx"
    foreign.write_bytes(b"not a block")
    with DiskTier(tmp_path, 1 << 30) as t:
        assert not orphan.exists() and foreign.exists() and young.exists()
        assert sorted(t.keys()) == [k(0), k(1), k(2)]
        assert t.used_bytes == 3 * ON_DISK
        t.check_integrity(deep=True)


def test_an_erasure_keeps_the_other_blocks_publication_time(tier):
    """The names are links to the extent, so its mtime is every block's publication time (TTL,
    restart order): erasing one block must not renew the others'. Control: without the restore,
    punching and zeroing would set it to now."""
    assert put_chain(tier, range(3)) == [Status.OK] * 3
    path = tier.locate(k(0))[0]
    os.utime(path, (1000, 1000))
    assert tier.delete(k(1))
    assert os.stat(path).st_mtime == 1000 and os.lstat(tier.path_of(k(2))).st_mtime == 1000
    with DiskTier(tier.path, 1 << 30, ttl_s=3600) as other:  # another process: published long ago, expired
        assert not other.contains(k(2))



def test_a_batch_larger_than_an_extent_takes_several(tier, tmp_path, monkeypatch):
    """File systems bound an inode's links (ext4: 65,000), and each packed block's name is one:
    a batch is packed EXTENT_BLOCKS at a time. Control: the same batch under the bound is one."""
    from kvtier.tiers import disk_extents

    assert put_chain(tier, range(10)) == [Status.OK] * 10
    assert len(extents(tmp_path / "d")) == 1
    monkeypatch.setattr(disk_extents, "EXTENT_BLOCKS", 4)
    assert put_chain(tier, range(20, 30)) == [Status.OK] * 10
    found = extents(tmp_path / "d")
    assert len(found) == 1 + 3 and max(os.stat(p).st_nlink for p in found) <= 1 + 10
    assert sorted(os.stat(p).st_nlink - 1 for p in found) == [2, 4, 4, 10]
    assert read_all(tier, range(20, 30))[0] == [Status.OK] * 10
    tier.check_integrity(deep=True)


def test_erasing_a_block_writes_only_its_own_table_entry_whatever_the_table_head_says(tier):
    """A damaged table head (its name length) must not steer the zeroing of an erased block's
    entry into another block: the entry's place comes from the extent's name this process wrote.
    Control: the head's name length, read back, is what the old code took."""
    assert put_chain(tier, range(3)) == [Status.OK] * 3
    path, first = tier.locate(k(0))
    assert first == PAGE  # one table page, then the blocks
    with open(path, "r+b") as f:
        head = bytearray(f.read(16))
        assert int.from_bytes(head[6:8], "little") == len(os.path.relpath(path, tier.path))  # control
        head[6:8] = (PAGE - 16 - 8 - 56 + 40).to_bytes(2, "little")  # entry 1 would land in k(0)'s header
        f.seek(0)
        f.write(head)
    assert tier.delete(k(1))
    statuses, outs = read_all(tier, [0, 2])
    assert statuses == [Status.OK] * 2 and np.array_equal(outs[0], data(0))


def test_an_extents_data_bytes_leave_out_its_holes_and_the_file_systems_own_map(tmp_path):
    """A restart counts a removed block's bytes still on disk as an extent's data less its live
    blocks and table. ``st_blocks`` also counts the map the file system keeps of the file: ext4
    takes a page for it once holes split a file into more extents than its inode holds (four),
    and a restart then counted a page no block took (``test_a_restart_rebuilds_the_index_from_the_links``
    failed that way in about half its runs)."""
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR)
    try:
        holes = [(8 * i + 2) * PAGE for i in range(7)]   # seven one-page holes: eight extents
        if not all(disk_extents.punch_hole(fd, offset, PAGE) for offset in holes):
            pytest.skip("this file system punches no holes")
        os.fsync(fd)
    finally:
        os.close(fd)
    st = os.stat(path)
    assert disk_extents.allocated_bytes(str(path), st) == (64 - 7) * PAGE
    # control: a file without holes is all data
    whole = tmp_path / "g"
    whole.write_bytes(b"x" * (3 * PAGE))
    assert disk_extents.allocated_bytes(str(whole), os.stat(whole)) == 3 * PAGE
