"""Block keys follow what vLLM computes and only that (``config.model_computation_digest``, the
namespace and the format tag), audit s29 a3:

* LongRoPE's long or short factors, which vLLM picks by ``--max-model-len``, give other keys; the
  RoPE kinds whose rotation does not depend on it keep the keys at any ``--max-model-len``;
* an engine of random weights (``--load-format dummy``) is refused;
* a multimodal model's vision tower and projector settings are digested;
* fields no KV follows (special token ids, training-only settings, ``10000`` vs ``10000.0``,
  another spelling of the KV cache's dtype) keep the keys, except for the models whose vLLM code
  reads them;
* a hub cache's snapshot path (``HF_HUB_OFFLINE=1``) keys as its repository and commit;
* (audit s29 a8 D3) Llama 4's ``attn_temperature_tuning``, which vLLM sets from ``--max-model-len``
  and which changes K and V, gives other keys;
* (audit s29 a11) a torchao scheme named in private fields or in a ``quantization_config_file``, a
  nested ``architectures``, the checkpoint's dtype where the model code computes in it give other
  keys; a placeholder id a worker writes keeps them; weights loaded from elsewhere than the model
  path need ``model_id`` / ``weights_revision``; ``--max-model-len -1`` with a RoPE built from the
  length is refused.

Each builds vLLM's own ``VllmConfig`` (``EngineArgs.create_engine_config``), no engine (the
LLaVA ones a stand-in holding transformers' real ``LlavaConfig``: vLLM cannot build a LLaVA model
config without torchvision).
"""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from tests.integrations.vllm.test_namespace_engine_settings import HASHES, _engine_kv  # noqa: E402

ORIGINAL_CONTEXT = 256   # the Phi-3 LongRoPE model's original_max_position_embeddings


@pytest.fixture(scope="module")
def longrope_model(tiny_model, tmp_path_factory) -> str:
    """A Phi-3 config with LongRoPE (short factors up to 256 positions, long ones to 2048) and the
    tiny model's tokenizer: enough for vLLM's configuration, no weights needed."""
    path = tmp_path_factory.mktemp("phi3-longrope")
    for source in Path(tiny_model).glob("*token*"):
        shutil.copy(source, path / source.name)
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 2048, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_theta": 10000.0,
              "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32",
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _rotated_keys(vllm_config, monkeypatch) -> torch.Tensor:
    """K of 64 positions as the rotary embedding this engine's model code builds rotates them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    hf = vllm_config.model_config.hf_text_config
    head = hf.hidden_size // hf.num_attention_heads
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})   # vLLM memoises get_rope per process
    with set_current_vllm_config(vllm_config):
        rope = rotary_embedding.get_rope(head, max_position=hf.max_position_embeddings,
                                         rope_parameters=hf.rope_parameters, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(64)
    query = torch.randn(64, hf.num_attention_heads * head, generator=generator)
    key = torch.randn(64, hf.num_key_value_heads * head, generator=generator)
    rotate = getattr(rope, "forward_native", rope)   # vLLM's reference path, where the class has one
    return rotate(positions, query, key)[1]


# == D1: what the RoPE takes from --max-model-len ===============================================
def test_longrope_engines_whose_max_model_len_picks_other_factors_do_not_share_keys(longrope_model, monkeypatch):
    """vLLM rotates with the long factors at every position once max_model_len exceeds the original
    context: the same tokens get other K, and must get other keys."""
    short_cfg, short = _engine_kv(longrope_model, max_model_len=ORIGINAL_CONTEXT)
    long_cfg, long = _engine_kv(longrope_model, max_model_len=2048)
    difference = (_rotated_keys(short_cfg, monkeypatch) - _rotated_keys(long_cfg, monkeypatch)).abs().max()
    assert difference > 1e-3, "control: the two engines rotate K differently"
    assert short.keys(HASHES) != long.keys(HASHES)


def test_longrope_engines_whose_max_model_len_picks_the_same_factors_share_keys(longrope_model, monkeypatch):
    a_cfg, a = _engine_kv(longrope_model, max_model_len=128)
    b_cfg, b = _engine_kv(longrope_model, max_model_len=ORIGINAL_CONTEXT)
    assert torch.equal(_rotated_keys(a_cfg, monkeypatch), _rotated_keys(b_cfg, monkeypatch)), "control: same K"
    assert a.keys(HASHES) == b.keys(HASHES)


ROPES_BLIND_TO_MAX_MODEL_LEN = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512, "rope_theta": 10000.0},
    "dynamic-ntk": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", list(ROPES_BLIND_TO_MAX_MODEL_LEN.values()), ids=list(ROPES_BLIND_TO_MAX_MODEL_LEN))
def test_rope_scalings_that_rotate_alike_at_any_max_model_len_keep_the_keys(tiny_model, monkeypatch, rope):
    overrides = {"rope_parameters": rope}
    a_cfg, a = _engine_kv(tiny_model, hf_overrides=overrides, max_model_len=512)
    b_cfg, b = _engine_kv(tiny_model, hf_overrides=overrides, max_model_len=2048)
    assert torch.equal(_rotated_keys(a_cfg, monkeypatch), _rotated_keys(b_cfg, monkeypatch)), "control: same K"
    assert a.keys(HASHES) == b.keys(HASHES)


# == D2: random weights ==========================================================================
def test_an_engine_of_random_weights_is_refused(tiny_model):
    """``--load-format dummy`` runs random weights under the real model's path: its blocks would
    carry the real weights' keys on a shared tier."""
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="load-format dummy"):
        _engine_kv(tiny_model, load_format="dummy")
    _engine_kv(tiny_model, load_format="safetensors")   # control: real weights, another loader


