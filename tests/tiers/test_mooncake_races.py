"""Races on one key within one process: MooncakeTier's puts, deletes and gets of one block from
several threads (or tiers of one tenant), against a real Mooncake Store.

The contract: every method is thread safe, ERROR means the tier failed, a put is content
addressed (a put that races a delete of its key is ordered before it: OK), a read is the exact
bytes or a miss, and a delete's answer is about what it removed. Each test makes one interleaving
happen every time: the tier's engine is wrapped so that, at one point of one call, another
thread's operation runs (or is waited for); every answer is still the real engine's.

A real ``mooncake_master`` and holder processes on loopback (tests/tiers/mooncake_harness.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers.base import Status
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.mooncake_client import RC_BAD_PARAMS, RC_NOT_READY
from tests.tiers.mooncake_harness import fresh_secret, make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 256 * 1024
#: how long a hook waits for the other side of its race (old code that never gets there must not hang)
WAIT_S = 5.0


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


class Hooked:
    """A tier's real engine, with hooks run before or after chosen calls: where another thread's
    operation lands in the race under test. The engine answers every call itself."""

    def __init__(self, real) -> None:
        self.real = real
        self.before: dict[str, Callable] = {}  # call name → hook(*args)
        self.after: dict[str, Callable] = {}  # call name → hook(result, *args)

    def __getattr__(self, name: str):
        call = getattr(self.real, name)
        before, after = self.before.get(name), self.after.get(name)
        if before is None and after is None:
            return call

        def hooked(*args):
            if before is not None:
                before(*args)
            result = call(*args)
            if after is not None:
                after(result, *args)
            return result

        return hooked


def once(hook: Callable) -> Callable:
    """``hook`` on its first call only (the race happens once; the tier's own retries run plain)."""
    done = threading.Event()

    def first(*args):
        if not done.is_set():
            done.set()
            hook(*args)

    return first


def first_calls(times: int, hook: Callable) -> Callable:
    """``hook`` on the first ``times`` calls but those it makes itself (they, and the calls after
    the last, run plain)."""
    left, running = [times], threading.Event()

    def call(*args):
        if left[0] and not running.is_set():
            left[0] -= 1
            running.set()
            try:
                hook(*args)
            finally:
                running.clear()

    return call


@pytest.fixture
def secret() -> bytes:
    return fresh_secret()


@pytest.fixture
def tier(secret):
    t = make_tier(secret=secret, timeout_s=10.0)
    real = t._engine
    t._engine = Hooked(real)
    yield t
    t._engine = real
    t.close()


@pytest.fixture
def other(secret):
    """Another tier of the same tenant in this process (its engine unwrapped): as another process
    of the tenant, it shares the blocks but not this tier's memory of what it removed."""
    t = make_tier(secret=secret, timeout_s=10.0)
    yield t
    t.close()


@pytest.fixture
def sessions(monkeypatch) -> None:
    """Small blocks move in put and get sessions (the path of blocks of 2 MiB and more)."""
    monkeypatch.setattr(MooncakeTier, "_session_min_bytes", 1)


# -- a put racing a delete of its block ------------------------------------------------------------
@pytest.mark.parametrize("path", ["batch calls", "sessions"])
def test_a_put_whose_block_a_delete_removes_each_time_it_lands_is_ok_not_an_error(tier, other, path,
                                                                                     monkeypatch):
    """The engine took the block (a batch put's 0; a session's -705: the name held it), then a
    delete removed it before the put confirmed it, in both of the put's rounds. The put is ordered
    before the delete: OK, and no put failure counted (an ERROR here was the CI flake of
    test_contract.py's eviction race, and its stats counted failures that never happened)."""
    monkeypatch.setattr(MooncakeTier, "_session_min_bytes", 1 << 40 if path == "batch calls" else 1)
    k, data = key(1), block(1)
    if path == "batch calls":
        tier._engine.after["batch_put_from_multi_buffers"] = lambda codes, *args: tier.delete(k)
    else:  # another process's put of the block lands first (-705), then the delete
        tier._engine.before["batch_put_session_start"] = lambda *args: other.put(k, data)
        tier._engine.after["batch_put_session_start"] = lambda codes, *args: tier.delete(k)
    assert tier.put(k, data) is Status.OK
    assert tier.stats.deletes == 2, "premise: the block vanished after each of the put's two rounds"
    assert (tier.stats.puts, tier.stats.put_failures, tier.stats.bytes_written) == (1, 0, BLOCK)
    tier._engine.before.clear()
    tier._engine.after.clear()
    out = np.zeros_like(data)
    assert tier.get(k, out) is Status.MISS  # the delete came after the put
    assert tier.put(k, data) is Status.OK and tier.get(k, out) is Status.OK and np.array_equal(out, data)


# -- two puts of one block from one process --------------------------------------------------------
def test_a_put_while_this_process_has_a_put_session_of_the_block_open_waits_for_it(tier, sessions):
    """Two requests of one engine save the same prefix: the second put session's start of the name
    answers -600 (this process's client already holds its reservation), which is another writer
    under way, waited for like any other: both puts OK, the block stored once."""
    k, data = key(2), block(2)
    reserved, second_waits = threading.Event(), threading.Event()

    def first_writes(*args):
        reserved.set()
        second_waits.wait(WAIT_S)  # the first put stays unpublished until the second waits on it

    tier._engine.before["batch_put_from_multi_buffer_ranges"] = once(first_writes)
    tier._engine.after["get_size"] = lambda size, *args: size == RC_NOT_READY and second_waits.set()
    first: dict[str, Status] = {}
    writer = threading.Thread(target=lambda: first.setdefault("put", tier.put(k, data)))
    writer.start()
    assert reserved.wait(WAIT_S)
    second = tier.put(k, data)
    writer.join(2 * WAIT_S)
    assert (first["put"], second) == (Status.OK, Status.OK)
    assert second_waits.is_set(), "premise: the second put found the first one's reservation"
    out = np.zeros_like(data)
    assert tier.get(k, out) is Status.OK and np.array_equal(out, data)


# -- a get torn by a delete -------------------------------------------------------------------------
def _replica_at(tier, name: str):
    """(holder, address) of the object under ``name``, or None."""
    for r in tier._engine.batch_get_replica_desc([name]).get(name, []):
        if r.is_memory_replica():
            b = r.get_memory_descriptor().buffer_descriptor
            return b.transport_endpoint, b.buffer_address
    return None


def _tear_under_read(deleter, reader, k: int, data: np.ndarray, fillers: list[bytes]) -> Callable:
    """A hook for the end of a get session's start (the reader holds the object's address): the
    ``deleter`` tier deletes the block, other blocks are put until one lands where it was (what a
    busy fleet does at once), and the block is put again (elsewhere). The read then transfers
    another block's bytes; the key holds a valid block again."""

    def tear(codes, names):
        home = _replica_at(reader, names[0])
        assert deleter.delete(key(k)) is True
        for j in range(64):
            fillers.append(key(1000 + j))
            assert deleter.put(fillers[-1], block(1000 + j)) is Status.OK
            if _replica_at(reader, deleter.storage_name(fillers[-1])) == home:
                break
        else:
            pytest.fail("premise: no later put reused the deleted block's memory")
        assert deleter.put(key(k), data) is Status.OK

    return tear


def test_a_read_torn_by_this_tiers_own_delete_is_a_miss_and_removes_nothing(tier, sessions):
    """The tier's delete is forced: it breaks the lease of a read under way in another thread, and
    the freed memory holds another block by the time the read transfers it. Nobody tampered with
    anything: a MISS (no verification failure counted), and the name, which a later put filled
    with a valid block (OK), keeps that block (a CORRUPT verdict removed it with the torn read)."""
    k, data = 3, block(3)
    assert tier.put(key(k), data) is Status.OK
    fillers: list[bytes] = []
    tier._engine.after["batch_get_session_start"] = once(_tear_under_read(tier, tier, k, data, fillers))
    out = np.zeros_like(data)
    assert tier.get(key(k), out) is Status.MISS
    assert tier.stats.verify_failures == 0
    out[:] = 0
    assert tier.get(key(k), out) is Status.OK and np.array_equal(out, data), \
        "the block a put stored after the delete was removed"
    tier.delete_many(fillers)


def test_a_read_torn_by_another_processs_delete_is_read_again(tier, other, sessions):
    """The same tear, by a delete of another process of the tenant (this tier did not remove the
    name): the object is read once more before it is judged, and the block put since is served."""
    k, data = 4, block(4)
    assert tier.put(key(k), data) is Status.OK
    fillers: list[bytes] = []
    tier._engine.after["batch_get_session_start"] = once(_tear_under_read(other, tier, k, data, fillers))
    out = np.zeros_like(data)
    assert tier.get(key(k), out) is Status.OK and np.array_equal(out, data)
    assert tier.stats.verify_failures == 0
    assert other.get(key(k), out) is Status.OK and np.array_equal(out, data)
    other.delete_many(fillers)


# -- a delete meeting an unfinished put ----------------------------------------------------------------
def test_a_delete_that_meets_an_unfinished_put_neither_hides_nor_later_removes_its_block(tier, sessions):
    """The delete's forced remove finds only the put's reservation (-703: nothing complete to
    remove), the put publishes, then the delete's answer reaches the tier. The delete is ordered
    before the put: the block stays readable, now and after later deletes retry what is owed."""
    k, data = key(5), block(5)
    reserved, removed, put_done = threading.Event(), threading.Event(), threading.Event()
    answers = []

    def put_writes(*args):
        reserved.set()
        removed.wait(WAIT_S)

    def delete_answered(codes, *args):
        answers.extend(codes)
        removed.set()
        put_done.wait(WAIT_S)

    tier._engine.before["batch_put_from_multi_buffer_ranges"] = once(put_writes)
    tier._engine.after["batch_remove"] = once(delete_answered)
    deleted: dict[str, bool] = {}

    def deleter():
        reserved.wait(WAIT_S)
        deleted["delete"] = tier.delete(k)

    thread = threading.Thread(target=deleter)
    thread.start()
    put = tier.put(k, data)
    put_done.set()
    thread.join(2 * WAIT_S)
    assert answers == [RC_NOT_READY], "premise: the delete met the put's reservation"
    assert (put, deleted["delete"]) == (Status.OK, False)
    out = np.zeros_like(data)
    assert tier.contains(k) and tier.get(k, out) is Status.OK and np.array_equal(out, data)
    time.sleep(1.1)  # owed removals are retried at most once a second, on a delete or a put
    assert tier.delete(key(6)) is False
    out[:] = 0
    assert tier.contains(k) and tier.get(k, out) is Status.OK and np.array_equal(out, data)


# -- a get whose session another read of the name dropped ------------------------------------------------
def _drop_session_under_read(tier, k: bytes, data: np.ndarray) -> Callable:
    """A hook for the end of a get session's start: the block is deleted, another read of it (a
    request of this process: the same engine client, whose get sessions the reads of a name share)
    starts a session of the name, which the engine refuses (-704) and so drops this client's
    session of the name, and the block is put again, at its size. The read's ranged call then
    answers -600, though the name holds the block."""

    def drop(codes, names):
        assert tier.delete(k) is True
        assert tier.get(k, np.zeros_like(data)) is Status.MISS
        assert tier.put(k, data) is Status.OK

    return drop


def test_a_read_whose_session_another_read_dropped_is_read_again(tier, sessions):
    """Nothing failed: the name was removed and stored again while the read held its session. The
    read is made once more, in a session of its own, and serves the block put since."""
    k, data = key(7), block(7)
    assert tier.put(k, data) is Status.OK
    answers: list[int] = []
    tier._engine.after["batch_get_session_start"] = first_calls(1, _drop_session_under_read(tier, k, data))
    tier._engine.after["batch_get_into_multi_buffer_ranges"] = lambda codes, *args: answers.extend(codes)
    out = np.zeros_like(data)
    assert tier.get(k, out) is Status.OK and np.array_equal(out, data)
    assert answers == [RC_BAD_PARAMS, HEADER_NBYTES + BLOCK], \
        "premise: the first ranged read answered -600, the second read the block whole"
    assert (tier.stats.errors, tier.stats.verify_failures) == (0, 0)


def test_a_read_whose_session_is_dropped_again_when_read_again_is_a_miss_and_removes_nothing(tier, sessions):
    """The same race twice: the read made again loses its session too. Read once more only: a MISS
    (not an ERROR: the tier did not fail; not CORRUPT: no object failed verification), and the name
    keeps the block the last put stored."""
    k, data = key(8), block(8)
    assert tier.put(k, data) is Status.OK
    answers: list[int] = []
    tier._engine.after["batch_get_session_start"] = first_calls(2, _drop_session_under_read(tier, k, data))
    tier._engine.after["batch_get_into_multi_buffer_ranges"] = lambda codes, *args: answers.extend(codes)
    out = np.zeros_like(data)
    assert tier.get(k, out) is Status.MISS
    assert answers == [RC_BAD_PARAMS, RC_BAD_PARAMS], "premise: both ranged reads answered -600"
    assert (tier.stats.errors, tier.stats.verify_failures) == (0, 0)
    assert not out.any(), "a miss writes nothing into the caller's buffer"
    assert tier.get(k, out) is Status.OK and np.array_equal(out, data)
