"""The admin API answers and audits every call, and refuses a setting that would never apply (s33 a6:
D4, D5).

* D4: an erase whose key shredding the key store refuses (read-only, full) has deleted the blocks by
  then: it answers that, with ``keys_shredded`` false and why, and is audited. (It answered INTERNAL
  with a traceback in the log, and no audit line.) A call that fails in any other way is audited too.
* D5: a tenant's TTL on a ``shared/NAME`` namespace is refused, through the admin API and in the
  config, naming the owner where it belongs (``shared/NAME``): shared blocks are indexed under that
  owner, so the TTL was accepted, saved and never applied.

Real ``kvtier serve`` processes, clients over TCP."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from kvtier.cli.admin import admin_call
from kvtier.errors import ConfigError
from kvtier.server.config import load_config
from kvtier.server.launch import ServerProcess, write_config
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants
from tests.server.test_erasure_tombstones import _encrypted
from tests.server.test_restart import Restartable, get, put


def _audit(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- D4 ----------------------------------------------------------------------------------------------
def _immutable(path, on: bool) -> bool:
    """``chattr +i`` / ``-i``: the directory refuses an unlink even to root; False where unsupported."""
    done = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
    return done.returncode == 0


def test_an_erase_whose_keys_cannot_be_shredded_says_so_and_is_audited(tmp_path):
    audit = tmp_path / "audit.jsonl"
    s = Restartable(tmp_path, audit_log=str(audit), **_encrypted(tmp_path))
    keys = keys_for("s33-shred-refused", 3)
    put(s.start(), "globex", "chat", keys)
    if not _immutable(tmp_path / "keys", True):
        s.stop()
        pytest.skip("chattr +i is not supported here")
    try:
        reply = s.admin("erase", tenant="globex")
        assert get(s.srv, "globex", "chat", keys) == [False] * 3
    finally:
        _immutable(tmp_path / "keys", False)
        rc, log = s.stop()
    assert reply["ok"] and reply["erased"] == 3 and reply["keys_shredded"] is False, reply
    assert "keys not shredded" in reply["error"] and "erase globex again" in reply["error"], reply
    lines = [a for a in _audit(audit) if a.get("cmd") == "erase"]
    assert [(a["ok"], a["erased"], a["keys_shredded"]) for a in lines] == [(True, 3, False)], lines
    assert rc == 0 and "Traceback" not in log, log[-2000:]


def test_an_admin_call_that_fails_outside_its_command_is_audited(tmp_path):
    audit = tmp_path / "audit.jsonl"
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                              server={"capacity": "16MiB", "max_block": "1MiB", "audit_log": str(audit)})
    try:
        with pytest.raises(PermissionError, match="ADMIN args must be a map"):
            admin_call(srv.tcp_url, TOKENS["admin"], "usage", ["not", "a", "map"])
    finally:
        srv.stop()
    lines = [a for a in _audit(audit) if a.get("event") == "admin"]
    assert [(a["cmd"], a["ok"]) for a in lines] == [("usage", False)], lines


# -- D5 ----------------------------------------------------------------------------------------------
WHERE = "shared/system-prompts"


def test_a_tenants_ttl_on_a_shared_namespace_is_refused_and_its_owners_applies(tmp_path):
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                              server={"capacity": "8MiB", "max_block": "256KiB", "sweep_interval_s": 0.05})
    ops = remote(srv, "ops", namespace=WHERE)
    try:
        keys = keys_for("s33-shared-ttl", 2)
        assert ops.put_many(keys, [block(k, 4096) for k in keys]) == [Status.OK] * 2
        reply = admin_call(srv.tcp_url, TOKENS["admin"], "set_ttl", {"tenant": "ops", "namespace": WHERE,
                                                                      "ttl_s": 0.2})
        assert reply["ok"] is False and f"--tenant {WHERE}" in reply["error"], reply
        assert admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["policy"]["namespace_ttl_s"] == {}
        assert admin_call(srv.tcp_url, TOKENS["admin"], "set_ttl", {"tenant": WHERE, "ttl_s": 0.2})["ok"]
        assert _gone_within(ops, keys, 5.0), "the shared owner's TTL did not expire its blocks"
    finally:
        ops.close()
        srv.stop()


def _gone_within(tier, keys, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(tier.contains_many(keys)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_configured_tenant_ttl_on_a_shared_namespace_is_refused_naming_its_owner(tmp_path):
    path = tmp_path / "c.toml"
    write_config(str(path), {"listen": ["tcp://127.0.0.1:0"]},
                 tenants(ops={"namespace_ttl_s": {WHERE: 60}}), shared=SHARED)
    with pytest.raises(ConfigError, match=f"owner '{WHERE}'.*ttl_s in the \\[\\[shared\\]\\] named 'system-prompts'"):
        load_config(path, env={})
    write_config(str(path), {"listen": ["tcp://127.0.0.1:0"]}, tenants(ops={"namespace_ttl_s": {"own": 60}}),
                 shared=SHARED)
    assert load_config(path, env={}).tenants[2].namespace_ttl_s == {"own": 60}  # control
