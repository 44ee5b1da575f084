"""HF ``generate`` modes on the cache ``prepare()`` hands out (audit s30 a5 D1-D3).

Stored blocks are gathered by position and keyed by token, so position i of the cache must hold
token i's K/V, fed once. Some HF generate modes break that: ``use_cache=False`` feeds the whole
sequence again at every step, and assisted / prompt-lookup decoding and ``prefill_chunk_size`` feed
the whole prompt after a loaded prefix. Old code served those without an error and saved K/V of
other positions under real block keys. Now a forward that re-feeds a loaded prefix is refused
before its K/V is written, and ``save()`` stores nothing of a cache holding another count of
positions than tokens; the same modes on an empty cache are served as HF serves them alone.
HF generate runs under ``no_grad``, as HF itself does (not ``inference_mode``), unless a test says.

A count of positions cannot tell the uncached suffix from as many of the prompt's first tokens:
HF's chunked prefill with a chunk as long as the suffix (audit s30 a11 D1) is refused by the ids
the first forward after a load feeds (hooks on the model, its base model and its input embeddings,
removed after it).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.errors import LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402
from tests.integrations.test_transformers_padding import (  # noqa: E402
    BOS, EOS, GENERATE, PAD, VOCAB, _ids, _llama, _text)

#: HF generate modes that feed the whole prompt again after the prefix a cache holds (each a
#: factory: an assistant model is built per call, since HF keeps state on it). The tests' prompt
#: has 70 tokens, 64 of them loaded on a hit: a chunk of 6 is the prompt's first 6 tokens, the
#: length of the uncached suffix, and ends where the suffix ends.
REFEEDING_MODES = {
    "prompt-lookup": lambda: dict(prompt_lookup_num_tokens=3),
    "assisted": lambda: dict(assistant_model=_llama()),
    "chunked-prefill": lambda: dict(prefill_chunk_size=16),
    "chunked-prefill-as-long-as-the-suffix": lambda: dict(prefill_chunk_size=6),
}

#: the refusal of a first forward after a load that is not the prompt's uncached suffix
REFUSED_REFEED = ("the first forward after prepare\\(\\) .* after the 64 loaded.*: feed prompt\\[64:\\] only, "
                  "as input_ids.*assisted or prompt-lookup.*prefill_chunk_size.*use_store=False")


@pytest.fixture(scope="module")
def model():
    return _llama()


def _session(model, capacity_tokens: int = 256, poison: bool = True):
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    return KVTierLM(model, host_store(ns), ns, capacity_tokens=capacity_tokens, poison=poison)


@pytest.fixture
def lm(model):
    session = _session(model)
    yield session
    session.close()
    session.store.check_integrity()
    session.store.close()


def _stored(lm) -> set:
    return set(lm.store.tiers[0].keys())


def _assert_later_request_equals_its_recompute(lm, text: np.ndarray, cached: int) -> None:
    """What the store holds for ``text`` is its own K/V: a hit gives the recompute's logits."""
    warm = lm.generate(text, 4, save=False)
    cold = lm.generate(text, 4, use_store=False, save=False)
    assert warm.cached_tokens == cached
    diff = float((warm.first_logits - cold.first_logits).abs().max())
    assert diff <= FP32_TOL, f"a later request is served K/V {diff:.3g} off its recompute"
    assert warm.tokens == cold.tokens


def _assert_same_generation(warm, alone) -> None:
    diff = max(float((w - a).abs().max()) for w, a in zip(warm.logits, alone.logits))
    assert diff <= FP32_TOL, f"logits differ from HF generate alone by {diff:.3g}"
    assert warm.sequences[0].tolist() == alone.sequences[0].tolist()


def _hf_generate_on_prepared(lm, prompt: np.ndarray, **mode):
    """HF generate on the cache ``lm.prepare`` loaded (the caller holds ``lm.request()``)."""
    prep = lm.prepare(prompt, extra_tokens=GENERATE["max_new_tokens"] + 2)
    out = lm.model.generate(_ids(prompt), **{cache_keyword(lm.model): prep.cache}, **GENERATE, **mode)
    return prep, out


def _store_prompt(lm, prompt: np.ndarray) -> None:
    lm.generate(prompt, 1)
    lm.wait_saves()


# -- D1: save() stores only a cache holding one position per token --------------------------------

