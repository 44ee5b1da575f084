"""Real vLLM with the kvtier connector and an embedded store (host DRAM + disk).

The writer engine's host tier holds 16 blocks, so its blocks really reach the
disk tier (evicted, or copied by write-behind); a second engine process on the
same directory, with no host tier, then loads them from disk. Every load writes
into pages poisoned with NaN first (``KVTIER_DEBUG_POISON``, set by the suite),
so a load that writes nothing fails its comparison.

Both engines publish vLLM's KV events over ZMQ (ipc): the writer's host tier as medium
"CPU" events beside its GPU pool's, the reader (no host tier) its GPU pool's only.
"""

from __future__ import annotations

import time

import pytest

from tests.integrations.vllm.harness import loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)

BLOCK_TOKENS = 64  # two vLLM pages of 32
BLOCK_BYTES = 64 << 10  # the tiny model: 2 layers x 2 (K, V) x 2 heads x 64 tokens x 32 dims x fp32
HOST_BLOCKS = 16


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvtier-disk")


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-events")


def kv_events(events_dir, name: str) -> dict:
    """vLLM's KV events published on an ipc socket (vLLM binds it) in ``events_dir``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
            "endpoint": f"ipc://{events_dir}/{name}.events"}


@pytest.fixture(scope="module")
def engine(engines, tiny_model, disk_dir, events_dir):
    extra = {
        "block_tokens": BLOCK_TOKENS,
        "host_bytes": HOST_BLOCKS * BLOCK_BYTES,
        "disk_path": str(disk_dir),
        "disk_bytes": "256MiB",
    }
    engine = engines("embedded", {"model": tiny_model, "extra": extra, "kv_events": kv_events(events_dir, "writer")})
    engine.wait_ready()
    return engine


@pytest.fixture(scope="module")
def reader(engines, tiny_model, disk_dir, events_dir):
    """A second engine process on the writer's disk directory, without a host tier: every
    block it loads comes from disk, every block it saves goes straight there. Started
    once, by the first test that needs it."""
    extra = {"block_tokens": BLOCK_TOKENS, "host_bytes": 0, "disk_path": str(disk_dir), "disk_bytes": "256MiB"}
    reader = engines("reader", {"model": tiny_model, "extra": extra, "kv_events": kv_events(events_dir, "reader")})
    reader.wait_ready()
    return reader


def block_files(path) -> set:
    return {p for p in path.rglob("*.kvb")}


def expected_hit(length: int) -> int:
    """Whole kvtier blocks, cut to whole 32-token pages that leave two tokens to compute."""
    return min(length // BLOCK_TOKENS * BLOCK_TOKENS, (length - 2) // 32 * 32)


def test_reset_prefix_cache_then_load_from_kvtier_gives_identical_tokens_and_logprobs(engine):
    # 300, 337, 374 tokens; 384 (whole blocks) and 385 (one past a page) leave 32 and 33 tokens to compute
    batch = prompts(3, 300, seed=1) + prompts(1, 384, seed=2) + prompts(1, 385, seed=3)
    first = engine.generate(batch, max_tokens=12)
    assert all(loaded_tokens(o) == 0 for o in first), "a fresh store holds nothing"
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"], "vLLM's prefix cache must be empty for the second run"
    second = engine.generate(batch, max_tokens=12)
    for prompt, a, b in zip(batch, first, second):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["num_cached_tokens"] == loaded_tokens(b)
        assert b["token_ids"] == a["token_ids"]
        assert b["logprobs"] == a["logprobs"], "top-5 logprobs must be identical, not merely close"
    stats = engine.call(op="stats")
    assert stats["worker"]["failed_pages"] == 0
    blocks_read = sum(-(-expected_hit(len(p)) // BLOCK_TOKENS) for p in batch)  # a partial block is read whole
    assert stats["worker"]["loaded_blocks"] == blocks_read


def test_small_host_loads_beside_other_requests_land_before_their_forward(engine):
    """Requests batched together: each finds others in the engine, and its load (a few KiB,
    all in the host tier) runs in the step of its forward (``sync_load_max_bytes``), not
    between steps. Pages are poisoned first: a load landing after the forward shows."""
    batch = prompts(3, 200, seed=11)  # 200, 237, 274 tokens: 10 blocks, all in the 16-block host tier
    cold = engine.generate(batch, max_tokens=8, sequential=False)
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"]
    jobs = engine.call(op="stats")["worker"]["load_jobs"]
    warm = engine.generate(batch, max_tokens=8, sequential=False)
    assert engine.call(op="stats")["worker"]["load_jobs"] - jobs == len(batch)
    for prompt, a, b in zip(batch, cold, warm):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"]


def test_another_cache_salt_never_hits(engine):
    prompt = prompts(1, 320, seed=4)
    alice = engine.generate(prompt, max_tokens=4, cache_salt="alice")
    engine.call(op="flush")
    engine.call(op="reset")
    bob = engine.generate(prompt, max_tokens=4, cache_salt="bob")
    unsalted = engine.generate(prompt, max_tokens=4)
    assert loaded_tokens(bob[0]) == 0 and bob[0]["num_cached_tokens"] == 0
    assert loaded_tokens(unsalted[0]) == 0
    engine.call(op="flush")
    engine.call(op="reset")
    again = engine.generate(prompt, max_tokens=4, cache_salt="alice")
    assert loaded_tokens(again[0]) == expected_hit(320), "the salted blocks are there, for their own salt"
    assert again[0]["token_ids"] == alice[0]["token_ids"]


def test_failed_loads_are_recomputed(engine):
    batch = prompts(2, 400, seed=7)
    first = engine.generate(batch, max_tokens=6)
    engine.call(op="flush")
    engine.call(op="reset")
    before = engine.call(op="stats")["worker"]["failed_pages"]
    engine.call(op="break_loads")
    try:
        second = engine.generate(batch, max_tokens=6)
    finally:
        engine.call(op="fix_loads")
    after = engine.call(op="stats")["worker"]["failed_pages"]
    assert after - before == sum(expected_hit(len(p)) // 32 for p in batch), "every page planned was reported"
    for a, b in zip(first, second):
        assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


def test_poisoned_pages_catch_a_load_that_writes_nothing(engine):
    batch = prompts(1, 300, seed=51)
    cold = engine.generate(batch, max_tokens=6)
    engine.call(op="flush")
    engine.call(op="reset")
    assert engine.call(op="stats")["worker"]["poison"], "the suite runs every engine with poisoned loads"
    engine.call(op="skip_load_copies")
    try:
        broken = engine.generate(batch, max_tokens=6)
    finally:
        engine.call(op="fix_loads")
    assert loaded_tokens(broken[0]) == expected_hit(300) > 0, "the broken load claims its pages"
    assert broken[0]["logprobs"] != cold[0]["logprobs"], "pages the load never wrote must show as NaN"


def test_a_second_engine_process_loads_from_disk_what_the_first_spilled(engine, reader):
    batch = prompts(3, 330, seed=21)
    cold = engine.generate(batch, max_tokens=8)
    assert all(loaded_tokens(o) == 0 for o in cold), "fresh prompts: a recompute"
    engine.generate(prompts(4, 400, seed=22), max_tokens=1)  # 26 more blocks through a 16-block host tier
    engine.call(op="flush")
    tiers = engine.call(op="stats")["worker"]["store"]["tiers"]
    assert tiers["host"]["evictions"] > 0 and tiers["disk"]["puts"] > 0, "the small host tier spilled to disk"
    warm = reader.generate(batch, max_tokens=8)
    for prompt, a, b in zip(batch, cold, warm):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"]
        assert b["logprobs"] == a["logprobs"], "top-5 logprobs of a disk load equal the recompute's"
    stats = reader.call(op="stats")["worker"]
    assert stats["failed_pages"] == 0
    assert stats["store"]["tiers"]["disk"]["hits"] >= sum(-(-expected_hit(len(p)) // BLOCK_TOKENS) for p in batch)


def test_a_block_corrupted_on_disk_mid_chain_stops_the_load_there(engine, reader, disk_dir):
    k = 3
    (base,) = prompts(1, 6 * BLOCK_TOKENS + 20, seed=41)  # 404 tokens: 6 full blocks
    engine.call(op="flush")  # the writer's write-behind is done: new files below are the reader's
    reference = reader.generate([base], max_tokens=8, cache_salt="reference")[0]  # another salt: recomputed
    assert loaded_tokens(reference) == 0
    # Find block k's file: store blocks 0..k-1, then block k alone.
    reader.generate([base[: k * BLOCK_TOKENS + 20]], max_tokens=1)
    reader.call(op="flush")
    before = block_files(disk_dir)
    reader.generate([base[: (k + 1) * BLOCK_TOKENS + 20]], max_tokens=1)
    reader.call(op="flush")
    (block_k,) = block_files(disk_dir) - before
    reader.generate([base], max_tokens=1)  # blocks k+1..5
    reader.call(op="flush")
    assert len(block_files(disk_dir) - before) == 6 - k
    with open(block_k, "r+b") as f:  # a byte of the payload (after the 4 KiB header page)
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0x5A]))
    reader.call(op="reset")
    before_stats = reader.call(op="stats")["worker"]
    out = reader.generate([base], max_tokens=8)[0]
    after_stats = reader.call(op="stats")["worker"]
    assert after_stats["loaded_blocks"] - before_stats["loaded_blocks"] == k, "the load stops at block k"
    assert after_stats["failed_pages"] - before_stats["failed_pages"] == (6 - k) * 2, "the rest is recomputed"
    assert out["token_ids"] == reference["token_ids"]
    assert out["logprobs"] == reference["logprobs"]
    # The corrupt copy was dropped, and blocks k..5, recomputed, were saved again (before, the
    # save cursor had passed them at the lookup: the chain stayed broken at k for good): the
    # next load reads the whole chain, and it is right.
    reader.call(op="flush")
    reader.call(op="reset")
    before_stats = reader.call(op="stats")["worker"]
    again = reader.generate([base], max_tokens=8)[0]
    after_stats = reader.call(op="stats")["worker"]
    assert after_stats["loaded_blocks"] - before_stats["loaded_blocks"] == 6, "the recomputed blocks were saved"
    assert after_stats["failed_pages"] == before_stats["failed_pages"]
    assert again["token_ids"] == reference["token_ids"]
    assert again["logprobs"] == reference["logprobs"]


# After the tests that read the writer's blocks from another engine process (the reader keys as
# before any reset): it moves the writer's key epoch.
def test_a_connector_cache_reset_makes_every_prompt_seen_before_miss(engine):
    """vLLM's reset_prefix_cache(reset_connector=True) -- what a weight update's cache clearing,
    release_kv_cache_memory and POST /reset_prefix_cache?reset_external=true call -- reported
    success and kvtier went on serving every block stored before (KV of the old weights)."""
    batch = prompts(2, 300, seed=61)
    cold = engine.generate(batch, max_tokens=8)
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"]
    warm = engine.generate(batch, max_tokens=8)
    for prompt, a, b in zip(batch, cold, warm):   # control: before the connector's reset, a hit
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"]
    engine.call(op="flush")
    assert engine.call(op="reset", connector=True)["ok"]
    after = engine.generate(batch, max_tokens=8)
    for a, b in zip(cold, after):
        assert loaded_tokens(b) == 0 and b["num_cached_tokens"] == 0, "nothing stored before the reset hits"
        assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]
    # what was computed after the reset is saved under the new epoch, and hits
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"]
    again = engine.generate(batch, max_tokens=8)
    for prompt, a, b in zip(batch, cold, again):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


# -- KV events: the host tier as medium "CPU" -------------------------------------------------
PAGE = 32


class EventTap:
    """A subscriber to an engine's KV events (vLLM's ZMQ publisher: topic, sequence, a msgpack
    ``KVEventBatch``); ``events`` keeps every event received, in order."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def drain(self, wait_s: float = 0.3) -> None:
        while self.sock.poll(int(wait_s * 1000)):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events.extend(self.decoder.decode(payload).events)
            wait_s = 0.05

    def stored(self, medium: str) -> list:
        return [e for e in self.events if type(e).__name__ == "BlockStored" and (e.medium or "GPU") == medium]

    def removed(self, medium: str) -> list:
        return [h for e in self.events if type(e).__name__ == "BlockRemoved" and (e.medium or "GPU") == medium
                for h in e.block_hashes]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _tap(engine, endpoint: str, seed: int) -> EventTap:
    """A tap that receives: a subscription takes a moment to reach the publisher, so prompts are
    sent until one's GPU events arrive."""
    tap = EventTap(endpoint)
    for attempt in range(20):
        engine.generate(prompts(1, 70, seed=seed + attempt), max_tokens=1)   # two new pages: GPU events
        tap.drain()
        if tap.stored("GPU"):
            return tap
    tap.close()
    raise AssertionError(f"no KV event from {endpoint}")


