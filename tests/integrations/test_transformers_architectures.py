"""Architectures whose config and cache kvtier used to misread (audit s28: D1-D4 and start-up refusals).

* A BERT-family encoder loaded with ``AutoModelForCausalLM`` (``is_decoder=False``, as every encoder
  checkpoint ships) attends both ways: a prefix's K/V depends on the tokens after it, so a hit is
  wrong. Refused by name; the same model as a decoder still hits, equal to its own full forward.
* An encoder-decoder family's ``*ForCausalLM`` (BART and kin) runs the decoder, whose layers and
  heads the config's generic fields do not name: the layout takes the decoder's, and hits are
  right whether the decoder has more layers than the encoder or fewer.
* What the model itself caches is checked once at construction (a few tokens through the model):
  a config that says another geometry than the model computes, a model with layers pruned in
  memory, and sliding-window layers are refused when the session is built, not at a request.
* A config whose layers differ (``per_layer_config``) is a ``ConfigError``, not transformers' own.
* The attention implementation is part of the namespace: eager applies Gemma 2's soft-capping,
  sdpa does not, and the two compute other K/V from the same files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, kv_layout, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers import namespace as namespace_module  # noqa: E402
from kvtier.integrations.transformers import session as session_module  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402

VOCAB = 256


def _saved(config, path, attn="eager"):
    """A random-weight model of ``config`` (init 0.2: a wrong position or KV shows), saved and loaded back."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()


def _prompt(n: int = 100, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n)


def _full_forward(model, prompt) -> torch.Tensor:
    """The model's own logits, without a cache: BartForCausalLM sizes the cache it builds itself by
    the encoder's layer count, so with a longer decoder its default forward raises IndexError."""
    with torch.inference_mode():
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        return model(input_ids=ids, use_cache=False).logits[0, -1].float()


def _warm_hit_error(model, prompt) -> tuple[int, float]:
    """Save a shorter prompt's blocks, then serve ``prompt`` from them (poisoned storage): the cached
    positions and the max abs difference of the hit's logits from the model's own full forward."""
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(model, store, ns, capacity_tokens=256, poison=True)
    try:
        lm.generate(prompt[:-10], 2)
        lm.wait_saves()
        warm = lm.generate(prompt, 4, save=False)
        return warm.cached_tokens, float((warm.first_logits - _full_forward(model, prompt)).abs().max())
    finally:
        lm.close()
        store.close()


# -- D1: bidirectional encoders loaded as causal LMs -------------------------------------------------

BIDIRECTIONAL = {
    "bert": lambda: transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=96, initializer_range=0.2),
    "roberta": lambda: transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=96, pad_token_id=0,
                                                  max_position_embeddings=512, initializer_range=0.2),
    "electra": lambda: transformers.ElectraConfig(vocab_size=VOCAB, hidden_size=64, embedding_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                                  initializer_range=0.2),
}


@pytest.mark.parametrize("family", sorted(BIDIRECTIONAL))
def test_a_bidirectional_encoder_loaded_as_a_causal_lm_is_refused_by_name(family, tmp_path):
    config = BIDIRECTIONAL[family]()
    assert config.is_decoder is False   # the default of every encoder checkpoint
    model = _saved(config, tmp_path)
    with pytest.raises(ConfigError, match="is_decoder=False.*bidirectional"):   # old code: accepted
        kv_layout(model.config, "float32", BLOCK)
    with pytest.raises(ConfigError, match="bidirectional"):
        namespace_for_model(model, block_tokens=BLOCK)
    with pytest.raises(ConfigError, match="bidirectional"):
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)


def test_control_without_the_refusal_a_bidirectional_encoders_hit_is_wrong(tmp_path, monkeypatch):
    """Why it is refused: the old behaviour, kept reachable by switching the refusals off. Without the
    config's, the construction probe refuses it (its prefix's logits change when tokens follow)."""
    model = _saved(BIDIRECTIONAL["bert"](), tmp_path)
    monkeypatch.setattr(namespace_module, "_refuse_bidirectional_config", lambda text: None)
    with pytest.raises(ConfigError, match="prefix run into a fresh cache gave other logits"):
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)
    monkeypatch.setattr(session_module, "check_model_cache", lambda *args, **kwargs: None)
    cached, diff = _warm_hit_error(model, _prompt())
    assert cached == 80 and diff > 100 * FP32_TOL


