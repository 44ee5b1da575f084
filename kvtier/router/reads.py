"""The router's bounded reads: a client's request body within a deadline, and a worker's answer
that the router holds whole (a 404 it looks into, a listing, a rendering, a LoRA answer) up to a
cap. A relayed answer is never held whole (router/relay.py); these are the reads that were, and a
worker (or a proxy in front of one) whose 404 ran to 300 MiB grew the router by ~1 GiB.

Also what clients may make the router hold while it reads from them: connections per address and
in all, and the deadline for a connection's first request head (:class:`PeerConnections`), and the
bytes of request bodies in flight (:class:`BodyBytes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import time
from collections import OrderedDict
from itertools import takewhile
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import RequestHandler, RequestPayloadError

from kvtier.router.requests import RequestError

log = logging.getLogger(__name__)

#: a worker's error answer the router looks into (a 404 for a model), or a LoRA load's answer:
#: vLLM's are a few hundred bytes
SMALL_ANSWER_BYTES = 64 << 10
#: a worker's ``/v1/models`` listing (every LoRA adapter it serves: ~300 bytes each)
LISTING_BYTES = 1 << 20


class AnswerTooLarge(ValueError):
    """A worker's answer ran past what the router reads of it (a ValueError: a bad answer)."""


async def read_capped(content: StreamReader, cap: int) -> tuple[bytes, bool]:
    """What ``content`` holds, read up to ``cap`` bytes and one more: ``(bytes, complete)``.
    Incomplete, the bytes are the answer's first ``cap + 1``, for the caller to relay on."""
    buf = bytearray()
    while len(buf) <= cap:
        chunk = await content.read(cap + 1 - len(buf))
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


async def answer_json(resp, cap: int) -> Any:
    """A worker's JSON answer, read whole only within ``cap`` bytes (else :class:`AnswerTooLarge`);
    a body that is no JSON raises ValueError (or RecursionError, nested too deeply)."""
    data, complete = await read_capped(resp.content, cap)
    if not complete:
        raise AnswerTooLarge(f"the answer is larger than {cap} bytes")
    return json.loads(data)


async def read_body(request: web.Request, hold: BodyHold, timeout_s: float, max_bytes: int,
                    setting: str = "max_body_bytes") -> bytes:
    """The client's request body, in ``timeout_s`` at most from when its reading began (408 after;
    a client that sends its headers and then nothing, or a byte now and then, otherwise holds a
    connection and a handler for ever), no larger than ``max_bytes`` (413 naming ``setting``, the
    setting that caps it; at once for a larger ``Content-Length``), each piece counted in ``hold``
    as it arrives (429 and the connection closed when one does not fit: :class:`BodyBytes`). The
    body is also kept in ``hold`` (``hold.body``) until it is given back. A body its
    ``Content-Encoding`` does not decode (aiohttp's server decodes gzip, deflate, br and zstd
    itself) is the client's 400."""
    declared = request.content_length if request.body_exists else 0
    if declared is not None and declared > max_bytes:
        raise body_too_large(max_bytes, setting)
    hold.start(request.content)
    try:
        hold.body = await asyncio.wait_for(_read_pieces(request.content, hold, max_bytes, setting), timeout_s)
    except asyncio.TimeoutError:
        raise body_too_late(timeout_s) from None
    except ConnectionResetError:
        # the client left mid-body (aiohttp fails the payload before it cancels the handler, and
        # wait_for hands on that failure): the handler is being cancelled, nothing to answer or log
        raise asyncio.CancelledError() from None
    except (RequestPayloadError, HttpProcessingError) as exc:
        # (uncaught, a 500 "internal router error" with two logged tracebacks: any client could
        # fill the log with them)
        raise body_unreadable(exc) from None
    return hold.body


async def _read_pieces(content: StreamReader, hold: BodyHold, max_bytes: int,
                      setting: str = "max_body_bytes") -> bytes:
    # Piece by piece as the socket gives them (aiohttp's ``request.read`` takes the whole body
    # before anything can count it); the stream's own buffer, which aiohttp stops filling past
    # twice its ``read_bufsize`` (512 KiB a connection), is the only part not counted.
    body = bytearray()
    while piece := await content.readany():
        if len(body) + len(piece) > max_bytes:
            raise body_too_large(max_bytes, setting)
        if not hold.take(len(piece)):
            raise hold.bodies.refusal(hold.address)
        body += piece
    if hold.refused:   # made to yield after its last piece, its end already read: not served uncounted
        raise hold.bodies.refusal(hold.address)
    hold.arrived()
    return bytes(body)


