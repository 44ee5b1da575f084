"""``kvtier bench lookup``: time to key a long prompt and find its cached prefix.

This is on the critical path of every request (before the engine can decide
what to prefill), so it must stay far below prefill time: the targets are ≤ 2 ms
for a 128 k-token prompt on a warm store holding all of it in 256-token blocks,
≤ 5 ms in 16-token blocks (8192 blocks: what the transformers integration uses).

Two keyings are timed, each followed by the same prefix lookup:

* over token ids (``block_keys``: the transformers integration, ``ContextCache``);
* over vLLM's block hashes, the way the connector's scheduler side does it
  (``EngineKV.block_hashes`` picks the hash of each kvtier block's last vLLM page,
  ``EngineKV.keys`` chains them under the namespace root). vLLM computes its own
  hashes before asking: that cost is vLLM's, so the bench makes them up front
  (32-byte SHA-256 digests, 16-token pages, as ``prefix_caching_hash_algo=sha256``).
"""

from __future__ import annotations

import hashlib
import statistics
import time

import numpy as np

from kvtier.bench.storage import refuse_beyond_memory
from kvtier.core.keys import _c_chain, block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import EngineKV  # plain values: no vLLM import
from kvtier.json_files import strict_json
from kvtier.store.tiered import TieredStore
from kvtier.tiers.host import HostTier


def run(tokens: int, block_tokens: int, runs: int) -> dict:
    if tokens < block_tokens or block_tokens <= 0 or runs <= 0:
        raise ConfigError(f"need --block-tokens > 0, --tokens >= --block-tokens (a whole block to look up) and "
                          f"--runs > 0; got {tokens}, {block_tokens}, {runs}")
    # A small per-block payload keeps the store cheap; lookup cost does not depend on it.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=block_tokens)
    # what it holds at once, at least: the prompt as int64 and as a list (8-byte pointers alone), the store
    refuse_beyond_memory(f"--tokens {tokens}", 16 * tokens + 2 * (tokens // block_tokens) * layout.block_nbytes)
    ns = Namespace("bench/lookup", layout, weights_revision="r0", tenant="bench")
    prompt = np.random.default_rng(0).integers(0, 128_000, tokens, dtype=np.int64)
    keys = block_keys(ns, prompt)
    # room for both chains (token keys and vLLM-hash keys) of the whole prompt
    store = TieredStore([HostTier(2 * max(1, len(keys)) * layout.block_nbytes, layout.block_nbytes)])
    blank = np.zeros(layout.block_nbytes, np.uint8)
    store.put(keys, [blank] * len(keys))
    as_list = prompt.tolist()
    page = min(VLLM_PAGE_TOKENS, block_tokens)
    engine = EngineKV(ns, page_tokens=page, hash_tokens=page, num_layers=1, format_tag="bench/lookup")
    vllm_hashes = _vllm_like_hashes(tokens // page)
    vllm_keys = engine.keys(engine.block_hashes(vllm_hashes, tokens))
    store.put(vllm_keys, [blank] * len(vllm_keys))

    total, keying, finding, from_list, vllm_total, vllm_keying = [], [], [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ks = block_keys(ns, prompt)
        t1 = time.perf_counter()
        match = store.lookup(ks)
        t2 = time.perf_counter()
        block_keys(ns, as_list)
        t3 = time.perf_counter()
        vks = engine.keys(engine.block_hashes(vllm_hashes, tokens))
        t4 = time.perf_counter()
        vmatch = store.lookup(vks)
        t5 = time.perf_counter()
        assert match.hit_blocks == len(keys), "the warm store must hold the whole prompt"
        assert vmatch.hit_blocks == len(vllm_keys), "the warm store must hold the whole prompt (vLLM keys)"
        keying.append(t1 - t0)
        finding.append(t2 - t1)
        total.append(t2 - t0)
        from_list.append(t3 - t2)
        vllm_keying.append(t4 - t3)
        vllm_total.append(t5 - t3)
    store.close()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    return {
        "tokens": tokens,
        "blocks": len(keys),
        "block_tokens": block_tokens,
        "runs": runs,
        "lookup_ms": ms(total),
        "keys_ms": ms(keying),
        "prefix_lookup_ms": ms(finding),
        "keys_from_python_list_ms": ms(from_list),
        "vllm_lookup_ms": ms(vllm_total),
        "vllm_keys_ms": ms(vllm_keying),
        "vllm_page_tokens": page,
        "hit_blocks": len(keys),
        "c_keying": _c_chain is not None,
    }


#: vLLM's default KV page (block) size on CPU and GPU
VLLM_PAGE_TOKENS = 16


def _vllm_like_hashes(pages: int) -> list[bytes]:
    """One 32-byte digest per vLLM page, chained like vLLM's (their values do not matter here)."""
    prev, out = b"", []
    for i in range(pages):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        out.append(prev)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("lookup", help="key a long prompt and look up its cached prefix")
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _main(args) -> int:
    result = run(args.tokens, args.block_tokens, args.runs)
    if args.json:
        print(strict_json(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lookup of a {args.tokens}-token prompt (median of {args.runs})")
        table.add_column("step")
        table.add_column("ms", justify="right")
        for name in ("keys_ms", "prefix_lookup_ms", "lookup_ms", "keys_from_python_list_ms",
                     "vllm_keys_ms", "vllm_lookup_ms"):
            table.add_row(name, f"{result[name]:.3f}")
        Console().print(table)
    return 0
