"""A stream the router ends early (its worker died or went silent, or the router shuts down)
ends with an error event its client reads as one (audit s34 a4): never glued to a partial event
the worker left (D3), and in the Anthropic form on ``/v1/messages`` (D6). Real ``Router`` app over
real sockets; the workers are a few lines of aiohttp, as test_http.py's."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from aiohttp import ClientSession, ClientTimeout, web

from tests.router.test_http import free_port, run, start_router

FIRST = b'data: {"id":"c","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"0"}]}\n\n'
HALF = b'data: {"id":"c","object":"text_completion","choices":[{"te'   # (its worker dies here)


class Worker:
    """Streams ``pieces`` (bytes written as they are, ``gap_s`` apart), then ``end``: "die" (its
    connection dropped), "stall" (no further byte, up to 30 s) or "done" (the stream ended)."""

    def __init__(self, pieces: list[bytes], end: str = "die", gap_s: float = 0.05) -> None:
        self.pieces, self.end, self.gap_s = pieces, end, gap_s
        self.port, self.runner = free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        for path in ("/v1/completions", "/v1/messages"):
            app.router.add_post(path, self.stream)
        app.router.add_get("/health", lambda r: web.Response())
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stream(self, request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in self.pieces:
            await resp.write(piece)
            await asyncio.sleep(self.gap_s)
        if self.end == "die":
            request.transport.close()
        elif self.end == "stall":   # until the router closes the request (aiohttp cancels no handler)
            for _ in range(600):
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.05)
        return resp

    async def stop(self) -> None:
        await self.runner.cleanup()


async def _serving(worker: Worker, **kw):
    await worker.start()
    return await start_router([worker], **kw)


async def _raw(url: str, path: str = "/v1/completions", body: dict | None = None) -> bytes:
    async with ClientSession() as s:
        async with s.post(url + path, json=body or {"prompt": "a b", "stream": True},
                          timeout=ClientTimeout(total=20)) as r:
            assert r.status == 200
            return await r.read()


def _events(raw: bytes) -> list[str]:
    """Each event's data, as an SSE parser joins its ``data:`` lines."""
    events = [e for e in raw.decode().replace("\r\n", "\n").split("\n\n") if e.strip()]
    return ["\n".join(line[len("data:"):].lstrip() for line in e.split("\n") if line.startswith("data:"))
            for e in events]


def _openai_error_end(raw: bytes) -> dict:
    """The stream's events all parse, and it ends with an OpenAI error event and ``[DONE]``: that
    error event's error."""
    events = _events(raw)
    assert events[-1] == "[DONE]", raw[-300:]
    parsed = [json.loads(e) for e in events[:-1]]   # (a glued event is no JSON: raises here)
    return parsed[-1]["error"]


def test_a_worker_that_dies_mid_event_leaves_no_partial_event_before_the_error_event():
    """Before: ``data: {"id":"c","object":"text_compdata: {"error": ...}`` reached the client, one
    event that is no JSON, so no clean error event at all."""
    async def main():
        w = Worker([FIRST, HALF])
        router, runner, url = await _serving(w)
        try:
            raw = await _raw(url)
            assert raw.startswith(FIRST) and HALF not in raw, raw
            error = _openai_error_end(raw)
            assert error["type"] == "service_unavailable_error" and w.url in error["message"], error
            assert len(_events(raw)) == 3, raw                  # the whole event, the error, [DONE]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_the_openai_sdk_raises_its_api_error_for_a_worker_that_died_mid_event():
    """Before: ``JSONDecodeError`` from the glued event, not the SDK's ``APIError``."""
    async def main():
        w = Worker([FIRST, HALF])
        router, runner, url = await _serving(w)
        try:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            texts = []
            with pytest.raises(openai.APIError, match="after the answer had started"):
                async for chunk in await client.completions.create(model="tiny", prompt="a b", stream=True):
                    texts.append(chunk.choices[0].text)
            assert texts == ["0"]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_shutdown_that_cuts_a_stream_mid_event_leaves_no_partial_event_before_its_error_event():
    """The drain's deadline ends a stream whose worker has sent half an event and is quiet."""
    async def main():
        w = Worker([FIRST, HALF], end="stall")
        router, runner, url = await _serving(w, drain_timeout_s=0.3)
        try:
            answer = asyncio.ensure_future(_raw(url))
            await asyncio.sleep(0.5)
            await runner.cleanup()
            raw = await answer
            assert raw.startswith(FIRST) and HALF not in raw, raw
            assert "shutting down" in _openai_error_end(raw)["message"]
        finally:
            await w.stop()
    run(main())


