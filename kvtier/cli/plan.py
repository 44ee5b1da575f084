"""``kvtier plan capacity`` and ``kvtier plan workers``: sizing answers with their formulas."""

from __future__ import annotations

import json
import sys

from kvtier.core.units import finite_float


def _print_json(value) -> None:
    """Strict JSON: a size or time that is not finite (``--retention-s 1e308``) is ``null``, never
    ``Infinity`` / ``NaN``, which are not JSON (jq, Go and JavaScript refuse them)."""
    from kvtier.planner.live import json_safe

    print(json.dumps(json_safe(value), allow_nan=False))


#: ``plan live --launcher local`` starts ``vllm serve`` on this host: without ``--max-workers`` it
#: was bounded only by the sizing's 100,000, and a few refused over-long prompts (audit s30 a7 D2)
#: had it spawn dozens; a host holds a few GPUs' workers
LOCAL_MAX_WORKERS = 8

#: ``plan workers``' description of the workload without a trace (a trace gives its own), and
#: the shared tier's retention, which sizes it only then
WORKLOAD_FLAGS = ("--rate", "--input-tokens", "--output-tokens", "--retention-s")
DEFAULT_RETENTION_S = 3600.0
#: fleets ``--verify`` simulates at most: the plan's, then one more prefill worker each
VERIFY_FLEETS = 32


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def ttft_percentile(text: str) -> float:
    """An argparse ``type`` for ``--ttft-percentile``, checked in its own unit (percent: 90 for p90).
    The sizing's message spoke of a fraction ("0.9 for p90"), and ``--ttft-percentile 0.9`` then
    sized the fleet for p0.9; a value below 1 is accepted (p0.5 may be meant) with a warning."""
    import argparse

    value = finite_float(text)
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"a percentile in (0, 100), e.g. 90 for p90; got {text}")
    if value < 1:
        print(f"kvtier: warning: --ttft-percentile {text} sizes for p{value:g}, not p{value * 100:g}; "
              f"the flag is in percent (90 for p90)", file=sys.stderr)
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="size context memory and workers")
    sub = parser.add_subparsers(dest="plan", required=True)

    cap = sub.add_parser("capacity", help="bytes of context memory for a user population")
    cap.add_argument("--model", default="llama-3-70b", help="preset name or path to an HF config.json")
    cap.add_argument("--kv-dtype", default=None, help="KV dtype (default: the model's, else bfloat16)")
    cap.add_argument("--users", type=int, required=True)
    cap.add_argument("--context-tokens", type=int, required=True, help="tokens of context per session")
    cap.add_argument("--sessions", type=_ints, default=(1,), help="sessions retained per user, e.g. 1,5,15,150")
    cap.add_argument("--replication", type=finite_float, default=1.0, help="copies kept by the shared tier")
    cap.add_argument("--overhead", type=finite_float, default=0.0,
                     help="format/encryption overhead as a fraction of raw KV (block header, AEAD tag)")
    cap.add_argument("--active-fraction", type=finite_float, default=0.1,
                     help="share of users active at once (their session sits in host DRAM)")
    cap.add_argument("--json", action="store_true")
    cap.set_defaults(func=_reporting_config_errors(run_capacity))

    wk = sub.add_parser("workers", help="prefill/decode workers and tier sizes for TTFT and ITL targets")
    wk.add_argument("--ttft", type=finite_float, required=True, help="TTFT target in seconds")
    wk.add_argument("--ttft-percentile", type=ttft_percentile, default=90.0,
                    help="percentile the TTFT target applies to, in percent (default 90: p90)")
    wk.add_argument("--itl", type=finite_float, required=True, help="inter-token latency target in seconds")
    wk.add_argument("--trace", default=None, help="Mooncake-format trace (gives rate, lengths and hit rate)")
    wk.add_argument("--rate", type=finite_float, default=None, help="arrival rate in requests/s (without --trace)")
    wk.add_argument("--input-tokens", type=int, default=None, help="mean prompt tokens (without --trace)")
    wk.add_argument("--output-tokens", type=int, default=None, help="mean output tokens (without --trace)")
    wk.add_argument("--hit-rate", type=finite_float, default=None,
                    help="share of prompt tokens loaded instead of recomputed (default with --trace: its replay)")
    wk.add_argument("--retention-s", type=finite_float, default=None,
                    help=f"without --trace: how long the shared tier keeps context, for sizing it "
                         f"(default {DEFAULT_RETENTION_S:g})")
    wk.add_argument("--cluster", default=None, help="cluster config JSON (model, accelerator, tiers)")
    wk.add_argument("--calibration", default=None, help="prefill calibration table (kvtier bench prefill)")
    wk.add_argument("--verify", action="store_true",
                    help="with --trace: check the plan by simulation (exit 1 when the simulated fleet misses the "
                         "TTFT target)")
    wk.add_argument("--json", action="store_true")
    wk.set_defaults(func=_reporting_config_errors(run_workers))

    live = sub.add_parser("live", help="watch a deployment's metrics, decide worker counts, act through a launcher")
    live.add_argument("--router", required=True, help="kvtier route address (host:port or URL) whose /metrics to poll")
    live.add_argument("--ttft", type=finite_float, required=True, help="TTFT target in seconds")
    live.add_argument("--ttft-percentile", type=ttft_percentile, default=90.0,
                      help="percentile the TTFT target applies to, in percent (default 90: p90)")
    live.add_argument("--itl", type=finite_float, required=True, help="inter-token latency target in seconds")
    live.add_argument("--output-tokens", type=int, default=256, help="mean output tokens assumed for decode sizing")
    live.add_argument("--cluster", default=None, help="cluster config JSON (model, accelerator, tiers)")
    live.add_argument("--calibration", default=None, help="prefill calibration table (kvtier bench prefill)")
    live.add_argument("--interval", type=finite_float, default=15.0, help="seconds between decisions")
    live.add_argument("--startup", type=finite_float, default=60.0, help="seconds a new worker takes to serve")
    live.add_argument("--prefill-workers", type=int, default=1, help="workers running now")
    live.add_argument("--decode-workers", type=int, default=1)
    live.add_argument("--status-file", default=None, help="write the last decision here as JSON (kvtier top reads it)")
    live.add_argument("--json", action="store_true", help="one JSON line per decision")
    live.add_argument("--iterations", type=int, default=0, help="stop after N decisions (0: run until interrupted)")
    live.add_argument("--min-workers", type=int, default=1, help="never fewer workers per pool")
    live.add_argument("--max-workers", type=int, default=None,
                      help=f"never more workers per pool (default with --launcher local, which runs them on this "
                           f"host: {LOCAL_MAX_WORKERS}, or the --adopt or --min-workers count if higher; else "
                           "100,000)")
    live.add_argument("--headroom", type=finite_float, default=0.10, help="size for the forecast x (1 + headroom)")
    live.add_argument("--scale-down-after", type=int, default=2, help="intervals the need must stay low")
    live.add_argument("--down-cooldown", type=finite_float, default=60.0,
                      help="seconds after any change before a scale-down")
    live.add_argument("--worker", action="append", default=[],
                      help="a worker's vLLM address whose /metrics to read (repeatable; the local launcher adds its own)")
    live.add_argument("--metrics-port", type=int, default=None, help="serve the planner's Prometheus /metrics here")
    live.add_argument("--metrics-host", default="127.0.0.1")
    live.add_argument("--targets-file", default=None,
                      help="write the serving workers here as a Prometheus file_sd list (job vllm)")
    launch = live.add_argument_group("launcher")
    launch.add_argument("--launcher", choices=("dry-run", "local"), default="dry-run",
                        help="dry-run: print decisions; local: start/drain/stop `vllm serve` workers behind the router "
                             "(either way one interval starts at most as many workers as the pool runs, a few "
                             "when it runs fewer; the next intervals start the rest)")
    launch.add_argument("--model", default=None, help="local: the model the started workers serve")
    launch.add_argument("--worker-args", default="",
                        help="local: `vllm serve` flags for every started worker, one shell-quoted string "
                             "(e.g. the kvtier connector's --kv-transfer-config)")
    launch.add_argument("--adopt", action="append", default=[],
                        help="local: a worker already registered with the router (repeatable); drained like the "
                             "others, never signalled")
    launch.add_argument("--run-dir", default=None, help="local: worker logs and event sockets (default: a new "
                                                        "private temporary directory)")
    launch.add_argument("--cores", default="", help="local: CPU cores for VLLM_CPU_OMP_THREADS_BIND, taken in turn")
    launch.add_argument("--no-kv-events", action="store_true", help="local: workers publish no KV events")
    launch.add_argument("--health-timeout", type=finite_float, default=600.0,
                        help="local: seconds a worker may take to start")
    launch.add_argument("--drain-timeout", type=finite_float, default=300.0,
                        help="local: seconds to wait for in-flight requests before removing a draining worker")
    launch.add_argument("--stop-timeout", type=finite_float, default=None,
                        help="local: seconds a stopping worker has from SIGTERM to SIGKILL (default: the "
                             "--shutdown-timeout its vLLM runs with, which covers a kvtier connector's flush, "
                             "plus 30, at least 60)")
    launch.add_argument("--router-admin-token", default=None,
                        help="local: the router's admin token (default: $KVTIER_ROUTER_ADMIN_TOKEN)")
    live.set_defaults(func=_reporting_config_errors(run_live))


