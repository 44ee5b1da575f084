"""``kvtier bench route``: the router's decision time, and (``--trace``) the router in front of real workers.

``--synthetic``: a real :class:`~kvtier.router.app.Router` (no sockets) whose index is
filled with ``--indexed-blocks`` blocks (default 1 M) spread over ``--workers`` workers
(default 16) in GPU and CPU media and the shared tier, the way KV events fill it; then
``Router.decide`` is timed on a ``--tokens``-token prompt (default 32 k) whose every
block is indexed somewhere (the worst case: each worker's price covers all of its
blocks), with a different load on the workers each time. A decision is what the router
does per request before it can forward it, as its ``kvtier_router_decision_seconds``
histogram times it: key the prompt's blocks, look them up, build the tier matrix, price
every worker, pick. The index is sized to hold the fill (:func:`index_capacity_for`: the
router's default capacity at least); a fill this machine's memory cannot hold is refused
up front. Target: p99 ≤ 1 ms. Recording the choice in the approximate tree
follows the decision (bookkeeping for the fallback mode); ``decide_call_*`` include it.

``--trace FILE``: a window of a Mooncake trace through ``kvtier route`` and two real vLLM
workers, once per policy over the kvtier deployment and once round-robin over workers
without kvtier (the baseline); see :mod:`kvtier.bench.route_trace`.
:mod:`kvtier.bench.route_stack` starts the processes (the real-vLLM router tests use it too).
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import time

import numpy as np

from kvtier.bench import route_trace
from kvtier.errors import ConfigError
from kvtier.json_files import strict_json

#: kvtier route's defaults for the workers' vLLM block size
BLOCK_TOKENS = 32
#: the filled index's memory per key (its masks, the workers' hash maps, the fill's own
#: hashes): ~1.3 GB RSS for 4 Mi keys, measured
INDEX_BYTES_PER_KEY = 320


def index_capacity_for(indexed_blocks: int, prompt_blocks: int, workers: int) -> int:
    """The router index's capacity for a fill of ``indexed_blocks`` (see :func:`fill_index`).

    The index evicts its oldest keys past ``capacity`` keys or workers' hashes, and the prompt's
    blocks are the oldest: a fill that reached the capacity evicted them, and the worst case
    timed (every prompt block indexed) was no longer the one measured. So: the router's default
    at least, and twice what the fill holds (keys, plus each worker's hashes of the prompt), so
    that no key is evicted and the index stays below the size from which lookups refresh keys,
    as in a run of the default size."""
    from kvtier.router.config import RouterConfig

    held = max(indexed_blocks, prompt_blocks) + workers * prompt_blocks
    return max(RouterConfig.index_capacity, 2 * held)


def _router(workers: int, block_tokens: int, policy: str = "tier-aware", index_capacity: int | None = None):
    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec

    config = RouterConfig(workers=[WorkerSpec(f"http://worker-{i}") for i in range(workers)], policy=policy,
                          block_tokens=block_tokens, kv_bytes_per_token=131072,
                          index_capacity=index_capacity or RouterConfig.index_capacity)
    router = Router(config, tokenizer=None)
    for w in router.workers:
        w.events_up = True     # as if every worker's KV events were connected
    return router


def fill_index(router, prompt: np.ndarray, indexed_blocks: int, seed: int = 0) -> None:
    """``indexed_blocks`` blocks in the index through the event path (``BlockIndex.stored``).

    The prompt: worker ``w`` holds its first ``(w + 1) / workers`` in GPU (odd workers
    in CPU), and the whole of it is in the shared tier, so every worker reaches every
    block. The rest: random 1024-block sequences, round-robin over the workers and media.
    Raises ``RuntimeError`` if a sequence does not make the index grow (it is full: it evicts as
    much as is stored), rather than storing for ever.
    """
    index, bs = router.index, router.config.block_tokens
    n = len(router.workers)
    blocks = len(prompt) // bs
    index.stored(0, [("p", 0, i) for i in range(blocks)], None, prompt, bs, "GPU", shared=True)
    index.clear_worker(0)
    for w in range(n):
        held = max(1, blocks * (w + 1) // n)
        index.stored(w, [("p", w, i) for i in range(held)], None, prompt[:held * bs], bs, "CPU" if w % 2 else "GPU")
    rng = np.random.default_rng(seed)
    seq_blocks = 1024
    s = 0
    while len(index) < indexed_blocks:
        before = len(index)
        count = min(seq_blocks, indexed_blocks - before)
        tokens = rng.integers(0, 150_000, count * bs, dtype=np.uint32)
        w = s % n
        index.stored(w, [("s", s, i) for i in range(count)], None, tokens, bs, ("GPU", "CPU")[s // n % 2],
                     shared=s % 3 == 0)
        s += 1
        if len(index) <= before:
            raise RuntimeError(f"the router index stopped growing at {before} keys of the {indexed_blocks} "
                               f"asked for (capacity {index.capacity})")


def p99_ms(seconds: list[float]) -> float:
    """The 99th percentile in ms, interpolated between ranks like the project's other percentiles
    (the rank ``int(0.99 n)`` is one above it: with 100 runs, the maximum, one scheduler hiccup)."""
    return round(route_trace.percentile(seconds, 0.99) * 1e3, 4)


def synthetic(tokens: int, workers: int, indexed_blocks: int, runs: int, block_tokens: int = BLOCK_TOKENS) -> dict:
    from kvtier.router.view import LiveView

    if block_tokens < 1 or tokens < block_tokens or workers < 1 or runs < 1 or indexed_blocks < 0:
        # a prompt under one block has nothing to price, and zero runs have no median
        raise ConfigError(f"--synthetic needs --block-tokens >= 1, --tokens >= --block-tokens ({block_tokens}), "
                          f"--workers >= 1, --runs >= 1 and --indexed-blocks >= 0; got tokens {tokens}, "
                          f"workers {workers}, runs {runs}, indexed blocks {indexed_blocks}")
    need = (max(indexed_blocks, tokens // block_tokens) + workers * (tokens // block_tokens)) * INDEX_BYTES_PER_KEY
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        raise ConfigError(f"--indexed-blocks {indexed_blocks} needs about {need / 2**30:.1f} GiB for the router "
                          f"index, more than this machine's {memory / 2**30:.1f} GiB")
    router = _router(workers, block_tokens,
                     index_capacity=index_capacity_for(indexed_blocks, tokens // block_tokens, workers))
    prompt = np.random.default_rng(1).integers(0, 150_000, tokens, dtype=np.uint32)
    t0 = time.perf_counter()
    fill_index(router, prompt, indexed_blocks)
    fill_s = time.perf_counter() - t0
    as_list = prompt.tolist()          # what the tokenizer hands the router
    rng = np.random.default_rng(2)
    gc.collect()
    decisions, calls, keying, viewing, policy, cpu = [], [], [], [], [], []
    for run in range(runs + 5):
        for w in router.workers:       # a different load each time: the policy must weigh it
            w.pending_tokens = int(rng.integers(0, 4 * tokens))
            w.active_blocks = int(rng.integers(0, 4096))
        t0 = time.perf_counter()
        decision = router.decide(as_list, set())
        t1 = time.perf_counter()
        # The same steps again, apart, for the breakdown, and their CPU time: on a shared
        # machine the wall clock also counts time the scheduler gave other processes.
        c0 = time.thread_time()
        keys = router.index.keys_of(as_list)
        t2 = time.perf_counter()
        view = LiveView(router.service, router.workers, router.index, keys, router.config.prefill_tokens_per_s,
                        router.config.decode_block_s)
        t3 = time.perf_counter()
        router.policy.choose(_Req(tokens, keys), view)
        t4 = time.perf_counter()
        c1 = time.thread_time()
        if run >= 5:                   # warm-up: first numpy calls, caches
            decisions.append(router.last_decision_s)
            calls.append(t1 - t0)
            keying.append(t2 - t1)
            viewing.append(t3 - t2)
            policy.append(t4 - t3)
            cpu.append(c1 - c0)
    if decision is None or view.cached_blocks(0) != len(keys):
        # the worst case timed is every prompt block indexed; anything less is another measurement
        raise RuntimeError(f"{view.cached_blocks(0)} of the prompt's {len(keys)} blocks are indexed "
                           f"(index: {len(router.index)} keys, capacity {router.index.capacity}); "
                           f"the decision times are not posted")
    ms = lambda xs: round(statistics.median(xs) * 1e3, 4)  # noqa: E731
    ordered = sorted(decisions)
    return {
        "tokens": tokens,
        "blocks": len(keys),
        "block_tokens": block_tokens,
        "workers": workers,
        "indexed_blocks": len(router.index),
        "index_capacity": router.index.capacity,
        "runs": runs,
        "decision_p50_ms": ms(decisions),
        "decision_p99_ms": p99_ms(decisions),
        "decision_max_ms": round(ordered[-1] * 1e3, 4),
        "decide_call_p50_ms": ms(calls),
        "decide_call_p99_ms": p99_ms(calls),
        "decision_cpu_p50_ms": ms(cpu),
        "decision_cpu_p99_ms": p99_ms(cpu),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "keys_p50_ms": ms(keying),
        "view_p50_ms": ms(viewing),
        "policy_p50_ms": ms(policy),
        "fill_s": round(fill_s, 2),
        "target_p99_ms": 1.0,
    }


class _Req:
    __slots__ = ("input_tokens", "blocks")

    def __init__(self, input_tokens: int, blocks) -> None:
        self.input_tokens, self.blocks = input_tokens, blocks


class ModeFlags:
    """The flags one mode of a bench reads, added through :meth:`add_argument` as to the parser.

    Each is defaulted to None in the parser, so that a flag given can be told from one left out
    (a value equal to the default included), and its default is kept here: the other mode
    refuses it by name (:meth:`refuse`), its own fills the defaults in (:meth:`fill_defaults`).
    Each flag a mode ignored was accepted and ignored: ``--trace --workers 4 --runs 10`` replayed
    on two workers, ``--synthetic --policies round-robin`` timed tier-aware.
    """

    def __init__(self, parser, mode: str) -> None:
        self.parser, self.mode = parser, mode
        self.defaults: dict[str, object] = {}
        self.flags: dict[str, str] = {}

    def add_argument(self, *names, **kwargs):
        action = self.parser.add_argument(*names, **kwargs)
        self.defaults[action.dest] = self.parser.get_default(action.dest)
        self.flags[action.dest] = action.option_strings[0]
        self.parser.set_defaults(**{action.dest: None})
        return action

    def given(self, args) -> list[str]:
        return [flag for dest, flag in self.flags.items() if getattr(args, dest) is not None]

    def fill_defaults(self, args) -> None:
        for dest, default in self.defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)

    def refuse(self, args, why: str) -> None:
        """Raise ``ConfigError`` naming this mode's flags ``args`` has, if any; ``why``: what the
        mode run instead reads, and how to say what was meant."""
        given = self.given(args)
        if given:
            named = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
            raise ConfigError(f"{named} {'is' if len(given) == 1 else 'are'} {self.mode}'s; {why}")


def register(subparsers) -> None:
    p = subparsers.add_parser("route", help="kvtier route: decision time (--synthetic) or a trace through real workers")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--synthetic", action="store_true", help="decision time over a synthetically filled index")
    mode.add_argument("--trace", metavar="FILE", help="replay a Mooncake-format trace through kvtier route and vLLM")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    synthetic_flags = ModeFlags(p, "--synthetic")
    synthetic_flags.add_argument("--tokens", type=int, default=32768, help="--synthetic: prompt tokens (default 32768)")
    synthetic_flags.add_argument("--workers", type=int, default=16, help="--synthetic: workers (default 16)")
    synthetic_flags.add_argument("--indexed-blocks", type=int, default=1_000_000,
                                 help="--synthetic: blocks in the index (default 1000000)")
    synthetic_flags.add_argument("--runs", type=int, default=300, help="--synthetic: decisions timed (default 300)")
    # --trace replays with the workers' page (vllm_trace.HASH_TOKENS) and reads the trace's own
    # block size from --trace-block-tokens, so this one is --synthetic's alone.
    synthetic_flags.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                                 help=f"--synthetic: the router's block size in tokens (default {BLOCK_TOKENS}); "
                                      "for a trace's block size give --trace-block-tokens")
    trace_flags = ModeFlags(p, "--trace")
    route_trace.add_arguments(trace_flags)
    p.set_defaults(func=functools.partial(_main, synthetic_flags=synthetic_flags, trace_flags=trace_flags))


def _main(args, *, synthetic_flags: ModeFlags, trace_flags: ModeFlags) -> int:
    if args.trace:
        trace_flags.fill_defaults(args)
        # --block-tokens was accepted and ignored: a 16-token trace was still read as 512-token blocks
        synthetic_flags.refuse(args, f"--trace replays a trace of {args.trace_block_tokens}-token blocks through "
                                     f"{route_trace.WORKERS} real vLLM workers, each block one "
                                     f"{route_trace.HASH_TOKENS}-token page of the workers: give the trace's block "
                                     "size with --trace-block-tokens, its window with --start and --requests")
        result = route_trace.run(args)
    else:
        synthetic_flags.fill_defaults(args)
        trace_flags.refuse(args, "--synthetic times the router's decision over a filled index with the tier-aware "
                                 "policy and no model: give it --tokens, --workers, --indexed-blocks, --runs or "
                                 "--block-tokens")
        result = synthetic(args.tokens, args.workers, args.indexed_blocks, args.runs, args.block_tokens)
    if args.json:
        print(strict_json(result))
    else:
        print(strict_json(result, indent=2))
    return 0
