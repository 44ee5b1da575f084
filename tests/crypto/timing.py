"""Timing side-channel checks that can see a leak, and prove it each run.

A check compares two probe populations that must be indistinguishable to an
attacker (another tenant's existing block vs an absent one) *beside a positive
control* the same procedure must tell apart (the prober's own hits vs misses;
a hit really does more work -- a block copied, keys walked). If the control is
not resolved the run proves nothing and :class:`TimingTestInvalid` is raised:
a blind procedure never passes.

Why not a p-value (the former KS test): with thousands of samples a test of
"same distribution" rejects for harmless differences a scheduler makes under
load, and accepts when the sample is too noisy to see anything. Here the
verdict is an effect size with a confidence interval: the whole bootstrap CI
of the median per-round difference must lie within a margin, the larger of a fraction of
the control effect measured in the same run and a small absolute floor. An
equivalence test, so noise cannot make it pass -- only a longer measurement.

Probes run interleaved: each round times one probe of every population in a
freshly shuffled order, so drift and bursts of load fall on all alike, and
rounds are resampled whole (a paired bootstrap). When a verdict is not yet
decisive (the CI straddles the margin, or the control is not yet resolved),
more rounds are measured, up to a budget; that is what keeps the check both
strict and steady on a loaded machine.

Give every population its own pool of items, of the same size, visited as
often: a pool probed twice as often stays warmer in the CPU caches and showed
up as a 0.8 µs "leak" (CI clear of zero) in a first draft of these tests.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

#: a probe: called with the round number, picks its item from its own pool, returns nothing useful
Probe = Callable[[int], object]


class TimingFailure(AssertionError):
    def __init__(self, message: str, verdict: "Verdict") -> None:
        super().__init__(f"{message}: {verdict}")
        self.verdict = verdict


class TimingTestInvalid(TimingFailure):
    """The positive control was not resolved: the procedure could not have seen a leak either."""


class TimingLeak(TimingFailure):
    """Populations that must be indistinguishable differ by more than the margin, with confidence."""


class TimingInconclusive(TimingFailure):
    """The budget ran out before the difference was shown to be within the margin."""


def spin(ns: int) -> None:
    """Busy-wait ``ns`` nanoseconds (``time.sleep`` overshoots by tens of µs)."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def measure(probes: Mapping[str, Probe], rounds: int, *, seed: int, start: int = 0) -> dict[str, np.ndarray]:
    """Times ``rounds`` rounds of every probe (ns), each round in a fresh random order.

    The collector is paused while timing: a collection lands on whichever probe
    happens to run, which only adds noise (both sides alike, but wider CIs)."""
    labels = list(probes)
    order = random.Random(seed)
    out = {label: np.empty(rounds, np.int64) for label in labels}
    clock = time.perf_counter_ns
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order.shuffle(labels)
            for label in labels:
                probe = probes[label]
                t0 = clock()
                probe(start + r)
                out[label][r] = clock() - t0
    finally:
        if was_enabled:
            gc.enable()
    return out


@dataclass(frozen=True)
class Effect:
    """How much slower population a is than b, in ns, with its bootstrap 95% confidence interval."""

    ns: float
    lo: float
    hi: float

    @property
    def resolved(self) -> bool:
        """The CI excludes zero: the two populations were told apart."""
        return self.lo > 0 or self.hi < 0

    @property
    def farthest(self) -> float:
        """The largest difference the data allow (either sign)."""
        return max(abs(self.lo), abs(self.hi))

    @property
    def nearest(self) -> float:
        """The smallest difference the data allow (0 when the CI holds 0)."""
        return 0.0 if not self.resolved else min(abs(self.lo), abs(self.hi))

    def __str__(self) -> str:
        return f"{self.ns / 1e3:+.2f} µs [95% CI {self.lo / 1e3:+.2f}, {self.hi / 1e3:+.2f}]"


