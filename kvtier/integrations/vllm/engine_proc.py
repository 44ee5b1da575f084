"""One vLLM engine in its own process, driven by JSON lines (for tests and ``kvtier bench vllm``).

vLLM keeps its KV connector in a process-wide global, so each engine instance
(a prefill and a decode instance, a fresh engine, one per benchmarked tier)
runs in its own process.
Usage: ``python -m kvtier.integrations.vllm.engine_proc '<json settings>'``; then one JSON command per
line on stdin, one reply per command on stdout as ``KVTIER-REPLY {"seq": n, "reply": <json>}``
(``seq``: the command's number, 0 for the ready reply; vLLM's own log lines are skipped by the reader).

Settings: ``model`` (a directory), ``extra`` (kv_connector_extra_config, or
null for no connector), ``role`` (kv_both | kv_producer | kv_consumer),
``dtype`` (default float32), ``max_model_len``, ``prefix_caching``, ``force_prefix_caching`` (keep vLLM's own prefix cache on
where its CPU platform turns it off, for latent-attention models: the reference a test compares a
kvtier hit with, as both take vLLM's context-attention path), ``hide_amx`` (vLLM's CPU kernels run
as on a host without AMX tiles: their other page layout, for a test of two hosts), ``kv_pages`` (vLLM's KV cache size in pages, to make it
smaller than a workload), ``kv_events`` (a KVEventsConfig dict: vLLM publishes its KV events,
the connector's CPU-medium ones among them), or ``transfer`` (a whole
KVTransferConfig dict, for another connector such as LMCache's). Commands: ``generate`` (prompts as token-id lists,
``max_tokens``, optional ``cache_salt``, ``kv_transfer_params``, ``lora``: an adapter as
``{"name", "id", "path"}`` for every prompt, with ``engine_args`` ``{"enable_lora": true}``), ``reset``
(vLLM's prefix cache; replies ``{"ok": bool}``, False when vLLM refused), ``ttft`` (one
prompt stepped through the engine: time to its first token, then ``max_tokens`` tokens with
top-5 logprobs), ``replay`` (requests added at their arrival times; per-request TTFT,
finish time, cached tokens, the process's CPU seconds: :func:`replay`), ``flush`` (wait for the connector's saves and the store's
write-behind copies), ``stats``,
``break_loads`` / ``fix_loads`` (make every store read fail while lookups
still hit), ``skip_load_copies`` (loads read and report success but write no
page; ``fix_loads`` undoes it), ``kill_on_next_load`` (SIGKILL a process at the next store read),
``quit``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvtier.child_process import die_with_parent

#: the child's defaults: in-process engine core, eager mode (start in seconds), no hub
CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

MARK = "KVTIER-REPLY "
#: vLLM's page (block_size) in every engine this module starts: kvtier blocks are whole pages
PAGE_TOKENS = 32


def latent_attention_host() -> dict:
    """How vLLM's CPU platform runs a latent-attention (MLA) model on this host: its backend,
    the weight dtype that backend takes, and its page size (AMX_MLA loads bfloat16 weights only:
    float32 ones fail at start-up). See :mod:`kvtier.integrations.vllm.cpu_pages`."""
    from kvtier.integrations.vllm.cpu_pages import latent_backend

    if latent_backend() == "AMX_MLA":
        return {"backend": "AMX_MLA", "dtype": "bfloat16", "page_tokens": PAGE_TOKENS}
    return {"backend": "CPU_MLA", "dtype": "float32", "page_tokens": 16}


class EngineDied(RuntimeError):
    pass


class EngineProcess:
    """The parent's handle on an engine process; ``call`` sends one command and returns its reply.

    Commands are numbered (``seq``) and the child echoes the number: a reply that comes after
    its command timed out (:class:`EngineDied` "no reply") is dropped, never taken as the answer
    to a later command. Not thread safe (one caller at a time)."""

    def __init__(self, settings: dict, log_path: Path, *, env: dict | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.integrations.vllm.engine_proc", json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**CHILD_ENV, **os.environ, **(env or {})},
            preexec_fn=die_with_parent,   # a bench or test run killed mid-way takes its engines along
        )
        self._replies: queue.Queue = queue.Queue()
        self._seq = 0                                   # the last command's number; 0: the ready reply
        self._awaited: collections.deque = collections.deque([0])   # numbers sent, not yet answered
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def wait_ready(self, timeout: float = 240) -> None:
        self._reply(timeout)

    def send(self, **cmd) -> None:
        self._seq += 1
        self.proc.stdin.write(json.dumps({**cmd, "seq": self._seq}) + "\n")
        self.proc.stdin.flush()
        self._awaited.append(self._seq)

    def reply(self, timeout: float = 240) -> dict:
        return self._reply(timeout)

    def call(self, timeout: float = 240, **cmd) -> dict:
        self.send(**cmd)
        return self._reply(timeout)

    def _reply(self, timeout: float) -> dict:
        """The reply to the oldest command not yet answered; one that times out is given up."""
        if not self._awaited:
            raise RuntimeError("no command awaits a reply")
        seq = self._awaited.popleft()
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise EngineDied(f"no reply in {timeout}s; log: {self.log_path}\n{self.tail()}") from None
            if got is None:
                self._replies.put(None)   # the end, for every later call too
                raise EngineDied(f"engine exited ({self.proc.poll()}); log: {self.log_path}\n{self.tail()}")
            if got["seq"] == seq:
                return got["reply"]
            # an older command's reply, come after that command timed out: not this one's
            self._log.write(f"kvtier engine_proc: dropped the late reply to command {got['seq']}\n")

    def generate(self, prompts, *, sequential: bool = True, **kw) -> list[dict]:
        """Outputs of ``prompts``; ``sequential`` (one request at a time) keeps results bit-comparable."""
        return self.call(op="generate", prompts=prompts, sequential=sequential, **kw)["outputs"]

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="quit", timeout=60)
            except (EngineDied, BrokenPipeError, OSError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)   # it reads stdout to its end, writing to the log
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):   # stdin: a flush into a dead child
                pipe.close()
        self._log.close()


# -- the child ------------------------------------------------------------------------------
def reply(seq: int, obj) -> None:
    """Answer command ``seq`` (0: the ready reply)."""
    sys.stdout.write(MARK + json.dumps({"seq": seq, "reply": obj}) + "\n")
    sys.stdout.flush()


def build(settings: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    engine_args = dict(settings.get("engine_args", {}))
    if settings.get("kv_events") is not None:
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(**settings["kv_events"])
    if settings.get("force_prefix_caching"):
        _keep_prefix_caching()
        engine_args.setdefault("distributed_executor_backend", "uni")   # the patch must reach the worker
    if settings.get("transfer") is not None:
        transfer = KVTransferConfig(**settings["transfer"])
    elif settings.get("extra") is not None:
        transfer = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role=settings.get("role", "kv_both"),
            kv_connector_extra_config=settings["extra"],
        )
    return LLM(
        model=settings["model"],
        dtype=settings.get("dtype", "float32"),
        enforce_eager=True,
        block_size=PAGE_TOKENS,
        max_model_len=settings.get("max_model_len", 2048),
        max_num_batched_tokens=settings.get("max_num_batched_tokens", settings.get("max_model_len", 2048)),
        seed=0,
        kv_transfer_config=transfer,
        enable_prefix_caching=settings.get("prefix_caching", True),
        **({"num_gpu_blocks_override": settings["kv_pages"]} if settings.get("kv_pages") else {}),
        **engine_args,
    )


def _keep_prefix_caching() -> None:
    """vLLM's CPU platform turns prefix caching off for latent-attention (MLA) models; keep it on
    in this process, so that a test has vLLM's own hit to compare a kvtier hit with."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    platform.check_and_update_config = classmethod(check_and_update_config)


def generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    prompts = []
    for ids in cmd["prompts"]:
        prompt = {"prompt_token_ids": ids}
        if cmd.get("cache_salt"):
            prompt["cache_salt"] = cmd["cache_salt"]
        prompts.append(prompt)
    params = []
    transfer = cmd.get("kv_transfer_params") or [None] * len(prompts)
    for extra in transfer:
        params.append(SamplingParams(
            max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=5, ignore_eos=True,
            extra_args={"kv_transfer_params": extra} if extra else None,
        ))
    lora = _lora_request(cmd.get("lora"))
    start = time.perf_counter()
    if cmd.get("sequential"):
        # One request at a time: batch composition changes float rounding in the
        # decode GEMMs, which would blur a comparison of cached and uncached runs.
        outs = [llm.generate([p], [sp], use_tqdm=False, lora_request=lora)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - start
    results = []
    for out in outs:
        completion = out.outputs[0]
        results.append({
            "token_ids": list(completion.token_ids),
            "logprobs": [sorted([tid, lp.logprob] for tid, lp in step.items()) for step in completion.logprobs or []],
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
        })
    return {"outputs": results, "seconds": elapsed}


def _lora_request(spec: dict | None):
    """vLLM's LoRARequest of a command's ``lora`` (``{"name", "id", "path"}``); None: the base model."""
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(spec["name"], spec["id"], spec["path"])


def _params(max_tokens: int, *, delta: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE)


def ttft(llm, cmd: dict) -> dict:
    """One prompt, stepped by hand so that the first token's time is seen (``LLM.generate``
    returns only when all ``max_tokens`` are done). Same fields as :func:`generate`."""
    engine = llm.llm_engine
    req_id = f"ttft-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": cmd["prompt"]}, _params(cmd.get("max_tokens", 4)))
    first = None
    final = None
    steps = []  # wall time of each engine step until the first token: where a TTFT goes
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outs = engine.step()
        if first is None:
            steps.append(round(time.perf_counter() - step_start, 5))
        for out in outs:
            if out.request_id != req_id:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    completion = final.outputs[0]
    return {
        "ttft_s": first,
        "seconds": elapsed,
        "steps_s": steps,
        "token_ids": list(completion.token_ids),
        "logprobs": [sorted([tid, lp.logprob] for tid, lp in step.items()) for step in completion.logprobs or []],
        "num_cached_tokens": final.num_cached_tokens,
        "kv_transfer_params": final.kv_transfer_params,
    }


