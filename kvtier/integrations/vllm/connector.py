"""``KvtierConnector``: kvtier behind vLLM's KV-connector API (``KVConnectorBase_V1``).

vLLM builds one instance per role. The scheduler-side instance answers how many
prompt tokens kvtier holds and plans loads and saves
(:mod:`~kvtier.integrations.vllm.scheduler_side`); the worker-side instance moves
the bytes (:mod:`~kvtier.integrations.vllm.worker_side`). Both take their store
from ``kv_connector_extra_config`` (:mod:`~kvtier.integrations.vllm.config`) and,
in one process, share it (:mod:`~kvtier.integrations.vllm.shared_store`).

``kv_role``: ``kv_both`` loads and saves, ``kv_producer`` (a prefill instance)
only saves, ``kv_consumer`` (a decode instance) only loads.

**Reset** (``reset_cache``: vLLM's ``reset_prefix_cache(reset_connector=True)``, which
``pause_generation(clear_cache=True)`` for a weight update, ``release_kv_cache_memory``
and ``POST /reset_prefix_cache?reset_external=true`` call): every later lookup misses
what was stored before. The store is shared (a disk tier, a kvtier server, other engines),
so nothing is deleted: the scheduler draws a fresh random key epoch, part of the root of
every key from then on, and sends it to the workers with each step's metadata; the old
blocks age out. The epoch lives in this engine process only: other engines sharing the
store still see the old blocks (reset them too), they do not see this engine's blocks
saved after the reset, and a restarted engine keys as before any reset (the blocks of its
weights on disk). Random, not counted: an epoch is never reused by a restart or another
engine for other weights. Weights that change and are kept across restarts, or shared by
several engines, need a new ``weights_revision``.

**KV events** (vLLM's ``--kv-events-config``): vLLM publishes its GPU pool's events; the
connector adds ``BlockStored`` / ``BlockRemoved`` of medium ``"CPU"`` for the blocks the host
tier holds (``take_events``), so that a router prices a worker's DRAM copies after vLLM evicted
its pages (:mod:`~kvtier.integrations.vllm.host_events`). A store without a host tier publishes
none (a disk or shared tier is no CPU medium); a reset removes them all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.integrations import poison as poisoning
from kvtier.integrations.vllm import cpu_windows, shared_store
from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV, engine_kv
from kvtier.integrations.vllm.host_events import HostBlock, HostEvents, HostResidency, Removed, host_tier
from kvtier.integrations.vllm.lookup_service import LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm.lora_digest import AdapterKeys, lora_settings
from kvtier.integrations.vllm.metadata import KvtierHandshake, KvtierMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """Show kvtier's log lines (store closed and flushed, failed loads) in vLLM's log.

    vLLM configures its own ``vllm`` logger only; kvtier's loggers would reach no
    handler, and INFO lines such as the shutdown flush report would vanish. Done
    only when the application configured neither the ``kvtier`` logger nor the root.
    """
    ours = logging.getLogger("kvtier")
    if ours.handlers or logging.getLogger().handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False

#: how long a step with no forward pass waits for an asynchronous load to end
IDLE_WAIT_S = 0.05


def _kv_event_ranks(vllm_config: "VllmConfig") -> int | None:
    """The workers whose host tiers must all hold a block for a CPU-medium ``BlockStored``;
    None when no KV events are published (or the ranks are not told apart here)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        return None
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        log.info("kvtier: no CPU-medium KV events with prefill context parallelism")
        return None
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def _host_blocks(config: ConnectorConfig, engine: EngineKV) -> int:
    """The most blocks the host tier can hold (each takes at least a block's bytes)."""
    return config.store.host_bytes // engine.layout.block_nbytes + 1