def test_control_the_same_encoder_as_a_decoder_hits_and_equals_its_full_forward(tmp_path):
    config = BIDIRECTIONAL["bert"]()
    config.is_decoder = True
    cached, diff = _warm_hit_error(_saved(config, tmp_path), _prompt())
    assert cached == 80 and diff <= FP32_TOL


# -- D2: encoder-decoder families' causal LMs run the decoder ----------------------------------------

def _bart(encoder_layers: int, decoder_layers: int, encoder_heads: int = 4, decoder_heads: int = 4):
    return transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=encoder_layers,
                                   decoder_layers=decoder_layers, encoder_attention_heads=encoder_heads,
                                   decoder_attention_heads=decoder_heads, encoder_ffn_dim=96, decoder_ffn_dim=96,
                                   max_position_embeddings=512, init_std=0.2)


def test_an_encoder_decoder_causal_lm_gets_its_decoders_layers_and_heads():
    """BartForCausalLM's config (is_encoder_decoder=False) maps num_hidden_layers / num_attention_heads
    to the encoder's fields (old code: 4 layers, 8 heads); the config as saved (is_encoder_decoder=True)
    comes back from transformers as a decoder view. Both give the decoder's layout."""
    config = _bart(encoder_layers=4, decoder_layers=2, encoder_heads=8, decoder_heads=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for cfg in (model.config, config):
        layout = kv_layout(cfg, "float32", BLOCK)
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 4, 16)


@pytest.mark.parametrize("encoder_layers, decoder_layers", [(2, 4), (4, 2)], ids=["more-decoder", "fewer-decoder"])
def test_an_encoder_decoder_causal_lm_hits_and_equals_its_full_forward(encoder_layers, decoder_layers, tmp_path):
    """Old code: more decoder layers → IndexError inside the model at every request; fewer → the
    storage's extra layers never written, nothing saved, every request a silent miss."""
    cached, diff = _warm_hit_error(_saved(_bart(encoder_layers, decoder_layers), tmp_path), _prompt())
    assert cached == 80 and diff <= FP32_TOL


# -- what the model caches, checked at construction ----------------------------------------------------

def test_a_model_caching_another_geometry_than_its_config_says_is_refused_at_construction():
    """CPM-Ant sizes its heads by ``dim_head`` (not hidden/heads) and caches 32 prompt positions ahead
    of the tokens (here the probe's prefix of 3). Old code: accepted, then a LayoutError at every request."""
    config = transformers.CpmAntConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=8,
                                       dim_ff=96, num_hidden_layers=2, position_bias_num_buckets=32,
                                       position_bias_max_distance=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ConfigError, match=r"cache layer 0 holds K \(1, 4, 35, 8\).*\(1, 4, 3, 16\)"):
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)


