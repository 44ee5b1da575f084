"""The disk tier verifies a request's blocks at once (``DiskReads._verified_whole``): the header
fields, the header's own check, each record's check and each payload's xxh3 checked together
rather than a header object built per block. It must accept exactly what the one-block path
(``DiskReads._judge_read``) accepts.

The damages here keep each header's own check valid (re-computed after the change), as a writer
with a bug or someone who knows the format would leave it: only the field checks can refuse them.
Each is read twice, by ``get_many`` (the batch path) on one tier and by ``get`` (one block at a
time, never the batch path) on a twin tier holding the same bytes, and both must agree.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvtier.core.payload import _BODY, _CHECK, FLAG_SEALED, HEADER_NBYTES
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_reads import DiskReads
from kvtier.tiers.disk_records import _RECORD, _RECORD_CHECK_NBYTES, BlockRecord
from tests.tiers.test_disk_extents import NB, data, k, poisoned, put_chain, read_all

# _BODY's fields: magic, version, flags, key, payload size, tokens, dtype, ndim, shape x6, checksum, created
HEADER_FORGERIES = {
    "unchanged": lambda f: None,  # the positive control: re-packed as it was, it must still be served
    "magic": lambda f: f.__setitem__(0, b"KVTX"),
    "version": lambda f: f.__setitem__(1, f[1] + 1),
    "sealed": lambda f: f.__setitem__(2, f[2] | FLAG_SEALED),
    "key": lambda f: f.__setitem__(3, k(99)),
    "size": lambda f: f.__setitem__(4, f[4] - PAGE),
    "ndim": lambda f: f.__setitem__(7, 7),
    "checksum": lambda f: f.__setitem__(14, bytes(16)),
}
# the record after the header: magic, has parent, parent, annotation length (then the annotation, a check)
RECORD_FORGERIES = {
    "unchanged": lambda r: None,
    "magic": lambda r: r.__setitem__(0, b"KVR2"),
    "has-parent": lambda r: r.__setitem__(1, 2),
    "parent": lambda r: r.__setitem__(2, k(77)),
    "length": lambda r: r.__setitem__(3, r[3] + 1),
}


def _page(tier: DiskTier, i: int) -> tuple[str, int, bytearray]:
    path, base = tier.locate(k(i))
    with open(path, "rb") as f:
        f.seek(base)
        return path, base, bytearray(f.read(PAGE))


def _write(path: str, base: int, page: bytearray) -> None:
    with open(path, "r+b") as f:
        f.seek(base)
        f.write(page)


def forge_header(tier: DiskTier, i: int, change) -> None:
    """Change block ``i``'s header fields and re-compute the header's own check."""
    path, base, page = _page(tier, i)
    fields = list(_BODY.unpack_from(page))
    change(fields)
    body = _BODY.pack(*fields)
    page[: HEADER_NBYTES] = body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    _write(path, base, page)


def forge_record(tier: DiskTier, i: int, change, *, resign: bool) -> None:
    """Change block ``i``'s record; with ``resign`` its check is re-computed (as a writer with a bug
    would leave it), else the old check stays."""
    path, base, page = _page(tier, i)
    fields = list(_RECORD.unpack_from(page, HEADER_NBYTES))
    length = fields[3]
    change(fields)
    head = _RECORD.pack(*fields)
    end = HEADER_NBYTES + _RECORD.size + length
    page[HEADER_NBYTES : HEADER_NBYTES + _RECORD.size] = head
    if resign:
        annotation = bytes(page[HEADER_NBYTES + _RECORD.size : end])
        page[end : end + _RECORD_CHECK_NBYTES] = xxhash.xxh3_128_digest(k(i) + head + annotation)
    _write(path, base, page)


def twins(tmp_path, annotator=None) -> tuple[DiskTier, DiskTier]:
    a, b = DiskTier(tmp_path / "batch", 1 << 30), DiskTier(tmp_path / "single", 1 << 30)
    for tier in (a, b):
        tier.annotator = annotator
        assert put_chain(tier, range(6)) == [Status.OK] * 6
    return a, b


def both_ways(a: DiskTier, b: DiskTier) -> tuple[list[Status], list[Status], list[np.ndarray]]:
    """Statuses of the six blocks read by get_many on ``a`` and by get, one by one, on ``b``."""
    batch, outs = read_all(a, range(6))
    single = [b.get(k(i), poisoned()) for i in range(6)]
    return batch, single, outs


@pytest.mark.parametrize("forgery", list(HEADER_FORGERIES))
def test_a_forged_header_is_judged_alike_by_the_batch_and_the_single_read(tmp_path, forgery):
    a, b = twins(tmp_path)
    for tier in (a, b):
        forge_header(tier, 3, HEADER_FORGERIES[forgery])
    batch, single, outs = both_ways(a, b)
    assert batch == single
    if forgery == "unchanged":
        assert batch == [Status.OK] * 6
    else:
        assert batch[3] is not Status.OK and batch[:3] + batch[4:] == [Status.OK] * 5
    assert all(np.array_equal(outs[i], data(i)) for i in range(6) if batch[i] is Status.OK)
    a.close(), b.close()


@pytest.mark.parametrize("resign", [True, False])
@pytest.mark.parametrize("forgery", list(RECORD_FORGERIES))
def test_a_forged_record_is_judged_alike_by_the_batch_and_the_single_read(tmp_path, forgery, resign):
    a, b = twins(tmp_path)
    for tier in (a, b):
        forge_record(tier, 3, RECORD_FORGERIES[forgery], resign=resign)
    batch, single, _ = both_ways(a, b)
    assert batch == single
    if forgery == "unchanged" or (forgery == "parent" and resign):  # a re-signed parent link is a record
        assert batch == [Status.OK] * 6
    else:
        assert batch[3] is not Status.OK and batch[:3] + batch[4:] == [Status.OK] * 5
    a.close(), b.close()


@pytest.mark.parametrize("lengths", ["equal", "unequal"])
def test_annotated_blocks_verify_in_a_batch_and_a_changed_annotation_is_caught(tmp_path, lengths):
    """Records with annotations: all of one length (checked together) or of several (one by one)."""
    def annotator(key: bytes) -> BlockRecord:
        n = 24 if lengths == "equal" else 8 + key[-1] * 5
        return BlockRecord(None, bytes([key[-1]]) * n)

    a, b = twins(tmp_path, annotator)
    batch, single, outs = both_ways(a, b)
    assert batch == single == [Status.OK] * 6  # the positive control
    assert all(np.array_equal(outs[i], data(i)) for i in range(6))
    for tier in (a, b):
        path, base, page = _page(tier, 2)
        page[HEADER_NBYTES + _RECORD.size + 3] ^= 0xFF  # one annotation byte, its check left as it was
        _write(path, base, page)
    batch, single, _ = both_ways(a, b)
    assert batch == single
    assert batch[2] is not Status.OK and batch[:2] + batch[3:] == [Status.OK] * 5
    a.close(), b.close()


def test_whole_blocks_that_verify_never_take_the_one_block_path(tmp_path, monkeypatch):
    """The batch path is what serves: with the one-block judge broken, a clean extent still reads;
    a damaged block (the control) does reach it."""
    a, _ = twins(tmp_path)

    def broken(*args):
        raise AssertionError("the one-block judge ran")

    monkeypatch.setattr(DiskReads, "_judge_read", broken)
    statuses, outs = read_all(a, range(6))
    assert statuses == [Status.OK] * 6
    assert all(np.array_equal(outs[i], data(i)) for i in range(6))
    assert a.stats.hits == 6 and a.stats.bytes_read == 6 * NB
    forge_header(a, 4, HEADER_FORGERIES["checksum"])
    with pytest.raises(AssertionError, match="one-block judge"):
        read_all(a, range(6))
    a.close()


def test_the_record_layout_these_forgeries_assume():
    # magic, has parent, pad, parent, annotation length, pad: the offsets records_ok reads
    assert _RECORD.format == "<4sB3x32sH2x" and struct.calcsize(_RECORD.format) == 44
