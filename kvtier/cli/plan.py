"""``kvtier plan capacity`` and ``kvtier plan workers``: sizing answers with their formulas."""

from __future__ import annotations

import json
import sys


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="size context memory and workers")
    sub = parser.add_subparsers(dest="plan", required=True)

    cap = sub.add_parser("capacity", help="bytes of context memory for a user population")
    cap.add_argument("--model", default="llama-3-70b", help="preset name or path to an HF config.json")
    cap.add_argument("--kv-dtype", default=None, help="KV dtype (default: the model's, else bfloat16)")
    cap.add_argument("--users", type=int, required=True)
    cap.add_argument("--context-tokens", type=int, required=True, help="tokens of context per session")
    cap.add_argument("--sessions", type=_ints, default=(1,), help="sessions retained per user, e.g. 1,5,15,150")
    cap.add_argument("--replication", type=float, default=1.0, help="copies kept by the shared tier")
    cap.add_argument("--overhead", type=float, default=0.0,
                     help="format/encryption overhead as a fraction of raw KV (block header, AEAD tag)")
    cap.add_argument("--active-fraction", type=float, default=0.1,
                     help="share of users active at once (their session sits in host DRAM)")
    cap.add_argument("--json", action="store_true")
    cap.set_defaults(func=_reporting_config_errors(run_capacity))

    wk = sub.add_parser("workers", help="prefill/decode workers and tier sizes for TTFT and ITL targets")
    wk.add_argument("--ttft", type=float, required=True, help="TTFT target in seconds")
    wk.add_argument("--ttft-percentile", type=float, default=90.0, help="percentile the TTFT target applies to")
    wk.add_argument("--itl", type=float, required=True, help="inter-token latency target in seconds")
    wk.add_argument("--trace", default=None, help="Mooncake-format trace (gives rate, lengths and hit rate)")
    wk.add_argument("--rate", type=float, default=None, help="arrival rate in requests/s (without --trace)")
    wk.add_argument("--input-tokens", type=int, default=None, help="mean prompt tokens (without --trace)")
    wk.add_argument("--output-tokens", type=int, default=None, help="mean output tokens (without --trace)")
    wk.add_argument("--hit-rate", type=float, default=None,
                    help="share of prompt tokens loaded instead of recomputed (default with --trace: its replay)")
    wk.add_argument("--retention-s", type=float, default=3600.0,
                    help="how long the shared tier keeps context, for sizing it without a trace")
    wk.add_argument("--cluster", default=None, help="cluster config JSON (model, accelerator, tiers)")
    wk.add_argument("--calibration", default=None, help="prefill calibration table (kvtier bench prefill)")
    wk.add_argument("--verify", action="store_true", help="with --trace: check the plan by simulation")
    wk.add_argument("--json", action="store_true")
    wk.set_defaults(func=_reporting_config_errors(run_workers))

    live = sub.add_parser("live", help="watch a deployment's metrics and decide worker counts (dry run)")
    live.add_argument("--router", required=True, help="kvtier route address (host:port or URL) whose /metrics to poll")
    live.add_argument("--ttft", type=float, required=True, help="TTFT target in seconds")
    live.add_argument("--ttft-percentile", type=float, default=90.0)
    live.add_argument("--itl", type=float, required=True, help="inter-token latency target in seconds")
    live.add_argument("--output-tokens", type=int, default=256, help="mean output tokens assumed for decode sizing")
    live.add_argument("--cluster", default=None, help="cluster config JSON (model, accelerator, tiers)")
    live.add_argument("--calibration", default=None, help="prefill calibration table (kvtier bench prefill)")
    live.add_argument("--interval", type=float, default=15.0, help="seconds between decisions")
    live.add_argument("--startup", type=float, default=60.0, help="seconds a new worker takes to serve")
    live.add_argument("--prefill-workers", type=int, default=1, help="workers running now")
    live.add_argument("--decode-workers", type=int, default=1)
    live.add_argument("--status-file", default=None, help="write the last decision here as JSON (kvtier top reads it)")
    live.add_argument("--json", action="store_true", help="one JSON line per decision")
    live.add_argument("--iterations", type=int, default=0, help="stop after N decisions (0: run until interrupted)")
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
        print(json.dumps({
            "model": plan.model,
            "bytes_per_token": plan.bytes_per_token,
            "session_bytes": plan.session_bytes,
            "units": "bytes (decimal: 1 TB = 1e12)",
            "formula": "users x sessions x context_tokens x bytes_per_token x (1 + overhead) x replication",
            "rows": [row._asdict() for row in plan.rows],
        }))
    else:
        print(render_plan(plan, inputs))
    return 0


