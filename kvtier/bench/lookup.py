"""``kvtier bench lookup``: time to key a long prompt and find its cached prefix.

This is on the critical path of every request (before the engine can decide
what to prefill), so it must stay far below prefill time: the target is ≤ 2 ms
for a 128 k-token prompt on a warm store holding all of it.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from kvtier.core.keys import block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.store.tiered import TieredStore
from kvtier.tiers.host import HostTier


def run(tokens: int, block_tokens: int, runs: int) -> dict:
    # A small per-block payload keeps the store cheap; lookup cost does not depend on it.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=block_tokens)
    ns = Namespace("bench/lookup", layout, weights_revision="r0", tenant="bench")
    prompt = np.random.default_rng(0).integers(0, 128_000, tokens, dtype=np.int64)
    keys = block_keys(ns, prompt)
    store = TieredStore([HostTier(max(1, len(keys)) * layout.block_nbytes, layout.block_nbytes)])
    blank = np.zeros(layout.block_nbytes, np.uint8)
    store.put(keys, [blank] * len(keys))
    as_list = prompt.tolist()

    total, keying, finding, from_list = [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ks = block_keys(ns, prompt)
        t1 = time.perf_counter()
        match = store.lookup(ks)
        t2 = time.perf_counter()
        block_keys(ns, as_list)
        t3 = time.perf_counter()
        assert match.hit_blocks == len(keys), "the warm store must hold the whole prompt"
        keying.append(t1 - t0)
        finding.append(t2 - t1)
        total.append(t2 - t0)
        from_list.append(t3 - t2)
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
        "hit_blocks": len(keys),
    }


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
        print(json.dumps(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lookup of a {args.tokens}-token prompt (median of {args.runs})")
        table.add_column("step")
        table.add_column("ms", justify="right")
        for name in ("keys_ms", "prefix_lookup_ms", "lookup_ms", "keys_from_python_list_ms"):
            table.add_row(name, f"{result[name]:.3f}")
        Console().print(table)
    return 0
