"""The live planner's decision core: measured load in, worker counts and their reasons out.

One code path for the running system (``kvtier plan live``) and the simulator
(``kvtier simulate --planner``): both hand :class:`LivePlanner` an :class:`Observation`
every interval and act on the :class:`Decision` it returns through a launcher.

- **Forecast.** The request rate is smoothed with Holt's linear method (level + trend)
  and projected over the horizon a new worker needs to become useful (its start-up plus
  one interval). The planner sizes for the larger of that projection and the last
  measurement: it must not lag a step up, and a smoothed level alone always does.
- **Size.** The same queue model as ``kvtier plan workers``
  (:func:`kvtier.planner.workers.plan_workers`): M/G/c prefill for the TTFT percentile,
  Little's law for decode, fed by the *measured* hit rate and prompt mix, so that a
  context tier that loads more of each prompt shortens the modelled prefill and needs
  fewer prefill workers. A headroom factor on the rate covers forecast error. An interval
  whose answers told no prompt lengths (streams without usage, through a router that does not
  count the lengths it priced) is sized on the mix of the intervals before it; with none
  measured yet, the pools hold (within their bounds). The hit rate is pooled over the
  intervals that measured it (cached tokens come only with usage), each weighing as the prompt
  tokens it is over; with none, nothing is taken as cached. The prompt mix is pooled with each
  interval weighing as its requests: an observation's sample may be capped (the router's
  intervals give at most 64 lengths), and a quiet interval's few long prompts must not weigh as
  much as a busy interval's whole sample.
- **Decide.** Scale up at once (a missed TTFT cannot be undone); scale down only when
  the count that would hold a rate higher by a band is still below the current count,
  for several intervals in a row, and not within a cooldown of the last change, by at
  most a fraction of the pool at a time. Two thresholds a band apart in *rate* (not in
  workers, where one worker is a large step for a small pool): noise in the measured rate
  narrower than the band therefore never makes the pool flap. The rate a scale-down is judged
  on leaves the trend out (the smoothed level or the measurement, whichever is higher), and the
  trend is projected at all only while it stands out of the rate's noise.

Policy only: no I/O, no clocks. Times are the caller's seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.json_files import json_safe  # (here too: the planner's status and decisions use it)
from kvtier.planner.costmodel import DecodeCostModel, PrefillCostModel
from kvtier.planner.workers import (MAX_WORKERS, SLATargets, Workload, decode_workers_for, prefill_service_times,
                                    prefill_workers_for, ttft_quantile)

#: prompt-length samples kept per observation: the queue model's cost is linear in them
MAX_SAMPLES = 512


@dataclass(frozen=True, slots=True)
class Observation:
    """What the metrics said over the last interval ending at ``at_s``."""

    at_s: float
    request_rate: float                 # requests/s that arrived in the interval
    input_tokens: tuple[int, ...]       # prompt lengths seen (a sample is enough)
    output_tokens: tuple[int, ...]
    hit_rate: float                     # share of prompt tokens loaded, not recomputed
    arrival_scv: float = 1.0            # squared coefficient of variation of the gaps
    hit_measured: bool = True           # False: no answer told cached tokens (hit_rate is no figure)
    requests: float | None = None       # requests the sample stands for (None: one per length in it)
    prompt_tokens: float | None = None  # prompt tokens hit_rate is over (None: the sample's sum)

    def __post_init__(self) -> None:
        if self.request_rate < 0 or not math.isfinite(self.request_rate):
            raise ConfigError(f"observed request rate must be a finite number >= 0, got {self.request_rate}")
        if not 0 <= self.hit_rate <= 1:
            raise ConfigError(f"observed hit rate is a fraction in [0, 1], got {self.hit_rate}")
        for name in ("requests", "prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"observed {name} must be a finite number >= 0, got {value}")

    @property
    def mix_weight(self) -> float:
        """The interval's weight in a pooled prompt mix: the requests its sample stands for."""
        return len(self.input_tokens) if self.requests is None else self.requests

    @property
    def hit_weight(self) -> float:
        """The interval's weight in a pooled hit rate: the prompt tokens its hit rate is over."""
        return sum(self.input_tokens) if self.prompt_tokens is None else self.prompt_tokens


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    interval_s: float = 15.0            # how often the planner observes and decides
    startup_s: float = 20.0             # from "start a worker" to its first request
    headroom: float = 0.10              # size for forecast × (1 + headroom)
    smoothing: float = 0.5              # Holt level weight (trend weight is half of it)
    scale_down_band: float = 0.10       # scale down only to what holds the rate × (1 + band) too
    scale_down_after: int = 2           # … for this many consecutive intervals
    mix_intervals: int = 4              # prompt mix and hit rate pooled over this many intervals
    down_cooldown_s: float = 60.0       # no scale-down within this long of any change
    up_cooldown_s: float = 0.0          # scale-ups may follow each other at once by default
    max_down_fraction: float = 0.25     # shed at most this share of a pool per decision
    min_workers: int = 1
    max_workers: int = MAX_WORKERS

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.startup_s < 0:
            raise ConfigError("planner interval must be > 0 s and start-up >= 0 s")
        if self.headroom < 0 or not 0 <= self.scale_down_band < 1 or not 0 < self.max_down_fraction <= 1:
            raise ConfigError("headroom >= 0, scale-down band in [0, 1), max down fraction in (0, 1]")
        if not 0 < self.smoothing <= 1 or self.scale_down_after < 1 or self.mix_intervals < 1:
            raise ConfigError("smoothing in (0, 1], scale_down_after >= 1, mix_intervals >= 1")
        if self.down_cooldown_s < 0 or self.up_cooldown_s < 0:
            raise ConfigError("cooldowns are seconds >= 0")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")


