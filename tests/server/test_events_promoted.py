"""KV events of ``kvtier serve`` as a subscriber folds them ("stored" / "removed" per tier): a block that
leaves the server leaves every tier it was announced in. Real server process, real CURVE subscriber.

(s27 events audit, E2: a block promoted back from disk was announced in DRAM and on disk, but its
deletion announced "removed host" only: every subscriber kept its disk copy as held for good.)"""

from __future__ import annotations

import time

import numpy as np

from kvtier.server.events import EventSubscriber, event_block_name
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.events_keys import EventsKeys
from tests.server.harness import SHARED, tenants

SLOT = 128 * 1024
EVENTS = EventsKeys({"router": "*"})


def _fold(sub: EventSubscriber, held: dict[str, set[bytes]], seen: list | None = None,
          quiet_s: float = 0.5) -> None:
    """Apply every event received until the stream is quiet: per tier, the names it holds
    (``seen`` gets each event as (type, tier, name))."""
    while (got := sub.recv(timeout_s=quiet_s)) is not None:
        for e in got[1]:
            names = held.setdefault(e["tier"], set())
            if e["type"] == "stored":
                names.update(e["blocks"])
            else:
                names.difference_update(e["blocks"])
            if seen is not None:
                seen += [(e["type"], e["tier"], name) for name in e["blocks"]]


def _serve(tmp_path, acme=None, **server):
    return ServerProcess.start(
        tenants(**({"acme": acme} if acme else {})), shared=SHARED, workdir=str(tmp_path), env=EVENTS.server_env(),
        server={"capacity": 4 * SLOT, "max_block": SLOT, "disk_dir": str(tmp_path / "disk"), "disk_capacity": "16MiB",
                **EVENTS.server_config(), **server})


def _where(held: dict[str, set[bytes]], name: bytes) -> list[str]:
    return sorted(t for t, names in held.items() if name in names)


def test_erasing_a_block_promoted_from_disk_announces_its_disk_copy_removed(tmp_path):
    with _serve(tmp_path) as srv:
        sub = EventSubscriber(srv.info["events"], **EVENTS.creds("router"))
        tier = remote(srv, "acme", namespace="spill")
        try:
            time.sleep(0.3)
            keys = keys_for("promoted", 12)
            assert tier.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
            held: dict[str, set[bytes]] = {}
            _fold(sub, held)
            name = event_block_name(EVENTS.name_key, "acme", "spill", keys[0])
            assert _where(held, name) == ["disk"]  # control: DRAM evicted it to disk
            out = np.zeros(SLOT, np.uint8)
            assert tier.get_many([keys[0]], [out]) == [Status.OK]  # promoted back into DRAM
            _fold(sub, held)
            assert _where(held, name) == ["disk", "host"], "control: the promotion was announced"
            assert tier.delete(keys[0]) is True
            assert tier.lookup_prefix([keys[0]]) == 0  # gone from every tier
            _fold(sub, held)
            assert _where(held, name) == [], f"the erased block is still announced as held in {_where(held, name)}"
        finally:
            tier.close()
            sub.close()


def test_an_expired_block_promoted_from_disk_leaves_every_tier_it_was_announced_in(tmp_path):
    """The same through the retention sweeper (every removal goes through one path: quota victims,
    expirations, erasures, misses)."""
    with _serve(tmp_path, acme={"namespace_ttl_s": {"scratch": 1.0}}, sweep_interval_s=0.2) as srv:
        sub = EventSubscriber(srv.info["events"], **EVENTS.creds("router"))
        tier = remote(srv, "acme", namespace="scratch")
        try:
            time.sleep(0.3)
            keys = keys_for("expiring", 8)
            assert tier.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 8
            out = np.zeros(SLOT, np.uint8)
            assert tier.get_many([keys[0]], [out]) == [Status.OK]  # from disk, promoted
            held: dict[str, set[bytes]] = {}
            _fold(sub, held, quiet_s=0.3)
            name = event_block_name(EVENTS.name_key, "acme", "scratch", keys[0])
            assert _where(held, name) == ["disk", "host"]  # control
            deadline = time.monotonic() + 10
            while tier.lookup_prefix([keys[0]]) and time.monotonic() < deadline:
                time.sleep(0.2)
            _fold(sub, held)
            assert all(_where(held, event_block_name(EVENTS.name_key, "acme", "scratch", k)) == [] for k in keys), \
                {k.hex()[:8]: _where(held, event_block_name(EVENTS.name_key, "acme", "scratch", k)) for k in keys}
        finally:
            tier.close()
            sub.close()


def test_a_block_held_in_one_tier_is_announced_as_before(tmp_path):
    """Control: a block DRAM alone ever held is announced stored in DRAM once and removed from it once."""
    with _serve(tmp_path) as srv:
        sub = EventSubscriber(srv.info["events"], **EVENTS.creds("router"))
        tier = remote(srv, "acme", namespace="dram")
        try:
            time.sleep(0.3)
            key = keys_for("dram-only", 1)[0]
            assert tier.put(key, block(key, SLOT)) is Status.OK
            assert tier.delete(key) is True
            held: dict[str, set[bytes]] = {}
            seen: list = []
            _fold(sub, held, seen)
            name = event_block_name(EVENTS.name_key, "acme", "dram", key)
            assert [(kind, t) for kind, t, n in seen if n == name] == [("stored", "host"), ("removed", "host")]
        finally:
            tier.close()
            sub.close()
