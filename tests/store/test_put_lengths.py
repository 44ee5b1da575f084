"""put / put_many with ``parents`` or ``metas`` of another length than ``keys``: refused with a
ValueError before anything is stored. Zipped, a shorter list stored only the first blocks, returned
fewer statuses than keys and counted every key as put (s26 audit, D3)."""

from __future__ import annotations

import pytest

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from tests.store.test_erasure_races import HookHost, block, holds, key

KEYS = [key(i, b"lengths") for i in range(3)]
WRONG = [{"parents": [None]}, {"metas": [None]}, {"parents": [None] * 4}, {"metas": [None, None]}]


@pytest.mark.parametrize("kw", WRONG, ids=["parents-short", "metas-short", "parents-long", "metas-short2"])
def test_store_put_refuses_parents_or_metas_of_another_length(kw):
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    try:
        what = next(iter(kw))
        with pytest.raises(ValueError, match=f"3 keys but {len(kw[what])} {what}"):
            store.put(KEYS, [block(i) for i in range(3)], **kw)
        assert not any(holds(fast, k) for k in KEYS), "a refused put stored blocks"
        assert store.stats()["store"]["puts"] == 0 and store.stats()["store"]["dirty_blocks"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("kw", WRONG, ids=["parents-short", "metas-short", "parents-long", "metas-short2"])
def test_tier_put_many_refuses_parents_or_metas_of_another_length(kw):
    tier = HookHost(8, "fast")  # the contract's put_many (HostTier does not override it)
    with pytest.raises(ValueError, match="3 keys but"):
        tier.put_many(KEYS, [block(i) for i in range(3)], **kw)
    assert not any(holds(tier, k) for k in KEYS)


def test_matching_lengths_are_stored():  # the control
    store = TieredStore([HookHost(8, "fast"), HookHost(64, "slow")])
    try:
        assert store.put(KEYS, [block(i) for i in range(3)], parents=[None] * 3, metas=[None] * 3) == [Status.OK] * 3
        assert store.put([], [], parents=[], metas=[]) == []
        assert HookHost(8, "t").put_many(KEYS, [block(i) for i in range(3)], metas=[None] * 3) == [Status.OK] * 3
    finally:
        store.close()
