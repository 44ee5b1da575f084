"""``IOLanes``, the server's I/O threads: one tenant's jobs held up hold no other tenant's, lanes take
turns, and urgent jobs never wait for a bulk one (audit s29 a1 D2, D5)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.server.io_lanes import IOLanes, Stopped

WAIT_S = 30


@pytest.fixture
def lanes():
    io = IOLanes(4, "test-io")  # as the server's
    yield io
    io.shutdown()


def _started(started: list, n: int) -> list:
    deadline = time.monotonic() + WAIT_S
    while len(started) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # (no more start meanwhile)
    return list(started)


def test_a_lane_held_up_holds_no_other_lanes_job(lanes):
    """One tenant's deletions on a slow disk (held here) run on two threads at most; another
    tenant's deletion and a read run beside them at once. A third tenant's deletion, with no
    thread left to bulk jobs, takes the first one that ends, before the first tenant's next."""
    gates = [threading.Event() for _ in range(6)]
    started: list = []

    def slow(i: int) -> None:
        started.append(i)
        assert gates[i].wait(WAIT_S)

    mine = [lanes.submit("acme", slow, i) for i in range(len(gates))]
    assert _started(started, 2) == [0, 1], "acme alone: two threads"
    assert lanes.submit("globex", lambda: "deleted").result(WAIT_S) == "deleted"
    assert lanes.submit("globex", lambda: "read", urgent=True).result(WAIT_S) == "read"
    held = threading.Event()
    theirs = lanes.submit("globex", held.wait, WAIT_S)  # globex's first: it runs beside acme's two
    third = lanes.submit("initech", started.append, "initech")
    assert lanes.submit("acme", lambda: "own read", urgent=True).result(WAIT_S) == "own read"
    assert _started(started, 2) == [0, 1], "no thread left to bulk jobs: initech's waits"
    gates[0].set()
    assert third.result(WAIT_S) is None
    assert started[:3] == [0, 1, "initech"], "initech's job took the first thread free, before acme's next"
    held.set()
    for gate in gates:
        gate.set()
    assert theirs.result(WAIT_S)
    for f in mine:
        f.result(WAIT_S)
    assert started[3:] == [2, 3, 4, 5], "a lane's jobs start in order"


def test_lanes_take_turns():
    io = IOLanes(2, "test-io")  # one thread for bulk jobs: the lanes' turns decide the order
    try:
        gate = threading.Event()
        order: list[str] = []
        held = io.submit("held", gate.wait, WAIT_S)
        queued = [io.submit(lane, order.append, f"{lane}{i}")
                  for lane, i in [("acme", 0), ("acme", 1), ("acme", 2), ("globex", 0), ("initech", 0)]]
        gate.set()
        assert held.result(WAIT_S)
        for f in queued:
            f.result(WAIT_S)
        assert order == ["acme0", "globex0", "initech0", "acme1", "acme2"]
    finally:
        io.shutdown()


def test_urgent_jobs_run_while_every_bulk_thread_is_held(lanes):
    gate = threading.Event()
    held = [lanes.submit(lane, gate.wait, WAIT_S) for lane in ("acme", "globex", "acme")]  # both bulk threads
    read = lanes.submit("globex", lambda: "read", urgent=True)
    own = lanes.submit("acme", lambda: "own read", urgent=True)
    assert read.result(WAIT_S) == "read" and own.result(WAIT_S) == "own read"
    assert not any(f.done() for f in held), "the bulk jobs were held: the urgent ones ran beside them"
    gate.set()
    assert all(f.result(WAIT_S) for f in held)


def test_a_failing_job_hands_its_exception_to_its_waiter(lanes):
    def fails():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        lanes.submit("acme", fails).result(WAIT_S)
    assert lanes.submit("acme", lambda: 7).result(WAIT_S) == 7


def test_shutdown_runs_what_is_queued_then_refuses():
    io = IOLanes(2, "test-io")
    gate = threading.Event()
    ran = []
    io.submit("acme", gate.wait, WAIT_S)
    queued = [io.submit(lane, ran.append, lane) for lane in ("acme", "globex", "(sweep)")]
    threading.Timer(0.2, gate.set).start()
    io.shutdown(wait=True)
    assert all(f.done() for f in queued) and sorted(ran) == ["(sweep)", "acme", "globex"]
    with pytest.raises(Stopped):
        io.submit("acme", ran.append, "late")


def test_one_thread_is_refused():
    with pytest.raises(ValueError, match="2 threads or more"):
        IOLanes(1, "test-io")
