"""The context of an indexed block when its event does not say it, or when the adapter's weights
changed (audit s34 a9 D1, D2).

D1: vLLM's CPU offloading connector publishes its copies with ``extra_keys`` None. A copy whose GPU
store the router no longer held (a gap without replay, a disconnect, a router started later) was
keyed from the base model's root: a tenant's salted blocks were predicted as hits for unsalted
requests, which the worker then recomputed (vLLM's hashes carry the salt).

D2: vLLM hashes a LoRA adapter's blocks with its name and path; events name it only. An adapter
reloaded with other weights through the router kept the old weights' blocks as its predicted hits.

Audit s34 r8 (regressions of that fix): D1, a base-model deployment (no salt, adapter or
multimodal extras seen) lost every CPU copy of a prefix whose GPU store came before the router
started, and the chunks after the dropped one waited as orphans for the whole TTL; D2, an adapter
unloaded and loaded again from the same path (vLLM still hits its blocks) lost their prediction;
D3, past ``MAX_LORA_NAMES`` an adapter's generation fell back to 0, its old weights' blocks
predicted again.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from kvtier.errors import ConfigError
from kvtier.router import index as index_module
from kvtier.router.config import RouterConfig
from kvtier.router.events import VllmEvents
from kvtier.router.index import CPU, GPU, MAX_LORA_NAMES, BlockIndex, block_keys, context_seed, worker_bit
from kvtier.router.workers import Worker
from tests.router.test_http import BS, one_worker_router, run

TOKENS = list(range(100, 100 + 3 * BS))      # three blocks
SALTED = [["tenant-a"], None, None]          # vLLM's extra_keys of a salted prompt's blocks


def _message(seq, events):
    return [b"", struct.pack(">Q", seq), msgpack.packb([1.0, events, None])]


def _stored(hashes, parent, tokens, medium, extra_keys):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": extra_keys,
            "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


class _Listener:
    """A worker's real event listener over a real index, with what it reported ignored."""

    def __init__(self, **index):
        self.index = BlockIndex(BS, **index)
        self.ignored = []
        self.events = VllmEvents(Worker(0, "http://w0"), self.index,
                                 on_ignored=lambda worker, reason, n: self.ignored.append((reason, n)))
        self.seq = 0

    def send(self, *events, lost=0):
        self.seq += lost
        self.events.handle(_message(self.seq, list(events)))
        self.seq += 1

    def hits(self, tokens=TOKENS, salt=None):
        return self.index.leading_masks(self.index.keys_of(tokens, context_seed(None, salt)))


# -- D1 ----------------------------------------------------------------------------------------------
def test_an_offloaded_copy_whose_gpu_store_was_lost_is_no_hit_for_an_unsalted_request():
    """(r8 D1: the router must have seen a salt for this; until then a copy is the base model's.)"""
    ears = _Listener()
    # the GPU store of tenant A's salted prompt is lost (a gap: the worker is cleared), then its
    # offloaded copy arrives as vLLM's OffloadingConnector sends it
    ears.send(_stored([11, 12, 13], None, TOKENS, "GPU", SALTED))
    ears.send(_stored([11, 12, 13], None, TOKENS, "CPU", None), lost=1)
    assert ears.events.resyncs == 1
    assert ears.hits() == [], "tenant A's salted blocks predicted as an unsalted request's hits"
    assert ears.hits(salt="tenant-a") == []          # (its context unknown: nobody's hits)
    assert ears.ignored == [("context_unknown", 3)]
    assert len(ears.index) == 0
    ears.index.check_integrity()


def test_an_offloaded_copy_of_blocks_the_worker_reported_keeps_their_context():
    """The control: the GPU store seen, the copy is credited to the salted keys, its extension too
    (chained on a known block), and nothing is counted as ignored."""
    ears = _Listener()
    ears.send(_stored([11, 12], None, TOKENS[:2 * BS], "GPU", SALTED[:2]))
    ears.send(_stored([11, 12, 13], None, TOKENS, "CPU", None))
    both = worker_bit(0, GPU) | worker_bit(0, CPU)
    assert ears.hits(salt="tenant-a") == [both, both, worker_bit(0, CPU)]
    assert ears.hits() == [] and ears.ignored == []