def median_difference(samples: Mapping[str, np.ndarray], a: str, b: str, *, resamples: int = 1000,
                      seed: int = 0) -> Effect:
    """The median of the per-round differences a[r] - b[r], with a bootstrap CI over rounds.

    Paired, because a and b were timed in the same rounds: load that comes and
    goes (the server descheduled, a busy neighbour) moves both probes of a round
    alike, and the per-round difference cancels it. On a loaded 2-core machine
    this gave a CI ten times narrower than the difference of the two medians.
    Under a pure shift d of one population, a[r] - b[r] is symmetric about d, so
    its median estimates the shift itself."""
    x, y = np.asarray(samples[a], np.int64), np.asarray(samples[b], np.int64)
    if len(x) != len(y) or len(x) < 20:
        raise ValueError(f"need paired samples of at least 20 rounds, got {len(x)} and {len(y)}")
    d = (x - y).astype(float)
    boot = np.median(d[np.random.default_rng(seed).integers(0, len(d), (resamples, len(d)))], axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return Effect(float(np.median(d)), float(lo), float(hi))


@dataclass(frozen=True)
class Verdict:
    control: Effect  #: hit - miss (must be resolved)
    gap: Effect  #: foreign - absent (must lie within ±margin)
    margin_ns: float
    rounds: int

    @property
    def control_ok(self) -> bool:
        # Resolved, and clearly bigger than the margin it sets: a control barely
        # above noise would make "a fraction of it" a meaningless yardstick.
        return self.control.resolved and self.control.nearest > self.margin_ns

    @property
    def equivalent(self) -> bool:
        return self.gap.farthest < self.margin_ns

    @property
    def leaking(self) -> bool:
        return self.gap.nearest >= self.margin_ns

    def __str__(self) -> str:
        return (f"{self.rounds} rounds; control hit-miss {self.control}; "
                f"gap foreign-absent {self.gap}; margin ±{self.margin_ns / 1e3:.2f} µs")


def judge(samples: Mapping[str, np.ndarray], *, fraction: float, floor_ns: float,
          control=("hit", "miss"), check=("foreign", "absent"), seed: int = 0) -> Verdict:
    c = median_difference(samples, *control, seed=seed)
    g = median_difference(samples, *check, seed=seed + 1)
    margin = max(fraction * abs(c.ns), floor_ns)
    return Verdict(c, g, margin, len(samples[check[0]]))


def assert_indistinguishable(probes: Mapping[str, Probe], *, rounds: int, max_rounds: int, fraction: float,
                             floor_ns: float, seed: int = 0, warmup: int = 50,
                             control=("hit", "miss"), check=("foreign", "absent")) -> Verdict:
    """Measure in batches of ``rounds`` until the verdict is decisive or ``max_rounds`` are spent.

    Raises :class:`TimingLeak` as soon as the gap is beyond the margin with
    confidence, :class:`TimingTestInvalid` if the control is never resolved,
    and :class:`TimingInconclusive` if the budget runs out with the gap not
    shown to be within the margin -- never a pass by default."""
    missing = {*control, *check} - set(probes)
    if missing:
        raise ValueError(f"probes lack populations {sorted(missing)}")
    measure(probes, warmup, seed=seed - 1)  # caches, allocators, connections: warm, untimed
    samples: dict[str, np.ndarray] = {label: np.empty(0, np.int64) for label in probes}
    while True:
        batch = measure(probes, rounds, seed=seed + len(samples[check[0]]), start=len(samples[check[0]]))
        samples = {k: np.concatenate([samples[k], batch[k]]) for k in samples}
        verdict = judge(samples, fraction=fraction, floor_ns=floor_ns, control=control, check=check, seed=seed)
        done = len(samples[check[0]]) + rounds > max_rounds
        if verdict.control_ok and verdict.leaking:
            raise TimingLeak(f"{check[0]} and {check[1]} probes are told apart", verdict)
        if verdict.control_ok and verdict.equivalent:
            return verdict
        if done:
            if not verdict.control_ok:
                raise TimingTestInvalid("the positive control was not resolved, so no leak could have "
                                        "been seen either", verdict)
            raise TimingInconclusive(f"{check[0]} vs {check[1]} not shown within the margin", verdict)
