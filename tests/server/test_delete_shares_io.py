"""One tenant's big DELETE does not hold the server's I/O threads from everyone else (real ``kvtier serve``).

A DELETE's held blocks are dropped on the server's two I/O threads (a disk spill costs system
calls per key). Dropped as one job per request, two 8192-key DELETEs of one tenant held both
threads for their whole run, and another tenant's 1-key DELETE (and disk GETs, evictions) waited
behind them: 1.25 s (audit s28 DOS). They run in jobs of ``DELETE_JOB_KEYS`` now.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.server.launch import ServerProcess
from kvtier.tiers.remote import RemoteTier
from tests.server.conftest import keys_for
from tests.server.harness import SHARED, TOKENS, tenants

N = 16384


def test_another_tenants_delete_is_not_queued_behind_a_big_delete(tmp_path):
    srv = ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path),
                              server={"capacity": "256MiB", "max_block": "1MiB", "disk_dir": str(tmp_path / "disk"),
                                      "disk_capacity": "1GiB", "insecure_plaintext": True})
    try:
        acme = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="big")
        keys = keys_for("big-delete", N)
        page = np.ones(4096, np.uint8)
        for i in range(0, N, 512):
            acme.put_many(keys[i : i + 512], [page] * len(keys[i : i + 512]))
        globex = RemoteTier(srv.tcp_url, TOKENS["globex"], namespace="small", timeout_s=60)
        mine = keys_for("small-delete", 1)[0]

        took: list[float] = []

        def attack(part):
            t = RemoteTier(srv.tcp_url, TOKENS["acme"], namespace="big", timeout_s=120)
            t0 = time.perf_counter()
            assert sum(t.delete_many(part)) == len(part)
            took.append(time.perf_counter() - t0)

        attackers = [threading.Thread(target=attack, args=(keys[: N // 2],)),
                     threading.Thread(target=attack, args=(keys[N // 2 :],))]
        for t in attackers:
            t.start()
        time.sleep(0.05)
        waits = []
        while any(t.is_alive() for t in attackers):
            globex.put(mine, page)
            t0 = time.perf_counter()
            assert globex.delete(mine)
            waits.append(time.perf_counter() - t0)
        for t in attackers:
            t.join()
        # Positive control: the big deletes took long enough to starve a queued request.
        assert len(took) == 2 and min(took) > 0.2, took
        assert waits, "no delete of the other tenant ran during the big ones"
        assert max(waits) < 0.25 * min(took), (f"a 1-key DELETE waited {max(waits):.3f} s behind another tenant's "
                                               f"DELETEs of {min(took):.3f} and {max(took):.3f} s")
    finally:
        srv.stop()
