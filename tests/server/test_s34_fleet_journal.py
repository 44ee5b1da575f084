"""The fleet journal (kvtier/server/fleet_journal.py, fleet.py) and what keeps it, and the index,
no bigger than what the fleet holds (audit s34 a3).

* D1: written anew (temp, fsync, rename, then a sync of the directory), a journal whose directory
  sync failed after the rename (EMFILE opening the directory, EIO syncing it) went on appending to
  the old file, which the rename had just unlinked: placements acknowledged durable were lost at
  the next start, and one fd leaked per failure. The callers that run while the server is up log
  such a failure and go on with the journal, so the journal must stay whole.
* D2: a demotion the fleet refused (FULL: no segment mounted) kept its record for good, and an
  erasure left the records of the blocks the index no longer held (owner, namespace, client key).
* D3: blocks the fleet evicted on its own stayed in the index and the journal until a client asked
  about that very block: both grew with every block ever demoted.
The last two against a real Mooncake master and holder (kvtier.tiers.mooncake_launch)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time

import numpy as np
import pytest

import kvtier.server.fleet_journal as fleet_journal
from kvtier.cli.admin import admin_call
from kvtier.errors import ConfigError
from kvtier.server.auth import KeySpace
from kvtier.server.config import ServerConfig, load_config
from kvtier.server.fleet import FleetRecords, JournaledFleet
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.server.index import BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.tiers.base import Status
from kvtier.tiers.mooncake_launch import MooncakeCluster
from tests.polling import wait_until
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import SECRET, SLOT, _serve
from tests.server.test_fleet_journal import CODEC, NBYTES, _entry
from tests.tiers.mooncake_harness import make_tier, mooncake_available

needs_mooncake = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

A, B, C = b"A" * 32, b"B" * 32, b"C" * 32


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _names_after_restart(path: str) -> list[bytes]:
    journal = FleetJournal(path)
    try:
        return sorted(name for name, _ in journal.records())
    finally:
        journal.close()


def _fail_opening_directory(monkeypatch, directory: str) -> None:
    """The directory's sync cannot open it: the server at its fd limit."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == directory:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", open_)


def _fail_syncing_directories(monkeypatch) -> None:
    """A directory's fsync fails (EIO); a file's works."""
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def test_a_compaction_whose_directory_sync_fails_keeps_later_placements(tmp_path, monkeypatch):
    path = str(tmp_path / JOURNAL_FILE)
    journal = FleetJournal(path)
    journal.placed([(A, b"recA", object()), (C, b"recC", object())])
    journal.forget([C], journal.seq)  # (a forgotten record: the compaction has work)
    fds = _open_fds()
    _fail_opening_directory(monkeypatch, str(tmp_path))
    with pytest.raises(OSError):
        journal.compact()  # (an erasure's or a settle's: the caller logs it and goes on)
    monkeypatch.undo()
    leaked = _open_fds() - fds
    journal.placed([(B, b"recB", object())])  # acknowledged: durable
    journal.close()
    assert _names_after_restart(path) == [A, B], "an acknowledged placement went to the unlinked old file"
    assert leaked == 0, "a failed rewrite leaked an fd"


def test_a_compaction_inside_forget_whose_directory_sync_fails_leaks_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / JOURNAL_FILE)
    journal = FleetJournal(path)
    journal.placed([(A, b"recA", object())])
    fds = _open_fds()
    monkeypatch.setattr(fleet_journal, "_COMPACT_AFTER", 1)  # (4096: only shortens the test)
    _fail_syncing_directories(monkeypatch)
    for i in range(5):  # each forgetting compacts, and each compaction's directory sync fails (logged)
        name = bytes([0x30 + i]) * 32
        journal.placed([(name, b"tmp", object())])
        journal.forget([name], journal.seq)
    monkeypatch.undo()
    leaked = _open_fds() - fds
    journal.placed([(B, b"recB", object())])
    journal.close()
    assert _names_after_restart(path) == [A, B], "an acknowledged placement went to the unlinked old file"
    assert leaked == 0, "each failed rewrite leaked an fd"