# == D5: a multimodal model's vision settings ===================================================
def _llava_config(**settings):
    """The parts of a LLaVA engine's VllmConfig the digest reads, around transformers' LlavaConfig."""
    from transformers import LlavaConfig

    hf = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048},
                     vision_config={"model_type": "clip_vision_model", "hidden_size": 64, "num_hidden_layers": 3,
                                    "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
                     **settings)
    model = types.SimpleNamespace(hf_config=hf, hf_text_config=hf.get_text_config(), max_model_len=2048,
                                  architecture="LlavaForConditionalGeneration", model_class_overrides=None,
                                  code_revision=None, dtype=torch.bfloat16, quantization=None,
                                  quantization_config=None, disable_sliding_window=False)
    cache = types.SimpleNamespace(sliding_window=None, kv_cache_dtype_skip_layers=[])
    return types.SimpleNamespace(model_config=model, cache_config=cache)


@pytest.mark.parametrize("setting", [{"vision_feature_layer": -1}, {"projector_hidden_act": "relu"},
                                     {"vision_feature_select_strategy": "full"}],
                         ids=["vision-feature-layer", "projector-activation", "feature-select-strategy"])
def test_a_multimodal_model_whose_vision_settings_differ_gets_another_digest(setting):
    """Image tokens, and every token after them, get other K and V; vLLM's block hash of an image
    is its own (pixels, processor kwargs), the same in both engines."""
    from kvtier.integrations.vllm.config import model_computation_digest

    assert model_computation_digest(_llava_config()) == model_computation_digest(_llava_config()), "control"
    assert model_computation_digest(_llava_config()) != model_computation_digest(_llava_config(**setting))


# == D6: what no KV follows ======================================================================
@pytest.mark.parametrize("setting", [
    {"hf_overrides": {"eos_token_id": [1, 2]}},
    {"hf_overrides": {"bos_token_id": 5}},
    {"hf_overrides": {"pad_token_id": 7}},
    {"hf_overrides": {"initializer_range": 0.01}},
    {"hf_overrides": {"attention_dropout": 0.1}},
    {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000}}},
], ids=["eos", "bos", "pad", "initializer-range", "attention-dropout", "integral-rope-theta"])
def test_config_fields_no_kv_follows_keep_the_keys(tiny_model, setting):
    plain_cfg, plain = _engine_kv(tiny_model)
    other_cfg, other = _engine_kv(tiny_model, **setting)
    assert plain_cfg.model_config.hf_text_config.to_json_string() != \
        other_cfg.model_config.hf_text_config.to_json_string(), "control: the override reached vLLM's config"
    assert plain.keys(HASHES) == other.keys(HASHES)