def test_save_refuses_a_cache_that_hf_generate_without_use_cache_fed_again_and_stores_nothing(lm):
    """use_cache=False: HF feeds the whole sequence at every step into the cache it is given (75
    tokens fed, 70 + 71 + ... positions held). Old code saved positions 0..63 of that cache (the
    prompt fed once, then again from position 70) under the keys of blocks 0..3 and more: a later
    request of the sequence was served K/V of other positions (logits 1.9 off its recompute).
    The store starts empty: no hit is involved."""
    prompt = _text(70)
    with torch.no_grad(), lm.request():
        prep, out = _hf_generate_on_prepared(lm, prompt, use_cache=False)
        sequence = out.sequences[0].numpy()
        assert lm.storage.held_tokens() > sequence.size
        with pytest.raises(LayoutError, match=f"save\\(\\) got {sequence.size - 1} tokens, but the cache holds"):
            lm.save(sequence[:-1], known_blocks=prep.known_blocks)
    assert _stored(lm) == set()
    _assert_later_request_equals_its_recompute(lm, sequence, cached=0)


def test_save_refuses_tokens_that_are_not_one_per_held_position(lm):
    """The prompt alone after HF generated 6 tokens into the cache: 70 tokens for 75 positions.
    Its blocks would be right here, but save() cannot tell such a prefix from a re-fed cache."""
    prompt = _text(70)
    with torch.no_grad(), lm.request():
        _hf_generate_on_prepared(lm, prompt)
        with pytest.raises(LayoutError, match="save\\(\\) got 70 tokens, but the cache holds K/V of 75 positions"):
            lm.save(prompt)
    assert _stored(lm) == set()


@pytest.mark.parametrize("whole", [True, False], ids=["sequence", "sequence-less-its-last-token"])
def test_control_save_takes_hf_generates_sequence_with_or_without_its_last_token(lm, whole):
    """HF never feeds the last token it generates: the output sequence is one token longer than the
    cache; either is accepted, and what is stored is served equal to a recompute."""
    prompt = _text(70)
    with torch.no_grad(), lm.request():
        prep, out = _hf_generate_on_prepared(lm, prompt)
        sequence = out.sequences[0].numpy()
        statuses = lm.save(sequence if whole else sequence[:-1], known_blocks=prep.known_blocks).result()
    assert len(statuses) == 4   # 75 positions held: 4 full blocks
    _assert_later_request_equals_its_recompute(lm, sequence, cached=64)


# -- D2: a loaded prefix followed by the whole prompt again is refused before it is written ---------

@pytest.mark.parametrize("mode", list(REFEEDING_MODES))
def test_hf_generate_that_feeds_the_prompt_again_after_a_hit_is_refused_and_nothing_is_stored(lm, mode):
    """HF feeds all 70 prompt tokens after the 64 loaded. Old code appended them at positions 64..:
    logits 4.7 off HF generate alone, other tokens, no error, and save() stored that K/V under the
    keys of blocks 4 and 5, served to a later plain lm.generate (2.9 off its recompute)."""
    prompt = _text(70)
    _store_prompt(lm, prompt)
    before = _stored(lm)
    with torch.no_grad(), lm.request():
        with pytest.raises(LayoutError, match=REFUSED_REFEED):
            _hf_generate_on_prepared(lm, prompt, **REFEEDING_MODES[mode]())
        assert all(layer.get_seq_length() == 64 for layer in lm.storage.layers)   # refused before the copy
        with pytest.raises(LayoutError, match="nothing of this request is saved"):
            lm.save(np.concatenate([prompt, _text(30, seed=9)]))
    assert _stored(lm) == before
    # The instance serves the next request, and what the store holds is still the prompt's own K/V.
    _assert_later_request_equals_its_recompute(lm, prompt, cached=64)
    with torch.no_grad():
        alone = lm.model.generate(_ids(prompt), **GENERATE)
        with lm.request():
            prep, warm = _hf_generate_on_prepared(lm, prompt)
    assert prep.cached_tokens == 64
    _assert_same_generation(warm, alone)


@pytest.mark.parametrize("mode", list(REFEEDING_MODES))
def test_control_the_same_modes_on_an_empty_cache_equal_hf_generate_alone_and_store_right_blocks(lm, mode):
    """With nothing loaded, HF feeds the prompt from position 0 (whole or in chunks) and each
    position once: served as HF serves it alone, and saved."""
    prompt = _text(70)
    with torch.no_grad():
        alone = lm.model.generate(_ids(prompt), **GENERATE, **REFEEDING_MODES[mode]())
        with lm.request():
            prep, warm = _hf_generate_on_prepared(lm, prompt, **REFEEDING_MODES[mode]())
            sequence = warm.sequences[0].numpy()
            lm.save(sequence, known_blocks=prep.known_blocks).result()
    assert prep.cached_tokens == 0
    _assert_same_generation(warm, alone)
    assert lm.store.lookup(block_keys(lm.namespace, sequence)).hit_blocks == 4
    _assert_later_request_equals_its_recompute(lm, sequence, cached=64)


