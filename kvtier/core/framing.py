"""Tag-length-value framing for everything that is hashed.

Fields are never joined as strings: each is ``tag (1 byte) | length (4 bytes,
big-endian) | value``, so two different field sequences can never produce the
same bytes (``("ab", "c")`` and ``("a", "bc")`` differ in their lengths, an
adapter called like a tenant differs in its tag).
"""

from __future__ import annotations

import struct

_HEAD = struct.Struct(">BI")


def frame(tag: int, value: bytes) -> bytes:
    if not 0 <= tag <= 255:
        raise ValueError(f"frame tag must fit in one byte, got {tag}")
    return _HEAD.pack(tag, len(value)) + value


def frame_str(tag: int, value: str) -> bytes:
    return frame(tag, value.encode("utf-8"))


def frame_int(tag: int, value: int) -> bytes:
    return frame(tag, value.to_bytes(8, "big", signed=True))


def frame_head(tag: int, length: int) -> bytes:
    """The header of a frame whose value the caller feeds to the hash itself."""
    return _HEAD.pack(tag, length)