class RateForecaster:
    """Holt's linear smoothing of the request rate; forecasts never go below zero.

    The trend is projected only while one interval of it stands out of the rate's noise: more
    than :attr:`TREND_OVER_NOISE` of the smoothed second difference of the measured rates (a
    straight ramp's is zero, so a ramp does not count as noise). A trend made of noise,
    projected over a start-up of several intervals, turned ±4 % noise into swings of over
    10 % in the sizing rate, and the pool scaled up and then down again (audit s34 a5 D2).
    """

    #: an interval's trend below this share of the noise is taken as noise (under steady ±4 %
    #: noise the ratio stayed below it in 999 intervals of 1,000; the trend of a ramp of 8 % of
    #: its start an interval passed it in the ramp's second interval: test_s34_live_noise.py)
    TREND_OVER_NOISE = 0.5

    def __init__(self, smoothing: float) -> None:
        self.alpha = smoothing
        self.beta = smoothing / 2
        self.level: float | None = None
        self.trend = 0.0
        self.last_at: float | None = None
        self.step_s = 0.0                       # the last update's interval
        self.noise: float | None = None         # smoothed |second difference| of the rates
        self._rates: deque[float] = deque(maxlen=2)

    def update(self, at_s: float, rate: float) -> None:
        if self.level is None or self.last_at is None:
            self.level, self.last_at = rate, at_s
            self._rates.append(rate)
            return
        dt = at_s - self.last_at
        if dt <= 0:  # a repeated or out-of-order observation: refresh the level only
            self.level = self.alpha * rate + (1 - self.alpha) * self.level
            return
        self._track_noise(rate)
        predicted = self.level + self.trend * dt
        level = self.alpha * rate + (1 - self.alpha) * predicted
        self.trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        self.level, self.last_at, self.step_s = level, at_s, dt

    def _track_noise(self, rate: float) -> None:
        """Smooth ``|r - 2 r' + r''|`` over the last three rates as the trend is smoothed: a
        straight ramp leaves it at zero, noise of standard deviation σ at about 2 σ."""
        if len(self._rates) == 2:
            error = abs(rate - 2 * self._rates[1] + self._rates[0])
            self.noise = error if self.noise is None else self.beta * error + (1 - self.beta) * self.noise
        self._rates.append(rate)

    @property
    def trend_is_signal(self) -> bool:
        return self.noise is not None and abs(self.trend) * self.step_s > self.TREND_OVER_NOISE * self.noise

    def forecast(self, horizon_s: float) -> float:
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * horizon_s if self.trend_is_signal else self.level)


