"""What one tenant does leaves no trace in another tenant's KV-event stream, and an erasure leaves
none in the replay rings.

(s30 a16 D1: a queue overflow made up of one tenant's events skipped a sequence number in every
scope, so every other tenant saw gaps that told of that tenant's activity, and had to start again.
a16 "erased tenant in the replay ring": after ``erase``, a replay still returned the erased tenant's
events, with their namespace names.) Real CURVE subscribers over TCP; the erasure on a real server.
"""

from __future__ import annotations

import time

import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.events import EventPublisher, EventSubscriber, replay
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.events_keys import EventsKeys
from tests.server.harness import SHARED, TOKENS, tenants

KEYS = EventsKeys({"router": "*", "acme": "acme", "globex": "globex"})


def _drain(sub: EventSubscriber, seconds: float) -> list[dict]:
    events: list[dict] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = sub.recv(timeout_s=0.2)
        if got is not None:
            events.extend(got[1])
    return events


def test_an_overflow_of_one_tenants_events_leaves_a_gap_only_where_they_were_due():
    pub = EventPublisher("tcp://127.0.0.1:*", name_key=KEYS.name_key, curve_secret=KEYS.server_secret,
                         subscribers={KEYS.subscribers[label].public: scope for label, scope in KEYS.scopes.items()},
                         queue_limit=50)
    subs = {label: EventSubscriber(pub.endpoint, **KEYS.creds(label)) for label in KEYS.scopes}
    try:
        time.sleep(0.5)
        for owner in ("acme", "globex"):   # every stream has a first number: a later skip is a gap
            pub.emit("stored", "host", owner, "ns", [owner.encode().ljust(32, b"0")], 1)
        time.sleep(0.3)
        for i in range(20_000):   # far faster than the publisher drains 50: globex's events are dropped
            pub.emit("stored", "host", "globex", "flood", [i.to_bytes(32, "big")], 1)
        assert pub.dropped > 0
        time.sleep(0.3)
        for owner in ("acme", "globex"):
            pub.emit("stored", "host", owner, "ns", [owner.encode().ljust(32, b"1")], 1)
        got = {label: _drain(sub, 1.0) for label, sub in subs.items()}
        acme = subs["acme"]
        assert [e["owner"] for e in got["acme"]] == ["acme", "acme"], "control: acme got all its events"
        assert acme.gaps == 0, f"acme's stream shows {acme.gaps} gaps from globex's burst alone"
        assert subs["globex"].gaps >= 1, "globex's own lost events must show as a gap in its scope"
        assert subs["router"].gaps >= 1, "and in the all-tenants scope"
    finally:
        for sub in subs.values():
            sub.close()
        pub.close()


@pytest.fixture
def srv(tmp_path):
    server = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                                 server={"capacity": "16MiB", "max_block": "1MiB", **KEYS.server_config()},
                                 env=KEYS.server_env())
    yield server
    server.stop()


def _put(srv, who: str, namespace: str, tag: str, session: str = "") -> None:
    keys = keys_for(tag, 2)
    assert remote(srv, who, namespace=namespace, session=session).put_many(keys, [block(k) for k in keys]) == \
        [Status.OK] * 2
    time.sleep(0.1)   # published on its own: a message of the ring holds one write's events


def _erase(srv, **args) -> None:
    reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", args)
    assert reply["ok"] and reply["erased"] == 2, reply


def _replayed(srv, label: str) -> set[tuple[str, str, str]]:
    """(type, owner, namespace) of every event a replay from the start gives ``label``'s key."""
    messages = replay(srv.info["events"], since=0, **KEYS.creds(label))
    return {(e["type"], e["owner"], e["namespace"]) for _, events in messages for e in events}


def test_a_replay_after_an_erasure_holds_none_of_the_erased_events(srv):
    live = EventSubscriber(srv.info["events"], **KEYS.creds("router"))
    time.sleep(0.3)
    _put(srv, "acme", "acme-kept", "kept")
    _put(srv, "acme", "acme-kept", "chat", session="chat-1")
    _put(srv, "acme", "acme-gone", "gone")
    _put(srv, "globex", "globex-private", "private")
    _erase(srv, tenant="acme", session="chat-1")
    _erase(srv, tenant="acme", namespace="acme-gone")
    _erase(srv, tenant="globex")
    removed = {(e["owner"], e["namespace"]) for e in _drain(live, 1.0) if e["type"] == "removed"}
    assert removed == {("acme", "acme-kept"), ("acme", "acme-gone"), ("globex", "globex-private")}, \
        "control: the erasures' removals went out live"

    everything = _replayed(srv, "router")
    assert not {e for e in everything if e[1] == "globex"}, f"the erased tenant's events replayed: {everything}"
    assert everything == {("stored", "acme", "acme-kept")}, "only the events of what was not erased remain"
    assert _replayed(srv, "acme") == {("stored", "acme", "acme-kept")}
    assert _replayed(srv, "globex") == set()
    live.close()
