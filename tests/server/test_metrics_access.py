"""Who may read ``/metrics``' per-tenant series, and at what price a wrong guess.

Before, the per-tenant series (and, with ``metrics_require_token``, every series) were unlocked by
the admin token -- the one that erases tenants and shreds their keys -- over plain HTTP on any
address (``metrics = "0.0.0.0:9400"`` was taken without a word, where a cleartext data listener
is refused), and a wrong token cost nothing: no throttle, no audit line, no count. Now a scrape
presents a read-only metrics token (``metrics_token_sha256``); the admin token is taken only on a
loopback metrics address (or with ``insecure_plaintext``); and a token refused is a failed login
of its address, sharing the HELLO limiter, counted and audited. Real ``kvtier serve`` processes.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from kvtier.errors import ConfigError
from kvtier.server.auth import hash_token
from kvtier.server.config import load_config
from kvtier.server.launch import ServerProcess
from tests.server.conftest import closed_by_peer, connect, hello_frame, read_frame
from tests.server.harness import SHARED, TOKENS, tenants

METRICS_TOKEN = "metrics-token-1"


def _scrape(addr: str, token: str | None, source: str | None = None) -> tuple[int, str]:
    """(status, body) of ``GET /metrics`` at ``addr`` (HOST:PORT), from ``source`` if given."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _config(tmp_path, server: str, admin: bool = True):
    path = tmp_path / "kvtier.toml"
    path.write_text(
        f'[server]\nlisten = ["tcp://127.0.0.1:7070"]\n{server}\n'
        + (f'[admin]\ntoken_sha256 = ["{hash_token(TOKENS["admin"])}"]\n' if admin else "")
        + f'[[tenant]]\nname = "acme"\ntoken_sha256 = ["{hash_token("acme")}"]\n')
    return path


def _non_loopback_ipv4() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))   # no packet is sent: only the route is looked up
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


# -- configuration ----------------------------------------------------------------------------
def test_a_cleartext_metrics_listener_beyond_loopback_that_only_the_admin_token_opens_is_refused(tmp_path):
    path = _config(tmp_path, 'metrics = "0.0.0.0:9400"\nmetrics_require_token = true')
    with pytest.raises(ConfigError, match="metrics_token_sha256.*127.0.0.1.*insecure_plaintext"):
        load_config(path, env={})
    # Accepted: cleartext asked for explicitly (as for the data listeners), ...
    assert load_config(path, env={}, overrides={"insecure_plaintext": True}).metrics_takes_admin_token
    # ... a read-only metrics token to scrape with (the admin token then not taken there), ...
    c = load_config(path, env={"KVTIER_SERVE_METRICS_TOKEN_SHA256": hash_token(METRICS_TOKEN)})
    assert c.metrics_token_sha256 == (hash_token(METRICS_TOKEN),) and not c.metrics_takes_admin_token
    # ... or loopback, where the admin token stays good.
    for address in ("127.0.0.1:9400", "localhost:9400", "[::1]:9400"):
        assert load_config(_config(tmp_path, f'metrics = "{address}"\nmetrics_require_token = true'),
                           env={}).metrics_takes_admin_token, address


def test_metrics_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="metrics_require_token needs a token"):
        load_config(_config(tmp_path, 'metrics = "127.0.0.1:0"\nmetrics_require_token = true', admin=False), env={})
    with pytest.raises(ConfigError, match="listed twice"):   # the metrics token is no tenant's token
        load_config(_config(tmp_path, f'metrics_token_sha256 = ["{hash_token("acme")}"]'), env={})
    with pytest.raises(ConfigError, match="not a SHA-256"):
        load_config(_config(tmp_path, f'metrics_token_sha256 = ["{METRICS_TOKEN}"]'), env={})
    with pytest.raises(ConfigError, match="metrics '9400': expected HOST:PORT"):
        load_config(_config(tmp_path, 'metrics = "9400"'), env={})


# -- a real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Metrics on 0.0.0.0 (plain HTTP reachable from the network), closed to scrapes without a token."""
    wd = tmp_path_factory.mktemp("kvtier-metrics-wide")
    srv = ServerProcess.start(
        tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(wd),
        server={"capacity": "16MiB", "max_block": "1MiB", "metrics": "0.0.0.0:0", "metrics_require_token": True,
                "metrics_token_sha256": [hash_token(METRICS_TOKEN)], "audit_log": str(wd / "audit.jsonl")})
    yield srv
    srv.stop()


