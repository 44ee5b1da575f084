"""Real vLLM with the kvtier connector and an embedded store (host DRAM + disk).

The writer engine's host tier holds 16 blocks, so its blocks really reach the
disk tier (evicted, or copied by write-behind); a second engine process on the
same directory, with no host tier, then loads them from disk. Every load writes
into pages poisoned with NaN first (``KVTIER_DEBUG_POISON``, set by the suite),
so a load that writes nothing fails its comparison.
"""

from __future__ import annotations

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
def engine(engines, tiny_model, disk_dir):
    extra = {
        "block_tokens": BLOCK_TOKENS,
        "host_bytes": HOST_BLOCKS * BLOCK_BYTES,
        "disk_path": str(disk_dir),
        "disk_bytes": "256MiB",
    }
    engine = engines("embedded", {"model": tiny_model, "extra": extra})
    engine.wait_ready()
    return engine


@pytest.fixture(scope="module")
def reader(engines, tiny_model, disk_dir):
    """A second engine process on the writer's disk directory, without a host tier: every
    block it loads comes from disk, every block it saves goes straight there. Started
    once, by the first test that needs it."""
    extra = {"block_tokens": BLOCK_TOKENS, "host_bytes": 0, "disk_path": str(disk_dir), "disk_bytes": "256MiB"}
    reader = engines("reader", {"model": tiny_model, "extra": extra})
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


# Last in the module on purpose: it moves the writer's key epoch, and the tests above read its
# blocks from another engine process (the reader keys as before any reset).
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
