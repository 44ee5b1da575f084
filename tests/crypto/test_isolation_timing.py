"""Isolation across tiers and the cross-tenant timing side channel (cf. vLLM CVE-2025-46570).

The timing tests time, interleaved, four populations of probes made by one
tenant (B): its own blocks (hit), absent keys (miss), keys another tenant (A)
has stored (foreign) and other absent keys (absent). hit vs miss is the
positive control -- a real difference the same procedure must resolve, or the
run is invalid; foreign vs absent must be equivalent within a margin that is a
fraction of that control (tests/crypto/timing.py explains the statistics).
The same check is shown to catch deliberately leaky variants.
"""

import hashlib

import numpy as np
import pytest

from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.server.launch import ServerProcess
from kvtier.store.context import ContextCache
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.wrapper import WrappingTier
from tests.crypto.timing import (
    TimingLeak, TimingTestInvalid, assert_indistinguishable, judge, spin,
)
from tests.server.harness import SHARED, TOKENS, tenants

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)

#: the margin: this fraction of the hit-vs-miss effect of the same run, or the floor if larger
FRACTION = 0.1
#: rounds per batch, and the most a check may take before it is called inconclusive
ROUNDS, MAX_ROUNDS = 1000, 4000
LEAK_ROUNDS = 250
POOL = 256  #: items per population (each visited equally often; see timing.py)


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


# -- the embedded store: one host tier both tenants share, a disk tier in one shared directory -----------
class LeakyTier(WrappingTier):
    """A deliberately broken tier: a key whose tokens another tenant has cached costs ``leak_ns`` more
    before it answers "miss" -- the found-then-refused pattern of a store that keys by tokens and
    checks the tenant afterwards. ``elsewhere`` stands in for that token index."""

    def __init__(self, inner, elsewhere: set, leak_ns: int) -> None:
        super().__init__(inner)
        self.name = f"leaky({inner.name})"
        self.elsewhere, self.leak_ns = elsewhere, leak_ns

    def _probe(self, key) -> None:
        if key in self.elsewhere:
            spin(self.leak_ns)

    def lookup_prefix(self, keys) -> int:
        if keys:
            self._probe(keys[0])
        return self.inner.lookup_prefix(keys)

    def contains(self, key) -> bool:
        self._probe(key)
        return self.inner.contains(key)

    def get(self, key, out):
        self._probe(key)
        return self.inner.get(key, out)

    def put(self, key, data, **kw):
        return self.inner.put(key, data, **kw)

    def delete(self, key) -> bool:
        return self.inner.delete(key)

    def keys(self):
        return self.inner.keys()


class Embedded:
    """Tenant A's and tenant B's stores over shared tiers; A's prompts half in DRAM and on disk, half on
    disk only (either could leak differently); B's own prompts (the control's hits) in DRAM."""

    def __init__(self, root, keyring, encrypted: bool) -> None:
        self.host = HostTier(8 * POOL * LAYOUT.block_nbytes, LAYOUT.block_nbytes)
        disk = DiskTier(root / "shared", 8 * POOL * LAYOUT.block_nbytes)
        self.lower = {t: EncryptedTier(disk, keyring, t, threads=1) if encrypted else disk for t in "ab"}
        self.a = ContextCache(TieredStore([self.host, self.lower["a"]], write_mode="write-through"), ns("a"))
        self.b = self.cache_b()
        rng = np.random.default_rng(5)
        self.prompts = {label: [rng.integers(0, 32000, LAYOUT.block_tokens) for _ in range(POOL)]
                        for label in ("hit", "miss", "foreign", "absent")}
        one = blocks(1)
        for i, p in enumerate(self.prompts["foreign"]):
            keys = self.a.keys(p)
            self.a.save(keys, one)
            if i % 2:
                assert self.host.delete(keys[0])  # on disk only
        for p in self.prompts["hit"]:
            self.b.save(self.b.keys(p), one)
        self.b_keys = {label: [self.b.keys(p) for p in ps] for label, ps in self.prompts.items()}

    def cache_b(self, leak_ns: int = 0) -> ContextCache:
        host = self.host
        if leak_ns:
            elsewhere = {self.b.keys(p)[0] for p in self.prompts["foreign"]}
            host = LeakyTier(self.host, elsewhere, leak_ns)
        return ContextCache(TieredStore([host, self.lower["b"]], write_mode="write-through"), ns("b"))

    def probes(self, op: str, cache: ContextCache):
        outs = [np.empty(LAYOUT.block_shape, np.float16)]
        if op == "lookup":
            return {label: (lambda i, ps=ps: cache.lookup(ps[i % POOL])) for label, ps in self.prompts.items()}
        return {label: (lambda i, ks=ks: cache.load(ks[i % POOL], outs)) for label, ks in self.b_keys.items()}


