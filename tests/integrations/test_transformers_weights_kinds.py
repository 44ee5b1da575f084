"""What a ``KVTierLM``'s weights check sees beyond plain parameters written in place (s32 r4 D3-D6).

* Weights held as buffers (BitNet's ``BitLinear``, GPTQ/AWQ's ``qweight``) are weights: another
  checkpoint loaded into them is refused as a parameter's change is.
* Weights moved with their bytes unchanged (``share_memory()``) or loaded again are the same
  weights: served; a session whose weights changed serves again once they are back.
* A model whose weights accelerate offloads to the meta device is refused with a ``ConfigError``,
  as a model off the CPU is.
* Which adapter PEFT's injected layers apply is part of the model: a switch after construction is
  refused (served again once switched back), and models applying other adapters get other
  namespaces. (peft is no kvtier dependency: those tests run where it is installed.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store, tokens  # noqa: E402

CHANGED = "weights changed after this KVTierLM was built"
PROMPT = tokens(100, seed=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one config: seeds 0 and 1."""
    paths = {}
    for seed in (0, 1):
        paths[seed] = tmp_path_factory.mktemp(f"tiny-seed{seed}")
        build_model(replace(TINY_SPEC, seed=seed), paths[seed], tokenizer=False, initializer_range=0.3)
    return paths


def _session(model, namespace) -> KVTierLM:
    """A session of ``model`` whose store holds the blocks of :data:`PROMPT` (96 tokens' worth)."""
    lm = KVTierLM(model, host_store(namespace), namespace, capacity_tokens=256)
    lm.generate(PROMPT, 2)
    lm.wait_saves()
    return lm


def _close(lm: KVTierLM) -> None:
    lm.close()
    lm.store.close()


def _assert_served_right(lm: KVTierLM) -> None:
    """The cached blocks are loaded and give a recompute's logits."""
    warm = lm.generate(PROMPT, 2, save=False)
    cold = lm.generate(PROMPT, 2, use_store=False, save=False)
    assert warm.cached_tokens == 96
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= FP32_TOL


# -- weights held as buffers (D3) ---------------------------------------------------------------

