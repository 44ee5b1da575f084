"""One deadline per RemoteTier call, a minimum rate for large ones, and replies bounded by their request.

Against a real misbehaving peer (:mod:`tests.server.faulty_peer`: real sockets, kvtier's own
frames) and, as the positive control, a real ``kvtier serve``.
"""

from __future__ import annotations

import os
import resource
import time
import tracemalloc

import numpy as np
import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import block, keys_for, remote
from tests.server.faulty_peer import FaultyPeer, payload_for

TIMEOUT_S = 0.5
SLACK_S = 0.5  #: the issue's bound: a call returns within timeout_s + 0.5 s
N_BLOCKS = 64
BLOCK = 64 * 1024


def _tier(peer: FaultyPeer, **kw) -> RemoteTier:
    kw = {"timeout_s": TIMEOUT_S, "connect_timeout_s": TIMEOUT_S, "backoff_s": 0.01, "max_backoff_s": 0.01, **kw}
    return RemoteTier(peer.url, "t", **kw)


def _outs(n: int = N_BLOCKS, nbytes: int = BLOCK) -> list[np.ndarray]:
    return [np.full(nbytes, 0xAB, np.uint8) for _ in range(n)]


def _wait_for(pred, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# Each block's reply comes `delay_s` after the one before: every block alone is "in time", which
# a per-block timeout lets through for the whole batch (64 x 0.3 s = 19 s before this rule).
@pytest.mark.parametrize("mode, delay_s", [("stall", 0), ("slow_blocks", 0.3), ("drip", 0.1)])
def test_a_get_of_64_blocks_from_a_stalling_server_returns_within_timeout(mode, delay_s):
    keys = keys_for(f"bounded-{mode}", N_BLOCKS)
    with FaultyPeer(mode, delay_s=delay_s) as peer:
        tier = _tier(peer)
        outs = _outs()
        t0 = time.monotonic()
        statuses = tier.get_many(keys, outs)
        elapsed = time.monotonic() - t0
        assert elapsed < TIMEOUT_S + SLACK_S, f"{mode}: get of {N_BLOCKS} blocks took {elapsed:.2f} s"
        hits = [i for i, s in enumerate(statuses) if s is Status.OK]
        # what arrived before the deadline is a verified hit; the rest are misses (ERROR)
        assert hits == list(range(len(hits))) and len(hits) <= 2, statuses
        assert all(s is Status.ERROR for s in statuses[len(hits):])
        for i in hits:
            assert outs[i].tobytes() == payload_for(keys[i], BLOCK)
        # the connection was discarded mid-frame, not pooled: the peer sees it closed
        assert _wait_for(lambda: peer.closed_by_client >= 1), "the timed-out connection was not closed"
        assert tier.stats.errors >= 1 and "TimeoutError" in (tier.last_error or "")
        tier.close()


@pytest.mark.parametrize("op", ["put_many", "lookup_prefix", "contains_many", "get_streams"])
def test_every_kind_of_call_is_bounded_by_one_deadline(op, tmp_path):
    keys = keys_for(f"bounded-{op}", N_BLOCKS)
    with FaultyPeer("slow_blocks" if op == "get_streams" else "stall", delay_s=0.3) as peer:
        tier = _tier(peer)
        sealed = EncryptedTier(tier, Keyring(StaticMasterKey(os.urandom(32)), tmp_path), "acme", streams=1)
        if op == "get_streams":
            assert tier.streams_available()  # (a PING, answered late: not part of the timed call)
        t0 = time.monotonic()
        if op == "put_many":
            statuses = tier.put_many(keys, [block(k, BLOCK) for k in keys])
            assert Status.OK not in statuses
        elif op == "lookup_prefix":
            assert tier.lookup_prefix(keys) == 0
        elif op == "contains_many":
            assert tier.contains_many(keys) == [False] * N_BLOCKS
        else:  # sealed streams, through an encrypted tier (one lane: one call)
            statuses = sealed.get_many(keys, _outs())
            assert Status.OK not in statuses
        elapsed = time.monotonic() - t0
        assert elapsed < TIMEOUT_S + SLACK_S, f"{op} took {elapsed:.2f} s"
        tier.close()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@pytest.mark.parametrize("call", ["get", "get_streams", "contains", "lookup", "keys", "hello"])
def test_a_reply_announcing_1gib_is_a_miss_with_nothing_allocated(call, tmp_path):
    key = keys_for(f"huge-{call}", 1)[0]
    with FaultyPeer("huge_hello" if call == "hello" else "huge") as peer:
        tier = _tier(peer, timeout_s=5.0, connect_timeout_s=5.0)
        out = np.zeros(BLOCK, np.uint8)
        sealed = EncryptedTier(tier, Keyring(StaticMasterKey(os.urandom(32)), tmp_path), "acme", streams=1)
        if call == "get_streams":
            assert tier.streams_available()  # learnt from HELLO (its PING fails on the huge reply)
            time.sleep(0.05)  # past the backoff that failure started
            assert tier.contains(key) is False  # down: at once, and a reconnection starts on its own thread
            assert _wait_for(lambda: tier.available)  # the peer answers HELLO: up again
        closed_before = peer.closed_by_client
        rss0 = _peak_rss_bytes()
        tracemalloc.start()
        try:
            t0 = time.monotonic()
            if call in ("get", "hello"):
                result = tier.get(key, out)
                assert result is Status.ERROR
            elif call == "get_streams":
                result = sealed.get(key, out)
                assert result is not Status.OK
            elif call == "contains":
                assert tier.contains(key) is False
            elif call == "lookup":
                assert tier.lookup_prefix([key]) == 0
            else:
                assert list(tier.keys()) == []
            elapsed = time.monotonic() - t0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{call}: {peak / 2**20:.0f} MiB allocated for a reply announcing 1 GiB"
        assert _peak_rss_bytes() - rss0 < 64 << 20
        # refused on its header, not after waiting for the gigabyte: long before the 5 s deadline
        assert elapsed < 1.0, f"{call}: took {elapsed:.2f} s"
        assert "BAD_LENGTH" in (tier.last_error or "") or "announces" in (tier.last_error or ""), tier.last_error
        assert _wait_for(lambda: peer.closed_by_client > closed_before), "the connection was kept after a protocol error"
        tier.close()


def test_a_large_transfer_may_take_its_size_at_the_minimum_rate():
    """8 blocks of 128 KiB sent at 2 MB/s take ~0.5 s: longer than timeout_s = 0.2 s, well inside
    1 MiB / (1 MB/s); the same call with a 10 MB/s floor (0.2 s allowed) gets only what came in time."""
    nbytes, n = 128 << 10, 8
    keys = keys_for("rate", n)
    with FaultyPeer("rate", rate=2e6) as peer:
        slow_ok = _tier(peer, timeout_s=0.2, min_rate_bytes_s=1e6)
        outs = _outs(n, nbytes)
        assert slow_ok.get_many(keys, outs) == [Status.OK] * n
        assert all(o.tobytes() == payload_for(k, nbytes) for k, o in zip(keys, outs))
        too_slow = _tier(peer, timeout_s=0.2, min_rate_bytes_s=1e7)
        t0 = time.monotonic()
        statuses = too_slow.get_many(keys, _outs(n, nbytes))
        assert time.monotonic() - t0 < 0.2 + SLACK_S
        assert statuses.count(Status.OK) < n and statuses[-1] is Status.ERROR
        slow_ok.close()
        too_slow.close()


def test_positive_control_a_real_server_answers_the_same_calls_in_time(server):
    tier = remote(server, "acme", timeout_s=TIMEOUT_S)
    keys = keys_for("bounded-control", N_BLOCKS)
    datas = [block(k, BLOCK) for k in keys]
    assert tier.put_many(keys, datas) == [Status.OK] * N_BLOCKS
    outs = _outs()
    t0 = time.monotonic()
    assert tier.get_many(keys, outs) == [Status.OK] * N_BLOCKS
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert all(np.array_equal(o, d) for o, d in zip(outs, datas))
    assert tier.lookup_prefix(keys) == N_BLOCKS and all(tier.contains_many(keys))
    assert sorted(tier.keys()) == sorted(keys)
    assert tier.stats.errors == 0
    tier.close()


# -- the name lookup of a new connection -------------------------------------------------------
def _slow_lookups(monkeypatch, delay_s: float, name: str = "localhost") -> list[str]:
    """``getaddrinfo`` of ``name`` takes ``delay_s``, as a resolver whose DNS server does not
    answer does (5 s per try by default); returns the names looked up, as they start."""
    import socket

    real = socket.getaddrinfo
    asked: list[str] = []

    def slow(host, *args, **kw):
        asked.append(host)
        if host == name:
            time.sleep(delay_s)
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    return asked


def test_a_slow_name_lookup_is_bounded_by_the_calls_deadline(server, monkeypatch):
    """socket.create_connection looked the name up before any timeout applied: a get with
    timeout_s=1 took 3 s, and a load in an engine's forward step (bounded_reads) with it."""
    from kvtier.tiers import remote_wire

    port = int(server.tcp_url.rsplit(":", 1)[1])
    asked = _slow_lookups(monkeypatch, 1.5)
    tier = RemoteTier(f"tcp://localhost:{port}", "acme-token-1", namespace="dns", timeout_s=1.0,
                      connect_timeout_s=0.5, backoff_s=0.01, max_backoff_s=0.01)
    t0 = time.monotonic()
    assert tier.get(keys_for("dns", 1)[0], np.empty(4096, np.uint8)) is not Status.OK
    took = time.monotonic() - t0
    assert took < 0.5 + SLACK_S, f"get with connect_timeout_s=0.5 took {took:.1f} s (the name lookup is not bounded)"
    assert "timeout" in (tier.last_error or "").lower() or "took longer" in (tier.last_error or ""), tier.last_error
    # Calls meanwhile wait for the one look-up under way: a silent DNS server costs one thread.
    time.sleep(0.05)
    for _ in range(3):
        assert tier.contains_many(keys_for("dns", 1)) == [False]
        time.sleep(0.02)
    tier.close()
    assert asked.count("localhost") == 1, asked
    assert _wait_for(lambda: not remote_wire._lookups, timeout=3.0)  # it ends on its own (and the next test)


def test_a_name_that_resolves_in_time_and_an_address_literal_connect(server, monkeypatch):
    """Controls: a lookup that ends within the deadline connects; an address literal asks no name
    service (a slow one does not matter to it)."""
    port = int(server.tcp_url.rsplit(":", 1)[1])
    asked = _slow_lookups(monkeypatch, 0.2)
    for host in ("localhost", "127.0.0.1"):
        tier = RemoteTier(f"tcp://{host}:{port}", "acme-token-1", namespace="dns", timeout_s=2.0,
                          connect_timeout_s=1.0)
        key = keys_for(f"dns-{host}", 1)[0]
        assert tier.put(key, block(key, 4096)) is Status.OK, tier.last_error
        out = np.empty(4096, np.uint8)
        assert tier.get(key, out) is Status.OK and np.array_equal(out, block(key, 4096))
        tier.close()
    assert asked.count("localhost") == 1 and "127.0.0.1" in asked  # (read in place: AI_NUMERICHOST)


def test_a_lookup_that_keeps_failing_is_a_failed_call_not_a_hang(server, monkeypatch):
    import socket

    def broken(host, *args, **kw):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", broken)
    tier = RemoteTier("tcp://kvtier.invalid:7070", "acme-token-1", namespace="dns", timeout_s=1.0,
                      connect_timeout_s=0.5)
    t0 = time.monotonic()
    assert tier.get(keys_for("dns", 1)[0], np.empty(4096, np.uint8)) is not Status.OK
    assert time.monotonic() - t0 < 0.5 + SLACK_S
    assert "name resolution" in (tier.last_error or ""), tier.last_error
    tier.close()
