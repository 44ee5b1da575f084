"""The router's block index: which worker holds which prompt block, in which tier.

Keys are the router's own, recomputed from token ids (a 64-bit key per block, chained
on its parent's key: see :func:`block_keys`), so no hash seed must agree with the
engines: a vLLM ``BlockStored`` event carries the token ids of the blocks it stores,
and the router keys a prompt the same way from the tokens its tokenizer gives.
The key is only a routing hint: a collision sends a request to a worker that then
misses, never to a wrong block (the worker checks its own cache). It is therefore
built for speed, not collision resistance (engines and tiers key with SHA-256).

A chain starts from its request's *context* (:func:`context_seed`): vLLM keys a LoRA
adapter's blocks and a ``cache_salt``'s (a tenant's) apart from the base model's, and so
must the router, or it would predict one tenant's or adapter's blocks as hits for another
(a wrong route, and a cross-tenant signal). Events carry both (``lora_name``, and the salt
in the first block's ``extra_keys``); a request carries them as its ``model`` and
``cache_salt``. Blocks whose ``extra_keys`` hold content the router cannot recompute from
a request (multimodal inputs, prompt embeddings) are keyed with it folded in: never
predicted as hits for a request with the same placeholder tokens. A chain start whose
event does not say its context (vLLM's CPU offloading connector publishes its copies with
``extra_keys`` None) is keyed as the base model's while the router has seen no tenant, adapter
or content extras (a base-model deployment, ``unkeyed_cpu_events="auto"``); once it has, it is
indexed only from a block this worker already reported (whose key carries the context), never
keyed as the base model's, and the events chained on what was left out are left out with it.
vLLM keys an adapter by its name and path, events by its name only: an adapter loaded through
the router from another path than before starts a new *generation* of its name
(:meth:`BlockIndex.lora_updated`), so that the old weights' blocks are no longer predicted as
its hits.

Per key, one int: bit 0 = a shared tier every worker can load holds it; bit
``1 + 2 x worker + tier`` = ``worker`` holds it in ``tier`` (0 = GPU/HBM, 1 = CPU/host).
Events are applied idempotently (a duplicate store sets bits already set, a duplicate
removal clears bits already clear), out of order (a block whose parent is not yet
known waits for it, bounded in events and blocks, for at most ``orphan_ttl_s``; a removal of
its blocks meanwhile strikes them from it), and the whole index is an LRU of at most
``capacity`` keys (least recently stored or, once nearly full, matched by a decision dropped
first) holding at most ``capacity`` workers' block hashes in all (each points at a key, and
goes with it), so memory is bounded whatever the publishers send, however many workers send
it. A block hash a worker reported keeps its key until removed (a later copy of it, in another
tier, is credited to the same key), and every bit a worker set is reachable from its hashes,
so a removal or a resync clears it.
"""

from __future__ import annotations

import array
import functools
import json
import re
import time
from collections import OrderedDict, deque
from itertools import repeat
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import xxhash

from kvtier.core.keys import as_token_array
from kvtier.router.chat_messages import lax_bool

GPU, CPU = 0, 1          #: worker tiers, as vLLM's ``medium``
SHARED_BIT = 1
#: the chain's root for the base model without a salt. Not 0: ``key_0 = seed * M + h_0``, and a
#: block whose tokens are all 0 has ``h = 0``, so from a root of 0 a prompt that began with such
#: blocks was keyed as the same prompt without them (its later blocks predicted as hits)
ROOT_SEED = 0x6B76746965722D72   # b"kvtier-r"
_MEDIUM = {"GPU": GPU, None: GPU, "CPU": CPU}
_U64 = (1 << 64) - 1


def worker_bit(worker: int, tier: int) -> int:
    return 1 << (1 + 2 * worker + tier)


def tier_of_medium(medium: str | None) -> int | None:
    """Index tier of a vLLM event medium; None for media the router does not price (STORAGE…)."""
    return _MEDIUM.get(medium.upper() if isinstance(medium, str) else medium)


def context_seed(lora_name: str | None = None, cache_salt: str | None = None, lora_generation: int = 0) -> int:
    """The chain's root for a request's context: :data:`ROOT_SEED` for the base model
    without a salt, else a 64-bit digest of the LoRA adapter's name and the salt, and of the
    adapter's generation once it was reloaded (:meth:`BlockIndex.lora_generation`)."""
    if not lora_name and not cache_salt:
        return ROOT_SEED
    context = [lora_name or "", cache_salt or ""]
    if lora_name and lora_generation:
        context.append(lora_generation)
    return xxhash.xxh3_64_intdigest(json.dumps(context, ensure_ascii=False).encode()) or 1


#: the root of a request that reads no cached block: no event is ever keyed from it
NO_READ_SEED = context_seed("\0kvtier: reads no cached block")


def reads_prefix_cache(body: dict, chat: bool) -> bool:
    """Whether vLLM may serve this request's prompt from cached blocks: not when it asks for
    prompt logprobs, since a cached block keeps no logits; vLLM's sampling params then skip
    reading the prefix cache, and the connector's loads with it. vLLM's ``to_sampling_params``
    takes ``prompt_logprobs``, or with ``echo`` (read as its pydantic model reads a boolean:
    ``1``, ``"true"``) a completion's ``logprobs`` or a chat's ``top_logprobs``; a chat's is
    never None (absent or null, it is 0), so a chat that echoes never reads the cache."""
    if body.get("prompt_logprobs") is not None:
        return False
    if not lax_bool(body.get("echo"), False):
        return True
    return not chat and body.get("logprobs") is None


