"""The local-process launcher: ``vllm serve`` workers started, registered, drained and stopped here.

It keeps :mod:`kvtier.planner.launchers`' contract against a running ``kvtier route``:

- ``start(pool)`` spawns ``python -m kvtier.integrations.vllm.launcher serve MODEL …`` (vLLM's
  own CLI, which also gives a kvtier-connector worker its shutdown grace) on a free port,
  with its KV events on an ipc socket in the run directory; a thread polls the worker's
  ``/health`` and only once it answers 200 adds it to the router (``POST /admin/workers``)
  — a worker still loading its model never sees a request. A worker that exits, does not
  become healthy in time or cannot be registered (the router refuses it or does not answer)
  is stopped with its whole process group and marked ``failed``; no new start is tried for
  ``failure_backoff_s`` (a broken command must not be relaunched every interval). The same
  thread then watches the serving worker: one whose process exits (OOM, a crash) is marked
  ``failed``, its group killed and the router told to forget it, so that ``list`` no longer
  counts it and the planner starts a replacement.
- ``drain(worker)`` tells the router to send it nothing new (``/admin/workers/drain``), waits
  until the router counts no request in flight on it (or ``drain_timeout_s`` passed),
  removes it from the router, then stops it: SIGTERM to its main process (vLLM shuts down in
  order, the connector flushes its store), SIGKILL to its process group after ``stop_timeout_s``.
  A drain the router refuses or does not answer leaves the worker serving (the planner asks
  again next interval), except during ``close()``: then the worker is stopped regardless.
- Workers found already running (``adopt``) are drained and removed like the others but
  never signalled: this launcher did not start them.

Each transition runs on its own thread so that the planner's loop never waits on a
worker's start-up; ``list`` reads the records under a lock. ``close()`` drains and stops
every worker this launcher started (the planner calls it when it exits). A planner killed
before that (SIGKILL, OOM) still takes its workers along: each is started with
``PR_SET_PDEATHSIG`` from one long-lived thread (:class:`kvtier.child_process.Spawner`), so the
kernel sends it SIGTERM and vLLM shuts down in order.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.child_process import Spawner
from kvtier.errors import ConfigError
from kvtier.planner.launchers import WorkerRecord
from kvtier.router.config import replay_beside

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A worker could not be started (now): the planner reports it and tries again later."""


@dataclass(frozen=True)
class WorkerTemplate:
    """What every started worker runs: ``vllm serve MODEL`` plus these flags."""

    model: str
    vllm_args: tuple[str, ...] = ()        #: e.g. ("--dtype", "float32", "--kv-transfer-config", "{…}")
    host: str = "127.0.0.1"
    kv_events: bool = True                 #: publish KV events (ipc socket) and have the router subscribe
    env: tuple[tuple[str, str], ...] = ()  #: extra environment
    cores: tuple[int, ...] = ()            #: VLLM_CPU_OMP_THREADS_BIND per worker, taken in turn (CPU builds)
    #: what runs ``serve MODEL …``: vLLM's CLI through kvtier's launcher (a test puts a stand-in here)
    program: tuple[str, ...] = (sys.executable, "-m", "kvtier.integrations.vllm.launcher")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("the local launcher needs the model its workers serve (--model)")
        for flag in ("--host", "--port", "--kv-events-config"):
            if any(a.split("=")[0] == flag for a in self.vllm_args):
                raise ConfigError(f"{flag} is set by the local launcher for each worker; leave it out of the "
                                  "worker arguments")


