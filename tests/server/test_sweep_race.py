"""The TTL sweeper against a PUT of a key it is about to delete: ``Service.sweep`` (an I/O thread)
takes a snapshot of the expired keys, then drops them one by one. A key put again meanwhile
(``resolve`` drops the expired copy, the PUT indexes a fresh one, acknowledged) was deleted when the
sweep reached it. Real ``kvtier serve``; 60 000 expired blocks ahead of the victim make the sweep
long enough to put it again in the middle."""

from __future__ import annotations

import time

import numpy as np

from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from kvtier.tiers.remote_protocol import Op, unpack_msgpack
from tests.server.conftest import block, frame, keys_for, logged_in, read_frame, remote
from tests.server.harness import SHARED, TOKENS, tenants

N_BULK = 60_000  # expired blocks ahead of the victim in the sweep's list (the sweep's limit is 100 000)
VICTIM_TTL_S = 3.0


def test_the_sweeper_leaves_a_block_put_again_while_it_sweeps(tmp_path):
    srv = ServerProcess.start(
        tenants(acme={"namespace_ttl_s": {"bulk": 1.0, "victim": VICTIM_TTL_S}}), shared=SHARED,
        workdir=str(tmp_path), server={"capacity": "64MiB", "max_block": "1MiB", "sweep_interval_s": 7.0})
    try:
        bulk = remote(srv, "acme", namespace="bulk")
        victim = remote(srv, "acme", namespace="victim")
        ks = keys_for("bulk", N_BULK)
        tiny = [np.zeros(64, np.uint8)] * N_BULK
        k = keys_for("victim", 1)[0]
        # The sweep goes namespace by namespace in the order they were first written: "bulk" first.
        # The victim is put at once, so that it has expired when the first sweep (at 7 s) starts.
        assert bulk.put(ks[0], tiny[0]) is Status.OK and victim.put(k, block(k, 4096)) is Status.OK
        for i in range(1, N_BULK, 4096):
            assert set(bulk.put_many(ks[i:i + 4096], tiny[i:i + 4096])) == {Status.OK}
        stats = logged_in(srv.tcp_url, TOKENS["acme"], "bulk")

        def bulk_left() -> int:
            stats.sendall(frame(Op.STATS))
            return unpack_msgpack(read_frame(stats)[1], "STATS")["namespace_blocks"]

        deadline = time.monotonic() + 20
        while bulk_left() == N_BULK:  # the first sweep has begun
            assert time.monotonic() < deadline, "no sweep"
        assert victim.put(k, block(k, 4096)) is Status.OK  # the old copy expired: a fresh block
        put_at = time.monotonic()
        assert bulk_left() > 0, "the sweep ended before the PUT: it raced nothing"
        out = np.zeros(4096, np.uint8)
        assert victim.get(k, out) is Status.OK
        previous = -1
        while (left := bulk_left()) != previous:  # until the sweep is over
            previous = left
            time.sleep(0.2)
        assert time.monotonic() - put_at < VICTIM_TTL_S - 0.5, "the sweep outlasted the fresh block's TTL: no verdict"
        assert victim.contains(k), "the sweeper deleted a block put again (and acknowledged) during its sweep"
        assert victim.get(k, out) is Status.OK and np.array_equal(out, block(k, 4096))
    finally:
        srv.stop()
