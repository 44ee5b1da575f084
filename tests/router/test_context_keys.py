"""The router keys a prompt in its context, as vLLM does: a ``cache_salt`` (a tenant) or a LoRA
adapter roots its own chain, and blocks with content the tokens do not show (multimodal inputs)
are never predicted as hits for other content behind the same placeholder tokens.

Events are encoded the way vLLM publishes them (its own ``BlockStored`` and ``KVEventBatch``
through msgspec, where vLLM is installed; plain msgpack maps otherwise) and fed to
:class:`VllmEvents`, as the router's listener does.
"""

from __future__ import annotations

import struct

import msgpack
import pytest

from kvtier.router.events import VllmEvents
from kvtier.router.index import GPU, BlockIndex, context_seed, worker_bit
from kvtier.router.workers import Worker

BS = 4
TOKENS = list(range(500, 500 + 3 * BS))          # three blocks


def encode(events: list[dict]) -> bytes:
    try:
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
    except ImportError:
        return msgpack.packb([1.0, events, None])
    fields = [{k: v for k, v in e.items() if k != "type"} for e in events]
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=[BlockStored(**f) for f in fields]))


def publish(listener: VllmEvents, *events: dict, payload: bytes | None = None) -> None:
    seq = listener.next_seq or 0        # the sequence number it expects: no gap, no restart
    listener.handle([b"", struct.pack(">Q", seq), payload if payload is not None else encode(list(events))])


def stored(hashes, parent, tokens, *, lora_name=None, extra_keys=None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": lora_name, "extra_keys": extra_keys}


def cached_blocks(index: BlockIndex, worker: int, tokens, seed: int) -> int:
    return sum(1 for m in index.masks(index.keys_of(tokens, seed)) if m & worker_bit(worker, GPU))


def setup(workers: int = 1):
    index = BlockIndex(BS)
    return index, [VllmEvents(Worker(w, f"http://w{w}"), index) for w in range(workers)]


def test_a_salted_prompt_hits_only_in_its_own_salt():
    index, (w0,) = setup()
    # vLLM puts the salt in the first block's extras only; later blocks inherit it through the chain
    publish(w0, stored([1, 2], None, TOKENS[:2 * BS], extra_keys=[("tenant-a",), None]))
    publish(w0, stored([3], 2, TOKENS[2 * BS:]))
    assert cached_blocks(index, 0, TOKENS, context_seed(cache_salt="tenant-a")) == 3   # positive control
    assert cached_blocks(index, 0, TOKENS, context_seed(cache_salt="tenant-b")) == 0
    assert cached_blocks(index, 0, TOKENS, context_seed()) == 0                          # no salt
    # the same tokens unsalted: their own chain, which the salted request does not see
    publish(w0, stored([7, 8, 9], None, TOKENS))
    assert cached_blocks(index, 0, TOKENS, context_seed()) == 3
    assert cached_blocks(index, 0, TOKENS, context_seed(cache_salt="tenant-b")) == 0


def test_a_lora_adapters_blocks_are_its_own():
    index, (w0,) = setup()
    assert not index.is_lora("adapter-a")
    publish(w0, stored([1, 2, 3], None, TOKENS, lora_name="adapter-a",
                       extra_keys=[("adapter-a",), ("adapter-a",), ("adapter-a",)]))
    assert index.is_lora("adapter-a") and not index.is_lora("base-model")
    assert cached_blocks(index, 0, TOKENS, context_seed(lora_name="adapter-a")) == 3
    assert cached_blocks(index, 0, TOKENS, context_seed()) == 0
    assert cached_blocks(index, 0, TOKENS, context_seed(lora_name="adapter-b")) == 0
    # an adapter and a salt together (the salt after the adapter's name in the first block)
    publish(w0, stored([4], None, TOKENS[:BS], lora_name="adapter-a", extra_keys=[("adapter-a", "t")]))
    assert cached_blocks(index, 0, TOKENS[:BS], context_seed("adapter-a", "t")) == 1
    assert cached_blocks(index, 0, TOKENS[:BS], context_seed("t", None)) == 0


def test_multimodal_blocks_never_hit_for_other_content_and_agree_across_workers():
    index, (w0, w1) = setup(2)
    image_a = [["image-sha-a", 0]]
    publish(w0, stored([1, 2, 3], None, TOKENS, extra_keys=[image_a, None, None]))
    # a text request with the same (placeholder) tokens: the router cannot know the image, so no hit
    assert cached_blocks(index, 0, TOKENS, context_seed()) == 0
    # the same image on another worker folds to the same keys: the index sees both holders
    publish(w1, stored([11, 12, 13], None, TOKENS, extra_keys=[image_a, None, None]))
    publish(w1, stored([21, 22, 23], None, TOKENS, extra_keys=[[["image-sha-b", 0]], None, None]))
    assert len(index) == 6      # image a's three keys, held by both workers, and image b's three
    # a plain text chain of those tokens is keyed as the router keys a request: a positive control
    publish(w0, stored([31, 32, 33], None, TOKENS))
    assert cached_blocks(index, 0, TOKENS, context_seed()) == 3


def test_an_orphan_keeps_its_context_until_its_parent_arrives():
    index, (w0,) = setup()
    publish(w0, stored([3], 2, TOKENS[2 * BS:], lora_name="adapter-a", extra_keys=[("adapter-a",)]))
    assert cached_blocks(index, 0, TOKENS, context_seed(lora_name="adapter-a")) == 0
    publish(w0, stored([1, 2], None, TOKENS[:2 * BS], lora_name="adapter-a",
                       extra_keys=[("adapter-a", "s"), ("adapter-a",)]))
    assert cached_blocks(index, 0, TOKENS, context_seed("adapter-a", "s")) == 3


@pytest.mark.parametrize("extra_keys", [[5], "not a list", [["a"], ["b"], ["c"], ["too many"]], [None]])
def test_odd_extra_keys_never_raise(extra_keys):
    index, (w0,) = setup()
    odd = stored([1, 2, 3], None, TOKENS, extra_keys=extra_keys)
    publish(w0, payload=msgpack.packb([1.0, [odd], None]))
    publish(w0, stored([9], None, [1] * BS))          # still applying events afterwards
    assert cached_blocks(index, 0, [1] * BS, context_seed()) == 1 and w0.resyncs == 0
