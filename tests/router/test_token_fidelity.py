"""The router keys the token ids a vLLM worker runs: for each request shape, the router's own
prompt (``Router._chat_prompt`` / ``_completion_prompt`` over a real ``PromptTokenizer``) is
compared with vLLM's rendering of the same request, in-process (``_vllm_ref.vllm_ids``: vLLM's
OnlineRenderer; those tests are skipped where vLLM is not installed, and ``make test`` installs
it). A chat the router has a worker render is rendered by vLLM's own ``/tokenize`` code
(``_vllm_ref.vllm_tokenize``); test_worker_render.py sends such chats through a real router.
Tokenizers are local: the test Llama's BPE with hand-written templates of real families'
shapes (Llama 3, Qwen 2.5 and 3, Mistral v3, Gemma, a gpt-oss-like system header, Command-R)."""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache

import pytest

pytest.importorskip("transformers")

from tests.router._vllm_ref import (AGENT, DEVELOPER_AWARE, DOCUMENTS, GEMMA, LLAMA3, MISTRAL_V3,  # noqa: E402
                                    OPENAI_ONLY, QWEN25, SYSTEM_EFFORT, THINKING, TOOL_CALL_JSON, make_model,
                                    vllm_ids, vllm_tokenize)

TEMPLATES = {"llama3": (LLAMA3, True), "qwen": (QWEN25, False), "mistral": (MISTRAL_V3, True),
             "gemma": (GEMMA, True), "effort": (SYSTEM_EFFORT, True), "openai": (OPENAI_ONLY, True),
             "developer": (DEVELOPER_AWARE, True), "tool_json": (TOOL_CALL_JSON, False), "thinking": (THINKING, False),
             "documents": (DOCUMENTS, True), "agent": (AGENT, False)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {name: make_model(root, name, template, bos=bos) for name, (template, bos) in TEMPLATES.items()}
    out["llama3_eos"] = make_model(root, "llama3_eos", LLAMA3, bos=True, eos=True)   # a special token after too
    return out


@lru_cache(maxsize=None)
def _router(path: str):
    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from kvtier.router.requests import PromptTokenizer

    config = RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9")], block_tokens=16, kv_bytes_per_token=4096)
    return Router(config, PromptTokenizer(path))


def worker_rendered(body: dict) -> bool:
    """Whether the router has a worker render this chat (Router.chat's test)."""
    from kvtier.router.chat_messages import worker_renders
    from kvtier.router.requests import WORKER_RENDERED

    return any(body.get(f) for f in WORKER_RENDERED) or worker_renders(body)


def router_ids(path: str, kind: str, body: dict, worker: bool = True) -> list[int]:
    """The ids ``kvtier route`` keys for ``body`` (short prompts: routed whole). A chat the router
    has a worker render is sent to vLLM's own ``/tokenize`` code as Router.chat sends it
    (requests.worker_render_payload) and its answer truncated as Router.chat truncates it
    (requests.truncated_chat); ``worker`` False: no worker answers, the router renders it."""
    router = _router(path)
    body = json.loads(json.dumps(body))
    if kind == "chat" and worker and worker_rendered(body):
        from kvtier.router.requests import truncated_chat, worker_render_payload

        status, answer = asyncio.run(vllm_tokenize(path, worker_render_payload(body)))
        assert status == 200, answer
        routed = router._routed(truncated_chat(answer["tokens"], body, router.tokenizer))
    elif kind == "chat":
        routed = asyncio.run(router._chat_prompt(body, len(json.dumps(body))))
    else:
        routed = asyncio.run(router._completion_prompt(body))
    assert routed.tokens == len(routed.ids)
    return routed.ids


def assert_keyed_as_vllm(path: str, kind: str, body: dict, worker: bool = True) -> None:
    from kvtier.router.requests import RequestError

    expected = vllm_ids(path, kind, body)
    try:
        got = router_ids(path, kind, body, worker)
    except RequestError as exc:
        pytest.fail(f"the router refused a request vLLM renders: {exc.status} {exc}")
    assert got == expected


PARTS = [{"type": "text", "text": "Summarise this:"}, {"type": "text", "text": "the quick brown fox"}]


# --- D1: content as a list of text parts -------------------------------------------------------

def test_content_parts_are_keyed_as_vllm_joins_them(models):
    """OpenAI's ``content: [{"type": "text", ...}]``: vLLM ("string" content format, as Llama 3's
    template is) joins the texts with "\\n"; handed the list, the template printed its repr."""
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": PARTS}]}
    assert_keyed_as_vllm(models["llama3"], "chat", body)


def test_content_parts_with_a_concatenating_template_are_not_refused(models):
    """Mistral-v3-style ``'[INST] ' + message['content']`` raised on a list: a 400 for a valid request."""
    assert_keyed_as_vllm(models["mistral"], "chat", {"messages": [{"role": "user", "content": PARTS}]})


@pytest.mark.parametrize("name", ["gemma", "openai"])
def test_openai_format_templates_get_parts(models, name):
    """A template that loops over a message's content gets parts, strings wrapped as one
    (empty ones kept, a text part's other fields beside), null content as no parts."""
    body = {"messages": [{"role": "system", "content": "sys"},
                         {"role": "user", "content": [*PARTS, {"type": "text", "text": "", "cache_control": {"t": 1}}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]}
    assert_keyed_as_vllm(models[name], "chat", body)


def test_text_like_parts_and_skipped_empties(models):
    """Every text-like part type vLLM reads (refusal, input_text, thinking, a bare string), an
    empty text left out of the join, a null text skipped."""
    body = {"messages": [{"role": "user", "content": [
        "plain", {"type": "input_text", "text": "in"}, {"type": "text", "text": ""}, {"type": "text", "text": None},
        {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hmm"}]}]}
    assert_keyed_as_vllm(models["qwen"], "chat", body)


def test_claude_code_billing_header_is_dropped_from_system_text(models):
    """vLLM drops Claude Code's per-request attribution line from system text (a cache breaker)."""
    body = {"messages": [{"role": "system", "content": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=123\nYou are Claude Code."}]},
        {"role": "user", "content": "hi"}]}
    assert_keyed_as_vllm(models["llama3"], "chat", body)


# --- D2: tool-call arguments -------------------------------------------------------------------

TOOL_HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}, "id": "c1"},
        {"id": "c2", "type": "function", "function": {"arguments": "not json", "name": "f"}},
        {"id": "c3", "type": "function", "function": {"arguments": "[1, 2]", "name": "g"}},
        {"id": "c4", "type": "function", "function": {"arguments": "", "name": "h"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "ok", "tool_calls": []},
    {"role": "user", "content": "thanks, and tomorrow?"}]


@pytest.mark.parametrize("name", ["qwen", "tool_json"])
def test_tool_call_arguments_are_keyed_as_a_dict(models, name):
    """An agent's history carries ``arguments`` as JSON strings: vLLM parses them to dicts
    (``{}`` when invalid, not an object or empty) and drops an empty ``tool_calls``, so
    ``arguments | tojson`` prints an object; a template printing a call whole prints its fields
    in the request model's order."""
    assert_keyed_as_vllm(models[name], "chat", {"messages": TOOL_HISTORY})


# --- D3, D4: null content, tool results as parts -----------------------------------------------

def test_null_content_is_keyed_as_empty(models):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "again"}]}
    assert_keyed_as_vllm(models["qwen"], "chat", body)


@pytest.mark.parametrize("name", ["qwen", "openai"])
def test_tool_message_parts_are_joined(models, name):
    """A tool result as text parts (Claude Code, Cursor): joined with "\\n", for either format."""
    body = {"messages": [{"role": "user", "content": "run it"}, {"role": "assistant", "content": "ok"},
                         {"role": "tool", "tool_call_id": "c1",
                          "content": [{"type": "text", "text": "out1"}, {"type": "text", "text": "out2"}]}]}
    assert_keyed_as_vllm(models[name], "chat", body)


# --- D5: developer role ------------------------------------------------------------------------

def test_developer_role_is_rendered_as_system(models):
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert_keyed_as_vllm(models["llama3"], "chat", body)


def test_developer_turns_are_merged_into_the_first_system_message(models):
    """A developer turn after a system one: converted, then all system text merged at the front."""
    body = {"messages": [{"role": "system", "content": "one"}, {"role": "user", "content": "hi"},
                         {"role": "developer", "content": [{"type": "text", "text": "two"}]},
                         {"role": "user", "content": "again"}]}
    assert_keyed_as_vllm(models["llama3"], "chat", body)


def test_a_template_that_names_developer_keeps_it(models):
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert_keyed_as_vllm(models["developer"], "chat", body)


# --- D6, D7: template arguments ----------------------------------------------------------------

@pytest.mark.parametrize("extra", [{"reasoning_effort": "high"}, {"reasoning_effort": "none"},
                                   {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "x"}}])
def test_reasoning_effort_reaches_the_template(models, extra):
    """gpt-oss / Gemma-4 style: the effort printed in the system header, the request's field over
    ``chat_template_kwargs``."""
    assert_keyed_as_vllm(models["effort"], "chat", {"messages": [{"role": "user", "content": "hi"}], **extra})


@pytest.mark.parametrize("extra", [{"reasoning_effort": "none"}, {"reasoning_effort": "high"},
                                   {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}])
def test_reasoning_effort_sets_enable_thinking(models, extra):
    """Qwen3 style: ``enable_thinking`` follows the effort unless the request's kwargs name it."""
    assert_keyed_as_vllm(models["thinking"], "chat", {"messages": [{"role": "user", "content": "hi"}], **extra})


def test_generation_prompt_in_chat_template_kwargs_is_not_refused(models):
    """``chat_template_kwargs`` naming ``add_generation_prompt``: the request's own field wins
    (vLLM's merge_kwargs); passed twice to apply_chat_template it was a TypeError, a 400."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False, "tokenize": False}}
    assert_keyed_as_vllm(models["qwen"], "chat", body)


@pytest.mark.parametrize("flags", [{"add_generation_prompt": "false"}, {"add_generation_prompt": 0},
                                   {"add_generation_prompt": False, "continue_final_message": "true"}])
def test_chat_booleans_read_as_vllm_reads_them(models, flags):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}], **flags}
    assert_keyed_as_vllm(models["qwen"], "chat", body)


# --- D8, D9: completions -----------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"truncation_side": "left"}, {"truncation_side": "right"},
                                   {"add_special_tokens": False}])
def test_truncated_text_completion_keeps_the_bos(models, extra):
    """``truncate_prompt_tokens`` N on a text: vLLM's tokenizer truncates on the left before it
    adds the BOS: ``[BOS] + the last N-1``. (An explicit side slices the whole encoding.)"""
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 8, "truncate_prompt_tokens": 40, **extra}
    assert_keyed_as_vllm(models["llama3"], "cmpl", body)


@pytest.mark.parametrize("value", ["false", 0, "no", "off", "true", 1])
def test_add_special_tokens_read_as_vllm_reads_it(models, value):
    assert_keyed_as_vllm(models["llama3"], "cmpl", {"prompt": "hello world", "add_special_tokens": value})


# --- s29 D1-D6: chats a worker renders, and the router's own rendering of them ----------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
AGENT_TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Check the tool."},
               {"role": "user", "content": "and tomorrow?"}]
WHERE = pytest.mark.parametrize("worker", [True, False], ids=["worker-renders", "router-renders"])


@WHERE
@pytest.mark.parametrize("name, extra", [
    ("effort", {"tools": TOOLS, "reasoning_effort": "none"}),
    ("agent", {"tools": TOOLS, "reasoning_effort": "none"}),
    ("agent", {"tools": TOOLS, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}),
    ("agent", {"tools": TOOLS, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": None}}),
    ("documents", {"documents": [{"title": "Paris", "text": "Sunny all week, 21C."}]}),
    ("documents", {"documents": [{"title": "Paris", "text": "Sunny."}], "tools": TOOLS,
                   "chat_template_kwargs": {"documents": [{"title": "Lyon", "text": "Rain."}]}})],
    ids=["effort-header", "effort-thinking", "kwargs-thinking", "kwargs-null-thinking", "documents",
         "documents-over-kwargs"])
def test_a_worker_rendered_chat_is_keyed_as_the_chat_runs(models, name, extra, worker):
    """An agent's chat (tools, a reasoning effort, its thinking turns) or a RAG chat (documents)
    is rendered by a worker's /tokenize, whose request (vLLM's TokenizeChatRequest) has no
    ``documents`` or ``reasoning_effort`` and never renames ``reasoning_content``: sent as it
    came, the worker rendered the chat without them (a system header's effort: block 0 keyed
    wrong; documents: every block). Its own fields folded into its template arguments as the
    chat request folds them, the worker renders the prompt the chat runs; so does the router
    when no worker answers."""
    assert_keyed_as_vllm(models[name], "chat", {"messages": AGENT_TURNS, **extra}, worker=worker)


@WHERE
@pytest.mark.parametrize("assistant", [{"reasoning_content": "Check the tool."},
                                       {"reasoning": "Look it up.", "reasoning_content": "Check the tool."},
                                       {"reasoning": None, "reasoning_content": "Check the tool."}])
def test_an_agents_thinking_turns_are_keyed_as_the_chat_runs(models, assistant, worker):
    """The assistant's ``reasoning_content`` (the field vLLM's reasoning parsers answer with) is
    what the chat's template prints; ``reasoning`` wins where both are set."""
    turns = [*AGENT_TURNS[:2], {"role": "assistant", "content": "It is sunny.", **assistant}, AGENT_TURNS[3]]
    assert_keyed_as_vllm(models["agent"], "chat", {"messages": turns, "tools": TOOLS}, worker=worker)


@WHERE
@pytest.mark.parametrize("name", ["llama3", "llama3_eos"])
@pytest.mark.parametrize("extra", [{}, {"truncate_prompt_tokens": 1}, {"truncate_prompt_tokens": 2},
                                   {"truncation_side": "left"}, {"truncation_side": "right"},
                                   {"add_special_tokens": "false"}, {"truncate_prompt_tokens": 2000}])
def test_a_truncated_chat_keeps_the_special_tokens_it_adds(models, name, extra, worker):
    """``add_special_tokens`` with ``truncate_prompt_tokens`` N and no side: vLLM's tokenizer
    truncates the rendering before it adds its special tokens, so a BOS (and an EOS after, for
    some models) stays: ``[BOS] + the last N-1``. The router cut the last N of ``[BOS, ...]``:
    every block keyed wrong. (An explicit side slices the whole encoding, as before.)"""
    body = {"messages": AGENT_TURNS * 3, "add_special_tokens": True, "truncate_prompt_tokens": 40, **extra}
    assert_keyed_as_vllm(models[name], "chat", body, worker=worker)


@pytest.mark.parametrize("name, extra", [
    ("thinking", {"chat_template_kwargs": {"enable_thinking": None}}),
    ("effort", {"chat_template_kwargs": {"reasoning_effort": "auto"}}),
    ("effort", {"chat_template_kwargs": {"reasoning_effort": None}}),
    ("thinking", {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": None}})])
def test_unset_template_arguments_are_left_unset(models, name, extra):
    """vLLM drops ``chat_template_kwargs`` values null and "auto" (merge_kwargs): the template
    sees the variable undefined, its own default. The router passed them on."""
    assert_keyed_as_vllm(models[name], "chat", {"messages": [{"role": "user", "content": "hi"}], **extra})


@WHERE
@pytest.mark.parametrize("value", [True, "true", 1, "on"])
def test_a_chat_asking_for_special_tokens_is_keyed_with_them(models, value, worker):
    """``add_special_tokens`` on a chat: a BOS before the template's own. The router's own
    rendering (no worker answers) left it out: every block keyed wrong."""
    body = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": value}
    assert_keyed_as_vllm(models["llama3"], "chat", body, worker=worker)


def test_the_worker_render_payload_carries_what_tokenize_lacks():
    """What a worker's /tokenize is sent: the fields it takes as they are, the chat request's
    own template arguments in its ``chat_template_kwargs`` (theirs win, as vLLM merges them),
    ``reasoning_content`` renamed; the client's body is left as it came."""
    import copy

    from kvtier.router.requests import worker_render_payload

    body = {"model": "tiny", "messages": AGENT_TURNS, "tools": TOOLS, "documents": [{"title": "t", "text": "x"}],
            "reasoning_effort": "low", "chat_template_kwargs": {"documents": [], "custom": 1},
            "add_special_tokens": True, "stream": True, "max_tokens": 5}
    sent = copy.deepcopy(body)
    payload = worker_render_payload(body)
    assert body == sent
    assert payload == {
        "model": "tiny", "tools": TOOLS, "add_special_tokens": True,
        "messages": [*AGENT_TURNS[:2], {"role": "assistant", "content": "It is sunny.", "reasoning": "Check the tool."},
                     AGENT_TURNS[3]],
        "chat_template_kwargs": {"documents": body["documents"], "custom": 1, "reasoning_effort": "low",
                                 "enable_thinking": True}}
    plain = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert worker_render_payload(plain) == plain   # nothing to fold: sent as it came


def test_a_part_whose_type_is_no_string_is_left_to_the_worker():
    """A content part whose ``type`` is a list or an object (vLLM refuses it: a 400) raised
    TypeError in the router (a 500 with a traceback)."""
    from kvtier.router.chat_messages import conversation, worker_renders

    for kind in (["text"], {"t": 1}, 3, None):
        messages = [{"role": "user", "content": [{"type": kind, "text": "a"}, {"type": "text", "text": "b"}]}]
        assert worker_renders({"messages": messages}), kind
        # (rendered by the router only when no worker could: the part left out, as media parts are)
        assert conversation(messages, "string", "")[0]["content"] == "b"
        assert conversation(messages, "openai", "")[0]["content"] == [{"type": "text", "text": "b"}]


@pytest.mark.parametrize("n", [2 ** 63, 2 ** 64, 10 ** 30, -2])
def test_truncate_prompt_tokens_out_of_vllms_range_is_refused(models, n):
    """vLLM takes -1 <= ``truncate_prompt_tokens`` <= 2**63-1 and refuses the rest (a 400); past
    2**64 the router's tokenizer raised OverflowError (a 500)."""
    from kvtier.router.requests import RequestError, check_body

    for field, body in (("prompt", {"prompt": "a b"}), ("messages", {"messages": [{"role": "user", "content": "a"}]})):
        with pytest.raises(RequestError) as refused:
            check_body({**body, "truncate_prompt_tokens": n}, field)
        assert refused.value.status == 400 and refused.value.param == "truncate_prompt_tokens"
        with pytest.raises(ValueError):   # vLLM's validation error
            vllm_ids(models["llama3"], "cmpl" if field == "prompt" else "chat", {**body, "truncate_prompt_tokens": n})
    for n in (-1, 0, 40, 2 ** 63 - 1):   # (taken; vLLM refuses one past its model's length later)
        check_body({"prompt": "a b", "truncate_prompt_tokens": n}, "prompt")


# --- the parts of the mirror that need no vLLM -------------------------------------------------

def test_lax_booleans_are_pydantics():
    """vLLM's request models are pydantic's: its lax reading of a boolean, value by value."""
    from kvtier.router.chat_messages import lax_bool

    table = {"false": False, "FALSE": False, "No": False, "off": False, "0": False, "f": False, "n": False,
             0: False, 0.0: False, "true": True, "Yes": True, "on": True, "1": True, "t": True, "y": True,
             1: True, 1.0: True}
    for value, expected in table.items():
        assert lax_bool(value, not expected) is expected, value
    for refused in ("", " false", "2", 2, 0.5, None, [], {}):   # (the worker refuses these: the default)
        assert lax_bool(refused, True) is True and lax_bool(refused, False) is False, refused
    pydantic = pytest.importorskip("pydantic")
    adapter = pydantic.TypeAdapter(bool)
    for value, expected in table.items():
        assert adapter.validate_python(value) is expected


def test_content_format_is_detected_as_vllm_detects_it():
    """"openai" when the template loops over a message's content (directly, through a variable
    assigned from ``messages``, a macro's parameter, a filter), else "string"."""
    from kvtier.router.chat_messages import content_format

    assert content_format(LLAMA3) == content_format(QWEN25) == content_format(MISTRAL_V3) == "string"
    assert content_format(GEMMA) == content_format(OPENAI_ONLY) == "openai"
    assert content_format("{% set msgs = messages %}{% for m in msgs %}{% for c in m.content | list %}"
                          "{{ c.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% macro render(x) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}"
                          "{% for m in messages %}{{ render(m['content']) }}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}{% for x in tools %}{% endfor %}") \
        == "string"
    assert content_format("{% for a, b in messages %}{% endfor %}") == "string"   # (vLLM's assertion fails)
    assert content_format("{% if %}") == "string"                                 # (unparsable)


def test_chats_the_router_cannot_mirror_go_to_a_worker():
    """Media, tool references and unknown parts: a worker's /tokenize renders them (vLLM inserts
    placeholders and processes the media); text parts, strings and null content the router does."""
    from kvtier.router.chat_messages import worker_renders

    def chat(content):
        return {"messages": [{"role": "user", "content": content}]}

    assert not worker_renders(chat("hi")) and not worker_renders(chat(None)) and not worker_renders(chat(PARTS))
    assert not worker_renders(chat(["a", {"type": "refusal", "refusal": "no"}]))
    for part in ({"type": "image_url", "image_url": {"url": "data:"}}, {"type": "input_audio"},
                 {"type": "tool_reference", "name": "t"}, {"type": "text", "text": "a", "uuid": "u"},
                 {"type": "mystery"}, {"image_url": "x"}, {"type": "text", "text": 3}):
        assert worker_renders(chat([part])), part
    assert worker_renders(chat({"type": "text"}))
    assert worker_renders({**chat("hi"), "chat_template_kwargs": {"chat_template": "{{ messages }}"}})


def test_a_media_chat_is_rendered_by_a_worker_and_never_refused(models):
    """When no worker can render a media chat, the router renders its text alone (the media parts
    left out) rather than refuse it: even a concatenating template takes it."""
    from kvtier.router.requests import PromptTokenizer

    tok = PromptTokenizer(models["mistral"])
    media = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}, *PARTS]}]}
    assert tok.chat(media["messages"], media) == tok.chat([{"role": "user", "content": PARTS}], {})


