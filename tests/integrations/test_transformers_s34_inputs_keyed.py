"""Blocks are keyed by token ids alone: K/V that other forward inputs made is never saved, and
models whose K/V depends on media are refused (audit s34 a10 D1-D5).

A block's key names its tokens; its K/V must be what those tokens give, every position attended and
numbered from 0. After a miss nothing checked what the caller's forward was fed, so K/V computed
from ``inputs_embeds`` (D2), at other ``position_ids`` (D3), or with GPT-2's ``token_type_ids`` (D4)
was saved under the ids and served to every later request on them. A multimodal model (LLaVA,
Qwen2-VL) feeds each image as a run of the same placeholder ids (D1), and Qwen2-VL's ``rope_deltas``
shift a hit's positions (D5): refused at construction.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import ConfigError, LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402
from tests.integrations.test_transformers_padding import (  # noqa: E402
    BOS, EOS, GENERATE, PAD, VOCAB, _ids, _llama, _text)

TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)


def _session(model):
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    return KVTierLM(model, host_store(ns), ns, capacity_tokens=256, poison=True)


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture
def lm(llama):
    session = _session(llama)
    yield session
    _close(session)


def _close(session) -> None:
    session.close()
    session.store.check_integrity()
    session.store.close()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=BOS, eos_token_id=EOS)
    return transformers.GPT2LMHeadModel(config).eval()


def _assert_served_as_recomputed(lm, prompt: np.ndarray, cached: int) -> None:
    warm = lm.generate(prompt, 2, save=False)
    cold = lm.generate(prompt, 2, use_store=False, save=False)
    assert warm.cached_tokens == cached
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= FP32_TOL


def _forward_after_a_miss(lm, prompt: np.ndarray, **inputs) -> None:
    """The caller's forward on the cache prepare() gave for ``prompt`` (nothing cached), then save()."""
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        assert prep.cached_tokens == 0
        lm.model(**inputs, **{cache_keyword(lm.model): prep.cache}, use_cache=True)
        return lm.save(prompt)


# -- D1 / D5: multimodal models and M-RoPE state refused at construction -----------------------------

def _llava():
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**TEXT),
                                      image_token_id=255, vision_feature_layer=-1,
                                      vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def _qwen2_vl():
    text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=250,
                                        vision_start_token_id=251, vision_end_token_id=252, video_token_id=253)
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("build", [_llava, _qwen2_vl], ids=["llava", "qwen2-vl"])
def test_a_multimodal_model_is_refused_at_construction_naming_its_media(build):
    """Every image is a run of the same placeholder ids: image B's request hit the blocks image A's
    saved and answered exactly as A (LLaVA); Qwen2-VL's rope_deltas shifted every hit's positions."""
    model = build()
    with pytest.raises(ConfigError, match="multimodal config \\(vision_config\\).*keys blocks by token ids only"):
        namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    store = host_store(namespace_for_model(_llama(), block_tokens=BLOCK, weights_revision="test"))
    with pytest.raises(ConfigError, match="takes media inputs \\(.*pixel_values.*kvtier cannot serve multimodal"):
        KVTierLM(model, store, weights_dir=None)
    store.close()


def test_a_model_keeping_mrope_rope_deltas_is_refused_at_construction(llama):
    """Qwen2-VL-style M-RoPE state on the base model shifts the positions of a forward that starts
    past 0, as a hit's suffix does: refused, whatever the config says."""
    torch.manual_seed(0)
    model = _llama()
    model.model.rope_deltas = None   # what Qwen2-VL's text model holds until an image request sets it
    with pytest.raises(ConfigError, match="model keeps rope_deltas"):
        _session(model)