@pytest.fixture
def bitnet_models(checkpoints):
    """The checkpoint's model with transformers' BitNet layers (weights as uint8 buffers), given
    packed ternary weights of two seeds. Their ``@torch.compile`` helpers run eagerly (no C++
    compiler's minutes; the K/V is the same)."""
    from transformers.integrations.bitnet import BitLinear, replace_with_bitnet_linear

    def bitnet(seed):
        model, _ = load_model(checkpoints[0], tokenizer=False)
        replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"])
        gen = torch.Generator().manual_seed(seed)
        for module in model.modules():
            if isinstance(module, BitLinear):  # the checkpoint's buffers, as a quantized load sets them
                module.weight = torch.randint(0, 255, (module.out_features // 4, module.in_features),
                                              dtype=torch.uint8, generator=gen)
                module.weight_scale = torch.ones(1)
        return model.eval()

    with torch.compiler.set_stance("force_eager"):
        yield bitnet(1), bitnet(2)


def test_another_checkpoint_loaded_into_buffer_weights_is_refused(bitnet_models):
    model, other = bitnet_models
    assert not any(".self_attn." in name for name, _ in model.named_parameters())  # buffers only
    lm = _session(model, namespace_for_model(model, block_tokens=BLOCK, weights_revision="bitnet-1"))
    try:
        _assert_served_right(lm)  # control
        # the other checkpoint's projections, loaded in place (a partial load, a weight sync)
        projections = {k: v for k, v in other.state_dict().items() if ".self_attn." in k or ".mlp." in k}
        assert model.load_state_dict(projections, strict=False).unexpected_keys == []
        with pytest.raises(ConfigError, match=CHANGED + r" \(weight 'model.layers.0.self_attn.q_proj.weight' "):
            lm.generate(PROMPT, 2)
    finally:
        _close(lm)


# -- the same weights moved or loaded again (D4) -------------------------------------------------

def test_weights_moved_or_loaded_again_are_served_and_changed_ones_until_they_are_back(checkpoints):
    model, _ = load_model(checkpoints[0], tokenizer=False)
    other, _ = load_model(checkpoints[1], tokenizer=False)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    lm = _session(model, namespace_for_model(model, block_tokens=BLOCK))
    try:
        model.share_memory()  # every tensor's bytes moved into shared memory, the values kept
        _assert_served_right(lm)
        model.load_state_dict(own)  # the same checkpoint loaded again: every version counter bumped
        _assert_served_right(lm)
        model.load_state_dict(other.state_dict())
        for _ in range(2):  # refused again while nothing changes (unhashed: the change was seen)
            with pytest.raises(ConfigError, match=CHANGED):
                lm.generate(PROMPT, 2)
        model.load_state_dict(own)  # back to the weights the namespace names
        _assert_served_right(lm)
    finally:
        _close(lm)


# -- weights offloaded to the meta device (D5) ---------------------------------------------------

def test_a_model_with_weights_on_the_meta_device_is_refused_with_a_config_error(checkpoints):
    """As a device_map with offloaded layers leaves them: the last layer's weights on meta."""
    model, _ = load_model(checkpoints[0], tokenizer=False)
    namespace = namespace_for_model(model, block_tokens=BLOCK)
    model.model.layers[-1].to("meta")
    store = host_store(namespace)
    try:
        with pytest.raises(ConfigError, match="runs models on the CPU; this one has weights on meta"):
            KVTierLM(model, store, namespace, capacity_tokens=256)
        with pytest.raises(ConfigError, match="runs models on the CPU"):
            KVTierLM(model, store, capacity_tokens=256)  # its namespace derived there
        with pytest.raises(ConfigError, match="is on the meta device"):
            namespace_for_model(model, block_tokens=BLOCK)
    finally:
        store.close()


def test_a_model_accelerate_offloads_is_refused_with_a_config_error(checkpoints):
    accelerate = pytest.importorskip("accelerate")
    model, _ = load_model(checkpoints[0], tokenizer=False)
    namespace = namespace_for_model(model, block_tokens=BLOCK)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    store = host_store(namespace)
    try:
        with pytest.raises(ConfigError, match="runs models on the CPU; this one has weights on meta"):
            KVTierLM(model, store, namespace, capacity_tokens=256)
    finally:
        store.close()


# -- PEFT adapters (D6) --------------------------------------------------------------------------

@pytest.fixture
def peft_model(checkpoints):
    """A PeftModel with LoRA adapters "a" (active) and "b" on q/v, of random weights."""
    peft = pytest.importorskip("peft")
    base, _ = load_model(checkpoints[0], tokenizer=False)

    def lora():
        return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    wrapped = peft.get_peft_model(base, lora(), adapter_name="a")
    wrapped.add_adapter("b", lora())
    wrapped.set_adapter("a")
    return wrapped


def _set_scale(wrapped, scale: float) -> None:
    for module in wrapped.modules():
        if hasattr(module, "set_scale") and hasattr(module, "scaling"):
            module.set_scale("a", scale)


SWITCHES = {  # a switch of what the injected layers apply, and its undoing
    "set_adapter": (lambda w: w.set_adapter("b"), lambda w: w.set_adapter("a")),
    "disable_adapter_layers": (lambda w: w.base_model.disable_adapter_layers(),
                               lambda w: w.base_model.enable_adapter_layers()),
    "set_scale": (lambda w: _set_scale(w, 2.0), lambda w: _set_scale(w, 1.0)),
}


@pytest.mark.parametrize("switch", SWITCHES)
def test_an_adapter_switch_is_refused_until_it_is_undone(peft_model, switch):
    model = peft_model.base_model.model  # what KVTierLM is given (PeftModel.forward hides its arguments)
    lm = _session(model, namespace_for_model(model, block_tokens=BLOCK))
    switch_to, back = SWITCHES[switch]
    try:
        switch_to(peft_model)
        with pytest.raises(ConfigError, match=CHANGED + r" \(a PEFT tuner layer applies other adapters"):
            lm.generate(PROMPT, 2)
        back(peft_model)
        _assert_served_right(lm)
    finally:
        _close(lm)


def test_models_applying_other_adapters_get_other_namespaces(peft_model):
    model = peft_model.base_model.model
    a = namespace_for_model(model, block_tokens=BLOCK)
    peft_model.set_adapter("b")
    b = namespace_for_model(model, block_tokens=BLOCK)
    assert a.weights_revision != b.weights_revision
    store = host_store(a)
    try:
        with pytest.raises(ConfigError, match="built from other weights than this model's"):
            KVTierLM(model, store, a, capacity_tokens=256)
    finally:
        store.close()
