"""The tenant's connection cap refusing one connection more is no outage of the tier (s32 a9 D4).

``RemoteTier`` opens a connection per concurrent caller. Where the server refused one more
(``ERROR TOO_MANY_CONNECTIONS``, "retry later": the tenant holds ``max_connections_per_tenant``
connections, some of them this tier's, working), the tier took it for a dead server: backoff, its
pooled connections closed, every thread's calls failing fast although the server was up and its
own connection fine. The call now waits, within its deadline, for one of the tier's connections
to come back to the pool. The real server, in this process (its deletions slowed to keep the
tier's connection busy); the real client; the tenant's other engine a raw connection.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.tiers.base import Status
from tests.server.conftest import keys_for, logged_in
from tests.server.harness import TOKENS, fresh_namespace
from tests.server.inprocess import PAGE, InProcessServer

BUSY_S = 1.0  # the tier's one connection is busy this long (a DELETE's slowed deletion)


def test_a_call_refused_a_connection_by_the_tenant_cap_uses_the_tiers_own_once_free(tmp_path):
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap")
    other_engine = logged_in(srv.url, TOKENS["acme"], ns)  # 1 of acme's 2
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0)
    try:
        keys = keys_for(ns, 2)
        assert tier.put_many(keys[:1], [np.full(PAGE, 1, np.uint8)]) == [Status.OK]  # its connection: 2 of 2
        started = threading.Event()
        srv.before_deletions(lambda _: (started.set(), time.sleep(BUSY_S)))
        busy = threading.Thread(target=tier.delete_many, args=(keys[:1],))
        busy.start()
        assert started.wait(10), "the busy call did not start"
        # a second caller needs a third connection: refused, it waits for the busy one
        assert tier.put_many(keys[1:], [np.full(PAGE, 2, np.uint8)]) == [Status.OK], tier.last_error
        busy.join(10)
        assert tier.available, tier.last_error  # was: backoff, every call failing for 5 s
        assert tier.ping()
        assert tier.contains_many(keys) == [False, True]
    finally:
        tier.close()
        other_engine.close()
        srv.stop()


def test_a_refusal_while_the_tier_holds_no_connection_is_still_a_backoff(tmp_path):
    """Other engines hold all of the tenant's connections: nothing of this tier's can come free."""
    srv = InProcessServer(tmp_path, max_connections_per_tenant=2)
    ns = fresh_namespace("cap-full")
    others = [logged_in(srv.url, TOKENS["acme"], ns) for _ in range(2)]
    tier = srv.remote("acme", namespace=ns, backoff_s=5.0, max_backoff_s=5.0)
    try:
        assert not tier.ping()
        assert not tier.available and "TOO_MANY_CONNECTIONS" in tier.last_error
    finally:
        tier.close()
        for s in others:
            s.close()
        srv.stop()
