"""KV events for routers: block stored / removed, per tier -- only to admitted subscribers.

Why not a plain ZMQ PUB: anyone who reached it learnt every tenant's block keys,
and keys are deterministic chains over tokens, so a listener could confirm that
tenant B sent prompt P (the prompt-leak class of CVE-2025-46570). Here:

* **Who may listen.** Over TCP the socket is a CURVE server (``curve_secret``):
  the handshake is encrypted and only public keys listed in ``subscribers`` get
  through ZAP; a TCP endpoint without CURVE is refused. Over ``ipc://`` the
  socket file is created 0600 (only the server's user can connect) and every
  connecting peer is admitted with scope ``*``.
* **What each sees.** A subscriber's *scope* is ``*`` (every tenant: a
  cluster router) or one tenant name. Each scope has its own sequence numbers
  and replay ring, so a tenant-scoped subscriber learns nothing of other
  tenants, not even that they were active (no gaps from their traffic).
* **How blocks are named.** Never by client keys: by
  :func:`event_block_name`, an HMAC under ``name_key``, a secret the operator
  gives to admitted subscribers. A router that knows the tenant, namespace and
  tokens computes the same names; a listener without the key learns nothing.

Protocol (ROUTER on the server, DEALER on the subscriber; frames are bytes):

* subscriber → server ``[b"SUB", since]``: register (or renew: repeat at least
  every ``peer_ttl_s / 3``); ``since`` is empty, or a u64 big-endian sequence
  number to replay from. Replays are rate-limited per subscriber key (``BUSY`` answers).
* server → subscriber ``[b"EV", seq, payload, publisher]`` live and replayed, then
  ``[b"SYNC", next_seq, publisher]`` after a SUB (and, unasked, when the server checks who
  is still connected); ``[b"FULL"]`` when no slot is left (see below);
  ``[b"BUSY"]`` for a replay asked again too soon.
* ``payload`` is msgpack ``[timestamp, [event, …]]``, each event a map
  ``{"type": "stored" | "removed", "tier", "owner", "namespace",
  "blocks": [name, …], "nbytes"}``.

``seq`` grows by one per message of a scope; each scope's replay ring keeps its
newest messages holding at most ``buffer`` events in all (``events_buffer``). A
gap that replay cannot fill (the ring moved on, or the bounded event queue
overflowed: then ``*`` and the scopes of the tenants whose events were lost skip
one, no other scope) means the subscriber's view is incomplete: it must clear
what it learnt from this publisher and start again.

**Restarts.** ``publisher`` is :data:`PUBLISHER_ID_BYTES` random bytes drawn at each
start of the server. A restarted server numbers from 0 again, but a subscriber hears from it
only at its next renewal: writes meanwhile may have brought the new numbers up to the one the
subscriber expects (or past it), so a number that went back does not tell every restart; a
``publisher`` that changed does, and what was learnt from the old server is stale. A ``SYNC``
ahead of the next number expected is a gap at once (messages sent while the subscriber was not
registered), not only at the next ``EV``. The id is a trailing frame, so no version is needed
either way: a subscriber from before it reads the first three frames and ignores it; frames
without it (a server from before it) are no error, a restart is then told only by a number that
went back. Frames after it are ignored, for later additions alike.

**Erasure.** An admin erase purges the rings (:meth:`EventPublisher.purge`):
every kept message that holds an erased event (of the tenant, namespace or
session's blocks, the erasure's own ``removed`` events included) leaves the
rings of ``*`` and of that tenant, so a replay returns none of its names. A
replay across the purge sees a hole there, and starts again.

**Who a peer is.** A registration belongs to the pair (ZMQ routing id, CURVE
key that sent the SUB), and its scope is taken from that key on every SUB: a
routing id is the peer's choice, so a tenant's key that reuses a router's id
replaces the router's registration instead of inheriting its scope. A routing
id that no longer reaches anyone is forgotten at once: the socket is
``ROUTER_MANDATORY`` (a send to a departed id fails, and the peer goes) and a
socket monitor reports disconnects, after which every peer is sent a ``SYNC``
to find the departed. Otherwise a registration lapses after ``peer_ttl_s``.

**Slots.** ``max_subscribers`` in all; one key holds at most
``max_peers_per_key`` (another SUB from the key replaces its least recently
seen peer, which then gets nothing until it renews); keys of scope ``*`` (the
cluster routers) have ``max_peers_per_key`` slots each set aside (at most half
of all), which tenant-scoped keys cannot take. Over ``ipc://`` there are no
keys: only ``max_subscribers`` applies.

Events come from any thread (tier eviction hooks run in I/O threads); one
publisher thread owns the sockets (ZMQ sockets are not thread safe).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from kvtier.core.framing import frame, frame_str

log = logging.getLogger(__name__)

ALL_TENANTS = "*"
_ZAP_DOMAIN = "kvtier-events"
_SEQ = struct.Struct(">Q")
#: the length of the id a publisher draws at each start (the last frame of its EV and SYNC)
PUBLISHER_ID_BYTES = 16
_TAG_OWNER, _TAG_NAMESPACE, _TAG_KEY = 1, 2, 3
#: how long after a disconnect the peers are checked (at most this often): the socket drops
#: the departed pipe meanwhile, and a burst of disconnects costs one check
_CHECK_DELAY_S = 0.05
#: the most queued events one message carries (fewer when the replay buffer is under 10,000)
_BATCH_EVENTS = 1000
#: messages queued for one subscriber that does not read, before the next ones are dropped (it sees
#: a gap and asks for a replay): at most 1,000 x _BATCH_EVENTS events (~160 MB) held for it, where
#: 10,000 messages held up to ~1.6 GB for each stalled subscriber
_SEND_QUEUE_MESSAGES = 1000
#: ZMTP heartbeats on a listener's connections (the router's SUB to each vLLM worker and its replay
#: DEALER, :class:`EventSubscriber`'s DEALER): a listener sends nothing once subscribed, so a flow
#: that died without a FIN or RST reaching it (a crashed or rebooted host, a NAT or firewall that
#: dropped an idle flow) was never noticed: the stale entries stayed, and a publisher restarted on
#: the same address was never heard. A PING every 2 s; no traffic for 6 s (three unanswered) ends
#: the connection, ZMQ reconnects and the listener's disconnect path (clear, replay) runs. The peer
#: answers in libzmq's I/O thread (ZMTP 3.1, libzmq >= 4.2: vLLM's pyzmq publisher, kvtier serve),
#: so a worker busy in Python still answers, and 6 s rides out a loaded host's scheduling stalls.
#: No TCP keepalive: the PINGs are traffic on the flow, so they keep a NAT's entry alive too, and
#: find a dead peer long before the kernel's keepalive would (2 h idle by default).
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
#: asks the peer to drop its end after as long without a word from us (our PINGs are that word):
#: a publisher stops queueing messages into a dead router's flow
HEARTBEAT_TTL_MS = 6000
#: renewals a subscriber queues while the server is unreachable (it sends one every ``renew_s``):
#: past this they are skipped, not blocking the thread (at the default 1,000, after ~83 minutes)
#: nor sent to the server in a pile when it is back
_SUB_QUEUE = 4


def event_block_name(name_key: bytes, owner: str, namespace: str, key: bytes) -> bytes:
    """The 32-byte name events give a block: HMAC-SHA256 under the subscribers' secret."""
    msg = frame_str(_TAG_OWNER, owner) + frame_str(_TAG_NAMESPACE, namespace) + frame(_TAG_KEY, bytes(key))
    return hmac.digest(name_key, msg, hashlib.sha256)