def test_an_event_too_long_to_hold_is_relayed_as_it_comes_and_ended_before_the_error_event():
    """Past ``HELD_EVENT_BYTES`` an unfinished event is relayed as it arrives; cut there, it is
    ended (a blank line) first, so that the error event after it is still an event of its own."""
    from kvtier.router.relay import HELD_EVENT_BYTES

    async def main():
        long = b'data: {"choices": [{"text": "' + b"x" * (HELD_EVENT_BYTES + 1000)
        w = Worker([FIRST, long])
        router, runner, url = await _serving(w)
        try:
            raw = await _raw(url)
            assert long in raw, len(raw)
            events = _events(raw)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable_error"
            assert len(events) == 4 and events[1].startswith('{"choices": [{"text": "xxx'), events[1][:40]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_stream_whose_events_arrive_in_pieces_is_relayed_byte_for_byte():
    """Control: events split anywhere across the worker's writes (``\\r\\n`` line ends too), and a
    stream its worker ends mid-event, reach the client exactly as the worker sent them."""
    async def main():
        stream = (FIRST + b'data: {"choices": [{"text": "1"}]}\r\n\r\n' + b": comment\n\n"
                  + b'data: {"choices": [{"text": "2"}]}\n\n' + b"data: [DONE]\n\n" + b'data: {"left": "op')
        pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]
        w = Worker(pieces, end="done", gap_s=0.001)
        router, runner, url = await _serving(w)
        try:
            assert await _raw(url) == stream
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def _anthropic_event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


ANTHROPIC_START = [
    _anthropic_event("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}}),
    _anthropic_event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}),
    _anthropic_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": "Hel"}}),
]
MESSAGES_BODY = {"model": "tiny", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _anthropic_error_end(raw: bytes) -> dict:
    """The stream ends with vLLM's named Anthropic error event, and no ``[DONE]``: its error."""
    assert b"[DONE]" not in raw, raw[-300:]
    last = raw.decode().split("\n\n")[-2]
    name, data = last.split("\n")
    assert name == "event: error" and raw.endswith(b"\n\n"), raw[-300:]
    event = json.loads(data[len("data: "):])
    assert event["type"] == "error", event
    return event["error"]


def test_the_anthropic_sdk_is_told_when_the_worker_of_its_stream_dies():
    """Before: the OpenAI form (``data: {"error"}`` + ``[DONE]``, no event name), which the
    Anthropic SDK ignores: its stream ended quietly, a truncated answer taken as whole."""
    async def main():
        w = Worker(ANTHROPIC_START + [b"event: content_block_delta\ndata: {\"ty"])
        router, runner, url = await _serving(w)
        try:
            client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
            seen = []
            with pytest.raises(anthropic.APIError, match="after the answer had started"):
                stream = await client.messages.create(**MESSAGES_BODY)
                async for event in stream:
                    seen.append(event.type)
            assert seen == ["message_start", "content_block_start", "content_block_delta"]
            error = _anthropic_error_end(await _raw(url, "/v1/messages", MESSAGES_BODY))
            assert error["type"] == "api_error" and w.url in error["message"], error
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_shutdown_ends_an_anthropic_stream_with_the_anthropic_error_event():
    async def main():
        w = Worker(ANTHROPIC_START, end="stall")
        router, runner, url = await _serving(w, drain_timeout_s=0.3)
        try:
            answer = asyncio.ensure_future(_raw(url, "/v1/messages", MESSAGES_BODY))
            await asyncio.sleep(0.5)
            await runner.cleanup()
            raw = await answer
            assert raw.startswith(b"".join(ANTHROPIC_START)), raw[:300]
            error = _anthropic_error_end(raw)
            assert error["type"] == "overloaded_error" and "shutting down" in error["message"], error
        finally:
            await w.stop()
    run(main())
