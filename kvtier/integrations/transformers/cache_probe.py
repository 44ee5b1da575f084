"""What a model really caches, and whether it can resume from a cache: checked once when a
:class:`~.session.KVTierLM` is built.

The KV layout comes from the model's config (:func:`~.namespace.kv_layout`), and a config can
say one thing while the model does another: a config field the layout code does not read
(CPM-Ant's ``dim_head``), an encoder-decoder config whose generic fields name the encoder
while the causal LM runs the decoder, a layer that skips its attention. And a model can cache
the right shapes yet not take what kvtier feeds it: the uncached suffix of a prompt after a
loaded prefix. XLM wants the whole sequence with a cache and drops the cached part itself
(fed the suffix alone, it drops it a second time: silently wrong logits, or a shape error);
ProphetNet's decoder asserts one new token per cached forward; an attention that sees the
tokens after a position (Gemma's ``use_bidirectional_attention``, BERT as an encoder) gives a
prefix K/V that depends on what follows. Found at the first request, such a model fails every
hit or, worse, serves wrong logits. So the session runs the model once on a few tokens at
construction, as vLLM runs a dummy batch before it serves: the whole prompt without a cache,
then its first tokens into a fresh ``DynamicCache`` and the rest as a suffix after them. What
the prefix cached must have the layout's shape in each of its layers, and the logits of both
parts must be the whole run's; otherwise the service fails at start with a :class:`ConfigError`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError

#: the probe prompt: a handful of tokens, so the check costs three forward passes of a few tokens
#: (~50 ms for a 2-layer toy model; about a short prefill's time for a real one)
PROBE_TOKENS = 8
#: how many of them go into the fresh cache first; the other 5 are the suffix (a suffix of 2 or
#: more: ProphetNet takes one token after a cache, never a longer suffix)
PREFIX_TOKENS = 3
#: probe ids are drawn from the vocabulary's first ids: image and other placeholder tokens, which a
#: forward on ids alone may treat otherwise, sit at its end (Fuyu's, Gemma 3's)
_PROBE_ID_RANGE = 1024

#: The largest difference allowed between the split run and the whole run, as a fraction of the
#: largest |logit| of the whole run. A servable model shows rounding only: over the 107
#: configurations served in audit s29 a6 (tiny random models, weights init 0.1) at most 1.0e-6 in
#: float32, 9.2e-4 in float16 and 5.4e-3 in bfloat16 (the split run sums attention in another
#: order and shape). What must be refused is far above: a bidirectional Gemma 0.26-0.91, a BERT
#: or RoBERTa encoder 0.37-0.59 (all with their config refusals switched off), in every dtype;
#: XLM and ProphetNet fail on shape or raise. So float32 is held to ~1000x its rounding, and the
#: half-precision dtypes to ~20-30x theirs, which leaves a deep real model's larger rounding room
#: (a false refusal would lock a servable model out) while staying well under the smallest wrong
#: case.
_RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 0.03, torch.bfloat16: 0.1}
_DEFAULT_TOLERANCE = 0.1


def check_model_cache(model, cache_keyword: str, layout: KVLayout, *, avoid_ids=frozenset()) -> None:
    """Raise :class:`ConfigError` unless ``model`` caches K and V of ``layout``'s shape in exactly
    ``layout.num_layers`` layers and resumes from a cache as kvtier feeds it: the logits of a
    prompt's first :data:`PREFIX_TOKENS` into a fresh cache and of the rest fed after them equal
    (within the dtype's rounding, :data:`_RELATIVE_TOLERANCE`) those of the whole prompt run
    without a cache. An exception raised by the model on the way is a :class:`ConfigError` too.

    Runs once per call (a session's construction): three forward passes, of the 8 probe tokens
    whole, then of 3 and of 5, under ``no_grad`` with autocast off (autocast is the
    caller's state, checked per request), in eval mode (the model's own mode is restored after).
    The probe's ids are fixed and valid for the vocabulary, none of ``avoid_ids`` (pad ids: a
    model numbering positions past them, or a mask, would make a different run of them). A plain
    ``DynamicCache`` takes the appends: it grows a layer for any index the model writes (so a
    model with more layers than the layout shows them instead of raising ``IndexError``), and
    checks neither shape nor dtype (the dtype stays the request's check, ``StorageLayer.update``).
    """
    name = _model_name(model)
    ids = probe_ids(_vocab_size(model), avoid_ids, next(model.parameters()).device)
    cache = DynamicCache()
    # The cached runs pass what a request passes (the cache, use_cache, logits_to_keep: 0 keeps every
    # position), so a model refusing one of them is refused here, not at its first request.
    cached = {cache_keyword: cache, "use_cache": True, "logits_to_keep": 0}
    with probing(model):
        whole = _logits(model, name, "the whole probe prompt without a cache", input_ids=ids, use_cache=False)
        head = _logits(model, name, f"the first {PREFIX_TOKENS} probe tokens into a fresh cache",
                       input_ids=ids[:, :PREFIX_TOKENS], **cached)
        _check_geometry(cache, layout, PREFIX_TOKENS)
        tail = _logits(model, name, f"the last {PROBE_TOKENS - PREFIX_TOKENS} probe tokens after a cache of "
                       f"{PREFIX_TOKENS}", input_ids=ids[:, PREFIX_TOKENS:], **cached)
    tolerance = _RELATIVE_TOLERANCE.get(next(model.parameters()).dtype, _DEFAULT_TOLERANCE)
    _check_same_logits(name, "the prefix run into a fresh cache", head, whole[:, :PREFIX_TOKENS], whole, tolerance)
    _check_same_logits(name, "the suffix run after the cached prefix", tail, whole[:, PREFIX_TOKENS:], whole,
                       tolerance)


def zero_token_types_change_logits(model, *, avoid_ids=frozenset()) -> bool:
    """Whether ``model``'s logits of the probe tokens given ``token_type_ids`` of zeros differ from
    those given none: GPT-2 and kin embed the types with their token embeddings and add them, zeros
    too, so any ``token_type_ids`` a forward passes change its K/V; the BERT family takes none as
    zeros. False for a model whose forward takes no ``token_type_ids``. One forward of the probe
    (two when the model takes them), under ``no_grad``; a forward that raises counts as a change."""
    forward = getattr(model, "_orig_mod", model).forward
    if "token_type_ids" not in inspect.signature(forward).parameters:
        return False
    ids = probe_ids(_vocab_size(model), avoid_ids, next(model.parameters()).device)
    with probing(model):
        try:
            plain = model(input_ids=ids, use_cache=False).logits
            typed = model(input_ids=ids, token_type_ids=torch.zeros_like(ids), use_cache=False).logits
        except Exception:  # noqa: BLE001 -- a model that cannot take them: any passed are refused
            return True
    return not torch.equal(plain, typed)


def is_compiled(model) -> bool:
    """Whether some of ``model`` runs compiled by dynamo: a ``torch.compile`` wrapper, a module
    compiled in place (``module.compile()``) or a ``forward`` replaced by a compiled one."""
    if hasattr(model, "_orig_mod"):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None
               or hasattr(getattr(m, "forward", None), "_torchdynamo_orig_callable") for m in model.modules())


def check_compiled_hit(model, cache_keyword: str, new_cache, expect_suffix, *, avoid_ids=frozenset()) -> None:
    """Raise :class:`ConfigError` if ``model`` (compiled: :func:`is_compiled`) cannot run what a
    cache hit runs: the probe tokens into ``new_cache()`` after ``expect_suffix(tokens)`` (the
    session's checks of the first forward after a load: forward pre-hooks and checks in the cache's
    ``update``, plain Python that dynamo does not trace). One forward: what it checks does not
    depend on how many positions were loaded before it (none here).

    Those checks are a graph break inside a compiled forward, which ``fullgraph=True`` (or
    ``torch._dynamo.error_on_graph_break``) forbids: such a model passed the probe and served
    misses, then raised at every hit. Found here, at construction, instead. Only that is refused:
    anything else the rehearsal raises, a request raises too, with its own error (the caller
    cleans up what ``expect_suffix`` set, whatever happens)."""
    from torch._dynamo.exc import Unsupported

    ids = probe_ids(_vocab_size(model), avoid_ids, next(model.parameters()).device)
    cache = new_cache()
    with probing(model):
        try:
            expect_suffix(ids[0].cpu().numpy())
            model(input_ids=ids, **{cache_keyword: cache}, use_cache=True, logits_to_keep=1)
        except Unsupported as e:
            raise ConfigError(
                f"{_model_name(model)} is compiled with fullgraph=True (or under error_on_graph_break): "
                f"kvtier checks the first forward after a cache load in Python (the fed ids against the "
                f"prompt's suffix, the weights), a graph break that fullgraph forbids, so every cache hit "
                f"would raise. Compile without fullgraph (torch.compile(model)) to serve it with kvtier "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        except Exception:  # noqa: BLE001, S110 -- a request raises it again, with its own error
            pass


def probe_ids(vocab_size: int, avoid_ids, device) -> torch.Tensor:
    """:data:`PROBE_TOKENS` fixed token ids (a (1, n) tensor) below ``vocab_size`` and
    :data:`_PROBE_ID_RANGE`, none of ``avoid_ids``; the global RNGs are not touched."""
    candidates = np.setdiff1d(np.arange(min(vocab_size, _PROBE_ID_RANGE)), np.fromiter(avoid_ids, np.int64))
    if candidates.size == 0:
        raise ConfigError(f"the model's vocabulary of {vocab_size} holds no token besides its pad ids "
                          f"{sorted(avoid_ids)}; kvtier cannot serve it")
    picks = np.random.default_rng(0).integers(0, candidates.size, PROBE_TOKENS)
    return torch.from_numpy(candidates[picks].astype(np.int64)).unsqueeze(0).to(device)


def _vocab_size(model) -> int:
    """The number of ids the model embeds (Marian's decoder vocabulary, not its config's shared one)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return int(text.vocab_size)


def _model_name(model) -> str:
    source = getattr(model.config, "_name_or_path", "") or ""
    return f"{type(model).__name__}" + (f" ({source})" if source else "")


@contextmanager
def probing(model):
    """Eval mode, no autograd, no autocast, for a probe; the model's mode is restored after."""
    training = model.training
    model.eval()
    device = next(model.parameters()).device.type
    try:
        with torch.no_grad(), torch.autocast(device, enabled=False):
            yield
    finally:
        model.train(training)


def _logits(model, name: str, what: str, **inputs) -> torch.Tensor:
    """The float32 logits of ``model(**inputs)``; any exception the model raises is a ConfigError:
    kvtier runs the same forward at every request."""
    try:
        out = model(**inputs)
    except Exception as e:  # noqa: BLE001 -- whatever the model raises, it would raise at every request
        raise ConfigError(f"{name} raised {type(e).__name__} on {what} (kvtier's check of how the model "
                          f"resumes from a KV cache, run at construction): {e}; kvtier cannot serve this "
                          f"model") from e
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def _check_geometry(cache: DynamicCache, layout: KVLayout, tokens: int) -> None:
    """Raise :class:`ConfigError` unless ``cache`` holds K and V of ``tokens`` positions in the layout's
    shape in each of exactly ``layout.num_layers`` layers."""
    want = (1, layout.num_kv_heads, tokens, layout.head_dim)
    fix = ("kvtier read this layout from the model's config; the model computes another, so blocks "
           "would be misread or never saved. kvtier's transformers integration cannot serve it")
    if len(cache.layers) != layout.num_layers:
        raise ConfigError(f"the model wrote {len(cache.layers)} cache layers, its KV layout has "
                          f"{layout.num_layers} ({layout}); {fix}")
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            raise ConfigError(f"the model never wrote cache layer {i} of {layout.num_layers} (a layer "
                              f"without attention, or one sharing another's KV); {fix}")
        got = (tuple(layer.keys.shape), tuple(layer.values.shape))
        if got != (want, want):
            raise ConfigError(
                f"cache layer {i} holds K {got[0]} and V {got[1]} for {tokens} tokens, the KV layout "
                f"(batch 1, {layout.num_kv_heads} KV heads, tokens, {layout.head_dim}) {want}; {fix}")


def _check_same_logits(name: str, what: str, got: torch.Tensor, want: torch.Tensor, whole: torch.Tensor,
                       tolerance: float) -> None:
    """Raise :class:`ConfigError` unless ``got`` has ``want``'s shape and differs from it by at most
    ``tolerance`` × the whole run's largest finite |logit| (non-finite values must match)."""
    why = ("so a hit would not give what a recompute gives (a model that wants the whole sequence "
           "with a cache, that numbers or masks a suffix otherwise, or whose attention sees later "
           "tokens); kvtier cannot serve it")
    if got.shape != want.shape:
        raise ConfigError(f"{name}: {what} gave logits of shape {tuple(got.shape)}, the whole run's same "
                          f"positions {tuple(want.shape)}, {why}")
    finite = whole[torch.isfinite(whole)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    scale = scale or 1.0
    if not torch.isclose(got, want, rtol=0.0, atol=tolerance * scale, equal_nan=True).all():
        diff = float(torch.nan_to_num((got - want).abs(), nan=float("inf")).max())
        raise ConfigError(f"{name}: {what} gave other logits than the whole prompt run without a cache "
                          f"(max |difference| {diff:.3g}, {diff / scale:.3g} of the largest |logit| "
                          f"{scale:.3g}; rounding allows {tolerance:g}), {why}")
