"""The tiers' hardware limits, measured in the same run as the loads they judge, the way kvtier reads.

* host: the copy a load from the DRAM pool must make (:func:`host_place_gib_s`, the limit
  ``load_efficiency`` is judged against): the load's own blocks, back to back in memory of the
  pool's kind (prefaulted, transparent huge pages), copied in one ``numpy.copyto`` into the
  positions they take in a destination laid out like the engine's KV storage, each block as
  ``layers x kv_parts x kv_heads`` strided rows of ``block_tokens x head_dim`` elements (4 KiB for
  the demo model), as the loader writes them; measured on the load's block count from the load's
  cache state. Beside it, :func:`host_copy_gib_s`: block-sized copies of a fixed 64 MiB into a
  *contiguous* buffer, the figure the demo posted before (the layout's strided rows cost more
  than a contiguous destination, and 64 MiB runs out of a 32 MiB L3 where a 20 MiB load may not:
  it is not the copy the load makes, so ratios against it are kept for comparison only).
* disk: cold ``O_DIRECT`` reads of a scratch file in the disk tier's directory
  in the requests kvtier makes with as many reads in flight as kvtier keeps. The
  transformers loader keeps two spans of blocks in flight on the store's two I/O
  threads; each span is one ``DiskTier.get_many``, which keeps one read in flight
  and verifies on a helper behind it, so two reads in all. A span of blocks
  packed in one extent (what ``put_many`` writes) is one request of all its
  blocks, header pages and payloads back to back, cut in requests of about
  1 MiB (``RUN_REQUEST_BYTES``) so that verifying one hides behind reading the
  next; blocks in files of their own are one request each.
  :func:`disk_limit_gib_s` takes the fastest of those shapes and whole-span
  requests (``blocks_per_read``; on this machine's virtual disk, 4 MiB requests
  two at a time were not faster than 260 KiB ones): the limit never favours
  kvtier's choice of request. Only payload bytes count, as in kvtier's own figure: the
  device without kvtier's files, header checks and checksums. The reads land in the best
  of three kinds of memory (:data:`DESTINATIONS`): a request-sized buffer per read in flight,
  reused (hot), on small pages or on huge pages (the disk tier's loads land in a reused
  huge-page ring: ``BlockIO.read_many_staged``), and a region as large as all the reads on
  huge pages (the kind of the loader's staging, :func:`~kvtier.tiers.direct_io.io_buffer`).
  Measured on this project's VMs, the memory a direct read lands in moves the device's
  speed by up to 1.7x (one segment a page): a limit on other memory than kvtier's would
  judge the memory, not the load.

All take the best of a few repetitions: a limit is what the hardware can do,
and a shared machine only ever makes it look slower.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.bench.baselines import huge_page_buffer
from kvtier.core.layout import KVLayout
from kvtier.tiers.direct_io import (PAGE, aligned_buffer, drop_cache, probe_direct_io, io_buffer, round_up,
                                    run_request_blocks)

GIB = float(1 << 30)


def host_copy_gib_s(block_nbytes: int, total_bytes: int = 64 << 20, repeats: int = 3) -> float:
    """GiB/s of block-sized ``numpy.copyto`` from huge-page memory (the pool's kind) into a plain,
    contiguous buffer: not the copy a load makes (see :func:`host_place_gib_s`), kept as the
    demo's earlier host figure (``load_efficiency_vs_memcpy``)."""
    block_nbytes = max(4096, min(block_nbytes, total_bytes))
    n = max(1, total_bytes // block_nbytes)
    src = huge_page_buffer(n * block_nbytes)
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


#: integer dtypes of each item size, to move raw KV bytes (as ``KVStorage.raw`` does; numpy has no bfloat16)
_RAW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def storage_like(layout: KVLayout, capacity_tokens: int) -> np.ndarray:
    """A zeroed (faulted-in) raw array of the engine's KV storage layout, ``(layers, kv_parts, 1,
    kv_heads, capacity, head_dim)``, on small pages like torch's own allocations."""
    shape = (layout.num_layers, layout.kv_parts, 1, layout.num_kv_heads, capacity_tokens, layout.head_dim)
    return aligned_buffer(int(np.prod(shape)) * layout.itemsize).view(_RAW[layout.itemsize]).reshape(shape)


def place_views(layout: KVLayout, src: np.ndarray, dst: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``(to, from_)`` for one ``numpy.copyto(to, from_)`` of ``blocks`` canonical blocks back to back
    in ``src`` (bytes) into positions ``0 ..`` of ``dst`` (raw storage, as :func:`storage_like` or
    ``KVStorage.raw()``): the transposed views the loader's ``_place_run`` copies through, the least
    copying the storage's layout allows."""
    bt = layout.block_tokens
    from_ = src[: blocks * layout.block_nbytes].view(dst.dtype).reshape(blocks, *layout.block_shape)
    to = dst[:, :, 0, :, : blocks * bt, :]
    to.shape = (layout.num_layers, layout.kv_parts, layout.num_kv_heads, blocks, bt, layout.head_dim)  # a view or raise
    return to, from_.transpose(1, 2, 3, 0, 4, 5)


def host_place_gib_s(layout: KVLayout, blocks: int, *, dst: np.ndarray | None = None,
                     before: Callable[[], None] | None = None, repeats: int = 3) -> float:
    """GiB/s of the copy a load of ``blocks`` blocks from the host tier must make: the blocks back to
    back in huge-page memory (the pool's kind) into positions ``0 ..`` of ``dst``, raw storage of
    the engine's layout (:func:`place_views`; default :func:`storage_like` of just those
    positions), one ``numpy.copyto``; the best of ``repeats``.

    ``dst`` should be memory of the kind the load writes (a ``KVStorage``'s ``raw()``, the same
    capacity, already faulted in) and ``before`` (untimed, before each copy) should leave the
    caches as the load found them: the demo poisons its storage before each load, so it passes a
    scratch storage's ``poison``. Measured on the load's own block count: the same bytes run out
    of the last-level cache, or not, as the load's do. ``dst`` is overwritten."""
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    dst = storage_like(layout, blocks * layout.block_tokens) if dst is None else dst
    src = huge_page_buffer(blocks * layout.block_nbytes)
    src[:] = 1
    to, from_ = place_views(layout, src, dst, blocks)
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        np.copyto(to, from_)
        best = min(best, time.perf_counter() - start)
    return blocks * layout.block_nbytes / best / GIB


#: where the disk limit's reads land (the best counts): a buffer per read in flight, reused, on
#: small pages; the same on huge pages; a place per read in one huge-page region
DESTINATIONS = ("small pages, reused", "huge pages, reused", "huge pages, a place per read")


def disk_read_gib_s(directory: str, block_nbytes: int = 2 << 20, *, in_flight: int = 1,
                    blocks_per_read: int = 1, total_bytes: int = 32 << 20, repeats: int = 2,
                    destinations: tuple[str, ...] = DESTINATIONS) -> float:
    """GiB/s of payload from cold reads of block files' shape (a header page + the payload rounded
    to pages; ``blocks_per_read`` such blocks back to back per request) in a scratch file in
    ``directory``, ``in_flight`` requests at once, into each of ``destinations`` in turn: the
    best run counts."""
    os.makedirs(directory, exist_ok=True)
    direct = probe_direct_io(directory)
    request = (PAGE + round_up(block_nbytes)) * blocks_per_read
    blocks = max(2 * in_flight, total_bytes // (block_nbytes * blocks_per_read))
    path = os.path.join(directory, f".kvtier-limit-{os.getpid()}.tmp")
    unknown = set(destinations) - set(DESTINATIONS)
    if unknown or not destinations:
        raise ValueError(f"destinations must be some of {DESTINATIONS}, got {destinations}")
    lanes = {"small pages, reused": [aligned_buffer(request) for _ in range(in_flight)]}
    if "huge pages, reused" in destinations:
        huge = io_buffer(in_flight * request)
        lanes["huge pages, reused"] = [huge[k * request : (k + 1) * request] for k in range(in_flight)]
    region = io_buffer(blocks * request) if "huge pages, a place per read" in destinations else None
    fill = np.frombuffer(os.urandom(PAGE), dtype=np.uint8).repeat(request // PAGE)[:request]
    for buf in lanes["small pages, reused"]:
        buf[:] = fill
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        for b in range(blocks):
            os.pwrite(fd, lanes["small pages, reused"][0], b * request)
        os.fsync(fd)

        def target(destination: str, lane: int, b: int) -> np.ndarray:
            if destination == "huge pages, a place per read":
                return region[b * request : (b + 1) * request]
            return lanes[destination][lane]

        def reader(lane: int, destination: str) -> None:  # lane k reads blocks k, k + in_flight, ...
            for b in range(lane, blocks, in_flight):
                if os.preadv(fd, [target(destination, lane, b)], b * request) != request:
                    raise OSError(f"short read of {path}")

        best = float("inf")
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            for _ in range(repeats):
                for destination in destinations:
                    drop_cache(fd)  # without O_DIRECT, at least ask for a cold read
                    start = time.perf_counter()
                    list(pool.map(reader, range(in_flight), [destination] * in_flight))
                    best = min(best, time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return blocks * blocks_per_read * block_nbytes / best / GIB


def disk_limit_gib_s(directory: str, block_nbytes: int, *, in_flight: int, span_blocks: int,
                     total_bytes: int = 16 << 20) -> float:
    """The disk limit of a load that keeps ``in_flight`` spans of ``span_blocks`` blocks in flight:
    the fastest of one request per block, the requests ``DiskTier.get_many`` cuts a packed span
    into (about :data:`~kvtier.tiers.direct_io.RUN_REQUEST_BYTES`) and one request per span
    (whichever the hardware serves best, whatever kvtier does)."""
    run = min(span_blocks, run_request_blocks(block_nbytes))
    total = max(total_bytes, 2 * in_flight * span_blocks * block_nbytes)  # two spans a lane at least
    return max(disk_read_gib_s(directory, block_nbytes, in_flight=in_flight, blocks_per_read=n, total_bytes=total)
               for n in sorted({1, run, max(1, span_blocks)}))
