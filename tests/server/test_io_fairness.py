"""The server's tier deletions on its I/O threads: fair among tenants, safe against a PUT of the
same key, quiet at a stop (regression audit s29 a1 D1, D3, D5).

The real server, in this process so that its deletions can be held or slowed (a slow disk or
fleet, a loaded machine), over real sockets with the real client. What a test waits for is an
event of the server's, not a lucky timing.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvtier.server.auth import KeySpace
from kvtier.server.service import DELETE_JOB_KEYS
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for
from tests.server.inprocess import InProcessServer

WAIT_S = 30


def _expired(srv, who: str, namespace: str, n: int, ttl_s: float) -> list[bytes]:
    """``n`` one-page blocks of ``who``'s, put and left to expire (the sweeper is off)."""
    keys = keys_for(f"{namespace}-expiring", n)
    tier = srv.remote(who, namespace=namespace, timeout_s=WAIT_S)
    for i in range(0, n, 512):
        assert set(tier.put_many(keys[i : i + 512], [block(k, 512) for k in keys[i : i + 512]])) == {Status.OK}
    time.sleep(ttl_s + 0.2)
    return keys


def test_a_tenants_expired_blocks_do_not_hold_another_tenants_delete(tmp_path):
    """One CONTAINS over a tenant's 2,048 expired blocks queued one I/O job per block, and another
    tenant's 1-key DELETE waited behind all of them (2.1 s over a real disk). They go in batches
    of DELETE_JOB_KEYS in their tenant's lane now: the other tenant's job runs after at most two
    of them."""
    n = 8 * DELETE_JOB_KEYS
    srv = InProcessServer(tmp_path, {"acme": {"ttl_s": 1}}, capacity="32MiB", sweep_interval_s=3600)
    try:
        keys = _expired(srv, "acme", "scratch", n, ttl_s=1)
        ran = srv.slow_deletions(0.001)
        acme = srv.remote("acme", namespace="scratch", timeout_s=WAIT_S)
        assert not any(acme.contains_many(keys))  # every block expired: each dropped
        globex = srv.remote("globex", timeout_s=WAIT_S)
        mine = keys_for("globex-one", 1)
        assert globex.put_many(mine, [block(mine[0], 512)]) == [Status.OK]
        assert globex.delete_many(mine) == [True]
        ahead = len(ran)
        deadline = time.monotonic() + WAIT_S
        while len(ran) < n + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ran) == n + 1, "the expired blocks' deletions all run in the end"
        assert ahead <= 3 * DELETE_JOB_KEYS, f"globex's DELETE ran behind {ahead - 1} of acme's {n} deletions"
    finally:
        srv.stop()


def test_concurrent_deletes_of_one_tenant_do_not_hold_another_tenants_delete(tmp_path):
    """DELETE_JOB_KEYS interleaved one tenant's DELETE with others only per request: 12 concurrent
    DELETEs of one tenant kept their jobs queued ahead of another tenant's 1-key DELETE (32 of
    them: 1.3 s). A tenant's DELETEs share its lane now: once globex's arrives, it takes the
    first bulk thread free, and only the jobs of acme's running then go before it. (acme's get a
    head start of 0.5 s to queue theirs; its first job is held until globex's DELETE is sent.)"""
    conns, part = 12, DELETE_JOB_KEYS
    srv = InProcessServer(tmp_path, capacity="32MiB")
    try:
        keys = keys_for("bulk", conns * part)
        acme = srv.remote("acme", namespace="bulk", timeout_s=WAIT_S)
        for i in range(0, len(keys), 512):
            assert set(acme.put_many(keys[i : i + 512], [block(k, 512) for k in keys[i : i + 512]])) == {Status.OK}
        first_job, sent = threading.Event(), threading.Event()

        def before(_skey):
            if not first_job.is_set():
                first_job.set()
                assert sent.wait(WAIT_S)
            time.sleep(0.001)

        ran = srv.before_deletions(before)
        deleters = [threading.Thread(target=srv.remote("acme", namespace="bulk", timeout_s=WAIT_S).delete_many,
                                     args=(keys[i * part : (i + 1) * part],)) for i in range(conns)]
        for t in deleters:
            t.start()
        assert first_job.wait(WAIT_S)
        time.sleep(0.5)
        globex = srv.remote("globex", timeout_s=WAIT_S)
        mine = keys_for("globex-one", 1)
        assert globex.put_many(mine, [block(mine[0], 512)]) == [Status.OK]
        answered = []
        theirs = threading.Thread(target=lambda: answered.append(globex.delete_many(mine)))
        before_theirs = len(ran)
        theirs.start()
        time.sleep(0.2)
        sent.set()
        theirs.join(WAIT_S)
        for t in deleters:
            t.join(WAIT_S)
        assert answered == [[True]] and len(ran) == conns * part + 1
        ahead = ran.index(KeySpace.of("globex", globex.namespace).storage_key(mine[0])) - before_theirs
        assert ahead <= 2 * part, f"globex's DELETE ran behind {ahead} more of acme's {conns * part} deletions"
    finally:
        srv.stop()


