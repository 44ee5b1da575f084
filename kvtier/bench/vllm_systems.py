"""The systems ``kvtier bench vllm`` puts side by side: engine settings and the servers behind them.

Each engine runs in its own process (:class:`~kvtier.integrations.vllm.engine_proc.EngineProcess`:
vLLM keeps its connector in a process-wide global). Servers are real subprocesses:
``kvtier serve`` for kvtier's remote tier, ``lmcache server`` for LMCache's
multiprocess connector (its in-process connector has no CPU path: it silently
recomputes, see ../shared/notes/vllm-on-cpu.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from kvtier.child_process import die_with_parent

TOKEN = "kvtier-bench-token"
#: what LMCache needs beside the engine; absent: the bench reports ``lmcache: null`` and why
LMCACHE_INSTALL = "make install-lmcache (pip install --no-deps lmcache==0.5.6 sortedcontainers aiofile)"


class Unavailable(Exception):
    """A system that cannot run here; its message is the reason reported."""


def model_spec(name: str, positions: int):
    """The locally built random model of ``name`` with at least ``positions`` positions: a Llama,
    or (``deepseek``) a DeepSeek-V2 of the demo model's size with multi-head latent attention."""
    from kvtier.integrations.transformers.models import DEMO_SPEC, ModelSpec

    if name == "demo":
        spec = DEMO_SPEC  # the model of `kvtier demo`
    elif name == "deepseek":
        from kvtier.integrations.vllm.engine_proc import latent_attention_host

        # rank 512 + RoPE 64: the one latent width vLLM's CPU kernels take; in the weight dtype of
        # the backend vLLM picks here (AMX_MLA, on a CPU with AMX, takes bfloat16 only)
        spec = replace(DEMO_SPEC, num_attention_heads=8, num_key_value_heads=8, latent_rank=512,
                       dtype=latent_attention_host()["dtype"])
    else:
        spec = ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=2048, max_position_embeddings=8192)
    if positions > spec.max_position_embeddings:
        # Positions change only the config (RoPE has no weights): another model directory.
        spec = replace(spec, max_position_embeddings=1 << (positions - 1).bit_length())
    return spec


def geometry(spec) -> dict:
    """What a reader needs to compare figures: layers, heads, KV bytes per token."""
    preset = asdict(spec)
    preset["kv_bytes_per_token"] = spec.kv_bytes_per_token
    if not spec.latent_rank:
        preset.pop("latent_rank")
    preset.pop("seed", None)
    return preset


def kvtier_extra(block_tokens: int, **store) -> dict:
    return {"block_tokens": block_tokens, **store}


def lmcache_settings(base: dict, port: int, *, prefix_caching: bool) -> dict:
    return {
        **base,
        "transfer": {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port},
        },
        "prefix_caching": prefix_caching,
        "engine_args": {"disable_hybrid_kv_cache_manager": True},
    }


LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false"}  # it reports usage home by default


@contextlib.contextmanager
def lmcache_server(workdir: Path, *, chunk_tokens: int, l1_gib: int, pids: list[int] | None = None):
    """A running ``lmcache server``; yields its port (and appends its pid to ``pids``, for
    its CPU time). Raises :class:`Unavailable` when LMCache is not installed or the server
    does not start."""
    if importlib.util.find_spec("lmcache") is None:
        raise Unavailable(f"LMCache is not installed ({LMCACHE_INSTALL})")
    launcher = Path(sys.executable).with_name("lmcache")
    if not launcher.exists():
        raise Unavailable(f"the lmcache command is not installed beside {sys.executable}")
    port, http_port = free_port(), free_port()
    log_path = workdir / "lmcache-server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(launcher), "server", "--port", str(port), "--http-port", str(http_port),
             "--l1-size-gb", str(l1_gib), "--chunk-size", str(chunk_tokens),
             "--supported-transfer-mode", "auto", "--eviction-policy", "LRU", "--disable-observability"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **LMCACHE_ENV}, preexec_fn=die_with_parent,
        )
        try:
            if not wait_port(port, 120, server):
                raise Unavailable(f"lmcache server did not listen (see {log_path})")
            if pids is not None:
                pids.append(server.pid)
            yield port
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def memcpy_s(nbytes: int) -> float:
    """Best of 5 copies of ``nbytes`` between prefaulted buffers: the floor of any load."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # written once: no page faults inside the timing
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return round(best, 5)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far; 0.0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.5)
    return False


def reset(engine) -> None:
    """vLLM's prefix cache emptied, or the bench stops: a reset that silently failed would
    turn a 'recompute' or a kvtier load into a local prefix-cache hit."""
    ok = engine.call(op="reset", timeout=120)["ok"]
    if ok is not True:
        raise RuntimeError(f"vLLM refused to reset its prefix cache (log: {engine.log_path})")
