"""``put_many(skip_present=True)`` skips only what the tenant's own namespace holds (s32 a9 D1).

It asked CONTAINS, which the server answers over every space the connection reads: its own
namespace, then the shared namespaces granted to it. A block only a publisher's shared namespace
held was answered OK and never sent: nothing was stored in the tenant's namespace (not listed, no
quota charged), and once the publisher deleted it the block the tenant was told it put was a MISS.
The server now says in its HELLO reply whether the connection reads shared namespaces; only where
it does not does the tier take CONTAINS for what its namespace holds (else it sends every block and
the server de-duplicates against the namespace itself). A real server process, real clients.
"""

from __future__ import annotations

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import unpack_msgpack
from tests.server.conftest import BLOCK, block, connect, hello_frame, keys_for, read_frame, remote
from tests.server.harness import TOKENS, fresh_namespace, shared_server


def test_a_block_only_a_shared_namespace_holds_is_stored_in_the_tenants_own():
    srv = shared_server()
    publisher = remote(srv, "ops", namespace="shared/system-prompts")
    reader = remote(srv, "acme")  # acme reads shared/system-prompts
    keys = keys_for(fresh_namespace("shared-copy"), 2)
    data = [block(k) for k in keys]
    try:
        assert publisher.put_many(keys[:1], data[:1]) == [Status.OK]
        assert reader.contains(keys[0])  # a read of acme's sees the publisher's copy, as it should
        assert reader.put_many(keys, data, skip_present=True) == [Status.OK, Status.OK]
        assert sorted(reader.keys()) == sorted(keys)  # was: only keys[1], the one CONTAINS did not find
        assert reader.stats.bytes_written == 2 * BLOCK  # both sent
        assert publisher.delete_many(keys[:1]) == [True]  # the publisher retires its block
        out = np.empty(BLOCK, np.uint8)
        assert reader.get(keys[0], out) is Status.OK and np.array_equal(out, data[0])  # was: MISS
    finally:
        publisher.close()
        reader.close()


def test_a_tenant_reading_no_shared_namespace_still_skips_what_it_holds():
    srv = shared_server()
    tier = remote(srv, "globex")  # granted no shared namespace: CONTAINS answers for its own alone
    keys = keys_for(fresh_namespace("skip-own"), 3)
    data = [block(k) for k in keys]
    try:
        assert tier.put_many(keys[:2], data[:2]) == [Status.OK] * 2
        assert tier.put_many(keys, data, skip_present=True) == [Status.OK] * 3
        # the two present were not sent, and are not counted as written (was: 5 blocks' bytes)
        assert tier.stats.bytes_written == 3 * BLOCK
        assert tier.stats.puts == 5
        assert sorted(tier.keys()) == sorted(keys)
    finally:
        tier.close()


def _hello_reply(srv, who: str, namespace: str) -> dict:
    sock = connect(srv.tcp_url)
    try:
        sock.sendall(hello_frame(TOKENS[who], namespace))
        h, meta, _ = read_frame(sock)
        assert h.code == 0, meta
        return unpack_msgpack(meta, "HELLO reply")
    finally:
        sock.close()


def test_the_hello_reply_says_whether_a_connection_reads_shared_namespaces():
    srv = shared_server()
    assert _hello_reply(srv, "acme", fresh_namespace())["reads_shared"] is True  # its own, then system-prompts
    assert _hello_reply(srv, "globex", fresh_namespace())["reads_shared"] is False
    assert _hello_reply(srv, "ops", "shared/system-prompts")["reads_shared"] is False  # writes what it reads
    assert _hello_reply(srv, "acme", "shared/system-prompts")["reads_shared"] is True  # read-only there
