"""How fast the disk reads into each kind of memory: the same cold ``O_DIRECT`` requests of a
scratch file, two in flight, into (1) a request-sized buffer per read in flight, reused, on
4 KiB pages, (2) the same on transparent huge pages, (3) a place per request in one region of
4 KiB pages, (4) the same region on huge pages. Rounds alternate the kinds; prints one JSON
object: per kind the median and best GiB/s.

    python scripts/bench_read_destination.py [--request-kib 1028] [--total-mib 64] [--rounds 8] [--dir DIR]

Why it matters: a direct read pins its buffer and hands the device one segment per physically
contiguous run of it (a 4 KiB page each, unless the buffer is on huge pages), and a buffer
reused at once is hot. kvtier's disk loads read into a reused ring on huge pages
(``direct_io.BlockIO.read_many_staged``); the demo's disk limit takes the best of (1), (2) and (4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.tiers.direct_io import PAGE, aligned_buffer, drop_cache, io_buffer, probe_direct_io

GIB = float(1 << 30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--request-kib", type=int, default=1028, help="bytes a request (default: 4 blocks of 256 KiB + headers)")
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    args = p.parse_args()
    request = max(PAGE, args.request_kib * 1024 // PAGE * PAGE)
    n = max(4, (args.total_mib << 20) // request)
    directory = tempfile.mkdtemp(prefix="kvtier-read-dest-", dir=args.dir)
    path = os.path.join(directory, "scratch")
    direct = probe_direct_io(directory)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        src = aligned_buffer(request)
        for i in range(n):
            src[:] = np.frombuffer(os.urandom(request), dtype=np.uint8)
            os.pwrite(fd, src, i * request)
        os.fsync(fd)
        small, huge = [aligned_buffer(request) for _ in range(2)], io_buffer(2 * request)
        region_small, region_huge = aligned_buffer(n * request), io_buffer(n * request)
        kinds = {
            "reused, 4 KiB pages": lambda lane, i: small[lane],
            "reused, huge pages": lambda lane, i: huge[lane * request : (lane + 1) * request],
            "a place per read, 4 KiB pages": lambda lane, i: region_small[i * request : (i + 1) * request],
            "a place per read, huge pages": lambda lane, i: region_huge[i * request : (i + 1) * request],
        }
        runs: dict[str, list[float]] = {kind: [] for kind in kinds}
        with ThreadPoolExecutor(2) as pool:
            for r in range(args.rounds):
                order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
                for kind in order:
                    target = kinds[kind]

                    def lane(k: int, target=target) -> None:
                        for i in range(k, n, 2):
                            if os.preadv(fd, [target(k, i)], i * request) != request:
                                raise OSError(f"short read of {path}")

                    drop_cache(fd)
                    start = time.perf_counter()
                    list(pool.map(lane, range(2)))
                    runs[kind].append(n * request / (time.perf_counter() - start) / GIB)
    finally:
        os.close(fd)
        os.unlink(path)
        os.rmdir(directory)
    print(json.dumps({"direct_io": direct, "request_bytes": request, "requests": n, "rounds": args.rounds,
                      "gib_s": {kind: {"median": round(statistics.median(v), 3), "best": round(max(v), 3)}
                                for kind, v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
