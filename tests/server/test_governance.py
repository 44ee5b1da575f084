"""Quotas, TTL retention, erasure through the admin API and CLI, and the audit trail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import BLOCK, block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants


@pytest.fixture(scope="module")
def gov_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-gov")
    srv = ServerProcess.start(
        tenants(acme={"quota": 8 * BLOCK, "namespace_ttl_s": {"scratch": 1.0}}, globex={"ttl_s": 600}),
        shared=SHARED, admin_token=TOKENS["admin"], workdir=str(wd),
        server={"capacity": "32MiB", "max_block": "256KiB", "audit_log": str(wd / "audit.jsonl"),
                "sweep_interval_s": 0.1},
    )
    yield srv
    srv.stop()


def _admin(srv, cmd, **args):
    return admin_call(srv.tcp_url, TOKENS["admin"], cmd, args)


def test_tenant_over_quota_evicts_its_own_least_recent_blocks_first(gov_server):
    acme = remote(gov_server, "acme", namespace="quota")
    globex = remote(gov_server, "globex", namespace="quota")
    theirs = keys_for("globex-quota", 4)
    assert globex.put_many(theirs, [block(k) for k in theirs]) == [Status.OK] * 4
    mine = keys_for("acme-quota", 12)
    for i, k in enumerate(mine):
        assert acme.put(k, block(k)) is Status.OK
        if i == 5:
            assert acme.lookup_prefix([mine[0]]) == 1  # a hit on the oldest: now most recent
    usage = _admin(gov_server, "usage")["usage"]
    assert usage["acme"]["bytes"] <= 8 * BLOCK
    present = acme.contains_many(mine)
    assert sum(present) == 8
    assert present[-1] and present[0], "the most recent and the re-used block survive"
    assert not present[1], "the least recently used block went first"
    assert globex.contains_many(theirs) == [True] * 4, "another tenant lost blocks to acme's quota"
    # A block larger than the whole quota is refused, not stored at others' expense.
    assert _admin(gov_server, "set_quota", tenant="globex", bytes=BLOCK // 2)["ok"]
    assert globex.put(keys_for("too-big", 1)[0], block(b"z" * 32)) is Status.FULL
    assert _admin(gov_server, "set_quota", tenant="globex", bytes=0)["ok"]


def test_namespace_ttl_expires_blocks(gov_server):
    scratch = remote(gov_server, "acme", namespace="scratch")
    keep = remote(gov_server, "acme", namespace="keep")
    keys = keys_for("ttl", 3)
    assert scratch.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
    assert keep.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
    assert scratch.lookup_prefix(keys) == 3
    expired_before = _admin(gov_server, "stats")["expirations"]
    blocks_before = _admin(gov_server, "usage")["usage"]["acme"]["blocks"]
    time.sleep(1.3)
    # The sweeper itself removes them: checked before any lookup or get, which would expire
    # them lazily and hide a sweeper that does nothing.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and _admin(gov_server, "stats")["expirations"] < expired_before + 3:
        time.sleep(0.05)
    assert _admin(gov_server, "stats")["expirations"] == expired_before + 3
    assert _admin(gov_server, "usage")["usage"]["acme"]["blocks"] == blocks_before - 3
    assert scratch.lookup_prefix(keys) == 0
    assert scratch.get(keys[0], np.zeros(BLOCK, np.uint8)) is Status.MISS
    assert keep.lookup_prefix(keys) == 3
    # Retention changes at run time, per tenant.
    assert _admin(gov_server, "set_ttl", tenant="acme", ttl_s=0.3, namespace="keep")["ok"]
    time.sleep(0.4)  # the blocks are already older than that
    assert keep.lookup_prefix(keys) == 0
    assert _admin(gov_server, "set_ttl", tenant="acme", ttl_s=0, namespace="keep")["ok"]


def test_erase_a_session_then_a_whole_tenant(gov_server):
    acme = remote(gov_server, "acme", namespace="sessions")
    globex = remote(gov_server, "globex", namespace="sessions")
    s1, s2 = keys_for("session-1", 2), keys_for("session-2", 2)
    assert acme.put_many(s1, [block(k) for k in s1], session="chat-1") == [Status.OK] * 2
    assert acme.put_many(s2, [block(k) for k in s2], session="chat-2") == [Status.OK] * 2
    g = keys_for("globex-session", 2)
    assert globex.put_many(g, [block(k) for k in g], session="chat-1") == [Status.OK] * 2

    assert _admin(gov_server, "erase", tenant="acme", session="chat-1") == {"ok": True, "erased": 2}
    assert acme.contains_many(s1 + s2) == [False, False, True, True]
    assert globex.contains_many(g) == [True, True], "a session id of another tenant was erased"

    erased = _admin(gov_server, "erase", tenant="acme")
    assert erased["ok"] and erased["erased"] >= 2
    assert acme.contains_many(s2) == [False, False]
    assert _admin(gov_server, "usage")["usage"]["acme"]["bytes"] == 0
    assert globex.contains_many(g) == [True, True]


def test_admin_errors_name_the_fix_and_everything_is_audited(gov_server):
    bad = _admin(gov_server, "erase", tenant="nobody")
    assert not bad["ok"] and "known:" in bad["error"]
    assert not _admin(gov_server, "frobnicate")["ok"]
    with pytest.raises(PermissionError):
        admin_call(gov_server.tcp_url, TOKENS["acme"], "usage", {})
    records = [json.loads(line) for line in open(gov_server.workdir + "/audit.jsonl")]
    admin = [r for r in records if r["event"] == "admin"]
    assert {r["cmd"] for r in admin} >= {"usage", "erase", "set_quota", "frobnicate"}
    assert all({"ts", "peer", "ok"} <= set(r) for r in admin)


def _admin_token_env(token: str) -> dict:
    """The environment of a ``kvtier admin`` call that takes ``token`` (never an argument: see ps)."""
    return {**os.environ, "KVTIER_ADMIN_TOKEN": token}


def test_admin_cli(gov_server):
    env_cmd = [sys.executable, "-c", "from kvtier.cli.admin import register; import argparse, sys;"
               "p = argparse.ArgumentParser(); s = p.add_subparsers(); register(s);"
               "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"]
    out = subprocess.run(env_cmd + ["admin", "hash-token"], input="abc\n", capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.strip() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    out = subprocess.run(env_cmd + ["admin", "--url", gov_server.tcp_url, "usage"], capture_output=True, text=True,
                         timeout=30, env=_admin_token_env(TOKENS["admin"]))
    assert out.returncode == 0, out.stderr
    assert "acme" in json.loads(out.stdout)["usage"]
    out = subprocess.run(env_cmd + ["admin", "--url", gov_server.tcp_url, "usage"], capture_output=True, text=True,
                         timeout=30, env=_admin_token_env("wrong"))
    assert out.returncode == 1 and "refused" in out.stderr


# -- admin argument checks, without a server (AdminAPI over a stub service) ----------------
class _Audit:
    def __init__(self):
        self.lines = []

    def write(self, kind, **fields):
        self.lines.append((kind, fields))


class _StubService:
    def __init__(self, config, state_path=None):
        from kvtier.server.governance import Governance
        from kvtier.server.index import BlockIndex
        from kvtier.server.runtime_state import RuntimeState

        self.config = config
        self.gov = Governance(config, RuntimeState(state_path))
        self.index = BlockIndex()
        self.audit = _Audit()


def _stub(state_path=None, shared=()):
    from kvtier.server.config import ServerConfig, TenantConfig

    return _StubService(ServerConfig(tenants=(TenantConfig("acme", ("0" * 64,)),), shared=shared), state_path)


def _call(svc, cmd, **args):
    import asyncio

    import msgpack

    from kvtier.server.admin import AdminAPI

    return asyncio.run(AdminAPI(svc).call("test", msgpack.packb({"cmd": cmd, "args": args})))


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -1.0])
def test_set_ttl_refuses_a_non_finite_or_negative_ttl(tmp_path, ttl):
    svc = _stub(str(tmp_path / "runtime.json"))
    reply = _call(svc, "set_ttl", tenant="acme", ttl_s=ttl)
    assert reply["ok"] is False and "finite" in reply["error"], reply
    assert svc.gov.ttl("acme", "default") is None and not (tmp_path / "runtime.json").exists()
    # a NaN would have made the sweeper expire every block: nothing is expired
    from kvtier.server.index import BlockEntry

    now = time.monotonic()
    svc.index.add(b"k" * 32, BlockEntry("acme", "default", b"k" * 32, 10, b"", now, "", "host"))
    assert svc.index.expired(now + 1.0, svc.gov.ttl) == []
    # control: a finite TTL is accepted and applied
    assert _call(svc, "set_ttl", tenant="acme", ttl_s=2.5) == {"ok": True, "ttl_s": 2.5}
    assert svc.gov.ttl("acme", "default") == 2.5


def test_set_ttl_checks_the_namespace_like_a_client_hello():
    svc = _stub()
    for ns in ("", "a" * 5000, "no spaces/or slashes"):
        reply = _call(svc, "set_ttl", tenant="acme", ttl_s=5, namespace=ns)
        assert reply["ok"] is False and "namespace" in reply["error"], str(reply)[:120]
    assert svc.gov.describe()["namespace_ttl_s"] == {}
    assert _call(svc, "set_ttl", tenant="acme", ttl_s=5, namespace="scratch")["ok"]     # control
    assert svc.gov.ttl("acme", "scratch") == 5


def test_set_ttl_on_a_shared_owner_changes_its_effective_ttl():
    from kvtier.server.config import SharedConfig

    svc = _stub(shared=(SharedConfig("sp", (), 60.0),))
    assert svc.gov.ttl("shared/sp", "sp") == 60.0
    assert _call(svc, "set_ttl", tenant="shared/sp", ttl_s=0)["ok"]
    assert svc.gov.ttl("shared/sp", "sp") is None, "the configured namespace TTL still won"
    assert _call(svc, "set_ttl", tenant="shared/sp", ttl_s=30, namespace="sp")["ok"]
    assert svc.gov.ttl("shared/sp", "sp") == 30
    reply = _call(svc, "set_ttl", tenant="shared/sp", ttl_s=30, namespace="other")
    assert reply["ok"] is False and "namespace" in reply["error"], reply


@pytest.mark.parametrize("cmd,args", [("set_quota", {"bytes": 1 << 20}), ("set_ttl", {"ttl_s": 7}),
                                      ("set_ttl", {"ttl_s": 7, "namespace": "scratch"})])
def test_an_override_that_cannot_be_saved_is_refused_audited_and_not_applied(tmp_path, cmd, args):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    svc = _stub(str(blocker / "runtime.json"))
    reply = _call(svc, cmd, tenant="acme", **args)
    assert reply["ok"] is False and "could not be saved" in reply["error"], reply
    assert svc.audit.lines and svc.audit.lines[-1][1]["ok"] is False
    assert (svc.gov.quota("acme"), svc.gov.ttl("acme", "scratch")) == (None, None), "applied though not saved"
    state = svc.gov._state
    assert (state.quota, state.tenant_ttl_s, state.namespace_ttl_s) == ({}, {}, {}), "kept in memory, unsaved"
    # control: once the state directory can be written, the same change is saved and applied
    blocker.unlink()
    assert _call(svc, cmd, tenant="acme", **args)["ok"]
    assert (blocker / "runtime.json").exists()


# -- a namespace TTL of 0: no expiry, even under the tenant's TTL -------------------------------
def _retention_server(tmp_path, tenant_specs, **server):
    return ServerProcess.start(tenant_specs, shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                               server={"capacity": "16MiB", "max_block": "256KiB", **server})


def test_a_namespace_ttl_of_0_means_no_expiry_even_under_a_tenant_ttl(tmp_path):
    """``set-ttl --namespace keep 0`` is documented as "no expiry"; governance stored 0 as "no
    override", so the tenant's 1 s TTL deleted keep's blocks anyway, after answering ok. The
    config file's ``namespace_ttl_s = { cfg = 0 }`` was dropped the same way."""
    specs = tenants(acme={"ttl_s": 1.0, "namespace_ttl_s": {"cfg": 0}})
    with _retention_server(tmp_path, specs, sweep_interval_s=0.1) as srv:
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "set_ttl", {"tenant": "acme", "namespace": "keep", "ttl_s": 0})
        assert reply == {"ok": True, "ttl_s": 0}
        tiers = {ns: remote(srv, "acme", namespace=ns) for ns in ("keep", "cfg", "other", "unset")}
        try:
            keys = keys_for("keep", 3)
            for tier in tiers.values():
                assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
            # null removes a namespace's own TTL: "unset" had 0, and follows the tenant's again
            assert admin_call(srv.tcp_url, TOKENS["admin"], "set_ttl",
                              {"tenant": "acme", "namespace": "unset", "ttl_s": 0})["ok"]
            assert admin_call(srv.tcp_url, TOKENS["admin"], "set_ttl",
                              {"tenant": "acme", "namespace": "unset", "ttl_s": None})["ok"]
            time.sleep(1.6)  # past the tenant's TTL, ~15 sweeps
            assert tiers["keep"].lookup_prefix(keys) == 3, "a namespace set to 'no expiry' (0) expired"
            assert tiers["cfg"].lookup_prefix(keys) == 3, "the config file's namespace TTL of 0 expired"
            out = np.zeros(BLOCK, np.uint8)
            assert tiers["keep"].get(keys[0], out) is Status.OK and np.array_equal(out, block(keys[0]))
            # controls: a namespace without a TTL of its own expires with its tenant's
            assert tiers["other"].lookup_prefix(keys) == 0
            assert tiers["unset"].lookup_prefix(keys) == 0
            policy = admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["policy"]
            assert policy["namespace_ttl_s"] == {"acme:cfg": 0, "acme:keep": 0}, policy
        finally:
            for tier in tiers.values():
                tier.close()