# --- D10: prompt null beside prompt embeddings ---------------------------------------------------

def test_completion_with_null_prompt_and_prompt_embeds_is_routed():
    """vLLM's own example, ``completions.create(prompt=None, extra_body={"prompt_embeds": ...})``,
    sends ``"prompt": null``: routed on load; a null prompt without embeddings is still refused."""
    from tests.router.test_http import one_worker_router, run

    async def main():
        async with one_worker_router(policy="tier-aware") as (w, _, url, s):
            async with s.post(url + "/v1/completions",
                              json={"model": "tiny", "prompt": None, "prompt_embeds": "AAAA"}) as r:
                assert r.status == 200, (r.status, await r.text())
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": None}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
            assert w.requests == 1
    run(main())


def test_a_media_chat_is_sent_to_a_workers_tokenize():
    """Through the router's front door: a chat with an image part is keyed as a worker's
    /tokenize renders it; a text chat is rendered by the router."""
    from tests.router.test_http import BS, one_worker_router, run

    async def main():
        async with one_worker_router(policy="tier-aware") as (w, router, url, s):
            rendered = [7] * 40                                   # ten blocks, as the worker renders
            router.index.stored(0, list(range(10)), None, rendered, BS, "GPU")
            w.rendered = rendered
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            body = {"model": "tiny", "messages": [{"role": "user", "content": [image, *PARTS]}]}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and int(r.headers["X-Kvtier-Predicted-Cached"]) == 39
            assert len(w.tokenized) == 1
            body["messages"][0]["content"] = "find it"            # control: text (the stand-in tokenizer's)
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["X-Kvtier-Predicted-Cached"] == "0"
            assert len(w.tokenized) == 1
    run(main())


