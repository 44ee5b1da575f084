"""``kvtier bench <what>``: benchmarks that print ratios against limits measured in the same run.

Each benchmark is a module under :mod:`kvtier.bench` with ``register(subparsers)``;
this module only groups them under ``bench``.
"""

from __future__ import annotations

import importlib

BENCH_MODULES = [
    "kvtier.bench.storage",
    "kvtier.bench.lookup",
    "kvtier.bench.prefill",
    "kvtier.bench.remote",
    "kvtier.bench.server_memory",
    "kvtier.bench.vllm",
    "kvtier.bench.restart",
    "kvtier.bench.route",
]


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (print JSON with --json)")
    sub = parser.add_subparsers(dest="bench", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(sub)
