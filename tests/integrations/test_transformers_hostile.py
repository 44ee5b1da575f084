"""The transformers integration against models and callers that would make it serve wrong KV.

Each case is checked numerically against a recompute without kvtier, or must be refused
with an error that names the cause: RoPE that depends on the request's length, weights
changed in memory (a merged LoRA), one session used from two threads, a session used
after ``close()``, finished saves piling up, a namespace of another KV geometry, an
``eos_token_id`` given as a list (as HF configs hold it).
"""

from __future__ import annotations

import threading
import types
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.errors import ConfigError, LayoutError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, kv_layout, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers import namespace as namespace_module  # noqa: E402
from kvtier.integrations.transformers import session as session_module  # noqa: E402
from kvtier.integrations.transformers.cache_io import KVStorage  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, assert_same, host_store, tokens  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # initializer_range 0.3: sharper attention than the default 0.02, so a wrong K shows in the tokens
    path = tmp_path_factory.mktemp("tiny-hostile")
    build_model(TINY_SPEC, path, tokenizer=False, initializer_range=0.3)
    model, _ = load_model(path, tokenizer=False)
    return model


# -- RoPE whose frequencies depend on the request's length -----------------------------------

SHORT = 64  # the model's original context: prompts past it switch the RoPE frequencies
ROPE_CASES = {
    "llama-dynamic": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "phi3-longrope": (transformers.Phi3Config, dict(
        pad_token_id=0, original_max_position_embeddings=SHORT,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                         "long_factor": [4.0] * 8, "original_max_position_embeddings": SHORT})),
    # a fixed scaling: the same frequencies whatever the length (served, and must match)
    "llama-linear": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
}


def _rope_model(case, tmp_path):
    config_class, extra = ROPE_CASES[case]
    build_model(replace(TINY_SPEC, max_position_embeddings=SHORT), tmp_path, tokenizer=False,
                config_class=config_class, initializer_range=0.3, **extra)
    return load_model(tmp_path, tokenizer=False)[0]


def _short_request_saves_then_long_one_loads(model):
    """A short request (inside the original context) saves 3 blocks; a long one (past it) loads
    them. Returns the long request's generation with kvtier and without it."""
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    cached = KVTierLM(model, store, ns, capacity_tokens=512)
    plain = KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=512)
    try:
        prompt = tokens(200, seed=11)
        cached.generate(prompt[:60], 1)
        cached.wait_saves()
        return cached.generate(prompt, 8, save=False), plain.generate(prompt, 8)
    finally:
        cached.close()
        plain.close()
        store.close()


@pytest.mark.parametrize("case, kind", [("llama-dynamic", "dynamic"), ("phi3-longrope", "longrope")])
def test_a_model_whose_rope_depends_on_the_request_length_is_refused_by_name(case, kind, tmp_path):
    model = _rope_model(case, tmp_path)
    with pytest.raises(ConfigError, match=rf"rope_parameters\['rope_type'\] = '{kind}'.*total length"):
        namespace_for_model(model, block_tokens=BLOCK)
    with pytest.raises(ConfigError, match="total length"):  # the plain session (no namespace) as well
        KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=64)


@pytest.mark.parametrize("case", ["llama-dynamic", "phi3-longrope"])
def test_control_without_the_refusal_a_hit_on_such_a_model_is_wrong(case, tmp_path, monkeypatch):
    # What the refusal prevents: with it bypassed, the hit's logits are not the recompute's.
    model = _rope_model(case, tmp_path)
    for module in (namespace_module, session_module):
        monkeypatch.setattr(module, "is_length_dependent_rope", lambda kind: False, raising=False)
    warm, cold = _short_request_saves_then_long_one_loads(model)
    assert warm.cached_tokens == 48
    assert float((warm.first_logits - cold.first_logits).abs().max()) > 0.1


def test_a_fixed_rope_scaling_is_served_and_a_hit_equals_the_recompute(tmp_path):
    warm, cold = _short_request_saves_then_long_one_loads(_rope_model("llama-linear", tmp_path))
    assert warm.cached_tokens == 48
    assert_same(warm, cold)


