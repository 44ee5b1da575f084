"""A chat request's messages and template arguments as a vLLM worker hands them to the chat
template, so that the router renders (and keys) the prompt the worker runs.

vLLM does not give the client's ``messages`` to ``apply_chat_template`` as they come: it parses
every message (vllm/renderers/chat_utils.py ``_parse_chat_message_content``,
``_postprocess_messages``; the request model's ``_normalize_messages_before``), converts
``developer`` turns for templates that do not know the role (renderers/hf.py
``safe_apply_chat_template``) and builds the template's arguments from several request fields
(``ChatCompletionRequest.build_chat_params``). This module mirrors that for text chats, written
from vLLM 0.32's code: the router runs without vLLM installed, so it cannot import it, and
tests/router/test_token_fidelity.py compares both renderings wherever vLLM is installed.

What it does not mirror, a worker renders (:func:`worker_renders`): media parts (vLLM inserts
the model's placeholders and processes the media), tool references, parts it does not know.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

#: text part types and the field holding their text (chat_utils.MM_PARSER_MAP, TEXT_PART_TYPES)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
#: part types whose empty text vLLM skips silently (chat_utils.PART_TYPES_TO_SKIP_NONE_CONTENT)
SKIP_NONE = ("text", "refusal")
#: fields of vLLM's content-part schemas (chat_utils._KNOWN_CONTENT_PART_FIELDS): an "openai"
#: format template is given a text part's *other* fields beside its text (e.g. cache_control)
KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"})
#: a tool call's fields and its function's, in the order of OpenAI's schema
TOOL_CALL_FIELDS, FUNCTION_FIELDS = ("id", "function", "type"), ("arguments", "name")
#: Claude Code's attribution line, dropped from system text by vLLM (its value changes per request)
BILLING_HEADER = "x-anthropic-billing-header"
#: apply_chat_template arguments the router fixes itself: a client's value would change what it
#: gets back (a dict, arrays, a mask), not the prompt
ROUTER_OWNED = ("tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "chat_template",
                "add_generation_prompt", "continue_final_message")
#: template arguments vLLM leaves unset when a request gives them (renderers/params.py merge_kwargs'
#: ``unset_values``): the template sees the variable undefined, its own default
UNSET = (None, "auto")
#: how pydantic's lax mode reads a boolean (vLLM's request models): anything else is refused
_TRUE, _FALSE = frozenset({"1", "on", "t", "true", "y", "yes"}), frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any, default: bool) -> bool:
    """``value`` as vLLM's pydantic request model reads a boolean field (``"false"``, ``0``,
    ``"off"``: False); ``default`` when absent, null or not a boolean at all (the worker refuses
    that request: its routing does not matter)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    return default


def template_kwargs(body: dict) -> tuple[dict, bool, bool]:
    """The template variables vLLM renders ``body`` with (``build_chat_params``, then
    ``ChatParams.with_defaults``: the request's ``chat_template_kwargs`` under its own fields,
    which win, and values :data:`UNSET` dropped), less those the router passes itself, and the
    request's ``add_generation_prompt`` and ``continue_final_message``."""
    given = body.get("chat_template_kwargs")
    kwargs = ({k: v for k, v in given.items() if k not in ROUTER_OWNED and v not in UNSET}
              if isinstance(given, dict) else {})
    kwargs.update(chat_request_kwargs(body))
    return (kwargs, lax_bool(body.get("add_generation_prompt"), True),
            lax_bool(body.get("continue_final_message"), False))


def chat_request_kwargs(body: dict) -> dict:
    """The template variables a chat request adds from its own fields (vLLM's
    ``ChatCompletionRequest.build_chat_params``): ``documents``, ``reasoning_effort`` and the
    ``enable_thinking`` it implies, unless ``chat_template_kwargs`` names that. A worker's
    ``/tokenize`` request has none of these fields (requests.worker_render_payload)."""
    given = body.get("chat_template_kwargs")
    kwargs = {"documents": body["documents"]} if isinstance(body.get("documents"), list) else {}
    effort = body.get("reasoning_effort")
    if effort not in UNSET:
        kwargs["reasoning_effort"] = effort
        if not (isinstance(given, dict) and "enable_thinking" in given):
            kwargs["enable_thinking"] = effort != "none"
    return kwargs


