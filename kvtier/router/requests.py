"""What the router reads of a request and of an answer: the prompt's token ids (the model's own
tokenizer and chat template, so that they are the worker's), the checks a body must pass,
the OpenAI error shape every error the router answers takes, and the cached tokens an
answer's usage reports. No I/O, no routing: :mod:`kvtier.router.app` calls these.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

import numpy as np
from aiohttp import web

from kvtier.router import chat_messages
from kvtier.router.index import lax_int, tokenizer_truncation, truncated_prompt


class RouteRequest(NamedTuple):
    input_tokens: int
    blocks: Sequence[int]


class AddedSpecial(NamedTuple):
    """How many special tokens a tokenizer's ``add_special_tokens`` puts before a text (a BOS)
    and after it (an EOS, for some models)."""
    before: int
    after: int


#: a tokenizer that adds none (or one the router cannot ask: a test's stand-in)
NO_SPECIAL = AddedSpecial(0, 0)
#: the largest ``truncate_prompt_tokens`` vLLM takes (its request models' ``le=_INT64_MAX``)
INT64_MAX = 2**63 - 1


class RequestError(Exception):
    """A client mistake or an unavailable service, answered in the OpenAI error format; ``close``:
    the connection is closed after the answer (a body that never came whole: its rest unread)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.kind, self.param, self.close = status, kind, param, close


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class PromptTokenizer:
    """The model's own tokenizer and chat template (transformers, from a local folder)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.model_path = model_path
        # truncating on the left, as vLLM loads a generating model's tokenizer (tokenizers/registry.py)
        self.tok = AutoTokenizer.from_pretrained(model_path, truncation_side="left")
        self.added_special = self._added_special()

    def clone(self) -> "PromptTokenizer":
        """Another instance, for another thread: calls into one HF tokenizer object must not overlap."""
        return PromptTokenizer(self.model_path)

    def completion(self, prompt: Any, add_special_tokens: bool = True, truncate_to: int | None = None) -> list[int]:
        """A completion prompt's ids as vLLM makes them (``add_special_tokens``: the request's,
        vLLM's default True: a BOS first, for most models). ``truncate_to`` N (a text's
        ``truncate_prompt_tokens`` without ``truncation_side``: index.tokenizer_truncation): encoded
        as vLLM encodes it, truncated by the tokenizer on the left *before* its special tokens are
        added, so a BOS stays first: ``[BOS] + the last N-1``, not the last N of ``[BOS, ...]``."""
        prompt = first_prompt(prompt)     # a batch: route on its first prompt
        if isinstance(prompt, str):
            if truncate_to:
                return self._encode(prompt, "prompt", add_special_tokens=add_special_tokens, truncation=True,
                                    max_length=truncate_to)
            return self._encode(prompt, "prompt", add_special_tokens=add_special_tokens)
        ids = token_ids(prompt)
        if ids is not None:
            return ids
        raise RequestError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")

    def chat(self, messages: list, body: dict) -> list[int]:
        """A chat prompt's ids as vLLM makes them: its rendering tokenized, special tokens added
        only if the chat asks (vLLM's default ``add_special_tokens: false`` for chats: the
        template holds the BOS), truncated as vLLM truncates it (:func:`truncated_chat`)."""
        return self.chat_prefix(messages, body, -1)[0]

    def chat_prefix(self, messages: list, body: dict, max_chars: int) -> tuple[list[int], float]:
        """The leading tokens of a chat prompt as :meth:`chat` makes them, from its first
        ``max_chars`` rendered characters at most (-1: all), and the share of the rendering they
        come from (1.0: all of it, the ids whole). A long chat is rendered whole (a string: cheap)
        but only its head tokenized, at ~400 bytes a token: the router routes on a prompt's first
        blocks, and tokenizing a 16 MiB body held gigabytes. The last tokens of a cut rendering may
        straddle the cut: the caller drops them (:func:`route_prefix`). Whole ids come truncated
        as vLLM truncates the chat (:func:`truncated_chat`); a cut rendering's truncation is the
        caller's (its last tokens are not known here)."""
        if not getattr(self.tok, "chat_template", None):
            # no template: key on the concatenated contents (routing still groups a session's turns)
            text = self._plain_chat(messages)
            if 0 <= max_chars < len(text):
                return self._encode(text[:max_chars], "messages"), max_chars / len(text)
            return self._encode(text, "messages"), 1.0
        text = self._rendered(messages, body)
        share = 1.0
        if 0 <= max_chars < len(text):
            text, share = text[:max_chars], max_chars / len(text)
        # what vLLM does with its rendering (and apply_chat_template(tokenize=True) too)
        add_special = chat_messages.lax_bool(body.get("add_special_tokens"), False)
        try:
            ids = list(self.tok(text, add_special_tokens=add_special)["input_ids"])
        except (TypeError, ValueError) as exc:
            raise RequestError(400, f"messages are not text the model's tokenizer can encode: {exc}",
                               param="messages") from None
        return (truncated_chat(ids, body, self) if share >= 1.0 else ids), share

    def _rendered(self, messages: list, body: dict) -> str:
        """The chat template's rendering of ``messages`` as a vLLM worker renders them: messages
        prepared as vLLM prepares them (:mod:`kvtier.router.chat_messages`) for the template's
        content format, the template arguments vLLM builds from the request's fields."""
        kwargs, generation_prompt = self._template_kwargs(body)
        try:
            template = self.tok.get_chat_template(kwargs.get("chat_template"), tools=kwargs.get("tools"))
            conv = chat_messages.conversation(messages, chat_messages.content_format(template), template)
            return self.tok.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=False,
                                                **kwargs)
        except Exception as exc:   # a template that rejects these messages: the worker will too
            raise RequestError(400, f"messages do not fit the model's chat template: {exc}",
                               param="messages") from None

    def _added_special(self) -> AddedSpecial:
        """Where this tokenizer's special tokens go around a text (found by encoding one)."""
        bare, full = self.tok.encode("a", add_special_tokens=False), self.tok.encode("a")
        before = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        return AddedSpecial(before, max(len(full) - len(bare) - before, 0))

    @staticmethod
    def _plain_chat(messages: list) -> str:
        return "\n".join(str(m.get("content", "")) for m in messages)

    @staticmethod
    def _template_kwargs(body: dict) -> tuple[dict, bool]:
        """What vLLM passes the chat template for ``body``, and whether a generation prompt ends it."""
        kwargs, generation_prompt, continue_final = chat_messages.template_kwargs(body)
        # what vLLM passes its template too (when no worker could render them)
        if isinstance(body.get("tools"), list):
            kwargs["tools"] = body["tools"]
        if isinstance(body.get("chat_template"), str) and body["chat_template"]:
            kwargs["chat_template"] = body["chat_template"]
        kwargs["continue_final_message"] = continue_final
        return kwargs, generation_prompt and not continue_final

    def _encode(self, text: str, param: str, **kwargs) -> list[int]:
        """``text``'s ids; a string no tokenizer can take (JSON may carry a lone UTF-16 surrogate,
        ``"\\ud800"``, which is no Unicode text) is the client's error, not the router's."""
        try:
            return self.tok.encode(text, **kwargs)
        except (TypeError, ValueError) as exc:
            raise RequestError(400, f"{param} is not text the model's tokenizer can encode: {exc}",
                               param=param) from None


