"""Deadlines, failures and backoff of :class:`~kvtier.tiers.mooncake.MooncakeTier`'s engine calls.

Each call has one deadline, ``max(timeout_s, bytes / min_rate_bytes_s)``; the engine call
runs on a worker thread (:class:`~kvtier.tiers.mooncake_client.BoundedCaller`) and the tier
stops waiting at the deadline. After an overrun or a master that does not answer the tier is
*down*: calls return misses at once. Once a backoff (doubling up to ``max_backoff_s``) is over, a
health check on a thread of its own decides; the callers go on failing fast meanwhile. (When the
first call after the backoff found out, every backoff of a long outage cost one caller the whole
deadline -- a host eviction demoting to the fleet holds the DRAM tier's lock, so every GET of a
DRAM block too.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtier.tiers.mooncake_client import MASTER_DOWN_CODES, Down, Overrun
from kvtier.tiers.recovery_probe import start_probe

log = logging.getLogger("kvtier.tiers.mooncake")

#: the longest one call may be waited for, however large and slow (a day). Python's waits refuse
#: more than ``threading.TIMEOUT_MAX`` (~9.2e9 s) with OverflowError, which here would be a call
#: that fails for good; ``timeout_s`` above it is refused, ``bytes / min_rate_bytes_s`` capped.
MAX_CALL_S = 86400.0

#: the name a health check looks up (a master RPC; no block is ever stored under it: names are
#: NAME_PREFIX + 64 hex digits)
_PROBE = "kvtier/health-check"


__all__ = ["MAX_CALL_S", "BoundedEngineCalls", "Down", "FollowUp", "Late", "log"]


class Late(Down):
    """An engine call overran its deadline and may still be running."""


class FollowUp(float):
    """The deadline (a ``time.monotonic`` time) of a *follow-up* call: one an operation makes after
    the engine already answered it, with what is left of the operation's deadline -- a poll of a
    name another writer reserved and has not published, a retry of a read a dead holder failed.
    Its overrun says that the operation ran out of time, not that the master stopped answering:
    it fails the blocks the call was for (ERROR, a miss) and leaves the tier up. (Taken for an
    outage, a put over a killed writer's reservation, or a read of one dead holder's block, took
    the whole tier down for the backoff: every read, put and lookup a miss; audit s31 a6 D1, D4.)
    A master that stopped answering is still found: by the next operation's first call."""


class _Unanswered(Exception):
    """The health check found the master not answering (its message says how)."""


class BoundedEngineCalls:
    """Engine calls with a deadline, and the backoff after a failure (the tier's ``_caller``,
    ``_engine``, ``_lock``, ``stats``, ``timeout_s``, ``min_rate_bytes_s`` and ``_backoff*``)."""

    def _deadline_in(self, nbytes: int = 0) -> float:
        return min(max(self.timeout_s, nbytes / self.min_rate_bytes_s), MAX_CALL_S)

    @property
    def _follow_up_s(self) -> float:
        """The least time a follow-up call is given: a master RPC takes ~0.1 ms, but its answer
        reaches a loaded process's caller only after a few GIL hand-offs (ms each)."""
        return min(0.05, self.timeout_s / 10)

    def _time_left_covers(self, deadline: float, cost_s: float = 0.0) -> bool:
        """Whether what is left of ``deadline`` covers ``cost_s`` seconds and a follow-up call after
        them (a poll after its pause; a retry that costs what the failed attempt did)."""
        return time.monotonic() + cost_s + self._follow_up_s < deadline

    def _follow_up_by(self, deadline: float) -> FollowUp:
        """A follow-up call's deadline: the operation's, and at least :attr:`_follow_up_s` from now
        (an operation's last call still gets the time an answer takes)."""
        return FollowUp(max(deadline, time.monotonic() + self._follow_up_s))

    def _check_up(self) -> None:
        if self._closed:
            raise Down("tier closed")
        if self._down_until:  # down since a failure (0.0: up)
            if time.monotonic() >= self._down_until:
                self._probe_in_background()
            raise Down(self.last_error or "down")

    def _probe_in_background(self) -> None:
        """Start the health check that ends an outage (a master RPC; one at a time)."""

        def check() -> None:
            try:
                codes = self._caller.call(self.timeout_s, self._engine.batch_is_exist, [_PROBE])
            except Overrun as exc:
                raise _Unanswered(f"the health check: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - the binding raising is the engine failing
                raise _Unanswered(f"the health check: {type(exc).__name__}: {exc}") from None
            if not self._master_answers(codes):
                raise _Unanswered("the master did not answer the health check")

        start_probe(self, check, lambda exc: self._failed(str(exc)), thread_name="kvtier-mooncake-probe",
                    answered=lambda: log.info("mooncake tier %s: the master answers again", self.master))

    def _call(self, deadline: float, fn, *args, if_late=None):
        """One engine call, waited for until ``deadline`` (monotonic); an overrun puts the tier in
        backoff (unless ``deadline`` is a :class:`FollowUp`) and raises :class:`Late` (its buffers
        are the call's until ``if_late`` runs)."""
        return self._wait(self._caller.submit(fn, *args), deadline, if_late=if_late)

    def _wait(self, future, deadline: float, *, if_late=None):
        """The result of a submitted engine call, as :meth:`_call` waits for it."""
        try:
            return self._caller.wait(future, deadline - time.monotonic(), if_late=if_late)
        except Overrun as exc:
            raise self._overran(exc, deadline) from None
        except Exception as exc:  # noqa: BLE001 - the binding raising is the engine failing, not the caller
            self._failed(f"{type(exc).__name__}: {exc}")
            raise Down(str(exc)) from None

    def _overran(self, exc: Overrun, deadline: float) -> Late:
        """What a call that ran past ``deadline`` raises; the tier goes down unless it was a follow-up."""
        if isinstance(deadline, FollowUp):
            log.info("mooncake tier %s: a follow-up call ran out of its operation's time: %s", self.master, exc)
        else:
            self._failed(str(exc))
        return Late(str(exc))

    def _failed(self, why: str) -> None:
        with self._lock:
            self.stats.errors += 1
            self.last_error = why
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
        log.warning("mooncake tier %s: %s (backing off)", self.master, why)

    def _succeeded(self) -> None:
        self._backoff = self._backoff_min

    def _codes(self, codes: Sequence[int]) -> None:
        """Note what a batch's return codes say about the master."""
        if any(c in MASTER_DOWN_CODES for c in codes):
            self._failed(f"the master did not answer (rc={min(codes)})")
        else:
            self._succeeded()

    @property
    def available(self) -> bool:
        """False from a failure until a health check finds the master answering again."""
        return not self._closed and not self._down_until

    def healthy(self) -> bool:
        """Whether the master answers a lookup, within ``timeout_s``. (The engine's own
        ``health_check`` asks nobody: it answered 0 within 1 ms with the master frozen.)"""
        try:
            self._check_up()
            return self._master_answers(self._call(time.monotonic() + self.timeout_s, self._engine.batch_is_exist,
                                                   [_PROBE]))
        except Down:
            return False

    @staticmethod
    def _master_answers(codes) -> bool:
        return isinstance(codes, (list, tuple)) and len(codes) == 1 and codes[0] not in MASTER_DOWN_CODES
