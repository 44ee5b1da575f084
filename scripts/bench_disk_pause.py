"""What a pause does to a disk load: kvtier's load of N cold blocks (the demo's first disk turn
after a restart: 256 KiB blocks that a write-behind's batches packed on the disk tier) and raw
reads of exactly the requests that load makes, each timed right after another burst of reads
("back to back") and after a pause with no I/O of ours ("after a pause", as a demo turn's load
comes after the turn's recompute), scored against the demo's disk limit (measured back to back,
as the demo measures it).

    python scripts/bench_disk_pause.py [--blocks 82] [--reps 8] [--pause-s 1.0] [--dir DIR]

The raw reads are the floor of any loader: the same requests, two in flight, into a reused
huge-page ring per lane (the disk tier's kind of staging), nothing verified or placed. Their
efficiency after a pause is what a loader with no cost of its own would score on that turn.
Prints one JSON object; the four cases run interleaved, in a shuffled order per repetition.
Every kvtier load goes into storage poisoned before it (untimed) and its bytes are checked after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_disk_load as disk_load  # noqa: E402 - the same blocks, layout and writer

CASES = ("kvtier, back to back", "kvtier, after a pause", "raw, back to back", "raw, after a pause")


def _record_requests(load) -> list[list[tuple[str, int, int]]]:
    """``(path, offset, bytes)`` of every read ``load()`` makes, per reading thread, in order."""
    seen: list[tuple[int, str, int, int]] = []
    real = os.preadv

    def spy(fd, buffers, offset):
        seen.append((threading.get_ident(), os.readlink(f"/proc/self/fd/{fd}"), offset,
                     sum(memoryview(b).nbytes for b in buffers)))
        return real(fd, buffers, offset)

    os.preadv = spy
    try:
        load()
    finally:
        os.preadv = real
    lanes: dict[int, list[tuple[str, int, int]]] = {}
    for thread, path, offset, size in seen:
        lanes.setdefault(thread, []).append((path, offset, size))
    return list(lanes.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=82, help="blocks of 256 KiB (default 82: the demo's first disk turn)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="an empty directory for the disk tier (default: a fresh one, removed after)")
    args = p.parse_args()
    if not os.path.isdir("/proc/self/fd"):
        p.error("needs Linux (/proc/self/fd names the files the load reads)")

    import numpy as np
    import torch

    from kvtier.demo import limits
    from kvtier.integrations.transformers.cache_io import (READ_CHUNK_BYTES, READS_IN_FLIGHT, KVStorage, Staging,
                                                           gather_blocks, load_blocks)
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.direct_io import io_buffer
    from kvtier.tiers.disk import DiskTier

    if args.dir and os.path.isdir(args.dir) and os.listdir(args.dir):
        p.error(f"--dir {args.dir} is not empty: the bench writes its own blocks there (and removes what is there)")
    n, nb = args.blocks, disk_load.NB
    directory = args.dir or tempfile.mkdtemp(prefix="kvtier-bench-pause-")
    disk_load.write(directory, n)
    # the disk tier alone: nothing is promoted, so every load reads the disk
    store = TieredStore([DiskTier(directory, 1 << 30)], io_threads=READS_IN_FLIGHT)
    lay = disk_load._layout()
    storage = KVStorage(lay, n * lay.block_tokens + 64, torch.float32, poison=True)
    staging = Staging(poison=True)
    staging.reserve(n * nb)
    keys = disk_load._keys(n)
    want = disk_load._blocks(n)

    def kvtier() -> float:
        storage.poison()  # untimed, as the demo's session poisons before a request:
        staging.poison()  # a load that writes nothing leaves NaN and fails the check below
        report = load_blocks(store, keys, storage, staging)
        if report.blocks != n:
            raise SystemExit(f"kvtier loaded {report.blocks} of {n} blocks")
        loaded = gather_blocks(storage, 0, n)
        if not all(np.array_equal(got.view(np.uint8), block) for got, block in zip(loaded, want)):
            raise SystemExit("kvtier loaded wrong bytes")
        return report.seconds

    lanes = _record_requests(kvtier)
    fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for lane in lanes for path, _, _ in lane}
    rings = [io_buffer(4 << 20) for _ in lanes]

    def raw() -> float:
        def read(lane, ring) -> None:
            at = 0
            for path, offset, size in lane:
                at = 0 if at + size > ring.nbytes else at
                os.preadv(fds[path], [ring[at : at + size]], offset)
                at += size

        threads = [threading.Thread(target=read, args=(lane, ring)) for lane, ring in zip(lanes, rings)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    try:
        times: dict[str, list[float]] = {case: [] for case in CASES}
        for _ in range(args.reps):
            for case in random.sample(CASES, len(CASES)):
                if case.endswith("pause"):
                    time.sleep(args.pause_s)
                else:
                    raw()  # another burst right before
                times[case].append(kvtier() if case.startswith("kvtier") else raw())
        limit = limits.disk_limit_gib_s(directory, nb, in_flight=READS_IN_FLIGHT,
                                        span_blocks=max(1, READ_CHUNK_BYTES // nb))
    finally:
        for fd in fds.values():
            os.close(fd)
        store.close()
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    ideal = n * nb / (limit * (1 << 30))
    out = {"blocks": n, "block_kib": nb >> 10, "requests": [len(lane) for lane in lanes], "pause_s": args.pause_s,
           "reps": args.reps, "disk_limit_gib_s": round(limit, 3), "ideal_ms": round(ideal * 1e3, 2)}
    for case, values in times.items():
        med = statistics.median(values)
        out[case] = {"median_ms": round(med * 1e3, 2), "best_ms": round(min(values) * 1e3, 2),
                     "efficiency_of_median": round(ideal / med, 3)}
    out["kvtier_over_raw_after_pause"] = round(out["kvtier, after a pause"]["median_ms"]
                                               / out["raw, after a pause"]["median_ms"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
