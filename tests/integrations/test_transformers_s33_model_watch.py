"""What a session's namespace names of the model, watched after construction (audit s33 a4).

The namespace names the weights, the config and the attention kernel a session was built with.
Changed afterwards, the model computes other K/V than the blocks the namespace keys:

* another attention kernel (``set_attn_implementation``: Gemma 2's eager kernel soft-caps, sdpa does
  not) was served the other kernel's blocks, and its own were saved under them (D1);
* RoPE frequencies (the non-persistent ``inv_freq`` buffer, which the weights digest leaves out)
  written or rebuilt went unseen (D2);
* a change lasting only while the caller's forward ran (a PEFT ``disable_adapter()`` context, or
  ``load_state_dict`` of other weights and back, between ``prepare`` and ``save``) was saved under
  the namespace (D3);
* a ``torch.compile`` wrapper's namespace could not be derived from its files (D4), and one compiled
  with ``fullgraph=True`` raised at every hit (D7).

Tiny random-weight models built in memory; compiles use the eager backend (seconds).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.errors import ConfigError, LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402

VOCAB = 256


def _llama(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, initializer_range=0.3)
    config = transformers.LlamaConfig(**{**fields, **extra})
    return transformers.LlamaForCausalLM(config).eval()


def _gemma2(attn: str) -> torch.nn.Module:
    """A Gemma 2 with attention soft-capping: its eager kernel applies it, sdpa does not."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, head_dim=16, initializer_range=0.3, attn_logit_softcapping=0.5,
        final_logit_softcapping=None, sliding_window=4096, layer_types=["full_attention", "full_attention"],
        attn_implementation=attn)
    return transformers.Gemma2ForCausalLM(config).eval()


def _session(model, store=None, ns=None) -> KVTierLM:
    ns = ns or namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    return KVTierLM(model, store or host_store(ns), ns, capacity_tokens=256)


def _prompt(n: int = 100, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n)


def _warm_equals_cold(lm: KVTierLM, prompt: np.ndarray) -> int:
    """Serve ``prompt`` from the store and recompute it; assert the logits agree; the tokens loaded."""
    warm = lm.generate(prompt, 1, save=False)
    cold = lm.generate(prompt, 1, use_store=False, save=False)
    diff = float((warm.first_logits - cold.first_logits).abs().max())
    assert diff <= FP32_TOL, f"{warm.cached_tokens} tokens loaded: logits {diff} off a recompute"
    return warm.cached_tokens


def _saved_blocks(lm: KVTierLM, prompt: np.ndarray) -> int:
    return lm.store.lookup(block_keys(lm.namespace, prompt)).hit_blocks


def _caller_forward(model, prep, prompt: np.ndarray) -> None:
    """The caller's own forward over the uncached suffix, on the prepared cache."""
    with torch.no_grad():
        model(input_ids=torch.from_numpy(prompt[prep.cached_tokens:].astype(np.int64))[None],
              use_cache=True, **{cache_keyword(model): prep.cache})


# -- D1: the attention kernel --------------------------------------------------------------------

def test_an_attention_kernel_switched_after_construction_is_refused_before_loading_or_saving():
    model = _gemma2("sdpa")
    lm = _session(model)
    prompt, other = _prompt(), _prompt(seed=7)
    try:
        lm.generate(prompt, 1)
        lm.wait_saves()
        model.set_attn_implementation("eager")
        with pytest.raises(ConfigError, match="attention implementation changed"):
            lm.generate(prompt, 1)  # nothing of the sdpa blocks loaded into the eager model
        with pytest.raises(ConfigError, match="attention implementation changed"):
            lm.prepare(other)
        model.set_attn_implementation("sdpa")
        # switched during the caller's request: the eager K/V is not saved under the sdpa namespace
        with lm.request():
            prep = lm.prepare(other)
            model.set_attn_implementation("eager")
            _caller_forward(model, prep, other)
            with pytest.raises(ConfigError, match="attention implementation changed"):
                lm.save(other)
        assert _saved_blocks(lm, other) == 0
        model.set_attn_implementation("sdpa")  # the kernel the namespace names: served again
        assert _warm_equals_cold(lm, prompt) == 96
    finally:
        lm.close()
        lm.store.close()