def replay(llm, cmd: dict) -> dict:
    """With ``KVTIER_ENGINE_PROFILE`` set, :func:`profiled_replay` adds where the time went.

    Add ``requests`` (``arrival_s``, ``prompt``, ``max_tokens``) at their arrival times and
    step the engine until all finish. Per request: ``first_token_s`` and ``finish_s`` (from the
    start of the replay), ``cached_tokens`` (vLLM's prefix cache plus a connector's load),
    ``output_tokens``. A request is added no earlier than its arrival; when the engine is busy
    it is added at the next step boundary (as a server's queue would hand it over)."""
    engine = llm.llm_engine
    todo = sorted(enumerate(cmd["requests"]), key=lambda item: item[1]["arrival_s"])
    rows = [{"arrival_s": r["arrival_s"], "prompt_tokens": len(r["prompt"]), "first_token_s": None,
             "finish_s": None, "cached_tokens": None, "output_tokens": 0} for r in cmd["requests"]]
    cpu = os.times()
    start = time.perf_counter()
    nxt, idle = 0, 0.0
    while nxt < len(todo) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(todo) and todo[nxt][1]["arrival_s"] <= now:
            index, req = todo[nxt]
            engine.add_request(str(index), {"prompt_token_ids": req["prompt"]},
                               _params(req["max_tokens"], delta=True))
            nxt += 1
        if not engine.has_unfinished_requests():
            wait = max(0.0, min(0.05, todo[nxt][1]["arrival_s"] - now))
            time.sleep(wait)
            idle += wait
            continue
        for out in engine.step():
            row = rows[int(out.request_id)]
            produced = sum(len(c.token_ids) for c in out.outputs)
            if produced and row["first_token_s"] is None:
                row["first_token_s"] = time.perf_counter() - start
            row["output_tokens"] += produced
            if out.num_cached_tokens is not None:
                row["cached_tokens"] = out.num_cached_tokens
            if out.finished:
                row["finish_s"] = time.perf_counter() - start
    end = os.times()
    # CPU seconds of this process (every thread: the forward's, the connector's) over the replay:
    # what the work cost, less sensitive than wall time to other jobs sharing the cores
    return {"requests": rows, "seconds": time.perf_counter() - start, "idle_s": round(idle, 3),
            "cpu_s": round(end.user + end.system - cpu.user - cpu.system, 3)}


