"""Prometheus metrics and the ``/metrics`` + ``/healthz`` HTTP endpoint.

Counters the request path updates are plain prometheus-client objects on a
registry of the server's own (no global registry, so tests can run several
servers in one process). Tier and tenant figures are read at scrape time by a
collector, so the hot path pays nothing for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        self.quota_evictions = Counter("kvtier_quota_evictions", "Blocks a tenant lost to its own quota", ["tenant"],
                                       registry=r)
        self.expirations = Counter("kvtier_expirations", "Blocks removed by TTL retention", registry=r)
        self.erasures = Counter("kvtier_erased_blocks", "Blocks removed by admin erasure", registry=r)
        self.auth_failures = Counter("kvtier_auth_failures", "Refused HELLOs", registry=r)
        self.protocol_errors = Counter("kvtier_protocol_errors", "Connections closed for a protocol error", ["code"],
                                       registry=r)
        self.connections = Gauge("kvtier_connections", "Open client connections", registry=r)
        self.refused_connections = Counter(
            "kvtier_refused_connections", "Connections refused or dropped by the admission limits", ["stage"],
            registry=r)

    def add_collector(self, collect: Callable[[], list]) -> None:
        class _C:
            def collect(self_inner):  # noqa: N805 - prometheus collector protocol
                return collect()

        self.registry.register(_C())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def tier_and_tenant_families(store, index, governance, event_count: Callable[[], int]) -> list:
    """Scrape-time figures: bytes per tier, tier counters, per-tenant usage and quota."""
    used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held per tier", labels=["tier"])
    cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
    evictions = CounterMetricFamily("kvtier_tier_evictions", "Blocks evicted per tier", labels=["tier"])
    verify = CounterMetricFamily("kvtier_tier_verify_failures", "Reads that failed verification per tier",
                                 labels=["tier"])
    for tier in store.tiers:
        used.add_metric([tier.name], tier.used_bytes)
        cap.add_metric([tier.name], tier.capacity_bytes)
        evictions.add_metric([tier.name], tier.stats.evictions)
        verify.add_metric([tier.name], tier.stats.verify_failures)
    t_bytes = GaugeMetricFamily("kvtier_tenant_used_bytes", "Payload bytes held per tenant", labels=["tenant"])
    t_blocks = GaugeMetricFamily("kvtier_tenant_blocks", "Blocks held per tenant", labels=["tenant"])
    t_quota = GaugeMetricFamily("kvtier_tenant_quota_bytes", "Quota per tenant", labels=["tenant"])
    for owner, (nbytes, nblocks) in index.usage_by_owner().items():
        t_bytes.add_metric([owner], nbytes)
        t_blocks.add_metric([owner], nblocks)
    for owner, quota in governance.describe()["quota_bytes"].items():
        t_quota.add_metric([owner], quota)
    events = CounterMetricFamily("kvtier_kv_events", "KV events published")
    events.add_metric([], event_count())
    return [used, cap, evictions, verify, t_bytes, t_blocks, t_quota, events]


async def serve_http(
    host: str, port: int, metrics: ServerMetrics, healthy: Callable[[], bool]
) -> asyncio.AbstractServer:
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` and ``GET /healthz`` (loopback use)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while True:  # skip headers
                h = await asyncio.wait_for(reader.readline(), 5)
                if h in (b"\r\n", b"\n", b""):
                    break
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            if parts[:1] != ["GET"]:
                status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path.startswith("/metrics"):
                status, body, ctype = "200 OK", metrics.render(), "text/plain; version=0.0.4; charset=utf-8"
            elif path.startswith("/healthz"):
                ok = healthy()
                status = "200 OK" if ok else "503 Service Unavailable"
                body, ctype = (b"ok\n" if ok else b"unhealthy\n"), "text/plain"
            else:
                status, body, ctype = "404 Not Found", b"try /metrics or /healthz\n", "text/plain"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=16384)
