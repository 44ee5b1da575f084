"""Admission at the router: a worker is sent about one prefill step of tokens at a time; the
rest of its requests wait in the router, the soonest-finishing first.

Why: vLLM prefills its waiting queue first come first served in steps of at most
``max_num_batched_tokens`` (2048 on CPU) and answers every request of a step when the step
ends. Requests that arrive together (a burst) are therefore answered in arrival order: a
small request that happened to arrive behind a large one waits for all of the large one's
prefill. The router sees the whole queue of each worker and knows each request's predicted
uncached tokens, so it can keep the engine's own queue short (about one step) and hand it
the held requests in a better order. Holding costs the engine nothing as long as it has a
step's worth of work queued; what is saved is the wait of the short requests.

Order: the earliest *virtual finish* first, ``key = arrival + predicted prefill seconds``.
Among requests that arrived together that is shortest first (which minimises the summed
waiting of a batch on one server); a request that has waited longer than a newcomer's whole
prefill goes before it, so a large request cannot be starved by a stream of small ones.

Mechanism only: the router decides the worker first (the policy), then admits through that
worker's queue. ``cap_tokens`` 0 turns it off (every request is sent at once, as before).
Off by default (``--admission-tokens``): on the trace bench (BENCHMARKS.md, issue 14) one
step's cap cut the baseline's plain vLLM workers' TTFT p50 to 0.69x but did not help the
workers with the kvtier connector, whose loads start only once a request is sent.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any


class AdmissionQueue:
    """One worker's admission: ``sent_tokens`` predicted uncached tokens sent and not yet
    answered (no first byte), at most ``cap_tokens`` of them unless a single request is larger
    (it then goes alone); the others held here, ordered by their keys."""

    __slots__ = ("cap_tokens", "sent_tokens", "_held", "_seq")

    def __init__(self, cap_tokens: int) -> None:
        if cap_tokens < 0:
            raise ValueError(f"admission cap must be >= 0 tokens (0: off), got {cap_tokens}")
        self.cap_tokens = cap_tokens
        self.sent_tokens = 0
        self._held: list[tuple[float, int, int, Any]] = []   # (key, arrival order, tokens, item)
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Requests held here."""
        return len(self._held)

    def _fits(self, tokens: int) -> bool:
        return self.cap_tokens == 0 or self.sent_tokens == 0 or self.sent_tokens + tokens <= self.cap_tokens

    def offer(self, tokens: int, key: float, item: Any) -> bool:
        """True: send the request now (counted as sent). False: it is held; :meth:`done` returns
        it when its turn comes. A newcomer never overtakes held requests by fitting a gap."""
        tokens = max(0, tokens)
        if not self._held and self._fits(tokens):
            self.sent_tokens += tokens
            return True
        heapq.heappush(self._held, (key, next(self._seq), tokens, item))
        return False

    def done(self, tokens: int) -> list[Any]:
        """A sent request was answered (first byte) or failed: its ``tokens`` leave the worker's
        queue. Returns the held items now sent, in order (each counted as sent)."""
        self.sent_tokens = max(0, self.sent_tokens - max(0, tokens))
        released = []
        while self._held and self._fits(self._held[0][2]):
            _, _, n, item = heapq.heappop(self._held)
            self.sent_tokens += n
            released.append(item)
        return released

    def withdraw(self, item: Any) -> bool:
        """Drop a held item (its client went away); False if it is no longer held."""
        for i, entry in enumerate(self._held):
            if entry[3] is item:
                self._held[i] = self._held[-1]
                self._held.pop()
                heapq.heapify(self._held)
                return True
        return False


class AsyncAdmission:
    """:class:`AdmissionQueue` for the router's request handlers: ``await admit(...)`` returns
    when the request may be sent; every admitted request must call :meth:`done` exactly once."""

    def __init__(self, cap_tokens: int) -> None:
        self.queue = AdmissionQueue(cap_tokens)

    @property
    def held(self) -> int:
        return len(self.queue)

    async def admit(self, tokens: int, key: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        if self.queue.offer(tokens, key, waiter):
            return
        try:
            await waiter
        except asyncio.CancelledError:
            if not self.queue.withdraw(waiter):
                # released in the same moment it was cancelled: it counts as sent, so give it back
                self.done(tokens)
            raise

    def done(self, tokens: int) -> None:
        for waiter in self.queue.done(tokens):
            if not waiter.done():
                waiter.set_result(None)
