"""A mixed load, apart from the demo: ``cache_io.load_blocks`` of H blocks the host tier holds
followed by D blocks only the disk tier holds (256 KiB blocks, the demo model's layout; the disk's
written as a write-behind's batches pack them), each load after a pause with no I/O (as a demo
turn's load follows its recompute), promotion off so that every load reads the disk again.

    python scripts/bench_mixed_load.py [--host-blocks 64] [--disk-blocks 44] [--loads 6] [--pause-s 1.0]

Prints one JSON line: the median and best load. Every load goes into storage poisoned before it
(untimed) and its bytes are checked after. Run it from two trees (PYTHONPATH=...) alternately to
compare code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_disk_load as disk_load  # noqa: E402 - the same blocks, layout and writer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-blocks", type=int, default=64, help="leading blocks in the host tier (default 64)")
    p.add_argument("--disk-blocks", type=int, default=44, help="blocks after them on the disk tier only (default 44)")
    p.add_argument("--loads", type=int, default=6)
    p.add_argument("--pause-s", type=float, default=1.0)
    args = p.parse_args()

    import numpy as np
    import torch

    from kvtier.integrations.transformers.cache_io import KVStorage, Staging, gather_blocks, load_blocks
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.base import Status
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier

    h, n = args.host_blocks, args.host_blocks + args.disk_blocks
    nb = disk_load.NB
    directory = tempfile.mkdtemp(prefix="kvtier-bench-mixed-")
    try:
        disk_load.write(directory, n)  # every block on disk; the host tier holds the first h too
        keys, blocks = disk_load._keys(n), disk_load._blocks(n)
        host = HostTier((n + 8) * nb, nb)
        for i in range(h):
            if host.put(keys[i], blocks[i]) is not Status.OK:
                raise SystemExit(f"the host tier refused block {i}")
        store = TieredStore([host, DiskTier(directory, 1 << 30)], promote=False)
        lay = disk_load._layout()
        storage = KVStorage(lay, n * lay.block_tokens + 64, torch.float32, poison=True)
        staging = Staging(poison=True)
        staging.reserve(n * nb)
        times, tiers = [], {}
        try:
            for _ in range(args.loads):
                time.sleep(args.pause_s)
                storage.poison()
                staging.poison()
                report = load_blocks(store, keys, storage, staging)
                if report.blocks != n:
                    raise SystemExit(f"loaded {report.blocks} of {n} blocks")
                if not all(np.array_equal(got.view(np.uint8), want) for got, want in zip(gather_blocks(storage, 0, n), blocks)):
                    raise SystemExit("loaded wrong bytes")
                times.append(report.seconds)
                tiers = {tier: b // nb for tier, b in report.bytes_by_tier.items()}
        finally:
            store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"host_blocks": h, "disk_blocks": args.disk_blocks, "blocks_by_tier": tiers,
                      "median_load_ms": round(statistics.median(times) * 1e3, 2),
                      "best_load_ms": round(min(times) * 1e3, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
