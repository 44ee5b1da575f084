"""What the scheduler-side connector tells the worker side each step.

Plain dataclasses of ints and bytes: vLLM may send them to another process.
A kvtier block spans ``pages_per_block`` vLLM pages; a transfer names the
pages of one block it reads or writes, from page ``first`` of the block on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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


@dataclass(slots=True)
class SaveJob:
    """Save the full blocks ``blocks`` (whole pages) of a request."""

    req_id: str
    hashes: list[bytes]
    blocks: list[BlockTransfer]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    #: the step runs no forward pass: the worker may block on its loads instead of
    #: returning at once to an engine loop that would spin (and hold the GIL) meanwhile
    idle_step: bool = False
