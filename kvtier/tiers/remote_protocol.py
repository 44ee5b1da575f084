"""The kvtier wire protocol (version 1): frames shared by :mod:`kvtier.server` and :mod:`kvtier.tiers.remote`.

It lives with the client so that imports point down (server → tiers), never up.

Every message, in both directions, is one frame::

    header  22 bytes, little-endian:
            magic "KV" | version u8 | op u8 | code u16 | req_id u32 | meta_len u32 | data_len u64
    meta    meta_len bytes: a fixed binary layout per op (keys are raw 32-byte
            strings) or, for HELLO / STATS / ADMIN, a msgpack map (never pickle)
    data    data_len bytes: block payload only (PUT requests, GET replies)

``code`` is 0 in requests; in replies it is a per-key :class:`~kvtier.tiers.base.Status`
value or, in an ``ERROR`` frame, an :class:`ErrorCode`. Every length is checked
against :func:`check_request` *before* anything is allocated; a frame that fails
a check gets one ``ERROR`` frame and the connection is closed.

Requests and replies (replies echo ``op`` and ``req_id``):

=========  ===================================================  =======================================
op         request meta (data)                                  reply
=========  ===================================================  =======================================
HELLO      msgpack {token, namespace, client}                   msgpack {tenant, namespace, max_block, ...}
PING       --                                                   --
LOOKUP     n keys                                               u32: leading keys present
CONTAINS   n keys                                               n bytes, 1 = present
GET        n x (key, u64 expected nbytes)                       n frames: code = status; if OK, meta =
                                                                block header (128 B), data = payload
PUT        block header | parent key (zeros: none) | session    code = status
           (data: the payload, then its 16-byte xxh3-128)
DELETE     n keys                                               n bytes, 1 = deleted
STATS      --                                                   msgpack map
ADMIN      msgpack {cmd, args}                                  msgpack map (admin token only)
LIST       u64 cursor, u32 limit (0: from the start)           u64 next cursor (0: no more), then the
                                                                namespace's keys, oldest first
           or, older clients: u32 offset, u32 limit             the keys only (offsets up to
                                                                ``LIST_MAX_OFFSET``)
ERROR      (server only) meta = UTF-8 message                   the server closes the connection
=========  ===================================================  =======================================

The block header is :func:`kvtier.core.payload.pack_header`: it carries the
client key, the payload size and (in GET replies) its xxh3-128 checksum, so both
ends verify what crossed the wire and a torn or swapped transfer is a miss.

A PUT carries its checksum as a *trailer* after the payload (the header's
checksum field is ignored): the client hashes each piece just before sending it
and the server each piece right after receiving it, while the bytes are in
cache -- a separate pass over a cold 8 MiB block costs as much as sending it.
The server stores the header with the checksum it verified.

A *sealed* PUT (block header flag ``FLAG_SEALED`` instead of ``FLAG_CHECKSUM``)
carries an AEAD block (:mod:`kvtier.crypto.aead`) that only the client can
open: its trailer is 16 zero bytes, the server hashes nothing, and it serves
the block with the same flag. A client accepts a sealed GET reply only where it
opens (authenticates) the payload itself, never as a plain checksummed block.
Servers that take sealed PUTs say ``"sealed"`` in the HELLO reply's ``features``.

``LIST`` pages after an opaque cursor (``"list_cursor"`` in ``features``): a
page costs the server O(page) however large the namespace, and a listing sees
every block present throughout exactly once. The 8-byte offset form of version
1 clients is still answered (the meta length tells the forms apart), but only a
few pages deep: walking to an offset costs the server the offset.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from kvtier.core.keys import KEY_BYTES
from kvtier.core.payload import HEADER_NBYTES as BLOCK_HEADER_NBYTES

MAGIC = b"KV"
VERSION = 1
SUPPORTED_VERSIONS = (1,)

HEADER = struct.Struct("<2sBBHIIQ")
HEADER_NBYTES = HEADER.size  # 22

#: most keys in one LOOKUP / CONTAINS / GET / DELETE (a 4 M-token prompt at 256 tokens a block)
MAX_KEYS = 16384
MAX_HELLO_META = 4096
MAX_ADMIN_META = 64 * 1024
MAX_SESSION_BYTES = 64
GET_ITEM = struct.Struct("<32sQ")
PUT_FIXED_META = BLOCK_HEADER_NBYTES + KEY_BYTES
NO_PARENT = bytes(KEY_BYTES)
CHECKSUM_NBYTES = 16  #: the xxh3-128 trailer of a PUT
#: what this server version offers beyond version 1's frames (HELLO reply ``features``)
FEATURES = ("sealed", "list_cursor")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
LIST_ARGS = struct.Struct("<II")  #: offset, limit (version 1 clients)
LIST_CURSOR_ARGS = struct.Struct("<QI")  #: cursor, limit
#: the deepest offset the offset form of LIST is answered for (4 pages of MAX_KEYS)
LIST_MAX_OFFSET = 4 * 16384

# What a *client* accepts in a reply, checked on the frame header before anything is read
# or allocated: a hostile or broken server must not make a client allocate what it announces.
# Replies whose size the request fixes (LOOKUP, CONTAINS, DELETE, LIST, GET, PUT) are checked
# against the request itself; the msgpack replies against these constants.
MAX_MAP_REPLY = 1 << 20  #: HELLO and STATS replies (a few hundred bytes in practice)
MAX_ADMIN_REPLY = 16 << 20  #: ADMIN replies (usage of every tenant, audit excerpts)
MAX_ERROR_MESSAGE = 4096  #: the part of an ERROR frame's message a client reads


class Op(enum.IntEnum):
    HELLO = 1
    PING = 2
    LOOKUP = 3
    CONTAINS = 4
    GET = 5
    PUT = 6
    DELETE = 7
    STATS = 8
    ADMIN = 9
    LIST = 10
    ERROR = 255


class ErrorCode(enum.IntEnum):
    """Connection-level errors: one ERROR frame, then the server closes."""

    BAD_MAGIC = 32
    BAD_VERSION = 33
    BAD_OP = 34
    BAD_LENGTH = 35  #: a meta or data length outside the op's limits
    BAD_META = 36  #: meta that does not parse for its op
    NOT_AUTHENTICATED = 37  #: anything but HELLO before a successful HELLO
    AUTH_FAILED = 38
    FORBIDDEN = 39  #: the token may not do this (ADMIN without the admin role, ...)
    TRUNCATED = 40  #: the peer closed in the middle of a frame
    TIMEOUT = 41  #: idle too long, or a frame took too long to arrive
    TOO_MANY_CONNECTIONS = 42
    INTERNAL = 43


#: per-key reply code for a PUT into a namespace the connection may only read
PUT_FORBIDDEN = int(ErrorCode.FORBIDDEN)

_OPS = {int(op) for op in Op} - {int(Op.ERROR)}
_KEY_OPS = {int(Op.LOOKUP), int(Op.CONTAINS), int(Op.DELETE)}


class Header(NamedTuple):
    version: int
    op: int
    code: int
    req_id: int
    meta_len: int
    data_len: int


class ProtocolError(Exception):
    """A frame broke the protocol; ``code`` is what the server answers before closing."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def pack_header(op: int, req_id: int, meta_len: int = 0, data_len: int = 0, code: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, code, req_id & 0xFFFFFFFF, meta_len, data_len)