@pytest.mark.parametrize("spellings", [("fp8", "fp8_e4m3"), ("auto", "bfloat16")], ids=["fp8", "auto"])
def test_spellings_of_one_kv_cache_dtype_keep_the_keys(tiny_model, spellings):
    a, b = (_engine_kv(tiny_model, dtype="bfloat16", kv_cache_dtype=d)[1] for d in spellings)
    assert a.keys(HASHES) == b.keys(HASHES)


def test_kv_cache_dtypes_that_differ_still_change_the_keys(tiny_model):
    e4m3, e5m2 = (_engine_kv(tiny_model, dtype="bfloat16", kv_cache_dtype=d)[1] for d in ("fp8_e4m3", "fp8_e5m2"))
    assert e4m3.keys(HASHES) != e5m2.keys(HASHES)


def _digest(hf, architecture: str) -> str:
    """The digest of transformers config ``hf`` run as ``architecture`` (the parts of a VllmConfig
    the digest reads)."""
    from kvtier.integrations.vllm.config import model_computation_digest

    model = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, architecture=architecture, dtype=torch.bfloat16,
                                  quantization=None, max_model_len=2048)
    return model_computation_digest(types.SimpleNamespace(model_config=model, cache_config=types.SimpleNamespace()))


def _llama_digest(architecture: str, **fields) -> str:
    """The digest of a Llama-shaped config run as ``architecture``."""
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2, **fields)
    return _digest(hf, architecture)


@pytest.mark.parametrize("architecture, field, values", [
    ("LongcatFlashNgramForCausalLM", "eos_token_id", (1, 2)),   # its n-gram embedding stops at EOS
    ("HrmTextForCausalLM", "initializer_range", (0.02, 0.01)),  # its embedding scale is 1/initializer_range
], ids=["longcat-ngram-eos", "hrm-initializer-range"])
def test_fields_the_models_vllm_code_reads_stay_in_the_digest(architecture, field, values):
    a, b = (_llama_digest(architecture, **{field: v}) for v in values)
    assert a != b
    assert _llama_digest("LlamaForCausalLM", **{field: values[0]}) == \
        _llama_digest("LlamaForCausalLM", **{field: values[1]}), "control: Llama's code reads neither"


def test_an_architecture_whose_code_cannot_be_read_keeps_every_field():
    """An out-of-tree model (not in vLLM's registry): its code may read anything."""
    assert _llama_digest("NotInVllmForCausalLM", eos_token_id=1) != _llama_digest("NotInVllmForCausalLM",
                                                                                     eos_token_id=2)


# == audit s29 a8 D3: Llama 4's attention temperature tuning ======================================
def test_llama4_engines_with_and_without_attention_temperature_tuning_do_not_share_keys():
    """vLLM's Llama 4 code sets ``attn_temperature_tuning`` as its worker loads the model, on for a
    ``--max-model-len`` over 32768. The NoPE layers' queries are scaled then, which changes their
    output and the K and V of every later layer (measured: a hit across the two settings was 0.0024
    off in a logprob). Engines on either side must not share keys."""
    from transformers import Llama4TextConfig

    def llama4(tuning: bool):
        return Llama4TextConfig(hidden_size=128, intermediate_size=256, intermediate_size_mlp=256,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                num_local_experts=2, num_experts_per_tok=1, no_rope_layers=[0, 1],
                                attention_chunk_size=None, attn_temperature_tuning=tuning)

    on, off = llama4(True), llama4(False)
    assert {k: v for k, v in on.to_dict().items() if k != "attn_temperature_tuning"} == \
        {k: v for k, v in off.to_dict().items() if k != "attn_temperature_tuning"}, "control: only it differs"
    assert _digest(on, "Llama4ForCausalLM") == _digest(llama4(True), "Llama4ForCausalLM"), "control: stable"
    assert _digest(on, "Llama4ForCausalLM") != _digest(off, "Llama4ForCausalLM")


# == D7: a hub cache's snapshot path =============================================================
COMMIT = "c" * 40


