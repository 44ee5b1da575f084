"""Servers for tests: tokens, tenants, and one lazily started shared server for the contract suite."""

from __future__ import annotations

import atexit
import threading
import uuid

from kvtier.server.launch import ServerProcess

TOKENS = {
    "acme": "acme-token-1",
    "acme2": "acme-token-2",  # a second token of the same tenant
    "globex": "globex-token-1",
    "ops": "ops-token-1",  # publishes the shared namespace
    "admin": "admin-token-1",
}


def tenants(**overrides) -> dict:
    base = {
        "acme": {"token": [TOKENS["acme"], TOKENS["acme2"]], "read_shared": ["system-prompts"]},
        "globex": {"token": TOKENS["globex"]},
        "ops": {"token": TOKENS["ops"]},
    }
    for name, extra in overrides.items():
        base[name] = {**base[name], **extra}
    return base


SHARED = [{"name": "system-prompts", "writers": ["ops"]}]

_lock = threading.Lock()
_shared: ServerProcess | None = None


def shared_server() -> ServerProcess:
    """One server for the whole test session (stopped at exit); callers isolate themselves by namespace."""
    global _shared
    with _lock:
        if _shared is None or _shared.proc.poll() is not None:
            _shared = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], unix=True,
                                          server={"capacity": "256MiB", "max_block": "8MiB"})
            atexit.register(_shared.stop)
        return _shared


def fresh_namespace(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
