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
from typing import Any, Callable


#: a withdrawn entry's item: it stays in the heap until it comes to the top (lazy deletion)
_WITHDRAWN = object()


class AdmissionQueue:
    """One worker's admission: ``sent_tokens`` predicted uncached tokens sent and not yet
    answered (no first byte), at most ``cap_tokens`` of them unless a single request is larger
    (it then goes alone); the others held here, ordered by their keys.

    Items must be hashable and distinct (the router's are futures). A withdrawn item is marked,
    not searched for: its entry leaves the heap when it reaches the top, or when withdrawn
    entries outnumber the held ones (a rebuild), so n clients leaving cost O(n log n), not
    the O(n^2) of a scan each (10,000 departures took 3 s of event loop)."""

    __slots__ = ("cap_tokens", "sent_tokens", "_held", "_entries", "_seq")

    def __init__(self, cap_tokens: int) -> None:
        if cap_tokens < 0:
            raise ValueError(f"admission cap must be >= 0 tokens (0: off), got {cap_tokens}")
        self.cap_tokens = cap_tokens
        self.sent_tokens = 0
        self._held: list[list] = []          # heap of [key, arrival order, tokens, item]
        self._entries: dict[Any, list] = {}  # item → its heap entry, for the items still held
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Requests held here."""
        return len(self._entries)

    def _fits(self, tokens: int) -> bool:
        return self.cap_tokens == 0 or self.sent_tokens == 0 or self.sent_tokens + tokens <= self.cap_tokens

    def would_hold(self, tokens: int) -> bool:
        """:meth:`offer` of ``tokens`` now would hold the request."""
        return bool(self._entries) or not self._fits(max(0, tokens))

    def offer(self, tokens: int, key: float, item: Any) -> bool:
        """True: send the request now (counted as sent). False: it is held; :meth:`done` returns
        it when its turn comes. A newcomer never overtakes held requests by fitting a gap."""
        tokens = max(0, tokens)
        if not self._entries and self._fits(tokens):
            self.sent_tokens += tokens
            return True
        entry = [key, next(self._seq), tokens, item]
        self._entries[item] = entry
        heapq.heappush(self._held, entry)
        return False

    def _top(self) -> list | None:
        """The first entry still held (withdrawn ones on top dropped)."""
        while self._held and self._held[0][3] is _WITHDRAWN:
            heapq.heappop(self._held)
        return self._held[0] if self._held else None

    def done(self, tokens: int, gone: Callable[[Any], bool] | None = None) -> list[Any]:
        """A sent request was answered (first byte) or failed: its ``tokens`` leave the worker's
        queue. Returns the held items now sent, in order (each counted as sent).

        ``gone``: a held item it says True of when its turn comes is dropped as withdrawn, neither
        counted nor returned (a waiter whose client left before its withdrawal could run)."""
        self.sent_tokens = max(0, self.sent_tokens - max(0, tokens))
        released = []
        while (top := self._top()) is not None and self._fits(top[2]):
            heapq.heappop(self._held)
            del self._entries[top[3]]
            if gone is not None and gone(top[3]):
                continue
            self.sent_tokens += top[2]
            released.append(top[3])
        return released

    def withdraw(self, item: Any) -> bool:
        """Drop a held item (its client went away); False if it is no longer held."""
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        entry[3] = _WITHDRAWN
        if len(self._held) > 2 * len(self._entries) + 64:   # mostly withdrawn: rebuilt, O(n) now and then
            self._held = [e for e in self._held if e[3] is not _WITHDRAWN]
            heapq.heapify(self._held)
        return True

    def take_all(self) -> list[Any]:
        """Every held item, in order, none counted as sent (their worker can no longer take them)."""
        items = [e[3] for e in sorted(self._entries.values())]
        self._held.clear()
        self._entries.clear()
        return items

    def check_integrity(self) -> None:
        """Raises unless every held item has exactly one live heap entry."""
        live = [e for e in self._held if e[3] is not _WITHDRAWN]
        if len(live) != len(self._entries) or any(self._entries.get(e[3]) is not e for e in live):
            raise AssertionError(f"admission queue: {len(live)} live heap entries, {len(self._entries)} held")


class QueueFull(Exception):
    """The router holds as many requests as it may (``max_held``): this one is refused."""


class AsyncAdmission:
    """:class:`AdmissionQueue` for the router's request handlers: ``await admit(...)`` returns
    True when the request may be sent (every request so admitted must call :meth:`done`
    exactly once), False when it must be decided again (:meth:`redecide_all`: its worker was
    ejected, drained or removed while it waited; nothing to give back)."""

    def __init__(self, cap_tokens: int) -> None:
        self.queue = AdmissionQueue(cap_tokens)

    @property
    def held(self) -> int:
        return len(self.queue)

    async def admit(self, tokens: int, key: float, may_hold: bool = True) -> bool:
        """``may_hold`` False: raise :class:`QueueFull` rather than hold the request."""
        if not may_hold and self.queue.would_hold(tokens):
            raise QueueFull
        waiter = asyncio.get_running_loop().create_future()
        if self.queue.offer(tokens, key, waiter):
            return True
        try:
            return await waiter
        except asyncio.CancelledError:
            if not self.queue.withdraw(waiter) and waiter.done() and not waiter.cancelled() and waiter.result():
                # released in the same moment it was cancelled: it counts as sent, so give it back
                self.done(tokens)
            raise

    def done(self, tokens: int) -> None:
        # A held waiter already done was cancelled and not yet withdrawn (its task's cancellation
        # runs later in this loop iteration: a client that left, the drain): dropped, not counted
        # as sent. Counted, its tokens stayed so for good (its withdrawal finds it gone and gives
        # nothing back), and past the cap the idle worker held every later stream (audit s33 a5 D2).
        for waiter in self.queue.done(tokens, gone=lambda waiter: waiter.done()):
            waiter.set_result(True)

    def redecide_all(self) -> int:
        """Wake every held request to be decided again (not sent here); returns how many."""
        waiters = self.queue.take_all()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)
        return len(waiters)
