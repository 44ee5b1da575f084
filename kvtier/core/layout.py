"""The geometry of one KV block and the checks that guard it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import LayoutError

#: dtypes a block may hold; the names are numpy's except bfloat16, which numpy
#: lacks: a bf16 block travels as raw 2-byte words (``uint16`` in numpy).
DTYPE_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV of ``block_tokens`` tokens for all layers of one TP rank.

    The canonical block is layer-major: ``(num_layers, kv_parts, num_kv_heads,
    block_tokens, head_dim)``, where ``kv_parts`` is 2 (K and V) for ordinary
    attention and 1 for a compressed latent (MLA), so that one layer's KV is one
    contiguous run and an engine can load layer by layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 256
    kv_parts: int = 2
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LayoutError(
                f"unknown KV dtype {self.dtype!r}; use one of {sorted(DTYPE_ITEMSIZE)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "kv_parts", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.kv_parts not in (1, 2):
            raise LayoutError(f"KVLayout.kv_parts must be 1 (MLA latent) or 2 (K and V), got {self.kv_parts}")
        if not isinstance(self.tp_rank, int):   # a float passed every check and broke the namespace root
            raise LayoutError(f"KVLayout.tp_rank must be an int, got {self.tp_rank!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"KVLayout.tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_parts, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.itemsize
        for dim in self.block_shape:
            n *= dim
        return n

    @property
    def bytes_per_token(self) -> int:
        return self.block_nbytes // self.block_tokens

    @property
    def layer_nbytes(self) -> int:
        return self.block_nbytes // self.num_layers

    def check_block(self, block: np.ndarray, what: str = "block") -> None:
        """Raise :class:`LayoutError` naming the mismatch unless ``block`` fits.

        Either the canonical shape with a dtype of the right item size, or any
        C-contiguous buffer of exactly :attr:`block_nbytes` bytes.
        """
        if not isinstance(block, np.ndarray):
            raise LayoutError(f"{what} must be a numpy array, got {type(block).__name__}")
        if not block.flags.c_contiguous:
            raise LayoutError(f"{what} must be C-contiguous (copy it with numpy.ascontiguousarray)")
        if block.nbytes != self.block_nbytes:
            raise LayoutError(
                f"{what} has shape {block.shape} dtype {block.dtype} = {block.nbytes} bytes; "
                f"layout {self.describe()} needs shape {self.block_shape} of {self.dtype} "
                f"= {self.block_nbytes} bytes"
            )
        if block.ndim != 1 and block.itemsize != self.itemsize:
            raise LayoutError(
                f"{what} has dtype {block.dtype} ({block.itemsize} bytes), layout needs {self.dtype}"
            )
        if block.ndim == len(self.block_shape) and block.shape != self.block_shape:
            raise LayoutError(
                f"{what} has shape {block.shape}, layout {self.describe()} needs {self.block_shape}"
            )

    def describe(self) -> str:
        return (
            f"(layers={self.num_layers}, kv_parts={self.kv_parts}, kv_heads={self.num_kv_heads}, "
            f"block_tokens={self.block_tokens}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"tp={self.tp_rank}/{self.tp_size})"
        )

    def empty_block(self) -> np.ndarray:
        """A fresh uint8 buffer of one block (for callers that want raw bytes)."""
        return np.empty(self.block_nbytes, dtype=np.uint8)
