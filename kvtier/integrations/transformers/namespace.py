"""The namespace of a Hugging Face causal LM: layout from its config, identity from its weights.

What makes two KV caches interchangeable is the same weights, the same config
(geometry, RoPE, norms, ...) and the same bytes layout. The weights identity is
*exact*: the SHA-256 of every byte of every ``*.safetensors`` file, combined
with the file names and sizes. A sample of the bytes would not do: a partial
fine-tune that changes a few MB between the samples would get the base model's
identity and load its KV (wrong outputs). Hashing costs seconds for a large
model (README, "Hugging Face transformers"), once: the digests are cached by
file identity (:mod:`.weights_hash`), so a restart reads nothing. Or give
``weights_revision`` (a revision you trust) and nothing is hashed. The identity
is content-derived, so two machines holding the same files agree on it (a
shared tier needs that), unlike a path or an mtime.

The files are not the whole story: a model can be changed after loading (PEFT's
``merge_and_unload()`` adds a LoRA into the q/v projections in memory) while its
config still names the base model's directory. So a digest of the weights as they
are in memory (:func:`loaded_weights_digest`) joins the files' identity: a merged
model gets a namespace of its own, never its base model's KV; so does the adapter that PEFT's
injected layers apply (:func:`adapter_states`), which no weight says. A namespace given to a
session is checked against the model it serves (:func:`refuse_foreign_namespace`), and
weights changed in place once the session is built are refused at its next request
(:mod:`.weights_watch`).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

import hashlib

import xxhash

from kvtier.core.framing import frame_int, frame_str
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.errors import ConfigError
from kvtier.integrations.transformers.weights_hash import HASH_NAME, WeightsDigests

#: Tokens per block. Only full blocks are stored, so every request recomputes
#: its partial last block: half a block on average. A chat or agent turn often
#: appends a few dozen tokens (a resumed session ~12); with 32-token blocks it
#: would compute ~28, with 16 ~20, and on a CPU a forward pass costs about 0.1 s
#: plus ~4 ms a token, so the block size is a visible part of a resume. A
#: 16-token block of a 92 M-parameter fp32 model is still 256 KiB: the disk tier
#: reads it at the same GiB/s as 512 KiB ones here, the host tier copies it at
#: memcpy speed, and 4 k tokens are 256 keys, hashed and looked up in well under
#: a millisecond. (The store's default of 256 suits long documents, not turns;
#: 16 is also vLLM's default page on GPUs.)
DEFAULT_BLOCK_TOKENS = 16

#: the identity's version and hash (a new scheme gives new namespaces: old blocks are never reused)
IDENTITY_PREFIX = f"st2:{HASH_NAME}:"
#: joins the files' identity and the loaded weights' digest in a derived weights_revision
_MEM_MARK = "+mem:"
#: the most a safetensors JSON header may hold (the format's own limit is 100 MB)
_MAX_HEADER = 100 << 20

#: torch dtype name → KVLayout dtype name
TORCH_TO_LAYOUT_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}

# Config fields that do not change what a token's KV is; everything else is
# fingerprinted (an unknown field changes the namespace: a cache may lose, never be wrong).
_VOLATILE_CONFIG_FIELDS = frozenset({
    "_name_or_path", "transformers_version", "architectures", "id2label", "label2id",
    "output_hidden_states", "output_attentions", "return_dict", "use_cache", "dtype",
    "torch_dtype", "problem_type", "chunk_size_feed_forward", "pad_token_id", "bos_token_id",
    "eos_token_id", "_attn_implementation", "_attn_implementation_internal",
    "_experts_implementation", "_commit_hash", "tokenizer_class", "initializer_range",
})


def is_length_dependent_rope(rope_type: str) -> bool:
    """Whether transformers recomputes RoPE frequencies of ``rope_type`` from each request's length.

    The rule of transformers' ``dynamic_rope_update`` (``modeling_rope_utils``, 5.x), which
    every model's rotary embedding is wrapped in: any type containing "dynamic" (NTK scaling
    grown to ``max(position_ids) + 1``) and "longrope" (Phi-3's short or long factors, picked
    by the same length). Fixed scalings ("linear", "yarn", "llama3", ...) do not depend on it.
    """
    return "dynamic" in rope_type or rope_type == "longrope"


def _refuse_length_dependent_rope(text) -> None:
    """Raise :class:`ConfigError` if the config asks for RoPE that depends on the request's length.

    A block's keys are then rotated with frequencies chosen by the length of the request that
    computed them: a block saved by a short request differs from what a recompute of a longer
    prompt puts at the same positions, and no block key can say which length made it.
    """
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(text, field, None)
        if not isinstance(params, dict):
            continue
        # one dict, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
        for where, p in [("", params), *((f"[{k!r}]", v) for k, v in params.items() if isinstance(v, dict))]:
            kind = p.get("rope_type") or p.get("type")
            if isinstance(kind, str) and is_length_dependent_rope(kind):
                raise ConfigError(
                    f"{field}{where}['rope_type'] = {kind!r}: transformers picks this model's RoPE "
                    f"frequencies from each request's total length, so a cached block (computed by a "
                    f"request of another length) is not what a recompute gives; kvtier cannot serve "
                    f"it. Use a RoPE scaling that does not depend on the length (e.g. 'linear', "
                    f"'yarn', 'llama3') or serve this model without kvtier")


def _refuse_bidirectional_config(text) -> None:
    """Raise :class:`ConfigError` if the config asks for bidirectional self-attention.

    The BERT family (BERT, RoBERTa, ELECTRA, BigBird, RemBERT, RoFormer, ...) picks its mask by
    ``is_decoder``, which every encoder checkpoint ships False; ``AutoModelForCausalLM`` loads
    such a checkpoint anyway (transformers only logs a warning). Its attention then sees the
    tokens after a position, so a prefix's K/V depends on what follows it: a block saved by a
    shorter prompt is not what a recompute of a longer one holds. ``add_cross_attention`` marks
    those configs: BART-style configs also carry ``is_decoder``, but their ``*ForCausalLM`` runs
    the causal decoder whatever it says. Fields the config *class* declares, not attributes of
    the instance: transformers makes every key of a config.json an attribute, and checkpoints
    saved by transformers 4 carry ``"is_decoder": false`` and ``"add_cross_attention": false``
    whatever the model (a Llama or GPT-2 of that kind was refused though its attention is causal).

    Gemma's family says it with ``use_bidirectional_attention`` (EmbeddingGemma, PaliGemma's text
    model: True; Gemma 4 and DiffusionGemma: "all"): refused. Gemma 4's "vision" is not: it makes
    attention bidirectional only within an image's tokens, and only where the multimodal model is
    given ``mm_token_type_ids``, which kvtier never passes (its text attention is causal:
    ``is_causal = use_bidirectional_attention != "all"``). The construction probe
    (:mod:`.cache_probe`) catches a bidirectional model too, but as logits that differ; this
    check says why, and costs nothing.
    """
    both_ways = getattr(text, "use_bidirectional_attention", None)
    if both_ways and both_ways != "vision":
        raise ConfigError(
            f"{type(text).__name__} has use_bidirectional_attention={both_ways!r}: this model's attention "
            f"sees the tokens after a position, so a cached prefix's K/V depends on what follows it and no "
            f"block can be reused; kvtier cannot serve it. Serve it without kvtier (or load it with "
            f"use_bidirectional_attention=False if it was trained causal)")
    declared = getattr(type(text), "__dataclass_fields__", {})
    if "is_decoder" in declared and "add_cross_attention" in declared and getattr(text, "is_decoder", None) is False:
        raise ConfigError(
            f"{type(text).__name__} has is_decoder=False: this model's attention is bidirectional (an "
            f"encoder checkpoint loaded as a causal LM), so a cached prefix's K/V depends on the tokens "
            f"after it and no block can be reused; kvtier cannot serve it. Load it with is_decoder=True "
            f"(a decoder, as fine-tuned for generation) or serve it without kvtier")


#: words naming a sub-config of media a multimodal config embeds among its tokens (LLaVA's and
#: Qwen2-VL's ``vision_config``, Gemma 3n's ``audio_config``, Emu3's image tokenizer ``vq_config``,
#: Qwen2.5-Omni's ``thinker_config`` holding both)
_MEDIA_CONFIG_WORDS = ("vision", "audio", "video", "speech", "image", "visual", "vq", "thinker")


def _media_sub_configs(config, prefix: str = "") -> list[str]:
    """The paths of ``config``'s sub-configs (nested ones too) that configure media encoders."""
    found: list[str] = []
    for name, value in vars(config).items():
        if not hasattr(value, "to_dict") or not hasattr(value, "model_type"):
            continue  # not a sub-config
        if any(word in name for word in _MEDIA_CONFIG_WORDS):
            found.append(prefix + name)
        else:
            found.extend(_media_sub_configs(value, f"{prefix}{name}."))
    return found


