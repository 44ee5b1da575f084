"""Erasure tombstones under the keys a server has had: its state key writes them; an older key of its
own (the disk's secret, which earlier versions keyed them by wherever there was a disk) is still read,
and what it authenticates is written anew under the state key at once -- at the next start that older
key may be gone (the disk dropped from the config). Tombstones of a key the server does not hold are
not applied but stay in the file, through every save, until a start holds that key again. Real files.
(s32 a3: D1; the servers themselves: test_state_key_disk_added_or_dropped.py.)"""

from __future__ import annotations

import json
import logging

import pytest

from kvtier.errors import ConfigError
from kvtier.server import runtime_state
from kvtier.server.runtime_state import RuntimeState

DISK_KEY, STATE_KEY, OTHER_KEY = b"d" * 32, b"s" * 32, b"o" * 32


def _erased(path, key: bytes, *erasures) -> None:
    state = RuntimeState(str(path), erasure_key=key)
    for owner, at in erasures:
        state.record_erasure(owner, None, None, at)


def test_tombstones_of_an_older_key_are_applied_and_written_anew_under_the_state_key(tmp_path, caplog):
    path = tmp_path / "runtime.json"
    _erased(path, DISK_KEY, ("globex", 1000.0))
    with caplog.at_level(logging.INFO, logger="kvtier.server.runtime_state"):
        state = RuntimeState(str(path), erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])
    assert state.erased("globex", "chat", "", 999.0)
    assert "written anew" in caplog.text
    # at once: a start that no longer holds the disk's key (the disk dropped) reads them
    assert RuntimeState(str(path), erasure_key=STATE_KEY).erasures() == {("globex", None, None): 1000.0}


def test_tombstones_of_a_key_the_server_does_not_hold_stay_in_the_file_until_it_does(tmp_path, caplog):
    """A run without the disk (its key unknown there) saves the file: they are kept in it, not applied;
    the next start with the disk applies them, with those recorded meanwhile."""
    path = tmp_path / "runtime.json"
    _erased(path, DISK_KEY, ("globex", 1000.0))
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        without = RuntimeState(str(path), erasure_key=STATE_KEY)
    assert without.erasures() == {} and "1 erasure records written under another key" in caplog.text
    without.set_quota("acme", 1 << 30)
    without.record_erasure("initech", None, None, 2000.0)
    again = RuntimeState(str(path), erasure_key=STATE_KEY)  # kept aside again, not lost
    assert again.erasures() == {("initech", None, None): 2000.0}
    again.set_quota("acme", 1 << 31)
    back = RuntimeState(str(path), erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])
    assert back.erasures() == {("globex", None, None): 1000.0, ("initech", None, None): 2000.0}
    assert back.quota == {"acme": 1 << 31}
    assert "foreign_erasures" not in json.loads(path.read_text()), "applied: written anew under the state key"


def test_tombstones_kept_aside_are_kept_by_a_server_without_an_erasure_key_too(tmp_path):
    path = tmp_path / "runtime.json"
    _erased(path, DISK_KEY, ("globex", 1000.0))
    RuntimeState(str(path), erasure_key=STATE_KEY).record_erasure("initech", None, None, 2000.0)
    RuntimeState(str(path)).set_quota("acme", 1)  # no disk, no fleet journal: nothing read, all kept
    back = RuntimeState(str(path), erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])
    assert back.erasures() == {("globex", None, None): 1000.0, ("initech", None, None): 2000.0}


def test_the_latest_erasure_of_a_scope_wins_when_sets_are_merged(tmp_path):
    path = tmp_path / "runtime.json"
    _erased(path, DISK_KEY, ("globex", 3000.0), ("acme", 1000.0))
    RuntimeState(str(path), erasure_key=STATE_KEY).record_erasure("globex", None, None, 2000.0)
    back = RuntimeState(str(path), erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])
    assert back.erasures() == {("globex", None, None): 3000.0, ("acme", None, None): 1000.0}


def test_sets_kept_aside_are_bounded(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runtime_state, "MAX_FOREIGN_SETS", 2)
    path = tmp_path / "runtime.json"
    keys = [bytes([k]) * 32 for k in b"abc"]
    for i, key in enumerate(keys):  # each start's key another: each file's set is kept aside
        RuntimeState(str(path), erasure_key=key).record_erasure(f"t{i}", None, None, 1000.0 + i)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        RuntimeState(str(path), erasure_key=OTHER_KEY).set_quota("acme", 1)
    assert "1 sets of erasure records of keys this server does not hold dropped" in caplog.text
    kept = json.loads(path.read_text())["foreign_erasures"]
    assert [s["erasures"][0][0] for s in kept] == ["t1", "t2"], "the oldest set went"


def test_tombstones_of_an_older_key_that_were_edited_stop_the_start(tmp_path):
    path = tmp_path / "runtime.json"
    _erased(path, DISK_KEY, ("globex", 1000.0))
    doc = json.loads(path.read_text())
    doc["erasures"][0][3] = 1.0  # moved back before the blocks it erased
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="edited"):
        RuntimeState(str(path), erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])