class FleetNeed(NamedTuple):
    prefill_workers: int
    decode_workers: int
    predicted_ttft_s: float
    mean_prefill_s: float
    note: str


class FleetSizer:
    """Worker counts for a rate, prompt mix and hit rate: ``plan_workers`` of ``kvtier plan
    workers``, each pool sized on its own. A pool whose target is out of reach (prompts too
    long for even an idle prefill worker to meet the TTFT; a single sequence stepping slower
    than the ITL) gets enough workers to keep up and a note that says so; the other pool is
    still sized for its own target."""

    def __init__(self, targets: SLATargets, prefill: PrefillCostModel, decode: DecodeCostModel,
                 load_bytes_per_s: float, decode_kv_tokens: int) -> None:
        self.targets = targets
        self.prefill = prefill
        self.decode = decode
        self.load_bytes_per_s = load_bytes_per_s
        self.decode_kv_tokens = decode_kv_tokens

    def size(self, rate: float, input_tokens: Sequence[int], output_tokens: Sequence[int], hit_rate: float,
             arrival_scv: float) -> FleetNeed:
        if rate <= 0 or not input_tokens:
            return FleetNeed(0, 0, 0.0, 0.0, "no requests")
        if not math.isfinite(rate):
            raise ConfigError(f"cannot size a fleet for a request rate of {rate}")
        inputs, outputs = _thin(input_tokens), _thin(output_tokens or (1,))
        workload = Workload(rate, inputs, outputs, min(hit_rate, 0.999), arrival_scv)
        service = prefill_service_times(workload, self.prefill, self.load_bytes_per_s)
        mean_prefill = float(service.mean())
        busy = rate * mean_prefill
        if busy > MAX_WORKERS / 2:  # the queue model's search would crawl to its bound: say so at once
            return FleetNeed(MAX_WORKERS, MAX_WORKERS, math.inf, mean_prefill,
                             f"{busy:.0f} workers busy on prefill alone: beyond what the planner sizes")
        notes = []
        try:
            prefill = prefill_workers_for(rate, service, arrival_scv, self.targets)
            ttft = ttft_quantile(prefill, rate, service, arrival_scv, self.targets.ttft_percentile)
        except ConfigError as exc:
            prefill, ttft = min(math.ceil(busy / 0.9), MAX_WORKERS), math.inf   # utilization <= 0.9
            notes.append(f"TTFT target unreachable ({exc}); prefill sized to keep up")
        decode, note = self._decode(rate, float(np.mean(inputs)), float(np.mean(outputs)))
        notes += [note] if note else []
        return FleetNeed(prefill, decode, ttft, mean_prefill, "; ".join(notes))

    def _decode(self, rate: float, mean_in: float, mean_out: float) -> tuple[int, str]:
        """Decode workers for the ITL target; else the fewest that keep up (a finite batch) in
        their KV memory; else the fewest that keep up at all. The note says which, and why."""
        first: ConfigError | None = None
        relaxed = ((self.targets.itl_s, self.decode_kv_tokens), (math.inf, self.decode_kv_tokens), (math.inf, math.inf))
        for i, (itl_s, kv_tokens) in enumerate(relaxed):
            try:
                workers = decode_workers_for(rate, mean_in, mean_out, self.decode, itl_s, kv_tokens)[0]
            except ConfigError as exc:
                first = first or exc
                continue
            return workers, "" if i == 0 else (f"ITL target unreachable ({first}); decode sized to keep up"
                                               + (" ignoring its KV memory" if i == 2 else ""))
        return MAX_WORKERS, f"ITL target unreachable ({first}); keeping up needs over {MAX_WORKERS} decode workers"


def _thin(samples: Sequence[int]) -> tuple[int, ...]:
    """At most :data:`MAX_SAMPLES` lengths with the same distribution: evenly spaced quantiles
    of the sorted samples (a strided pick would keep or miss the few long prompts that carry
    the service time's variance by chance, and the worker count would jump with it)."""
    if len(samples) <= MAX_SAMPLES:
        return tuple(int(s) for s in samples)
    ordered = np.sort(np.asarray(samples))
    picks = ((np.arange(MAX_SAMPLES) + 0.5) * len(ordered) / MAX_SAMPLES).astype(np.int64)
    return tuple(ordered[picks].tolist())


