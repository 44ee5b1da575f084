"""kvtier for Hugging Face transformers causal LMs (Llama, Qwen2, Mistral without sliding window).

* :mod:`.namespace` — the namespace of a model: KV layout from its config, an exact weights identity
  (every byte hashed once, cached by :mod:`.weights_hash`).
* :mod:`.cache_io` — store blocks ↔ the model's ``DynamicCache``, one large copy per block.
* :mod:`.cache_probe` — what the model really caches, and whether it resumes from a cache as kvtier feeds it
  (a few tokens whole, then as a cached prefix and a suffix), checked at start.
* :mod:`.weights_watch` — whether the model's weights changed since its session was built, checked at
  each request without hashing them.
* :mod:`.session` — :class:`KVTierLM`: lookup → load → prefill the suffix → generate → save.
* :mod:`.models` — random-weight Llama models and a local tokenizer, built once and cached.

The names below resolve lazily, so that ``models`` (paths, specs) imports
without torch; ``KVTierLM`` and the namespace helpers import torch/transformers.
"""

from __future__ import annotations

__all__ = ["Generation", "KVTierLM", "Prepared", "kv_layout", "namespace_for_model", "weights_identity"]

_HOMES = {
    "Generation": "session", "KVTierLM": "session", "Prepared": "session",
    "kv_layout": "namespace", "namespace_for_model": "namespace", "weights_identity": "namespace",
}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