def test_the_text_model_of_a_multimodal_family_is_still_served():
    """Refusing media leaves text: a Gemma 3 text model (its multimodal sibling is refused) hits."""
    config = transformers.Gemma3TextConfig(**TEXT, head_dim=16, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    session = _session(transformers.Gemma3ForCausalLM(config).eval())
    try:
        prompt = _text(40)
        session.generate(prompt, 1).saved.result()
        _assert_served_as_recomputed(session, prompt, cached=32)
    finally:
        _close(session)


# -- D2: inputs_embeds after a miss ------------------------------------------------------------------

def test_inputs_embeds_fed_after_a_miss_are_never_saved_under_the_ids(lm):
    """Embeddings of 5 positions replaced (a soft prompt, image features): old code saved their K/V
    under the prompt's ids, and a later plain request hit it (1.1 off its recompute)."""
    prompt = _text(40)
    embeds = lm.model.get_input_embeddings()(_ids(prompt)).detach()
    embeds[:, 5:10] = torch.randn_like(embeds[:, 5:10])
    with pytest.raises(LayoutError, match="nothing of this request is saved: a forward fed inputs_embeds.*"
                                          "from position 0"):
        _forward_after_a_miss(lm, prompt, inputs_embeds=embeds)
    _assert_served_as_recomputed(lm, prompt, cached=0)


def test_inputs_embeds_through_opts_forward_method_are_never_saved():
    """OPT's head calls its decoder, skipping its base model: the decoder's call is watched too."""
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=128, init_std=0.1, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(0)
    session = _session(transformers.OPTForCausalLM(config).eval())
    try:
        prompt = _text(40)
        embeds = session.model.get_input_embeddings()(_ids(prompt)).detach()
        with torch.no_grad(), session.request():
            prep = session.prepare(prompt)
            session.model.forward(inputs_embeds=embeds, past_key_values=prep.cache, use_cache=True)
            with pytest.raises(LayoutError, match="a forward fed inputs_embeds"):
                session.save(prompt)
    finally:
        _close(session)


def test_a_reference_forward_of_inputs_embeds_without_the_cache_leaves_the_save_alone(lm):
    """Only forwards on the prepared cache count: the caller's own run of embeddings without it, in
    the same request, changes nothing the cache holds."""
    prompt = _text(40)
    keyword = cache_keyword(lm.model)
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        lm.model(input_ids=_ids(prompt), **{keyword: prep.cache}, use_cache=True)
        lm.model(inputs_embeds=lm.model.get_input_embeddings()(_ids(prompt)), use_cache=False)
        assert len(lm.save(prompt).result()) == 2
    _assert_served_as_recomputed(lm, prompt, cached=32)


# -- D3: positions and masks the blocks do not have ------------------------------------------------------

def test_position_ids_that_do_not_number_from_zero_are_never_saved(lm):
    """Packed or offset positions (100..139): old code saved keys rotated for them as positions 0..39."""
    prompt = _text(40)
    with pytest.raises(LayoutError, match="position_ids that do not number its 40 positions 0..39.*from position 0"):
        _forward_after_a_miss(lm, prompt, input_ids=_ids(prompt), position_ids=torch.arange(100, 140)[None])
    _assert_served_as_recomputed(lm, prompt, cached=0)


def test_position_ids_numbering_the_positions_as_stored_are_saved(lm):
    prompt = _text(40)
    statuses = _forward_after_a_miss(lm, prompt, input_ids=_ids(prompt), position_ids=torch.arange(40)[None],
                                     cache_position=torch.arange(40)).result()
    assert len(statuses) == 2
    _assert_served_as_recomputed(lm, prompt, cached=32)


def test_suffix_positions_offset_after_a_hit_are_never_saved(lm):
    """After 32 loaded, a suffix fed at positions 200.. : its blocks are not saved (the loaded ones
    stay what they were)."""
    prompt = _text(70)
    lm.generate(prompt[:40], 1).saved.result()
    keyword = cache_keyword(lm.model)
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        assert prep.cached_tokens == 32
        lm.model(input_ids=_ids(prompt[32:]), position_ids=torch.arange(200, 238)[None],
                 **{keyword: prep.cache}, use_cache=True)
        with pytest.raises(LayoutError, match="position_ids .* 32..69.*from position 32"):
            lm.save(prompt)
    _assert_served_as_recomputed(lm, prompt, cached=32)


def test_a_forward_mask_that_save_was_not_told_of_is_never_saved(lm):
    """The forward masks position 20; save() is given no mask (the prompt holds no pad id): the
    blocks from 16 on hold K/V computed under a mask no key names. Told the mask, save() stores the
    block before it."""
    prompt = _text(40)
    mask = torch.ones(1, 40, dtype=torch.long)
    mask[0, 20] = 0
    with pytest.raises(LayoutError, match="attention_mask masks position 20.*from position 20"):
        _forward_after_a_miss(lm, prompt, input_ids=_ids(prompt), attention_mask=mask)
    assert lm.prepare(prompt).cached_tokens == 0
    keyword = cache_keyword(lm.model)
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt, attention_mask=mask)
        lm.model(input_ids=_ids(prompt), attention_mask=mask, **{keyword: prep.cache}, use_cache=True)
        assert len(lm.save(prompt, attention_mask=mask).result()) == 1
    _assert_served_as_recomputed(lm, prompt, cached=16)


