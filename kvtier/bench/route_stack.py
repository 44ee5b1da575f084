"""Start the pieces of a routed deployment as real processes: vLLM workers and ``kvtier route``.

For ``kvtier bench route --trace`` and the real-vLLM router tests. A worker is
``python -m kvtier.integrations.vllm.launcher serve`` (vLLM's own CLI) with its KV events
published on a loopback ZMQ port and, optionally, the kvtier connector; a router is
``python -m kvtier.cli.main route`` in front of them. Each runs in its own process group
(so that vLLM's engine-core child goes with it) and dies with its parent (a killed test
run leaves nothing behind); logs go to files the caller names.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtier.child_process import die_with_parent
from kvtier.router.config import replay_beside


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    proc: subprocess.Popen
    log_path: Path
    url: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, as far as the others can tell."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        try:   # whatever of the group is left (vLLM's engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Worker(Proc):
    events: str = ""
    cmd: tuple = ()          #: how it was started (a restart reuses it: same port, same events endpoint)
    env: dict | None = None

    @property
    def spec(self) -> str:
        """``kvtier route --worker`` value."""
        return f"{self.url},events={self.events},replay={replay_beside(self.events)}"

    def restart(self) -> None:
        """Start it again as it was (after :meth:`kill` or :meth:`stop`): a new process and a new
        KV-event publisher (its sequence from 0) on the same URL and endpoint; returns at once."""
        if self.alive():
            raise RuntimeError(f"worker {self.url} is still running")
        self.proc = _spawn(list(self.cmd), self.env, self.log_path, append=True)


def _die_with_parent() -> None:
    """In the child: a session of its own (its group is signalled whole), gone with its starter."""
    os.setsid()
    die_with_parent()


def kvtier_transfer_config(remote_url: str, token: str, *, block_tokens: int = 64,
                           host_bytes: str | int = "32MiB") -> dict:
    """vLLM ``--kv-transfer-config`` of the kvtier connector over a shared ``kvtier serve``."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_tokens": block_tokens, "host_bytes": host_bytes,
                                          "remote_url": remote_url, "remote_token": token}}


def start_worker(model: str, log_path: Path, *, transfer: dict | None = None, core: int | None = None,
                 max_model_len: int = 2048, block_size: int = 32, kv_cache_gib: int = 1,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> Worker:
    """A vLLM OpenAI server on a free loopback port (``env``: set in its environment besides
    this process's); returns at once (see :func:`wait_ready`)."""
    port = free_port()
    # vLLM binds its publisher only for wildcard TCP ("tcp://*:N": every interface, anyone
    # on the network reads the events) and ipc/inproc; "tcp://127.0.0.1:N" makes it
    # *connect*. An ipc socket beside the log: local, and as private as that directory.
    endpoint = f"ipc://{Path(log_path).resolve().parent}/vllm-{port}.events"
    # and its replay buffer beside it: the router catches up on connecting and after lost events
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay_beside(endpoint), "topic": ""}
    cmd = [sys.executable, "-m", "kvtier.integrations.vllm.launcher", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
           "--max-model-len", str(max_model_len), "--enable-prompt-tokens-details",
           # vLLM's abort endpoint, which the router calls when a client leaves (router/abort.py)
           "--enable-scale-out",
           "--kv-events-config", json.dumps(events), *(extra_args or [])]
    if transfer:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    # VLLM_ENABLE_RESPONSES_API_STORE: Responses API answers kept per worker (previous_response_id)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_ENABLE_RESPONSES_API_STORE": "1",
           "VLLM_SERVER_DEV_MODE": "1", "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    if core is not None:     # one core per worker: two workers' OpenMP threads must not fight
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    proc = _spawn(cmd, env, Path(log_path))
    return Worker(proc, Path(log_path), f"http://127.0.0.1:{port}", endpoint, tuple(cmd), env)


def _spawn(cmd: list[str], env: dict | None, log_path: Path, append: bool = False) -> subprocess.Popen:
    log = open(log_path, "a" if append else "w")   # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            preexec_fn=_die_with_parent)
    log.close()
    return proc


def wait_ready(procs: list[Proc], timeout_s: float = 300.0) -> None:
    """Until every one answers ``/health`` 200; raises with the log tail of one that died or hung."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.url} exited ({p.proc.returncode}) before it was ready:\n{p.log_tail()}")
            try:
                with urllib.request.urlopen(p.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(p)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            for p in pending:
                p.stop()
            raise RuntimeError(f"{pending[0].url} not ready after {timeout_s:.0f} s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)


def start_router(model: str, workers: list[Worker], log_path: Path, *, policy: str = "tier-aware",
                 events: bool = True, extra_args: list[str] | None = None, timeout_s: float = 60.0) -> Proc:
    """``kvtier route`` on a free port, ready (its ``/health`` answers) when this returns."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier.cli.main", "route", "--model-path", model, "--port", str(port),
           "--policy", policy, "--health-interval-s", "0.5", *(extra_args or [])]
    for w in workers:
        cmd += ["--worker", w.spec if events else w.url]
    proc = _spawn(cmd, {**os.environ, "HF_HUB_OFFLINE": "1"}, Path(log_path))
    router = Proc(proc, Path(log_path), f"http://127.0.0.1:{port}")
    wait_ready([router], timeout_s)
    return router


def events_connected(router: Proc, workers: int, timeout_s: float = 30.0) -> bool:
    """Until the router's ``/metrics`` says every worker's KV events are connected."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router.url + "/metrics", timeout=2) as resp:
                text = resp.read().decode()
            up = [line for line in text.splitlines()
                  if line.startswith("kvtier_router_worker_events_up{") and line.endswith(" 1.0")]
            if len(up) >= workers:
                return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def router_metric(router: Proc, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the router's ``/metrics`` (0 when absent); labels matched whole."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(router.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # a counter's sample is NAME_total
            if sample.name in (name, name + "_total") and (labels is None or sample.labels == labels):
                return sample.value
    return 0.0
