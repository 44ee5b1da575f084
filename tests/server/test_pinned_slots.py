"""R1: a tenant's stalled GETs of its disk-resident blocks now pin the host pool's slots (the
promoted copy is sent pinned, 62d8601); with no per-tenant bound on pinned slots, a few stalled
connections (as many as the pool has slots) make every other tenant's PUT answer FULL for
frame_timeout_s. Before 62d8601 such reads held the 4 scratch buffers, never pool slots."""
from __future__ import annotations

import asyncio
import hashlib
import socket
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import GET_ITEM, Op
from tests.server.conftest import block, frame, hello_frame, keys_for, read_frame
from tests.server.harness import SHARED, TOKENS, fresh_namespace, tenants

MB = 1 << 20
NB = 8 * MB  # a pool of 24 MiB holds three


@pytest.fixture
def srv(tmp_path):
    from kvtier.server.launch import ServerProcess

    s = ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path), server={
        "capacity": "24MiB", "max_block": "8MiB", "disk_dir": str(tmp_path / "disk"), "disk_capacity": "1GiB",
        "frame_timeout_s": 15.0})
    yield s
    s.stop()


def _stalled_get(url, token, namespace, key):
    host, port = url[len("tcp://"):].rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect((host, int(port)))
    s.sendall(hello_frame(token, namespace))
    h, meta, _ = read_frame(s)
    assert h.code == 0, (h, meta)
    s.sendall(frame(Op.GET, GET_ITEM.pack(key, NB)))
    return s


def test_three_stalled_disk_reads_of_one_tenant_do_not_make_other_tenants_puts_full(srv):
    ns = fresh_namespace()
    acme = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=ns, timeout_s=10.0)
    akeys = keys_for("attacker", 7)
    for k in akeys:  # through a 24 MiB pool: the early ones go to disk
        assert acme.put(k, block(k, NB)) is Status.OK
    time.sleep(1.0)  # write-behind settles
    socks = [_stalled_get(srv.tcp_url, TOKENS["acme"], ns, k) for k in akeys[:3]]  # disk-resident blocks
    try:
        time.sleep(1.0)
        victim = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace=ns, timeout_s=5.0)
        results = [victim.put(k, block(k, NB)) for k in keys_for("victim", 3)]
        victim.close()
    finally:
        for s in socks:
            s.close()
        acme.close()
    assert results == [Status.OK] * 3, (
        f"globex's PUTs while acme leaves 3 GETs of its disk blocks unread: {[r.name for r in results]}")


def test_control_a_tenant_that_reads_its_replies_leaves_other_tenants_puts_alone(srv):
    """The same store and reads, every reply taken: nothing stays pinned, and globex's PUTs are OK."""
    ns = fresh_namespace()
    acme = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=ns, timeout_s=10.0)
    akeys = keys_for("reader", 7)
    for k in akeys:
        assert acme.put(k, block(k, NB)) is Status.OK
    time.sleep(1.0)
    out = np.empty(NB, np.uint8)
    for k in akeys[:3]:
        assert acme.get(k, out) is Status.OK and np.array_equal(out, block(k, NB))
    victim = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace=ns, timeout_s=5.0)
    try:
        assert [victim.put(k, block(k, NB)) for k in keys_for("victim2", 3)] == [Status.OK] * 3
    finally:
        victim.close()
        acme.close()


# -- Service's bounds on pinned slots, in process: which replies are sent from the pool itself ----
class _StalledConn:
    """A connection whose client reads nothing until ``go`` is set: each reply's payload is kept."""

    tls = False

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.payloads: list[np.ndarray] = []
        self.heads: list[bytes] = []

    def write(self, *parts) -> None:
        self.heads.append(bytes(parts[0]))

    def write_payload(self, head, block_header, payload) -> None:
        self.heads.append(bytes(head))
        self.payloads.append(payload)

    async def drain(self) -> None:
        await self.go.wait()

    def working(self) -> None:
        pass

    def receiving(self) -> None:
        pass


@pytest.fixture
def served(tmp_path):
    """An in-process server: a pool of 8 blocks of 1 MiB (a tenant may pin 2), a disk below."""
    from kvtier.server.config import ServerConfig, TenantConfig
    from kvtier.server.server import Server

    tenants_ = tuple(TenantConfig(name, (hashlib.sha256(TOKENS[name].encode()).hexdigest(),))
                     for name in ("acme", "globex", "ops"))
    server = Server(ServerConfig(tenants=tenants_, capacity_bytes=8 * MB, max_block_bytes=MB,
                                 disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=64 * MB, frame_timeout_s=5.0))
    yield server
    server.service.close()
    server.store.close()


