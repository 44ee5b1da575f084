"""The check of the first forward after a load, on a compiled model (audit s32 f13).

A compiled model's forward calls the cache's ``update``, so dynamo traced kvtier's check that the
first forward after a load feeds the prompt's uncached suffix, and decided it once per graph from
what it saw while tracing. After suffixes of two lengths it made the length symbolic, and the shape
test then came out False for a 1-token suffix: a session that had loaded a prefix once refused every
later fully cached prompt ("feeds 1 token ids after the 48 loaded that are not prompt[48:]"). The
check and the hooks that see the ids now run as Python on every request, compiled or not: the suffix
passes (logits of a recompute), other ids of any length are refused.
(The eager backend: dynamo traces the model as any backend would, without a C++ compiler's minutes.
Tracing is what costs here, so each compile style runs one history, served and refused in one test,
with one new token a request: no decode graphs.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store  # noqa: E402
from tests.integrations.test_transformers_resume_probe import VOCAB, _llama, _model  # noqa: E402


def _wrapped(model):
    return torch.compile(model, backend="eager")


def _in_place(model):
    model.compile(backend="eager")
    return model


COMPILES = {"torch.compile": _wrapped, "model.compile": _in_place}


@pytest.fixture(params=list(COMPILES))
def lm(request):
    """A session of a compiled Llama (poisoned storage: a position a load skipped reads NaN)."""
    torch._dynamo.reset()  # each test traces afresh: what it asserts must not hang on another's graphs
    model = COMPILES[request.param](_model(_llama()))
    ns = namespace_for_model(model, block_tokens=BLOCK, weights_revision="test")
    store = host_store(ns)
    session = KVTierLM(model, store, ns, capacity_tokens=256, poison=True)
    yield session
    session.close()
    store.close()


PROMPT = np.random.default_rng(3).integers(3, VOCAB, 100)


def _ids(tokens) -> torch.Tensor:
    return torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]


def _recompute(lm, tokens) -> torch.Tensor:
    """The model's last logits over ``tokens``, fed whole without a cache (no kvtier), run eagerly:
    the reference is the model's own, and traces no graph of its own."""
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
        return lm.model(input_ids=_ids(tokens), use_cache=False).logits[0, -1].float()


def _serve(lm, n: int):
    """generate() of one token after the prompt's first ``n`` tokens (saving its blocks); asserts its
    logits are a recompute's."""
    generation = lm.generate(PROMPT[:n], 1)
    lm.wait_saves()
    diff = float((generation.first_logits - _recompute(lm, PROMPT[:n])).abs().max())
    assert diff <= FP32_TOL, f"{n} tokens, {generation.cached_tokens} cached: logits {diff} off a recompute"
    return generation


def _feed_two_lengths(lm) -> None:
    """40 tokens with nothing cached, then a 38-token suffix after a load (a request saves the blocks
    of its prompt): the compiled graphs have seen two lengths (dynamo then traces the length as a
    symbol), the second one through the check of a load."""
    assert _serve(lm, 40).cached_tokens == 0
    assert _serve(lm, 70).cached_tokens == 32


def _serves_fully_cached_prompts(lm) -> None:
    """The last prompt token is always computed: a prompt of whole cached blocks plus one token has
    a 1-token suffix. Old code refused it once the session had loaded a prefix before (with a
    suffix of another length), saying it fed ids that are not the prompt's suffix."""
    assert _serve(lm, 65).cached_tokens == 64
    assert _serve(lm, 49).cached_tokens == 48
    assert _serve(lm, 90).cached_tokens == 64  # a longer suffix again
    assert lm.storage.refused is None


def _refuses_first_forwards_that_are_not_the_suffix(lm) -> None:
    """A first forward of other ids than prompt[loaded:] is refused before its K/V is written,
    whatever its length; the suffix itself then passes, a recompute's logits."""
    keyword = cache_keyword(lm.model)
    other = (PROMPT[64] + 1) % VOCAB
    for prompt, wrong in ((PROMPT[:65], [other]), (PROMPT[:65], PROMPT[:1]), (PROMPT[:76], PROMPT[:12]),
                          (PROMPT[:76], np.concatenate([PROMPT[64:75], [other]]))):
        with torch.inference_mode(), lm.request():
            prep = lm.prepare(prompt)
            assert prep.cached_tokens == 64
            with pytest.raises(LayoutError, match=f"feeds {len(wrong)} token ids after the 64 loaded that are not "
                                                  f"prompt\\[64:\\] of a {len(prompt)}-token prompt"):
                lm.model(input_ids=_ids(wrong), **{keyword: prep.cache}, use_cache=True)
            assert lm.storage.held_tokens() == 64  # refused before the copy
            prep = lm.prepare(prompt)
            logits = lm.model(input_ids=_ids(prompt[64:]), **{keyword: prep.cache}, use_cache=True).logits[0, -1]
        assert float((logits.float() - _recompute(lm, prompt)).abs().max()) <= FP32_TOL


def test_a_compiled_model_serves_the_prompt_suffix_after_a_load_and_refuses_other_ids(lm):
    """After two lengths fed, one after a load: fully cached prompts (1-token suffixes) are served,
    and first forwards of other ids are still refused."""
    _feed_two_lengths(lm)
    _serves_fully_cached_prompts(lm)
    _refuses_first_forwards_that_are_not_the_suffix(lm)
