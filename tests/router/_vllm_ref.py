"""Local tokenizers with hand-written chat templates of real families' shapes (no hub), and vLLM's
own rendering of a request, in-process (vllm.renderers.online_renderer.OnlineRenderer: the code a
worker's /v1/chat/completions and /v1/completions run before the engine). test_token_fidelity.py
compares the router's ids with these; vLLM is imported only by :func:`vllm_ids`."""
from __future__ import annotations

import asyncio
import json
import shutil
from functools import lru_cache
from pathlib import Path

from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- if message.content %}\n{{ message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
MISTRAL_V3 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% endif %}{% endfor %}")
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
OPENAI_ONLY = (  # iterates content without a string branch: vLLM hands it parts ("openai" format)
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}{{ part['text'] }}|{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DEVELOPER_AWARE = (  # names the developer role: vLLM leaves it as it is
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'developer' %}<|dev|>"
    "{% else %}<|{{ message['role'] }}|>{% endif %}{{ message['content'] }}\n{% endfor %}")
TOOL_CALL_JSON = (  # prints an assistant's tool calls whole
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}\n{% endfor %}")
THINKING = (  # Qwen3 style: enable_thinking in the generation prompt's tail
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
SYSTEM_EFFORT = (  # gpt-oss/Gemma-4 style: the request's reasoning effort in the system header, first
    "{{ bos_token }}<|system|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_model(root: Path, name: str, template: str | None, bos: bool = True) -> str:
    """A model folder: the tiny test Llama's weights config and BPE tokenizer, ``template`` as its
    chat template, and (``bos``) a post-processor that adds ``<s>`` as Llama/Mistral/Gemma do."""
    src = ensure_model(VLLM_TEST_SPEC)[0]
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / f, out / f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = template
    else:
        cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    tj = json.loads((out / "tokenizer.json").read_text())
    if bos:
        bos_id = next(t["id"] for t in tj["added_tokens"] if t["content"] == "<s>")
        tj["post_processor"] = {"type": "TemplateProcessing",
                                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}}],
                                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}},
                                         {"Sequence": {"id": "B", "type_id": 1}}],
                                "special_tokens": {"<s>": {"id": "<s>", "ids": [bos_id], "tokens": ["<s>"]}}}
        cfg["add_bos_token"] = True
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return str(out)


@lru_cache(maxsize=None)
def _online(path: str):
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    mc = ModelConfig(model=path, tokenizer=path, max_model_len=2048)
    renderer = renderer_from_config(VllmConfig(model_config=mc))
    return OnlineRenderer(mc, renderer, request_logger=None, chat_template=None,
                          chat_template_content_format="auto")


def vllm_ids(path: str, kind: str, body: dict) -> list[int]:
    """The prompt token ids vLLM's OpenAI server runs for ``body`` (first prompt of a batch);
    the calling test is skipped where vLLM is not installed."""
    import copy

    import pytest

    pytest.importorskip("vllm")
    body = copy.deepcopy(body)   # (vLLM's parsing changes the messages it is given)
    online = _online(path)
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        out = asyncio.run(online.render_chat(ChatCompletionRequest(**{"model": path, **body})))
        if not isinstance(out, tuple):
            raise ValueError(out)
        return list(out[1][0]["prompt_token_ids"])
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    out = asyncio.run(online.render_completion(CompletionRequest(**{"model": path, **body})))
    if not isinstance(out, list):
        raise ValueError(out)
    return list(out[0]["prompt_token_ids"])
