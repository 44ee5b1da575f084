"""Prometheus metrics and the ``/metrics`` + ``/healthz`` HTTP endpoint.

Counters the request path updates are plain prometheus-client objects on a
registry of the server's own (no global registry, so tests can run several
servers in one process). Tier and tenant figures are read at scrape time by a
collector, so the hot path pays nothing for them.

Per-tenant series (``kvtier_tenant_*{tenant=…}``) say when a tenant stores
and how much: a side channel between tenants. They live in a registry of their
own that is rendered only to a scrape presenting a metrics token
(``metrics_token_sha256``: read-only, good for nothing else) or the admin token
(``Authorization: Bearer <token>``, hashed and compared in constant time with
every configured digest); other scrapes see aggregates without a tenant label.
The endpoint is plain HTTP, so the admin token (which erases tenants) is taken
only on a loopback address, or where ``insecure_plaintext`` says cleartext is
accepted. ``metrics_require_token`` closes ``/metrics`` altogether to scrapes
without such a token (``/healthz`` stays open). A token presented and refused is
a failed login of the peer's address, as a refused HELLO is: charged to the
server's login limiter, counted in ``kvtier_auth_failures`` and audited a few
lines per burst; an address over its budget is answered 429 before its token is
looked at. The endpoint is bounded: a few connections at once, a few of them per
peer address, a header count and line size, and one deadline for the whole request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.server.admission import Admission, LoginLimiter
from kvtier.server.audit import AuditLog

# Fine around a millisecond: a PUT's server time is judged against 2 ms (``kvtier bench remote --quota-stress``).
_LATENCY_BUCKETS = (2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 2.5e-4, 3.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3,
                    2.5e-3, 3.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
#: families with a tenant label: rendered only to the admin token
TENANT_PREFIX = "kvtier_tenant_"
MAX_METRICS_CONNECTIONS = 16
#: of those, what one peer address may hold: a scraper, ``kvtier top`` and a liveness probe ask one
#: at a time
MAX_METRICS_PER_PEER = 4
MAX_HEADERS = 64
MAX_HEADER_LINE = 8192
REQUEST_DEADLINE_S = 5.0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: per-tenant series: only for the admin token
        self.tenant_registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvtier_requests", "Requests by op", ["op"], registry=r)
        self.latency = Histogram("kvtier_request_seconds", "Request latency by op", ["op"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.hits = Counter("kvtier_hits", "Blocks found (get: sent, lookup: in the matched prefix)", ["op"],
                            registry=r)
        self.misses = Counter("kvtier_misses", "Blocks asked for and not found", ["op"], registry=r)
        self.bytes_in = Counter("kvtier_received_bytes", "Payload bytes received (puts)", registry=r)
        self.bytes_out = Counter("kvtier_sent_bytes", "Payload bytes sent (gets)", registry=r)
        self.verify_failures = Counter("kvtier_verify_failures", "Uploads whose checksum did not match", registry=r)
        self.put_results = Counter("kvtier_put_blocks", "Put outcomes", ["result"], registry=r)
        self.quota_evictions = Counter("kvtier_quota_evictions", "Blocks tenants lost to their own quotas", registry=r)
        self.tenant_quota_evictions = Counter("kvtier_tenant_quota_evictions", "Blocks a tenant lost to its own quota",
                                              ["tenant"], registry=self.tenant_registry)
        self.expirations = Counter("kvtier_expirations", "Blocks removed by TTL retention", registry=r)
        self.erasures = Counter("kvtier_erased_blocks", "Blocks removed by admin erasure", registry=r)
        self.auth_failures = Counter("kvtier_auth_failures", "Refused HELLOs and /metrics tokens", registry=r)
        self.protocol_errors = Counter("kvtier_protocol_errors", "Connections closed for a protocol error", ["code"],
                                       registry=r)
        self.connections = Gauge("kvtier_connections", "Open client connections", registry=r)
        self.refused_connections = Counter(
            "kvtier_refused_connections", "Connections refused or dropped by the admission limits", ["stage"],
            registry=r)

    def count_quota_eviction(self, account: str) -> None:
        self.quota_evictions.inc()
        self.tenant_quota_evictions.labels(account).inc()

    def add_collector(self, collect: Callable[[], list]) -> None:
        """Scrape-time families; those named ``kvtier_tenant_*`` go to the admin-only registry."""

        class _C:
            def __init__(self, per_tenant: bool) -> None:
                self.per_tenant = per_tenant

            def collect(self_inner):  # noqa: N805 - prometheus collector protocol
                return [f for f in collect() if f.name.startswith(TENANT_PREFIX) == self_inner.per_tenant]

        self.registry.register(_C(False))
        self.tenant_registry.register(_C(True))

    def render(self, *, per_tenant: bool = False) -> bytes:
        """The exposition text; per-tenant series only with ``per_tenant`` (an admin scrape)."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.tenant_registry) if per_tenant else text


