"""Worker bookkeeping: health (ejection and re-admission) and the load each one carries.

Mechanism only. What the router routed to a worker and has not seen finish is its
load: the requests predicted to be prefilled and not yet answered (the queue: their
uncached tokens, their number, their predicted tier-load seconds), and blocks of
requests in flight (decode pressure). The policies read these through the
live view; nothing here decides where a request goes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Worker:
    id: int                       #: stable slot: index bits, metrics labels
    url: str                      #: base URL, e.g. http://127.0.0.1:8001
    events_endpoint: str | None = None
    replay_endpoint: str | None = None   #: the publisher's replay ROUTER (vLLM ``replay_endpoint``)
    healthy: bool = True
    failures: int = 0             #: consecutive failed health checks or requests
    ejected_at: float | None = None
    pending_tokens: int = 0       #: predicted prefill tokens of requests without a first byte yet
    pending_requests: int = 0     #: requests without a first byte yet
    pending_load_s: float = 0.0   #: predicted tier-load seconds of those requests (the service model's load part)
    #: the uncached tokens of each request without a first byte, in the order sent (ticket → tokens):
    #: which of them would share a prefill step with a new one (the step-sharing delay)
    queued: dict = field(default_factory=dict)
    active_blocks: int = 0        #: blocks of requests in flight
    inflight: int = 0
    events_up: bool = False       #: the KV-event stream is connected (and not mid-resync)
    draining: bool = False        #: taken out of rotation (admin API); in-flight requests finish
    speed: "PrefillFit" = field(default_factory=lambda: PrefillFit())   #: this worker's measured prefill line
    decode_step_s: float | None = None   #: measured (EWMA of a stream's gap between chunks while nothing prefills)
    starts: int = 0               #: requests sent to it so far (tells a decode-only gap from one a prefill joined)
    extra: dict = field(default_factory=dict)
    #: the model ids its ``/v1/models`` listed last (None: not known yet; router/models.py)
    models: frozenset[str] | None = None

    def start(self, prefill_tokens: int, blocks: int, load_s: float = 0.0) -> int:
        """A request sent here; returns its ticket (for :meth:`first_byte` and :meth:`finish`)."""
        self.pending_tokens += prefill_tokens
        self.pending_requests += 1
        self.pending_load_s += load_s
        self.active_blocks += blocks
        self.inflight += 1
        self.starts += 1
        self.queued[self.starts] = prefill_tokens
        return self.starts

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s

    def first_byte(self, prefill_tokens: int, seconds: float, *, others: int = 0, load_s: float = 0.0,
                   ticket: int | None = None, timed: bool = True) -> bool:
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

        ``timed`` False: the first byte is not the end of the prefill (a non-streamed answer
        comes whole, after its decode), so it is no sample: one such answer of 400 tokens put
        the measured prefill speed at 11 tokens/s (2,000 configured), and every later
        request's price with it.
        """
        self._unqueue(prefill_tokens, load_s, ticket)
        if others == 0 and timed:
            return self.speed.sample(prefill_tokens, seconds)
        return False

    def step_sharing_delay_s(self, tokens: int, step_tokens: int, speed: float) -> float:
        """Seconds that ``tokens`` more, queued here now, would add to the first tokens of the
        requests already waiting here (the sum over them).

        vLLM prefills its waiting queue first come first served in steps of at most
        ``step_tokens`` (``max_num_batched_tokens``), and every request whose last prompt token
        is in a step gets its first token when that step ends. A new request's tokens fill
        the room left in the queue's last, partly filled step: each request finishing in that
        step waits ``min(tokens, room) / speed`` longer. In a FIFO engine without shared
        steps (the simulator's worker) nobody ahead waits for a newcomer; here they do. The
        oldest request is taken to be in the step already running (a request reaching an
        idle engine starts a step at once), which no newcomer can delay.
        """
        if step_tokens <= 0 or tokens <= 0 or len(self.queued) < 2:
            return 0.0
        waiting = list(self.queued.values())[1:]
        total = sum(waiting)
        used = total % step_tokens
        if not used:            # the last step is full: the newcomer starts the next one
            return 0.0
        tail_start = total - used
        sharing, seen = 0, 0
        for n in waiting:       # requests whose last token falls in the last, partial step
            seen += n
            if seen > tail_start:
                sharing += 1
        return sharing * min(tokens, step_tokens - used) / speed

    def quiet_mark(self) -> int | None:
        """A mark for :meth:`decode_gap`: None while a prefill is predicted on this worker."""
        return self.starts if self.pending_requests == 0 else None

    def decode_gap(self, seconds: float, since: int | None, ewma: float = 0.2) -> None:
        """A stream on this worker got a chunk ``seconds`` after its previous one, taken at
        mark ``since`` (:meth:`quiet_mark`). Counted as a decode step only if no prefill was
        predicted here then and none was sent since: a gap that spans a prefill step belongs
        to the queue term, priced from ``pending_tokens``."""
        # below a millisecond: chunks of one step (the usage chunk, [DONE]) read apart
        if since is not None and since == self.starts and seconds > 1e-3:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, ewma)

    def _unqueue(self, prefill_tokens: int, load_s: float, ticket: int | None = None) -> None:
        if ticket is None:   # a caller without tickets: the oldest queued request of that size
            ticket = next((t for t, n in self.queued.items() if n == prefill_tokens), None)
        self.queued.pop(ticket, None)
        self.pending_tokens = max(0, self.pending_tokens - prefill_tokens)
        self.pending_requests = max(0, self.pending_requests - 1)
        # float sums drift: an empty queue has no load left
        self.pending_load_s = max(0.0, self.pending_load_s - load_s) if self.pending_requests else 0.0

    def finish(self, prefill_tokens: int, blocks: int, answered: bool, load_s: float = 0.0,
               ticket: int | None = None) -> None:
        if not answered:
            self._unqueue(prefill_tokens, load_s, ticket)
        self.active_blocks = max(0, self.active_blocks - blocks)
        self.inflight = max(0, self.inflight - 1)


