"""From the turn records the workers emitted to the demo's summary (plain data, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvtier.bench.baselines import ratio_warnings


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None for no values."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


GIB = float(1 << 30)


def ideal_load_s(loaded_bytes: dict[str, int], limits_gib_s: dict[str, float] | None) -> float | None:
    """Seconds the load takes at the hardware's speed: the longest of its tiers' parts, each
    part its bytes at that tier's limit (measured the way kvtier reads); None when a tier that
    served bytes has no measured limit (a server, say).

    The longest part, not their sum: ``load_blocks`` hands the lower tiers' runs to the store's
    I/O threads first and copies the host runs while those reads are in flight, so a mixed load
    at both limits takes the longer part. Summed, such a load scored 1.44 (warned as a wrong
    baseline) and one at 70 % of the hardware's speed 1.0. Both parts share the CPU on a small
    machine, so the longer part can be out of reach: a mixed figure may read low, never high."""
    if not loaded_bytes or not limits_gib_s:
        return None
    if any(not limits_gib_s.get(tier) for tier in loaded_bytes):
        return None
    return max(n / (limits_gib_s[tier] * GIB) for tier, n in loaded_bytes.items())


def load_efficiency(loaded_bytes: dict[str, int], load_s: float | None,
                    limits_gib_s: dict[str, float] | None) -> float | None:
    """(bytes ÷ that tier's limit) ÷ measured load time: 1.0 is a load at the hardware's speed."""
    ideal = ideal_load_s(loaded_bytes, limits_gib_s)
    if ideal is None or not load_s:
        return None
    return ideal / load_s


#: the limit each tier's ``load_efficiency_vs_memcpy`` takes in place of its own: the host tier's
#: contiguous 64 MiB memcpy (``limits.host_copy_gib_s``, the figure posted before the host limit
#: made the load's own copy); other tiers keep theirs
MEMCPY_LIMITS = {"host": "host_memcpy"}


def memcpy_limits(limits_gib_s: dict[str, float] | None) -> dict[str, float] | None:
    """``limits_gib_s`` with each tier of :data:`MEMCPY_LIMITS` judged against its memcpy figure
    (none where that was not measured)."""
    if not limits_gib_s:
        return limits_gib_s
    out = dict(limits_gib_s)
    for tier, key in MEMCPY_LIMITS.items():
        out[tier] = limits_gib_s.get(key)
    return out


def load_tiers(loaded_bytes: dict[str, int]) -> str | None:
    """The key a turn's efficiency counts under: the tiers that served its bytes, host first
    ("host", "disk", "host+disk"). A mixed load is bounded by whichever of its overlapped parts
    is longer, so it is neither a host nor a disk figure: it has a key of its own and stays out
    of the single-tier percentiles (counted for the tier with most bytes, the demo's mixed turns
    entered the host p50)."""
    tiers = sorted((tier for tier, n in loaded_bytes.items() if n), key=lambda tier: (tier != "host", tier))
    return "+".join(tiers) or None


def max_logits_diff(diffs: Iterable[float]) -> tuple[float | None, bool]:
    """The largest |logit difference| over the turns (None: no turns, or a turn's was NaN) and
    whether a turn's was NaN: a load that left the poisoned NaN KV in place gives NaN logits, and
    ``max()`` over NaN depends on the order (a NaN after a finite value is dropped, a first one
    wins), so that a turn the demo exists to catch read 0.0, or printed a bare NaN in --json."""
    diffs = list(diffs)
    if any(math.isnan(d) for d in diffs):
        return None, True
    return max(diffs, default=None), False


def logits_match(diff: float, tolerance: float | None) -> bool:
    """Whether a turn's largest |first-token logit difference| from the recompute passes: finite
    and at most ``tolerance`` (the worker's, :func:`kvtier.demo.worker.logits_tolerance`). A record
    without a tolerance (none the worker writes) has only a NaN failed.

    The greedy tokens alone cannot fail a load whose KV is wrong but close enough that the few
    argmax tokens survive (likely on a small random-weight model): its logits say so."""
    if math.isnan(diff):
        return False
    return tolerance is None or diff <= tolerance


def logits_off_turns(turns: Iterable[dict]) -> list[int]:
    """The turns (numbered as the demo's table numbers them, from 1) whose logit difference is
    above their tolerance (a NaN one is not: ``logits_nan`` says so)."""
    return [t["index"] + 1 for t in turns
            if t.get("logits_tolerance") is not None and t["logits_max_abs_diff"] > t["logits_tolerance"]]


def turn_outputs_equal(turn: dict) -> bool:
    """A turn's verdict: its greedy tokens equal the recompute's and its logits pass :func:`logits_match`."""
    return turn["outputs_equal"] and logits_match(turn["logits_max_abs_diff"], turn.get("logits_tolerance"))


def summarize(turns: list[dict], phases: list[dict], *, runtime_s: float, scenario: str) -> dict:
    """The figures a user checks: equality, speedups, load efficiency per tier and kvtier's time over
    the ideal transfer (lookup and load apart from the prefill), hit rate, CPU saved, bytes.

    ``outputs_equal``: every turn's greedy tokens and first-token logits match the recompute's
    (:func:`turn_outputs_equal`); ``logits_off_turns`` names the turns whose logits are off by more
    than their tolerance, ``logits_nan`` says one was NaN.
    ``load_efficiency_p50`` (and p10) per tier, mixed loads under their own key ("host+disk"): the
    ideal load (:func:`ideal_load_s`: the longest of its tiers' parts at their limits) over the
    measured load; the host limit makes the same copy as the load (the load's
    blocks into the KV storage's layout, from its cache state). ``load_efficiency_vs_memcpy_p50``:
    the same with the host part at the contiguous memcpy limit instead, as posted before."""
    cold = [t["ttft_cold_s"] for t in turns]
    warm = [t["ttft_warm_s"] for t in turns]
    resumes = [t for t in turns if t["kind"] == "resume"]
    context = sum(t["context_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    loaded: dict[str, int] = {}
    for t in turns:
        for tier, n in t["loaded_bytes"].items():
            loaded[tier] = loaded.get(tier, 0) + n
    written: dict[str, int] = {}
    for phase in phases:
        for tier, stats in (phase.get("store_stats") or {}).items():
            written[tier] = written.get(tier, 0) + stats.get("bytes_written", 0)
    last_stats = (phases[-1].get("store_stats") or {}) if phases else {}
    restart = next((p for p in phases if p["phase"] > 1), None)
    # The tax is judged where kvtier did something: on turns that loaded a prefix
    # (a turn with nothing cached costs its prefill plus a lookup, a ratio of ~1).
    # No hit: the per-hit figures are None (the report leaves their line out), not the misses'.
    hits = [t for t in turns if t["cached_tokens"]]
    # Load efficiency per tier, against the limits its own process measured. A turn
    # loading from two tiers counts under both ("host+disk", :func:`load_tiers`), apart from
    # the single-tier figures: its ideal is the longer of the tiers' parts, which it loads at once.
    # The host limit is the copy the load makes (limits.host_place_gib_s: the same blocks into the
    # storage's strided rows, from the load's cache state); ``*_vs_memcpy`` judges the host part
    # against the contiguous memcpy instead, the figure posted before (no warning: not the same copy).
    limits_of = {p["phase"]: p.get("limits_gib_s") for p in phases}
    efficiency: dict[str, list[float]] = {}
    vs_memcpy: dict[str, list[float]] = {}
    overhead: list[float] = []
    warnings: list[str] = []
    for t in turns:
        # the turn's own limits (the best of start-up and right after its load), else its phase's
        limits = t.get("limits_gib_s") or limits_of.get(t["phase"])
        tier = load_tiers(t["loaded_bytes"])
        memcpy_ideal = ideal_load_s(t["loaded_bytes"], memcpy_limits(limits))
        if memcpy_ideal is not None and t.get("load_s"):
            vs_memcpy.setdefault(tier, []).append(memcpy_ideal / t["load_s"])
        ideal = ideal_load_s(t["loaded_bytes"], limits)
        if ideal is None or not t.get("load_s"):
            continue
        efficiency.setdefault(tier, []).append(ideal / t["load_s"])
        warnings += [f"turn {t.get('index', '?')}: {w}" for w in ratio_warnings(
            {f"{tier} load_efficiency": ideal / t["load_s"]}, what="limit measured in the same process")]
        # kvtier's own time (lookup + load) over the ideal transfer; the suffix's prefill
        # is the engine's, not kvtier's, and no longer pads the ideal.
        overhead.append((t["lookup_s"] + t["load_s"]) / ideal)
    # what the workers saw go wrong in their phase (a shared tier that failed or took nothing)
    warnings += [f"phase {p['phase']}: {w}" for p in phases for w in p.get("warnings", ())]
    logits_diff, logits_nan = max_logits_diff(t["logits_max_abs_diff"] for t in turns)
    summary = {
        "scenario": scenario,
        "turns": len(turns),
        "outputs_equal": all(turn_outputs_equal(t) for t in turns),
        "logits_max_abs_diff": logits_diff,
        "logits_nan": logits_nan,
        "logits_off_turns": logits_off_turns(turns),
        "ttft_cold_p50_s": percentile(cold, 50),
        "ttft_cold_p90_s": percentile(cold, 90),
        "ttft_warm_p50_s": percentile(warm, 50),
        "ttft_warm_p90_s": percentile(warm, 90),
        "speedup_p50": percentile([t["speedup"] for t in turns], 50),
        "load_efficiency_p50": {tier: percentile(v, 50) for tier, v in sorted(efficiency.items())},
        "load_efficiency_p10": {tier: percentile(v, 10) for tier, v in sorted(efficiency.items())},
        "load_efficiency_turns": {tier: len(v) for tier, v in sorted(efficiency.items())},
        "load_efficiency_vs_memcpy_p50": {tier: percentile(v, 50) for tier, v in sorted(vs_memcpy.items())},
        "warnings": warnings,
        "overhead_ratio_p50": percentile(overhead, 50),
        "overhead_ratio_p90": percentile(overhead, 90),
        "lookup_s_p50": percentile([t.get("lookup_s") for t in hits], 50),
        "lookup_s_p90": percentile([t.get("lookup_s") for t in hits], 90),
        "load_s_p50": percentile([t.get("load_s") for t in hits], 50),
        "prefill_s_p50": percentile([t.get("prefill_s") for t in hits], 50),
        "hit_rate": cached / context if context else 0.0,
        "cached_tokens": cached,
        "context_tokens": context,
        "cpu_seconds_cold": sum(t["cpu_cold_s"] for t in turns),
        "cpu_seconds_warm": sum(t["cpu_warm_s"] for t in turns),
        "cpu_seconds_saved": sum(t["cpu_cold_s"] - t["cpu_warm_s"] for t in turns),
        "bytes_loaded_by_tier": loaded,
        "bytes_written_by_tier": written,
        "bytes_used_by_tier": {tier: s.get("used_bytes", 0) for tier, s in last_stats.items()},
        "tier_limits_gib_s": [p.get("limits_gib_s") for p in phases],
        "runs_per_turn": {"without": [t.get("cold_runs", 1) for t in turns], "with": [t.get("warm_runs", 1) for t in turns]},
        "runtime_s": runtime_s,
    }
    if resumes:
        first = resumes[0]
        summary.update({
            "resume_speedup": first["speedup"],
            "resume_context_tokens": first["context_tokens"],
            "resume_new_tokens": first["computed_tokens"],
            "resume_tiers": sorted(first["tokens_by_tier"]),
            "resume_ttft_cold_s": first["ttft_cold_s"],
            "resume_ttft_warm_s": first["ttft_warm_s"],
        })
        after = [t for t in resumes if t["phase"] > 1]
        if after:
            summary["resume_after_restart_speedup"] = after[0]["speedup"]
            summary["resume_after_restart_tiers"] = sorted(after[0]["tokens_by_tier"])
    if restart is not None:
        summary["restart"] = {
            "new_process_ready_s": restart.get("spawn_to_ready_s"),
            "model_load_s": restart.get("model_load_s"),
            "store_open_s": restart.get("store_open_s"),
            "disk_blocks_recovered": restart.get("recovered_blocks"),
        }
    return summary
