"""Masked prompts through the prepare()/save() API (audit s29 a6 D3).

Stored blocks hold K/V of positions all attended and numbered from 0, keyed by token ids only. HF
``generate`` masks pad positions (the ``attention_mask`` passed, or one it infers from the
generation config's ``pad_token_id`` when none is passed) and numbers the positions after them
otherwise, so from the first masked position on its K/V is not what a block key names. Old code
served a left-padded prompt's blocks to HF generate anyway: other logits and tokens, no error.
Now a hit and the saved blocks stop before the first masked position (a left-padded prompt loads
and saves nothing); without a mask, the pad id is read as HF generate reads it. Checked against HF
``generate`` alone: same logits at every step, same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402

VOCAB = 256
PAD, BOS, EOS = 0, 1, 2


def _llama(pad_token_id: int = PAD):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, initializer_range=0.1,
                                      pad_token_id=pad_token_id, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model():
    return _llama()


@pytest.fixture
def lm(model):
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    store = host_store(ns)
    session = KVTierLM(model, store, ns, capacity_tokens=256, poison=True)
    yield session
    session.close()
    store.check_integrity()
    store.close()


def _text(n: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n)   # no pad, bos or eos id


def _ids(prompt: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(prompt.astype(np.int64))[None]


GENERATE = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _hf_generate_with_and_without_kvtier(lm, prompt, mask=None, *, tell_prepare: bool):
    """HF generate alone, and HF generate on the cache ``lm.prepare`` loaded (given ``mask`` too when
    ``tell_prepare``); ``mask`` goes to both generate calls if not None (else HF infers it)."""
    extra = {} if mask is None else {"attention_mask": mask}
    with torch.inference_mode():
        alone = lm.model.generate(_ids(prompt), **extra, **GENERATE)
        with lm.request():
            prep = lm.prepare(prompt, extra_tokens=8, **(extra if tell_prepare else {}))
            warm = lm.model.generate(_ids(prompt), **extra, **{cache_keyword(lm.model): prep.cache}, **GENERATE)
    return prep.cached_tokens, alone, warm


def _assert_same_generation(warm, alone) -> None:
    diff = max(float((w - a).abs().max()) for w, a in zip(warm.logits, alone.logits))
    assert diff <= FP32_TOL, f"logits differ from HF generate alone by {diff:.3g}"
    assert warm.sequences[0].tolist() == alone.sequences[0].tolist()


def _left_padded(pads: int = 5, n: int = 60) -> tuple[np.ndarray, torch.Tensor]:
    prompt = np.concatenate([np.full(pads, PAD), _text(n)])
    mask = torch.ones(1, prompt.size, dtype=torch.long)
    mask[0, :pads] = 0
    return prompt, mask


@pytest.mark.parametrize("how", ["mask-given", "mask-inferred-from-the-pad-id"])
def test_hf_generate_on_the_prepared_cache_equals_hf_generate_alone_for_a_left_padded_prompt(lm, how):
    """kvtier's own generate stored this prompt's blocks first (pads attended). Old code: 64 cached,
    first-step logits 1.35 off, other tokens."""
    prompt, mask = _left_padded()
    lm.generate(prompt, 1)
    lm.wait_saves()
    given = how == "mask-given"
    cached, alone, warm = _hf_generate_with_and_without_kvtier(lm, prompt, mask if given else None,
                                                               tell_prepare=given)
    assert cached == 0
    _assert_same_generation(warm, alone)


def _assert_the_hit_stops_before_the_pad_at_40(lm) -> None:
    """A prompt of 70 tokens with the pad id at position 40, saved, then run through HF generate on
    the prepared cache (no mask given to prepare): blocks 0-1 hit, and the generation is HF's alone."""
    prompt = _text(70)
    prompt[40] = PAD
    lm.generate(prompt, 1)
    lm.wait_saves()
    cached, alone, warm = _hf_generate_with_and_without_kvtier(lm, prompt, tell_prepare=False)
    assert cached == 32
    _assert_same_generation(warm, alone)


def test_without_a_mask_the_hit_stops_before_the_first_pad_id_as_hf_generate_masks_it(lm):
    """A pad id inside the prompt (position 40): HF generate masks it, so blocks 0-1 (before it)
    hold its K/V and the rest do not. Old code: 64 cached and other logits."""
    _assert_the_hit_stops_before_the_pad_at_40(lm)


def test_a_masked_forward_saves_only_the_blocks_before_its_first_masked_position(lm):
    """Right padding (masked from position 60): the forward under the mask holds the text's K/V in
    blocks 0-2; save() with the mask stores those three, and a later prompt hits them and equals its
    recompute. Old code: save() took no mask (a TypeError here; without it, all 4 blocks saved)."""
    text = _text(60)
    prompt = np.concatenate([text, np.full(10, PAD)])
    mask = torch.ones(1, prompt.size, dtype=torch.long)
    mask[0, 60:] = 0
    with torch.inference_mode(), lm.request():
        prep = lm.prepare(prompt, attention_mask=mask)
        lm.model(input_ids=_ids(prompt), attention_mask=mask, **{cache_keyword(lm.model): prep.cache}, use_cache=True)
        statuses = lm.save(prompt, attention_mask=mask).result()
    assert len(statuses) == 3
    later = np.concatenate([text, _text(20, seed=6)])
    warm = lm.generate(later, 4, save=False)
    cold = lm.generate(later, 4, use_store=False, save=False)
    assert warm.cached_tokens == 48
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= FP32_TOL and warm.tokens == cold.tokens