#: connector methods timed by ``KVTIER_ENGINE_PROFILE`` (any KVConnectorBase_V1: kvtier's or LMCache's)
_SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                    "update_connector_output", "request_finished")
_WORKER_CALLS = ("start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors")


def profiled_replay(llm, cmd: dict, profile: str) -> dict:
    """:func:`replay` with where the engine's time went (a diagnostic, not a figure to report).

    ``profile``: ``steps`` adds ``profile``: per engine step its wall time and the tokens it
    scheduled (prefill: requests given more than one token; decode: one), summed by kind of
    step, and the time spent inside each connector method; any other value is also a file
    prefix: the replay's cProfile is written to ``<prefix>-<n>.prof``.
    """
    import cProfile

    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    timed: dict[str, list] = {}
    originals = []

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        acc = timed.setdefault(label, [0, 0.0])

        def timed_call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += 1
                acc[1] += time.perf_counter() - t

        setattr(obj, name, timed_call)
        originals.append((obj, name))

    scheduled: list[dict] = []
    wrap_schedule = scheduler.schedule

    def schedule(*a, **kw):
        out = wrap_schedule(*a, **kw)
        tokens = dict(out.num_scheduled_tokens)
        # what a prefill chunk attends to besides itself (a prefix hit, an earlier chunk): the
        # attention part of its cost, which skipping cached tokens does not remove
        context = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        context += list(zip(cached.req_ids, cached.num_computed_tokens))
        prefill_context = sum(n for req, n in context if tokens.get(req, 0) > 1)
        running, waiting = scheduler.get_request_counts()
        scheduled.append((tokens, prefill_context, running, waiting, round(scheduler.get_kv_cache_usage(), 3)))
        return out

    scheduler.schedule = schedule
    originals.append((scheduler, "schedule"))
    if getattr(scheduler, "connector", None) is not None:
        for name in _SCHEDULER_CALLS:
            wrap(scheduler.connector, name, f"scheduler.{name}")
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            for name in _WORKER_CALLS:
                wrap(get_kv_transfer_group(), name, f"worker.{name}")
    except ImportError:
        pass
    steps = []
    step = llm.llm_engine.step

    def timed_step():
        before = len(scheduled)
        t = time.perf_counter()
        out = step()
        wall = time.perf_counter() - t
        tokens, context, running, waiting, usage = scheduled[before] if len(scheduled) > before else ({}, 0, 0, 0, 0.0)
        steps.append((wall, sum(n for n in tokens.values() if n > 1), sum(n for n in tokens.values() if n == 1),
                      context, running, waiting, usage))
        return out

    llm.llm_engine.step = timed_step
    prof = cProfile.Profile() if profile != "steps" else None
    cpu_before = _thread_cpu()
    try:
        if prof:
            prof.enable()
        result = replay(llm, cmd)
    finally:
        if prof:
            prof.disable()
        del llm.llm_engine.step
        for obj, name in originals:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
    cpu_after = _thread_cpu()
    if prof:
        global _PROFILES
        _PROFILES += 1
        prof.dump_stats(f"{profile}-{_PROFILES}.prof")
    kinds = {"prefill": [0, 0.0, 0], "mixed": [0, 0.0, 0], "decode": [0, 0.0, 0], "empty": [0, 0.0, 0]}
    for wall, pre, dec, *_ in steps:
        kind = "mixed" if pre and dec else "prefill" if pre else "decode" if dec else "empty"
        kinds[kind][0] += 1
        kinds[kind][1] += wall
        kinds[kind][2] += pre
    result["profile"] = {
        "steps": len(steps), "step_s": round(sum(s[0] for s in steps), 3),
        "prefill_tokens": sum(s[1] for s in steps), "decode_tokens": sum(s[2] for s in steps),
        "by_kind": {k: {"steps": n, "s": round(s, 3), "prefill_tokens": p} for k, (n, s, p) in kinds.items()},
        "connector": {k: {"calls": n, "s": round(s, 4)} for k, (n, s) in sorted(timed.items())},
        # every step: what bounds the engine (time against tokens, KV use, queue) is read off these
        "per_step_fields": ["wall_s", "prefill_tokens", "decode_tokens", "prefill_context_tokens", "running",
                            "waiting", "kv_usage"],
        "per_step": [[round(s[0], 4), *s[1:]] for s in steps],
        "thread_cpu_s": {name: round(cpu - cpu_before.get(name, 0.0), 3) for name, cpu in sorted(cpu_after.items())
                         if cpu - cpu_before.get(name, 0.0) > 0.005},
    }
    return result


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}  # Python names (the OS sees "python")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(task.name)) or "other:" + stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = name.rstrip("0123456789_-") or name  # a pool's threads under one name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