def truncated_chat(ids: list[int], body: dict, tokenizer: Any) -> list[int]:
    """A chat's whole ids (its rendering's tokens, and around them the special tokens the chat
    asks ``tokenizer`` to add; a worker's ``/tokenize`` or the router's own) as vLLM truncates
    them for ``truncate_prompt_tokens`` N: index.truncated_prompt's slice, except where the chat
    adds special tokens and names no side. vLLM's tokenizer truncates those (``truncation=True,
    max_length=N``, as tokenizer_truncation does for a completion) and keeps the special tokens it
    adds: ``[BOS] + the last N-1``, not the last N of ``[BOS, ...]`` (every block keyed wrong).
    (An N below their count: they are kept, then sliced to N, as vLLM slices them.) Truncating
    the result again leaves it as it is."""
    n = tokenizer_truncation(body)
    added = getattr(tokenizer, "added_special", NO_SPECIAL)
    if (n is None or n >= len(ids) or added == NO_SPECIAL
            or not chat_messages.lax_bool(body.get("add_special_tokens"), False)):
        return truncated_prompt(ids, body)
    end = len(ids) - added.after
    kept = ids[:added.before] + ids[max(end - max(n - added.before - added.after, 0), added.before):end] + ids[end:]
    return truncated_prompt(kept, body)