def _hub_cache(root, model: str) -> None:
    """A hub cache holding ``org/tiny`` at :data:`COMMIT`, as ``huggingface_hub`` lays it out."""
    repo = root / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def _offline_engine(monkeypatch, cache_root, **connector):
    """An engine of ``--model org/tiny`` with ``HF_HUB_OFFLINE=1`` on a host whose hub cache is
    ``cache_root``: vLLM replaces the name by the snapshot's path there."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache_root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_root))
    return _engine_kv("org/tiny", connector)


def test_two_hosts_with_one_hub_commit_in_other_cache_roots_share_keys(tiny_model, tmp_path, monkeypatch):
    for host in ("a", "b"):
        _hub_cache(tmp_path / host, tiny_model)
    a_cfg, a = _offline_engine(monkeypatch, tmp_path / "a")
    b_cfg, b = _offline_engine(monkeypatch, tmp_path / "b")
    assert a_cfg.model_config.model != b_cfg.model_config.model, "control: vLLM runs each host's own path"
    assert (a.namespace.model_id, a.namespace.weights_revision) == ("org/tiny", COMMIT)
    assert a.keys(HASHES) == b.keys(HASHES)


def test_a_given_weights_revision_and_model_id_win_over_the_snapshots(tiny_model, tmp_path, monkeypatch):
    _hub_cache(tmp_path, tiny_model)
    _, engine = _offline_engine(monkeypatch, tmp_path, model_id="mine", weights_revision="v2")
    assert (engine.namespace.model_id, engine.namespace.weights_revision) == ("mine", "v2")


def test_a_path_that_is_no_hub_snapshot_keys_as_it_is(tiny_model):
    _, engine = _engine_kv(tiny_model)
    assert (engine.namespace.model_id, engine.namespace.weights_revision) == (tiny_model, "")


# == audit s29 a11 ===============================================================================
def _torchao(scheme: dict) -> dict:
    """A torchao ``quantization_config`` as transformers saves it: the scheme only in private fields."""
    return {"quant_method": "torchao", "quant_type": {"default": scheme}}


INT4 = {"_type": "Int4WeightOnlyConfig", "_version": 1, "_data": {"group_size": 128}}
FP8 = {"_type": "Float8DynamicActivationFloat8WeightConfig", "_version": 2, "_data": {"granularity": {"_type": "PerRow"}}}


# D2: private fields name a torchao scheme
def test_torchao_quantization_schemes_named_in_private_fields_do_not_share_keys():
    """One bf16 checkpoint quantized online as int4 or as fp8 (``quantization`` is "torchao" in
    both): vLLM's torchao method reads the scheme from ``_type`` / ``_data``."""
    int4, int4_again, fp8 = (_llama_digest("LlamaForCausalLM", quantization_config=_torchao(s))
                             for s in (INT4, INT4, FP8))
    assert int4 == int4_again, "control: stable"
    assert int4 != fp8


def test_host_local_private_fields_keep_the_keys():
    """Where the files are and which attention kernel transformers picked name no computation."""
    from transformers import LlamaConfig

    def config(path: str, attention: str):
        hf = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                         name_or_path=path)
        hf._commit_hash = path[-1] * 40
        hf._attn_implementation = attention
        return hf

    a, b = config("/host/a", "sdpa"), config("/other/b", "eager")
    assert a.to_dict()["_name_or_path"] != b.to_dict()["_name_or_path"], "control: the field differs"
    assert _digest(a, "LlamaForCausalLM") == _digest(b, "LlamaForCausalLM")


# D3: a nested config's architectures picks the code of a part
def test_a_multimodal_model_whose_text_model_code_differs_gets_another_digest():
    """vLLM's LLaVA builds its language model by ``text_config.architectures``."""
    from kvtier.integrations.vllm.config import model_computation_digest

    def llava(text_architecture: str):
        config = _llava_config()
        config.model_config.hf_config.text_config.architectures = [text_architecture]
        return model_computation_digest(config)

    assert llava("LlamaForCausalLM") == llava("LlamaForCausalLM"), "control: stable"
    assert llava("LlamaForCausalLM") != llava("Qwen2ForCausalLM")


def test_the_top_level_architectures_keep_the_keys():
    """vLLM's resolved architecture stands for the top-level class names (the same code runs)."""
    a = _llama_digest("LlamaForCausalLM", architectures=["LlamaForCausalLM"])
    assert a == _llama_digest("LlamaForCausalLM", architectures=["MyLlama"], auto_map={"AutoModel": "x.Y"})


# D7: the checkpoint's dtype, where the model's code computes in it
OPENPANGU = "PanguUltraMoEForCausalLM"   # allocates its attention sinks in config.torch_dtype


