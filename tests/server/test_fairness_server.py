"""Hole 3 of issue 12 against a real ``kvtier serve``: a publisher's writes into a shared namespace
count against its own quota, and LIST pages follow a cursor.

Before, a block written into ``shared/NAME`` was charged to the shared namespace only: a tenant with
a quota stored without limit by publishing. LIST took an offset and the server copied the whole
namespace for every page; a deletion between two pages shifted the offsets, so blocks present all
along were skipped.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import LIST_MAX_OFFSET, ErrorCode, Op
from tests.server.conftest import block, connect, frame, hello_frame, keys_for, read_frame, remote
from tests.server.harness import SHARED, TOKENS, fresh_namespace, tenants

BLOCK = 16 * 1024  # whole pages: a block's footprint is its payload
QUOTA = 4 * BLOCK


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    wd = tmp_path_factory.mktemp("kvtier-fair")
    s = ServerProcess.start(
        tenants(ops={"quota": QUOTA}), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(wd),
        server={"capacity": "16MiB", "max_block": "256KiB"},
    )
    yield s
    s.stop()


def _admin(srv, cmd, **args):
    return admin_call(srv.tcp_url, TOKENS["admin"], cmd, args)


def test_a_publisher_pays_for_what_it_writes_into_a_shared_namespace(srv):
    ops_own = remote(srv, "ops", namespace="own")
    publish = remote(srv, "ops", namespace="shared/system-prompts")
    reader = remote(srv, "acme")  # granted read_shared: reads fall through to the shared space
    own = keys_for("fair-own", 2)
    assert ops_own.put_many(own, [block(k, BLOCK) for k in own]) == [Status.OK] * 2
    pub = keys_for("fair-pub", 6)
    for k in pub:
        assert publish.put(k, block(k, BLOCK)) is Status.OK
    # Six blocks published and two of its own: 8 blocks against a 4-block quota. Its least
    # recently used blocks went first, its own and published ones alike.
    assert ops_own.contains_many(own) == [False, False], "the publisher's own older blocks should have gone"
    assert reader.contains_many(pub) == [False, False, True, True, True, True]
    stats = publish.server_stats()
    assert stats["charged_bytes"] <= QUOTA, stats
    assert stats["charged_bytes"] == 4 * BLOCK
    # Same-tenant control: what survives reads back intact, for a granted reader too.
    out = np.zeros(BLOCK, np.uint8)
    assert reader.get(pub[-1], out) is Status.OK and (out == block(pub[-1], BLOCK)).all()
    # Another tenant is not charged for reading it, and keeps its blocks.
    mine = keys_for("fair-acme", 4)
    assert reader.put_many(mine, [block(k, BLOCK) for k in mine]) == [Status.OK] * 4
    assert reader.contains_many(pub[2:]) == [True] * 4


def test_erasing_a_publisher_keeps_what_it_published(srv):
    publish = remote(srv, "ops", namespace="shared/system-prompts")
    reader = remote(srv, "acme")
    k = keys_for("fair-erase", 1)[0]
    assert publish.put(k, block(k, BLOCK)) is Status.OK
    assert _admin(srv, "erase", tenant="ops")["ok"]
    assert reader.contains(k), "the shared namespace's blocks belong to it, not to the tenant that wrote them"
    assert _admin(srv, "erase", tenant="shared/system-prompts")["ok"]
    assert not reader.contains(k)


def _list(s, cursor: int, limit: int) -> tuple[int, list[bytes]]:
    s.sendall(frame(Op.LIST, struct.pack("<QI", cursor, limit)))
    h, meta, _ = read_frame(s)
    assert h.op == Op.LIST, meta
    (nxt,) = struct.unpack_from("<Q", meta)
    return nxt, [meta[i : i + 32] for i in range(8, len(meta), 32)]


def test_list_pages_follow_a_cursor_across_deletions(srv):
    ns = fresh_namespace("list")
    tier = remote(srv, "globex", namespace=ns)
    keys = keys_for(ns, 300)
    assert tier.put_many(keys, [block(k, 64) for k in keys]) == [Status.OK] * 300
    s = connect(srv.tcp_url)
    s.sendall(hello_frame(TOKENS["globex"], ns))
    assert read_frame(s)[0].code == 0
    seen: list[bytes] = []
    cursor, deleted = 0, []
    while True:
        cursor, page = _list(s, cursor, 50)
        seen += page
        # Between pages another worker deletes blocks already listed: with offsets, the next
        # page would start 10 blocks too far and skip them.
        if len(deleted) < 30:
            gone = seen[len(deleted) : len(deleted) + 10]
            assert tier.delete_many(gone) == [True] * len(gone)
            deleted += gone
        if not cursor:
            break
    assert seen == keys, "every block present from start to end is listed once, oldest first"
    assert sorted(tier.keys()) == sorted(set(keys) - set(deleted))  # the client's own pager
    s.close()


def test_the_offset_form_of_older_clients_is_served_a_few_pages_deep_only(srv):
    ns = fresh_namespace("list-old")
    tier = remote(srv, "globex", namespace=ns)
    keys = keys_for(ns, 20)
    assert tier.put_many(keys, [block(k, 64) for k in keys]) == [Status.OK] * 20
    s = connect(srv.tcp_url)
    s.sendall(hello_frame(TOKENS["globex"], ns))
    read_frame(s)
    s.sendall(frame(Op.LIST, struct.pack("<II", 5, 10)))
    h, meta, _ = read_frame(s)
    assert h.op == Op.LIST and [meta[i : i + 32] for i in range(0, len(meta), 32)] == keys[5:15]
    s.sendall(frame(Op.LIST, struct.pack("<II", LIST_MAX_OFFSET + 1, 10)))
    h, meta, _ = read_frame(s)
    assert h.op == Op.ERROR and h.code == ErrorCode.BAD_META and b"cursor" in meta
    s.close()


def _cursors(srv, who: str, ns: str, n: int = 2) -> list[int]:
    """The cursors of ``n`` one-block pages of ``ns`` from the start, on a raw connection."""
    s = connect(srv.tcp_url)
    s.sendall(hello_frame(TOKENS[who], ns))
    assert read_frame(s)[0].code == 0
    cursors, cursor = [], 0
    for _ in range(n):
        cursor, _ = _list(s, cursor, 1)
        cursors.append(cursor)
    s.close()
    return cursors


def _cursor_gap(srv, other_puts: int) -> int:
    """How far apart acme's cursors of its blocks B and C are, when another tenant stored
    ``other_puts`` blocks in its own namespace between acme's A and B."""
    ns = fresh_namespace("gap")
    acme = remote(srv, "acme", namespace=ns)
    globex = remote(srv, "globex", namespace=fresh_namespace("gap"))
    a, b, c = keys_for(f"acme-{ns}", 3)
    assert acme.put(a, block(a, 64)) is Status.OK
    others = keys_for(f"globex-{ns}", other_puts)
    if others:
        assert globex.put_many(others, [block(k, 64) for k in others]) == [Status.OK] * other_puts
    assert acme.put_many([b, c], [block(b, 64), block(c, 64)]) == [Status.OK, Status.OK]
    c1, c2 = _cursors(srv, "acme", ns)
    acme.close()
    globex.close()
    assert 0 < c1 < c2, (c1, c2)  # the cursor contract: increasing, 0 only at the end
    return c2 - c1


