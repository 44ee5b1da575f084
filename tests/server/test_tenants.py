"""Tenant isolation by construction: the tenant comes from the token and is part of every key."""

from __future__ import annotations

import json

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import ErrorCode, Op, unpack_msgpack
from tests.server.conftest import BLOCK, block, closed_by_peer, connect, hello_frame, keys_for, read_frame, remote


def _fill(tier, keys):
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * len(keys)


def test_other_tenant_with_same_keys_gets_zero_hits_while_same_tenant_hits(server):
    keys = keys_for("isolation", 8)
    acme = remote(server, "acme", namespace="chat")
    _fill(acme, keys)
    control = remote(server, "acme2", namespace="chat")  # another token of the same tenant
    globex = remote(server, "globex", namespace="chat")  # same namespace name, same keys
    out = np.zeros(BLOCK, np.uint8)

    assert control.lookup_prefix(keys) == 8
    assert control.get(keys[3], out) is Status.OK and np.array_equal(out, block(keys[3]))

    assert globex.lookup_prefix(keys) == 0
    assert globex.contains_many(keys) == [False] * 8
    assert globex.get_many(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]) == [Status.MISS] * 8
    assert globex.delete_many(keys) == [False] * 8
    assert list(globex.keys()) == []
    assert set(control.keys()) == set(keys)  # control: the owner's other token lists them
    # ... and exactly like absent keys: same statuses for never-written keys.
    absent = keys_for("never-written", 8)
    assert globex.get_many(absent, [np.zeros(BLOCK, np.uint8) for _ in absent]) == [Status.MISS] * 8

    # A foreign put of the same key is the other tenant's own block: nothing leaks either way.
    bogus = np.full(BLOCK, 7, np.uint8)
    assert globex.put(keys[0], bogus) is Status.OK
    assert control.get(keys[0], out) is Status.OK and np.array_equal(out, block(keys[0]))
    assert globex.get(keys[0], out) is Status.OK and np.array_equal(out, bogus)
    assert acme.lookup_prefix(keys) == 8  # globex's delete attempts removed nothing
    for t in (acme, control, globex):
        t.close()


def test_namespaces_of_one_tenant_are_separate(server):
    keys = keys_for("ns-separate", 3)
    a = remote(server, "acme", namespace="model-a")
    b = remote(server, "acme", namespace="model-b")
    _fill(a, keys)
    assert a.lookup_prefix(keys) == 3
    # control: another client (another token) of the same tenant and namespace hits, byte for byte
    same = remote(server, "acme2", namespace="model-a")
    out = np.zeros(BLOCK, np.uint8)
    assert same.lookup_prefix(keys) == 3
    assert same.get(keys[1], out) is Status.OK and np.array_equal(out, block(keys[1]))
    assert b.lookup_prefix(keys) == 0
    assert b.get(keys[1], np.zeros(BLOCK, np.uint8)) is Status.MISS


def test_tenant_claimed_in_hello_is_ignored(server):
    s = connect(server.tcp_url)
    s.sendall(hello_frame("acme-token-1", "claims", tenant="globex", owner="globex"))
    h, meta, _ = read_frame(s)
    assert h.op == Op.HELLO and h.code == 0
    assert unpack_msgpack(meta, "reply")["tenant"] == "acme"
    s.close()


def test_bad_token_is_refused_and_audited(server):
    s = connect(server.tcp_url)
    s.sendall(hello_frame("not-a-token"))
    h, meta, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.AUTH_FAILED
    assert closed_by_peer(s)
    stored = keys_for("bad-token", 2)
    good = remote(server, "acme", namespace="bad-token")
    _fill(good, stored)
    assert remote(server, "acme2", namespace="bad-token").lookup_prefix(stored) == 2  # control: a good token hits
    bad = remote(server, "acme", namespace="bad-token")
    bad._token = "also-wrong"
    assert bad.lookup_prefix(stored) == 0  # a refused token is a miss, not an exception
    assert "AUTH_FAILED" in (bad.last_error or "")
    records = [json.loads(line) for line in open(server.workdir + "/audit.jsonl")]
    failures = [r for r in records if r["event"] == "auth_failure"]
    assert len(failures) >= 2
    assert all("not-a-token" not in json.dumps(r) for r in records), "a token leaked into the audit log"


