"""What vLLM computes from the weights, as one digest in every block key (:func:`model_computation_digest`).

Two engines of one model path and revision can still compute other K and V for the same tokens:
``--hf-overrides``, ``--dtype``, ``--quantization``, and a RoPE whose factors follow
``--max-model-len``. The digest names all of that, so such engines never share a key. It leaves out
what differs between hosts for the same computation (where the files are, the transformers
version) and the fields that change no KV, so that the same weights with the same settings on two
hosts share keys. A field it leaves out wrongly would let two engines load each other's KV; a
field it keeps wrongly only makes them miss: when in doubt, a field is kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

from kvtier.errors import ConfigError

#: hf config fields that differ between hosts, processes or library versions for the same
#: weights and the same computation, or that no computation of K or V reads. Dropped at every level
#: of nesting (but inside ``quantization_config``: :func:`_host_independent`).
_HOST_LOCAL_HF_FIELDS = frozenset({
    "transformers_version",
    # switches of transformers' own forward and its classification heads, not of vLLM's model
    "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "id2label", "label2id", "problem_type", "tokenizer_class",
    # vLLM's MiniMax-M2 code writes the engine's --max-model-len here in its worker: no KV follows it
    "max_model_len",
    # Not here: ``attn_temperature_tuning``, which vLLM's Llama 4 code writes into hf_config as its
    # worker loads the model (true when --max-model-len exceeds 32768, unless the generation config
    # sets it). It scales the queries of the NoPE layers (llama4.py: q * attn_scale): their output
    # changes, and with it the K and V of every later layer. The worker's value reaches the
    # scheduler's keys through the handshake (metadata.KvtierHandshake).
})

#: private fields of transformers' configs that name the host or the process, not the computation:
#: where the files are, the hub commit, the attention / experts kernels transformers' (and vLLM's
#: Transformers backend's) loading picks, how the config was loaded. Only these: other private
#: fields can name the computation (a torchao ``quantization_config`` names its scheme only in
#: ``_type`` / ``_version`` / ``_data``).
_HOST_LOCAL_PRIVATE_FIELD = re.compile(
    r"_(?:name_or_path|commit_hash|attn_implementation\w*|experts_implementation\w*|auto_class"
    r"|from_auto|from_pipeline|configuration_file|output_attentions)")

#: the class names the checkpoint was saved from, dropped from the top level only: vLLM's resolved
#: architecture stands for them there. A nested config's ``architectures`` picks the code of a
#: part (vLLM's LLaVA family builds its language model by ``text_config.architectures``): kept.
_STOOD_FOR_AT_TOP_LEVEL = frozenset({"architectures", "auto_map"})

#: the dtype the checkpoint was saved in (spelled by transformers' version). vLLM's native models
#: compute in the dtype vLLM resolved (digested), yet some model code computes in this one (vLLM
#: 0.32: OpenPangu's attention sinks, joined to every layer's K/V, GLM-4V's and ERNIE-4.5-VL's
#: pixel values, Nemotron-H MTP's ``eh_proj``): kept for those (:func:`_fields_read_by_model_code`),
#: as the canonical name of the dtype under one key (``torch.float16`` and ``"float16"`` compute
#: the same).
_DTYPE_FIELDS = frozenset({"dtype", "torch_dtype"})
#: model code reading the hf config's dtype: ``<x>config.dtype`` (not vLLM's ``model_config.dtype``,
#: not an assignment, as vLLM's Transformers backend writes vLLM's dtype there) or a getattr of it
_READS_CONFIG_DTYPE = re.compile(
    r"(?<!model_)config\.(?:torch_)?dtype\b(?!\s*=(?!=))"
    r"|attr\(\s*[\w.]*config\s*,\s*[\"'](?:torch_)?dtype[\"']")

#: multimodal placeholder token ids. Which prompt positions an image fills is vLLM's processor's
#: choice, in the prompt's token ids and vLLM's block hashes; some model code writes them into the
#: hf config as each worker builds the model (Isaac, Kimi-K2.5, InternS2-Mobius: from the tokenizer
#: or another field), which the scheduler's copy never sees. Dropped where the model's code never
#: reads them or writes them itself (the value then follows the tokenizer and the other fields);
#: kept where it reads a value it does not write (Qwen2-VL's M-RoPE positions follow
#: ``image_token_id``): a kept field the worker rewrote costs misses, never a wrong hit.
_PLACEHOLDER_ID_FIELDS = frozenset({
    "image_token_id", "image_token_index", "video_token_id", "video_token_index",
    "audio_token_id", "audio_token_index",
})

#: the quantization scheme (``quantization_config_file``: the file's contents,
#: :func:`_with_quantization_file`): kept whole, private fields and all
_QUANTIZATION_FIELDS = frozenset({"quantization_config", "quantization_config_file"})

#: hf config fields that change no KV unless the model's vLLM code reads them: the generation's
#: special tokens (a corrected ``eos_token_id`` is a common override and a common hub update) and
#: training-only settings (weights are loaded, never initialised; vLLM runs the model in eval mode,
#: where dropout does nothing). Yet some model code does read them (vLLM 0.32: LongCat-Flash-Ngram's
#: n-gram embedding stops at ``eos_token_id``, GLM-4V's image token is ``pad_token_id``, Moondream3
#: embeds ``bos_token_id`` before an image, HRM scales its embeddings by 1/``initializer_range``),
#: so each is dropped only for an architecture whose code never names it
#: (:func:`_fields_read_by_model_code`).
_INERT_UNLESS_READ = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "initializer_factor", "init_std",
    "dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "classifier_dropout",
    "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
})

#: vLLM's package of model code; a model module's imports from it are read with it
_MODELS_PACKAGE = "vllm.model_executor.models"
_IMPORT_FROM = re.compile(r"^\s*from\s+(\.+[\w.]*|vllm\.model_executor\.models\.[\w.]+)\s+import\b", re.M)


#: the fields dropped unless the model's vLLM code reads them (:func:`_fields_read_by_model_code`)
_KEPT_WHERE_READ = _INERT_UNLESS_READ | _PLACEHOLDER_ID_FIELDS | _DTYPE_FIELDS


@functools.lru_cache(maxsize=None)
def _fields_read_by_model_code(architecture: str) -> frozenset[str]:
    """Which of :data:`_KEPT_WHERE_READ` vLLM's code for ``architecture`` reads: its module and the
    modules of vLLM's model package it imports, read as text (nothing is imported: the scheduler's
    process never loads model code). All of them where that code cannot be read: an out-of-tree
    model, a registry laid out otherwise than vLLM 0.32's."""
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        module = getattr(ModelRegistry.models.get(architecture), "module_name", None)
    except ImportError:
        module = None
    text = _model_code(module) if isinstance(module, str) else None
    if text is None:
        return _KEPT_WHERE_READ
    return frozenset(name for name in _KEPT_WHERE_READ if _reads(text, name))


