"""An admin call made with a tenant's token (an erase of another tenant, a quota, a TTL) is refused
and audited, as every admin call is; a flood of them writes a few audit lines, not one each, however
it is paced, and each line is bounded (the command and argument names). So is a data request made
with the admin token. A real ``kvtier serve``, clients over TCP; the windows with a real audit file.

(s30 audit a2, D3: the refusal left no trace: only the admin token's own calls were audited. s30
a10 D2: one refused frame a second was audited every time, each line ~6x the frame.)"""

from __future__ import annotations

import json
import time

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.audit import AuditLog, RefusalWindows
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
    assert (line["tenant"], line["cmd"], line["args"]) == ("acme", "erase", ["tenant"]), line
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
    assert refused[1]["args"] == ["tenant"]


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


def test_refused_admin_calls_a_second_apart_are_audited_a_few_a_minute(srv):
    """One refused call every 1.05 s refilled the old per-burst bucket between calls: each audited.
    Now 3 lines in the window, and the rest counted in one line when the log closes (the server stops)."""
    for _ in range(5):
        _refused(srv, TOKENS["acme"], "set_ttl", {"tenant": "acme", "ttl_s": 1})
        time.sleep(1.05)
    assert len([r for r in _audit(srv) if r["event"] == "admin_refused"]) == 3
    srv.stop()
    suppressed = [r for r in _audit(srv) if r["event"] == "refusals_suppressed"]
    assert [(r["principal"], r["suppressed"]) for r in suppressed] == [("acme", 2)], suppressed


def test_a_refused_admin_frame_of_long_control_strings_writes_a_line_of_about_a_kilobyte(srv):
    """64 arguments, names and values of control characters (6 bytes each once escaped): a 15 KB frame
    made a 91 KB line. The line keeps the command and the argument names that fit, counts the rest."""
    args = {f"k{i:02d}" + "\x00" * 36: "\x00" * 200 for i in range(64)}
    _refused(srv, TOKENS["acme"], "erase" + "\x00" * 60, args)
    with open(f"{srv.workdir}/audit.jsonl", "rb") as f:
        [line] = [ln for ln in f if b'"admin_refused"' in ln]
    assert len(line) <= 1200, f"a refused admin call wrote a {len(line)} B audit line"
    record = json.loads(line)
    assert record["args"] and record["args"][0].startswith("k00") and "\x00" * 200 not in line.decode()
    assert len(record["args"]) + record["args_left_out"] == 64, record


def test_refusals_past_a_window_are_counted_into_one_line_at_the_next_window(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), refusals=RefusalWindows(per_window=3, window_s=0.5))
    written = [audit.write_refusal("acme", "admin_refused", n=n) for n in range(10)]
    assert written == [True] * 3 + [False] * 7
    assert audit.write_refusal("globex", "admin_refused", n=0)  # another principal's window is its own
    time.sleep(0.6)
    assert audit.write_refusal("globex", "admin_refused", n=1)  # acme's window ended: its count is written first
    assert audit.write_refusal("acme", "admin_refused", n=10)  # a new window
    audit.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    events = [(r["event"], r.get("principal") or r.get("n"), r.get("suppressed")) for r in lines]
    assert events == [("admin_refused", 0, None), ("admin_refused", 1, None), ("admin_refused", 2, None),
                      ("admin_refused", 0, None), ("refusals_suppressed", "acme", 7), ("admin_refused", 1, None),
                      ("admin_refused", 10, None)], events