#: token ids are below this (vLLM's are ``>= 0``; the router's keys take 32 bits)
TOKEN_ID_LIMIT = 1 << 32


def token_ids(value: Any) -> list[int] | None:
    """``value`` as vLLM's request model reads a list of token ids, as ints (0 <= id < 2**32), or
    None if it is none. Its pydantic lax mode takes what :func:`lax_int` takes: ``3.0`` (numpy
    and torch float arrays' ``tolist()`` give those), ``true``, ``"3"``; never ``1.5``. A list of
    ints is handed back as it is, checked in C loops (the types as a set, then min and max): a
    million ids in ~25 ms instead of ~60."""
    if not isinstance(value, list):
        return None
    if len(value) < 64:   # (a batch of many short ones: the generator costs less than the set)
        if all(type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in value):
            return value
    elif set(map(type, value)) == {int}:
        return value if min(value) >= 0 and max(value) < TOKEN_ID_LIMIT else None
    ids = [lax_int(t) for t in value]
    return ids if all(t is not None and 0 <= t < TOKEN_ID_LIMIT for t in ids) else None


def token_list(value: Any) -> bool:
    """``value`` is a list of token ids as vLLM reads one (:func:`token_ids`)."""
    return token_ids(value) is not None


def valid_prompt(prompt: Any) -> bool:
    """A completion's ``prompt`` as vLLM takes it: a text, a non-empty list of token ids, or a
    batch (:func:`is_batch`) of texts or of non-empty lists of ids. (A list that begins with a
    text is a batch of texts, so ``["3", 4]``, which vLLM reads as ids, is refused.)"""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if is_batch(prompt):
        return set(map(type, prompt)) == {str} or all(token_list(p) and p for p in prompt)
    return token_list(prompt)


def is_batch(prompt: Any) -> bool:
    """A completion's ``prompt`` is a batch: a list of texts or of token-id lists, each of which
    vLLM runs as an engine request of its own."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (list, str))


def first_prompt(prompt: Any) -> Any:
    """The prompt a completion is routed on: a batch's first (a text or a list of ids)."""
    return prompt[0] if is_batch(prompt) else prompt


def rest_of_batch_tokens(prompts: list, tokens_per_char: float, special_tokens: int, body: dict) -> int:
    """The prefill tokens of a completion batch's prompts after its first: a list of ids its
    length; a text estimated from its characters at ``tokens_per_char`` (:func:`text_rate`),
    plus the ``special_tokens`` the tokenizer adds to each (a batch is texts or ids, never both);
    each cut to the request's ``truncate_prompt_tokens`` N as vLLM cuts each of its prompts (N >=
    0: at most N; -1, the model's own limit, unknown here: whole). Counted in numpy, the lengths a
    slice at a time (:func:`prompt_lengths`)."""
    lengths = prompt_lengths(prompts, 1)
    if isinstance(prompts[0], str):
        lengths = special_tokens + np.rint(lengths * tokens_per_char).astype(np.int64)
    n = lax_int(body.get("truncate_prompt_tokens"))
    if n is not None and n >= 0:
        lengths = np.minimum(lengths, n)
    return int(lengths.sum())