def reasoning_renamed(messages: list) -> list:
    """``messages`` as vLLM's chat request reads them (``_normalize_messages_before``): a
    message's older ``reasoning_content`` renamed ``reasoning`` where that is unset (dropped
    otherwise). Copies the messages it changes: the client's body is left as it came."""
    return [_reasoning_renamed(m) if isinstance(m, dict) and "reasoning_content" in m else m for m in messages]


def _reasoning_renamed(message: dict) -> dict:
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if message["reasoning_content"] is not None and out.get("reasoning") is None:
        out["reasoning"] = message["reasoning_content"]
    return out


def worker_renders(body: dict) -> bool:
    """Whether a chat holds what this module does not render as vLLM does: a part that is not
    text (media, a tool reference, an unknown type, one with a ``uuid``), content of another
    shape, or a template of its own in ``chat_template_kwargs`` (vLLM renders with it). Such a
    chat is rendered by a worker (``/tokenize``)."""
    given = body.get("chat_template_kwargs")
    if isinstance(given, dict) and given.get("chat_template") is not None:
        return True
    for m in body["messages"]:
        content = m.get("content") if isinstance(m, dict) else None
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return True
        for part in content:
            if isinstance(part, str):
                continue
            kind = _text_kind(part)
            if kind is None or not isinstance(part.get(TEXT_PARTS[kind]), (str, type(None))):
                return True
    return False


def _text_kind(part: Any) -> str | None:
    """A part's type if vLLM reads it as text (a dict of a text type, without a ``uuid``), else
    None. (A type that is no string, a list or an object, is no text part: vLLM refuses it.)"""
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if isinstance(kind, str) and kind in TEXT_PARTS and part.get("uuid") is None else None


def conversation(messages: list, content_format: ContentFormat, template: str) -> list[dict]:
    """``messages`` as vLLM gives them to ``template``. Parts :func:`worker_renders` names are
    left out (the router renders such a chat only when no worker could: its text still keys the
    session's turns alike)."""
    conv = [_message(m, content_format) for m in reasoning_renamed(messages)]
    for m in conv:
        _parse_tool_calls(m)
    if any(m["role"] == "developer" for m in conv) and not ('"developer"' in template or "'developer'" in template):
        conv = _consolidated_system([_developer_as_system(m) for m in conv])
    return conv


def _message(msg: dict, content_format: ContentFormat) -> dict:
    """One message as ``_parse_chat_message_content`` makes it: only the fields it copies, in its order."""
    role = msg["role"]
    content = msg.get("content")
    parts = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        parts = []
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [t for t in (_text_part(p, content_format) for p in parts) if t is not None]
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts) if content_format == "string" else texts}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = msg["tool_calls"]
        if msg.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = msg["reasoning"]
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        # tool results arrive as text parts (Claude Code, Cursor); most templates take a string
        if isinstance(out["content"], list) and all(p.get("type") == "text" for p in out["content"]):
            out["content"] = "\n".join(p.get("text", "") for p in out["content"])
    for name in ("name", "task"):
        if isinstance(msg.get(name), str):
            out[name] = msg[name]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def _text_part(part: Any, content_format: ContentFormat) -> Any:
    """A part's text ("string" format) or text part ("openai" format), or None: skipped."""
    if isinstance(part, str):
        text, extras = part, {}
    elif (kind := _text_kind(part)) is not None:
        text = part.get(TEXT_PARTS[kind])
        if text is None and kind in SKIP_NONE:
            return None
        extras = {k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}
    else:
        return None   # (not text: :func:`worker_renders` sends such a chat to a worker)
    if content_format == "string":
        return text or None   # (vLLM drops an empty text from the join)
    return {"type": "text", "text": text, **extras}