#: a string pydantic's lax mode reads as an integer, once stripped: digits (single underscores between
#: them, as Python's ``int`` takes them) and a fraction of zeros only
_LAX_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")


def lax_int(value) -> int | None:
    """``value`` as vLLM's pydantic request models read an integer field in lax mode (``true`` is 1,
    ``5.0`` and ``"5"``, ``" 5.00 "`` are 5), or None where pydantic refuses it (``5.5``, ``"0x10"``, a
    float past int64, a list): the worker then refuses the request, so its routing does not matter."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2 ** 63 else None
    if isinstance(value, str):
        text = value.strip()
        if _LAX_INT_TEXT.fullmatch(text):
            return int(text.partition(".")[0])
    return None


def truncated_prompt(token_ids: list[int], body: dict) -> list[int]:
    """The prompt vLLM runs when a request asks it to truncate (``truncate_prompt_tokens`` N > 0):
    its last N tokens (a generating model's tokenizer truncates on the left), or its first N with
    ``truncation_side: right``. Keyed whole, its cut prefix was predicted as a hit. (-1, the
    model's own limit, is left whole: the router does not know every worker's.)"""
    n = lax_int(body.get("truncate_prompt_tokens"))
    if n is None or n < 0 or n >= len(token_ids):
        return token_ids
    if n == 0:
        return []
    return token_ids[:n] if body.get("truncation_side") == "right" else token_ids[-n:]


def tokenizer_truncation(body: dict) -> int | None:
    """The N a text prompt is encoded to when the request truncates it and names no side
    (``truncate_prompt_tokens`` N > 0): vLLM then lets its tokenizer truncate (``truncation=True,
    max_length=N``, on the left), which keeps the special tokens it adds (a BOS) and cuts the
    text's tokens, where :func:`truncated_prompt` would cut the BOS. None: the text is encoded whole
    (an explicit ``truncation_side``: vLLM slices the whole encoding, as ``truncated_prompt`` does)."""
    n = lax_int(body.get("truncate_prompt_tokens"))
    if n is None or n <= 0 or body.get("truncation_side") is not None:
        return None
    return n


def _fold(key: int, extras: list) -> int:
    """A block's key with content the tokens do not show (multimodal ids, embedding digests)."""
    return xxhash.xxh3_64_intdigest(repr(extras).encode(), seed=key)


def block_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, seed: int = ROOT_SEED) -> list[int]:
    """Keys of the full blocks of ``token_ids``, each chained on its parent's key.

    ``key_i = key_{i-1} * M + h_i  (mod 2**64)``, ``key_{-1} = seed``, where ``h_i`` is
    block ``i``'s digest: a multilinear sum of its tokens (``sum_t token_t * R_t``, odd
    random ``R_t``; one differing token always changes it) through murmur3's finaliser.
    The chain is linear so that numpy computes it for all blocks at once, with no
    Python per block (a loop of xxh3 calls was 0.3 ms of a 1 ms decision at 32 k
    tokens): ``key_i = M**i * (seed * M + sum_{j<=i} h_j * M**-j)``, M odd hence
    invertible. Two different prefixes that end in the same block keep different keys
    (their parents' difference times M is not 0). :func:`block_keys_reference` is the
    same definition one block at a time.
    """
    tokens = as_token_array(token_ids)
    n = tokens.size // block_tokens
    if n == 0:
        return []
    digests = _block_digests(tokens[:n * block_tokens].reshape(n, block_tokens), block_tokens)
    powers, inverse_powers = _powers(n)
    start = np.uint64((seed * _CHAIN_M) & _U64)
    return (powers[:n] * (start + np.cumsum(digests * inverse_powers[:n], dtype=np.uint64))).tolist()


def block_keys_reference(token_ids: Sequence[int], block_tokens: int, seed: int = ROOT_SEED) -> list[int]:
    """:func:`block_keys`, one block at a time in Python ints: the definition the fast path must equal."""
    weights = [int(r) for r in _weights(block_tokens)]
    keys, key = [], seed
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start:start + block_tokens]
        digest = _fmix64(sum(int(t) * r for t, r in zip(block, weights)) & _U64)
        key = (key * _CHAIN_M + digest) & _U64
        keys.append(key)
    return keys


_CHAIN_M = 0x9E3779B97F4A7C15            # odd: invertible mod 2**64
_CHAIN_M_INV = pow(_CHAIN_M, -1, 1 << 64)
_FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * _FMIX[0]) & _U64
    x ^= x >> 33
    x = (x * _FMIX[1]) & _U64
    return x ^ (x >> 33)


