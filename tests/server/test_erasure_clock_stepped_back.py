"""An erasure's tombstone covers the blocks stamped (their wall-clock creation, in their disk
annotation or fleet record) at or before its time. With the wall clock stepped back between a
block's stamp and the erase (an NTP step), ``time.time()`` at the erase is older than the newest
stamps: the tombstone is recorded at the newest stamp of the owner's blocks instead, so an old copy
of the newest erased blocks put back is not served after a restart. The stamps counted are this
run's and those read back at the start (a clock stepped back across the restart).

The real ``Server`` in process (its admin module's clock stepped back), clients over TCP; the fleet
journal's part over a stand-in fleet, as in test_fleet_journal.py. (s32 a3: D3.)"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server import admin as admin_module
from kvtier.server.fleet import rebuild_from_journal
from kvtier.server.index import BlockIndex
from kvtier.server.runtime_state import RuntimeState
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for
from tests.server.harness import TOKENS
from tests.server.inprocess import InProcessServer
from tests.server.test_erasure_tombstones import _copy_aside, _put_back
from tests.server.test_fleet_journal import _entry, _fleet, _place
from tests.server.test_restart import block_files

SLOT = 64 * 1024
STEP_BACK_S = 5.0


def _server(tmp_path) -> InProcessServer:
    return InProcessServer(tmp_path, disk_dir=str(tmp_path / "disk"), disk_capacity="64MiB")


def _put(s: InProcessServer, keys) -> None:
    t = s.remote("globex", "chat")
    try:
        assert t.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * len(keys)
    finally:
        t.close()


def _served(s: InProcessServer, keys) -> list[bool]:
    t = s.remote("globex", "chat")
    try:
        outs = [np.zeros(SLOT, np.uint8) for _ in keys]
        return [st is Status.OK for st in t.get_many(keys, outs)]
    finally:
        t.close()


def _erase_with_the_clock_stepped_back(s: InProcessServer, monkeypatch) -> None:
    stepped = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    stepped.time = lambda: time.time() - STEP_BACK_S
    with monkeypatch.context() as m:
        m.setattr(admin_module, "time", stepped)
        reply = admin_call(s.url, TOKENS["admin"], "erase", {"tenant": "globex"})
    assert reply["ok"] and reply["erased"] == 3, reply


def _spilled(disk, n: int, timeout_s: float = 20.0) -> list:
    """The block files once write-behind has spilled ``n`` of them."""
    deadline = time.monotonic() + timeout_s
    while len(files := block_files(disk)) < n:
        assert time.monotonic() < deadline, f"write-behind spilled {len(files)} of {n} blocks"
        time.sleep(0.05)
    return files


@pytest.mark.parametrize("stamped", ["at the start", "in this run"])
def test_a_clock_stepped_back_before_an_erase_leaves_no_erased_block_uncovered(tmp_path, monkeypatch, stamped):
    keys = keys_for(f"globex-stepped/{stamped}", 3)
    s = _server(tmp_path)
    _put(s, keys)
    if stamped == "at the start":  # the stamps read back from disk by the next start
        s.stop()
        _copy_aside(block_files(tmp_path / "disk"), tmp_path / "backup")
        s = _server(tmp_path)
    else:  # the stamps this run's write-behind wrote
        _copy_aside(_spilled(tmp_path / "disk", 3), tmp_path / "backup")
    _erase_with_the_clock_stepped_back(s, monkeypatch)
    s.stop()
    _put_back(tmp_path / "backup", tmp_path / "disk")
    s = _server(tmp_path)
    try:
        assert s.server.recovered["erased"] == 3, s.server.recovered
        assert _served(s, keys) == [False] * 3, "erased blocks served again after the restart"
    finally:
        s.stop()


def test_a_tombstone_covers_the_fleet_records_stamped_ahead_of_the_clock(tmp_path):
    """The fleet journal's records: stamped when placed, and read back at the start."""
    state = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=b"e" * 32)
    index = BlockIndex()
    fleet = _fleet(tmp_path, index)
    fleet.records.stamps = state.stamps
    fleet.tombstones = state
    _place(fleet, index, *(_entry("globex", "chat", i) for i in range(3)))
    fleet.record_erasure("globex", None, None, time.time() - STEP_BACK_S)
    fleet.close()
    rebuilt = rebuild_from_journal(_fleet(tmp_path, BlockIndex()), {"globex"}, state)
    assert rebuilt.erased == 3 and not rebuilt.found, rebuilt.summary()


def test_a_tombstone_is_recorded_at_the_newest_stamp_only_when_the_clock_is_behind_it(tmp_path):
    state = RuntimeState(str(tmp_path / "runtime.json"), erasure_key=b"e" * 32)
    state.stamps.note("globex", 2000.0)
    state.stamps.note("globex", 1500.0)  # (older: the newest stays)
    state.record_erasure("globex", "chat", None, 1990.0)
    state.record_erasure("acme", "chat", None, 1990.0)  # another owner's stamps do not count
    state.record_erasure("globex", None, "s1", 2010.0)  # a clock past every stamp: its own time
    again = RuntimeState(state.path, erasure_key=b"e" * 32).erasures()
    assert again == {("globex", "chat", None): 2000.0, ("acme", "chat", None): 1990.0,
                     ("globex", None, "s1"): 2010.0}
