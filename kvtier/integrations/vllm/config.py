"""Connector settings from ``kv_connector_extra_config``, and the namespace of an engine's KV.

The extra config is flat: the connector's own keys (below) plus any
:class:`~kvtier.store.config.StoreConfig` key, so one JSON object picks both
the behaviour and the store::

    {"block_tokens": 256, "host_bytes": "8GiB", "disk_path": "/mnt/nvme/kvtier"}   # embedded
    {"block_tokens": 256, "host_bytes": "8GiB", "remote_url": "tcp://kv-0:7400"}   # + a kvtier server

A server is there to share: with ``remote_url`` and no ``write_mode`` the store
writes through, so that other instances see a block as soon as it is saved
(write-back would send it to the server only when the host tier evicts it).
The server token comes from ``remote_token``, the URL or ``$KVTIER_TOKEN``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.core.keys import BlockKey, chain_external_hashes
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.core.units import parse_size
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.model_digest import model_computation_digest
from kvtier.store import safety
from kvtier.store.config import StoreConfig, check_flag, check_seconds, check_text

log = logging.getLogger(__name__)

#: the longest flush at shutdown ``shutdown_flush_s`` may ask for, in seconds
MAX_SHUTDOWN_FLUSH_S = 3600

#: seconds a scheduler waits for the worker's answer to a lookup of DRAM and disk tiers
LOOKUP_TIMEOUT_S = 2.0

#: torch dtype name → kvtier dtype name
_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
}


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector does; the store it uses is ``store``.

    * ``block_tokens``: tokens per kvtier block, a multiple of vLLM's block size.
      Lookups, loads and saves are in whole kvtier blocks (a load may stop inside
      the last one).
    * ``model_id`` / ``weights_revision``: the namespace; default: vLLM's model
      name and revision (for a hub cache's snapshot path, which vLLM gives with
      ``HF_HUB_OFFLINE=1``: the repository and the snapshot's commit). Set them
      when two paths hold the same weights, or one path is reused for other
      weights. They name the weights only: what vLLM computes from them (its hf
      config after ``--hf-overrides``, dtype, quantization:
      :func:`model_computation_digest`) joins every key by itself, as a LoRA request's
      adapter does (its files' contents and the engine's LoRA settings:
      :mod:`~kvtier.integrations.vllm.lora_digest`).
    * ``async_load``: load between scheduler steps (``get_finished``) instead of
      before the forward pass that needs the blocks.
    * ``sync_load_when_alone``: with ``async_load``, a request that finds no other
      request in the engine still loads synchronously, in the step of its
      forward pass: with nothing else to compute, an asynchronous load only adds
      engine steps (an idle pass, then a wait) before the forward.
    * ``sync_load_max_bytes``: with ``async_load``, a load of at most this many
      bytes (a size: ``8MiB``, or bytes) whose blocks all sit in tiers with bounded
      reads (``Tier.bounded_reads``: the host (DRAM) tier, a kvtier server, Mooncake
      Store) also runs synchronously, in the step of its forward pass. An
      asynchronous load keeps the request, and the pages reserved for it, out of
      the batch until the step after the load ends: a whole engine step (tens to
      hundreds of ms) added to its TTFT, and pages that hold no computing request
      meanwhile. A memcpy of a few MiB costs the step a millisecond or two; a
      server's read of as much a few more (a round trip, then its bandwidth). A
      server that stalls holds the step up to its call deadline (``timeout_s``), as
      the scheduler's lookup on it already can. Loads from disk stay asynchronous
      (a disk read has no deadline); ``0`` makes every load beside other requests
      asynchronous.
    * ``pd_wait_s``: a request carrying ``kv_transfer_params`` from a prefill
      instance waits up to this long for the blocks it announces to be visible.
    * ``load_failure_policy``: "recompute" (the default; vLLM's own default
      would fail the request) or "fail".
    * ``shutdown_flush_s``: at engine shutdown (vLLM's ``shutdown``, SIGTERM,
      process exit) the store flushes host blocks not yet on disk for at most
      this long. vLLM gives a worker about 5 s between asking it to stop and
      killing it (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, the engine-core
      process manager's grace), hence the default of 4; kvtier's launcher
      (:mod:`kvtier.integrations.vllm.launcher`) raises that grace to cover a
      longer flush unless the variable is set. At most
      :data:`MAX_SHUTDOWN_FLUSH_S` (an hour): "no limit" is not a setting, and a
      timeout past the platform's (``threading.TIMEOUT_MAX``) would make shutdown raise.
    * ``allow_weak_block_hashes``: accept vLLM's non-cryptographic block hashes
      (``prefix_caching_hash_algo`` "xxhash" / "xxhash_cbor") as key material,
      with a warning. Off by default: keys chain over those hashes, and a
      prompt crafted to collide with another's hash would be served the other's
      KV (wrong output, and a hit that tells the prompt was seen).
    * ``debug_poison``: fill the pages a load writes and its staging buffers with
      NaN first (tests; :mod:`kvtier.integrations.poison`). Default:
      ``$KVTIER_DEBUG_POISON``.
    """

    block_tokens: int = 256
    model_id: str | None = None
    weights_revision: str | None = None
    async_load: bool = True
    sync_load_when_alone: bool = True
    sync_load_max_bytes: int | str = 8 << 20
    pd_wait_s: float = 5.0
    load_failure_policy: str = "recompute"
    shutdown_flush_s: float = 4.0
    allow_weak_block_hashes: bool = False
    debug_poison: bool | None = None
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise ConfigError(f"block_tokens={self.block_tokens!r}; give a positive multiple of vLLM's block size")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"load_failure_policy={self.load_failure_policy!r}; use 'recompute' or 'fail'")
        # a frozen dataclass: normalise the size through object.__setattr__
        object.__setattr__(self, "sync_load_max_bytes", parse_size(self.sync_load_max_bytes, "sync_load_max_bytes"))
        check_seconds(self.pd_wait_s, "pd_wait_s")
        check_seconds(self.shutdown_flush_s, "shutdown_flush_s", hint=" (0: drop what only DRAM holds)")
        if self.shutdown_flush_s > MAX_SHUTDOWN_FLUSH_S:
            raise ConfigError(
                f"shutdown_flush_s={self.shutdown_flush_s!r}; give at most {MAX_SHUTDOWN_FLUSH_S} seconds (the "
                f"flush at shutdown is bounded: vLLM and the orchestrator kill the worker long before, and "
                f"timeouts past the platform's limit make the shutdown raise instead of flushing)")
        for name in ("async_load", "sync_load_when_alone", "allow_weak_block_hashes"):
            check_flag(getattr(self, name), name)
        check_flag(self.debug_poison, "debug_poison", optional=True)
        check_text(self.model_id, "model_id", optional=True)
        check_text(self.weights_revision, "weights_revision", optional=True)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"store"}
        mine = {k: extra.pop(k) for k in list(extra) if k in own}
        store_keys = {f.name for f in fields(StoreConfig)}
        unknown = sorted(set(extra) - store_keys)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; connector keys are {sorted(own)}, "
                f"store keys are {sorted(store_keys)}"
            )
        if extra.get("remote_url") and "write_mode" not in extra:
            extra["write_mode"] = "write-through"
        return cls(**mine, store=StoreConfig.from_dict(extra))

    def replace(self, **changes) -> "ConnectorConfig":
        return dataclasses.replace(self, **changes)

    @property
    def lookup_timeout_s(self) -> float:
        """How long a scheduler in another process than the store's worker waits for its lookup
        answer: :data:`LOOKUP_TIMEOUT_S`, plus the call deadline of each tier the worker's lookup may
        wait on (a kvtier server's ``remote_timeout_s``, Mooncake's ``mooncake_timeout_s``), so a
        slow tier's hit is a hit as it is for a scheduler in the worker's process. Finite: each
        deadline is at most a day (``StoreConfig``)."""
        store = self.store
        return (LOOKUP_TIMEOUT_S + (store.remote_timeout_s if store.remote_url else 0.0)
                + (store.mooncake_timeout_s if store.mooncake_master else 0.0))


