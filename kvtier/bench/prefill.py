"""``kvtier bench prefill``: prefill seconds against prompt tokens on this machine.

Builds a random-weight Llama locally with transformers (``LlamaConfig`` +
``LlamaForCausalLM``, nothing from a hub), times a forward pass over prompts of each
length, fits the prefill cost model (overhead + linear FLOPs + quadratic attention
FLOPs) and writes the table as a calibration profile the planner and the simulator
read (``--calibration FILE``, or ship it as ``kvtier/data/prefill_<accelerator>.json``).
torch and transformers are imported inside the command only.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from kvtier.json_files import strict_json


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def register(subparsers) -> None:
    parser = subparsers.add_parser("prefill", help="measure prefill seconds vs tokens; write a calibration profile")
    parser.add_argument("--tokens", type=_ints, default=[128, 256, 512, 1024, 2048],
                        help="comma-separated prompt lengths")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per length; the fastest counts")
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    parser.add_argument("--accelerator", default=None, help="name to file the profile under (default: the device)")
    parser.add_argument("--output", default=None, help="profile path (default: ./prefill_<accelerator>.json)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.set_defaults(func=run)


def _memory_bandwidth(size_bytes: int = 64 << 20) -> float:
    """Bytes a second one copy moves (read + write), the best of three: the decode model's HBM."""
    import numpy as np

    src = np.ones(size_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * size_bytes / best


def measure(model_config: dict, tokens: list[int], repeat: int, device: str) -> tuple[list[tuple[int, float]], dict]:
    """Fastest of ``repeat`` forward passes per prompt length, and what ran them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = LlamaConfig(**model_config, max_position_embeddings=max(tokens) * 2)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    points = []
    with torch.inference_mode():
        warm = torch.randint(0, model_config["vocab_size"], (1, min(tokens)), device=device)
        model(input_ids=warm, use_cache=True, logits_to_keep=1)
        for n in tokens:
            ids = torch.randint(0, model_config["vocab_size"], (1, n), device=device)
            best = float("inf")
            for _ in range(repeat):
                sync()
                start = time.perf_counter()
                # logits for the last position only, as a serving engine's prefill does
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                sync()
                best = min(best, time.perf_counter() - start)
            points.append((n, best))
    return points, {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": str(dtype)}


def _model_problem(args) -> str | None:
    """Why the model flags cannot build a Llama, or None: said before the measurement, which a bad
    one ended in a traceback (a division by zero heads, a tensor shape, transformers' own check)."""
    sizes = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads, "--kv-heads": args.kv_heads,
             "--intermediate": args.intermediate, "--vocab": args.vocab, "--repeat": args.repeat}
    small = [f"{flag} {value}" for flag, value in sizes.items() if value < 1]
    if small:
        return f"sizes are at least 1; got {', '.join(small)}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} must be a multiple of --heads {args.heads} (each head gets hidden/heads dims)"
    if args.heads % args.kv_heads:
        return f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads} (heads share KV heads in groups)"
    return None


def _output_problem(path: Path) -> str | None:
    """Why the profile cannot be written to ``path``, or None: checked before the measurement,
    which may take minutes, not after it."""
    parent = path.parent
    if path.is_dir():
        return f"--output {path} is a directory; give a file path"
    if path.exists():  # (only a file to create needs a writable directory: /dev/null lives in /dev)
        return None if os.access(path, os.W_OK) else f"--output {path} is not writable"
    if not parent.is_dir():
        return f"--output {path}: its directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--output {path}: its directory {parent} is not writable"
    return None


def _device_problem(device: str) -> str | None:
    """Why torch cannot place a tensor on ``device`` (a name it does not know, a backend it was
    built without), or None."""
    import torch

    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError) as exc:   # torch asserts "not compiled with CUDA enabled"
        return f"--device {device!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


def run(args) -> int:
    from kvtier.planner.costmodel import CalibrationTable, fit_rates

    lengths = sorted(set(args.tokens))
    if len(lengths) < 3 or lengths[0] < 1:
        # counted without repeats: --tokens 32,32,32 fitted three rates to one point and wrote the
        # profile the planner and the simulator read as this machine's prefill cost
        print(f"kvtier bench prefill: give at least 3 distinct --tokens lengths, each at least 1 (the fit has "
              f"3 terms); got {','.join(map(str, args.tokens))}", file=sys.stderr)
        return 2
    accelerator = args.accelerator or args.device.split(":")[0]
    path = Path(args.output or f"prefill_{accelerator}.json")
    problem = _model_problem(args) or _output_problem(path) or _device_problem(args.device)
    if problem:
        print(f"kvtier bench prefill: {problem}", file=sys.stderr)
        return 2
    model_config = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                        vocab_size=args.vocab)
    points, runtime = measure(model_config, lengths, args.repeat, args.device)
    extra = {**runtime, "host": platform.node(),
             "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
             "cpus": os.cpu_count(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.device == "cpu":
        extra["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        extra["memory_bytes_per_s"] = _memory_bandwidth()
    table = CalibrationTable(accelerator, 1, model_config, tuple(points),
                             source=f"kvtier bench prefill on {platform.node()} ({args.device}, random-weight Llama"
                                    f" {args.layers}x{args.hidden})", extra=extra)
    fit = fit_rates(table)
    profile = table.to_json()
    profile["fit"] = fit._asdict()
    path.write_text(json.dumps(profile, indent=1) + "\n")
    if args.json:
        print(strict_json(profile))
        return 0
    for n, seconds in points:
        print(f"{n:>7} tokens  {seconds * 1000:9.1f} ms  {n / seconds:10.0f} tokens/s")
    print(f"fit: overhead {fit.overhead_s * 1000:.1f} ms, linear {fit.linear_flops_per_s / 1e9:.1f} GFLOP/s,"
          f" attention {fit.attention_flops_per_s / 1e9:.1f} GFLOP/s, worst point off by {fit.max_relative_error:.1%}")
    print(f"wrote {path}")
    return 0
