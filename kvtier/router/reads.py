"""The router's bounded reads: a client's request body within a deadline, and a worker's answer
that the router holds whole (a 404 it looks into, a listing, a rendering, a LoRA answer) up to a
cap. A relayed answer is never held whole (router/relay.py); these are the reads that were, and a
worker (or a proxy in front of one) whose 404 ran to 300 MiB grew the router by ~1 GiB.

Also what clients may make the router hold while it reads from them: connections per address and
the deadline for a connection's first request head (:class:`PeerConnections`), and the bytes of
request bodies in flight (:class:`BodyBytes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import OrderedDict
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.web import RequestHandler

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


async def read_body(request: web.Request, hold: BodyHold, timeout_s: float, max_bytes: int) -> bytes:
    """The client's request body, in ``timeout_s`` at most from when its reading began (408 after;
    a client that sends its headers and then nothing, or a byte now and then, otherwise holds a
    connection and a handler for ever), no larger than ``max_bytes`` (413; at once for a larger
    ``Content-Length``), each piece counted in ``hold`` as it arrives (429 and the connection
    closed when one does not fit: :class:`BodyBytes`)."""
    declared = request.content_length if request.body_exists else 0
    if declared is not None and declared > max_bytes:
        raise body_too_large(max_bytes)
    hold.start(request.content)
    try:
        return await asyncio.wait_for(_read_pieces(request.content, hold, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise body_too_late(timeout_s) from None
    except ConnectionResetError:
        # the client left mid-body (aiohttp fails the payload before it cancels the handler, and
        # wait_for hands on that failure): the handler is being cancelled, nothing to answer or log
        raise asyncio.CancelledError() from None


async def _read_pieces(content: StreamReader, hold: BodyHold, max_bytes: int) -> bytes:
    # Piece by piece as the socket gives them (aiohttp's ``request.read`` takes the whole body
    # before anything can count it); the stream's own buffer, which aiohttp stops filling past
    # twice its ``read_bufsize`` (512 KiB a connection), is the only part not counted.
    body = bytearray()
    while piece := await content.readany():
        if len(body) + len(piece) > max_bytes:
            raise body_too_large(max_bytes)
        if not hold.take(len(piece)):
            raise hold.bodies.refusal(hold.address)
        body += piece
    if hold.refused:   # made to yield after its last piece, its end already read: not served uncounted
        raise hold.bodies.refusal(hold.address)
    hold.arrived()
    return bytes(body)


def body_too_large(max_bytes: int) -> RequestError:
    return RequestError(413, f"the request body is larger than the router takes (max_body_bytes = {max_bytes})")


def body_too_late(timeout_s: float) -> RequestError:
    """The error of a body not read whole within ``timeout_s``: a 408, and the connection closed."""
    return RequestError(408, f"the request body did not arrive within {timeout_s:g} s", "timeout_error", close=True)


class BodyBytes:
    """The bytes of request bodies the router holds at once, every request's together: a body is
    kept from its read until its answer ends (it is what is forwarded, and a retry forwards it
    again), so without a bound a client with many slow or held requests of ``max_body_bytes``
    each grew the router by that many times 16 MiB.

    Counted as they arrive (:func:`read_body`), never as declared: a ``Content-Length`` (or a
    chunked body's most) costs a client nothing to say, and when heads were charged what they
    declared, 64 idle sockets that each declared 16 MiB and sent one byte held the whole 1 GiB and
    every other client was answered 429 for ``body_timeout_s`` (audit s28 R1). Sending bytes and
    then stalling is still the cheapest way to hold them, so one address's bodies *still arriving*
    count at most ``per_peer`` (a Unix socket's, like :class:`PeerConnections`, are not counted
    per address); bodies wholly in count only in the limit, since a proxy's clients share its
    address and their bodies are held as long as their answers last.

    Past a bound, the youngest body still arriving yields (429, its connection closed, its bytes
    given back at once), never the piece that happened to come next: refused that way, a batch of
    17 concurrent 8 MiB uploads from one address, each part-way in when the share ran out, was
    answered 429 to every request and none completed (audit s28 F1). The oldest bodies finish.
    Event loop only."""

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

    def _youngest(self, address: str | None) -> BodyHold | None:
        """The body that began reading last (of ``address``, or of anyone for None)."""
        for hold in reversed(self._reading):
            if address is None or hold.address == address:
                return hold
        return None

    def hold(self, address: str | None) -> BodyHold:
        """An empty count for one request's body from ``address`` (None: not counted per address)."""
        return BodyHold(self, address)

    def arriving(self, address: str | None) -> int:
        """The bytes of ``address``'s bodies that are not yet wholly in."""
        return self._arriving.get(address, 0) if address is not None else 0


class BodyHold:
    """One request's bytes in :class:`BodyBytes`: taken as its body arrives (in its address's
    share until :meth:`arrived`), all given back by :meth:`release` (once the answer is over;
    idempotent). Event loop only."""

    __slots__ = ("bodies", "address", "nbytes", "_arriving", "_content", "refused")

    def __init__(self, bodies: BodyBytes, address: str | None) -> None:
        self.bodies = bodies
        self.address = address
        self.nbytes = 0
        self._arriving = address is not None
        self._content: StreamReader | None = None
        self.refused = False

    def start(self, content: StreamReader) -> None:
        """The body begins to be read from ``content``: from now on it is among those that yield."""
        self._content = content
        self.bodies._reading[self] = None

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more if they fit under the limit and the address's share, younger bodies
        still arriving yielding until they do; False (nothing counted) if this one is the youngest
        left in the way, or was itself made to yield."""
        bodies = self.bodies
        if self.refused or not self._room_if_younger_yield(nbytes):
            return False   # (no one refused for nothing: yielding would not make the piece fit)
        while True:
            share = self._arriving and bodies._arriving.get(self.address, 0) + nbytes > bodies.per_peer
            if not share and bodies.held + nbytes <= bodies.limit:
                if self._arriving:
                    bodies._arriving[self.address] = bodies._arriving.get(self.address, 0) + nbytes
                bodies.held += nbytes
                self.nbytes += nbytes
                return True
            bodies._youngest(self.address if share else None).yield_to_older()

    def _room_if_younger_yield(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit once every body younger than this one gave its bytes
        back (those of this address for its share, anyone's for the limit)."""
        bodies = self.bodies
        mine = anyone = 0
        for hold in reversed(bodies._reading):
            if hold is self:
                break
            anyone += hold.nbytes
            if hold.address == self.address:
                mine += hold.nbytes
        if self._arriving and bodies._arriving.get(self.address, 0) - mine + nbytes > bodies.per_peer:
            return False
        return bodies.held - anyone + nbytes <= bodies.limit

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

    def release(self) -> None:
        self.arrived()
        self.bodies.held -= self.nbytes
        self.nbytes = 0


def default_per_peer() -> int:
    """The connections one address may hold when ``max_connections_per_peer`` is 0: a quarter of
    this process's open-file limit, so that one client, whatever it does, leaves the router
    descriptors for other clients and for its own calls to the workers."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(4, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 4)


class PeerConnections:
    """At most ``per_peer`` client connections per address (TCP; a Unix socket's are not counted),
    and each connection's first request head within ``header_timeout_s`` of its connect.

    A connection past the cap closes that address's connection that has waited longest for a
    request (silent since it connected, or idle between requests), so a flood of silent sockets
    from one address only churns its own; if every one of that address's connections has a
    request under way, the newcomer is closed instead. A connection is *busy* from when its
    request's head is in until its handler returns (:meth:`middleware`). Before this bound (and
    the header deadline, ``header_timeout_s``) one client that opened a few hundred silent sockets
    took every descriptor of the router: at ``RLIMIT_NOFILE`` its accept loop failed (EMFILE) and
    no other client was served, nor could it reach its workers.

    The head deadline covers a new connection only: a kept-alive one idle between requests is
    aiohttp's keep-alive timer's (``keepalive_timeout_s``, far longer). One timer for both closed
    idle pooled connections after 5 s, and an aiohttp client, which reuses a pooled socket without
    looking at it and does not retry a POST, failed its next request (audit s28 R3).

    Installed on aiohttp's connection manager by :meth:`watch` (``Router.runner``); aiohttp has
    no hook of its own for a new connection. Event loop only."""

    def __init__(self, per_peer: int, header_timeout_s: float) -> None:
        self.per_peer = per_peer
        self.header_timeout_s = header_timeout_s
        #: connections without a request begun yet → the timer that closes them at the deadline
        self._no_head_yet: dict[RequestHandler, asyncio.TimerHandle] = {}
        self._peer: dict[RequestHandler, str] = {}             #: counted connection → its address
        self._count: dict[str, int] = {}                       #: address → its connections
        #: address → its connections without a request under way, the longest waiting first
        self._idle: dict[str, OrderedDict[RequestHandler, None]] = {}
        self._refusing: set[str] = set()   #: addresses told about once (until they hold none)

    def watch(self, server: web.Server) -> None:
        """Count the connections of ``server`` (its ``connection_made`` / ``connection_lost``,
        which each of its connections calls)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.connected(handler, transport)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            self.forget(handler)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost

    def connected(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        if not isinstance(peer, tuple):   # a Unix socket: its file's permissions decide who connects
            self._await_head(handler)
            return
        address = peer[0]
        if self._count.get(address, 0) >= self.per_peer:
            idle = self._idle[address]
            if not idle:
                if address not in self._refusing:
                    self._refusing.add(address)
                    log.warning("%s holds %d connections, each with a request under way "
                                "(max_connections_per_peer); closing its new ones", address, self.per_peer)
                handler.force_close()
                return
            oldest, _ = idle.popitem(last=False)
            self.forget(oldest)
            oldest.force_close()
        self._peer[handler] = address
        self._count[address] = self._count.get(address, 0) + 1
        self._idle.setdefault(address, OrderedDict())[handler] = None
        self._await_head(handler)

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
        address = self._peer.pop(handler, None)
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

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Marks the request's connection busy while its handler runs, and as having begun a
        request (its head is in: the head deadline is over for it). The outermost middleware."""
        conn = request.protocol
        timer = self._no_head_yet.pop(conn, None)
        if timer is not None:
            timer.cancel()
        address = self._peer.get(conn)
        if address is not None:
            self._idle[address].pop(conn, None)
        try:
            return await handler(request)
        finally:
            if address is not None and self._peer.get(conn) == address:
                self._idle[address][conn] = None