@functools.lru_cache(maxsize=8)
def _weights(block_tokens: int) -> np.ndarray:
    """The multilinear weights ``R_t`` of a block size: fixed (keys must agree across processes), odd."""
    rng = np.random.Generator(np.random.PCG64(0x6B767469 + block_tokens))
    return rng.integers(0, 1 << 63, block_tokens, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _block_digests(blocks: np.ndarray, block_tokens: int) -> np.ndarray:
    # einsum multiplies and sums without a (blocks x tokens) uint64 temporary, whose fresh
    # allocation (page faults) cost 6x the arithmetic
    x = np.einsum("ij,j->i", blocks, _weights(block_tokens), dtype=np.uint64, casting="unsafe")
    s33, m0, m1 = np.uint64(33), np.uint64(_FMIX[0]), np.uint64(_FMIX[1])
    x ^= x >> s33
    x *= m0
    x ^= x >> s33
    x *= m1
    x ^= x >> s33
    return x


_power_cache: list[np.ndarray] = []


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``M**i`` and ``M**-i`` for ``i < n`` (at least), grown by doubling and kept."""
    if not _power_cache or _power_cache[0].size < n:
        size = max(n, 2 * _power_cache[0].size if _power_cache else 1024)
        ups = np.full(size, _CHAIN_M, dtype=np.uint64)
        downs = np.full(size, _CHAIN_M_INV, dtype=np.uint64)
        ups[0] = downs[0] = 1
        _power_cache[:] = [np.multiply.accumulate(ups), np.multiply.accumulate(downs)]
    return _power_cache[0], _power_cache[1]


MAX_LORA_NAMES = 4096      #: adapters remembered from events, and loads (oldest forgotten first)
#: buckets of adapter names forgotten past ``MAX_LORA_NAMES``: each keeps the highest generation
#: of a name forgotten into it, the generation of every name of the bucket the router no longer knows
FORGOTTEN_LORA_BUCKETS = 1 << 14
#: what a chain start of unknown context (a CPU copy without ``extra_keys``) is keyed as:
#: ``base`` the base model's; ``drop`` left out; ``auto`` ``base`` until the router sees a
#: salt, an adapter or content extras in an event or a request, then ``drop``
UNKEYED_CPU_EVENTS = ("auto", "base", "drop")
#: orphans' budget in blocks, per allowed orphan event: a stored event is one request's new blocks
ORPHAN_BLOCKS_PER_EVENT = 64
#: how long an orphan waits for its parent: a publisher sends a chain in order, so a parent not
#: seen by then was published before the router listened and never comes
ORPHAN_TTL_S = 30.0


class _Extras:
    __slots__ = ("salt", "per_block")

    def __init__(self, salt: str | None, per_block: dict[int, list]) -> None:
        self.salt, self.per_block = salt, per_block


def _content_extras(block_hashes: Sequence[object], starts_chain: bool, lora_name: str | None,
                    extra_keys: Sequence[object] | None) -> _Extras:
    """Split an event's per-block ``extra_keys`` (vLLM's untagged order: LoRA name if the
    event has one, ``(mm_identifier, offset)`` pairs, the first block's cache salt, prompt
    embedding digests) into the salt and, per block, the content to fold into its key."""
    salt, per_block = None, {}
    if not extra_keys:
        return _Extras(None, per_block)
    for i, entry in enumerate(list(extra_keys)[:len(block_hashes)]):
        if not entry:
            continue
        items = list(entry) if isinstance(entry, (list, tuple)) else [entry]   # (odd input: no raise)
        if lora_name and items and items[0] == lora_name:
            items = items[1:]
        if i == 0 and starts_chain:
            strings = [x for x in items if isinstance(x, str)]
            if strings:
                salt = strings[-1]      # the salt is the only bare string after the LoRA name
                items.remove(salt)
        if items:
            per_block[i] = items
    return _Extras(salt, per_block)


#: the path of an adapter the router knows was loaded, or unloaded, but not from where
_UNKNOWN_PATH = object()


class _Adapter(NamedTuple):
    """What the router knows of a LoRA adapter's name: the generation its blocks are keyed
    under, and the path it was last loaded from through the router (``_UNKNOWN_PATH``)."""
    generation: int
    path: object


def _forgotten_bucket(lora_name: str) -> int:
    return xxhash.xxh3_64_intdigest(lora_name.encode("utf-8", "surrogatepass")) % FORGOTTEN_LORA_BUCKETS


class _Source:
    """What the index knows of one worker's publisher: its hashes → our keys (and back), and orphans."""

    __slots__ = ("hash_to_key", "key_to_hash", "orphans", "orphans_since", "orphan_count", "orphan_blocks",
                 "orphan_hashes", "unkeyed_hashes")

    def __init__(self) -> None:
        self.hash_to_key: dict[object, int] = {}
        #: the inverse (one hash per key and worker): a key the LRU drops takes its hashes with it
        self.key_to_hash: dict[int, object] = {}
        #: parent hash → stored events waiting for it (lists: a removal shortens them), oldest
        #: first; and since when
        self.orphans: OrderedDict[object, list[list]] = OrderedDict()
        self.orphans_since: dict[object, float] = {}
        self.orphan_count = 0
        self.orphan_blocks = 0
        #: block hash → the waiting events that store it: a removal of it strikes it from them
        self.orphan_hashes: dict[object, list[list]] = {}
        #: block hashes left out for their unknown context (oldest first, bounded): an event
        #: chained on one is left out at once, its parent's key never comes
        self.unkeyed_hashes: OrderedDict[object, None] = OrderedDict()