def test_set_ttl_unset_in_the_cli_removes_a_namespace_ttl(tmp_path):
    specs = tenants(acme={"ttl_s": 600})
    cli = [sys.executable, "-m", "kvtier.cli.main", "admin"]
    with _retention_server(tmp_path, specs) as srv:
        base = cli + ["--url", srv.tcp_url, "set-ttl", "--tenant", "acme"]
        env = _admin_token_env(TOKENS["admin"])
        out = subprocess.run(base + ["--namespace", "keep", "0"], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and json.loads(out.stdout) == {"ok": True, "ttl_s": 0.0}, out.stderr
        assert admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["policy"]["namespace_ttl_s"] == {"acme:keep": 0}
        out = subprocess.run(base + ["--namespace", "keep", "--unset"], capture_output=True, text=True, timeout=60,
                             env=env)
        assert out.returncode == 0 and json.loads(out.stdout) == {"ok": True, "ttl_s": None}, out.stderr
        assert admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["policy"]["namespace_ttl_s"] == {}
        out = subprocess.run(base + ["--namespace", "keep"], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 2 and "--unset" in out.stderr  # seconds or --unset, one of them


def test_governance_reads_a_namespace_ttl_of_0_as_never_and_null_as_the_tenants(tmp_path):
    """Runtime overrides saved before kept null for a namespace set to 0 (it followed the tenant
    then): such a file still loads, and means the same."""
    from kvtier.server.config import ServerConfig, TenantConfig
    from kvtier.server.governance import Governance
    from kvtier.server.runtime_state import RuntimeState

    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({"version": 1, "tenant_ttl_s": {"acme": 60},
                                "namespace_ttl_s": [["acme", "old", None], ["acme", "keep", 0]]}))
    config = ServerConfig(tenants=(TenantConfig("acme", ("0" * 64,), namespace_ttl_s={"old": 5.0}),))
    gov = Governance(config, RuntimeState(str(path)))
    assert gov.ttl("acme", "old") == 60, "a saved null: the namespace follows its tenant (over the config's 5)"
    assert gov.ttl("acme", "keep") is None and not gov.is_expired("acme", "keep", 0.0, 1e9)
    assert gov.ttl("acme", "other") == 60 and gov.is_expired("acme", "other", 0.0, 61.0)
    gov.set_ttl("acme", 0, "other")
    gov.set_ttl("acme", None, "keep")
    gov.set_ttl("acme", 0)  # a tenant's 0: none
    saved = json.loads(path.read_text())
    assert saved["namespace_ttl_s"] == [["acme", "keep", None], ["acme", "old", None], ["acme", "other", 0]]
    assert saved["tenant_ttl_s"] == {"acme": None}
    again = Governance(config, RuntimeState(str(path)))
    assert (again.ttl("acme", "other"), again.ttl("acme", "keep"), again.ttl("acme", "x")) == (None, None, None)


# -- LIST leaves out blocks past their TTL ---------------------------------------------------------
def test_list_does_not_name_blocks_past_their_retention(tmp_path):
    """Expired blocks are misses at once (GET, LOOKUP, CONTAINS); LIST named them until the sweeper
    came (every sweep_interval_s), and usage counted them."""
    specs = tenants(acme={"namespace_ttl_s": {"scratch": 0.5}})
    with _retention_server(tmp_path, specs, sweep_interval_s=30) as srv:
        scratch = remote(srv, "acme", namespace="scratch")
        keep = remote(srv, "acme", namespace="keep")
        try:
            keys = keys_for("scratch-list", 3)
            assert scratch.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
            assert keep.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
            assert sorted(scratch.keys()) == sorted(keys)  # control: listed while alive
            time.sleep(0.8)
            later = keys_for("scratch-later", 2)
            assert scratch.put_many(later, [block(k) for k in later]) == [Status.OK] * 2
            listed = list(scratch.keys())
            assert listed == later, f"LIST named {len(listed) - 2} blocks past their 0.5 s TTL"
            assert admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]["acme"]["blocks"] == 5, (
                "the expired blocks LIST saw were not dropped")
            assert sorted(keep.keys()) == sorted(keys)  # control: another namespace is left alone
            assert scratch.contains_many(keys + later) == [False] * 3 + [True] * 2
        finally:
            scratch.close()
            keep.close()
