"""A ``KVTierLM`` serves only K/V of the weights it runs: checked at construction and at each request.

* Weights changed in place after the session was built (an optimizer step between rollouts, a
  checkpoint loaded with ``load_state_dict``, PEFT's merge writing ``weight.data``, a replaced
  parameter) are refused at the next request and at ``save``: the session's namespace names the
  weights of its construction, and its blocks are their K/V (s32 a6 D1).
* A namespace of another model of the same geometry (another checkpoint of one config, another
  attention implementation) is refused at construction; a ``weights_revision`` given by the
  caller stays trusted (s32 a6 D5).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from tests.integrations.test_transformers import BLOCK, assert_same, host_store, tokens  # noqa: E402

CHANGED = "weights changed after this KVTierLM was built"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one config (a base model and its "fine-tune"): seeds 0 and 1."""
    paths = {}
    for seed in (0, 1):
        paths[seed] = tmp_path_factory.mktemp(f"tiny-seed{seed}")
        build_model(replace(TINY_SPEC, seed=seed), paths[seed], tokenizer=False, initializer_range=0.3)
    return paths


def _lora_delta(weight: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """A dense rank-4 update, as a merged LoRA adds."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, weight.shape[1], generator=gen) * 0.3
    b = torch.randn(weight.shape[0], 4, generator=gen) * 0.3
    return b @ a


def _optimizer_step(model, other) -> None:
    ids = torch.from_numpy(tokens(24, seed=3))[None]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _load_other_checkpoint(model, other) -> None:
    model.load_state_dict(other.state_dict())


def _merge_through_data(model, other) -> None:
    # PEFT's merge: ``base_layer.weight.data += delta``, which bumps no version counter
    for layer in model.model.layers:
        layer.self_attn.v_proj.weight.data += _lora_delta(layer.self_attn.v_proj.weight)


def _set_data(model, other) -> None:
    # PEFT's safe merge: the merged weight computed apart, then set as ``.data``
    for layer in model.model.layers:
        weight = layer.self_attn.k_proj.weight
        weight.data = weight.data + _lora_delta(weight)


def _replace_parameter(model, other) -> None:
    proj = model.model.layers[0].self_attn.k_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach() + _lora_delta(proj.weight))


CHANGES = {"optimizer step": _optimizer_step, "load_state_dict": _load_other_checkpoint,
           "weight.data +=": _merge_through_data, "weight.data =": _set_data,
           "parameter replaced": _replace_parameter}


@pytest.mark.parametrize("change", CHANGES)
def test_weights_changed_in_place_after_construction_are_refused_at_the_next_request(checkpoints, change):
    model, _ = load_model(checkpoints[0], tokenizer=False)
    other, _ = load_model(checkpoints[1], tokenizer=False)
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(model, store, ns, capacity_tokens=256)
    prompt = tokens(100, seed=1)
    try:
        lm.generate(prompt, 2)
        lm.wait_saves()
        assert lm.generate(prompt, 2, save=False).cached_tokens == 96  # control: the blocks serve it
        CHANGES[change](model, other)
        with pytest.raises(ConfigError, match=CHANGED):
            lm.generate(prompt, 2)
        with pytest.raises(ConfigError, match=CHANGED):
            lm.prepare(prompt)
        # the store still holds the old weights' blocks, never loaded again: a session for the
        # changed model (its own namespace) computes what the model computes
        with KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=256) as plain:
            assert_same(plain.generate(prompt, 4), lm.generate(prompt, 4, use_store=False, save=False))
    finally:
        lm.close()
        store.close()


def test_a_cache_computed_across_a_weights_change_is_not_saved(checkpoints):
    """prepare() (a load under the old weights), then the weights change, then the caller's forward
    and save(): the cache mixes both weights' K/V; nothing of it is saved."""
    model, _ = load_model(checkpoints[0], tokenizer=False)
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(model, store, ns, capacity_tokens=256)
    prompt = tokens(100, seed=2)
    try:
        lm.generate(prompt[:64], 1)
        lm.wait_saves()
        with lm.request():
            prep = lm.prepare(prompt)
            assert prep.cached_tokens == 64
            _merge_through_data(model, None)
            with torch.inference_mode():
                model(input_ids=torch.from_numpy(prompt[prep.cached_tokens:])[None], use_cache=True,
                      **{cache_keyword(model): prep.cache})
            with pytest.raises(ConfigError, match=CHANGED):
                lm.save(prompt, known_blocks=prep.known_blocks)
        lm.close()  # (waits for any save: none was started)
        assert store.lookup(block_keys(ns, prompt)).hit_blocks == 4  # only the 4 blocks saved before
    finally:
        lm.close()
        store.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["model", "torch.compile"])
def test_requests_without_a_weights_change_keep_hitting(checkpoints, compiled):
    """Control for the check: forwards, generation and saves change no weight it watches, so a
    session keeps serving, a torch.compile wrapper's too (given the namespace of the model it
    compiles, whose weights it holds under other names)."""
    model, _ = load_model(checkpoints[0], tokenizer=False)
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    lm = KVTierLM(torch.compile(model, backend="eager") if compiled else model, store, ns, capacity_tokens=256)
    prompt = tokens(100, seed=7)
    try:
        cached = []
        for n in (60, 80, 100):  # a conversation's turns, each saved (prompt + generated tokens)
            cached.append(lm.generate(prompt[:n], 4).cached_tokens)
            lm.wait_saves()
        assert cached == [0, 48, 80]
    finally:
        lm.close()
        store.close()


# -- a namespace of another model of the same geometry ------------------------------------------

def test_a_namespace_of_another_checkpoint_of_the_same_config_is_refused(checkpoints):
    base, _ = load_model(checkpoints[0], tokenizer=False)
    tuned, _ = load_model(checkpoints[1], tokenizer=False)
    base_ns = namespace_for_model(base, block_tokens=BLOCK)
    assert base_ns.model_id == namespace_for_model(tuned, block_tokens=BLOCK).model_id  # one config
    store = host_store(base_ns)
    try:
        with pytest.raises(ConfigError, match="built from other weights than this model's"):
            KVTierLM(tuned, store, base_ns, capacity_tokens=256)
        KVTierLM(base, store, base_ns, capacity_tokens=256).close()  # control: its own model
    finally:
        store.close()


def test_a_namespace_of_another_attention_implementation_is_refused(checkpoints):
    """The same weights under eager and sdpa: one geometry and one weights digest, another model
    id (kernels need not compute the same K/V: Gemma 2's soft-capping)."""
    sdpa, _ = load_model(checkpoints[0], tokenizer=False)
    eager, _ = load_model(checkpoints[0], tokenizer=False, attn_implementation="eager")
    sdpa_ns = namespace_for_model(sdpa, block_tokens=BLOCK)
    store = host_store(sdpa_ns)
    try:
        with pytest.raises(ConfigError, match="model_id .* is not this model's .*attn=eager"):
            KVTierLM(eager, store, sdpa_ns, capacity_tokens=256)
    finally:
        store.close()


def test_a_weights_revision_the_caller_gives_stays_trusted(checkpoints):
    """Nothing in a given revision can be checked against the weights: it is taken as given (the
    caller vouches that "v1" names these weights), as namespace_for_model takes it."""
    base, _ = load_model(checkpoints[0], tokenizer=False)
    tuned, _ = load_model(checkpoints[1], tokenizer=False)
    ns = namespace_for_model(base, block_tokens=BLOCK, weights_revision="v1")
    store = host_store(ns)
    try:
        KVTierLM(tuned, store, ns, capacity_tokens=256).close()
    finally:
        store.close()
