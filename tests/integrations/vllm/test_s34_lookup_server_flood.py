"""The worker's lookup server outlives a flood of connections (audit s34 a6 D1), without an engine.

Another local process of the user could open connections to the lookup socket until the worker ran
out of descriptors: the accept loop ended at the first failed accept, and once the flood was gone
every lookup of the engine's life was a miss. Idle connections each held a thread forever. Now a
failed accept (or thread start) is waited out, an idle connection is closed, at most
``max_connections`` are served at once, and the scheduler's client asks again on a new connection
where the worker closed its idle one.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from kvtier.integrations.vllm.lookup_service import LookupClient, LookupServer
from tests.polling import wait_until

KEYS = [b"k" * 32] * 3

#: run by a second process of this user: connects to argv[1] and sends nothing until no connect gets
#: through for a second (the server stopped accepting, its backlog full), says how many it made, exits
FLOOD = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))   # its own table is not what runs out
held = []
last = time.monotonic()
while len(held) < 2000 and time.monotonic() - last < 1.0:
    peer = socket.socket(socket.AF_UNIX)
    peer.setblocking(False)   # a full backlog: EAGAIN at once
    if peer.connect_ex(sys.argv[1]) == 0:
        held.append(peer)
        last = time.monotonic()
    else:
        peer.close()
        time.sleep(0.005)
print(len(held), flush=True)
time.sleep(0.3)
"""


def _serving_threads() -> int:
    return sum(t.name == "kvtier-lookup-conn" for t in threading.enumerate())


def _settled_serving_threads() -> int:
    """Connection threads left by earlier tests, once those whose peers closed are gone."""
    wait_until(lambda: _serving_threads() == 0, timeout_s=5)
    return _serving_threads()


def _accepting() -> bool:
    return any(t.name == "kvtier-lookup" for t in threading.enumerate())


def _idle_peers(path: str, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing (each connect retried while the backlog is full)."""
    peers = []
    while len(peers) < count:
        peer = socket.socket(socket.AF_UNIX)
        peer.settimeout(2)
        try:
            peer.connect(path)
        except BlockingIOError:
            peer.close()
            time.sleep(0.002)
            continue
        peers.append(peer)
    return peers


@contextmanager
def _descriptors_left(spare: int):
    """Lower this process's soft RLIMIT_NOFILE to leave about ``spare`` descriptors free; restored after.
    (A new descriptor takes the lowest free number, and the limit bounds that number.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken = {int(fd) for fd in os.listdir("/proc/self/fd")}
    limit = free = 0
    while free < spare:
        free += limit not in taken
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def sock_path(tmp_path) -> str:
    return str(tmp_path / "l.sock")


def test_the_server_accepts_again_once_a_flood_that_ran_it_out_of_descriptors_ends(sock_path, caplog):
    caplog.set_level(logging.ERROR, logger="kvtier")
    server = LookupServer(sock_path, lambda keys: len(keys))   # (24 spare descriptors: below its cap of 64)
    try:
        assert LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0).lookup(KEYS) == 3
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, sock_path], stdout=subprocess.PIPE, text=True)
        with _descriptors_left(spare=24):
            made = int(flood.communicate(timeout=30)[0])
        assert flood.returncode == 0 and made >= 24, made   # the flood took every descriptor left
        assert _accepting(), "the accept loop ended at a failed accept"
        # the flood is gone: its connections end, their descriptors come back, lookups are answered
        client = LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0)
        assert wait_until(lambda: _lookup_or_none(client) == 3, timeout_s=10), "lookups failed after the flood"
        client.close()
        assert "Too many open files" in caplog.text   # what it waited out: EMFILE, logged once
        assert caplog.text.count("cannot accept a connection") == 1
    finally:
        server.close()


def _lookup_or_none(client: LookupClient) -> int | None:
    try:
        return client.lookup(KEYS)
    except OSError:
        return None


def test_idle_connections_are_capped_then_closed_and_a_client_gets_through(sock_path, caplog):
    before = _settled_serving_threads()
    server = LookupServer(sock_path, lambda keys: len(keys), idle_timeout_s=1.0, max_connections=16)
    peers = []
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            peers = _idle_peers(sock_path, 300)
            time.sleep(0.3)
            held = _serving_threads() - before
            assert held <= 16, f"{held} threads held by 300 idle peers"
            assert "closing new ones unserved" in caplog.text
            # the peers stay connected and silent; the server closes them once idle for a second
            assert wait_until(lambda: _serving_threads() == before, timeout_s=10), _serving_threads() - before
        client = LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0)
        assert client.lookup(KEYS) == 3
        client.close()
        assert _accepting()
    finally:
        for peer in peers:
            peer.close()
        server.close()


def test_a_client_gets_through_as_soon_as_a_flood_holding_every_slot_leaves(sock_path):
    server = LookupServer(sock_path, lambda keys: len(keys), idle_timeout_s=60.0, max_connections=8)
    try:
        peers = _idle_peers(sock_path, 8)
        assert wait_until(lambda: _serving_threads() >= 8)
        with pytest.raises(OSError):   # every slot taken: a new connection is closed unserved
            LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0).lookup(KEYS)
        for peer in peers:
            peer.close()
        client = LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0)
        assert wait_until(lambda: _lookup_or_none(client) == 3, timeout_s=5)
        client.close()
    finally:
        server.close()


def test_the_scheduler_client_reconnects_where_the_server_closed_its_idle_connection(sock_path):
    before = _settled_serving_threads()
    server = LookupServer(sock_path, lambda keys: len(keys), idle_timeout_s=0.2)
    client = LookupClient(sock_path, timeout_s=1.0, backoff_s=30.0)   # a failure would back off 30 s
    try:
        assert client.lookup(KEYS) == 3
        assert wait_until(lambda: _serving_threads() == before, timeout_s=5)   # the server closed it
        assert client.lookup(KEYS) == 3   # asked again on a new connection: no miss, no backoff
        assert client.lookup(KEYS) == 3
    finally:
        client.close()
        server.close()


def test_a_thread_that_cannot_start_closes_its_connection_and_the_server_goes_on(sock_path, caplog):
    caplog.set_level(logging.ERROR, logger="kvtier")
    server = LookupServer(sock_path, lambda keys: len(keys))
    try:
        # a stack larger than the address space: every thread start fails ("can't start new thread")
        threading.stack_size(1 << 48)
        try:
            with pytest.raises(OSError):   # the connection closed unserved
                LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0).lookup(KEYS)
        finally:
            threading.stack_size(0)
        assert wait_until(lambda: "cannot start a thread" in caplog.text, timeout_s=5)   # logged once closed
        client = LookupClient(sock_path, timeout_s=1.0, backoff_s=0.0)
        assert wait_until(lambda: _lookup_or_none(client) == 3, timeout_s=5)
        client.close()
        assert _accepting()
    finally:
        server.close()
