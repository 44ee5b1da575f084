"""An erase that is not complete fails the CLI, a shared block's writer stays charged over a restart, the
state-in-both-directories refusal, and an old shared-namespace TTL that can be removed (s33 r1 D1-D4).

* D1: ``kvtier admin erase`` exits 3 (partly done) when the reply says the tenant's keys were not
  shredded or a tier kept copies (``refused``): the server says ``complete: false``. It exited 0, so
  ``kvtier admin erase --tenant T && mark_erased T`` recorded an erasure whose keys survived.
* D2: the tenant that wrote a block into a shared namespace (its payer, charged under its quota) is
  kept in the block's spill annotation and fleet record, and charged again at start while it is still
  a configured writer. It was forgotten: after each restart a tenant at its quota wrote another quota's
  worth of shared blocks.
* D3: a ``state_dir`` set while both it and ``disk_dir`` hold runtime.json is refused naming both
  files, with no ``mv`` that would replace state_dir's (and its erasures' tombstones); the advice
  where only disk_dir holds them uses ``mv -n``.
* D4: ``set_ttl --unset`` of a tenant's TTL on a ``shared/`` namespace, which an older version saved,
  removes it (a setting there is still refused).

Real ``kvtier serve`` processes, clients over TCP; the fleet journal over the stand-in fleet of
test_fleet_journal.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgpack
import pytest

from kvtier.core.payload import pack_header
from kvtier.server.auth import KeySpace
from kvtier.server.fleet import rebuild_from_journal
from kvtier.server.index import BlockEntry, BlockIndex
from kvtier.server.launch import ServerProcess
from kvtier.server.spill import SpillAnnotation, SpillCodec
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS, tenants
from tests.server.test_erasure_tombstones import _encrypted
from tests.server.test_fleet_journal import NBYTES, _fleet, _place, _reopened
from tests.server.test_restart import Restartable, block_files, put, stopped_cleanly

SHARED_NS = "shared/system-prompts"
SHARED_OWNER = "shared/system-prompts"
PAGE = 4096


# -- D1 ----------------------------------------------------------------------------------------------
def _cli_erase(srv, *scope: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from kvtier.cli.main import main; sys.exit(main())",
                           "admin", "--url", srv.tcp_url, "erase", *scope],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVTIER_ADMIN_TOKEN": TOKENS["admin"]})


def _immutable(path, on: bool) -> bool:
    """``chattr +i`` / ``-i``: the directory refuses an unlink even to root; False where unsupported."""
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


def test_cli_erase_whose_keys_are_not_shredded_exits_3_and_a_complete_one_0(tmp_path):
    s = Restartable(tmp_path, **_encrypted(tmp_path))
    srv = s.start()
    put(srv, "globex", "chat", keys_for("s33b-shred", 3))
    put(srv, "acme", "chat", keys_for("s33b-done", 2))
    put(srv, "acme", "docs", keys_for("s33b-ns", 2))
    if not _immutable(tmp_path / "keys", True):
        s.stop()
        pytest.skip("chattr +i is not supported here")
    try:
        partly = _cli_erase(srv, "--tenant", "globex")
    finally:
        _immutable(tmp_path / "keys", False)
    namespace_only = _cli_erase(srv, "--tenant", "acme", "--namespace", "docs")  # shreds no keys, by design
    whole = _cli_erase(srv, "--tenant", "acme")
    stopped_cleanly(*s.stop())
    reply = json.loads(partly.stdout)
    assert partly.returncode == 3, (partly.returncode, partly.stdout, partly.stderr)
    assert reply["ok"] and reply["erased"] == 3 and reply["keys_shredded"] is False and reply["complete"] is False
    assert "keys not shredded" in reply["error"]
    assert namespace_only.returncode == 0, namespace_only.stdout
    assert json.loads(namespace_only.stdout) == {"ok": True, "erased": 2, "keys_shredded": False}
    assert whole.returncode == 0, whole.stdout
    assert json.loads(whole.stdout) == {"ok": True, "erased": 2, "keys_shredded": True}


def test_cli_erase_whose_blocks_a_tier_kept_exits_3(tmp_path):
    s = Restartable(tmp_path)
    keys = keys_for("s33b-refused", 4)
    put(s.start(), "globex", "chat", keys)
    stopped_cleanly(*s.stop())  # flushed to disk
    shards = sorted({path.parent for path in block_files(s.disk)})
    srv = s.start()
    if not all(_immutable(shard, True) for shard in shards):
        for shard in shards:
            _immutable(shard, False)
        s.stop()
        pytest.skip("chattr +i is not supported here")
    try:
        partly = _cli_erase(srv, "--tenant", "globex")
    finally:
        for shard in shards:
            _immutable(shard, False)
    stopped_cleanly(*s.stop())
    reply = json.loads(partly.stdout)
    assert partly.returncode == 3, (partly.returncode, partly.stdout, partly.stderr)
    assert reply["ok"] and reply["refused"] > 0 and reply["complete"] is False, reply


# -- D2 ----------------------------------------------------------------------------------------------
def _put_shared(srv, keys) -> list[Status]:
    tier = remote(srv, "ops", namespace=SHARED_NS)
    try:
        return tier.put_many(keys, [block(k, 64) for k in keys])
    finally:
        tier.close()


def _held_shared(srv, keys) -> int:
    tier = remote(srv, "ops", namespace=SHARED_NS)
    try:
        return sum(tier.contains_many(keys))
    finally:
        tier.close()


def test_a_shared_blocks_writer_is_charged_the_same_after_restarts(tmp_path):
    """ops, quota 10 pages, writes 10 one-page shared blocks per run: its quota bounds them across
    restarts (it was charged 0 after each restart and held 30 after two)."""
    s = Restartable(tmp_path, tenants(ops={"quota": 10 * PAGE}), capacity="8MiB", max_block="256KiB")
    written: list[bytes] = []
    charged = []
    for run in range(3):
        srv = s.start()
        charged.append(s.admin("usage")["usage"]["ops"]["charged_bytes"])
        keys = keys_for(f"s33b-payer{run}", 10)
        written += keys
        assert _put_shared(srv, keys) == [Status.OK] * 10
        held = _held_shared(srv, written)
        stopped_cleanly(*s.stop())
    assert charged == [0, 10 * PAGE, 10 * PAGE]
    assert held == 10  # the quota evicted the writer's older shared blocks, as without restarts


def test_a_writer_dropped_from_the_config_is_not_charged_after_a_restart(tmp_path):
    s = Restartable(tmp_path, tenants(ops={"quota": 10 * PAGE}), capacity="8MiB", max_block="256KiB")
    keys = keys_for("s33b-dropped", 4)
    assert _put_shared(s.start(), keys) == [Status.OK] * 4
    stopped_cleanly(*s.stop())
    s.srv = ServerProcess.start(s.tenants, shared=[{"name": "system-prompts", "writers": []}],  # ops dropped
                                admin_token=TOKENS["admin"], workdir=str(s.workdir), server=s.server)
    try:
        usage = s.admin("usage")["usage"]
    finally:
        stopped_cleanly(*s.stop())
    assert usage["ops"]["charged_bytes"] == 0
    assert usage[SHARED_OWNER]["blocks"] == 4 and usage[SHARED_OWNER]["charged_bytes"] == 4 * PAGE, usage


def _shared_entry(i: int, payer: str) -> tuple[bytes, BlockEntry]:
    key = bytes([i]) * 32
    skey = KeySpace.of(SHARED_OWNER, SHARED_NS[len("shared/"):]).storage_key(key)
    return skey, BlockEntry(SHARED_OWNER, SHARED_NS[len("shared/"):], key, NBYTES, pack_header(key, NBYTES, bytes(16)),
                            time.monotonic(), "", "host", None, None, payer=payer)


def test_a_fleet_record_keeps_a_shared_blocks_payer_while_it_is_a_writer(tmp_path):
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    (name,) = _place(fleet, index, _shared_entry(1, "ops"))
    objects = dict(fleet.inner.objects)
    fleet.close()
    payers = {}
    for writers in ({SHARED_OWNER: frozenset({"ops"})}, {SHARED_OWNER: frozenset()}):
        again, _ = _reopened(tmp_path)
        again.inner.objects = dict(objects)
        out = rebuild_from_journal(again, {SHARED_OWNER, "ops"}, writers=writers)
        payers[bool(writers[SHARED_OWNER])] = [(skey, entry.payer) for _, skey, entry in out.found]
        again.close()
    assert payers == {True: [(name, "ops")], False: [(name, "")]}


def test_an_annotation_without_a_payer_reads_as_before_and_one_with_none_is_written_so():
    """An older version's annotation (9 fields) reads with no payer; one without a payer is written
    in that form, so that a version before payers still reads it."""
    codec = SpillCodec(b"k" * 32)
    plain = SpillAnnotation("acme", "chat", b"x" * 32, "", 1.0, b"h", 3, None)
    shared = SpillAnnotation(SHARED_OWNER, "system-prompts", b"y" * 32, "", 1.0, b"h", 3, None, "ops")
    disk_key = b"d" * 32
    assert codec.unpack(disk_key, codec.pack(disk_key, plain)) == plain
    assert codec.unpack(disk_key, codec.pack(disk_key, shared)).payer == "ops"
    body = codec.pack(disk_key, plain)[:-32]
    assert len(msgpack.unpackb(body, raw=False)) == 9


# -- D3 ----------------------------------------------------------------------------------------------
def test_state_in_both_directories_is_refused_naming_both_and_no_mv(tmp_path):
    state = tmp_path / "state"
    s = Restartable(tmp_path, state_dir=str(state))
    s.start()
    assert s.admin("erase", tenant="globex")["ok"]  # a tombstone in state/runtime.json
    stopped_cleanly(*s.stop())
    kept = (state / "runtime.json").read_bytes()
    del s.server["state_dir"]  # one run without it (a config rolled back) writes disk/runtime.json
    s.start()
    assert s.admin("set_quota", tenant="acme", bytes=1 << 20)["ok"]
    stopped_cleanly(*s.stop())
    s.server["state_dir"] = str(state)
    with pytest.raises(RuntimeError) as refused:
        s.start()
    message = str(refused.value)
    assert str(s.disk / "runtime.json") in message and str(state / "runtime.json") in message, message
    assert "Nothing is merged" in message and " mv " not in message, message
    assert (state / "runtime.json").read_bytes() == kept


def test_state_left_in_disk_dir_alone_advises_mv_n(tmp_path):
    s = Restartable(tmp_path)
    s.start()
    assert s.admin("set_quota", tenant="acme", bytes=1 << 20)["ok"]  # disk/runtime.json
    stopped_cleanly(*s.stop())
    s.server["state_dir"] = str(tmp_path / "state")
    with pytest.raises(RuntimeError) as refused:
        s.start()
    assert f"&& mv -n {s.disk / 'runtime.json'} {tmp_path / 'state'}/" in str(refused.value), str(refused.value)


# -- D4 ----------------------------------------------------------------------------------------------
def test_a_shared_namespace_ttl_an_older_version_saved_can_be_unset(tmp_path):
    s = Restartable(tmp_path)
    s.start()
    assert s.admin("set_quota", tenant="acme", bytes=1 << 20)["ok"]  # disk/runtime.json
    stopped_cleanly(*s.stop())
    path = s.disk / "runtime.json"
    saved = json.loads(path.read_text())
    saved["namespace_ttl_s"].append(["ops", SHARED_NS, 0.5])  # as a version before the refusal saved it
    path.write_text(json.dumps(saved))
    s.start()
    try:
        before = s.admin("usage")["policy"]["namespace_ttl_s"]
        refused = s.admin("set_ttl", tenant="ops", namespace=SHARED_NS, ttl_s=5)
        unset = s.admin("set_ttl", tenant="ops", namespace=SHARED_NS, ttl_s=None)
        after = s.admin("usage")["policy"]["namespace_ttl_s"]
    finally:
        stopped_cleanly(*s.stop())
    assert before == {f"ops:{SHARED_NS}": 0.5}
    assert not refused["ok"] and "shared namespace belong to its owner" in refused["error"], refused
    assert unset == {"ok": True, "ttl_s": None} and after == {}
    assert json.loads(path.read_text())["namespace_ttl_s"] == []  # gone from the file, not kept as null
    assert json.loads(path.read_text())["quota"] == {"acme": 1 << 20}