def test_an_offloaded_chunk_chained_on_a_known_block_is_indexed_and_on_an_unknown_one_waits():
    ears = _Listener()
    ears.send(_stored([11], None, TOKENS[:BS], "GPU", SALTED[:1]))
    ears.send(_stored([13], 12, TOKENS[2 * BS:], "CPU", None))        # parent 12 not yet reported: waits
    assert ears.hits(salt="tenant-a") == [worker_bit(0, GPU)]
    ears.send(_stored([12], 11, TOKENS[BS:2 * BS], "GPU", [None]))     # the parent: the chunk follows
    assert ears.hits(salt="tenant-a") == [worker_bit(0, GPU)] * 2 + [worker_bit(0, CPU)]
    assert ears.hits() == [] and ears.ignored == []


def test_an_offloaded_chain_is_indexed_from_its_first_block_the_worker_reported():
    """Its first block evicted and forgotten, the second still reported: the blocks from the
    second on keep their (salted) keys; the first is left out."""
    index = BlockIndex(BS)
    index.stored(0, [11, 12, 13], None, TOKENS, BS, "GPU", extra_keys=SALTED)
    index.stored(0, [91], None, [7] * BS, BS, "GPU", extra_keys=[None])
    index.removed(0, [11], "GPU")
    index.stored(0, [11, 12, 13], None, TOKENS, BS, "CPU", context_known=False)
    salted = index.keys_of(TOKENS, context_seed(None, "tenant-a"))
    assert index.mask(salted[0]) == 0
    assert [index.mask(k) for k in salted[1:]] == [worker_bit(0, GPU) | worker_bit(0, CPU)] * 2
    assert index.unkeyed_blocks == 1
    assert index.leading_masks(index.keys_of(TOKENS)) == []
    index.check_integrity()


def test_the_kvtier_connectors_cpu_events_say_their_context_and_are_indexed_after_a_gap():
    """kvtier's connector sends each CPU copy with vLLM's extra_keys (a list, the salt on the
    first block): its stores are indexed under their context, GPU store seen or not."""
    ears = _Listener()
    ears.send()
    ears.send(_stored([11, 12, 13], None, TOKENS, "CPU", SALTED), lost=1)
    assert ears.hits(salt="tenant-a") == [worker_bit(0, CPU)] * 3
    ears.send(_stored([21, 22], None, TOKENS[:2 * BS], "CPU", [None, None]))   # an unsalted prompt's
    assert ears.hits() == [worker_bit(0, CPU)] * 2
    assert ears.ignored == []


def test_a_gpu_store_without_extra_keys_is_still_keyed_as_the_base_models():
    """The control: only a CPU copy is taken as context-unknown (an older vLLM's GPU events have
    no extra_keys field at all)."""
    ears = _Listener()
    ears.send(_stored([11, 12, 13], None, TOKENS, "GPU", None))
    assert ears.hits() == [worker_bit(0, GPU)] * 3 and ears.ignored == []


# -- D2 ----------------------------------------------------------------------------------------------
PROMPT = " ".join(["abc"] * 40)               # WordTokenizer: 40 tokens of 3, 10 blocks


async def _predicted(s, url, model="A"):
    async with s.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT}) as r:
        assert r.status == 200
        return int(r.headers["X-Kvtier-Predicted-Cached"])


async def _lora(s, url, path, **body):
    async with s.post(url + path, json=body) as r:
        return r.status


def _adapter_router():
    return one_worker_router(policy="tier-aware", models_refresh_s=0.2)


async def _with_adapter_a(w, router):
    w.loras = ["A"]
    for _ in range(50):
        if router.index.is_lora("A"):
            break
        await asyncio.sleep(0.1)
    # adapter A's 10 blocks of the prompt, as its vLLM events say
    router.index.stored(0, list(range(10)), None, [3] * 40, BS, "GPU", lora_name="A", extra_keys=[["A"]] * 10)


