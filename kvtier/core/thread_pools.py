"""Thread pools whose threads run from the start, so that no request pays for starting one."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name-N``, all started now.

    A thread start waits until the new thread runs (on a busy machine: milliseconds);
    left to the first submits, it lands inside the first load that uses the pool. Each
    thread holds a task at a barrier until all exist, so that none is reused before the
    next starts.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    barrier = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(barrier.wait, 10.0)
    try:
        barrier.wait(10.0)
    except threading.BrokenBarrierError:  # a machine too busy to start them: they start on use
        pass
    return pool
