"""vLLM's CPU page layout depends on the host, and a block is never shared across layouts.

A bfloat16 page written by vLLM's AMX kernels holds other bytes than the AVX-512 / AVX2
kernels' page of the same K and V; latent attention runs AMX_MLA or CPU_MLA by the same test.
The connector's format tag (the first link of every key) named the model, dtype, geometry and
vLLM's attention settings, but not that: two hosts of a fleet sharing a tier (or one disk tier
moved between machines) could hand each other pages that read as other KV.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.vllm.cpu_pages import amx_tiles
from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)

AMX = pytest.mark.skipif(not amx_tiles(), reason="needs a CPU with AMX tiles (vLLM's other CPU page layout)")


def _spec(dtype, **kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if kw.pop("latent", False):
        return MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=dtype, **kw)
    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dtype, **kw)


def test_the_page_format_names_the_layout_the_host_writes(monkeypatch):
    """With AMX tiles and without, as vLLM decides (the host's flag switched): bfloat16 pages
    and latent pages get other names; float32 pages (which vLLM lays out alike) the same."""
    from kvtier.integrations.vllm import cpu_pages

    monkeypatch.setattr(cpu_pages.platform, "machine", lambda: "x86_64")
    names = {}
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        names[amx] = {kind: cpu_pages.page_format(spec, "auto") for kind, spec in
                      {"bf16": _spec(torch.bfloat16), "f32": _spec(torch.float32),
                       "latent": _spec(torch.bfloat16, latent=True)}.items()}
        # CPU_MLA asked for by name: the reference backend even with AMX tiles
        assert cpu_pages.page_format(_spec(torch.bfloat16, latent=True), "auto", "CPU_MLA") == "CPU_MLA"
    assert names[True]["bf16"] != names[False]["bf16"], names
    assert names[True]["latent"] == "AMX_MLA" and names[False]["latent"] == "CPU_MLA"
    assert names[True]["f32"] == names[False]["f32"], "control: float32 pages are laid out alike"


@AMX
def test_vllms_amx_page_is_not_its_vector_page():
    """The reason for the rule, measured on vLLM's own kernel: the same K and V cached with
    the ``amx`` and the ``vec`` layout give other bytes. Control: ``vec`` and ``vec16`` agree."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    key, value = torch.randn(64, 2, 64, dtype=torch.bfloat16), torch.randn(64, 2, 64, dtype=torch.bfloat16)
    pages = {}
    for isa in ("amx", "vec", "vec16"):
        k, v = torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16)
        ops.cpu_attn_reshape_and_cache(key, value, k, v, torch.arange(64), isa)
        pages[isa] = (k, v)
    assert not torch.equal(pages["amx"][0], pages["vec"][0]) and not torch.equal(pages["amx"][1], pages["vec"][1])
    assert torch.equal(pages["vec"][0], pages["vec16"][0]) and torch.equal(pages["vec"][1], pages["vec16"][1])


@AMX
def test_a_block_written_with_amx_pages_is_a_miss_on_a_host_without(engines, tiny_model, tmp_path):
    """Two hosts on one disk tier, the tiny Llama in bfloat16: a writer with AMX tiles, a reader
    running as a host without them (``hide_amx``). The reader loaded the writer's blocks before
    (its pages read as other KV); now it finds none. Control: a reader with AMX tiles loads them."""
    disk = tmp_path / "disk"
    extra = {"block_tokens": 64, "host_bytes": 0, "disk_path": str(disk), "disk_bytes": "256MiB"}
    batch = prompts(2, 300, seed=41)
    writer = engines("amx-writer", {"model": tiny_model, "dtype": "bfloat16", "extra": extra})
    other = engines("no-amx-reader", {"model": tiny_model, "dtype": "bfloat16", "extra": extra, "hide_amx": True})
    same = engines("amx-reader", {"model": tiny_model, "dtype": "bfloat16", "extra": extra})
    for engine in (writer, other, same):
        engine.wait_ready()
    written = writer.generate(batch, max_tokens=4)
    assert all(loaded_tokens(o) == 0 for o in written)
    writer.call(op="flush")
    assert all(loaded_tokens(o) == 0 for o in other.generate(batch, max_tokens=4)), \
        "a host that lays pages out otherwise must not load them"
    hits = same.generate(batch, max_tokens=4)
    assert [loaded_tokens(o) for o in hits] == [expected_hit(len(p), 64) for p in batch]   # control
    assert [o["token_ids"] for o in hits] == [o["token_ids"] for o in written]