def test_a_model_with_layers_pruned_in_memory_is_refused_at_construction(tmp_path):
    """Layers dropped from the module list but not from the config (layer pruning): old code accepted
    it, and the storage's layer the model never writes held 0 tokens, so nothing was ever saved."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96)
    model = _saved(config, tmp_path)
    model.model.layers = model.model.layers[:1]
    with pytest.raises(ConfigError, match="the model wrote 1 cache layers, its KV layout has 2"):
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)


def test_a_sliding_window_model_is_refused_at_construction_not_at_its_first_request(tmp_path):
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=96, sliding_window=24)
    model = _saved(config, tmp_path)
    with pytest.raises(ConfigError, match="sliding-window or hybrid"):   # old code: at the first generate()
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)


# -- D3: configs whose layers differ -----------------------------------------------------------------------

def test_a_config_whose_layers_differ_in_kv_geometry_is_refused_with_a_config_error():
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96)
    try:
        config = transformers.LlamaConfig(**kw, per_layer_config={1: {"num_key_value_heads": 1}})
    except TypeError:
        pytest.skip("this transformers has no per-layer configs")
    with pytest.raises(ConfigError, match="layers differ in their KV geometry"):   # old code: transformers' error
        kv_layout(config, "float32", BLOCK)
    same = transformers.LlamaConfig(**kw, per_layer_config={1: {"intermediate_size": 64}})
    assert kv_layout(same, "float32", BLOCK).num_kv_heads == 2   # control: one KV geometry is served


def test_gemma4_unified_text_with_per_layer_head_sizes_is_refused_with_a_config_error():
    if "gemma4_unified_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("no gemma4_unified_text in this transformers")
    config = transformers.CONFIG_MAPPING["gemma4_unified_text"](
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, head_dim=16, sliding_window=24)
    with pytest.raises(ConfigError, match="layers differ"):   # old code: AmbiguousGlobalPerLayerAttributeError
        kv_layout(config, "float32", BLOCK)


# -- D4: the attention implementation is part of the namespace ------------------------------------------

def test_softcapped_attention_under_eager_and_sdpa_gets_two_namespaces(tmp_path):
    """Gemma 2's attention soft-capping is applied by the eager kernel only: the same files under
    eager and sdpa compute other K/V (old code: one namespace, so one's KV served to the other)."""
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                       layer_types=["full_attention"] * 2, attn_logit_softcapping=50.0,
                                       initializer_range=0.2)
    eager = _saved(config, tmp_path, attn="eager")
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    prompt = _prompt()
    assert float((_full_forward(eager, prompt) - _full_forward(sdpa, prompt)).abs().max()) > FP32_TOL
    a = namespace_for_model(eager, block_tokens=BLOCK)
    b = namespace_for_model(sdpa, block_tokens=BLOCK)
    assert a.weights_revision == b.weights_revision and a.root != b.root
    assert ":attn=eager" in a.model_id and ":attn=sdpa" in b.model_id
    assert namespace_for_model(eager, block_tokens=BLOCK) == a   # control: the same load, the same namespace


def _checkpoint_with_legacy_config_keys(config, path, extra: dict):
    """A decoder-only checkpoint whose config.json carries the generic fields transformers 4.x's
    ``PretrainedConfig.to_dict()`` writes for every model (``is_decoder: false``,
    ``add_cross_attention: false``, ...), as conversion/merge tools that dump the full dict leave them."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    data.update(extra)
    cfg_file.write_text(json.dumps(data))
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


LEGACY_4X_KEYS = {"is_decoder": False, "add_cross_attention": False, "is_encoder_decoder": False,
                  "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None, "tie_encoder_decoder": False}


# -- causal decoders whose config.json names is_decoder=false (transformers 4 dumps) are served --------

def test_a_llama_checkpoint_with_transformers4_full_config_keys_is_still_served(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, initializer_range=0.2)
    model = _checkpoint_with_legacy_config_keys(config, tmp_path, LEGACY_4X_KEYS)
    # a Llama is causal whatever is_decoder says (LlamaModel never reads it)
    prompt = np.random.default_rng(1).integers(3, VOCAB, 100)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.inference_mode():
        head = model(input_ids=ids[:, :50]).logits[0, -1]
        whole = model(input_ids=ids).logits[0, 49]
    assert float((head - whole).abs().max()) <= FP32_TOL   # causal: later tokens change nothing before them
    kv_layout(model.config, "float32", BLOCK)   # regression audit s28 R1: was refused as bidirectional
    cached, diff = _warm_hit_error(model, prompt)
    assert cached == 80 and diff <= FP32_TOL


def test_a_gpt2_checkpoint_with_is_decoder_false_in_config_json_is_still_served(tmp_path):
    """GPT2Config declares add_cross_attention itself, so one stray key suffices."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2)
    model = _checkpoint_with_legacy_config_keys(config, tmp_path, {"is_decoder": False})
    cached, diff = _warm_hit_error(model, np.random.default_rng(1).integers(3, VOCAB, 100))
    assert cached == 80 and diff <= FP32_TOL