def test_a_forward_feeding_the_suffix_in_two_parts_after_a_load_is_refused(lm):
    """The contract prepare() states: after a load, the first forward feeds the whole uncached
    suffix. A part of it cannot be told from a re-fed prompt's first chunk (both are short of the
    prompt's end), so it is refused too; the whole suffix passes."""
    prompt = _text(70)
    _store_prompt(lm, prompt)
    keyword = cache_keyword(lm.model)
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        with pytest.raises(LayoutError, match="appends 3 positions after the 64 loaded"):
            lm.model(input_ids=_ids(prompt[64:67]), **{keyword: prep.cache}, use_cache=True)
        prep = lm.prepare(prompt)
        logits = lm.model(input_ids=_ids(prompt[64:]), **{keyword: prep.cache}, use_cache=True).logits[0, -1]
        full = lm.model(input_ids=_ids(prompt), use_cache=False).logits[0, -1]
    assert float((logits - full).abs().max()) <= FP32_TOL


# -- s30 a11 D1: the first forward after a load is checked by its token ids -------------------------

GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _hooks_left(lm) -> int:
    """Forward pre-hooks on the model's modules (kvtier's watch the ids fed)."""
    return sum(len(module._forward_pre_hooks) for module in lm.model.modules())


@pytest.mark.parametrize("grad", list(GRAD_MODES))
def test_hf_chunked_prefill_whose_chunk_is_as_long_as_the_suffix_is_refused_after_a_hit(lm, grad):
    """prefill_chunk_size = 6 = 70 - 64: HF's first chunk is prompt[:6], 6 positions that end at the
    prompt's end. Old code checked only where that append ended: it wrote prompt[:6]'s K/V at
    positions 64..69, appended the later chunks unchecked (139 positions for 70 tokens) and HF
    generated other tokens (logits 0.71 off HF alone), with no error."""
    prompt = _text(70)
    _store_prompt(lm, prompt)
    with GRAD_MODES[grad](), lm.request():
        with pytest.raises(LayoutError, match="layer 0: the first forward after prepare\\(\\) feeds 6 token ids "
                                              "after the 64 loaded that are not prompt\\[64:\\] of a 70-token "
                                              "prompt: feed prompt\\[64:\\] only.*prefill_chunk_size"):
            _hf_generate_on_prepared(lm, prompt, prefill_chunk_size=6)
        assert all(layer.get_seq_length() == 64 for layer in lm.storage.layers)   # refused before the copy
    assert _hooks_left(lm) == 0
    _assert_later_request_equals_its_recompute(lm, prompt, cached=64)


FORWARDS = {
    "model": lambda model, **kw: model(**kw),
    "forward-method": lambda model, **kw: model.forward(**kw),
    "base-model": lambda model, **kw: model.model(**kw),
}


@pytest.mark.parametrize("call", list(FORWARDS))
@pytest.mark.parametrize("grad", list(GRAD_MODES))
def test_a_first_forward_of_other_tokens_as_many_as_the_suffix_is_refused_however_the_model_is_called(lm, grad, call):
    """The user's own forward of the prompt's first 6 tokens after 64 loaded: refused, however the
    model is called; the suffix itself then passes, and its logits are a recompute's."""
    prompt = _text(70)
    _store_prompt(lm, prompt)
    keyword = cache_keyword(lm.model)
    forward = FORWARDS[call]
    with GRAD_MODES[grad](), lm.request():
        prep = lm.prepare(prompt)
        with pytest.raises(LayoutError, match="feeds 6 token ids after the 64 loaded that are not prompt\\[64:\\]"):
            forward(lm.model, input_ids=_ids(prompt[:6]), **{keyword: prep.cache}, use_cache=True)
        with pytest.raises(LayoutError, match="nothing of this request is saved"):
            lm.save(prompt)
        prep = lm.prepare(prompt)
        forward(lm.model, input_ids=_ids(prompt[64:]), **{keyword: prep.cache}, use_cache=True)
        assert lm.storage.held_tokens() == 70 and _hooks_left(lm) == 0
        logits = lm.model(input_ids=_ids(prompt[-1:]), **{keyword: prep.cache}, use_cache=True).logits[0, -1]
        full = lm.model(input_ids=_ids(np.concatenate([prompt, prompt[-1:]])), use_cache=False).logits[0, -1]
    assert float((logits - full).abs().max()) <= FP32_TOL