def check_endpoint(endpoint: str, *, curve: bool) -> None:
    """Refuse an endpoint that would hand events to unauthenticated listeners."""
    scheme = endpoint.split("://", 1)[0]
    if scheme == "ipc":
        return
    if scheme != "tcp":
        raise ValueError(f"events endpoint {endpoint!r}: use tcp://HOST:PORT (with CURVE keys) or ipc:///path")
    if not curve:
        host = urlsplit(endpoint).hostname or ""
        where = "any local user" if _is_loopback(host) else "anyone on the network"
        raise ValueError(
            f"events endpoint {endpoint!r} without CURVE would let {where} read every tenant's KV events; "
            f"set events_curve_secret (`kvtier admin new-events-keys`) or use ipc:///path (a 0600 socket)"
        )


def heartbeat(sock) -> None:
    """Set :data:`HEARTBEAT_IVL_MS` and its timeouts on a listener's ``sock``, before it connects."""
    import zmq

    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Kept(NamedTuple):
    """A message kept for replay."""

    seq: int
    payload: bytes
    events: int  #: how many events it holds (what the ring's bound counts)


class _Scope:
    """The stream one kind of subscriber sees: its own sequence numbers and replay ring.

    The ring keeps the newest messages holding at most ``buffer`` events in all. Its
    bound counts events, not messages: a message holds 1 to :data:`_BATCH_EVENTS` events
    (as many as were queued when it was sent), so a bound in messages kept up to 1,000x
    ``buffer`` events under load.
    """

    __slots__ = ("name", "seq", "ring", "buffer", "held")

    def __init__(self, name: str, buffer: int) -> None:
        self.name = name
        self.seq = 0
        self.ring: collections.deque[_Kept] = collections.deque()
        self.buffer = buffer
        self.held = 0  #: events in ``ring``

    def admits(self, owner: str) -> bool:
        return self.name == ALL_TENANTS or self.name == owner

    def keep(self, seq: int, payload: bytes, events: int) -> None:
        """Keep a message for replay, dropping the oldest while the ring holds more than ``buffer`` events."""
        self.ring.append(_Kept(seq, payload, events))
        self.held += events
        while self.held > self.buffer and self.ring:
            self.held -= self.ring.popleft().events

    def forget(self, holds_erased) -> None:
        """Drop every kept message whose payload ``holds_erased`` says yes to."""
        self.ring = collections.deque(m for m in self.ring if not holds_erased(m.payload))
        self.held = sum(m.events for m in self.ring)


