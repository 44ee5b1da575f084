"""``remote``: the shared pod tier -- a ``kvtier serve`` server -- behind the tier contract.

::

    tier = RemoteTier("tcp://127.0.0.1:7070", token=os.environ["KVTIER_TOKEN"], namespace="llama-70b")
    store = TieredStore([HostTier(...), DiskTier(...), tier])

* **Bounded.** Every operation has a deadline (``timeout_s``); a slow, dead or
  misbehaving server turns into :attr:`Status.ERROR` (gets, puts), ``False``
  (contains, delete) or ``0`` (lookup_prefix): a miss, never a hang, never an
  exception. After a failure the tier stays *down* for a backoff period that
  doubles up to ``max_backoff_s`` (operations fail at once, without network),
  then tries to reconnect; a success resets it.
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
  ``pool_size`` kept open while idle.

Blocks evicted by the server are not reported through ``on_evict`` (the server
owns that policy); ``capacity_bytes`` is the tenant's quota, or the server's
capacity when it has none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.payload import (
    FLAG_CHECKSUM,
    FLAG_SEALED,
    BlockMeta,
    header_mismatch,
    pack_header,
    unpack_header,
)
from kvtier.core.payload import HEADER_NBYTES as BLOCK_HEADER_NBYTES
from kvtier.tiers.base import Status, Tier
from kvtier.tiers.remote_protocol import (
    GET_ITEM,
    LIST_ARGS,
    MAX_KEYS,
    U32,
    Op,
    pack_put_meta,
)
from kvtier.tiers.remote_wire import Address, WireClient, parse_url, resolve_token
from kvtier.tiers.streams import PayloadSink, PayloadSource, StreamingTier

log = logging.getLogger(__name__)

#: puts sent before the first reply is read: enough to keep the pipe full,
#: small enough that replies never fill the socket buffers both ways
_PUT_WINDOW = 64
_NO_CHECKSUM = bytes(16)


class TierDown(Exception):
    """The server is in backoff after a failure (internal: becomes a status)."""


class RemoteTier(Tier, StreamingTier):
    name = "remote"

    def __init__(
        self,
        url: str | Address,
        token: str | None = None,
        *,
        namespace: str | None = None,
        session: str = "",
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        pool_size: int = 4,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.address = parse_url(url) if isinstance(url, str) else url
        self._token = resolve_token(self.address, token)
        self.namespace = namespace or self.address.namespace
        self.session = session
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.pool_size = pool_size
        if name:
            self.name = name
        self._idle: list[WireClient] = []
        self._pool_lock = threading.Lock()
        self._backoff_min = backoff_s
        self._backoff_max = max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self._closed = False
        self.last_error: str | None = None
        self._server_info: dict = {}

    # -- connections, failures, backoff ---------------------------------------------------
    @contextmanager
    def _conn(self):
        now = time.monotonic()
        if self._closed:
            raise TierDown("tier closed")
        if now < self._down_until:
            raise TierDown(self.last_error or "server down")
        conn = None
        with self._pool_lock:
            while self._idle and conn is None:
                conn = self._idle.pop()
                if not conn.reusable():  # closed by the server while idle: not a failure
                    conn.close()
                    conn = None
        if conn is None:
            try:
                conn = WireClient(self.address, self._token, namespace=self.namespace,
                                  connect_timeout_s=self.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - refused, timed out, bad token: all "down"
                self._failed(exc)
                raise TierDown(str(exc)) from exc
            self._server_info = conn.info
        try:
            yield conn
        except TierDown:
            conn.close()
            raise
        except Exception as exc:  # noqa: BLE001 - timeouts, resets, ERROR frames, garbled replies
            # Callers validate their arguments before taking a connection, so whatever
            # fails here is the server or the network. The connection may be out of
            # step with the server: never reuse it.
            conn.close()
            self._failed(exc)
            raise TierDown(str(exc)) from exc
        except BaseException:
            conn.close()
            raise
        else:
            self._backoff = self._backoff_min
            conn.last_used = time.monotonic()
            with self._pool_lock:
                if len(self._idle) < self.pool_size and not self._closed:
                    self._idle.append(conn)
                    conn = None
            if conn is not None:
                conn.close()

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
            c.close()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    @property
    def available(self) -> bool:
        """False while in backoff after a failure."""
        return time.monotonic() >= self._down_until and not self._closed

    # -- contract ----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        out: list[bool] = []
        try:
            for meta in metas:
                with self._conn() as c:
                    _, body = c.call(Op.CONTAINS, meta, deadline=self._deadline())
                    if len(body) != len(meta) // KEY_BYTES:
                        raise ValueError("CONTAINS reply of the wrong length")
                out += [b == 1 for b in body]
        except TierDown:
            out += [False] * (len(keys) - len(out))
        return out

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        n = 0
        try:
            for meta in metas:
                with self._conn() as c:
                    _, body = c.call(Op.LOOKUP, meta, deadline=self._deadline())
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
        views = [memoryview(o).cast("B") for o in outs]
        for v in views:
            if v.readonly:
                raise ValueError("get: the output buffer is read-only")
        return self._get_blocks(keys, views, [v.nbytes for v in views], sealed=False)

    def get_streams(self, keys: Sequence[BlockKey], sinks: Sequence[PayloadSink]) -> list[Status]:
        if len(keys) != len(sinks):
            raise ValueError(f"get_streams: {len(keys)} keys but {len(sinks)} sinks")
        return self._get_blocks(keys, sinks, [s.nbytes for s in sinks], sealed=True)

    def _get_blocks(self, keys: Sequence[BlockKey], payloads: Sequence, sizes: list[int], *,
                    sealed: bool) -> list[Status]:
        for k in keys:
            _check_key(k)
        statuses: list[Status] = []
        try:
            for start in range(0, len(keys), MAX_KEYS):
                part = slice(start, start + MAX_KEYS)
                with self._conn() as c:
                    statuses += self._get_batch(c, keys[part], payloads[part], sizes[part], sealed)
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

    def _get_batch(self, c: WireClient, keys: Sequence[BlockKey], payloads: Sequence, sizes: Sequence[int],
                   sealed: bool) -> list[Status]:
        """Payloads are buffers (checksummed blocks) or, if ``sealed``, sinks (sealed blocks)."""
        deadline = self._deadline()
        meta = b"".join(GET_ITEM.pack(k, n) for k, n in zip(keys, sizes))
        rid = c.send(Op.GET, meta, deadline=deadline)
        # A plain read takes only checksummed blocks (a sealed one has no checksum to verify);
        # a sink authenticates whatever it is fed, so a sealed read takes either kind.
        verified_by = FLAG_SEALED | FLAG_CHECKSUM if sealed else FLAG_CHECKSUM
        out: list[Status] = []
        for key, payload, n in zip(keys, payloads, sizes):
            h = c.read_header(deadline, rid)
            if h.op != Op.GET:
                raise ValueError(f"GET answered with op {h.op}")
            if h.code != Status.OK:
                if h.meta_len or h.data_len:
                    raise ValueError("a GET miss carried data")
                out.append(_status(h.code))
                continue
            if h.meta_len != BLOCK_HEADER_NBYTES:
                raise ValueError("GET reply without a block header")
            header = unpack_header(c.read_bytes(h.meta_len, deadline))
            if (header is None or h.data_len != n or header_mismatch(header, key, n)
                    or not header.flags & verified_by):
                c.skip(h.data_len, deadline)  # frame boundaries still hold: skip it, report corrupt
                out.append(Status.CORRUPT)
            elif sealed:
                out.append(Status.OK if c.read_stream(n, payload, deadline) is None else Status.CORRUPT)
            else:
                hasher = xxhash.xxh3_128()
                c.read_into(payload, deadline, hasher)
                out.append(Status.OK if hasher.digest() == header.checksum else Status.CORRUPT)
            deadline = self._deadline()  # each block gets its own time budget
        return out

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
        which keys the server holds and sends only the others."""
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
        return self._put_blocks(keys, sources, [s.nbytes for s in sources], parents, None, session, False,
                                sealed=True)

    def streams_available(self) -> bool:
        if not self._server_info:
            self.ping()  # learn what the server offers (HELLO); nothing if it is down
        return "sealed" in self._server_info.get("features", ())

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
        if skip_present and keys:
            present = self.contains_many(keys)
            for i in [i for i in todo if present[i]]:
                statuses[i] = Status.OK
            todo = [i for i in todo if not present[i]]
        flags = FLAG_SEALED if sealed else FLAG_CHECKSUM
        try:
            with self._conn() as c:
                if sealed and "sealed" not in c.info.get("features", ()):
                    self.last_error = f"{self.address} does not take sealed payloads (an older server)"
                    todo = []
                max_block = c.max_block
                deadline = self._deadline()
                pending: list[tuple[int, int]] = []
                for i in todo:
                    n = sizes[i]
                    if max_block and n > max_block or n == 0:
                        statuses[i] = Status.TOO_LARGE
                        continue
                    # The checksum travels as a trailer (see remote_protocol): none in the header.
                    header = pack_header(bytes(keys[i]), n, _NO_CHECKSUM, metas[i], flags=flags)
                    meta = pack_put_meta(header, parents[i], session)
                    if sealed:
                        rid = c.send_put_stream(meta, payloads[i], deadline)
                    else:
                        rid = c.send_put(meta, payloads[i], deadline)
                    pending.append((i, rid))
                    if len(pending) >= _PUT_WINDOW:
                        self._put_reply(c, pending.pop(0), statuses, deadline)
                    deadline = self._deadline()  # each block gets its own time budget
                for item in pending:
                    self._put_reply(c, item, statuses, deadline)
        except TierDown:
            pass
        with self._lock:
            for i, s in enumerate(statuses):
                if s is Status.OK:
                    self.stats.puts += 1
                    self.stats.bytes_written += sizes[i]
                else:
                    self.stats.put_failures += 1
        return statuses

    @staticmethod
    def _put_reply(c: WireClient, item: tuple[int, int], statuses: list[Status], deadline: float) -> None:
        i, rid = item
        h = c.read_header(deadline, rid)
        if h.meta_len or h.data_len:
            c.skip(h.meta_len + h.data_len, deadline)
        statuses[i] = _status(h.code)

    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        metas = [_keys_meta(chunk) for chunk in _chunks(keys, MAX_KEYS)]
        out: list[bool] = []
        try:
            for meta in metas:
                with self._conn() as c:
                    _, body = c.call(Op.DELETE, meta, deadline=self._deadline())
                out += [b == 1 for b in body[: len(meta) // KEY_BYTES]]
        except TierDown:
            pass
        out += [False] * (len(keys) - len(out))
        with self._lock:
            self.stats.deletes += sum(out)
        return out

    def keys(self) -> Iterator[BlockKey]:
        found: list[BlockKey] = []
        try:
            while True:
                with self._conn() as c:
                    _, body = c.call(Op.LIST, LIST_ARGS.pack(len(found), MAX_KEYS), deadline=self._deadline())
                batch = [BlockKey(body[i : i + KEY_BYTES]) for i in range(0, len(body), KEY_BYTES)]
                found += batch
                if len(batch) < MAX_KEYS:
                    break
        except TierDown:
            pass
        return iter(found)

    def server_stats(self) -> dict:
        """The server's STATS for this connection's tenant and namespace ({} if unreachable)."""
        try:
            with self._conn() as c:
                return c.call_msgpack(Op.STATS, deadline=self._deadline())
        except TierDown:
            return {}

    def ping(self) -> bool:
        try:
            with self._conn() as c:
                c.call(Op.PING, deadline=self._deadline())
            return True
        except TierDown:
            return False

    @property
    def capacity_bytes(self) -> int:
        s = self.server_stats()
        return int(s.get("quota_bytes") or s.get("capacity_bytes") or 0)

    @property
    def used_bytes(self) -> int:
        return int(self.server_stats().get("namespace_bytes", 0))

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def __repr__(self) -> str:
        return f"<RemoteTier {self.address} namespace={self.namespace!r}>"


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"keys are {KEY_BYTES} bytes (kvtier.core.keys), got {key!r:.40}")
    return bytes(key)


def _keys_meta(keys: Sequence[BlockKey]) -> bytes:
    return b"".join(_check_key(k) for k in keys)


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
