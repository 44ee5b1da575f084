"""Malformed frames (hypothesis strategies) and a concurrent sender that checks every answer.

Every generated frame breaks the protocol in a known way; the server must answer
each with one ERROR frame carrying an :class:`ErrorCode` (one of those expected
for that kind of breakage) and close the connection. Frames that need an
authenticated connection are sent after a valid HELLO on the same connection.
Used by ``tests/server/test_fuzz.py`` (100,000 frames in ``make test``) and
``scripts/fuzz_server.py`` (long runs).
"""

from __future__ import annotations

import random
import selectors
import socket
import time
from dataclasses import dataclass

from hypothesis import strategies as st

from kvtier.tiers.remote_protocol import (
    GET_ITEM,
    HEADER_NBYTES,
    LIST_ARGS,
    LIST_CURSOR_ARGS,
    MAX_ADMIN_META,
    MAX_HELLO_META,
    MAX_KEYS,
    PUT_FIXED_META,
    ErrorCode,
    Op,
    pack_msgpack,
    unpack_header,
)
from kvtier.tiers.remote_protocol import HEADER as _H

E = ErrorCode
VALID_OPS = [int(op) for op in Op if op is not Op.ERROR]
KEY_OPS = [Op.LOOKUP, Op.CONTAINS, Op.DELETE]


#: byte ranges of a frame that never decide its error: the request id, and for
#: some kinds whatever follows the field that is wrong
REQ_ID = (6, 10)


@dataclass(frozen=True)
class Case:
    kind: str
    payload: bytes
    expect: frozenset  #: acceptable error codes
    authed: bool = False  #: send a valid HELLO first
    free: tuple = (REQ_ID,)  #: (start, end) ranges :func:`variants` may rewrite at random


def variants(case: Case, n: int, rng: random.Random) -> list[Case]:
    """``case`` and ``n - 1`` mutants of it: random bytes in its free ranges, same expected error.

    Hypothesis explores the structure (kinds, ops, lengths, cut points); this
    multiplies each structure cheaply, so that 100,000 frames fit in a test run.
    """
    out = [case]
    raw = bytearray(case.payload)
    for _ in range(n - 1):
        for start, end in case.free:
            end = min(end, len(raw))
            if end > start:
                raw[start:end] = rng.randbytes(end - start)
        out.append(Case(case.kind, bytes(raw), case.expect, case.authed, case.free))
    return out


def _hdr(op, meta_len, data_len, *, magic=b"KV", version=1, code=0, req_id=7) -> bytes:
    return _H.pack(magic, version, op, code, req_id, meta_len, data_len)


u8 = st.integers(0, 255)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
small_blob = st.binary(min_size=0, max_size=48)


@st.composite
def bad_magic(draw) -> Case:
    magic = draw(st.binary(min_size=2, max_size=2).filter(lambda m: m != b"KV"))
    rest = draw(st.binary(min_size=HEADER_NBYTES - 2, max_size=HEADER_NBYTES + 40))
    return Case("bad-magic", magic + rest, frozenset({E.BAD_MAGIC}), draw(st.booleans()), ((2, 1 << 16),))


@st.composite
def bad_version(draw) -> Case:
    v = draw(u8.filter(lambda v: v != 1))
    h = _hdr(draw(u8), draw(u32), draw(u64), version=v, code=draw(u16), req_id=draw(u32))
    return Case("bad-version", h + draw(small_blob), frozenset({E.BAD_VERSION}), draw(st.booleans()), ((3, 1 << 16),))


@st.composite
def bad_op(draw) -> Case:
    op = draw(u8.filter(lambda o: o not in VALID_OPS))
    return Case("bad-op", _hdr(op, draw(u32), draw(u64)) + draw(small_blob), frozenset({E.BAD_OP}),
                draw(st.booleans()), ((4, 1 << 16),))


@st.composite
def bad_code(draw) -> Case:
    h = _hdr(draw(st.sampled_from(VALID_OPS)), draw(u32), draw(u64), code=draw(st.integers(1, 0xFFFF)))
    return Case("bad-code", h + draw(small_blob), frozenset({E.BAD_META}), draw(st.booleans()), ((6, 1 << 16),))


