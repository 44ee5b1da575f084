"""The audit log is never written where others may read it, and a tenant taken out of the config can
still be erased, its keys shredded. Real ``kvtier serve`` processes (:class:`Restartable`).

(s34 audit a8 D2: an existing 0644 audit log was used as it was, and a symbolic link at its path was
followed. D3: after a tenant's ``[[tenant]]`` was deleted and the server restarted, ``admin erase
--tenant T`` answered "unknown tenant", so T's keys stayed in the key store for good and every copy
of its sealed blocks stayed readable. s34 r7 D2: the fix took any name the key store held keys of,
and a key store may be shared: an erase sent to a server that never had T shredded the keys of the
server that serves T. A name not in the config now takes ``"offboarded": true``.)"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.server.audit import AuditLog
from tests.server.conftest import keys_for
from tests.server.harness import TOKENS, tenants
from tests.server.test_restart import SLOT, Restartable, block_files, get, put, stopped_cleanly

MASTER = {"KVTIER_MASTER_KEY": "5a" * 32}
N = 6
ACME_KEYS = keys_for("stays", 2)


# -- D2: the audit log --------------------------------------------------------------------------
def _audited(tmp_path: Path, log: Path) -> Restartable:
    return Restartable(tmp_path, audit_log=str(log))


def _start_refused(s: Restartable) -> str:
    """The log of a start that was refused."""
    with pytest.raises(RuntimeError, match="did not start") as refused:
        s.start()
    return str(refused.value)


def test_an_existing_audit_log_others_may_read_is_refused_at_start_naming_the_fix(tmp_path):
    log = tmp_path / "audit.jsonl"
    log.write_text('{"event":"earlier"}\n')
    os.chmod(log, 0o644)  # a logrotate `create 0644`, a touch under umask 022
    s = _audited(tmp_path, log)
    said = _start_refused(s)
    assert f"chmod 600 {log}" in said and "audit_log" in said, said
    assert log.read_text() == '{"event":"earlier"}\n' and stat.S_IMODE(log.stat().st_mode) == 0o644

    os.chmod(log, 0o600)  # the fix the refusal named
    s.start()
    try:
        assert s.admin("usage")["ok"]
    finally:
        stopped_cleanly(*s.stop())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == {"event": "earlier"} and [r.get("cmd") for r in lines[1:]] == ["usage"]


def test_a_symbolic_link_at_the_audit_logs_path_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("victim file\n")
    os.chmod(target, 0o600)  # (private: only the link is wrong)
    log = tmp_path / "audit.jsonl"
    log.symlink_to(target)
    said = _start_refused(_audited(tmp_path, log))
    assert "regular file" in said and str(log) in said, said
    assert target.read_text() == "victim file\n"


def test_a_fifo_at_the_audit_logs_path_is_refused_without_waiting_for_a_reader(tmp_path):
    log = tmp_path / "audit.jsonl"
    os.mkfifo(log, 0o600)
    said = _start_refused(_audited(tmp_path, log))
    assert "regular file" in said, said


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's needs root")
def test_an_audit_log_another_user_owns_is_refused(tmp_path):
    log = tmp_path / "audit.jsonl"
    log.touch(mode=0o600)
    os.chown(log, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by this user"):
        AuditLog(str(log))


def test_a_new_audit_log_is_made_0600_whatever_the_umask(tmp_path):
    log = tmp_path / "audit.jsonl"
    old = os.umask(0)
    try:
        audit = AuditLog(str(log))
    finally:
        os.umask(old)
    audit.write("admin", cmd="usage")
    audit.close()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and '"cmd":"usage"' in log.read_text()


# -- D3: erasing a tenant taken out of the config ------------------------------------------------
def _offboarded(tmp_path: Path, **server) -> tuple[Restartable, Path]:
    """globex's blocks stored (and acme's, who stays), a copy of the disk kept aside (a backup), then
    globex taken out of the config and the server started again; the backup's path."""
    s = Restartable(tmp_path, capacity=4 * SLOT, **server)
    s.env = MASTER
    srv = s.start()
    put(srv, "globex", "n", keys_for("offboard", N))
    put(srv, "acme", "n", ACME_KEYS)
    stopped_cleanly(*s.stop())
    backup = tmp_path / "backup"
    shutil.copytree(s.disk, backup)
    s.tenants = {name: spec for name, spec in tenants().items() if name != "globex"}
    assert s.start() and s.admin("stats")["recovered"]["unknown_owner"] == N
    return s, backup


def _key_files(s: Restartable) -> set[str]:
    return {p.name for p in (s.disk / "keys").glob("*.json") if p.name != "keystore-check.json"}


def _restored(s: Restartable, backup: Path) -> None:
    """The backup's block files put back into the (stopped) server's disk_dir."""
    for path in block_files(backup):
        dest = s.disk / path.relative_to(backup)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def test_an_offboarded_tenants_keys_are_shredded_by_erase_and_its_tombstone_outlasts_a_restart(tmp_path):
    s, backup = _offboarded(tmp_path, encrypt_at_rest=True)
    try:
        keys_before = _key_files(s)
        assert len(keys_before) == 2, keys_before  # globex's and acme's
        reply = s.admin("erase", tenant="globex", offboarded=True)
        assert reply == {"ok": True, "erased": 0, "keys_shredded": True}, reply
        assert len(_key_files(s)) == 1 and _key_files(s) < keys_before
        assert get(s.srv, "acme", "n", ACME_KEYS) == [True] * len(ACME_KEYS)  # acme's keys are left alone
        # done already: a second erase finds nothing left to shred, and is not refused
        assert s.admin("erase", tenant="globex", offboarded=True) == {"ok": True, "erased": 0,
                                                                      "keys_shredded": False}
    finally:
        stopped_cleanly(*s.stop())
    # globex comes back (a new contract), and the old backup of its files is put back: the tombstone
    # drops them, they are never served under its new keys
    s.tenants = tenants()
    _restored(s, backup)
    s.start()
    try:
        recovered = s.admin("stats")["recovered"]
        assert (recovered["erased"], recovered["recovered"]) == (N, len(ACME_KEYS)), recovered
    finally:
        stopped_cleanly(*s.stop())


