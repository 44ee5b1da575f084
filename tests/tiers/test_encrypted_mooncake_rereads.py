"""Sealed blocks that fail their tags read unhashed are read again hashed, together, and counted once:
an EncryptedTier over a MooncakeTier against a real Mooncake Store (tests/tiers/mooncake_harness.py).

The Mooncake tier reads an EncryptedTier's blocks unhashed (the AES-GCM tags are the check); a
block that fails them may be a read torn under way, so it is read again, hashed. That re-read was
made one block at a time, each with a deadline of its own (and the tier below's own re-read): N
tampered blocks (anyone with engine access can tamper) cost 2N engine round trips in series, far
past ``timeout_s``. And a torn read served on its re-read counted two hits and twice its bytes
(audit s32 a5 D2, D6)."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import both_transfer_paths, fresh_secret, make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10
TIMEOUT_S = 1.0
READS = ("batch_get_into_multi_buffers", "batch_get_into_multi_buffer_ranges")


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


@pytest.fixture
def sealed(tmp_path):
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"m" * 32), tmp_path / "keys")
    tier = EncryptedTier(make_tier(tenant="acme", secret=fresh_secret(), timeout_s=TIMEOUT_S), keyring, "acme",
                         chunk_bytes=64 * 1024)
    yield tier
    tier.close()


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


class ReadCalls:
    """The tier's real engine; each read call is counted, answers after ``delay_s``, and ``after``
    (if given) runs on what it delivered."""

    def __init__(self, engine, delay_s: float = 0.0, after=None) -> None:
        self._engine, self._delay_s, self._after = engine, delay_s, after
        self.reads = 0

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)
        if name not in READS:
            return fn

        def read(names, ptrs, lens, *rest):
            self.reads += 1
            time.sleep(self._delay_s)
            codes = fn(names, ptrs, lens, *rest)
            if self._after is not None:
                self._after(self.reads, ptrs, lens)
            return codes

        return read


def tamper(inner, name: bytes) -> None:
    """Change one payload byte of the object stored under ``name``, its header kept (the engine
    authenticates nobody)."""
    engine, storage = inner._engine, inner.storage_name(name)
    obj = bytearray(engine.get(storage))
    obj[HEADER_NBYTES + 100] ^= 1
    assert engine.remove(storage, True) == 0
    assert engine.put(storage, bytes(obj)) == 0


def test_tampered_sealed_blocks_are_read_again_in_one_batch_within_the_timeout(sealed, transfer_path):
    n = 6
    keys = [os.urandom(32) for _ in range(n)]
    datas = [block(i) for i in range(n)]
    assert sealed.put_many(keys, datas) == [Status.OK] * n
    for k in keys:
        tamper(sealed.inner, sealed._name(k))
    real = sealed.inner._engine
    sealed.inner._engine = engine = ReadCalls(real, delay_s=0.2)
    try:
        start = time.monotonic()
        statuses = sealed.get_many(keys, [np.zeros_like(d) for d in datas])
        took = time.monotonic() - start
    finally:
        sealed.inner._engine = real
    assert statuses == [Status.CORRUPT] * n
    if transfer_path == "batch calls":  # (in sessions each block is a call of its own, the calls at once)
        # the unhashed read, the hashed re-read of all six, and the tier below's own re-read of them
        assert engine.reads <= 3, f"{n} tampered blocks took {engine.reads} read calls"
    assert took < 2 * TIMEOUT_S, f"a sealed get of {n} tampered blocks took {took:.2f} s against {TIMEOUT_S} s"
    assert sealed.inner.available


def test_a_torn_sealed_read_served_on_its_re_read_counts_one_hit(sealed):
    key, data = os.urandom(32), block(7)
    assert sealed.put(key, data) is Status.OK

    def tear_the_first(reads: int, ptrs, lens) -> None:
        if reads == 1:  # its last bytes another object's, as a reuse of freed memory delivers
            ctypes.memset(ptrs[0][-1] + lens[0][-1] - 100, 0xAB, 50)

    real = sealed.inner._engine
    sealed.inner._engine = engine = ReadCalls(real, after=tear_the_first)
    hits, nbytes = sealed.inner.stats.hits, sealed.inner.stats.bytes_read
    out = np.zeros_like(data)
    try:
        statuses = sealed.get_many([key], [out])
    finally:
        sealed.inner._engine = real
    assert engine.reads == 2, "premise: the torn read was read again"
    assert statuses == [Status.OK] and np.array_equal(out, data)
    assert sealed.inner.stats.hits - hits == 1
    assert sealed.inner.stats.bytes_read - nbytes == sealed._sealed_size(BLOCK)
    assert sealed.inner.stats.verify_failures == 0
