"""One real Mooncake Store for the test session: ``mooncake_master`` + two segment-holder processes
on loopback, started on first use and stopped at exit. Each tier a test makes gets a fresh secret,
so tests never see each other's blocks."""

from __future__ import annotations

import atexit
import os
import threading

_cluster = None
_lock = threading.Lock()

#: how long the master keeps a silent holder's segment (its default is 10 s): fault tests wait this out
CLIENT_TTL_S = 3


def mooncake_available() -> str | None:
    """None if the real engine can run here, else why not (a skip reason)."""
    try:
        import mooncake.store  # noqa: F401 - also fails without libibverbs
    except ImportError as exc:
        return f"mooncake-transfer-engine-non-cuda not importable: {exc}"
    from kvtier.tiers.mooncake_launch import find_master_binary

    try:
        find_master_binary()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def start_cluster(holders: int = 2, segment_bytes: int = 192 << 20):
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    return MooncakeCluster.start(holders=holders, segment_bytes=segment_bytes,
                                 master_flags=[f"--client_ttl={CLIENT_TTL_S}"])


def shared_cluster():
    global _cluster
    with _lock:
        if _cluster is None:
            _cluster = start_cluster()
            atexit.register(_cluster.stop)
        return _cluster


def fresh_secret() -> bytes:
    return os.urandom(32)


def make_tier(cluster=None, *, tenant: str = "tenant", secret: bytes | None = None, **kw):
    from kvtier.tiers.mooncake import MooncakeTier

    cluster = cluster or shared_cluster()
    return MooncakeTier(cluster.master_address, cluster.metadata_url, tenant=tenant,
                        secret=secret or fresh_secret(), **kw)


def both_transfer_paths(request, monkeypatch) -> str:
    """For an autouse fixture parametrized ``["batch calls", "sessions"]``: the tier moves blocks
    below ``MooncakeTier._session_min_bytes`` in batch calls and larger ones in sessions; the tests' small
    blocks take the path named."""
    from kvtier.tiers.mooncake import MooncakeTier

    monkeypatch.setattr(MooncakeTier, "_session_min_bytes", 1 << 40 if request.param == "batch calls" else 1)
    return request.param
