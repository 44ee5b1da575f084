"""Model families whose cache or positions kvtier cannot treat as a plain per-token KV (audit s27 D2, D3).

* A model without attention (Mamba, RWKV, ...) caches a recurrent state: refused with a
  ``ConfigError`` that says so, not an ``AttributeError`` from deep in the layout code.
* The RoBERTa family numbers a token's position by the count of non-pad tokens before it
  (``create_position_ids_from_input_ids``): after a cached prefix holding the pad id, the suffix
  would be numbered from the prefix's length, a recompute numbers it from its count of non-pad
  tokens. A hit stops before the first block holding the pad id; checked against the model's
  own full forward, with a prompt without the pad id still hitting in full (the control).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, kv_layout, namespace_for_model  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402

# -- models without attention ------------------------------------------------------------------

NO_ATTENTION = {
    "mamba": lambda: transformers.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=4),
    "rwkv": lambda: transformers.RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                            attention_hidden_size=32, intermediate_size=64),
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4,
                                                head_dim=16, state_size=4, n_groups=1),
}


@pytest.mark.parametrize("family", sorted(NO_ATTENTION))
def test_a_model_without_attention_is_refused_with_a_config_error_naming_why(family):
    config = NO_ATTENTION[family]()
    with pytest.raises(ConfigError, match="no attention heads"):   # old code: AttributeError
        kv_layout(config, "float32", BLOCK)
    if family == "mamba2":
        return  # the config alone: its model's reference kernels are slow on a CPU
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match="recurrent state"):
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64).close()


# -- positions numbered past pad tokens (RoBERTa and kin) ------------------------------------------

PAD = 1
VOCAB = 512


def _roberta(path):
    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=1024, is_decoder=True,
                                        pad_token_id=PAD, initializer_range=0.3)   # sharp: a wrong position shows
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _load(path, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **config).eval()


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    return _roberta(tmp_path_factory.mktemp("roberta"))


@pytest.fixture(scope="module")
def roberta(roberta_dir):
    return _load(roberta_dir)


@pytest.fixture
def roberta_session(roberta):
    ns = namespace_for_model(roberta, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(roberta, store, ns, capacity_tokens=256)
    plain = KVTierLM(roberta, None, block_tokens=BLOCK, capacity_tokens=256)
    yield lm, plain
    lm.close()
    plain.close()
    store.check_integrity()
    store.close()


def _prompt(seed: int, pads=()) -> np.ndarray:
    prompt = np.random.default_rng(seed).integers(PAD + 1, VOCAB, 150)
    prompt[list(pads)] = PAD
    return prompt


def _recompute(model, prompt: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(prompt.astype(np.int64))[None]).logits[0, -1].float()


def _assert_equals_recompute(lm, plain, prompt, cached: int) -> None:
    warm = lm.generate(prompt, 4, save=False)
    diff = float((warm.first_logits - _recompute(lm.model, prompt)).abs().max())
    assert diff <= FP32_TOL, f"{warm.cached_tokens} cached positions: logits differ from the recompute by {diff:.3g}"
    assert warm.cached_tokens == cached
    assert warm.tokens == plain.generate(prompt, 4).tokens


@pytest.mark.parametrize("pads, cached", [
    ((40, 70), 32),    # first pad in block 2: blocks 0-1 load, the rest is recomputed
    ((10,), 0),        # in block 0: nothing loads
    ((99,), 96),       # in block 6, past the cached prefix of 6 blocks: everything cached loads
], ids=["block2", "block0", "past-the-hit"])
def test_a_hit_stops_before_the_first_block_holding_the_pad_id_and_equals_the_recompute(roberta_session, pads, cached):
    lm, plain = roberta_session
    prompt = _prompt(1, pads)
    lm.generate(prompt[:100], 2)
    lm.wait_saves()
    _assert_equals_recompute(lm, plain, prompt, cached)   # old code: 96 cached, logits ~5 off


def test_control_a_prompt_without_the_pad_id_hits_in_full_and_equals_the_recompute(roberta_session):
    lm, plain = roberta_session
    prompt = _prompt(2)
    lm.generate(prompt[:100], 2)
    lm.wait_saves()
    _assert_equals_recompute(lm, plain, prompt, 96)


def test_models_that_differ_in_the_pad_id_get_different_namespaces(roberta_dir, roberta):
    """The pad id shifts every position of these models (they start after it), though it is no
    part of the config's fingerprint (for other models it changes no KV): the same files loaded
    with another pad id share no KV."""
    other = _load(roberta_dir, pad_token_id=0)
    a = namespace_for_model(roberta, block_tokens=BLOCK)
    b = namespace_for_model(other, block_tokens=BLOCK)
    assert a.weights_revision == b.weights_revision   # the same weights: only the pad id tells them apart
    assert a.root != b.root and a.model_id.endswith(":pads=1") and b.model_id.endswith(":pads=0")


def test_a_model_numbering_past_pads_without_a_pad_id_is_refused(roberta):
    import copy

    broken = copy.deepcopy(roberta)
    broken.roberta.embeddings.padding_idx = None
    with pytest.raises(ConfigError, match="counting non-pad tokens"):
        KVTierLM(broken, None, block_tokens=BLOCK, capacity_tokens=64).close()