def test_a_put_after_a_delete_is_stored_while_an_expired_copy_is_still_being_deleted(tmp_path):
    """Audit s29 a1 D3: a DELETE job's erase of a key whose expired copy a GET had dropped (its
    deletion still running) took the key's one slot of deletions under way and cleared it. The
    PUT of the key after the DELETE was answered waited for nothing, found the old copy still in
    DRAM, was acknowledged OK and stored nothing, and the old deletion then removed the copy."""
    srv = InProcessServer(tmp_path, {"acme": {"ttl_s": 1}}, capacity="16MiB", max_block="1MiB", sweep_interval_s=3600)
    try:
        keys = _expired(srv, "acme", "del", DELETE_JOB_KEYS + 1, ttl_s=1)  # two DELETE jobs: k is in the second
        k = keys[-1]
        k_skey = KeySpace.of("acme", "del").storage_key(k)
        delete_running, k_dropped, release_k = threading.Event(), threading.Event(), threading.Event()

        def before(skey):
            if skey == k_skey:  # the expired copy's deletion: a slow disk
                assert release_k.wait(WAIT_S)
            elif not delete_running.is_set():  # the DELETE's first job, until the GET dropped k
                delete_running.set()
                assert k_dropped.wait(WAIT_S)

        ran = srv.before_deletions(before)
        deleted = []
        deleter = threading.Thread(
            target=lambda: deleted.append(srv.remote("acme", namespace="del", timeout_s=WAIT_S).delete_many(keys)))
        deleter.start()
        assert delete_running.wait(WAIT_S)
        reader = srv.remote("acme", namespace="del", timeout_s=WAIT_S)
        assert reader.get(k, np.zeros(512, np.uint8)) is Status.MISS  # expired: dropped, its deletion held
        k_dropped.set()

        acme = srv.remote("acme", namespace="del", timeout_s=WAIT_S)
        put = []
        putter = threading.Thread(target=lambda: put.append(acme.put_many([k], [block(k, 512)])))
        deleter.join(2.0)
        if deleted:  # answered while k's deletion runs: the PUT goes now (it must wait for that deletion)
            putter.start()
            putter.join(2.0)
        release_k.set()
        deleter.join(WAIT_S)
        if putter.ident is None:  # (not started yet)
            putter.start()
        putter.join(WAIT_S)
        assert deleted and put == [[Status.OK]]
        deadline = time.monotonic() + WAIT_S
        while k_skey not in ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert k_skey in ran, "the expired copy's deletion ran"
        out = np.zeros(512, np.uint8)
        assert acme.contains_many([k]) == [True], "a PUT acknowledged after the DELETE answered was never stored"
        assert acme.get(k, out) is Status.OK and np.array_equal(out, block(k, 512))
    finally:
        srv.stop()


