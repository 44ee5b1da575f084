"""Prometheus /metrics and /healthz (per-tenant series only for the admin token); KV events over ZMQ
with sequence numbers and replay."""

from __future__ import annotations

import time
import urllib.request

import numpy as np

from kvtier.server.events import EventSubscriber, event_block_name, replay
from kvtier.tiers.base import Status
from tests.server.conftest import BLOCK, EVENTS_KEYS, block, keys_for, remote
from tests.server.harness import TOKENS


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_and_healthz(server):
    base = f"http://{server.info['metrics']}"
    assert _get(base + "/healthz") == (200, "ok\n")
    tier = remote(server, "globex", namespace="metrics")
    keys = keys_for("metrics", 4)
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 4
    assert tier.lookup_prefix(keys + keys_for("absent", 1)) == 4
    out = np.zeros(BLOCK, np.uint8)
    assert tier.get(keys[0], out) is Status.OK
    assert tier.get(keys_for("absent", 1)[0], out) is Status.MISS
    status, text = _get(base + "/metrics", TOKENS["admin"])
    assert status == 200
    assert _metric(text, "kvtier_hits_total", op="get") >= 1
    assert _metric(text, "kvtier_misses_total", op="get") >= 1
    assert _metric(text, "kvtier_hits_total", op="lookup") >= 4
    assert _metric(text, "kvtier_received_bytes_total") >= 4 * BLOCK
    assert _metric(text, "kvtier_tier_used_bytes", tier="host") > 0
    assert _metric(text, "kvtier_tenant_used_bytes", tenant="globex") >= 4 * BLOCK
    assert _metric(text, "kvtier_request_seconds_count", op="put") >= 4
    for name in ("kvtier_tier_evictions_total", "kvtier_verify_failures_total", "kvtier_tier_capacity_bytes",
                 "kvtier_connections", "kvtier_auth_failures_total"):
        assert name in text, name
    assert _get(base + "/nope")[0] == 404


def test_per_tenant_series_only_for_the_admin_token(server):
    """A tenant watching /metrics must not see when another tenant stores (a side channel): without
    the admin token no series has a tenant label, only totals; with it, the tenant's series is there
    and moves when that tenant stores (positive control)."""
    base = f"http://{server.info['metrics']}"
    globex = remote(server, "globex", namespace="metrics-tenant")
    keys = keys_for("metrics-tenant", 3)
    assert globex.put_many(keys[:1], [block(keys[0])]) == [Status.OK]
    before = _get(base + "/metrics", TOKENS["admin"])[1]
    assert globex.put_many(keys[1:], [block(k) for k in keys[1:]]) == [Status.OK] * 2
    after = _get(base + "/metrics", TOKENS["admin"])[1]
    assert _metric(after, "kvtier_tenant_blocks", tenant="globex") == _metric(before, "kvtier_tenant_blocks",
                                                                               tenant="globex") + 2
    for token in (None, TOKENS["globex"], "not-a-token"):  # no token, a tenant's token, garbage
        status, text = _get(base + "/metrics", token)
        assert status == 200
        assert "tenant=" not in text and "kvtier_tenant_" not in text, f"per-tenant series leak to {token!r}"
        assert _metric(text, "kvtier_stored_blocks") >= 3  # the aggregate is there
        assert "kvtier_request_seconds_count" in text


def test_kv_events_have_sequence_numbers_and_replay(server):
    sub = EventSubscriber(server.info["events"], **EVENTS_KEYS.creds("router"))
    time.sleep(0.3)  # let the registration reach the publisher
    tier = remote(server, "acme", namespace="events")
    keys = keys_for("events", 3)
    names = {event_block_name(EVENTS_KEYS.name_key, "acme", "events", k): k for k in keys}
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
    assert tier.delete(keys[1])
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = sub.recv(timeout_s=0.5)
        if got is None:
            continue
        seen.extend((got[0], e) for e in got[1])
        mine = [e for _, e in seen if e["namespace"] == "events"]
        stored = {bytes(n) for e in mine if e["type"] == "stored" for n in e["blocks"]}
        removed = {bytes(n) for e in mine if e["type"] == "removed" for n in e["blocks"]}
        if stored >= set(names) and event_block_name(EVENTS_KEYS.name_key, "acme", "events", keys[1]) in removed:
            break
    assert stored >= set(names) and {names[n] for n in removed} == {keys[1]}
    assert all(e["tier"] == "host" and e["owner"] == "acme" for _, e in seen if e["namespace"] == "events")
    seqs = sorted({s for s, _ in seen})
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers have gaps"
    assert sub.gaps == 0

    # A subscriber that missed everything asks for a replay from the first sequence number.
    replayed = replay(server.info["events"], since=seqs[0], **EVENTS_KEYS.creds("router"))
    assert [s for s, _ in replayed][: len(seqs)] == seqs
    got = {bytes(n) for _, events in replayed for e in events if e["type"] == "stored" for n in e["blocks"]}
    assert got >= set(names)
    sub.close()
