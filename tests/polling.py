"""Waiting in tests for something another thread or process brings about."""

from __future__ import annotations

import time


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll ``condition()`` every 50 ms until it is true (True) or ``timeout_s`` has passed (False)."""
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= until:
            return False
        time.sleep(0.05)
    return True
