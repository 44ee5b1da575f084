"""The tenant's connection cap refusing one connection more is no outage of the tier (s32 a9 D4).

``RemoteTier`` opens a connection per concurrent caller. Where the server refused one more
(``ERROR TOO_MANY_CONNECTIONS``, "retry later": the tenant holds ``max_connections_per_tenant``
connections, some of them this tier's, working), the tier took it for a dead server: backoff, its
pooled connections closed, every thread's calls failing fast although the server was up and its
own connection fine. The call now waits, within its deadline, for one of the tier's connections
to come back to the pool. The real server, in this process (its deletions slowed to keep the
tier's connection busy); the real client; the tenant's other engine a raw connection.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.remote_wire import CallerError
from tests.server.conftest import keys_for, logged_in
from tests.server.harness import TOKENS, fresh_namespace
from tests.server.inprocess import PAGE, InProcessServer

BUSY_S = 1.0  # the tier's one connection is busy this long (a DELETE's slowed deletion)


def test_a_call_refused_a_connection_by_the_tenant_cap_uses_the_tiers_own_once_free(tmp_path):
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0)
    try:
        keys = keys_for(ns, 2)
        assert tier.put_many(keys[:1], [np.full(PAGE, 1, np.uint8)]) == [Status.OK]  # its connection: 2 of 2
        started = threading.Event()
        srv.before_deletions(lambda _: (started.set(), time.sleep(BUSY_S)))
        busy = threading.Thread(target=tier.delete_many, args=(keys[:1],))
        busy.start()
        assert started.wait(10), "the busy call did not start"
        # a second caller needs a third connection: refused, it waits for the busy one
        assert tier.put_many(keys[1:], [np.full(PAGE, 2, np.uint8)]) == [Status.OK], tier.last_error
        busy.join(10)
        assert tier.available, tier.last_error  # was: backoff, every call failing for 5 s
        assert tier.ping()
        assert tier.contains_many(keys) == [False, True]
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


def test_a_refusal_while_the_tier_holds_no_connection_is_still_a_backoff(tmp_path):
    """Other engines hold all of the tenant's connections: nothing of this tier's can come free."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-full")
    others = [logged_in(srv.url, TOKENS["acme"], ns) for _ in range(2)]
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0)
    try:
        assert not tier.ping()
        assert not tier.available and "TOO_MANY_CONNECTIONS" in tier.last_error
    finally:
        tier.close()
        for s in others:
            s.close()
        srv.stop()


# -- the holes r7 found in that wait (s32 r7 D1-D3) ---------------------------------------------------
class _Source:
    """A sealed payload's source: ``nbytes`` of ``fill``, or, ``broken``, a first piece and the
    caller's own exception (its connection is closed mid-frame)."""

    def __init__(self, fill: int, broken: bool = False) -> None:
        self.nbytes = PAGE
        self._fill, self._broken = fill, broken

    def pieces(self):
        if self._broken:
            yield memoryview(bytearray(PAGE // 4))
            raise RuntimeError("the caller's source broke")
        yield memoryview(bytearray([self._fill]) * PAGE)


class _SlowBrokenSink:
    """Takes the payload, then the caller's code takes ``BUSY_S`` and raises (a CallerError)."""

    def __init__(self, started: threading.Event) -> None:
        self.nbytes = PAGE
        self.buf = bytearray(PAGE)
        self._started = started

    def pieces(self):
        yield memoryview(self.buf)
        self._started.set()
        time.sleep(BUSY_S)
        raise RuntimeError("the caller's sink broke")


def _read_with_a_broken_sink_in_the_background(tier, key) -> threading.Thread:
    """The tier's one connection busy for ``BUSY_S`` with a read that ends in CallerError (closed, not pooled)."""
    started = threading.Event()

    def read() -> None:
        with pytest.raises(CallerError):
            tier.get_streams([key], [_SlowBrokenSink(started)])

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(10), "the read did not start"
    return reader


@pytest.mark.parametrize("timeout_s", [5.0, BUSY_S / 2], ids=["the-slot-frees-in-time", "it-does-not"])
def test_a_call_waiting_for_the_cap_connects_once_the_tiers_connection_is_closed_or_fails_on_the_record(
        tmp_path, timeout_s):
    """D1: the waiter found nothing pooled and nothing held and failed at once, silently (ERROR, no
    last_error, no stats.errors) -- although the close had just freed the slot it needed."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-closed")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0, timeout_s=timeout_s)
    try:
        keys = keys_for(ns, 2)
        assert tier.put_streams(keys[:1], [_Source(1)]) == [Status.OK]  # its connection: 2 of 2
        errors = tier.stats.errors
        reader = _read_with_a_broken_sink_in_the_background(tier, keys[0])
        put = tier.put_streams(keys[1:], [_Source(2)])  # refused a third connection: waits
        reader.join(10)
        assert tier.available, tier.last_error
        if timeout_s > BUSY_S:
            assert put == [Status.OK], tier.last_error
            assert tier.stats.errors == errors and tier.last_error is None
        else:  # the deadline passed first: this call alone fails, on the record
            assert put == [Status.ERROR]
            assert tier.stats.errors == errors + 1 and "TOO_MANY_CONNECTIONS" in tier.last_error
        assert tier.contains_many(keys) == [True, timeout_s > BUSY_S]
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


def test_a_call_that_waited_for_the_cap_and_then_timed_out_fails_alone(tmp_path):
    """D2: the wait came out of the call's deadline, and the request after it timing out backed the
    whole tier off (every thread failing fast for 5 s) with the server answering on time."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-deadline")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    # each deletion takes BUSY_S: one call alone has time for it, not after waiting for another's
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0, timeout_s=1.6 * BUSY_S)
    try:
        keys = keys_for(ns, 3)
        assert tier.put_many(keys, [np.full(PAGE, i, np.uint8) for i in range(3)]) == [Status.OK] * 3
        started = threading.Event()
        srv.before_deletions(lambda _: (started.set(), time.sleep(BUSY_S)))
        busy = threading.Thread(target=tier.delete_many, args=(keys[:1],))
        busy.start()
        assert started.wait(10), "the busy call did not start"
        assert tier.delete_many(keys[1:2]) == [False]  # waited for the busy call, then timed out
        busy.join(10)
        assert tier.available, tier.last_error
        assert "did not answer in time" in tier.last_error
        # (the server still counts the timed-out connection while it deletes: D3's wait)
        assert tier.contains_many(keys[2:]) == [True]
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