def test_a_rename_that_fails_leaves_no_temp_file_and_the_journal_as_it_was(tmp_path, monkeypatch):
    path = str(tmp_path / JOURNAL_FILE)
    journal = FleetJournal(path)
    journal.placed([(A, b"recA", object()), (C, b"recC", object())])
    journal.forget([C], journal.seq)
    fds = _open_fds()

    def replace(src, dst, **kwargs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        journal.compact()
    monkeypatch.undo()
    assert _open_fds() == fds, "the temp file's fd leaked"
    assert os.listdir(tmp_path) == [JOURNAL_FILE], "the temp file (every live record) was left behind"
    journal.placed([(B, b"recB", object())])
    journal.close()
    assert _names_after_restart(path) == [A, B]


# -- D2: records of blocks the fleet does not hold ------------------------------------------------------
def _journaled(tmp_path, tier, index: BlockIndex) -> JournaledFleet:
    state = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=CODEC.erasure_key())
    return JournaledFleet(tier, FleetJournal(str(tmp_path / JOURNAL_FILE)), FleetRecords(index, CODEC),
                          tombstones=state)


def _indexed(index: BlockIndex, *entries) -> list[bytes]:
    for skey, entry in entries:
        index.add(skey, entry)
    return [skey for skey, _ in entries]


def _recorded(fleet: JournaledFleet) -> set[bytes]:
    return {name for name, _ in fleet.journal.records()}


@needs_mooncake
def test_a_demotion_the_fleet_refuses_keeps_no_record(tmp_path):
    cluster = MooncakeCluster.start(holders=1, segment_bytes=32 << 20, master_flags=["--client_ttl=2"])
    tier = None
    try:
        cluster.kill_holder(0)  # its segment goes: the master answers puts "no space" (-200)
        tier = make_tier(cluster, timeout_s=2.0)
        index = BlockIndex()
        fleet = _journaled(tmp_path, tier, index)
        keys = _indexed(index, *(_entry("acme", "chat", i) for i in range(4)))
        data = [np.full(NBYTES, 7, np.uint8) for _ in keys]
        probe = os.urandom(32)  # (unrecorded: a put that fails otherwise meanwhile may have landed)
        assert wait_until(lambda: tier.put(probe, data[0]) is Status.FULL, timeout_s=20), \
            "premise: the fleet refuses puts for want of space"
        assert fleet.put_many(keys, data) == [Status.FULL] * 4
        assert _recorded(fleet) == set(), "the records of blocks the fleet refused to store stay in the journal"
        fleet.close()
        tier = None
    finally:
        if tier is not None:
            tier.close()
        cluster.stop()


@needs_mooncake
def test_an_erasure_removes_the_unindexed_blocks_its_records_cover(tmp_path):
    """A block the fleet holds that the index let go (a demotion answered late or in error that
    landed all the same): the erasure of its namespace deletes it from the fleet and forgets its
    record; another namespace's, and an indexed block (the erasure's own to delete), stay."""
    index = BlockIndex()
    fleet = _journaled(tmp_path, make_tier(timeout_s=2.0), index)
    try:
        indexed, orphan, other = _indexed(index, _entry("acme", "chat", 1), _entry("acme", "chat", 2),
                                          _entry("acme", "notes", 3))
        keys = [indexed, orphan, other]
        assert fleet.put_many(keys, [np.full(NBYTES, 7, np.uint8) for _ in keys]) == [Status.OK] * 3
        index.remove(orphan)
        index.remove(other)
        fleet.record_erasure("acme", "chat", None, time.time())
        assert fleet.erase_unindexed_records() == 1
        assert _recorded(fleet) == {indexed, other}, "the record of an erased block stays in the journal"
        assert fleet.contains_many(keys) == [True, False, True], "the erased block stays in the fleet"
        assert fleet.erase_unindexed_records() == 0  # (judged once per erasure)
        file_holds = {name for name, _ in FleetJournal.records_in(fleet.journal.path)}
        assert file_holds == {indexed, other}, "the erased block's record is still readable in the file"
    finally:
        fleet.close()


