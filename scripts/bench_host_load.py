"""The transformers loader's host load, apart from the demo: ``cache_io.load_blocks`` of N warm
256 KiB blocks (the demo model's layout: 8 layers, 4 KV heads, head dim 64, fp32, 16 tokens) out
of a ``HostTier`` (three saves, so three pool runs, as a conversation's turns leave them) into a
poisoned ``KVStorage``, against, per load, right after it, the same bytes copied the limits' ways:

* the demo's host limit (``demo/limits.host_place_gib_s``): the same blocks from huge-page memory
  into a second ``KVStorage`` (the same layout and capacity), the strided rows the load writes;
* a contiguous memcpy of the same blocks, block by block, into a plain buffer (the copy the demo's
  host limit made before; here on the load's bytes, not the demo's fixed 64 MiB).

Every side finds the caches alike: each copy's destination storage (or, for the memcpy, the
scratch storage) is poisoned right before it, as the demo poisons the engine's before each load
(a 128 MiB fill: the pool's, the source's and the destination's lines are evicted alike).

    python scripts/bench_host_load.py [--blocks 80] [--loads 30]

Prints one JSON line: wall efficiency (the demo's figure: bytes at the limit ÷ load time, median
and best load; the limit is the best copy of the run) against each limit, and CPU efficiency
(the limit's copy's thread CPU time ÷ the load's, medians): on a busy machine the CPU figure
moves least. Run it from two trees (PYTHONPATH=...) alternately to compare code.
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

    from kvtier.bench.baselines import huge_page_buffer, ratio_warnings, report_warnings
    from kvtier.core.keys import block_keys
    from kvtier.core.layout import KVLayout
    from kvtier.core.namespace import Namespace
    from kvtier.demo.limits import place_views
    from kvtier.integrations.transformers.cache_io import KVStorage, Staging, gather_blocks, load_blocks
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.direct_io import aligned_buffer
    from kvtier.tiers.host import HostTier

    lay = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=16)
    n, nb = args.blocks, lay.block_nbytes
    store = TieredStore([HostTier(384 << 20, nb)])
    storage = KVStorage(lay, 8192, torch.float32, poison=True)
    scratch = KVStorage(lay, 8192, torch.float32, poison=True)  # the limit's destination: the same kind
    keys = block_keys(Namespace("bench-host-load", lay), np.arange(n * lay.block_tokens, dtype=np.uint32))
    storage.tensor.normal_()
    for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)):
        store.put(keys[a:b], gather_blocks(storage, a, b - a), parents=[keys[a - 1] if a else None, *keys[a : b - 1]])
    expected = storage.tensor[:, :, :, :, : n * lay.block_tokens].clone()
    src, dst = huge_page_buffer(n * nb), aligned_buffer(n * nb)
    src[:] = 1
    dst[:] = 0
    to, from_ = place_views(lay, src, scratch.raw(), n)
    staging = Staging(poison=True)
    walls, cpu_loads = [], []
    copies = {"place": ([], []), "memcpy": ([], [])}  # (wall, thread CPU) per load

    def memcpy() -> None:
        for i in range(n):
            np.copyto(dst[i * nb : (i + 1) * nb], src[i * nb : (i + 1) * nb])

    for _ in range(args.loads):
        storage.poison()  # as the demo does before every request, untimed
        c = time.thread_time()
        report = load_blocks(store, keys, storage, staging)
        cpu_loads.append(time.thread_time() - c)
        walls.append(report.seconds)
        assert report.blocks == n
        assert torch.equal(storage.tensor[:, :, :, :, : n * lay.block_tokens], expected), "the load placed wrong bytes"
        for name, copy in (("place", lambda: np.copyto(to, from_)), ("memcpy", memcpy)):
            scratch.poison()  # the same cache state as the load found
            c, t = time.thread_time(), time.perf_counter()
            copy()
            copies[name][0].append(time.perf_counter() - t)
            copies[name][1].append(time.thread_time() - c)
    store.close()
    gib = float(1 << 30)
    limit, memcpy_limit = (n * nb / min(copies[k][0]) / gib for k in ("place", "memcpy"))
    ideal, memcpy_ideal = n * nb / (limit * gib), n * nb / (memcpy_limit * gib)
    result = {
        "blocks": n, "limit_gib_s": round(limit, 3), "memcpy_limit_gib_s": round(memcpy_limit, 3),
        "load_ms_p50": round(statistics.median(walls) * 1e3, 3), "load_ms_min": round(min(walls) * 1e3, 3),
        "load_efficiency_p50": round(ideal / statistics.median(walls), 3), "load_efficiency_best": round(ideal / min(walls), 3),
        "load_efficiency_vs_memcpy_p50": round(memcpy_ideal / statistics.median(walls), 3),
        "cpu_load_ms_p50": round(statistics.median(cpu_loads) * 1e3, 3),
        "cpu_limit_copy_ms_p50": round(statistics.median(copies["place"][1]) * 1e3, 3),
        "cpu_memcpy_ms_p50": round(statistics.median(copies["memcpy"][1]) * 1e3, 3),
        "cpu_efficiency": round(statistics.median(copies["place"][1]) / statistics.median(cpu_loads), 3),
    }
    result["warnings"] = ratio_warnings({k: result[k] for k in ("load_efficiency_p50", "load_efficiency_best")},
                                        what="host limit (the same copy, from the same cache state)")
    report_warnings(result["warnings"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