def test_an_adapter_reloaded_in_place_through_the_router_loses_its_old_weights_hits():
    async def main():
        async with _adapter_router() as (w, router, url, s):
            await _with_adapter_a(w, router)
            assert await _predicted(s, url) == 39                     # control
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A-v2",
                               load_inplace=True) == 200
            assert await _predicted(s, url) == 0
            # the new weights' blocks, as the worker then publishes them, are hits again
            router.index.stored(0, list(range(100, 110)), None, [3] * 40, BS, "GPU", lora_name="A",
                                extra_keys=[["A"]] * 10)
            assert await _predicted(s, url) == 39
    run(main())


def test_an_adapter_unloaded_then_loaded_from_another_path_loses_its_old_hits():
    async def main():
        async with _adapter_router() as (w, router, url, s):
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A-v1") == 200
            await _with_adapter_a(w, router)
            assert await _predicted(s, url) == 39
            assert await _lora(s, url, "/v1/unload_lora_adapter", lora_name="A") == 200
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A-v2") == 200
            assert await _predicted(s, url) == 0
            assert router.index.lora_generation("A") == 1      # the other path (r8 D2: not the unload)
    run(main())


def test_a_refused_reload_and_another_adapters_load_keep_the_adapters_hits():
    """The controls: a reload every worker refused changed no weights; loading adapter B (or A's
    first load, whose path the router had not seen) says nothing about A's."""
    async def main():
        async with _adapter_router() as (w, router, url, s):
            await _with_adapter_a(w, router)
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="B", lora_path="/loras/B") == 200
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A-v1") == 200
            assert await _predicted(s, url) == 39
            w.refuse_lora = "The lora adapter 'A' has already been loaded."
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A-v2",
                               load_inplace=True) == 400
            assert await _predicted(s, url) == 39
    run(main())


def test_an_adapters_generation_moves_on_only_where_its_weights_may_differ():
    """(r8 D2: an unload and a load in place from the same path no longer move it.)"""
    index = BlockIndex(BS)
    index.lora_updated({"lora_name": "A", "lora_path": "/a1"}, unloaded=False)     # first load seen
    assert index.lora_generation("A") == 0
    index.lora_updated({"lora_name": "A", "lora_path": "/a1"}, unloaded=False)     # the same weights
    assert index.lora_generation("A") == 0
    index.lora_updated({"lora_name": "A", "lora_path": "/a2"}, unloaded=False)     # another path
    assert index.lora_generation("A") == 1
    index.lora_updated({"lora_name": "A", "lora_path": "/a2", "load_inplace": "true"}, unloaded=False)
    assert index.lora_generation("A") == 1                                           # the same path
    index.lora_updated({"lora_name": "A"}, unloaded=True)
    assert index.lora_generation("A") == 1
    index.lora_updated({"lora_name": "A", "lora_path": "/a3", "load_inplace": "true"}, unloaded=False)
    assert index.lora_generation("A") == 2                                           # (pydantic's lax bool)
    for odd in ({"lora_name": ["A"]}, {"lora_name": None}, ["A"], None):
        index.lora_updated(odd, unloaded=True)                                       # vLLM refuses these
    assert index.lora_generation("A") == 2 and index.lora_generation(None) == 0
    # events are keyed under the generation: A's new blocks are not the old ones' keys
    index.stored(0, [1], None, TOKENS[:BS], BS, "GPU", lora_name="A", extra_keys=[["A"]])
    assert index.mask(block_keys(TOKENS[:BS], BS, context_seed("A", None, 2))[0]) == worker_bit(0, GPU)
    assert index.mask(block_keys(TOKENS[:BS], BS, context_seed("A"))[0]) == 0
    assert context_seed("A", None, 0) == context_seed("A") != context_seed("A", None, 2)


# -- r8 D1 -------------------------------------------------------------------------------------------
CHUNK, CHUNKS = 4, 8
HOT = list(range(1000, 1000 + BS * CHUNK * CHUNKS))       # a hot system prompt: 32 blocks
HOT_HASHES = [10_000 + i for i in range(CHUNK * CHUNKS)]


