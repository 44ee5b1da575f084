"""Deletes and erasures during a Mooncake fleet outage, of blocks this server never placed there.

A block demoted while the fleet is known down is never sent (the tier refuses it before any engine
call): its fleet record goes at once, so a DELETE of it answers deleted and an erase reports none of
them left in the fleet (they answered not deleted and ``refused``: the record made them count as
placed). A block this server holds only in DRAM may still have a copy in the fleet that another server
of the fleet (same secret: same names) placed: an erase during the outage passes its name on all the
same, and the copy is removed once the fleet answers (it stayed readable: only names with a record
here were passed on). Real processes: mooncake_master (frozen with SIGSTOP), a segment holder, one or
two kvtier servers, clients over TCP. (s31 r2 D1, D2)"""

from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest

from kvtier.cli.admin import admin_call
from kvtier.server.fleet_journal import JOURNAL_FILE, FleetJournal
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import TOKENS
from tests.server.test_fleet_erase_and_stalls import SLOT, _readable_in_fleet, _serve, cluster  # noqa: F401
from tests.server.test_fleet_erase_outage import _wait_for
from tests.server.test_fleet_outage_erase_restart import _fleet_only
from tests.tiers.mooncake_harness import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))


def _put(srv, ns: str, keys) -> None:
    acme = remote(srv, "acme", namespace=ns)
    try:
        assert acme.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * len(keys)
    finally:
        acme.close()


def _trip(srv, ns: str, key) -> None:
    """A read of a block in the frozen fleet: its call overruns and the tier knows the fleet down."""
    acme = remote(srv, "acme", namespace=ns)
    try:
        assert acme.get_many([key], [np.zeros(SLOT, np.uint8)]) != [Status.OK]
    finally:
        acme.close()


def _recorded(tmp_path, keys) -> int:
    """How many of ``keys`` the fleet journal holds a live record of (read from a copy of the file)."""
    copy = tmp_path / "journal-copy"
    shutil.copyfile(tmp_path / "state" / JOURNAL_FILE, copy)
    journal = FleetJournal(str(copy))
    try:
        return sum(any(k in record for _, record in journal.records()) for k in keys)
    finally:
        journal.close()


def test_blocks_demoted_while_the_fleet_is_known_down_are_deleted_and_erased(tmp_path, cluster):  # noqa: F811
    tripping, deleted, erased = keys_for("trip", 8), keys_for("demoted-deleted", 4), keys_for("demoted-erased", 4)
    with _serve(tmp_path, cluster, **_fleet_only(tmp_path)) as srv:
        _put(srv, "trip", tripping)  # DRAM holds 4: the first 4 go to the fleet
        time.sleep(1.0)
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            _trip(srv, "trip", tripping[0])
            # DRAM holds 4: each put evicts the 4 before it into a fleet known down
            _put(srv, "demoted-deleted", deleted)
            _put(srv, "demoted-erased", erased)
            _put(srv, "filler", keys_for("filler", 4))
            time.sleep(1.0)
            records = _recorded(tmp_path, deleted + erased)
            acme = remote(srv, "acme", namespace="demoted-deleted")
            try:
                answered = acme.delete_many(deleted)
            finally:
                acme.close()
            reply = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": "demoted-erased"})
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
    assert records == 0, f"{records} blocks the fleet never received keep a fleet record"
    assert answered == [True] * 4, f"a DELETE of blocks the fleet never received answered {answered}"
    assert reply["ok"] and reply["erased"] == 4 and not reply.get("refused"), reply


def test_an_erase_during_an_outage_removes_another_servers_copies_once_the_fleet_answers(tmp_path, cluster):  # noqa: F811
    ns = "shared-fleet"
    keys = keys_for(ns, 12)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with _serve(tmp_path / "b", cluster, **_fleet_only(tmp_path / "b")) as b, \
            _serve(tmp_path / "a", cluster, **_fleet_only(tmp_path / "a")) as a:
        _put(b, ns, keys)  # B: DRAM holds 4, the first 8 go to the fleet
        time.sleep(1.0)
        assert all(_readable_in_fleet(cluster, ns, keys[:4])), "control: B placed them in the fleet"
        _put(a, ns, keys[:4])  # A: the same blocks, in its DRAM only
        os.killpg(cluster.master.pid, signal.SIGSTOP)
        try:
            reply = admin_call(a.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme", "namespace": ns})
        finally:
            os.killpg(cluster.master.pid, signal.SIGCONT)
        assert reply["ok"] and reply["erased"] + reply.get("refused", 0) == 4, reply

        def removed() -> bool:
            return not any(_readable_in_fleet(cluster, ns, keys[:4]))
        assert _wait_for(removed, 30), "the copies another server placed stay readable after an erase of them"
