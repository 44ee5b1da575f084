"""Models that kvtier cannot resume from a cache, refused when the session is built (audit s29 a6).

* The construction probe runs a few tokens whole, then as a cached prefix and a suffix after it,
  and compares the logits. XLM wants the whole sequence with a cache and drops the cached part
  itself (D1: fed the suffix, silently wrong logits with ``causal=True``, a crash at every hit with
  ``causal=False``); ProphetNet's decoder takes one token after a cache (D2: every hit crashed).
  Both are refused at construction; an exception inside the probe is a ``ConfigError``.
* Gemma, Gemma 2 and Gemma 3 with ``use_bidirectional_attention=True`` (EmbeddingGemma's setting)
  see the tokens after a position (D4): refused by name, and by the probe alone if the config
  check is switched off. The same models with causal attention are still served.
* OpenAI GPT, XLNet and Reformer keep no per-token K/V cache (D5): the refusal says so instead of
  blaming the transformers version.
* WhisperForCausalLM whose decoder has fewer heads than its encoder (D6): the KV heads come from
  the decoder (Whisper's ``num_key_value_heads`` names the encoder's), so it is served.
* The probe leaves the model as it found it, and accepts servable models in half precision.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, kv_layout, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers import namespace as namespace_module  # noqa: E402
from kvtier.integrations.transformers import cache_probe  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402

VOCAB = 256


def _model(config, dtype=torch.float32):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _construct(model):
    KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64).close()


def _hit_error(model) -> tuple[int, float]:
    """Save 70 tokens' blocks, then serve 100 tokens from them (poisoned storage): the cached positions
    and the max abs difference of the hit's logits from the model's own full forward."""
    prompt = np.random.default_rng(1).integers(3, VOCAB, 100)
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    store = host_store(ns)
    lm = KVTierLM(model, store, ns, capacity_tokens=256, poison=True)
    try:
        lm.generate(prompt[:70], 1)
        lm.wait_saves()
        warm = lm.generate(prompt, 1, save=False)
        with torch.inference_mode():
            ids = torch.from_numpy(prompt.astype(np.int64))[None]
            full = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        return warm.cached_tokens, float((warm.first_logits - full).abs().max())
    finally:
        lm.close()
        store.close()


# -- D1, D2: models that do not take a suffix after a cache --------------------------------------------

def _xlm(causal: bool):
    return transformers.XLMConfig(vocab_size=VOCAB, emb_dim=64, n_layers=2, n_heads=4, max_position_embeddings=512,
                                  causal=causal, pad_index=0, init_std=0.1)


def test_xlm_wanting_the_whole_sequence_with_a_cache_is_refused_at_construction():
    """causal=True: fed 5 tokens after a cache of 3, XLM drops 3 more and answers for 2 positions.
    Old code: accepted, and a hit's logits were 0.5 off with no error."""
    with pytest.raises(ConfigError, match=r"XLMWithLMHeadModel: the suffix run after the cached prefix gave "
                                          r"logits of shape \(1, 2, 256\).*\(1, 5, 256\)"):
        _construct(_model(_xlm(causal=True)))


def test_bidirectional_xlm_is_refused_at_construction_not_at_its_first_hit():
    """causal=False (XLM's default). Old code: accepted, then a RuntimeError inside the model at every hit."""
    with pytest.raises(ConfigError, match="XLMWithLMHeadModel raised RuntimeError on the last 5 probe tokens "
                                          "after a cache of 3"):
        _construct(_model(_xlm(causal=False)))


def test_prophetnet_taking_one_token_after_a_cache_is_refused_at_construction():
    """Old code: accepted (its probe was one token into an empty cache), then every hit with a suffix of
    two or more tokens raised the model's AssertionError."""
    config = transformers.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=64, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ConfigError, match="ProphetNetForCausalLM raised AssertionError .*use_cache"):
        _construct(_model(config))


# -- D4: Gemma's bidirectional attention -----------------------------------------------------------------

GEMMA_KW = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, initializer_range=0.1)
GEMMAS = {
    "gemma": lambda **kw: transformers.GemmaConfig(**GEMMA_KW, **kw),
    "gemma2": lambda **kw: transformers.Gemma2Config(**GEMMA_KW, layer_types=["full_attention"] * 2, **kw),
    "gemma3_text": lambda **kw: transformers.Gemma3TextConfig(**GEMMA_KW, layer_types=["full_attention"] * 2, **kw),
}