def body_too_large(max_bytes: int, setting: str = "max_body_bytes") -> RequestError:
    """The 413 of a body over ``max_bytes``, naming the ``setting`` that set it (an audio form's
    named ``max_body_bytes`` sent its operator to raise the wrong one: audit s31 r3 D5)."""
    return RequestError(413, f"the request body is larger than the router takes ({setting} = {max_bytes})")


def body_unreadable(exc: Exception) -> RequestError:
    """The error of a body aiohttp could not read (its encoding does not decode, its chunks are
    malformed): a 400, and the connection closed, since the rest of the body cannot be read."""
    cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
    reason = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
    return RequestError(400, f"the request body cannot be read: {reason}", close=True)


def body_too_late(timeout_s: float) -> RequestError:
    """The error of a body not read whole within ``timeout_s``: a 408, and the connection closed."""
    return RequestError(408, f"the request body did not arrive within {timeout_s:g} s", "timeout_error", close=True)


class BodyBytes:
    """The bytes of request bodies the router holds at once, every request's together: a body is
    kept from its read until its worker's first byte is relayed (it is what is forwarded, and a
    retry before that forwards it again) or its request ends, so without a bound a client with
    many slow or held requests of ``max_body_bytes`` each grew the router by that many times
    16 MiB. Not until the answer ends: a client that sent its body and never read its answer kept
    it counted for ever, and two such clients had every other request refused 429 (audit s29 a2 D1).

    Counted as they arrive (:func:`read_body`), never as declared: a ``Content-Length`` (or a
    chunked body's most) costs a client nothing to say, and when heads were charged what they
    declared, 64 idle sockets that each declared 16 MiB and sent one byte held the whole 1 GiB and
    every other client was answered 429 for ``body_timeout_s`` (audit s28 R1). Sending bytes and
    then stalling is still the cheapest way to hold them, so one address's bodies *still arriving*
    count at most ``per_peer`` (a Unix socket's, like :class:`PeerConnections`, are not counted
    per address); bodies wholly in count only in the limit, since a proxy's clients share its
    address and their bodies are held until their answers begin.

    Past a bound, the youngest bodies still arriving yield (429, their connections closed, their
    bytes given back at once), never the piece that happened to come next: refused that way, a
    batch of 17 concurrent 8 MiB uploads from one address, each part-way in when the share ran
    out, was answered 429 to every request and none completed (audit s28 F1). The oldest bodies
    finish. Only bodies whose bytes the piece needs yield (:func:`_needed`). Event loop only."""

    def __init__(self, limit: int, per_peer: int) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.held = 0
        self._arriving: dict[str, int] = {}   #: address → bytes of its bodies not yet wholly in
        #: the bodies being read, oldest first (a dict: ordered, O(1) removal)
        self._reading: dict[BodyHold, None] = {}

    def refusal(self, address: str | None) -> RequestError:
        return RequestError(429, f"the router holds {self.held} bytes of request bodies (max_inflight_body_bytes "
                                 f"= {self.limit}), {self.arriving(address)} of them still arriving from this "
                                 f"address (max_arriving_body_bytes_per_peer = {self.per_peer}); retry later",
                            "rate_limit_error", close=True)

    def hold(self, address: str | None) -> BodyHold:
        """An empty count for one request's body from ``address`` (None: not counted per address)."""
        return BodyHold(self, address)

    def arriving(self, address: str | None) -> int:
        """The bytes of ``address``'s bodies that are not yet wholly in."""
        return self._arriving.get(address, 0) if address is not None else 0


def _needed(younger: list[BodyHold], need: int) -> list[BodyHold] | None:
    """Which of the bodies ``younger`` (youngest first) yield to free ``need`` bytes: the youngest
    that hold bytes until they free enough, less those the older ones chosen already cover. A body
    that holds nothing yet (its head in, its first piece not) or whose bytes are not needed is
    never refused: it frees nothing, and it was answered 429 though it fit once the body whose
    bytes were needed had yielded (audit s29 a2 D6). None: all of them cannot free that much."""
    if need <= 0:
        return []
    chosen: list[BodyHold] = []
    freed = 0
    for hold in younger:
        if freed >= need:
            break
        if hold.nbytes:
            chosen.append(hold)
            freed += hold.nbytes
    if freed < need:
        return None
    for hold in list(chosen):   # the youngest first: spared if the others free enough without it
        if freed - hold.nbytes >= need:
            chosen.remove(hold)
            freed -= hold.nbytes
    return chosen


