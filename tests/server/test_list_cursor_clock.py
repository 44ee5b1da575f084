"""R2 (low): LIST cursors are read off the wall clock at the namespace's first block (62d8601).
After a restart whose wall clock is behind the previous run's (an NTP step back, a host whose RTC
is off, a restart on another host with the same state_dir), the rebuilt namespace is numbered
below a cursor the client holds: its next page is empty, and the client takes the listing as
complete while none of the namespace's blocks were listed after the cursor. A cursor must never
make later blocks unreachable; e.g. persisting a high-water mark or starting a rebuilt namespace
past max(clock, last position handed out)."""
from __future__ import annotations

import time

from kvtier.server import index as index_mod
from kvtier.server.index import BlockEntry, BlockIndex

NB = 4096


def _fill(ix: BlockIndex, keys: list[bytes]) -> None:
    now = time.monotonic()
    for k in keys:
        ix.add(k, BlockEntry("acme", "ns", k, NB, b"", now))


def test_a_cursor_from_before_a_restart_with_the_clock_stepped_back_still_reaches_later_blocks(monkeypatch):
    old = [b"k%03d" % i for i in range(4)]
    first = BlockIndex()
    _fill(first, old)
    page, cursor = first.page("acme", "ns", 0, 2)  # the client lists 2 and keeps the cursor
    assert [e.key for e in page] == old[:2]

    # the server restarts; the wall clock is 10 s behind the previous run's
    real = time.time_ns
    monkeypatch.setattr(index_mod.time, "time_ns", lambda: real() - 10_000_000_000)
    second = BlockIndex()
    _fill(second, old)  # recovery indexes the spilled blocks again, oldest first
    new = [b"n%03d" % i for i in range(3)]
    _fill(second, new)  # and new blocks arrive
    page, _ = second.page("acme", "ns", cursor, 100)
    listed = {e.key for e in page}
    assert set(new) <= listed, (
        f"after the restart the old cursor {cursor} is past every position "
        f"({second.page('acme', 'ns', 0, 1)[1]} first): the page is {sorted(listed)}, new blocks never listed")


def test_a_server_with_a_state_directory_numbers_after_every_cursor_an_earlier_run_handed_out(tmp_path, monkeypatch):
    """The persisted high-water mark: the restarted server's rebuilt namespace starts past the old
    cursor whatever its clock says, so the old cursor pages on through every block after it."""
    from kvtier.server.runtime_state import RuntimeState

    path = str(tmp_path / "runtime.json")
    state = RuntimeState(path)
    first = BlockIndex()
    first.number_after(state.list_high_water, state.set_list_high_water)
    old = [b"k%03d" % i for i in range(4)]
    _fill(first, old)
    page, cursor = first.page("acme", "ns", 0, 2)
    assert [e.key for e in page] == old[:2] and cursor
    assert RuntimeState(path).list_high_water > cursor, "the mark is persisted before the cursor is answered"
    writes = RuntimeState(path).list_high_water
    first.page("acme", "ns", 0, 1)
    assert RuntimeState(path).list_high_water == writes, "a cursor under the mark writes nothing"

    real = time.time_ns
    monkeypatch.setattr(index_mod.time, "time_ns", lambda: real() - 3600 * 10**9)  # an hour back
    again = RuntimeState(path)
    second = BlockIndex()
    second.number_after(again.list_high_water, again.set_list_high_water)
    _fill(second, old)
    new = [b"n%03d" % i for i in range(3)]
    _fill(second, new)
    assert second.page("acme", "ns", 0, 1)[1] > cursor, "the rebuilt namespace is numbered after the old cursor"
    page, _ = second.page("acme", "ns", cursor, 100)
    assert [e.key for e in page] == old + new


def test_control_a_cursor_of_this_run_pages_on_without_repeating(monkeypatch):
    ix = BlockIndex()
    keys = [b"k%03d" % i for i in range(6)]
    _fill(ix, keys)
    page, cursor = ix.page("acme", "ns", 0, 2)
    rest, end = ix.page("acme", "ns", cursor, 100)
    assert [e.key for e in page + rest] == keys and end == 0
