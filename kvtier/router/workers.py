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
    speed: "IdleSpeed" = field(default_factory=lambda: IdleSpeed())   #: this worker's measured prefill speed
    decode_step_s: float | None = None   #: measured (EWMA of a stream's gap between chunks while nothing prefills)
    starts: int = 0               #: requests sent to it so far (tells a decode-only gap from one a prefill joined)
    extra: dict = field(default_factory=dict)

    def start(self, prefill_tokens: int, blocks: int) -> None:
        self.pending_tokens += prefill_tokens
        self.active_blocks += blocks
        self.inflight += 1
        self.starts += 1

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s

    def first_byte(self, prefill_tokens: int, seconds: float, *, others: int = 0) -> bool:
        """A request's first byte came ``seconds`` after it was sent; ``others`` requests were
        in flight on this worker then.

        The prefill speed is learnt only from requests that found the worker idle: their
        time is their own service. A busy worker's first bytes are not attributed to the
        requests in flight (what 25655cd did): vLLM prefills in steps of up to
        ``max_num_batched_tokens`` (2048 on CPU), so requests sent together get their first
        token at the end of the same step, and the residual of one of them is mostly the
        prefill of the requests sent *after* it, not of those running before it (measured
        on the trace bench: a burst of 7 requests put 40 of 64 on one worker). Returns True
        when the request was a speed sample (found the worker idle).
        """
        self.pending_tokens = max(0, self.pending_tokens - prefill_tokens)
        if others == 0:
            return self.speed.sample(prefill_tokens, seconds)
        return False

    def quiet_mark(self) -> int | None:
        """A mark for :meth:`decode_gap`: None while a prefill is predicted on this worker."""
        return self.starts if self.pending_tokens == 0 else None

    def decode_gap(self, seconds: float, since: int | None, ewma: float = 0.2) -> None:
        """A stream on this worker got a chunk ``seconds`` after its previous one, taken at
        mark ``since`` (:meth:`quiet_mark`). Counted as a decode step only if no prefill was
        predicted here then and none was sent since: a gap that spans a prefill step belongs
        to the queue term, priced from ``pending_tokens``."""
        # below a millisecond: chunks of one step (the usage chunk, [DONE]) read apart
        if since is not None and since == self.starts and seconds > 1e-3:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, ewma)

    def finish(self, prefill_tokens: int, blocks: int, answered: bool) -> None:
        if not answered:
            self.pending_tokens = max(0, self.pending_tokens - prefill_tokens)
        self.active_blocks = max(0, self.active_blocks - blocks)
        self.inflight = max(0, self.inflight - 1)


class IdleSpeed:
    """Prefill speed from requests that found their worker idle: uncached tokens ÷ time to
    first byte, as a ratio of two EWMAs, not an EWMA of ratios: a mostly cached request
    (32 tokens to compute, 0.1 s of HTTP, step and load) would otherwise pull the speed to
    a few hundred tokens/s at once, and the next burst would avoid that worker."""

    __slots__ = ("tokens", "seconds", "weight")

    def __init__(self, weight: float = 0.3) -> None:
        self.tokens: float | None = None
        self.seconds: float | None = None
        self.weight = weight

    def sample(self, tokens: int, seconds: float) -> bool:
        if tokens <= 0 or seconds <= 0:
            return False
        self.tokens = _ewma(self.tokens, tokens, self.weight)
        self.seconds = _ewma(self.seconds, seconds, self.weight)
        return True

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens is None else self.tokens / self.seconds


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
