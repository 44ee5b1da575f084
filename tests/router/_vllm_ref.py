"""Local tokenizers with hand-written chat templates of real families' shapes (no hub), and vLLM's
own rendering of a request, in-process (vllm.renderers.online_renderer.OnlineRenderer: the code a
worker's /v1/chat/completions and /v1/completions run before the engine), and a worker's answer to
``/tokenize`` (vLLM's ServingTokenization over the same renderer). test_token_fidelity.py and
test_worker_render.py compare the router's ids with these; vLLM is imported only by
:func:`vllm_ids` and :func:`vllm_tokenize`."""
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
DOCUMENTS = (  # Command-R style: a RAG request's documents and tools in the preamble
    "{{ bos_token }}<|SYSTEM|>{% if documents %}Documents:{% for d in documents %}\n[{{ loop.index0 }}] "
    "{{ d.title }}: {{ d.text }}{% endfor %}{% endif %}{% if tools %}Tools:{{ tools | tojson }}{% endif %}\n"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|CHATBOT|>{% endif %}")
AGENT = (  # Qwen3 style: tools in the system turn, an assistant's thinking kept in the history, the
           # generation prompt's tail set by enable_thinking
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def make_model(root: Path, name: str, template: str | None, bos: bool = True, eos: bool = False) -> str:
    """A model folder: the tiny test Llama's weights config and BPE tokenizer, ``template`` as its
    chat template, and (``bos``) a post-processor that adds ``<s>`` as Llama/Mistral/Gemma do
    (``eos``: and ``</s>`` after the text, as some encoders' tokenizers do)."""
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
        if eos:
            eos_id = next(t["id"] for t in tj["added_tokens"] if t["content"] == "</s>")
            tj["post_processor"]["single"].append({"SpecialToken": {"id": "</s>", "type_id": 0}})
            tj["post_processor"]["special_tokens"]["</s>"] = {"id": "</s>", "ids": [eos_id], "tokens": ["</s>"]}
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return str(out)


@lru_cache(maxsize=None)
def _online(path: str):
    """A worker's renderer, served as an agent's worker is (``--enable-auto-tool-choice
    --tool-call-parser hermes``: without them vLLM refuses every request that has tools)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    mc = ModelConfig(model=path, tokenizer=path, max_model_len=2048)
    renderer = renderer_from_config(VllmConfig(model_config=mc))
    return OnlineRenderer(mc, renderer, request_logger=None, chat_template=None,
                          chat_template_content_format="auto", enable_auto_tools=True, tool_parser="hermes")


@lru_cache(maxsize=None)
def _tokenization(path: str):
    """A worker's ``/tokenize`` handler (vLLM's ServingTokenization), serving the model as "tiny"."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    online = _online(path)
    models = OpenAIModelRegistry(online.model_config, [BaseModelPath(name="tiny", model_path=path)])
    return ServingTokenization(models, online, chat_template=None, chat_template_content_format="auto")


async def vllm_tokenize(path: str, payload: dict) -> tuple[int, dict]:
    """A vLLM worker's answer to ``POST /tokenize`` with ``payload``: (status, JSON body). The
    body is read as vLLM's endpoint reads it (a TokenizeRequest: the chat or the completion
    form); a request it refuses is a 400, as its exception handlers answer."""
    import copy

    from pydantic import TypeAdapter
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

    try:
        request = TypeAdapter(TokenizeRequest).validate_python(copy.deepcopy(payload))
        out = await _tokenization(path).create_tokenize(request, None)
    except Exception as exc:  # noqa: BLE001 - vLLM's validation and template errors: its 400
        return 400, {"error": {"message": str(exc), "code": 400}}
    if isinstance(out, ErrorResponse):
        return out.error.code, out.model_dump()
    return 200, out.model_dump()


def vllm_ids(path: str, kind: str, body: dict) -> list[int]:
    """The prompt token ids vLLM's OpenAI server runs for ``body`` (first prompt of a batch);
    the calling test is skipped where vLLM is not installed."""
    import pytest

    pytest.importorskip("vllm")
    return asyncio.run(vllm_render(path, kind, body))


async def vllm_render(path: str, kind: str, body: dict) -> list[int]:
    """:func:`vllm_ids`, on a running loop; a request vLLM refuses raises a ValueError (its
    validation's, or its error answer's)."""
    import copy

    body = copy.deepcopy(body)   # (vLLM's parsing changes the messages it is given)
    online = _online(path)
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        out = await online.render_chat(ChatCompletionRequest(**{"model": path, **body}))
        if not isinstance(out, tuple):
            raise ValueError(out)
        return list(out[1][0]["prompt_token_ids"])
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    out = await online.render_completion(CompletionRequest(**{"model": path, **body}))
    if not isinstance(out, list):
        raise ValueError(out)
    return list(out[0]["prompt_token_ids"])