def prompt_lengths(prompts: list, start: int = 0) -> np.ndarray:
    """The length of each of ``prompts[start:]`` (a text's characters, a list's ids), taken
    :data:`BATCH_SLICE` prompts at a time. ``map(len, ...)`` is C code that holds the GIL until it
    returns: over a whole 16 MiB batch (~5.6 M texts) it held it 0.2 s, from a thread of its own
    as well, so the event loop stood still just the same (audit s30 a11 D4). Between slices the
    interpreter hands the GIL to a thread that waits for it."""
    lengths = np.empty(max(len(prompts) - start, 0), dtype=np.int64)
    for at in range(start, len(prompts), BATCH_SLICE):
        part = prompts[at:at + BATCH_SLICE]
        lengths[at - start:at - start + len(part)] = np.fromiter(map(len, part), dtype=np.int64, count=len(part))
    return lengths


def text_rate(tokens: int, chars: int) -> float | None:
    """Tokens per character of a text of ``chars`` characters that tokenized to ``tokens`` (its
    special tokens aside), at which a batch's other texts are priced; None for a text shorter than
    :data:`RATE_SAMPLE_CHARS`, too short to say what the others hold."""
    return max(tokens, 0) / chars if chars >= RATE_SAMPLE_CHARS else None


def rate_sample(prompts: list) -> str | None:
    """The text a batch of texts takes its tokens per character from when its first is too short
    (:func:`text_rate`): the first of at least :data:`RATE_SAMPLE_CHARS` characters, its first
    :data:`RATE_SAMPLE_MAX_CHARS` (a rate needs no more); None if the batch has none."""
    sample = next((p for p in prompts if len(p) >= RATE_SAMPLE_CHARS), None)
    return None if sample is None else sample[:RATE_SAMPLE_MAX_CHARS]


def text_chars(prompt: Any) -> int:
    """Characters the tokenizer is given for a completion's prompt (a batch: its first prompt,
    the one routed on; token ids: none to encode, answered without walking them)."""
    prompt = first_prompt(prompt)
    return len(prompt) if isinstance(prompt, str) else 0


#: characters of a long text tokenized per routed token (``max_route_tokens``): English runs ~4
#: to a token, so a text is cut near the tokens routing uses, not tokenized whole
CHARS_PER_ROUTE_TOKEN = 4
#: the fewest characters of a text whose tokens per character a completion batch's other texts are
#: priced at: an empty first text measured 0, and ``["", t, t, t, t]`` was priced as nothing but
#: its special tokens, in the queue's price, the admission cap and the planner's prompt mix
#: (audit s30 a11 D3)
RATE_SAMPLE_CHARS = 64
#: the most characters of a batch's sample text tokenized to measure its rate
RATE_SAMPLE_MAX_CHARS = 4096
#: tokens per character of a batch none of whose texts is long enough to measure it
DEFAULT_TOKENS_PER_CHAR = 1 / CHARS_PER_ROUTE_TOKEN
#: a completion batch's prompts measured per slice (:func:`prompt_lengths`; ~1 ms each)
BATCH_SLICE = 16384
#: a cut text's last tokens dropped beside its last partial block: a token or a few may straddle
#: the cut, and a chat template's closing tokens come after a cut rendering
CUT_MARGIN_TOKENS = 64


class RoutedPrompt(NamedTuple):
    """What a request is routed on: ``ids``, the prompt's leading tokens routing keys (at most
    ``max_route_tokens``), and ``tokens``, the prompt's whole length as far as the router knows it
    (estimated from the share of a cut text that was tokenized)."""
    ids: list[int]
    tokens: int


