"""``kvtier demo --synthetic``: store → evict → reload of synthetic KV, no model, no torch.

For machines without torch: the same store the real demo uses (a small host
pool over a disk tier, write-back so that host evictions demote to disk), fed
random blocks of the demo model's geometry through the token-level
:class:`ContextCache`. It saves a 4 k-token context, saves more until the host
pool evicts it to disk, reloads it (from disk, promoting into the room the other context left), reloads it again
(from host), then reopens the store as a restart would and reloads from disk.
Every reload is compared byte for byte over the blocks it loaded, and its rate is
over those blocks' bytes; a reload that loaded fewer than the context's blocks says
how many and why the rest are missing (a file system too full to store them, or not
loaded). Each phase is timed against the tier limit measured in the same run (the
disk's at the layout's block size, the best of the request shapes a load of the
context can take), and a phase above its limit is printed with a warning: the limit
is then wrong, not the phase fast. ``--json`` prints the phases as one strict JSON
object instead of the table.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.bench.baselines import ratio_warnings, report_warnings
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.demo.limits import disk_limit_gib_s, host_copy_gib_s
from kvtier.demo.preflight import writable_dir
from kvtier.json_files import strict_json
from kvtier.store.context import CachedPrefix, ContextCache
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

GIB = float(1 << 30)
#: the demo model's KV geometry: 16 KiB a token, 512 KiB a 32-token block
LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=32)
CONTEXT_TOKENS = 4096
N_BLOCKS = CONTEXT_TOKENS // LAYOUT.block_tokens


#: why a load came short of the context: the file system had no room to store the rest
DISK_FULL = "not stored (disk full)"
#: a load came short of the context while the file system had room (missing or unreadable blocks: a defect)
NOT_LOADED = "not loaded"


class Phase(NamedTuple):
    """One timed step of the round trip."""

    name: str
    tier: str
    seconds: float
    blocks: int  #: blocks saved; or loaded (the leading run the store served: what an engine can use)
    limit: float | None  #: the tier's limit measured in this run (GiB/s); None where not measured
    bytes_equal: bool | None  #: the loaded blocks hold the saved bytes; None for a save or nothing loaded
    shortfall: str | None  #: why the context's other blocks were not loaded (:data:`DISK_FULL`, ...); None if none

    @property
    def gib_s(self) -> float | None:
        """The rate over the bytes this phase moved; None when it moved none (no rate of nothing)."""
        return self.blocks * LAYOUT.block_nbytes / self.seconds / GIB if self.blocks and self.seconds > 0 else None

    @property
    def of_limit(self) -> float | None:
        return self.gib_s / self.limit if self.gib_s is not None and self.limit else None


class RoundTrip(NamedTuple):
    phases: list[Phase]
    found_after_eviction: list[str]  #: the tiers the context was found in once the other evicted it
    after_restart: CachedPrefix  #: what a reopened store finds of the context


def _open(directory: str, host_blocks: int) -> TieredStore:
    host = HostTier(host_blocks * LAYOUT.block_nbytes, LAYOUT.block_nbytes)
    return TieredStore([host, DiskTier(directory, 1 << 30)], write_mode="write-back")


def _limit_warnings(phases: list[Phase]) -> list[str]:
    """A warning for each phase above its tier's limit (``ratio_warnings``' bound)."""
    return ratio_warnings({f"{p.name!r} of the {p.tier} limit": p.of_limit for p in phases if p.of_limit},
                          what="tier limit measured in this run")


def _shortfall(directory: str, missing_blocks: int) -> str | None:
    """Why ``missing_blocks`` of the context were not loaded: the file system under ``directory``
    has less room than they take (the disk tier could not store them, and evicted some of the
    context to store the rest), else they were stored and not loaded (a defect)."""
    if not missing_blocks:
        return None
    return DISK_FULL if shutil.disk_usage(directory).free < missing_blocks * LAYOUT.block_nbytes else NOT_LOADED


def _round_trip(directory: str, console: Console) -> RoundTrip:
    """Save a context, evict it to disk, reload it from disk, from host, and after a restart."""
    rng = np.random.default_rng(0)
    ns = Namespace("synthetic/demo", LAYOUT, weights_revision="random")
    context = rng.integers(0, 32000, CONTEXT_TOKENS)
    blocks = [rng.standard_normal(LAYOUT.block_shape, dtype=np.float32) for _ in range(N_BLOCKS)]
    outs = [np.empty(LAYOUT.block_shape, np.float32) for _ in range(N_BLOCKS)]
    phases: list[Phase] = []
    limits = {}

    def timed_save(name: str, tier: str, save) -> None:
        start = time.perf_counter()
        statuses = save()
        seconds = time.perf_counter() - start
        phases.append(Phase(name, tier, seconds, sum(s.ok for s in statuses), limits.get(tier), None, None))

    def timed_load(name: str, tier: str, load) -> None:
        for out in outs:   # (untimed) a load that reports blocks it did not write cannot pass on the last one's
            out.fill(np.nan)
        start = time.perf_counter()
        loaded = load().loaded
        seconds = time.perf_counter() - start
        # only the loaded blocks were written into ``outs``: the others hold the NaN put there
        same = all(np.array_equal(a, b) for a, b in zip(blocks[:loaded], outs[:loaded])) if loaded else None
        phases.append(Phase(name, tier, seconds, loaded, limits.get(tier), same,
                            _shortfall(directory, N_BLOCKS - loaded)))

    limits["host"] = host_copy_gib_s(LAYOUT.block_nbytes)
    try:
        # the blocks the phases read, one get_many of the whole context (one request in flight)
        limits["disk"] = disk_limit_gib_s(directory, LAYOUT.block_nbytes, in_flight=1, span_blocks=N_BLOCKS)
    except OSError as exc:
        # the probe's scratch file did not fit (ENOSPC) or could not be made: a measurement
        # only, the round trip runs without a disk limit
        console.print(f"disk limit not measured: {exc}", style="dim")
    store = _open(directory, host_blocks=N_BLOCKS)  # room for one context
    cache = ContextCache(store, ns)
    keys = cache.keys(context)
    timed_save("save a 4k-token context", "host", lambda: cache.save(keys, blocks))
    # Another context of the same size pushes the first one down to disk;
    # then it ends (deleted), so that reloading promotes without demoting it.
    other = cache.keys(rng.integers(0, 32000, CONTEXT_TOKENS))
    cache.save(other, blocks)
    where = cache.lookup(context).tiers
    store.delete(other)
    timed_load("reload after eviction", "disk", lambda: cache.load(keys, outs))
    timed_load("reload again (promoted)", "host", lambda: cache.load(keys, outs))
    store.close()
    store = _open(directory, host_blocks=N_BLOCKS)  # a restart: empty host, same directory
    cache = ContextCache(store, ns)
    after = cache.lookup(context)
    timed_load("reload after a restart", "disk", lambda: cache.load(keys, outs))
    store.close()
    return RoundTrip(phases, sorted(set(where)), after)


def _failures(trip: RoundTrip, directory: str) -> list[str]:
    """Why the round trip did not bring the context back whole and byte for byte, a line per kind
    of failure (empty: it did)."""
    failures = []
    differ = [p.name for p in trip.phases if p.bytes_equal is False]
    if differ:
        failures.append(f"blocks loaded with bytes other than those saved: {', '.join(differ)}")
    short = [p for p in trip.phases if p.shortfall]
    if short:
        loads = ", ".join(f"{p.name} {p.blocks}/{N_BLOCKS}" for p in short)
        if any(p.shortfall == DISK_FULL for p in short):
            failures.append(f"blocks loaded: {loads}; the rest were not stored: the file system of {directory} has "
                            f"{shutil.disk_usage(directory).free >> 20} MiB free, the context takes "
                            f"{N_BLOCKS * LAYOUT.block_nbytes >> 20} MiB (give --store-dir a directory with room)")
        else:
            failures.append(f"blocks loaded: {loads}; the rest were not (missing or unreadable, with room on the disk)")
    elif trip.after_restart.hit_blocks != N_BLOCKS:
        failures.append(f"after the restart the store found {trip.after_restart.hit_blocks}/{N_BLOCKS} blocks")
    return failures


def run_synthetic(args) -> int:
    as_json = getattr(args, "json", False)
    # with --json, stdout holds the JSON object only: what else is said goes to stderr
    console = Console(file=sys.stderr if as_json else sys.stdout, highlight=False, width=110)
    # bad input is one line and exit 2 (ConfigError), before anything is written
    directory = writable_dir(args.store_dir, "--store-dir") if args.store_dir else tempfile.mkdtemp(
        prefix="kvtier-synthetic-")
    try:
        trip = _round_trip(directory, console)
        failures = _failures(trip, directory)
    finally:
        if args.store_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    warnings = _limit_warnings(trip.phases)
    if as_json:
        print(strict_json(_as_json(trip, warnings, ok=not failures)))
        report_warnings(warnings)
    else:
        _print(console, trip, warnings)
    for failure in failures:
        print(f"kvtier demo --synthetic: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _cells(p: Phase) -> list[str]:
    if p.bytes_equal is None:
        same = "-" if p.shortfall is None else p.shortfall  # a save, or a load of nothing
    else:
        same = ("yes" if p.bytes_equal else "NO") + (f"; the rest {p.shortfall}" if p.shortfall else "")
    return [p.name, p.tier, f"{p.seconds * 1000:.1f}", "-" if p.gib_s is None else f"{p.gib_s:.2f}",
            f"{p.limit:.2f}" if p.limit else "-", "-" if p.of_limit is None else f"{p.of_limit * 100:.0f}%",
            f"{p.blocks}/{N_BLOCKS}", same]


def _print(console: Console, trip: RoundTrip, warnings: list[str]) -> None:
    table = Table(title=f"synthetic KV round trip: {CONTEXT_TOKENS} tokens = {N_BLOCKS} blocks x "
                        f"{LAYOUT.block_nbytes >> 10} KiB ({N_BLOCKS * LAYOUT.block_nbytes >> 20} MiB)")
    for column in ("phase", "tier", "ms", "GiB/s", "tier limit", "of limit", "blocks", "bytes equal"):
        table.add_column(column, justify="left" if column in ("phase", "tier", "bytes equal") else "right")
    for phase in trip.phases:
        table.add_row(*_cells(phase))
    console.print(table)
    for warning in warnings:
        console.print(f"WARNING: {warning}", style="bold red")
    after = trip.after_restart
    console.print(f"after eviction the context was found in: {trip.found_after_eviction}; "
                  f"after the restart: {after.hit_blocks}/{N_BLOCKS} blocks, in {sorted(set(after.tiers))}")


def _as_json(trip: RoundTrip, warnings: list[str], *, ok: bool) -> dict:
    return {
        "mode": "synthetic",
        "context_tokens": CONTEXT_TOKENS,
        "context_blocks": N_BLOCKS,
        "block_bytes": LAYOUT.block_nbytes,
        "phases": [{"phase": p.name, "tier": p.tier, "seconds": p.seconds, "blocks": p.blocks, "gib_s": p.gib_s,
                    "tier_limit_gib_s": p.limit, "of_limit": p.of_limit, "bytes_equal": p.bytes_equal,
                    "shortfall": p.shortfall} for p in trip.phases],
        "found_after_eviction": trip.found_after_eviction,
        "found_after_restart_blocks": trip.after_restart.hit_blocks,
        "found_after_restart_tiers": sorted(set(trip.after_restart.tiers)),
        "warnings": warnings,
        "ok": ok,
    }