def _pooled_lengths(samples: Sequence[tuple[Sequence[int], float]]) -> tuple[int, ...]:
    """Several intervals' length samples as one mix, each interval weighing as the requests its
    sample stands for (``(sample, requests)`` pairs). Samples of one length per request are
    joined as they are; otherwise :data:`MAX_SAMPLES` evenly spaced quantiles of the weighted
    lengths (as :func:`_thin` picks them): joined, a quiet interval's 2 long prompts weighed
    2/66 against a busy one's 64 lengths sampled for 1,000 requests, not 2/1,002."""
    groups = [(sample, weight) for sample, weight in samples if len(sample) and weight > 0]
    if all(weight == len(sample) for sample, weight in groups):
        return tuple(n for sample, _ in groups for n in sample)
    lengths = np.concatenate([np.asarray(sample, dtype=np.int64) for sample, _ in groups])
    weights = np.concatenate([np.full(len(sample), weight / len(sample)) for sample, weight in groups])
    order = np.argsort(lengths, kind="stable")
    lengths, cumulative = lengths[order], np.cumsum(weights[order])
    picks = (np.arange(MAX_SAMPLES) + 0.5) * (cumulative[-1] / MAX_SAMPLES)
    at = np.minimum(np.searchsorted(cumulative, picks, side="right"), len(lengths) - 1)
    return tuple(lengths[at].tolist())


class PoolDecision(NamedTuple):
    pool: str               # "prefill" or "decode"
    current: int
    needed: int
    target: int
    action: str             # "scale_up", "scale_down" or "hold"
    reason: str


class Decision(NamedTuple):
    at_s: float
    forecast_rate: float
    sizing_rate: float      # the rate the pools were sized for (headroom included)
    hit_rate: float
    predicted_ttft_s: float
    prefill: PoolDecision
    decode: PoolDecision

    @property
    def changed(self) -> bool:
        return self.prefill.action != "hold" or self.decode.action != "hold"

    def to_json(self) -> dict:
        """Strict JSON values: a figure that is not finite (a TTFT out of reach, one not
        predicted) is ``null``."""
        out = {k: round(v, 6) if isinstance(v, float) else v
               for k, v in self._asdict().items() if k not in ("prefill", "decode")}
        out["prefill"] = self.prefill._asdict()
        out["decode"] = self.decode._asdict()
        return json_safe(out)