# --- s29 a10 D2: truncate_prompt_tokens read as pydantic's lax int ---------------------------------

LAX_TRUNCATIONS = ["5", " 5 ", "5.00", 5.0, True]


@pytest.mark.parametrize("value", LAX_TRUNCATIONS)
def test_a_lax_truncate_prompt_tokens_truncates_a_completion_as_vllm_does(models, value):
    """vLLM's request model reads ``"5"``, ``5.0`` and ``true`` as 5 (1) and runs the last tokens;
    the router read only a JSON int: the whole prompt (87 tokens) keyed, its cut head predicted as hits."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog " * 4, "truncate_prompt_tokens": value}
    assert_keyed_as_vllm(models["llama3"], "cmpl", body)


@WHERE
@pytest.mark.parametrize("extra", [{}, {"add_special_tokens": True}, {"truncation_side": "right"}])
@pytest.mark.parametrize("value", ["20", 20.0])
def test_a_lax_truncate_prompt_tokens_truncates_a_chat_as_vllm_does(models, value, extra, worker):
    body = {"messages": AGENT_TURNS * 3, "truncate_prompt_tokens": value, **extra}
    assert_keyed_as_vllm(models["llama3"], "chat", body, worker=worker)


@pytest.mark.parametrize("n", [str(2 ** 63), "-2", -2.0])
def test_a_lax_truncate_prompt_tokens_out_of_vllms_range_is_refused(models, n):
    """As vLLM reads it, out of -1..2**63-1: refused with a 400, as vLLM refuses it. Old code let it through."""
    from kvtier.router.requests import RequestError, check_body

    with pytest.raises(RequestError) as refused:
        check_body({"prompt": "a b", "truncate_prompt_tokens": n}, "prompt")
    assert refused.value.status == 400 and refused.value.param == "truncate_prompt_tokens"
    with pytest.raises(ValueError):   # vLLM's validation error
        vllm_ids(models["llama3"], "cmpl", {"prompt": "a b", "truncate_prompt_tokens": n})


def test_lax_integers_are_pydantics():
    """vLLM's request models are pydantic's: its lax reading of an integer, value by value; None
    where pydantic refuses (the worker refuses the request: it stays as the router read it before)."""
    from kvtier.router.index import lax_int

    table = {"5": 5, " 5 ": 5, "\t5\n": 5, "+5": 5, "-1": -1, "-0": 0, "00012": 12, "1_000": 1000, "5.0": 5,
             "5.00": 5, "-5.0": -5, "1_000.0": 1000, "9" * 30: int("9" * 30), True: 1, False: 0, 5: 5, 5.0: 5,
             -0.0: 0, 1e18: 10 ** 18}
    refused = ["5.", ".0", "5.5", "1e3", "0x10", "", " ", "1__0", "_1", "1_", "+-1", "- 5", "5.0_0", "5.0.0",
               "٥", 5.5, 1e20, 2.0 ** 63, float("inf"), float("nan"), None, [5], {}]
    for value, expected in table.items():
        assert lax_int(value) == expected and type(lax_int(value)) is int, value
    for value in refused:
        assert lax_int(value) is None, value
    pydantic = pytest.importorskip("pydantic")
    adapter = pydantic.TypeAdapter(int)
    for value, expected in table.items():
        assert adapter.validate_python(value) == expected, value
    for value in refused:
        with pytest.raises(pydantic.ValidationError):
            adapter.validate_python(value)