@st.composite
def bad_length(draw) -> Case:
    op = draw(st.sampled_from(VALID_OPS))
    if op == Op.PUT:
        meta_len, data_len = draw(st.one_of(
            st.tuples(st.integers(0, PUT_FIXED_META - 1) | st.integers(PUT_FIXED_META + 65, 0xFFFFFFFF), u64),
            st.tuples(st.just(PUT_FIXED_META), st.integers(0, 16) | st.integers((8 << 20) + 17, 2**64 - 1)),
        ))
    else:
        data_len = draw(st.integers(1, 2**64 - 1) | st.just(0))
        if op in KEY_OPS or op == Op.GET:
            item = GET_ITEM.size if op == Op.GET else 32
            bad = st.just(0) | st.integers(1, MAX_KEYS * item).filter(lambda n: n % item) | \
                st.integers(MAX_KEYS * item + 1, 0xFFFFFFFF)
            meta_len = draw(bad if data_len == 0 else u32)
        elif op == Op.HELLO:
            meta_len = draw((st.just(0) | st.integers(MAX_HELLO_META + 1, 0xFFFFFFFF)) if data_len == 0 else u32)
        elif op == Op.ADMIN:
            meta_len = draw((st.just(0) | st.integers(MAX_ADMIN_META + 1, 0xFFFFFFFF)) if data_len == 0 else u32)
        elif op == Op.LIST:
            meta_len = draw(u32.filter(lambda n: n not in (LIST_ARGS.size, LIST_CURSOR_ARGS.size))
                            if data_len == 0 else u32)
        else:  # PING, STATS
            meta_len = draw(st.integers(1, 0xFFFFFFFF) if data_len == 0 else u32)
    # Lengths are checked before authentication: a badly sized frame is refused for its size.
    return Case("bad-length", _hdr(op, meta_len, data_len) + draw(small_blob), frozenset({E.BAD_LENGTH}),
                draw(st.booleans()), (REQ_ID, (HEADER_NBYTES, 1 << 16)))


@st.composite
def not_authenticated(draw) -> Case:
    op = draw(st.sampled_from([Op.PING, Op.STATS, Op.LOOKUP, Op.GET, Op.LIST]))
    meta = {Op.PING: b"", Op.STATS: b"", Op.LIST: bytes(8)}.get(op, b"")
    if op == Op.LOOKUP:
        meta = draw(st.binary(min_size=32, max_size=32)) * draw(st.integers(1, 4))
    if op == Op.GET:
        meta = draw(st.binary(min_size=GET_ITEM.size, max_size=GET_ITEM.size))
    return Case("not-authenticated", _hdr(op, len(meta), 0) + meta, frozenset({E.NOT_AUTHENTICATED}), False,
                (REQ_ID, (HEADER_NBYTES, 1 << 16)))


def _bad_namespace(ns: str) -> bool:
    from kvtier.server.config import check_namespace

    try:
        check_namespace(ns)
    except ValueError:
        return True
    return False


@st.composite
def bad_hello(draw) -> Case:
    meta = draw(st.one_of(
        st.binary(min_size=1, max_size=200),
        st.builds(lambda v: pack_msgpack({"token": v}), st.text(max_size=40)),
        st.builds(lambda v: pack_msgpack({"token": v}), st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=8)),
        st.builds(lambda ns: pack_msgpack({"token": "acme-token-1", "namespace": ns}),
                  st.text(max_size=80).filter(_bad_namespace)),
    ))
    return Case("bad-hello", _hdr(Op.HELLO, len(meta), 0) + meta,
                frozenset({E.BAD_META, E.AUTH_FAILED, E.FORBIDDEN}), False, (REQ_ID, (HEADER_NBYTES, 1 << 16)))


@st.composite
def truncated(draw) -> Case:
    op = draw(st.sampled_from([Op.HELLO, Op.LOOKUP, Op.ADMIN]))
    meta_len = {Op.HELLO: draw(st.integers(2, MAX_HELLO_META)), Op.LOOKUP: 32 * draw(st.integers(1, 64)),
                Op.ADMIN: draw(st.integers(2, 4096))}[op]
    full = _hdr(op, meta_len, 0) + bytes(meta_len)
    cut = draw(st.integers(1, HEADER_NBYTES + meta_len - 1))
    authed = op != Op.HELLO and draw(st.booleans())
    expect = {E.TRUNCATED}
    if not authed and op != Op.HELLO and cut >= HEADER_NBYTES:
        expect = {E.NOT_AUTHENTICATED}
    if authed and op == Op.ADMIN and cut >= HEADER_NBYTES + meta_len:
        expect = {E.FORBIDDEN}
    return Case("truncated", full[:cut], frozenset(expect), authed)


