"""``kvtier simulate``: replay a request trace on a simulated cluster under every routing policy."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvtier.cli.plan import ttft_percentile
from kvtier.core.units import finite_float


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(subparsers) -> None:
    parser = subparsers.add_parser("simulate", help="trace-driven cluster simulation: TTFT, hit rate per tier")
    parser.add_argument("--trace", default=None,
                        help="Mooncake-format JSONL trace (default: ../shared/data/traces/conversation_trace.jsonl)")
    parser.add_argument("--cluster", default=None, help="cluster config JSON (default: the one shipped with kvtier)")
    parser.add_argument("--calibration", default=None, help="prefill calibration table (kvtier bench prefill)")
    parser.add_argument("--policies", type=_names, default=None,
                        help="without --planner: comma-separated routing policies: round_robin, least_loaded,"
                             " prefix_overlap, tier_aware (default: all)")
    parser.add_argument("--prefill-workers", type=int, default=None, help="override the cluster's prefill workers")
    parser.add_argument("--decode-workers", type=int, default=None, help="override the cluster's decode workers")
    parser.add_argument("--limit", type=int, default=None, help="simulate only the first N requests")
    parser.add_argument("--plot", default=None, metavar="DIR", help="without --planner: write PNG plots to DIR")
    parser.add_argument("--json", action="store_true")
    planner = parser.add_argument_group("live planner over a day (--planner)")
    planner.add_argument("--planner", action="store_true",
                         help="replay the trace as one day on a planner-driven prefill pool: worker-hours and SLA"
                              " attainment, static vs planned, context tier on vs off")
    planner.add_argument("--diurnal", type=finite_float, default=3.0, metavar="K",
                         help="peak/trough arrival-rate ratio")
    planner.add_argument("--scale", type=int, default=100, metavar="COPIES",
                         help="copies of the trace's users (sets the fleet size: 100 gives hundreds of workers);"
                              " copies x trace requests may not exceed the requests a simulated day holds")
    planner.add_argument("--ttft", type=finite_float, default=2.0, help="TTFT target in seconds (SLA)")
    planner.add_argument("--ttft-percentile", type=ttft_percentile, default=90.0,
                         help="percentile the planner sizes for, in percent (default 90: p90)")
    planner.add_argument("--itl", type=finite_float, default=0.05, help="inter-token latency target in seconds")
    planner.add_argument("--interval", type=finite_float, default=360.0,
                         help="planner interval in seconds of the day (compressed with it into the trace's span)")
    planner.add_argument("--startup", type=finite_float, default=480.0,
                         help="seconds of the day from starting a worker to its first request")
    planner.add_argument("--cooldown", type=finite_float, default=1440.0,
                         help="seconds of the day after any change before a scale-down")
    parser.set_defaults(func=run)


def run(args) -> int:
    from kvtier.errors import ConfigError
    from kvtier.sim import run_simulation
    from kvtier.sim.cluster import load_cluster
    from kvtier.sim.trace import TRACE_HINT, default_trace_path, load_trace

    started = time.perf_counter()
    ignored = _not_for_the_planner(args)
    if ignored:
        print(f"kvtier simulate: {' and '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} for the run without"
              " --planner: the planner's day is routed tier_aware and draws no plot", file=sys.stderr)
        return 2
    # Checked before the simulation runs, not after it has: the run may be long.
    if args.plot and Path(args.plot).exists() and not Path(args.plot).is_dir():
        print(f"kvtier simulate: --plot DIR: {args.plot} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        cluster = load_cluster(args.cluster)
    except ConfigError as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("prefill_workers", args.prefill_workers),
                                   ("decode_workers", args.decode_workers)) if v is not None}
    cluster = cluster.replace(**overrides) if overrides else cluster
    trace_path = args.trace or default_trace_path()
    if trace_path is None:
        print(f"kvtier simulate: no --trace given and no default trace found; {TRACE_HINT}", file=sys.stderr)
        return 2
    try:
        trace = load_trace(trace_path, cluster.block_tokens)
    except ConfigError as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    if args.limit is not None:
        if args.limit <= 0:   # [:0] would simulate nothing, [:-5] all but the last five
            print(f"kvtier simulate: --limit must be a positive number of requests, got {args.limit}",
                  file=sys.stderr)
            return 2
        trace = trace.head(args.limit)
    if args.planner:
        return _run_planner(args, trace, cluster, started)
    from kvtier.sim.policies import POLICIES

    try:
        sim = run_simulation(trace, cluster, args.policies or list(POLICIES), args.calibration)
    except ConfigError as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    try:
        plots = _plot(args.plot, sim, trace, cluster) if args.plot else []
    except OSError as exc:   # made unwritable, or a file, since the check above
        print(f"kvtier simulate: --plot DIR: cannot write plots to {args.plot} ({exc})", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({
            "trace": {"path": str(trace_path), "requests": len(trace.requests), "duration_s": trace.duration_s},
            "cluster": {"model": cluster.model, "accelerator": cluster.accelerator,
                        "devices_per_worker": cluster.devices_per_worker, "prefill_workers": cluster.prefill_workers,
                        "decode_workers": cluster.decode_workers, "tiers": list(cluster.tier_names)},
            "cost_model": sim.costs.provenance,
            "policies": {name: report.to_json() for name, report in sim.reports.items()},
            "plots": [str(p) for p in plots],
            "runtime_s": round(elapsed, 2),
        }))
        return 0
    print(f"{len(trace.requests):,} requests over {trace.duration_s / 60:.1f} min; {cluster.model} on "
          f"{cluster.prefill_workers} prefill + {cluster.decode_workers} decode workers of "
          f"{cluster.devices_per_worker}x{cluster.accelerator}; {sim.costs.provenance}")
    tiers = cluster.tier_names
    head = f"{'policy':<15}{'p50':>8}{'p90':>8}{'p99':>8}{'hit':>7} " + " ".join(f"{t[:10]:>10}" for t in tiers)
    print(head + f"{'saved s':>10}{'imbal':>7}")
    for name, r in sim.reports.items():
        print(f"{name:<15}{r.ttft_p50_s:>8.3f}{r.ttft_p90_s:>8.3f}{r.ttft_p99_s:>8.3f}{r.hit_rate:>7.1%} "
              + " ".join(f"{r.hit_rate_by_tier[t]:>10.1%}" for t in tiers)
              + f"{r.prefill_seconds_saved:>10.0f}{r.imbalance:>7.3f}")
    print("TTFT in seconds; hit = prompt blocks reused, split by the tier they came from; saved = prefill"
          " worker-seconds avoided net of loads; imbal = max/mean prefill busy time.")
    for path in plots:
        print(f"wrote {path}")
    print(f"simulated in {elapsed:.1f} s")
    return 0


def _not_for_the_planner(args) -> list[str]:
    """The flags given that ``--planner`` would take and ignore (it replays the day with its own
    tier-aware routing and writes no plot): refused, as a plot that never appears or a policy
    name never checked would pass for a run that used them."""
    if not args.planner:
        return []
    return [flag for flag, value in (("--plot", args.plot), ("--policies", args.policies)) if value is not None]


def _plot(directory: str, sim, trace, cluster) -> list[Path]:
    from kvtier.sim.cache import hit_rate_curve
    from kvtier.sim.plots import plot_hit_rate_curve, plot_ttft_cdf

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    block_bytes = sim.model.block_bytes(cluster.block_tokens)
    marks = {"HBM/worker": cluster.hbm_cache_bytes}
    marks.update({t.name: t.capacity_bytes for t in cluster.tiers if t.capacity_bytes})
    return [plot_ttft_cdf(sim.results, out / "ttft_cdf.png"),
            plot_hit_rate_curve(hit_rate_curve(trace), block_bytes, out / "hit_rate_vs_capacity.png", marks)]


def _run_planner(args, trace, cluster, started: float) -> int:
    from kvtier.errors import ConfigError
    from kvtier.planner.live import PlannerSettings
    from kvtier.planner.workers import SLATargets
    from kvtier.sim.fleet import simulate_planned_day

    try:
        targets = SLATargets(args.ttft, args.itl, args.ttft_percentile / 100.0)
        settings = PlannerSettings(interval_s=args.interval, startup_s=args.startup, down_cooldown_s=args.cooldown)
        out = simulate_planned_day(trace, cluster, targets, peak_to_trough=args.diurnal, copies=args.scale,
                                   settings=settings, calibration=args.calibration)
    except ConfigError as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    out["trace"] = {"path": str(trace.source), "requests": len(trace.requests), "duration_s": trace.duration_s}
    out["runtime_s"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(out))
        return 0
    day = out["day"]
    print(f"one day = the trace's span; {day['formula']} (a = {day['a']}, peak/trough {day['peak_to_trough']:g});"
          f" {day['requests']:,} requests ({day['realised_by']})")
    print(f"{day['timeline']}; {out['cost_model']}")
    print(f"{'':<14}{'fleet':<9}{'prefill wh':>11}{'decode wh':>10}{'workers':>13}{'SLA':>9}{'queue miss':>11}")
    for label in ("with_tier", "without_tier"):
        row = out[label]
        st, pl = row["static"], row["planned"]
        print(f"{label:<14}{'static':<9}{st['prefill_worker_hours']:>11.1f}{st['decode_worker_hours']:>10.1f}"
              f"{st['prefill_workers']:>13}{st['sla_attainment']:>9.2%}{st['misses_from_queueing']:>11.2%}")
        span = f"{pl['min_prefill_workers']}-{pl['peak_prefill_workers']}"
        print(f"{'':<14}{'planned':<9}{pl['prefill_worker_hours']:>11.1f}{pl['decode_worker_hours']:>10.1f}"
              f"{span:>13}{pl['sla_attainment']:>9.2%}{pl['misses_from_queueing']:>11.2%}")
    print(f"planned/static worker-hours {out['planned_over_static']:.3f}; prefill worker-hours planned with the"
          f" context tier {out['prefill_worker_hours_with_tier']:.1f}, without {out['prefill_worker_hours_without_tier']:.1f}")
    print(f"SLA: {out['sla']}")
    print(f"simulated in {out['runtime_s']:.1f} s")
    return 0
