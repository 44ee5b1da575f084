"""Decode or prefill context parallelism is refused, naming the flag.

With either, each of vLLM's scheduler block ids stands for ``block_size`` tokens times the
context-parallel size, while kvtier maps tokens to block ids by ``block_size``: a block's save
would gather the pages of tokens past it (not computed yet) under its key. vLLM's own
configuration objects for the KV cache; no engine.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, engine_kv  # noqa: E402
from tests.integrations.vllm.test_integration_hostile import _kv_cache_config, _layers, _vllm_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _engine_kv(**parallel):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    vllm_config = _vllm_config()
    for setting, size in parallel.items():
        setattr(vllm_config.parallel_config, setting, size)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    return engine_kv(ConnectorConfig(block_tokens=256), vllm_config, _kv_cache_config(spec, _layers(range(2))))


@pytest.mark.parametrize("setting, flag", [
    ("decode_context_parallel_size", "--decode-context-parallel-size 2"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size 2"),
])
def test_context_parallelism_is_refused_naming_its_flag(setting, flag):
    with pytest.raises(ConfigError, match=f"does not support context parallelism \\({flag}\\)"):
        _engine_kv(**{setting: 2})


def test_context_parallel_size_one_is_accepted():
    engine = _engine_kv(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    assert engine.page_tokens == 16