def _reporting_config_errors(command):
    """Turn a configuration mistake into its message and exit status 2, not a traceback."""

    def run(args) -> int:
        from kvtier.errors import ConfigError

        try:
            return command(args)
        except ConfigError as exc:
            print(f"kvtier plan: {exc}", file=sys.stderr)
            return 2

    return run


def run_capacity(args) -> int:
    from kvtier.planner.capacity import CapacityInputs, plan_capacity, render_plan
    from kvtier.planner.models import load_model

    model = load_model(args.model, kv_dtype=args.kv_dtype)
    inputs = CapacityInputs(users=args.users, context_tokens=args.context_tokens, sessions=args.sessions,
                            replication=args.replication, format_overhead=args.overhead,
                            active_fraction=args.active_fraction)
    plan = plan_capacity(model, inputs)
    if args.json:
        _print_json({
            "model": plan.model,
            "bytes_per_token": plan.bytes_per_token,
            "session_bytes": plan.session_bytes,
            "units": "bytes (decimal: 1 TB = 1e12)",
            "formula": "users x sessions x context_tokens x bytes_per_token x (1 + overhead) x replication",
            "rows": [row._asdict() for row in plan.rows],
        })
    else:
        print(render_plan(plan, inputs))
    return 0


def run_workers(args) -> int:
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.models import load_model
    from kvtier.planner.workers import (SLATargets, Workload, plan_workers, shared_tier_bytes_for_hit_rate,
                                         shared_tier_bytes_for_retention)
    from kvtier.sim.cluster import load_cluster

    _refuse_flags_of_the_other_mode(args)
    cluster = load_cluster(args.cluster)
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, args.calibration or cluster.calibration)
    targets = SLATargets(ttft_s=args.ttft, itl_s=args.itl, ttft_percentile=args.ttft_percentile / 100.0)
    pod = [t for t in cluster.tiers if t.scope == "pod"]
    load_bw = min(t.read_bytes_per_s for t in (pod or cluster.tiers)) if cluster.tiers else 1e18
    tiers: dict[str, float] = {}
    if args.trace:
        from kvtier.sim.cache import hit_rate_curve, replay_prefix_hits
        from kvtier.sim.trace import load_trace

        trace = load_trace(args.trace, cluster.block_tokens)
        block_bytes = model.block_bytes(cluster.block_tokens)
        unbounded = replay_prefix_hits(trace)
        hit_rate = args.hit_rate if args.hit_rate is not None else unbounded.token_hit_rate
        _warn_of_a_hit_rate_above_the_traces(hit_rate, unbounded.token_hit_rate)
        workload = Workload.from_arrivals([r.arrival_s for r in trace.requests],
                                          [r.input_tokens for r in trace.requests],
                                          [r.output_tokens for r in trace.requests], hit_rate)
        # The shared tier: the smallest capacity on the LRU curve that reaches the assumed hit rate.
        tiers["shared_bytes"] = shared_tier_bytes_for_hit_rate(hit_rate_curve(trace), hit_rate, block_bytes)
        hit_source = "given" if args.hit_rate is not None else "replay of the trace, unbounded LRU (token hits)"
    else:
        if None in (args.rate, args.input_tokens, args.output_tokens, args.hit_rate):
            print("kvtier plan workers: without --trace give --rate, --input-tokens, --output-tokens and --hit-rate",
                  file=sys.stderr)
            return 2
        workload = Workload(args.rate, (args.input_tokens,), (args.output_tokens,), args.hit_rate)
        retention_s = DEFAULT_RETENTION_S if args.retention_s is None else args.retention_s
        tiers["shared_bytes"] = shared_tier_bytes_for_retention(args.rate, retention_s, args.input_tokens,
                                                                args.hit_rate, model.bytes_per_token)
        hit_source = "given"
    decode_kv_tokens = int(cluster.decode_kv_bytes // model.bytes_per_token)
    plan = plan_workers(workload, targets, costs.prefill, costs.decode, load_bw, decode_kv_tokens)
    tiers["hbm_cache_bytes_per_prefill_worker"] = cluster.hbm_cache_bytes
    verified = None
    if args.verify:
        verified = _verify_by_simulation(trace, cluster, plan, targets, args.calibration)
    out = {"model": model.name, "accelerator": cluster.accelerator, "devices_per_worker": cluster.devices_per_worker,
           "cost_model": costs.provenance, "hit_rate_assumed": plan.hit_rate, "hit_rate_source": hit_source,
           "arrival_rate_per_s": workload.arrival_rate_per_s, **plan._asdict(), "tiers": tiers,
           "simulated": verified}
    missed = verified is not None and not verified["meets_target"]
    if args.json:
        _print_json(out)
    else:
        _print_workers(args, out)
    if missed:
        print(f"kvtier plan: the simulation misses the p{args.ttft_percentile:g} TTFT target of {args.ttft:g} s: "
              f"{verified['ttft_s']:.3g} s with {verified['prefill_workers']} prefill workers, the most --verify "
              "tries; the plan does not hold for this trace (its assumed hit rate or cost model)", file=sys.stderr)
    return 1 if missed else 0


def _print_workers(args, out: dict) -> None:
    """The text form of ``out``, the plan ``--json`` posts."""
    from kvtier.planner.capacity import human_bytes

    print(f"{out['model']} on {out['devices_per_worker']}x{out['accelerator']} per worker; {out['cost_model']}")
    print(f"workload: {out['arrival_rate_per_s']:.2f} req/s (arrival SCV {out['arrival_scv']:.2f}),"
          f" token hit rate assumed {out['hit_rate_assumed']:.1%} ({out['hit_rate_source']})")
    print(f"prefill workers: {out['prefill_workers']} (utilization {out['prefill_utilization']:.0%},"
          f" predicted p{args.ttft_percentile:g} TTFT {out['predicted_ttft_s']:.2f} s <= {args.ttft} s)")
    print(f"decode workers:  {out['decode_workers']} (batch ~{out['decode_batch']},"
          f" predicted ITL {out['predicted_itl_s'] * 1000:.1f} ms <= {args.itl * 1000:g} ms)")
    for name, size in out["tiers"].items():
        print(f"{name}: {human_bytes(size)}")
    verified = out["simulated"]
    if verified:
        verdict = "meets the target" if verified["meets_target"] else f"misses the target of {args.ttft:g} s"
        print(f"simulated with tier-aware routing and {verified['prefill_workers']} prefill workers:"
              f" p{args.ttft_percentile:g} TTFT {verified['ttft_s']:.2f} s ({verdict}),"
              f" ITL p50 {verified['itl_p50_s'] * 1000:.1f} ms, token hit rate {verified['token_hit_rate']:.1%}"
              f" (block hit rate {verified['block_hit_rate']:.1%})")


def _refuse_flags_of_the_other_mode(args) -> None:
    """Refuse, by name, the flags the mode run would ignore: with ``--trace``, the workload's
    (:data:`WORKLOAD_FLAGS`: the trace gives rate and lengths, its replay the shared tier's size;
    a plan printed "for 100 req/s" was the trace's 1 req/s); without it, ``--verify`` (nothing
    to simulate: it posted ``"simulated": null``, exit 0)."""
    from kvtier.errors import ConfigError

    if args.trace:
        given = [flag for flag in WORKLOAD_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            one = len(given) == 1
            named = given[0] if one else f"{', '.join(given[:-1])} and {given[-1]}"
            raise ConfigError(f"{named} {'is' if one else 'are'} for the plan without --trace: the "
                              "trace gives the arrival rate and lengths, and its replay the shared tier's size; "
                              f"leave {'it' if one else 'them'} out, or --trace out")
    elif args.verify:
        raise ConfigError("--verify simulates a --trace: give --trace FILE, or leave --verify out")


def _warn_of_a_hit_rate_above_the_traces(assumed: float, unbounded: float) -> None:
    """``--hit-rate`` above what even an unbounded cache gets from the trace: the plan is sized
    for reuse the workload does not have (and ``--verify`` then misses its target)."""
    if assumed > unbounded:
        print(f"kvtier plan: warning: --hit-rate {assumed:g} is above the trace's own, {unbounded:.3g} with an "
              "unbounded cache: the plan assumes reuse the trace does not have", file=sys.stderr)


def _verify_by_simulation(trace, cluster, plan, targets, calibration) -> dict:
    """Simulate the plan with tier-aware routing; add prefill workers until the simulated
    TTFT percentile meets the target too (the queueing formula is an approximation), at most
    :data:`VERIFY_FLEETS` fleets. Posts the last fleet simulated and ``meets_target``."""
    import numpy as np

    from kvtier.sim import run_simulation

    # the fleet posted is the last one simulated, whether or not it met the target
    for extra in range(VERIFY_FLEETS):
        workers = plan.prefill_workers + extra
        run = run_simulation(trace, cluster.replace(prefill_workers=workers, decode_workers=plan.decode_workers),
                             ["tier_aware"], calibration)
        ttft = float(np.percentile([o.ttft_s for o in run.results["tier_aware"].outcomes],
                                   targets.ttft_percentile * 100))
        if ttft <= targets.ttft_s:
            break
    report = run.reports["tier_aware"]
    token_hit_rate = _token_hit_rate(run.results["tier_aware"], trace)
    # hit_rate: the figure set beside hit_rate_assumed, in its unit (tokens); it was the block
    # rate, which prompts ending in short partial blocks put at half the tokens actually reused
    return {"prefill_workers": workers, "ttft_s": ttft, "meets_target": ttft <= targets.ttft_s,
            "itl_p50_s": report.itl_p50_s, "token_hit_rate": token_hit_rate, "block_hit_rate": report.hit_rate,
            "hit_rate": token_hit_rate}


def _token_hit_rate(result, trace) -> float:
    """The share of the trace's prompt tokens the simulation reused (did not compute): the unit
    of the assumed hit rate (``replay_prefix_hits().token_hit_rate``), which
    ``PolicyReport.hit_rate`` (prompt blocks) is not."""
    prompt_tokens = sum(r.input_tokens for r in trace.requests)
    return 1.0 - sum(result.computed_tokens_per_worker) / prompt_tokens


def run_live(args) -> int:
    """Poll the router's counters (and the workers' vLLM metrics), decide, act through a launcher."""
    import logging
    import os
    import time

    from kvtier.cli.top import scrape
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.live import FleetSizer, LivePlanner, PlannerSettings
    from kvtier.planner.loop import PlannerLoop
    from kvtier.planner.models import load_model
    from kvtier.planner.workers import SLATargets
    from kvtier.errors import ConfigError
    from kvtier.sim.cluster import load_cluster

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _refuse_waits_out_of_range(args)
    if args.output_tokens <= 0:
        raise ConfigError(f"--output-tokens is the mean output tokens per request, > 0; got {args.output_tokens}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be 0-65535 (0: any free port), got {args.metrics_port}")
    for flag, path in (("--status-file", args.status_file), ("--targets-file", args.targets_file)):
        # said at start-up; a directory that disappears later is only logged (kvtier.planner.loop)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ConfigError(f"{flag} {path}: its directory does not exist; create it or give another path")
    cluster = load_cluster(args.cluster)
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, args.calibration or cluster.calibration)
    pod = [t for t in cluster.tiers if t.scope == "pod"]
    load_bw = min(t.read_bytes_per_s for t in (pod or cluster.tiers)) if cluster.tiers else 1e18
    sizer = FleetSizer(SLATargets(args.ttft, args.itl, args.ttft_percentile / 100.0), costs.prefill, costs.decode,
                       load_bw, int(cluster.decode_kv_bytes // model.bytes_per_token))
    settings = PlannerSettings(interval_s=args.interval, startup_s=args.startup, headroom=args.headroom,
                               scale_down_after=args.scale_down_after, down_cooldown_s=args.down_cooldown,
                               min_workers=args.min_workers, max_workers=live_max_workers(args))
    launcher, report, worker_urls = _live_launcher(args)
    current = len(args.adopt) if args.launcher == "local" else args.prefill_workers
    planner = LivePlanner(sizer, settings, max(current, settings.min_workers), args.decode_workers)
    loop = PlannerLoop(planner, launcher, args.router, args.output_tokens, scrape, aggregate=args.launcher == "local",
                       worker_urls=worker_urls, status_file=args.status_file, targets_file=args.targets_file,
                       report=report)
    try:   # before the loop: no worker has been started yet
        server = loop.metrics.serve(args.metrics_port, args.metrics_host) if args.metrics_port is not None else None
    except OSError as exc:
        raise ConfigError(f"--metrics-port {args.metrics_port} on {args.metrics_host}: cannot listen ({exc})") from None
    if server is not None:
        print(json.dumps({"planner_metrics": f"http://{args.metrics_host}:{server.server_port}/metrics"}), flush=True)
    decisions = 0
    try:
        while not args.iterations or decisions < args.iterations:
            if loop.step() is not None:
                decisions += 1
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        if hasattr(launcher, "close"):
            launcher.close()   # the local launcher drains and stops the workers it started
        if server is not None:
            server.shutdown()
    return 0


def _refuse_waits_out_of_range(args) -> None:
    """The seconds ``plan live`` sleeps or waits for, bounded by a day: ``finite_float`` takes
    1e300, which ``time.sleep`` and a process wait overflow (a traceback after the first decision,
    whose end stopped the workers that decision had started)."""
    from kvtier.cli.top import MAX_WAIT_S
    from kvtier.errors import ConfigError

    # flag, seconds, whether 0 is a meaningful value (no start-up delay, no drain wait)
    waits = (("--interval", args.interval, False), ("--startup", args.startup, True),
             ("--health-timeout", args.health_timeout, False), ("--drain-timeout", args.drain_timeout, True))
    if args.stop_timeout is not None:
        waits += (("--stop-timeout", args.stop_timeout, False),)
    for flag, seconds, zero_means_none in waits:
        low_ok = seconds >= 0 if zero_means_none else seconds > 0
        if not (low_ok and seconds <= MAX_WAIT_S):
            raise ConfigError(f"{flag} is seconds in {'[' if zero_means_none else '('}0, {MAX_WAIT_S:g}] "
                              f"(at most a day), got {seconds:g}")


def live_max_workers(args) -> int:
    """``--max-workers``; without it, 100,000 (the sizing's bound) for a dry run, and for the
    local launcher :data:`LOCAL_MAX_WORKERS`, or more where the workers adopted or
    ``--min-workers`` are more (a lower bound would drain adopted workers at once)."""
    from kvtier.planner.workers import MAX_WORKERS

    if args.max_workers is not None:   # 0 too: PlannerSettings refuses it, not taken as "not given"
        return args.max_workers
    if args.launcher != "local":
        return MAX_WORKERS
    return max(LOCAL_MAX_WORKERS, len(args.adopt), args.min_workers)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _live_launcher(args):
    """(launcher, decision printer, the worker URLs whose /metrics the planner reads)."""
    import os
    import shlex
    import signal
    import tempfile

    from kvtier.errors import ConfigError
    from kvtier.planner.launchers import DryRunLauncher

    if args.launcher == "dry-run":
        launcher = DryRunLauncher(json_lines=args.json)
        launcher.seed("prefill", args.prefill_workers)
        launcher.seed("decode", args.decode_workers)
        return launcher, launcher.report, lambda: list(args.worker)
    from kvtier.planner.local_launcher import LocalLauncher, RouterAdmin, WorkerTemplate

    if not args.adopt:
        raise ConfigError("--launcher local: give the workers already behind the router with --adopt URL "
                          "(the router starts with at least one)")
    from kvtier.router.config import WorkerSpec

    adopted = set()
    for url in args.adopt:   # (a URL the router could not name is a one-line error, not a traceback)
        if "," in url:
            raise ConfigError(f"--adopt {url!r}: give the worker's URL alone")
        name = WorkerSpec.parse(url).url
        if name in adopted:   # (one worker counted twice: the fleet would stay one short of every decision)
            raise ConfigError(f"--adopt {url!r}: that worker is given twice")
        adopted.add(name)
    try:
        cores = tuple(int(c) for c in args.cores.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--cores is a comma-separated list of core numbers, got {args.cores!r}") from None
    try:
        worker_args = tuple(shlex.split(args.worker_args))
    except ValueError as exc:   # an unbalanced quote
        raise ConfigError(f"--worker-args {args.worker_args!r}: {exc}") from None
    template = WorkerTemplate(args.model, worker_args, kv_events=not args.no_kv_events,
                              env=(("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1")),), cores=cores)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="kvtier-planner-")
    token = args.router_admin_token or os.environ.get("KVTIER_ROUTER_ADMIN_TOKEN")
    # without --stop-timeout, the launcher derives one from the workers' --shutdown-timeout: here, before
    # the planner has a thread (reading the worker arguments swaps sys.stdout while vLLM imports)
    launcher = LocalLauncher(template, RouterAdmin(args.router, token), run_dir, health_timeout_s=args.health_timeout,
                             drain_timeout_s=args.drain_timeout, stop_timeout_s=args.stop_timeout)
    for url in args.adopt:
        launcher.adopt(url)
    # SIGTERM (down.sh, a test's teardown) ends the loop like Ctrl-C: the workers it started are drained first
    signal.signal(signal.SIGTERM, _interrupted)

    def report(decision) -> None:
        d = decision.prefill
        line = {"at_s": round(decision.at_s, 3), "action": d.action, "current": d.current, "target": d.target,
                "reason": d.reason} if args.json else None
        print(json.dumps(line) if line else f"[t={decision.at_s:.0f}s] workers: {d.action} {d.current} -> "
              f"{d.target} ({d.reason})", flush=True)

    def worker_urls() -> list[str]:
        return [*args.worker, *(w.url for w in launcher.list("prefill") if w.state == "serving")]

    return launcher, report, worker_urls