def route_prefix(ids: list[int], share: float, max_tokens: int, block_tokens: int) -> RoutedPrompt:
    """``ids``, the tokens of a text's first ``share`` (1.0: all of it), as the request is routed:
    a whole tokenization cut to ``max_tokens`` whole blocks; a cut text's tokens less the last
    :data:`CUT_MARGIN_TOKENS` and its last partial block (they may differ from the whole text's)."""
    limit = max(max_tokens // block_tokens, 1) * block_tokens
    if share >= 1.0:
        return RoutedPrompt(ids[:limit] if len(ids) > limit else ids, len(ids))
    keep = min(max(0, len(ids) - CUT_MARGIN_TOKENS) // block_tokens * block_tokens, limit)
    return RoutedPrompt(ids[:keep], max(len(ids), round(len(ids) / share)) if share > 0 else len(ids))


#: chat fields a worker renders: tools and documents (vLLM normalises them through its own
#: schema first), a request's own ``chat_template`` and ``add_special_tokens`` (the router's
#: rendering once ignored them: every block keyed wrong; it adds the special tokens now, when
#: no worker renders)
WORKER_RENDERED = ("tools", "documents", "chat_template", "add_special_tokens")
#: the fields of a chat request that a worker's ``/tokenize`` takes as they are (vLLM's
#: TokenizeChatRequest); the others it renders with: :func:`worker_render_payload`
RENDER_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "add_special_tokens", "media_io_kwargs", "mm_processor_kwargs")


def worker_render_payload(body: dict) -> dict:
    """What a worker's ``/tokenize`` is sent to render the chat ``body`` as its
    ``/v1/chat/completions`` renders it. vLLM's TokenizeChatRequest is not its chat request: it
    has no ``documents`` and no ``reasoning_effort`` (nor the ``enable_thinking`` that implies),
    and it reads a message's ``reasoning`` only, never renaming the older ``reasoning_content``
    (a request sent as it came rendered without its documents, its effort or an agent's
    thinking turns: every block from there on keyed wrong). Those fields are folded into its
    ``chat_template_kwargs`` as the chat request merges them (their values win), and the
    messages renamed as the chat request renames them. ``body`` is left as it came."""
    payload = {k: body[k] for k in RENDER_FIELDS if k in body}
    given = body.get("chat_template_kwargs")
    added = chat_messages.chat_request_kwargs(body)
    if added and (given is None or isinstance(given, dict)):   # (any other: the chat is refused)
        payload["chat_template_kwargs"] = {**(given or {}), **added}
    payload["messages"] = chat_messages.reasoning_renamed(body["messages"])
    return payload


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
    n = lax_int(body.get("truncate_prompt_tokens"))   # ("40", 40.0: vLLM reads them as 40)
    if n is not None and not -1 <= n <= INT64_MAX:   # (as vLLM refuses it: past 2**64 the tokenizer raised, a 500)
        raise RequestError(400, f"'truncate_prompt_tokens' must be -1 (the model's limit) or from 0 to {INT64_MAX}",
                           param="truncate_prompt_tokens")


def _token_count(value: Any, absent: int | None = None) -> int | None:
    """A usage field as a count of tokens: an int >= 0 (a bool is no count), ``absent`` for a
    field left out or null, None for anything else (a string, a float, a negative number)."""
    if value is None:
        return absent
    return value if type(value) is int and value >= 0 else None


def cached_tokens(usage: Any) -> tuple[int, int] | None:
    """(cached, prompt) tokens of an answer's usage: OpenAI's, or Anthropic's (``/v1/messages``:
    vLLM reports ``input_tokens`` less the cached and newly cached ones). None unless every field
    read is a count of tokens: a backend's ``"n/a"`` or ``-1`` raised in the router's bookkeeping
    after the answer was relayed (audit s33 a5 D1), and counted, would garble the planner's hit rate."""
    if not isinstance(usage, dict):
        return None
    if usage.get("cache_read_input_tokens") is not None:   # Anthropic's
        counts = [_token_count(usage["cache_read_input_tokens"]), _token_count(usage.get("input_tokens"), 0),
                  _token_count(usage.get("cache_creation_input_tokens"), 0)]
        return None if None in counts else (counts[0], sum(counts))
    details = usage.get("prompt_tokens_details")
    cached = _token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
    prompt = _token_count(usage.get("prompt_tokens"), 0)
    return None if cached is None or prompt is None else (cached, prompt)


def usage_of_stream(tail: bytes) -> Any:
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return json.loads(line[6:]).get("usage")
            except (ValueError, AttributeError, RecursionError):
                return None
    return None