@dataclass(frozen=True)
class EngineKV:
    """The geometry of one engine's KV cache and the identity of its blocks.

    ``format_tag`` names the engine-native byte order of a page (platform, KV
    cache layout, attention spec, hash algorithm) and the computation that fills
    it (:func:`model_computation_digest`). Blocks are stored in that order, so the
    tag is the first link of every key chain: engines whose pages differ, in
    layout or in content, never share a key.
    """

    namespace: Namespace
    page_tokens: int  #: vLLM block size
    hash_tokens: int  #: tokens per entry of ``request.block_hashes``
    num_layers: int
    format_tag: str

    @property
    def layout(self) -> KVLayout:
        return self.namespace.layout

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def pages_per_block(self) -> int:
        return self.layout.block_tokens // self.page_tokens

    def keys(self, hashes: list[bytes], epoch: str = "", adapter: str = "") -> list[BlockKey]:
        """Keys of kvtier blocks 0..n-1, given vLLM's hash of the last page of each.

        ``epoch``: the connector's key epoch (``KvtierConnector.reset_cache``); "" (no reset
        yet) keys as before epochs existed, so a store filled earlier still hits.
        ``adapter``: the request's LoRA adapter, its files and the engine's LoRA settings
        (:mod:`~kvtier.integrations.vllm.lora_digest`), as the namespace's ``adapter``; ""
        (no adapter) keys as before adapters were named."""
        namespace = dataclasses.replace(self.namespace, adapter=adapter) if adapter else self.namespace
        links = [self.format_tag.encode()] + ([b"epoch " + epoch.encode()] if epoch else [])
        root = chain_external_hashes(namespace, links)[-1]
        return chain_external_hashes(namespace, hashes, parent=root)

    def block_hashes(self, request_hashes: list[bytes], num_tokens: int) -> list[bytes]:
        """vLLM's hash of the last hash-block of each full kvtier block within ``num_tokens``."""
        step = self.block_tokens // self.hash_tokens
        n = min(len(request_hashes) * self.hash_tokens, num_tokens) // self.block_tokens
        return [bytes(request_hashes[(i + 1) * step - 1]) for i in range(n)]