def test_a_first_forward_of_inputs_embeds_is_refused_after_a_hit_and_never_saved_after_a_miss(lm):
    """Embeddings carry no token ids to check, even those of the right tokens: refused after a load
    (the ids the model's embeddings took just before, to make them, are forgotten at the model's
    call). With nothing loaded, the forward is served, but its K/V is never saved under the ids
    (soft prompts and merged image features are embeddings no id names: audit s34 a10 D2)."""
    prompt = _text(70)
    keyword = cache_keyword(lm.model)
    embed = lm.model.get_input_embeddings()
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        assert prep.cached_tokens == 0
        lm.model(inputs_embeds=embed(_ids(prompt)), **{keyword: prep.cache}, use_cache=True)
        with pytest.raises(LayoutError, match="nothing of this request is saved: a forward fed inputs_embeds"):
            lm.save(prompt)
        assert lm.prepare(prompt).cached_tokens == 0
    _store_prompt(lm, prompt)
    with torch.no_grad(), lm.request():
        prep = lm.prepare(prompt)
        assert prep.cached_tokens == 64
        with pytest.raises(LayoutError, match="feeds 6 positions after the 64 loaded without input_ids "
                                              "\\(inputs_embeds\\).*feed prompt\\[64:\\] only, as input_ids"):
            lm.model(inputs_embeds=embed(_ids(prompt[64:])), **{keyword: prep.cache}, use_cache=True)
    assert _hooks_left(lm) == 0


def test_a_model_whose_head_skips_its_base_model_is_checked_by_the_ids_it_embeds():
    """OPTForCausalLM runs its decoder, not its base model (OPTModel): the ids are seen by its input
    embeddings. The suffix is served as HF serves the prompt alone; the prompt's first tokens are
    refused, as for Llama."""
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=128, init_std=0.1, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(0)
    lm = _session(transformers.OPTForCausalLM(config).eval())
    try:
        prompt = _text(70)
        _store_prompt(lm, prompt)
        with torch.no_grad():
            alone = lm.model.generate(_ids(prompt), **GENERATE)
            with lm.request():
                with pytest.raises(LayoutError, match="feeds 6 token ids after the 64 loaded that are not prompt"):
                    _hf_generate_on_prepared(lm, prompt, prefill_chunk_size=6)
                prep, warm = _hf_generate_on_prepared(lm, prompt)
        assert prep.cached_tokens == 64
        _assert_same_generation(warm, alone)
    finally:
        lm.close()
        lm.store.close()


def test_no_hook_is_left_on_the_model_by_a_prepare_that_no_forward_followed(model):
    """The hook goes at the next prepare() or at close(), not only at a forward: the model outlives
    the session, and each forward would otherwise run a hook of a closed one."""
    lm = _session(model)
    try:
        prompt = _text(70)
        _store_prompt(lm, prompt)
        assert lm.prepare(prompt).cached_tokens == 64 and _hooks_left(lm) > 0
        hooks = _hooks_left(lm)
        assert lm.prepare(prompt).cached_tokens == 64 and _hooks_left(lm) == hooks
    finally:
        lm.close()
        lm.store.close()
    assert _hooks_left(lm) == 0


# -- D3: a storage grown inside kvtier's inference_mode stays writable under no_grad -------------

@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poisoned"])
def test_hf_generate_under_no_grad_serves_a_storage_that_lm_generate_grew(model, poison):
    """lm.generate() past capacity_tokens grows the storage inside its torch.inference_mode. Old
    code: the storage became an inference tensor, and HF generate on a prepared cache (under
    no_grad) raised "Inplace update to inference tensor outside InferenceMode" at its first append
    (at the poison fill in prepare() with poisoning on), for every later such request."""
    lm = _session(model, capacity_tokens=32, poison=poison)
    try:
        prompt = _text(70)
        # Grown to more than the request below reserves: prepare() outside inference_mode, which
        # grows it again, would otherwise hand the old code a normal tensor anew.
        lm.generate(prompt, 16)
        lm.wait_saves()
        assert lm.storage.capacity >= prompt.size + GENERATE["max_new_tokens"] + 2
        with torch.no_grad():
            alone = lm.model.generate(_ids(prompt), **GENERATE)
            with lm.request():
                prep, warm = _hf_generate_on_prepared(lm, prompt)
                assert lm.save(warm.sequences[0].numpy(), known_blocks=prep.known_blocks) is None   # 4 known
        assert prep.cached_tokens == 64
        _assert_same_generation(warm, alone)
        _assert_later_request_equals_its_recompute(lm, warm.sequences[0].numpy(), cached=64)
    finally:
        lm.close()
        lm.store.close()
