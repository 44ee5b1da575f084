"""Who may hold a connection slot: limits before and after login.

The server's connection slots were one pool shared by sockets that had not
said HELLO and by every tenant, so eight silent sockets locked everyone out.
Now:

* **Before login** a connection (a TLS handshake included: TLS starts only
  after admission) is *unauthenticated*: at most ``max_per_peer`` of them per
  peer address, at most ``max_unauthenticated`` in all, and each must
  authenticate within ``hello_timeout_s``. A full pool is never a refusal: the
  oldest pre-login connection of the same address (or, with the whole pool
  full, the oldest of all) is dropped to make room. A client that logs in at
  once gets in; a flood from one address only pushes out its own sockets.
* **After login** a connection moves to the authenticated pool of
  ``max_connections``, of which one tenant may hold at most
  ``max_per_tenant``.
* **Failed logins** are limited per peer address (a token bucket); a peer over
  its budget is refused before its token is even checked, and only the first
  refusals of a burst are audited (the rest are counted).

Decisions only: the caller closes what this module names.
"""

from __future__ import annotations

import collections
import time
from typing import Hashable, NamedTuple


class Admit(NamedTuple):
    ok: bool
    #: an older pre-login connection to close so that this one fits (or None)
    evict: Hashable | None = None
    reason: str = ""


class Admission:
    def __init__(self, *, max_connections: int, max_unauthenticated: int, max_per_peer: int,
                 max_per_tenant: int, hello_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_per_peer = max_per_peer
        self.max_per_tenant = max_per_tenant
        self.hello_timeout_s = hello_timeout_s
        #: pre-login connections, oldest first → (peer, since)
        self._pending: collections.OrderedDict[Hashable, tuple[str, float]] = collections.OrderedDict()
        self._pending_by_peer: collections.Counter[str] = collections.Counter()
        self._tenant_of: dict[Hashable, str] = {}
        self._by_tenant: collections.Counter[str] = collections.Counter()

    @property
    def unauthenticated(self) -> int:
        return len(self._pending)

    @property
    def authenticated(self) -> int:
        return len(self._tenant_of)

    def connect(self, conn: Hashable, peer: str | None, now: float | None = None) -> Admit:
        """A new socket (before any byte of TLS or HELLO); ``peer`` None: not counted per
        address (Unix sockets: every local process shares one "address", and the socket
        file's permissions already decide who may connect)."""
        evict = None
        if peer is not None and self._pending_by_peer[peer] >= self.max_per_peer:
            # That address's own oldest silent socket makes room: a flood churns itself.
            evict = next(c for c, (p, _) in self._pending.items() if p == peer)
        elif len(self._pending) >= self.max_unauthenticated:
            evict = next(iter(self._pending))
        if evict is not None:
            self.forget(evict)
        self._pending[conn] = (peer, time.monotonic() if now is None else now)
        if peer is not None:
            self._pending_by_peer[peer] += 1
        return Admit(True, evict)

    def login(self, conn: Hashable, tenant: str) -> Admit:
        """HELLO succeeded: move ``conn`` to the authenticated pool, if there is room."""
        if conn not in self._pending:
            return Admit(False, reason="connection is not waiting to log in")
        if len(self._tenant_of) >= self.max_connections:
            return Admit(False, reason="too many connections; retry later")
        if self._by_tenant[tenant] >= self.max_per_tenant:
            return Admit(False, reason="too many connections for this tenant; retry later")
        self._drop_pending(conn)
        self._tenant_of[conn] = tenant
        self._by_tenant[tenant] += 1
        return Admit(True)

    def forget(self, conn: Hashable) -> None:
        if conn in self._pending:
            self._drop_pending(conn)
        tenant = self._tenant_of.pop(conn, None)
        if tenant is not None:
            self._by_tenant[tenant] -= 1
            if not self._by_tenant[tenant]:
                del self._by_tenant[tenant]

    def overdue(self, now: float | None = None) -> list[Hashable]:
        """Pre-login connections past ``hello_timeout_s`` (oldest first)."""
        now = time.monotonic() if now is None else now
        out = []
        for conn, (_, since) in self._pending.items():
            if now - since <= self.hello_timeout_s:
                break  # ordered by age
            out.append(conn)
        return out

    def _drop_pending(self, conn: Hashable) -> None:
        peer, _ = self._pending.pop(conn)
        if peer is None:
            return
        self._pending_by_peer[peer] -= 1
        if not self._pending_by_peer[peer]:
            del self._pending_by_peer[peer]


class LoginLimiter:
    """Failed logins per peer address: a token bucket of ``burst`` refilled at ``per_s``.

    Bounded memory: at most ``max_peers`` addresses are tracked (the least recent go).
    """

    def __init__(self, *, burst: int = 10, per_s: float = 1.0, max_peers: int = 10_000,
                 audit_per_burst: int = 3) -> None:
        self.burst = burst
        self.per_s = per_s
        self.max_peers = max_peers
        self.audit_per_burst = audit_per_burst
        #: peer → [tokens, last refill, audited failures since the bucket was last full]
        self._peers: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.suppressed_audits = 0

    def _bucket(self, peer: str, now: float) -> list:
        b = self._peers.get(peer)
        if b is None:
            b = self._peers[peer] = [float(self.burst), now, 0]
            if len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.per_s)
            b[1] = now
            if b[0] >= self.burst:
                b[2] = 0
        return b

    def allowed(self, peer: str, now: float | None = None) -> bool:
        """May this peer try to log in now?"""
        return self._bucket(peer, time.monotonic() if now is None else now)[0] >= 1.0

    def failed(self, peer: str, now: float | None = None) -> bool:
        """Charge one failure; returns whether it should be audited (bounded per burst)."""
        b = self._bucket(peer, time.monotonic() if now is None else now)
        b[0] = max(0.0, b[0] - 1.0)
        b[2] += 1
        if b[2] <= self.audit_per_burst:
            return True
        self.suppressed_audits += 1
        return False
