"""Two more damaged first lines of the fleet journal (real files):

* this format's first line damaged into the first format's (``v2`` -> ``v1``: two bits): the entries
  after it carry their checksums, so it is read in this format, logged, and written anew with every
  record (read as the first format, the reading stopped at the first checksum, and the rewrite at open
  kept the first record only: the blocks of the others beyond erase and TTL);
* a journal holding no entry (a server that placed nothing yet, or whose records were all forgotten)
  with a few bits of its first line flipped: nothing in it is at stake, so it opens as an empty
  journal, logged, and is written anew (the start was refused, "move it away"); a file further from
  the first line is still refused.

(s32 a3: D5, D6; the other damaged first lines: test_fleet_journal_damaged_magic.py.)"""

from __future__ import annotations

import logging

import pytest

from kvtier.errors import ConfigError
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal

MAGIC = b"kvtier fleet journal v2\n"
MAGIC_V1 = b"kvtier fleet journal v1\n"


def _journal(path, n: int) -> dict[bytes, bytes]:
    records = {bytes([i]) * 32: b"record-%d" % i for i in range(n)}
    journal = FleetJournal(str(path))
    if records:
        journal.placed([(name, record, object()) for name, record in records.items()])
    journal.close()
    return records


def test_a_first_line_damaged_into_the_first_formats_keeps_every_record(tmp_path, caplog):
    path = tmp_path / JOURNAL_FILE
    records = _journal(path, 10)
    path.write_bytes(MAGIC_V1 + path.read_bytes()[len(MAGIC):])
    with caplog.at_level(logging.ERROR, logger="kvtier.server.fleet_journal"):
        journal = FleetJournal(str(path))
    assert dict(journal.records()) == records
    assert "first line is damaged" in caplog.text
    journal.close()
    assert path.read_bytes().startswith(MAGIC), "written anew with a good first line"
    assert dict(FleetJournal(str(path)).records()) == records


@pytest.mark.parametrize("bits", [[3 * 8], [0, 9, 17, 100, 150, 191]], ids=["one bit", "six bits"])
def test_an_empty_journal_with_bits_of_its_first_line_flipped_opens_empty(tmp_path, caplog, bits):
    path = tmp_path / JOURNAL_FILE
    _journal(path, 0)
    data = bytearray(path.read_bytes())
    assert bytes(data) == MAGIC
    for bit in bits:
        data[bit // 8] ^= 0x80 >> bit % 8
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="kvtier.server.fleet_journal"):
        journal = FleetJournal(str(path))
    assert journal.records() == [] and "holds no entry and its first line is damaged" in caplog.text
    journal.placed([(b"\x07" * 32, b"record-7", object())])  # appends after the good first line written anew
    journal.close()
    assert path.read_bytes().startswith(MAGIC)
    assert dict(FleetJournal(str(path)).records()) == {b"\x07" * 32: b"record-7"}


@pytest.mark.parametrize("content", [b"x" * len(MAGIC), MAGIC.replace(b"fleet", b"flaet") + b"P",
                                     b"[server]\nlisten = 1\n"],
                         ids=["another file", "damaged, a byte longer", "shorter"])
def test_a_file_further_from_an_empty_journal_is_still_refused(tmp_path, content):
    path = tmp_path / JOURNAL_FILE
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a kvtier fleet journal"):
        FleetJournal(str(path))
    assert path.read_bytes() == content, "a file refused as no journal was changed"