class BodyHold:
    """One request's body in :class:`BodyBytes`: its bytes counted as they arrive (in its address's
    share until :meth:`arrived`) and, once wholly read, the body itself (``body``, the one copy
    the router forwards), both given back by :meth:`release` (idempotent) once no retry can
    forward it again. Event loop only."""

    __slots__ = ("bodies", "address", "nbytes", "body", "_arriving", "_content", "_lent", "refused")

    def __init__(self, bodies: BodyBytes, address: str | None) -> None:
        self.bodies = bodies
        self.address = address
        self.nbytes = 0
        self.body: bytes | None = None
        self._arriving = address is not None
        self._content: StreamReader | None = None
        self._lent: asyncio.Future | None = None   #: a thread's job on the body, its handler gone
        self.refused = False

    def start(self, content: StreamReader) -> None:
        """The body begins to be read from ``content``: from now on it is among those that yield."""
        self._content = content
        self.bodies._reading[self] = None

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more if they fit under the limit and the address's share, the younger
        bodies still arriving whose bytes that needs yielding first; False (nothing counted, no
        one refused) if yielding cannot make them fit, or this body was itself made to yield."""
        if self.refused:
            return False
        yielding = self._younger_to_yield(nbytes)
        if yielding is None:
            return False
        for hold in yielding:
            hold.yield_to_older()
        bodies = self.bodies
        if self._arriving:
            bodies._arriving[self.address] = bodies._arriving.get(self.address, 0) + nbytes
        bodies.held += nbytes
        self.nbytes += nbytes
        return True

    def _younger_to_yield(self, nbytes: int) -> list[BodyHold] | None:
        """The younger bodies still arriving that must yield for ``nbytes`` more to fit: this
        address's own for its share, then anyone's for the limit (None: they cannot make it fit)."""
        bodies = self.bodies
        over_share = bodies._arriving.get(self.address, 0) + nbytes - bodies.per_peer if self._arriving else 0
        over_limit = bodies.held + nbytes - bodies.limit
        if over_share <= 0 and over_limit <= 0:
            return []
        younger = list(takewhile(lambda hold: hold is not self, reversed(bodies._reading)))
        mine = _needed([hold for hold in younger if hold.address == self.address], over_share)
        if mine is None:
            return None
        others = _needed([hold for hold in younger if hold not in mine], over_limit - sum(h.nbytes for h in mine))
        return None if others is None else mine + others

    def yield_to_older(self) -> None:
        """Refused for an older body: its bytes given back now, its read failed with a 429 (the
        reader wakes with it at once, even from a client that sends nothing more)."""
        self.refused = True
        self.release()
        if self._content is not None:
            self._content.set_exception(self.bodies.refusal(self.address))

    def arrived(self) -> None:
        """The body is wholly in: it leaves its address's share (it stays in the limit)."""
        self.bodies._reading.pop(self, None)
        if self._arriving:
            self._arriving = False
            left = self.bodies._arriving.pop(self.address, 0) - self.nbytes
            if left:
                self.bodies._arriving[self.address] = left

    def lent_to(self, job: asyncio.Future) -> None:
        """A thread works on the body (``job``) after its handler stopped waiting for it: the body
        stays counted, whenever :meth:`release` is called, until the job is over."""
        self._lent = job

    def release(self) -> None:
        """The body's bytes and the body given back: once its worker's first byte is relayed, or
        its request is over (a body lent to a thread's job, once that job is over)."""
        if self._lent is not None and not self._lent.done():
            self._lent.add_done_callback(lambda _: self.release())
            return
        self.arrived()
        self.bodies.held -= self.nbytes
        self.nbytes = 0
        self.body = None