@pytest.fixture(scope="module", params=["disk", "encrypted-disk"])
def embedded(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("timing")
    keyring = Keyring(StaticMasterKey(bytes(range(32))), root / "keys", refresh_s=0.0)
    world = Embedded(root, keyring, encrypted=request.param == "encrypted-disk")
    # the populations are what they claim to be
    assert all(world.b.lookup(p).hit_blocks == 1 for p in world.prompts["hit"])
    assert all(world.a.lookup(p).hit_blocks == 1 for p in world.prompts["foreign"])
    assert not any(world.b.lookup(p).hit_blocks for label in ("miss", "foreign", "absent")
                   for p in world.prompts[label])
    return world


EMBEDDED_FLOOR_NS = 500  # the margin never goes below 0.5 µs


@pytest.mark.parametrize("op", ["lookup", "get"])
def test_embedded_store_times_a_foreign_block_like_an_absent_one(embedded, op):
    verdict = assert_indistinguishable(embedded.probes(op, embedded.b), rounds=ROUNDS, max_rounds=MAX_ROUNDS,
                                       fraction=FRACTION, floor_ns=EMBEDDED_FLOOR_NS, seed=1)
    print(f"embedded {op}: {verdict}")


@pytest.mark.parametrize("op", ["lookup", "get"])
@pytest.mark.parametrize("leak_us", [200, 10])
def test_the_check_catches_a_leaky_embedded_tier(embedded, op, leak_us):
    leaky = embedded.cache_b(leak_ns=leak_us * 1000)
    with pytest.raises(TimingLeak) as caught:  # smaller batches: a leak is called as soon as it is clear
        assert_indistinguishable(embedded.probes(op, leaky), rounds=LEAK_ROUNDS, max_rounds=MAX_ROUNDS,
                                 fraction=FRACTION, floor_ns=EMBEDDED_FLOOR_NS, seed=2)
    gap = caught.value.verdict.gap
    assert gap.nearest >= caught.value.verdict.margin_ns
    # It measured the leak, not noise. Only the lower bound is tight: an injected delay can
    # overshoot on a loaded machine (a preempted sleep), never undershoot.
    assert 0.7 * leak_us * 1000 < gap.ns < 5 * leak_us * 1000


# -- a real `kvtier serve` over TCP: acme (A) and globex (B) in a namespace of the same name ---------------
SERVER_BLOCK = 16 * 1024
CHAIN = 8  #: keys per lookup: a hit walks them all, a miss stops at the first
SERVER_FLOOR_NS = 2000  # loopback TCP round trips: the margin never goes below 2 µs


class Served:
    def __init__(self, srv: ServerProcess) -> None:
        self.b = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace="same-name")
        a = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="same-name")
        self.chains = {label: [[hashlib.sha256(f"{label}/{i}/{j}".encode()).digest() for j in range(CHAIN)]
                               for i in range(POOL // 2)] for label in ("hit", "miss", "foreign", "absent")}
        data = np.random.default_rng(0).integers(0, 256, SERVER_BLOCK, dtype=np.uint8)
        # A's blocks first: B's that follow push the oldest of them out of DRAM, onto disk only
        for owner, label in ((a, "foreign"), (self.b, "hit")):
            for chain in self.chains[label]:
                assert owner.put_many(chain, [data] * CHAIN) == [Status.OK] * CHAIN
        self.a = a

    def probes(self, op: str, leak_ns: int = 0):
        out = np.empty(SERVER_BLOCK, np.uint8)
        n = POOL // 2

        def probe(label, chains):
            if op == "lookup":
                call = lambda i: self.b.lookup_prefix(chains[i % n])  # noqa: E731
            else:
                call = lambda i: self.b.get(chains[i % n][0], out)  # noqa: E731
            if leak_ns and label == "foreign":  # a server that answered another tenant's key later
                return lambda i: (spin(leak_ns), call(i))
            return call

        return {label: probe(label, chains) for label, chains in self.chains.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    wd = tmp_path_factory.mktemp("timing-serve")
    # 24 MiB of DRAM for 2 x 16 MiB of blocks: all are written behind to disk, 8 MiB of acme's only there
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(wd), server={
        "capacity": "24MiB", "max_block": "1MiB", "disk_dir": str(wd / "disk"), "disk_capacity": "64MiB",
    }) as srv:
        world = Served(srv)
        b, chains = world.b, world.chains
        assert all(b.lookup_prefix(c) == CHAIN for c in chains["hit"])
        assert all(world.a.lookup_prefix(c) == CHAIN for c in chains["foreign"])
        assert not any(b.lookup_prefix(c) for label in ("miss", "foreign", "absent") for c in chains[label])
        yield world
        world.a.close()
        b.close()


@pytest.mark.parametrize("op", ["lookup", "get"])
def test_server_times_a_foreign_block_like_an_absent_one(served, op):
    verdict = assert_indistinguishable(served.probes(op), rounds=ROUNDS, max_rounds=MAX_ROUNDS,
                                       fraction=FRACTION, floor_ns=SERVER_FLOOR_NS, seed=3)
    print(f"server {op}: {verdict}")


@pytest.mark.parametrize("op", ["lookup", "get"])
def test_the_check_catches_a_leak_through_the_server(served, op):
    """A foreign key answered 10 µs later (a few times the margin, a tenth of a loopback round trip).
    The delay is added inside the timed probe, on the client side: from the timer's point of view
    the same as a server that did extra work for a key another tenant holds."""
    with pytest.raises(TimingLeak) as caught:
        assert_indistinguishable(served.probes(op, leak_ns=10_000), rounds=LEAK_ROUNDS, max_rounds=MAX_ROUNDS,
                                 fraction=FRACTION, floor_ns=SERVER_FLOOR_NS, seed=4)
    assert caught.value.verdict.gap.nearest >= caught.value.verdict.margin_ns
    assert 7_000 < caught.value.verdict.gap.ns < 50_000  # an injected delay may overshoot under load, not undershoot


# -- the check itself ------------------------------------------------------------------------------------
def synthetic(shift_ns: float, control_ns: float, n: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    """Heavy-tailed latencies (lognormal around 100 µs, with a slow mode 20% of the time that hits
    whole rounds, as a descheduled process does)."""
    rng = np.random.default_rng(seed)
    slow = np.where(rng.random(n) < 0.2, 60_000, 0)

    def population(extra):
        return (rng.lognormal(np.log(100_000), 0.1, n) + slow + extra).astype(np.int64)

    return {"hit": population(control_ns), "miss": population(0), "foreign": population(shift_ns),
            "absent": population(0)}


def test_judge_passes_equal_populations_and_flags_a_shift_beyond_the_margin():
    honest = judge(synthetic(0, 30_000), fraction=FRACTION, floor_ns=SERVER_FLOOR_NS)
    assert honest.control_ok and honest.equivalent and not honest.leaking
    leak = judge(synthetic(10_000, 30_000), fraction=FRACTION, floor_ns=SERVER_FLOOR_NS)
    assert leak.control_ok and leak.leaking and not leak.equivalent
    assert 8_000 < leak.gap.ns < 12_000


def test_judge_refuses_a_run_whose_control_is_not_resolved():
    blind = judge(synthetic(0, 0), fraction=FRACTION, floor_ns=SERVER_FLOOR_NS)
    assert not blind.control_ok  # a yardstick of zero: whatever the gap, the run proves nothing


def test_a_blind_procedure_fails_loudly_instead_of_passing():
    """Hits that cost what misses cost: the procedure has no control, so it must not pass."""
    same = {label: (lambda i: spin(20_000)) for label in ("hit", "miss", "foreign", "absent")}
    with pytest.raises(TimingTestInvalid):
        assert_indistinguishable(same, rounds=500, max_rounds=1000, fraction=FRACTION,
                                 floor_ns=SERVER_FLOOR_NS, seed=5)