class _Pool:
    """One pool's hysteresis state: its count, when it last changed, how long the need stayed low."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self.last_change_s = -math.inf
        self.last_up_s = -math.inf
        self.low_intervals = 0

    def hold(self, now: float, settings: PlannerSettings, why: str) -> PoolDecision:
        """No need measured to size on: the count stays, brought within the bounds; no interval
        counts towards a scale-down."""
        bounded = min(max(self.count, settings.min_workers), settings.max_workers)
        if bounded != self.count:
            return self.decide(now, bounded, bounded, settings, why)
        self.low_intervals = 0
        return PoolDecision(self.name, self.count, self.count, self.count, "hold", f"holds {self.count}: {why}")

    def decide(self, now: float, needed: int, needed_banded: int, settings: PlannerSettings,
               why: str) -> PoolDecision:
        """``needed`` holds the sizing rate; ``needed_banded`` the rate × (1 + band): up on the
        first, down only to the second."""
        needed = min(max(needed, settings.min_workers), settings.max_workers)
        banded = min(max(needed_banded, needed), settings.max_workers)
        current = self.count
        if current > settings.max_workers:   # a bound is not a forecast: no hysteresis, no cooldown
            self._change(now, settings.max_workers, up=False)
            return PoolDecision(self.name, current, needed, settings.max_workers, "scale_down",
                                f"{current} above --max-workers {settings.max_workers}; {why}")
        if needed > current:
            self.low_intervals = 0
            wait = self.last_up_s + settings.up_cooldown_s - now
            if wait > 0:
                return PoolDecision(self.name, current, needed, current, "hold",
                                    f"need {needed} > {current} but scale-up cooldown has {wait:.0f} s left; {why}")
            self._change(now, needed, up=True)
            return PoolDecision(self.name, current, needed, needed, "scale_up", f"need {needed} > {current}: {why}")
        if banded >= current:
            self.low_intervals = 0
            return PoolDecision(self.name, current, needed, current, "hold",
                                f"need {needed}, {banded} at +{settings.scale_down_band:.0%} rate, holds {current};"
                                f" {why}")
        self.low_intervals += 1
        if self.low_intervals < settings.scale_down_after:
            return PoolDecision(self.name, current, needed, current, "hold",
                                f"need {needed} < {current} for {self.low_intervals} of "
                                f"{settings.scale_down_after} intervals; {why}")
        wait = self.last_change_s + settings.down_cooldown_s - now
        if wait > 0:
            return PoolDecision(self.name, current, needed, current, "hold",
                                f"need {needed} < {current} but cooldown has {wait:.0f} s left; {why}")
        target = max(banded, current - max(1, math.floor(current * settings.max_down_fraction)))
        self._change(now, target, up=False)
        return PoolDecision(self.name, current, needed, target, "scale_down",
                            f"need {needed} < {current} for {settings.scale_down_after} intervals: {why}")

    def _change(self, now: float, count: int, up: bool) -> None:
        self.count = count
        self.last_change_s = now
        self.low_intervals = 0
        if up:
            self.last_up_s = now


#: the decode pool's part of a decision for workers that prefill and decode alike: none of its own
AGGREGATED_DECODE = PoolDecision("decode", 0, 0, 0, "hold", "aggregated into the prefill pool")


class LivePlanner:
    """Observation → forecast → sizing → hysteresis → :class:`Decision`. Keeps the counts it
    decided; the caller acts on each decision (a launcher) before the next observation, and
    may tell it what runs instead (:meth:`reconcile`).

    :meth:`decide_aggregated` is for workers that prefill *and* decode (plain ``vllm
    serve``): one pool, ``prefill``, with one hysteresis on the larger of the two needs, and the
    ``decode`` pool :data:`AGGREGATED_DECODE`. Two hystereses whose targets were joined (the
    larger) came down only when both pools' scale-downs fell in the same interval; reconciled
    to what runs before every decision, they could each fire in turn and never together, and
    the fleet never shrank (audit s34 r3 D1)."""

    def __init__(self, sizer: FleetSizer, settings: PlannerSettings | None = None,
                 prefill_workers: int = 1, decode_workers: int = 1) -> None:
        self.sizer = sizer
        self.settings = settings or PlannerSettings()
        self.forecaster = RateForecaster(self.settings.smoothing)
        self.prefill = _Pool("prefill", prefill_workers)
        self.decode = _Pool("decode", decode_workers)
        self._mix: deque[Observation] = deque(maxlen=self.settings.mix_intervals)
        # the intervals that measured a hit rate, apart: one whose prompt lengths came from the
        # router but whose answers carried no usage measured none, and must neither count as 0 %
        # hits nor push the last measured ones out of the pool
        self._hits: deque[Observation] = deque(maxlen=self.settings.mix_intervals)

    def _pooled_mix(self) -> tuple[tuple[int, ...], tuple[int, ...], float, float]:
        """Prompt and output lengths, the token hit rate and the arrival burstiness of the last
        few intervals (the hit rate: of the last few that measured it; none, 0): they change
        slowly, and one interval's sample is noisy (a few long prompts move its mean; a few
        close arrivals its SCV)."""
        inputs = _pooled_lengths([(o.input_tokens, o.mix_weight) for o in self._mix])
        outputs = _pooled_lengths([(o.output_tokens, o.mix_weight) for o in self._mix])
        total = sum(o.hit_weight for o in self._hits)
        hit = sum(o.hit_rate * o.hit_weight for o in self._hits) / total if total else 0.0
        scv = sum(o.arrival_scv for o in self._mix) / len(self._mix) if self._mix else 1.0
        return inputs, outputs, hit, scv

    def _unmeasured(self, obs: Observation) -> str:
        """What the decision's reason says of figures this interval did not measure."""
        if not obs.request_rate:
            return ""
        if not obs.input_tokens:
            return "; prompt mix of earlier intervals (no answer carried usage in this one)"
        if not self._hits:
            return "; no hit rate measured yet (no answer carried usage): sized as if nothing were cached"
        if not obs.hit_measured:
            return "; hit rate of earlier intervals (no answer carried usage in this one)"
        return ""

    def reconcile(self, prefill_workers: int, decode_workers: int) -> None:
        """The workers running now (a launcher's starting and serving ones): the next decision's
        current counts, whatever the last one targeted (a start refused, a worker failed since)."""
        self.prefill.count, self.decode.count = prefill_workers, decode_workers

    def decide(self, obs: Observation) -> Decision:
        """The next decision, each pool on its own (prefill and decode workers apart)."""
        return self._decide(obs, aggregated=False)

    def decide_aggregated(self, obs: Observation) -> Decision:
        """The next decision for workers that prefill and decode alike (the class docstring)."""
        return self._decide(obs, aggregated=True)

    def _decide(self, obs: Observation, aggregated: bool) -> Decision:
        s = self.settings
        self.forecaster.update(obs.at_s, obs.request_rate)
        if obs.input_tokens:
            self._mix.append(obs)
            if obs.hit_measured:
                self._hits.append(obs)
        inputs, outputs, hit, scv = self._pooled_mix()
        horizon = s.startup_s + s.interval_s
        forecast = self.forecaster.forecast(horizon)
        sizing_rate = max(forecast, obs.request_rate) * (1 + s.headroom)
        if sizing_rate > 0 and not inputs:
            # requests, but no prompt length known yet (a router that does not count the lengths
            # it priced, and streams without usage): sizing on no prompts would say "no
            # requests" and shed the pools
            why = (f"{obs.request_rate:.2f} req/s measured, {forecast:.2f} forecast in {horizon:.0f} s, but no"
                   " prompt length known yet (the router priced none and no answer carried usage: streams"
                   " without stream_options.include_usage)")
            decode = AGGREGATED_DECODE if aggregated else self.decode.hold(obs.at_s, s, why)
            return Decision(obs.at_s, forecast, sizing_rate, hit, math.nan, self.prefill.hold(obs.at_s, s, why),
                            decode)
        need = self.sizer.size(sizing_rate, inputs, outputs, hit, scv)
        # A scale-down is judged on the rate without the trend: a trend that noise bent up scaled
        # the pool up, and once it bent back the workers were shed again (audit s34 a5 D2). The
        # level and the measurement keep the band's promise; a real fall shows in both.
        holding_rate = max(self.forecaster.forecast(0.0), obs.request_rate) * (1 + s.headroom)
        pct = f"p{self.sizer.targets.ttft_percentile * 100:g}"
        why = (f"{obs.request_rate:.2f} req/s measured, {forecast:.2f} forecast in {horizon:.0f} s,"
               f" sized for {sizing_rate:.2f} ({holding_rate:.2f} without the trend) at hit rate {hit:.1%}"
               f" (mean prefill {need.mean_prefill_s:.3f} s, {pct} TTFT {need.predicted_ttft_s:.2f} s"
               f" <= {self.sizer.targets.ttft_s:g} s)" + (f"; {need.note}" if need.note else "")
               + self._unmeasured(obs))
        banded = self.sizer.size(holding_rate * (1 + s.scale_down_band), inputs, outputs, hit, scv)
        if aggregated:
            both = self.prefill.decide(obs.at_s, max(need.prefill_workers, need.decode_workers),
                                       max(banded.prefill_workers, banded.decode_workers), s,
                                       f"prefill needs {need.prefill_workers}, decode {need.decode_workers}: {why}")
            return Decision(obs.at_s, forecast, sizing_rate, hit, need.predicted_ttft_s, both, AGGREGATED_DECODE)
        prefill = self.prefill.decide(obs.at_s, need.prefill_workers, banded.prefill_workers, s, why)
        decode = self.decode.decide(obs.at_s, need.decode_workers, banded.decode_workers, s, why)
        return Decision(obs.at_s, forecast, sizing_rate, hit, need.predicted_ttft_s, prefill, decode)
