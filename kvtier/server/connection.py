"""One client connection: zero-copy frame reading, ordered replies, timeouts.

:class:`Connection` is an :class:`asyncio.BufferedProtocol`: the event loop reads
straight into the buffer ``get_buffer`` hands out, which is either a small
per-connection staging area (headers and meta; several pipelined frames per
read) or -- while a payload is expected -- the destination itself, e.g. a
reserved pool slot. Payload bytes are therefore copied once, by the kernel.

Requests are handled one at a time, in order, by the connection's task
(:meth:`Connection._serve`); while it works, bytes keep arriving into staging
until it is full, then reading pauses (per-connection backpressure). Replies
are written with ``transport.writelines`` (the payload as a view of its slot,
no copy) and the task waits for the write buffer to drain before it releases
the slot or reads on, so a client that does not read its replies stops being
read from and holds at most one block. Over TLS the payload is handed to TLS in
pieces of ``TLS_PIECE_BYTES`` by :meth:`Connection.drain`, each once the buffer
is under its limits: TLS encrypts what it is given at once, so a block given
whole would sit encrypted in memory until a client that does not read took it.

Timeouts are enforced by the server's watchdog (:meth:`expired`): a connection
idle between frames for ``idle_timeout_s``, or one whose current frame (or the
reply being sent) has taken longer than ``frame_timeout_s``, gets a TIMEOUT
error and is closed -- a slowloris client only ever holds its own connection. A
connection the server closes whose client does not take what is left to send (that
error, a last reply) is reset ``frame_timeout_s`` later: a graceful close waits for
the client, and one that has stopped reading would hold its slot for good.
"""

from __future__ import annotations

import asyncio
import enum
from asyncio import sslproto
import logging
import socket
import ssl
import struct
import time

from kvtier.server.io_lanes import Stopped
from kvtier.tiers.remote_protocol import (
    HEADER_NBYTES,
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    check_request,
    pack_header,
    unpack_header,
)

log = logging.getLogger(__name__)

STAGING_BYTES = 64 * 1024
#: over TLS a payload goes to the transport in pieces of at most this many bytes (see drain)
TLS_PIECE_BYTES = 256 * 1024
_DISCARD = memoryview(bytearray(1 << 20))  # payloads the server refuses are read into this, and dropped


class Phase(enum.Enum):
    IDLE = "idle"  #: between frames: the idle timeout applies
    RECV = "recv"  #: a frame is arriving: the frame timeout applies
    WORK = "work"  #: the server is working (e.g. disk I/O): no timeout
    SEND = "send"  #: waiting for the client to read a reply: the frame timeout applies
    #: closed by the server, what it wrote still queued for the client: the frame timeout applies,
    #: then a reset. Final: ``transport.close`` waits for the client to take the rest, and one that
    #: has stopped reading never does -- its slot and descriptor would be held for good.
    CLOSING = "closing"


class Closed(Exception):
    """The peer closed; ``mid_frame`` if it did so in the middle of a frame."""

    def __init__(self, mid_frame: bool) -> None:
        super().__init__("truncated frame" if mid_frame else "closed")
        self.mid_frame = mid_frame


