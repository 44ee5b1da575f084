"""The client end of the kvtier wire protocol: addresses and one blocking connection.

:class:`WireClient` speaks :mod:`kvtier.tiers.remote_protocol` over one TCP, TLS or
Unix socket. Every call takes a *deadline* (``time.monotonic()`` value): no
call blocks past it, whatever the server does -- a silent server, one that
trickles a byte at a time, one that announces a reply of a gigabyte. A reply's
lengths are checked against what its request can receive
(:func:`~kvtier.tiers.remote_protocol.check_reply`) before anything is read or
allocated. Small frames are read through a
staging buffer (many pipelined replies per ``recv``); payloads are received
straight into the caller's buffer and sent straight from it (``recv_into`` /
``sendmsg``, no copy in user space).

A WireClient is used by one thread at a time (the pool in
:mod:`kvtier.tiers.remote` hands them out). After any error it is broken:
close it and open another.
"""

from __future__ import annotations

import ipaddress
import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import SplitResult, parse_qs, parse_qsl, urlsplit, urlunsplit

import xxhash

from kvtier.errors import ConfigError
from kvtier.tiers.remote_protocol import (
    CHECKSUM_NBYTES,
    HEADER,
    HEADER_NBYTES,
    MAX_ADMIN_REPLY,
    MAX_ERROR_MESSAGE,
    MAX_MAP_REPLY,
    ErrorCode,
    Header,
    Op,
    check_reply,
    pack_header,
    pack_msgpack,
    unpack_header,
    unpack_msgpack,
)

_STAGING = 64 * 1024
#: payload pieces a PUT sends and hashes at a time: small enough to be hashed from cache
_PIECE = 1024 * 1024
_ZERO_TRAILER = bytes(CHECKSUM_NBYTES)  #: a sealed PUT's trailer: its AEAD tags are the check
#: a kernel timeout may end this much after the deadline before it is re-armed (a setsockopt
#: pair per re-arm; the loops also check the deadline between system calls)
_ARM_SLACK_S = 0.01
#: the longest kernel timeout set at once (a C ``long`` of seconds must hold it; a longer deadline
#: is still checked between system calls)
_MAX_ARM_S = 86400.0


@dataclass(frozen=True, slots=True)
class Address:
    scheme: str  #: tcp, tls or unix
    host: str  #: host name, or the socket path for unix
    port: int | None
    namespace: str = "default"
    token: str | None = None
    ca_file: str | None = None  #: TLS: the CA that signed the server certificate (else the system store)

    def __str__(self) -> str:
        where = self.host if self.scheme == "unix" else f"{self.host}:{self.port}"
        return f"{self.scheme}://{where}"


def parse_url(url: str) -> Address:
    """``tcp://HOST:PORT``, ``tls://HOST:PORT`` or ``unix:///PATH``, with optional
    ``?namespace=NAME&token=T&ca=CA.pem`` (prefer ``KVTIER_TOKEN`` to a token in a URL)."""
    try:
        parts = urlsplit(url)
    except ValueError:   # an unclosed bracket (tcp://[::1:7070), a host no name can be: a typo, not a crash
        raise ConfigError(f"{_redacted(_split_unchecked(url))!r} is not a URL: its host is no name or address "
                          "(an IPv6 address goes in brackets closed before the port: tcp://[::1]:7070)") from None
    shown = _redacted(parts)  # errors end up in logs: never the token
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"namespace", "token", "ca"}
    if unknown:
        raise ConfigError(f"{shown!r}: unknown parameter(s) {sorted(unknown)}; use namespace, token or ca")
    common = dict(namespace=query.get("namespace", "default"), token=query.get("token"), ca_file=query.get("ca"))
    if parts.scheme == "unix":
        if not parts.path.startswith("/"):
            raise ConfigError(f"{shown!r}: a unix socket URL needs an absolute path: unix:///run/kvtier.sock")
        return Address("unix", parts.path, None, **common)
    if parts.scheme in ("tcp", "tls"):
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ConfigError(f"{shown!r}: expected {parts.scheme}://HOST:PORT, e.g. {parts.scheme}://127.0.0.1:7070")
        return Address(parts.scheme, parts.hostname, port, **common)
    raise ConfigError(f"{shown!r}: use tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH")


