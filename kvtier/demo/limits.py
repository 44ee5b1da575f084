"""The tiers' hardware limits, measured in the same run as the numbers they judge.

* host: ``numpy.copyto`` between warm (already faulted) buffers, in block-sized
  pieces — what loading from the DRAM pool could cost at best.
* disk: a cold ``O_DIRECT`` read of a freshly written scratch file in the disk
  tier's directory, in 2 MiB requests — the device, without kvtier's file per
  block, header checks and checksums.

Both take the best of a few repetitions: a limit is what the hardware can do,
and a shared machine only ever makes it look slower.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvtier.tiers.direct_io import aligned_buffer, drop_cache, probe_direct_io

GIB = float(1 << 30)


def host_copy_gib_s(block_nbytes: int, total_bytes: int = 64 << 20, repeats: int = 3) -> float:
    """GiB/s of block-sized ``numpy.copyto`` from one warm buffer into another."""
    block_nbytes = max(4096, min(block_nbytes, total_bytes))
    n = max(1, total_bytes // block_nbytes)
    src = aligned_buffer(n * block_nbytes)
    src[:] = 1
    dst = aligned_buffer(n * block_nbytes)
    dst[:] = 0
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i * block_nbytes : (i + 1) * block_nbytes], src[i * block_nbytes : (i + 1) * block_nbytes])
        best = min(best, time.perf_counter() - start)
    return n * block_nbytes / best / GIB


def disk_read_gib_s(directory: str, total_bytes: int = 32 << 20, chunk: int = 2 << 20, repeats: int = 2) -> float:
    """GiB/s of a cold sequential read of a scratch file in ``directory`` (O_DIRECT when supported)."""
    os.makedirs(directory, exist_ok=True)
    direct = probe_direct_io(directory)
    path = os.path.join(directory, f".kvtier-limit-{os.getpid()}.tmp")
    buf = aligned_buffer(chunk)
    buf[:] = np.frombuffer(os.urandom(4096), dtype=np.uint8).repeat(chunk // 4096)[:chunk]
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        for offset in range(0, total_bytes, chunk):
            os.pwrite(fd, buf, offset)
        os.fsync(fd)
        best = float("inf")
        for _ in range(repeats):
            drop_cache(fd)  # without O_DIRECT, at least ask for a cold read
            start = time.perf_counter()
            for offset in range(0, total_bytes, chunk):
                os.preadv(fd, [buf], offset)
            best = min(best, time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return total_bytes / best / GIB