_PROFILES = 0


def stats(llm) -> dict:
    result = {}
    try:
        core = llm.llm_engine.engine_core.engine_core
        result["scheduler"] = core.scheduler.connector.stats()
    except AttributeError as exc:
        result["scheduler_error"] = str(exc)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        result["worker"] = get_kv_transfer_group().stats()
    except Exception as exc:  # noqa: BLE001
        result["worker_error"] = str(exc)
    return result


def main() -> int:
    for name, value in CHILD_ENV.items():
        os.environ.setdefault(name, value)
    settings = json.loads(sys.argv[1])
    if settings.get("hide_amx"):
        # a host without AMX tiles (the CPU kernels' other page layout: cpu_pages), on one with them
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False
    llm = build(settings)
    reply(0, {"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op, seq = cmd["op"], cmd.get("seq", 0)
        if op == "generate":
            reply(seq, generate(llm, cmd))
        elif op == "ttft":
            reply(seq, ttft(llm, cmd))
        elif op == "replay":
            profile = os.environ.get("KVTIER_ENGINE_PROFILE")
            reply(seq, profiled_replay(llm, cmd, profile) if profile else replay(llm, cmd))
        elif op == "reset":
            # connector: also reset the connector's cache, as vLLM's reset_prefix_cache?reset_external
            # and its cache clearing on a weight update do
            ok = llm.reset_prefix_cache(reset_connector=True) if cmd.get("connector") else llm.reset_prefix_cache()
            reply(seq, {"ok": ok})
        elif op == "stats":
            reply(seq, stats(llm))
        elif op == "flush":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            connector = get_kv_transfer_group()
            worker = getattr(connector, "worker", None)
            if worker is not None:
                worker.flush()
                connector.store.flush_dirty(cmd.get("timeout_s", 60.0))  # write-behind copies landed too
            reply(seq, {"ok": True})
        elif op == "clear_store":
            # Test hook: empty kvtier's tiers while vLLM's own prefix cache keeps its pages.
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            store = get_kv_transfer_group().store
            store.flush_dirty(60.0)
            keys = {k for tier in store.tiers for k in tier.keys()}
            reply(seq, {"ok": True, "deleted": store.delete(list(keys))})
        elif op == "break_loads":
            # Test hook: lookups still hit, every read fails (a tier that dies between the two).
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            from kvtier.store.tiered import GetResult
            from kvtier.tiers.base import Status

            connector = get_kv_transfer_group()
            connector.worker.direct_host = None  # every read through store.get, failing below
            store = connector.store
            store.get = lambda keys, outs, **kw: GetResult([Status.ERROR] * len(keys), [None] * len(keys), 0)
            reply(seq, {"ok": True})
        elif op == "kill_on_next_load":
            # Test hook: the next store read first SIGKILLs process ``pid`` (a kvtier server), so
            # the scheduler's lookup saw the server alive and the worker's load finds it dead.
            import signal

            from vllm.distributed.kv_transfer import get_kv_transfer_group

            store = get_kv_transfer_group().store
            original, pid = store.get, cmd["pid"]

            def get(keys, outs, **kw):
                store.get = original
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)  # let the kernel close its sockets
                return original(keys, outs, **kw)

            store.get = get
            reply(seq, {"ok": True})
        elif op == "skip_load_copies":
            # Test hook: a broken load that reads and verifies blocks, reports them loaded and
            # writes no page (what poisoning must catch).
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().worker.paged.scatter = lambda src, transfer: None
            reply(seq, {"ok": True})
        elif op == "fix_loads":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            from kvtier.integrations.vllm.worker_side import direct_host_tier

            connector = get_kv_transfer_group()
            vars(connector.store).pop("get", None)
            vars(connector.worker.paged).pop("scatter", None)
            connector.worker.direct_host = direct_host_tier(connector.store)
            reply(seq, {"ok": True})
        elif op == "quit":
            reply(seq, {"ok": True})
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
