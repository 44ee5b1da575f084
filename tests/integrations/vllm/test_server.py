"""Real vLLM engines sharing a kvtier server: a fresh engine reuses what another stored,
prefill/decode disaggregation, a block tampered on the server's spill disk mid-chain, and a
server that dies mid-run."""

from __future__ import annotations

import time

import pytest

from kvtier.cli.admin import admin_call
from tests.integrations.vllm.harness import (assert_loads_what_another_computed, expected_hit, loaded_tokens,
                                             prompts, skip_without_vllm)

skip_without_vllm()

pytestmark = pytest.mark.timeout(480)

TOKEN = "vllm-test-token"
ADMIN = "vllm-test-admin"
BLOCK_TOKENS = 64
BLOCK_BYTES = 64 << 10  # the tiny model: 2 layers x 2 (K, V) x 2 heads x 64 tokens x 32 dims x fp32
#: the second server's DRAM pool: 16 blocks, so a few prompts push a chain out to its spill disk
SPILL_POOL = {"capacity": 16 * BLOCK_BYTES, "max_block": BLOCK_BYTES, "disk_capacity": "64MiB"}


def remote_extra(url: str) -> dict:
    # host_bytes 0: every lookup, load and save goes to the server.
    return {"block_tokens": BLOCK_TOKENS, "host_bytes": 0, "remote_url": url, "remote_token": TOKEN}


def hit(length: int) -> int:
    return expected_hit(length, BLOCK_TOKENS)


@pytest.fixture(scope="module")
def spill_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-spill")


@pytest.fixture(scope="module")
def servers(spill_dir):
    from kvtier.server.launch import ServerProcess

    shared = ServerProcess.start({"acme": TOKEN})
    # A small pool that spills to disk_dir; killed by the last test of this module.
    doomed = ServerProcess.start({"acme": TOKEN}, admin_token=ADMIN,
                                 server={**SPILL_POOL, "disk_dir": str(spill_dir)})
    yield shared, doomed
    shared.stop()
    doomed.stop()


@pytest.fixture(scope="module")
def cluster(engines, tiny_model, servers):
    """A prefill-only instance, a decode-only instance (both on one server), and an engine on a second server."""
    shared, doomed = servers
    producer = engines("producer", {"model": tiny_model, "extra": remote_extra(shared.url), "role": "kv_producer"})
    consumer = engines("consumer", {"model": tiny_model, "extra": remote_extra(shared.url), "role": "kv_consumer"})
    survivor = engines("survivor", {"model": tiny_model, "extra": remote_extra(doomed.url)})
    for engine in (producer, consumer, survivor):
        engine.wait_ready()
    return producer, consumer, survivor


def test_fresh_engine_process_loads_what_another_stored_through_the_server(cluster):
    producer, consumer, _ = cluster
    assert_loads_what_another_computed(producer, consumer, BLOCK_TOKENS, seed=11)


def test_small_loads_from_the_server_beside_other_requests_land_before_their_forward(cluster):
    """Requests batched together, whose blocks only the server holds (``host_bytes`` 0): each
    finds others in the engine, and its load (a few hundred KiB: one call with its deadline)
    runs in the step of its forward (``sync_load_max_bytes``). A load run between steps kept
    its request out of the batch until the next step: a whole engine step added to its TTFT.
    Pages are poisoned first: a load landing after the forward shows."""
    producer, consumer, _ = cluster
    batch = prompts(3, 300, seed=31)
    cold = producer.generate(batch, max_tokens=8, sequential=False)
    assert all(loaded_tokens(o) == 0 for o in cold)
    producer.call(op="flush")
    before = consumer.call(op="stats")["worker"]
    warm = consumer.generate(batch, max_tokens=8, sequential=False)
    after = consumer.call(op="stats")["worker"]
    for prompt, a, b in zip(batch, cold, warm):
        assert loaded_tokens(b) == hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"]
    assert after["load_jobs"] - before["load_jobs"] == len(batch)
    assert after["async_load_jobs"] == before["async_load_jobs"], "a server's small load waited a step"
    assert after["failed_pages"] == before["failed_pages"]


