"""What the router passes between a client and a worker, and what it keeps of an answer: the
request headers a worker is sent (hop-by-hop ones dropped, plaintext asked for), a bounded
record of the answer relayed (for its usage and a Responses API id), and the deadline on the
answer's writes to a client that takes none of it (:class:`WriteWatch`). No I/O:
:mod:`kvtier.router.app` calls these.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Awaitable, Callable, Mapping

from multidict import CIMultiDict

from kvtier.router.requests import usage_of_stream

#: Headers meant for one connection, not for the next hop (RFC 9110 §7.6.1: a proxy must drop
#: them, and any header the request's ``Connection`` names), and the framing aiohttp sets itself.
#: ``Proxy-Authorization`` is the client's credential for a proxy in front of the router: a
#: worker must never see it.
HOP_HEADERS = frozenset({"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
                         "proxy-authorization", "proxy-authenticate", "proxy-connection", "host",
                         "content-length"})
#: Headers that describe the bytes the client sent, when the body was encoded: aiohttp's server
#: decodes a gzip, deflate, br or zstd body as it reads it, and the worker is sent the decoded
#: body. Told it was still gzip, a worker (or an ingress before it) that honours the header
#: failed the request.
ENCODED_BODY_HEADERS = frozenset({"content-encoding", "content-md5", "digest", "content-digest", "repr-digest"})
#: a stream's head and tail kept (its response id first; its usage chunk last)
TAIL_BYTES = 65536
#: a whole (non-streamed) answer up to this size is parsed for its usage; a larger one only has its
#: tail searched, as a stream's is: a 97 MB embeddings answer held in memory and parsed on the
#: event loop stalled every stream the router relayed for 0.76 s
WHOLE_PARSE_BYTES = 1 << 20
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*')
#: the end of a server-sent event: a blank line, that is a line end and then an empty line's, each
#: CRLF, LF or CR as SSE lets every line choose (``\n\r\n`` and ``\n\r`` end events too: audit s34
#: r4 D1). A CR before an LF is one line end (CRLF), never two.
_EVENT_END = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)")
#: how bytes that end with an event end (:data:`_EVENT_END`) end: two line ends other than one
#: CRLF's two bytes, or a line end and then a CRLF. ``endswith`` finds it at a fraction of a regex's
#: cost, and a vLLM worker's every chunk is looked at
EVENT_END_SUFFIXES = (b"\n\n", b"\r\r", b"\n\r", b"\n\r\n", b"\r\r\n")
#: the longest event end (``\r\n\r\n``): one that ends in bytes still to come begins at most one
#: byte less than this before them
EVENT_END_BYTES = 4
#: the most of one unfinished event a stream's relay holds back (:class:`WholeEvents`)
HELD_EVENT_BYTES = WHOLE_PARSE_BYTES
#: the endpoint whose streams are the Anthropic Messages API's, ended with its own error event
ANTHROPIC_PATH = "/v1/messages"


def forwarded_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The client's headers as a worker is sent them: hop-by-hop ones dropped (and those the
    client's ``Connection`` header names), those of an encoded body (:data:`ENCODED_BODY_HEADERS`:
    the body forwarded is the decoded one), and ``Accept-Encoding: identity`` instead of whatever
    the client or aiohttp would ask for, since the router reads the answer's usage from its bytes
    and relays it with its own framing.

    A header sent more than once is forwarded as every one of its lines, in order (a multidict):
    collapsed to its last value, two ``X-Request-Id`` lines (a client's, one an ingress appended)
    had the worker run the request under the last while the router, reading the first as vLLM
    does, named and aborted it by the first, and missed (audit s31 a4 D1)."""
    named = {t.strip().lower() for v in _all(headers, "Connection") for t in v.split(",")}
    drop = HOP_HEADERS | named | {"accept-encoding"}
    if _all(headers, "Content-Encoding"):
        drop |= ENCODED_BODY_HEADERS
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)
    out["Accept-Encoding"] = "identity"
    return out


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)   # a multidict: a header may come more than once
    if getall is not None:
        return list(getall(name, []))
    return [v for k, v in headers.items() if k.lower() == name.lower()]