def _reads(code: str, name: str) -> bool:
    """Whether model ``code`` reads hf config field ``name`` (:data:`_KEPT_WHERE_READ`)."""
    if name in _DTYPE_FIELDS:
        # "dtype" names vLLM's own dtype all over model code: only reads of the config's count
        return _READS_CONFIG_DTYPE.search(code) is not None
    if name in _PLACEHOLDER_ID_FIELDS:
        # a placeholder the code writes follows what it is computed from, not the scheduler's copy
        read = re.search(rf"\b{name}\b(?!\s*=(?!=))", code)
        written = re.search(rf"\.{name}\s*=(?!=)", code)
        return read is not None and written is None
    return re.search(rf"\b{name}\b", code) is not None


def _model_code(module: str) -> str | None:
    """The source of ``module`` and of every module of vLLM's model package it imports, transitively
    (vLLM's layers and utilities outside it are shared by every model: not read); None if
    ``module`` is not a source file of that package."""
    import vllm.model_executor.models as package

    root = Path(package.__file__).parent
    texts, seen, pending = [], set(), [module]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(root, name)
        if path is None:
            if name == module:
                return None
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        is_package = path.name == "__init__.py"
        pending.extend(_absolute(name, is_package, spec) for spec in _IMPORT_FROM.findall(text))
    return "\n".join(texts)


