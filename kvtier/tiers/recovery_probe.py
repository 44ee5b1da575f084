"""The health check that ends a tier's outage, shared by the tiers that back off after a failure
(:class:`~kvtier.tiers.remote.RemoteTier`, :class:`~kvtier.tiers.mooncake.MooncakeTier`).

A tier that failed is *down* until its backoff is over; then one check runs on a thread of its
own while the callers go on failing fast. (When the first caller after the backoff found out
itself, a frozen server or master cost that caller the whole deadline every backoff, all outage
long.) The tier keeps its own state -- ``_lock``, ``_probing``, ``_closed``, ``_down_until`` (0.0:
up) and ``_backoff`` -- and says what a check is and what a failed one does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def start_probe(tier, check: Callable[[], None], failed: Callable[[Exception], None], *,
                thread_name: str, answered: Callable[[], None]) -> None:
    """Run ``check`` on a thread of its own, unless one runs already or ``tier`` is closed.

    Until it ends the tier stays down for one more backoff. If ``check`` raises, ``failed(exc)``
    backs the tier off again; if it returns, the tier is up and ``answered()`` says so.
    """
    with tier._lock:
        if tier._probing or tier._closed:
            return
        tier._probing = True
        tier._down_until = time.monotonic() + tier._backoff

    def probe() -> None:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - whatever the check met, the tier is still down
            with tier._lock:
                tier._probing = False
            failed(exc)
            return
        with tier._lock:
            tier._down_until = 0.0
            tier._probing = False
        answered()

    threading.Thread(target=probe, name=thread_name, daemon=True).start()
