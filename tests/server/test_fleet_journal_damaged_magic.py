"""The fleet journal's first line damaged (a flipped bit in the file's first sector): every entry after it
carries its own checksum, so the start goes on with every record, logged, and the file is written anew
with a good first line, also when the damage reaches the first entries (whole ones after them are kept);
a file with no whole entry after its first line is still refused. (s31 a2 D4, r2 D4)"""

from __future__ import annotations

import logging

import pytest

from kvtier.errors import ConfigError
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal

MAGIC = b"kvtier fleet journal v2\n"


def _journal_of_three(path) -> dict[bytes, bytes]:
    records = {bytes([i]) * 32: b"record-%d" % i for i in range(3)}
    journal = FleetJournal(str(path))
    journal.placed([(name, record, object()) for name, record in records.items()])
    journal.close()
    return records


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("at", [0, 7, len(MAGIC) - 1])
def test_a_bit_flipped_in_the_first_line_keeps_every_record_and_is_written_anew(tmp_path, caplog, at):
    path = tmp_path / JOURNAL_FILE
    records = _journal_of_three(path)
    _flip(path, at)
    with caplog.at_level(logging.ERROR, logger="kvtier.server.fleet_journal"):
        journal = FleetJournal(str(path))
    assert dict(journal.records()) == records
    assert "first line is damaged" in caplog.text
    assert path.read_bytes().startswith(MAGIC), "the damaged first line is still in the file"
    journal.placed([(b"\x09" * 32, b"record-9", object())])  # appends after the good first line read back
    journal.close()
    assert dict(FleetJournal(str(path)).records()) == {**records, b"\x09" * 32: b"record-9"}


def test_a_damaged_first_line_and_first_entry_keep_the_whole_entries_after_them(tmp_path, caplog):
    """One bad sector covers the first line and the first entry: the whole entries after them are read
    (the damaged one skipped, logged), not a refused start that would lose every record."""
    path = tmp_path / JOURNAL_FILE
    records = _journal_of_three(path)
    _flip(path, 3)
    _flip(path, len(MAGIC) + 5)  # the first entry's name: its checksum no longer matches
    with caplog.at_level(logging.ERROR, logger="kvtier.server.fleet_journal"):
        journal = FleetJournal(str(path))
    assert dict(journal.records()) == {name: r for name, r in records.items() if name != bytes([0]) * 32}
    assert "first line is damaged" in caplog.text and "1 damaged entries skipped" in caplog.text
    journal.close()
    assert path.read_bytes().startswith(MAGIC), "the damaged first line is still in the file"


def test_a_damaged_first_line_with_no_whole_entry_after_it_is_refused(tmp_path):
    path = tmp_path / JOURNAL_FILE
    journal = FleetJournal(str(path))
    journal.placed([(bytes(32), b"record-0", object())])
    journal.close()
    _flip(path, 3)
    _flip(path, len(MAGIC) + 5)  # the only entry's name: its checksum no longer matches
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="not a kvtier fleet journal"):
        FleetJournal(str(path))
    assert path.read_bytes() == before, "a file refused as no journal was changed"