def _split_unchecked(url: str) -> SplitResult:
    """``url`` cut into urlsplit's parts without its checks of the host, so that a URL it refused
    can still be quoted through :func:`_redacted` (a token in its query masked)."""
    rest, _, query = url.partition("#")[0].partition("?")
    scheme, sep, rest = rest.partition("://")
    if not sep:
        return SplitResult("", "", scheme, query, "")
    netloc, slash, path = rest.partition("/")
    return SplitResult(scheme, netloc, slash + path, query, "")


def _redacted(parts) -> str:
    """The URL to quote in an error: every query value but a namespace's or a CA file's masked
    (``token=***``; a misspelt ``tokn=`` may hold one too), no user info, no fragment."""
    query = "&".join(f"{k}={v}" if k in ("namespace", "ca") else f"{k}=***"
                     for k, v in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, query, ""))


class RemoteError(Exception):
    """The server answered with an ERROR frame (it closes the connection after)."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = str(code)
        super().__init__(f"{name}: {message}")
        self.code = code


class CallerError(ValueError):
    """A caller's payload source or sink broke its contract (made more or fewer bytes than it
    announced, yielded something that is no buffer, raised) while a call held a connection:
    the caller's mistake, raised to it -- not a failure of the server. The connection is out of
    step (a frame half sent or half read): close it."""


class HelloFields(NamedTuple):
    """What a HELLO reply says, read once and checked (a field of the wrong type or range is its
    default: another version's server, or a man in the middle without TLS, may send anything)."""

    features: frozenset[str]  #: none by default
    max_block: int  #: 0: no block limit
    idle_timeout_s: float  #: 0.0: no idle timeout
    #: CONTAINS answers for the namespace PUT writes and no other: the server says the connection
    #: may write and reads no shared namespace (False where it does, or does not say: an older server)
    contains_own_only: bool


class WireClient:
    def __init__(self, address: Address, token: str, *, namespace: str | None = None,
                 connect_timeout_s: float = 2.0, client_name: str = "kvtier", deadline: float | None = None) -> None:
        """Connect and say HELLO within ``connect_timeout_s``, and before ``deadline`` if one is
        given (the deadline of the call this connection is opened for)."""
        self.address = address
        deadline = min(time.monotonic() + connect_timeout_s, deadline if deadline is not None else float("inf"))
        connect_timeout_s = _remaining(deadline)
        if address.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout_s)
            try:
                sock.connect(address.host)
            except BaseException:
                sock.close()
                raise
        else:
            sock = _connect_tcp(address.host, address.port, deadline)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if address.scheme == "tls":
                    ctx = ssl.create_default_context(cafile=address.ca_file)
                    sock = ctx.wrap_socket(sock, server_hostname=address.host)
            except BaseException:
                sock.close()
                raise
        # Blocking mode with kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO), not Python's
        # timeout mode: one syscall moves a whole piece (no poll() before each call,
        # no partial sends of non-blocking mode) and loops check the deadline.
        sock.settimeout(None)
        self.sock = sock
        self._armed = -1.0  # the kernel timeout (s) last set
        self._zero_copy_send = not isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(_STAGING)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._req = 0
        self.closed = False
        try:
            hello = {"token": token, "namespace": namespace or address.namespace, "client": client_name}
            rid = self.send(Op.HELLO, pack_msgpack(hello), deadline=deadline)
            h = self.read_header(deadline, rid)
            check_reply(h, Op.HELLO, meta=(1, MAX_MAP_REPLY))
            self.info = unpack_msgpack(self.read_bytes(h.meta_len, deadline), "HELLO reply")
            self.hello = hello = _hello_fields(self.info)  # only these are used afterwards: checked once
            self.features, self.max_block, self.idle_timeout_s = hello.features, hello.max_block, hello.idle_timeout_s
        except BaseException:
            self.close()
            raise
        self.last_used = time.monotonic()

    def reusable(self) -> bool:
        """False for a pooled connection the server has closed, or is about to close for idling:
        it has sent something unasked (an ERROR frame, EOF) or sat idle nearly as long as it allows."""
        if self.closed or self._end > self._start:
            return False
        if self.idle_timeout_s and time.monotonic() - self.last_used > 0.8 * self.idle_timeout_s:
            return False
        poller = select.poll()  # (not select(): fds above 1024 are common in engines)
        poller.register(self.sock, select.POLLIN)
        return not poller.poll(0)

    # -- sending -------------------------------------------------------------------------
    def next_id(self) -> int:
        self._req = (self._req + 1) & 0xFFFFFFFF
        return self._req

    def send(self, op: int, meta: bytes = b"", payload=None, *, deadline: float) -> int:
        rid = self.next_id()
        data_len = memoryview(payload).nbytes if payload is not None else 0
        head = pack_header(op, rid, len(meta), data_len) + meta
        self.send_buffers([head] if payload is None else [head, payload], deadline)
        return rid

    def send_put(self, meta: bytes, payload, deadline: float) -> int:
        """Send a PUT: header, then the payload in cache-sized pieces, each hashed just
        before it is sent (the hash pulls it into cache, the kernel's copy finds it
        there; hashing after the send costs twice as much), then the xxh3-128 trailer."""
        view = memoryview(payload).cast("B")
        rid = self.next_id()
        head = pack_header(Op.PUT, rid, len(meta), len(view) + CHECKSUM_NBYTES) + meta
        hasher = xxhash.xxh3_128()
        first = view[:_PIECE]
        hasher.update(first)
        self.send_buffers([head, first], deadline)
        for off in range(_PIECE, len(view), _PIECE):
            piece = view[off : off + _PIECE]
            hasher.update(piece)
            self.send_buffers([piece], deadline)
        self.send_buffers([hasher.digest()], deadline)
        return rid

    def send_put_stream(self, meta: bytes, source, deadline: float) -> int:
        """Send a sealed PUT (a :class:`~kvtier.tiers.streams.PayloadSource`): each piece as soon
        as the source has made it (still in cache, and before the source reuses its buffer),
        then the all-zero trailer -- the payload authenticates itself.
        A source that breaks its contract raises :class:`CallerError` (the frame is half sent)."""
        rid = self.next_id()
        total = source.nbytes
        pending = [pack_header(Op.PUT, rid, len(meta), total + CHECKSUM_NBYTES) + meta]
        sent = 0
        for piece in _from_caller(source.pieces, "payload source"):
            view = _caller_buffer(piece, "payload source", writable=False)
            sent += view.nbytes
            if sent > total:
                raise CallerError(f"payload source made more than the {total} bytes it announced")
            self.send_buffers([*pending, view], deadline)
            pending = []
        if sent != total:
            raise CallerError(f"payload source made {sent} of the {total} bytes it announced")
        self.send_buffers([*pending, _ZERO_TRAILER], deadline)
        return rid

    def _arm(self, deadline: float) -> None:
        """Bound each blocking call by the time left to ``deadline`` (raises if none is left).

        Called before each blocking system call. The kernel timeout (which counts from the start
        of each call) is re-armed when a call could end more than a few milliseconds after the
        deadline (time has passed since it was set) or noticeably before it (a later call's
        longer deadline)."""
        left = _remaining(deadline)
        if not self._zero_copy_send:  # TLS: OpenSSL needs Python's own timeout mode
            self.sock.settimeout(left)
            return
        if self._armed > left + _ARM_SLACK_S or self._armed < left - max(0.05 * left, _ARM_SLACK_S):
            tv = struct.pack("ll", int(left), int((left - int(left)) * 1e6) or 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._armed = left

    def send_buffers(self, bufs: list, deadline: float) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        views = [v for v in views if len(v)]
        sock = self.sock
        while views:
            self._arm(deadline)
            try:
                sent = sock.sendmsg(views) if self._zero_copy_send else sock.send(views[0])
            except BlockingIOError:  # SO_SNDTIMEO expired: the server does not read
                raise TimeoutError(f"{self.address} is not reading") from None
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # -- receiving -----------------------------------------------------------------------
    def _recv_some(self, deadline: float) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._mv[:n] = self._mv[self._start : self._end]
            self._start, self._end = 0, n
        self._arm(deadline)
        try:
            k = self.sock.recv_into(self._mv[self._end :])
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"{self.address} did not answer in time") from None
        if k == 0:
            raise ConnectionError(f"{self.address} closed the connection")
        self._end += k

    def read_header(self, deadline: float, expect_id: int | None = None) -> Header:
        while self._end - self._start < HEADER_NBYTES:
            self._recv_some(deadline)
        h = unpack_header(self._mv[self._start : self._start + HEADER_NBYTES])
        self._start += HEADER_NBYTES
        if h.op == Op.ERROR:  # the connection ends here: read a bounded part of the message
            message = self.read_bytes(min(h.meta_len, MAX_ERROR_MESSAGE), deadline).decode("utf-8", "replace")
            raise RemoteError(h.code, message)
        if expect_id is not None and h.req_id != expect_id:
            raise ConnectionError(f"reply to request {h.req_id}, expected {expect_id}: stream out of step")
        return h

    def read_bytes(self, n: int, deadline: float) -> bytes:
        if n <= len(self._buf):
            while self._end - self._start < n:
                if len(self._buf) - self._start < n:
                    m = self._end - self._start
                    self._mv[:m] = self._mv[self._start : self._end]
                    self._start, self._end = 0, m
                self._recv_some(deadline)
            out = bytes(self._mv[self._start : self._start + n])
            self._start += n
            return out
        out = bytearray(n)
        self.read_into(out, deadline)
        return bytes(out)

    def read_into(self, dest, deadline: float, hasher=None) -> None:
        """Fill ``dest`` with the next bytes: what is staged first, the rest straight from the
        socket; ``hasher.update`` is fed each piece as it lands (still in cache)."""
        view = memoryview(dest).cast("B")
        k = min(self._end - self._start, len(view))
        if k:
            view[:k] = self._mv[self._start : self._start + k]
            self._start += k
            if hasher is not None:
                hasher.update(view[:k])
        got, n = k, len(view)
        sock = self.sock
        while got < n:
            self._arm(deadline)
            # Whatever the kernel has, like a plain recv loop; each piece is hashed at once,
            # while it is still in cache.
            try:
                dest = view[got:]
                r = sock.recv_into(dest, len(dest))
            except BlockingIOError:  # SO_RCVTIMEO expired
                raise TimeoutError(f"{self.address} stalled mid-payload") from None
            if r == 0:
                raise ConnectionError(f"{self.address} closed the connection mid-payload")
            if hasher is not None:
                hasher.update(view[got : got + r])
            got += r

    def read_stream(self, n: int, sink, deadline: float) -> str | None:
        """Feed the next ``n`` payload bytes to a :class:`~kvtier.tiers.streams.PayloadSink`; returns
        its verdict (None: verified). What it does not ask for is skipped, so the stream stays in
        step whatever the sink does -- unless it breaks its contract (raises, or yields what is
        no writable buffer): :class:`CallerError`, the payload half read."""
        pieces = _from_caller(sink.pieces, "payload sink")
        got = 0
        try:
            view = _caller_buffer(next(pieces), "payload sink", writable=True)
            while True:
                k = view.nbytes
                if got + k > n:
                    verdict = f"the reader asked for more than the {n} bytes of the block"
                    break
                self.read_into(view, deadline)
                got += k
                view = _caller_buffer(next(pieces), "payload sink", writable=True)
        except StopIteration as done:
            verdict = done.value
        finally:
            pieces.close()
        if got < n:
            self.skip(n - got, deadline)
            verdict = verdict or f"the reader stopped after {got} of {n} bytes"
        return verdict

    def skip(self, n: int, deadline: float) -> None:
        scratch = bytearray(min(n, 1 << 20))
        while n:
            k = min(n, len(scratch))
            self.read_into(memoryview(scratch)[:k], deadline)
            n -= k

    # -- simple request/reply ----------------------------------------------------------------
    def call(self, op: int, meta: bytes = b"", *, deadline: float, reply_meta: tuple[int, int]) -> tuple[Header, bytes]:
        """One request whose reply carries meta only, of ``reply_meta`` = (least, most) bytes:
        a reply announcing anything else is a :class:`ProtocolError`, found before it is read."""
        rid = self.send(op, meta, deadline=deadline)
        h = self.read_header(deadline, rid)
        check_reply(h, op, meta=reply_meta)
        return h, self.read_bytes(h.meta_len, deadline) if h.meta_len else b""

    def call_msgpack(self, op: int, args: dict | None = None, *, deadline: float) -> dict:
        cap = MAX_ADMIN_REPLY if op == Op.ADMIN else MAX_MAP_REPLY
        _, body = self.call(op, pack_msgpack(args) if args is not None else b"", deadline=deadline,
                            reply_meta=(1, cap))
        return unpack_msgpack(body, Op(op).name + " reply")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