def run_workers(args) -> int:
    from kvtier.planner.capacity import human_bytes
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.models import load_model
    from kvtier.planner.workers import SLATargets, Workload, plan_workers, shared_tier_bytes_for_retention
    from kvtier.sim.cluster import load_cluster

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
        workload = Workload.from_arrivals([r.arrival_s for r in trace.requests],
                                          [r.input_tokens for r in trace.requests],
                                          [r.output_tokens for r in trace.requests], hit_rate)
        # The shared tier: the smallest capacity on the LRU curve that reaches the assumed hit rate.
        for point in hit_rate_curve(trace):
            if point.token_hit_rate >= min(hit_rate, unbounded.token_hit_rate) * 0.999:
                tiers["shared_bytes"] = point.capacity_blocks * block_bytes
                break
        hit_source = "given" if args.hit_rate is not None else "replay of the trace, unbounded LRU (token hits)"
    else:
        if None in (args.rate, args.input_tokens, args.output_tokens, args.hit_rate):
            print("kvtier plan workers: without --trace give --rate, --input-tokens, --output-tokens and --hit-rate",
                  file=sys.stderr)
            return 2
        workload = Workload(args.rate, (args.input_tokens,), (args.output_tokens,), args.hit_rate)
        tiers["shared_bytes"] = shared_tier_bytes_for_retention(args.rate, args.retention_s, args.input_tokens,
                                                                args.hit_rate, model.bytes_per_token)
        hit_source = "given"
    decode_kv_tokens = int(cluster.decode_kv_bytes // model.bytes_per_token)
    plan = plan_workers(workload, targets, costs.prefill, costs.decode, load_bw, decode_kv_tokens)
    tiers["hbm_cache_bytes_per_prefill_worker"] = cluster.hbm_cache_bytes
    verified = None
    if args.verify and args.trace:
        verified = _verify_by_simulation(trace, cluster, plan, targets, args.calibration)
    out = {"model": model.name, "accelerator": cluster.accelerator, "devices_per_worker": cluster.devices_per_worker,
           "cost_model": costs.provenance, "hit_rate_assumed": plan.hit_rate, "hit_rate_source": hit_source,
           "arrival_rate_per_s": workload.arrival_rate_per_s, **plan._asdict(), "tiers": tiers,
           "simulated": verified}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{model.name} on {cluster.devices_per_worker}x{cluster.accelerator} per worker; {costs.provenance}")
    print(f"workload: {workload.arrival_rate_per_s:.2f} req/s (arrival SCV {workload.arrival_scv:.2f}),"
          f" hit rate assumed {plan.hit_rate:.1%} ({hit_source})")
    print(f"prefill workers: {plan.prefill_workers} (utilization {plan.prefill_utilization:.0%},"
          f" predicted p{args.ttft_percentile:g} TTFT {plan.predicted_ttft_s:.2f} s <= {args.ttft} s)")
    print(f"decode workers:  {plan.decode_workers} (batch ~{plan.decode_batch},"
          f" predicted ITL {plan.predicted_itl_s * 1000:.1f} ms <= {args.itl * 1000:g} ms)")
    for name, size in tiers.items():
        print(f"{name}: {human_bytes(size)}")
    if verified:
        print(f"simulated with tier-aware routing and {verified['prefill_workers']} prefill workers:"
              f" p{args.ttft_percentile:g} TTFT {verified['ttft_s']:.2f} s,"
              f" ITL p50 {verified['itl_p50_s'] * 1000:.1f} ms, hit rate {verified['hit_rate']:.1%}")
    return 0


def _verify_by_simulation(trace, cluster, plan, targets, calibration) -> dict:
    """Simulate the plan with tier-aware routing; add prefill workers until the simulated
    TTFT percentile meets the target too (the queueing formula is an approximation)."""
    import numpy as np

    from kvtier.sim import run_simulation

    workers = plan.prefill_workers
    for _ in range(32):
        run = run_simulation(trace, cluster.replace(prefill_workers=workers, decode_workers=plan.decode_workers),
                             ["tier_aware"], calibration)
        ttft = float(np.percentile([o.ttft_s for o in run.results["tier_aware"].outcomes],
                                   targets.ttft_percentile * 100))
        if ttft <= targets.ttft_s:
            break
        workers += 1
    report = run.reports["tier_aware"]
    return {"prefill_workers": workers, "ttft_s": ttft, "meets_target": ttft <= targets.ttft_s,
            "itl_p50_s": report.itl_p50_s, "hit_rate": report.hit_rate}


def run_live(args) -> int:
    """Poll the router's counters, decide through the planner, act through the dry-run launcher."""
    import os
    import time

    from kvtier.cli.top import scrape
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.launchers import DryRunLauncher, apply
    from kvtier.planner.live import FleetSizer, LivePlanner, PlannerSettings
    from kvtier.planner.models import load_model
    from kvtier.planner.observe import RouterCounters, observation_between
    from kvtier.planner.workers import SLATargets
    from kvtier.sim.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, args.calibration or cluster.calibration)
    pod = [t for t in cluster.tiers if t.scope == "pod"]
    load_bw = min(t.read_bytes_per_s for t in (pod or cluster.tiers)) if cluster.tiers else 1e18
    sizer = FleetSizer(SLATargets(args.ttft, args.itl, args.ttft_percentile / 100.0), costs.prefill, costs.decode,
                       load_bw, int(cluster.decode_kv_bytes // model.bytes_per_token))
    settings = PlannerSettings(interval_s=args.interval, startup_s=args.startup)
    planner = LivePlanner(sizer, settings, args.prefill_workers, args.decode_workers)
    launcher = DryRunLauncher(json_lines=args.json)
    launcher.seed("prefill", args.prefill_workers)
    launcher.seed("decode", args.decode_workers)
    before = None
    decisions = 0
    try:
        while not args.iterations or decisions < args.iterations:
            samples = scrape(args.router)
            if not samples.up:
                print(f"kvtier plan live: router metrics unreachable ({samples.error}); holding", file=sys.stderr)
            else:
                now = RouterCounters.from_samples(time.monotonic(), samples)
                obs = observation_between(before, now, args.output_tokens) if before else None
                before = now
                if obs is not None:
                    decision = planner.decide(obs)
                    launcher.report(decision)
                    apply(decision, launcher)
                    decisions += 1
                    if args.status_file:
                        tmp = args.status_file + ".tmp"
                        with open(tmp, "w") as fh:
                            json.dump(decision.to_json(), fh)
                        os.replace(tmp, args.status_file)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0