def _module_file(root: Path, name: str) -> Path | None:
    """The source file of module ``name`` of vLLM's model package; None for a module outside it."""
    if name != _MODELS_PACKAGE and not name.startswith(_MODELS_PACKAGE + "."):
        return None
    base = root.joinpath(*name.split(".")[3:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(module: str, is_package: bool, spec: str) -> str:
    """The module that ``from <spec> import`` names inside ``module``."""
    if not spec.startswith("."):
        return spec
    dots = len(spec) - len(spec.lstrip("."))
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(dots - 1):
        package = package.rpartition(".")[0]
    rest = spec[dots:]
    return f"{package}.{rest}" if rest else package


def _host_independent(value, dropped: frozenset[str] | None, *, top_level: bool = False):
    """``value`` (an hf config dict) without the ``dropped`` fields, the host-local private ones
    (:data:`_HOST_LOCAL_PRIVATE_FIELD`) and, at the top level, :data:`_STOOD_FOR_AT_TOP_LEVEL`; its
    dtype under one key, by name; its integral floats as ints: ``rope_theta`` 10000 and 10000.0
    compute the same. ``dropped`` None keeps every field: :data:`_QUANTIZATION_FIELDS` are kept
    whole, as vLLM's quantization methods read all of them."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            key = str(key)
            if dropped is not None and _is_host_local(key, dropped, top_level):
                continue
            if dropped is not None and key in _DTYPE_FIELDS:
                if key == "dtype" or "dtype" not in value:   # one field, spelled by transformers' version
                    kept["dtype"] = _dtype_name(item)
                continue
            kept[key] = _host_independent(item, None if key in _QUANTIZATION_FIELDS else dropped)
        return kept
    if isinstance(value, (list, tuple)):
        return [_host_independent(v, dropped) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_host_local(key: str, dropped: frozenset[str], top_level: bool) -> bool:
    return (key in dropped or _HOST_LOCAL_PRIVATE_FIELD.fullmatch(key) is not None
            or (top_level and key in _STOOD_FOR_AT_TOP_LEVEL))


def _dtype_name(value):
    """``torch.float16``, ``"torch.float16"`` and ``"float16"`` as ``"float16"`` (transformers keeps
    a per-part dtype as a dict of them; Emu3 has a vocabulary entry "dtype": an int, kept)."""
    if isinstance(value, dict):
        return {str(k): _dtype_name(v) for k, v in value.items()}
    if isinstance(value, str) or type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return value


def _rope_parameter_sets(text_config) -> list[dict]:
    """The text config's RoPE parameters: one set, or one per layer type (transformers 5 names
    them by attention kind, as Gemma 3's ``full_attention`` / ``sliding_attention``)."""
    rope = getattr(text_config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "rope_theta" in rope:
        return [rope]
    return [v for v in rope.values() if isinstance(v, dict)]


def _rope_context(model) -> list[dict]:
    """What the RoPE vLLM builds reads from ``--max-model-len`` (vLLM 0.32's rotary embeddings).

    * LongRoPE (Phi-3/3.5/4-mini) uses its long factors for every position when ``max_model_len``
      exceeds ``original_max_position_embeddings``, its short ones otherwise: that choice.
    * Dynamic NTK with ``max_trained_positions``, and FoPE without ``num_inv_freq``, compute their
      frequencies from the length ``get_rope`` is given, which some model code takes from
      ``max_model_len`` (PLaMo 3: the least of it and ``max_position_embeddings``): the length.

    The others (default, linear, NTK, YaRN, DeepSeek YaRN, Llama 3, dynamic NTK without
    ``max_trained_positions`` or by ``alpha``) give a position the same rotation at any length:
    nothing, so that ``--max-model-len`` keeps their keys.
    """
    context = []
    for rope in _rope_parameter_sets(model.hf_text_config):
        kind = rope.get("rope_type", "default")
        original = rope.get("original_max_position_embeddings")
        if kind == "longrope" and isinstance(original, int):
            context.append({"longrope_long_factors": model.max_model_len > original})
        elif (kind == "longrope" or (kind == "dynamic" and "factor" in rope and "max_trained_positions" in rope)
              or (rope.get("use_fope") and rope.get("num_inv_freq") is None)):
            context.append({"max_model_len": _built_max_model_len(model)})
    return context


def _built_max_model_len(model) -> int:
    """The ``max_model_len`` the model was built with. With ``--max-model-len -1`` vLLM builds the
    model at the length it derives from the config, then lowers ``max_model_len`` to what fits in
    memory before the connector is built: the length the RoPE was built at is gone. Refused then,
    for the RoPEs whose rotation depends on it (an engine started at the lowered length rotates
    otherwise, yet would share keys)."""
    if getattr(model, "original_max_model_len", None) == -1:
        raise ConfigError(
            "KvtierConnector keys this model's blocks by the max_model_len its RoPE was built with, "
            "which --max-model-len -1 (auto-fit) does not keep; give --max-model-len explicitly")
    return model.max_model_len


def _with_quantization_file(hf: dict) -> dict:
    """``hf`` with its ``quantization_config_file`` as the file's parsed contents: vLLM's online
    quantization (torchao) takes the scheme from the file, whose path says nothing of it (one path
    on two hosts, a file edited between runs). Refused if the file cannot be read or parsed."""
    path = hf.get("quantization_config_file")
    if path is None:
        return hf
    try:
        contents = json.loads(Path(str(path)).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"KvtierConnector keys blocks by the quantization scheme in quantization_config_file, "
                          f"and cannot read {path!r} ({e})") from e
    return {**hf, "quantization_config_file": contents}


def model_computation_digest(vllm_config) -> str:
    """A digest of the model computation vLLM runs, beyond the weights: what makes the KV of one
    token sequence differ between engines of the same model path and revision.

    * the whole hf config *after* ``--hf-overrides`` and vLLM's own config hooks (a multimodal
      model's vision tower and projector with its text model): RoPE theta and scaling (YaRN,
      llama3, ...), sliding windows, norms, soft-caps, head sizes, which vision layer feeds the
      projector;
    * what the RoPE takes from ``--max-model-len`` (:func:`_rope_context`: LongRoPE's long or
      short factors);
    * the architecture vLLM resolved and any class override (which model code runs), the
      remote code's revision;
    * the dtype vLLM computes in (with ``--kv-cache-dtype fp8`` the pages are fp8 whatever it
      is, yet fp16- and bf16-computed KV differ), and the quantization (``--quantization fp8``
      of a bf16 checkpoint on a GPU computes other K and V from the same files);
    * the cache settings that change K/V but not the page geometry: layers kept out of a
      quantized KV cache, a sliding window disabled or overridden.

    Not in it: where the files are, the transformers version, the fields of
    :data:`_HOST_LOCAL_HF_FIELDS` and, for models whose code does not read them,
    :data:`_KEPT_WHERE_READ` (special token ids, initialisation, dropout, the checkpoint's dtype,
    multimodal placeholder ids), and settings that
    change no KV (``max_model_len`` outside the RoPE above and the config fields vLLM's model code
    writes from it, as Llama 4's ``attn_temperature_tuning``; ``gpu_memory_utilization``, ...), so
    the same weights with the same settings on two hosts share keys. Scheduler and workers compute
    it from their own copy of the configuration: a model whose vLLM code writes a KV-relevant
    config field while a multi-process worker loads it would have its lookups miss its saves
    (lost, never wrong) but for the connector's handshake.
    """
    from vllm.config.utils import normalize_value

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    architecture = str(model.architecture)
    dropped = _HOST_LOCAL_HF_FIELDS | (_KEPT_WHERE_READ - _fields_read_by_model_code(architecture))
    hf_config = model.hf_config
    computation = {
        "hf": _host_independent(_with_quantization_file(hf_config.to_dict()), dropped, top_level=True),
        "architecture": architecture,
        "class_overrides": getattr(model, "model_class_overrides", None) or {},
        "code_revision": getattr(model, "code_revision", None) or "",
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": str(model.quantization or ""),
        "quantization_args": getattr(model, "quantization_config", None),
        "disable_sliding_window": bool(getattr(model, "disable_sliding_window", False)),
        "sliding_window": getattr(cache, "sliding_window", None),
        "kv_cache_dtype_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", None) or []),
    }
    if model.hf_text_config is not hf_config:
        # nested in hf_config for the models vLLM 0.32 knows; digested apart in case one is not
        computation["hf_text"] = _host_independent(model.hf_text_config.to_dict(), dropped, top_level=True)
    rope_context = _rope_context(model)
    if rope_context:
        computation["rope_context"] = rope_context
    try:
        # vLLM's own canonical form for its config hashes: it refuses what has no stable
        # encoding rather than digesting a repr that names a memory address (such a digest
        # would differ between the scheduler and the workers: every lookup a miss)
        canonical = json.dumps(normalize_value(computation), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"KvtierConnector cannot key blocks on this model's configuration ({e}); "
                          f"run this model without the connector") from e
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