def test_beyond_loopback_the_metrics_token_opens_metrics_and_the_admin_token_does_not(wide):
    port = wide.info["metrics"].rsplit(":", 1)[1]
    ip = _non_loopback_ipv4()
    for host in ([ip] if ip else []) + ["127.0.0.1"]:   # the listener decides, not the peer
        status, text = _scrape(f"{host}:{port}", METRICS_TOKEN)
        assert status == 200 and "kvtier_tenant_quota_bytes" in text and "kvtier_stored_blocks" in text, host
        assert _scrape(f"{host}:{port}", TOKENS["admin"])[0] == 401, f"the admin token was taken from {host}"
        assert _scrape(f"{host}:{port}", None)[0] == 401
    audit = [json.loads(x) for x in (open(f"{wide.workdir}/audit.jsonl").read().splitlines())]
    assert any("admin token is not taken" in r.get("reason", "") for r in audit), audit


def test_the_metrics_token_is_no_login(wide):
    """Read-only: the metrics token opens no connection to the data port (nor an ADMIN op)."""
    s = connect(wide.tcp_url)
    s.sendall(hello_frame(METRICS_TOKEN))
    h, meta, _ = read_frame(s)
    assert h.code != 0, meta
    assert closed_by_peer(s)
    s.close()


def test_a_wide_metrics_address_that_the_admin_token_would_open_is_warned_about(tmp_path):
    """Without ``metrics_require_token`` the aggregates stay open, so the server starts; it says
    that its per-tenant series are shown to no one (the admin token is not taken there)."""
    with ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                             server={"capacity": "16MiB", "max_block": "1MiB", "metrics": "0.0.0.0:0"}) as srv:
        port = srv.info["metrics"].rsplit(":", 1)[1]
        status, text = _scrape(f"127.0.0.1:{port}", TOKENS["admin"])
        assert status == 200 and "kvtier_stored_blocks" in text and "kvtier_tenant_" not in text
        assert "the admin token is not taken there" in srv.log()


def test_on_loopback_both_tokens_open_metrics(tmp_path):
    with ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "metrics": "127.0.0.1:0", "metrics_require_token": True,
        "metrics_token_sha256": [hash_token(METRICS_TOKEN)],
    }) as srv:
        for token in (METRICS_TOKEN, TOKENS["admin"]):
            status, text = _scrape(srv.info["metrics"], token)
            assert status == 200 and "kvtier_tenant_quota_bytes" in text, token
        assert "not taken there" not in srv.log()


# -- guessing -----------------------------------------------------------------------------------
def test_wrong_tokens_on_metrics_are_throttled_counted_and_audited(tmp_path):
    audit = tmp_path / "audit.jsonl"
    with ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "metrics": "127.0.0.1:0", "metrics_require_token": True,
        "audit_log": str(audit), "login_failure_burst": 5, "login_failure_rate_per_s": 0.5,
    }) as srv:
        addr = srv.info["metrics"]
        t0 = time.monotonic()
        codes = [_scrape(addr, f"guess-{i}")[0] for i in range(200)]
        refilled = (time.monotonic() - t0) * 0.5   # tries the bucket gave back meanwhile (1 in 2 s)
        assert codes[:5] == [401] * 5 and set(codes) == {401, 429} and codes.count(401) <= 5 + refilled + 1, codes
        # throttled: the right token from the same address is not even compared ...
        assert _scrape(addr, TOKENS["admin"])[0] == 429
        # ... nor a HELLO (one budget per address, the data port's too)
        s = connect(srv.tcp_url)
        s.sendall(hello_frame(TOKENS["acme"]))
        h, meta, _ = read_frame(s)
        assert h.code != 0 and b"too many failed logins" in meta, meta
        s.close()
        # another address is not held back, and sees every failure counted
        status, text = _scrape(addr, TOKENS["admin"], source="127.0.0.2")
        assert status == 200
        failures = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                       if ln.startswith("kvtier_auth_failures_total"))
        assert failures >= 201, failures
        time.sleep(2.2)   # the bucket refills: the right token is served again
        assert _scrape(addr, TOKENS["admin"])[0] == 200
    lines = [json.loads(x) for x in audit.read_text().splitlines() if x.strip()]
    failed = [r for r in lines if r["event"] == "auth_failure" and r.get("reason") == "metrics: wrong token"]
    assert 1 <= len(failed) <= 3 and all(r["peer"] == "127.0.0.1" for r in failed), lines   # a few per burst
    assert not any("guess" in x for x in audit.read_text().splitlines()), "a token in the audit log"
