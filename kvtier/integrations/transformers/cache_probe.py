"""What a model really caches, checked once when a :class:`~.session.KVTierLM` is built.

The KV layout comes from the model's config (:func:`~.namespace.kv_layout`), and a config can
say one thing while the model does another: a config field the layout code does not read
(CPM-Ant's ``dim_head``), an encoder-decoder config whose generic fields name the encoder
while the causal LM runs the decoder, a layer that skips its attention. Found at the first
request, such a model fails every request (a shape error, an ``IndexError`` inside the
model) or, worse, saves nothing and misses forever (layers the model never writes keep
the storage's held length at 0). So the session runs the model once on one token at
construction, as vLLM runs a dummy batch before it serves, and compares what the model
appended with the layout: the service fails at start, with a :class:`ConfigError`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError


def check_cache_geometry(model, cache_keyword: str, layout: KVLayout) -> None:
    """Run ``model`` on one token and raise :class:`ConfigError` unless it cached K and V of
    ``layout``'s shape in exactly ``layout.num_layers`` layers.

    A plain ``DynamicCache`` takes the appends: it grows a layer for any index the model
    writes (so a model with more layers than the layout shows them instead of raising
    ``IndexError``), and checks neither shape nor dtype (the dtype stays the request's
    check, ``StorageLayer.update``, which also sees autocast). Autocast is off here: it is
    the caller's state, not the model's. Nothing of the model changes (inference mode).
    """
    cache = DynamicCache()
    token = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode(), torch.autocast(token.device.type, enabled=False):
        model(input_ids=token, **{cache_keyword: cache}, use_cache=True, logits_to_keep=1)
    want = (1, layout.num_kv_heads, 1, layout.head_dim)
    fix = ("kvtier read this layout from the model's config; the model computes another, so blocks "
           "would be misread or never saved. kvtier's transformers integration cannot serve it")
    if len(cache.layers) != layout.num_layers:
        raise ConfigError(f"the model wrote {len(cache.layers)} cache layers, its KV layout has "
                          f"{layout.num_layers} ({layout}); {fix}")
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            raise ConfigError(f"the model never wrote cache layer {i} of {layout.num_layers} (a layer "
                              f"without attention, or one sharing another's KV); {fix}")
        got = (tuple(layer.keys.shape), tuple(layer.values.shape))
        if got != (want, want):
            raise ConfigError(
                f"cache layer {i} holds K {got[0]} and V {got[1]} for one token, the KV layout "
                f"(batch 1, {layout.num_kv_heads} KV heads, tokens, {layout.head_dim}) {want}; {fix}")