def test_a_left_padded_prompt_saves_nothing(lm):
    """Old code: save() took no mask; without it, all 4 blocks of the masked forward were saved."""
    prompt, mask = _left_padded()
    with torch.inference_mode(), lm.request():
        prep = lm.prepare(prompt, attention_mask=mask)
        lm.model(input_ids=_ids(prompt), attention_mask=mask, **{cache_keyword(lm.model): prep.cache}, use_cache=True)
        assert lm.save(prompt, attention_mask=mask) is None
        assert lm.save(prompt) is None   # no mask: the pad id is masked, as HF generate infers it
    assert lm.store.lookup(block_keys(lm.namespace, prompt)).hit_blocks == 0


def test_control_a_pad_id_equal_to_eos_is_not_masked_and_hits_in_full():
    """HF generate infers no mask when the pad id is an eos id (it attends every token): neither does
    prepare(), and HF generate on the prepared cache still equals HF generate alone."""
    model = _llama(pad_token_id=EOS)
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    store = host_store(ns)
    lm = KVTierLM(model, store, ns, capacity_tokens=256, poison=True)
    try:
        prompt = _text(70)
        prompt[40] = EOS
        lm.generate(prompt, 1)
        lm.wait_saves()
        cached, alone, warm = _hf_generate_with_and_without_kvtier(lm, prompt, tell_prepare=False)
        assert cached == 64
        _assert_same_generation(warm, alone)
    finally:
        lm.close()
        store.close()


def test_control_kvtiers_own_generate_attends_every_token_and_hits_past_pad_ids(lm):
    """generate() runs the model without a mask: its blocks past a pad id are what it computes, so
    they still hit, equal to its own recompute and to the model's full forward."""
    prompt = _text(70)
    prompt[[3, 40]] = PAD
    lm.generate(prompt[:66], 1)
    lm.wait_saves()
    warm = lm.generate(prompt, 4, save=False)
    cold = lm.generate(prompt, 4, use_store=False, save=False)
    with torch.inference_mode():
        full = lm.model(input_ids=_ids(prompt), use_cache=False).logits[0, -1]
    assert warm.cached_tokens == 64
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= FP32_TOL and warm.tokens == cold.tokens
    assert float((warm.first_logits - full).abs().max()) <= FP32_TOL


@pytest.mark.parametrize("mask", [np.ones(69), np.ones(71), np.ones((2, 70))], ids=["short", "long", "batch-2"])
def test_a_mask_that_is_not_one_entry_per_token_is_refused(lm, mask):
    with pytest.raises(ValueError, match="attention_mask"):
        lm.prepare(_text(70), attention_mask=mask)


# -- s29 a10 D1: the pad id HF generate masks is read at each call, as HF generate reads it ----------

@pytest.fixture
def lm_built_before_the_pad_id():
    """A session over a model whose generation config gets its pad id only after the session is
    built (``model.generation_config.pad_token_id = tokenizer.pad_token_id``, as scripts do before
    calling HF generate)."""
    unpadded = _llama(pad_token_id=None)
    ns = namespace_for_model(unpadded, block_tokens=BLOCK, weights_revision="test")
    store = host_store(ns)
    session = KVTierLM(unpadded, store, ns, capacity_tokens=256, poison=True)
    unpadded.generation_config.pad_token_id = PAD
    yield session
    session.close()
    store.check_integrity()
    store.close()


def test_a_pad_id_set_after_the_session_is_built_stops_the_hit_as_hf_generate_masks_it(lm_built_before_the_pad_id):
    """Old code read the pad id once, at construction: 64 cached, logits 0.36 off, another token."""
    lm = lm_built_before_the_pad_id
    _assert_the_hit_stops_before_the_pad_at_40(lm)


def test_a_pad_id_set_after_the_session_is_built_stops_what_save_stores(lm_built_before_the_pad_id):
    """HF generate ran under the mask it infers from the new pad id (position 40): save() without a
    mask stores blocks 0-1 only. Old code stored all 4, and later prompts sharing the prefix loaded
    the masked K/V (logits 0.63 off their recompute)."""
    lm = lm_built_before_the_pad_id
    prompt = _text(70)
    prompt[40] = PAD
    with torch.inference_mode(), lm.request():
        prep = lm.prepare(prompt, extra_tokens=8)
        out = lm.model.generate(_ids(prompt), **{cache_keyword(lm.model): prep.cache}, **GENERATE)
        statuses = lm.save(out.sequences[0], known_blocks=prep.known_blocks).result()
    assert len(statuses) == 2
    assert lm.store.lookup(block_keys(lm.namespace, prompt)).hit_blocks == 2


# -- s29 a10 D3: save() after generate(save=False) stores what generate() would have -----------------

def test_save_after_kvtiers_own_generate_stores_what_generate_would_have(lm):
    """The demo's pattern: generate(save=False), then save(prompt + reply[:-1]). generate() attends
    every token, pad ids included, so its K/V past a pad id is what a block key names. Old code
    stopped at the pad id (position 40): 2 of the prompt's 4 blocks stored, where generate() stores 4."""
    prompt = _text(70)
    prompt[40] = PAD
    first = lm.generate(prompt, 4, save=False)
    held = np.concatenate([prompt, np.asarray(first.tokens[:-1], dtype=np.int64)])
    lm.save(held, known_blocks=first.known_blocks).result()
    assert lm.store.lookup(block_keys(lm.namespace, prompt)).hit_blocks == 4
    warm = lm.generate(prompt, 4, save=False)
    cold = lm.generate(prompt, 4, use_store=False, save=False)
    assert warm.cached_tokens == 64
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= FP32_TOL and warm.tokens == cold.tokens
