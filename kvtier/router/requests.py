"""What the router reads of a request and of an answer: the prompt's token ids (the model's own
tokenizer and chat template, so that they are the worker's), the checks a body must pass,
the OpenAI error shape every error the router answers takes, and the cached tokens an
answer's usage reports. No I/O, no routing: :mod:`kvtier.router.app` calls these.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

from aiohttp import web


class RouteRequest(NamedTuple):
    input_tokens: int
    blocks: Sequence[int]


class RequestError(Exception):
    """A client mistake or an unavailable service, answered in the OpenAI error format."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class PromptTokenizer:
    """The model's own tokenizer and chat template (transformers, from a local folder)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.tok = AutoTokenizer.from_pretrained(model_path)

    def clone(self) -> "PromptTokenizer":
        """Another instance, for another thread: calls into one HF tokenizer object must not overlap."""
        return PromptTokenizer(self.model_path)

    def completion(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids as vLLM makes them (``add_special_tokens``: the request's,
        vLLM's default True: a BOS first, for most models)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]     # a batch: route on its first prompt
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt", add_special_tokens=add_special_tokens)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")

    def chat(self, messages: list, body: dict) -> list[int]:
        kwargs = {}
        if body.get("chat_template_kwargs") and isinstance(body["chat_template_kwargs"], dict):
            kwargs = dict(body["chat_template_kwargs"])
        # what vLLM passes its template too (defaults as vLLM's)
        for name in ("tools", "documents"):
            if isinstance(body.get(name), list):
                kwargs[name] = body[name]
        if isinstance(body.get("chat_template"), str) and body["chat_template"]:
            kwargs["chat_template"] = body["chat_template"]   # (when no worker renders it)
        kwargs["continue_final_message"] = body.get("continue_final_message") is True
        generation_prompt = body.get("add_generation_prompt") is not False and not kwargs["continue_final_message"]
        if getattr(self.tok, "chat_template", None):
            try:
                ids = self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                   **kwargs)
            except Exception as exc:   # a template that rejects these messages: the worker will too
                raise RequestError(400, f"messages do not fit the model's chat template: {exc}",
                                   param="messages") from None
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        # No template: key on the concatenated contents (routing still groups a session's turns).
        return self._encode("\n".join(str(m.get("content", "")) for m in messages), "messages")

    def _encode(self, text: str, param: str, **kwargs) -> list[int]:
        """``text``'s ids; a string no tokenizer can take (JSON may carry a lone UTF-16 surrogate,
        ``"\\ud800"``, which is no Unicode text) is the client's error, not the router's."""
        try:
            return self.tok.encode(text, **kwargs)
        except (TypeError, ValueError) as exc:
            raise RequestError(400, f"{param} is not text the model's tokenizer can encode: {exc}",
                               param=param) from None


def token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t < 1 << 32 for t in value)


def valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str) or (token_list(prompt) and prompt):
        return True
    return (isinstance(prompt, list) and bool(prompt)
            and (all(isinstance(p, str) for p in prompt) or all(token_list(p) and p for p in prompt)))


def text_chars(prompt: Any) -> int:
    """Characters a completion's prompt gives the tokenizer (token ids: none to encode)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


#: chat fields a worker renders: tools and documents (vLLM normalises them through its own
#: schema first), a request's own ``chat_template`` and ``add_special_tokens`` (the router's
#: rendering used the model's template, without special tokens: every block keyed wrong)
WORKER_RENDERED = ("tools", "documents", "chat_template", "add_special_tokens")
#: what a worker's ``/tokenize`` takes of a chat request (vLLM's TokenizeChatRequest)
RENDER_FIELDS = ("model", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                  "chat_template", "chat_template_kwargs", "add_special_tokens", "mm_processor_kwargs")


def check_body(body: Any, field: str) -> None:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if field not in body:
        raise RequestError(400, f"'{field}' is a required property", param=field)
    if field == "prompt" and not valid_prompt(body["prompt"]):
        raise RequestError(400, "'prompt' must be a string, a list of token ids (0 <= id < 2**32), "
                                "or a non-empty list of those", param="prompt")
    if field == "messages":
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects",
                               param="messages")


def cached_tokens(usage: Any) -> tuple[int, int] | None:
    """(cached, prompt) tokens of an answer's usage: OpenAI's, or Anthropic's (``/v1/messages``:
    vLLM reports ``input_tokens`` less the cached and newly cached ones)."""
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        cached = usage["cache_read_input_tokens"]
        return cached, cached + int(usage.get("input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int):
        return None
    return cached, int(usage.get("prompt_tokens") or 0)


def usage_of_stream(tail: bytes) -> Any:
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return json.loads(line[6:]).get("usage")
            except (ValueError, AttributeError, RecursionError):
                return None
    return None
