"""A HostTier closed under its readers and writers: a read that pinned its block before close copies
it from the pool it pinned it in (not from the tier's pool, which close drops: a TypeError), later
reads miss, and a reservation committed after close publishes nothing."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"host-close" + i.to_bytes(4, "little")).digest()


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251 + 1, np.uint8)


class ClosingHost(HostTier):
    """Closes itself (as another thread would) once a reader has pinned a block, before it copies."""

    def __init__(self) -> None:
        super().__init__(8 * BLOCK, BLOCK, prefault=False)
        self.close_before_copy = False

    def _view(self, *args):
        if self.close_before_copy:
            self.close_before_copy = False
            self.close()
        return super()._view(*args)


def test_a_get_that_pinned_its_block_before_close_copies_it():
    tier = ClosingHost()
    assert tier.put(key(1), block(1)) is Status.OK
    tier.close_before_copy = True
    out = np.full(BLOCK, 0xA5, np.uint8)
    assert tier.get(key(1), out) is Status.OK  # TypeError: the pool was None
    assert np.array_equal(out, block(1))
    assert tier.get(key(1), out) is Status.MISS  # and after close: a miss


@pytest.mark.parametrize("how", ["borrow", "hold", "borrow_many", "borrow_runs"])
def test_views_taken_before_close_stay_readable(how):
    tier = ClosingHost()
    assert tier.put(key(1), block(1)) is Status.OK
    if how == "borrow":
        with tier.borrow(key(1)) as view:
            tier.close()
            assert np.array_equal(view, block(1))
    elif how == "hold":
        held = tier.hold(key(1))
        tier.close()
        assert np.array_equal(held.view, block(1))
        held.release()
    else:
        with getattr(tier, how)([key(1)], BLOCK) as views:
            tier.close()
            assert len(views) == 1 and np.array_equal(views[0], block(1))
    # after close: nothing is lent
    assert tier.hold(key(1)) is None
    with tier.borrow(key(1)) as view:
        assert view is None
    with tier.borrow_runs([key(1)], BLOCK) as runs:
        assert runs == []


def test_a_reservation_committed_after_close_publishes_nothing():
    tier = HostTier(8 * BLOCK, BLOCK, prefault=False)
    status, res = tier.reserve(key(2), BLOCK)
    assert status is Status.OK and res is not None
    res.view[:] = block(2)  # an upload still being received when the tier closes
    tier.close()
    assert tier.commit(res) is False
    assert not tier.contains(key(2))
    assert tier.get(key(2), np.empty(BLOCK, np.uint8)) is Status.MISS  # TypeError when it was published