@pytest.mark.parametrize("family", sorted(GEMMAS))
def test_a_gemma_with_bidirectional_attention_is_refused_by_name(family):
    """Old code: accepted, and a hit's logits were 0.06-0.49 off the full forward, no error."""
    config = GEMMAS[family](use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="use_bidirectional_attention=True.*sees the tokens after"):
        kv_layout(config, "float32", BLOCK)
    with pytest.raises(ConfigError, match="use_bidirectional_attention=True"):
        _construct(_model(config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(GEMMAS))
def test_without_the_config_check_the_probe_alone_refuses_a_bidirectional_gemma(family, dtype, monkeypatch):
    """The behavioural check catches what no config flag names: the prefix's logits change once the
    whole prompt is run (bfloat16 too: ~0.26 of the largest logit and more, its tolerance 0.1)."""
    monkeypatch.setattr(namespace_module, "_refuse_bidirectional_config", lambda text: None)
    with pytest.raises(ConfigError, match="prefix run into a fresh cache gave other logits"):
        _construct(_model(GEMMAS[family](use_bidirectional_attention=True), dtype))


@pytest.mark.parametrize("family", sorted(GEMMAS))
def test_control_the_same_gemmas_with_causal_attention_are_served_and_hit_like_a_recompute(family):
    cached, diff = _hit_error(_model(GEMMAS[family](use_bidirectional_attention=False)))
    assert cached == 64 and diff <= FP32_TOL


# -- D5: models without a per-token K/V cache ----------------------------------------------------------

NO_KV_CACHE = {
    "openai-gpt": (lambda: transformers.OpenAIGPTConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=128), "recomputes the whole sequence"),
    "xlnet": (lambda: transformers.XLNetConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, d_inner=128),
              "it keeps 'mems' instead"),
    "reformer": (lambda: transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, attention_head_size=16, is_decoder=True,
        attn_layers=["local", "local"], axial_pos_shape=[16, 32], axial_pos_embds_dim=[32, 32],
        feed_forward_size=64, local_attn_chunk_length=16), "it keeps 'past_buckets_states' instead"),
}


@pytest.mark.parametrize("family", sorted(NO_KV_CACHE))
def test_a_model_without_a_kv_cache_is_refused_saying_so(family):
    """Old code: "this transformers version is not supported", which no version fixes."""
    make, keeps = NO_KV_CACHE[family]
    with pytest.raises(ConfigError) as refused:
        _construct(_model(make()))
    message = str(refused.value)
    assert "keeps no DynamicCache of per-token K/V" in message and keeps in message
    assert "version" not in message


# -- D6: an encoder-decoder config's KV heads are its decoder's ---------------------------------------

def test_a_whisper_decoder_with_fewer_heads_than_its_encoder_is_served_and_hits_like_a_recompute():
    """WhisperConfig maps num_key_value_heads to encoder_attention_heads. Old code: a layout of 8 KV
    heads, so the model (caching 4) was refused."""
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=8,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=512,
        max_source_positions=64, num_mel_bins=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1)
    model = _model(config)
    assert kv_layout(model.config, "float32", BLOCK).num_kv_heads == 4
    cached, diff = _hit_error(model)
    assert cached == 64 and diff <= FP32_TOL


# -- the probe itself ------------------------------------------------------------------------------------

def _llama(**extra):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, initializer_range=0.1, **extra)


def test_the_probe_leaves_the_model_as_it_found_it():
    """A model in training mode with dropout: the probe runs it in eval mode (dropout would make the
    split run differ), then gives the mode back; weights, gradients and the global RNG untouched."""
    model = _model(_llama(attention_dropout=0.5)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    layout = kv_layout(model.config, "float32", BLOCK)
    cache_probe.check_model_cache(model, cache_keyword(model), layout)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


SERVABLE = {
    "llama": _llama,
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, initializer_range=0.1),
    "bloom-alibi": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                                    initializer_range=0.1),
    "opt": lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, ffn_dim=128, init_std=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", sorted(SERVABLE))
def test_servable_models_pass_the_probe_in_every_dtype(family, dtype):
    """The probe's tolerance must never lock out a servable model: rounding in half precision is all
    that its split run shows."""
    _construct(_model(SERVABLE[family](), dtype))


# -- s29 a10 D4: a torch.compile(model) wrapper ----------------------------------------------------------

def test_a_torch_compiled_model_is_served_and_hits_like_a_recompute():
    """``torch.compile(model)`` gives an OptimizedModule whose forward is ``(*args, **kwargs)``: the
    compiled model's own forward names the cache argument. Old code refused it, saying a Llama
    "keeps no DynamicCache of per-token K/V". (The eager backend: dynamo traces the model as any
    backend would, without a C++ compiler's minutes on this CPU.)"""
    compiled = torch.compile(_model(_llama()), backend="eager")
    assert cache_keyword(compiled) == cache_keyword(compiled._orig_mod)
    cached, diff = _hit_error(compiled)
    assert cached == 64 and diff <= FP32_TOL


class _OpaqueWrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_wrapper_hiding_its_forward_arguments_is_refused_saying_so():
    """Old code said the model keeps no per-token K/V cache, which the wrapped Llama does."""
    with pytest.raises(ConfigError) as refused:
        cache_keyword(_OpaqueWrapper(_model(_llama())))
    message = str(refused.value)
    assert "a wrapper whose forward arguments cannot be seen" in message and "model.compile()" in message
    assert "keeps no DynamicCache" not in message
