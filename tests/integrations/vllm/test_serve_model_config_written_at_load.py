"""``vllm serve`` of a model whose vLLM code writes its config while the worker loads it still hits.

The connector's keys start from a format tag that digests the model config vLLM runs (so that
engines computing other KV never share keys). ``vllm serve`` runs the scheduler and the worker
in two processes, each with its own copy of the config, and vLLM's Falcon code sets
``num_ln_in_parallel_attn`` (None in the file, 2 for the new decoder architecture) in the
worker's copy as it builds the model: the scheduler's tag then named another root than the
worker's saves, and every lookup missed. The worker now tells the scheduler its tag (vLLM's
connector handshake, ``KvtierHandshake``) and lookups follow it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integrations.vllm.harness import skip_without_vllm
from tests.integrations.vllm.test_serve import _post, _text, start_vllm_serve, stop_vllm_serve

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def falcon(tmp_path_factory) -> str:
    from transformers import FalconConfig

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=5)
    out = tmp_path_factory.mktemp("falcon")
    build_model(spec, out, config_class=FalconConfig, new_decoder_architecture=True, num_kv_heads=2,
                parallel_attn=True, bias=False, alibi=False)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["num_ln_in_parallel_attn"] = None   # as many Falcon checkpoints have it: vLLM sets it at load
    path.write_text(json.dumps(config))
    return str(out)


KVTIER = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
          "kv_role": "kv_both", "kv_connector_extra_config": {"block_tokens": 64, "host_bytes": "64MiB"}}
#: kvtier as vLLM's MultiConnector's only sub-connector: MultiConnector hands on one sub-connector's
#: handshake, and kvtier's goes when no other has one (regression audit s28 K1: it declined)
MULTI = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [KVTIER]}}


TRANSFERS = {"kvtier": KVTIER, "multiconnector": MULTI}


@pytest.fixture(scope="module")
def served(falcon, tmp_path_factory) -> dict[str, tuple]:
    """A ``vllm serve`` of ``falcon`` per transfer config, started side by side: each start-up is
    mostly imports in three processes, ~30 s, and the two parameters paid them one after the
    other. Each engine has its own store (a host tier in its own process): no test sees the
    other's blocks. Stopped at the module's end, side by side too (each takes seconds)."""
    logs = tmp_path_factory.mktemp("vllm-serve")

    def start(name: str) -> tuple:
        log_path = logs / f"{name}.log"
        return (*start_vllm_serve(falcon, TRANSFERS[name], log_path, timeout_s=300), log_path)

    with ThreadPoolExecutor(len(TRANSFERS)) as pool:
        futures = {name: pool.submit(start, name) for name in TRANSFERS}
    up = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()   # a start-up's failure (pytest.fail with its log) fails the tests
        yield up
    finally:
        with ThreadPoolExecutor(len(TRANSFERS)) as pool:
            list(pool.map(stop_vllm_serve, [proc for proc, *_ in up.values()]))


@pytest.mark.parametrize("transfer", list(TRANSFERS))
def test_a_model_whose_config_vllm_writes_at_load_is_reloaded_from_kvtier(falcon, served, transfer):
    _, base, log_path = served[transfer]
    body = {"model": falcon, "prompt": _text(300, seed=7), "max_tokens": 8, "temperature": 0}
    first = _post(base + "/v1/completions", body)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 256 and first["kv_transfer_params"]["kvtier_loaded_tokens"] == 0
    time.sleep(0.5)  # the connector's writes are asynchronous
    _post(base + "/reset_prefix_cache")
    second = _post(base + "/v1/completions", body)
    loaded = second["kv_transfer_params"]["kvtier_loaded_tokens"]
    assert loaded == min(prompt_tokens // 64 * 64, (prompt_tokens - 2) // 32 * 32) > 0, \
        "the scheduler's lookups missed what the worker saved"
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # Positive control of the premise: the tags differed, and the scheduler followed the worker's.
    assert "lookups follow the worker's keys" in log_path.read_text()
