"""A caller's mistake is the caller's ValueError, not a server outage.

A session id over MAX_SESSION_BYTES was found out while the put held a connection: taken for a
failure of the server, it closed a healthy connection, put the tier into backoff (every thread's
calls failed at once, for seconds) and the put answered Status.ERROR.
"""

from __future__ import annotations

import pytest

from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import block, keys_for
from tests.server.harness import TOKENS, fresh_namespace, shared_server


@pytest.mark.parametrize("mistake", [{"session": "s" * 65}, {"meta": BlockMeta(shape=(1,) * 7)}])
def test_a_bad_put_argument_raises_and_leaves_the_tier_available(mistake):
    srv = shared_server()
    tier = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=fresh_namespace("mistake"), backoff_s=5.0,
                      max_backoff_s=5.0)
    keys = keys_for(f"mistake-{sorted(mistake)[0]}", 3)
    try:
        assert tier.put(keys[0], block(keys[0], 4096)) is Status.OK
        with pytest.raises(ValueError):
            tier.put(keys[1], block(keys[1], 4096), **mistake)
        assert tier.available, tier.last_error
        assert tier.put(keys[2], block(keys[2], 4096)) is Status.OK
    finally:
        tier.close()
