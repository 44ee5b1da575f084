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

from kvtier.bench.baselines import report_warnings
from kvtier.child_process import die_with_parent
from kvtier.demo.preflight import check_remote, exit_on_termination, make_store_dir, writable_dir
from kvtier.demo.report import Reporter, plot, print_summary
from kvtier.demo.summary import summarize
from kvtier.demo.workload import Scenario, default_scenario, quick_scenario
from kvtier.errors import ConfigError, KvtierError, LayoutError, TierError
from kvtier.integrations.transformers.models import DEMO_SPEC, cache_dir, remove_dead_builds  # no torch at import
from kvtier.integrations.transformers.namespace import DEFAULT_BLOCK_TOKENS  # no torch at import
from kvtier.json_files import strict_json

#: tokens per block: see DEFAULT_BLOCK_TOKENS for why 16 suits conversation turns
BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS
#: the server-side key space the demo's engines share with ``--remote`` (the preflight checks it is usable)
REMOTE_NAMESPACE = "kvtier-demo"


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
        return {**settings, "remote_url": remote_url, "remote_namespace": REMOTE_NAMESPACE, "remote_timeout_s": 30.0}
    return {**settings, "disk_path": store_dir, "disk_bytes": "8GiB"}


def run_phase(job: dict, reporter: Reporter) -> tuple[list[dict], dict]:
    """Run one worker process to completion; its turn records and its summary of itself.

    A worker that reports a setting or tier it cannot use (an ``error`` event) raises the
    :class:`~kvtier.errors.KvtierError` it named (``kvtier`` prints one line and exits 2); one
    that fails otherwise raises RuntimeError with its stderr. However this ends (an exception, a
    signal turned into SystemExit), the worker is stopped and reaped before this returns, so that
    nothing writes into the store directory while the caller removes it."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by OpenMP at torch import, so set before exec
    spawned = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.demo.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
            preexec_fn=die_with_parent,
        )
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            turns: list[dict] = []
            info: dict = {"phase": job["phase"]}
            failure: dict | None = None
            for line in proc.stdout:
                event = json.loads(line)
                if event["event"] == "ready":
                    info.update(event, spawn_to_ready_s=time.perf_counter() - spawned)
                elif event["event"] == "turn":
                    turns.append(event)
                elif event["event"] == "done":
                    info.update(sessions=event["sessions"], store_stats=event["store_stats"])
                elif event["event"] == "error":
                    failure = event
                elif event["event"] == "warning":
                    info.setdefault("warnings", []).append(event["text"])
                reporter.on_event(event)
            if proc.wait() != 0:
                if failure is not None:
                    raise _ERRORS.get(failure.get("kind"), ConfigError)(failure["message"])
                errors.seek(0)
                raise RuntimeError(f"demo worker (phase {job['phase']}) failed:\n{errors.read()[-4000:]}")
        finally:
            _stop(proc)
            # a model build the worker could not clean up (killed hard) is removed now that it is gone
            remove_dead_builds(job.get("model_root") or cache_dir() / "models")
    return turns, info


#: the errors a worker may report by name (anything else it reports is a ConfigError)
_ERRORS = {cls.__name__: cls for cls in (ConfigError, TierError, LayoutError, KvtierError)}


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop ``proc`` if it still runs (SIGTERM: its ``finally`` blocks run; SIGKILL after ``grace_s``)
    and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


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
    remote = getattr(args, "remote", None)
    cache = cache_dir()
    own_dir = args.store_dir is None
    try:   # everything that can be wrong with the input is found here, before a worker loads a model
        if remote and args.store_dir is not None:
            # the engines' store is then the server alone (store_settings): the directory was
            # neither checked nor used, and the run exited 0 as if a disk tier had been there
            raise ConfigError("--store-dir is the local disk tier's; --remote uses the server as the shared "
                              "tier instead: give one of them")
        if remote:
            check_remote(remote, REMOTE_NAMESPACE)
        if args.store_dir is not None:
            writable_dir(args.store_dir, "--store-dir")
        if args.plot:
            check_plot_path(args.plot)
        if own_dir or not (cache / "models" / DEMO_SPEC.name / "config.json").exists():
            # the model is built and cached there (and the store directory made) on first use
            writable_dir(cache / "models", "the cache directory", fix="; set XDG_CACHE_HOME to a writable directory")
    except ConfigError as exc:
        print(f"kvtier demo: {exc}", file=sys.stderr)   # as kvtier's main would: one line, exit 2
        return 2
    with exit_on_termination():   # SIGTERM/SIGHUP unwind too: the finally below removes the store
        store_dir = make_store_dir(cache) if own_dir else args.store_dir
        try:
            with Reporter(sum(len(p) for p in phases), quiet_stdout=args.json) as reporter:
                turns, infos = replay(scenario, store_dir, reporter, threads=args.threads, remote_url=remote)
        finally:
            if own_dir:
                shutil.rmtree(store_dir, ignore_errors=True)
    summary = summarize(turns, infos, runtime_s=time.perf_counter() - started, scenario=scenario.name)
    report_warnings(summary["warnings"])  # a load faster than its limit: the limit is wrong
    if args.plot:
        # after the runs, before the figures are printed, but never instead of them
        boundaries = [sum(len(p) for p in phases[: k + 1]) for k in range(len(phases) - 1)]
        try:
            plot(turns, args.plot, boundaries)
            summary["plot"] = args.plot
        except OSError as exc:
            summary["plot_error"] = f"{args.plot}: {exc.strerror or exc}"
    if args.json:
        print(strict_json(summary))   # NaN / Infinity are no JSON: jq, Go and JavaScript refuse them
    else:
        print_summary(reporter.console, summary)
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    """1, with a line on stderr for each reason, when the run did not show what it exists to show:
    kvtier's outputs differ from the recompute's (greedy tokens, or first-token logits NaN or off
    by more than their tolerance: a load served wrong or no KV), or the plot asked for was not
    written; else 0. Said after the figures, never instead of them."""
    failures = []
    if not summary["outputs_equal"] or summary["logits_nan"] or summary["logits_off_turns"]:
        failures.append(f"outputs differ between kvtier and the recompute{_logits_failure(summary)} "
                        f"(a load served wrong or missing KV): see the turns marked NO")
    if "plot_error" in summary:
        failures.append(f"the plot could not be written: {summary['plot_error']}")
    for failure in failures:
        print(f"kvtier demo: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _logits_failure(summary: dict) -> str:
    """What the first-token logits add to a failed run's line (nothing when they passed)."""
    if summary["logits_nan"]:
        return "; a turn's first-token logits were NaN (its load left the poisoned KV in place)"
    if summary["logits_off_turns"]:
        turns = ", ".join(f"#{n}" for n in summary["logits_off_turns"])
        return f"; first-token logits off by more than their tolerance on turns {turns}"
    return ""


def check_plot_path(path: str) -> None:
    """``--plot``'s directory exists and can be written (the file is drawn after the runs); else ConfigError."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--plot {path!r} is a directory; name a .png file")
    if not os.path.isdir(parent):
        raise ConfigError(f"--plot {path!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--plot {path!r}: {parent!r} is not writable")
