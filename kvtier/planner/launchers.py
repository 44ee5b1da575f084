"""Launchers: how a planner's decision becomes workers started, drained and stopped.

The planner (``kvtier/planner/live.py``) decides counts; a launcher owns the workers.
Contract every launcher keeps (what "no request fails" means):

- ``start(pool)`` asks for one more worker; it joins the router only once healthy
  (the launcher polls its health endpoint, then registers it), never before.
- ``drain(worker)`` takes a worker out of the router's rotation; its requests in flight
  finish. ``stop(worker)`` is only for a drained worker whose in-flight count is zero (or
  whose drain deadline passed; then the router retries what had not sent a first byte).
- ``list(pool)`` is the launcher's own view (starting, serving, draining), so that the
  planner's counts and the launcher's workers are reconciled every interval: the planner's loop
  decides from the workers starting or serving there (:mod:`kvtier.planner.loop`), not from
  the counts it asked for last (starts refused by a backoff, workers failed since).

:class:`DryRunLauncher` prints what it would do; its drains are over at the next ``apply``
(it has no requests to wait for), so that its records stay as few as a real fleet's.
:class:`KubernetesLauncher` documents the replica-count implementation (no cluster here). The
local-process launcher (``vllm serve`` with the kvtier connector, registered with ``kvtier route``
through its admin API) is :class:`kvtier.planner.local_launcher.LocalLauncher`.

Worker states: ``starting`` → ``serving`` → ``draining`` → ``stopped``, or ``failed`` (never
became healthy, or its process died while serving: ``list`` leaves it out, so the next
decision replaces it).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from kvtier.planner.live import AGGREGATED_DECODE, Decision

POOLS = ("prefill", "decode")

#: one ``apply`` starts at most as many workers as the pool has live (it doubles), and at least
#: this many: a decision far above the pool (a spike, or figures gone wrong: five refused
#: over-long prompts asked for 9x the pool) costs a few starts an interval, never thousands of
#: ``vllm serve`` at once; the rest are started in the next intervals if the decision stands
MIN_STARTS_PER_APPLY = 4
#: finished (stopped or failed) workers whose records a launcher keeps (and the local launcher
#: the logs of its failed starts): a pool that scales up and down all day must not grow them
KEEP_FINISHED = 5

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    name: str
    pool: str
    state: str = "starting"   # starting → serving → draining → stopped, or failed
    url: str = ""


class Launcher(Protocol):
    def start(self, pool: str) -> WorkerRecord: ...
    def drain(self, worker: WorkerRecord) -> None: ...
    def stop(self, worker: WorkerRecord) -> None: ...
    def list(self, pool: str) -> list[WorkerRecord]: ...


def starts_this_interval(missing: int, live: int) -> int:
    """How many of the ``missing`` workers one ``apply`` starts beside ``live`` ones."""
    return min(missing, max(live, MIN_STARTS_PER_APPLY))


def apply(decision: Decision, launcher: Launcher) -> list[WorkerRecord]:
    """Bring each pool towards its decided target: start the missing, at most
    :func:`starts_this_interval` of them (the next interval's ``apply`` starts more), and
    drain the surplus (the youngest first: a worker still starting holds no requests and no
    cache).

    A launcher that cannot act now (its failure backoff, a router refusing) costs only that
    action: the other pool, and the other drains, are still acted on; the first error is
    raised once both pools are done. A ``scale_down`` never starts a worker, even where the
    launcher runs fewer than its target now (workers failed since it was decided).

    A launcher with a ``settle()`` (the dry run, whose transitions are only pretended) finishes
    the last apply's transitions first."""
    settle = getattr(launcher, "settle", None)
    if settle is not None:
        settle()
    touched: list[WorkerRecord] = []
    errors: list[Exception] = []
    for pool_decision in (decision.prefill, decision.decode):
        pool = pool_decision.pool
        live = [w for w in launcher.list(pool) if w.state in ("starting", "serving")]
        missing = 0 if pool_decision.action == "scale_down" else pool_decision.target - len(live)
        starts = starts_this_interval(missing, len(live))
        if starts < missing:
            log.info("%s: starting %d of the %d workers missing this interval", pool, starts, missing)
        try:   # the next start would fail the same way (a backoff): stop at the first
            for _ in range(starts):
                touched.append(launcher.start(pool))
        except Exception as exc:
            errors.append(exc)
        surplus = len(live) - pool_decision.target
        # starting ones first, then the most recently started (``list`` is in start order)
        youngest_first = sorted(reversed(live), key=lambda w: w.state != "starting")
        for worker in youngest_first[:max(0, surplus)]:
            try:
                launcher.drain(worker)
                touched.append(worker)
            except Exception as exc:
                errors.append(exc)
    if errors:
        raise errors[0]
    return touched


def aggregated(decision: Decision) -> Decision:
    """The decision for workers that prefill *and* decode (plain ``vllm serve``, no P/D split):
    one pool, ``prefill``, whose target holds both needs (the larger of the two targets); the
    ``decode`` pool holds no workers of its own. Joins two pools' decisions after the fact: the
    planner's loop has the planner decide one aggregated pool instead
    (``LivePlanner.decide_aggregated``), whose scale-downs cannot miss each other."""
    p, d = decision.prefill, decision.decode
    # what runs is what the last aggregated decision asked for: the larger of the two pools' counts
    current, target = max(p.current, d.current), max(p.target, d.target)
    action = "scale_up" if target > current else "scale_down" if target < current else "hold"
    reason = p.reason if target == p.target else f"decode needs {d.target}: {d.reason}"
    both = p._replace(current=current, needed=max(p.needed, d.needed), target=target, action=action, reason=reason)
    return decision._replace(prefill=both, decode=AGGREGATED_DECODE)


@dataclass
class DryRunLauncher:
    """Keeps the workers it would have, prints every action with the decision's reason."""

    out: TextIO = field(default_factory=lambda: sys.stdout)
    json_lines: bool = False
    workers: list[WorkerRecord] = field(default_factory=list)
    _serial: int = 0

    def seed(self, pool: str, count: int) -> None:
        for _ in range(count):
            self._serial += 1
            self.workers.append(WorkerRecord(f"{pool}-{self._serial}", pool, "serving"))

    def start(self, pool: str) -> WorkerRecord:
        self._serial += 1
        worker = WorkerRecord(f"{pool}-{self._serial}", pool, "starting")
        self.workers.append(worker)
        self._say("start", worker)
        return worker

    def drain(self, worker: WorkerRecord) -> None:
        worker.state = "draining"
        self._say("drain", worker)

    def settle(self) -> None:
        """The workers drained before are stopped (a dry run holds no requests to wait for);
        only the last :data:`KEEP_FINISHED` stopped records are kept."""
        for worker in [w for w in self.workers if w.state == "draining"]:
            self.stop(worker)
        stopped = [w for w in self.workers if w.state == "stopped"]
        for worker in stopped[:-KEEP_FINISHED]:
            self.workers.remove(worker)

    def stop(self, worker: WorkerRecord) -> None:
        worker.state = "stopped"
        self._say("stop", worker)

    def list(self, pool: str) -> list[WorkerRecord]:
        return [w for w in self.workers if w.pool == pool and w.state != "stopped"]

    def report(self, decision: Decision) -> None:
        if self.json_lines:
            print(json.dumps(decision.to_json()), file=self.out, flush=True)
            return
        for d in (decision.prefill, decision.decode):
            print(f"[t={decision.at_s:.0f}s] {d.pool}: {d.action} {d.current} -> {d.target} ({d.reason})",
                  file=self.out, flush=True)

    def _say(self, action: str, worker: WorkerRecord) -> None:
        if not self.json_lines:
            print(f"  dry-run: would {action} {worker.name}", file=self.out, flush=True)


class KubernetesLauncher(Protocol):
    """The interface a Kubernetes launcher implements (no cluster here, so none ships).

    One Deployment (or LeaderWorkerSet) per pool, e.g. ``kvtier-prefill`` and
    ``kvtier-decode``, whose pods run ``vllm serve`` with the kvtier connector and a
    readiness probe on ``/health``:

    - ``start(pool)``: patch ``spec.replicas`` of the pool's Deployment up by one
      (``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``); the router
      learns the pod from the pool's Endpoints, which list a pod only once ready.
    - ``drain(worker)``: annotate the pod ``controller.kubernetes.io/pod-deletion-cost``
      lowest (so a scale-down removes this pod) and tell the router to stop routing to it;
      the pod's ``preStopHook`` waits for in-flight requests, bounded by
      ``terminationGracePeriodSeconds``.
    - ``stop(worker)``: patch ``spec.replicas`` down by one once drained.
    - ``list(pool)``: the pool's pods with their ready condition and deletion cost.
    """

    namespace: str
    deployments: dict[str, str]  # pool → Deployment name

    def start(self, pool: str) -> WorkerRecord: ...
    def drain(self, worker: WorkerRecord) -> None: ...
    def stop(self, worker: WorkerRecord) -> None: ...
    def list(self, pool: str) -> list[WorkerRecord]: ...