def test_a_refusal_the_tiers_own_just_closed_connection_caused_is_no_backoff(tmp_path):
    """D3: a connection the tier closed (a caller's broken source) is counted by the server until
    it has read the close; the tier, holding none, took the refusal of its next call for an outage."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-own-close")
    other_engine = srv.remote("acme", namespace=ns)  # 1 of acme's 2, busy deleting keys[0] for BUSY_S
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0)
    try:
        keys = keys_for(ns, 2)
        assert tier.put_many(keys, [np.full(PAGE, i, np.uint8) for i in range(2)]) == [Status.OK] * 2
        started = threading.Event()
        srv.before_deletions(lambda _: (started.set(), time.sleep(BUSY_S)))
        busy = threading.Thread(target=other_engine.delete_many, args=(keys[:1],))
        busy.start()
        assert started.wait(10), "the other engine's deletion did not start"
        # a put of the key under deletion waits for it on the server, which reads nothing of the
        # connection meanwhile: the close that follows is seen once the deletion is over
        with pytest.raises(CallerError):
            tier.put_streams(keys[:1], [_Source(0, broken=True)])
        assert tier.contains_many(keys[1:]) == [True], tier.last_error  # refused at first: own doing
        assert tier.available, tier.last_error
        busy.join(10)
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


def test_the_recovery_probe_refused_by_the_cap_for_the_tiers_own_connection_ends_the_outage(tmp_path):
    """D3: the probe after a backoff took a cap refusal, caused by the connection the failure had
    just closed (the server still busy on it), for one more failure: a longer backoff."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-probe")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    tier = srv.remote("acme", namespace=ns, backoff_s=0.2, max_backoff_s=5.0, timeout_s=0.3)
    try:
        keys = keys_for(ns, 2)
        assert tier.put_many(keys, [np.full(PAGE, i, np.uint8) for i in range(2)]) == [Status.OK] * 2
        srv.before_deletions(lambda _: time.sleep(2 * BUSY_S))
        started = time.monotonic()
        assert tier.delete_many(keys[:1]) == [False]  # a real timeout: backoff, its connection closed
        assert not tier.available
        time.sleep(0.25)
        tier.contains_many(keys[1:])  # fails fast, and starts the probe
        while not tier.available and time.monotonic() - started < 1.5 * BUSY_S:
            time.sleep(0.02)
        assert tier.available, tier.last_error  # was: down again, for a doubled backoff
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


# -- r8 D2: a close the server has seen frees nothing of this tier's any more -------------------------
def _take_the_freed_slot(srv, ns) -> object:
    """Another engine of the tenant connects as soon as the server has freed the tier's slot."""
    give_up = time.monotonic() + 5.0
    while True:
        try:
            return logged_in(srv.url, TOKENS["acme"], ns)
        except AssertionError:  # refused: the server has not read the tier's close yet
            assert time.monotonic() < give_up, "the server never freed the closed connection's slot"
            time.sleep(0.005)


def test_after_a_close_the_server_has_seen_a_cap_refusal_is_real_and_backs_off(tmp_path):
    """Every refusal within ``connect_timeout_s`` of any close of the tier's counted as its own doing:
    with the freed slot taken by another engine, each call retried the connect until the window or its
    deadline ran out (5 s here, the tier still up), against a cap really full. The server sees a close
    within milliseconds; from then on a refusal is real: calls fail at once and the tier backs off."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-seen-close")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0, timeout_s=3.0, connect_timeout_s=10.0)
    engines = [other_engine]
    try:
        keys = keys_for(ns, 9)
        assert tier.put_streams(keys[:1], [_Source(1)]) == [Status.OK]  # its connection: 2 of 2
        with pytest.raises(CallerError):
            tier.put_streams(keys[1:2], [_Source(1, broken=True)])  # closed: no backoff
        engines.append(_take_the_freed_slot(srv, ns))  # the cap is full with others' connections now
        took, results = [], []

        def put(key) -> None:
            started = time.monotonic()
            results.append(tier.put_streams([key], [_Source(2)])[0])
            took.append(time.monotonic() - started)

        callers = [threading.Thread(target=put, args=(k,)) for k in keys[1:]]
        for t in callers:
            t.start()
        for t in callers:
            t.join(10)
        assert results == [Status.ERROR] * len(callers)
        assert max(took) < 0.5, f"calls retried {max(took):.2f}s against a cap held by others"
        assert not tier.available and "TOO_MANY_CONNECTIONS" in tier.last_error  # backed off
    finally:
        tier.close()
        for engine in engines:
            engine.close()
        srv.stop()