def _offloaded_chunks(order=range(CHUNKS)):
    """The hot prompt's CPU copy as vLLM's OffloadingConnector publishes it: a chunk an event,
    extra_keys None, chunk i chained on chunk i-1's last block."""
    return [_stored(HOT_HASHES[c * CHUNK:(c + 1) * CHUNK], HOT_HASHES[c * CHUNK - 1] if c else None,
                    HOT[c * CHUNK * BS:(c + 1) * CHUNK * BS], "CPU", None) for c in order]


def test_a_base_model_deployments_copy_offloaded_after_a_router_restart_is_predicted():
    """The prompt's GPU store came before the router started (a GPU hit publishes nothing); its
    CPU copy, evicted, is offloaded again from its first chunk."""
    ears = _Listener()
    ears.send()
    ears.send(*_offloaded_chunks())
    assert ears.hits(HOT) == [worker_bit(0, CPU)] * len(HOT_HASHES)
    assert ears.ignored == [] and not ears.index.keyed_context_seen
    ears.index.check_integrity()


@pytest.mark.parametrize("order", [range(CHUNKS), range(CHUNKS - 1, -1, -1)], ids=["in_order", "reversed"])
def test_once_a_tenant_was_seen_an_unknown_context_copy_and_the_chunks_chained_on_it_are_dropped_at_once(order):
    ears = _Listener()
    ears.send(_stored([91], None, [7] * BS, "GPU", [["tenant-a"]]))        # a salted prompt's store
    ears.send(*_offloaded_chunks(order))
    assert ears.hits(HOT) == []
    assert ears.index._sources[0].orphan_count == 0, "chunks wait for a parent that never comes"
    assert ears.index.dropped_orphans == 0
    assert sum(n for reason, n in ears.ignored if reason == "context_unknown") == len(HOT_HASHES)
    ears.index.check_integrity()
    # the control: its first chunk stored again with its context, the next chunk's copy follows it
    ears.send(_stored(HOT_HASHES[:CHUNK], None, HOT[:CHUNK * BS], "GPU", [None] * CHUNK))
    ears.send(*_offloaded_chunks([1]))
    assert ears.hits(HOT) == [worker_bit(0, GPU)] * CHUNK + [worker_bit(0, CPU)] * CHUNK


@pytest.mark.parametrize("mode, before, after", [("auto", True, False), ("base", True, True), ("drop", False, False)])
def test_unkeyed_cpu_events_key_a_copy_of_unknown_context_as_the_base_models_or_drop_it(mode, before, after):
    index = BlockIndex(BS, unkeyed_cpu_events=mode)

    def copy_predicted(h, tokens):
        index.stored(0, [h], None, tokens, BS, "CPU", context_known=False)
        return bool(index.leading_masks(index.keys_of(tokens)))

    assert copy_predicted(1, TOKENS[:BS]) is before
    index.add_lora_names(["A"])                       # a worker lists an adapter
    assert copy_predicted(2, TOKENS[BS:2 * BS]) is after
    with pytest.raises(ValueError):
        BlockIndex(BS, unkeyed_cpu_events="yes")


def test_a_salted_request_ends_the_base_model_keying_of_copies_of_unknown_context():
    async def main():
        async with one_worker_router() as (w, router, url, s):
            index = router.index
            index.stored(0, [1], None, TOKENS[:BS], BS, "CPU", context_known=False)
            assert index.leading_masks(index.keys_of(TOKENS[:BS])) == [worker_bit(0, CPU)]
            async with s.post(url + "/v1/completions", json={"prompt": PROMPT, "cache_salt": "tenant-a",
                                                              "prompt_logprobs": 1}) as r:
                assert r.status == 200
            assert index.keyed_context_seen        # (a salted request that reads no cached block too)
            index.stored(0, [2], None, TOKENS[BS:2 * BS], BS, "CPU", context_known=False)
            assert index.leading_masks(index.keys_of(TOKENS[BS:2 * BS])) == [] and index.unkeyed_blocks == 1
    run(main())