def tier_and_tenant_families(store, index, governance, event_count: Callable[[], int]) -> list:
    """Scrape-time figures: bytes per tier, tier counters, per-tenant usage, charges and quota."""
    used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held per tier", labels=["tier"])
    cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
    evictions = CounterMetricFamily("kvtier_tier_evictions", "Blocks evicted per tier", labels=["tier"])
    verify = CounterMetricFamily("kvtier_tier_verify_failures", "Reads that failed verification per tier",
                                 labels=["tier"])
    owed = GaugeMetricFamily("kvtier_tier_owed_removals",
                             "Removals a fleet tier owes (it could not be asked, or refused): hidden, retried",
                             labels=["tier"])
    given_up = CounterMetricFamily("kvtier_tier_owed_removals_given_up",
                                   "Owed removals of blocks never placed here, given up past the tier's bound",
                                   labels=["tier"])
    for tier in store.tiers:
        used.add_metric([tier.name], tier.used_bytes)
        cap.add_metric([tier.name], tier.capacity_bytes)
        evictions.add_metric([tier.name], tier.stats.evictions)
        verify.add_metric([tier.name], tier.stats.verify_failures)
        if (owing := _owing_tier(tier)) is not None:
            owed.add_metric([tier.name], owing.owed_removals)
            given_up.add_metric([tier.name], owing.owed_removals_given_up)
    held = GaugeMetricFamily("kvtier_stored_bytes", "Payload bytes held, all tenants together")
    held.add_metric([], index.total_bytes)
    blocks = GaugeMetricFamily("kvtier_stored_blocks", "Blocks held, all tenants together")
    blocks.add_metric([], len(index))
    t_bytes = GaugeMetricFamily("kvtier_tenant_used_bytes", "Payload bytes held per tenant", labels=["tenant"])
    t_blocks = GaugeMetricFamily("kvtier_tenant_blocks", "Blocks held per tenant", labels=["tenant"])
    t_quota = GaugeMetricFamily("kvtier_tenant_quota_bytes", "Quota per tenant", labels=["tenant"])
    t_charged = GaugeMetricFamily("kvtier_tenant_charged_bytes",
                                  "Pool bytes charged per tenant (the footprints its quota is checked against)",
                                  labels=["tenant"])
    usage = index.usage_by_owner()
    quotas = governance.describe()["quota_bytes"]
    for owner, (nbytes, nblocks) in usage.items():
        t_bytes.add_metric([owner], nbytes)
        t_blocks.add_metric([owner], nblocks)
    for owner, quota in quotas.items():
        t_quota.add_metric([owner], quota)
    # (a tenant with a quota and no block of its own may be charged for the shared blocks it wrote)
    for owner in sorted(usage.keys() | quotas.keys()):
        t_charged.add_metric([owner], governance.charged(index, owner))
    events = CounterMetricFamily("kvtier_kv_events", "KV events published")
    events.add_metric([], event_count())
    return [used, cap, evictions, verify, owed, given_up, held, blocks, t_bytes, t_blocks, t_quota, t_charged, events]


def _owing_tier(tier):
    """The tier under ``tier``'s wrappers that owes removals (a Mooncake fleet's), or None."""
    while tier is not None:
        # (asked of the class: a wrapper forwarding attributes would answer for the tier it wraps)
        if isinstance(getattr(type(tier), "owed_removals_given_up", None), property):
            return tier
        tier = getattr(tier, "inner", None)
    return None


def token_matches(token: str | None, digests: Iterable[bytes]) -> bool:
    """Whether ``token``'s SHA-256 is one of ``digests``: compared with every digest (constant time,
    no early exit)."""
    if not token:
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    found = False
    for candidate in digests:
        found |= hmac.compare_digest(candidate, digest)
    return found


