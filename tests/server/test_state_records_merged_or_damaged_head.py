"""Records in ``state_dir`` that a start reads back are kept whole in two more cases (real files):

* tombstones of the disk's key, kept aside by a run without the disk, merged with the state key's
  when the disk is back: past :data:`~kvtier.server.runtime_state.MAX_ERASURES` none is dropped (the
  merge was bounded without folding: the oldest went at once, and a restored copy of the blocks
  they covered would be served); the next erasure folds them instead;
* a fleet journal whose first line is damaged into the first format's AND whose first entry is
  damaged too (one bad sector over the head): the entries further on carry their checksums, so it is
  read in this format and keeps every other record (read as the first format, without checksums, the
  reading stopped at the first entry and the rewrite at open kept none of the 10).

(s32 r5: D2, D3.)"""

from __future__ import annotations

import json
import logging

from kvtier.server import runtime_state
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.server.runtime_state import RuntimeState

DISK_KEY, STATE_KEY = b"d" * 32, b"s" * 32
MAGIC = b"kvtier fleet journal v2\n"
MAGIC_V1 = b"kvtier fleet journal v1\n"
BOUND = 6  # MAX_ERASURES in these tests: the merge goes past it by one


def _nothing_held(owner: str):
    return iter(())


def test_tombstones_merged_past_the_bound_are_kept_then_folded_not_dropped(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runtime_state, "MAX_ERASURES", BOUND)
    path = str(tmp_path / "runtime.json")
    with_disk = RuntimeState(path, erasure_key=DISK_KEY)  # an earlier version, a disk: acme's sessions erased
    for s in range(BOUND):
        with_disk.record_erasure("acme", None, f"s{s}", 1000.0 + s)
    RuntimeState(path, erasure_key=STATE_KEY).record_erasure("globex", None, None, 9000.0)  # the disk dropped
    with caplog.at_level(logging.WARNING, logger="kvtier.server.runtime_state"):
        back = RuntimeState(path, erasure_key=STATE_KEY, older_erasure_keys=[DISK_KEY])  # the disk back
    assert "tombstones dropped" not in caplog.text, caplog.text
    lost = [s for s in range(BOUND) if not back.erased("acme", "chat", f"s{s}", 1000.0 + s)]
    assert lost == [], f"acme's session tombstones dropped by the merge: {lost}"
    assert back.erased("globex", "chat", "", 8999.0)
    # written anew under the state key with all of them: a start without the disk reads them all
    assert len(RuntimeState(path, erasure_key=STATE_KEY).erasures()) == BOUND + 1
    back.record_erasure("initech", None, None, 9500.0, live_blocks=_nothing_held)  # the next erasure folds
    assert len(back.erasures()) <= BOUND
    assert all(back.erased("acme", "chat", f"s{s}", 1000.0 + s) for s in range(BOUND)), "folded, none lost"
    assert "tombstones dropped" not in caplog.text
    assert len(json.loads(open(path).read())["erasures"]) <= BOUND


def _journal(path, n: int) -> dict[bytes, bytes]:
    records = {bytes([i]) * 32: b"record-%d" % i for i in range(n)}
    journal = FleetJournal(str(path))
    journal.placed([(name, record, object()) for name, record in records.items()])
    journal.close()
    return records


def test_a_head_damaged_into_the_first_formats_with_its_first_entry_keeps_the_others(tmp_path, caplog):
    path = tmp_path / JOURNAL_FILE
    records = _journal(path, 10)
    data = bytearray(MAGIC_V1 + path.read_bytes()[len(MAGIC):])
    data[len(MAGIC) + 40] ^= 0xFF  # a byte of the first entry's record: its checksum no longer matches
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="kvtier.server.fleet_journal"):
        journal = FleetJournal(str(path))
    kept = dict(journal.records())
    journal.close()
    first = next(iter(records))
    assert kept == {name: record for name, record in records.items() if name != first}, \
        f"{len(kept)} records read, {sum(records.get(n) == r for n, r in kept.items())} intact of 9"
    assert "first line is damaged" in caplog.text and "1 damaged entries skipped" in caplog.text
    assert path.read_bytes().startswith(MAGIC), "written anew with a good first line"
    assert dict(FleetJournal(str(path)).records()) == kept