# -- r8 D2 -------------------------------------------------------------------------------------------
def test_an_adapter_unloaded_and_loaded_again_from_the_same_path_keeps_its_hits():
    """vLLM hashes the adapter's blocks with (name, path) and keeps them across the unload: hits."""
    async def main():
        async with _adapter_router() as (w, router, url, s):
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A") == 200
            await _with_adapter_a(w, router)
            assert await _predicted(s, url) == 39
            assert await _lora(s, url, "/v1/unload_lora_adapter", lora_name="A") == 200
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A") == 200
            assert await _predicted(s, url) == 39
            # in place from the same path: vLLM's hashes do not change even if the files did
            assert await _lora(s, url, "/v1/load_lora_adapter", lora_name="A", lora_path="/loras/A",
                               load_inplace=True) == 200
            assert await _predicted(s, url) == 39
            assert router.index.lora_generation("A") == 0
    run(main())


def test_an_adapter_whose_last_path_the_router_does_not_know_moves_on_at_its_next_load():
    """Conservative where the path is unknown: unloaded before the router saw a load of it, or
    loaded in place over a load it never saw (each from one counter: no value twice)."""
    index = BlockIndex(BS)
    index.lora_updated({"lora_name": "A"}, unloaded=True)
    index.lora_updated({"lora_name": "A", "lora_path": "/a"}, unloaded=False)
    index.lora_updated({"lora_name": "B", "lora_path": "/b", "load_inplace": True}, unloaded=False)
    assert (index.lora_generation("A"), index.lora_generation("B")) == (1, 2)


# -- r8 D3 -------------------------------------------------------------------------------------------
def test_an_adapter_forgotten_past_max_lora_names_never_has_its_old_weights_blocks_predicted():
    index = BlockIndex(BS)
    first, second = TOKENS[:BS], TOKENS[BS:2 * BS]

    def predicted(name, tokens):
        return len(index.leading_masks(index.keys_of(tokens, context_seed(name, None, index.lora_generation(name)))))

    index.lora_updated({"lora_name": "A", "lora_path": "/a/v1"}, unloaded=False)
    index.lora_updated({"lora_name": "B", "lora_path": "/b"}, unloaded=False)      # never reloaded
    index.stored(0, [1], None, first, BS, "GPU", lora_name="A", extra_keys=[["A"]])      # v1's block
    index.stored(0, [3], None, first, BS, "GPU", lora_name="B", extra_keys=[["B"]])
    index.lora_updated({"lora_name": "A", "lora_path": "/a/v2"}, unloaded=False)
    index.stored(0, [2], None, second, BS, "GPU", lora_name="A", extra_keys=[["A"]])     # v2's block
    assert (predicted("A", first), predicted("A", second), predicted("B", first)) == (0, 1, 1)
    for i in range(MAX_LORA_NAMES):
        index.lora_updated({"lora_name": f"t{i}"}, unloaded=True)                 # other adapters swapped out
    assert predicted("A", first) == 0, "A's old weights' block predicted as its hit again"
    assert "A" not in index._adapters and "B" not in index._adapters            # (both forgotten)
    assert (predicted("A", second), predicted("B", first)) == (1, 1)      # their own generations kept
    # A's path is unknown now: loaded again (even from /a/v2), it moves to a generation never drawn
    index.lora_updated({"lora_name": "A", "lora_path": "/a/v2"}, unloaded=False)
    assert index.lora_generation("A") == 2 and (predicted("A", first), predicted("A", second)) == (0, 0)
    assert index_module._forgotten_bucket("A") != index_module._forgotten_bucket("B")   # (what B's 1 rests on)


def test_unkeyed_cpu_events_is_a_router_setting_checked_by_name(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text('unkeyed_cpu_events = "drop"\n[[worker]]\nurl = "http://127.0.0.1:9"\n')
    c = RouterConfig.from_file(str(p))
    assert c.unkeyed_cpu_events == "drop"
    for bad in ("never", 5):
        p.write_text(f'unkeyed_cpu_events = {bad!r}\n[[worker]]\nurl = "http://127.0.0.1:9"\n'.replace("'", '"'))
        with pytest.raises(ConfigError, match="unkeyed_cpu_events"):
            RouterConfig.from_file(str(p)).check()