def _hello_fields(info: dict) -> HelloFields:
    """The :class:`HelloFields` of a HELLO reply."""
    feats = info.get("features", ())
    features = frozenset(f for f in feats if isinstance(f, str)) if isinstance(feats, (list, tuple)) else frozenset()
    mb = info.get("max_block", 0)
    max_block = mb if isinstance(mb, int) and not isinstance(mb, bool) and mb >= 0 else 0
    it = info.get("idle_timeout_s", 0)
    ok = isinstance(it, (int, float)) and not isinstance(it, bool) and math.isfinite(it) and it > 0
    own_only = info.get("writable") is True and info.get("reads_shared") is False
    return HelloFields(features, max_block, float(it) if ok else 0.0, own_only)


def _from_caller(pieces, what: str):
    """The pieces a caller's ``pieces()`` makes, what its code raises raised as
    :class:`CallerError` (its return value, a sink's verdict, passed on)."""
    try:
        return (yield from pieces())
    except Exception as exc:  # noqa: BLE001 - whatever the caller's code raises is its own mistake
        raise CallerError(f"the {what} raised {type(exc).__name__}: {exc}") from exc


def _caller_buffer(piece, what: str, *, writable: bool) -> memoryview:
    """``piece`` as the flat byte view the socket calls take, else :class:`CallerError`."""
    try:
        view = memoryview(piece).cast("B")
    except TypeError as exc:  # not a buffer, or not contiguous
        raise CallerError(f"the {what} yielded {type(piece).__name__}, not a contiguous buffer") from exc
    if writable and view.readonly:
        raise CallerError(f"the {what} yielded a read-only buffer")
    return view


