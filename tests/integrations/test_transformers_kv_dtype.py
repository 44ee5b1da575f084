"""K/V computed in another dtype than the storage's is refused, and nothing of it is saved (audit s27 D1).

The storage's dtype is the namespace's: a ``copy_`` into it would convert bf16 K/V (an fp32 model
run under ``torch.autocast("cpu", dtype=torch.bfloat16)``; a model whose layers differ in dtype
from its first parameter) and save it under the fp32 namespace, where every later request, of
this process or of any sharing a tier, would load it as fp32 KV (logits ~0.2 off a recompute).
Each refusal is checked to leave the store unchanged, and a plain request after it to save and
hit only fp32 KV of its own, equal to a recompute without kvtier.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.errors import LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.cache_io import KVStorage  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, FP32_TOL, host_store, tokens  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # initializer_range 0.3: bf16 K/V then moves the logits well past the fp32 tolerance (0.2)
    path = tmp_path_factory.mktemp("tiny-dtype")
    build_model(TINY_SPEC, path, tokenizer=False, initializer_range=0.3)
    return load_model(path, tokenizer=False)[0]


def recompute(model, prompt: np.ndarray) -> torch.Tensor:
    """The last position's logits of the whole prompt, by the model alone (no kvtier)."""
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(prompt.astype(np.int64))[None]).logits[0, -1].float()


def assert_plain_requests_hit_only_their_own_kv(lm, store, ns, prompt) -> None:
    """The store holds nothing; a plain request saves, a longer one hits it and equals a recompute."""
    assert list(store.tiers[0].keys()) == [], "a refused request saved blocks"
    first = lm.generate(prompt[:100], 3)
    assert first.cached_tokens == 0
    saved = lm.wait_saves()
    assert len(saved) == 6 and sorted(store.tiers[0].keys()) == sorted(block_keys(ns, prompt[:96]))
    warm = lm.generate(prompt, 4, save=False)
    assert warm.cached_tokens == 96
    diff = float((warm.first_logits - recompute(lm.model, prompt)).abs().max())
    assert diff <= FP32_TOL, f"a hit on fp32 KV differs from the recompute by {diff:.3g}"


@pytest.fixture
def session(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256)
    yield lm, store, ns
    lm.close()
    store.check_integrity()
    store.close()


def test_a_request_under_bf16_autocast_is_refused_before_anything_is_saved(session):
    lm, store, ns = session
    prompt = tokens(150, seed=1)
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(LayoutError, match="autocast to torch.bfloat16"):
            lm.generate(prompt[:100], 3)       # old code: served, and its bf16 KV saved as fp32 KV
        with pytest.raises(LayoutError, match="autocast"):
            lm.prepare(prompt[:100])
    assert lm.wait_saves() == []
    assert_plain_requests_hit_only_their_own_kv(lm, store, ns, prompt)


def test_without_the_up_front_check_the_storage_refuses_the_bf16_kv_and_nothing_is_saved(session, monkeypatch):
    """What autocast entered after ``prepare`` (or any path round the up-front check) reaches: the
    storage's own dtype check, in the forward, before the save."""
    lm, store, ns = session
    monkeypatch.setattr(lm, "_refuse_autocast", lambda: None, raising=False)
    prompt = tokens(150, seed=2)
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(LayoutError, match="V of torch.bfloat16, but the namespace holds torch.float32"):
            lm.generate(prompt[:100], 3)
    assert lm.wait_saves() == []
    monkeypatch.undo()
    assert_plain_requests_hit_only_their_own_kv(lm, store, ns, prompt)


def test_a_caller_entering_autocast_after_prepare_is_refused_and_cannot_save_the_cache(session):
    lm, store, ns = session
    prompt = tokens(150, seed=3)
    with lm.request():
        prep = lm.prepare(prompt[:100], extra_tokens=4)
        with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
            with pytest.raises(LayoutError, match="namespace holds torch.float32"):
                lm.model(input_ids=torch.from_numpy(prompt[:100].astype(np.int64))[None],
                         **{cache_keyword(lm.model): prep.cache}, use_cache=True)
        with pytest.raises(LayoutError, match="nothing of this request is saved"):
            lm.save(prompt[:100])
    assert_plain_requests_hit_only_their_own_kv(lm, store, ns, prompt)


