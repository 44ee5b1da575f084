"""The transformers loader's disk load, apart from the demo: ``cache_io.load_blocks`` of N cold
256 KiB blocks (the demo model's layout: 8 layers, 4 KV heads, head dim 64, fp32, 16 tokens; or
``--block-kib`` K: K / 8 layers of one KV head, the same tokens and head dim) that
a write-behind flusher's batches of 32 put on the disk tier, read by a fresh process through
``TieredStore([host, disk])`` (the loader's spans of ``READ_CHUNK_BYTES``, ``READS_IN_FLIGHT`` reads in
flight, background promotion), against the demo's disk limit measured in that process before and
after (the best counts), with the span and reads in flight the demo's worker gives it.

    python scripts/bench_disk_load.py [--blocks 128] [--runs 5] [--block-kib 256] [--dir DIR]

Prints one JSON line per run and the medians. Run it from two trees (PYTHONPATH=...) alternately
to compare code; the limit comes from the tree it runs in (``disk_limit_gib_s`` where it exists).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile

NB = 256 << 10  # the demo model's block; --block-kib sets another


def _layout():
    from kvtier.core.layout import KVLayout

    if NB == 256 << 10:
        return KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=16)
    return KVLayout(num_layers=NB // (8 << 10), num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(1, n + 1)]


def write(directory: str, n: int) -> None:
    from kvtier.tiers.direct_io import aligned_buffer
    from kvtier.tiers.disk import DiskTier

    shutil.rmtree(directory, ignore_errors=True)
    keys = _keys(n)
    blocks = _blocks(n)
    with DiskTier(directory, 1 << 30) as disk:
        for a in range(0, n, 32):
            datas = [aligned_buffer(NB) for _ in keys[a : a + 32]]
            for d, block in zip(datas, blocks[a : a + 32]):
                d[:] = block
            assert all(s.ok for s in disk.put_many(keys[a : a + 32], datas))


def _blocks(n: int) -> list:
    """The blocks' bytes, the same in the writer and in each reader (which checks its load)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, NB, dtype=np.uint8) for _ in range(n)]


def read(directory: str, n: int) -> dict:
    import torch

    from kvtier.demo import limits
    import numpy as np

    from kvtier.integrations.transformers.cache_io import (READ_CHUNK_BYTES, READS_IN_FLIGHT, KVStorage, Staging,
                                                           gather_blocks, load_blocks)
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier

    lay = _layout()

    def limit() -> float:
        if hasattr(limits, "disk_limit_gib_s"):  # as the demo's worker measures it: the loader's span
            return limits.disk_limit_gib_s(directory, NB, in_flight=READS_IN_FLIGHT,
                                           span_blocks=max(1, READ_CHUNK_BYTES // NB))
        return limits.disk_read_gib_s(directory, NB, in_flight=READS_IN_FLIGHT, total_bytes=16 << 20)

    before = limit()
    store = TieredStore([HostTier(64 << 20, NB), DiskTier(directory, 1 << 30)])
    # poisoned before the timer (at allocation): a load that writes nothing fails the check below
    storage = KVStorage(lay, n * lay.block_tokens + 64, torch.float32, poison=True)
    staging = Staging(poison=True)
    staging.reserve(n * NB)
    report = load_blocks(store, _keys(n), storage, staging)
    store.wait_promotions(30)
    store.close()
    best = max(before, limit())
    assert report.blocks == n, report
    loaded = gather_blocks(storage, 0, n)
    assert all(np.array_equal(got.view(np.uint8), want) for got, want in zip(loaded, _blocks(n))), "wrong bytes loaded"
    return {"load_ms": round(report.seconds * 1e3, 2), "disk_limit_gib_s": round(best, 3),
            "load_efficiency": round(n * NB / (best * (1 << 30)) / report.seconds, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--block-kib", type=int, default=256, help="block size, a multiple of 8 KiB (default 256)")
    p.add_argument("--dir", default=None, help="disk tier directory (default: a fresh one, removed after)")
    p.add_argument("--read-only", action="store_true", help=argparse.SUPPRESS)  # the fresh reader process
    args = p.parse_args()
    global NB
    if args.block_kib <= 0 or args.block_kib % 8:
        p.error("--block-kib must be a positive multiple of 8")
    NB = args.block_kib << 10
    directory = args.dir or tempfile.mkdtemp(prefix="kvtier-bench-load-")
    if args.read_only:
        print(json.dumps(read(directory, args.blocks)))
        return 0
    try:
        write(directory, args.blocks)
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, __file__, "--read-only", "--dir", directory, "--blocks",
                                  str(args.blocks), "--block-kib", str(args.block_kib)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
        print(json.dumps({"median_load_ms": statistics.median(r["load_ms"] for r in runs),
                          "median_load_efficiency": statistics.median(r["load_efficiency"] for r in runs)}))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