def unpack_header(buf) -> Header:
    """Parse a frame header; raises :class:`ProtocolError` on a bad magic or version."""
    magic, version, op, code, req_id, meta_len, data_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {magic!r}: not a kvtier client (expected {MAGIC!r})")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {version} is not supported; this server speaks {SUPPORTED_VERSIONS}",
        )
    return Header(version, op, code, req_id, meta_len, data_len)


def check_request(h: Header, max_block: int) -> None:
    """Reject a request header whose op or lengths are out of bounds (nothing allocated yet)."""
    if h.op not in _OPS:
        raise ProtocolError(ErrorCode.BAD_OP, f"unknown op {h.op}")
    if h.code != 0:
        raise ProtocolError(ErrorCode.BAD_META, f"request code must be 0, got {h.code}")
    op = h.op
    if op == Op.PUT:
        if not PUT_FIXED_META <= h.meta_len <= PUT_FIXED_META + MAX_SESSION_BYTES:
            raise ProtocolError(ErrorCode.BAD_LENGTH, f"PUT meta of {h.meta_len} bytes")
        if not CHECKSUM_NBYTES < h.data_len <= max_block + CHECKSUM_NBYTES:
            raise ProtocolError(
                ErrorCode.BAD_LENGTH,
                f"PUT data of {h.data_len} bytes; this server takes a payload of 1..{max_block} bytes + checksum",
            )
        return
    if h.data_len != 0:
        raise ProtocolError(ErrorCode.BAD_LENGTH, f"{Op(op).name} carries no payload, got data_len={h.data_len}")
    if op in _KEY_OPS:
        _check_items(h, KEY_BYTES)
    elif op == Op.GET:
        _check_items(h, GET_ITEM.size)
    elif op == Op.HELLO:
        if not 0 < h.meta_len <= MAX_HELLO_META:
            raise ProtocolError(ErrorCode.BAD_LENGTH, f"HELLO meta of {h.meta_len} bytes")
    elif op == Op.LIST:
        if h.meta_len not in (LIST_ARGS.size, LIST_CURSOR_ARGS.size):
            raise ProtocolError(ErrorCode.BAD_LENGTH, f"LIST meta must be {LIST_CURSOR_ARGS.size} bytes (cursor form) "
                                                      f"or {LIST_ARGS.size} (offset form), got {h.meta_len}")
    elif op == Op.ADMIN:
        if not 0 < h.meta_len <= MAX_ADMIN_META:
            raise ProtocolError(ErrorCode.BAD_LENGTH, f"ADMIN meta of {h.meta_len} bytes")
    elif h.meta_len != 0:  # PING, STATS
        raise ProtocolError(ErrorCode.BAD_LENGTH, f"{Op(op).name} carries no meta, got meta_len={h.meta_len}")


