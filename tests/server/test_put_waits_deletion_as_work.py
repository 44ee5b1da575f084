"""A PUT waiting for the server's own deletion of its key is not timed as a slow client (s32 a9 D2).

A PUT of a key whose deletion is under way (a DELETE's, an expired or quota-evicted copy's) waits
for it before it lands. It waited in its frame's RECV phase, where the watchdog's
``frame_timeout_s`` runs: a deletion slower than that (a slow disk, a fleet delete, a turn on the
I/O threads) was answered ``ERROR TIMEOUT``, and the client took the server for down (backoff:
every thread's calls failed). The wait is now the server's WORK phase. The real server, in this
process, its deletions slowed; the real client.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.tiers.base import Status
from tests.server.conftest import keys_for
from tests.server.harness import fresh_namespace
from tests.server.inprocess import PAGE, InProcessServer

FRAME_TIMEOUT_S = 1.0
SLOW_DELETE_S = 1.6  # longer than a frame may take


def test_a_put_outwaits_a_deletion_slower_than_the_frame_timeout(tmp_path):
    srv = InProcessServer(tmp_path, frame_timeout_s=FRAME_TIMEOUT_S)
    try:
        ns = fresh_namespace("slow-delete")
        deleter = srv.remote("acme", namespace=ns, timeout_s=10)
        writer = srv.remote("acme", namespace=ns, timeout_s=10)
        key = keys_for(ns, 1)
        old, new = np.full(PAGE, 1, np.uint8), np.full(PAGE, 2, np.uint8)
        assert deleter.put_many(key, [old]) == [Status.OK]
        assert writer.ping()
        started = threading.Event()
        ran = srv.before_deletions(lambda _: (started.set(), time.sleep(SLOW_DELETE_S)))
        deleting = threading.Thread(target=deleter.delete_many, args=(key,))
        deleting.start()
        assert started.wait(10), "the deletion did not start"
        t0 = time.monotonic()
        got = writer.put_many(key, [new])  # waits for the deletion, server side
        took = time.monotonic() - t0
        deleting.join(10)
        assert ran and took > FRAME_TIMEOUT_S, "the PUT raced no deletion longer than a frame may take"
        assert got == [Status.OK], writer.last_error  # was: ERROR (TIMEOUT: a frame took too long)
        assert writer.available, writer.last_error
        out = np.zeros(PAGE, np.uint8)
        assert writer.get(key[0], out) is Status.OK and np.array_equal(out, new)
    finally:
        srv.stop()
