"""One engine process of the demo: ``python -m kvtier.demo.worker < job.json``.

It opens the store (a fresh host tier; the disk tier re-indexes what an
earlier process left), loads the model, measures the tiers' limits, then runs
each request of its phase twice — without kvtier (recompute the whole
context) and with it (load the cached prefix, compute the rest) — and writes
one JSON line per event on stdout. The demo's process restart is real: the
next phase is another run of this module.

Every measured request starts with the machine idle from our side: the
previous request's background save is waited for first (its time is reported,
not hidden in a TTFT).

Short measurements are repeated, by one rule for both sides: a run is repeated
until the runs add up to a second (at most three; never two, whose median would
be the slower run) and the median counts, when
repeating cannot change what is measured — always without kvtier; with kvtier
only if everything came from the host tier (a block read from disk is promoted,
so a second run would measure DRAM). On this shared 2-core machine a 0.2 s run
can double when another process takes a core at the wrong moment, while a 10 s
run averages such moments out; the repeats keep one hiccup from deciding a
short turn's figure. The record says how many runs each side took.

Before every run, both sides alike, the engine's KV storage and load staging are
filled with NaN (``KVTierLM(poison=True)``, outside the timing): a load that
reported success without writing would leave NaN where the context's KV should
be, so its logits and tokens differ and ``outputs_equal`` says so, instead of
matching because the previous run left the right KV in place. ``outputs_equal`` judges
the greedy tokens of every run and their first-token logits (:func:`logits_tolerance`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def idle_cores(sample_s: float = 0.3) -> float:
    """Cores left idle by everything else on the machine, sampled from /proc/stat."""
    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, total

    idle0, total0 = snapshot()
    time.sleep(sample_s)
    idle1, total1 = snapshot()
    return (idle1 - idle0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def choose_threads() -> int:
    """torch threads for this engine: one per core, unless other processes keep the cores busy.

    OpenMP threads meet at a barrier after every operator, so a thread that
    loses its core stalls the whole forward pass. Measured on this 2-core
    machine: with about one other busy process two threads still ran a
    prefill 1.5x faster than one; with three or more, one thread ran a short
    prefill faster and far steadier (and a long one about as fast). So:
    ``ceil(idle cores + 0.5)`` threads, at most one per core — on 2 cores, one
    thread only when other processes leave half a core idle or less. Chosen
    once per process, so both sides of every comparison run with the same
    setting.
    """
    cores = os.cpu_count() or 1
    try:
        idle = idle_cores()
    except OSError:
        return cores
    return max(1, min(cores, math.ceil(idle + 0.5)))


def _configure_threads(threads: int | None) -> None:
    # Before torch starts OpenMP: passive waiting keeps 2 threads from spinning
    # against each other (and against other processes) on a 2-core machine;
    # active spinning made a contended prefill 2-3x slower here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The suffix prefill runs with a mask (queries after a cached prefix); without
    # this, transformers copies K and V once per query head group (repeat_kv).
    # Both runs (with and without kvtier) use the same setting.
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)


#: repeat a measurement until its runs add up to this much wall time (see the module doc)
REPEAT_UNTIL_S = 1.0
MAX_RUNS = 3


def measure(run, repeatable) -> list:
    """Runs of ``run()``: one, or more while short and ``repeatable(first run)``; an odd count
    (a second run implies a third), so that :func:`median` is a true median, not the slower of two."""
    runs = [run()]
    while repeatable(runs[0]) and len(runs) < MAX_RUNS and (
            sum(g.ttft_s for g in runs) < REPEAT_UNTIL_S or len(runs) % 2 == 0):
        runs.append(run())
    return runs


def median(runs: list):
    """The run of median TTFT (:func:`measure` gives an odd count; of an even one, the upper)."""
    return sorted(runs, key=lambda g: g.ttft_s)[len(runs) // 2]


class LimitMeter:
    """The tiers' limits (:mod:`kvtier.demo.limits`), measured in this process the way its loads read.

    ``storage`` is the engine's KV storage: the host limit copies into a scratch storage like it
    (same layout, dtype, capacity and poisoning: memory of the load's kind), poisoned before each
    copy when the engine poisons before each load, so that the copy finds the caches as the load
    did. The scratch storage is this meter's, allocated on the first host measurement. Not thread
    safe."""

    def __init__(self, layout, storage, disk=None, note=None) -> None:
        self.layout, self.storage, self.disk = layout, storage, disk
        self._scratch = None
        #: ``note(text)`` is told, once, that the disk limit could not be measured
        self.note = note
        #: why the last disk measurement failed (None: it did not)
        self.disk_error: str | None = None

    def _scratch_storage(self):
        from kvtier.integrations.transformers.cache_io import KVStorage

        engine = self.storage
        if self._scratch is None or self._scratch.capacity != engine.capacity:
            self._scratch = KVStorage(self.layout, engine.capacity, engine.dtype, engine.device,
                                      poison=engine.poisoned)
        return self._scratch

    def measure(self, loaded_bytes: dict[str, int] | None = None) -> dict[str, float]:
        """At start-up (``loaded_bytes`` None): every tier's limit that needs no load to size it,
        ``host_memcpy`` and ``disk``. After a load: the limits of the tiers it read from, ``host``
        (the copy the load made, on its block count: the limit ``load_efficiency`` is judged
        against), ``host_memcpy`` (contiguous, 64 MiB: the figure posted before) and ``disk``."""
        from kvtier.demo.limits import disk_limit_gib_s, host_copy_gib_s, host_place_gib_s
        from kvtier.integrations.transformers.cache_io import READ_CHUNK_BYTES, READS_IN_FLIGHT

        nbytes = self.layout.block_nbytes
        measured = {}
        if loaded_bytes is None or "host" in loaded_bytes:
            measured["host_memcpy"] = host_copy_gib_s(nbytes)
        if loaded_bytes and loaded_bytes.get("host"):
            scratch = self._scratch_storage()
            measured["host"] = host_place_gib_s(self.layout, max(1, loaded_bytes["host"] // nbytes), dst=scratch.raw(),
                                                before=scratch.poison if scratch.poisoned else None)
        if self.disk is not None and (loaded_bytes is None or "disk" in loaded_bytes):
            # kvtier's loader reads READS_IN_FLIGHT spans at once, a span packed in one extent with one
            # request (DiskTier.put_many packs the write-behind batches): the limit is the faster of
            # that and a request per block, READS_IN_FLIGHT at once
            span = max(1, READ_CHUNK_BYTES // nbytes)
            try:
                measured["disk"] = disk_limit_gib_s(self.disk.path, nbytes, in_flight=READS_IN_FLIGHT,
                                                    span_blocks=span)
            except OSError as exc:
                # The probe writes a scratch file of tens of MiB beside the blocks: on a small or full
                # file system (ENOSPC), a read-only one, it fails where the store itself still works.
                # A demo-only measurement: the limit is left out (no efficiency), the run goes on.
                if self.disk_error is None and self.note is not None:
                    self.note(f"disk limit not measured (no load efficiency for the disk tier): {exc}")
                self.disk_error = str(exc)
        return measured


def logits_tolerance(reference, dtype) -> float:
    """How far a run's first-token logits may be from the recompute's ``reference``: the rounding the
    cache probe allows for the model's ``dtype`` (1e-3 in fp32, the demo's) times the largest
    |logit|. Relative, as logits' scale is the model's (a random-weight model's are small).

    With the right KV a warm run differs from the recompute only in the order of its fp32 sums (a
    suffix prefill over a loaded prefix, not one over the whole prompt): at most 2.5e-6 (absolute)
    in every demo run posted. KV loaded wrong (another position's block, a stale or half-written one) moves the
    attention of every later position, the logits by far more than 1e-3 of their scale; the probe
    judges the same comparison (a suffix fed after a cached prefix) by the same rule."""
    from kvtier.integrations.transformers.cache_probe import _DEFAULT_TOLERANCE, _RELATIVE_TOLERANCE

    return _RELATIVE_TOLERANCE.get(dtype, _DEFAULT_TOLERANCE) * float(reference.abs().max())


def logits_diff(reference, runs) -> float:
    """The largest |first-token logit difference| of any of ``runs`` from ``reference``: NaN if one
    run's is (a NaN is never lost to ``max()``'s order)."""
    import torch

    return float(torch.stack([(g.first_logits - reference).abs().max() for g in runs]).max())


def run_turn(lm, context: list[int], gen_tokens: int, limits: dict, emit_cold,
             measure_limits=None) -> tuple[dict, list[int]]:
    """One request measured without kvtier, then with it; its record and the reference reply.

    ``measure_limits(loaded_bytes)`` (:meth:`LimitMeter.measure`) measures, after the load, the
    limits of the tiers it read from; each counts for this turn with the best of ``limits``."""
    import numpy as np

    from kvtier.demo.summary import ideal_load_s, load_efficiency, logits_match, memcpy_limits

    prompt = np.asarray(context, dtype=np.int64)
    colds = measure(lambda: lm.generate(prompt, gen_tokens, use_store=False), lambda g: True)
    cold = median(colds)
    emit_cold(cold.ttft_s)
    warms = measure(lambda: lm.generate(prompt, gen_tokens, save=False), lambda g: set(g.loaded_bytes) <= {"host"})
    warm = median(warms)
    # Store what this request added, as generate() would have: the storage
    # holds the last run's KV (every run computed the same tokens), and save()
    # without a mask after generate() saves it as generate() does (every token attended).
    last = warms[-1]
    t = time.perf_counter()
    lm.save(np.concatenate([prompt, np.asarray(last.tokens[:-1], dtype=np.int64)]), known_blocks=last.known_blocks)
    lm.wait_saves()
    save_s = time.perf_counter() - t
    if warm.loaded_bytes and measure_limits is not None:
        # Measured again right after the load (untimed): on a shared machine the limit
        # taken at start-up can be a slow moment's; a limit is the best seen. Not while
        # the load's background promotions still read the disk: they would slow the limit.
        if lm.store is not None:
            lm.store.wait_promotions(30.0)
        fresh = measure_limits(warm.loaded_bytes)  # the tiers this load read from (disk costs ~1 s)
        limits = {tier: max(limits.get(tier, 0.0), fresh.get(tier, 0.0)) for tier in set(limits) | set(fresh)}
    # The ideal load: the bytes at each tier's limit measured in this process the
    # way kvtier reads. Lookup and load are kvtier's time; the suffix's prefill is the
    # engine's and stays out of the ideal (it hid a load running slower than its limit).
    ideal = ideal_load_s(warm.loaded_bytes, limits)
    bpt = lm.layout.bytes_per_token
    # Every run's logits against the recompute's, each warm run's load as much as the median's
    # (a vector of the vocabulary's size per run: cheap next to a forward pass).
    diff = logits_diff(cold.first_logits, colds + warms)
    tolerance = logits_tolerance(cold.first_logits, lm.storage.dtype)
    record = dict(
        context_tokens=len(context), cached_tokens=warm.cached_tokens, computed_tokens=len(context) - warm.cached_tokens,
        tokens_by_tier={tier: n // bpt for tier, n in warm.loaded_bytes.items()}, loaded_bytes=warm.loaded_bytes,
        ttft_cold_s=cold.ttft_s, ttft_warm_s=warm.ttft_s, cpu_cold_s=cold.ttft_cpu_s, cpu_warm_s=warm.ttft_cpu_s,
        lookup_s=warm.lookup_s, load_s=warm.load_s, prefill_s=warm.prefill_s,
        limits_gib_s=limits, ideal_load_s=ideal, load_efficiency=load_efficiency(warm.loaded_bytes, warm.load_s, limits),
        load_efficiency_vs_memcpy=load_efficiency(warm.loaded_bytes, warm.load_s, memcpy_limits(limits)),
        overhead_ratio=(warm.lookup_s + warm.load_s) / ideal if ideal else None, speedup=cold.ttft_s / warm.ttft_s,
        outputs_equal=all(g.tokens == cold.tokens for g in colds + warms) and logits_match(diff, tolerance),
        logits_max_abs_diff=diff, logits_tolerance=tolerance,
        cold_runs=len(colds), warm_runs=len(warms), save_s=save_s,
    )
    return record, cold.tokens


def shared_tier_warnings(tiers, blocks_saved: int) -> list[str]:
    """What went wrong with a store's kvtier server (``--remote``) among ``tiers`` since they were
    opened, said so that a demo that missed its shared tier does not pass for one that used it:
    calls that failed (refused, timed out, lost connections: the store took them as misses and
    skipped saves), and none of the ``blocks_saved`` (the store's puts) reaching the server.
    Empty without a server."""
    from kvtier.tiers.remote import RemoteTier

    warnings = []
    for tier in tiers:
        server = _unwrapped(tier)
        if not isinstance(server, RemoteTier):
            continue
        counts = server.stats.snapshot()
        if counts["errors"]:
            warnings.append(f"the kvtier server {server.address} failed ({counts['errors']} connection failures, "
                            f"the last: {server.last_error}): what it should have stored or served was missed")
        if blocks_saved and not counts["bytes_written"]:
            warnings.append(f"the kvtier server {server.address} took 0 bytes of the {blocks_saved} blocks "
                            f"this engine saved: the shared tier was not used")
    return warnings


def _unwrapped(tier):
    """The tier a wrapper (encryption, fault injection) stands in front of."""
    while hasattr(tier, "inner"):
        tier = tier.inner
    return tier


def main() -> int:
    # SIGTERM (the parent stopping this worker, or the kernel's die-with-parent signal) unwinds,
    # so that ``finally`` blocks run: a half-built model directory is removed, not left behind.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    from kvtier.errors import KvtierError

    try:
        return _run(json.loads(sys.stdin.read()))
    except KvtierError as exc:
        # A setting or tier that cannot be used: said to the parent as an event (one line there,
        # exit 2), not as a traceback.
        _emit("error", kind=type(exc).__name__, message=str(exc))
        return 2


def _run(job: dict) -> int:
    _configure_threads(job.get("threads"))
    started = time.perf_counter()

    import torch

    from kvtier.demo.workload import Scenario
    from kvtier.integrations.transformers import KVTierLM, namespace_for_model
    from kvtier.integrations.transformers.cache_io import READS_IN_FLIGHT
    from kvtier.integrations.transformers.models import DEMO_SPEC, ModelSpec, ensure_model, load_model
    from kvtier.store.config import StoreConfig, build_store

    spec = ModelSpec(**job["model_spec"]) if job.get("model_spec") else DEMO_SPEC
    t = time.perf_counter()
    model_dir, built = ensure_model(spec, job.get("model_root"))
    if built:
        _emit("model_built", seconds=time.perf_counter() - t, path=str(model_dir))
    t = time.perf_counter()
    model, tokenizer = load_model(model_dir)
    load_s = time.perf_counter() - t
    # Sampled here, with this process idle (imports and load are done).
    torch.set_num_threads(job.get("threads") or choose_threads())
    namespace = namespace_for_model(model, block_tokens=job["block_tokens"], weights_dir=model_dir)
    t = time.perf_counter()
    # As many I/O threads as the loader's reads in flight (the disk limit below reads that many
    # at once): the loader queues spans ahead of them, so the threads, not it, bound the reads.
    store = build_store(StoreConfig(**job["store"]), namespace.layout, io_threads=READS_IN_FLIGHT)
    open_s = time.perf_counter() - t
    disk = next((tier for tier in store.tiers if tier.name == "disk"), None)
    recovered = sum(1 for _ in disk.keys()) if disk is not None else 0
    lm = KVTierLM(model, store, namespace, capacity_tokens=job.get("capacity_tokens", 8192),
                  poison=job.get("poison", True))
    scenario = Scenario.from_json(job["scenario"])

    def encode(role: str, text: str, max_tokens: int) -> list[int]:
        ids = tokenizer(f"<|{role}|>{text}\n", add_special_tokens=False)["input_ids"]
        return list(ids[:max_tokens])

    assistant = tokenizer("<|assistant|>", add_special_tokens=False)["input_ids"]
    system = encode(scenario.system_prompt.role, scenario.system_prompt.text, scenario.system_prompt.max_tokens)
    sessions: dict[str, list[int]] = job.get("sessions") or {}

    # Warm up the kernels (first calls allocate and tune); nothing is stored.
    lm.generate(system[:64], 2, use_store=False)

    meter = LimitMeter(namespace.layout, lm.storage, disk, note=lambda text: _emit("note", text=text))
    measure_limits = meter.measure
    limits = measure_limits()
    _emit("ready", pid=os.getpid(), phase=job["phase"], ready_s=time.perf_counter() - started,
          model_load_s=load_s, store_open_s=open_s, recovered_blocks=recovered, limits_gib_s=limits,
          block_tokens=namespace.layout.block_tokens, bytes_per_token=namespace.layout.bytes_per_token,
          threads=torch.get_num_threads(), poisoned=lm.storage.poisoned)

    for index in job["step_indices"]:
        step = scenario.steps[index]
        context = sessions.get(step.session) or list(system)
        for message in step.messages:
            context = context + encode(message.role, message.text, message.max_tokens)
        context = context + assistant
        _emit("start", index=index, session=step.session, label=step.label, context_tokens=len(context))
        record, reply = run_turn(lm, context, scenario.gen_tokens, limits, emit_cold=lambda s: _emit(
            "cold_done", index=index, ttft_s=s), measure_limits=measure_limits)
        _emit("turn", index=index, phase=job["phase"], session=step.session, label=step.label, kind=step.kind,
              **record)
        sessions[step.session] = context + reply  # the reference reply continues the conversation

    lm.close()
    stats = store.stats()
    for text in shared_tier_warnings(store.tiers, blocks_saved=stats["store"]["puts"]):
        _emit("warning", text=text)
    store.close()
    _emit("done", phase=job["phase"], sessions=sessions, store_stats=stats["tiers"],
          seconds=time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
