"""An admin erasure against a DELETE and a PUT of one of its keys (audit s30 a1 D2).

An erasure selects the blocks indexed when it begins, then removes them in jobs on the I/O threads,
other lanes' jobs in between. It removed them by key: a block its tenant deleted and put again
meanwhile (acknowledged, created after the erasure began, so beyond its tombstone too) was erased
with the old one's key, and counted as erased. The erasure now removes only the entries it
selected, as the TTL sweep does.

The real server, in this process (its deletions slowed: a slow disk, a loaded machine), over real
sockets: the real client and the admin API's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.cli.admin import admin_call
from kvtier.tiers.base import Status
from tests.server.conftest import keys_for
from tests.server.harness import TOKENS, fresh_namespace
from tests.server.inprocess import PAGE, InProcessServer

N_BLOCKS = 400
SLOW_DELETE_S = 0.005  # per block: the erasure takes 2 s
WAIT_S = 30


def test_an_erasure_leaves_a_block_deleted_and_put_again_while_it_runs(tmp_path):
    srv = InProcessServer(tmp_path, capacity="16MiB")
    try:
        ns = fresh_namespace()
        client = srv.remote("acme", namespace=ns, timeout_s=WAIT_S)
        keys = keys_for(ns, N_BLOCKS)
        for i in range(0, N_BLOCKS, 100):
            assert set(client.put_many(keys[i : i + 100], [np.full(PAGE, 1, np.uint8)] * 100)) == {Status.OK}
        ran = srv.slow_deletions(SLOW_DELETE_S)
        last, new = keys[-1], np.full(PAGE, 2, np.uint8)
        with ThreadPoolExecutor(1) as pool:
            erasing = pool.submit(admin_call, srv.url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": ns},
                                  timeout_s=WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while len(ran) < 20:
                assert time.monotonic() < deadline, "the erasure did not begin"
                time.sleep(0.01)
            assert client.delete_many([last]) == [True]
            assert client.put_many([last], [new]) == [Status.OK]
            assert len(ran) < N_BLOCKS - 10, "the erasure was over before the PUT: it raced nothing"
            answer = erasing.result(WAIT_S)
        assert answer["ok"], answer
        # Was: 400 erased, the block put again among them (GET: MISS).
        assert answer["erased"] == N_BLOCKS - 1
        out = np.zeros(PAGE, np.uint8)
        assert client.get(last, out) is Status.OK and np.array_equal(out, new)
        assert not any(client.contains_many(keys[:-1]))
    finally:
        srv.stop()
