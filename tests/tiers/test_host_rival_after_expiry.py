"""Two writers of one key where the first copy published has outlived the TTL when the second
commits (a promotion carrying an old block's age racing a put of the same key): the second
commit expires and frees the first copy, and the pool stays consistent -- the freed copy is not
kept as a rival reservation (which the integrity check, and so the server's admin ``check``,
reported for good as an inconsistent pool)."""

import hashlib
import time

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

BLOCK = 4096
TTL_S = 1.0
KEYS = 4


def key(i: int) -> bytes:
    return hashlib.sha256(b"rival-after-expiry" + i.to_bytes(4, "little")).digest()


def test_a_rival_committed_after_the_first_copy_expired_takes_its_place_and_the_pool_stays_consistent():
    t = HostTier(16 * BLOCK, BLOCK, ttl_s=TTL_S)
    old = time.time() - 0.8 * TTL_S  # the promoted blocks' age: near the end of their life here
    written = []
    for i in range(KEYS):
        _, promotion = t.reserve(key(i), BLOCK, created=old)
        _, put = t.reserve(key(i), BLOCK)  # a rival: the promotion is still being written
        promotion.view[:] = 1
        put.view[:] = 1
        assert t.commit(promotion)
        written.append(put)
    time.sleep(0.4 * TTL_S)  # every promoted copy is past the TTL now; the puts are young
    for put in written:
        assert t.commit(put)  # the expired copy is freed: this one is the block now
        t.check_integrity()  # failed here: "a rival reservation is not being written"
    out = np.empty(BLOCK, np.uint8)
    for i in range(KEYS):
        assert t.get(key(i), out) is Status.OK and (out == 1).all()
        assert t.delete(key(i))
    assert t.used_bytes == 0
    t.check_integrity()


def test_a_writer_still_writing_stays_the_rival_when_the_expired_copy_is_replaced():
    """A third writer of the key, still writing when the expired copy is replaced, is kept as
    the rival (its commit then finds the block published and frees its own copy)."""
    t = HostTier(16 * BLOCK, BLOCK, ttl_s=TTL_S)
    _, promotion = t.reserve(key(0), BLOCK, created=time.time() - 0.8 * TTL_S)
    _, put = t.reserve(key(0), BLOCK)
    _, late = t.reserve(key(0), BLOCK)
    for res in (promotion, put, late):
        res.view[:] = 2
    assert t.commit(promotion)
    time.sleep(0.4 * TTL_S)
    assert t.commit(put)
    t.check_integrity()
    assert t.used_bytes == 2 * BLOCK  # the block and the late writer's reservation
    assert not t.commit(late)  # the key is published: the late copy is freed
    assert t.used_bytes == BLOCK
    t.check_integrity()