def _refuse_multimodal_config(config) -> None:
    """Raise :class:`ConfigError` if ``config`` is a multimodal model's (a vision or audio sub-config).

    Its K/V depends on the media merged into the embeddings of its placeholder tokens, which are the
    same ids for every image; blocks are keyed by token ids, so a request with image B would load
    the K/V of image A's request (audit s34 a10 D1). Keying blocks by the media's content (vLLM's
    ``mm_hash``) would serve it; this integration does not. Its text model alone (a ``*ForCausalLM``
    of its ``text_config``) has no such input and is served."""
    media = _media_sub_configs(config)
    if media:
        raise ConfigError(
            f"{type(config).__name__} is a multimodal config ({', '.join(media)}): the model's K/V depends on "
            f"the images or audio merged into its placeholder tokens, and kvtier keys blocks by token ids "
            f"only, so one request's media K/V would be served to another's; kvtier cannot serve multimodal "
            f"models (serve the text model alone, or without kvtier)")


def _decoder_field(text, names: tuple[str, ...]):
    """The first of ``names`` that ``text`` sets to a positive int, or None.

    Encoder-decoder configs (BART, mBART, Marian, Pegasus, Whisper, ...) map ``num_hidden_layers``
    and ``num_attention_heads`` to the *encoder's* fields, while their ``*ForCausalLM`` runs the
    decoder alone (distilbart-*-12-6: 12 and 6 layers), whose own fields say its size."""
    for name in names:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_layout(config, dtype: str, block_tokens: int) -> KVLayout:
    """The canonical block layout of a decoder config (Llama, Qwen2, Mistral and kin).

    One block layout has one head size for K and V. Models whose cache has two sizes are
    refused with the way to serve them: latent attention (DeepSeek-V2/V3, ``kv_lora_rank``),
    which transformers caches as the compressed latent and the RoPE key, and attention whose
    K and V heads differ (``qk_head_dim`` / ``v_head_dim``). A wrong head size would otherwise
    surface as a shape error inside the model's forward. RoPE whose frequencies depend on the
    request's length is refused too (:func:`is_length_dependent_rope`): its KV is no function
    of the prefix alone; so is bidirectional attention (:func:`_refuse_bidirectional_config`).
    An encoder-decoder config gives its decoder's layers and heads (:func:`_decoder_field`).
    A multimodal config (a vision or audio sub-config) is refused (:func:`_refuse_multimodal_config`).
    A config whose layers differ (transformers' ``per_layer_config``) is read layer by layer:
    refused unless every layer has the same layout.
    """
    _refuse_multimodal_config(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    # Of a flat encoder-decoder config (BartConfig as saved, is_encoder_decoder=True), transformers 5
    # returns a decoder view: a copy of the same class whose generic fields hold the decoder's and
    # whose decoder_* fields fall back to the class defaults. A *ForCausalLM's own config
    # (is_encoder_decoder=False) comes back as itself, generic fields naming the encoder: there
    # the decoder_* fields are the ones to read.
    decoder_view = text is not config and type(text) is type(config)
    if getattr(text, "is_heterogeneous", False):
        # Reading a per-layer field off the global config raises transformers' own
        # AmbiguousGlobalPerLayerAttributeError; each layer's config answers for itself.
        layers = list(text.per_layer_config)
        layouts = [_layer_kv_layout(layer, dtype, block_tokens, decoder_view) for layer in layers]
        differ = [i for i, lay in enumerate(layouts) if lay != layouts[0]]
        if differ:
            raise ConfigError(
                f"this model's layers differ in their KV geometry (per_layer_config: layer 0 {layouts[0]}, "
                f"layer {differ[0]} {layouts[differ[0]]}): one KVLayout cannot hold them; kvtier's "
                f"transformers integration cannot serve it")
        return layouts[0]
    return _layer_kv_layout(text, dtype, block_tokens, decoder_view)


def _layer_kv_layout(text, dtype: str, block_tokens: int, decoder_view: bool) -> KVLayout:
    """:func:`kv_layout` of one text config whose fields hold for every layer (``decoder_view``: its
    generic fields are the decoder's already)."""
    def decoder(*names):
        return None if decoder_view else _decoder_field(text, names)

    decoder_heads = decoder("decoder_attention_heads", "num_decoder_attention_heads")
    heads = decoder_heads or getattr(text, "num_attention_heads", None)
    if not heads:
        raise ConfigError(
            f"{type(text).__name__} has no attention heads (num_attention_heads): a state-space or "
            f"recurrent model (Mamba, RWKV, xLSTM, ...) caches a recurrent state, not per-token K/V; "
            f"kvtier cannot store it. Serve this model without kvtier")
    _refuse_bidirectional_config(text)
    _refuse_length_dependent_rope(text)
    serve = ("Serve it with vLLM and the kvtier connector, which stores latent-attention (MLA) caches "
             "as vLLM keeps them")
    if getattr(text, "kv_lora_rank", None):
        raise ConfigError(
            f"this model uses multi-head latent attention: transformers caches a latent of "
            f"{text.kv_lora_rank} and a RoPE key of {getattr(text, 'qk_rope_head_dim', '?')} values a "
            f"token, which kvtier's transformers integration does not store. {serve}")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    k_dim = getattr(text, "qk_head_dim", None) or head_dim
    v_dim = getattr(text, "v_head_dim", None) or head_dim
    if k_dim != v_dim:
        raise ConfigError(
            f"this model's attention caches K of {k_dim} and V of {v_dim} values a head; kvtier's "
            f"transformers integration needs one head size for both. {serve}")
    head_dim = k_dim
    # An encoder-decoder config's num_key_value_heads is no decoder field: Whisper's attribute_map
    # points it at encoder_attention_heads. Its decoder's own KV head count, or its heads, say it.
    if decoder_heads:
        kv_heads = decoder("decoder_num_key_value_heads", "num_decoder_key_value_heads") or decoder_heads
    else:
        kv_heads = getattr(text, "num_key_value_heads", None)
    if kv_heads is None and getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        # Falcon's multi-query attention caches one K/V head; its config has no num_key_value_heads
        # (the cache's own shape check in StorageLayer.update refuses a count that is wrong).
        kv_heads = 1
    kv_heads = kv_heads or heads
    if dtype not in TORCH_TO_LAYOUT_DTYPE:
        raise ConfigError(f"KV dtype {dtype!r} is not supported; use one of {sorted(TORCH_TO_LAYOUT_DTYPE)}")
    return KVLayout(
        num_layers=decoder("decoder_layers", "num_decoder_layers") or text.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=TORCH_TO_LAYOUT_DTYPE[dtype],
        block_tokens=block_tokens,
    )


def config_fingerprint(config) -> str:
    """xxh3-128 of the config's KV-relevant fields, as canonical JSON."""
    values = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_FIELDS}
    canonical = json.dumps(values, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canonical.encode("utf-8"))