class MetricsAuth:
    """Who may see the per-tenant series (and, with ``require_token``, any): a scrape presenting a
    metrics token, or the admin token where ``admin_accepted`` (a loopback listener, or cleartext
    accepted). ``logins`` and ``audit`` are the server's (a failed scrape and a failed HELLO share
    one budget per address); both are used on the event loop only, as the HELLO path uses them."""

    def __init__(self, metrics: ServerMetrics, *, metrics_token_sha256: Iterable[str] = (),
                 admin_token_sha256: Iterable[str] = (), admin_accepted: bool = True,
                 logins: LoginLimiter | None = None, audit: AuditLog | None = None) -> None:
        self.metrics = metrics
        self.scrape_digests = [bytes.fromhex(h) for h in metrics_token_sha256]
        self.admin_digests = [bytes.fromhex(h) for h in admin_token_sha256]
        self.admin_accepted = admin_accepted
        self.logins = LoginLimiter() if logins is None else logins
        self.audit = AuditLog(None) if audit is None else audit

    def judge(self, token: str | None, peer: str) -> str:
        """``"tenant"`` (per-tenant series), ``"open"`` (no token: aggregates), ``"refused"`` (a token
        that unlocks nothing here: a failed login, charged and counted) or ``"throttled"`` (the
        address is over its failed-login budget: the token not even compared)."""
        if not token:
            return "open"
        if not self.logins.allowed(peer):
            self.metrics.auth_failures.inc()
            return "throttled"
        # both lists compared whatever the first gave: no early exit
        scrape, admin = token_matches(token, self.scrape_digests), token_matches(token, self.admin_digests)
        if scrape or (admin and self.admin_accepted):
            return "tenant"
        self.metrics.auth_failures.inc()
        if self.logins.failed(peer):   # a burst writes a few audit lines, not one per try
            reason = ("metrics: the admin token is not taken on a plain-HTTP listener beyond loopback; "
                      "scrape with a metrics token (metrics_token_sha256)") if admin else "metrics: wrong token"
            self.audit.write("auth_failure", peer=peer, reason=reason)
        return "refused"


def _bearer(headers: list[bytes]) -> str | None:
    for line in headers:
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


async def serve_http(
    host: str, port: int, metrics: ServerMetrics, healthy: Callable[[], bool], *,
    auth: MetricsAuth | None = None, require_token: bool = False,
    max_connections: int = MAX_METRICS_CONNECTIONS, max_per_peer: int = MAX_METRICS_PER_PEER,
    deadline_s: float = REQUEST_DEADLINE_S,
) -> asyncio.AbstractServer:
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` and ``GET /healthz``.

    At most ``max_connections`` at once and ``max_per_peer`` of them per peer address, at most
    :data:`MAX_HEADERS` header lines of :data:`MAX_HEADER_LINE` bytes, and ``deadline_s`` for the
    whole request, reply included: a slow or silent client holds a slot for seconds, never
    longer. A newcomer is never refused: past its address's share, that address's oldest
    connection is dropped, past the whole cap the oldest of all. With one cap and no share, a
    single client that kept 16 silent sockets open had every other client's scrape and
    ``/healthz`` aborted at once: a liveness probe failed and an orchestrator restarted a healthy
    server. ``auth``: who sees the per-tenant series (default: nobody)."""
    auth = MetricsAuth(metrics) if auth is None else auth
    # The rule of the server's own pre-login connections (kvtier.server.admission): a flood from
    # one address pushes out only its own sockets. Nobody logs in here: the other limits are unused.
    slots = Admission(max_connections=0, max_unauthenticated=max_connections, max_per_peer=max_per_peer,
                      max_per_tenant=0, hello_timeout_s=deadline_s)

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        line = await reader.readline()
        headers: list[bytes] = []
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            headers.append(h)
            if len(headers) > MAX_HEADERS:
                raise ValueError("too many headers")
        parts = line.decode("latin-1").split()
        path = parts[1] if len(parts) >= 2 else ""
        extra = ""
        if parts[:1] != ["GET"]:
            status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
        elif path.startswith("/metrics"):
            verdict = auth.judge(_bearer(headers), peer)
            if verdict == "throttled":
                status, ctype, extra = "429 Too Many Requests", "text/plain", "Retry-After: 1\r\n"
                body = b"too many failed logins from this address; retry later\n"
            elif require_token and verdict != "tenant":
                status, ctype, extra = "401 Unauthorized", "text/plain", 'WWW-Authenticate: Bearer realm="kvtier"\r\n'
                body = b"metrics need the metrics token (or the admin token, on a loopback address)\n"
            else:
                status, body = "200 OK", metrics.render(per_tenant=verdict == "tenant")
                ctype = "text/plain; version=0.0.4; charset=utf-8"
        elif path.startswith("/healthz"):
            ok = healthy()
            status = "200 OK" if ok else "503 Service Unavailable"
            body, ctype = (b"ok\n" if ok else b"unhealthy\n"), "text/plain"
        else:
            status, body, ctype = "404 Not Found", b"try /metrics or /healthz\n", "text/plain"
        writer.write(
            f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n".encode() + body
        )
        await writer.drain()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer = peer[0] if isinstance(peer, tuple) else None
        evict = slots.connect(writer, peer).evict
        if evict is not None:   # (its own handler then ends on the lost connection, and forgets it)
            metrics.refused_connections.labels("metrics").inc()
            evict.transport.abort()
        try:
            await asyncio.wait_for(respond(reader, writer, peer or "?"), deadline_s)
        except (asyncio.TimeoutError, ConnectionError, UnicodeError, ValueError, asyncio.LimitOverrunError,
                asyncio.IncompleteReadError):
            writer.transport.abort()  # nothing more for it, and nothing buffered kept
        finally:
            slots.forget(writer)
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_HEADER_LINE)
