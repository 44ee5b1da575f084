"""What the scheduler-side connector tells the worker side each step, and what a worker
tells it back.

Plain dataclasses of ints, strings and bytes (and tuples of them): vLLM may send them to another
process.
A kvtier block spans ``pages_per_block`` vLLM pages; a transfer names the
pages of one block it reads or writes, from page ``first`` of the block on.

Steps are numbered by the scheduler's builds (0, 1, 2, ...). With more than one batch in
flight (async scheduling, pipeline parallelism) vLLM builds step N+1 before it takes step
N's report, so a step carries both its own number and the last step whose report the
scheduler had taken (``reported_step``); each worker names the step of its report
(:class:`KvtierWorkerMetadata`), and which saved blocks its host tier took or lost since its
last report (:mod:`~kvtier.integrations.vllm.host_events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata, KVConnectorMetadata,
                                                                KVConnectorWorkerMetadata)

from kvtier.integrations.vllm.host_events import HostReport, merge_reports
from kvtier.integrations.vllm.lora_digest import AdapterFiles


@dataclass(slots=True)
class KvtierHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once, after its KV caches are registered: the format
    tag its keys start from (``EngineKV.format_tag``). The tag digests the model config as the
    worker runs it, and vLLM's code for some models writes config fields while a worker loads
    the model (Falcon's ``num_ln_in_parallel_attn``, Llama 4's ``attn_temperature_tuning``):
    a scheduler in another process keeps the config as it was, and keyed its lookups from
    another root than the worker's saves (every lookup a miss)."""

    format_tag: str


@dataclass(slots=True)
class BlockTransfer:
    index: int  #: kvtier block index in the request
    first: int  #: first page of the block this transfer covers
    page_ids: list[int]  #: vLLM block ids of pages ``first, first+1, ...``


@dataclass(slots=True)
class LoadJob:
    """Load blocks into a request's pages. ``hashes[i]`` names kvtier block i (from 0)."""

    req_id: str
    hashes: list[bytes]
    blocks: list[BlockTransfer]
    is_async: bool
    #: the request's LoRA adapter as its keys name it (``EngineKV.keys``); "": none
    adapter: str = ""


@dataclass(slots=True)
class SaveJob:
    """Save the full blocks ``blocks`` (whole pages) of a request."""

    req_id: str
    hashes: list[bytes]
    blocks: list[BlockTransfer]
    #: the request's LoRA adapter as its keys name it (``EngineKV.keys``); "": none
    adapter: str = ""
    #: the files ``adapter`` was named from, as they were then (None: no adapter): the worker saves
    #: nothing where they changed by the time vLLM ran the step (it may have read the new ones)
    adapter_files: AdapterFiles | None = None
    #: the step before which the request computed nothing (it was looked up while the scheduler
    #: built the steps before it): a worker on another host vouches for its own copy of the files
    #: only where it saw them, unwritten since, at an earlier step's save (``WorkerAdapterCheck``)
    adapter_since_step: int = 0


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    #: the step runs no forward pass: the worker may block on its loads instead of
    #: returning at once to an engine loop that would spin (and hold the GIL) meanwhile
    idle_step: bool = False
    step: int = 0  #: this step's number
    #: the last step whose report the scheduler had taken when it built this one (-1: none): a
    #: worker whose load failed in a later step drops its saves (their KV may have been
    #: computed over the pages the load left unfilled, and the scheduler has not rewound yet)
    reported_step: int = -1
    #: the key epoch the step's loads and saves use: "" until the first ``reset_cache``
    #: (keys as before any reset), then a fresh random value for each reset
    epoch: str = ""


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's report names its step. Never empty: vLLM then hands the scheduler
    connector every step's report (an empty one it skips), in step order."""

    step: int
    #: blocks its host tier took or lost since the last report: (key epoch, block id) → (rank
    #: bits holding it, rank bits not); empty without KV events or a host tier
    host: HostReport = field(default_factory=dict)
    #: request → the first block of the LoRA saves the worker dropped since the last report (its
    #: adapter's files may not have held the version the job names while vLLM ran the step): the
    #: scheduler cannot always tell from the files (a link flipped away and back, files unreadable
    #: for a moment), and must neither announce those blocks nor save over them
    adapter_dropped: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # The workers (tensor and pipeline ranks) of one step report the same step, each its own
        # host tier under its own rank bit; a save one rank dropped is missing from the store.
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        return KvtierWorkerMetadata(min(self.step, other.step), merge_reports(self.host, other.host),
                                    merge_adapter_drops(self.adapter_dropped, other.adapter_dropped))


def merge_adapter_drops(*reports: dict[str, int]) -> dict[str, int]:
    """Each request's first dropped block over the ranks' reports."""
    merged: dict[str, int] = {}
    for report in reports:
        for req_id, first in report.items():
            merged[req_id] = min(first, merged.get(req_id, first))
    return merged