def _store(server, tenant: str, keys: list[bytes]) -> list[bytes]:
    """Commit ``keys`` (1 MiB blocks) into ``tenant``'s default namespace as a PUT does; their storage keys."""
    from kvtier.core.payload import BlockMeta
    from kvtier.core.payload import pack_header as pack_block_header
    from kvtier.server.auth import KeySpace
    from kvtier.server.index import BlockEntry

    space = KeySpace.of(tenant, "default")
    out = []
    for k in keys:
        skey = space.storage_key(k)
        status, res = server.host.reserve(skey, MB, meta=BlockMeta("uint8", (MB,), 0))
        assert res is not None, status
        res.view[:] = block(k, MB)
        server.host.commit(res)
        header = pack_block_header(k, MB, bytes(16), BlockMeta("uint8", (MB,), 0))
        assert server.index.add(skey, BlockEntry(tenant, "default", k, MB, header, time.monotonic()))
        out.append(skey)
    return out


def _sends_from_pool(server, conn: _StalledConn) -> list[bool]:
    pool = server.host._pool
    return [np.shares_memory(p, pool) for p in conn.payloads]


def test_within_its_share_a_tenant_is_sent_the_pool_slot_itself_and_past_it_a_copy(served):
    svc = served.service
    akeys, gkeys = keys_for("acme-dram", 4), keys_for("globex-dram", 1)
    _store(served, "acme", akeys)
    _store(served, "globex", gkeys)
    acme = svc.auth.authenticate(TOKENS["acme"], "default")
    globex = svc.auth.authenticate(TOKENS["globex"], "default")

    async def run():
        from kvtier.tiers.remote_protocol import VERSION, Header

        head = Header(VERSION, Op.GET, 0, 1, 0, 0)
        conns = [_StalledConn() for _ in akeys]
        tasks = []
        for conn, k in zip(conns, akeys):  # acme: four GETs of DRAM blocks, none read yet
            tasks.append(asyncio.ensure_future(svc.handle(conn, acme, head, GET_ITEM.pack(k, MB))))
            await asyncio.sleep(0.2)
        pinned_by_acme = svc.pinned_bytes
        g = _StalledConn()
        gtask = asyncio.ensure_future(svc.handle(g, globex, head, GET_ITEM.pack(gkeys[0], MB)))
        await asyncio.sleep(0.2)
        # a PUT's slot while both stall: the pool still has room for uploads
        free = served.host.free_slots
        for conn in conns + [g]:
            conn.go.set()
        await asyncio.gather(*tasks, gtask)
        return conns, g, pinned_by_acme, free

    conns, g, pinned_by_acme, free = asyncio.run(run())
    sent = [_sends_from_pool(served, c) for c in conns]
    assert all(len(c.payloads) == 1 for c in conns), [c.heads for c in conns]
    # acme's share: a quarter of the 8-block pool, two blocks, sent zero-copy; the others copies
    assert [s[0] for s in sent] == [True, True, False, False], sent
    assert pinned_by_acme == 2 * served.host.footprint(MB)
    for c, k in zip(conns, akeys):  # the copies hold the same bytes
        assert np.array_equal(np.asarray(c.payloads[0]), block(k, MB))
    assert _sends_from_pool(served, g) == [True], "globex, within its own share, is sent its slot"
    assert free >= 1
    assert svc.pinned_bytes == 0, "every pin released after its send"
    served.host.check_integrity()


def test_a_hot_block_read_by_many_stalled_connections_is_charged_once_and_stays_zero_copy(served):
    """Many replies sending one slot pin no more of the pool than one: all are sent from it."""
    svc = served.service
    (skey,) = _store(served, "acme", keys_for("acme-hot", 1))
    k = keys_for("acme-hot", 1)[0]
    acme = svc.auth.authenticate(TOKENS["acme"], "default")

    async def run():
        from kvtier.tiers.remote_protocol import VERSION, Header

        head = Header(VERSION, Op.GET, 0, 1, 0, 0)
        conns = [_StalledConn() for _ in range(6)]
        tasks = [asyncio.ensure_future(svc.handle(c, acme, head, GET_ITEM.pack(k, MB))) for c in conns]
        await asyncio.sleep(0.3)
        pinned = svc.pinned_bytes
        for c in conns:
            c.go.set()
        await asyncio.gather(*tasks)
        return conns, pinned

    conns, pinned = asyncio.run(run())
    assert [_sends_from_pool(served, c) for c in conns] == [[True]] * 6
    assert pinned == served.host.footprint(MB)
    assert svc.pinned_bytes == 0 and svc._pinned_bytes_by_tenant == {} and svc._slot_pins == {}
