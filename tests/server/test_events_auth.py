"""KV events reach only admitted subscribers, name blocks by a keyed hash, and stay in scope.

Each refusal test runs beside a positive control (an admitted subscriber on the
same server that must receive the same traffic), so that "received nothing"
cannot pass because nothing was published.
"""

from __future__ import annotations

import os
import stat
import time

import msgpack
import pytest
import zmq

from kvtier.errors import ConfigError
from kvtier.server.config import load_config
from kvtier.server.events import EventPublisher, EventSubscriber, event_block_name, replay
from kvtier.tiers.base import Status
from tests.server.conftest import EVENTS_KEYS, block, keys_for, remote

_FIELDS = {"type", "tier", "owner", "namespace", "blocks", "nbytes"}


def _drain(sub: EventSubscriber, seconds: float) -> list[tuple[int, dict]]:
    out: list[tuple[int, dict]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = sub.recv(timeout_s=0.2)
        if got is not None:
            out.extend((got[0], e) for e in got[1])
    return out


def _raw_frames(sock: zmq.Socket, seconds: float) -> list[list[bytes]]:
    frames = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(100):
            frames.append(sock.recv_multipart())
    return frames


def test_unadmitted_listeners_receive_nothing_while_the_router_does(server):
    ctx = zmq.Context.instance()
    endpoint = server.info["events"]
    plain_sub = ctx.socket(zmq.SUB)  # the old protocol: any PUB subscriber
    plain_sub.setsockopt(zmq.SUBSCRIBE, b"")
    plain_sub.connect(endpoint)
    no_curve = ctx.socket(zmq.DEALER)  # speaks our protocol, no credentials
    no_curve.connect(endpoint)
    stranger_pub, stranger_secret = zmq.curve_keypair()  # valid CURVE, key not admitted
    stranger = ctx.socket(zmq.DEALER)
    stranger.curve_serverkey = EVENTS_KEYS.server_public.encode()
    stranger.curve_publickey, stranger.curve_secretkey = stranger_pub, stranger_secret
    stranger.connect(endpoint)
    for s in (no_curve, stranger):
        s.setsockopt(zmq.LINGER, 0)
        s.send_multipart([b"SUB", (0).to_bytes(8, "big")])  # also asks for a replay of everything
    router = EventSubscriber(endpoint, **EVENTS_KEYS.creds("router"))
    time.sleep(0.3)

    keys = keys_for("unadmitted", 4)
    assert remote(server, "globex", namespace="unadmitted").put_many(keys, [block(k) for k in keys]) == [Status.OK] * 4

    seen = _drain(router, 1.5)
    names = {event_block_name(EVENTS_KEYS.name_key, "globex", "unadmitted", k) for k in keys}
    assert names <= {bytes(n) for _, e in seen for n in e["blocks"]}, "positive control: the router must see them"
    for s in (plain_sub, no_curve, stranger):
        assert _raw_frames(s, 0.5) == []
        s.close()
    with pytest.raises(TimeoutError):  # replay is the same socket: refused as silently
        replay(endpoint, since=0, timeout_s=0.5)
    router.close()


def test_events_name_blocks_by_keyed_hash_never_by_client_keys(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    creds = EVENTS_KEYS.creds("router")
    sock.curve_serverkey = creds["server_public"].encode()
    sock.curve_publickey, sock.curve_secretkey = creds["public"].encode(), creds["secret"].encode()
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.info["events"])
    sock.send_multipart([b"SUB", b""])
    time.sleep(0.3)
    keys = keys_for("keyed-names", 3)
    tier = remote(server, "acme", namespace="keyed-names")
    assert tier.put_many(keys, [block(k) for k in keys]) == [Status.OK] * 3
    frames = [f for f in _raw_frames(sock, 1.5) if f[0] == b"EV"]
    assert frames, "positive control: the router must receive events"
    events = [e for f in frames for e in msgpack.unpackb(f[2], raw=False)[1] if e["namespace"] == "keyed-names"]
    assert events and all(set(e) == _FIELDS for e in events)
    for f in frames:
        assert not any(k in f[2] for k in keys), "a client key crossed the events socket"
    assert {bytes(n) for e in events for n in e["blocks"]} == {
        event_block_name(EVENTS_KEYS.name_key, "acme", "keyed-names", k) for k in keys}
    sock.close()


def test_a_tenant_scoped_subscriber_sees_only_its_tenant_and_no_gaps_from_others(server):
    acme_sub = EventSubscriber(server.info["events"], **EVENTS_KEYS.creds("acme"))
    router = EventSubscriber(server.info["events"], **EVENTS_KEYS.creds("router"))
    time.sleep(0.3)
    acme_keys, globex_keys = keys_for("scope-acme", 3), keys_for("scope-globex", 5)
    globex = remote(server, "globex", namespace="scope")
    acme = remote(server, "acme", namespace="scope")
    for i in range(3):  # interleaved, so that a shared sequence would show globex's traffic as gaps
        assert globex.put_many(globex_keys[i:i + 1], [block(globex_keys[i])]) == [Status.OK]
        time.sleep(0.02)
        assert acme.put_many(acme_keys[i:i + 1], [block(acme_keys[i])]) == [Status.OK]
        time.sleep(0.02)
    assert globex.put_many(globex_keys[3:], [block(k) for k in globex_keys[3:]]) == [Status.OK] * 2
    mine = _drain(acme_sub, 1.5)
    everything = _drain(router, 0.5)
    assert {e["owner"] for _, e in everything} >= {"acme", "globex"}, "control: the router sees both tenants"
    assert mine and {e["owner"] for _, e in mine} == {"acme"}
    assert {bytes(n) for _, e in mine for n in e["blocks"]} >= {
        event_block_name(EVENTS_KEYS.name_key, "acme", "scope", k) for k in acme_keys}
    seqs = sorted({s for s, _ in mine})
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and acme_sub.gaps == 0
    # Its replay holds only its own tenant's events too, and a second replay right after is refused.
    replayed = replay(server.info["events"], since=0, **EVENTS_KEYS.creds("acme"))
    assert replayed and {e["owner"] for _, events in replayed for e in events} == {"acme"}
    with pytest.raises(RuntimeError, match="BUSY"):
        replay(server.info["events"], since=0, **EVENTS_KEYS.creds("acme"))
    acme_sub.close()
    router.close()


def test_plain_tcp_events_are_refused_and_ipc_is_a_0600_socket(tmp_path):
    with pytest.raises(ConfigError, match="CURVE"):
        load_config(None, env={}, overrides={"listen": ["tcp://127.0.0.1:0"], "events": "tcp://127.0.0.1:5557",
                                             "events_name_key": "ab" * 32})
    with pytest.raises(ConfigError, match="events_name_key"):
        load_config(None, env={}, overrides={"listen": ["tcp://127.0.0.1:0"], "events": f"ipc://{tmp_path}/e"})
    path = tmp_path / "events.sock"
    pub = EventPublisher(f"ipc://{path}", name_key=os.urandom(32))
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        sub = EventSubscriber(pub.endpoint)
        time.sleep(0.2)
        pub.emit("stored", "host", "acme", "ns", [b"k" * 32], 1)
        got = sub.recv(timeout_s=2)
        assert got is not None and got[1][0]["blocks"] == [event_block_name(pub._name_key, "acme", "ns", b"k" * 32)]
        sub.close()
    finally:
        pub.close()


def test_a_full_event_queue_drops_and_leaves_a_gap_subscribers_can_see(tmp_path):
    pub = EventPublisher(f"ipc://{tmp_path}/q.sock", name_key=os.urandom(32), queue_limit=4, batch_s=0.05)
    try:
        sub = EventSubscriber(pub.endpoint)
        time.sleep(0.2)
        pub.emit("stored", "host", "acme", "ns", [b"a" * 32], 1)
        assert sub.recv(timeout_s=2) is not None
        for i in range(5000):  # far faster than one publisher batch: the queue (4) overflows
            pub.emit("stored", "host", "acme", "ns", [i.to_bytes(32, "big")], 1)
        assert pub.dropped > 0
        time.sleep(0.2)
        pub.emit("stored", "host", "acme", "ns", [b"z" * 32], 1)
        while sub.recv(timeout_s=0.5) is not None:
            pass
        assert sub.gaps >= 1
        sub.close()
    finally:
        pub.close()


def test_a_subscriber_counts_a_restarted_server_as_a_restart_not_a_gap(tmp_path):
    """A restarted server numbers from 0 again; a sequence that went back counted as nothing, so
    a router kept what it had learnt of the old server's tier. Its SYNC (a renewal's answer) or
    EV below the next number expected is a restart."""
    endpoint = f"ipc://{tmp_path}/r.sock"
    pub = EventPublisher(endpoint, name_key=os.urandom(32), batch_s=0.01)
    sub = EventSubscriber(endpoint, renew_s=0.2)
    try:
        time.sleep(0.2)
        for i in range(3):
            pub.emit("stored", "host", "acme", "ns", [bytes([i]) * 32], 1)
            assert sub.recv(timeout_s=2) is not None
        sub.recv(timeout_s=0.5)       # a renewal's SYNC: the next number, no restart (control)
        assert sub.next_seq == 3 and sub.restarts == 0 and sub.gaps == 0
        pub.close()
        pub = EventPublisher(endpoint, name_key=os.urandom(32), batch_s=0.01)
        deadline = time.monotonic() + 5
        while sub.restarts == 0 and time.monotonic() < deadline:
            sub.recv(timeout_s=0.2)
        assert sub.restarts == 1 and sub.gaps == 0 and sub.next_seq == 0
        pub.emit("stored", "host", "acme", "ns", [b"n" * 32], 1)
        got = sub.recv(timeout_s=2)
        assert got is not None and got[0] == 0 and sub.restarts == 1
    finally:
        sub.close()
        pub.close()