class RouterAdmin:
    """The router's ``/admin/workers`` API over HTTP (urllib: runs on the launcher's threads)."""

    def __init__(self, router_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base = (router_url if "://" in router_url else f"http://{router_url}").rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """(status, JSON body) of an answer, 4xx/5xx included; :class:`LaunchError` when there is
        no answer to read (refused, timed out, reset, not HTTP, a 2xx body that is not JSON), so
        that every caller handles a router that is down the way it handles one that refuses."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            try:
                return err.code, json.loads(err.read() or b"{}")
            except (OSError, ValueError, http.client.HTTPException):
                return err.code, {}
        except (OSError, ValueError, http.client.HTTPException) as exc:   # URLError is an OSError
            raise LaunchError(f"router {method} {path}: {exc}") from None

    def _ok(self, method: str, path: str, body: dict | None = None) -> dict:
        status, out = self._call(method, path, body)
        if status >= 300:
            message = (out.get("error") or {}).get("message", out) if isinstance(out, dict) else out
            raise LaunchError(f"router {method} {path}: {status} {message}")
        return out

    def add(self, url: str, events: str | None = None) -> dict:
        body = {"url": url}
        if events:   # and its publisher's replay buffer beside it
            body.update(events=events, replay=replay_beside(events))
        return self._ok("POST", "/admin/workers", body)

    def drain(self, url: str) -> dict:
        return self._ok("POST", "/admin/workers/drain", {"url": url})

    def remove(self, url: str, force: bool = False) -> dict:
        return self._ok("DELETE", "/admin/workers", {"url": url, "force": force})

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in self._ok("GET", "/admin/workers").get("workers", [])}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, ValueError, http.client.HTTPException):   # not up yet, or not HTTP on that port
        return False


@dataclass
class _Process:
    proc: subprocess.Popen | None       # None: adopted, not ours to signal
    events: str | None
    log_path: Path | None


@dataclass
class LocalLauncher:
    template: WorkerTemplate
    admin: RouterAdmin
    run_dir: Path
    health_timeout_s: float = 600.0
    drain_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    failure_backoff_s: float = 60.0
    poll_s: float = 0.5
    workers: list[WorkerRecord] = field(default_factory=list)
    actions: list[tuple[float, str, str]] = field(default_factory=list)   #: (time, action, worker) log
    _procs: dict[str, _Process] = field(default_factory=dict)
    _serial: int = 0
    _last_failure_s: float = -1e18
    _threads: list[threading.Thread] = field(default_factory=list)
    _closing: bool = False

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.RLock()   # _record is called with it held too
        # start() may run on any thread, and PR_SET_PDEATHSIG follows the thread that forked
        self._spawner = Spawner("kvtier-launcher-spawn")

    # --- the launcher contract -------------------------------------------------------
    def adopt(self, url: str, pool: str = "prefill") -> WorkerRecord:
        """A worker already registered with the router (started by someone else)."""
        with self._lock:
            self._serial += 1
            worker = WorkerRecord(f"{pool}-{self._serial}", pool, "serving", url.rstrip("/"))
            self.workers.append(worker)
            self._procs[worker.name] = _Process(None, None, None)
        return worker

    def start(self, pool: str) -> WorkerRecord:
        wait = self._last_failure_s + self.failure_backoff_s - time.monotonic()
        if wait > 0:
            raise LaunchError(f"a worker failed to start; next try in {wait:.0f} s")
        with self._lock:
            self._serial += 1
            name = f"{pool}-{self._serial}"
            core = self.template.cores[(self._serial - 1) % len(self.template.cores)] if self.template.cores else None
        port = _free_port(self.template.host)
        url = f"http://{self.template.host}:{port}"
        events = f"ipc://{self.run_dir.resolve()}/{name}.events" if self.template.kv_events else None
        cmd = [*self.template.program, "serve", self.template.model,
               "--host", self.template.host, "--port", str(port), *self.template.vllm_args]
        if "--enable-scale-out" not in self.template.vllm_args:
            # vLLM's abort endpoint: the router names the requests of clients that left (router/abort.py)
            cmd.append("--enable-scale-out")
        if events:
            # ipc, not tcp: vLLM binds its publisher only on a wildcard tcp address (every interface)
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": events, "replay_endpoint": replay_beside(events),
                                                      "topic": ""})]
        env = {**os.environ, **dict(self.template.env)}
        if core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "w") as out:
            # its own session: a signal to the planner's group does not reach the worker, and
            # stopping the worker's group takes vLLM's engine-core child with it; forked on the
            # spawner's thread, so that a planner killed before its close() takes its workers along
            proc = self._spawner.popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        worker = WorkerRecord(name, pool, "starting", url)
        with self._lock:
            self.workers.append(worker)
            self._procs[name] = _Process(proc, events, log_path)
        self._record("start", worker)
        self._spawn(self._bring_up, worker)
        return worker

    def drain(self, worker: WorkerRecord) -> None:
        with self._lock:
            if worker.state in ("draining", "stopped", "failed"):
                return
            was = worker.state
            worker.state = "draining"
        self._record("drain", worker)
        self._spawn(self._drain_then_stop, worker, was == "serving")

    def stop(self, worker: WorkerRecord) -> None:
        """SIGTERM the worker's main process, SIGKILL its group after ``stop_timeout_s`` or once it
        exited (leftovers); adopted workers are left alone. Only the main process is asked: vLLM's
        API server then shuts its engine and worker processes down in order (the connector
        flushes its store there), where a SIGTERM to the whole group would hit them all at once."""
        proc = self._procs.get(worker.name)
        if proc is not None and proc.proc is not None and proc.proc.poll() is None:
            try:
                proc.proc.send_signal(signal.SIGTERM)
                proc.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop in %.0f s; killing it", worker.name, self.stop_timeout_s)
                os.killpg(proc.proc.pid, signal.SIGKILL)
                proc.proc.wait()
            except ProcessLookupError:
                pass
        if proc is not None and proc.proc is not None:
            try:   # what is left of its group (vLLM's engine core)
                os.killpg(proc.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self._lock:
            if worker.state != "failed":
                worker.state = "stopped"
        self._record("stop", worker)

    def list(self, pool: str) -> list[WorkerRecord]:
        with self._lock:
            return [w for w in self.workers if w.pool == pool and w.state not in ("stopped", "failed")]

    def pids(self) -> dict[str, int]:
        """Process ids of the workers this launcher started and that still run (for status files)."""
        return {n: p.proc.pid for n, p in self._procs.items() if p.proc is not None and p.proc.poll() is None}

    def close(self, timeout_s: float | None = None) -> None:
        """Drain and stop every live worker this launcher started; wait for the transitions. A
        worker whose drain the router refuses or does not answer is stopped all the same."""
        self._closing = True
        for worker in [w for w in self.workers if w.state in ("starting", "serving")]:
            if self._procs[worker.name].proc is not None:
                self.drain(worker)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None
                                       else self.drain_timeout_s + self.stop_timeout_s + 5)
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    # --- transitions (each on its own thread) ------------------------------------------
    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=self._guarded, args=(fn, *args), daemon=True, name=f"kvtier-launcher-{fn.__name__}")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:   # a transition's failure is logged; the planner sees the state next interval
            log.exception("launcher transition %s failed", fn.__name__)

    def _bring_up(self, worker: WorkerRecord) -> None:
        proc = self._procs[worker.name]
        deadline = time.monotonic() + self.health_timeout_s
        while worker.state == "starting":
            if proc.proc.poll() is not None:
                # stop() kills what is left of its process group (vLLM's engine core): a fork
                # does not inherit PR_SET_PDEATHSIG, so nothing else would
                self.stop(worker)
                return self._failed(worker, f"exited ({proc.proc.returncode}) before it was healthy")
            if _healthy(worker.url):
                try:
                    self.admin.add(worker.url, proc.events)
                except LaunchError as exc:
                    # refused, or no answer: a timed-out add may still have landed, so forget it
                    # too; the failure backoff then spaces out the next try
                    self._forget(worker)
                    self.stop(worker)
                    return self._failed(worker, f"healthy but the router did not take it: {exc}")
                with self._lock:
                    if worker.state == "starting":
                        worker.state = "serving"
                        self._record("serving", worker)
                if worker.state == "serving":
                    return self._watch(worker)
                break   # drained while we registered it: fall through and take it out again
            if time.monotonic() > deadline:
                self.stop(worker)
                return self._failed(worker, f"not healthy after {self.health_timeout_s:.0f} s")
            time.sleep(self.poll_s)
        if worker.state == "draining":   # drained before it ever served: the drain thread stops it
            return

    def _watch(self, worker: WorkerRecord) -> None:
        """While it serves (a drain takes over from here; a refused drain starts a new watch): a
        process that exited is a worker gone, however the router's health check sees it."""
        proc = self._procs[worker.name].proc
        while proc is not None and worker.state == "serving":   # None: adopted, not ours to watch
            if proc.poll() is not None:
                with self._lock:
                    if worker.state != "serving":   # a drain began: its thread stops the worker
                        return
                    worker.state = "failed"         # claimed: drain() leaves a failed worker alone
                self.stop(worker)                   # reaps it and kills what is left of its group
                self._forget(worker)
                return self._failed(worker, f"exited ({proc.returncode}) while serving")
            time.sleep(self.poll_s)

    def _forget(self, worker: WorkerRecord) -> None:
        """Best effort: the router stops routing to ``worker`` and forgets it (it may not know it)."""
        try:
            if worker.url in self.admin.workers():
                self.admin.drain(worker.url)
                self.admin.remove(worker.url, force=True)
        except LaunchError as exc:
            log.warning("could not remove %s from the router: %s", worker.name, exc)

    def _drain_then_stop(self, worker: WorkerRecord, registered: bool) -> None:
        if registered:
            try:
                self.admin.drain(worker.url)
            except LaunchError as exc:
                if self._closing:   # close() promises every started worker stopped: stop it unregistered
                    log.warning("drain of %s failed while closing: %s; stopping it anyway", worker.name, exc)
                    return self.stop(worker)
                # 409 (the router's last routable worker) or the router is down: keep it serving
                log.warning("drain of %s refused: %s; it stays in rotation", worker.name, exc)
                with self._lock:
                    worker.state = "serving"
                self._record("drain_refused", worker)
                return self._watch(worker)   # serving again: this thread watches it now
            deadline = time.monotonic() + self.drain_timeout_s
            force = False
            while True:
                try:
                    inflight = self.admin.workers().get(worker.url, {}).get("inflight", 0)
                except LaunchError as exc:
                    log.warning("router unreachable while draining %s: %s", worker.name, exc)
                    inflight = 1
                if inflight == 0:
                    break
                if time.monotonic() > deadline:
                    log.warning("drain of %s: %d still in flight after %.0f s; removing it anyway",
                                worker.name, inflight, self.drain_timeout_s)
                    force = True
                    break
                time.sleep(self.poll_s)
            try:
                self.admin.remove(worker.url, force=force)
            except LaunchError as exc:
                log.warning("removing %s from the router: %s", worker.name, exc)
            self._record("removed", worker)
        else:
            # still starting: it never joined the router. Wait for the start thread to see the
            # state change (it may be mid-registration), then make sure the router forgets it.
            time.sleep(self.poll_s)
            self._forget(worker)
        self.stop(worker)

    def _failed(self, worker: WorkerRecord, why: str) -> None:
        proc = self._procs[worker.name]
        tail = ""
        if proc.log_path is not None:
            try:
                tail = proc.log_path.read_text(errors="replace")[-2000:]
            except OSError:
                pass
        log.error("worker %s %s; log %s:\n%s", worker.name, why, proc.log_path, tail)
        with self._lock:
            worker.state = "failed"
        self._last_failure_s = time.monotonic()
        self._record("failed", worker)

    def _record(self, action: str, worker: WorkerRecord) -> None:
        with self._lock:
            self.actions.append((time.time(), action, worker.name))
        log.info("launcher: %s %s (%s)", action, worker.name, worker.url)
