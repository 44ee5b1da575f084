"""``remote``: the shared pod tier -- a ``kvtier serve`` server -- behind the tier contract.

::

    tier = RemoteTier("tcp://127.0.0.1:7070", token=os.environ["KVTIER_TOKEN"], namespace="llama-70b")
    store = TieredStore([HostTier(...), DiskTier(...), tier])

* **Bounded.** Every call (a get or put of any number of blocks, a lookup, a
  contains, ...) has *one* deadline, set when it starts: ``timeout_s``, or for
  a call that moves ``B`` payload bytes, ``max(timeout_s, B / min_rate_bytes_s)``
  (default 50 MB/s: a 512-block prompt of 2 MiB blocks may take 21 s, a single
  block 5 s). Connecting, sending and every receive of the call share what is
  left of it; nothing re-arms it per block. When it passes, the blocks not yet
  received are :attr:`Status.ERROR` (gets, puts), the connection is closed
  (never reused mid-frame) and the call returns: a slow, dead or misbehaving
  server turns into misses -- ``False`` (contains, delete), ``0``
  (lookup_prefix) -- never a hang, never an exception. A reply is checked
  against what its request can receive before it is read: a GET reply's
  payload must be the size asked for, a CONTAINS reply one byte a key, ...;
  anything else (say, a server announcing a 1 GiB reply) is a protocol error
  handled the same way, with nothing allocated. After a failure the tier stays
  *down* (operations fail at once, without network); once a backoff that doubles
  up to ``max_backoff_s`` is over, a connection attempt on a thread of its own
  decides, and the callers go on failing fast meanwhile. (When the first call
  after the backoff tried, a frozen server cost one caller the whole deadline
  every backoff, all outage long.) A success resets the backoff.
* **Verified.** A put sends the block header with the payload's xxh3-128
  checksum; the server checks it before storing. A get checks the returned
  header (key, size) and the checksum of the bytes received: a torn or
  swapped transfer is :attr:`Status.CORRUPT`, counted in ``stats.verify_failures``.
  On any status but OK the content of the caller's buffer is unspecified.
* **Zero copy.** Payloads go from the caller's buffer to the socket and from
  the socket into the caller's buffer; batches are pipelined on one connection.
* **Streams.** :meth:`put_streams` / :meth:`get_streams`
  (:class:`~kvtier.tiers.streams.StreamingTier`) move sealed payloads piece by
  piece as the caller seals or opens them: no checksum, the AEAD tags are the
  check. They are flagged sealed on the server, and a plain read never
  returns one.
* **Isolated.** The server derives the tenant from the token; this tier can
  only name blocks of its tenant's namespace (and read granted shared ones).
* **Thread safe.** A pool of connections: one per concurrent caller, at most
  ``pool_size`` kept open while idle. A server refusing one connection more
  (``TOO_MANY_CONNECTIONS``: the tenant's cap, a load signal) while this tier
  holds others, or closed one the server has not seen closed yet (it counts
  it until it has read the close: this tier waits for the server's EOF on it,
  at most ``connect_timeout_s``; one closed after a timeout or reset, or with a
  reply left unread -- a caller's sink that broke -- is closed outright, not shut
  down, and counts for ``connect_timeout_s``; at most 16 shut-down ones are kept
  open, each let go once the server is seen to have closed it, looked at as
  calls end), is no outage: the call waits, within its
  deadline, for one of them to come back to the pool, or connects again once
  one is closed (after a short pause, while one closed is unseen); else it alone
  fails, counted in ``stats.errors`` and ``last_error``. Once the server has
  seen every close, a refusal is real: the tier backs off. A call that waited
  and then runs out of time fails alone too. Nothing backs off, and such a
  refusal of the recovery probe ends the outage (the server answers).
* **The caller's mistakes raise.** Arguments are checked before a connection is
  taken; a payload source or sink that breaks its contract mid-call (more or
  fewer bytes than it announced, an exception of its own) raises
  :class:`~kvtier.tiers.remote_wire.CallerError` (a ``ValueError``): its
  connection is closed (outright where a reply is left unread: reset, not sent
  on), the tier stays up.

Blocks evicted by the server are not reported through ``on_evict`` (the server
owns that policy); ``capacity_bytes`` is the tenant's quota, or the server's
capacity when it has none.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.namespace import check_namespace
from kvtier.core.payload import (
    FLAG_CHECKSUM,
    FLAG_SEALED,
    BlockMeta,
    header_mismatch,
    pack_header,
    unpack_header,
)
from kvtier.core.payload import HEADER_NBYTES as BLOCK_HEADER_NBYTES
from kvtier.tiers.base import Status, Tier, writable_bytes
from kvtier.tiers.recovery_probe import start_probe
from kvtier.tiers.remote_protocol import (
    CHECKSUM_NBYTES,
    GET_ITEM,
    LIST_ARGS,
    LIST_CURSOR_ARGS,
    MAX_KEYS,
    U32,
    U64,
    ErrorCode,
    Op,
    ProtocolError,
    check_reply,
    pack_put_meta,
)
from kvtier.tiers.remote_wire import Address, CallerError, RemoteError, WireClient, parse_url, resolve_token
from kvtier.tiers.streams import PayloadSink, PayloadSource, StreamingTier, Unverifiable

log = logging.getLogger(__name__)

#: puts sent before the first reply is read: enough to keep the pipe full,
#: small enough that replies never fill the socket buffers both ways
_PUT_WINDOW = 64
_NO_CHECKSUM = bytes(16)
#: the slowest transfer rate a large call is allowed (bytes/s): see "Bounded" above
DEFAULT_MIN_RATE_BYTES_S = 50e6
#: the first and longest pause before a call refused by the tenant's connection cap connects again
#: while a connection this tier closed may still count on the server (see _UnseenCloses)
_CAP_RETRY_MIN_S = 0.01
_CAP_RETRY_MAX_S = 0.25


class TierDown(Exception):
    """The server is in backoff after a failure (internal: becomes a status)."""


#: what a look at a shut-down connection finds the server's side doing (see _UnseenCloses)
_QUIET, _CLOSED, _SENDING = "quiet", "closed", "sending"


class _UnseenCloses:
    """Connections this tier closed that the server may still count against the tenant's
    connection cap (under the tier's ``_pool_lock``).

    A connection in step with the server (its last call complete, nothing left to read) is closed
    as a shutdown of this side; the server, reading it, forgets the connection and then closes its
    own side, which this tier reads as EOF. Until then a cap refusal may be on the closed
    connection's account (the server can be busy in its handler for a second or more); from then
    on it is another's doing -- another engine took the slot -- and a real refusal. (Guessing
    instead, a grace of ``connect_timeout_s`` after every close, had the tier retry against a cap
    really full for seconds, no backoff: audit s32 r8 D2.) A server whose side stays open
    ``limit_s`` is taken to have seen the close.

    A connection whose call failed (a timeout, a reset) is closed outright, and so is one with a
    reply (or the rest of one) left unread -- a caller's sink that broke mid-reply, or a reply that
    goes on arriving after the close: only shut down, the server would go on sending it the reply
    until its frame timeout (30 s), holding the tenant's slot and the blocks it lends (audit s33
    a2 D3); closed with unread data, it is reset and the server lets go at once. Such a close
    tells nothing more, so it may count for ``limit_s`` (the server may be busy in its handler on
    it, not reading: s32 r7 D2, D3). So is the oldest shut-down connection closed outright when
    more than :attr:`HELD` wait: their descriptors are bounded.

    The shut-down ones are looked at (no wait: a poll per socket) at every close, every call's
    end and every question, and let go once the server has closed its side or ``limit_s`` has
    passed: kept until a cap refusal asked, every connection closed for a full pool kept its
    descriptor, without bound (audit s33 a2 D2)."""

    HELD = 16  #: shut-down connections kept at most: each look polls every one, under the pool lock
    _READS = 16  #: reads per look at one socket, for what the server sent before its EOF (an ERROR frame)

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._conns: list[tuple[WireClient, float]] = []  # (shut down here, since), oldest first
        self._outright_at = -math.inf  #: when one was last closed outright

    def add(self, conn: WireClient, outright: bool) -> None:
        """Close ``conn``: outright if asked or if a reply is left unread on it, else shut down.
        (A frame half *sent* -- a caller's source that broke -- is shut down: the server reads the
        EOF mid-frame, drops the connection and closes its side, which this tier sees.)"""
        now = time.monotonic()
        self.prune(now)
        if outright or self._reply_unread(conn.sock):
            self._close_outright(conn, now)
            return
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server's side is gone already: nothing left for it to see
            conn.close()
            return
        self._conns.append((conn, now))
        if len(self._conns) > self.HELD:
            oldest, _ = self._conns.pop(0)
            self._close_outright(oldest, now)

    def _close_outright(self, conn: WireClient, now: float) -> None:
        conn.close()
        self._outright_at = now

    @staticmethod
    def _reply_unread(sock: socket.socket) -> bool:
        """Whether the server sent bytes this tier has not read (not an EOF: that is a close seen).
        Never waits: it runs under the pool lock, and a TLS socket carries a Python timeout (its
        call's deadline), with which CPython waits for readability before any recv, MSG_DONTWAIT
        or not -- a connection in step, closed for a full pool, held the lock for the rest of its
        last call's deadline, and every other call waited behind it (audit s33 r4 D1). So a poll
        decides first; the peek runs only where data (or EOF) is there, and returns at once."""
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True  # decrypted already, not read
        poller = select.poll()  # (not select(): fds above 1024 are common in engines)
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        try:  # (the plain socket's recv: TLS takes no flags, and a peek at its records tells as much)
            return bool(socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing arrived (BlockingIOError), or reset: nothing the server still sends
            return False

    def any(self) -> bool:
        """Whether one of them may still count on the server (those it has seen are let go)."""
        now = time.monotonic()
        self.prune(now)
        return bool(self._conns) or now - self._outright_at < self.limit_s

    def prune(self, now: float) -> None:
        """Let go of the shut-down connections the server has seen closed, or that waited ``limit_s``."""
        if not self._conns:
            return
        unseen = []
        for conn, since in self._conns:
            side = self._server_side(conn.sock)
            if side is _SENDING:
                self._close_outright(conn, now)
            elif side is _CLOSED or now - since >= self.limit_s:
                conn.close()
            else:
                unseen.append((conn, since))
        self._conns = unseen

    def _server_side(self, sock: socket.socket) -> str:
        """:data:`_CLOSED` (EOF, or reset), :data:`_QUIET` (open, nothing more to read) or
        :data:`_SENDING` (more than an ERROR frame arrived: a reply nobody reads)."""
        poller = select.poll()  # (not select(): fds above 1024 are common in engines)
        poller.register(sock, select.POLLIN)
        for _ in range(self._READS):
            if not poller.poll(0):
                return _QUIET
            try:
                if not sock.recv(1 << 16, socket.MSG_DONTWAIT):
                    return _CLOSED  # EOF: the server forgot the connection before closing its side
            except BlockingIOError:
                return _QUIET
            except OSError:  # reset: gone on the server too
                return _CLOSED
        return _SENDING

    def close(self) -> None:
        for conn, _ in self._conns:
            conn.close()
        self._conns = []


class RemoteTier(Tier, StreamingTier):
    name = "remote"
    bounded_reads = True  # every call has one deadline, set when it starts (see the module docstring)

    def __init__(
        self,
        url: str | Address,
        token: str | None = None,
        *,
        namespace: str | None = None,
        session: str = "",
        timeout_s: float = 5.0,
        min_rate_bytes_s: float = DEFAULT_MIN_RATE_BYTES_S,
        connect_timeout_s: float = 2.0,
        pool_size: int = 4,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.address = parse_url(url) if isinstance(url, str) else url
        self._token = resolve_token(self.address, token)
        # the server's own rule: a name it refuses would fail every HELLO, the tier down for good
        self.namespace = check_namespace(namespace or self.address.namespace)
        self.session = session
        # NaN or infinity would be no deadline at all: "bounded" needs finite numbers
        for what, v in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                        ("min_rate_bytes_s", min_rate_bytes_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{what}={v!r}: give a finite number > 0")
        self.timeout_s = timeout_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.connect_timeout_s = connect_timeout_s
        self.pool_size = pool_size
        if name:
            self.name = name
        self._idle: list[WireClient] = []
        self._pool_lock = threading.Lock()
        #: notified when a connection comes back to the pool, a call's goes or one opens (see _wait_for_slot)
        self._pool_returns = threading.Condition(self._pool_lock)
        self._held = 0  #: connections calls hold now (under _pool_lock)
        self._opening = 0  #: connections calls are opening now (under _pool_lock)
        self._closes = 0  #: connections this tier closed so far (under _pool_lock)
        self._unseen = _UnseenCloses(connect_timeout_s)  #: of those, the ones the server may still count
        self._backoff_min = backoff_s
        self._backoff_max = max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0  # 0.0: up; else down, and a reconnection is due from then
        self._probing = False
        self._closed = False
        self.last_error: str | None = None
        self._server_info: dict = {}  #: the last HELLO reply, as sent (unchecked: for display)
        self._server_features: frozenset[str] = frozenset()  #: checked (WireClient.features)
        self._contains_own_only = False  #: checked (HelloFields.contains_own_only)

    # -- connections, failures, backoff ---------------------------------------------------
    @contextmanager
    def _conn(self, deadline: float):
        """A connection for one call: pooled, or opened (connect + HELLO) before ``deadline``."""
        if self._closed:
            raise TierDown("tier closed")
        if self._down_until:  # down since a failure (0.0: up)
            if time.monotonic() >= self._down_until:
                self._probe_in_background()
            raise TierDown(self.last_error or "server down")
        with self._pool_lock:
            conn = self._take_idle_locked()
        waited = False  #: the call waited for the tenant's connection cap (see _open)
        if conn is None:
            conn, waited = self._open(deadline)
        keep = failed = False
        try:
            yield conn
        except (TierDown, CallerError):
            # (CallerError: the caller's source or sink broke its contract, not the server; the
            # connection is out of step with it, a frame half sent or half read: see _UnseenCloses.add)
            raise
        except Exception as exc:  # noqa: BLE001 - timeouts, resets, ERROR frames, garbled replies
            # Callers validate their arguments before taking a connection, so whatever
            # fails here is the server or the network. The connection may be out of
            # step with the server: never reuse it (closed as it is given back).
            failed = True
            self._call_failed(exc, waited)
            raise TierDown(str(exc)) from exc
        else:
            self._backoff = self._backoff_min
            conn.last_used = time.monotonic()
            keep = True
        finally:
            self._give_back(conn, keep, failed)

    def _call_failed(self, exc: BaseException, waited: bool) -> None:
        """A call's request failed. If the call spent part of its deadline waiting for the
        tenant's connection cap and then ran out of time, the wait is the cause, not the server:
        that call alone fails (a server answering on time put every thread into backoff)."""
        if waited and isinstance(exc, TimeoutError):
            self._failed_alone(exc)
        else:
            self._failed(exc)

    def _take_idle_locked(self) -> WireClient | None:
        """A pooled connection the server has not closed, now held by a call (under ``_pool_lock``)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                self._held += 1
                return conn
            conn.close()  # closed by the server while idle: not a failure
        return None

    def _give_back(self, conn: WireClient, keep: bool, failed: bool = False) -> None:
        """A call is over with ``conn``: pooled if ``keep`` and there is room, else closed (``failed``:
        its request failed, see _close_locked). Closes the server has seen are let go meanwhile
        (see _UnseenCloses)."""
        with self._pool_lock:
            self._held -= 1
            self._unseen.prune(time.monotonic())
            keep = keep and len(self._idle) < self.pool_size and not self._closed
            if keep:
                self._idle.append(conn)
            else:
                self._close_locked(conn, failed)
            self._pool_returns.notify_all()

    def _close_locked(self, conn: WireClient, failed: bool = False) -> None:
        """Close a connection of this tier's (under ``_pool_lock``): its server slot frees, but the
        server counts it against the tenant's cap until it has read the close. Calls waiting for
        the cap try to connect again (see _open); a refusal before the server has read it is this
        tier's own doing (see _UnseenCloses). One whose request ``failed`` (timed out, reset) is
        closed outright -- a stalled server must see it closed, not keep sending into it -- and
        counted for ``connect_timeout_s`` (see _closes_may_count_locked); so is one left with a
        reply unread (a caller's sink that broke mid-reply: see _UnseenCloses.add)."""
        if self._closed:
            conn.close()
            return
        self._closes += 1
        self._unseen.add(conn, outright=failed)

    def _open(self, deadline: float) -> tuple[WireClient, bool]:
        """A connection held by the call, and whether the call waited for the tenant's connection
        cap to get it; TierDown if none could be had. A refusal for the cap while this tier holds
        others (or has just closed some) is a load signal, not an outage: the call waits, within
        its deadline, for one of them to come back to the pool or for a slot to free, and tries
        again (no backoff: a refused extra connection of a busy engine put every thread's calls
        into backoff, with the server up and the tier's connection fine)."""
        waited, pause = False, _CAP_RETRY_MIN_S
        while True:
            with self._pool_lock:
                closes_seen = self._closes
            try:
                conn = self._connect(deadline)
            except RemoteError as exc:
                if exc.code != ErrorCode.TOO_MANY_CONNECTIONS or not self._holds_connections():
                    self._failed(exc)
                    raise TierDown(str(exc)) from exc
                waited = True
                pooled = self._wait_for_slot(deadline, exc, closes_seen, pause)
                if pooled is not None:
                    return pooled, waited
                pause = min(pause * 2, _CAP_RETRY_MAX_S)
                continue
            except Exception as exc:  # noqa: BLE001 - refused, timed out, bad token: all "down"
                self._call_failed(exc, waited)
                raise TierDown(str(exc)) from exc
            self._remember_hello(conn)
            return conn, waited

    def _connect(self, deadline: float) -> WireClient:
        """A new connection, held by the call; counted as opening while it connects (the server
        may count it before this tier does: a burst of first calls found the tier holding nothing
        and took the refusals for an outage)."""
        conn = None
        with self._pool_lock:
            self._opening += 1
        try:
            conn = WireClient(self.address, self._token, namespace=self.namespace,
                              connect_timeout_s=self.connect_timeout_s, deadline=deadline)
            return conn
        finally:
            with self._pool_lock:
                self._opening -= 1
                if conn is not None:
                    self._held += 1
                self._pool_returns.notify_all()  # (calls waiting for the cap: held, or no more)

    def _holds_connections(self) -> bool:
        """Whether a cap refusal can be this tier's own doing: it holds or opens connections, or
        closed one the server may still count (see _closes_may_count_locked)."""
        with self._pool_lock:
            return bool(self._idle) or self._may_free_a_slot_locked()

    def _closes_may_count_locked(self) -> bool:
        """Whether a connection this tier closed may still count on the server: one the server has
        not seen closed, or one closed outright within ``connect_timeout_s`` (see _UnseenCloses)."""
        return self._unseen.any()

    def _may_free_a_slot_locked(self) -> bool:
        return bool(self._held or self._opening or self._closes_may_count_locked())

    def _wait_for_slot(self, deadline: float, refusal: RemoteError, closes_seen: int,
                       pause: float) -> WireClient | None:
        """After a cap refusal: the first of this tier's connections to come back to the pool
        before ``deadline``, or None when it is time to connect again -- one of them was closed
        (its slot is free, or soon will be), or one closed that the server has not seen closed
        yet may still count there and ``pause`` is over. TierDown for this call alone (counted, in
        ``last_error``) if the deadline passes first."""
        with self._pool_lock:
            retry_at = time.monotonic() + pause if self._closes_may_count_locked() else math.inf
            while not (self._closed or self._down_until):
                conn = self._take_idle_locked()
                if conn is not None:
                    return conn
                if self._closes != closes_seen or not self._may_free_a_slot_locked():
                    return None  # a slot was freed, or nothing of this tier's is left to free one
                now = time.monotonic()
                if now >= deadline:
                    break
                if now >= retry_at:
                    return None
                self._pool_returns.wait(min(deadline, retry_at) - now)
            else:  # the tier closed or went down meanwhile: that failure is recorded already
                raise TierDown(self.last_error or f"{refusal} (tier down)")
        exc = TierDown(f"{refusal} (no connection of this tier came free within the call's deadline)")
        self._failed_alone(exc)
        raise exc

    def _remember_hello(self, conn: WireClient) -> None:
        self._server_info = conn.info
        self._server_features = conn.features
        self._contains_own_only = conn.hello.contains_own_only

    def _failed_alone(self, exc: BaseException) -> None:
        """One call failed for a cause of its own (the tenant's connection cap): counted and
        recorded, the tier stays up."""
        with self._lock:
            self.stats.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        log.info("remote tier %s: a call failed: %s (no backoff)", self.address, self.last_error)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
        log.warning("remote tier %s: %s (backing off)", self.address, self.last_error)
        with self._pool_lock:  # the others may be just as broken: reconnect afresh
            idle, self._idle = self._idle, []
            for c in idle:
                self._close_locked(c)
            self._pool_returns.notify_all()  # (calls waiting for a pooled connection: down now)

    def _probe_in_background(self) -> None:
        """Start the connection attempt that ends an outage (one at a time). The connection it
        opens joins the pool."""

        def check() -> None:
            try:
                conn = WireClient(self.address, self._token, namespace=self.namespace,
                                  connect_timeout_s=self.connect_timeout_s, deadline=self._deadline())
            except RemoteError as exc:
                # the server answered: refused for the tenant's cap, with this tier's own
                # connections (held, or closed and not yet seen closed) counted, it is up (see _open)
                if exc.code == ErrorCode.TOO_MANY_CONNECTIONS and self._holds_connections():
                    return
                raise
            self._remember_hello(conn)
            conn.last_used = time.monotonic()
            with self._pool_lock:
                keep = not self._closed and len(self._idle) < self.pool_size
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

        start_probe(self, check, self._failed, thread_name="kvtier-remote-probe",
                    answered=lambda: log.info("remote tier %s: the server answers again", self.address))

    def _deadline(self, nbytes: int = 0) -> float:
        """The one deadline of a call that moves ``nbytes`` payload bytes, set at its start."""
        return time.monotonic() + max(self.timeout_s, nbytes / self.min_rate_bytes_s)

    @property
    def available(self) -> bool:
        """False from a failure until a connection to the server succeeds again."""
        return not self._down_until and not self._closed

    # -- contract ----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._contains_many(keys, self._deadline())

    def _contains_many(self, keys: Sequence[BlockKey], deadline: float) -> list[bool]:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        out: list[bool] = []
        try:
            for meta in metas:
                count = len(meta) // KEY_BYTES
                with self._conn(deadline) as c:
                    _, body = c.call(Op.CONTAINS, meta, deadline=deadline, reply_meta=(count, count))
                out += [b == 1 for b in body]
        except TierDown:
            out += [False] * (len(keys) - len(out))
        return out

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        n = 0
        deadline = self._deadline()
        try:
            for meta in metas:
                with self._conn(deadline) as c:
                    _, body = c.call(Op.LOOKUP, meta, deadline=deadline, reply_meta=(U32.size, U32.size))
                    (hit,) = U32.unpack(body)
                count = len(meta) // KEY_BYTES
                n += min(hit, count)
                if hit < count:
                    break
        except TierDown:
            pass
        return n

    def get(self, key: BlockKey, out) -> Status:
        return self.get_many([key], [out])[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence) -> list[Status]:
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        views = [writable_bytes(o) for o in outs]
        return self._get_blocks(keys, views, [v.nbytes for v in views], sealed=False)

    def get_streams(self, keys: Sequence[BlockKey], sinks: Sequence[PayloadSink]) -> list[Status]:
        if len(keys) != len(sinks):
            raise ValueError(f"get_streams: {len(keys)} keys but {len(sinks)} sinks")
        return self._get_blocks(keys, sinks, _announced_sizes(sinks, "sink"), sealed=True)

    def _get_blocks(self, keys: Sequence[BlockKey], payloads: Sequence, sizes: list[int], *,
                    sealed: bool) -> list[Status]:
        for k in keys:
            _check_key(k)
        deadline = self._deadline(sum(sizes))
        statuses: list[Status] = []  # filled as replies arrive: what came before a failure stays
        try:
            for start in range(0, len(keys), MAX_KEYS):
                part = slice(start, start + MAX_KEYS)
                with self._conn(deadline) as c:
                    self._get_batch(c, keys[part], payloads[part], sizes[part], sealed, deadline, statuses)
        except TierDown:
            statuses += [Status.ERROR] * (len(keys) - len(statuses))
        with self._lock:
            for s, n in zip(statuses, sizes):
                if s is Status.OK:
                    self.stats.hits += 1
                    self.stats.bytes_read += n
                elif s is Status.CORRUPT:
                    self.stats.verify_failures += 1
                elif s is not Status.ERROR:
                    self.stats.misses += 1
        return statuses

    @staticmethod
    def _get_batch(c: WireClient, keys: Sequence[BlockKey], payloads: Sequence, sizes: Sequence[int],
                   sealed: bool, deadline: float, out: list[Status]) -> None:
        """Append each block's status to ``out`` as its reply is read. Payloads are buffers
        (checksummed blocks) or, if ``sealed``, sinks (sealed blocks)."""
        meta = b"".join(GET_ITEM.pack(k, n) for k, n in zip(keys, sizes))
        rid = c.send(Op.GET, meta, deadline=deadline)
        # A plain read takes only checksummed blocks (a sealed one has no checksum to verify);
        # a sink authenticates whatever it is fed, so a sealed read takes either kind.
        verified_by = FLAG_SEALED | FLAG_CHECKSUM if sealed else FLAG_CHECKSUM
        for key, payload, n in zip(keys, payloads, sizes):
            h = c.read_header(deadline, rid)
            if h.code != Status.OK:
                check_reply(h, Op.GET, meta=(0, 0))  # a miss carries nothing
                out.append(_status(h.code))
                continue
            # A hit carries a block header and exactly the payload asked for (the server answers
            # BAD_SIZE otherwise): a longer announcement is a protocol error, never read or skipped.
            check_reply(h, Op.GET, meta=(BLOCK_HEADER_NBYTES, BLOCK_HEADER_NBYTES), data=(n, n))
            header = unpack_header(c.read_bytes(h.meta_len, deadline))
            if header is None or header_mismatch(header, key, n) or not header.flags & verified_by:
                c.skip(n, deadline)  # frame boundaries still hold: skip it, report corrupt
                out.append(Status.CORRUPT)
            elif sealed:
                verdict = c.read_stream(n, payload, deadline)
                # a sink that lacks the block's key cannot judge it: a miss, the block is kept
                out.append(Status.OK if verdict is None else
                           Status.MISS if isinstance(verdict, Unverifiable) else Status.CORRUPT)
            else:
                hasher = xxhash.xxh3_128()
                c.read_into(payload, deadline, hasher)
                out.append(Status.OK if hasher.digest() == header.checksum else Status.CORRUPT)

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None,
            session: str | None = None) -> Status:
        return self.put_many([key], [data], parents=[parent], metas=[meta], session=session)[0]

    def put_many(
        self,
        keys: Sequence[BlockKey],
        datas: Sequence,
        *,
        parents: Sequence[BlockKey | None] | None = None,
        metas: Sequence[BlockMeta | None] | None = None,
        session: str | None = None,
        skip_present: bool = False,
    ) -> list[Status]:
        """Put blocks, pipelined on one connection. ``skip_present`` asks first (one round trip)
        which keys the namespace holds and sends only the others -- where the server says its
        CONTAINS answers for this namespace alone. A connection that also reads shared namespaces
        is answered from them too (a copy only a publisher holds is no block of this namespace,
        gone when the publisher deletes it), as is one of an older server that does not say:
        then every block is sent, and the server, which de-duplicates against this namespace
        alone, stores each once. Blocks found present are OK, not counted in ``bytes_written``."""
        if len(keys) != len(datas):
            raise ValueError(f"put_many: {len(keys)} keys but {len(datas)} buffers")
        views = [memoryview(d).cast("B") for d in datas]
        return self._put_blocks(keys, views, [v.nbytes for v in views], parents, metas, session, skip_present,
                                sealed=False)

    def put_streams(
        self,
        keys: Sequence[BlockKey],
        sources: Sequence[PayloadSource],
        *,
        parents: Sequence[BlockKey | None] | None = None,
        session: str | None = None,
    ) -> list[Status]:
        """Put sealed payloads, each sent piece by piece as its source makes it; pipelined like
        :meth:`put_many`. Needs a server that takes them (:meth:`streams_available`)."""
        if len(keys) != len(sources):
            raise ValueError(f"put_streams: {len(keys)} keys but {len(sources)} sources")
        return self._put_blocks(keys, sources, _announced_sizes(sources, "source"), parents, None, session, False,
                                sealed=True)

    def streams_available(self) -> bool:
        if not self._server_info:
            self.ping()  # learn what the server offers (HELLO); nothing if it is down
        return "sealed" in self._server_features

    def _put_blocks(self, keys: Sequence[BlockKey], payloads: Sequence, sizes: list[int], parents, metas,
                    session: str | None, skip_present: bool, *, sealed: bool) -> list[Status]:
        """Payloads are buffers (checksummed blocks) or, if ``sealed``, sources (sealed blocks)."""
        if parents is None:
            parents = [None, *keys[:-1]]
        metas = metas or [None] * len(keys)
        session = self.session if session is None else session
        for k in keys:
            _check_key(k)
        todo = list(range(len(keys)))
        statuses = [Status.ERROR] * len(keys)
        deadline = self._deadline(sum(sizes))
        skipped: set[int] = set()
        if skip_present and keys and self._contains_answers_for_puts():
            present = self._contains_many(keys, deadline)
            skipped = {i for i in todo if present[i]}
            for i in skipped:
                statuses[i] = Status.OK
            todo = [i for i in todo if i not in skipped]
        flags = FLAG_SEALED if sealed else FLAG_CHECKSUM
        # Packed before a connection is taken: a caller's mistake (a session id over
        # MAX_SESSION_BYTES, a meta no header can hold) is the caller's ValueError, not a
        # server failure that closes the connection and puts the tier into backoff. The
        # checksum travels as a trailer (see remote_protocol): none in the header.
        put_metas = {i: pack_put_meta(pack_header(bytes(keys[i]), sizes[i], _NO_CHECKSUM, metas[i], flags=flags),
                                      parents[i], session) for i in todo}
        try:
            with self._conn(deadline) as c:
                if sealed and "sealed" not in c.features:
                    self.last_error = f"{self.address} does not take sealed payloads (an older server)"
                    todo = []
                max_block = c.max_block
                pending: list[tuple[int, int]] = []
                for i in todo:
                    n = sizes[i]
                    if max_block and n > max_block or n == 0:
                        statuses[i] = Status.TOO_LARGE
                        continue
                    meta = put_metas[i]
                    if sealed:
                        rid = c.send_put_stream(meta, payloads[i], deadline)
                    else:
                        rid = c.send_put(meta, payloads[i], deadline)
                    pending.append((i, rid))
                    if len(pending) >= _PUT_WINDOW:
                        self._put_reply(c, pending.pop(0), statuses, deadline)
                for item in pending:
                    self._put_reply(c, item, statuses, deadline)
        except TierDown:
            pass
        with self._lock:
            for i, s in enumerate(statuses):
                if s is Status.OK:
                    self.stats.puts += 1
                    self.stats.bytes_written += 0 if i in skipped else sizes[i]
                else:
                    self.stats.put_failures += 1
        return statuses

    def _contains_answers_for_puts(self) -> bool:
        """Whether the server said (HELLO) that CONTAINS answers for the namespace PUT writes alone."""
        if not self._server_info:
            self.ping()  # learn it (HELLO); nothing if the server is down
        return self._contains_own_only

    @staticmethod
    def _put_reply(c: WireClient, item: tuple[int, int], statuses: list[Status], deadline: float) -> None:
        i, rid = item
        h = c.read_header(deadline, rid)
        check_reply(h, Op.PUT, meta=(0, 0))  # a status, nothing more
        statuses[i] = _status(h.code)

    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        out: list[bool] = []
        deadline = self._deadline()
        try:
            for meta in metas:
                count = len(meta) // KEY_BYTES
                with self._conn(deadline) as c:
                    _, body = c.call(Op.DELETE, meta, deadline=deadline, reply_meta=(count, count))
                out += [b == 1 for b in body]
        except TierDown:
            pass
        out += [False] * (len(keys) - len(out))
        with self._lock:
            self.stats.deletes += sum(out)
        return out

    def keys(self) -> Iterator[BlockKey]:
        """The namespace's keys, oldest first; each page of ``MAX_KEYS`` is a call of its own (with
        its own deadline): a large namespace may take many. Pages follow the server's cursor
        (``list_cursor``); a server without it is asked by offset."""
        found: list[BlockKey] = []
        if not self._server_info:
            self.ping()  # learn what the server offers (HELLO); nothing if it is down
        try:
            if "list_cursor" in self._server_features:
                cursor = 0
                while True:
                    deadline = self._deadline(MAX_KEYS * KEY_BYTES)
                    with self._conn(deadline) as c:  # the reply's checks too: a bad one is TierDown
                        _, body = c.call(Op.LIST, LIST_CURSOR_ARGS.pack(cursor, MAX_KEYS), deadline=deadline,
                                         reply_meta=(U64.size, U64.size + MAX_KEYS * KEY_BYTES))
                        if len(body) < U64.size or (len(body) - U64.size) % KEY_BYTES:
                            raise ProtocolError(ErrorCode.BAD_LENGTH, f"LIST reply of {len(body)} bytes: not a "
                                                                      f"cursor and whole keys")
                        (next_cursor,) = U64.unpack_from(body)
                        if next_cursor and next_cursor <= cursor:
                            raise ProtocolError(ErrorCode.BAD_META, "LIST cursor did not advance")
                    found += [BlockKey(body[i : i + KEY_BYTES]) for i in range(U64.size, len(body), KEY_BYTES)]
                    if not next_cursor:
                        return iter(found)
                    cursor = next_cursor
            while True:
                deadline = self._deadline(MAX_KEYS * KEY_BYTES)
                with self._conn(deadline) as c:
                    _, body = c.call(Op.LIST, LIST_ARGS.pack(len(found), MAX_KEYS), deadline=deadline,
                                     reply_meta=(0, MAX_KEYS * KEY_BYTES))
                    if len(body) % KEY_BYTES:
                        raise ProtocolError(ErrorCode.BAD_LENGTH, f"LIST reply of {len(body)} bytes: not whole keys")
                batch = [BlockKey(body[i : i + KEY_BYTES]) for i in range(0, len(body), KEY_BYTES)]
                found += batch
                if len(batch) < MAX_KEYS:
                    break
        except TierDown:
            pass
        return iter(found)

    def server_stats(self) -> dict:
        """The server's STATS for this connection's tenant and namespace ({} if unreachable)."""
        deadline = self._deadline()
        try:
            with self._conn(deadline) as c:
                return c.call_msgpack(Op.STATS, deadline=deadline)
        except TierDown:
            return {}

    def ping(self) -> bool:
        deadline = self._deadline()
        try:
            with self._conn(deadline) as c:
                c.call(Op.PING, deadline=deadline, reply_meta=(0, 0))
            return True
        except TierDown:
            return False

    @property
    def capacity_bytes(self) -> int:
        return _stat_int(self.server_stats(), "quota_bytes", "capacity_bytes")

    @property
    def used_bytes(self) -> int:
        return _stat_int(self.server_stats(), "namespace_bytes")

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._unseen.close()
            self._pool_returns.notify_all()
        for c in idle:
            c.close()

    def __repr__(self) -> str:
        return f"<RemoteTier {self.address} namespace={self.namespace!r}>"


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"keys are {KEY_BYTES} bytes (kvtier.core.keys), got {key!r:.40}")
    return bytes(key)


