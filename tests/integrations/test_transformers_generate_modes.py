"""HF ``generate`` modes on the cache ``prepare()`` hands out (audit s30 a5 D1-D3).

Stored blocks are gathered by position and keyed by token, so position i of the cache must hold
token i's K/V, fed once. Some HF generate modes break that: ``use_cache=False`` feeds the whole
sequence again at every step, and assisted / prompt-lookup decoding and ``prefill_chunk_size`` feed
the whole prompt after a loaded prefix. Old code served those without an error and saved K/V of
other positions under real block keys. Now a forward that re-feeds a loaded prefix is refused
before its K/V is written, and ``save()`` stores nothing of a cache holding another count of
positions than tokens; the same modes on an empty cache are served as HF serves them alone.
Everything here runs HF generate under ``no_grad``, as HF itself does (not ``inference_mode``).
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
from tests.integrations.test_transformers_padding import GENERATE, _ids, _llama, _text  # noqa: E402

#: HF generate modes that feed the whole prompt again after the prefix a cache holds (each a
#: factory: an assistant model is built per call, since HF keeps state on it)
REFEEDING_MODES = {
    "prompt-lookup": lambda: dict(prompt_lookup_num_tokens=3),
    "assisted": lambda: dict(assistant_model=_llama()),
    "chunked-prefill": lambda: dict(prefill_chunk_size=16),
}


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
        with pytest.raises(LayoutError, match="appends .* positions after the 64 loaded, but the prompt has 70 "
                                              "tokens: feed prompt\\[64:\\] only.*assisted or prompt-lookup.*"
                                              "prefill_chunk_size.*use_store=False"):
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
