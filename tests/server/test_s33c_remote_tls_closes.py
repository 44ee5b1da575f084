"""A remote tier over TLS closes the connections its full pool has no room for without waiting.

Closing one, the tier looks whether a reply is left unread on it (then it is closed outright). That
look runs under the pool lock; on a TLS socket, which carries a Python timeout (its last call's
deadline), a peek with MSG_DONTWAIT still waited for readability up to that timeout: every
connection closed in step held the lock for the rest of its deadline, every other call waited
behind it, timed out, and the tier backed off (64 small deletes: 14 s, some lost; audit s33 r4 D1)."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import keys_for
from tests.server.harness import TOKENS
from tests.server.inprocess import PAGE, InProcessServer
from tests.server.test_tls import _self_signed


def test_tls_connections_closed_for_a_full_pool_do_not_hold_up_other_calls(tmp_path):
    cert, key = _self_signed(tmp_path)
    srv = InProcessServer(tmp_path, listen=["tls://127.0.0.1:0"], tls_cert=cert, tls_key=key)
    srv.before_deletions(lambda _: time.sleep(0.02))  # each call holds its connection ~20 ms
    tier = RemoteTier(f"{srv.url}?ca={cert}", TOKENS["acme"], namespace="s33c-tls", pool_size=1, timeout_s=2.0)
    threads, rounds = 8, 8
    keys = keys_for("s33c-tls-closes", threads * rounds)
    try:
        assert tier.put_many(keys, [np.full(PAGE, 1, np.uint8)] * len(keys)) == [Status.OK] * len(keys)
        results = []

        def deleting(t: int) -> None:
            for r in range(rounds):
                results.append(tier.delete_many([keys[r * threads + t]])[0])

        workers = [threading.Thread(target=deleting, args=(t,)) for t in range(threads)]
        started = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        took = time.monotonic() - started
        # most calls find the pool full: their connections are closed, each in step (nothing to read)
        assert results == [True] * len(keys), f"deletes lost: {results.count(False)} (tier errors {tier.stats.errors})"
        assert tier.stats.errors == 0, tier.last_error
        assert took < 5.0, f"{len(keys)} small deletes took {took:.1f} s: closing connections waited under the lock"
    finally:
        tier.close()
        srv.stop()
