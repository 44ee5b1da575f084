"""The operator's view of a quota shows what the quota is charged: pool footprints, not payload.

A 64 B block takes a 4 KiB page of the pool and is charged that. ``kvtier admin usage`` posted only
payload ``bytes`` beside the ``quota``: a tenant at its quota, losing one of its own blocks at every
put, read as 1.6 % full (s32 a7 D8). Each usage row now carries ``charged_bytes`` (the tenant's own
STATS figure), and ``/metrics`` a ``kvtier_tenant_charged_bytes`` series, per-tenant like the others
(only to a scrape with a token). A real ``kvtier serve``, clients over TCP.
"""

from __future__ import annotations

import urllib.request

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

PAGE = 4096
QUOTA = 10 * PAGE
TINY = 64


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess.start(tenants(acme={"quota": QUOTA}), shared=SHARED, admin_token=TOKENS["admin"],
                            workdir=str(tmp_path_factory.mktemp("kvtier-charged")),
                            server={"capacity": "8MiB", "max_block": "256KiB", "metrics": "127.0.0.1:0"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def acme_at_its_quota(srv) -> dict:
    """acme after 30 puts of 64 B under a quota of 10 pages: its own STATS."""
    acme = remote(srv, "acme", namespace="tiny")
    try:
        keys = keys_for("tiny", 30)
        assert [acme.put(k, block(k, TINY)) for k in keys] == [Status.OK] * 30
        return acme.server_stats()
    finally:
        acme.close()


def _scrape(srv, token: str | None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://{srv.info['metrics']}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def test_usage_shows_beside_the_quota_what_it_is_charged(srv, acme_at_its_quota):
    row = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]["acme"]
    assert acme_at_its_quota["charged_bytes"] == QUOTA, "control: acme is at its quota"
    assert (row["bytes"], row["blocks"], row["quota"]) == (10 * TINY, 10, QUOTA), row
    assert row.get("charged_bytes") == QUOTA, f"usage shows a tenant at its quota as {row['bytes'] / QUOTA:.1%} full"


def test_usage_charges_a_publisher_for_what_it_wrote_into_a_shared_namespace(srv):
    ops = remote(srv, "ops", namespace="shared/system-prompts")
    try:
        keys = keys_for("published", 2)
        assert ops.put_many(keys, [block(k, TINY) for k in keys]) == [Status.OK] * 2
    finally:
        ops.close()
    usage = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]
    assert usage["shared/system-prompts"]["charged_bytes"] == 2 * PAGE
    assert usage["ops"]["blocks"] == 0 and usage["ops"]["charged_bytes"] == 2 * PAGE, usage["ops"]
    assert usage["globex"]["charged_bytes"] == 0


def test_the_charged_series_is_per_tenant_shown_only_to_a_scrape_with_a_token(srv, acme_at_its_quota):
    from prometheus_client.parser import text_string_to_metric_families

    with_token = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for f in text_string_to_metric_families(_scrape(srv, TOKENS["admin"])) for s in f.samples}
    assert with_token[("kvtier_tenant_charged_bytes", (("tenant", "acme"),))] == QUOTA
    assert with_token[("kvtier_tenant_quota_bytes", (("tenant", "acme"),))] == QUOTA
    assert "kvtier_tenant_charged_bytes" not in _scrape(srv, None), "a tenant's charges shown without a token"
