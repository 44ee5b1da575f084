"""Block keys follow the computation vLLM runs, not only the model path: engine settings that
change the KV of a token sequence (``--hf-overrides`` of RoPE, the model dtype under an fp8 KV
cache, ``--quantization``) give other keys, and settings that change no KV (``max_model_len``,
``gpu_memory_utilization``, another host's copy of the files) give the same.

The config tests build vLLM's own ``VllmConfig`` (``EngineArgs.create_engine_config``), no
engine; the last test runs engines on one shared disk tier.
"""
from __future__ import annotations

import json
import shutil
import types

import pytest

from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

HASHES = [bytes([i]) * 32 for i in range(3)]
ROPE_THETA_1000 = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
YARN_X4 = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                               "rope_theta": 10000.0}}


def _vllm_config(model: str, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    settings = {"dtype": "float32", "block_size": 32, "max_model_len": 2048, "enforce_eager": True, **engine_args}
    return EngineArgs(model=model, **settings).create_engine_config()


def _engine_kv(model: str, connector: dict | None = None, **engine_args):
    """vLLM's configuration of an engine, and the connector's ``EngineKV`` for it (the KV cache
    config vLLM would hand the connector: one full-attention group, 32-token pages)."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.config import ConnectorConfig, engine_kv

    vllm_config = _vllm_config(model, **engine_args)
    hf = vllm_config.model_config.hf_text_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    assert isinstance(kv_dtype, torch.dtype)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.hidden_size // hf.num_attention_heads, dtype=kv_dtype)
    group = types.SimpleNamespace(kv_cache_spec=spec,
                                  layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)])
    kv_cache_config = types.SimpleNamespace(kv_cache_groups=[group], hash_block_size=32, kv_cache_layout="NHD")
    return vllm_config, engine_kv(ConnectorConfig(block_tokens=32, **(connector or {})), vllm_config, kv_cache_config)


@pytest.mark.parametrize("override", [YARN_X4, ROPE_THETA_1000], ids=["yarn-rope-scaling", "rope-theta"])
def test_an_engine_whose_rope_is_overridden_does_not_share_keys_with_one_that_is_not(tiny_model, override):
    plain_cfg, plain = _engine_kv(tiny_model)
    over_cfg, over = _engine_kv(tiny_model, hf_overrides=override)
    # control: the override reached the model vLLM runs (its rotary embedding differs)
    a, b = plain_cfg.model_config.hf_text_config, over_cfg.model_config.hf_text_config
    assert a.rope_parameters != b.rope_parameters, "control: the override changed the model's rotary embedding"
    assert plain.keys(HASHES) != over.keys(HASHES), \
        "engines computing different K for the same tokens share block keys: each loads the other's KV"


@pytest.mark.parametrize("setting", [{"max_model_len": 1024}, {"gpu_memory_utilization": 0.5},
                                     {"hf_overrides": {"use_cache": False}}],
                         ids=["max-model-len", "gpu-memory-utilization", "override-of-no-kv-field"])
def test_settings_that_change_no_kv_keep_the_keys(tiny_model, setting):
    _, plain = _engine_kv(tiny_model)
    _, other = _engine_kv(tiny_model, **setting)
    assert plain.keys(HASHES) == other.keys(HASHES)


def test_the_same_files_on_another_host_share_keys(tiny_model, tmp_path):
    """Another host: the same weights and config at another path, written by another
    transformers version (its version stamp, the dtype spelled ``torch_dtype``). With the same
    ``model_id`` (the path is the default one) both engines key alike."""
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "4.57.1"
    config["torch_dtype"] = config.pop("dtype", config.get("torch_dtype", "float32"))
    (copy / "config.json").write_text(json.dumps(config))
    here_cfg, here = _engine_kv(tiny_model, {"model_id": "org/tiny-llama"})
    there_cfg, there = _engine_kv(str(copy), {"model_id": "org/tiny-llama"})
    # control: vLLM read each copy from its own path
    assert here_cfg.model_config.hf_config._name_or_path != there_cfg.model_config.hf_config._name_or_path
    assert here.keys(HASHES) == there.keys(HASHES)


def test_the_model_dtype_under_an_fp8_kv_cache_and_quantization_change_the_keys(tiny_model):
    """Pages of an fp8 KV cache are fp8 whatever dtype computed them, and ``--quantization fp8``
    reads the same bfloat16 files: the page geometry is the same, the KV is not. (On a CPU the
    page format also names the model dtype; on a GPU only the computation digest does.)"""
    from kvtier.integrations.vllm.config import model_computation_digest

    half, bf16 = (_vllm_config(tiny_model, dtype=d, kv_cache_dtype="fp8") for d in ("float16", "bfloat16"))
    assert model_computation_digest(half) != model_computation_digest(bf16)
    plain_cfg, plain = _engine_kv(tiny_model, dtype="bfloat16")
    quant_cfg, quant = _engine_kv(tiny_model, dtype="bfloat16", quantization="fp8")
    assert model_computation_digest(plain_cfg) != model_computation_digest(quant_cfg)
    assert plain.keys(HASHES) != quant.keys(HASHES)


def test_the_digest_is_the_same_for_a_copy_of_the_configuration(tiny_model):
    """The scheduler and each worker compute the keys from their own copy of vLLM's
    configuration (a worker process gets it pickled): the digest must come out the same."""
    import pickle

    from kvtier.integrations.vllm.config import model_computation_digest

    config = _vllm_config(tiny_model, hf_overrides=YARN_X4)
    assert model_computation_digest(pickle.loads(pickle.dumps(config))) == model_computation_digest(config)


@pytest.mark.timeout(400)
def test_an_engine_with_another_rope_theta_never_loads_the_kv_of_one_without(engines, tiny_model, tmp_path):
    """End to end, through a shared disk tier: engine A (the model as saved) computes and saves
    prompts. C (the same model, another ``max_model_len``) loads them, as A computed them. B runs
    the same model path with ``--hf-overrides '{"rope_parameters": {"rope_theta": 1000}}'``: it
    must not load A's blocks (they hold K rotated with another theta) and answers as its own
    recompute does."""
    batch = prompts(2, 300, seed=21)
    extra = {"block_tokens": 32, "host_bytes": "64MiB", "disk_path": str(tmp_path / "shared")}
    override = {"engine_args": {"hf_overrides": ROPE_THETA_1000}}
    # All four start side by side (their start-ups, not their requests, were most of this
    # test's minute, one after another). The disk tier is shared by directory: C and B look a
    # block up on disk when their own index misses it, so each sees what A flushed before it runs.
    a = engines("rope-a", {"model": tiny_model, "extra": extra})
    c = engines("rope-c-shorter", {"model": tiny_model, "extra": extra, "max_model_len": 1024})
    ref_engine = engines("rope-b-plain", {"model": tiny_model, "extra": None, **override})
    b = engines("rope-b-kvtier", {"model": tiny_model, "extra": extra, **override})
    for engine in (a, c, ref_engine, b):
        engine.wait_ready()
    mine = a.generate(batch, max_tokens=8)
    a.call(op="flush")
    same = c.generate(batch, max_tokens=8)
    for prompt, x, y in zip(batch, mine, same):
        assert loaded_tokens(y) == expected_hit(len(prompt), 32) > 0, "an engine of the same computation shares keys"
        assert y["token_ids"] == x["token_ids"] and y["logprobs"] == x["logprobs"]
    ref = ref_engine.generate(batch, max_tokens=8)
    assert [o["logprobs"] for o in ref] != [o["logprobs"] for o in mine], "control: the override changes the model"
    got = b.generate(batch, max_tokens=8)
    worst = max(abs(x - y) for o, r in zip(got, ref) for s, t in zip(o["logprobs"], r["logprobs"])
                for (_, x), (_, y) in zip(s, t))
    loaded = [loaded_tokens(o) for o in got]
    assert loaded == [0, 0] and worst < 1e-4, \
        f"B loaded {loaded} tokens of A's KV (another rope_theta): logprobs off its recompute by {worst}"