def test_an_offboarded_tenant_whose_blocks_the_disk_held_is_erased_without_encryption(tmp_path):
    s, _ = _offboarded(tmp_path)
    try:
        assert s.admin("erase", tenant="globex", offboarded=True) == {"ok": True, "erased": 0}
    finally:
        stopped_cleanly(*s.stop())


def test_a_name_that_never_was_a_tenant_is_still_unknown_and_shreds_nothing(tmp_path):
    s, _ = _offboarded(tmp_path, encrypt_at_rest=True)
    try:
        keys_before = _key_files(s)
        for name in ("globexx", "initech", "shared/nothing", "../globex"):
            for offboarded in (False, True):
                reply = s.admin("erase", tenant=name, offboarded=offboarded)
                assert not reply["ok"] and reply["error"].startswith(f"unknown tenant {name!r}"), reply
                assert "--offboarded" not in reply["error"], reply  # (nothing of it to shred: no hint)
        # an offboarded tenant is erased whole only: a namespace's erase would shred nothing
        reply = s.admin("erase", tenant="globex", namespace="n", offboarded=True)
        assert not reply["ok"] and "no longer configured" in reply["error"], reply
        assert _key_files(s) == keys_before
        # a configured tenant takes the usual path (control)
        assert s.admin("erase", tenant="acme", namespace="n") == {"ok": True, "erased": len(ACME_KEYS),
                                                                 "keys_shredded": False}
        assert _key_files(s) == keys_before
        # quotas and TTLs are only for configured tenants
        reply = s.admin("set_quota", tenant="globex", bytes=1)
        assert not reply["ok"] and "unknown tenant" in reply["error"], reply
    finally:
        stopped_cleanly(*s.stop())


def test_an_offboarded_tenant_is_erased_only_when_the_call_says_it_was_offboarded(tmp_path):
    s, _ = _offboarded(tmp_path, encrypt_at_rest=True)
    try:
        keys_before = _key_files(s)
        reply = s.admin("erase", tenant="globex")
        assert not reply["ok"] and reply["error"].startswith("unknown tenant 'globex'"), reply
        assert "--offboarded" in reply["error"], reply  # (the key store holds its keys: the way is named)
        assert _key_files(s) == keys_before
        reply = s.admin("erase", tenant="globex", offboarded="yes")
        assert not reply["ok"] and "offboarded must be true or false" in reply["error"], reply
        assert _key_files(s) == keys_before
        # a configured tenant takes the usual path, with the flag or without it
        assert s.admin("erase", tenant="acme", namespace="n", offboarded=True) == {
            "ok": True, "erased": len(ACME_KEYS), "keys_shredded": False}
    finally:
        stopped_cleanly(*s.stop())


def test_kvtier_admin_erase_offboarded_shreds_an_offboarded_tenants_keys(tmp_path):
    s, _ = _offboarded(tmp_path, encrypt_at_rest=True)
    try:
        keys_before = _key_files(s)
        plain = _kvtier_admin(s, "erase", "--tenant", "globex")
        assert plain.returncode == 1 and "--offboarded" in plain.stdout, plain
        assert _key_files(s) == keys_before
        offboarded = _kvtier_admin(s, "erase", "--tenant", "globex", "--offboarded")
        assert offboarded.returncode == 0, offboarded
        assert json.loads(offboarded.stdout) == {"ok": True, "erased": 0, "keys_shredded": True}
        assert len(_key_files(s)) == 1
    finally:
        stopped_cleanly(*s.stop())


def _kvtier_admin(s: Restartable, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_ADMIN_TOKEN"} | {"PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "admin", "--url", s.srv.tcp_url, "--token", "-",
                           *argv], input=TOKENS["admin"] + "\n", capture_output=True, text=True, env=env, timeout=60)


def test_an_erase_sent_to_a_server_that_never_had_the_tenant_leaves_the_shared_key_store_alone(tmp_path):
    """Servers A and B share one key store (``keystore_dir``) and one master key; globex is B's
    tenant only. An erase of globex sent to A -- a wrong URL -- must not shred the keys B reads
    globex's blocks with."""
    keystore = tmp_path / "shared-keystore"
    shared = {"encrypt_at_rest": True, "capacity": 4 * SLOT, "keystore_dir": str(keystore)}
    b = Restartable(tmp_path / "b", **shared)
    a = Restartable(tmp_path / "a", {n: spec for n, spec in tenants().items() if n != "globex"}, **shared)
    a.env = b.env = MASTER
    for server in (a, b):
        server.workdir.mkdir()
    b.start()
    try:
        globex = keys_for("on-b-only", N)  # 6 blocks in 4 slots: 2 spilled, sealed under globex's keys
        put(b.srv, "globex", "n", globex)
        keys_before = {p.name for p in keystore.glob("*.json")}
        a.start()
        try:
            reply = a.admin("erase", tenant="globex")
        finally:
            stopped_cleanly(*a.stop())
        assert not reply["ok"] and reply["error"].startswith("unknown tenant 'globex'"), reply
        assert "--offboarded" in reply["error"], reply
        assert {p.name for p in keystore.glob("*.json")} == keys_before
        assert get(b.srv, "globex", "n", globex) == [True] * N
    finally:
        stopped_cleanly(*b.stop())