class WriteWatch:
    """A deadline on an answer's writes to its client, as ``request_timeout_s`` is one on its
    worker's silence: ``on_stall`` is called once one write has waited ``timeout_s`` (found
    within twice that: one timer per answer, looking every ``timeout_s``, since a timer per write
    cost ~8 µs a relayed chunk, a stream's every token). Without it a client that sent its
    request and never read its answer held the handler and its worker's request for ever (audit
    s29 a2 D1). Event loop only; :meth:`stop` once the answer is over."""

    __slots__ = ("timeout_s", "_on_stall", "_begun", "_writing", "_seen", "_timer")

    def __init__(self, timeout_s: float, on_stall: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._begun = 0          #: writes begun
        self._writing = False
        self._seen = -1          #: writes begun when it last looked
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._look)

    async def send(self, write: Awaitable[None]) -> None:
        """Await ``write``, one write of the answer to the client, under the deadline."""
        self._begun += 1
        self._writing = True
        try:
            await write
        finally:
            self._writing = False

    def _look(self) -> None:
        if self._writing and self._begun == self._seen:   # the write under way when it last looked
            self._on_stall()
            return
        self._seen = self._begun
        self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._look)

    def stop(self) -> None:
        self._timer.cancel()


def usage_of_tail(tail: bytes) -> Any:
    """The ``usage`` object of a whole JSON answer from its last bytes (vLLM writes it after the
    choices or data), or None: the last ``"usage":`` key's value, decoded alone."""
    found = None
    for found in _USAGE_KEY.finditer(tail):
        pass
    if found is None:
        return None
    try:
        usage, _ = json.JSONDecoder().raw_decode(tail[found.end():].decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return usage


class KeptAnswer:
    """What the router keeps of an answer it relays, bounded whatever the answer's size: its
    head (``keep_head``: a Responses API answer's id), its last :data:`TAIL_BYTES`, and, for a
    whole answer, all of it while it is at most :data:`WHOLE_PARSE_BYTES`. Owned by one relay;
    ``add`` copies the chunk's bytes it keeps."""

    def __init__(self, first: bytes, streaming: bool, keep_head: bool) -> None:
        self.streaming = streaming
        self.head = bytearray(first[:TAIL_BYTES]) if keep_head else None
        self.tail = bytearray(first[-TAIL_BYTES:])
        self.whole = None if streaming or len(first) > WHOLE_PARSE_BYTES else bytearray(first)

    def add(self, chunk: bytes) -> None:
        if self.head is not None and len(self.head) < TAIL_BYTES:
            self.head += chunk[:TAIL_BYTES - len(self.head)]
        if self.whole is not None:
            if len(self.whole) + len(chunk) <= WHOLE_PARSE_BYTES:
                self.whole += chunk
            else:
                self.whole = None   # too large to parse on the event loop: its tail will do
        self.tail += chunk[-TAIL_BYTES:]
        if len(self.tail) > TAIL_BYTES:
            del self.tail[:-TAIL_BYTES]

    def usage(self) -> Any:
        """The answer's ``usage``: a stream's last usage chunk; a whole answer parsed, or (too
        large to parse) read from its tail."""
        if self.streaming:
            return usage_of_stream(bytes(self.tail))
        if self.whole is None:
            return usage_of_tail(bytes(self.tail))
        try:
            return json.loads(self.whole).get("usage")
        except (ValueError, AttributeError, RecursionError):
            return None


def ends_an_event(data: bytes) -> bool:
    """Whether ``data`` ends with an event's end (only its last bytes are read)."""
    return data.endswith(EVENT_END_SUFFIXES)


def last_event_end(data: bytes) -> int:
    """Where the last event end in ``data`` ends (0: ``data`` has none). A run of line ends longer
    than one blank line may be read as one and an empty line after it: an empty line is no event."""
    if ends_an_event(data):   # (only its last bytes read)
        return len(data)
    end = 0
    for found in _EVENT_END.finditer(data):
        end = found.end()
    return end


class WholeEvents:
    """A stream relayed in whole events: each chunk's bytes up to its last event end are relayed,
    those after it held until the event's end comes. A worker that died, or a drain that ended
    the stream, mid-way through an event then leaves no partial event before the router's error
    event, which the client would read glued to it as one event that is no JSON (the openai SDK
    raised ``JSONDecodeError``, not the ``APIError`` the error event is for: audit s34 a4 D3). An
    event longer than :data:`HELD_EVENT_BYTES` is relayed as it comes (:func:`stream_error_end`
    then closes it).

    Each read costs its own length, never the held event's: the held pieces are joined once, when
    they are relayed, and an event end is looked for in the new bytes and the last held ones (the
    held bytes have none). Re-joined and searched at each read, a 1 MiB event in 1,448-byte reads
    cost the event loop 0.6 s (audit s34 r4 D2). A chunk with no line end (most of a long event's)
    is not searched at all."""

    __slots__ = ("_held", "_held_bytes", "_held_last")

    def __init__(self) -> None:
        self._held: list[bytes] = []   #: the unfinished event's pieces, in order
        self._held_bytes = 0
        self._held_last = b""          #: the held bytes' last EVENT_END_BYTES - 1

    def take(self, chunk: bytes) -> bytes:
        """The bytes to relay now, of those held and ``chunk``."""
        if not self._held and ends_an_event(chunk):   # a vLLM worker's every chunk: relayed at once
            return chunk
        end = self._event_end_in(chunk)
        if end is None:
            self._hold(chunk)
            return self._released() if self._held_bytes > HELD_EVENT_BYTES else b""
        done = self._released() + chunk[:end] if self._held else chunk[:end]
        if end < len(chunk):
            self._hold(chunk[end:])
            if self._held_bytes > HELD_EVENT_BYTES:   # (one chunk beyond the cap: relayed as it came)
                return done + self._released()
        return done

    def _event_end_in(self, chunk: bytes) -> int | None:
        """Where in ``chunk`` the last event end of the held bytes and ``chunk`` ends, or None."""
        if b"\n" not in chunk and b"\r" not in chunk:
            return None
        before = self._held_last
        end = last_event_end(before + chunk) - len(before)
        return end if end > 0 else None

    def _hold(self, piece: bytes) -> None:
        self._held.append(piece)
        self._held_bytes += len(piece)
        self._held_last = (self._held_last + piece[-(EVENT_END_BYTES - 1):])[-(EVENT_END_BYTES - 1):]

    def _released(self) -> bytes:
        """Every held byte, in order, now no longer held."""
        held = b"".join(self._held)
        self._held, self._held_bytes, self._held_last = [], 0, b""
        return held

    def rest(self) -> bytes:
        """What is held when the stream ends as its worker ended it: relayed as it came."""
        return self._released()


def stream_error_end(path: str, message: str, relayed_tail: bytes, shutdown: bool = False) -> bytes:
    """The bytes that end a stream cut short (its worker failed, or the router shuts down),
    after the relayed bytes that end with ``relayed_tail``, in the form the clients of ``path``
    act on. An OpenAI stream ends as vLLM ends one that fails: an error event, then ``[DONE]``.
    An Anthropic Messages stream (:data:`ANTHROPIC_PATH`) ends with a named ``event: error`` as
    vLLM's does, and no ``[DONE]``: the Anthropic SDK acts on named events only, and the OpenAI
    form ended its stream with no word, a truncated answer taken as whole (audit s34 a4 D6). An
    event left open (longer than :class:`WholeEvents` holds) is ended first, so that the error
    event is read as one of its own (D3)."""
    close = b"" if not relayed_tail or ends_an_event(relayed_tail) else b"\n\n"
    if path == ANTHROPIC_PATH:
        error = {"type": "error", "error": {"type": "overloaded_error" if shutdown else "api_error",
                                            "message": message}}
        return close + f"event: error\ndata: {json.dumps(error)}\n\n".encode()
    error = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}}
    return close + f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
