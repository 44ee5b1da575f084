"""A scriptable stand-in for ``kvtier serve`` that plays a broken, malicious or other-version server.

It answers HELLO with ``hello`` (any msgpack map: fields of the wrong type are the point) and
hands every later request to ``handler(h, meta, data) -> bytes | None``, the bytes to send back
(None: nothing). :func:`healthy` answers like a well-behaved server and is the positive control:
every test that breaks one thing first checks that the same client works against it. Real TCP
sockets, kvtier's own frame encoders.
"""

from __future__ import annotations

import socket

from kvtier.core.payload import checksum
from kvtier.core.payload import pack_header as pack_block_header
from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import (
    FEATURES,
    GET_ITEM,
    Op,
    pack_header,
    pack_msgpack,
)
from tests.server.loopback_peer import LoopbackPeer, payload_for

#: what ``kvtier serve`` says in its HELLO reply (the fields the client reads)
GOOD_HELLO = {"server": "hostile", "tenant": "t", "max_block": 8 << 20, "idle_timeout_s": 300.0,
              "features": list(FEATURES)}
GOOD_STATS = {"namespace_bytes": 4096, "capacity_bytes": 1 << 20}


def reply(h, body: bytes = b"", code: int = 0) -> bytes:
    """A reply frame to request ``h`` carrying ``body`` as its meta."""
    return pack_header(h.op, h.req_id, len(body), 0, code) + body


def healthy(h, meta: bytes, data: bytes) -> bytes | None:
    """A well-behaved server that holds every block (GET), takes every PUT and holds nothing
    else (CONTAINS, LOOKUP, LIST: empty)."""
    if h.op == Op.GET:
        out = b""
        for off in range(0, len(meta), GET_ITEM.size):
            key, n = GET_ITEM.unpack_from(meta, off)
            payload = payload_for(key, n)
            head = pack_block_header(key, n, checksum(payload))
            out += pack_header(Op.GET, h.req_id, len(head), n, Status.OK) + head + payload
        return out
    if h.op in (Op.CONTAINS, Op.DELETE):
        return reply(h, bytes(len(meta) // 32))
    if h.op == Op.LOOKUP:
        return reply(h, bytes(4))
    if h.op == Op.STATS:
        return reply(h, pack_msgpack(GOOD_STATS))
    if h.op == Op.LIST:
        return reply(h, bytes(8))  # cursor 0: no more, no keys
    return reply(h)  # PUT, PING: OK, nothing more


def answering(op: int, fn):
    """``healthy``, except that requests of ``op`` are answered by ``fn(h, meta) -> bytes``."""
    def handler(h, meta, data):
        return fn(h, meta) if h.op == op else healthy(h, meta, data)
    return handler


class HostileServer(LoopbackPeer):
    """Listens on a loopback port (``url``); one thread per connection. ``connections`` counts
    accepted ones, ``closed_by_client`` those the client closed (EOF)."""

    def __init__(self, handler=healthy, *, hello: dict | None = None) -> None:
        self.handler = handler
        self.hello = GOOD_HELLO if hello is None else hello
        super().__init__(backlog=64)

    def _recv_exact(self, s: socket.socket, n: int) -> bytes | None:
        out = bytearray()
        while len(out) < n:
            try:
                chunk = s.recv(n - len(out))
            except socket.timeout:
                if self._stop.is_set():
                    return None
                continue
            except OSError:
                return None
            if not chunk:
                if not self._stop.is_set():
                    with self._lock:
                        self.closed_by_client += 1
                return None
            out += chunk
        return bytes(out)

    def _send(self, s: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes and not self._stop.is_set():
            try:
                view = view[s.send(view):]
            except socket.timeout:
                continue
            except OSError:
                return

    def _serve(self, s: socket.socket) -> None:
        s.settimeout(0.05)
        frame = self._read_frame(s)
        if frame is None:
            return
        info = pack_msgpack(self.hello)
        self._send(s, pack_header(Op.HELLO, frame[0].req_id, len(info), 0) + info)
        while not self._stop.is_set():
            frame = self._read_frame(s)
            if frame is None:
                return
            out = self.handler(*frame)
            if out:
                self._send(s, out)
