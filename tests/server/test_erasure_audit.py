"""An admin call made with a tenant's token (an erase of another tenant, a quota, a TTL) is refused
and audited, as every admin call is; a flood of them writes a few audit lines, not one each. So is
a data request made with the admin token. A real ``kvtier serve``, clients over TCP.

(s30 audit a2, D3: the refusal left no trace: only the admin token's own calls were audited.)"""

from __future__ import annotations

import json
import time

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.remote_protocol import Op
from kvtier.tiers.remote_wire import RemoteError, WireClient, parse_url
from tests.server.harness import SHARED, TOKENS, tenants


@pytest.fixture
def srv(tmp_path):
    server = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                                 server={"capacity": "16MiB", "max_block": "1MiB",
                                         "audit_log": str(tmp_path / "audit.jsonl")})
    yield server
    server.stop()


def _audit(srv) -> list[dict]:
    with open(f"{srv.workdir}/audit.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _refused(srv, token: str, cmd, args) -> None:
    with pytest.raises(PermissionError, match="ADMIN needs the admin token"):
        admin_call(srv.tcp_url, token, cmd, args)


def test_a_tenant_tokens_admin_call_is_refused_and_audited(srv):
    _refused(srv, TOKENS["acme"], "erase", {"tenant": "globex"})
    assert admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["ok"]  # the control: the admin's own call
    lines = _audit(srv)
    refused = [r for r in lines if r["event"] == "admin_refused"]
    assert len(refused) == 1, f"a tenant's admin erase left no audit line: {lines}"
    (line,) = refused
    assert (line["tenant"], line["cmd"], line["args"]) == ("acme", "erase", {"tenant": "globex"}), line
    assert line["peer"].startswith("127.0.0.1"), line
    assert [r["cmd"] for r in lines if r["event"] == "admin"] == ["usage"]


def test_a_refused_admin_frame_that_does_not_decode_is_audited_too(srv):
    client = WireClient(parse_url(srv.tcp_url), TOKENS["globex"], namespace="default", connect_timeout_s=5.0)
    try:
        with pytest.raises(RemoteError):
            # (0xc1: a byte msgpack never uses)
            client.call(Op.ADMIN, b"\xc1 not msgpack", deadline=time.monotonic() + 10, reply_meta=(1, 1 << 16))
    finally:
        client.close()
    nested = {"cmd": ["set_quota"] * 3, "args": {"tenant": {"deep": [[[1]]]}}}
    _refused(srv, TOKENS["globex"], nested["cmd"], nested["args"])
    refused = [r for r in _audit(srv) if r["event"] == "admin_refused"]
    assert [(r["tenant"], r["cmd"]) for r in refused] == [("globex", "<undecodable>"), ("globex", "<list>")]
    assert refused[1]["args"] == {"tenant": "<dict>"}


def test_a_flood_of_refused_admin_calls_writes_a_few_audit_lines(srv):
    for _ in range(40):
        _refused(srv, TOKENS["acme"], "set_quota", {"tenant": "acme", "bytes": None})
    _refused(srv, TOKENS["globex"], "erase", {"tenant": "acme"})  # another tenant's burst is its own
    refused = [r for r in _audit(srv) if r["event"] == "admin_refused"]
    by_acme = [r for r in refused if r["tenant"] == "acme"]
    assert 1 <= len(by_acme) <= 5, f"{len(by_acme)} audit lines for 40 refused admin calls"
    assert [r["tenant"] for r in refused if r["tenant"] != "acme"] == ["globex"]


def test_a_data_request_with_the_admin_token_is_refused_and_audited(srv):
    client = WireClient(parse_url(srv.tcp_url), TOKENS["admin"], namespace="default", connect_timeout_s=5.0)
    try:
        with pytest.raises(RemoteError, match="administers"):
            client.call(Op.LIST, bytes(12), deadline=time.monotonic() + 10, reply_meta=(0, 1 << 20))
    finally:
        client.close()
    refused = [r for r in _audit(srv) if r["event"] == "admin_token_refused"]
    assert [r["op"] for r in refused] == ["LIST"], refused