def _connect_tcp(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to ``host``, its name looked up and each of its addresses tried with only
    what is left before ``deadline`` (``socket.create_connection`` looks the name up with no bound
    at all, then gives each address the whole timeout)."""
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in _resolve(host, port, deadline):
        left = _remaining(deadline)
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error if error is not None else OSError(f"{host!r} resolves to no address")


#: name look-ups under way: (host, port) -> their outcome (one at a time per name; see _resolve)
_lookups: dict[tuple[str, int], Future] = {}
_lookups_lock = threading.Lock()


def _resolve(host: str, port: int, deadline: float) -> list:
    """``getaddrinfo`` of ``host`` within the deadline. A name is looked up on a helper thread that
    the caller waits for only until ``deadline``: a resolver whose DNS server does not answer waits
    5 s per try, and a load in an engine's forward step (``bounded_reads``) must not. A look-up
    that outlives its caller goes on and serves the callers that come meanwhile, so a silent DNS
    server costs one thread per name, not one per call. An address literal is read in place."""
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        pass
    else:  # (AI_NUMERICHOST: no name service is asked)
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    key = (host, port)
    with _lookups_lock:
        lookup = _lookups.get(key)
        if lookup is None:
            lookup = _lookups[key] = Future()
            threading.Thread(target=_look_up, args=(key, lookup), name="kvtier-resolve", daemon=True).start()
    try:
        return lookup.result(timeout=_remaining(deadline))
    except FutureTimeout:
        raise TimeoutError(f"looking up {host!r} took longer than the call's deadline") from None


def _look_up(key: tuple[str, int], lookup: Future) -> None:
    try:
        infos = socket.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM)
    except BaseException as exc:  # noqa: BLE001 - handed to the callers waiting for it
        outcome: tuple = (None, exc)
    else:
        outcome = (infos, None)
    with _lookups_lock:
        _lookups.pop(key, None)  # the next call looks the name up afresh (the system caches, not us)
    if outcome[1] is not None:
        lookup.set_exception(outcome[1])
    else:
        lookup.set_result(outcome[0])


def _remaining(deadline: float) -> float:
    """Seconds left to ``deadline``, at most ``_MAX_ARM_S`` (what a kernel timeout is set to);
    raises TimeoutError when none is left -- and for a NaN deadline, which would never pass."""
    left = deadline - time.monotonic()
    if not left > 0:
        raise TimeoutError("kvtier server did not answer in time")
    return min(left, _MAX_ARM_S)


def resolve_token(address: Address, token: str | None) -> str:
    token = token or address.token or os.environ.get("KVTIER_TOKEN")
    if not token:
        raise ConfigError(
            f"no token for {address}: pass token=..., add ?token=... to the URL, or set KVTIER_TOKEN"
        )
    return token


__all__ = ["Address", "CallerError", "HelloFields", "RemoteError", "WireClient", "parse_url", "resolve_token", "HEADER"]