class _Purge(NamedTuple):
    """An erasure's purge of the replay rings, queued behind the events emitted before it."""

    owner: str
    namespace: str | None  #: None: every namespace of ``owner``
    blocks: tuple[tuple[str, bytes], ...] | None  #: (namespace, key) of each block; None: all of them


class _EventQueue(queue.Queue):
    """The bounded event queue, which also carries purges (:meth:`put_beyond_bound`)."""

    def put_beyond_bound(self, item) -> None:
        """Queue ``item`` even when full, without waiting: a purge dropped on a full queue left an
        erased tenant's names in the rings. Erasures are admin calls, so they add few items."""
        with self.mutex:  # what put() does under it, less the wait for room
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()


class _Peer:
    __slots__ = ("scope", "last_seen")

    def __init__(self, scope: _Scope, now: float) -> None:
        self.scope = scope
        self.last_seen = now


#: a registration: (ZMQ routing id, the CURVE key that sent its SUB; "" over ipc)
_PeerId = tuple[bytes, str]


class EventPublisher:
    """Publishes KV events to admitted subscribers (see the module docstring).

    ``subscribers`` maps a subscriber's z85 CURVE public key to its scope (``*``
    or a tenant name); it is required with ``curve_secret`` and unused over ipc.
    ``buffer``: events (not messages) each scope keeps for replay; a message carries at
    most 1,000 events and at most a tenth of ``buffer`` (at least one).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        name_key: bytes,
        curve_secret: str | None = None,
        subscribers: Mapping[str, str] | None = None,
        buffer: int = 10000,
        queue_limit: int = 100_000,
        max_subscribers: int = 64,
        max_peers_per_key: int = 4,
        peer_ttl_s: float = 30.0,
        replay_interval_s: float = 1.0,
        batch_s: float = 0.005,
    ) -> None:
        import zmq

        check_endpoint(endpoint, curve=curve_secret is not None)
        if len(name_key) < 16:
            raise ValueError("events name_key must be at least 16 bytes of secret")
        if buffer < 1:
            raise ValueError(f"events buffer: keep at least 1 event for replay, got {buffer}")
        self._zmq = zmq
        self._name_key = bytes(name_key)
        #: this start's own id, in every EV and SYNC: a subscriber tells a restarted server by it even
        #: when the new numbers have reached the old ones (see "Restarts" in the module docstring)
        self.publisher_id = os.urandom(PUBLISHER_ID_BYTES)
        self._subscribers = dict(subscribers or {})
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_QUEUE_MESSAGES)  # a stalled subscriber loses messages
        self._sock.setsockopt(zmq.RCVHWM, 1_000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4096)  # subscribers send only tiny SUB frames (and handshakes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a departed routing id fails: forget it
        if curve_secret is not None:
            self._start_curve(curve_secret)
        self._bind(endpoint)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._buffer = buffer
        #: a message holds at most a tenth of what the ring keeps: the newest message is always
        #: kept, and dropping the oldest whole messages leaves more than 90 % of ``buffer`` events
        self._batch_events = max(1, min(_BATCH_EVENTS, buffer // 10))
        self._scopes: dict[str, _Scope] = {ALL_TENANTS: _Scope(ALL_TENANTS, buffer)}
        for scope in set(self._subscribers.values()):
            self._scopes.setdefault(scope, _Scope(scope, buffer))
        self._peers: dict[_PeerId, _Peer] = {}
        self._last_replay: dict[str, float] = {}
        self._max_subscribers = max_subscribers
        self._max_per_key = max_peers_per_key
        all_keys = sum(1 for scope in self._subscribers.values() if scope == ALL_TENANTS)
        #: slots tenant-scoped keys may not take: kept for the all-tenant keys (routers)
        self._reserved = min(max_subscribers // 2, max_peers_per_key * all_keys)
        # disconnects (of some peer: the monitor does not say which) → check every peer
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._check_at: float | None = None
        self._peer_ttl_s = peer_ttl_s
        self._replay_interval_s = replay_interval_s
        self._queue = _EventQueue(maxsize=queue_limit)
        self._batch_s = batch_s
        #: the scopes that skip a number at the next publish: ``*`` and those of the owners whose
        #: events a full queue dropped; bounded, one entry per scope (producers add, the publisher takes)
        self._lost_scopes: set[str] = set()
        self._lost_lock = threading.Lock()
        #: events accepted / dropped because the queue was full
        self.emitted = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    @property
    def seq(self) -> int:
        """The next sequence number of the all-tenants scope."""
        return self._scopes[ALL_TENANTS].seq

    # -- set-up ---------------------------------------------------------------------------
    def _start_curve(self, curve_secret: str) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        secret = curve_secret.encode() if isinstance(curve_secret, str) else curve_secret
        if len(secret) != 40:
            raise ValueError("events_curve_secret must be a 40-character z85 CURVE secret key")
        if not self._subscribers:
            raise ValueError("events over CURVE need at least one subscriber key (events_subscribers)")
        for key, scope in self._subscribers.items():
            if len(key) != 40:
                raise ValueError(f"events subscriber key {key[:12]!r}…: expected a 40-character z85 public key")
            if not scope:
                raise ValueError(f"events subscriber {key[:12]}…: give a scope, '*' or a tenant name")
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("kvtier.events.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=_KeyList(self._subscribers))
        self._sock.curve_server = True
        self._sock.curve_secretkey = secret
        self._sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())

    def _bind(self, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            self._sock.bind(endpoint)
            return
        # The socket file is the credential: only the server's user may connect.
        old = os.umask(0o177)
        try:
            self._sock.bind(endpoint)
        finally:
            os.umask(old)
        os.chmod(endpoint[len("ipc://"):], 0o600)

    # -- producer side (any thread) -----------------------------------------------------------
    def emit(self, kind: str, tier: str, owner: str, namespace: str, keys: list[bytes], nbytes: int) -> None:
        """Queue one event; never blocks. A full queue drops it and makes ``*`` and ``owner``'s scope
        (those that would have carried it) skip a number; no other scope: a gap in one tenant's
        stream from another's burst told it of that tenant's activity, and made it start again."""
        try:
            self._queue.put_nowait((kind, tier, owner, namespace, keys, nbytes))
            self.emitted += 1
        except queue.Full:
            self.dropped += 1
            with self._lost_lock:
                self._lost_scopes.update({ALL_TENANTS, owner} & self._scopes.keys())

    def purge(self, owner: str, namespace: str | None = None,
              blocks: list[tuple[str, bytes]] | None = None) -> None:
        """Take the erased events of ``owner`` (of ``namespace``; of these ``(namespace, key)`` blocks)
        out of the replay rings: every kept message holding one leaves the rings of ``*`` and of
        ``owner``. Applied after the events queued before (an erasure's "removed" ones among them),
        on the publisher thread; any thread may call it, and it never blocks."""
        self._queue.put_beyond_bound(_Purge(owner, namespace, None if blocks is None else tuple(blocks)))

    # -- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            batch, purge = self._next_batch()
            if batch or self._lost_scopes:
                self._publish(batch)
            if purge is not None:
                self._purge(purge)
            ready = dict(poller.poll(0))
            if self._sock in ready:
                self._serve_requests()
            if self._monitor in ready:
                self._drain_monitor()
                if self._check_at is None:  # coalesced, and after the socket has dropped the pipe
                    self._check_at = time.monotonic() + _CHECK_DELAY_S
            if self._check_at is not None and time.monotonic() >= self._check_at:
                self._check_at = None
                self._check_peers()
            self._expire_peers()

    def _next_batch(self) -> tuple[list[tuple], _Purge | None]:
        """The events queued (waiting up to ``batch_s`` for the first), a batch at most, and the purge
        queued after them that ended the batch, if one did."""
        batch: list[tuple] = []
        try:
            item = self._queue.get(timeout=self._batch_s)
            while not isinstance(item, _Purge):
                batch.append(item)
                if len(batch) >= self._batch_events:
                    return batch, None
                item = self._queue.get_nowait()
            return batch, item
        except queue.Empty:
            return batch, None

    def _publish(self, batch: list[tuple]) -> None:
        import msgpack

        with self._lost_lock:
            lost, self._lost_scopes = self._lost_scopes, set()
        now = time.time()
        for scope in self._scopes.values():
            if scope.name in lost:
                scope.seq += 1  # the lost events leave a gap every subscriber that would have had them sees
            events = [self._render(e) for e in batch if scope.admits(e[2])]
            if not events:
                continue
            payload = msgpack.packb([now, events], use_bin_type=True)
            seq = scope.seq
            scope.seq += 1
            scope.keep(seq, payload, len(events))
            frames = self._ev(seq, payload)
            for pid, peer in list(self._peers.items()):
                if peer.scope is scope:
                    self._send(pid[0], frames)

    def _purge(self, purge: _Purge) -> None:
        """Forget the kept messages holding an event ``purge`` names. Whole messages: one packed again
        without those events would hand a replaying subscriber a stream that looks complete but lacks
        the erasure's "removed" events; the hole it sees instead makes it start again."""
        import msgpack

        names = None if purge.blocks is None else {
            event_block_name(self._name_key, purge.owner, namespace, key) for namespace, key in purge.blocks}

        def erased(event: dict) -> bool:
            return (event["owner"] == purge.owner
                    and (purge.namespace is None or event["namespace"] == purge.namespace)
                    and (names is None or not names.isdisjoint(event["blocks"])))

        def holds_erased(payload: bytes) -> bool:
            return any(erased(e) for e in msgpack.unpackb(payload, raw=False)[1])

        for scope in self._scopes.values():
            if scope.admits(purge.owner):
                scope.forget(holds_erased)

    def _render(self, event: tuple) -> dict:
        kind, tier, owner, namespace, keys, nbytes = event
        names = [event_block_name(self._name_key, owner, namespace, k) for k in keys]
        return {"type": kind, "tier": tier, "owner": owner, "namespace": namespace, "blocks": names,
                "nbytes": nbytes}

    def _ev(self, seq: int, payload: bytes) -> list[bytes]:
        return [b"EV", _SEQ.pack(seq), payload, self.publisher_id]

    def _sync(self, next_seq: int) -> list[bytes]:
        return [b"SYNC", _SEQ.pack(next_seq), self.publisher_id]

    def _send(self, ident: bytes, frames: list[bytes]) -> bool:
        """Send to a routing id; False (and its registrations forgotten) if it reaches no one."""
        try:
            self._sock.send_multipart([ident, *frames], self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # that subscriber is not reading: it will see a gap
        except self._zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): that peer is gone
            self._forget(ident)
            return False
        return True

    def _forget(self, ident: bytes) -> None:
        for pid in [pid for pid in self._peers if pid[0] == ident]:
            del self._peers[pid]

    def _drain_monitor(self) -> None:
        for _ in range(1000):
            try:
                self._monitor.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return

    def _check_peers(self) -> None:
        """Some peer disconnected: find which by sending each a SYNC (a departed one fails)."""
        for (ident, _), peer in list(self._peers.items()):
            self._send(ident, self._sync(peer.scope.seq))

    def _serve_requests(self) -> None:
        zmq = self._zmq
        for _ in range(100):  # bounded work per loop, so publishing never starves
            try:
                msg = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = msg[0].bytes
            body = [f.bytes for f in msg[1:]]
            if not body or body[0] != b"SUB" or len(body) != 2 or len(body[1]) not in (0, _SEQ.size):
                continue  # not our protocol: no answer
            user = self._user_of(msg[-1])
            if user is not None:
                self._subscribe(ident, user, body[1])

    def _user_of(self, frame_) -> str | None:
        """The admitted subscriber that sent this frame (its CURVE key), or None."""
        if self._auth is None:
            return ""  # ipc: the socket file's permission admitted it
        try:
            user = frame_.get("User-Id")
        except Exception:  # noqa: BLE001 - no ZAP identity: not admitted
            return None
        return user if user in self._subscribers else None

    def _subscribe(self, ident: bytes, user: str, since_raw: bytes) -> None:
        scope = self._scopes[self._subscribers.get(user, ALL_TENANTS)]
        now = time.monotonic()
        peer = self._peers.get((ident, user))
        if peer is None:
            self._forget(ident)  # the id now speaks for another key: its old scope must not follow
            if not self._make_room(user, scope):
                self._send(ident, [b"FULL"])
                return
            peer = self._peers[(ident, user)] = _Peer(scope, now)
        peer.last_seen = now
        if since_raw:
            # Per key, not per connection: reconnecting must not buy another replay.
            if now - self._last_replay.get(user, float("-inf")) < self._replay_interval_s:
                self._send(ident, [b"BUSY"])
                return
            self._last_replay[user] = now
            (since,) = _SEQ.unpack(since_raw)
            for seq, payload, _ in list(scope.ring):
                if seq >= since:
                    self._send(ident, self._ev(seq, payload))
        self._send(ident, self._sync(scope.seq))

    def _make_room(self, user: str, scope: _Scope) -> bool:
        """Whether a new peer of ``user`` may register (see "Slots" in the module docstring);
        may forget that key's least recently seen peer to make room."""
        if self._auth is not None:  # ipc has no keys to count by
            mine = [pid for pid in self._peers if pid[1] == user]
            if len(mine) >= self._max_per_key:
                del self._peers[min(mine, key=lambda pid: self._peers[pid].last_seen)]
                return True  # its own slot, reused
        if len(self._peers) >= self._max_subscribers:
            return False
        if scope.name == ALL_TENANTS:
            return True
        tenant_peers = sum(1 for p in self._peers.values() if p.scope.name != ALL_TENANTS)
        return tenant_peers < self._max_subscribers - self._reserved

    def _expire_peers(self) -> None:
        now = time.monotonic()
        for pid in [i for i, p in self._peers.items() if now - p.last_seen > self._peer_ttl_s]:
            del self._peers[pid]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class _KeyList:
    """ZAP credentials: a CURVE client is admitted iff its public key is configured."""

    def __init__(self, subscribers: Mapping[str, str]) -> None:
        self._keys = frozenset(k.encode() for k in subscribers)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


class EventSubscriber:
    """The subscriber side, for routers and tests: register, replay, receive, renew.

    ``recv`` returns ``(seq, events)`` or None on timeout; it renews the
    registration as it goes, and never raises on what the server sends. ``gaps`` counts
    sequence numbers that never arrived (an ``EV`` or ``SYNC`` ahead of the next expected
    number), and messages that could not be read (``malformed``: frames missing or short, a
    payload that is not ``[timestamp, [event, …]]``, a publisher id of another length), whose
    events are as lost; ``restarts`` counts restarts of the server (another publisher id, or a
    ``SYNC`` or ``EV`` below the next expected number: see "Restarts" in the module docstring),
    after which what was learnt of the old one is stale. ``publisher_id``: the id of the
    server heard last (None before, or from a server that sends none). ``heard``: when a
    ``SYNC`` or ``EV`` last came (``time.monotonic``; 0.0 before the first). Not thread safe:
    one thread uses it.

    With ``since``, the first message is expected to be number ``since``: when the first ``EV`` or
    ``SYNC`` is ahead of it (the ring moved past ``since``, or the replay was answered ``BUSY``
    and the next number came live or with a renewal), the numbers in between count as gaps; one
    below it, a number that went back, is a restart.
    """

    def __init__(self, endpoint: str, *, server_public: str | None = None, public: str | None = None,
                 secret: str | None = None, since: int | None = None, renew_s: float = 5.0) -> None:
        import zmq

        self._zmq = zmq
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _SUB_QUEUE)
        heartbeat(self._sock)
        if server_public is not None:
            self._sock.curve_serverkey = server_public.encode()
            self._sock.curve_publickey = (public or "").encode()
            self._sock.curve_secretkey = (secret or "").encode()
        self._sock.connect(endpoint)
        self.endpoint = endpoint
        self.renew_s = renew_s
        self._last_sub = 0.0
        self.next_seq: int | None = None
        self.publisher_id: bytes | None = None
        self.gaps = 0
        self.restarts = 0
        self.malformed = 0
        self.status: bytes | None = None
        self.heard = 0.0
        self._since = since   #: the number asked to replay from: the first message is judged against it
        self._sub(since)

    def _sub(self, since: int | None) -> None:
        try:
            self._sock.send_multipart([b"SUB", b"" if since is None else _SEQ.pack(since)], self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass   # the server is unreachable and renewals are queued already: one is enough
        self._last_sub = time.monotonic()

    def recv(self, timeout_s: float = 1.0) -> tuple[int, list] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() - self._last_sub > self.renew_s:
                self._sub(None)
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(min(left, self.renew_s) * 1000)):
                if time.monotonic() >= deadline:
                    return None
                continue
            got = self._take(self._sock.recv_multipart())
            if got is not None:
                return got

    def _take(self, frames: list[bytes]) -> tuple[int, list] | None:
        """One message from the server: an ``EV``'s ``(seq, events)``, else None (after noting a
        ``SYNC``'s number, or a message that cannot be read as a gap)."""
        import msgpack

        kind = frames[0]
        if kind not in (b"SYNC", b"EV"):
            if kind in (b"BUSY", b"FULL"):
                self.status = kind
            else:
                self._malformed(f"a message of kind {kind[:16]!r}")
            return None
        seq = _SEQ.unpack(frames[1])[0] if len(frames) >= 2 and len(frames[1]) == _SEQ.size else None
        if seq is None or (kind == b"EV" and len(frames) < 3):
            self._malformed(f"{kind.decode()} of {len(frames)} frames")
            return None
        id_at = 2 if kind == b"SYNC" else 3
        publisher = frames[id_at] if len(frames) > id_at else None
        if publisher is not None and len(publisher) != PUBLISHER_ID_BYTES:
            self._malformed(f"{kind.decode()} with a publisher id of {len(publisher)} bytes")
            return None
        self.status, self.heard = kind, time.monotonic()
        # every renewal is answered with the next number, so a restart or a hole shows at the latest then
        self._follow(seq, publisher)
        if kind == b"SYNC":
            return None
        self.next_seq = seq + 1
        try:
            events = msgpack.unpackb(frames[2], raw=False)[1]
            if not isinstance(events, list):
                raise TypeError(f"events of type {type(events).__name__}")
        except Exception as exc:   # noqa: BLE001 - malformed input from the network: its events are lost
            self._malformed(f"EV {seq} unreadable: {exc!r}")
            return None
        return seq, events

    def _malformed(self, what: str) -> None:
        """A message that cannot be read: what it said is lost, counted as a gap."""
        self.malformed += 1
        self.gaps += 1
        log.log(logging.WARNING if self.malformed == 1 else logging.DEBUG,
                "events from %s: %s, counted as lost (%d so far)", self.endpoint, what, self.malformed)

    def _follow(self, seq: int, publisher: bytes | None) -> None:
        """Take ``seq`` (an ``EV``'s own number, a ``SYNC``'s next one) from ``publisher`` as the next
        number: a restart if another publisher sent it or the number went back (then the numbers
        before it are the new server's, not lost ones of the old), else a gap if it skipped ahead."""
        first = self.next_seq is None
        # the first message follows on from the number the replay was asked from, if any
        expected = self._since if first else self.next_seq
        if first and publisher is None:
            log.info("events from %s carry no publisher id (a kvtier server from before it): a restart "
                     "is told only by numbers that go back", self.endpoint)
        if expected is not None:   # else the first message of a stream joined live: nothing to follow on from
            if (not first and publisher != self.publisher_id) or seq < expected:
                self.restarts += 1
            elif seq > expected:
                self.gaps += seq - expected
        self.publisher_id, self.next_seq = publisher, seq

    def close(self) -> None:
        self._sock.close()


def replay(endpoint: str, since: int, timeout_s: float = 2.0, **curve) -> list[tuple[int, list]]:
    """One-shot replay: (seq, events) of every buffered message of this subscriber's scope from ``since``."""
    import msgpack

    sub = EventSubscriber(endpoint, since=since, **curve)
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sub._sock.poll(int((deadline - time.monotonic()) * 1000)):
                break
            frames = sub._sock.recv_multipart()
            if frames[0] == b"EV":
                out.append((_SEQ.unpack(frames[1])[0], msgpack.unpackb(frames[2], raw=False)[1]))
            elif frames[0] in (b"SYNC", b"BUSY", b"FULL"):
                if frames[0] != b"SYNC":
                    raise RuntimeError(f"events replay refused: {frames[0].decode()}")
                return out
        raise TimeoutError(f"no replay answer from {endpoint} within {timeout_s} s (not admitted?)")
    finally:
        sub.close()
