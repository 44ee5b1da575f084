"""``kvtier demo``: split the scenario at its restarts, run each part in a fresh engine process.

This process never imports torch: it spawns :mod:`kvtier.demo.worker` once per
phase (so the restart in the middle is a real one: new process, empty host
tier, the disk tier re-indexed from its directory), feeds it the scenario and
the conversations so far as JSON, and renders the JSON lines it answers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.bench.baselines import report_warnings
from kvtier.child_process import die_with_parent
from kvtier.demo.report import Reporter, plot, print_summary
from kvtier.demo.summary import summarize
from kvtier.demo.workload import Scenario, default_scenario, quick_scenario
from kvtier.integrations.transformers.namespace import DEFAULT_BLOCK_TOKENS  # no torch at import

#: tokens per block: see DEFAULT_BLOCK_TOKENS for why 16 suits conversation turns
BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS


def phases_of(scenario: Scenario) -> list[list[int]]:
    """Step indices per engine process: the scenario cut at each "restart"."""
    phases: list[list[int]] = [[]]
    for i, step in enumerate(scenario.steps):
        if step.kind == "restart":
            phases.append([])
        else:
            phases[-1].append(i)
    return [p for p in phases if p]


def store_settings(store_dir: str, remote_url: str | None = None) -> dict:
    # Write-through: a turn's blocks reach the disk tier (or the server) when they
    # are saved, so a restart (or a crash) loses nothing but the DRAM copy. The
    # host pool is prefaulted at open (~1 s a GiB here, on a restart's critical
    # path): sized for the demo's working set (~250 MiB), not for the machine.
    settings = {"host_bytes": "384MiB", "write_mode": "write-through"}
    if remote_url:
        # The shared server is the tier a new process resumes from (token: $KVTIER_TOKEN).
        return {**settings, "remote_url": remote_url, "remote_namespace": "kvtier-demo", "remote_timeout_s": 30.0}
    return {**settings, "disk_path": store_dir, "disk_bytes": "8GiB"}


def run_phase(job: dict, reporter: Reporter) -> tuple[list[dict], dict]:
    """Run one worker process to completion; its turn records and its summary of itself."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by OpenMP at torch import, so set before exec
    spawned = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.demo.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
            preexec_fn=die_with_parent,
        )
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        turns: list[dict] = []
        info: dict = {"phase": job["phase"]}
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "ready":
                info.update(event, spawn_to_ready_s=time.perf_counter() - spawned)
            elif event["event"] == "turn":
                turns.append(event)
            elif event["event"] == "done":
                info.update(sessions=event["sessions"], store_stats=event["store_stats"])
            reporter.on_event(event)
        if proc.wait() != 0:
            errors.seek(0)
            raise RuntimeError(f"demo worker (phase {job['phase']}) failed:\n{errors.read()[-4000:]}")
    return turns, info


def replay(
    scenario: Scenario,
    store_dir: str,
    reporter: Reporter,
    *,
    threads: int | None = None,
    model_spec: dict | None = None,
    model_root: str | None = None,
    remote_url: str | None = None,
) -> tuple[list[dict], list[dict]]:
    """Run every phase of ``scenario`` in its own worker process; the turn records and per-phase info."""
    turns: list[dict] = []
    infos: list[dict] = []
    sessions: dict = {}
    for number, indices in enumerate(phases_of(scenario), start=1):
        if number > 1:
            shared = "kvtier server" if remote_url else "disk tier"
            reporter.restart(f"engine process {infos[-1].get('pid')} exits; a new one starts on the same {shared}")
        job = {
            "phase": number,
            "scenario": scenario.to_json(),
            "step_indices": indices,
            "sessions": sessions,
            "block_tokens": BLOCK_TOKENS,
            "store": store_settings(store_dir, remote_url),
            "threads": threads,
            "capacity_tokens": 8192,
            "model_spec": model_spec,
            "model_root": model_root,
        }
        phase_turns, info = run_phase(job, reporter)
        turns += phase_turns
        infos.append(info)
        sessions = info["sessions"]
    return turns, infos


def run_demo(args) -> int:
    missing = [name for name in ("torch", "transformers", "tokenizers") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"kvtier demo runs a model and needs {', '.join(missing)}: install them with "
              f"`pip install torch==2.13.0 'kvtier[torch]'` (or `make install`), "
              f"or run `kvtier demo --synthetic`, which needs neither.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    scenario = quick_scenario() if args.quick else default_scenario()
    phases = phases_of(scenario)
    from kvtier.integrations.transformers.models import cache_dir  # no torch at import

    own_dir = args.store_dir is None
    store_dir = args.store_dir or tempfile.mkdtemp(prefix="demo-store-", dir=_mkdir(cache_dir()))
    try:
        with Reporter(sum(len(p) for p in phases), quiet_stdout=args.json) as reporter:
            turns, infos = replay(scenario, store_dir, reporter, threads=args.threads,
                                  remote_url=getattr(args, "remote", None))
        summary = summarize(turns, infos, runtime_s=time.perf_counter() - started, scenario=scenario.name)
        report_warnings(summary["warnings"])  # a load faster than its limit: the limit is wrong
        if args.plot:
            boundaries = [sum(len(p) for p in phases[: k + 1]) for k in range(len(phases) - 1)]
            plot(turns, args.plot, boundaries)
            summary["plot"] = args.plot
        if args.json:
            print(json.dumps(summary))
        else:
            print_summary(reporter.console, summary)
    finally:
        if own_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
    return 0


def _mkdir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
