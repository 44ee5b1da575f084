"""One interval of ``kvtier plan live``: scrape → observe → decide → act → report.

The router's counters give the observation (:mod:`kvtier.planner.observe`); the workers'
own ``/metrics`` (vLLM) give the engine-side view reported beside it; the planner decides
(:mod:`kvtier.planner.live`) from the workers the launcher lists as starting or serving (not
from the counts it asked for last: starts refused, workers failed since); a launcher acts
(:func:`kvtier.planner.launchers.apply`; where workers prefill and decode alike, the planner decides
them as one pool); the decision goes to the planner's metrics and a JSON status file (``kvtier top
--planner-status``).

An interval never ends the planner for a reason that is not the planner's: an endpoint that
does not answer, or answers something that is not metrics, counts as down. The router and the
workers are scraped at once, under one deadline (``scrape_deadline_s``): a scrape not done by
then counts as down and is left to finish on its own thread (no new scrape of that endpoint is
begun until it has), so that neither many silent workers nor one that drips its answer hold the
interval; a status or
targets file that cannot be written is logged and counted (``kvtier_planner_status_write_errors``);
figures the planner cannot decide on (whatever raises while sizing) are logged and counted as a
scrape error (``kvtier_planner_scrape_errors``), and the interval holds. Either way the workers
keep running and the next interval tries again; and one interval starts only so many workers
(:func:`kvtier.planner.launchers.apply`). A worker whose scrape failed keeps its last good
scrape as the baseline of its latencies (one timeout does not make the next interval read its
whole life). The status and targets files are strict JSON (a figure that is not finite is
``null``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kvtier.planner.launchers import POOLS, apply
from kvtier.planner.live import Decision, LivePlanner, Observation, json_safe
from kvtier.planner.metrics import PlannerMetrics
from kvtier.planner.observe import FleetLoad, RouterCounters, fleet_load, observation_between

log = logging.getLogger(__name__)


class Scraped(NamedTuple):
    """One address's scrape: its samples (None: the scrape raised) and the monotonic time it was
    done (when a counter in it was read, give or take the answer's transfer)."""

    samples: object | None
    at_s: float


@dataclass
class PlannerLoop:
    planner: LivePlanner
    launcher: object                          #: a kvtier.planner.launchers.Launcher
    router: str                               #: the router's address (its /metrics)
    output_tokens: int
    scrape: Callable                          #: address → samples (kvtier.cli.top.scrape)
    metrics: PlannerMetrics = field(default_factory=PlannerMetrics)
    aggregate: bool = False                   #: workers prefill and decode (plain vllm serve)
    worker_urls: Callable[[], list[str]] = list   #: whose vLLM /metrics to read
    status_file: str | None = None
    targets_file: str | None = None           #: Prometheus file_sd list of the serving workers
    report: Callable[[Decision], None] | None = None
    #: every scrape of an interval is done within this long, or counts as down: a scrape's own
    #: timeout (2 s) bounds each read, not a peer that drips its answer; the second more is slack
    scrape_deadline_s: float = 3.0
    last: Decision | None = None
    last_load: FleetLoad | None = None
    _before: RouterCounters | None = None
    _before_workers: dict | None = None
    _actions_seen: int = 0
    _scrapes: dict[str, Future] = field(default_factory=dict)   # by address; those past a deadline still run

    def step(self) -> Decision | None:
        """One interval: a decision, or None (first scrape, a counter reset, the router down)."""
        urls = self.worker_urls()
        scraped = self._scrape_all([self.router, *urls])
        router = scraped.pop(self.router, None)
        samples = router.samples if router is not None else None
        self._record_launcher()
        self.write_targets()
        if samples is None or not samples.up:
            self.metrics.scrape_errors.inc()
            log.warning("router metrics unreachable (%s); holding", samples.error if samples else "scrape failed")
            return None
        # stamped when the router answered, not when the slowest worker did: a worker 2 s late
        # moved the stamp, and the rate between two stamps was 20-50 % off (audit s34 r3 D3)
        now = RouterCounters.from_samples(router.at_s, samples)
        obs = observation_between(self._before, now, self.output_tokens) if self._before else None
        self._before = now
        # a worker whose scrape failed is left out: fleet_load counts only workers that answered
        scraped = {url: s.samples for url, s in scraped.items() if s is not None and s.samples is not None}
        self.last_load = fleet_load(scraped, self._before_workers, self.planner.sizer.targets.ttft_percentile)
        # each worker's baseline is its last good scrape: a failed one (a timeout under load)
        # would make the next interval read the worker's histograms since it started
        kept = {url: s for url, s in (self._before_workers or {}).items() if url in urls}
        self._before_workers = {**kept, **{url: s for url, s in scraped.items() if s.up}}
        self.metrics.record_fleet(self.last_load)
        if obs is None:
            return None
        acted = self._decide(obs)
        if acted is None:
            return None
        self.metrics.record(obs, acted)
        if self.report:
            self.report(acted)
        try:
            apply(acted, self.launcher)
        except Exception as exc:   # a launcher that cannot act now (LaunchError, a router refusing): next interval
            log.warning("launcher could not act on the decision: %s", exc)
        self._record_launcher()
        self.last = acted
        self._write_status(acted)
        return acted

    def _decide(self, obs: Observation) -> Decision | None:
        """The decision to act on, or None if deciding raised: the loop's caller (``kvtier plan
        live``) would end, and its ``finally`` drain every worker it started, for one interval's
        figures (a garbled counter sized into an overflow)."""
        try:
            self._reconcile()
            return (self.planner.decide_aggregated if self.aggregate else self.planner.decide)(obs)
        except Exception as exc:
            self.metrics.scrape_errors.inc()
            log.warning("no decision on this interval's figures (%r); holding", exc)
            return None

    def _reconcile(self) -> None:
        """Tell the planner the workers the launcher runs (starting or serving) before it decides:
        its current counts, its metrics' ``kvtier_planner_workers`` and whether a change is up or
        down follow what runs. Aggregated, the prefill pool's workers are the whole fleet (the
        planner decides them as one pool)."""
        running = {pool: sum(w.state in ("starting", "serving") for w in self.launcher.list(pool)) for pool in POOLS}
        self.planner.reconcile(running["prefill"], 0 if self.aggregate else running["decode"])

    def write_targets(self) -> None:
        """The serving workers as a Prometheus ``file_sd_configs`` file (host:port, job ``vllm``)."""
        if not self.targets_file:
            return
        from urllib.parse import urlsplit

        hosts = sorted({urlsplit(w.url).netloc for pool in ("prefill", "decode") for w in self.launcher.list(pool)
                        if w.state == "serving" and w.url})
        self._write_side_file(self.targets_file, [{"targets": hosts, "labels": {"job": "vllm"}}])

    def _scrape_all(self, urls: list[str]) -> dict[str, Scraped | None]:
        """Each address's :class:`Scraped`, all scraped at once and done within ``scrape_deadline_s``:
        None for one not done by then (down), samples None for one that raised. An address whose
        scrape from an earlier interval still runs is down without a new one: a stuck endpoint
        holds one thread, never one more per interval, and an answer begun intervals ago is no
        figure for this one."""
        begun = {}
        for url in dict.fromkeys(urls):
            leftover = self._scrapes.get(url)
            if leftover is None or leftover.done():
                self._scrapes[url] = begun[url] = self._begin_scrape(url)
            else:
                log.warning("scraping %s: still waiting on an earlier interval's scrape; counted as down", url)
        wait(begun.values(), timeout=self.scrape_deadline_s)
        results = dict.fromkeys(urls)
        for url, future in begun.items():
            if future.done():
                results[url] = future.result()
            else:
                log.warning("scraping %s: not done in %.1f s; counted as down", url, self.scrape_deadline_s)
        self._scrapes = {url: f for url, f in self._scrapes.items() if not f.done()}
        return results

    def _begin_scrape(self, url: str) -> Future:
        """``_scrape(url)`` on a daemon thread of its own, as a :class:`Scraped` stamped when it is
        done: one past the deadline is abandoned to finish when it will (a thread pool would queue
        the next interval's scrapes behind it)."""
        future: Future = Future()

        def run() -> None:
            samples = self._scrape(url)
            future.set_result(Scraped(samples, time.monotonic()))

        threading.Thread(target=run, daemon=True, name="kvtier-planner-scrape").start()
        return future

    def _scrape(self, url: str):
        """``scrape(url)``, or None if it raised: a bad endpoint is down, never the planner's end
        (whose ``finally`` would drain every worker it started)."""
        try:
            return self.scrape(url)
        except Exception as exc:
            log.warning("scraping %s failed: %r", url, exc)
            return None

    def _write_side_file(self, path: str, value) -> None:
        """Status and targets are for people and Prometheus: failing to write one (its directory
        removed, the disk full) is reported, not a reason to stop deciding."""
        try:
            _replace_json(path, value)
        except OSError as exc:
            self.metrics.status_write_errors.inc()
            log.warning("cannot write %s: %s", path, exc)

    def _record_launcher(self) -> None:
        self.metrics.record_launcher(self.launcher)
        since = getattr(self.launcher, "actions_since", None)   # a launcher that keeps only its last actions
        if since is not None:
            new, self._actions_seen = since(self._actions_seen)
        else:
            actions = getattr(self.launcher, "actions", None)
            if actions is None:
                return
            new = list(actions)[self._actions_seen:]
            self._actions_seen += len(new)
        for _, action, _ in new:
            self.metrics.launcher_actions.labels(action).inc()

    def _write_status(self, decision: Decision) -> None:
        if not self.status_file:
            return
        status = decision.to_json()
        status["workers"] = [{"name": w.name, "pool": w.pool, "state": w.state, "url": w.url}
                             for pool in ("prefill", "decode") for w in self.launcher.list(pool)]
        if self.last_load is not None:
            status["engines"] = self.last_load._asdict()
        pids = getattr(self.launcher, "pids", None)
        if pids is not None:
            status["pids"] = pids()
        self._write_side_file(self.status_file, status)


def _replace_json(path: str, value) -> None:
    """Readers see the old file or the new one, never half of one; strict JSON (``null`` for a
    figure that is not finite), which jq, Go and JavaScript read too."""
    text = json.dumps(json_safe(value), allow_nan=False)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        try:   # a half-written temporary (disk full) is not left behind
            os.unlink(tmp)
        except OSError:
            pass
        raise