class PrefillFit:
    """A worker's prefill time as a line, ``seconds = overhead + tokens / speed``, fitted to the
    last ``window`` requests that found their worker idle (uncached tokens → time to first
    byte), robustly: Theil–Sen, the median of the slopes between every two samples, and the
    median intercept under it.

    Why a line and not a ratio: every request pays a fixed part (HTTP, scheduling, the
    connector's lookup) whatever it computes, ~0.1-0.2 s on the shared 2-core machine. A
    ratio of averages folds it into the speed, which then reads 1.5-2x too slow for the
    tokens of a queue (vLLM prefills a queue in shared steps: the fixed parts of queued
    requests overlap, their tokens do not), so queues looked dearer than tier loads and
    decode steps. The slope prices queued tokens; the intercept is each request's own fixed
    part (the service model's ``overhead_s``).

    Why robust: idle samples are few (a dozen in a 64-request round of the trace bench) and a
    machine that stalls now and then makes some of them seconds late. The least-squares fit
    this replaced (exponentially weighted, ~5 samples' memory) took one such sample, 161
    tokens in 0.644 s among others on ~3,700 tokens/s, to 31,800 then 81,000 tokens/s with
    0.3 s of overhead: queued tokens then cost next to nothing, and tier-aware routing went
    blind to queues. The median ignores up to ~29 % of wild samples. Until the samples spread
    over token counts (or when they fit no increasing line) it falls back to the ratio of
    sums with no intercept, what the router did before.
    """

    __slots__ = ("samples", "_line")

    #: token counts must spread at least this much (standard deviation) to fit a slope
    MIN_SPREAD_TOKENS = 64.0
    #: idle first bytes kept: enough for the median to outvote stalls, few enough to follow
    #: a worker whose speed changes (another model, a neighbour taking the cores)
    WINDOW = 32

    def __init__(self, window: int = WINDOW) -> None:
        if window < 3:
            raise ValueError(f"a prefill line needs a window of at least 3 samples, got {window}")
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)  # the window: the oldest goes
        self._line: tuple[float, float] | None = None

    @property
    def n(self) -> int:
        return len(self.samples)

    def sample(self, tokens: int, seconds: float) -> bool:
        if tokens <= 0 or seconds <= 0:
            return False
        self.samples.append((tokens, seconds))
        self._line = self._fit()   # once per sample: decisions read it far more often
        return True

    def line(self) -> tuple[float, float] | None:
        """``(tokens_per_s, overhead_s)``, or None before any sample."""
        return self._line

    def _fit(self) -> tuple[float, float]:
        x = np.fromiter((t for t, _ in self.samples), dtype=float, count=len(self.samples))
        y = np.fromiter((s for _, s in self.samples), dtype=float, count=len(self.samples))
        if len(x) >= 3 and x.std() >= self.MIN_SPREAD_TOKENS:
            i, j = np.triu_indices(len(x), 1)
            apart = x[j] != x[i]
            slope = float(np.median((y[j] - y[i])[apart] / (x[j] - x[i])[apart]))
            if slope > 0:
                # (an intercept a little below 0 is noise around a line through the origin)
                overhead = max(0.0, float(np.median(y - slope * x)))
                if overhead < float(np.median(y)):
                    return 1.0 / slope, overhead
        return float(x.sum() / y.sum()), 0.0

    @property
    def tokens_per_s(self) -> float | None:
        line = self.line()
        return None if line is None else line[0]

    @property
    def overhead_s(self) -> float | None:
        line = self.line()
        return None if line is None else line[1]


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