def test_prefill_decode_disaggregation_matches_a_single_instance(cluster):
    producer, consumer, _ = cluster
    batch = prompts(2, 420, seed=12)
    # Prefill instance: computes the prompt and one token; announces the blocks it stores.
    prefilled = producer.generate(batch, max_tokens=1)
    handoff = [o["kv_transfer_params"] for o in prefilled]
    assert all(p["kvtier_blocks"] == len(q) // BLOCK_TOKENS for p, q in zip(handoff, batch))
    # Decode instance: no flush in between; it waits for the announced blocks, loads, continues.
    decoded = consumer.generate(batch, max_tokens=16, kv_transfer_params=handoff)
    # A single instance from scratch (the producer never loads; its own prefix cache is reset).
    producer.call(op="reset")
    single = producer.generate(batch, max_tokens=16)
    for prompt, d, s in zip(batch, decoded, single):
        assert loaded_tokens(d) == hit(len(prompt)) > 0
        assert loaded_tokens(s) == 0
        assert d["token_ids"] == s["token_ids"] and d["logprobs"] == s["logprobs"]


def server_stats(server) -> dict:
    return admin_call(server.url, ADMIN, "stats", {})


def spilled_files(server, spill_dir, timeout_s: float = 30.0) -> set:
    """The server's block files, once its write-behind has copied every block it indexes to disk."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = set(spill_dir.rglob("*.kvb"))
        if len(files) == server_stats(server)["blocks"]:
            return files
        assert time.monotonic() < deadline, "the server's write-behind never caught up with its index"
        time.sleep(0.1)


def test_a_block_tampered_on_the_servers_disk_mid_chain_stops_the_load_there(cluster, servers, spill_dir):
    _, _, survivor = cluster  # host_bytes 0: every block it loads comes from the server
    _, server = servers
    n, k = 6, 3
    base, control = (prompts(1, n * BLOCK_TOKENS + 20, seed=s)[0] for s in (15, 16))  # 404 tokens: 6 full blocks
    reference = survivor.generate([base], max_tokens=8, cache_salt="reference")[0]  # another salt: recomputed
    control_cold = survivor.generate([control], max_tokens=8)[0]
    assert loaded_tokens(reference) == loaded_tokens(control_cold) == 0
    # Find block k's file on the server: store blocks 0..k-1, then block k alone, then the rest.
    survivor.call(op="flush")
    files = [spilled_files(server, spill_dir)]
    for end in (k, k + 1, n):
        survivor.generate([base[: end * BLOCK_TOKENS + 20]], max_tokens=1)
        survivor.call(op="flush")
        files.append(spilled_files(server, spill_dir))
    assert [len(b - a) for a, b in zip(files, files[1:])] == [k, 1, n - k - 1]
    (block_k,) = files[2] - files[1]
    # Push both chains out of the server's 16-block pool: only its disk holds them now.
    evictions = server_stats(server)["store"]["tiers"]["host"]["evictions"]
    survivor.generate(prompts(6, 520, seed=17), max_tokens=1)  # 57 blocks
    survivor.call(op="flush")
    assert server_stats(server)["store"]["tiers"]["host"]["evictions"] - evictions >= 57 - 16
    with open(block_k, "r+b") as f:  # a byte of the payload (after the 4 KiB header page)
        f.seek(4096 + BLOCK_BYTES // 2)
        byte = f.read(1)
        f.seek(4096 + BLOCK_BYTES // 2)
        f.write(bytes([byte[0] ^ 0x5A]))

    def load(prompt):
        survivor.call(op="reset")
        worker, disk = survivor.call(op="stats")["worker"], server_stats(server)["store"]["tiers"]["disk"]
        out = survivor.generate([prompt], max_tokens=8)[0]
        worker2, disk2 = survivor.call(op="stats")["worker"], server_stats(server)["store"]["tiers"]["disk"]
        delta = {name: worker2[name] - worker[name] for name in ("loaded_blocks", "failed_pages")}
        delta.update({f"disk_{name}": disk2[name] - disk[name] for name in ("hits", "verify_failures")})
        return out, delta

    # Positive control: the untampered chain, pushed out the same way, loads whole from the server's disk.
    warm, delta = load(control)
    assert loaded_tokens(warm) == n * BLOCK_TOKENS
    assert delta == {"loaded_blocks": n, "failed_pages": 0, "disk_hits": n, "disk_verify_failures": 0}
    assert warm["token_ids"] == control_cold["token_ids"] and warm["logprobs"] == control_cold["logprobs"]

    out, delta = load(base)
    # The server reads blocks 0..k-1 from disk, finds block k corrupt and answers a miss: the load
    # stops at block k and vLLM recomputes blocks k..n-1 (two pages each).
    # The store asks each tier for the whole run at once (TieredStore.get → get_many), so the
    # server may also read the blocks after k; nothing past the miss is used.
    assert k <= delta.pop("disk_hits") <= n - 1
    assert delta == {"loaded_blocks": k, "failed_pages": (n - k) * 2, "disk_verify_failures": 1}
    assert out["token_ids"] == reference["token_ids"]
    assert out["logprobs"] == reference["logprobs"], "top-5 logprobs equal a recompute without kvtier"
    # The server dropped the tampered copy, and blocks k..n-1, recomputed, were saved again
    # (before, the save cursor had passed them at the lookup: the chain stayed broken at k):
    # the next load reads the whole chain, and it is right.
    survivor.call(op="flush")
    again, delta = load(base)
    assert delta["loaded_blocks"] == n and delta["failed_pages"] == 0, delta
    assert again["token_ids"] == reference["token_ids"]
    assert again["logprobs"] == reference["logprobs"]


def test_requests_complete_when_the_server_is_killed_mid_run(cluster, servers):
    _, _, survivor = cluster
    _, doomed = servers
    batch = prompts(3, 380, seed=13)
    reference = survivor.generate(batch, max_tokens=24)
    survivor.call(op="flush")
    survivor.call(op="reset")
    failed_before = survivor.call(op="stats")["worker"]["failed_pages"]
    # The server dies inside the first request: after its lookup hit, as its load starts.
    survivor.call(op="kill_on_next_load", pid=doomed.proc.pid)
    fresh = prompts(2, 300, seed=14)
    start = time.monotonic()
    during = survivor.generate(batch + fresh, max_tokens=24)
    assert time.monotonic() - start < 120, "a dead server must cost a bounded timeout, not hang"
    assert doomed.proc.wait(timeout=10) == -9
    assert len(during) == 5 and all(len(o["token_ids"]) == 24 for o in during)
    assert all(loaded_tokens(o) == 0 for o in during), "the first load failed, later lookups miss"
    stats = survivor.call(op="stats")
    assert stats["worker"]["failed_pages"] - failed_before == hit(len(batch[0])) // 32
    assert stats["scheduler"]["lookup_errors"] == 0, "the remote tier reports a dead server as a miss"
    for ref, got in zip(reference, during):
        assert got["token_ids"] == ref["token_ids"] and got["logprobs"] == ref["logprobs"]
