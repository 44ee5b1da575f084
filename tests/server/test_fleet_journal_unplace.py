"""A placement whose put the fleet never sent (refused before any engine call: the fleet known down)
has its record forgotten -- but only a record that placement began: one live before it (an earlier
placement of the block may have landed in the fleet) or placed again after it (that put may be sent)
stays, so no block the fleet may hold loses its record. (s31 r2 D1)"""

from __future__ import annotations

from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal

NAME, OTHER = b"\x01" * 32, b"\x02" * 32


def _reopened(path) -> set[bytes]:
    journal = FleetJournal(str(path))
    try:
        return {name for name, _ in journal.records()}
    finally:
        journal.close()


def test_the_record_an_unsent_placement_began_is_forgotten(tmp_path):
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    unsent = journal.placed([(NAME, b"record-1", object()), (OTHER, b"record-2", object())])
    journal.unplace([NAME], unsent)
    assert {name for name, _ in journal.records()} == {OTHER}
    journal.close()
    assert _reopened(tmp_path / JOURNAL_FILE) == {OTHER}


def test_a_record_live_before_the_unsent_placement_is_kept(tmp_path):
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    entry = object()
    journal.placed([(NAME, b"record-1", entry)])  # sent: the fleet holds the block
    journal.unplace([NAME], journal.placed([(NAME, b"record-1", entry)]))  # demoted again, not sent
    journal.unplace([OTHER], journal.placed([(OTHER, b"record-2", object())]))
    journal.unplace([OTHER], journal.placed([(OTHER, b"record-2b", object())]))  # (begun anew: forgotten)
    assert {name for name, _ in journal.records()} == {NAME}
    journal.close()


def test_a_record_placed_again_after_the_unsent_placement_is_kept(tmp_path):
    journal = FleetJournal(str(tmp_path / JOURNAL_FILE))
    entry = object()
    unsent = journal.placed([(NAME, b"record-1", entry)])
    journal.placed([(NAME, b"record-1", entry)])  # another demotion of the block, whose put may be sent
    journal.unplace([NAME], unsent)
    assert {name for name, _ in journal.records()} == {NAME}
    journal.close()