def test_list_cursors_do_not_count_other_tenants_blocks(srv):
    """Cursors were one server-wide sequence: the gap between two of acme's consecutive cursors
    counted the blocks every other tenant stored in between (37 here)."""
    quiet = _cursor_gap(srv, 0)
    busy = _cursor_gap(srv, 37)
    assert busy == quiet, (f"acme's consecutive LIST cursors are {busy} apart after globex stored 37 blocks "
                           f"({quiet} apart otherwise): acme can count another tenant's writes")


def test_a_namespace_emptied_and_filled_again_lists_its_new_blocks_after_an_old_cursor(srv):
    """Cursors are the namespace's own: a namespace that empties (its order is dropped) and gets
    blocks again must not number them from where the old cursors were, or a pager holding one
    skips them."""
    ns = fresh_namespace("refill")
    tier = remote(srv, "globex", namespace=ns)
    old = keys_for(f"old-{ns}", 2)
    assert tier.put_many(old, [block(k, 64) for k in old]) == [Status.OK] * 2
    (cursor,) = _cursors(srv, "globex", ns, 1)
    assert cursor
    assert tier.delete_many(old) == [True, True]  # the namespace is empty now
    new = keys_for(f"new-{ns}", 3)
    assert tier.put_many(new, [block(k, 64) for k in new]) == [Status.OK] * 3
    s = connect(srv.tcp_url)
    s.sendall(hello_frame(TOKENS["globex"], ns))
    assert read_frame(s)[0].code == 0
    end, page = _list(s, cursor, 10)
    s.close()
    tier.close()
    assert (end, page) == (0, new), "blocks added after the cursor was handed out were skipped"
