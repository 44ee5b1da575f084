"""Fleet scale: a day's load on a prefill pool that the live planner resizes.

Two passes, because a cache replay does not need hundreds of workers and hundreds of
workers do not need a cache replay:

1. **Service times.** :class:`~kvtier.sim.simulator.ClusterSimulator` replays the trace
   once with tier-aware routing (tiers as configured: the context tier on; or with every
   tier below HBM removed: off). It gives each request its prefill service seconds (the
   cheapest load-or-recompute plan where its prefix blocks were) and the prompt tokens it
   reused.
2. **The day.** The trace is replicated ``copies`` times (copy ``k`` circularly shifted by
   ``k/copies`` of the trace's span, so that copies interleave instead of coinciding; each
   copy stands for another population of users with the same behaviour) and its arrival
   times are warped onto a :class:`DiurnalProfile`: an arrival at a fraction ``u`` of the
   span lands at the time ``t`` where the profile's cumulative rate reaches ``u`` of its
   total. Every request is kept (no thinning), its order within its copy too. The pool is
   a central FIFO (the router's least-loaded dispatch at its best) over ``c`` workers,
   the Kiefer–Wolfowitz recursion on a heap of free times: O(log c) a request, so a day
   at hundreds of workers takes seconds.

Every ``interval_s`` the planner (:class:`~kvtier.planner.live.LivePlanner`, the code of
``kvtier plan live``) observes the last interval's arrival rate, prompt mix, hit rate and
arrival burstiness, and resizes the pool: a new worker serves from ``startup_s`` after the
decision and is paid from the decision; a worker removed is the one free soonest, and it
finishes what it was given first (drain), paid until then.

Approximations, stated: the hit rate per request is the one of pass 1 (at the trace's own
scale); the planner's queue model loads every hit at one rate, the one at which pass 1's
reused KV arrived (HBM hits free, the rest at their tier's); decode is sized by the same
model but not simulated at fleet scale (ITL is not in the attainment); the TTFT is
queueing + prefill service (no network).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtier.errors import ConfigError
from kvtier.planner.live import Decision, FleetSizer, LivePlanner, Observation, PlannerSettings
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace

DAY_S = 86400.0
#: planner intervals a simulated day may hold (an interval of >= 0.864 s): each is a planner
#: decision and a bin of the peak-rate histogram, so the run's time and memory follow the count
MAX_INTERVALS = 100_000
#: requests a simulated day may hold (``--scale`` copies x the trace's requests; the default,
#: 100 copies of the published trace, is 1.2 M): the pool replay keeps ~140 bytes a request
#: (its arrays and its loop's lists) and takes ~20 s a million, so a day at the cap needs
#: ~1.5 GB and minutes; past some multiple of it, memory runs out before the run ends
MAX_DAY_REQUESTS = 10_000_000


@dataclass(frozen=True, slots=True)
class DiurnalProfile:
    """``rate(t) = mean × (1 − a·cos(2πt/T))`` over one period ``T``: the trough at ``t = 0``
    (night), the peak at ``T/2`` (midday), ``a = (r − 1)/(r + 1)`` for a peak/trough ratio ``r``."""

    peak_to_trough: float
    period_s: float

    def __post_init__(self) -> None:
        if not self.peak_to_trough >= 1 or not math.isfinite(self.peak_to_trough):
            raise ConfigError(f"--diurnal is the peak/trough rate ratio, >= 1 (3 for a 3x day), got {self.peak_to_trough}")
        if self.period_s <= 0:
            raise ConfigError("the day's period must be positive seconds")

    @property
    def amplitude(self) -> float:
        return (self.peak_to_trough - 1) / (self.peak_to_trough + 1)

    def factor(self, t: np.ndarray | float) -> np.ndarray | float:
        return 1 - self.amplitude * np.cos(2 * np.pi * np.asarray(t) / self.period_s)

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        """∫₀ᵗ factor, in seconds of mean rate."""
        w = 2 * np.pi / self.period_s
        return t - self.amplitude * np.sin(w * t) / w

    def warp(self, fractions: np.ndarray) -> np.ndarray:
        """Times at which the cumulative profile reaches ``fractions`` of its total (monotone)."""
        grid = np.linspace(0.0, self.period_s, 200_001)
        return np.interp(np.asarray(fractions) * self.period_s, self.cumulative(grid), grid)

    def describe(self) -> dict:
        return {"shape": "sinusoid", "formula": "rate(t) = mean x (1 - a cos(2 pi t / T))",
                "a": round(self.amplitude, 6), "peak_to_trough": self.peak_to_trough,
                "period_s": self.period_s, "trough_at_s": 0.0, "peak_at_s": self.period_s / 2}


class ServicePass(NamedTuple):
    """Per trace request (trace order): prefill service seconds, prompt tokens reused and the
    seconds spent loading them (0 for blocks already in the worker's HBM)."""

    service_s: np.ndarray
    reused_tokens: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    load_s: np.ndarray

    @property
    def hit_rate(self) -> float:
        return float(self.reused_tokens.sum() / max(self.input_tokens.sum(), 1))

    def load_bytes_per_s(self, bytes_per_token: int) -> float:
        """The rate at which the replay's reused KV arrived, HBM hits included at no cost: the
        queue model, which loads every hit at one rate, then spends on a hit rate the seconds
        the replay spent loading (each tier's hits at that tier's bandwidth and latency).
        Infinite when nothing was loaded from below HBM (no tier, or only HBM hits)."""
        load_s = float(self.load_s.sum())
        return float(self.reused_tokens.sum()) * bytes_per_token / load_s if load_s > 0 else math.inf


class _RecordingSimulator(ClusterSimulator):
    """The cluster simulator, keeping each request's plan (its outcomes do not name the request)."""

    def run(self, trace: Trace):
        self._by_request: dict[int, tuple[float, int, float]] = {}
        return super().run(trace)

    def _finish(self, worker, request, start, plan, outcomes, jobs, events) -> None:
        reused = min(plan.reused_blocks * self.cluster.block_tokens, request.input_tokens - 1)
        self._by_request[id(request)] = (plan.seconds, reused, plan.load_s)
        super()._finish(worker, request, start, plan, outcomes, jobs, events)


def service_pass(trace: Trace, cluster, model, prefill, decode, policy) -> ServicePass:
    sim = _RecordingSimulator(cluster, model, prefill, decode, policy)
    sim.run(trace)
    seconds, reused, load = zip(*(sim._by_request[id(r)] for r in trace.requests))
    return ServicePass(np.array(seconds), np.array(reused, dtype=np.int64),
                       np.array([r.input_tokens for r in trace.requests], dtype=np.int64),
                       np.array([r.output_tokens for r in trace.requests], dtype=np.int64),
                       np.array(load))


class DayLoad(NamedTuple):
    arrivals_s: np.ndarray      # sorted
    source: np.ndarray          # index of the trace request each arrival replays


def check_day_size(copies: int, requests: int) -> None:
    """Refuse a day of more than :data:`MAX_DAY_REQUESTS` requests before anything is built."""
    if copies < 1:
        raise ConfigError(f"--scale is a number of trace copies >= 1, got {copies}")
    if copies * requests > MAX_DAY_REQUESTS:
        raise ConfigError(f"--scale {copies:,} copies x {requests:,} requests = {copies * requests:,} requests in"
                          f" the day, over the {MAX_DAY_REQUESTS:,} a simulated day may hold; lower --scale (at"
                          f" most {max(MAX_DAY_REQUESTS // max(requests, 1), 1):,} for this trace) or --limit")


def check_time_spread(trace: Trace) -> None:
    """Refuse a trace whose requests all arrive at one instant (or one request): its span is the
    day's length, and a day of no length has no shape to follow."""
    if len(trace.requests) < 2 or trace.duration_s <= 0:
        held = ("a single request" if len(trace.requests) < 2
                else f"{len(trace.requests):,} requests that all arrive at one instant")
        raise ConfigError(f"the trace needs requests spread over time to shape a day; this one holds {held}"
                          " (--planner needs a trace with arrival times)")


def day_load(trace: Trace, copies: int, profile: DiurnalProfile) -> DayLoad:
    check_day_size(copies, len(trace.requests))
    check_time_spread(trace)
    times = np.array([r.arrival_s for r in trace.requests])
    span = times[-1] - times[0]
    base = (times - times[0]) / span  # fraction of the span, in [0, 1]
    # copies x requests in one array (row k: copy k, shifted by k/copies), no list of copies
    fractions = ((base[None, :] + (np.arange(copies) / copies)[:, None]) % 1.0).ravel()
    source = np.tile(np.arange(len(times)), copies)
    order = np.argsort(fractions, kind="stable")
    return DayLoad(profile.warp(fractions[order]), source[order])


class PoolRun(NamedTuple):
    ttft_s: np.ndarray
    prefill_worker_s: float
    decode_worker_s: float
    end_s: float
    decisions: list[Decision]
    peak_prefill: int
    peak_decode: int

    def attainment(self, ttft_target_s: float) -> float:
        return float(np.mean(self.ttft_s <= ttft_target_s)) if len(self.ttft_s) else 1.0

    def queueing_misses(self, service_s: np.ndarray, ttft_target_s: float) -> float:
        """Share of requests that missed the target only for waiting (their prefill alone fits)."""
        return float(np.mean((self.ttft_s > ttft_target_s) & (service_s <= ttft_target_s))) if len(service_s) else 0.0


class _Windows(NamedTuple):
    """What the metrics would say over each planner interval, precomputed with numpy."""

    ends: np.ndarray
    starts_idx: np.ndarray
    ends_idx: np.ndarray


def _observation(day: DayLoad, svc: ServicePass, lo: int, hi: int, end_s: float, interval_s: float) -> Observation:
    src = day.source[lo:hi]
    count = hi - lo
    if count == 0:
        return Observation(end_s, 0.0, (), (), 0.0)
    inputs = svc.input_tokens[src]
    hit = float(svc.reused_tokens[src].sum() / max(inputs.sum(), 1))
    gaps = np.diff(day.arrivals_s[lo:hi])
    scv = float(gaps.var() / gaps.mean() ** 2) if len(gaps) >= 2 and gaps.mean() > 0 else 1.0
    return Observation(end_s, count / interval_s, tuple(inputs.tolist()), tuple(svc.output_tokens[src].tolist()),
                       hit, scv)


def run_pool(day: DayLoad, svc: ServicePass, duration_s: float, settings: PlannerSettings,
             planner: LivePlanner | None = None, static: tuple[int, int] | None = None) -> PoolRun:
    """One day on one pool: ``static`` (prefill, decode) workers all day, or ``planner``-driven."""
    if (planner is None) == (static is None):
        raise ValueError("give a planner or a static fleet, not both")
    service = svc.service_s[day.source]
    arrivals = day.arrivals_s
    n = len(arrivals)
    ttft = np.empty(n)
    if static is not None:
        prefill, decode = static
        provisioned_sum, stopped_sum = 0.0, 0.0
        free = [0.0] * prefill
    else:
        prefill, decode = planner.prefill.count, planner.decode.count
        free = [0.0] * prefill
        provisioned_sum, stopped_sum = 0.0, 0.0
    heapq.heapify(free)
    alive = prefill
    peak_p, peak_d = prefill, decode
    decode_s, decode_since = 0.0, 0.0
    decisions: list[Decision] = []
    interval = settings.interval_s
    next_t = interval if planner is not None else math.inf
    window_lo = 0
    i = 0
    pop, replace, push = heapq.heappop, heapq.heapreplace, heapq.heappush
    arr = arrivals.tolist()
    serv = service.tolist()
    while i < n:
        a = arr[i]
        if a >= next_t:
            hi = int(np.searchsorted(arrivals, next_t, side="left"))
            decision = planner.decide(_observation(day, svc, window_lo, hi, next_t, interval))
            decisions.append(decision)
            window_lo = hi
            target = decision.prefill.target
            if target > alive:
                ready = next_t + settings.startup_s
                for _ in range(target - alive):
                    push(free, ready)
                provisioned_sum += (target - alive) * next_t
            elif target < alive:
                for _ in range(alive - target):
                    stopped_sum += max(next_t, pop(free))  # drains what it was given
            alive = target
            peak_p = max(peak_p, alive)
            new_decode = decision.decode.target
            if new_decode != decode:  # decode pools pay from the decision too (start-up and drain ignored)
                decode_s += decode * (next_t - decode_since)
                decode, decode_since = new_decode, next_t
                peak_d = max(peak_d, decode)
            next_t += interval
            continue
        start = free[0]
        if start < a:
            start = a
        finish = start + serv[i]
        replace(free, finish)
        ttft[i] = finish - a
        i += 1
    end = max(duration_s, max(free) if free else 0.0)
    if static is not None:
        prefill_s = prefill * end
        decode_s = decode * end
    else:
        stopped_sum += end * alive
        prefill_s = stopped_sum - provisioned_sum
        decode_s += decode * (end - decode_since)
    return PoolRun(ttft, prefill_s, decode_s, end, decisions, peak_p, peak_d)


def peak_rate(day: DayLoad, interval_s: float, duration_s: float) -> tuple[float, int, int]:
    """The highest arrival rate over any planner interval of the day, and that window's bounds."""
    edges = np.arange(0.0, duration_s + interval_s, interval_s)
    counts = np.histogram(day.arrivals_s, edges)[0]
    k = int(counts.argmax())
    lo, hi = np.searchsorted(day.arrivals_s, [edges[k], edges[k + 1]])
    return counts[k] / interval_s, int(lo), int(hi)


def static_fleet(day: DayLoad, svc: ServicePass, sizer: FleetSizer, settings: PlannerSettings,
                 duration_s: float) -> tuple[int, int, float]:
    """A fleet sized for the peak: the same queue model at the peak interval's rate and mix,
    with the planner's headroom, so that the two differ only in following the load."""
    rate, lo, hi = peak_rate(day, settings.interval_s, duration_s)
    obs = _observation(day, svc, lo, hi, 0.0, settings.interval_s)
    need = sizer.size(rate * (1 + settings.headroom), obs.input_tokens, obs.output_tokens, obs.hit_rate,
                      obs.arrival_scv)
    return max(need.prefill_workers, 1), max(need.decode_workers, 1), rate


def fleet_sizer(cluster, model, costs, targets, svc: ServicePass) -> FleetSizer:
    """The planner's queue model for this cluster, its hits loaded as its replay loaded them.

    Tier on and tier off are sized by this one rule, so that they compare like for like:
    HBM hits cost no load in either, and only hits from the tiers below are charged (at the
    rate the replay read them). Pricing every hit at the pod link, as ``kvtier plan workers``
    does with no replay to say where its hits sit, charged the tier-on fleet for the HBM hits
    the tier-off fleet got free: on a trace of HBM hits only, 14 workers against 12 for the
    same service."""
    return FleetSizer(targets, costs.prefill, costs.decode, svc.load_bytes_per_s(model.bytes_per_token),
                      int(cluster.decode_kv_bytes // model.bytes_per_token))


def simulate_planned_day(trace: Trace, cluster, targets, *, peak_to_trough: float = 3.0, copies: int = 100,
                         settings: PlannerSettings | None = None, calibration: str | None = None) -> dict:
    """Static vs planned, context tier on vs off: the figures of ``kvtier simulate --planner``.

    ``settings`` are in seconds of a real day (default: decide every 6 min, a worker serves
    8 min after it is started, 24 min of cooldown before a scale-down); they are compressed
    with the day into the trace's span, as the arrivals are."""
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.models import load_model
    from kvtier.sim.policies import make_policy

    day_settings = settings or PlannerSettings(interval_s=360.0, startup_s=480.0, down_cooldown_s=1440.0)
    if DAY_S / day_settings.interval_s > MAX_INTERVALS:
        # Each interval is a planner decision and a histogram bin: 1e-7 s asked numpy for TiBs.
        raise ConfigError(f"--interval must be >= {DAY_S / MAX_INTERVALS:g} s of the day (at most "
                          f"{MAX_INTERVALS:,} planner decisions a day), got {day_settings.interval_s:g}")
    check_day_size(copies, len(trace.requests))   # before the service passes, which take a while
    check_time_spread(trace)   # before the profile, whose period is the trace's span
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, calibration or cluster.calibration)
    duration = trace.duration_s
    profile = DiurnalProfile(peak_to_trough, duration)
    squeeze = duration / DAY_S
    settings = dataclasses.replace(day_settings, interval_s=day_settings.interval_s * squeeze,
                                   startup_s=day_settings.startup_s * squeeze,
                                   down_cooldown_s=day_settings.down_cooldown_s * squeeze,
                                   up_cooldown_s=day_settings.up_cooldown_s * squeeze)
    day = day_load(trace, copies, profile)
    out: dict = {
        "day": {**profile.describe(),
                "timeline": f"the trace's {duration / 3600:.2f} h span is one day: 1 s here is"
                            f" {86400 / duration:.1f} s of a day; worker-hours are in this timeline's hours",
                "realised_by": f"{copies} copies of the trace (copy k shifted circularly by k/{copies} of its span,"
                               " other users with the same behaviour and the service times of the original's replay),"
                               " arrival times warped onto the profile's cumulative"
                               " rate; no request thinned or dropped",
                "requests": int(len(day.arrivals_s)),
                "mean_rate_per_s": round(len(day.arrivals_s) / duration, 3)},
        "targets": {"ttft_s": targets.ttft_s, "ttft_percentile": targets.ttft_percentile, "itl_s": targets.itl_s},
        "planner": {"in_day_seconds": {f: getattr(day_settings, f) for f in day_settings.__slots__},
                    "in_timeline_seconds": {f: round(getattr(settings, f), 3) for f in
                                            ("interval_s", "startup_s", "down_cooldown_s", "up_cooldown_s")}},
        "cost_model": costs.provenance,
    }
    runs = {}
    for label, tiered in (("with_tier", True), ("without_tier", False)):
        sim_cluster = cluster if tiered else cluster.replace(tiers=())
        svc = service_pass(trace, sim_cluster, model, costs.prefill, costs.decode, make_policy("tier_aware"))
        service = svc.service_s[day.source]
        sizer = fleet_sizer(sim_cluster, model, costs, targets, svc)
        static_p, static_d, peak = static_fleet(day, svc, sizer, settings, duration)
        static = run_pool(day, svc, duration, settings, static=(static_p, static_d))
        planner = LivePlanner(sizer, settings, prefill_workers=static_p, decode_workers=static_d)
        planned = run_pool(day, svc, duration, settings, planner=planner)
        runs[label] = (static, planned)
        ups = sum(d.prefill.action == "scale_up" for d in planned.decisions)
        downs = sum(d.prefill.action == "scale_down" for d in planned.decisions)
        out[label] = {
            "hit_rate": round(svc.hit_rate, 4), "mean_prefill_service_s": round(float(svc.service_s.mean()), 4),
            "peak_rate_per_s": round(peak, 2),
            "static": {"prefill_workers": static_p, "decode_workers": static_d,
                       "prefill_worker_hours": _hours(static.prefill_worker_s),
                       "decode_worker_hours": _hours(static.decode_worker_s),
                       "sla_attainment": round(static.attainment(targets.ttft_s), 5),
                       "misses_from_queueing": round(static.queueing_misses(service, targets.ttft_s), 5),
                       "ttft_p90_s": round(float(np.percentile(static.ttft_s, 90)), 3)},
            "planned": {"peak_prefill_workers": planned.peak_prefill,
                        "min_prefill_workers": min((d.prefill.target for d in planned.decisions), default=static_p),
                        "peak_decode_workers": planned.peak_decode,
                        "prefill_worker_hours": _hours(planned.prefill_worker_s),
                        "decode_worker_hours": _hours(planned.decode_worker_s),
                        "sla_attainment": round(planned.attainment(targets.ttft_s), 5),
                        "misses_from_queueing": round(planned.queueing_misses(service, targets.ttft_s), 5),
                        "ttft_p90_s": round(float(np.percentile(planned.ttft_s, 90)), 3),
                        "decisions": len(planned.decisions), "prefill_scale_ups": ups, "prefill_scale_downs": downs},
        }
    static, planned = runs["with_tier"]
    static_s = static.prefill_worker_s + static.decode_worker_s
    planned_s = planned.prefill_worker_s + planned.decode_worker_s
    out.update({
        "static_worker_hours": _hours(static_s),
        "planned_worker_hours": _hours(planned_s),
        "sla_attainment_static": round(static.attainment(targets.ttft_s), 5),
        "sla_attainment_planned": round(planned.attainment(targets.ttft_s), 5),
        "prefill_worker_hours_with_tier": _hours(planned.prefill_worker_s),
        "prefill_worker_hours_without_tier": _hours(runs["without_tier"][1].prefill_worker_s),
        "sla": f"share of requests with TTFT (queue + prefill) <= {targets.ttft_s:g} s; requests whose prefill"
               " alone is longer miss in every fleet (misses_from_queueing: those that missed for waiting)",
    })
    # of the run's worker-seconds, not of the hours rounded for the JSON: a trace of minutes has
    # worker-hours of hundredths, and their ratio at 0.01 h was 0.7 for a run's 0.7298. (The
    # static fleet holds a worker over the trace's span, which check_time_spread made nonzero.)
    out["planned_over_static"] = round(planned_s / static_s, 4)
    return out


def _hours(worker_s: float) -> float:
    """Worker-seconds as the JSON's worker-hours: to 0.01 h, or 4 significant figures where that
    is finer. Worker-hours are in the timeline's hours, so a trace of minutes has hundredths."""
    hours = worker_s / 3600
    if hours <= 0:
        return 0.0
    return round(hours, max(2, 3 - math.floor(math.log10(hours))))