class Connection(asyncio.BufferedProtocol):
    def __init__(self, server, *, tls=None) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.peer_host = "?"  #: the address limits count by (no port)
        self._tls_context = tls  #: TLS to start once admitted (None: plain or Unix)
        self._handshake: asyncio.Future | None = None
        self._staging = bytearray(STAGING_BYTES)
        self._smv = memoryview(self._staging)
        self._start = 0
        self._end = 0
        self._need = 0
        self._target: memoryview | None = None
        self._target_got = 0
        self._hasher = None
        self._waiter: asyncio.Future | None = None
        self._drain_waiter: asyncio.Future | None = None
        self._write_paused = False
        self._unsent: memoryview | None = None  #: over TLS, the rest of a payload drain() sends
        self._read_paused = False
        self._eof = False
        self._closed = False
        self.phase = Phase.IDLE
        self.since = time.monotonic()  # when the current phase began
        self.bytes_in = 0
        self.task: asyncio.Task | None = None
        self.tls = False

    # -- asyncio protocol callbacks ------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix"
        self.peer_host = peer[0] if isinstance(peer, tuple) else "unix"
        if self._tls_context is None:
            # high = 0: pause_writing as soon as anything is left unsent, resume when
            # all of it is gone -- the moment a sent slot may be released.
            transport.set_write_buffer_limits(high=0, low=0)
        if not self.server.admit(self):
            if self._tls_context is not None:
                self._closed = True
                transport.abort()  # no TLS yet: an ERROR frame would be noise to the peer
                return
            self.fail(ErrorCode.TOO_MANY_CONNECTIONS, "too many connections; retry later")
            return
        if self._tls_context is not None:
            self._wrap_tls(transport)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def _wrap_tls(self, raw) -> None:
        """Put TLS under this protocol now, inside ``connection_made``: the event loop
        starts reading as soon as it returns, and the ClientHello must reach TLS (a
        ``loop.start_tls`` awaited later could lose it to our staging buffer)."""
        loop = asyncio.get_running_loop()
        self._handshake = loop.create_future()
        tls = sslproto.SSLProtocol(loop, self, self._tls_context, self._handshake, server_side=True,
                                   call_connection_made=False,
                                   ssl_handshake_timeout=max(1.0, self.server.admission.hello_timeout_s))
        raw.set_protocol(tls)
        tls.connection_made(raw)
        self.transport = tls._app_transport

    async def _finish_tls(self) -> bool:
        """Wait for the handshake (under the HELLO deadline: the watchdog closes it)."""
        try:
            await self._handshake
        except (ConnectionError, OSError, asyncio.TimeoutError, ssl.SSLError):
            self.close()
            self.server.forget(self)  # a failed handshake may never reach connection_lost
            return False
        self.tls = True
        # TLS encrypts (copies) every piece as it is written: payloads go in pieces (see
        # drain) and these limits bound what waits encrypted for a client that does not read.
        self.transport.set_write_buffer_limits(high=1 << 20, low=256 << 10)
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._target_got :]
        if self._end == len(self._staging):
            self._compact()
        return self._smv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        if self.phase is Phase.IDLE:
            self._enter(Phase.RECV)
        if self._target is not None:
            if self._hasher is not None:  # hash while the bytes are still in cache
                self._hasher.update(self._target[self._target_got : self._target_got + nbytes])
            self._target_got += nbytes
            if self._target_got == len(self._target):
                self._target = None
                self._wake()
            return
        self._end += nbytes
        if self._end - self._start >= self._need:
            self._wake()
        if self._end == len(self._staging):
            self._compact()
            if self._end == len(self._staging) and not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the write side open: the task may still answer what arrived

    def connection_lost(self, exc) -> None:
        self._eof = True
        self._closed = True
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(Closed(False))
        self.server.forget(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- reading (used by the task) ----------------------------------------------------
    def _enter(self, phase: Phase) -> None:
        if self.phase is Phase.CLOSING:
            return  # the task winding down must not restart the clock of a connection being closed
        self.phase = phase
        self.since = time.monotonic()

    def working(self) -> None:
        """The server is busy on this request (e.g. disk I/O): no timeout runs."""
        self._enter(Phase.WORK)

    def receiving(self) -> None:
        """The rest of the current frame is expected now: the frame timeout runs again."""
        self._enter(Phase.RECV)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _compact(self) -> None:
        if self._start:
            n = self._end - self._start
            self._smv[:n] = self._smv[self._start : self._end]
            self._start, self._end = 0, n

    def _resume_reading(self) -> None:
        if self._read_paused and not self._closed:
            self._read_paused = False
            self.transport.resume_reading()

    async def _wait(self, mid_frame: bool) -> None:
        if self._eof or self._closed:
            raise Closed(mid_frame and not self._closed)
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _fill(self, n: int, mid_frame: bool = True) -> None:
        """Wait until ``n`` (≤ staging size) bytes are staged."""
        while self._end - self._start < n:
            if len(self._staging) - self._start < n:
                self._compact()
            self._need = n
            self._resume_reading()
            await self._wait(mid_frame or self._end > self._start)
        self._need = 0

    def _take(self, n: int) -> memoryview:
        view = self._smv[self._start : self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
            self._resume_reading()
        return view

    async def read_header(self) -> Header:
        self._enter(Phase.RECV if self._end > self._start else Phase.IDLE)
        await self._fill(HEADER_NBYTES, mid_frame=False)
        return unpack_header(self._take(HEADER_NBYTES))

    async def read_meta(self, n: int) -> bytes:
        if n <= len(self._staging):
            await self._fill(n)
            return bytes(self._take(n))
        buf = bytearray(n)  # bounded by check_request
        await self.read_into(memoryview(buf))
        return bytes(buf)

    async def read_into(self, dest, hasher=None) -> None:
        """Fill ``dest`` (a writable buffer) with the next bytes of the stream, zero-copy;
        ``hasher.update`` is fed each piece as it lands."""
        view = memoryview(dest).cast("B")
        k = min(self._end - self._start, len(view))
        if k:
            view[:k] = self._take(k)
            if hasher is not None:
                hasher.update(view[:k])
        if k == len(view):
            return
        self._target, self._target_got, self._hasher = view, k, hasher
        self._resume_reading()
        try:
            while self._target is not None:
                await self._wait(True)
        finally:
            self._target = self._hasher = None

    async def discard(self, n: int) -> None:
        while n:
            k = min(n, len(_DISCARD))
            await self.read_into(_DISCARD[:k])
            n -= k

    # -- writing --------------------------------------------------------------------------
    def write(self, *parts) -> None:
        if self._unsent is not None:  # a payload drain() has not sent yet goes first, whole
            parts, self._unsent = (self._unsent, *parts), None
        if not self._closed:
            self.transport.writelines(parts)

    def write_payload(self, head: bytes, block_header: bytes, payload) -> None:
        """A GET reply; ``payload`` (a view of a pinned slot) may be released after :meth:`drain`.

        Over TLS only the headers are written here: :meth:`drain` writes the payload, piece by
        piece, so the caller must await it before releasing the slot (as it must anyway)."""
        if not self.tls:
            self.write(head, block_header, payload)
            return
        self.write(head, block_header)
        self._unsent = memoryview(payload).cast("B")

    async def drain(self) -> None:
        """Return once everything written so far is in the kernel or, over TLS, encrypted and
        under the write limits (then a sent slot may be released: nothing refers to it)."""
        try:
            while self._unsent is not None:
                await self._writable()
                piece, rest = self._unsent[:TLS_PIECE_BYTES], self._unsent[TLS_PIECE_BYTES:]
                self._unsent = rest if len(rest) else None
                self.transport.write(piece)  # TLS encrypts it now: the view is not kept
            await self._writable()
        finally:
            self._unsent = None  # never written after the caller has released its slot

    async def _writable(self) -> None:
        """Wait until the write buffer is under its low limit (at once if it is not paused)."""
        if self._closed:
            raise Closed(False)
        if not self._write_paused:
            return
        previous = self.phase
        self._enter(Phase.SEND)
        self._drain_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None
            self._enter(previous)

    def reply(self, h: Header, code: int = 0, meta: bytes = b"") -> None:
        self.write(pack_header(h.op, h.req_id, len(meta), 0, code), meta)

    def fail(self, code: ErrorCode, message: str) -> None:
        """Send one ERROR frame and close (pending writes are flushed first)."""
        if self._closed:
            return
        if self._tls_context is not None and not self.tls:  # mid-handshake: plaintext would be noise
            self._closed = True
            self.transport.abort()
            self._wake()
            return
        self._unsent = None  # the rest of a payload is not sent ahead of the error
        body = message.encode("utf-8", "replace")[:1024]
        self.write(pack_header(Op.ERROR, 0, len(body), 0, int(code)), body)
        self._close_after_writes()
        self._wake()

    def expired(self, now: float, idle_s: float, frame_s: float) -> bool:
        if self.phase is Phase.IDLE:
            return now - self.since > idle_s
        if self.phase in (Phase.RECV, Phase.SEND, Phase.CLOSING):
            return now - self.since > frame_s
        return False

    def timeout(self) -> None:
        if self.phase in (Phase.SEND, Phase.CLOSING):
            self._reset()
        else:
            what = "idle" if self.phase is Phase.IDLE else "a frame took"
            self.fail(ErrorCode.TIMEOUT, f"{what} too long; closing")
        if self.task is not None:
            self.task.cancel()

    # -- the request loop ------------------------------------------------------------------
    async def _serve(self) -> None:
        server = self.server
        max_block = server.config.max_block_bytes
        try:
            if self._tls_context is not None and not await self._finish_tls():
                return
            h = await self.read_header()
            check_request(h, max_block)
            if h.op != Op.HELLO:
                raise ProtocolError(ErrorCode.NOT_AUTHENTICATED, "the first frame must be HELLO")
            meta = await self.read_meta(h.meta_len)
            self._enter(Phase.WORK)
            principal = server.service.hello(self, h, meta)
            while True:
                h = await self.read_header()
                check_request(h, max_block)
                meta = await self.read_meta(h.meta_len) if h.meta_len else b""
                if h.op == Op.HELLO:
                    raise ProtocolError(ErrorCode.BAD_OP, "HELLO only once per connection")
                if h.op != Op.PUT:  # a PUT is still receiving its payload
                    self._enter(Phase.WORK)
                await server.service.handle(self, principal, h, meta)
        except ProtocolError as exc:
            server.metrics.protocol_errors.labels(exc.code.name).inc()
            self.fail(exc.code, str(exc))
        except Closed as exc:
            if exc.mid_frame and not self._closed:
                server.metrics.protocol_errors.labels(ErrorCode.TRUNCATED.name).inc()
                self.fail(ErrorCode.TRUNCATED, "connection closed in the middle of a frame")
            else:
                self.close()
        except (asyncio.CancelledError, Stopped):  # (Stopped: the server stopping, its I/O threads gone)
            self.close()
        except Exception:  # noqa: BLE001 - one connection's bug must not take the server down
            log.exception("internal error on connection from %s", self.peer)
            server.metrics.protocol_errors.labels(ErrorCode.INTERNAL.name).inc()
            self.fail(ErrorCode.INTERNAL, "internal server error")

    def _reset(self) -> None:
        """The client does not read: drop what is queued at once (it may be views of pool slots
        that the cancelled task is about to release) and reset, so that the kernel frees its send
        buffer too (SO_LINGER 0 turns close into RST)."""
        self._closed = True
        sock = self.transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, AttributeError):
            pass
        self.transport.abort()

    def _close_after_writes(self) -> None:
        """Close once what is written has gone; a connection still here ``frame_timeout_s`` later
        (its client stopped reading) is reset by the watchdog (:attr:`Phase.CLOSING`)."""
        self._closed = True
        self._enter(Phase.CLOSING)
        self.transport.close()

    def close(self) -> None:
        if not self._closed:
            self._close_after_writes()
