"""kvtier for Hugging Face transformers causal LMs (Llama, Qwen2, Mistral without sliding window).

Importing this package imports torch and transformers; the rest of kvtier never does.

* :mod:`.namespace` — the namespace of a model: KV layout from its config, a cheap weights identity.
* :mod:`.cache_io` — store blocks ↔ the model's ``DynamicCache``, one large copy per block.
* :mod:`.session` — :class:`KVTierLM`: lookup → load → prefill the suffix → generate → save.
* :mod:`.models` — random-weight Llama models and a local tokenizer, built once and cached.
"""

from kvtier.integrations.transformers.namespace import kv_layout, namespace_for_model, weights_identity
from kvtier.integrations.transformers.session import Generation, KVTierLM, Prepared

__all__ = ["Generation", "KVTierLM", "Prepared", "kv_layout", "namespace_for_model", "weights_identity"]
