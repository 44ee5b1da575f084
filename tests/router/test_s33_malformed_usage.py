"""A worker's answer whose usage is no count of tokens (a string, an object, a negative number,
a bool, an integer past a float's range) is relayed as it came, once, and counted as no usage: it
never turns into a logged "router error", an internal error counted and a 500 written after the
answer (audit s33 a5 D1). Real ``Router`` app over real sockets, a stand-in worker."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession, web

from kvtier.router.requests import cached_tokens
from tests.router.test_http import StandIn, run, start_router


@pytest.mark.parametrize("usage, got", [
    ({"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}, (4, 8)),
    ({"prompt_tokens": None, "prompt_tokens_details": {"cached_tokens": 4}}, (4, 0)),
    ({"prompt_tokens": "n/a", "prompt_tokens_details": {"cached_tokens": 3}}, None),
    ({"prompt_tokens": {"x": 1}, "prompt_tokens_details": {"cached_tokens": 3}}, None),
    ({"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": -1}}, None),
    ({"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": True}}, None),
    ({"prompt_tokens": 4.0, "prompt_tokens_details": {"cached_tokens": 2}}, None),
    ({"input_tokens": 4, "cache_read_input_tokens": 12}, (12, 16)),
    ({"input_tokens": 4, "cache_read_input_tokens": 12, "cache_creation_input_tokens": 2}, (12, 18)),
    ({"input_tokens": "4", "cache_read_input_tokens": 12}, None),
    ({"input_tokens": 4, "cache_read_input_tokens": -12}, None),
    ({"input_tokens": 4, "cache_read_input_tokens": 12, "cache_creation_input_tokens": False}, None),
])
def test_usage_is_read_only_as_counts_of_tokens(usage, got):
    assert cached_tokens(usage) == got


class OddUsage(StandIn):
    """A backend that reports usage as it pleases."""

    usage: dict = {}

    async def complete(self, request):
        await request.read()
        self.requests += 1
        return web.json_response({"id": "cmpl-1", "choices": [{"text": "hi"}], "usage": self.usage})


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": "n/a", "prompt_tokens_details": {"cached_tokens": 3}},
    {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": -1}},
    {"prompt_tokens": 10 ** 401, "prompt_tokens_details": {"cached_tokens": 10 ** 400}},   # a float's overflow
])
def test_an_answer_with_odd_usage_is_relayed_once_and_no_router_error(usage):
    async def main():
        w = OddUsage("w0")
        w.usage = usage
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                    assert r.status == 200 and (await r.json())["choices"] == [{"text": "hi"}]
                # the same connection serves the next request (no second answer written on it)
                async with s.post(url + "/v1/completions", json={"prompt": "a b c d"}) as r:
                    assert r.status == 200
            assert router.metrics.errors.labels("internal")._value.get() == 0
            assert router.metrics.usage_answers.labels(w.url)._value.get() == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
