"""Loud, once-per-process warnings about settings that leave data exposed.

kvtier runs without a master key and with the default tenant ``""`` so that it
works out of the box; neither is an error, but both should not go unnoticed.
Each warning is logged at WARNING once per process and subject (a tier medium,
a server's spill directory), so a process that builds many stores is told
once, not once per store.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvtier.safety")

_said: set[tuple[str, str]] = set()
_lock = threading.Lock()


def first_time(kind: str, subject: str = "") -> bool:
    """True the first time this process asks about ``(kind, subject)``; False after."""
    with _lock:
        if (kind, subject) in _said:
            return False
        _said.add((kind, subject))
        return True


def plaintext_message(tier: str, where: str) -> str:
    return (f"the {tier} tier stores KV blocks UNENCRYPTED ({where}): anyone who can read it reads the "
            f"prompts they were computed from. Configure a master key (master_key_file, mode 0600, or "
            f"$KVTIER_MASTER_KEY) to seal them")


def warn_plaintext(tier: str, where: str) -> None:
    """A disk or remote tier is about to hold blocks without encryption."""
    if first_time("plaintext", tier):
        log.warning("kvtier: %s", plaintext_message(tier, where))


def server_plaintext_message(disk_dir: str) -> str:
    return (f"disk_dir {disk_dir} holds spilled KV blocks UNENCRYPTED (unless clients seal them): set "
            f"encrypt_at_rest = true and master_key_file (or $KVTIER_MASTER_KEY)")


def warn_server_plaintext(disk_dir: str) -> None:
    """A server spills to ``disk_dir`` without ``encrypt_at_rest``."""
    if first_time("server-plaintext", disk_dir):
        log.warning("kvtier serve: %s", server_plaintext_message(disk_dir))


def warn_default_tenant(where: str) -> None:
    """An embedded store keys and seals for the default tenant ``""``."""
    if first_time("default-tenant"):
        log.warning("kvtier: %s uses the default tenant \"\": every user of this store shares key roots "
                    "(and encryption keys), so any of them can hit on another's prompts; set tenant=... per "
                    "user or customer", where)