def test_a_stop_during_a_deletes_jobs_logs_no_error(tmp_path, caplog):
    """Audit s29 a1 D1: the stop closed the connections but left their tasks running and shut the
    I/O threads down; a DELETE partway through its jobs then sent its next one to them and logged
    "internal error on connection" (RuntimeError: cannot schedule new futures after shutdown).
    The tasks are cancelled and awaited first now."""
    caplog.set_level(logging.ERROR)
    srv = InProcessServer(tmp_path, capacity="16MiB")
    stopping = threading.Event()
    try:
        keys = keys_for("stop-mid-delete", 3 * DELETE_JOB_KEYS)
        acme = srv.remote("acme", namespace="big", timeout_s=WAIT_S)
        assert set(acme.put_many(keys, [block(k, 512) for k in keys])) == {Status.OK}
        first_job = threading.Event()

        def before(_skey):  # the DELETE's first job runs until the I/O threads are being shut down
            if not first_job.is_set():
                first_job.set()
                assert stopping.wait(WAIT_S)

        srv.before_deletions(before)
        real_close = srv.service.close

        def close():
            stopping.set()
            real_close()

        srv.service.close = close

        def delete():
            try:
                srv.remote("acme", namespace="big", timeout_s=WAIT_S).delete_many(keys)
            except Exception:  # noqa: BLE001 - the server stops under it
                pass

        deleter = threading.Thread(target=delete)
        deleter.start()
        assert first_job.wait(WAIT_S)
    finally:
        srv.stop()
        stopping.set()
    deleter.join(WAIT_S)
    assert srv.server.shutdown_report is not None, "the stop did not finish"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, f"the stop mid-DELETE logged: {errors}"


def _drop_one_batch(srv, namespace: str) -> tuple:
    """A batch of DELETE_JOB_KEYS expired blocks of acme's, dropped by one CONTAINS, whose
    deletions take 10 ms each (a slow disk or fleet): acme's tier, the keys, the deletions run."""
    keys = _expired(srv, "acme", namespace, DELETE_JOB_KEYS, ttl_s=1)
    ran = srv.before_deletions(lambda _: time.sleep(0.01))
    acme = srv.remote("acme", namespace=namespace, timeout_s=WAIT_S)
    assert not any(acme.contains_many(keys))  # every block expired: all dropped in one batch
    return acme, keys, ran


def _all_run(ran: list, n: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while len(ran) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(ran) == n


def test_a_put_of_a_dropped_key_waits_for_its_own_deletion_only(tmp_path):
    """A dropped key's deletion was its batch's: a PUT of the key waited for all DELETE_JOB_KEYS
    deletions (2.6 s). The PUT now takes its key out of the batch and deletes it at once, even the
    batch's last; the batch skips it later (else it would delete the new copy)."""
    srv = InProcessServer(tmp_path, {"acme": {"ttl_s": 1}}, capacity="8MiB", sweep_interval_s=3600)
    try:
        acme, keys, ran = _drop_one_batch(srv, "batch")
        last = keys[-1]
        t0 = time.monotonic()
        assert acme.put_many([last], [block(last, 512)]) == [Status.OK]
        waited = time.monotonic() - t0
        assert waited < 0.5, f"the PUT waited {waited:.2f} s, behind {len(ran)} deletions of other keys"
        assert _all_run(ran, len(keys)), "every dropped block is deleted"
        # (the new copy's TTL runs out meanwhile: the deletions are counted, not the copy read)
        assert ran.count(KeySpace.of("acme", "batch").storage_key(last)) == 1, "the PUT's copy was deleted too"
    finally:
        srv.stop()


def test_a_put_of_a_dropped_key_is_answered_within_the_frame_timeout(tmp_path):
    """The PUT waits in its receive phase, where its frame deadline runs: behind a whole batch of
    deletions, a PUT under frame_timeout_s=1 failed (TIMEOUT)."""
    srv = InProcessServer(tmp_path, {"acme": {"ttl_s": 1}}, capacity="8MiB", sweep_interval_s=3600,
                          frame_timeout_s=1)
    try:
        acme, keys, _ = _drop_one_batch(srv, "frame")
        assert acme.put_many(keys[:1], [block(keys[0], 512)]) == [Status.OK]
    finally:
        srv.stop()