def weights_identity(model_dir: str | os.PathLike, *, digests: WeightsDigests | None = None) -> str:
    """The exact identity of the ``*.safetensors`` files of ``model_dir`` (see module doc): every byte
    hashed, once per file version (``digests``: where digests are cached; default the user's cache)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors file in {os.fspath(model_dir)!r}; save the model with "
            f"save_pretrained(safe_serialization=True) or pass weights_revision= explicitly"
        )
    # (a file is checked when it is hashed; one whose digest is cached is not even opened)
    hexes = (digests or WeightsDigests()).digests(files, check=_check_safetensors)
    sizes = [os.stat(path).st_size for path in files]
    h = hashlib.sha256()
    for path, size, hexdigest in zip(files, sizes, hexes):
        h.update(frame_str(1, path.name) + frame_int(2, size) + frame_str(3, hexdigest))
    return IDENTITY_PREFIX + h.hexdigest()


def _check_safetensors(path: str | os.PathLike) -> None:
    """Raise :class:`ConfigError` unless the file's length field shows a safetensors file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
    if len(head) != 8:
        raise ConfigError(f"{path} is not a safetensors file (shorter than its length field)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(size - 8, _MAX_HEADER):
        raise ConfigError(f"{path} is not a safetensors file (header length {header_len})")


def check_weights_match(model, model_dir: str | os.PathLike, samples: int = 3, values: int = 64) -> None:
    """Raise :class:`ConfigError` unless a few sampled weights of ``model`` equal those in ``model_dir``.

    Guards the file-based identity against its one easy mistake: a model *built* from
    a config read in ``model_dir`` (so ``_name_or_path`` points there) but not
    *loaded* from it, with an error that names the fix. Weights changed in memory
    after loading are :func:`loaded_weights_digest`'s to catch: this is a sample.
    """
    from safetensors import safe_open

    # A torch.compile wrapper's state dict names every weight "_orig_mod.<name>", a name no file
    # holds: compared as the model it compiles (as loaded_weights_digest reads it).
    state = getattr(model, "_orig_mod", model).state_dict()
    compared = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = [n for n in f.keys() if n in state and state[n].numel() > 1]
            picks = {names[i * (len(names) - 1) // max(samples - 1, 1)] for i in range(samples)} if names else set()
            for name in sorted(picks):
                stored = f.get_slice(name)
                rows = stored[:1] if len(stored.get_shape()) > 1 else stored[:values]
                mine = state[name][:1] if state[name].dim() > 1 else state[name][:values]
                if rows.shape != mine.shape or not bool((rows.to(mine.dtype) == mine.detach().cpu()).all()):
                    raise ConfigError(
                        f"the model's weight {name!r} differs from {path}: the model was not loaded from "
                        f"{os.fspath(model_dir)!r}; pass weights_dir= of its real files or weights_revision="
                    )
                compared += 1
    if not compared:
        raise ConfigError(f"no weight of the model could be compared with {os.fspath(model_dir)!r}; "
                          f"pass weights_revision= explicitly")


#: the attributes of a PEFT tuner layer that choose what it computes and are no tensor
_ADAPTER_STATE = ("active_adapters", "disable_adapters", "merged_adapters", "scaling")


def adapter_states(model) -> list[tuple[str, str]]:
    """The state of every PEFT tuner layer of ``model`` (:func:`adapter_state`), as (module name, state).
    Empty for a model without them."""
    return [(name, state) for name, module in model.named_modules() if (state := adapter_state(module)) is not None]


def adapter_state(module) -> str | None:
    """The state of ``module`` if it is a PEFT tuner layer, as canonical JSON: what chooses what it
    computes and is no tensor (its active adapters, whether its adapters are disabled, those merged
    into its base weights, each adapter's scaling); None for any other module.

    PEFT injects its layers into the model (kvtier is given ``peft_model.base_model.model``:
    ``PeftModel.forward`` hides its arguments). Every adapter's weights are in the state dict, but
    ``set_adapter``, ``disable_adapter_layers`` or ``set_scale`` change what the layers compute
    (another adapter's K/V, or the base model's) with no weight changed. Read duck-typed (kvtier does
    not import peft): a module whose class has ``active_adapters`` and ``disable_adapters`` that are
    values, not methods (peft's tuner layers and module wrappers; transformers' ``PeftAdapterMixin``
    gives the model *methods* of those names, which the injected layers answer for).
    """
    if not _may_be_tuner_layer(type(module)):
        return None
    values = {attr: getattr(module, attr, None) for attr in _ADAPTER_STATE}
    if callable(values["active_adapters"]) or callable(values["disable_adapters"]):
        return None
    return json.dumps(values, sort_keys=True, default=repr)


@functools.cache
def _may_be_tuner_layer(kind: type) -> bool:
    # per class, once: a weights check asks it of every module at every request
    return hasattr(kind, "active_adapters") and hasattr(kind, "disable_adapters")


def loaded_weights_digest(model) -> str:
    """xxh3-128 of the model's weights as they are in memory: every tensor of its state dict
    (name, dtype, shape and every byte), in the state dict's order, and the state of its PEFT tuner
    layers (:func:`adapter_states`, where it has any: which adapter they apply).

    Exact, and the same on every machine that loads the same files in the same dtype. It costs
    one read of the weights on one core, at memory speed: measured 0.09-0.13 s for a 1.36 GB
    fp32 Llama (0.03 s in bf16) on a 2-core VM, i.e. ~1-1.5 s for a 16 GB model, once per
    :func:`namespace_for_model` call and once per check of a namespace given to a session
    (:func:`refuse_foreign_namespace`): a session's start, and once per change its weights watch
    sees (:mod:`.weights_watch`), never per request of unchanged weights. A tensor tied to
    another (shared embeddings) is hashed once and named as the other's alias. A tensor on the meta
    device (weights that accelerate offloads between forwards) has no bytes here: refused with a
    :class:`ConfigError`.
    """
    # A torch.compile wrapper's state dict names every weight "_orig_mod.<name>": the same weights
    # under other names, digested as the model it compiles.
    model = getattr(model, "_orig_mod", model)
    h = xxhash.xxh3_128()
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if t.is_meta:
            raise ConfigError(
                f"the model's weight {name!r} is on the meta device (offloaded, e.g. by accelerate's "
                f"cpu_offload or a device_map with offloading): its bytes are not in memory, so the "
                f"weights cannot be identified. Load the model without offloading (device_map=None)")
        h.update(_tensor_header(name, t))
        alias = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and alias in seen:
            h.update(frame_str(4, seen[alias]))
            continue
        seen[alias] = name
        _hash_bytes(h, t)
    for name, state in adapter_states(model):
        h.update(frame_str(6, name) + frame_str(7, state))
    return h.hexdigest()


def non_persistent_buffers_digest(model) -> str:
    """xxh3-128 of the model's non-persistent buffers (name, dtype, shape and every byte, module by
    module): what :func:`loaded_weights_digest` leaves out, since no checkpoint holds them (RoPE's
    ``inv_freq``), though the forward reads them. Small: a read of a few KB for most models."""
    model = getattr(model, "_orig_mod", model)
    h = xxhash.xxh3_128()
    for prefix, module in model.named_modules():
        for leaf in sorted(module._non_persistent_buffers_set):
            tensor = module._buffers.get(leaf)
            if tensor is not None:
                h.update(_tensor_header(f"{prefix}.{leaf}" if prefix else leaf, tensor.detach()))
                _hash_bytes(h, tensor.detach())
    return h.hexdigest()


def _tensor_header(name: str, tensor) -> bytes:
    return frame_str(1, name) + frame_str(2, str(tensor.dtype)) + frame_str(3, repr(tuple(tensor.shape)))


def _hash_bytes(h, tensor) -> None:
    import torch

    # A view of the tensor's own bytes when it sits contiguous in host memory; one copy else.
    data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    h.update(frame_int(5, data.nbytes))
    h.update(data)


def pad_counted_positions(model) -> frozenset[int]:
    """The pad ids that ``model`` numbers positions past: empty for most models; the RoBERTa family
    (RoBERTa, XLM-RoBERTa(-XL), CamemBERT, Data2VecText, RoBERTa-PreLayerNorm, X-MOD) and TrOCR with
    sinusoidal positions give a token the count of non-pad tokens up to it
    (``create_position_ids_from_input_ids``), starting after the pad id.

    A suffix after a cached prefix is numbered from the prefix's *length*, a recompute numbers it
    from the prefix's count of non-pad tokens: the two agree only when the prefix holds no pad id,
    so a hit must stop before the first block holding one (the session caps it there). A module
    that numbers so without an integer ``padding_idx`` is refused: the cap would not know what
    to look for.
    """
    pads = set()
    for name, module in model.named_modules():
        if not callable(getattr(module, "create_position_ids_from_input_ids", None)):
            continue
        pad = getattr(module, "padding_idx", None)
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise ConfigError(
                f"{name or type(model).__name__} numbers positions by counting non-pad tokens, but its "
                f"padding_idx is {pad!r}: kvtier cannot tell which cached prefixes a recompute numbers "
                f"the same way; set the config's pad_token_id, or serve this model without kvtier")
        pads.add(pad)
    return frozenset(pads)


def model_dtype_name(model) -> str:
    dtype = next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def attention_implementation(config) -> str:
    """The attention kernel transformers runs the model's text layers with (``eager``, ``sdpa``,
    ``flash_attention_2``, a hub kernel, ...), as the loaded model resolved it.

    It joins the namespace although the config fingerprint leaves it out: kernels do not all
    compute the same K/V. Gemma 2's attention soft-capping is applied by the eager kernel and
    skipped by sdpa, so the same files under the two give other hidden states, hence other K/V
    from the second layer on. Where kernels agree (up to rounding) the cost is a miss between
    servers running different ones, never a wrong hit; so every model's namespace names it, not
    only those with a known difference.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None) or "default"


def namespace_for_model(
    model,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    weights_dir: str | os.PathLike | None = None,
    weights_revision: str | None = None,
    tenant: str = "",
    adapter: str = "",
    salt: str = "",
) -> Namespace:
    """The namespace of ``model``'s KV cache.

    The weights are identified by ``weights_revision`` if given (e.g. a hub
    commit hash you trust), else by :func:`weights_identity` of ``weights_dir``
    or, failing that, of the directory the model was loaded from
    (``config._name_or_path``), joined by :func:`loaded_weights_digest` (weights
    changed after loading, e.g. a merged LoRA, give another namespace). A model
    built in memory has neither: save it first, or pass ``weights_revision``
    (trusted as given: nothing is hashed).
    """
    config = model.config
    if weights_revision is None:
        source = weights_dir or getattr(config, "_name_or_path", "") or ""
        if not source or not Path(source).is_dir():
            raise ConfigError(
                "cannot identify the model's weights: it was not loaded from a local directory; "
                "pass weights_dir=<directory with *.safetensors> or weights_revision=<a revision you trust>"
            )
        files = weights_identity(source)
        loaded = loaded_weights_digest(model)  # first: it says why an offloaded model's weights cannot be read
        check_weights_match(model, source)
        weights_revision = f"{files}{_MEM_MARK}{loaded}"
    dtype = model_dtype_name(model)
    layout = kv_layout(config, dtype, block_tokens)
    return Namespace(model_id_of(model), layout, weights_revision=weights_revision, tenant=tenant,
                     adapter=adapter, salt=salt)


def model_id_of(model) -> str:
    """The ``model_id`` of ``model``'s namespace: its model type, config fingerprint, attention
    implementation and (models that number positions past it) pad id."""
    config = model.config
    model_id = f"hf:{config.model_type}:cfg={config_fingerprint(config)}:attn={attention_implementation(config)}"
    pads = pad_counted_positions(model)
    if pads:
        # pad_token_id is no part of the fingerprint (it changes no KV of most models); here it
        # shifts every position (they start after it), so models differing in it share no KV.
        model_id += f":pads={','.join(map(str, sorted(pads)))}"
    return model_id


def refuse_foreign_namespace(model, namespace: Namespace) -> None:
    """Raise :class:`ConfigError` unless ``namespace`` names ``model``: its ``model_id`` must be
    :func:`model_id_of` the model (the same type, config, attention kernel and pad id), and a
    ``weights_revision`` that :func:`namespace_for_model` derived (``...+mem:<digest>``) must hold
    the :func:`loaded_weights_digest` of the weights loaded now: a namespace of another checkpoint
    of the same config (a base model and its fine-tune) would otherwise serve that checkpoint's
    K/V. A revision without that digest was given by the caller and is trusted as given. Costs
    one read of the weights (what :func:`namespace_for_model` pays), once per session."""
    mine = model_id_of(model)
    if namespace.model_id != mine:
        raise ConfigError(
            f"the namespace's model_id {namespace.model_id!r} is not this model's {mine!r} (another model "
            f"type, config, attention implementation or pad id): its blocks hold another model's K/V; build "
            f"the namespace from this model (namespace_for_model)")
    digest = derived_weights_digest(namespace)
    if digest is not None and digest != (loaded := loaded_weights_digest(model)):
        raise ConfigError(
            f"the namespace was built from other weights than this model's: its weights digest "
            f"{_MEM_MARK}{digest} is not the loaded weights' {_MEM_MARK}{loaded} (another checkpoint of the "
            f"same config, or weights changed since namespace_for_model ran); build the namespace from "
            f"this model (namespace_for_model), or pass weights_revision= naming these weights")


def derived_weights_digest(namespace: Namespace) -> str | None:
    """The :func:`loaded_weights_digest` in a ``weights_revision`` that :func:`namespace_for_model`
    derived (``...+mem:<digest>``), or None for a revision the caller gave."""
    _, derived, digest = namespace.weights_revision.rpartition(_MEM_MARK)
    return digest if derived else None
