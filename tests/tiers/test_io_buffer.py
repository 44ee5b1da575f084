"""Staging for direct I/O (``direct_io.io_buffer``): large buffers on transparent huge pages.

A direct read pins its buffer's pages and hands the device one segment per physically
contiguous run: on 4 KiB pages a 1 MiB read is 256 segments, on a huge page one. Measured on
this project's VMs, reads into huge pages ran up to 1.7x faster (BENCHMARKS.md)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.direct_io import HUGE_PAGE, PAGE, BlockIO, aligned_buffer, io_buffer


def _address(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _anon_huge_kib(buf: np.ndarray) -> int:
    """AnonHugePages of the mapping that holds ``buf`` (from /proc/self/smaps)."""
    address = _address(buf)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the buffer")


@pytest.mark.parametrize("nbytes", [HUGE_PAGE, 3 * HUGE_PAGE + 5 * PAGE, 64 << 20])
def test_a_large_buffer_starts_on_a_huge_page_boundary_zeroed_and_writable(nbytes):
    buf = io_buffer(nbytes)
    assert buf.nbytes == nbytes and buf.dtype == np.uint8
    assert _address(buf) % HUGE_PAGE == 0
    assert not buf.any()
    buf[:] = 7  # writable, its whole length
    assert int(buf[-1]) == 7


@pytest.mark.parametrize("nbytes", [1, PAGE, HUGE_PAGE - PAGE])
def test_a_small_buffer_is_a_plain_page_aligned_one(nbytes):
    buf = io_buffer(nbytes)
    assert buf.nbytes == nbytes and _address(buf) % PAGE == 0
    assert not buf.any()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this host")
def test_a_large_buffer_is_backed_by_huge_pages_where_the_kernel_gives_them():
    buf = io_buffer(16 << 20)
    assert _anon_huge_kib(buf) >= HUGE_PAGE >> 10
    if _thp_mode() == "madvise":  # the control: unadvised memory gets small pages
        plain = aligned_buffer(16 << 20)
        assert _anon_huge_kib(plain) == 0


def test_the_disk_tiers_staging_chunks_are_huge_page_buffers():
    io = BlockIO(direct=True, chunk_bytes=HUGE_PAGE, leases=1)
    try:
        with io._lease() as lease:
            assert all(_address(chunk) % HUGE_PAGE == 0 for chunk in lease.chunks)
            assert _address(lease.page) % PAGE == 0 and _address(lease.tail) % PAGE == 0
    finally:
        io.close()
