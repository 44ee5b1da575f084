"""The transformers loader's host load, apart from the demo: ``cache_io.load_blocks`` of N warm
256 KiB blocks (the demo model's layout: 8 layers, 4 KV heads, head dim 64, fp32, 16 tokens) out
of a ``HostTier`` (three saves, so three pool runs, as a conversation's turns leave them) into a
poisoned ``KVStorage``, against the demo's host limit (``demo/limits.host_copy_gib_s``, the best
of the process) and, per load, the same bytes copied the limit's way right after it.

    python scripts/bench_host_load.py [--blocks 80] [--loads 30]

Prints one JSON line: wall efficiency (the demo's figure: bytes at the limit ÷ load time, median
and best load) and CPU efficiency (the limit's copy's thread CPU time ÷ the load's, medians): on a
busy machine the CPU figure moves least. Run it from two trees (PYTHONPATH=...) alternately to
compare code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--loads", type=int, default=30)
    args = p.parse_args()

    import numpy as np
    import torch

    from kvtier.bench.baselines import huge_page_buffer
    from kvtier.core.keys import block_keys
    from kvtier.core.layout import KVLayout
    from kvtier.core.namespace import Namespace
    from kvtier.demo.limits import host_copy_gib_s
    from kvtier.integrations.transformers.cache_io import KVStorage, Staging, gather_blocks, load_blocks
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.direct_io import aligned_buffer
    from kvtier.tiers.host import HostTier

    lay = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=16)
    n, nb = args.blocks, lay.block_nbytes
    store = TieredStore([HostTier(384 << 20, nb)])
    storage = KVStorage(lay, 8192, torch.float32, poison=True)
    keys = block_keys(Namespace("bench-host-load", lay), np.arange(n * lay.block_tokens, dtype=np.uint32))
    storage.tensor.normal_()
    for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)):
        store.put(keys[a:b], gather_blocks(storage, a, b - a), parents=[keys[a - 1] if a else None, *keys[a : b - 1]])
    expected = storage.tensor[:, :, :, :, : n * lay.block_tokens].clone()
    src, dst = huge_page_buffer(n * nb), aligned_buffer(n * nb)
    src[:] = 1
    dst[:] = 0
    staging = Staging(poison=True)
    walls, cpu_loads, cpu_copies, limit = [], [], [], 0.0
    for r in range(args.loads):
        storage.poison()  # as the demo does before every request, untimed
        c = time.thread_time()
        report = load_blocks(store, keys, storage, staging)
        cpu_loads.append(time.thread_time() - c)
        walls.append(report.seconds)
        assert report.blocks == n
        c = time.thread_time()
        for i in range(n):  # the limit's copy of the same bytes
            np.copyto(dst[i * nb : (i + 1) * nb], src[i * nb : (i + 1) * nb])
        cpu_copies.append(time.thread_time() - c)
        if r % 5 == 0:
            limit = max(limit, host_copy_gib_s(nb))
    assert torch.equal(storage.tensor[:, :, :, :, : n * lay.block_tokens], expected), "the load placed wrong bytes"
    store.close()
    ideal = n * nb / (limit * (1 << 30))
    print(json.dumps({
        "blocks": n, "limit_gib_s": round(limit, 3),
        "load_ms_p50": round(statistics.median(walls) * 1e3, 3), "load_ms_min": round(min(walls) * 1e3, 3),
        "load_efficiency_p50": round(ideal / statistics.median(walls), 3), "load_efficiency_best": round(ideal / min(walls), 3),
        "cpu_load_ms_p50": round(statistics.median(cpu_loads) * 1e3, 3),
        "cpu_limit_copy_ms_p50": round(statistics.median(cpu_copies) * 1e3, 3),
        "cpu_efficiency": round(statistics.median(cpu_copies) / statistics.median(cpu_loads), 3),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
