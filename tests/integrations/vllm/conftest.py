"""Fixtures of the real-vLLM tests (each test module skips itself where vLLM is not installed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integrations.vllm.harness import Engine


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """A random-weight Llama and a locally trained tokenizer (nothing from a hub), built once."""
    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model

    spec = VLLM_TEST_SPEC   # head_dim 32: the smallest vLLM's CPU attention takes
    return str(ensure_model(spec)[0])


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Start engines (several at once, to overlap their start-up); all stopped at the module's end."""
    started: list[Engine] = []
    logs = tmp_path_factory.mktemp("engine-logs")

    def start(name: str, settings: dict, **kw) -> Engine:
        engine = Engine(settings, logs / f"{name}.log", **kw)
        started.append(engine)
        return engine

    yield start
    # Closed side by side: each waits seconds on its child's shutdown, and a module of many
    # engines (test_architectures) spent ~40 s closing them one after another.
    with ThreadPoolExecutor(max(1, len(started))) as pool:
        list(pool.map(Engine.close, started))