#: vLLM ``prefix_caching_hash_algo`` values that are cryptographic hashes (SHA-256)
STRONG_BLOCK_HASHES = ("sha256", "sha256_cbor")


def check_block_hashes(config: ConnectorConfig, cache_config) -> None:
    """Refuse vLLM's non-cryptographic block hashes as key material unless explicitly allowed.

    kvtier's keys chain over vLLM's block hashes: if those can be made to
    collide (xxHash can, by construction, for anyone who picks the input),
    one request can address another's blocks.
    """
    algo = str(getattr(cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in STRONG_BLOCK_HASHES:
        return
    if not config.allow_weak_block_hashes:
        raise ConfigError(
            f"vLLM's prefix_caching_hash_algo is {algo!r}, not a cryptographic hash; kvtier keys blocks on "
            f"it, so colliding prompts could read each other's KV. Run vLLM with "
            f"--prefix-caching-hash-algo sha256 (or sha256_cbor), or set \"allow_weak_block_hashes\": true "
            f"in kv_connector_extra_config to accept the risk")
    if safety.first_time("weak-block-hashes", algo):
        log.warning("kvtier: keying blocks on vLLM's non-cryptographic %r block hashes "
                    "(allow_weak_block_hashes): crafted prompts could collide with others'", algo)


def check_kv_cache_kind(spec, block_tokens: int) -> None:
    """Only KV caches whose pages hold what the connector saves, until it saves them.

    Full attention keeps every page of a request. A sliding window frees the pages that fall
    out of it (the null page takes their place) while the request runs, and the connector
    learns of no free: a kvtier block of more tokens than the window could have its first
    pages freed, and handed to another request, before its last token is computed and the
    block saved. With blocks no longer than the window, a block's first page is still in
    the window when its last token is computed (vLLM frees a page once all its tokens are
    ``window`` behind), and null pages are never saved (scheduler_side.NULL_PAGE). Multi-head
    latent attention (DeepSeek-V2/V3, Kimi) keeps every page as full attention does; its page
    holds one latent row a token instead of K and V (:func:`is_latent`). Every other kind (ring
    buffers, gaps freed in full attention, attention sinks, local chunks, DeepSeek-V4's sparse
    latent caches, Mamba state) keeps or frees pages by rules this connector does not follow:
    refused.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    kind = type(spec)
    if kind is MLAAttentionSpec:
        if getattr(spec, "model_version", None) is not None:
            raise ConfigError(f"KvtierConnector supports dense latent (MLA) KV caches; this model's is "
                              f"{spec.model_version}'s sparse one")
        return
    if kind is SlidingWindowSpec:
        if block_tokens > spec.sliding_window:
            fits = spec.sliding_window // spec.block_size * spec.block_size
            raise ConfigError(
                f"this model attends over a sliding window of {spec.sliding_window} tokens and vLLM frees the "
                f"pages behind it: block_tokens={block_tokens} must be at most the window"
                + (f" (e.g. {fits}, whole pages of {spec.block_size})" if fits else
                   f", and vLLM's pages ({spec.block_size} tokens) are longer than it"))
    elif kind is not FullAttentionSpec:
        raise ConfigError(f"KvtierConnector supports full and sliding-window attention KV caches; this model's is "
                          f"{kind.__name__}")


def is_latent(spec) -> bool:
    """A multi-head latent attention cache: one row a token of ``head_size`` (the compressed KV
    plus the decoupled RoPE key, shared by every head), no separate V."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(spec, MLAAttentionSpec)


def engine_kv(config: ConnectorConfig, vllm_config, kv_cache_config, *, tp_rank: int = 0,
              pp_rank: int = 0) -> EngineKV:
    """Namespace and geometry from vLLM's configuration (both roles see the same).

    The scheduler looks up under ``tp_rank`` 0 of pipeline stage ``pp_rank`` 0 (vLLM gives it
    the first worker's KV cache config: stage 0's layers); each worker keys its own shard of
    its own stage's layers (:func:`_pipeline_stage`).
    """
    check_block_hashes(config, vllm_config.cache_config)
    check_no_context_parallelism(vllm_config.parallel_config)
    check_real_weights(vllm_config.load_config)
    check_weights_from_model_path(vllm_config.load_config, config)
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KvtierConnector supports one KV cache group (full attention), this model has {len(groups)}; "
            "run without the connector or with --disable-hybrid-kv-cache-manager"
        )
    spec = groups[0].kv_cache_spec
    check_kv_cache_kind(spec, config.block_tokens)   # an attention spec: heads, head size, dtype, pages
    latent = is_latent(spec)
    kv_parts = 1 if latent else 2
    if not latent and getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError("KvtierConnector needs K and V of the same head size")
    dtype_name = str(spec.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise ConfigError(f"KV cache dtype {spec.dtype} is not supported; use one of {sorted(_DTYPES)}")
    itemsize = spec.dtype.itemsize
    dense = spec.num_kv_heads * spec.block_size * kv_parts * spec.head_size * itemsize
    if spec.page_size_bytes != dense:
        raise ConfigError(
            f"the KV page is {spec.page_size_bytes} bytes, not the dense {dense} of "
            f"{spec.num_kv_heads} heads x {spec.block_size} tokens x {kv_parts} x {spec.head_size}; "
            "packed or padded pages are not supported"
        )
    page_tokens = spec.block_size
    hash_tokens = kv_cache_config.hash_block_size or page_tokens
    if config.block_tokens % page_tokens or config.block_tokens % hash_tokens:
        raise ConfigError(
            f"block_tokens={config.block_tokens} must be a multiple of vLLM's block size {page_tokens}"
            + (f" and of its hash block size {hash_tokens}" if hash_tokens != page_tokens else "")
        )
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    layout = KVLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=_DTYPES[dtype_name],
        block_tokens=config.block_tokens,
        kv_parts=kv_parts,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
    )
    model_id, revision = _weights_identity(model.model, model.revision)
    namespace = Namespace(
        model_id=config.model_id or model_id,
        layout=layout,
        weights_revision=config.weights_revision if config.weights_revision is not None else revision,
        tenant=config.store.tenant,
    )
    return EngineKV(
        namespace=namespace,
        page_tokens=page_tokens,
        hash_tokens=hash_tokens,
        num_layers=layout.num_layers,
        format_tag=_format_tag(vllm_config, kv_cache_config, spec,
                               _pipeline_stage(parallel, pp_rank, groups[0].layer_names)),
    )


#: vLLM's context parallelism settings, each with its flag
_CONTEXT_PARALLEL_SETTINGS = (("decode_context_parallel_size", "--decode-context-parallel-size"),
                              ("prefill_context_parallel_size", "--prefill-context-parallel-size"))


def check_no_context_parallelism(parallel_config) -> None:
    """Refuse decode or prefill context parallelism: each of vLLM's scheduler block ids then
    stands for ``block_size`` tokens times the context-parallel size, spread over the ranks,
    while kvtier maps tokens to block ids by ``block_size``: it would save and load the wrong
    pages (tokens past a block, under the block's key)."""
    for setting, flag in _CONTEXT_PARALLEL_SETTINGS:
        size = int(getattr(parallel_config, setting, 1) or 1)
        if size > 1:
            raise ConfigError(
                f"KvtierConnector does not support context parallelism ({flag} {size}): vLLM's block ids "
                f"then cover {size} ranks' pages, and kvtier would save and load the wrong ones. Run "
                f"without {flag} (or with 1) to use kvtier, or without --kv-transfer-config to use context "
                "parallelism")


def check_real_weights(load_config) -> None:
    """Refuse ``--load-format dummy``: vLLM's benchmarking mode runs random weights under the real
    model's path and config, so its blocks would carry the real model's keys, and every engine of
    the real weights sharing the store (a disk, a kvtier server) would load their KV."""
    if str(load_config.load_format) == "dummy":
        raise ConfigError(
            "vLLM runs random weights with --load-format dummy, and kvtier keys blocks by the model they "
            "claim to be: engines of the real weights sharing this store would load their KV. Run the "
            "benchmark without --kv-transfer-config, or with the real weights")


#: vLLM 0.32's load formats that read the weights from the model path's files (its default loader)
_MODEL_PATH_LOAD_FORMATS = frozenset({"auto", "hf", "pt", "safetensors", "npcache", "fastsafetensors",
                                      "instanttensor", "mistral"})


def check_weights_from_model_path(load_config, config: ConnectorConfig) -> None:
    """Refuse a load format whose weights may come from elsewhere than the model path (tensorizer's
    URI, a sharded or streamed copy, another process, a plugin's loader) unless ``model_id`` and
    ``weights_revision`` are given: the default namespace names the model path and revision, which
    two engines of two such weight files share, and each would load the other's KV."""
    load_format = str(load_config.load_format)
    if load_format in _MODEL_PATH_LOAD_FORMATS or load_format == "dummy":   # dummy: check_real_weights
        return
    if not config.model_id or config.weights_revision is None:
        raise ConfigError(
            f"with --load-format {load_format} vLLM may load weights other than the model path's, and "
            "kvtier keys blocks by that path: set model_id and weights_revision in "
            "kv_connector_extra_config to name the weights this engine runs")


#: a hub cache's snapshot: ``…/models--{org}--{name}/snapshots/{commit}`` (hub repo names hold no "--")
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


def _weights_identity(model: str, revision: str | None) -> tuple[str, str]:
    """The default ``model_id`` and ``weights_revision``: vLLM's model name or path and its
    ``--revision``. With ``HF_HUB_OFFLINE=1`` vLLM replaces ``--model org/name`` by the path of its
    snapshot in the local hub cache, which differs between hosts (``HF_HOME``, the user's home) for
    the same files: a snapshot path names the repository, and its commit is the revision."""
    snapshot = _HUB_SNAPSHOT.search(str(model))
    if snapshot is None:
        return str(model), revision or ""
    return snapshot["repo"].replace("--", "/"), snapshot["commit"]


def _pipeline_stage(parallel, pp_rank: int, layer_names) -> dict | None:
    """Which layers a worker's pages hold, for the format tag; None without pipeline parallelism.

    With ``--pipeline-parallel-size`` N each stage's worker holds only its own layers (vLLM
    projects the KV cache groups per worker), and ``tp_rank`` is 0 in every stage: without the
    stage in the tag, two stages of as many layers would save other layers' KV under one key,
    and on a shared tier (disk, kvtier server) each would load the other's. The rank and size
    alone do not say which layers either (``VLLM_PP_LAYER_PARTITION`` 8,8,8,8 and 7,8,9,8 give
    stage 1 eight layers each, not the same eight): the layer names do. Absent when N is 1,
    so that the keys of an engine without pipeline parallelism stay what they were.
    """
    size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if not 0 <= pp_rank < size:
        raise ConfigError(f"pipeline stage {pp_rank} of {size}: not a stage of this engine")
    if size == 1:
        return None
    layers = hashlib.sha256("\n".join(sorted(layer_names)).encode()).hexdigest()[:32]
    return {"rank": pp_rank, "size": size, "layers": layers}


#: vLLM's spellings of one KV cache format ("fp8" is "fp8_e4m3" on every platform and backend of vLLM 0.32)
_CACHE_DTYPE_SYNONYMS = {"fp8": "fp8_e4m3"}


def _page_dtype(cache_dtype: str, spec) -> str:
    """The KV cache's format, one name for one format: ``auto`` is the dtype of the pages vLLM
    allocated (the model's), a synonym its canonical name."""
    if cache_dtype == "auto":
        return str(spec.dtype).removeprefix("torch.")
    return _CACHE_DTYPE_SYNONYMS.get(cache_dtype, cache_dtype)


def _format_tag(vllm_config, kv_cache_config, spec, pipeline: dict | None = None) -> str:
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    attention = getattr(vllm_config, "attention_config", None)
    parts = {
        "engine": "vllm",
        "platform": current_platform.device_type,
        "layout": str(kv_cache_config.kv_cache_layout or ""),
        "backend": str(getattr(attention, "backend", None) or "auto"),
        "spec": type(spec).__name__,
        "kv_cache_dtype": _page_dtype(str(cache.cache_dtype), spec),
        "hash": str(cache.prefix_caching_hash_algo),
        "model": model_computation_digest(vllm_config),
    }
    if pipeline is not None:
        parts["pipeline_stage"] = pipeline
    if current_platform.device_type == "cpu":
        # the CPU kernels' page layout depends on the host (AMX or not) and the model dtype: cpu_pages
        from kvtier.integrations.vllm.cpu_pages import page_format

        requested = getattr(attention, "backend", None)
        parts["page_format"] = page_format(spec, str(cache.cache_dtype),
                                           getattr(requested, "name", None) or (str(requested) if requested else None),
                                           model_dtype=getattr(vllm_config.model_config, "dtype", None))
    return "vllm-page/1 " + json.dumps(parts, sort_keys=True)