def test_the_config_dtype_stays_in_the_digest_where_the_model_code_computes_in_it():
    assert _llama_digest(OPENPANGU, dtype=torch.float16) != _llama_digest(OPENPANGU, dtype=torch.bfloat16)
    assert _llama_digest(OPENPANGU, dtype=torch.float16) == _llama_digest(OPENPANGU, dtype="float16"), \
        "one dtype, two spellings"
    assert _llama_digest("LlamaForCausalLM", dtype=torch.float16) == \
        _llama_digest("LlamaForCausalLM", dtype=torch.bfloat16), "control: Llama computes in vLLM's dtype"


# D5: placeholder ids the model code writes in its workers
def test_a_placeholder_id_the_model_code_writes_in_its_worker_keeps_the_keys():
    """vLLM's Isaac code sets ``image_token_id`` from the tokenizer as each worker builds the model;
    the scheduler's copy of the config never has it (a multi-process executor)."""
    from transformers import LlamaConfig

    scheduler = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
    worker = LlamaConfig(**scheduler.to_dict())
    worker.image_token_id = 151655
    assert _digest(scheduler, "IsaacForConditionalGeneration") == _digest(worker, "IsaacForConditionalGeneration")


def test_a_placeholder_id_the_model_code_reads_stays_in_the_digest():
    """Qwen2-VL's M-RoPE positions follow ``image_token_id``: other positions, other K."""
    a, b = (_llama_digest("Qwen2VLForConditionalGeneration", image_token_id=i) for i in (151655, 7))
    assert a != b


# D6: weights from elsewhere than the model path
@pytest.mark.parametrize("load", [
    {"load_format": "tensorizer", "model_loader_extra_config": {"tensorizer_uri": "/w/finetune-A.tensors"}},
    {"load_format": "sharded_state"},
    {"load_format": "runai_streamer"},
], ids=["tensorizer", "sharded-state", "runai-streamer"])
def test_a_load_format_whose_weights_may_not_be_the_model_paths_needs_the_weights_named(tiny_model, load):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="model_id and weights_revision"):
        _engine_kv(tiny_model, **load)
    with pytest.raises(ConfigError, match="model_id and weights_revision"):
        _engine_kv(tiny_model, {"model_id": "finetune-A"}, **load)
    _, engine = _engine_kv(tiny_model, {"model_id": "finetune-A", "weights_revision": "1"}, **load)
    assert (engine.namespace.model_id, engine.namespace.weights_revision) == ("finetune-A", "1")


# D1: a quantization scheme in a file
def test_quantization_config_files_of_other_schemes_do_not_share_keys(tiny_model, tmp_path):
    """vLLM's torchao quantization reads its scheme from the file ``quantization_config_file`` names;
    one path can hold either scheme (two hosts, an edit between runs)."""
    path = tmp_path / "torchao.json"
    keys = {}
    for name, scheme in (("int4", INT4), ("int4-again", INT4), ("fp8", FP8)):
        path.write_text(json.dumps(scheme))
        keys[name] = _engine_kv(tiny_model, hf_overrides={"quantization_config_file": str(path)})[1].keys(HASHES)
    assert keys["int4"] == keys["int4-again"], "control: stable"
    assert keys["int4"] != keys["fp8"]


def test_a_quantization_config_file_that_cannot_be_read_is_refused(tiny_model, tmp_path):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="quantization_config_file"):
        _engine_kv(tiny_model, hf_overrides={"quantization_config_file": str(tmp_path / "absent.json")})


# D4: --max-model-len -1 with a RoPE built from the length
DYNAMIC_NTK = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 1024,
                                   "rope_theta": 10000.0}}


def test_auto_fit_max_model_len_with_a_length_dependent_rope_is_refused(tiny_model):
    """vLLM builds the model at the derived length, then lowers ``max_model_len`` to what fits
    before the connector is built: the length the RoPE rotates by is gone."""
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="max-model-len -1"):
        _engine_kv(tiny_model, hf_overrides=DYNAMIC_NTK, max_model_len=-1)
    _engine_kv(tiny_model, hf_overrides=DYNAMIC_NTK, max_model_len=2048)   # control: explicit length
    _engine_kv(tiny_model, max_model_len=-1)   # control: a RoPE that rotates alike at any length