@st.composite
def authed_abuse(draw) -> Case:
    which = draw(st.integers(0, 3))
    if which == 0:
        meta = pack_msgpack({"token": "acme-token-1", "namespace": "x"})
        return Case("hello-twice", _hdr(Op.HELLO, len(meta), 0) + meta, frozenset({E.BAD_OP}), True)
    if which == 1:  # a PUT whose block header is garbage
        data_len = draw(st.integers(17, 2048))
        meta = draw(st.binary(min_size=PUT_FIXED_META, max_size=PUT_FIXED_META + 64))
        return Case("put-garbage-header", _hdr(Op.PUT, len(meta), data_len) + meta + bytes(data_len),
                    frozenset({E.BAD_META}), True, (REQ_ID, (HEADER_NBYTES, 1 << 16)))
    if which == 2:
        meta = pack_msgpack({"cmd": "erase", "args": {"tenant": "globex"}})
        return Case("tenant-admin", _hdr(Op.ADMIN, len(meta), 0) + meta, frozenset({E.FORBIDDEN}), True)
    cut = draw(st.integers(PUT_FIXED_META + HEADER_NBYTES + 1, PUT_FIXED_META + HEADER_NBYTES + 4096))
    from kvtier.core.payload import pack_header as block_header

    meta = block_header(bytes(32), 8192, bytes(16)) + bytes(32)
    full = _hdr(Op.PUT, len(meta), 8192 + 16) + meta + bytes(8192 + 16)
    return Case("put-cut-mid-payload", full[:cut], frozenset({E.TRUNCATED}), True)


frames = st.one_of(bad_magic(), bad_version(), bad_op(), bad_code(), bad_length(), not_authenticated(),
                   bad_hello(), truncated(), authed_abuse())


# -- sending --------------------------------------------------------------------------------
class Outcome:
    def __init__(self) -> None:
        self.sent = 0
        self.ok = 0
        self.failures: list[str] = []
        self.codes: dict[str, int] = {}


def _connect(url: str) -> socket.socket:
    if url.startswith("unix://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(url[len("unix://") :])
    else:
        host, port = url[len("tcp://") :].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
    return s


def _judge(case: Case, data: bytes) -> str | None:
    """None if ``data`` (everything the server sent before closing) is the right answer."""
    pos = 0
    if case.authed:
        h = unpack_header(data[:HEADER_NBYTES])
        if h.op != Op.HELLO or h.code != 0:
            return f"HELLO refused: {h}"
        pos = HEADER_NBYTES + h.meta_len
    if len(data) < pos + HEADER_NBYTES:
        return f"no ERROR frame (got {len(data) - pos} bytes)"
    h = unpack_header(data[pos : pos + HEADER_NBYTES])
    end = pos + HEADER_NBYTES + h.meta_len
    if h.op != Op.ERROR:
        return f"answered op {h.op} code {h.code}, not ERROR"
    if end != len(data):
        return "bytes after the ERROR frame"
    if h.code not in case.expect:
        return f"code {h.code} not in {sorted(int(c) for c in case.expect)}"
    return None


def send_all(url: str, cases: list[Case], hello: bytes, outcome: Outcome, *, inflight: int = 48,
             timeout_s: float = 30.0) -> None:
    """One connection per case, ``inflight`` at a time; each must end in its ERROR frame and EOF."""
    sel = selectors.DefaultSelector()
    pending = list(reversed(cases))
    live: dict[socket.socket, tuple[Case, bytearray, float]] = {}
    try:
        while pending or live:
            while pending and len(live) < inflight:
                case = pending.pop()
                s = _connect(url)
                try:
                    s.sendall((hello if case.authed else b"") + case.payload)
                    s.shutdown(socket.SHUT_WR)  # a truncated frame stays truncated
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server may close before reading all of a frame it already refused
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
                live[s] = (case, bytearray(), time.monotonic())
                outcome.sent += 1
            for key, _ in sel.select(1.0):
                s = key.fileobj
                case, buf, _ = live[s]
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:  # closed with our bytes unread: what came before still counts
                    chunk = b""
                if chunk:
                    buf += chunk
                    continue
                sel.unregister(s)
                s.close()
                del live[s]
                why = _judge(case, bytes(buf))
                if why is None:
                    outcome.ok += 1
                    outcome.codes[case.kind] = outcome.codes.get(case.kind, 0) + 1
                else:
                    outcome.failures.append(f"{case.kind}: {why}; frame {case.payload[:64].hex()}")
            now = time.monotonic()
            for s, (case, _, t0) in list(live.items()):
                if now - t0 > timeout_s:
                    outcome.failures.append(
                        f"{case.kind}: no close within {timeout_s}s; frame {case.payload[:64].hex()}"
                    )
                    sel.unregister(s)
                    s.close()
                    del live[s]
    finally:
        for s in live:
            s.close()
        sel.close()

