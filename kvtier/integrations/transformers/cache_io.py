"""Moving KV between store blocks and a transformers ``DynamicCache``, with large copies only.

The model's KV lives in one preallocated tensor, :class:`KVStorage`, of shape
``(layers, 2, batch=1, kv_heads, capacity, head_dim)``; each cache layer is a
:class:`StorageLayer` whose keys and values are views of it. Two reasons:

* **Loading is one copy per block, or fewer.** A canonical block ``(layers, 2,
  kv_heads, block_tokens, head_dim)`` lands in ``storage[:, :, 0, :, span, :]``
  with a strided ``numpy.copyto`` (inner runs of ``block_tokens * head_dim``
  elements), straight from the host pool (:meth:`HostTier.borrow_runs`: the
  whole run of host blocks pinned at once, no staging copy; blocks adjacent in
  the pool go in one call) or from a page-aligned staging buffer a slower tier
  read into. No per-token, per-layer Python loop.
* **Appending is in place.** ``DynamicLayer.update`` concatenates, copying the
  whole prefix at every forward; a loaded 4 k-token prefix would be copied
  again for each decode step. Here ``update`` writes the new positions only.

Saving is the reverse gather: ``storage[:, :, 0, :, span, :]`` of N blocks into
N canonical blocks, one copy.

Only plain full-attention layers are supported (Llama, Qwen2, Mistral without a
sliding window); anything else raises :class:`ConfigError` rather than risk a
wrong cache.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvtier.core.keys import BlockKey
from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError, LayoutError
from kvtier.integrations import poison as poisoning
from kvtier.store.tiered import TieredStore
from kvtier.tiers.direct_io import run_request_blocks
from kvtier.tiers.host import HostTier

#: reads from slower tiers: bytes per request to the store (a span), and requests in flight. A
#: span's blocks are placed as they are verified, so a span need not be small for its copies to
#: overlap reads; each span costs its I/O thread a pause (the next span's lookups, the last
#: request's check), so spans are large: the demo's 20-40 MiB loads are two spans, one a thread.
READ_CHUNK_BYTES = 16 << 20
READS_IN_FLIGHT = 2
#: spans handed to the store beyond those being read: an I/O thread that finishes a span starts
#: the next at once instead of waiting for the loader's thread to wake and hand it over (on a
#: busy machine that round trip cost 1-3 ms a span). The reads in flight stay as many as the
#: store has I/O threads (``TieredStore(io_threads=READS_IN_FLIGHT)``, its default).
SPANS_AHEAD = READS_IN_FLIGHT

#: integer dtypes used to move raw KV bytes through numpy (numpy has no bfloat16)
_RAW_TORCH = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


class KVStorage:
    """One tensor holding every layer's K and V for one sequence, with spare capacity.

    Not thread safe: one request at a time writes it. Views handed out (layer
    keys/values, :meth:`raw`) stay valid until :meth:`ensure_capacity`
    reallocates; data below the sequence length is never overwritten by appends.
    """

    def __init__(
        self, layout: KVLayout, capacity_tokens: int, dtype: torch.dtype, device="cpu", *, poison: bool | None = None
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        #: debug: fill with NaN at allocation and on :meth:`poison` (see :mod:`kvtier.integrations.poison`)
        self.poisoned = poisoning.enabled(poison)
        self.tensor = self._alloc(capacity_tokens)
        self.layers: list[StorageLayer] = []
        #: why an append of the current cache was refused (None: none was): its layers may then
        #: hold different lengths, so the session saves nothing of it (cleared by :meth:`new_cache`)
        self.refused: str | None = None
        #: what the first forward after a load must feed (:meth:`expect_prompt_suffix`)
        self.expected: PromptSuffix | None = None
        #: what every forward on the current cache is given besides token ids (:meth:`watch_inputs`)
        self.inputs_watch: InputsWatch | None = None
        #: (position, why): from that position on, the cache holds K/V that no block key names (a
        #: forward fed embeddings, token types, other positions or a mask; :class:`InputsWatch`),
        #: so no block from there is saved (cleared by :meth:`new_cache`)
        self.untrusted: tuple[int, str] | None = None
        #: the cache :meth:`new_cache` made last: forwards given another are not this storage's
        self.cache: DynamicCache | None = None
        #: while set, every forward's first append (layer 0's) first asks it whether the model changed
        #: since the cache was prepared (a change in words, or None); a change marks the cache refused,
        #: and the forward goes on (cleared by :meth:`new_cache` and after a change)
        self.model_change: Callable[[], str | None] | None = None

    def _alloc(self, capacity: int) -> torch.Tensor:
        lay = self.layout
        # A normal tensor even when a request grows the storage inside torch.inference_mode
        # (KVTierLM.generate): an inference tensor cannot be written outside that mode, and HF
        # generate, which a caller runs on a prepared cache, runs under no_grad only.
        with torch.inference_mode(False):
            # Filled, not empty: the pages are faulted in now, at allocation,
            # instead of during a timed load (a first write runs ~6x below memcpy speed).
            tensor = torch.zeros(
                (lay.num_layers, lay.kv_parts, 1, lay.num_kv_heads, capacity, lay.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            if self.poisoned:
                poisoning.fill_tensor(tensor)
        return tensor

    def poison(self) -> None:
        """Debug: overwrite every position with NaN (a no-op unless poisoning is on).

        Called before each request: what a load claims to have written must then
        really be written, or the model reads NaN. Positions past the sequence
        length are never read (the cache views stop at the length), so this costs
        nothing but the fill.
        """
        if self.poisoned:
            poisoning.fill_tensor(self.tensor)

    @property
    def capacity(self) -> int:
        return self.tensor.shape[4]

    def ensure_capacity(self, tokens: int) -> None:
        """Grow (doubling) to hold ``tokens`` positions, keeping the data."""
        if tokens <= self.capacity:
            return
        bigger = self._alloc(max(tokens, 2 * self.capacity))
        with torch.inference_mode(False):  # as in _alloc: the storage stays a normal tensor
            bigger[:, :, :, :, : self.capacity].copy_(self.tensor)
        self.tensor = bigger
        for layer in self.layers:
            layer.refresh()

    def raw(self) -> np.ndarray:
        """The storage as a numpy array of same-size integers (bf16 has no numpy dtype)."""
        return self.tensor.view(_RAW_TORCH[self.tensor.element_size()]).numpy()

    def new_cache(self, config) -> DynamicCache:
        """A ``DynamicCache`` for ``config`` whose layers are views of this storage, empty."""
        cache = DynamicCache(config=config)
        # The kinds of layers transformers would cache for this config; not their count, which it
        # reads from fields that name an encoder-decoder config's encoder (BartForCausalLM): the
        # session checks the count the model really writes once, at construction (cache_probe).
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            kinds = sorted({type(layer).__name__ for layer in cache.layers})
            raise ConfigError(
                f"kvtier loads KV into full-attention DynamicLayer caches only; this model's cache has "
                f"{len(cache.layers)} layers of kind {kinds} (sliding-window or hybrid attention is not supported)"
            )
        self.stop_watching()
        self.layers = [StorageLayer(self, i) for i in range(self.layout.num_layers)]
        self.refused = None
        self.untrusted = None
        self.model_change = None
        cache.layers = list(self.layers)
        self.cache = cache
        return cache

    def held_tokens(self) -> int:
        """Positions every layer holds (after a refused append, some layers hold more than others)."""
        return min((layer.length for layer in self.layers), default=0)

    def set_length(self, tokens: int) -> None:
        """Declare positions ``0:tokens`` valid in every layer (after a load)."""
        if tokens > self.capacity:
            raise ValueError(f"length {tokens} exceeds capacity {self.capacity}; call ensure_capacity first")
        for layer in self.layers:
            layer.length = tokens
            layer.refresh()

    def expect_prompt_suffix(self, suffix: np.ndarray, fed_to: FedTo, *, zero_token_types_change_kv: bool) -> None:
        """After a load of a prompt's prefix: every layer's next append must be that of ``suffix``,
        the prompt's uncached tokens, fed once as ids to the modules ``fed_to`` without token types
        that change K/V (see :class:`PromptSuffix`), or it is refused (:meth:`StorageLayer.update`).
        Watching them stops at that append, at the next :meth:`new_cache` or at :meth:`stop_expecting`."""
        self.stop_expecting()
        self.expected = PromptSuffix(suffix, fed_to, zero_token_types_change_kv=zero_token_types_change_kv)
        for layer in self.layers:
            layer.expected = self.expected

    def watch_inputs(self, fed_to: FedTo, *, zero_token_types_change_kv: bool) -> None:
        """Until the next :meth:`new_cache` or :meth:`stop_watching`: check what every forward on the
        current cache is given besides its token ids (:class:`InputsWatch`; ``storage.untrusted``)."""
        self.stop_watching_inputs()
        self.inputs_watch = InputsWatch(self, fed_to, zero_token_types_change_kv=zero_token_types_change_kv)

    def distrust(self, position: int, why: str) -> None:
        """The cache holds K/V that no block key names from ``position`` on (the earliest is kept)."""
        if self.untrusted is None or position < self.untrusted[0]:
            self.untrusted = (position, why)

    def stop_watching_inputs(self) -> None:
        if self.inputs_watch is not None:
            self.inputs_watch.stop_watching()
            self.inputs_watch = None

    def stop_watching(self) -> None:
        """Leave the model without any hook of this storage's (:meth:`stop_expecting`,
        :meth:`stop_watching_inputs`): the model may outlive it."""
        self.stop_expecting()
        self.stop_watching_inputs()

    def stop_expecting(self) -> None:
        """Check no append of the current cache against a prompt's suffix (and leave the module
        it watched without a hook)."""
        if self.expected is not None:
            self.expected.stop_watching()
            self.expected = None
        for layer in self.layers:
            layer.expected = None


class FedTo(NamedTuple):
    """The modules a forward of the model passes its inputs to: ``models``, the model and its base
    model (its ``forward`` takes the caller's keyword arguments), and ``embeddings``, its input
    embeddings (or None), which take the ids alone."""

    models: Sequence[torch.nn.Module]
    embeddings: torch.nn.Module | None


class PromptSuffix:
    """The uncached tokens of a prompt whose prefix was loaded, which the next forward must feed,
    and the ids (and ``token_type_ids``) each thread last fed the modules watched, seen by forward
    pre-hooks on them. A count of positions cannot tell the suffix from another run of as many
    tokens: HF generate's chunked prefill feeds the prompt's first tokens after the loaded ones, in
    a chunk as long as the suffix when ``prefill_chunk_size`` equals its length.

    The session watches the model, its base model and its input embeddings: a forward runs the
    embeddings on its ids whichever of them is called (HF generate, the model called by the
    user, its ``forward`` method or its base model called directly), and the model's (or base
    model's) call records its ``input_ids``, None for a forward of ``inputs_embeds``. The
    embeddings' own calls count only outside such a call: inside it they may embed other things
    (GPT-2 embeds ``token_type_ids`` with its token embeddings, after the ids). The one hole:
    ``inputs_embeds`` passed to the ``forward`` method of a model whose base model it skips (OPT
    calls its decoder) is checked against the ids this thread last embedded. By thread, since
    sessions of other threads may run the same model meanwhile. ``zero_token_types_change_kv``:
    whether ``token_type_ids`` of zeros give other K/V than none (GPT-2: they add an embedding)."""

    def __init__(self, suffix: np.ndarray, fed_to: FedTo, *, zero_token_types_change_kv: bool) -> None:
        self.tokens = torch.from_numpy(np.asarray(suffix, dtype=np.int64))
        self.zero_token_types_change_kv = zero_token_types_change_kv
        self._fed: dict[int, _Fed] = {}  # thread id -> what it last fed
        self._in_model: dict[int, int] = {}  # thread id -> calls of models[] under way
        self._hooks = [module.register_forward_pre_hook(self._note_model_call, with_kwargs=True)
                       for module in fed_to.models]
        # always_call: a forward that raises still leaves the model's call
        self._hooks += [module.register_forward_hook(self._note_model_return, always_call=True)
                        for module in fed_to.models]
        if fed_to.embeddings is not None:
            self._hooks.append(fed_to.embeddings.register_forward_pre_hook(self._note_embedded, with_kwargs=True))

    # Run as Python, never traced: a compiled model runs its modules' hooks inside compiled code,
    # where dynamo would trace these writes (a graph break at get_ident, guards on the ids it saw)
    # instead of simply making them, as it traced the check itself (StorageLayer._check_prompt_suffix).
    @torch.compiler.disable
    def _note_model_call(self, module, args, kwargs) -> None:
        tid = threading.get_ident()
        depth = self._in_model.get(tid, 0)
        self._in_model[tid] = depth + 1
        if depth == 0:  # the outermost call: the caller's own arguments (HF models take input_ids first)
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._fed[tid] = _Fed(_tensor_or_none(ids), _tensor_or_none(kwargs.get("token_type_ids")))

    @torch.compiler.disable
    def _note_model_return(self, module, args, output) -> None:
        tid = threading.get_ident()
        self._in_model[tid] = max(0, self._in_model.get(tid, 0) - 1)

    @torch.compiler.disable
    def _note_embedded(self, module, args, kwargs) -> None:
        tid = threading.get_ident()
        if self._in_model.get(tid, 0) == 0:  # embedded by a forward that skips the model's calls (OPT's)
            self._fed[tid] = _Fed(_tensor_or_none(kwargs.get("input", args[0] if args else None)), None)

    def stop_watching(self) -> None:
        for hook in self._hooks:
            hook.remove()  # idempotent

    def wrong_feed(self, loaded: int, appended: int) -> str | None:
        """What is wrong with a first append of ``appended`` positions after ``loaded`` loaded ones
        on this thread, in words (None: it is the suffix's)."""
        n = self.tokens.numel()
        if appended != n:
            return f"appends {appended} positions after the {loaded} loaded, but the prompt has {loaded + n} tokens"
        fed = self._fed.get(threading.get_ident(), _Fed(None, None))
        if fed.ids is None:
            return (f"feeds {appended} positions after the {loaded} loaded without input_ids (inputs_embeds), "
                    f"which kvtier cannot check against the prompt's tokens")
        if tuple(fed.ids.shape) not in ((n,), (1, n)) or not torch.equal(fed.ids.reshape(-1).to("cpu", torch.int64),
                                                                          self.tokens):
            return (f"feeds {appended} token ids after the {loaded} loaded that are not prompt[{loaded}:] of a "
                    f"{loaded + n}-token prompt")
        return None

    def wrong_token_types(self) -> str | None:
        """What is wrong with the token types this thread's first forward after the load passed, in
        words (None: none that change K/V)."""
        fed = self._fed.get(threading.get_ident(), _Fed(None, None))
        if token_types_change_kv(fed.token_types, self.zero_token_types_change_kv):
            return ("passes token_type_ids, which change every position's K/V (this model embeds them): the "
                    "loaded blocks hold K/V computed without them")
        return None


class _Fed(NamedTuple):
    ids: torch.Tensor | None
    token_types: torch.Tensor | None


def _tensor_or_none(value) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def token_types_change_kv(token_types: torch.Tensor | None, zeros_change_kv: bool) -> bool:
    """Whether a forward given ``token_type_ids`` computes other K/V than one given none: any
    non-zero type does; zeros do in a model that embeds them whatever they are (GPT-2 adds
    ``wte(token_type_ids)``), not in one that takes none as zeros (the BERT family)."""
    return token_types is not None and (zeros_change_kv or bool(token_types.any()))


class InputsWatch:
    """What each forward on a cache a caller prepared was given besides its token ids, checked after
    the forward by forward hooks on the model and its base model (the modules of
    :attr:`FedTo.models`): the first position from which the cache holds K/V other than a block
    keyed by its tokens holds (every position attended, numbered from 0, embedded from its id
    alone) is kept in ``storage.untrusted``, with why; the session saves no block from there on.

    After a miss nothing else checks what the forward was fed, and HF models take much besides
    ``input_ids``: ``inputs_embeds`` (soft prompts, merged image features), ``token_type_ids``
    (GPT-2 adds their embedding), ``position_ids`` or ``cache_position`` that number positions
    otherwise (packed or offset sequences), an ``attention_mask`` that masks positions (the mask
    given to ``save`` may say otherwise). A forward counts when one of its keyword arguments is this
    storage's cache and it appended to it (layer 0's append, :meth:`note_append`, by thread)."""

    def __init__(self, storage: KVStorage, fed_to: FedTo, *, zero_token_types_change_kv: bool) -> None:
        self.storage = storage
        self.zero_token_types_change_kv = zero_token_types_change_kv
        self._appended: dict[int, tuple[int, int]] = {}  # thread id -> (first position, count) of its last append
        self._hooks = [module.register_forward_hook(self._after_forward, with_kwargs=True) for module in fed_to.models]

    def stop_watching(self) -> None:
        for hook in self._hooks:
            hook.remove()  # idempotent

    @torch.compiler.disable  # a compiled forward's layer 0 calls it: as Python, never traced
    def note_append(self, start: int, count: int) -> None:
        """Layer 0 of the storage appends ``count`` positions from ``start`` (this thread's forward)."""
        self._appended[threading.get_ident()] = (start, count)

    # Run as Python, never traced (as PromptSuffix's hooks).
    @torch.compiler.disable
    def _after_forward(self, module, args, kwargs, output) -> None:
        appended = self._appended.get(threading.get_ident())
        if appended is None or not any(value is self.storage.cache for value in kwargs.values()):
            return  # a forward of another cache (or none): a reference run of the caller's
        untrusted = self.first_untrusted(*appended, args, kwargs)
        if untrusted is not None:
            self.storage.distrust(*untrusted)

    def first_untrusted(self, start: int, count: int, args, kwargs) -> tuple[int, str] | None:
        """The first position of ``start .. start + count - 1`` whose K/V no block key names, given the
        forward's arguments, and why; None if every one is its token's."""
        found: list[tuple[int, str]] = []
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None and kwargs.get("inputs_embeds") is not None:
            found.append((start, "a forward fed inputs_embeds, not input_ids: K/V of embeddings that the "
                                 "token ids passed to save() do not name"))
        token_types = _tensor_or_none(kwargs.get("token_type_ids"))
        if token_types_change_kv(token_types, self.zero_token_types_change_kv):
            found.append((start, "a forward passed token_type_ids, which change every position's K/V (this "
                                 "model embeds them) and are no part of a block's key"))
        for name in ("position_ids", "cache_position"):
            off = _first_misnumbered(kwargs.get(name), start, count)
            if off is not None:
                found.append((start + off, f"a forward passed {name} that do not number its {count} positions "
                                           f"{start}..{start + count - 1}: keys rotated for other positions"))
        masked = _first_masked(kwargs.get("attention_mask"), start, count)
        if masked is not None:
            found.append(masked)
        return min(found, key=lambda item: item[0], default=None)


def _first_misnumbered(positions, start: int, count: int) -> int | None:
    """The index of the first of ``count`` positions that ``positions`` (None: the default) numbers
    otherwise than ``start, start + 1, ...``; 0 when it cannot be read so (another shape, M-RoPE's
    three rows)."""
    if not isinstance(positions, torch.Tensor):
        return None
    if positions.dim() > 2 or positions.numel() != count:
        return 0
    wrong = torch.nonzero(positions.reshape(-1).cpu() != torch.arange(start, start + count))
    return int(wrong[0, 0]) if wrong.numel() else None


def _first_masked(mask, start: int, count: int) -> tuple[int, str] | None:
    """The first position whose K/V ``mask`` (a forward's ``attention_mask``, aligned with the end of
    its positions, as HF extends it) makes other than the block's (it or a position before it
    masked; positions before ``start`` were written by earlier forwards), and why."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() > 2 or (mask.dim() == 2 and mask.shape[0] != 1):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        return start, (f"a forward passed an attention_mask of shape {shape}: kvtier reads a (1, tokens) mask "
                       f"only, so what this one masks is unknown")
    zeros = torch.nonzero(mask.reshape(-1) == 0)
    if not zeros.numel():
        return None
    at = start + count - mask.numel() + int(zeros[0, 0])
    return max(at, start), (f"a forward's attention_mask masks position {at}, which the mask given to save() "
                            f"attends: K/V computed under another mask than a block's")


class StorageLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a :class:`KVStorage`; appends in place."""

    def __init__(self, storage: KVStorage, index: int) -> None:
        super().__init__()
        self.storage = storage
        self.index = index
        self.length = 0
        #: what the next append must be (:meth:`KVStorage.expect_prompt_suffix`); None: anything
        self.expected: PromptSuffix | None = None
        self.device = storage.device
        self.is_initialized = True
        self.refresh()

    def refresh(self) -> None:
        t = self.storage.tensor
        self.keys = t[self.index, 0, :, :, : self.length]
        self.values = t[self.index, 1, :, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the storage exists already

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append K/V of the layout's shape and the storage's dtype in place; anything else raises
        :class:`LayoutError` before a byte is copied, and marks the storage refused (nothing of
        this cache is saved). So does a first append after a load that is not the prompt's
        uncached suffix, by count and by token ids (:meth:`KVStorage.expect_prompt_suffix`). A forward
        of a model changed since the cache was prepared marks it refused (``storage.model_change``)."""
        lay = self.storage.layout
        want = (1, lay.num_kv_heads, key_states.shape[-2], lay.head_dim)
        if tuple(key_states.shape) != want or tuple(value_states.shape) != want:
            # copy_ would broadcast (one head into N, a batch into one): wrong KV, saved under real keys.
            self._refuse(
                f"layer {self.index} appends K {tuple(key_states.shape)} and V {tuple(value_states.shape)}, but "
                f"the cache holds (batch 1, {lay.num_kv_heads} KV heads, tokens, {lay.head_dim}): one sequence "
                f"of the namespace's layout (no beam search or batch; a namespace of this model)")
        dtype = self.storage.dtype
        if key_states.dtype != dtype or value_states.dtype != dtype:
            # copy_ would convert: KV computed in bf16 (autocast, a layer of another dtype) saved under
            # the namespace of fp32 KV, and served to requests that computed none of it.
            self._refuse(
                f"layer {self.index} appends K of {key_states.dtype} and V of {value_states.dtype}, but the "
                f"namespace holds {dtype} KV (autocast, or a model whose layers differ in dtype from its "
                f"first parameter); run the model in one dtype, without autocast")
        if self.expected is not None:
            self._check_prompt_suffix(key_states.shape[-2])
        if self.index == 0 and self.storage.model_change is not None:
            self._check_model()
        if self.index == 0 and self.storage.inputs_watch is not None:
            self.storage.inputs_watch.note_append(self.length, key_states.shape[-2])
        end = self.length + key_states.shape[-2]
        self.storage.ensure_capacity(end)
        t = self.storage.tensor
        t[self.index, 0, :, :, self.length : end].copy_(key_states)
        t[self.index, 1, :, :, self.length : end].copy_(value_states)
        self.length = end
        self.refresh()
        return self.keys, self.values

    @torch.compiler.disable
    def _check_prompt_suffix(self, appended: int) -> None:
        """The first append after a load must be the K/V of the prompt's uncached tokens: HF generate
        in some modes feeds the whole prompt again after the loaded prefix (or its first tokens, in
        chunks), and appended there their K/V would sit at positions (and carry the RoPE) of other
        tokens: wrong logits now, wrong blocks saved under real keys. Later appends (decode steps)
        are not checked: the hook goes now.

        Run as Python, never traced (a compiled model's forward calls it: a graph break, on the first
        forward after a load only, since decode steps see ``expected`` None). Traced, dynamo decided
        the check once per graph from what it saw while tracing: after suffixes of several lengths it
        made the length symbolic, and ``(1, 1) in ((n,), (1, n))`` with ``n`` symbolic and 1 came
        out False, so a compiled model refused every 1-token suffix (a fully cached prompt)."""
        expected, self.expected = self.expected, None
        expected.stop_watching()
        wrong = expected.wrong_feed(self.length, appended)
        if wrong is not None:
            self._refuse(
                f"layer {self.index}: the first forward after prepare() {wrong}: feed prompt[{self.length}:] only, "
                f"as input_ids. HF generate feeds the whole prompt again after a loaded prefix with assisted or "
                f"prompt-lookup decoding (assistant_model, prompt_lookup_num_tokens) or prefill_chunk_size: drop "
                f"those options, or pass use_store=False to prepare() for such requests")
        wrong = expected.wrong_token_types()
        if wrong is not None:
            self._refuse(f"layer {self.index}: the first forward after prepare() {wrong}; pass no token_type_ids "
                         f"after a loaded prefix, or pass use_store=False to prepare() for such requests")

    # Run as Python, never traced (as _check_prompt_suffix): a graph break in a compiled forward.
    @torch.compiler.disable
    def _check_model(self) -> None:
        """Mark the cache refused if the model changed since it was prepared (``storage.model_change``):
        the caller's code runs between prepare and save (a PEFT ``disable_adapter()`` context around
        its forward, weights loaded and loaded back), so a model the same at both may have computed
        other K/V in between. Once per forward (layer 0), whichever module the caller ran."""
        storage = self.storage
        if storage.refused is None and (change := storage.model_change()) is not None:
            storage.refused = (f"the model changed during this request ({change}): the cache may hold another "
                               f"model's K/V than the namespace's")
            storage.model_change = None  # refused for good: no need to ask again

    def _refuse(self, why: str):
        self.storage.refused = why
        raise LayoutError(why)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove (transformers' convention)")
        self.length = max(0, self.length + tokens_to_remove)
        self.refresh()

    def reset(self) -> None:
        self.length = 0
        self.refresh()


class LoadReport(NamedTuple):
    """``blocks`` leading blocks were copied into the storage; ``bytes_by_tier`` says from where."""

    blocks: int
    bytes_by_tier: dict[str, int]
    seconds: float


class Staging:
    """A reusable page-aligned buffer for reads from slower tiers (allocating and
    faulting in a fresh one per load would cost more than the copy it serves).

    A load takes regions one after another (:meth:`take`), never the same bytes
    twice, so that each read gets memory no other read of the load wrote.
    With poisoning on (debug), every region is handed out filled with the
    poison pattern: a read that reports success without writing is then caught
    instead of passing on earlier bytes. The fill happens in :meth:`poison`
    (the session calls it before a request, untimed) and when a buffer is
    allocated (:meth:`reserve`, before the load's timer): a debug aid must not
    be measured as load time.
    """

    def __init__(self, *, poison: bool | None = None) -> None:
        self._buf: np.ndarray | None = None
        self._used = 0  # bytes handed out since the last rewind
        self._dirty = 0  # bytes [0, _dirty) handed out since the last poison fill
        self.poisoned = poisoning.enabled(poison)

    def poison(self) -> None:
        """Start over: refill what was handed out (debug poisoning on), hand out from the start."""
        if self.poisoned and self._buf is not None and self._dirty:
            poisoning.fill_bytes(self._buf[: self._dirty])
        self._dirty = self._used = 0

    def reserve(self, nbytes: int) -> None:
        """Make :meth:`take` of ``nbytes`` in all, from the start, need no allocation."""
        if self._buf is None or self._buf.nbytes < nbytes:
            self._buf = self._fresh(nbytes)
            self._dirty = self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """The next ``nbytes`` of staging (poisoned if poisoning is on)."""
        if self._dirty and self._used == 0:
            self.poison()  # a caller that did not poison between loads: refill now
        if self._buf is None or self._used + nbytes > self._buf.nbytes:
            # The regions handed out keep the old buffer alive; start a bigger one.
            self._buf = self._fresh(max(nbytes, 2 * (self._buf.nbytes if self._buf is not None else 0)))
            self._dirty = self._used = 0
        region = self._buf[self._used : self._used + nbytes]
        self._used += nbytes
        self._dirty = max(self._dirty, self._used)
        return region

    def rewind(self) -> None:
        """The load is over: the next one takes from the start (refilled first if poisoning is on)."""
        self._used = 0

    def _fresh(self, nbytes: int) -> np.ndarray:
        buf = _aligned(nbytes)
        if self.poisoned:
            poisoning.fill_bytes(buf)
        return buf


def load_blocks(
    store: TieredStore, keys: Sequence[BlockKey], storage: KVStorage, staging: Staging | None = None
) -> LoadReport:
    """Copy the blocks of ``keys`` (a chain from the first block) into positions ``0..``.

    Runs of blocks in a plain host tier are copied straight from their pinned
    slots; runs of other blocks are read by the store (which verifies them, and
    promotes them in the background) into page-aligned staging, then copied.
    The reads start first, on the store's I/O threads, and the host runs are
    copied on this thread while they are in flight: a load whose recent blocks
    sit in DRAM and older ones on disk takes about the longer of the two, not
    their sum. Stops at the first block no tier can serve: later blocks are
    useless without it (copies made past it are harmless). ``staging`` should be
    poisoned / reserved by the caller before (see :class:`Staging`); the timer
    covers the load only.
    """
    start = time.perf_counter()
    layout = storage.layout
    nbytes = layout.block_nbytes
    storage.ensure_capacity(len(keys) * layout.block_tokens)
    raw = storage.raw()
    host = store.tiers[0] if isinstance(store.tiers[0], HostTier) else None
    staging = staging or Staging(poison=storage.poisoned)
    # Promotions of what this load reads wait until the whole load is over (not only
    # each span's get): their reads would compete with ours.
    with store.reading():
        lower = _LowerReads(store, keys, raw, layout, staging)
        try:
            segments = _host_segments(host, keys)
            for in_host, a, b in segments:
                if not in_host:
                    lower.add(a, b)
            copied: list[tuple[int, int]] = []  # host runs copied: (first block, blocks)
            for in_host, a, b in segments:
                i = a
                while in_host and i < b:
                    before = i
                    with host.borrow_runs(keys[i:b], nbytes) as runs:
                        for run in runs:  # one copy per run of blocks adjacent in the pool
                            n = run.nbytes // nbytes
                            _place_run(raw, i, run, n, layout)
                            copied.append((i, n))
                            i += n
                    if i == before:  # evicted since the plan: the store finds the rest below (or not)
                        lower.add(i, b)
                        break
            served = lower.finish()
        finally:
            lower.close()
            staging.rewind()
    by_tier: dict[str, int] = {}
    host_bytes = sum(min(n, served - i) for i, n in copied if i < served) * nbytes
    if host_bytes:
        by_tier[host.name] = host_bytes
    for tier, n in lower.bytes_by_tier(served).items():  # the store may serve some from the host tier too
        by_tier[tier] = by_tier.get(tier, 0) + n
    return LoadReport(served, by_tier, time.perf_counter() - start)


def _host_segments(host: HostTier | None, keys: Sequence[BlockKey]) -> list[tuple[bool, int, int]]:
    """``(in_host, a, b)``: ``keys`` cut where the host tier starts or stops holding them (a run
    it holds is found under one hold of its lock: a load from DRAM alone pays one pass)."""
    segments: list[tuple[bool, int, int]] = []
    i, n = 0, len(keys)
    while i < n:
        held = host.lookup_prefix(keys[i:]) if host is not None else 0
        if held:
            segments.append((True, i, i + held))
            i += held
            continue
        j = i + 1
        while j < n and not (host is not None and host.contains(keys[j])):
            j += 1
        segments.append((False, i, j))
        i = j
    return segments


def read_spans(n: int, most: int, lanes: int, unit: int = 1) -> list[tuple[int, int]]:
    """``n`` blocks cut into spans ``(a, b)`` of at most ``most`` blocks, in whole units of ``unit``
    blocks (the disk tier reads a packed span in requests of ``unit`` blocks: a span of whole units
    costs no extra request) but the last, as equal as they go, in a count that ``lanes`` reads in
    flight share evenly (when there are enough units): cut in ``most`` from the start, the last lane
    to finish could be left reading a whole span while the others idle, and its span's verifying
    and placing would be all the longer after the last read."""
    unit = max(1, min(unit, most))
    units = -(-n // unit)
    count = -(-units // (most // unit))
    if units >= lanes:
        count = -(-count // lanes) * lanes
    size, extra = divmod(units, count) if count else (0, 0)
    spans, a = [], 0
    for k in range(count):
        b = min(n, a + (size + (k < extra)) * unit)
        spans.append((a, b))
        a = b
    return spans


class _LowerReads:
    """The blocks of a load that the host tier lacks, read through the store in spans on its I/O
    threads (two in flight, more queued behind them) into ``staging``, each block placed into the
    storage as soon as its tier has verified it, on the thread that verified it (a disk tier: each
    request's blocks while it reads the next), so that placing hides behind the reads and the
    last span leaves only its last request's blocks to place. A block placed past a miss is
    harmless: the cache stops at the miss."""

    def __init__(self, store: TieredStore, keys: Sequence[BlockKey], raw: np.ndarray, layout: KVLayout,
                 staging: Staging) -> None:
        self.store, self.keys, self.raw, self.layout, self.staging = store, keys, raw, layout, staging
        self.nbytes = layout.block_nbytes
        self.spans: deque = deque()  # (a, b, first, buf, outs) not yet handed to the store
        self.running: dict = {}  # future -> (a, b)
        self.results: list[tuple[int, object]] = []  # (a, result) of each span read
        self.served = len(keys)

    def add(self, a: int, b: int) -> None:
        """Read blocks ``a .. b - 1`` of the load."""
        nbytes = self.nbytes
        buf = self.staging.take((b - a) * nbytes)
        outs = [buf[k * nbytes : (k + 1) * nbytes] for k in range(b - a)]
        for s, e in read_spans(b - a, max(1, READ_CHUNK_BYTES // nbytes), READS_IN_FLIGHT, run_request_blocks(nbytes)):
            self.spans.append((a + s, a + e, a, buf, outs))
        self._top_up()

    def _top_up(self) -> None:
        while self.spans and len(self.running) < READS_IN_FLIGHT + SPANS_AHEAD:
            a, b, first, buf, outs = self.spans.popleft()
            if a >= self.served:
                continue  # past a miss: useless
            segment = outs[a - first : b - first]
            future = self.store.get_async(
                self.keys[a:b], segment, promote_in_background=True,
                on_ready=lambda ready, payloads, a=a, first=first, buf=buf, outs=outs: self._place(
                    a, first, buf, outs, ready, payloads))
            self.running[future] = (a, b)

    def _place(self, a: int, first: int, buf: np.ndarray, outs: list, ready: list[int], payloads: list) -> None:
        for s, e, run in _runs([a - first + i for i in ready], payloads, outs, buf, self.nbytes):
            _place_run(self.raw, first + s, run, e - s, self.layout)

    def finish(self) -> int:
        """Wait for every read; the blocks served from the load's start (up to the first miss)."""
        while self.running:
            finished, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
            for future in finished:
                a, b = self.running.pop(future)
                result = future.result()
                self.results.append((a, result))
                if result.loaded < b - a:
                    self.served = min(self.served, a + result.loaded)  # later spans are useless past a miss
            self._top_up()
        return self.served

    def close(self) -> None:
        """Never leave a read writing into staging the next load takes (after an error, say)."""
        self.spans.clear()
        for future in self.running:
            if not future.cancel():
                future.exception()
        self.running.clear()

    def bytes_by_tier(self, served: int) -> dict[str, int]:
        by_tier: dict[str, int] = {}
        for a, result in self.results:
            for k in range(min(result.loaded, served - a)):
                tier = result.tiers[k] or "?"
                by_tier[tier] = by_tier.get(tier, 0) + self.nbytes
        return by_tier


def _runs(indices: list[int], payloads: list[np.ndarray], outs: Sequence[np.ndarray], buf: np.ndarray,
          nbytes: int) -> list[tuple[int, int, np.ndarray]]:
    """``(s, e, bytes)``: blocks ``s .. e - 1`` to place with one copy. Blocks handed over in
    their own ``outs`` (slices of ``buf`` back to back) join runs; blocks a tier handed over from
    its staging go one by one."""
    runs: list[tuple[int, int, np.ndarray]] = []
    for i, payload in sorted(zip(indices, payloads), key=lambda pair: pair[0]):
        if payload is not outs[i]:
            runs.append((i, i + 1, payload))
        elif runs and runs[-1][1] == i and runs[-1][2] is buf:
            runs[-1] = (runs[-1][0], i + 1, buf)
        else:
            runs.append((i, i + 1, buf))
    return [(s, e, buf[s * nbytes : e * nbytes] if run is buf else run) for s, e, run in runs]


def _place_run(raw: np.ndarray, first: int, run: np.ndarray, n: int, layout: KVLayout) -> None:
    """Blocks ``first .. first + n - 1`` from ``run``, ``n`` canonical blocks back to back (bytes)."""
    lay = layout
    bt = lay.block_tokens
    src = run.view(raw.dtype).reshape(n, *lay.block_shape).transpose(1, 2, 3, 0, 4, 5)
    dst = raw[:, :, 0, :, first * bt : (first + n) * bt, :]
    # Assigning the shape (not reshape) raises rather than copy: the copy must land in the storage.
    dst.shape = (lay.num_layers, lay.kv_parts, lay.num_kv_heads, n, bt, lay.head_dim)
    np.copyto(dst, src)


def gather_blocks(storage: KVStorage, first_block: int, n_blocks: int) -> list[np.ndarray]:
    """Canonical copies of blocks ``first_block .. first_block + n_blocks - 1`` (caller owns them).

    One strided copy into a page-aligned buffer, so that a disk tier writes the
    blocks without another copy.
    """
    layout = storage.layout
    bt = layout.block_tokens
    nbytes = layout.block_nbytes
    if n_blocks <= 0:
        return []
    raw = storage.raw()
    lay = layout
    buf = _aligned(n_blocks * nbytes)
    dst = buf.view(raw.dtype).reshape(n_blocks, lay.num_layers, lay.kv_parts, lay.num_kv_heads, bt, lay.head_dim)
    src = raw[:, :, 0, :, first_block * bt : (first_block + n_blocks) * bt, :]
    src = src.reshape(lay.num_layers, lay.kv_parts, lay.num_kv_heads, n_blocks, bt, lay.head_dim)
    np.copyto(dst, src.transpose(3, 0, 1, 2, 4, 5))
    return [buf[k * nbytes : (k + 1) * nbytes] for k in range(n_blocks)]


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (O_DIRECT tiers read into and write from it without staging),
    on huge pages when large (a direct read's speed depends on it: :func:`~kvtier.tiers.direct_io.io_buffer`)."""
    from kvtier.tiers.direct_io import io_buffer

    return io_buffer(nbytes)