def test_shared_namespace_is_read_only_and_only_for_granted_tenants(server):
    prompt = keys_for("system-prompt", 4)
    ops = remote(server, "ops", namespace="shared/system-prompts")
    _fill(ops, prompt)

    # acme is granted: its reads fall through to the shared space from any namespace,
    # and a chain that continues in its own space resolves across both.
    acme = remote(server, "acme", namespace="assistant")
    suffix = keys_for("acme-suffix", 2)
    _fill(acme, suffix)
    assert acme.lookup_prefix(prompt) == 4
    assert acme.lookup_prefix(prompt + suffix) == 6
    out = np.zeros(BLOCK, np.uint8)
    assert acme.get(prompt[1], out) is Status.OK and np.array_equal(out, block(prompt[1]))
    # ... but cannot change it: deletes from its own namespace do not reach it.
    assert acme.delete(prompt[0]) is False
    assert acme.lookup_prefix(prompt) == 4

    # Connected to the shared namespace itself, a granted reader is read-only.
    reader = remote(server, "acme", namespace="shared/system-prompts")
    assert reader.lookup_prefix(prompt) == 4
    assert reader.put(keys_for("intrusion", 1)[0], block(b"x" * 32)) is not Status.OK
    assert reader.delete(prompt[0]) is False

    # globex is not granted: nothing, exactly as if absent; and it may not connect there.
    globex = remote(server, "globex", namespace="assistant")
    assert globex.lookup_prefix(prompt) == 0
    s = connect(server.tcp_url)  # control: a granted tenant may connect there
    s.sendall(hello_frame("acme-token-1", "shared/system-prompts"))
    h, _, _ = read_frame(s)
    assert h.op == Op.HELLO and h.code == 0
    s.close()
    s = connect(server.tcp_url)
    s.sendall(hello_frame("globex-token-1", "shared/system-prompts"))
    h, _, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.FORBIDDEN
    s.close()


def test_admin_token_is_not_a_tenant_and_tenants_cannot_administer(server):
    s = connect(server.tcp_url)
    s.sendall(hello_frame("admin-token-1"))
    h, meta, _ = read_frame(s)
    assert unpack_msgpack(meta, "reply")["admin"] is True
    from tests.server.conftest import frame

    s.sendall(frame(Op.LOOKUP, keys_for("a", 1)[0], req_id=2))
    h, _, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.FORBIDDEN
    s.close()
    s = connect(server.tcp_url)  # control: the same lookup from a tenant's token is answered
    s.sendall(hello_frame("acme-token-1"))
    read_frame(s)
    s.sendall(frame(Op.LOOKUP, keys_for("a", 1)[0], req_id=2))
    h, _, _ = read_frame(s)
    assert h.op == Op.LOOKUP and h.code == 0
    s.close()

    from kvtier.tiers.remote_protocol import pack_msgpack

    s = connect(server.tcp_url)
    s.sendall(hello_frame("acme-token-1"))
    read_frame(s)
    s.sendall(frame(Op.ADMIN, pack_msgpack({"cmd": "erase", "args": {"tenant": "globex"}}), req_id=2))
    h, _, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.FORBIDDEN
    s.close()

    s = connect(server.tcp_url)  # control: the same command from the admin token is carried out
    s.sendall(hello_frame("admin-token-1"))
    read_frame(s)
    s.sendall(frame(Op.ADMIN, pack_msgpack({"cmd": "erase", "args": {"tenant": "globex"}}), req_id=2))
    h, meta, _ = read_frame(s)
    assert h.op == Op.ADMIN and h.code == 0, (h, meta)
    s.close()


def test_unix_socket_serves_the_same_store(server):
    keys = keys_for("unix", 2)
    tcp = remote(server, "acme", namespace="both-ways")
    _fill(tcp, keys)
    from kvtier.tiers.remote import RemoteTier

    unix = RemoteTier(server.unix_url, "acme-token-2", namespace="both-ways")
    assert unix.lookup_prefix(keys) == 2


def test_identical_blocks_from_different_workers_are_stored_once(server):
    keys = keys_for("dedupe", 4)
    w1 = remote(server, "acme", namespace="dedupe")
    w2 = remote(server, "acme2", namespace="dedupe")  # another worker of the same tenant
    assert w1.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 4
    used = w1.used_bytes
    assert used == 4 * BLOCK
    assert w2.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 4
    assert w2.put_many(keys, [block(k) for k in keys], skip_present=True) == [Status.OK] * 4
    assert w1.used_bytes == used == w2.used_bytes