#: the largest payload a frame can announce (its u64 data length holds the PUT's checksum trailer too)
_MAX_PAYLOAD = 2**64 - 1 - CHECKSUM_NBYTES


def _announced_sizes(streams: Sequence, what: str) -> list[int]:
    """The ``nbytes`` of payload sources or sinks, checked before a connection is taken: a size
    no frame can carry is the caller's ValueError, not a server failure that puts the tier into
    backoff."""
    sizes = [s.nbytes for s in streams]
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_PAYLOAD:
            raise ValueError(f"a payload {what} announced nbytes={n!r:.40}: give an int of 0..{_MAX_PAYLOAD}")
    return sizes


def _keys_meta(keys: Sequence[BlockKey]) -> bytes:
    return b"".join(_check_key(k) for k in keys)


def _stat_int(stats: dict, *names: str) -> int:
    """The first of ``names`` in a STATS map that is a positive int, else 0: a value of another
    type (a string, a float, a bool) from another version's server is no number of bytes."""
    for name in names:
        v = stats.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _chunks(seq: Sequence, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _status(code: int) -> Status:
    try:
        return Status(code)
    except ValueError:
        return Status.ERROR  # e.g. a PUT into a read-only namespace


def open_remote(url: str, token: str | None = None, **kw) -> RemoteTier:
    """A :class:`RemoteTier` for ``url`` (see :func:`kvtier.tiers.remote_wire.parse_url`)."""
    return RemoteTier(url, token, **kw)
