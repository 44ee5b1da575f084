"""Lower-tier reads share a few scratch buffers server-wide; no tenant can keep them from the others.

A GET of a block that is not in DRAM is read (verified, promoted) into one of the server's few
scratch buffers. It used to hold that buffer until the client had read the reply: four connections
of one tenant that sent a GET of a disk block each and read nothing held all four for
``frame_timeout_s``, and every other tenant's read of a block not in DRAM waited past its deadline
(its tier went into backoff). Now the buffer is given back before the send (the reply goes out
from the promoted copy in the pool, or from a buffer lent to the connection within per-tenant
bounds), a tenant takes at most half of them at a time, and a wait for one is bounded (a miss).
Real ``kvtier serve`` processes and raw sockets; ``ScratchPool``'s bounds on the event loop.
"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

from kvtier.server.service import ScratchPool
from kvtier.tiers.base import Status
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_protocol import GET_ITEM, HEADER_NBYTES, Op, unpack_header
from tests.server.conftest import block, frame, hello_frame, keys_for, read_frame, recv_exact
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


def _stalled_get(url: str, token: str, namespace: str, key: bytes) -> socket.socket:
    """A logged-in connection with a 4 KiB receive window that sends a GET and reads nothing."""
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


def _victim_get_while_acme_stalls(srv, stalled: int, stored: int = 7):
    """globex reads its own disk-resident block while ``stalled`` connections of acme each hold a
    GET of one of acme's disk-resident blocks unread."""
    ns = fresh_namespace()
    victim = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace=ns, timeout_s=3.0)
    vkey = keys_for("victim", 1)[0]
    assert victim.put(vkey, block(vkey, NB)) is Status.OK
    acme = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=ns, timeout_s=10.0)
    akeys = keys_for("attacker", stored)
    for k in akeys:  # through a 24 MiB pool: the early ones (and the victim's) go to disk
        assert acme.put(k, block(k, NB)) is Status.OK
    time.sleep(1.0)  # write-behind settles
    socks = [_stalled_get(srv.tcp_url, TOKENS["acme"], ns, k) for k in akeys[:stalled]]
    try:
        time.sleep(1.0)
        out = np.full(NB, 0xAB, np.uint8)  # poisoned: a read that writes nothing fails
        t0 = time.monotonic()
        st = victim.get(vkey, out)
        took = time.monotonic() - t0
        # what each stalled reader was answered (the header arrives, the payload waits for it)
        answers = [Status(unpack_header(recv_exact(s, HEADER_NBYTES)).code) for s in socks]
        # acme itself is served again once its readers are gone (every buffer came back)
        for s in socks:
            s.close()
        socks = []
        mine = np.full(NB, 0xAB, np.uint8)
        again = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace=ns, timeout_s=10.0)
        acme_after = again.get(akeys[0], mine) is Status.OK and np.array_equal(mine, block(akeys[0], NB))
        again.close()
    finally:
        for s in socks:
            s.close()
        victim.close()
        acme.close()
    return st, took, np.array_equal(out, block(vkey, NB)), acme_after, answers


def test_control_three_stalled_readers_leave_a_scratch_buffer(srv):
    """Held across the send as before, one of the four buffers was still free: the read is quick."""
    st, took, same, acme_after, _ = _victim_get_while_acme_stalls(srv, 3)
    assert st is Status.OK and took < 3.0 and same, (st, took)
    assert acme_after


def test_a_tenant_that_stalls_four_gets_does_not_block_another_tenants_disk_reads(srv):
    st, took, same, acme_after, answers = _victim_get_while_acme_stalls(srv, 4)
    assert st is Status.OK and took < 3.0, (
        f"globex's GET of its own block: {st.name} after {took:.1f} s while acme stalls 4 reads")
    assert same
    assert acme_after
    # One sent from a pinned pool slot (acme's share of pinned slots: a quarter of the pool, at
    # least one block), two from lent buffers (acme's share of them); past both, a MISS. (All four
    # were OK when stalled replies could pin every slot of the pool: test_pinned_slots.py.)
    assert sorted(answers) == [Status.OK] * 3 + [Status.MISS], answers


def test_ten_stalled_gets_of_one_tenant_leave_the_others_reads_alone(srv):
    """More stalled readers than the pool's pinned slots, buffers and lending bounds: past its
    share the tenant's reads are misses, and another tenant's read is still served at once."""
    st, took, same, acme_after, answers = _victim_get_while_acme_stalls(srv, 10, stored=12)
    assert st is Status.OK and took < 3.0 and same, (st, took)
    assert acme_after
    # Sent from acme's one pinned pool slot and from its two lent buffers, at most; the rest missed.
    assert answers.count(Status.OK) <= 3 and set(answers) == {Status.OK, Status.MISS}, answers


# -- ScratchPool's bounds ----------------------------------------------------------------------
def test_one_tenant_takes_at_most_its_share_and_a_wait_ends_at_its_deadline():
    async def run():
        pool = ScratchPool(4, 64)
        a1, a2 = await pool.acquire("acme", 1.0), await pool.acquire("acme", 1.0)
        t0 = time.monotonic()
        assert await pool.acquire("acme", 0.2) is None, "a third buffer for one tenant of a pool of 4"
        assert 0.15 < time.monotonic() - t0 < 1.0
        g1, g2 = await pool.acquire("globex", 1.0), await pool.acquire("globex", 1.0)  # the other half
        assert g1 is not None and g2 is not None
        # A waiter gets the buffer its tenant gives back, in the order they came.
        first = asyncio.ensure_future(pool.acquire("acme", 5.0))
        second = asyncio.ensure_future(pool.acquire("initech", 5.0))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        pool.release("acme", a1)
        assert await asyncio.wait_for(first, 1.0) is a1
        assert not second.done(), "past acme's share, but the pool is full: initech still waits"
        pool.release("globex", g1)
        assert await asyncio.wait_for(second, 1.0) is g1
        for tenant, buf in (("acme", a2), ("globex", g2)):
            pool.release(tenant, buf)

    asyncio.run(run())


def test_lent_buffers_are_bounded_per_tenant_and_in_all():
    async def run():
        pool = ScratchPool(4, 64)
        lent = []
        for _ in range(2):
            buf = await pool.acquire("acme", 1.0)
            assert pool.lend("acme")
            lent.append(buf)
        buf = await pool.acquire("acme", 1.0)  # lent ones leave the pool: a fresh buffer for the next read
        assert buf is not None and all(buf is not b for b in lent)
        assert not pool.lend("acme"), "past acme's share of lent buffers"
        pool.release("acme", buf)
        for _ in range(2):
            b = await pool.acquire("globex", 1.0)
            assert pool.lend("globex")
        b = await pool.acquire("initech", 1.0)
        assert not pool.lend("initech"), "past the lent buffers of the whole pool"
        pool.release("initech", b)
        for b in lent:
            pool.returned("acme", b)
        b = await pool.acquire("initech", 1.0)
        assert pool.lend("initech"), "a lent buffer came back: there is room again"

    asyncio.run(run())


def test_a_cancelled_wait_gives_back_what_it_was_handed():
    async def run():
        pool = ScratchPool(2, 64, share=1)
        a = await pool.acquire("acme", 1.0)
        waiter = asyncio.ensure_future(pool.acquire("acme", 5.0))
        await asyncio.sleep(0.01)
        pool.release("acme", a)  # handed to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await pool.acquire("acme", 0.1) is not None, "the handed-over place was lost"

    asyncio.run(run())