def test_hf_generate_on_a_left_padded_prompt_still_saves_nothing_without_an_error(lm):
    """Positions HF numbers from the mask differ from 0.. exactly where the mask prepare() and save()
    were given masks: nothing to save, as before, and no refusal."""
    prompt = np.concatenate([[PAD] * 3, _text(40)])
    mask = torch.from_numpy((prompt != PAD).astype(np.int64))[None]
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt, attention_mask=mask, extra_tokens=8)
        out = lm.model.generate(_ids(prompt), attention_mask=mask, past_key_values=prep.cache, **GENERATE)
        assert lm.save(out.sequences[0], attention_mask=mask) is None


# -- D4: GPT-2's token_type_ids --------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_lm():
    session = _session(_gpt2())
    yield session
    _close(session)


def _hf_generate_on_prepared(lm, prompt, token_types):
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt, extra_tokens=8)
        out = lm.model.generate(_ids(prompt), token_type_ids=token_types, past_key_values=prep.cache, **GENERATE)
        return prep, lm.save(out.sequences[0])


@pytest.mark.parametrize("segments", ["two", "zeros"])
def test_gpt2_token_type_ids_through_hf_generate_are_never_saved(gpt2_lm, segments):
    """GPT-2 adds wte(token_type_ids) to every position's input, zeros included: old code saved
    request A's K/V (two segments) and served it to request B (none), 0.056 off its recompute."""
    prompt = _text(40, seed=11 if segments == "two" else 12)
    token_types = torch.zeros(1, 40, dtype=torch.long)
    if segments == "two":
        token_types[:, 20:] = 1
    with pytest.raises(LayoutError, match="nothing of this request is saved: a forward passed token_type_ids"):
        _hf_generate_on_prepared(gpt2_lm, prompt, token_types)
    _assert_served_as_recomputed(gpt2_lm, prompt, cached=0)


def test_gpt2_token_type_ids_after_a_hit_are_refused_by_name(gpt2_lm):
    """After a load, a forward with token_type_ids is refused naming them (old code refused it by
    accident, saying the suffix's ids were wrong: the embedding hook saw the types, embedded last)."""
    prompt = _text(40, seed=13)
    gpt2_lm.generate(prompt, 1).saved.result()
    with pytest.raises(LayoutError, match="the first forward after prepare\\(\\) passes token_type_ids"):
        _hf_generate_on_prepared(gpt2_lm, prompt, torch.zeros(1, 40, dtype=torch.long))
    prep, saved = _hf_generate_on_prepared(gpt2_lm, prompt, None)   # without them: served, saved
    assert prep.cached_tokens == 32 and len(saved.result()) == 2


def test_zero_token_types_of_a_model_that_takes_none_as_zeros_are_saved():
    """The BERT family embeds None as type 0: zeros change no K/V, and are saved."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, is_decoder=True, pad_token_id=PAD)
    torch.manual_seed(0)
    session = _session(transformers.BertLMHeadModel(config).eval())
    try:
        prompt = _text(40)
        statuses = _forward_after_a_miss(session, prompt, input_ids=_ids(prompt),
                                         token_type_ids=torch.zeros(1, 40, dtype=torch.long)).result()
        assert len(statuses) == 2
        with pytest.raises(LayoutError, match="token_type_ids"):
            _forward_after_a_miss(session, _text(40, seed=9), input_ids=_ids(_text(40, seed=9)),
                                  token_type_ids=torch.ones(1, 40, dtype=torch.long))
        _assert_served_as_recomputed(session, prompt, cached=32)
    finally:
        _close(session)


def test_no_hook_is_left_on_the_model_after_close(llama):
    session = _session(llama)
    with torch.no_grad(), session.request():
        session.prepare(_text(40))
    _close(session)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in llama.modules())


def test_sessions_dropped_without_close_leave_no_hook_and_no_storage_alive(llama):
    """Every prepare() watches the model's forwards until the next request or close(); the hooks held
    the storage and its KV tensor, so sessions dropped without close() kept both for good
    (audit s34 r11 D1)."""
    import gc
    import weakref

    def serve_one_request():
        session = _session(llama)
        prompt = _text(40)
        with torch.no_grad(), session.request():
            prep = session.prepare(prompt)
            llama(input_ids=torch.as_tensor(prompt[None]), **{cache_keyword(llama): prep.cache}, use_cache=True)
        session.store.close()
        return weakref.ref(session.storage)

    storages = [serve_one_request() for _ in range(3)]
    gc.collect()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in llama.modules())
    assert [ref() for ref in storages] == [None] * 3
