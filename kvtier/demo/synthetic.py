"""``kvtier demo --synthetic``: store → evict → reload of synthetic KV, no model, no torch.

For machines without torch: the same store the real demo uses (a small host
pool over a disk tier, write-back so that host evictions demote to disk), fed
random blocks of the demo model's geometry through the token-level
:class:`ContextCache`. It saves a 4 k-token context, saves more until the host
pool evicts it to disk, reloads it (from disk, promoting into the room the other context left), reloads it again
(from host), then reopens the store as a restart would and reloads from disk.
Every reload is compared byte for byte; each phase is timed against the tier
limit measured in the same run (the disk's at the layout's block size, the best of
the request shapes a load of the context can take), and a phase above its limit
is printed with a warning: the limit is then wrong, not the phase fast.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.bench.baselines import ratio_warnings
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.demo.limits import disk_limit_gib_s, host_copy_gib_s
from kvtier.demo.preflight import writable_dir
from kvtier.store.context import ContextCache
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

GIB = float(1 << 30)
#: the demo model's KV geometry: 16 KiB a token, 512 KiB a 32-token block
LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=32)
CONTEXT_TOKENS = 4096


def _open(directory: str, host_blocks: int) -> TieredStore:
    host = HostTier(host_blocks * LAYOUT.block_nbytes, LAYOUT.block_nbytes)
    return TieredStore([host, DiskTier(directory, 1 << 30)], write_mode="write-back")


def _limit_warnings(rows: list[tuple]) -> list[str]:
    """A warning for each phase above its tier's limit (``ratio_warnings``' bound)."""
    return ratio_warnings({f"{phase!r} of the {tier} limit": gib_s / limit
                           for phase, tier, _, gib_s, limit, _ in rows if limit},
                          what="tier limit measured in this run")


def run_synthetic(args) -> int:
    console = Console(highlight=False, width=110)
    rng = np.random.default_rng(0)
    ns = Namespace("synthetic/demo", LAYOUT, weights_revision="random")
    n_blocks = CONTEXT_TOKENS // LAYOUT.block_tokens
    # bad input is one line and exit 2 (ConfigError), before anything is written
    directory = writable_dir(args.store_dir, "--store-dir") if args.store_dir else tempfile.mkdtemp(
        prefix="kvtier-synthetic-")
    context = rng.integers(0, 32000, CONTEXT_TOKENS)
    blocks = [rng.standard_normal(LAYOUT.block_shape, dtype=np.float32) for _ in range(n_blocks)]
    outs = [np.empty(LAYOUT.block_shape, np.float32) for _ in range(n_blocks)]
    rows = []
    limits = {}

    def timed(phase: str, tier: str, fn) -> None:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        gib_s = n_blocks * LAYOUT.block_nbytes / seconds / GIB
        same = all(np.array_equal(a, b) for a, b in zip(blocks, outs)) if result is not None else None
        rows.append((phase, tier, seconds, gib_s, limits.get(tier), same))

    try:
        limits["host"] = host_copy_gib_s(LAYOUT.block_nbytes)
        try:
            # the blocks the phases read, one get_many of the whole context (one request in flight)
            limits["disk"] = disk_limit_gib_s(directory, LAYOUT.block_nbytes, in_flight=1, span_blocks=n_blocks)
        except OSError as exc:
            # the probe's scratch file did not fit (ENOSPC) or could not be made: a measurement
            # only, the round trip runs without a disk limit
            console.print(f"disk limit not measured: {exc}", style="dim")
        store = _open(directory, host_blocks=n_blocks)  # room for one context
        cache = ContextCache(store, ns)
        keys = cache.keys(context)
        timed("save a 4k-token context", "host", lambda: cache.save(keys, blocks) and None)
        # Another context of the same size pushes the first one down to disk;
        # then it ends (deleted), so that reloading promotes without demoting it.
        other = cache.keys(rng.integers(0, 32000, CONTEXT_TOKENS))
        cache.save(other, blocks)
        where = cache.lookup(context).tiers
        store.delete(other)
        timed("reload after eviction", "disk", lambda: cache.load(keys, outs))
        timed("reload again (promoted)", "host", lambda: cache.load(keys, outs))
        store.close()
        store = _open(directory, host_blocks=n_blocks)  # a restart: empty host, same directory
        cache = ContextCache(store, ns)
        after = cache.lookup(context)
        timed("reload after a restart", "disk", lambda: cache.load(keys, outs))
        store.close()
    finally:
        if args.store_dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    table = Table(title=f"synthetic KV round trip: {CONTEXT_TOKENS} tokens = {n_blocks} blocks x "
                        f"{LAYOUT.block_nbytes >> 10} KiB ({n_blocks * LAYOUT.block_nbytes >> 20} MiB)")
    for column in ("phase", "tier", "ms", "GiB/s", "tier limit", "of limit", "bytes equal"):
        table.add_column(column, justify="left" if column in ("phase", "tier") else "right")
    for phase, tier, seconds, gib_s, limit, same in rows:
        table.add_row(phase, tier, f"{seconds * 1000:.1f}", f"{gib_s:.2f}", f"{limit:.2f}" if limit else "-",
                      f"{gib_s / limit * 100:.0f}%" if limit else "-", "-" if same is None else ("yes" if same else "NO"))
    console.print(table)
    for warning in _limit_warnings(rows):
        console.print(f"WARNING: {warning}", style="bold red")
    console.print(f"after eviction the context was found in: {sorted(set(where))}; "
                  f"after the restart: {after.hit_blocks}/{n_blocks} blocks, in {sorted(set(after.tiers))}")
    ok = all(same in (None, True) for *_, same in rows) and after.hit_blocks == n_blocks
    return 0 if ok else 1
