"""A misbehaving kvtier server for client tests: it speaks the real protocol, then misbehaves.

Not a fake of ``kvtier serve`` (tests that need a working server start the real one):
a small threaded socket server that answers HELLO as a server would and then does one
thing wrong, on purpose, on every connection:

* ``stall``       reads every request, answers none;
* ``slow_blocks`` answers each GET item correctly, but ``delay_s`` after the one before;
* ``drip``        answers correctly, one byte every ``delay_s``;
* ``rate``        answers correctly at ``rate`` bytes/s (for the minimum-rate rule);
* ``huge``        announces a 1 GiB reply (GET: a 1 GiB payload; other ops: 1 GiB of meta),
                  sends a few bytes of it, then waits;
* ``huge_hello``  announces a 1 GiB HELLO reply.

GET payloads are :func:`payload_for` of the key, with a correct block header, so a client
that waits long enough gets verified hits: the tests see timing, not garbage, at work.
"""

from __future__ import annotations

import socket
import time

from kvtier.core.payload import checksum
from kvtier.core.payload import pack_header as pack_block_header
from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import (
    GET_ITEM,
    FEATURES,
    Op,
    pack_header,
    pack_msgpack,
)
from tests.server.loopback_peer import LoopbackPeer, payload_for

GIB = 1 << 30
MODES = ("stall", "slow_blocks", "drip", "rate", "huge", "huge_hello")


class FaultyPeer(LoopbackPeer):
    def __init__(self, mode: str, *, delay_s: float = 0.1, rate: float = 1e6, max_block: int = 8 << 20) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: use one of {MODES}")
        self.mode = mode
        self.delay_s = delay_s
        self.rate = rate
        self.max_block = max_block
        super().__init__(backlog=16)

    # -- one connection -------------------------------------------------------------------
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
                chunk = b""
            if not chunk:
                return None
            out += chunk
        return bytes(out)

    def _serve(self, s: socket.socket) -> None:
        s.settimeout(0.05)
        try:
            frame = self._read_frame(s)
            if frame is None:
                return self._client_closed()
            h, _, _ = frame
            if self.mode == "huge_hello":
                self._send(s, pack_header(Op.HELLO, h.req_id, GIB, 0) + b"\x80" * 64)
                return self._wait_for_close(s)
            info = pack_msgpack({"server": "faulty", "tenant": "t", "max_block": self.max_block,
                                 "features": list(FEATURES)})
            self._send(s, pack_header(Op.HELLO, h.req_id, len(info), 0) + info)
            while not self._stop.is_set():
                frame = self._read_frame(s)
                if frame is None:
                    return self._client_closed()
                self._answer(s, *frame)
        except (BrokenPipeError, ConnectionResetError):
            self._client_closed()

    def _client_closed(self) -> None:
        if not self._stop.is_set():
            with self._lock:
                self.closed_by_client += 1

    def _wait_for_close(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if not s.recv(65536):
                    return self._client_closed()
            except socket.timeout:
                continue
            except OSError:
                return self._client_closed()

    def _answer(self, s: socket.socket, h, meta: bytes, data: bytes) -> None:
        if self.mode == "stall":
            return
        if self.mode == "huge":
            if h.op == Op.GET:
                key, n = GET_ITEM.unpack_from(meta, 0)
                head = pack_block_header(key, n, bytes(16))
                self._send(s, pack_header(Op.GET, h.req_id, len(head), GIB, Status.OK) + head + bytes(4096))
            else:
                self._send(s, pack_header(h.op, h.req_id, GIB, 0) + bytes(4096))
            return
        replies = self._replies(h, meta)
        for reply in replies:
            if self.mode == "slow_blocks":
                time.sleep(self.delay_s)
                self._send(s, reply)
            elif self.mode == "drip":
                for i in range(len(reply)):
                    if self._stop.wait(self.delay_s):
                        return
                    self._send(s, reply[i : i + 1])
            else:  # rate
                piece = 16 << 10
                for i in range(0, len(reply), piece):
                    self._send(s, reply[i : i + piece])
                    time.sleep(len(reply[i : i + piece]) / self.rate)

    def _replies(self, h, meta: bytes) -> list[bytes]:
        """Correct replies to a request, one per GET item (one in all for other ops)."""
        if h.op == Op.GET:
            out = []
            for off in range(0, len(meta), GET_ITEM.size):
                key, n = GET_ITEM.unpack_from(meta, off)
                data = payload_for(key, n)
                head = pack_block_header(key, n, checksum(data))
                out.append(pack_header(Op.GET, h.req_id, len(head), n, Status.OK) + head + data)
            return out
        if h.op == Op.PUT:
            return [pack_header(Op.PUT, h.req_id, 0, 0, Status.OK)]
        if h.op in (Op.CONTAINS, Op.DELETE):
            body = bytes(len(meta) // 32)
            return [pack_header(h.op, h.req_id, len(body), 0) + body]
        if h.op == Op.LOOKUP:
            return [pack_header(h.op, h.req_id, 4, 0) + bytes(4)]
        return [pack_header(h.op, h.req_id, 0, 0)]

    def _send(self, s: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes and not self._stop.is_set():
            try:
                k = s.send(view)
            except socket.timeout:
                continue
            view = view[k:]
