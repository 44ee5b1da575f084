"""An erase while the Mooncake fleet does not answer, on a server with a ``state_dir`` and no disk:
the erased blocks stay erased across a crash and restart (their removal owed, the fleet journal still
holding their records), the audit line says what was refused, and blocks that were never placed in the
fleet (DRAM only) are erased and deleted, not reported left in the fleet. Real processes:
mooncake_master (frozen with SIGSTOP), a segment holder, the kvtier server, clients over TCP.
(s31 a2 D1, D2, D3)"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import SLOT, _readable_in_fleet, _serve, cluster  # noqa: F401
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


def _fleet_only(tmp_path) -> dict:
    """No disk: the journal and the runtime state live in ``state_dir``."""
    return {"mooncake_timeout_s": 0.5, "state_dir": str(tmp_path / "state"), "audit_log": str(tmp_path / "audit.jsonl")}


def _served(srv, namespace: str, keys) -> list[bytes]:
    acme = remote(srv, "acme", namespace=namespace)
    try:
        outs = [np.zeros(SLOT, np.uint8) for _ in keys]
        statuses = acme.get_many(keys, outs)
        return [k for k, s, o in zip(keys, statuses, outs) if s is Status.OK and np.array_equal(o, block(k, SLOT))]
    finally:
        acme.close()


def _audited_erase(tmp_path) -> dict:
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("cmd") == "erase"][-1]


def _put_spilling(tmp_path, srv, ns: str, keys) -> int:
    """Put ``keys`` (DRAM holds 4, the others go to the fleet); how many the journal records."""
    acme = remote(srv, "acme", namespace=ns)
    try:
        assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * len(keys)
    finally:
        acme.close()
    time.sleep(1.0)  # the spills into the fleet landed
    journal = (tmp_path / "state" / "fleet.journal").read_bytes()
    placed = sum(k in journal for k in keys)
    assert placed >= len(keys) - 4, "control: the blocks DRAM has no room for went to the fleet"
    return placed


def test_an_erase_the_fleet_did_not_answer_stays_done_across_a_crash(tmp_path, cluster):  # noqa: F811
    ns = "owed-across-restart"
    keys = keys_for(ns, 12)
    srv = _serve(tmp_path, cluster, **_fleet_only(tmp_path))
    try:
        _put_spilling(tmp_path, srv, ns, keys)
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": ns})
            srv.proc.kill()  # a crash (or a supervisor's kill -9) while the fleet still does not answer
            srv.proc.wait()
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
    finally:
        srv.stop()
    assert reply["ok"] and reply.get("refused", 0) >= 8, reply  # control: the removals are owed

    with _serve(tmp_path, cluster, **_fleet_only(tmp_path)) as srv:
        served = _served(srv, ns, keys)
        assert not served, f"{len(served)} erased blocks are served again after the restart"
        left = _readable_in_fleet(cluster, ns, keys)
        assert not any(left), f"{sum(left)} erased blocks are still readable in the fleet after the restart"
        journal = (tmp_path / "state" / "fleet.journal").read_bytes()
        assert not any(k in journal for k in keys) and ns.encode() not in journal


def test_the_audit_line_of_an_erase_the_fleet_did_not_answer_counts_the_refused(tmp_path, cluster):  # noqa: F811
    ns = "audited-owed"
    keys = keys_for(ns, 12)
    with _serve(tmp_path, cluster, **_fleet_only(tmp_path)) as srv:
        placed = _put_spilling(tmp_path, srv, ns, keys)
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": ns})
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
    assert reply["ok"] and reply.get("refused", 0) >= placed, reply  # control: the removals are owed
    audited = _audited_erase(tmp_path)
    assert (audited["erased"], audited.get("refused")) == (reply["erased"], reply["refused"]), \
        f"the audit line of a partly refused erase reads as done: {audited}"


def test_blocks_never_placed_in_the_fleet_are_erased_and_deleted_during_its_outage(tmp_path, cluster):  # noqa: F811
    with _serve(tmp_path, cluster, **_fleet_only(tmp_path)) as srv:
        acme = remote(srv, "acme", namespace="dram-only")
        try:
            erased_keys, deleted_keys = keys_for("dram-only-erased", 2), keys_for("dram-only-deleted", 2)
            both = erased_keys + deleted_keys  # DRAM holds 4: nothing goes to the fleet
            assert acme.put_many(both, [block(k, SLOT) for k in both]) == [Status.OK] * 4
            time.sleep(1.0)
            journal = (tmp_path / "state" / "fleet.journal").read_bytes()
            assert not any(k in journal for k in both), "control: none of them was placed in the fleet"
            os.killpg(cluster.master.pid, signal.SIGSTOP)
            try:
                deleted = acme.delete_many(deleted_keys)
                reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "dram-only"})
            finally:
                os.killpg(cluster.master.pid, signal.SIGCONT)
            assert deleted == [True, True], "a tenant's DELETE of blocks only DRAM held answered not deleted"
            assert reply == {"ok": True, "erased": 2}, reply
            assert acme.get_many(both, [np.zeros(SLOT, np.uint8) for _ in both]) == [Status.MISS] * 4
        finally:
            acme.close()