def _until(tap: EventTap, engine, done, what: str, timeout_s: float = 60) -> None:
    """Drain until ``done()``. A worker reports saves finished after its last step with its next
    step's metadata: a short prompt (no kvtier block, a vLLM prefix hit after the first) makes one."""
    deadline = time.monotonic() + timeout_s
    nudge = prompts(1, 40, seed=99)
    while True:
        tap.drain()
        if done():
            return
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        engine.generate(nudge, max_tokens=1)


def _page_hashes(tap: EventTap, tokens: list[int]) -> list:
    """vLLM's hashes of ``tokens``' full pages, from its GPU BlockStored events (by page content:
    the prompts are random)."""
    by_content = {tuple(e.token_ids[i * PAGE:(i + 1) * PAGE]): h
                  for e in tap.stored("GPU") for i, h in enumerate(e.block_hashes)}
    return [by_content[tuple(tokens[j * PAGE:(j + 1) * PAGE])] for j in range(len(tokens) // PAGE)]


def test_a_disk_only_store_publishes_no_cpu_events(reader, events_dir):
    """A disk block is no CPU-medium block (and a shared tier publishes its own events)."""
    tap = _tap(reader, f"ipc://{events_dir}/reader.events", seed=300)
    try:
        saved = reader.call(op="stats")["worker"]["saved_blocks"]
        reader.generate(prompts(1, 300, seed=310), max_tokens=2)
        reader.call(op="flush")
        for _ in range(3):
            reader.generate(prompts(1, 40, seed=99), max_tokens=1)
        tap.drain()
        assert reader.call(op="stats")["worker"]["saved_blocks"] - saved >= 4, "control: the blocks were saved"
        assert len(tap.stored("GPU")) >= 2, "control: the GPU pool's events arrive"
        assert not tap.stored("CPU") and not tap.removed("CPU")
    finally:
        tap.close()


def test_the_host_tier_is_published_as_cpu_kv_events_until_it_evicts_or_resets(engine, events_dir):
    """The audit's E1 end to end: vLLM's scheduler publishes the connector's take_events() beside
    its GPU pool's, and a router (its real BlockIndex here) credits the worker's CPU tier from
    them: after vLLM evicts the pages, the host tier's copies stay credited; once the host tier
    evicts them, nothing is; a connector reset removes what the host tier held."""
    from kvtier.router.index import CPU, GPU, BlockIndex, worker_bit

    tap = _tap(engine, f"ipc://{events_dir}/writer.events", seed=200)
    try:
        (target,) = prompts(1, 300, seed=81)          # 4 full blocks of 64 tokens: 8 pages saved
        pages = 4 * BLOCK_TOKENS // PAGE
        engine.generate([target], max_tokens=4)
        engine.call(op="flush")
        def all_stored() -> bool:
            try:
                wanted = set(_page_hashes(tap, target)[:pages])
            except KeyError:
                return False   # the GPU events of the target's pages are not in yet
            return wanted <= {h for e in tap.stored("CPU") for h in e.block_hashes}

        _until(tap, engine, all_stored, "a CPU BlockStored of every saved page")
        hashes = _page_hashes(tap, target)[:pages]     # positive control: the GPU events of the same pages
        for b in range(4):                             # one event per kvtier block, as vLLM's GPU pages say
            (event,) = [e for e in tap.stored("CPU") if hashes[2 * b] in e.block_hashes]
            assert event.block_hashes == hashes[2 * b:2 * b + 2] and event.block_size == PAGE
            assert event.parent_block_hash == (hashes[2 * b - 1] if b else None)
            assert event.token_ids == target[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS]
            assert event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"

        index = BlockIndex(PAGE)
        _apply(index, tap.events)
        keys = index.keys_of(target)[:pages]
        assert index.masks(keys) == [worker_bit(0, GPU) | worker_bit(0, CPU)] * pages
        index.removed(0, hashes, "GPU")                # as when vLLM evicts the pages
        assert index.masks(keys) == [worker_bit(0, CPU)] * pages, "the host tier's copies stay credited"
        seen = len(tap.events)

        # 4 more prompts of 400+ tokens: 25 blocks through the 16-block host tier evict the target's
        evictions = engine.call(op="stats")["worker"]["store"]["tiers"]["host"]["evictions"]
        engine.generate(prompts(4, 400, seed=82), max_tokens=1)
        engine.call(op="flush")
        _until(tap, engine, lambda: set(hashes) <= set(tap.removed("CPU")), "a CPU BlockRemoved of every page")
        assert engine.call(op="stats")["worker"]["store"]["tiers"]["host"]["evictions"] > evictions
        _apply(index, tap.events[seen:])
        assert index.masks(keys) == [], "evicted from the host tier too: not credited"

        # a connector reset (a new key epoch): every block the host tier holds is unreachable
        held = {h for e in tap.stored("CPU") for h in e.block_hashes} - set(tap.removed("CPU"))
        assert held, "control: the last prompts' blocks are in the host tier"
        assert engine.call(op="reset", connector=True)["ok"]
        _until(tap, engine, lambda: held <= set(tap.removed("CPU")), "a CPU BlockRemoved at the reset")
    finally:
        tap.close()


def _apply(index, events) -> None:
    """What ``kvtier route`` does with a worker's events (kvtier/router/events.py)."""
    for e in events:
        kind = type(e).__name__
        if kind == "BlockStored":
            index.stored(0, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium,
                         lora_name=e.lora_name, extra_keys=e.extra_keys)
        elif kind == "BlockRemoved":
            index.removed(0, e.block_hashes, e.medium)
        else:
            index.clear_worker(0)
