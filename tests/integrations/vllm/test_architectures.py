"""Real vLLM with the kvtier connector on geometries the rest of the suite does not use.

The suite's tiny Llama has 2 KV heads of 32 dims in fp32. Here: a Qwen2 (attention biases) with
one KV head of 64 dims (multi-query attention) and three layers, whose pages have another
shape. A store that got the page layout wrong for it (heads, head size, layers) would load
the wrong bytes, and the poisoned pages (the suite's ``KVTIER_DEBUG_POISON``) catch a load
that writes nothing.

What "equal" means on such a model: vLLM's own prefix-cache hit changes the shape of the
computed tail, which moves a logprob by an ulp or two against the full recompute on some
geometries (measured: up to 1e-6 here), so the exact reference for a kvtier hit is vLLM's
own hit over the same prefix, in an engine without any connector. The positive control:
that own hit really is a hit.
"""

from __future__ import annotations

import json

import pytest

from kvtier.integrations.vllm import cpu_windows
from kvtier.integrations.vllm.engine_proc import PAGE_TOKENS, latent_attention_host
from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)

#: lengths whose cacheable prefix is the same for vLLM (leaves >= 1 token) and kvtier (>= 2)
LENGTHS = (300, 337, 374)


@pytest.fixture(scope="module")
def qwen2_mqa(tmp_path_factory) -> str:
    from transformers import Qwen2Config

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=3)
    out = tmp_path_factory.mktemp("qwen2-mqa")
    build_model(spec, out, config_class=Qwen2Config)
    return str(out)


def _batch() -> list[list[int]]:
    batch = [p for length in LENGTHS for p in prompts(1, length, seed=length)]
    assert [len(p) for p in batch] == list(LENGTHS)
    return batch


