"""The router tokenizes with the model's own tokenizer (a real local one), so its ids are the worker's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_prompt_ids_are_the_model_tokenizers(tmp_path):
    from transformers import AutoTokenizer

    from kvtier.integrations.transformers.models import ModelSpec, ensure_model
    from kvtier.router.app import PromptTokenizer, RequestError

    spec = ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, vocab_size=2048, max_position_embeddings=2048)
    path = str(ensure_model(spec)[0])
    tok = PromptTokenizer(path)
    ref = AutoTokenizer.from_pretrained(path)
    text = "the quick brown fox jumps over the lazy dog " * 20
    assert tok.completion(text) == ref.encode(text)
    assert tok.completion([text, "other"]) == ref.encode(text)        # a batch routes on its first prompt
    assert tok.completion([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(RequestError):
        tok.completion({"a": 1})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    ids = tok.chat(messages, {})
    if ref.chat_template:
        assert ids == list(ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    else:   # no template: keyed on the contents, the same for every turn of a session
        assert ids == ref.encode("be brief\n" + text)