def check_reply(h: Header, op: int, *, meta: tuple[int, int], data: tuple[int, int] = (0, 0)) -> None:
    """Reject a reply header (client side) unless it answers ``op`` with a meta length and a data
    length within the inclusive bounds the request allows; raises :class:`ProtocolError`."""
    if h.op != op:
        raise ProtocolError(ErrorCode.BAD_OP, f"{_op_name(op)} answered with op {h.op}")
    if not meta[0] <= h.meta_len <= meta[1]:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"{_op_name(op)} reply announces {h.meta_len} meta bytes; the request allows {meta[0]}..{meta[1]}")
    if not data[0] <= h.data_len <= data[1]:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"{_op_name(op)} reply announces {h.data_len} data bytes; the request allows {data[0]}..{data[1]}")


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"


def _check_items(h: Header, item: int) -> None:
    if h.meta_len == 0 or h.meta_len % item or h.meta_len // item > MAX_KEYS:
        raise ProtocolError(
            ErrorCode.BAD_LENGTH, f"{Op(h.op).name} meta must be 1..{MAX_KEYS} items of {item} bytes, got {h.meta_len}"
        )


def split_keys(meta) -> list[bytes]:
    mv = memoryview(meta)
    return [bytes(mv[i : i + KEY_BYTES]) for i in range(0, len(mv), KEY_BYTES)]


class PutMeta(NamedTuple):
    block_header: bytes
    parent: bytes | None
    session: str


def pack_put_meta(block_header: bytes, parent: bytes | None, session: str = "") -> bytes:
    raw_session = session.encode("utf-8")
    if len(raw_session) > MAX_SESSION_BYTES:
        raise ValueError(f"session id is {len(raw_session)} bytes; use at most {MAX_SESSION_BYTES}")
    if len(block_header) != BLOCK_HEADER_NBYTES:
        raise ValueError("block header has the wrong size")
    return block_header + (parent if parent else NO_PARENT) + raw_session


def unpack_put_meta(meta: bytes) -> PutMeta:
    parent = meta[BLOCK_HEADER_NBYTES:PUT_FIXED_META]
    try:
        session = meta[PUT_FIXED_META:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_META, "PUT session id is not UTF-8") from exc
    return PutMeta(meta[:BLOCK_HEADER_NBYTES], None if parent == NO_PARENT else parent, session)


def unpack_msgpack(meta: bytes, what: str) -> dict:
    """Decode a msgpack map with bounded sizes; raises :class:`ProtocolError` if it is not one."""
    import msgpack

    try:
        value = msgpack.unpackb(
            meta,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_ADMIN_META,
            max_bin_len=MAX_ADMIN_META,
            max_array_len=1024,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the peer's bad frame
        raise ProtocolError(ErrorCode.BAD_META, f"{what} meta is not msgpack ({type(exc).__name__})") from exc
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_META, f"{what} meta must be a msgpack map")
    return value


def pack_msgpack(value: dict) -> bytes:
    import msgpack

    return msgpack.packb(value, use_bin_type=True)