# -- D2: non-persistent buffers (RoPE) -----------------------------------------------------------

def _scale_in_place(model) -> None:
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)


def _one_value_through_data(model) -> None:
    # inv_freq holds 32 values (head_dim 64): index 1 is none of the 8 spread samples
    model.model.rotary_emb.inv_freq.data[1] *= 0.5


def _rebuilt_with_another_theta(model) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)


ROPE_CHANGES = {"mul_ under no_grad": _scale_in_place, "one value through .data": _one_value_through_data,
                "rotary module rebuilt, rope_theta=500": _rebuilt_with_another_theta}


@pytest.mark.parametrize("change", list(ROPE_CHANGES))
def test_rope_frequencies_changed_after_construction_are_refused(change):
    model = _llama(num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    lm = _session(model)
    prompt = _prompt()
    try:
        lm.generate(prompt, 1)
        lm.wait_saves()
        assert _warm_equals_cold(lm, prompt) == 96  # control: the blocks serve it
        ROPE_CHANGES[change](model)
        with pytest.raises(ConfigError, match="non-persistent buffer"):
            lm.generate(prompt, 1)
    finally:
        lm.close()
        lm.store.close()


def test_a_rotary_module_rebuilt_from_the_same_config_keeps_serving():
    """Control: new buffer objects, the same frequencies (settled by the buffers' digest)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = _llama()
    lm = _session(model)
    prompt = _prompt()
    try:
        lm.generate(prompt, 1)
        lm.wait_saves()
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
        assert _warm_equals_cold(lm, prompt) == 96
    finally:
        lm.close()
        lm.store.close()


# -- D3: changes lasting only while the caller's forward runs --------------------------------------

def test_an_adapter_disabled_only_during_the_callers_generate_is_not_saved():
    peft = pytest.importorskip("peft")
    peft_model = peft.get_peft_model(_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)).eval()
    model = peft_model.base_model.model
    lm = _session(model)
    prompt = _prompt(seed=5)
    try:
        with lm.request(), torch.no_grad():
            prep = lm.prepare(prompt, extra_tokens=2)
            with peft_model.disable_adapter():  # a base-model pass (a reference model's, say)
                out = model.generate(torch.from_numpy(prompt.astype(np.int64))[None], max_new_tokens=2,
                                     do_sample=False, **{cache_keyword(model): prep.cache})
            with pytest.raises(LayoutError, match="changed during this request"):
                lm.save(out[0])
        assert _saved_blocks(lm, prompt) == 0
        # control: the same request with the adapter on throughout is saved, and served
        with lm.request(), torch.no_grad():
            prep = lm.prepare(prompt, extra_tokens=2)
            out = model.generate(torch.from_numpy(prompt.astype(np.int64))[None], max_new_tokens=2,
                                 do_sample=False, **{cache_keyword(model): prep.cache})
            lm.save(out[0]).result()
        assert _warm_equals_cold(lm, prompt) == 96
    finally:
        lm.close()
        lm.store.close()


def test_weights_swapped_and_swapped_back_during_the_callers_forward_are_not_saved():
    model = _llama()
    lm = _session(model)
    prompt = _prompt(seed=5)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    w1 = {k: v + 0.05 * torch.randn_like(v) for k, v in w0.items()}
    try:
        with lm.request():
            prep = lm.prepare(prompt)
            model.load_state_dict(w1)
            _caller_forward(model, prep, prompt)
            model.load_state_dict(w0)
            with pytest.raises(LayoutError, match="changed"):
                lm.save(prompt)
        assert _saved_blocks(lm, prompt) == 0
        # the weights are the namespace's again: the next request is served, and saved
        lm.generate(prompt, 1)
        lm.wait_saves()
        assert _warm_equals_cold(lm, prompt) == 96
    finally:
        lm.close()
        lm.store.close()


# -- D4, D7: torch.compile -----------------------------------------------------------------------

# One layer: dynamo traces each forward kind once, and tracing is what these tests pay for.

def test_a_compiled_wrapper_gets_its_models_namespace_from_the_files(tmp_path):
    _llama(num_hidden_layers=1).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    # (what KVTierLM(compiled, store) derives when given no namespace)
    assert namespace_for_model(compiled, block_tokens=BLOCK) == namespace_for_model(model, block_tokens=BLOCK)


def _wrapped_fullgraph(model):
    return torch.compile(model, backend="eager", fullgraph=True)


def _in_place_fullgraph(model):
    model.compile(backend="eager", fullgraph=True)
    return model


@pytest.mark.parametrize("compile_", [_wrapped_fullgraph, _in_place_fullgraph], ids=["torch.compile", "model.compile"])
def test_a_fullgraph_compile_is_refused_at_construction_naming_fullgraph(compile_):
    """Its misses ran; every hit raised (the checks of the first forward after a load are a graph break)."""
    torch._dynamo.reset()
    model = compile_(_llama(num_hidden_layers=1))
    with pytest.raises(ConfigError, match="fullgraph"):
        _session(model)
    # without a store nothing is loaded: nothing to refuse
    KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64).close()


def test_weights_swapped_during_an_unstored_requests_forward_after_an_earlier_rewrite_are_not_saved():
    """prepare(use_store=False) after an earlier same-bytes rewrite (load_state_dict of the same
    weights) settles it first and watches the request: weights swapped for the caller's forward and
    back before save() were saved under the namespace, and a later hit differed from a recompute
    (audit s33 r8 D1). The control: the same request without the swap is saved and hits."""
    def run(swap: bool):
        m = _llama()
        lm = _session(m)
        w0 = {k: v.clone() for k, v in m.state_dict().items()}
        w1 = {k: v + 0.05 * torch.randn_like(v) for k, v in w0.items()}
        prompt = _prompt(seed=5)
        m.load_state_dict(w0)  # the same weights again: bytes equal, version counters bumped
        saved = True
        with lm.request():
            prepared = lm.prepare(prompt, use_store=False)
            if swap:
                m.load_state_dict(w1)
            _caller_forward(m, prepared, prompt)
            if swap:
                m.load_state_dict(w0)
            try:
                lm.save(prompt).result()
            except (LayoutError, ConfigError):
                saved = False
        warm = lm.generate(prompt, 1, save=False)
        cold = lm.generate(prompt, 1, use_store=False, save=False)
        lm.close()
        return saved, warm.cached_tokens, float((warm.first_logits - cold.first_logits).abs().max())

    saved, hit, _ = run(swap=False)
    assert saved and hit > 0, "control: an unchanged request is saved and hits"
    saved, hit, diff = run(swap=True)
    assert not saved and hit == 0, "weights swapped during the forward were saved"
    assert diff <= FP32_TOL


def test_an_unstored_request_of_weights_offloaded_after_construction_runs_and_is_not_saved():
    """prepare(use_store=False) settles a move of the weights by their digest, which refuses weights
    on the meta device (accelerate's cpu_offload after the session was built): such a request runs
    unwatched and save refuses it, as before that settling (it raised out of prepare: audit s33
    r13 D1)."""
    accelerate = pytest.importorskip("accelerate")
    m = _llama()
    lm = _session(m)
    prompt = _prompt(seed=4)
    accelerate.cpu_offload(m, execution_device=torch.device("cpu"))
    with lm.request():
        prepared = lm.prepare(prompt, use_store=False)
        _caller_forward(m, prepared, prompt)
        with pytest.raises((ConfigError, LayoutError)):
            lm.save(prompt).result()
    assert _saved_blocks(lm, prompt) == 0
    lm.close()
