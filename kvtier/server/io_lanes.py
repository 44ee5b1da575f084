"""``IOLanes``: the server's I/O threads, shared fairly among tenants.

The event loop hands blocking work to a few threads: tier deletions (a disk unlink, a fleet
delete per block), reads from a lower tier, a reservation whose eviction writes to disk, the
retention sweep. Every job is queued in the *lane* of whoever caused it -- a tenant, the
sweeper, the admin API -- and the threads serve the lanes in turn (round robin), one job at a
time. In a plain thread pool (first come, first served) one tenant's work was queued ahead of
everyone's: 32 concurrent DELETEs of one tenant (jobs of 256 keys), or the deletions of its 16 k
expired blocks that one CONTAINS dropped, held another tenant's 1-key DELETE for 1.3 to 2.1 s.

* *Urgent* jobs (a client waits on one block: a lower-tier read, a reservation that evicts) go
  before the bulk ones of their lane, on any thread free.
* *Bulk* jobs (deletions, the sweep) leave a thread free for urgent ones: an urgent job finds
  one unless urgent jobs hold it, and never queues behind deletions.
* A lane's first bulk job takes any other thread free; its further ones run at once only while
  they leave a thread free for another lane's first one too, and no other lane's bulk job
  waits. Alone, a tenant's deletions run on two threads (of the server's 4), as in a plain
  pool; another tenant's deletion runs beside them at once. With more lanes at work than
  threads, a bulk job waits for the end of one job running, then for one job of each lane
  ahead of it in turn. Jobs are kept short for that: the service's deletion jobs end after 256
  keys or 50 ms (kvtier/server/service.py), where 256 deletions on a slow disk, or behind the
  write-behind copies of their blocks, took seconds.

Thread safe. :meth:`IOLanes.shutdown` runs every job already queued; a job submitted after it
raises :class:`Stopped`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

#: lanes of the server's own work (a tenant's name never holds parentheses)
SWEEP_LANE = "(sweep)"
ADMIN_LANE = "(admin)"
EVICTION_LANE = "(evictions)"


class Stopped(RuntimeError):
    """A job submitted once :meth:`IOLanes.shutdown` was called (the server is stopping)."""


class _Lane:
    __slots__ = ("urgent", "bulk", "running", "bulk_running")

    def __init__(self) -> None:
        self.urgent: deque = deque()
        self.bulk: deque = deque()
        self.running = 0  # its jobs running now
        self.bulk_running = 0  # those of them bulk

    def idle(self) -> bool:
        return not (self.urgent or self.bulk or self.running)


class IOLanes:
    """``workers`` threads (at least 2) serving one FIFO queue per lane, the lanes in turn; a bulk job
    starts only with a thread left free for urgent ones, a lane's second only with one more left
    free for another lane's bulk job and while none waits."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 2:
            raise ValueError(f"IOLanes needs 2 threads or more (one kept for urgent jobs), got {workers}")
        self.workers = workers
        self._running = 0  # jobs running now
        self._cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}  # lanes with jobs queued or running
        self._turns: deque[str] = deque()  # the lanes with work queued, in the order they are served next
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, lane: str, fn: Callable[..., Any], *args, urgent: bool = False) -> Future:
        """Queue ``fn(*args)`` in ``lane``; its future. Raises :class:`Stopped` after shutdown."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise Stopped("the server's I/O threads are shut down")
            queued = self._lanes.setdefault(lane, _Lane())
            if not (queued.urgent or queued.bulk):
                self._turns.append(lane)
            (queued.urgent if urgent else queued.bulk).append((future, fn, args))
            self._cond.notify()  # (threads are alike: one that cannot run it now, none can)
        return future

    async def run(self, lane: str, fn: Callable[..., Any], *args, urgent: bool = False) -> Any:
        """:meth:`submit`, awaited on the event loop."""
        return await asyncio.wrap_future(self.submit(lane, fn, *args, urgent=urgent))

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new jobs; the threads end once every queued one has run (``wait``: joined)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _may_run(self, queued: _Lane) -> bool:
        """Whether the next job of the lane ``queued`` may start now."""
        if queued.urgent:
            return True
        if not queued.bulk:
            return False
        if not queued.bulk_running:
            return self._running + 1 < self.workers  # a thread left free for urgent jobs
        # (and one for another lane's first bulk job, whom none may be waiting for now)
        return self._running + 2 < self.workers and not any(map(self._bulk_waits, self._lanes.values()))

    @staticmethod
    def _bulk_waits(queued: _Lane) -> bool:
        """A bulk job of this lane is queued and none of its runs: it goes before any lane's second."""
        return bool(queued.bulk) and not queued.bulk_running

    def _next_locked(self):
        """(lane, job, urgent) to run now, or None: the first lane in turn with a job that may run;
        it goes to the back of the turns if it has more queued. A lane passed over keeps its place."""
        for lane in self._turns:
            queued = self._lanes[lane]
            if self._may_run(queued):
                break
        else:
            return None
        self._turns.remove(lane)
        urgent = bool(queued.urgent)
        job = (queued.urgent if urgent else queued.bulk).popleft()
        queued.running += 1
        self._running += 1
        if not urgent:
            queued.bulk_running += 1
        if queued.urgent or queued.bulk:
            self._turns.append(lane)
        return lane, job, urgent

    def _finished_locked(self, lane: str, urgent: bool) -> None:
        queued = self._lanes[lane]
        queued.running -= 1
        self._running -= 1
        if not urgent:
            queued.bulk_running -= 1
        if queued.idle():
            del self._lanes[lane]
        if self._stopping:  # the last job may have ended: the threads waiting end too
            self._cond.notify_all()
        # (otherwise the job one more may run now is this thread's next)

    def _work(self) -> None:
        while True:
            with self._cond:
                while (picked := self._next_locked()) is None:
                    if self._stopping and not self._turns:
                        return  # nothing is left to run
                    self._cond.wait()
            lane, (future, fn, args), urgent = picked
            try:
                self._run(future, fn, args)
            finally:
                with self._cond:
                    self._finished_locked(lane, urgent)

    @staticmethod
    def _run(future: Future, fn, args) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits, as an executor does
            future.set_exception(exc)
        else:
            future.set_result(result)
