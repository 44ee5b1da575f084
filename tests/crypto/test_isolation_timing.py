"""Isolation across tiers and the cross-tenant timing side channel (cf. vLLM CVE-2025-46570)."""

import random
import time

import numpy as np
import pytest
from scipy.stats import ks_2samp

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.store.context import ContextCache
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def ns(tenant):
    return Namespace("m", LAYOUT, weights_revision="r", tenant=tenant)


def blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(LAYOUT.block_shape).astype(np.float16) for _ in range(n)]


@pytest.mark.parametrize("kind", ["host", "disk", "encrypted-disk"])
def test_zero_cross_tenant_hits_beside_a_control_that_hits(kind, tmp_path, keyring):
    def tier_for(tenant):
        if kind == "host":
            return HostTier(64 * LAYOUT.block_nbytes, LAYOUT.block_nbytes)
        disk = DiskTier(tmp_path / "shared", 256 * LAYOUT.block_nbytes)
        return disk if kind == "disk" else EncryptedTier(disk, keyring, tenant, threads=1)

    shared = tier_for("a") if kind == "host" else None
    caches = {}
    for tenant in ("a", "b"):
        tier = shared or tier_for(tenant)
        caches[tenant] = ContextCache(TieredStore([tier]), ns(tenant))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 32000, 4 * LAYOUT.block_tokens) for _ in range(10)]
    for p in prompts:
        caches["a"].save(caches["a"].keys(p), blocks(4))
    control = sum(caches["a"].lookup(p).hit_blocks for p in prompts)
    cross = sum(caches["b"].lookup(p).hit_blocks for p in prompts)
    outs = [np.empty(LAYOUT.block_shape, np.float16) for _ in range(4)]
    cross_loads = sum(caches["b"].load(caches["b"].keys(p), outs).loaded for p in prompts)
    assert control == 40
    assert cross == 0 and cross_loads == 0
    # Control for the loads too: the owner loads every block, byte for byte, into poisoned buffers.
    for p in prompts:
        for out in outs:
            out.fill(np.nan)
        assert caches["a"].load(caches["a"].keys(p), outs).loaded == 4
        assert all(np.array_equal(out, want) for out, want in zip(outs, blocks(4)))


def test_lookup_of_foreign_and_absent_blocks_is_indistinguishable(tmp_path, keyring):
    """≥ 2,000 interleaved probes each; a two-sample KS test must not tell them apart."""
    disk = DiskTier(tmp_path / "shared", 4096 * LAYOUT.block_nbytes)
    host = HostTier(4096 * LAYOUT.block_nbytes, LAYOUT.block_nbytes)
    store_a = TieredStore([host, EncryptedTier(disk, keyring, "a", threads=1)])
    cache_a = ContextCache(store_a, ns("a"))
    cache_b = ContextCache(TieredStore([host, EncryptedTier(disk, keyring, "b", threads=1)]), ns("b"))
    rng = np.random.default_rng(5)
    n = 2000
    stored = [rng.integers(0, 32000, LAYOUT.block_tokens) for _ in range(n)]
    absent = [rng.integers(0, 32000, LAYOUT.block_tokens) for _ in range(n)]
    one = blocks(1)
    for p in stored:
        cache_a.save(cache_a.keys(p), one)
    assert all(cache_a.lookup(p).hit_blocks == 1 for p in stored[:50])  # control

    order = [("foreign", p) for p in stored] + [("absent", p) for p in absent]
    random.Random(11).shuffle(order)  # interleave so machine noise hits both alike
    times = {"foreign": [], "absent": []}
    for _ in range(2):  # warm-up pass, then the measured pass
        for label in times:
            times[label].clear()
        for label, prompt in order:
            t0 = time.perf_counter_ns()
            hit = cache_b.lookup(prompt).hit_blocks
            times[label].append(time.perf_counter_ns() - t0)
            assert hit == 0
    result = ks_2samp(times["foreign"], times["absent"])
    assert result.pvalue > 0.01, (
        f"foreign vs absent lookups are distinguishable: KS={result.statistic:.3f} p={result.pvalue:.4f}, "
        f"medians {np.median(times['foreign'])} vs {np.median(times['absent'])} ns"
    )