@needs_mooncake
def test_a_served_namespace_whose_demotions_the_fleet_refused_leaves_no_record_once_erased(tmp_path):
    """The audit's repro through a server: fleet only, its holder gone; DRAM keeps 4 of 12 blocks."""
    cluster = MooncakeCluster.start(holders=1, segment_bytes=64 << 20, master_flags=["--client_ttl=2"])
    try:
        cluster.kill_holder(0)
        time.sleep(5)  # (the master drops the holder's segment)
        keys = keys_for("orphan", 12)
        with _serve(tmp_path, cluster, mooncake_timeout_s=0.5, state_dir=str(tmp_path / "state")) as srv:
            acme = remote(srv, "acme", namespace="private-ns")
            try:
                assert all(s is Status.OK for s in acme.put_many(keys, [block(k, SLOT) for k in keys]))
                time.sleep(2)
            finally:
                acme.close()
            assert _records_naming(tmp_path, keys) == 0, "refused demotions keep their records"
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "private-ns"})
            assert reply.get("complete", True), reply
            assert wait_until(lambda: _records_naming(tmp_path, keys) == 0)
    finally:
        cluster.stop()


def _records_naming(tmp_path, keys) -> int:
    """How many of the journal's records name one of ``keys`` (in clear: no encryption at rest)."""
    copy = tmp_path / "journal-copy"
    shutil.copyfile(tmp_path / "state" / JOURNAL_FILE, copy)
    return sum(any(k in record for k in keys) for _, record in FleetJournal.records_in(str(copy)))


# -- D3: what the fleet evicted on its own -------------------------------------------------------------
@needs_mooncake
def test_the_index_and_journal_let_go_of_what_the_fleet_evicted_on_its_own(tmp_path):
    segment = 16 << 20  # at most 256 blocks of 64 KiB: the fleet evicts the rest
    cluster = MooncakeCluster.start(holders=1, segment_bytes=segment,
                                    master_flags=["--client_ttl=3", "--default_kv_lease_ttl=200"])
    fits = segment // SLOT
    try:
        with _serve(tmp_path, cluster, state_dir=str(tmp_path / "state"), fleet_audit_interval_s=1) as srv:
            acme = remote(srv, "acme", namespace="stream")
            try:
                for r in range(12):
                    keys = keys_for(f"g{r}", 64)
                    assert all(s is Status.OK for s in acme.put_many(keys, [block(k, SLOT) for k in keys]))
            finally:
                acme.close()

            def indexed() -> int:
                return admin_call(srv.tcp_url, TOKENS["admin"], "usage", {})["usage"]["acme"]["blocks"]

            def recorded() -> int:
                copy = tmp_path / "journal-copy"
                shutil.copyfile(tmp_path / "state" / JOURNAL_FILE, copy)
                return len(FleetJournal.records_in(str(copy)))
            held = _held_in_fleet(cluster, [k for r in range(12) for k in keys_for(f"g{r}", 64)])
            assert held <= fits
            # (DRAM holds 4 more; the sweep checks up to 4096 entries at the fleet a second, in passes
            # begun at most every fleet_audit_interval_s: 1 s here, so that the pass after the puts
            # comes within the wait, which a pass every 30 s, the default, would not)
            assert wait_until(lambda: indexed() <= 4 + held and recorded() <= held, timeout_s=20), \
                f"blocks put 768, the fleet holds {held}: index {indexed()}, journal {recorded()}"
    finally:
        cluster.stop()


def test_the_fleet_audit_interval_is_a_server_setting_of_more_than_0_seconds():
    """How often a pass over the entries at the fleet begins (the D3 test shortens it, through the
    config file): a [server] key, so a KVTIER_SERVE_ variable too; 0 would begin a pass every sweep."""
    assert ServerConfig().fleet_audit_interval_s == 30
    assert load_config(env={"KVTIER_SERVE_FLEET_AUDIT_INTERVAL_S": "2.5"}).fleet_audit_interval_s == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(ConfigError, match="KVTIER_SERVE_FLEET_AUDIT_INTERVAL_S"):
            load_config(env={"KVTIER_SERVE_FLEET_AUDIT_INTERVAL_S": bad})
    with pytest.raises(ConfigError, match="fleet_audit_interval_s"):
        ServerConfig(fleet_audit_interval_s=0)


def _held_in_fleet(cluster, keys) -> int:
    reader = make_tier(cluster, tenant="kvtier-serve", secret=SECRET)
    try:
        return sum(reader.contains_many([KeySpace.of("acme", "stream").storage_key(k) for k in keys]))
    finally:
        reader.close()
