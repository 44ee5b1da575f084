"""Limits before login: silent sockets and stalled TLS handshakes cannot lock tenants out.

Each lock-out test has its control: the flood is shown to be holding sockets
open at the moment the legitimate client is served.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import time

import numpy as np
import pytest

from kvtier.server.admission import Admission, LoginLimiter
from kvtier.server.config import ServerConfig
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import ErrorCode, Op, unpack_header
from tests.server.conftest import block, hello_frame, keys_for
from tests.server.harness import SHARED, TOKENS, tenants
from tests.server.test_tls import _self_signed

ATTACKER = "127.0.0.2"  # loopback range: another address on this machine


def _open_from(source: str, url: str) -> socket.socket:
    host, port = url.split("://", 1)[1].split("?")[0].rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((host, int(port)))
    return s


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    except OSError:
        return False
    finally:
        s.setblocking(True)


def test_silent_sockets_and_stalled_tls_handshakes_do_not_lock_out_a_client(tmp_path):
    cert, key = _self_signed(tmp_path)
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), tcp=False, server={
        "listen": ["tls://127.0.0.1:0"], "tls_cert": cert, "tls_key": key, "capacity": "16MiB",
        "max_block": "1MiB", "max_connections": 8,
    }) as srv:
        url = f"{srv.url}?ca={cert}"
        silent = [_open_from(ATTACKER, srv.url) for _ in range(50)]
        stalled = []
        for _ in range(50):  # the first bytes of a ClientHello, then nothing
            s = _open_from(ATTACKER, srv.url)
            s.sendall(b"\x16\x03\x01\x02\x00\x01")
            stalled.append(s)
        time.sleep(0.3)
        open_before = sum(_still_open(s) for s in silent + stalled)
        assert open_before >= 16, "control: the flood must be holding sockets when the client arrives"
        tier = RemoteTier(url, TOKENS["acme"], namespace="admission", timeout_s=5)  # from another address
        keys = keys_for("admission", 2)
        t0 = time.monotonic()
        assert tier.put_many(keys, [block(k, 4096) for k in keys]) == [Status.OK] * 2, tier.last_error
        out = np.zeros(4096, np.uint8)
        assert tier.get(keys[0], out) is Status.OK and np.array_equal(out, block(keys[0], 4096))
        assert time.monotonic() - t0 < 1.0, f"served after {time.monotonic() - t0:.2f} s behind the flood"
        tier.close()
        # From the flood's own address too: its oldest silent socket gives way.
        t0 = time.monotonic()
        ctx = ssl.create_default_context(cafile=cert)
        with ctx.wrap_socket(_open_from(ATTACKER, srv.url), server_hostname="127.0.0.1") as s:
            s.sendall(hello_frame(TOKENS["acme"], "admission"))
            assert unpack_header(s.recv(22)).code == 0
        assert time.monotonic() - t0 < 1.0
        for s in silent + stalled:
            s.close()


def test_a_silent_socket_is_cut_at_the_hello_deadline(tmp_path):
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "hello_timeout_s": 0.5, "idle_timeout_s": 300,
    }) as srv:
        silent = _open_from("127.0.0.1", srv.tcp_url)
        authed = _open_from("127.0.0.1", srv.tcp_url)  # control: logged in, idle, kept
        authed.sendall(hello_frame(TOKENS["acme"], "deadline"))
        t0 = time.monotonic()
        data = b""
        while chunk := silent.recv(4096):
            data += chunk
        assert 0.4 < time.monotonic() - t0 < 3.0
        assert unpack_header(data[:22]).op == Op.ERROR and unpack_header(data[:22]).code == ErrorCode.TIMEOUT
        assert _still_open(authed)
        silent.close()
        authed.close()


def test_one_tenant_cannot_take_every_connection(tmp_path):
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "max_connections": 8, "max_connections_per_tenant": 3,
    }) as srv:
        held = []
        for _ in range(3):
            s = _open_from("127.0.0.1", srv.tcp_url)
            s.sendall(hello_frame(TOKENS["globex"], "hog"))
            assert unpack_header(s.recv(22)).code == 0
            held.append(s)
        fourth = _open_from("127.0.0.1", srv.tcp_url)
        fourth.sendall(hello_frame(TOKENS["globex"], "hog"))
        h = unpack_header(fourth.recv(22))
        assert h.op == Op.ERROR and h.code == ErrorCode.TOO_MANY_CONNECTIONS
        other = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="fair", timeout_s=2)  # control: still served
        k = keys_for("fair", 1)
        assert other.put_many(k, [block(k[0], 4096)]) == [Status.OK], other.last_error
        for s in [*held, fourth]:
            s.close()


def test_by_default_one_tenant_gets_half_the_connections(tmp_path):
    """The per-tenant cap defaulted to max_connections: one tenant's token held every slot and
    every other tenant was refused TOO_MANY_CONNECTIONS. Only max_connections is set here."""
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "max_connections": 8,
    }) as srv:
        held = []
        for _ in range(8):
            s = _open_from("127.0.0.1", srv.tcp_url)
            s.sendall(hello_frame(TOKENS["globex"], "hog"))
            held.append(s)
            if unpack_header(s.recv(22)).code != 0:
                break
        assert len(held) == 5, "the fifth of one tenant's logins is refused, not the ninth"
        other = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="fair", timeout_s=2)  # control: still served
        k = keys_for("fair-default", 1)
        assert other.put_many(k, [block(k[0], 4096)]) == [Status.OK], other.last_error
        other.close()
        for s in held:
            s.close()


def test_the_per_tenant_connection_cap_defaults_to_half_and_an_explicit_one_wins():
    assert ServerConfig().tenant_connection_cap == 512
    assert ServerConfig(max_connections=1).tenant_connection_cap == 1
    assert ServerConfig(max_connections=8, max_connections_per_tenant=8).tenant_connection_cap == 8
    assert ServerConfig(max_connections=8, max_connections_per_tenant=3).tenant_connection_cap == 3


def test_failed_logins_are_throttled_per_address_and_audited_boundedly(tmp_path):
    audit = tmp_path / "audit.jsonl"
    with ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": "16MiB", "max_block": "1MiB", "audit_log": str(audit), "login_failure_burst": 5,
        "login_failure_rate_per_s": 0.01,
    }) as srv:
        codes = []
        for _ in range(40):
            s = _open_from(ATTACKER, srv.tcp_url)
            s.sendall(hello_frame("not-a-token", "guess"))
            codes.append(unpack_header(s.recv(22)).code)
            s.close()
        assert set(codes) == {ErrorCode.AUTH_FAILED}
        # The right token from the throttled address waits too; from another address it works (control).
        s = _open_from(ATTACKER, srv.tcp_url)
        s.sendall(hello_frame(TOKENS["acme"], "guess"))
        assert unpack_header(s.recv(22)).code == ErrorCode.AUTH_FAILED
        s.close()
        ok = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="throttle", timeout_s=2)
        k = keys_for("throttle", 1)
        assert ok.put_many(k, [block(k[0], 4096)]) == [Status.OK], ok.last_error
        time.sleep(0.3)
        lines = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
        failures = [r for r in lines if r.get("event", r.get("kind")) == "auth_failure" or "auth_failure" in str(r)]
        assert 1 <= len(failures) <= 5, f"{len(failures)} audit lines for 40 failed logins"


def test_admission_policy_drops_the_oldest_silent_socket_of_the_same_address_first():
    adm = Admission(max_connections=8, max_unauthenticated=4, max_per_peer=2, max_per_tenant=8, hello_timeout_s=5)
    assert adm.connect("a1", "A", now=0).evict is None
    assert adm.connect("a2", "A", now=1).evict is None
    assert adm.connect("b1", "B", now=2).evict is None
    assert adm.connect("a3", "A", now=3).evict == "a1"  # A at its cap: A's oldest goes, not B's
    assert adm.connect("c1", "C", now=4).evict is None
    assert adm.connect("d1", "D", now=5).evict == "a2"  # pool full: the oldest of all
    assert adm.login("b1", "acme").ok and adm.unauthenticated == 3 and adm.authenticated == 1
    assert adm.overdue(now=9.5) == ["a3", "c1"]


@pytest.mark.parametrize("burst", [3])
def test_login_limiter_refills_and_bounds_audit_lines(burst):
    lim = LoginLimiter(burst=burst, per_s=1.0, audit_per_burst=2)
    audited = [lim.failed("p", now=0.0) for _ in range(burst)]
    assert audited == [True, True, False] and not lim.allowed("p", now=0.0)
    assert lim.allowed("q", now=0.0)  # another address is untouched
    assert lim.allowed("p", now=1.5)  # refilled


# -- HELLO fields of the wrong shape -------------------------------------------------------------
def _nested(depth: int):
    v = 0
    for _ in range(depth):
        v = [v]
    return v


@pytest.fixture(scope="module")
def hello_srv(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-hello")
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(wd), server={
        "capacity": "16MiB", "max_block": "1MiB", "audit_log": str(wd / "audit.jsonl")})
    yield srv
    srv.stop()


def _hello_code(srv, fields: dict) -> tuple[int, bytes]:
    import msgpack

    from tests.server.conftest import connect, frame, read_frame

    meta = msgpack.packb(fields)
    assert len(meta) <= 4096  # a HELLO the server reads whole
    s = connect(srv.tcp_url)
    try:
        s.sendall(frame(Op.HELLO, meta))
        h, body, _ = read_frame(s)
    finally:
        s.close()
    return h.code, body


@pytest.mark.parametrize("token,field", [("not-a-token", "namespace"), ("not-a-token", "client"),
                                         (TOKENS["acme"], "namespace"), (TOKENS["acme"], "client"),
                                         (TOKENS["admin"], "namespace")])
def test_a_nested_hello_field_is_refused_not_an_internal_error(hello_srv, token, field):
    """A msgpack list nested 1,000 deep fits in a HELLO; the failed login's audit line took its
    str(), which raised RecursionError: INTERNAL and a traceback, from anyone who can connect."""
    code, body = _hello_code(hello_srv, {"token": token, "namespace": "default", field: _nested(1000)})
    assert code == ErrorCode.BAD_META, (ErrorCode(code).name, body)
    assert b"must be a string" in body
    assert "Traceback" not in hello_srv.log(), hello_srv.log()[-1500:]


@pytest.mark.parametrize("field,value", [("namespace", 7), ("client", {"a": 1}), ("namespace", b"default")])
def test_a_hello_field_that_is_no_string_is_bad_meta(hello_srv, field, value):
    code, body = _hello_code(hello_srv, {"token": TOKENS["acme"], "namespace": "default", field: value})
    assert code == ErrorCode.BAD_META and f"HELLO {field} must be a string".encode() in body, (code, body)


def test_hello_fields_of_the_right_type_still_log_in_and_fail_as_before(hello_srv):
    """Controls: a string client name logs in; an unknown token is AUTH_FAILED, audited with the
    fields it sent, cut short."""
    code, _ = _hello_code(hello_srv, {"token": TOKENS["acme"], "namespace": "default", "client": "vllm"})
    assert code == 0
    code, _ = _hello_code(hello_srv, {"token": "not-a-token", "namespace": "ns-x" * 40, "client": "c" * 500})
    assert code == ErrorCode.AUTH_FAILED
    failed = [r for r in _audit(hello_srv) if r["event"] == "auth_failure"]
    assert failed and failed[-1]["namespace"] == ("ns-x" * 40)[:80] and failed[-1]["client"] == "c" * 80, failed[-1:]


def test_nested_admin_arguments_are_refused_and_audited_not_an_internal_error(hello_srv):
    """The admin API's replies and audit lines quoted the client's values with str()/repr() too."""
    from kvtier.cli.admin import admin_call

    reply = admin_call(hello_srv.tcp_url, TOKENS["admin"], "set_ttl", {"tenant": _nested(900), "ttl_s": 1})
    assert reply["ok"] is False and "unknown tenant '<list>'" in reply["error"], reply
    reply = admin_call(hello_srv.tcp_url, TOKENS["admin"], _nested(900), {"x": _nested(900)})
    assert reply["ok"] is False and "unknown admin command" in reply["error"], reply
    assert admin_call(hello_srv.tcp_url, TOKENS["admin"], "usage", {})["ok"]  # control
    assert "Traceback" not in hello_srv.log(), hello_srv.log()[-1500:]
    admin = [r for r in _audit(hello_srv) if r["event"] == "admin"]
    assert any(r["cmd"] == "<list>" and r["args"] == {"x": "<list>"} and r["ok"] is False for r in admin), admin[-3:]


def _audit(srv) -> list[dict]:
    time.sleep(0.2)  # (written by the server as it answers; flushed per line)
    with open(os.path.join(srv.workdir, "audit.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