def test_a_length_dependent_rope_of_one_layer_type_is_refused_by_name():
    text = types.SimpleNamespace(num_attention_heads=4, hidden_size=64, num_hidden_layers=2, rope_parameters={
        "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match=r"rope_parameters\['sliding_attention'\]\['rope_type'\] = 'dynamic'"):
        kv_layout(text, "float32", BLOCK)
    text.rope_parameters["sliding_attention"]["rope_type"] = "yarn"
    assert kv_layout(text, "float32", BLOCK).num_kv_heads == 4


# -- weights changed in memory (a merged LoRA) ------------------------------------------------

SPEC3 = replace(TINY_SPEC, num_hidden_layers=3)  # 3 layers: the old 3-tensor sample missed every projection
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def merge_random_lora(model, rank: int = 8, seed: int = 0) -> None:
    """W += (alpha / r) B A on every q_proj and v_proj, alpha = 2r: a LoRA merged in memory, as
    PEFT's merge_and_unload() does (the shape of kvtier's own random_lora_adapter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
                a = torch.randn(rank, proj.in_features, generator=gen) * 0.5
                b = torch.randn(proj.out_features, rank, generator=gen) * 0.5
                proj.weight += 2.0 * (b @ a)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-3-layers")
    build_model(SPEC3, path, tokenizer=False)
    return path


def test_a_merged_lora_never_loads_the_base_models_kv(base_dir):
    base, _ = load_model(base_dir, tokenizer=False)
    tuned, _ = load_model(base_dir, tokenizer=False)
    merge_random_lora(tuned)
    base_ns = namespace_for_model(base, block_tokens=BLOCK)
    tuned_ns = namespace_for_model(tuned, block_tokens=BLOCK)
    assert tuned_ns.root != base_ns.root
    store = host_store(base_ns)
    base_lm = KVTierLM(base, store, base_ns, capacity_tokens=256)
    tuned_lm = KVTierLM(tuned, store, tuned_ns, capacity_tokens=256)
    plain = KVTierLM(tuned, None, block_tokens=BLOCK, capacity_tokens=256)
    try:
        prompt = tokens(100, seed=12)
        base_lm.generate(prompt, 2)
        base_lm.wait_saves()
        # control: another load of the same files shares the base model's namespace, and hits
        again, _ = load_model(base_dir, tokenizer=False)
        assert namespace_for_model(again, block_tokens=BLOCK) == base_ns
        assert base_lm.generate(prompt, 2, save=False).cached_tokens == 96
        warm = tuned_lm.generate(prompt, 8)
        assert warm.cached_tokens == 0
        assert_same(warm, plain.generate(prompt, 8))
        tuned_lm.wait_saves()
        again = tuned_lm.generate(prompt, 8, save=False)  # the tuned model's own blocks serve it
        assert again.cached_tokens == 96
        assert_same(again, plain.generate(prompt, 8))
    finally:
        base_lm.close()
        tuned_lm.close()
        plain.close()
        store.close()


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_one_row_changed_in_any_projection_changes_the_namespace(base_dir, projection):
    model, _ = load_model(base_dir, tokenizer=False)
    before = namespace_for_model(model, block_tokens=BLOCK).root
    weight = model.model.layers[1].get_submodule(projection).weight
    with torch.no_grad():
        weight[weight.shape[0] // 2, 3] += 1e-3  # one value of a middle row of the middle layer
    assert namespace_for_model(model, block_tokens=BLOCK).root != before


# -- one session, two threads -----------------------------------------------------------------

def test_two_threads_on_one_session_get_the_tokens_of_a_recompute_and_save_right_blocks(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns, blocks=1024)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=512)
    plain = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=512)
    prompts = [tokens(150, seed=20), tokens(151, seed=21)]
    expected = [plain.generate(p, 8) for p in prompts]
    wrong, errors, hits = [], [], []

    def worker(i: int) -> None:
        for _ in range(6):
            try:
                got = lm.generate(prompts[i], 8)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc)[:200])
                continue
            hits.append(got.cached_tokens)
            diff = float((got.first_logits - expected[i].first_logits).abs().max())
            if got.tokens != expected[i].tokens or diff > 1e-4:
                wrong.append((i, got.cached_tokens, diff))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:3]
        assert not wrong, f"{len(wrong)} of 12 requests returned wrong output, e.g. {wrong[:2]}"
        assert max(hits) == 144  # control: the requests did load blocks, not only recompute
        # What the two threads saved is served to everyone sharing the store.
        with KVTierLM(tiny, store, ns, capacity_tokens=512) as fresh:
            for p, e in zip(prompts, expected):
                later = fresh.generate(p, 8, save=False)
                assert later.cached_tokens == 144
                assert_same(later, e)
    finally:
        lm.close()
        plain.close()
        store.close()


def test_a_caller_driving_the_model_holds_the_request_lock_from_prepare_to_save(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256)
    try:
        with lm.request():
            prompt = tokens(40, seed=3)
            prep = lm.prepare(prompt)
            other = threading.Thread(target=lm.generate, args=(tokens(40, seed=4), 1))
            other.start()
            other.join(0.5)
            assert other.is_alive()  # another thread's request waits for this one
            with torch.inference_mode():
                tiny(input_ids=torch.from_numpy(prompt.astype(np.int64))[None], **{cache_keyword(tiny): prep.cache})
            lm.save(prompt)
        other.join(30)
        assert not other.is_alive()
    finally:
        lm.close()
        store.close()


# -- lifecycle: finished saves, close() -------------------------------------------------------

def test_finished_saves_are_not_kept(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns, blocks=1024)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256)
    try:
        for i in range(20):
            gen = lm.generate(tokens(40, seed=100 + i), 1)  # 2 new blocks a request, saved in the background
            gen.saved.result(10)
        assert len(lm._saves) == 1  # the last one only: the others had finished when the next started
        assert len(lm.wait_saves()) == 2  # control: an outstanding save's statuses are still reported
        assert lm._saves == []
    finally:
        lm.close()
        store.close()


def _outcome_within(call, seconds: float = 10.0) -> str:
    outcome: list[str] = []

    def run() -> None:
        try:
            call()
            outcome.append("returned")
        except Exception as exc:  # noqa: BLE001
            outcome.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return outcome[0] if outcome else "hangs"


def test_every_call_after_close_fails_fast_and_never_hangs(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(tiny, store, ns, capacity_tokens=256)
    assert lm.generate(tokens(40, seed=1), 1).tokens  # control: it served before
    lm.close()
    lm.close()  # idempotent
    prompt = tokens(40, seed=2)  # new blocks: a call that ran would start a save
    calls = [lambda: lm.generate(prompt, 1), lambda: lm.generate(prompt, 1), lambda: lm.prepare(prompt),
             lambda: lm.save(prompt), lambda: lm.wait_saves(), lambda: lm.generate(prompt, 1)]
    try:
        for k, call in enumerate(calls):
            outcome = _outcome_within(call)
            assert outcome.startswith("RuntimeError") and "closed" in outcome, f"call {k}: {outcome}"
    finally:
        store.close()


# -- a namespace of another KV geometry -------------------------------------------------------

def test_a_namespace_of_another_kv_geometry_is_refused(tmp_path):
    build_model(TINY_SPEC, tmp_path / "a", tokenizer=False)                                  # 2 KV heads
    build_model(replace(TINY_SPEC, num_key_value_heads=1), tmp_path / "b", tokenizer=False)  # 1 KV head
    a, _ = load_model(tmp_path / "a", tokenizer=False)
    b, _ = load_model(tmp_path / "b", tokenizer=False)
    ns_a = namespace_for_model(a, block_tokens=BLOCK)
    store = host_store(ns_a)
    try:
        with pytest.raises(ConfigError, match="not this model's KV layout"):
            KVTierLM(b, store, ns_a, capacity_tokens=256).close()
        KVTierLM(a, store, ns_a, capacity_tokens=256).close()  # control: its own model is accepted
    finally:
        store.close()


def test_an_append_of_another_shape_is_refused_before_the_copy():
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
    storage = KVStorage(layout, 16, torch.float32, poison=False)
    layer = storage.new_cache(transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)).layers[0]
    good = torch.randn(1, 2, 3, 8)
    keys, values = layer.update(good, -good)  # control: the layout's shape is stored
    assert torch.equal(keys, good) and torch.equal(values, -good)
    for bad in (torch.randn(1, 1, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(1, 2, 3, 4)):
        with pytest.raises(LayoutError, match="batch 1, 2 KV heads"):
            layer.update(bad, bad)
    assert layer.get_seq_length() == 3  # nothing appended by the refused ones


# -- eos_token_id as HF configs hold it --------------------------------------------------------

def test_generation_stops_at_any_id_of_an_eos_collection_and_a_non_id_is_refused(tiny):
    lm = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=256)
    try:
        prompt = tokens(40, seed=7)
        free = lm.generate(prompt, 8)
        stop = free.tokens[3]
        upto = free.tokens[: free.tokens.index(stop) + 1]
        assert len(upto) < 8   # control: generation without it runs on past that token
        unused = next(t for t in range(TINY_SPEC.vocab_size) if t not in free.tokens)
        for eos in (stop, np.int64(stop), [stop], (unused, stop), {stop}, torch.tensor([unused, stop]),
                    np.array([stop])):
            assert lm.generate(prompt, 8, eos_token_id=eos).tokens == upto, f"eos_token_id={eos!r}"  # old: [..] ran on
        assert lm.generate(prompt, 8, eos_token_id=[unused]).tokens == free.tokens
        for bad in ("7", float(stop), [stop, "x"], [float(stop)], True, [True], object()):
            with pytest.raises(TypeError, match="eos_token_id"):
                lm.generate(prompt, 8, eos_token_id=bad)
    finally:
        lm.close()
