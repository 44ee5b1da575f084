"""An erase while the Mooncake fleet does not answer: the reply says which blocks are not erased yet
(it answered ``erased: 12`` with no error while every other server of the fleet still read them
whole), the server never serves them meanwhile, and once the fleet answers again the owed removals
land on their own -- no later delete needed -- and the fleet journal keeps no record of them.
Real processes: mooncake_master (frozen with SIGSTOP), a segment holder, the kvtier server, clients
over TCP. (s30 a10 D4)"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from kvtier.cli.admin import admin_call
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import SLOT, _readable_in_fleet, _serve, cluster  # noqa: F401

NAMESPACE = "outage-erased-ns"


def _wait_for(check, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_an_erase_the_fleet_did_not_answer_is_refused_then_done_once_it_answers(tmp_path, cluster):  # noqa: F811
    journal = tmp_path / "state" / "fleet.journal"
    with _serve(tmp_path, cluster, mooncake_timeout_s=0.5, disk_dir=str(tmp_path / "disk"),
                disk_capacity=f"{2 * SLOT + 8192}", state_dir=str(tmp_path / "state")) as srv:
        acme = remote(srv, "acme", namespace=NAMESPACE)
        try:
            keys = keys_for("outage-erase", 12)
            assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
            time.sleep(1.0)  # the spills into the fleet (write-behind) landed
            in_fleet = sum(k in journal.read_bytes() for k in keys)
            assert in_fleet >= 8, "control: DRAM holds 4 blocks, the disk 2: the others went to the fleet"
            os.killpg(cluster.master.pid, signal.SIGSTOP)
            try:
                reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": NAMESPACE})
                frozen = acme.get_many(keys, [np.zeros(SLOT, np.uint8) for _ in keys])
            finally:
                os.killpg(cluster.master.pid, signal.SIGCONT)
            assert reply["ok"] and reply.get("refused", 0) >= in_fleet, reply
            assert reply["erased"] + reply["refused"] == 12, reply
            assert "Mooncake fleet" in reply.get("error", "") and "did not answer" in reply["error"], reply
            assert frozen == [Status.MISS] * 12, "a block whose erasure is owed was served"
            assert acme.get_many(keys, [np.zeros(SLOT, np.uint8) for _ in keys]) == [Status.MISS] * 12
            assert acme.lookup_prefix(keys) == 0

            # No further call to the server: its sweep retries what the fleet owes.
            def done() -> bool:
                return not any(_readable_in_fleet(cluster, NAMESPACE, keys))
            assert _wait_for(done, 30), "the owed removals never landed once the fleet answered again"

            def forgotten() -> bool:
                text = journal.read_bytes()
                return not any(k in text for k in keys) and NAMESPACE.encode() not in text
            assert _wait_for(forgotten, 10), "the erased blocks' records (clear keys, namespace) stay in the journal"
        finally:
            acme.close()
    assert not any(_readable_in_fleet(cluster, NAMESPACE, keys))


def test_control_an_erase_the_fleet_answers_is_done_at_once(tmp_path, cluster):  # noqa: F811
    journal = tmp_path / "state" / "fleet.journal"
    with _serve(tmp_path, cluster, mooncake_timeout_s=0.5, disk_dir=str(tmp_path / "disk"),
                disk_capacity=f"{2 * SLOT + 8192}", state_dir=str(tmp_path / "state")) as srv:
        acme = remote(srv, "acme", namespace=NAMESPACE)
        try:
            keys = keys_for("answered-erase", 12)
            assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
            time.sleep(1.0)
            assert sum(k in journal.read_bytes() for k in keys) >= 8
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": NAMESPACE})
            assert reply == {"ok": True, "erased": 12}, reply
            assert not any(_readable_in_fleet(cluster, NAMESPACE, keys))
            assert not any(k in journal.read_bytes() for k in keys)
        finally:
            acme.close()
