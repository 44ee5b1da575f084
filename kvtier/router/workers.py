"""Worker bookkeeping: health (ejection and re-admission) and the load each one carries.

Mechanism only. What the router routed to a worker and has not seen finish is its
load: prompt tokens predicted to be prefilled and not yet answered (the queue), and
blocks of requests in flight (decode pressure). The policies read these through the
live view; nothing here decides where a request goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Worker:
    id: int                       #: stable slot: index bits, metrics labels
    url: str                      #: base URL, e.g. http://127.0.0.1:8001
    events_endpoint: str | None = None
    healthy: bool = True
    failures: int = 0             #: consecutive failed health checks or requests
    ejected_at: float | None = None
    pending_tokens: int = 0       #: predicted prefill tokens of requests without a first byte yet
    active_blocks: int = 0        #: blocks of requests in flight
    inflight: int = 0
    events_up: bool = False       #: the KV-event stream is connected (and not mid-resync)
    draining: bool = False        #: taken out of rotation (admin API); in-flight requests finish
    prefill_tokens_per_s: float | None = None   #: measured (EWMA of uncached tokens ÷ time to first byte, idle worker)
    inflight_s: float | None = None   #: measured: seconds each request already in flight adds to a new one's TTFT
    extra: dict = field(default_factory=dict)

    def start(self, prefill_tokens: int, blocks: int) -> None:
        self.pending_tokens += prefill_tokens
        self.active_blocks += blocks
        self.inflight += 1

    def first_byte(self, prefill_tokens: int, seconds: float, *, others: int = 0, ahead_tokens: int = 0,
                   default_speed: float | None = None, ewma: float = 0.3) -> None:
        """A request's first byte came ``seconds`` after it was sent; ``others`` requests were
        in flight on this worker then, ``ahead_tokens`` prompt tokens queued before it.

        Two things are learnt apart, so that one does not absorb the other: the prefill
        speed only from requests that found the worker idle (their time is service alone),
        and the in-flight pressure from the rest: what their TTFT had beyond the queued
        and own prefill, shared among the requests that were running. A busy vLLM engine
        interleaves decode steps with a new prefill, and that cost grows with the running
        requests whatever their prompts hit; a fixed per-block guess (``decode_block_s``)
        let one worker take most requests of a cached trace while its TTFT grew 10x.
        """
        self.pending_tokens = max(0, self.pending_tokens - prefill_tokens)
        if seconds <= 0:
            return
        if others == 0:
            if prefill_tokens > 0:
                self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, prefill_tokens / seconds, ewma)
            return
        speed = self.prefill_tokens_per_s or default_speed
        if speed:
            residual = max(0.0, seconds - (ahead_tokens + prefill_tokens) / speed)
            self.inflight_s = _ewma(self.inflight_s, residual / others, ewma)

    def finish(self, prefill_tokens: int, blocks: int, answered: bool) -> None:
        if not answered:
            self.pending_tokens = max(0, self.pending_tokens - prefill_tokens)
        self.active_blocks = max(0, self.active_blocks - blocks)
        self.inflight = max(0, self.inflight - 1)


def _ewma(old: float | None, sample: float, weight: float) -> float:
    return sample if old is None else (1 - weight) * old + weight * sample


class Health:
    """Eject a worker after ``eject_after`` consecutive failures; re-admit it on one success."""

    def __init__(self, eject_after: int = 2) -> None:
        self.eject_after = eject_after

    def failed(self, worker: Worker) -> bool:
        """Count a failure; True when this one ejected the worker."""
        worker.failures += 1
        if worker.healthy and worker.failures >= self.eject_after:
            worker.healthy = False
            worker.ejected_at = time.monotonic()
            return True
        return False

    def ok(self, worker: Worker) -> bool:
        """Count a success; True when it re-admitted the worker."""
        worker.failures = 0
        if not worker.healthy:
            worker.healthy = True
            worker.ejected_at = None
            return True
        return False