def _open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_per_peer() -> int:
    """The connections one address may hold when ``max_connections_per_peer`` is 0: a quarter of
    this process's open-file limit, so that one client, whatever it does, leaves the router
    descriptors for other clients and for its own calls to the workers."""
    return max(4, _open_file_limit() // 4)


#: connections asyncio's accept loop takes in one go, before any of them can be closed (the
#: backlog aiohttp's sites serve with)
ACCEPT_BATCH = 128


def default_max_connections() -> int:
    """The client connections the router holds at most, every address's together: half of what
    this process's open-file limit leaves beside a reserve for the router's own descriptors (an
    eighth of the limit, at least 64: listening sockets, logs, model files, the workers' event
    sockets) and one accept batch (:data:`ACCEPT_BATCH`), since each client connection with a
    request under way holds one more, to its worker. The cap per address alone let four
    addresses (one IPv6 host has a /64 of them) that held their share each take every
    descriptor: the accept loop then failed (EMFILE) for every other client (audit s29 a2 D3)."""
    limit = _open_file_limit()
    return max(4, (limit - max(64, limit // 8) - ACCEPT_BATCH) // 2)


class PeerConnections:
    """At most ``per_peer`` client connections per address (TCP; a Unix socket's count only in
    all) and ``max_connections`` in all, and each connection's first request head within
    ``header_timeout_s`` of its connect.

    A connection past an address's cap closes that address's connection that has waited longest
    for a request (silent since it connected, or idle between requests), so a flood of silent
    sockets from one address only churns its own; past the cap of all, the connection of any
    address that has waited longest is closed. If every connection that could make room has a
    request under way, the newcomer is closed instead. A connection is *busy* from when aiohttp
    builds its request (its request factory, :meth:`watch`) until its handler returns
    (:meth:`middleware`). Busy only from the middleware on, a kept-alive connection whose request
    was built, its handler task not yet started (a loop turn), was closed for a newcomer and its
    client got no answer (audit s29 a9 D1). A head aiohttp parsed in the loop turn before it
    builds the request still counts as waiting: aiohttp tells nothing of it. Before these bounds (and
    the header deadline, ``header_timeout_s``) clients that opened a few hundred silent or idle
    sockets took every descriptor of the router: at ``RLIMIT_NOFILE`` its accept loop failed
    (EMFILE) and no other client was served, nor could it reach its workers.

    The head deadline covers a new connection only: a kept-alive one idle between requests is
    aiohttp's keep-alive timer's (``keepalive_timeout_s``, far longer). One timer for both closed
    idle pooled connections after 5 s, and an aiohttp client, which reuses a pooled socket without
    looking at it and does not retry a POST, failed its next request (audit s28 R3).

    Installed on aiohttp's connection manager by :meth:`watch` (``Router.runner``); aiohttp has
    no hook of its own for a new connection. Event loop only."""

    def __init__(self, per_peer: int, header_timeout_s: float, max_connections: int | None = None) -> None:
        self.per_peer = per_peer
        self.max_connections = max_connections or default_max_connections()
        self.header_timeout_s = header_timeout_s
        #: connections without a request begun yet → the timer that closes them at the deadline
        self._no_head_yet: dict[RequestHandler, asyncio.TimerHandle] = {}
        #: counted connection → its address (None: a Unix socket's, its file's permissions decide
        #: who connects: counted in all only)
        self._peer: dict[RequestHandler, str | None] = {}
        self._count: dict[str, int] = {}                       #: address → its connections
        #: address → its connections without a request under way, the longest waiting first
        self._idle: dict[str, OrderedDict[RequestHandler, None]] = {}
        self._idle_all: OrderedDict[RequestHandler, None] = OrderedDict()   #: every address's
        self._refusing: set[str] = set()   #: addresses told about once (until they hold none)
        self._full_told = -math.inf        #: when a newcomer past the cap of all was last logged

    def watch(self, server: web.Server) -> None:
        """Count the connections of ``server`` (its ``connection_made`` / ``connection_lost``,
        which each of its connections calls), and mark one busy as its request is built (its
        ``request_factory``, which each connection takes when it is made: call before serving)."""
        made, lost, build = server.connection_made, server.connection_lost, server.request_factory

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.connected(handler, transport)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            self.forget(handler)
            lost(handler, exc)

        def request_factory(message, payload, handler: RequestHandler, writer, task) -> web.BaseRequest:
            self._request_begun(handler)
            return build(message, payload, handler, writer, task)

        server.connection_made, server.connection_lost = connection_made, connection_lost
        server.request_factory = request_factory
        quiet_accept_failures()

    def connected(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else None
        if not self._room_for(address):
            handler.force_close()
            return
        self._peer[handler] = address
        if address is not None:
            self._count[address] = self._count.get(address, 0) + 1
            self._idle.setdefault(address, OrderedDict())[handler] = None
        self._idle_all[handler] = None
        self._await_head(handler)

    def _room_for(self, address: str | None) -> bool:
        """Whether a new connection from ``address`` may be kept: it is within the caps, or the
        connection that has waited longest (the address's past its own cap, anyone's past the cap
        of all) was closed for it. False: every one that could make room has a request under way."""
        if address is not None and self._count.get(address, 0) >= self.per_peer \
                and not self._close_longest_idle(self._idle[address]):
            if address not in self._refusing:
                self._refusing.add(address)
                log.warning("%s holds %d connections, each with a request under way "
                            "(max_connections_per_peer); closing its new ones", address, self.per_peer)
            return False
        if len(self._peer) >= self.max_connections and not self._close_longest_idle(self._idle_all):
            now = time.monotonic()
            if now - self._full_told >= 60.0:   # (once a minute: each request that ends lets one more in)
                self._full_told = now
                log.warning("the router holds %d client connections, each with a request under way (its "
                            "cap, from the open-file limit); closing new ones", self.max_connections)
            return False
        return True

    def _close_longest_idle(self, idle: OrderedDict[RequestHandler, None]) -> bool:
        """Close the connection of ``idle`` that has waited longest for a request (False: none)."""
        if not idle:
            return False
        oldest = next(iter(idle))
        self.forget(oldest)
        oldest.force_close()
        return True

    def _await_head(self, handler: RequestHandler) -> None:
        self._no_head_yet[handler] = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._no_head, handler)

    def _no_head(self, handler: RequestHandler) -> None:
        if self._no_head_yet.pop(handler, None) is not None:
            handler.force_close()

    def forget(self, handler: RequestHandler) -> None:
        timer = self._no_head_yet.pop(handler, None)
        if timer is not None:
            timer.cancel()
        if handler not in self._peer:
            return
        address = self._peer.pop(handler)
        self._idle_all.pop(handler, None)
        if address is None:
            return
        self._idle[address].pop(handler, None)
        self._count[address] -= 1
        if not self._count[address]:
            del self._count[address], self._idle[address]
            self._refusing.discard(address)

    def connections(self, address: str) -> int:
        return self._count.get(address, 0)

    def address(self, handler: RequestHandler) -> str | None:
        """The address ``handler``'s connection is counted under (None: not counted, a Unix socket)."""
        return self._peer.get(handler)

    def _request_begun(self, conn: RequestHandler) -> None:
        """``conn``'s request is built: it is busy, and its head deadline is over."""
        timer = self._no_head_yet.pop(conn, None)
        if timer is not None:
            timer.cancel()
        self._busy(conn)

    def _busy(self, conn: RequestHandler) -> None:
        self._idle_all.pop(conn, None)
        address = self._peer.get(conn)
        if address is not None:
            self._idle[address].pop(conn, None)

    def _idle_again(self, conn: RequestHandler) -> None:
        if conn not in self._peer:   # closed meanwhile
            return
        self._idle_all[conn] = None
        address = self._peer[conn]
        if address is not None:
            self._idle[address][conn] = None

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Marks the request's connection idle again once its handler returns (it was marked busy
        when the request was built, :meth:`watch`). The outermost middleware. A request aiohttp
        answers itself (a head it cannot parse: 400) passes no middleware, but aiohttp closes its
        connection, which :meth:`forget` then drops."""
        try:
            return await handler(request)
        finally:
            self._idle_again(request.protocol)


#: what asyncio logs, with a traceback, when its accept loop finds no descriptor left (EMFILE),
#: and when one of the retries it schedules for each such failure finds its listener closed
_ACCEPT_FAILED = ("socket.accept() out of system resource",
                  "Exception in callback BaseSelectorEventLoop._start_serving")


class _AcceptFailures(logging.Filter):
    """asyncio's accept failures for want of descriptors, let through at most once a second, the
    next one saying how many were left out. Its accept loop logs one per connection it could not
    take and schedules a retry for each (CPython 3.11): a router at its open-file limit wrote
    55,000 of them, with tracebacks, in 8 s (21 MB; audit s29 a2 D3), and the retries still
    pending when it stopped logged one more each."""

    def __init__(self) -> None:
        super().__init__()
        self._next = -math.inf
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_ACCEPT_FAILED)):
            return True
        now = time.monotonic()
        if now < self._next:
            self._left_out += 1
            return False
        self._next = now + 1.0
        if self._left_out:
            record.msg = f"{record.msg}\n({self._left_out} more since the last one, not logged)"
            self._left_out = 0
        return True


def quiet_accept_failures() -> None:
    """Install :class:`_AcceptFailures` on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AcceptFailures) for f in logger.filters):
        logger.addFilter(_AcceptFailures())