def test_autocast_to_the_storages_own_dtype_is_not_refused_up_front(tiny):
    """Control: the check is on the dtype, not on autocast being on (an fp32 autocast is a no-op)."""
    lm = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=256)
    try:
        prompt = tokens(40, seed=4)
        with torch.autocast("cpu", dtype=torch.float32):
            out = lm.generate(prompt, 2)
        assert float((out.first_logits - recompute(tiny, prompt)).abs().max()) <= FP32_TOL
    finally:
        lm.close()


def test_a_model_whose_kv_dtype_differs_from_its_first_parameter_is_refused(tiny):
    """bf16 embeddings over fp32 layers: the model runs (K/V fp32), kvtier's storage takes the first
    parameter's bf16. The old code converted the K/V into it and handed bf16 keys back to fp32
    attention (a torch error, or, with an attention that casts, bf16 KV saved as the model's)."""
    mixed = copy.deepcopy(tiny)
    mixed.model.embed_tokens.to(BF16)
    prompt = tokens(40, seed=5)
    assert recompute(mixed, prompt).isfinite().all()   # control: the model itself runs
    lm = KVTierLM(mixed, None, block_tokens=BLOCK, capacity_tokens=128)
    try:
        with pytest.raises(LayoutError, match="K of torch.float32 and V of torch.float32, but the namespace holds "
                                              "torch.bfloat16"):
            lm.generate(prompt, 2)
    finally:
        lm.close()


def test_a_cache_whose_layers_differ_in_dtype_is_refused_at_the_first_such_layer_and_not_saved(tiny, tmp_path):
    """bf16 model with its second layer (and head) in fp32: layer 0 appends, layer 1 is refused, so
    the layers hold different lengths; a save of that cache would gather positions layer 1 never
    received (NaN under poisoning, a previous request's KV without): it raises, and stores nothing."""
    mixed = copy.deepcopy(tiny).to(BF16)
    for part in (mixed.model.layers[1], mixed.model.norm, mixed.lm_head):
        part.float()
    mixed.save_pretrained(tmp_path)
    mixed = load_model(tmp_path, tokenizer=False)[0]
    for part in (mixed.model.layers[1], mixed.model.norm, mixed.lm_head):
        part.float()   # dtype="auto" loads every weight in the config's one dtype
    prompt = tokens(100, seed=6)
    assert recompute(mixed, prompt).isfinite().all()   # control: the model itself runs
    ns = namespace_for_model(mixed, block_tokens=BLOCK, weights_revision="mixed-test")
    store = host_store(ns)
    lm = KVTierLM(mixed, store, ns, capacity_tokens=256)
    try:
        with lm.request():
            prep = lm.prepare(prompt)
            with torch.inference_mode(), pytest.raises(LayoutError, match="layer 1 appends K of torch.float32"):
                mixed(input_ids=torch.from_numpy(prompt.astype(np.int64))[None], **{cache_keyword(mixed): prep.cache},
                      use_cache=True)
            lengths = [layer.get_seq_length() for layer in prep.cache.layers]
            assert lengths == [100, 0]
            with pytest.raises(LayoutError, match="nothing of this request is saved"):
                lm.save(prompt)
        with pytest.raises(LayoutError, match="layer 1 appends"):
            lm.generate(prompt, 2)
        assert lm.wait_saves() == [] and list(store.tiers[0].keys()) == []
    finally:
        lm.close()
        store.close()


def test_an_append_of_another_dtype_is_refused_before_the_copy():
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
    storage = KVStorage(layout, 16, torch.float32, poison=False)
    layer = storage.new_cache(transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)).layers[0]
    good = torch.randn(1, 2, 3, 8)
    layer.update(good, -good)   # control: the storage's dtype is stored
    assert storage.refused is None
    for k, v in ((good.to(BF16), -good), (good, (-good).to(BF16)), (good.double(), -good.double())):
        with pytest.raises(LayoutError, match="namespace holds torch.float32"):
            layer.update(k, v)
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, good)   # nothing appended
    assert storage.refused is not None
    storage.new_cache(transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=16))
    assert storage.refused is None   # a new request's cache starts clean