def _block_describer(engine: EngineKV):
    """``describe(request, index)``: kvtier block ``index`` of a vLLM request as its CPU-medium
    ``BlockStored`` states it, page by page as vLLM's own GPU events do (``BlockPool``)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    page, pages, per_page = engine.page_tokens, engine.pages_per_block, engine.page_tokens // engine.hash_tokens

    def describe(request, index: int) -> HostBlock:
        hashes, first = request.block_hashes, index * pages
        start = first * page
        extra, mm = [], 0
        for j in range(pages):
            keys, mm = generate_block_hash_extra_keys(request, start + j * page, start + (j + 1) * page, mm)
            extra.append(keys)
        lora = request.lora_request
        return HostBlock(
            page_hashes=tuple(hashes[(j + 1) * per_page - 1] for j in range(first, first + pages)),
            parent=hashes[first * per_page - 1] if first else None,
            token_ids=array("q", request.all_token_ids[start:start + pages * page]),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            session_id=getattr(request, "session_id", None),
        )

    return describe


def _vllm_events(items: list, engine: EngineKV, kv_cache_config: "KVCacheConfig") -> list["KVCacheEvent"]:
    """:mod:`~kvtier.integrations.vllm.host_events`'s events as vLLM's, fields as its GPU pool's
    (hashes as its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` says; the connector's one KV cache
    group, 0, with its spec's kind)."""
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    kind, window = get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
    events = []
    for item in items:
        hashes = [maybe_convert_block_hash(h) for h in item.page_hashes]
        if isinstance(item, Removed):
            events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=0))
            continue
        events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if item.parent is None else maybe_convert_block_hash(item.parent),
            token_ids=item.token_ids.tolist(), block_size=engine.page_tokens, lora_id=item.lora_id,
            medium=MEDIUM_CPU, lora_name=item.lora_name, extra_keys=item.extra_keys, group_idx=0,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window, session_id=item.session_id))
    return events


def _smallest_window(kv_cache_config) -> int | None:
    """The sliding window of the KV cache group the connector moves pages of (the first), where
    vLLM frees a request's pages that fall out of it (a sliding-window spec; None otherwise), so
    that a save planned again after a failed load does not read them (audit s33 a9 D1). A hybrid
    model under this connector has its sliding layers unified into a full-attention group that
    still names a window but frees nothing: taken as a window, its held blocks were never saved
    (audit s33 r10 D1)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if not groups:
        return None
    spec = groups[0].kv_cache_spec
    window = getattr(spec, "sliding_window", None)
    frees = type(spec).__name__ in ("SlidingWindowSpec", "SlidingWindowMLASpec")
    return window if frees and isinstance(window, int) and window > 0 else None


def _kv_owning_layers(kv_cache_config) -> frozenset[str] | None:
    """The layers the connector's KV cache config names, over all its groups: the layers that own
    KV pages. None where that config is unknown (none, or no groups)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    return frozenset(name for group in groups for name in group.layer_names)


def _layers_to_store(kv_caches: dict[str, "torch.Tensor"], owners: frozenset[str] | None) -> dict[str, "torch.Tensor"]:
    """The registered caches of the layers that own their KV, in vLLM's order.

    With cross-layer KV sharing (Gemma 3n, Gemma 4: the last ``num_kv_shared_layers`` layers attend
    over an earlier layer's KV) vLLM registers the sharing layers too, each as its target's tensor.
    Their KV is not theirs: it is stored and loaded once, with the owner, whose tensor the sharing
    layer reads. vLLM builds the connector from the KV cache config before it adds the sharing layers
    (gpu_worker.py, "NOTE(Kuntai)"), so that config names the owners only. All layers are kept
    where the config is unknown or names none of them (the layout's count check then judges)."""
    if owners is None:
        return kv_caches
    owned = {name: kv for name, kv in kv_caches.items() if name in owners}
    return owned or kv_caches


def _leaf_connectors(connector) -> Iterable[KVConnectorBase_V1]:
    """The connectors of vLLM's KV transfer group, MultiConnectors opened at any depth."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if isinstance(connector, MultiConnector):
        for child in connector._connectors:
            yield from _leaf_connectors(child)
    else:
        yield connector


def _other_handshakes() -> bool:
    """Whether a connector beside kvtier in this worker's KV transfer group hands vLLM a handshake.
    Neither a MultiConnector (its children are asked) nor a kvtier connector is asked: either would
    ask this one back, without end."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False
    return any(c.get_handshake_metadata() is not None for c in _leaf_connectors(get_kv_transfer_group())
               if not isinstance(c, KvtierConnector))


class KvtierConnector(KVConnectorBase_V1):
    #: whether this connector's handshake reaches the scheduler: only the worker of pipeline stage 0,
    #: TP rank 0 (set in ``__init__``) hands its format tag over
    _hands_tag_over = False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a lost save is a future miss, not a lost hand-off

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        # The scheduler keys as TP rank 0 of pipeline stage 0 (vLLM gives it the first worker's KV
        # cache config). With pipeline parallelism each stage keys its own layers (config's
        # _pipeline_stage) and serves lookups on its own socket; the scheduler asks stage 0's, and a
        # block another stage lacks is a failed load there, which vLLM gathers from every worker
        # (load_failure_policy: recomputed, or the request fails).
        tp_rank = pp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
            pp_rank = get_pp_group().rank_in_group
        self.engine = engine_kv(self.config, vllm_config, kv_cache_config, tp_rank=tp_rank, pp_rank=pp_rank)
        # named now, as engine_kv counted them: vLLM 0.32 adds the KV-sharing layers to a copy of this
        # config (initialize_kv_cache), and one that added them to this object would change nothing here
        self._kv_owning_layers = _kv_owning_layers(kv_cache_config)
        # vLLM keys each worker's handshake (pp_rank, tp_rank) and the scheduler reads (0, 0) only;
        # a handshake of another stage reaches every sub-connector of a MultiConnector, and those
        # without a handshake of their own refuse pp_rank > 0 (the engine fails to start)
        self._hands_tag_over = role == KVConnectorRole.WORKER and tp_rank == 0 and pp_rank == 0
        engine_id = str(transfer.engine_id)
        # CPU-medium KV events: with vLLM's KV events on and a host tier (module docstring), pages
        # named by whole hash-blocks (one KV cache group: always)
        ranks = (_kv_event_ranks(vllm_config)
                 if self.config.store.host_bytes and self.engine.page_tokens % self.engine.hash_tokens == 0 else None)
        self.host_events: HostEvents | None = None
        self.store = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._lookup_server: LookupServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM builds the worker first: if it runs in this process, share its store.
            self.store = shared_store.worker_store(engine_id)
            bounded: frozenset[str] = frozenset()
            if self.store is not None:
                # which tier holds each block, too; through self.store, which shutdown clears
                lookup = lambda keys: self.store.lookup(keys)  # noqa: E731
                # small loads from these run in the forward's step (ConnectorConfig.sync_load_max_bytes)
                bounded = frozenset(t.name for t in self.store.tiers if t.bounded_reads)
            else:
                lookup = LookupClient(socket_path(engine_id), timeout_s=self.config.lookup_timeout_s).lookup
            if transfer.kv_load_failure_policy != self.config.load_failure_policy:
                # Read by vLLM's scheduler right after it builds this connector.
                log.info("kvtier: kv_load_failure_policy=%s (a failed load is recomputed)",
                         self.config.load_failure_policy)
                transfer.kv_load_failure_policy = self.config.load_failure_policy
            if ranks is not None:
                self.host_events = HostEvents(ranks, _block_describer(self.engine),
                                              _host_blocks(self.config, self.engine))
            self.scheduler = SchedulerSide(
                self.config, self.engine, lookup,
                loads=transfer.kv_role in ("kv_both", "kv_consumer"),
                saves=transfer.kv_role in ("kv_both", "kv_producer"),
                bounded_tiers=bounded,
                host_events=self.host_events,
                adapters=AdapterKeys(lora_settings(vllm_config)),
                window_tokens=_smallest_window(kv_cache_config),
            )
        else:
            self.store = shared_store.acquire(self.config.store, self.engine.layout,
                                              flush_timeout_s=self.config.shutdown_flush_s)
            shared_store.register_worker(engine_id, self.store)
            host = host_tier(self.store.tiers)
            residency = None
            if ranks is not None and host is not None:
                rank = pp_rank * vllm_config.parallel_config.tensor_parallel_size + tp_rank
                residency = HostResidency(host, rank, _host_blocks(self.config, self.engine))
            self.worker = WorkerSide(self.engine, self.store, poison=poisoning.enabled(self.config.debug_poison),
                                     residency=residency)
            if tp_rank == 0:
                store = self.store
                self._lookup_server = LookupServer(socket_path(engine_id, pp_rank=pp_rank),
                                                   lambda keys: store.lookup(keys).hit_blocks)
        log.info("kvtier connector (%s): namespace %s, %d-token blocks, %s",
                 role.name, self.engine.namespace.model_id, self.engine.block_tokens,
                 f"tiers {[t.name for t in self.store.tiers]}" if self.store else "lookups via the worker")

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        # The hybrid manager is off with this connector: on CPU that exposes a model of mixed
        # sliding windows to a vLLM decode defect, avoided here (cpu_windows.py).
        self.worker.split_kv_off = cpu_windows.guard(self._vllm_config, self._kv_cache_config)
        self.worker.register(_layers_to_store(kv_caches, self._kv_owning_layers))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtierMetadata):
            self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the forward (sync) or before scheduling (async)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # whole blocks are copied once all layers are done, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvtierMetadata):
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        wait_s = IDLE_WAIT_S if isinstance(meta, KvtierMetadata) and meta.idle_step else 0.0
        return None, (self.worker.finished_loads(wait_s) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_handshake_metadata(self) -> KvtierHandshake | None:
        """The worker's format tag, for the scheduler (:class:`KvtierHandshake`), from the worker
        the scheduler reads (pipeline stage 0, TP rank 0) only. Inside a ``MultiConnector``, which
        passes on only the first sub-connector's metadata that is not None, only if no other
        sub-connector has any: kvtier's would take the place of one that needs it (NIXL's). Then
        the scheduler keeps its own tag, and says so once here."""
        if not self._hands_tag_over:
            return None
        if _other_handshakes():
            log.warning("kvtier connector: another connector of this MultiConnector hands vLLM its handshake, "
                        "so kvtier's format tag does not reach the scheduler; a model whose vLLM code writes "
                        "its config as the worker loads it (Falcon, Llama 4) then gets no hits in a "
                        "multiprocess engine")
            return None
        return KvtierHandshake(self.engine.format_tag)

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata:
        # Names the step this report is of; never empty, so the scheduler sees every report.
        return self.worker.report()

    def shutdown(self) -> None:
        """vLLM's stop signal (worker shutdown, scheduler shutdown): saves reach the store, and
        the last connector of the process closes it, flushing DRAM-only blocks to disk
        within ``shutdown_flush_s`` in all (see :mod:`~kvtier.integrations.vllm.shared_store`)."""
        deadline = time.monotonic() + self.config.shutdown_flush_s
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self.worker is not None:
            self.worker.shutdown(timeout_s=self.config.shutdown_flush_s / 2)
        if self.store is not None:
            store, self.store = self.store, None
            shared_store.release(store, flush_timeout_s=max(0.0, deadline - time.monotonic()))

    # -- scheduler side ---------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, rank): m for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        """Key lookups from the format tag of the worker that answers them (stage 0, TP rank 0;
        :class:`KvtierHandshake`): where the worker's model loading changed its config, the tag
        the scheduler computed from its own copy named another root, and no lookup could hit."""
        if self.scheduler is None:
            return
        told = metadata.get((0, 0))
        if not isinstance(told, KvtierHandshake) or told.format_tag == self.engine.format_tag:
            return
        log.warning("kvtier connector: the worker keys blocks from another model digest than this scheduler "
                    "(vLLM's code for this model changed its config while the worker loaded it); lookups "
                    "follow the worker's keys")
        self.engine = dataclasses.replace(self.engine, format_tag=told.format_tag)
        self.scheduler.engine = self.engine

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """vLLM's prefix cache: which LoRA adapter versions it holds pages of is forgotten at each of
        its resets (:meth:`~kvtier.integrations.vllm.lora_digest.AdapterKeys.watch_prefix_cache`)."""
        if self.scheduler is not None:
            self.scheduler.adapters.watch_prefix_cache(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        ours = isinstance(worker_meta, KvtierWorkerMetadata)
        self.scheduler.update(connector_output.finished_recving, connector_output.invalid_block_ids,
                              worker_meta.step if ours else None, worker_meta.adapter_dropped if ours else None)
        if isinstance(worker_meta, KvtierWorkerMetadata):
            self.scheduler.host_report(worker_meta.host)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """The CPU-medium events since the last call (vLLM publishes them after its GPU pool's)."""
        if self.host_events is None:
            return ()
        items = self.host_events.take()
        return _vllm_events(items, self.engine, self._kv_cache_config) if items else ()

    def reset_cache(self) -> bool:
        """Every later lookup misses what was stored before (a new key epoch; see the module's
        docstring). True: vLLM treats the connector's cache as cleared."""
        return self.scheduler.reset() if self.scheduler is not None else False

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    # -- introspection ------------------------------------------------------------------
    def stats(self) -> dict:
        side = self.scheduler or self.worker
        return {"role": self.role.name, **{k: getattr(side.stats, k) for k in side.stats.__slots__},
                **({"poison": self.worker.poison, "split_kv_off": self.worker.split_kv_off}
                   if self.worker is not None else {}),
                "store": self.store.stats() if self.store is not None else None}