def test_a_kvtier_hit_on_a_multi_query_qwen2_equals_vllms_own_hit(engines, qwen2_mqa):
    batch = _batch()
    plain = engines("qwen2-plain", {"model": qwen2_mqa, "extra": None})
    kv = engines("qwen2-kvtier", {"model": qwen2_mqa, "extra": {"block_tokens": PAGE_TOKENS,
                                                                 "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()

    recompute = plain.generate(batch, max_tokens=8)
    own_hit = plain.generate(batch, max_tokens=8)   # the same engine again: vLLM's prefix cache
    cold = kv.generate(batch, max_tokens=8)
    kv.call(op="flush")
    assert kv.call(op="reset")["ok"], "vLLM's prefix cache must be empty for the kvtier run"
    assert kv.call(op="stats")["worker"]["poison"], "the suite runs every engine with poisoned loads"
    assert not kv.call(op="stats")["worker"]["split_kv_off"], "control: no window, vLLM's decode is left alone"
    warm = kv.generate(batch, max_tokens=8)

    for prompt, full, own, first, hit in zip(batch, recompute, own_hit, cold, warm):
        cacheable = expected_hit(len(prompt), PAGE_TOKENS, PAGE_TOKENS)
        assert own["num_cached_tokens"] == cacheable > 0, "control: vLLM's own hit covers the same prefix"
        assert loaded_tokens(first) == 0
        assert loaded_tokens(hit) == cacheable, "every whole page but the last tokens came from kvtier"
        assert first["token_ids"] == full["token_ids"] and first["logprobs"] == full["logprobs"], \
            "the connector changes nothing on a miss"
        assert hit["token_ids"] == own["token_ids"] == full["token_ids"]
        assert hit["logprobs"] == own["logprobs"], "bit-equal to vLLM's own hit over the same prefix"
        assert [[t for t, _ in step] for step in hit["logprobs"]] == [[t for t, _ in step] for step in full["logprobs"]]
        worst = max(abs(a - b) for x, y in zip(hit["logprobs"], full["logprobs"]) for (_, a), (_, b) in zip(x, y))
        assert worst < 1e-4, f"a hit moved a logprob by {worst} against the full recompute"
    assert kv.call(op="stats")["worker"]["failed_pages"] == 0


def _fp8_kv_here() -> bool:
    """vLLM's CPU kernels take an fp8 KV cache on x86 with AVX-512 or AMX only."""
    import torch

    from kvtier.integrations.vllm.cpu_pages import amx_tiles

    return amx_tiles() or bool(torch.cpu._is_avx512_supported())


@pytest.mark.skipif(not _fp8_kv_here(), reason="vLLM's CPU fp8 KV cache needs x86 with AVX-512 or AMX")
def test_a_kvtier_hit_on_an_fp8_kv_cache_equals_vllms_own_hit(engines, tiny_model):
    """``--kv-cache-dtype fp8``: pages of one byte an element (float8_e4m3), half a bfloat16
    page, which numpy cannot name either; the bytes move unconverted. First run on a host
    whose CPU takes it (the AMD VM of earlier sessions could not)."""
    batch = _batch()
    fp8 = {"dtype": "bfloat16", "engine_args": {"kv_cache_dtype": "fp8"}}
    plain = engines("fp8-plain", {"model": tiny_model, "extra": None, **fp8})
    kv = engines("fp8-kvtier", {"model": tiny_model, **fp8,
                                "extra": {"block_tokens": PAGE_TOKENS, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()
    _assert_a_hit_equals_vllms_own_hit(plain, kv, batch)


@pytest.fixture(scope="module")
def sliding_window_mistral(tmp_path_factory) -> str:
    from transformers import MistralConfig

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=5)
    out = tmp_path_factory.mktemp("mistral-swa")
    build_model(spec, out, config_class=MistralConfig, sliding_window=2 * PAGE_TOKENS)
    return str(out)


def test_a_sliding_window_model_never_stores_nor_loads_vllms_null_page(engines, sliding_window_mistral):
    """Every layer attends over a 64-token window, so vLLM gives a request's pages out of the
    window back and puts its null page (zeros) in their place: in a local prefix hit, and in
    the pages of external tokens. Before the fix the connector saved that page as the blocks'
    KV; a later request whose window needed them loaded zeros (measured: other tokens, a
    logprob off by 0.45)."""
    plain = engines("swa-plain", {"model": sliding_window_mistral, "extra": None})
    kv = engines("swa-kvtier", {"model": sliding_window_mistral, "extra": {"block_tokens": PAGE_TOKENS,
                                                                          "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()
    (prompt,) = prompts(1, 600, seed=11)
    (more,) = prompts(1, 100, seed=12)
    (tail,) = prompts(1, 100, seed=13)

    # Loads work on this model: a repeated prompt loads and equals vLLM's own hit.
    full = plain.generate([prompt], max_tokens=8)[0]
    own = plain.generate([prompt], max_tokens=8)[0]
    assert own["num_cached_tokens"] > 0, "control: vLLM's own prefix cache hits on this model"
    kv.generate([prompt], max_tokens=8)
    kv.call(op="flush")
    assert kv.call(op="reset")["ok"]
    warm = kv.generate([prompt], max_tokens=8)[0]
    assert loaded_tokens(warm) > 0
    assert warm["token_ids"] == own["token_ids"] == full["token_ids"] and warm["logprobs"] == own["logprobs"]

    # The defect's path: kvtier lost the prompt's blocks while vLLM still holds its pages. A
    # longer prompt then hits vLLM's own cache, whose leading pages are the null page, and the
    # connector saves what it computes from there: never the null page.
    assert kv.call(op="clear_store")["deleted"] > 0
    saved_before = kv.call(op="stats")["worker"]["saved_blocks"]
    longer = kv.generate([prompt + more], max_tokens=4)[0]
    assert longer["num_cached_tokens"] >= 512, "control: a local hit with pages out of the window"
    kv.call(op="flush")
    saved = kv.call(op="stats")["worker"]["saved_blocks"] - saved_before
    assert 0 < saved < len(prompt + more) // PAGE_TOKENS, "blocks in the window saved, none from the null page"
    # A prompt sharing the first 256 tokens, in an empty vLLM cache: whatever kvtier serves
    # must be real KV, so the answer equals the recompute.
    assert kv.call(op="reset")["ok"]
    shared = prompt[:256] + tail
    hit = kv.generate([shared], max_tokens=8)[0]
    ref = plain.generate([shared], max_tokens=8)[0]
    assert hit["token_ids"] == ref["token_ids"]
    worst = max(abs(a - b) for x, y in zip(hit["logprobs"], ref["logprobs"]) for (_, a), (_, b) in zip(x, y))
    assert worst < 1e-4, f"served KV moved a logprob by {worst}"
    assert kv.call(op="stats")["worker"]["failed_pages"] == 0


def _assert_a_hit_equals_vllms_own_hit(plain, kv, batch) -> None:
    """``plain`` (no connector) computes ``batch`` twice: the recompute, then vLLM's own hit; ``kv``
    computes it cold, then (its prefix cache reset) loads it from kvtier: the miss equals the
    recompute and the hit equals vLLM's own hit, bit for bit, with poisoned loads on."""
    full = plain.generate(batch, max_tokens=8)
    own_hit = plain.generate(batch, max_tokens=8)
    cold = kv.generate(batch, max_tokens=8)
    kv.call(op="flush")
    assert kv.call(op="reset")["ok"]
    warm = kv.generate(batch, max_tokens=8)
    for prompt, recompute, own, first, hit in zip(batch, full, own_hit, cold, warm):
        cacheable = expected_hit(len(prompt), PAGE_TOKENS, PAGE_TOKENS)
        assert own["num_cached_tokens"] == cacheable > 0, "control: vLLM's own hit covers the same prefix"
        assert loaded_tokens(first) == 0 and loaded_tokens(hit) == cacheable
        assert first["token_ids"] == recompute["token_ids"] and first["logprobs"] == recompute["logprobs"], \
            "the connector changes nothing on a miss"
        assert hit["token_ids"] == own["token_ids"] and hit["logprobs"] == own["logprobs"], \
            "bit-equal to vLLM's own hit over the same prefix"
    stats = kv.call(op="stats")["worker"]
    assert stats["failed_pages"] == 0 and stats["poison"]


def test_a_kvtier_hit_in_bfloat16_equals_vllms_own_hit(engines, tiny_model):
    """The suite's engines run float32; production runs bfloat16, whose pages the worker copies
    through an int16 view (numpy has no bfloat16): the bytes must move, never be converted.
    The model's float32 weights run in bfloat16 here."""
    batch = _batch()
    plain = engines("bf16-plain", {"model": tiny_model, "extra": None, "dtype": "bfloat16"})
    kv = engines("bf16-kvtier", {"model": tiny_model, "dtype": "bfloat16",
                                 "extra": {"block_tokens": PAGE_TOKENS, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()

    _assert_a_hit_equals_vllms_own_hit(plain, kv, batch)


@pytest.fixture(scope="module")
def interleaved_gemma3(tmp_path_factory) -> str:
    """A Gemma 3 of two layers: the first attends over a 64-token window, the second over all
    tokens (Gemma 3 interleaves five local layers with one global)."""
    from transformers import Gemma3TextConfig

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=7)
    out = tmp_path_factory.mktemp("gemma3-interleaved")
    build_model(spec, out, config_class=Gemma3TextConfig, head_dim=64, sliding_window=2 * PAGE_TOKENS,
                layer_types=["sliding_attention", "full_attention"])
    return str(out)


def test_a_model_of_sliding_and_full_layers_loads_what_vllms_own_hit_holds(engines, interleaved_gemma3):
    """Sliding-window layers beside full ones make two KV cache groups in vLLM's hybrid manager,
    which vLLM turns off for a connector without HMA support: every layer then keeps all its pages
    (one full-attention group), and the connector stores all of them. The reference is vLLM's own
    hit with the hybrid manager off too, so both compute the same way.

    On CPU, one group of mixed windows meets a vLLM decode defect (kvtier/integrations/vllm/
    cpu_windows.py): split-KV decode reads stale scratch memory, and now and then an engine
    decodes token 0 from the second token on (a CI run: the reference engine; here 5 engines in
    41, kvtier or not). The connector turns split-KV decode off for such a model itself; the
    reference engine, which has no connector, is started with it off."""
    flat = {"disable_hybrid_kv_cache_manager": True}
    plain = engines("gemma3-plain", {"model": interleaved_gemma3, "extra": None, "engine_args": flat},
                    env={cpu_windows.SWITCH: "0"})
    kv = engines("gemma3-kvtier", {"model": interleaved_gemma3, "engine_args": flat,
                                   "extra": {"block_tokens": PAGE_TOKENS, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()
    assert kv.call(op="stats")["worker"]["split_kv_off"], "the connector avoids vLLM's split-KV decode here"
    batch = _batch()
    _assert_a_hit_equals_vllms_own_hit(plain, kv, batch)


@pytest.fixture(scope="module")
def kv_sharing_gemma4(tmp_path_factory) -> str:
    """A Gemma 4 of four layers whose last two attend over the KV of earlier layers
    (``num_kv_shared_layers``, as in Gemma 3n and Gemma 4): vLLM allocates KV for two."""
    from transformers import Gemma4TextConfig

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, vocab_size=2048, max_position_embeddings=2048, seed=9)
    out = tmp_path_factory.mktemp("gemma4-kv-sharing")
    build_model(spec, out, config_class=Gemma4TextConfig, head_dim=32, layer_types=["full_attention"] * 4,
                num_kv_shared_layers=2, sliding_window=2 * PAGE_TOKENS, hidden_size_per_layer_input=16,
                vocab_size_per_layer_input=spec.vocab_size)
    return str(out)


def test_a_model_whose_layers_share_kv_loads_what_vllms_own_hit_holds(engines, kv_sharing_gemma4):
    """vLLM builds the connector from the KV cache config of the layers that own KV, then registers
    every layer's cache, a sharing layer's being its target's tensor. Before the fix the engine died
    at start-up (LayoutError: 4 KV layers registered, the config has 2). The connector stores and
    loads the owners' pages; the sharing layers read them there."""
    plain = engines("gemma4-shared-plain", {"model": kv_sharing_gemma4, "extra": None})
    kv = engines("gemma4-shared-kvtier", {"model": kv_sharing_gemma4,
                                          "extra": {"block_tokens": PAGE_TOKENS, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()
    _assert_a_hit_equals_vllms_own_hit(plain, kv, _batch())


#: the backend vLLM's CPU platform picks for latent attention here: CPU_MLA (any dtype, 16-token
#: pages: it overrides the suite's 32) or, on a CPU with AMX, AMX_MLA (bfloat16 weights only)
MLA_HOST = latent_attention_host()
MLA_PAGE_TOKENS = MLA_HOST["page_tokens"]


@pytest.fixture(scope="module")
def latent_deepseek(tmp_path_factory) -> str:
    """A DeepSeek-V2 of two layers: multi-head latent attention, whose KV is one row a token of
    the compressed latent (512) and the RoPE key (64), the one geometry vLLM's CPU kernel runs."""
    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=5,
                     latent_rank=512)
    out = tmp_path_factory.mktemp("deepseek-mla")
    build_model(spec, out)
    assert json.loads((out / "config.json").read_text())["kv_lora_rank"] == 512
    return str(out)


def test_a_kvtier_hit_on_a_latent_attention_deepseek_equals_vllms_own_hit(engines, latent_deepseek):
    """DeepSeek-V2/V3 and Kimi cache a latent per token, not K and V: pages of
    [1, 16 tokens, 576] on CPU (CPU_MLA, float32), [32 tokens, 576] in bfloat16 on a CPU with AMX
    (AMX_MLA, which takes no float32 weights: a CI run on such a host failed at start-up before the
    test chose the host's backend). The connector refused the kind before (a ConfigError at start-up).

    vLLM's CPU platform runs these models with its own prefix cache off under CPU_MLA, so there
    kvtier is the only prefix cache. The exact reference of a hit is vLLM's own hit over the same prefix (an
    engine without the connector whose prefix cache is kept on for the test): both compute the
    tail against cached latents through vLLM's context-attention path. That path is not close to
    the full recompute on this backend, and no tolerance against it would mean much: vLLM's CPU
    latent decode kernel alone is ~1e-2 off its own prefill (measured without kvtier: step k of a
    generation against a prefill of the prompt and k tokens), and its own hit is up to 0.14 off
    the recompute over 8 steps of top-5 logprobs, enough to reorder a random model's near-tied
    top-5. So the hit is held to vLLM's own hit, bit for bit."""
    block_tokens = 2 * MLA_PAGE_TOKENS   # two pages a block: the scatter of page runs is exercised
    # lengths whose prefix vLLM (>= 1 token left, whole pages) and kvtier (>= 2, blocks of two pages)
    # cache alike, for 16- and for 32-token pages
    batch = [p for length in (270, 330, 390) for p in prompts(1, length, seed=length)]
    dtype = MLA_HOST["dtype"]
    plain = engines("mla-plain", {"model": latent_deepseek, "extra": None, "force_prefix_caching": True,
                                  "dtype": dtype})
    kv = engines("mla-kvtier", {"model": latent_deepseek, "dtype": dtype,
                                "extra": {"block_tokens": block_tokens, "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()

    recompute = plain.generate(batch, max_tokens=8)
    own_hit = plain.generate(batch, max_tokens=8)
    cold = kv.generate(batch, max_tokens=8)
    kv.call(op="flush")
    # (AMX_MLA keeps vLLM's own prefix cache on: emptied, so that the hit can only be kvtier's)
    assert kv.call(op="reset")["ok"]
    assert kv.call(op="stats")["worker"]["poison"], "the suite runs every engine with poisoned loads"
    warm = kv.generate(batch, max_tokens=8)

    for prompt, full, own, first, hit in zip(batch, recompute, own_hit, cold, warm):
        cacheable = expected_hit(len(prompt), block_tokens, MLA_PAGE_TOKENS)
        assert full["num_cached_tokens"] == 0 and own["num_cached_tokens"] == cacheable > 0, \
            "control: vLLM's own hit covers the same prefix"
        assert loaded_tokens(first) == 0 and first["num_cached_tokens"] == 0, "a cold run hits nothing"
        assert loaded_tokens(hit) == cacheable, "every whole block but the last tokens came from kvtier"
        assert first["token_ids"] == full["token_ids"] and first["logprobs"] == full["logprobs"], \
            "the connector changes nothing on a miss"
        assert hit["token_ids"] == own["token_ids"]
        assert hit["logprobs"] == own["logprobs"], "bit-equal to vLLM's own hit over the same prefix"
    assert kv.call(op="stats")["worker"]["failed_pages"] == 0
