"""Debug poisoning of the memory a load writes, so that a load that writes nothing is caught.

A load that reports success without writing leaves whatever the memory held
before: often the very KV a test expects, because the test computed the same
prompt a moment earlier into the same storage or pages. Outputs then match and
the test passes on a broken load. With poisoning on, the integrations fill that
memory with NaN (floating KV) or a 0xFF byte pattern (staging buffers and any
other dtype; 0xFF bytes read as NaN in fp32, fp16 and bf16) right before each
load, so a skipped write turns into NaN logits and a failed comparison.

On when ``$KVTIER_DEBUG_POISON`` is ``1`` (the test suite sets it for every
process it starts) or when an integration is asked explicitly. It costs one
memory fill per load, outside the timed path; leave it off in production.
"""

from __future__ import annotations

import os

import numpy as np

ENV = "KVTIER_DEBUG_POISON"
#: the byte written into poisoned raw buffers; as fp32/fp16/bf16 it is a NaN
BYTE = 0xFF


def enabled(explicit: bool | None = None) -> bool:
    """``explicit`` if given, else ``$KVTIER_DEBUG_POISON`` (1/true/yes/on)."""
    if explicit is not None:
        return bool(explicit)
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def fill_bytes(buf: np.ndarray) -> None:
    """Overwrite a raw buffer (any numpy dtype) with the poison byte pattern."""
    buf.view(np.uint8)[...] = BYTE


def fill_tensor(tensor) -> None:
    """Overwrite a torch tensor: NaN for floating dtypes, the byte pattern for others."""
    if tensor.dtype.is_floating_point:
        tensor.fill_(float("nan"))  # fp8 included: both fp8 formats have a NaN
    else:
        tensor.fill_(-1)  # all bits set: the byte pattern, in any integer width
