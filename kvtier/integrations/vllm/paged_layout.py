"""vLLM's paged KV cache as the worker sees it, and copies between its pages and kvtier blocks.

The layout is read from the tensors vLLM registers, never assumed: one view
per attention layer, ``[num_pages, heads, page_tokens, content]`` logically
(``[num_pages, page_tokens, latent]`` for multi-head latent attention), with
whatever strides the attention backend's KV cache layout gave it. How K
and V sit inside ``content`` (side by side, or K rows then V rows as the CPU
backend does) is the backend's business: pages are copied whole, in the
backend's byte order, and :class:`~kvtier.integrations.vllm.config.EngineKV`
binds that order into every key.

A kvtier block is layer-major: ``(layers, pages_per_block, *page_shape)``, so
one layer's pages are one contiguous run.

Thread safety: ``gather`` and ``scatter`` may run on any thread; callers make
sure no two touch the same pages at once (vLLM does not reuse a page while a
load into it is in flight: the scheduler keeps it until the load is reported).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from kvtier.errors import LayoutError
from kvtier.integrations.vllm.config import EngineKV
from kvtier.integrations.vllm.metadata import BlockTransfer

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class PagedKV:
    """The registered per-layer caches of one worker, in layer order."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], engine: EngineKV) -> None:
        if not kv_caches:
            raise LayoutError("vLLM registered no KV cache tensors")
        names = sorted(kv_caches, key=_layer_index)
        self.layers = [kv_caches[name] for name in names]
        self.layer_names = names
        first = self.layers[0]
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.pages_per_block = engine.pages_per_block
        if len(self.layers) != engine.num_layers:
            raise LayoutError(f"vLLM registered {len(self.layers)} KV layers, its KV cache config has {engine.num_layers}")
        for name, kv in zip(names, self.layers):
            if tuple(kv.shape[1:]) != self.page_shape or kv.dtype != self.dtype:
                raise LayoutError(f"layer {name} has pages {tuple(kv.shape[1:])} {kv.dtype}, layer {names[0]} "
                                  f"{self.page_shape} {self.dtype}: layers must share one page shape")
        self.page_nbytes = math.prod(self.page_shape) * self.dtype.itemsize
        want = engine.layout.layer_nbytes // self.pages_per_block
        # A latent (MLA) cache may have no heads axis: [pages, tokens, latent] (the CPU backend
        # keeps one of 1). Pages are copied whole either way; the axes are checked only to
        # catch a layout whose page is not a run of whole tokens.
        latent = engine.layout.kv_parts == 1
        tokens_axis = 0 if latent and first.dim() == 3 else 1
        heads_ok = not latent or first.dim() == 3 or self.page_shape[0] == 1   # one latent row a token
        if (first.dim() != 4 and not (latent and first.dim() == 3)) or not heads_ok or \
                self.page_shape[tokens_axis] != engine.page_tokens or self.page_nbytes != want:
            shape = (f"[pages, (1,) {engine.page_tokens} tokens, latent]" if latent else
                     f"[pages, heads, {engine.page_tokens} tokens, content]")
            raise LayoutError(
                f"KV pages are {tuple(first.shape)} {self.dtype} ({self.page_nbytes} bytes a page); the layout "
                f"{engine.layout.describe()} needs {shape} of {want} bytes"
            )
        self.block_shape = (len(self.layers), self.pages_per_block, *self.page_shape)
        self.block_nbytes = self.page_nbytes * self.pages_per_block * len(self.layers)
        if self.block_nbytes != engine.layout.block_nbytes:
            raise LayoutError(f"a block of these pages is {self.block_nbytes} bytes, the layout says "
                              f"{engine.layout.block_nbytes}")
        # CPU pages seen as numpy arrays (no copy): loads write them with plain memcpys
        self._host_views = [_numpy_view(kv) for kv in self.layers] if self.device.type == "cpu" else None
        self._np_dtype = self._host_views[0].dtype if self._host_views else None

    def block_view(self, buf: np.ndarray) -> torch.Tensor:
        """A ``block_shape`` tensor over a block's bytes (no copy)."""
        return torch.from_numpy(buf).view(self.dtype).view(self.block_shape)

    def gather(self, transfer: BlockTransfer, out: np.ndarray) -> None:
        """Copy the pages of ``transfer`` into ``out`` (one block's bytes).

        On CPU, as :meth:`scatter`: one ``np.copyto`` per layer and run of consecutive page
        ids. It runs on the engine's thread for every saved block; ``torch.index_select``
        (plus the index tensor it needs) measured 3x the time (~70-100 vs 26 us a block of
        4 layers x 32 KiB, memcpy 11 us).
        """
        lo, hi = transfer.first, transfer.first + len(transfer.page_ids)
        if self._host_views is not None:
            ids = self._check(transfer)
            block = out.view(self._np_dtype).reshape(self.block_shape)
            for start, stop in _runs(ids):
                first = ids[start]
                for layer, kv in enumerate(self._host_views):
                    np.copyto(block[layer, lo + start : lo + stop], kv[first : first + (stop - start)])
            return
        block = self.block_view(out)
        ids = self._ids(transfer)
        for layer, kv in enumerate(self.layers):
            block[layer, lo:hi].copy_(kv.index_select(0, ids))

    def scatter(self, src: np.ndarray, transfer: BlockTransfer) -> None:
        """Copy pages ``transfer.first..`` of a block's bytes (staging, or a read-only view of
        the host pool) into the paged cache.

        On CPU, each run of consecutive page ids is one ``np.copyto`` per layer: a plain
        memcpy that releases the GIL and runs on the calling thread only, where
        ``index_copy_`` measured 1.5x slower (28 vs 20 ms for 64 MiB; memcpy 16 ms) and may
        start an OpenMP team that competes with the engine's forward for the cores.
        """
        ids = self._check(transfer)
        lo = transfer.first
        if self._host_views is None:
            block = self.block_view(src)
            index = self._ids(transfer)
            for layer, kv in enumerate(self.layers):
                part = block[layer, lo : lo + len(ids)]
                kv.index_copy_(0, index, part.to(kv.device, non_blocking=False))
            return
        block = src.view(self._np_dtype).reshape(self.block_shape)
        for start, stop in _runs(ids):
            a, b = lo + start, lo + stop
            first = ids[start]
            for layer, kv in enumerate(self._host_views):
                np.copyto(kv[first : first + (stop - start)], block[layer, a:b])

    def poison(self, transfers: list[BlockTransfer]) -> None:
        """Debug: fill the pages of ``transfers`` with NaN (the byte pattern for non-float
        KV), so that a load that claims them without writing them is caught."""
        ids = torch.tensor([p for t in transfers for p in t.page_ids], dtype=torch.long, device=self.device)
        fill = float("nan") if self.dtype.is_floating_point else -1
        for kv in self.layers:
            kv.index_fill_(0, ids, fill)

    def _check(self, transfer: BlockTransfer) -> list[int]:
        if transfer.first < 0 or transfer.first + len(transfer.page_ids) > self.pages_per_block:
            raise LayoutError(f"pages {transfer.first}..+{len(transfer.page_ids)} exceed a block of "
                              f"{self.pages_per_block}")
        return transfer.page_ids

    def _ids(self, transfer: BlockTransfer) -> torch.Tensor:
        return torch.tensor(self._check(transfer), dtype=torch.long, device=self.device)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` positions of the runs of consecutive values in ``ids``."""
    runs, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            runs.append((start, k))
            start = k
    return runs


def _numpy_view(kv: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, through an integer dtype of the same size where
    numpy has no such float (bfloat16, float8): the bytes are copied, never converted."""
    if kv.dtype in _NUMPY_NATIVE:
        return kv.numpy()
    return kv.view(_SAME_SIZE_INT[kv.dtype.itemsize]).numpy()


_NUMPY_NATIVE = (torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32)
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layer_index(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else 0, name)