def _without_billing_header(parts: list) -> list:
    """System text less Claude Code's attribution line (chat_utils._strip_claude_code_billing_header)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_calls(message: dict) -> None:
    """An assistant's tool calls as templates expect them (chat_utils._postprocess_messages):
    JSON-string ``arguments`` parsed to a dict, ``{}`` when empty, invalid or not an object; an
    empty list dropped. Copies what it changes: the client's body is left as it came."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):   # (vLLM refuses the request: the worker answers it)
            parsed_calls.append(call)
            continue
        args = function.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                args = None
        function = {**function, "arguments": args if isinstance(args, dict) else {}}
        parsed_calls.append(_schema_order({**call, "function": _schema_order(function, FUNCTION_FIELDS)},
                                          TOOL_CALL_FIELDS))
    message["tool_calls"] = parsed_calls


def _schema_order(d: dict, fields: tuple[str, ...]) -> dict:
    """``d`` with the schema's fields first, in its order, then the others as they came: what the
    request model's validation (pydantic, of OpenAI's TypedDicts) hands vLLM, and a template that
    prints a tool call whole (``| tojson``) prints that order."""
    return {**{k: d[k] for k in fields if k in d}, **{k: v for k, v in d.items() if k not in fields}}


def _developer_as_system(message: dict) -> dict:
    if message["role"] != "developer":
        return message
    out = {**message, "role": "system"}
    out.pop("tools", None)
    return out


def _consolidated_system(conv: list[dict]) -> list[dict]:
    """All system messages merged into one at the front, when there are several or one not first
    (hf._consolidate_system_messages: templates such as Qwen 3.6 take a system message first only)."""
    contents, others, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(contents)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            contents.append(content)
    return [{"role": "system", "content": "\n\n".join(contents)}, *others] if merge else conv


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """How vLLM gives this template message content (hf._detect_content_format, the worker's
    ``--chat-template-content-format auto``): "openai" (a list of parts) when the template loops
    over a message's content, else "string" (text parts joined)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:   # (vLLM's default for a template it cannot parse)
        return "string"
    try:
        return "openai" if any(True for _ in _content_loops(ast)) else "string"
    except Exception:
        return "string"


def _is_access(node: Any, var: str, key: str | None = None) -> bool:
    """``var`` (or ``var[key]`` / ``var.key``), through filters, tests and slices (hf._is_var_or_elems_access)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_access(node.node, var, key)
    if isinstance(node, nodes.Test) or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        return _is_access(node.node, var, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var
    # (``var`` itself here, not through filters: hf._is_attr_access)
    named = isinstance(getattr(node, "node", None), nodes.Name) and node.node.ctx == "load" and node.node.name == var
    if isinstance(node, nodes.Getitem):
        return named and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and named and node.attr == key


def _content_loops(root: Any):
    """The template's loops over a message's content (hf._iter_nodes_assign_content_item)."""
    from jinja2 import nodes

    names, queue = ["messages"], ["messages"]   # ``messages`` and the variables assigned from it
    while queue:
        name = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _is_access(assign.node, name):
                target = _name(assign.target)
                names.append(target)
                if target not in names[:-1]:   # (vLLM skips self-assignment only; a cycle looped)
                    queue.append(target)
    message_vars = [_name(loop.target) for loop in root.find_all(nodes.For)
                    if any(_is_access(loop.iter, n) for n in names)]
    # macro parameters given a message's content, and the loops inside macros
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = {a.name for a in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_access(arg, v, "content") for v in message_vars):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in params and any(_is_access(kw.value, v, "content") for v in message_vars):
                    content_params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if content_params:
                macro_params[id(loop)] = content_params
    for loop in root.find_all(nodes.For):
        if any(_is_access(loop.iter, v, "content") for v in message_vars) or (
                isinstance(loop.iter, nodes.Name) and (
                    loop.iter.name in macro_params.get(id(loop), ())
                    or (id(loop) not in in_macros and loop.iter.name == "content"))):
            yield _name(loop.target)


def _name(target: Any) -> str:
    """An assignment's or loop's single target; vLLM asserts one (``for a, b in messages``:
    its detection fails, and the format is "string"), so this raises likewise."""
    from jinja2 import nodes

    if not isinstance(target, nodes.Name):
        raise ValueError("not a single variable")
    return target.name
