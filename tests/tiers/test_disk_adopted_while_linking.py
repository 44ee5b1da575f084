"""A lookup on another thread between a ``put_many``'s links and its settle (s31 a3 D6).

``_link_all`` runs outside the lock: a ``lookup_prefix`` / ``contains`` / ``get`` of those keys on
another thread (the scheduler looking up the prefix a save is writing) adopts them, making an
extent entry for the new extent. The settle then put a second one at the same name and forgot the
adopted entries, and when the first one's last block went, it dropped the *second* from the
tier's table: the blocks stayed indexed in an extent the tier did not count (``check_integrity``:
"unknown extent"), and each one erased later kept its bytes in ``used_bytes``. Now the settle takes
the adopted extent, and an extent drops only itself from the table.

The interleaving is forced: the tier's ``_link_all`` runs a look-up on another thread once the names
are linked (the thread is real; only its timing is pinned).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier

NB = 16384
ON_DISK = 4096 + NB


def k(i: int) -> bytes:
    return bytes([i]) * 32


def data(i: int) -> np.ndarray:
    return np.full(NB, i, np.uint8)


def _looked_up_on_another_thread_once_linked(tier: DiskTier, look) -> list:
    real = tier._link_all
    seen = []

    def link_then_look(rel, keys):
        failures = real(rel, keys)
        other = threading.Thread(target=lambda: seen.append(look(tier)))
        other.start()
        other.join()
        return failures

    tier._link_all = link_then_look
    return seen


@pytest.mark.parametrize("look", [
    lambda t: t.lookup_prefix([k(1), k(2), k(3)]),
    lambda t: [t.contains(k(i)) for i in (1, 2, 3)],
], ids=["lookup_prefix", "contains"])
def test_blocks_adopted_while_their_names_are_linked_stay_counted(tmp_path, look):
    with DiskTier(tmp_path, 1 << 26, direct_io=False) as tier:
        seen = _looked_up_on_another_thread_once_linked(tier, look)
        assert tier.put_many([k(1), k(2), k(3)], [data(1), data(2), data(3)]) == [Status.OK] * 3
        assert seen and seen[0] in (3, [True] * 3)  # the other thread found them all (adopted)
        tier.check_integrity(deep=True)
        assert tier.used_bytes == 3 * ON_DISK
        assert tier.delete(k(1))  # erased in place: its bytes are free
        assert tier.used_bytes == 2 * ON_DISK
        tier.check_integrity(deep=True)
        for i in (2, 3):
            out = np.empty(NB, np.uint8)
            assert tier.get(k(i), out) is Status.OK and np.array_equal(out, data(i))
        assert tier.delete(k(2)) and tier.delete(k(3))
        assert tier.used_bytes == 0
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # the extent went with its last block
        tier.check_integrity()