class BlockIndex:
    """Blocks per worker and tier, fed by events, read by the live cluster view.

    ``unkeyed_blocks``: blocks of stored events left out, in all, because their context was
    unknown (``context_known=False``, where such events are dropped: those before the event's
    first block the worker already reported, and the events chained on them);
    ``dropped_orphans``: orphan events dropped (over budget, or waited too long);
    ``keyed_context_seen``: an event or request with a salt, an adapter or content extras came
    since the index was made (``unkeyed_cpu_events="auto"`` drops unknown contexts from then on)."""

    def __init__(self, block_tokens: int, capacity: int = 1 << 22, max_orphans: int = 4096,
                 orphan_ttl_s: float = ORPHAN_TTL_S, unkeyed_cpu_events: str = "auto") -> None:
        if block_tokens <= 0 or capacity <= 0:
            raise ValueError("block_tokens and capacity must be positive")
        if unkeyed_cpu_events not in UNKEYED_CPU_EVENTS:
            raise ValueError(f"unkeyed_cpu_events is one of {', '.join(UNKEYED_CPU_EVENTS)}, "
                             f"got {unkeyed_cpu_events!r}")
        self.unkeyed_cpu_events = unkeyed_cpu_events
        self.keyed_context_seen = False
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._refresh_from = capacity - capacity // 8   # size from which lookups refresh keys
        self.max_orphans = max_orphans
        #: orphans hold their token ids: bounded in blocks too (one event can be a 30 k-token prompt)
        self.max_orphan_blocks = ORPHAN_BLOCKS_PER_EVENT * max_orphans
        self.orphan_ttl_s = orphan_ttl_s
        self._masks: OrderedDict[int, int] = OrderedDict()
        self._sources: dict[int, _Source] = {}
        #: workers' block hashes held, all sources together (bounded by ``capacity`` too: each
        #: worker's map capped on its own held up to workers x ``capacity`` entries)
        self._hashes = 0
        self._max_worker = 0      # highest worker id ever indexed: how wide masks can be
        self._lora_names: OrderedDict[str, None] = OrderedDict()   # adapters seen in events
        #: adapters loaded or unloaded through the router (:meth:`lora_updated`), oldest first
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()
        #: per bucket of names forgotten from ``_adapters``: the highest generation forgotten there
        self._forgotten_adapters: dict[int, int] = {}
        self._last_generation = 0   # generations are drawn from one counter: none is used twice
        self.dropped_orphans = 0
        self.unkeyed_blocks = 0

    def __len__(self) -> int:
        return len(self._masks)

    def mask(self, key: int) -> int:
        return self._masks.get(key, 0)

    def masks(self, keys: Sequence[int]) -> list[int]:
        """Masks of the leading ``keys``, stopping at the first key nobody holds."""
        get = self._masks.get
        out = []
        for key in keys:
            m = get(key, 0)
            if not m:
                break
            out.append(m)
        return out

    def leading_masks(self, keys: Sequence[int]) -> list[int]:
        """:meth:`masks` with the lookups done at C speed (one ``dict.get`` per key, then a scan);
        the keys found count as used (see :meth:`_used`)."""
        found = list(map(self._masks.get, keys, repeat(0)))
        try:
            found = found[:found.index(0)]
        except ValueError:
            pass
        if found and (len(self._masks) >= self._refresh_from or self._hashes >= self._refresh_from):
            self._used(keys[:len(found)])
        return found

    def _used(self, keys: Sequence[int]) -> None:
        """Move a decision's matched keys to the young end of the LRU, the root last (youngest).

        vLLM publishes a block once, when cached, and a prefix-cache hit publishes nothing:
        evicted by first store, the system prompt every request reads went first, and with its
        root gone its whole chain was unreachable. Only done once the index is nearly full
        (until then nothing is evicted and the order does not matter): ~20 ns a key."""
        deque(map(self._masks.move_to_end, reversed(keys)), maxlen=0)

    def tier_runs(self, worker_ids: Sequence[int], keys: Sequence[int],
                  codes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Where each worker can have the leading prompt blocks anybody holds, as runs.

        Returns ``(run_tiers, run_blocks)``: the leading keys split into runs of equal
        masks (``run_blocks[r]`` keys each: a prompt has a few, one per change of who
        holds what), and ``run_tiers[i, r]`` = ``codes[0]`` if ``worker_ids[i]`` holds
        run ``r`` in GPU, else ``codes[1]`` in CPU, else ``codes[2]`` if the shared tier
        does, else ``codes[3]`` (int8). Numpy work (one ``unpackbits`` of the runs'
        masks), no loop per worker or per block.
        """
        masks = self.leading_masks(keys)
        ids = np.asarray(worker_ids, dtype=np.int64)
        if not masks:
            return np.full((len(ids), 0), codes[3], dtype=np.int8), np.zeros(0, dtype=np.int64)
        # 64-bit words of the widest mask, and of the widest bit asked about (a worker
        # that never sent an event still has a column: all clear)
        words = (2 + 2 * max(self._max_worker, int(ids.max(initial=0)))) // 64 + 1
        if 2 + 2 * self._max_worker < 64:
            # array.array converts the list of ints faster than numpy does
            packed = np.frombuffer(array.array("Q", masks), dtype=np.uint64).reshape(-1, 1)
            if words > 1:   # a worker id beyond every mask's bits: its columns are all clear
                packed = np.hstack((packed, np.zeros((len(masks), words - 1), dtype=np.uint64)))
        else:   # over 31 workers: split each mask into words (slower; rare)
            packed = np.array([[(m >> (64 * w)) & _U64 for w in range(words)] for m in masks], dtype="<u8")
        starts = np.flatnonzero(np.concatenate(([True], (packed[1:] != packed[:-1]).any(axis=1))))
        run_blocks = np.diff(np.append(starts, len(masks)))
        bits = np.unpackbits(packed[starts].view(np.uint8), axis=1, bitorder="little").T   # (bits, runs)
        gpu, cpu, shared = bits[1 + 2 * ids], bits[2 + 2 * ids], bits[0]   # worker_bit(w, GPU / CPU)
        out = np.where(shared, np.int8(codes[2]), np.int8(codes[3]))[None, :].repeat(len(ids), axis=0)
        out[cpu.view(bool)] = codes[1]
        out[gpu.view(bool)] = codes[0]
        return out, run_blocks

    def keys_of(self, token_ids: Sequence[int] | np.ndarray, seed: int = ROOT_SEED) -> list[int]:
        """A prompt's keys, rooted in its context (:func:`context_seed`)."""
        return block_keys(token_ids, self.block_tokens, seed=seed)

    # --- mutations ------------------------------------------------------------------
    def _set(self, key: int, bits: int) -> None:
        """Set ``bits`` on ``key`` (the youngest now), within the bounds (:meth:`_evict`)."""
        masks = self._masks
        masks[key] = masks.get(key, 0) | bits
        masks.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        """The oldest keys go while over ``capacity`` keys or hashes, each with the workers' hashes
        that point at it: each worker's map capped on its own, a key's hashes outlived it, and the
        index held up to (workers + 1) x ``capacity`` entries in all."""
        masks, sources = self._masks, self._sources
        while (len(masks) > self.capacity or self._hashes > self.capacity) and masks:
            key, rest = masks.popitem(last=False)
            rest &= ~SHARED_BIT
            while rest:   # the workers with a bit on it, from the bits (usually one)
                worker = ((rest & -rest).bit_length() - 2) >> 1
                rest &= ~(worker_bit(worker, GPU) | worker_bit(worker, CPU))
                src = sources.get(worker)
                h = src.key_to_hash.pop(key, None) if src is not None else None
                if h is not None:
                    del src.hash_to_key[h]
                    self._hashes -= 1

    def _unbind(self, src: _Source, h: object, key: int) -> None:
        """Forget ``src``'s hash ``h`` (bound to ``key``)."""
        del src.hash_to_key[h]
        if src.key_to_hash.get(key) == h:
            del src.key_to_hash[key]
        self._hashes -= 1

    def _clear(self, key: int, bits: int) -> None:
        m = self._masks.get(key)
        if m is None:
            return
        m &= ~bits
        if m:
            self._masks[key] = m
        else:
            del self._masks[key]

    def _source(self, worker: int) -> _Source:
        src = self._sources.get(worker)
        if src is None:
            if worker < 0:
                raise ValueError(f"worker ids are >= 0, got {worker}")
            src = self._sources[worker] = _Source()
            self._max_worker = max(self._max_worker, worker)
        return src

    def stored(self, worker: int, block_hashes: Sequence[object], parent_hash: object,
               token_ids: Sequence[int], block_size: int, medium: str | None = "GPU",
               shared: bool = False, lora_name: str | None = None,
               extra_keys: Sequence[object] | None = None, context_known: bool = True) -> int:
        """Apply a ``BlockStored`` event; returns how many blocks were indexed (0 if it waits).

        ``shared``: these blocks also reach a tier every worker loads from (the worker
        writes what it computes through to it). ``lora_name`` and ``extra_keys`` are the
        event's (vLLM's untagged per-block extras): a chain that starts here is rooted in
        its context (:func:`context_seed`); content extras are folded into their block's key.
        ``context_known=False``: the event does not say its context (vLLM's CPU offloading
        connector leaves ``extra_keys`` None, salt and multimodal inputs included). A chain that
        starts here is keyed as the base model's while :meth:`_unknown_context_is_base_model`;
        otherwise it is indexed only from its first block this worker already reported, and
        the blocks before it, with the events chained on them, are left out (counted in
        ``unkeyed_blocks``), since keyed from the base model's root a tenant's salted blocks
        were predicted as another's hits.
        """
        if tier_of_medium(medium) is None or block_size != self.block_tokens or not block_hashes:
            return 0
        src = self._source(worker)
        # A worklist, not recursion: a long chain of orphans (a decode whose root event was
        # missed) resolved one frame per event raised RecursionError and lost the rest.
        pending = [(block_hashes, parent_hash, token_ids, block_size, medium, shared, lora_name, extra_keys,
                    context_known)]
        done = 0
        while pending:
            hashes = self._store(worker, src, pending.pop())
            done += len(hashes)
            for h in hashes:
                pending.extend(self._orphans_of(src, h))
        return done

    def _store(self, worker: int, src: _Source, event: Sequence) -> Sequence[object]:
        """One stored event whose tier and block size are good; returns the hashes indexed."""
        block_hashes, parent_hash, token_ids, block_size, medium, shared, lora_name, extra_keys, context_known = event
        extras = _content_extras(block_hashes, parent_hash is None, lora_name, extra_keys)
        if lora_name or extras.salt is not None or extras.per_block:
            self.saw_keyed_context()
        if parent_hash is None and not context_known and not self._unknown_context_is_base_model():
            first = self._first_known(src, block_hashes)
            self._leave_out(src, block_hashes[:first])
            block_hashes, token_ids = block_hashes[first:], token_ids[first * block_size:]
            extras, parent = _Extras(None, {}), None    # (the first block's key is known)
            if not block_hashes:
                return ()
        elif parent_hash is None:
            parent = context_seed(lora_name, extras.salt, self.lora_generation(lora_name))
        else:
            parent = src.hash_to_key.get(parent_hash)
            if parent is None:
                if parent_hash in src.unkeyed_hashes:
                    self._leave_out(src, block_hashes)   # (its parent's key never comes)
                else:
                    self._wait_for_parent(src, event)
                return ()
        if lora_name:
            self.add_lora_names([str(lora_name)])
        keys = self._event_keys(src, block_hashes, parent, token_ids[:len(block_hashes) * block_size], extras)
        bits = worker_bit(worker, tier_of_medium(medium)) | (SHARED_BIT if shared else 0)
        both = worker_bit(worker, GPU) | worker_bit(worker, CPU)
        h2k, k2h, masks, unkeyed = src.hash_to_key, src.key_to_hash, self._masks, src.unkeyed_hashes
        for h, key in zip(block_hashes, keys):
            old = h2k.get(h)
            if old != key:
                if unkeyed:
                    unkeyed.pop(h, None)     # (stored again with its context: keyed now)
                if old is not None:
                    self._clear(old, both)   # the old key is reached through this mapping only
                    self._unbind(src, h, old)
                other = k2h.get(key)
                if other is not None:
                    # another hash of this worker with the same key (a collision): one hash per
                    # key and worker, the newest; the key's bits stay reachable from it
                    self._unbind(src, other, key)
                h2k[h] = key
                k2h[key] = h
                self._hashes += 1
            masks[key] = masks.get(key, 0) | bits
            masks.move_to_end(key)
        self._evict()   # once an event (over the bounds meanwhile by at most its blocks)
        return block_hashes[:len(keys)]

    def saw_keyed_context(self) -> None:
        """An event or request with a cache salt, a LoRA adapter or content extras came: the
        deployment is not the base model's alone (see ``unkeyed_cpu_events``)."""
        self.keyed_context_seen = True

    def _unknown_context_is_base_model(self) -> bool:
        """Whether a chain start of unknown context is keyed as the base model's: in a deployment
        of the base model alone it is (vLLM's offloading connector leaves ``extra_keys`` None for
        every copy; dropped, a hot prefix whose GPU store came before the router started was never
        predicted in CPU), once a tenant or adapter may have sent it not (a miss, never another
        tenant's hit)."""
        mode = self.unkeyed_cpu_events
        return mode == "base" or (mode == "auto" and not self.keyed_context_seen)

    @staticmethod
    def _first_known(src: _Source, block_hashes: Sequence[object]) -> int:
        """Where a chain start of unknown context can be indexed from: its first block that
        ``src`` already reported (whose key carries the context); none: its length."""
        h2k = src.hash_to_key
        return next((i for i, h in enumerate(block_hashes) if h in h2k), len(block_hashes))

    def _leave_out(self, src: _Source, block_hashes: Sequence[object]) -> None:
        """Blocks of unknown context are not indexed (counted in ``unkeyed_blocks``), nor the
        events chained on them, waiting or to come: the offloading connector sends a prompt's
        copy a chunk an event, each chained on the one before, and those waited as orphans for
        their parent, which never comes, for the whole ``orphan_ttl_s``."""
        worklist = [block_hashes]
        while worklist:
            hashes = [h for h in worklist.pop() if h not in src.hash_to_key]
            self.unkeyed_blocks += len(hashes)
            for h in hashes:
                self._remember_unkeyed(src, h)
                if h in src.orphans:
                    worklist.extend(event[0] for event in src.orphans[h])
                    self._drop_orphans(src, h, dropped=False)

    def _remember_unkeyed(self, src: _Source, h: object) -> None:
        """Note ``h`` as left out, within the orphans' budget in blocks (oldest forgotten first:
        an event chained on one forgotten waits as an orphan, as before)."""
        unkeyed = src.unkeyed_hashes
        unkeyed.pop(h, None)
        unkeyed[h] = None
        while len(unkeyed) > self.max_orphan_blocks:
            unkeyed.popitem(last=False)

    def _event_keys(self, src: _Source, block_hashes: Sequence[object], parent: int | None,
                    tokens: Sequence[int], extras: _Extras) -> list[int]:
        """Keys of an event's blocks. A block hash this worker already reported keeps its key:
        vLLM's CPU offloading connector publishes its copies of a salted prompt's blocks with
        ``extra_keys=None``, and recomputed they were keyed as an unsalted prompt's (another
        tenant's hits). The hashes already carry the context; only new blocks are keyed anew,
        chained on the last known one. ``parent`` None: the context is unknown and the first
        block's key known (:meth:`_first_known`)."""
        h2k, block_size = src.hash_to_key, self.block_tokens
        known = []
        for h in block_hashes[:len(tokens) // block_size]:
            key = h2k.get(h)
            if key is None:
                break
            known.append(key)
        start = len(known)
        seed = known[-1] if known else parent
        rest = tokens[start * block_size:]
        if not any(i >= start for i in extras.per_block):
            return known + block_keys(rest, block_size, seed=seed)
        # rare (multimodal, embeddings): block by block, folding each block's extras
        key = seed
        for i in range(start, len(tokens) // block_size):
            key = block_keys(tokens[i * block_size:(i + 1) * block_size], block_size, seed=key)[0]
            if extras.per_block.get(i):
                key = _fold(key, extras.per_block[i])
            known.append(key)
        return known

    def lora_generation(self, lora_name: object) -> int:
        """The generation adapter ``lora_name``'s blocks are keyed under (what :func:`context_seed`
        folds into its chains' root): 0 until it is loaded through the router from another path
        than before, then a value drawn for it that no other load drew. A name forgotten past
        ``MAX_LORA_NAMES`` has the highest generation of the names forgotten into its bucket: its
        own, or one its old weights' blocks never had (misses, never stale hits); a name never
        forgotten into it and never reloaded keeps 0, as the events of its blocks do."""
        if not isinstance(lora_name, str):
            return 0
        adapter = self._adapter(lora_name)
        return adapter.generation if adapter is not None else 0

    def _adapter(self, lora_name: str) -> _Adapter | None:
        """What the router knows of adapter ``lora_name`` (None: nothing since it started)."""
        adapter = self._adapters.get(lora_name)
        if adapter is not None or not self._forgotten_adapters:
            return adapter
        forgotten = self._forgotten_adapters.get(_forgotten_bucket(lora_name))
        return None if forgotten is None else _Adapter(forgotten, _UNKNOWN_PATH)

    def lora_updated(self, body: object, unloaded: bool) -> None:
        """vLLM's ``/v1/load_lora_adapter`` (``unloaded``: ``/v1/unload_lora_adapter``) with
        ``body`` took effect on some worker. vLLM hashes an adapter's blocks with its name and
        path ("re-pointing a LoRA name at a different adapter does not reuse KV"), its events
        name it only. Its cached blocks outlive an unload (vLLM does not reset its prefix cache),
        so the generation moves on only at a load from another path than the adapter's last load
        here, or from a path the router does not know (it saw the adapter unloaded, or forgot it)
        or in place over a load it never saw: the blocks keyed under the old generation, no
        longer hits on any worker, are no longer predicted as the adapter's (they age out of the
        LRU). An unload, a load from the same path, and the first plain load seen keep it.

        A ``load_inplace`` from the same path keeps it too, even where the files there were
        replaced by other weights: vLLM's block hashes do not change then either, so vLLM
        itself serves the old weights' cached blocks, and the router predicts what vLLM does."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            return
        self.saw_keyed_context()
        known = self._adapter(name)
        if unloaded:
            self._note_adapter(name, known or _Adapter(0, _UNKNOWN_PATH))
            return
        path = body.get("lora_path")
        if known is None:
            moved = lax_bool(body.get("load_inplace"), False)   # over a load the router never saw
        else:
            moved = known.path is _UNKNOWN_PATH or known.path != path
        generation = self._new_generation() if moved else (known.generation if known else 0)
        self._note_adapter(name, _Adapter(generation, path))

    def _new_generation(self) -> int:
        self._last_generation += 1
        return self._last_generation

    def _note_adapter(self, name: str, adapter: _Adapter) -> None:
        """Remember ``adapter`` (the youngest now); past ``MAX_LORA_NAMES`` the oldest is forgotten
        into its bucket, which keeps the highest generation forgotten there (its path unknown)."""
        for old_name, old in self._remember(self._adapters, name, adapter):
            bucket = _forgotten_bucket(old_name)
            self._forgotten_adapters[bucket] = max(self._forgotten_adapters.get(bucket, 0), old.generation)

    @staticmethod
    def _remember(table: OrderedDict, name: str, value: object) -> list[tuple[str, object]]:
        """Put ``name`` in ``table`` as its youngest; returns the oldest entries forgotten for it."""
        table.pop(name, None)
        table[name] = value
        return [table.popitem(last=False) for _ in range(len(table) - MAX_LORA_NAMES)]

    def is_lora(self, model: object) -> bool:
        """Whether a request's ``model`` names a LoRA adapter (named by some worker's events,
        or listed by its ``/v1/models``)."""
        return isinstance(model, str) and model in self._lora_names

    def add_lora_names(self, names: Sequence[str]) -> None:
        """Adapters to key apart from the base model (the most recent ``MAX_LORA_NAMES`` kept)."""
        if names:
            self.saw_keyed_context()
        for name in names:
            self._remember(self._lora_names, name, None)

    def _wait_for_parent(self, src: _Source, event: Sequence) -> None:
        """Keep ``event`` until its parent arrives; the oldest orphans go first when over budget
        (a new orphan is likelier to resolve than one that has waited). Token ids are kept as
        uint32 (a list of Python ints is 8 to 36 bytes a token)."""
        hash(tuple(event[0]))   # an unhashable block hash raises here, before anything changes
        blocks = len(event[0])
        if blocks > self.max_orphan_blocks:
            self.dropped_orphans += 1   # a miss later, never a wrong answer
            return
        while src.orphans and (src.orphan_count >= self.max_orphans
                               or src.orphan_blocks + blocks > self.max_orphan_blocks):
            self._drop_orphans(src, next(iter(src.orphans)))
        if src.orphan_count >= self.max_orphans:   # (max_orphans 0: none kept)
            self.dropped_orphans += 1
            return
        event = [event[0], event[1], as_token_array(event[2][:blocks * event[3]]), *event[3:]]
        if event[1] not in src.orphans:
            src.orphans_since[event[1]] = time.monotonic()
        src.orphans.setdefault(event[1], []).append(event)
        src.orphan_count += 1
        src.orphan_blocks += blocks
        for h in event[0]:
            src.orphan_hashes.setdefault(h, []).append(event)

    def _orphans_of(self, src: _Source, parent_hash: object) -> list[list]:
        """The events waiting for ``parent_hash`` (now indexed), unless they waited too long."""
        if parent_hash not in src.orphans:
            return []
        fresh = time.monotonic() - src.orphans_since[parent_hash] <= self.orphan_ttl_s
        waiting = src.orphans[parent_hash]
        self._drop_orphans(src, parent_hash, dropped=not fresh)
        return waiting if fresh else []

    def _drop_orphans(self, src: _Source, parent_hash: object, dropped: bool = True) -> None:
        waiting = src.orphans.pop(parent_hash)
        del src.orphans_since[parent_hash]
        src.orphan_count -= len(waiting)
        src.orphan_blocks -= sum(len(e[0]) for e in waiting)
        for event in waiting:
            self._unlist_orphan_hashes(src, event, event[0])
        if dropped:
            self.dropped_orphans += len(waiting)

    @staticmethod
    def _unlist_orphan_hashes(src: _Source, event: list, hashes: Sequence[object]) -> None:
        for h in hashes:
            events = src.orphan_hashes.get(h)
            if events is None:
                continue
            events[:] = [e for e in events if e is not event]
            if not events:
                del src.orphan_hashes[h]

    def _strike_orphans(self, src: _Source, h: object, tier: int) -> None:
        """The worker removed block ``h`` from ``tier`` while an event storing it there waits for
        its parent: that block and the ones after it in the event (its descendants) are struck,
        or the parent's arrival credited blocks the worker no longer holds, for good (vLLM sends
        a removal once)."""
        events = {id(e): e for e in src.orphan_hashes[h]}   # (one per event, if h repeats in it)
        for event in events.values():
            if tier_of_medium(event[4]) != tier:
                continue
            cut = list(event[0]).index(h)
            struck = event[0][cut:]
            # a hash also in the kept part still names this event (a publisher may repeat one)
            kept = set(event[0][:cut])
            self._unlist_orphan_hashes(src, event, [x for x in struck if x not in kept])
            src.orphan_blocks -= len(struck)
            if cut:
                event[0], event[2] = event[0][:cut], event[2][:cut * event[3]]
                continue
            waiting = src.orphans[event[1]]
            waiting[:] = [e for e in waiting if e is not event]
            src.orphan_count -= 1
            if not waiting:
                del src.orphans[event[1]], src.orphans_since[event[1]]

    def removed(self, worker: int, block_hashes: Iterable[object], medium: str | None = "GPU") -> None:
        """Apply a ``BlockRemoved`` event (unknown hashes are ignored: duplicates, or never seen;
        a block of an orphan that waits is struck from it, with its descendants)."""
        tier = tier_of_medium(medium)
        src = self._sources.get(worker)
        if tier is None or src is None:
            return
        bit = worker_bit(worker, tier)
        both = worker_bit(worker, GPU) | worker_bit(worker, CPU)
        for h in block_hashes:
            if src.orphan_hashes and h in src.orphan_hashes:
                self._strike_orphans(src, h, tier)
            key = src.hash_to_key.get(h)
            if key is None:
                continue
            self._clear(key, bit)
            if not self._masks.get(key, 0) & both:
                self._unbind(src, h, key)

    def clear_worker(self, worker: int) -> None:
        """Forget everything ``worker`` reported (it left, its publisher restarted, or a gap)."""
        src = self._sources.pop(worker, None)
        if src is None:
            return
        bits = worker_bit(worker, GPU) | worker_bit(worker, CPU)
        self._hashes -= len(src.hash_to_key)
        for key in src.key_to_hash:
            self._clear(key, bits)

    def add_shared(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._set(key, SHARED_BIT)

    def clear_shared(self) -> None:
        """Forget what the shared tier holds (its publisher restarted or events were lost)."""
        for key in [k for k, m in self._masks.items() if m & SHARED_BIT]:
            self._clear(key, SHARED_BIT)

    def worker_blocks(self, worker: int) -> int:
        """Blocks ``worker`` reported stored and not removed (since its last resync)."""
        src = self._sources.get(worker)
        return len(src.hash_to_key) if src is not None else 0

    def workers_known(self) -> list[int]:
        return sorted(self._sources)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bounds hold, each worker's hash → key map is one to
        one and points only at keys that carry that worker's bits, and the orphans' counts and
        hash lists agree with the events waiting."""
        assert len(self._masks) <= self.capacity, f"{len(self._masks)} keys over capacity {self.capacity}"
        assert self._hashes == sum(len(s.hash_to_key) for s in self._sources.values()), "hash count disagrees"
        assert self._hashes <= self.capacity, f"{self._hashes} hashes over capacity {self.capacity}"
        for worker, src in self._sources.items():
            both = worker_bit(worker, GPU) | worker_bit(worker, CPU)
            assert {k: h for h, k in src.hash_to_key.items()} == src.key_to_hash, f"worker {worker}: maps disagree"
            assert all(self._masks.get(k, 0) & both for k in src.key_to_hash), f"worker {worker}: a hash of no bit"
            waiting = [e for events in src.orphans.values() for e in events]
            assert src.orphan_count == len(waiting) and set(src.orphans) == set(src.orphans_since)
            assert src.orphan_blocks == sum(len(e[0]) for e in waiting), f"worker {worker}: orphan blocks disagree"
            listed = {(h, id(e)) for h, events in src.orphan_hashes.items() for e in events}
            assert listed == {(h, id(e)) for e in waiting for h in e[0]}, f"worker {worker}: orphan hashes disagree"
